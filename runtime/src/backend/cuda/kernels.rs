//! The kernel table: every entry point of the embedded modules, resolved once at start.

use super::device::{Device, Kernel, Module};
use crate::error::{Result, RuntimeError};

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}

/// Whether this build embeds compiled kernels (nvcc was found at build time).
pub fn embedded() -> bool {
    !embedded::MODULES.is_empty()
}

/// Matvec variants: rows per block 1, 2, 4, and the element-wise fallback for column counts
/// that are not a multiple of the 16-byte chunk.
pub(crate) struct MatvecKernels {
    pub group: [Kernel; 3],
    pub group_scalar: Kernel,
    pub swiglu: [Kernel; 3],
    pub swiglu_scalar: Kernel,
    /// The same with the RMSNorm of x fused in.
    pub group_norm: [Kernel; 3],
    pub group_norm_scalar: Kernel,
    pub swiglu_norm: [Kernel; 3],
    pub swiglu_norm_scalar: Kernel,
}

/// Attention variants per dims-per-lane (2, 4, 8 → head_dim up to 64, 128, 256).
pub(crate) struct AttentionKernels {
    pub decode: [Kernel; 3],
    /// Decode with one query head per block (short context).
    pub decode_single: [Kernel; 3],
    pub prefill: [Kernel; 3],
}

/// Code widths of the file-layout kernels, in the order of [`GroupKernels`]' tables.
pub(crate) const GROUP_BITS: [u8; 5] = [2, 3, 4, 6, 8];

/// Group-quantized weights per code width ([`GROUP_BITS`]): the decode matvecs by rows per
/// thread, the f32 dequantization for prefill GEMMs, and the embedding row gather.
pub(crate) struct GroupKernels {
    /// `[refined][width][R: 1, 2, 4]`: up to three projections of one x. `[1]` are the `_rf`
    /// entries, which apply a decode row's refinement or fetch lag's contributions; `[0]`
    /// leave that code out (the unrefined kernels' registers and occupancy).
    pub matvec: [[[Kernel; 3]; 5]; 2],
    /// The same with the input RMSNorm fused.
    pub matvec_norm: [[[Kernel; 3]; 5]; 2],
    /// `[refined][width][R: 1, 2]`: gate and up with SwiGLU, R row pairs per thread.
    pub swiglu: [[[Kernel; 2]; 5]; 2],
    pub swiglu_norm: [[[Kernel; 2]; 5]; 2],
    /// `[width]`: the f32 panel prefill's GEMM reads.
    pub dequant_f32: [Kernel; 5],
    /// `[width]`: rows of the table by token id (a tied embedding of coded head).
    pub gather_f32: [Kernel; 5],
    /// The tensor-core kernels over the tile layout (group_mma.cu), by [`TILE_BITS`].
    pub tile: TileKernels,
}

/// Code widths of the tensor-core tile layout, in the order of [`TileKernels`]' tables.
pub(crate) const TILE_BITS: [u8; 3] = [2, 3, 4];

/// Group codes in the tensor-core tile layout (2, 3 and 4 bits, sm_80+): matvecs by `[width]
/// [tiles per block 1, 2, 4 (SwiGLU 1, 2) × ring slots per warp 3, 4]`, the packing from the
/// file layout, and the prefill panel.
pub(crate) struct TileKernels {
    /// `[refined][width][plan]`: plans `_r{1,2,4}_s{3,4}`, `_r1_s3_w16`
    /// (TilePlan::kernel_index); `[1]` the `_rf` entries, as [`GroupKernels::matvec`].
    pub matvec: [[[Kernel; 7]; 3]; 2],
    pub matvec_norm: [[[Kernel; 7]; 3]; 2],
    /// `_r{1,2}_s{3,4}`, `_r1_s3_w16`.
    pub swiglu: [[[Kernel; 5]; 3]; 2],
    pub swiglu_norm: [[[Kernel; 5]; 3]; 2],
    /// `[width]`: rows of the table by token id.
    pub gather_f32: [Kernel; 3],
    pub pack_codes: [Kernel; 3],
    pub pack_scales: Kernel,
    pub dequant_f32: [Kernel; 3],
}

/// Trellis-coded weights (trellis.cu): matvecs by `[code: HYB, 1MAD, 3INST][K − 2][order:
/// row-major, mma][tile rows per group − 1]`, the prefill GEMMs by `[code][K − 2][order]
/// [tokens per block: 64, 128]`,
/// the input transform by `[norm fused][order]`, the output transforms, and the prefill
/// transforms (one block per token) by `[order]` and alone.
pub(crate) struct TrellisKernels {
    pub matvec: [[[[Kernel; 2]; 2]; 3]; 3],
    pub gemm: [[[[Kernel; 2]; 2]; 3]; 3],
    pub prepare: [[Kernel; 2]; 2],
    /// `[refined]`: `[1]` the `_rf` entries, as [`GroupKernels::matvec`].
    pub finish: [Kernel; 2],
    pub finish_swiglu: [Kernel; 2],
    pub prepare_tokens: [Kernel; 2],
    pub finish_tokens: Kernel,
}

/// The entry names of coded.cu's formats, in [`super::coded::CODED_FORMATS`]' order.
macro_rules! coded_names {
    ($prefix:literal, $suffix:literal) => {
        [
            concat!($prefix, "lut2", $suffix),
            concat!($prefix, "lut3", $suffix),
            concat!($prefix, "lut4", $suffix),
            concat!($prefix, "q4_0", $suffix),
            concat!($prefix, "q4_1", $suffix),
            concat!($prefix, "q5_0", $suffix),
            concat!($prefix, "q5_1", $suffix),
            concat!($prefix, "q8_0", $suffix),
            concat!($prefix, "q2_k", $suffix),
            concat!($prefix, "q3_k", $suffix),
            concat!($prefix, "q4_k", $suffix),
            concat!($prefix, "q5_k", $suffix),
            concat!($prefix, "q6_k", $suffix),
        ]
    };
}

/// Look-up-table codes and GGUF blocks (coded.cu), by format ([`super::coded::CODED_FORMATS`]):
/// matvecs by `[format][R − 1]` (R rows per thread: 1, 2), SwiGLU (one row pair per thread),
/// the f32 prefill panel and the embedding row gather.
pub(crate) struct CodedKernels {
    pub matvec: Vec<[Kernel; 2]>,
    pub matvec_norm: Vec<[Kernel; 2]>,
    pub swiglu: Vec<Kernel>,
    pub swiglu_norm: Vec<Kernel>,
    pub dequant_f32: Vec<Kernel>,
    pub gather_f32: Vec<Kernel>,
}

pub(crate) struct Kernels {
    pub embedding_bf16: Kernel,
    pub embedding_f32: Kernel,
    pub rms_norm: Kernel,
    pub rope: Kernel,
    pub rope_qk: Kernel,
    pub write_kv_f32: Kernel,
    pub write_kv_f16: Kernel,
    pub silu_mul: Kernel,
    pub add_assign: Kernel,
    pub add_bias_rows: Kernel,
    pub f32_to_bf16: Kernel,
    pub argmax_partial: Kernel,
    pub argmax_final: Kernel,
    pub fill_random_bf16: Kernel,
    pub fill_random_f32: Kernel,
    pub add_nibble_units: Kernel,
    pub matvec_bf16: MatvecKernels,
    pub matvec_f32: MatvecKernels,
    pub attn_f32: AttentionKernels,
    pub attn_f16: AttentionKernels,
    /// Tensor-core prefill attention over f16 caches, head_dim 64 and 128 (sm_80+).
    pub prefill_mma_f16: [Kernel; 2],
    pub gemm_bf16: Kernel,
    pub gemm_f32: Kernel,
    pub group: GroupKernels,
    pub trellis: TrellisKernels,
    pub coded: CodedKernels,
    /// KVarN decode attention and the code frame's rotation (kvarn.cu).
    pub kvarn_attn_decode_g4: Kernel,
    pub kvarn_attn_decode_g8: Kernel,
    pub kvarn_attn_decode_g4_w: Kernel,
    pub kvarn_attn_decode_g8_w: Kernel,
    pub kvarn_attn_merge: Kernel,
    pub kvarn_decode_rows: Kernel,
    pub kvarn_refine_score: Kernel,
    pub kvarn_refine_correct: Kernel,
    pub kvarn_hadamard_rows: Kernel,
    /// Weight refinement (refine.cu): the channel selection and the column gather.
    pub refine_select: Kernel,
    pub refine_columns: Kernel,
    /// Fetch lead: selected columns staged in device memory, and the real input's values.
    pub refine_stage_units: Kernel,
    pub refine_gather_values: Kernel,
}

impl Kernels {
    pub fn load(device: &Device) -> Result<Self> {
        if !embedded() {
            return Err(RuntimeError::Unsupported(
                "this binary was built without CUDA kernels (nvcc was not found at build time); \
                 rebuild after `bash scripts/fetch_cuda_tools.sh` (or with SFX_NVCC=/path/to/nvcc)"
                    .into(),
            ));
        }
        let mut modules = Vec::new();
        for (name, image) in embedded::MODULES {
            modules.push(device.load_module(name, image)?);
        }
        let find = |m: &str| -> Result<&Module> {
            embedded::MODULES
                .iter()
                .position(|(n, _)| *n == m)
                .map(|i| &modules[i])
                .ok_or_else(|| RuntimeError::Unsupported(format!("kernel module {m} missing")))
        };
        let ew = find("elementwise")?;
        let mv = find("matvec")?;
        let at = find("attention")?;
        let gm = find("gemm")?;
        let am = find("attention_mma")?;
        let gq = find("group")?;
        let gt = find("group_mma")?;
        let tr = find("trellis")?;
        let kv = find("kvarn")?;
        let rf = find("refine")?;
        let cd = find("coded")?;
        let coded = |names: [&'static str; 13]| -> Result<Vec<Kernel>> {
            names.into_iter().map(|n| cd.function(n)).collect()
        };
        let coded_rows = |r1: [&'static str; 13], r2: [&'static str; 13]| {
            Ok::<_, RuntimeError>(
                coded(r1)?
                    .into_iter()
                    .zip(coded(r2)?)
                    .map(|(a, b)| [a, b])
                    .collect::<Vec<_>>(),
            )
        };
        // Trellis entry points: tr_matvec_{code}_k{K}_{rm|mma}_r{1|2} and
        // tr_gemm_{code}_k{K}_{rm|mma}_t{64|128}, as [K − 2][order][variant].
        macro_rules! tr_orders {
            ($prefix:literal, $code:literal, $k:literal, $v1:literal, $v2:literal) => {
                [
                    [
                        tr.function(concat!($prefix, $code, "_k", $k, "_rm_", $v1))?,
                        tr.function(concat!($prefix, $code, "_k", $k, "_rm_", $v2))?,
                    ],
                    [
                        tr.function(concat!($prefix, $code, "_k", $k, "_mma_", $v1))?,
                        tr.function(concat!($prefix, $code, "_k", $k, "_mma_", $v2))?,
                    ],
                ]
            };
        }
        macro_rules! tr_widths {
            ($prefix:literal, $code:literal, $v1:literal, $v2:literal) => {
                [
                    tr_orders!($prefix, $code, "2", $v1, $v2),
                    tr_orders!($prefix, $code, "3", $v1, $v2),
                    tr_orders!($prefix, $code, "4", $v1, $v2),
                ]
            };
        }
        macro_rules! tr_matvec {
            ($code:literal) => {
                tr_widths!("tr_matvec_", $code, "r1", "r2")
            };
        }
        macro_rules! tr_gemm {
            ($code:literal) => {
                tr_widths!("tr_gemm_", $code, "t64", "t128")
            };
        }
        // Group-code entry points are named by bits and rows per thread (kernels/group.cu).
        // `[plain, _rf]` pairs: the `_rf` entries apply a refinement (kernels/group.cu).
        macro_rules! gt_family {
            ($prefix:literal, [$($r:literal),+]) => {
                [
                    [
                        [$(gt.function(concat!($prefix, "_b2_r", $r))?),+],
                        [$(gt.function(concat!($prefix, "_b3_r", $r))?),+],
                        [$(gt.function(concat!($prefix, "_b4_r", $r))?),+],
                    ],
                    [
                        [$(gt.function(concat!($prefix, "_rf_b2_r", $r))?),+],
                        [$(gt.function(concat!($prefix, "_rf_b3_r", $r))?),+],
                        [$(gt.function(concat!($prefix, "_rf_b4_r", $r))?),+],
                    ],
                ]
            };
        }
        macro_rules! gq_widths {
            ($prefix:expr, [$($r:literal),+]) => {
                [
                    [$(gq.function(concat!($prefix, "_b2_r", $r))?),+],
                    [$(gq.function(concat!($prefix, "_b3_r", $r))?),+],
                    [$(gq.function(concat!($prefix, "_b4_r", $r))?),+],
                    [$(gq.function(concat!($prefix, "_b6_r", $r))?),+],
                    [$(gq.function(concat!($prefix, "_b8_r", $r))?),+],
                ]
            };
        }
        macro_rules! gq_family {
            ($prefix:literal, [$($r:literal),+]) => {
                [
                    gq_widths!($prefix, [$($r),+]),
                    gq_widths!(concat!($prefix, "_rf"), [$($r),+]),
                ]
            };
        }
        let matvec = |names: [&'static str; 16]| -> Result<MatvecKernels> {
            let f = |i: usize| mv.function(names[i]);
            Ok(MatvecKernels {
                group: [f(0)?, f(1)?, f(2)?],
                group_scalar: f(3)?,
                swiglu: [f(4)?, f(5)?, f(6)?],
                swiglu_scalar: f(7)?,
                group_norm: [f(8)?, f(9)?, f(10)?],
                group_norm_scalar: f(11)?,
                swiglu_norm: [f(12)?, f(13)?, f(14)?],
                swiglu_norm_scalar: f(15)?,
            })
        };
        let attention = |names: [&'static str; 9]| -> Result<AttentionKernels> {
            let f = |i: usize| at.function(names[i]);
            Ok(AttentionKernels {
                decode: [f(0)?, f(1)?, f(2)?],
                decode_single: [f(3)?, f(4)?, f(5)?],
                prefill: [f(6)?, f(7)?, f(8)?],
            })
        };
        let k = Self {
            embedding_bf16: ew.function("embedding_bf16")?,
            embedding_f32: ew.function("embedding_f32")?,
            rms_norm: ew.function("rms_norm")?,
            rope: ew.function("rope")?,
            rope_qk: ew.function("rope_qk")?,
            write_kv_f32: ew.function("write_kv_f32")?,
            write_kv_f16: ew.function("write_kv_f16")?,
            silu_mul: ew.function("silu_mul")?,
            add_assign: ew.function("add_assign")?,
            add_bias_rows: ew.function("add_bias_rows")?,
            f32_to_bf16: ew.function("f32_to_bf16")?,
            argmax_partial: ew.function("argmax_partial")?,
            argmax_final: ew.function("argmax_final")?,
            fill_random_bf16: ew.function("fill_random_bf16")?,
            fill_random_f32: ew.function("fill_random_f32")?,
            add_nibble_units: ew.function("add_nibble_units")?,
            matvec_bf16: matvec([
                "matvec_group_bf16_r1",
                "matvec_group_bf16_r2",
                "matvec_group_bf16_r4",
                "matvec_group_bf16_scalar",
                "matvec_swiglu_bf16_r1",
                "matvec_swiglu_bf16_r2",
                "matvec_swiglu_bf16_r4",
                "matvec_swiglu_bf16_scalar",
                "matvec_group_norm_bf16_r1",
                "matvec_group_norm_bf16_r2",
                "matvec_group_norm_bf16_r4",
                "matvec_group_norm_bf16_scalar",
                "matvec_swiglu_norm_bf16_r1",
                "matvec_swiglu_norm_bf16_r2",
                "matvec_swiglu_norm_bf16_r4",
                "matvec_swiglu_norm_bf16_scalar",
            ])?,
            matvec_f32: matvec([
                "matvec_group_f32_r1",
                "matvec_group_f32_r2",
                "matvec_group_f32_r4",
                "matvec_group_f32_scalar",
                "matvec_swiglu_f32_r1",
                "matvec_swiglu_f32_r2",
                "matvec_swiglu_f32_r4",
                "matvec_swiglu_f32_scalar",
                "matvec_group_norm_f32_r1",
                "matvec_group_norm_f32_r2",
                "matvec_group_norm_f32_r4",
                "matvec_group_norm_f32_scalar",
                "matvec_swiglu_norm_f32_r1",
                "matvec_swiglu_norm_f32_r2",
                "matvec_swiglu_norm_f32_r4",
                "matvec_swiglu_norm_f32_scalar",
            ])?,
            attn_f32: attention([
                "attn_decode_f32_d2",
                "attn_decode_f32_d4",
                "attn_decode_f32_d8",
                "attn_decode1_f32_d2",
                "attn_decode1_f32_d4",
                "attn_decode1_f32_d8",
                "attn_prefill_f32_d2",
                "attn_prefill_f32_d4",
                "attn_prefill_f32_d8",
            ])?,
            attn_f16: attention([
                "attn_decode_f16_d2",
                "attn_decode_f16_d4",
                "attn_decode_f16_d8",
                "attn_decode1_f16_d2",
                "attn_decode1_f16_d4",
                "attn_decode1_f16_d8",
                "attn_prefill_f16_d2",
                "attn_prefill_f16_d4",
                "attn_prefill_f16_d8",
            ])?,
            prefill_mma_f16: [
                am.function("attn_prefill_mma_f16_d64")?,
                am.function("attn_prefill_mma_f16_d128")?,
            ],
            gemm_bf16: gm.function("gemm_xwt_bf16")?,
            gemm_f32: gm.function("gemm_xwt_f32")?,
            group: GroupKernels {
                matvec: gq_family!("gq_matvec", ["1", "2", "4"]),
                matvec_norm: gq_family!("gq_matvec_norm", ["1", "2", "4"]),
                swiglu: gq_family!("gq_swiglu", ["1", "2"]),
                swiglu_norm: gq_family!("gq_swiglu_norm", ["1", "2"]),
                dequant_f32: [
                    gq.function("group_dequant_f32_b2")?,
                    gq.function("group_dequant_f32_b3")?,
                    gq.function("group_dequant_f32_b4")?,
                    gq.function("group_dequant_f32_b6")?,
                    gq.function("group_dequant_f32_b8")?,
                ],
                gather_f32: [
                    gq.function("group_gather_f32_b2")?,
                    gq.function("group_gather_f32_b3")?,
                    gq.function("group_gather_f32_b4")?,
                    gq.function("group_gather_f32_b6")?,
                    gq.function("group_gather_f32_b8")?,
                ],
                tile: TileKernels {
                    matvec: gt_family!(
                        "gt_matvec",
                        ["1_s3", "1_s4", "2_s3", "2_s4", "4_s3", "4_s4", "1_s3_w16"]
                    ),
                    matvec_norm: gt_family!(
                        "gt_matvec_norm",
                        ["1_s3", "1_s4", "2_s3", "2_s4", "4_s3", "4_s4", "1_s3_w16"]
                    ),
                    swiglu: gt_family!("gt_swiglu", ["1_s3", "1_s4", "2_s3", "2_s4", "1_s3_w16"]),
                    swiglu_norm: gt_family!(
                        "gt_swiglu_norm",
                        ["1_s3", "1_s4", "2_s3", "2_s4", "1_s3_w16"]
                    ),
                    pack_codes: [
                        gt.function("gt_pack_codes_b2")?,
                        gt.function("gt_pack_codes_b3")?,
                        gt.function("gt_pack_codes_b4")?,
                    ],
                    pack_scales: gt.function("gt_pack_scales")?,
                    dequant_f32: [
                        gt.function("gt_dequant_f32_b2")?,
                        gt.function("gt_dequant_f32_b3")?,
                        gt.function("gt_dequant_f32_b4")?,
                    ],
                    gather_f32: [
                        gt.function("gt_gather_f32_b2")?,
                        gt.function("gt_gather_f32_b3")?,
                        gt.function("gt_gather_f32_b4")?,
                    ],
                },
            },
            trellis: TrellisKernels {
                matvec: [tr_matvec!("hyb"), tr_matvec!("1mad"), tr_matvec!("3inst")],
                gemm: [tr_gemm!("hyb"), tr_gemm!("1mad"), tr_gemm!("3inst")],
                prepare: [
                    [
                        tr.function("tr_prepare_rm")?,
                        tr.function("tr_prepare_mma")?,
                    ],
                    [
                        tr.function("tr_prepare_norm_rm")?,
                        tr.function("tr_prepare_norm_mma")?,
                    ],
                ],
                finish: [tr.function("tr_finish")?, tr.function("tr_finish_rf")?],
                finish_swiglu: [
                    tr.function("tr_finish_swiglu")?,
                    tr.function("tr_finish_swiglu_rf")?,
                ],
                prepare_tokens: [
                    tr.function("tr_prepare_tokens_rm")?,
                    tr.function("tr_prepare_tokens_mma")?,
                ],
                finish_tokens: tr.function("tr_finish_tokens")?,
            },
            coded: CodedKernels {
                matvec: coded_rows(
                    coded_names!("cd_matvec_", "_r1"),
                    coded_names!("cd_matvec_", "_r2"),
                )?,
                matvec_norm: coded_rows(
                    coded_names!("cd_matvec_norm_", "_r1"),
                    coded_names!("cd_matvec_norm_", "_r2"),
                )?,
                swiglu: coded(coded_names!("cd_swiglu_", ""))?,
                swiglu_norm: coded(coded_names!("cd_swiglu_norm_", ""))?,
                dequant_f32: coded(coded_names!("cd_dequant_f32_", ""))?,
                gather_f32: coded(coded_names!("cd_gather_f32_", ""))?,
            },
            kvarn_attn_decode_g4: kv.function("kvarn_attn_decode_g4")?,
            kvarn_attn_decode_g8: kv.function("kvarn_attn_decode_g8")?,
            kvarn_attn_decode_g4_w: kv.function("kvarn_attn_decode_g4_w")?,
            kvarn_attn_decode_g8_w: kv.function("kvarn_attn_decode_g8_w")?,
            kvarn_attn_merge: kv.function("kvarn_attn_merge")?,
            kvarn_decode_rows: kv.function("kvarn_decode_rows")?,
            kvarn_refine_score: kv.function("kvarn_refine_score")?,
            kvarn_refine_correct: kv.function("kvarn_refine_correct")?,
            kvarn_hadamard_rows: kv.function("kvarn_hadamard_rows")?,
            refine_select: rf.function("refine_select")?,
            refine_columns: rf.function("refine_columns")?,
            refine_stage_units: rf.function("refine_stage_units")?,
            refine_gather_values: rf.function("refine_gather_values")?,
        };
        // The KV scoring blocks keep their query heads' split weights in shared memory (past
        // 48 KB with eight query heads and many splits).
        k.kvarn_refine_score.allow_shared(device.smem_optin)?;
        // Attention stages key tiles in dynamic shared memory beyond the 48 KB default.
        for a in [&k.attn_f32, &k.attn_f16] {
            for f in a.decode.iter().chain(&a.decode_single).chain(&a.prefill) {
                f.allow_shared(device.smem_optin)?;
            }
        }
        // The tensor-core prefill's double-buffered tiles (69 KB at head 128), the group
        // matvec's staged x (up to ~50K columns), the trellis GEMM's two staged units (70 KB)
        // and the trellis prefill transforms' two copies of a vector exceed the 48 KB default
        // too.
        for f in k
            .prefill_mma_f16
            .iter()
            .chain(k.group.matvec.iter().flatten().flatten())
            .chain(k.group.matvec_norm.iter().flatten().flatten())
            .chain(k.group.swiglu.iter().flatten().flatten())
            .chain(k.group.swiglu_norm.iter().flatten().flatten())
            .chain(k.group.tile.matvec.iter().flatten().flatten())
            .chain(k.group.tile.matvec_norm.iter().flatten().flatten())
            .chain(k.group.tile.swiglu.iter().flatten().flatten())
            .chain(k.group.tile.swiglu_norm.iter().flatten().flatten())
            .chain(k.trellis.matvec.iter().flatten().flatten().flatten())
            .chain(k.trellis.gemm.iter().flatten().flatten().flatten())
            .chain(k.trellis.prepare.iter().flatten())
            .chain(k.trellis.finish.iter())
            .chain(k.trellis.finish_swiglu.iter())
            .chain(k.trellis.prepare_tokens.iter())
            .chain([&k.trellis.finish_tokens])
            .chain(k.coded.matvec.iter().flatten())
            .chain(k.coded.matvec_norm.iter().flatten())
            .chain(k.coded.swiglu.iter())
            .chain(k.coded.swiglu_norm.iter())
        {
            f.allow_shared(device.smem_optin)?;
        }
        // Modules stay loaded for the life of the process (kernels are plain handles).
        std::mem::forget(modules);
        Ok(k)
    }
}

#[cfg(test)]
mod coded_name_tests {
    #[test]
    fn entry_names_follow_the_format_table() {
        let names = coded_names!("cd_swiglu_", "");
        for (name, format) in names.iter().zip(super::super::coded::CODED_FORMATS) {
            assert_eq!(*name, format!("cd_swiglu_{format}"));
        }
    }
}

//! The backend conformance suite: every op of [`Backend`] on every backend, checked against
//! a reference with a stated normalised-error bound (llama.cpp's `test-backend-ops` is the
//! model). A device backend is compared with the CPU backend; the CPU backend with plain
//! f64 loops written here (so the reference itself is checked, and a CPU run is not a
//! comparison with itself).
//!
//! One table ([`cases`]) lists op × shape family with its bounds; adding an op means adding
//! its [`Op`] variant, one `execute` arm and one `naive` arm. Inputs are fresh random values
//! per run (seeded; the seed is printed so a failure can be replayed), outputs are poisoned
//! with NaN first so an element a kernel forgot to write fails the check.

use crate::backend::cpu::CpuBackend;
use crate::backend::{
    AttentionShape, Backend, GroupItem, KvDtype, KvLayout, KvarnLayer, KvarnLayerMut,
    KvarnRefineSpec, KvarnShape, KvarnSlot, MatmulOut, RopeTable, WeightPrecision,
};
use crate::error::{Result, RuntimeError};
use crate::kv::{KvBase, KvBits, Kvarn, RefineBits};
use crate::model::{rope_cos_sin, Model, ModelOptions};
use crate::resident::dequantize_trellis;
use crate::resident::trellis_linear::with_our_tables;
use crate::resident::ResidentKernels;
use crate::synthetic::SyntheticWeights;
use half::{bf16, f16};
use sfx_formats::gguf::{BlockTensor, GgmlType};
use sfx_formats::resident::{
    GroupQuantized, LutQuantized, Rotation, TileOrder, TrellisCode, TrellisQuantized,
    TrellisScheme, SUPPORTED_BITS,
};
use sfx_formats::{DType, TensorView};

/// One op with the shape it runs at.
#[derive(Debug, Clone)]
pub enum Op {
    Embedding {
        dtype: DType,
        vocab: usize,
        cols: usize,
        n: usize,
    },
    Matmul {
        dtype: DType,
        m: usize,
        rows: usize,
        cols: usize,
        bias: bool,
        acc: bool,
    },
    /// `norm`: the RMSNorm of x fused in (`rms_norm_matmul_group`).
    MatmulGroup {
        dtype: DType,
        m: usize,
        cols: usize,
        rows: [usize; 3],
        bias: bool,
        norm: bool,
    },
    Swiglu {
        dtype: DType,
        m: usize,
        rows: usize,
        cols: usize,
        norm: bool,
    },
    RmsNorm {
        rows: usize,
        cols: usize,
        in_place: bool,
    },
    Rope {
        n: usize,
        heads: usize,
        head_dim: usize,
        first: usize,
    },
    RopeQk {
        n: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        first: usize,
    },
    WriteKv {
        kv: KvDtype,
        n: usize,
        kv_heads: usize,
        head_dim: usize,
        first: usize,
    },
    Attention {
        kv: KvDtype,
        n: usize,
        past: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    },
    /// A decode step's attention block through [`Backend::rope_write_kv_attention`]: the
    /// queries and the new keys arrive before RoPE, the cache holds `past` earlier rows;
    /// `caches` compares the key and value stores after the step instead of the output.
    RopeAttention {
        kv: KvDtype,
        n: usize,
        past: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        caches: bool,
    },
    /// Decode attention of one token over a KVarN layer ([`Backend::kvarn_attention`]):
    /// per KV head `sinks` FP16 rows, `tiles` tiles encoded by the CPU encoder, `tail` FP16
    /// rows; the queries in the code frame (the op scales them).
    KvarnAttention(KvarnCase),
    /// One decode step of a KVarN layer ([`Backend::kvarn_decode`]): the case's fill is what
    /// the step at its position sees (the new row is the last sink, or the tail's last row);
    /// sink capacity `sinks`, a tail of one tile. Output: the attention output, then the key
    /// and value rows read back from the slot the position names.
    KvarnDecode(KvarnCase),
    /// [`Backend::hadamard_rows`]: `rows` rows of `n` values into the KVarN code frame.
    HadamardRows {
        rows: usize,
        n: usize,
    },
    SiluMul {
        len: usize,
    },
    AddAssign {
        len: usize,
    },
    Argmax {
        rows: usize,
        cols: usize,
    },
    CopyRows {
        rows: usize,
        row_len: usize,
        first: usize,
        n: usize,
    },
    ReadRows {
        rows: usize,
        row_len: usize,
        first: usize,
        n: usize,
    },
    NibbleUnits {
        row_len: usize,
        units: usize,
    },
    /// Channel selection S(x) of `rows` rows of `row_len` at `k` per 1024 (`ties`: few
    /// distinct magnitudes, zeros and a NaN, so the tie rule decides; `norm`: of the rows'
    /// RMSNorm); the indices compared.
    SelectChannels {
        rows: usize,
        row_len: usize,
        k: usize,
        ties: bool,
        norm: bool,
    },
    /// Column refinement of up to three projections (`outs`, 0 = absent) of one input (its
    /// RMSNorm with `norm`): the device's own selection, then the selected columns added from
    /// a host-memory byte store whose columns start `offset` bytes in.
    SelectedColumns {
        rows: usize,
        row_len: usize,
        k: usize,
        outs: [usize; 3],
        offset: usize,
        norm: bool,
    },
    /// Fetch lead's path (docs/method.md §3): channels selected from an earlier stream (its
    /// RMSNorm with `norm`), each projection's selected columns staged from a host-memory
    /// store into backend memory, the real input's values gathered at those channels, and the
    /// staged columns added through the identity index.
    LeadColumns {
        rows: usize,
        row_len: usize,
        k: usize,
        outs: [usize; 3],
        offset: usize,
        norm: bool,
    },
    Random {
        dtype: DType,
        rows: usize,
        cols: usize,
    },
    /// A coded projection (group codes: RTN / AWQ; trellis tiles: QTIP / YAQA) through the
    /// backend's [`ResidentKernels`]; `acc` runs `forward_add`.
    CodedLinear {
        format: Coded,
        m: usize,
        rows: usize,
        cols: usize,
        bias: bool,
        acc: bool,
    },
    /// Rows of a coded table by token id (a tied embedding of a quantized head, or of a GGUF
    /// file's blocks) through [`crate::linear::Linear::gather_rows`].
    CodedEmbedding {
        format: Coded,
        vocab: usize,
        cols: usize,
        n: usize,
    },
    /// Up to three coded projections of one input (q/k/v) as the graph runs them on the
    /// backend: fused launches (`norm`: the input RMSNorm folded in) where the backend's
    /// matrix type holds the codes, else the norm and one projection at a time.
    CodedProjections {
        format: Coded,
        m: usize,
        cols: usize,
        rows: [usize; 3],
        bias: bool,
        norm: bool,
    },
    /// Coded gate and up with SwiGLU (`norm`: the MLP's RMSNorm folded in), as the graph runs
    /// them on the backend.
    CodedSwiglu {
        format: Coded,
        m: usize,
        rows: usize,
        cols: usize,
        norm: bool,
    },
    /// Coded projections of one decode row with their refinement
    /// ([`crate::backend::refine::FusedColumns`]) as the graph hands it to them: q/k/v-like
    /// projections of one input, gate and up with SwiGLU, or one projection accumulating into
    /// its output (o, down). The channels are the reference's own selection of |x̂| (x̂ the
    /// normalised input with `norm`); the columns lie in host memory at their channels, or
    /// `staged` in backend memory in selection order (fetch lead).
    RefinedProjections {
        format: Coded,
        kind: RefinedKind,
        cols: usize,
        rows: [usize; 3],
        k: usize,
        staged: bool,
        norm: bool,
        bias: bool,
    },
    /// A synthetic model: prefill, then greedy-fed decode steps (step graphs as the backend
    /// does them, or off); every step's logits compared.
    Decode {
        preset: &'static str,
        /// Tokens of the first forward (logits of every one compared), then `steps` single
        /// tokens.
        prompt: usize,
        steps: usize,
        graphs: bool,
        weights: SyntheticWeights,
        /// Selective weight refinement from synthetic columns, in the backend.
        refine: Option<DecodeRefine>,
    },
}

/// How a [`Op::RefinedProjections`] case's projections run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefinedKind {
    /// Up to three projections of one input, each output stored (q/k/v).
    Group,
    /// Gate (`rows[0]`) and up (`rows[1]`) with SwiGLU, the refinements added before it.
    Swiglu,
    /// One projection (`rows[0]`) accumulated into its output (o, down).
    Accumulate,
}

/// A refined decode case: budget `k` per 1024 on every set, fetch lead/lag `s` per set.
#[derive(Debug, Clone, Copy)]
pub struct DecodeRefine {
    k: usize,
    s: [f32; 4],
}

/// The resident format of a coded case.
#[derive(Debug, Clone, Copy)]
pub enum Coded {
    /// Group codes (RTN / AWQ): `bits` per weight, scale and zero point per `group` columns.
    Group { bits: u8, group: usize },
    /// Trellis tiles (QTIP / YAQA) of `k` bits per weight, under `rotation`.
    Trellis {
        code: TrellisCode,
        k: u8,
        order: TileOrder,
        rotation: Rotation,
    },
    /// A llama.cpp GGUF weight in its own blocks (legacy 32-weight blocks or K-quants).
    Gguf { ty: GgmlType },
    /// Look-up-table codes (SqueezeLLM): `bits` per weight, a table of levels a row.
    Lut { bits: u8 },
}

impl Coded {
    /// The format in a family name, e.g. `q4g128` or `hyb-q9 K2 mma`.
    fn tag(&self) -> String {
        match *self {
            Coded::Group { bits, group } => format!("q{bits}g{group}"),
            Coded::Trellis {
                code,
                k,
                order,
                rotation: Rotation::Full,
            } => format!("{} K{k} {}", code.name(), order.name()),
            Coded::Trellis {
                code,
                k,
                order,
                rotation,
            } => format!(
                "{} K{k} {} rotation {}",
                code.name(),
                order.name(),
                rotation.name()
            ),
            Coded::Gguf { ty } => format!("gguf {ty}"),
            Coded::Lut { bits } => format!("lut{bits}"),
        }
    }
}

/// A row of the table.
#[derive(Debug, Clone)]
pub struct Case {
    pub op: &'static str,
    pub family: String,
    pub spec: Op,
    /// Bound on ‖out − ref‖ / ‖ref‖ for a device backend against the CPU backend.
    pub bound: f64,
    /// Bound for the CPU backend against the f64 reference.
    pub cpu_bound: f64,
}

/// What one case measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CaseResult {
    pub op: &'static str,
    pub family: String,
    pub backend: String,
    /// `cpu` or `f64`.
    pub reference: &'static str,
    pub error: f64,
    pub bound: f64,
    pub passed: bool,
    /// Output elements compared.
    pub elements: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
}

fn dt(d: DType) -> &'static str {
    match d {
        DType::BF16 => "bf16",
        DType::F32 => "f32",
        _ => "?",
    }
}

/// Every case of the suite. Shape families: decode (m = 1) and prefill rows, odd sizes that
/// take the kernels' element-wise paths, every GQA ratio of the Llama/Qwen families (1–8),
/// head sizes 64–256, long contexts, BF16/F32 weights and F32/F16 KV.
pub fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    let mut add = |op: &'static str, family: String, spec: Op, bound: f64, cpu_bound: f64| {
        v.push(Case {
            op,
            family,
            spec,
            bound,
            cpu_bound,
        })
    };
    for dtype in [DType::BF16, DType::F32] {
        add(
            "embedding",
            format!("{} 131×72 n7", dt(dtype)),
            Op::Embedding {
                dtype,
                vocab: 131,
                cols: 72,
                n: 7,
            },
            0.0,
            0.0,
        );
        add(
            "embedding",
            format!("{} 49152×576 n1", dt(dtype)),
            Op::Embedding {
                dtype,
                vocab: 49152,
                cols: 576,
                n: 1,
            },
            0.0,
            0.0,
        );
        add(
            "random_matrix",
            format!("{} 300×77", dt(dtype)),
            Op::Random {
                dtype,
                rows: 300,
                cols: 77,
            },
            0.0,
            0.0,
        );
        // Matvec (m ≤ 4) and GEMM (m > 4) shapes; the GEMM on a device rounds activations to
        // BF16 for the tensor cores (relative error ~2⁻⁹ per element).
        let gemm_bound = if dtype == DType::BF16 { 4e-3 } else { 1e-5 };
        // m ≤ 4 runs the matvec kernels, larger m the GEMM.
        for (m, rows, cols, bias, acc) in [
            (1, 1536, 576, false, false),
            (1, 4096, 4096, false, true),
            (1, 1024, 4096, true, false),
            (1, 37, 53, true, false),
            (2, 576, 1536, false, true),
            (3, 129, 511, false, false),
            (4, 200, 72, true, true),
            (5, 64, 72, false, false),
            (17, 96, 256, true, false),
            (64, 1536, 576, false, true),
            (130, 77, 129, true, true),
        ] {
            add(
                "matmul_t",
                format!(
                    "{} m{m} {rows}×{cols}{}{}",
                    dt(dtype),
                    if bias { " +bias" } else { "" },
                    if acc { " +=" } else { "" }
                ),
                Op::Matmul {
                    dtype,
                    m,
                    rows,
                    cols,
                    bias,
                    acc,
                },
                if m <= 4 { 1e-5 } else { gemm_bound },
                1e-5,
            );
        }
        for norm in [false, true] {
            let op = if norm {
                "rms_norm_matmul_group"
            } else {
                "matmul_t_group"
            };
            for (m, cols, rows, bias, bound) in [
                (1, 576, [576, 192, 192], false, 1e-5),
                (1, 4096, [4096, 1024, 1024], true, 1e-5),
                (3, 75, [33, 9, 9], true, 1e-5),
                (2, 4096, [128_256, 0, 0], false, 1e-5),
                (9, 256, [256, 64, 64], false, gemm_bound),
            ] {
                let rows = if rows[1] == 0 { [rows[0], 8, 8] } else { rows };
                add(
                    op,
                    format!(
                        "{} m{m} {cols}→{},{},{}{}",
                        dt(dtype),
                        rows[0],
                        rows[1],
                        rows[2],
                        if bias { " +bias" } else { "" }
                    ),
                    Op::MatmulGroup {
                        dtype,
                        m,
                        cols,
                        rows,
                        bias,
                        norm,
                    },
                    bound,
                    1e-5,
                );
            }
            let op = if norm {
                "rms_norm_swiglu"
            } else {
                "matmul_t_swiglu"
            };
            for (m, rows, cols, bound) in [
                (1, 1536, 576, 1e-5),
                (1, 14336, 4096, 1e-5),
                (2, 133, 75, 1e-5),
                (9, 200, 64, gemm_bound),
            ] {
                add(
                    op,
                    format!("{} m{m} {cols}→{rows}", dt(dtype)),
                    Op::Swiglu {
                        dtype,
                        m,
                        rows,
                        cols,
                        norm,
                    },
                    bound,
                    1e-5,
                );
            }
        }
    }
    for (rows, cols, in_place) in [
        (1, 576, false),
        (7, 4096, false),
        (512, 37, false),
        (3, 14336, false),
        (96, 128, true),
        (5, 64, true),
    ] {
        add(
            if in_place {
                "rms_norm_in_place"
            } else {
                "rms_norm"
            },
            format!("{rows}×{cols}"),
            Op::RmsNorm {
                rows,
                cols,
                in_place,
            },
            2e-6,
            2e-6,
        );
    }
    for (n, heads, head_dim, first) in [
        (1, 32, 128, 0),
        (1, 9, 64, 4095),
        (37, 3, 64, 1000),
        (5, 8, 128, 32_000),
        (2, 4, 24, 131_000),
        (1, 2, 256, 70),
    ] {
        add(
            "rope",
            format!("n{n} {heads}×{head_dim} @{first}"),
            Op::Rope {
                n,
                heads,
                head_dim,
                first,
            },
            1e-6,
            1e-6,
        );
    }
    for (n, heads, kv_heads, head_dim, first) in [(1, 32, 8, 128, 77), (19, 9, 3, 64, 500)] {
        add(
            "rope_qk",
            format!("n{n} {heads}+{kv_heads}×{head_dim} @{first}"),
            Op::RopeQk {
                n,
                heads,
                kv_heads,
                head_dim,
                first,
            },
            1e-6,
            1e-6,
        );
    }
    for kv in [KvDtype::F32, KvDtype::F16] {
        add(
            "write_kv",
            format!("{} n1 8×128 @700", kv.as_str()),
            Op::WriteKv {
                kv,
                n: 1,
                kv_heads: 8,
                head_dim: 128,
                first: 700,
            },
            0.0,
            0.0,
        );
        add(
            "write_kv",
            format!("{} n33 3×64 @0", kv.as_str()),
            Op::WriteKv {
                kv,
                n: 33,
                kv_heads: 3,
                head_dim: 64,
                first: 0,
            },
            0.0,
            0.0,
        );
        // Decode (n ≤ 4: split-K) over every GQA ratio and head size, short and long
        // contexts; then prefill chunks (flash-style), first chunks and later chunks over
        // earlier positions.
        let decode = [
            (1, 0, 32, 8, 128),
            (1, 5, 9, 3, 64),
            (1, 777, 32, 32, 128),
            (1, 1000, 28, 4, 128),
            (1, 1500, 12, 2, 128),
            (1, 2047, 14, 2, 64),
            (1, 3000, 16, 2, 128),
            (1, 4095, 40, 8, 128),
            (1, 600, 8, 1, 80),
            (1, 300, 16, 8, 256),
            (3, 130, 32, 8, 128),
            (1, 33_000, 32, 8, 128),
        ];
        let prefill = [
            (16, 0, 9, 3, 64),
            (61, 0, 32, 8, 128),
            (100, 300, 14, 2, 64),
            (512, 0, 8, 8, 128),
            (40, 2000, 12, 2, 128),
            (23, 100, 16, 8, 256),
            (9, 4096, 24, 8, 128),
            (200, 1000, 8, 2, 128),
            (130, 70, 6, 3, 64),
        ];
        let schedules = decode
            .iter()
            .map(|s| ("decode", s))
            .chain(prefill.iter().map(|s| ("prefill", s)));
        for (kind, &(n, past, heads, kv_heads, head_dim)) in schedules {
            // Prefill over an f16 cache runs on tensor cores where the head size has a
            // kernel (64, 128): Q and the probabilities are rounded to f16 (relative
            // 2^-11 each), the products accumulate in f32.
            let tensor_cores =
                kind == "prefill" && kv == KvDtype::F16 && matches!(head_dim, 64 | 128);
            add(
                "attention",
                format!(
                    "{} {kind} n{n} past {past} {heads}/{kv_heads}×{head_dim}",
                    kv.as_str()
                ),
                Op::Attention {
                    kv,
                    n,
                    past,
                    heads,
                    kv_heads,
                    head_dim,
                },
                if tensor_cores { 2e-3 } else { 2e-5 },
                2e-5,
            );
        }
        // The fused decode block: short context (one-head blocks), long context (GQA groups),
        // several queries, head sizes 64–256, and a new row that lands in a later split.
        for (n, past, heads, kv_heads, head_dim) in [
            (1, 0, 32, 8, 128),
            (1, 70, 9, 3, 64),
            (1, 1500, 32, 8, 128),
            (3, 130, 32, 8, 128),
            (4, 2046, 14, 2, 64),
            (1, 300, 16, 8, 256),
        ] {
            for caches in [false, true] {
                let what = if caches { "caches" } else { "output" };
                add(
                    "rope_attention",
                    format!(
                        "{} {what} n{n} past {past} {heads}/{kv_heads}×{head_dim}",
                        kv.as_str()
                    ),
                    Op::RopeAttention {
                        kv,
                        n,
                        past,
                        heads,
                        kv_heads,
                        head_dim,
                        caches,
                    },
                    // The stores: RoPE rounded as the CPU rounds it, then the cache's rounding.
                    if caches { 1e-7 } else { 2e-5 },
                    if caches { 1e-6 } else { 2e-5 },
                );
            }
        }
    }
    // KVarN decode attention: every base the CPU cache offers, GQA ratios 1–8, head sizes 64
    // and 128, with and without sinks, tiles and tail, a sink run longer than one 128-row
    // chunk. The kernel dequantizes each element with one fused multiply-add and applies the
    // per-token (key) or per-channel (value) scale once per tile, so it differs from the CPU
    // by float rounding, summation order and exp.
    let attention_layers: &[(usize, usize, usize, usize, usize, usize)] = &[
        (9, 3, 64, 5, 2, 7),
        (32, 8, 128, 128, 3, 1),
        (14, 2, 64, 0, 1, 0),
        (28, 4, 128, 130, 0, 50),
        (8, 8, 64, 0, 4, 127),
        // Long layers: many blocks per KV head (split-K) and their merge.
        (32, 8, 128, 128, 40, 77),
        (8, 1, 128, 128, 30, 0),
    ];
    // A whole decode step from the position on the device: the new row as the last sink, the
    // tail's first and last rows, and mid-tail over many tiles.
    let decode_layers: &[(usize, usize, usize, usize, usize, usize)] = &[
        (9, 3, 64, 5, 0, 0),
        (9, 3, 64, 128, 0, 1),
        (32, 8, 128, 128, 2, 128),
        (32, 8, 128, 128, 40, 70),
        (8, 1, 128, 16, 3, 9),
    ];
    let kvarn_ops = [
        (
            "kvarn_attention",
            &[(2, 2), (3, 2), (3, 3), (2, 1), (4, 4)][..],
            attention_layers,
            Op::KvarnAttention as fn(KvarnCase) -> Op,
        ),
        (
            "kvarn_decode",
            &[(2, 2), (3, 2), (2, 1)][..],
            decode_layers,
            Op::KvarnDecode,
        ),
    ];
    // One KVarN case, named by its bases, refinement and layer.
    type KvarnLayerCase = (usize, usize, usize, usize, usize, usize);
    let mut add_kvarn =
        |op: &'static str,
         make: fn(KvarnCase) -> Op,
         bits: KvBits,
         refine: Option<KvarnRefineSpec>,
         &(heads, kv_heads, head_dim, sinks, tiles, tail): &KvarnLayerCase| {
            let refined = refine.map_or(String::new(), |r| {
                format!(
                    "+{}/+{} g{} {} ",
                    r.bits.key,
                    r.bits.value,
                    r.group,
                    crate::kv::spec::fraction_label(r.fraction)
                )
            });
            add(
            op,
            format!(
                "{}/{} {refined}{heads}/{kv_heads}×{head_dim} sinks {sinks} tiles {tiles} tail {tail}",
                bits.key, bits.value
            ),
            make(KvarnCase {
                bits,
                heads,
                kv_heads,
                head_dim,
                sinks,
                tiles,
                tail,
                refine,
            }),
            2e-5,
            2e-5,
        );
        };
    for (op, bases, layers, make) in kvarn_ops {
        for &(key, value) in bases {
            for layer in layers {
                add_kvarn(op, make, KvBits { key, value }, None, layer);
            }
        }
    }
    // Eq. 7/8 refinement: the paper's +4/+4 bits in groups of 2 (selecting 1/8 and 1/128 of
    // the groups), values-only bits in groups of 4 over the 2/1 base, and a layer with no
    // tile yet (nothing eligible). The f64 reference selects from its exact weights and
    // attends with the selected tokens refined.
    let kb = |key, value| KvBits { key, value };
    let rb = |key, value| RefineBits { key, value };
    let refined: &[(KvBits, RefineBits, usize, f64)] = &[
        (kb(2, 2), rb(4, 4), 2, 1.0 / 8.0),
        (kb(2, 2), rb(4, 4), 2, 1.0 / 128.0),
        (kb(3, 2), rb(4, 4), 2, 1.0 / 8.0),
        (kb(2, 1), rb(0, 1), 4, 1.0 / 16.0),
    ];
    let refined_layers: &[KvarnLayerCase] = &[
        (9, 3, 64, 5, 2, 7),
        (32, 8, 128, 128, 40, 77),
        (8, 1, 128, 16, 3, 9),
        (28, 4, 128, 130, 0, 50),
        // More groups than one round of the selection's passes (8,192 score bits) and several
        // scoring blocks.
        (8, 1, 128, 16, 150, 9),
    ];
    for (op, make) in [
        ("kvarn_attention", Op::KvarnAttention as fn(KvarnCase) -> Op),
        ("kvarn_decode", Op::KvarnDecode),
    ] {
        for &(bits, rbits, group, fraction) in refined {
            let spec = KvarnRefineSpec {
                bits: rbits,
                group,
                fraction,
            };
            for layer in refined_layers {
                add_kvarn(op, make, bits, Some(spec), layer);
            }
        }
    }
    // The code frame's rotation: head sizes 64–256 over a decode step's heads, a prefill
    // chunk's rows, the longest row, and the trivial one. A device runs the CPU's operations
    // in the CPU's order, so it must match bit for bit.
    for (rows, n) in [
        (9, 64),
        (32, 128),
        (512 * 3, 64),
        (3, 256),
        (2, 1024),
        (4, 1),
    ] {
        add(
            "hadamard_rows",
            format!("{rows}×{n}"),
            Op::HadamardRows { rows, n },
            0.0,
            1e-6,
        );
    }
    for len in [1, 1000, 57_344] {
        add(
            "silu_mul",
            format!("{len}"),
            Op::SiluMul { len },
            1e-6,
            1e-6,
        );
        add(
            "add_assign",
            format!("{len}"),
            Op::AddAssign { len },
            0.0,
            0.0,
        );
    }
    for (rows, cols) in [(1, 49_152), (3, 128_256), (2, 7)] {
        add(
            "argmax_rows",
            format!("{rows}×{cols}"),
            Op::Argmax { rows, cols },
            0.0,
            0.0,
        );
    }
    add(
        "copy_rows",
        "9×576 rows 3..7".into(),
        Op::CopyRows {
            rows: 9,
            row_len: 576,
            first: 3,
            n: 4,
        },
        0.0,
        0.0,
    );
    add(
        "read_rows",
        "5×1536 row 4".into(),
        Op::ReadRows {
            rows: 5,
            row_len: 1536,
            first: 4,
            n: 1,
        },
        0.0,
        0.0,
    );
    for (row_len, units) in [(576, 9), (4096, 16), (1537, 3)] {
        add(
            "add_nibble_units",
            format!("{row_len} × {units} units"),
            Op::NibbleUnits { row_len, units },
            1e-6,
            1e-6,
        );
    }
    // Weight refinement: the selection exactly (budgets of short last chunks, every channel
    // selected, ties and a NaN), the column gather on the Llama-3.1-8B and SmolLM2 sets, in
    // prefill rows, and columns neither 8-byte sized nor aligned.
    for (rows, row_len, k, ties, norm) in [
        (1, 4096, 16, false, true),
        (1, 14336, 16, false, false),
        (4, 576, 16, false, true),
        (1, 2049, 3, false, false),
        (2, 1024, 1024, false, false),
        (1, 3000, 100, true, false),
        (3, 1024, 7, true, false),
    ] {
        add(
            "select_channels",
            format!(
                "{rows}×{row_len} k{k}{}{}",
                if ties { " ties" } else { "" },
                if norm { " norm" } else { "" }
            ),
            Op::SelectChannels {
                rows,
                row_len,
                k,
                ties,
                norm,
            },
            0.0,
            0.0,
        );
    }
    // Each shape through the device's own selection (`own`) and/or fetch lead's path (`lead`:
    // selected from an earlier stream, staged, the real input's values gathered).
    for (rows, row_len, k, outs, offset, norm, own, lead) in [
        (1, 4096, 16, [4096, 1024, 1024], 0, true, true, true),
        (1, 14336, 16, [4096, 0, 0], 0, false, true, false),
        (1, 14336, 64, [4096, 0, 0], 0, false, true, true),
        (1, 4096, 32, [14336, 14336, 0], 0, true, true, true),
        (1, 576, 16, [576, 192, 192], 0, true, true, false),
        (3, 1536, 64, [576, 0, 0], 0, false, true, false),
        (3, 1536, 64, [576, 0, 0], 4, true, false, true),
        (2, 1000, 1024, [100, 37, 0], 5, false, true, true),
        (1, 1000, 1024, [1100, 37, 0], 3, false, true, false),
        (1, 2049, 3, [300, 0, 0], 0, false, true, false),
    ] {
        let name = format!(
            "{rows}×{row_len} k{k} → {outs:?} @{offset}{}",
            if norm { " norm" } else { "" }
        );
        if own {
            let spec = Op::SelectedColumns {
                rows,
                row_len,
                k,
                outs,
                offset,
                norm,
            };
            add("add_selected_columns", name.clone(), spec, 2e-6, 2e-6);
        }
        if lead {
            let spec = Op::LeadColumns {
                rows,
                row_len,
                k,
                outs,
                offset,
                norm,
            };
            add("lead_columns", name, spec, 2e-6, 2e-6);
        }
    }
    // Group-quantized projections at every code width: decode (matvec, m ≤ 4) on the Llama
    // and SmolLM shapes (576 columns end in a half group), accumulate and bias variants, and
    // prefill (m > 4; bounds at `add_coded_linear`).
    for bits in SUPPORTED_BITS {
        for (m, rows, cols, group, bias, acc) in [
            (1, 4096, 4096, 128, false, false),
            (1, 1536, 576, 128, true, false),
            (3, 100, 1536, 128, false, true),
            (1, 300, 14336, 128, false, true),
            (2, 33, 64, 32, true, true),
            (9, 96, 576, 128, true, false),
            (40, 256, 1024, 64, false, true),
        ] {
            add_coded_linear(
                &mut add,
                "group_linear",
                Coded::Group { bits, group },
                (m, rows, cols, bias, acc),
            );
        }
    }
    // GGUF weights in their blocks, every type the CPU runs in blocks: decode (one and two
    // tokens, bias, accumulation) and a prefill of 9 tokens; legacy blocks on SmolLM2's
    // widths, K-quants on multiples of 256. Backends without block kernels (CUDA) run the
    // dequantized float path, as every backend does for the 4-bit i-quants (no block kernels
    // read them yet): those cases check that fallback.
    let iq4 = [GgmlType::IQ4NL, GgmlType::IQ4XS];
    for ty in crate::resident::gguf_blocks::BLOCK_TYPES
        .into_iter()
        .chain(iq4)
    {
        let k = ty.block_size() == 256;
        let wide = if k { 1024 } else { 1536 };
        let narrow = if k { 512 } else { 576 };
        for (m, rows, cols, bias, acc) in [
            (1, 96, narrow, true, false),
            (2, 33, wide, false, true),
            (9, 40, narrow, true, false),
        ] {
            add_coded_linear(
                &mut add,
                "gguf_linear",
                Coded::Gguf { ty },
                (m, rows, cols, bias, acc),
            );
        }
    }
    // Look-up-table codes (SqueezeLLM) at every width: decode and prefill on SmolLM2's widths
    // (576 off the 128-code bit-plane grid, 1536 on it). Backends without kernels for them
    // (CUDA) run the dequantized float path: those cases check that fallback.
    for bits in sfx_formats::resident::LUT_BITS {
        for (m, rows, cols, bias, acc) in [
            (1, 96, 576, true, false),
            (2, 33, 1536, false, true),
            (9, 40, 576, true, false),
        ] {
            add_coded_linear(
                &mut add,
                "lut_linear",
                Coded::Lut { bits },
                (m, rows, cols, bias, acc),
            );
        }
    }
    // Embedding rows from group codes at every width (2, 3 and 4 bits: the tile layout on
    // CUDA, a 576-column row ending in a half super-chunk at 2 bits): the first and last ids
    // of the table and random ones; the gather is exact (the same f32 products as the CPU).
    for bits in SUPPORTED_BITS {
        for (vocab, cols, group, n) in [(5003, 576, 128, 7), (300, 4096, 128, 3), (77, 64, 32, 5)] {
            add(
                "group_embedding",
                format!("q{bits}g{group} {vocab}×{cols} n{n}"),
                Op::CodedEmbedding {
                    format: Coded::Group { bits, group },
                    vocab,
                    cols,
                    n,
                },
                0.0,
                0.0,
            );
        }
    }
    // GGUF blocks and look-up-table codes through the fused decode paths (CUDA's coded.cu
    // kernels: up to three projections in one launch, gate/up with SwiGLU, the norm folded
    // in) on the Llama-3.1-8B shapes and a small one, and as embedding tables (the first and
    // last ids and random ones; the gather is exact).
    let block_formats = crate::resident::gguf_blocks::BLOCK_TYPES
        .into_iter()
        .map(|ty| Coded::Gguf { ty })
        .chain(
            sfx_formats::resident::LUT_BITS
                .into_iter()
                .map(|bits| Coded::Lut { bits }),
        );
    for format in block_formats {
        for norm in [false, true] {
            for shape in [
                (1, 4096, [4096, 1024, 1024], false),
                (2, 512, [256, 128, 64], true),
            ] {
                add_projections(&mut add, "coded_projections", format, norm, shape);
            }
            for shape in [(1, 14336, 4096), (2, 160, 512)] {
                add_swiglu(&mut add, "coded_swiglu", format, norm, shape);
            }
        }
        add(
            "coded_embedding",
            format!("{} 301×512 n5", format.tag()),
            Op::CodedEmbedding {
                format,
                vocab: 301,
                cols: 512,
                n: 5,
            },
            0.0,
            0.0,
        );
    }
    // The fused decode paths over group codes: q/k/v shapes of SmolLM2 and Llama-3.1-8B (and
    // an odd one), gate/up of both, with and without the norm folded in.
    for bits in SUPPORTED_BITS {
        for norm in [false, true] {
            for shape in [
                (1, 576, [576, 192, 192], false),
                (1, 4096, [4096, 1024, 1024], true),
                (3, 1536, [1536, 256, 96], true),
            ] {
                let format = Coded::Group { bits, group: 128 };
                add_projections(&mut add, "group_projections", format, norm, shape);
            }
            for (m, rows, cols, group) in
                [(1, 1536, 576, 128), (1, 14336, 4096, 128), (2, 133, 64, 32)]
            {
                let format = Coded::Group { bits, group };
                add_swiglu(&mut add, "group_swiglu", format, norm, (m, rows, cols));
            }
        }
    }
    // A decode row's refinement applied by the projections' launches (issue 14): the Llama-
    // 3.1-8B shapes of each set at the budgets the benches use, SmolLM2's (576 columns: one
    // short chunk; 1536 rows), columns in host memory and staged, every group-code width the
    // converter writes, and the default trellis format (its output transform's launch adds it).
    let hyb2 = Coded::Trellis {
        code: TrellisCode::Hyb { q: 9 },
        k: 2,
        order: TileOrder::RowMajor,
        rotation: Rotation::Full,
    };
    let formats = [2u8, 3, 4]
        .map(|bits| Coded::Group { bits, group: 128 })
        .into_iter()
        .chain([hyb2]);
    for format in formats {
        for staged in [false, true] {
            let shapes = [
                (
                    RefinedKind::Group,
                    4096,
                    [4096, 1024, 1024],
                    16,
                    true,
                    false,
                ),
                (RefinedKind::Group, 576, [576, 192, 192], 64, true, true),
                (RefinedKind::Group, 576, [576, 0, 0], 32, false, false),
                (RefinedKind::Swiglu, 4096, [14336, 14336, 0], 8, true, false),
                (RefinedKind::Swiglu, 576, [1536, 1536, 0], 64, true, false),
                (
                    RefinedKind::Accumulate,
                    14336,
                    [4096, 0, 0],
                    16,
                    false,
                    false,
                ),
                (RefinedKind::Accumulate, 576, [576, 0, 0], 128, false, true),
            ];
            for (kind, cols, rows, k, norm, bias) in shapes {
                // Trellis tiles: the 8B shapes.
                if matches!(format, Coded::Trellis { .. }) && cols == 576 {
                    continue;
                }
                add(
                    "refined_projections",
                    format!(
                        "{} {kind:?} {cols}→{rows:?} k{k}{}{}{}",
                        format.tag(),
                        if staged { " staged" } else { "" },
                        if norm { " +norm" } else { "" },
                        if bias { " +bias" } else { "" }
                    ),
                    Op::RefinedProjections {
                        format,
                        kind,
                        cols,
                        rows,
                        k,
                        staged,
                        norm,
                        bias,
                    },
                    2e-5,
                    2e-5,
                );
            }
        }
    }
    trellis_cases(&mut add);
    for (preset, graphs) in [("tiny", true), ("tiny-qwen3", true), ("tiny", false)] {
        add(
            "model_decode",
            format!(
                "{preset} f32 prefill 7 + 12 steps, graphs {}",
                if graphs { "on" } else { "off" }
            ),
            Op::Decode {
                preset,
                prompt: 7,
                steps: 12,
                graphs,
                weights: SyntheticWeights::Float,
                refine: None,
            },
            1e-4,
            1e-5,
        );
    }
    // A whole group-coded model, unrefined: the control of the refined group-coded cases
    // below (its prefill's coded GEMMs multiply on tensor cores on CUDA, as the trellis
    // model's do, hence their bound).
    add(
        "model_decode",
        "tiny-wide-qwen3 q2g32 prefill 7 + 12 steps, graphs on".into(),
        Op::Decode {
            preset: "tiny-wide-qwen3",
            prompt: 7,
            steps: 12,
            graphs: true,
            weights: SyntheticWeights::Group { bits: 2, group: 32 },
            refine: None,
        },
        3e-3,
        1e-5,
    );
    // The same at group 128, which CUDA re-lays out into its tensor-core tiles (2, 3 and 4
    // bits): every projection of the decode steps runs the tile matvecs, the prefill their
    // dequantized panels.
    for bits in [2, 3, 4] {
        add(
            "model_decode",
            format!("tiny-wide-qwen3 q{bits}g128 prefill 7 + 12 steps, graphs on"),
            Op::Decode {
                preset: "tiny-wide-qwen3",
                prompt: 7,
                steps: 12,
                graphs: true,
                weights: SyntheticWeights::Group { bits, group: 128 },
                refine: None,
            },
            3e-3,
            1e-5,
        );
    }
    // Whole models of look-up-table codes and GGUF blocks through the graph's fused paths
    // (q/k/v in one launch, gate/up with SwiGLU, norms folded in: CUDA's coded.cu kernels);
    // prefill multiplies TF32 panels on CUDA, hence the group models' bound. Q2_K's is wider:
    // at seed 21 its prefill's TF32 rounding moves the decode by 4.8e-3 (the same on three
    // H100s), and by 1.6e-6 with the same kernels and an f32 GEMM (SFX_CUDA_GEMM=own); seeds
    // 22 and 23 give 4.4e-5 and 1.9e-4. A kernel bug moves it by orders of magnitude more.
    for (weights, bound) in [
        (SyntheticWeights::Lut { bits: 3 }, 3e-3),
        (SyntheticWeights::Lut { bits: 4 }, 3e-3),
        (SyntheticWeights::Gguf { ty: GgmlType::Q2K }, 1e-2),
        (SyntheticWeights::Gguf { ty: GgmlType::Q4K }, 3e-3),
        (SyntheticWeights::Gguf { ty: GgmlType::Q6K }, 3e-3),
        (SyntheticWeights::Gguf { ty: GgmlType::Q5_0 }, 3e-3),
    ] {
        add(
            "model_decode",
            format!(
                "tiny-wide-qwen3 {} prefill 7 + 12 steps, graphs on",
                weights_tag(weights)
            ),
            Op::Decode {
                preset: "tiny-wide-qwen3",
                prompt: 7,
                steps: 12,
                graphs: true,
                weights,
                refine: None,
            },
            bound,
            1e-5,
        );
    }
    // A whole trellis-coded model through the graph's fused paths (HYB K2, 1MAD K3, and HYB
    // K2 under a block rotation); its prefill multiplies TF32 panels on CUDA, hence the looser
    // bound.
    let b64 = Rotation::Blocks { max_log2: 6 };
    for (code, k, rotation) in [
        (TrellisCode::Hyb { q: 9 }, 2, Rotation::Full),
        (TrellisCode::OneMad, 3, Rotation::Full),
        (TrellisCode::Hyb { q: 9 }, 2, b64),
    ] {
        add(
            "model_decode",
            format!(
                "tiny-qwen3 {} prefill 7 + 12 steps, graphs on",
                weights_tag(SyntheticWeights::Trellis { code, k, rotation })
            ),
            Op::Decode {
                preset: "tiny-qwen3",
                prompt: 7,
                steps: 12,
                graphs: true,
                weights: SyntheticWeights::Trellis { code, k, rotation },
                refine: None,
            },
            3e-3,
            1e-5,
        );
    }
    // Refined decode steps in the backend (selection, gathers from host memory, branches in
    // the step graph), at s = 0 and under fetch lead and lag: the CPU reference is the same
    // tokens in one refined prefill (chunk rows select per row, from the same stream
    // positions).
    // k = 16 under lead is what the engine hands to the projections' launches where the
    // backend fuses refinement (k ≤ refine::engine::FUSED_MAX_K, staged sets).
    for (k, s) in [
        (64, [0.0; 4]),
        (64, [0.5, 1.0, 1.0, 0.5]),
        (16, [0.5, 1.0, 1.0, 0.5]),
        (128, [1.5, 0.5, 0.5, 2.0]),
    ] {
        add(
            "model_decode",
            format!("tiny-wide f32 refined k{k} s{s:?} prefill 7 + 12 steps, graphs on"),
            Op::Decode {
                preset: "tiny-wide",
                prompt: 7,
                steps: 12,
                graphs: true,
                weights: SyntheticWeights::Float,
                refine: Some(DecodeRefine { k, s }),
            },
            REFINED_DECODE_BOUND,
            REFINED_DECODE_BOUND,
        );
    }
    // The same with group- and trellis-coded weights, whose launches apply a decode row's
    // refinement themselves where the backend fuses it (CUDA, staged sets at k ≤ 16): at
    // s = 0 (each set selects on the stream), under fetch lead with o and down at s = 0, and
    // with lag (o and down select and fetch on branches; their contributions land in a later
    // o or down launch).
    let hyb = TrellisCode::Hyb { q: 9 };
    for (weights, k, s) in [
        (SyntheticWeights::Group { bits: 2, group: 32 }, 64, [0.0; 4]),
        (
            SyntheticWeights::Group { bits: 4, group: 32 },
            128,
            [1.0, 0.0, 0.5, 0.0],
        ),
        (
            SyntheticWeights::Group { bits: 2, group: 32 },
            64,
            [0.5, 1.0, 1.0, 0.5],
        ),
        (
            SyntheticWeights::Group { bits: 2, group: 32 },
            16,
            [0.5, 1.0, 1.0, 0.5],
        ),
        (
            SyntheticWeights::Trellis {
                code: hyb,
                k: 2,
                rotation: Rotation::Full,
            },
            64,
            [0.0; 4],
        ),
        (
            SyntheticWeights::Trellis {
                code: hyb,
                k: 2,
                rotation: Rotation::Full,
            },
            64,
            [0.5, 1.0, 1.0, 0.5],
        ),
        (
            SyntheticWeights::Trellis {
                code: hyb,
                k: 2,
                rotation: Rotation::Full,
            },
            16,
            [0.5, 1.0, 1.0, 0.5],
        ),
        // Refinement beside launches that do not apply it themselves (CUDA's GGUF and
        // look-up-table kernels): the backend's own selection and column launches.
        (SyntheticWeights::Gguf { ty: GgmlType::Q4K }, 64, [0.0; 4]),
        (SyntheticWeights::Lut { bits: 3 }, 16, [0.5, 1.0, 1.0, 0.5]),
    ] {
        let tag = weights_tag(weights);
        // Every token but the first is a decode step, and the first is one row: no
        // tensor-core prefill, whose ~5e-4 (TF32 panels on CUDA) reaches the steps through
        // the cache and swaps near-tied channels of the selection (with a 7-token prefill
        // these cases measured up to 1.0e-2 in single rows on an H100). Decode only they
        // measured 0.8e-6 to 2.0e-6 (seed 1), but a channel whose |x| ties the k-th to ~1e-6
        // can still swap: one case of a whole suite run measured 7.1e-4. Hence
        // REFINED_DECODE_BOUND.
        add(
            "model_decode",
            format!("tiny-wide-qwen3 {tag} refined k{k} s{s:?} prefill 1 + 18 steps, graphs on"),
            Op::Decode {
                preset: "tiny-wide-qwen3",
                prompt: 1,
                steps: 18,
                graphs: true,
                weights,
                refine: Some(DecodeRefine { k, s }),
            },
            REFINED_DECODE_BOUND,
            REFINED_DECODE_BOUND,
        );
    }
    v
}

/// Bound of the refined whole-model decode cases on every backend, the CPU's included: a
/// decode row's top-k selection can swap channels whose |x| ties the k-th to ~1e-6 against
/// the prefill reference's (CPU against its own prefill: 3 of 80 time seeds measured 9.4e-4 to
/// 1.7e-3, above the 1e-5 these cases had). A lost set's refinement measured 5e-2, and
/// dropping every refinement moves the logits ten bounds or more
/// (`refined_decode_cases_see_a_dropped_refinement`).
const REFINED_DECODE_BOUND: f64 = 3e-3;

/// The refinement engine of a refined decode case, in `b`, from synthetic columns.
fn decode_refiner<B: Backend>(
    b: &B,
    config: &sfx_formats::ModelConfig,
    refine: Option<DecodeRefine>,
) -> Result<Option<crate::refine::Refiner<B>>> {
    let Some(r) = refine else {
        return Ok(None);
    };
    let settings = crate::refine::RefineSettings {
        k: [r.k; 4],
        s: r.s,
        mlp: crate::refine::MlpMode::Channels,
        bundle_k: 0,
    };
    let plan = crate::synthetic::refinement_plan(config);
    crate::refine::Refiner::new_in_backend(plan, settings, b, |src| {
        Ok(std::borrow::Cow::Owned(
            crate::synthetic::refinement_columns(src, 7),
        ))
    })
    .map(Some)
}

/// SplitMix64 stream of test inputs.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f32 {
        ((self.next() >> 40) as f32) / 16_777_216.0 * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
    /// An RMSNorm weight vector: values in [0.5, 1.5).
    fn norm_weights(&mut self, n: usize) -> Vec<f32> {
        self.vec(n, 0.5).iter().map(|v| v + 1.0).collect()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// The code width, group size, columns and total rows of a group-coded case.
/// A coded case's format, columns and rows of all its matrices stacked.
fn coded_shape(spec: &Op) -> Option<(Coded, usize, usize)> {
    match *spec {
        Op::CodedLinear {
            format, rows, cols, ..
        } => Some((format, cols, rows)),
        Op::CodedSwiglu {
            format, rows, cols, ..
        } => Some((format, cols, 2 * rows)),
        Op::CodedProjections {
            format, cols, rows, ..
        }
        | Op::RefinedProjections {
            format, cols, rows, ..
        } => Some((format, cols, rows.iter().sum())),
        Op::CodedEmbedding {
            format,
            vocab,
            cols,
            ..
        } => Some((format, cols, vocab)),
        _ => None,
    }
}

/// Rows `first..first + rows` of a group-coded case's matrix from its inputs (the codes of
/// all its matrices, stacked by rows, in `bytes`; scales in `b` rounded to f16; zero points
/// in `ids`).
/// Rows `first..first + rows` of a GGUF-block case's matrix (its block bytes from `bytes`).
fn gguf_blocks(spec: &Op, x: &Inputs, first: usize, rows: usize) -> Result<BlockTensor> {
    let Some((Coded::Gguf { ty }, cols, _)) = coded_shape(spec) else {
        return Err(RuntimeError::Unsupported(
            "gguf_blocks: not a GGUF-block case".into(),
        ));
    };
    let row_bytes = cols / ty.block_size() * ty.type_size();
    Ok(BlockTensor {
        ty,
        rows,
        cols,
        bytes: x.bytes[first * row_bytes..(first + rows) * row_bytes].to_vec(),
    })
}

/// Rows `first..first + rows` of a look-up-table case: codes from `bytes`, each row's levels
/// from `ids` (`2^bits` a row, as signed bytes), row scales from `b`.
fn lut_weight(spec: &Op, x: &Inputs, first: usize, rows: usize) -> Result<LutQuantized> {
    let Some((Coded::Lut { bits }, cols, _)) = coded_shape(spec) else {
        return Err(RuntimeError::Unsupported(
            "lut_weight: not a look-up-table case".into(),
        ));
    };
    let row_bytes = (cols * usize::from(bits)).div_ceil(8);
    let n = 1usize << bits;
    let codes = x.bytes[first * row_bytes..(first + rows) * row_bytes].to_vec();
    let tables = x.ids[first * n..(first + rows) * n]
        .iter()
        .map(|&t| t as u8 as i8)
        .collect();
    let scales = x.b[first..first + rows]
        .iter()
        .map(|&v| f16::from_f32(v))
        .collect();
    LutQuantized::from_parts(bits, rows, cols, codes, tables, scales).map_err(|e| {
        RuntimeError::Shape {
            op: "lut codes",
            msg: e.to_string(),
        }
    })
}

fn group_codes(spec: &Op, x: &Inputs, first: usize, rows: usize) -> Result<GroupQuantized> {
    let Some((Coded::Group { bits, group }, cols, _)) = coded_shape(spec) else {
        return Err(crate::error::RuntimeError::Unsupported(
            "group_codes: not a group-coded case".into(),
        ));
    };
    let row_bytes = (cols * usize::from(bits)).div_ceil(8);
    let gpr = cols.div_ceil(group);
    let bytes = x.bytes[first * row_bytes..(first + rows) * row_bytes].to_vec();
    let scales = x.b[first * gpr..(first + rows) * gpr]
        .iter()
        .map(|&v| f16::from_f32(v))
        .collect();
    let zeros = x.ids[first * gpr..(first + rows) * gpr]
        .iter()
        .map(|&z| z as u8)
        .collect();
    GroupQuantized::from_parts(bits, group, rows, cols, bytes, scales, zeros).map_err(|e| {
        crate::error::RuntimeError::Shape {
            op: "group codes",
            msg: e.to_string(),
        }
    })
}

/// Projection `proj` (rows `first..first + rows` of the stack) of a trellis-coded case: its
/// tile streams from `bytes` (stacked by rows), output signs × scales from `b`, input signs
/// from `ids` (`cols` per projection), the Gaussian HYB table and our transforms.
fn trellis_weight(
    spec: &Op,
    x: &Inputs,
    proj: usize,
    first: usize,
    rows: usize,
) -> Result<TrellisQuantized> {
    let err = |msg: String| crate::error::RuntimeError::Shape {
        op: "trellis codes",
        msg,
    };
    let Some((
        Coded::Trellis {
            code,
            k,
            order,
            rotation,
        },
        cols,
        _,
    )) = coded_shape(spec)
    else {
        return Err(err("not a trellis-coded case".into()));
    };
    let scheme = TrellisScheme {
        code,
        l: 16,
        k,
        order,
        rotation,
    };
    let row_bytes = cols / 16 * scheme.tile_bytes();
    let tiles = x.bytes[first / 16 * row_bytes..(first + rows) / 16 * row_bytes].to_vec();
    let su = x.ids[proj * cols..(proj + 1) * cols]
        .iter()
        .map(|&v| if v & 1 == 0 { f16::ONE } else { f16::NEG_ONE })
        .collect();
    with_our_tables(
        scheme,
        rows,
        cols,
        tiles,
        su,
        x.b[first..first + rows].to_vec(),
    )
    .map_err(err)
}

/// Projection `proj` (rows `first..first + rows`) of a coded case on backend `b`.
fn coded_linear<B: ResidentKernels>(
    b: &B,
    spec: &Op,
    x: &Inputs,
    (proj, first, rows): (usize, usize, usize),
    bias: Option<Vec<f32>>,
) -> Result<Box<dyn crate::linear::Linear<B>>> {
    match coded_shape(spec) {
        Some((Coded::Trellis { .. }, ..)) => b.trellis_linear(
            trellis_weight(spec, x, proj, first, rows)?,
            bias,
            "conformance trellis",
        ),
        Some((Coded::Lut { .. }, ..)) => crate::resident::lut_or_dequantized(
            b,
            &lut_weight(spec, x, first, rows)?,
            bias,
            WeightPrecision::F32,
            "conformance lut",
        ),
        Some((Coded::Gguf { .. }, ..)) => crate::resident::gguf_blocks::block_linear(
            b,
            &gguf_blocks(spec, x, first, rows)?,
            bias,
            WeightPrecision::F32,
            "conformance gguf",
        ),
        _ => b.group_linear(
            group_codes(spec, x, first, rows)?,
            bias,
            "conformance group",
        ),
    }
}

/// The dequantized weights of a coded case's projections (`rows` each, stacked), as the
/// reference multiplies them.
fn coded_dequant(spec: &Op, x: &Inputs, rows: &[usize]) -> Result<Vec<f32>> {
    let total: usize = rows.iter().sum();
    match coded_shape(spec) {
        Some((Coded::Trellis { .. }, ..)) => {
            let mut w = Vec::new();
            let mut first = 0;
            for (proj, &r) in rows.iter().enumerate() {
                w.extend(dequantize_trellis(&trellis_weight(
                    spec, x, proj, first, r,
                )?)?);
                first += r;
            }
            Ok(w)
        }
        Some((Coded::Lut { .. }, ..)) => Ok(lut_weight(spec, x, 0, total)?.dequantize()),
        Some((Coded::Gguf { .. }, ..)) => {
            gguf_blocks(spec, x, 0, total)?
                .dequantize()
                .map_err(|e| RuntimeError::Shape {
                    op: "gguf blocks",
                    msg: e.to_string(),
                })
        }
        _ => Ok(group_codes(spec, x, 0, total)?.dequantize()),
    }
}

/// One coded projection case `(m, rows, cols, bias, acc)`: decode (m ≤ 4, matvec) within 1e-5
/// of the CPU; prefill within 1e-3 (group codes: an f32 panel the device GEMM multiplies in
/// TF32, 10-bit mantissas on both operands; trellis codes: exact decoded values against x'
/// rounded to f16 — either way a relative error of ~2⁻¹¹ per product).
fn add_coded_linear(
    add: &mut impl FnMut(&'static str, String, Op, f64, f64),
    op: &'static str,
    format: Coded,
    (m, rows, cols, bias, acc): (usize, usize, usize, bool, bool),
) {
    add(
        op,
        format!(
            "{} m{m} {rows}×{cols}{}{}",
            format.tag(),
            if bias { " +bias" } else { "" },
            if acc { " +=" } else { "" }
        ),
        Op::CodedLinear {
            format,
            m,
            rows,
            cols,
            bias,
            acc,
        },
        if m <= 4 { 1e-5 } else { 1e-3 },
        1e-5,
    );
}

/// A fused q/k/v case (`Op::CodedProjections`, three projections of one input in one launch
/// where the backend fuses them; `norm`: the input RMSNorm folded in) of `format`, named `op`.
fn add_projections(
    add: &mut impl FnMut(&'static str, String, Op, f64, f64),
    op: &'static str,
    format: Coded,
    norm: bool,
    (m, cols, rows, bias): (usize, usize, [usize; 3], bool),
) {
    add(
        op,
        format!(
            "{} m{m} {cols}→{},{},{}{}{}",
            format.tag(),
            rows[0],
            rows[1],
            rows[2],
            if bias { " +bias" } else { "" },
            if norm { " +norm" } else { "" }
        ),
        Op::CodedProjections {
            format,
            m,
            cols,
            rows,
            bias,
            norm,
        },
        1e-5,
        1e-5,
    );
}

/// A fused gate/up case with SwiGLU (`Op::CodedSwiglu`) of `format`, named `op`.
fn add_swiglu(
    add: &mut impl FnMut(&'static str, String, Op, f64, f64),
    op: &'static str,
    format: Coded,
    norm: bool,
    (m, rows, cols): (usize, usize, usize),
) {
    add(
        op,
        format!(
            "{} m{m} {cols}→{rows}{}",
            format.tag(),
            if norm { " +norm" } else { "" }
        ),
        Op::CodedSwiglu {
            format,
            m,
            rows,
            cols,
            norm,
        },
        1e-5,
        1e-5,
    );
}

/// Trellis-coded projections (QTIP / YAQA tiles) on the same shape families as the group
/// codes (rows multiples of 16; 576, 1536, 14336 take dense Hadamard factors): every code at
/// every K in both tile orders on decode and on a prefill of 70 tokens (two token blocks of
/// the GEMM; 3 tile rows, fewer than a block's warps; 576 columns: a dense factor and padding
/// tiles); the default format (HYB K2, row-major as `sfx-convert` writes it) and QTIP's
/// checkpoints' format (HYB K2, mma order) on every shape, 260 tokens included (the GEMM's
/// 128-token blocks; `SFX_TR_GEMM_TOKENS=128` runs every case's prefill on them); the fused
/// q/k/v and gate/up paths for one format per code.
fn trellis_cases(add: &mut impl FnMut(&'static str, String, Op, f64, f64)) {
    const HYB: TrellisCode = TrellisCode::Hyb { q: 9 };
    // 1024 × 1536 and 2048 × 512: decode with bias and accumulation after tr_prepare and after
    // the matvec's prologue, with more than one token.
    let decode = [
        (1, 1536, 576, true, false),
        (3, 96, 1536, false, true),
        (1, 304, 14336, false, true),
        (2, 48, 64, true, true),
        (2, 1024, 1536, true, true),
    ];
    let shapes_all = [
        (1, 4096, 4096, false, false),
        (2, 1024, 1536, true, true),
        (3, 2048, 512, false, true),
        (1, 1536, 576, true, false),
        (3, 96, 1536, false, true),
        (1, 304, 14336, false, true),
        (2, 48, 64, true, true),
        (9, 96, 576, true, false),
        (40, 256, 1024, false, true),
        (70, 160, 1536, false, true),
        (260, 48, 576, true, false),
    ];
    let mut i = 0;
    for code in [HYB, TrellisCode::OneMad, TrellisCode::ThreeInst] {
        for k in 2..=4u8 {
            for order in [TileOrder::RowMajor, TileOrder::Mma] {
                let format = Coded::Trellis {
                    code,
                    k,
                    order,
                    rotation: Rotation::Full,
                };
                let full = code == HYB && k == 2;
                let shapes: Vec<_> = if full {
                    shapes_all.to_vec()
                } else {
                    vec![decode[i % decode.len()], (70, 48, 576, true, true)]
                };
                i += 1;
                for shape in shapes {
                    add_coded_linear(add, "trellis_linear", format, shape);
                }
            }
        }
    }
    let fused = [
        Coded::Trellis {
            code: HYB,
            k: 2,
            order: TileOrder::RowMajor,
            rotation: Rotation::Full,
        },
        Coded::Trellis {
            code: HYB,
            k: 2,
            order: TileOrder::Mma,
            rotation: Rotation::Full,
        },
        Coded::Trellis {
            code: TrellisCode::OneMad,
            k: 2,
            order: TileOrder::RowMajor,
            rotation: Rotation::Full,
        },
        Coded::Trellis {
            code: TrellisCode::ThreeInst,
            k: 3,
            order: TileOrder::RowMajor,
            rotation: Rotation::Full,
        },
    ];
    // The Llama-3.1-8B shapes (4096 → 4096/1024/1024, 4096 → 14336) for the default format only:
    // their f64 references dominate the suite's CPU time.
    for (fi, format) in fused.into_iter().enumerate() {
        let large = fi == 0;
        for norm in [false, true] {
            for shape in [
                (1, 576, [576, 192, 192], false),
                (1, 4096, [4096, 1024, 1024], true),
                (3, 1536, [1536, 256, 96], true),
            ] {
                if shape.1 == 4096 && !large {
                    continue;
                }
                add_projections(add, "trellis_projections", format, norm, shape);
            }
            for shape in [(1, 1536, 576), (1, 14336, 4096), (2, 144, 64)] {
                if shape.1 == 14336 && !large {
                    continue;
                }
                add_swiglu(add, "trellis_swiglu", format, norm, shape);
            }
        }
    }
    // Block rotations (sfx-convert --rotation bN): the matvec's prologue transforms every input
    // width in registers (14336 included, which a full rotation sends through tr_prepare; 576
    // in blocks of 64) and the output transforms mix nothing across rows. Every dimension here
    // has blocks of at least 32 (the CUDA kernels' smallest).
    let blocks = |code, k, order, max_log2| Coded::Trellis {
        code,
        k,
        order,
        rotation: Rotation::Blocks { max_log2 },
    };
    let b128 = blocks(HYB, 2, TileOrder::RowMajor, 7);
    for shape in [
        (1, 4096, 4096, false, false),
        (1, 1536, 576, true, false),
        (1, 320, 14336, false, true),
        (2, 1024, 1536, true, true),
        (70, 160, 1536, false, true),
        (260, 64, 576, true, false),
    ] {
        add_coded_linear(add, "trellis_linear", b128, shape);
    }
    let b256 = blocks(TrellisCode::OneMad, 3, TileOrder::Mma, 8);
    for shape in [(1, 4096, 4096, true, true), (3, 1024, 1536, false, false)] {
        add_coded_linear(add, "trellis_linear", b256, shape);
    }
    for norm in [false, true] {
        for shape in [
            (1, 4096, [4096, 1024, 1024], true),
            (1, 576, [576, 192, 192], false),
        ] {
            add_projections(add, "trellis_projections", b128, norm, shape);
        }
        for shape in [(1, 14336, 4096), (1, 1536, 576)] {
            add_swiglu(add, "trellis_swiglu", b128, norm, shape);
        }
    }
}

/// Values as a matrix of `dtype` stores them (BF16 rounding applied).
fn rounded(values: &[f32], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::BF16 => values.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
        _ => values.to_vec(),
    }
}

fn kv_rounded(values: &[f32], kv: KvDtype) -> Vec<f32> {
    match kv {
        KvDtype::F16 => values.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
        KvDtype::F32 => values.to_vec(),
    }
}

fn matrix_bytes(values: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::BF16 => values
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

fn upload_matrix<B: Backend>(
    b: &B,
    values: &[f32],
    dtype: DType,
    rows: usize,
    cols: usize,
) -> Result<B::Matrix> {
    let bytes = matrix_bytes(values, dtype);
    let shape = [rows, cols];
    let view = TensorView::new("conformance", dtype, &shape, &bytes)?;
    b.upload_matrix("conformance", &view, WeightPrecision::Native)
}

fn poisoned<B: Backend>(b: &B, n: usize) -> Result<B::Buffer> {
    b.upload(&vec![f32::NAN; n])
}

fn index<B: Backend>(b: &B, values: &[u32]) -> Result<B::Index> {
    let mut i = b.alloc_index(values.len())?;
    b.write_index(&mut i, values)?;
    Ok(i)
}

fn download<B: Backend>(b: &B, buf: &B::Buffer) -> Result<Vec<f32>> {
    let mut v = vec![0.0; b.buffer_len(buf)];
    b.download(buf, &mut v)?;
    Ok(v)
}

/// The host inputs of a case, drawn once and given to every backend.
#[derive(Default)]
struct Inputs {
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
    d: Vec<f32>,
    ids: Vec<u32>,
    bytes: Vec<u8>,
    /// Token ids of cases whose `ids` hold something else (group zero points).
    tokens: Vec<u32>,
    /// KVarN refinement units, `[kv_heads, tile capacity, groups per tile, unit]`; a refined
    /// projection case's columns, projection after projection.
    units: Vec<u8>,
    /// A refined projection case's refinement scales, projection after projection.
    e: Vec<f32>,
}

fn inputs(spec: &Op, rng: &mut Rng) -> Inputs {
    let mut i = Inputs::default();
    match *spec {
        Op::Embedding { vocab, cols, n, .. } => {
            i.a = rng.vec(vocab * cols, 1.0);
            i.ids = (0..n).map(|t| if t == 0 { vocab - 1 } else if t == 1 { 0 } else { rng.below(vocab) } as u32).collect();
        }
        Op::Matmul { m, rows, cols, .. } => {
            i.a = rng.vec(m * cols, 1.0);
            i.b = rng.vec(rows * cols, (3.0 / cols.max(1) as f32).sqrt());
            i.c = rng.vec(rows, 0.5);
            i.d = rng.vec(m * rows, 1.0);
        }
        Op::MatmulGroup { m, cols, rows, .. } => {
            i.a = rng.vec(m * cols, 3.0);
            let total: usize = rows.iter().sum();
            i.b = rng.vec(total * cols, (3.0 / cols as f32).sqrt());
            i.c = rng.vec(total, 0.5);
            i.d = rng.norm_weights(cols);
        }
        Op::Swiglu { m, rows, cols, .. } => {
            i.a = rng.vec(m * cols, 3.0);
            i.b = rng.vec(2 * rows * cols, (3.0 / cols as f32).sqrt() * 2.0);
            i.d = rng.norm_weights(cols);
        }
        Op::RmsNorm { rows, cols, .. } => {
            i.a = rng.vec(rows * cols, 3.0);
            i.b = rng.norm_weights(cols);
        }
        Op::Rope {
            n, heads, head_dim, ..
        } => i.a = rng.vec(n * heads * head_dim, 2.0),
        Op::RopeQk {
            n,
            heads,
            kv_heads,
            head_dim,
            ..
        } => {
            i.a = rng.vec(n * heads * head_dim, 2.0);
            i.b = rng.vec(n * kv_heads * head_dim, 2.0);
        }
        Op::WriteKv {
            n,
            kv_heads,
            head_dim,
            ..
        } => {
            i.a = rng.vec(n * kv_heads * head_dim, 2.0);
            i.b = rng.vec(n * kv_heads * head_dim, 2.0);
        }
        Op::HadamardRows { rows, n } => i.a = rng.vec(rows * n, 2.0),
        Op::KvarnDecode(ref c) => {
            let d = c.head_dim;
            i.a = rng.vec(c.heads * d, 1.5);
            // The step's key and value rows, then the stores (sinks in b, tail in c).
            i.d = rng.vec(2 * c.kv_heads * d, 1.5);
            i.b = rng.vec(2 * c.kv_heads * c.sinks * d, 1.5);
            i.c = rng.vec(2 * c.kv_heads * KVARN_TILE * d, 1.0);
            (i.bytes, i.units) = kvarn_records(c, rng);
            i.ids = vec![kvarn_decode_position(c) as u32];
        }
        Op::KvarnAttention(ref c) => {
            let d = c.head_dim;
            i.a = rng.vec(c.heads * d, 1.5 / (d as f32).sqrt());
            // Keys then values, [kv_heads, capacity, d] each: the sinks in b, the tail in c.
            i.b = rng.vec(2 * c.kv_heads * c.sinks.max(1) * d, 1.5);
            i.c = rng.vec(2 * c.kv_heads * c.tail.max(1) * d, 1.0);
            (i.bytes, i.units) = kvarn_records(c, rng);
        }
        Op::Attention {
            n,
            past,
            heads,
            kv_heads,
            head_dim,
            ..
        }
        | Op::RopeAttention {
            n,
            past,
            heads,
            kv_heads,
            head_dim,
            ..
        } => {
            let total = past + n;
            i.a = rng.vec(n * heads * head_dim, 1.5);
            i.b = rng.vec(total * kv_heads * head_dim, 1.5);
            i.c = rng.vec(total * kv_heads * head_dim, 1.0);
        }
        Op::SiluMul { len } | Op::AddAssign { len } => {
            i.a = rng.vec(len, 8.0);
            i.b = rng.vec(len, 2.0);
        }
        Op::Argmax { rows, cols } => {
            i.a = rng.vec(rows * cols, 10.0);
            // A tie at the maximum: the lower index must win.
            if cols > 10 {
                for r in 0..rows {
                    let row = &mut i.a[r * cols..(r + 1) * cols];
                    let (j, k) = (rng.below(cols / 2), cols / 2 + rng.below(cols / 2));
                    row[j] = 11.0;
                    row[k] = 11.0;
                }
            }
        }
        Op::CopyRows { rows, row_len, .. } | Op::ReadRows { rows, row_len, .. } => {
            i.a = rng.vec(rows * row_len, 1.0);
        }
        Op::NibbleUnits { row_len, units } => {
            let unit_bytes = row_len.div_ceil(2) + 3;
            i.bytes = (0..units * unit_bytes).map(|_| rng.next() as u8).collect();
            i.a = rng.vec(units, 1.0);
            i.b = rng.vec(row_len, 0.1);
            i.c = rng.vec(2 * row_len, 1.0);
        }
        Op::SelectChannels {
            rows,
            row_len,
            ties,
            ..
        } => {
            i.a = rng.vec(rows * row_len, 2.0);
            i.d = rng.norm_weights(row_len);
            if ties {
                // Quarter steps: many equal magnitudes, and zeros.
                for v in &mut i.a {
                    *v = (*v * 4.0).round() / 4.0;
                }
                let at = rng.below(rows * row_len);
                i.a[at] = f32::NAN;
            }
        }
        Op::SelectedColumns {
            rows,
            row_len,
            outs,
            offset,
            ..
        }
        | Op::LeadColumns {
            rows,
            row_len,
            outs,
            offset,
            ..
        } => {
            // Lead cases: the earlier stream follows the real input in `a`.
            let streams = if matches!(spec, Op::LeadColumns { .. }) {
                2
            } else {
                1
            };
            i.a = rng.vec(streams * rows * row_len, 2.0);
            i.d = rng.norm_weights(row_len);
            let mut units = 0;
            for &o in outs.iter().filter(|&&o| o > 0) {
                units += o.div_ceil(2) * row_len;
                i.b.extend(rng.vec(o, 0.05));
                i.c.extend(rng.vec(rows * o, 1.0));
            }
            i.bytes = (0..offset + units).map(|_| rng.next() as u8).collect();
        }
        Op::Random { .. } => i.ids = vec![rng.next() as u32, rng.next() as u32],
        Op::CodedLinear { m, rows, .. } => {
            coded_inputs(&mut i, spec, rng);
            i.c = rng.vec(rows, 0.5);
            i.d = rng.vec(m * rows, 1.0);
        }
        Op::CodedEmbedding { vocab, n, .. } => {
            coded_inputs(&mut i, spec, rng);
            i.tokens = (0..n)
                .map(|t| match t {
                    0 => vocab - 1,
                    1 => 0,
                    _ => rng.below(vocab),
                } as u32)
                .collect();
        }
        Op::RefinedProjections {
            cols, rows, kind, ..
        } => {
            coded_inputs(&mut i, spec, rng);
            let total: usize = rows.iter().sum();
            i.c = rng.vec(total, 0.5);
            // Norm weights, or the accumulated output's start values.
            i.d = if kind == RefinedKind::Accumulate {
                rng.vec(rows[0], 1.0)
            } else {
                rng.norm_weights(cols)
            };
            for &r in rows.iter().filter(|&&r| r > 0) {
                i.units
                    .extend((0..r.div_ceil(2) * cols).map(|_| rng.next() as u8));
            }
            i.e = rng.vec(total, 0.02);
        }
        Op::CodedProjections { cols, .. } | Op::CodedSwiglu { cols, .. } => {
            coded_inputs(&mut i, spec, rng);
            let total = coded_shape(spec).map_or(0, |s| s.2);
            i.c = rng.vec(total, 0.5);
            i.d = rng.norm_weights(cols);
        }
        Op::Decode { prompt, steps, .. } => {
            i.ids = (0..prompt + steps).map(|_| rng.next() as u32).collect()
        }
    }
    i
}

/// x (`a`, m rows) and random codes (`bytes`) of a coded case; group codes take scales
/// (`b`) and zero points (`ids`), trellis tiles output signs × scales (`b`) and input signs
/// (`ids`, per projection).
fn coded_inputs(i: &mut Inputs, spec: &Op, rng: &mut Rng) {
    let m = match *spec {
        Op::CodedLinear { m, .. } | Op::CodedProjections { m, .. } | Op::CodedSwiglu { m, .. } => m,
        Op::RefinedProjections { .. } => 1,
        _ => 0,
    };
    let Some((format, cols, rows)) = coded_shape(spec) else {
        return;
    };
    i.a = rng.vec(m * cols, 1.0);
    match format {
        Coded::Group { bits, group } => {
            let groups = rows * cols.div_ceil(group);
            i.bytes = (0..rows * (cols * usize::from(bits)).div_ceil(8))
                .map(|_| rng.next() as u8)
                .collect();
            // Scales give the dequantized weights variance ≈ 1/cols (as the float cases).
            let levels = f32::from(1u16 << bits);
            let unit = (12.0 / ((levels * levels - 1.0) * cols as f32)).sqrt();
            i.b = rng
                .vec(groups, 0.5)
                .iter()
                .map(|u| unit * (1.0 + u))
                .collect();
            i.ids = (0..groups).map(|_| rng.below(1 << bits) as u32).collect();
        }
        Coded::Gguf { ty } => i.bytes = random_gguf_blocks(ty, rows, cols, rng),
        Coded::Lut { bits } => {
            i.bytes = (0..rows * (cols * usize::from(bits)).div_ceil(8))
                .map(|_| rng.next() as u8)
                .collect();
            // Levels anywhere on the signed byte grid (its ends included); scales give the
            // weights variance ≈ 1/cols.
            i.ids = (0..rows << bits)
                .map(|_| (rng.next() & 0xff) as u32)
                .collect();
            let unit = (3.0 / cols as f32).sqrt() / 128.0;
            i.b = rng
                .vec(rows, 0.5)
                .iter()
                .map(|u| unit * (1.0 + u))
                .collect();
        }
        Coded::Trellis { k, .. } => {
            i.bytes = (0..rows / 16 * cols / 16 * 32 * usize::from(k))
                .map(|_| rng.next() as u8)
                .collect();
            // The codes' values are ≈ N(0, 1) and the transforms orthonormal: weights of
            // variance ≈ 1/cols, with random output signs.
            let unit = 1.0 / (cols as f32).sqrt();
            i.b = rng
                .vec(rows, 1.0)
                .iter()
                .map(|u| unit * (0.5 + u))
                .collect();
            i.ids = (0..3 * cols).map(|_| rng.next() as u32).collect();
        }
    }
}

/// A synthetic model's projection format in a case name.
fn weights_tag(weights: SyntheticWeights) -> String {
    match weights {
        SyntheticWeights::Group { bits, group } => format!("q{bits}g{group}"),
        SyntheticWeights::Trellis {
            code,
            k,
            rotation: Rotation::Full,
        } => format!("qtip{k} {}", code.name()),
        SyntheticWeights::Trellis { code, k, rotation } => {
            format!("qtip{k} {} rotation {}", code.name(), rotation.name())
        }
        SyntheticWeights::Lut { bits } => format!("lut{bits}"),
        SyntheticWeights::Gguf { ty } => format!("gguf {ty}"),
        SyntheticWeights::Float => "f32".into(),
    }
}

/// GGUF blocks of `ty` for a `rows × cols` matrix: random code bytes (every bit pattern is a
/// valid code), scaled by `scale_random_blocks`.
fn random_gguf_blocks(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let mut bytes: Vec<u8> = (0..rows * cols / ty.block_size() * ty.type_size())
        .map(|_| rng.next() as u8)
        .collect();
    crate::resident::gguf_blocks::scale_random_blocks(ty, &mut bytes, cols, || {
        rng.vec(1, 0.5)[0] - 0.5
    });
    bytes
}

/// Host `[total, kv_heads·d]` rows → a `[kv_heads, capacity, d]` store image.
fn kv_image(rows: &[f32], kv_heads: usize, d: usize, capacity: usize) -> Vec<f32> {
    let total = rows.len() / (kv_heads * d).max(1);
    let mut img = vec![0.0; kv_heads * capacity * d];
    for t in 0..total {
        for h in 0..kv_heads {
            let src = (t * kv_heads + h) * d;
            let dst = (h * capacity + t) * d;
            img[dst..dst + d].copy_from_slice(&rows[src..src + d]);
        }
    }
    img
}

/// The cache layout of an attention case: every position of the step and a few spare rows
/// past it (which a correct kernel never reads).
fn attention_layout(kv_heads: usize, head_dim: usize, past: usize, n: usize) -> KvLayout {
    KvLayout {
        kv_heads,
        head_dim,
        capacity: past + n + 5,
    }
}

/// Both cache stores, keys then values, as f32.
fn download_caches<B: Backend>(
    b: &B,
    kc: &B::KvStore,
    vc: &B::KvStore,
    layout: KvLayout,
) -> Result<Vec<f32>> {
    let mut out = vec![0.0; 2 * layout.buffer_len()];
    let (ko, vo) = out.split_at_mut(layout.buffer_len());
    b.download_kv(kc, ko)?;
    b.download_kv(vc, vo)?;
    Ok(out)
}

/// Key and value store images holding the first `rows` token rows of `x.b` / `x.c` and
/// poison elsewhere (7, −7), so a row the step should have written but did not shows.
fn fresh_kv_images(x: &Inputs, rows: usize, layout: KvLayout) -> (Vec<f32>, Vec<f32>) {
    let row = layout.kv_heads * layout.head_dim;
    let image = |src: &[f32], poison: f32| {
        let mut img = kv_image(
            &src[..rows * row],
            layout.kv_heads,
            layout.head_dim,
            layout.capacity,
        );
        for h in 0..layout.kv_heads {
            let start = (h * layout.capacity + rows) * layout.head_dim;
            let end = (h + 1) * layout.capacity * layout.head_dim;
            img[start..end].fill(poison);
        }
        img
    };
    (image(&x.b, 7.0), image(&x.c, -7.0))
}

/// Runs the case's op on backend `b`; the output as f32 (ids as f32 values).
fn execute<B: ResidentKernels>(spec: &Op, x: &Inputs, b: &B) -> Result<Vec<f32>> {
    match *spec {
        Op::Embedding {
            dtype,
            vocab,
            cols,
            n,
        } => {
            let table = upload_matrix(b, &x.a, dtype, vocab, cols)?;
            let mut out = poisoned(b, n * cols)?;
            b.embedding(&table, &index(b, &x.ids)?, &mut out)?;
            download(b, &out)
        }
        Op::Matmul {
            dtype,
            m,
            rows,
            cols,
            bias,
            acc,
        } => {
            let w = upload_matrix(b, &x.b, dtype, rows, cols)?;
            let xb = b.upload(&x.a)?;
            let bb = if bias { Some(b.upload(&x.c)?) } else { None };
            let mut y = if acc {
                b.upload(&x.d)?
            } else {
                poisoned(b, m * rows)?
            };
            let mode = if acc {
                MatmulOut::Accumulate
            } else {
                MatmulOut::Store
            };
            b.matmul_t(&xb, m, &w, bb.as_ref(), &mut y, mode)?;
            download(b, &y)
        }
        Op::MatmulGroup {
            dtype,
            m,
            cols,
            rows,
            bias,
            norm,
        } => {
            let xb = b.upload(&x.a)?;
            let nw = b.upload(&x.d)?;
            let mut normed = poisoned(b, m * cols)?;
            let mut off = 0;
            let mut ws = Vec::new();
            let mut biases = Vec::new();
            for &r in &rows {
                ws.push(upload_matrix(
                    b,
                    &x.b[off * cols..(off + r) * cols],
                    dtype,
                    r,
                    cols,
                )?);
                biases.push(if bias {
                    Some(b.upload(&x.c[off..off + r])?)
                } else {
                    None
                });
                off += r;
            }
            let mut outs = rows
                .iter()
                .map(|&r| poisoned(b, m * r))
                .collect::<Result<Vec<_>>>()?;
            {
                let mut items: Vec<GroupItem<'_, B>> = ws
                    .iter()
                    .zip(&biases)
                    .zip(outs.iter_mut())
                    .map(|((w, bi), out)| GroupItem::new(w, bi.as_ref(), out))
                    .collect();
                if norm {
                    b.rms_norm_matmul_group(&xb, &nw, 1e-5, &mut normed, m, &mut items)?;
                } else {
                    b.matmul_t_group(&xb, m, &mut items)?;
                }
            }
            let mut all = Vec::new();
            for o in &outs {
                all.extend(download(b, o)?);
            }
            Ok(all)
        }
        Op::Swiglu {
            dtype,
            m,
            rows,
            cols,
            norm,
        } => {
            let wg = upload_matrix(b, &x.b[..rows * cols], dtype, rows, cols)?;
            let wu = upload_matrix(b, &x.b[rows * cols..], dtype, rows, cols)?;
            let xb = b.upload(&x.a)?;
            let mut gate = poisoned(b, m * rows)?;
            let mut up = poisoned(b, m * rows)?;
            if norm {
                let nw = b.upload(&x.d)?;
                let mut normed = poisoned(b, m * cols)?;
                b.rms_norm_swiglu(&xb, &nw, 1e-5, &mut normed, m, &wg, &wu, &mut gate, &mut up)?;
            } else {
                b.matmul_t_swiglu(&xb, m, &wg, &wu, &mut gate, &mut up)?;
            }
            download(b, &gate)
        }
        Op::RmsNorm {
            rows,
            cols,
            in_place,
        } => {
            let w = b.upload(&x.b)?;
            if in_place {
                let mut xb = b.upload(&x.a)?;
                b.rms_norm_in_place(&mut xb, &w, 1e-6)?;
                download(b, &xb)
            } else {
                let xb = b.upload(&x.a)?;
                let mut out = poisoned(b, rows * cols)?;
                b.rms_norm(&xb, &w, 1e-5, &mut out)?;
                download(b, &out)
            }
        }
        Op::Rope {
            n,
            heads,
            head_dim,
            first,
        } => {
            let table = rope_table(b, head_dim, first + n)?;
            let mut xb = b.upload(&x.a)?;
            let pos: Vec<u32> = (first..first + n).map(|p| p as u32).collect();
            b.rope(&mut xb, heads, head_dim, &table, &index(b, &pos)?)?;
            download(b, &xb)
        }
        Op::RopeQk {
            n,
            heads,
            kv_heads,
            head_dim,
            first,
        } => {
            let table = rope_table(b, head_dim, first + n)?;
            let (mut qb, mut kb) = (b.upload(&x.a)?, b.upload(&x.b)?);
            let pos: Vec<u32> = (first..first + n).map(|p| p as u32).collect();
            b.rope_qk(
                &mut qb,
                heads,
                &mut kb,
                kv_heads,
                head_dim,
                &table,
                &index(b, &pos)?,
            )?;
            let mut out = download(b, &qb)?;
            out.extend(download(b, &kb)?);
            Ok(out)
        }
        Op::WriteKv {
            kv,
            n,
            kv_heads,
            head_dim,
            first,
        } => {
            let layout = KvLayout {
                kv_heads,
                head_dim,
                capacity: first + n + 3,
            };
            let mut kc = b.upload_kv(&vec![7.0; layout.buffer_len()], kv)?;
            let mut vc = b.upload_kv(&vec![-7.0; layout.buffer_len()], kv)?;
            let pos: Vec<u32> = (first..first + n).map(|p| p as u32).collect();
            let (kb, vb) = (b.upload(&x.a)?, b.upload(&x.b)?);
            b.write_kv(&kb, &vb, &mut kc, &mut vc, layout, &index(b, &pos)?)?;
            download_caches(b, &kc, &vc, layout)
        }
        Op::HadamardRows { n, .. } => {
            let mut x_dev = b.upload(&x.a)?;
            b.hadamard_rows(&mut x_dev, n)?;
            download(b, &x_dev)
        }
        Op::KvarnDecode(ref c) => {
            let shape = kvarn_decode_shape(c);
            let (sink_half, tail_half) = (x.b.len() / 2, x.c.len() / 2);
            let mut sink_k = b.upload_kv(&x.b[..sink_half], KvDtype::F16)?;
            let mut sink_v = b.upload_kv(&x.b[sink_half..], KvDtype::F16)?;
            let mut tail_k = b.upload_kv(&x.c[..tail_half], KvDtype::F16)?;
            let mut tail_v = b.upload_kv(&x.c[tail_half..], KvDtype::F16)?;
            let records = kvarn_tile_store(b, c, &x.bytes)?;
            let units = kvarn_units_store(b, c, &x.units)?;
            let row = c.kv_heads * c.head_dim;
            let (q, k, v) = (
                b.upload(&x.a)?,
                b.upload(&x.d[..row])?,
                b.upload(&x.d[row..])?,
            );
            let positions = index(b, &x.ids)?;
            let mut out = poisoned(b, c.heads * c.head_dim)?;
            let mut scratch = poisoned(b, b.kvarn_decode_scratch_len(&shape))?;
            let layer = KvarnLayerMut {
                sink_k: &mut sink_k,
                sink_v: &mut sink_v,
                tiles: &records,
                tail_k: &mut tail_k,
                tail_v: &mut tail_v,
                units: units.as_ref(),
            };
            b.kvarn_decode(
                &q,
                &k,
                &v,
                layer,
                &shape,
                &positions,
                &mut scratch,
                &mut out,
            )?;
            let mut all = download(b, &out)?;
            let (stores, cap, r) = match kvarn_decode_slot(c) {
                KvarnSlot::Sink(r) => ([&sink_k, &sink_v], c.sinks, r),
                KvarnSlot::Tail(r) => ([&tail_k, &tail_v], KVARN_TILE, r),
            };
            for st in stores {
                let mut h = vec![0.0f32; c.kv_heads * cap * c.head_dim];
                b.download_kv(st, &mut h)?;
                all.extend(kvarn_slot_rows(&h, c, cap, r));
            }
            Ok(all)
        }
        Op::KvarnAttention(ref c) => {
            let shape = kvarn_shape(c);
            let (sink_half, tail_half) = (x.b.len() / 2, x.c.len() / 2);
            let sink_k = b.upload_kv(&x.b[..sink_half], KvDtype::F16)?;
            let sink_v = b.upload_kv(&x.b[sink_half..], KvDtype::F16)?;
            let tail_k = b.upload_kv(&x.c[..tail_half], KvDtype::F16)?;
            let tail_v = b.upload_kv(&x.c[tail_half..], KvDtype::F16)?;
            let records = kvarn_tile_store(b, c, &x.bytes)?;
            let units = kvarn_units_store(b, c, &x.units)?;
            let layer = KvarnLayer {
                sink_k: &sink_k,
                sink_v: &sink_v,
                tiles: &records,
                tail_k: &tail_k,
                tail_v: &tail_v,
                units: units.as_ref(),
            };
            let q = b.upload(&x.a)?;
            let mut out = poisoned(b, c.heads * c.head_dim)?;
            let mut scratch = poisoned(b, b.kvarn_scratch_len(&shape))?;
            b.kvarn_attention(&q, &layer, &shape, &mut scratch, &mut out)?;
            download(b, &out)
        }
        Op::Attention {
            kv,
            n,
            past,
            heads,
            kv_heads,
            head_dim,
        } => {
            let layout = attention_layout(kv_heads, head_dim, past, n);
            let kc = b.upload_kv(&kv_image(&x.b, kv_heads, head_dim, layout.capacity), kv)?;
            let vc = b.upload_kv(&kv_image(&x.c, kv_heads, head_dim, layout.capacity), kv)?;
            let shape = AttentionShape {
                n_heads: heads,
                kv: layout,
                past,
                n_queries: n,
            };
            let pos: Vec<u32> = (past..past + n).map(|p| p as u32).collect();
            let q = b.upload(&x.a)?;
            let mut scratch = b.alloc(b.attention_scratch_len(layout, heads).max(1))?;
            let mut out = poisoned(b, n * heads * head_dim)?;
            b.attention(
                &q,
                &kc,
                &vc,
                &shape,
                &index(b, &pos)?,
                &mut scratch,
                &mut out,
            )?;
            download(b, &out)
        }
        Op::RopeAttention {
            kv,
            n,
            past,
            heads,
            kv_heads,
            head_dim,
            caches,
        } => {
            let layout = attention_layout(kv_heads, head_dim, past, n);
            let row = kv_heads * head_dim;
            let (kc, vc) = fresh_kv_images(x, past, layout);
            let (mut kc, mut vc) = (b.upload_kv(&kc, kv)?, b.upload_kv(&vc, kv)?);
            let shape = AttentionShape {
                n_heads: heads,
                kv: layout,
                past,
                n_queries: n,
            };
            let pos: Vec<u32> = (past..past + n).map(|p| p as u32).collect();
            let table = rope_table(b, head_dim, past + n)?;
            let mut q = b.upload(&x.a)?;
            let mut k = b.upload(&x.b[past * row..])?;
            let v = b.upload(&x.c[past * row..])?;
            let mut scratch = b.alloc(b.attention_scratch_len(layout, heads).max(1))?;
            let mut out = poisoned(b, n * heads * head_dim)?;
            b.rope_write_kv_attention(
                &mut q,
                &mut k,
                &v,
                &table,
                &mut kc,
                &mut vc,
                &shape,
                &index(b, &pos)?,
                &mut scratch,
                &mut out,
            )?;
            if caches {
                download_caches(b, &kc, &vc, layout)
            } else {
                download(b, &out)
            }
        }
        Op::CodedEmbedding { vocab, cols, n, .. } => {
            let table = coded_linear(b, spec, x, (0, 0, vocab), None)?;
            let mut out = poisoned(b, n * cols)?;
            table.gather_rows(b, &index(b, &x.tokens)?, &mut out)?;
            download(b, &out)
        }
        Op::CodedLinear {
            m, rows, bias, acc, ..
        } => {
            let bias = bias.then(|| x.c.clone());
            let linear = coded_linear(b, spec, x, (0, 0, rows), bias)?;
            let xb = b.upload(&x.a)?;
            if acc {
                let mut y = b.upload(&x.d)?;
                let mut scratch = poisoned(b, m * rows)?;
                linear.forward_add(b, &xb, m, &mut y, &mut scratch)?;
                download(b, &y)
            } else {
                let mut y = poisoned(b, m * rows)?;
                linear.forward(b, &xb, m, &mut y)?;
                download(b, &y)
            }
        }
        Op::CodedProjections {
            m,
            cols,
            rows,
            bias,
            norm,
            ..
        } => {
            let mut linears = Vec::new();
            let mut off = 0;
            for (proj, &r) in rows.iter().enumerate() {
                let bi = bias.then(|| x.c[off..off + r].to_vec());
                linears.push(coded_linear(b, spec, x, (proj, off, r), bi)?);
                off += r;
            }
            let xb = b.upload(&x.a)?;
            let nw = b.upload(&x.d)?;
            let mut normed = poisoned(b, m * cols)?;
            let mut outs = rows
                .iter()
                .map(|&r| poisoned(b, m * r))
                .collect::<Result<Vec<_>>>()?;
            let parts: Option<Vec<_>> = linears.iter().map(|l| l.matrix_parts()).collect();
            match parts {
                Some(parts) => {
                    let mut items: Vec<GroupItem<'_, B>> = parts
                        .into_iter()
                        .zip(outs.iter_mut())
                        .map(|((weight, bias), out)| GroupItem::new(weight, bias, out))
                        .collect();
                    if norm {
                        b.rms_norm_matmul_group(&xb, &nw, 1e-5, &mut normed, m, &mut items)?;
                    } else {
                        b.matmul_t_group(&xb, m, &mut items)?;
                    }
                }
                None => {
                    let input = if norm {
                        b.rms_norm(&xb, &nw, 1e-5, &mut normed)?;
                        &normed
                    } else {
                        &xb
                    };
                    for (l, out) in linears.iter().zip(outs.iter_mut()) {
                        l.forward(b, input, m, out)?;
                    }
                }
            }
            let mut all = Vec::new();
            for o in &outs {
                all.extend(download(b, o)?);
            }
            Ok(all)
        }
        Op::CodedSwiglu {
            m,
            rows,
            cols,
            norm,
            ..
        } => {
            let wg = coded_linear(b, spec, x, (0, 0, rows), None)?;
            let wu = coded_linear(b, spec, x, (1, rows, rows), None)?;
            let xb = b.upload(&x.a)?;
            let nw = b.upload(&x.d)?;
            let mut normed = poisoned(b, m * cols)?;
            let mut gate = poisoned(b, m * rows)?;
            let mut up = poisoned(b, m * rows)?;
            match (wg.matrix_parts(), wu.matrix_parts()) {
                (Some((g, _)), Some((u, _))) if norm => {
                    b.rms_norm_swiglu(&xb, &nw, 1e-5, &mut normed, m, g, u, &mut gate, &mut up)?;
                }
                (Some((g, _)), Some((u, _))) => {
                    b.matmul_t_swiglu(&xb, m, g, u, &mut gate, &mut up)?;
                }
                _ => {
                    let input = if norm {
                        b.rms_norm(&xb, &nw, 1e-5, &mut normed)?;
                        &normed
                    } else {
                        &xb
                    };
                    wg.forward(b, input, m, &mut gate)?;
                    wu.forward(b, input, m, &mut up)?;
                    b.silu_mul(&mut gate, &up)?;
                }
            }
            download(b, &gate)
        }
        Op::RefinedProjections {
            kind,
            cols,
            rows,
            k,
            staged,
            norm,
            bias,
            ..
        } => execute_refined(b, spec, x, (kind, cols, rows, k, staged, norm, bias)),
        Op::SiluMul { .. } => {
            let mut g = b.upload(&x.a)?;
            b.silu_mul(&mut g, &b.upload(&x.b)?)?;
            download(b, &g)
        }
        Op::AddAssign { .. } => {
            let mut a = b.upload(&x.a)?;
            b.add_assign(&mut a, &b.upload(&x.b)?)?;
            download(b, &a)
        }
        Op::Argmax { rows, cols } => {
            let mut ids = index(b, &vec![u32::MAX; rows])?;
            b.argmax_rows(&b.upload(&x.a)?, cols, &mut ids)?;
            let mut out = vec![0u32; rows];
            b.download_index(&ids, &mut out)?;
            Ok(out.into_iter().map(|v| v as f32).collect())
        }
        Op::CopyRows {
            row_len, first, n, ..
        } => {
            let mut dst = poisoned(b, n * row_len)?;
            b.copy_rows(&b.upload(&x.a)?, row_len, first, &mut dst)?;
            download(b, &dst)
        }
        Op::ReadRows {
            row_len, first, n, ..
        } => {
            let mut out = vec![f32::NAN; n * row_len];
            b.read_rows(&b.upload(&x.a)?, row_len, first, &mut out)?;
            Ok(out)
        }
        Op::NibbleUnits { row_len, units } => {
            let unit_bytes = x.bytes.len() / units;
            let mut y = b.upload(&x.c)?;
            b.add_nibble_units(&mut y, row_len, 1, &x.bytes, unit_bytes, &x.a, &x.b)?;
            download(b, &y)
        }
        Op::SelectChannels {
            row_len, k, norm, ..
        } => {
            let rows = x.a.len() / row_len;
            let per_row = crate::refine::select::selected_count(k, row_len);
            let mut sel = b.alloc_index(rows * per_row)?;
            let mut values = b.alloc(rows * per_row)?;
            let w = b.upload(&x.d)?;
            let norm = norm.then_some((&w, CONFORMANCE_EPS));
            b.select_channels(&b.upload(&x.a)?, row_len, norm, k, &mut sel, &mut values)?;
            let mut out = vec![0u32; rows * per_row];
            b.download_index(&sel, &mut out)?;
            Ok(out.iter().map(|&i| i as f32).collect())
        }
        Op::SelectedColumns {
            row_len,
            k,
            outs,
            offset,
            norm,
            ..
        } => {
            let rows = x.a.len() / row_len;
            let per_row = crate::refine::select::selected_count(k, row_len);
            let xb = b.upload(&x.a)?;
            let w = b.upload(&x.d)?;
            let mut sel = b.alloc_index(rows * per_row)?;
            let mut values = b.alloc(rows * per_row)?;
            let norm = norm.then_some((&w, CONFORMANCE_EPS));
            b.select_channels(&xb, row_len, norm, k, &mut sel, &mut values)?;
            let mut store = b.alloc_host_byte_store(x.bytes.len())?;
            b.write_byte_store(&mut store, 0, &x.bytes)?;
            let dims: Vec<usize> = outs.iter().copied().filter(|&o| o > 0).collect();
            let mut scales = Vec::new();
            let mut ys = Vec::new();
            let (mut s0, mut y0) = (0, 0);
            for &o in &dims {
                scales.push(b.upload(&x.b[s0..s0 + o])?);
                ys.push(b.upload(&x.c[y0..y0 + rows * o])?);
                s0 += o;
                y0 += rows * o;
            }
            // Sized for this launch and for one into the first output alone (below).
            let first = &dims[..dims.len().min(1)];
            let mut scratch = b.alloc(
                b.selected_columns_scratch_len(rows, per_row, &dims)
                    .max(b.selected_columns_scratch_len(rows, per_row, first))
                    .max(1),
            )?;
            let mut aside = b.alloc((rows * first.iter().sum::<usize>()).max(1))?;
            let mut at = offset;
            let mut targets = Vec::new();
            for ((&o, sc), y) in dims.iter().zip(&scales).zip(ys.iter_mut()) {
                let unit_bytes = o.div_ceil(2);
                targets.push(crate::backend::refine::ColumnTarget {
                    store: &store,
                    offset: at,
                    unit_bytes,
                    scales: sc,
                    out: y,
                    accumulate: true,
                });
                at += unit_bytes * row_len;
            }
            // Twice, with a launch of another shape between them on the same scratch (the
            // engine keeps one for all of a step's sets): the second finds the scratch as
            // both left it.
            for pass in 0..2 {
                b.add_selected_columns(
                    rows,
                    row_len,
                    &sel,
                    &values,
                    per_row,
                    &mut targets,
                    &mut scratch,
                )?;
                if let (0, [first], true) = (pass, first, dims.len() > 1) {
                    b.add_selected_columns(
                        rows,
                        row_len,
                        &sel,
                        &values,
                        per_row,
                        &mut [crate::backend::refine::ColumnTarget {
                            store: &store,
                            offset,
                            unit_bytes: first.div_ceil(2),
                            scales: &scales[0],
                            out: &mut aside,
                            accumulate: true,
                        }],
                        &mut scratch,
                    )?;
                }
            }
            let mut out = Vec::new();
            for y in &ys {
                out.extend(download(b, y)?);
            }
            Ok(out)
        }
        Op::LeadColumns {
            rows,
            row_len,
            k,
            outs,
            offset,
            norm,
        } => {
            let per_row = crate::refine::select::selected_count(k, row_len);
            let (real, earlier) = x.a.split_at(rows * row_len);
            let w = b.upload(&x.d)?;
            let norm = norm.then_some((&w, CONFORMANCE_EPS));
            let mut sel = b.alloc_index(rows * per_row)?;
            let mut values = b.alloc(rows * per_row)?;
            b.select_channels(&b.upload(earlier)?, row_len, norm, k, &mut sel, &mut values)?;
            b.gather_selected_values(&b.upload(real)?, row_len, norm, &sel, per_row, &mut values)?;
            let mut store = b.alloc_host_byte_store(x.bytes.len())?;
            b.write_byte_store(&mut store, 0, &x.bytes)?;
            let identity: Vec<u32> = (0..(rows * per_row) as u32).collect();
            let mut id = b.alloc_index(identity.len())?;
            b.write_index(&mut id, &identity)?;
            let dims: Vec<usize> = outs.iter().copied().filter(|&o| o > 0).collect();
            // Every projection staged by one call, as fetch lead stages a set.
            let mut staged = dims
                .iter()
                .map(|&o| b.alloc_byte_store(rows * per_row * o.div_ceil(2)))
                .collect::<Result<Vec<_>>>()?;
            let mut at = offset;
            let mut targets = Vec::new();
            for (&o, dst) in dims.iter().zip(staged.iter_mut()) {
                let unit_bytes = o.div_ceil(2);
                targets.push(crate::backend::refine::StageTarget {
                    store: &store,
                    offset: at,
                    unit_bytes,
                    dst,
                });
                at += unit_bytes * row_len;
            }
            b.stage_selected_units(rows, row_len, &sel, per_row, &mut targets)?;
            let (mut s0, mut y0) = (0, 0);
            let mut out = Vec::new();
            for (&o, staged) in dims.iter().zip(&staged) {
                let unit_bytes = o.div_ceil(2);
                let scales = b.upload(&x.b[s0..s0 + o])?;
                let mut y = b.upload(&x.c[y0..y0 + rows * o])?;
                let mut scratch =
                    b.alloc(b.selected_columns_scratch_len(rows, per_row, &[o]).max(1))?;
                // Row r's staged columns are units r·per_row.. of `staged`: read through the
                // identity index, as rows of `rows · per_row` columns.
                b.add_selected_columns(
                    rows,
                    rows * per_row,
                    &id,
                    &values,
                    per_row,
                    &mut [crate::backend::refine::ColumnTarget {
                        store: staged,
                        offset: 0,
                        unit_bytes,
                        scales: &scales,
                        out: &mut y,
                        accumulate: true,
                    }],
                    &mut scratch,
                )?;
                out.extend(download(b, &y)?);
                s0 += o;
                y0 += rows * o;
            }
            Ok(out)
        }
        Op::Random { dtype, rows, cols } => {
            let seed = (u64::from(x.ids[0]) << 32) | u64::from(x.ids[1]);
            let m = b.random_matrix(rows, cols, dtype, seed, 0.37)?;
            // Read back through a matvec with unit vectors would round; an embedding of
            // every row returns the stored values exactly.
            let ids: Vec<u32> = (0..rows as u32).collect();
            let mut out = poisoned(b, rows * cols)?;
            b.embedding(&m, &index(b, &ids)?, &mut out)?;
            download(b, &out)
        }
        Op::Decode {
            preset,
            prompt,
            steps,
            graphs,
            weights,
            refine,
        } => {
            let config = crate::synthetic::preset(preset)?;
            let options = ModelOptions {
                step_graphs: graphs,
                ..ModelOptions::default()
            };
            // One backend value per model: models own theirs.
            let model = synthetic_model(b.clone(), &config, weights, &options)?;
            let mut refiner = decode_refiner(b, &config, refine)?;
            let vocab = config.vocab_size as u32;
            let mut cache = model.new_cache(prompt + steps)?;
            let mut forward = |tokens: &[u32], mode| match refiner.as_mut() {
                Some(r) => model.forward_refined(tokens, &mut cache, mode, r),
                None => model.forward(tokens, &mut cache, mode),
            };
            let first: Vec<u32> = x.ids[..prompt].iter().map(|t| t % vocab).collect();
            let mut out = forward(&first, crate::LogitsMode::All)?.into_vec();
            for s in 0..steps {
                let t = x.ids[prompt + s] % vocab;
                out.extend(forward(&[t], crate::LogitsMode::Last)?.into_vec());
            }
            Ok(out)
        }
    }
}

/// [`Op::RefinedProjections`] on a backend: the ops the graph calls with the refinements
/// where the backend holds the codes as its matrices (one launch each on CUDA for group
/// codes), else each projection and [`crate::backend::refine::apply_fused_columns`].
#[allow(clippy::type_complexity)]
fn execute_refined<B: ResidentKernels>(
    b: &B,
    spec: &Op,
    x: &Inputs,
    (kind, cols, rows, k, staged, norm, bias): (
        RefinedKind,
        usize,
        [usize; 3],
        usize,
        bool,
        bool,
        bool,
    ),
) -> Result<Vec<f32>> {
    use crate::backend::refine::{apply_fused_columns, FusedColumns};
    let dims: Vec<usize> = rows.iter().copied().filter(|&r| r > 0).collect();
    let chosen = naive_select(&naive_select_input(&x.a, &x.d, cols, norm), cols, k);
    let chosen: Vec<u32> = chosen.iter().map(|&c| c as u32).collect();
    let selected = chosen.len();
    let sel = index(b, &chosen)?;
    let (mut stores, mut scales, mut linears) = (Vec::new(), Vec::new(), Vec::new());
    let (mut at, mut off) = (0, 0);
    for (p, &r) in dims.iter().enumerate() {
        let unit = r.div_ceil(2);
        let columns = &x.units[at..at + unit * cols];
        let store = if staged {
            let bytes: Vec<u8> = chosen
                .iter()
                .flat_map(|&c| &columns[c as usize * unit..][..unit])
                .copied()
                .collect();
            let mut st = b.alloc_byte_store(bytes.len())?;
            b.write_byte_store(&mut st, 0, &bytes)?;
            st
        } else {
            let mut st = b.alloc_host_byte_store(columns.len())?;
            b.write_byte_store(&mut st, 0, columns)?;
            st
        };
        stores.push(store);
        scales.push(b.upload(&x.e[off..off + r])?);
        let bi = bias.then(|| x.c[off..off + r].to_vec());
        linears.push(coded_linear(b, spec, x, (p, off, r), bi)?);
        at += unit * cols;
        off += r;
    }
    let fused: Vec<FusedColumns<'_, B>> = dims
        .iter()
        .zip(stores.iter().zip(&scales))
        .map(|(&r, (store, sc))| FusedColumns {
            sel: &sel,
            selected,
            store,
            staged,
            unit_bytes: r.div_ceil(2),
            scales: sc,
        })
        .collect();
    let xb = b.upload(&x.a)?;
    let nw = b.upload(&x.d)?;
    let norm_arg = norm.then_some((&nw, 1e-5f32));
    let mut normed = poisoned(b, cols)?;
    let mut outs = match kind {
        RefinedKind::Accumulate => vec![b.upload(&x.d)?],
        _ => dims
            .iter()
            .map(|&r| poisoned(b, r))
            .collect::<Result<Vec<_>>>()?,
    };
    let parts: Option<Vec<_>> = linears.iter().map(|l| l.matrix_parts()).collect();
    match (kind, parts) {
        (RefinedKind::Group, Some(parts)) => {
            let mut items: Vec<GroupItem<'_, B>> = parts
                .into_iter()
                .zip(outs.iter_mut())
                .zip(&fused)
                .map(|(((w, bi), out), f)| GroupItem {
                    refine: Some(*f),
                    ..GroupItem::new(w, bi, out)
                })
                .collect();
            if norm {
                b.rms_norm_matmul_group(&xb, &nw, 1e-5, &mut normed, 1, &mut items)?;
            } else {
                b.matmul_t_group(&xb, 1, &mut items)?;
            }
        }
        (RefinedKind::Swiglu, Some(parts)) => {
            let [(g, _), (u, _)] = parts.as_slice() else {
                return Err(RuntimeError::EmptyInput);
            };
            let (gate, rest) = outs.split_at_mut(1);
            b.rms_norm_swiglu_refined(
                &xb,
                &nw,
                1e-5,
                &mut normed,
                1,
                g,
                u,
                &mut gate[0],
                &mut rest[0],
                [&fused[0], &fused[1]],
            )?;
            outs.truncate(1);
        }
        (RefinedKind::Accumulate, Some(parts)) => {
            let (w, bi) = parts[0];
            b.matmul_t_refined(
                &xb,
                1,
                w,
                bi,
                &mut outs[0],
                MatmulOut::Accumulate,
                Some(&fused[0]),
                &[],
            )?;
        }
        // Formats the backend's matrices do not hold: each projection, then its refinement.
        (_, None) => {
            let input = match norm_arg {
                Some((w, eps)) => {
                    b.rms_norm(&xb, w, eps, &mut normed)?;
                    &normed
                }
                None => &xb,
            };
            let mut tmp = poisoned(b, dims[0])?;
            for (p, l) in linears.iter().enumerate() {
                if kind == RefinedKind::Accumulate {
                    l.forward_add(b, input, 1, &mut outs[p], &mut tmp)?;
                } else {
                    l.forward(b, input, 1, &mut outs[p])?;
                }
                apply_fused_columns(b, input, cols, None, &fused[p], &mut outs[p])?;
            }
            if kind == RefinedKind::Swiglu {
                let (gate, rest) = outs.split_at_mut(1);
                b.silu_mul(&mut gate[0], &rest[0])?;
                outs.truncate(1);
            }
        }
    }
    let mut all = Vec::new();
    for o in &outs {
        all.extend(download(b, o)?);
    }
    Ok(all)
}

fn rope_table<B: Backend>(b: &B, head_dim: usize, positions: usize) -> Result<RopeTable<B>> {
    let inv: Vec<f32> = (0..head_dim / 2)
        .map(|j| (1e4f64.powf(-(2.0 * j as f64) / head_dim as f64)) as f32)
        .collect();
    let (cos, sin) = rope_cos_sin(&inv, 0, positions);
    Ok(RopeTable {
        cos: b.upload(&cos)?,
        sin: b.upload(&sin)?,
        positions,
        half: head_dim / 2,
    })
}

/// The op in plain f64 loops, from the same inputs (the CPU backend's reference).
fn naive(spec: &Op, x: &Inputs) -> Option<Vec<f64>> {
    let f = |v: &[f32]| v.iter().map(|&a| a as f64).collect::<Vec<f64>>();
    Some(match *spec {
        Op::Embedding { dtype, cols, .. } => {
            let t = rounded(&x.a, dtype);
            x.ids
                .iter()
                .flat_map(|&id| {
                    t[id as usize * cols..][..cols]
                        .iter()
                        .map(|&v| v as f64)
                        .collect::<Vec<_>>()
                })
                .collect()
        }
        Op::Matmul {
            dtype,
            m,
            rows,
            cols,
            bias,
            acc,
        } => naive_xwt(&rounded(&x.b, dtype), x, m, rows, cols, bias, acc),
        Op::MatmulGroup {
            dtype,
            m,
            cols,
            rows,
            bias,
            norm,
        } => {
            let w = rounded(&x.b, dtype);
            stacked_reference(&w, &normed_input(x, norm), x, m, cols, &rows, bias)
        }
        Op::Swiglu {
            dtype,
            m,
            rows,
            cols,
            norm,
        } => swiglu_reference(&rounded(&x.b, dtype), &normed_input(x, norm), m, rows, cols),
        Op::RmsNorm { cols, in_place, .. } => {
            let eps = if in_place { 1e-6 } else { 1e-5 };
            x.a.chunks(cols)
                .flat_map(|row| {
                    let ms: f64 =
                        row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / cols as f64;
                    let inv = 1.0 / (ms + eps).sqrt();
                    row.iter()
                        .zip(&x.b)
                        .map(move |(&v, &w)| v as f64 * inv * w as f64)
                        .collect::<Vec<_>>()
                })
                .collect()
        }
        Op::Rope {
            n,
            heads,
            head_dim,
            first,
        } => naive_rope(&x.a, n, heads, head_dim, first),
        Op::RopeQk {
            n,
            heads,
            kv_heads,
            head_dim,
            first,
        } => {
            let mut out = naive_rope(&x.a, n, heads, head_dim, first);
            out.extend(naive_rope(&x.b, n, kv_heads, head_dim, first));
            out
        }
        Op::WriteKv {
            kv,
            n,
            kv_heads,
            head_dim,
            first,
        } => {
            let cap = first + n + 3;
            let mut k = vec![kv_rounded(&[7.0], kv)[0] as f64; kv_heads * cap * head_dim];
            let mut v = vec![kv_rounded(&[-7.0], kv)[0] as f64; kv_heads * cap * head_dim];
            let (kr, vr) = (kv_rounded(&x.a, kv), kv_rounded(&x.b, kv));
            for t in 0..n {
                for h in 0..kv_heads {
                    for c in 0..head_dim {
                        let src = (t * kv_heads + h) * head_dim + c;
                        let dst = (h * cap + first + t) * head_dim + c;
                        k[dst] = kr[src] as f64;
                        v[dst] = vr[src] as f64;
                    }
                }
            }
            k.extend(v);
            k
        }
        Op::KvarnAttention(ref c) => naive_kvarn(c, x)?,
        Op::KvarnDecode(ref c) => naive_kvarn_decode(c, x)?,
        Op::HadamardRows { n, .. } => {
            // H[i][j] = (−1)^popcount(i & j) / √n, as a matrix product.
            let scale = 1.0 / (n as f64).sqrt();
            x.a.chunks_exact(n)
                .flat_map(|row| {
                    (0..n).map(move |i| {
                        row.iter()
                            .enumerate()
                            .map(|(j, &v)| {
                                let sign = if (i & j).count_ones() % 2 == 0 {
                                    1.0
                                } else {
                                    -1.0
                                };
                                sign * v as f64
                            })
                            .sum::<f64>()
                            * scale
                    })
                })
                .collect()
        }
        Op::Attention {
            kv,
            n,
            past,
            heads,
            kv_heads,
            head_dim,
        } => {
            let (kr, vr) = (kv_rounded(&x.b, kv), kv_rounded(&x.c, kv));
            let d = head_dim;
            let scale = 1.0 / (d as f64).sqrt();
            let g = heads / kv_heads;
            let mut out = vec![0.0f64; n * heads * d];
            for t in 0..n {
                let len = past + t + 1;
                for h in 0..heads {
                    let kh = h / g;
                    let q = &x.a[(t * heads + h) * d..][..d];
                    let scores: Vec<f64> = (0..len)
                        .map(|p| {
                            let k = &kr[(p * kv_heads + kh) * d..][..d];
                            q.iter()
                                .zip(k)
                                .map(|(&a, &b)| a as f64 * b as f64)
                                .sum::<f64>()
                                * scale
                        })
                        .collect();
                    let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                    let sum: f64 = w.iter().sum();
                    for (p, wp) in w.iter().enumerate() {
                        let v = &vr[(p * kv_heads + kh) * d..][..d];
                        for c in 0..d {
                            out[(t * heads + h) * d + c] += wp / sum * v[c] as f64;
                        }
                    }
                }
            }
            out
        }
        Op::RopeAttention {
            kv,
            n,
            past,
            heads,
            kv_heads,
            head_dim,
            caches,
        } => {
            let row = kv_heads * head_dim;
            let f32s = |v: Vec<f64>| v.into_iter().map(|a| a as f32).collect::<Vec<f32>>();
            let q = f32s(naive_rope(&x.a, n, heads, head_dim, past));
            let mut k = x.b[..past * row].to_vec();
            k.extend(f32s(naive_rope(
                &x.b[past * row..],
                n,
                kv_heads,
                head_dim,
                past,
            )));
            let rotated = Inputs {
                a: q,
                b: k,
                c: x.c.clone(),
                ..Inputs::default()
            };
            if caches {
                let layout = attention_layout(kv_heads, head_dim, past, n);
                let (kc, vc) = fresh_kv_images(&rotated, past + n, layout);
                let mut img = f(&kv_rounded(&kc, kv));
                img.extend(f(&kv_rounded(&vc, kv)));
                img
            } else {
                let attention = Op::Attention {
                    kv,
                    n,
                    past,
                    heads,
                    kv_heads,
                    head_dim,
                };
                naive(&attention, &rotated)?
            }
        }
        Op::SiluMul { .. } => {
            x.a.iter()
                .zip(&x.b)
                .map(|(&g, &u)| g as f64 / (1.0 + (-(g as f64)).exp()) * u as f64)
                .collect()
        }
        Op::AddAssign { .. } => {
            x.a.iter()
                .zip(&x.b)
                .map(|(&a, &b)| (a + b) as f64)
                .collect()
        }
        Op::Argmax { cols, .. } => {
            x.a.chunks(cols)
                .map(|row| {
                    let mut best = 0;
                    for (i, &v) in row.iter().enumerate() {
                        if v > row[best] {
                            best = i;
                        }
                    }
                    best as f64
                })
                .collect()
        }
        Op::CopyRows {
            row_len, first, n, ..
        }
        | Op::ReadRows {
            row_len, first, n, ..
        } => f(&x.a[first * row_len..(first + n) * row_len]),
        Op::NibbleUnits { row_len, units } => {
            let unit_bytes = x.bytes.len() / units;
            let mut y = f(&x.c);
            for e in 0..row_len {
                let mut acc = 0.0f64;
                for j in 0..units {
                    let byte = x.bytes[j * unit_bytes + e / 2];
                    let nib = if e % 2 == 1 { byte >> 4 } else { byte & 15 };
                    acc += x.a[j] as f64 * (nib as i32 - 8) as f64;
                }
                y[row_len + e] += acc * x.b[e] as f64;
            }
            y
        }
        Op::SelectChannels {
            row_len, k, norm, ..
        } => naive_select(&naive_select_input(&x.a, &x.d, row_len, norm), row_len, k)
            .iter()
            .map(|&i| i as f64)
            .collect(),
        Op::SelectedColumns {
            row_len,
            k,
            outs,
            offset,
            norm,
            ..
        } => {
            let xs = naive_select_input(&x.a, &x.d, row_len, norm);
            let sel = naive_select(&xs, row_len, k);
            // Twice, as the case applies it.
            naive_columns(x, &xs, &sel, row_len, &outs, offset, 2.0)
        }
        Op::LeadColumns {
            rows,
            row_len,
            k,
            outs,
            offset,
            norm,
        } => {
            let (real, earlier) = x.a.split_at(rows * row_len);
            let sel = naive_select(
                &naive_select_input(earlier, &x.d, row_len, norm),
                row_len,
                k,
            );
            let xs = naive_select_input(real, &x.d, row_len, norm);
            naive_columns(x, &xs, &sel, row_len, &outs, offset, 1.0)
        }
        Op::CodedEmbedding { vocab, cols, .. } => {
            let w = coded_dequant(spec, x, &[vocab]).ok()?;
            x.tokens
                .iter()
                .flat_map(|&t| f(&w[t as usize * cols..][..cols]))
                .collect()
        }
        Op::CodedLinear {
            m,
            rows,
            cols,
            bias,
            acc,
            ..
        } => {
            let w = coded_dequant(spec, x, &[rows]).ok()?;
            naive_xwt(&w, x, m, rows, cols, bias, acc)
        }
        Op::CodedProjections {
            m,
            cols,
            rows,
            bias,
            norm,
            ..
        } => {
            let w = coded_dequant(spec, x, &rows).ok()?;
            stacked_reference(&w, &normed_input(x, norm), x, m, cols, &rows, bias)
        }
        Op::CodedSwiglu {
            m,
            rows,
            cols,
            norm,
            ..
        } => {
            let w = coded_dequant(spec, x, &[rows, rows]).ok()?;
            swiglu_reference(&w, &normed_input(x, norm), m, rows, cols)
        }
        Op::RefinedProjections {
            kind,
            cols,
            rows,
            k,
            norm,
            bias,
            ..
        } => {
            let dims: Vec<usize> = rows.iter().copied().filter(|&r| r > 0).collect();
            let w = coded_dequant(spec, x, &dims).ok()?;
            let xs = if kind == RefinedKind::Accumulate {
                normed_input(x, false)
            } else {
                normed_input(x, norm)
            };
            let sel = naive_select(&naive_select_input(&x.a, &x.d, cols, norm), cols, k);
            let mut y = stacked_reference(&w, &xs, x, 1, cols, &dims, bias);
            // Each projection's refinement: Σ_j x̂_{c_j} · level(C[:, c_j]) ⊙ scales.
            let (mut at, mut off) = (0, 0);
            for &r in &dims {
                let unit = r.div_ceil(2);
                for e in 0..r {
                    let d: f64 = sel
                        .iter()
                        .map(|&c| {
                            let byte = x.units[at + c * unit + e / 2];
                            let nib = if e % 2 == 1 { byte >> 4 } else { byte & 15 };
                            xs[c] * f64::from(i32::from(nib) - 8)
                        })
                        .sum();
                    y[off + e] += d * f64::from(x.e[off + e]);
                }
                at += unit * cols;
                off += r;
            }
            match kind {
                RefinedKind::Group => y,
                RefinedKind::Accumulate => y
                    .iter()
                    .zip(&x.d)
                    .map(|(v, &y0)| v + f64::from(y0))
                    .collect(),
                RefinedKind::Swiglu => {
                    let (g, u) = y.split_at(dims[0]);
                    g.iter()
                        .zip(u)
                        .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
                        .collect()
                }
            }
        }
        Op::Random { dtype, rows, cols } => {
            let seed = (u64::from(x.ids[0]) << 32) | u64::from(x.ids[1]);
            let v: Vec<f32> = (0..rows * cols)
                .map(|i| crate::backend::synthetic_value(seed, i as u64) * 0.37)
                .collect();
            f(&rounded(&v, dtype))
        }
        // The model's reference is the CPU backend.
        Op::Decode { .. } => return None,
    })
}

/// `x.c + times · Σ_{i ∈ sel} xs_i · level(C[:, i]) ⊙ scales` in f64 for each projection of
/// `outs` (0 = absent) and row of `xs`: the columns of `ceil(o/2)` bytes lie in `x.bytes` from
/// `offset` on, projection after projection, their scales in `x.b` and the outputs' start
/// values in `x.c`.
fn naive_columns(
    x: &Inputs,
    xs: &[f64],
    sel: &[usize],
    row_len: usize,
    outs: &[usize],
    offset: usize,
    times: f64,
) -> Vec<f64> {
    let rows = xs.len() / row_len;
    let per_row = sel.len() / rows.max(1);
    let mut y: Vec<f64> = x.c.iter().map(|&v| v as f64).collect();
    let (mut s0, mut y0, mut at) = (0, 0, offset);
    for &o in outs.iter().filter(|&&o| o > 0) {
        let unit_bytes = o.div_ceil(2);
        for r in 0..rows {
            for e in 0..o {
                let mut acc = 0.0f64;
                for &i in &sel[r * per_row..(r + 1) * per_row] {
                    let byte = x.bytes[at + i * unit_bytes + e / 2];
                    let nib = if e % 2 == 1 { byte >> 4 } else { byte & 15 };
                    acc += xs[r * row_len + i] * (nib as i32 - 8) as f64;
                }
                y[y0 + r * o + e] += times * acc * x.b[s0 + e] as f64;
            }
        }
        s0 += o;
        y0 += rows * o;
        at += unit_bytes * row_len;
    }
    y
}

/// `y = x.a · wᵀ (+ x.c) (+ x.d)` in f64: the reference of every projection case.
#[allow(clippy::too_many_arguments)]
/// A KVarN attention case: positions per KV head (the stores' capacities are at least one
/// row or tile, so no store is empty).
#[derive(Debug, Clone)]
pub struct KvarnCase {
    bits: KvBits,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    sinks: usize,
    tiles: usize,
    tail: usize,
    /// Eq. 7/8 refinement from units the CPU encoder wrote with the tiles.
    refine: Option<KvarnRefineSpec>,
}

const KVARN_TILE: usize = 128;

fn kvarn_shape(c: &KvarnCase) -> KvarnShape {
    KvarnShape {
        n_heads: c.heads,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        bits: c.bits,
        tile_tokens: KVARN_TILE,
        sinks: c.sinks,
        sink_capacity: c.sinks.max(1),
        tiles: c.tiles,
        tile_capacity: c.tiles.max(1),
        tail: c.tail,
        tail_capacity: c.tail.max(1),
        refine: c.refine,
    }
}

/// `[kv_heads, max(tiles, 1), record]` tile records of random keys and values, encoded by the
/// CPU's KVarN encoder (the unused capacity stays zero); with refinement, the units the
/// encoder's sub-interval indices pack into (`[kv_heads, max(tiles, 1), groups, unit]`).
fn kvarn_records(c: &KvarnCase, rng: &mut Rng) -> (Vec<u8>, Vec<u8>) {
    let Ok(base) = Kvarn::with_tile(c.bits, c.head_dim, KVARN_TILE) else {
        return (Vec::new(), Vec::new()); // the op then reports the bad geometry itself
    };
    let d = c.head_dim;
    let (rec, cap, n) = (base.tile_bytes(), c.tiles.max(1), KVARN_TILE * d);
    let bits = c.refine.map_or(RefineBits::NONE, |r| r.bits);
    let (group, unit) = c
        .refine
        .map_or((KVARN_TILE, 0), |r| (r.group, r.unit_bytes(d)));
    let per_tile = KVARN_TILE / group;
    let mut bytes = vec![0u8; c.kv_heads * cap * rec];
    let mut units = vec![0u8; c.kv_heads * cap * per_tile * unit];
    let (mut ks, mut vs) = (vec![0u8; n], vec![0u8; n]);
    for h in 0..c.kv_heads {
        for t in 0..c.tiles {
            let (keys, values) = (rng.vec(n, 1.5), rng.vec(n, 1.0));
            let out = &mut bytes[(h * cap + t) * rec..][..rec];
            if c.refine.is_none() {
                base.encode_tile(&keys, &values, bits, out, &mut [], &mut []);
                continue;
            }
            base.encode_tile(&keys, &values, bits, out, &mut ks, &mut vs);
            for g in 0..per_tile {
                let u = &mut units[((h * cap + t) * per_tile + g) * unit..][..unit];
                let rows = g * group * d..(g + 1) * group * d;
                crate::kv::bitpack::pack(&ks[rows.clone()], bits.key, u, 0);
                crate::kv::bitpack::pack(&vs[rows], bits.value, u, group * d * bits.key as usize);
            }
        }
    }
    (bytes, units)
}

/// The case's refinement units in host memory the device reads ([`Backend::alloc_host_byte_store`]),
/// filled one tile's units at a time as the cache fills them; none without refinement.
fn kvarn_units_store<B: Backend>(
    b: &B,
    c: &KvarnCase,
    units: &[u8],
) -> Result<Option<B::ByteStore>> {
    let Some(r) = c.refine else {
        return Ok(None);
    };
    let tile_units = (KVARN_TILE / r.group) * r.unit_bytes(c.head_dim);
    let store = b.alloc_host_byte_store(units.len())?;
    fill_checked(b, store, units, tile_units, "refinement unit").map(Some)
}

/// The position whose decode step sees the case's fill: the last sink, or the tail's last row.
fn kvarn_decode_position(c: &KvarnCase) -> usize {
    if c.tiles == 0 && c.tail == 0 {
        c.sinks.saturating_sub(1)
    } else {
        c.sinks + c.tiles * KVARN_TILE + c.tail.saturating_sub(1)
    }
}

/// Where a decode case's step writes its rows.
fn kvarn_decode_slot(c: &KvarnCase) -> KvarnSlot {
    kvarn_decode_shape(c).decode_at(kvarn_decode_position(c)).1
}

/// Row `r` of every KV head of a `[kv_heads, cap, d]` store.
fn kvarn_slot_rows(store: &[f32], c: &KvarnCase, cap: usize, r: usize) -> Vec<f32> {
    let d = c.head_dim;
    (0..c.kv_heads)
        .flat_map(|h| store[(h * cap + r) * d..][..d].to_vec())
        .collect()
}

/// A decode case's geometry: sink capacity `sinks`, the tail one tile.
fn kvarn_decode_shape(c: &KvarnCase) -> KvarnShape {
    KvarnShape {
        sink_capacity: c.sinks,
        tail_capacity: KVARN_TILE,
        ..kvarn_shape(c)
    }
}

/// Rows of `d` values times the normalised Sylvester Hadamard matrix, in f64.
fn hadamard_f64(x: &[f64], d: usize) -> Vec<f64> {
    let scale = 1.0 / (d as f64).sqrt();
    x.chunks_exact(d)
        .flat_map(|row| {
            (0..d).map(move |i| {
                let dot: f64 = (0..d)
                    .map(|j| {
                        if (i & j).count_ones() % 2 == 0 {
                            row[j]
                        } else {
                            -row[j]
                        }
                    })
                    .sum();
                dot * scale
            })
        })
        .collect()
}

/// f64 decode step: the query rotated exactly; the key and value rows rotated by the CPU's
/// f32 transform (the `hadamard_rows` cases check it against the exact product) and rounded
/// to FP16 into their slot — rotated exactly, an element within float rounding of an FP16
/// rounding boundary would land one FP16 step away from any f32 device's row; attention as
/// [`naive_kvarn`] over the fill the position sees, the output rotated back exactly; then
/// the stores as written.
fn naive_kvarn_decode(c: &KvarnCase, x: &Inputs) -> Option<Vec<f64>> {
    let (d, kv) = (c.head_dim, c.kv_heads);
    let f64s = |v: &[f32]| v.iter().map(|&a| a as f64).collect::<Vec<f64>>();
    let r16 = |v: f64| f16::from_f32(v as f32).to_f32();
    let q = hadamard_f64(&f64s(&x.a), d);
    let mut kv32 = x.d.clone();
    let level = crate::backend::cpu::SimdLevel::detect();
    let (_, scale) = crate::backend::kvarn::hadamard_rows_check(kv32.len(), d).ok()?;
    kv32.chunks_exact_mut(d)
        .for_each(|row| crate::resident::hadamard::fwht_scaled(level, row, scale));
    let kvr = f64s(&kv32);
    let mut sinks: Vec<f32> = x.b.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
    let mut tail: Vec<f32> = x.c.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
    let slot = kvarn_decode_slot(c);
    let (store, cap, r) = match slot {
        KvarnSlot::Sink(r) => (&mut sinks, c.sinks, r),
        KvarnSlot::Tail(r) => (&mut tail, KVARN_TILE, r),
    };
    let half = store.len() / 2;
    for h in 0..kv {
        for ch in 0..d {
            store[(h * cap + r) * d + ch] = r16(kvr[h * d + ch]);
            store[half + (h * cap + r) * d + ch] = r16(kvr[(kv + h) * d + ch]);
        }
    }
    // naive_kvarn's stores hold exactly the filled rows: sinks fill their capacity here; the
    // tail is cut to its `tail` rows.
    let th = tail.len() / 2;
    let mut tail_fill = Vec::with_capacity(2 * kv * c.tail.max(1) * d);
    for part in [&tail[..th], &tail[th..]] {
        for h in 0..kv {
            let rows = &part[h * KVARN_TILE * d..][..c.tail.max(1) * d];
            tail_fill.extend_from_slice(rows);
        }
    }
    let view = Inputs {
        a: q.iter().map(|&v| v as f32).collect(),
        b: sinks.clone(),
        c: tail_fill,
        bytes: x.bytes.clone(),
        units: x.units.clone(),
        ..Inputs::default()
    };
    let out = naive_kvarn(c, &view)?;
    let mut all = hadamard_f64(&out, d);
    let (written, cap) = match slot {
        KvarnSlot::Sink(_) => (&sinks, c.sinks),
        KvarnSlot::Tail(_) => (&tail, KVARN_TILE),
    };
    let half = written.len() / 2;
    for part in [&written[..half], &written[half..]] {
        all.extend(kvarn_slot_rows(part, c, cap, r).iter().map(|&v| v as f64));
    }
    Some(all)
}

/// The case's tile store as the cache fills it: a zeroed store, one record written at a time,
/// then read back and compared ([`fill_checked`]).
fn kvarn_tile_store<B: Backend>(b: &B, c: &KvarnCase, bytes: &[u8]) -> Result<B::ByteStore> {
    let Ok(base) = Kvarn::with_tile(c.bits, c.head_dim, KVARN_TILE) else {
        return b.upload_byte_store(bytes); // the op reports the bad geometry itself
    };
    let store = b.alloc_byte_store(bytes.len())?;
    fill_checked(b, store, bytes, base.tile_bytes(), "record")
}

/// `bytes` written into `store` `piece` bytes at a time ([`Backend::write_byte_store`]), then
/// read back in two reads, one at an offset, and compared byte for byte.
fn fill_checked<B: Backend>(
    b: &B,
    mut store: B::ByteStore,
    bytes: &[u8],
    piece: usize,
    what: &str,
) -> Result<B::ByteStore> {
    let piece = piece.max(1);
    for (i, p) in bytes.chunks(piece).enumerate() {
        b.write_byte_store(&mut store, i * piece, p)?;
    }
    let mut back = vec![0u8; bytes.len()];
    let half = (bytes.len() / piece / 2) * piece;
    b.read_byte_store(&store, 0, &mut back[..half])?;
    b.read_byte_store(&store, half, &mut back[half..])?;
    if let Some(at) = back.iter().zip(bytes).position(|(a, b)| a != b) {
        return Err(RuntimeError::Shape {
            op: "read_byte_store",
            msg: format!("byte {at} read back differs from the {what} written"),
        });
    }
    Ok(store)
}

/// f64 attention over the positions a KVarN layer stores: FP16 rows rounded as the stores
/// round them, tile rows as the CPU decoder reconstructs them.
fn naive_kvarn(c: &KvarnCase, x: &Inputs) -> Option<Vec<f64>> {
    let base = Kvarn::with_tile(c.bits, c.head_dim, KVARN_TILE).ok()?;
    let (d, g, rec) = (c.head_dim, c.heads / c.kv_heads, base.tile_bytes());
    let (sc, tc, cap) = (c.sinks.max(1), c.tail.max(1), c.tiles.max(1));
    let (sink_half, tail_half) = (x.b.len() / 2, x.c.len() / 2);
    let r16 = |v: &[f32]| -> Vec<f64> {
        v.iter()
            .map(|&a| f16::from_f32(a).to_f32() as f64)
            .collect()
    };
    let mut out = vec![0.0f64; c.heads * d];
    let (mut kc, mut vt) = (vec![0.0f32; d * KVARN_TILE], vec![0.0f32; KVARN_TILE * d]);
    for h in 0..c.kv_heads {
        let mut keys: Vec<Vec<f64>> = Vec::new();
        let mut values: Vec<Vec<f64>> = Vec::new();
        for t in 0..c.sinks {
            keys.push(r16(&x.b[(h * sc + t) * d..][..d]));
            values.push(r16(&x.b[sink_half + (h * sc + t) * d..][..d]));
        }
        for ti in 0..c.tiles {
            let r = &x.bytes[(h * cap + ti) * rec..][..rec];
            base.decode_keys(r, &mut kc);
            base.decode_values(r, &mut vt);
            for t in 0..KVARN_TILE {
                keys.push((0..d).map(|ch| kc[ch * KVARN_TILE + t] as f64).collect());
                values.push(vt[t * d..][..d].iter().map(|&v| v as f64).collect());
            }
        }
        for t in 0..c.tail {
            keys.push(r16(&x.c[(h * tc + t) * d..][..d]));
            values.push(r16(&x.c[tail_half + (h * tc + t) * d..][..d]));
        }
        let scale = 1.0 / (d as f64).sqrt();
        let weights = |keys: &[Vec<f64>], qh: usize| -> Vec<f64> {
            let q = &x.a[(h * g + qh) * d..][..d];
            let scores: Vec<f64> = keys
                .iter()
                .map(|k| q.iter().zip(k).map(|(&a, &b)| a as f64 * b * scale).sum())
                .collect();
            let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
            let sum: f64 = w.iter().sum();
            w.iter().map(|v| v / sum).collect()
        };
        if let Some(r) = c.refine {
            // Eq. 7 from the resident weights, then the attention recomputed with the
            // selected groups' tokens refined (what eq. 8's correction amounts to).
            let per_tile = KVARN_TILE / r.group;
            let all_w: Vec<Vec<f64>> = (0..g).map(|qh| weights(&keys, qh)).collect();
            let mut scored: Vec<(f64, usize)> = (0..c.tiles * per_tile)
                .map(|gi| {
                    let first = c.sinks + gi * r.group;
                    let s = all_w
                        .iter()
                        .map(|w| w[first..first + r.group].iter().sum::<f64>())
                        .fold(f64::NEG_INFINITY, f64::max);
                    (s, gi)
                })
                .collect();
            scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let unit = r.unit_bytes(d);
            let mut sub = vec![0u8; d];
            let (mut kr, mut vr) = (vec![0.0f32; d], vec![0.0f32; d]);
            for &(_, gi) in scored.iter().take(r.selected(scored.len())) {
                let (ti, gt) = (gi / per_tile, gi % per_tile);
                let tile = &x.bytes[(h * cap + ti) * rec..][..rec];
                let u = &x.units[((h * cap + ti) * per_tile + gt) * unit..][..unit];
                for t in 0..r.group {
                    let tt = gt * r.group + t;
                    crate::kv::bitpack::unpack(
                        u,
                        r.bits.key,
                        t * d * r.bits.key as usize,
                        &mut sub,
                    );
                    base.refined_key(tile, tt, &sub, r.bits.key, &mut kr);
                    let v_at = (r.group * d * r.bits.key as usize) + t * d * r.bits.value as usize;
                    crate::kv::bitpack::unpack(u, r.bits.value, v_at, &mut sub);
                    base.refined_value(tile, tt, &sub, r.bits.value, &mut vr);
                    let at = c.sinks + ti * KVARN_TILE + tt;
                    keys[at] = kr.iter().map(|&v| v as f64).collect();
                    values[at] = vr.iter().map(|&v| v as f64).collect();
                }
            }
        }
        for qh in 0..g {
            let w = weights(&keys, qh);
            let o = &mut out[(h * g + qh) * d..][..d];
            for (wp, v) in w.iter().zip(&values) {
                for (oc, &vc) in o.iter_mut().zip(v) {
                    *oc += wp * vc;
                }
            }
        }
    }
    Some(out)
}

/// RMSNorm epsilon of the selection cases.
const CONFORMANCE_EPS: f32 = 1e-5;

/// The values a selection case ranks: the rows, or their RMSNorm (f64) with `norm`.
fn naive_select_input(x: &[f32], w: &[f32], row_len: usize, norm: bool) -> Vec<f64> {
    if !norm {
        return x.iter().map(|&v| v as f64).collect();
    }
    debug_assert_eq!(w.len(), row_len);
    naive_norm(x, w, CONFORMANCE_EPS as f64)
}

/// S(x) by sorting: every chunk's channels ordered by |x| (a NaN largest) descending then
/// index ascending, its budget taken, indices ascending.
fn naive_select(x: &[f64], row_len: usize, k: usize) -> Vec<usize> {
    let mut out = Vec::new();
    for row in x.chunks_exact(row_len) {
        for start in (0..row_len).step_by(1024) {
            let len = (row_len - start).min(1024);
            let budget = ((k * len + 512) / 1024).clamp(1, len);
            let mut idx: Vec<usize> = (start..start + len).collect();
            let key = |i: usize| row[i].abs();
            idx.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
            let mut top = idx[..budget].to_vec();
            top.sort_unstable();
            out.extend(top);
        }
    }
    out
}

fn naive_xwt(
    w: &[f32],
    x: &Inputs,
    m: usize,
    rows: usize,
    cols: usize,
    bias: bool,
    acc: bool,
) -> Vec<f64> {
    let mut y = vec![0.0f64; m * rows];
    for t in 0..m {
        for r in 0..rows {
            let mut v: f64 = (0..cols)
                .map(|c| w[r * cols + c] as f64 * x.a[t * cols + c] as f64)
                .sum();
            if bias {
                v += x.c[r] as f64;
            }
            if acc {
                v += x.d[t * rows + r] as f64;
            }
            y[t * rows + r] = v;
        }
    }
    y
}

/// The projections' input in f64: x (`a`), RMS-normalised with weight `d` when `norm`.
fn normed_input(x: &Inputs, norm: bool) -> Vec<f64> {
    if norm {
        naive_norm(&x.a, &x.d, 1e-5)
    } else {
        x.a.iter().map(|&v| f64::from(v)).collect()
    }
}

/// Up to three projections of one input in f64, their weights stacked by rows in `w` and
/// their biases in `x.c`: each projection's `m × rows` outputs in turn.
fn stacked_reference(
    w: &[f32],
    xs: &[f64],
    x: &Inputs,
    m: usize,
    cols: usize,
    rows: &[usize],
    bias: bool,
) -> Vec<f64> {
    let mut out = Vec::new();
    let mut off = 0;
    for &rn in rows {
        for t in 0..m {
            for r in off..off + rn {
                let s: f64 = (0..cols)
                    .map(|c| w[r * cols + c] as f64 * xs[t * cols + c])
                    .sum();
                out.push(s + if bias { x.c[r] as f64 } else { 0.0 });
            }
        }
        off += rn;
    }
    out
}

/// `silu(xs·w_gᵀ) ⊙ (xs·w_uᵀ)` in f64, gate rows then up rows stacked in `w`.
fn swiglu_reference(w: &[f32], xs: &[f64], m: usize, rows: usize, cols: usize) -> Vec<f64> {
    let dot = |r: usize, t: usize| -> f64 {
        (0..cols)
            .map(|c| w[r * cols + c] as f64 * xs[t * cols + c])
            .sum()
    };
    let mut out = Vec::new();
    for t in 0..m {
        for r in 0..rows {
            let g = dot(r, t);
            let u = dot(rows + r, t);
            out.push(g / (1.0 + (-g).exp()) * u);
        }
    }
    out
}

fn naive_norm(x: &[f32], w: &[f32], eps: f64) -> Vec<f64> {
    let cols = w.len();
    x.chunks(cols)
        .flat_map(|row| {
            let ms: f64 = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / cols as f64;
            let inv = 1.0 / (ms + eps).sqrt();
            row.iter()
                .zip(w)
                .map(move |(&v, &g)| v as f64 * inv * g as f64)
                .collect::<Vec<_>>()
        })
        .collect()
}

fn naive_rope(x: &[f32], n: usize, heads: usize, head_dim: usize, first: usize) -> Vec<f64> {
    let half = head_dim / 2;
    let mut out: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    for t in 0..n {
        let p = (first + t) as f32;
        for h in 0..heads {
            let base = (t * heads + h) * head_dim;
            for j in 0..half {
                let inv = (1e4f64.powf(-(2.0 * j as f64) / head_dim as f64)) as f32;
                let ang = (p * inv) as f64;
                let (a, bv) = (x[base + j] as f64, x[base + j + half] as f64);
                out[base + j] = a * ang.cos() - bv * ang.sin();
                out[base + j + half] = bv * ang.cos() + a * ang.sin();
            }
        }
    }
    out
}

/// The synthetic model of a decode case (F32 float parts, seed 11).
fn synthetic_model<B: ResidentKernels>(
    b: B,
    config: &sfx_formats::ModelConfig,
    weights: SyntheticWeights,
    options: &ModelOptions,
) -> Result<Model<B>> {
    Model::synthetic_with(
        b,
        config,
        DType::F32,
        weights,
        SyntheticWeights::Float,
        11,
        options,
    )
}

/// The CPU reference of a decode run: the same tokens in one prefill with logits at every
/// position, so the decode path (matvec, split-K attention, step graphs) is checked against
/// the prefill path (GEMM, flash-style attention).
fn decode_as_prefill(spec: &Op, x: &Inputs) -> Result<Vec<f64>> {
    let Op::Decode {
        preset,
        prompt,
        steps,
        weights,
        refine,
        ..
    } = *spec
    else {
        return Err(crate::RuntimeError::Unsupported("not a decode case".into()));
    };
    let config = crate::synthetic::preset(preset)?;
    let model = synthetic_model(
        CpuBackend::new(),
        &config,
        weights,
        &ModelOptions::default(),
    )?;
    let vocab = config.vocab_size as u32;
    let all: Vec<u32> = x.ids[..prompt + steps].iter().map(|t| t % vocab).collect();
    let mut cache = model.new_cache(all.len())?;
    let logits = match decode_refiner(model.backend(), &config, refine)? {
        Some(mut r) => model.forward_refined(&all, &mut cache, crate::LogitsMode::All, &mut r),
        None => model.forward(&all, &mut cache, crate::LogitsMode::All),
    }?
    .into_vec();
    Ok(logits.iter().map(|&v| v as f64).collect())
}

/// ‖a − b‖ / ‖b‖ (‖b‖ = 0: the absolute norm); NaN anywhere in `a` is infinite error.
pub fn normalized_error(a: &[f64], b: &[f64]) -> f64 {
    if a.len() != b.len() || a.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        num += (x - y) * (x - y);
        den += y * y;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// Runs one case on `backend`: against the CPU backend when `backend` is a device, against the
/// f64 reference when it is the CPU itself (`is_cpu`).
pub fn run_case<B: ResidentKernels>(
    case: &Case,
    backend: &B,
    is_cpu: bool,
    seed: u64,
) -> CaseResult {
    let mut rng = Rng(seed);
    let x = inputs(&case.spec, &mut rng);
    let cpu = CpuBackend::new();
    let outcome = (|| -> Result<(f64, usize, &'static str)> {
        let got: Vec<f64> = execute(&case.spec, &x, backend)?
            .iter()
            .map(|&v| v as f64)
            .collect();
        let (reference, name): (Vec<f64>, &'static str) = match (is_cpu, naive(&case.spec, &x)) {
            (true, Some(r)) => (r, "f64"),
            (true, None) => (decode_as_prefill(&case.spec, &x)?, "cpu prefill"),
            (false, _) => (
                execute(&case.spec, &x, &cpu)?
                    .iter()
                    .map(|&v| v as f64)
                    .collect(),
                "cpu",
            ),
        };
        Ok((normalized_error(&got, &reference), got.len(), name))
    })();
    let bound = if is_cpu { case.cpu_bound } else { case.bound };
    match outcome {
        Ok((error, elements, reference)) => CaseResult {
            op: case.op,
            family: case.family.clone(),
            backend: backend.name(),
            reference,
            error,
            bound,
            passed: error <= bound,
            elements,
            failure: None,
        },
        Err(e) => CaseResult {
            op: case.op,
            family: case.family.clone(),
            backend: backend.name(),
            reference: if is_cpu { "f64" } else { "cpu" },
            error: f64::INFINITY,
            bound,
            passed: false,
            elements: 0,
            failure: Some(e.to_string()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every refined decode case can catch a device that drops its refinement: on the CPU the
    /// refined run's logits stand at least ten bounds away from the same run without it.
    #[test]
    fn refined_decode_cases_see_a_dropped_refinement() {
        let cpu = CpuBackend::new();
        let mut checked = 0;
        for case in cases().iter().filter(|c| c.op == "model_decode") {
            let Op::Decode {
                preset,
                prompt,
                steps,
                graphs,
                weights,
                refine: Some(_),
            } = case.spec
            else {
                continue;
            };
            let x = inputs(&case.spec, &mut Rng(7));
            let refined: Vec<f64> = execute(&case.spec, &x, &cpu)
                .unwrap()
                .iter()
                .map(|&v| v as f64)
                .collect();
            let plain = Op::Decode {
                preset,
                prompt,
                steps,
                graphs,
                weights,
                refine: None,
            };
            let dropped: Vec<f64> = execute(&plain, &x, &cpu)
                .unwrap()
                .iter()
                .map(|&v| v as f64)
                .collect();
            let moved = normalized_error(&dropped, &refined);
            eprintln!("{}: {moved:.2e}", case.family);
            assert!(
                moved >= 10.0 * case.bound,
                "{}: dropping the refinement moves the logits by {moved:.2e}, bound {:.0e}",
                case.family,
                case.bound
            );
            checked += 1;
        }
        assert!(checked >= 10, "{checked} refined decode cases");
    }
}

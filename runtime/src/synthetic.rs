//! Synthetic models: real architectures' shapes with random weights, generated on the device
//! in seconds (nothing to download). Speed at batch 1 depends on shapes and bytes, not on
//! weight values, so these are how 8B-class speed is measured; every backend draws the same
//! weights for the same seed ([`crate::backend::synthetic_value`]), so they also serve
//! cross-backend checks.

use crate::backend::{synthetic_bits, synthetic_value};
use crate::error::{Result, RuntimeError};
use crate::linear::{FloatLinear, Linear, SharedLinear};
use crate::model::{DecoderLayer, Model, ModelOptions};
use crate::resident::trellis_linear::with_our_tables;
use crate::resident::ResidentKernels;
use half::f16;
use rayon::prelude::*;
use sfx_formats::config::{Arch, RopeScaling};
use sfx_formats::gguf::{BlockTensor, GgmlType};
use sfx_formats::resident::{
    GroupQuantized, LutQuantized, Rotation, TrellisCode, TrellisQuantized, TrellisScheme,
};
use sfx_formats::{DType, ModelConfig};
use std::sync::Arc;

/// Names accepted by [`preset`].
pub const PRESETS: &[&str] = &[
    "llama-3.1-8b",
    "llama-3.2-1b",
    "llama-3.2-3b",
    "mistral-7b",
    "qwen2.5-0.5b",
    "qwen2.5-7b",
    "qwen3-8b",
    "smollm2-135m",
    "tiny",
    "tiny-qwen3",
    "tiny-wide",
    "tiny-wide-qwen3",
];

#[allow(clippy::too_many_arguments)]
fn config(
    arch: Arch,
    hidden: usize,
    ffn: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    vocab: usize,
    theta: f64,
    eps: f64,
    tie: bool,
) -> ModelConfig {
    ModelConfig {
        arch,
        hidden_size: hidden,
        intermediate_size: ffn,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim,
        vocab_size: vocab,
        max_position_embeddings: 131_072,
        rms_norm_eps: eps,
        rope_theta: theta,
        rope_scaling: None,
        tie_word_embeddings: tie,
        attention_bias: arch == Arch::Qwen2,
        qk_norm: arch == Arch::Qwen3,
        bos_token_id: None,
        eos_token_ids: Vec::new(),
    }
}

fn llama3_scaling(factor: f64) -> Option<RopeScaling> {
    Some(RopeScaling::Llama3 {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    })
}

/// The config of a named architecture, as its Hugging Face `config.json` gives it.
pub fn preset(name: &str) -> Result<ModelConfig> {
    use Arch::*;
    let c = match name {
        "llama-3.1-8b" => ModelConfig {
            rope_scaling: llama3_scaling(8.0),
            ..config(
                Llama, 4096, 14336, 32, 32, 8, 128, 128_256, 5e5, 1e-5, false,
            )
        },
        "llama-3.2-1b" => ModelConfig {
            rope_scaling: llama3_scaling(32.0),
            ..config(Llama, 2048, 8192, 16, 32, 8, 64, 128_256, 5e5, 1e-5, true)
        },
        "llama-3.2-3b" => ModelConfig {
            rope_scaling: llama3_scaling(32.0),
            ..config(Llama, 3072, 8192, 28, 24, 8, 128, 128_256, 5e5, 1e-5, true)
        },
        "mistral-7b" => config(
            Mistral, 4096, 14336, 32, 32, 8, 128, 32_768, 1e6, 1e-5, false,
        ),
        "qwen2.5-0.5b" => config(Qwen2, 896, 4864, 24, 14, 2, 64, 151_936, 1e6, 1e-6, true),
        "qwen2.5-7b" => config(
            Qwen2, 3584, 18944, 28, 28, 4, 128, 152_064, 1e6, 1e-6, false,
        ),
        "qwen3-8b" => config(
            Qwen3, 4096, 12288, 36, 32, 8, 128, 151_936, 1e6, 1e-6, false,
        ),
        "smollm2-135m" => config(Llama, 576, 1536, 30, 9, 3, 64, 49_152, 1e5, 1e-5, true),
        // Small shapes for tests: odd sizes, GQA 2, a bias (Qwen2 graph) / q-k norms (Qwen3).
        "tiny" => config(Qwen2, 72, 200, 2, 6, 3, 24, 131, 1e4, 1e-5, false),
        "tiny-qwen3" => config(Qwen3, 64, 160, 2, 4, 2, 32, 97, 1e4, 1e-6, true),
        // Refined decode tests: wide enough that k = 16 per 1024 selects 8 channels. On 64
        // it selects one, and a device-vs-CPU near tie in |x| then swaps a set's whole
        // refinement, which moved a 12-step decode by ~3e-3.
        "tiny-wide" => config(Qwen2, 512, 1024, 2, 8, 4, 64, 131, 1e4, 1e-5, false),
        "tiny-wide-qwen3" => config(Qwen3, 512, 1024, 2, 8, 4, 64, 97, 1e4, 1e-6, true),
        other => {
            return Err(RuntimeError::Config(format!(
                "unknown synthetic model {other:?}; known: {}",
                PRESETS.join(", ")
            )))
        }
    };
    Ok(c)
}

/// Parameters of a config (embedding and untied head included).
pub fn parameter_count(c: &ModelConfig) -> u64 {
    let h = c.hidden_size as u64;
    let per_layer = h * (c.q_dim() as u64 + 2 * c.kv_dim() as u64)
        + c.q_dim() as u64 * h
        + 3 * h * c.intermediate_size as u64
        + 2 * h;
    let embed = c.vocab_size as u64 * h;
    let head = if c.tie_word_embeddings { 0 } else { embed };
    c.num_hidden_layers as u64 * per_layer + embed + head + h
}

/// A seed per tensor, so every matrix differs and any one can be regenerated alone.
fn tensor_seed(seed: u64, name: &str) -> u64 {
    name.bytes().fold(seed ^ 0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Host vector of `n` synthetic values × `scale` (norm weights, biases: small).
fn host_values(seed: u64, n: usize, scale: f32, offset: f32) -> Vec<f32> {
    (0..n)
        .map(|i| offset + synthetic_value(seed, i as u64) * scale)
        .collect()
}

/// Random group-quantized codes (format group-asym-v1) for a `rows × cols` projection: codes
/// uniform over the code range, zero points near the middle, scales giving the dequantized
/// weights variance ≈ 1/cols like the float synthetic weights. Any bytes are valid codes, so
/// the kernels do exactly the work of a converted model.
pub fn group_codes(
    seed: u64,
    rows: usize,
    cols: usize,
    bits: u8,
    group: usize,
) -> Result<GroupQuantized> {
    let row_bytes = (cols * bits as usize).div_ceil(8);
    let codes = random_bytes(seed, rows * row_bytes);
    let groups = rows * cols.div_ceil(group);
    let levels = f32::from(1u16 << bits);
    let unit = (12.0 / ((levels * levels - 1.0) * cols.max(1) as f32)).sqrt();
    // u16: an 8-bit head's 1 << 8 overflows a u8.
    let mid = ((1u16 << bits) / 2) as u8;
    let scales = (0..groups)
        .map(|g| f16::from_f32(unit * (1.0 + 0.25 * synthetic_value(seed ^ 0x5ca1e, g as u64))))
        .collect();
    let zeros = (0..groups)
        .map(|g| mid - u8::from(synthetic_value(seed ^ 0x2e80, g as u64) < 0.0))
        .collect();
    GroupQuantized::from_parts(bits, group, rows, cols, codes, scales, zeros).map_err(|e| {
        RuntimeError::Shape {
            op: "synthetic group codes",
            msg: e.to_string(),
        }
    })
}

/// Random look-up-table codes (format lut-v1) for a `rows × cols` projection: codes uniform,
/// each row's 2^bits int8 levels spread over ±127 with a little jitter, and the row scale
/// that gives the weights variance ≈ 1/cols. The kernels do exactly the work of a converted
/// model.
pub fn lut_codes(seed: u64, rows: usize, cols: usize, bits: u8) -> Result<LutQuantized> {
    let err = |msg: String| RuntimeError::Shape {
        op: "synthetic look-up-table codes",
        msg,
    };
    let (code_bytes, levels) =
        LutQuantized::sizes(bits, rows, cols).map_err(|e| err(e.to_string()))?;
    let n = 1usize << bits;
    let step = 254.0 / (n - 1) as f32;
    let tables = (0..levels)
        .map(|i| {
            let jitter = 0.25 * step * synthetic_value(seed ^ 0x7ab1e, i as u64);
            (-127.0 + step * (i % n) as f32 + jitter).clamp(-127.0, 127.0) as i8
        })
        .collect();
    // Levels spread evenly over ±127 have variance ≈ 127²/3.
    let unit = (3.0 / cols.max(1) as f32).sqrt() / 127.0;
    let scales = (0..rows)
        .map(|r| f16::from_f32(unit * (1.0 + 0.25 * synthetic_value(seed ^ 0x5ca1e, r as u64))))
        .collect();
    LutQuantized::from_parts(
        bits,
        rows,
        cols,
        random_bytes(seed, code_bytes),
        tables,
        scales,
    )
    .map_err(|e| err(e.to_string()))
}

/// Random GGUF blocks of `ty` for a `rows × cols` projection: random code bytes (every bit
/// pattern is a valid code) and scales giving the weights variance ≈ 1/cols.
pub fn gguf_blocks(seed: u64, rows: usize, cols: usize, ty: GgmlType) -> Result<BlockTensor> {
    if !cols.is_multiple_of(ty.block_size()) {
        return Err(RuntimeError::Shape {
            op: "synthetic GGUF blocks",
            msg: format!("{cols} columns is not a whole number of {ty} blocks"),
        });
    }
    let mut bytes = random_bytes(seed, rows * cols / ty.block_size() * ty.type_size());
    let mut block = 0u64;
    crate::resident::gguf_blocks::scale_random_blocks(ty, &mut bytes, cols, || {
        block += 1;
        0.25 * synthetic_value(seed ^ 0x5ca1e, block)
    });
    Ok(BlockTensor {
        ty,
        rows,
        cols,
        bytes,
    })
}

/// `n` random bytes from `seed`, 1 MiB blocks in parallel (an 8B model has ~2 GB of codes).
fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut out = vec![0u8; n];
    const BLOCK_WORDS: usize = 1 << 17;
    out.par_chunks_mut(8 * BLOCK_WORDS)
        .enumerate()
        .for_each(|(block, chunk)| {
            for (i, word) in chunk.chunks_mut(8).enumerate() {
                let v = synthetic_bits(seed, (block * BLOCK_WORDS + i) as u64).to_le_bytes();
                word.copy_from_slice(&v[..word.len()]);
            }
        });
    out
}

/// Random trellis tiles (format trellis-v1, row-major tiles as `sfx-convert` writes them) for
/// a `rows × cols` projection: random streams (every bit string is a valid tail-biting
/// stream), random input signs, output signs with the scale that gives the weights variance ≈
/// 1/cols (the codes' values are ≈ N(0, 1) and the transforms are orthonormal), the Gaussian
/// HYB table, and our Hadamard factors of both sizes (none under a block rotation). The
/// kernels do exactly the work of a converted model.
pub fn trellis_codes(
    seed: u64,
    rows: usize,
    cols: usize,
    scheme: TrellisScheme,
) -> Result<TrellisQuantized> {
    let err = |msg: String| RuntimeError::Shape {
        op: "synthetic trellis codes",
        msg,
    };
    let len = TrellisQuantized::tile_stream_len(&scheme, rows, cols)
        .ok_or_else(|| err(format!("[{rows}, {cols}] overflows")))?;
    let tiles = random_bytes(seed, len);
    let sign = |s: u64, i: usize| synthetic_bits(s, i as u64) & 1 == 0;
    let su = (0..cols)
        .map(|i| {
            if sign(seed ^ 0x5151, i) {
                f16::ONE
            } else {
                f16::NEG_ONE
            }
        })
        .collect();
    let unit = 1.0 / (cols.max(1) as f32).sqrt();
    let sv = (0..rows)
        .map(|i| if sign(seed ^ 0x5252, i) { unit } else { -unit })
        .collect();
    with_our_tables(scheme, rows, cols, tiles, su, sv).map_err(err)
}

/// What the projections of a synthetic model are (embedding, head and norms stay float).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SyntheticWeights {
    /// Float matrices (BF16 or F32), generated on the device.
    Float,
    /// Group-quantized codes of `bits` bits in groups of `group` columns (RTN / AWQ layout).
    Group { bits: u8, group: usize },
    /// Trellis tiles of `k` bits per weight with `code` (QTIP / YAQA layout) and `rotation`.
    Trellis {
        code: TrellisCode,
        k: u8,
        rotation: Rotation,
    },
    /// Look-up-table codes of `bits` bits (SqueezeLLM layout).
    Lut { bits: u8 },
    /// llama.cpp GGUF blocks of type `ty`, as a GGUF-resident file keeps them.
    Gguf { ty: GgmlType },
}

/// The formats a synthetic stand-in for a model file takes: the float dtype, the
/// projections' format (read from layer 0's `q_proj`) and the head's (`lm_head.weight`, or a
/// tied model's embedding). A tuner times candidates on another architecture's shapes in the
/// file's own formats with these.
pub fn formats_of(
    file: &sfx_formats::sfx::SfxFile,
) -> Result<(DType, SyntheticWeights, SyntheticWeights)> {
    use sfx_formats::sfx::Layout;
    let layout = |name: &str| file.section(name).ok().map(|s| s.layout.clone());
    let unreadable = |name: &str, what: String| {
        RuntimeError::Config(format!(
            "{}: section '{name}' is {what}: no synthetic format stands in for it",
            file.path().display()
        ))
    };
    let projection = "model.layers.0.self_attn.q_proj.weight";
    let (dtype, weights) = match layout(projection) {
        Some(Layout::Dense { dtype, .. }) => (dtype, SyntheticWeights::Float),
        Some(Layout::PackedCodes { bits, .. })
            if layout(&format!("{projection}.table")).is_some() =>
        {
            (
                DType::BF16,
                SyntheticWeights::Lut {
                    bits: u8::try_from(bits)
                        .map_err(|_| unreadable(projection, format!("{bits}-bit")))?,
                },
            )
        }
        Some(Layout::GgufBlocks { ggml_type, .. }) => (
            DType::BF16,
            SyntheticWeights::Gguf {
                ty: gguf_type(ggml_type).ok_or_else(|| {
                    unreadable(projection, format!("of GGUF type id {ggml_type}"))
                })?,
            },
        ),
        Some(Layout::PackedCodes { bits, group, .. }) => (
            DType::BF16,
            SyntheticWeights::Group {
                bits: u8::try_from(bits)
                    .map_err(|_| unreadable(projection, format!("{bits}-bit")))?,
                group: group as usize,
            },
        ),
        Some(Layout::TrellisTiles { k, scheme, .. }) => {
            let s = TrellisScheme::decode(scheme, k)
                .map_err(|e| unreadable(projection, e.to_string()))?;
            (
                DType::BF16,
                SyntheticWeights::Trellis {
                    code: s.code,
                    k: s.k,
                    rotation: s.rotation,
                },
            )
        }
        other => {
            return Err(unreadable(
                projection,
                other.map_or("missing".into(), |l| format!("{l:?}")),
            ))
        }
    };
    let (head_name, head_layout) = ["lm_head.weight", "model.embed_tokens.weight"]
        .into_iter()
        .find_map(|n| layout(n).map(|l| (n, l)))
        .ok_or_else(|| unreadable("lm_head.weight", "missing, as is the embedding".into()))?;
    let head = match head_layout {
        Layout::PackedCodes { bits, group, .. } => SyntheticWeights::Group {
            bits: u8::try_from(bits).map_err(|_| unreadable(head_name, format!("{bits}-bit")))?,
            group: group as usize,
        },
        Layout::Dense { .. } => SyntheticWeights::Float,
        Layout::GgufBlocks { ggml_type, .. } => SyntheticWeights::Gguf {
            ty: gguf_type(ggml_type)
                .ok_or_else(|| unreadable(head_name, format!("of GGUF type id {ggml_type}")))?,
        },
        other => return Err(unreadable(head_name, format!("{other:?}"))),
    };
    let dtype = match dtype {
        DType::F32 => DType::F32,
        _ => DType::BF16,
    };
    Ok((dtype, weights, head))
}

fn gguf_type(id: u64) -> Option<GgmlType> {
    u32::try_from(id).ok().and_then(GgmlType::from_id)
}

impl<B: ResidentKernels> Model<B> {
    /// A model of `config`'s shapes with weights of `dtype` (BF16 or F32) drawn from `seed`:
    /// projections uniform with variance 1/in_dim (activations stay O(1) through the
    /// residual stream), RMSNorm weights near 1, biases small.
    pub fn synthetic(
        backend: B,
        config: &ModelConfig,
        dtype: DType,
        seed: u64,
        options: &ModelOptions,
    ) -> Result<Self> {
        Self::synthetic_with(
            backend,
            config,
            dtype,
            SyntheticWeights::Float,
            SyntheticWeights::Float,
            seed,
            options,
        )
    }

    /// [`Model::synthetic`] with the projections in `weights`' format and the head in
    /// `head`'s. An untied model's embedding stays `dtype`; a tied one is the head's table
    /// (quantized with it).
    pub fn synthetic_with(
        backend: B,
        config: &ModelConfig,
        dtype: DType,
        weights: SyntheticWeights,
        head: SyntheticWeights,
        seed: u64,
        options: &ModelOptions,
    ) -> Result<Self> {
        crate::model::validate_config(config)?;
        let c = config;
        let b = &backend;
        let matrix = |name: &str, rows: usize, cols: usize| {
            let scale = (3.0 / cols.max(1) as f32).sqrt();
            b.random_matrix(rows, cols, dtype, tensor_seed(seed, name), scale)
        };
        let vector = |name: &str, n: usize, scale: f32, offset: f32| {
            b.upload(&host_values(tensor_seed(seed, name), n, scale, offset))
        };
        // A backend without kernels for a format holds its dequantized copy in `dtype`.
        let precision = if dtype == DType::F32 {
            crate::backend::WeightPrecision::F32
        } else {
            crate::backend::WeightPrecision::Bf16
        };
        let linear_of = |weights: SyntheticWeights,
                         name: String,
                         rows: usize,
                         cols: usize,
                         bias: bool|
         -> Result<Box<dyn Linear<B>>> {
            let bias = bias
                .then(|| host_values(tensor_seed(seed, &format!("{name}.bias")), rows, 0.02, 0.0));
            match weights {
                SyntheticWeights::Float => {
                    let w = matrix(&name, rows, cols)?;
                    Ok(Box::new(FloatLinear::new(b, w, bias.as_deref())?))
                }
                SyntheticWeights::Group { bits, group } => {
                    let q = group_codes(tensor_seed(seed, &name), rows, cols, bits, group)?;
                    b.group_linear(q, bias, &name)
                }
                SyntheticWeights::Trellis { code, k, rotation } => {
                    let scheme = TrellisScheme {
                        rotation,
                        ..TrellisScheme::qtip(code, k)
                    };
                    let q = trellis_codes(tensor_seed(seed, &name), rows, cols, scheme)?;
                    b.trellis_linear(q, bias, &name)
                }
                SyntheticWeights::Lut { bits } => {
                    let q = lut_codes(tensor_seed(seed, &name), rows, cols, bits)?;
                    crate::resident::lut_or_dequantized(b, &q, bias, precision, &name)
                }
                SyntheticWeights::Gguf { ty } => {
                    let t = gguf_blocks(tensor_seed(seed, &name), rows, cols, ty)?;
                    crate::resident::gguf_blocks::block_linear(b, &t, bias, precision, &name)
                }
            }
        };
        let linear = |name: String, rows: usize, cols: usize, bias: bool| {
            linear_of(weights, name, rows, cols, bias)
        };
        let hidden = c.hidden_size;
        let embed_name = "model.embed_tokens.weight";
        let embed: Arc<dyn Linear<B>> = if c.tie_word_embeddings && head != SyntheticWeights::Float
        {
            Arc::from(linear_of(
                head,
                embed_name.into(),
                c.vocab_size,
                hidden,
                false,
            )?)
        } else {
            let table = b.random_matrix(
                c.vocab_size,
                hidden,
                dtype,
                tensor_seed(seed, embed_name),
                1.0,
            )?;
            Arc::new(FloatLinear::new(b, table, None)?)
        };
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let norm = |n: &str, len: usize| vector(&format!("{p}.{n}"), len, 0.1, 1.0);
            let qkv_bias = c.attention_bias;
            layers.push(DecoderLayer {
                attn_norm: norm("input_layernorm", hidden)?,
                q_proj: linear(format!("{p}.self_attn.q_proj"), c.q_dim(), hidden, qkv_bias)?,
                k_proj: linear(
                    format!("{p}.self_attn.k_proj"),
                    c.kv_dim(),
                    hidden,
                    qkv_bias,
                )?,
                v_proj: linear(
                    format!("{p}.self_attn.v_proj"),
                    c.kv_dim(),
                    hidden,
                    qkv_bias,
                )?,
                o_proj: linear(format!("{p}.self_attn.o_proj"), hidden, c.q_dim(), false)?,
                q_norm: if c.qk_norm {
                    Some(norm("self_attn.q_norm", c.head_dim)?)
                } else {
                    None
                },
                k_norm: if c.qk_norm {
                    Some(norm("self_attn.k_norm", c.head_dim)?)
                } else {
                    None
                },
                mlp_norm: norm("post_attention_layernorm", hidden)?,
                gate_proj: linear(
                    format!("{p}.mlp.gate_proj"),
                    c.intermediate_size,
                    hidden,
                    false,
                )?,
                up_proj: linear(
                    format!("{p}.mlp.up_proj"),
                    c.intermediate_size,
                    hidden,
                    false,
                )?,
                down_proj: linear(
                    format!("{p}.mlp.down_proj"),
                    hidden,
                    c.intermediate_size,
                    false,
                )?,
            });
        }
        let final_norm = vector("model.norm.weight", hidden, 0.1, 1.0)?;
        let lm_head: Box<dyn Linear<B>> = if c.tie_word_embeddings {
            Box::new(SharedLinear(embed.clone()))
        } else {
            linear_of(head, "lm_head.weight".into(), c.vocab_size, hidden, false)?
        };
        Model::assemble(backend, c, embed, layers, final_norm, lm_head, options)
    }
}

/// Refinement of a synthetic model (issue 14, item 5): every projection's `in_dim` columns of
/// random 4-bit levels, the sizes a converted file's refinement has, with small per-row
/// scales; [`refinement_columns`] draws a source's bytes (each projection its own stream of
/// [`synthetic_bits`]). Speed depends on the bytes a step reads, not on their values.
pub fn refinement_plan(c: &ModelConfig) -> crate::refine::RefinementPlan {
    use crate::refine::engine::{ColumnSource, LayerSources};
    let q = c.num_attention_heads * c.head_dim;
    let kv = c.num_key_value_heads * c.head_dim;
    let (h, f) = (c.hidden_size, c.intermediate_size);
    let shapes: [&[(usize, usize)]; 4] = [
        &[(q, h), (kv, h), (kv, h)],
        &[(h, q)],
        &[(f, h), (f, h)],
        &[(h, f)],
    ];
    let mut key = 0u64;
    let layers = (0..c.num_hidden_layers)
        .map(|_| {
            let mut l = LayerSources {
                attn_norm: vec![1.0; h],
                mlp_norm: vec![1.0; h],
                ..Default::default()
            };
            for (set, projections) in l.sets.iter_mut().zip(shapes) {
                for &(out, inp) in projections {
                    set.push(ColumnSource {
                        key_base: key << 32,
                        offset: 0,
                        unit_bytes: out.div_ceil(2),
                        out,
                        inp,
                        scales: vec![1e-3; out],
                    });
                    key += 1;
                }
            }
            l
        })
        .collect();
    crate::refine::RefinementPlan {
        layers,
        hidden: h,
        eps: c.rms_norm_eps as f32,
        fitted_k: [None; 4],
    }
}

/// The random column bytes of a synthetic refinement source (see [`refinement_plan`]).
pub fn refinement_columns(src: &crate::refine::engine::ColumnSource, seed: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; src.inp * src.unit_bytes];
    let stream = seed ^ src.key_base;
    bytes.par_chunks_mut(8).enumerate().for_each(|(i, chunk)| {
        let bits = synthetic_bits(stream, i as u64).to_le_bytes();
        chunk.copy_from_slice(&bits[..chunk.len()]);
    });
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_counted() {
        for name in PRESETS {
            let c = preset(name).unwrap();
            crate::model::validate_config(&c).unwrap();
            assert!(parameter_count(&c) > 0);
        }
        // Llama-3.1-8B: 8.03 B parameters (embedding and head untied).
        let p = parameter_count(&preset("llama-3.1-8b").unwrap());
        assert!((8_020_000_000..8_040_000_000).contains(&p), "{p}");
        assert!(preset("gpt-2").is_err());
    }

    #[test]
    fn synthetic_group_codes_are_valid_and_seeded() {
        let a = group_codes(3, 8, 576, 2, 128).unwrap();
        assert_eq!(a, group_codes(3, 8, 576, 2, 128).unwrap());
        assert_ne!(a.codes(), group_codes(4, 8, 576, 2, 128).unwrap().codes());
        // Dequantized weights have variance near 1/cols, as the float synthetic weights, at
        // every width a head or projection takes (8 bits overflowed a u8 zero point once).
        for bits in sfx_formats::resident::SUPPORTED_BITS {
            let w = group_codes(3, 8, 576, bits, 128).unwrap().dequantize();
            let var = w.iter().map(|v| (v * v) as f64).sum::<f64>() / w.len() as f64;
            assert!((0.5..2.0).contains(&(var * 576.0)), "{bits} bits: {var}");
        }
    }

    #[test]
    fn synthetic_trellis_codes_are_valid_and_scaled() {
        let a = trellis_codes(
            3,
            32,
            576,
            TrellisScheme::qtip(TrellisCode::Hyb { q: 9 }, 2),
        )
        .unwrap();
        assert_eq!(
            a,
            trellis_codes(
                3,
                32,
                576,
                TrellisScheme::qtip(TrellisCode::Hyb { q: 9 }, 2)
            )
            .unwrap()
        );
        assert_ne!(
            a.tiles(),
            trellis_codes(
                4,
                32,
                576,
                TrellisScheme::qtip(TrellisCode::Hyb { q: 9 }, 2)
            )
            .unwrap()
            .tiles()
        );
        // Weights of variance ≈ 1/cols, as the float synthetic weights, for every code.
        for code in [
            TrellisCode::Hyb { q: 9 },
            TrellisCode::OneMad,
            TrellisCode::ThreeInst,
        ] {
            let q = trellis_codes(5, 32, 576, TrellisScheme::qtip(code, 3)).unwrap();
            let w = crate::resident::dequantize_trellis(&q).unwrap();
            let var = w.iter().map(|v| (v * v) as f64).sum::<f64>() / w.len() as f64;
            assert!((0.5..2.0).contains(&(var * 576.0)), "{code:?}: {var}");
        }
    }

    #[test]
    fn synthetic_weights_are_reproducible_per_seed() {
        let b = crate::CpuBackend::new();
        let c = preset("tiny").unwrap();
        let m1 = Model::synthetic(b, &c, DType::BF16, 7, &ModelOptions::default()).unwrap();
        let m2 = Model::synthetic(b, &c, DType::BF16, 7, &ModelOptions::default()).unwrap();
        let m3 = Model::synthetic(b, &c, DType::BF16, 8, &ModelOptions::default()).unwrap();
        let run = |m: &Model| {
            let mut cache = m.new_cache(8).unwrap();
            m.forward(&[1, 5, 9], &mut cache, crate::LogitsMode::Last)
                .unwrap()
                .into_vec()
        };
        let (a, b2, c3) = (run(&m1), run(&m2), run(&m3));
        assert_eq!(a, b2);
        assert_ne!(a, c3);
        assert!(a.iter().all(|v| v.is_finite()));
    }

    /// A channel-columns engine over `c`'s synthetic refinement (seed 5), placed in `b`.
    fn channel_refiner(
        c: &ModelConfig,
        b: &crate::CpuBackend,
        k: [usize; 4],
        s: [f32; 4],
    ) -> crate::refine::Refiner<crate::CpuBackend> {
        let settings = crate::refine::RefineSettings {
            k,
            s,
            mlp: crate::refine::MlpMode::Channels,
            bundle_k: 0,
        };
        crate::refine::Refiner::new_in_backend(refinement_plan(c), settings, b, |src| {
            Ok(std::borrow::Cow::Owned(refinement_columns(src, 5)))
        })
        .unwrap()
    }

    /// A refiner whose budgets are all 0 does not enter the step (the model runs the base), one
    /// with a budget does; their counters say which ran.
    #[test]
    fn a_refiner_that_selects_nothing_is_left_out_of_the_step() {
        use crate::refine::{MlpMode, RefineSettings, Refiner};
        let b = crate::CpuBackend::new();
        let c = preset("tiny").unwrap();
        let m = Model::synthetic(b, &c, DType::F32, 3, &ModelOptions::default()).unwrap();
        let refiner = |k: [usize; 4]| channel_refiner(&c, &b, k, [0.0; 4]);
        let steps = |r: &mut Refiner<crate::CpuBackend>| {
            let mut cache = m.new_cache(8).unwrap();
            let logits = m
                .forward_refined(&[1, 5, 9], &mut cache, crate::LogitsMode::Last, r)
                .unwrap()
                .into_vec();
            (r.counters().tokens, logits)
        };
        let mut none = refiner([0; 4]);
        assert!(none.selects_nothing());
        let base = {
            let mut cache = m.new_cache(8).unwrap();
            m.forward(&[1, 5, 9], &mut cache, crate::LogitsMode::Last)
                .unwrap()
                .into_vec()
        };
        assert_eq!(steps(&mut none), (0, base.clone()));
        let mut one_set = refiner([0, 0, 0, 64]);
        assert!(!one_set.selects_nothing());
        let (tokens, refined) = steps(&mut one_set);
        assert!(tokens > 0 && refined != base, "{tokens}");
        // Bundles with a neuron budget refine even where every channel budget is 0.
        let bundles = |bundle_k| RefineSettings {
            k: [0; 4],
            s: [0.0; 4],
            mlp: MlpMode::Bundles,
            bundle_k,
        };
        assert!(!bundles(12).selects_nothing() && bundles(0).selects_nothing());
    }

    /// One engine rescheduled to other budgets and lead/lag decodes exactly as an engine
    /// built with those settings: the tuner's speed side reuses one copy of the columns.
    #[test]
    fn a_rescheduled_refiner_decodes_as_a_fresh_one() {
        use crate::refine::Refiner;
        let b = crate::CpuBackend::new();
        let c = preset("tiny").unwrap();
        let m = Model::synthetic(b, &c, DType::F32, 3, &ModelOptions::default()).unwrap();
        let refiner = |k: [usize; 4], s: [f32; 4]| channel_refiner(&c, &b, k, s);
        // A prefill and decode steps: lead and lag act within each step.
        let decode = |r: &mut Refiner<crate::CpuBackend>| {
            let mut cache = m.new_cache(16).unwrap();
            let mut out = m
                .forward_refined(&[1, 5, 9], &mut cache, crate::LogitsMode::Last, r)
                .unwrap()
                .into_vec();
            for t in [4u32, 7, 2] {
                let step = m
                    .forward_refined(&[t], &mut cache, crate::LogitsMode::Last, r)
                    .unwrap()
                    .into_vec();
                out.extend(step);
            }
            out
        };
        let (k, s) = ([32, 0, 64, 16], [1.0, 0.5, 1.5, 1.0]);
        let mut fresh = refiner(k, s);
        let mut moved = refiner([16; 4], [0.0; 4]);
        let before = decode(&mut moved);
        moved.set_schedule(&b, k, s).unwrap();
        assert_eq!(moved.settings().k, k);
        let after = decode(&mut moved);
        assert_ne!(before, after);
        assert_eq!(after, decode(&mut fresh));
        // And back: the lag buffers of the first schedule are rebuilt, not left stale.
        moved.set_schedule(&b, [16; 4], [0.0; 4]).unwrap();
        assert_eq!(decode(&mut moved), before);
        assert!(moved.set_schedule(&b, k, [0.3; 4]).is_err());
    }
}

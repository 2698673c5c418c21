//! GGUF → a model in Hugging Face conventions (configuration, tensor names and layouts,
//! tokenizer) for the llama, mistral, qwen2 and qwen3 architectures: the plan decided from the
//! header, and the tensors materialized in memory for a runtime (the checkpoint-folder writer,
//! `hf_folder`, streams from the same plan).
//!
//! Tensors are dequantized to f32 and renamed to the Hugging Face names; GGUF dims are
//! innermost-first, so the HF shape is the dims reversed and the bytes need no transpose.
//! llama.cpp's converter permutes the rows of Q and K for llama/mistral (its RoPE rotates
//! adjacent pairs, Hugging Face's rotates the two halves of each head); [`unpermute_rows`]
//! undoes it. qwen2/qwen3 are stored unpermuted.

use super::reader::GgufTensorInfo;
use super::tokenizer::{tokenizer_from_gguf, GgufTokenizer};
use super::{dequantize, GgmlType, GgufError, GgufFile};
use crate::tensor::OwnedTensors;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// A GGUF model converted to Hugging Face conventions and held in memory (a checkpoint folder
/// is written by [`super::import_gguf_to_folder`], which streams instead).
#[derive(Debug)]
pub struct ImportedModel {
    pub hf_config: Value,
    /// F32 tensors with Hugging Face names and shapes.
    pub tensors: OwnedTensors,
    /// Weight matrices kept in their GGUF blocks ([`import_gguf_keeping`]), by Hugging Face
    /// name; absent from `tensors`. Empty for a plain import.
    pub blocks: BTreeMap<String, BlockTensor>,
    pub tokenizer_json: String,
    pub tokenizer_config: Value,
    pub generation_config: Value,
    /// sha256 (lowercase hex) of the GGUF file, for provenance.
    pub source_sha256: Option<String>,
}

/// A weight matrix in llama.cpp's own blocks: `rows` rows of `cols / block_size` blocks of
/// `ty`, rows in Hugging Face order (Q/K rows un-permuted like the dequantized tensors).
#[derive(Debug, Clone, PartialEq)]
pub struct BlockTensor {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub bytes: Vec<u8>,
}

impl BlockTensor {
    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.cols / self.ty.block_size() * self.ty.type_size()
    }

    /// Checks that `bytes` holds exactly `rows` rows of whole `ty` blocks of `cols` values
    /// (the fields are public, so a caller may have built it by hand).
    pub fn check(&self) -> Result<(), GgufError> {
        let ty = self.ty;
        if !self.cols.is_multiple_of(ty.block_size()) {
            return Err(GgufError::Import(format!(
                "{} columns is not a whole number of {ty} blocks of {}",
                self.cols,
                ty.block_size()
            )));
        }
        let want = (self.rows as u64)
            .checked_mul(self.cols as u64)
            .and_then(|n| ty.bytes_for(n));
        if want != Some(self.bytes.len() as u64) {
            return Err(GgufError::Import(format!(
                "{}×{} {ty} needs {} bytes, got {}",
                self.rows,
                self.cols,
                want.unwrap_or(u64::MAX),
                self.bytes.len()
            )));
        }
        Ok(())
    }

    /// Dequantizes to f32 values in row-major order.
    pub fn dequantize(&self) -> Result<Vec<f32>, GgufError> {
        super::dequantize_to_vec(self.ty, &self.bytes, self.rows * self.cols)
    }
}

/// The architectures this importer understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufArch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

impl GgufArch {
    pub fn from_name(name: &str) -> Result<Self, GgufError> {
        match name {
            "llama" => Ok(GgufArch::Llama),
            "mistral" => Ok(GgufArch::Mistral),
            "qwen2" => Ok(GgufArch::Qwen2),
            "qwen3" => Ok(GgufArch::Qwen3),
            other => Err(GgufError::UnsupportedArchitecture(other.to_string())),
        }
    }

    fn hf_architecture(self) -> &'static str {
        match self {
            GgufArch::Llama => "LlamaForCausalLM",
            GgufArch::Mistral => "MistralForCausalLM",
            GgufArch::Qwen2 => "Qwen2ForCausalLM",
            GgufArch::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    fn model_type(self) -> &'static str {
        match self {
            GgufArch::Llama => "llama",
            GgufArch::Mistral => "mistral",
            GgufArch::Qwen2 => "qwen2",
            GgufArch::Qwen3 => "qwen3",
        }
    }

    /// llama.cpp's converter permutes Q/K rows only for the Llama family.
    fn qk_permuted(self) -> bool {
        matches!(self, GgufArch::Llama | GgufArch::Mistral)
    }
}

/// Hugging Face name of a GGUF tensor, or `None` if it has no HF counterpart here.
pub fn hf_tensor_name(gguf_name: &str) -> Option<String> {
    let global = match gguf_name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(n) = global {
        return Some(n.to_string());
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) || layer.len() > 6 {
        return None;
    }
    let layer: usize = layer.parse().ok()?;
    let (module, suffix) = rest.rsplit_once('.')?;
    let hf_module = match module {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    let is_norm = module.ends_with("norm");
    match suffix {
        "weight" => {}
        "bias" if !is_norm => {}
        _ => return None,
    }
    Some(format!("model.layers.{layer}.{hf_module}.{suffix}"))
}

/// Inverse of llama.cpp's Q/K permutation on a row-major `[rows, row_len]` matrix (or a
/// bias, `row_len` = 1). The converter does, per head of `d = rows / n_head` rows,
/// `reshape(n_head, 2, d/2, ...).swapaxes(1, 2)`: GGUF row `h·d + 2i + s` holds HF row
/// `h·d + s·d/2 + i`. Works on any element type (use bytes with `row_len = cols · 4`).
pub fn unpermute_rows<T: Copy + Send + Sync>(
    data: &[T],
    rows: usize,
    row_len: usize,
    n_head: usize,
) -> Result<Vec<T>, String> {
    if n_head == 0 || !rows.is_multiple_of(2 * n_head) {
        return Err(format!(
            "{rows} rows cannot be split into {n_head} heads of an even number of rows"
        ));
    }
    if data.len() != rows * row_len {
        return Err(format!(
            "{} elements is not {rows} rows of {row_len}",
            data.len()
        ));
    }
    let d = rows / n_head;
    let half = d / 2;
    let mut out = Vec::with_capacity(data.len());
    for hf_row in 0..rows {
        let (h, r) = (hf_row / d, hf_row % d);
        let (s, i) = (r / half, r % half);
        let src = h * d + 2 * i + s;
        out.extend_from_slice(&data[src * row_len..(src + 1) * row_len]);
    }
    Ok(out)
}

/// Model hyper-parameters read from `{arch}.*` metadata.
#[derive(Debug, Clone)]
struct Dims {
    arch: GgufArch,
    hidden: usize,
    intermediate: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    vocab: usize,
    context: usize,
}

fn usize_key(gguf: &GgufFile, key: &str) -> Result<usize, GgufError> {
    let v = gguf.get_u64(key)?;
    usize::try_from(v)
        .ok()
        .filter(|&v| v > 0 && v <= 1 << 30)
        .ok_or_else(|| GgufError::metadata(key, format!("{v} is not a plausible dimension")))
}

/// An f32 as the decimal it was written from (f32 1e-5 is 9.99999974e-6 as f64; "1e-5" is
/// what config.json should say).
fn f32_json(x: f32) -> Value {
    let shortest: f64 = format!("{x}").parse().unwrap_or(x as f64);
    json!(shortest)
}

fn read_dims(gguf: &GgufFile, arch: GgufArch, arch_name: &str) -> Result<Dims, GgufError> {
    let k = |s: &str| format!("{arch_name}.{s}");
    let hidden = usize_key(gguf, &k("embedding_length"))?;
    let heads = usize_key(gguf, &k("attention.head_count"))?;
    let kv_heads = match gguf.get(&k("attention.head_count_kv")) {
        Some(_) => usize_key(gguf, &k("attention.head_count_kv"))?,
        None => heads,
    };
    let head_dim = match gguf.get(&k("attention.key_length")) {
        Some(_) => usize_key(gguf, &k("attention.key_length"))?,
        None => {
            if hidden % heads != 0 {
                return Err(GgufError::Import(format!(
                    "embedding_length {hidden} is not divisible by head_count {heads} and \
                     attention.key_length is absent"
                )));
            }
            hidden / heads
        }
    };
    if let Some(vl) = gguf.opt_u64(&k("attention.value_length"))? {
        if vl as usize != head_dim {
            return Err(GgufError::Import(format!(
                "attention.value_length {vl} differs from key_length {head_dim}"
            )));
        }
    }
    if heads % kv_heads != 0 {
        return Err(GgufError::Import(format!(
            "head_count {heads} is not a multiple of head_count_kv {kv_heads}"
        )));
    }
    if let Some(rd) = gguf.opt_u64(&k("rope.dimension_count"))? {
        if rd as usize != head_dim {
            return Err(GgufError::Import(format!(
                "rope.dimension_count {rd} differs from head_dim {head_dim}: partial rotary \
                 embeddings are not supported for {arch_name}"
            )));
        }
    }
    let embd = gguf
        .tensor_info("token_embd.weight")
        .ok_or_else(|| GgufError::MissingTensor("token_embd.weight".into()))?;
    let vocab = match embd.dims.as_slice() {
        [h, v] if *h as usize == hidden => *v as usize,
        d => {
            return Err(GgufError::tensor(
                "token_embd.weight",
                format!("dims {d:?} do not match [embedding_length {hidden}, vocab]"),
            ))
        }
    };
    Ok(Dims {
        arch,
        hidden,
        intermediate: usize_key(gguf, &k("feed_forward_length"))?,
        layers: usize_key(gguf, &k("block_count"))?,
        heads,
        kv_heads,
        head_dim,
        vocab,
        context: usize_key(gguf, &k("context_length"))?,
    })
}

/// The HF shape a tensor must have, from the model dims.
fn expected_shape(hf_name: &str, d: &Dims) -> Option<Vec<usize>> {
    let q = d.heads * d.head_dim;
    let kv = d.kv_heads * d.head_dim;
    let tail = hf_name
        .strip_prefix("model.layers.")
        .and_then(|r| r.split_once('.'))
        .map(|(_, t)| t)
        .unwrap_or(hf_name);
    Some(match tail {
        "model.embed_tokens.weight" | "lm_head.weight" => vec![d.vocab, d.hidden],
        "model.norm.weight" | "input_layernorm.weight" | "post_attention_layernorm.weight" => {
            vec![d.hidden]
        }
        "self_attn.q_proj.weight" => vec![q, d.hidden],
        "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => vec![kv, d.hidden],
        "self_attn.o_proj.weight" => vec![d.hidden, q],
        "self_attn.q_proj.bias" => vec![q],
        "self_attn.k_proj.bias" | "self_attn.v_proj.bias" => vec![kv],
        "self_attn.o_proj.bias" => vec![d.hidden],
        "self_attn.q_norm.weight" | "self_attn.k_norm.weight" => vec![d.head_dim],
        "mlp.gate_proj.weight" | "mlp.up_proj.weight" => vec![d.intermediate, d.hidden],
        "mlp.down_proj.weight" => vec![d.hidden, d.intermediate],
        _ => return None,
    })
}

/// Opens, validates and converts a GGUF file; also hashes it (in parallel with the
/// conversion).
pub fn import_gguf(path: impl AsRef<Path>) -> Result<ImportedModel, GgufError> {
    import_gguf_keeping(path, |_| false)
}

/// [`import_gguf`], keeping every 2-D weight whose type `keep` accepts in its GGUF blocks
/// ([`ImportedModel::blocks`]) instead of dequantizing it: for a runtime with kernels for
/// those blocks, which then holds no f32 copy of them.
pub fn import_gguf_keeping(
    path: impl AsRef<Path>,
    keep: impl Fn(GgmlType) -> bool + Sync,
) -> Result<ImportedModel, GgufError> {
    let path = path.as_ref();
    let gguf = GgufFile::open(path)?;
    let (sha, model) = rayon::join(
        || sha256_hex(gguf.bytes()),
        || import_from_gguf_keeping(&gguf, &keep),
    );
    let mut model = model.map_err(|e| in_file(path, e))?;
    model.source_sha256 = Some(sha);
    Ok(model)
}

/// Names `path` in an error about its contents (errors that already name a file pass as they
/// are).
pub(super) fn in_file(path: &Path, e: GgufError) -> GgufError {
    match e {
        e @ (GgufError::Io { .. } | GgufError::InFile { .. } | GgufError::Output(_)) => e,
        e => GgufError::InFile {
            path: path.to_path_buf(),
            source: Box::new(e),
        },
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(bytes);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Converts an already open GGUF (no hashing: `source_sha256` is `None`).
pub fn import_from_gguf(gguf: &GgufFile) -> Result<ImportedModel, GgufError> {
    import_from_gguf_keeping(gguf, &|_| false)
}

fn import_from_gguf_keeping(
    gguf: &GgufFile,
    keep: &(dyn Fn(GgmlType) -> bool + Sync),
) -> Result<ImportedModel, GgufError> {
    let plan = plan_import(gguf)?;
    let mut tensors = OwnedTensors::new();
    let mut blocks = BTreeMap::new();
    for (hf, planned) in &plan.tensors {
        let info = planned.info;
        let shape = info.shape();
        let keep_blocks = shape.len() == 2 && hf.ends_with(".weight") && keep(info.ggml_type);
        let mut bytes = if keep_blocks {
            gguf.tensor_bytes(info)?.to_vec()
        } else {
            dequantize_le_bytes(gguf, info)?
        };
        if let Some(n_head) = planned.qk_heads {
            // Whole rows move, so block bytes un-permute like f32 ones.
            let rows = shape[0];
            bytes = unpermute_rows(&bytes, rows, bytes.len() / rows, n_head)
                .map_err(|m| GgufError::tensor(&info.name, m))?;
        }
        if keep_blocks {
            let (rows, cols) = (shape[0], shape[1]);
            blocks.insert(
                hf.clone(),
                BlockTensor {
                    ty: info.ggml_type,
                    rows,
                    cols,
                    bytes,
                },
            );
            continue;
        }
        tensors
            .insert_raw(hf.clone(), crate::DType::F32, info.shape(), bytes)
            .map_err(|e| GgufError::tensor(&info.name, e.to_string()))?;
    }
    Ok(ImportedModel {
        hf_config: plan.hf_config,
        blocks,
        tensors,
        tokenizer_json: plan.tokenizer.tokenizer_json,
        tokenizer_config: plan.tokenizer.tokenizer_config,
        generation_config: plan.tokenizer.generation_config,
        source_sha256: None,
    })
}

/// Everything an import decides from the GGUF header alone: the Hugging Face configuration,
/// the tokenizer, and for every tensor its Hugging Face name and whether its rows need
/// llama.cpp's Q/K permutation undone. No tensor data is read.
pub(super) struct ImportPlan<'g> {
    pub hf_config: Value,
    pub tokenizer: GgufTokenizer,
    /// By Hugging Face name (sorted: the order of the safetensors header).
    pub tensors: BTreeMap<String, PlannedTensor<'g>>,
}

pub(super) struct PlannedTensor<'g> {
    pub info: &'g GgufTensorInfo,
    /// Heads of a Q/K projection (weight or bias) stored with llama.cpp's row permutation.
    pub qk_heads: Option<usize>,
}

pub(super) fn plan_import(gguf: &GgufFile) -> Result<ImportPlan<'_>, GgufError> {
    let arch_name = gguf.get_str("general.architecture")?;
    let arch = GgufArch::from_name(arch_name)?;
    let dims = read_dims(gguf, arch, arch_name)?;
    let tok = tokenizer_from_gguf(gguf)?;
    let tok_vocab = tok.tokenizer.get_vocab_size(true);
    if tok_vocab > dims.vocab {
        return Err(GgufError::Import(format!(
            "the tokenizer has {tok_vocab} tokens but token_embd has only {} rows",
            dims.vocab
        )));
    }

    // Map every tensor to its HF name first, so an unknown tensor fails before any work.
    let mut plan: BTreeMap<String, &GgufTensorInfo> = BTreeMap::new();
    let mut rope_freqs = None;
    for info in gguf.tensors() {
        if info.name == "rope_freqs.weight" {
            rope_freqs = Some(info);
            continue;
        }
        let hf = hf_tensor_name(&info.name).ok_or_else(|| {
            GgufError::tensor(
                &info.name,
                format!(
                    "no Hugging Face {} counterpart is known",
                    arch.hf_architecture()
                ),
            )
        })?;
        if let Some(layer) = layer_of(&hf) {
            if layer >= dims.layers {
                return Err(GgufError::tensor(
                    &info.name,
                    format!("layer {layer} but block_count is {}", dims.layers),
                ));
            }
        }
        let shape = info.shape();
        let want = expected_shape(&hf, &dims).expect("every mapped name has a shape rule");
        if shape != want {
            return Err(GgufError::tensor(
                &info.name,
                format!(
                    "shape {shape:?} (GGUF dims {:?}) does not match the {want:?} that the \
                     metadata implies for {hf}",
                    info.dims
                ),
            ));
        }
        plan.insert(hf, info);
    }
    check_complete(&plan, &dims)?;
    let tie = !plan.contains_key("lm_head.weight");
    let attention_bias = plan.contains_key("model.layers.0.self_attn.q_proj.bias");
    if arch == GgufArch::Mistral && attention_bias {
        return Err(GgufError::Import(
            "mistral GGUF has attention biases, which MistralForCausalLM cannot hold".into(),
        ));
    }
    let rope_scaling = rope_scaling(gguf, arch_name, &dims, rope_freqs)?;

    let mut cfg = Map::new();
    cfg.insert("architectures".into(), json!([arch.hf_architecture()]));
    cfg.insert("model_type".into(), json!(arch.model_type()));
    cfg.insert("hidden_size".into(), json!(dims.hidden));
    cfg.insert("intermediate_size".into(), json!(dims.intermediate));
    cfg.insert("num_hidden_layers".into(), json!(dims.layers));
    cfg.insert("num_attention_heads".into(), json!(dims.heads));
    cfg.insert("num_key_value_heads".into(), json!(dims.kv_heads));
    cfg.insert("head_dim".into(), json!(dims.head_dim));
    cfg.insert("vocab_size".into(), json!(dims.vocab));
    cfg.insert("max_position_embeddings".into(), json!(dims.context));
    let eps_key = format!("{arch_name}.attention.layer_norm_rms_epsilon");
    cfg.insert("rms_norm_eps".into(), f32_json(gguf.get_f32(&eps_key)?));
    let theta = gguf
        .opt_f32(&format!("{arch_name}.rope.freq_base"))?
        .unwrap_or(10000.0);
    cfg.insert("rope_theta".into(), f32_json(theta));
    cfg.insert("rope_scaling".into(), rope_scaling.unwrap_or(Value::Null));
    cfg.insert("tie_word_embeddings".into(), json!(tie));
    cfg.insert("bos_token_id".into(), json!(tok.special.bos));
    cfg.insert("eos_token_id".into(), json!(tok.special.eos));
    cfg.insert("attention_bias".into(), json!(attention_bias));
    cfg.insert("attention_dropout".into(), json!(0.0));
    cfg.insert("hidden_act".into(), json!("silu"));
    cfg.insert("initializer_range".into(), json!(0.02));
    cfg.insert("use_cache".into(), json!(true));
    cfg.insert("torch_dtype".into(), json!("bfloat16"));
    match arch {
        GgufArch::Llama => {
            cfg.insert("mlp_bias".into(), json!(false));
        }
        GgufArch::Mistral => {
            cfg.insert("sliding_window".into(), Value::Null);
        }
        GgufArch::Qwen2 | GgufArch::Qwen3 => {
            cfg.insert("use_sliding_window".into(), json!(false));
            cfg.insert("sliding_window".into(), Value::Null);
            cfg.insert("max_window_layers".into(), json!(dims.layers));
        }
    }

    let tensors = plan
        .into_iter()
        .map(|(hf, info)| {
            let heads = match hf.rsplit('.').nth(1) {
                Some("q_proj") => Some(dims.heads),
                Some("k_proj") => Some(dims.kv_heads),
                _ => None,
            };
            let qk_heads = heads.filter(|_| arch.qk_permuted());
            (hf, PlannedTensor { info, qk_heads })
        })
        .collect();
    Ok(ImportPlan {
        hf_config: Value::Object(cfg),
        tokenizer: tok,
        tensors,
    })
}

fn layer_of(hf: &str) -> Option<usize> {
    hf.strip_prefix("model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// Every tensor the HF model needs must be present.
fn check_complete(plan: &BTreeMap<String, &GgufTensorInfo>, d: &Dims) -> Result<(), GgufError> {
    let whole_model = ["model.embed_tokens.weight", "model.norm.weight"].map(String::from);
    let mut per_layer = vec![
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ];
    match d.arch {
        GgufArch::Qwen2 => per_layer.extend([
            "self_attn.q_proj.bias",
            "self_attn.k_proj.bias",
            "self_attn.v_proj.bias",
        ]),
        GgufArch::Qwen3 => per_layer.extend(["self_attn.q_norm.weight", "self_attn.k_norm.weight"]),
        _ => {}
    }
    let has_q_bias = plan.contains_key("model.layers.0.self_attn.q_proj.bias");
    if d.arch == GgufArch::Llama && has_q_bias {
        // Llama with attention_bias: HF then expects all four biases... except that
        // LlamaAttention puts `bias=attention_bias` on q/k/v *and* o.
        per_layer.extend([
            "self_attn.q_proj.bias",
            "self_attn.k_proj.bias",
            "self_attn.v_proj.bias",
            "self_attn.o_proj.bias",
        ]);
    }
    // Checked name by name and stopped at the first missing one: each present name is a
    // distinct entry of the tensor table, so the work is bounded by the file, not by a
    // block_count read from it (a huge one would otherwise build billions of names).
    let per_layer_names = (0..d.layers).flat_map(|l| {
        per_layer
            .iter()
            .map(move |t| format!("model.layers.{l}.{t}"))
    });
    let mut required = Vec::new();
    for r in whole_model.into_iter().chain(per_layer_names) {
        if !plan.contains_key(&r) {
            return Err(GgufError::Import(format!(
                "tensor for {r} is missing from the GGUF"
            )));
        }
        required.push(r);
    }
    // And nothing extra that HF would not load (a stray bias would be silently dropped).
    let allowed: std::collections::HashSet<&str> = required.iter().map(String::as_str).collect();
    for name in plan.keys() {
        if name != "lm_head.weight" && !allowed.contains(name.as_str()) {
            return Err(GgufError::Import(format!(
                "{name} ({}) has no place in {}",
                plan[name].name,
                d.arch.hf_architecture()
            )));
        }
    }
    Ok(())
}

/// Dequantizes a tensor straight into little-endian f32 bytes (the layout
/// [`OwnedTensors`] stores), without an intermediate f32 vector when alignment allows.
fn dequantize_le_bytes(gguf: &GgufFile, info: &GgufTensorInfo) -> Result<Vec<u8>, GgufError> {
    let n = info.n_elements;
    let len = n
        .checked_mul(4)
        .ok_or_else(|| GgufError::tensor(&info.name, "f32 size overflows"))?;
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(len)
        .map_err(|_| GgufError::tensor(&info.name, format!("cannot allocate {len} bytes")))?;
    bytes.resize(len, 0);
    let src = gguf.tensor_bytes(info)?;
    let wrap = |e: GgufError| GgufError::tensor(&info.name, e.to_string());
    match bytemuck::try_cast_slice_mut::<u8, f32>(&mut bytes) {
        Ok(out) if cfg!(target_endian = "little") => {
            dequantize(info.ggml_type, src, n, out).map_err(wrap)?
        }
        _ => {
            let v = super::dequantize_to_vec(info.ggml_type, src, n).map_err(wrap)?;
            for (c, x) in bytes.chunks_exact_mut(4).zip(v) {
                c.copy_from_slice(&x.to_le_bytes());
            }
        }
    }
    Ok(bytes)
}

/// `rope_scaling` for config.json, from `{arch}.rope.scaling.*` or a `rope_freqs` tensor.
fn rope_scaling(
    gguf: &GgufFile,
    arch_name: &str,
    dims: &Dims,
    rope_freqs: Option<&GgufTensorInfo>,
) -> Result<Option<Value>, GgufError> {
    let k = |s: &str| format!("{arch_name}.rope.scaling.{s}");
    let ty = gguf.opt_str(&k("type"))?;
    if let Some(info) = rope_freqs {
        if !matches!(ty, None | Some("none")) {
            return Err(GgufError::Import(format!(
                "both a rope_freqs tensor and rope.scaling.type '{}' are present",
                ty.unwrap_or_default()
            )));
        }
        if info.n_elements != dims.head_dim / 2 {
            return Err(GgufError::tensor(
                &info.name,
                format!("{} factors for head_dim {}", info.n_elements, dims.head_dim),
            ));
        }
        let factors = gguf.dequantize_info(info)?;
        let theta = gguf
            .opt_f32(&format!("{arch_name}.rope.freq_base"))?
            .unwrap_or(10000.0) as f64;
        let original = gguf.opt_u64(&k("original_context_length"))?;
        return llama3_rope_scaling_from_factors(&factors, dims.head_dim, theta, original)
            .map_err(|m| GgufError::tensor(&info.name, m));
    }
    match ty {
        None | Some("none") => Ok(None),
        Some("linear") => {
            let factor = gguf.get_f32(&k("factor"))?;
            Ok(Some(
                json!({"rope_type": "linear", "factor": f32_json(factor)}),
            ))
        }
        Some(other) => Err(GgufError::Import(format!(
            "rope scaling type '{other}' ({}) is not supported (supported: none, linear, \
             llama3 via rope_freqs)",
            k("type")
        ))),
    }
}

/// Recovers Llama-3 `rope_scaling` from the per-frequency divisors llama.cpp stores in
/// `rope_freqs` (convert_hf_to_gguf: 1 above the high-frequency cutoff, `factor` below the
/// low one, `1 / ((1 − s)/factor + s)` between, with s = (L/λ − lf)/(hf − lf), λ = 2π/freq).
/// Between the cutoffs s = a/λ − b with a = L/(hf − lf), b = lf/(hf − lf), fitted by least
/// squares; L is `original_context_length` when the file has it, else lf is taken as 1 (as
/// every Llama-3.x release has). The result is checked against every stored factor.
pub fn llama3_rope_scaling_from_factors(
    factors: &[f32],
    head_dim: usize,
    rope_theta: f64,
    original_context: Option<u64>,
) -> Result<Option<Value>, String> {
    if factors.is_empty() || factors.len() * 2 != head_dim {
        return Err(format!("{} factors for head_dim {head_dim}", factors.len()));
    }
    let r: Vec<f64> = factors.iter().map(|&x| x as f64).collect();
    if r.iter().any(|x| !x.is_finite() || *x < 1.0 - 1e-4) {
        return Err("rope factors must be finite and at least 1".into());
    }
    let factor = r.iter().cloned().fold(1.0, f64::max);
    if factor < 1.0 + 1e-6 {
        return Ok(None);
    }
    let inv_lambda = |i: usize| {
        rope_theta.powf(-((2 * i) as f64) / head_dim as f64) / (2.0 * std::f64::consts::PI)
    };
    let mut pts = Vec::new();
    for (i, &ri) in r.iter().enumerate() {
        if ri > 1.0 + 1e-4 && ri < factor * (1.0 - 1e-4) {
            let s = (1.0 / ri - 1.0 / factor) / (1.0 - 1.0 / factor);
            pts.push((inv_lambda(i), s));
        }
    }
    if pts.len() < 2 {
        return Err(format!(
            "only {} frequencies lie between the llama3 cutoffs; the scaling parameters \
             cannot be recovered",
            pts.len()
        ));
    }
    let n = pts.len() as f64;
    let (sx, sy) = pts
        .iter()
        .fold((0.0, 0.0), |(a, b), &(x, y)| (a + x, b + y));
    let (mx, my) = (sx / n, sy / n);
    let sxx: f64 = pts.iter().map(|&(x, _)| (x - mx) * (x - mx)).sum();
    let sxy: f64 = pts.iter().map(|&(x, y)| (x - mx) * (y - my)).sum();
    let a = sxy / sxx;
    let b = a * mx - my;
    if !(a > 0.0 && b > 0.0) {
        return Err(format!(
            "fitted smoothing line a={a}, b={b} is not a llama3 ramp"
        ));
    }
    let nice = |x: f64| {
        let r = (x * 1e4).round() / 1e4;
        if (r - x).abs() <= 1e-4 * x.abs() {
            r
        } else {
            x
        }
    };
    let l = match original_context {
        Some(l) => l as f64,
        None => (a / b).round(),
    };
    let lf = nice(b * l / a);
    let hf = nice(lf + l / a);
    let factor = nice(factor);
    for (i, &ri) in r.iter().enumerate() {
        let lambda = 1.0 / inv_lambda(i);
        let pred = if lambda < l / hf {
            1.0
        } else if lambda > l / lf {
            factor
        } else {
            let s = (l / lambda - lf) / (hf - lf);
            1.0 / ((1.0 - s) / factor + s)
        };
        if (pred - ri).abs() > 1e-3 * ri {
            return Err(format!(
                "llama3 parameters (factor {factor}, low {lf}, high {hf}, original context {l}) \
                 predict {pred} for frequency {i} but the tensor holds {ri}"
            ));
        }
    }
    Ok(Some(json!({
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": lf,
        "high_freq_factor": hf,
        "original_max_position_embeddings": l as u64,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's permutation, written from convert_hf_to_gguf's numpy expression
    /// `w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)`:
    /// output index (h, i, s) in the swapped array reads input (h, s, i).
    fn permute(w: &[u32], rows: usize, cols: usize, n_head: usize) -> Vec<u32> {
        let half = rows / n_head / 2;
        let mut out = vec![0; w.len()];
        for h in 0..n_head {
            for i in 0..half {
                for s in 0..2 {
                    let out_row = (h * half + i) * 2 + s;
                    let in_row = (h * 2 + s) * half + i;
                    out[out_row * cols..(out_row + 1) * cols]
                        .copy_from_slice(&w[in_row * cols..(in_row + 1) * cols]);
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        for (rows, cols, n_head) in [(8, 3, 1), (12, 2, 3), (24, 5, 2), (16, 1, 4)] {
            let w: Vec<u32> = (0..(rows * cols) as u32).collect();
            let p = permute(&w, rows, cols, n_head);
            assert_ne!(
                p, w,
                "permutation should move rows for {rows}x{cols}/{n_head}"
            );
            assert_eq!(unpermute_rows(&p, rows, cols, n_head).unwrap(), w);
        }
        // Explicit: one head of 4 rows: GGUF order is HF rows [0, 2, 1, 3].
        let hf = [10u32, 11, 12, 13];
        assert_eq!(permute(&hf, 4, 1, 1), [10, 12, 11, 13]);
        assert!(unpermute_rows(&[1u8; 6], 6, 1, 2).is_err());
    }

    #[test]
    fn tensor_names_map() {
        let cases = [
            ("token_embd.weight", Some("model.embed_tokens.weight")),
            ("output_norm.weight", Some("model.norm.weight")),
            ("output.weight", Some("lm_head.weight")),
            (
                "blk.0.attn_norm.weight",
                Some("model.layers.0.input_layernorm.weight"),
            ),
            (
                "blk.12.ffn_norm.weight",
                Some("model.layers.12.post_attention_layernorm.weight"),
            ),
            (
                "blk.3.attn_q.bias",
                Some("model.layers.3.self_attn.q_proj.bias"),
            ),
            (
                "blk.3.attn_output.weight",
                Some("model.layers.3.self_attn.o_proj.weight"),
            ),
            (
                "blk.1.attn_k_norm.weight",
                Some("model.layers.1.self_attn.k_norm.weight"),
            ),
            (
                "blk.2.ffn_down.weight",
                Some("model.layers.2.mlp.down_proj.weight"),
            ),
            ("blk.2.ffn_gate_exps.weight", None),
            ("blk.x.attn_q.weight", None),
            ("blk.1.attn_norm.bias", None),
            ("rope_freqs.weight", None),
        ];
        for (g, hf) in cases {
            assert_eq!(hf_tensor_name(g).as_deref(), hf, "{g}");
        }
    }

    /// convert_hf_to_gguf's llama3 rope factors, written from its formula.
    fn llama3_factors(dim: usize, base: f64, factor: f64, lf: f64, hf: f64, l: f64) -> Vec<f32> {
        (0..dim / 2)
            .map(|i| {
                let freq = 1.0 / base.powf((2 * i) as f64 / dim as f64);
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                let r = if wavelen < l / hf {
                    1.0
                } else if wavelen > l / lf {
                    factor
                } else {
                    let s = (l / wavelen - lf) / (hf - lf);
                    1.0 / ((1.0 - s) / factor + s)
                };
                r as f32
            })
            .collect()
    }

    #[test]
    fn llama3_rope_scaling_recovered() {
        // Llama-3.1-8B: head_dim 128, theta 5e5, factor 8, low 1, high 4, original 8192.
        let f = llama3_factors(128, 500000.0, 8.0, 1.0, 4.0, 8192.0);
        let v = llama3_rope_scaling_from_factors(&f, 128, 500000.0, None)
            .unwrap()
            .unwrap();
        assert_eq!(
            v,
            json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
        );
        // Llama-3.2-1B: head_dim 64, factor 32, with the original context from metadata.
        let f = llama3_factors(64, 500000.0, 32.0, 1.0, 4.0, 8192.0);
        let v = llama3_rope_scaling_from_factors(&f, 64, 500000.0, Some(8192))
            .unwrap()
            .unwrap();
        assert_eq!(v["factor"], json!(32.0));
        assert_eq!(v["high_freq_factor"], json!(4.0));
        // No scaling: all ones.
        assert_eq!(
            llama3_rope_scaling_from_factors(&[1.0; 32], 64, 1e4, None).unwrap(),
            None
        );
        // Factors no llama3 ramp can produce.
        let mut bad = llama3_factors(128, 500000.0, 8.0, 1.0, 4.0, 8192.0);
        bad[31] = 7.9;
        bad[30] = 1.01;
        assert!(llama3_rope_scaling_from_factors(&bad, 128, 500000.0, None).is_err());
    }
}

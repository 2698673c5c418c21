//! Hugging Face `config.json` → [`ModelConfig`], for the decoder-only families the runtime
//! implements. Every missing or inconsistent field is an error naming the field and the file.

use crate::FormatError;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Model families with their distinguishing graph features.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Llama 1/2/3 (incl. Llama-3 rope scaling), SmolLM.
    Llama,
    /// Mistral: Llama graph (sliding window is ignored: we never exceed it in evaluation).
    Mistral,
    /// Qwen2: biases on q/k/v.
    Qwen2,
    /// Qwen3: RMSNorm on each query/key head before RoPE, explicit head_dim.
    Qwen3,
}

impl Arch {
    /// `config.json`'s `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }

    /// `config.json`'s `architectures` entry.
    pub fn hf_architecture(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Mistral => "MistralForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    fn from_hf(model_type: Option<&str>, architectures: &[String]) -> Option<Arch> {
        let by_type = match model_type {
            Some("llama") => Some(Arch::Llama),
            Some("mistral") => Some(Arch::Mistral),
            Some("qwen2") => Some(Arch::Qwen2),
            Some("qwen3") => Some(Arch::Qwen3),
            _ => None,
        };
        by_type.or_else(|| {
            architectures.iter().find_map(|a| match a.as_str() {
                "LlamaForCausalLM" => Some(Arch::Llama),
                "MistralForCausalLM" => Some(Arch::Mistral),
                "Qwen2ForCausalLM" => Some(Arch::Qwen2),
                "Qwen3ForCausalLM" => Some(Arch::Qwen3),
                _ => None,
            })
        })
    }
}

/// RoPE frequency scaling, as in `config.json`'s `rope_scaling`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Llama-3.1's piecewise wavelength scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// Position interpolation: every frequency divided by `factor`.
    Linear { factor: f64 },
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v projections (Qwen2, and Llama checkpoints with `attention_bias`).
    pub attention_bias: bool,
    /// Per-head RMSNorm on queries and keys (Qwen3).
    pub qk_norm: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// Dimensions above this are rejected as corrupt before anything is allocated from them
/// (largest real values: vocab ~260K, intermediate ~50K).
const MAX_DIM: usize = 1 << 24;

impl ModelConfig {
    pub fn from_file(path: &Path) -> Result<Self, FormatError> {
        let text = std::fs::read_to_string(path).map_err(|e| FormatError::io(path, e))?;
        let json: Value = serde_json::from_str(&text).map_err(|e| FormatError::Config {
            path: path.to_path_buf(),
            msg: format!("not valid JSON: {e}"),
        })?;
        Self::from_hf_json(&json, path)
    }

    /// Parses a `config.json` value; `origin` is only used in error messages.
    pub fn from_hf_json(json: &Value, origin: &Path) -> Result<Self, FormatError> {
        let f = Fields {
            json,
            path: origin.to_path_buf(),
        };
        let architectures: Vec<String> = json
            .get("architectures")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        let model_type = json.get("model_type").and_then(Value::as_str);
        let arch = Arch::from_hf(model_type, &architectures).ok_or_else(|| {
            f.err(format!(
                "unsupported architecture (model_type {:?}, architectures {:?}); supported: llama, mistral, qwen2, qwen3",
                model_type.unwrap_or("<missing>"),
                architectures
            ))
        })?;

        let hidden_size = f.dim("hidden_size")?;
        let num_attention_heads = f.dim("num_attention_heads")?;
        let num_key_value_heads = f
            .opt_dim("num_key_value_heads")?
            .unwrap_or(num_attention_heads);
        let head_dim = match f.opt_dim("head_dim")? {
            Some(d) => d,
            None => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(f.err(format!(
                        "hidden_size {hidden_size} is not divisible by num_attention_heads {num_attention_heads} and head_dim is absent"
                    )));
                }
                hidden_size / num_attention_heads
            }
        };
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(f.err(format!(
                "num_attention_heads {num_attention_heads} is not a multiple of num_key_value_heads {num_key_value_heads}"
            )));
        }
        if head_dim % 2 != 0 {
            return Err(f.err(format!("head_dim {head_dim} must be even for RoPE")));
        }

        let rope_scaling = match json.get("rope_scaling") {
            None | Some(Value::Null) => None,
            Some(v) => Some(parse_rope_scaling(v, &f)?),
        };

        let eos_token_ids = match json.get("eos_token_id") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| as_token_id(v).ok_or_else(|| f.err("eos_token_id: expected integers")))
                .collect::<Result<_, _>>()?,
            Some(v) => {
                vec![as_token_id(v).ok_or_else(|| f.err("eos_token_id: expected an integer"))?]
            }
        };
        let bos_token_id = match json.get("bos_token_id") {
            None | Some(Value::Null) => None,
            Some(v) => {
                Some(as_token_id(v).ok_or_else(|| f.err("bos_token_id: expected an integer"))?)
            }
        };

        Ok(ModelConfig {
            arch,
            hidden_size,
            intermediate_size: f.dim("intermediate_size")?,
            num_hidden_layers: f.dim("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size: f.dim("vocab_size")?,
            max_position_embeddings: f.opt_dim("max_position_embeddings")?.unwrap_or(4096),
            rms_norm_eps: f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta: f.opt_f64("rope_theta")?.unwrap_or(10000.0),
            rope_scaling,
            tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            attention_bias: f.opt_bool("attention_bias")?.unwrap_or(arch == Arch::Qwen2),
            qk_norm: arch == Arch::Qwen3,
            bos_token_id,
            eos_token_ids,
        })
    }

    /// The `config.json` of this configuration, as Hugging Face writes it for the
    /// architecture: every field [`ModelConfig::from_hf_json`] reads, so the two round-trip.
    pub fn to_hf_json(&self) -> Value {
        let eos = match self.eos_token_ids.as_slice() {
            [] => Value::Null,
            [one] => serde_json::json!(one),
            many => serde_json::json!(many),
        };
        serde_json::json!({
            "architectures": [self.arch.hf_architecture()],
            "model_type": self.arch.model_type(),
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
        })
    }

    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Inverse frequencies θ_j for RoPE pairs j = 0..head_dim/2, with scaling applied.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let half = self.head_dim / 2;
        let base: Vec<f64> = (0..half)
            .map(|j| 1.0 / self.rope_theta.powf(2.0 * j as f64 / self.head_dim as f64))
            .collect();
        match &self.rope_scaling {
            None => base,
            Some(RopeScaling::Linear { factor }) => base.iter().map(|f| f / factor).collect(),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                // Llama-3.1: long wavelengths are slowed by `factor`, short ones kept, and the
                // band between is interpolated smoothly (transformers' _compute_llama3_parameters).
                let old_ctx = *original_max_position_embeddings as f64;
                let low_wavelen = old_ctx / low_freq_factor;
                let high_wavelen = old_ctx / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old_ctx / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }
}

fn parse_rope_scaling(v: &Value, f: &Fields) -> Result<RopeScaling, FormatError> {
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(Value::as_str)
        .ok_or_else(|| f.err("rope_scaling: missing rope_type"))?;
    let num = |key: &str| {
        v.get(key)
            .and_then(Value::as_f64)
            .ok_or_else(|| f.err(format!("rope_scaling.{key}: missing or not a number")))
    };
    match kind {
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
        }),
        "linear" => Ok(RopeScaling::Linear {
            factor: num("factor")?,
        }),
        "default" => Ok(RopeScaling::Linear { factor: 1.0 }),
        other => Err(f.err(format!(
            "rope_scaling type '{other}' is not supported (supported: llama3, linear)"
        ))),
    }
}

fn as_token_id(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|x| u32::try_from(x).ok())
}

struct Fields<'a> {
    json: &'a Value,
    path: PathBuf,
}

impl Fields<'_> {
    fn err(&self, msg: impl Into<String>) -> FormatError {
        FormatError::Config {
            path: self.path.clone(),
            msg: msg.into(),
        }
    }

    fn opt_dim(&self, key: &str) -> Result<Option<usize>, FormatError> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => {
                let n = v
                    .as_u64()
                    .ok_or_else(|| self.err(format!("field '{key}' must be a positive integer")))?;
                if n == 0 || n as u128 > MAX_DIM as u128 {
                    return Err(self.err(format!(
                        "field '{key}' = {n} is out of range (1..={MAX_DIM})"
                    )));
                }
                Ok(Some(n as usize))
            }
        }
    }

    fn dim(&self, key: &str) -> Result<usize, FormatError> {
        self.opt_dim(key)?
            .ok_or_else(|| self.err(format!("missing required field '{key}'")))
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>, FormatError> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(format!("field '{key}' must be a number"))),
        }
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>, FormatError> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(format!("field '{key}' must be true or false"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn smollm2() -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
            "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
            "tie_word_embeddings": true, "bos_token_id": 1, "eos_token_id": 2
        })
    }

    #[test]
    fn parses_llama_and_derives_head_dim() {
        let c = ModelConfig::from_hf_json(&smollm2(), Path::new("config.json")).unwrap();
        assert_eq!(c.arch, Arch::Llama);
        assert_eq!(c.head_dim, 64);
        assert_eq!(c.kv_dim(), 192);
        assert_eq!(c.eos_token_ids, vec![2]);
        assert!(!c.attention_bias && !c.qk_norm);
    }

    #[test]
    fn missing_hidden_size_is_named() {
        let mut j = smollm2();
        j.as_object_mut().unwrap().remove("hidden_size");
        let e = ModelConfig::from_hf_json(&j, Path::new("m/config.json")).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("hidden_size") && msg.contains("m/config.json"),
            "{msg}"
        );
    }

    #[test]
    fn absurd_and_inconsistent_dims_are_rejected() {
        let mut j = smollm2();
        j["vocab_size"] = json!(1u64 << 40);
        assert!(ModelConfig::from_hf_json(&j, Path::new("c"))
            .unwrap_err()
            .to_string()
            .contains("vocab_size"));
        let mut j = smollm2();
        j["num_key_value_heads"] = json!(4);
        assert!(ModelConfig::from_hf_json(&j, Path::new("c"))
            .unwrap_err()
            .to_string()
            .contains("num_key_value_heads"));
    }

    #[test]
    fn unsupported_architecture_is_named() {
        let mut j = smollm2();
        j["model_type"] = json!("gpt_neox");
        j["architectures"] = json!(["GPTNeoXForCausalLM"]);
        let msg = ModelConfig::from_hf_json(&j, Path::new("c"))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("gpt_neox"), "{msg}");
    }

    #[test]
    fn qwen_families() {
        let mut j = smollm2();
        j["model_type"] = json!("qwen2");
        assert!(
            ModelConfig::from_hf_json(&j, Path::new("c"))
                .unwrap()
                .attention_bias
        );
        j["model_type"] = json!("qwen3");
        j["head_dim"] = json!(128);
        let c = ModelConfig::from_hf_json(&j, Path::new("c")).unwrap();
        assert!(c.qk_norm && c.head_dim == 128 && c.q_dim() == 9 * 128);
    }

    #[test]
    fn llama3_rope_scaling_matches_reference_values() {
        // Llama-3.1-8B: theta 5e5, head_dim 128, factor 8, low 1, high 4, original ctx 8192.
        // Reference values from the formula in Meta's reference implementation: the highest
        // frequency (j = 0) is kept (1.0), the lowest band is divided by 8.
        let mut j = smollm2();
        j["hidden_size"] = json!(4096);
        j["num_attention_heads"] = json!(32);
        j["num_key_value_heads"] = json!(8);
        j["rope_theta"] = json!(500000.0);
        j["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let c = ModelConfig::from_hf_json(&j, Path::new("c")).unwrap();
        let f = c.rope_inv_freq();
        assert_eq!(f[0], 1.0);
        let last_unscaled = 1.0 / 500000f64.powf(126.0 / 128.0);
        assert!((f[63] - last_unscaled / 8.0).abs() < 1e-15);
    }

    /// The config.json written into an output folder reads back as the same configuration,
    /// for every architecture, with and without rope scaling and tied embeddings.
    #[test]
    fn hf_json_round_trips() {
        let mut variants = Vec::new();
        for (model_type, eos) in [
            ("llama", json!(2)),
            ("mistral", json!([2, 7])),
            ("qwen2", json!(null)),
        ] {
            let mut j = smollm2();
            j["model_type"] = json!(model_type);
            j["eos_token_id"] = eos;
            variants.push(j);
        }
        let mut j = smollm2();
        j["model_type"] = json!("qwen3");
        j["head_dim"] = json!(128);
        j["tie_word_embeddings"] = json!(true);
        j["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        variants.push(j);
        for j in variants {
            let c = ModelConfig::from_hf_json(&j, Path::new("c")).unwrap();
            let back = ModelConfig::from_hf_json(&c.to_hf_json(), Path::new("c")).unwrap();
            assert_eq!(back, c, "{j}");
        }
    }
}

//! One decoder block's weights and its loading from Hugging Face tensor names.

use crate::backend::Backend;
use crate::error::Result;
use crate::linear::{check_shape, require, Linear, LinearFactory, LinearRole, LinearSpec};
use sfx_formats::{ModelConfig, TensorSource};

/// Weights of one Llama-family block: pre-norm attention and pre-norm SwiGLU MLP.
pub struct DecoderLayer<B: Backend> {
    pub(crate) attn_norm: B::Buffer,
    pub(crate) q_proj: Box<dyn Linear<B>>,
    pub(crate) k_proj: Box<dyn Linear<B>>,
    pub(crate) v_proj: Box<dyn Linear<B>>,
    pub(crate) o_proj: Box<dyn Linear<B>>,
    /// Qwen3's per-head RMSNorm on queries and keys (before RoPE).
    pub(crate) q_norm: Option<B::Buffer>,
    pub(crate) k_norm: Option<B::Buffer>,
    pub(crate) mlp_norm: B::Buffer,
    pub(crate) gate_proj: Box<dyn Linear<B>>,
    pub(crate) up_proj: Box<dyn Linear<B>>,
    pub(crate) down_proj: Box<dyn Linear<B>>,
}

impl<B: Backend> DecoderLayer<B> {
    pub(crate) fn load(
        backend: &B,
        config: &ModelConfig,
        tensors: &dyn TensorSource,
        factory: &dyn LinearFactory<B>,
        i: usize,
    ) -> Result<Self> {
        let c = config;
        let p = format!("model.layers.{i}");
        let hidden = c.hidden_size;
        let linear = |role: LinearRole, name: &str, out_dim: usize, in_dim: usize, bias: bool| {
            let weight_name = format!("{p}.{name}.weight");
            let bias_name = bias.then(|| format!("{p}.{name}.bias"));
            let spec = LinearSpec {
                layer: Some(i),
                role,
                weight_name: &weight_name,
                bias_name: bias_name.as_deref(),
                out_dim,
                in_dim,
            };
            factory.load(backend, tensors, &spec)
        };
        let norm = |name: &str, len: usize, why: &str| -> Result<B::Buffer> {
            let full = format!("{p}.{name}.weight");
            let view = require(tensors, &full, why)?;
            check_shape(&full, view.shape, &[len])?;
            backend.upload(&view.to_f32_vec())
        };
        let qkv_bias = c.attention_bias;
        Ok(Self {
            attn_norm: norm("input_layernorm", hidden, "attention RMSNorm")?,
            q_proj: linear(
                LinearRole::Query,
                "self_attn.q_proj",
                c.q_dim(),
                hidden,
                qkv_bias,
            )?,
            k_proj: linear(
                LinearRole::Key,
                "self_attn.k_proj",
                c.kv_dim(),
                hidden,
                qkv_bias,
            )?,
            v_proj: linear(
                LinearRole::Value,
                "self_attn.v_proj",
                c.kv_dim(),
                hidden,
                qkv_bias,
            )?,
            o_proj: linear(
                LinearRole::AttnOutput,
                "self_attn.o_proj",
                hidden,
                c.q_dim(),
                false,
            )?,
            q_norm: if c.qk_norm {
                Some(norm(
                    "self_attn.q_norm",
                    c.head_dim,
                    "Qwen3 query norm (qk_norm)",
                )?)
            } else {
                None
            },
            k_norm: if c.qk_norm {
                Some(norm(
                    "self_attn.k_norm",
                    c.head_dim,
                    "Qwen3 key norm (qk_norm)",
                )?)
            } else {
                None
            },
            mlp_norm: norm("post_attention_layernorm", hidden, "MLP RMSNorm")?,
            gate_proj: linear(
                LinearRole::Gate,
                "mlp.gate_proj",
                c.intermediate_size,
                hidden,
                false,
            )?,
            up_proj: linear(
                LinearRole::Up,
                "mlp.up_proj",
                c.intermediate_size,
                hidden,
                false,
            )?,
            down_proj: linear(
                LinearRole::Down,
                "mlp.down_proj",
                hidden,
                c.intermediate_size,
                false,
            )?,
        })
    }

    /// Every projection of the block with its role.
    pub fn linears(&self) -> [(LinearRole, &dyn Linear<B>); 7] {
        [
            (LinearRole::Query, &*self.q_proj),
            (LinearRole::Key, &*self.k_proj),
            (LinearRole::Value, &*self.v_proj),
            (LinearRole::AttnOutput, &*self.o_proj),
            (LinearRole::Gate, &*self.gate_proj),
            (LinearRole::Up, &*self.up_proj),
            (LinearRole::Down, &*self.down_proj),
        ]
    }
}

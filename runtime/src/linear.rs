//! The linear-layer interface every resident weight format and refinement implements, and
//! the float implementation.
//!
//! Like mistral.rs's `QuantMethod`, the graph only sees `dyn Linear<B>`: a quantized base, a
//! refined (DecDEC / StrataFlux) linear or a float one are interchangeable per projection.
//! A format implements `Linear<B>` for each backend it has kernels for; loading goes through a
//! [`LinearFactory`], so a new format plugs into [`crate::model::Model::load_with`] without
//! touching the graph.

use crate::backend::{Backend, MatmulOut, WeightPrecision};
use crate::error::{Result, RuntimeError};
use sfx_formats::{DType, TensorSource};
use std::sync::Arc;

/// `y[m, out] = x[m, in] · Wᵀ (+ b)` for m tokens.
pub trait Linear<B: Backend>: Send + Sync {
    fn in_dim(&self) -> usize;
    fn out_dim(&self) -> usize;
    fn has_bias(&self) -> bool;
    /// `x` holds `m × in_dim` values, `y` `m × out_dim`; `y` is overwritten.
    fn forward(&self, backend: &B, x: &B::Buffer, m: usize, y: &mut B::Buffer) -> Result<()>;
    /// `acc += x·Wᵀ (+ b)`: the projection followed by the residual add. The default runs
    /// [`Linear::forward`] into `scratch` (`m × out_dim`) and adds; a format whose kernel can
    /// accumulate in place overrides it (one kernel and one pass over `acc` fewer).
    fn forward_add(
        &self,
        backend: &B,
        x: &B::Buffer,
        m: usize,
        acc: &mut B::Buffer,
        scratch: &mut B::Buffer,
    ) -> Result<()> {
        self.forward(backend, x, m, scratch)?;
        backend.add_assign(acc, scratch)
    }
    /// The weight as the backend's own resident matrix (float weights; on CUDA group codes
    /// too) and the bias, for the graph's fused multi-projection ops
    /// ([`Backend::matmul_t_group`], [`Backend::matmul_t_swiglu`], the norm-fused forms);
    /// `None` for formats the backend's matrix type does not hold, which run unfused.
    fn matrix_parts(&self) -> Option<(&B::Matrix, Option<&B::Buffer>)> {
        None
    }
    /// `out[t, :] = Ŵ[tokens[t], :]`: the weight's rows as a lookup table — how a tied
    /// embedding reads the head it shares (a quantized head keeps one table, not two).
    /// `out` holds `tokens × in_dim` values; an id ≥ `out_dim` is
    /// [`RuntimeError::TokenOutOfRange`]. Formats without a row gather say so.
    fn gather_rows(&self, backend: &B, tokens: &B::Index, out: &mut B::Buffer) -> Result<()> {
        let _ = (backend, tokens, out);
        Err(RuntimeError::Unsupported(format!(
            "{}: this weight format has no row gather (it cannot serve as an embedding)",
            self.describe()
        )))
    }
    /// Bytes this linear keeps resident on the device (weights, scales, bias), for the
    /// per-tier memory accounting of the evaluation protocol.
    fn resident_bytes(&self) -> usize;
    /// Short description for logs, e.g. `"bf16 576×1536"`.
    fn describe(&self) -> String;
}

/// A float weight matrix (BF16 with f32 accumulation, or F32) with an optional f32 bias.
pub struct FloatLinear<B: Backend> {
    weight: B::Matrix,
    bias: Option<B::Buffer>,
    out_dim: usize,
    in_dim: usize,
    dtype: DType,
}

impl<B: Backend> FloatLinear<B> {
    /// Wraps a resident matrix (`[out, in]`) and an optional bias of length `out`.
    pub fn new(backend: &B, weight: B::Matrix, bias: Option<&[f32]>) -> Result<Self> {
        let (out_dim, in_dim) = backend.matrix_dims(&weight);
        let bias = match bias {
            Some(b) if b.len() != out_dim => {
                return Err(RuntimeError::Shape {
                    op: "FloatLinear::new",
                    msg: format!("bias has {} elements, expected {out_dim}", b.len()),
                })
            }
            Some(b) => Some(backend.upload(b)?),
            None => None,
        };
        let dtype = backend.matrix_dtype(&weight);
        Ok(Self {
            weight,
            bias,
            out_dim,
            in_dim,
            dtype,
        })
    }

    /// Loads `weight_name` (`[out, in]`) and optionally `bias_name` (`[out]`) from `tensors`,
    /// checking both shapes against `(out_dim, in_dim)`.
    pub fn load(
        backend: &B,
        tensors: &dyn TensorSource,
        spec: &LinearSpec<'_>,
        precision: WeightPrecision,
    ) -> Result<Self> {
        let view = require(tensors, spec.weight_name, spec.role.describe())?;
        check_shape(spec.weight_name, view.shape, &[spec.out_dim, spec.in_dim])?;
        let weight = backend.upload_matrix(spec.weight_name, &view, precision)?;
        let bias = load_bias(tensors, spec)?;
        Self::new(backend, weight, bias.as_deref())
    }

    pub fn weight(&self) -> &B::Matrix {
        &self.weight
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
}

impl<B: Backend> Linear<B> for FloatLinear<B> {
    fn in_dim(&self) -> usize {
        self.in_dim
    }
    fn out_dim(&self) -> usize {
        self.out_dim
    }
    fn has_bias(&self) -> bool {
        self.bias.is_some()
    }
    fn forward(&self, backend: &B, x: &B::Buffer, m: usize, y: &mut B::Buffer) -> Result<()> {
        backend.matmul_t(x, m, &self.weight, self.bias.as_ref(), y, MatmulOut::Store)
    }
    fn forward_add(
        &self,
        backend: &B,
        x: &B::Buffer,
        m: usize,
        acc: &mut B::Buffer,
        _scratch: &mut B::Buffer,
    ) -> Result<()> {
        backend.matmul_t(
            x,
            m,
            &self.weight,
            self.bias.as_ref(),
            acc,
            MatmulOut::Accumulate,
        )
    }
    fn matrix_parts(&self) -> Option<(&B::Matrix, Option<&B::Buffer>)> {
        Some((&self.weight, self.bias.as_ref()))
    }
    fn gather_rows(&self, backend: &B, tokens: &B::Index, out: &mut B::Buffer) -> Result<()> {
        backend.embedding(&self.weight, tokens, out)
    }
    fn resident_bytes(&self) -> usize {
        let bias = if self.bias.is_some() {
            self.out_dim * 4
        } else {
            0
        };
        self.out_dim * self.in_dim * self.dtype.size_in_bytes() + bias
    }
    fn describe(&self) -> String {
        format!(
            "{} {}×{}{}",
            self.dtype.as_str().to_ascii_lowercase(),
            self.in_dim,
            self.out_dim,
            if self.bias.is_some() { " +bias" } else { "" }
        )
    }
}

/// Which projection a linear is; the four refinement sets of the method (qkv, o, gu, d) are
/// unions of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinearRole {
    Query,
    Key,
    Value,
    AttnOutput,
    Gate,
    Up,
    Down,
    LmHead,
    /// The token embedding table `[vocab, hidden]`, read by row gathers only.
    Embedding,
}

impl LinearRole {
    /// The decoder projection named `self_attn.q_proj` … `mlp.down_proj`.
    pub fn of_projection(name: &str) -> Option<Self> {
        Some(match name {
            "self_attn.q_proj" => Self::Query,
            "self_attn.k_proj" => Self::Key,
            "self_attn.v_proj" => Self::Value,
            "self_attn.o_proj" => Self::AttnOutput,
            "mlp.gate_proj" => Self::Gate,
            "mlp.up_proj" => Self::Up,
            "mlp.down_proj" => Self::Down,
            _ => return None,
        })
    }

    pub fn describe(self) -> &'static str {
        match self {
            LinearRole::Query => "query projection",
            LinearRole::Key => "key projection",
            LinearRole::Value => "value projection",
            LinearRole::AttnOutput => "attention output projection",
            LinearRole::Gate => "MLP gate projection",
            LinearRole::Up => "MLP up projection",
            LinearRole::Down => "MLP down projection",
            LinearRole::LmHead => "output head",
            LinearRole::Embedding => "token embedding",
        }
    }
}

/// Everything a factory needs to build one projection.
#[derive(Debug, Clone, Copy)]
pub struct LinearSpec<'a> {
    /// Decoder layer, `None` for the output head.
    pub layer: Option<usize>,
    pub role: LinearRole,
    /// Hugging Face tensor name of the `[out, in]` weight.
    pub weight_name: &'a str,
    pub bias_name: Option<&'a str>,
    pub out_dim: usize,
    pub in_dim: usize,
}

/// Builds the linear for each projection of a model being loaded.
pub trait LinearFactory<B: Backend> {
    fn load(
        &self,
        backend: &B,
        tensors: &dyn TensorSource,
        spec: &LinearSpec<'_>,
    ) -> Result<Box<dyn Linear<B>>>;

    /// The token embedding (`spec.role` is [`LinearRole::Embedding`], `[vocab, hidden]` as
    /// `[out_dim, in_dim]`), read through [`Linear::gather_rows`]. The default is the float
    /// table at `precision`; a format that stores the table quantized overrides this.
    fn load_embedding(
        &self,
        backend: &B,
        tensors: &dyn TensorSource,
        spec: &LinearSpec<'_>,
        precision: WeightPrecision,
    ) -> Result<Arc<dyn Linear<B>>> {
        Ok(Arc::new(FloatLinear::load(
            backend, tensors, spec, precision,
        )?))
    }

    /// The output head of a model with tied embeddings: the embedding itself (float or
    /// quantized, one resident copy either way).
    fn tied_lm_head(
        &self,
        _backend: &B,
        embedding: &Arc<dyn Linear<B>>,
        _spec: &LinearSpec<'_>,
    ) -> Result<Box<dyn Linear<B>>> {
        Ok(Box::new(SharedLinear(embedding.clone())))
    }
}

/// One resident linear serving two roles (a tied embedding and head): every call goes to
/// the shared weight.
pub struct SharedLinear<B: Backend>(pub Arc<dyn Linear<B>>);

impl<B: Backend> Linear<B> for SharedLinear<B> {
    fn in_dim(&self) -> usize {
        self.0.in_dim()
    }
    fn out_dim(&self) -> usize {
        self.0.out_dim()
    }
    fn has_bias(&self) -> bool {
        self.0.has_bias()
    }
    fn forward(&self, backend: &B, x: &B::Buffer, m: usize, y: &mut B::Buffer) -> Result<()> {
        self.0.forward(backend, x, m, y)
    }
    fn forward_add(
        &self,
        backend: &B,
        x: &B::Buffer,
        m: usize,
        acc: &mut B::Buffer,
        scratch: &mut B::Buffer,
    ) -> Result<()> {
        self.0.forward_add(backend, x, m, acc, scratch)
    }
    fn matrix_parts(&self) -> Option<(&B::Matrix, Option<&B::Buffer>)> {
        self.0.matrix_parts()
    }
    fn gather_rows(&self, backend: &B, tokens: &B::Index, out: &mut B::Buffer) -> Result<()> {
        self.0.gather_rows(backend, tokens, out)
    }
    fn resident_bytes(&self) -> usize {
        self.0.resident_bytes()
    }
    fn describe(&self) -> String {
        self.0.describe()
    }
}

/// Float linears from a float checkpoint.
#[derive(Debug, Clone, Copy, Default)]
pub struct FloatLinearFactory {
    pub precision: WeightPrecision,
}

impl<B: Backend> LinearFactory<B> for FloatLinearFactory {
    fn load(
        &self,
        backend: &B,
        tensors: &dyn TensorSource,
        spec: &LinearSpec<'_>,
    ) -> Result<Box<dyn Linear<B>>> {
        Ok(Box::new(FloatLinear::load(
            backend,
            tensors,
            spec,
            self.precision,
        )?))
    }
}

/// Fetches a tensor, turning "not found" into an error that says what it was needed for.
pub(crate) fn require<'a>(
    tensors: &'a dyn TensorSource,
    name: &str,
    why: &str,
) -> Result<sfx_formats::TensorView<'a>> {
    match tensors.tensor(name) {
        Ok(v) => Ok(v),
        Err(sfx_formats::FormatError::MissingTensor(_)) => Err(RuntimeError::MissingTensor {
            name: name.to_string(),
            why: why.to_string(),
        }),
        Err(e) => Err(e.into()),
    }
}

/// The projection's f32 bias when the spec names one (checked against `out_dim`).
pub(crate) fn load_bias(
    tensors: &dyn TensorSource,
    spec: &LinearSpec<'_>,
) -> Result<Option<Vec<f32>>> {
    let Some(name) = spec.bias_name else {
        return Ok(None);
    };
    let b = require(
        tensors,
        name,
        "bias of an attention projection (attention_bias)",
    )?;
    check_shape(name, b.shape, &[spec.out_dim])?;
    Ok(Some(b.to_f32_vec()))
}

pub(crate) fn check_shape(name: &str, actual: &[usize], expected: &[usize]) -> Result<()> {
    if actual == expected {
        Ok(())
    } else {
        Err(RuntimeError::TensorShape {
            name: name.to_string(),
            expected: expected.to_vec(),
            actual: actual.to_vec(),
        })
    }
}

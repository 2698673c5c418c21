//! Resident quantizers behind one trait (mistral.rs `QuantMethod` style: one file per
//! method). A quantizer turns one projection's float weight into a resident layout from
//! `sfx_formats::resident`; activation-aware methods (AWQ, SqueezeLLM, YAQA/QTIP) read the
//! calibration statistics they need from [`CalibrationStats`].
//!
//! - [`rtn`]: asymmetric min/max round-to-nearest per group of 128 input channels.
//! - [`awq`]: activation-aware per-channel scales (folded into the input's producer) and
//!   clipping on top of the same group layout.
//! - [`file_base`]: the codes of an existing container, kept as they are.
//! - [`gguf_base`]: a llama.cpp GGUF's own blocks, kept as they are.
//! - [`ggml_quant`]: a float model rounded into llama.cpp's block types as `llama-quantize`
//!   rounds them ([`ggml_rounding`]).
//! - [`sqllm`]: SqueezeLLM's sensitivity-weighted k-means per row into look-up-table codes
//!   (`LutQuantized`), weighted by the Fisher diagonal.
//! - [`lnq`]: GuidedQuant's layer-wise non-uniform quantization, SqueezeLLM's tables refined
//!   against each output group's gradient-weighted layer error.
//! - [`qtip`]: random-Hadamard incoherence + LDLQ with the input Hessian + bitshift-trellis
//!   Viterbi per 16×16 tile (`TrellisQuantized`).

pub mod awq;
pub mod file_base;
pub mod ggml_quant;
pub mod ggml_rounding;
pub mod gguf_base;
pub mod head;
pub mod kept_base;
pub mod lnq;
pub mod qtip;
pub mod rtn;
pub mod sqllm;
pub mod yaqa;

pub use awq::Awq;
pub use file_base::FileBase;
pub use ggml_quant::GgmlQuant;
pub use gguf_base::GgufBase;
pub use head::TableQuant;
pub use kept_base::KeptBase;
pub use lnq::Lnq;
pub use qtip::Qtip;
pub use rtn::Rtn;
use sfx_formats::gguf::BlockTensor;
pub use sfx_formats::resident::{
    GroupQuantized, LutQuantized, ResidentError, TrellisQuantized, DEFAULT_GROUP_SIZE,
};
use sfx_runtime::ProjectionSet;
pub use sqllm::SqueezeLlm;
use std::collections::BTreeMap;
pub use yaqa::Yaqa;

/// A borrowed row-major float weight `[rows (out), cols (in)]` of one projection.
#[derive(Debug, Clone, Copy)]
pub struct WeightView<'a> {
    /// Tensor name, for messages.
    pub name: &'a str,
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    /// YAQA's Kronecker factors of the full-model KL Hessian for this weight, if computed.
    pub kron: Option<Kron<'a>>,
    /// The diagonal of the empirical Fisher information of this weight (`rows × cols`, the
    /// summed squared gradients of the loss on the calibration text), if computed:
    /// SqueezeLLM's per-weight sensitivity.
    pub fisher: Option<&'a [f32]>,
    /// A user's importance of each input column (`cols` values, llama.cpp's importance matrix
    /// read from a file), if given: the weighting of llama.cpp's block rounding.
    pub imatrix: Option<&'a [f32]>,
    /// GuidedQuant's Hessians of this weight's output groups, if computed: LNQ's objective.
    pub guided: Option<&'a crate::yaqa::GuidedHessian>,
}

/// The mean of the diagonal of the row-major `n × n` matrix `m`: the scale relative damping
/// and normalisation of a Hessian are measured in.
pub(crate) fn mean_diagonal(m: &[f32], n: usize) -> f64 {
    (0..n).map(|i| f64::from(m[i * n + i])).sum::<f64>() / n as f64
}

/// Kronecker factors `H_in` (`cols²`) and `H_out` (`rows²`), row-major, of one weight's
/// Hessian (`tr(E H_in Eᵀ H_out)`), as accumulated by [`crate::yaqa`].
#[derive(Debug, Clone, Copy)]
pub struct Kron<'a> {
    pub h_in: &'a [f32],
    pub h_out: &'a [f32],
}

/// Input statistics of one projection set from the calibration pass, everything an
/// activation-aware quantizer consumes: AWQ's scale and clip searches need `gram` and
/// `abs_mean`; QTIP/YAQA's LDLQ needs the same `H = E[x xᵀ]` (= `gram`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct InputStats {
    /// Input channels.
    pub cols: usize,
    /// Tokens accumulated.
    pub tokens: u64,
    /// `E[x xᵀ]`, row-major `[cols, cols]`.
    pub gram: Vec<f32>,
    /// `E[|x_i|]` per input channel.
    pub abs_mean: Vec<f32>,
}

/// What the converter tells a quantizer about the set it quantizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SetContext {
    pub set: ProjectionSet,
    /// Whether per-input-channel scales can be folded into the op that produces the set's
    /// input (an RMSNorm, `up_proj` rows, or `v_proj` rows when o's input channels map 1:1
    /// to v's outputs, i.e. without GQA). When false, input scales must not be returned.
    pub scales_foldable: bool,
}

/// A quantized projection set.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedSet {
    /// One resident weight per input weight, in order. They act on `x / s` when
    /// `input_scales` is `Some(s)`, i.e. they hold `Q(W·diag(s))`.
    pub weights: Vec<ResidentWeight>,
    /// Per-input-channel scales `s` the caller folds into the input's producer.
    pub input_scales: Option<Vec<f32>>,
    /// Quantizer-specific record for the container metadata (e.g. AWQ's α).
    pub info: BTreeMap<String, f64>,
}

/// Every resident format a quantizer can produce (or a base file holds).
#[derive(Debug, Clone, PartialEq)]
pub enum ResidentWeight {
    Group(GroupQuantized),
    Trellis(TrellisQuantized),
    /// A llama.cpp GGUF weight kept in its own blocks ([`gguf_base`]).
    Gguf(BlockTensor),
    /// Per-row look-up-table codes ([`sqllm`]).
    Lut(LutQuantized),
}

impl ResidentWeight {
    pub fn bits_per_weight(&self) -> f64 {
        match self {
            ResidentWeight::Group(g) => g.bits_per_weight(),
            ResidentWeight::Trellis(t) => t.bits_per_weight(),
            ResidentWeight::Gguf(t) => t.bytes.len() as f64 * 8.0 / (t.rows * t.cols) as f64,
            ResidentWeight::Lut(l) => l.bits_per_weight(),
        }
    }
    /// Resident bytes of this projection's own sections.
    pub fn size_in_bytes(&self) -> usize {
        match self {
            ResidentWeight::Group(g) => g.size_in_bytes(),
            ResidentWeight::Trellis(t) => t.size_in_bytes(),
            ResidentWeight::Gguf(t) => t.bytes.len(),
            ResidentWeight::Lut(l) => l.size_in_bytes(),
        }
    }
    pub fn rows(&self) -> usize {
        match self {
            ResidentWeight::Group(g) => g.rows(),
            ResidentWeight::Trellis(t) => t.rows(),
            ResidentWeight::Gguf(t) => t.rows,
            ResidentWeight::Lut(l) => l.rows(),
        }
    }
    pub fn cols(&self) -> usize {
        match self {
            ResidentWeight::Group(g) => g.cols(),
            ResidentWeight::Trellis(t) => t.cols(),
            ResidentWeight::Gguf(t) => t.cols,
            ResidentWeight::Lut(l) => l.cols(),
        }
    }
    /// Dequantized weight in the original domain, row-major (R = W − Ŵ for the refinement
    /// needs it). Fails only on a trellis weight whose stored Hadamard factors are unusable.
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>, QuantError> {
        match self {
            ResidentWeight::Group(g) => Ok(g.dequantize()),
            ResidentWeight::Lut(l) => Ok(l.dequantize()),
            ResidentWeight::Trellis(t) => {
                sfx_runtime::resident::dequantize_trellis(t).map_err(|e| QuantError::Layout {
                    name: name.to_string(),
                    source: ResidentError::Invalid(e.to_string()),
                })
            }
            ResidentWeight::Gguf(t) => t.dequantize().map_err(|e| QuantError::Base {
                name: name.to_string(),
                message: e.to_string(),
            }),
        }
    }
}

/// Errors from quantizing one projection.
#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    #[error("{name}: {source}")]
    Layout {
        name: String,
        #[source]
        source: ResidentError,
    },
    #[error("{name}: the importance matrix has no entry for this weight (--imatrix-file)")]
    MissingImportance { name: String },
    #[error("{name}: resident base: {message}")]
    Base { name: String, message: String },
    #[error("{name}: {method} needs calibration statistics ({what})")]
    MissingStats {
        name: String,
        method: &'static str,
        what: &'static str,
    },
}

/// A resident quantizer: the float weights of one projection set (linears sharing one input)
/// plus, for activation-aware methods, the set's [`InputStats`] → resident layouts.
/// Must be deterministic: converting twice gives identical bytes.
pub trait ResidentQuantizer: Send + Sync {
    /// Short name for logs and container metadata, e.g. `"awq3-g128"`.
    fn name(&self) -> String;
    /// Whether [`ResidentQuantizer::quantize_set`] needs `stats` (the converter then runs the
    /// statistics pass first).
    fn needs_calibration(&self) -> bool {
        false
    }
    fn quantize_set(
        &self,
        weights: &[WeightView<'_>],
        stats: Option<&InputStats>,
        context: SetContext,
    ) -> Result<QuantizedSet, QuantError>;
}

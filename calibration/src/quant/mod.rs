//! Resident quantizers behind one trait (mistral.rs `QuantMethod` style: one file per
//! method). A quantizer turns one projection's float weight into a resident layout from
//! `sfx_formats::resident`; activation-aware methods (AWQ, SqueezeLLM, YAQA/QTIP) read the
//! calibration statistics they need from [`CalibrationStats`].
//!
//! - [`rtn`]: asymmetric min/max round-to-nearest per group of 128 input channels.

pub mod awq;
pub mod rtn;

pub use rtn::Rtn;
pub use sfx_formats::resident::{GroupQuantized, ResidentError, DEFAULT_GROUP_SIZE};

/// A borrowed row-major float weight `[rows (out), cols (in)]` of one projection.
#[derive(Debug, Clone, Copy)]
pub struct WeightView<'a> {
    /// Tensor name, for messages.
    pub name: &'a str,
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
}

/// Per-projection calibration statistics an activation-aware quantizer consumes.
/// Placeholder until the calibration pass lands: AWQ needs the per-input-channel mean |x|
/// (`channel_abs_mean`, length `cols`) and a sample of inputs for its output-MSE searches.
#[derive(Debug, Clone, Default)]
pub struct CalibrationStats {
    /// Mean |x_i| over calibration tokens, one per input channel.
    pub channel_abs_mean: Vec<f32>,
    /// Sampled input rows, row-major `[samples, cols]`.
    pub samples: Vec<f32>,
}

/// Every resident format a quantizer can produce. Non-uniform (SqueezeLLM LUT) and trellis
/// (QTIP) layouts become further variants.
#[derive(Debug, Clone, PartialEq)]
pub enum ResidentWeight {
    Group(GroupQuantized),
}

impl ResidentWeight {
    pub fn bits_per_weight(&self) -> f64 {
        match self {
            ResidentWeight::Group(g) => g.bits_per_weight(),
        }
    }
    /// Dequantized weight, row-major (R = W − Ŵ for the refinement needs it).
    pub fn dequantize(&self) -> Vec<f32> {
        match self {
            ResidentWeight::Group(g) => g.dequantize(),
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
    #[error("{name}: {method} needs calibration statistics ({what})")]
    MissingStats {
        name: String,
        method: &'static str,
        what: &'static str,
    },
}

/// A resident quantizer: float weight (+ optional statistics) → resident layout.
/// Must be deterministic: converting twice gives identical bytes.
pub trait ResidentQuantizer: Send + Sync {
    /// Short name for logs and container metadata, e.g. `"rtn4-g128"`.
    fn name(&self) -> String;
    /// Whether [`ResidentQuantizer::quantize`] needs `stats` (the converter then runs the
    /// calibration pass first).
    fn needs_calibration(&self) -> bool {
        false
    }
    fn quantize(
        &self,
        weight: WeightView<'_>,
        stats: Option<&CalibrationStats>,
    ) -> Result<ResidentWeight, QuantError>;
}

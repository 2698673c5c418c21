//! Resident (fast-tier) quantized linears, one file per format (mistral.rs `QuantMethod`
//! layout). Each implements [`crate::Linear`] for the backends it has kernels for and comes
//! with a [`crate::LinearFactory`] so a whole model loads with it.
//!
//! - [`group`]: group-wise asymmetric integer weights (`sfx_formats::resident::GroupQuantized`,
//!   RTN / AWQ codes) — CPU decode matvec unpacking codes on the fly, dequantized-panel GEMM
//!   for prefill, and [`RtnFactory`] quantizing every projection at load.
//! - [`hadamard`], [`trellis`]: QTIP's rotations and bitshift-trellis codes / Viterbi.
//! - [`trellis_linear`]: trellis-coded weights (`TrellisQuantized`, QTIP / YAQA) — decode
//!   matvec decoding tiles on the fly between the input and output Hadamard transforms.

pub mod group;
pub mod hadamard;
pub mod trellis;
pub mod trellis_kernel;
pub mod trellis_linear;
mod viterbi_kernel;

pub use group::{GroupQuantLinear, RtnFactory};
pub use trellis_linear::{dequantize_trellis, TrellisLinear};

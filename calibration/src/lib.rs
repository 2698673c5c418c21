//! Quantizers, calibration statistics, refinement fitting and the tuner.
//!
//! Empty in the foundation release: the converter milestone (resident quantizers behind one
//! trait, calibration statistics M = E[zzᵀ] and G = E[xzᵀ], the fitted refinement solve
//! C (M + λI) = R G + λR) lands here. Calibration text comes from
//! `sfx_formats::corpus` (`brown` by default).

pub mod convert;
pub mod quant;
pub mod refine;
pub mod stats;
#[cfg(test)]
mod test_util;
pub mod tune;
pub mod yaqa;

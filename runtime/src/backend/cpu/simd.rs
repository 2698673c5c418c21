//! Which vector instruction set the CPU kernels use. Detected once at run time so one binary
//! runs on any x86-64 host (the release binary also runs on hosts without AVX-512) and on
//! other architectures through the portable path.

use crate::error::{Result, RuntimeError};

/// Instruction-set tiers with hand-written or multiversioned kernels, weakest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// Portable Rust; LLVM vectorizes it for the baseline target (SSE2 on x86-64).
    Scalar,
    /// AVX2 + FMA (x86-64-v3: Haswell/Zen 1 and later).
    Avx2,
    /// AVX-512F on top of AVX2 + FMA (Skylake-SP, Zen 4).
    Avx512,
}

/// Whether the AVX-512 tier also has the integer extensions the int8 kernels use (BW, VL,
/// VBMI, VNNI: Ice Lake, Zen 4 and later). Cached by std's feature detection.
pub(crate) fn avx512_int8_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        SimdLevel::Avx512.is_supported()
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512vbmi")
            && std::arch::is_x86_feature_detected!("avx512vnni")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

impl SimdLevel {
    /// The best tier this CPU supports.
    pub fn detect() -> Self {
        Self::all()
            .into_iter()
            .rev()
            .find(|l| l.is_supported())
            .unwrap_or(SimdLevel::Scalar)
    }

    pub fn all() -> [SimdLevel; 3] {
        [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512]
    }

    /// Every tier this CPU can run (tests compare each against the reference loops).
    pub fn supported() -> Vec<SimdLevel> {
        Self::all()
            .into_iter()
            .filter(|l| l.is_supported())
            .collect()
    }

    pub fn is_supported(self) -> bool {
        match self {
            SimdLevel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => {
                SimdLevel::Avx2.is_supported() && std::arch::is_x86_feature_detected!("avx512f")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
        }
    }

    /// Parses `scalar`, `avx2` or `avx512` (the `SFX_CPU_SIMD` override) and checks the CPU
    /// supports it.
    pub fn parse_supported(s: &str) -> Result<Self> {
        let level = match s.trim().to_ascii_lowercase().as_str() {
            "scalar" | "none" => SimdLevel::Scalar,
            "avx2" => SimdLevel::Avx2,
            "avx512" => SimdLevel::Avx512,
            other => {
                return Err(RuntimeError::Unsupported(format!(
                    "unknown SIMD level '{other}' (expected scalar, avx2 or avx512)"
                )))
            }
        };
        if !level.is_supported() {
            return Err(RuntimeError::Unsupported(format!(
                "this CPU does not support {} (best available: {})",
                level.as_str(),
                Self::detect().as_str()
            )));
        }
        Ok(level)
    }
}

//! Decode activations quantized to int8 in blocks of 32, for integer dot-product kernels.
//!
//! A block `b` of 32 inputs becomes `x̃_i = d_b·q_i` with `d_b = max|x_b| / 127` and
//! `q_i = round(x_i / d_b)` in [−127, 127] (llama.cpp's `Q8_0` activations). A coded weight's
//! integer codes then meet `q` in `u8 × i8 → i32` dot products (`vpdpbusd`, `pmaddubsw`), four
//! products per instruction lane instead of one f32 FMA, and each block's integer sum is
//! scaled by `d_b` once. The result is exactly `Ŵ·x̃`: the only approximation is `x → x̃`,
//! a relative error of at most 1/254 of the block's largest input per element.
//!
//! Which activations a decode uses is the backend's [`DecodeActivations`] setting: the CPU
//! backend built by [`crate::CpuBackend::new`] keeps f32 activations (it is the reference the
//! GPU kernels are checked against); the command-line tools run int8 unless told otherwise.

use crate::error::{Result, RuntimeError};

/// Runs `$call` over `$y` in blocks of `$rows` rows, then one row at a time over the rest:
/// `$r0` is the block's first row, `$yb` its outputs, and the const `$r` its row count (an
/// int8 kernel's interleave factor, a const generic of its block function).
macro_rules! by_row_blocks {
    ($y:expr, $rows:expr, |$r0:ident, $yb:ident, $r:ident| $call:expr) => {{
        let n = $y.len();
        let whole = n - n % $rows;
        for $r0 in (0..whole).step_by($rows) {
            const $r: usize = $rows;
            let $yb = &mut $y[$r0..$r0 + $rows];
            $call;
        }
        for $r0 in whole..n {
            const $r: usize = 1;
            let $yb = &mut $y[$r0..$r0 + 1];
            $call;
        }
    }};
}
pub(crate) use by_row_blocks;

/// Whether the int8 kernels run at `level` on this machine: AVX-512 with VNNI and VBMI. On
/// other tiers coded projections keep their f32 kernels: a portable integer path measured
/// 0.33–0.57× of them on AVX2 (results.md), slower than no int8 at all.
pub(crate) fn int8_kernels_at(level: crate::backend::cpu::SimdLevel) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        level == crate::backend::cpu::SimdLevel::Avx512
            && crate::backend::cpu::simd::avx512_int8_supported()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = level;
        false
    }
}

/// Inputs per activation block (one f32 scale each).
pub const ACT_BLOCK: usize = 32;

/// How a CPU decode step (one or two tokens) feeds activations to coded projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DecodeActivations {
    /// f32 activations, f32 FMAs over the unpacked codes: the reference numerics.
    #[default]
    F32,
    /// Activations quantized per block of 32 to int8, integer dot products.
    Int8,
}

impl DecodeActivations {
    /// Parses `f32` or `int8` (the tools' `SFX_CPU_ACTIVATIONS`).
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "float" | "exact" => Ok(Self::F32),
            "int8" | "i8" | "q8" => Ok(Self::Int8),
            other => Err(RuntimeError::Unsupported(format!(
                "unknown CPU decode activations '{other}' (expected f32 or int8)"
            ))),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Int8 => "int8",
        }
    }
}

/// One decode row of activations in int8 blocks.
#[derive(Debug, Clone, Default)]
pub struct Q8Activations {
    /// `q_i`, one per input.
    pub q: Vec<i8>,
    /// `d_b`, one per block of [`ACT_BLOCK`] inputs.
    pub d: Vec<f32>,
    /// `Σ_{i∈b} q_i` per block (for zero points: `Σ_i z·x̃_i = z·Σ_b d_b·sum_b`).
    pub sums: Vec<i32>,
}

impl Q8Activations {
    /// Quantizes `x`, whose length must be a multiple of [`ACT_BLOCK`] (callers check).
    pub fn quantize(x: &[f32]) -> Self {
        let mut a = Self::default();
        a.requantize(x);
        a
    }

    /// Quantizes `x` into this buffer, reusing its allocations.
    pub fn requantize(&mut self, x: &[f32]) {
        debug_assert_eq!(x.len() % ACT_BLOCK, 0);
        let blocks = x.len() / ACT_BLOCK;
        self.q.resize(x.len(), 0);
        self.d.resize(blocks, 0.0);
        self.sums.resize(blocks, 0);
        for (((xb, qb), d), s) in x
            .chunks_exact(ACT_BLOCK)
            .zip(self.q.chunks_exact_mut(ACT_BLOCK))
            .zip(self.d.iter_mut())
            .zip(self.sums.iter_mut())
        {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            // A non-finite input poisons its block's scale (NaN/inf), as it would poison an
            // f32 dot: the output shows it instead of hiding it behind a clamped code.
            *d = amax / 127.0;
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            let mut sum = 0i32;
            for (q, &v) in qb.iter_mut().zip(xb) {
                // Adding 1.5·2^23 rounds to nearest (ties to even) in the FPU's own mode and
                // vectorizes on every tier, where `round` is a libm call per element.
                const SHIFTER: f32 = 12_582_912.0;
                let r = ((v * inv).clamp(-127.0, 127.0) + SHIFTER - SHIFTER) as i8;
                *q = r;
                sum += i32::from(r);
            }
            *s = sum;
        }
    }

    /// Per 64 inputs, the 16 i32 lanes' block scales of a `vpdpbusd` over them in input
    /// order: `d` of the first 32 inputs ×8, of the next 32 ×8.
    pub(crate) fn pair_lane_scales(&self) -> Vec<f32> {
        self.d
            .chunks_exact(2)
            .flat_map(|p| {
                let (a, b) = (p[0], p[1]);
                (0..16).map(move |l| if l < 8 { a } else { b })
            })
            .collect()
    }

    /// `x̃`, the values the integer kernels multiply (tests and references).
    pub fn dequantized(&self) -> Vec<f32> {
        self.q
            .chunks_exact(ACT_BLOCK)
            .zip(&self.d)
            .flat_map(|(qb, &d)| qb.iter().map(move |&q| d * f32::from(q)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::lcg;

    /// Every element within half a step of its block's grid, block sums equal to the codes'
    /// sum, an all-zero block exact, and the largest magnitude of each block hit exactly.
    #[test]
    fn quantization_error_is_half_a_step() {
        let mut seed = 3u64;
        let mut x: Vec<f32> = (0..8 * ACT_BLOCK).map(|_| 4.0 * lcg(&mut seed)).collect();
        x[ACT_BLOCK..2 * ACT_BLOCK].fill(0.0);
        x[70] = -1e3; // an outlier owns its block's scale
        let a = Q8Activations::quantize(&x);
        let xt = a.dequantized();
        for (b, xb) in x.chunks_exact(ACT_BLOCK).enumerate() {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let step = amax / 127.0;
            let qs: i32 = a.q[b * ACT_BLOCK..(b + 1) * ACT_BLOCK]
                .iter()
                .map(|&q| i32::from(q))
                .sum();
            assert_eq!(qs, a.sums[b]);
            for (i, &v) in xb.iter().enumerate() {
                let e = (xt[b * ACT_BLOCK + i] - v).abs();
                assert!(
                    e <= 0.5 * step * (1.0 + 1e-6) + 1e-30,
                    "block {b} [{i}] err {e}"
                );
                if v.abs() == amax && amax > 0.0 {
                    assert_eq!(a.q[b * ACT_BLOCK + i].unsigned_abs(), 127);
                }
            }
        }
        assert!(xt[ACT_BLOCK..2 * ACT_BLOCK].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn parse_names_the_bad_value() {
        assert_eq!(
            DecodeActivations::parse("INT8").unwrap(),
            DecodeActivations::Int8
        );
        assert_eq!(
            DecodeActivations::parse("f32").unwrap(),
            DecodeActivations::F32
        );
        let e = DecodeActivations::parse("fp4").unwrap_err().to_string();
        assert!(e.contains("fp4"), "{e}");
    }
}

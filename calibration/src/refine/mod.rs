//! Weight refinement (docs/method.md §2): the fitted refinement solve and DecDEC's 4-bit
//! column-major storage.
//!
//! - [`fit_refinement`]: C minimising E‖Rx − C z_k(x)‖² + λ‖C − P‖²_F, i.e.
//!   C (M + λI) = R G + λP, by Cholesky (faer, f64), with the prior P of [`FitPrior`].
//! - [`quantize_columns_4bit`]: C → [`RefinementColumns`] (symmetric 4-bit, per-output-row
//!   fp16 scale from a 32-point MSE grid search, column-major nibbles).
//! - [`RefinementColumns::apply`]: reference y' = Ŵx + Σ_{i∈S(x)} x_i C[:, i].
//!
//! Plain (DecDEC) refinement is `quantize_columns_4bit(R)`. [`bundles`]: the neuron-wise MLP
//! alternative (eq. 5–6).

pub mod bundles;

use crate::stats::RefinementStats;
use faer::linalg::solvers::Solve;
use faer::{Mat, Side};
use half::f16;
use rayon::prelude::*;

/// Errors from fitting a refinement.
#[derive(Debug, thiserror::Error)]
pub enum RefineError {
    #[error("shape mismatch: {0}")]
    Shape(String),
    #[error("no calibration rows accumulated")]
    NoData,
    #[error("M + λI (λ = {lambda}) is not positive definite; use a larger λ")]
    NotPositiveDefinite { lambda: f64 },
}

/// Mean of diag(M) with M = E[z zᵀ]: the unit of the default ridge λ.
pub fn default_lambda(stats: &RefinementStats) -> f64 {
    let d = stats.in_dim;
    if d == 0 || stats.n == 0 {
        return 0.0;
    }
    let tr: f64 = (0..d).map(|i| stats.m[i * d + i]).sum();
    tr / d as f64 / stats.n as f64
}

/// The ridge λ of the fit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Lambda {
    /// This value for every projection set.
    Absolute(f64),
    /// This multiple of [`default_lambda`] of each set's statistics (1.0: the default).
    MeanDiag(f64),
}

impl Default for Lambda {
    fn default() -> Self {
        Self::MeanDiag(1.0)
    }
}

impl Lambda {
    /// `0.05` (absolute) or `0.1x` (a multiple of mean diag(M)).
    pub fn parse(s: &str) -> Option<Self> {
        let (v, relative) = match s.strip_suffix('x') {
            Some(v) => (v, true),
            None => (s, false),
        };
        let v: f64 = v.trim().parse().ok()?;
        if !(v.is_finite() && v > 0.0) {
            return None;
        }
        Some(if relative {
            Self::MeanDiag(v)
        } else {
            Self::Absolute(v)
        })
    }

    /// λ for one set's statistics.
    pub fn value(self, stats: &RefinementStats) -> f64 {
        match self {
            Self::Absolute(v) => v,
            Self::MeanDiag(m) => m * default_lambda(stats),
        }
    }

    /// The form the container's `params.refine.lambda` records.
    pub fn describe(self) -> serde_json::Value {
        match self {
            Self::Absolute(v) => serde_json::json!(v),
            Self::MeanDiag(1.0) => serde_json::json!("mean_diag_m"),
            Self::MeanDiag(m) => serde_json::json!(format!("{m}x_mean_diag_m")),
        }
    }
}

/// What the ridge pulls C towards where the statistics say little (channels rarely among
/// the top k).
///
/// With unlimited calibration data C = R G M⁻¹ whatever the prior; with 16 K tokens most
/// channels are selected a few dozen times and the prior decides their columns. The residual
/// R is the right guess when the rounding error of one input channel is unrelated to the
/// others' (round-to-nearest, AWQ). An error-feedback quantizer (QTIP/YAQA's LDLQ) pushes each
/// weight's error into the weights rounded after it, so R's columns cancel one another on
/// typical inputs and a column of R alone is a poor correction; pulled towards zero the fit
/// lowers q/k/v's error there but raises down's, and the model's KL ends higher
/// (docs/results.md, issue 16), so the residual stays the default for every base.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FitPrior {
    /// P = R: the plain residual (DecDEC's correction).
    #[default]
    Residual,
    /// P = 0.
    Zero,
}

impl FitPrior {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "residual" => Some(Self::Residual),
            "zero" => Some(Self::Zero),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Residual => "residual",
            Self::Zero => "zero",
        }
    }

    /// The ridge that measured best with this prior on held-out projection error
    /// (docs/results.md, issue 16): 1× mean diag(M) towards the residual, 0.1× towards zero.
    pub fn default_lambda(self) -> Lambda {
        match self {
            Self::Residual => Lambda::MeanDiag(1.0),
            Self::Zero => Lambda::MeanDiag(0.1),
        }
    }
}

/// How C is fitted: the ridge λ and its prior.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct FitSpec {
    pub lambda: Lambda,
    pub prior: FitPrior,
}

/// Fits the refinement matrix C (`out × in`, row-major) for the residual `r` = W − Ŵ
/// (`out × in`, row-major) from calibration `stats` at their budget k:
/// solves C (M + λI) = R G + λP with M = E[zzᵀ], G = E[xzᵀ] and λ, P from `spec`. All
/// arithmetic in f64; the Cholesky factor is computed once and applied to the `out`
/// right-hand sides (as (M + λI) Cᵀ = Gᵀ Rᵀ + λ Pᵀ, M being symmetric).
///
/// Cost: in³/3 (factor) + 2·out·in² (RG and the solve) flops, memory ≈ 3·in² + 2·out·in f64.
pub fn fit_refinement(
    r: &[f32],
    stats: &RefinementStats,
    spec: FitSpec,
) -> Result<Vec<f32>, RefineError> {
    Ok(fit_refinement_f64(r, stats, spec)?
        .into_iter()
        .map(|v| v as f32)
        .collect())
}

/// [`fit_refinement`] without the final rounding to f32 (for checks of the solve itself).
pub fn fit_refinement_f64(
    r: &[f32],
    stats: &RefinementStats,
    spec: FitSpec,
) -> Result<Vec<f64>, RefineError> {
    let d = stats.in_dim;
    if d == 0 || !r.len().is_multiple_of(d) {
        return Err(RefineError::Shape(format!(
            "residual of {} values is not [out, {d}]",
            r.len()
        )));
    }
    if stats.n == 0 {
        return Err(RefineError::NoData);
    }
    let out = r.len() / d;
    let lambda = spec.lambda.value(stats);
    let inv_n = 1.0 / stats.n as f64;
    // A = M + λI (symmetrised against accumulation round-off).
    let a = Mat::<f64>::from_fn(d, d, |i, j| {
        let m = 0.5 * (stats.m[i * d + j] + stats.m[j * d + i]) * inv_n;
        if i == j {
            m + lambda
        } else {
            m
        }
    });
    let rt = Mat::<f64>::from_fn(d, out, |i, o| r[o * d + i] as f64);
    let gt = Mat::<f64>::from_fn(d, d, |i, j| stats.g[j * d + i] * inv_n);
    // Bᵀ = Gᵀ Rᵀ + λ Pᵀ.
    let mut bt = &gt * &rt;
    if spec.prior == FitPrior::Residual {
        bt += faer::Scale(lambda) * &rt;
    }
    let llt = a
        .llt(Side::Lower)
        .map_err(|_| RefineError::NotPositiveDefinite { lambda })?;
    llt.solve_in_place(bt.as_mut());
    // bt is now Cᵀ (in × out).
    let mut c = vec![0.0f64; out * d];
    c.par_chunks_mut(d).enumerate().for_each(|(o, row)| {
        for (i, v) in row.iter_mut().enumerate() {
            *v = bt[(i, o)];
        }
    });
    Ok(c)
}

/// Number of candidate scales in the per-row grid search.
pub const GRID_POINTS: usize = 32;
/// Largest level magnitude: levels are −7..=7.
pub const MAX_LEVEL: i32 = 7;

/// Candidate j ∈ 0..32 of a row with max |c| = `amax`: f16(amax/7 · (1 − 0.7·j/31)), i.e.
/// from the max-abs scale (j = 0, no clipping) down to 30 % of it.
fn candidate_scale(amax: f32, j: usize) -> f16 {
    let ratio = 1.0 - 0.7 * j as f32 / (GRID_POINTS - 1) as f32;
    f16::from_f32((amax / MAX_LEVEL as f32 * ratio).min(f16::MAX.to_f32()))
}

/// Level of `v` at `scale`: round(v / scale) clamped to −7..=7, ties to even (0 for a zero
/// scale). Rounds with the 1.5·2²³ trick after clamping instead of `f32::round`, which is a
/// libm call on baseline x86-64 and blocks vectorisation of the grid search.
#[inline(always)]
pub fn quantize_level(v: f32, scale: f32) -> i32 {
    level_value(v, scale) as i32
}

/// [`quantize_level`] as the float it is computed in: clamped to ±7 before rounding, it is an
/// exact small integer (never −0), so the cast to i32 and back is the identity — a cast that
/// saturates and, done per element, keeps the grid search from vectorising.
#[inline(always)]
fn level_value(v: f32, scale: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23
    if scale > 0.0 {
        let t = (v / scale).clamp(-(MAX_LEVEL as f32), MAX_LEVEL as f32);
        (t + MAGIC) - MAGIC
    } else {
        0.0
    }
}

/// Squared error of one row at `scale` (8 independent f64 lanes so it vectorises).
#[inline(always)]
fn row_sse(row: &[f32], scale: f32) -> f64 {
    let err = |v: f32| {
        let e = (v - level_value(v, scale) * scale) as f64;
        e * e
    };
    let mut acc = [0.0f64; 8];
    let chunks = row.chunks_exact(8);
    let tail: f64 = chunks.remainder().iter().map(|&v| err(v)).sum();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += err(v);
        }
    }
    acc.iter().sum::<f64>() + tail
}

/// Scale of one output row: the best of [`GRID_POINTS`] candidates by squared error (ties →
/// the larger scale). Candidate 0 is the max-abs scale, so the result is never worse than it.
pub fn grid_search_scale(row: &[f32]) -> f16 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked on the line above.
        return unsafe { grid_search_scale_avx2(row) };
    }
    grid_search_scale_portable(row)
}

/// [`grid_search_scale_portable`] compiled for AVX2. The search is a third of a `--fit`
/// conversion's time (every fitted weight is scored at 32 scales); baseline x86-64 runs it
/// 4 floats wide. The same IEEE operations per element in the same per-lane order (Rust
/// never contracts to FMA), so the same scale bit for bit (test below).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn grid_search_scale_avx2(row: &[f32]) -> f16 {
    grid_search_scale_portable(row)
}

#[inline(always)]
fn grid_search_scale_portable(row: &[f32]) -> f16 {
    let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 || !amax.is_finite() {
        return f16::ZERO;
    }
    let mut best = (f64::INFINITY, f16::ZERO);
    for j in 0..GRID_POINTS {
        let s = candidate_scale(amax, j);
        let e = row_sse(row, s.to_f32());
        if e < best.0 {
            best = (e, s);
        }
    }
    best.1
}

/// Max-abs scale f16(max|row| / 7) (no clipping): the grid search's first candidate.
pub fn max_abs_scale(row: &[f32]) -> f16 {
    let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    candidate_scale(amax, 0)
}

/// A 4-bit refinement matrix stored for one-read-per-selected-channel access.
///
/// Column i (input channel i) is `column_bytes() = ceil(out / 2)` consecutive bytes at
/// `i · column_bytes()` in `packed`: byte b holds row 2b in its low nibble and row 2b + 1 in its
/// high nibble, each as `level + 8` (levels −7..7 → nibbles 1..15; an odd `out` pads the last
/// high nibble with 8 = level 0). Value = level · `row_scales[row]` (fp16, resident).
#[derive(Debug, Clone, PartialEq)]
pub struct RefinementColumns {
    pub out: usize,
    pub in_dim: usize,
    pub packed: Vec<u8>,
    pub row_scales: Vec<f16>,
}

/// Quantizes `c` (`out × in`, row-major) to [`RefinementColumns`]. Per output row the scale is
/// [`grid_search_scale`] of that row (across all input channels).
pub fn quantize_columns_4bit(c: &[f32], out: usize, in_dim: usize) -> RefinementColumns {
    assert_eq!(c.len(), out * in_dim, "quantize_columns_4bit: shape");
    let row_scales: Vec<f16> = c.par_chunks(in_dim.max(1)).map(grid_search_scale).collect();
    // Levels row-major (contiguous reads), then packed column-major in blocks of 64 columns
    // so the transposition stays in cache.
    let mut nibbles = vec![8u8; out * in_dim];
    nibbles
        .par_chunks_mut(in_dim.max(1))
        .zip(c.par_chunks(in_dim.max(1)))
        .zip(row_scales.par_iter())
        .for_each(|((nib, row), s)| {
            let s = s.to_f32();
            for (n, &v) in nib.iter_mut().zip(row) {
                *n = (quantize_level(v, s) + 8) as u8;
            }
        });
    let cb = out.div_ceil(2);
    const BLOCK: usize = 64;
    let mut packed = vec![0u8; cb * in_dim];
    packed
        .par_chunks_mut((cb * BLOCK).max(1))
        .enumerate()
        .for_each(|(blk, cols)| {
            let i0 = blk * BLOCK;
            let width = cols.len() / cb.max(1);
            // Rows 2p and 2p + 1 make byte p of every column: one store per byte, no
            // read-modify-write. An odd last row's high nibble is level 0 (stored 8).
            for p in 0..cb {
                let (o_lo, o_hi) = (2 * p, 2 * p + 1);
                let lo = &nibbles[o_lo * in_dim + i0..o_lo * in_dim + i0 + width];
                let hi =
                    (o_hi < out).then(|| &nibbles[o_hi * in_dim + i0..o_hi * in_dim + i0 + width]);
                for (j, &l) in lo.iter().enumerate() {
                    let h = hi.map_or(8, |h| h[j]);
                    cols[j * cb + p] = l | (h << 4);
                }
            }
        });
    RefinementColumns {
        out,
        in_dim,
        packed,
        row_scales,
    }
}

impl RefinementColumns {
    /// Bytes of one packed column.
    pub fn column_bytes(&self) -> usize {
        self.out.div_ceil(2)
    }

    /// The packed bytes of input channel `i` (one contiguous read).
    pub fn column(&self, i: usize) -> &[u8] {
        let cb = self.column_bytes();
        &self.packed[i * cb..(i + 1) * cb]
    }

    /// Level of (row `o`, column `i`).
    #[inline]
    pub fn level(&self, o: usize, i: usize) -> i32 {
        let b = self.column(i)[o / 2];
        let nib = if o.is_multiple_of(2) {
            b & 0x0F
        } else {
            b >> 4
        };
        nib as i32 - 8
    }

    /// Row scales as f32.
    pub fn scales_f32(&self) -> Vec<f32> {
        self.row_scales.iter().map(|s| s.to_f32()).collect()
    }

    /// Dequantized C, row-major `out × in`.
    pub fn dequantize(&self) -> Vec<f32> {
        let scales = self.scales_f32();
        let d = self.in_dim;
        let mut c = vec![0.0f32; self.out * d];
        for i in 0..d {
            self.add_column(&scales, i, 1.0, |o, v| c[o * d + i] = v);
        }
        c
    }

    /// Calls `f(row, x_i · C[row, i])` for every row of column `i`.
    #[inline]
    fn add_column(&self, scales: &[f32], i: usize, xi: f32, mut f: impl FnMut(usize, f32)) {
        for (b, &byte) in self.column(i).iter().enumerate() {
            for (h, nib) in [byte & 0x0F, byte >> 4].into_iter().enumerate() {
                let o = 2 * b + h;
                if o < self.out {
                    f(o, xi * (nib as i32 - 8) as f32 * scales[o]);
                }
            }
        }
    }

    /// Reference refinement: `y += Σ_{i ∈ selected} x_i C[:, i]` where `y` (length `out`)
    /// holds Ŵx on entry and `x` (length `in`) is the projection input of one token.
    pub fn apply(&self, y: &mut [f32], x: &[f32], selected: &[usize]) {
        assert_eq!(y.len(), self.out, "apply: y length");
        assert_eq!(x.len(), self.in_dim, "apply: x length");
        let scales = self.scales_f32();
        for &i in selected {
            self.add_column(&scales, i, x[i], |o, v| y[o] += v);
        }
    }

    /// Bytes of the packed columns plus the fp16 row scales.
    pub fn storage_bytes(&self) -> usize {
        self.packed.len() + 2 * self.row_scales.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values in [-0.01, 0.01).
    fn pseudo(n: usize, seed: u64) -> Vec<f32> {
        crate::test_util::lcg_vec(n, seed)
            .into_iter()
            .map(|v| v * 0.01)
            .collect()
    }

    /// The dispatched search (AVX2 where the CPU has it) picks the scale the baseline build
    /// picks, on heavy-tailed rows of every length class (below, at and past 8-lane chunks).
    #[test]
    fn grid_search_is_the_same_on_every_instruction_set() {
        for (n, seed) in [
            (5usize, 1u64),
            (8, 2),
            (13, 3),
            (576, 4),
            (1536, 5),
            (1537, 6),
        ] {
            for row in pseudo(n * 64, seed).chunks(n) {
                let tails: Vec<f32> = row.iter().map(|v| v * v * v * 1e4).collect();
                assert_eq!(
                    grid_search_scale(&tails).to_bits(),
                    grid_search_scale_portable(&tails).to_bits()
                );
            }
        }
    }

    #[test]
    fn pack_layout_and_round_trip() {
        // Odd out (padded high nibble), and more columns than one 64-column packing block.
        for (out, d) in [(7usize, 5usize), (10, 130)] {
            pack_case(out, d);
        }
    }

    fn pack_case(out: usize, d: usize) {
        let mut c = pseudo(out * d, 3 + d as u64);
        c[2 * d + 1] = 0.0;
        let q = quantize_columns_4bit(&c, out, d);
        assert_eq!(q.column_bytes(), out.div_ceil(2));
        assert_eq!(q.packed.len(), out.div_ceil(2) * d);
        for i in 0..d {
            if out % 2 == 1 {
                assert_eq!(q.column(i)[out / 2] >> 4, 8, "padding nibble is level 0");
            }
            for o in 0..out {
                let s = q.row_scales[o].to_f32();
                assert_eq!(q.level(o, i), quantize_level(c[o * d + i], s));
            }
        }
        let deq = q.dequantize();
        assert_eq!(deq[2 * d + 1], 0.0);
        // apply on some channels = dense product with the dequantized matrix.
        let x = pseudo(d, 9);
        let mut y = vec![1.0f32; out];
        q.apply(&mut y, &x, &[0, 2, 4]);
        for o in 0..out {
            let want = 1.0
                + [0, 2, 4]
                    .iter()
                    .map(|&i| x[i] * deq[o * d + i])
                    .sum::<f32>();
            assert!((y[o] - want).abs() < 1e-6);
        }
    }

    #[test]
    fn error_bounds_and_grid_never_worse() {
        let (out, d) = (33, 300);
        let mut c = pseudo(out * d, 11);
        // Heavy-tailed rows make clipping pay off.
        for o in 0..out {
            c[o * d + o] *= 3.0;
        }
        c[5 * d..6 * d].fill(0.0); // an all-zero row
        let q = quantize_columns_4bit(&c, out, d);
        let deq = q.dequantize();
        for o in 0..out {
            let row = &c[o * d..(o + 1) * d];
            let s = q.row_scales[o].to_f32();
            let s_max = max_abs_scale(row).to_f32();
            // Unclipped entries are within half a step.
            for (i, &v) in row.iter().enumerate() {
                let e = (v - deq[o * d + i]).abs();
                if v.abs() <= MAX_LEVEL as f32 * s {
                    assert!(e <= 0.5 * s * (1.0 + 1e-6) + 1e-12, "row {o}: {e} > {s}/2");
                }
                // At the max-abs scale every entry is (f16 rounding aside) within s/2.
                let e_max = (v - quantize_level(v, s_max) as f32 * s_max).abs();
                assert!(e_max <= 0.5 * s_max * 1.01 + 1e-12);
            }
            assert!(row_sse(row, s) <= row_sse(row, s_max));
        }
        assert!(deq[5 * d..6 * d].iter().all(|&v| v == 0.0));
        // The grid search should actually clip some heavy-tailed rows.
        let improved = (0..out)
            .filter(|&o| {
                let row = &c[o * d..(o + 1) * d];
                row_sse(row, q.row_scales[o].to_f32()) < row_sse(row, max_abs_scale(row).to_f32())
            })
            .count();
        eprintln!("{improved} of {out} rows improved by clipping");
        assert!(improved > out / 2, "only {improved} rows improved");
    }
}

//! AWQ: activation-aware weight quantization (Lin et al. 2024; llm-awq's `auto_scale.py` /
//! `auto_clip.py`), on top of the RTN group quantizer.
//!
//! Per projection set (linears sharing one input, e.g. q, k, v):
//! 1. Scale search: for α ∈ {0, 1/n, …, (n−1)/n} (n = 20: 0, 0.05, …, 0.95),
//!    `s_j = max(mean_t |x_tj|, ·)^α` clamped ≥ 1e-4, normalised `s ← s / sqrt(max(s)·min(s))`;
//!    quantize `W·diag(s)` with RTN (min/max grid) and measure the set's output error
//!    `E = mean_t Σ_linears ‖W x_t − Q(W diag s) diag(s)⁻¹ x_t‖²` on the calibration sample;
//!    keep the best α. α = 0 gives s = 1, i.e. exactly RTN, and ties go to the smaller α, so
//!    the chosen scales are never worse than RTN on this objective.
//! 2. Optional clip search (per linear; llm-awq skips it for q and k): per output row and group,
//!    shrink the group's `[min, max]` (widened to contain 0, as `minmax_grid`) by ratios
//!    1.0 → `min_clip` in `clip_steps` steps and keep the ratio with the lowest
//!    group-local output error `δᵀ G_gg δ`. The clipped weight is kept only if it lowers the
//!    full objective E (cross-group terms included).
//!
//! The error is evaluated through the input Gram matrix `G = XᵀX / n`:
//! `E = Σ_rows Δ_r G Δ_rᵀ`, `Δ = W − Ŵ`, so a capped input sample (≤ 4096 rows) suffices.
//!
//! **Folding.** The returned [`GroupQuantized`] weights hold `W·diag(s)`. The runtime computes
//! `y = Ŵ' x'` where `x'` is the previous op's output, so the caller must make that op emit
//! `x / s`: divide the preceding RMSNorm weight by `s` ([`fold_into_norm`]; qkv ←
//! `input_layernorm`, gate/up ← `post_attention_layernorm`) or the preceding linear's output
//! rows by `s` ([`fold_into_rows`]; o ← v_proj when o's input channels map 1:1 to v's outputs,
//! i.e. no GQA; down ← up_proj, since `silu(gate) ⊙ up` is linear in up).

use super::{GroupQuantized, QuantError, WeightView, DEFAULT_GROUP_SIZE};
use faer::{Accum, Mat, MatMut, MatRef, Par};
use half::f16;
use rayon::prelude::*;
use sfx_formats::resident::{f16_round_up, minmax_grid, ResidentError};

/// AWQ settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Awq {
    /// 2, 3 or 4.
    pub bits: u8,
    /// Input channels per group (a multiple of 8; 128 in AWQ).
    pub group_size: usize,
    /// α grid size n: α ∈ {0, 1/n, …, (n−1)/n}. AWQ: 20.
    pub alpha_steps: usize,
    /// Clip ratios tried, from 1.0 down to `min_clip` inclusive (≥ 2). 0 or 1 disables clipping.
    pub clip_steps: usize,
    /// Smallest clip ratio (AWQ max_shrink 0.5 → 0.5).
    pub min_clip: f32,
}

impl Awq {
    /// `bits`-bit AWQ, group 128, 20 α values, clip ratios 1.0 → 0.5 in 20 steps.
    pub fn new(bits: u8) -> Self {
        Self {
            bits,
            group_size: DEFAULT_GROUP_SIZE,
            alpha_steps: 20,
            clip_steps: 20,
            min_clip: 0.5,
        }
    }

    /// The α grid, `{0, 1/n, …, (n−1)/n}`.
    pub fn alphas(&self) -> Vec<f32> {
        let n = self.alpha_steps.max(1);
        (0..n).map(|i| i as f32 / n as f32).collect()
    }

    /// Clip ratios, 1.0 first.
    pub fn clip_ratios(&self) -> Vec<f32> {
        if self.clip_steps < 2 {
            return vec![1.0];
        }
        let n = (self.clip_steps - 1) as f32;
        (0..self.clip_steps)
            .map(|i| 1.0 - (1.0 - self.min_clip) * i as f32 / n)
            .collect()
    }

    /// AWQ for one projection set: `weights` share the input (same `cols`), `x` is the
    /// calibration input sample row-major `[n, cols]`, `clip[i]` enables the clip search for
    /// `weights[i]` (false for q and k). See the module docs for the caller's folding duty.
    pub fn quantize_set(
        &self,
        weights: &[WeightView<'_>],
        x: &[f32],
        n: usize,
        clip: &[bool],
    ) -> Result<AwqSet, QuantError> {
        let cols = check_set(weights, x, n, clip)?;
        let g = gram(x, n, cols);
        let mean = channel_abs_mean(x, n, cols);
        self.quantize_set_from_stats(weights, &g, &mean, clip)
    }

    /// [`Awq::quantize_set`] from accumulated statistics: `g` = `E[x xᵀ]` (`[cols, cols]`)
    /// and `mean` = `E[|x_i|]` over all calibration tokens, so no activations are stored.
    pub fn quantize_set_from_stats(
        &self,
        weights: &[WeightView<'_>],
        g: &[f32],
        mean: &[f32],
        clip: &[bool],
    ) -> Result<AwqSet, QuantError> {
        let cols = check_weights(weights, clip)?;
        if g.len() != cols * cols || mean.len() != cols {
            return Err(layout(
                weights[0].name,
                "statistics are not [cols, cols] and [cols]",
            ));
        }
        let mut best: Option<AwqSet> = None;
        let mut rtn_error = 0.0;
        for alpha in self.alphas() {
            let cand = self.with_scales(weights, g, awq_scales(mean, alpha), alpha)?;
            if alpha == 0.0 {
                rtn_error = cand.error;
            }
            if best.as_ref().is_none_or(|b| cand.error < b.error) {
                best = Some(cand);
            }
        }
        let mut best = best.ok_or_else(|| layout(weights[0].name, "empty α grid"))?;
        best.rtn_error = rtn_error;
        best.scaled_error = best.error;
        if self.clip_steps >= 2 {
            let ratios = self.clip_ratios();
            let mut total = 0.0;
            for (i, w) in weights.iter().enumerate() {
                let unclipped = best.errors[i];
                if clip[i] {
                    let (q, e) = self.clip_one(w, g, &best.scales, &ratios)?;
                    if e < unclipped {
                        best.weights[i] = q;
                        best.errors[i] = e;
                    }
                }
                total += best.errors[i];
            }
            best.error = total;
        }
        Ok(best)
    }

    /// Quantizes the set with fixed scales `s` (no search, no clip): `Q(W·diag(s))` per linear
    /// and the objective. `alpha` is only recorded. With `s = 1` this is exactly RTN.
    pub fn quantize_with_scales(
        &self,
        weights: &[WeightView<'_>],
        x: &[f32],
        n: usize,
        s: Vec<f32>,
        alpha: f32,
    ) -> Result<AwqSet, QuantError> {
        let cols = check_set(weights, x, n, &vec![false; weights.len()])?;
        if s.len() != cols {
            return Err(layout(weights[0].name, "scale length ≠ cols"));
        }
        let g = gram(x, n, cols);
        let mut set = self.with_scales(weights, &g, s, alpha)?;
        set.rtn_error = f64::NAN;
        set.scaled_error = set.error;
        Ok(set)
    }

    fn with_scales(
        &self,
        weights: &[WeightView<'_>],
        g: &[f32],
        s: Vec<f32>,
        alpha: f32,
    ) -> Result<AwqSet, QuantError> {
        let mut qs = Vec::with_capacity(weights.len());
        let mut errors = Vec::with_capacity(weights.len());
        for w in weights {
            let scaled = scale_columns(w.data, w.cols, &s);
            let q = GroupQuantized::quantize_with(
                &scaled,
                w.rows,
                w.cols,
                self.bits,
                self.group_size,
                minmax_grid,
            )
            .map_err(|source| QuantError::Layout {
                name: w.name.to_string(),
                source,
            })?;
            let mut eff = q.dequantize();
            unscale_columns(&mut eff, w.cols, &s);
            errors.push(output_error(g, w.data, &eff, w.rows, w.cols));
            qs.push(q);
        }
        Ok(AwqSet {
            weights: qs,
            error: errors.iter().sum(),
            errors,
            scales: s,
            alpha,
            rtn_error: f64::NAN,
            scaled_error: f64::NAN,
        })
    }

    /// Clip search for one linear at scales `s`: best ratio per (row, group), then the
    /// quantized `W·diag(s)` with those ratios and its full objective.
    fn clip_one(
        &self,
        w: &WeightView<'_>,
        g: &[f32],
        s: &[f32],
        ratios: &[f32],
    ) -> Result<(GroupQuantized, f64), QuantError> {
        let cols = w.cols;
        let gs = self.group_size;
        let gpr = cols.div_ceil(gs);
        let scaled = scale_columns(w.data, cols, s);
        let bits = self.bits;
        let rows = w.rows;
        // Per group: for each ratio, the rows' weighted errors δ_r G_gg δ_rᵀ as one GEMM
        // (rows × len × len) instead of a dot product per row — the search's hot loop.
        let mut best_ratio = vec![1.0f32; rows * gpr];
        let mut best_err = vec![f64::INFINITY; rows];
        for gi in 0..gpr {
            let c0 = gi * gs;
            let len = gs.min(cols - c0);
            let g_gg = Mat::<f32>::from_fn(len, len, |i, j| g[(c0 + i) * cols + c0 + j]);
            best_err.fill(f64::INFINITY);
            let mut delta = vec![0.0f32; rows * len];
            let mut prod = vec![0.0f32; rows * len];
            for &r in ratios {
                delta
                    .par_chunks_mut(len)
                    .zip(scaled.par_chunks(cols))
                    .for_each(|(d, row)| {
                        let vals = &row[c0..c0 + len];
                        let (scale, zero) = shrink_grid(vals, bits, r);
                        for (j, (dj, &v)) in d.iter_mut().zip(vals).enumerate() {
                            *dj = (v - fake_quant(v, scale, zero, bits)) / s[c0 + j];
                        }
                    });
                faer::linalg::matmul::matmul(
                    MatMut::from_row_major_slice_mut(&mut prod, rows, len),
                    Accum::Replace,
                    MatRef::from_row_major_slice(&delta, rows, len),
                    g_gg.as_ref(),
                    1.0f32,
                    Par::rayon(0),
                );
                best_err
                    .par_iter_mut()
                    .zip(best_ratio.par_chunks_mut(gpr))
                    .zip(delta.par_chunks(len).zip(prod.par_chunks(len)))
                    .for_each(|((be, br), (d, p))| {
                        let e = sfx_runtime::backend::cpu::math::dot(d, p) as f64;
                        if e < *be {
                            *be = e;
                            br[gi] = r;
                        }
                    });
            }
        }
        let mut k = 0usize;
        let q = GroupQuantized::quantize_with(&scaled, w.rows, cols, bits, gs, |vals, b| {
            let r = best_ratio.get(k).copied().unwrap_or(1.0);
            k += 1;
            shrink_grid(vals, b, r)
        })
        .map_err(|source| QuantError::Layout {
            name: w.name.to_string(),
            source,
        })?;
        let mut eff = q.dequantize();
        unscale_columns(&mut eff, cols, s);
        let e = output_error(g, w.data, &eff, w.rows, cols);
        Ok((q, e))
    }
}

/// Result of AWQ on one projection set.
#[derive(Debug, Clone, PartialEq)]
pub struct AwqSet {
    /// `Q(W·diag(s))` per input linear, in order. Dequantize and divide columns by `s`
    /// ([`AwqSet::effective_weights`]) for the weight acting on the *unscaled* input.
    pub weights: Vec<GroupQuantized>,
    /// Per-input-channel scales `s` (length `cols`); fold `1/s` into the preceding op.
    pub scales: Vec<f32>,
    /// Chosen α.
    pub alpha: f32,
    /// Final objective (mean over sample tokens of the summed squared output error).
    pub error: f64,
    /// Final objective per linear.
    pub errors: Vec<f64>,
    /// Objective of plain RTN (α = 0) on the same sample.
    pub rtn_error: f64,
    /// Objective after the scale search, before clipping.
    pub scaled_error: f64,
}

impl AwqSet {
    /// Dequantized weights with the scales divided back out: `Q(W diag s) diag(s)⁻¹`, i.e. the
    /// weight to use on the original (unfolded) input.
    pub fn effective_weights(&self) -> Vec<Vec<f32>> {
        self.weights
            .iter()
            .map(|q| {
                let mut w = q.dequantize();
                unscale_columns(&mut w, q.cols(), &self.scales);
                w
            })
            .collect()
    }
}

fn layout(name: &str, msg: &str) -> QuantError {
    QuantError::Layout {
        name: name.to_string(),
        source: ResidentError::Invalid(format!("awq: {msg}")),
    }
}

fn check_set(
    weights: &[WeightView<'_>],
    x: &[f32],
    n: usize,
    clip: &[bool],
) -> Result<usize, QuantError> {
    let cols = check_weights(weights, clip)?;
    if n == 0 || x.len() != n * cols {
        return Err(layout(weights[0].name, "input sample is not [n, cols]"));
    }
    Ok(cols)
}

fn check_weights(weights: &[WeightView<'_>], clip: &[bool]) -> Result<usize, QuantError> {
    let first = weights
        .first()
        .ok_or_else(|| layout("awq", "empty projection set"))?;
    let cols = first.cols;
    for w in weights {
        if w.cols != cols || w.data.len() != w.rows * w.cols {
            return Err(layout(w.name, "weights of a set must share cols"));
        }
    }
    if clip.len() != weights.len() {
        return Err(layout(first.name, "one clip flag per weight"));
    }
    Ok(cols)
}

/// The min/max grid of [`minmax_grid`] with `[min, max]` (widened to contain 0) shrunk by
/// `ratio`. `ratio = 1` is exactly `minmax_grid`.
pub fn shrink_grid(values: &[f32], bits: u8, ratio: f32) -> (f16, u8) {
    if ratio == 1.0 {
        return minmax_grid(values, bits);
    }
    let qmax = ((1u32 << bits) - 1) as f32;
    let (lo, hi) = values
        .iter()
        .fold((0.0f32, 0.0f32), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    let (lo, hi) = (lo * ratio, hi * ratio);
    let scale = f16_round_up(((hi - lo) / qmax).max(1e-5));
    let zero = (-lo / scale.to_f32()).round().clamp(0.0, qmax) as u8;
    (scale, zero)
}

/// Quantize-dequantize of one value exactly as `GroupQuantized::quantize_with` + dequantize.
pub(crate) fn fake_quant(w: f32, scale: f16, zero: u8, bits: u8) -> f32 {
    let qmax = ((1u16 << bits) - 1) as f32;
    let s = scale.to_f32();
    let z = f32::from(zero);
    let q = if s > 0.0 {
        ((w / s).round() + z).clamp(0.0, qmax)
    } else {
        z
    };
    // quantize_with stores `q as u8`; q is integral in [0, qmax].
    (q - z) * s
}

/// Mean |x| per input channel of row-major `x` `[n, cols]`.
pub fn channel_abs_mean(x: &[f32], n: usize, cols: usize) -> Vec<f32> {
    let mut acc = vec![0.0f64; cols];
    for row in x.chunks_exact(cols).take(n) {
        for (a, &v) in acc.iter_mut().zip(row) {
            *a += v.abs() as f64;
        }
    }
    acc.iter().map(|&a| (a / n.max(1) as f64) as f32).collect()
}

/// AWQ scales for one α: `s = max(mean^α, 1e-4)`, then `s / sqrt(max(s)·min(s))`.
/// α = 0 gives exactly 1 everywhere.
pub fn awq_scales(abs_mean: &[f32], alpha: f32) -> Vec<f32> {
    if alpha == 0.0 {
        return vec![1.0; abs_mean.len()];
    }
    let s: Vec<f32> = abs_mean
        .iter()
        .map(|&m| m.max(0.0).powf(alpha).max(1e-4))
        .collect();
    let (lo, hi) = s.iter().fold((f32::INFINITY, 0.0f32), |(lo, hi), &v| {
        (lo.min(v), hi.max(v))
    });
    let norm = ((hi as f64) * (lo as f64)).sqrt() as f32;
    s.iter().map(|&v| v / norm).collect()
}

/// `G = XᵀX / n` (row-major `[cols, cols]`) of the input sample `x` `[n, cols]`.
pub fn gram(x: &[f32], n: usize, cols: usize) -> Vec<f32> {
    let mut g = vec![0.0f32; cols * cols];
    let xm = MatRef::from_row_major_slice(&x[..n * cols], n, cols);
    faer::linalg::matmul::matmul(
        MatMut::from_row_major_slice_mut(&mut g, cols, cols),
        Accum::Replace,
        xm.transpose(),
        xm,
        1.0 / n as f32,
        Par::rayon(0),
    );
    g
}

/// Mean over sample tokens of `‖(W − Ŵ) x‖²` = `Σ_r Δ_r G Δ_rᵀ` for `W`, `Ŵ` `[rows, cols]`
/// and the Gram matrix `G` of [`gram`].
pub fn output_error(g: &[f32], w: &[f32], w_hat: &[f32], rows: usize, cols: usize) -> f64 {
    let delta: Vec<f32> = w.iter().zip(w_hat).map(|(a, b)| a - b).collect();
    let mut p = vec![0.0f32; rows * cols];
    faer::linalg::matmul::matmul(
        MatMut::from_row_major_slice_mut(&mut p, rows, cols),
        Accum::Replace,
        MatRef::from_row_major_slice(&delta, rows, cols),
        MatRef::from_row_major_slice(g, cols, cols),
        1.0f32,
        Par::rayon(0),
    );
    p.iter().zip(&delta).map(|(&a, &b)| (a * b) as f64).sum()
}

/// `W·diag(s)`: column j multiplied by `s_j`.
pub fn scale_columns(w: &[f32], cols: usize, s: &[f32]) -> Vec<f32> {
    let mut out = w.to_vec();
    for row in out.chunks_exact_mut(cols) {
        for (v, &sj) in row.iter_mut().zip(s) {
            *v *= sj;
        }
    }
    out
}

/// In place `W·diag(s)⁻¹`: column j divided by `s_j`.
pub fn unscale_columns(w: &mut [f32], cols: usize, s: &[f32]) {
    for row in w.chunks_exact_mut(cols) {
        for (v, &sj) in row.iter_mut().zip(s) {
            *v /= sj;
        }
    }
}

/// Folds AWQ scales into the preceding RMSNorm: `norm_weight[j] /= s[j]`.
pub fn fold_into_norm(norm_weight: &mut [f32], s: &[f32]) {
    for (w, &sj) in norm_weight.iter_mut().zip(s) {
        *w /= sj;
    }
}

/// Folds AWQ scales into the preceding linear's output rows: row `i` of `weight`
/// (`[s.len(), cols]`) divided by `s[i]` (o ← v_proj without GQA, down ← up_proj).
pub fn fold_into_rows(weight: &mut [f32], cols: usize, s: &[f32]) {
    for (row, &si) in weight.chunks_exact_mut(cols).zip(s) {
        for v in row {
            *v /= si;
        }
    }
}

impl super::ResidentQuantizer for Awq {
    fn name(&self) -> String {
        format!("awq{}-g{}", self.bits, self.group_size)
    }

    fn needs_calibration(&self) -> bool {
        true
    }

    /// For the q/k/v set the weights must come in that order: llm-awq skips the clip search
    /// for q and k (their errors are amplified by the softmax, not measured by the output
    /// MSE). Without foldable scales (o under GQA) only the clip search runs.
    fn quantize_set(
        &self,
        weights: &[WeightView<'_>],
        stats: Option<&super::InputStats>,
        context: super::SetContext,
    ) -> Result<super::QuantizedSet, QuantError> {
        let name = weights.first().map_or("awq", |w| w.name);
        let stats = stats.ok_or_else(|| QuantError::MissingStats {
            name: name.to_string(),
            method: "awq",
            what: "input Gram matrix and mean |x| per channel",
        })?;
        let clip: Vec<bool> = (0..weights.len())
            .map(|i| !(context.set == sfx_runtime::ProjectionSet::Qkv && i < 2))
            .collect();
        let search = if context.scales_foldable {
            *self
        } else {
            // α grid {0}: s = 1, i.e. RTN plus the clip search.
            Awq {
                alpha_steps: 1,
                ..*self
            }
        };
        let set = search.quantize_set_from_stats(weights, &stats.gram, &stats.abs_mean, &clip)?;
        let info = [
            ("alpha", (set.alpha as f64 * 1e6).round() / 1e6),
            ("objective", set.error),
            ("objective_rtn", set.rtn_error),
            ("objective_scaled", set.scaled_error),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        Ok(super::QuantizedSet {
            weights: set
                .weights
                .into_iter()
                .map(super::ResidentWeight::Group)
                .collect(),
            input_scales: context.scales_foldable.then_some(set.scales),
            info,
        })
    }
}

//! SqueezeLLM (Kim et al. 2024), dense part, written from the paper: each output row gets its
//! own `2^b`-entry codebook, the centroids of a k-means over the row's weights in which weight
//! `w_ij` counts with its sensitivity `F_ij`, the diagonal of the empirical Fisher information
//! (the squared gradients of the loss on calibration text, summed over sequences; computed by
//! [`crate::yaqa::fisher_diagonal`]). The objective per row is `Σ_j F_ij (w_ij − c(q_ij))²`,
//! a second-order estimate of the loss increase when the Hessian is replaced by its Fisher
//! diagonal.
//!
//! In one dimension the weighted k-means is solved exactly ([`fit_row`]: dynamic programming
//! over contiguous runs of the sorted row) instead of by SqueezeLLM's Lloyd iterations. The
//! centroids are then snapped to the row's signed 8-bit grid (`LutQuantized`: one f16 scale a row) and every weight takes its nearest snapped level
//! (for fixed levels that minimises each weighted term on its own).
//!
//! Not implemented: SqueezeLLM's sparse outlier part (the dense-and-sparse decomposition).

use super::{InputStats, LutQuantized};
use super::{QuantError, QuantizedSet, ResidentQuantizer, ResidentWeight, SetContext, WeightView};
use half::f16;
use rayon::prelude::*;
use sfx_formats::resident::{f16_round_up, put_code};
use std::collections::BTreeMap;

/// SqueezeLLM's dense non-uniform quantizer at `bits` (2, 3 or 4) per weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SqueezeLlm {
    pub bits: u8,
}

impl ResidentQuantizer for SqueezeLlm {
    fn name(&self) -> String {
        format!("sqllm{}", self.bits)
    }
    fn quantize_set(
        &self,
        weights: &[WeightView<'_>],
        _stats: Option<&InputStats>,
        _context: SetContext,
    ) -> Result<QuantizedSet, QuantError> {
        let quantized = weights
            .iter()
            .map(|w| {
                let fisher = w.fisher.ok_or_else(|| QuantError::MissingStats {
                    name: w.name.to_string(),
                    method: "sqllm",
                    what: "the Fisher diagonal of the loss on calibration text",
                })?;
                quantize_rows(w, fisher, self.bits).map(ResidentWeight::Lut)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(QuantizedSet {
            weights: quantized,
            input_scales: None,
            info: BTreeMap::new(),
        })
    }
}

fn layout_err(name: &str, e: sfx_formats::resident::ResidentError) -> QuantError {
    QuantError::Layout {
        name: name.to_string(),
        source: e,
    }
}

/// Every row of `w` through [`fit_row`] and the snap to its 8-bit grid.
pub(super) fn quantize_rows(
    w: &WeightView<'_>,
    fisher: &[f32],
    bits: u8,
) -> Result<LutQuantized, QuantError> {
    let (rows, cols) = (w.rows, w.cols);
    let (code_bytes, _) =
        LutQuantized::sizes(bits, rows, cols).map_err(|e| layout_err(w.name, e))?;
    if w.data.len() != rows * cols || fisher.len() != rows * cols {
        return Err(layout_err(
            w.name,
            sfx_formats::resident::ResidentError::Invalid(format!(
                "{} weights and {} Fisher values for {rows} × {cols}",
                w.data.len(),
                fisher.len()
            )),
        ));
    }
    if let Some(i) = w.data.iter().position(|v| !v.is_finite()) {
        return Err(layout_err(
            w.name,
            sfx_formats::resident::ResidentError::Invalid(format!(
                "weight [{}, {}] is {}",
                i / cols,
                i % cols,
                w.data[i]
            )),
        ));
    }
    let rb = code_bytes / rows;
    let k = 1usize << bits;
    let mut codes = vec![0u8; code_bytes];
    let mut tables = vec![0i8; rows * k];
    let mut scales = vec![f16::ZERO; rows];
    codes
        .par_chunks_mut(rb)
        .zip(tables.par_chunks_mut(k))
        .zip(scales.par_iter_mut())
        .enumerate()
        .for_each(|(r, ((code_row, table), scale))| {
            let values = &w.data[r * cols..(r + 1) * cols];
            let centroids = fit_row(values, &fisher[r * cols..(r + 1) * cols], k);
            let (s, levels) = snap(&centroids);
            *scale = s;
            table.copy_from_slice(&levels);
            let sf = s.to_f32();
            let level_values: Vec<f32> = levels.iter().map(|&l| f32::from(l) * sf).collect();
            for (i, &v) in values.iter().enumerate() {
                put_code(code_row, i, bits, nearest(&level_values, v) as u8);
            }
        });
    LutQuantized::from_parts(bits, rows, cols, codes, tables, scales)
        .map_err(|e| layout_err(w.name, e))
}

/// Index of the value in `levels` nearest to `v` (the lower index on a tie).
pub(super) fn nearest(levels: &[f32], v: f32) -> usize {
    let mut best = (0, f32::INFINITY);
    for (j, &l) in levels.iter().enumerate() {
        let d = (l - v).abs();
        if d < best.1 {
            best = (j, d);
        }
    }
    best.0
}

/// Centroids snapped to one row's grid: `scale = max|c| / 127` rounded up to an f16 (so no
/// level leaves −127..=127), levels `round(c / scale)`.
pub(super) fn snap(centroids: &[f64]) -> (f16, Vec<i8>) {
    let max = centroids.iter().fold(0.0f64, |m, c| m.max(c.abs()));
    if max == 0.0 {
        return (f16::ZERO, vec![0; centroids.len()]);
    }
    let scale = f16_round_up((max / 127.0) as f32);
    let s = f64::from(scale.to_f32());
    let levels = centroids
        .iter()
        .map(|&c| (c / s).round().clamp(-127.0, 127.0) as i8)
        .collect();
    (scale, levels)
}

/// The weighted k-means of one row, solved exactly: `k` centroids (ascending) minimising
/// `Σ_i f_i (v_i − c(v_i))²`. Weights that are all zero (a row no calibration token's gradient
/// reached) count every value equally; otherwise a weight never drops below a millionth of
/// the row's mean, so a run of insensitive weights still gets a centroid inside it.
///
/// In one dimension an optimal clustering is a partition of the sorted row into `k`
/// contiguous runs, found by dynamic programming over (runs, prefix length). The within-run
/// cost obeys the quadrangle inequality, so the best split point is monotone in the prefix
/// length and each of the `k` layers is solved by divide and conquer in `O(n log n)`
/// (Grønlund et al. 2017, "Fast exact k-means, k-medians and Bregman divergence clustering
/// in 1D"); every run cost is O(1) from prefix sums. Lloyd's iterations, SqueezeLLM's
/// choice, stop in local optima: with Fisher weights spread over orders of magnitude a few
/// heavy weights pull several starting centroids onto one value.
pub fn fit_row(values: &[f32], fisher: &[f32], k: usize) -> Vec<f64> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[a].total_cmp(&values[b]).then(a.cmp(&b)));
    let v: Vec<f64> = order.iter().map(|&i| f64::from(values[i])).collect();
    let n = v.len();
    let all_zero = !fisher.iter().any(|&f| f > 0.0);
    let mean = fisher.iter().map(|&f| f64::from(f.max(0.0))).sum::<f64>() / n.max(1) as f64;
    let f: Vec<f64> = order
        .iter()
        .map(|&i| {
            if all_zero {
                1.0
            } else {
                f64::from(fisher[i]).max(1e-6 * mean)
            }
        })
        .collect();
    if n <= k {
        // As many levels as values: each value its own centroid, the rest repeat the last.
        let mut c = v.clone();
        c.resize(k, v.last().copied().unwrap_or(0.0));
        return c;
    }
    let sums = PrefixSums::new(&v, &f);
    // best[i]: the least cost of the first i sorted values in the current number of runs;
    // split[j][i]: where the last of j + 1 runs starts in that optimum.
    let mut best: Vec<f64> = (0..=n).map(|i| sums.run_cost(0, i)).collect();
    let mut split = vec![vec![0usize; n + 1]; k];
    for layer in split.iter_mut().skip(1) {
        let mut next = vec![f64::INFINITY; n + 1];
        solve_layer(&sums, &best, &mut next, layer, (1, n), (0, n - 1));
        best = next;
    }
    // Walk the splits back from the whole row.
    let mut bounds = vec![n; k + 1];
    for j in (0..k).rev() {
        bounds[j] = if j == 0 { 0 } else { split[j][bounds[j + 1]] };
    }
    (0..k)
        .map(|j| sums.centroid(&v, bounds[j], bounds[j + 1]))
        .collect()
}

/// One dynamic-programming layer for prefix lengths `lo..=hi`, whose best last-run starts lie
/// in `from..=to`: `next[i] = min_{m < i} prev[m] + cost(m, i)`.
fn solve_layer(
    sums: &PrefixSums,
    prev: &[f64],
    next: &mut [f64],
    split: &mut [usize],
    (lo, hi): (usize, usize),
    (from, to): (usize, usize),
) {
    if lo > hi {
        return;
    }
    let mid = (lo + hi) / 2;
    let (mut best, mut arg) = (f64::INFINITY, from);
    let last = to.min(mid - 1);
    for (m, &before) in prev.iter().enumerate().take(last + 1).skip(from) {
        let c = before + sums.run_cost(m, mid);
        if c < best {
            (best, arg) = (c, m);
        }
    }
    next[mid] = best;
    split[mid] = arg;
    if mid > lo {
        solve_layer(sums, prev, next, split, (lo, mid - 1), (from, arg));
    }
    solve_layer(sums, prev, next, split, (mid + 1, hi), (arg, to));
}

/// Prefix sums of `f`, `f·v` and `f·v²` over the sorted row.
struct PrefixSums {
    w: Vec<f64>,
    wv: Vec<f64>,
    wv2: Vec<f64>,
}

impl PrefixSums {
    fn new(v: &[f64], f: &[f64]) -> Self {
        let (mut w, mut wv, mut wv2) = (vec![0.0], vec![0.0], vec![0.0]);
        for (&vi, &fi) in v.iter().zip(f) {
            w.push(w[w.len() - 1] + fi);
            wv.push(wv[wv.len() - 1] + fi * vi);
            wv2.push(wv2[wv2.len() - 1] + fi * vi * vi);
        }
        Self { w, wv, wv2 }
    }

    /// `Σ f (v − mean)²` over sorted positions `a..b`, the run's weighted mean its centroid.
    fn run_cost(&self, a: usize, b: usize) -> f64 {
        let w = self.w[b] - self.w[a];
        if w <= 0.0 {
            return 0.0;
        }
        let wv = self.wv[b] - self.wv[a];
        (self.wv2[b] - self.wv2[a] - wv * wv / w).max(0.0)
    }

    /// The weighted mean of sorted positions `a..b` (an empty run: the value at `a`).
    fn centroid(&self, v: &[f64], a: usize, b: usize) -> f64 {
        let w = self.w[b] - self.w[a];
        if b <= a || w <= 0.0 {
            return v[a.min(v.len() - 1)];
        }
        (self.wv[b] - self.wv[a]) / w
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// The optimal weighted 1-D k-means cost by dynamic programming over contiguous runs of
    /// the sorted values (an optimal clustering in one dimension is contiguous), O(k·n²).
    fn optimal_cost(values: &[f32], fisher: &[f32], k: usize) -> f64 {
        let mut order: Vec<usize> = (0..values.len()).collect();
        order.sort_by(|&a, &b| values[a].total_cmp(&values[b]));
        let v: Vec<f64> = order.iter().map(|&i| f64::from(values[i])).collect();
        let f: Vec<f64> = order.iter().map(|&i| f64::from(fisher[i])).collect();
        let n = v.len();
        let run = |a: usize, b: usize| {
            let w: f64 = f[a..b].iter().sum();
            if w == 0.0 {
                return 0.0;
            }
            let m = (a..b).map(|i| f[i] * v[i]).sum::<f64>() / w;
            (a..b).map(|i| f[i] * (v[i] - m).powi(2)).sum::<f64>()
        };
        let mut best = vec![f64::INFINITY; n + 1];
        best[0] = 0.0;
        for _ in 0..k {
            let mut next = vec![f64::INFINITY; n + 1];
            next[0] = 0.0;
            for b in 1..=n {
                for (a, &before) in best.iter().enumerate().take(b) {
                    next[b] = next[b].min(before + run(a, b));
                }
                next[b] = next[b].min(best[b]);
            }
            best = next;
        }
        best[n]
    }

    fn cost_of(values: &[f32], fisher: &[f32], c: &[f64]) -> f64 {
        values
            .iter()
            .zip(fisher)
            .map(|(&v, &f)| {
                let d = c
                    .iter()
                    .map(|&c| (f64::from(v) - c).abs())
                    .fold(f64::INFINITY, f64::min);
                f64::from(f) * d * d
            })
            .sum()
    }

    /// Against the exact optimum by the plain O(k·n²) dynamic program (no monotone-split
    /// shortcut) on small rows: heavy-tailed values, Fisher weights spread over three orders
    /// of magnitude, fewer values than levels included.
    #[test]
    fn weighted_kmeans_is_the_exact_optimum() {
        let mut seed = 11u64;
        for case in 0..40 {
            let n = 3 + case % 38;
            let values: Vec<f32> = (0..n).map(|_| lcg(&mut seed).powi(3) * 4.0).collect();
            let fisher: Vec<f32> = (0..n)
                .map(|_| 10f32.powf(3.0 * (lcg(&mut seed) + 1.0) / 2.0))
                .collect();
            for k in [2, 4, 8, 16] {
                let c = fit_row(&values, &fisher, k);
                let got = cost_of(&values, &fisher, &c);
                let opt = optimal_cost(&values, &fisher, k);
                assert!(
                    (got - opt).abs() <= 1e-9 * opt.max(1e-300) + 1e-15,
                    "case {case} n {n} k {k}: {got} vs optimum {opt}"
                );
                assert_eq!(c.len(), k);
                assert!(c.windows(2).all(|p| p[0] <= p[1]), "{c:?}");
            }
        }
    }

    /// The weights move the centroids: unweighted, three levels sit at the three clusters'
    /// means (0.15, 1.1, 5); a value with most of the row's Fisher mass pulls its cluster's
    /// level onto itself (0.1).
    #[test]
    fn a_sensitive_weight_pulls_its_level() {
        let values = [0.0, 0.1, 0.2, 0.3, 1.0, 1.1, 1.2, 5.0];
        let even = [1.0; 8];
        let c = fit_row(&values, &even, 2);
        assert!(
            (c[0] - 3.9 / 7.0).abs() < 1e-6 && (c[1] - 5.0).abs() < 1e-6,
            "{c:?}"
        );
        let mut heavy = [1.0; 8];
        heavy[1] = 1000.0;
        let c = fit_row(&values, &even, 3);
        assert!((c[0] - 0.15).abs() < 1e-6, "{c:?}");
        let c = fit_row(&values, &heavy, 3);
        assert!((c[0] - 0.1).abs() < 0.001, "{c:?}");
        // All-zero sensitivities fall back to equal weights.
        assert_eq!(fit_row(&values, &[0.0; 8], 2), fit_row(&values, &even, 2));
    }

    #[test]
    fn rows_snap_to_their_grid_and_take_the_nearest_level() {
        let mut seed = 3u64;
        let (rows, cols) = (6, 96);
        let data: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed) * 0.05).collect();
        let fisher: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed).abs()).collect();
        let w = WeightView {
            name: "t.weight",
            data: &data,
            rows,
            cols,
            kron: None,
            fisher: Some(&fisher),
            imatrix: None,
            guided: None,
        };
        for bits in sfx_formats::resident::LUT_BITS {
            let q = quantize_rows(&w, &fisher, bits).unwrap();
            let deq = q.dequantize();
            for r in 0..rows {
                let centroids = fit_row(
                    &data[r * cols..(r + 1) * cols],
                    &fisher[r * cols..(r + 1) * cols],
                    1 << bits,
                );
                let s = q.scales()[r].to_f32();
                let levels: Vec<f32> = q.tables()[r << bits..(r + 1) << bits]
                    .iter()
                    .map(|&l| f32::from(l) * s)
                    .collect();
                // The snap moves a centroid by at most half a grid step.
                for (c, l) in centroids.iter().zip(&levels) {
                    assert!(
                        (*c as f32 - l).abs() <= 0.5 * s + 1e-7,
                        "row {r}: {c} vs {l}"
                    );
                }
                for i in 0..cols {
                    let (v, got) = (data[r * cols + i], deq[r * cols + i]);
                    let best = levels
                        .iter()
                        .map(|l| (l - v).abs())
                        .fold(f32::INFINITY, f32::min);
                    assert!((got - v).abs() <= best + 1e-7, "row {r} col {i}");
                }
            }
        }
        let missing = SqueezeLlm { bits: 4 }
            .quantize_set(
                &[WeightView { fisher: None, ..w }],
                None,
                SetContext {
                    set: sfx_runtime::ProjectionSet::Qkv,
                    scales_foldable: true,
                },
            )
            .unwrap_err();
        assert!(missing.to_string().contains("Fisher"), "{missing}");
        let mut bad = data.clone();
        bad[100] = f32::NAN;
        let e = quantize_rows(&WeightView { data: &bad, ..w }, &fisher, 4).unwrap_err();
        assert!(e.to_string().contains("[1, 4]"), "{e}");
    }
}

//! LNQ, GuidedQuant's layer-wise non-uniform quantization (Kim et al. 2025), written from the
//! paper: the same per-row look-up tables as SqueezeLLM ([`super::sqllm`], the starting point),
//! refined against the layer's output error instead of a per-weight sensitivity.
//!
//! Row `w` of output group g (the channels are split into a few contiguous groups) minimises
//!
//! `(ŵ − w)ᵀ H (ŵ − w)`, `ŵ_j = c(q_j)`, `H = H_g / m(H_g) + a · P / m(P) + d · I`,
//!
//! with `H_g = Σ_t s_{t,g} x_t x_tᵀ` ([`GuidedHessian`]): the layer inputs' second moments over
//! the calibration text, each token weighted by the mean squared loss gradient at the group's
//! outputs (GuidedQuant's objective); `P = E[x xᵀ]` the same inputs unweighted; `m` a matrix's
//! mean diagonal. SqueezeLLM's objective is a diagonal one; LNQ keeps the cross terms, so a
//! weight's rounding error can be paid back by its correlated neighbours. The unweighted part
//! (`a` = [`PLAIN_WEIGHT`]) and the damping (`d` = [`DAMPING`] times the mean diagonal) are
//! ours: with a few thousand calibration tokens the saliency-weighted `H_g` alone is nearly
//! low-rank, and fitting it made the model worse than its SqueezeLLM start (docs/decisions.md,
//! "LNQ", has the measurements behind both numbers).
//!
//! Alternating minimisation, a few rounds of:
//! - **codes** (P-step): cyclic coordinate descent over the row's columns. With the others
//!   fixed, column j's best value is the table level nearest to
//!   `w_j − Σ_{k≠j} H_jk (ŵ_k − w_k) / H_jj`, which is exact for that coordinate, so the
//!   objective never rises. Rows share `H_g`, so a block of rows runs together: `Q = E·H`
//!   once a cycle, exact updates inside a block of 128 columns, one product per block for the
//!   columns after it (GPTQ's lazy batch updates).
//! - **table** (C-step): with the codes fixed, the levels are a least-squares problem in
//!   `2^b` unknowns per row, `(Aᵀ H A) c = Aᵀ H w` (A: the one-hot code matrix); levels no
//!   weight uses keep their value.
//!
//! The levels are then snapped to the row's signed 8-bit grid (the `lut-v1` format's f16 row
//! scale), which can raise the objective a little; every row therefore keeps the best state
//! any round reached, the SqueezeLLM start included, so LNQ is never worse than it on its own
//! objective.

use super::{sqllm, LutQuantized, QuantError, QuantizedSet, ResidentQuantizer, ResidentWeight};
use super::{InputStats, SetContext, WeightView};
use crate::yaqa::GuidedHessian;
use faer::{Accum, MatMut, MatRef, Par};
use half::f16;
use rayon::prelude::*;
use sfx_formats::resident::{get_code, lut::row_values, put_code};
use std::collections::BTreeMap;

/// Columns updated exactly before the rest of `E·H` is brought up to date with one product.
const BLOCK: usize = 128;
/// Rows refined together (one product per block serves them all; blocks run in parallel).
const ROWS: usize = 16;
/// Damping added to the objective's diagonal, relative to its mean: a column no calibration
/// token excites (`H_jj = 0`) still has a well-defined best level, and round-off cannot make
/// the objective indefinite.
pub const DAMPING: f32 = 0.3;
/// Weight of the unweighted input Hessian mixed into each group's (docs/decisions.md).
pub const PLAIN_WEIGHT: f32 = 1.0;

/// LNQ at `bits` (2, 3 or 4) per weight.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lnq {
    pub bits: u8,
    /// Rounds of codes + table (GuidedQuant's default: 3).
    pub rounds: usize,
    /// Coordinate-descent sweeps over the columns in each codes step (GuidedQuant: 4).
    pub sweeps: usize,
    /// [`PLAIN_WEIGHT`].
    pub plain_weight: f32,
    /// [`DAMPING`].
    pub damping: f32,
}

impl Lnq {
    pub fn new(bits: u8) -> Self {
        Self {
            bits,
            rounds: 3,
            sweeps: 4,
            plain_weight: setting("SFX_LNQ_PLAIN").unwrap_or(PLAIN_WEIGHT),
            damping: setting("SFX_LNQ_DAMP").unwrap_or(DAMPING),
        }
    }
}

/// A development override of a default (the settings screen in docs/decisions.md): a
/// finite non-negative number from the environment. A file records the values it was made
/// with (`params.lnq`).
fn setting(name: &str) -> Option<f32> {
    let v: f32 = std::env::var(name).ok()?.parse().ok()?;
    (v.is_finite() && v >= 0.0).then_some(v)
}

/// The objective of one weight before and after LNQ, summed over its rows.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Objective {
    start: f64,
    end: f64,
}

impl ResidentQuantizer for Lnq {
    fn name(&self) -> String {
        format!("lnq{}", self.bits)
    }
    /// The set's input moments are the objective's unweighted part, and the pass that
    /// gathers them forms the guided Hessians.
    fn needs_calibration(&self) -> bool {
        true
    }
    fn quantize_set(
        &self,
        weights: &[WeightView<'_>],
        stats: Option<&InputStats>,
        _context: SetContext,
    ) -> Result<QuantizedSet, QuantError> {
        let mut total = Objective::default();
        let mut quantized = Vec::with_capacity(weights.len());
        for w in weights {
            let fisher = w.fisher.ok_or_else(|| QuantError::MissingStats {
                name: w.name.to_string(),
                method: "lnq",
                what: "the Fisher diagonal of the loss on calibration text",
            })?;
            let guided = w.guided.ok_or_else(|| QuantError::MissingStats {
                name: w.name.to_string(),
                method: "lnq",
                what: "GuidedQuant's output-group Hessians from calibration text",
            })?;
            let plain = stats.ok_or_else(|| QuantError::MissingStats {
                name: w.name.to_string(),
                method: "lnq",
                what: "the input second moments E[x xᵀ] of the calibration text",
            })?;
            let start = sqllm::quantize_rows(w, fisher, self.bits)?;
            let (lut, objective) = self.refine(w, guided, &plain.gram, start)?;
            total.start += objective.start;
            total.end += objective.end;
            quantized.push(ResidentWeight::Lut(lut));
        }
        let mut info = BTreeMap::new();
        info.insert("objective_sqllm".into(), total.start);
        info.insert("objective_lnq".into(), total.end);
        Ok(QuantizedSet {
            weights: quantized,
            input_scales: None,
            info,
        })
    }
}

/// One block of rows of a weight that share `H_g`: their floats, codes and tables.
struct Rows<'a> {
    n: usize,
    cols: usize,
    levels: usize,
    w: &'a [f32],
    codes: Vec<u8>,
    tables: Vec<i8>,
    scales: Vec<f16>,
}

impl Lnq {
    /// LNQ from `start` (SqueezeLLM's tables and codes of `w`) with the weight's guided
    /// Hessians; returns the refined tables and the objective summed over rows before and after.
    fn refine(
        &self,
        w: &WeightView<'_>,
        guided: &GuidedHessian,
        plain: &[f32],
        start: LutQuantized,
    ) -> Result<(LutQuantized, Objective), QuantError> {
        let (rows, cols, bits) = (w.rows, w.cols, self.bits);
        let invalid = |msg: String| QuantError::Layout {
            name: w.name.to_string(),
            source: sfx_formats::resident::ResidentError::Invalid(msg),
        };
        if guided.cols != cols
            || guided.groups == 0
            || guided.groups > rows
            || guided.sums.len() != guided.groups * cols * cols
            || plain.len() != cols * cols
        {
            return Err(invalid(format!(
                "guided Hessians over {} inputs ({} groups, {} values) and {} input moments \
                 for {rows} × {cols}",
                guided.cols,
                guided.groups,
                guided.sums.len(),
                plain.len()
            )));
        }
        if let Some(i) = guided.sums.iter().chain(plain).position(|v| !v.is_finite()) {
            return Err(invalid(format!("Hessian value {i} is not finite")));
        }
        let levels = 1usize << bits;
        let row_bytes = start.row_bytes();
        // Row-unpacked codes (one byte a weight) while refining.
        let mut codes = vec![0u8; rows * cols];
        for (r, dst) in codes.chunks_exact_mut(cols).enumerate() {
            let src = &start.codes()[r * row_bytes..(r + 1) * row_bytes];
            for (j, c) in dst.iter_mut().enumerate() {
                *c = get_code(src, j, bits);
            }
        }
        let mut tables = start.tables().to_vec();
        let mut scales = start.scales().to_vec();
        let mut objective = Objective::default();
        for g in 0..guided.groups {
            let range = crate::yaqa::group_rows(rows, guided.groups, g);
            let h = objective_hessian(guided.block(g), plain, cols, self);
            let blocks: Vec<Objective> = codes[range.start * cols..range.end * cols]
                .par_chunks_mut(ROWS * cols)
                .zip(tables[range.start * levels..range.end * levels].par_chunks_mut(ROWS * levels))
                .zip(scales[range.clone()].par_chunks_mut(ROWS))
                .enumerate()
                .map(|(b, ((codes, tables), scales))| {
                    let first = range.start + b * ROWS;
                    let n = scales.len();
                    let mut block = Rows {
                        n,
                        cols,
                        levels,
                        w: &w.data[first * cols..(first + n) * cols],
                        codes: codes.to_vec(),
                        tables: tables.to_vec(),
                        scales: scales.to_vec(),
                    };
                    let objective = block.refine(&h, self.rounds, self.sweeps);
                    codes.copy_from_slice(&block.codes);
                    tables.copy_from_slice(&block.tables);
                    scales.copy_from_slice(&block.scales);
                    objective
                })
                .collect();
            for o in blocks {
                objective.start += o.start;
                objective.end += o.end;
            }
        }
        let mut packed = vec![0u8; rows * row_bytes];
        for (dst, src) in packed
            .chunks_exact_mut(row_bytes)
            .zip(codes.chunks_exact(cols))
        {
            for (j, &c) in src.iter().enumerate() {
                put_code(dst, j, bits, c);
            }
        }
        let lut = LutQuantized::from_parts(bits, rows, cols, packed, tables, scales).map_err(
            |source| QuantError::Layout {
                name: w.name.to_string(),
                source,
            },
        )?;
        Ok((lut, objective))
    }
}

/// Group g's objective: `H_g / m(H_g) + a · P / m(P) + d · I` with `m` the mean of a matrix's
/// diagonal, `P = Σ_t x_t x_tᵀ`, `a` = `plain_weight` and `d` = `damping` times the mixed
/// matrix's mean diagonal. A matrix that is all zero drops out of the mix (the identity is
/// left when both are: every column then counts alike, as SqueezeLLM's rows without gradient).
fn objective_hessian(h: &[f32], plain: &[f32], cols: usize, lnq: &Lnq) -> Vec<f32> {
    let mean_diag = |m: &[f32]| super::mean_diagonal(m, cols);
    let inverse = |m: f64| if m > 0.0 { 1.0 / m } else { 0.0 };
    let a = inverse(mean_diag(h));
    let b = f64::from(lnq.plain_weight) * inverse(mean_diag(plain));
    let (a, b) = (a as f32, b as f32);
    let mut mixed: Vec<f32> = h.iter().zip(plain).map(|(&x, &y)| a * x + b * y).collect();
    let mean = mean_diag(&mixed);
    let add = if mean > 0.0 {
        (f64::from(lnq.damping) * mean) as f32
    } else {
        1.0
    };
    for j in 0..cols {
        mixed[j * cols + j] += add;
    }
    mixed
}

impl Rows<'_> {
    /// Each row's level values (level × scale), `levels` a row.
    fn values(&self) -> Vec<f32> {
        let k = self.levels;
        self.tables
            .chunks_exact(k)
            .zip(&self.scales)
            .flat_map(|(t, &s)| row_values(t, s)[..k].to_vec())
            .collect()
    }

    /// `E = Ŵ − W`, row-major `n × cols`.
    fn error(&self, values: &[f32]) -> Vec<f32> {
        let (k, cols) = (self.levels, self.cols);
        let mut e = vec![0.0f32; self.n * cols];
        for r in 0..self.n {
            for j in 0..cols {
                let i = r * cols + j;
                e[i] = values[r * k + usize::from(self.codes[i])] - self.w[i];
            }
        }
        e
    }

    /// Each row's `eᵀ H e`.
    fn objectives(&self, e: &[f32], h: &[f32]) -> Vec<f64> {
        let q = times_h(e, h, self.n, self.cols);
        q.chunks_exact(self.cols)
            .zip(e.chunks_exact(self.cols))
            .map(|(q, e)| q.iter().zip(e).map(|(&a, &b)| f64::from(a * b)).sum())
            .collect()
    }

    /// The alternating rounds; each row ends in the best state it reached.
    fn refine(&mut self, h: &[f32], rounds: usize, sweeps: usize) -> Objective {
        let (n, cols, k) = (self.n, self.cols, self.levels);
        let mut values = self.values();
        let mut e = self.error(&values);
        let first = self.objectives(&e, h);
        let mut best = first.clone();
        let mut best_state = (self.codes.clone(), self.tables.clone(), self.scales.clone());
        let mut keep_best = |rows: &Self, objective: &[f64]| {
            for r in 0..n {
                if objective[r] < best[r] {
                    best[r] = objective[r];
                    best_state.0[r * cols..(r + 1) * cols]
                        .copy_from_slice(&rows.codes[r * cols..(r + 1) * cols]);
                    best_state.1[r * k..(r + 1) * k]
                        .copy_from_slice(&rows.tables[r * k..(r + 1) * k]);
                    best_state.2[r] = rows.scales[r];
                }
            }
        };
        for _ in 0..rounds {
            for _ in 0..sweeps {
                self.sweep(h, &values, &mut e);
            }
            keep_best(self, &self.objectives(&e, h));
            self.fit_tables(h);
            values = self.values();
            e = self.error(&values);
            keep_best(self, &self.objectives(&e, h));
        }
        (self.codes, self.tables, self.scales) = best_state;
        Objective {
            start: first.iter().sum(),
            end: best.iter().sum(),
        }
    }

    /// One cyclic coordinate-descent sweep of the codes over every column (module docs).
    fn sweep(&mut self, h: &[f32], values: &[f32], e: &mut [f32]) {
        let (n, cols, k) = (self.n, self.cols, self.levels);
        let mut q = times_h(e, h, n, cols);
        for b0 in (0..cols).step_by(BLOCK) {
            let b1 = (b0 + BLOCK).min(cols);
            let width = b1 - b0;
            let mut change = vec![0.0f32; n * width];
            for j in b0..b1 {
                let h_row = &h[j * cols..(j + 1) * cols];
                let hjj = h_row[j];
                for r in 0..n {
                    let i = r * cols + j;
                    let target = self.w[i] - (q[i] - e[i] * hjj) / hjj;
                    let row_values = &values[r * k..(r + 1) * k];
                    let code = sqllm::nearest(row_values, target);
                    let delta = row_values[code] - (self.w[i] + e[i]);
                    if code as u8 != self.codes[i] && delta != 0.0 {
                        self.codes[i] = code as u8;
                        e[i] += delta;
                        change[r * width + (j - b0)] += delta;
                        for (qv, &hv) in q[r * cols + b0..r * cols + b1]
                            .iter_mut()
                            .zip(&h_row[b0..b1])
                        {
                            *qv += delta * hv;
                        }
                    }
                }
            }
            if b1 < cols {
                faer::linalg::matmul::matmul(
                    MatMut::from_row_major_slice_mut(&mut q, n, cols).subcols_mut(b1, cols - b1),
                    Accum::Add,
                    MatRef::from_row_major_slice(&change, n, width),
                    MatRef::from_row_major_slice(h, cols, cols).submatrix(b0, b1, width, cols - b1),
                    1.0f32,
                    Par::Seq,
                );
            }
        }
    }

    /// The C-step: each row's levels by least squares with its codes fixed, then snapped to
    /// the row's 8-bit grid.
    fn fit_tables(&mut self, h: &[f32]) {
        let k = self.levels;
        for r in 0..self.n {
            let centroids = self.least_squares_levels(r, h);
            let (scale, levels) = sqllm::snap(&centroids);
            self.scales[r] = scale;
            self.tables[r * k..(r + 1) * k].copy_from_slice(&levels);
        }
    }

    /// Row `r`'s levels minimising its objective for its current codes, `(Aᵀ H A) c = Aᵀ H w`;
    /// levels no weight uses (or all of them, if the system is singular) keep their values.
    fn least_squares_levels(&self, r: usize, h: &[f32]) -> Vec<f64> {
        let (cols, k) = (self.cols, self.levels);
        let codes = &self.codes[r * cols..(r + 1) * cols];
        let w = &self.w[r * cols..(r + 1) * cols];
        // s[a] = Σ_{j: code j = a} H[j, :], so (Aᵀ H A)[a][b] = Σ_{i: code i = b} s[a][i] and
        // (Aᵀ H w)[a] = s[a] · w.
        let mut s = vec![0.0f32; k * cols];
        let mut count = vec![0usize; k];
        for (j, &c) in codes.iter().enumerate() {
            let c = usize::from(c);
            count[c] += 1;
            for (a, &b) in s[c * cols..(c + 1) * cols]
                .iter_mut()
                .zip(&h[j * cols..(j + 1) * cols])
            {
                *a += b;
            }
        }
        let mut m = vec![0.0f64; k * k];
        let mut rhs = vec![0.0f64; k];
        for a in 0..k {
            let sa = &s[a * cols..(a + 1) * cols];
            for (i, &c) in codes.iter().enumerate() {
                m[a * k + usize::from(c)] += f64::from(sa[i]);
            }
            rhs[a] = sa
                .iter()
                .zip(w)
                .map(|(&x, &y)| f64::from(x) * f64::from(y))
                .sum();
        }
        let used: Vec<usize> = (0..k).filter(|&a| count[a] > 0).collect();
        let old = row_values(&self.tables[r * k..(r + 1) * k], self.scales[r]);
        let mut centroids: Vec<f64> = old[..k].iter().map(|&v| f64::from(v)).collect();
        if let Some(solved) = solve(&m, &rhs, k, &used) {
            for (&a, v) in used.iter().zip(solved) {
                centroids[a] = v;
            }
        }
        centroids
    }
}

/// `E·H` for `n` rows.
fn times_h(e: &[f32], h: &[f32], n: usize, cols: usize) -> Vec<f32> {
    let mut q = vec![0.0f32; n * cols];
    faer::linalg::matmul::matmul(
        MatMut::from_row_major_slice_mut(&mut q, n, cols),
        Accum::Replace,
        MatRef::from_row_major_slice(e, n, cols),
        MatRef::from_row_major_slice(h, cols, cols),
        1.0f32,
        Par::Seq,
    );
    q
}

/// The `used` rows and columns of the `k × k` system `m c = rhs`, by Gaussian elimination with
/// partial pivoting; `None` when it is singular to working precision (the row then keeps its
/// levels).
fn solve(m: &[f64], rhs: &[f64], k: usize, used: &[usize]) -> Option<Vec<f64>> {
    let u = used.len();
    if u == 0 {
        return None;
    }
    let mut a: Vec<Vec<f64>> = used
        .iter()
        .map(|&i| {
            let mut row: Vec<f64> = used.iter().map(|&j| m[i * k + j]).collect();
            row.push(rhs[i]);
            row
        })
        .collect();
    let scale = (0..u).map(|i| a[i][i].abs()).fold(0.0f64, f64::max);
    if scale == 0.0 || !scale.is_finite() {
        return None;
    }
    for col in 0..u {
        let pivot = (col..u).max_by(|&x, &y| a[x][col].abs().total_cmp(&a[y][col].abs()))?;
        if a[pivot][col].abs() <= 1e-12 * scale {
            return None;
        }
        a.swap(col, pivot);
        let (top, below) = a.split_at_mut(col + 1);
        let pivot_row = &top[col];
        for row in below.iter_mut() {
            let f = row[col] / pivot_row[col];
            if f != 0.0 {
                for (v, &p) in row[col..].iter_mut().zip(&pivot_row[col..]) {
                    *v -= f * p;
                }
            }
        }
    }
    let mut x = vec![0.0f64; u];
    for row in (0..u).rev() {
        let tail: f64 = (row + 1..u).map(|c| a[row][c] * x[c]).sum();
        x[row] = (a[row][u] - tail) / a[row][row];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row's objective `(ŵ − w)ᵀ H (ŵ − w)` in f64, written out term by term.
    fn objective(w: &[f32], what: &[f32], h: &[f32]) -> f64 {
        let n = w.len();
        let e: Vec<f64> = what
            .iter()
            .zip(w)
            .map(|(&a, &b)| f64::from(a - b))
            .collect();
        (0..n)
            .flat_map(|i| (0..n).map(move |j| (i, j)))
            .map(|(i, j)| e[i] * f64::from(h[i * n + j]) * e[j])
            .sum()
    }

    #[test]
    fn the_objective_mixes_unit_diagonal_hessians_and_damps_them() {
        let h = [4.0, 1.0, 1.0, 2.0]; // mean diagonal 3
        let p = [1.0, 0.5, 0.5, 3.0]; // mean diagonal 2
        let lnq = Lnq {
            plain_weight: 0.5,
            damping: 0.1,
            ..Lnq::new(3)
        };
        let got = objective_hessian(&h, &p, 2, &lnq);
        // h/3 + 0.5·p/2 has mean diagonal 1.5; the damping adds 0.1 · 1.5.
        let want = [
            4.0 / 3.0 + 0.25 + 0.15,
            1.0 / 3.0 + 0.125,
            1.0 / 3.0 + 0.125,
            2.0 / 3.0 + 0.75 + 0.15,
        ];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{got:?} vs {want:?}");
        }
        // Nothing accumulated: every column alike.
        assert_eq!(
            objective_hessian(&[0.0; 4], &[0.0; 4], 2, &lnq),
            [1.0, 0.0, 0.0, 1.0]
        );
    }

    #[test]
    fn solve_matches_a_known_system_and_skips_unused_levels() {
        // 2x + y = 5, x + 3y = 10 → (1, 3); level 1 unused.
        let m = [2.0, 0.0, 1.0, 0.0, 7.0, 0.0, 1.0, 0.0, 3.0];
        let rhs = [5.0, 9.0, 10.0];
        let x = solve(&m, &rhs, 3, &[0, 2]).expect("regular");
        assert!(
            (x[0] - 1.0).abs() < 1e-12 && (x[1] - 3.0).abs() < 1e-12,
            "{x:?}"
        );
        assert!(solve(&[0.0; 4], &[1.0, 1.0], 2, &[0, 1]).is_none());
    }

    #[test]
    fn each_step_lowers_the_objective_it_optimises_and_lnq_beats_its_start() {
        // Strongly correlated inputs: H = B Bᵀ with a shared component, where a diagonal
        // sensitivity (SqueezeLLM) cannot see what one weight's error does to the others.
        let (n, cols, bits) = (3usize, 40usize, 2u8);
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        };
        let basis: Vec<f32> = (0..cols * 8).map(|_| next()).collect();
        let mut h = vec![0.0f32; cols * cols];
        for i in 0..cols {
            for j in 0..cols {
                let shared = 0.8;
                let own: f32 = (0..8).map(|t| basis[i * 8 + t] * basis[j * 8 + t]).sum();
                h[i * cols + j] = own + shared;
            }
        }
        let w: Vec<f32> = (0..n * cols).map(|_| next()).collect();
        let fisher: Vec<f32> = (0..n * cols).map(|i| h[(i % cols) * (cols + 1)]).collect();
        let view = WeightView {
            name: "test.weight",
            data: &w,
            rows: n,
            cols,
            kron: None,
            fisher: Some(&fisher),
            imatrix: None,
            guided: None,
        };
        let start = sqllm::quantize_rows(&view, &fisher, bits).expect("sqllm");
        let mut guided = GuidedHessian::zeros(cols, 1);
        guided.sums.copy_from_slice(&h);
        let lnq = Lnq::new(bits);
        let (lut, reported) = lnq
            .refine(&view, &guided, &vec![0.0; cols * cols], start.clone())
            .expect("lnq");

        // The reported objectives are those of H / mean diag(H) + DAMPING · I (no plain part
        // was accumulated), rebuilt here by hand.
        let mean = (0..cols).map(|j| h[j * cols + j]).sum::<f32>() / cols as f32;
        let hd: Vec<f32> = (0..cols * cols)
            .map(|i| h[i] / mean + if i % (cols + 1) == 0 { DAMPING } else { 0.0 })
            .collect();
        let score = |q: &LutQuantized| -> f64 {
            let what = q.dequantize();
            (0..n)
                .map(|r| {
                    objective(
                        &w[r * cols..(r + 1) * cols],
                        &what[r * cols..(r + 1) * cols],
                        &hd,
                    )
                })
                .sum()
        };
        let (before, after) = (score(&start), score(&lut));
        assert!(
            (before - reported.start).abs() <= 1e-4 * before,
            "{before} vs {reported:?}"
        );
        assert!(
            (after - reported.end).abs() <= 1e-4 * before,
            "{after} vs {reported:?}"
        );
        assert!(after < 0.8 * before, "LNQ {after} vs SqueezeLLM {before}");

        // One sweep of the codes alone never raises the objective, and after it no single
        // weight can move to another level of its row and lower it (a coordinate-wise minimum
        // up to the sweep order, checked exhaustively at the end of a converged run).
        let mut rows = Rows {
            n,
            cols,
            levels: 1 << bits,
            w: &w,
            codes: (0..n * cols)
                .map(|i| {
                    get_code(
                        &start.codes()[(i / cols) * start.row_bytes()..],
                        i % cols,
                        bits,
                    )
                })
                .collect(),
            tables: start.tables().to_vec(),
            scales: start.scales().to_vec(),
        };
        let values = rows.values();
        let mut e = rows.error(&values);
        let mut last = rows.objectives(&e, &hd).iter().sum::<f64>();
        for _ in 0..20 {
            rows.sweep(&hd, &values, &mut e);
            let now = rows.objectives(&e, &hd).iter().sum::<f64>();
            assert!(now <= last * (1.0 + 1e-5), "sweep raised {last} → {now}");
            last = now;
        }
        let k = 1usize << bits;
        for r in 0..n {
            let what: Vec<f32> = (0..cols)
                .map(|j| values[r * k + usize::from(rows.codes[r * cols + j])])
                .collect();
            let row_w = &w[r * cols..(r + 1) * cols];
            let base = objective(row_w, &what, &hd);
            for j in 0..cols {
                for level in 0..k {
                    let mut moved = what.clone();
                    moved[j] = values[r * k + level];
                    assert!(
                        objective(row_w, &moved, &hd) >= base * (1.0 - 1e-4),
                        "row {r} column {j} level {level} lowers the objective"
                    );
                }
            }
        }

        // The table step: at the least-squares levels the objective's gradient with respect to
        // each used level, 2 Σ_{j: code j = a} (H e)_j, vanishes (in f64, from the definition).
        for r in 0..n {
            let c = rows.least_squares_levels(r, &hd);
            let codes = &rows.codes[r * cols..(r + 1) * cols];
            let e: Vec<f64> = (0..cols)
                .map(|j| c[usize::from(codes[j])] - f64::from(w[r * cols + j]))
                .collect();
            let he: Vec<f64> = (0..cols)
                .map(|i| (0..cols).map(|j| f64::from(hd[i * cols + j]) * e[j]).sum())
                .collect();
            let scale: f64 = he.iter().map(|v| v.abs()).sum::<f64>().max(1e-30);
            for a in 0..k {
                let grad: f64 = (0..cols)
                    .filter(|&j| usize::from(codes[j]) == a)
                    .map(|j| he[j])
                    .sum();
                assert!(
                    grad.abs() <= 1e-4 * scale,
                    "row {r} level {a}: gradient {grad}"
                );
            }
        }
    }
}

//! Calibration statistics for the fitted refinement (docs/method.md §2):
//! M = E[z zᵀ] and G = E[x zᵀ], where z = z_k(x) is x with everything but the top-k |x_i| of
//! each 1024-channel chunk zeroed.
//!
//! [`RefinementStats`] accumulates the *sums* Σ z zᵀ and Σ x zᵀ in f64 from observed rows
//! without storing activations; [`RefinementStats::m_mean`] / [`RefinementStats::g_mean`]
//! divide by the row count.
//!
//! **Memory**: `m` and `g` are dense `in × in` f64 each, i.e. 16·in² bytes per projection set
//! per layer: 5.3 MB for in = 576 (SmolLM2-135M), 268 MB for in = 4096, and 3.3 GB for the
//! 14336-wide down projection of an 8B model (1.6 GB each). The converter must therefore hold
//! the statistics of about one layer at a time (and at most one k per set for `down`).
//!
//! **Selection** ([`select_top_k`], shared with the runtime so calibration and decoding pick
//! exactly the same channels): see `sfx_runtime::refine::select`.

use rayon::prelude::*;

pub use sfx_runtime::refine::select::{
    chunk_budget, mask_top_k, select_top_k, selected_count, CHUNK,
};

/// Running sums for one projection set of one layer at one budget k.
#[derive(Debug, Clone, PartialEq)]
pub struct RefinementStats {
    pub in_dim: usize,
    /// Selection budget per full 1024-channel chunk.
    pub k_per_1024: usize,
    /// Rows (tokens) accumulated.
    pub n: u64,
    /// Σ z zᵀ, row-major `in × in` (symmetric).
    pub m: Vec<f64>,
    /// Σ x zᵀ, row-major `in × in`: `g[i·in + j] = Σ x_i z_j`.
    pub g: Vec<f64>,
}

impl RefinementStats {
    pub fn new(in_dim: usize, k_per_1024: usize) -> Self {
        Self {
            in_dim,
            k_per_1024,
            n: 0,
            m: vec![0.0; in_dim * in_dim],
            g: vec![0.0; in_dim * in_dim],
        }
    }

    /// Adds `rows` observed inputs, row-major `[rows, in_dim]`.
    ///
    /// Parallel over rows of M/G (rayon), each accumulating over the tokens in order, so the
    /// result does not depend on the thread count. Cost per token: in·|S| + |S|² multiply-adds.
    pub fn add_rows(&mut self, x: &[f32], rows: usize) {
        let d = self.in_dim;
        assert_eq!(x.len(), rows * d, "add_rows: x is not [rows, in_dim]");
        if rows == 0 || d == 0 {
            return;
        }
        // Selected indices (and their values) per token.
        let per = selected_count(self.k_per_1024, d);
        let mut sel_idx = Vec::with_capacity(rows * per);
        let mut sel_val = Vec::with_capacity(rows * per);
        let mut buf = Vec::new();
        for t in 0..rows {
            let row = &x[t * d..(t + 1) * d];
            select_top_k(row, self.k_per_1024, &mut buf);
            debug_assert_eq!(buf.len(), per);
            for &j in &buf {
                sel_idx.push(j);
                sel_val.push(row[j] as f64);
            }
        }
        let (sel_idx, sel_val) = (&sel_idx, &sel_val);
        // The sums start as the allocator's lazily mapped zero pages: the first `+=` would read
        // the shared zero page and then fault again to write it, each write fault flushing the
        // TLB of every thread (12 % of a plain conversion's time in `perf`). Writing the zeros
        // first maps each page once.
        let first = self.n == 0;
        if first {
            self.m.fill(0.0);
        }
        // G rows: g[i, j] += x_i z_j for j ∈ S.
        self.g.par_chunks_mut(d).enumerate().for_each(|(i, g_row)| {
            if first {
                g_row.fill(0.0);
            }
            for t in 0..rows {
                let xi = x[t * d + i] as f64;
                if xi == 0.0 {
                    continue;
                }
                let s = t * per..(t + 1) * per;
                for (&j, &v) in sel_idx[s.clone()].iter().zip(&sel_val[s]) {
                    g_row[j] += xi * v;
                }
            }
        });
        // M: m[i, j] += z_i z_j for i, j ∈ S. Few nonzeros per token: sequential is cheap.
        for t in 0..rows {
            let s = t * per..(t + 1) * per;
            let (idx, val) = (&sel_idx[s.clone()], &sel_val[s]);
            for (&i, &vi) in idx.iter().zip(val) {
                let m_row = &mut self.m[i * d..(i + 1) * d];
                for (&j, &vj) in idx.iter().zip(val) {
                    m_row[j] += vi * vj;
                }
            }
        }
        self.n += rows as u64;
    }

    /// Adds another accumulator of the same shape and budget (e.g. from another thread).
    pub fn merge(&mut self, other: &RefinementStats) {
        assert_eq!(
            (self.in_dim, self.k_per_1024),
            (other.in_dim, other.k_per_1024),
            "merge: different shapes"
        );
        self.m
            .par_iter_mut()
            .zip(other.m.par_iter())
            .for_each(|(a, b)| *a += b);
        self.g
            .par_iter_mut()
            .zip(other.g.par_iter())
            .for_each(|(a, b)| *a += b);
        self.n += other.n;
    }

    /// M = E[z zᵀ] (row-major `in × in`); all zeros when nothing was observed.
    pub fn m_mean(&self) -> Vec<f64> {
        let s = 1.0 / self.n.max(1) as f64;
        self.m.iter().map(|v| v * s).collect()
    }

    /// G = E[x zᵀ] (row-major `in × in`).
    pub fn g_mean(&self) -> Vec<f64> {
        let s = 1.0 / self.n.max(1) as f64;
        self.g.iter().map(|v| v * s).collect()
    }

    /// Bytes held by `m` and `g`.
    pub fn bytes(&self) -> usize {
        (self.m.len() + self.g.len()) * std::mem::size_of::<f64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets() {
        assert_eq!(chunk_budget(16, 1024), 16);
        assert_eq!(chunk_budget(16, 576), 9); // 16·576/1024 = 9
        assert_eq!(chunk_budget(16, 512), 8);
        assert_eq!(chunk_budget(16, 32), 1); // 0.5 rounds half up
        assert_eq!(chunk_budget(16, 1), 1); // at least one
        assert_eq!(chunk_budget(3, 100), 1); // 0.29 → 0 → at least one
        assert_eq!(chunk_budget(0, 1024), 0);
        assert_eq!(chunk_budget(2048, 1024), 1024); // never more than the chunk
        assert_eq!(selected_count(16, 1536), 16 + 8);
        assert_eq!(selected_count(32, 14336), 32 * 14);
    }

    #[test]
    fn top_k_exact_with_ties_and_tail() {
        // 1024 + 100 channels; k = 4 → tail budget round(400/1024) = 0 → 1.
        let mut x = vec![0.5f32; 1124];
        x[10] = -3.0;
        x[700] = 3.0; // ties |−3| with index 10
        x[5] = 2.0;
        x[1000] = -2.0; // ties with 5
        x[999] = 2.0; // third of the tied 2.0s: loses on index
        x[1100] = 1.0;
        x[1123] = -1.0; // tie in the tail: lower index wins
        let mut sel = Vec::new();
        select_top_k(&x, 4, &mut sel);
        assert_eq!(sel, vec![5, 10, 700, 999, 1100]);
        // All equal: the lowest indices.
        let y = vec![1.0f32; 1024];
        select_top_k(&y, 3, &mut sel);
        assert_eq!(sel, vec![0, 1, 2]);
        // Brute force against a full sort on pseudo-random data with many ties.
        let mut state = 12345u64;
        let z: Vec<f32> = (0..2600)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 33) % 41) as f32 - 20.0
            })
            .collect();
        // Non-finite values order as `total_cmp` orders |x|: NaN (either sign) above +inf.
        let mut z = z;
        z[17] = f32::NAN;
        z[1500] = -f32::NAN;
        z[1501] = f32::NEG_INFINITY;
        z[2000] = -0.0;
        for k in [1, 7, 32, 1024] {
            select_top_k(&z, k, &mut sel);
            let mut want = Vec::new();
            for s in (0..z.len()).step_by(CHUNK) {
                let e = (s + CHUNK).min(z.len());
                let mut ids: Vec<usize> = (s..e).collect();
                ids.sort_by(|&a, &b| z[b].abs().total_cmp(&z[a].abs()).then(a.cmp(&b)));
                let mut top = ids[..chunk_budget(k, e - s)].to_vec();
                top.sort();
                want.extend(top);
            }
            assert_eq!(sel, want, "k = {k}");
        }
    }

    #[test]
    fn accumulation_matches_dense_definition() {
        let d = 40;
        let rows = 13;
        let x: Vec<f32> = (0..rows * d)
            .map(|i| ((i * 7919 % 97) as f32 - 48.0) / 17.0)
            .collect();
        let mut st = RefinementStats::new(d, 200); // 200·40/1024 → 8 per row
        st.add_rows(&x[..5 * d], 5);
        let mut rest = RefinementStats::new(d, 200);
        rest.add_rows(&x[5 * d..], rows - 5);
        st.merge(&rest);
        assert_eq!(st.n, rows as u64);
        let mut m = vec![0.0f64; d * d];
        let mut g = vec![0.0f64; d * d];
        for t in 0..rows {
            let row = &x[t * d..(t + 1) * d];
            let z = mask_top_k(row, 200);
            assert_eq!(z.iter().filter(|v| **v != 0.0).count(), 8);
            for i in 0..d {
                for j in 0..d {
                    m[i * d + j] += z[i] as f64 * z[j] as f64;
                    g[i * d + j] += row[i] as f64 * z[j] as f64;
                }
            }
        }
        for (a, b) in st.m.iter().zip(&m).chain(st.g.iter().zip(&g)) {
            assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }
}

//! Row-wise and element-wise ops: RMSNorm, RoPE, SwiGLU, residual add, embedding rows and KV
//! scatter. Each is < 1 % of a layer's time, so they are plain loops LLVM vectorizes, run on
//! the rayon pool only when a call is big enough (prefill) to amortise the fork.

use super::math::{self, multiversioned};
use super::matvec::WeightElem;
use super::SimdLevel;
use crate::backend::KvLayout;
use rayon::prelude::*;

/// Element count above which an op is split across threads (~64 K floats ≈ 20 µs of work).
const PARALLEL_ELEMS: usize = 1 << 16;

/// Rows per parallel task for rows of `row_len`, or `None` to stay on this thread.
fn rows_per_task(rows: usize, row_len: usize) -> Option<usize> {
    if rows * row_len < PARALLEL_ELEMS || rows < 2 {
        return None;
    }
    let threads = rayon::current_num_threads().max(1);
    Some(rows.div_ceil(4 * threads).max(1))
}

multiversioned! {
    fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) = rms_norm_body;
}

/// RMSNorm as Hugging Face computes it in f32: `(x · rsqrt(mean(x²) + eps)) · w`.
#[inline(always)]
fn rms_norm_body(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let dim = w.len();
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let inv = 1.0 / (math::sum_squares(xr) / dim as f32 + eps).sqrt();
        for ((o, &xv), &wv) in or.iter_mut().zip(xr).zip(w) {
            *o = (xv * inv) * wv;
        }
    }
}

/// `out = rms_norm(x)` row by row; `x.len()` is a multiple of `w.len()` (checked by caller).
pub(crate) fn rms_norm(level: SimdLevel, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let dim = w.len();
    if dim == 0 {
        return;
    }
    match rows_per_task(x.len() / dim, dim) {
        None => rms_norm_rows(level, x, w, eps, out),
        Some(per) => x
            .par_chunks(per * dim)
            .zip(out.par_chunks_mut(per * dim))
            .for_each(|(xc, oc)| rms_norm_rows(level, xc, w, eps, oc)),
    }
}

/// In-place RMSNorm (the per-head q/k norm of Qwen3).
pub(crate) fn rms_norm_in_place(level: SimdLevel, x: &mut [f32], w: &[f32], eps: f32) {
    let dim = w.len();
    if dim == 0 {
        return;
    }
    // One row at a time through a small copy: the norm reads the whole row before writing.
    let per = rows_per_task(x.len() / dim, dim)
        .unwrap_or(x.len() / dim)
        .max(1);
    x.par_chunks_mut(per * dim).for_each(|xc| {
        let mut row = vec![0.0f32; dim];
        for xr in xc.chunks_exact_mut(dim) {
            row.copy_from_slice(xr);
            rms_norm_rows(level, &row, w, eps, xr);
        }
    });
}

multiversioned! {
    fn rope_rows(x: &mut [f32], row_len: usize, head_dim: usize, cos: &[f32], sin: &[f32]) = rope_body;
}

/// Hugging Face `apply_rotary_pos_emb` with `rotate_half`: for each head, pair i with
/// i + head_dim/2: (a, b) → (a·cos − b·sin, b·cos + a·sin), angle θ_i·position.
#[inline(always)]
fn rope_body(x: &mut [f32], row_len: usize, head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for ((xr, c), s) in x
        .chunks_exact_mut(row_len)
        .zip(cos.chunks_exact(half))
        .zip(sin.chunks_exact(half))
    {
        for head in xr.chunks_exact_mut(head_dim) {
            let (lo, hi) = head.split_at_mut(half);
            for i in 0..half {
                let (a, b) = (lo[i], hi[i]);
                lo[i] = a * c[i] - b * s[i];
                hi[i] = b * c[i] + a * s[i];
            }
        }
    }
}

/// RoPE on `x[n, n_heads * head_dim]` with per-token `cos`/`sin` `[n, head_dim / 2]`.
pub(crate) fn rope(
    level: SimdLevel,
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    cos: &[f32],
    sin: &[f32],
) {
    let row_len = n_heads * head_dim;
    let half = head_dim / 2;
    if row_len == 0 || half == 0 {
        return;
    }
    let rows = x.len() / row_len;
    match rows_per_task(rows, row_len) {
        None => rope_rows(level, x, row_len, head_dim, cos, sin),
        Some(per) => x
            .par_chunks_mut(per * row_len)
            .zip(cos.par_chunks(per * half).zip(sin.par_chunks(per * half)))
            .for_each(|(xc, (cc, sc))| rope_rows(level, xc, row_len, head_dim, cc, sc)),
    }
}

multiversioned! {
    fn silu_mul_chunk(gate: &mut [f32], up: &[f32]) = silu_mul_body;
}

#[inline(always)]
fn silu_mul_body(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = math::silu(*g) * u;
    }
}

/// `gate ← silu(gate) ⊙ up`.
pub(crate) fn silu_mul(level: SimdLevel, gate: &mut [f32], up: &[f32]) {
    if gate.len() < PARALLEL_ELEMS {
        silu_mul_chunk(level, gate, up);
    } else {
        let per = gate.len().div_ceil(4 * rayon::current_num_threads().max(1));
        gate.par_chunks_mut(per)
            .zip(up.par_chunks(per))
            .for_each(|(g, u)| silu_mul_chunk(level, g, u));
    }
}

/// `acc += x`.
pub(crate) fn add_assign(acc: &mut [f32], x: &[f32]) {
    if acc.len() < PARALLEL_ELEMS {
        acc.iter_mut().zip(x).for_each(|(a, b)| *a += b);
    } else {
        acc.par_chunks_mut(PARALLEL_ELEMS)
            .zip(x.par_chunks(PARALLEL_ELEMS))
            .for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(a, b)| *a += b));
    }
}

/// Copies table rows `tokens[t]` (widened to f32) into `out[t]`; ids are checked by the caller.
pub(crate) fn embedding<E: WeightElem>(table: &[E], cols: usize, tokens: &[u32], out: &mut [f32]) {
    for (&tok, row) in tokens.iter().zip(out.chunks_exact_mut(cols)) {
        let src = &table[tok as usize * cols..][..cols];
        for (o, &v) in row.iter_mut().zip(src) {
            *o = v.to_f32();
        }
    }
}

/// Token-major `src[n, kv_heads * head_dim]` → `dst[kv_heads, capacity, head_dim]` at
/// positions `start..start + n` (bounds checked by the caller).
pub(crate) fn write_kv(src: &[f32], dst: &mut [f32], l: KvLayout, start: usize) {
    let hd = l.head_dim;
    let row = l.kv_heads * hd;
    for (t, tok) in src.chunks_exact(row).enumerate() {
        for (g, head) in tok.chunks_exact(hd).enumerate() {
            let at = (g * l.capacity + start + t) * hd;
            dst[at..at + hd].copy_from_slice(head);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rnd(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// RMSNorm vs an f64 loop; rows big enough to take the parallel path too. Tolerance 1e-6
    /// relative (one f32 rsqrt and two roundings).
    #[test]
    fn rms_norm_matches_reference() {
        let mut seed = 1;
        for &(rows, dim) in &[(1, 7), (3, 64), (300, 576)] {
            let x: Vec<f32> = (0..rows * dim).map(|_| rnd(&mut seed) * 4.0).collect();
            let w: Vec<f32> = (0..dim).map(|_| rnd(&mut seed)).collect();
            for level in SimdLevel::supported() {
                let mut out = vec![f32::NAN; x.len()];
                rms_norm(level, &x, &w, 1e-5, &mut out);
                let mut inplace = x.clone();
                rms_norm_in_place(level, &mut inplace, &w, 1e-5);
                for r in 0..rows {
                    let xr = &x[r * dim..(r + 1) * dim];
                    let ms = xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim as f64;
                    let inv = 1.0 / (ms + 1e-5).sqrt();
                    for i in 0..dim {
                        let want = xr[i] as f64 * inv * w[i] as f64;
                        let tol = 1e-6 * want.abs().max(1e-3);
                        assert!((out[r * dim + i] as f64 - want).abs() <= tol, "{level:?}");
                        assert_eq!(out[r * dim + i], inplace[r * dim + i]);
                    }
                }
            }
        }
    }

    /// RoPE against the rotation computed directly in f64 from θ_i = base^(−2i/d), pairing
    /// (i, i + d/2). Tolerance 1e-6 absolute on unit-scale inputs.
    #[test]
    fn rope_matches_direct_rotation() {
        let (n_heads, hd, n, base, past) = (3, 8, 5, 10000.0f64, 17usize);
        let half = hd / 2;
        let mut seed = 2;
        let x: Vec<f32> = (0..n * n_heads * hd).map(|_| rnd(&mut seed)).collect();
        let mut cos = vec![0.0f32; n * half];
        let mut sin = vec![0.0f32; n * half];
        for t in 0..n {
            for i in 0..half {
                let a = (past + t) as f64 * base.powf(-2.0 * i as f64 / hd as f64);
                cos[t * half + i] = a.cos() as f32;
                sin[t * half + i] = a.sin() as f32;
            }
        }
        for level in SimdLevel::supported() {
            let mut y = x.clone();
            rope(level, &mut y, n_heads, hd, &cos, &sin);
            for t in 0..n {
                for h in 0..n_heads {
                    let o = (t * n_heads + h) * hd;
                    for i in 0..half {
                        let a = (past + t) as f64 * base.powf(-2.0 * i as f64 / hd as f64);
                        let (x0, x1) = (x[o + i] as f64, x[o + i + half] as f64);
                        let want0 = x0 * a.cos() - x1 * a.sin();
                        let want1 = x1 * a.cos() + x0 * a.sin();
                        assert!((y[o + i] as f64 - want0).abs() < 1e-6, "{level:?}");
                        assert!((y[o + i + half] as f64 - want1).abs() < 1e-6, "{level:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn silu_mul_and_add_match_reference() {
        let mut seed = 3;
        let n = 70_000; // above PARALLEL_ELEMS
        let g: Vec<f32> = (0..n).map(|_| rnd(&mut seed) * 12.0).collect();
        let u: Vec<f32> = (0..n).map(|_| rnd(&mut seed)).collect();
        for level in SimdLevel::supported() {
            let mut y = g.clone();
            silu_mul(level, &mut y, &u);
            for i in 0..n {
                let gf = g[i] as f64;
                let want = gf / (1.0 + (-gf).exp()) * u[i] as f64;
                assert!(
                    (y[i] as f64 - want).abs() <= 1e-6 * want.abs() + 1e-12,
                    "{level:?} {i}"
                );
            }
        }
        let mut acc = g.clone();
        add_assign(&mut acc, &u);
        assert!(acc
            .iter()
            .zip(g.iter().zip(&u))
            .all(|(a, (x, y))| *a == x + y));
    }

    #[test]
    fn write_kv_scatters_heads() {
        let l = KvLayout {
            kv_heads: 2,
            head_dim: 2,
            capacity: 4,
        };
        let src = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]; // 2 tokens × (2 heads × 2)
        let mut dst = vec![0.0; l.buffer_len()];
        write_kv(&src, &mut dst, l, 1);
        assert_eq!(
            dst,
            [0., 0., 1., 2., 5., 6., 0., 0., 0., 0., 3., 4., 7., 8., 0., 0.]
        );
    }
}

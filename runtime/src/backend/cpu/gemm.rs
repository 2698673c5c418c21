//! Prefill linears `y[m, out] = x[m, in] · Wᵀ` through faer's f32 GEMM.
//!
//! candle's BF16 GEMM is 20× slower than f32 on this machine class (docs: crates.md), so BF16
//! weights are widened to f32 panel by panel and multiplied in f32. A panel is a block of
//! weight rows sized to stay in L2 while its GEMM runs; widening is one pass over the weights
//! per call, negligible next to 2·m flops per weight at m ≥ 64.
//! Measured (2-core EPYC dev VM, m = 512, SmolLM2 shapes, `examples/bench_kernels`): BF16
//! panels 179–197 GF/s vs one parallel f32 faer GEMM 178–201 GF/s — the ~190 GF/s 2-core FMA
//! peak either way. So no f32 copy of the weights is kept (it would triple BF16 memory: +4
//! bytes/param, 32 GB for an 8B model).
//!
//! Decision for F32 weights: one faer GEMM parallelized inside faer.

use super::matvec::WeightElem;
use super::scratch::with_scratch;
use faer::{Accum, MatMut, MatRef, Par};
use rayon::prelude::*;

/// Target size of one widened f32 panel (a quarter of a Zen 4 / Sapphire Rapids 1–2 MiB L2,
/// leaving room for faer's packed activation block).
const PANEL_BYTES: usize = 256 * 1024;

/// `y = x · wᵀ` with `x` row-major `[m, cols]`, `w` row-major `[rows, cols]`,
/// `y` row-major `[m, rows]`. Callers check the lengths.
pub(crate) fn matmul_t<E: PanelSource>(x: &[f32], m: usize, w: &[E], rows: usize, y: &mut [f32]) {
    let cols = x.len().checked_div(m).unwrap_or(0);
    debug_assert_eq!(x.len(), m * cols);
    debug_assert_eq!(w.len(), rows * cols);
    debug_assert_eq!(y.len(), m * rows);
    if m == 0 || rows == 0 {
        return;
    }
    if cols == 0 {
        y.fill(0.0);
        return;
    }
    let xm = MatRef::from_row_major_slice(x, m, cols);
    if let Some(wf) = E::as_f32(w) {
        // F32 weights need no widening: one GEMM, parallelized inside faer.
        let wm = MatRef::from_row_major_slice(wf, rows, cols);
        let ym = MatMut::from_row_major_slice_mut(y, m, rows);
        faer::linalg::matmul::matmul(
            ym,
            Accum::Replace,
            xm,
            wm.transpose(),
            1.0f32,
            Par::rayon(0),
        );
        return;
    }
    matmul_t_panels(x, m, rows, y, |r0, panel| {
        for (d, s) in panel.iter_mut().zip(&w[r0 * cols..]) {
            *d = s.to_f32();
        }
    });
}

/// `y = x · Ŵᵀ` where `fill(first_row, panel)` writes f32 weight rows
/// `first_row..first_row + panel.len() / cols` of Ŵ (row-major) into `panel`. Every weight
/// format without an f32 copy (BF16, packed integer codes) goes through this: widen or decode
/// one L2-sized panel, then one sequential faer GEMM per panel, panels in parallel.
pub(crate) fn matmul_t_panels(
    x: &[f32],
    m: usize,
    rows: usize,
    y: &mut [f32],
    fill: impl Fn(usize, &mut [f32]) + Sync,
) {
    let cols = x.len().checked_div(m).unwrap_or(0);
    if m == 0 || rows == 0 {
        return;
    }
    if cols == 0 {
        y.fill(0.0);
        return;
    }
    let xm = MatRef::from_row_major_slice(x, m, cols);
    // Panels of weight rows = column blocks of y. At least two panels per thread so both
    // cores stay busy on the small k/v projections (192 rows for SmolLM2).
    let threads = rayon::current_num_threads().max(1);
    let by_cache = (PANEL_BYTES / (4 * cols)).max(16);
    let by_threads = rows.div_ceil(2 * threads);
    let panel = by_cache.min(by_threads).next_multiple_of(16).max(16);

    let mut blocks: Vec<(usize, MatMut<'_, f32>)> = Vec::with_capacity(rows.div_ceil(panel));
    let mut rest = MatMut::from_row_major_slice_mut(y, m, rows);
    let mut start = 0;
    while start < rows {
        let width = panel.min(rows - start);
        let (block, tail) = rest.split_at_col_mut(width);
        blocks.push((start, block));
        rest = tail;
        start += width;
    }
    blocks.into_par_iter().for_each(|(r0, yb)| {
        let width = yb.ncols();
        with_scratch(width * cols, |wide| {
            fill(r0, wide);
            let wm = MatRef::from_row_major_slice(wide, width, cols);
            faer::linalg::matmul::matmul(yb, Accum::Replace, xm, wm.transpose(), 1.0f32, Par::Seq);
        })
    });
}

/// A weight element type the GEMM can consume, directly (f32) or by widening (bf16 bits).
pub(crate) trait PanelSource: WeightElem {
    fn as_f32(w: &[Self]) -> Option<&[f32]>;
}

impl PanelSource for f32 {
    fn as_f32(w: &[Self]) -> Option<&[f32]> {
        Some(w)
    }
}

impl PanelSource for u16 {
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_f64_reference_for_bf16_and_f32() {
        let mut seed = 11u64;
        let mut rnd = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        for &(m, rows, cols) in &[(3, 5, 7), (17, 33, 64), (64, 200, 130), (130, 48, 577)] {
            let x: Vec<f32> = (0..m * cols).map(|_| rnd()).collect();
            let wf: Vec<f32> = (0..rows * cols).map(|_| rnd()).collect();
            let wb: Vec<u16> = wf
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            let mut yf = vec![f32::NAN; m * rows];
            let mut yb = vec![f32::NAN; m * rows];
            matmul_t(&x, m, &wf, rows, &mut yf);
            matmul_t(&x, m, &wb, rows, &mut yb);
            for t in 0..m {
                for r in 0..rows {
                    let (mut want_f, mut want_b, mut mag) = (0.0f64, 0.0f64, 0.0f64);
                    for i in 0..cols {
                        let xv = x[t * cols + i] as f64;
                        want_f += wf[r * cols + i] as f64 * xv;
                        want_b += wb[r * cols + i].to_f32() as f64 * xv;
                        mag += (wf[r * cols + i] as f64 * xv).abs();
                    }
                    // f32 accumulation: 1e-5 of the absolute sum (≈ cols · 2^-24 with margin).
                    let tol = 1e-5 * mag + 1e-6;
                    assert!(
                        (yf[t * rows + r] as f64 - want_f).abs() <= tol,
                        "f32 {m}x{rows}x{cols}"
                    );
                    assert!(
                        (yb[t * rows + r] as f64 - want_b).abs() <= tol,
                        "bf16 {m}x{rows}x{cols}"
                    );
                }
            }
        }
    }
}

//! YAQA rounding (Tseng, Sun, De Sa 2025): QTIP's format and incoherence processing, with LDLQ
//! against *both* Kronecker factors of the full-model KL Hessian, `tr(E H_in Eᵀ H_out)`, from
//! [`crate::yaqa`] (Sketch B). Written from the paper's formulas and the derivation below;
//! YAQA's GPL code is not used.
//!
//! Two-sided LDLQ: with `H_in = U_in D_in U_inᵀ` and `H_out = U_out D_out U_outᵀ` (unit upper
//! block-triangular `U`, 16×16 blocks), define `F = U_outᵀ E U_in`. Then
//! `tr(E H_in Eᵀ H_out) = Σ_ij tr(F_ij D_in,j F_ijᵀ D_out,i)`, so if each tile's rounding error
//! is `F_ij = η_ij`, the errors do not interact. Since `U_outᵀ` is lower and `U_in` upper
//! block-triangular with identity diagonal blocks, `F_ij = E_ij + Σ_{a≤i, b≤j, (a,b)≠(i,j)}
//! U_out[a,i]ᵀ E_ab U_in[b,j]`, so tile `(i, j)` is rounded from the target
//! `W_ij + X_ij + Σ_{a<i} U_out[a,i]ᵀ X_aj`, with `X = E·U_in` accumulated over finished tiles
//! (`X_aj = Σ_{b≤j} E_ab U_in[b,j]`, which for the current row holds only `b < j`). Tiles on
//! one anti-diagonal depend only on earlier anti-diagonals, so they are rounded in parallel.
//! Cost: `rows·cols²/2 + rows²·cols/2` multiply-adds besides the Viterbi.

use super::qtip::{
    block_udu, proxy_error, rotate_symmetric, short_name, CodeBook, Qtip, Rotated, TileResult,
};
use super::{
    InputStats, QuantError, QuantizedSet, ResidentQuantizer, ResidentWeight, SetContext, WeightView,
};
use rayon::prelude::*;
use sfx_formats::resident::{ResidentError, TrellisQuantized, TILE_SIDE, TILE_WEIGHTS};
use sfx_runtime::resident::trellis::{decode_tile, TrellisQuantizer, TrellisSpec};
use std::collections::BTreeMap;

/// YAQA: the QTIP trellis format rounded with the two-sided LDLQ.
#[derive(Debug, Clone)]
pub struct Yaqa {
    pub qtip: Qtip,
}

impl Yaqa {
    pub fn new(bits: u8) -> Self {
        Self {
            qtip: Qtip::new(bits),
        }
    }
}

fn err(name: &str, msg: impl std::fmt::Display) -> QuantError {
    QuantError::Layout {
        name: name.to_string(),
        source: ResidentError::Invalid(msg.to_string()),
    }
}

/// Normalises a Hessian factor by its mean diagonal (YAQA: each factor's scale is arbitrary,
/// only the product matters), so the relative damping means the same for both.
fn normalise(h: &mut [f32], n: usize) {
    let mean = super::mean_diagonal(h, n);
    if mean > 0.0 {
        let inv = (1.0 / mean) as f32;
        h.iter_mut().for_each(|v| *v *= inv);
    }
}

/// Two-sided LDLQ over 16×16 tiles; `wt` rotated and scaled, `u_in` (`cols²`) and `u_out`
/// (`rows²`) the block-UDUᵀ factors of the rotated Hessian factors. Returns the tile streams.
#[allow(clippy::too_many_arguments)]
fn ldlq_two_sided(
    name: &str,
    wt: &[f32],
    rows: usize,
    cols: usize,
    u_in: &[f64],
    u_out: &[f64],
    tq: &TrellisQuantizer,
    book: &CodeBook,
    tail: sfx_runtime::resident::trellis::TailBiting,
) -> Result<Vec<u8>, QuantError> {
    let spec = *tq.spec();
    let tb = spec.stream_bytes();
    let (tr_n, tc_n) = (rows / TILE_SIDE, cols / TILE_SIDE);
    let mut tiles = vec![0u8; tr_n * tc_n * tb];
    // X = E·U_in over finished tiles, row-major [rows, cols] (f64: the sums run long).
    let mut x = vec![0.0f64; rows * cols];
    for d in 0..tr_n + tc_n - 1 {
        let cells: Vec<(usize, usize)> = (0..tr_n)
            .filter_map(|i| d.checked_sub(i).filter(|&j| j < tc_n).map(|j| (i, j)))
            .collect();
        let done: Vec<TileResult> = cells
            .par_iter()
            .map(|&(i, j)| {
                let (r0, c0) = (i * TILE_SIDE, j * TILE_SIDE);
                let mut target = vec![0.0f32; TILE_WEIGHTS];
                for r in 0..TILE_SIDE {
                    for c in 0..TILE_SIDE {
                        // W + X_ij + Σ_{a<i} U_out[a-rows, i-row]ᵀ X[a-rows, j-cols].
                        let mut s =
                            f64::from(wt[(r0 + r) * cols + c0 + c]) + x[(r0 + r) * cols + c0 + c];
                        for a in 0..r0 {
                            s += u_out[a * rows + r0 + r] * x[a * cols + c0 + c];
                        }
                        target[r * TILE_SIDE + c] = s as f32;
                    }
                }
                let q = tq.quantize_with(&target, tail).map_err(|e| err(name, e))?;
                let mut dec = vec![0.0f32; TILE_WEIGHTS];
                decode_tile(&q.stream, &spec, &book.code, &mut dec).map_err(|e| err(name, e))?;
                // E_ij = W_ij − Ŵ_ij (not target − Ŵ: the feedback terms are not error).
                let e: Vec<f32> = (0..TILE_WEIGHTS)
                    .map(|p| wt[(r0 + p / TILE_SIDE) * cols + c0 + p % TILE_SIDE] - dec[p])
                    .collect();
                Ok((q.stream, e))
            })
            .collect();
        let mut finished = Vec::with_capacity(done.len());
        for (&(i, j), res) in cells.iter().zip(done) {
            let (stream, e) = res?;
            let t = (i * tc_n + j) * tb;
            tiles[t..t + tb].copy_from_slice(&stream);
            finished.push((i, j, e));
        }
        // X[i-rows, j'-cols] += E_ij · U_in[j-cols, j'-cols] for j' ≥ j (tiles of one
        // anti-diagonal have distinct i, so the row blocks they update are disjoint).
        let mut rows_x: Vec<(usize, &mut [f64])> = x
            .chunks_exact_mut(TILE_SIDE * cols)
            .enumerate()
            .filter(|(i, _)| finished.iter().any(|f| f.0 == *i))
            .collect();
        rows_x.par_iter_mut().for_each(|(i, band)| {
            let Some((_, j, e)) = finished.iter().find(|f| f.0 == *i) else {
                return;
            };
            let c0 = j * TILE_SIDE;
            for r in 0..TILE_SIDE {
                let xr = &mut band[r * cols..(r + 1) * cols];
                for b in 0..TILE_SIDE {
                    let ev = f64::from(e[r * TILE_SIDE + b]);
                    if ev == 0.0 {
                        continue;
                    }
                    let ur = &u_in[(c0 + b) * cols..(c0 + b + 1) * cols];
                    for (xv, uv) in xr[c0..].iter_mut().zip(&ur[c0..]) {
                        *xv += ev * uv;
                    }
                }
            }
        });
    }
    Ok(tiles)
}

impl Yaqa {
    fn quantize_one(
        &self,
        w: &WeightView<'_>,
        book: &CodeBook,
        tq: &TrellisQuantizer,
    ) -> Result<(TrellisQuantized, f64), QuantError> {
        let q = &self.qtip;
        let (rows, cols) = (w.rows, w.cols);
        let kron = w.kron.ok_or_else(|| QuantError::MissingStats {
            name: w.name.to_string(),
            method: "yaqa",
            what: "the Kronecker factors H_in, H_out of the full-model KL Hessian",
        })?;
        if rows % TILE_SIDE != 0 || cols % TILE_SIDE != 0 {
            return Err(err(
                w.name,
                format!("[{rows}, {cols}] is not a multiple of the 16×16 trellis tile"),
            ));
        }
        if kron.h_in.len() != cols * cols || kron.h_out.len() != rows * rows {
            return Err(err(
                w.name,
                format!(
                    "Kronecker factors of {} and {} values, expected {cols}² and {rows}²",
                    kron.h_in.len(),
                    kron.h_out.len()
                ),
            ));
        }
        let had_in = q.hadamard(cols, w.name)?;
        let had_out = q.hadamard(rows, w.name)?;
        let Rotated { su, sv, wt, scale } = q.rotate_weight(w, &had_in, &had_out, book)?;
        let mut h_in =
            rotate_symmetric(kron.h_in, cols, &su, &had_in).map_err(|e| err(w.name, e))?;
        let mut h_out =
            rotate_symmetric(kron.h_out, rows, &sv, &had_out).map_err(|e| err(w.name, e))?;
        normalise(&mut h_in, cols);
        normalise(&mut h_out, rows);
        let (u_in, _) = block_udu(&h_in, cols, TILE_SIDE, q.damp).map_err(|e| err(w.name, e))?;
        let (u_out, _) = block_udu(&h_out, rows, TILE_SIDE, q.damp).map_err(|e| err(w.name, e))?;
        let tiles = ldlq_two_sided(
            w.name,
            &wt,
            rows,
            cols,
            &u_in,
            &u_out,
            tq,
            book,
            q.tail_biting,
        )?;
        let weight = q.pack(
            w.name, rows, cols, tiles, &su, &sv, scale, book, &had_in, &had_out,
        )?;
        // Report the input-side proxy (comparable with QTIP's) on the KL factor H_in.
        let proxy = proxy_error(&weight, &wt, &h_in, rows, cols);
        Ok((weight, proxy))
    }
}

impl ResidentQuantizer for Yaqa {
    fn name(&self) -> String {
        format!(
            "yaqa{}-{}{}",
            self.qtip.bits,
            self.qtip.code.name(),
            self.qtip.rotation_suffix()
        )
    }

    fn needs_calibration(&self) -> bool {
        false
    }

    fn quantize_set(
        &self,
        weights: &[WeightView<'_>],
        _stats: Option<&InputStats>,
        _context: SetContext,
    ) -> Result<QuantizedSet, QuantError> {
        let first = weights.first().map_or("(empty set)", |w| w.name);
        let book = CodeBook::new(self.qtip.code);
        let spec = TrellisSpec::qtip(
            u32::from(self.qtip.bits),
            book.code.values_per_step() as u32,
        )
        .map_err(|e| err(first, e))?;
        let tq = TrellisQuantizer::new(spec, &book.code).map_err(|e| err(first, e))?;
        let mut out = Vec::with_capacity(weights.len());
        let mut info = BTreeMap::new();
        for w in weights {
            let (t, proxy) = self.quantize_one(w, &book, &tq)?;
            info.insert(format!("proxy_err_in.{}", short_name(w.name)), proxy);
            out.push(ResidentWeight::Trellis(t));
        }
        Ok(QuantizedSet {
            weights: out,
            input_scales: None,
            info,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With `H_out = I` the two-sided LDLQ must reduce to QTIP's one-sided LDLQ exactly (same
    /// targets, same tiles); with a non-trivial `H_out` the Kronecker objective must be lower
    /// than one-sided LDLQ's on the same weight.
    #[test]
    fn reduces_to_one_sided_and_uses_the_output_factor() {
        let (rows, cols) = (32usize, 48usize);
        let mut s = 3u64;
        let mut rnd = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        let w: Vec<f32> = (0..rows * cols).map(|_| rnd()).collect();
        let xin: Vec<f32> = (0..cols * 2 * cols).map(|_| rnd()).collect();
        let xout: Vec<f32> = (0..rows * 2 * rows).map(|_| rnd() + 0.3).collect();
        let gram = |x: &[f32], n: usize| {
            let mut h = vec![0.0f32; n * n];
            for r in x.chunks_exact(n) {
                for i in 0..n {
                    for j in 0..n {
                        h[i * n + j] += r[i] * r[j];
                    }
                }
            }
            h
        };
        let h_in = gram(&xin, cols);
        let h_out = gram(&xout, rows);
        let eye: Vec<f32> = (0..rows * rows)
            .map(|t| if t / rows == t % rows { 1.0 } else { 0.0 })
            .collect();
        let mk = |h_out| WeightView {
            name: "test.weight",
            data: &w,
            rows,
            cols,
            kron: Some(super::super::Kron { h_in: &h_in, h_out }),
            fisher: None,
            imatrix: None,
            guided: None,
        };
        let y = Yaqa::new(2);
        let book = CodeBook::new(y.qtip.code);
        let tq = TrellisQuantizer::new(TrellisSpec::qtip(2, 2).unwrap(), &book.code).unwrap();
        let (two_eye, _) = y.quantize_one(&mk(&eye), &book, &tq).unwrap();
        let one = y.qtip.quantize_one(&mk(&eye), &h_in, &book, &tq).unwrap();
        // Same targets up to summation order (f64 loop vs f32 GEMM): nearly all tiles agree.
        let tb = 64;
        let same = two_eye
            .tiles()
            .chunks_exact(tb)
            .zip(one.weight.tiles().chunks_exact(tb))
            .filter(|(a, b)| a == b)
            .count();
        assert!(
            same * 10 >= 9 * (rows / 16) * (cols / 16),
            "only {same} tiles agree with QTIP"
        );

        let (two, _) = y.quantize_one(&mk(&h_out), &book, &tq).unwrap();
        // Kronecker objective in the original domain: tr(E H_in Eᵀ H_out).
        let objective = |t: &TrellisQuantized| {
            let deq = sfx_runtime::resident::dequantize_trellis(t).unwrap();
            let e: Vec<f64> = w.iter().zip(&deq).map(|(a, b)| f64::from(a - b)).collect();
            let mut tot = 0.0;
            for a in 0..rows {
                for b in 0..rows {
                    let ho = f64::from(h_out[a * rows + b]);
                    let mut q = 0.0;
                    for i in 0..cols {
                        for j in 0..cols {
                            q += e[a * cols + i] * f64::from(h_in[i * cols + j]) * e[b * cols + j];
                        }
                    }
                    tot += ho * q;
                }
            }
            tot
        };
        let (o2, o1) = (objective(&two), objective(&one.weight));
        assert!(
            o2 < o1,
            "two-sided {o2} should beat one-sided {o1} on tr(E H_in Eᵀ H_out)"
        );
    }
}

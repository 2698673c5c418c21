//! [`LutLinear`]: `y = x·Ŵᵀ` for look-up-table codes (`ŵ[r, i] = s_r·T_r[q[r, i]]`, layout in
//! `sfx_formats::resident::lut`), on the CPU backend.
//!
//! Decode (m ≤ 2): with int8 activations the group kernels run the codes ([`group_q8`]: one
//! `vpermb` from the row's table after the unpack, the row one group with zero point 128 and
//! the row's scale); otherwise an f32 loop reads each code's value from the row's table of 2–16
//! f32 values. Prefill dequantizes panels of rows into faer's f32 GEMM, as the group format
//! does. Never a dequantized copy of the matrix.

use crate::backend::cpu::gemm::matmul_t_panels;
use crate::backend::cpu::math::multiversioned;
use crate::backend::cpu::{CpuBackend, CpuBuffer, CpuIndex, SimdLevel};
use crate::error::{check_len, Result};
use crate::linear::Linear;
use crate::resident::{coded_forward, gather_decoded_rows, group_q8, run_row_blocks};
use half::f16;
use sfx_formats::resident::lut::row_values;
use sfx_formats::resident::LutQuantized;

/// A look-up-table-coded projection with an optional f32 bias.
#[derive(Debug, Clone)]
pub struct LutLinear {
    weight: LutQuantized,
    bias: Option<Vec<f32>>,
    /// The tables as the int8 kernels read them: `level + 128`, row-major.
    unsigned_tables: Vec<u8>,
    /// Zero point 128 per row (the int8 kernels' one group a row).
    zeros: Vec<u8>,
}

impl LutLinear {
    pub fn new(weight: LutQuantized, bias: Option<Vec<f32>>) -> Result<Self> {
        if let Some(b) = &bias {
            check_len("LutLinear::new", "bias", b.len(), weight.rows())?;
        }
        let unsigned_tables = weight
            .tables()
            .iter()
            .map(|&t| (i16::from(t) + 128) as u8)
            .collect();
        let zeros = vec![128; weight.rows()];
        Ok(Self {
            weight,
            bias,
            unsigned_tables,
            zeros,
        })
    }

    pub fn weight(&self) -> &LutQuantized {
        &self.weight
    }

    /// `y = Ŵ·x̃` for one token with `x` quantized to int8 blocks, or `None` off the int8
    /// kernels' grid (the whole row is one group, so its width must be on it).
    fn matvec_int8(&self, level: SimdLevel, x: &[f32], y: &mut [f32]) -> Option<()> {
        let w = &self.weight;
        let cols = w.cols();
        if !group_q8::takes(level, cols, cols) {
            return None;
        }
        let prepared = group_q8::Prepared::new(x, cols, w.bits());
        let (rb, n_levels) = (w.row_bytes(), w.levels());
        let block = |r0: usize, yb: &mut [f32]| {
            let n = yb.len();
            let rows = group_q8::CodeRows {
                codes: &w.codes()[r0 * rb..(r0 + n) * rb],
                scales: &w.scales()[r0..r0 + n],
                zeros: &self.zeros[r0..r0 + n],
                bits: w.bits(),
                tables: Some(&self.unsigned_tables[r0 * n_levels..(r0 + n) * n_levels]),
            };
            group_q8::rows(level, &rows, &prepared, yb);
        };
        run_row_blocks(w.codes().len(), y, block);
        Some(())
    }

    /// `y = Ŵ·x` for one token with f32 activations, bias excluded.
    pub fn matvec(&self, level: SimdLevel, x: &[f32], y: &mut [f32]) {
        let w = &self.weight;
        debug_assert_eq!((x.len(), y.len()), (w.cols(), w.rows()));
        let (rb, n_levels) = (w.row_bytes(), w.levels());
        let block = |r0: usize, yb: &mut [f32]| {
            let n = yb.len();
            let args = Rows {
                codes: &w.codes()[r0 * rb..(r0 + n) * rb],
                tables: &w.tables()[r0 * n_levels..(r0 + n) * n_levels],
                scales: &w.scales()[r0..r0 + n],
                x,
            };
            match w.bits() {
                4 => rows_b4(level, &args, yb),
                3 => rows_b3(level, &args, yb),
                _ => rows_b2(level, &args, yb),
            }
        };
        run_row_blocks(w.codes().len(), y, block);
    }

    /// `y[m, rows] = x[m, cols] · Ŵᵀ` through dequantized panels and faer, bias excluded.
    fn matmul_panels(&self, x: &[f32], m: usize, y: &mut [f32]) {
        let w = &self.weight;
        let cols = w.cols();
        matmul_t_panels(x, m, w.rows(), y, |r0, panel| {
            for (i, row) in panel.chunks_exact_mut(cols).enumerate() {
                // Cannot fail: the panel's rows are within the matrix and `cols` wide.
                let _ = w.dequantize_row(r0 + i, row);
            }
        });
    }
}

impl Linear<CpuBackend> for LutLinear {
    fn in_dim(&self) -> usize {
        self.weight.cols()
    }
    fn out_dim(&self) -> usize {
        self.weight.rows()
    }
    fn has_bias(&self) -> bool {
        self.bias.is_some()
    }
    fn forward(
        &self,
        backend: &CpuBackend,
        x: &CpuBuffer,
        m: usize,
        y: &mut CpuBuffer,
    ) -> Result<()> {
        coded_forward(
            "LutLinear::forward",
            backend,
            (x, m, y),
            (self.weight.rows(), self.weight.cols()),
            self.bias.as_deref(),
            |level, x, y| self.matvec_int8(level, x, y),
            |level, x, y| self.matvec(level, x, y),
            |x, m, y| self.matmul_panels(x, m, y),
        )
    }
    fn gather_rows(
        &self,
        _backend: &CpuBackend,
        tokens: &CpuIndex,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        let (rows, cols) = (self.weight.rows(), self.weight.cols());
        gather_decoded_rows(tokens, out, rows, cols, |r, row| {
            let _ = self.weight.dequantize_row(r, row);
        })
    }
    fn resident_bytes(&self) -> usize {
        self.weight.size_in_bytes() + self.bias.as_ref().map_or(0, |b| 4 * b.len())
    }
    fn describe(&self) -> String {
        format!(
            "lut{} {}×{} ({:.3} bits/weight){}",
            self.weight.bits(),
            self.weight.cols(),
            self.weight.rows(),
            self.weight.bits_per_weight(),
            if self.bias.is_some() { " +bias" } else { "" }
        )
    }
}

/// One block of rows for the f32 decode loop.
struct Rows<'a> {
    codes: &'a [u8],
    tables: &'a [i8],
    scales: &'a [f16],
    x: &'a [f32],
}

/// Per row: its `2^B` values, then 8 codes per `B` bytes looked up and multiplied into 8
/// accumulators; a tail of fewer than 8 codes one at a time.
#[inline(always)]
fn rows_generic<const B: usize>(a: &Rows<'_>, y: &mut [f32]) {
    let cols = a.x.len();
    let rb = (cols * B).div_ceil(8);
    let n = 1usize << B;
    let mask = (1u32 << B) - 1;
    for (r, yr) in y.iter_mut().enumerate() {
        let values = row_values(&a.tables[r * n..(r + 1) * n], a.scales[r]);
        let row = &a.codes[r * rb..(r + 1) * rb];
        let mut acc = [0.0f32; 8];
        let mut xc = a.x.chunks_exact(8);
        for (c, x8) in (&mut xc).enumerate() {
            let mut v = 0u32;
            for (k, &b) in row[c * B..c * B + B].iter().enumerate() {
                v |= u32::from(b) << (8 * k);
            }
            for j in 0..8 {
                acc[j] += values[((v >> (B * j)) & mask) as usize] * x8[j];
            }
        }
        let mut dot: f32 = acc.iter().sum();
        let done = cols - xc.remainder().len();
        for (j, &xv) in xc.remainder().iter().enumerate() {
            let q = sfx_formats::resident::get_code(row, done + j, B as u8);
            dot += values[usize::from(q)] * xv;
        }
        *yr = dot;
    }
}

#[inline(always)]
fn rows_4(a: &Rows<'_>, y: &mut [f32]) {
    rows_generic::<4>(a, y)
}
#[inline(always)]
fn rows_3(a: &Rows<'_>, y: &mut [f32]) {
    rows_generic::<3>(a, y)
}
#[inline(always)]
fn rows_2(a: &Rows<'_>, y: &mut [f32]) {
    rows_generic::<2>(a, y)
}

multiversioned! { fn rows_b4(a: &Rows<'_>, y: &mut [f32]) = rows_4; }
multiversioned! { fn rows_b3(a: &Rows<'_>, y: &mut [f32]) = rows_3; }
multiversioned! { fn rows_b2(a: &Rows<'_>, y: &mut [f32]) = rows_2; }

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{assert_rows_match_f64, lcg};
    use sfx_formats::resident::put_code;

    /// A random valid LUT weight: codes uniform over the `2^bits` levels, levels anywhere in
    /// −128..=127 (both ends included), scales around 0.01.
    pub(crate) fn random_lut(rows: usize, cols: usize, bits: u8, seed: &mut u64) -> LutQuantized {
        let rb = (cols * usize::from(bits)).div_ceil(8);
        let mut codes = vec![0u8; rows * rb];
        for r in 0..rows {
            for i in 0..cols {
                let q = ((lcg(seed) + 1.0) * 0.5 * (1 << bits) as f32) as u8;
                put_code(
                    &mut codes[r * rb..(r + 1) * rb],
                    i,
                    bits,
                    q.min((1 << bits) - 1),
                );
            }
        }
        let n = rows << bits;
        let tables = (0..n)
            .map(|k| match k % 37 {
                0 => -128,
                1 => 127,
                _ => (lcg(seed) * 127.0) as i8,
            })
            .collect();
        let scales = (0..rows)
            .map(|_| f16::from_f32(0.01 * (1.5 + lcg(seed))))
            .collect();
        LutQuantized::from_parts(bits, rows, cols, codes, tables, scales).unwrap()
    }

    /// The int8 kernels (every tier that has them) against the f64 product of the format's
    /// own dequantization with the dequantized int8 activations; bound: f32 rounding of the
    /// block terms, `assert_rows_match_f64`'s 1e-5·Σ|ŵ·x̃| + 1e-5. Widths: on and off the
    /// 128-code bit-plane grid (576 = 4.5 units), a tail row block.
    #[test]
    fn int8_decode_matches_the_f64_product_with_quantized_activations() {
        let mut seed = 17u64;
        for &(rows, cols) in &[(7, 64), (33, 576), (9, 1536), (5, 640)] {
            let x: Vec<f32> = (0..cols)
                .map(|i| lcg(&mut seed) * (1.0 + (i % 5) as f32))
                .collect();
            for bits in sfx_formats::resident::LUT_BITS {
                let q = random_lut(rows, cols, bits, &mut seed);
                let deq = q.dequantize();
                let lin = LutLinear::new(q, None).unwrap();
                let p = group_q8::Prepared::new(&x, cols, bits);
                let xt = p.acts.dequantized();
                for level in SimdLevel::supported() {
                    let mut y = vec![f32::NAN; rows];
                    if lin.matvec_int8(level, &x, &mut y).is_none() {
                        eprintln!("{level:?}: no int8 kernels at this tier (f32 kernels run)");
                        continue;
                    }
                    assert_rows_match_f64(
                        &deq,
                        &xt,
                        &y,
                        &format!("{level:?} lut{bits} {rows}x{cols}"),
                    );
                }
            }
        }
    }

    /// The f32 decode on every tier, and prefill through panels, against the f64 product of
    /// the dequantized weight with the f32 input.
    #[test]
    fn f32_decode_and_prefill_match_the_dequantized_weight() {
        let mut seed = 5u64;
        for &(rows, cols) in &[(3, 8), (17, 100), (40, 576)] {
            for bits in sfx_formats::resident::LUT_BITS {
                let q = random_lut(rows, cols, bits, &mut seed);
                let deq = q.dequantize();
                let bias: Vec<f32> = (0..rows).map(|_| lcg(&mut seed)).collect();
                let lin = LutLinear::new(q, Some(bias.clone())).unwrap();
                let x: Vec<f32> = (0..cols).map(|_| lcg(&mut seed)).collect();
                for level in SimdLevel::supported() {
                    let mut y = vec![f32::NAN; rows];
                    lin.matvec(level, &x, &mut y);
                    assert_rows_match_f64(&deq, &x, &y, &format!("{level:?} lut{bits} f32"));
                }
                let m = 5;
                let xs: Vec<f32> = (0..m * cols).map(|_| lcg(&mut seed)).collect();
                let backend = CpuBackend::new();
                let mut y = CpuBuffer(vec![f32::NAN; m * rows]);
                lin.forward(&backend, &CpuBuffer(xs.clone()), m, &mut y)
                    .unwrap();
                for t in 0..m {
                    let yt: Vec<f32> = (0..rows).map(|r| y.0[t * rows + r] - bias[r]).collect();
                    let xt = &xs[t * cols..(t + 1) * cols];
                    assert_rows_match_f64(&deq, xt, &yt, &format!("lut{bits} prefill token {t}"));
                }
            }
        }
    }

    #[test]
    fn gathered_rows_are_the_dequantized_rows_and_bad_ids_are_named() {
        let mut seed = 3u64;
        let q = random_lut(6, 16, 3, &mut seed);
        let deq = q.dequantize();
        let lin = LutLinear::new(q, None).unwrap();
        let backend = CpuBackend::new();
        let mut out = CpuBuffer(vec![f32::NAN; 2 * 16]);
        lin.gather_rows(&backend, &CpuIndex(vec![5, 0]), &mut out)
            .unwrap();
        let got = &out.0;
        assert_eq!(&got[..16], &deq[5 * 16..6 * 16]);
        assert_eq!(&got[16..], &deq[..16]);
        let err = lin
            .gather_rows(&backend, &CpuIndex(vec![6]), &mut out)
            .unwrap_err();
        assert!(err.to_string().contains('6'), "{err}");
        assert!(LutLinear::new(lin.weight().clone(), Some(vec![0.0; 5])).is_err());
    }
}

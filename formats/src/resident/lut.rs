//! [`LutQuantized`]: non-uniform codes with one look-up table per output row (SqueezeLLM's
//! and GuidedQuant/LNQ's resident format).
//!
//! Weight `ŵ[r, i] = scale[r] · table[r, q[r, i]]`:
//! - codes `q` are `bits` wide (2, 3 or 4) and packed exactly like [`super::GroupQuantized`]'s
//!   (rows one after another, `ceil(cols·bits/8)` bytes each, one little-endian bit stream a
//!   row), so the unpacking of the group kernels serves both formats;
//! - `table[r, ·]` is `2^bits` signed 8-bit levels (row-major `[rows, 2^bits]`) and `scale[r]`
//!   one f16 per row. The quantizer fits real-valued centroids and snaps them to this grid:
//!   with 16 centroids spread over 255 levels the snap moves a centroid by ≤ 1/254 of the row's
//!   range, far below the spacing between centroids, and it makes the decode an integer dot
//!   product (the level as an unsigned byte `level + 128` against int8 activations, the 128
//!   subtracted once per row through the activations' sum), as fast as group codes.

use super::{get_code, invalid, ResidentError};
use half::f16;

/// Code widths of the look-up-table format.
pub const LUT_BITS: [u8; 3] = [2, 3, 4];

/// Per-row look-up-table codes `[rows (out), cols (in)]`; layout in the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct LutQuantized {
    bits: u8,
    rows: usize,
    cols: usize,
    codes: Vec<u8>,
    tables: Vec<i8>,
    scales: Vec<f16>,
}

/// A row's weight values by code: each of its `levels` (2^bits int8 levels) times its f16
/// scale, in f32; entries past the levels are 0: the f32 CPU kernel, the dequantization and
/// the CUDA kernels' tables all take these.
#[inline]
pub fn row_values(levels: &[i8], scale: f16) -> [f32; 16] {
    let s = scale.to_f32();
    let mut values = [0.0f32; 16];
    for (v, &t) in values.iter_mut().zip(levels) {
        *v = f32::from(t) * s;
    }
    values
}

impl LutQuantized {
    /// Wraps already-packed parts, validating every size (bits in [`LUT_BITS`], byte counts
    /// without overflow, `2^bits` levels and one finite non-negative scale per row).
    pub fn from_parts(
        bits: u8,
        rows: usize,
        cols: usize,
        codes: Vec<u8>,
        tables: Vec<i8>,
        scales: Vec<f16>,
    ) -> Result<Self, ResidentError> {
        let (code_bytes, levels) = Self::sizes(bits, rows, cols)?;
        if codes.len() != code_bytes {
            return invalid(format!(
                "{} code bytes, expected {code_bytes} for {rows}×{cols} at {bits} bits",
                codes.len()
            ));
        }
        if tables.len() != levels {
            return invalid(format!(
                "{} table levels, expected {levels} ({rows} rows × {} levels)",
                tables.len(),
                1usize << bits
            ));
        }
        if scales.len() != rows {
            return invalid(format!("{} row scales, expected {rows}", scales.len()));
        }
        if let Some(s) = scales.iter().find(|s| !s.is_finite() || s.to_f32() < 0.0) {
            return invalid(format!("row scale {s} is not a finite non-negative number"));
        }
        Ok(Self {
            bits,
            rows,
            cols,
            codes,
            tables,
            scales,
        })
    }

    /// `(code bytes, table levels)` of a `rows × cols` matrix at `bits`, or why the
    /// dimensions are unusable.
    pub fn sizes(bits: u8, rows: usize, cols: usize) -> Result<(usize, usize), ResidentError> {
        if !LUT_BITS.contains(&bits) {
            return invalid(format!(
                "{bits}-bit look-up-table codes (supported: 2, 3, 4)"
            ));
        }
        if rows == 0 || cols == 0 {
            return invalid(format!("empty matrix {rows} × {cols}"));
        }
        let code_bytes = cols
            .checked_mul(usize::from(bits))
            .map(|b| b.div_ceil(8))
            .and_then(|rb| rb.checked_mul(rows));
        let levels = rows.checked_mul(1 << bits);
        match (code_bytes, levels) {
            (Some(c), Some(l)) => Ok((c, l)),
            _ => invalid(format!("{rows} × {cols} overflows")),
        }
    }

    pub fn bits(&self) -> u8 {
        self.bits
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn codes(&self) -> &[u8] {
        &self.codes
    }
    /// Row-major `[rows, 2^bits]` levels.
    pub fn tables(&self) -> &[i8] {
        &self.tables
    }
    pub fn scales(&self) -> &[f16] {
        &self.scales
    }
    /// Levels per row: `2^bits`.
    pub fn levels(&self) -> usize {
        1 << self.bits
    }
    /// Bytes of one packed row.
    pub fn row_bytes(&self) -> usize {
        (self.cols * usize::from(self.bits)).div_ceil(8)
    }

    /// Resident bytes: codes + int8 tables + f16 row scales.
    pub fn size_in_bytes(&self) -> usize {
        self.codes.len() + self.tables.len() + 2 * self.scales.len()
    }

    /// Storage cost per weight, tables and scales included (4 bits on 576 columns:
    /// 4 + (16 + 2)·8/576 = 4.25).
    pub fn bits_per_weight(&self) -> f64 {
        (8 * self.size_in_bytes()) as f64 / (self.rows * self.cols) as f64
    }

    /// Writes the dequantized row `row` into `out` (`cols` values).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) -> Result<(), ResidentError> {
        if row >= self.rows || out.len() != self.cols {
            return invalid(format!(
                "dequantize_row({row}) into {} values of a {} × {} matrix",
                out.len(),
                self.rows,
                self.cols
            ));
        }
        let rb = self.row_bytes();
        let codes = &self.codes[row * rb..(row + 1) * rb];
        let n = self.levels();
        // Prefill dequantizes rows panel by panel: no allocation per row.
        let values = row_values(&self.tables[row * n..(row + 1) * n], self.scales[row]);
        for (i, o) in out.iter_mut().enumerate() {
            *o = values[usize::from(get_code(codes, i, self.bits))];
        }
        Ok(())
    }

    /// The whole dequantized matrix, row-major (tests, reference paths, the refinement's
    /// residual).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
            // Cannot fail: row < rows and row.len() == cols.
            let _ = self.dequantize_row(r, row);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resident::put_code;

    fn tiny() -> LutQuantized {
        // 2 rows × 8 columns at 2 bits: row 0 codes 0..3 twice, row 1 reversed.
        let mut codes = vec![0u8; 4];
        for i in 0..8 {
            put_code(&mut codes[..2], i, 2, (i % 4) as u8);
            put_code(&mut codes[2..], i, 2, (3 - i % 4) as u8);
        }
        LutQuantized::from_parts(
            2,
            2,
            8,
            codes,
            vec![-100, -10, 20, 127, -128, 0, 1, 2],
            vec![f16::from_f32(0.5), f16::from_f32(2.0)],
        )
        .unwrap()
    }

    #[test]
    fn dequantizes_through_each_rows_table_and_scale() {
        let q = tiny();
        let d = q.dequantize();
        assert_eq!(&d[..4], &[-50.0, -5.0, 10.0, 63.5]);
        assert_eq!(&d[8..12], &[4.0, 2.0, 0.0, -256.0]);
        assert_eq!(q.size_in_bytes(), 4 + 8 + 4);
        assert_eq!(q.bits_per_weight(), 16.0 * 8.0 / 16.0);
    }

    #[test]
    fn bad_parts_are_named() {
        let q = tiny();
        let parts = |codes: usize, tables: usize, scales: Vec<f16>| {
            LutQuantized::from_parts(2, 2, 8, vec![0; codes], vec![0; tables], scales)
                .unwrap_err()
                .to_string()
        };
        let ok_scales = q.scales().to_vec();
        assert!(parts(3, 8, ok_scales.clone()).contains("code bytes"));
        assert!(parts(4, 7, ok_scales.clone()).contains("table levels"));
        assert!(parts(4, 8, vec![f16::ONE]).contains("row scales"));
        assert!(parts(4, 8, vec![f16::ONE, f16::NAN]).contains("not a finite"));
        assert!(parts(4, 8, vec![f16::ONE, f16::from_f32(-1.0)]).contains("not a finite"));
        let e = LutQuantized::from_parts(6, 2, 8, vec![], vec![], vec![]).unwrap_err();
        assert!(e.to_string().contains("6-bit"));
        let e = LutQuantized::sizes(4, usize::MAX, usize::MAX).unwrap_err();
        assert!(e.to_string().contains("overflows"));
        let e = LutQuantized::sizes(4, 0, 8).unwrap_err();
        assert!(e.to_string().contains("empty"));
        let mut out = vec![0.0; 7];
        assert!(q.dequantize_row(0, &mut out).is_err());
        assert!(q.dequantize_row(2, &mut [0.0; 8]).is_err());
    }
}

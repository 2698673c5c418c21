//! Resident (fast-tier) weight layouts shared by the converter, the `.sfx` container and the
//! runtime kernels. Only data and its encoding live here; quantizers that *choose* the grid
//! (RTN, AWQ's scale/clip search) live in `sfx-calibration`, kernels in `sfx-runtime`.
//!
//! [`GroupQuantized`]: asymmetric integer codes with one f16 scale and one integer zero point
//! per group of `group_size` consecutive input channels (AWQ / RTN "g128").
//!
//! Code layout (chosen for the CPU decode matvec, which walks one row at a time):
//! - rows are stored one after another, each `row_bytes() = ceil(cols·bits / 8)` bytes, so a
//!   row block is one contiguous stream for a thread;
//! - within a row the codes form one little-endian bit stream: code `i` occupies bits
//!   `i·bits .. (i+1)·bits` counted from bit 0 of byte 0 (4-bit: even column in the low
//!   nibble; 3-bit: 8 codes per 3 bytes; 2-bit: 4 codes per byte, column 0 in bits 0–1);
//! - `group_size` is a multiple of 8, so every group starts on a byte boundary and every
//!   8 codes are exactly `bits` whole bytes — the kernel unpacks 8 codes from one
//!   `bits`-byte load. The last group of a row may be shorter (`cols` need not be a multiple
//!   of `group_size`: SmolLM2's 576 = 4·128 + 64).
//!
//! Scales and zero points are row-major `[rows, groups_per_row()]`. Dequantized weight:
//! `ŵ[r, i] = (q[r, i] − zero[r, g]) · scale[r, g]` with `g = i / group_size`.

use half::f16;

pub mod lut;
pub mod trellis;
pub use lut::{LutQuantized, LUT_BITS};
pub use trellis::{
    hadamard_section, trellis_sections, Rotation, SmallHadamard, TileOrder, TrellisCode,
    TrellisParts, TrellisQuantized, TrellisScheme, TILE_SIDE, TILE_WEIGHTS, TLUT_SECTION,
};

/// Default quantization group (AWQ, RTN): 128 input channels.
pub const DEFAULT_GROUP_SIZE: usize = 128;

/// Code widths with kernels on every backend: 2–4 bits for the decoder's projections, 6 and
/// 8 for the output head and embedding (`sfx-convert --head q6|q8`), where the extra bits are
/// cheap next to what they buy (the head is one matrix but its errors reach every logit).
pub const SUPPORTED_BITS: [u8; 5] = [2, 3, 4, 6, 8];

/// Errors from building or validating a resident layout. Never a panic on bad dimensions.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ResidentError {
    #[error("resident layout: {0}")]
    Invalid(String),
}

fn invalid<T>(msg: impl Into<String>) -> Result<T, ResidentError> {
    Err(ResidentError::Invalid(msg.into()))
}

/// Group-wise asymmetric integer weights `[rows (out), cols (in)]`; layout in the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupQuantized {
    bits: u8,
    group_size: usize,
    rows: usize,
    cols: usize,
    codes: Vec<u8>,
    scales: Vec<f16>,
    zeros: Vec<u8>,
}

impl GroupQuantized {
    /// Wraps already-packed parts, validating every size (bits in [`SUPPORTED_BITS`], group a non-zero
    /// multiple of 8, byte and group counts without overflow, zero points within the code
    /// range, finite non-negative scales).
    pub fn from_parts(
        bits: u8,
        group_size: usize,
        rows: usize,
        cols: usize,
        codes: Vec<u8>,
        scales: Vec<f16>,
        zeros: Vec<u8>,
    ) -> Result<Self, ResidentError> {
        let (row_bytes, groups) = Self::check_dims(bits, group_size, rows, cols)?;
        let want_codes = row_bytes.checked_mul(rows);
        let want_groups = groups.checked_mul(rows);
        let (Some(want_codes), Some(want_groups)) = (want_codes, want_groups) else {
            return invalid(format!("{rows} × {cols} overflows"));
        };
        if codes.len() != want_codes {
            return invalid(format!(
                "{} code bytes, expected {want_codes} for {rows}×{cols} at {bits} bits",
                codes.len()
            ));
        }
        if scales.len() != want_groups || zeros.len() != want_groups {
            return invalid(format!(
                "{} scales / {} zero points, expected {want_groups} ({rows} rows × {groups} groups)",
                scales.len(),
                zeros.len()
            ));
        }
        let qmax = (1u16 << bits) - 1;
        if let Some(z) = zeros.iter().find(|&&z| u16::from(z) > qmax) {
            return invalid(format!("zero point {z} exceeds the {bits}-bit code range"));
        }
        if let Some(s) = scales.iter().find(|s| !s.is_finite() || s.to_f32() < 0.0) {
            return invalid(format!("scale {s} is not a finite non-negative number"));
        }
        Ok(Self {
            bits,
            group_size,
            rows,
            cols,
            codes,
            scales,
            zeros,
        })
    }

    /// Returns `(row_bytes, groups_per_row)` or why the dimensions are unusable.
    fn check_dims(
        bits: u8,
        group_size: usize,
        rows: usize,
        cols: usize,
    ) -> Result<(usize, usize), ResidentError> {
        if !SUPPORTED_BITS.contains(&bits) {
            return invalid(format!("{bits} bits per code (supported: 2, 3, 4, 6, 8)"));
        }
        if group_size == 0 || !group_size.is_multiple_of(8) {
            return invalid(format!(
                "group size {group_size} is not a positive multiple of 8"
            ));
        }
        if rows == 0 || cols == 0 {
            return invalid(format!("empty matrix {rows} × {cols}"));
        }
        let Some(row_bits) = cols.checked_mul(bits as usize) else {
            return invalid(format!("{cols} columns overflow"));
        };
        Ok((row_bits.div_ceil(8), cols.div_ceil(group_size)))
    }

    /// Quantizes row-major f32 `weights` (`[rows, cols]`): `grid(group_values, bits)` picks each
    /// group's `(scale, zero)`, then `q = clamp(round(w / scale) + zero, 0, 2^bits − 1)`
    /// (round half away from zero, as `f32::round`). Deterministic; rows in order.
    pub fn quantize_with(
        weights: &[f32],
        rows: usize,
        cols: usize,
        bits: u8,
        group_size: usize,
        mut grid: impl FnMut(&[f32], u8) -> (f16, u8),
    ) -> Result<Self, ResidentError> {
        let (row_bytes, groups) = Self::check_dims(bits, group_size, rows, cols)?;
        if rows.checked_mul(cols) != Some(weights.len()) {
            return invalid(format!(
                "{} weights for a {rows} × {cols} matrix",
                weights.len()
            ));
        }
        if let Some(i) = weights.iter().position(|w| !w.is_finite()) {
            return invalid(format!("weight [{}, {}] is not finite", i / cols, i % cols));
        }
        let qmax = ((1u16 << bits) - 1) as f32;
        let mut codes = vec![0u8; rows * row_bytes];
        let mut scales = Vec::with_capacity(rows * groups);
        let mut zeros = Vec::with_capacity(rows * groups);
        for (row, out) in weights
            .chunks_exact(cols)
            .zip(codes.chunks_exact_mut(row_bytes))
        {
            for (g, vals) in row.chunks(group_size).enumerate() {
                let (scale, zero) = grid(vals, bits);
                let s = scale.to_f32();
                let z = f32::from(zero);
                for (j, &w) in vals.iter().enumerate() {
                    let q = if s > 0.0 {
                        ((w / s).round() + z).clamp(0.0, qmax)
                    } else {
                        z
                    } as u8;
                    put_code(out, g * group_size + j, bits, q);
                }
                scales.push(scale);
                zeros.push(zero);
            }
        }
        Self::from_parts(bits, group_size, rows, cols, codes, scales, zeros)
    }

    pub fn bits(&self) -> u8 {
        self.bits
    }
    pub fn group_size(&self) -> usize {
        self.group_size
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
    pub fn scales(&self) -> &[f16] {
        &self.scales
    }
    pub fn zeros(&self) -> &[u8] {
        &self.zeros
    }
    /// Bytes of one packed row.
    pub fn row_bytes(&self) -> usize {
        (self.cols * self.bits as usize).div_ceil(8)
    }
    pub fn groups_per_row(&self) -> usize {
        self.cols.div_ceil(self.group_size)
    }

    /// Code of weight `[row, col]`; `None` out of range.
    pub fn code(&self, row: usize, col: usize) -> Option<u8> {
        if row >= self.rows || col >= self.cols {
            return None;
        }
        let rb = self.row_bytes();
        Some(get_code(
            &self.codes[row * rb..(row + 1) * rb],
            col,
            self.bits,
        ))
    }

    /// Resident bytes: codes + f16 scales + u8 zero points.
    pub fn size_in_bytes(&self) -> usize {
        self.codes.len() + 2 * self.scales.len() + self.zeros.len()
    }

    /// Exact storage cost per weight, scales and zero points included
    /// (4-bit g128 on 576 columns: 4 + (16 + 8)·5/576 = 4.208).
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
        let gpr = self.groups_per_row();
        for (g, chunk) in out.chunks_mut(self.group_size).enumerate() {
            let s = self.scales[row * gpr + g].to_f32();
            let z = f32::from(self.zeros[row * gpr + g]);
            for (j, o) in chunk.iter_mut().enumerate() {
                let q = f32::from(get_code(codes, g * self.group_size + j, self.bits));
                *o = (q - z) * s;
            }
        }
        Ok(())
    }

    /// The whole dequantized matrix, row-major (tests, reference paths).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
            // Cannot fail: row < rows and row.len() == cols.
            let _ = self.dequantize_row(r, row);
        }
        out
    }
}

/// Code `i` of a little-endian bit stream of `bits`-bit codes.
#[inline]
pub fn get_code(stream: &[u8], i: usize, bits: u8) -> u8 {
    let bit = i * bits as usize;
    let (byte, shift) = (bit / 8, bit % 8);
    let lo = u16::from(stream[byte]);
    let hi = stream.get(byte + 1).map_or(0, |&b| u16::from(b));
    (((lo | (hi << 8)) >> shift) & ((1u16 << bits) - 1)) as u8
}

/// Stores code `i` (its low `bits` bits) into a zero-initialised little-endian bit stream.
#[inline]
pub fn put_code(stream: &mut [u8], i: usize, bits: u8, q: u8) {
    let bit = i * bits as usize;
    let (byte, shift) = (bit / 8, bit % 8);
    let mask = (1u16 << bits) - 1;
    let v = (u16::from(q) & mask) << shift;
    stream[byte] |= v as u8;
    if v >> 8 != 0 {
        stream[byte + 1] |= (v >> 8) as u8;
    }
}

/// The smallest f16 that is ≥ `x` (for positive finite `x` within f16 range): rounding a
/// scale *up* keeps the whole `[min, max]` range on the grid, so the rounding error stays
/// ≤ scale/2.
pub fn f16_round_up(x: f32) -> f16 {
    let h = f16::from_f32(x);
    if h.to_f32() >= x || !h.is_finite() {
        h
    } else {
        f16::from_bits(h.to_bits() + 1)
    }
}

/// The round-to-nearest grid of one group (llm-awq `pseudo_quantize_tensor`, with the range
/// widened to contain 0 as GPTQ does, so an all-positive group stays on the grid):
/// `min' = min(min, 0)`, `max' = max(max, 0)`, `scale = max((max' − min') / (2^bits − 1), 1e-5)`
/// rounded *up* to f16, `zero = clamp(round(−min' / scale), 0, 2^bits − 1)`.
/// Every value of the group then reconstructs within `scale / 2`.
pub fn minmax_grid(values: &[f32], bits: u8) -> (f16, u8) {
    let qmax = ((1u32 << bits) - 1) as f32;
    let (lo, hi) = values
        .iter()
        .fold((0.0f32, 0.0f32), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    let scale = f16_round_up(((hi - lo) / qmax).max(1e-5));
    let zero = (-lo / scale.to_f32()).round().clamp(0.0, qmax) as u8;
    (scale, zero)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bit_stream_round_trips_for_all_widths() {
        for bits in SUPPORTED_BITS {
            let n = 37;
            let code = |i: usize| ((i * 37 + 11) % (1usize << bits)) as u8;
            let mut s = vec![0u8; (n * bits as usize).div_ceil(8)];
            for i in 0..n {
                put_code(&mut s, i, bits, code(i));
            }
            for i in 0..n {
                assert_eq!(get_code(&s, i, bits), code(i), "{bits} bits, code {i}");
            }
        }
        // 8-bit: one byte per code; 6-bit: code 1 starts at bit 6 of byte 0.
        let mut s = vec![0u8; 2];
        put_code(&mut s, 0, 8, 0xC5);
        put_code(&mut s, 1, 8, 0x3A);
        assert_eq!(s, [0xC5, 0x3A]);
        let mut s = vec![0u8; 2];
        put_code(&mut s, 1, 6, 0b10_1101);
        assert_eq!(s, [0b0100_0000, 0b0000_1011]);
        // 4-bit: even column in the low nibble.
        let mut s = vec![0u8; 1];
        put_code(&mut s, 0, 4, 0x3);
        put_code(&mut s, 1, 4, 0xA);
        assert_eq!(s, [0xA3]);
    }

    #[test]
    fn rejects_bad_dimensions_without_panicking() {
        let q = |bits, g, r, c, codes: usize, groups: usize| {
            GroupQuantized::from_parts(
                bits,
                g,
                r,
                c,
                vec![0; codes],
                vec![f16::ONE; groups],
                vec![0; groups],
            )
        };
        assert!(q(4, 128, 2, 576, 576, 10).is_ok());
        assert!(q(5, 128, 2, 576, 720, 10).is_err());
        assert!(q(4, 100, 2, 576, 576, 12).is_err());
        assert!(q(4, 0, 2, 576, 576, 10).is_err());
        assert!(q(4, 128, 0, 576, 0, 0).is_err());
        assert!(q(4, 128, 2, 576, 575, 10).is_err());
        assert!(q(4, 128, 2, 576, 576, 9).is_err());
        assert!(q(4, 128, usize::MAX, usize::MAX, 0, 0).is_err());
        assert!(
            GroupQuantized::from_parts(2, 8, 1, 8, vec![0; 2], vec![f16::ONE], vec![4]).is_err()
        );
        assert!(
            GroupQuantized::quantize_with(&[0.0; 5], 2, 3, 4, 8, |_, _| (f16::ONE, 0)).is_err()
        );
        assert!(
            GroupQuantized::quantize_with(&[f32::NAN; 6], 2, 3, 4, 8, |_, _| (f16::ONE, 0))
                .is_err()
        );
    }

    #[test]
    fn bits_per_weight_counts_scales_and_zeros() {
        let g = GroupQuantized::quantize_with(&vec![0.5; 2 * 576], 2, 576, 4, 128, |_, _| {
            (f16::ONE, 0)
        })
        .unwrap();
        assert_eq!(g.size_in_bytes(), 2 * 288 + 2 * 5 * 3);
        assert!((g.bits_per_weight() - (4.0 + 24.0 * 5.0 / 576.0)).abs() < 1e-12);
        let g3 = GroupQuantized::quantize_with(&vec![0.5; 3 * 576], 3, 576, 3, 128, |_, _| {
            (f16::ONE, 0)
        })
        .unwrap();
        assert_eq!(g3.row_bytes(), 216);
    }
}

//! Block decoders of llama.cpp's "i-quants": IQ4_NL and IQ4_XS (4-bit codes into a fixed
//! non-linear table) and IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (indices into lattice grids,
//! [`super::iq_grids`], with one sign bit per weight).
//!
//! Layouts are ggml-common.h's `block_iq*` structs, restated above each decoder. Every value is
//! `scale × table entry × ±1`, evaluated in the order of ggml's `dequantize_row_iq*` and of
//! gguf-py's `dequantize_blocks`: the sub-block scale is formed first (an f16 times a small
//! integer or half-integer, exact in f32), then one multiply by the table entry, the only
//! rounding; the sign flip is exact. So the results are bit-identical to both references
//! (checked against gguf-py's output in `tests/fixtures/iq_dequant_reference.json`).

use super::iq_grids::{IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID};
use half::f16;

/// IQ4_NL/IQ4_XS code → value: ggml's `kvalues_iq4nl`, a format constant (the 16 levels the
/// format defines, tuned by its author for Gaussian-like weights).
pub const IQ4_NL_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

#[inline]
fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

#[inline]
fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// The 8 signs of a group from its 7 stored bits: the 8th makes the count of minus signs
/// even (ggml's `ksigns_iq2xs` table is exactly this). Bit j set = element j negative.
#[inline]
fn signs_from_7(bits: u32) -> u8 {
    let s = bits & 0x7F;
    (s | ((s.count_ones() & 1) << 7)) as u8
}

/// Writes `scale × grid[j] × ±1` for the `n` bytes of grid point `point` (value j in byte j).
#[inline]
fn put_grid(y: &mut [f32], scale: f32, point: u64, signs: u8, n: usize) {
    let values = point.to_le_bytes();
    for j in 0..n {
        let v = scale * values[j] as f32;
        y[j] = if signs & (1 << j) != 0 { -v } else { v };
    }
}

/// IQ4_NL (18 B, 32 weights): f16 d; qs[16]. Element j < 16 = low nibble of qs[j], j + 16 =
/// high nibble; x = d·kvalues[q].
pub(super) fn block_iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = d * IQ4_NL_VALUES[(qs[j] & 0x0F) as usize] as f32;
        y[j + 16] = d * IQ4_NL_VALUES[(qs[j] >> 4) as usize] as f32;
    }
}

/// IQ4_XS (136 B, 256 weights): f16 d; u16 scales_h; scales_l[4]; qs[128]. Sub-block ib
/// (32 weights, qs[16ib..16ib+16] as IQ4_NL) has the 6-bit scale ls = nibble ib%2 of
/// scales_l[ib/2] | bits 2ib..2ib+1 of scales_h << 4; x = (d·(ls − 32))·kvalues[q].
pub(super) fn block_iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let scales_h = u16_at(b, 2);
    let scales_l = &b[4..8];
    let qs = &b[8..136];
    for ib in 0..8 {
        let low = (scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0F;
        let high = ((scales_h >> (2 * ib)) & 3) as u8;
        let dl = d * ((low | (high << 4)) as i32 - 32) as f32;
        let q = &qs[16 * ib..16 * ib + 16];
        let y = &mut y[32 * ib..32 * ib + 32];
        for j in 0..16 {
            y[j] = dl * IQ4_NL_VALUES[(q[j] & 0x0F) as usize] as f32;
            y[j + 16] = dl * IQ4_NL_VALUES[(q[j] >> 4) as usize] as f32;
        }
    }
}

/// IQ2_XXS (66 B): f16 d; qs as 8 pairs of u32 (a, b), one pair per 32 weights. The bytes of
/// a index 4 points of [`IQ2XXS_GRID`] (8 weights each); b holds four 7-bit sign groups
/// (bits 7l..7l+6) and the 4-bit scale s (bits 28–31); x = d·(0.5 + s)·0.25·grid·±1.
pub(super) fn block_iq2_xxs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for ib in 0..8 {
        let at = 2 + 8 * ib;
        let idx = &b[at..at + 4];
        let aux = u32_at(b, at + 4);
        let db = d * (0.5 + (aux >> 28) as f32) * 0.25;
        for l in 0..4 {
            let signs = signs_from_7(aux >> (7 * l));
            let y = &mut y[32 * ib + 8 * l..];
            put_grid(y, db, IQ2XXS_GRID[idx[l] as usize], signs, 8);
        }
    }
}

/// IQ2_XS (74 B): f16 d; u16 qs[32]; scales[8]. qs[4ib + l] = 9-bit index into
/// [`IQ2XS_GRID`] | 7 sign bits << 9; groups l = 0, 1 take the low nibble of scales[ib],
/// l = 2, 3 the high one; x = d·(0.5 + s)·0.25·grid·±1.
pub(super) fn block_iq2_xs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let scales = &b[66..74];
    for ib in 0..8 {
        let db = [
            d * (0.5 + (scales[ib] & 0x0F) as f32) * 0.25,
            d * (0.5 + (scales[ib] >> 4) as f32) * 0.25,
        ];
        for l in 0..4 {
            let q = u16_at(b, 2 + 2 * (4 * ib + l));
            let signs = signs_from_7((q >> 9) as u32);
            let y = &mut y[32 * ib + 8 * l..];
            put_grid(y, db[l / 2], IQ2XS_GRID[(q & 511) as usize], signs, 8);
        }
    }
}

/// IQ2_S (82 B): f16 d; qs[32] (low 8 bits of the indices); signs[32] (8 explicit sign bits
/// per group); qh[8] (bits 2l..2l+1 of qh[ib] = index bits 8–9 of group l); scales[8] as
/// IQ2_XS. Index into [`IQ2S_GRID`]; x = d·(0.5 + s)·0.25·grid·±1.
pub(super) fn block_iq2_s(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..34];
    let signs = &b[34..66];
    let qh = &b[66..74];
    let scales = &b[74..82];
    for ib in 0..8 {
        let db = [
            d * (0.5 + (scales[ib] & 0x0F) as f32) * 0.25,
            d * (0.5 + (scales[ib] >> 4) as f32) * 0.25,
        ];
        for l in 0..4 {
            let g = 4 * ib + l;
            let idx = qs[g] as usize | ((((qh[ib] >> (2 * l)) & 3) as usize) << 8);
            put_grid(&mut y[8 * g..], db[l / 2], IQ2S_GRID[idx], signs[g], 8);
        }
    }
}

/// IQ3_XXS (98 B): f16 d; qs[64] (indices into [`IQ3XXS_GRID`], 4 weights each); u32[8]
/// scales-and-signs, one per 32 weights: four 7-bit sign groups of 8 weights (bits 7l..) and
/// the 4-bit scale s (bits 28–31); x = d·(0.5 + s)·0.5·grid·±1.
pub(super) fn block_iq3_xxs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..66];
    for ib in 0..8 {
        let aux = u32_at(b, 66 + 4 * ib);
        let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
        for l in 0..4 {
            let signs = signs_from_7(aux >> (7 * l));
            let q = &qs[8 * ib + 2 * l..];
            let y = &mut y[32 * ib + 8 * l..];
            put_grid(y, db, IQ3XXS_GRID[q[0] as usize] as u64, signs, 4);
            put_grid(
                &mut y[4..],
                db,
                IQ3XXS_GRID[q[1] as usize] as u64,
                signs >> 4,
                4,
            );
        }
    }
}

/// IQ3_S (110 B): f16 d; qs[64] (low 8 bits of the indices into [`IQ3S_GRID`], 4 weights
/// each); qh[8] (bit k of qh[ib] = index bit 8 of point k of sub-block ib); signs[32] (8
/// explicit bits per 8 weights); scales[4] (nibble ib%2 of scales[ib/2] = s of sub-block ib);
/// x = d·(1 + 2s)·grid·±1.
pub(super) fn block_iq3_s(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..66];
    let qh = &b[66..74];
    let signs = &b[74..106];
    let scales = &b[106..110];
    for ib in 0..8 {
        let s = (scales[ib / 2] >> (4 * (ib % 2))) & 0x0F;
        let db = d * (1 + 2 * s as i32) as f32;
        for k in 0..8 {
            let idx = qs[8 * ib + k] as usize | ((((qh[ib] >> k) & 1) as usize) << 8);
            let sign = signs[4 * ib + k / 2] >> (4 * (k % 2));
            put_grid(
                &mut y[32 * ib + 4 * k..],
                db,
                IQ3S_GRID[idx] as u64,
                sign,
                4,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    //! Hand-built blocks whose values follow from the layout text alone; the bit-exact check
    //! against gguf-py on random blocks is `formats/tests/gguf_iq_reference.rs`.
    use super::*;

    fn h(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    #[test]
    fn sign_groups_have_even_parity() {
        // ggml's ksigns_iq2xs begins 0x00, 0x81, 0x82, 0x03, 0x84 and ends 0x7e, 0xff.
        let first: Vec<u8> = (0..5).map(signs_from_7).collect();
        assert_eq!(first, [0x00, 0x81, 0x82, 0x03, 0x84]);
        assert_eq!(signs_from_7(126), 0x7E);
        assert_eq!(signs_from_7(127), 0xFF);
        // Only the low 7 bits count.
        assert_eq!(signs_from_7(0x80 | 1), 0x81);
    }

    #[test]
    fn iq4_nl_nibbles_index_the_table() {
        let mut b = vec![0u8; 18];
        b[..2].copy_from_slice(&h(0.5));
        b[2] = 0xF0; // element 0 → code 0 (−127), element 16 → code 15 (113)
        b[17] = 0x98; // element 15 → code 8 (1), element 31 → code 9 (13)
        let mut y = [0f32; 32];
        block_iq4_nl(&b, &mut y);
        assert_eq!((y[0], y[16], y[15], y[31]), (-63.5, 56.5, 0.5, 6.5));
        assert_eq!(y[1], -63.5);
    }

    #[test]
    fn iq4_xs_six_bit_scales() {
        let mut b = vec![0u8; 136];
        b[..2].copy_from_slice(&h(0.25));
        // Sub-block 3: low nibble = high nibble of scales_l[1] = 5, high bits = bits 6–7 of
        // scales_h = 2 → ls = 37, scale = 5·0.25.
        b[2..4].copy_from_slice(&(2u16 << 6).to_le_bytes());
        b[5] = 0x50;
        b[8 + 16 * 3] = 0x0F; // element 96 → code 15, element 112 → code 0
        let mut y = [0f32; 256];
        block_iq4_xs(&b, &mut y);
        assert_eq!(y[96], 1.25 * 113.0);
        assert_eq!(y[112], 1.25 * -127.0);
        // Sub-block 0: every field zero → ls = 0 → scale −32·0.25 = −8; code 0 → −127.
        assert_eq!(y[0], 8.0 * 127.0);
    }

    #[test]
    fn iq2_xxs_grid_scale_and_signs() {
        let mut b = vec![0u8; 66];
        b[..2].copy_from_slice(&h(1.0));
        // Sub-block 1: point 1 of group 0 is grid entry 1 = 0x080808080808082b; scale nibble
        // 3 → db = 3.5·0.25; sign group 0 = 1 → element 0 negative, and element 7 (parity).
        b[2 + 8] = 1;
        let aux: u32 = (3 << 28) | 1;
        b[2 + 12..2 + 16].copy_from_slice(&aux.to_le_bytes());
        let mut y = [0f32; 256];
        block_iq2_xxs(&b, &mut y);
        let db = 3.5 * 0.25;
        assert_eq!(y[32], -db * 0x2B as f32);
        assert_eq!(y[33], db * 8.0);
        assert_eq!(y[39], -db * 8.0);
        // Sub-block 0 is all zero: scale 0.5·0.25, grid entry 0 (all 8), no signs.
        assert_eq!(y[0], 0.125 * 8.0);
    }

    #[test]
    fn iq3_s_high_bit_and_odd_scale() {
        let mut b = vec![0u8; 110];
        b[..2].copy_from_slice(&h(0.5));
        // Sub-block 1 (high nibble of scales[0] = 2 → 1 + 4 = 5), point 2 (elements 40–43):
        // qs = 0 with qh bit 2 set → grid entry 256; signs[4 + 1] low nibble bit 0 → element 40
        // negative.
        b[106] = 0x20;
        b[66 + 1] = 1 << 2;
        b[74 + 5] = 0x01;
        let mut y = [0f32; 256];
        block_iq3_s(&b, &mut y);
        let point = IQ3S_GRID[256].to_le_bytes();
        assert_eq!(y[40], -2.5 * point[0] as f32);
        assert_eq!(y[41], 2.5 * point[1] as f32);
        assert_eq!(y[0], 0.5 * IQ3S_GRID[0].to_le_bytes()[0] as f32);
    }
}

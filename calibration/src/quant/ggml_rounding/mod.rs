//! llama.cpp's rounding of float rows into its block types, without an importance matrix: the
//! reference path `llama-quantize` takes for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K … Q6_K.
//!
//! The aim is byte-identical blocks, so every expression keeps ggml's f32 operation order
//! (`a*b*c` is `(a*b)*c`, an `int` operand is converted to f32 where C converts it) and its
//! integer conversions (truncating float → int8, wrapping int → uint8). ggml compiles these
//! functions without FMA contraction, and Rust never contracts, so the f32 results agree bit
//! for bit. Block layouts are ggml's (`ggml-common.h`); [`sfx_formats::gguf::dequantize`]
//! reads them back. The algorithms (llama.cpp, MIT licence):
//!
//! - Q4_0 / Q5_0 / Q8_0: one f16 scale per 32 weights from the block's signed absolute maximum
//!   (Q8_0: its magnitude), codes by truncation or rounding.
//! - Q4_1 / Q5_1: scale and minimum from the block's range.
//! - Q2_K / Q4_K / Q5_K: per sub-block (16 or 32 weights) an affine fit searched over `nstep`
//!   candidate scales minimising a weighted error (`make_qkx_quants`); sub-block scales and
//!   minimums are themselves quantized to 4 (Q2_K) or 6 bits against two f16 super-scales, and
//!   the codes are recomputed against the quantized scales.
//! - Q3_K: symmetric sub-block scales refined by coordinate descent (`make_q3_quants`), 6-bit
//!   scales against one f16 super-scale.
//! - Q6_K: symmetric sub-block scales searched over 18 candidates (`make_qx_quants`), int8
//!   scales against one f16 super-scale.

mod reference;
mod search;
mod weighted;

use half::f16;
use reference::{q2_k, q3_k, q45_k, q4_0, q4_1, q5_0, q5_1, q6_k, q8_0};
use sfx_formats::gguf::{k_scale_min, q3k_scales, GgmlType, QK_K};
use weighted::{legacy_weighted, q2_k_weighted, q3_k_weighted, q45_k_weighted};

/// Below this a group's maximum counts as zero (ggml's `GROUP_MAX_EPS`).
const GROUP_MAX_EPS: f32 = 1e-15;

/// The block types [`quantize_row`] writes: every type the runtime runs in its blocks.
pub use sfx_runtime::resident::gguf_blocks::BLOCK_TYPES as QUANTIZABLE;

/// Appends the blocks of `x` (a whole number of `ty`'s blocks: one row, or part of one for
/// the unweighted rounding) to `out`. `importance` (one value per element of `x`, llama.cpp's
/// importance matrix for the row's input columns) selects llama.cpp's weighted rounding; Q8_0
/// has none and ignores it. `None` when `ty` is not one of [`QUANTIZABLE`] or the lengths do
/// not fit.
pub fn quantize_row(
    ty: GgmlType,
    x: &[f32],
    importance: Option<&[f32]>,
    out: &mut Vec<u8>,
) -> Option<()> {
    if !QUANTIZABLE.contains(&ty)
        || !x.len().is_multiple_of(ty.block_size())
        || importance.is_some_and(|w| w.len() != x.len())
    {
        return None;
    }
    out.reserve(x.len() / ty.block_size() * ty.type_size());
    let blocks = x.chunks_exact(ty.block_size());
    let Some(importance) = importance.filter(|_| ty != GgmlType::Q8_0) else {
        match ty {
            GgmlType::Q4_0 => blocks.for_each(|b| q4_0(b, out)),
            GgmlType::Q4_1 => blocks.for_each(|b| q4_1(b, out)),
            GgmlType::Q5_0 => blocks.for_each(|b| q5_0(b, out)),
            GgmlType::Q5_1 => blocks.for_each(|b| q5_1(b, out)),
            GgmlType::Q8_0 => blocks.for_each(|b| q8_0(b, out)),
            GgmlType::Q2K => blocks.for_each(|b| q2_k(b, out)),
            GgmlType::Q3K => blocks.for_each(|b| q3_k(b, out)),
            GgmlType::Q4K => blocks.for_each(|b| q45_k(b, 15, -1.0, 20, out)),
            GgmlType::Q5K => blocks.for_each(|b| q45_k(b, 31, -0.5, 15, out)),
            GgmlType::Q6K => blocks.for_each(|b| q6_k(b, None, out)),
            _ => return None,
        }
        return Some(());
    };
    let weighted = blocks.zip(importance.chunks_exact(ty.block_size()));
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => {
            legacy_weighted(ty, x, importance, out)
        }
        GgmlType::Q2K => weighted.for_each(|(b, w)| q2_k_weighted(b, w, out)),
        GgmlType::Q3K => weighted.for_each(|(b, w)| q3_k_weighted(b, w, out)),
        GgmlType::Q4K => weighted.for_each(|(b, w)| q45_k_weighted(b, w, 15, out)),
        GgmlType::Q5K => weighted.for_each(|(b, w)| q45_k_weighted(b, w, 31, out)),
        GgmlType::Q6K => weighted.for_each(|(b, w)| q6_k(b, Some(w), out)),
        _ => return None,
    }
    Some(())
}

/// ggml's `nearest_int`: adding 1.5·2²³ leaves the integer part in the mantissa, rounded to
/// nearest with ties to even by the FPU (valid for |v| < 2²²; outside it ggml's result is as
/// meaningless as this one, and both are clamped by the callers).
fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12_582_912.0f32).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

fn f16_bits(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_bits().to_le_bytes()
}

/// The f32 value of the f16 that `v` is stored as.
fn through_f16(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// The first element of largest magnitude, with its sign (ggml's strict `<` keeps the first).
fn signed_absmax(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    (amax, max)
}

fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

fn reciprocal_or_zero(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

/// C's float → `int8_t` conversion (truncation; the values here are in range).
fn trunc_i8(v: f32) -> i32 {
    v as i8 as i32
}

/// Q5_0 / Q5_1's packing: low nibbles in `qs`, the fifth bits in a little-endian u32.
fn push_five_bit(codes: &[u8; 32], out: &mut Vec<u8>) {
    let mut qh = 0u32;
    for (j, &c) in codes.iter().enumerate() {
        qh |= u32::from(c >> 4 & 1) << j;
    }
    out.extend_from_slice(&qh.to_le_bytes());
    for j in 0..16 {
        out.push((codes[j] & 0x0f) | (codes[16 + j] & 0x0f) << 4);
    }
}

/// Four 2-bit codes a byte: byte `l` of each 32-byte group holds codes `l`, `l+32`, `l+64`,
/// `l+96` of its 128 (Q2_K and Q3_K's low bits).
fn push_two_bit(codes: &[u8; QK_K], out: &mut Vec<u8>) {
    for half in codes.chunks_exact(128) {
        for l in 0..32 {
            out.push(half[l] | half[l + 32] << 2 | half[l + 64] << 4 | half[l + 96] << 6);
        }
    }
}

/// Q3_K's sixteen 6-bit scale levels (0..=63) in its 12 bytes: low nibbles in bytes 0..8,
/// the top two bits in bytes 8..12 (what `q3k_scales` reads back).
fn pack_q3_scales(levels: &[u8; QK_K / 16]) -> [u8; 12] {
    let mut packed = [0u8; 12];
    for (j, &l) in levels.iter().enumerate() {
        if j < 8 {
            packed[j] = l & 0xf;
        } else {
            packed[j - 8] |= (l & 0xf) << 4;
        }
        packed[j % 4 + 8] |= (l >> 4) << (2 * (j / 4));
    }
    packed
}

/// Q4_K / Q5_K's eight 6-bit scales and minimums in their 12 bytes (what `k_scale_min` reads
/// back); bits above the sixth are dropped where ggml's packing drops them.
fn pack_k_scales(scales: &[u8; QK_K / 32], mins: &[u8; QK_K / 32]) -> [u8; 12] {
    let mut packed = [0u8; 12];
    for (j, (&ls, &lm)) in scales.iter().zip(mins).enumerate() {
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0xf) | (lm & 0xf) << 4;
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    packed
}

/// Q2_K's codes recomputed against the stored 4-bit scales and minimums, then the block.
fn finish_q2_k(
    x: &[f32],
    codes: &mut [u8; QK_K],
    packed: &[u8; QK_K / 16],
    (d, dmin): (f32, f32),
    out: &mut Vec<u8>,
) {
    let (d_bits, dmin_bits) = (f16_bits(d), f16_bits(dmin));
    let (d, dmin) = (through_f16(d), through_f16(dmin));
    for ((xs, cs), &p) in x
        .chunks_exact(16)
        .zip(codes.chunks_exact_mut(16))
        .zip(packed)
    {
        let dj = d * f32::from(p & 0xf);
        if dj == 0.0 {
            continue;
        }
        let dm = dmin * f32::from(p >> 4);
        for (c, &v) in cs.iter_mut().zip(xs) {
            *c = nearest_int((v + dm) / dj).clamp(0, 3) as u8;
        }
    }
    out.extend_from_slice(packed);
    push_two_bit(codes, out);
    out.extend_from_slice(&d_bits);
    out.extend_from_slice(&dmin_bits);
}

/// Q3_K's codes recomputed against the stored 6-bit scales, then the block.
fn finish_q3_k(x: &[f32], codes: &mut [i8; QK_K], packed: &[u8; 12], d: f32, out: &mut Vec<u8>) {
    let d_bits = f16_bits(d);
    let d = through_f16(d);
    let stored = q3k_scales(packed);
    for ((xs, cs), &sc) in x
        .chunks_exact(16)
        .zip(codes.chunks_exact_mut(16))
        .zip(&stored)
    {
        let dj = d * sc as f32;
        if dj == 0.0 {
            continue;
        }
        for (c, &v) in cs.iter_mut().zip(xs) {
            *c = (nearest_int(v / dj).clamp(-4, 3) + 4) as i8;
        }
    }
    let mut hmask = [0u8; QK_K / 8];
    let mut low = [0u8; QK_K];
    for (j, (&c, l)) in codes.iter().zip(low.iter_mut()).enumerate() {
        let mut c = c as u8;
        if c > 3 {
            hmask[j % 32] |= 1 << (j / 32);
            c -= 4;
        }
        *l = c;
    }
    out.extend_from_slice(&hmask);
    push_two_bit(&low, out);
    out.extend_from_slice(packed);
    out.extend_from_slice(&d_bits);
}

/// Q4_K / Q5_K's codes recomputed against the stored 6-bit scales and minimums, then the
/// block.
fn finish_q45_k(
    x: &[f32],
    codes: &mut [u8; QK_K],
    packed: &[u8; 12],
    (d, dmin): (f32, f32),
    nmax: i32,
    out: &mut Vec<u8>,
) {
    let (d_bits, dmin_bits) = (f16_bits(d), f16_bits(dmin));
    let (d, dmin) = (through_f16(d), through_f16(dmin));
    for (j, (xs, cs)) in x
        .chunks_exact(32)
        .zip(codes.chunks_exact_mut(32))
        .enumerate()
    {
        let (sc, m) = k_scale_min(packed, j);
        let dj = d * f32::from(sc);
        if dj == 0.0 {
            continue;
        }
        let dm = dmin * f32::from(m);
        for (c, &v) in cs.iter_mut().zip(xs) {
            *c = nearest_int((v + dm) / dj).clamp(0, nmax) as u8;
        }
    }
    out.extend_from_slice(&d_bits);
    out.extend_from_slice(&dmin_bits);
    out.extend_from_slice(packed);
    if nmax == 31 {
        let mut qh = [0u8; QK_K / 8];
        for (j, c) in codes.iter_mut().enumerate() {
            if *c > 15 {
                // Code j sits in group j / 32 of eight; group g's fifth bits are bit g of qh.
                qh[j % 32] |= 1 << (j / 32);
                *c -= 16;
            }
        }
        out.extend_from_slice(&qh);
    }
    for pair in codes.chunks_exact(64) {
        for l in 0..32 {
            out.push(pair[l] | pair[l + 32] << 4);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sfx_formats::gguf::dequantize_to_vec;

    fn lcg_normal(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed;
        let mut u = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        (0..n)
            .map(|_| ((-2.0 * u().ln()).sqrt() * (std::f64::consts::TAU * u()).cos()) as f32)
            .collect()
    }

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        for (v, want) in [
            (0.5, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (3.49, 3),
        ] {
            assert_eq!(nearest_int(v), want, "{v}");
        }
    }

    /// Each type's blocks decode (through the GGUF reader's dequantizer) to values within the
    /// type's step of the input: a layout written in the wrong order fails this by far.
    #[test]
    fn blocks_decode_close_to_their_input() {
        let x = lcg_normal(7, 4 * QK_K);
        for ty in QUANTIZABLE {
            let mut bytes = Vec::new();
            quantize_row(ty, &x, None, &mut bytes).unwrap();
            assert_eq!(
                bytes.len(),
                x.len() / ty.block_size() * ty.type_size(),
                "{ty:?}"
            );
            let back = dequantize_to_vec(ty, &bytes, x.len()).unwrap();
            let rms = |v: &mut dyn Iterator<Item = f32>| {
                (v.map(|e| f64::from(e * e)).sum::<f64>() / x.len() as f64).sqrt()
            };
            let err = rms(&mut x.iter().zip(&back).map(|(a, b)| a - b));
            // Relative RMS error of a Gaussian at b bits is about 2^-b·√12·σ-ish; these caps
            // sit near twice llama.cpp's published figures for each type.
            let cap = match ty {
                GgmlType::Q2K => 0.45,
                GgmlType::Q3K => 0.25,
                GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q4K => 0.14,
                GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5K => 0.07,
                GgmlType::Q6K => 0.035,
                _ => 0.01,
            };
            assert!(err < cap, "{ty:?}: rms error {err} ≥ {cap}");
        }
    }

    #[test]
    fn a_zero_row_gives_zero_weights_and_odd_lengths_are_refused() {
        for ty in QUANTIZABLE {
            let mut bytes = Vec::new();
            quantize_row(ty, &[0.0; QK_K], None, &mut bytes).unwrap();
            let back = dequantize_to_vec(ty, &bytes, QK_K).unwrap();
            assert!(back.iter().all(|&v| v == 0.0), "{ty:?}");
            assert!(quantize_row(ty, &[0.0; QK_K + 16], None, &mut bytes).is_none());
        }
        assert!(quantize_row(GgmlType::F16, &[0.0; QK_K], None, &mut Vec::new()).is_none());
    }
}

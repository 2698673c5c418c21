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
//!   candidate scales minimising a weighted error (`make_qkx2_quants`); sub-block scales and
//!   minimums are themselves quantized to 4 (Q2_K) or 6 bits against two f16 super-scales, and
//!   the codes are recomputed against the quantized scales.
//! - Q3_K: symmetric sub-block scales refined by coordinate descent (`make_q3_quants`), 6-bit
//!   scales against one f16 super-scale.
//! - Q6_K: symmetric sub-block scales searched over 18 candidates (`make_qx_quants`), int8
//!   scales against one f16 super-scale.

use half::f16;
use sfx_formats::gguf::{k_scale_min, q3k_scales, GgmlType, QK_K};

/// Below this a group's maximum counts as zero (ggml's `GROUP_MAX_EPS`).
const GROUP_MAX_EPS: f32 = 1e-15;

/// The block types [`quantize_row`] writes.
pub const QUANTIZABLE: [GgmlType; 10] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// Appends the blocks of `x` (a whole number of `ty`'s blocks) to `out`; `None` when `ty` is
/// not one of [`QUANTIZABLE`] or `x` is not a whole number of its blocks.
pub fn quantize_row(ty: GgmlType, x: &[f32], out: &mut Vec<u8>) -> Option<()> {
    if !QUANTIZABLE.contains(&ty) || !x.len().is_multiple_of(ty.block_size()) {
        return None;
    }
    out.reserve(x.len() / ty.block_size() * ty.type_size());
    let blocks = x.chunks_exact(ty.block_size());
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
        GgmlType::Q6K => blocks.for_each(|b| q6_k(b, out)),
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

fn q4_0(x: &[f32], out: &mut Vec<u8>) {
    let (_, max) = signed_absmax(x);
    let d = max / -8.0;
    let id = reciprocal_or_zero(d);
    out.extend_from_slice(&f16_bits(d));
    for j in 0..16 {
        let lo = trunc_i8(x[j] * id + 8.5).min(15) as u8;
        let hi = trunc_i8(x[16 + j] * id + 8.5).min(15) as u8;
        out.push(lo | hi << 4);
    }
}

fn q4_1(x: &[f32], out: &mut Vec<u8>) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = reciprocal_or_zero(d);
    out.extend_from_slice(&f16_bits(d));
    out.extend_from_slice(&f16_bits(min));
    for j in 0..16 {
        let lo = trunc_i8((x[j] - min) * id + 0.5).min(15) as u8;
        let hi = trunc_i8((x[16 + j] - min) * id + 0.5).min(15) as u8;
        out.push(lo | hi << 4);
    }
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

fn q5_0(x: &[f32], out: &mut Vec<u8>) {
    let (_, max) = signed_absmax(x);
    let d = max / -16.0;
    let id = reciprocal_or_zero(d);
    out.extend_from_slice(&f16_bits(d));
    let mut codes = [0u8; 32];
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = trunc_i8(v * id + 16.5).min(31) as u8;
    }
    push_five_bit(&codes, out);
}

fn q5_1(x: &[f32], out: &mut Vec<u8>) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = reciprocal_or_zero(d);
    out.extend_from_slice(&f16_bits(d));
    out.extend_from_slice(&f16_bits(min));
    let mut codes = [0u8; 32];
    for (c, &v) in codes.iter_mut().zip(x) {
        // C's float → uint8_t conversion: truncation.
        *c = ((v - min) * id + 0.5) as u8;
    }
    push_five_bit(&codes, out);
}

fn q8_0(x: &[f32], out: &mut Vec<u8>) {
    let amax = x
        .iter()
        .fold(0.0f32, |a, v| if a > v.abs() { a } else { v.abs() });
    let d = amax / 127.0;
    let id = reciprocal_or_zero(d);
    out.extend_from_slice(&f16_bits(d));
    out.extend(x.iter().map(|&v| (v * id).round() as i8 as u8));
}

/// An affine fit `x ≈ scale·L + min` (L in 0..=nmax, min ≤ 0) of one sub-block minimising
/// Σ w·|err| (`use_mad`) or Σ w·err², searched over `nstep + 1` candidate scales from
/// `(nmax + rmin)/(max − min)` in steps of `rdelta/(max − min)` (ggml's `make_qkx2_quants`).
/// Returns `(scale, −min)`.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    codes: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        codes.fill(0);
        return (0.0, -min);
    }
    let error = |scale: f32, min: f32, codes: &[u8]| {
        let mut e = 0.0f32;
        for i in 0..n {
            let diff = scale * f32::from(codes[i]) + min - x[i];
            let diff = if use_mad { diff.abs() } else { diff * diff };
            e += weights[i] * diff;
        }
        e
    };
    let nmax_f = nmax as f32;
    let iscale = nmax_f / (max - min);
    let mut scale = 1.0 / iscale;
    for i in 0..n {
        codes[i] = nearest_int(iscale * (x[i] - min)).clamp(0, nmax) as u8;
    }
    let mut best_error = error(scale, min, codes);
    let mut aux = [0u8; 32];
    let aux = &mut aux[..n];
    for is in 0..=nstep {
        let iscale = (rmin + rdelta * is as f32 + nmax_f) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            aux[i] = l as u8;
            let (w, l) = (weights[i], l as f32);
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let cur_error = error(this_scale, this_min, aux);
            if cur_error < best_error {
                codes.copy_from_slice(aux);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// A symmetric fit `x ≈ scale·(L − nmax)` weighted by x², its codes refined by up to five
/// rounds of coordinate descent (ggml's `make_q3_quants` with `do_rmse`). Codes come back
/// offset by `nmax`.
fn make_q3_quants(nmax: i32, x: &[f32], codes: &mut [i8]) -> f32 {
    let (amax, max) = signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        codes.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for (c, &v) in codes.iter_mut().zip(x) {
        let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        *c = l as i8;
        let w = v * v;
        sumlx += w * v * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    for _ in 0..5 {
        let mut changed = 0;
        for (c, &v) in codes.iter_mut().zip(x) {
            let w = v * v;
            let old = f32::from(*c);
            let mut slx = sumlx - w * v * old;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * old * old;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != i32::from(*c) {
                    slx += w * v * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        *c = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed += 1;
                    }
                }
            }
        }
        if changed == 0 {
            break;
        }
    }
    for c in codes.iter_mut() {
        *c += nmax as i8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// A symmetric fit weighted by x² searched over 18 scales around `nmax/max` (ggml's
/// `make_qx_quants` with `rmse_type` 1 and no importance). Codes come back offset by `nmax`.
fn make_qx_quants(nmax: i32, x: &[f32], codes: &mut [i8]) -> f32 {
    let (amax, max) = signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        codes.fill(0);
        return 0.0;
    }
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for &v in x {
            let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1) as f32;
            let w = v * v;
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let set_codes = |iscale: f32, codes: &mut [i8]| {
        for (c, &v) in codes.iter_mut().zip(x) {
            *c = (nearest_int(iscale * v).clamp(-nmax, nmax - 1) + nmax) as i8;
        }
    };
    let iscale = -(nmax as f32) / max;
    set_codes(iscale, codes);
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9i32..=9 {
        if is == 0 {
            continue;
        }
        let iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            set_codes(iscale, codes);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
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

fn q2_k(x: &[f32], out: &mut Vec<u8>) {
    const Q4SCALE: f32 = 15.0;
    let mut codes = [0u8; QK_K];
    let mut scales = [0.0f32; QK_K / 16];
    let mut mins = [0.0f32; QK_K / 16];
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for (j, (xs, cs)) in x
        .chunks_exact(16)
        .zip(codes.chunks_exact_mut(16))
        .enumerate()
    {
        let mut weights = [0.0f32; 16];
        for (w, v) in weights.iter_mut().zip(xs) {
            *w = v.abs();
        }
        (scales[j], mins[j]) = make_qkx2_quants(3, xs, &weights, cs, -0.5, 0.1, 15, true);
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let mut packed = [0u8; QK_K / 16];
    let mut d = 0.0f32;
    if max_scale > 0.0 {
        let iscale = Q4SCALE / max_scale;
        for (p, s) in packed.iter_mut().zip(&scales) {
            *p = nearest_int(iscale * s) as u8;
        }
        d = max_scale / Q4SCALE;
    }
    let mut dmin = 0.0f32;
    if max_min > 0.0 {
        let iscale = Q4SCALE / max_min;
        for (p, m) in packed.iter_mut().zip(&mins) {
            *p |= (nearest_int(iscale * m) << 4) as u8;
        }
        dmin = max_min / Q4SCALE;
    }
    let (d_bits, dmin_bits) = (f16_bits(d), f16_bits(dmin));
    let (d, dmin) = (through_f16(d), through_f16(dmin));
    for ((xs, cs), &p) in x
        .chunks_exact(16)
        .zip(codes.chunks_exact_mut(16))
        .zip(&packed)
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
    out.extend_from_slice(&packed);
    push_two_bit(&codes, out);
    out.extend_from_slice(&d_bits);
    out.extend_from_slice(&dmin_bits);
}

fn q3_k(x: &[f32], out: &mut Vec<u8>) {
    let mut codes = [0i8; QK_K];
    let mut scales = [0.0f32; QK_K / 16];
    let (mut amax, mut max_scale) = (0.0f32, 0.0f32);
    for (j, (xs, cs)) in x
        .chunks_exact(16)
        .zip(codes.chunks_exact_mut(16))
        .enumerate()
    {
        scales[j] = make_q3_quants(4, xs, cs);
        if scales[j].abs() > amax {
            amax = scales[j].abs();
            max_scale = scales[j];
        }
    }
    let mut packed = [0u8; 12];
    let mut d = 0.0f32;
    if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        for (j, s) in scales.iter().enumerate() {
            // int → int8_t, then clamped and offset: 0..=63.
            let l = (i32::from(nearest_int(iscale * s) as i8).clamp(-32, 31) + 32) as u8;
            if j < 8 {
                packed[j] = l & 0xf;
            } else {
                packed[j - 8] |= (l & 0xf) << 4;
            }
            packed[j % 4 + 8] |= (l >> 4) << (2 * (j / 4));
        }
        d = 1.0 / iscale;
    }
    let d_bits = f16_bits(d);
    let d = through_f16(d);
    let stored = q3k_scales(&packed);
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
    out.extend_from_slice(&packed);
    out.extend_from_slice(&d_bits);
}

/// Q4_K (`nmax` 15) and Q5_K (`nmax` 31): eight sub-blocks of 32 with 6-bit scales and
/// minimums packed as `get_scale_min_k4` reads them.
fn q45_k(x: &[f32], nmax: i32, rmin: f32, nstep: i32, out: &mut Vec<u8>) {
    let mut codes = [0u8; QK_K];
    let mut scales = [0.0f32; QK_K / 32];
    let mut mins = [0.0f32; QK_K / 32];
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for (j, (xs, cs)) in x
        .chunks_exact(32)
        .zip(codes.chunks_exact_mut(32))
        .enumerate()
    {
        let sum_x2 = xs.iter().fold(0.0f32, |s, v| s + v * v);
        let av_x = (sum_x2 / 32.0).sqrt();
        let mut weights = [0.0f32; 32];
        for (w, v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        (scales[j], mins[j]) = make_qkx2_quants(nmax, xs, &weights, cs, rmin, 0.1, nstep, false);
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut packed = [0u8; 12];
    for j in 0..QK_K / 32 {
        // int → uint8_t wraps, then the 6-bit cap.
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0xf) | (lm & 0xf) << 4;
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    let (d, dmin) = (max_scale / 63.0, max_min / 63.0);
    let (d_bits, dmin_bits) = (f16_bits(d), f16_bits(dmin));
    let (d, dmin) = (through_f16(d), through_f16(dmin));
    for (j, (xs, cs)) in x
        .chunks_exact(32)
        .zip(codes.chunks_exact_mut(32))
        .enumerate()
    {
        let (sc, m) = k_scale_min(&packed, j);
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
    out.extend_from_slice(&packed);
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

fn q6_k(x: &[f32], out: &mut Vec<u8>) {
    let mut codes = [0i8; QK_K];
    let mut scales = [0.0f32; QK_K / 16];
    let (mut max_abs_scale, mut max_scale) = (0.0f32, 0.0f32);
    for (j, (xs, cs)) in x
        .chunks_exact(16)
        .zip(codes.chunks_exact_mut(16))
        .enumerate()
    {
        scales[j] = make_qx_quants(32, xs, cs);
        if scales[j].abs() > max_abs_scale {
            max_abs_scale = scales[j].abs();
            max_scale = scales[j];
        }
    }
    if max_abs_scale < GROUP_MAX_EPS {
        out.extend(std::iter::repeat_n(0u8, GgmlType::Q6K.type_size()));
        return;
    }
    let iscale = -128.0 / max_scale;
    let d_bits = f16_bits(1.0 / iscale);
    let d = through_f16(1.0 / iscale);
    let mut packed = [0i8; QK_K / 16];
    for (p, s) in packed.iter_mut().zip(&scales) {
        *p = nearest_int(iscale * s).min(127) as i8;
    }
    for ((xs, cs), &p) in x
        .chunks_exact(16)
        .zip(codes.chunks_exact_mut(16))
        .zip(&packed)
    {
        let dj = d * f32::from(p);
        if dj == 0.0 {
            continue;
        }
        for (c, &v) in cs.iter_mut().zip(xs) {
            *c = (nearest_int(v / dj).clamp(-32, 31) + 32) as i8;
        }
    }
    let codes = codes.map(|c| c as u8);
    let mut ql = [0u8; QK_K / 2];
    let mut qh = [0u8; QK_K / 4];
    for (h, half) in codes.chunks_exact(128).enumerate() {
        let (ql, qh) = (&mut ql[64 * h..], &mut qh[32 * h..]);
        for l in 0..32 {
            let [c1, c2, c3, c4] = [half[l], half[l + 32], half[l + 64], half[l + 96]];
            ql[l] = (c1 & 0xf) | (c3 & 0xf) << 4;
            ql[l + 32] = (c2 & 0xf) | (c4 & 0xf) << 4;
            qh[l] = c1 >> 4 | (c2 >> 4) << 2 | (c3 >> 4) << 4 | (c4 >> 4) << 6;
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(packed.iter().map(|&p| p as u8));
    out.extend_from_slice(&d_bits);
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
            quantize_row(ty, &x, &mut bytes).unwrap();
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
            quantize_row(ty, &[0.0; QK_K], &mut bytes).unwrap();
            let back = dequantize_to_vec(ty, &bytes, QK_K).unwrap();
            assert!(back.iter().all(|&v| v == 0.0), "{ty:?}");
            assert!(quantize_row(ty, &[0.0; QK_K + 16], &mut bytes).is_none());
        }
        assert!(quantize_row(GgmlType::F16, &[0.0; QK_K], &mut Vec::new()).is_none());
    }
}

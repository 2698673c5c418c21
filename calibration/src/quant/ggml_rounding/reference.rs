//! llama.cpp's rounding without an importance matrix (its `quantize_row_*_ref`), one
//! function a block.

use super::search::{make_q3_quants, make_qkx_quants, make_qx_quants};
use super::*;

pub(super) fn q4_0(x: &[f32], out: &mut Vec<u8>) {
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

pub(super) fn q4_1(x: &[f32], out: &mut Vec<u8>) {
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

pub(super) fn q5_0(x: &[f32], out: &mut Vec<u8>) {
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

pub(super) fn q5_1(x: &[f32], out: &mut Vec<u8>) {
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

pub(super) fn q8_0(x: &[f32], out: &mut Vec<u8>) {
    let amax = x
        .iter()
        .fold(0.0f32, |a, v| if a > v.abs() { a } else { v.abs() });
    let d = amax / 127.0;
    let id = reciprocal_or_zero(d);
    out.extend_from_slice(&f16_bits(d));
    out.extend(x.iter().map(|&v| (v * id).round() as i8 as u8));
}

pub(super) fn q2_k(x: &[f32], out: &mut Vec<u8>) {
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
        (scales[j], mins[j]) = make_qkx_quants(3, xs, &weights, cs, -0.5, 0.1, 15, true);
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
    finish_q2_k(x, &mut codes, &packed, (d, dmin), out);
}

pub(super) fn q3_k(x: &[f32], out: &mut Vec<u8>) {
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
        // int → int8_t, then clamped and offset: 0..=63.
        let levels =
            scales.map(|s| (i32::from(nearest_int(iscale * s) as i8).clamp(-32, 31) + 32) as u8);
        packed = pack_q3_scales(&levels);
        d = 1.0 / iscale;
    }
    finish_q3_k(x, &mut codes, &packed, d, out);
}

/// Q4_K (`nmax` 15) and Q5_K (`nmax` 31): eight sub-blocks of 32 with 6-bit scales and
/// minimums packed as `get_scale_min_k4` reads them.
pub(super) fn q45_k(x: &[f32], nmax: i32, rmin: f32, nstep: i32, out: &mut Vec<u8>) {
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
        (scales[j], mins[j]) = make_qkx_quants(nmax, xs, &weights, cs, rmin, 0.1, nstep, false);
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
    // int → uint8_t wraps, then the 6-bit cap.
    let level = |v: f32| (nearest_int(v) as u8).min(63);
    let packed = pack_k_scales(
        &scales.map(|s| level(inv_scale * s)),
        &mins.map(|m| level(inv_min * m)),
    );
    finish_q45_k(
        x,
        &mut codes,
        &packed,
        (max_scale / 63.0, max_min / 63.0),
        nmax,
        out,
    );
}

/// Q6_K; `importance` weights the sub-block scale search (llama.cpp's imatrix path).
pub(super) fn q6_k(x: &[f32], importance: Option<&[f32]>, out: &mut Vec<u8>) {
    let mut codes = [0i8; QK_K];
    let mut scales = [0.0f32; QK_K / 16];
    let (mut max_abs_scale, mut max_scale) = (0.0f32, 0.0f32);
    for (j, (xs, cs)) in x
        .chunks_exact(16)
        .zip(codes.chunks_exact_mut(16))
        .enumerate()
    {
        let weights = importance.map(|w| &w[16 * j..16 * j + 16]);
        scales[j] = make_qx_quants(32, xs, cs, weights);
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

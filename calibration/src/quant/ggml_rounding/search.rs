//! The scale searches llama.cpp's block rounding is built from (`make_qkx2_quants`,
//! `make_q3_quants`, `make_qx_quants`, `make_qp_quants` in its `ggml-quants.c`), each keeping
//! ggml's f32 operation order.

use super::{nearest_int, signed_absmax, GROUP_MAX_EPS};

/// An affine fit `x ≈ scale·L + min` (L in 0..=nmax, min ≤ 0) of one sub-block minimising
/// Σ w·|err| (`use_mad`) or Σ w·err², searched over `nstep + 1` candidate scales from
/// `(nmax + rmin)/(max − min)` in steps of `rdelta/(max − min)` (ggml's `make_qkx2_quants`;
/// its `make_qkx3_quants` is the same given weights and finite inputs, as here).
/// Returns `(scale, −min)`.
#[allow(clippy::too_many_arguments)]
pub(super) fn make_qkx_quants(
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
pub(super) fn make_q3_quants(nmax: i32, x: &[f32], codes: &mut [i8]) -> f32 {
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

/// A symmetric fit weighted by `weights` (x² without) searched over 18 scales around
/// `nmax/max` (ggml's `make_qx_quants` with `rmse_type` 1). Codes come back offset by `nmax`.
pub(super) fn make_qx_quants(
    nmax: i32,
    x: &[f32],
    codes: &mut [i8],
    weights: Option<&[f32]>,
) -> f32 {
    let (amax, max) = signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        codes.fill(0);
        return 0.0;
    }
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for (i, &v) in x.iter().enumerate() {
            let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1) as f32;
            let w = weights.map_or(v * v, |w| w[i]);
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

/// Non-negative `x` (sub-block scales or minimums) on a 0..=nmax grid: the best of nine
/// scales around `nmax/max` by weighted squared error, then up to five rounds of coordinate
/// descent (ggml's `make_qp_quants`). Codes are u8 as in ggml: a negative code wraps, and the
/// descent reads the wrapped value back, as ggml's does.
pub(super) fn make_qp_quants(nmax: i32, x: &[f32], codes: &mut [u8], weights: &[f32]) -> f32 {
    let max = x.iter().fold(0.0f32, |m, &v| if m > v { m } else { v });
    if max < GROUP_MAX_EPS {
        codes.fill(0);
        return 0.0;
    }
    let nmax_f = nmax as f32;
    let mut iscale = nmax_f / max;
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = nearest_int(iscale * v) as u8;
    }
    let scale = 1.0 / iscale;
    let mut best_mse = 0.0f32;
    for i in 0..x.len() {
        let diff = x[i] - scale * f32::from(codes[i]);
        best_mse += weights[i] * diff * diff;
    }
    for is in -4i32..=4 {
        if is == 0 {
            continue;
        }
        let iscale_is = (0.1 * is as f32 + nmax_f) / max;
        let scale_is = 1.0 / iscale_is;
        let mut mse = 0.0f32;
        for i in 0..x.len() {
            let l = nearest_int(iscale_is * x[i]).min(nmax);
            let diff = x[i] - scale_is * l as f32;
            mse += weights[i] * diff * diff;
        }
        if mse < best_mse {
            best_mse = mse;
            iscale = iscale_is;
        }
    }
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for i in 0..x.len() {
        let l = nearest_int(iscale * x[i]).min(nmax);
        codes[i] = l as u8;
        let w = weights[i];
        sumlx += w * x[i] * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    for _ in 0..5 {
        let mut changed = 0;
        for i in 0..x.len() {
            let w = weights[i];
            let old = f32::from(codes[i]);
            let mut slx = sumlx - w * x[i] * old;
            let mut sl2 = suml2 - w * old * old;
            if slx > 0.0 && sl2 > 0.0 {
                let new_l = nearest_int(x[i] * sl2 / slx).min(nmax);
                if new_l != i32::from(codes[i]) {
                    slx += w * x[i] * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if slx * slx * suml2 > sumlx * sumlx * sl2 {
                        codes[i] = new_l as u8;
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
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

//! llama.cpp's rounding with an importance matrix (its `quantize_row_*_impl`): per weight
//! `importance · √(σ² + x²)` steers every scale search.

use super::search::{make_qkx_quants, make_qp_quants, make_qx_quants};
use super::*;

/// `importance · √(σ² + x²)` per weight: llama.cpp's imatrix weighting, σ² the mean square
/// of the span it is computed over (scaled by `sigma_factor`).
pub(super) fn importance_weights(x: &[f32], importance: &[f32], sigma2: f32, weights: &mut [f32]) {
    for ((w, &q), &v) in weights.iter_mut().zip(importance).zip(x) {
        *w = q * (sigma2 + v * v).sqrt();
    }
}

pub(super) fn sum_squares(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |s, v| s + v * v)
}

/// One sub-block's importance weights and their sum (ggml's `sw`).
fn weighted_subblock<const N: usize>(
    xs: &[f32],
    importance: &[f32],
    sigma2: f32,
) -> ([f32; N], f32) {
    let mut weights = [0.0f32; N];
    importance_weights(xs, &importance[..N], sigma2, &mut weights);
    let sum = weights.iter().fold(0.0f32, |s, w| s + w);
    (weights, sum)
}

/// Q4_0, Q4_1, Q5_0, Q5_1 with an importance vector: σ² over the whole row, per block a
/// weighted symmetric (`_0`) or affine (`_1`) fit.
pub(super) fn legacy_weighted(ty: GgmlType, x: &[f32], importance: &[f32], out: &mut Vec<u8>) {
    let sigma2 = sum_squares(x) / x.len() as f32;
    for (xb, qw) in x.chunks_exact(32).zip(importance.chunks_exact(32)) {
        let mut weights = [0.0f32; 32];
        importance_weights(xb, qw, sigma2, &mut weights);
        match ty {
            GgmlType::Q4_0 | GgmlType::Q5_0 => {
                let nmax = if ty == GgmlType::Q4_0 { 8 } else { 16 };
                let mut codes = [0i8; 32];
                let d = make_qx_quants(nmax, xb, &mut codes, Some(&weights));
                out.extend_from_slice(&f16_bits(d));
                let codes = codes.map(|c| c as u8);
                if ty == GgmlType::Q4_0 {
                    out.extend((0..16).map(|j| codes[j] | codes[j + 16] << 4));
                } else {
                    push_five_bit(&codes, out);
                }
            }
            _ => {
                let nmax = if ty == GgmlType::Q4_1 { 15 } else { 31 };
                let mut codes = [0u8; 32];
                let (d, neg_min) =
                    make_qkx_quants(nmax, xb, &weights, &mut codes, -0.9, 0.05, 36, false);
                out.extend_from_slice(&f16_bits(d));
                out.extend_from_slice(&f16_bits(-neg_min));
                if ty == GgmlType::Q4_1 {
                    out.extend((0..16).map(|j| codes[j] | codes[j + 16] << 4));
                } else {
                    push_five_bit(&codes, out);
                }
            }
        }
    }
}

/// Q2_K with an importance vector: weighted affine sub-block fits, their scales and minimums
/// fitted onto 4 bits by [`make_qp_quants`] weighted by each sub-block's total weight.
pub(super) fn q2_k_weighted(x: &[f32], importance: &[f32], out: &mut Vec<u8>) {
    let mut codes = [0u8; QK_K];
    let mut scales = [0.0f32; QK_K / 16];
    let mut mins = [0.0f32; QK_K / 16];
    let mut sw = [0.0f32; QK_K / 16];
    let sigma2 = sum_squares(x) / QK_K as f32;
    for (j, (xs, cs)) in x
        .chunks_exact(16)
        .zip(codes.chunks_exact_mut(16))
        .enumerate()
    {
        let weights: [f32; 16];
        (weights, sw[j]) = weighted_subblock(xs, &importance[16 * j..], sigma2);
        (scales[j], mins[j]) = make_qkx_quants(3, xs, &weights, cs, -0.9, 0.05, 36, false);
    }
    let (mut ls, mut lm) = ([0u8; QK_K / 16], [0u8; QK_K / 16]);
    let d = make_qp_quants(15, &scales, &mut ls, &sw);
    let dmin = make_qp_quants(15, &mins, &mut lm, &sw);
    let packed: [u8; QK_K / 16] = std::array::from_fn(|j| ls[j] | lm[j] << 4);
    finish_q2_k(x, &mut codes, &packed, (d, dmin), out);
}

/// Q3_K with an importance vector: weighted symmetric sub-block fits, their scales fitted onto
/// 6 signed bits by a weighted [`make_qx_quants`].
pub(super) fn q3_k_weighted(x: &[f32], importance: &[f32], out: &mut Vec<u8>) {
    let mut codes = [0i8; QK_K];
    let mut scales = [0.0f32; QK_K / 16];
    let mut sw = [0.0f32; QK_K / 16];
    let sigma2 = 2.0 * sum_squares(x) / QK_K as f32;
    for (j, (xs, cs)) in x
        .chunks_exact(16)
        .zip(codes.chunks_exact_mut(16))
        .enumerate()
    {
        let weights: [f32; 16];
        (weights, sw[j]) = weighted_subblock(xs, &importance[16 * j..], sigma2);
        scales[j] = make_qx_quants(4, xs, cs, Some(&weights));
    }
    let mut ls = [0i8; QK_K / 16];
    let d = make_qx_quants(32, &scales, &mut ls, Some(&sw));
    let packed = pack_q3_scales(&ls.map(|l| l as u8));
    finish_q3_k(x, &mut codes, &packed, d, out);
}

/// Q4_K (`nmax` 15) and Q5_K (31) with an importance vector: weighted affine sub-block fits,
/// scales and minimums fitted onto 6 bits by [`make_qp_quants`].
pub(super) fn q45_k_weighted(x: &[f32], importance: &[f32], nmax: i32, out: &mut Vec<u8>) {
    let mut codes = [0u8; QK_K];
    let mut scales = [0.0f32; QK_K / 32];
    let mut mins = [0.0f32; QK_K / 32];
    let mut sw = [0.0f32; QK_K / 32];
    let sigma2 = 2.0 * sum_squares(x) / QK_K as f32;
    for (j, (xs, cs)) in x
        .chunks_exact(32)
        .zip(codes.chunks_exact_mut(32))
        .enumerate()
    {
        let weights: [f32; 32];
        (weights, sw[j]) = weighted_subblock(xs, &importance[32 * j..], sigma2);
        (scales[j], mins[j]) = make_qkx_quants(nmax, xs, &weights, cs, -0.9, 0.05, 36, false);
    }
    let (mut ls, mut lm) = ([0u8; QK_K / 32], [0u8; QK_K / 32]);
    let d = make_qp_quants(63, &scales, &mut ls, &sw);
    let dmin = make_qp_quants(63, &mins, &mut lm, &sw);
    // Q5_K caps the levels at 63; Q4_K stores them as they are (above 63 only when a
    // negative one wrapped).
    let cap = |l: [u8; QK_K / 32]| if nmax == 31 { l.map(|v| v.min(63)) } else { l };
    let packed = pack_k_scales(&cap(ls), &cap(lm));
    finish_q45_k(x, &mut codes, &packed, (d, dmin), nmax, out);
}

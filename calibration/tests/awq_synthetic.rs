//! AWQ on synthetic data: activation outliers make AWQ beat RTN; α = 0 is RTN exactly;
//! folding `1/s` into the preceding norm preserves the float product.

use sfx_calibration::quant::awq::{
    awq_scales, channel_abs_mean, fold_into_norm, fold_into_rows, gram, output_error,
    scale_columns, Awq,
};
use sfx_calibration::quant::{Rtn, WeightView};

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

const COLS: usize = 256;
const ROWS: usize = 48;
const N: usize = 384;
const OUTLIERS: [usize; 4] = [3, 77, 130, 201];

/// Inputs with 4 outlier channels (|x| ~ 40× the rest), and two weights sharing the input.
fn data(seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut s = seed;
    let mut x: Vec<f32> = (0..N * COLS).map(|_| lcg(&mut s)).collect();
    for row in x.chunks_exact_mut(COLS) {
        for &c in &OUTLIERS {
            row[c] *= 40.0;
        }
    }
    let w1: Vec<f32> = (0..ROWS * COLS).map(|_| 0.05 * lcg(&mut s)).collect();
    let w2: Vec<f32> = (0..2 * ROWS * COLS).map(|_| 0.03 * lcg(&mut s)).collect();
    (x, w1, w2)
}

fn views<'a>(w1: &'a [f32], w2: &'a [f32]) -> [WeightView<'a>; 2] {
    [
        WeightView {
            kron: None,
            fisher: None,
            imatrix: None,
            guided: None,
            name: "w1",
            data: w1,
            rows: ROWS,
            cols: COLS,
        },
        WeightView {
            kron: None,
            fisher: None,
            imatrix: None,
            guided: None,
            name: "w2",
            data: w2,
            rows: 2 * ROWS,
            cols: COLS,
        },
    ]
}

/// Direct ‖X Wᵀ − X Ŵᵀ‖² / n, for cross-checking the Gram form.
fn direct_error(x: &[f32], w: &[f32], w_hat: &[f32], rows: usize) -> f64 {
    let mut e = 0.0f64;
    for xr in x.chunks_exact(COLS) {
        for r in 0..rows {
            let d: f64 = (0..COLS)
                .map(|j| (w[r * COLS + j] - w_hat[r * COLS + j]) as f64 * xr[j] as f64)
                .sum();
            e += d * d;
        }
    }
    e / (x.len() / COLS) as f64
}

#[test]
fn awq_beats_rtn_at_3_bits_with_outlier_channels() {
    let (x, w1, w2) = data(7);
    let v = views(&w1, &w2);
    let awq = Awq::new(3);
    let set = awq.quantize_set(&v, &x, N, &[false, true]).unwrap();

    // RTN through the public RTN quantizer, error measured directly (no Gram matrix).
    let mut rtn_direct = 0.0;
    for w in &v {
        let q = Rtn::new(3).quantize_group(*w).unwrap().dequantize();
        rtn_direct += direct_error(&x, w.data, &q, w.rows);
    }
    let eff = set.effective_weights();
    let awq_direct: f64 = v
        .iter()
        .zip(&eff)
        .map(|(w, e)| direct_error(&x, w.data, e, w.rows))
        .sum();
    let rel = |a: f64, b: f64| (a - b).abs() / b;
    assert!(
        rel(set.rtn_error, rtn_direct) < 1e-3,
        "{} vs {rtn_direct}",
        set.rtn_error
    );
    assert!(
        rel(set.error, awq_direct) < 1e-3,
        "{} vs {awq_direct}",
        set.error
    );
    assert!(set.alpha > 0.0, "outliers should pick α > 0");
    assert!(
        awq_direct < 0.8 * rtn_direct,
        "AWQ {awq_direct} vs RTN {rtn_direct} (α {})",
        set.alpha
    );
    // Never worse than RTN on the calibration objective, clip included.
    assert!(set.scaled_error <= set.rtn_error);
    assert!(set.error <= set.scaled_error);
    // Deterministic.
    assert_eq!(set, awq.quantize_set(&v, &x, N, &[false, true]).unwrap());
}

#[test]
fn awq_is_never_worse_than_rtn_on_the_objective() {
    for (seed, bits) in [(1u64, 2u8), (2, 3), (3, 4)] {
        // Also without outliers: α = 0 remains available.
        let mut s = seed;
        let x: Vec<f32> = (0..N * COLS).map(|_| lcg(&mut s)).collect();
        let w1: Vec<f32> = (0..ROWS * COLS).map(|_| 0.05 * lcg(&mut s)).collect();
        let w2: Vec<f32> = (0..2 * ROWS * COLS).map(|_| 0.05 * lcg(&mut s)).collect();
        let set = Awq::new(bits)
            .quantize_set(&views(&w1, &w2), &x, N, &[true, true])
            .unwrap();
        assert!(set.error <= set.rtn_error, "{bits} bits: {set:?}");
    }
}

#[test]
fn alpha_zero_reproduces_rtn_exactly() {
    let (x, w1, w2) = data(11);
    let v = views(&w1, &w2);
    let mean = channel_abs_mean(&x, N, COLS);
    let s = awq_scales(&mean, 0.0);
    assert!(s.iter().all(|&v| v == 1.0));
    let awq = Awq::new(3);
    let set = awq.quantize_with_scales(&v, &x, N, s, 0.0).unwrap();
    let g = gram(&x, N, COLS);
    for (w, q) in v.iter().zip(&set.weights) {
        let rtn = Rtn::new(3).quantize_group(*w).unwrap();
        assert_eq!(*q, rtn);
    }
    let eff = set.effective_weights();
    let e: f64 = v
        .iter()
        .zip(&eff)
        .map(|(w, e)| output_error(&g, w.data, e, w.rows, COLS))
        .sum();
    assert_eq!(e, set.error);
    // And the search reports the same RTN objective.
    let full = Awq {
        clip_steps: 0,
        ..awq
    }
    .quantize_set(&v, &x, N, &[false, false])
    .unwrap();
    assert_eq!(full.rtn_error, set.error);
}

#[test]
fn scales_are_normalised() {
    let (x, ..) = data(5);
    let mean = channel_abs_mean(&x, N, COLS);
    let s = awq_scales(&mean, 0.5);
    let (lo, hi) = s
        .iter()
        .fold((f32::INFINITY, 0.0f32), |(l, h), &v| (l.min(v), h.max(v)));
    assert!((lo * hi - 1.0).abs() < 1e-5, "{lo} {hi}");
    assert!(s[OUTLIERS[0]] > 5.0 * s[0]);
}

/// (x ⊙ norm / s) · (W diag s)ᵀ = (x ⊙ norm) · Wᵀ in float; likewise for a preceding linear.
#[test]
fn folding_preserves_the_float_product() {
    let (x, w1, _) = data(13);
    let mut s0 = 99u64;
    let norm: Vec<f32> = (0..COLS).map(|_| 1.0 + 0.5 * lcg(&mut s0)).collect();
    let s = awq_scales(&channel_abs_mean(&x, N, COLS), 0.7);
    let mut folded = norm.clone();
    fold_into_norm(&mut folded, &s);
    let ws = scale_columns(&w1, COLS, &s);
    for xr in x.chunks_exact(COLS).take(16) {
        for r in 0..ROWS {
            let wr = &w1[r * COLS..(r + 1) * COLS];
            let wsr = &ws[r * COLS..(r + 1) * COLS];
            let a: f64 = (0..COLS)
                .map(|j| (xr[j] * norm[j]) as f64 * wr[j] as f64)
                .sum();
            let b: f64 = (0..COLS)
                .map(|j| (xr[j] * folded[j]) as f64 * wsr[j] as f64)
                .sum();
            let scale: f64 = (0..COLS)
                .map(|j| ((xr[j] * norm[j]) as f64 * wr[j] as f64).abs())
                .sum();
            assert!((a - b).abs() <= 1e-5 * scale, "{a} vs {b}");
        }
    }
    // Preceding linear: prev [COLS, k] rows divided by s, next W·diag(s).
    let k = 32;
    let prev: Vec<f32> = (0..COLS * k).map(|_| lcg(&mut s0)).collect();
    let mut prev_f = prev.clone();
    fold_into_rows(&mut prev_f, k, &s);
    let u: Vec<f32> = (0..k).map(|_| lcg(&mut s0)).collect();
    let h = |p: &[f32]| -> Vec<f64> {
        p.chunks_exact(k)
            .map(|row| row.iter().zip(&u).map(|(a, b)| (a * b) as f64).sum())
            .collect()
    };
    let (h0, h1) = (h(&prev), h(&prev_f));
    for r in 0..ROWS {
        let a: f64 = (0..COLS).map(|j| h0[j] * w1[r * COLS + j] as f64).sum();
        let b: f64 = (0..COLS).map(|j| h1[j] * ws[r * COLS + j] as f64).sum();
        let scale: f64 = (0..COLS)
            .map(|j| (h0[j] * w1[r * COLS + j] as f64).abs())
            .sum();
        assert!((a - b).abs() <= 1e-5 * scale, "{a} vs {b}");
    }
}

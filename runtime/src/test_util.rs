//! Helpers shared by the runtime's unit tests.

/// A deterministic pseudo-random value in [-1, 1) (Knuth's MMIX LCG), so kernel tests need no
/// RNG dependency and replay identically.
pub(crate) fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// Asserts `y[r] = Σ_i w[r, i]·x[i]` for every row of the row-major `w` (`y.len()` rows of
/// `x.len()` columns) within f32 rounding of an int8 kernel's per-block terms: 1e-5 of
/// `Σ_i |w·x|` plus 1e-5, against the product in f64. `what` names the case in a failure.
pub(crate) fn assert_rows_match_f64(w: &[f32], x: &[f32], y: &[f32], what: &str) {
    let cols = x.len();
    for (r, &got) in y.iter().enumerate() {
        let (mut want, mut mag) = (0.0f64, 0.0f64);
        for (wi, xi) in w[r * cols..(r + 1) * cols].iter().zip(x) {
            let t = f64::from(*wi) * f64::from(*xi);
            want += t;
            mag += t.abs();
        }
        let got = f64::from(got);
        assert!(
            (got - want).abs() <= 1e-5 * mag + 1e-5,
            "{what} row {r}: {got} vs {want}"
        );
    }
}

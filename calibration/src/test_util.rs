//! Deterministic pseudo-random data for unit tests (no `rand` dependency in test data, so
//! the values are identical on every platform and rand version).

/// `n` values uniform in [-1, 1) from a 64-bit LCG seeded with `seed`.
pub(crate) fn lcg_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

//! Helpers shared by the runtime's unit tests.

/// A deterministic pseudo-random value in [-1, 1) (Knuth's MMIX LCG), so kernel tests need no
/// RNG dependency and replay identically.
pub(crate) fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

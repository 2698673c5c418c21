//! Channel selection S(x) (docs/method.md §2): the top-k |x_i| of every 1024-channel chunk.
//!
//! Chunks of [`CHUNK`] channels, the last one possibly shorter with a pro-rata budget
//! ([`chunk_budget`]). Within a chunk the order is |x_i| descending, ties broken by the lower
//! index (a total order, so the selection is exact and deterministic; NaN sorts above every
//! finite value via `f32::total_cmp`). The converter's calibration statistics use the same
//! functions, so the channels a fit assumed are the channels decoding selects.

/// Channels per selection chunk.
pub const CHUNK: usize = 1024;

/// Budget of a chunk of `len` channels for `k` per full 1024-chunk:
/// `round(k · len / 1024)` (half up), at least 1 when `k > 0`, at most `len`.
pub fn chunk_budget(k_per_1024: usize, len: usize) -> usize {
    if k_per_1024 == 0 || len == 0 {
        return 0;
    }
    let k = (k_per_1024 * len + CHUNK / 2) / CHUNK;
    k.clamp(1, len)
}

/// Total number of selected channels for an input of `in_dim` channels.
pub fn selected_count(k_per_1024: usize, in_dim: usize) -> usize {
    (0..in_dim)
        .step_by(CHUNK)
        .map(|s| chunk_budget(k_per_1024, (in_dim - s).min(CHUNK)))
        .sum()
}

/// Appends to `out` the indices S(x) of the top-k |x_i| of every 1024-chunk of `x`, sorted
/// ascending. `out` is cleared first.
pub fn select_top_k(x: &[f32], k_per_1024: usize, out: &mut Vec<usize>) {
    out.clear();
    let mut keys: Vec<u64> = Vec::with_capacity(CHUNK.min(x.len()));
    for start in (0..x.len()).step_by(CHUNK) {
        let end = (start + CHUNK).min(x.len());
        let k = chunk_budget(k_per_1024, end - start);
        if k == 0 {
            continue;
        }
        // One integer per channel whose ascending order is the selection order: |x| has a
        // clear sign bit, so its bits order as `total_cmp` orders it (NaN above +inf), and
        // their complement sorts descending; the offset in the chunk breaks ties upward.
        // Selecting on plain u64s runs several times faster than on indices through a
        // comparison closure (a decode token selects ~120 times on the CPU).
        keys.clear();
        keys.extend(
            x[start..end]
                .iter()
                .enumerate()
                .map(|(o, v)| (u64::from(!v.abs().to_bits()) << 32) | o as u64),
        );
        if k < keys.len() {
            keys.select_nth_unstable(k - 1);
        }
        let first = out.len();
        out.extend(
            keys[..k]
                .iter()
                .map(|&key| start + (key & 0xFFFF_FFFF) as usize),
        );
        out[first..].sort_unstable();
    }
}

/// z_k(x): `x` with every channel outside S(x) set to zero.
pub fn mask_top_k(x: &[f32], k_per_1024: usize) -> Vec<f32> {
    let mut sel = Vec::new();
    select_top_k(x, k_per_1024, &mut sel);
    let mut z = vec![0.0; x.len()];
    for i in sel {
        z[i] = x[i];
    }
    z
}

//! CPU kernels of the refinement accumulate (docs/method.md eq. 2 / 6).

/// `out[e] += scales[e] · Σ_j weights[j] · level_j[e]` over nibble-packed units (levels
/// `nibble − 8`, element `e` in byte `e / 2`, low nibble first), `units` holding them back to
/// back.
pub(crate) fn add_nibble_units(
    out: &mut [f32],
    units: &[u8],
    unit_bytes: usize,
    weights: &[f32],
    scales: &[f32],
) {
    add_nibble_columns(
        out,
        units
            .chunks_exact(unit_bytes.max(1))
            .zip(weights.iter().copied()),
        scales,
    );
}

/// [`add_nibble_units`] over `(unit, weight)` pairs wherever the units lie (a projection's
/// selected columns read in place). Units are summed in an f32 accumulator first so the
/// per-row scale multiplies once per element, not once per unit; a zero weight is skipped.
pub(crate) fn add_nibble_columns<'u>(
    out: &mut [f32],
    units: impl Iterator<Item = (&'u [u8], f32)>,
    scales: &[f32],
) {
    let n = out.len();
    let pairs = n / 2;
    let mut acc = vec![0.0f32; n];
    for (unit, w) in units {
        if w == 0.0 {
            continue;
        }
        for (pair, &byte) in acc.chunks_exact_mut(2).zip(&unit[..pairs]) {
            pair[0] += w * ((byte & 0x0F) as i32 - 8) as f32;
            pair[1] += w * ((byte >> 4) as i32 - 8) as f32;
        }
        if n % 2 == 1 {
            acc[n - 1] += w * ((unit[pairs] & 0x0F) as i32 - 8) as f32;
        }
    }
    for ((o, a), s) in out.iter_mut().zip(&acc).zip(scales) {
        *o += a * s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_element_by_element_decoding() {
        // 5 rows (odd: the last high nibble is padding), 3 units.
        let units: Vec<u8> = vec![
            0x9F, 0x18, 0x08, // unit 0: levels 7, 1, 0, -7, 0 (pad 0)
            0x88, 0x88, 0x0C, // unit 1: 0, 0, 0, 0, 4
            0xF1, 0x78, 0x88, // unit 2: -7, 7, 0, -1, 0
        ];
        let weights = [2.0, -1.0, 0.5];
        let scales = [1.0, 0.5, 2.0, 1.0, 0.25];
        let mut out = vec![1.0f32; 5];
        add_nibble_units(&mut out, &units, 3, &weights, &scales);
        let level = |u: usize, e: usize| {
            let b = units[u * 3 + e / 2];
            (if e.is_multiple_of(2) { b & 15 } else { b >> 4 }) as f32 - 8.0
        };
        for (e, &o) in out.iter().enumerate() {
            let want = 1.0 + scales[e] * (0..3).map(|u| weights[u] * level(u, e)).sum::<f32>();
            assert_eq!(o, want, "element {e}");
        }
        assert_eq!(out[0], 1.0 + (2.0 * 7.0 - 0.5 * 7.0));
    }
}

//! CPU kernels of the refinement accumulate (docs/method.md eq. 2 / 6).

use super::SimdLevel;
use crate::refine::plan::nibble_level;

/// `out[e] += scales[e] · Σ_j weights[j] · level_j[e]` over nibble-packed units (levels
/// `nibble − 8`, element `e` in byte `e / 2`, low nibble first), `units` holding them back to
/// back.
pub(crate) fn add_nibble_units(
    level: SimdLevel,
    out: &mut [f32],
    units: &[u8],
    unit_bytes: usize,
    weights: &[f32],
    scales: &[f32],
) {
    add_nibble_columns(
        level,
        out,
        units
            .chunks_exact(unit_bytes.max(1))
            .zip(weights.iter().copied()),
        scales,
    );
}

/// Elements per block of the vector kernels: 16 bytes of every unit.
const BLOCK: usize = 32;

/// [`add_nibble_units`] over `(unit, weight)` pairs wherever the units lie (a projection's
/// selected columns read in place); a zero weight is skipped. Blocks of [`BLOCK`] elements
/// are the outer loop and the units the inner one, so a block's sums stay in registers over
/// every unit and the per-row scale multiplies once; the tail past the last full block runs
/// the same sums element by element.
pub(crate) fn add_nibble_columns<'u>(
    level: SimdLevel,
    out: &mut [f32],
    units: impl Iterator<Item = (&'u [u8], f32)>,
    scales: &[f32],
) {
    let n = out.len().min(scales.len());
    // The backends' argument checks size every unit; the filter keeps the vector loads in
    // bounds regardless.
    let unit_min = n.div_ceil(2);
    let units: Vec<(&[u8], f32)> = units
        .filter(|&(u, w)| {
            debug_assert!(u.len() >= unit_min, "a unit shorter than its rows");
            w != 0.0 && u.len() >= unit_min
        })
        .collect();
    if units.is_empty() {
        return;
    }
    let blocks = n / BLOCK;
    #[cfg(target_arch = "x86_64")]
    {
        match level {
            SimdLevel::Avx512 if level.is_supported() => {
                // SAFETY: AVX-512F was detected at run time; every unit holds at least
                // `blocks · 16` bytes (filtered above) and `out`, `scales` `blocks · 32`.
                unsafe { x86::blocks_avx512(&mut out[..n], &units, scales, blocks) };
            }
            SimdLevel::Avx2 if level.is_supported() => {
                // SAFETY: AVX2 and FMA were detected at run time; sizes as above.
                unsafe { x86::blocks_avx2(&mut out[..n], &units, scales, blocks) };
            }
            _ => blocks_portable(&mut out[..n], &units, scales, blocks),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = level;
        blocks_portable(&mut out[..n], &units, scales, blocks);
    }
    for e in blocks * BLOCK..n {
        let sum: f32 = units.iter().map(|&(u, w)| w * nibble_level(u, e)).sum();
        out[e] += sum * scales[e];
    }
}

fn blocks_portable(out: &mut [f32], units: &[(&[u8], f32)], scales: &[f32], blocks: usize) {
    for blk in 0..blocks {
        let mut acc = [0.0f32; BLOCK];
        for &(u, w) in units {
            for (pair, &b) in acc.chunks_exact_mut(2).zip(&u[blk * 16..blk * 16 + 16]) {
                pair[0] += w * ((b & 0x0F) as i32 - 8) as f32;
                pair[1] += w * ((b >> 4) as i32 - 8) as f32;
            }
        }
        let at = blk * BLOCK..(blk + 1) * BLOCK;
        for ((o, a), s) in out[at.clone()].iter_mut().zip(&acc).zip(&scales[at]) {
            *o += a * s;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::BLOCK;
    use std::arch::x86_64::*;

    /// 16 bytes of a unit as its 32 levels (`nibble − 8`, i8), in element order: low
    /// nibbles are the even elements, high nibbles the odd ones.
    #[inline(always)]
    unsafe fn levels(p: *const u8) -> (__m128i, __m128i) {
        let b = _mm_loadu_si128(p.cast());
        let mask = _mm_set1_epi8(0x0F);
        let eight = _mm_set1_epi8(8);
        let lo = _mm_sub_epi8(_mm_and_si128(b, mask), eight);
        let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16::<4>(b), mask), eight);
        (_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi))
    }

    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn blocks_avx512(
        out: &mut [f32],
        units: &[(&[u8], f32)],
        scales: &[f32],
        blocks: usize,
    ) {
        for blk in 0..blocks {
            let mut a0 = _mm512_setzero_ps();
            let mut a1 = _mm512_setzero_ps();
            for &(u, w) in units {
                let (e0, e1) = levels(u.as_ptr().add(blk * 16));
                let w = _mm512_set1_ps(w);
                a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(e0)), w, a0);
                a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(e1)), w, a1);
            }
            let o = out.as_mut_ptr().add(blk * BLOCK);
            let s = scales.as_ptr().add(blk * BLOCK);
            // Product and add rounded apart (no FMA), as the tail and the portable loop do:
            // adding into a zeroed delta and then into the output must give the bits of
            // adding into the output directly (the engine in the backend and the host-driven
            // one agree bit for bit).
            let v0 = _mm512_mul_ps(a0, _mm512_loadu_ps(s));
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), v0));
            let (o, s) = (o.add(16), s.add(16));
            let v1 = _mm512_mul_ps(a1, _mm512_loadu_ps(s));
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), v1));
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn blocks_avx2(
        out: &mut [f32],
        units: &[(&[u8], f32)],
        scales: &[f32],
        blocks: usize,
    ) {
        for blk in 0..blocks {
            let mut acc = [_mm256_setzero_ps(); 4];
            for &(u, w) in units {
                let (e0, e1) = levels(u.as_ptr().add(blk * 16));
                let w = _mm256_set1_ps(w);
                let parts = [e0, _mm_srli_si128::<8>(e0), e1, _mm_srli_si128::<8>(e1)];
                for (a, p) in acc.iter_mut().zip(parts) {
                    let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(p));
                    *a = _mm256_fmadd_ps(v, w, *a);
                }
            }
            for (i, a) in acc.into_iter().enumerate() {
                let o = out.as_mut_ptr().add(blk * BLOCK + 8 * i);
                let s = scales.as_ptr().add(blk * BLOCK + 8 * i);
                let v = _mm256_mul_ps(a, _mm256_loadu_ps(s));
                _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), v));
            }
        }
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
        for level in SimdLevel::supported() {
            let mut out = vec![1.0f32; 5];
            add_nibble_units(level, &mut out, &units, 3, &weights, &scales);
            let lv = |u: usize, e: usize| {
                let b = units[u * 3 + e / 2];
                (if e.is_multiple_of(2) { b & 15 } else { b >> 4 }) as f32 - 8.0
            };
            for (e, &o) in out.iter().enumerate() {
                let want = 1.0 + scales[e] * (0..3).map(|u| weights[u] * lv(u, e)).sum::<f32>();
                assert_eq!(o, want, "{level:?} element {e}");
            }
            assert_eq!(out[0], 1.0 + (2.0 * 7.0 - 0.5 * 7.0));
        }
    }

    /// Every tier against f64 sums over lengths with and without full vector blocks, with
    /// a zero weight among the units and padding bytes past the rows.
    #[test]
    fn vector_tiers_match_f64_sums() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for n in [1usize, 31, 32, 33, 96, 192, 575, 576, 1536] {
            let unit_bytes = n.div_ceil(2) + 3;
            let count = 11;
            let units: Vec<u8> = (0..count * unit_bytes).map(|_| next() as u8).collect();
            let mut weights: Vec<f32> = (0..count)
                .map(|_| (next() % 2001) as f32 / 100.0 - 10.0)
                .collect();
            weights[3] = 0.0;
            let scales: Vec<f32> = (0..n).map(|_| (next() % 1000) as f32 / 997.0).collect();
            let base: Vec<f32> = (0..n).map(|e| e as f32 * 0.25 - 3.0).collect();
            for level in SimdLevel::supported() {
                let mut out = base.clone();
                add_nibble_units(level, &mut out, &units, unit_bytes, &weights, &scales);
                for e in 0..n {
                    let sum: f64 = (0..count)
                        .map(|u| {
                            let b = units[u * unit_bytes + e / 2];
                            let q = if e % 2 == 0 { b & 15 } else { b >> 4 };
                            weights[u] as f64 * (q as f64 - 8.0)
                        })
                        .sum();
                    let want = base[e] as f64 + sum * scales[e] as f64;
                    let err = (out[e] as f64 - want).abs();
                    assert!(
                        err <= 1e-4 * (1.0 + want.abs()),
                        "{level:?} n={n} e={e}: {} vs {want}",
                        out[e]
                    );
                }
            }
        }
    }
}

//! Decode-time matrix-vector products `y = W·x` for BF16 and F32 row-major weights.
//!
//! At one token the whole weight matrix is read once and each element is used for one FMA, so
//! the kernel is memory-bound: what matters is streaming rows at full bandwidth on every core.
//! Rows are split into blocks across the decode pool's threads; each thread walks its rows
//! strictly in order with four accumulators (four FMA chains hide the 4-cycle FMA latency). Measured on
//! the 2-core EPYC dev VM, 49152×576 BF16: one sequential row stream 16–18 GB/s, four
//! interleaved rows sharing each `x` load 5–8 GB/s (the prefetcher loses the short 1152-byte
//! row streams); software prefetch did not help. BF16 widens to F32 by a 16-bit shift (exact).

use super::SimdLevel;

/// A weight element the kernels can widen to f32.
pub(crate) trait WeightElem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    /// Loads 8 elements widened to f32.
    ///
    /// # Safety
    /// `p` must be valid for 8 reads and AVX2 must be available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
    /// Loads 16 elements widened to f32.
    ///
    /// # Safety
    /// `p` must be valid for 16 reads and AVX-512F must be available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

/// BF16 is stored as its raw bits; widening is `bits << 16`.
impl WeightElem for u16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let h = _mm256_loadu_si256(p as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }
}

impl WeightElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
}

/// Below this many weight bytes a matrix is done on one thread: a fan-out costs a few
/// µs, about the time to stream 64 KiB from DRAM on one core.
const MIN_PARALLEL_BYTES: usize = 64 * 1024;

/// `y[r] = Σ_i w[r, i]·x[i]` for `w` row-major `[y.len(), x.len()]`, on the decode pool
/// (`spin_pool`).
/// Callers guarantee `w.len() == y.len() * x.len()`.
pub(crate) fn matvec<E: WeightElem>(level: SimdLevel, w: &[E], x: &[f32], y: &mut [f32]) {
    let cols = x.len();
    let rows = y.len();
    debug_assert_eq!(w.len(), rows * cols);
    if rows == 0 {
        return;
    }
    if cols == 0 {
        y.fill(0.0);
        return;
    }
    let bytes = std::mem::size_of_val(w);
    let pool = super::spin_pool::pool();
    let threads = pool.threads();
    if bytes < MIN_PARALLEL_BYTES || threads == 1 {
        rows_kernel(level, w, x, y);
        return;
    }
    // ~4 blocks per thread lets the shared block counter absorb a thread descheduled
    // mid-token (measured on SmolLM2 decode: 1, 2, 4, 8 blocks/thread → 88, 90, 96, 88 tok/s).
    let per_task = rows.div_ceil(threads * 4).max(1);
    pool.for_each_chunk_mut(y, per_task, |b, yb| {
        let r0 = b * per_task;
        let wb = &w[r0 * cols..(r0 + yb.len()) * cols];
        rows_kernel(level, wb, x, yb);
    });
}

/// One block of rows on the calling thread, at the requested SIMD tier.
pub(crate) fn rows_kernel<E: WeightElem>(level: SimdLevel, w: &[E], x: &[f32], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if level == SimdLevel::Avx512 && level.is_supported() {
            // SAFETY: AVX-512F/AVX2/FMA detected; slice lengths checked by the caller
            // (w.len() == y.len() * x.len()), which bounds every pointer read below.
            unsafe { rows_avx512(w, x, y) };
            return;
        }
        if level == SimdLevel::Avx2 && level.is_supported() {
            // SAFETY: as above, for AVX2/FMA.
            unsafe { rows_avx2(w, x, y) };
            return;
        }
    }
    let _ = level;
    rows_portable(w, x, y);
}

fn rows_portable<E: WeightElem>(w: &[E], x: &[f32], y: &mut [f32]) {
    const L: usize = 16;
    let cols = x.len();
    for (r, yr) in y.iter_mut().enumerate() {
        let row = &w[r * cols..(r + 1) * cols];
        let mut acc = [0.0f32; L];
        let mut cw = row.chunks_exact(L);
        let mut cx = x.chunks_exact(L);
        for (a, b) in (&mut cw).zip(&mut cx) {
            for j in 0..L {
                acc[j] += a[j].to_f32() * b[j];
            }
        }
        let mut s: f32 = cw
            .remainder()
            .iter()
            .zip(cx.remainder())
            .map(|(a, b)| a.to_f32() * b)
            .sum();
        s += acc.iter().sum::<f32>();
        *yr = s;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn rows_avx512<E: WeightElem>(w: &[E], x: &[f32], y: &mut [f32]) {
    use std::arch::x86_64::*;
    let cols = x.len();
    let wp = w.as_ptr();
    let xp = x.as_ptr();
    for (r, yr) in y.iter_mut().enumerate() {
        let p = wp.add(r * cols);
        let mut a0 = _mm512_setzero_ps();
        let mut a1 = _mm512_setzero_ps();
        let mut a2 = _mm512_setzero_ps();
        let mut a3 = _mm512_setzero_ps();
        let mut i = 0;
        while i + 64 <= cols {
            a0 = _mm512_fmadd_ps(E::load16(p.add(i)), _mm512_loadu_ps(xp.add(i)), a0);
            a1 = _mm512_fmadd_ps(
                E::load16(p.add(i + 16)),
                _mm512_loadu_ps(xp.add(i + 16)),
                a1,
            );
            a2 = _mm512_fmadd_ps(
                E::load16(p.add(i + 32)),
                _mm512_loadu_ps(xp.add(i + 32)),
                a2,
            );
            a3 = _mm512_fmadd_ps(
                E::load16(p.add(i + 48)),
                _mm512_loadu_ps(xp.add(i + 48)),
                a3,
            );
            i += 64;
        }
        while i + 16 <= cols {
            a0 = _mm512_fmadd_ps(E::load16(p.add(i)), _mm512_loadu_ps(xp.add(i)), a0);
            i += 16;
        }
        let mut s =
            _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
        while i < cols {
            s += (*p.add(i)).to_f32() * *xp.add(i);
            i += 1;
        }
        *yr = s;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum256(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
    _mm_cvtss_f32(s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_avx2<E: WeightElem>(w: &[E], x: &[f32], y: &mut [f32]) {
    use std::arch::x86_64::*;
    let cols = x.len();
    let wp = w.as_ptr();
    let xp = x.as_ptr();
    for (r, yr) in y.iter_mut().enumerate() {
        let p = wp.add(r * cols);
        let mut a0 = _mm256_setzero_ps();
        let mut a1 = _mm256_setzero_ps();
        let mut a2 = _mm256_setzero_ps();
        let mut a3 = _mm256_setzero_ps();
        let mut i = 0;
        while i + 32 <= cols {
            a0 = _mm256_fmadd_ps(E::load8(p.add(i)), _mm256_loadu_ps(xp.add(i)), a0);
            a1 = _mm256_fmadd_ps(E::load8(p.add(i + 8)), _mm256_loadu_ps(xp.add(i + 8)), a1);
            a2 = _mm256_fmadd_ps(E::load8(p.add(i + 16)), _mm256_loadu_ps(xp.add(i + 16)), a2);
            a3 = _mm256_fmadd_ps(E::load8(p.add(i + 24)), _mm256_loadu_ps(xp.add(i + 24)), a3);
            i += 32;
        }
        while i + 8 <= cols {
            a0 = _mm256_fmadd_ps(E::load8(p.add(i)), _mm256_loadu_ps(xp.add(i)), a0);
            i += 8;
        }
        let mut s = hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        while i < cols {
            s += (*p.add(i)).to_f32() * *xp.add(i);
            i += 1;
        }
        *yr = s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_util::lcg;

    /// Every tier against an f64 reference, for shapes exercising the unrolled loop, SIMD
    /// tails and the parallel split. Tolerance: f32 accumulation of `cols` products
    /// of magnitude ≤ 1 → |err| ≤ ~cols·2^-24·Σ|w·x|; we use 1e-5·Σ|w·x| + 1e-6.
    #[test]
    fn matches_f64_reference_on_all_tiers() {
        let mut seed = 7u64;
        for &(rows, cols) in &[
            (1, 1),
            (3, 5),
            (4, 16),
            (7, 33),
            (13, 100),
            (130, 577),
            (600, 512),
        ] {
            let wf: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
            let wb: Vec<u16> = wf
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            let x: Vec<f32> = (0..cols).map(|_| lcg(&mut seed)).collect();
            for level in SimdLevel::supported() {
                for bf16 in [false, true] {
                    let mut y = vec![f32::NAN; rows];
                    if bf16 {
                        matvec(level, &wb, &x, &mut y);
                    } else {
                        matvec(level, &wf, &x, &mut y);
                    }
                    for r in 0..rows {
                        let (mut want, mut mag) = (0.0f64, 0.0f64);
                        for i in 0..cols {
                            let wv = if bf16 {
                                wb[r * cols + i].to_f32()
                            } else {
                                wf[r * cols + i]
                            };
                            want += wv as f64 * x[i] as f64;
                            mag += (wv as f64 * x[i] as f64).abs();
                        }
                        let err = (y[r] as f64 - want).abs();
                        assert!(
                            err <= 1e-5 * mag + 1e-6,
                            "{level:?} bf16={bf16} {rows}x{cols} row {r}: {} vs {want}",
                            y[r]
                        );
                    }
                }
            }
        }
    }
}

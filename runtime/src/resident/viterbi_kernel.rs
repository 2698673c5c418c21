//! The two Viterbi step kernels of trellis quantization: a forward step (min over the 2^KV
//! predecessors of every state, with back-pointers) and a backward step (cost-to-go over the
//! 2^KV successors). They are the whole cost of a conversion to a trellis base: two passes of
//! 2^16 states per step, 128 (V = 2) or 256 (V = 1) steps per 16×16 tile, ~10^5 tiles.
//!
//! State values are stored planar (`vals[j·N + s]` is value `j` of state `s`) so both kernels
//! stream them. KV and V are constants: with a run-time fan-out the per-state loops did not
//! vectorize. The AVX-512 copies spread the per-`u` minimum over the 2^KV states that share it
//! with one lane permute, and form the block minima of the backward step with in-register
//! butterflies; every cost is `min + d0² (+ d1²)` in the same order as the portable copy, so
//! both give bit-identical costs and therefore identical paths.

use crate::backend::cpu::SimdLevel;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// The DP arrays of one forward step: `next[s] = min_a prev[(s >> KV) | a·H] + cost(s)` with
/// `H = N >> KV`; `bp[u]`, if given, receives the minimising `a` for `u = s >> KV`. `m` is
/// scratch of at least `H`.
pub(crate) struct Forward<'a> {
    pub prev: &'a [f32],
    pub next: &'a mut [f32],
    pub m: &'a mut [f32],
    pub bp: Option<&'a mut [u8]>,
}

/// The DP arrays of one backward step: `cur[s] = min_b next[((s mod H) << KV) | b] + cost(s)`.
/// `mn` is scratch of at least `H`.
pub(crate) struct Backward<'a> {
    pub next: &'a [f32],
    pub cur: &'a mut [f32],
    pub mn: &'a mut [f32],
}

/// What a state's cost depends on: the planar state values, the step's V targets, and the
/// trellis shape.
#[derive(Clone, Copy)]
pub(crate) struct Costs<'a> {
    pub vals: &'a [f32],
    pub tgt: &'a [f32],
    pub kv: u32,
    pub v: usize,
}

pub(crate) fn forward_step(level: SimdLevel, f: Forward<'_>, c: Costs<'_>) {
    dispatch_kv_v!(c.kv, c.v, forward(level, f, c))
}

pub(crate) fn backward_step(level: SimdLevel, b: Backward<'_>, c: Costs<'_>) {
    dispatch_kv_v!(c.kv, c.v, backward(level, b, c))
}

/// Every (K·V, V) the quantizer admits: codes have V = 1 or 2 and K·V ≤ 8
/// (`trellis::MAX_QUANT_KV`, checked by `TrellisQuantizer::new`).
macro_rules! dispatch_kv_v {
    ($kv:expr, $v:expr, $f:ident($($arg:expr),*)) => {
        match ($kv, $v) {
            (1, 1) => Step::<1, 1>::$f($($arg),*),
            (2, 1) => Step::<2, 1>::$f($($arg),*),
            (3, 1) => Step::<3, 1>::$f($($arg),*),
            (4, 1) => Step::<4, 1>::$f($($arg),*),
            (5, 1) => Step::<5, 1>::$f($($arg),*),
            (6, 1) => Step::<6, 1>::$f($($arg),*),
            (7, 1) => Step::<7, 1>::$f($($arg),*),
            (8, 1) => Step::<8, 1>::$f($($arg),*),
            (2, 2) => Step::<2, 2>::$f($($arg),*),
            (4, 2) => Step::<4, 2>::$f($($arg),*),
            (6, 2) => Step::<6, 2>::$f($($arg),*),
            (8, 2) => Step::<8, 2>::$f($($arg),*),
            (kv, v) => unreachable!("TrellisQuantizer::new admits no K·V = {kv} with V = {v}"),
        }
    };
}
use dispatch_kv_v;

struct Step<const KV: usize, const V: usize>;

impl<const KV: usize, const V: usize> Step<KV, V> {
    fn forward(level: SimdLevel, f: Forward<'_>, c: Costs<'_>) {
        let n = f.prev.len();
        assert!(f.next.len() == n && f.m.len() >= n >> KV);
        assert!(f.bp.as_ref().is_none_or(|bp| bp.len() >= n >> KV));
        assert!(c.vals.len() >= V * n && c.tgt.len() >= V);
        #[cfg(target_arch = "x86_64")]
        if level == SimdLevel::Avx512 && level.is_supported() && Self::avx512_shape(n) {
            // SAFETY: AVX-512F was detected at run time; the lengths were checked above and
            // the shape (multiples of 16 lanes) by `avx512_shape`.
            return unsafe { Self::forward_avx512(f, c) };
        }
        #[cfg(target_arch = "x86_64")]
        if level >= SimdLevel::Avx2 && SimdLevel::Avx2.is_supported() {
            // SAFETY: AVX2 and FMA were detected at run time.
            return unsafe { Self::forward_avx2(f, c) };
        }
        let _ = level;
        Self::forward_portable(f, c)
    }

    fn backward(level: SimdLevel, b: Backward<'_>, c: Costs<'_>) {
        let n = b.next.len();
        assert!(b.cur.len() == n && b.mn.len() >= n >> KV);
        assert!(c.vals.len() >= V * n && c.tgt.len() >= V);
        #[cfg(target_arch = "x86_64")]
        if level == SimdLevel::Avx512 && level.is_supported() && Self::avx512_shape(n) {
            // SAFETY: as in `forward`.
            return unsafe { Self::backward_avx512(b, c) };
        }
        #[cfg(target_arch = "x86_64")]
        if level >= SimdLevel::Avx2 && SimdLevel::Avx2.is_supported() {
            // SAFETY: AVX2 and FMA were detected at run time.
            return unsafe { Self::backward_avx2(b, c) };
        }
        let _ = level;
        Self::backward_portable(b, c)
    }

    /// Whole 16-lane vectors of states and of `u` values.
    fn avx512_shape(n: usize) -> bool {
        n.is_multiple_of(16) && (n >> KV).is_multiple_of(16)
    }

    /// `m[u] = min_a prev[a·H + u]` (and its argmin): streams the 2^KV blocks of `prev`.
    #[inline(always)]
    fn predecessor_min(prev: &[f32], m: &mut [f32], bp: Option<&mut [u8]>) {
        let h = prev.len() >> KV;
        let m = &mut m[..h];
        m.copy_from_slice(&prev[..h]);
        match bp {
            Some(bp) => {
                let bp = &mut bp[..h];
                bp.fill(0);
                for a in 1..1usize << KV {
                    let blk = &prev[a * h..(a + 1) * h];
                    for ((mu, bu), &x) in m.iter_mut().zip(bp.iter_mut()).zip(blk) {
                        let better = x < *mu;
                        *mu = if better { x } else { *mu };
                        *bu = if better { a as u8 } else { *bu };
                    }
                }
            }
            None => {
                for a in 1..1usize << KV {
                    for (mu, &x) in m.iter_mut().zip(&prev[a * h..(a + 1) * h]) {
                        *mu = mu.min(x);
                    }
                }
            }
        }
    }

    #[inline(always)]
    fn cost(base: f32, vals: &[f32], n: usize, s: usize, tgt: &[f32]) -> f32 {
        let mut c = base;
        for j in 0..V {
            let d = tgt[j] - vals[j * n + s];
            c += d * d;
        }
        c
    }

    #[inline(always)]
    fn forward_portable(f: Forward<'_>, c: Costs<'_>) {
        let n = f.prev.len();
        Self::predecessor_min(f.prev, f.m, f.bp);
        for (u, (out, &mu)) in f.next.chunks_exact_mut(1 << KV).zip(f.m.iter()).enumerate() {
            for (b, o) in out.iter_mut().enumerate() {
                *o = Self::cost(mu, c.vals, n, (u << KV) | b, c.tgt);
            }
        }
    }

    #[inline(always)]
    fn backward_portable(b: Backward<'_>, c: Costs<'_>) {
        let n = b.next.len();
        let h = n >> KV;
        for (x, blk) in b.mn.iter_mut().zip(b.next.chunks_exact(1 << KV)) {
            *x = blk.iter().copied().fold(f32::INFINITY, f32::min);
        }
        for (a, out) in b.cur.chunks_exact_mut(h).enumerate() {
            for (u, (o, &mu)) in out.iter_mut().zip(b.mn.iter()).enumerate() {
                *o = Self::cost(mu, c.vals, n, a * h + u, c.tgt);
            }
        }
    }

    /// The portable bodies, vectorized 8 lanes wide by LLVM (the fallback for CPUs without
    /// AVX-512 and for state counts that are not whole vectors).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn forward_avx2(f: Forward<'_>, c: Costs<'_>) {
        Self::forward_portable(f, c)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn backward_avx2(b: Backward<'_>, c: Costs<'_>) {
        Self::backward_portable(b, c)
    }

    /// `acc + Σ_j (t_j − vals_j[s0..s0+16])²`, summed in the portable order.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn cost16(
        acc: __m512,
        vals: *const f32,
        n: usize,
        s0: usize,
        t: &[__m512; V],
    ) -> __m512 {
        let mut acc = acc;
        for (j, tj) in t.iter().enumerate() {
            // SAFETY: the caller guarantees s0 + 16 ≤ n and V planes of n values.
            let d = _mm512_sub_ps(*tj, unsafe { _mm512_loadu_ps(vals.add(j * n + s0)) });
            acc = _mm512_add_ps(acc, _mm512_mul_ps(d, d));
        }
        acc
    }

    /// Lane `i` of the result is lane `i >> KV` of the input (all lanes 0 once KV ≥ 4).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    fn spread_index() -> __m512i {
        let idx: [i32; 16] = std::array::from_fn(|i| (i >> KV) as i32);
        // SAFETY: reads 64 bytes from a 64-byte array.
        unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn forward_avx512(f: Forward<'_>, c: Costs<'_>) {
        let Forward { prev, next, m, bp } = f;
        let (vals, tgt) = (c.vals, c.tgt);
        let n = prev.len();
        Self::predecessor_min(prev, m, bp);
        let t: [__m512; V] = std::array::from_fn(|j| _mm512_set1_ps(tgt[j]));
        let idx = Self::spread_index();
        // The `u` values one vector of 16 states needs (one when KV ≥ 4).
        let m_lanes = (16usize >> KV).max(1);
        let m_mask = ((1u32 << m_lanes) - 1) as __mmask16;
        let (mp, vp, np) = (m.as_ptr(), vals.as_ptr(), next.as_mut_ptr());
        for s0 in (0..n).step_by(16) {
            // SAFETY: s0 + 16 ≤ n; u = s0 >> KV < H ≤ m.len(), and the masked load reads
            // u..u + 16 >> KV ≤ H lanes when KV < 4.
            unsafe {
                let mu = if KV >= 4 {
                    _mm512_set1_ps(*mp.add(s0 >> KV))
                } else {
                    _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(m_mask, mp.add(s0 >> KV)))
                };
                _mm512_storeu_ps(np.add(s0), Self::cost16(mu, vp, n, s0, &t));
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn backward_avx512(b: Backward<'_>, c: Costs<'_>) {
        let Backward { next, cur, mn } = b;
        let (vals, tgt) = (c.vals, c.tgt);
        let n = next.len();
        let h = n >> KV;
        let (xp, mp) = (next.as_ptr(), mn.as_mut_ptr());
        if KV >= 4 {
            for u in 0..h {
                // SAFETY: block u is next[u << KV .. (u + 1) << KV], inside next; u < H ≤ mn.len().
                unsafe {
                    let base = xp.add(u << KV);
                    let mut acc = _mm512_loadu_ps(base);
                    for c in 1..1usize << (KV - 4) {
                        acc = _mm512_min_ps(acc, _mm512_loadu_ps(base.add(16 * c)));
                    }
                    *mp.add(u) = _mm512_reduce_min_ps(acc);
                }
            }
        } else {
            // Butterflies within each group of 2^KV lanes leave the group minimum in every lane
            // of the group; compressing the group leaders packs 16 >> KV minima.
            let swaps: [__m512i; 3] = std::array::from_fn(|r| {
                let idx: [i32; 16] = std::array::from_fn(|i| (i ^ (1 << r)) as i32);
                // SAFETY: reads 64 bytes from a 64-byte array.
                unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) }
            });
            let leaders = (0..16usize)
                .filter(|i| i % (1 << KV) == 0)
                .fold(0u16, |a, i| a | (1 << i));
            let out_mask = ((1u32 << (16 >> KV)) - 1) as __mmask16;
            for s0 in (0..n).step_by(16) {
                // SAFETY: s0 + 16 ≤ n; the store writes 16 >> KV minima at s0 >> KV, inside H.
                unsafe {
                    let mut x = _mm512_loadu_ps(xp.add(s0));
                    for swap in &swaps[..KV] {
                        x = _mm512_min_ps(x, _mm512_permutexvar_ps(*swap, x));
                    }
                    let packed = _mm512_maskz_compress_ps(leaders, x);
                    _mm512_mask_storeu_ps(mp.add(s0 >> KV), out_mask, packed);
                }
            }
        }
        let t: [__m512; V] = std::array::from_fn(|j| _mm512_set1_ps(tgt[j]));
        let (mp, vp, cp) = (mn.as_ptr(), vals.as_ptr(), cur.as_mut_ptr());
        for a in 0..1usize << KV {
            for u0 in (0..h).step_by(16) {
                // SAFETY: u0 + 16 ≤ H ≤ mn.len(); a·H + u0 + 16 ≤ n.
                unsafe {
                    let s0 = a * h + u0;
                    let acc = Self::cost16(_mm512_loadu_ps(mp.add(u0)), vp, n, s0, &t);
                    _mm512_storeu_ps(cp.add(s0), acc);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
    }

    /// Both steps straight from their definitions (loops over predecessors and successors).
    fn reference(
        prev: &[f32],
        vals: &[f32],
        tgt: &[f32],
        kv: usize,
        v: usize,
    ) -> (Vec<f32>, Vec<u8>, Vec<f32>) {
        let n = prev.len();
        let h = n >> kv;
        let cost = |base: f32, s: usize| {
            let mut c = base;
            for j in 0..v {
                let d = tgt[j] - vals[j * n + s];
                c += d * d;
            }
            c
        };
        let mut bp = vec![0u8; h];
        let fwd = (0..n)
            .map(|s| {
                let u = s >> kv;
                let (best_a, best) = (0..1usize << kv).map(|a| (a, prev[u | (a * h)])).fold(
                    (0, f32::INFINITY),
                    |acc, x| if x.1 < acc.1 { x } else { acc },
                );
                bp[u] = best_a as u8;
                cost(best, s)
            })
            .collect();
        let bwd = (0..n)
            .map(|s| {
                let u = s % h;
                let best = (0..1usize << kv)
                    .map(|b| prev[(u << kv) | b])
                    .fold(f32::INFINITY, f32::min);
                cost(best, s)
            })
            .collect();
        (fwd, bp, bwd)
    }

    /// Every (KV, V) the dispatcher admits, on every SIMD tier of this CPU, against the
    /// definition; costs must match bit for bit (same summation order), back-pointers exactly.
    #[test]
    fn steps_match_definition_on_every_tier() {
        let mut seed = 11u64;
        for l in [8u32, 12] {
            let n = 1usize << l;
            for (kv, v) in [
                (1, 1),
                (2, 1),
                (3, 1),
                (4, 1),
                (5, 1),
                (6, 1),
                (2, 2),
                (4, 2),
                (6, 2),
            ] {
                let prev: Vec<f32> = (0..n).map(|_| lcg(&mut seed).abs() * 10.0).collect();
                let vals: Vec<f32> = (0..n * v).map(|_| lcg(&mut seed)).collect();
                let tgt: Vec<f32> = (0..v).map(|_| lcg(&mut seed)).collect();
                let (fwd, bp_ref, bwd) = reference(&prev, &vals, &tgt, kv as usize, v);
                for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512] {
                    if !level.is_supported() {
                        continue;
                    }
                    let h = n >> kv;
                    let (mut next, mut m, mut bp) = (vec![0.0; n], vec![0.0; h], vec![0u8; h]);
                    let c = Costs {
                        vals: &vals,
                        tgt: &tgt,
                        kv,
                        v,
                    };
                    let f = Forward {
                        prev: &prev,
                        next: &mut next,
                        m: &mut m,
                        bp: Some(&mut bp),
                    };
                    forward_step(level, f, c);
                    assert_eq!(next, fwd, "forward {level:?} L={l} KV={kv} V={v}");
                    assert_eq!(bp, bp_ref, "back-pointers {level:?} L={l} KV={kv} V={v}");
                    let f = Forward {
                        prev: &prev,
                        next: &mut next,
                        m: &mut m,
                        bp: None,
                    };
                    forward_step(level, f, c);
                    assert_eq!(
                        next, fwd,
                        "forward without bp {level:?} L={l} KV={kv} V={v}"
                    );
                    let mut cur = vec![0.0; n];
                    let b = Backward {
                        next: &prev,
                        cur: &mut cur,
                        mn: &mut m,
                    };
                    backward_step(level, b, c);
                    assert_eq!(cur, bwd, "backward {level:?} L={l} KV={kv} V={v}");
                }
            }
        }
    }
}

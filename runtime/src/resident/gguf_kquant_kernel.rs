//! Decode matvec for llama.cpp's K-quant super-blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K; 256
//! weights each) read as the file stores them, against int8 activations.
//!
//! Every K type is, per 16-weight sub-block `k` (Q4_K/Q5_K's 32-weight sub-blocks are two of
//! them), `ŵ = s_k·u + c_k` with an unsigned code `u` and
//!
//! | type | `u` | `s_k` | `c_k` |
//! |---|---|---|---|
//! | Q2_K | 2-bit | `d·sc_k` | `−dmin·m_k` |
//! | Q3_K | 2-bit + high bit · 4 | `d·sc_k` (signed 6-bit) | `−4·s_k` |
//! | Q4_K | nibble | `d·sc_k` (6-bit) | `−dmin·m_k` |
//! | Q5_K | nibble + fifth bit · 16 | as Q4_K | as Q4_K |
//! | Q6_K | nibble + 2 high bits · 16 | `d·sc_k` (int8) | `−32·s_k` |
//!
//! so `Σ ŵ·x̃ = Σ_k s_k·d_x·Σ u·q + Σ_k c_k·(d_x·Σ q)`: per 64-weight step one `vpdpbusd`
//! (the 64 codes are gathered in weight order from the type's bit fields: nibbles, shifted
//! 2-bit fields, high bits as a byte mask), and per super-block the 16 `s_k` and `c_k` in
//! one vector each. Each step's i32 lanes take their sub-block's `s_k` with one `vpermps`.
//! Four rows share the activation loads. Other tiers run the f32 path (the caller's).

use crate::backend::cpu::q8_activations::{int8_kernels_at, Q8Activations, ACT_BLOCK};
use crate::backend::cpu::SimdLevel;
#[cfg(target_arch = "x86_64")]
use sfx_formats::gguf::{k_scale_min, q3k_scales};
use sfx_formats::gguf::{GgmlType, QK_K};

/// Weights per sub-block lane group (the finest K-quant scale).
const SUB: usize = 16;

/// The K types these kernels read.
const TYPES: [GgmlType; 5] = [
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// Whether the int8 kernels take a `cols`-wide matrix of `ty` at `level`.
pub(crate) fn takes(level: SimdLevel, ty: GgmlType, cols: usize) -> bool {
    int8_kernels_at(level) && TYPES.contains(&ty) && cols > 0 && cols.is_multiple_of(QK_K)
}

/// Per-token values every row shares.
pub(crate) struct Prepared {
    pub(crate) acts: Q8Activations,
    /// Per 64-input step, 16 lanes: `d_x` of its first 32 inputs ×8, of the next 32 ×8.
    dvec: Vec<f32>,
    /// `d_x·Σq` per 16 inputs: what a sub-block's `c_k` multiplies.
    gx16: Vec<f32>,
}

impl Prepared {
    /// Quantizes `x` (a multiple of 256 long).
    pub(crate) fn new(x: &[f32]) -> Self {
        let acts = Q8Activations::quantize(x);
        let dvec = acts.pair_lane_scales();
        let gx16 = acts
            .q
            .chunks_exact(SUB)
            .enumerate()
            .map(|(k, q)| {
                let sum: i32 = q.iter().map(|&v| i32::from(v)).sum();
                acts.d[k * SUB / ACT_BLOCK] * sum as f32
            })
            .collect();
        Self { acts, dvec, gx16 }
    }
}

/// `y[r] = Σ_i ŵ[r, i]·x̃_i` for the `y.len()` rows of super-blocks in `bytes` (the rows'
/// bytes as in the file). The caller checked [`takes`].
pub(crate) fn rows(level: SimdLevel, ty: GgmlType, bytes: &[u8], p: &Prepared, y: &mut [f32]) {
    assert!(
        takes(level, ty, p.acts.q.len()),
        "int8 kernels not available here"
    );
    debug_assert_eq!(
        bytes.len(),
        y.len() * p.acts.q.len() / QK_K * ty.type_size()
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `takes` checked AVX-512F/BW/VL/VBMI/VNNI; `bytes` holds `y.len()` rows of
    // `cols / 256` super-blocks of `ty`.
    unsafe {
        match ty {
            GgmlType::Q2K => vnni::rows::<2>(bytes, p, y),
            GgmlType::Q3K => vnni::rows::<3>(bytes, p, y),
            GgmlType::Q4K => vnni::rows::<4>(bytes, p, y),
            GgmlType::Q5K => vnni::rows::<5>(bytes, p, y),
            _ => vnni::rows::<6>(bytes, p, y),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (level, ty, bytes, p, y);
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::{k_scale_min, q3k_scales, Prepared, QK_K};
    use crate::backend::cpu::q8_activations::by_row_blocks;
    use std::arch::x86_64::*;

    const ROWS: usize = 4;
    const TYPE_SIZE: [usize; 7] = [0, 0, 84, 110, 144, 176, 210];

    #[inline(always)]
    unsafe fn f16_at(p: *const u8) -> f32 {
        let bits = u16::from_le_bytes([*p, *p.add(1)]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
    }

    /// `vpermps` indices of step `t` of a super-block: i32 lane `l` covers weights
    /// `64t + 4l .. 64t + 4l + 3`, sub-block `4t + l/4`.
    fn step_lanes() -> [[i32; 16]; 4] {
        std::array::from_fn(|t| std::array::from_fn(|l| (4 * t + l / 4) as i32))
    }

    /// The super-block's 16 sub-block scales `s_k` and coefficients `c_k`.
    #[inline(always)]
    unsafe fn scales<const T: u8>(b: *const u8) -> (__m512, __m512) {
        match T {
            2 => {
                let sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(b.cast()));
                let lo = _mm512_cvtepi32_ps(_mm512_and_si512(sc, _mm512_set1_epi32(0x0F)));
                let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(sc));
                let (d, dmin) = (f16_at(b.add(80)), f16_at(b.add(82)));
                (
                    _mm512_mul_ps(lo, _mm512_set1_ps(d)),
                    _mm512_mul_ps(hi, _mm512_set1_ps(-dmin)),
                )
            }
            3 => {
                let sc = q3k_scales(std::slice::from_raw_parts(b.add(96), 12));
                let v = _mm512_cvtepi32_ps(_mm512_loadu_si512(sc.as_ptr().cast()));
                let s = _mm512_mul_ps(v, _mm512_set1_ps(f16_at(b.add(108))));
                (s, _mm512_mul_ps(s, _mm512_set1_ps(-4.0)))
            }
            4 | 5 => {
                let (d, dmin) = (f16_at(b), f16_at(b.add(2)));
                let packed = std::slice::from_raw_parts(b.add(4), 12);
                let mut s = [0.0f32; 16];
                let mut c = [0.0f32; 16];
                for j in 0..8 {
                    let (sc, m) = k_scale_min(packed, j);
                    let (sj, cj) = (d * f32::from(sc), -dmin * f32::from(m));
                    s[2 * j] = sj;
                    s[2 * j + 1] = sj;
                    c[2 * j] = cj;
                    c[2 * j + 1] = cj;
                }
                (_mm512_loadu_ps(s.as_ptr()), _mm512_loadu_ps(c.as_ptr()))
            }
            _ => {
                let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(b.add(192).cast()));
                let s = _mm512_mul_ps(_mm512_cvtepi32_ps(sc), _mm512_set1_ps(f16_at(b.add(208))));
                (s, _mm512_mul_ps(s, _mm512_set1_ps(-32.0)))
            }
        }
    }

    /// Two 32-byte halves as one 64-byte vector (`lo` first).
    #[inline(always)]
    unsafe fn join(lo: __m256i, hi: __m256i) -> __m512i {
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
    }

    /// `(v >> shift) & mask` per byte of 32.
    #[inline(always)]
    unsafe fn field(v: __m256i, shift: u32, mask: i8) -> __m256i {
        _mm256_and_si256(
            _mm256_srl_epi16(v, _mm_cvtsi32_si128(shift as i32)),
            _mm256_set1_epi8(mask),
        )
    }

    /// A 64-bit byte mask: bit `l` of `lo` for weights 0..32, of `hi` for 32..64.
    #[inline(always)]
    unsafe fn bit_mask(bytes: __m256i, lo: i32, hi: i32) -> u64 {
        let a = _mm256_test_epi8_mask(bytes, _mm256_set1_epi8((1 << lo) as u8 as i8));
        let b = _mm256_test_epi8_mask(bytes, _mm256_set1_epi8((1 << hi) as u8 as i8));
        u64::from(a) | (u64::from(b) << 32)
    }

    /// The 64 unsigned codes of step `t` (weights `64t..64t + 64`) of super-block `b`.
    #[inline(always)]
    unsafe fn codes<const T: u8>(b: *const u8, t: usize) -> __m512i {
        match T {
            2 | 3 => {
                let (h, j) = (t / 2, 2 * (t % 2));
                let qs = _mm256_loadu_si256(b.add(if T == 2 { 16 } else { 32 } + 32 * h).cast());
                let v = join(field(qs, 2 * j as u32, 3), field(qs, 2 * j as u32 + 2, 3));
                if T == 2 {
                    v
                } else {
                    let hmask = _mm256_loadu_si256(b.cast());
                    let bit = (4 * h + j) as i32;
                    let m = bit_mask(hmask, bit, bit + 1);
                    _mm512_mask_add_epi8(v, m, v, _mm512_set1_epi8(4))
                }
            }
            4 | 5 => {
                let qs = _mm256_loadu_si256(b.add(if T == 4 { 16 } else { 48 } + 32 * t).cast());
                let v = join(field(qs, 0, 0x0F), field(qs, 4, 0x0F));
                if T == 4 {
                    v
                } else {
                    let qh = _mm256_loadu_si256(b.add(16).cast());
                    let m = bit_mask(qh, 2 * t as i32, 2 * t as i32 + 1);
                    _mm512_mask_add_epi8(v, m, v, _mm512_set1_epi8(16))
                }
            }
            _ => {
                let n = t / 2;
                let ql = _mm512_loadu_si512(b.add(64 * n).cast());
                let qh = _mm256_loadu_si256(b.add(128 + 32 * n).cast());
                let nib = _mm512_set1_epi8(0x0F);
                let (low, high) = if t.is_multiple_of(2) {
                    (
                        _mm512_and_si512(ql, nib),
                        join(field(qh, 0, 3), field(qh, 2, 3)),
                    )
                } else {
                    (
                        _mm512_and_si512(_mm512_srli_epi16::<4>(ql), nib),
                        join(field(qh, 4, 3), field(qh, 6, 3)),
                    )
                };
                _mm512_or_si512(low, _mm512_slli_epi16::<4>(high))
            }
        }
    }

    /// # Safety
    /// AVX-512F/BW/VL/VBMI/VNNI and F16C must be available; `bytes` must hold `y.len()` rows
    /// of `cols / 256` super-blocks of type `T` (`cols = p.acts.q.len()`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,f16c,fma")]
    pub(super) unsafe fn rows<const T: u8>(bytes: &[u8], p: &Prepared, y: &mut [f32]) {
        by_row_blocks!(y, ROWS, |r0, yb, R| rows_block::<T, R>(bytes, p, r0, yb))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,f16c,fma")]
    unsafe fn rows_block<const T: u8, const R: usize>(
        bytes: &[u8],
        p: &Prepared,
        r0: usize,
        y: &mut [f32],
    ) {
        let ts = TYPE_SIZE[usize::from(T)];
        let nsb = p.acts.q.len() / QK_K;
        let row_bytes = nsb * ts;
        let rows: [*const u8; R] =
            std::array::from_fn(|i| bytes.as_ptr().add((r0 + i) * row_bytes));
        let lanes = step_lanes();
        let idx: [__m512i; 4] =
            std::array::from_fn(|t| _mm512_loadu_si512(lanes[t].as_ptr().cast()));
        let (xq, dv, gp) = (p.acts.q.as_ptr(), p.dvec.as_ptr(), p.gx16.as_ptr());
        let mut acc = [_mm512_setzero_ps(); R];
        let mut side = [_mm512_setzero_ps(); R];
        for sb in 0..nsb {
            let gx = _mm512_loadu_ps(gp.add(16 * sb));
            let mut s = [_mm512_setzero_ps(); R];
            for i in 0..R {
                let (si, ci) = scales::<T>(rows[i].add(sb * ts));
                s[i] = si;
                side[i] = _mm512_fmadd_ps(ci, gx, side[i]);
            }
            for (t, idx_t) in idx.iter().enumerate() {
                let step = 4 * sb + t;
                let x = _mm512_loadu_si512(xq.add(64 * step).cast());
                let d = _mm512_loadu_ps(dv.add(16 * step));
                for i in 0..R {
                    let c = codes::<T>(rows[i].add(sb * ts), t);
                    let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c, x);
                    let sv = _mm512_mul_ps(_mm512_permutexvar_ps(*idx_t, s[i]), d);
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sv, acc[i]);
                }
            }
        }
        for i in 0..R {
            y[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i], side[i]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resident::gguf_blocks::tests::random_blocks;
    use crate::test_util::{assert_rows_match_f64, lcg};
    use sfx_formats::gguf::dequantize_to_vec;

    /// Every K type against the f64 product of llama.cpp's dequantization (the formats
    /// crate's, from ggml's block definitions) with the dequantized int8 activations. Bound:
    /// 1e-5 of Σ|ŵ·x̃| + 1e-5 (f32 rounding of the per-step terms).
    #[test]
    fn matches_the_f64_product_with_quantized_activations() {
        let mut seed = 77u64;
        for ty in TYPES {
            for &(rows, cols) in &[(5, 256), (9, 1024), (3, 4096)] {
                let level = SimdLevel::detect();
                if !takes(level, ty, cols) {
                    eprintln!("skipped: no AVX-512 VNNI on this machine (f32 path runs)");
                    return;
                }
                let bytes = random_blocks(ty, rows, cols, &mut seed).bytes;
                let deq = dequantize_to_vec(ty, &bytes, rows * cols).unwrap();
                let x: Vec<f32> = (0..cols)
                    .map(|i| lcg(&mut seed) * (1.0 + (i % 5) as f32))
                    .collect();
                let p = Prepared::new(&x);
                let xt = p.acts.dequantized();
                let mut y = vec![f32::NAN; rows];
                super::rows(level, ty, &bytes, &p, &mut y);
                assert_rows_match_f64(&deq, &xt, &y, &format!("{ty} {rows}x{cols}"));
            }
        }
    }
}

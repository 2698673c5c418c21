//! Decode matvec for llama.cpp's 32-weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) against
//! int8 activations ([`Q8Activations`], whose blocks are the same 32 inputs).
//!
//! Every block stores unsigned codes `u` (a nibble, a nibble plus a fifth bit, or an int8
//! code offset by 128) with `ŵ = d·u + c`: `c = m` for the `_1` types and `c = −o·d` for the
//! `_0` types (`o` = 8, 16, 128). So with activation block `x̃ = d_x·q`,
//!
//! `Σ_i ŵ_i·x̃_i = d·d_x·Σ_i u_i·q_i + c·(d_x·Σ_i q_i)`,
//!
//! an exact integer dot per block, one scale product, and one coefficient times a per-token
//! block sum: `Ŵ·x̃` up to f32 rounding of the per-block terms.
//!
//! - AVX-512 with VNNI: two blocks (64 codes) per `vpdpbusd`. Nibble blocks keep GGUF's byte
//!   order (byte `j` holds codes `j` and `j + 16`), so a pair's 32 bytes split into low and
//!   high nibbles make the 64 codes `[a₀..₁₅, b₀..₁₅, a₁₆..₃₁, b₁₆..₃₁]`; the activations are
//!   permuted that way once per token. Fifth bits come from the pair's `qh` words as a byte
//!   mask (one masked OR). The block scale products of 16 blocks are formed in one vector,
//!   and each pair's lanes pick theirs with one `vpermps`. Four rows share the activation
//!   loads.
//! - Other tiers dequantize blocks into f32 dots (the caller's path; [`int8_kernels_at`]).
//!
//! Shapes: input widths that are multiples of 64 (an even number of blocks; every Llama/Qwen
//! width is); others run the f32 path.

use crate::backend::cpu::q8_activations::{int8_kernels_at, Q8Activations, ACT_BLOCK};
use crate::backend::cpu::SimdLevel;
use half::f16;

/// Inputs per kernel step (two blocks).
const PAIR: usize = 2 * ACT_BLOCK;

/// How a block's codes are stored once loaded (see [`super::gguf_blocks::LegacyBlocks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CodeLayout {
    /// 16 bytes per block, byte `j` = code `j` (low nibble) and `j + 16` (high nibble).
    Nibbles,
    /// [`CodeLayout::Nibbles`] plus a 32-bit word per block: bit `j` = bit 4 of code `j`.
    NibblesHigh,
    /// 32 bytes per block, code `j` in byte `j` (int8 codes stored offset by 128).
    Bytes,
}

/// Whether the int8 kernels take a `cols`-wide matrix at `level`.
pub(crate) fn takes(level: SimdLevel, cols: usize) -> bool {
    int8_kernels_at(level) && cols > 0 && cols.is_multiple_of(PAIR)
}

/// Per-token values every row shares.
pub(crate) struct Prepared {
    pub(crate) acts: Q8Activations,
    /// `d_x·Σq` per block: what a block's coefficient `c` multiplies.
    gx: Vec<f32>,
    /// Nibble layouts: per pair of blocks, the activations in code order
    /// `[a₀..₁₅, b₀..₁₅, a₁₆..₃₁, b₁₆..₃₁]`.
    paired: Vec<i8>,
}

impl Prepared {
    /// Quantizes `x` (`takes(x.len())` must hold) for codes stored as `layout`.
    pub(crate) fn new(x: &[f32], layout: CodeLayout) -> Self {
        let acts = Q8Activations::quantize(x);
        let gx = acts
            .d
            .iter()
            .zip(&acts.sums)
            .map(|(&d, &s)| d * s as f32)
            .collect();
        let mut paired = Vec::new();
        if layout != CodeLayout::Bytes {
            paired.reserve(acts.q.len());
            for pair in acts.q.chunks_exact(PAIR) {
                let (a, b) = pair.split_at(ACT_BLOCK);
                paired.extend_from_slice(&a[..16]);
                paired.extend_from_slice(&b[..16]);
                paired.extend_from_slice(&a[16..]);
                paired.extend_from_slice(&b[16..]);
            }
        }
        Self { acts, gx, paired }
    }
}

/// A block of consecutive rows in the loaded layout.
pub(crate) struct BlockRows<'a> {
    pub(crate) layout: CodeLayout,
    /// Code bytes: 16 (nibbles) or 32 (bytes) per block.
    pub(crate) qs: &'a [u8],
    /// Fifth bits per block ([`CodeLayout::NibblesHigh`] only).
    pub(crate) qh: &'a [u32],
    /// Scale per block.
    pub(crate) d: &'a [f16],
    /// Minimum per block for the `_1` types; empty for the `_0` types.
    pub(crate) m: &'a [f16],
    /// `o` of the `_0` types (`c = −o·d`).
    pub(crate) offset: f32,
}

/// `y[r] = Σ_i ŵ[r, i]·x̃_i` for every row of `w` (the caller checked [`takes`]).
pub(crate) fn rows(level: SimdLevel, w: &BlockRows<'_>, p: &Prepared, y: &mut [f32]) {
    assert!(
        takes(level, p.acts.q.len()),
        "int8 kernels not available here"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `takes` checked AVX-512F/BW/VL/VBMI/VNNI; `w` holds `y.len()` rows of the
    // layout's bytes, words and scales for `p.acts.q.len()` inputs (the caller's slices).
    unsafe {
        match w.layout {
            CodeLayout::Nibbles => vnni::rows::<0>(w, p, y),
            CodeLayout::NibblesHigh => vnni::rows::<1>(w, p, y),
            CodeLayout::Bytes => vnni::rows::<2>(w, p, y),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::{BlockRows, Prepared, PAIR};
    use crate::backend::cpu::q8_activations::by_row_blocks;
    use std::arch::x86_64::*;

    /// Rows per interleaved block: they share the activation, index and block-sum loads.
    const ROWS: usize = 4;
    /// Blocks whose scales are converted and multiplied in one vector.
    const CHUNK: usize = 16;

    /// `vpermps` indices of pair `p` (0..8) of a chunk: which block's scale product each i32
    /// lane of the pair's dot takes. Nibble layouts: lanes 0–3 and 8–11 are block `2p`, 4–7
    /// and 12–15 block `2p + 1`; bytes: lanes 0–7 and 8–15.
    fn lane_blocks(bytes: bool) -> [[i32; 16]; 8] {
        std::array::from_fn(|p| {
            std::array::from_fn(|l| {
                let second = if bytes { l >= 8 } else { (l / 4) % 2 == 1 };
                (2 * p + usize::from(second)) as i32
            })
        })
    }

    /// # Safety
    /// AVX-512F/BW/VL/VBMI/VNNI and F16C must be available; `w` must hold `y.len()` rows of
    /// `cols / 32` blocks (`cols = p.acts.q.len()`, `super::takes(cols)`) in layout `L`
    /// (0 nibbles, 1 nibbles with fifth bits, 2 bytes).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,f16c,fma")]
    pub(super) unsafe fn rows<const L: u8>(w: &BlockRows<'_>, p: &Prepared, y: &mut [f32]) {
        let index = lane_blocks(L == 2);
        by_row_blocks!(y, ROWS, |r0, yb, R| rows_block::<L, R>(
            w, p, &index, r0, yb
        ))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,f16c,fma")]
    unsafe fn rows_block<const L: u8, const R: usize>(
        w: &BlockRows<'_>,
        p: &Prepared,
        index: &[[i32; 16]; 8],
        r0: usize,
        y: &mut [f32],
    ) {
        let blocks = p.acts.d.len();
        let block_bytes = if L == 2 { 32 } else { 16 };
        let has_min = !w.m.is_empty();
        let neg_offset = _mm512_set1_ps(-w.offset);
        let nib = _mm256_set1_epi8(0x0F);
        let fifth = _mm512_set1_epi8(0x10);
        let xs: *const i8 = if L == 2 {
            p.acts.q.as_ptr()
        } else {
            p.paired.as_ptr()
        };
        let first: [usize; R] = std::array::from_fn(|i| (r0 + i) * blocks);
        let mut acc = [_mm512_setzero_ps(); R];
        let mut side = [_mm512_setzero_ps(); R];
        for c0 in (0..blocks).step_by(CHUNK) {
            let nb = (blocks - c0).min(CHUNK);
            let km: __mmask16 = if nb == CHUNK { !0 } else { (1u16 << nb) - 1 };
            let dx = _mm512_maskz_loadu_ps(km, p.acts.d.as_ptr().add(c0));
            let gx = _mm512_maskz_loadu_ps(km, p.gx.as_ptr().add(c0));
            let mut s = [_mm512_setzero_ps(); R];
            for i in 0..R {
                let b = first[i] + c0;
                let dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(km, w.d.as_ptr().add(b).cast()));
                s[i] = _mm512_mul_ps(dw, dx);
                let c = if has_min {
                    _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(km, w.m.as_ptr().add(b).cast()))
                } else {
                    _mm512_mul_ps(dw, neg_offset)
                };
                side[i] = _mm512_fmadd_ps(c, gx, side[i]);
            }
            for (pp, lanes) in index.iter().enumerate().take(nb / 2) {
                let pair = c0 / 2 + pp;
                let x = _mm512_loadu_si512(xs.add(PAIR * pair).cast());
                let idx = _mm512_loadu_si512(lanes.as_ptr().cast());
                for i in 0..R {
                    let b = first[i] + 2 * pair;
                    let codes = if L == 2 {
                        _mm512_loadu_si512(w.qs.as_ptr().add(b * block_bytes).cast())
                    } else {
                        let raw = _mm256_loadu_si256(w.qs.as_ptr().add(b * block_bytes).cast());
                        let lo = _mm256_and_si256(raw, nib);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), nib);
                        let codes = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                        if L == 1 {
                            let (qa, qb) = (
                                u64::from(*w.qh.get_unchecked(b)),
                                u64::from(*w.qh.get_unchecked(b + 1)),
                            );
                            let high = (qa & 0xFFFF)
                                | (qb & 0xFFFF) << 16
                                | (qa >> 16) << 32
                                | (qb >> 16) << 48;
                            _mm512_mask_add_epi8(codes, high, codes, fifth)
                        } else {
                            codes
                        }
                    };
                    let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, x);
                    let sv = _mm512_permutexvar_ps(idx, s[i]);
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
    use crate::resident::gguf_blocks::{LegacyBlocks, BLOCK_TYPES};
    use crate::test_util::{assert_rows_match_f64, lcg};

    /// Every type on every tier against the f64 product of llama.cpp's dequantization (the
    /// formats crate's, written from ggml's block definitions) with the dequantized int8
    /// activations: what the kernel computes exactly up to f32 rounding. Bound: 1e-5 of
    /// Σ|ŵ·x̃| + 1e-5. Widths of 64 (one pair), 576 (18 blocks: a 16-block chunk and a
    /// short one) and 1536.
    #[test]
    fn matches_the_f64_product_with_quantized_activations() {
        let mut seed = 21u64;
        for ty in BLOCK_TYPES
            .into_iter()
            .filter(|&t| LegacyBlocks::supports(t))
        {
            for &(rows, cols) in &[(7, 64), (9, 576), (5, 1536)] {
                let t = random_blocks(ty, rows, cols, &mut seed);
                let deq = t.dequantize().unwrap();
                let w = LegacyBlocks::from_gguf(&t).unwrap();
                let x: Vec<f32> = (0..cols)
                    .map(|i| lcg(&mut seed) * (1.0 + (i % 5) as f32))
                    .collect();
                let p = Prepared::new(&x, w.layout());
                let xt = p.acts.dequantized();
                for level in SimdLevel::supported() {
                    if !takes(level, cols) {
                        eprintln!("{level:?}: no int8 kernels at this tier (f32 path runs)");
                        continue;
                    }
                    let mut y = vec![f32::NAN; rows];
                    rows_of(level, &w, &p, &mut y);
                    let what = format!("{level:?} {ty} {rows}x{cols}");
                    assert_rows_match_f64(&deq, &xt, &y, &what);
                }
            }
        }
    }

    fn rows_of(level: SimdLevel, w: &LegacyBlocks, p: &Prepared, y: &mut [f32]) {
        super::rows(level, &w.block_rows(0, y.len()), p, y);
    }

    #[test]
    fn widths_off_the_pair_grid_are_not_taken() {
        let level = SimdLevel::detect();
        assert!(!takes(level, 32));
        assert!(!takes(level, 0));
        assert_eq!(takes(level, 576), int8_kernels_at(level));
        assert!(!takes(SimdLevel::Avx2, 576));
    }
}

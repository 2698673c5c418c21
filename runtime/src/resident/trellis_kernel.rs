//! AVX-512 decode matvec for trellis tiles: `y = Ŵ·x` for one 16-row tile row, decoding the
//! bitshift trellis in registers (never writing Ŵ to memory).
//!
//! Per group of 16 trellis steps: one `vpermb`/`vpermi2b` gathers, for every lane, the three
//! stream bytes holding its 16-bit window (tail-biting wrap folded into the byte indices), a
//! variable shift and mask give the 16 states, and the code turns them into values:
//! - HYB: `h = x·(x+1)`, one `vpgatherdd` of the f16 pair from the 2^q-row table, the sign of
//!   the first value flipped by XOR with `h & 0x8000` (bit 15 of `h` is exactly the f16 sign
//!   bit of the low half), two `vcvtph2ps` → 32 weights = 2 tile rows (row-major tiles) or
//!   rows g and 8+g interleaved by lane pairs (QTIP's fragment order, handled by a permuted x
//!   and a masked final reduction);
//! - 1MAD: LCG, byte sum with one `vpdpbusd` against a vector of ones, affine map;
//! - 3INST: LCG, mask/XOR, the two f16 halves widened and added.
//!
//! Accumulation is per tile row in 16 f32 lanes; rows are reduced once at the end of the tile
//! row, so the inner loop has no horizontal operations.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::trellis::ONE_MAD_SCALE;
use sfx_formats::resident::{TileOrder, TrellisCode, TILE_SIDE};

/// Byte-permute indices and per-lane shifts for one (K, V) pair.
#[derive(Debug, Clone)]
pub(crate) struct Tables {
    /// One 64-byte index vector per group of 16 steps.
    idx: Vec<[u8; 64]>,
    /// `16 − (bit offset mod 8)` per lane (the same for every group).
    shift: [u32; 16],
    /// HYB table as f16-pair dwords.
    lut: Vec<u32>,
    code: TrellisCode,
    k: usize,
    mma: bool,
}

/// Whether the running CPU has everything the kernel uses.
pub(crate) fn supported() -> bool {
    crate::backend::cpu::simd::avx512_int8_supported()
}

impl Tables {
    /// `None` for combinations the kernel does not cover (fragment order with a V = 1 code).
    pub(crate) fn new(
        code: TrellisCode,
        k: usize,
        order: TileOrder,
        tlut: &[half::f16],
    ) -> Option<Self> {
        let v = code.values_per_step();
        let mma = order == TileOrder::Mma;
        if mma && v != 2 {
            return None;
        }
        let stream = 32 * k; // bytes per tile
        let groups = 256 / (16 * v);
        let idx = (0..groups)
            .map(|g| {
                let mut ix = [0u8; 64];
                for i in 0..16 {
                    let o = k * v * (16 * g + i);
                    let b = o >> 3;
                    // Little-endian dword = B[b]<<24 | B[b+1]<<16 | B[b+2]<<8 | B[b+3].
                    for j in 0..4 {
                        ix[4 * i + j] = ((b + 3 - j) % stream) as u8;
                    }
                }
                ix
            })
            .collect();
        let shift = std::array::from_fn(|i| (16 - ((k * v * i) & 7)) as u32);
        let lut = tlut
            .chunks_exact(2)
            .map(|c| u32::from(c[0].to_bits()) | u32::from(c[1].to_bits()) << 16)
            .collect();
        Some(Self {
            idx,
            shift,
            lut,
            code,
            k,
            mma,
        })
    }
}

/// Lane permutation of x for QTIP's fragment order: lane `2j+v` of the first (second) half
/// of a 16-step group holds step `j` (`j + 8`), whose column is `8·((j>>1)&1) + 2·((j>>2)&3) + v`.
fn mma_x_perm(second: bool) -> [i32; 16] {
    std::array::from_fn(|lane| {
        let j = (lane >> 1) + if second { 8 } else { 0 };
        let v = lane & 1;
        (8 * ((j >> 1) & 1) + 2 * ((j >> 2) & 3) + v) as i32
    })
}

/// `y[0..16] = Ŵ_tilerow · x` for one tile row: `streams` holds the row's `tc_n` tile streams,
/// `x` the `16·tc_n` rotated inputs.
///
/// # Safety
/// The CPU must support AVX-512F/BW/VBMI/VNNI ([`supported`]); `streams.len() ==
/// tc_n·32·K`, `x.len() == 16·tc_n`, `y.len() == 16`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vnni,avx512vl,f16c,fma")]
pub(crate) unsafe fn tile_row(t: &Tables, streams: &[u8], x: &[f32], y: &mut [f32]) {
    match (t.code, t.k) {
        (TrellisCode::Hyb { q }, 2) => hyb::<2>(t, u32::from(q), streams, x, y),
        (TrellisCode::Hyb { q }, 3) => hyb::<3>(t, u32::from(q), streams, x, y),
        (TrellisCode::Hyb { q }, 4) => hyb::<4>(t, u32::from(q), streams, x, y),
        (TrellisCode::Hyb { q }, _) => hyb::<1>(t, u32::from(q), streams, x, y),
        (code, 2) => computed::<2>(t, code, streams, x, y),
        (code, 3) => computed::<3>(t, code, streams, x, y),
        (code, 4) => computed::<4>(t, code, streams, x, y),
        (code, _) => computed::<1>(t, code, streams, x, y),
    }
}

/// Loads a tile stream of `32·K` bytes into two registers (the second masked, so no read
/// goes past the tile) and returns the 16 states of group `g`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn states<const K: usize>(
    lo: __m512i,
    hi: __m512i,
    idx: &[u8; 64],
    shift: __m512i,
) -> __m512i {
    let ix = _mm512_loadu_si512(idx.as_ptr().cast());
    let d = if 32 * K <= 64 {
        _mm512_permutexvar_epi8(ix, lo)
    } else {
        _mm512_permutex2var_epi8(lo, ix, hi)
    };
    _mm512_and_si512(_mm512_srlv_epi32(d, shift), _mm512_set1_epi32(0xFFFF))
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn load_stream<const K: usize>(p: *const u8) -> (__m512i, __m512i) {
    let n = 32 * K;
    if n == 32 {
        // K = 1: one 32-byte stream, duplicated so indices mod 64 wrap as mod 32.
        let h = _mm256_loadu_si256(p.cast());
        let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(h), h);
        (z, z)
    } else if n <= 64 {
        (_mm512_loadu_si512(p.cast()), _mm512_setzero_si512())
    } else {
        let rest = n - 64;
        let mask: __mmask64 = if rest >= 64 { !0 } else { (1u64 << rest) - 1 };
        (
            _mm512_loadu_si512(p.cast()),
            _mm512_maskz_loadu_epi8(mask, p.add(64).cast()),
        )
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn hyb<const K: usize>(t: &Tables, q: u32, streams: &[u8], x: &[f32], y: &mut [f32]) {
    let tb = 32 * K;
    let tc_n = x.len() / TILE_SIDE;
    let shift = _mm512_loadu_si512(t.shift.as_ptr().cast());
    let one = _mm512_set1_epi32(1);
    let qmask = _mm512_set1_epi32(((1u32 << q) - 1) as i32);
    let sign = _mm512_set1_epi32(0x8000);
    let qshift = _mm_cvtsi32_si128((15 - q) as i32);
    let (pa, pb) = (mma_x_perm(false), mma_x_perm(true));
    let (pa, pb) = (
        _mm512_loadu_si512(pa.as_ptr().cast()),
        _mm512_loadu_si512(pb.as_ptr().cast()),
    );
    let mut acc = [_mm512_setzero_ps(); 16];
    let lut = t.lut.as_ptr().cast::<i32>();
    for tc in 0..tc_n {
        let (lo, hi) = load_stream::<K>(streams.as_ptr().add(tc * tb));
        let xv = _mm512_loadu_ps(x.as_ptr().add(tc * TILE_SIDE));
        let (xa, xb) = if t.mma {
            (_mm512_permutexvar_ps(pa, xv), _mm512_permutexvar_ps(pb, xv))
        } else {
            (xv, xv)
        };
        for g in 0..8 {
            let st = states::<K>(lo, hi, &t.idx[g], shift);
            let h = _mm512_mullo_epi32(st, _mm512_add_epi32(st, one));
            let li = _mm512_and_si512(_mm512_srl_epi32(h, qshift), qmask);
            let pair = _mm512_i32gather_epi32::<4>(li, lut);
            let pair = _mm512_xor_si512(pair, _mm512_and_si512(h, sign));
            let w0 = _mm512_cvtph_ps(_mm512_castsi512_si256(pair));
            let w1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(pair));
            acc[2 * g] = _mm512_fmadd_ps(w0, xa, acc[2 * g]);
            acc[2 * g + 1] = _mm512_fmadd_ps(w1, xb, acc[2 * g + 1]);
        }
    }
    if t.mma {
        // Lanes with bit 1 clear hold row g, the others row 8 + g (step parity).
        let even: __mmask16 = 0x3333;
        for g in 0..8 {
            let s = _mm512_add_ps(acc[2 * g], acc[2 * g + 1]);
            y[g] = _mm512_mask_reduce_add_ps(even, s);
            y[8 + g] = _mm512_mask_reduce_add_ps(!even, s);
        }
    } else {
        for (r, a) in acc.iter().enumerate() {
            y[r] = _mm512_reduce_add_ps(*a);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn computed<const K: usize>(
    t: &Tables,
    code: TrellisCode,
    streams: &[u8],
    x: &[f32],
    y: &mut [f32],
) {
    let tb = 32 * K;
    let tc_n = x.len() / TILE_SIDE;
    let shift = _mm512_loadu_si512(t.shift.as_ptr().cast());
    let mut acc = [_mm512_setzero_ps(); 16];
    let ones = _mm512_set1_epi8(1);
    let one_mad = code == TrellisCode::OneMad;
    let (mul, add) = if one_mad {
        (_mm512_set1_epi32(34_038_481), _mm512_set1_epi32(76_625_530))
    } else {
        (_mm512_set1_epi32(89_226_354), _mm512_set1_epi32(64_248_484))
    };
    let mad_scale = _mm512_set1_ps(ONE_MAD_SCALE);
    let mask3 = _mm512_set1_epi32(0x8FFF_8FFFu32 as i32);
    let xor3 = _mm512_set1_epi32(0x3B60_3B60);
    // 1MAD: value = s·c − 510·c, so Σ value·x = Σ s·(c·x) − 510·c·Σx; the second term is
    // the same for every row of the tile row and is added once at the end.
    let mut xsum = _mm512_setzero_ps();
    for tc in 0..tc_n {
        let (lo, hi) = load_stream::<K>(streams.as_ptr().add(tc * tb));
        let xv = _mm512_loadu_ps(x.as_ptr().add(tc * TILE_SIDE));
        if one_mad {
            xsum = _mm512_add_ps(xsum, xv);
            let cx = _mm512_mul_ps(xv, mad_scale);
            for (g, a) in acc.iter_mut().enumerate() {
                let st = states::<K>(lo, hi, &t.idx[g], shift);
                let z = _mm512_add_epi32(_mm512_mullo_epi32(st, mul), add);
                let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z, ones);
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), cx, *a);
            }
        } else {
            for (g, a) in acc.iter_mut().enumerate() {
                let st = states::<K>(lo, hi, &t.idx[g], shift);
                let z = _mm512_add_epi32(_mm512_mullo_epi32(st, mul), add);
                let m = _mm512_xor_si512(_mm512_and_si512(z, mask3), xor3);
                let low = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(m));
                let high = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(m)));
                *a = _mm512_fmadd_ps(_mm512_add_ps(low, high), xv, *a);
            }
        }
    }
    let offset = if one_mad {
        -510.0 * 4096.0 / 605_391.0 * _mm512_reduce_add_ps(xsum)
    } else {
        0.0
    };
    for (r, a) in acc.iter().enumerate() {
        y[r] = _mm512_reduce_add_ps(*a) + offset;
    }
}

/// Decodes one tile stream into `out` (256 values in sequence order, i.e. tile row-major for
/// [`TileOrder::RowMajor`]; the caller places values for other orders). For prefill panels.
///
/// # Safety
/// As [`tile_row`]; `stream.len() == 32·K`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vnni,avx512vl,f16c,fma")]
pub(crate) unsafe fn decode_tile_seq(t: &Tables, stream: &[u8], out: &mut [f32; 256]) {
    match t.k {
        1 => decode_seq::<1>(t, stream, out),
        2 => decode_seq::<2>(t, stream, out),
        3 => decode_seq::<3>(t, stream, out),
        _ => decode_seq::<4>(t, stream, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn decode_seq<const K: usize>(t: &Tables, stream: &[u8], out: &mut [f32; 256]) {
    let shift = _mm512_loadu_si512(t.shift.as_ptr().cast());
    let (lo, hi) = load_stream::<K>(stream.as_ptr());
    let o = out.as_mut_ptr();
    match t.code {
        TrellisCode::Hyb { q } => {
            let one = _mm512_set1_epi32(1);
            let qmask = _mm512_set1_epi32(((1u32 << q) - 1) as i32);
            let sign = _mm512_set1_epi32(0x8000);
            let qshift = _mm_cvtsi32_si128((15 - u32::from(q)) as i32);
            let lut = t.lut.as_ptr().cast::<i32>();
            for g in 0..8 {
                let st = states::<K>(lo, hi, &t.idx[g], shift);
                let h = _mm512_mullo_epi32(st, _mm512_add_epi32(st, one));
                let li = _mm512_and_si512(_mm512_srl_epi32(h, qshift), qmask);
                let pair = _mm512_i32gather_epi32::<4>(li, lut);
                let pair = _mm512_xor_si512(pair, _mm512_and_si512(h, sign));
                _mm512_storeu_ps(o.add(32 * g), _mm512_cvtph_ps(_mm512_castsi512_si256(pair)));
                _mm512_storeu_ps(
                    o.add(32 * g + 16),
                    _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(pair)),
                );
            }
        }
        code => {
            let one_mad = code == TrellisCode::OneMad;
            let (mul, add) = if one_mad {
                (_mm512_set1_epi32(34_038_481), _mm512_set1_epi32(76_625_530))
            } else {
                (_mm512_set1_epi32(89_226_354), _mm512_set1_epi32(64_248_484))
            };
            let ones = _mm512_set1_epi8(1);
            let mad_scale = _mm512_set1_ps(ONE_MAD_SCALE);
            let mad_bias = _mm512_set1_ps(-510.0 * 4096.0 / 605_391.0);
            let mask3 = _mm512_set1_epi32(0x8FFF_8FFFu32 as i32);
            let xor3 = _mm512_set1_epi32(0x3B60_3B60);
            for g in 0..16 {
                let st = states::<K>(lo, hi, &t.idx[g], shift);
                let z = _mm512_add_epi32(_mm512_mullo_epi32(st, mul), add);
                let w = if one_mad {
                    let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z, ones);
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), mad_scale, mad_bias)
                } else {
                    let m = _mm512_xor_si512(_mm512_and_si512(z, mask3), xor3);
                    _mm512_add_ps(
                        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(m)),
                        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(m))),
                    )
                };
                _mm512_storeu_ps(o.add(16 * g), w);
            }
        }
    }
}

//! Decode matvec for group codes against int8 activations ([`Q8Activations`]).
//!
//! `y_r = Σ_g s_{r,g}·(Σ_{b∈g} d_b·Σ_{i∈b} q_{r,i}·a_i − z_{r,g}·Σ_{b∈g} d_b·Σ_{i∈b} a_i)`:
//! the inner sums are exact integer dots of the unsigned codes with the int8 activations, so
//! the result is `Ŵ·x̃` up to f32 rounding of the per-block terms.
//!
//! - AVX-512 with VNNI and VBMI, 2- and 4-bit codes in groups of a multiple of 128: bit
//!   planes. A 128-code unit is `16·B` bytes; plane `j` (`(bytes >> B·j) & mask`) holds codes
//!   `P·k + j` (`P = 8/B`) in byte `k`, so with the activations permuted the same way once per
//!   token each plane is one `vpdpbusd` (64 multiply-adds into 16 i32 lanes; 2-bit units use
//!   the 256-bit form). Every i32 lane sums codes of one activation block, so one convert and
//!   one FMA with a per-token vector of block scales close the unit, and the group scale is
//!   applied once per group. Measured on Zen 4 this is about twice the generic unpack below.
//! - AVX-512 with VNNI and VBMI, other widths: 64 codes per step. A masked load takes the
//!   `8·B` code bytes, `vpermb` gives every 64-bit lane the `B` bytes of its 8 codes,
//!   `vpmultishiftqb` moves code `j` of each lane to byte `j` (bit offset `B·j`), an AND drops
//!   the neighbours' bits, one `vpdpbusd`. Lane `l` sums codes `4l..4l+3`: lanes 0–7 are
//!   activation block `2c`, 8–15 block `2c+1`. 8-bit codes skip the unpack.
//! - Other tiers keep the f32 kernels ([`int8_kernels_at`]).
//!
//! Look-up-table codes (`sfx_formats::resident::LutQuantized`) run through the same kernels:
//! a row's table of unsigned levels (`level + 128`, at most 64 of them) sits in one register
//! and one `vpermb` per code vector maps the unpacked codes to their levels before the
//! `vpdpbusd`; the row is then one group whose zero point is 128 and whose scale is the row's.
//!
//! Shapes: input width and group size multiples of 64 (every Llama/Qwen width is); others run
//! the f32 kernel.

use crate::backend::cpu::q8_activations::{int8_kernels_at, Q8Activations, ACT_BLOCK};
use crate::backend::cpu::SimdLevel;
use half::f16;

/// Codes per AVX-512 step, and the granule shapes must be multiples of.
const STEP: usize = 64;
/// Codes per bit-plane unit (the planar kernels' groups must be multiples of it).
const UNIT: usize = 128;

/// Whether the bit-plane kernel runs `bits`-bit codes in `group`-code groups.
fn planar(bits: u8, group: usize) -> bool {
    matches!(bits, 2 | 4) && group.is_multiple_of(UNIT)
}

/// Whether the int8 kernels take a `cols`-wide matrix of `group`-code groups at `level`.
pub(crate) fn takes(level: SimdLevel, cols: usize, group: usize) -> bool {
    int8_kernels_at(level) && cols > 0 && cols.is_multiple_of(STEP) && group.is_multiple_of(STEP)
}

/// Per-token values every row shares.
pub(crate) struct Prepared {
    pub(crate) acts: Q8Activations,
    /// `Σ_{b∈g} d_b·sum_b` per group: the zero point's coefficient.
    gx: Vec<f32>,
    /// Per 64-input step, 16 lanes: `d_{2c}` ×8 then `d_{2c+1}` ×8.
    dvec: Vec<f32>,
    /// Bit-plane kernels: per 128-input unit, the activations in plane order (plane `j`,
    /// byte `k` = input `P·k + j`), zero past the last input.
    planes: Vec<i8>,
    /// Bit-plane kernels: per unit, the i32 lanes' block scales (16 lanes at 4 bits, 8 at 2).
    dunit: Vec<f32>,
    group: usize,
}

impl Prepared {
    /// Quantizes `x` for `bits`-bit codes (`takes(x.len(), group)` must hold).
    pub(crate) fn new(x: &[f32], group: usize, bits: u8) -> Self {
        let acts = Q8Activations::quantize(x);
        let per_group = group / ACT_BLOCK;
        let gx = acts
            .d
            .chunks(per_group)
            .zip(acts.sums.chunks(per_group))
            .map(|(d, s)| d.iter().zip(s).map(|(&d, &s)| d * s as f32).sum())
            .collect();
        let (mut planes, mut dunit, mut dvec) = (Vec::new(), Vec::new(), Vec::new());
        if planar(bits, group) {
            let per = 8 / usize::from(bits);
            let lanes = 4 * usize::from(bits);
            let units = x.len().div_ceil(UNIT);
            planes.resize(units * UNIT, 0);
            for (u, pu) in planes.chunks_exact_mut(UNIT).enumerate() {
                let xs = &acts.q[u * UNIT..((u + 1) * UNIT).min(x.len())];
                let plane_len = UNIT / per;
                for (j, pj) in pu.chunks_exact_mut(plane_len).enumerate() {
                    for (k, v) in pj.iter_mut().enumerate() {
                        *v = xs.get(per * k + j).copied().unwrap_or(0);
                    }
                }
                // i32 lane l sums bytes 4l..4l+3 of every plane: inputs 4·per·l onwards.
                dunit.extend((0..lanes).map(|l| {
                    let b = u * UNIT / ACT_BLOCK + 4 * per * l / ACT_BLOCK;
                    acts.d.get(b).copied().unwrap_or(0.0)
                }));
            }
        } else {
            dvec = acts.pair_lane_scales();
        }
        Self {
            acts,
            gx,
            dvec,
            planes,
            dunit,
            group,
        }
    }
}

/// A block of consecutive rows: their codes, scales and zero points.
pub(crate) struct CodeRows<'a> {
    pub(crate) codes: &'a [u8],
    pub(crate) scales: &'a [f16],
    pub(crate) zeros: &'a [u8],
    pub(crate) bits: u8,
    /// Look-up-table codes: `2^bits` unsigned levels per row, row-major; a code's value is
    /// its row's level, not the code itself.
    pub(crate) tables: Option<&'a [u8]>,
}

/// `y[r] = Σ_i ŵ[r, i]·x̃_i` for every row of `w` (the caller checked [`takes`]).
pub(crate) fn rows(level: SimdLevel, w: &CodeRows<'_>, p: &Prepared, y: &mut [f32]) {
    assert!(
        takes(level, p.acts.q.len(), p.group),
        "int8 kernels not available here"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `takes` checked AVX-512F/BW/VL/VBMI/VNNI; `w` holds `y.len()` rows of
    // `cols·bits/8` code bytes and `cols/group` scales and zeros per row (the caller's slices).
    unsafe {
        match (w.bits, w.tables.is_some()) {
            (4, false) if planar(4, p.group) => vnni::planar4::<false>(w, p, y),
            (4, true) if planar(4, p.group) => vnni::planar4::<true>(w, p, y),
            (2, false) if planar(2, p.group) => vnni::planar2::<false>(w, p, y),
            (2, true) if planar(2, p.group) => vnni::planar2::<true>(w, p, y),
            (8, _) => vnni::rows::<8, false>(w, p, y),
            (6, _) => vnni::rows::<6, false>(w, p, y),
            (4, false) => vnni::rows::<4, false>(w, p, y),
            (4, true) => vnni::rows::<4, true>(w, p, y),
            (3, false) => vnni::rows::<3, false>(w, p, y),
            (3, true) => vnni::rows::<3, true>(w, p, y),
            (_, false) => vnni::rows::<2, false>(w, p, y),
            (_, true) => vnni::rows::<2, true>(w, p, y),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::{CodeRows, Prepared, STEP, UNIT};
    use crate::backend::cpu::q8_activations::by_row_blocks;
    use std::arch::x86_64::*;

    /// Rows per interleaved block: the activation and scale loads of a unit are shared by
    /// four rows' code streams (one row alone is bound by those loads at 576 columns).
    const ROWS: usize = 4;

    /// The f32 value of an f16 scale (one `vcvtph2ps`; `half`'s conversion dispatches).
    #[inline(always)]
    unsafe fn scale(h: half::f16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h.to_bits()))))
    }

    /// Row `r`'s table of levels in every 128-bit lane's reach of `vpermb` (zero where `w`
    /// has no tables: the caller then never uses it).
    #[inline(always)]
    unsafe fn table(w: &CodeRows<'_>, r: usize) -> __m512i {
        match w.tables {
            Some(t) => {
                let n = 1usize << w.bits;
                let m: __mmask64 = if n >= 64 { !0 } else { (1u64 << n) - 1 };
                _mm512_maskz_loadu_epi8(m, t.as_ptr().add(r * n).cast())
            }
            None => _mm512_setzero_si512(),
        }
    }

    /// `Σ_g s_g·z_g·Σx̃_g` of row `r`: the zero points' share, subtracted once per row. 16
    /// groups a vector (a Llama row has 4.5–112 groups; a scalar loop over them cost as much
    /// as the codes' dots on narrow rows).
    #[inline(always)]
    unsafe fn zero_term(w: &CodeRows<'_>, p: &Prepared, r: usize) -> f32 {
        let gpr = p.gx.len();
        let mut acc = _mm512_setzero_ps();
        for g0 in (0..gpr).step_by(16) {
            let n = (gpr - g0).min(16);
            let m: __mmask16 = if n == 16 { !0 } else { (1u16 << n) - 1 };
            let at = r * gpr + g0;
            let s = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
                m,
                w.scales.as_ptr().add(at).cast(),
            ));
            let z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(
                m,
                w.zeros.as_ptr().add(at).cast(),
            )));
            let gx = _mm512_maskz_loadu_ps(m, p.gx.as_ptr().add(g0));
            acc = _mm512_fmadd_ps(_mm512_mul_ps(s, z), gx, acc);
        }
        _mm512_reduce_add_ps(acc)
    }

    /// 4-bit codes by bit planes: one 64-byte unit is 128 codes, low nibbles plane 0.
    ///
    /// # Safety
    /// As [`rows`], with `super::planar(4, group)`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,f16c,fma")]
    pub(super) unsafe fn planar4<const LUT: bool>(w: &CodeRows<'_>, p: &Prepared, y: &mut [f32]) {
        by_row_blocks!(y, ROWS, |r0, yb, R| planar4_block::<R, LUT>(w, p, r0, yb))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,f16c,fma")]
    unsafe fn planar4_block<const R: usize, const LUT: bool>(
        w: &CodeRows<'_>,
        p: &Prepared,
        r0: usize,
        y: &mut [f32],
    ) {
        let cols = p.acts.q.len();
        let rb = cols / 2;
        let gpr = p.gx.len();
        let units_per_group = p.group / UNIT;
        let nunits = cols.div_ceil(UNIT);
        let tail_mask: __mmask64 = if cols.is_multiple_of(UNIT) {
            !0
        } else {
            (1u64 << 32) - 1
        };
        let nib = _mm512_set1_epi8(0x0F);
        let (xp, dp) = (p.planes.as_ptr(), p.dunit.as_ptr());
        let rows: [*const u8; R] = std::array::from_fn(|i| w.codes.as_ptr().add((r0 + i) * rb));
        let tables: [__m512i; R] =
            std::array::from_fn(|i| if LUT { table(w, r0 + i) } else { nib });
        let mut lanes = [_mm512_setzero_ps(); R];
        for g in 0..gpr {
            let (u0, u1) = (g * units_per_group, ((g + 1) * units_per_group).min(nunits));
            let mut acc = [_mm512_setzero_ps(); R];
            for u in u0..u1 {
                let m = if u + 1 == nunits { tail_mask } else { !0 };
                let x0 = _mm512_loadu_si512(xp.add(UNIT * u).cast());
                let x1 = _mm512_loadu_si512(xp.add(UNIT * u + 64).cast());
                let d = _mm512_loadu_ps(dp.add(16 * u));
                for i in 0..R {
                    let raw = _mm512_maskz_loadu_epi8(m, rows[i].add(64 * u).cast());
                    let mut lo = _mm512_and_si512(raw, nib);
                    let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), nib);
                    if LUT {
                        lo = _mm512_permutexvar_epi8(lo, tables[i]);
                        hi = _mm512_permutexvar_epi8(hi, tables[i]);
                    }
                    let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, x0);
                    let dot = _mm512_dpbusd_epi32(dot, hi, x1);
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d, acc[i]);
                }
            }
            for i in 0..R {
                let s = scale(*w.scales.get_unchecked((r0 + i) * gpr + g));
                lanes[i] = _mm512_fmadd_ps(acc[i], _mm512_set1_ps(s), lanes[i]);
            }
        }
        for i in 0..R {
            y[i] = _mm512_reduce_add_ps(lanes[i]) - zero_term(w, p, r0 + i);
        }
    }

    /// 2-bit codes by bit planes: one 32-byte unit is 128 codes, four planes, 256-bit ops.
    ///
    /// # Safety
    /// As [`rows`], with `super::planar(2, group)`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,f16c,fma")]
    pub(super) unsafe fn planar2<const LUT: bool>(w: &CodeRows<'_>, p: &Prepared, y: &mut [f32]) {
        by_row_blocks!(y, ROWS, |r0, yb, R| planar2_block::<R, LUT>(w, p, r0, yb))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,f16c,fma")]
    unsafe fn planar2_block<const R: usize, const LUT: bool>(
        w: &CodeRows<'_>,
        p: &Prepared,
        r0: usize,
        y: &mut [f32],
    ) {
        let cols = p.acts.q.len();
        let rb = cols / 4;
        let gpr = p.gx.len();
        let units_per_group = p.group / UNIT;
        let nunits = cols.div_ceil(UNIT);
        let tail_mask: __mmask32 = if cols.is_multiple_of(UNIT) {
            !0
        } else {
            (1u32 << 16) - 1
        };
        let two = _mm256_set1_epi8(0x03);
        let (xp, dp) = (p.planes.as_ptr(), p.dunit.as_ptr());
        let rows: [*const u8; R] = std::array::from_fn(|i| w.codes.as_ptr().add((r0 + i) * rb));
        let tables: [__m256i; R] = std::array::from_fn(|i| {
            if LUT {
                _mm512_castsi512_si256(table(w, r0 + i))
            } else {
                two
            }
        });
        let mut lanes = [_mm256_setzero_ps(); R];
        for g in 0..gpr {
            let (u0, u1) = (g * units_per_group, ((g + 1) * units_per_group).min(nunits));
            let mut acc = [_mm256_setzero_ps(); R];
            for u in u0..u1 {
                let m = if u + 1 == nunits { tail_mask } else { !0 };
                let x = xp.add(UNIT * u);
                let xs = [
                    _mm256_loadu_si256(x.cast()),
                    _mm256_loadu_si256(x.add(32).cast()),
                    _mm256_loadu_si256(x.add(64).cast()),
                    _mm256_loadu_si256(x.add(96).cast()),
                ];
                let d = _mm256_loadu_ps(dp.add(8 * u));
                for i in 0..R {
                    let raw = _mm256_maskz_loadu_epi8(m, rows[i].add(32 * u).cast());
                    let mut p0 = _mm256_and_si256(raw, two);
                    let mut p1 = _mm256_and_si256(_mm256_srli_epi16::<2>(raw), two);
                    let mut p2 = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), two);
                    let mut p3 = _mm256_and_si256(_mm256_srli_epi16::<6>(raw), two);
                    if LUT {
                        p0 = _mm256_permutexvar_epi8(p0, tables[i]);
                        p1 = _mm256_permutexvar_epi8(p1, tables[i]);
                        p2 = _mm256_permutexvar_epi8(p2, tables[i]);
                        p3 = _mm256_permutexvar_epi8(p3, tables[i]);
                    }
                    let dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), p0, xs[0]);
                    let dot = _mm256_dpbusd_epi32(dot, p1, xs[1]);
                    let dot = _mm256_dpbusd_epi32(dot, p2, xs[2]);
                    let dot = _mm256_dpbusd_epi32(dot, p3, xs[3]);
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d, acc[i]);
                }
            }
            for i in 0..R {
                let s = scale(*w.scales.get_unchecked((r0 + i) * gpr + g));
                lanes[i] = _mm256_fmadd_ps(acc[i], _mm256_set1_ps(s), lanes[i]);
            }
        }
        for i in 0..R {
            let l = lanes[i];
            let l = _mm_add_ps(_mm256_castps256_ps128(l), _mm256_extractf128_ps::<1>(l));
            let l = _mm_add_ps(l, _mm_movehl_ps(l, l));
            let l = _mm_add_ss(l, _mm_shuffle_ps::<0b01>(l, l));
            y[i] = _mm_cvtss_f32(l) - zero_term(w, p, r0 + i);
        }
    }

    /// `vpermb` indices: byte `8k + j` of the result is stream byte `B·k + j` (clamped; the
    /// bytes past a lane's `B` only feed bits the mask drops).
    fn gather_index<const B: usize>() -> [u8; 64] {
        std::array::from_fn(|i| ((B * (i / 8) + i % 8).min(63)) as u8)
    }

    /// `vpmultishiftqb` controls: byte `j` of every lane starts at bit `B·j`.
    fn shift_control<const B: usize>() -> [u8; 64] {
        std::array::from_fn(|i| (B * (i % 8)) as u8)
    }

    /// # Safety
    /// AVX-512F/BW/VL/VBMI/VNNI and F16C must be available; `w` must hold `y.len()` rows of
    /// `cols·B/8` code bytes and `cols.div_ceil(group)` scales and zeros per row, with
    /// `cols = p.acts.q.len()` and `super::takes(cols, group)`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,f16c,fma")]
    pub(super) unsafe fn rows<const B: usize, const LUT: bool>(
        w: &CodeRows<'_>,
        p: &Prepared,
        y: &mut [f32],
    ) {
        by_row_blocks!(y, ROWS, |r0, yb, R| rows_block::<B, R, LUT>(w, p, r0, yb))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,f16c,fma")]
    unsafe fn rows_block<const B: usize, const R: usize, const LUT: bool>(
        w: &CodeRows<'_>,
        p: &Prepared,
        r0: usize,
        y: &mut [f32],
    ) {
        let cols = p.acts.q.len();
        let rb = cols * B / 8;
        let gpr = p.gx.len();
        let steps_per_group = p.group / STEP;
        let nsteps = cols / STEP;
        let step_bytes = 8 * B;
        let load_mask: __mmask64 = if step_bytes >= 64 {
            !0
        } else {
            (1u64 << step_bytes) - 1
        };
        let idx = _mm512_loadu_si512(gather_index::<B>().as_ptr().cast());
        let ctl = _mm512_loadu_si512(shift_control::<B>().as_ptr().cast());
        let code_mask = _mm512_set1_epi8(((1u32 << B) - 1) as u8 as i8);
        let xq = p.acts.q.as_ptr();
        let dv = p.dvec.as_ptr();
        let rows: [*const u8; R] = std::array::from_fn(|i| w.codes.as_ptr().add((r0 + i) * rb));
        let tables: [__m512i; R] =
            std::array::from_fn(|i| if LUT { table(w, r0 + i) } else { code_mask });
        let mut lanes = [_mm512_setzero_ps(); R];
        for g in 0..gpr {
            let (c0, c1) = (g * steps_per_group, ((g + 1) * steps_per_group).min(nsteps));
            let mut acc = [_mm512_setzero_ps(); R];
            for c in c0..c1 {
                let x = _mm512_loadu_si512(xq.add(c * STEP).cast());
                let d = _mm512_loadu_ps(dv.add(16 * c));
                for i in 0..R {
                    let raw =
                        _mm512_maskz_loadu_epi8(load_mask, rows[i].add(c * step_bytes).cast());
                    let mut codes = if B == 8 {
                        raw
                    } else {
                        _mm512_and_si512(
                            _mm512_multishift_epi64_epi8(ctl, _mm512_permutexvar_epi8(idx, raw)),
                            code_mask,
                        )
                    };
                    if LUT {
                        codes = _mm512_permutexvar_epi8(codes, tables[i]);
                    }
                    let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, x);
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d, acc[i]);
                }
            }
            for i in 0..R {
                let s = scale(*w.scales.get_unchecked((r0 + i) * gpr + g));
                lanes[i] = _mm512_fmadd_ps(acc[i], _mm512_set1_ps(s), lanes[i]);
            }
        }
        for i in 0..R {
            y[i] = _mm512_reduce_add_ps(lanes[i]) - zero_term(w, p, r0 + i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{assert_rows_match_f64, lcg};
    use sfx_formats::resident::{minmax_grid, GroupQuantized};

    /// Every bit width on every tier against the f64 product of the format's own
    /// dequantization with the dequantized int8 activations (what the kernel computes
    /// exactly up to f32 rounding): shapes with a short last group (576 = 4·128 + 64),
    /// group 64 and 256, rows spanning several blocks. Bound: f32 rounding of the block and
    /// group terms, 1e-5·Σ|ŵ·x̃| + 1e-5.
    #[test]
    fn matches_the_f64_product_with_quantized_activations() {
        let mut seed = 9u64;
        for &(rows, cols, group) in &[
            (7, 64, 64),
            (33, 576, 128),
            (20, 512, 256),
            (5, 1536, 64),
            (9, 640, 128),
            (3, 704, 256),
        ] {
            let wf: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
            let x: Vec<f32> = (0..cols)
                .map(|i| lcg(&mut seed) * (1.0 + (i % 7) as f32))
                .collect();
            for bits in sfx_formats::resident::SUPPORTED_BITS {
                let p = Prepared::new(&x, group, bits);
                let xt = p.acts.dequantized();
                let q = GroupQuantized::quantize_with(&wf, rows, cols, bits, group, minmax_grid)
                    .unwrap();
                let deq = q.dequantize();
                let w = CodeRows {
                    codes: q.codes(),
                    scales: q.scales(),
                    zeros: q.zeros(),
                    bits,
                    tables: None,
                };
                for level in SimdLevel::supported() {
                    if !takes(level, cols, group) {
                        eprintln!("{level:?}: no int8 kernels at this tier (f32 kernels run)");
                        continue;
                    }
                    let mut y = vec![f32::NAN; rows];
                    super::rows(level, &w, &p, &mut y);
                    let what = format!("{level:?} {bits}b {rows}x{cols} g{group}");
                    assert_rows_match_f64(&deq, &xt, &y, &what);
                }
            }
        }
    }

    #[test]
    fn shapes_off_the_64_grid_are_not_taken() {
        let level = SimdLevel::detect();
        assert!(!takes(level, 61, 64));
        assert!(!takes(level, 576, 32));
        assert!(!takes(level, 0, 64));
        assert_eq!(takes(level, 576, 128), int8_kernels_at(level));
        assert!(!takes(SimdLevel::Scalar, 576, 128));
    }
}

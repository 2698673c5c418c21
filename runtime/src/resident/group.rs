//! [`GroupQuantLinear`]: `y = x·Ŵᵀ` for group-quantized weights
//! (`ŵ[r, i] = (q[r, i] − z[r, g])·s[r, g]`, layout in `sfx_formats::resident`).
//!
//! Decode (m ≤ 2, per token): never dequantizes the matrix. Per row the affine form
//! `y_r = Σ_g s_{r,g} (Σ_{i∈g} q_{r,i} x_i − z_{r,g} Σ_{i∈g} x_i)` needs one integer-code ×
//! activation dot per group plus one multiply-add per group; the group sums `Σ x` are
//! computed once per token and shared by all rows. Codes are unpacked 8 at a time from
//! `bits` bytes (one u32, constant shifts per lane, so LLVM vectorizes the unpack, convert
//! and FMA 8 lanes wide); one body is compiled per SIMD tier (`multiversioned!`). Rows are
//! split into ~4 blocks per rayon thread like the float matvec; f32 accumulation.
//!
//! Prefill (m > 2): each rayon task dequantizes a panel of rows to f32 (sized for L2) and runs
//! faer's f32 GEMM on it — the float path's strategy, with unpacking in place of widening.

use crate::backend::cpu::gemm::matmul_t_panels;
use crate::backend::cpu::math::multiversioned;
use crate::backend::cpu::{CpuBackend, CpuBuffer, CpuIndex, SimdLevel};
use crate::backend::WeightPrecision;
use crate::error::{check_len, Result, RuntimeError};
use crate::linear::{
    check_shape, load_bias, require, FloatLinear, Linear, LinearFactory, LinearRole, LinearSpec,
};
use crate::resident::{coded_forward, gather_decoded_rows, group_q8, run_row_blocks};
use half::f16;
use sfx_formats::resident::{minmax_grid, GroupQuantized, ResidentError, DEFAULT_GROUP_SIZE};
use sfx_formats::TensorSource;

fn layout_err(op: &'static str, e: ResidentError) -> RuntimeError {
    RuntimeError::Shape {
        op,
        msg: e.to_string(),
    }
}

/// A group-quantized projection with an optional f32 bias, on the CPU backend.
#[derive(Debug, Clone)]
pub struct GroupQuantLinear {
    weight: GroupQuantized,
    bias: Option<Vec<f32>>,
}

impl GroupQuantLinear {
    pub fn new(weight: GroupQuantized, bias: Option<Vec<f32>>) -> Result<Self> {
        if let Some(b) = &bias {
            check_len("GroupQuantLinear::new", "bias", b.len(), weight.rows())?;
        }
        Ok(Self { weight, bias })
    }

    pub fn weight(&self) -> &GroupQuantized {
        &self.weight
    }

    /// `y = Ŵ·x̃` for one token with `x` quantized to int8 blocks ([`group_q8`]), or `None`
    /// when the shape is off the int8 kernels' grid.
    fn matvec_int8(&self, level: SimdLevel, x: &[f32], y: &mut [f32]) -> Option<()> {
        let w = &self.weight;
        if !group_q8::takes(level, w.cols(), w.group_size()) {
            return None;
        }
        let prepared = group_q8::Prepared::new(x, w.group_size(), w.bits());
        let (rb, gpr) = (w.row_bytes(), w.groups_per_row());
        let block = |r0: usize, yb: &mut [f32]| {
            let n = yb.len();
            let rows = group_q8::CodeRows {
                codes: &w.codes()[r0 * rb..(r0 + n) * rb],
                scales: &w.scales()[r0 * gpr..(r0 + n) * gpr],
                zeros: &w.zeros()[r0 * gpr..(r0 + n) * gpr],
                bits: w.bits(),
                tables: None,
            };
            group_q8::rows(level, &rows, &prepared, yb);
        };
        run_row_blocks(w.codes().len(), y, block);
        Some(())
    }

    /// `y = Ŵ·x` for one token (`x.len() == cols`, `y.len() == rows`), bias excluded.
    pub fn matvec(&self, level: SimdLevel, x: &[f32], y: &mut [f32]) {
        let w = &self.weight;
        let (rows, cols, gs) = (w.rows(), w.cols(), w.group_size());
        debug_assert_eq!((x.len(), y.len()), (cols, rows));
        let gsum: Vec<f32> = x.chunks(gs).map(|c| c.iter().sum()).collect();
        let xp = plane_order(x, gs, w.bits() as usize);
        let rb = w.row_bytes();
        let gpr = w.groups_per_row();
        let block = |r0: usize, yb: &mut [f32]| {
            let n = yb.len();
            let args = Rows {
                codes: &w.codes()[r0 * rb..(r0 + n) * rb],
                scales: &w.scales()[r0 * gpr..(r0 + n) * gpr],
                zeros: &w.zeros()[r0 * gpr..(r0 + n) * gpr],
                x,
                xp: &xp,
                gsum: &gsum,
                group: gs,
            };
            match w.bits() {
                8 => rows_b8(level, &args, yb),
                6 => rows_b6(level, &args, yb),
                4 => rows_b4(level, &args, yb),
                3 => rows_b3(level, &args, yb),
                _ => rows_b2(level, &args, yb),
            }
        };
        run_row_blocks(w.codes().len(), y, block);
    }

    /// `y[m, rows] = x[m, cols] · Ŵᵀ` through dequantized panels and faer, bias excluded.
    fn matmul_panels(&self, x: &[f32], m: usize, y: &mut [f32]) {
        let w = &self.weight;
        let cols = w.cols();
        matmul_t_panels(x, m, w.rows(), y, |r0, panel| {
            for (i, row) in panel.chunks_exact_mut(cols).enumerate() {
                dequantize_row_fast(w, r0 + i, row);
            }
        });
    }
}

impl Linear<CpuBackend> for GroupQuantLinear {
    fn in_dim(&self) -> usize {
        self.weight.cols()
    }
    fn out_dim(&self) -> usize {
        self.weight.rows()
    }
    fn has_bias(&self) -> bool {
        self.bias.is_some()
    }
    fn forward(
        &self,
        backend: &CpuBackend,
        x: &CpuBuffer,
        m: usize,
        y: &mut CpuBuffer,
    ) -> Result<()> {
        coded_forward(
            "GroupQuantLinear::forward",
            backend,
            (x, m, y),
            (self.weight.rows(), self.weight.cols()),
            self.bias.as_deref(),
            |level, x, y| self.matvec_int8(level, x, y),
            |level, x, y| self.matvec(level, x, y),
            |x, m, y| self.matmul_panels(x, m, y),
        )
    }
    fn gather_rows(
        &self,
        _backend: &CpuBackend,
        tokens: &CpuIndex,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        let (rows, cols) = (self.weight.rows(), self.weight.cols());
        gather_decoded_rows(tokens, out, rows, cols, |r, row| {
            dequantize_row_fast(&self.weight, r, row)
        })
    }
    fn resident_bytes(&self) -> usize {
        self.weight.size_in_bytes() + self.bias.as_ref().map_or(0, |b| 4 * b.len())
    }
    fn describe(&self) -> String {
        format!(
            "q{}g{} {}×{} ({:.3} bits/weight){}",
            self.weight.bits(),
            self.weight.group_size(),
            self.weight.cols(),
            self.weight.rows(),
            self.weight.bits_per_weight(),
            if self.bias.is_some() { " +bias" } else { "" }
        )
    }
}

/// One block of rows for the decode kernel.
struct Rows<'a> {
    codes: &'a [u8],
    scales: &'a [f16],
    zeros: &'a [u8],
    x: &'a [f32],
    /// `x` in bit-plane order (`plane_order`), read by the 2/4-bit block loop.
    xp: &'a [f32],
    /// Σ x per group.
    gsum: &'a [f32],
    group: usize,
}

/// 8 codes of `B` bits from `B` little-endian bytes (a u32 up to 4 bits, where LLVM keeps
/// the lanes 32-bit wide; a u64 above).
#[inline(always)]
fn unpack8<const B: usize>(p: &[u8]) -> [f32; 8] {
    let mask = (1u64 << B) - 1;
    if B <= 4 {
        let mut v = 0u32;
        for (k, &b) in p[..B].iter().enumerate() {
            v |= u32::from(b) << (8 * k);
        }
        std::array::from_fn(|j| ((v >> (B * j)) & mask as u32) as f32)
    } else {
        let mut v = 0u64;
        for (k, &b) in p[..B].iter().enumerate() {
            v |= u64::from(b) << (8 * k);
        }
        std::array::from_fn(|j| ((v >> (B * j)) & mask) as f32)
    }
}

/// Codes per block of the planar fast path: 16 lanes × (8 / bits) codes from 16 bytes at
/// 2, 4 and 8 bits (64, 32, 16 codes); 16 lanes × 8 codes from 48 bytes (3 bytes a lane) at
/// 3 bits. 6-bit codes have no planar form (a code straddles bytes); 0 sends whole groups
/// through the 8-at-a-time loop.
const fn block_codes(bits: usize) -> usize {
    match bits {
        3 => 128,
        2 | 4 | 8 => 128 / bits,
        _ => 0,
    }
}

/// Reorders `x` so that the kernels read codes as bit planes: in each full block of a group,
/// lane `k` (byte `k`, or bytes `3k..3k+3` at 3 bits) holds codes `per·k + j`
/// (`per = block / 16`) at bit `bits·j`, so `xp[base + 16·j + k] = x[base + per·k + j]`;
/// then plane `j` of the 16 lanes meets 16 consecutive `xp` values (a straight
/// shift-mask-convert-FMA loop). Values past the last full block of a group keep their
/// order. O(cols) once per token, shared by all rows.
fn plane_order(x: &[f32], group: usize, bits: usize) -> Vec<f32> {
    let mut xp = x.to_vec();
    let blk = block_codes(bits);
    if blk == 0 {
        return xp;
    }
    let per = blk / 16;
    for (xg, pg) in x.chunks(group).zip(xp.chunks_mut(group)) {
        for (xb, pb) in xg.chunks_exact(blk).zip(pg.chunks_exact_mut(blk)) {
            for j in 0..per {
                for k in 0..16 {
                    pb[16 * j + k] = xb[per * k + j];
                }
            }
        }
    }
    xp
}

/// Σ q·x over codes `first..first + xs.len()` of a group's bit stream, 8 at a time.
#[inline(always)]
fn dot_chunks<const B: usize>(bytes: &[u8], first: usize, xs: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut xc = xs.chunks_exact(8);
    let b0 = first * B / 8;
    for (c, x8) in (&mut xc).enumerate() {
        let q = unpack8::<B>(&bytes[b0 + c * B..]);
        for j in 0..8 {
            acc[j] += q[j] * x8[j];
        }
    }
    let mut dot: f32 = acc.iter().sum();
    let done = first + xs.len() - xc.remainder().len();
    for (j, &xv) in xc.remainder().iter().enumerate() {
        dot += f32::from(sfx_formats::resident::get_code(bytes, done + j, B as u8)) * xv;
    }
    dot
}

#[inline(always)]
fn rows_generic<const B: usize>(a: &Rows<'_>, y: &mut [f32]) {
    let cols = a.x.len();
    let rb = (cols * B).div_ceil(8);
    let gpr = a.gsum.len();
    let blk = block_codes(B);
    let block_bytes = blk * B / 8;
    let mask = (1u32 << B) - 1;
    for (r, yr) in y.iter_mut().enumerate() {
        let row = &a.codes[r * rb..(r + 1) * rb];
        // Σ_g s_g·(block dots) kept as 16 lanes (no horizontal sum per group); the scalar
        // part carries the tails and −Σ_g s_g z_g Σx_g.
        let mut lanes = [0.0f32; 16];
        let mut total = 0.0f32;
        for (g, xg) in a.x.chunks(a.group).enumerate() {
            let bytes = &row[g * a.group * B / 8..];
            let s = a.scales[r * gpr + g].to_f32();
            let z = f32::from(a.zeros[r * gpr + g]);
            let rest = {
                let xpg = &a.xp[g * a.group..g * a.group + xg.len()];
                let nb = xg.len().checked_div(blk).unwrap_or(0);
                let mut acc = [0.0f32; 16];
                for (by, xb) in bytes[..nb * block_bytes]
                    .chunks_exact(block_bytes.max(1))
                    .zip(xpg.chunks_exact(blk.max(1)))
                {
                    if B == 3 {
                        // Lane k = bytes 3k..3k+3 = codes 8k..8k+7.
                        let v: [u32; 16] = std::array::from_fn(|k| {
                            u32::from(by[3 * k])
                                | u32::from(by[3 * k + 1]) << 8
                                | u32::from(by[3 * k + 2]) << 16
                        });
                        for j in 0..8 {
                            let xj = &xb[16 * j..16 * j + 16];
                            for k in 0..16 {
                                acc[k] += ((v[k] >> (3 * j)) & mask) as f32 * xj[k];
                            }
                        }
                    } else {
                        // Byte-wide lanes measured 2× faster than u32 lanes at 2 bits.
                        for j in 0..blk / 16 {
                            let xj = &xb[16 * j..16 * j + 16];
                            for k in 0..16 {
                                acc[k] +=
                                    f32::from(((u32::from(by[k]) >> (B * j)) & mask) as u8) * xj[k];
                            }
                        }
                    }
                }
                for k in 0..16 {
                    lanes[k] += s * acc[k];
                }
                if nb * blk < xg.len() {
                    dot_chunks::<B>(bytes, nb * blk, &xg[nb * blk..])
                } else {
                    0.0
                }
            };
            total += s * (rest - z * a.gsum[g]);
        }
        *yr = total + lanes.iter().sum::<f32>();
    }
}

#[inline(always)]
fn rows_4(a: &Rows<'_>, y: &mut [f32]) {
    rows_generic::<4>(a, y)
}
#[inline(always)]
fn rows_3(a: &Rows<'_>, y: &mut [f32]) {
    rows_generic::<3>(a, y)
}
#[inline(always)]
fn rows_2(a: &Rows<'_>, y: &mut [f32]) {
    rows_generic::<2>(a, y)
}
#[inline(always)]
fn rows_6(a: &Rows<'_>, y: &mut [f32]) {
    rows_generic::<6>(a, y)
}
#[inline(always)]
fn rows_8(a: &Rows<'_>, y: &mut [f32]) {
    rows_generic::<8>(a, y)
}

multiversioned! { fn rows_b4(a: &Rows<'_>, y: &mut [f32]) = rows_4; }
multiversioned! { fn rows_b3(a: &Rows<'_>, y: &mut [f32]) = rows_3; }
multiversioned! { fn rows_b2(a: &Rows<'_>, y: &mut [f32]) = rows_2; }
multiversioned! { fn rows_b6(a: &Rows<'_>, y: &mut [f32]) = rows_6; }
multiversioned! { fn rows_b8(a: &Rows<'_>, y: &mut [f32]) = rows_8; }

/// Dequantizes row `r` with the 8-at-a-time unpack (prefill panels).
fn dequantize_row_fast(w: &GroupQuantized, r: usize, out: &mut [f32]) {
    fn go<const B: usize>(w: &GroupQuantized, r: usize, out: &mut [f32]) {
        let rb = w.row_bytes();
        let gpr = w.groups_per_row();
        let row = &w.codes()[r * rb..(r + 1) * rb];
        for (g, og) in out.chunks_mut(w.group_size()).enumerate() {
            let bytes = &row[g * w.group_size() * B / 8..];
            let s = w.scales()[r * gpr + g].to_f32();
            let zs = f32::from(w.zeros()[r * gpr + g]) * s;
            let glen = og.len();
            let mut oc = og.chunks_exact_mut(8);
            for (c, o8) in (&mut oc).enumerate() {
                let q = unpack8::<B>(&bytes[c * B..]);
                for j in 0..8 {
                    o8[j] = q[j] * s - zs;
                }
            }
            let rem = oc.into_remainder();
            let done = glen - rem.len();
            for (j, o) in rem.iter_mut().enumerate() {
                *o = f32::from(sfx_formats::resident::get_code(bytes, done + j, B as u8)) * s - zs;
            }
        }
    }
    match w.bits() {
        8 => go::<8>(w, r, out),
        6 => go::<6>(w, r, out),
        4 => go::<4>(w, r, out),
        3 => go::<3>(w, r, out),
        _ => go::<2>(w, r, out),
    }
}

/// Loads every decoder projection as RTN group-quantized weights (quantized at load from the
/// float checkpoint); an untied output head stays float at `head_precision` and a tied one
/// shares the float embedding. The embedding is never quantized.
#[derive(Debug, Clone, Copy)]
pub struct RtnFactory {
    pub bits: u8,
    pub group_size: usize,
    pub head_precision: WeightPrecision,
}

impl RtnFactory {
    /// `bits`-bit RTN, group 128, BF16 head.
    pub fn new(bits: u8) -> Self {
        Self {
            bits,
            group_size: DEFAULT_GROUP_SIZE,
            head_precision: WeightPrecision::Bf16,
        }
    }
}

impl LinearFactory<CpuBackend> for RtnFactory {
    fn load(
        &self,
        backend: &CpuBackend,
        tensors: &dyn TensorSource,
        spec: &LinearSpec<'_>,
    ) -> Result<Box<dyn Linear<CpuBackend>>> {
        if spec.role == LinearRole::LmHead {
            return Ok(Box::new(FloatLinear::load(
                backend,
                tensors,
                spec,
                self.head_precision,
            )?));
        }
        let view = require(tensors, spec.weight_name, spec.role.describe())?;
        check_shape(spec.weight_name, view.shape, &[spec.out_dim, spec.in_dim])?;
        let w = view.to_f32_vec();
        let q = GroupQuantized::quantize_with(
            &w,
            spec.out_dim,
            spec.in_dim,
            self.bits,
            self.group_size,
            minmax_grid,
        )
        .map_err(|e| layout_err("RtnFactory::load", e))?;
        let bias = load_bias(tensors, spec)?;
        Ok(Box::new(GroupQuantLinear::new(q, bias)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_util::lcg;

    /// `forward` on every SIMD tier and bit width vs the f64 reference `dequantize → matmul`,
    /// for m = 1, 2 (decode kernel) and m = 5 (panel GEMM), shapes with tail groups
    /// (576 = 4·128 plus 64, 200 = 128 plus 72) and a tail inside a group (cols 61: not a
    /// multiple of 8). Tolerance: f32 accumulation over `cols` terms plus the affine
    /// regrouping — we allow 2e-5·Σ|ŵ·x| + 1e-5 (ŵ and x are O(1) here, so Σ|ŵx| ≈ cols/4).
    #[test]
    fn forward_matches_f64_dequantized_reference() {
        let mut seed = 5u64;
        for &(rows, cols, group) in &[
            (1, 8, 8),
            (13, 61, 16),
            (64, 200, 128),
            (130, 576, 128),
            (300, 576, 64),
        ] {
            let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
            let bias: Vec<f32> = (0..rows).map(|_| lcg(&mut seed)).collect();
            for bits in sfx_formats::resident::SUPPORTED_BITS {
                let q = GroupQuantized::quantize_with(&w, rows, cols, bits, group, minmax_grid)
                    .unwrap();
                let deq = q.dequantize();
                let lin = GroupQuantLinear::new(q, Some(bias.clone())).unwrap();
                for m in [1usize, 2, 5] {
                    let x: Vec<f32> = (0..m * cols).map(|_| lcg(&mut seed)).collect();
                    for level in SimdLevel::supported() {
                        let backend = CpuBackend::with_simd(level).unwrap();
                        let mut y = CpuBuffer(vec![f32::NAN; m * rows]);
                        lin.forward(&backend, &CpuBuffer(x.clone()), m, &mut y)
                            .unwrap();
                        for t in 0..m {
                            for r in 0..rows {
                                let (mut want, mut mag) = (bias[r] as f64, bias[r].abs() as f64);
                                for i in 0..cols {
                                    let p = deq[r * cols + i] as f64 * x[t * cols + i] as f64;
                                    want += p;
                                    mag += p.abs();
                                }
                                let got = y.0[t * rows + r] as f64;
                                assert!(
                                    (got - want).abs() <= 2e-5 * mag + 1e-5,
                                    "{level:?} {bits}b {rows}x{cols} g{group} m{m} [{t},{r}]: {got} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        let q = GroupQuantized::quantize_with(&[0.5; 16], 2, 8, 4, 8, minmax_grid).unwrap();
        assert!(GroupQuantLinear::new(q.clone(), Some(vec![0.0; 3])).is_err());
        let lin = GroupQuantLinear::new(q, None).unwrap();
        let b = CpuBackend::new();
        let mut y = CpuBuffer(vec![0.0; 2]);
        assert!(lin
            .forward(&b, &CpuBuffer(vec![0.0; 7]), 1, &mut y)
            .is_err());
        assert!(lin
            .forward(&b, &CpuBuffer(vec![0.0; 8]), 2, &mut y)
            .is_err());
        assert!(lin.describe().starts_with("q4g8 8×2"));
    }

    /// The row gather (a tied embedding read from head codes) at every width, rows with a
    /// tail group and a tail inside a group, against the format's own dequantization; ids
    /// past the table are an error naming the token, not a panic.
    #[test]
    fn gathered_rows_are_the_dequantized_rows() {
        let mut seed = 11u64;
        for &(rows, cols, group) in &[(50, 576, 128), (9, 61, 16)] {
            let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
            for bits in sfx_formats::resident::SUPPORTED_BITS {
                let q = GroupQuantized::quantize_with(&w, rows, cols, bits, group, minmax_grid)
                    .unwrap();
                let deq = q.dequantize();
                let lin = GroupQuantLinear::new(q, None).unwrap();
                let b = CpuBackend::new();
                let ids = [rows as u32 - 1, 0, 3, 3];
                let mut out = CpuBuffer(vec![f32::NAN; ids.len() * cols]);
                lin.gather_rows(&b, &CpuIndex(ids.to_vec()), &mut out)
                    .unwrap();
                for (t, &id) in ids.iter().enumerate() {
                    let want = &deq[id as usize * cols..][..cols];
                    let got = &out.0[t * cols..][..cols];
                    for (i, (g, e)) in got.iter().zip(want).enumerate() {
                        assert!(
                            (g - e).abs() <= 1e-6 * e.abs(),
                            "{bits}b row {id} [{i}]: {g} vs {e}"
                        );
                    }
                }
                let mut two = CpuBuffer(vec![0.0; 2 * cols]);
                let err = lin
                    .gather_rows(&b, &CpuIndex(vec![0, rows as u32]), &mut two)
                    .unwrap_err();
                assert!(err.to_string().contains(&rows.to_string()), "{err}");
                let mut short = CpuBuffer(vec![0.0; cols]);
                assert!(lin
                    .gather_rows(&b, &CpuIndex(vec![0, 1]), &mut short)
                    .is_err());
            }
        }
    }
}

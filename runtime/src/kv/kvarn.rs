//! KVarN resident KV tile codec (Muller et al. 2026; reference implementation
//! github.com/huawei-csl/KVarN, Apache-2.0), plus StrataFlux's nested refinement.
//!
//! Per (tile, KV head): keys and values arrive already rotated by the normalised Sylvester
//! Hadamard matrix; each is balanced by a log-domain Sinkhorn variance normalisation,
//! quantised by asymmetric per-row min/max RTN, and the RTN scale and zero point are absorbed
//! into the row-axis Sinkhorn scale. K is handled as a `[D, G]` matrix (rows = channels, so
//! keys are quantised per channel), V as `[G, D]` (rows = tokens).
//!
//! Both halves are therefore the same object: a `[rows, cols]` code matrix with a per-row
//! scale `A` and zero `Z` and a per-column scale `B`, reconstructed as `(q·A[r] + Z[r])·B[c]`.
//!
//! Record per (tile, head), byte offsets in this order (D = head_dim, G = tile tokens):
//! `K codes (D·G·kb/8) | s_col_K f16[D] | zp_K f16[D] | s_row_K f16[G] |
//!  V codes (G·D·vb/8) | s_col_V f16[D] | s_row_V f16[G] | zp_V f16[G]`, padded to 8 bytes.
//! Codes are a little-endian bitstream over the row-major matrix (code `i` starts at bit
//! `i·bits`), which for 4 and 2 bits is exactly the reference's nibble / crumb packing.

use half::f16;

use super::base::{KvBase, KvBits, RefineBits};
use super::bitpack;
use crate::backend::cpu::math::multiversioned;
use crate::backend::cpu::SimdLevel;
use crate::resident::hadamard::fwht_scaled;

/// Tokens per tile of the shipped KVarN presets (one vLLM block upstream).
const DEFAULT_TILE_TOKENS: usize = 128;

/// Sinkhorn constants of the reference `sinkhorn.py` (16 iterations is its default and the
/// store functions'; the vLLM config ships 8, commented as lossless against 16).
const SINKHORN_ITERS: usize = 16;
const STD_MIN: f32 = 1e-3;
const STD_MAX: f32 = 1e3;
/// The reference clips log-scales to [−0.3, 10]; exp is monotone, so clipping the scales to
/// [e^−0.3, e^10] is the same step, and keeping linear scales avoids an ln and an exp per
/// line per half-step.
const S_MIN: f32 = 0.740_818_2;
const S_MAX: f32 = 22_026.465;
const IMBALANCE_FLOOR: f32 = 1e-8;

/// Inputs are clamped here so that every stored fp16 quantity stays finite: the column scale
/// is at least e^-0.3, so balanced magnitudes stay below 2.7e4 and a 1-bit row's scale below
/// 5.4e4 < 65504. Real K/V activations come from fp16/bf16 and are far smaller.
const INPUT_LIMIT: f32 = 2.0e4;

/// Column scales are clamped into a finite, normal fp16 range before rounding.
const SCALE_MIN: f32 = 6.103_515_6e-5;
const SCALE_MAX: f32 = 6.0e4;

/// Column chunk for the hot decode loop: the column scales of one chunk are converted from
/// fp16 once into a stack buffer and reused by every row, so decode never allocates.
const COL_CHUNK: usize = 256;

/// Bytes of one encoded tile of one KV head (the record layout in the module docs).
pub fn kvarn_tile_bytes(bits: KvBits, head_dim: usize, tile: usize) -> usize {
    Layout::new(bits, head_dim, tile).total
}

/// One code matrix of the record and where its metadata lives.
#[derive(Clone, Copy, Debug)]
struct Section {
    rows: usize,
    cols: usize,
    bits: u32,
    codes: usize,
    codes_len: usize,
    /// Per-row absorbed scale (f16[rows]).
    a: usize,
    /// Per-row absorbed zero point (f16[rows]).
    z: usize,
    /// Per-column Sinkhorn scale (f16[cols]).
    b: usize,
}

impl Section {
    fn codes<'t>(&self, tile: &'t [u8]) -> &'t [u8] {
        &tile[self.codes..self.codes + self.codes_len]
    }
}

#[derive(Clone, Copy, Debug)]
struct Layout {
    k: Section,
    v: Section,
    total: usize,
}

impl Layout {
    fn new(bits: KvBits, d: usize, g: usize) -> Layout {
        let k_len = packed_len(d * g, bits.key);
        let k_a = k_len;
        let k_z = k_a + 2 * d;
        let k_b = k_z + 2 * d;
        let v_codes = k_b + 2 * g;
        let v_len = packed_len(g * d, bits.value);
        let v_b = v_codes + v_len;
        let v_a = v_b + 2 * d;
        let v_z = v_a + 2 * g;
        let end = v_z + 2 * g;
        Layout {
            k: Section {
                rows: d,
                cols: g,
                bits: bits.key,
                codes: 0,
                codes_len: k_len,
                a: k_a,
                z: k_z,
                b: k_b,
            },
            v: Section {
                rows: g,
                cols: d,
                bits: bits.value,
                codes: v_codes,
                codes_len: v_len,
                a: v_a,
                z: v_z,
                b: v_b,
            },
            total: end.next_multiple_of(8),
        }
    }
}

fn packed_len(n: usize, bits: u32) -> usize {
    (n * bits as usize).div_ceil(8)
}

/// KVarN tile codec for one head dimension and bit allocation.
#[derive(Clone, Debug)]
pub struct Kvarn {
    bits: KvBits,
    head_dim: usize,
    tile_tokens: usize,
    layout: Layout,
    inv_sqrt_d: f32,
    /// Always [`SINKHORN_ITERS`] outside tests; tests set 0 to get plain per-row RTN.
    sinkhorn_iters: usize,
    /// SIMD tier the decode kernels run at.
    simd: SimdLevel,
}

impl Kvarn {
    /// KVarN with 128-token tiles. `head_dim` must be a power of two (fast Hadamard).
    pub fn new(bits: KvBits, head_dim: usize) -> Result<Kvarn, String> {
        Kvarn::with_tile(bits, head_dim, DEFAULT_TILE_TOKENS)
    }

    /// KVarN with `tile_tokens` tokens per tile (at least 2: per-row std needs two samples).
    pub fn with_tile(bits: KvBits, head_dim: usize, tile_tokens: usize) -> Result<Kvarn, String> {
        for (what, b) in [("key", bits.key), ("value", bits.value)] {
            if !(1..=8).contains(&b) {
                return Err(format!("kvarn: {what} bits must be 1..=8, got {b}"));
            }
        }
        if head_dim == 0 || !head_dim.is_power_of_two() {
            return Err(format!(
                "kvarn: head_dim must be a power of two for the fast Hadamard transform, got {head_dim}"
            ));
        }
        if tile_tokens < 2 {
            return Err(format!(
                "kvarn: tile_tokens must be at least 2, got {tile_tokens}"
            ));
        }
        Ok(Kvarn {
            bits,
            head_dim,
            tile_tokens,
            layout: Layout::new(bits, head_dim, tile_tokens),
            inv_sqrt_d: 1.0 / (head_dim as f32).sqrt(),
            sinkhorn_iters: SINKHORN_ITERS,
            simd: SimdLevel::detect(),
        })
    }

    fn check_tile(&self, tile: &[u8]) {
        assert!(
            tile.len() >= self.layout.total,
            "kvarn: tile record has {} bytes, need {}",
            tile.len(),
            self.layout.total
        );
    }
}

/// Byte offsets of the sections of one tile record (the module docs' layout), for kernels
/// that read records in place: key codes `[head_dim, tile]` with A and Z per channel and B per
/// token; value codes `[tile, head_dim]` with A and Z per token and B per channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvarnRecordLayout {
    pub k_codes: usize,
    pub k_a: usize,
    pub k_z: usize,
    pub k_b: usize,
    pub v_codes: usize,
    pub v_a: usize,
    pub v_z: usize,
    pub v_b: usize,
    pub total: usize,
}

impl Kvarn {
    pub fn record_layout(&self) -> KvarnRecordLayout {
        let (k, v) = (self.layout.k, self.layout.v);
        KvarnRecordLayout {
            k_codes: k.codes,
            k_a: k.a,
            k_z: k.z,
            k_b: k.b,
            v_codes: v.codes,
            v_a: v.a,
            v_z: v.z,
            v_b: v.b,
            total: self.layout.total,
        }
    }
}

impl KvBase for Kvarn {
    fn name(&self) -> String {
        format!("kvarn {}", self.bits)
    }

    fn bits(&self) -> KvBits {
        self.bits
    }

    fn head_dim(&self) -> usize {
        self.head_dim
    }

    fn tile_tokens(&self) -> usize {
        self.tile_tokens
    }

    fn tile_bytes(&self) -> usize {
        self.layout.total
    }

    fn to_code_frame(&self, x: &mut [f32]) {
        assert_eq!(x.len(), self.head_dim, "kvarn: vector length != head_dim");
        fwht_scaled(self.simd, x, self.inv_sqrt_d);
    }

    fn to_model_frame(&self, x: &mut [f32]) {
        // The normalised Sylvester matrix is symmetric and orthogonal: H⁻¹ = H.
        assert_eq!(x.len(), self.head_dim, "kvarn: vector length != head_dim");
        fwht_scaled(self.simd, x, self.inv_sqrt_d);
    }

    fn encode_tile(
        &self,
        keys: &[f32],
        values: &[f32],
        refine: RefineBits,
        out: &mut [u8],
        key_sub: &mut [u8],
        value_sub: &mut [u8],
    ) {
        let (d, g) = (self.head_dim, self.tile_tokens);
        let n = d * g;
        assert!(
            keys.len() >= n && values.len() >= n,
            "kvarn: short K/V tile"
        );
        assert!(
            out.len() >= self.layout.total,
            "kvarn: output record too short"
        );
        let out = &mut out[..self.layout.total];
        // Padding and the OR-ed code streams both rely on a zeroed record.
        out.fill(0);

        // K is quantised as [D, G]: transpose the token-major input.
        let mut kt = vec![0.0f32; n];
        for (t, row) in keys[..n].chunks_exact(d).enumerate() {
            for (c, &x) in row.iter().enumerate() {
                kt[c * g + t] = sanitize(x);
            }
        }
        let key_sub = if refine.key > 0 {
            assert!(key_sub.len() >= n, "kvarn: key_sub too short");
            Some(SubOut {
                dst: &mut key_sub[..n],
                bits: refine.key.min(8),
                transposed: true,
            })
        } else {
            None
        };
        encode_section(&self.layout.k, &kt, self.sinkhorn_iters, out, key_sub);

        let vt: Vec<f32> = values[..n].iter().map(|&x| sanitize(x)).collect();
        let value_sub = if refine.value > 0 {
            assert!(value_sub.len() >= n, "kvarn: value_sub too short");
            Some(SubOut {
                dst: &mut value_sub[..n],
                bits: refine.value.min(8),
                transposed: false,
            })
        } else {
            None
        };
        encode_section(&self.layout.v, &vt, self.sinkhorn_iters, out, value_sub);
    }

    fn decode_keys(&self, tile: &[u8], out: &mut [f32]) {
        self.check_tile(tile);
        decode_section(self.simd, &self.layout.k, tile, out);
    }

    fn decode_values(&self, tile: &[u8], out: &mut [f32]) {
        self.check_tile(tile);
        decode_section(self.simd, &self.layout.v, tile, out);
    }

    fn refined_key(&self, tile: &[u8], t: usize, sub: &[u8], bits: u32, out: &mut [f32]) {
        self.check_tile(tile);
        assert!(t < self.tile_tokens, "kvarn: token {t} outside the tile");
        // Token t is column t of the [D, G] key matrix.
        refine_line(&self.layout.k, tile, Line::Col(t), sub, bits, out);
    }

    fn refined_value(&self, tile: &[u8], t: usize, sub: &[u8], bits: u32, out: &mut [f32]) {
        self.check_tile(tile);
        assert!(t < self.tile_tokens, "kvarn: token {t} outside the tile");
        refine_line(&self.layout.v, tile, Line::Row(t), sub, bits, out);
    }
}

// ---------------------------------------------------------------------------------------------
// Hadamard

// ---------------------------------------------------------------------------------------------
// Sinkhorn variance normalisation

/// Best-so-far scales of the log-domain Sinkhorn: `balanced = tile / s_col / s_row`.
struct Balance {
    s_col: Vec<f32>,
    #[cfg_attr(not(test), allow(dead_code))]
    s_row: Vec<f32>,
    #[cfg_attr(not(test), allow(dead_code))]
    imbalance: f32,
}

/// Reference semantics (`variance_normalize`): unbiased std (torch default), the starting
/// identity scales are a candidate, ties go to the later iterate (`imb <= best`).
fn sinkhorn(m: &[f32], rows: usize, cols: usize, iters: usize) -> Balance {
    let mut s_c = vec![1.0f32; cols];
    let mut s_r = vec![1.0f32; rows];
    let mut inv_c = vec![1.0f32; cols];
    let mut inv_r = vec![1.0f32; rows];
    let mut cur = vec![0.0f32; rows * cols];
    let mut col_sd = vec![0.0f32; cols];
    let mut row_sd = vec![0.0f32; rows];
    let mut col_mean = vec![0.0f32; cols];

    materialise(m, cols, &inv_c, &inv_r, &mut cur);
    col_std(&cur, rows, cols, &mut col_mean, &mut col_sd);
    row_std(&cur, cols, &mut row_sd);
    let mut best = imbalance(&col_sd, &row_sd);
    let mut best_c = vec![1.0f32; cols];
    let mut best_r = vec![1.0f32; rows];

    for _ in 0..iters {
        // col_sd always holds the column stds of the current iterate here.
        update_scale(&mut s_c, &mut inv_c, &mut col_sd);
        materialise(m, cols, &inv_c, &inv_r, &mut cur);
        row_std(&cur, cols, &mut row_sd);
        // Rescales row_sd to the row stds of the new iterate, saving a pass over the tile.
        update_scale(&mut s_r, &mut inv_r, &mut row_sd);
        materialise(m, cols, &inv_c, &inv_r, &mut cur);
        col_std(&cur, rows, cols, &mut col_mean, &mut col_sd);
        let imb = imbalance(&col_sd, &row_sd);
        if imb <= best {
            best = imb;
            best_c.copy_from_slice(&s_c);
            best_r.copy_from_slice(&s_r);
        }
    }
    Balance {
        s_col: best_c,
        s_row: best_r,
        imbalance: best,
    }
}

/// One Sinkhorn half-step on one axis. Scaling a line by `k` scales its std by `k`, so `sd` is
/// updated to the stds of the rescaled lines exactly, without another pass over the tile.
fn update_scale(scale: &mut [f32], inv: &mut [f32], sd: &mut [f32]) {
    for ((s, i), d) in scale.iter_mut().zip(inv.iter_mut()).zip(sd.iter_mut()) {
        let new = (*s * d.clamp(STD_MIN, STD_MAX)).clamp(S_MIN, S_MAX);
        *d *= *s / new;
        *s = new;
        *i = 1.0 / new;
    }
}

fn materialise(m: &[f32], cols: usize, inv_c: &[f32], inv_r: &[f32], cur: &mut [f32]) {
    for ((crow, mrow), &ir) in cur
        .chunks_exact_mut(cols)
        .zip(m.chunks_exact(cols))
        .zip(inv_r)
    {
        for ((c, &x), &ic) in crow.iter_mut().zip(mrow).zip(inv_c) {
            *c = x * ic * ir;
        }
    }
}

/// Two-pass (mean, then squared deviations): K channels can carry offsets far above their
/// spread, where a one-pass sum of squares would cancel catastrophically in f32.
fn col_std(cur: &[f32], rows: usize, cols: usize, mean: &mut [f32], out: &mut [f32]) {
    mean.fill(0.0);
    for row in cur.chunks_exact(cols) {
        for (s, &v) in mean.iter_mut().zip(row) {
            *s += v;
        }
    }
    let inv_n = 1.0 / rows as f32;
    for s in mean.iter_mut() {
        *s *= inv_n;
    }
    out.fill(0.0);
    for row in cur.chunks_exact(cols) {
        for ((o, &mu), &v) in out.iter_mut().zip(mean.iter()).zip(row) {
            let dv = v - mu;
            *o += dv * dv;
        }
    }
    let inv_dof = 1.0 / rows.saturating_sub(1).max(1) as f32;
    for o in out.iter_mut() {
        *o = (*o * inv_dof).sqrt();
    }
}

fn row_std(cur: &[f32], cols: usize, out: &mut [f32]) {
    let inv_n = 1.0 / cols as f32;
    let inv_dof = 1.0 / cols.saturating_sub(1).max(1) as f32;
    for (o, row) in out.iter_mut().zip(cur.chunks_exact(cols)) {
        let mu = lane_sum(row, |v| v) * inv_n;
        *o = (lane_sum(row, |v| (v - mu) * (v - mu)) * inv_dof).sqrt();
    }
}

/// Sum with eight independent accumulators so the reduction vectorises without fast-math.
#[inline(always)]
fn lane_sum(xs: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut chunks = xs.chunks_exact(8);
    for ch in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(ch) {
            *a += f(v);
        }
    }
    let tail: f32 = chunks.remainder().iter().map(|&v| f(v)).sum();
    acc.iter().sum::<f32>() + tail
}

fn spread(sd: &[f32]) -> f32 {
    let (lo, hi) = sd.iter().fold((f32::INFINITY, 0.0f32), |(lo, hi), &s| {
        (lo.min(s), hi.max(s))
    });
    hi / lo.max(IMBALANCE_FLOOR)
}

fn imbalance(col_sd: &[f32], row_sd: &[f32]) -> f32 {
    spread(col_sd) + spread(row_sd)
}

// ---------------------------------------------------------------------------------------------
// Encoding

fn sanitize(x: f32) -> f32 {
    if x.is_nan() {
        0.0
    } else {
        x.clamp(-INPUT_LIMIT, INPUT_LIMIT)
    }
}

/// Where the refinement sub-indices of one section go. The trait stores them token-major
/// `[G, D]`; K's matrix is `[D, G]`, hence `transposed`.
struct SubOut<'a> {
    dst: &'a mut [u8],
    bits: u32,
    transposed: bool,
}

fn write_f16(out: &mut [u8], at: usize, h: f16) {
    out[at..at + 2].copy_from_slice(&h.to_le_bytes());
}

#[inline(always)]
fn read_f16(tile: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([tile[at], tile[at + 1]]).to_f32()
}

fn f16_step_down(h: f16) -> f16 {
    let b = h.to_bits();
    let next = if b & 0x8000 == 0 {
        if b == 0 {
            f16::from_bits(0x8001)
        } else {
            f16::from_bits(b - 1)
        }
    } else {
        f16::from_bits(b + 1)
    };
    if next.is_finite() {
        next
    } else {
        h
    }
}

fn f16_step_up(h: f16) -> f16 {
    let b = h.to_bits();
    let next = if b & 0x8000 == 0 {
        f16::from_bits(b + 1)
    } else if b == 0x8000 {
        f16::from_bits(0x0001)
    } else {
        f16::from_bits(b - 1)
    };
    if next.is_finite() {
        next
    } else {
        h
    }
}

/// Largest fp16 not above `v`, so the stored zero point never lies above the row minimum.
fn f16_floor(v: f32) -> f16 {
    let h = f16::from_f32(v);
    if h.to_f32() > v {
        f16_step_down(h)
    } else {
        h
    }
}

/// Smallest fp16 not below `v`, so the stored grid still reaches the row maximum.
fn f16_ceil(v: f32) -> f16 {
    let h = f16::from_f32(v);
    if h.to_f32() < v {
        f16_step_up(h)
    } else {
        h
    }
}

/// Encodes one `[rows, cols]` matrix (already sanitised) into its section of `out`.
///
/// The row-axis Sinkhorn scale cancels exactly under per-row min/max RTN once absorbed
/// (`A = s_row·(hi−lo)/(s_row·qmax)`, `Z = s_row·lo/s_row`), so the row is quantised directly
/// in the domain `y = x / B`, using the fp16-rounded `B` the decoder will see. `Z` is rounded
/// down and `A` up to fp16 so the stored grid covers `[lo, hi]`, and codes and sub-indices are
/// both computed against the stored fp16 `A`, `Z`: every element then lies within half a
/// stored bin of its code's centre, whatever the fp16 rounding did to the metadata.
fn encode_section(
    sec: &Section,
    m: &[f32],
    iters: usize,
    out: &mut [u8],
    mut sub: Option<SubOut<'_>>,
) {
    let (rows, cols) = (sec.rows, sec.cols);
    let bal = sinkhorn(m, rows, cols, iters);

    let mut b = vec![0.0f32; cols];
    for (c, (bf, &s)) in b.iter_mut().zip(&bal.s_col).enumerate() {
        let h = f16::from_f32(s.clamp(SCALE_MIN, SCALE_MAX));
        write_f16(out, sec.b + 2 * c, h);
        *bf = h.to_f32();
    }

    let qmax = ((1u32 << sec.bits) - 1) as f32;
    let mut y = vec![0.0f32; cols];
    for (r, mrow) in m.chunks_exact(cols).enumerate() {
        let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
        for ((yv, &x), &bf) in y.iter_mut().zip(mrow).zip(&b) {
            *yv = x / bf;
            lo = lo.min(*yv);
            hi = hi.max(*yv);
        }
        let z = f16_floor(lo);
        let zf = z.to_f32();
        let mut a = f16_ceil(((hi - zf) / qmax).max(f16::MIN_POSITIVE_SUBNORMAL.to_f32()));
        // f32 rounding of the division may leave the top of the grid an ulp short.
        for _ in 0..4 {
            if zf + qmax * a.to_f32() >= hi {
                break;
            }
            a = f16_step_up(a);
        }
        write_f16(out, sec.a + 2 * r, a);
        write_f16(out, sec.z + 2 * r, z);
        let af = a.to_f32();

        let codes = &mut out[sec.codes..sec.codes + sec.codes_len];
        for (c, &yv) in y.iter().enumerate() {
            let u = (yv - zf) / af;
            // Truncation of a non-negative value is floor; round() and floor() are libm
            // calls on baseline x86-64 and made up a large share of encode time.
            let qi = (u.clamp(0.0, qmax) + 0.5) as u32;
            let q = qi as f32;
            bitpack::put(
                codes,
                (r * cols + c) * sec.bits as usize,
                sec.bits,
                qi as u8,
            );
            if let Some(s) = sub.as_mut() {
                let n = (1u32 << s.bits) as f32;
                // Position inside the bin [q−½, q+½) in units of A.
                let pos = u - q + 0.5;
                let idx = (pos * n).clamp(0.0, n - 1.0) as u8;
                let at = if s.transposed {
                    c * rows + r
                } else {
                    r * cols + c
                };
                s.dst[at] = idx;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding (hot path)

multiversioned! {
    /// Writes the `[rows, cols]` resident matrix `(q·A[r] + Z[r])·B[c]` row-major into `out`
    /// (compiled per SIMD tier: the row kernels vectorize over columns).
    fn decode_section(sec: &Section, tile: &[u8], out: &mut [f32]) = decode_section_body;
}

#[inline(always)]
fn decode_section_body(sec: &Section, tile: &[u8], out: &mut [f32]) {
    let (rows, cols, bits) = (sec.rows, sec.cols, sec.bits);
    assert!(out.len() >= rows * cols, "kvarn: decode output too short");
    let codes = sec.codes(tile);
    if !cols.is_multiple_of(8) {
        // Rows that do not start on a byte boundary only occur in tiny test geometries.
        decode_section_scalar(sec, tile, out);
        return;
    }
    let row_bytes = cols * bits as usize / 8;
    let mut bbuf = [0.0f32; COL_CHUNK];
    let mut c0 = 0;
    while c0 < cols {
        let n = COL_CHUNK.min(cols - c0);
        for (i, v) in bbuf[..n].iter_mut().enumerate() {
            *v = read_f16(tile, sec.b + 2 * (c0 + i));
        }
        let bcol = &bbuf[..n];
        let byte0 = c0 * bits as usize / 8;
        let nbytes = n * bits as usize / 8;
        for (r, orow) in out[..rows * cols].chunks_exact_mut(cols).enumerate() {
            let a = read_f16(tile, sec.a + 2 * r);
            let z = read_f16(tile, sec.z + 2 * r);
            let src = &codes[r * row_bytes + byte0..][..nbytes];
            let dst = &mut orow[c0..c0 + n];
            match bits {
                4 => row_4bit(src, a, z, bcol, dst),
                8 => row_8bit(src, a, z, bcol, dst),
                1 => row_packed::<1>(src, a, z, bcol, dst),
                2 => row_packed::<2>(src, a, z, bcol, dst),
                3 => row_packed::<3>(src, a, z, bcol, dst),
                5 => row_packed::<5>(src, a, z, bcol, dst),
                6 => row_packed::<6>(src, a, z, bcol, dst),
                _ => row_packed::<7>(src, a, z, bcol, dst),
            }
        }
        c0 += n;
    }
}

fn decode_section_scalar(sec: &Section, tile: &[u8], out: &mut [f32]) {
    let codes = sec.codes(tile);
    let cols = sec.cols;
    for (r, orow) in out[..sec.rows * cols].chunks_exact_mut(cols).enumerate() {
        let a = read_f16(tile, sec.a + 2 * r);
        let z = read_f16(tile, sec.z + 2 * r);
        for (c, o) in orow.iter_mut().enumerate() {
            let q = f32::from(bitpack::get(
                codes,
                (r * cols + c) * sec.bits as usize,
                sec.bits,
            ));
            *o = (q * a + z) * read_f16(tile, sec.b + 2 * c);
        }
    }
}

#[inline(always)]
fn row_4bit(src: &[u8], a: f32, z: f32, b: &[f32], dst: &mut [f32]) {
    for ((&byte, bb), d) in src
        .iter()
        .zip(b.chunks_exact(2))
        .zip(dst.chunks_exact_mut(2))
    {
        d[0] = (f32::from(byte & 15) * a + z) * bb[0];
        d[1] = (f32::from(byte >> 4) * a + z) * bb[1];
    }
}

#[inline(always)]
fn row_8bit(src: &[u8], a: f32, z: f32, b: &[f32], dst: &mut [f32]) {
    for ((&byte, &bb), d) in src.iter().zip(b).zip(dst.iter_mut()) {
        *d = (f32::from(byte) * a + z) * bb;
    }
}

/// Any width: eight codes fill exactly `BITS` bytes, so each group is one little-endian
/// word. `BITS` is a constant so the shifts are immediates (a runtime width made 3-bit decode
/// ~5× slower than 4-bit). Measured faster than per-byte unpacking for 1 and 2 bits, slower
/// for 4 and 8, which keep their byte kernels.
#[inline(always)]
fn row_packed<const BITS: usize>(src: &[u8], a: f32, z: f32, b: &[f32], dst: &mut [f32]) {
    let mask = (1u64 << BITS) - 1;
    for ((grp, bb), d) in src
        .chunks_exact(BITS)
        .zip(b.chunks_exact(8))
        .zip(dst.chunks_exact_mut(8))
    {
        let mut w = [0u8; 8];
        w[..BITS].copy_from_slice(grp);
        let word = u64::from_le_bytes(w);
        for j in 0..8 {
            let q = ((word >> (j * BITS)) & mask) as u32;
            d[j] = (q as f32 * a + z) * bb[j];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Refinement

/// One token's line through a section matrix: a column of K's `[D, G]`, a row of V's `[G, D]`.
#[derive(Clone, Copy)]
enum Line {
    Row(usize),
    Col(usize),
}

fn refine_line(sec: &Section, tile: &[u8], line: Line, sub: &[u8], bits: u32, out: &mut [f32]) {
    let len = match line {
        Line::Row(_) => sec.cols,
        Line::Col(_) => sec.rows,
    };
    assert!(out.len() >= len, "kvarn: refined output too short");
    let bits = bits.min(8);
    if bits > 0 {
        assert!(sub.len() >= len, "kvarn: sub-index slice too short");
    }
    let codes = sec.codes(tile);
    // Sub-interval k of 2^bits has centre −½ + (k+½)/2^bits in code units; 2^bits is a power
    // of two, so the table is exact and needs no per-element division.
    let n = 1usize << bits;
    let step = 1.0 / n as f32;
    let mut offset = [0.0f32; 256];
    for (k, o) in offset[..n].iter_mut().enumerate() {
        *o = if bits == 0 {
            0.0
        } else {
            (k as f32 + 0.5) * step - 0.5
        };
    }
    let sub_off = |i: usize| -> f32 {
        if bits == 0 {
            0.0
        } else {
            // Indices are masked so a corrupt byte cannot index out of the table.
            offset[usize::from(sub[i]) & (n - 1)]
        }
    };
    match line {
        Line::Row(r) => {
            let a = read_f16(tile, sec.a + 2 * r);
            let z = read_f16(tile, sec.z + 2 * r);
            for (c, o) in out[..len].iter_mut().enumerate() {
                let q = f32::from(bitpack::get(
                    codes,
                    (r * sec.cols + c) * sec.bits as usize,
                    sec.bits,
                ));
                *o = ((q + sub_off(c)) * a + z) * read_f16(tile, sec.b + 2 * c);
            }
        }
        Line::Col(c) => {
            let b = read_f16(tile, sec.b + 2 * c);
            for (r, o) in out[..len].iter_mut().enumerate() {
                let a = read_f16(tile, sec.a + 2 * r);
                let z = read_f16(tile, sec.z + 2 * r);
                let q = f32::from(bitpack::get(
                    codes,
                    (r * sec.cols + c) * sec.bits as usize,
                    sec.bits,
                ));
                *o = ((q + sub_off(r)) * a + z) * b;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic 64-bit LCG (Knuth MMIX constants); high bits only.
    struct Lcg(u64);

    impl Lcg {
        fn next_u32(&mut self) -> u32 {
            self.0 = self
                .0
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (self.0 >> 33) as u32
        }

        fn uniform(&mut self) -> f32 {
            ((f64::from(self.next_u32()) + 0.5) / 2_147_483_648.0) as f32
        }

        fn normal(&mut self) -> f32 {
            let (u1, u2) = (self.uniform(), self.uniform());
            (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
        }
    }

    fn kb(k: u32, v: u32) -> KvBits {
        KvBits { key: k, value: v }
    }

    /// `[G, D]` token-major tile with a few outlier channels (large spread, large offset) as
    /// real keys have, and a loud token.
    fn outlier_tile(seed: u64, g: usize, d: usize) -> Vec<f32> {
        let mut rng = Lcg(seed);
        let mut x = vec![0.0f32; g * d];
        for t in 0..g {
            for c in 0..d {
                let mut v = rng.normal();
                if c % 17 == 3 {
                    v = 12.0 * v + 5.0;
                }
                if c == d / 2 {
                    v += 40.0;
                }
                if t == 7 {
                    v *= 6.0;
                }
                x[t * d + c] = v;
            }
        }
        x
    }

    struct Encoded {
        tile: Vec<u8>,
        key_sub: Vec<u8>,
        value_sub: Vec<u8>,
    }

    fn encode(kv: &Kvarn, keys: &[f32], values: &[f32], refine: RefineBits) -> Encoded {
        let n = kv.head_dim() * kv.tile_tokens();
        let mut e = Encoded {
            tile: vec![0xAA; kv.tile_bytes()],
            key_sub: vec![0; n],
            value_sub: vec![0; n],
        };
        kv.encode_tile(
            keys,
            values,
            refine,
            &mut e.tile,
            &mut e.key_sub,
            &mut e.value_sub,
        );
        e
    }

    /// Resident keys and values, both token-major `[G, D]`.
    fn resident(kv: &Kvarn, tile: &[u8]) -> (Vec<f32>, Vec<f32>) {
        let (d, g) = (kv.head_dim(), kv.tile_tokens());
        let mut kc = vec![0.0f32; d * g];
        kv.decode_keys(tile, &mut kc);
        let mut k = vec![0.0f32; d * g];
        for c in 0..d {
            for t in 0..g {
                k[t * d + c] = kc[c * g + t];
            }
        }
        let mut v = vec![0.0f32; d * g];
        kv.decode_values(tile, &mut v);
        (k, v)
    }

    /// Refined keys and values, token-major `[G, D]`.
    fn refined(kv: &Kvarn, e: &Encoded, refine: RefineBits) -> (Vec<f32>, Vec<f32>) {
        let (d, g) = (kv.head_dim(), kv.tile_tokens());
        let mut k = vec![0.0f32; d * g];
        let mut v = vec![0.0f32; d * g];
        for t in 0..g {
            let s = t * d..(t + 1) * d;
            kv.refined_key(
                &e.tile,
                t,
                &e.key_sub[s.clone()],
                refine.key,
                &mut k[s.clone()],
            );
            kv.refined_value(&e.tile, t, &e.value_sub[s.clone()], refine.value, &mut v[s]);
        }
        (k, v)
    }

    /// Stored bin width A·B of element (t, c), token-major.
    fn bin_widths(kv: &Kvarn, tile: &[u8]) -> (Vec<f32>, Vec<f32>) {
        let (d, g) = (kv.head_dim(), kv.tile_tokens());
        let (ks, vs) = (kv.layout.k, kv.layout.v);
        let mut kw = vec![0.0f32; d * g];
        let mut vw = vec![0.0f32; d * g];
        for t in 0..g {
            for c in 0..d {
                kw[t * d + c] = read_f16(tile, ks.a + 2 * c) * read_f16(tile, ks.b + 2 * t);
                vw[t * d + c] = read_f16(tile, vs.a + 2 * t) * read_f16(tile, vs.b + 2 * c);
            }
        }
        (kw, vw)
    }

    fn rel_mse(x: &[f32], y: &[f32]) -> f64 {
        let num: f64 = x
            .iter()
            .zip(y)
            .map(|(&a, &b)| f64::from(a - b).powi(2))
            .sum();
        let den: f64 = x.iter().map(|&a| f64::from(a).powi(2)).sum();
        num / den
    }

    fn check_within(x: &[f32], y: &[f32], width: &[f32], frac: f32, what: &str) {
        for (i, ((&a, &b), &w)) in x.iter().zip(y).zip(width).enumerate() {
            let tol = frac * w * (1.0 + 1e-2) + 1e-4 * a.abs();
            assert!(
                (a - b).abs() <= tol,
                "{what}: element {i}: exact {a}, got {b}, |err| {} > {tol}",
                (a - b).abs()
            );
        }
    }

    #[test]
    fn tile_bytes_match_reference() {
        assert_eq!(kvarn_tile_bytes(kb(4, 4), 128, 128), 17920);
        assert_eq!(kvarn_tile_bytes(kb(4, 2), 128, 128), 13824);
        let kv = Kvarn::new(kb(4, 2), 128).unwrap();
        assert_eq!(kv.tile_bytes(), 13824);
        assert_eq!(kv.tile_tokens(), 128);
        assert_eq!(kv.name(), "kvarn 4/2");
        // Dense streams and 8-byte padding: K 8 codes·2 b = 2 B + 2·4·2 + 2·2 = 22 B,
        // V 8 codes·1 b = 1 B + 4·2 + 2·2·2 = 17 B, 39 B → 40 B.
        assert_eq!(kvarn_tile_bytes(kb(2, 1), 4, 2), 40);
        // 3 bits: 4·4·3/8 = 6 B per stream, (6 + 24)·2 = 60 B → 64 B.
        assert_eq!(kvarn_tile_bytes(kb(3, 3), 4, 4), 64);
    }

    #[test]
    fn constructor_validates() {
        assert!(Kvarn::new(kb(2, 2), 96).is_err());
        assert!(Kvarn::new(kb(2, 2), 0).is_err());
        assert!(Kvarn::new(kb(0, 2), 64).is_err());
        assert!(Kvarn::new(kb(2, 9), 64).is_err());
        assert!(Kvarn::with_tile(kb(2, 2), 64, 1).is_err());
        assert!(Kvarn::with_tile(kb(2, 2), 64, 2).is_ok());
    }

    #[test]
    fn hadamard_is_orthogonal_involution() {
        let kv = Kvarn::new(kb(4, 4), 128).unwrap();
        let mut rng = Lcg(11);
        let x: Vec<f32> = (0..128).map(|_| rng.normal()).collect();
        let mut y = x.clone();
        kv.to_code_frame(&mut y);
        let n0: f32 = x.iter().map(|v| v * v).sum();
        let n1: f32 = y.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() <= 1e-5 * n0, "norm {n0} -> {n1}");
        assert!(x.iter().zip(&y).any(|(a, b)| (a - b).abs() > 1e-3));
        kv.to_model_frame(&mut y);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() <= 1e-6 * (1.0 + a.abs()), "{a} vs {b}");
        }
    }

    #[test]
    fn hadamard_matches_sylvester_matrix() {
        let kv = Kvarn::new(kb(2, 2), 8).unwrap();
        // Sylvester H_8 entry (i, j) = (−1)^popcount(i & j), normalised by 1/√8.
        let h = |i: usize, j: usize| {
            let s = if (i & j).count_ones().is_multiple_of(2) {
                1.0
            } else {
                -1.0
            };
            s / 8f32.sqrt()
        };
        let x = [0.5f32, -1.0, 2.0, 3.5, -0.25, 0.0, 1.5, -2.0];
        let mut y = x;
        kv.to_code_frame(&mut y);
        for (i, &yi) in y.iter().enumerate() {
            let want: f32 = (0..8).map(|j| h(i, j) * x[j]).sum();
            assert!((yi - want).abs() < 1e-6, "row {i}: {yi} vs {want}");
        }
    }

    #[test]
    fn round_trip_within_half_bin() {
        let (d, g) = (64, 128);
        let keys = outlier_tile(1, g, d);
        let values = outlier_tile(2, g, d);
        for bits in 1..=8 {
            let kv = Kvarn::with_tile(kb(bits, bits), d, g).unwrap();
            let e = encode(&kv, &keys, &values, RefineBits::NONE);
            let (k, v) = resident(&kv, &e.tile);
            let (kw, vw) = bin_widths(&kv, &e.tile);
            check_within(&keys, &k, &kw, 0.5, &format!("K {bits}b"));
            check_within(&values, &v, &vw, 0.5, &format!("V {bits}b"));
            assert!(e.tile[kv.layout.v.z + 2 * g..].iter().all(|&b| b == 0));
        }
    }

    /// Rows whose offset dwarfs their spread: the fp16 zero point is then much coarser than a
    /// bin, and only the directed rounding of Z (down) and A (up) keeps the grid over the row.
    #[test]
    fn offset_rows_stay_within_half_bin() {
        let (d, g) = (32, 16);
        let mut rng = Lcg(17);
        let x: Vec<f32> = (0..g * d).map(|_| 40.0 + 0.01 * rng.normal()).collect();
        for bits in [2, 4, 8] {
            let kv = Kvarn::with_tile(kb(bits, bits), d, g).unwrap();
            let e = encode(&kv, &x, &x, RefineBits::NONE);
            let (k, v) = resident(&kv, &e.tile);
            let (kw, vw) = bin_widths(&kv, &e.tile);
            check_within(&x, &k, &kw, 0.5, &format!("K {bits}b"));
            check_within(&x, &v, &vw, 0.5, &format!("V {bits}b"));
        }
    }

    #[test]
    fn error_decreases_with_bits() {
        let (d, g) = (64, 128);
        let keys = outlier_tile(3, g, d);
        let values = outlier_tile(4, g, d);
        let mut last = (f64::INFINITY, f64::INFINITY);
        for bits in [2, 3, 4] {
            let kv = Kvarn::with_tile(kb(bits, bits), d, g).unwrap();
            let e = encode(&kv, &keys, &values, RefineBits::NONE);
            let (k, v) = resident(&kv, &e.tile);
            let cur = (rel_mse(&keys, &k), rel_mse(&values, &v));
            assert!(
                cur.0 < last.0 && cur.1 < last.1,
                "{bits}b: {cur:?} vs {last:?}"
            );
            last = cur;
        }
        // The +40 offset channel costs per-token V quantisation most: Sinkhorn balances
        // spread, not means (in the model the Hadamard rotation spreads such offsets).
        assert!(last.0 < 1e-2 && last.1 < 5e-2, "{last:?}");
    }

    #[test]
    fn refinement_subdivides_bins() {
        let (d, g) = (64, 128);
        let keys = outlier_tile(5, g, d);
        let values = outlier_tile(6, g, d);
        for bits in [2, 3] {
            let kv = Kvarn::with_tile(kb(bits, bits), d, g).unwrap();
            let base = encode(&kv, &keys, &values, RefineBits::NONE);
            let (k0, v0) = resident(&kv, &base.tile);
            let (mk0, mv0) = (rel_mse(&keys, &k0), rel_mse(&values, &v0));
            for rb in 1..=4u32 {
                let refine = RefineBits { key: rb, value: rb };
                let e = encode(&kv, &keys, &values, refine);
                // Refinement must not change the resident record.
                assert_eq!(e.tile, base.tile);
                assert!(e
                    .key_sub
                    .iter()
                    .chain(&e.value_sub)
                    .all(|&s| u32::from(s) < 1 << rb));
                let (k, v) = refined(&kv, &e, refine);
                let (kw, vw) = bin_widths(&kv, &e.tile);
                let frac = 1.0 / (1u32 << (rb + 1)) as f32;
                check_within(&keys, &k, &kw, frac, &format!("K {bits}b+{rb}"));
                check_within(&values, &v, &vw, frac, &format!("V {bits}b+{rb}"));
                let (mk, mv) = (rel_mse(&keys, &k), rel_mse(&values, &v));
                assert!(
                    mk < mk0 && mv < mv0,
                    "{bits}b+{rb}: {mk} {mv} vs {mk0} {mv0}"
                );
                if rb == 4 {
                    assert!(
                        mk0 / mk > 10.0 && mv0 / mv > 10.0,
                        "{bits}b+4 gain K {} V {}",
                        mk0 / mk,
                        mv0 / mv
                    );
                }
            }
        }
    }

    #[test]
    fn one_sided_refinement_leaves_other_sub_untouched() {
        let (d, g) = (8, 8);
        let kv = Kvarn::with_tile(kb(2, 2), d, g).unwrap();
        let x = outlier_tile(9, g, d);
        let mut tile = vec![0; kv.tile_bytes()];
        let mut ks = vec![0xEE; d * g];
        let mut vs = vec![0xEE; d * g];
        kv.encode_tile(
            &x,
            &x,
            RefineBits { key: 0, value: 1 },
            &mut tile,
            &mut ks,
            &mut vs,
        );
        assert!(ks.iter().all(|&s| s == 0xEE));
        assert!(vs.iter().all(|&s| s < 2));
    }

    #[test]
    fn decode_agrees_with_refined_at_zero_bits() {
        // 128 × 64 takes the fast kernels, 6 × 4 the scalar fallback.
        for (d, g) in [(64, 128), (4, 6), (8, 40)] {
            for bits in 1..=8 {
                let kv = Kvarn::with_tile(kb(bits, 9 - bits), d, g).unwrap();
                let keys = outlier_tile(7, g, d);
                let values = outlier_tile(8, g, d);
                let e = encode(&kv, &keys, &values, RefineBits::NONE);
                let (k, v) = resident(&kv, &e.tile);
                let mut out = vec![0.0f32; d];
                for t in 0..g {
                    kv.refined_key(&e.tile, t, &[], 0, &mut out);
                    assert_eq!(out, k[t * d..(t + 1) * d], "K token {t} bits {bits}");
                    kv.refined_value(&e.tile, t, &[], 0, &mut out);
                    assert_eq!(out, v[t * d..(t + 1) * d], "V token {t} bits {bits}");
                }
            }
        }
    }

    #[test]
    fn fast_kernels_match_scalar_decode() {
        let (d, g) = (64, 128);
        let keys = outlier_tile(12, g, d);
        let values = outlier_tile(13, g, d);
        for bits in 1..=8 {
            let kv = Kvarn::with_tile(kb(bits, bits), d, g).unwrap();
            let e = encode(&kv, &keys, &values, RefineBits::NONE);
            for sec in [kv.layout.k, kv.layout.v] {
                let mut fast = vec![0.0f32; d * g];
                let mut slow = vec![1.0f32; d * g];
                decode_section(SimdLevel::detect(), &sec, &e.tile, &mut fast);
                decode_section_scalar(&sec, &e.tile, &mut slow);
                assert_eq!(fast, slow, "bits {bits}");
            }
        }
    }

    /// Builds a 2-token, 8-channel tile whose every row spans exactly [0, qmax] with integer
    /// entries, so with the Sinkhorn disabled A = 1, Z = 0, B = 1 and the codes are the entries.
    fn packing_case(bits: u32, kq: &[[u32; 2]; 8], vq: &[[u32; 8]; 2]) -> Vec<u8> {
        let mut kv = Kvarn::with_tile(kb(bits, bits), 8, 2).unwrap();
        kv.sinkhorn_iters = 0;
        let mut keys = vec![0.0f32; 16];
        let mut values = vec![0.0f32; 16];
        for c in 0..8 {
            for t in 0..2 {
                keys[t * 8 + c] = kq[c][t] as f32;
                values[t * 8 + c] = vq[t][c] as f32;
            }
        }
        let e = encode(&kv, &keys, &values, RefineBits::NONE);
        let (k, v) = resident(&kv, &e.tile);
        assert_eq!(k, keys);
        assert_eq!(v, values);
        let (ks, vs) = (kv.layout.k, kv.layout.v);
        let mut streams = ks.codes(&e.tile).to_vec();
        streams.extend_from_slice(vs.codes(&e.tile));
        streams
    }

    #[test]
    fn packing_bit_positions() {
        // K matrix row c = channel c holds codes (c,0), (c,1) at stream indices 2c, 2c+1.
        // 1 bit: K codes 0,1, 1,0, 0,1, 0,1 | 1,0, 1,0, 0,1, 1,0 → bit i = code i.
        let k1 = [
            [0, 1],
            [1, 0],
            [0, 1],
            [0, 1],
            [1, 0],
            [1, 0],
            [0, 1],
            [1, 0],
        ];
        let v1 = [[1, 0, 0, 0, 0, 0, 0, 1], [0, 1, 1, 1, 0, 1, 0, 1]];
        // K bits (LSB first): 0110 0101 → 0b1010_0110 = 0xA6; 1010 0110 → 0b0110_0101 = 0x65.
        // V: 1000 0001 → 0x81; 0111 0101 → 0b1010_1110 = 0xAE.
        assert_eq!(packing_case(1, &k1, &v1), vec![0xA6, 0x65, 0x81, 0xAE]);

        // 2 bits: index 0 in bits 0–1 of each byte.
        let k2 = [
            [0, 3],
            [3, 0],
            [3, 0],
            [0, 3],
            [0, 3],
            [0, 3],
            [3, 0],
            [3, 0],
        ];
        let v2 = [[0, 1, 2, 3, 3, 2, 1, 0], [3, 3, 0, 0, 1, 0, 3, 2]];
        // K bytes: (0,3,3,0) → 0b00_11_11_00 = 0x3C; (3,0,0,3) → 0b11_00_00_11 = 0xC3;
        // (0,3,0,3) → 0b11_00_11_00 = 0xCC; (3,0,3,0) → 0b00_11_00_11 = 0x33.
        // V bytes: (0,1,2,3) → 0b11_10_01_00 = 0xE4; (3,2,1,0) → 0b00_01_10_11 = 0x1B;
        // (3,3,0,0) → 0x0F; (1,0,3,2) → 0b10_11_00_01 = 0xB1.
        assert_eq!(
            packing_case(2, &k2, &v2),
            vec![0x3C, 0xC3, 0xCC, 0x33, 0xE4, 0x1B, 0x0F, 0xB1]
        );

        // 3 bits: dense stream, codes straddle byte boundaries (code 2 spans bits 6–8).
        let k3 = [
            [0, 7],
            [7, 0],
            [0, 7],
            [7, 0],
            [0, 7],
            [0, 7],
            [7, 0],
            [7, 0],
        ];
        let v3 = [[0, 7, 1, 2, 3, 4, 5, 6], [7, 0, 6, 5, 4, 3, 2, 1]];
        // K codes 0,7,7,0,0,7,7,0 | 0,7,0,7,7,0,7,0, bit i·3 + j = bit j of code i, so
        // bits 0..8 = 000 111 11|1 … : byte 0 = 0b1111_1000 = 0xF8, byte 1 starts with the
        // top bit of code 2 (1), then codes 3, 4 (000 000) and bit 0 of code 5 (1) = 0x81.
        // V codes 0,7,1,2,3,4,5,6: byte 0 = code0 | code1 << 3 | (code2 & 3) << 6 = 0x78,
        // byte 1 = code2 >> 2 | code3 << 1 | code4 << 4 | (code5 & 1) << 7 = 0x34.
        assert_eq!(
            packing_case(3, &k3, &v3),
            vec![0xF8, 0x81, 0x1F, 0x38, 0x7E, 0x1C, 0x78, 0x34, 0xD6, 0x87, 0xCB, 0x29]
        );
    }

    /// `[G, D]` tile with one hot channel and one hot token on top of unit noise.
    fn hot_tile(seed: u64, g: usize, d: usize) -> Vec<f32> {
        let mut rng = Lcg(seed);
        let mut x = vec![0.0f32; g * d];
        for t in 0..g {
            for c in 0..d {
                let mut v = rng.normal();
                if c == 5 {
                    v *= 30.0;
                }
                if t == 9 {
                    v *= 30.0;
                }
                x[t * d + c] = v;
            }
        }
        x
    }

    #[test]
    fn sinkhorn_balances_hot_channel_and_token() {
        let (d, g) = (64, 128);
        let x = hot_tile(21, g, d);
        let none = sinkhorn(&x, g, d, 0);
        let bal = sinkhorn(&x, g, d, SINKHORN_ITERS);
        assert!(
            bal.imbalance < 0.25 * none.imbalance,
            "imbalance {} vs unnormalised {}",
            bal.imbalance,
            none.imbalance
        );
        // The returned imbalance is that of the returned scales.
        let mut cur = x.clone();
        let inv_c: Vec<f32> = bal.s_col.iter().map(|s| 1.0 / s).collect();
        let inv_r: Vec<f32> = bal.s_row.iter().map(|s| 1.0 / s).collect();
        materialise(&x, d, &inv_c, &inv_r, &mut cur);
        let (mut cs, mut rs, mut mean) = (vec![0.0; d], vec![0.0; g], vec![0.0; d]);
        col_std(&cur, g, d, &mut mean, &mut cs);
        row_std(&cur, d, &mut rs);
        let imb = imbalance(&cs, &rs);
        assert!(
            (imb - bal.imbalance).abs() < 1e-3 * imb,
            "{imb} vs {}",
            bal.imbalance
        );
        // The hot channel and hot token got the largest scales.
        let argmax = |s: &[f32]| (0..s.len()).fold(0, |m, i| if s[i] > s[m] { i } else { m });
        assert_eq!(argmax(&bal.s_col), 5);
        assert_eq!(argmax(&bal.s_row), 9);
    }

    #[test]
    fn sinkhorn_beats_plain_rtn_at_two_bits() {
        let (d, g) = (64, 128);
        let keys = hot_tile(22, g, d);
        let values = hot_tile(23, g, d);
        let kv = Kvarn::with_tile(kb(2, 2), d, g).unwrap();
        let mut plain = kv.clone();
        plain.sinkhorn_iters = 0;
        let (k, v) = resident(&kv, &encode(&kv, &keys, &values, RefineBits::NONE).tile);
        let (kp, vp) = resident(
            &plain,
            &encode(&plain, &keys, &values, RefineBits::NONE).tile,
        );
        let (mk, mv) = (rel_mse(&keys, &k), rel_mse(&values, &v));
        let (mkp, mvp) = (rel_mse(&keys, &kp), rel_mse(&values, &vp));
        assert!(
            mk < mkp && mv < mvp,
            "sinkhorn K {mk} V {mv}, plain K {mkp} V {mvp}"
        );
    }

    fn all_finite(kv: &Kvarn, keys: &[f32], values: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let refine = RefineBits { key: 3, value: 2 };
        let e = encode(kv, keys, values, refine);
        let (k, v) = resident(kv, &e.tile);
        let (kr, vr) = refined(kv, &e, refine);
        for (i, x) in k.iter().chain(&v).chain(&kr).chain(&vr).enumerate() {
            assert!(x.is_finite(), "element {i} = {x}");
        }
        assert!(e.key_sub.iter().all(|&s| s < 8) && e.value_sub.iter().all(|&s| s < 4));
        (k, v)
    }

    #[test]
    fn degenerate_tiles_stay_finite() {
        let (d, g) = (16, 8);
        for bits in [1, 2, 3, 4, 8] {
            let kv = Kvarn::with_tile(kb(bits, bits), d, g).unwrap();
            let zeros = vec![0.0f32; d * g];
            let (k, v) = all_finite(&kv, &zeros, &zeros);
            assert!(k.iter().chain(&v).all(|&x| x == 0.0), "zeros {bits}b");

            let konst = vec![3.7f32; d * g];
            let (k, v) = all_finite(&kv, &konst, &konst);
            for &x in k.iter().chain(&v) {
                assert!((x - 3.7).abs() < 1e-2, "constant {bits}b: {x}");
            }

            let tiny = vec![-1e-7f32; d * g];
            all_finite(&kv, &tiny, &tiny);

            let mut bad = outlier_tile(31, g, d);
            bad[3] = f32::NAN;
            bad[17] = f32::INFINITY;
            bad[40] = f32::NEG_INFINITY;
            bad[41] = 1e30;
            let (k, v) = all_finite(&kv, &bad, &bad);
            // Entries away from the poisoned rows/columns still decode sensibly at 8 bits.
            if bits == 8 {
                assert!((k[d * g - 1] - bad[d * g - 1]).abs() < 1.0);
                assert!((v[d * g - 1] - bad[d * g - 1]).abs() < 1.0);
            }
        }
    }

    /// `cargo test --release -p sfx-runtime kvarn -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn bench_decode() {
        use std::hint::black_box;
        use std::time::Instant;
        let (d, g) = (64, 128);
        let keys = outlier_tile(41, g, d);
        let values = outlier_tile(42, g, d);
        for bits in [kb(2, 2), kb(3, 3), kb(4, 4), kb(4, 2), kb(1, 1), kb(8, 8)] {
            let kv = Kvarn::with_tile(bits, d, g).unwrap();
            let e = encode(&kv, &keys, &values, RefineBits::NONE);
            let mut out = vec![0.0f32; d * g];
            let reps = 20_000;
            let mut best_k = f64::INFINITY;
            let mut best_v = f64::INFINITY;
            for _ in 0..5 {
                let t0 = Instant::now();
                for _ in 0..reps {
                    kv.decode_keys(black_box(&e.tile), black_box(&mut out));
                }
                best_k = best_k.min(t0.elapsed().as_secs_f64());
                let t0 = Instant::now();
                for _ in 0..reps {
                    kv.decode_values(black_box(&e.tile), black_box(&mut out));
                }
                best_v = best_v.min(t0.elapsed().as_secs_f64());
            }
            let per = 1e9 / (reps * d * g) as f64;
            let t0 = Instant::now();
            let enc_reps = 50;
            for _ in 0..enc_reps {
                black_box(encode(&kv, &keys, &values, RefineBits { key: 4, value: 4 }));
            }
            let enc_us = t0.elapsed().as_secs_f64() * 1e6 / enc_reps as f64;
            println!(
                "kvarn {bits} D={d} G={g}: decode_keys {:.3} ns/elem, decode_values {:.3} ns/elem, encode_tile(+4/+4) {enc_us:.0} us",
                best_k * per,
                best_v * per
            );
        }
    }
}

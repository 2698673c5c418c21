//! [`TrellisLinear`]: `y = x·Wᵀ` for trellis-coded weights (`sfx_formats::resident::
//! TrellisQuantized`, QTIP/YAQA): `y = sv ⊙ H_outᵀ · (Ŵ · (H_in · (su ⊙ x)))`.
//!
//! Decode (m ≤ 2): the Hadamard transforms cost O(n·m_small) per token; the matvec decodes
//! the trellis on the fly, one tile row (16 outputs) per task — the 16×16 tile streams of a
//! tile row are contiguous, so each task reads `32·K` bytes per 256 weights and never
//! materialises Ŵ. Prefill (m > 2): each task decodes a panel of 16-row tile rows to f32 and
//! runs faer's GEMM on it (as the group-quantized path).

use crate::backend::cpu::gemm::matmul_t_panels;
use crate::backend::cpu::{CpuBackend, CpuBuffer, SimdLevel};
use crate::error::{check_len, Result, RuntimeError};
use crate::linear::Linear;
use crate::resident::add_bias;
use crate::resident::hadamard::{stored_factor, Hadamard};
use crate::resident::trellis::{code_1mad, code_3inst, code_table};
#[cfg(target_arch = "x86_64")]
use crate::resident::trellis_kernel::{decode_tile_seq, tile_row};
use crate::resident::trellis_kernel::{supported as kernel_supported, Tables};
use sfx_formats::resident::{
    TileOrder, TrellisCode, TrellisParts, TrellisQuantized, TrellisScheme, TILE_SIDE, TILE_WEIGHTS,
};

/// Token counts up to this run the decode matvec once per token.
const MATVEC_MAX_ROWS: usize = 2;
/// Below this many stream bytes a matvec stays on one thread (a fork/join costs a few µs).
const MIN_PARALLEL_BYTES: usize = 16 * 1024;

fn shape_err(op: &'static str, msg: impl Into<String>) -> RuntimeError {
    RuntimeError::Shape {
        op,
        msg: msg.into(),
    }
}

/// Everything the kernels need about the code, precomputed once per projection.
#[derive(Debug, Clone)]
pub(crate) struct Decoder {
    code: TrellisCode,
    k: usize,
    /// HYB rows as f32 pairs.
    lut: Vec<[f32; 2]>,
    /// Tile position (row·16 + col) of sequence position p.
    place: [u8; TILE_WEIGHTS],
    row_major: bool,
}

impl Decoder {
    pub(crate) fn new(w: &TrellisQuantized) -> Self {
        let s = w.scheme();
        let lut = w
            .tlut()
            .chunks_exact(2)
            .map(|c| [c[0].to_f32(), c[1].to_f32()])
            .collect();
        let mut place = [0u8; TILE_WEIGHTS];
        for (p, slot) in place.iter_mut().enumerate() {
            let (r, c) = s.order.position(p);
            *slot = (r * TILE_SIDE + c) as u8;
        }
        Self {
            code: s.code,
            k: usize::from(s.k),
            lut,
            place,
            row_major: s.order == TileOrder::RowMajor,
        }
    }

    /// The 16-bit state of step `t`: bits `K·V·t ..+16` of the tile stream, wrapping.
    /// `ext` is the stream followed by its first 4 bytes.
    #[inline(always)]
    fn state(&self, ext: &[u8], t: usize) -> u32 {
        let o = self.k * self.code.values_per_step() * t;
        let b = o >> 3;
        let word = u32::from_be_bytes([ext[b], ext[b + 1], ext[b + 2], ext[b + 3]]);
        (word >> (16 - (o & 7))) & 0xFFFF
    }

    /// Decodes one tile stream into `out` (256 values, tile row-major).
    #[inline(always)]
    pub(crate) fn decode_tile(&self, stream: &[u8], out: &mut [f32; TILE_WEIGHTS]) {
        let mut ext = [0u8; 132];
        let n = stream.len();
        ext[..n].copy_from_slice(stream);
        for i in 0..4 {
            ext[n + i] = stream[i % n];
        }
        let mut seq = [0.0f32; TILE_WEIGHTS];
        match self.code {
            TrellisCode::Hyb { q } => {
                let (shift, mask) = (15 - u32::from(q), (1u32 << q) - 1);
                for (t, pair) in seq.chunks_exact_mut(2).enumerate() {
                    let x = self.state(&ext, t);
                    let h = x * (x + 1);
                    let [a, b] = self.lut[((h >> shift) & mask) as usize];
                    pair[0] = if h & 0x8000 != 0 { -a } else { a };
                    pair[1] = b;
                }
            }
            TrellisCode::OneMad => {
                for (t, v) in seq.iter_mut().enumerate() {
                    *v = code_1mad(self.state(&ext, t));
                }
            }
            TrellisCode::ThreeInst => {
                for (t, v) in seq.iter_mut().enumerate() {
                    *v = code_3inst(self.state(&ext, t));
                }
            }
        }
        self.place(&seq, out);
    }

    /// Sequence order → tile row-major.
    #[inline(always)]
    pub(crate) fn place(&self, seq: &[f32; TILE_WEIGHTS], out: &mut [f32; TILE_WEIGHTS]) {
        if self.row_major {
            *out = *seq;
        } else {
            for (p, &v) in seq.iter().enumerate() {
                out[usize::from(self.place[p])] = v;
            }
        }
    }
}

/// A trellis-coded projection with an optional f32 bias, on the CPU backend.
#[derive(Debug, Clone)]
pub struct TrellisLinear {
    weight: TrellisQuantized,
    decoder: Decoder,
    /// AVX-512 kernel tables when the CPU and the scheme are covered.
    fast: Option<Tables>,
    had_in: Hadamard,
    had_out: Hadamard,
    su: Vec<f32>,
    bias: Option<Vec<f32>>,
}

/// The transforms of a trellis weight, from its stored factors.
pub fn trellis_hadamards(w: &TrellisQuantized) -> Result<(Hadamard, Hadamard)> {
    let rotation = w.scheme().rotation;
    let build = |n: usize, f: &sfx_formats::resident::SmallHadamard, side: &str| {
        Hadamard::for_rotation(n, rotation, f)
            .map_err(|e| shape_err("TrellisLinear::new", format!("{side} transform: {e}")))
    };
    Ok((
        build(w.cols(), w.had_in(), "input")?,
        build(w.rows(), w.had_out(), "output")?,
    ))
}

impl TrellisLinear {
    pub fn new(weight: TrellisQuantized, bias: Option<Vec<f32>>) -> Result<Self> {
        if let Some(b) = &bias {
            check_len("TrellisLinear::new", "bias", b.len(), weight.rows())?;
        }
        let (had_in, had_out) = trellis_hadamards(&weight)?;
        let su = weight.su().iter().map(|s| s.to_f32()).collect();
        let s = weight.scheme();
        let fast = if kernel_supported() {
            Tables::new(s.code, usize::from(s.k), s.order, weight.tlut())
        } else {
            None
        };
        Ok(Self {
            fast,
            decoder: Decoder::new(&weight),
            weight,
            had_in,
            had_out,
            su,
            bias,
        })
    }

    pub fn weight(&self) -> &TrellisQuantized {
        &self.weight
    }

    /// `H_in · (su ⊙ x)` for `m` rows of `x`.
    fn transform_input(&self, x: &[f32], m: usize) -> Result<Vec<f32>> {
        let mut x2: Vec<f32> = x
            .chunks_exact(self.su.len())
            .flat_map(|r| r.iter().zip(&self.su).map(|(a, s)| a * s))
            .collect();
        self.had_in
            .apply_rows(&mut x2, m)
            .map_err(|e| shape_err("TrellisLinear::forward", e.to_string()))?;
        Ok(x2)
    }

    /// `y ← sv ⊙ H_outᵀ · y` for `m` rows of `y`.
    fn transform_output(&self, y: &mut [f32], m: usize) -> Result<()> {
        self.had_out
            .apply_rows_transpose(y, m)
            .map_err(|e| shape_err("TrellisLinear::forward", e.to_string()))?;
        for row in y.chunks_exact_mut(self.weight.rows()) {
            for (v, s) in row.iter_mut().zip(self.weight.sv()) {
                *v *= s;
            }
        }
        Ok(())
    }

    /// `y = Ŵ·x` in the rotated domain for one token (no transforms, no bias).
    pub fn matvec_rotated(&self, level: SimdLevel, x: &[f32], y: &mut [f32]) {
        let fast = if level == SimdLevel::Avx512 {
            self.fast.as_ref()
        } else {
            None
        };
        self.matvec_with(fast, x, y)
    }

    /// Whether decode runs the AVX-512 kernel (else the portable decoder).
    pub fn has_fast_kernel(&self) -> bool {
        self.fast.is_some()
    }

    fn matvec_with(&self, fast: Option<&Tables>, x: &[f32], y: &mut [f32]) {
        let w = &self.weight;
        let tc_n = w.cols() / TILE_SIDE;
        let tb = w.scheme().tile_bytes();
        let row_block = |tr: usize, yb: &mut [f32]| {
            #[cfg(target_arch = "x86_64")]
            if let Some(t) = fast {
                let base = tr * tc_n * tb;
                // SAFETY: `fast` is only Some when `kernel_supported()` held at construction;
                // the slices have the lengths `tile_row` requires (whole tile row, 16 outputs).
                unsafe { tile_row(t, &w.tiles()[base..base + tc_n * tb], x, yb) };
                return;
            }
            let _ = fast;
            let mut acc = [0.0f32; TILE_SIDE];
            let mut tile = [0.0f32; TILE_WEIGHTS];
            let base = tr * tc_n * tb;
            for tc in 0..tc_n {
                self.decoder
                    .decode_tile(&w.tiles()[base + tc * tb..base + (tc + 1) * tb], &mut tile);
                let xs = &x[tc * TILE_SIDE..(tc + 1) * TILE_SIDE];
                for (a, row) in acc.iter_mut().zip(tile.chunks_exact(TILE_SIDE)) {
                    *a += row.iter().zip(xs).map(|(p, q)| p * q).sum::<f32>();
                }
            }
            yb.copy_from_slice(&acc);
        };
        let pool = crate::backend::cpu::spin_pool::pool();
        let threads = pool.threads();
        if w.tiles().len() < MIN_PARALLEL_BYTES || threads == 1 {
            for (tr, yb) in y.chunks_exact_mut(TILE_SIDE).enumerate() {
                row_block(tr, yb);
            }
        } else {
            // A few tasks per thread (not one per tile row): a task costs ~1 µs to hand out,
            // about the time one 16×576 tile row takes to decode.
            let per_task = (w.rows() / TILE_SIDE).div_ceil(2 * threads).max(1);
            pool.for_each_chunk_mut(y, per_task * TILE_SIDE, |b, yb| {
                for (i, yr) in yb.chunks_exact_mut(TILE_SIDE).enumerate() {
                    row_block(b * per_task + i, yr);
                }
            });
        }
    }

    /// One tile, tile row-major: the AVX-512 decoder when available (then placed by the tile
    /// order), else the portable one.
    fn decode_tile_any(&self, stream: &[u8], out: &mut [f32; TILE_WEIGHTS]) {
        #[cfg(target_arch = "x86_64")]
        if let Some(t) = &self.fast {
            let mut seq = [0.0f32; TILE_WEIGHTS];
            // SAFETY: `fast` exists only when `kernel_supported()` held; `stream` is one tile.
            unsafe { decode_tile_seq(t, stream, &mut seq) };
            self.decoder.place(&seq, out);
            return;
        }
        self.decoder.decode_tile(stream, out);
    }

    /// Rows `r0..r0 + panel.len()/cols` of Ŵ (rotated domain); `r0` and the row count are
    /// multiples of 16 (the panel GEMM sizes panels so).
    fn fill_rows(&self, r0: usize, panel: &mut [f32]) {
        let w = &self.weight;
        let cols = w.cols();
        let tc_n = cols / TILE_SIDE;
        let tb = w.scheme().tile_bytes();
        let mut tile = [0.0f32; TILE_WEIGHTS];
        for (i, band) in panel.chunks_exact_mut(TILE_SIDE * cols).enumerate() {
            let tr = r0 / TILE_SIDE + i;
            for tc in 0..tc_n {
                let t = (tr * tc_n + tc) * tb;
                self.decode_tile_any(&w.tiles()[t..t + tb], &mut tile);
                for (r, row) in tile.chunks_exact(TILE_SIDE).enumerate() {
                    band[r * cols + tc * TILE_SIDE..r * cols + (tc + 1) * TILE_SIDE]
                        .copy_from_slice(row);
                }
            }
        }
    }
}

/// A trellis weight from its streams and signs, with the tables every file of ours carries:
/// the code's lookup table and our Hadamard factors of both sizes (none under a block
/// rotation; synthetic models and tests build weights so; the message names what did not
/// fit).
pub fn with_our_tables(
    scheme: TrellisScheme,
    rows: usize,
    cols: usize,
    tiles: Vec<u8>,
    su: Vec<half::f16>,
    sv: Vec<f32>,
) -> std::result::Result<TrellisQuantized, String> {
    let factor = |n: usize| match scheme.rotation {
        sfx_formats::resident::Rotation::Full => stored_factor(n),
        _ => Ok(sfx_formats::resident::SmallHadamard::unit()),
    };
    TrellisQuantized::from_parts(TrellisParts {
        scheme,
        rows,
        cols,
        tiles,
        su,
        sv,
        tlut: code_table(scheme.code),
        had_in: factor(cols)?,
        had_out: factor(rows)?,
    })
    .map_err(|e| e.to_string())
}

/// Ŵ in the rotated domain (decoded tiles only), row-major `[rows, cols]`.
pub fn decode_rotated(w: &TrellisQuantized) -> Vec<f32> {
    let dec = Decoder::new(w);
    let cols = w.cols();
    let mut out = vec![0.0f32; w.rows() * cols];
    let mut tile = [0.0f32; TILE_WEIGHTS];
    for tr in 0..w.rows() / TILE_SIDE {
        for tc in 0..cols / TILE_SIDE {
            dec.decode_tile(w.tile(tr, tc), &mut tile);
            for (r, row) in tile.chunks_exact(TILE_SIDE).enumerate() {
                let o = (tr * TILE_SIDE + r) * cols + tc * TILE_SIDE;
                out[o..o + TILE_SIDE].copy_from_slice(row);
            }
        }
    }
    out
}

/// The full dequantized weight `W ≈ diag(sv) · H_outᵀ · Ŵ · H_in · diag(su)`, row-major
/// (refinement fitting needs `R = W − Ŵ` in the original domain).
pub fn dequantize_trellis(w: &TrellisQuantized) -> Result<Vec<f32>> {
    let (had_in, had_out) = trellis_hadamards(w)?;
    let (rows, cols) = (w.rows(), w.cols());
    let mut m = decode_rotated(w);
    let err = |e: crate::resident::hadamard::HadamardError| {
        shape_err("dequantize_trellis", e.to_string())
    };
    // Ŵ·H_in: each row r ← H_inᵀ r.
    had_in.apply_rows_transpose(&mut m, rows).map_err(err)?;
    // H_outᵀ·(…): each column c ← H_outᵀ c.
    let mut t = transpose(&m, rows, cols);
    had_out.apply_rows_transpose(&mut t, cols).map_err(err)?;
    let mut out = transpose(&t, cols, rows);
    for (r, row) in out.chunks_exact_mut(cols).enumerate() {
        let s = w.sv()[r];
        for (v, u) in row.iter_mut().zip(w.su()) {
            *v *= s * u.to_f32();
        }
    }
    Ok(out)
}

/// Row-major `[rows, cols]` → `[cols, rows]`.
pub fn transpose(a: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0f32; a.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = a[r * cols + c];
        }
    }
    t
}

impl Linear<CpuBackend> for TrellisLinear {
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
        let (rows, cols) = (self.weight.rows(), self.weight.cols());
        check_len("TrellisLinear::forward", "input", x.len(), m * cols)?;
        check_len("TrellisLinear::forward", "output", y.len(), m * rows)?;
        if m == 0 {
            return Ok(());
        }
        let x2 = self.transform_input(x.as_slice(), m)?;
        let y = y.as_mut_slice();
        if m <= MATVEC_MAX_ROWS {
            for (xr, yr) in x2.chunks_exact(cols).zip(y.chunks_exact_mut(rows)) {
                self.matvec_rotated(backend.simd(), xr, yr);
            }
        } else {
            matmul_t_panels(&x2, m, rows, y, |r0, panel| self.fill_rows(r0, panel));
        }
        self.transform_output(y, m)?;
        add_bias(y, rows, self.bias.as_deref());
        Ok(())
    }
    fn resident_bytes(&self) -> usize {
        self.weight.size_in_bytes() + self.bias.as_ref().map_or(0, |b| 4 * b.len())
    }
    fn describe(&self) -> String {
        format!(
            "{} {}×{} ({:.3} bits/weight){}",
            self.weight.scheme().name(),
            self.weight.cols(),
            self.weight.rows(),
            self.weight.bits_per_weight(),
            if self.bias.is_some() { " +bias" } else { "" }
        )
    }
}

/// Random trellis weights for tests of this module and of the CUDA layout (any bytes are a
/// valid tail-biting stream).
#[cfg(test)]
pub(crate) mod test_weights {
    use super::with_our_tables;
    use half::f16;
    use sfx_formats::resident::{TileOrder, TrellisCode, TrellisQuantized, TrellisScheme};

    pub(crate) fn bytes(n: usize, seed: &mut u64) -> Vec<u8> {
        (0..n)
            .map(|_| {
                *seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (*seed >> 56) as u8
            })
            .collect()
    }

    /// A `rows × cols` weight with random tiles, signs and scales.
    pub(crate) fn weight(
        code: TrellisCode,
        k: u8,
        order: TileOrder,
        rows: usize,
        cols: usize,
    ) -> TrellisQuantized {
        let mut seed = 11 + u64::from(k);
        let scheme = TrellisScheme {
            code,
            l: 16,
            k,
            order,
            rotation: sfx_formats::resident::Rotation::Full,
        };
        let tiles = bytes(
            TrellisQuantized::tile_stream_len(&scheme, rows, cols).unwrap(),
            &mut seed,
        );
        let signs = bytes(rows + cols, &mut seed);
        let su = signs[..cols]
            .iter()
            .map(|&b| f16::from_f32(if b & 1 == 0 { 1.0 } else { -1.0 }))
            .collect();
        let sv = signs[cols..]
            .iter()
            .map(|&b| (f32::from(b) - 128.0) / 300.0)
            .collect();
        with_our_tables(scheme, rows, cols, tiles, su, sv).unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::test_weights::{bytes, weight};
    use super::*;
    use crate::backend::Backend;
    use crate::resident::trellis::{decode_tile as reference_decode, Code, TrellisSpec};

    fn runtime_code(w: &TrellisQuantized) -> Code {
        match w.scheme().code {
            TrellisCode::Hyb { q } => Code::Hyb {
                q: u32::from(q),
                tlut: w
                    .tlut()
                    .chunks_exact(2)
                    .map(|c| [c[0].to_f32(), c[1].to_f32()])
                    .collect(),
            },
            TrellisCode::OneMad => Code::OneMad,
            TrellisCode::ThreeInst => Code::ThreeInst,
        }
    }

    const CODES: [TrellisCode; 3] = [
        TrellisCode::Hyb { q: 9 },
        TrellisCode::OneMad,
        TrellisCode::ThreeInst,
    ];

    /// The kernel's tile decoder against the trellis module's bit-by-bit state reader and
    /// code functions, for every code, K and tile order.
    #[test]
    fn tile_decoder_matches_the_reference_decoder() {
        for code in CODES {
            for k in 1..=4u8 {
                if usize::from(k) * code.values_per_step() >= 16 {
                    continue;
                }
                for order in [TileOrder::RowMajor, TileOrder::Mma] {
                    let w = weight(code, k, order, 32, 48);
                    let dec = Decoder::new(&w);
                    let rc = runtime_code(&w);
                    let spec =
                        TrellisSpec::qtip(u32::from(k), code.values_per_step() as u32).unwrap();
                    for tr in 0..2 {
                        for tc in 0..3 {
                            let mut got = [0.0f32; TILE_WEIGHTS];
                            dec.decode_tile(w.tile(tr, tc), &mut got);
                            let mut seq = vec![0.0f32; TILE_WEIGHTS];
                            reference_decode(w.tile(tr, tc), &spec, &rc, &mut seq).unwrap();
                            for (p, &v) in seq.iter().enumerate() {
                                let (r, c) = order.position(p);
                                assert_eq!(got[r * 16 + c], v, "{code:?} K{k} {order:?} p{p}");
                            }
                        }
                    }
                }
            }
        }
    }

    /// The AVX-512 kernel against the portable decoder, for every code, K and tile order it
    /// covers (skipped, with a message, on CPUs without AVX-512 VBMI/VNNI).
    #[test]
    fn fast_kernel_matches_portable_decoder() {
        if !kernel_supported() {
            eprintln!("no AVX-512 VBMI/VNNI: fast trellis kernel not tested on this CPU");
            return;
        }
        let mut covered = 0;
        for code in CODES {
            for k in 1..=4u8 {
                for order in [TileOrder::RowMajor, TileOrder::Mma] {
                    let w = weight(code, k, order, 48, 64);
                    let lin = TrellisLinear::new(w, None).unwrap();
                    let Some(fast) = lin.fast.as_ref() else {
                        assert!(order == TileOrder::Mma && code.values_per_step() == 1);
                        continue;
                    };
                    covered += 1;
                    let mut seed = 5;
                    let x: Vec<f32> = bytes(64, &mut seed)
                        .iter()
                        .map(|&b| (f32::from(b) - 127.5) / 64.0)
                        .collect();
                    let (mut a, mut b) = (vec![0.0f32; 48], vec![0.0f32; 48]);
                    lin.matvec_with(Some(fast), &x, &mut a);
                    lin.matvec_with(None, &x, &mut b);
                    // The fast tile decoder of the prefill panels against the portable one.
                    for (i, stream) in lin
                        .weight
                        .tiles()
                        .chunks_exact(lin.weight.scheme().tile_bytes())
                        .enumerate()
                    {
                        let (mut p, mut q) = ([0.0f32; TILE_WEIGHTS], [0.0f32; TILE_WEIGHTS]);
                        lin.decode_tile_any(stream, &mut p);
                        lin.decoder.decode_tile(stream, &mut q);
                        // 1MAD's affine map is one FMA in the kernel, a divide in the reference.
                        for (u, v) in p.iter().zip(&q) {
                            assert!(
                                (u - v).abs() <= 1e-6 * (1.0 + v.abs()),
                                "{code:?} K{k} {order:?} tile {i}: {u} vs {v}"
                            );
                        }
                    }
                    for (r, (p, q)) in a.iter().zip(&b).enumerate() {
                        assert!(
                            (p - q).abs() < 1e-4 * (1.0 + q.abs()),
                            "{code:?} K{k} {order:?} row {r}: {p} vs {q}"
                        );
                    }
                }
            }
        }
        assert_eq!(covered, 3 * 4 + 4);
    }

    /// Decode matvec and prefill GEMM against the dequantized matrix times x (f64).
    #[test]
    fn forward_matches_dequantized_matmul() {
        let backend = CpuBackend::new();
        for (code, k, rows, cols) in [
            (TrellisCode::Hyb { q: 9 }, 2, 192, 576),
            (TrellisCode::Hyb { q: 9 }, 3, 64, 48),
            (TrellisCode::OneMad, 2, 48, 64),
            (TrellisCode::ThreeInst, 4, 32, 96),
        ] {
            let w = weight(code, k, TileOrder::RowMajor, rows, cols);
            let deq = dequantize_trellis(&w).unwrap();
            let bias: Vec<f32> = (0..rows).map(|i| i as f32 * 0.01).collect();
            let lin = TrellisLinear::new(w, Some(bias.clone())).unwrap();
            for m in [1usize, 2, 5] {
                let mut seed = 99;
                let x: Vec<f32> = bytes(m * cols, &mut seed)
                    .iter()
                    .map(|&b| (f32::from(b) - 127.5) / 64.0)
                    .collect();
                let xb = backend.upload(&x).unwrap();
                let mut yb = backend.upload(&vec![0.0; m * rows]).unwrap();
                lin.forward(&backend, &xb, m, &mut yb).unwrap();
                let y = yb.as_slice();
                for t in 0..m {
                    for r in 0..rows {
                        let want: f64 = (0..cols)
                            .map(|c| f64::from(deq[r * cols + c]) * f64::from(x[t * cols + c]))
                            .sum::<f64>()
                            + f64::from(bias[r]);
                        let got = f64::from(y[t * rows + r]);
                        assert!(
                            (got - want).abs() < 1e-3 * (1.0 + want.abs()),
                            "{code:?} m{m} r{r}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

//! QTIP (Tseng et al. 2024): random Hadamard incoherence processing, then LDLQ rounding with
//! the layer-input Hessian `H = E[x xᵀ]`, each 16-column block of 16×16 tiles quantized by a
//! tail-biting bitshift-trellis Viterbi. Written from the paper's formulas and the LDLQ
//! derivation below; QTIP's GPL code is not used.
//!
//! Incoherence: `W̃ = H_out · diag(σ_out) · W · diag(σ_in) · H_inᵀ` with random signs σ and the
//! orthonormal Hadamard transforms of `sfx_runtime::resident::hadamard`; the Hessian moves to
//! `H̃ = H_in · diag(σ_in) · H · diag(σ_in) · H_inᵀ`, and `tr(E H Eᵀ)` is unchanged (up to the
//! scale²) in the rotated domain. The rotated weight is divided by
//! `scale = RMS(W̃) / (RMS(code) · 0.9)` (QTIP's `Wscale` with its `scale_override` 0.9) and
//! `sv = σ_out · scale` is stored, as QTIP folds `Wscale` into `SV`.
//!
//! LDLQ with 16-column blocks: write `H̃ = U D Uᵀ` with `U` unit upper block-triangular and `D`
//! block-diagonal. Quantizing block `j` to the target `W_j + Σ_{i<j} E_i U_ij` (E = W − Ŵ of
//! the blocks already done) makes the error `E = η U⁻¹` for the per-block rounding errors `η`,
//! so `tr(E H̃ Eᵀ) = Σ_j tr(η_j D_j η_jᵀ)`: each block's rounding error is weighted by its own
//! conditional block only (QuIP's LDLQ, blocked as QTIP does). `U` comes from the Cholesky
//! factor of the index-reversed `H̃`.

use super::{
    InputStats, QuantError, QuantizedSet, ResidentQuantizer, ResidentWeight, SetContext, WeightView,
};
use faer::{Accum, Mat, MatMut, MatRef, Par, Side};
use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;
use sfx_formats::resident::{
    Rotation, SmallHadamard, TrellisCode, TrellisParts, TrellisQuantized, TrellisScheme, TILE_SIDE,
    TILE_WEIGHTS,
};
use sfx_runtime::resident::hadamard::Hadamard;
use sfx_runtime::resident::trellis::{
    hyb_gaussian_tlut, Code, TailBiting, TrellisQuantizer, TrellisSpec,
};
use sfx_runtime::resident::trellis_linear::{decode_rotated, transpose};
use std::collections::BTreeMap;

/// QTIP's trellis quantizer at `bits` bits per weight.
#[derive(Debug, Clone)]
pub struct Qtip {
    pub bits: u8,
    pub code: TrellisCode,
    /// Relative damping added to the Hessian diagonal (QuIP/QTIP: 0.01 × mean diagonal).
    pub damp: f64,
    /// QTIP's `scale_override`.
    pub scale_override: f64,
    pub tail_biting: TailBiting,
    /// Seed of the sign vectors (mixed with the tensor name, so every projection differs).
    pub seed: u64,
    /// The Hadamard rotation's span: the whole dimension, or blocks a GPU block transforms
    /// on its own.
    pub rotation: Rotation,
}

impl Qtip {
    pub fn new(bits: u8) -> Self {
        Self {
            bits,
            code: TrellisCode::Hyb { q: 9 },
            damp: 0.01,
            scale_override: 0.9,
            tail_biting: TailBiting::TwoPass,
            seed: 0x5154_4950, // "QTIP"
            rotation: Rotation::Full,
        }
    }
}

fn err(name: &str, msg: impl std::fmt::Display) -> QuantError {
    QuantError::Layout {
        name: name.to_string(),
        source: sfx_formats::resident::ResidentError::Invalid(msg.to_string()),
    }
}

/// The code as the runtime's trellis module evaluates it, with its table (HYB) as stored
/// (f16), so the Viterbi search scores exactly the values the kernels will decode.
pub(crate) struct CodeBook {
    pub code: Code,
    pub tlut: Vec<f16>,
    pub rms: f64,
}

impl CodeBook {
    pub fn new(code: TrellisCode) -> Self {
        let (code, tlut) = match code {
            TrellisCode::Hyb { q } => {
                let t: Vec<f16> = hyb_gaussian_tlut(u32::from(q))
                    .iter()
                    .flat_map(|p| [f16::from_f32(p[0]), f16::from_f32(p[1])])
                    .collect();
                let rows = t.chunks_exact(2).map(|c| [c[0].to_f32(), c[1].to_f32()]);
                (
                    Code::Hyb {
                        q: u32::from(q),
                        tlut: rows.collect(),
                    },
                    t,
                )
            }
            TrellisCode::OneMad => (Code::OneMad, Vec::new()),
            TrellisCode::ThreeInst => (Code::ThreeInst, Vec::new()),
        };
        // RMS over all 2^16 states = over the values the trellis can emit, uniformly weighted.
        let v = code.values_per_step();
        let mut out = vec![0.0f32; v];
        let mut sum = 0.0f64;
        for x in 0..1u32 << 16 {
            code.decode(x, &mut out);
            sum += out.iter().map(|&a| f64::from(a).powi(2)).sum::<f64>();
        }
        let rms = (sum / f64::from(1u32 << 16) / v as f64).sqrt();
        Self { code, tlut, rms }
    }
}

/// FNV-1a of the tensor name: a stable per-projection seed component.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn signs(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| if rng.random::<bool>() { 1.0 } else { -1.0 })
        .collect()
}

/// `H · diag(σ) · A · diag(σ) · Hᵀ` for a symmetric `n × n` matrix `A` (row-major).
pub(crate) fn rotate_symmetric(
    a: &[f32],
    n: usize,
    sigma: &[f32],
    had: &Hadamard,
) -> Result<Vec<f32>, String> {
    let mut m: Vec<f32> = (0..n * n)
        .map(|t| a[t] * sigma[t / n] * sigma[t % n])
        .collect();
    // Rows: A·Hᵀ (each row r ← H r); then columns: H·(…) (each column ← H column), which
    // for the symmetric intermediate is rows of the transpose.
    had.apply_rows(&mut m, n).map_err(|e| e.to_string())?;
    let mut t = transpose(&m, n, n);
    had.apply_rows(&mut t, n).map_err(|e| e.to_string())?;
    // Symmetrise against round-off so the Cholesky sees an exactly symmetric matrix.
    Ok((0..n * n)
        .map(|i| 0.5 * (t[i] + t[(i % n) * n + i / n]))
        .collect())
}

/// `U` (unit upper block-triangular, blocks of `b`) with `H = U D Uᵀ`, from the Cholesky
/// factor of the index-reversed `H + δ·mean(diag)·I`; the damping is doubled until the
/// factorisation succeeds. Returns U row-major and the damping used.
pub(crate) fn block_udu(
    h: &[f32],
    n: usize,
    b: usize,
    damp: f64,
) -> Result<(Vec<f64>, f64), String> {
    let mean_diag = super::mean_diagonal(h, n);
    let mean_diag = if mean_diag > 0.0 { mean_diag } else { 1.0 };
    let mut delta = damp;
    for _ in 0..20 {
        let add = delta * mean_diag;
        // Reversed: A[i][j] = H[n−1−i][n−1−j].
        let a = Mat::<f64>::from_fn(n, n, |i, j| {
            let v = f64::from(h[(n - 1 - i) * n + (n - 1 - j)]);
            if i == j {
                v + add
            } else {
                v
            }
        });
        if let Ok(llt) = a.llt(Side::Lower) {
            let l = llt.L();
            // Block LDL of A: L_A = R · blockdiag(R_jj)⁻¹. A's blocks are H's blocks reversed,
            // so block boundaries must be reversed too: n is a multiple of b.
            let mut la = vec![0.0f64; n * n];
            for jb in (0..n).step_by(b) {
                // Invert the lower-triangular diagonal block R_jj by forward substitution.
                let mut inv = vec![0.0f64; b * b];
                for c in 0..b {
                    for r in 0..b {
                        let mut s = if r == c { 1.0 } else { 0.0 };
                        for k in 0..r {
                            s -= l[(jb + r, jb + k)] * inv[k * b + c];
                        }
                        inv[r * b + c] = s / l[(jb + r, jb + r)];
                    }
                }
                for i in jb..n {
                    for c in 0..b {
                        let mut s = 0.0;
                        // Only the lower triangle of the factor is defined.
                        for k in 0..b.min(i + 1 - jb) {
                            s += l[(i, jb + k)] * inv[k * b + c];
                        }
                        la[i * n + jb + c] = s;
                    }
                }
            }
            // U = P·L_A·P.
            let u = (0..n * n)
                .map(|t| la[(n - 1 - t / n) * n + (n - 1 - t % n)])
                .collect();
            return Ok((u, delta));
        }
        delta *= 2.0;
    }
    Err("Hessian is not positive definite even with damping 10^4·mean(diag)".into())
}

/// A projection after incoherence processing: its sign vectors, the rotated weight divided by
/// `scale`, and `scale`.
pub(crate) struct Rotated {
    pub su: Vec<f32>,
    pub sv: Vec<f32>,
    pub wt: Vec<f32>,
    pub scale: f64,
}

/// A rounded tile: its stream and decoded values (sequence order).
pub(crate) type TileResult = Result<(Vec<u8>, Vec<f32>), QuantError>;

/// One projection's trellis quantization, for the converter's report.
pub(crate) struct Rounded {
    pub weight: TrellisQuantized,
    /// `tr(E H̃ Eᵀ) / tr(W̃ H̃ W̃ᵀ)` in the rotated, scaled domain (QTIP's proxy error).
    pub proxy: f64,
}

impl Qtip {
    fn scheme(&self) -> TrellisScheme {
        TrellisScheme {
            rotation: self.rotation,
            ..TrellisScheme::qtip(self.code, self.bits)
        }
    }

    /// `-b128` after a quantizer's name under a block rotation, nothing for the full one.
    pub(crate) fn rotation_suffix(&self) -> String {
        match self.rotation {
            Rotation::Full => String::new(),
            r => format!("-{}", r.name()),
        }
    }

    /// The rotation of a dimension of `n` values.
    pub(crate) fn hadamard(&self, n: usize, name: &str) -> Result<Hadamard, QuantError> {
        match self.rotation {
            Rotation::Full => Hadamard::new(n),
            r => Hadamard::blocks(n, r.block_len(n)),
        }
        .map_err(|e| err(name, e))
    }

    /// Signs, rotation and scale of one projection: returns (σ_in, σ_out, W̃ / scale, scale).
    pub(crate) fn rotate_weight(
        &self,
        w: &WeightView<'_>,
        had_in: &Hadamard,
        had_out: &Hadamard,
        book: &CodeBook,
    ) -> Result<Rotated, QuantError> {
        let (rows, cols) = (w.rows, w.cols);
        let mut rng = StdRng::seed_from_u64(self.seed ^ name_hash(w.name));
        let su = signs(&mut rng, cols);
        let sv = signs(&mut rng, rows);
        let mut m: Vec<f32> = w
            .data
            .chunks_exact(cols)
            .zip(&sv)
            .flat_map(|(row, s)| row.iter().zip(&su).map(move |(a, u)| a * u * s))
            .collect();
        had_in
            .apply_rows(&mut m, rows)
            .map_err(|e| err(w.name, e))?;
        let mut t = transpose(&m, rows, cols);
        had_out
            .apply_rows(&mut t, cols)
            .map_err(|e| err(w.name, e))?;
        let mut wt = transpose(&t, cols, rows);
        let rms = (wt.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / wt.len() as f64).sqrt();
        let scale = if rms > 0.0 {
            rms / (book.rms * self.scale_override)
        } else {
            1.0
        };
        // f32 scale stored in sv: quantize against exactly the value the kernel multiplies by.
        let scale = f64::from(scale as f32);
        for v in &mut wt {
            *v = (f64::from(*v) / scale) as f32;
        }
        Ok(Rotated { su, sv, wt, scale })
    }

    /// LDLQ over 16-column blocks with a trellis per 16×16 tile. `wt` is the rotated, scaled
    /// weight and `u` the block-UDUᵀ factor of the rotated Hessian. Returns the tile streams.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn ldlq(
        &self,
        name: &str,
        wt: &[f32],
        rows: usize,
        cols: usize,
        u: &[f64],
        tq: &TrellisQuantizer,
        book: &CodeBook,
    ) -> Result<Vec<u8>, QuantError> {
        let tb = self.scheme().tile_bytes();
        let (tr_n, tc_n) = (rows / TILE_SIDE, cols / TILE_SIDE);
        let mut tiles = vec![0u8; tr_n * tc_n * tb];
        // E = W̃ − Ŵ of the blocks done so far (row-major; columns ≥ c0 still zero).
        let mut err_m = vec![0.0f32; rows * cols];
        let u32m: Vec<f32> = u.iter().map(|&v| v as f32).collect();
        let spec = *tq.spec();
        for jb in 0..tc_n {
            let c0 = jb * TILE_SIDE;
            // target = W̃[:, blk] + E[:, :c0] · U[:c0, blk].
            let mut target = vec![0.0f32; rows * TILE_SIDE];
            for (r, t) in target.chunks_exact_mut(TILE_SIDE).enumerate() {
                t.copy_from_slice(&wt[r * cols + c0..r * cols + c0 + TILE_SIDE]);
            }
            if c0 > 0 {
                let e = MatRef::from_row_major_slice(&err_m, rows, cols).subcols(0, c0);
                let ub =
                    MatRef::from_row_major_slice(&u32m, cols, cols).submatrix(0, c0, c0, TILE_SIDE);
                let tm = MatMut::from_row_major_slice_mut(&mut target, rows, TILE_SIDE);
                faer::linalg::matmul::matmul(tm, Accum::Add, e, ub, 1.0f32, Par::rayon(0));
            }
            let results: Vec<TileResult> = (0..tr_n)
                .into_par_iter()
                .map(|tr| {
                    let tile = &target[tr * TILE_WEIGHTS..(tr + 1) * TILE_WEIGHTS];
                    let q = tq
                        .quantize_with(tile, self.tail_biting)
                        .map_err(|e| err(name, e))?;
                    let mut dec = vec![0.0f32; TILE_WEIGHTS];
                    sfx_runtime::resident::trellis::decode_tile(
                        &q.stream, &spec, &book.code, &mut dec,
                    )
                    .map_err(|e| err(name, e))?;
                    Ok((q.stream, dec))
                })
                .collect();
            for (tr, res) in results.into_iter().enumerate() {
                let (stream, dec) = res?;
                let t = (tr * tc_n + jb) * tb;
                tiles[t..t + tb].copy_from_slice(&stream);
                for r in 0..TILE_SIDE {
                    let row = tr * TILE_SIDE + r;
                    for c in 0..TILE_SIDE {
                        err_m[row * cols + c0 + c] =
                            wt[row * cols + c0 + c] - dec[r * TILE_SIDE + c];
                    }
                }
            }
        }
        Ok(tiles)
    }

    /// Rotates, LDLQ-rounds and packs one projection given its input Hessian `E[x xᵀ]`.
    pub(crate) fn quantize_one(
        &self,
        w: &WeightView<'_>,
        gram: &[f32],
        book: &CodeBook,
        tq: &TrellisQuantizer,
    ) -> Result<Rounded, QuantError> {
        let (rows, cols) = (w.rows, w.cols);
        if rows % TILE_SIDE != 0 || cols % TILE_SIDE != 0 {
            return Err(err(
                w.name,
                format!("[{rows}, {cols}] is not a multiple of the 16×16 trellis tile"),
            ));
        }
        if gram.len() != cols * cols {
            return Err(err(
                w.name,
                format!("Hessian of {} values, expected {cols}²", gram.len()),
            ));
        }
        let had_in = self.hadamard(cols, w.name)?;
        let had_out = self.hadamard(rows, w.name)?;
        let Rotated { su, sv, wt, scale } = self.rotate_weight(w, &had_in, &had_out, book)?;
        let h = rotate_symmetric(gram, cols, &su, &had_in).map_err(|e| err(w.name, e))?;
        let (u, _delta) = block_udu(&h, cols, TILE_SIDE, self.damp).map_err(|e| err(w.name, e))?;
        let tiles = self.ldlq(w.name, &wt, rows, cols, &u, tq, book)?;
        let weight = self.pack(
            w.name, rows, cols, tiles, &su, &sv, scale, book, &had_in, &had_out,
        )?;
        let proxy = proxy_error(&weight, &wt, &h, rows, cols);
        Ok(Rounded { weight, proxy })
    }
}

impl Qtip {
    /// The stored weight: tiles, f16 input signs, output signs × scale, the code's table and
    /// the Hadamard factors.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn pack(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        tiles: Vec<u8>,
        su: &[f32],
        sv: &[f32],
        scale: f64,
        book: &CodeBook,
        had_in: &Hadamard,
        had_out: &Hadamard,
    ) -> Result<TrellisQuantized, QuantError> {
        TrellisQuantized::from_parts(TrellisParts {
            scheme: self.scheme(),
            rows,
            cols,
            tiles,
            su: su.iter().map(|&s| f16::from_f32(s)).collect(),
            sv: sv.iter().map(|&s| (f64::from(s) * scale) as f32).collect(),
            tlut: book.tlut.clone(),
            had_in: small(had_in, name)?,
            had_out: small(had_out, name)?,
        })
        .map_err(|source| QuantError::Layout {
            name: name.to_string(),
            source,
        })
    }
}

pub(crate) fn small(h: &Hadamard, name: &str) -> Result<SmallHadamard, QuantError> {
    SmallHadamard::new(h.small_order(), h.small_factor()).map_err(|source| QuantError::Layout {
        name: name.to_string(),
        source,
    })
}

/// `tr(E H Eᵀ) / tr(W H Wᵀ)` with `E = W − Ŵ` in the rotated, scaled domain.
pub(crate) fn proxy_error(
    w: &TrellisQuantized,
    wt: &[f32],
    h: &[f32],
    rows: usize,
    cols: usize,
) -> f64 {
    let dec = decode_rotated(w);
    let e: Vec<f32> = wt.iter().zip(&dec).map(|(a, b)| a - b).collect();
    let quad = |m: &[f32]| -> f64 {
        let mut mh = vec![0.0f32; rows * cols];
        faer::linalg::matmul::matmul(
            MatMut::from_row_major_slice_mut(&mut mh, rows, cols),
            Accum::Replace,
            MatRef::from_row_major_slice(m, rows, cols),
            MatRef::from_row_major_slice(h, cols, cols),
            1.0f32,
            Par::rayon(0),
        );
        mh.iter()
            .zip(m)
            .map(|(&a, &b)| f64::from(a) * f64::from(b))
            .sum()
    };
    let den = quad(wt);
    if den > 0.0 {
        quad(&e) / den
    } else {
        0.0
    }
}

impl ResidentQuantizer for Qtip {
    fn name(&self) -> String {
        format!(
            "qtip{}-{}{}",
            self.bits,
            self.code.name(),
            self.rotation_suffix()
        )
    }

    fn needs_calibration(&self) -> bool {
        true
    }

    fn quantize_set(
        &self,
        weights: &[WeightView<'_>],
        stats: Option<&InputStats>,
        _context: SetContext,
    ) -> Result<QuantizedSet, QuantError> {
        let first = weights.first().map_or("(empty set)", |w| w.name);
        let stats = stats.ok_or_else(|| QuantError::MissingStats {
            name: first.to_string(),
            method: "qtip",
            what: "the input Hessian E[x xᵀ]",
        })?;
        let book = CodeBook::new(self.code);
        let spec = TrellisSpec::qtip(u32::from(self.bits), book.code.values_per_step() as u32)
            .map_err(|e| err(first, e))?;
        let tq = TrellisQuantizer::new(spec, &book.code).map_err(|e| err(first, e))?;
        let mut out = Vec::with_capacity(weights.len());
        let mut info = BTreeMap::new();
        for w in weights {
            let r = self.quantize_one(w, &stats.gram, &book, &tq)?;
            info.insert(format!("proxy_err.{}", short_name(w.name)), r.proxy);
            out.push(ResidentWeight::Trellis(r.weight));
        }
        Ok(QuantizedSet {
            weights: out,
            input_scales: None,
            info,
        })
    }
}

/// `model.layers.3.self_attn.q_proj` → `q_proj`.
pub(crate) fn short_name(name: &str) -> &str {
    let base = name.strip_suffix(".weight").unwrap_or(name);
    base.rsplit('.').next().unwrap_or(base)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }

    #[test]
    fn block_udu_reconstructs_the_hessian() {
        let n = 48;
        let mut s = 7u64;
        let x: Vec<f32> = (0..n * 3 * n).map(|_| lcg(&mut s)).collect();
        // H = XᵀX / rows (PD).
        let mut h = vec![0.0f32; n * n];
        for r in x.chunks_exact(n) {
            for i in 0..n {
                for j in 0..n {
                    h[i * n + j] += r[i] * r[j] / (3 * n) as f32;
                }
            }
        }
        let (u, delta) = block_udu(&h, n, 16, 0.0).unwrap();
        assert_eq!(delta, 0.0);
        // Unit diagonal blocks (identity), zero below the block diagonal.
        for i in 0..n {
            for j in 0..n {
                let v = u[i * n + j];
                if i / 16 == j / 16 {
                    let want = if i == j { 1.0 } else { 0.0 };
                    assert!((v - want).abs() < 1e-9, "U[{i}][{j}] = {v}");
                } else if i > j {
                    assert!(v.abs() < 1e-12, "U[{i}][{j}] = {v}");
                }
            }
        }
        // U⁻¹ H U⁻ᵀ must be block diagonal: check via D = U⁻¹ H U⁻ᵀ computed by solving.
        let um = Mat::<f64>::from_fn(n, n, |i, j| u[i * n + j]);
        let hm = Mat::<f64>::from_fn(n, n, |i, j| f64::from(h[i * n + j]));
        use faer::linalg::solvers::Solve;
        let lu = um.partial_piv_lu();
        // U⁻¹ H, then U⁻¹ (U⁻¹ H)ᵀ = U⁻¹ H U⁻ᵀ (H symmetric).
        let a = lu.solve(&hm);
        let d = lu.solve(a.transpose().to_owned());
        let mut off = 0.0f64;
        for i in 0..n {
            for j in 0..n {
                if i / 16 != j / 16 {
                    off = off.max(d[(i, j)].abs());
                }
            }
        }
        assert!(off < 1e-4, "off-block-diagonal mass {off}");
    }
}

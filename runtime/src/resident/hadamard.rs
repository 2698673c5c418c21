//! Normalised orthogonal Hadamard transforms for the hidden / intermediate sizes of the
//! Llama, Qwen and SmolLM families — the rotation used by QTIP-style incoherence processing
//! (docs/format.md, "Trellis-coded projections"). Built from the mathematics (Sylvester, Paley I/II,
//! Kronecker products over GF(p^k)); QTIP's own code and tables are GPL and are not used.
//!
//! An order `n` is split as `n = m · 2^k` with `m` the smallest factor that has a construction
//! here; the transform is `(H_m ⊗ H_{2^k}) / √n`, where `H_{2^k}` is the natural-order Sylvester
//! matrix (`H[i][j] = (−1)^popcount(i & j)`), applied as a fast Walsh–Hadamard transform, and
//! `H_m` is a dense ±1 matrix.
//!
//! Index convention: `x` (length `n`) is a row-major `[m, 2^k]` matrix `X` (`x[i·2^k + a] =
//! X[i][a]`) and the transform computes `Y = H_m · X · H_{2^k} / √n`. That is the same shape
//! convention as QTIP (reshape to `(K, n/K)`, FWHT on the last axis, left-multiply by `had_K`),
//! but our `H_m` are Paley matrices, not Sloane's tables, so a checkpoint quantized by QTIP must
//! be decoded with QTIP's own `had_K`, not with these.

use crate::backend::cpu::math::multiversioned;
use crate::backend::cpu::SimdLevel;
use rayon::prelude::*;
use std::cell::RefCell;
use std::fmt;
use thiserror::Error;

/// The dense factor of our transform of order `n` as a container stores it (what a converted
/// file or a synthetic trellis weight carries for `n`).
pub fn stored_factor(n: usize) -> Result<sfx_formats::resident::SmallHadamard, String> {
    let h = Hadamard::new(n).map_err(|e| format!("transform of order {n}: {e}"))?;
    sfx_formats::resident::SmallHadamard::new(h.small_order(), h.small_factor())
        .map_err(|e| e.to_string())
}

/// Largest dense factor built. The mixing pass costs `n·m` multiply-adds per vector and the
/// matrix `m²` floats, so past this the rotation stops being cheap next to the matvec it
/// protects; it also bounds the finite fields searched (q < 2048).
pub const MAX_SMALL_ORDER: usize = 2048;

/// `apply_rows` fans out over rayon only above this many floats: a fork/join costs a few µs,
/// more than transforming one or two short rows.
const PAR_MIN_ELEMS: usize = 1 << 15;

/// Why a Hadamard transform of the requested order cannot be built or applied.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HadamardError {
    #[error("no Hadamard transform of order 0")]
    Empty,
    #[error("no Hadamard matrix of order {n} exists: the order must be 1, 2 or a multiple of 4")]
    NotHadamardOrder { n: usize },
    #[error(
        "no Hadamard construction for order {n} (n = m·2^k with H_m from Sylvester, Paley I, \
         Paley II or Kronecker products of those); tried m = {tried}"
    )]
    NoConstruction { n: usize, tried: String },
    #[error(
        "no block rotation of {n} values in blocks of {b} (b must be a power of two dividing n)"
    )]
    BadBlock { n: usize, b: usize },
    #[error("vector of length {got} does not match Hadamard transform order {expected}")]
    LengthMismatch { expected: usize, got: usize },
    #[error("buffer of {got} floats is not {rows} rows of Hadamard order {n}")]
    RowsMismatch { n: usize, rows: usize, got: usize },
    #[error(
        "stored Hadamard factor of order {m} is unusable for order {n} (n/m must be a power of \
         two and the factor an m×m ±1 matrix with orthogonal rows)"
    )]
    BadFactor { n: usize, m: usize },
}

/// How a small Hadamard matrix is built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Construction {
    /// Natural-order Sylvester matrix of a power-of-two order.
    Sylvester { order: usize },
    /// Paley I over GF(q), q ≡ 3 (mod 4): order q + 1.
    PaleyI { q: usize },
    /// Paley II over GF(q), q ≡ 1 (mod 4): order 2(q + 1).
    PaleyII { q: usize },
    /// Kronecker product `A ⊗ B`.
    Kronecker(Box<Construction>, Box<Construction>),
    /// A factor read from a file (a converted or imported checkpoint).
    Stored { order: usize },
}

impl Construction {
    /// A construction of order `m` (≤ [`MAX_SMALL_ORDER`]), or `None` if none of ours applies.
    pub fn for_order(m: usize) -> Option<Construction> {
        plan(m)
    }

    pub fn order(&self) -> usize {
        match self {
            Self::Sylvester { order } => *order,
            Self::PaleyI { q } => q + 1,
            Self::PaleyII { q } => 2 * (q + 1),
            Self::Kronecker(a, b) => a.order() * b.order(),
            Self::Stored { order } => *order,
        }
    }
}

impl fmt::Display for Construction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Sylvester { order } => write!(f, "Sylvester({order})"),
            Self::PaleyI { q } => write!(f, "PaleyI(GF({q}))"),
            Self::PaleyII { q } => write!(f, "PaleyII(GF({q}))"),
            Self::Kronecker(a, b) => write!(f, "{a} ⊗ {b}"),
            Self::Stored { order } => write!(f, "stored({order})"),
        }
    }
}

/// The normalised transform `(H_m ⊗ H_{2^k}) / √n` of one order `n`, or the block-diagonal
/// `(I_{n/b} ⊗ H_b) / √b` of a block rotation.
#[derive(Debug, Clone)]
pub struct Hadamard {
    n: usize,
    m: usize,
    /// Length of the independently transformed blocks (`n` unless a block rotation).
    block: usize,
    /// `H_m / √n`, row-major. Folding the normalisation into the dense factor lets the mixing
    /// pass write final values, so no separate scaling sweep over `x` is needed.
    small_scaled: Vec<f32>,
    /// `H_mᵀ / √n`: a second copy keeps the transpose's coefficient reads contiguous.
    small_scaled_t: Vec<f32>,
    scale: f32,
    construction: Construction,
    simd: SimdLevel,
}

impl Hadamard {
    /// Builds the transform of order `n`, choosing the smallest `m` with `n / m` a power of two
    /// that has a construction (the dense pass costs `n·m`, so smaller is faster).
    pub fn new(n: usize) -> Result<Hadamard, HadamardError> {
        if n == 0 {
            return Err(HadamardError::Empty);
        }
        if n > 2 && !n.is_multiple_of(4) {
            return Err(HadamardError::NotHadamardOrder { n });
        }
        let odd = n >> n.trailing_zeros();
        let mut tried = Vec::new();
        for j in 0..=n.trailing_zeros() {
            let m = odd << j;
            if m > MAX_SMALL_ORDER {
                tried.push(format!("{m}.. (above the {MAX_SMALL_ORDER} limit)"));
                break;
            }
            if let Some(construction) = plan(m) {
                return Ok(Self::from_construction(n, construction));
            }
            tried.push(explain_failure(m));
        }
        Err(HadamardError::NoConstruction {
            n,
            tried: tried.join("; "),
        })
    }

    /// The transform of order `n` with a given dense ±1 factor of order `m` (row-major), as
    /// stored in a container: `n / m` must be a power of two and the factor a Hadamard matrix.
    pub fn with_factor(n: usize, m: usize, entries: &[i8]) -> Result<Hadamard, HadamardError> {
        if n == 0 {
            return Err(HadamardError::Empty);
        }
        let fits = m > 0 && n.is_multiple_of(m) && (n / m).is_power_of_two();
        let square = m.checked_mul(m) == Some(entries.len());
        let pm_one = entries.iter().all(|&e| e == 1 || e == -1);
        let orthogonal = square
            && pm_one
            && (0..m).all(|i| {
                (i + 1..m).all(|j| {
                    (0..m)
                        .map(|c| i32::from(entries[i * m + c]) * i32::from(entries[j * m + c]))
                        .sum::<i32>()
                        == 0
                })
            });
        if !(fits && orthogonal) {
            return Err(HadamardError::BadFactor { n, m });
        }
        Ok(Self::from_entries(
            n,
            Construction::Stored { order: m },
            entries.to_vec(),
        ))
    }

    /// The block-diagonal transform `(I_{n/b} ⊗ H_b) / √b`: a Walsh–Hadamard transform of
    /// each contiguous block of `b` values (`b` a power of two dividing `n`). Symmetric, so
    /// [`Hadamard::apply_transpose`] is the same map.
    pub fn blocks(n: usize, b: usize) -> Result<Hadamard, HadamardError> {
        if n == 0 {
            return Err(HadamardError::Empty);
        }
        if b == 0 || !b.is_power_of_two() || !n.is_multiple_of(b) {
            return Err(HadamardError::BadBlock { n, b });
        }
        let mut h = Self::from_construction(b, Construction::Sylvester { order: 1 });
        h.n = n;
        Ok(h)
    }

    /// The transform a trellis weight's rotation names over a dimension of `n` values: blocks,
    /// or the full transform with the stored dense factor `factor`.
    pub fn for_rotation(
        n: usize,
        rotation: sfx_formats::resident::Rotation,
        factor: &sfx_formats::resident::SmallHadamard,
    ) -> Result<Hadamard, HadamardError> {
        match rotation {
            sfx_formats::resident::Rotation::Full => {
                Self::with_factor(n, factor.order(), factor.entries())
            }
            r => Self::blocks(n, r.block_len(n)),
        }
    }

    /// Length of the blocks transformed independently (`n` for a full transform).
    pub fn block_len(&self) -> usize {
        self.block
    }

    /// The dense ±1 factor `H_m`, row-major (what a container stores).
    pub fn small_factor(&self) -> Vec<i8> {
        let scale = self.scale;
        self.small_scaled
            .iter()
            .map(|&v| if v / scale > 0.0 { 1 } else { -1 })
            .collect()
    }

    fn from_construction(n: usize, construction: Construction) -> Hadamard {
        let entries = build(&construction);
        Self::from_entries(n, construction, entries)
    }

    fn from_entries(n: usize, construction: Construction, entries: Vec<i8>) -> Hadamard {
        let m = construction.order();
        let scale = (1.0 / (n as f64).sqrt()) as f32;
        let small_scaled: Vec<f32> = entries.into_iter().map(|h| f32::from(h) * scale).collect();
        let small_scaled_t = (0..m * m)
            .map(|t| small_scaled[(t % m) * m + t / m])
            .collect();
        Hadamard {
            n,
            m,
            block: n,
            small_scaled,
            small_scaled_t,
            scale,
            construction,
            simd: SimdLevel::detect(),
        }
    }

    /// `n`, the length of the vectors this transforms.
    pub fn order(&self) -> usize {
        self.n
    }

    /// `m`, the order of the dense factor (1 when `n` is a power of two).
    pub fn small_order(&self) -> usize {
        self.m
    }

    pub fn construction(&self) -> &Construction {
        &self.construction
    }

    /// `x ← (H_m ⊗ H_{2^k}) · x / √n`.
    pub fn apply(&self, x: &mut [f32]) -> Result<(), HadamardError> {
        self.check_len(x.len())?;
        with_scratch(|s| self.transform(x, false, s));
        Ok(())
    }

    /// `x ← (H_m ⊗ H_{2^k})ᵀ · x / √n`, the inverse of [`Hadamard::apply`]. Differs from it
    /// because Paley I matrices are not symmetric.
    pub fn apply_transpose(&self, x: &mut [f32]) -> Result<(), HadamardError> {
        self.check_len(x.len())?;
        with_scratch(|s| self.transform(x, true, s));
        Ok(())
    }

    /// [`Hadamard::apply`] on each of `rows` contiguous rows of length `n`.
    pub fn apply_rows(&self, data: &mut [f32], rows: usize) -> Result<(), HadamardError> {
        self.rows(data, rows, false)
    }

    /// [`Hadamard::apply_transpose`] on each of `rows` contiguous rows of length `n`.
    pub fn apply_rows_transpose(&self, data: &mut [f32], rows: usize) -> Result<(), HadamardError> {
        self.rows(data, rows, true)
    }

    fn check_len(&self, got: usize) -> Result<(), HadamardError> {
        if got == self.n {
            Ok(())
        } else {
            Err(HadamardError::LengthMismatch {
                expected: self.n,
                got,
            })
        }
    }

    fn rows(&self, data: &mut [f32], rows: usize, transpose: bool) -> Result<(), HadamardError> {
        if rows.checked_mul(self.n) != Some(data.len()) {
            return Err(HadamardError::RowsMismatch {
                n: self.n,
                rows,
                got: data.len(),
            });
        }
        if rows > 1 && data.len() >= PAR_MIN_ELEMS {
            data.par_chunks_mut(self.n)
                .for_each(|row| with_scratch(|s| self.transform(row, transpose, s)));
        } else {
            with_scratch(|s| {
                for row in data.chunks_exact_mut(self.n) {
                    self.transform(row, transpose, s);
                }
            });
        }
        Ok(())
    }

    /// `x.len() == self.n` is checked by every caller.
    fn transform(&self, x: &mut [f32], transpose: bool, scratch: &mut Vec<f32>) {
        if self.block < self.n {
            for chunk in x.chunks_exact_mut(self.block) {
                fwht_scaled(self.simd, chunk, self.scale);
            }
            return;
        }
        if self.m == 1 {
            fwht_scaled(self.simd, x, self.scale);
            return;
        }
        if scratch.len() < self.n {
            scratch.resize(self.n, 0.0);
        }
        let hs = if transpose {
            &self.small_scaled_t
        } else {
            &self.small_scaled
        };
        mix(self.simd, x, hs, self.m, &mut scratch[..self.n]);
    }
}

thread_local! {
    /// One `n`-float output buffer per thread: the dense mix cannot run in place, and a
    /// per-call allocation would dominate small transforms.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

fn with_scratch<R>(f: impl FnOnce(&mut Vec<f32>) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut v) => f(&mut v),
        // Only reachable on re-entry from inside `f`; a private buffer keeps that correct.
        Err(_) => f(&mut Vec::new()),
    })
}

/// In-place unnormalised Walsh–Hadamard transform (natural / Sylvester order).
#[inline(always)]
fn fwht_body(x: &mut [f32]) {
    let len = x.len();
    // First two stages fused as radix-4: the h = 1, 2 butterflies are too short to vectorize
    // separately and would each cost a full pass over x.
    if len >= 4 {
        for c in x.chunks_exact_mut(4) {
            let (a, b, d, e) = (c[0] + c[1], c[0] - c[1], c[2] + c[3], c[2] - c[3]);
            c[0] = a + d;
            c[1] = b + e;
            c[2] = a - d;
            c[3] = b - e;
        }
    } else if len == 2 {
        let (a, b) = (x[0], x[1]);
        x[0] = a + b;
        x[1] = a - b;
        return;
    }
    let mut h = 4;
    while h < len {
        for c in x.chunks_exact_mut(2 * h) {
            let (lo, hi) = c.split_at_mut(h);
            for (u, v) in lo.iter_mut().zip(hi.iter_mut()) {
                let (s, d) = (*u + *v, *u - *v);
                *u = s;
                *v = d;
            }
        }
        h *= 2;
    }
}

#[inline(always)]
fn fwht_scaled_body(x: &mut [f32], scale: f32) {
    fwht_body(x);
    for v in x.iter_mut() {
        *v *= scale;
    }
}

/// Output rows × columns of one register tile of the dense mix. 4×16 keeps 8 ymm (AVX2) or
/// 4 zmm (AVX-512) accumulators live across the whole reduction over `m`, so each output is
/// stored once instead of being reloaded and stored per term (which made the first, axpy-based
/// version ~5× slower for m = 344).
const TILE_R: usize = 4;
const TILE_W: usize = 16;

/// `out[i0..i0+R, c0..c0+W] = Σ_l hs[i, l] · x[l, c0..c0+W]`.
#[inline(always)]
fn mix_tile<const R: usize>(
    x: &[f32],
    hs: &[f32],
    m: usize,
    p: usize,
    i0: usize,
    c0: usize,
    out: &mut [f32],
) {
    let mut acc = [[0.0f32; TILE_W]; R];
    let hrows: [&[f32]; R] = std::array::from_fn(|r| &hs[(i0 + r) * m..(i0 + r + 1) * m]);
    for (l, xrow) in x.chunks_exact(p).enumerate() {
        let xv = &xrow[c0..c0 + TILE_W];
        for (a, hr) in acc.iter_mut().zip(&hrows) {
            let c = hr[l];
            for (o, &v) in a.iter_mut().zip(xv) {
                *o += c * v;
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        out[(i0 + r) * p + c0..][..TILE_W].copy_from_slice(a);
    }
}

/// `x ← (H ⊗ H_p) x` with `hs` the m×m dense factor (already scaled, already transposed if
/// wanted), `p = x.len() / m`; `out` is scratch of `x.len()`.
#[inline(always)]
fn mix_body(x: &mut [f32], hs: &[f32], m: usize, out: &mut [f32]) {
    let p = x.len() / m;
    for row in x.chunks_exact_mut(p) {
        fwht_body(row);
    }
    let wide = p - p % TILE_W;
    let tiled_rows = m - m % TILE_R;
    for c0 in (0..wide).step_by(TILE_W) {
        for i0 in (0..tiled_rows).step_by(TILE_R) {
            mix_tile::<TILE_R>(x, hs, m, p, i0, c0, out);
        }
        for i0 in tiled_rows..m {
            mix_tile::<1>(x, hs, m, p, i0, c0, out);
        }
    }
    // Narrow remainder (p < 16, i.e. n < 16·m — tests and toy sizes only): plain dot products.
    for i in 0..m {
        for c in wide..p {
            out[i * p + c] = (0..m).map(|l| hs[i * m + l] * x[l * p + c]).sum();
        }
    }
    x.copy_from_slice(out);
}

multiversioned! {
    /// Power-of-two Walsh–Hadamard transform times `scale` (KVarN rotates head vectors with it).
    pub(crate) fn fwht_scaled(x: &mut [f32], scale: f32) = fwht_scaled_body;
}
multiversioned! { fn mix(x: &mut [f32], hs: &[f32], m: usize, out: &mut [f32]) = mix_body; }

// ---------------------------------------------------------------------------------------------
// Small matrices.

/// `q = p^k` with `p` prime, or `None`.
fn prime_power(q: usize) -> Option<(usize, u32)> {
    let f = factorize(q);
    match f.as_slice() {
        [(p, k)] => Some((*p, *k)),
        _ => None,
    }
}

fn factorize(mut n: usize) -> Vec<(usize, u32)> {
    let mut out = Vec::new();
    let mut d = 2;
    while d * d <= n {
        let mut e = 0;
        while n.is_multiple_of(d) {
            n /= d;
            e += 1;
        }
        if e > 0 {
            out.push((d, e));
        }
        d += 1;
    }
    if n > 1 {
        out.push((n, 1));
    }
    out
}

fn paley_field_ok(q: usize, residue: usize) -> bool {
    q % 4 == residue && prime_power(q).is_some()
}

fn plan(m: usize) -> Option<Construction> {
    if m == 0 || m > MAX_SMALL_ORDER {
        return None;
    }
    if m.is_power_of_two() {
        return Some(Construction::Sylvester { order: m });
    }
    if !m.is_multiple_of(4) {
        return None;
    }
    if paley_field_ok(m - 1, 3) {
        return Some(Construction::PaleyI { q: m - 1 });
    }
    if paley_field_ok(m / 2 - 1, 1) {
        return Some(Construction::PaleyII { q: m / 2 - 1 });
    }
    // Smallest factor first, so a Sylvester ⊗ Paley split (cheap to build) is found before
    // products of two Paley matrices.
    (2..)
        .take_while(|a| a * a <= m)
        .filter(|&a| m.is_multiple_of(a))
        .find_map(|a| {
            let (x, y) = (plan(a)?, plan(m / a)?);
            Some(Construction::Kronecker(Box::new(x), Box::new(y)))
        })
}

fn explain_failure(m: usize) -> String {
    if m > 2 && !m.is_multiple_of(4) {
        return format!("{m} (not 1, 2 or a multiple of 4)");
    }
    let why = |q: usize, residue: usize| match prime_power(q) {
        None => {
            let f: Vec<String> = factorize(q)
                .iter()
                .map(|&(p, e)| {
                    if e == 1 {
                        format!("{p}")
                    } else {
                        format!("{p}^{e}")
                    }
                })
                .collect();
            format!("{q} = {} is not a prime power", f.join("·"))
        }
        Some(_) => format!("{q} ≢ {residue} (mod 4)"),
    };
    format!(
        "{m} (Paley I: {}; Paley II: {}; no Kronecker split into constructible factors)",
        why(m - 1, 3),
        why(m / 2 - 1, 1)
    )
}

/// ±1 entries of the planned matrix, row-major. `Hadamard::new` only passes `plan` output,
/// whose Paley fields always exist; an invalid `q` (possible only by hand-building a
/// `Construction`) yields an empty matrix instead of a panic.
fn build(c: &Construction) -> Vec<i8> {
    match c {
        Construction::Sylvester { order } => {
            let m = *order;
            (0..m * m)
                .map(|t| {
                    if ((t / m) & (t % m)).count_ones() % 2 == 0 {
                        1
                    } else {
                        -1
                    }
                })
                .collect()
        }
        Construction::PaleyI { q } => paley_one(*q).unwrap_or_default(),
        Construction::PaleyII { q } => paley_two(*q).unwrap_or_default(),
        Construction::Kronecker(a, b) => {
            let (ha, hb) = (build(a), build(b));
            let (ma, mb) = (a.order(), b.order());
            let m = ma * mb;
            let mut h = vec![0i8; m * m];
            for (r, row) in h.chunks_exact_mut(m).enumerate() {
                let (i, k) = (r / mb, r % mb);
                for (cidx, v) in row.iter_mut().enumerate() {
                    let (j, l) = (cidx / mb, cidx % mb);
                    *v = ha[i * ma + j] * hb[k * mb + l];
                }
            }
            h
        }
        // Never reached: stored factors come with their entries (`with_factor`).
        Construction::Stored { order } => vec![0; order * order],
    }
}

/// GF(p^k): elements are integers whose base-p digits are polynomial coefficients (low first)
/// modulo a fixed monic irreducible polynomial of degree k.
struct Gf {
    p: usize,
    k: usize,
    q: usize,
    /// Low coefficients c_0..c_{k−1} of the modulus x^k + Σ c_i x^i.
    modulus: Vec<usize>,
}

impl Gf {
    fn new(q: usize) -> Option<Gf> {
        let (p, k) = prime_power(q)?;
        let k = k as usize;
        let modulus = find_irreducible(p, k)?;
        Some(Gf { p, k, q, modulus })
    }

    fn digits(&self, mut a: usize) -> Vec<usize> {
        (0..self.k)
            .map(|_| {
                let d = a % self.p;
                a /= self.p;
                d
            })
            .collect()
    }

    fn sub(&self, mut a: usize, mut b: usize) -> usize {
        let (mut r, mut place) = (0, 1);
        for _ in 0..self.k {
            r += (a % self.p + self.p - b % self.p) % self.p * place;
            place *= self.p;
            a /= self.p;
            b /= self.p;
        }
        r
    }

    fn mul(&self, a: usize, b: usize) -> usize {
        let (p, k) = (self.p, self.k);
        let (da, db) = (self.digits(a), self.digits(b));
        let mut prod = vec![0usize; 2 * k - 1];
        for (i, &x) in da.iter().enumerate() {
            for (j, &y) in db.iter().enumerate() {
                prod[i + j] = (prod[i + j] + x * y) % p;
            }
        }
        // x^k ≡ −Σ c_i x^i: fold the high coefficients down, top first.
        for d in (k..2 * k - 1).rev() {
            let c = prod[d];
            if c != 0 {
                for (i, &mi) in self.modulus.iter().enumerate() {
                    let t = &mut prod[d - k + i];
                    *t = (*t + p - c * mi % p) % p;
                }
                prod[d] = 0;
            }
        }
        prod[..k].iter().rev().fold(0, |acc, &c| acc * p + c)
    }

    /// Quadratic character χ over all elements: 0 at 0, +1 on nonzero squares, −1 otherwise.
    fn quadratic_character(&self) -> Vec<i8> {
        let mut chi = vec![-1i8; self.q];
        chi[0] = 0;
        for a in 1..self.q {
            chi[self.mul(a, a)] = 1;
        }
        chi
    }
}

/// The first monic irreducible of degree k over GF(p) in digit order (c_0 ≠ 0 so x ∤ f).
fn find_irreducible(p: usize, k: usize) -> Option<Vec<usize>> {
    let count = p.checked_pow(u32::try_from(k).ok()?)?;
    (0..count).find_map(|t| {
        let low: Vec<usize> = (0..k).map(|i| t / p.pow(i as u32) % p).collect();
        if low[0] == 0 {
            return None;
        }
        let mut f = low.clone();
        f.push(1);
        is_irreducible(&f, p).then_some(low)
    })
}

/// Trial division by every monic polynomial of degree 1..=deg/2.
fn is_irreducible(f: &[usize], p: usize) -> bool {
    let deg = f.len() - 1;
    for d in 1..=deg / 2 {
        for t in 0..p.pow(d as u32) {
            let mut g: Vec<usize> = (0..d).map(|i| t / p.pow(i as u32) % p).collect();
            g.push(1);
            if poly_rem_is_zero(f, &g, p) {
                return false;
            }
        }
    }
    true
}

fn poly_rem_is_zero(f: &[usize], g: &[usize], p: usize) -> bool {
    let dg = g.len() - 1;
    let mut r = f.to_vec();
    for top in (dg..r.len()).rev() {
        let c = r[top];
        if c != 0 {
            for (i, &gi) in g.iter().enumerate() {
                let t = &mut r[top - dg + i];
                *t = (*t + p - c * gi % p) % p;
            }
        }
    }
    r[..dg].iter().all(|&c| c == 0)
}

/// Paley I, q ≡ 3 (mod 4): H = I + C with the skew conference matrix
/// C = [[0, 1ᵀ], [−1, Q]], Q[i][j] = χ(a_i − a_j); C·Cᵀ = q·I and C = −Cᵀ give H·Hᵀ = (q+1)·I.
fn paley_one(q: usize) -> Option<Vec<i8>> {
    if q % 4 != 3 {
        return None;
    }
    let gf = Gf::new(q)?;
    let chi = gf.quadratic_character();
    let m = q + 1;
    let mut h = vec![1i8; m * m];
    for i in 1..m {
        h[i * m] = -1;
        for j in 1..m {
            if i != j {
                h[i * m + j] = chi[gf.sub(i - 1, j - 1)];
            }
        }
    }
    Some(h)
}

/// Paley II, q ≡ 1 (mod 4): the conference matrix C = [[0, 1ᵀ], [1, Q]] is symmetric with
/// C² = q·I, and H = C ⊗ [[1, 1], [1, −1]] + I ⊗ [[1, −1], [−1, −1]] has H·Hᵀ = 2(q+1)·I
/// (the cross terms cancel because C is symmetric).
fn paley_two(q: usize) -> Option<Vec<i8>> {
    if q % 4 != 1 {
        return None;
    }
    let gf = Gf::new(q)?;
    let chi = gf.quadratic_character();
    let c = |i: usize, j: usize| -> i8 {
        if i == j {
            0
        } else if i == 0 || j == 0 {
            1
        } else {
            chi[gf.sub(i - 1, j - 1)]
        }
    };
    let (v, m) = (q + 1, 2 * (q + 1));
    let mut h = vec![0i8; m * m];
    for i in 0..v {
        for j in 0..v {
            let cij = c(i, j);
            let block: [[i8; 2]; 2] = if cij == 0 {
                [[1, -1], [-1, -1]]
            } else {
                [[cij, cij], [cij, -cij]]
            };
            for (r, brow) in block.iter().enumerate() {
                for (s, &b) in brow.iter().enumerate() {
                    h[(2 * i + r) * m + 2 * j + s] = b;
                }
            }
        }
    }
    Some(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Rng(u64);
    impl Rng {
        fn f32(&mut self) -> f32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
        fn vec(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.f32()).collect()
        }
    }

    fn assert_hadamard(h: &[i8], m: usize, what: &str) {
        assert_eq!(h.len(), m * m, "{what}: size");
        assert!(h.iter().all(|&v| v == 1 || v == -1), "{what}: entries");
        for i in 0..m {
            for j in 0..m {
                let dot: i32 = (0..m)
                    .map(|t| i32::from(h[i * m + t]) * i32::from(h[j * m + t]))
                    .sum();
                let want = if i == j { m as i32 } else { 0 };
                assert_eq!(dot, want, "{what}: (H·Hᵀ)[{i}][{j}]");
            }
        }
    }

    /// Every order ≤ 200 we can build; the gaps (92, 116, 156, 172, 184, 188) need Williamson
    /// or other constructions not implemented here.
    #[test]
    fn small_orders_are_hadamard() {
        let built: Vec<usize> = (1..=200).filter(|&m| plan(m).is_some()).collect();
        let mut want = vec![1, 2];
        want.extend(
            (4..=200)
                .step_by(4)
                .filter(|m| ![92, 116, 156, 172, 184, 188].contains(m)),
        );
        assert_eq!(built, want);
        for &m in &built {
            let c = plan(m).unwrap();
            assert_eq!(c.order(), m);
            assert_hadamard(&build(&c), m, &format!("order {m} = {c}"));
        }
        let expected = [
            (12, Construction::PaleyI { q: 11 }),
            (20, Construction::PaleyI { q: 19 }),
            (28, Construction::PaleyI { q: 27 }),
            (36, Construction::PaleyII { q: 17 }),
            (52, Construction::PaleyII { q: 25 }),
            (76, Construction::PaleyII { q: 37 }),
            (148, Construction::PaleyII { q: 73 }),
            (152, Construction::PaleyI { q: 151 }),
            (344, Construction::PaleyI { q: 343 }),
        ];
        for (m, c) in expected {
            assert_eq!(plan(m), Some(c), "order {m}");
        }
    }

    /// A block rotation against the explicit matrix `(I ⊗ H_b) / √b` (Sylvester's `H_b` from
    /// its definition, `(−1)^popcount(i & j)`): every block mixes only its own values, the map
    /// is its own transpose and inverse, and bad block lengths are refused.
    #[test]
    fn block_rotations_are_block_diagonal_sylvester() {
        let mut rng = Rng(0x5eed_b10c);
        for (n, b) in [(576, 64), (384, 128), (96, 32), (64, 64)] {
            let h = Hadamard::blocks(n, b).unwrap();
            assert_eq!(h.block_len(), b);
            let x = rng.vec(n);
            let mut got = x.clone();
            h.apply(&mut got).unwrap();
            let norm = 1.0 / (b as f64).sqrt();
            for (i, &g) in got.iter().enumerate() {
                let (blk, r) = (i / b, i % b);
                let want: f64 = (0..b)
                    .map(|c| {
                        let sign = if (r & c).count_ones() % 2 == 0 {
                            1.0
                        } else {
                            -1.0
                        };
                        sign * f64::from(x[blk * b + c])
                    })
                    .sum::<f64>()
                    * norm;
                assert!(
                    (f64::from(g) - want).abs() < 1e-5,
                    "n {n} b {b} [{i}]: {g} vs {want}"
                );
            }
            let mut t = x.clone();
            h.apply_transpose(&mut t).unwrap();
            assert_eq!(t, got, "n {n} b {b}: symmetric");
            h.apply(&mut t).unwrap();
            for (a, b) in t.iter().zip(&x) {
                assert!((a - b).abs() < 1e-5);
            }
        }
        for (n, b) in [(576, 128), (96, 48), (0, 32), (64, 0)] {
            assert!(Hadamard::blocks(n, b).is_err(), "n {n} b {b}");
        }
    }

    /// Paley matrices over every extension-field degree the planner can hit (k = 1..5).
    #[test]
    fn paley_over_extension_fields() {
        for q in [3, 7, 11, 19, 23, 27, 31, 43, 243, 343] {
            let h = paley_one(q).unwrap();
            assert_hadamard(&h, q + 1, &format!("Paley I GF({q})"));
        }
        for q in [5, 9, 13, 17, 25, 29, 37, 49, 73, 81, 121, 125] {
            let h = paley_two(q).unwrap();
            assert_hadamard(&h, 2 * (q + 1), &format!("Paley II GF({q})"));
        }
        // Paley I matrices are not symmetric, so apply_transpose is a different map.
        let h = paley_one(11).unwrap();
        assert!((0..12).any(|i| (0..12).any(|j| h[i * 12 + j] != h[j * 12 + i])));
        assert!(paley_one(13).is_none() && paley_two(15).is_none() && paley_one(15).is_none());
    }

    #[test]
    fn field_arithmetic() {
        for q in [9, 25, 27, 49, 81, 125, 243, 343, 729] {
            let gf = Gf::new(q).unwrap();
            // A field has exactly (q − 1)/2 nonzero squares and no zero divisors.
            let chi = gf.quadratic_character();
            assert_eq!(
                chi.iter().filter(|&&c| c == 1).count(),
                (q - 1) / 2,
                "GF({q})"
            );
            for a in 1..q.min(60) {
                for b in 1..q {
                    assert_ne!(gf.mul(a, b), 0, "GF({q}): {a}·{b}");
                }
                assert_eq!(gf.sub(a, a), 0);
            }
        }
    }

    #[test]
    fn model_sizes() {
        let cases = [
            (1, 1),
            (2, 1),
            (64, 1),
            (128, 1),
            (576, 36),
            (896, 28),
            (960, 60),
            (1024, 1),
            (1536, 12),
            (2048, 1),
            (2560, 20),
            (3072, 12),
            (3584, 28),
            (4096, 1),
            (4864, 76),
            (5120, 20),
            (6144, 12),
            (8192, 1),
            (8960, 140),
            (9728, 76),
            (11008, 344),
            (12288, 12),
            (13824, 108),
            (14336, 28),
            (17408, 68),
            (18944, 148),
            (27648, 108),
            (28672, 28),
            (29568, 924),
        ];
        for (n, m) in cases {
            let h = Hadamard::new(n).unwrap_or_else(|e| panic!("{n}: {e}"));
            assert_eq!(
                (h.order(), h.small_order()),
                (n, m),
                "{n}: {}",
                h.construction()
            );
        }
    }

    #[test]
    fn unconstructible_sizes_fail_clearly() {
        assert_eq!(
            Hadamard::new(100_003).unwrap_err(),
            HadamardError::NotHadamardOrder { n: 100_003 }
        );
        assert_eq!(
            Hadamard::new(6).unwrap_err(),
            HadamardError::NotHadamardOrder { n: 6 }
        );
        assert_eq!(Hadamard::new(0).unwrap_err(), HadamardError::Empty);
        for n in [92, 172, 116, 156] {
            let e = Hadamard::new(n).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, HadamardError::NoConstruction { n: en, .. } if en == n));
            assert!(msg.contains(&format!("order {n}")), "{msg}");
            assert!(msg.contains("not a prime power"), "{msg}");
        }
        let msg = Hadamard::new(172).unwrap_err().to_string();
        assert!(msg.contains("171 = 3^2·19 is not a prime power"), "{msg}");
        assert!(msg.contains("85 = 5·17 is not a prime power"), "{msg}");
        // 4·2053: every candidate m (2053, 4106, …) is above the dense-factor limit.
        let msg = Hadamard::new(4 * 2053).unwrap_err().to_string();
        assert!(msg.contains("limit"), "{msg}");
    }

    #[test]
    fn length_mismatch_is_an_error() {
        let h = Hadamard::new(24).unwrap();
        let mut x = vec![0.0; 23];
        assert!(h.apply(&mut x).is_err() && h.apply_transpose(&mut x).is_err());
        let mut d = vec![0.0; 48];
        assert!(h.apply_rows(&mut d, 3).is_err());
        assert!(h.apply_rows(&mut d, usize::MAX).is_err());
        assert!(h.apply_rows(&mut d, 2).is_ok());
    }

    #[test]
    fn preserves_norm_and_inverts() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for n in [1, 2, 4, 12, 64, 576, 896, 1536, 4864, 11008, 14336, 18944] {
            let h = Hadamard::new(n).unwrap();
            let x = rng.vec(n);
            let mut y = x.clone();
            h.apply(&mut y).unwrap();
            let norm = |v: &[f32]| v.iter().map(|&a| f64::from(a).powi(2)).sum::<f64>().sqrt();
            let (nx, ny) = (norm(&x), norm(&y));
            assert!((nx - ny).abs() <= 1e-5 * nx, "{n}: {nx} vs {ny}");
            h.apply_transpose(&mut y).unwrap();
            let err = x
                .iter()
                .zip(&y)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(err <= 1e-5, "{n}: HᵀH x differs by {err}");
            // And the other order, HHᵀ = I.
            let mut z = x.clone();
            h.apply_transpose(&mut z).unwrap();
            h.apply(&mut z).unwrap();
            let err = x
                .iter()
                .zip(&z)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(err <= 1e-5, "{n}: HHᵀ x differs by {err}");
        }
    }

    #[test]
    fn matches_dense_kronecker() {
        let mut rng = Rng(12345);
        for n in [24, 40, 56, 72, 96, 112, 160, 192, 688] {
            let h = Hadamard::new(n).unwrap();
            let m = h.small_order();
            let p = n / m;
            let hm = build(h.construction());
            let hp = build(&Construction::Sylvester { order: p });
            let s = 1.0 / (n as f64).sqrt();
            let dense = |r: usize, c: usize| {
                let (i, a, j, b) = (r / p, r % p, c / p, c % p);
                f64::from(hm[i * m + j]) * f64::from(hp[a * p + b]) * s
            };
            let x = rng.vec(n);
            for transpose in [false, true] {
                let mut y = x.clone();
                if transpose {
                    h.apply_transpose(&mut y).unwrap();
                } else {
                    h.apply(&mut y).unwrap();
                }
                for (r, &yr) in y.iter().enumerate() {
                    let want: f64 = (0..n)
                        .map(|c| {
                            let d = if transpose { dense(c, r) } else { dense(r, c) };
                            d * f64::from(x[c])
                        })
                        .sum();
                    assert!(
                        (f64::from(yr) - want).abs() < 1e-5,
                        "n={n} transpose={transpose} row {r}: {yr} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn rows_match_single_vectors() {
        let mut rng = Rng(777);
        for (n, rows) in [(1536, 3), (896, 64), (2048, 40)] {
            let h = Hadamard::new(n).unwrap();
            let data = rng.vec(n * rows);
            for transpose in [false, true] {
                let mut batch = data.clone();
                if transpose {
                    h.apply_rows_transpose(&mut batch, rows).unwrap();
                } else {
                    h.apply_rows(&mut batch, rows).unwrap();
                }
                for (r, got) in batch.chunks_exact(n).enumerate() {
                    let mut want = data[r * n..(r + 1) * n].to_vec();
                    if transpose {
                        h.apply_transpose(&mut want).unwrap();
                    } else {
                        h.apply(&mut want).unwrap();
                    }
                    assert_eq!(got, want.as_slice(), "n={n} row {r}");
                }
            }
        }
    }

    #[test]
    #[ignore]
    fn bench_apply() {
        let mut rng = Rng(42);
        for n in [576, 1536, 4096, 4864, 8960, 11008, 14336, 18944, 29568] {
            let h = Hadamard::new(n).unwrap();
            let mut x = rng.vec(n);
            let iters = (50_000_000 / (n * (h.small_order() + 16))).max(20);
            h.apply(&mut x).unwrap();
            let t = std::time::Instant::now();
            for _ in 0..iters {
                h.apply(&mut x).unwrap();
            }
            let ns = t.elapsed().as_nanos() as f64 / (iters * n) as f64;
            println!(
                "n={n:6} m={:4} ({}) {:?}: {ns:.3} ns/element",
                h.small_order(),
                h.construction(),
                h.simd
            );
        }
    }
}

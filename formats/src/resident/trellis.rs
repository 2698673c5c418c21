//! [`TrellisQuantized`]: QTIP-style trellis-coded weights (bitshift trellis over 16×16 tiles
//! after a random Hadamard transform on both sides). Data and validation only: the codes,
//! Hadamard transforms and kernels that give these bytes meaning live in `sfx-runtime`
//! (`resident::trellis`, `resident::hadamard`, `resident::trellis_linear`).
//!
//! Meaning (docs/format.md, "Trellis-coded projections"): for a projection `W` `[rows, cols]`,
//! `y = W·x ≈ sv ⊙ H_outᵀ · (Ŵ · (H_in · (su ⊙ x)))`, where
//! - `H_in`, `H_out` are the orthonormal transforms `(H_m ⊗ H_{2^k}) / √n` of orders `cols` and
//!   `rows` (`H_{2^k}` natural-order Sylvester, `H_m` the dense ±1 factor in [`SmallHadamard`];
//!   `x` of length `n` read as a row-major `[m, 2^k]` matrix, QTIP's convention);
//! - `su` holds ±1 input signs, `sv` output signs times the weight scale (QTIP folds `Wscale`
//!   into `SV` the same way);
//! - `Ŵ` `[rows, cols]` is the decoded trellis: tile `(tr, tc)` covers rows `16·tr..16·tr+16`
//!   and columns `16·tc..16·tc+16`, tiles are stored in row-major tile order, each as a stream of
//!   exactly `256·K` bits (`32·K` bytes, MSB-first). Step `t` of a tile reads the `L`-bit window
//!   at bit `K·V·t` (wrapping: tail-biting) and its code emits `V` values at sequence positions
//!   `V·t..V·t+V`, placed in the tile by [`TileOrder`].

use super::ResidentError;
use half::f16;

/// Tile side: QTIP's 16×16 tiles (td_x = td_y = 16).
pub const TILE_SIDE: usize = 16;
/// Weights per tile.
pub const TILE_WEIGHTS: usize = TILE_SIDE * TILE_SIDE;

fn invalid<T>(msg: impl Into<String>) -> Result<T, ResidentError> {
    Err(ResidentError::Invalid(format!("trellis: {}", msg.into())))
}

/// Which function maps an `L`-bit state to weight values (QTIP's codes; docs/format.md,
/// "Trellis-coded projections").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TrellisCode {
    /// QTIP's HYB (`quantlut_sym`): V = 2 values from a `2^q`-row table of f16 pairs, the first
    /// negated by bit 15 of `x·(x+1)`.
    Hyb { q: u8 },
    /// 1MAD (V = 1): LCG + byte sum.
    OneMad,
    /// 3INST (V = 1): LCG + masked sum of two f16 halves.
    ThreeInst,
}

impl TrellisCode {
    /// Values emitted per trellis step.
    pub fn values_per_step(self) -> usize {
        match self {
            TrellisCode::Hyb { .. } => 2,
            TrellisCode::OneMad | TrellisCode::ThreeInst => 1,
        }
    }

    /// Rows of the lookup table (`2^q` for HYB, 0 for computed codes).
    pub fn table_rows(self) -> usize {
        match self {
            TrellisCode::Hyb { q } => 1usize << q,
            _ => 0,
        }
    }

    pub fn name(self) -> String {
        match self {
            TrellisCode::Hyb { q } => format!("hyb-q{q}"),
            TrellisCode::OneMad => "1mad".into(),
            TrellisCode::ThreeInst => "3inst".into(),
        }
    }

    /// Parses `hyb` (q = 9), `hyb-qN`, `1mad`, `3inst`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "hyb" => Some(TrellisCode::Hyb { q: 9 }),
            "1mad" => Some(TrellisCode::OneMad),
            "3inst" => Some(TrellisCode::ThreeInst),
            _ => {
                let q: u8 = s.strip_prefix("hyb-q")?.parse().ok()?;
                (1..=15).contains(&q).then_some(TrellisCode::Hyb { q })
            }
        }
    }
}

/// Where value `p` (0..256) of a tile's decoded sequence lands inside the 16×16 tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TileOrder {
    /// Row-major: `p → (p / 16, p % 16)`. Written by `sfx-convert`.
    RowMajor,
    /// QTIP's kernel (tensor-core fragment) order, used by its prequantized checkpoints:
    /// with `s = p / 2`, `v = p % 2`: row `8·(s & 1) + (s >> 4)`, column
    /// `8·((s >> 1) & 1) + 2·((s >> 2) & 3) + v`.
    Mma,
}

impl TileOrder {
    /// `(row, col)` inside the tile of sequence position `p < 256`.
    pub fn position(self, p: usize) -> (usize, usize) {
        match self {
            TileOrder::RowMajor => (p / TILE_SIDE, p % TILE_SIDE),
            TileOrder::Mma => {
                let (s, v) = (p >> 1, p & 1);
                (
                    8 * (s & 1) + (s >> 4),
                    8 * ((s >> 1) & 1) + 2 * ((s >> 2) & 3) + v,
                )
            }
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TileOrder::RowMajor => "row-major",
            TileOrder::Mma => "mma",
        }
    }
}

/// How far the random Hadamard rotation of a trellis weight mixes each dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Rotation {
    /// One transform over the whole dimension, `(H_m ⊗ H_{2^k}) / √n` (QTIP's).
    #[default]
    Full,
    /// A Walsh–Hadamard transform of each contiguous block of `b` values, `(I_{n/b} ⊗ H_b) /
    /// √b`, with `b` the largest power of two that divides `n` up to `2^max_log2` (576 → 64
    /// at 128). No value mixes with another block's, so a GPU block that owns whole blocks of
    /// outputs or inputs transforms them without a pass over the whole vector.
    Blocks { max_log2: u8 },
}

/// Block lengths a [`Rotation::Blocks`] may name: 16 … 4096.
pub const ROTATION_BLOCK_LOG2: std::ops::RangeInclusive<u8> = 4..=12;

impl Rotation {
    /// Blocks of at most `max` values (a power of two in 16 … 4096).
    pub fn blocks(max: usize) -> Option<Self> {
        let log2 = u8::try_from(max.trailing_zeros()).ok()?;
        (max.is_power_of_two() && ROTATION_BLOCK_LOG2.contains(&log2))
            .then_some(Rotation::Blocks { max_log2: log2 })
    }

    /// The block length over a dimension of `n` values (`n` itself for a full rotation).
    pub fn block_len(self, n: usize) -> usize {
        match self {
            Rotation::Full => n,
            Rotation::Blocks { max_log2 } => {
                let pow2 = 1usize << n.trailing_zeros().min(usize::BITS - 1);
                pow2.min(1usize << max_log2).min(n.max(1))
            }
        }
    }

    /// `full` or `b128` (what `--rotation` takes and `sfx inspect` shows).
    pub fn name(self) -> String {
        match self {
            Rotation::Full => "full".into(),
            Rotation::Blocks { max_log2 } => format!("b{}", 1usize << max_log2),
        }
    }

    /// Parses `full` or `bN` (N a power of two in 16 … 4096).
    pub fn parse(s: &str) -> Option<Self> {
        if s == "full" {
            return Some(Rotation::Full);
        }
        Self::blocks(s.strip_prefix('b')?.parse().ok()?)
    }
}

/// Code, state width, bits per weight, tile order and rotation of a trellis-coded weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TrellisScheme {
    pub code: TrellisCode,
    /// State width in bits (QTIP: 16).
    pub l: u8,
    /// Bits per weight.
    pub k: u8,
    pub order: TileOrder,
    pub rotation: Rotation,
}

impl TrellisScheme {
    /// QTIP's shape: L = 16, row-major tiles.
    pub fn qtip(code: TrellisCode, k: u8) -> Self {
        Self {
            code,
            l: 16,
            k,
            order: TileOrder::RowMajor,
            rotation: Rotation::Full,
        }
    }

    pub fn v(&self) -> usize {
        self.code.values_per_step()
    }

    /// Bytes of one tile's stream (`256·K / 8`).
    pub fn tile_bytes(&self) -> usize {
        TILE_WEIGHTS * usize::from(self.k) / 8
    }

    /// The combinations the runtime decodes: L = 16, K ∈ 1..=4 with K·V < L.
    pub fn validate(&self) -> Result<(), ResidentError> {
        if self.l != 16 {
            return invalid(format!("state width L = {} (only 16 is supported)", self.l));
        }
        if !(1..=4).contains(&self.k) {
            return invalid(format!("{} bits per weight (1–4 supported)", self.k));
        }
        if let TrellisCode::Hyb { q } = self.code {
            if !(1..=15).contains(&q) {
                return invalid(format!("HYB table of 2^{q} rows (q must be 1–15)"));
            }
        }
        if let Rotation::Blocks { max_log2 } = self.rotation {
            if !ROTATION_BLOCK_LOG2.contains(&max_log2) {
                return invalid(format!(
                    "rotation blocks of 2^{max_log2} values (2^4 … 2^12 supported)"
                ));
            }
        }
        Ok(())
    }

    /// Packs the scheme into one u64 for the container's layout dims: byte 0 code
    /// (0 HYB, 1 1MAD, 2 3INST), byte 1 HYB table bits, byte 2 L, byte 3 order (0 row-major,
    /// 1 mma), byte 4 the rotation (0 full, else log2 of the largest block). K is its own
    /// dimension. Readers before block rotations refuse a non-zero byte 4 ("unknown high
    /// bits"), so such a file never decodes with the wrong transform.
    pub fn encode(&self) -> u64 {
        let (code, q) = match self.code {
            TrellisCode::Hyb { q } => (0u64, u64::from(q)),
            TrellisCode::OneMad => (1, 0),
            TrellisCode::ThreeInst => (2, 0),
        };
        let order = match self.order {
            TileOrder::RowMajor => 0u64,
            TileOrder::Mma => 1,
        };
        let rotation = match self.rotation {
            Rotation::Full => 0u64,
            Rotation::Blocks { max_log2 } => u64::from(max_log2),
        };
        code | q << 8 | u64::from(self.l) << 16 | order << 24 | rotation << 32
    }

    /// Inverse of [`TrellisScheme::encode`]; the message names the bad field.
    pub fn decode(packed: u64, k: u64) -> Result<Self, ResidentError> {
        if packed >> 40 != 0 {
            return invalid(format!("scheme word {packed:#x} has unknown high bits"));
        }
        let byte = |i: u32| ((packed >> (8 * i)) & 0xff) as u8;
        let code = match byte(0) {
            0 => TrellisCode::Hyb { q: byte(1) },
            1 => TrellisCode::OneMad,
            2 => TrellisCode::ThreeInst,
            c => return invalid(format!("unknown code id {c} (0 HYB, 1 1MAD, 2 3INST)")),
        };
        let order = match byte(3) {
            0 => TileOrder::RowMajor,
            1 => TileOrder::Mma,
            o => return invalid(format!("unknown tile order {o} (0 row-major, 1 mma)")),
        };
        let k = u8::try_from(k)
            .ok()
            .filter(|k| (1..=4).contains(k))
            .map_or_else(
                || invalid(format!("{k} bits per weight (1–4 supported)")),
                Ok,
            )?;
        let rotation = match byte(4) {
            0 => Rotation::Full,
            b if ROTATION_BLOCK_LOG2.contains(&b) => Rotation::Blocks { max_log2: b },
            b => {
                return invalid(format!(
                    "rotation byte {b} (0 full, 4–12 blocks of up to 2^b values)"
                ))
            }
        };
        let s = Self {
            code,
            l: byte(2),
            k,
            order,
            rotation,
        };
        s.validate()?;
        Ok(s)
    }

    pub fn name(&self) -> String {
        let rotation = match self.rotation {
            Rotation::Full => String::new(),
            r => format!(" rotation {}", r.name()),
        };
        format!(
            "trellis {} L{} K{} {}{rotation}",
            self.code.name(),
            self.l,
            self.k,
            self.order.name()
        )
    }
}

/// The dense ±1 factor `H_m` of a Hadamard transform of order `m·2^k` (`m = 1`: pure
/// Walsh–Hadamard). Stored in the file so a reader never has to reproduce a construction
/// (an imported QTIP checkpoint carries QTIP's factors, ours carry ours).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SmallHadamard {
    order: usize,
    entries: Vec<i8>,
}

impl SmallHadamard {
    /// Identity factor (`m = 1`).
    pub fn unit() -> Self {
        Self {
            order: 1,
            entries: vec![1],
        }
    }

    /// Checks entries are ±1 and rows orthogonal (`H Hᵀ = m·I`).
    pub fn new(order: usize, entries: Vec<i8>) -> Result<Self, ResidentError> {
        if order == 0 || order > 4096 || order.checked_mul(order) != Some(entries.len()) {
            return invalid(format!(
                "Hadamard factor of order {order} with {} entries",
                entries.len()
            ));
        }
        if entries.iter().any(|&e| e != 1 && e != -1) {
            return invalid(format!(
                "Hadamard factor of order {order} has entries other than ±1"
            ));
        }
        for i in 0..order {
            for j in i + 1..order {
                let dot: i64 = (0..order)
                    .map(|c| i64::from(entries[i * order + c]) * i64::from(entries[j * order + c]))
                    .sum();
                if dot != 0 {
                    return invalid(format!(
                        "Hadamard factor of order {order}: rows {i} and {j} are not orthogonal"
                    ));
                }
            }
        }
        Ok(Self { order, entries })
    }

    pub fn order(&self) -> usize {
        self.order
    }

    /// Row-major ±1 entries.
    pub fn entries(&self) -> &[i8] {
        &self.entries
    }

    /// Whether a transform of length `n` can use this factor (`n = m·2^k`).
    pub fn fits(&self, n: usize) -> bool {
        n.is_multiple_of(self.order) && (n / self.order).is_power_of_two()
    }
}

/// A trellis-coded projection `[rows, cols]`; meaning in the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct TrellisQuantized {
    scheme: TrellisScheme,
    rows: usize,
    cols: usize,
    tiles: Vec<u8>,
    su: Vec<f16>,
    sv: Vec<f32>,
    tlut: Vec<f16>,
    had_in: SmallHadamard,
    had_out: SmallHadamard,
}

/// Parts of a [`TrellisQuantized`] (named, so a caller cannot swap `su` and `sv`).
#[derive(Debug, Clone, PartialEq)]
pub struct TrellisParts {
    pub scheme: TrellisScheme,
    pub rows: usize,
    pub cols: usize,
    /// `(rows/16)·(cols/16)` tile streams of `32·K` bytes, row-major tile order.
    pub tiles: Vec<u8>,
    /// Input signs (±1), `cols`.
    pub su: Vec<f16>,
    /// Output signs × scale, `rows`.
    pub sv: Vec<f32>,
    /// HYB table `[2^q, 2]` row-major; empty for computed codes.
    pub tlut: Vec<f16>,
    pub had_in: SmallHadamard,
    pub had_out: SmallHadamard,
}

impl TrellisQuantized {
    /// Validates every size and value that would otherwise make the kernels read out of bounds
    /// or produce non-finite output.
    pub fn from_parts(p: TrellisParts) -> Result<Self, ResidentError> {
        p.scheme.validate()?;
        let (rows, cols) = (p.rows, p.cols);
        if rows == 0
            || cols == 0
            || !rows.is_multiple_of(TILE_SIDE)
            || !cols.is_multiple_of(TILE_SIDE)
        {
            return invalid(format!(
                "[{rows}, {cols}] is not a non-empty multiple of the {TILE_SIDE}×{TILE_SIDE} tile"
            ));
        }
        let want = Self::tile_stream_len(&p.scheme, rows, cols)
            .map_or_else(|| invalid(format!("[{rows}, {cols}] overflows")), Ok)?;
        if p.tiles.len() != want {
            return invalid(format!(
                "{} tile bytes, expected {want} for [{rows}, {cols}] at K = {}",
                p.tiles.len(),
                p.scheme.k
            ));
        }
        if p.su.len() != cols || p.sv.len() != rows {
            return invalid(format!(
                "su has {} entries and sv {}, expected {cols} and {rows}",
                p.su.len(),
                p.sv.len()
            ));
        }
        if let Some(i) = p.su.iter().position(|&s| s.to_f32().abs() != 1.0) {
            return invalid(format!("su[{i}] = {} is not ±1", p.su[i]));
        }
        if let Some(i) = p.sv.iter().position(|s| !s.is_finite()) {
            return invalid(format!("sv[{i}] = {} is not finite", p.sv[i]));
        }
        let want_lut = p.scheme.code.table_rows() * p.scheme.v();
        if p.tlut.len() != want_lut {
            return invalid(format!(
                "lookup table of {} values, {} needs {want_lut}",
                p.tlut.len(),
                p.scheme.code.name()
            ));
        }
        if let Some(i) = p.tlut.iter().position(|v| !v.is_finite()) {
            return invalid(format!("lookup table value {i} is not finite"));
        }
        if p.scheme.rotation != Rotation::Full && (p.had_in.order() != 1 || p.had_out.order() != 1)
        {
            return invalid(format!(
                "block rotation with dense Hadamard factors of orders {} and {} (blocks take none)",
                p.had_in.order(),
                p.had_out.order()
            ));
        }
        if p.scheme.rotation == Rotation::Full && (!p.had_in.fits(cols) || !p.had_out.fits(rows)) {
            return invalid(format!(
                "Hadamard factors of orders {} (input) and {} (output) do not divide {cols} and \
                 {rows} into powers of two",
                p.had_in.order(),
                p.had_out.order()
            ));
        }
        Ok(Self {
            scheme: p.scheme,
            rows,
            cols,
            tiles: p.tiles,
            su: p.su,
            sv: p.sv,
            tlut: p.tlut,
            had_in: p.had_in,
            had_out: p.had_out,
        })
    }

    /// Bytes of all tile streams of a `[rows, cols]` weight; `None` on overflow.
    pub fn tile_stream_len(scheme: &TrellisScheme, rows: usize, cols: usize) -> Option<usize> {
        (rows / TILE_SIDE)
            .checked_mul(cols / TILE_SIDE)?
            .checked_mul(scheme.tile_bytes())
    }

    pub fn scheme(&self) -> &TrellisScheme {
        &self.scheme
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn tiles(&self) -> &[u8] {
        &self.tiles
    }
    /// Stream of tile `(tr, tc)`.
    pub fn tile(&self, tr: usize, tc: usize) -> &[u8] {
        let tb = self.scheme.tile_bytes();
        let i = tr * (self.cols / TILE_SIDE) + tc;
        &self.tiles[i * tb..(i + 1) * tb]
    }
    pub fn su(&self) -> &[f16] {
        &self.su
    }
    pub fn sv(&self) -> &[f32] {
        &self.sv
    }
    pub fn tlut(&self) -> &[f16] {
        &self.tlut
    }
    pub fn had_in(&self) -> &SmallHadamard {
        &self.had_in
    }
    pub fn had_out(&self) -> &SmallHadamard {
        &self.had_out
    }

    /// Per-projection resident bytes: tile streams, f16 `su`, f32 `sv`. The lookup table and
    /// Hadamard factors are stored once per model and not counted here.
    pub fn size_in_bytes(&self) -> usize {
        self.tiles.len() + 2 * self.su.len() + 4 * self.sv.len()
    }

    /// Storage cost per weight (2-bit, 576×576: 2 + (16 + 32)/576 = 2.083).
    pub fn bits_per_weight(&self) -> f64 {
        (8 * self.size_in_bytes()) as f64 / (self.rows * self.cols) as f64
    }
}

/// Container section name of the model-wide HYB table (`[2^q, 2]` F16).
pub const TLUT_SECTION: &str = "resident.tlut";

/// Container section name of the model-wide dense ±1 Hadamard factor of order `m`
/// (`[m, m]` F32).
pub fn hadamard_section(m: usize) -> String {
    format!("resident.hadamard.{m}")
}

/// One section to write: name, layout, bytes.
pub type SectionBytes = (String, crate::sfx::Layout, Vec<u8>);

/// The container sections of trellis weight `name` (docs/format.md, "Trellis-coded
/// projections"): `(own, shared)`. `own` are `{name}.weight` (tiles), `{name}.weight.su` (F16)
/// and `{name}.weight.sv` (F32); `shared` are the model-wide table and Hadamard factors, which
/// a writer stores once (and, for a table that differs from the stored one, as
/// `{name}.weight.tlut`).
pub fn trellis_sections(
    name: &str,
    t: &TrellisQuantized,
) -> (Vec<SectionBytes>, Vec<SectionBytes>) {
    use crate::sfx::Layout;
    use crate::DType;
    let (rows, cols) = (t.rows() as u64, t.cols() as u64);
    let f16_bytes = |v: &[f16]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let dense = |dtype, shape: Vec<u64>| Layout::Dense { dtype, shape };
    let own = vec![
        (
            format!("{name}.weight"),
            Layout::TrellisTiles {
                rows,
                cols,
                k: u64::from(t.scheme().k),
                scheme: t.scheme().encode(),
            },
            t.tiles().to_vec(),
        ),
        (
            format!("{name}.weight.su"),
            dense(DType::F16, vec![cols]),
            f16_bytes(t.su()),
        ),
        (
            format!("{name}.weight.sv"),
            dense(DType::F32, vec![rows]),
            t.sv().iter().flat_map(|x| x.to_le_bytes()).collect(),
        ),
    ];
    let mut shared = Vec::new();
    if !t.tlut().is_empty() {
        shared.push((
            TLUT_SECTION.to_string(),
            dense(DType::F16, vec![t.tlut().len() as u64 / 2, 2]),
            f16_bytes(t.tlut()),
        ));
    }
    for f in [t.had_in(), t.had_out()] {
        let m = f.order();
        if m > 1 && !shared.iter().any(|s| s.0 == hadamard_section(m)) {
            shared.push((
                hadamard_section(m),
                dense(DType::F32, vec![m as u64, m as u64]),
                f.entries()
                    .iter()
                    .flat_map(|&e| f32::from(e).to_le_bytes())
                    .collect(),
            ));
        }
    }
    (own, shared)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts() -> TrellisParts {
        let scheme = TrellisScheme::qtip(TrellisCode::Hyb { q: 9 }, 2);
        TrellisParts {
            scheme,
            rows: 32,
            cols: 48,
            tiles: vec![0; 2 * 3 * 64],
            su: vec![f16::ONE; 48],
            sv: vec![0.5; 32],
            tlut: vec![f16::ZERO; 1024],
            had_in: SmallHadamard::new(12, sylvester_like_12())
                .unwrap_or_else(|_| SmallHadamard::unit()),
            had_out: SmallHadamard::unit(),
        }
    }

    // Paley I of order 12 built from the quadratic residues mod 11 (independent of the
    // runtime's construction code).
    fn sylvester_like_12() -> Vec<i8> {
        let q = 11usize;
        let chi = |a: usize| -> i8 {
            let a = a % q;
            if a == 0 {
                0
            } else if (1..q).any(|x| x * x % q == a) {
                1
            } else {
                -1
            }
        };
        let n = q + 1;
        let mut h = vec![0i8; n * n];
        for i in 0..n {
            for j in 0..n {
                // Jacobsthal core S (skew), Paley I: H = I + S with S = [[0, 1ᵀ], [−1, Q]].
                let s = match (i, j) {
                    (0, 0) => 0,
                    (0, _) => 1,
                    (_, 0) => -1,
                    _ => chi(q + j - i),
                };
                h[i * n + j] = if i == j { 1 } else { s };
            }
        }
        h
    }

    #[test]
    fn valid_parts_build_and_count_bits() {
        let p = parts();
        assert_eq!(
            p.had_in.order(),
            12,
            "the Paley I test factor must be a Hadamard matrix"
        );
        let t = TrellisQuantized::from_parts(p).unwrap();
        assert_eq!(t.tile(1, 2).len(), 64);
        // 2 bits + (48·16 + 32·32) / (32·48)
        let want = 2.0 + (48.0 * 16.0 + 32.0 * 32.0) / (32.0 * 48.0);
        assert!((t.bits_per_weight() - want).abs() < 1e-12);
    }

    #[test]
    fn bad_parts_are_named() {
        let mut p = parts();
        p.tiles.pop();
        let e = TrellisQuantized::from_parts(p).unwrap_err().to_string();
        assert!(e.contains("tile bytes"), "{e}");

        let mut p = parts();
        p.su[3] = f16::from_f32(0.5);
        let e = TrellisQuantized::from_parts(p).unwrap_err().to_string();
        assert!(e.contains("su[3]"), "{e}");

        let mut p = parts();
        p.rows = 40;
        let e = TrellisQuantized::from_parts(p).unwrap_err().to_string();
        assert!(e.contains("tile"), "{e}");

        let mut p = parts();
        p.had_out = p.had_in.clone();
        let e = TrellisQuantized::from_parts(p).unwrap_err().to_string();
        assert!(e.contains("Hadamard"), "{e}");

        let mut p = parts();
        p.tlut.truncate(10);
        let e = TrellisQuantized::from_parts(p).unwrap_err().to_string();
        assert!(e.contains("lookup table"), "{e}");

        let mut p = parts();
        p.scheme.rotation = Rotation::Blocks { max_log2: 7 };
        let e = TrellisQuantized::from_parts(p).unwrap_err().to_string();
        assert!(e.contains("block rotation"), "{e}");
        let mut p = parts();
        p.scheme.rotation = Rotation::Blocks { max_log2: 7 };
        p.had_in = SmallHadamard::unit();
        assert!(TrellisQuantized::from_parts(p).is_ok());

        assert!(SmallHadamard::new(2, vec![1, 1, 1, 1]).is_err());
        assert!(SmallHadamard::new(2, vec![1, 1, 1, -1]).is_ok());
        assert!(SmallHadamard::new(3, vec![1; 4]).is_err());
    }

    #[test]
    fn scheme_round_trips_and_rejects_unknown_fields() {
        for code in [
            TrellisCode::Hyb { q: 9 },
            TrellisCode::OneMad,
            TrellisCode::ThreeInst,
        ] {
            for order in [TileOrder::RowMajor, TileOrder::Mma] {
                for rotation in [Rotation::Full, Rotation::Blocks { max_log2: 7 }] {
                    for k in 1..=4u8 {
                        let s = TrellisScheme {
                            code,
                            l: 16,
                            k,
                            order,
                            rotation,
                        };
                        assert_eq!(TrellisScheme::decode(s.encode(), u64::from(k)).unwrap(), s);
                    }
                }
            }
        }
        // Byte 4: 0 or 4..=12; the byte after it is unknown.
        assert!(TrellisScheme::decode(0x0010_0900 | 3 << 32, 2).is_err());
        assert!(TrellisScheme::decode(0x0010_0900 | 13 << 32, 2).is_err());
        assert!(TrellisScheme::decode(0x0010_0900 | 12 << 32, 2).is_ok());
        assert!(TrellisScheme::decode(3, 2).is_err());
        assert!(TrellisScheme::decode(0x0001_0009 | 7 << 24, 2).is_err());
        assert!(TrellisScheme::decode(0x0010_0009, 5).is_err());
        assert!(TrellisScheme::decode(0x0008_0009, 2).is_err()); // L = 8
        assert!(TrellisScheme::decode(1 << 40, 2).is_err());
    }

    #[test]
    fn block_rotations_take_the_largest_power_of_two_that_divides() {
        let b128 = Rotation::parse("b128").unwrap();
        assert_eq!(b128, Rotation::Blocks { max_log2: 7 });
        assert_eq!(b128.name(), "b128");
        // 576 = 9·64, 1536 = 12·128, 14336 = 112·128, 48 = 3·16.
        for (n, b) in [(576, 64), (1536, 128), (14336, 128), (4096, 128), (48, 16)] {
            assert_eq!(b128.block_len(n), b, "n = {n}");
        }
        assert_eq!(Rotation::Full.block_len(576), 576);
        assert_eq!(Rotation::parse("full"), Some(Rotation::Full));
        for bad in ["b100", "b8", "b8192", "blocks", "b"] {
            assert_eq!(Rotation::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn mma_order_is_a_permutation_with_adjacent_pairs() {
        let mut seen = [false; TILE_WEIGHTS];
        for p in 0..TILE_WEIGHTS {
            let (r, c) = TileOrder::Mma.position(p);
            assert!(!seen[r * 16 + c]);
            seen[r * 16 + c] = true;
            if p % 2 == 1 {
                let (r0, c0) = TileOrder::Mma.position(p - 1);
                assert_eq!((r0, c0 + 1), (r, c));
            }
        }
        // Spot values worked out by hand from the formula: p = 2s + v with
        // d1 = p>>5, d3 = (p>>3)&3, d2 = (p>>2)&1, d0 = (p>>1)&1, d4 = p&1.
        for p in [0usize, 1, 2, 7, 37, 100, 255] {
            let (d1, d3, d2, d0, d4) = (p >> 5, (p >> 3) & 3, (p >> 2) & 1, (p >> 1) & 1, p & 1);
            assert_eq!(
                TileOrder::Mma.position(p),
                (8 * d0 + d1, 8 * d2 + 2 * d3 + d4)
            );
        }
    }
}

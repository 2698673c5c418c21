//! Import of QTIP / YAQA prequantized Hugging Face checkpoints (both write the same format) into
//! the trellis sections of a `.sfx` container. Implemented from the checkpoint format as
//! docs/format.md states it ("QTIP/YAQA checkpoint import") only: QTIP's code is GPL-3.0 and is
//! not used.
//!
//! What a checkpoint holds per projection `P` (e.g. `model.layers.0.self_attn.q_proj`):
//! - `P.trellis`: int16 `[(out/16)·(in/16), 16·K]`, the tile bitstreams in the storage
//!   swizzle of QTIP's CUDA kernel ([`unswizzle`]);
//! - `P.SU`: ±1 input signs `[in]`, `P.SV`: output signs × `Wscale` `[out]` (fp32);
//! - `P.tlut`: the HYB table, fp16 `[2^Q, 2]`.
//!
//! and `config.json` carries `quip_params` ([`QuipParams`]). Inside a tile the kernel visits
//! weights in tensor-core fragment order, which is [`TileOrder::Mma`]. The small Hadamard
//! factors of non-power-of-two orders are *not* in the checkpoint (QTIP hard-codes them), so
//! the caller supplies them ([`HadamardTables`]; docs/decisions.md "QTIP checkpoint import").
//!
//! Meaning after import (the runtime's, `resident::trellis`): `y = SV ⊙ H_outᵀ·(Ŵ·(H_in·(SU ⊙ x)))`.
//! QTIP's extra fixed factor 32 (`x/32` before the matvec, `·32` after) cancels and is not stored.

use crate::checkpoint::{read_optional, read_optional_json, ShardIndex};
use crate::config::ModelConfig;
use crate::resident::{
    trellis_sections, SmallHadamard, TileOrder, TrellisCode, TrellisParts, TrellisQuantized,
    TrellisScheme, TILE_SIDE, TLUT_SECTION,
};
use crate::sfx::{Codec, Layout, SectionSpec, SfxWriter, Tier};
use crate::{DType, FormatError};
use memmap2::Mmap;
use safetensors::{Dtype as StDtype, SafeTensors};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// QTIP's kernel groups 16×16 tiles in 2×2 blocks, so both dimensions of an imported
/// projection must be multiples of this.
pub const SUPERTILE_SIDE: usize = 2 * TILE_SIDE;

/// Orders of the dense Hadamard factors QTIP ships (`n = K·2^p`). Used
/// only to name the order a missing table should have; the tables themselves come from the
/// user.
pub const QTIP_HADAMARD_ORDERS: [usize; 12] =
    [12, 20, 28, 36, 52, 60, 108, 116, 124, 140, 156, 172];

/// Largest Hadamard table accepted: the runtime's dense mixing pass is built for factors up
/// to this order (`sfx_runtime::resident::hadamard::MAX_SMALL_ORDER`), and validating a table
/// costs `order³`.
pub const MAX_TABLE_ORDER: usize = 2048;

/// A `--hadamard-tables` file larger than this is rejected before it is read (a 2048-order
/// table written as `+`/`-` strings is ≈ 4.2 MB).
const MAX_TABLES_FILE_BYTES: u64 = 64 << 20;

/// Why a QTIP checkpoint cannot be imported; every variant names the file, field or tensor.
#[derive(Debug, thiserror::Error)]
pub enum QtipError {
    /// `quip_params` (or one of its fields) is missing, malformed or names a variant this
    /// importer cannot decode. `field` is the full JSON path, e.g. `quip_params.decode_mode`.
    #[error("{path}: {field}: {msg}")]
    Params {
        path: PathBuf,
        field: String,
        msg: String,
    },
    /// A checkpoint tensor is missing, of the wrong dtype/shape, or holds invalid values.
    #[error("tensor '{tensor}': {msg}")]
    Tensor { tensor: String, msg: String },
    /// A dimension needs a Hadamard factor the tables do not provide, or a table is invalid.
    #[error("Hadamard tables: {0}")]
    Hadamard(String),
    /// Dimensions the kernel swizzle cannot express.
    #[error("QTIP trellis layout: {0}")]
    Layout(String),
    #[error(transparent)]
    Format(#[from] FormatError),
}

fn tensor_err(tensor: &str, msg: impl Into<String>) -> QtipError {
    QtipError::Tensor {
        tensor: tensor.to_string(),
        msg: msg.into(),
    }
}

// ---------------------------------------------------------------------------------------------
// quip_params

/// `config.json`'s `quip_params`, restricted to what can be imported: the layout of QTIP's
/// CUDA kernel (bitshift codebook, L = 16, 16×16 tiles, V = 2, `quantlut_sym` = HYB with a
/// `2^tlut_bits`-row table, K ∈ {2, 3, 4}).
#[derive(Debug, Clone, PartialEq)]
pub struct QuipParams {
    pub codebook: Option<String>,
    pub codebook_version: Option<Value>,
    pub l: u8,
    pub k: u8,
    pub v: u8,
    pub tlut_bits: u8,
    pub decode_mode: String,
    pub td_x: usize,
    pub td_y: usize,
    pub split_for_tp: bool,
    /// The object as found, for the container's provenance.
    pub raw: Value,
}

impl QuipParams {
    /// Parses and validates `quip_params` of a `config.json` value; `path` is for messages.
    pub fn from_config_json(config: &Value, path: &Path) -> Result<Self, QtipError> {
        let err = |field: &str, msg: String| QtipError::Params {
            path: path.to_path_buf(),
            field: if field.is_empty() {
                "quip_params".into()
            } else {
                format!("quip_params.{field}")
            },
            msg,
        };
        let q = match config.get("quip_params") {
            Some(Value::Object(o)) => o,
            None | Some(Value::Null) => {
                return Err(err(
                    "",
                    "missing: not a QTIP/YAQA checkpoint (config.json has no quip_params)".into(),
                ))
            }
            Some(other) => return Err(err("", format!("expected an object, found {other}"))),
        };
        let uint = |field: &str| -> Result<u64, QtipError> {
            match q.get(field) {
                None | Some(Value::Null) => Err(err(field, "missing".into())),
                Some(v) => v.as_u64().ok_or_else(|| {
                    err(field, format!("expected a non-negative integer, found {v}"))
                }),
            }
        };
        let string = |field: &str| -> Result<Option<String>, QtipError> {
            match q.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(v) => Err(err(field, format!("expected a string, found {v}"))),
            }
        };

        let codebook = string("codebook")?;
        if let Some(cb) = &codebook {
            // Only the bitshift trellis codebook has the tile streams described in §3.
            if !cb.contains("bitshift") {
                return Err(err(
                    "codebook",
                    format!("{cb:?}: only QTIP's bitshift trellis codebook can be imported"),
                ));
            }
        }
        let decode_mode =
            string("decode_mode")?.ok_or_else(|| err("decode_mode", "missing".into()))?;
        if decode_mode != "quantlut_sym" {
            let why = match decode_mode.as_str() {
                "1mad" | "2mad" | "3inst" | "lut" | "quantlut" => {
                    "QTIP has no CUDA kernel for this mode, so its checkpoints keep the non-kernel \
                     tile layout, which the format description does not specify"
                }
                _ => "unknown decode mode",
            };
            return Err(err(
                "decode_mode",
                format!("{decode_mode:?}: {why}; only \"quantlut_sym\" (HYB) can be imported"),
            ));
        }
        let l = uint("L")?;
        if l != 16 {
            return Err(err(
                "L",
                format!("{l}: only L = 16 (16-bit trellis states) is supported"),
            ));
        }
        let v = uint("V")?;
        if v != 2 {
            return Err(err(
                "V",
                format!("{v}: quantlut_sym (HYB) emits V = 2 values per step"),
            ));
        }
        let k = uint("K")?;
        if !(2..=4).contains(&k) {
            return Err(err(
                "K",
                format!("{k} bits per weight: QTIP's kernel layout exists for K = 2, 3, 4"),
            ));
        }
        let tlut_bits = uint("tlut_bits")?;
        if !(1..=15).contains(&tlut_bits) {
            return Err(err(
                "tlut_bits",
                format!("{tlut_bits}: the HYB table index takes 1 to 15 bits of the state"),
            ));
        }
        let td_x = uint("td_x")?;
        let td_y = uint("td_y")?;
        for (field, td) in [("td_x", td_x), ("td_y", td_y)] {
            if td != TILE_SIDE as u64 {
                return Err(err(
                    field,
                    format!("{td}: only 16×16 tiles (td_x = td_y = 16) are supported"),
                ));
            }
        }
        let split_for_tp = match q.get("split_for_tp") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                return Err(err(
                    "split_for_tp",
                    format!("expected a boolean, found {v}"),
                ))
            }
        };
        if split_for_tp {
            return Err(err(
                "split_for_tp",
                "true: tensor-parallel split checkpoints are not supported".into(),
            ));
        }
        match q.get("skip_list") {
            None | Some(Value::Null) => {}
            Some(Value::Array(a)) if a.is_empty() => {}
            Some(Value::Array(a)) => {
                // Skipped projections stay float; the trellis loader builds every projection
                // of a trellis-v1 container from trellis sections.
                return Err(err(
                    "skip_list",
                    format!(
                        "{} projection(s) kept in float ({}): mixed float/trellis models are not \
                         supported",
                        a.len(),
                        Value::Array(a.clone())
                    ),
                ));
            }
            Some(v) => return Err(err("skip_list", format!("expected a list, found {v}"))),
        }
        // Each value was range-checked above, so the narrowing casts are exact.
        Ok(Self {
            codebook,
            codebook_version: q.get("codebook_version").cloned(),
            l: l as u8,
            k: k as u8,
            v: v as u8,
            tlut_bits: tlut_bits as u8,
            decode_mode,
            td_x: td_x as usize,
            td_y: td_y as usize,
            split_for_tp,
            raw: Value::Object(q.clone()),
        })
    }

    /// The runtime scheme: HYB with `Q = tlut_bits`, L = 16, K bits, kernel tile order.
    pub fn scheme(&self) -> TrellisScheme {
        TrellisScheme {
            code: TrellisCode::Hyb { q: self.tlut_bits },
            l: self.l,
            k: self.k,
            order: TileOrder::Mma,
            rotation: crate::resident::Rotation::Full,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Kernel byte swizzle

/// Byte count of the tile streams of a `[rows, cols]` projection at `bits` per weight, after
/// checking the shape is one the kernel swizzle covers.
fn swizzle_len(rows: usize, cols: usize, bits: usize) -> Result<usize, QtipError> {
    if rows == 0
        || cols == 0
        || !rows.is_multiple_of(SUPERTILE_SIDE)
        || !cols.is_multiple_of(SUPERTILE_SIDE)
    {
        return Err(QtipError::Layout(format!(
            "[{rows}, {cols}] is not a non-empty multiple of {SUPERTILE_SIDE}×{SUPERTILE_SIDE} \
             (the kernel stores 16×16 tiles in 2×2 groups)"
        )));
    }
    if !(1..=8).contains(&bits) {
        return Err(QtipError::Layout(format!("{bits} bits per weight (1–8)")));
    }
    (rows / TILE_SIDE)
        .checked_mul(cols / TILE_SIDE)
        .and_then(|t| t.checked_mul(32 * bits))
        .ok_or_else(|| QtipError::Layout(format!("[{rows}, {cols}] overflows")))
}

/// Visits every stored byte position of the kernel swizzle in storage order, with the tile
/// (row-major tile index) and stream byte it holds. Storage order is
/// `(A, B, c, b, a, K−1−r)`: stored index `((((A·(cols/32)+B)·32 + c)·2 + b)·2 + a)·K + (K−1−r)`
/// holds byte `c·K + r` of tile `(2A+a, 2B+b)` (QTIP's kernel tile order).
fn for_each_swizzled(rows: usize, cols: usize, bits: usize, mut f: impl FnMut(usize, usize)) {
    let tile_bytes = 32 * bits;
    let tiles_per_row = cols / TILE_SIDE;
    let mut stored = 0;
    for big_a in 0..rows / SUPERTILE_SIDE {
        for big_b in 0..cols / SUPERTILE_SIDE {
            for c in 0..32 {
                for b in 0..2 {
                    for a in 0..2 {
                        let tile = (2 * big_a + a) * tiles_per_row + 2 * big_b + b;
                        let base = tile * tile_bytes + c * bits;
                        // Lane c's K bytes are stored in reverse order (K−1−r): the kernel
                        // loads them as one little-endian word and wants e[c·K] on top.
                        for r in (0..bits).rev() {
                            f(stored, base + r);
                            stored += 1;
                        }
                    }
                }
            }
        }
    }
}

/// QTIP kernel storage (the raw little-endian bytes of the int16 `trellis` tensor) → per-tile
/// big-endian streams (`32·bits` bytes each) in row-major tile order, as
/// [`TrellisQuantized`] stores them. `rows` = output dim, `cols` = input dim, both multiples
/// of 32.
pub fn unswizzle(
    bytes: &[u8],
    rows: usize,
    cols: usize,
    bits: usize,
) -> Result<Vec<u8>, QtipError> {
    let n = swizzle_len(rows, cols, bits)?;
    if bytes.len() != n {
        return Err(QtipError::Layout(format!(
            "{} bytes for [{rows}, {cols}] at {bits} bits per weight, expected {n}",
            bytes.len()
        )));
    }
    let mut out = vec![0u8; n];
    for_each_swizzled(rows, cols, bits, |stored, stream| {
        out[stream] = bytes[stored]
    });
    Ok(out)
}

/// Inverse of [`unswizzle`]: per-tile streams in row-major tile order → QTIP kernel storage.
pub fn swizzle(tiles: &[u8], rows: usize, cols: usize, bits: usize) -> Result<Vec<u8>, QtipError> {
    let n = swizzle_len(rows, cols, bits)?;
    if tiles.len() != n {
        return Err(QtipError::Layout(format!(
            "{} tile bytes for [{rows}, {cols}] at {bits} bits per weight, expected {n}",
            tiles.len()
        )));
    }
    let mut out = vec![0u8; n];
    for_each_swizzled(rows, cols, bits, |stored, stream| {
        out[stored] = tiles[stream]
    });
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Tensors

/// A borrowed safetensors tensor of any dtype (QTIP's `trellis` is int16, which the float
/// [`crate::TensorSource`] boundary does not carry).
#[derive(Debug, Clone, Copy)]
pub struct RawTensor<'a> {
    pub name: &'a str,
    pub dtype: StDtype,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

impl RawTensor<'_> {
    fn elements(&self) -> Option<usize> {
        self.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
    }

    /// Values of a float tensor (F32, F16, BF16) as f32.
    pub fn float_values(&self) -> Result<Vec<f32>, QtipError> {
        let size = match self.dtype {
            StDtype::F32 => 4,
            StDtype::F16 | StDtype::BF16 => 2,
            other => {
                return Err(tensor_err(
                    self.name,
                    format!("dtype {other:?}, expected a float tensor (F32, F16 or BF16)"),
                ))
            }
        };
        if self.elements().and_then(|n| n.checked_mul(size)) != Some(self.data.len()) {
            return Err(tensor_err(
                self.name,
                "byte length does not match dtype and shape",
            ));
        }
        Ok(match self.dtype {
            StDtype::F32 => self
                .data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            StDtype::F16 => self
                .data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            _ => self
                .data
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        })
    }

    /// The one value of an integer tensor of a single element (QTIP's `rcp`, `tp_rank`).
    fn int_scalar(&self) -> Option<i64> {
        if self.elements()? != 1 {
            return None;
        }
        let d = self.data;
        Some(match (self.dtype, d.len()) {
            (StDtype::U8, 1) => i64::from(d[0]),
            (StDtype::I8, 1) => i64::from(d[0] as i8),
            (StDtype::BOOL, 1) => i64::from(d[0]),
            (StDtype::I16, 2) => i64::from(i16::from_le_bytes([d[0], d[1]])),
            (StDtype::U16, 2) => i64::from(u16::from_le_bytes([d[0], d[1]])),
            (StDtype::I32, 4) => i64::from(i32::from_le_bytes([d[0], d[1], d[2], d[3]])),
            (StDtype::U32, 4) => i64::from(u32::from_le_bytes([d[0], d[1], d[2], d[3]])),
            (StDtype::I64, 8) | (StDtype::U64, 8) => {
                i64::from_le_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
            }
            _ => return None,
        })
    }
}

struct Entry {
    file: usize,
    dtype: StDtype,
    shape: Vec<usize>,
    range: Range<usize>,
}

/// The safetensors files of a QTIP checkpoint folder (single or sharded), memory-mapped,
/// with tensors of every dtype.
pub struct QtipTensors {
    maps: Vec<(PathBuf, Mmap)>,
    entries: BTreeMap<String, Entry>,
}

impl QtipTensors {
    /// `model.safetensors`, or the shards named by `model.safetensors.index.json`.
    pub fn open_dir(dir: &Path) -> Result<Self, QtipError> {
        let files = ShardIndex::read(dir)?.files;
        let mut maps = Vec::new();
        let mut entries = BTreeMap::new();
        for (i, path) in files.into_iter().enumerate() {
            let file = File::open(&path).map_err(|e| FormatError::io(&path, e))?;
            // SAFETY: opened read-only; like every mmap-based loader we assume the file is not
            // truncated by another process while mapped.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| FormatError::io(&path, e))?;
            // The crate validates the header (size cap, offsets in bounds, no overlaps, byte
            // lengths matching dtype × shape), so every range below lies inside the map.
            let st = SafeTensors::deserialize(&mmap).map_err(|e| {
                FormatError::invalid(&path, format!("invalid safetensors file: {e}"))
            })?;
            let base = mmap.as_ptr() as usize;
            for (name, view) in st.tensors() {
                let start = view.data().as_ptr() as usize - base;
                let entry = Entry {
                    file: i,
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    range: start..start + view.data().len(),
                };
                if entries.insert(name.clone(), entry).is_some() {
                    return Err(FormatError::invalid(
                        &path,
                        format!("tensor '{name}' appears in more than one shard"),
                    )
                    .into());
                }
            }
            maps.push((path, mmap));
        }
        Ok(Self { maps, entries })
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    pub fn get(&self, name: &str) -> Option<RawTensor<'_>> {
        let (key, e) = self.entries.get_key_value(name)?;
        Some(RawTensor {
            name: key,
            dtype: e.dtype,
            shape: &e.shape,
            data: &self.maps[e.file].1[e.range.clone()],
        })
    }

    fn require(&self, name: &str, why: &str) -> Result<RawTensor<'_>, QtipError> {
        self.get(name)
            .ok_or_else(|| tensor_err(name, format!("not found in the checkpoint ({why})")))
    }
}

// ---------------------------------------------------------------------------------------------
// One projection

/// The four tensors of one QTIP projection.
#[derive(Debug, Clone, Copy)]
pub struct QtipLinearTensors<'a> {
    pub trellis: RawTensor<'a>,
    pub su: RawTensor<'a>,
    pub sv: RawTensor<'a>,
    pub tlut: RawTensor<'a>,
}

/// Builds the runtime weight of one `[rows, cols]` projection from its QTIP tensors:
/// `trellis` unswizzled into row-major tile streams in [`TileOrder::Mma`], `SU` (any float
/// dtype, exactly ±1) as f16, `SV` (signs × Wscale) as f32, `tlut` as the f16 HYB table. The
/// Hadamard factors are the caller's (`had_in` of order dividing `cols`, `had_out` `rows`).
pub fn trellis_from_qtip(
    t: QtipLinearTensors<'_>,
    scheme: &TrellisScheme,
    rows: usize,
    cols: usize,
    had_in: SmallHadamard,
    had_out: SmallHadamard,
) -> Result<TrellisQuantized, QtipError> {
    let k = usize::from(scheme.k);
    let tr = t.trellis.name;
    let want_len = swizzle_len(rows, cols, k).map_err(|e| tensor_err(tr, e.to_string()))?;
    // `ceil(td_x·td_y·K / 16)` int16 words per tile = 16·K.
    let want_shape = [(rows / TILE_SIDE) * (cols / TILE_SIDE), TILE_SIDE * k];
    if t.trellis.dtype != StDtype::I16 || t.trellis.shape != want_shape {
        return Err(tensor_err(
            tr,
            format!(
                "{:?} {:?}, expected I16 {want_shape:?} for a [{rows}, {cols}] projection at K = {k}",
                t.trellis.dtype, t.trellis.shape
            ),
        ));
    }
    if t.trellis.data.len() != want_len {
        return Err(tensor_err(
            tr,
            format!("{} bytes, expected {want_len}", t.trellis.data.len()),
        ));
    }
    let tiles =
        unswizzle(t.trellis.data, rows, cols, k).map_err(|e| tensor_err(tr, e.to_string()))?;

    if t.su.shape != [cols] {
        return Err(tensor_err(
            t.su.name,
            format!("shape {:?}, expected [{cols}]", t.su.shape),
        ));
    }
    let su = t.su.float_values()?;
    if let Some(i) = su.iter().position(|&s| s != 1.0 && s != -1.0) {
        return Err(tensor_err(
            t.su.name,
            format!("SU[{i}] = {} is not ±1", su[i]),
        ));
    }
    let su = su.into_iter().map(half::f16::from_f32).collect();

    if t.sv.shape != [rows] {
        return Err(tensor_err(
            t.sv.name,
            format!("shape {:?}, expected [{rows}]", t.sv.shape),
        ));
    }
    let sv = t.sv.float_values()?;
    if let Some(i) = sv.iter().position(|s| !s.is_finite()) {
        return Err(tensor_err(
            t.sv.name,
            format!("SV[{i}] = {} is not finite", sv[i]),
        ));
    }

    let lut_rows = scheme.code.table_rows();
    if t.tlut.shape != [lut_rows, 2] {
        return Err(tensor_err(
            t.tlut.name,
            format!(
                "shape {:?}, expected [{lut_rows}, 2] (2^tlut_bits rows of V = 2)",
                t.tlut.shape
            ),
        ));
    }
    // F16 is QTIP's dtype and converts exactly; wider dtypes are rounded to f16 as the
    // runtime's table is f16.
    let tlut: Vec<half::f16> = t
        .tlut
        .float_values()?
        .into_iter()
        .map(half::f16::from_f32)
        .collect();
    if let Some(i) = tlut.iter().position(|v| !v.is_finite()) {
        return Err(tensor_err(
            t.tlut.name,
            format!("value {i} is not finite in f16"),
        ));
    }

    TrellisQuantized::from_parts(TrellisParts {
        scheme: *scheme,
        rows,
        cols,
        tiles,
        su,
        sv,
        tlut,
        had_in,
        had_out,
    })
    .map_err(|e| tensor_err(tr, e.to_string()))
}

// ---------------------------------------------------------------------------------------------
// Hadamard tables

/// User-supplied dense ±1 Hadamard factors by order (QTIP's `had_K`), for the dimensions that
/// are not powers of two. JSON: `{"36": [row, …], …}` with each row a list of ±1 numbers or a
/// string of `+`/`-` characters. Entry `[i][j]` is the matrix QTIP's forward transform
/// left-multiplies with after reshaping `x` to `(K, n/K)` and applying the Walsh–Hadamard
/// transform along the last axis (our `H_m` in `(H_m ⊗ H_{2^k})/√n`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HadamardTables {
    factors: BTreeMap<usize, SmallHadamard>,
}

impl HadamardTables {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one factor; power-of-two orders are rejected (QTIP uses the plain Walsh–Hadamard
    /// transform there, so a table would be ignored or, worse, silently differ).
    pub fn insert(&mut self, h: SmallHadamard) -> Result<(), QtipError> {
        let m = h.order();
        if m.is_power_of_two() {
            return Err(QtipError::Hadamard(format!(
                "order {m} is a power of two: those dimensions use the plain Walsh–Hadamard \
                 transform, remove the table"
            )));
        }
        if self.factors.insert(m, h).is_some() {
            return Err(QtipError::Hadamard(format!("order {m} given twice")));
        }
        Ok(())
    }

    pub fn orders(&self) -> impl Iterator<Item = usize> + '_ {
        self.factors.keys().copied()
    }

    /// Parses the JSON text of a tables file; `origin` names it in messages.
    pub fn from_json_str(text: &str, origin: &Path) -> Result<Self, QtipError> {
        let bad = |msg: String| QtipError::Hadamard(format!("{}: {msg}", origin.display()));
        let json: Value =
            serde_json::from_str(text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let obj = json
            .as_object()
            .ok_or_else(|| bad("expected an object mapping order → K×K ±1 matrix".into()))?;
        let mut tables = Self::new();
        for (key, rows) in obj {
            let m: usize = key
                .parse()
                .ok()
                .filter(|m| (2..=MAX_TABLE_ORDER).contains(m))
                .ok_or_else(|| {
                    bad(format!(
                        "key {key:?} is not an order in 2..={MAX_TABLE_ORDER}"
                    ))
                })?;
            let rows = rows
                .as_array()
                .filter(|r| r.len() == m)
                .ok_or_else(|| bad(format!("order {m}: expected a list of {m} rows")))?;
            let mut entries = Vec::with_capacity(m * m);
            for (i, row) in rows.iter().enumerate() {
                let before = entries.len();
                match row {
                    Value::String(s) => {
                        for ch in s.chars() {
                            entries.push(match ch {
                                '+' => 1i8,
                                '-' => -1,
                                _ => {
                                    return Err(bad(format!(
                                        "order {m} row {i}: character {ch:?} is not + or -"
                                    )))
                                }
                            });
                        }
                    }
                    Value::Array(vals) => {
                        for v in vals {
                            entries.push(match v.as_i64() {
                                Some(1) => 1i8,
                                Some(-1) => -1,
                                _ => {
                                    return Err(bad(format!(
                                        "order {m} row {i}: entry {v} is not ±1"
                                    )))
                                }
                            });
                        }
                    }
                    other => {
                        return Err(bad(format!(
                            "order {m} row {i}: expected a list or a +/- string, found {other}"
                        )))
                    }
                }
                if entries.len() - before != m {
                    return Err(bad(format!(
                        "order {m} row {i}: {} entries, expected {m}",
                        entries.len() - before
                    )));
                }
            }
            let h = SmallHadamard::new(m, entries).map_err(|e| bad(format!("order {m}: {e}")))?;
            tables.insert(h).map_err(|e| bad(e.to_string()))?;
        }
        Ok(tables)
    }

    /// Reads a tables file (size-checked before reading).
    pub fn from_file(path: &Path) -> Result<Self, QtipError> {
        let len = std::fs::metadata(path)
            .map_err(|e| FormatError::io(path, e))?
            .len();
        if len > MAX_TABLES_FILE_BYTES {
            return Err(QtipError::Hadamard(format!(
                "{}: {len} bytes (at most {MAX_TABLES_FILE_BYTES})",
                path.display()
            )));
        }
        let text = std::fs::read_to_string(path).map_err(|e| FormatError::io(path, e))?;
        Self::from_json_str(&text, path)
    }

    /// The factor for a transform of order `n`: identity for powers of two, else the one table
    /// whose order `m` divides `n` with `n/m` a power of two. `Err(Some(K))` names the missing
    /// order when it is one of QTIP's; `Err(None)` when none is known.
    fn factor_for(&self, n: usize) -> Result<Result<SmallHadamard, Option<usize>>, QtipError> {
        if n.is_power_of_two() {
            return Ok(Ok(SmallHadamard::unit()));
        }
        let fitting: Vec<&SmallHadamard> = self.factors.values().filter(|h| h.fits(n)).collect();
        match fitting[..] {
            [h] => Ok(Ok(h.clone())),
            [] => Ok(Err(QTIP_HADAMARD_ORDERS
                .iter()
                .copied()
                .find(|&k| n.is_multiple_of(k) && (n / k).is_power_of_two()))),
            _ => Err(QtipError::Hadamard(format!(
                "orders {:?} all fit dimension {n}; keep only the one the checkpoint was \
                 quantized with",
                fitting.iter().map(|h| h.order()).collect::<Vec<_>>()
            ))),
        }
    }

    /// Factors for every dimension in `dims`; one error listing every missing order.
    pub fn resolve(&self, dims: &[usize]) -> Result<BTreeMap<usize, SmallHadamard>, QtipError> {
        let mut out = BTreeMap::new();
        let mut missing = Vec::new();
        for &n in dims.iter().collect::<BTreeSet<_>>() {
            match self.factor_for(n)? {
                Ok(h) => {
                    out.insert(n, h);
                }
                Err(Some(k)) => missing.push(format!("K = {k} for dimension {n} = {k}·{}", n / k)),
                Err(None) => {
                    let odd = n >> n.trailing_zeros();
                    missing.push(format!(
                        "an order {odd}·2^j dividing dimension {n} (not one of QTIP's tables)"
                    ))
                }
            }
        }
        if !missing.is_empty() {
            return Err(QtipError::Hadamard(format!(
                "missing Hadamard matrices: {}. QTIP checkpoints do not store them; supply \
                 QTIP's K×K matrices with --hadamard-tables FILE (JSON {{\"K\": [K rows of ±1]}}; \
                 docs/format.md, \"QTIP/YAQA checkpoint import\")",
                missing.join("; ")
            )));
        }
        Ok(out)
    }
}

// ---------------------------------------------------------------------------------------------
// The whole checkpoint

/// A QTIP/YAQA Hugging Face folder: config, `quip_params`, tensors, tokenizer files.
pub struct QtipCheckpoint {
    pub dir: PathBuf,
    pub config: ModelConfig,
    pub params: QuipParams,
    pub tensors: QtipTensors,
    pub tokenizer_json: Option<String>,
    pub tokenizer_config: Option<Value>,
}

/// What an import wrote, for the CLI report and the container's `params.quant`.
#[derive(Debug, Clone, Default)]
pub struct QtipImportReport {
    /// Trellis projections written.
    pub linears: usize,
    /// Dense (float) sections written: embedding, norms, biases, untied head.
    pub dense_tensors: usize,
    /// Projections whose HYB table differs from the first one (stored per projection).
    pub own_tables: usize,
    /// Dense Hadamard factor orders stored (`resident.hadamard.{m}`).
    pub hadamard_orders: Vec<usize>,
    /// Resident bits per weight of the projections (tiles + f16 SU + f32 SV).
    pub linear_bits_per_weight: f64,
    /// Bytes of all sections written.
    pub bytes: u64,
    /// Checkpoint tensors not used (e.g. QTIP's `tp_rank` buffers).
    pub ignored_tensors: Vec<String>,
    /// `params` entries for the container metadata (`quant`).
    pub params: BTreeMap<String, Value>,
}

/// Projections of one decoder layer: HF name suffix, rows (out), cols (in), has q/k/v bias.
fn projections(c: &ModelConfig) -> [(&'static str, usize, usize, bool); 7] {
    let (h, q, kv, i) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let b = c.attention_bias;
    [
        ("self_attn.q_proj", q, h, b),
        ("self_attn.k_proj", kv, h, b),
        ("self_attn.v_proj", kv, h, b),
        ("self_attn.o_proj", h, q, false),
        ("mlp.gate_proj", i, h, false),
        ("mlp.up_proj", i, h, false),
        ("mlp.down_proj", h, i, false),
    ]
}

/// Section writer with the model-wide sections (HYB table, Hadamard factors) written once.
struct Out<'w> {
    writer: &'w mut SfxWriter,
    shared: BTreeMap<String, Vec<u8>>,
    report: QtipImportReport,
}

impl Out<'_> {
    fn put(&mut self, name: String, layout: Layout, bytes: &[u8]) -> Result<(), QtipError> {
        self.report.bytes += bytes.len() as u64;
        self.writer.add_section(
            SectionSpec::new(name, Tier::Resident, Codec::Raw, layout),
            bytes,
        )?;
        Ok(())
    }

    /// A float tensor copied in its source dtype (embedding, untied head), shape checked.
    fn dense_copy(&mut self, t: RawTensor<'_>, shape: &[usize]) -> Result<(), QtipError> {
        let dtype = match t.dtype {
            StDtype::F32 => DType::F32,
            StDtype::F16 => DType::F16,
            StDtype::BF16 => DType::BF16,
            other => {
                return Err(tensor_err(
                    t.name,
                    format!("dtype {other:?}, expected F32, F16 or BF16"),
                ))
            }
        };
        if t.shape != shape {
            return Err(tensor_err(
                t.name,
                format!("shape {:?}, expected {shape:?}", t.shape),
            ));
        }
        let layout = Layout::Dense {
            dtype,
            shape: shape.iter().map(|&d| d as u64).collect(),
        };
        self.report.dense_tensors += 1;
        self.put(t.name.to_string(), layout, t.data)
    }

    /// A vector (norm weight, bias) stored as F32, as `sfx-convert` writes them.
    fn dense_f32(&mut self, t: RawTensor<'_>, len: usize) -> Result<(), QtipError> {
        if t.shape != [len] {
            return Err(tensor_err(
                t.name,
                format!("shape {:?}, expected [{len}]", t.shape),
            ));
        }
        let v = t.float_values()?;
        let layout = Layout::Dense {
            dtype: DType::F32,
            shape: vec![len as u64],
        };
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.report.dense_tensors += 1;
        self.put(t.name.to_string(), layout, &bytes)
    }

    /// A trellis projection `p`: its own sections, then the shared ones on first use; a
    /// differing table becomes `p.weight.tlut` (the loader prefers it over `resident.tlut`).
    fn trellis(&mut self, p: &str, t: &TrellisQuantized) -> Result<(), QtipError> {
        let (own, shared) = trellis_sections(p, t);
        for (name, layout, bytes) in own {
            self.put(name, layout, &bytes)?;
        }
        for (name, layout, bytes) in shared {
            match self.shared.get(&name) {
                Some(b) if *b == bytes => {}
                Some(_) if name == TLUT_SECTION => {
                    self.report.own_tables += 1;
                    self.put(format!("{p}.weight.tlut"), layout, &bytes)?;
                }
                Some(_) => {
                    return Err(QtipError::Hadamard(format!(
                        "{name}: two different factors of one order"
                    )))
                }
                None => {
                    self.put(name.clone(), layout, &bytes)?;
                    self.shared.insert(name, bytes);
                }
            }
        }
        self.report.linears += 1;
        Ok(())
    }
}

impl QtipCheckpoint {
    /// Reads `config.json` (model config and `quip_params`), maps the safetensors files and
    /// reads the tokenizer files if present. Tensors are checked when written.
    pub fn open(dir: &Path) -> Result<Self, QtipError> {
        let config_path = dir.join("config.json");
        let json = read_optional_json(&config_path)?.ok_or_else(|| {
            FormatError::invalid(
                &config_path,
                "not found (a QTIP checkpoint folder has config.json)",
            )
        })?;
        let params = QuipParams::from_config_json(&json, &config_path)?;
        let config = ModelConfig::from_hf_json(&json, &config_path)?;
        let tensors = QtipTensors::open_dir(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            params,
            tensors,
            tokenizer_json: read_optional(&dir.join("tokenizer.json"))?,
            tokenizer_config: read_optional_json(&dir.join("tokenizer_config.json"))?,
        })
    }

    /// The distinct transform orders of the projections (input and output dims).
    pub fn transform_dims(&self) -> Vec<usize> {
        let c = &self.config;
        let set: BTreeSet<usize> = [c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size]
            .into_iter()
            .collect();
        set.into_iter().collect()
    }

    /// The weight of projection `p` (`model.layers.{i}.{proj}`), `[rows, cols]`.
    pub fn linear(
        &self,
        p: &str,
        rows: usize,
        cols: usize,
        factors: &BTreeMap<usize, SmallHadamard>,
    ) -> Result<TrellisQuantized, QtipError> {
        let ts = &self.tensors;
        let trellis_name = format!("{p}.trellis");
        let Some(trellis) = ts.get(&trellis_name) else {
            let hint = if ts.get(&format!("{p}.weight")).is_some() {
                format!(
                    "{p}.weight is stored in float; mixed float/trellis models are not supported"
                )
            } else if ts.names().any(|n| {
                n.contains("qkv_proj") || n.contains("upgate_proj") || n.contains("gate_up_proj")
            }) {
                "the checkpoint has fused projections (qkv/upgate), which are not supported".into()
            } else {
                "a QTIP checkpoint has P.trellis, P.SU, P.SV and P.tlut per projection".into()
            };
            return Err(tensor_err(
                &trellis_name,
                format!("not found in the checkpoint: {hint}"),
            ));
        };
        // Tensor-parallel variants store rows/columns split across ranks.
        if let Some(rcp) = ts.get(&format!("{p}.rcp")) {
            match rcp.int_scalar() {
                Some(0) => {}
                Some(v) => {
                    return Err(tensor_err(
                        rcp.name,
                        format!(
                            "{v}: tensor-parallel (row/column-split) layouts are not supported"
                        ),
                    ))
                }
                None => return Err(tensor_err(rcp.name, "expected one integer")),
            }
        }
        // hfize folds Wscale into SV; a separate Wscale means the layer files were not hfized
        // and SV would lack the scale.
        let wscale = format!("{p}.Wscale");
        if ts.get(&wscale).is_some() {
            return Err(tensor_err(
                &wscale,
                "present: expected an hfized checkpoint with Wscale folded into SV",
            ));
        }
        let factor = |n: usize| {
            factors
                .get(&n)
                .cloned()
                .ok_or_else(|| QtipError::Hadamard(format!("no factor resolved for dimension {n}")))
        };
        trellis_from_qtip(
            QtipLinearTensors {
                trellis,
                su: ts.require(&format!("{p}.SU"), "input signs")?,
                sv: ts.require(&format!("{p}.SV"), "output signs × scale")?,
                tlut: ts.require(&format!("{p}.tlut"), "HYB lookup table")?,
            },
            &self.params.scheme(),
            rows,
            cols,
            factor(cols)?,
            factor(rows)?,
        )
    }

    /// Writes every model section to `writer` (the caller writes the metadata and finishes
    /// the file): the embedding, norms, biases and untied head as dense sections (norms and
    /// biases F32, the rest in the source dtype, as `sfx-convert` does), the projections as
    /// trellis sections. Hadamard factors are resolved first, so a missing table fails before
    /// anything is written. `on_layer(done, total)` after every decoder layer.
    pub fn write_sfx(
        &self,
        tables: &HadamardTables,
        writer: &mut SfxWriter,
        on_layer: &mut dyn FnMut(usize, usize),
    ) -> Result<QtipImportReport, QtipError> {
        let c = &self.config;
        let factors = tables.resolve(&self.transform_dims())?;
        if self.tensors.get("lm_head.trellis").is_some() {
            return Err(tensor_err(
                "lm_head.trellis",
                "a quantized output head is not supported (the runtime keeps the head float)",
            ));
        }
        let ts = &self.tensors;
        let mut out = Out {
            writer,
            shared: BTreeMap::new(),
            report: QtipImportReport::default(),
        };
        let mut used: BTreeSet<String> = BTreeSet::new();
        let mut mark = |names: &[String]| used.extend(names.iter().cloned());

        let embed = ts.require("model.embed_tokens.weight", "token embedding")?;
        out.dense_copy(embed, &[c.vocab_size, c.hidden_size])?;
        mark(&["model.embed_tokens.weight".into()]);
        let (mut code_bits, mut weights) = (0u64, 0u64);
        for l in 0..c.num_hidden_layers {
            let pre = format!("model.layers.{l}");
            let mut norms = vec![
                ("input_layernorm", c.hidden_size),
                ("post_attention_layernorm", c.hidden_size),
            ];
            if c.qk_norm {
                norms.push(("self_attn.q_norm", c.head_dim));
                norms.push(("self_attn.k_norm", c.head_dim));
            }
            for (n, len) in norms {
                let name = format!("{pre}.{n}.weight");
                out.dense_f32(ts.require(&name, "RMSNorm weight")?, len)?;
                mark(&[name]);
            }
            for (proj, rows, cols, bias) in projections(c) {
                let p = format!("{pre}.{proj}");
                if bias {
                    let name = format!("{p}.bias");
                    out.dense_f32(ts.require(&name, "projection bias (attention_bias)")?, rows)?;
                    mark(&[name]);
                }
                let t = self.linear(&p, rows, cols, &factors)?;
                code_bits += 8 * t.size_in_bytes() as u64;
                weights += (rows * cols) as u64;
                out.trellis(&p, &t)?;
                mark(&["trellis", "SU", "SV", "tlut", "rcp"].map(|s| format!("{p}.{s}")));
            }
            on_layer(l + 1, c.num_hidden_layers);
        }
        let norm = "model.norm.weight";
        out.dense_f32(ts.require(norm, "final RMSNorm weight")?, c.hidden_size)?;
        mark(&[norm.into()]);
        if !c.tie_word_embeddings {
            let head = ts.require(
                "lm_head.weight",
                "untied output head (tie_word_embeddings = false)",
            )?;
            out.dense_copy(head, &[c.vocab_size, c.hidden_size])?;
            mark(&["lm_head.weight".into()]);
        }

        let mut report = out.report;
        report.ignored_tensors = ts
            .names()
            .filter(|n| !used.contains(*n))
            .map(String::from)
            .collect();
        report.hadamard_orders = factors
            .values()
            .map(SmallHadamard::order)
            .filter(|&m| m > 1)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        report.linear_bits_per_weight = code_bits as f64 / weights.max(1) as f64;
        let scheme = self.params.scheme();
        report.params.insert(
            "quant".into(),
            json!({
                "name": format!("qtip{}-import", scheme.k),
                "method": "qtip-import",
                "bits": scheme.k,
                "group": null,
                "packing": "trellis-v1",
                "code": scheme.code.name(),
                "l": scheme.l,
                "v": scheme.v(),
                "tile_order": scheme.order.name(),
                "bits_per_weight": report.linear_bits_per_weight,
                "hadamard_orders": report.hadamard_orders,
                "quip_params": self.params.raw,
            }),
        );
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg_bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (s >> 56) as u8
            })
            .collect()
    }

    #[test]
    fn swizzle_and_unswizzle_are_inverses() {
        for (rows, cols) in [(32, 32), (32, 64), (64, 96), (96, 32)] {
            for bits in 1..=4 {
                let n = rows * cols * bits / 8;
                let tiles = lcg_bytes(n, (rows * 1000 + cols * 10 + bits) as u64);
                let stored = swizzle(&tiles, rows, cols, bits).unwrap();
                assert_ne!(
                    stored, tiles,
                    "the swizzle must move bytes ({rows}×{cols}, K{bits})"
                );
                assert_eq!(unswizzle(&stored, rows, cols, bits).unwrap(), tiles);
                assert_eq!(
                    swizzle(
                        &unswizzle(&tiles, rows, cols, bits).unwrap(),
                        rows,
                        cols,
                        bits
                    )
                    .unwrap(),
                    tiles
                );
            }
        }
    }

    /// Positions worked out by hand from the storage order (`for_each_swizzled`) for K = 2,
    /// rows = 32, cols = 64 (tiles 2×4, 64 bytes each, cols/32 = 2 column groups):
    /// index = ((((A·2 + B)·32 + c)·2 + b)·2 + a)·2 + (1 − r).
    #[test]
    fn hand_computed_positions_k2_32x64() {
        let (rows, cols, bits) = (32, 64, 2);
        // (tile row, tile col, stream byte c·K + r, stored index)
        let cases = [
            (0, 0, 0, 1),    // A=B=a=b=c=r=0 → 0·2 + 1
            (0, 0, 1, 0),    // r = 1 → 1 − 1 = 0
            (1, 0, 0, 3),    // a = 1 → (1)·2 + 1
            (0, 1, 0, 5),    // b = 1 → ((1)·2 + 0)·2 + 1
            (1, 1, 0, 7),    // a = b = 1 → ((1)·2 + 1)·2 + 1
            (0, 0, 2, 9),    // c = 1: ((1·2)·2)·2 + 1
            (1, 2, 10, 299), // A=0 a=1 B=1 b=0, c=5 r=0: (((1·32+5)·2+0)·2+1)·2+1
            (0, 3, 63, 508), // A=0 a=0 B=1 b=1, c=31 r=1: (((1·32+31)·2+1)·2+0)·2+0
            (1, 3, 62, 511), // last group, c=31 r=0, a=b=1: (((63)·2+1)·2+1)·2+1
        ];
        for (tr, tc, j, want) in cases {
            let mut tiles = vec![0u8; rows * cols * bits / 8];
            tiles[(tr * 4 + tc) * 64 + j] = 0xA5;
            let stored = swizzle(&tiles, rows, cols, bits).unwrap();
            let at: Vec<usize> = stored
                .iter()
                .enumerate()
                .filter(|(_, &b)| b == 0xA5)
                .map(|(i, _)| i)
                .collect();
            assert_eq!(at, vec![want], "tile ({tr}, {tc}) byte {j}");
        }
    }

    #[test]
    fn swizzle_rejects_shapes_outside_2x2_tile_groups() {
        let e = unswizzle(&[0; 16 * 32 * 2 / 8], 16, 32, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("multiple of 32"), "{e}");
        let e = unswizzle(&[0; 10], 32, 32, 2).unwrap_err().to_string();
        assert!(e.contains("expected 256"), "{e}");
    }

    fn params() -> Value {
        json!({"quip_params": {"codebook": "bitshift", "codebook_version": 0, "L": 16, "K": 2,
            "V": 2, "tlut_bits": 9, "decode_mode": "quantlut_sym", "td_x": 16, "td_y": 16,
            "split_for_tp": false, "skip_list": null}})
    }

    fn parse_err(edit: impl FnOnce(&mut serde_json::Map<String, Value>)) -> String {
        let mut v = params();
        edit(v["quip_params"].as_object_mut().unwrap());
        QuipParams::from_config_json(&v, Path::new("config.json"))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn quip_params_parse_and_map_to_the_kernel_scheme() {
        let p = QuipParams::from_config_json(&params(), Path::new("c.json")).unwrap();
        assert_eq!(
            p.scheme(),
            TrellisScheme {
                code: TrellisCode::Hyb { q: 9 },
                l: 16,
                k: 2,
                order: TileOrder::Mma,
                rotation: crate::resident::Rotation::Full,
            }
        );
        let e = QuipParams::from_config_json(&json!({"model_type": "llama"}), Path::new("c.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("quip_params") && e.contains("missing"), "{e}");
    }

    #[test]
    fn unsupported_quip_params_name_field_and_value() {
        let e = parse_err(|q| {
            q.insert("decode_mode".into(), json!("1mad"));
        });
        assert!(
            e.contains("quip_params.decode_mode") && e.contains("1mad"),
            "{e}"
        );
        let e = parse_err(|q| {
            q.insert("L".into(), json!(12));
        });
        assert!(e.contains("quip_params.L") && e.contains("12"), "{e}");
        let e = parse_err(|q| {
            q.insert("td_y".into(), json!(8));
        });
        assert!(e.contains("quip_params.td_y") && e.contains('8'), "{e}");
        let e = parse_err(|q| {
            q.insert("K".into(), json!(5));
        });
        assert!(e.contains("quip_params.K") && e.contains('5'), "{e}");
        let e = parse_err(|q| {
            q.insert("V".into(), json!(1));
        });
        assert!(e.contains("quip_params.V"), "{e}");
        let e = parse_err(|q| {
            q.remove("tlut_bits");
        });
        assert!(
            e.contains("quip_params.tlut_bits") && e.contains("missing"),
            "{e}"
        );
        let e = parse_err(|q| {
            q.insert("K".into(), json!("two"));
        });
        assert!(e.contains("quip_params.K") && e.contains("integer"), "{e}");
        let e = parse_err(|q| {
            q.insert("split_for_tp".into(), json!(true));
        });
        assert!(e.contains("quip_params.split_for_tp"), "{e}");
        let e = parse_err(|q| {
            q.insert("skip_list".into(), json!(["model.layers.0.mlp.down_proj"]));
        });
        assert!(
            e.contains("quip_params.skip_list") && e.contains("down_proj"),
            "{e}"
        );
        let e = parse_err(|q| {
            q.insert("codebook".into(), json!("e8p"));
        });
        assert!(e.contains("quip_params.codebook"), "{e}");
    }

    /// Paley I of order 12 (q = 11): H = I + S, S the skew conference matrix built from the
    /// quadratic residues mod 11; rows as `+`/`-` strings.
    fn paley12() -> Vec<String> {
        let chi = |a: usize| -> i8 {
            match a % 11 {
                0 => 0,
                a if (1..11usize).any(|x| x * x % 11 == a) => 1,
                _ => -1,
            }
        };
        (0..12)
            .map(|i| {
                (0..12)
                    .map(|j| {
                        let s = match (i, j) {
                            _ if i == j => 1,
                            (0, _) => 1,
                            (_, 0) => -1,
                            _ => chi(11 + j - i),
                        };
                        if s > 0 {
                            '+'
                        } else {
                            '-'
                        }
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn hadamard_tables_parse_validate_and_resolve() {
        let origin = Path::new("t.json");
        let e = HadamardTables::new()
            .resolve(&[64, 96, 576])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("K = 12 for dimension 96") && e.contains("K = 36 for dimension 576"),
            "{e}"
        );
        assert!(!e.contains("dimension 64"), "{e}");

        let tables =
            HadamardTables::from_json_str(&json!({"12": paley12()}).to_string(), origin).unwrap();
        let f = tables.resolve(&[64, 96, 192]).unwrap();
        assert_eq!(f[&64].order(), 1);
        assert_eq!(f[&96].order(), 12);
        assert_eq!(f[&192].order(), 12);
        let e = tables.resolve(&[96, 576]).unwrap_err().to_string();
        assert!(
            e.contains("K = 36 for dimension 576") && !e.contains("dimension 96"),
            "{e}"
        );

        // The same matrix as numbers parses to the same factor.
        let numeric: Vec<Vec<i32>> = paley12()
            .iter()
            .map(|r| r.chars().map(|c| if c == '+' { 1 } else { -1 }).collect())
            .collect();
        assert_eq!(
            HadamardTables::from_json_str(&json!({"12": numeric}).to_string(), origin).unwrap(),
            tables
        );

        let e = HadamardTables::from_json_str(&json!({"2": ["++", "+-"]}).to_string(), origin)
            .unwrap_err()
            .to_string();
        assert!(e.contains("power of two"), "{e}");
        let e = HadamardTables::from_json_str(r#"{"12": [[1, 1]]}"#, origin)
            .unwrap_err()
            .to_string();
        assert!(e.contains("order 12") && e.contains("12 rows"), "{e}");
        let e = HadamardTables::from_json_str(
            &json!({"12": vec!["++++++++++++"; 12]}).to_string(),
            origin,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("not orthogonal"), "{e}");
        let mut bad = paley12();
        bad[3] = bad[3].replacen('+', "x", 1);
        let e = HadamardTables::from_json_str(&json!({"12": bad}).to_string(), origin)
            .unwrap_err()
            .to_string();
        assert!(e.contains("row 3") && e.contains("'x'"), "{e}");
    }
}

//! Memory-mapped GGUF reader (versions 2 and 3, little-endian).
//!
//! Layout (ggml `docs/gguf.md`): magic "GGUF", u32 version, u64 tensor count, u64 metadata
//! count, the metadata key/value pairs, the tensor infos, padding to `general.alignment`
//! (default 32), then the tensor data. Nothing read from the file is trusted: every length
//! and count is checked against the bytes that remain before anything is allocated, tensor
//! element counts are computed with overflow checks, and tensor byte ranges must be aligned,
//! inside the file and disjoint.

use super::dequant::{dequantize, GgmlType};
use super::GgufError;
use memmap2::Mmap;
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};

pub const GGUF_MAGIC: &[u8; 4] = b"GGUF";
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most 4 dimensions.
pub const MAX_DIMS: usize = 4;
/// Arrays of arrays deeper than this are rejected (no real file nests more than 1 level; the
/// cap keeps the recursive parser's stack bounded on hostile input).
pub const MAX_ARRAY_DEPTH: usize = 8;

/// GGUF metadata value types (the u32 tags of the file format).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    fn from_id(id: u32) -> Option<Self> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }

    /// The fewest bytes one value of this type occupies in the file (a string or array is
    /// at least its length/header), used to bound counts before allocating.
    fn min_encoded_size(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(MetaArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A homogeneous metadata array. Stored typed (not as `Vec<MetaValue>`) so memory stays
/// proportional to the file's bytes.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<MetaArray>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl MetaValue {
    pub fn type_name(&self) -> String {
        match self {
            MetaValue::Array(a) => format!("array of {}", a.elem_type().name()),
            other => other.value_type().name().to_string(),
        }
    }

    pub fn value_type(&self) -> ValueType {
        match self {
            MetaValue::U8(_) => ValueType::U8,
            MetaValue::I8(_) => ValueType::I8,
            MetaValue::U16(_) => ValueType::U16,
            MetaValue::I16(_) => ValueType::I16,
            MetaValue::U32(_) => ValueType::U32,
            MetaValue::I32(_) => ValueType::I32,
            MetaValue::F32(_) => ValueType::F32,
            MetaValue::Bool(_) => ValueType::Bool,
            MetaValue::String(_) => ValueType::String,
            MetaValue::Array(_) => ValueType::Array,
            MetaValue::U64(_) => ValueType::U64,
            MetaValue::I64(_) => ValueType::I64,
            MetaValue::F64(_) => ValueType::F64,
        }
    }

    /// The value as an integer when it is one (of any width).
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(v) => v.into(),
            MetaValue::I8(v) => v.into(),
            MetaValue::U16(v) => v.into(),
            MetaValue::I16(v) => v.into(),
            MetaValue::U32(v) => v.into(),
            MetaValue::I32(v) => v.into(),
            MetaValue::U64(v) => v.into(),
            MetaValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value as a float when it is a float (f32 widened exactly).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => None,
        }
    }
}

impl MetaArray {
    pub fn elem_type(&self) -> ValueType {
        match self {
            MetaArray::U8(_) => ValueType::U8,
            MetaArray::I8(_) => ValueType::I8,
            MetaArray::U16(_) => ValueType::U16,
            MetaArray::I16(_) => ValueType::I16,
            MetaArray::U32(_) => ValueType::U32,
            MetaArray::I32(_) => ValueType::I32,
            MetaArray::F32(_) => ValueType::F32,
            MetaArray::Bool(_) => ValueType::Bool,
            MetaArray::String(_) => ValueType::String,
            MetaArray::Array(_) => ValueType::Array,
            MetaArray::U64(_) => ValueType::U64,
            MetaArray::I64(_) => ValueType::I64,
            MetaArray::F64(_) => ValueType::F64,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            MetaArray::U8(v) => v.len(),
            MetaArray::I8(v) => v.len(),
            MetaArray::U16(v) => v.len(),
            MetaArray::I16(v) => v.len(),
            MetaArray::U32(v) => v.len(),
            MetaArray::I32(v) => v.len(),
            MetaArray::F32(v) => v.len(),
            MetaArray::Bool(v) => v.len(),
            MetaArray::String(v) => v.len(),
            MetaArray::Array(v) => v.len(),
            MetaArray::U64(v) => v.len(),
            MetaArray::I64(v) => v.len(),
            MetaArray::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Integer arrays of any width, widened.
    pub fn to_i128_vec(&self) -> Option<Vec<i128>> {
        fn w<T: Copy + Into<i128>>(v: &[T]) -> Vec<i128> {
            v.iter().map(|&x| x.into()).collect()
        }
        Some(match self {
            MetaArray::U8(v) => w(v),
            MetaArray::I8(v) => w(v),
            MetaArray::U16(v) => w(v),
            MetaArray::I16(v) => w(v),
            MetaArray::U32(v) => w(v),
            MetaArray::I32(v) => w(v),
            MetaArray::U64(v) => w(v),
            MetaArray::I64(v) => w(v),
            _ => return None,
        })
    }
}

/// One tensor's description from the header.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// GGUF order: `dims[0]` is the contiguous (innermost) dimension.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset of the data relative to the start of the data section.
    pub offset: u64,
    pub n_elements: usize,
    pub n_bytes: usize,
}

impl GgufTensorInfo {
    /// Row-major shape, outermost first (PyTorch / safetensors order): `dims` reversed.
    pub fn shape(&self) -> Vec<usize> {
        // Each dim fits in usize: their product does (checked when the header was parsed).
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// An open, validated GGUF file. Tensor data stays in the memory map until asked for.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_start: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Opens and validates `path`. Errors name the file and what is wrong with it.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref().to_path_buf();
        let io = |e| GgufError::Io {
            path: path.clone(),
            source: e,
        };
        let file = File::open(&path).map_err(io)?;
        // SAFETY: the map is read-only; like every mmap-based model loader we rely on the
        // file not being truncated or rewritten while it is open.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let header = parse_header(&mmap).map_err(|e| GgufError::InFile {
            path: path.clone(),
            source: Box::new(e),
        })?;
        Ok(GgufFile {
            path,
            mmap,
            version: header.version,
            meta_index: header
                .metadata
                .iter()
                .enumerate()
                .map(|(i, (k, _))| (k.clone(), i))
                .collect(),
            metadata: header.metadata,
            tensor_index: header
                .tensors
                .iter()
                .enumerate()
                .map(|(i, t)| (t.name.clone(), i))
                .collect(),
            tensors: header.tensors,
            alignment: header.alignment,
            data_start: header.data_start,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset of the data section.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    /// The whole file's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.mmap
    }

    /// Metadata in file order.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&MetaValue, GgufError> {
        self.get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    fn wrong(key: &str, expected: &'static str, v: &MetaValue) -> GgufError {
        GgufError::WrongType {
            key: key.to_string(),
            expected,
            found: v.type_name(),
        }
    }

    fn int<T: TryFrom<i128>>(
        &self,
        key: &str,
        expected: &'static str,
    ) -> Result<Option<T>, GgufError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let i = v.as_i128().ok_or_else(|| Self::wrong(key, expected, v))?;
        T::try_from(i)
            .map(Some)
            .map_err(|_| GgufError::metadata(key, format!("value {i} does not fit in {expected}")))
    }

    /// An integer of any stored width that fits in u32.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        self.opt_u32(key)?
            .ok_or_else(|| GgufError::MissingKey(key.into()))
    }

    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>, GgufError> {
        self.int(key, "u32")
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.opt_u64(key)?
            .ok_or_else(|| GgufError::MissingKey(key.into()))
    }

    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.int(key, "u64")
    }

    pub fn get_i64(&self, key: &str) -> Result<i64, GgufError> {
        self.int(key, "i64")?
            .ok_or_else(|| GgufError::MissingKey(key.into()))
    }

    /// An f32 (or f64 narrowed) value.
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        self.opt_f32(key)?
            .ok_or_else(|| GgufError::MissingKey(key.into()))
    }

    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::F32(v)) => Ok(Some(*v)),
            Some(MetaValue::F64(v)) => Ok(Some(*v as f32)),
            Some(v) => Err(Self::wrong(key, "f32", v)),
        }
    }

    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        let v = self.require(key)?;
        v.as_f64().ok_or_else(|| Self::wrong(key, "f64", v))
    }

    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        self.opt_bool(key)?
            .ok_or_else(|| GgufError::MissingKey(key.into()))
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(Self::wrong(key, "bool", v)),
        }
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        self.opt_str(key)?
            .ok_or_else(|| GgufError::MissingKey(key.into()))
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::String(s)) => Ok(Some(s)),
            Some(v) => Err(Self::wrong(key, "string", v)),
        }
    }

    pub fn get_array(&self, key: &str) -> Result<&MetaArray, GgufError> {
        match self.require(key)? {
            MetaValue::Array(a) => Ok(a),
            v => Err(Self::wrong(key, "array", v)),
        }
    }

    pub fn get_str_array(&self, key: &str) -> Result<&[String], GgufError> {
        match self.require(key)? {
            MetaValue::Array(MetaArray::String(v)) => Ok(v),
            // An empty array of another element type is still an empty list of strings.
            MetaValue::Array(a) if a.is_empty() => Ok(&[]),
            v => Err(Self::wrong(key, "array of string", v)),
        }
    }

    /// An array of integers of any width, widened to i64.
    pub fn get_int_array(&self, key: &str) -> Result<Vec<i64>, GgufError> {
        let v = self.require(key)?;
        let MetaValue::Array(a) = v else {
            return Err(Self::wrong(key, "array of integers", v));
        };
        let wide = a
            .to_i128_vec()
            .ok_or_else(|| Self::wrong(key, "array of integers", v))?;
        wide.into_iter()
            .enumerate()
            .map(|(i, x)| {
                i64::try_from(x).map_err(|_| {
                    GgufError::metadata(key, format!("element {i} = {x} does not fit in i64"))
                })
            })
            .collect()
    }

    pub fn get_f32_array(&self, key: &str) -> Result<&[f32], GgufError> {
        match self.require(key)? {
            MetaValue::Array(MetaArray::F32(v)) => Ok(v),
            v => Err(Self::wrong(key, "array of f32", v)),
        }
    }

    /// Tensor infos in header order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// A tensor's raw bytes. Infos from [`GgufFile::tensors`] were validated at open to lie
    /// inside the file; a hand-made info that does not is an error, not a panic.
    pub fn tensor_bytes(&self, info: &GgufTensorInfo) -> Result<&[u8], GgufError> {
        let range = self
            .data_start
            .checked_add(info.offset)
            .and_then(|start| Some((start as usize, (start as usize).checked_add(info.n_bytes)?)));
        range
            .and_then(|(start, end)| self.mmap.get(start..end))
            .ok_or_else(|| GgufError::tensor(&info.name, "data range lies outside the file"))
    }

    /// Dequantizes a tensor to f32 in storage order (row-major over [`GgufTensorInfo::shape`]).
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>, GgufError> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| GgufError::MissingTensor(name.to_string()))?;
        self.dequantize_info(info)
    }

    pub fn dequantize_info(&self, info: &GgufTensorInfo) -> Result<Vec<f32>, GgufError> {
        let mut out = Vec::new();
        out.try_reserve_exact(info.n_elements).map_err(|_| {
            GgufError::tensor(
                &info.name,
                format!("cannot allocate {} f32 values", info.n_elements),
            )
        })?;
        out.resize(info.n_elements, 0.0);
        dequantize(
            info.ggml_type,
            self.tensor_bytes(info)?,
            info.n_elements,
            &mut out,
        )
        .map_err(|e| GgufError::tensor(&info.name, e.to_string()))?;
        Ok(out)
    }
}

struct Header {
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<GgufTensorInfo>,
    alignment: u64,
    data_start: u64,
}

/// Bounds-checked little-endian cursor over the file.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::truncated(
                what(),
                self.pos as u64,
                n,
                self.buf.len() as u64,
            ));
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn arr<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        Ok(s.try_into().expect("take returned N bytes"))
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }

    /// A gguf_string: u64 length + UTF-8 bytes.
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let len = self.u64(&|| format!("length of {}", what()))?;
        let at = self.pos;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| {
            GgufError::Header(format!("{} at byte {at} is not valid UTF-8 ({e})", what()))
        })
    }

    /// A count of items about to be read, each at least `min_size` bytes: rejected before
    /// any allocation if the remaining bytes cannot hold that many.
    fn count(&mut self, min_size: u64, what: &dyn Fn() -> String) -> Result<usize, GgufError> {
        let at = self.pos as u64;
        let n = self.u64(&|| format!("count of {}", what()))?;
        let need = n.checked_mul(min_size);
        match need {
            Some(need) if need <= self.remaining() => Ok(n as usize),
            _ => Err(GgufError::Header(format!(
                "{} count {n} at byte {at} cannot fit in the {} bytes that remain",
                what(),
                self.remaining()
            ))),
        }
    }
}

fn parse_header(buf: &[u8]) -> Result<Header, GgufError> {
    let mut c = Cursor { buf, pos: 0 };
    let magic: [u8; 4] = c.arr(&|| "magic".into())?;
    if &magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = c.u32(&|| "version".into())?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion(version));
    }
    // Tensor infos are at least 8 (name) + 4 (n_dims) + 4 (type) + 8 (offset) bytes; metadata
    // pairs at least 8 (key) + 4 (type) + 1 (value). Checked when each count is used below,
    // against what remains at that point.
    let tensor_count_raw = c.u64(&|| "tensor count".into())?;
    let kv_count = c.count(13, &|| "metadata key/value".into())?;

    let mut metadata: Vec<(String, MetaValue)> = Vec::with_capacity(kv_count);
    let mut seen: HashSet<String> = HashSet::with_capacity(kv_count);
    for i in 0..kv_count {
        let key = c.string(&|| format!("metadata key #{i}"))?;
        let ty_at = c.pos;
        let ty_id = c.u32(&|| format!("type of metadata key '{key}'"))?;
        let ty = ValueType::from_id(ty_id).ok_or_else(|| {
            GgufError::metadata(&key, format!("unknown value type {ty_id} at byte {ty_at}"))
        })?;
        let value = read_value(&mut c, ty, &key, 0)?;
        if !seen.insert(key.clone()) {
            return Err(GgufError::metadata(&key, "duplicate key"));
        }
        metadata.push((key, value));
    }

    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, MetaValue::U32(a))) if *a > 0 && a.is_power_of_two() => u64::from(*a),
        Some((_, v)) => {
            return Err(GgufError::metadata(
                "general.alignment",
                format!("must be a power-of-two u32, found {v:?}"),
            ))
        }
    };

    if tensor_count_raw
        .checked_mul(24)
        .is_none_or(|need| need > c.remaining())
    {
        return Err(GgufError::Header(format!(
            "tensor count {tensor_count_raw} cannot fit in the {} bytes that remain",
            c.remaining()
        )));
    }
    let tensor_count = tensor_count_raw as usize;
    let mut tensors = Vec::with_capacity(tensor_count);
    let mut names: HashSet<String> = HashSet::with_capacity(tensor_count);
    for i in 0..tensor_count {
        let name = c.string(&|| format!("name of tensor #{i}"))?;
        let n_dims = c.u32(&|| format!("dimension count of tensor '{name}'"))? as usize;
        if n_dims > MAX_DIMS {
            return Err(GgufError::tensor(
                &name,
                format!("{n_dims} dimensions (ggml supports at most {MAX_DIMS})"),
            ));
        }
        let mut dims = Vec::with_capacity(n_dims);
        for d in 0..n_dims {
            dims.push(c.u64(&|| format!("dimension {d} of tensor '{name}'"))?);
        }
        let ty_id = c.u32(&|| format!("type of tensor '{name}'"))?;
        let offset = c.u64(&|| format!("data offset of tensor '{name}'"))?;
        let ggml_type = GgmlType::from_id(ty_id).ok_or_else(|| GgufError::UnknownGgmlType {
            tensor: name.clone(),
            id: ty_id,
        })?;
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= isize::MAX as u64)
            .ok_or_else(|| {
                GgufError::tensor(
                    &name,
                    format!("dimensions {dims:?}: element count overflows"),
                )
            })?;
        // A tensor of no dimensions is one element: one row of length 1.
        let row_len = dims.first().copied().unwrap_or(1);
        if row_len % ggml_type.block_size() as u64 != 0 {
            return Err(GgufError::tensor(
                &name,
                format!(
                    "row length {row_len} is not a multiple of the {ggml_type} block size {}",
                    ggml_type.block_size()
                ),
            ));
        }
        let n_bytes = ggml_type
            .bytes_for(n_elements)
            .filter(|&n| n <= isize::MAX as u64)
            .ok_or_else(|| {
                GgufError::tensor(&name, format!("dimensions {dims:?}: byte size overflows"))
            })?;
        if offset % alignment != 0 {
            return Err(GgufError::tensor(
                &name,
                format!("data offset {offset} is not a multiple of the alignment {alignment}"),
            ));
        }
        if !names.insert(name.clone()) {
            return Err(GgufError::tensor(&name, "duplicate tensor name"));
        }
        tensors.push(GgufTensorInfo {
            name,
            dims,
            ggml_type,
            offset,
            n_elements: n_elements as usize,
            n_bytes: n_bytes as usize,
        });
    }

    let header_end = c.pos as u64;
    let file_len = buf.len() as u64;
    let data_start = header_end.next_multiple_of(alignment);
    if !tensors.is_empty() && data_start > file_len {
        return Err(GgufError::truncated(
            "padding before the tensor data",
            header_end,
            data_start - header_end,
            file_len,
        ));
    }
    let data_len = file_len.saturating_sub(data_start);
    for t in &tensors {
        let end = t.offset.checked_add(t.n_bytes as u64);
        if end.is_none_or(|end| end > data_len) {
            return Err(GgufError::tensor(
                &t.name,
                format!(
                    "data range {}..{} (+{} bytes at offset {}) lies beyond the end of the file ({} data bytes)",
                    data_start.saturating_add(t.offset),
                    data_start.saturating_add(t.offset).saturating_add(t.n_bytes as u64),
                    t.n_bytes,
                    t.offset,
                    data_len
                ),
            ));
        }
    }
    let mut order: Vec<&GgufTensorInfo> = tensors.iter().filter(|t| t.n_bytes > 0).collect();
    order.sort_by_key(|t| t.offset);
    for pair in order.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        if b.offset < a.offset + a.n_bytes as u64 {
            return Err(GgufError::tensor(
                &b.name,
                format!(
                    "data at offset {} overlaps tensor '{}' (offset {}, {} bytes)",
                    b.offset, a.name, a.offset, a.n_bytes
                ),
            ));
        }
    }

    Ok(Header {
        version,
        metadata,
        tensors,
        alignment,
        data_start,
    })
}

fn read_value(
    c: &mut Cursor<'_>,
    ty: ValueType,
    key: &str,
    depth: usize,
) -> Result<MetaValue, GgufError> {
    let what = || format!("value of metadata key '{key}'");
    Ok(match ty {
        ValueType::U8 => MetaValue::U8(c.arr::<1>(&what)?[0]),
        ValueType::I8 => MetaValue::I8(c.arr::<1>(&what)?[0] as i8),
        ValueType::U16 => MetaValue::U16(u16::from_le_bytes(c.arr(&what)?)),
        ValueType::I16 => MetaValue::I16(i16::from_le_bytes(c.arr(&what)?)),
        ValueType::U32 => MetaValue::U32(u32::from_le_bytes(c.arr(&what)?)),
        ValueType::I32 => MetaValue::I32(i32::from_le_bytes(c.arr(&what)?)),
        ValueType::F32 => MetaValue::F32(f32::from_le_bytes(c.arr(&what)?)),
        ValueType::U64 => MetaValue::U64(u64::from_le_bytes(c.arr(&what)?)),
        ValueType::I64 => MetaValue::I64(i64::from_le_bytes(c.arr(&what)?)),
        ValueType::F64 => MetaValue::F64(f64::from_le_bytes(c.arr(&what)?)),
        ValueType::Bool => MetaValue::Bool(read_bool(c, key)?),
        ValueType::String => MetaValue::String(c.string(&what)?),
        ValueType::Array => MetaValue::Array(read_array(c, key, depth)?),
    })
}

fn read_bool(c: &mut Cursor<'_>, key: &str) -> Result<bool, GgufError> {
    let at = c.pos;
    match c.arr::<1>(&|| format!("value of metadata key '{key}'"))?[0] {
        0 => Ok(false),
        1 => Ok(true),
        b => Err(GgufError::metadata(
            key,
            format!("bool at byte {at} has value {b} (must be 0 or 1)"),
        )),
    }
}

fn read_array(c: &mut Cursor<'_>, key: &str, depth: usize) -> Result<MetaArray, GgufError> {
    if depth >= MAX_ARRAY_DEPTH {
        return Err(GgufError::metadata(
            key,
            format!("arrays nested deeper than {MAX_ARRAY_DEPTH} levels"),
        ));
    }
    let at = c.pos;
    let elem_id = c.u32(&|| format!("element type of array '{key}'"))?;
    let elem = ValueType::from_id(elem_id).ok_or_else(|| {
        GgufError::metadata(
            key,
            format!("unknown array element type {elem_id} at byte {at}"),
        )
    })?;
    let n = c.count(elem.min_encoded_size(), &|| {
        format!("array '{key}' ({} elements)", elem.name())
    })?;
    let what = |i: usize| move || format!("element {i} of array '{key}'");
    // Fixed-size elements: one bounds check for the whole run (count() has checked it fits).
    macro_rules! fixed {
        ($variant:ident, $t:ty) => {{
            let size = std::mem::size_of::<$t>();
            let raw = c.take((n * size) as u64, &what(0))?;
            MetaArray::$variant(
                raw.chunks_exact(size)
                    .map(|b| <$t>::from_le_bytes(b.try_into().expect("chunk size")))
                    .collect(),
            )
        }};
    }
    Ok(match elem {
        ValueType::U8 => fixed!(U8, u8),
        ValueType::I8 => fixed!(I8, i8),
        ValueType::U16 => fixed!(U16, u16),
        ValueType::I16 => fixed!(I16, i16),
        ValueType::U32 => fixed!(U32, u32),
        ValueType::I32 => fixed!(I32, i32),
        ValueType::F32 => fixed!(F32, f32),
        ValueType::U64 => fixed!(U64, u64),
        ValueType::I64 => fixed!(I64, i64),
        ValueType::F64 => fixed!(F64, f64),
        ValueType::Bool => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(read_bool(c, key)?);
            }
            MetaArray::Bool(v)
        }
        ValueType::String => {
            let mut v = Vec::with_capacity(n);
            for i in 0..n {
                v.push(c.string(&what(i))?);
            }
            MetaArray::String(v)
        }
        ValueType::Array => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(read_array(c, key, depth + 1)?);
            }
            MetaArray::Array(v)
        }
    })
}

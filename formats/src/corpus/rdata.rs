//! A reader for R's lazy-load databases (`Rdata.rdx` + `Rdata.rdb`), the form in which R
//! packages ship their data sets, and for the subset of R's serialization format those
//! files use.
//!
//! Layout (R's `makeLazyLoadDB` / `lazyLoadDBfetch`):
//! - `Rdata.rdx` is a gzip'd serialization of `list(variables = list(<name> = c(offset,
//!   length), ...), references = list(...), compressed = TRUE)`.
//! - `Rdata.rdb` is a concatenation of entries; entry `(offset, length)` with `compressed =
//!   TRUE` is a 4-byte big-endian uncompressed length followed by a zlib stream holding
//!   another serialization (the object itself). `compressed = 2 | 3` adds a one-byte method
//!   tag after the length (`'0'` stored, `'Z'` zlib, `'2'` bzip2, `'X'` xz); `FALSE` means
//!   the entry is the bare serialization.
//!
//! Only the XDR (big-endian binary, `"X\n"`) serialization, versions 2 and 3, and the SEXP
//! types plain data needs are supported: NULL, pairlists with attributes and tags, symbols
//! (with the reference table), CHARSXP, and logical/integer/double/character/list vectors.
//! Anything else (closures, environments, ALTREP, ...) is an [`RDataError::UnsupportedType`]
//! naming the type code. The input is untrusted: every length is checked against the bytes
//! left before anything is allocated, and nesting depth is bounded, so bad input gives an
//! error, never a panic or a huge allocation.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use flate2::read::{GzDecoder, ZlibDecoder};
use thiserror::Error;

/// Errors from reading R serializations and lazy-load databases.
#[derive(Debug, Error)]
pub enum RDataError {
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("R serialization truncated at byte {offset}: {needed} more bytes needed")]
    Truncated { offset: usize, needed: usize },
    #[error("not an XDR R serialization: {0}")]
    BadHeader(String),
    #[error("unsupported R serialization version {0} (only 2 and 3 are supported)")]
    UnsupportedVersion(i32),
    #[error("unsupported R SEXP type code {code} ({name}) at byte {offset}")]
    UnsupportedType {
        code: u8,
        name: &'static str,
        offset: usize,
    },
    #[error("length {len} at byte {offset} is larger than the {remaining} bytes left")]
    LengthTooLarge {
        len: u64,
        remaining: usize,
        offset: usize,
    },
    #[error("invalid length {len} at byte {offset}")]
    BadLength { len: i64, offset: usize },
    #[error("string at byte {offset} is not valid UTF-8")]
    InvalidUtf8 { offset: usize },
    #[error(
        "reference {index} at byte {offset} is not in the reference table ({table_len} entries)"
    )]
    BadReference {
        index: usize,
        table_len: usize,
        offset: usize,
    },
    #[error("objects nested deeper than {0} levels")]
    TooDeep(usize),
    #[error("malformed R object at byte {offset}: {msg}")]
    Malformed { offset: usize, msg: String },
    #[error("decompression failed: {0}")]
    Decompress(#[source] std::io::Error),
    #[error("decompressed size {actual} does not match the declared {declared} bytes")]
    SizeMismatch { declared: u64, actual: u64 },
    #[error("decompressed data exceeds the {limit}-byte limit")]
    TooLarge { limit: u64 },
    #[error("lazy-load index: {0}")]
    Index(String),
    #[error("object `{name}` is not in the database; it holds: {available}")]
    NoSuchObject { name: String, available: String },
    #[error(
        "entry `{name}` (offset {offset}, length {len}) lies outside the {db_len}-byte database"
    )]
    EntryOutOfRange {
        name: String,
        offset: u64,
        len: u64,
        db_len: usize,
    },
    #[error("unsupported lazy-load compression: {0}")]
    UnsupportedCompression(String),
}

type Result<T> = std::result::Result<T, RDataError>;

/// An R object: its value plus attributes in serialization order (`names`, `class`, ...).
#[derive(Debug, Clone, PartialEq)]
pub struct RObject {
    pub value: RValue,
    pub attributes: Vec<(String, RObject)>,
}

/// The value part of an [`RObject`]. NA is `None` where the R type has one.
#[derive(Debug, Clone, PartialEq)]
pub enum RValue {
    Null,
    Symbol(String),
    /// A bare CHARSXP (normally only seen inside character vectors and symbols).
    Char(Option<String>),
    Logical(Vec<Option<bool>>),
    Integer(Vec<Option<i32>>),
    /// R's NA_real_ is a NaN payload; kept as the raw f64.
    Real(Vec<f64>),
    Str(Vec<Option<String>>),
    List(Vec<RObject>),
    /// A pairlist flattened into (tag, value) cells.
    Pairlist(Vec<(Option<String>, RObject)>),
}

impl RObject {
    fn plain(value: RValue) -> Self {
        RObject {
            value,
            attributes: Vec::new(),
        }
    }

    /// The attribute called `name`, if present.
    pub fn attr(&self, name: &str) -> Option<&RObject> {
        self.attributes
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v)
    }

    /// The `names` attribute as strings (NA names are `None`).
    pub fn names(&self) -> Option<&[Option<String>]> {
        match &self.attr("names")?.value {
            RValue::Str(v) => Some(v),
            _ => None,
        }
    }

    /// The element called `name` of a named list or a tagged pairlist (first match, as R's
    /// `[[` does).
    pub fn get(&self, name: &str) -> Option<&RObject> {
        match &self.value {
            RValue::List(items) => {
                let names = self.names()?;
                let i = names.iter().position(|n| n.as_deref() == Some(name))?;
                items.get(i)
            }
            RValue::Pairlist(cells) => cells
                .iter()
                .find(|(tag, _)| tag.as_deref() == Some(name))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    /// A short name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self.value {
            RValue::Null => "NULL",
            RValue::Symbol(_) => "symbol",
            RValue::Char(_) => "CHARSXP",
            RValue::Logical(_) => "logical",
            RValue::Integer(_) => "integer",
            RValue::Real(_) => "double",
            RValue::Str(_) => "character",
            RValue::List(_) => "list",
            RValue::Pairlist(_) => "pairlist",
        }
    }
}

// SEXP type codes (R's Rinternals.h and serialize.c).
const SYMSXP: u8 = 1;
const LISTSXP: u8 = 2;
const CHARSXP: u8 = 9;
const LGLSXP: u8 = 10;
const INTSXP: u8 = 13;
const REALSXP: u8 = 14;
const STRSXP: u8 = 16;
const VECSXP: u8 = 19;
const NILVALUE_SXP: u8 = 254;
const REFSXP: u8 = 255;

// Flag bits of an item header.
const HAS_ATTR: u32 = 1 << 9;
const HAS_TAG: u32 = 1 << 10;
// CHARSXP encoding bits, in the "levels" part (flags >> 12).
const BYTES_MASK: u32 = 1 << 1;
const LATIN1_MASK: u32 = 1 << 2;
const UTF8_MASK: u32 = 1 << 3;
const ASCII_MASK: u32 = 1 << 6;

const NA_INTEGER: i32 = i32::MIN;

/// Deep enough for data sets (R's only naturally deep structure, the pairlist, is read
/// iteratively along its CDR), shallow enough for small stacks: unoptimized builds use
/// about 8 KiB of stack per level, so this stays under 1 MiB, half the 2 MiB default of
/// spawned threads.
pub const MAX_DEPTH: usize = 100;

/// Caps pre-allocation: a claimed length is only a promise, so vectors grow with the data
/// actually read beyond this.
const PREALLOC_CAP: usize = 1 << 12;

/// Upper bound for any decompressed blob; guards against decompression bombs.
pub const MAX_DECOMPRESSED: u64 = 1 << 30;

/// Human-readable name of a SEXP type code, for error messages.
pub fn sexp_type_name(code: u8) -> &'static str {
    match code {
        0 => "NILSXP",
        1 => "SYMSXP",
        2 => "LISTSXP",
        3 => "CLOSXP",
        4 => "ENVSXP",
        5 => "PROMSXP",
        6 => "LANGSXP",
        7 => "SPECIALSXP",
        8 => "BUILTINSXP",
        9 => "CHARSXP",
        10 => "LGLSXP",
        13 => "INTSXP",
        14 => "REALSXP",
        15 => "CPLXSXP",
        16 => "STRSXP",
        17 => "DOTSXP",
        18 => "ANYSXP",
        19 => "VECSXP",
        20 => "EXPRSXP",
        21 => "BCODESXP",
        22 => "EXTPTRSXP",
        23 => "WEAKREFSXP",
        24 => "RAWSXP",
        25 => "S4SXP",
        238 => "ALTREP_SXP",
        239 => "ATTRLISTSXP",
        240 => "ATTRLANGSXP",
        241 => "BASEENV_SXP",
        242 => "EMPTYENV_SXP",
        243 => "BCREPREF",
        244 => "BCREPDEF",
        245 => "GENERICREFSXP",
        246 => "CLASSREFSXP",
        247 => "PERSISTSXP",
        248 => "PACKAGESXP",
        249 => "NAMESPACESXP",
        250 => "BASENAMESPACE_SXP",
        251 => "MISSINGARG_SXP",
        252 => "UNBOUNDVALUE_SXP",
        253 => "GLOBALENV_SXP",
        254 => "NILVALUE_SXP",
        255 => "REFSXP",
        _ => "unknown",
    }
}

/// Parses one XDR R serialization (`"X\n"` header, version 2 or 3) into an [`RObject`].
/// Trailing bytes after the object are ignored, as R does.
pub fn unserialize(data: &[u8]) -> Result<RObject> {
    let mut r = Reader::new(data);
    r.read_header()?;
    r.read_item()
}

/// Byte decoding of CHARSXPs that carry no explicit encoding flag.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Native {
    Utf8,
    Latin1,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// R's reference table; only symbols enter it in the subset we read.
    refs: Vec<String>,
    depth: usize,
    native: Native,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Reader {
            buf,
            pos: 0,
            refs: Vec::new(),
            depth: 0,
            native: Native::Utf8,
        }
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let rest = &self.buf[self.pos..];
        if n > rest.len() {
            return Err(RDataError::Truncated {
                offset: self.pos,
                needed: n - rest.len(),
            });
        }
        self.pos += n;
        Ok(&rest[..n])
    }

    fn read_u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn read_i32(&mut self) -> Result<i32> {
        Ok(self.read_u32()? as i32)
    }

    fn read_f64(&mut self) -> Result<f64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(f64::from_be_bytes(a))
    }

    fn read_header(&mut self) -> Result<()> {
        let magic = self.take(2).map_err(|_| {
            RDataError::BadHeader("input shorter than the 2-byte format marker".into())
        })?;
        match magic {
            b"X\n" => {}
            b"A\n" => {
                return Err(RDataError::BadHeader(
                    "ASCII format is not supported".into(),
                ))
            }
            b"B\n" => {
                return Err(RDataError::BadHeader(
                    "native binary format is not supported".into(),
                ))
            }
            other => {
                return Err(RDataError::BadHeader(format!(
                    "format marker {other:?}, expected \"X\\n\""
                )))
            }
        }
        let version = self.read_i32()?;
        let _writer_version = self.read_i32()?;
        let _min_reader_version = self.read_i32()?;
        match version {
            2 => {}
            3 => {
                let len = self.read_i32()?;
                let len = self.checked_len(i64::from(len), 1)?;
                let enc = self.take(len)?;
                // Strings without an encoding flag are in the writer's native encoding.
                let enc = String::from_utf8_lossy(enc).to_ascii_lowercase();
                if matches!(
                    enc.as_str(),
                    "latin1" | "iso-8859-1" | "iso8859-1" | "iso_8859-1" | "iso88591"
                ) {
                    self.native = Native::Latin1;
                }
            }
            v => return Err(RDataError::UnsupportedVersion(v)),
        }
        Ok(())
    }

    /// Validates a count of elements, each at least `min_elem_bytes` long in the input,
    /// against what is left, so no allocation can exceed a small multiple of the input.
    fn checked_len(&self, len: i64, min_elem_bytes: u64) -> Result<usize> {
        let offset = self.pos.saturating_sub(4);
        if len < 0 {
            return Err(RDataError::BadLength { len, offset });
        }
        let len = len as u64;
        let need = len.saturating_mul(min_elem_bytes);
        if need > self.remaining() as u64 {
            return Err(RDataError::LengthTooLarge {
                len,
                remaining: self.remaining(),
                offset,
            });
        }
        // Fits in usize: it is bounded by the buffer length.
        Ok(len as usize)
    }

    /// Vector length: an i32, or -1 followed by two u32 halves of a 64-bit length.
    fn read_vec_len(&mut self, min_elem_bytes: u64) -> Result<usize> {
        let len = self.read_i32()?;
        let len = if len == -1 {
            let hi = u64::from(self.read_u32()?);
            let lo = u64::from(self.read_u32()?);
            let long = (hi << 32) | lo;
            i64::try_from(long).unwrap_or(i64::MAX)
        } else {
            i64::from(len)
        };
        self.checked_len(len, min_elem_bytes)
    }

    fn read_item(&mut self) -> Result<RObject> {
        let flags = self.read_u32()?;
        self.read_item_with(flags)
    }

    fn read_item_with(&mut self, flags: u32) -> Result<RObject> {
        if self.depth >= MAX_DEPTH {
            return Err(RDataError::TooDeep(MAX_DEPTH));
        }
        self.depth += 1;
        let out = self.read_item_inner(flags);
        self.depth -= 1;
        out
    }

    fn read_item_inner(&mut self, flags: u32) -> Result<RObject> {
        let at = self.pos.saturating_sub(4);
        let ty = (flags & 0xff) as u8;
        let has_attr = flags & HAS_ATTR != 0;
        match ty {
            NILVALUE_SXP => Ok(RObject::plain(RValue::Null)),
            REFSXP => {
                let mut index = (flags >> 8) as usize;
                if index == 0 {
                    index = self.read_i32()?.max(0) as usize;
                }
                // 1-based, as in R.
                match index.checked_sub(1).and_then(|i| self.refs.get(i)) {
                    Some(name) => Ok(RObject::plain(RValue::Symbol(name.clone()))),
                    None => Err(RDataError::BadReference {
                        index,
                        table_len: self.refs.len(),
                        offset: at,
                    }),
                }
            }
            SYMSXP => {
                let name = match self.read_item()?.value {
                    RValue::Char(Some(s)) => s,
                    RValue::Char(None) => "NA".to_string(),
                    _ => {
                        return Err(RDataError::Malformed {
                            offset: at,
                            msg: "symbol name is not a CHARSXP".into(),
                        })
                    }
                };
                self.refs.push(name.clone());
                Ok(RObject::plain(RValue::Symbol(name)))
            }
            LISTSXP => self.read_pairlist(flags),
            CHARSXP => {
                let s = self.read_charsxp_body(flags)?;
                // R reads and drops attributes on CHARSXPs (old writers emitted them).
                if has_attr {
                    self.read_item()?;
                }
                Ok(RObject::plain(RValue::Char(s)))
            }
            LGLSXP | INTSXP => {
                let n = self.read_vec_len(4)?;
                let mut v = Vec::with_capacity(n.min(PREALLOC_CAP));
                for _ in 0..n {
                    let x = self.read_i32()?;
                    v.push((x != NA_INTEGER).then_some(x));
                }
                let value = if ty == LGLSXP {
                    RValue::Logical(v.into_iter().map(|x| x.map(|x| x != 0)).collect())
                } else {
                    RValue::Integer(v)
                };
                self.finish_vector(value, has_attr)
            }
            REALSXP => {
                let n = self.read_vec_len(8)?;
                let mut v = Vec::with_capacity(n.min(PREALLOC_CAP));
                for _ in 0..n {
                    v.push(self.read_f64()?);
                }
                self.finish_vector(RValue::Real(v), has_attr)
            }
            STRSXP => {
                // Each element is at least a flags word and a length word.
                let n = self.read_vec_len(8)?;
                let mut v = Vec::with_capacity(n.min(PREALLOC_CAP));
                for _ in 0..n {
                    let el_at = self.pos;
                    let el_flags = self.read_u32()?;
                    let el_ty = (el_flags & 0xff) as u8;
                    if el_ty != CHARSXP {
                        return Err(RDataError::Malformed {
                            offset: el_at,
                            msg: format!(
                                "character vector element has type {el_ty} ({}), expected CHARSXP",
                                sexp_type_name(el_ty)
                            ),
                        });
                    }
                    v.push(self.read_charsxp_body(el_flags)?);
                    if el_flags & HAS_ATTR != 0 {
                        self.read_item()?;
                    }
                }
                self.finish_vector(RValue::Str(v), has_attr)
            }
            VECSXP => {
                let n = self.read_vec_len(4)?;
                let mut v = Vec::with_capacity(n.min(PREALLOC_CAP));
                for _ in 0..n {
                    v.push(self.read_item()?);
                }
                self.finish_vector(RValue::List(v), has_attr)
            }
            other => Err(RDataError::UnsupportedType {
                code: other,
                name: sexp_type_name(other),
                offset: at,
            }),
        }
    }

    fn finish_vector(&mut self, value: RValue, has_attr: bool) -> Result<RObject> {
        let attributes = if has_attr {
            self.read_attributes()?
        } else {
            Vec::new()
        };
        Ok(RObject { value, attributes })
    }

    /// Attributes are a tagged pairlist; every cell must have a tag (the attribute name).
    fn read_attributes(&mut self) -> Result<Vec<(String, RObject)>> {
        let at = self.pos;
        let list = self.read_item()?;
        match list.value {
            RValue::Pairlist(cells) => cells
                .into_iter()
                .map(|(tag, v)| {
                    tag.map(|t| (t, v)).ok_or_else(|| RDataError::Malformed {
                        offset: at,
                        msg: "attribute without a name".into(),
                    })
                })
                .collect(),
            RValue::Null => Ok(Vec::new()),
            _ => Err(RDataError::Malformed {
                offset: at,
                msg: format!("attributes are a {}, expected a pairlist", list.type_name()),
            }),
        }
    }

    /// Reads a pairlist iteratively along its CDR chain, so long pairlists cannot
    /// overflow the stack. Attributes of the head cell become the object's attributes;
    /// attributes on later cells are read and dropped (they are not observable in R
    /// either without walking cells).
    fn read_pairlist(&mut self, first_flags: u32) -> Result<RObject> {
        let mut cells = Vec::new();
        let mut attributes = Vec::new();
        let mut flags = first_flags;
        let mut first = true;
        loop {
            if flags & HAS_ATTR != 0 {
                let a = self.read_attributes()?;
                if first {
                    attributes = a;
                }
            }
            let tag = if flags & HAS_TAG != 0 {
                let at = self.pos;
                match self.read_item()?.value {
                    RValue::Symbol(s) => Some(s),
                    RValue::Null => None,
                    _ => {
                        return Err(RDataError::Malformed {
                            offset: at,
                            msg: "pairlist tag is not a symbol".into(),
                        })
                    }
                }
            } else {
                None
            };
            let car = self.read_item()?;
            cells.push((tag, car));
            first = false;
            let cdr_at = self.pos;
            let next = self.read_u32()?;
            match (next & 0xff) as u8 {
                LISTSXP => flags = next,
                NILVALUE_SXP => break,
                other => {
                    return Err(RDataError::Malformed {
                        offset: cdr_at,
                        msg: format!(
                            "pairlist ends in type {other} ({}) instead of NULL",
                            sexp_type_name(other)
                        ),
                    })
                }
            }
        }
        Ok(RObject {
            value: RValue::Pairlist(cells),
            attributes,
        })
    }

    /// The part of a CHARSXP after its flags: length (-1 = NA_STRING) and bytes.
    fn read_charsxp_body(&mut self, flags: u32) -> Result<Option<String>> {
        let len = self.read_i32()?;
        if len == -1 {
            return Ok(None);
        }
        let at = self.pos;
        let n = self.checked_len(i64::from(len), 1)?;
        let bytes = self.take(n)?;
        let levels = flags >> 12;
        let latin1 = levels & LATIN1_MASK != 0
            || (levels & (UTF8_MASK | ASCII_MASK | BYTES_MASK) == 0
                && self.native == Native::Latin1);
        if latin1 {
            // Latin-1 bytes are exactly the code points U+0000..U+00FF.
            return Ok(Some(bytes.iter().map(|&b| char::from(b)).collect()));
        }
        // UTF-8, ASCII, native UTF-8, and "bytes" (which we can only accept if it
        // happens to be UTF-8).
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(Some(s.to_owned())),
            Err(_) => Err(RDataError::InvalidUtf8 { offset: at }),
        }
    }
}

/// Decompresses a gzip stream, refusing output beyond `limit` bytes.
fn gunzip(data: &[u8], limit: u64) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    GzDecoder::new(data)
        .take(limit + 1)
        .read_to_end(&mut out)
        .map_err(RDataError::Decompress)?;
    if out.len() as u64 > limit {
        return Err(RDataError::TooLarge { limit });
    }
    Ok(out)
}

/// Decompresses a zlib stream that must produce exactly `declared` bytes.
fn inflate_exact(data: &[u8], declared: u64) -> Result<Vec<u8>> {
    if declared > MAX_DECOMPRESSED {
        return Err(RDataError::TooLarge {
            limit: MAX_DECOMPRESSED,
        });
    }
    let mut out = Vec::with_capacity((declared as usize).min(1 << 24));
    ZlibDecoder::new(data)
        .take(declared + 1)
        .read_to_end(&mut out)
        .map_err(RDataError::Decompress)?;
    if out.len() as u64 != declared {
        return Err(RDataError::SizeMismatch {
            declared,
            actual: out.len() as u64,
        });
    }
    Ok(out)
}

/// How `.rdb` entries are stored (the `compressed` element of the index).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// `compressed = FALSE`: entries are bare serializations.
    None,
    /// `compressed = TRUE` (or 1): 4-byte big-endian length + zlib stream.
    Zlib,
    /// `compressed = 2 | 3`: 4-byte length + method byte + payload.
    Tagged,
}

/// An opened lazy-load database: the index plus the `.rdb` bytes.
#[derive(Debug, Clone)]
pub struct LazyLoadDb {
    rdb: Vec<u8>,
    entries: BTreeMap<String, (u64, u64)>,
    compression: Compression,
}

impl LazyLoadDb {
    /// Opens `<stem>.rdx` and `<stem>.rdb`, e.g. `open(dir.join("Rdata"))`.
    pub fn open(stem: &Path) -> Result<Self> {
        let rdx_path = stem.with_extension("rdx");
        let rdb_path = stem.with_extension("rdb");
        let rdx = std::fs::read(&rdx_path).map_err(|source| RDataError::Io {
            path: rdx_path.clone(),
            source,
        })?;
        let rdb = std::fs::read(&rdb_path).map_err(|source| RDataError::Io {
            path: rdb_path.clone(),
            source,
        })?;
        Self::from_bytes(&rdx, rdb)
    }

    /// Builds a database from the gzip'd index bytes and the `.rdb` contents.
    pub fn from_bytes(rdx_gz: &[u8], rdb: Vec<u8>) -> Result<Self> {
        // The index only lists names and offsets; 64 MiB is far beyond any real one.
        let raw = gunzip(rdx_gz, 64 << 20)?;
        let index = unserialize(&raw)?;
        let variables = index
            .get("variables")
            .ok_or_else(|| RDataError::Index("no `variables` element".into()))?;
        let mut entries = BTreeMap::new();
        match &variables.value {
            RValue::List(items) => {
                let names = variables
                    .names()
                    .ok_or_else(|| RDataError::Index("`variables` has no names".into()))?;
                if names.len() != items.len() {
                    return Err(RDataError::Index(format!(
                        "`variables` has {} names for {} elements",
                        names.len(),
                        items.len()
                    )));
                }
                for (name, item) in names.iter().zip(items) {
                    let name = name
                        .clone()
                        .ok_or_else(|| RDataError::Index("NA variable name".into()))?;
                    let pos = offset_pair(&name, item)?;
                    entries.insert(name, pos);
                }
            }
            RValue::Null => {}
            _ => {
                return Err(RDataError::Index(format!(
                    "`variables` is a {}, expected a list",
                    variables.type_name()
                )))
            }
        }
        let compression = match index.get("compressed").map(|c| &c.value) {
            // R's default when the element is absent.
            None => Compression::Zlib,
            Some(RValue::Logical(v)) if v.as_slice() == [Some(true)] => Compression::Zlib,
            Some(RValue::Logical(v)) if v.as_slice() == [Some(false)] => Compression::None,
            Some(RValue::Integer(v)) if v.as_slice() == [Some(1)] => Compression::Zlib,
            Some(RValue::Integer(v)) if matches!(v.as_slice(), [Some(2 | 3)]) => {
                Compression::Tagged
            }
            Some(RValue::Real(v)) if v.as_slice() == [1.0] => Compression::Zlib,
            Some(RValue::Real(v)) if v.as_slice() == [2.0] || v.as_slice() == [3.0] => {
                Compression::Tagged
            }
            Some(other) => {
                return Err(RDataError::UnsupportedCompression(format!(
                    "`compressed` = {other:?}"
                )))
            }
        };
        Ok(LazyLoadDb {
            rdb,
            entries,
            compression,
        })
    }

    /// Object names in the database, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// Reads and unserializes the object called `name`.
    pub fn get(&self, name: &str) -> Result<RObject> {
        let &(offset, len) = self
            .entries
            .get(name)
            .ok_or_else(|| RDataError::NoSuchObject {
                name: name.to_string(),
                available: self.names().collect::<Vec<_>>().join(", "),
            })?;
        let out_of_range = || RDataError::EntryOutOfRange {
            name: name.to_string(),
            offset,
            len,
            db_len: self.rdb.len(),
        };
        let end = offset.checked_add(len).ok_or_else(out_of_range)?;
        if end > self.rdb.len() as u64 {
            return Err(out_of_range());
        }
        // In range of a slice length, so these fit in usize.
        let entry = &self.rdb[offset as usize..end as usize];
        let raw = match self.compression {
            Compression::None => entry.to_vec(),
            Compression::Zlib => {
                let (declared, body) = split_len(entry)?;
                inflate_exact(body, declared)?
            }
            Compression::Tagged => {
                let (declared, body) = split_len(entry)?;
                let (&method, body) = body.split_first().ok_or(RDataError::Truncated {
                    offset: 4,
                    needed: 1,
                })?;
                match method {
                    b'Z' => inflate_exact(body, declared)?,
                    b'0' => {
                        if body.len() as u64 != declared {
                            return Err(RDataError::SizeMismatch {
                                declared,
                                actual: body.len() as u64,
                            });
                        }
                        body.to_vec()
                    }
                    b'2' => return Err(RDataError::UnsupportedCompression("bzip2".into())),
                    b'X' => return Err(RDataError::UnsupportedCompression("xz".into())),
                    m => {
                        return Err(RDataError::UnsupportedCompression(format!(
                            "method byte {m:#04x}"
                        )))
                    }
                }
            }
        };
        unserialize(&raw)
    }

    /// Reads the object called `name`, which must be a character vector.
    pub fn get_strings(&self, name: &str) -> Result<Vec<Option<String>>> {
        let obj = self.get(name)?;
        match obj.value {
            RValue::Str(v) => Ok(v),
            _ => Err(RDataError::Malformed {
                offset: 0,
                msg: format!("`{name}` is a {}, not a character vector", obj.type_name()),
            }),
        }
    }
}

fn split_len(entry: &[u8]) -> Result<(u64, &[u8])> {
    match entry {
        [a, b, c, d, rest @ ..] => Ok((u64::from(u32::from_be_bytes([*a, *b, *c, *d])), rest)),
        _ => Err(RDataError::Truncated {
            offset: entry.len(),
            needed: 4 - entry.len(),
        }),
    }
}

/// An index entry: an integer (or, for > 2 GiB databases, double) pair (offset, length).
fn offset_pair(name: &str, item: &RObject) -> Result<(u64, u64)> {
    let bad = || {
        RDataError::Index(format!(
            "entry `{name}` is not a non-negative (offset, length) pair"
        ))
    };
    match &item.value {
        RValue::Integer(v) => match v.as_slice() {
            [Some(o), Some(l)] if *o >= 0 && *l >= 0 => Ok((*o as u64, *l as u64)),
            _ => Err(bad()),
        },
        RValue::Real(v) => match v.as_slice() {
            [o, l] if valid_offset(*o) && valid_offset(*l) => Ok((*o as u64, *l as u64)),
            _ => Err(bad()),
        },
        _ => Err(bad()),
    }
}

fn valid_offset(x: f64) -> bool {
    x.is_finite() && x >= 0.0 && x.fract() == 0.0 && x < 9.0e15
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::write::{GzEncoder, ZlibEncoder};
    use std::io::Write;

    /// Builds XDR serializations by hand, so tests do not depend on R.
    #[derive(Default)]
    struct W(Vec<u8>);

    impl W {
        fn header(version: i32) -> Self {
            let mut w = W(b"X\n".to_vec());
            w.i32(version).i32(0x0004_0201).i32(0x0003_0500);
            if version == 3 {
                w.i32(5);
                w.0.extend_from_slice(b"UTF-8");
            }
            w
        }
        fn i32(&mut self, x: i32) -> &mut Self {
            self.0.extend_from_slice(&x.to_be_bytes());
            self
        }
        fn u32(&mut self, x: u32) -> &mut Self {
            self.0.extend_from_slice(&x.to_be_bytes());
            self
        }
        fn charsxp(&mut self, s: Option<&str>) -> &mut Self {
            match s {
                // UTF8_MASK | gp "cached" bit, as R writes.
                Some(s) => {
                    self.u32(0x0000_8009 | (UTF8_MASK << 12));
                    self.i32(s.len() as i32);
                    self.0.extend_from_slice(s.as_bytes());
                }
                None => {
                    self.u32(9).i32(-1);
                }
            }
            self
        }
        fn strsxp(&mut self, items: &[Option<&str>]) -> &mut Self {
            self.u32(16).i32(items.len() as i32);
            for s in items {
                self.charsxp(*s);
            }
            self
        }
        fn symbol(&mut self, s: &str) -> &mut Self {
            self.u32(1).charsxp(Some(s))
        }
        fn nil(&mut self) -> &mut Self {
            self.u32(254)
        }
    }

    /// Serializes `list(variables = list(<name> = c(off, len), ...), references = list(),
    /// compressed = TRUE)` the way R does, with the `names` symbol referenced after its
    /// first use.
    fn index_bytes(entries: &[(&str, i32, i32)]) -> Vec<u8> {
        let mut w = W::header(3);
        w.u32(19 | HAS_ATTR).i32(3);
        // variables
        w.u32(19 | HAS_ATTR).i32(entries.len() as i32);
        for &(_, o, l) in entries {
            w.u32(13).i32(2).i32(o).i32(l);
        }
        w.u32(2 | HAS_TAG).symbol("names");
        let names: Vec<Option<&str>> = entries.iter().map(|e| Some(e.0)).collect();
        w.strsxp(&names).nil();
        // references
        w.u32(19).i32(0);
        // compressed
        w.u32(10).i32(1).i32(1);
        // names of the outer list: REFSXP to `names` (index 1 packed in the flags)
        w.u32(2 | HAS_TAG).u32((1 << 8) | 255);
        w.strsxp(&[Some("variables"), Some("references"), Some("compressed")])
            .nil();
        w.0
    }

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(data).expect("write to Vec");
        e.finish().expect("finish gzip")
    }

    fn rdb_entry(payload: &[u8]) -> Vec<u8> {
        let mut e = ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(payload).expect("write to Vec");
        let z = e.finish().expect("finish zlib");
        let mut out = (payload.len() as u32).to_be_bytes().to_vec();
        out.extend_from_slice(&z);
        out
    }

    fn sample_db() -> (Vec<u8>, Vec<u8>) {
        let mut a = W::header(3);
        a.strsxp(&[Some("First line"), None, Some("Café — “quoted”")]);
        let mut b = W::header(2);
        b.strsxp(&[Some("x")]);
        let ea = rdb_entry(&a.0);
        let eb = rdb_entry(&b.0);
        let mut rdb = ea.clone();
        rdb.extend_from_slice(&eb);
        let rdx = index_bytes(&[
            ("alpha", 0, ea.len() as i32),
            ("beta", ea.len() as i32, eb.len() as i32),
        ]);
        (gzip(&rdx), rdb)
    }

    #[test]
    fn reads_handmade_database() {
        let (rdx, rdb) = sample_db();
        let db = LazyLoadDb::from_bytes(&rdx, rdb).expect("valid db");
        assert_eq!(db.names().collect::<Vec<_>>(), ["alpha", "beta"]);
        assert_eq!(
            db.get_strings("alpha").expect("alpha"),
            vec![
                Some("First line".to_string()),
                None,
                Some("Café — “quoted”".to_string())
            ]
        );
        assert_eq!(
            db.get_strings("beta").expect("beta"),
            vec![Some("x".into())]
        );
        let err = db.get("gamma").expect_err("missing object");
        assert!(err.to_string().contains("alpha, beta"), "{err}");
    }

    #[test]
    fn reads_scalars_attributes_and_references() {
        let mut w = W::header(3);
        w.u32(19 | HAS_ATTR).i32(4);
        w.u32(10).i32(3).i32(1).i32(0).i32(NA_INTEGER);
        w.u32(13).i32(2).i32(-5).i32(NA_INTEGER);
        w.u32(14).i32(2);
        w.0.extend_from_slice(&1.5f64.to_be_bytes());
        w.0.extend_from_slice(&(-0.25f64).to_be_bytes());
        w.nil();
        // attributes: names = ..., class = "foo" (the second tag is a new symbol, the
        // third a reference to the first)
        w.u32(2 | HAS_TAG).symbol("names");
        w.strsxp(&[Some("l"), Some("i"), Some("r"), Some("n")]);
        w.u32(2 | HAS_TAG).symbol("class").strsxp(&[Some("foo")]);
        w.u32(2 | HAS_TAG).u32(255).i32(1).strsxp(&[Some("dup")]);
        w.nil();
        let obj = unserialize(&w.0).expect("valid");
        assert_eq!(
            obj.get("l").map(|o| &o.value),
            Some(&RValue::Logical(vec![Some(true), Some(false), None]))
        );
        assert_eq!(
            obj.get("i").map(|o| &o.value),
            Some(&RValue::Integer(vec![Some(-5), None]))
        );
        assert_eq!(
            obj.get("r").map(|o| &o.value),
            Some(&RValue::Real(vec![1.5, -0.25]))
        );
        assert_eq!(obj.get("n").map(|o| &o.value), Some(&RValue::Null));
        assert_eq!(
            obj.attr("class").map(|o| &o.value),
            Some(&RValue::Str(vec![Some("foo".into())]))
        );
        // The explicit-index reference resolved to the first symbol, `names`.
        assert_eq!(obj.attributes[2].0, "names");
    }

    #[test]
    fn latin1_strings_are_converted() {
        let mut w = W::header(2);
        w.u32(16).i32(1).u32(9 | (LATIN1_MASK << 12)).i32(4);
        w.0.extend_from_slice(&[b'c', b'a', b'f', 0xe9]);
        let obj = unserialize(&w.0).expect("valid");
        assert_eq!(obj.value, RValue::Str(vec![Some("café".into())]));
    }

    #[test]
    fn rejects_wrong_headers() {
        for bad in [
            &b""[..],
            b"X",
            b"RDX3\n",
            b"A\n2\n",
            b"B\n\0\0\0\x03",
            b"X\n\0\0\0\x09\0\0\0\0\0\0\0\0",
        ] {
            let err = unserialize(bad).expect_err("bad header");
            assert!(
                matches!(
                    err,
                    RDataError::BadHeader(_)
                        | RDataError::UnsupportedVersion(_)
                        | RDataError::Truncated { .. }
                ),
                "{err}"
            );
        }
        assert!(matches!(
            LazyLoadDb::from_bytes(b"not gzip at all", Vec::new()),
            Err(RDataError::Decompress(_))
        ));
    }

    #[test]
    fn every_truncation_is_an_error() {
        let (rdx, rdb) = sample_db();
        let raw = gunzip(&rdx, 1 << 20).expect("gunzip");
        for n in 0..raw.len() {
            assert!(unserialize(&raw[..n]).is_err(), "prefix {n} parsed");
        }
        for n in 0..rdx.len() {
            assert!(
                LazyLoadDb::from_bytes(&rdx[..n], rdb.clone()).is_err(),
                "rdx prefix {n} parsed"
            );
        }
        // A truncated .rdb: the index is fine, the entry is not.
        let db = LazyLoadDb::from_bytes(&rdx, rdb[..rdb.len() / 2].to_vec()).expect("index");
        assert!(matches!(
            db.get("beta"),
            Err(RDataError::EntryOutOfRange { .. })
        ));
    }

    #[test]
    fn absurd_lengths_are_errors_not_allocations() {
        let cases: Vec<Vec<u8>> = vec![
            W::header(3).u32(16).i32(i32::MAX).0.clone(),
            W::header(3).u32(13).i32(0x4000_0000).0.clone(),
            W::header(3)
                .u32(14)
                .i32(-1)
                .u32(0xffff_ffff)
                .u32(0xffff_ffff)
                .0
                .clone(),
            W::header(3).u32(19).i32(-1).u32(1).u32(0).0.clone(),
            W::header(3).u32(19).i32(-7).0.clone(),
            W::header(3).u32(16).i32(1).u32(9).i32(i32::MAX).0.clone(),
            W::header(3).u32(16).i32(1).u32(9).i32(-2).0.clone(),
        ];
        // A version 3 header with an absurd native-encoding length.
        let mut v3_bad = b"X\n".to_vec();
        v3_bad.extend_from_slice(&[0, 0, 0, 3, 0, 4, 2, 1, 0, 3, 5, 0, 0x7f, 0xff, 0xff, 0xff]);
        for data in cases.iter().chain([&v3_bad]) {
            let err = unserialize(data).expect_err("absurd length");
            assert!(
                matches!(
                    err,
                    RDataError::LengthTooLarge { .. }
                        | RDataError::BadLength { .. }
                        | RDataError::Truncated { .. }
                ),
                "{err}"
            );
        }
        // A declared decompressed size larger than the data really holds.
        let (rdx, mut rdb) = sample_db();
        rdb[..4].copy_from_slice(&u32::MAX.to_be_bytes());
        let db = LazyLoadDb::from_bytes(&rdx, rdb).expect("index");
        assert!(db.get("alpha").is_err());
    }

    #[test]
    fn unsupported_types_are_named() {
        for code in [3u8, 4, 6, 15, 24, 25, 238, 242] {
            let data = W::header(3).u32(u32::from(code)).i32(0).0.clone();
            let err = unserialize(&data).expect_err("unsupported");
            let msg = err.to_string();
            assert!(msg.contains(&format!("code {code} ")), "{msg}");
            assert!(msg.contains(sexp_type_name(code)), "{msg}");
        }
    }

    #[test]
    fn bad_references_and_deep_nesting_are_errors() {
        let data = W::header(3).u32((7 << 8) | 255).0.clone();
        assert!(matches!(
            unserialize(&data),
            Err(RDataError::BadReference { index: 7, .. })
        ));
        let mut w = W::header(3);
        for _ in 0..10_000 {
            w.u32(19).i32(1);
        }
        w.nil();
        assert!(matches!(unserialize(&w.0), Err(RDataError::TooDeep(_))));
        // Attributes of attributes of ... recurse through a different path.
        let mut w = W::header(3);
        for _ in 0..10_000 {
            w.u32(2 | HAS_ATTR);
        }
        w.nil();
        assert!(matches!(unserialize(&w.0), Err(RDataError::TooDeep(_))));
        // A long pairlist is read without recursion along its CDR.
        let mut w = W::header(3);
        for _ in 0..100_000 {
            w.u32(2).nil();
        }
        w.nil();
        match unserialize(&w.0).expect("long pairlist").value {
            RValue::Pairlist(cells) => assert_eq!(cells.len(), 100_000),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn random_corruption_never_panics() {
        let (rdx, rdb) = sample_db();
        let raw = gunzip(&rdx, 1 << 20).expect("gunzip");
        let entry = inflate_exact(
            &rdb[4..],
            u64::from(u32::from_be_bytes([rdb[0], rdb[1], rdb[2], rdb[3]])),
        )
        .expect("entry");
        // xorshift: deterministic and dependency-free.
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for base in [&raw, &entry] {
            for _ in 0..20_000 {
                let mut data = base.clone();
                for _ in 0..1 + next() % 4 {
                    let i = (next() % data.len() as u64) as usize;
                    data[i] = match next() % 3 {
                        0 => next() as u8,
                        1 => 0xff,
                        _ => 0,
                    };
                }
                let _ = unserialize(&data);
            }
        }
    }
}

//! The `.sfx` container, version 1: the converter's output and the runtime's input.
//!
//! Byte-level specification: `docs/format.md`. In short: a 4 KiB header block (magic, version),
//! 4 KiB-aligned sections (one tensor or one refinement matrix each, streamed by the writer),
//! a JSON metadata block (zstd), a table of fixed-size 256-byte section entries and a 96-byte
//! footer that locates metadata and table and checksums everything except section payloads.
//! Section payloads carry their own SHA-256, computed while streaming and checked on demand
//! ([`SfxFile::verify`]).
//!
//! The table sits at the end (after the sections) so the writer is one forward pass that never
//! seeks and never holds more than one section's compression window in memory; the reader
//! finds it through the fixed-size footer, like tantivy and zip.

mod metadata;
mod reader;
mod writer;

pub use metadata::{Provenance, SfxMetadata};
pub use reader::{SectionView, SfxFile, VerifyReport};
pub use writer::{SectionSpec, SectionWriter, SfxWriter, WriterCheckpoint};

use crate::tensor::DType;

/// First four bytes of the file and last four bytes of the footer.
pub const MAGIC: [u8; 4] = *b"SFX\0";
/// The format version this code writes and the only one it reads.
pub const VERSION: u32 = 1;
/// Every section and the metadata block start at a multiple of this (mmap, O_DIRECT).
pub const ALIGN: u64 = 4096;
/// Meaningful bytes at the start of the header block; the rest of the first 4 KiB is zero.
pub const HEADER_LEN: usize = 64;
/// Fixed size of the footer, the last bytes of the file.
pub const FOOTER_LEN: usize = 96;
/// Fixed size of one section table entry.
pub const ENTRY_LEN: usize = 256;
/// Longest section name in bytes (UTF-8).
pub const MAX_NAME_LEN: usize = 158;
/// At most this many sections: 2^20 entries is a 256 MiB table, far above any model
/// (a 70B model with per-layer sections has a few thousand).
pub const MAX_SECTIONS: u64 = 1 << 20;
/// Largest decoded metadata block accepted (the tokenizer is the bulk: ~2 MB for SmolLM2,
/// ~17 MB for Gemma-scale vocabularies).
pub const MAX_METADATA_LEN: u64 = 256 << 20;
/// Most shape dimensions a section entry records.
pub const MAX_DIMS: usize = 4;

/// Where the runtime keeps a section: always in accelerator/RAM memory, in a RAM cache, or read
/// from SSD on demand.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Tier {
    Resident,
    Ram,
    Ssd,
}

impl Tier {
    pub fn code(self) -> u8 {
        match self {
            Tier::Resident => 0,
            Tier::Ram => 1,
            Tier::Ssd => 2,
        }
    }

    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(Tier::Resident),
            1 => Some(Tier::Ram),
            2 => Some(Tier::Ssd),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Resident => "resident",
            Tier::Ram => "ram",
            Tier::Ssd => "ssd",
        }
    }
}

/// How a section's stored bytes encode its decoded bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codec {
    /// Stored bytes are the decoded bytes; the only codec that allows [`SfxFile::read_range`].
    Raw,
    /// One zstd frame, no frame checksum (the table has one). The level is not part of the
    /// format (the decoder does not need it); this writer uses fixed levels so its output is
    /// reproducible.
    Zstd,
}

impl Codec {
    /// zstd level this writer uses for sections: fast enough (hundreds of MB/s) for
    /// gigabyte-scale tensors.
    pub const ZSTD_LEVEL: i32 = 3;
    /// zstd level for the metadata block: on SmolLM2's tokenizer + config (1.86 MB of JSON)
    /// level 19 gives 3.88x in 0.7 s vs 3.08x at level 3; written once per conversion, read
    /// (2 ms decode) on every open (docs/format.md, "zstd decision").
    pub const METADATA_ZSTD_LEVEL: i32 = 19;

    pub fn code(self) -> u16 {
        match self {
            Codec::Raw => 0,
            Codec::Zstd => 1,
        }
    }

    pub fn from_code(code: u16) -> Option<Self> {
        match code {
            0 => Some(Codec::Raw),
            1 => Some(Codec::Zstd),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Codec::Raw => "raw",
            Codec::Zstd => "zstd",
        }
    }
}

/// What the decoded bytes of a section mean. Encoded in an entry as a u16 code, a dtype byte
/// and up to four u64 dims (docs/format.md, "Layouts").
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Layout {
    /// Opaque bytes whose meaning the metadata names (indexes, JSON side tables).
    Bytes,
    /// A float tensor, little-endian, row-major, outermost dimension first (1 to 4 dims).
    Dense { dtype: DType, shape: Vec<u64> },
    /// Resident quantizer codes for a `[rows, cols]` weight at `bits` bits per code with
    /// `group` columns per scale group; the packing is the quantizer's (named in metadata).
    PackedCodes {
        rows: u64,
        cols: u64,
        bits: u64,
        group: u64,
    },
    /// Refinement matrix C `[out, in]` stored column-major as 4-bit signed levels −7..7 stored
    /// as `level + 8`: column i (all `out` values of input channel i) is bytes
    /// `[i * ceil(out/2), (i + 1) * ceil(out/2))`, element 2j in the low nibble of byte j.
    /// One selected input channel is one contiguous read. Scales live in their own section.
    ColumnNibbles { out: u64, inp: u64 },
    /// MLP neuron bundles (docs/method.md eq. 5–6) for `neurons` intermediate channels of a model
    /// with `hidden` channels: bundle j is `4 · ceil(hidden/2)` consecutive bytes at
    /// `j · 4 · ceil(hidden/2)` holding four nibble vectors of `hidden` values each, in order
    /// gate refinement row j, up refinement row j, down refinement column j, 4-bit copy of
    /// the float down column j (nibble order as in [`Layout::ColumnNibbles`]). One bundle is
    /// one contiguous read; the scales live in resident sections.
    NeuronBundles { neurons: u64, hidden: u64 },
    /// Trellis-coded weight `[rows, cols]` at `k` bits per weight: `(rows/16)·(cols/16)` tile
    /// streams of `32·k` bytes in row-major tile order; `scheme` is
    /// [`crate::resident::TrellisScheme::encode`] (code, table bits, L, tile order). Signs,
    /// scales, table and Hadamard factors live in their own sections (docs/format.md).
    TrellisTiles {
        rows: u64,
        cols: u64,
        k: u64,
        scheme: u64,
    },
    /// A llama.cpp GGUF weight `[rows, cols]` kept in its own blocks: `rows` rows of
    /// `cols / block_size` blocks of the type with GGUF id `ggml_type` (Q4_0 … Q8_0, Q2_K …
    /// Q6_K, the i-quants), each block exactly as llama.cpp lays it out; rows in Hugging Face
    /// order (Q/K rows un-permuted). The blocks carry their own scales.
    GgufBlocks {
        rows: u64,
        cols: u64,
        ggml_type: u64,
    },
}

impl Layout {
    pub fn code(&self) -> u16 {
        match self {
            Layout::Bytes => 0,
            Layout::Dense { .. } => 1,
            Layout::PackedCodes { .. } => 2,
            Layout::ColumnNibbles { .. } => 3,
            Layout::NeuronBundles { .. } => 4,
            Layout::TrellisTiles { .. } => 5,
            Layout::GgufBlocks { .. } => 6,
        }
    }

    /// Bytes per column of a [`Layout::ColumnNibbles`] section; `None` for other layouts.
    pub fn column_bytes(&self) -> Option<u64> {
        match self {
            Layout::ColumnNibbles { out, .. } => Some(out.div_ceil(2)),
            _ => None,
        }
    }

    /// Bytes per bundle of a [`Layout::NeuronBundles`] section; `None` for other layouts.
    pub fn bundle_bytes(&self) -> Option<u64> {
        match self {
            Layout::NeuronBundles { hidden, .. } => Some(4 * hidden.div_ceil(2)),
            _ => None,
        }
    }

    /// Decoded length the layout implies, where it implies one (`None`: any length).
    /// `None` inside `Some` cannot happen; overflow is `Err(())`.
    pub(crate) fn expected_len(&self) -> Result<Option<u64>, ()> {
        match self {
            Layout::Bytes | Layout::PackedCodes { .. } => Ok(None),
            Layout::Dense { dtype, shape } => shape
                .iter()
                .try_fold(dtype.size_in_bytes() as u64, |acc, &d| acc.checked_mul(d))
                .map(Some)
                .ok_or(()),
            Layout::ColumnNibbles { out, inp } => {
                out.div_ceil(2).checked_mul(*inp).map(Some).ok_or(())
            }
            Layout::NeuronBundles { neurons, hidden } => hidden
                .div_ceil(2)
                .checked_mul(4)
                .and_then(|b| b.checked_mul(*neurons))
                .map(Some)
                .ok_or(()),
            Layout::TrellisTiles { rows, cols, k, .. } => (rows / 16)
                .checked_mul(cols / 16)
                .and_then(|t| t.checked_mul(32 * k))
                .map(Some)
                .ok_or(()),
            Layout::GgufBlocks {
                rows,
                cols,
                ggml_type,
            } => {
                let ty = gguf_block_type(*ggml_type).map_err(|_| ())?;
                rows.checked_mul(*cols)
                    .and_then(|n| ty.bytes_for(n))
                    .map(Some)
                    .ok_or(())
            }
        }
    }

    /// (code, dtype byte, ndim, dims) as stored in a table entry.
    pub(crate) fn encode(&self) -> (u16, u8, u8, [u64; MAX_DIMS]) {
        let mut dims = [0u64; MAX_DIMS];
        match self {
            Layout::Bytes => (0, 0, 0, dims),
            Layout::Dense { dtype, shape } => {
                dims[..shape.len()].copy_from_slice(shape);
                (1, dtype_code(*dtype), shape.len() as u8, dims)
            }
            Layout::PackedCodes {
                rows,
                cols,
                bits,
                group,
            } => {
                dims = [*rows, *cols, *bits, *group];
                (2, 0, 4, dims)
            }
            Layout::ColumnNibbles { out, inp } => {
                dims[0] = *out;
                dims[1] = *inp;
                (3, 0, 2, dims)
            }
            Layout::NeuronBundles { neurons, hidden } => {
                dims[0] = *neurons;
                dims[1] = *hidden;
                (4, 0, 2, dims)
            }
            Layout::TrellisTiles {
                rows,
                cols,
                k,
                scheme,
            } => {
                dims = [*rows, *cols, *k, *scheme];
                (5, 0, 4, dims)
            }
            Layout::GgufBlocks {
                rows,
                cols,
                ggml_type,
            } => {
                dims[..3].copy_from_slice(&[*rows, *cols, *ggml_type]);
                (6, 0, 3, dims)
            }
        }
    }

    /// Inverse of [`Layout::encode`]; the message says which field is wrong.
    pub(crate) fn decode(
        code: u16,
        dtype: u8,
        ndim: u8,
        dims: [u64; MAX_DIMS],
    ) -> Result<Self, String> {
        let n = ndim as usize;
        if n > MAX_DIMS {
            return Err(format!("{n} dims (at most {MAX_DIMS})"));
        }
        if dims[n..].iter().any(|&d| d != 0) {
            return Err("nonzero unused dims".into());
        }
        let want = |k: usize| {
            if n == k {
                Ok(())
            } else {
                Err(format!("layout code {code} needs {k} dims, entry has {n}"))
            }
        };
        let no_dtype = || {
            if dtype == 0 {
                Ok(())
            } else {
                Err(format!(
                    "layout code {code} takes no dtype, entry has {dtype}"
                ))
            }
        };
        match code {
            0 => {
                want(0)?;
                no_dtype()?;
                Ok(Layout::Bytes)
            }
            1 => {
                if n == 0 {
                    return Err("dense layout with no dims".into());
                }
                let dtype =
                    dtype_from_code(dtype).ok_or_else(|| format!("unknown dtype code {dtype}"))?;
                Ok(Layout::Dense {
                    dtype,
                    shape: dims[..n].to_vec(),
                })
            }
            2 => {
                want(4)?;
                no_dtype()?;
                if !(1..=8).contains(&dims[2]) {
                    return Err(format!("packed codes of {} bits (1 to 8)", dims[2]));
                }
                Ok(Layout::PackedCodes {
                    rows: dims[0],
                    cols: dims[1],
                    bits: dims[2],
                    group: dims[3],
                })
            }
            3 => {
                want(2)?;
                no_dtype()?;
                Ok(Layout::ColumnNibbles {
                    out: dims[0],
                    inp: dims[1],
                })
            }
            4 => {
                want(2)?;
                no_dtype()?;
                Ok(Layout::NeuronBundles {
                    neurons: dims[0],
                    hidden: dims[1],
                })
            }
            5 => {
                want(4)?;
                no_dtype()?;
                if !dims[0].is_multiple_of(16) || !dims[1].is_multiple_of(16) {
                    return Err(format!(
                        "trellis tiles of a [{}, {}] weight (not multiples of 16)",
                        dims[0], dims[1]
                    ));
                }
                crate::resident::TrellisScheme::decode(dims[3], dims[2])
                    .map_err(|e| e.to_string())?;
                Ok(Layout::TrellisTiles {
                    rows: dims[0],
                    cols: dims[1],
                    k: dims[2],
                    scheme: dims[3],
                })
            }
            6 => {
                want(3)?;
                no_dtype()?;
                let ty = gguf_block_type(dims[2])?;
                if !dims[1].is_multiple_of(ty.block_size() as u64) {
                    return Err(format!(
                        "GGUF {ty} blocks of a [{}, {}] weight ({} columns is not a whole \
                         number of blocks of {})",
                        dims[0],
                        dims[1],
                        dims[1],
                        ty.block_size()
                    ));
                }
                Ok(Layout::GgufBlocks {
                    rows: dims[0],
                    cols: dims[1],
                    ggml_type: dims[2],
                })
            }
            _ => Err(format!("unknown layout code {code}")),
        }
    }
}

/// The quantized GGUF type with id `id` that a [`Layout::GgufBlocks`] section may hold: one
/// of blocks of several weights that [`crate::gguf::dequantize`] reads (not a float or
/// integer type).
pub fn gguf_block_type(id: u64) -> Result<crate::gguf::GgmlType, String> {
    let ty = u32::try_from(id)
        .ok()
        .and_then(crate::gguf::GgmlType::from_id)
        .ok_or_else(|| format!("unknown GGUF type id {id}"))?;
    if ty.is_decodable_block_type() {
        Ok(ty)
    } else {
        Err(format!(
            "GGUF type {ty} is not a block-quantized type this reader decodes"
        ))
    }
}

fn dtype_code(d: DType) -> u8 {
    match d {
        DType::F32 => 1,
        DType::F16 => 2,
        DType::BF16 => 3,
    }
}

fn dtype_from_code(c: u8) -> Option<DType> {
    match c {
        1 => Some(DType::F32),
        2 => Some(DType::F16),
        3 => Some(DType::BF16),
        _ => None,
    }
}

/// Rounds `x` up to the next multiple of [`ALIGN`]; `None` on overflow.
pub(crate) fn align_up(x: u64) -> Option<u64> {
    x.checked_add(ALIGN - 1).map(|v| v & !(ALIGN - 1))
}

/// One section table entry, as written and as parsed.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Entry {
    pub name: String,
    pub tier: Tier,
    pub codec: Codec,
    pub layout: Layout,
    pub offset: u64,
    pub stored_len: u64,
    pub decoded_len: u64,
    pub sha256: [u8; 32],
}

impl Entry {
    pub fn encode(&self) -> [u8; ENTRY_LEN] {
        let mut b = [0u8; ENTRY_LEN];
        b[0..8].copy_from_slice(&self.offset.to_le_bytes());
        b[8..16].copy_from_slice(&self.stored_len.to_le_bytes());
        b[16..24].copy_from_slice(&self.decoded_len.to_le_bytes());
        b[24..56].copy_from_slice(&self.sha256);
        let (lcode, dtype, ndim, dims) = self.layout.encode();
        b[56..58].copy_from_slice(&self.codec.code().to_le_bytes());
        b[58..60].copy_from_slice(&lcode.to_le_bytes());
        b[60] = self.tier.code();
        b[61] = dtype;
        b[62] = ndim;
        for (i, d) in dims.iter().enumerate() {
            b[64 + 8 * i..72 + 8 * i].copy_from_slice(&d.to_le_bytes());
        }
        let name = self.name.as_bytes();
        b[96..98].copy_from_slice(&(name.len() as u16).to_le_bytes());
        b[98..98 + name.len()].copy_from_slice(name);
        b
    }

    /// Parses one entry; checks only what is local to the entry (codes, name, dims). File-level
    /// checks (bounds, alignment, overlap, uniqueness) are the reader's.
    pub fn decode(b: &[u8], index: usize) -> Result<Self, String> {
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().unwrap());
        let name_len = u16_at(96) as usize;
        if name_len == 0 || name_len > MAX_NAME_LEN {
            return Err(format!(
                "table entry {index}: name length {name_len} (1 to {MAX_NAME_LEN})"
            ));
        }
        let name = std::str::from_utf8(&b[98..98 + name_len])
            .map_err(|_| format!("table entry {index}: name is not UTF-8"))?
            .to_string();
        if b[98 + name_len..].iter().any(|&x| x != 0) || b[63] != 0 {
            return Err(format!(
                "section '{name}': nonzero reserved bytes in its entry"
            ));
        }
        let codec = Codec::from_code(u16_at(56))
            .ok_or_else(|| format!("section '{name}': unknown codec {}", u16_at(56)))?;
        let tier = Tier::from_code(b[60])
            .ok_or_else(|| format!("section '{name}': unknown tier {}", b[60]))?;
        let mut dims = [0u64; MAX_DIMS];
        for (i, d) in dims.iter_mut().enumerate() {
            *d = u64_at(64 + 8 * i);
        }
        let layout = Layout::decode(u16_at(58), b[61], b[62], dims)
            .map_err(|m| format!("section '{name}': bad layout: {m}"))?;
        Ok(Entry {
            offset: u64_at(0),
            stored_len: u64_at(8),
            decoded_len: u64_at(16),
            sha256: b[24..56].try_into().unwrap(),
            name,
            tier,
            codec,
            layout,
        })
    }
}

/// The footer's fields (docs/format.md, "Footer").
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Footer {
    pub metadata_offset: u64,
    pub metadata_stored_len: u64,
    pub metadata_decoded_len: u64,
    pub table_offset: u64,
    pub table_len: u64,
    pub section_count: u32,
    pub metadata_codec: Codec,
    pub checksum: [u8; 32],
    pub version: u32,
    pub flags: u32,
}

impl Footer {
    /// Bytes 0..48: the part the footer checksum covers.
    pub fn encode_fields(&self) -> [u8; 48] {
        let mut b = [0u8; 48];
        b[0..8].copy_from_slice(&self.metadata_offset.to_le_bytes());
        b[8..16].copy_from_slice(&self.metadata_stored_len.to_le_bytes());
        b[16..24].copy_from_slice(&self.metadata_decoded_len.to_le_bytes());
        b[24..32].copy_from_slice(&self.table_offset.to_le_bytes());
        b[32..40].copy_from_slice(&self.table_len.to_le_bytes());
        b[40..44].copy_from_slice(&self.section_count.to_le_bytes());
        b[44..46].copy_from_slice(&self.metadata_codec.code().to_le_bytes());
        b
    }

    pub fn encode(&self) -> [u8; FOOTER_LEN] {
        let mut b = [0u8; FOOTER_LEN];
        b[0..48].copy_from_slice(&self.encode_fields());
        b[48..80].copy_from_slice(&self.checksum);
        b[80..84].copy_from_slice(&self.version.to_le_bytes());
        b[84..88].copy_from_slice(&self.flags.to_le_bytes());
        b[92..96].copy_from_slice(&MAGIC);
        b
    }
}

/// The 64 meaningful header bytes: magic, version, flags, zero padding.
pub(crate) fn encode_header(flags: u32) -> [u8; HEADER_LEN] {
    let mut b = [0u8; HEADER_LEN];
    b[0..4].copy_from_slice(&MAGIC);
    b[4..8].copy_from_slice(&VERSION.to_le_bytes());
    b[8..12].copy_from_slice(&flags.to_le_bytes());
    b
}

/// SHA-256 over header ‖ metadata (stored) ‖ table ‖ footer bytes 0..48.
pub(crate) fn footer_checksum(
    header: &[u8],
    metadata: &[u8],
    table: &[u8],
    footer_fields: &[u8],
) -> [u8; 32] {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(header);
    h.update(metadata);
    h.update(table);
    h.update(footer_fields);
    h.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_round_trip_through_entry_bytes() {
        let layouts = [
            Layout::Bytes,
            Layout::Dense {
                dtype: DType::BF16,
                shape: vec![576, 1536],
            },
            Layout::PackedCodes {
                rows: 576,
                cols: 576,
                bits: 3,
                group: 128,
            },
            Layout::ColumnNibbles { out: 575, inp: 9 },
            Layout::GgufBlocks {
                rows: 1536,
                cols: 576,
                ggml_type: u64::from(crate::gguf::GgmlType::Q4_1.id()),
            },
        ];
        for (i, layout) in layouts.into_iter().enumerate() {
            let e = Entry {
                name: format!("layer.{i}.ü"),
                tier: Tier::Ssd,
                codec: Codec::Zstd,
                layout,
                offset: 4096 * 3,
                stored_len: 17,
                decoded_len: 99,
                sha256: [i as u8; 32],
            };
            assert_eq!(Entry::decode(&e.encode(), i).unwrap(), e);
        }
    }

    #[test]
    fn column_nibbles_length_and_column_bytes() {
        let l = Layout::ColumnNibbles { out: 575, inp: 9 };
        assert_eq!(l.column_bytes(), Some(288));
        assert_eq!(l.expected_len(), Ok(Some(288 * 9)));
        let huge = Layout::Dense {
            dtype: DType::F32,
            shape: vec![u64::MAX, 2],
        };
        assert_eq!(huge.expected_len(), Err(()));
    }

    #[test]
    fn gguf_blocks_take_whole_blocks_of_a_quantized_type() {
        use crate::gguf::GgmlType;
        let blocks = |cols: u64, ty: GgmlType| Layout::GgufBlocks {
            rows: 3,
            cols,
            ggml_type: u64::from(ty.id()),
        };
        // Q2_K: 84 bytes a super-block of 256; Q4_0: 18 bytes a block of 32.
        assert_eq!(
            blocks(512, GgmlType::Q2K).expected_len(),
            Ok(Some(3 * 2 * 84))
        );
        assert_eq!(
            blocks(64, GgmlType::Q4_0).expected_len(),
            Ok(Some(3 * 2 * 18))
        );
        let decode = |l: &Layout| {
            let (code, dtype, ndim, dims) = l.encode();
            Layout::decode(code, dtype, ndim, dims)
        };
        assert_eq!(
            decode(&blocks(512, GgmlType::Q2K)),
            Ok(blocks(512, GgmlType::Q2K))
        );
        let err = decode(&blocks(576, GgmlType::Q2K)).unwrap_err();
        assert!(err.contains("576 columns") && err.contains("Q2_K"), "{err}");
        let err = decode(&blocks(512, GgmlType::F16)).unwrap_err();
        assert!(err.contains("F16"), "{err}");
        let err = Layout::decode(6, 0, 3, [3, 512, 4, 0]).unwrap_err();
        assert!(err.contains("unknown GGUF type id 4"), "{err}");
    }

    #[test]
    fn unknown_codes_are_rejected_with_the_section_name() {
        let mut b = Entry {
            name: "w".into(),
            tier: Tier::Ram,
            codec: Codec::Raw,
            layout: Layout::Bytes,
            offset: 4096,
            stored_len: 1,
            decoded_len: 1,
            sha256: [0; 32],
        }
        .encode();
        b[60] = 7;
        assert_eq!(
            Entry::decode(&b, 0).unwrap_err(),
            "section 'w': unknown tier 7"
        );
        b[60] = 0;
        b[56] = 9;
        assert_eq!(
            Entry::decode(&b, 0).unwrap_err(),
            "section 'w': unknown codec 9"
        );
    }
}

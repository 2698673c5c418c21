//! Validating `.sfx` reader over a memory map (or owned bytes, for tests).
//!
//! Order of trust: footer magic and version → footer field bounds → footer checksum over
//! header, metadata and table → each table entry's codes → every section inside the data area,
//! aligned, non-overlapping, names unique. Only then is any offset used to slice. Section
//! payloads are verified on demand ([`SfxFile::verify`]) because hashing gigabytes on every
//! open would defeat mmap.

use super::{
    footer_checksum, Codec, Entry, Footer, Layout, SfxMetadata, Tier, ALIGN, ENTRY_LEN, FOOTER_LEN,
    HEADER_LEN, MAGIC, MAX_METADATA_LEN, MAX_SECTIONS, VERSION,
};
use crate::FormatError;
use rayon::prelude::*;
use sha2::Digest;
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

enum Storage {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// An opened, structurally validated `.sfx` file.
pub struct SfxFile {
    path: PathBuf,
    storage: Storage,
    /// The open file the map was made from, and its size and mtime then (`None` for
    /// [`SfxFile::from_bytes`]): readers of the same bytes open this inode, not the path, and
    /// [`SfxFile::check_unchanged`] compares against the stamp.
    opened: Option<(std::fs::File, FileStamp)>,
    entries: Vec<Entry>,
    index: HashMap<String, usize>,
    metadata: SfxMetadata,
}

/// What `fstat` says of a file's contents: a write or a truncation moves its size or mtime.
/// Not the ctime: unlinking the file (a new one renamed over its path, which leaves the open
/// inode intact) moves it too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    len: u64,
    mtime: (i64, i64),
}

impl FileStamp {
    fn of(m: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        FileStamp {
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
        }
    }
}

/// A section's table entry and its stored bytes (borrowed from the map).
#[derive(Debug, Clone, Copy)]
pub struct SectionView<'a> {
    pub name: &'a str,
    pub tier: Tier,
    pub codec: Codec,
    pub layout: &'a Layout,
    /// File offset of the first stored byte (a multiple of 4096).
    pub offset: u64,
    /// The stored bytes: the decoded bytes when `codec` is raw.
    pub bytes: &'a [u8],
    pub decoded_len: u64,
    pub sha256: &'a [u8; 32],
}

impl<'a> SectionView<'a> {
    /// The decoded bytes: borrowed for raw sections, decompressed (bounded by the recorded
    /// decoded length) for zstd ones.
    pub fn decode(&self) -> Result<Cow<'a, [u8]>, FormatError> {
        match self.codec {
            Codec::Raw => Ok(Cow::Borrowed(self.bytes)),
            Codec::Zstd => decode_zstd(self.bytes, self.decoded_len)
                .map(Cow::Owned)
                .map_err(|m| FormatError::Other(format!("section '{}': {m}", self.name))),
        }
    }
}

/// What [`SfxFile::verify`] checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    pub sections: usize,
    /// Stored bytes hashed.
    pub bytes: u64,
}

impl SfxFile {
    /// Memory-maps and validates a file (see the module doc for the order of checks).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, FormatError> {
        let path = path.as_ref().to_path_buf();
        let file = std::fs::File::open(&path).map_err(|e| FormatError::io(&path, e))?;
        let stamp = FileStamp::of(&file.metadata().map_err(|e| FormatError::io(&path, e))?);
        let len = stamp.len;
        if len < ALIGN + FOOTER_LEN as u64 {
            return Err(FormatError::invalid(
                &path,
                format!(
                    "file is {len} bytes, shorter than the smallest .sfx file ({} bytes): truncated or not a .sfx file",
                    ALIGN + FOOTER_LEN as u64
                ),
            ));
        }
        // SAFETY: the map is read-only; a file modified underneath us while mapped can give
        // garbage bytes (caught by checksums) but not memory unsafety in safe code here.
        // A file truncated under the map raises SIGBUS on the next touch of a lost page; the
        // CLIs turn that into a clear error (strataflux::mapped) and check the stamp before
        // reporting (`check_unchanged`).
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| FormatError::io(&path, e))?;
        Self::from_storage(path, Storage::Mmap(mmap), Some((file, stamp)))
    }

    /// Validates a file held in memory; `path` is only used in messages.
    pub fn from_bytes(path: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<Self, FormatError> {
        Self::from_storage(path.into(), Storage::Owned(bytes), None)
    }

    fn from_storage(
        path: PathBuf,
        storage: Storage,
        opened: Option<(std::fs::File, FileStamp)>,
    ) -> Result<Self, FormatError> {
        let (entries, metadata) =
            parse(storage.bytes()).map_err(|m| FormatError::invalid(&path, m))?;
        let index = entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.name.clone(), i))
            .collect();
        Ok(Self {
            path,
            storage,
            opened,
            entries,
            index,
            metadata,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn metadata(&self) -> &SfxMetadata {
        &self.metadata
    }

    /// The open file this container was mapped from (`None` for [`SfxFile::from_bytes`]).
    /// Whoever reads its bytes again (a refinement tier) should clone this handle rather than
    /// open the path: a file renamed over the path since is another inode, whose bytes were
    /// never validated against this table.
    pub fn file(&self) -> Option<&std::fs::File> {
        self.opened.as_ref().map(|(f, _)| f)
    }

    /// Errors when the mapped file has changed since [`SfxFile::open`] (size or mtime of the
    /// open inode): a truncation or an in-place rewrite, after which bytes read through
    /// the map may be other than those validated, so results computed from them must not be
    /// reported. A file replaced by a rename is another inode and leaves this one unchanged.
    /// Always `Ok` for [`SfxFile::from_bytes`].
    pub fn check_unchanged(&self) -> Result<(), FormatError> {
        let Some((file, then)) = &self.opened else {
            return Ok(());
        };
        let now = FileStamp::of(
            &file
                .metadata()
                .map_err(|e| FormatError::io(&self.path, e))?,
        );
        if now == *then {
            return Ok(());
        }
        let what = if now.len != then.len {
            format!(
                "its size went from {} to {} bytes (truncated or rewritten)",
                then.len, now.len
            )
        } else {
            "it was written to in place (its modification time moved)".to_string()
        };
        Err(FormatError::invalid(
            &self.path,
            format!(
                "the file changed on disk while it was in use: {what}; results read from it \
                 cannot be trusted (replace a model by renaming a new file over it, never by \
                 writing into it)"
            ),
        ))
    }

    /// A digest naming this container's contents: SHA-256 over every section's name and
    /// recorded SHA-256 in table order (hex). No section data is read, so it is instant; two
    /// files with equal sections and names share it (e.g. a byte-identical re-conversion).
    pub fn content_digest(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for e in &self.entries {
            h.update((e.name.len() as u64).to_le_bytes());
            h.update(e.name.as_bytes());
            h.update(e.sha256);
        }
        format!("{:x}", h.finalize())
    }

    /// All sections in table (writer) order.
    pub fn sections(&self) -> impl Iterator<Item = SectionView<'_>> + '_ {
        self.entries.iter().map(|e| self.view(e))
    }

    pub fn section(&self, name: &str) -> Result<SectionView<'_>, FormatError> {
        let i = self.index.get(name).ok_or_else(|| {
            FormatError::invalid(&self.path, format!("no section named '{name}'"))
        })?;
        Ok(self.view(&self.entries[*i]))
    }

    /// `len` bytes at `offset` within a raw section: e.g. one refinement column,
    /// `read_range(name, i * col_bytes, col_bytes)`. Errors name the section.
    pub fn read_range(&self, name: &str, offset: u64, len: u64) -> Result<&[u8], FormatError> {
        let s = self.section(name)?;
        if s.codec != Codec::Raw {
            return Err(FormatError::invalid(
                &self.path,
                format!(
                    "section '{name}' is {}-compressed; ranges need codec raw",
                    s.codec.as_str()
                ),
            ));
        }
        match offset.checked_add(len) {
            Some(end) if end <= s.bytes.len() as u64 => Ok(&s.bytes[offset as usize..end as usize]),
            _ => Err(FormatError::invalid(
                &self.path,
                format!(
                    "section '{name}': range {offset}+{len} is outside its {} bytes",
                    s.bytes.len()
                ),
            )),
        }
    }

    /// Hashes every section's stored bytes (in parallel) and compares with the table. The error
    /// names every section that does not match.
    pub fn verify(&self) -> Result<VerifyReport, FormatError> {
        self.verify_where(|_| true)
    }

    /// [`SfxFile::verify`] for the sections `select` accepts (e.g. only the refinement tiers,
    /// checked before a run trusts them).
    pub fn verify_where(
        &self,
        select: impl Fn(&SectionView<'_>) -> bool + Sync,
    ) -> Result<VerifyReport, FormatError> {
        let chosen: Vec<&Entry> = self
            .entries
            .iter()
            .filter(|e| select(&self.view(e)))
            .collect();
        let bad: Vec<&str> = chosen
            .par_iter()
            .filter_map(|e| {
                let v = self.view(e);
                let got: [u8; 32] = sha2::Sha256::digest(v.bytes).into();
                (got != e.sha256).then_some(e.name.as_str())
            })
            .collect();
        if !bad.is_empty() {
            let list = bad
                .iter()
                .map(|n| format!("'{n}'"))
                .collect::<Vec<_>>()
                .join(", ");
            return Err(FormatError::invalid(
                &self.path,
                format!("checksum mismatch in section {list}: the file is corrupt"),
            ));
        }
        Ok(VerifyReport {
            sections: chosen.len(),
            bytes: chosen.iter().map(|e| e.stored_len).sum(),
        })
    }

    fn view<'a>(&'a self, e: &'a Entry) -> SectionView<'a> {
        // Bounds were validated by `parse`.
        let bytes = &self.storage.bytes()[e.offset as usize..(e.offset + e.stored_len) as usize];
        SectionView {
            name: &e.name,
            tier: e.tier,
            codec: e.codec,
            layout: &e.layout,
            offset: e.offset,
            bytes,
            decoded_len: e.decoded_len,
            sha256: &e.sha256,
        }
    }
}

impl std::fmt::Debug for SfxFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SfxFile")
            .field("path", &self.path)
            .field("sections", &self.entries.len())
            .finish()
    }
}

fn decode_zstd(stored: &[u8], decoded_len: u64) -> Result<Vec<u8>, String> {
    use std::io::Read;
    // Streamed, so memory grows with the bytes actually produced: a crafted table entry that
    // claims an absurd decoded length cannot make us allocate it up front.
    let mut out = Vec::with_capacity(decoded_len.min(64 << 20) as usize);
    let decoder =
        zstd::stream::read::Decoder::with_buffer(stored).map_err(|e| format!("zstd: {e}"))?;
    decoder
        .take(decoded_len.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(|e| format!("zstd decode failed: {e}"))?;
    if out.len() as u64 != decoded_len {
        return Err(format!(
            "decoded to {}{} bytes, the table says {decoded_len}",
            out.len(),
            if out.len() as u64 > decoded_len {
                "+"
            } else {
                ""
            }
        ));
    }
    Ok(out)
}

/// Every structural check; messages name the field or section at fault.
fn parse(b: &[u8]) -> Result<(Vec<Entry>, SfxMetadata), String> {
    let len = b.len() as u64;
    if len < ALIGN + FOOTER_LEN as u64 {
        return Err(format!(
            "file is {len} bytes, shorter than the smallest .sfx file: truncated or not a .sfx file"
        ));
    }
    if b[0..4] != MAGIC {
        return Err("bad header magic: not a .sfx file".into());
    }
    let f = &b[b.len() - FOOTER_LEN..];
    let u64_at = |o: usize| u64::from_le_bytes(f[o..o + 8].try_into().unwrap());
    let u32_at = |o: usize| u32::from_le_bytes(f[o..o + 4].try_into().unwrap());
    if f[92..96] != MAGIC {
        return Err("bad footer magic: the file is truncated or was not finished".into());
    }
    let version = u32_at(80);
    let header_version = u32::from_le_bytes(b[4..8].try_into().unwrap());
    if version != VERSION || header_version != VERSION {
        return Err(format!(
            "format version {header_version} (footer {version}); this reader supports {VERSION}"
        ));
    }
    let metadata_codec = Codec::from_code(u16::from_le_bytes(f[44..46].try_into().unwrap()))
        .ok_or("footer: unknown metadata codec")?;
    let footer = Footer {
        metadata_offset: u64_at(0),
        metadata_stored_len: u64_at(8),
        metadata_decoded_len: u64_at(16),
        table_offset: u64_at(24),
        table_len: u64_at(32),
        section_count: u32_at(40),
        metadata_codec,
        checksum: f[48..80].try_into().unwrap(),
        version,
        flags: u32_at(84),
    };
    if footer.flags != 0 || u32::from_le_bytes(b[8..12].try_into().unwrap()) != 0 {
        return Err("unknown flags set (version 1 defines none)".into());
    }
    if f[46..48] != [0, 0] || f[88..92] != [0; 4] || b[12..HEADER_LEN].iter().any(|&x| x != 0) {
        return Err("nonzero reserved bytes in header or footer".into());
    }
    let count = footer.section_count as u64;
    if count > MAX_SECTIONS {
        return Err(format!("footer: {count} sections (at most {MAX_SECTIONS})"));
    }
    let footer_start = len - FOOTER_LEN as u64;
    if footer.table_len != count * ENTRY_LEN as u64 {
        return Err(format!(
            "footer: table length {} for {count} sections of {ENTRY_LEN} bytes",
            footer.table_len
        ));
    }
    if footer.table_offset.checked_add(footer.table_len) != Some(footer_start) {
        return Err(format!(
            "footer: table {}+{} does not end at the footer ({footer_start}): truncated file?",
            footer.table_offset, footer.table_len
        ));
    }
    let meta_end = footer
        .metadata_offset
        .checked_add(footer.metadata_stored_len)
        .ok_or("footer: metadata offset + length overflows")?;
    if footer.metadata_offset < ALIGN
        || !footer.metadata_offset.is_multiple_of(ALIGN)
        || meta_end != footer.table_offset
    {
        return Err(format!(
            "footer: metadata block {}+{} is not a 4 KiB-aligned block ending at the table ({})",
            footer.metadata_offset, footer.metadata_stored_len, footer.table_offset
        ));
    }
    if footer.metadata_decoded_len > MAX_METADATA_LEN {
        return Err(format!(
            "footer: metadata decodes to {} bytes (at most {MAX_METADATA_LEN})",
            footer.metadata_decoded_len
        ));
    }
    let meta_stored = &b[footer.metadata_offset as usize..meta_end as usize];
    let table = &b[footer.table_offset as usize..footer_start as usize];
    let want = footer_checksum(&b[..HEADER_LEN], meta_stored, table, &f[..48]);
    if want != footer.checksum {
        return Err("header/metadata/table checksum mismatch: the file's index is corrupt".into());
    }

    let mut entries = Vec::with_capacity(count as usize);
    for (i, raw) in table.chunks_exact(ENTRY_LEN).enumerate() {
        entries.push(Entry::decode(raw, i)?);
    }
    validate_sections(&entries, footer.metadata_offset)?;

    let json = match footer.metadata_codec {
        Codec::Raw => {
            if footer.metadata_decoded_len != footer.metadata_stored_len {
                return Err("footer: raw metadata with differing lengths".into());
            }
            meta_stored.to_vec()
        }
        Codec::Zstd => decode_zstd(meta_stored, footer.metadata_decoded_len)
            .map_err(|m| format!("metadata block: {m}"))?,
    };
    let metadata: SfxMetadata =
        serde_json::from_slice(&json).map_err(|e| format!("metadata block: {e}"))?;
    Ok((entries, metadata))
}

/// Sections lie in [ALIGN, data_end), start 4 KiB-aligned, do not overlap, have unique names
/// and lengths consistent with codec and layout.
fn validate_sections(entries: &[Entry], data_end: u64) -> Result<(), String> {
    let mut names = HashMap::with_capacity(entries.len());
    for e in entries {
        let name = &e.name;
        if names.insert(name.as_str(), ()).is_some() {
            return Err(format!("section '{name}' appears twice in the table"));
        }
        if !e.offset.is_multiple_of(ALIGN) {
            return Err(format!(
                "section '{name}': offset {} is not 4 KiB-aligned",
                e.offset
            ));
        }
        let end = e
            .offset
            .checked_add(e.stored_len)
            .ok_or_else(|| format!("section '{name}': offset + length overflows"))?;
        if e.offset < ALIGN || end > data_end {
            return Err(format!(
                "section '{name}': bytes {}..{end} are outside the data area {ALIGN}..{data_end} (truncated or corrupt file)",
                e.offset
            ));
        }
        match e.codec {
            Codec::Raw if e.decoded_len != e.stored_len => {
                return Err(format!(
                    "section '{name}': raw codec but stored {} != decoded {} bytes",
                    e.stored_len, e.decoded_len
                ))
            }
            _ => {}
        }
        match e.layout.expected_len() {
            Ok(Some(n)) if n != e.decoded_len => {
                return Err(format!(
                    "section '{name}': layout {:?} needs {n} bytes, the table says {}",
                    e.layout, e.decoded_len
                ))
            }
            Err(()) => return Err(format!("section '{name}': layout size overflows")),
            _ => {}
        }
    }
    let mut by_offset: Vec<&Entry> = entries.iter().collect();
    by_offset.sort_by_key(|e| (e.offset, e.stored_len));
    for w in by_offset.windows(2) {
        // No overflow: both ends were checked above.
        if w[0].offset + w[0].stored_len > w[1].offset {
            return Err(format!(
                "sections '{}' and '{}' overlap",
                w[0].name, w[1].name
            ));
        }
    }
    Ok(())
}

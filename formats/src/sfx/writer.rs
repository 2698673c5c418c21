//! Streaming, atomic, deterministic `.sfx` writer.

use super::{
    align_up, encode_header, footer_checksum, Codec, Entry, Footer, Layout, SfxMetadata, Tier,
    ALIGN, ENTRY_LEN, HEADER_LEN, MAX_METADATA_LEN, MAX_NAME_LEN, MAX_SECTIONS, VERSION,
};
use crate::atomic::AtomicFile;
use crate::FormatError;
use sha2::Digest;
use std::collections::HashSet;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

/// What a section is, given when it is added.
#[derive(Debug, Clone, PartialEq)]
pub struct SectionSpec {
    pub name: String,
    pub tier: Tier,
    pub codec: Codec,
    pub layout: Layout,
}

impl SectionSpec {
    pub fn new(name: impl Into<String>, tier: Tier, codec: Codec, layout: Layout) -> Self {
        Self {
            name: name.into(),
            tier,
            codec,
            layout,
        }
    }
}

/// Writes a `.sfx` file in one forward pass. Sections appear in the file and the table in the
/// order they are added. Nothing is visible at the output path until [`SfxWriter::finish`]
/// succeeds; dropping the writer (or a panic, or a kill) leaves no file there.
pub struct SfxWriter {
    file: AtomicFile,
    path: PathBuf,
    /// Bytes written so far (the next write's file offset).
    pos: u64,
    entries: Vec<Entry>,
    names: HashSet<String>,
    /// Set while a [`SectionWriter`] is open; still set if one was dropped unfinished.
    section_open: bool,
}

impl SfxWriter {
    pub fn create(path: impl AsRef<Path>) -> Result<Self, FormatError> {
        let path = path.as_ref().to_path_buf();
        let mut file = AtomicFile::create(&path)?;
        let mut block = vec![0u8; ALIGN as usize];
        block[..HEADER_LEN].copy_from_slice(&encode_header(0));
        file.write_all(&block)?;
        Ok(Self {
            file,
            path,
            pos: ALIGN,
            entries: Vec::new(),
            names: HashSet::new(),
            section_open: false,
        })
    }

    /// Adds a section whose bytes are in memory.
    pub fn add_section(&mut self, spec: SectionSpec, bytes: &[u8]) -> Result<(), FormatError> {
        let mut w = self.begin_section(spec)?;
        w.write_all(bytes)
            .map_err(|e| FormatError::io(w.path.clone(), e))?;
        w.finish()
    }

    /// Starts a section to be streamed through [`Write`]; call [`SectionWriter::finish`] when
    /// done. Only one section is open at a time (the borrow enforces it).
    pub fn begin_section(&mut self, spec: SectionSpec) -> Result<SectionWriter<'_>, FormatError> {
        self.check_usable()?;
        let bad = |msg: String| FormatError::invalid(&self.path, msg);
        if spec.name.is_empty() || spec.name.len() > MAX_NAME_LEN {
            return Err(bad(format!(
                "section name '{}' is {} bytes (1 to {MAX_NAME_LEN})",
                spec.name,
                spec.name.len()
            )));
        }
        if self.names.contains(&spec.name) {
            return Err(bad(format!("section '{}' added twice", spec.name)));
        }
        if self.entries.len() as u64 >= MAX_SECTIONS {
            return Err(bad(format!("more than {MAX_SECTIONS} sections")));
        }
        if let Layout::Dense { shape, .. } = &spec.layout {
            if shape.is_empty() || shape.len() > super::MAX_DIMS {
                return Err(bad(format!(
                    "section '{}': dense layout needs 1 to 4 dims, got {}",
                    spec.name,
                    shape.len()
                )));
            }
        }
        if let Layout::PackedCodes { bits, .. } = spec.layout {
            if !(1..=8).contains(&bits) {
                return Err(bad(format!(
                    "section '{}': packed codes of {bits} bits (1 to 8)",
                    spec.name
                )));
            }
        }
        // Sections start 4 KiB-aligned; the previous one is followed by zero padding.
        self.pad_to_alignment()?;
        self.section_open = true;
        let sink = HashingSink {
            inner: self.file.writer(),
            hasher: sha2::Sha256::new(),
            written: 0,
        };
        let sink = match spec.codec {
            Codec::Raw => Sink::Raw(sink),
            Codec::Zstd => Sink::Zstd(
                zstd::stream::write::Encoder::new(sink, Codec::ZSTD_LEVEL)
                    .map_err(|e| FormatError::io(&self.path, e))?,
            ),
        };
        Ok(SectionWriter {
            sink: Some(sink),
            decoded_len: 0,
            spec,
            offset: self.pos,
            path: self.path.clone(),
            pos: &mut self.pos,
            entries: &mut self.entries,
            names: &mut self.names,
            section_open: &mut self.section_open,
        })
    }

    /// Writes the metadata block, the section table and the footer, then fsyncs and renames
    /// the file into place.
    pub fn finish(mut self, metadata: &SfxMetadata) -> Result<(), FormatError> {
        self.check_usable()?;
        let json = serde_json::to_vec(metadata)
            .map_err(|e| FormatError::invalid(&self.path, format!("metadata: {e}")))?;
        if json.len() as u64 > MAX_METADATA_LEN {
            return Err(FormatError::invalid(
                &self.path,
                format!(
                    "metadata is {} bytes (at most {MAX_METADATA_LEN})",
                    json.len()
                ),
            ));
        }
        let stored = zstd::bulk::compress(&json, Codec::METADATA_ZSTD_LEVEL)
            .map_err(|e| FormatError::io(&self.path, e))?;
        self.pad_to_alignment()?;
        let metadata_offset = self.pos;
        self.write(&stored)?;
        let mut table = Vec::with_capacity(self.entries.len() * ENTRY_LEN);
        for e in &self.entries {
            table.extend_from_slice(&e.encode());
        }
        let table_offset = self.pos;
        self.write(&table)?;
        let mut footer = Footer {
            metadata_offset,
            metadata_stored_len: stored.len() as u64,
            metadata_decoded_len: json.len() as u64,
            table_offset,
            table_len: table.len() as u64,
            section_count: self.entries.len() as u32,
            metadata_codec: Codec::Zstd,
            checksum: [0; 32],
            version: VERSION,
            flags: 0,
        };
        footer.checksum =
            footer_checksum(&encode_header(0), &stored, &table, &footer.encode_fields());
        self.write(&footer.encode())?;
        self.file.commit()
    }

    fn check_usable(&self) -> Result<(), FormatError> {
        if self.section_open {
            return Err(FormatError::invalid(
                &self.path,
                "a section writer was dropped without finish(); the file is incomplete",
            ));
        }
        Ok(())
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), FormatError> {
        self.file.write_all(bytes)?;
        self.pos += bytes.len() as u64;
        Ok(())
    }

    fn pad_to_alignment(&mut self) -> Result<(), FormatError> {
        let target = align_up(self.pos).expect("file offsets stay far below u64::MAX");
        let zeros = [0u8; ALIGN as usize];
        self.write(&zeros[..(target - self.pos) as usize])
    }
}

/// Counts and hashes the stored bytes on their way to the file: the checksum is computed
/// while writing, never by reading the file back.
struct HashingSink<'a> {
    inner: &'a mut BufWriter<File>,
    hasher: sha2::Sha256,
    written: u64,
}

impl Write for HashingSink<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

enum Sink<'a> {
    Raw(HashingSink<'a>),
    Zstd(zstd::stream::write::Encoder<'static, HashingSink<'a>>),
}

/// One section being streamed. Write its decoded bytes, then call [`SectionWriter::finish`].
/// Dropping it unfinished makes the [`SfxWriter`] refuse further use (the output file is
/// never created).
pub struct SectionWriter<'a> {
    sink: Option<Sink<'a>>,
    decoded_len: u64,
    spec: SectionSpec,
    offset: u64,
    path: PathBuf,
    pos: &'a mut u64,
    entries: &'a mut Vec<Entry>,
    names: &'a mut HashSet<String>,
    section_open: &'a mut bool,
}

impl Write for SectionWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = match self.sink.as_mut().expect("sink present until finish") {
            Sink::Raw(s) => s.write(buf)?,
            Sink::Zstd(s) => s.write(buf)?,
        };
        self.decoded_len += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        match self.sink.as_mut().expect("sink present until finish") {
            Sink::Raw(s) => s.flush(),
            Sink::Zstd(s) => s.flush(),
        }
    }
}

impl SectionWriter<'_> {
    /// Ends the section and records its table entry (offset, lengths, SHA-256 of the stored
    /// bytes). Fails if the byte count disagrees with the layout's shape.
    pub fn finish(mut self) -> Result<(), FormatError> {
        let sink = match self.sink.take().expect("sink present until finish") {
            Sink::Raw(s) => s,
            Sink::Zstd(enc) => enc.finish().map_err(|e| FormatError::io(&self.path, e))?,
        };
        let name = &self.spec.name;
        match self.spec.layout.expected_len() {
            Ok(Some(n)) if n != self.decoded_len => {
                return Err(FormatError::invalid(
                    &self.path,
                    format!(
                        "section '{name}': layout {:?} needs {n} bytes, {} were written",
                        self.spec.layout, self.decoded_len
                    ),
                ))
            }
            Err(()) => {
                return Err(FormatError::invalid(
                    &self.path,
                    format!("section '{name}': layout size overflows u64"),
                ))
            }
            _ => {}
        }
        let stored_len = sink.written;
        self.entries.push(Entry {
            name: name.clone(),
            tier: self.spec.tier,
            codec: self.spec.codec,
            layout: self.spec.layout.clone(),
            offset: self.offset,
            stored_len,
            decoded_len: self.decoded_len,
            sha256: sink.hasher.finalize().into(),
        });
        self.names.insert(name.clone());
        *self.pos += stored_len;
        *self.section_open = false;
        Ok(())
    }
}

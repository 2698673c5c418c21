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
use std::io::{self, BufReader, BufWriter, Read, Write};
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

/// Where a resumable writer stood at a durable point ([`SfxWriter::checkpoint`]): what
/// [`SfxWriter::resume`] needs to continue after a crash.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WriterCheckpoint {
    /// Bytes of the temporary file that belong to finished sections; a resumed writer
    /// discards everything after them.
    pub len: u64,
    /// The section table so far: the 256-byte entries as written at the end of the file,
    /// in lowercase hex.
    pub table: String,
}

/// The header block every file starts with.
fn header_block() -> Vec<u8> {
    let mut block = vec![0u8; ALIGN as usize];
    block[..HEADER_LEN].copy_from_slice(&encode_header(0));
    block
}

impl SfxWriter {
    pub fn create(path: impl AsRef<Path>) -> Result<Self, FormatError> {
        let path = path.as_ref().to_path_buf();
        let file = AtomicFile::create(&path)?;
        Self::start(file, path)
    }

    /// [`SfxWriter::create`] with the bytes going to `part` (kept if the writer dies) until
    /// [`SfxWriter::finish`] renames it to `path`; [`SfxWriter::checkpoint`] marks durable
    /// points to resume from. `part` must be on `path`'s filesystem.
    pub fn create_resumable(
        path: impl AsRef<Path>,
        part: impl AsRef<Path>,
    ) -> Result<Self, FormatError> {
        let path = path.as_ref().to_path_buf();
        let file = AtomicFile::create_resumable(&path, part)?;
        Self::start(file, path)
    }

    fn start(mut file: AtomicFile, path: PathBuf) -> Result<Self, FormatError> {
        file.write_all(&header_block())?;
        Ok(Self {
            file,
            path,
            pos: ALIGN,
            entries: Vec::new(),
            names: HashSet::new(),
            section_open: false,
        })
    }

    /// Makes every finished section durable (flush, fsync) and returns the state that
    /// [`SfxWriter::resume`] continues from. Record it only after this returns: then a crash
    /// at any instant leaves a recorded state whose bytes are on disk.
    pub fn checkpoint(&mut self) -> Result<WriterCheckpoint, FormatError> {
        self.check_usable()?;
        self.file.sync()?;
        let mut table = String::with_capacity(self.entries.len() * ENTRY_LEN * 2);
        for e in &self.entries {
            for b in e.encode() {
                table.push_str(&format!("{b:02x}"));
            }
        }
        Ok(WriterCheckpoint {
            len: self.pos,
            table,
        })
    }

    /// Continues the resumable file `part` (of [`SfxWriter::create_resumable`]) from
    /// `checkpoint`. The file's first `checkpoint.len` bytes are checked against the recorded
    /// table (header block, every section's place, zero padding and SHA-256), so a file that
    /// is not the one the checkpoint describes is refused, naming what is wrong; the bytes
    /// after them are cut off.
    pub fn resume(
        path: impl AsRef<Path>,
        part: impl AsRef<Path>,
        checkpoint: &WriterCheckpoint,
    ) -> Result<Self, FormatError> {
        let (path, part) = (path.as_ref().to_path_buf(), part.as_ref());
        let bad = |msg: String| FormatError::invalid(part, msg);
        let entries = decode_table(&checkpoint.table).map_err(&bad)?;
        check_prefix(part, checkpoint.len, &entries)?;
        let file = AtomicFile::reopen_resumable(&path, part, checkpoint.len)?;
        let mut names = HashSet::new();
        for e in &entries {
            if !names.insert(e.name.clone()) {
                return Err(bad(format!("checkpoint lists section '{}' twice", e.name)));
            }
        }
        Ok(Self {
            file,
            path,
            pos: checkpoint.len,
            entries,
            names,
            section_open: false,
        })
    }

    /// The decoded bytes of section `name`, already written (a resumed conversion reads back
    /// the model-wide sections it compares later ones with).
    pub fn read_section(&mut self, name: &str) -> Result<Vec<u8>, FormatError> {
        self.check_usable()?;
        let tmp = self.file.tmp_path().to_path_buf();
        let entry = self
            .entries
            .iter()
            .find(|e| e.name == name)
            .ok_or_else(|| FormatError::invalid(&tmp, format!("no section '{name}' written")))?
            .clone();
        self.file
            .writer()
            .flush()
            .map_err(|e| FormatError::io(&tmp, e))?;
        let mut f = File::open(&tmp).map_err(|e| FormatError::io(&tmp, e))?;
        io::Seek::seek(&mut f, io::SeekFrom::Start(entry.offset))
            .map_err(|e| FormatError::io(&tmp, e))?;
        let mut stored = Vec::new();
        f.take(entry.stored_len)
            .read_to_end(&mut stored)
            .map_err(|e| FormatError::io(&tmp, e))?;
        match entry.codec {
            Codec::Raw => Ok(stored),
            Codec::Zstd => zstd::bulk::decompress(&stored, entry.decoded_len as usize)
                .map_err(|e| FormatError::invalid(&tmp, format!("section '{name}': {e}"))),
        }
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

/// The entries of a [`WriterCheckpoint::table`].
fn decode_table(hex: &str) -> Result<Vec<Entry>, String> {
    let bytes = hex.as_bytes();
    if !bytes.len().is_multiple_of(2 * ENTRY_LEN) {
        return Err(format!(
            "checkpoint table is {} hex digits, not a multiple of {}",
            bytes.len(),
            2 * ENTRY_LEN
        ));
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Ok(c - b'0'),
        b'a'..=b'f' => Ok(c - b'a' + 10),
        _ => Err(format!(
            "checkpoint table: {:?} is not a hex digit",
            c as char
        )),
    };
    let raw = bytes
        .chunks_exact(2)
        .map(|p| Ok(digit(p[0])? << 4 | digit(p[1])?))
        .collect::<Result<Vec<u8>, String>>()?;
    raw.chunks_exact(ENTRY_LEN)
        .enumerate()
        .map(|(i, b)| Entry::decode(b, i))
        .collect()
}

/// Checks that the first `len` bytes of `part` are a header block followed by exactly the
/// sections of `entries`: each at the next 4 KiB boundary after zero padding, with its
/// recorded SHA-256, the last ending at `len`.
fn check_prefix(part: &Path, len: u64, entries: &[Entry]) -> Result<(), FormatError> {
    let io = |e| FormatError::io(part, e);
    let bad = |msg: String| FormatError::invalid(part, msg);
    let on_disk = part.metadata().map_err(io)?.len();
    if on_disk < len {
        return Err(bad(format!(
            "{on_disk} bytes, but its checkpoint says {len} were written"
        )));
    }
    let mut r = BufReader::with_capacity(1 << 20, File::open(part).map_err(io)?);
    let mut header = vec![0u8; ALIGN as usize];
    r.read_exact(&mut header).map_err(io)?;
    if header != header_block() {
        return Err(bad("does not start with an .sfx header block".into()));
    }
    let mut pos = ALIGN;
    let mut buf = vec![0u8; 1 << 20];
    for e in entries {
        let start = align_up(pos).unwrap_or(u64::MAX);
        let end = e.offset.checked_add(e.stored_len);
        if e.offset != start || end.is_none_or(|end| end > len) {
            return Err(bad(format!(
                "section '{}' at {}+{} is not where its checkpoint's table puts the next                  section ({start}, within {len} bytes)",
                e.name, e.offset, e.stored_len
            )));
        }
        let pad = (start - pos) as usize;
        r.read_exact(&mut buf[..pad]).map_err(io)?;
        if buf[..pad].iter().any(|&b| b != 0) {
            return Err(bad(format!("nonzero padding before section '{}'", e.name)));
        }
        let mut hasher = sha2::Sha256::new();
        let mut left = e.stored_len;
        while left > 0 {
            let n = left.min(buf.len() as u64) as usize;
            r.read_exact(&mut buf[..n]).map_err(io)?;
            hasher.update(&buf[..n]);
            left -= n as u64;
        }
        if <[u8; 32]>::from(hasher.finalize()) != e.sha256 {
            return Err(bad(format!(
                "section '{}' does not match its checksum in the checkpoint",
                e.name
            )));
        }
        pos = start + e.stored_len;
    }
    if pos != len {
        return Err(bad(format!(
            "its checkpoint's sections end at {pos}, but the checkpoint says {len} bytes"
        )));
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sfx::SfxFile;
    use crate::DType;

    fn dense(n: usize, seed: u8) -> (SectionSpec, Vec<u8>, String) {
        let name = format!("t{seed}");
        let layout = Layout::Dense {
            dtype: DType::F32,
            shape: vec![n as u64],
        };
        let bytes = (0..4 * n).map(|i| (i as u8).wrapping_mul(seed)).collect();
        (
            SectionSpec::new(name.clone(), Tier::Resident, Codec::Raw, layout),
            bytes,
            name,
        )
    }

    fn add(w: &mut SfxWriter, n: usize, seed: u8) {
        let (spec, bytes, _) = dense(n, seed);
        w.add_section(spec, &bytes).unwrap();
    }

    #[test]
    fn resumed_writer_ends_byte_identical_to_one_that_was_never_interrupted() {
        let dir = tempfile::tempdir().unwrap();
        let straight = dir.path().join("straight.sfx");
        let mut w = SfxWriter::create(&straight).unwrap();
        for (n, seed) in [(3000, 3), (10, 5), (2000, 7)] {
            add(&mut w, n, seed);
        }
        w.finish(&SfxMetadata::default()).unwrap();

        let (dest, part) = (dir.path().join("out.sfx"), dir.path().join("out.part"));
        let cp = {
            let mut w = SfxWriter::create_resumable(&dest, &part).unwrap();
            add(&mut w, 3000, 3);
            add(&mut w, 10, 5);
            let cp = w.checkpoint().unwrap();
            // Killed half-way through the next section: its bytes are past the checkpoint.
            let (spec, bytes, _) = dense(2000, 7);
            let mut s = w.begin_section(spec).unwrap();
            s.write_all(&bytes[..1000]).unwrap();
            s.flush().unwrap();
            cp
        };
        assert!(!dest.exists() && part.metadata().unwrap().len() > cp.len);
        let mut w = SfxWriter::resume(&dest, &part, &cp).unwrap();
        assert_eq!(w.read_section("t5").unwrap(), dense(10, 5).1);
        add(&mut w, 2000, 7);
        w.finish(&SfxMetadata::default()).unwrap();
        assert_eq!(
            std::fs::read(&dest).unwrap(),
            std::fs::read(&straight).unwrap()
        );
        assert!(!part.exists());
        SfxFile::open(&dest).unwrap().verify().unwrap();
    }

    #[test]
    fn resume_refuses_a_file_its_checkpoint_does_not_describe() {
        let dir = tempfile::tempdir().unwrap();
        let (dest, part) = (dir.path().join("out.sfx"), dir.path().join("out.part"));
        let mut w = SfxWriter::create_resumable(&dest, &part).unwrap();
        add(&mut w, 3000, 3);
        add(&mut w, 10, 5);
        let cp = w.checkpoint().unwrap();
        drop(w);
        let good = std::fs::read(&part).unwrap();
        let err = |bytes: &[u8], cp: &WriterCheckpoint| {
            std::fs::write(&part, bytes).unwrap();
            SfxWriter::resume(&dest, &part, cp)
                .err()
                .expect("refused")
                .to_string()
        };
        let mut flipped = good.clone();
        flipped[(ALIGN + 5) as usize] ^= 1;
        let e = err(&flipped, &cp);
        assert!(e.contains("'t3'") && e.contains("checksum"), "{e}");
        let e = err(&good[..good.len() - 1], &cp);
        assert!(e.contains("checkpoint says"), "{e}");
        let short = WriterCheckpoint {
            len: cp.len - 1,
            ..cp.clone()
        };
        let e = err(&good, &short);
        assert!(e.contains("t5"), "{e}");
        let odd = WriterCheckpoint {
            table: cp.table[1..].to_string(),
            ..cp.clone()
        };
        assert!(err(&good, &odd).contains("hex digits"));
        // Untouched, it resumes.
        std::fs::write(&part, &good).unwrap();
        SfxWriter::resume(&dest, &part, &cp).unwrap();
    }
}

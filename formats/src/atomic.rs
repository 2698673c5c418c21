//! Crash-safe writes: data goes to a temporary file in the destination directory, is fsynced,
//! then renamed over the destination, and the directory is fsynced. A killed writer leaves at
//! most a `*.tmp` file behind, never a truncated file at the output path.
//!
//! A resumable file ([`AtomicFile::create_resumable`]) has a temporary at a path its caller
//! chooses, kept when the writer dies, so a later run can cut it back to its last durable
//! length and go on ([`AtomicFile::reopen_resumable`]).

use crate::FormatError;
use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// A file being written; becomes visible at `dest` only on [`AtomicFile::commit`]. Dropped
/// without commit, it removes its temporary file, unless it is resumable.
pub struct AtomicFile {
    dest: PathBuf,
    tmp: PathBuf,
    writer: Option<BufWriter<File>>,
    /// The temporary belongs to a checkpoint of the caller's and outlives this writer.
    keep_tmp: bool,
}

impl AtomicFile {
    pub fn create(dest: impl AsRef<Path>) -> Result<Self, FormatError> {
        let dest = dest.as_ref().to_path_buf();
        let dir = parent_dir(&dest);
        let file_name = dest
            .file_name()
            .ok_or_else(|| FormatError::invalid(&dest, "output path has no file name"))?
            .to_string_lossy()
            .into_owned();
        let tmp = dir.join(format!(".{file_name}.{}.tmp", std::process::id()));
        let file = File::create(&tmp).map_err(|e| FormatError::io(&tmp, e))?;
        Ok(Self::writing(dest, tmp, file, false))
    }

    /// The writer of `file` (open at `tmp`), renamed to `dest` on commit.
    fn writing(dest: PathBuf, tmp: PathBuf, file: File, keep_tmp: bool) -> Self {
        Self {
            dest,
            tmp,
            writer: Some(BufWriter::with_capacity(1 << 20, file)),
            keep_tmp,
        }
    }

    /// A file written at the temporary path `tmp` (created, or emptied if it exists) and
    /// renamed to `dest` on commit; dropped uncommitted, `tmp` stays for
    /// [`AtomicFile::reopen_resumable`]. `tmp` must be on `dest`'s filesystem.
    pub fn create_resumable(
        dest: impl AsRef<Path>,
        tmp: impl AsRef<Path>,
    ) -> Result<Self, FormatError> {
        let tmp = tmp.as_ref().to_path_buf();
        let file = File::create(&tmp).map_err(|e| FormatError::io(&tmp, e))?;
        Ok(Self::writing(dest.as_ref().to_path_buf(), tmp, file, true))
    }

    /// Continues the resumable temporary `tmp`: its first `len` bytes stay, anything after
    /// them (what was being written when the last writer died) is cut off.
    pub fn reopen_resumable(
        dest: impl AsRef<Path>,
        tmp: impl AsRef<Path>,
        len: u64,
    ) -> Result<Self, FormatError> {
        let tmp = tmp.as_ref().to_path_buf();
        let io = |e| FormatError::io(&tmp, e);
        let mut file = OpenOptions::new().write(true).open(&tmp).map_err(io)?;
        let on_disk = file.metadata().map_err(io)?.len();
        if on_disk < len {
            return Err(FormatError::invalid(
                &tmp,
                format!("{on_disk} bytes, but its checkpoint says {len} were written"),
            ));
        }
        file.set_len(len).map_err(io)?;
        file.seek(SeekFrom::End(0)).map_err(io)?;
        Ok(Self::writing(dest.as_ref().to_path_buf(), tmp, file, true))
    }

    /// The temporary file the bytes go to until commit.
    pub fn tmp_path(&self) -> &Path {
        &self.tmp
    }

    /// Makes everything written so far durable (flush, fsync) without committing: a checkpoint
    /// recorded after this names bytes that survive a crash.
    pub fn sync(&mut self) -> Result<(), FormatError> {
        let tmp = self.tmp.clone();
        let w = self.writer();
        w.flush().map_err(|e| FormatError::io(&tmp, e))?;
        w.get_ref()
            .sync_data()
            .map_err(|e| FormatError::io(&tmp, e))
    }

    pub fn writer(&mut self) -> &mut BufWriter<File> {
        // Invariant: `writer` is only taken by `commit`, which consumes self.
        self.writer.as_mut().expect("writer present until commit")
    }

    pub fn write_all(&mut self, bytes: &[u8]) -> Result<(), FormatError> {
        let tmp = self.tmp.clone();
        self.writer()
            .write_all(bytes)
            .map_err(|e| FormatError::io(tmp, e))
    }

    pub fn commit(mut self) -> Result<(), FormatError> {
        let writer = self.writer.take().expect("writer present until commit");
        let file = writer
            .into_inner()
            .map_err(|e| FormatError::io(&self.tmp, e.into_error()))?;
        file.sync_all().map_err(|e| FormatError::io(&self.tmp, e))?;
        drop(file);
        fs::rename(&self.tmp, &self.dest).map_err(|e| FormatError::io(&self.dest, e))?;
        sync_dir(&parent_dir(&self.dest));
        Ok(())
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if self.writer.is_some() && !self.keep_tmp {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

/// Writes a whole file atomically.
pub fn write_atomic(dest: impl AsRef<Path>, bytes: &[u8]) -> Result<(), FormatError> {
    let mut f = AtomicFile::create(dest)?;
    f.write_all(bytes)?;
    f.commit()
}

pub(crate) fn parent_dir(p: &Path) -> PathBuf {
    match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

pub(crate) fn sync_dir(dir: &Path) {
    // Directory fsync makes the rename durable; some filesystems refuse it, which is harmless.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uncommitted_file_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("out.bin");
        {
            let mut f = AtomicFile::create(&dest).unwrap();
            f.write_all(b"partial").unwrap();
        }
        assert!(!dest.exists());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn committed_file_replaces_destination() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("out.bin");
        fs::write(&dest, b"old").unwrap();
        write_atomic(&dest, b"new").unwrap();
        assert_eq!(fs::read(&dest).unwrap(), b"new");
    }

    #[test]
    fn resumable_file_survives_drop_and_continues_from_its_durable_length() {
        let dir = tempfile::tempdir().unwrap();
        let (dest, tmp) = (dir.path().join("out.bin"), dir.path().join("out.part"));
        {
            let mut f = AtomicFile::create_resumable(&dest, &tmp).unwrap();
            f.write_all(b"kept").unwrap();
            f.sync().unwrap();
            f.write_all(b" torn").unwrap();
        }
        assert!(!dest.exists());
        assert_eq!(fs::read(&tmp).unwrap(), b"kept torn");
        let mut f = AtomicFile::reopen_resumable(&dest, &tmp, 4).unwrap();
        f.write_all(b" and more").unwrap();
        f.commit().unwrap();
        assert_eq!(fs::read(&dest).unwrap(), b"kept and more");
        assert!(!tmp.exists());
        // A checkpoint claiming more bytes than the file holds is refused, naming the file.
        fs::write(&tmp, b"abc").unwrap();
        let err = AtomicFile::reopen_resumable(&dest, &tmp, 10)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("out.part") && err.contains("3 bytes"), "{err}");
    }
}

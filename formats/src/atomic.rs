//! Crash-safe writes: data goes to a temporary file in the destination directory, is fsynced,
//! then renamed over the destination, and the directory is fsynced. A killed writer leaves at
//! most a `*.tmp` file behind, never a truncated file at the output path.

use crate::FormatError;
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// A file being written; becomes visible at `dest` only on [`AtomicFile::commit`]. Dropped
/// without commit, it removes its temporary file.
pub struct AtomicFile {
    dest: PathBuf,
    tmp: PathBuf,
    writer: Option<BufWriter<File>>,
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
        Ok(Self {
            dest,
            tmp,
            writer: Some(BufWriter::with_capacity(1 << 20, file)),
        })
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
        if self.writer.is_some() {
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
}

//! Shared by the targets whose readers open files: the input written to a temporary file.

use std::io::Write;

/// `data` in a new temporary file (removed when dropped); `None` if the file system refuses.
pub fn temp_file(data: &[u8]) -> Option<tempfile::NamedTempFile> {
    let mut f = tempfile::NamedTempFile::new().ok()?;
    f.write_all(data).ok()?;
    Some(f)
}

//! `SfxFile::check_unchanged` and `SfxFile::file`: a container truncated or written to in place
//! after it was opened is reported (its map may now hold other bytes than were validated); one
//! replaced by a rename is not (the open inode keeps its bytes), and the handle still reads
//! the bytes that were opened, not the new file at the path.

use sfx_formats::sfx::{Codec, Layout, SectionSpec, SfxFile, SfxMetadata, SfxWriter, Tier};
use std::os::unix::fs::FileExt;
use std::path::Path;

fn write(path: &Path, fill: u8) {
    let mut w = SfxWriter::create(path).unwrap();
    w.add_section(
        SectionSpec::new("refine", Tier::Ssd, Codec::Raw, Layout::Bytes),
        &[fill; 10_000],
    )
    .unwrap();
    w.finish(&SfxMetadata::default()).unwrap();
}

/// Past the file's previous mtime on filesystems with coarse timestamps.
fn tick() {
    std::thread::sleep(std::time::Duration::from_millis(20));
}

#[test]
fn truncation_and_in_place_writes_are_reported_a_rename_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.sfx");

    write(&p, 1);
    let f = SfxFile::open(&p).unwrap();
    f.check_unchanged().unwrap();
    let offset = f.section("refine").unwrap().offset;
    // A new file renamed over the path: the open one is untouched and still read.
    let q = dir.path().join("new.sfx");
    write(&q, 2);
    tick();
    std::fs::rename(&q, &p).unwrap();
    f.check_unchanged().unwrap();
    let mut b = [0u8; 4];
    f.file().unwrap().read_exact_at(&mut b, offset).unwrap();
    assert_eq!(b, [1; 4], "the handle must read the inode that was opened");
    assert_eq!(f.section("refine").unwrap().bytes[..4], [1; 4]);
    drop(f);

    // Written to in place, same size.
    let f = SfxFile::open(&p).unwrap();
    tick();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .write_all_at(&[9; 4], offset)
        .unwrap();
    let e = f.check_unchanged().unwrap_err().to_string();
    assert!(
        e.contains("m.sfx") && e.contains("changed on disk") && e.contains("written to in place"),
        "{e}"
    );
    drop(f);

    // Truncated.
    let f = SfxFile::open(&p).unwrap();
    let len = std::fs::metadata(&p).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let e = f.check_unchanged().unwrap_err().to_string();
    assert!(
        e.contains(&format!("from {len} to {} bytes", len / 2)),
        "{e}"
    );

    // A container read from memory has no file to change.
    let mem = SfxFile::from_bytes("mem.sfx", {
        write(&q, 3);
        std::fs::read(&q).unwrap()
    })
    .unwrap();
    assert!(mem.file().is_none());
    mem.check_unchanged().unwrap();
}

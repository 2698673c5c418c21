//! The `.sfx` reader on arbitrary bytes: the footer, the section table and the metadata
//! validated by `SfxFile::from_bytes`; then every section decoded (zstd bounded by the
//! recorded length) and hashed. Any panic, hang or oversized allocation is a bug.
#![no_main]
use libfuzzer_sys::fuzz_target;
use sfx_formats::sfx::SfxFile;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = SfxFile::from_bytes("fuzz.sfx", data.to_vec()) else {
        return;
    };
    let _ = file.metadata();
    let _ = file.content_digest();
    for s in file.sections() {
        let _ = s.decode();
    }
    let _ = file.verify();
});

//! Malformed GGUF files must fail with an error naming the problem: never a panic, never an
//! allocation sized by an untrusted count. A counting global allocator records the largest
//! single allocation made while each hostile file is opened.

#[path = "common/assets.rs"]
mod assets;

#[path = "common/gguf_writer.rs"]
mod gguf_writer;

use gguf_writer::{put_str, s, GgufBuilder, V};
use sfx_formats::gguf::{GgufError, GgufFile};
use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

struct PeakAlloc;
static LARGEST: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for PeakAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: PeakAlloc = PeakAlloc;

/// Serialises the allocation measurements (tests run on several threads).
static MEASURE: Mutex<()> = Mutex::new(());
/// No hostile file here is larger than a few MB; 64 MiB means "sized by a lie".
const ALLOC_LIMIT: usize = 64 << 20;

/// Opens `path`, expecting an error; checks the largest allocation and returns the message.
fn open_err(path: &Path) -> String {
    let _g = MEASURE.lock().unwrap_or_else(|e| e.into_inner());
    LARGEST.store(0, Ordering::Relaxed);
    let r = GgufFile::open(path);
    let peak = LARGEST.load(Ordering::Relaxed);
    let msg = match r {
        Ok(_) => panic!("{} opened but should have failed", path.display()),
        Err(e) => e.to_string(),
    };
    assert!(
        peak < ALLOC_LIMIT,
        "{}: an allocation of {peak} bytes while failing with: {msg}",
        path.display()
    );
    msg
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn assert_contains(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "expected {p:?} in: {msg}");
    }
}

/// A small valid file exercising every value type, a nested array and three tensors.
fn valid() -> GgufBuilder {
    GgufBuilder::new()
        .kv("general.architecture", s("llama"))
        .kv("a.u8", V::U8(7))
        .kv("a.i16", V::I16(-3))
        .kv("a.f64", V::F64(0.5))
        .kv("a.bool", V::Bool(true))
        .kv("a.strs", V::Arr(8, vec![s("x"), s("yz")]))
        .kv(
            "a.nested",
            V::Arr(
                9,
                vec![V::Arr(4, vec![V::U32(1), V::U32(2)]), V::Arr(4, vec![])],
            ),
        )
        .f32_tensor("t.a", &[4, 2], &[1., 2., 3., 4., 5., 6., 7., 8.])
        .tensor("t.b", &[32], 3, vec![0u8; 20])
        .f32_tensor("t.c", &[3], &[0.5, 0.25, 0.125])
}

/// Header bytes up to (not including) the tensor-info section, for hand-made files.
fn prefix(version: u32, n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(version.to_le_bytes());
    out.extend(n_tensors.to_le_bytes());
    out.extend(n_kv.to_le_bytes());
    out
}

#[test]
fn allocation_counter_sees_large_allocations() {
    let _g = MEASURE.lock().unwrap_or_else(|e| e.into_inner());
    LARGEST.store(0, Ordering::Relaxed);
    let v = std::hint::black_box(vec![1u8; ALLOC_LIMIT + 1]);
    assert!(LARGEST.load(Ordering::Relaxed) > ALLOC_LIMIT);
    drop(v);
}

#[test]
fn valid_synthetic_file_opens() {
    let d = tempfile::tempdir().unwrap();
    let p = valid().write(d.path(), "ok.gguf");
    let g = GgufFile::open(&p).unwrap();
    assert_eq!(g.tensors().len(), 3);
    assert_eq!(g.dequantize("t.c").unwrap(), [0.5, 0.25, 0.125]);
}

#[test]
fn truncated_synthetic_file_at_every_byte() {
    let d = tempfile::tempdir().unwrap();
    let full = valid().build();
    // The last tensor's data ends 12 bytes into the final 32-byte padded block; any cut past
    // that end leaves a valid file.
    let data_end = full.len() - 32 + 12;
    for cut in 0..data_end {
        let p = write(d.path(), "cut.gguf", &full[..cut]);
        let msg = open_err(&p);
        assert!(
            msg.contains("truncated")
                || msg.contains("beyond the end")
                || msg.contains("cannot fit")
                || msg.contains("not a GGUF file"),
            "cut at {cut}: {msg}"
        );
        assert!(
            msg.contains("cut.gguf"),
            "cut at {cut}: message should name the file: {msg}"
        );
    }
}

#[test]
fn truncated_real_model_header() {
    let model = assets::smollm2_gguf();
    let head = {
        use std::io::Read;
        let mut buf = vec![0u8; 2_000_000];
        let mut f = std::fs::File::open(&model).unwrap();
        f.read_exact(&mut buf).unwrap();
        buf
    };
    let d = tempfile::tempdir().unwrap();
    // Inside the magic, version, counts, first key, the token list, the merges, the tensor
    // infos; just after the header (tensor data missing).
    for cut in [
        0, 3, 4, 6, 8, 15, 24, 31, 40, 60, 1000, 100_000, 700_000, 1_500_000, 1_785_000, 1_785_664,
        1_900_000,
    ] {
        let p = write(d.path(), "smol-cut.gguf", &head[..cut]);
        let msg = open_err(&p);
        match cut {
            0..=3 => assert_contains(&msg, &["truncated", "magic"]),
            4..=7 => assert_contains(&msg, &["truncated", "version"]),
            1_785_664.. => {
                assert_contains(&msg, &["beyond the end of the file", "token_embd.weight"])
            }
            // Either a read runs off the end, or a count is refused because the bytes left
            // cannot hold that many items.
            _ => assert!(
                msg.contains("truncated") || msg.contains("cannot fit"),
                "cut {cut}: {msg}"
            ),
        }
        assert_contains(&msg, &["smol-cut.gguf"]);
    }
}

#[test]
fn wrong_magic() {
    let d = tempfile::tempdir().unwrap();
    let mut b = valid().build();
    b[..4].copy_from_slice(b"GGML");
    let msg = open_err(&write(d.path(), "m.gguf", &b));
    assert_contains(&msg, &["not a GGUF file", "expected \"GGUF\""]);
    let msg = open_err(&write(d.path(), "s.safetensors", b"{\"__metadata__\": {}}"));
    assert_contains(&msg, &["not a GGUF file"]);
}

#[test]
fn unsupported_versions() {
    let d = tempfile::tempdir().unwrap();
    for (v, hint) in [
        (1u32, "version 1"),
        (4, "supported: 2, 3"),
        (3u32.swap_bytes(), "big-endian"),
    ] {
        let mut g = valid();
        g.version = v;
        let msg = open_err(&g.write(d.path(), "v.gguf"));
        assert_contains(&msg, &["unsupported GGUF version", hint]);
    }
    // Version 2 has the same layout as 3 and is accepted.
    let mut g = valid();
    g.version = 2;
    assert_eq!(
        GgufFile::open(g.write(d.path(), "v2.gguf"))
            .unwrap()
            .version(),
        2
    );
}

#[test]
fn string_length_beyond_file() {
    let d = tempfile::tempdir().unwrap();
    // A key whose length claims 1 TiB.
    let mut b = prefix(3, 0, 1);
    b.extend((1u64 << 40).to_le_bytes());
    b.extend(b"general.name");
    let msg = open_err(&write(d.path(), "k.gguf", &b));
    assert_contains(&msg, &["truncated", "metadata key #0", "1099511627776"]);
    // A string value whose length runs past the end.
    let mut b = prefix(3, 0, 1);
    put_str(&mut b, "general.name");
    b.extend(8u32.to_le_bytes());
    b.extend(u64::MAX.to_le_bytes());
    b.extend(b"abc");
    let msg = open_err(&write(d.path(), "v.gguf", &b));
    assert_contains(&msg, &["truncated", "general.name"]);
    // A string inside an array.
    let mut b = prefix(3, 0, 1);
    put_str(&mut b, "tokenizer.ggml.tokens");
    b.extend(9u32.to_le_bytes());
    b.extend(8u32.to_le_bytes());
    b.extend(2u64.to_le_bytes());
    put_str(&mut b, "ok");
    b.extend(1000u64.to_le_bytes());
    b.extend([b'x'; 20]);
    let msg = open_err(&write(d.path(), "a.gguf", &b));
    assert_contains(
        &msg,
        &["truncated", "element 1 of array 'tokenizer.ggml.tokens'"],
    );
}

#[test]
fn array_count_two_to_the_sixtieth() {
    let d = tempfile::tempdir().unwrap();
    for elem in [0u32, 6, 8, 9, 12, 7] {
        let mut b = prefix(3, 0, 1);
        put_str(&mut b, "huge");
        b.extend(9u32.to_le_bytes());
        b.extend(elem.to_le_bytes());
        b.extend((1u64 << 60).to_le_bytes());
        b.extend([0u8; 64]);
        let msg = open_err(&write(d.path(), "arr.gguf", &b));
        assert_contains(&msg, &["array 'huge'", "1152921504606846976", "cannot fit"]);
    }
    // Nested: an inner array's count lies.
    let mut b = prefix(3, 0, 1);
    put_str(&mut b, "nest");
    b.extend(9u32.to_le_bytes());
    b.extend(9u32.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.extend(4u32.to_le_bytes());
    b.extend((1u64 << 60).to_le_bytes());
    let msg = open_err(&write(d.path(), "nest.gguf", &b));
    assert_contains(&msg, &["array 'nest'", "cannot fit"]);
}

#[test]
fn huge_counts_in_the_header() {
    let d = tempfile::tempdir().unwrap();
    let msg = open_err(&write(d.path(), "kv.gguf", &prefix(3, 0, 1 << 60)));
    assert_contains(&msg, &["metadata key/value count", "cannot fit"]);
    let msg = open_err(&write(d.path(), "t.gguf", &prefix(3, u64::MAX, 0)));
    assert_contains(&msg, &["tensor count", "cannot fit"]);
}

#[test]
fn tensor_dims_product_overflows() {
    let d = tempfile::tempdir().unwrap();
    let g = GgufBuilder::new().tensor("big", &[1 << 32, 1 << 32, 1 << 32], 0, vec![0u8; 32]);
    let msg = open_err(&g.write(d.path(), "o.gguf"));
    assert_contains(&msg, &["tensor 'big'", "overflows"]);
    // Product fits in u64 but the byte size does not fit the address space.
    let g = GgufBuilder::new().tensor("wide", &[1 << 31, 1 << 31], 0, vec![0u8; 32]);
    let msg = open_err(&g.write(d.path(), "w.gguf"));
    assert_contains(&msg, &["tensor 'wide'", "overflows"]);
    let g = GgufBuilder::new().tensor("five", &[1, 1, 1, 1, 1], 0, vec![0u8; 4]);
    let msg = open_err(&g.write(d.path(), "f.gguf"));
    assert_contains(&msg, &["tensor 'five'", "5 dimensions"]);
}

#[test]
fn tensor_data_beyond_end_of_file() {
    let d = tempfile::tempdir().unwrap();
    let mut g = valid();
    g.tensors[1].offset = Some(1 << 20);
    let msg = open_err(&g.write(d.path(), "r.gguf"));
    assert_contains(&msg, &["tensor 't.b'", "beyond the end of the file"]);
    // Offset so large that offset + size overflows u64.
    let mut g = valid();
    g.tensors[0].offset = Some(u64::MAX - 31);
    let msg = open_err(&g.write(d.path(), "x.gguf"));
    assert_contains(&msg, &["tensor 't.a'", "beyond the end of the file"]);
}

#[test]
fn overlapping_tensors() {
    let d = tempfile::tempdir().unwrap();
    let mut g = valid();
    g.tensors[2].offset = Some(0);
    let msg = open_err(&g.write(d.path(), "ov.gguf"));
    assert_contains(&msg, &["overlaps tensor", "t.a", "t.c"]);
}

#[test]
fn misaligned_offset_and_bad_alignment() {
    let d = tempfile::tempdir().unwrap();
    let mut g = valid();
    g.tensors[1].offset = Some(36);
    let msg = open_err(&g.write(d.path(), "al.gguf"));
    assert_contains(
        &msg,
        &["tensor 't.b'", "not a multiple of the alignment 32"],
    );
    let g = valid().kv("general.alignment", V::U32(24));
    let msg = open_err(&g.write(d.path(), "al2.gguf"));
    assert_contains(&msg, &["general.alignment", "power-of-two"]);
    // A valid non-default alignment is honoured.
    let g = valid().kv("general.alignment", V::U32(64));
    let f = GgufFile::open(g.write(d.path(), "al3.gguf")).unwrap();
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.data_start() % 64, 0);
    assert_eq!(f.dequantize("t.c").unwrap(), [0.5, 0.25, 0.125]);
}

#[test]
fn unknown_ggml_type_names_the_tensor() {
    let d = tempfile::tempdir().unwrap();
    let mut g = valid();
    g.tensors[1].ty = 99;
    let msg = open_err(&g.write(d.path(), "ty.gguf"));
    assert_contains(&msg, &["tensor 't.b'", "unknown ggml type id 99"]);
    // Retired id 4 (Q4_2) is unknown too.
    let mut g = valid();
    g.tensors[1].ty = 4;
    assert_contains(
        &open_err(&g.write(d.path(), "ty4.gguf")),
        &["unknown ggml type id 4"],
    );
}

#[test]
fn known_but_undecodable_type_fails_on_dequantize_only() {
    let d = tempfile::tempdir().unwrap();
    // IQ1_S (id 19): 50 bytes per 256 elements; the file is valid.
    let g = GgufBuilder::new().tensor("iq", &[256], 19, vec![0u8; 50]);
    let f = GgufFile::open(g.write(d.path(), "iq.gguf")).unwrap();
    let msg = f.dequantize("iq").unwrap_err().to_string();
    assert_contains(&msg, &["tensor 'iq'", "IQ1_S", "not supported"]);
    let msg = f.dequantize("nope").unwrap_err().to_string();
    assert_contains(&msg, &["'nope' not found"]);
}

#[test]
fn row_length_must_be_whole_blocks() {
    let d = tempfile::tempdir().unwrap();
    let g = GgufBuilder::new().tensor("q", &[31, 2], 3, vec![0u8; 40]);
    let msg = open_err(&g.write(d.path(), "blk.gguf"));
    assert_contains(&msg, &["tensor 'q'", "row length 31", "Q4_1 block size 32"]);
}

#[test]
fn malformed_metadata() {
    let d = tempfile::tempdir().unwrap();
    let cases: Vec<(GgufBuilder, &[&str])> = vec![
        (valid().kv("a.u8", V::U8(1)), &["a.u8", "duplicate key"]),
        (
            valid().f32_tensor("t.a", &[1], &[0.0]),
            &["t.a", "duplicate tensor name"],
        ),
    ];
    for (i, (g, want)) in cases.into_iter().enumerate() {
        let msg = open_err(&g.write(d.path(), &format!("m{i}.gguf")));
        assert_contains(&msg, want);
    }
    // Unknown value type, bad bool, invalid UTF-8 key, too-deep nesting: hand-made.
    let mut b = prefix(3, 0, 1);
    put_str(&mut b, "odd");
    b.extend(13u32.to_le_bytes());
    b.extend([0u8; 16]);
    assert_contains(
        &open_err(&write(d.path(), "u.gguf", &b)),
        &["'odd'", "unknown value type 13"],
    );

    let mut b = prefix(3, 0, 1);
    put_str(&mut b, "flag");
    b.extend(7u32.to_le_bytes());
    b.push(2);
    assert_contains(
        &open_err(&write(d.path(), "b.gguf", &b)),
        &["'flag'", "must be 0 or 1"],
    );

    let mut b = prefix(3, 0, 1);
    b.extend(2u64.to_le_bytes());
    b.extend([0xC3, 0x28]);
    b.extend(4u32.to_le_bytes());
    b.extend(1u32.to_le_bytes());
    assert_contains(
        &open_err(&write(d.path(), "utf.gguf", &b)),
        &["metadata key #0", "UTF-8"],
    );

    let mut b = prefix(3, 0, 1);
    put_str(&mut b, "deep");
    b.extend(9u32.to_le_bytes());
    for _ in 0..20 {
        b.extend(9u32.to_le_bytes());
        b.extend(1u64.to_le_bytes());
    }
    b.extend([0u8; 64]);
    assert_contains(
        &open_err(&write(d.path(), "deep.gguf", &b)),
        &["'deep'", "nested deeper"],
    );
}

#[test]
fn missing_file_is_an_io_error_naming_it() {
    let msg = GgufFile::open("/nonexistent/model.gguf").unwrap_err();
    assert!(matches!(msg, GgufError::Io { .. }));
    assert_contains(&msg.to_string(), &["/nonexistent/model.gguf"]);
}

#[test]
fn import_rejects_unsupported_architecture_and_tokenizer() {
    let d = tempfile::tempdir().unwrap();
    let g = GgufBuilder::new().kv("general.architecture", s("gemma2"));
    let msg = sfx_formats::gguf::import_gguf(g.write(d.path(), "g.gguf"))
        .unwrap_err()
        .to_string();
    assert_contains(
        &msg,
        &[
            "g.gguf",
            "unsupported architecture 'gemma2'",
            "llama, mistral, qwen2, qwen3",
        ],
    );
    // The GgufError converts into the crate's FormatError with the same message.
    let fe: sfx_formats::FormatError = sfx_formats::gguf::import_gguf(d.path().join("g.gguf"))
        .unwrap_err()
        .into();
    assert_contains(&fe.to_string(), &["unsupported architecture 'gemma2'"]);
}

/// Found by the `gguf_file` fuzz target (2026-12-05): a block-quantized tensor of no
/// dimensions made the row-length error index its empty dimension list and panic.
#[test]
fn block_tensor_without_dimensions_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = GgufBuilder::new()
        .kv("general.architecture", s("llama"))
        .tensor("t.scalar_q4_0", &[], 2, vec![0u8; 18])
        .build();
    let msg = open_err(&write(dir.path(), "no_dims.gguf", &bytes));
    assert_contains(&msg, &["t.scalar_q4_0", "row length 1", "block size 32"]);
}

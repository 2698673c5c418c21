//! `.sfx` container v1: round trip, determinism, corruption and crafted-file rejection.
//! Crafted files are made by patching bytes at the offsets docs/format.md gives, so these
//! tests also pin the documented layout.

use sfx_formats::sfx::{
    Codec, Layout, Provenance, SectionSpec, SfxFile, SfxMetadata, SfxWriter, Tier, ALIGN,
    ENTRY_LEN, FOOTER_LEN,
};
use sfx_formats::DType;
use sha2::Digest;
use std::io::Write;
use std::path::Path;

fn metadata() -> SfxMetadata {
    let mut m = SfxMetadata {
        tokenizer_json: Some(r#"{"model":{"vocab":{"a":0,"b":1}}}"#.into()),
        tokenizer_config: Some(serde_json::json!({"chat_template": "{{ messages }}"})),
        provenance: Provenance {
            tool: "sfx-convert".into(),
            tool_version: "0.1.0".into(),
            source_id: "HuggingFaceTB/SmolLM2-135M-Instruct".into(),
            source_revision: Some("abc123".into()),
            calibration_text_sha256: Some("00".repeat(32)),
            seed: Some(7),
            ..Default::default()
        },
        ..Default::default()
    };
    m.provenance
        .source_files_sha256
        .insert("model.safetensors".into(), "ff".repeat(32));
    m.params.insert(
        "refine.qkv".into(),
        serde_json::json!({"k": 64, "fit": true}),
    );
    m
}

fn dense_f32(rows: usize, cols: usize) -> (Layout, Vec<u8>) {
    let v: Vec<u8> = (0..rows * cols)
        .flat_map(|i| (i as f32 * 0.5).to_le_bytes())
        .collect();
    let layout = Layout::Dense {
        dtype: DType::F32,
        shape: vec![rows as u64, cols as u64],
    };
    (layout, v)
}

/// Column-major nibbles for C [out, in]: column i is `i` repeated.
fn nibbles(out: usize, inp: usize) -> (Layout, Vec<u8>) {
    let col = out.div_ceil(2);
    let v: Vec<u8> = (0..inp).flat_map(|i| vec![i as u8; col]).collect();
    (
        Layout::ColumnNibbles {
            out: out as u64,
            inp: inp as u64,
        },
        v,
    )
}

/// Writes the standard test file: three sections, one zstd, one streamed in odd chunks.
fn write_sample(path: &Path, chunk: usize) {
    let mut w = SfxWriter::create(path).unwrap();
    let (l, d) = dense_f32(3, 5);
    w.add_section(SectionSpec::new("embed", Tier::Resident, Codec::Raw, l), &d)
        .unwrap();
    let (l, d) = nibbles(7, 300);
    {
        let mut s = w
            .begin_section(SectionSpec::new("refine.0.q", Tier::Ssd, Codec::Raw, l))
            .unwrap();
        for c in d.chunks(chunk) {
            s.write_all(c).unwrap();
        }
        s.finish().unwrap();
    }
    let text = b"scales scales scales ".repeat(500);
    {
        let mut s = w
            .begin_section(SectionSpec::new(
                "refine.0.q.scales",
                Tier::Ram,
                Codec::Zstd,
                Layout::Bytes,
            ))
            .unwrap();
        for c in text.chunks(chunk) {
            s.write_all(c).unwrap();
        }
        s.finish().unwrap();
    }
    w.finish(&metadata()).unwrap();
}

#[test]
fn sfx_round_trip_sections_and_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.sfx");
    write_sample(&p, 1000);
    let f = SfxFile::open(&p).unwrap();
    assert_eq!(f.metadata(), &metadata());
    let names: Vec<_> = f.sections().map(|s| s.name.to_string()).collect();
    assert_eq!(names, ["embed", "refine.0.q", "refine.0.q.scales"]);
    for s in f.sections() {
        assert_eq!(s.offset % ALIGN, 0, "{}", s.name);
    }
    let e = f.section("embed").unwrap();
    assert_eq!(e.tier, Tier::Resident);
    assert_eq!(e.bytes, dense_f32(3, 5).1.as_slice());
    let q = f.section("refine.0.q").unwrap();
    assert_eq!((q.tier, q.codec), (Tier::Ssd, Codec::Raw));
    assert_eq!(q.layout, &Layout::ColumnNibbles { out: 7, inp: 300 });
    let s = f.section("refine.0.q.scales").unwrap();
    assert_eq!(s.codec, Codec::Zstd);
    assert!(s.bytes.len() < 500, "zstd should shrink repetitive text");
    assert_eq!(&*s.decode().unwrap(), b"scales scales scales ".repeat(500));
    let report = f.verify().unwrap();
    assert_eq!(report.sections, 3);
    assert!(f
        .section("missing")
        .unwrap_err()
        .to_string()
        .contains("'missing'"));
}

#[test]
fn sfx_read_range_returns_one_column() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.sfx");
    write_sample(&p, 64);
    let f = SfxFile::open(&p).unwrap();
    let q = f.section("refine.0.q").unwrap();
    let col = q.layout.column_bytes().unwrap();
    assert_eq!(col, 4);
    assert_eq!(
        f.read_range("refine.0.q", 123 * col, col).unwrap(),
        &[123u8; 4]
    );
    let err = f.read_range("refine.0.q", 300 * col, 1).unwrap_err();
    assert!(err.to_string().contains("section 'refine.0.q'"), "{err}");
    let err = f.read_range("refine.0.q", u64::MAX, 2).unwrap_err();
    assert!(err.to_string().contains("outside"), "{err}");
    let err = f.read_range("refine.0.q.scales", 0, 1).unwrap_err();
    assert!(err.to_string().contains("zstd"), "{err}");
}

#[test]
fn sfx_writer_is_deterministic() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.sfx");
    let b = dir.path().join("b.sfx");
    write_sample(&a, 1 << 20);
    write_sample(&b, 7); // different write chunking, same bytes
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
}

#[test]
fn sfx_truncated_file_is_rejected_at_every_cut() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.sfx");
    write_sample(&p, 100);
    let full = std::fs::read(&p).unwrap();
    let mut cuts: Vec<usize> = (0..full.len()).step_by(97).collect();
    cuts.extend(full.len() - 200..full.len());
    for cut in cuts {
        let err = SfxFile::from_bytes("cut.sfx", full[..cut].to_vec()).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("truncated") || msg.contains("shorter"),
            "cut at {cut}: {msg}"
        );
    }
    // Also through the mmap path.
    let t = dir.path().join("t.sfx");
    std::fs::write(&t, &full[..full.len() - 1]).unwrap();
    assert!(SfxFile::open(&t)
        .unwrap_err()
        .to_string()
        .contains("truncated"));
    std::fs::write(&t, b"").unwrap();
    assert!(SfxFile::open(&t)
        .unwrap_err()
        .to_string()
        .contains("shorter"));
}

#[test]
fn sfx_bit_flip_in_section_is_named_by_verify() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.sfx");
    write_sample(&p, 100);
    let mut bytes = std::fs::read(&p).unwrap();
    let (off, len) = {
        let f = SfxFile::open(&p).unwrap();
        let s = f.section("refine.0.q").unwrap();
        (s.offset as usize, s.bytes.len())
    };
    bytes[off + len / 2] ^= 0x10;
    let f = SfxFile::from_bytes("flipped.sfx", bytes).unwrap(); // structure is intact
    let err = f.verify().unwrap_err().to_string();
    assert!(err.contains("section 'refine.0.q'"), "{err}");
    assert!(!err.contains("'embed'"), "{err}");
}

#[test]
fn sfx_bit_flip_in_index_is_rejected_on_open() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.sfx");
    write_sample(&p, 100);
    let full = std::fs::read(&p).unwrap();
    let (table_off, _, _) = footer(&full);
    // Header, metadata, table and footer fields are all covered by the footer checksum.
    for pos in [5usize, 40, table_off + 3, table_off + 100, full.len() - 60] {
        let mut b = full.clone();
        b[pos] ^= 1;
        let err = SfxFile::from_bytes("x.sfx", b).unwrap_err().to_string();
        assert!(
            ["checksum", "footer:", "reserved", "version"]
                .iter()
                .any(|w| err.contains(w)),
            "flip at {pos}: {err}"
        );
    }
}

/// (table offset, section count, metadata offset) read from the footer per docs/format.md.
fn footer(b: &[u8]) -> (usize, usize, usize) {
    let f = &b[b.len() - FOOTER_LEN..];
    let u64_at = |o: usize| u64::from_le_bytes(f[o..o + 8].try_into().unwrap()) as usize;
    let count = u32::from_le_bytes(f[40..44].try_into().unwrap()) as usize;
    (u64_at(24), count, u64_at(0))
}

/// Applies `patch` to the file bytes, then recomputes the footer checksum so the crafted file
/// passes the index check and reaches the structural checks.
fn craft(full: &[u8], patch: impl FnOnce(&mut Vec<u8>)) -> Result<SfxFile, String> {
    let mut b = full.to_vec();
    patch(&mut b);
    let n = b.len();
    let f = n - FOOTER_LEN;
    let (table_off, _, meta_off) = footer(&b);
    // A patch may make the footer's ranges nonsense; then there is nothing to re-checksum and
    // the reader must reject the footer fields themselves.
    if meta_off <= table_off && table_off <= f {
        let meta = &b[meta_off..table_off];
        let mut h = sha2::Sha256::new();
        h.update(&b[..64]);
        h.update(meta);
        h.update(&b[table_off..f]);
        h.update(&b[f..f + 48]);
        let sum: [u8; 32] = h.finalize().into();
        b[f + 48..f + 80].copy_from_slice(&sum);
    }
    SfxFile::from_bytes("crafted.sfx", b).map_err(|e| e.to_string())
}

fn set_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

#[test]
fn sfx_crafted_files_are_rejected_with_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.sfx");
    write_sample(&p, 100);
    let full = std::fs::read(&p).unwrap();
    let (t, _, _) = footer(&full);
    let e1 = t + ENTRY_LEN; // entry of "refine.0.q"
    assert!(
        craft(&full, |_| {}).is_ok(),
        "the crafting helper itself must be sound"
    );

    let err = craft(&full, |b| set_u64(b, e1, ALIGN)).unwrap_err();
    assert!(
        err.contains("overlap") && err.contains("'refine.0.q'"),
        "{err}"
    );

    let err = craft(&full, |b| set_u64(b, e1, 1 << 40)).unwrap_err();
    assert!(
        err.contains("section 'refine.0.q'") && err.contains("outside"),
        "{err}"
    );

    let err = craft(&full, |b| set_u64(b, e1, 3 * ALIGN + 8)).unwrap_err();
    assert!(
        err.contains("section 'refine.0.q'") && err.contains("aligned"),
        "{err}"
    );

    let err = craft(&full, |b| set_u64(b, e1 + 8, u64::MAX)).unwrap_err();
    assert!(
        err.contains("section 'refine.0.q'") && err.contains("overflow"),
        "{err}"
    );

    // Stored length that disagrees with the layout's shape.
    let err = craft(&full, |b| {
        set_u64(b, e1 + 8, 8);
        set_u64(b, e1 + 16, 8);
    })
    .unwrap_err();
    assert!(
        err.contains("section 'refine.0.q'") && err.contains("layout"),
        "{err}"
    );

    // Duplicate name: rename entry 1 to "embed".
    let err = craft(&full, |b| {
        b[e1 + 96..e1 + 256].fill(0);
        b[e1 + 96..e1 + 98].copy_from_slice(&5u16.to_le_bytes());
        b[e1 + 98..e1 + 103].copy_from_slice(b"embed");
    })
    .unwrap_err();
    assert!(err.contains("'embed' appears twice"), "{err}");

    // Absurd counts and lengths: rejected before any allocation of that size.
    let n = full.len();
    let err = craft(&full, |b| {
        b[n - 56..n - 52].copy_from_slice(&u32::MAX.to_le_bytes())
    })
    .unwrap_err();
    assert!(err.contains("sections (at most"), "{err}");
    let err = craft(&full, |b| set_u64(b, n - FOOTER_LEN + 16, u64::MAX)).unwrap_err();
    assert!(err.contains("metadata decodes to"), "{err}");
    let err = craft(&full, |b| set_u64(b, n - FOOTER_LEN + 24, u64::MAX)).unwrap_err();
    assert!(err.contains("footer: table"), "{err}");
    let err = craft(&full, |b| b[e1 + 96] = 255).unwrap_err();
    assert!(err.contains("name length"), "{err}");
    let err = craft(&full, |b| b[e1 + 62] = 200).unwrap_err();
    assert!(err.contains("bad layout"), "{err}");
    // A zstd section whose table entry claims an absurd decoded length: opening is fine (its
    // layout does not fix a length), decoding fails by name without allocating that much.
    let e2 = t + 2 * ENTRY_LEN;
    let f = craft(&full, |b| set_u64(b, e2 + 16, u64::MAX / 2)).unwrap();
    let err = f
        .section("refine.0.q.scales")
        .unwrap()
        .decode()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("section 'refine.0.q.scales'") && err.contains("the table says"),
        "{err}"
    );
    let err = craft(&full, |b| b[0] = b'X').unwrap_err();
    assert!(err.contains("magic"), "{err}");
    let err = craft(&full, |b| b[4] = 2).unwrap_err();
    assert!(err.contains("version 2"), "{err}");
}

#[test]
fn sfx_dropped_writer_leaves_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.sfx");
    {
        let mut w = SfxWriter::create(&p).unwrap();
        let (l, d) = dense_f32(2, 2);
        w.add_section(SectionSpec::new("a", Tier::Ram, Codec::Raw, l), &d)
            .unwrap();
    }
    assert!(!p.exists());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

    // A section writer dropped unfinished poisons the writer: finish refuses.
    let mut w = SfxWriter::create(&p).unwrap();
    {
        let mut s = w
            .begin_section(SectionSpec::new("a", Tier::Ram, Codec::Zstd, Layout::Bytes))
            .unwrap();
        s.write_all(b"half").unwrap();
    }
    let err = w.finish(&SfxMetadata::default()).unwrap_err().to_string();
    assert!(err.contains("without finish"), "{err}");
    assert!(!p.exists());
}

#[test]
fn sfx_writer_rejects_bad_sections() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = SfxWriter::create(dir.path().join("m.sfx")).unwrap();
    let (l, d) = dense_f32(2, 2);
    let err = w
        .add_section(
            SectionSpec::new("a", Tier::Ram, Codec::Raw, l.clone()),
            &d[..4],
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("section 'a'") && err.contains("16 bytes"),
        "{err}"
    );
    let mut w = SfxWriter::create(dir.path().join("n.sfx")).unwrap();
    w.add_section(SectionSpec::new("a", Tier::Ram, Codec::Raw, l.clone()), &d)
        .unwrap();
    let err = w
        .add_section(SectionSpec::new("a", Tier::Ram, Codec::Raw, l.clone()), &d)
        .unwrap_err()
        .to_string();
    assert!(err.contains("added twice"), "{err}");
    let err = w
        .add_section(
            SectionSpec::new("x".repeat(159), Tier::Ram, Codec::Raw, l),
            &d,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("1 to 158"), "{err}");
}

#[test]
fn sfx_empty_container_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("e.sfx");
    SfxWriter::create(&p)
        .unwrap()
        .finish(&SfxMetadata::default())
        .unwrap();
    let f = SfxFile::open(&p).unwrap();
    assert_eq!(f.sections().count(), 0);
    assert_eq!(f.verify().unwrap().sections, 0);
}

/// Measures the metadata zstd decision on a realistic payload (SmolLM2's tokenizer + config).
/// Run: `cargo test -p sfx-formats --test sfx_container -- --ignored --nocapture`.
#[test]
#[ignore = "measurement; needs assets/SmolLM2-135M-Instruct.Q4_1.gguf"]
fn sfx_measure_metadata_zstd_ratio() {
    let gguf =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/SmolLM2-135M-Instruct.Q4_1.gguf");
    let imported = sfx_formats::gguf::import_gguf(&gguf).unwrap();
    let mut m = metadata();
    m.config = Some(sfx_formats::ModelConfig::from_hf_json(&imported.hf_config, &gguf).unwrap());
    m.tokenizer_config = Some(imported.tokenizer_config.clone());
    m.tokenizer_json = Some(imported.tokenizer_json.clone());
    let json = serde_json::to_vec(&m).unwrap();
    println!(
        "tokenizer.json text: {} bytes",
        imported.tokenizer_json.len()
    );
    println!("metadata JSON: {} bytes", json.len());
    for level in [1, 3, 9, 19] {
        let t = std::time::Instant::now();
        let c = zstd::bulk::compress(&json, level).unwrap();
        let enc_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = std::time::Instant::now();
        let d = zstd::bulk::decompress(&c, json.len()).unwrap();
        let dec_ms = t.elapsed().as_secs_f64() * 1e3;
        assert_eq!(d, json);
        println!(
            "zstd level {level}: {} bytes, ratio {:.2}x, encode {enc_ms:.0} ms, decode {dec_ms:.1} ms",
            c.len(),
            json.len() as f64 / c.len() as f64
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.sfx");
    SfxWriter::create(&p).unwrap().finish(&m).unwrap();
    let t = std::time::Instant::now();
    let f = SfxFile::open(&p).unwrap();
    println!(
        "open (checksum + zstd decode + JSON parse): {:.1} ms, file {} bytes",
        t.elapsed().as_secs_f64() * 1e3,
        std::fs::metadata(&p).unwrap().len()
    );
    assert_eq!(f.metadata(), &m);
}

#[test]
fn sfx_neuron_bundles_round_trip_and_length_is_enforced() {
    // Layout code 4: bundle j is 4·ceil(hidden/2) bytes at j·4·ceil(hidden/2) (docs/format.md).
    let (neurons, hidden) = (5usize, 7usize);
    let unit = 4 * hidden.div_ceil(2);
    let bytes: Vec<u8> = (0..neurons * unit).map(|i| (i / unit) as u8).collect();
    let layout = Layout::NeuronBundles {
        neurons: neurons as u64,
        hidden: hidden as u64,
    };
    assert_eq!(layout.bundle_bytes(), Some(unit as u64));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.sfx");
    let spec = |name: &str| SectionSpec::new(name, Tier::Ssd, Codec::Raw, layout.clone());
    let mut bad = SfxWriter::create(dir.path().join("bad.sfx")).unwrap();
    let err = bad
        .add_section(spec("short"), &bytes[1..])
        .unwrap_err()
        .to_string();
    assert!(err.contains("section 'short'"), "{err}");
    let mut w = SfxWriter::create(&path).unwrap();
    w.add_section(spec("model.layers.0.mlp.bundles"), &bytes)
        .unwrap();
    w.finish(&metadata()).unwrap();
    let f = SfxFile::open(&path).unwrap();
    let s = f.section("model.layers.0.mlp.bundles").unwrap();
    assert_eq!(s.layout, &layout);
    assert_eq!(s.tier, Tier::Ssd);
    // Bundle 3 is one contiguous read.
    let b3 = f
        .read_range("model.layers.0.mlp.bundles", (3 * unit) as u64, unit as u64)
        .unwrap();
    assert!(b3.iter().all(|&v| v == 3));
}

/// Writes the standard test file as the seed of the `sfx_container` fuzz target:
/// `SFX_WRITE_FUZZ_SEEDS=1 cargo test -p sfx-formats --test sfx_container -- --ignored
/// fuzz_seed`.
#[test]
#[ignore = "writes fuzz/seeds; run by hand"]
fn fuzz_seed() {
    if std::env::var("SFX_WRITE_FUZZ_SEEDS").as_deref() != Ok("1") {
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/sfx_container");
    std::fs::create_dir_all(&dir).unwrap();
    write_sample(&dir.join("sample.sfx"), 97);
    // The seed is a valid container, so the fuzzer starts from the deep paths.
    SfxFile::open(dir.join("sample.sfx"))
        .unwrap()
        .verify()
        .unwrap();
}

//! The real SmolLM2-135M Q4_1 GGUF against the reference made with the Python `gguf`
//! package (gguf-py's `quants.dequantize`, the dequantizer transformers uses):
//! `tests/fixtures/gguf_dequant_reference.json`.
//!
//! Tolerances, and why:
//! - Sampled values: bit-exact. Every ggml formula here is f16 scale × small integer (exact in
//!   f32, ≤ 11 + 8 significant bits) followed by one f32 multiply and at most one f32 add/sub,
//!   evaluated in the same order by gguf-py (numpy f32, no FMA) and by us (Rust never fuses).
//! - Sums: the reference uses `math.fsum` (exactly rounded); we use Neumaier-compensated f64
//!   summation, whose error here is a few ulps of the sum, so 1e-12 relative is generous
//!   (squares of f32 values are exact in f64).
//!
//! The model comes from `scripts/fetch_assets.sh` (run by `make test`), the fixtures from
//! `scripts/golden`; a missing one fails the test.

#[path = "common/assets.rs"]
mod assets;

use serde_json::Value;
use sfx_formats::gguf::{import_gguf, import_gguf_to_folder, GgufFile};
use sfx_formats::TensorSource;
use std::path::Path;
use std::time::Instant;

const MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

fn fixture(name: &str) -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap()
}

/// Neumaier-compensated sum (plus sum of squares and of absolute values).
#[derive(Default)]
struct Stats {
    sum: (f64, f64),
    sumsq: (f64, f64),
}

fn neumaier(acc: &mut (f64, f64), x: f64) {
    let (s, c) = *acc;
    let t = s + x;
    let c = if s.abs() >= x.abs() {
        c + ((s - t) + x)
    } else {
        c + ((x - t) + s)
    };
    *acc = (t, c);
}

impl Stats {
    fn of(values: impl IntoIterator<Item = f32>) -> (f64, f64) {
        let mut st = Stats::default();
        for v in values {
            let v = v as f64;
            neumaier(&mut st.sum, v);
            neumaier(&mut st.sumsq, v * v);
        }
        (st.sum.0 + st.sum.1, st.sumsq.0 + st.sumsq.1)
    }
}

fn assert_rel(what: &str, got: f64, want: f64, rel: f64) -> f64 {
    let err = (got - want).abs() / want.abs().max(1e-300);
    assert!(
        err <= rel,
        "{what}: got {got:e}, reference {want:e} (relative error {err:e})"
    );
    err
}

fn bits(hex: &Value) -> u32 {
    u32::from_str_radix(hex.as_str().unwrap(), 16).unwrap()
}

#[test]
fn every_tensor_matches_gguf_py_reference() {
    let path = assets::smollm2_gguf();
    let fx = fixture("gguf_dequant_reference.json");
    let g = GgufFile::open(&path).unwrap();
    let refs = fx["tensors"].as_array().unwrap();
    assert_eq!(refs.len(), g.tensors().len());
    assert_eq!(
        fx["n_tensors"].as_u64().unwrap() as usize,
        g.tensors().len()
    );
    let mut n_values = 0usize;
    let mut worst = 0f64;
    let mut n_samples = 0;
    for r in refs {
        let name = r["name"].as_str().unwrap();
        let info = g
            .tensor_info(name)
            .unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(info.ggml_type.name(), r["type"].as_str().unwrap(), "{name}");
        assert_eq!(
            info.ggml_type.id() as u64,
            r["type_id"].as_u64().unwrap(),
            "{name}"
        );
        let shape: Vec<u64> = r["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        assert_eq!(info.dims, shape, "{name}: GGUF dims");
        assert_eq!(
            info.n_elements as u64,
            r["n_elements"].as_u64().unwrap(),
            "{name}"
        );
        let vals = g.dequantize(name).unwrap();
        n_values += vals.len();
        let (sum, sumsq) = Stats::of(vals.iter().copied());
        worst = worst.max(assert_rel(
            &format!("{name} sum"),
            sum,
            r["sum"].as_f64().unwrap(),
            1e-12,
        ));
        worst = worst.max(assert_rel(
            &format!("{name} sumsq"),
            sumsq,
            r["sumsq"].as_f64().unwrap(),
            1e-12,
        ));
        let idx = r["sample_flat_index"].as_array().unwrap();
        let want = r["sample_f32_bits"].as_array().unwrap();
        assert_eq!(idx.len(), want.len());
        for (i, b) in idx.iter().zip(want) {
            let i = i.as_u64().unwrap() as usize;
            let got = vals[i];
            assert_eq!(
                got.to_bits(),
                bits(b),
                "{name}[{i}]: got {got:e}, reference {:e}",
                f32::from_bits(bits(b))
            );
            n_samples += 1;
        }
    }
    assert_eq!(n_values as u64, fx["n_values"].as_u64().unwrap());
    eprintln!(
        "{} tensors, {n_values} values: {n_samples} sampled values bit-exact, worst relative \
         sum/sumsq deviation {worst:e}",
        refs.len()
    );
}

#[test]
fn hf_layout_matches_transformers_unpermutation() {
    let path = assets::smollm2_gguf();
    let fx = fixture("gguf_dequant_reference.json");
    let m = import_gguf(&path).unwrap();
    let g = GgufFile::open(&path).unwrap();
    for (hf_name, r) in fx["hf_layout"].as_object().unwrap() {
        let t = m.tensors.tensor(hf_name).unwrap();
        let shape: Vec<usize> = r["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(t.shape, shape.as_slice(), "{hf_name}");
        let vals = t.to_f32_vec();
        let (sum, sumsq) = Stats::of(vals.iter().copied());
        assert_rel(
            &format!("{hf_name} sum"),
            sum,
            r["sum"].as_f64().unwrap(),
            1e-12,
        );
        assert_rel(
            &format!("{hf_name} sumsq"),
            sumsq,
            r["sumsq"].as_f64().unwrap(),
            1e-12,
        );
        let cols = shape[1];
        let raw = g.dequantize(r["gguf_name"].as_str().unwrap()).unwrap();
        let mut moved = 0;
        for (rc, b) in r["sample_row_col"]
            .as_array()
            .unwrap()
            .iter()
            .zip(r["sample_f32_bits"].as_array().unwrap())
        {
            let (row, col) = (
                rc[0].as_u64().unwrap() as usize,
                rc[1].as_u64().unwrap() as usize,
            );
            assert_eq!(
                vals[row * cols + col].to_bits(),
                bits(b),
                "{hf_name}[{row}, {col}]"
            );
            if raw[row * cols + col].to_bits() != bits(b) {
                moved += 1;
            }
        }
        // The samples must actually exercise the permutation (most rows move).
        assert!(
            moved > 0,
            "{hf_name}: no sampled value differs between GGUF and HF order"
        );
    }
}

#[test]
fn dequantizing_the_whole_model_is_fast() {
    let path = assets::smollm2_gguf();
    let t0 = Instant::now();
    let g = GgufFile::open(&path).unwrap();
    let opened = t0.elapsed();
    let t1 = Instant::now();
    let mut n = 0usize;
    let mut buf = Vec::new();
    for info in g.tensors() {
        buf.resize(info.n_elements, 0f32);
        sfx_formats::gguf::dequantize(
            info.ggml_type,
            g.tensor_bytes(info).unwrap(),
            info.n_elements,
            &mut buf,
        )
        .unwrap();
        assert!(buf.iter().all(|v| v.is_finite()), "{}", info.name);
        n += info.n_elements;
    }
    let dq = t1.elapsed();
    eprintln!(
        "open + parse header: {:.3} s; dequantize {n} values: {:.3} s ({:.2} ns/value, {} threads)",
        opened.as_secs_f64(),
        dq.as_secs_f64(),
        dq.as_secs_f64() * 1e9 / n as f64,
        rayon::current_num_threads()
    );
    // A regression guard, far above the measured time (see the printout).
    assert!(dq.as_secs_f64() < 10.0, "dequantization took {dq:?}");
}

#[test]
fn import_and_write_hf_folder() {
    let path = assets::smollm2_gguf();
    let t0 = Instant::now();
    let m = import_gguf(&path).unwrap();
    let import_s = t0.elapsed().as_secs_f64();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("smollm2-hf");
    let t1 = Instant::now();
    let calls = std::cell::Cell::new(0usize);
    let written = import_gguf_to_folder(&path, &out, |done, total| {
        assert_eq!(done, calls.get() + 1);
        assert_eq!(total, m.tensors.len());
        calls.set(done);
    })
    .unwrap();
    let write_s = t1.elapsed().as_secs_f64();
    eprintln!("import in memory (open, dequantize, un-permute, tokenizer, sha256): {import_s:.2} s; streamed HF folder: {write_s:.2} s");
    assert_eq!(calls.get(), m.tensors.len());
    assert_eq!(m.source_sha256.as_deref(), Some(MODEL_SHA256));
    assert_eq!(written.source_sha256, MODEL_SHA256);
    assert_eq!(written.hf_config, m.hf_config);

    // config.json: SmolLM2-135M's published configuration, and accepted by the crate's own
    // config parser.
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg, m.hf_config);
    for (k, v) in [
        ("architectures", serde_json::json!(["LlamaForCausalLM"])),
        ("model_type", "llama".into()),
        ("hidden_size", 576.into()),
        ("intermediate_size", 1536.into()),
        ("num_hidden_layers", 30.into()),
        ("num_attention_heads", 9.into()),
        ("num_key_value_heads", 3.into()),
        ("head_dim", 64.into()),
        ("vocab_size", 49152.into()),
        ("max_position_embeddings", 8192.into()),
        ("rms_norm_eps", 1e-5.into()),
        ("rope_theta", 100000.0.into()),
        ("rope_scaling", Value::Null),
        ("tie_word_embeddings", true.into()),
        ("bos_token_id", 1.into()),
        ("eos_token_id", 2.into()),
        ("attention_bias", false.into()),
        ("torch_dtype", "bfloat16".into()),
    ] {
        assert_eq!(cfg[k], v, "config.json {k}");
    }
    let parsed = sfx_formats::ModelConfig::from_hf_json(&cfg, &out.join("config.json")).unwrap();
    assert_eq!(parsed.head_dim, 64);
    assert!(parsed.tie_word_embeddings);

    // model.safetensors: BF16, sorted names, exactly bf16(f32) of the imported tensors.
    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let names = m.tensors.tensor_names();
    assert_eq!(names.len(), 272);
    assert!(!names.contains(&"lm_head.weight".to_string()));
    let mut by_offset: Vec<(usize, String)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (v.data().as_ptr() as usize, n))
        .collect();
    by_offset.sort();
    let in_file_order: Vec<String> = by_offset.into_iter().map(|(_, n)| n).collect();
    assert_eq!(
        in_file_order, names,
        "tensors must be stored in sorted name order"
    );
    for name in &names {
        let v = st.tensor(name).unwrap();
        let t = m.tensors.tensor(name).unwrap();
        assert_eq!(v.dtype(), safetensors::Dtype::BF16, "{name}");
        assert_eq!(v.shape(), t.shape, "{name}");
        let want: Vec<u8> = t
            .to_bf16_vec()
            .iter()
            .flat_map(|b| b.to_le_bytes())
            .collect();
        assert!(v.data() == want.as_slice(), "{name}: BF16 bytes differ");
    }
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(
        meta.metadata()
            .as_ref()
            .and_then(|m| m.get("format"))
            .map(String::as_str),
        Some("pt")
    );

    // Tokenizer files.
    let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    let ids = tok
        .encode("Hello world! 123", false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(ids, [19556, 905, 17, 216, 33, 34, 35]);
    let tc: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(tc["bos_token"], "<|im_start|>");
    assert_eq!(tc["eos_token"], "<|im_end|>");
    assert_eq!(tc["unk_token"], "<|endoftext|>");
    assert_eq!(tc["pad_token"], "<|im_end|>");
    assert_eq!(tc["add_bos_token"], false);
    assert_eq!(tc["model_max_length"], 8192);
    assert!(tc["chat_template"]
        .as_str()
        .unwrap()
        .starts_with("{% for message in messages %}"));
    let gc: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("generation_config.json")).unwrap())
            .unwrap();
    assert_eq!(
        gc,
        serde_json::json!({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2})
    );

    // Nothing but the five files (no temporary files left behind).
    let mut files: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
}

//! The CLIs must turn bad input into a clear message and a non-zero exit — never a panic.
//! Each case builds its broken file from the real model (or from scratch) in a temp dir.

use crate::common::gguf;
use std::process::Command;

/// Runs a binary; returns (exit code, stderr).
fn run(bin: &str, args: &[&str]) -> (i32, String) {
    let out = Command::new(bin).args(args).output().expect("spawn");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn assert_clean_failure(code: i32, stderr: &str, needle: &str) {
    assert_ne!(code, 0, "expected failure; stderr: {stderr}");
    assert!(
        !stderr.contains("panicked"),
        "must not panic; stderr: {stderr}"
    );
    assert!(
        stderr.contains(needle),
        "stderr should mention '{needle}': {stderr}"
    );
}

const RUN: &str = env!("CARGO_BIN_EXE_sfx-run");
const CONVERT: &str = env!("CARGO_BIN_EXE_sfx-convert");

#[test]
fn truncated_gguf_is_rejected_by_run_and_convert() {
    let d = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(gguf()).unwrap();
    // Cut inside the metadata, inside the tensor table, and inside the tensor data.
    for cut in [100usize, 2_000_000, bytes.len() - 1000] {
        let p = d.path().join(format!("cut{cut}.gguf"));
        std::fs::write(&p, &bytes[..cut]).unwrap();
        let ps = p.to_str().unwrap();
        let (code, err) = run(RUN, &[ps, "-p", "hi", "-n", "1"]);
        assert_clean_failure(code, &err, "cut");
        let out = d.path().join("out");
        let (code, err) = run(CONVERT, &["import-gguf", ps, "-o", out.to_str().unwrap()]);
        assert_clean_failure(code, &err, "cut");
        assert!(!out.join("model.safetensors").exists());
    }
}

#[test]
fn wrong_magic_is_rejected() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("bad.gguf");
    let mut bytes = std::fs::read(gguf()).unwrap()[..4096].to_vec();
    bytes[..4].copy_from_slice(b"GGML");
    std::fs::write(&p, bytes).unwrap();
    let (code, err) = run(RUN, &[p.to_str().unwrap(), "-p", "hi"]);
    assert_clean_failure(code, &err, "magic");
}

#[test]
fn config_missing_hidden_size_is_named() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(
        d.path().join("config.json"),
        r#"{"model_type":"llama","intermediate_size":16,"num_hidden_layers":1,
            "num_attention_heads":2,"vocab_size":32}"#,
    )
    .unwrap();
    let (code, err) = run(RUN, &[d.path().to_str().unwrap(), "-p", "hi"]);
    assert_clean_failure(code, &err, "hidden_size");
}

#[test]
fn missing_model_and_bad_eval_spec_are_clear() {
    let (code, err) = run(RUN, &["/nonexistent/model.gguf", "-p", "hi"]);
    assert_clean_failure(code, &err, "/nonexistent/model.gguf");
    let gguf = gguf();
    let (code, err) = run(RUN, &[gguf.to_str().unwrap(), "--ppl", "wiki"]);
    assert_clean_failure(code, &err, "wiki");
    let (code, err) = run(RUN, &[gguf.to_str().unwrap(), "--ppl", "nosuchfile.txt:1"]);
    assert_clean_failure(code, &err, "nosuchfile.txt");
}

#[test]
fn bad_trellis_code_is_named_before_any_work() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("x.sfx");
    let gguf = gguf();
    let args = |code: &'static str| {
        [
            "--quant",
            "qtip2",
            "--trellis-code",
            code,
            gguf.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ]
        .map(String::from)
    };
    for bad in ["2mad", "hyb-q0", "hyb-q16"] {
        let a = args(bad);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let (code, err) = run(CONVERT, &a);
        assert_clean_failure(code, &err, "--trellis-code");
        assert!(err.contains(bad), "{err}");
    }
    assert!(!out.exists(), "a failed conversion must leave no output");
}

#[test]
fn truncated_safetensors_folder_is_rejected() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("hf");
    let gguf = gguf();
    let (code, err) = run(
        CONVERT,
        &[
            "import-gguf",
            gguf.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "{err}");
    let st = out.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() / 2]).unwrap();
    let (code, err) = run(RUN, &[out.to_str().unwrap(), "-p", "hi", "-n", "1"]);
    assert_clean_failure(code, &err, "model.safetensors");
}

#[test]
fn sfx_verify_names_a_corrupted_section() {
    use sfx_formats::sfx::{Codec, Layout, SectionSpec, SfxMetadata, SfxWriter, Tier};
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("m.sfx");
    let mut w = SfxWriter::create(&p).unwrap();
    w.add_section(
        SectionSpec::new("layers.0.refine.qkv", Tier::Ram, Codec::Raw, Layout::Bytes),
        &[7u8; 10_000],
    )
    .unwrap();
    w.finish(&SfxMetadata::default()).unwrap();
    let sfx = env!("CARGO_BIN_EXE_sfx");
    let (code, err) = run(sfx, &["verify", p.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    // Flip one bit inside the section's data (sections start at the first 4 KiB boundary).
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[4096 + 123] ^= 0x10;
    std::fs::write(&p, bytes).unwrap();
    let (code, err) = run(sfx, &["verify", p.to_str().unwrap()]);
    assert_clean_failure(code, &err, "layers.0.refine.qkv");
}

#[test]
fn bad_kv_options_are_named() {
    let gguf = gguf();
    let g = gguf.to_str().unwrap();
    let (code, err) = run(RUN, &[g, "-p", "hi", "--kv", "9/2"]);
    assert_clean_failure(code, &err, "--kv");
    let (code, err) = run(RUN, &[g, "-p", "hi", "--kv", "2/2", "--kv-group", "3"]);
    assert_clean_failure(code, &err, "--kv-group");
    let (code, err) = run(RUN, &[g, "-p", "hi", "--kv", "2/2", "--kv-fraction", "2"]);
    assert_clean_failure(code, &err, "--kv-fraction");
    let (code, err) = run(RUN, &[g, "-p", "hi", "--kv", "2/2", "--kv-tier", "disk"]);
    assert_clean_failure(code, &err, "--kv-tier");
    let (code, err) = run(RUN, &[g, "--ppl", "wiki:1", "--kv", "2/2"]);
    assert_clean_failure(code, &err, "austen-long");
}

/// `import-qtip` on a QTIP folder (config.json + safetensors written here) whose config or
/// Hadamard tables are unusable: a non-zero exit naming the field, order or file, and no
/// output file.
#[test]
fn import_qtip_errors_are_named() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("qtip");
    std::fs::create_dir_all(&dir).unwrap();
    // One tensor: the errors below are found before any projection is read.
    let one = [0u8; 4];
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1], &one).unwrap();
    safetensors::serialize_to_file([("x", view)], None, &dir.join("model.safetensors")).unwrap();
    let config = |hidden: usize, decode_mode: &str, with_params: bool| {
        let mut c = serde_json::json!({
            "model_type": "llama", "hidden_size": hidden, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": hidden / 32, "head_dim": 32,
            "num_key_value_heads": 1, "vocab_size": 32,
            "quip_params": {"codebook": "bitshift", "L": 16, "K": 2, "V": 2, "tlut_bits": 9,
                            "decode_mode": decode_mode, "td_x": 16, "td_y": 16}
        });
        if !with_params {
            c.as_object_mut().unwrap().remove("quip_params");
        }
        std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    };
    let out = d.path().join("out.sfx");
    let (o, dir_s) = (out.to_str().unwrap(), dir.to_str().unwrap());

    config(64, "quantlut_sym", false);
    let (code, err) = run(CONVERT, &["import-qtip", dir_s, "-o", o]);
    assert_clean_failure(code, &err, "quip_params: missing");

    config(64, "3inst", true);
    let (code, err) = run(CONVERT, &["import-qtip", dir_s, "-o", o]);
    assert_clean_failure(code, &err, "quip_params.decode_mode: \"3inst\"");

    // 96 = 12·8: needs QTIP's 12×12 matrix, which the checkpoint does not carry.
    config(96, "quantlut_sym", true);
    let (code, err) = run(CONVERT, &["import-qtip", dir_s, "-o", o]);
    assert_clean_failure(code, &err, "K = 12 for dimension 96");
    assert_clean_failure(code, &err, "--hadamard-tables");

    let tables = d.path().join("had.json");
    std::fs::write(
        &tables,
        serde_json::json!({"12": vec!["++++++++++++"; 12]}).to_string(),
    )
    .unwrap();
    let (code, err) = run(
        CONVERT,
        &[
            "import-qtip",
            dir_s,
            "-o",
            o,
            "--hadamard-tables",
            tables.to_str().unwrap(),
        ],
    );
    assert_clean_failure(code, &err, "not orthogonal");
    assert!(
        !out.exists(),
        "a failed import must not leave an output file"
    );
}

const SFX: &str = env!("CARGO_BIN_EXE_sfx");

#[test]
fn bad_device_and_bench_arguments_are_named() {
    let g = gguf();
    let g = g.to_str().unwrap();
    let (code, err) = run(RUN, &[g, "-p", "hi", "--device", "tpu"]);
    assert_clean_failure(code, &err, "expected cpu, cuda, cuda:N");
    let (code, err) = run(SFX, &["bench", "--synthetic", "gpt-9", "--device", "cpu"]);
    assert_clean_failure(code, &err, "unknown synthetic model");
    let (code, err) = run(
        SFX,
        &[
            "bench",
            "--synthetic",
            "tiny",
            "-p",
            "12,x",
            "--device",
            "cpu",
        ],
    );
    assert_clean_failure(code, &err, "\"x\" is not a whole number");
    let (code, err) = run(SFX, &["bench", "--synthetic", "tiny", "--graphs", "maybe"]);
    assert_clean_failure(code, &err, "--graphs");
    let (code, err) = run(SFX, &["bench", "--synthetic", "tiny", "--quant", "rtn7"]);
    assert_clean_failure(code, &err, "--quant \"rtn7\"");
    let (code, err) = run(SFX, &["bench", "--synthetic", "tiny", "--head", "q9"]);
    assert_clean_failure(code, &err, "--head \"q9\"");
    let (code, err) = run(SFX, &["bench", "--synthetic", "tiny", "--quant", "qtip5"]);
    assert_clean_failure(code, &err, "--quant \"qtip5\"");
    let (code, err) = run(SFX, &["bench", "--synthetic", "tiny", "--quant", "sqllm5"]);
    assert_clean_failure(code, &err, "--quant \"sqllm5\"");
    // tiny's 72 columns are no whole number of 256-weight super-blocks.
    let (code, err) = run(
        SFX,
        &[
            "bench",
            "--synthetic",
            "tiny",
            "--quant",
            "q4_k",
            "--device",
            "cpu",
        ],
    );
    assert_clean_failure(
        code,
        &err,
        "72 columns is not a whole number of Q4_K blocks",
    );
    let (code, err) = run(
        SFX,
        &[
            "bench",
            "--synthetic",
            "tiny-qwen3",
            "--quant",
            "qtip2",
            "--trellis-code",
            "2mad",
        ],
    );
    assert_clean_failure(code, &err, "--trellis-code \"2mad\"");
    // tiny's 72-wide hidden state is no multiple of the 16×16 trellis tile: named at build.
    let (code, err) = run(
        SFX,
        &[
            "bench",
            "--synthetic",
            "tiny",
            "--quant",
            "qtip2",
            "--device",
            "cpu",
            "-p",
            "4",
            "-n",
            "1",
            "-r",
            "1",
        ],
    );
    assert_clean_failure(code, &err, "16×16 tile");
    let (code, err) = run(
        SFX,
        &["test-backend", "--device", "cpu", "--op", "no_such_op"],
    );
    assert_clean_failure(code, &err, "matches no op");
    // Repeated filters: the error names every one, and lists each op once.
    let (code, err) = run(
        SFX,
        &[
            "test-backend",
            "--device",
            "cpu",
            "--op",
            "no_such_op",
            "--op",
            "nor_this",
        ],
    );
    assert_clean_failure(code, &err, "\"no_such_op\" / \"nor_this\" matches no op");
    assert_eq!(err.matches("model_decode").count(), 1, "{err}");
}

/// A machine without a GPU (CI): asking for CUDA is a clear error, not a panic, and `auto`
/// runs on the CPU.
#[test]
fn cuda_without_a_gpu_is_a_clear_error() {
    if sfx_runtime::backend::cuda::CudaBackend::available() {
        eprintln!("a CUDA device is present: the no-GPU error path is not reachable here");
        return;
    }
    let g = gguf();
    let g = g.to_str().unwrap();
    let (code, err) = run(RUN, &[g, "-p", "hi", "-n", "1", "--device", "cuda"]);
    assert_clean_failure(code, &err, "--device cuda");
    let out = Command::new(SFX)
        .args([
            "bench",
            "--synthetic",
            "tiny",
            "-p",
            "8",
            "-n",
            "4",
            "-r",
            "1",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("| tg4 |") && table.contains("cpu"),
        "{table}"
    );
}

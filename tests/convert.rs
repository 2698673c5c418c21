//! `sfx-convert` end to end on the real SmolLM2-135M: RTN codes equal an in-process RTN, AWQ
//! beats RTN against the float model, the stored MLP refinement reconstructs the float MLP,
//! conversion is byte-identical across thread counts, a killed conversion leaves the output
//! path untouched, an output folder holds the same container and `sfx verify` names a
//! corrupted file of it, and bad options are named.

use crate::common::{
    assets, f32_options as opts, float_model, gguf, logits, mean_kl, quick_args, stdout_of,
    wiki_tokens,
};
use sfx_formats::resident::GroupQuantized;
use sfx_formats::sfx::{Layout, SfxFile};
use sfx_formats::{OwnedTensors, TensorSource};
use sfx_runtime::resident::RtnFactory;
use sfx_runtime::{load_sfx_model, CpuBackend, Model, SfxTensors};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

fn out_dir() -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("convert_test");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs sfx-convert with `threads` rayon threads; panics with its stderr on failure.
fn convert(args: &[&str], threads: usize) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_sfx-convert"))
        .args(args)
        .env("SFX_ASSETS", assets())
        .env("RAYON_NUM_THREADS", threads.to_string())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "sfx-convert {args:?} failed:\n{stderr}"
    );
    stderr
}

/// `rtn4` with one 32-token calibration sequence and no held-out text (the resident codes
/// do not depend on calibration) plus `extra` flags, written to `name`, opened and verified.
fn quick_rtn4(name: &str, extra: &[&str]) -> SfxFile {
    let path = out_dir().join(name);
    let args = quick_args("rtn4", extra, &path);
    convert(&args.iter().map(String::as_str).collect::<Vec<_>>(), 2);
    let file = SfxFile::open(&path).unwrap();
    file.verify().unwrap();
    file
}

/// A conversion several tests read, made once per test binary (each costs tens of seconds
/// on two cores): its path.
fn shared(cell: &'static OnceLock<PathBuf>, name: &str, extra: &[&str]) -> &'static PathBuf {
    cell.get_or_init(|| {
        quick_rtn4(name, extra);
        out_dir().join(name)
    })
}

/// Plain `rtn4` with the default (q8) head: the tied-head test's file and the refit test's base.
fn rtn4_default() -> SfxFile {
    static P: OnceLock<PathBuf> = OnceLock::new();
    SfxFile::open(shared(&P, "rtn4-head-q8.sfx", &[])).unwrap()
}

/// `rtn4 --fit --mlp both --k 8`: the ladder's single-k reference, the refit test's direct
/// conversion, and the tune tests' "another file" (they copy it).
pub(crate) fn rtn4_fit_k8_path() -> &'static PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    shared(
        &P,
        "rtn4-fit-k8.sfx",
        &["--fit", "--mlp", "both", "--k", "8"],
    )
}

fn rtn4_fit_k8() -> SfxFile {
    SfxFile::open(rtn4_fit_k8_path()).unwrap()
}

#[test]
fn rtn4_container_runs_exactly_like_in_process_rtn() {
    let file = quick_rtn4("rtn4.sfx", &["--head", "bf16"]);
    let sfx_model = load_sfx_model(&file, &opts()).unwrap();
    let (ckpt, _) = float_model();
    let rtn = Model::load_with(
        CpuBackend::new(),
        &ckpt.config,
        &*ckpt.tensors,
        &RtnFactory::new(4),
        &opts(),
    )
    .unwrap();
    let ids = &wiki_tokens(24);
    let (a, b) = (logits(&sfx_model, ids, None), logits(&rtn, ids, None));
    let diff = a
        .iter()
        .zip(&b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        diff <= 1e-4,
        "converted rtn4 vs in-process rtn4: max |Δlogit| {diff}"
    );
    // 4-bit codes + f16 scale + u8 zero per 128 weights (576 = 4·128 + 64 adds a group).
    let bpw = file.metadata().params["quant"]["bits_per_weight"]
        .as_f64()
        .unwrap();
    assert!((4.18..4.25).contains(&bpw), "bits per weight {bpw}");
    std::fs::remove_file(file.path()).unwrap();
}

/// The default head (`q8`) on the tied SmolLM2: the embedding section becomes 8-bit codes (no second
/// table), close to the float table, and the converted model equals an in-process RTN model
/// whose float embedding is those codes dequantized — so the runtime's row gather from codes
/// and its coded head agree with the float embedding and head paths on the same values.
#[test]
fn quantized_tied_head_is_one_table_serving_embedding_and_head() {
    let file = rtn4_default();
    let name = "model.embed_tokens.weight";
    let layout = file.section(name).unwrap().layout.clone();
    assert!(
        matches!(
            layout,
            Layout::PackedCodes {
                bits: 8,
                group: 128,
                ..
            }
        ),
        "{name}: {layout:?}"
    );
    assert!(
        file.section("lm_head.weight").is_err(),
        "a tied head has no second table"
    );
    assert_eq!(file.metadata().params["head"]["format"], "q8");
    let (table, vocab, hidden) = dequantized(&file, name.trim_end_matches(".weight"));
    let (ckpt, _) = float_model();
    let float = ckpt.tensors.tensor(name).unwrap().to_f32_vec();
    assert_eq!(table.len(), float.len());
    let (num, den) = table
        .iter()
        .zip(&float)
        .fold((0.0f64, 0.0f64), |(n, d), (a, b)| {
            (n + f64::from(a - b).powi(2), d + f64::from(*b).powi(2))
        });
    let rel = (num / den).sqrt();
    // 8 bits over a group's range: about (range/255)/√12 per weight, well under 1 % of the
    // table's RMS for SmolLM2's embedding (its rows are near-Gaussian).
    assert!(rel < 0.01, "8-bit table relative error {rel}");

    let mut tensors = OwnedTensors::new();
    for n in ckpt.tensors.tensor_names() {
        let v = ckpt.tensors.tensor(&n).unwrap();
        let values = if n == name {
            table.clone()
        } else {
            v.to_f32_vec()
        };
        tensors.insert_f32(n.clone(), v.shape.to_vec(), &values);
    }
    let reference = Model::load_with(
        CpuBackend::new(),
        &ckpt.config,
        &tensors,
        &RtnFactory::new(4),
        &opts(),
    )
    .unwrap();
    let model = load_sfx_model(&file, &opts()).unwrap();
    assert_eq!(model.config().vocab_size, vocab);
    assert_eq!(model.config().hidden_size, hidden);
    let ids = &wiki_tokens(24);
    let (a, b) = (logits(&model, ids, None), logits(&reference, ids, None));
    let diff = a
        .iter()
        .zip(&b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        diff <= 1e-3,
        "q8-head .sfx vs float path on the same table: max |Δlogit| {diff}"
    );
    // One resident table: the 8-bit codes + scales + zeros, not a BF16 copy besides.
    let embed_bytes = vocab * hidden + vocab * hidden.div_ceil(128) * 3;
    let float_bytes = vocab * hidden * 2;
    assert!(model.resident_bytes() + float_bytes / 2 < reference.resident_bytes());
    assert!(model.embedding().resident_bytes() == embed_bytes);
}

/// `awq3 --fit --mlp both` (small AWQ grid, for time) with a held-out set, converted with 2
/// and with 1 thread.
fn awq3_pair() -> &'static (PathBuf, PathBuf) {
    static P: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    P.get_or_init(|| {
        let g = gguf();
        let run = |name: &str, threads: usize| {
            let path = out_dir().join(name);
            let args = [
                "--quant",
                "awq3",
                "--head",
                "bf16",
                "--fit",
                "--mlp",
                "both",
                "--k",
                "16,8,16,32",
                "--awq-grid",
                "5,5",
                g.to_str().unwrap(),
                "-o",
                path.to_str().unwrap(),
                "--calib-seqs",
                "2",
                "--calib-len",
                "128",
                "--heldout-seqs",
                "1",
            ];
            let log = convert(&args, threads);
            assert!(
                log.contains("layer  30/30"),
                "per-layer log missing:\n{log}"
            );
            path
        };
        (run("awq3-t2.sfx", 2), run("awq3-t1.sfx", 1))
    })
}

#[test]
fn conversion_is_byte_identical_across_thread_counts() {
    let (a, b) = awq3_pair();
    let (a, b) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    assert_eq!(a.len(), b.len(), "file sizes differ");
    let first = a.iter().zip(&b).position(|(x, y)| x != y);
    assert!(first.is_none(), "files differ first at byte {first:?}");
    // Only this test reads the 1-thread file; CI's disk is finite.
    std::fs::remove_file(&awq3_pair().1).unwrap();
}

#[test]
fn awq3_container_beats_rtn3_and_records_what_it_did() {
    let (path, _) = awq3_pair();
    let file = SfxFile::open(path).unwrap();
    file.verify().unwrap();
    let (ckpt, float) = float_model();
    let ids = wiki_tokens(96);
    let vocab = ckpt.config.vocab_size;
    let reference = logits(float, &ids, None);
    let awq = load_sfx_model(&file, &opts()).unwrap();
    let rtn = Model::load_with(
        CpuBackend::new(),
        &ckpt.config,
        &*ckpt.tensors,
        &RtnFactory::new(3),
        &opts(),
    )
    .unwrap();
    let kl_awq = mean_kl(&reference, &logits(&awq, &ids, None), vocab);
    let kl_rtn = mean_kl(&reference, &logits(&rtn, &ids, None), vocab);
    // Measured: awq3 ≈ 0.5 of rtn3's KL even with 256 calibration tokens.
    assert!(
        kl_awq < 0.8 * kl_rtn,
        "awq3 KL {kl_awq} vs rtn3 KL {kl_rtn}"
    );

    let m = file.metadata();
    let refine = &m.params["refine"];
    assert_eq!(refine["fit"], true);
    assert_eq!(refine["k"]["o"], 8);
    assert_eq!(refine["k"]["d"], 32);
    assert_eq!(refine["bundle_k"], 24);
    assert_eq!(m.params["calibration"]["tokens"], 256);
    assert_eq!(m.params["awq"]["alpha"].as_array().unwrap().len(), 30);
    assert!(m.provenance.calibration_text_sha256.is_some());
    assert!(m
        .provenance
        .source_files_sha256
        .contains_key("SmolLM2-135M-Instruct.Q4_1.gguf"));
    for l in [0, 29] {
        let p = format!("model.layers.{l}");
        for proj in [
            "self_attn.q_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.down_proj",
        ] {
            let s = file.section(&format!("{p}.{proj}.refine")).unwrap();
            assert_eq!(s.tier.as_str(), "ram");
        }
        let b = file.section(&format!("{p}.mlp.bundles")).unwrap();
        assert_eq!(
            b.layout,
            &Layout::NeuronBundles {
                neurons: 1536,
                hidden: 576
            }
        );
    }
}

/// Signed level of element `i` of a nibble vector (docs/format.md, `column_nibbles`).
fn level(bytes: &[u8], i: usize) -> f32 {
    let b = bytes[i / 2];
    let nib = if i.is_multiple_of(2) {
        b & 0x0F
    } else {
        b >> 4
    };
    nib as f32 - 8.0
}

fn f16s(file: &SfxFile, name: &str) -> Vec<f32> {
    file.section(name)
        .unwrap()
        .decode()
        .unwrap()
        .chunks_exact(2)
        .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect()
}

fn dequantized(file: &SfxFile, prefix: &str) -> (Vec<f32>, usize, usize) {
    let codes = file.section(&format!("{prefix}.weight")).unwrap();
    let Layout::PackedCodes {
        rows,
        cols,
        bits,
        group,
    } = codes.layout.clone()
    else {
        panic!("{prefix}: not packed codes");
    };
    let scales = f16s(file, &format!("{prefix}.weight.scales"));
    let zeros = file
        .section(&format!("{prefix}.weight.zeros"))
        .unwrap()
        .decode()
        .unwrap()
        .to_vec();
    let q = GroupQuantized::from_parts(
        bits as u8,
        group as usize,
        rows as usize,
        cols as usize,
        codes.decode().unwrap().to_vec(),
        scales.into_iter().map(half::f16::from_f32).collect(),
        zeros,
    )
    .unwrap();
    (q.dequantize(), rows as usize, cols as usize)
}

/// A plain-refinement (no --fit) awq3 container with channels and bundles.
fn awq3_plain() -> &'static PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let g = gguf();
        let path = out_dir().join("awq3-plain.sfx");
        let args = [
            "--quant",
            "awq3",
            "--head",
            "bf16",
            "--mlp",
            "both",
            "--awq-grid",
            "5,5",
            g.to_str().unwrap(),
            "-o",
            path.to_str().unwrap(),
            "--calib-seqs",
            "2",
            "--calib-len",
            "128",
            "--heldout",
            "none",
        ];
        convert(&args, 2);
        path
    })
}

/// Float f32 copies of the container's dense tensors (embedding, folded norms).
fn dense_tensors(file: &SfxFile) -> OwnedTensors {
    let src = SfxTensors::new(file).unwrap();
    let mut t = OwnedTensors::new();
    for name in src.tensor_names() {
        let v = src.tensor(&name).unwrap();
        t.insert_f32(name.clone(), v.shape.to_vec(), &v.to_f32_vec());
    }
    t
}

/// Adds `Σ level · scale` of a column-major nibble matrix (`column_nibbles`) to `w`.
fn add_columns(file: &SfxFile, prefix: &str, w: &mut [f32], rows: usize, cols: usize) {
    let packed = file
        .section(&format!("{prefix}.refine"))
        .unwrap()
        .decode()
        .unwrap();
    let scales = f16s(file, &format!("{prefix}.refine.scales"));
    let cb = rows.div_ceil(2);
    for i in 0..cols {
        let col = &packed[i * cb..(i + 1) * cb];
        for (r, s) in scales.iter().enumerate() {
            w[r * cols + i] += level(col, r) * s;
        }
    }
}

const PROJS: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

#[test]
fn resident_codes_plus_stored_residual_rebuild_the_float_model() {
    // Without --fit every refinement holds the plain residual R = W' − Q(W') (W' = W·diag s),
    // so codes + refinement rebuild W' up to R's 4-bit rounding, and with the folded norms and
    // rows the rebuilt model must sit far closer to the float model than the resident base.
    // Two independent rebuilds: channel columns for every projection, and neuron bundles
    // (gate/up rows, down refinement column) for the MLP. This checks AWQ's folding into
    // both RMSNorms, v_proj/up_proj rows, and both refinement layouts, decoded here from
    // docs/format.md rather than with the converter's code.
    let path = awq3_plain();
    let file = SfxFile::open(path).unwrap();
    let (ckpt, float) = float_model();
    let c = &ckpt.config;
    let (hidden, ffn) = (c.hidden_size, c.intermediate_size);
    let mut columns = dense_tensors(&file);
    let mut bundled = dense_tensors(&file);
    let cb = hidden.div_ceil(2);
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let bundles = file
            .section(&format!("{p}.mlp.bundles"))
            .unwrap()
            .decode()
            .unwrap();
        let row_s = f16s(&file, &format!("{p}.mlp.bundles.row_scales"));
        let col_s = f16s(&file, &format!("{p}.mlp.bundles.col_scales"));
        let part = |j: usize, k: usize| &bundles[(j * 4 + k) * cb..(j * 4 + k + 1) * cb];
        for proj in PROJS {
            let prefix = format!("{p}.{proj}");
            let (base, rows, cols) = dequantized(&file, &prefix);
            let mut w = base.clone();
            add_columns(&file, &prefix, &mut w, rows, cols);
            let name = format!("{prefix}.weight");
            columns.insert_f32(name.clone(), vec![rows, cols], &w);
            let mut w = base;
            match proj {
                "mlp.gate_proj" | "mlp.up_proj" => {
                    let k = usize::from(proj == "mlp.up_proj");
                    for j in 0..rows {
                        for i in 0..cols {
                            w[j * cols + i] += level(part(j, k), i) * row_s[k * ffn + j];
                        }
                    }
                }
                "mlp.down_proj" => {
                    for j in 0..ffn {
                        for i in 0..hidden {
                            w[i * ffn + j] += level(part(j, 2), i) * col_s[i];
                        }
                    }
                }
                _ => {}
            }
            bundled.insert_f32(name, vec![rows, cols], &w);
        }
    }
    let ids = wiki_tokens(96);
    let reference = logits(float, &ids, None);
    let kl = |m: &Model<CpuBackend>| mean_kl(&reference, &logits(m, &ids, None), c.vocab_size);
    let kl_base = kl(&load_sfx_model(&file, &opts()).unwrap());
    let kl_columns = kl(&Model::load_cpu(c, &columns, &opts()).unwrap());
    let kl_bundles = kl(&Model::load_cpu(c, &bundled, &opts()).unwrap());
    eprintln!("KL vs float: base {kl_base:.4}, columns {kl_columns:.4}, bundles {kl_bundles:.4}");
    assert!(
        kl_columns < 0.1 * kl_base,
        "columns {kl_columns} vs base {kl_base}"
    );
    // Bundles refine only the MLP: less than the columns, still a large gain.
    assert!(
        kl_bundles < 0.7 * kl_base,
        "bundles {kl_bundles} vs base {kl_base}"
    );
    // Part 4 of a bundle is a 4-bit copy of W'_down: it must agree with the rebuilt down
    // weight to within its own quantization step (plus clipping at the row extremes).
    let (l, j) = (7, 100);
    let p = format!("model.layers.{l}");
    let bundles = file
        .section(&format!("{p}.mlp.bundles"))
        .unwrap()
        .decode()
        .unwrap();
    let col_s = f16s(&file, &format!("{p}.mlp.bundles.col_scales"));
    let down = columns
        .tensor(&format!("{p}.mlp.down_proj.weight"))
        .unwrap()
        .to_f32_vec();
    let copy = &bundles[(j * 4 + 3) * cb..(j * 4 + 4) * cb];
    let mut within = 0;
    for i in 0..hidden {
        let step = col_s[hidden + i];
        let v = level(copy, i) * step;
        if (v - down[i * ffn + j]).abs() <= 0.75 * step {
            within += 1;
        }
    }
    assert!(
        within * 100 >= 95 * hidden,
        "down copy: {within}/{hidden} within a step"
    );
}

/// `sfx verify PATH`: (success, stdout + stderr).
fn sfx_verify(path: &Path) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sfx"))
        .arg("verify")
        .arg(path)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// `sfx publish ARGS` with no Hugging Face token or client reachable but what `env` adds
/// (HOME is an empty folder): (success, stdout, stderr).
fn sfx_publish(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let home = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sfx"));
    cmd.arg("publish").args(args).env("HOME", home.path());
    for var in [
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_TOKEN_PATH",
        "HF_HOME",
        "XDG_CACHE_HOME",
        "SFX_HF_CLI",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("PATH", home.path());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The YAML front matter of a model card, parsed.
fn card_front_matter(card: &str) -> yaml_rust2::Yaml {
    let body = card
        .strip_prefix("---\n")
        .expect("front matter opens the card");
    let end = body.find("\n---\n").expect("front matter is closed");
    let mut docs = yaml_rust2::YamlLoader::load_from_str(&body[..end]).expect("YAML parses");
    docs.remove(0)
}

#[test]
fn folder_output_holds_the_same_container_and_names_a_corrupted_file() {
    let folder = out_dir().join("rtn4-fit-folder");
    let _ = std::fs::remove_dir_all(&folder);
    let single = rtn4_fit_k8();
    let receipt = ["--quality", "wiki:1", "--quality-ctx", "256"];
    // A GGUF names no Hub repository of its float model; the card's base_model comes from here.
    let card_source = ["--base-model", "HuggingFaceTB/SmolLM2-135M-Instruct"];
    let args = quick_args(
        "rtn4",
        &[
            &["--fit", "--mlp", "both", "--k", "8"][..],
            &receipt,
            &card_source,
        ]
        .concat(),
        &folder,
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    convert(&args, 2);
    // The folder's container is the single file's, byte for byte.
    assert_eq!(
        std::fs::read(folder.join("model.sfx")).unwrap(),
        std::fs::read(single.path()).unwrap()
    );
    let (ok, text) = sfx_verify(&folder);
    assert!(ok && text.contains(": OK ("), "{text}");
    // The tools take the folder where they take its container: the same greedy tokens.
    let generate = |model: &Path| {
        stdout_of(
            Command::new(env!("CARGO_BIN_EXE_sfx-run"))
                .arg(model)
                .args(["-p", "The capital of France is", "-n", "6"]),
        )
    };
    assert_eq!(generate(&folder), generate(single.path()));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(folder.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["num_hidden_layers"], 30);
    assert_eq!(
        config["quantization_config"]["resident"]["name"],
        "rtn4-g128"
    );
    assert_eq!(config["quantization_config"]["refinement"]["k"]["qkv"], 8);
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(folder.join("manifest.json")).unwrap())
            .unwrap();
    assert_eq!(manifest["command_line"][3], "--fit");
    for name in [
        "model.sfx",
        "config.json",
        "README.md",
        "generation_config.json",
        "tokenizer.json",
    ] {
        assert!(
            manifest["files"][name]["sha256"].is_string(),
            "{name} in {manifest}"
        );
    }
    assert_eq!(
        manifest["source_files_sha256"]["SmolLM2-135M-Instruct.Q4_1.gguf"]
            .as_str()
            .map(str::len),
        Some(64)
    );
    let card = std::fs::read_to_string(folder.join("README.md")).unwrap();
    // The card's front matter is YAML with the keys the Hub reads.
    let front = card_front_matter(&card);
    for key in ["license", "library_name", "pipeline_tag"] {
        assert!(front[key].as_str().is_some(), "{key} missing: {card}");
    }
    assert_eq!(
        front["base_model"].as_str(),
        Some("HuggingFaceTB/SmolLM2-135M-Instruct")
    );
    assert_eq!(front["base_model_relation"].as_str(), Some("quantized"));
    assert!(
        front["tags"].as_vec().is_some_and(|t| !t.is_empty()),
        "{card}"
    );
    // The quality receipt is listed, shown on the card, and its numbers are what the command
    // it records measures again (run in the folder, as the card says).
    assert!(manifest["files"]["quality.json"]["sha256"].is_string());
    let receipt: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(folder.join("quality.json")).unwrap())
            .unwrap();
    assert!(
        card.contains("## Quality") && card.contains("| resident base |"),
        "{card}"
    );
    let command: Vec<&str> = receipt["command"].as_str().unwrap().split(' ').collect();
    assert_eq!(&command[..2], ["sfx-run", "."], "{receipt}");
    let again: serde_json::Value = serde_json::from_str(&stdout_of(
        Command::new(env!("CARGO_BIN_EXE_sfx-run"))
            .args(&command[1..])
            .arg("--json")
            .current_dir(&folder)
            .env("SFX_ASSETS", assets())
            .env("RAYON_NUM_THREADS", "2"),
    ))
    .unwrap();
    let close = |a: &serde_json::Value, b: &serde_json::Value| {
        let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
        assert!((a - b).abs() <= 1e-9 * a.abs().max(1e-12), "{a} vs {b}");
    };
    close(&receipt["base"]["ppl"], &again["base"]["ppl"]);
    close(&receipt["base"]["kl_mean"], &again["base"]["kl"]["mean"]);
    close(&receipt["refined"]["ppl"], &again["ppl"]);
    close(&receipt["refined"]["kl_mean"], &again["kl"]["mean"]);
    assert_eq!(receipt["refined"]["k"][0], 8);
    assert_eq!(receipt["scored_tokens"], 255);
    // `sfx publish --dry-run` lists exactly the manifest's files and the manifest itself,
    // with the sizes and SHA-256s verify checked; it needs neither token nor client.
    let folder_arg = folder.to_str().unwrap();
    let (ok, dry, err) = sfx_publish(
        &[
            folder_arg,
            "--repo",
            "my-org/smol-rtn4",
            "--dry-run",
            "--json",
        ],
        &[],
    );
    assert!(ok, "{err}");
    let dry: serde_json::Value = serde_json::from_str(&dry).unwrap();
    let sent: Vec<&str> = dry["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    let mut want: Vec<&str> = manifest["files"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    want.push("manifest.json");
    assert_eq!(sent, want);
    for f in dry["files"].as_array().unwrap() {
        let name = f["name"].as_str().unwrap();
        let bytes = std::fs::metadata(folder.join(name)).unwrap().len();
        assert_eq!(f["bytes"].as_u64(), Some(bytes), "{name}");
        if name != "manifest.json" {
            assert_eq!(f["sha256"], manifest["files"][name]["sha256"], "{name}");
        }
    }
    assert!(dry["token"].is_null() && dry["client"].is_null(), "{dry}");
    // Without a token nothing is sent, and the error says how to give one.
    let (ok, _, err) = sfx_publish(&[folder_arg, "--repo", "my-org/smol-rtn4"], &[]);
    assert!(!ok && err.contains("no Hugging Face token"), "{err}");
    // With a token the official client is run on the folder (a stand-in records its
    // arguments here); a bad repository id is refused before anything else.
    let bin = tempfile::tempdir().unwrap();
    let record = bin.path().join("args.txt");
    let client = bin.path().join("hf");
    std::fs::write(
        &client,
        format!("#!/bin/sh\nprintf '%s\\n' \"$@\" > {}\n", record.display()),
    )
    .unwrap();
    std::fs::set_permissions(&client, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let client_env = [
        ("HF_TOKEN", "hf_test"),
        ("SFX_HF_CLI", client.to_str().unwrap()),
    ];
    let (ok, out, err) = sfx_publish(
        &[folder_arg, "--repo", "my-org/smol-rtn4", "--private"],
        &client_env,
    );
    assert!(ok && out.contains("published"), "{out}{err}");
    assert_eq!(
        std::fs::read_to_string(&record)
            .unwrap()
            .lines()
            .collect::<Vec<_>>(),
        ["upload", "my-org/smol-rtn4", folder_arg, ".", "--private"]
    );
    let (ok, _, err) = sfx_publish(&[folder_arg, "--repo", "smol-rtn4"], &client_env);
    assert!(!ok && err.contains("no namespace"), "{err}");
    // A file the manifest does not list is refused by name (it would go out unchecked).
    let stray = folder.join("notes.txt");
    std::fs::write(&stray, b"draft").unwrap();
    let (ok, _, err) = sfx_publish(&[folder_arg, "--repo", "o/n", "--dry-run"], &[]);
    std::fs::remove_file(&stray).unwrap();
    assert!(!ok && err.contains("notes.txt"), "{err}");
    // A flipped byte in any file is named by `sfx verify`, which exits non-zero.
    for name in [
        "README.md",
        "config.json",
        "model.sfx",
        "tokenizer.json",
        "manifest.json",
        "quality.json",
    ] {
        let bad = out_dir().join(format!("rtn4-fit-folder-bad-{name}"));
        let _ = std::fs::remove_dir_all(&bad);
        std::fs::create_dir_all(&bad).unwrap();
        for e in std::fs::read_dir(&folder).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), bad.join(e.file_name())).unwrap();
        }
        let mut bytes = std::fs::read(bad.join(name)).unwrap();
        let at = bytes.len() / 3;
        bytes[at] ^= 0x01;
        std::fs::write(bad.join(name), &bytes).unwrap();
        let (ok, text) = sfx_verify(&bad);
        assert!(!ok && text.contains(name), "{name}: {text}");
        // Publishing it is refused too, naming the same file.
        let (ok, _, err) = sfx_publish(&[bad.to_str().unwrap(), "--repo", "o/n", "--dry-run"], &[]);
        assert!(!ok && err.contains(name), "{name}: {err}");
        std::fs::remove_dir_all(&bad).unwrap();
    }
    // Converting into a folder that is not an output folder is refused before any work,
    // and leaves it as it was.
    let other = out_dir().join("not-an-output-folder");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("keep.txt"), b"mine").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_sfx-convert"))
        .args(quick_args("rtn4", &["--fit", "--k", "8"], &other))
        .env("SFX_ASSETS", assets())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("not an output folder"),
        "{stderr}"
    );
    assert_eq!(std::fs::read(other.join("keep.txt")).unwrap(), b"mine");
    assert_eq!(std::fs::read_dir(&other).unwrap().count(), 1);
}

#[test]
fn killed_conversion_leaves_the_output_path_untouched() {
    let dir = out_dir().join("kill");
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("model.sfx");
    std::fs::write(&out, b"previous contents").unwrap();
    // The partial state an earlier run of this test left (tests/resume.rs continues it).
    let state = dir.join(".model.sfx.resume");
    let _ = std::fs::remove_dir_all(&state);
    let g = gguf();
    let mut child = Command::new(env!("CARGO_BIN_EXE_sfx-convert"))
        .args([
            "--quant",
            "rtn3",
            "--head",
            "bf16",
            g.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ])
        .args([
            "--calib-seqs",
            "4",
            "--calib-len",
            "128",
            "--heldout",
            "none",
        ])
        .env("SFX_ASSETS", assets())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Kill once the partial container exists and has sections in it.
    let started = std::time::Instant::now();
    loop {
        let part_bytes = std::fs::metadata(state.join("model.sfx.part")).map_or(0, |m| m.len());
        if part_bytes > 1 << 20 {
            break;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "converter ended before the kill"
        );
        assert!(
            started.elapsed().as_secs() < 120,
            "no partial container appeared"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), b"previous contents");
    let _ = std::fs::remove_dir_all(&state);
}

/// `--k-ladder` fits every rung in one calibration pass: each rung's columns and bundles are
/// byte for byte what a conversion fitted at that k alone writes, and a run at budget k reads
/// the largest rung not above it.
#[test]
fn ladder_rungs_equal_one_conversion_per_k() {
    let fit = ["--fit", "--mlp", "both"];
    fn with<'a>(fit: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
        fit.iter().chain(extra).copied().collect()
    }
    let ladder = quick_rtn4(
        "rtn4-ladder.sfx",
        &with(&fit, &["--k-ladder", "8,16", "--k", "16"]),
    );
    // Rung 8 is not the file's default (16): the ladder's other rungs are checked too.
    let singles = [(8, rtn4_fit_k8())];
    assert_eq!(
        ladder.metadata().params["refine"]["ladder"],
        serde_json::json!([8, 16])
    );
    let bytes = |f: &SfxFile, name: &str| f.section(name).unwrap().decode().unwrap().to_vec();
    for (k, single) in &singles {
        for l in [0, 17, 29] {
            let p = format!("model.layers.{l}");
            for proj in [
                "self_attn.q_proj",
                "self_attn.o_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            ] {
                for suffix in ["", ".scales"] {
                    let a = format!("{p}.{proj}.refine.k{k}{suffix}");
                    let b = format!("{p}.{proj}.refine{suffix}");
                    assert_eq!(bytes(&ladder, &a), bytes(single, &b), "{a} vs {b}");
                }
            }
            for suffix in ["", ".row_scales", ".col_scales"] {
                let a = format!("{p}.mlp.bundles.k{k}{suffix}");
                let b = format!("{p}.mlp.bundles{suffix}");
                assert_eq!(bytes(&ladder, &a), bytes(single, &b), "{a} vs {b}");
            }
        }
    }
    // The resident codes do not depend on k.
    let q = "model.layers.3.mlp.gate_proj.weight";
    assert_eq!(bytes(&ladder, q), bytes(&singles[0].1, q));

    let config = ladder.metadata().config.clone().unwrap();
    let plan = sfx_runtime::refine::plan_from_sfx(&ladder, &config, Some([8, 31, 7, 100])).unwrap();
    assert_eq!(plan.fitted_k, [Some(8), Some(16), Some(8), Some(16)]);
    let down = &plan.layers[2].sets[3][0];
    let want = ladder
        .section("model.layers.2.mlp.down_proj.refine.k16")
        .unwrap()
        .offset;
    assert_eq!(down.offset, want);
    let default = sfx_runtime::refine::plan_from_sfx(&ladder, &config, None).unwrap();
    assert_eq!(default.fitted_k, [Some(16); 4]);
    std::fs::remove_file(ladder.path()).unwrap();
}

/// `--base` keeps a file's resident codes and fits new refinement: refitting a plain rtn4
/// file gives byte for byte the sections of a direct `--fit` conversion, records the base's
/// digest, and refuses an AWQ file (its scales are folded) or a `--quant` the file does not
/// hold.
#[test]
fn refit_from_a_base_equals_a_direct_conversion() {
    let fit = ["--fit", "--mlp", "both", "--k", "8"];
    let base = rtn4_default();
    let base_arg = base.path().to_str().unwrap();
    let refit = quick_rtn4(
        "rtn4-refit.sfx",
        &[&["--base", base_arg][..], &fit].concat(),
    );
    let direct = rtn4_fit_k8();
    let names = |f: &SfxFile| f.sections().map(|s| s.name.to_string()).collect::<Vec<_>>();
    assert_eq!(names(&refit), names(&direct));
    for s in direct.sections() {
        let other = refit.section(s.name).unwrap();
        assert_eq!(other.sha256, s.sha256, "{}", s.name);
    }
    let p = &refit.metadata().params;
    assert_eq!(p["base"]["refitted_from"], base.content_digest());
    assert_eq!(p["quant"], direct.metadata().params["quant"]);

    let awq = awq3_plain();
    let g = gguf();
    let o = out_dir().join("never-refit.sfx");
    for (args, needle) in [
        (vec!["--base", awq.to_str().unwrap(), "--fit"], "awq"),
        (vec!["--base", base_arg, "--quant", "rtn3"], "--quant rtn3"),
        (
            vec!["--base", "/nonexistent/base.sfx"],
            "/nonexistent/base.sfx",
        ),
    ] {
        let args = [&args[..], &[g.to_str().unwrap(), "-o", o.to_str().unwrap()]].concat();
        refused(&args, needle);
    }
    assert!(!o.exists());
    std::fs::remove_file(refit.path()).unwrap();
}

#[test]
fn bad_options_are_named() {
    let g = gguf();
    let g = g.to_str().unwrap();
    let o = out_dir().join("never.sfx");
    let o = o.to_str().unwrap();
    let folder = out_dir().join("never-folder");
    let folder = folder.to_str().unwrap();
    let not_gguf = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let cases: [(&[&str], &str); 26] = [
        (
            &["--quant", "rtn3", "--imatrix", g, "-o", o],
            "--imatrix goes with a llama.cpp type from a float model",
        ),
        (&["--quant", "gguf", g, "-o", o], "--float-source <hf-dir"),
        (
            &["--quant", "q4_k_m", g, "-o", o],
            "--quant \"q4_k_m\": expected rtnN, awqN, qtipN, yaqaN, sqllmN or lnqN with N = 2, 3 \
             or 4, a llama.cpp type (q2_k",
        ),
        (
            &["--quant", "sqllm5", g, "-o", o],
            "--quant \"sqllm5\": expected rtnN",
        ),
        (
            &["--quant", "lnq1", g, "-o", o],
            "--quant \"lnq1\": expected rtnN",
        ),
        (
            &["--quant", "qtip2", "--rotation", "b100", g, "-o", o],
            "--rotation \"b100\": expected full or bN",
        ),
        (
            &["--quant", "rtn3", "--imatrix-file", not_gguf, g, "-o", o],
            "--imatrix-file goes with a llama.cpp type from a float model",
        ),
        (
            &["--quant", "q4_k", "--imatrix-file", not_gguf, g, "-o", o],
            "not an importance matrix",
        ),
        (
            &["--quant", "gguf", not_gguf, "--float-source", g, "-o", o],
            "is not a GGUF file",
        ),
        (
            &["--quant", "rtn3", "--float-source", g, g, "-o", o],
            "--float-source goes with --quant gguf",
        ),
        (
            &["--quant", "rtn3", "--fit", "--lambda=-1", g, "-o", o],
            "--lambda \"-1\"",
        ),
        (
            &["--quant", "rtn3", "--fit", "--lambda", "0x", g, "-o", o],
            "--lambda \"0x\"",
        ),
        (
            &[
                "--quant",
                "rtn3",
                "--fit",
                "--fit-prior",
                "ridge",
                g,
                "-o",
                o,
            ],
            "--fit-prior \"ridge\"",
        ),
        (
            &["--quant", "rtn3", "--k-ladder", "8,16", g, "-o", o],
            "--k-ladder needs --fit",
        ),
        (
            &["--quant", "rtn3", "--fit", "--k-ladder", "16,8", g, "-o", o],
            "must increase",
        ),
        (
            &["--quant", "rtn3", "--fit", "--k-ladder", "8,32", g, "-o", o],
            "--k 16",
        ),
        (&["--quant", "awq5", g, "-o", o], "--quant"),
        (
            &["--quant", "rtn3", "--head", "q5", g, "-o", o],
            "--head \"q5\"",
        ),
        (&["--quant", "rtn3", "--k", "2000", g, "-o", o], "--k 2000"),
        (&["--quant", "rtn3", "--k", "0", g, "-o", o], "--k 0"),
        (
            &["--quant", "rtn3", "--quality", "wiki:2", g, "-o", o],
            "output folder",
        ),
        (
            &["--quant", "rtn3", "--quality", "wiki", g, "-o", folder],
            "--quality",
        ),
        (&["--quant", "rtn3", "--k", "1,2", g, "-o", o], "four"),
        (&["--quant", "rtn3", "--mlp", "rows", g, "-o", o], "--mlp"),
        (
            &["--quant", "rtn3", "--calib", "wiki", g, "-o", o],
            "held-out",
        ),
        (
            &["--quant", "rtn3", "/nonexistent/model", "-o", o],
            "/nonexistent/model",
        ),
    ];
    for (args, needle) in cases {
        refused(args, needle);
        assert!(!Path::new(folder).exists(), "{args:?} left {folder}");
    }
    // Without the receipt's text (no assets), a folder conversion stops before any work.
    let out = Command::new(env!("CARGO_BIN_EXE_sfx-convert"))
        .args([
            "--quant",
            "rtn3",
            g,
            "-o",
            folder,
            "--calib",
            "/nonexistent/calib.txt",
        ])
        .env("SFX_ASSETS", "/nonexistent/assets")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("--quality wiki"),
        "{stderr}"
    );
    assert!(!Path::new(folder).exists());
    assert!(!Path::new(o).exists());
}

/// sfx-convert `args` fails with a message containing `needle`, without a panic.
fn refused(args: &[&str], needle: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_sfx-convert"))
        .args(args)
        .env("SFX_ASSETS", assets())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(stderr.contains(needle), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
}

#[test]
fn publish_workflow_parses_and_calls_only_project_commands() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(".github/workflows/publish.yml");
    let text = std::fs::read_to_string(&path).unwrap();
    let doc = yaml_rust2::YamlLoader::load_from_str(&text)
        .unwrap()
        .remove(0);
    let jobs = doc["jobs"].as_hash().expect("jobs");
    assert!(!jobs.is_empty());
    let allowed = [
        "make build",
        "make assets",
        "make hub-client",
        "./target/release/sfx-convert ",
        "./target/release/sfx verify ",
        "./target/release/sfx publish ",
    ];
    let mut steps_run = Vec::new();
    for (_, job) in jobs {
        assert!(
            job["strategy"]["matrix"]["quant"]
                .as_vec()
                .is_some_and(|q| q.len() >= 2),
            "a model × quant matrix"
        );
        for step in job["steps"].as_vec().expect("steps") {
            if let Some(uses) = step["uses"].as_str() {
                assert!(uses.starts_with("actions/checkout@"), "{uses}");
                continue;
            }
            let run = step["run"].as_str().expect("a step runs a command");
            for line in run.lines().filter(|l| !l.trim().is_empty()) {
                assert!(
                    allowed.iter().any(|a| line.trim().starts_with(a)),
                    "not a project command: {line}"
                );
            }
            steps_run.push(run.to_string());
        }
    }
    // Convert, verify, then publish, in that order (the receipt comes with the folder).
    let at = |what: &str| steps_run.iter().position(|r| r.contains(what)).unwrap();
    assert!(at("sfx-convert") < at("sfx verify") && at("sfx verify") < at("sfx publish"));
    assert!(
        doc["on"]["push"]["tags"].as_vec().is_some(),
        "runs on a tag"
    );
}

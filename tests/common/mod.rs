//! Paths shared by the CLI-level integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// Runs `cmd`, panics with its stderr unless it succeeds, and returns its stdout.
pub fn stdout_of(cmd: &mut std::process::Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `$SFX_ASSETS`, else the workspace's `assets/` (filled by `make assets`, which `make test`
/// runs first).
pub fn assets() -> PathBuf {
    std::env::var_os("SFX_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("assets"))
}

/// The quickest `sfx-convert` calibration: one 32-token sequence, no held-out text (enough
/// for tests whose codes do not depend on it, and for E[x²] of a weighted rounding).
pub const QUICK_CALIBRATION: [&str; 6] = [
    "--calib-seqs",
    "1",
    "--calib-len",
    "32",
    "--heldout",
    "none",
];

/// The arguments of a quick conversion (calibration [`QUICK_CALIBRATION`]) of the pinned GGUF
/// to `out` with `--quant quant` and `extra` flags.
pub fn quick_args(quant: &str, extra: &[&str], out: &Path) -> Vec<String> {
    let mut args = vec!["--quant".to_string(), quant.to_string()];
    args.extend(extra.iter().map(|e| e.to_string()));
    args.push(gguf().to_string_lossy().into_owned());
    args.push("-o".into());
    args.push(out.to_string_lossy().into_owned());
    args.extend(QUICK_CALIBRATION.map(String::from));
    args
}

/// A quick conversion ([`quick_args`]) of the asset to `name` in the target directory's
/// folder `dir`; its path.
pub fn quick_convert(dir: &str, quant: &str, extra: &[&str], name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(dir);
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join(name);
    stdout_of(
        std::process::Command::new(env!("CARGO_BIN_EXE_sfx-convert"))
            .args(quick_args(quant, extra, &out))
            .env("SFX_ASSETS", assets()),
    );
    out
}

/// The development model; a missing file fails the test with the command that fetches it.
pub fn gguf() -> PathBuf {
    let p = assets().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "{} missing: run `make assets` first",
        p.display()
    );
    p
}

/// A committed fixture from the independent transformers reference (`scripts/golden`). The
/// checkout is `$SFX_REPO` when set (a test binary run from another copy of the tree, e.g.
/// on a GPU machine), else the one the test was built in.
pub fn fixture(name: &str) -> serde_json::Value {
    let root = std::env::var_os("SFX_REPO")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf());
    let p = root.join("tests/fixtures").join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

use sfx_formats::checkpoint::Checkpoint;
use sfx_runtime::refine::Refiner;
use sfx_runtime::{CpuBackend, LogitsMode, Model, ModelOptions, WeightPrecision};
use std::sync::OnceLock;

/// F32 weights: comparisons between models should not carry BF16 rounding.
pub fn f32_options() -> ModelOptions {
    ModelOptions {
        precision: WeightPrecision::F32,
        ..Default::default()
    }
}

/// The float development model (the reference for KL), loaded once per test binary.
pub fn float_model() -> &'static (Checkpoint, Model<CpuBackend>) {
    static M: OnceLock<(Checkpoint, Model<CpuBackend>)> = OnceLock::new();
    M.get_or_init(|| {
        let ckpt = Checkpoint::open(gguf().to_str().unwrap()).unwrap();
        let model = Model::load_cpu(&ckpt.config, &*ckpt.tensors, &f32_options()).unwrap();
        (ckpt, model)
    })
}

/// The first `n` tokens of the wiki text: held out from every calibration (Brown).
pub fn wiki_tokens(n: usize) -> Vec<u32> {
    let (ckpt, _) = float_model();
    wiki_tokens_with(ckpt.tokenizer_json.as_ref().unwrap(), n)
}

/// The first `n` tokens of the wiki text under the tokenizer `json` (a converted file's own,
/// so a test of `.sfx` files needs no source model).
pub fn wiki_tokens_with(json: &str, n: usize) -> Vec<u32> {
    let text = sfx_formats::corpus::wiki_text(&assets()).unwrap();
    let tok = tokenizers::Tokenizer::from_bytes(json.as_bytes()).unwrap();
    tok.encode(&text[..20000], false).unwrap().get_ids()[..n].to_vec()
}

/// All-position logits of `ids` from an empty cache, refined when `refiner` is given.
pub fn logits(
    m: &Model<CpuBackend>,
    ids: &[u32],
    refiner: Option<&mut Refiner<CpuBackend>>,
) -> Vec<f32> {
    let mut cache = m.new_cache(ids.len()).unwrap();
    match refiner {
        Some(r) => m.forward_refined(ids, &mut cache, LogitsMode::All, r),
        None => m.forward(ids, &mut cache, LogitsMode::All),
    }
    .unwrap()
    .into_vec()
}

/// Mean over positions of KL(p ‖ q), in f64 over the full vocabulary.
pub fn mean_kl(p: &[f32], q: &[f32], vocab: usize) -> f64 {
    let log_softmax = |row: &[f32]| -> Vec<f64> {
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let lse = row.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln() + m;
        row.iter().map(|&v| v as f64 - lse).collect()
    };
    let rows = p.len() / vocab;
    (0..rows)
        .map(|r| {
            let lp = log_softmax(&p[r * vocab..(r + 1) * vocab]);
            let lq = log_softmax(&q[r * vocab..(r + 1) * vocab]);
            lp.iter()
                .zip(&lq)
                .map(|(a, b)| a.exp() * (a - b))
                .sum::<f64>()
        })
        .sum::<f64>()
        / rows as f64
}

/// Mean KL to the float model of `sfx-run MODEL EXTRA --ppl wiki:1 --ctx 512`.
pub fn kl_to_float(model: &Path, extra: &[&str]) -> f64 {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sfx-run"))
        .arg(model)
        .args(extra)
        .args(["--ppl", "wiki:1", "--ctx", "512", "--kl-ref"])
        .arg(gguf())
        .arg("--json")
        .env("SFX_ASSETS", assets())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "sfx-run {model:?} {extra:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["kl"]["mean"].as_f64().unwrap()
}

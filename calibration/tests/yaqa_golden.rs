//! YAQA per-sequence gradients G_b = Σ_t g_t x_tᵀ on the real SmolLM2-135M against PyTorch +
//! transformers (fixture `tests/fixtures/yaqa_golden.json`, `scripts/golden/yaqa_golden.py`:
//! 48 wiki tokens, labels sampled from the float model, loss = Σ_t −log p(y_t), G formed in
//! float64 from hooked layer inputs and output gradients).
//!
//! Tolerances: the fixture records how far transformers' own float32 run is from its float64
//! run (the stored reference) — at most 6.4e-5 relative for any vector below and 5e-6 for the
//! loss. Our f32 graph sums in other orders, so we allow 1e-3 (≈ 15× that spread) on every
//! compared quantity and 1e-4 on the loss: a real error (a wrong label, a mis-ordered RoPE
//! half, a missing norm) moves these by O(1), see `wrong_labels_are_detected`.

use serde_json::Value;
use sfx_calibration::yaqa::{sequence_loss_and_gradients, SequenceGradients};
use sfx_formats::checkpoint::Checkpoint;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

const VEC_TOL: f64 = 1e-3;
const LOSS_TOL: f64 = 1e-4;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `$SFX_ASSETS`, else the workspace's `assets/` (as tests/common/mod.rs).
fn gguf_path() -> PathBuf {
    let p = std::env::var_os("SFX_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("assets"))
        .join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "{} missing: run `make assets` first",
        p.display()
    );
    p
}

fn checkpoint() -> &'static Checkpoint {
    static C: OnceLock<Checkpoint> = OnceLock::new();
    C.get_or_init(|| {
        let p = gguf_path();
        Checkpoint::open(p.to_str().expect("utf-8 asset path"))
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    })
}

fn fixture() -> &'static Value {
    static F: OnceLock<Value> = OnceLock::new();
    F.get_or_init(|| {
        let p = workspace().join("tests/fixtures/yaqa_golden.json");
        let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        serde_json::from_str(&text).expect("fixture is valid JSON")
    })
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("integer") as u32)
        .collect()
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number"))
        .collect()
}

fn run(labels: &[u32]) -> SequenceGradients {
    let ckpt = checkpoint();
    let tokens = u32s(&fixture()["tokens"]);
    sequence_loss_and_gradients(&ckpt.config, &*ckpt.tensors, &tokens, labels).expect("gradients")
}

/// ‖a − b‖ / ‖b‖.
fn rel(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let d: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let n: f64 = b.iter().map(|y| y * y).sum();
    (d / n).sqrt()
}

/// Worst relative error over the fixture's statistics of every stored linear.
fn compare(got: &SequenceGradients) -> Vec<(String, &'static str, f64)> {
    let mut errs = Vec::new();
    let linears = fixture()["linears"].as_object().expect("linears");
    for (name, want) in linears {
        let (rows, cols, g) = got
            .gradients
            .get(name)
            .unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(
            (*rows as u64, *cols as u64),
            (
                want["rows"].as_u64().unwrap(),
                want["cols"].as_u64().unwrap()
            ),
            "{name} shape"
        );
        let at = |i: usize, j: usize| g[i * cols + j] as f64;
        let row_norms: Vec<f64> = (0..*rows)
            .map(|i| (0..*cols).map(|j| at(i, j).powi(2)).sum::<f64>().sqrt())
            .collect();
        let col_norms: Vec<f64> = (0..*cols)
            .map(|j| (0..*rows).map(|i| at(i, j).powi(2)).sum::<f64>().sqrt())
            .collect();
        let fro = row_norms.iter().map(|v| v * v).sum::<f64>().sqrt();
        let r = f64s(&want["r"]);
        let g_r: Vec<f64> = (0..*rows)
            .map(|i| (0..*cols).map(|j| at(i, j) * r[j]).sum())
            .collect();
        let want_fro = want["fro"].as_f64().unwrap();
        errs.push((name.clone(), "fro", (fro - want_fro).abs() / want_fro));
        errs.push((
            name.clone(),
            "row_norms",
            rel(&row_norms, &f64s(&want["row_norms"])),
        ));
        errs.push((
            name.clone(),
            "col_norms",
            rel(&col_norms, &f64s(&want["col_norms"])),
        ));
        errs.push((name.clone(), "g_r", rel(&g_r, &f64s(&want["g_r"]))));
    }
    errs
}

#[test]
fn gradients_match_transformers() {
    let f = fixture();
    let labels = u32s(&f["labels"]);
    let got = run(&labels);
    let want_loss = f["loss"].as_f64().unwrap();
    let loss_err = (got.loss - want_loss).abs() / want_loss;
    eprintln!("loss {} vs {want_loss}: rel {loss_err:.2e}", got.loss);
    assert!(loss_err <= LOSS_TOL, "loss {} vs {want_loss}", got.loss);
    assert_eq!(got.gradients.len(), 7 * 30);

    let errs = compare(&got);
    assert_eq!(errs.len(), 4 * 7);
    for (name, what, e) in &errs {
        eprintln!("{name:42} {what:10} rel err {e:.2e}");
    }
    let bad: Vec<_> = errs
        .iter()
        .filter(|e| e.2.is_nan() || e.2 > VEC_TOL)
        .collect();
    assert!(bad.is_empty(), "over {VEC_TOL}: {bad:?}");
}

/// The comparison can fail: the same tokens with the labels shifted by one position give a
/// different loss and different gradients, far outside the tolerances.
#[test]
fn wrong_labels_are_detected() {
    let mut labels = u32s(&fixture()["labels"]);
    labels.rotate_left(1);
    let got = run(&labels);
    let want_loss = fixture()["loss"].as_f64().unwrap();
    assert!((got.loss - want_loss).abs() / want_loss > 100.0 * LOSS_TOL);
    let worst = compare(&got).iter().fold(0f64, |m, e| m.max(e.2));
    assert!(worst > 100.0 * VEC_TOL, "worst {worst}");
}

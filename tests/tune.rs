//! `sfx tune` end to end on the real SmolLM2-135M: a k-ladder file is tuned on this machine,
//! the profile lands in the sidecar, the KL and PPL it records equal an independent
//! `sfx-run --ppl --kl-ref` evaluation of the chosen settings (which runs the float model
//! alongside instead of from kept rows), `sfx-run --budget` applies it, and bad requests
//! are named.

use crate::common::{assets, gguf};
use sfx_formats::sfx::SfxFile;
use sfx_formats::tune::{sidecar_path, TuneFile};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

const SFX: &str = env!("CARGO_BIN_EXE_sfx");
const RUN: &str = env!("CARGO_BIN_EXE_sfx-run");

fn out_dir() -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tune_test");
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn run(bin: &str, args: &[&str]) -> Output {
    Command::new(bin)
        .args(args)
        .env("SFX_ASSETS", assets())
        .env("RAYON_NUM_THREADS", "2")
        .output()
        .unwrap()
}

fn ok(bin: &str, args: &[&str]) -> (String, String) {
    let out = run(bin, args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{bin} {args:?} failed:\n{stderr}");
    (String::from_utf8_lossy(&out.stdout).into_owned(), stderr)
}

/// An rtn4 `--fit` conversion from a little calibration text, plus `extra` flags.
fn convert(name: &str, extra: &[&str]) -> PathBuf {
    let path = out_dir().join(name);
    let g = gguf();
    let mut args = vec!["--quant", "rtn4", "--fit", g.to_str().unwrap()];
    args.extend_from_slice(&["-o", path.to_str().unwrap(), "--calib-seqs", "1"]);
    args.extend_from_slice(&["--heldout", "none"]);
    args.extend_from_slice(extra);
    ok(env!("CARGO_BIN_EXE_sfx-convert"), &args);
    path
}

/// An rtn4 file fitted at k = 8 and 16 (channels).
fn ladder_file() -> &'static PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        convert(
            "rtn4-ladder.sfx",
            &["--k-ladder", "8,16", "--calib-len", "64"],
        )
    })
}

/// The KL text of these tests: one 128-token window of a novel the calibration never saw.
const TEXT: [&str; 6] = [
    "--text",
    "austen/persuasion",
    "--windows",
    "1",
    "--ctx",
    "128",
];

/// `sfx tune MODEL` on the CPU against the GGUF on the test text, lead/lag 0 and 0.5,
/// 32 context tokens, with `budgets`, `timing` (`--tokens`, `--rounds`) and `extra` flags.
fn tune_args(model: &str, budgets: &str, timing: [&str; 2], extra: &[&str]) -> Vec<String> {
    let g = gguf();
    let mut args: Vec<String> = ["tune", model, "--kl-ref", g.to_str().unwrap()]
        .iter()
        .chain(&TEXT)
        .chain(&["--budget", budgets, "--device", "cpu", "--s", "0,0.5"])
        .chain(&[
            "--context",
            "32",
            "--tokens",
            timing[0],
            "--rounds",
            timing[1],
        ])
        .chain(extra)
        .map(|a| a.to_string())
        .collect();
    args.push("--json".into());
    args
}

/// The JSON `sfx tune` prints, and its stderr (the log of every measurement).
fn tune_json(args: &[String]) -> (serde_json::Value, String) {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (stdout, stderr) = ok(SFX, &args);
    (serde_json::from_str(&stdout).unwrap(), stderr)
}

/// Runs `sfx tune` once (short timings: this checks the plumbing, not the machine).
fn tuned() -> &'static serde_json::Value {
    static T: OnceLock<serde_json::Value> = OnceLock::new();
    T.get_or_init(|| {
        let model = ladder_file().to_str().unwrap();
        tune_json(&tune_args(model, "5%,1000%", ["4", "1"], &[])).0
    })
}

fn eval_json(extra: &[&str]) -> (serde_json::Value, String) {
    let model = ladder_file().to_str().unwrap();
    let g = gguf();
    let mut args = vec![
        model,
        "--ppl",
        "austen/persuasion:1",
        "--ctx",
        "128",
        "--kl-ref",
        g.to_str().unwrap(),
        "--no-base",
        "--json",
        "--device",
        "cpu",
    ];
    args.extend_from_slice(extra);
    let (stdout, stderr) = ok(RUN, &args);
    (serde_json::from_str(&stdout).unwrap(), stderr)
}

#[test]
fn tuned_profiles_record_what_an_independent_evaluation_measures() {
    let t = tuned();
    let path = ladder_file();
    let file = SfxFile::open(path).unwrap();
    let sidecar = TuneFile::read(&sidecar_path(path), &file.content_digest())
        .unwrap()
        .expect("sidecar written");
    assert_eq!(t["ladder"], serde_json::json!([8, 16]));
    let entry = &sidecar.machines[0];
    assert_eq!(entry.machine.device, "cpu");
    assert_eq!(entry.profiles.len(), 2);
    assert_eq!(entry.scored_tokens, 127);
    // A budget of 1000 % admits the largest rung everywhere (with whichever lead/lag scores
    // the lowest KL).
    let loose = entry.budget(10.0).unwrap();
    assert_eq!(loose.k, [16; 4]);
    for p in entry.profiles.iter().filter(|p| p.k != [0; 4]) {
        let (k, s) = p.k_and_s();
        let (v, _) = eval_json(&["--k", &k, "--s", &s, "--mlp", &p.mlp, "--no-tune"]);
        let kl = v["kl"]["mean"].as_f64().unwrap();
        let ppl = v["ppl"].as_f64().unwrap();
        let tuned_kl = p.kl.expect("a chosen configuration records its KL");
        let tuned_ppl = p.ppl.expect("a chosen configuration records its PPL");
        assert!(
            (kl - tuned_kl).abs() < 1e-9,
            "budget {}: KL {kl} vs tuned {tuned_kl}",
            p.budget
        );
        assert!(
            (ppl - tuned_ppl).abs() < 1e-6 * ppl,
            "PPL {ppl} vs {tuned_ppl}"
        );
    }
}

#[test]
fn sfx_run_applies_the_profile_and_names_bad_budgets() {
    tuned();
    let loose = {
        let file = SfxFile::open(ladder_file()).unwrap();
        let t = TuneFile::read(&sidecar_path(ladder_file()), &file.content_digest())
            .unwrap()
            .unwrap();
        t.machines[0].budget(10.0).unwrap().clone()
    };
    let (v, stderr) = eval_json(&["--budget", "1000%"]);
    assert!(
        stderr.contains("tuning profile: 1000.0 % budget"),
        "{stderr}"
    );
    assert_eq!(v["refine"]["settings"]["k"], serde_json::json!(loose.k));
    // An explicit --k overrides the profile's.
    let (v, _) = eval_json(&["--budget", "1000%", "--k", "8"]);
    assert_eq!(
        v["refine"]["settings"]["k"],
        serde_json::json!([8, 8, 8, 8])
    );

    let model = ladder_file().to_str().unwrap();
    let bad = run(
        RUN,
        &[
            model, "--budget", "7%", "-p", "Hi", "-n", "1", "--device", "cpu",
        ],
    );
    let e = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success());
    assert!(
        e.contains("--budget 7.0%: not tuned") && e.contains("1000%"),
        "{e}"
    );

    let (text, _) = ok(SFX, &["inspect", model]);
    assert!(text.contains("tuning profile (sfx tune)"), "{text}");
    assert!(text.contains("k    8  ram"), "{text}");
}

#[test]
fn a_profile_of_another_file_or_no_reference_is_refused() {
    tuned();
    // The ladder file's profile beside another container (a copy of the convert tests'
    // fitted k = 8 file): its digest does not match.
    let other = out_dir().join("other.sfx");
    std::fs::copy(crate::convert::rtn4_fit_k8_path(), &other).unwrap();
    std::fs::copy(sidecar_path(ladder_file()), sidecar_path(&other)).unwrap();
    let o = other.to_str().unwrap();
    let bad = run(
        RUN,
        &[
            o, "--budget", "5%", "-p", "Hi", "-n", "1", "--device", "cpu",
        ],
    );
    let e = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && e.contains("model_digest"), "{e}");
    // Without --budget the unusable profile is skipped with a warning.
    let (_, e) = ok(RUN, &[o, "-p", "Hi", "-n", "1", "--device", "cpu"]);
    assert!(e.contains("warning: tuning profile ignored"), "{e}");

    let bad = run(SFX, &["tune", o, "--device", "cpu"]);
    let e = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && e.contains("--kl-ref"), "{e}");
    assert!(!e.contains("panicked"), "{e}");
    std::fs::remove_file(&other).unwrap();
    std::fs::remove_file(sidecar_path(&other)).unwrap();
}

/// `sfx-run --k-sweep` scores the base and every budget against one kept reference pass;
/// each row equals a single `--k` run that scores the float model alongside.
#[test]
fn k_sweep_rows_equal_single_runs() {
    let (v, _) = eval_json(&["--k-sweep", "8,16", "--no-tune"]);
    let runs = v["runs"].as_array().unwrap();
    let ks: Vec<_> = runs.iter().map(|r| r["k"].clone()).collect();
    assert_eq!(ks, [serde_json::json!(8), serde_json::json!(16)]);
    for r in runs {
        let k = r["k"].as_u64().unwrap().to_string();
        let (single, _) = eval_json(&["--k", &k, "--no-tune"]);
        let (a, b) = (
            r["kl"]["mean"].as_f64().unwrap(),
            single["kl"]["mean"].as_f64().unwrap(),
        );
        assert!((a - b).abs() < 1e-9, "k = {k}: sweep KL {a} vs single {b}");
        let (a, b) = (r["ppl"].as_f64().unwrap(), single["ppl"].as_f64().unwrap());
        assert!(
            (a - b).abs() < 1e-6 * b,
            "k = {k}: sweep PPL {a} vs single {b}"
        );
    }
    let bad = run(
        RUN,
        &[
            ladder_file().to_str().unwrap(),
            "--ppl",
            "wiki:1",
            "--k-sweep",
            "8,x",
        ],
    );
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        !bad.status.success() && stderr.contains("--k-sweep \"8,x\""),
        "{stderr}"
    );
}

/// `--speed-model` times the candidates on a synthetic model in the file's formats: the
/// profile names it, its KL is still the file's (the same as the file's own profile for the
/// same k), it sits beside the file's own profile, and sfx-run never applies it.
#[test]
fn a_profile_timed_on_a_synthetic_model_is_listed_not_applied() {
    let t = tuned();
    let copy = out_dir().join("ladder-speed-model.sfx");
    std::fs::copy(ladder_file(), &copy).unwrap();
    let model = copy.to_str().unwrap();
    let (v, log) = tune_json(&tune_args(
        model,
        "1000%",
        ["8", "3"],
        &["--speed-model", "tiny"],
    ));
    // With --json the measurements are still logged, on stderr.
    assert!(
        log.contains("speed model tiny (synthetic") && log.contains("slowdown"),
        "{log}"
    );
    let label = v["result"]["speed_model"].as_str().unwrap();
    // The ladder file is rtn4 with the converter's default q8 head.
    assert_eq!(label, "tiny (synthetic, 4-bit g128, 8-bit g128 head)");
    let own = t["result"]["profiles"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["budget"] == 10.0)
        .unwrap();
    let proxied = &v["result"]["profiles"][0];
    // 1000 %: every candidate fits on either model, so both keep the file's lowest KL.
    for field in ["k", "s", "kl"] {
        assert_eq!(proxied[field], own[field], "{field}");
    }
    // Alone in the sidecar, the entry is not applied.
    let bad = run(
        RUN,
        &[
            model, "--budget", "1000%", "-p", "Hi", "-n", "1", "--device", "cpu",
        ],
    );
    let e = String::from_utf8_lossy(&bad.stderr);
    assert!(
        !bad.status.success() && e.contains("--budget") && e.contains("never applied"),
        "{e}"
    );
    let (text, _) = ok(SFX, &["inspect", model]);
    assert!(text.contains("speed measured on tiny (synthetic"), "{text}");
    // A file with bundles: the stand-in has channel columns only, so bundles are refused.
    let both = crate::convert::rtn4_fit_k8_path().to_str().unwrap();
    let g = gguf();
    let g = g.to_str().unwrap();
    let refused = run(
        SFX,
        &[
            "tune",
            both,
            "--kl-ref",
            g,
            "--speed-model",
            "tiny",
            "--mlp",
            "bundles",
        ],
    );
    let e = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && e.contains("channel columns only"),
        "{e}"
    );
    let unknown = run(
        SFX,
        &["tune", both, "--kl-ref", g, "--speed-model", "gpt-9"],
    );
    let e = String::from_utf8_lossy(&unknown.stderr);
    assert!(
        !unknown.status.success()
            && e.contains("--speed-model \"gpt-9\"")
            && e.contains("llama-3.1-8b")
            && !e.contains("float reference"),
        "{e}"
    );
}

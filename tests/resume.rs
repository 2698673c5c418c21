//! Resumable conversions on the real SmolLM2-135M. An output folder's conversion, interrupted
//! at three points in a row (an abort right after the first block's checkpoint; a `kill -9` in
//! the middle of a block of the resumed run; an abort after the last block's checkpoint with
//! a torn tail written past it), continues with `--resume` each time and ends byte-identical,
//! every file, to an uninterrupted conversion. A single-file conversion's resume is refused
//! with other options, over a damaged partial file and with nothing to resume, each with a
//! message naming why; a fresh run does not clobber it; it then resumes to the uninterrupted
//! container's bytes.

use crate::common::{assets, gguf};
use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

fn out_dir() -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("resume_test");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The partial-state folder of `out`.
fn partial(out: &Path) -> PathBuf {
    out.with_file_name(format!(
        ".{}.resume",
        out.file_name().unwrap().to_string_lossy()
    ))
}

/// Removes `out` and its partial state, left by an earlier run of the tests.
fn fresh(out: &Path) {
    let _ = std::fs::remove_file(out);
    let _ = std::fs::remove_dir_all(out);
    let _ = std::fs::remove_dir_all(partial(out));
}

/// The conversion of these tests, cheap but carrying every kind of cross-block state: AWQ
/// (its α per layer goes from the checkpointed reports into the metadata) with fitted
/// refinement, a q8 head (weighted by the final calibration streams), two calibration and one
/// held-out window of 32 tokens, through all 30 blocks; no quality receipt (it costs time and
/// carries no cross-block state; tests/determinism.rs checks that it is reproducible).
fn args(out: &Path, extra: &[&str]) -> Vec<String> {
    let g = gguf();
    let mut a: Vec<String> = [
        "--quant",
        "awq3",
        "--awq-grid",
        "2,1",
        "--fit",
        g.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--calib-seqs",
        "2",
        "--calib-len",
        "32",
        "--heldout",
        "wiki",
        "--heldout-seqs",
        "1",
        "--quality",
        "none",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// Runs in `out_dir()/cwd`: the folder's manifest records the command line, so the reference
/// and the interrupted folder are both written as `-o folder`, from different directories.
fn converter_in(cwd: &str, args: &[String], abort_after: Option<usize>) -> Command {
    let dir = out_dir().join(cwd);
    std::fs::create_dir_all(&dir).unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_sfx-convert"));
    c.current_dir(dir)
        .args(args)
        .env("SFX_ASSETS", assets())
        .env("RAYON_NUM_THREADS", "2");
    if let Some(n) = abort_after {
        c.env("SFX_CONVERT_ABORT_AFTER_BLOCK", n.to_string());
    }
    c
}

fn run_in(cwd: &str, args: &[String], abort_after: Option<usize>) -> Output {
    converter_in(cwd, args, abort_after).output().unwrap()
}

fn succeeds_in(cwd: &str, args: &[String]) -> String {
    let out = run_in(cwd, args, None);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{args:?} failed:\n{stderr}");
    stderr
}

/// Runs with the abort hook at block `n` and checks that it died there, leaving a
/// checkpoint of `n` blocks and no output (`out` as seen from here).
fn aborted_after(cwd: &str, args: &[String], out: &Path, n: usize) {
    let o = run_in(cwd, args, Some(n));
    assert_eq!(
        o.status.signal(),
        Some(6),
        "expected SIGABRT after block {n}:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(blocks_done(out), n);
    assert!(!out.exists());
}

fn checkpoint(out: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(partial(out).join("checkpoint.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn blocks_done(out: &Path) -> usize {
    checkpoint(out)["converter"]["blocks_done"]
        .as_u64()
        .unwrap() as usize
}

/// Fails with a message containing every one of `needles`, without a panic.
fn refused(args: &[String], needles: &[&str]) {
    let o = run_in(".", args, None);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{args:?} succeeded");
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    for n in needles {
        assert!(stderr.contains(n), "{args:?}: no {n:?} in:\n{stderr}");
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// Every file of a folder, by name.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

/// The uninterrupted conversion's folder: its files.
fn reference() -> &'static Vec<(String, Vec<u8>)> {
    static R: OnceLock<Vec<(String, Vec<u8>)>> = OnceLock::new();
    R.get_or_init(|| {
        let out = out_dir().join("straight/folder");
        fresh(&out);
        succeeds_in("straight", &args(Path::new("folder"), &[]));
        assert!(!partial(&out).exists(), "a finished run keeps no state");
        let f = files(&out);
        assert!(f.iter().any(|(n, _)| n == "manifest.json"), "{:?}", f.len());
        f
    })
}

fn reference_container() -> &'static [u8] {
    let (_, bytes) = reference()
        .iter()
        .find(|(n, _)| n == "model.sfx")
        .expect("model.sfx in the folder");
    bytes
}

#[test]
fn folder_conversion_interrupted_three_times_resumes_to_the_same_files() {
    let expected = reference();
    let cwd = "interrupted";
    let out = out_dir().join(cwd).join("folder");
    fresh(&out);
    let first = args(Path::new("folder"), &[]);
    let resume = args(Path::new("folder"), &["--resume"]);

    // 1. Abort right after the first block's checkpoint.
    aborted_after(cwd, &first, &out, 1);

    // 2. The resumed run: kill -9 in the middle of the block after the progress reports
    //    block 12 (reported once its checkpoint is recorded).
    let mut child = converter_in(cwd, &resume, None)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The reader stays open until the kill: a closed pipe would end the converter first.
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        let n = stderr.read_line(&mut line).unwrap();
        seen += &line;
        assert!(n > 0, "no progress line for block 12:\n{seen}");
        if line.starts_with("layer  12/30") {
            break;
        }
    }
    assert!(seen.contains("resuming folder after block 1/30"), "{seen}");
    std::thread::sleep(std::time::Duration::from_millis(300));
    child.kill().unwrap();
    assert_eq!(child.wait().unwrap().signal(), Some(9));
    drop(stderr);
    let done = blocks_done(&out);
    assert!((12..30).contains(&done), "checkpoint after {done} blocks");
    assert!(!out.exists());

    // 3. The next resumed run aborts after the last block's checkpoint; the head's sections
    //    were half written past it (bytes after the checkpoint's length are cut off).
    aborted_after(cwd, &resume, &out, 30);
    let part = partial(&out).join("model.sfx.part");
    let mut bytes = std::fs::read(&part).unwrap();
    assert_eq!(
        bytes.len() as u64,
        checkpoint(&out)["writer"]["len"].as_u64().unwrap()
    );
    bytes.extend(std::iter::repeat_n(0xA5, 10_000));
    std::fs::write(&part, &bytes).unwrap();

    let stderr = succeeds_in(cwd, &resume);
    assert!(
        stderr.contains("resuming folder after block 30/30"),
        "{stderr}"
    );
    let got = files(&out);
    assert_eq!(
        got.iter().map(|(n, _)| n).collect::<Vec<_>>(),
        expected.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
    for ((name, a), (_, b)) in got.iter().zip(expected) {
        assert!(a == b, "{name} differs from the uninterrupted folder's");
    }
    assert!(!partial(&out).exists(), "a finished run keeps no state");
}

#[test]
fn resume_refuses_other_options_missing_state_and_a_damaged_partial_file() {
    let out = out_dir().join("refusals.sfx");
    fresh(&out);
    aborted_after(".", &args(&out, &[]), &out, 1);
    let state = partial(&out);
    let before = std::fs::read(state.join("checkpoint.json")).unwrap();

    refused(
        &args(&out, &["--resume", "--k", "32"]),
        &[
            "other inputs or options",
            "--k: checkpoint 16,16,16,16, now 32,32,32,32",
            "remove",
        ],
    );
    refused(
        &args(
            &out,
            &["--resume", "--calib", "austen/persuasion", "--mlp", "both"],
        ),
        &[
            "--calib: checkpoint brown, now austen/persuasion",
            "calibration tokens: checkpoint ",
            "--mlp: checkpoint channels, now both",
        ],
    );
    // A fresh run does not start over a partial conversion.
    refused(
        &args(&out, &[]),
        &[
            "finished 1 of 30 blocks",
            "pass --resume",
            ".refusals.sfx.resume",
        ],
    );
    assert_eq!(
        std::fs::read(state.join("checkpoint.json")).unwrap(),
        before,
        "a refused run changed the checkpoint"
    );

    // A partial file that is not what its checkpoint describes.
    let part = state.join("model.sfx.part");
    let good = std::fs::read(&part).unwrap();
    let mut bad = good.clone();
    bad[good.len() - 100] ^= 1;
    std::fs::write(&part, &bad).unwrap();
    refused(&args(&out, &["--resume"]), &["model.sfx.part", "checksum"]);
    std::fs::write(&part, &good).unwrap();

    // Nothing to resume: named, and nothing left behind.
    let never = out_dir().join("never-started.sfx");
    fresh(&never);
    refused(
        &args(&never, &["--resume"]),
        &["no interrupted conversion", "checkpoint.json"],
    );
    assert!(!partial(&never).exists() && !never.exists());

    // Left alone, the partial conversion still resumes to the uninterrupted container.
    succeeds_in(".", &args(&out, &["--resume"]));
    assert!(std::fs::read(&out).unwrap() == reference_container());
    assert!(!partial(&out).exists());
}

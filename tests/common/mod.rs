//! Paths shared by the CLI-level integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// `$SFX_ASSETS`, else the workspace's `assets/` (filled by `make assets`, which `make test`
/// runs first).
pub fn assets() -> PathBuf {
    std::env::var_os("SFX_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("assets"))
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

/// A committed fixture from the independent transformers reference (`scripts/golden`).
pub fn fixture(name: &str) -> serde_json::Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

//! Where the integration tests find the real model: `$SFX_ASSETS`, else the workspace's
//! `assets/` (filled by `scripts/fetch_assets.sh`, which `make test` runs first). Shared by
//! several test crates through `#[path]`; each uses part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub fn smollm2_gguf() -> PathBuf {
    asset("SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// A file of the asset cache, by its path inside it.
pub fn asset(relative: &str) -> PathBuf {
    let dir = std::env::var_os("SFX_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets"));
    let p = dir.join(relative);
    assert!(
        p.is_file(),
        "{} is missing: run scripts/fetch_assets.sh (make test does)",
        p.display()
    );
    p
}

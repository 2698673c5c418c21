//! Where the integration tests find the real model: `$SFX_ASSETS`, else the workspace's
//! `assets/` (filled by `scripts/fetch_assets.sh`, which `make test` runs first).

use std::path::{Path, PathBuf};

pub fn smollm2_gguf() -> PathBuf {
    let dir = std::env::var_os("SFX_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets"));
    let p = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "{} is missing: run scripts/fetch_assets.sh (make test does)",
        p.display()
    );
    p
}

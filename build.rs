//! Records the source revision (`git describe --always --dirty`) for the output folder's
//! manifest; a build outside a checkout records none.
use std::process::Command;

fn main() {
    for f in [".git/HEAD", ".git/index"] {
        if std::path::Path::new(f).exists() {
            println!("cargo:rerun-if-changed={f}");
        }
    }
    let described = Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=12"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty());
    if let Some(rev) = described {
        println!("cargo:rustc-env=SFX_GIT_REVISION={rev}");
    }
}

//! Checks our canonical texts against the independent Python reference in
//! `tests/fixtures/canonical_texts.json` (`{name: {chars, bytes, sha256}}`): the texts feed
//! every perplexity number, so they must agree byte for byte with other tools.

use std::path::{Path, PathBuf};

use serde_json::Value;
use sfx_formats::corpus::{self, AUSTEN_NOVELS};
use sha2::{Digest, Sha256};

fn fixture_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("tests")
        .join("fixtures")
        .join("canonical_texts.json")
}

/// Maps a fixture name to our loader name; the reference may name novels bare (`emma`) or
/// with their source prefix (`austen/emma`).
fn source_name(name: &str) -> Option<String> {
    match name {
        "wiki" | "brown" => Some(name.to_string()),
        n if AUSTEN_NOVELS.contains(&n) => Some(format!("austen/{n}")),
        n if n
            .strip_prefix("austen/")
            .is_some_and(|novel| AUSTEN_NOVELS.contains(&novel)) =>
        {
            Some(n.to_string())
        }
        _ => None,
    }
}

#[test]
fn corpus_canonical_texts_match_reference() {
    let path = fixture_path();
    let raw = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let assets = corpus::assets_dir();
    assert!(
        assets.join("wiki").is_dir() && assets.join("austen").is_dir(),
        "assets not found at {}: run scripts/fetch_assets.sh (make test does)",
        assets.display()
    );
    let fixture: serde_json::Map<String, Value> =
        serde_json::from_slice(&raw).expect("fixture is a JSON object");

    let mut checked = Vec::new();
    let mut failures = Vec::new();
    for (name, expected) in &fixture {
        // Only {chars, bytes, sha256} records are texts; anything else is metadata.
        let Some(want_sha) = expected.get("sha256").and_then(Value::as_str) else {
            continue;
        };
        let source =
            source_name(name).unwrap_or_else(|| panic!("fixture names an unknown text `{name}`"));
        let text = corpus::load_named_text(&assets, &source)
            .unwrap_or_else(|e| panic!("loading {source}: {e}"));
        let got_sha = format!("{:x}", Sha256::digest(text.as_bytes()));
        let got_bytes = text.len() as u64;
        let got_chars = text.chars().count() as u64;
        eprintln!("{source}: {got_chars} chars, {got_bytes} bytes, sha256 {got_sha}");
        if let Some(want) = expected.get("bytes").and_then(Value::as_u64) {
            if want != got_bytes {
                failures.push(format!("{name}: {got_bytes} bytes, reference {want}"));
            }
        }
        if let Some(want) = expected.get("chars").and_then(Value::as_u64) {
            if want != got_chars {
                failures.push(format!("{name}: {got_chars} chars, reference {want}"));
            }
        }
        if !want_sha.eq_ignore_ascii_case(&got_sha) {
            failures.push(format!("{name}: sha256 {got_sha}, reference {want_sha}"));
        }
        checked.push(source);
    }
    assert!(failures.is_empty(), "mismatches:\n{}", failures.join("\n"));

    // The reference must cover every evaluation text, or a renamed key would silently
    // shrink this test to nothing.
    let mut required = vec!["wiki".to_string()];
    required.extend(AUSTEN_NOVELS.iter().map(|n| format!("austen/{n}")));
    for name in required {
        assert!(checked.contains(&name), "reference fixture lacks `{name}`");
    }
}

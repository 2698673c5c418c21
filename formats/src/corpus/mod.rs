//! The canonical evaluation and calibration texts (`sfx text` prints them).
//!
//! Every text is produced byte-for-byte by a fixed rule, so perplexities computed here
//! compare with those of other tools that follow the same rules:
//! - [`wiki_text`]: Wikipedia "Vital Articles" lead sections.
//! - [`austen_text`]: one of Jane Austen's six novels, from the `janeaustenr` R package.
//! - [`brown_text`]: the Brown corpus, untagged and detokenized (calibration only).
//! - [`load_named_text`] / [`TextSource`]: the names the CLIs accept (`wiki`,
//!   `austen/<novel>`, `brown`, or a file path).

pub mod brown;
pub mod rdata;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use thiserror::Error;

pub use rdata::RDataError;

/// The six novels of the `janeaustenr` database, by their object names there.
pub const AUSTEN_NOVELS: [&str; 6] = [
    "emma",
    "mansfieldpark",
    "prideprejudice",
    "sensesensibility",
    "persuasion",
    "northangerabbey",
];

/// Errors from loading corpus texts.
#[derive(Debug, Error)]
pub enum CorpusError {
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("parsing {path}: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: {source}")]
    RData {
        path: PathBuf,
        #[source]
        source: RDataError,
    },
    #[error("{path}: {msg}")]
    Format { path: PathBuf, msg: String },
    #[error("unknown Austen novel `{name}`; valid names: {}", AUSTEN_NOVELS.join(", "))]
    UnknownNovel { name: String },
    #[error("no Brown corpus documents (files named c[a-r][0-9][0-9]) in {0}")]
    NoBrownDocuments(PathBuf),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CorpusError + '_ {
    move |source| CorpusError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn read_utf8(path: &Path) -> Result<String, CorpusError> {
    let bytes = std::fs::read(path).map_err(io_err(path))?;
    String::from_utf8(bytes).map_err(|e| CorpusError::Format {
        path: path.to_path_buf(),
        msg: format!("not valid UTF-8 ({e})"),
    })
}

/// Where the downloaded assets live, first match wins:
/// 1. the `SFX_ASSETS` environment variable, if set and non-empty (used as given);
/// 2. `./assets`, relative to the current directory, if it is a directory;
/// 3. `assets/` in this crate's source directory or its parent (the workspace root), as
///    known at compile time, if it exists — so `cargo test` and `cargo run` from anywhere
///    inside a checkout find the workspace's assets;
/// 4. otherwise `./assets`, so that error messages name the conventional place.
///
/// The result is not checked further; loaders report missing files themselves.
pub fn assets_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("SFX_ASSETS").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let local = PathBuf::from("assets");
    if local.is_dir() {
        return local;
    }
    // Only the crate dir and the workspace root: walking further up could pick up an
    // unrelated `assets` directory.
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .take(2)
        .map(|dir| dir.join("assets"))
        .find(|p| p.is_dir())
        .unwrap_or(local)
}

/// Python's `str.isspace()`: Unicode `White_Space` plus U+001C..U+001F (which Python
/// counts as whitespace through their bidi class and Rust's `char::is_whitespace` does
/// not). Spelled out so the canonical text cannot drift with either language's tables.
fn is_python_space(c: char) -> bool {
    matches!(
        c,
        '\u{9}'..='\u{d}'
            | '\u{1c}'..='\u{20}'
            | '\u{85}'
            | '\u{a0}'
            | '\u{1680}'
            | '\u{2000}'..='\u{200a}'
            | '\u{2028}'
            | '\u{2029}'
            | '\u{202f}'
            | '\u{205f}'
            | '\u{3000}'
    )
}

/// Python's `str.strip()` with no arguments.
fn python_strip(s: &str) -> &str {
    s.trim_matches(is_python_space)
}

#[derive(Deserialize)]
struct WikiEntry {
    extract: String,
}

/// Builds the wiki text from the JSON object's contents; see [`wiki_text`].
pub fn wiki_text_from_json(json: &[u8]) -> Result<String, serde_json::Error> {
    // BTreeMap<String, _> orders keys bytewise, which for UTF-8 is code point order —
    // the same as Python's `sorted()` on str. A repeated key keeps its last value, as
    // Python's json module does.
    let entries: BTreeMap<String, WikiEntry> = serde_json::from_slice(json)?;
    let mut out = String::with_capacity(json.len());
    for (i, entry) in entries.values().enumerate() {
        if i > 0 {
            out.push_str("\n\n");
        }
        out.push_str(python_strip(&entry.extract));
    }
    out.push('\n');
    Ok(out)
}

/// The canonical `wiki` text: entries of `wiki/summaries_en-us.json` sorted by key in
/// code point order, each entry's `extract` with surrounding whitespace stripped (Python
/// `str.strip()` semantics), joined with `"\n\n"`, plus a final `"\n"`.
pub fn wiki_text(assets: &Path) -> Result<String, CorpusError> {
    let path = assets.join("wiki").join("summaries_en-us.json");
    let bytes = std::fs::read(&path).map_err(io_err(&path))?;
    wiki_text_from_json(&bytes).map_err(|source| CorpusError::Json { path, source })
}

/// Opens the `janeaustenr` lazy-load database (`austen/Rdata.rdx` + `.rdb`).
pub fn austen_db(assets: &Path) -> Result<rdata::LazyLoadDb, CorpusError> {
    let stem = assets.join("austen").join("Rdata");
    rdata::LazyLoadDb::open(&stem).map_err(|source| CorpusError::RData {
        path: stem.with_extension("rdx"),
        source,
    })
}

/// The canonical `austen/<novel>` text: the novel's lines joined with `"\n"` (NA lines
/// become empty lines), plus a final `"\n"`. `novel` is one of [`AUSTEN_NOVELS`], which
/// are also the object names in the database.
pub fn austen_text(assets: &Path, novel: &str) -> Result<String, CorpusError> {
    if !AUSTEN_NOVELS.contains(&novel) {
        return Err(CorpusError::UnknownNovel {
            name: novel.to_string(),
        });
    }
    let db = austen_db(assets)?;
    let lines = db.get_strings(novel).map_err(|source| CorpusError::RData {
        path: assets.join("austen").join("Rdata.rdb"),
        source,
    })?;
    let mut out = String::new();
    for (i, line) in lines.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        out.push_str(line.as_deref().unwrap_or(""));
    }
    out.push('\n');
    Ok(out)
}

/// The canonical `brown` text (calibration only): the files `brown/c[a-r][0-9][0-9]` in
/// name order, untagged and detokenized by the rules in [`brown`]: one line per paragraph,
/// documents separated by a blank line, final `"\n"`.
pub fn brown_text(assets: &Path) -> Result<String, CorpusError> {
    let dir = assets.join("brown");
    let mut files: Vec<(String, PathBuf)> = Vec::new();
    for entry in std::fs::read_dir(&dir).map_err(io_err(&dir))? {
        let entry = entry.map_err(io_err(&dir))?;
        let name = entry.file_name();
        if let Some(name) = name.to_str().filter(|n| brown::is_document_name(n)) {
            files.push((name.to_string(), entry.path()));
        }
    }
    if files.is_empty() {
        return Err(CorpusError::NoBrownDocuments(dir));
    }
    files.sort();
    let mut docs = Vec::with_capacity(files.len());
    for (_, path) in &files {
        let doc = brown::document_text(&read_utf8(path)?);
        if !doc.is_empty() {
            docs.push(doc);
        }
    }
    let mut out = docs.join("\n\n");
    out.push('\n');
    Ok(out)
}

/// A named text, as accepted by `--ppl <name>:N` and `--calib <name>` (the `:N` suffix is
/// the caller's business).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TextSource {
    /// `wiki`: [`wiki_text`].
    Wiki,
    /// `austen/<novel>`: [`austen_text`].
    Austen(String),
    /// `brown`: [`brown_text`].
    Brown,
    /// Any other name is a file path (relative to the current directory, not to the
    /// assets). `*.jsonl`: one JSON object per non-blank line with a string field `text`;
    /// the texts are joined with `"\n\n"` plus a final `"\n"` (like `wiki`). Anything
    /// else: UTF-8 plain text, used verbatim except for a leading byte-order mark.
    File(PathBuf),
}

impl TextSource {
    /// Resolves a name. The names `wiki` and `brown` and the prefix `austen/` always mean
    /// the built-in texts; a file with such a name is reachable as `./wiki` etc.
    pub fn parse(name: &str) -> Result<Self, CorpusError> {
        Ok(match name {
            "wiki" => TextSource::Wiki,
            "brown" => TextSource::Brown,
            _ => match name.strip_prefix("austen/") {
                Some(novel) if AUSTEN_NOVELS.contains(&novel) => {
                    TextSource::Austen(novel.to_string())
                }
                Some(novel) => {
                    return Err(CorpusError::UnknownNovel {
                        name: novel.to_string(),
                    })
                }
                None => TextSource::File(PathBuf::from(name)),
            },
        })
    }

    /// Loads the text; `assets` is only consulted for the built-in texts.
    pub fn load(&self, assets: &Path) -> Result<String, CorpusError> {
        match self {
            TextSource::Wiki => wiki_text(assets),
            TextSource::Austen(novel) => austen_text(assets, novel),
            TextSource::Brown => brown_text(assets),
            TextSource::File(path) => load_file_text(path),
        }
    }
}

impl fmt::Display for TextSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TextSource::Wiki => f.write_str("wiki"),
            TextSource::Austen(novel) => write!(f, "austen/{novel}"),
            TextSource::Brown => f.write_str("brown"),
            TextSource::File(path) => write!(f, "{}", path.display()),
        }
    }
}

/// `TextSource::parse(name)?.load(assets)`.
pub fn load_named_text(assets: &Path, name: &str) -> Result<String, CorpusError> {
    TextSource::parse(name)?.load(assets)
}

/// A user-supplied text file; see [`TextSource::File`] for the rules.
pub fn load_file_text(path: &Path) -> Result<String, CorpusError> {
    let text = read_utf8(path)?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let is_jsonl = path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("jsonl"));
    if !is_jsonl {
        return Ok(text.to_string());
    }
    #[derive(Deserialize)]
    struct Line {
        text: String,
    }
    let mut docs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let parsed: Line = serde_json::from_str(line).map_err(|e| CorpusError::Format {
            path: path.to_path_buf(),
            msg: format!(
                "line {}: expected an object with a string `text` ({e})",
                i + 1
            ),
        })?;
        docs.push(parsed.text);
    }
    let mut out = docs.join("\n\n");
    out.push('\n');
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The real assets (`make test` fetches them first; missing assets fail the test).
    fn real_assets() -> PathBuf {
        let dir = assets_dir();
        assert!(
            dir.join("wiki").is_dir() && dir.join("austen").is_dir() && dir.join("brown").is_dir(),
            "assets not found at {}: run scripts/fetch_assets.sh",
            dir.display()
        );
        dir
    }

    fn stats(name: &str, text: &str) {
        eprintln!(
            "{name}: {} chars, {} bytes, {} words",
            text.chars().count(),
            text.len(),
            text.split_whitespace().count()
        );
    }

    #[test]
    fn python_strip_matches_python() {
        assert_eq!(python_strip(" \t\n x y \r\n"), "x y");
        assert_eq!(python_strip("\u{a0}\u{3000}x\u{2029}\u{85}"), "x");
        // Python strips these information separators; Rust's trim() would not.
        assert_eq!(python_strip("\u{1c}\u{1f}x\u{1e}"), "x");
        // Zero-width space and BOM are not whitespace to Python.
        assert_eq!(python_strip("\u{200b}x\u{feff}"), "\u{200b}x\u{feff}");
    }

    #[test]
    fn wiki_sorts_by_code_point_and_strips() {
        let json = r#"{
            "b": {"title": "b", "extract": "  second\n"},
            "B": {"title": "B", "extract": "upper"},
            "é": {"title": "é", "extract": "\u00a0accent "},
            "a": {"title": "a", "extract": "first", "topic": "x"},
            "10": {"extract": "digits"}
        }"#;
        let text = wiki_text_from_json(json.as_bytes()).expect("valid json");
        assert_eq!(text, "digits\n\nupper\n\nfirst\n\nsecond\n\naccent\n");
        assert!(wiki_text_from_json(br#"{"a": {"title": "no extract"}}"#).is_err());
    }

    #[test]
    fn source_names_resolve() {
        assert_eq!(TextSource::parse("wiki").ok(), Some(TextSource::Wiki));
        assert_eq!(TextSource::parse("brown").ok(), Some(TextSource::Brown));
        assert_eq!(
            TextSource::parse("austen/emma").ok(),
            Some(TextSource::Austen("emma".into()))
        );
        assert_eq!(
            TextSource::parse("./wiki").ok(),
            Some(TextSource::File("./wiki".into()))
        );
        let err = TextSource::parse("austen/ulysses").expect_err("unknown novel");
        let msg = err.to_string();
        assert!(
            msg.contains("ulysses") && msg.contains("northangerabbey"),
            "{msg}"
        );
        let err = austen_text(Path::new("/nonexistent"), "Emma").expect_err("case matters");
        assert!(matches!(err, CorpusError::UnknownNovel { .. }));
        for name in ["wiki", "brown", "austen/persuasion", "some/file.txt"] {
            let src = TextSource::parse(name).expect("parses");
            assert_eq!(src.to_string(), name);
        }
    }

    #[test]
    fn file_sources() {
        let dir = tempfile::tempdir().expect("tempdir");
        let plain = dir.path().join("a.txt");
        std::fs::write(&plain, "\u{feff}Hello\nworld").expect("write");
        let name = plain.to_str().expect("utf-8 temp path");
        assert_eq!(
            load_named_text(Path::new("/nonexistent"), name).expect("plain"),
            "Hello\nworld"
        );
        let jsonl = dir.path().join("b.jsonl");
        std::fs::write(
            &jsonl,
            "{\"text\": \"one\", \"id\": 1}\n\n{\"text\": \"two\\nlines\"}\n",
        )
        .expect("write");
        assert_eq!(
            load_file_text(&jsonl).expect("jsonl"),
            "one\n\ntwo\nlines\n"
        );
        std::fs::write(&jsonl, "{\"text\": \"ok\"}\n{\"body\": \"x\"}\n").expect("write");
        let err = load_file_text(&jsonl).expect_err("missing text field");
        assert!(err.to_string().contains("line 2"), "{err}");
        std::fs::write(&plain, [0xffu8, 0xfe, 0x00]).expect("write");
        assert!(matches!(
            load_file_text(&plain),
            Err(CorpusError::Format { .. })
        ));
        assert!(matches!(
            load_file_text(&dir.path().join("missing.txt")),
            Err(CorpusError::Io { .. })
        ));
    }

    #[test]
    fn missing_assets_are_io_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(matches!(wiki_text(dir.path()), Err(CorpusError::Io { .. })));
        assert!(matches!(
            brown_text(dir.path()),
            Err(CorpusError::Io { .. })
        ));
        assert!(matches!(
            austen_text(dir.path(), "emma"),
            Err(CorpusError::RData { .. })
        ));
        std::fs::create_dir(dir.path().join("brown")).expect("mkdir");
        assert!(matches!(
            brown_text(dir.path()),
            Err(CorpusError::NoBrownDocuments(_))
        ));
    }

    #[test]
    fn real_austen_database() {
        let assets = real_assets();
        let db = austen_db(&assets).expect("austen db");
        let names: Vec<&str> = db.names().collect();
        eprintln!("austen objects: {names:?}");
        let mut expected = AUSTEN_NOVELS.to_vec();
        expected.sort_unstable();
        assert_eq!(names, expected);
        for novel in AUSTEN_NOVELS {
            let text = austen_text(&assets, novel).expect("novel");
            stats(&format!("austen/{novel}"), &text);
            assert!(text.ends_with('\n') && !text.ends_with("\n\n\n\n\n"));
            assert!(
                text.split_whitespace().count() > 70_000,
                "{novel} too short"
            );
        }
        let emma = austen_text(&assets, "emma").expect("emma");
        assert!(
            emma.starts_with("EMMA\n\nBy Jane Austen\n"),
            "{}",
            &emma[..40]
        );
    }

    #[test]
    fn real_wiki_text() {
        let assets = real_assets();
        let text = wiki_text(&assets).expect("wiki");
        stats("wiki", &text);
        // The pinned text's word count and first words, recorded when it was pinned.
        assert_eq!(text.split_whitespace().count(), 775_848);
        assert!(text.starts_with("0 is a number"), "{}", &text[..40]);
    }

    #[test]
    fn real_brown_text() {
        let assets = real_assets();
        let text = brown_text(&assets).expect("brown");
        stats("brown", &text);
        let head: String = text.chars().take(300).collect();
        eprintln!("brown begins: {head:?}");
        assert!(head.starts_with(
            "The Fulton County Grand Jury said Friday an investigation of Atlanta's recent \
             primary election produced \"no evidence\" that any irregularities took place.\n"
        ));
        assert_eq!(text.split("\n\n").count(), 500);
        // Tags are gone: no token of the form word/lowercase-tag survives, except the
        // fractions and slashed words that really are text.
        assert!(!text.contains("/nn ") && !text.contains("/at "));
        assert!(!text.contains(" ,") && !text.contains(" .") && !text.contains("; ;"));
        // Quote tokens became '"'; the remaining '' are inch marks ("12''").
        assert!(!text.contains("``") && !text.contains("''\""));
    }

    #[test]
    fn assets_dir_prefers_env() {
        // Only read the variable's effect through a child-free check: setting env vars in
        // a multithreaded test binary is unsound, so compare against what is set now.
        match std::env::var_os("SFX_ASSETS").filter(|v| !v.is_empty()) {
            Some(v) => assert_eq!(assets_dir(), PathBuf::from(v)),
            None => assert!(assets_dir().ends_with("assets")),
        }
    }
}

//! A conversion's output folder, the unit users download and check: `model.sfx` beside the
//! files a Hugging Face user expects (`config.json` with a `quantization_config` block, the
//! tokenizer files and chat template, `generation_config.json`, a `README.md` model card) and
//! a `manifest.json` naming every file's size and SHA-256 with the conversion's provenance.
//! Everything but the container is derived from the container's own metadata, so a folder
//! says nothing its `model.sfx` does not.
//!
//! The folder is built in a staging directory beside the destination and moved into place
//! only when complete ([`publish_staged`]); [`verify_folder`] checks all of it and names the
//! file that is wrong.

mod card;

use crate::atomic::{parent_dir, sync_dir, write_atomic};
use crate::sfx::SfxFile;
use crate::FormatError;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The container's file name inside a folder.
pub const MODEL_FILE: &str = "model.sfx";
/// The manifest's file name; it lists every other file.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The quality receipt (PPL and KL against the float source on held-out text).
pub const QUALITY_FILE: &str = "quality.json";
/// What `manifest.json`'s `format` says, and its version.
const MANIFEST_FORMAT: &str = "strataflux-folder";
const MANIFEST_VERSION: u32 = 1;

/// One file of a folder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub bytes: u64,
    /// Lowercase hex.
    pub sha256: String,
}

/// `manifest.json`: every file of the folder but itself, and where the model came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub files: BTreeMap<String, FileEntry>,
    pub tool: String,
    pub tool_version: String,
    /// The tool's source revision (`git describe`), when it was built from a checkout.
    pub git_revision: Option<String>,
    pub source_id: String,
    pub source_revision: Option<String>,
    pub source_files_sha256: BTreeMap<String, String>,
    pub calibration_text_sha256: Option<String>,
    pub seed: Option<u64>,
    /// The converter's arguments, program name first.
    pub command_line: Vec<String>,
    /// SHA-256 of this manifest as written with this field empty, so a change to the
    /// manifest itself is caught and blamed on it.
    pub manifest_sha256: String,
}

impl Manifest {
    /// The manifest's bytes as written: pretty JSON with a final newline.
    fn to_bytes(&self) -> Result<Vec<u8>, FormatError> {
        let v = serde_json::to_value(self).map_err(|e| FormatError::Other(e.to_string()))?;
        Ok(pretty(&v))
    }

    /// `manifest_sha256` of this manifest.
    fn own_digest(&self) -> Result<String, FormatError> {
        let blank = Manifest {
            manifest_sha256: String::new(),
            ..self.clone()
        };
        Ok(format!("{:x}", Sha256::digest(blank.to_bytes()?)))
    }
}

/// What a folder needs beyond its container's metadata.
#[derive(Debug, Clone, Default)]
pub struct FolderInputs {
    pub command_line: Vec<String>,
    pub git_revision: Option<String>,
    /// The source's `generation_config.json`; without one it is derived from the config's
    /// BOS/EOS ids.
    pub generation_config: Option<Value>,
    /// The source's license identifier (Hugging Face card vocabulary); `other` if unknown.
    pub license: Option<String>,
    /// The Hub id of the float model, for the card's `base_model`.
    pub base_model: Option<String>,
    /// The quality receipt (`strataflux::quality`), written as `quality.json` and shown as
    /// the card's quality table; none when the conversion was asked not to measure it.
    pub quality: Option<Value>,
}

/// What [`verify_folder`] checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FolderReport {
    pub files: usize,
    pub bytes: u64,
    /// The files the manifest lists, as checked (name order), and the manifest itself.
    pub checked: BTreeMap<String, FileEntry>,
    pub manifest: FileEntry,
    /// Sections of `model.sfx` whose checksums were checked.
    pub sections: usize,
    /// Files in the folder the manifest does not list (not part of the model).
    pub unlisted: Vec<String>,
}

/// The container of an output folder (`DIR/model.sfx` where `DIR` has a manifest), so every
/// tool takes the folder where it takes the file; any other path as given.
pub fn container_path(spec: &Path) -> PathBuf {
    if spec.join(MANIFEST_FILE).is_file() && spec.join(MODEL_FILE).is_file() {
        spec.join(MODEL_FILE)
    } else {
        spec.to_path_buf()
    }
}

/// [`container_path`] of a model argument given as text (a Hub id stays as it is).
pub fn container_spec(spec: &str) -> String {
    container_path(Path::new(spec))
        .to_string_lossy()
        .into_owned()
}

/// Lowercase hex SHA-256 and length of a file, read in 1 MiB pieces.
pub fn sha256_file(path: &Path) -> Result<FileEntry, FormatError> {
    let mut f = std::fs::File::open(path).map_err(|e| FormatError::io(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(|e| FormatError::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        bytes += n as u64;
    }
    Ok(FileEntry {
        bytes,
        sha256: format!("{:x}", h.finalize()),
    })
}

fn pretty(v: &Value) -> Vec<u8> {
    let mut s = serde_json::to_string_pretty(v).unwrap_or_else(|_| "null".into());
    s.push('\n');
    s.into_bytes()
}

/// Writes every file of the folder `dir` but the container (`dir/model.sfx`, already
/// written), then the manifest, each atomically. Returns the manifest.
pub fn write_folder_files(dir: &Path, inputs: &FolderInputs) -> Result<Manifest, FormatError> {
    let sfx_path = dir.join(MODEL_FILE);
    let sfx = SfxFile::open(&sfx_path)?;
    let meta = sfx.metadata();
    let config = meta
        .config
        .as_ref()
        .ok_or_else(|| FormatError::invalid(&sfx_path, "no model configuration in the metadata"))?;
    let mut config_json = config.to_hf_json();
    if let Value::Object(m) = &mut config_json {
        m.insert(
            "quantization_config".into(),
            card::quantization_config(&meta.params),
        );
    }
    write_atomic(dir.join("config.json"), &pretty(&config_json))?;
    if let Some(t) = &meta.tokenizer_json {
        write_atomic(dir.join("tokenizer.json"), t.as_bytes())?;
    }
    if let Some(t) = &meta.tokenizer_config {
        write_atomic(dir.join("tokenizer_config.json"), &pretty(t))?;
    }
    let generation = inputs.generation_config.clone().unwrap_or_else(|| {
        serde_json::json!({
            "bos_token_id": config.bos_token_id,
            "eos_token_id": config.eos_token_ids,
        })
    });
    write_atomic(dir.join("generation_config.json"), &pretty(&generation))?;
    if let Some(q) = &inputs.quality {
        write_atomic(dir.join(QUALITY_FILE), &pretty(q))?;
    }
    let tiers = card::tier_bytes(&sfx);
    let readme = card::model_card(meta, &tiers, inputs);
    write_atomic(dir.join("README.md"), readme.as_bytes())?;

    let mut files = BTreeMap::new();
    for name in listed_files(dir)? {
        if name != MANIFEST_FILE {
            files.insert(name.clone(), sha256_file(&dir.join(&name))?);
        }
    }
    let p = &meta.provenance;
    let manifest = Manifest {
        format: MANIFEST_FORMAT.into(),
        version: MANIFEST_VERSION,
        files,
        tool: p.tool.clone(),
        tool_version: p.tool_version.clone(),
        git_revision: inputs.git_revision.clone(),
        source_id: p.source_id.clone(),
        source_revision: p.source_revision.clone(),
        source_files_sha256: p.source_files_sha256.clone(),
        calibration_text_sha256: p.calibration_text_sha256.clone(),
        seed: p.seed,
        command_line: inputs.command_line.clone(),
        manifest_sha256: String::new(),
    };
    let manifest = Manifest {
        manifest_sha256: manifest.own_digest()?,
        ..manifest
    };
    write_atomic(dir.join(MANIFEST_FILE), &manifest.to_bytes()?)?;
    Ok(manifest)
}

/// Plain files of `dir` (no hidden ones: atomic writes' leftovers), sorted.
fn listed_files(dir: &Path) -> Result<Vec<String>, FormatError> {
    let mut names = Vec::new();
    for e in std::fs::read_dir(dir).map_err(|e| FormatError::io(dir, e))? {
        let e = e.map_err(|e| FormatError::io(dir, e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if e.path().is_file() && !name.starts_with('.') {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// Whether an output folder may be written to `out`: nothing there, an empty folder, or an
/// earlier output folder (one with a manifest), which it will replace. Anything else is
/// refused, so a conversion never overwrites what it did not write.
pub fn check_destination(out: &Path) -> Result<(), FormatError> {
    if !out.exists() {
        return Ok(());
    }
    let ours = out.is_dir()
        && (out.join(MANIFEST_FILE).is_file()
            || std::fs::read_dir(out)
                .map_err(|e| FormatError::io(out, e))?
                .next()
                .is_none());
    if ours {
        Ok(())
    } else {
        Err(FormatError::invalid(
            out,
            "exists and is not an output folder (no manifest.json); choose a new path or \
             remove it",
        ))
    }
}

/// Moves the finished folder `staging` to `out`, replacing an earlier output folder there
/// ([`check_destination`]).
pub fn publish_staged(staging: &Path, out: &Path) -> Result<(), FormatError> {
    check_destination(out)?;
    if out.exists() {
        let old = staging.with_extension("old");
        std::fs::rename(out, &old).map_err(|e| FormatError::io(out, e))?;
        if let Err(e) = std::fs::rename(staging, out) {
            // Put the earlier folder back rather than leave nothing at `out`.
            let _ = std::fs::rename(&old, out);
            return Err(FormatError::io(out, e));
        }
        std::fs::remove_dir_all(&old).map_err(|e| FormatError::io(&old, e))?;
    } else {
        std::fs::rename(staging, out).map_err(|e| FormatError::io(out, e))?;
    }
    sync_dir(&parent_dir(out));
    Ok(())
}

/// Checks an output folder: the manifest parses, every file it lists is there with its size
/// and SHA-256, and `model.sfx` opens and passes its own section checksums. The first file
/// that is wrong is named in the error.
pub fn verify_folder(dir: &Path) -> Result<FolderReport, FormatError> {
    let manifest_path = dir.join(MANIFEST_FILE);
    let text =
        std::fs::read_to_string(&manifest_path).map_err(|e| FormatError::io(&manifest_path, e))?;
    let manifest: Manifest = serde_json::from_str(&text)
        .map_err(|e| FormatError::invalid(&manifest_path, format!("not a manifest: {e}")))?;
    if manifest.format != MANIFEST_FORMAT || manifest.version != MANIFEST_VERSION {
        return Err(FormatError::invalid(
            &manifest_path,
            format!(
                "format {:?} version {}; this tool reads {MANIFEST_FORMAT:?} version \
                 {MANIFEST_VERSION}",
                manifest.format, manifest.version
            ),
        ));
    }
    if manifest.own_digest()? != manifest.manifest_sha256 || manifest.to_bytes()? != text.as_bytes()
    {
        return Err(FormatError::invalid(
            &manifest_path,
            "changed since it was written (its own SHA-256 or its bytes differ)",
        ));
    }
    if !manifest.files.contains_key(MODEL_FILE) {
        return Err(FormatError::invalid(
            &manifest_path,
            format!("lists no {MODEL_FILE}"),
        ));
    }
    let mut bytes = 0;
    let mut checked = BTreeMap::new();
    for (name, want) in &manifest.files {
        if name.contains('/') || name.contains('\\') || name.starts_with('.') {
            return Err(FormatError::invalid(
                &manifest_path,
                format!("file name {name:?} is not a plain name in the folder"),
            ));
        }
        let path = dir.join(name);
        let got = sha256_file(&path)?;
        if got.bytes != want.bytes {
            return Err(FormatError::invalid(
                &path,
                format!("{} bytes, the manifest says {}", got.bytes, want.bytes),
            ));
        }
        if got.sha256 != want.sha256 {
            return Err(FormatError::invalid(
                &path,
                format!(
                    "SHA-256 {} differs from the manifest's {}",
                    got.sha256, want.sha256
                ),
            ));
        }
        bytes += got.bytes;
        checked.insert(name.clone(), got);
    }
    let sfx = SfxFile::open(dir.join(MODEL_FILE))?;
    let sections = sfx.verify()?.sections;
    let unlisted = listed_files(dir)?
        .into_iter()
        .filter(|n| n != MANIFEST_FILE && !manifest.files.contains_key(n))
        .collect();
    Ok(FolderReport {
        files: manifest.files.len(),
        bytes,
        checked,
        manifest: FileEntry {
            bytes: text.len() as u64,
            sha256: format!("{:x}", Sha256::digest(text.as_bytes())),
        },
        sections,
        unlisted,
    })
}

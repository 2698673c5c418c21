//! Resumable conversions: where an interrupted `sfx-convert` keeps what it has done, and how a
//! run with `--resume` finds it and checks that it is continuing the same conversion.
//!
//! Beside the output `DIR/NAME` lives `DIR/.NAME.resume/` while a conversion runs:
//! `model.sfx.part` (the container being written), `checkpoint.json` (replaced atomically
//! after every finished block, once that block's sections are fsynced), `lock` (held by the
//! running converter), and for an output folder `folder/`, the folder being assembled. A
//! kill at any instant leaves a checkpoint whose bytes are on disk; a resumed run cuts the
//! partial container back to it (docs/format.md, "Resumable conversions").

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use sfx_calibration::convert::ConvertState;
use sfx_formats::atomic::write_atomic;
use sfx_formats::sfx::WriterCheckpoint;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs::{self, File, TryLockError};
use std::path::{Path, PathBuf};

/// The checkpoint's file name inside the partial-state folder.
pub const CHECKPOINT_FILE: &str = "checkpoint.json";
/// The container being written, inside the partial-state folder.
pub const PART_FILE: &str = "model.sfx.part";
/// An output folder being assembled, inside the partial-state folder.
pub const FOLDER_DIR: &str = "folder";
const LOCK_FILE: &str = "lock";
const FORMAT: &str = "strataflux-convert-checkpoint";
const VERSION: u32 = 1;

/// `checkpoint.json`: which conversion this is and how far it got.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub format: String,
    pub version: u32,
    /// Every input and option that decides the output's bytes, keyed by what a user would
    /// change (a flag, the model files, the tool build), as text.
    pub fingerprint: BTreeMap<String, String>,
    /// SHA-256 of `fingerprint` (its JSON): one name for the conversion in messages.
    pub fingerprint_sha256: String,
    /// Decoder blocks of the model.
    pub blocks: usize,
    pub writer: WriterCheckpoint,
    pub converter: ConvertState,
}

impl Checkpoint {
    pub fn new(
        fingerprint: BTreeMap<String, String>,
        blocks: usize,
        writer: WriterCheckpoint,
        converter: ConvertState,
    ) -> Self {
        Self {
            format: FORMAT.into(),
            version: VERSION,
            fingerprint_sha256: fingerprint_sha256(&fingerprint),
            fingerprint,
            blocks,
            writer,
            converter,
        }
    }
}

/// SHA-256 of a fingerprint's JSON (a `BTreeMap`, so its order is fixed).
pub fn fingerprint_sha256(fingerprint: &BTreeMap<String, String>) -> String {
    let json = serde_json::to_vec(fingerprint).unwrap_or_default();
    format!("{:x}", Sha256::digest(json))
}

/// What differs between the fingerprint a checkpoint recorded and this run's, one line per
/// field (`--k: checkpoint 16, now 32`). `catch_all` is a field that holds every option at
/// once, listed only when no named field explains the difference.
pub fn differences(
    recorded: &BTreeMap<String, String>,
    now: &BTreeMap<String, String>,
    catch_all: &str,
) -> Vec<String> {
    let none = String::from("(none)");
    let mut keys: Vec<&String> = recorded.keys().chain(now.keys()).collect();
    keys.sort();
    keys.dedup();
    let mut out: Vec<String> = keys
        .into_iter()
        .filter(|k| *k != catch_all)
        .filter_map(|k| {
            let (a, b) = (
                recorded.get(k).unwrap_or(&none),
                now.get(k).unwrap_or(&none),
            );
            (a != b).then(|| format!("{k}: checkpoint {a}, now {b}"))
        })
        .collect();
    if out.is_empty() && recorded.get(catch_all) != now.get(catch_all) {
        out.push(format!(
            "{catch_all}: checkpoint {}, now {}",
            recorded.get(catch_all).unwrap_or(&none),
            now.get(catch_all).unwrap_or(&none)
        ));
    }
    out
}

/// The partial-state folder of one output, locked by this process while it exists.
pub struct PartialDir {
    pub dir: PathBuf,
    _lock: File,
    /// Set once the output is complete and the folder removed (or handed on).
    done: bool,
}

impl PartialDir {
    /// `DIR/.NAME.resume` for the output `DIR/NAME`.
    pub fn path_for(output: &Path) -> Result<PathBuf> {
        let name = output
            .file_name()
            .ok_or_else(|| anyhow!("{}: the output path has no name", output.display()))?
            .to_string_lossy()
            .into_owned();
        let parent = match output.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        Ok(parent.join(format!(".{name}.resume")))
    }

    /// Opens (creating it if needed) and locks the partial-state folder of `output`; refuses
    /// while another converter holds it.
    pub fn open(output: &Path) -> Result<Self> {
        let dir = Self::path_for(output)?;
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let lock_path = dir.join(LOCK_FILE);
        let lock = File::create(&lock_path)
            .with_context(|| format!("creating {}", lock_path.display()))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => bail!(
                "{}: another sfx-convert is converting to this output (it holds {})",
                output.display(),
                lock_path.display()
            ),
            Err(TryLockError::Error(e)) => {
                return Err(e).with_context(|| format!("locking {}", lock_path.display()))
            }
        }
        Ok(Self {
            dir,
            _lock: lock,
            done: false,
        })
    }

    pub fn checkpoint_path(&self) -> PathBuf {
        self.dir.join(CHECKPOINT_FILE)
    }

    pub fn part_path(&self) -> PathBuf {
        self.dir.join(PART_FILE)
    }

    pub fn folder_path(&self) -> PathBuf {
        self.dir.join(FOLDER_DIR)
    }

    /// The recorded checkpoint, if there is one.
    pub fn checkpoint(&self) -> Result<Option<Checkpoint>> {
        let path = self.checkpoint_path();
        let text = match fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        let remove = || format!("remove {} to start over", self.dir.display());
        let cp: Checkpoint = serde_json::from_str(&text).map_err(|e| {
            anyhow!(
                "{}: not a conversion checkpoint ({e}); {}",
                path.display(),
                remove()
            )
        })?;
        if cp.format != FORMAT || cp.version != VERSION {
            bail!(
                "{}: format {:?} version {}, this sfx-convert reads {FORMAT:?} version \
                 {VERSION}; {}",
                path.display(),
                cp.format,
                cp.version,
                remove()
            );
        }
        Ok(Some(cp))
    }

    /// Records `cp` atomically (temporary file, fsync, rename, directory fsync).
    pub fn record(&self, cp: &Checkpoint) -> Result<()> {
        let path = self.checkpoint_path();
        let json = serde_json::to_vec(cp).context("encoding the checkpoint")?;
        write_atomic(&path, &json).with_context(|| format!("writing {}", path.display()))
    }

    /// Removes everything but the lock: what an earlier run left without a checkpoint (it
    /// died before finishing a block), which nothing can continue.
    pub fn clear(&self) -> Result<()> {
        for e in
            fs::read_dir(&self.dir).with_context(|| format!("listing {}", self.dir.display()))?
        {
            let e = e.with_context(|| format!("listing {}", self.dir.display()))?;
            if e.file_name() == LOCK_FILE {
                continue;
            }
            let p = e.path();
            let removed = if e.file_type().is_ok_and(|t| t.is_dir()) {
                fs::remove_dir_all(&p)
            } else {
                fs::remove_file(&p)
            };
            removed.with_context(|| format!("removing {}", p.display()))?;
        }
        Ok(())
    }

    /// The output is complete: the partial state goes.
    pub fn finish(mut self) -> Result<()> {
        self.done = true;
        fs::remove_dir_all(&self.dir).with_context(|| format!("removing {}", self.dir.display()))
    }
}

impl Drop for PartialDir {
    /// A run that stops before its first checkpoint leaves nothing to continue: it takes the
    /// folder with it. One that stops later keeps it for `--resume`.
    fn drop(&mut self) {
        if !self.done && !self.checkpoint_path().exists() {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn differences_name_each_changed_field_and_the_catch_all_only_alone() {
        let a = map(&[("--k", "16"), ("--fit", "true"), ("options", "A")]);
        let b = map(&[("--k", "32"), ("--fit", "true"), ("options", "B")]);
        assert_eq!(
            differences(&a, &b, "options"),
            ["--k: checkpoint 16, now 32"]
        );
        let c = map(&[("--k", "16"), ("--fit", "true"), ("options", "C")]);
        assert_eq!(
            differences(&a, &c, "options"),
            ["options: checkpoint A, now C"]
        );
        let d = map(&[("--k", "16"), ("options", "A"), ("--base", "x.sfx")]);
        assert_eq!(
            differences(&a, &d, "options"),
            [
                "--base: checkpoint (none), now x.sfx",
                "--fit: checkpoint true, now (none)"
            ]
        );
        assert!(differences(&a, &a, "options").is_empty());
    }

    #[test]
    fn partial_dir_is_locked_and_removed_unless_it_holds_a_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("model.sfx");
        let p = PartialDir::open(&out).unwrap();
        assert_eq!(p.dir, dir.path().join(".model.sfx.resume"));
        let err = PartialDir::open(&out).err().unwrap().to_string();
        assert!(err.contains("another sfx-convert"), "{err}");
        fs::write(p.part_path(), b"bytes").unwrap();
        drop(p);
        assert!(!dir.path().join(".model.sfx.resume").exists());

        let p = PartialDir::open(&out).unwrap();
        fs::write(p.checkpoint_path(), b"{not json").unwrap();
        let err = p.checkpoint().err().unwrap().to_string();
        assert!(
            err.contains("checkpoint.json") && err.contains("remove"),
            "{err}"
        );
        drop(p);
        // Kept for --resume: it has a checkpoint (a broken one is reported, not deleted).
        assert!(dir
            .path()
            .join(".model.sfx.resume/checkpoint.json")
            .exists());
        let p = PartialDir::open(&out).unwrap();
        p.clear().unwrap();
        assert_eq!(fs::read_dir(&p.dir).unwrap().count(), 1);
        p.finish().unwrap();
        assert!(!dir.path().join(".model.sfx.resume").exists());
    }
}

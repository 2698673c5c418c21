//! Opening a model for the runtime: a Hugging Face folder, a Hub repo id, or a GGUF file, all
//! resolved to one [`Checkpoint`]: a config, a [`TensorSource`] and the tokenizer files.
//!
//! safetensors files are memory-mapped and validated by the `safetensors` crate (header size
//! cap, offsets in bounds, no overlaps); tensor views borrow the map, so a BF16 checkpoint is
//! never copied before the runtime lays it out for its kernels.

use crate::config::ModelConfig;
use crate::gguf::{BlockTensor, GgmlType};
use crate::tensor::{DType, TensorSource, TensorView};
use crate::FormatError;
use memmap2::Mmap;
use safetensors::SafeTensors;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};

/// Everything needed to run a model, independent of where it came from.
pub struct Checkpoint {
    /// What the user asked for (path or repo id), for messages and provenance.
    pub origin: String,
    pub config: ModelConfig,
    pub tensors: Box<dyn TensorSource>,
    /// Contents of `tokenizer.json`.
    pub tokenizer_json: Option<String>,
    /// `tokenizer_config.json` (chat template, special token strings), if present.
    pub tokenizer_config: Option<Value>,
    /// `generation_config.json`, if present.
    pub generation_config: Option<Value>,
    /// Weights a GGUF file holds in blocks the runtime runs as they are
    /// ([`Checkpoint::open_keeping_blocks`]), by Hugging Face name; not in `tensors`.
    pub blocks: BTreeMap<String, BlockTensor>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("origin", &self.origin)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Checkpoint {
    /// Resolves `spec`: an existing `.gguf` file, an existing directory, or else a Hub repo id
    /// (`org/name`, optionally `org/name@revision`).
    pub fn open(spec: &str) -> Result<Self, FormatError> {
        let path = Path::new(spec);
        if path.is_file() {
            return if has_extension(path, "gguf") {
                Self::from_gguf(path)
            } else {
                Err(FormatError::invalid(
                    path,
                    "expected a .gguf file, a Hugging Face model folder, or a Hub repo id",
                ))
            };
        }
        if path.is_dir() {
            return Self::from_hf_dir(path);
        }
        if looks_like_repo_id(spec) {
            let dir = crate::checkpoint::hub::resolve(spec)?;
            let mut ckpt = Self::from_hf_dir(&dir)?;
            ckpt.origin = spec.to_string();
            return Ok(ckpt);
        }
        Err(FormatError::invalid(
            path,
            "no such file or directory, and not a Hub repo id (org/name)",
        ))
    }

    /// [`Checkpoint::open`], except that a GGUF file's 2-D weights of the types `keep`
    /// accepts stay in their blocks ([`Checkpoint::blocks`]) for a runtime with kernels for
    /// them.
    pub fn open_keeping_blocks(
        spec: &str,
        keep: impl Fn(GgmlType) -> bool + Sync,
    ) -> Result<Self, FormatError> {
        let path = Path::new(spec);
        if path.is_file() && has_extension(path, "gguf") {
            return Self::from_gguf_keeping(path, keep);
        }
        Self::open(spec)
    }

    /// A GGUF file, dequantized to F32 in memory with Hugging Face names and layout.
    pub fn from_gguf(path: &Path) -> Result<Self, FormatError> {
        Self::from_gguf_keeping(path, |_| false)
    }

    /// [`Checkpoint::from_gguf`], keeping the 2-D weights of the types `keep` accepts in
    /// their blocks ([`Checkpoint::blocks`]).
    pub fn from_gguf_keeping(
        path: &Path,
        keep: impl Fn(GgmlType) -> bool + Sync,
    ) -> Result<Self, FormatError> {
        let imported = crate::gguf::import_gguf_keeping(path, keep)?;
        let config = ModelConfig::from_hf_json(&imported.hf_config, path)?;
        Ok(Checkpoint {
            origin: path.display().to_string(),
            config,
            tensors: Box::new(imported.tensors),
            tokenizer_json: Some(imported.tokenizer_json),
            tokenizer_config: Some(imported.tokenizer_config),
            generation_config: Some(imported.generation_config),
            blocks: imported.blocks,
        })
    }

    /// A Hugging Face folder: `config.json`, `model.safetensors` or a sharded
    /// `model.safetensors.index.json`, and tokenizer files.
    pub fn from_hf_dir(dir: &Path) -> Result<Self, FormatError> {
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        let tensors = SafetensorsCheckpoint::open_dir(dir)?;
        Ok(Checkpoint {
            origin: dir.display().to_string(),
            config,
            tensors: Box::new(tensors),
            tokenizer_json: read_optional(&dir.join("tokenizer.json"))?,
            tokenizer_config: read_optional_json(&dir.join("tokenizer_config.json"))?,
            generation_config: read_optional_json(&dir.join("generation_config.json"))?,
            blocks: BTreeMap::new(),
        })
    }

    /// The chat template from `tokenizer_config.json`, if the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.tokenizer_config
            .as_ref()?
            .get("chat_template")?
            .as_str()
    }
}

fn has_extension(path: &Path, ext: &str) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case(ext))
}

fn looks_like_repo_id(spec: &str) -> bool {
    let id = spec.split('@').next().unwrap_or(spec);
    let parts: Vec<&str> = id.split('/').collect();
    parts.len() == 2
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        })
}

pub(crate) fn read_optional(path: &Path) -> Result<Option<String>, FormatError> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(FormatError::io(path, e)),
    }
}

pub(crate) fn read_optional_json(path: &Path) -> Result<Option<Value>, FormatError> {
    read_optional(path)?
        .map(|s| {
            serde_json::from_str(&s)
                .map_err(|e| FormatError::invalid(path, format!("not valid JSON: {e}")))
        })
        .transpose()
}

/// The safetensors files of a model folder: `model.safetensors`, or the shards named by
/// `model.safetensors.index.json` (sorted, each once), with that index's `weight_map` so the
/// caller can check it against the files.
pub(crate) struct ShardIndex {
    pub files: Vec<PathBuf>,
    pub weight_map: Option<(PathBuf, serde_json::Map<String, Value>)>,
}

impl ShardIndex {
    pub fn read(dir: &Path) -> Result<Self, FormatError> {
        let index_path = dir.join("model.safetensors.index.json");
        let Some(json) = read_optional_json(&index_path)? else {
            let single = dir.join("model.safetensors");
            if !single.is_file() {
                return Err(FormatError::invalid(
                    dir,
                    "no model.safetensors or model.safetensors.index.json in the model folder",
                ));
            }
            return Ok(Self {
                files: vec![single],
                weight_map: None,
            });
        };
        let Some(Value::Object(map)) = json.get("weight_map") else {
            return Err(FormatError::invalid(
                &index_path,
                "missing 'weight_map' object",
            ));
        };
        let mut shards = BTreeSet::new();
        for (tensor, shard) in map {
            let shard = shard.as_str().ok_or_else(|| {
                FormatError::invalid(
                    &index_path,
                    format!("weight_map['{tensor}'] is not a string"),
                )
            })?;
            if shard.contains('/') || shard.contains('\\') || shard.contains("..") {
                return Err(FormatError::invalid(
                    &index_path,
                    format!("weight_map['{tensor}'] = '{shard}' points outside the folder"),
                ));
            }
            shards.insert(shard);
        }
        Ok(Self {
            files: shards.into_iter().map(|s| dir.join(s)).collect(),
            weight_map: Some((index_path.clone(), map.clone())),
        })
    }
}

/// One memory-mapped safetensors file, with its tensor table parsed once.
struct MappedFile {
    path: PathBuf,
    mmap: Mmap,
    /// name → (dtype, shape, byte range within the map)
    entries: BTreeMap<String, (DType, Vec<usize>, std::ops::Range<usize>)>,
}

impl MappedFile {
    fn open(path: &Path) -> Result<Self, FormatError> {
        let file = File::open(path).map_err(|e| FormatError::io(path, e))?;
        // SAFETY: the file is opened read-only; like every mmap-based loader we assume it is
        // not truncated by another process while mapped.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| FormatError::io(path, e))?;
        let st = SafeTensors::deserialize(&mmap)
            .map_err(|e| FormatError::invalid(path, format!("invalid safetensors file: {e}")))?;
        let base = mmap.as_ptr() as usize;
        let mut entries = BTreeMap::new();
        for (name, view) in st.tensors() {
            let dtype = match view.dtype() {
                safetensors::Dtype::F32 => DType::F32,
                safetensors::Dtype::F16 => DType::F16,
                safetensors::Dtype::BF16 => DType::BF16,
                other => {
                    return Err(FormatError::UnsupportedDType {
                        tensor: name,
                        dtype: format!("{other:?}"),
                    })
                }
            };
            let start = view.data().as_ptr() as usize - base;
            let range = start..start + view.data().len();
            entries.insert(name, (dtype, view.shape().to_vec(), range));
        }
        Ok(MappedFile {
            path: path.to_path_buf(),
            mmap,
            entries,
        })
    }
}

/// A (possibly sharded) safetensors checkpoint.
pub struct SafetensorsCheckpoint {
    files: Vec<MappedFile>,
    /// tensor name → index into `files`
    index: BTreeMap<String, usize>,
}

impl SafetensorsCheckpoint {
    pub fn open_dir(dir: &Path) -> Result<Self, FormatError> {
        let shards = ShardIndex::read(dir)?;
        let files: Vec<MappedFile> = shards
            .files
            .iter()
            .map(|p| MappedFile::open(p))
            .collect::<Result<_, _>>()?;
        let declared = shards.weight_map.as_ref().map(|(p, m)| (p.as_path(), m));
        Self::from_files(files, declared)
    }

    pub fn open_file(path: &Path) -> Result<Self, FormatError> {
        Self::from_files(vec![MappedFile::open(path)?], None)
    }

    fn from_files(
        files: Vec<MappedFile>,
        declared: Option<(&Path, &serde_json::Map<String, Value>)>,
    ) -> Result<Self, FormatError> {
        let mut index = BTreeMap::new();
        for (i, f) in files.iter().enumerate() {
            for name in f.entries.keys() {
                if let Some(prev) = index.insert(name.clone(), i) {
                    return Err(FormatError::invalid(
                        &f.path,
                        format!(
                            "tensor '{name}' also appears in {}",
                            files[prev].path.display()
                        ),
                    ));
                }
            }
        }
        if let Some((index_path, map)) = declared {
            for (name, shard) in map {
                let found = index.get(name).map(|&i| &files[i].path);
                let ok =
                    found.is_some_and(|p| p.file_name().and_then(|f| f.to_str()) == shard.as_str());
                if !ok {
                    return Err(FormatError::invalid(
                        index_path,
                        format!("tensor '{name}' is listed in weight_map but not found in its shard {shard}"),
                    ));
                }
            }
        }
        Ok(Self { files, index })
    }
}

impl TensorSource for SafetensorsCheckpoint {
    fn tensor_names(&self) -> Vec<String> {
        self.index.keys().cloned().collect()
    }

    fn tensor(&self, name: &str) -> Result<TensorView<'_>, FormatError> {
        let &i = self
            .index
            .get(name)
            .ok_or_else(|| FormatError::MissingTensor(name.to_string()))?;
        let f = &self.files[i];
        let (dtype, shape, range) = &f.entries[name];
        TensorView::new(name, *dtype, shape, &f.mmap[range.clone()])
    }
}

/// Hub resolution through the standard Hugging Face cache (`HF_HOME`, `HF_HUB_CACHE`).
pub mod hub {
    use crate::FormatError;
    use std::path::PathBuf;

    const FILES: [&str; 4] = [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ];

    fn offline() -> bool {
        std::env::var("HF_HUB_OFFLINE")
            .map(|v| !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("false"))
            .unwrap_or(false)
    }

    /// Returns the snapshot folder holding `repo_id`'s files, downloading them when allowed.
    pub fn resolve(spec: &str) -> Result<PathBuf, FormatError> {
        let (repo_id, revision) = match spec.split_once('@') {
            Some((id, rev)) => (id.to_string(), rev.to_string()),
            None => (spec.to_string(), "main".to_string()),
        };
        let repo =
            hf_hub::Repo::with_revision(repo_id.clone(), hf_hub::RepoType::Model, revision.clone());
        // transformers honours HF_HUB_CACHE before HF_HOME; hf-hub 0.4 only reads HF_HOME.
        let cache = match std::env::var_os("HF_HUB_CACHE") {
            Some(dir) if !dir.is_empty() => hf_hub::Cache::new(PathBuf::from(dir)),
            _ => hf_hub::Cache::from_env(),
        };
        // A full commit hash names a snapshot folder directly (no ref file points to it).
        let pinned = cache
            .path()
            .join(repo.folder_name())
            .join("snapshots")
            .join(&revision);
        if revision.len() == 40 && pinned.join("config.json").is_file() {
            return Ok(pinned);
        }
        if let Some(config) = cache.repo(repo.clone()).get("config.json") {
            let dir = config
                .parent()
                .map(PathBuf::from)
                .ok_or_else(|| FormatError::Other("cache entry has no parent folder".into()))?;
            return Ok(dir);
        }
        if offline() {
            return Err(FormatError::Other(format!(
                "model '{repo_id}' is not in the Hugging Face cache ({}) and HF_HUB_OFFLINE is set",
                cache.path().display()
            )));
        }
        download(&repo, &repo_id)
    }

    #[cfg(feature = "hub-download")]
    fn download(repo: &hf_hub::Repo, repo_id: &str) -> Result<PathBuf, FormatError> {
        let err = |e: hf_hub::api::sync::ApiError| {
            FormatError::Other(format!("downloading '{repo_id}' from the Hub: {e}"))
        };
        let api = hf_hub::api::sync::ApiBuilder::from_env()
            .build()
            .map_err(err)?;
        let r = api.repo(repo.clone());
        let config = r.get("config.json").map_err(err)?;
        for f in FILES.iter().skip(1) {
            // Tokenizer and generation configs are optional in many repos.
            let _ = r.get(f);
        }
        match r.get("model.safetensors.index.json") {
            Ok(index) => {
                let text =
                    std::fs::read_to_string(&index).map_err(|e| FormatError::io(&index, e))?;
                let json: serde_json::Value = serde_json::from_str(&text)
                    .map_err(|e| FormatError::invalid(&index, format!("not valid JSON: {e}")))?;
                let mut shards: Vec<String> = json
                    .get("weight_map")
                    .and_then(|m| m.as_object())
                    .map(|m| {
                        m.values()
                            .filter_map(|v| v.as_str().map(String::from))
                            .collect()
                    })
                    .unwrap_or_default();
                shards.sort();
                shards.dedup();
                for s in shards {
                    r.get(&s).map_err(err)?;
                }
            }
            Err(_) => {
                r.get("model.safetensors").map_err(err)?;
            }
        }
        config
            .parent()
            .map(PathBuf::from)
            .ok_or_else(|| FormatError::Other("download has no parent folder".into()))
    }

    #[cfg(not(feature = "hub-download"))]
    fn download(_repo: &hf_hub::Repo, repo_id: &str) -> Result<PathBuf, FormatError> {
        let _ = FILES;
        Err(FormatError::Other(format!(
            "model '{repo_id}' is not in the Hugging Face cache and this build has no Hub download support (feature 'hub-download')"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shard list both safetensors readers (checkpoints and QTIP import) share: sorted,
    /// each shard once, and index entries that leave the folder or are not strings refused.
    #[test]
    fn shard_index_lists_each_shard_once_and_refuses_escapes() {
        let d = tempfile::tempdir().unwrap();
        let index = d.path().join("model.safetensors.index.json");
        let err = ShardIndex::read(d.path()).err().unwrap().to_string();
        assert!(err.contains("no model.safetensors"), "{err}");

        std::fs::write(
            &index,
            r#"{"weight_map": {"a": "b.safetensors", "c": "a.safetensors", "d": "b.safetensors"}}"#,
        )
        .unwrap();
        let shards = ShardIndex::read(d.path()).unwrap();
        let names: Vec<_> = shards
            .files
            .iter()
            .map(|p| p.file_name().unwrap())
            .collect();
        assert_eq!(names, ["a.safetensors", "b.safetensors"]);
        assert_eq!(shards.weight_map.unwrap().1.len(), 3);

        for (bad, needle) in [
            (
                r#"{"weight_map": {"w": "../x.safetensors"}}"#,
                "points outside",
            ),
            (
                r#"{"weight_map": {"w": "sub\\x.safetensors"}}"#,
                "points outside",
            ),
            (r#"{"weight_map": {"w": 3}}"#, "is not a string"),
            (r#"{"metadata": {}}"#, "missing 'weight_map'"),
            ("{", "not valid JSON"),
        ] {
            std::fs::write(&index, bad).unwrap();
            let err = ShardIndex::read(d.path()).err().unwrap().to_string();
            assert!(err.contains(needle), "{bad}: {err}");
        }
    }

    #[test]
    fn repo_id_detection() {
        assert!(looks_like_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct"));
        assert!(looks_like_repo_id("meta-llama/Llama-3.1-8B@main"));
        assert!(!looks_like_repo_id("model.gguf"));
        assert!(!looks_like_repo_id("a/b/c"));
        assert!(!looks_like_repo_id("/abs/path"));
    }

    #[test]
    fn missing_path_is_a_clear_error() {
        let e = Checkpoint::open("/nonexistent/dir/model.gguf").unwrap_err();
        assert!(e.to_string().contains("no such file"), "{e}");
    }
}

//! The typed metadata block: everything a runtime needs besides tensors, and where the file
//! came from. Serialized as JSON (struct fields in declaration order, maps sorted), so the same
//! metadata always gives the same bytes.

use crate::config::ModelConfig;
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct SfxMetadata {
    /// The model architecture and sizes.
    pub config: Option<ModelConfig>,
    /// The Hugging Face `tokenizer.json`, verbatim text.
    pub tokenizer_json: Option<String>,
    /// The Hugging Face `tokenizer_config.json` (holds `chat_template`).
    pub tokenizer_config: Option<serde_json::Value>,
    pub provenance: Provenance,
    /// Quantizer and refinement parameters, keyed by projection set or section group
    /// (e.g. `"quant"`, `"refine.qkv"`); the schema belongs to the component that writes it.
    pub params: BTreeMap<String, serde_json::Value>,
}

#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct Provenance {
    /// Name of the writing tool, e.g. `sfx-convert`.
    pub tool: String,
    /// Its version (`CARGO_PKG_VERSION`). No timestamps: files must be reproducible.
    pub tool_version: String,
    /// Hub id, GGUF file name or local directory the model came from.
    pub source_id: String,
    /// Hub revision (commit) when known.
    pub source_revision: Option<String>,
    /// Source file name → lowercase hex SHA-256 of its bytes.
    pub source_files_sha256: BTreeMap<String, String>,
    /// Lowercase hex SHA-256 of the calibration token ids as fed to the model (u32 LE, window
    /// after window).
    pub calibration_text_sha256: Option<String>,
    pub seed: Option<u64>,
}

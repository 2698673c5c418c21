//! Errors from reading, dequantizing and importing GGUF files. Every variant names what is at
//! fault (the byte offset, metadata key or tensor) so a user can act on the message.

use crate::FormatError;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Any other error, with the file it happened in.
    #[error("{path}: {source}")]
    InFile {
        path: PathBuf,
        #[source]
        source: Box<GgufError>,
    },
    #[error("not a GGUF file: magic bytes {found:?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported GGUF version {0} (supported: 2, 3){hint}", hint = version_hint(*.0))]
    UnsupportedVersion(u32),
    #[error("file truncated: reading {what} at byte {offset} needs {needed} bytes, only {available} remain")]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        available: u64,
    },
    /// Structurally invalid header (counts, alignment, duplicate names...).
    #[error("invalid GGUF header: {0}")]
    Header(String),
    #[error("metadata key '{key}': {msg}")]
    Metadata { key: String, msg: String },
    #[error("metadata key '{0}' is missing")]
    MissingKey(String),
    #[error("metadata key '{key}' has type {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error("tensor '{tensor}': {msg}")]
    Tensor { tensor: String, msg: String },
    #[error("tensor '{tensor}': unknown ggml type id {id}")]
    UnknownGgmlType { tensor: String, id: u32 },
    #[error("tensor '{0}' not found in the GGUF file")]
    MissingTensor(String),
    #[error("dequantization: {0}")]
    Dequant(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("unsupported architecture '{0}' (supported: llama, mistral, qwen2, qwen3)")]
    UnsupportedArchitecture(String),
    /// The GGUF is valid but cannot be expressed as a Hugging Face checkpoint.
    #[error("cannot import: {0}")]
    Import(String),
    #[error(transparent)]
    Output(#[from] FormatError),
}

fn version_hint(v: u32) -> &'static str {
    if v == 1 {
        "; version 1 files use 32-bit lengths and predate every current converter"
    } else if v.swap_bytes() <= 3 {
        "; this looks like a big-endian GGUF, which is not supported"
    } else {
        ""
    }
}

impl GgufError {
    pub(crate) fn truncated(what: impl Into<String>, offset: u64, needed: u64, len: u64) -> Self {
        GgufError::Truncated {
            what: what.into(),
            offset,
            needed,
            available: len.saturating_sub(offset),
        }
    }

    pub(crate) fn tensor(tensor: impl Into<String>, msg: impl Into<String>) -> Self {
        GgufError::Tensor {
            tensor: tensor.into(),
            msg: msg.into(),
        }
    }

    pub(crate) fn metadata(key: impl Into<String>, msg: impl Into<String>) -> Self {
        GgufError::Metadata {
            key: key.into(),
            msg: msg.into(),
        }
    }
}

impl From<GgufError> for FormatError {
    fn from(e: GgufError) -> Self {
        match e {
            GgufError::Io { path, source } => FormatError::Io { path, source },
            GgufError::Output(inner) => inner,
            GgufError::InFile { path, source } => FormatError::Invalid {
                path,
                msg: source.to_string(),
            },
            other => FormatError::Other(other.to_string()),
        }
    }
}

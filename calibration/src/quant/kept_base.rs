//! A resident base read from a file instead of quantized (`sfx-convert --base FILE`, `--quant
//! gguf`): an existing container's codes ([`FileBase`]) or a llama.cpp GGUF's blocks
//! ([`GgufBase`]), told apart by the file's first bytes.

use super::{FileBase, GgufBase, ResidentQuantizer};
use sfx_formats::{FormatError, ModelConfig};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

pub enum KeptBase {
    Sfx(Box<FileBase>),
    Gguf(GgufBase),
}

impl KeptBase {
    /// Opens `path` as a GGUF when it starts with the GGUF magic, else as a container.
    pub fn open(path: &Path, config: &ModelConfig) -> Result<Self, FormatError> {
        if is_gguf(path) {
            Ok(Self::Gguf(GgufBase::open(path, config)?))
        } else {
            Ok(Self::Sfx(Box::new(FileBase::open(path, config)?)))
        }
    }

    pub fn quantizer(&self) -> &dyn ResidentQuantizer {
        match self {
            Self::Sfx(b) => &**b,
            Self::Gguf(b) => b,
        }
    }

    /// `params.quant` of the new container: the codes' own description.
    pub fn quant_params(&self) -> serde_json::Value {
        match self {
            Self::Sfx(b) => b.quant_params().clone(),
            Self::Gguf(b) => b.quant_params(),
        }
    }

    /// Other records carried over into the new container's `params`, `base` among them.
    pub fn extra_params(&self) -> BTreeMap<String, serde_json::Value> {
        match self {
            Self::Sfx(b) => {
                let mut p = b.extra_params();
                p.insert(
                    "base".into(),
                    serde_json::json!({ "refitted_from": b.digest() }),
                );
                p
            }
            Self::Gguf(b) => BTreeMap::from([(
                "base".into(),
                serde_json::json!({ "gguf_sha256": b.digest() }),
            )]),
        }
    }
}

/// Whether `path` starts with the GGUF magic (any read error: no).
pub fn is_gguf(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == sfx_formats::gguf::GGUF_MAGIC
}

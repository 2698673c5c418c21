//! A llama.cpp GGUF's own blocks as the resident base (`sfx-convert --quant gguf`).
//!
//! The base most llama.cpp users already own is a k-quant GGUF (Q2_K, Q3_K_M, Q4_K_M …). Its
//! projections are kept bit for bit — the container's `gguf_blocks` sections hold the GGUF's
//! block bytes, rows in Hugging Face order — and the refinement is fitted on the residual
//! R = W_float − dequant(W_gguf) against the float model the GGUF was made from. The runtime
//! then reads the same blocks it would read from the GGUF itself.
//!
//! Only the seven decoder projections come from the GGUF; norms, the embedding and the head
//! come from the float model (the head at `--head`'s format).

use super::file_base::{parse_projection, same_shape};
use super::InputStats;
use super::{QuantError, QuantizedSet, ResidentQuantizer, ResidentWeight, SetContext, WeightView};
use sfx_formats::checkpoint::Checkpoint;
use sfx_formats::gguf::{BlockTensor, GgmlType};
use sfx_formats::{FormatError, ModelConfig};
use sfx_runtime::ProjectionSet;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A GGUF file whose projection blocks serve as the base of a conversion.
pub struct GgufBase {
    path: PathBuf,
    /// `model.layers.{l}.{proj}.weight` → the weight's blocks.
    blocks: BTreeMap<String, BlockTensor>,
    sha256: String,
}

impl GgufBase {
    /// Reads the GGUF at `path` (every projection must be block-quantized) and checks that
    /// its model has `config`'s shape.
    pub fn open(path: &Path, config: &ModelConfig) -> Result<Self, FormatError> {
        let bad = |msg: String| FormatError::invalid(path, msg);
        // Kept: the types the residual can be computed for (their dequantized values).
        let ckpt = Checkpoint::from_gguf_keeping(path, GgmlType::is_decodable_block_type)?;
        if ckpt.blocks.is_empty() {
            return Err(bad(
                "no block-quantized weights: --quant gguf keeps a quantized GGUF's blocks \
                 (Q2_K … Q6_K, Q4_0 … Q8_0, the i-quants)"
                    .into(),
            ));
        }
        same_shape(path, &ckpt.config, config)?;
        let mut blocks = ckpt.blocks;
        blocks.retain(|name, _| {
            name.strip_suffix(".weight")
                .and_then(parse_projection)
                .is_some()
        });
        for l in 0..config.num_hidden_layers {
            for proj in ProjectionSet::ALL.iter().flat_map(|s| s.projections()) {
                let name = format!("model.layers.{l}.{proj}.weight");
                if !blocks.contains_key(&name) {
                    let found = ckpt
                        .tensors
                        .tensor(&name)
                        .map(|v| format!("{:?}", v.dtype))
                        .unwrap_or_else(|_| "missing".into());
                    return Err(bad(format!(
                        "{name} is not block-quantized in the GGUF ({found}); every \
                         projection must be, to be kept as the base"
                    )));
                }
            }
        }
        let sha256 = sfx_formats::package::sha256_file(path)?.sha256;
        Ok(Self {
            path: path.to_path_buf(),
            blocks,
            sha256,
        })
    }

    /// Projections per GGUF type name, e.g. `{"Q2_K": 60, "Q4_K": 30, …}`.
    pub fn type_counts(&self) -> BTreeMap<&'static str, usize> {
        let mut counts = BTreeMap::new();
        for t in self.blocks.values() {
            *counts.entry(t.ty.name()).or_insert(0) += 1;
        }
        counts
    }

    /// Bits per weight of the kept projections (block scales included).
    pub fn bits_per_weight(&self) -> f64 {
        let (bytes, weights) = self.blocks.values().fold((0usize, 0usize), |(b, w), t| {
            (b + t.bytes.len(), w + t.rows * t.cols)
        });
        bytes as f64 * 8.0 / weights.max(1) as f64
    }

    /// `params.quant` of the new container.
    pub fn quant_params(&self) -> serde_json::Value {
        serde_json::json!({
            "name": self.name(),
            "method": "gguf",
            "packing": sfx_runtime::sfx_model::PACKING_GGUF_BLOCKS_V1,
            "types": self.type_counts(),
            "bits_per_weight": self.bits_per_weight(),
            "gguf": self.path.file_name().map(|n| n.to_string_lossy().into_owned()),
            "gguf_sha256": self.sha256,
        })
    }

    /// The GGUF's sha256 (recorded as the new file's base).
    pub fn digest(&self) -> String {
        self.sha256.clone()
    }
}

impl ResidentQuantizer for GgufBase {
    fn name(&self) -> String {
        let types: Vec<&str> = self.type_counts().into_keys().collect();
        format!("gguf-{}", types.join("+"))
    }

    fn quantize_set(
        &self,
        weights: &[WeightView<'_>],
        _stats: Option<&InputStats>,
        _context: SetContext,
    ) -> Result<QuantizedSet, QuantError> {
        let weight = |v: &WeightView<'_>| {
            let t = self
                .blocks
                .get(&format!("{}.weight", v.name))
                .ok_or_else(|| QuantError::Base {
                    name: v.name.to_string(),
                    message: "not in the GGUF's blocks".into(),
                })?;
            if (t.rows, t.cols) != (v.rows, v.cols) {
                return Err(QuantError::Base {
                    name: v.name.to_string(),
                    message: format!(
                        "the GGUF's weight is [{}, {}], the float model's [{}, {}]",
                        t.rows, t.cols, v.rows, v.cols
                    ),
                });
            }
            Ok(ResidentWeight::Gguf(t.clone()))
        };
        Ok(QuantizedSet {
            weights: weights.iter().map(weight).collect::<Result<_, _>>()?,
            input_scales: None,
            info: BTreeMap::new(),
        })
    }
}

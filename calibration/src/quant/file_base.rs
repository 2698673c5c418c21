//! The resident codes of an existing container, kept bit for bit (`sfx-convert --base`).
//!
//! Quantizing is the slow part of a conversion (the trellis Viterbi search is ~50 min for
//! SmolLM2 on 2 cores, YAQA adds its Hessian sketch); fitting refinement is minutes. With the
//! base read from a file, a new refinement — another k ladder, λ, prior or calibration text —
//! is fitted against the float model's weights without quantizing again, and the residual
//! R = W − Ŵ is exactly the one the runtime will see.
//!
//! Files whose quantizer folded per-channel scales into the norms and into v / up rows (AWQ)
//! are refused: their codes act on `x / s`, and the float weights in that basis are not in
//! the file.

use super::InputStats;
use super::{QuantError, QuantizedSet, ResidentQuantizer, ResidentWeight, SetContext, WeightView};
use sfx_formats::sfx::{Layout, SfxFile};
use sfx_formats::{FormatError, ModelConfig};
use sfx_runtime::linear::{LinearRole, LinearSpec};
use sfx_runtime::{SfxLinearFactory, WeightPrecision};
use std::collections::BTreeMap;
use std::path::Path;

/// A container whose resident codes serve as the base of a new conversion.
pub struct FileBase {
    file: SfxFile,
    /// `params.quant` of the file (`name`, `method`, `bits`, …).
    quant: serde_json::Value,
}

impl FileBase {
    /// Opens `path`, verifies every section's checksum, and checks that it was converted from
    /// a model of `config`'s shape by a quantizer whose codes act on the unscaled input.
    pub fn open(path: &Path, config: &ModelConfig) -> Result<Self, FormatError> {
        let file = SfxFile::open(path)?;
        file.verify()?;
        let meta = file.metadata();
        let quant = meta.params.get("quant").cloned().ok_or_else(|| {
            FormatError::invalid(
                path,
                "no params.quant: not written by sfx-convert, so its resident format is unknown",
            )
        })?;
        let method = quant.get("method").and_then(|m| m.as_str()).unwrap_or("");
        if method == "awq" {
            return Err(FormatError::invalid(
                path,
                "params.quant.method is awq: AWQ folds per-channel scales into the norms and \
                 the v / up rows, so its codes cannot be re-fitted against the float weights; \
                 convert again with --quant awqN",
            ));
        }
        let Some(file_config) = &meta.config else {
            return Err(FormatError::invalid(
                path,
                "no model config in the metadata",
            ));
        };
        same_shape(path, file_config, config)?;
        Ok(Self { file, quant })
    }

    /// The file's `params.quant`, copied into the new container.
    pub fn quant_params(&self) -> &serde_json::Value {
        &self.quant
    }

    /// Other quantizer records of the file worth carrying over (YAQA's sketch).
    pub fn extra_params(&self) -> BTreeMap<String, serde_json::Value> {
        self.file
            .metadata()
            .params
            .iter()
            .filter(|(k, _)| k.as_str() == "yaqa")
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// The file's content digest (recorded as the new file's base).
    pub fn digest(&self) -> String {
        self.file.content_digest()
    }

    fn weight(&self, view: &WeightView<'_>) -> Result<ResidentWeight, QuantError> {
        let fail = |message: String| QuantError::Base {
            name: view.name.to_string(),
            message,
        };
        let (layer, role) = parse_projection(view.name)
            .ok_or_else(|| fail("not a decoder projection name".into()))?;
        let weight_name = format!("{}.weight", view.name);
        let spec = LinearSpec {
            layer: Some(layer),
            role,
            weight_name: &weight_name,
            bias_name: None,
            out_dim: view.rows,
            in_dim: view.cols,
        };
        let factory = SfxLinearFactory::new(&self.file, WeightPrecision::F32);
        let layout = self
            .file
            .section(&weight_name)
            .map_err(|e| fail(e.to_string()))?
            .layout;
        match layout {
            Layout::PackedCodes { .. } if factory.is_lut(&weight_name) => {
                factory.lut_quantized(&spec).map(ResidentWeight::Lut)
            }
            Layout::PackedCodes { .. } => factory.group_quantized(&spec).map(ResidentWeight::Group),
            Layout::TrellisTiles { .. } => factory
                .trellis_quantized(&spec)
                .map(ResidentWeight::Trellis),
            Layout::GgufBlocks { .. } => factory.gguf_blocks(&spec).map(ResidentWeight::Gguf),
            other => {
                return Err(fail(format!(
                    "section {weight_name} is {other:?}, not resident codes"
                )))
            }
        }
        .map_err(|e| fail(e.to_string()))
    }
}

/// An error naming `path` unless its model (`base`) has the float model's shape.
pub(crate) fn same_shape(
    path: &Path,
    base: &ModelConfig,
    float: &ModelConfig,
) -> Result<(), FormatError> {
    let shape = |c: &ModelConfig| {
        (
            c.hidden_size,
            c.intermediate_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.attention_bias,
        )
    };
    if shape(base) == shape(float) {
        return Ok(());
    }
    Err(FormatError::invalid(
        path,
        format!(
            "model shape (hidden, intermediate, layers, heads, kv heads, head dim, bias) {:?} \
             differs from the float model's {:?}",
            shape(base),
            shape(float)
        ),
    ))
}

/// `model.layers.{l}.{self_attn|mlp}.{x}_proj` → (l, role).
pub(crate) fn parse_projection(name: &str) -> Option<(usize, LinearRole)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, proj) = rest.split_once('.')?;
    let role = LinearRole::of_projection(proj)?;
    Some((layer.parse().ok()?, role))
}

impl ResidentQuantizer for FileBase {
    fn name(&self) -> String {
        self.quant
            .get("name")
            .and_then(|n| n.as_str())
            .unwrap_or("file")
            .to_string()
    }

    fn quantize_set(
        &self,
        weights: &[WeightView<'_>],
        _stats: Option<&InputStats>,
        _context: SetContext,
    ) -> Result<QuantizedSet, QuantError> {
        Ok(QuantizedSet {
            weights: weights
                .iter()
                .map(|v| self.weight(v))
                .collect::<Result<_, _>>()?,
            input_scales: None,
            info: BTreeMap::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn projection_names_parse() {
        assert_eq!(
            parse_projection("model.layers.12.mlp.down_proj"),
            Some((12, LinearRole::Down))
        );
        assert_eq!(
            parse_projection("model.layers.0.self_attn.k_proj"),
            Some((0, LinearRole::Key))
        );
        assert_eq!(parse_projection("model.layers.x.mlp.down_proj"), None);
        assert_eq!(parse_projection("lm_head"), None);
    }
}

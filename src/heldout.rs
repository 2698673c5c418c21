//! Held-out text against a float reference, shared by `sfx tune` and the conversion's quality
//! receipt: a `.sfx` file's tokenizer cuts a named text into scoring windows, and the float
//! model's predictions on them are computed once (on its own backend, reference numerics) and
//! kept as rows every candidate is compared with.

use crate::device::{with_backend, DeviceChoice, OnBackend};
use anyhow::{anyhow, bail, Context, Result};
use sfx_formats::checkpoint::Checkpoint;
use sfx_formats::sfx::SfxFile;
use sfx_runtime::eval::{reference_rows, window_parts, EvalPart, ModelScorer, ReferenceRow};
use sfx_runtime::resident::ResidentKernels;
use sfx_runtime::sfx_model::sfx_tokenizer_json;
use sfx_runtime::{Model, ModelOptions};
use std::path::Path;

/// Weights as stored (sfx-run's default), the default KV cache and step graphs.
pub fn scoring_options() -> ModelOptions {
    ModelOptions {
        precision: sfx_runtime::WeightPrecision::Native,
        ..ModelOptions::default()
    }
}

/// The first `windows` windows of `window` tokens of text `text` (`wiki`, `brown`,
/// `austen/<novel>` or a file), tokenized by `file`'s tokenizer; `flag` names the option in
/// errors. Fewer windows than asked is an error.
pub fn text_windows(
    file: &SfxFile,
    path: &Path,
    flag: &str,
    text: &str,
    window: usize,
    windows: usize,
) -> Result<Vec<EvalPart>> {
    let tok_json = sfx_tokenizer_json(file)
        .ok_or_else(|| anyhow!("{}: no tokenizer in the metadata", path.display()))?;
    let tokenizer = tokenizers::Tokenizer::from_bytes(tok_json.as_bytes())
        .map_err(|e| anyhow!("{}: tokenizer: {e}", path.display()))?;
    let assets = sfx_formats::corpus::assets_dir();
    let body = sfx_formats::corpus::load_named_text(&assets, text)
        .with_context(|| format!("{flag} {text}"))?;
    let ids = tokenizer
        .encode_fast(body.as_str(), false)
        .map_err(|e| anyhow!("{flag} {text}: tokenizing: {e}"))?
        .get_ids()
        .to_vec();
    let parts = window_parts(&ids, window, windows);
    if parts.len() < windows {
        bail!(
            "{flag} {text}: {} tokens hold {} windows of {window}, {windows} asked for",
            ids.len(),
            parts.len(),
        );
    }
    Ok(parts)
}

/// The float model `spec`'s KL rows on `parts`, computed on `device`.
pub fn float_reference_rows(
    device: DeviceChoice,
    spec: &str,
    parts: &[EvalPart],
) -> Result<Vec<Vec<ReferenceRow>>> {
    let capacity = parts.iter().map(|p| p.tokens.len()).max().unwrap_or(0);
    with_backend(
        device,
        ReferenceTask {
            spec,
            parts,
            capacity,
        },
    )
}

struct ReferenceTask<'a> {
    spec: &'a str,
    parts: &'a [EvalPart],
    capacity: usize,
}

impl OnBackend for ReferenceTask<'_> {
    type Output = Vec<Vec<ReferenceRow>>;
    fn run<B: ResidentKernels>(self, backend: B) -> Result<Self::Output> {
        let ckpt = Checkpoint::open(self.spec)
            .with_context(|| format!("{}: opening the float model", self.spec))?;
        let model = Model::load(
            backend.with_reference_numerics(),
            &ckpt.config,
            ckpt.tensors.as_ref(),
            &scoring_options(),
        )
        .with_context(|| format!("{}: loading the float model", self.spec))?;
        let mut scorer = ModelScorer::new(&model, self.capacity)?;
        Ok(reference_rows(self.parts, &mut scorer)?)
    }
}

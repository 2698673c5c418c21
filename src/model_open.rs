//! Opening a float checkpoint (Hugging Face folder, Hub id or GGUF file) as a runnable model.

use anyhow::{Context, Result};
use sfx_formats::checkpoint::Checkpoint;
use sfx_runtime::resident::{runs_in_blocks, GgufBlockFactory, ResidentKernels};
use sfx_runtime::{Model, ModelOptions};

/// Opens `spec` and loads it on `backend`. A GGUF file's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and
/// Q2_K–Q6_K weights stay in their blocks and run on the backend's block kernels (where it
/// has none, they are dequantized at load); other types are dequantized. The returned checkpoint keeps
/// config, tokenizer and provenance, not the weights.
pub fn load_checkpoint_model<B: ResidentKernels>(
    backend: B,
    spec: &str,
    options: &ModelOptions,
) -> Result<(Model<B>, Checkpoint)> {
    let mut ckpt = Checkpoint::open_keeping_blocks(spec, runs_in_blocks)
        .with_context(|| format!("opening model {spec}"))?;
    let factory = GgufBlockFactory {
        blocks: &ckpt.blocks,
        precision: options.precision,
    };
    let model = Model::load_with(
        backend,
        &ckpt.config,
        ckpt.tensors.as_ref(),
        &factory,
        options,
    )
    .with_context(|| format!("loading model {spec}"))?;
    // The model holds its own copy of the blocks.
    ckpt.blocks.clear();
    Ok((model, ckpt))
}

//! Running a decoder one block at a time over hidden states held on the host: the converter's
//! calibration pass (GPTQ/AWQ style). Only the block being processed has to be loaded, so
//! converting an 8B model needs one layer of weights plus the calibration activations in
//! memory, not the whole model.

use super::layer::{DecoderLayer, LayerScratch};
use super::rope::rope_cos_sin;
use super::validate_config;
use crate::backend::{Backend, RopeTable};
use crate::error::{Result, RuntimeError};
use crate::kv_cache::{FloatKvCache, KvShape};
use crate::linear::{check_shape, require, LinearFactory};
use crate::observe::ActivationObserver;
use sfx_formats::{ModelConfig, TensorSource};

/// Loads blocks on demand and runs one over one sequence's hidden states.
pub struct LayerwiseRunner<B: Backend> {
    backend: B,
    config: ModelConfig,
    inv_freq: Vec<f32>,
    eps: f32,
}

impl<B: Backend> LayerwiseRunner<B> {
    pub fn new(backend: B, config: &ModelConfig) -> Result<Self> {
        validate_config(config)?;
        Ok(Self {
            backend,
            inv_freq: config.rope_inv_freq().iter().map(|&f| f as f32).collect(),
            eps: config.rms_norm_eps as f32,
            config: config.clone(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Loads decoder block `layer` with projections built by `factory`.
    pub fn load_layer(
        &self,
        tensors: &dyn TensorSource,
        factory: &dyn LinearFactory<B>,
        layer: usize,
    ) -> Result<DecoderLayer<B>> {
        if layer >= self.config.num_hidden_layers {
            return Err(RuntimeError::Config(format!(
                "layer {layer} requested, the model has {}",
                self.config.num_hidden_layers
            )));
        }
        DecoderLayer::load(&self.backend, &self.config, tensors, factory, layer)
    }

    /// Embedding rows of `tokens` as f32, row-major `[tokens, hidden]`, decoded row by row
    /// (the whole table is never converted).
    pub fn embed(&self, tensors: &dyn TensorSource, tokens: &[u32]) -> Result<Vec<f32>> {
        let c = &self.config;
        let name = "model.embed_tokens.weight";
        let view = require(tensors, name, "token embedding")?;
        check_shape(name, view.shape, &[c.vocab_size, c.hidden_size])?;
        let row_bytes = c.hidden_size * view.dtype.size_in_bytes();
        let mut out = Vec::with_capacity(tokens.len() * c.hidden_size);
        for (index, &t) in tokens.iter().enumerate() {
            let row = t as usize;
            if row >= c.vocab_size {
                return Err(RuntimeError::TokenOutOfRange {
                    token: t,
                    index,
                    vocab: c.vocab_size,
                });
            }
            let bytes = &view.data[row * row_bytes..(row + 1) * row_bytes];
            let shape = [c.hidden_size];
            let row_view = sfx_formats::TensorView::new(name, view.dtype, &shape, bytes)?;
            out.extend(row_view.to_f32_vec());
        }
        Ok(out)
    }

    /// Runs `block` (decoder layer `layer`) over one sequence whose residual stream before the
    /// block is `hidden` (`[n, hidden_size]`, positions 0..n), replacing it with the stream
    /// after the block. `observer` sees the block's projection inputs exactly as in
    /// [`crate::Model::forward_observed`].
    pub fn forward_layer(
        &self,
        block: &DecoderLayer<B>,
        layer: usize,
        hidden: &mut [f32],
        observer: Option<&mut dyn ActivationObserver>,
    ) -> Result<()> {
        let c = &self.config;
        if hidden.is_empty() || !hidden.len().is_multiple_of(c.hidden_size) {
            return Err(RuntimeError::Config(format!(
                "hidden states of {} values are not [tokens, {}]",
                hidden.len(),
                c.hidden_size
            )));
        }
        let n = hidden.len() / c.hidden_size;
        let b = &self.backend;
        let mut observer = observer;
        b.run(|| {
            let shape = KvShape {
                layers: 1,
                ..KvShape::of(c)
            };
            let mut cache = FloatKvCache::new(b, shape, n)?;
            let mut h = b.upload(hidden)?;
            let (cos, sin) = rope_cos_sin(&self.inv_freq, 0, n);
            let rope = RopeTable {
                cos: b.upload(&cos)?,
                sin: b.upload(&sin)?,
                positions: n,
                half: self.inv_freq.len(),
            };
            let mut positions = b.alloc_index(n)?;
            b.write_index(&mut positions, &(0..n as u32).collect::<Vec<_>>())?;
            let mut scratch = LayerScratch::new(b, c, n)?;
            block.forward(
                b,
                c,
                self.eps,
                &rope,
                &positions,
                &mut h,
                n,
                &mut scratch,
                &mut cache,
                0,
                layer,
                &mut observer,
                &mut None,
            )?;
            b.download(&h, hidden)
        })
    }
}

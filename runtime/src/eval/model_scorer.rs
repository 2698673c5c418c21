//! [`Scorer`] for a [`Model`] with its own KV cache: how the evaluation drivers run the real
//! graph (prefill for windows, the decode path for long-context scoring).

use super::runner::Scorer;
use crate::backend::Backend;
use crate::error::RuntimeError;
use crate::kv_cache::KvCache;
use crate::model::{LogitsMode, Model};

pub struct ModelScorer<'m, B: Backend> {
    model: &'m Model<B>,
    cache: Box<dyn KvCache<B> + 'm>,
}

impl<'m, B: Backend> ModelScorer<'m, B> {
    /// A scorer whose cache holds up to `capacity` positions (the longest part evaluated).
    pub fn new(model: &'m Model<B>, capacity: usize) -> Result<Self, RuntimeError> {
        Ok(Self {
            model,
            cache: Box::new(model.new_cache(capacity)?),
        })
    }

    fn last_row(logits: crate::model::Logits) -> Result<Vec<f32>, RuntimeError> {
        let vocab = logits.vocab();
        let mut v = logits.into_vec();
        let rows = v.len() / vocab.max(1);
        if rows == 0 {
            return Err(RuntimeError::EmptyInput);
        }
        v.drain(..(rows - 1) * vocab);
        Ok(v)
    }
}

impl<B: Backend> Scorer for ModelScorer<'_, B> {
    type Error = RuntimeError;

    fn vocab_size(&self) -> usize {
        self.model.config().vocab_size
    }

    fn score_window(&mut self, tokens: &[u32]) -> Result<Vec<f32>, RuntimeError> {
        self.cache.clear();
        Ok(self
            .model
            .forward(tokens, self.cache.as_mut(), LogitsMode::All)?
            .into_vec())
    }

    fn prefill_last(&mut self, tokens: &[u32]) -> Result<Vec<f32>, RuntimeError> {
        self.cache.clear();
        Self::last_row(
            self.model
                .forward(tokens, self.cache.as_mut(), LogitsMode::Last)?,
        )
    }

    fn decode_step(&mut self, token: u32) -> Result<Vec<f32>, RuntimeError> {
        Self::last_row(
            self.model
                .forward(&[token], self.cache.as_mut(), LogitsMode::Last)?,
        )
    }
}

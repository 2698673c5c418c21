//! [`Scorer`] for a [`Model`] with its own KV cache: how the evaluation drivers run the real
//! graph (prefill for windows, the decode path for long-context scoring).

use super::runner::Scorer;
use crate::backend::Backend;
use crate::error::RuntimeError;
use crate::kv_cache::KvCache;
use crate::model::{LogitsMode, Model};
use crate::refine::Refiner;

pub struct ModelScorer<'m, B: Backend> {
    model: &'m Model<B>,
    cache: Box<dyn KvCache<B> + 'm>,
    /// Selective refinement applied on every forward, when present.
    refiner: Option<Refiner<B>>,
}

impl<'m, B: Backend> ModelScorer<'m, B> {
    /// A scorer whose cache holds up to `capacity` positions (the longest part evaluated).
    pub fn new(model: &'m Model<B>, capacity: usize) -> Result<Self, RuntimeError> {
        Ok(Self {
            model,
            cache: Box::new(model.new_cache(capacity)?),
            refiner: None,
        })
    }

    /// A scorer that runs every forward through `refiner`.
    pub fn with_refiner(
        model: &'m Model<B>,
        capacity: usize,
        refiner: Refiner<B>,
    ) -> Result<Self, RuntimeError> {
        let mut s = Self::new(model, capacity)?;
        s.refiner = Some(refiner);
        Ok(s)
    }

    pub fn refiner(&self) -> Option<&Refiner<B>> {
        self.refiner.as_ref()
    }

    pub fn into_refiner(self) -> Option<Refiner<B>> {
        self.refiner
    }

    fn forward(
        &mut self,
        tokens: &[u32],
        mode: LogitsMode,
    ) -> Result<crate::model::Logits, RuntimeError> {
        match self.refiner.as_mut() {
            Some(r) => self
                .model
                .forward_refined(tokens, self.cache.as_mut(), mode, r),
            None => self.model.forward(tokens, self.cache.as_mut(), mode),
        }
    }

    /// The last position's logits of a forward.
    pub(crate) fn last_row(logits: crate::model::Logits) -> Result<Vec<f32>, RuntimeError> {
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
        Ok(self.forward(tokens, LogitsMode::All)?.into_vec())
    }

    fn prefill_last(&mut self, tokens: &[u32]) -> Result<Vec<f32>, RuntimeError> {
        self.cache.clear();
        Self::last_row(self.forward(tokens, LogitsMode::Last)?)
    }

    fn decode_step(&mut self, token: u32) -> Result<Vec<f32>, RuntimeError> {
        Self::last_row(self.forward(&[token], LogitsMode::Last)?)
    }
}

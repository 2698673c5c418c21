//! Which positions get logits, and the f32 logits that come back.

/// Positions of a forward call whose logits are computed. The output head is the largest
/// matrix of small models (SmolLM2: 49152 × 576, 21 % of the weights), so generation asks
/// only for the last position and perplexity for the scored tail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsMode {
    /// Fill the cache only (prefill of context that is not scored).
    None,
    /// The last input position (generation).
    Last,
    /// The last `n` input positions (clamped to the input length).
    LastN(usize),
    /// Every input position (perplexity). Costs `n × vocab × 4` bytes of host memory
    /// (2048 × 49152: 400 MB); score long inputs in pieces or with `LastN`.
    All,
}

impl LogitsMode {
    /// Number of trailing positions of an `n_tokens` input that get logits.
    pub fn rows(self, n_tokens: usize) -> usize {
        match self {
            LogitsMode::None => 0,
            LogitsMode::Last => n_tokens.min(1),
            LogitsMode::LastN(k) => k.min(n_tokens),
            LogitsMode::All => n_tokens,
        }
    }
}

/// Row-major f32 logits `[rows, vocab]` for consecutive sequence positions.
#[derive(Debug, Clone, PartialEq)]
pub struct Logits {
    data: Vec<f32>,
    vocab: usize,
    first_position: usize,
}

impl Logits {
    pub(crate) fn new(data: Vec<f32>, vocab: usize, first_position: usize) -> Self {
        debug_assert!(vocab > 0 && data.len().is_multiple_of(vocab));
        Self {
            data,
            vocab,
            first_position,
        }
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }
    pub fn rows(&self) -> usize {
        self.data.len() / self.vocab.max(1)
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
    /// Sequence position (index in the KV cache) of row 0: the logits of row `i` predict the
    /// token at position `first_position() + i + 1`.
    pub fn first_position(&self) -> usize {
        self.first_position
    }
    pub fn row(&self, i: usize) -> Option<&[f32]> {
        self.data.get(i * self.vocab..(i + 1) * self.vocab)
    }
    /// The last row (the next-token distribution after the input).
    pub fn last(&self) -> Option<&[f32]> {
        self.rows().checked_sub(1).and_then(|i| self.row(i))
    }
    pub fn as_slice(&self) -> &[f32] {
        &self.data
    }
    pub fn into_vec(self) -> Vec<f32> {
        self.data
    }
}

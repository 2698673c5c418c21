//! Observing projection inputs during a forward pass (the calibration pass of the converter).
//!
//! [`Model::forward_observed`](crate::Model::forward_observed) calls an
//! [`ActivationObserver`] once per layer and [`ProjectionSet`] with the *input* of that set's
//! projections, downloaded to the host as row-major `[rows, in]` f32. The plain
//! [`Model::forward`](crate::Model::forward) passes no observer and pays one branch per set.

/// Projections that share one input (docs/method.md §2: each set has its own refinement budget).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ProjectionSet {
    /// q, k, v: input is the attention-normed hidden state (`hidden`).
    Qkv,
    /// o: input is the attention output (`q_dim`).
    O,
    /// gate, up: input is the MLP-normed hidden state (`hidden`).
    GateUp,
    /// down: input is `silu(gate) ⊙ up` (`intermediate_size`).
    Down,
}

impl ProjectionSet {
    pub const ALL: [ProjectionSet; 4] = [Self::Qkv, Self::O, Self::GateUp, Self::Down];

    /// Short name used in logs and metadata: `qkv`, `o`, `gu`, `d`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Qkv => "qkv",
            Self::O => "o",
            Self::GateUp => "gu",
            Self::Down => "d",
        }
    }

    /// Index in [`ProjectionSet::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The set's projections in graph order, as named under `model.layers.{i}.` (q, k, v
    /// order matters: AWQ folds o's scales into v, and sections are written in this order).
    pub fn projections(self) -> &'static [&'static str] {
        match self {
            Self::Qkv => &["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            Self::O => &["self_attn.o_proj"],
            Self::GateUp => &["mlp.gate_proj", "mlp.up_proj"],
            Self::Down => &["mlp.down_proj"],
        }
    }
}

/// Receives projection inputs during [`Model::forward_observed`](crate::Model::forward_observed).
pub trait ActivationObserver: Send {
    /// `x` is the input of `set` in decoder layer `layer`, row-major `[rows, x.len() / rows]`
    /// (one row per token of the current prefill chunk).
    fn observe(&mut self, layer: usize, set: ProjectionSet, x: &[f32], rows: usize);
}

/// Any `FnMut(layer, set, x, rows)` closure is an observer.
impl<F: FnMut(usize, ProjectionSet, &[f32], usize) + Send> ActivationObserver for F {
    fn observe(&mut self, layer: usize, set: ProjectionSet, x: &[f32], rows: usize) {
        self(layer, set, x, rows)
    }
}

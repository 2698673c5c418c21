//! Evaluation per the project's protocol (docs/results.md): perplexity over fixed windows,
//! long-context scoring through the decode path, and KL divergence to a reference model.
//! This module holds the model-independent arithmetic; the drivers that run a model live in
//! [`runner`].

pub mod kl;
pub mod kv_sweep;
pub mod model_scorer;
pub mod ppl;
pub mod runner;
pub mod spec;

pub use kl::{KlAccumulator, KlSummary, ReferenceRow};
pub use model_scorer::ModelScorer;
pub use ppl::{log_softmax_at, NllAccumulator, PplSummary};
pub use runner::{
    evaluate, evaluate_against, long_context_part, reference_rows, window_parts, EvalPart,
    EvalResult, PartResult, Scorer,
};
pub use spec::{EvalSpec, EvalSpecError};

//! StrataFlux runtime: the decoder graph, its backends and KV caches.
//!
//! - [`backend`]: the [`Backend`] trait (ops, resident buffers, device-side index buffers,
//!   step graphs), the CPU backend and the CUDA backend ([`backend::cuda`]).
//! - [`conformance`]: every op on every backend against a reference with a stated bound
//!   (`sfx test-backend`); [`synthetic`]: models of real shapes with random weights;
//!   [`bench`]: llama-bench-style pp/tg measurement.
//! - [`linear`]: the [`Linear`] interface every weight format implements; float linears.
//! - [`kv_cache`]: the [`KvCache`] interface and the f32 cache; [`kv`]: quantized KV (KVarN
//!   resident base, nested refinement, eq. 7 selection, eq. 8 correction).
//! - [`eval`]: perplexity / KL evaluation per the project protocol; [`sampling`], [`chat`].
//! - [`model`]: the Llama-family decoder ([`Model`]), logits selection.
//!
//! Data moves one way: `TensorSource` (sfx-formats) → resident matrices → ops → logits.

pub mod backend;
pub mod bench;
pub mod chat;
pub mod conformance;
pub mod error;
pub mod eval;
pub mod kv;
pub mod kv_cache;
pub mod linear;
pub mod model;
pub mod observe;
pub mod refine;
pub mod resident;
pub mod sampling;
pub mod sfx_model;
pub mod synthetic;
#[cfg(test)]
mod test_util;

pub use backend::cpu::{CpuBackend, SimdLevel};
pub use backend::{Backend, WeightPrecision};
pub use error::RuntimeError;
pub use kv_cache::{FloatKvCache, KvCache, KvShape};
pub use linear::{FloatLinear, FloatLinearFactory, Linear, LinearFactory, LinearRole, LinearSpec};
pub use model::{LayerwiseRunner, Logits, LogitsMode, Model, ModelOptions};
pub use observe::{ActivationObserver, ProjectionSet};
pub use sfx_model::{load_sfx_model, SfxLinearFactory, SfxTensors};

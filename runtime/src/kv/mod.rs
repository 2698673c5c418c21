//! Quantized KV caches (docs/method.md §5): a low-bit resident base (KVarN) with the first tokens
//! and the current partial tile in FP16, nested refinement bits in a backing tier (RAM, or an
//! SSD spill file behind a RAM cache), and per-step selection of the token groups that get
//! refined (eq. 7) with the exact attention correction of eq. 8.
//!
//! - [`base`]: the [`KvBase`] trait a resident tile format implements; [`kvarn`]: KVarN.
//! - [`bitpack`]: little-endian bit streams (codes, sub-interval indices).
//! - [`attend`]: decode-step attention over one KV head: scores, eq. 7 selection, eq. 8.
//! - [`tier`]: where refinement units live (RAM or SSD spill + cache).
//! - [`cache`]: [`QuantKvCache`], the [`crate::KvCache`] implementation tying them together.
//! - [`backend_cache`]: [`BackendKvarnCache`], the KVarN base alone with its rows, tiles and
//!   decode attention in the backend (device memory on CUDA).

pub mod attend;
pub mod backend_cache;
pub mod base;
pub mod bitpack;
pub mod cache;
pub mod kvarn;
pub mod spec;
pub mod tier;

pub use backend_cache::{new_quantized_cache, runs_in_backend, BackendKvarnCache};
pub use base::{KvBase, KvBits, RefineBits};
pub use cache::{KvBytes, KvCacheStats, QuantKvCache};
pub use kvarn::{Kvarn, KvarnRecordLayout};
pub use spec::{KvBaseChoice, KvConfig, KvRefineConfig, KvTierConfig};

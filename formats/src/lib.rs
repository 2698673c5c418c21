//! File formats: bytes in, typed tensors and configs out. Nothing here computes with a model.
//!
//! - [`tensor`]: the [`TensorSource`] boundary the runtime loads from.
//! - [`config`]: Hugging Face `config.json` → [`ModelConfig`].
//! - [`checkpoint`]: safetensors checkpoints (single or sharded, memory-mapped) and hub ids.
//! - [`gguf`]: llama.cpp GGUF reading, dequantization, tokenizer and HF-folder import.
//! - [`qtip`]: QTIP/YAQA prequantized checkpoints → trellis weights.
//! - [`corpus`]: the canonical evaluation and calibration texts.
//! - [`atomic`]: crash-safe file writes.
//! - [`tune`]: `sfx tune`'s per-machine tuning profiles (a sidecar next to the model).

pub mod atomic;
pub mod checkpoint;
pub mod config;
pub mod corpus;
pub mod error;
pub mod gguf;
pub mod package;
pub mod qtip;
pub mod resident;
pub mod sfx;
pub mod tensor;
pub mod tune;

pub use config::ModelConfig;
pub use error::FormatError;
pub use tensor::{DType, OwnedTensors, TensorSource, TensorView};

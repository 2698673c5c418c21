//! llama.cpp GGUF files: a validating memory-mapped reader, dequantization of the common
//! ggml types, the embedded tokenizer rebuilt as a Hugging Face tokenizer, and import of
//! llama/mistral/qwen2/qwen3 models as Hugging Face checkpoint folders.
//!
//! ```no_run
//! # fn main() -> Result<(), sfx_formats::gguf::GgufError> {
//! // A Hugging Face folder, streamed a chunk of one tensor at a time:
//! sfx_formats::gguf::import_gguf_to_folder("model.Q4_K_M.gguf", "model-hf", |done, total| {
//!     eprintln!("{done}/{total}")
//! })?;
//! // Or every tensor dequantized in memory, for a runtime:
//! let model = sfx_formats::gguf::import_gguf("model.Q4_K_M.gguf")?;
//! # Ok(()) }
//! ```

mod dequant;
mod error;
mod hf_folder;
mod imatrix;
mod import;
mod iq;
mod iq_grids;
mod reader;
mod tokenizer;

pub use dequant::{
    dequantize, dequantize_to_vec, k_scale_min, q3k_scales, GgmlType, DEQUANTIZABLE, QK_K,
};
pub use error::GgufError;
pub use hf_folder::{import_gguf_to_folder, import_gguf_to_folder_in_chunks, FolderImport};
pub use imatrix::{Imatrix, ImatrixError};
pub use import::{
    hf_tensor_name, import_from_gguf, import_gguf, import_gguf_keeping,
    llama3_rope_scaling_from_factors, unpermute_rows, BlockTensor, GgufArch, ImportedModel,
};
pub use reader::{
    GgufFile, GgufTensorInfo, MetaArray, MetaValue, ValueType, DEFAULT_ALIGNMENT, GGUF_MAGIC,
    MAX_ARRAY_DEPTH, MAX_DIMS,
};
pub use tokenizer::{token_type, tokenizer_from_gguf, GgufTokenizer, SpecialTokens};

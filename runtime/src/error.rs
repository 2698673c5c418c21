use sfx_formats::FormatError;

/// Errors from building or running a model. Every variant names the tensor, op or limit at
/// fault so a user can act on the message without a debugger.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error("tensor '{name}': expected shape {expected:?}, found {actual:?}")]
    TensorShape {
        name: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    #[error("tensor '{name}' is required ({why}) but the checkpoint does not contain it")]
    MissingTensor { name: String, why: String },
    #[error("token id {token} at input index {index} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange {
        token: u32,
        index: usize,
        vocab: usize,
    },
    #[error("forward was called with no tokens")]
    EmptyInput,
    #[error(
        "KV cache is full: {cached} cached + {new} new tokens exceed its capacity of {capacity} \
         (create the cache with a larger capacity or clear it)"
    )]
    CacheFull {
        cached: usize,
        new: usize,
        capacity: usize,
    },
    #[error("KV cache does not fit this model: {0}")]
    CacheMismatch(String),
    #[error("{op}: {msg}")]
    Shape { op: &'static str, msg: String },
    #[error("model config: {0}")]
    Config(String),
    #[error("{0}")]
    Unsupported(String),
    #[error("CUDA {op}: {msg}")]
    Cuda { op: &'static str, msg: String },
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

/// Rows of `row_len` elements in `len` (a buffer of whole rows), or which buffer is ragged.
pub(crate) fn check_rows(
    op: &'static str,
    what: &str,
    len: usize,
    row_len: usize,
) -> Result<usize> {
    if row_len == 0 || !len.is_multiple_of(row_len) {
        return Err(RuntimeError::Shape {
            op,
            msg: format!("{what} has {len} elements, not a multiple of the row length {row_len}"),
        });
    }
    Ok(len / row_len)
}

/// Shorthand for the length checks every op does before touching memory.
pub(crate) fn check_len(
    op: &'static str,
    what: &str,
    actual: usize,
    expected: usize,
) -> Result<()> {
    if actual == expected {
        Ok(())
    } else {
        Err(RuntimeError::Shape {
            op,
            msg: format!("{what} has {actual} elements, expected {expected}"),
        })
    }
}

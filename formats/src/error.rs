use std::path::PathBuf;

/// Errors from reading or writing model files. Every variant names the file, tensor or field
/// at fault so a user can act on the message.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("tensor '{0}' not found in the checkpoint")]
    MissingTensor(String),
    #[error("tensor '{tensor}': shape {shape:?} overflows the address space")]
    ShapeOverflow { tensor: String, shape: Vec<usize> },
    #[error(
        "tensor '{tensor}': expected {expected} bytes for its dtype and shape, found {actual}"
    )]
    TensorSize {
        tensor: String,
        expected: usize,
        actual: usize,
    },
    #[error("tensor '{tensor}': unsupported dtype {dtype} (supported: F32, F16, BF16)")]
    UnsupportedDType { tensor: String, dtype: String },
    #[error("{path}: invalid config: {msg}")]
    Config { path: PathBuf, msg: String },
    #[error("{path}: {msg}")]
    Invalid { path: PathBuf, msg: String },
    #[error("{0}")]
    Other(String),
}

impl FormatError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        FormatError::Io {
            path: path.into(),
            source,
        }
    }

    pub fn invalid(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        FormatError::Invalid {
            path: path.into(),
            msg: msg.into(),
        }
    }
}

//! Typed, borrowed views of checkpoint tensors: the boundary between file formats (which own
//! bytes) and the runtime (which builds kernels' weight layouts from them).

use crate::FormatError;

/// Element types a float checkpoint tensor may have once a file format has decoded it.
/// Quantized GGUF blocks are dequantized to `F32` before they cross this boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// The safetensors dtype tag, also used in error messages.
    pub fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
        }
    }
}

/// A tensor's bytes in little-endian row-major order, with its dtype and shape (outermost
/// dimension first, as in safetensors and PyTorch).
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

impl<'a> TensorView<'a> {
    /// Checks that shape and byte length agree without overflowing; every constructor of a
    /// view from untrusted bytes goes through this.
    pub fn new(
        name: &str,
        dtype: DType,
        shape: &'a [usize],
        data: &'a [u8],
    ) -> Result<Self, FormatError> {
        let expected = element_count(name, shape)?
            .checked_mul(dtype.size_in_bytes())
            .ok_or_else(|| FormatError::ShapeOverflow {
                tensor: name.to_string(),
                shape: shape.to_vec(),
            })?;
        if expected != data.len() {
            return Err(FormatError::TensorSize {
                tensor: name.to_string(),
                expected,
                actual: data.len(),
            });
        }
        Ok(Self { dtype, shape, data })
    }

    pub fn element_count(&self) -> usize {
        self.shape.iter().product()
    }

    /// Decodes to f32 (copying). Used where a kernel wants f32 (norm weights, biases) or for
    /// weights the runtime keeps as f32.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self.dtype {
            DType::F32 => self
                .data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            DType::F16 => self
                .data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            DType::BF16 => self
                .data
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        }
    }

    /// Decodes to bf16 bit patterns (copying). F32 inputs are rounded to nearest-even, as
    /// PyTorch's `.to(torch.bfloat16)` does.
    pub fn to_bf16_vec(&self) -> Vec<half::bf16> {
        match self.dtype {
            DType::BF16 => self
                .data
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]))
                .collect(),
            _ => self
                .to_f32_vec()
                .into_iter()
                .map(half::bf16::from_f32)
                .collect(),
        }
    }
}

/// Product of the dimensions, or an error naming the tensor when it overflows `usize`.
pub fn element_count(name: &str, shape: &[usize]) -> Result<usize, FormatError> {
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| FormatError::ShapeOverflow {
            tensor: name.to_string(),
            shape: shape.to_vec(),
        })
}

/// Anything that can hand out named float tensors: a memory-mapped safetensors checkpoint, a
/// GGUF file dequantized in memory, a `.sfx` container later. The runtime loads a model from
/// a `TensorSource` and a [`crate::config::ModelConfig`] and never sees the file format.
pub trait TensorSource: Send + Sync {
    /// All tensor names, sorted.
    fn tensor_names(&self) -> Vec<String>;
    fn tensor(&self, name: &str) -> Result<TensorView<'_>, FormatError>;
    fn contains(&self, name: &str) -> bool {
        self.tensor(name).is_ok()
    }
}

/// Tensors owned in memory (e.g. a dequantized GGUF). Stored as raw little-endian bytes so a
/// view is zero-copy.
#[derive(Debug, Default)]
pub struct OwnedTensors {
    tensors: std::collections::BTreeMap<String, OwnedTensor>,
}

#[derive(Debug)]
struct OwnedTensor {
    dtype: DType,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl OwnedTensors {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert_f32(&mut self, name: impl Into<String>, shape: Vec<usize>, values: &[f32]) {
        let data = bytemuck::cast_slice::<f32, u8>(values).to_vec();
        self.tensors.insert(
            name.into(),
            OwnedTensor {
                dtype: DType::F32,
                shape,
                data,
            },
        );
    }

    pub fn insert_raw(
        &mut self,
        name: impl Into<String>,
        dtype: DType,
        shape: Vec<usize>,
        data: Vec<u8>,
    ) -> Result<(), FormatError> {
        let name = name.into();
        TensorView::new(&name, dtype, &shape, &data)?;
        self.tensors
            .insert(name, OwnedTensor { dtype, shape, data });
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }
}

impl TensorSource for OwnedTensors {
    fn tensor_names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }

    fn tensor(&self, name: &str) -> Result<TensorView<'_>, FormatError> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| FormatError::MissingTensor(name.to_string()))?;
        Ok(TensorView {
            dtype: t.dtype,
            shape: &t.shape,
            data: &t.data,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn view_rejects_size_mismatch_and_overflow() {
        let data = [0u8; 6];
        assert!(matches!(
            TensorView::new("t", DType::F32, &[2], &data),
            Err(FormatError::TensorSize {
                expected: 8,
                actual: 6,
                ..
            })
        ));
        assert!(matches!(
            TensorView::new("t", DType::BF16, &[usize::MAX, 3], &data),
            Err(FormatError::ShapeOverflow { .. })
        ));
    }

    #[test]
    fn bf16_rounding_matches_round_to_nearest_even() {
        // 1 + 2^-8 is exactly halfway between two bf16 values; ties go to the even mantissa (1.0).
        let mut t = OwnedTensors::new();
        t.insert_f32("x", vec![2], &[1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0]);
        let v = t.tensor("x").unwrap().to_bf16_vec();
        assert_eq!(v[0].to_f32(), 1.0);
        assert_eq!(v[1].to_f32(), 1.0 + 4.0 / 256.0);
    }
}

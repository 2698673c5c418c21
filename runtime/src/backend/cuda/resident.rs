//! [`CudaResidentLinear`]: a coded projection (group codes or trellis tiles) resident on a CUDA
//! device. The codes live in a [`CudaMatrix`], so every projection op of the backend takes them
//! and the linear itself only routes `forward` / `forward_add` / `gather_rows` to those ops.

use super::{CudaBackend, CudaBuffer, CudaIndex, CudaMatrix};
use crate::backend::{Backend, MatmulOut};
use crate::error::Result;
use crate::linear::Linear;

/// A coded projection with an optional f32 bias, resident on a CUDA device.
pub struct CudaResidentLinear {
    pub(super) weight: CudaMatrix,
    pub(super) bias: Option<CudaBuffer>,
    /// Bytes of the host format (codes, scales, signs …) this was uploaded from.
    pub(super) host_bytes: usize,
    /// The format's short name for logs, e.g. `q4g128` or `qtip2-hyb-q9`.
    pub(super) format: String,
}

impl Linear<CudaBackend> for CudaResidentLinear {
    fn in_dim(&self) -> usize {
        self.weight.inner.cols
    }
    fn out_dim(&self) -> usize {
        self.weight.inner.rows
    }
    fn has_bias(&self) -> bool {
        self.bias.is_some()
    }
    fn forward(
        &self,
        backend: &CudaBackend,
        x: &CudaBuffer,
        m: usize,
        y: &mut CudaBuffer,
    ) -> Result<()> {
        backend.matmul_t(x, m, &self.weight, self.bias.as_ref(), y, MatmulOut::Store)
    }
    fn forward_add(
        &self,
        backend: &CudaBackend,
        x: &CudaBuffer,
        m: usize,
        acc: &mut CudaBuffer,
        _scratch: &mut CudaBuffer,
    ) -> Result<()> {
        let bias = self.bias.as_ref();
        backend.matmul_t(x, m, &self.weight, bias, acc, MatmulOut::Accumulate)
    }
    fn matrix_parts(&self) -> Option<(&CudaMatrix, Option<&CudaBuffer>)> {
        Some((&self.weight, self.bias.as_ref()))
    }
    fn gather_rows(
        &self,
        backend: &CudaBackend,
        tokens: &CudaIndex,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        backend.embedding(&self.weight, tokens, out)
    }
    fn resident_bytes(&self) -> usize {
        self.host_bytes + self.bias.as_ref().map_or(0, |b| 4 * b.len)
    }
    fn describe(&self) -> String {
        format!(
            "{} {}×{} (cuda){}",
            self.format,
            self.weight.inner.cols,
            self.weight.inner.rows,
            if self.bias.is_some() { " +bias" } else { "" }
        )
    }
}

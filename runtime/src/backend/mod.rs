//! The compute boundary. A [`Backend`] owns activation buffers and resident float weight
//! matrices and implements every op the decoder graph needs; the graph in [`crate::model`] is
//! written once against this trait.
//!
//! Following candle's `BackendStorage`/`BackendDevice` split, a new device (CUDA, Metal) is a
//! new module with its own `Buffer`/`Matrix` types and kernels, not an edit of the graph.
//! Quantized and refined linears are not backend ops: they implement [`crate::linear::Linear`]
//! for the backends they have kernels for.

pub mod cpu;

use crate::error::Result;
use sfx_formats::{DType, TensorView};

/// How a float checkpoint tensor is stored once resident.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightPrecision {
    /// Keep BF16 as BF16 and F32 as F32; F16 widens to F32 (BF16 would drop 3 mantissa bits).
    #[default]
    Native,
    /// Widen everything to F32 (exact path; 2× the memory of BF16).
    F32,
    /// Round everything to BF16 (nearest-even), as an exported BF16 checkpoint would have it.
    Bf16,
}

impl WeightPrecision {
    /// The resident dtype for a source tensor of dtype `src`.
    pub fn resident_dtype(self, src: DType) -> DType {
        match (self, src) {
            (WeightPrecision::F32, _) => DType::F32,
            (WeightPrecision::Bf16, _) => DType::BF16,
            (WeightPrecision::Native, DType::BF16) => DType::BF16,
            (WeightPrecision::Native, _) => DType::F32,
        }
    }
}

/// Layout of one layer's K or V cache buffer: `[kv_heads, capacity, head_dim]`, so that one KV
/// head's keys are one contiguous `[positions, head_dim]` matrix (what the per-head attention
/// GEMMs want).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub kv_heads: usize,
    pub head_dim: usize,
    pub capacity: usize,
}

impl KvLayout {
    pub fn buffer_len(&self) -> usize {
        self.kv_heads * self.capacity * self.head_dim
    }
}

/// Shape of one causal attention call: `n_queries` new tokens at positions
/// `past..past + n_queries` attend to cache positions `0..=their own position`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub n_heads: usize,
    pub kv: KvLayout,
    pub past: usize,
    pub n_queries: usize,
}

impl AttentionShape {
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.kv.head_dim
    }
    /// Query heads per KV head (grouped-query attention).
    pub fn group(&self) -> usize {
        self.n_heads / self.kv.kv_heads.max(1)
    }
}

/// Ops of the decoder graph. All activations are f32 row-major `[rows, cols]` buffers; the
/// buffer length carries the row count where a parameter does not.
///
/// Every op checks the lengths it is given and returns [`crate::RuntimeError::Shape`] rather
/// than panicking, so a graph bug surfaces as a message naming the op.
pub trait Backend: Send + Sync + Sized + 'static {
    /// An f32 activation buffer resident on the device.
    type Buffer: Send + Sync;
    /// A float weight matrix `[rows, cols]` resident on the device (BF16 or F32). Cloning
    /// shares storage, which is how tied embeddings avoid a second copy.
    type Matrix: Send + Sync + Clone;

    fn name(&self) -> String;

    /// Runs one whole forward pass. The CPU backend moves it onto a rayon worker so the ~200
    /// parallel ops of a decode step fork from inside the pool instead of handing off from an
    /// outside thread each time (measured: 9–15 % of decode time in context switches
    /// otherwise). A device backend can use it to bracket a command stream / graph capture.
    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    /// A zero-filled buffer of `len` f32 values.
    fn alloc(&self, len: usize) -> Result<Self::Buffer>;
    fn upload(&self, host: &[f32]) -> Result<Self::Buffer>;
    /// Copies the whole buffer to `out` (`out.len()` must equal the buffer length).
    fn download(&self, buf: &Self::Buffer, out: &mut [f32]) -> Result<()>;
    fn buffer_len(&self, buf: &Self::Buffer) -> usize;

    /// Makes a 2-D checkpoint tensor resident with the given precision policy.
    fn upload_matrix(
        &self,
        name: &str,
        view: &TensorView<'_>,
        precision: WeightPrecision,
    ) -> Result<Self::Matrix>;
    /// `(rows, cols)`; for a linear weight that is `(out_dim, in_dim)`.
    fn matrix_dims(&self, w: &Self::Matrix) -> (usize, usize);
    fn matrix_dtype(&self, w: &Self::Matrix) -> DType;

    /// `out[t] = table[tokens[t]]` (token ids must already be checked against the vocab).
    fn embedding(&self, table: &Self::Matrix, tokens: &[u32], out: &mut Self::Buffer)
        -> Result<()>;

    /// `y[m, rows] = x[m, cols] · wᵀ (+ bias)`: the float linear.
    fn matmul_t(
        &self,
        x: &Self::Buffer,
        m: usize,
        w: &Self::Matrix,
        bias: Option<&Self::Buffer>,
        y: &mut Self::Buffer,
    ) -> Result<()>;

    /// Row-wise RMSNorm (Zhang & Sennrich 2019, eq. 4): `out = x / sqrt(mean(x²) + eps) · w`;
    /// the row length is `weight`'s length.
    fn rms_norm(
        &self,
        x: &Self::Buffer,
        weight: &Self::Buffer,
        eps: f32,
        out: &mut Self::Buffer,
    ) -> Result<()>;
    /// In-place RMSNorm (Qwen3's per-head q/k norm: rows are heads).
    fn rms_norm_in_place(
        &self,
        x: &mut Self::Buffer,
        weight: &Self::Buffer,
        eps: f32,
    ) -> Result<()>;

    /// Rotary embedding, Hugging Face "rotate_half" pairing (i, i + head_dim/2), on
    /// `x[n_tokens, n_heads * head_dim]`. `cos`/`sin` are `[n_tokens, head_dim / 2]`.
    fn rope(
        &self,
        x: &mut Self::Buffer,
        n_heads: usize,
        head_dim: usize,
        cos: &Self::Buffer,
        sin: &Self::Buffer,
    ) -> Result<()>;

    /// Scatters `src[n, kv_heads * head_dim]` (token-major, as a projection produces it) into
    /// a `[kv_heads, capacity, head_dim]` cache buffer at positions `start..start + n`.
    fn write_kv(
        &self,
        src: &Self::Buffer,
        dst: &mut Self::Buffer,
        layout: KvLayout,
        start: usize,
    ) -> Result<()>;

    /// Causal grouped-query attention of `q[n_queries, n_heads * head_dim]` over cache
    /// buffers already holding positions `0..past + n_queries`; softmax scale 1/√head_dim.
    fn attention(
        &self,
        q: &Self::Buffer,
        k_cache: &Self::Buffer,
        v_cache: &Self::Buffer,
        shape: &AttentionShape,
        out: &mut Self::Buffer,
    ) -> Result<()>;

    /// SwiGLU (Shazeer 2020): `gate ← silu(gate) ⊙ up`.
    fn silu_mul(&self, gate: &mut Self::Buffer, up: &Self::Buffer) -> Result<()>;

    /// Residual add: `acc += x`.
    fn add_assign(&self, acc: &mut Self::Buffer, x: &Self::Buffer) -> Result<()>;

    /// Host copy of rows `first..first + out.len() / row_len` of `src[_, row_len]`. The
    /// refinement engine's selection and neuron-bundle math read activations through this
    /// (one token row at decode: a few KB).
    fn read_rows(
        &self,
        src: &Self::Buffer,
        row_len: usize,
        first: usize,
        out: &mut [f32],
    ) -> Result<()>;

    /// The refinement accumulate of method.md eq. 2 / 6:
    /// `y[row, e] += Σ_j weights[j] · level_j[e] · scales[e]` for `e < row_len`, where unit
    /// `j` is the `unit_bytes` bytes at `units[j · unit_bytes..]` holding 4-bit levels as
    /// `nibble − 8`, element `e` in byte `e / 2`, low nibble first (docs/format.md,
    /// `column_nibbles`). `scales` has `row_len` entries (per output row of the projection).
    #[allow(clippy::too_many_arguments)]
    fn add_nibble_units(
        &self,
        y: &mut Self::Buffer,
        row_len: usize,
        row: usize,
        units: &[u8],
        unit_bytes: usize,
        weights: &[f32],
        scales: &[f32],
    ) -> Result<()>;

    /// Copies rows `first..first + dst_rows` of `src[_, row_len]` into `dst`
    /// (selects the positions that need logits).
    fn copy_rows(
        &self,
        src: &Self::Buffer,
        row_len: usize,
        first: usize,
        dst: &mut Self::Buffer,
    ) -> Result<()>;
}

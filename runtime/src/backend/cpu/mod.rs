//! The CPU backend: f32 activations in `Vec`s, BF16/F32 weights, rayon for threads (the
//! global pool, so `RAYON_NUM_THREADS` applies) and run-time SIMD dispatch.

mod attention;
mod elementwise;
pub(crate) mod gemm;
pub mod math;
mod matvec;
mod refine_kernels;
mod scratch;
mod simd;

pub use simd::SimdLevel;

use crate::backend::{AttentionShape, Backend, KvLayout, WeightPrecision};
use crate::error::{check_len, Result, RuntimeError};
use sfx_formats::{DType, TensorView};
use std::sync::Arc;

/// Activations on the CPU: a plain f32 vector. Public so CPU-only kernels (quantized linears)
/// can read and write it directly.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CpuBuffer(pub Vec<f32>);

impl CpuBuffer {
    pub fn as_slice(&self) -> &[f32] {
        &self.0
    }
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.0
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Resident weight elements: BF16 kept as raw bits (widened by shifting), or F32.
#[derive(Debug)]
pub enum CpuWeights {
    Bf16(Vec<u16>),
    F32(Vec<f32>),
}

/// A row-major `[rows, cols]` weight matrix shared by reference count (tied embeddings).
#[derive(Debug, Clone)]
pub struct CpuMatrix {
    inner: Arc<CpuMatrixData>,
}

#[derive(Debug)]
struct CpuMatrixData {
    rows: usize,
    cols: usize,
    weights: CpuWeights,
}

impl CpuMatrix {
    /// Wraps weights; errors when the element count does not match `rows × cols`.
    pub fn new(rows: usize, cols: usize, weights: CpuWeights) -> Result<Self> {
        let len = match &weights {
            CpuWeights::Bf16(w) => w.len(),
            CpuWeights::F32(w) => w.len(),
        };
        let want = rows.checked_mul(cols).ok_or_else(|| RuntimeError::Shape {
            op: "CpuMatrix::new",
            msg: format!("{rows} × {cols} overflows"),
        })?;
        check_len("CpuMatrix::new", "weights", len, want)?;
        Ok(Self {
            inner: Arc::new(CpuMatrixData {
                rows,
                cols,
                weights,
            }),
        })
    }
    pub fn rows(&self) -> usize {
        self.inner.rows
    }
    pub fn cols(&self) -> usize {
        self.inner.cols
    }
    pub fn weights(&self) -> &CpuWeights {
        &self.inner.weights
    }
    pub fn dtype(&self) -> DType {
        match self.inner.weights {
            CpuWeights::Bf16(_) => DType::BF16,
            CpuWeights::F32(_) => DType::F32,
        }
    }
    pub fn size_in_bytes(&self) -> usize {
        self.rows() * self.cols() * self.dtype().size_in_bytes()
    }
}

/// CPU compute. Cheap to copy; holds only the SIMD tier its kernels dispatch to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuBackend {
    simd: SimdLevel,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

/// Token counts up to this use the matvec kernel once per token rather than a GEMM: at m ≤ 2
/// the GEMM's packing costs more than re-reading the weights.
const MATVEC_MAX_ROWS: usize = 2;

impl CpuBackend {
    /// The best SIMD tier of this CPU, lowered by `SFX_CPU_SIMD=scalar|avx2|avx512` if set
    /// (to test the fallbacks on a machine that has more; an unsupported value is ignored).
    pub fn new() -> Self {
        let detected = SimdLevel::detect();
        let simd = std::env::var("SFX_CPU_SIMD")
            .ok()
            .and_then(|s| SimdLevel::parse_supported(&s).ok())
            .map_or(detected, |l| l.min(detected));
        Self { simd }
    }

    /// A backend pinned to `simd`; errors if this CPU lacks it.
    pub fn with_simd(simd: SimdLevel) -> Result<Self> {
        if !simd.is_supported() {
            return Err(RuntimeError::Unsupported(format!(
                "this CPU does not support {} (best available: {})",
                simd.as_str(),
                SimdLevel::detect().as_str()
            )));
        }
        Ok(Self { simd })
    }

    pub fn simd(&self) -> SimdLevel {
        self.simd
    }
}

fn check_rows(op: &'static str, what: &str, len: usize, row_len: usize) -> Result<usize> {
    if row_len == 0 || !len.is_multiple_of(row_len) {
        return Err(RuntimeError::Shape {
            op,
            msg: format!("{what} has {len} elements, not a multiple of the row length {row_len}"),
        });
    }
    Ok(len / row_len)
}

impl Backend for CpuBackend {
    type Buffer = CpuBuffer;
    type Matrix = CpuMatrix;

    fn name(&self) -> String {
        format!(
            "cpu ({}, {} threads)",
            self.simd.as_str(),
            rayon::current_num_threads()
        )
    }

    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        // `scope` executes its closure on a worker of the global pool (blocking this thread).
        rayon::scope(|_| f())
    }

    fn alloc(&self, len: usize) -> Result<CpuBuffer> {
        Ok(CpuBuffer(vec![0.0; len]))
    }

    fn upload(&self, host: &[f32]) -> Result<CpuBuffer> {
        Ok(CpuBuffer(host.to_vec()))
    }

    fn download(&self, buf: &CpuBuffer, out: &mut [f32]) -> Result<()> {
        check_len("download", "destination", out.len(), buf.len())?;
        out.copy_from_slice(&buf.0);
        Ok(())
    }

    fn buffer_len(&self, buf: &CpuBuffer) -> usize {
        buf.len()
    }

    fn upload_matrix(
        &self,
        name: &str,
        view: &TensorView<'_>,
        precision: WeightPrecision,
    ) -> Result<CpuMatrix> {
        let &[rows, cols] = view.shape else {
            return Err(RuntimeError::Shape {
                op: "upload_matrix",
                msg: format!(
                    "tensor '{name}' has shape {:?}, expected 2 dimensions",
                    view.shape
                ),
            });
        };
        let weights = match precision.resident_dtype(view.dtype) {
            DType::BF16 => CpuWeights::Bf16(
                view.to_bf16_vec()
                    .into_iter()
                    .map(|v| v.to_bits())
                    .collect(),
            ),
            _ => CpuWeights::F32(view.to_f32_vec()),
        };
        CpuMatrix::new(rows, cols, weights)
    }

    fn matrix_dims(&self, w: &CpuMatrix) -> (usize, usize) {
        (w.rows(), w.cols())
    }

    fn matrix_dtype(&self, w: &CpuMatrix) -> DType {
        w.dtype()
    }

    fn embedding(&self, table: &CpuMatrix, tokens: &[u32], out: &mut CpuBuffer) -> Result<()> {
        let cols = table.cols();
        check_len("embedding", "output", out.len(), tokens.len() * cols)?;
        if cols == 0 {
            return Ok(());
        }
        if let Some(index) = tokens.iter().position(|&t| t as usize >= table.rows()) {
            return Err(RuntimeError::TokenOutOfRange {
                token: tokens[index],
                index,
                vocab: table.rows(),
            });
        }
        match table.weights() {
            CpuWeights::Bf16(w) => elementwise::embedding(w, cols, tokens, &mut out.0),
            CpuWeights::F32(w) => elementwise::embedding(w, cols, tokens, &mut out.0),
        }
        Ok(())
    }

    fn matmul_t(
        &self,
        x: &CpuBuffer,
        m: usize,
        w: &CpuMatrix,
        bias: Option<&CpuBuffer>,
        y: &mut CpuBuffer,
    ) -> Result<()> {
        let (rows, cols) = (w.rows(), w.cols());
        check_len("matmul_t", "input", x.len(), m * cols)?;
        check_len("matmul_t", "output", y.len(), m * rows)?;
        if let Some(b) = bias {
            check_len("matmul_t", "bias", b.len(), rows)?;
        }
        let (x, y) = (&x.0[..], &mut y.0[..]);
        if m <= MATVEC_MAX_ROWS {
            for (xr, yr) in x
                .chunks_exact(cols.max(1))
                .zip(y.chunks_exact_mut(rows.max(1)))
            {
                match w.weights() {
                    CpuWeights::Bf16(wv) => matvec::matvec(self.simd, wv, xr, yr),
                    CpuWeights::F32(wv) => matvec::matvec(self.simd, wv, xr, yr),
                }
            }
        } else {
            match w.weights() {
                CpuWeights::Bf16(wv) => gemm::matmul_t(x, m, wv, rows, y),
                CpuWeights::F32(wv) => gemm::matmul_t(x, m, wv, rows, y),
            }
        }
        if let Some(b) = bias {
            for yr in y.chunks_exact_mut(rows.max(1)) {
                for (v, bv) in yr.iter_mut().zip(&b.0) {
                    *v += bv;
                }
            }
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &CpuBuffer,
        weight: &CpuBuffer,
        eps: f32,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        check_rows("rms_norm", "input", x.len(), weight.len())?;
        check_len("rms_norm", "output", out.len(), x.len())?;
        elementwise::rms_norm(self.simd, &x.0, &weight.0, eps, &mut out.0);
        Ok(())
    }

    fn rms_norm_in_place(&self, x: &mut CpuBuffer, weight: &CpuBuffer, eps: f32) -> Result<()> {
        check_rows("rms_norm_in_place", "input", x.len(), weight.len())?;
        elementwise::rms_norm_in_place(self.simd, &mut x.0, &weight.0, eps);
        Ok(())
    }

    fn rope(
        &self,
        x: &mut CpuBuffer,
        n_heads: usize,
        head_dim: usize,
        cos: &CpuBuffer,
        sin: &CpuBuffer,
    ) -> Result<()> {
        if !head_dim.is_multiple_of(2) {
            return Err(RuntimeError::Shape {
                op: "rope",
                msg: format!("head_dim {head_dim} is odd"),
            });
        }
        let n = check_rows("rope", "input", x.len(), n_heads * head_dim)?;
        check_len("rope", "cos", cos.len(), n * head_dim / 2)?;
        check_len("rope", "sin", sin.len(), n * head_dim / 2)?;
        elementwise::rope(self.simd, &mut x.0, n_heads, head_dim, &cos.0, &sin.0);
        Ok(())
    }

    fn write_kv(
        &self,
        src: &CpuBuffer,
        dst: &mut CpuBuffer,
        layout: KvLayout,
        start: usize,
    ) -> Result<()> {
        let n = check_rows(
            "write_kv",
            "source",
            src.len(),
            layout.kv_heads * layout.head_dim,
        )?;
        check_len("write_kv", "cache", dst.len(), layout.buffer_len())?;
        if start + n > layout.capacity {
            return Err(RuntimeError::Shape {
                op: "write_kv",
                msg: format!(
                    "positions {start}..{} exceed capacity {}",
                    start + n,
                    layout.capacity
                ),
            });
        }
        elementwise::write_kv(&src.0, &mut dst.0, layout, start);
        Ok(())
    }

    fn attention(
        &self,
        q: &CpuBuffer,
        k_cache: &CpuBuffer,
        v_cache: &CpuBuffer,
        shape: &AttentionShape,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        let s = shape;
        if s.kv.head_dim == 0 {
            return Err(RuntimeError::Shape {
                op: "attention",
                msg: "head_dim is 0".into(),
            });
        }
        if s.kv.kv_heads == 0 || !s.n_heads.is_multiple_of(s.kv.kv_heads) {
            return Err(RuntimeError::Shape {
                op: "attention",
                msg: format!(
                    "{} query heads are not a multiple of {} KV heads",
                    s.n_heads, s.kv.kv_heads
                ),
            });
        }
        if s.past + s.n_queries > s.kv.capacity {
            return Err(RuntimeError::Shape {
                op: "attention",
                msg: format!(
                    "{} positions exceed cache capacity {}",
                    s.past + s.n_queries,
                    s.kv.capacity
                ),
            });
        }
        check_len("attention", "queries", q.len(), s.n_queries * s.q_dim())?;
        check_len("attention", "output", out.len(), s.n_queries * s.q_dim())?;
        check_len("attention", "key cache", k_cache.len(), s.kv.buffer_len())?;
        check_len("attention", "value cache", v_cache.len(), s.kv.buffer_len())?;
        attention::attention(self.simd, &q.0, &k_cache.0, &v_cache.0, s, &mut out.0);
        Ok(())
    }

    fn silu_mul(&self, gate: &mut CpuBuffer, up: &CpuBuffer) -> Result<()> {
        check_len("silu_mul", "up", up.len(), gate.len())?;
        elementwise::silu_mul(self.simd, &mut gate.0, &up.0);
        Ok(())
    }

    fn add_assign(&self, acc: &mut CpuBuffer, x: &CpuBuffer) -> Result<()> {
        check_len("add_assign", "addend", x.len(), acc.len())?;
        elementwise::add_assign(&mut acc.0, &x.0);
        Ok(())
    }

    fn read_rows(
        &self,
        src: &CpuBuffer,
        row_len: usize,
        first: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let n = check_rows("read_rows", "destination", out.len(), row_len)?;
        let end = (first + n) * row_len;
        if end > src.len() {
            return Err(RuntimeError::Shape {
                op: "read_rows",
                msg: format!("rows {first}..{} exceed the source", first + n),
            });
        }
        out.copy_from_slice(&src.0[first * row_len..end]);
        Ok(())
    }

    fn add_nibble_units(
        &self,
        y: &mut CpuBuffer,
        row_len: usize,
        row: usize,
        units: &[u8],
        unit_bytes: usize,
        weights: &[f32],
        scales: &[f32],
    ) -> Result<()> {
        let bad = |msg: String| {
            Err(RuntimeError::Shape {
                op: "add_nibble_units",
                msg,
            })
        };
        if unit_bytes < row_len.div_ceil(2) || units.len() != weights.len() * unit_bytes {
            return bad(format!(
                "{} bytes of units of {unit_bytes} bytes for {} weights and rows of {row_len}",
                units.len(),
                weights.len()
            ));
        }
        if scales.len() != row_len || (row + 1) * row_len > y.len() {
            return bad(format!(
                "{} scales, row {row} of {row_len} in a buffer of {}",
                scales.len(),
                y.len()
            ));
        }
        let out = &mut y.0[row * row_len..(row + 1) * row_len];
        refine_kernels::add_nibble_units(out, units, unit_bytes, weights, scales);
        Ok(())
    }

    fn copy_rows(
        &self,
        src: &CpuBuffer,
        row_len: usize,
        first: usize,
        dst: &mut CpuBuffer,
    ) -> Result<()> {
        let n = check_rows("copy_rows", "destination", dst.len(), row_len)?;
        let end = (first + n) * row_len;
        if end > src.len() {
            return Err(RuntimeError::Shape {
                op: "copy_rows",
                msg: format!(
                    "rows {first}..{} exceed the source's {} rows",
                    first + n,
                    src.len() / row_len
                ),
            });
        }
        dst.0.copy_from_slice(&src.0[first * row_len..end]);
        Ok(())
    }
}

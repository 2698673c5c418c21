//! Resident (fast-tier) quantized linears, one file per format (mistral.rs `QuantMethod`
//! layout). Each implements [`crate::Linear`] for the backends it has kernels for and comes
//! with a [`crate::LinearFactory`] so a whole model loads with it.
//!
//! - [`group`]: group-wise asymmetric integer weights (`sfx_formats::resident::GroupQuantized`,
//!   RTN / AWQ codes) — CPU decode matvec unpacking codes on the fly, dequantized-panel GEMM
//!   for prefill, and [`RtnFactory`] quantizing every projection at load.
//! - [`hadamard`], [`trellis`]: QTIP's rotations and bitshift-trellis codes / Viterbi.
//! - [`trellis_linear`]: trellis-coded weights (`TrellisQuantized`, QTIP / YAQA) — decode
//!   matvec decoding tiles on the fly between the input and output Hadamard transforms.
//! - [`gguf_blocks`]: a llama.cpp GGUF's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and Q2_K–Q6_K weights run
//!   in their own blocks (CPU; CUDA dequantizes them at load).
//!
//! On the CPU, coded projections' decode matvecs take int8 activation blocks when the backend
//! asks for them (`CpuBackend::with_decode_activations`; the tools' default): integer dot
//! products per 32 inputs (`group_q8`, `gguf_blocks_kernel`, `gguf_kquant_kernel`), f32
//! otherwise.
//!
//! On CUDA both formats run through `backend::cuda::CudaResidentLinear` (the backend's own
//! kernels over the same codes).

pub mod gguf_blocks;
mod gguf_blocks_kernel;
mod gguf_kquant_kernel;
pub mod group;
mod group_q8;
pub mod hadamard;
pub mod lut;
pub mod trellis;
pub mod trellis_kernel;
pub mod trellis_linear;
mod viterbi_kernel;

pub use gguf_blocks::{
    runs_in_blocks, GgufBlockFactory, GgufBlockLinear, GgufWeight, KQuantBlocks, LegacyBlocks,
};
pub use group::{GroupQuantLinear, RtnFactory};
pub use lut::LutLinear;
pub use trellis_linear::{dequantize_trellis, TrellisLinear};

use crate::backend::cpu::{CpuBackend, DecodeActivations, SimdLevel};
use crate::backend::cuda::CudaBackend;
use crate::backend::Backend;
use crate::error::Result;
use crate::linear::Linear;
use sfx_formats::gguf::BlockTensor;
use sfx_formats::resident::{GroupQuantized, LutQuantized, TrellisQuantized};

/// Which resident formats a backend has kernels for: the `.sfx` loader builds each projection
/// through this, so a format missing on a backend is one clear error at load, naming the
/// format and the projection, not a failure mid-run.
pub trait ResidentKernels: Backend {
    /// A group-quantized projection (RTN / AWQ codes) resident on this backend; `what` names
    /// it for errors.
    fn group_linear(
        &self,
        q: GroupQuantized,
        bias: Option<Vec<f32>>,
        what: &str,
    ) -> Result<Box<dyn Linear<Self>>>;
    /// A trellis-coded projection (QTIP / YAQA tiles).
    fn trellis_linear(
        &self,
        q: TrellisQuantized,
        bias: Option<Vec<f32>>,
        what: &str,
    ) -> Result<Box<dyn Linear<Self>>>;
    /// A GGUF weight in its own blocks, or `None` where this backend has no kernels for
    /// `t`'s type (the caller then dequantizes it).
    fn gguf_block_linear(
        &self,
        t: &BlockTensor,
        bias: Option<Vec<f32>>,
        what: &str,
    ) -> Result<Option<Box<dyn Linear<Self>>>>;
    /// A look-up-table-coded projection (SqueezeLLM codes), or `None` where this backend has
    /// no kernels for it (the caller then dequantizes it).
    fn lut_linear(
        &self,
        q: &LutQuantized,
        bias: Option<Vec<f32>>,
        what: &str,
    ) -> Result<Option<Box<dyn Linear<Self>>>>;
}

/// A float linear holding `values` (row-major `[rows, cols]`) at `precision`: how a backend
/// without kernels for a coded format still runs it.
pub fn float_linear_of<B: Backend>(
    backend: &B,
    values: &[f32],
    (rows, cols): (usize, usize),
    bias: Option<&[f32]>,
    precision: crate::backend::WeightPrecision,
    name: &str,
) -> Result<crate::linear::FloatLinear<B>> {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let shape = [rows, cols];
    let view = sfx_formats::TensorView::new(name, sfx_formats::DType::F32, &shape, &bytes)
        .map_err(|e| crate::RuntimeError::Shape {
            op: "float_linear_of",
            msg: e.to_string(),
        })?;
    let weight = backend.upload_matrix(name, &view, precision)?;
    crate::linear::FloatLinear::new(backend, weight, bias)
}

/// `q` on the backend's look-up-table kernels, or dequantized at `precision` where it has
/// none.
pub fn lut_or_dequantized<B: ResidentKernels>(
    backend: &B,
    q: &LutQuantized,
    bias: Option<Vec<f32>>,
    precision: crate::backend::WeightPrecision,
    name: &str,
) -> Result<Box<dyn Linear<B>>> {
    match backend.lut_linear(q, bias.clone(), name)? {
        Some(linear) => Ok(linear),
        None => Ok(Box::new(float_linear_of(
            backend,
            &q.dequantize(),
            (q.rows(), q.cols()),
            bias.as_deref(),
            precision,
            name,
        )?)),
    }
}

/// A CPU coded projection's `forward`: with `m ≤ 2` tokens, one decode matvec per token —
/// `int8(x, y)` when the backend decodes with int8 activations and the kernels take the
/// shape (it returns `None` otherwise), else `exact(x, y)` with f32 activations — and with
/// more tokens `prefill(x, m, y)`; then the bias.
#[allow(clippy::too_many_arguments)]
pub(crate) fn coded_forward(
    op: &'static str,
    backend: &CpuBackend,
    (x, m, y): (
        &crate::backend::cpu::CpuBuffer,
        usize,
        &mut crate::backend::cpu::CpuBuffer,
    ),
    (rows, cols): (usize, usize),
    bias: Option<&[f32]>,
    int8: impl Fn(SimdLevel, &[f32], &mut [f32]) -> Option<()>,
    exact: impl Fn(SimdLevel, &[f32], &mut [f32]),
    prefill: impl FnOnce(&[f32], usize, &mut [f32]),
) -> Result<()> {
    crate::error::check_len(op, "input", x.len(), m * cols)?;
    crate::error::check_len(op, "output", y.len(), m * rows)?;
    if m == 0 {
        return Ok(());
    }
    let (x, y) = (x.as_slice(), y.as_mut_slice());
    if m <= DECODE_MAX_TOKENS {
        let level = backend.simd();
        let use_int8 = backend.decode_activations() == DecodeActivations::Int8;
        for (xr, yr) in x.chunks_exact(cols).zip(y.chunks_exact_mut(rows)) {
            if !use_int8 || int8(level, xr, yr).is_none() {
                exact(level, xr, yr);
            }
        }
    } else {
        prefill(x, m, y);
    }
    add_bias(y, rows, bias);
    Ok(())
}

/// Token counts up to this run a coded projection's decode matvec once per token.
const DECODE_MAX_TOKENS: usize = 2;

/// Below this many weight bytes a CPU decode matvec stays on one thread (a fork/join costs a
/// few µs).
const MIN_PARALLEL_BYTES: usize = 32 * 1024;

/// Runs `block(first_row, outputs)` over `y` in ~4 row blocks per thread of the decode pool, or
/// on the calling thread for a matrix of fewer than [`MIN_PARALLEL_BYTES`] weight bytes.
pub(crate) fn run_row_blocks(
    weight_bytes: usize,
    y: &mut [f32],
    block: impl Fn(usize, &mut [f32]) + Sync,
) {
    let pool = crate::backend::cpu::spin_pool::pool();
    let threads = pool.threads();
    if weight_bytes < MIN_PARALLEL_BYTES || threads == 1 {
        block(0, y);
        return;
    }
    let per_task = y.len().div_ceil(threads * 4).max(1);
    pool.for_each_chunk_mut(y, per_task, |b, yb| block(b * per_task, yb));
}

/// `y[t, :] += bias` for every token row of a CPU projection's output.
pub(crate) fn add_bias(y: &mut [f32], rows: usize, bias: Option<&[f32]>) {
    if let Some(b) = bias {
        for yr in y.chunks_exact_mut(rows) {
            for (v, bv) in yr.iter_mut().zip(b) {
                *v += bv;
            }
        }
    }
}

/// A coded table's rows for `tokens` (an embedding gather): `decode_row(r, out)` writes row
/// `r` as f32 values; an id ≥ `rows` is [`crate::RuntimeError::TokenOutOfRange`].
pub(crate) fn gather_decoded_rows(
    tokens: &crate::backend::cpu::CpuIndex,
    out: &mut crate::backend::cpu::CpuBuffer,
    rows: usize,
    cols: usize,
    decode_row: impl Fn(usize, &mut [f32]),
) -> Result<()> {
    let tokens = &tokens.0[..];
    crate::error::check_len("embedding", "output", out.len(), tokens.len() * cols)?;
    if let Some(index) = tokens.iter().position(|&t| t as usize >= rows) {
        return Err(crate::RuntimeError::TokenOutOfRange {
            token: tokens[index],
            index,
            vocab: rows,
        });
    }
    for (&t, row) in tokens.iter().zip(out.as_mut_slice().chunks_exact_mut(cols)) {
        decode_row(t as usize, row);
    }
    Ok(())
}

impl ResidentKernels for CpuBackend {
    fn group_linear(
        &self,
        q: GroupQuantized,
        bias: Option<Vec<f32>>,
        _what: &str,
    ) -> Result<Box<dyn Linear<Self>>> {
        Ok(Box::new(GroupQuantLinear::new(q, bias)?))
    }
    fn trellis_linear(
        &self,
        q: TrellisQuantized,
        bias: Option<Vec<f32>>,
        _what: &str,
    ) -> Result<Box<dyn Linear<Self>>> {
        Ok(Box::new(TrellisLinear::new(q, bias)?))
    }
    fn gguf_block_linear(
        &self,
        t: &BlockTensor,
        bias: Option<Vec<f32>>,
        _what: &str,
    ) -> Result<Option<Box<dyn Linear<Self>>>> {
        match GgufWeight::from_gguf(t)? {
            Some(w) => Ok(Some(Box::new(GgufBlockLinear::new(w, bias)?))),
            None => Ok(None),
        }
    }
    fn lut_linear(
        &self,
        q: &LutQuantized,
        bias: Option<Vec<f32>>,
        _what: &str,
    ) -> Result<Option<Box<dyn Linear<Self>>>> {
        Ok(Some(Box::new(LutLinear::new(q.clone(), bias)?)))
    }
}

impl ResidentKernels for CudaBackend {
    fn group_linear(
        &self,
        q: GroupQuantized,
        bias: Option<Vec<f32>>,
        what: &str,
    ) -> Result<Box<dyn Linear<Self>>> {
        Ok(Box::new(self.upload_group_linear(
            &q,
            bias.as_deref(),
            what,
        )?))
    }
    fn trellis_linear(
        &self,
        q: TrellisQuantized,
        bias: Option<Vec<f32>>,
        what: &str,
    ) -> Result<Box<dyn Linear<Self>>> {
        Ok(Box::new(self.upload_trellis_linear(
            &q,
            bias.as_deref(),
            what,
        )?))
    }
    /// The legacy blocks and the K-quants run in their blocks (`None`, dequantized at load:
    /// the i-quants and float types).
    fn gguf_block_linear(
        &self,
        t: &BlockTensor,
        bias: Option<Vec<f32>>,
        what: &str,
    ) -> Result<Option<Box<dyn Linear<Self>>>> {
        Ok(self
            .upload_gguf_linear(t, bias.as_deref(), what)?
            .map(|l| Box::new(l) as Box<dyn Linear<Self>>))
    }
    fn lut_linear(
        &self,
        q: &LutQuantized,
        bias: Option<Vec<f32>>,
        what: &str,
    ) -> Result<Option<Box<dyn Linear<Self>>>> {
        Ok(Some(Box::new(self.upload_lut_linear(
            q,
            bias.as_deref(),
            what,
        )?)))
    }
}

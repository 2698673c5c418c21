//! [`GgufBlockLinear`]: a llama.cpp GGUF weight run in its own blocks — the legacy 32-weight
//! blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the K-quant super-blocks (Q2_K … Q6_K). No f32
//! copy of the matrix is made at load; the bytes held equal the file's.
//!
//! - Legacy blocks are split into arrays at load ([`LegacyBlocks`]: codes, fifth bits, f16
//!   scales and minimums), so the kernels read 16 blocks' scales in one load.
//! - K-quant super-blocks stay as the file lays them out ([`KQuantBlocks`]); their kernels
//!   decode scales per super-block.
//! - Decode (m ≤ 2) with int8 activations (the CPU tools' default): integer dots
//!   (`gguf_blocks_kernel`, `gguf_kquant_kernel`), as llama.cpp runs these files.
//! - Decode with f32 activations (the reference numerics), and on machines without AVX-512
//!   VNNI: blocks dequantized on the fly into f32 dots.
//! - Prefill: panels of rows dequantized into faer's f32 GEMM, as the group codes do.
//! - A tied embedding gathers its rows from the same blocks.
//!
//! Other GGUF types (F16, BF16, F32, the i-quants IQ4_NL … IQ3_S) are dequantized at load.

use crate::backend::cpu::gemm::matmul_t_panels;
use crate::backend::cpu::math::dot;
use crate::backend::cpu::{CpuBackend, CpuBuffer, CpuIndex, SimdLevel};
use crate::backend::{Backend, WeightPrecision};
use crate::error::{check_len, Result, RuntimeError};
use crate::linear::{load_bias, FloatLinear, Linear, LinearFactory, LinearSpec};
use crate::resident::gguf_blocks_kernel::{self as kernel, BlockRows, CodeLayout, Prepared};
use crate::resident::gguf_kquant_kernel as kquant;
use crate::resident::{coded_forward, gather_decoded_rows, run_row_blocks, ResidentKernels};
use half::f16;
use sfx_formats::gguf::{dequantize, BlockTensor, GgmlType, QK_K};
use sfx_formats::TensorSource;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Weights per block.
const BLOCK: usize = 32;

/// The GGUF types the CPU runs in their own blocks: the legacy 32-weight blocks, then the
/// K-quants.
pub const BLOCK_TYPES: [GgmlType; 10] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// Whether a GGUF weight of type `ty` runs in its blocks on the CPU.
pub fn runs_in_blocks(ty: GgmlType) -> bool {
    BLOCK_TYPES.contains(&ty)
}

/// Byte offsets in a block of `ty` of its f16 scale and, for the types with one, its f16
/// minimum (`m` of Q4_1/Q5_1, `dmin` of Q2_K/Q4_K/Q5_K).
fn scale_offsets(ty: GgmlType) -> (usize, Option<usize>) {
    match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => (0, Some(2)),
        GgmlType::Q2K => (80, Some(82)),
        GgmlType::Q3K => (108, None),
        GgmlType::Q6K => (208, None),
        _ => (0, None),
    }
}

/// Writes `scale()`'s (scale, minimum) into the f16 fields of every `ty` block in `bytes`
/// (the minimum only where the type has one): random code bytes plus this make valid blocks
/// for tests and conformance cases.
pub(crate) fn set_block_scales(
    ty: GgmlType,
    bytes: &mut [u8],
    mut scale: impl FnMut() -> (f32, f32),
) {
    let (d_at, min_at) = scale_offsets(ty);
    for blk in bytes.chunks_exact_mut(ty.type_size()) {
        let (d, min) = scale();
        blk[d_at..d_at + 2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
        if let Some(at) = min_at {
            blk[at..at + 2].copy_from_slice(&f16::from_f32(min).to_le_bytes());
        }
    }
}

/// Writes scales into every `ty` block of `bytes` (random code bytes, every bit pattern a
/// valid code) for a matrix of `cols` columns: f16 scales giving weights of variance ≈ 1/cols
/// (each times `1 + jitter()`), and minimums that centre the codes near 0. Conformance cases
/// and synthetic models are made so.
pub(crate) fn scale_random_blocks(
    ty: GgmlType,
    bytes: &mut [u8],
    cols: usize,
    mut jitter: impl FnMut() -> f32,
) {
    // Codes span ~2^bits levels, times the K-quants' sub-block scales (random codes too: 4-bit
    // ones average 7.5, 6-bit ones 31.5, Q6_K's signed bytes ~64): one step ≈ 2/(levels·√cols).
    let (levels, sub) = match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => (16.0, 1.0),
        GgmlType::Q5_0 | GgmlType::Q5_1 => (32.0, 1.0),
        GgmlType::Q4K => (16.0, 32.0),
        GgmlType::Q5K => (32.0, 32.0),
        GgmlType::Q8_0 | GgmlType::IQ4NL => (256.0, 1.0),
        GgmlType::IQ4XS => (256.0, 32.0),
        GgmlType::Q2K => (4.0, 8.0),
        GgmlType::Q3K => (8.0, 32.0),
        _ => (64.0, 128.0),
    };
    let unit = 2.0 / (levels * sub * (cols.max(1) as f32).sqrt());
    let legacy = ty.block_size() == 32;
    set_block_scales(ty, bytes, || {
        let d = unit * (1.0 + jitter());
        // Legacy minimums are added (w = d·q + m), K-quant ones subtracted (w = d·sc·q −
        // dmin·m, m as random as sc): either way the codes' middle lands near 0.
        (
            d,
            if legacy {
                -0.5 * levels * d
            } else {
                0.5 * levels * d
            },
        )
    });
}

/// One GGUF matrix of 32-weight blocks, fields split into arrays.
#[derive(Debug, Clone)]
pub struct LegacyBlocks {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    /// Code bytes per block: 16 (byte `j` = codes `j` and `j + 16`) or, for Q8_0, 32 (code
    /// + 128, so every type's codes are unsigned).
    qs: Vec<u8>,
    /// Q5_0/Q5_1: bit `j` is bit 4 of code `j`.
    qh: Vec<u32>,
    d: Vec<f16>,
    /// Q4_1/Q5_1 minimums; empty otherwise.
    m: Vec<f16>,
}

impl LegacyBlocks {
    pub fn supports(ty: GgmlType) -> bool {
        BLOCK_TYPES.contains(&ty) && ty.block_size() == BLOCK
    }

    /// Splits `t`'s blocks into arrays, checking type and sizes.
    pub fn from_gguf(t: &BlockTensor) -> Result<Self> {
        if !Self::supports(t.ty) {
            return Err(block_error("LegacyBlocks::from_gguf", t));
        }
        check_blocks("LegacyBlocks::from_gguf", t)?;
        let n = t.rows * (t.cols / BLOCK);
        let ts = t.ty.type_size();
        let f16_at = |b: &[u8], i: usize| f16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |b: &[u8], i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let (has_min, has_high) = match t.ty {
            GgmlType::Q4_1 => (true, false),
            GgmlType::Q5_0 => (false, true),
            GgmlType::Q5_1 => (true, true),
            _ => (false, false),
        };
        let code_bytes = if t.ty == GgmlType::Q8_0 { 32 } else { 16 };
        let mut w = Self {
            ty: t.ty,
            rows: t.rows,
            cols: t.cols,
            qs: Vec::with_capacity(n * code_bytes),
            qh: Vec::with_capacity(if has_high { n } else { 0 }),
            d: Vec::with_capacity(n),
            m: Vec::with_capacity(if has_min { n } else { 0 }),
        };
        for b in t.bytes.chunks_exact(ts) {
            w.d.push(f16_at(b, 0));
            let mut at = 2;
            if has_min {
                w.m.push(f16_at(b, at));
                at += 2;
            }
            if has_high {
                w.qh.push(u32_at(b, at));
                at += 4;
            }
            let codes = &b[at..at + code_bytes];
            if t.ty == GgmlType::Q8_0 {
                w.qs.extend(codes.iter().map(|&q| q ^ 0x80));
            } else {
                w.qs.extend_from_slice(codes);
            }
        }
        Ok(w)
    }

    pub fn ty(&self) -> GgmlType {
        self.ty
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held (the file's block bytes).
    pub fn size_in_bytes(&self) -> usize {
        self.qs.len() + 4 * self.qh.len() + 2 * (self.d.len() + self.m.len())
    }

    pub(crate) fn layout(&self) -> CodeLayout {
        match self.ty {
            GgmlType::Q8_0 => CodeLayout::Bytes,
            GgmlType::Q5_0 | GgmlType::Q5_1 => CodeLayout::NibblesHigh,
            _ => CodeLayout::Nibbles,
        }
    }

    /// `o` of `ŵ = d·(u − o)` for the `_0` types.
    fn offset(&self) -> f32 {
        match self.ty {
            GgmlType::Q4_0 => 8.0,
            GgmlType::Q5_0 => 16.0,
            GgmlType::Q8_0 => 128.0,
            _ => 0.0,
        }
    }

    fn code_bytes(&self) -> usize {
        if self.layout() == CodeLayout::Bytes {
            32
        } else {
            16
        }
    }

    /// Rows `r0..r0 + n` as the kernels read them.
    pub(crate) fn block_rows(&self, r0: usize, n: usize) -> BlockRows<'_> {
        let bpr = self.cols / BLOCK;
        let (b0, b1) = (r0 * bpr, (r0 + n) * bpr);
        let cb = self.code_bytes();
        BlockRows {
            layout: self.layout(),
            qs: &self.qs[b0 * cb..b1 * cb],
            qh: if self.qh.is_empty() {
                &[]
            } else {
                &self.qh[b0..b1]
            },
            d: &self.d[b0..b1],
            m: if self.m.is_empty() {
                &[]
            } else {
                &self.m[b0..b1]
            },
            offset: self.offset(),
        }
    }

    /// Row `r` as f32 values (`out.len() == cols`), llama.cpp's dequantization.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let bpr = self.cols / BLOCK;
        for (k, ob) in out.chunks_exact_mut(BLOCK).enumerate() {
            self.dequantize_block(r * bpr + k, ob);
        }
    }

    /// Block `b` (row-major over the whole matrix) as 32 f32 values.
    #[inline(always)]
    pub(crate) fn dequantize_block(&self, b: usize, out: &mut [f32]) {
        let cb = self.code_bytes();
        let d = self.d[b].to_f32();
        let c = match self.m.get(b) {
            Some(m) => m.to_f32(),
            None => -self.offset() * d,
        };
        let qs = &self.qs[b * cb..(b + 1) * cb];
        if cb == 32 {
            for (o, &u) in out.iter_mut().zip(qs) {
                *o = d * f32::from(u) + c;
            }
        } else {
            let qh = self.qh.get(b).copied().unwrap_or(0);
            for j in 0..16 {
                let lo = (qs[j] & 0x0F) | ((((qh >> j) & 1) as u8) << 4);
                let hi = (qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
                out[j] = d * f32::from(lo) + c;
                out[j + 16] = d * f32::from(hi) + c;
            }
        }
    }
}

/// One GGUF matrix of K-quant super-blocks (256 weights each), as the file stores them.
#[derive(Debug, Clone)]
pub struct KQuantBlocks(BlockTensor);

impl KQuantBlocks {
    pub fn supports(ty: GgmlType) -> bool {
        BLOCK_TYPES.contains(&ty) && ty.block_size() == QK_K
    }

    /// Takes `t`'s super-blocks, checking type and sizes.
    pub fn from_gguf(t: &BlockTensor) -> Result<Self> {
        if !Self::supports(t.ty) {
            return Err(block_error("KQuantBlocks::from_gguf", t));
        }
        check_blocks("KQuantBlocks::from_gguf", t)?;
        Ok(Self(t.clone()))
    }

    /// Rows `r0..r0 + n`'s bytes.
    fn rows_bytes(&self, r0: usize, n: usize) -> &[u8] {
        let rb = self.0.row_bytes();
        &self.0.bytes[r0 * rb..(r0 + n) * rb]
    }

    /// Super-block `b` (row-major over the whole matrix) as 256 f32 values.
    fn dequantize_block(&self, b: usize, out: &mut [f32]) {
        let ts = self.0.ty.type_size();
        // Sizes were checked at construction, so this cannot fail; NaN would show it did.
        if dequantize(self.0.ty, &self.0.bytes[b * ts..(b + 1) * ts], QK_K, out).is_err() {
            out.fill(f32::NAN);
        }
    }

    /// Row `r` as f32 values (`out.len() == cols`), llama.cpp's dequantization.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        if dequantize(self.0.ty, self.rows_bytes(r, 1), self.0.cols, out).is_err() {
            out.fill(f32::NAN);
        }
    }
}

/// The error for a block type without kernels.
fn block_error(op: &'static str, t: &BlockTensor) -> RuntimeError {
    RuntimeError::Shape {
        op,
        msg: format!("{} blocks have no block kernels", t.ty),
    }
}

/// [`BlockTensor::check`] as a runtime error.
fn check_blocks(op: &'static str, t: &BlockTensor) -> Result<()> {
    t.check().map_err(|e| RuntimeError::Shape {
        op,
        msg: e.to_string(),
    })
}

/// The weight of a [`GgufBlockLinear`].
#[derive(Debug, Clone)]
pub enum GgufWeight {
    Legacy(LegacyBlocks),
    KQuant(KQuantBlocks),
}

impl GgufWeight {
    /// `t`'s blocks on the CPU kernels, or `None` for a type without them.
    pub fn from_gguf(t: &BlockTensor) -> Result<Option<Self>> {
        if LegacyBlocks::supports(t.ty) {
            Ok(Some(Self::Legacy(LegacyBlocks::from_gguf(t)?)))
        } else if KQuantBlocks::supports(t.ty) {
            Ok(Some(Self::KQuant(KQuantBlocks::from_gguf(t)?)))
        } else {
            Ok(None)
        }
    }

    pub fn ty(&self) -> GgmlType {
        match self {
            Self::Legacy(w) => w.ty,
            Self::KQuant(w) => w.0.ty,
        }
    }
    pub fn rows(&self) -> usize {
        match self {
            Self::Legacy(w) => w.rows,
            Self::KQuant(w) => w.0.rows,
        }
    }
    pub fn cols(&self) -> usize {
        match self {
            Self::Legacy(w) => w.cols,
            Self::KQuant(w) => w.0.cols,
        }
    }
    pub fn size_in_bytes(&self) -> usize {
        match self {
            Self::Legacy(w) => w.size_in_bytes(),
            Self::KQuant(w) => w.0.bytes.len(),
        }
    }
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        match self {
            Self::Legacy(w) => w.dequantize_row(r, out),
            Self::KQuant(w) => w.dequantize_row(r, out),
        }
    }

    /// Values per block: 32 (legacy) or 256 (K-quant super-blocks).
    fn block_len(&self) -> usize {
        match self {
            Self::Legacy(_) => BLOCK,
            Self::KQuant(_) => QK_K,
        }
    }

    /// Block `b` (row-major over the whole matrix) as [`GgufWeight::block_len`] f32 values.
    fn dequantize_block(&self, b: usize, out: &mut [f32]) {
        match self {
            Self::Legacy(w) => w.dequantize_block(b, out),
            Self::KQuant(w) => w.dequantize_block(b, out),
        }
    }
}

/// A GGUF-block projection with an optional f32 bias, on the CPU backend.
#[derive(Debug, Clone)]
pub struct GgufBlockLinear {
    weight: GgufWeight,
    bias: Option<Vec<f32>>,
}

impl GgufBlockLinear {
    pub fn new(weight: GgufWeight, bias: Option<Vec<f32>>) -> Result<Self> {
        if let Some(b) = &bias {
            check_len("GgufBlockLinear::new", "bias", b.len(), weight.rows())?;
        }
        Ok(Self { weight, bias })
    }

    pub fn weight(&self) -> &GgufWeight {
        &self.weight
    }

    /// `y = Ŵ·x̃` for one token with `x` in int8 blocks, or `None` where no int8 kernel takes
    /// the shape on this machine.
    fn matvec_int8(&self, level: SimdLevel, x: &[f32], y: &mut [f32]) -> Option<()> {
        let bytes = self.weight.size_in_bytes();
        match &self.weight {
            GgufWeight::Legacy(w) => {
                if !kernel::takes(level, w.cols) {
                    return None;
                }
                let prepared = Prepared::new(x, w.layout());
                run_row_blocks(bytes, y, |r0, yb| {
                    kernel::rows(level, &w.block_rows(r0, yb.len()), &prepared, yb);
                });
            }
            GgufWeight::KQuant(w) => {
                if !kquant::takes(level, w.0.ty, w.0.cols) {
                    return None;
                }
                let prepared = kquant::Prepared::new(x);
                run_row_blocks(bytes, y, |r0, yb| {
                    kquant::rows(level, w.0.ty, w.rows_bytes(r0, yb.len()), &prepared, yb);
                });
            }
        }
        Some(())
    }

    /// `y = Ŵ·x` for one token with f32 activations (the reference numerics): blocks
    /// dequantized on the fly (a legacy block or a K-quant super-block at a time).
    fn matvec_f32(&self, x: &[f32], y: &mut [f32]) {
        let w = &self.weight;
        let chunk = w.block_len();
        let per_row = w.cols() / chunk;
        run_row_blocks(w.size_in_bytes(), y, |r0, yb| {
            let mut block = [0.0f32; QK_K];
            let block = &mut block[..chunk];
            for (i, yr) in yb.iter_mut().enumerate() {
                let first = (r0 + i) * per_row;
                let mut total = 0.0f32;
                for (k, xb) in x.chunks_exact(chunk).enumerate() {
                    w.dequantize_block(first + k, block);
                    total += dot(block, xb);
                }
                *yr = total;
            }
        });
    }
}

impl Linear<CpuBackend> for GgufBlockLinear {
    fn in_dim(&self) -> usize {
        self.weight.cols()
    }
    fn out_dim(&self) -> usize {
        self.weight.rows()
    }
    fn has_bias(&self) -> bool {
        self.bias.is_some()
    }
    fn forward(
        &self,
        backend: &CpuBackend,
        x: &CpuBuffer,
        m: usize,
        y: &mut CpuBuffer,
    ) -> Result<()> {
        let (rows, cols) = (self.weight.rows(), self.weight.cols());
        let w = &self.weight;
        coded_forward(
            "GgufBlockLinear::forward",
            backend,
            (x, m, y),
            (rows, cols),
            self.bias.as_deref(),
            |level, x, y| self.matvec_int8(level, x, y),
            |_, x, y| self.matvec_f32(x, y),
            |x, m, y| {
                matmul_t_panels(x, m, rows, y, |r0, panel| {
                    for (i, row) in panel.chunks_exact_mut(cols).enumerate() {
                        w.dequantize_row(r0 + i, row);
                    }
                })
            },
        )
    }
    fn gather_rows(
        &self,
        _backend: &CpuBackend,
        tokens: &CpuIndex,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        let (rows, cols) = (self.weight.rows(), self.weight.cols());
        gather_decoded_rows(tokens, out, rows, cols, |r, row| {
            self.weight.dequantize_row(r, row)
        })
    }
    fn resident_bytes(&self) -> usize {
        self.weight.size_in_bytes() + self.bias.as_ref().map_or(0, |b| 4 * b.len())
    }
    fn describe(&self) -> String {
        format!(
            "gguf {} {}×{}{}",
            self.weight.ty(),
            self.weight.cols(),
            self.weight.rows(),
            if self.bias.is_some() { " +bias" } else { "" }
        )
    }
}

/// Builds every weight a GGUF file kept in blocks ([`sfx_formats::Checkpoint::blocks`]) on
/// the backend's block kernels, and the rest as float linears at `precision`. A backend
/// without kernels for a block type gets that weight dequantized at load.
pub struct GgufBlockFactory<'a> {
    pub blocks: &'a BTreeMap<String, BlockTensor>,
    pub precision: WeightPrecision,
}

/// `t` dequantized into a float linear on `backend`: where the backend has no kernels for
/// the blocks.
pub fn dequantized_linear<B: Backend>(
    backend: &B,
    t: &BlockTensor,
    bias: Option<&[f32]>,
    precision: WeightPrecision,
    name: &str,
) -> Result<FloatLinear<B>> {
    let values = t.dequantize().map_err(|e| RuntimeError::Shape {
        op: "dequantized_linear",
        msg: format!("{name}: {e}"),
    })?;
    crate::resident::float_linear_of(backend, &values, (t.rows, t.cols), bias, precision, name)
}

/// `t` on the backend's block kernels, or dequantized at `precision` where it has none.
pub fn block_linear<B: ResidentKernels>(
    backend: &B,
    t: &BlockTensor,
    bias: Option<Vec<f32>>,
    precision: WeightPrecision,
    name: &str,
) -> Result<Box<dyn Linear<B>>> {
    match backend.gguf_block_linear(t, bias.clone(), name)? {
        Some(linear) => Ok(linear),
        None => Ok(Box::new(dequantized_linear(
            backend,
            t,
            bias.as_deref(),
            precision,
            name,
        )?)),
    }
}

impl<B: ResidentKernels> LinearFactory<B> for GgufBlockFactory<'_> {
    fn load(
        &self,
        backend: &B,
        tensors: &dyn TensorSource,
        spec: &LinearSpec<'_>,
    ) -> Result<Box<dyn Linear<B>>> {
        let Some(t) = self.blocks.get(spec.weight_name) else {
            return Ok(Box::new(FloatLinear::load(
                backend,
                tensors,
                spec,
                self.precision,
            )?));
        };
        check_dims(spec, t)?;
        let bias = load_bias(tensors, spec)?;
        block_linear(backend, t, bias, self.precision, spec.weight_name)
    }

    fn load_embedding(
        &self,
        backend: &B,
        tensors: &dyn TensorSource,
        spec: &LinearSpec<'_>,
        precision: WeightPrecision,
    ) -> Result<Arc<dyn Linear<B>>> {
        let Some(t) = self.blocks.get(spec.weight_name) else {
            return Ok(Arc::new(FloatLinear::load(
                backend, tensors, spec, precision,
            )?));
        };
        check_dims(spec, t)?;
        match backend.gguf_block_linear(t, None, spec.weight_name)? {
            Some(linear) => Ok(Arc::from(linear)),
            None => Ok(Arc::new(dequantized_linear(
                backend,
                t,
                None,
                precision,
                spec.weight_name,
            )?)),
        }
    }
}

fn check_dims(spec: &LinearSpec<'_>, t: &BlockTensor) -> Result<()> {
    crate::linear::check_shape(
        spec.weight_name,
        &[t.rows, t.cols],
        &[spec.out_dim, spec.in_dim],
    )
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::test_util::lcg;

    /// A `rows × cols` matrix of `ty` blocks with random codes and scales: legacy scales in
    /// 0.01–0.06 with minimums down to −0.2, K-quant scales and minimums in 0.001–0.011.
    pub(crate) fn random_blocks(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        seed: &mut u64,
    ) -> BlockTensor {
        let mut bytes: Vec<u8> = (0..rows * cols / ty.block_size() * ty.type_size())
            .map(|_| (lcg(seed).to_bits() >> 7) as u8)
            .collect();
        let k = ty.block_size() == QK_K;
        set_block_scales(ty, &mut bytes, || {
            let (a, b) = (lcg(seed).abs(), lcg(seed).abs());
            if k {
                (0.001 + 0.01 * a, 0.001 + 0.01 * b)
            } else {
                (0.01 + 0.05 * a, -0.2 * b)
            }
        });
        BlockTensor {
            ty,
            rows,
            cols,
            bytes,
        }
    }

    /// The split layout dequantizes to exactly llama.cpp's values (the formats crate's
    /// dequantization, written from ggml's block definitions).
    #[test]
    fn rows_dequantize_as_the_gguf_blocks() {
        let mut seed = 5u64;
        for ty in BLOCK_TYPES
            .into_iter()
            .filter(|&t| LegacyBlocks::supports(t))
        {
            let (rows, cols) = (3, 96);
            let t = random_blocks(ty, rows, cols, &mut seed);
            let want = t.dequantize().unwrap();
            let w = LegacyBlocks::from_gguf(&t).unwrap();
            assert_eq!(w.size_in_bytes(), t.bytes.len(), "{ty}");
            let mut row = vec![f32::NAN; cols];
            for r in 0..rows {
                w.dequantize_row(r, &mut row);
                assert_eq!(row, want[r * cols..(r + 1) * cols], "{ty} row {r}");
            }
        }
    }

    /// The i-quants have no block kernels: `runs_in_blocks` leaves them to the importer, which
    /// dequantizes them to f32, and one handed to the CPU's block path anyway is declined
    /// (the factory then builds a float linear; the conformance suite's IQ4 cases run that).
    #[test]
    fn i_quants_are_declined_by_the_block_kernels() {
        use GgmlType::*;
        for ty in [IQ4NL, IQ4XS, IQ2XXS, IQ2XS, IQ2S, IQ3XXS, IQ3S] {
            assert!(!runs_in_blocks(ty), "{ty}");
            let t = BlockTensor {
                ty,
                rows: 2,
                cols: QK_K,
                bytes: vec![0; 2 * QK_K / ty.block_size() * ty.type_size()],
            };
            assert!(GgufWeight::from_gguf(&t).unwrap().is_none(), "{ty}");
        }
    }

    #[test]
    fn bad_blocks_are_refused_with_the_reason() {
        let mut seed = 6u64;
        let mut t = random_blocks(GgmlType::Q4_0, 2, 64, &mut seed);
        t.bytes.pop();
        let e = LegacyBlocks::from_gguf(&t).unwrap_err().to_string();
        assert!(e.contains("needs 72 bytes, got 71"), "{e}");
        let t = BlockTensor {
            ty: GgmlType::Q6K,
            rows: 1,
            cols: 256,
            bytes: vec![0; 210],
        };
        let e = LegacyBlocks::from_gguf(&t).unwrap_err().to_string();
        assert!(e.contains("Q6_K blocks have no block kernels"), "{e}");
    }
}

//! The CPU backend: f32 activations in `Vec`s, BF16/F32 weights, rayon for threads (the
//! global pool, so `RAYON_NUM_THREADS` applies) and run-time SIMD dispatch.

mod attention;
mod elementwise;
pub(crate) mod gemm;
mod kvarn;
pub mod math;
mod matvec;
pub mod q8_activations;
mod refine_kernels;
mod scratch;
pub(crate) mod simd;
pub(crate) mod spin_pool;

pub use q8_activations::DecodeActivations;
pub use simd::SimdLevel;

use crate::backend::{
    synthetic_value, AttentionShape, Backend, KvDtype, KvLayout, KvarnLayer, KvarnShape, MatmulOut,
    RopeTable, WeightPrecision,
};
use crate::error::{check_len, check_rows, Result, RuntimeError};
use half::bf16;
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

/// u32 values (token ids, positions) in host memory; staging and device are the same place.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CpuIndex(pub Vec<u32>);

/// A KV store: f32 elements; an F16 store holds values rounded to f16 on write, so the CPU
/// reference computes exactly what a device with half-precision storage reads back.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuKvStore {
    pub data: Vec<f32>,
    pub dtype: KvDtype,
}

/// Rounds in place to the store's element type.
fn round_kv(values: &mut [f32], dtype: KvDtype) {
    if dtype == KvDtype::F16 {
        for v in values {
            *v = half::f16::from_f32(*v).to_f32();
        }
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

/// CPU compute. Cheap to copy; holds the SIMD tier its kernels dispatch to and how decode
/// activations meet coded weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuBackend {
    simd: SimdLevel,
    /// f32 (the reference, [`CpuBackend::new`]'s) or int8 blocks for coded projections'
    /// decode matvecs.
    decode_activations: DecodeActivations,
    /// Whether the refinement engine hands a decode row's refinement to the projections
    /// ([`Backend::fuses_refinement`]); the CPU's projections then add it by separate ops, so
    /// this only exercises the engine's fused path against its branches (tests).
    fused_refinement: bool,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

/// Token counts up to this use the matvec kernel once per token rather than a GEMM: at m ≤ 2
/// the GEMM's packing costs more than re-reading the weights.
const MATVEC_MAX_ROWS: usize = 2;

/// RMSNorm of one row on the host as the CPU backend's `rms_norm` computes it (its SIMD tier,
/// so the same sums): a host-side engine selecting from it picks what the backend would.
pub(crate) fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut Vec<f32>) {
    out.clear();
    out.resize(x.len(), 0.0);
    elementwise::rms_norm(CpuBackend::new().simd, x, w, eps, out);
}

impl CpuBackend {
    /// The best SIMD tier of this CPU, lowered by `SFX_CPU_SIMD=scalar|avx2|avx512` if set
    /// (to test the fallbacks on a machine that has more; an unsupported value is ignored).
    pub fn new() -> Self {
        let detected = SimdLevel::detect();
        let simd = std::env::var("SFX_CPU_SIMD")
            .ok()
            .and_then(|s| SimdLevel::parse_supported(&s).ok())
            .map_or(detected, |l| l.min(detected));
        Self {
            simd,
            decode_activations: DecodeActivations::F32,
            fused_refinement: false,
        }
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
        Ok(Self {
            simd,
            decode_activations: DecodeActivations::F32,
            fused_refinement: false,
        })
    }

    /// This backend with the refinement engine's fused path on or off (off by default).
    pub fn with_fused_refinement(self, on: bool) -> Self {
        Self {
            fused_refinement: on,
            ..self
        }
    }

    pub fn simd(&self) -> SimdLevel {
        self.simd
    }

    /// This backend with coded projections' decode matvecs fed `activations`.
    pub fn with_decode_activations(self, activations: DecodeActivations) -> Self {
        Self {
            decode_activations: activations,
            ..self
        }
    }

    pub fn decode_activations(&self) -> DecodeActivations {
        self.decode_activations
    }

    /// `f(r, row)` for every row of `x`, or of its RMSNorm by `norm` as `rms_norm` computes
    /// it.
    fn each_normed_row(
        &self,
        x: &CpuBuffer,
        row_len: usize,
        norm: Option<(&CpuBuffer, f32)>,
        mut f: impl FnMut(usize, &[f32]),
    ) {
        let mut normed = vec![0.0f32; row_len];
        for (r, row) in x.0.chunks_exact(row_len).enumerate() {
            match norm {
                Some((w, eps)) => {
                    elementwise::rms_norm(self.simd, row, &w.0, eps, &mut normed);
                    f(r, &normed);
                }
                None => f(r, row),
            }
        }
    }
}

/// Positions as the CPU kernels take them: `first..first + n`, consecutive. The graph only
/// ever issues consecutive runs; anything else is refused rather than misread.
fn consecutive(op: &'static str, positions: &CpuIndex, n: usize) -> Result<usize> {
    let p = &positions.0;
    if p.len() != n {
        return Err(RuntimeError::Shape {
            op,
            msg: format!("{} positions for {n} tokens", p.len()),
        });
    }
    let first = p.first().copied().unwrap_or(0) as usize;
    if p.iter().enumerate().any(|(i, &v)| v as usize != first + i) {
        return Err(RuntimeError::Unsupported(format!(
            "{op}: the CPU backend runs consecutive positions only (got {p:?})"
        )));
    }
    Ok(first)
}

impl CpuBackend {
    /// `y = x·wᵀ (+ bias)` on slices whose lengths `matmul_t` checked.
    fn product(&self, x: &[f32], m: usize, w: &CpuMatrix, bias: Option<&[f32]>, y: &mut [f32]) {
        let (rows, cols) = (w.rows(), w.cols());
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
                for (v, bv) in yr.iter_mut().zip(b) {
                    *v += bv;
                }
            }
        }
    }
}

impl Backend for CpuBackend {
    type Buffer = CpuBuffer;
    type Matrix = CpuMatrix;
    type Index = CpuIndex;
    type KvStore = CpuKvStore;
    type ByteStore = Vec<u8>;
    type Graph = ();

    fn with_reference_numerics(&self) -> Self {
        self.with_decode_activations(DecodeActivations::F32)
    }

    fn name(&self) -> String {
        let acts = match self.decode_activations {
            DecodeActivations::F32 => "",
            DecodeActivations::Int8 => ", int8 decode activations",
        };
        format!(
            "cpu ({}{acts}, {} threads)",
            self.simd.as_str(),
            rayon::current_num_threads()
        )
    }

    fn numerics_name(&self) -> String {
        let acts = match self.decode_activations {
            DecodeActivations::F32 => "",
            DecodeActivations::Int8 => ", int8 decode activations",
        };
        format!("cpu ({}{acts})", self.simd.as_str())
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

    fn upload_into(&self, buf: &mut CpuBuffer, host: &[f32]) -> Result<()> {
        check_len("upload_into", "source", host.len(), buf.len())?;
        buf.0.copy_from_slice(host);
        Ok(())
    }

    fn alloc_index(&self, len: usize) -> Result<CpuIndex> {
        Ok(CpuIndex(vec![0; len]))
    }

    fn stage_index(&self, idx: &mut CpuIndex, values: &[u32]) -> Result<()> {
        check_len("stage_index", "values", values.len(), idx.0.len())?;
        idx.0.copy_from_slice(values);
        Ok(())
    }

    fn upload_staged_index(&self, _idx: &CpuIndex) -> Result<()> {
        Ok(())
    }

    fn download_index(&self, idx: &CpuIndex, out: &mut [u32]) -> Result<()> {
        check_len("download_index", "destination", out.len(), idx.0.len())?;
        out.copy_from_slice(&idx.0);
        Ok(())
    }

    fn alloc_kv(&self, len: usize, dtype: KvDtype) -> Result<CpuKvStore> {
        Ok(CpuKvStore {
            data: vec![0.0; len],
            dtype,
        })
    }

    fn upload_kv(&self, host: &[f32], dtype: KvDtype) -> Result<CpuKvStore> {
        let mut data = host.to_vec();
        round_kv(&mut data, dtype);
        Ok(CpuKvStore { data, dtype })
    }

    fn download_kv(&self, kv: &CpuKvStore, out: &mut [f32]) -> Result<()> {
        check_len("download_kv", "destination", out.len(), kv.data.len())?;
        out.copy_from_slice(&kv.data);
        Ok(())
    }

    fn upload_byte_store(&self, bytes: &[u8]) -> Result<Vec<u8>> {
        Ok(bytes.to_vec())
    }

    fn alloc_byte_store(&self, len: usize) -> Result<Vec<u8>> {
        let mut v = Vec::new();
        v.try_reserve_exact(len).map_err(|e| {
            crate::error::RuntimeError::Config(format!(
                "allocating a tile store of {len} bytes: {e}"
            ))
        })?;
        v.resize(len, 0);
        Ok(v)
    }

    fn alloc_host_byte_store(&self, len: usize) -> Result<Vec<u8>> {
        self.alloc_byte_store(len)
    }

    fn write_byte_store(&self, tiles: &mut Vec<u8>, offset: usize, bytes: &[u8]) -> Result<()> {
        crate::backend::kvarn::tile_range_check(
            "write_byte_store",
            tiles.len(),
            offset,
            bytes.len(),
        )?;
        tiles[offset..offset + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    fn read_byte_store(&self, tiles: &Vec<u8>, offset: usize, out: &mut [u8]) -> Result<()> {
        crate::backend::kvarn::tile_range_check("read_byte_store", tiles.len(), offset, out.len())?;
        out.copy_from_slice(&tiles[offset..offset + out.len()]);
        Ok(())
    }

    fn hadamard_rows(&self, x: &mut CpuBuffer, row_len: usize) -> Result<()> {
        let (_, scale) = crate::backend::kvarn::hadamard_rows_check(x.len(), row_len)?;
        use rayon::prelude::*;
        let level = self.simd;
        x.0.par_chunks_mut(row_len)
            .for_each(|row| crate::resident::hadamard::fwht_scaled(level, row, scale));
        Ok(())
    }

    fn kvarn_attention(
        &self,
        q: &CpuBuffer,
        layer: &KvarnLayer<'_, Self>,
        shape: &KvarnShape,
        _scratch: &mut CpuBuffer,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        kvarn::kvarn_attention(self.simd, q, layer, shape, out)
    }

    fn random_matrix(
        &self,
        rows: usize,
        cols: usize,
        dtype: DType,
        seed: u64,
        scale: f32,
    ) -> Result<CpuMatrix> {
        use rayon::prelude::*;
        let n = rows.checked_mul(cols).ok_or_else(|| RuntimeError::Shape {
            op: "random_matrix",
            msg: format!("{rows} × {cols} overflows"),
        })?;
        let value = |i: usize| synthetic_value(seed, i as u64) * scale;
        let weights = match dtype {
            DType::BF16 => CpuWeights::Bf16(
                (0..n)
                    .into_par_iter()
                    .map(|i| bf16::from_f32(value(i)).to_bits())
                    .collect(),
            ),
            DType::F32 => CpuWeights::F32((0..n).into_par_iter().map(value).collect()),
            other => {
                return Err(RuntimeError::Unsupported(format!(
                    "random_matrix: {} weights (BF16 and F32 only)",
                    other.as_str()
                )))
            }
        };
        CpuMatrix::new(rows, cols, weights)
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

    fn embedding(&self, table: &CpuMatrix, tokens: &CpuIndex, out: &mut CpuBuffer) -> Result<()> {
        let tokens = &tokens.0[..];
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
        out: MatmulOut,
    ) -> Result<()> {
        let (rows, cols) = (w.rows(), w.cols());
        check_len("matmul_t", "input", x.len(), m * cols)?;
        check_len("matmul_t", "output", y.len(), m * rows)?;
        if let Some(b) = bias {
            check_len("matmul_t", "bias", b.len(), rows)?;
        }
        let bias = bias.map(|b| &b.0[..]);
        match out {
            MatmulOut::Store => self.product(&x.0, m, w, bias, &mut y.0),
            // The product rounds to f32 before the add, as a separate projection + residual
            // add would: the fused path changes no numbers. A decode step's product lands in
            // this thread's scratch (the matvec takes none itself); a GEMM's gets its own
            // buffer, since its panels use the scratch.
            MatmulOut::Accumulate if m <= MATVEC_MAX_ROWS => {
                scratch::with_scratch(y.len(), |tmp| {
                    self.product(&x.0, m, w, bias, tmp);
                    elementwise::add_assign(&mut y.0, tmp);
                })
            }
            MatmulOut::Accumulate => {
                let mut tmp = vec![0.0; y.len()];
                self.product(&x.0, m, w, bias, &mut tmp);
                elementwise::add_assign(&mut y.0, &tmp);
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
        table: &RopeTable<CpuBackend>,
        positions: &CpuIndex,
    ) -> Result<()> {
        if !head_dim.is_multiple_of(2) || table.half != head_dim / 2 {
            return Err(RuntimeError::Shape {
                op: "rope",
                msg: format!("head_dim {head_dim} with a table of {} pairs", table.half),
            });
        }
        let n = check_rows("rope", "input", x.len(), n_heads * head_dim)?;
        let first = consecutive("rope", positions, n)?;
        if first + n > table.positions {
            return Err(RuntimeError::Shape {
                op: "rope",
                msg: format!(
                    "positions {first}..{} exceed the table's {}",
                    first + n,
                    table.positions
                ),
            });
        }
        let half = table.half;
        let rows = first * half..(first + n) * half;
        elementwise::rope(
            self.simd,
            &mut x.0,
            n_heads,
            head_dim,
            &table.cos.0[rows.clone()],
            &table.sin.0[rows],
        );
        Ok(())
    }

    fn write_kv(
        &self,
        k: &CpuBuffer,
        v: &CpuBuffer,
        k_cache: &mut CpuKvStore,
        v_cache: &mut CpuKvStore,
        layout: KvLayout,
        positions: &CpuIndex,
    ) -> Result<()> {
        let row = layout.kv_heads * layout.head_dim;
        let n = check_rows("write_kv", "keys", k.len(), row)?;
        check_len("write_kv", "values", v.len(), k.len())?;
        check_len(
            "write_kv",
            "key cache",
            k_cache.data.len(),
            layout.buffer_len(),
        )?;
        check_len(
            "write_kv",
            "value cache",
            v_cache.data.len(),
            layout.buffer_len(),
        )?;
        let start = consecutive("write_kv", positions, n)?;
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
        for (src, dst) in [(k, &mut *k_cache), (v, &mut *v_cache)] {
            if dst.dtype == KvDtype::F32 {
                elementwise::write_kv(&src.0, &mut dst.data, layout, start);
            } else {
                scratch::with_scratch(src.0.len(), |rows| {
                    rows.copy_from_slice(&src.0);
                    round_kv(rows, dst.dtype);
                    elementwise::write_kv(rows, &mut dst.data, layout, start);
                });
            }
        }
        Ok(())
    }

    fn attention(
        &self,
        q: &CpuBuffer,
        k_cache: &CpuKvStore,
        v_cache: &CpuKvStore,
        shape: &AttentionShape,
        positions: &CpuIndex,
        _scratch: &mut CpuBuffer,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        let s = shape;
        s.check(q.len(), out.len(), k_cache.data.len(), v_cache.data.len())?;
        if consecutive("attention", positions, s.n_queries)? != s.past {
            return Err(RuntimeError::Shape {
                op: "attention",
                msg: format!("positions do not start at past = {}", s.past),
            });
        }
        attention::attention(self.simd, &q.0, &k_cache.data, &v_cache.data, s, &mut out.0);
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

    fn argmax_rows(&self, x: &CpuBuffer, cols: usize, out: &mut CpuIndex) -> Result<()> {
        let rows = check_rows("argmax_rows", "input", x.len(), cols)?;
        check_len("argmax_rows", "output", out.0.len(), rows)?;
        for (o, row) in out.0.iter_mut().zip(x.0.chunks_exact(cols)) {
            *o = crate::sampling::argmax(row) as u32;
        }
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
        crate::backend::check_nibble_units(
            y.len(),
            row_len,
            row,
            units.len(),
            unit_bytes,
            weights.len(),
            scales.len(),
        )?;
        let out = &mut y.0[row * row_len..(row + 1) * row_len];
        refine_kernels::add_nibble_units(self.simd, out, units, unit_bytes, weights, scales);
        Ok(())
    }

    fn fuses_refinement(&self, _w: &CpuMatrix) -> bool {
        self.fused_refinement
    }

    fn select_channels(
        &self,
        x: &CpuBuffer,
        row_len: usize,
        norm: Option<(&CpuBuffer, f32)>,
        k_per_1024: usize,
        sel: &mut CpuIndex,
        values: &mut CpuBuffer,
    ) -> Result<()> {
        let (_, per_row) = crate::backend::refine::select_check(
            x.len(),
            row_len,
            norm.map(|(w, _)| w.len()),
            k_per_1024,
            sel.0.len(),
            values.len(),
        )?;
        let mut picked = Vec::with_capacity(per_row);
        // The norm as `rms_norm` computes it, so the host-driven engine (which selects from
        // rms_norm's output) and this op select the same channels.
        self.each_normed_row(x, row_len, norm, |r, row| {
            crate::refine::select::select_top_k(row, k_per_1024, &mut picked);
            let at = r * per_row..(r + 1) * per_row;
            for ((slot, value), &i) in sel.0[at.clone()]
                .iter_mut()
                .zip(&mut values.0[at])
                .zip(&picked)
            {
                *slot = i as u32;
                *value = row[i];
            }
        });
        Ok(())
    }

    fn add_selected_columns(
        &self,
        rows: usize,
        row_len: usize,
        sel: &CpuIndex,
        values: &CpuBuffer,
        selected: usize,
        targets: &mut [crate::backend::refine::ColumnTarget<'_, Self>],
        _scratch: &mut CpuBuffer,
    ) -> Result<()> {
        let check = crate::backend::refine::columns_check::<Self>(
            rows,
            row_len,
            sel.0.len(),
            values.len(),
            selected,
            targets,
            |s| s.len(),
            |b| b.len(),
        )?;
        for (t, &out_dim) in targets.iter_mut().zip(&check.out_dims) {
            for r in 0..rows {
                let at = r * selected..(r + 1) * selected;
                // An index past the row names no column: skipped, as the kernels do.
                let units = sel.0[at.clone()]
                    .iter()
                    .zip(&values.0[at])
                    .filter(|&(&i, _)| (i as usize) < row_len)
                    .map(|(&i, &v)| {
                        let start = t.offset + i as usize * t.unit_bytes;
                        (&t.store[start..start + t.unit_bytes], v)
                    });
                let out = &mut t.out.0[r * out_dim..(r + 1) * out_dim];
                if !t.accumulate {
                    out.fill(0.0);
                }
                refine_kernels::add_nibble_columns(self.simd, out, units, &t.scales.0);
            }
        }
        Ok(())
    }

    fn stage_selected_units(
        &self,
        rows: usize,
        row_len: usize,
        sel: &CpuIndex,
        selected: usize,
        targets: &mut [crate::backend::refine::StageTarget<'_, Self>],
    ) -> Result<()> {
        crate::backend::refine::stage_check(rows, row_len, sel.0.len(), selected, targets, |s| {
            s.len()
        })?;
        for t in targets.iter_mut() {
            let unit_bytes = t.unit_bytes;
            for (u, &i) in sel.0[..rows * selected].iter().enumerate() {
                let out = &mut t.dst[u * unit_bytes..(u + 1) * unit_bytes];
                if (i as usize) < row_len {
                    let start = t.offset + i as usize * unit_bytes;
                    out.copy_from_slice(&t.store[start..start + unit_bytes]);
                } else {
                    out.fill(0);
                }
            }
        }
        Ok(())
    }

    fn gather_selected_values(
        &self,
        x: &CpuBuffer,
        row_len: usize,
        norm: Option<(&CpuBuffer, f32)>,
        sel: &CpuIndex,
        selected: usize,
        values: &mut CpuBuffer,
    ) -> Result<()> {
        crate::backend::refine::gather_check(
            x.len(),
            row_len,
            norm.map(|(w, _)| w.len()),
            sel.0.len(),
            selected,
            values.len(),
        )?;
        // Normalised as `select_channels` and `rms_norm` do it.
        self.each_normed_row(x, row_len, norm, |r, row| {
            let at = r * selected..(r + 1) * selected;
            for (v, &i) in values.0[at.clone()].iter_mut().zip(&sel.0[at]) {
                *v = row.get(i as usize).copied().unwrap_or(0.0);
            }
        });
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

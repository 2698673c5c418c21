//! Look-up-table codes (SqueezeLLM) and llama.cpp's GGUF blocks (Q4_0 … Q8_0, Q2_K … Q6_K) on
//! the CUDA backend, inside a [`CudaMatrix`] (no dequantized copy): the CUDA-core kernels of
//! kernels/coded.cu decode 32 weights at a time in every projection op of the backend (q/k/v
//! in one launch, gate/up with SwiGLU in one, the input RMSNorm folded in, the residual added
//! in the epilogue). Prefill dequantizes into a transient f32 panel for cuBLAS's TF32 GEMM, as
//! the group codes do; a tied embedding gathers its rows from the same codes.
//!
//! GGUF blocks are split at load into three planes — scale fields, low code bits, high code
//! bits — so a chunk's code bytes are aligned 16-byte loads ([`GgufPlanes`]; docs/format.md,
//! "CUDA GGUF planes"). The bytes held equal the file's. A look-up-table weight keeps its codes
//! as the file stores them; its int8 tables times the row scales become f32 tables (16 levels
//! × 4 bytes a row at 4 bits).

use super::device::DeviceMem;
use super::resident::CudaResidentLinear;
use super::{
    blocks, i32_of, Arg, Codes, CudaBackend, CudaBuffer, CudaMatrix, MatrixData, WeightRef,
};
use crate::backend::Backend;
use crate::error::{check_len, Result, RuntimeError};
use sfx_formats::gguf::{BlockTensor, GgmlType};
use sfx_formats::resident::lut::row_values;
use sfx_formats::resident::LutQuantized;
use sfx_formats::DType;
use std::sync::Arc;

/// Columns per chunk of the kernels (`CD_CHUNK`), threads per block (`CD_THREADS`).
const CHUNK: usize = 32;
const THREADS: usize = 256;
/// Projections one launch takes (`CD_MAX_ITEMS`).
const MAX_ITEMS: usize = 3;
/// Chunks a thread loads ahead (`CD_UNROLL`).
const UNROLL: usize = 2;
/// The narrowest row set: look-up-table codes keep a warp on one row (its lanes read one
/// table: no bank conflicts); the GGUF kernels measured nothing narrower yet.
const NARROWEST_TPR: usize = 32;

/// The formats of kernels/coded.cu, in the order of [`super::kernels::CodedKernels`]' tables
/// (the kernels' name suffixes).
pub(crate) const CODED_FORMATS: [&str; 13] = [
    "lut2", "lut3", "lut4", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k",
    "q6_k",
];

/// Index of the format named `name` (e.g. `lut3`, `q4_k`) in [`CODED_FORMATS`].
fn format_index(name: &str) -> Option<usize> {
    CODED_FORMATS.iter().position(|f| *f == name)
}

/// What a [`CudaMatrix`] of look-up-table codes or GGUF blocks holds beside its main buffer
/// (the packed codes, or the GGUF blocks' low code bits).
pub(super) struct CodedCodes {
    /// Index into [`CODED_FORMATS`].
    format: usize,
    /// The kernels' `bpr`: blocks per row (GGUF) or bytes per row (look-up-table codes).
    bpr: usize,
    /// GGUF: the blocks' scale fields; look-up-table codes: f32 tables `[rows][2^bits]`.
    meta: DeviceMem,
    /// GGUF: the blocks' high code bits, for the types that have them.
    high: Option<DeviceMem>,
}

impl CodedCodes {
    pub(super) fn same_format(&self, other: &CodedCodes) -> bool {
        self.format == other.format && self.bpr == other.bpr
    }
}

/// The kernels' `CdItem` / `CdGroup` (kernels/coded.cu), passed by value.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct CdItem {
    meta: u64,
    qs: u64,
    qh: u64,
    bias: u64,
    y: u64,
    rows: i32,
    block_end: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct CdGroup {
    item: [CdItem; MAX_ITEMS],
    count: i32,
}

/// Where each field of a GGUF block goes: byte ranges of the block concatenated into its
/// `meta` plane (the scales, in file order), and the ranges of its low (`qs`) and high (`qh`)
/// code bits. The kernels' `Fmt*::META`, `QS`, `QH` are these lengths.
struct BlockPlanes {
    meta: &'static [(usize, usize)],
    qs: (usize, usize),
    qh: Option<(usize, usize)>,
}

fn block_planes(ty: GgmlType) -> Option<BlockPlanes> {
    let p = |meta, qs, qh| BlockPlanes { meta, qs, qh };
    Some(match ty {
        GgmlType::Q4_0 => p(&[(0, 2)], (2, 18), None),
        GgmlType::Q4_1 => p(&[(0, 4)], (4, 20), None),
        GgmlType::Q5_0 => p(&[(0, 2)], (6, 22), Some((2, 6))),
        GgmlType::Q5_1 => p(&[(0, 4)], (8, 24), Some((4, 8))),
        GgmlType::Q8_0 => p(&[(0, 2)], (2, 34), None),
        GgmlType::Q2K => p(&[(0, 16), (80, 84)], (16, 80), None),
        GgmlType::Q3K => p(&[(96, 110)], (32, 96), Some((0, 32))),
        GgmlType::Q4K => p(&[(0, 16)], (16, 144), None),
        GgmlType::Q5K => p(&[(0, 16)], (48, 176), Some((16, 48))),
        GgmlType::Q6K => p(&[(192, 210)], (0, 128), Some((128, 192))),
        _ => return None,
    })
}

/// A GGUF tensor's blocks split into the kernels' three planes (each the blocks' field in
/// block order), or `None` for a type the kernels do not read.
pub(super) struct GgufPlanes {
    format: usize,
    meta: Vec<u8>,
    qs: Vec<u8>,
    qh: Vec<u8>,
}

impl GgufPlanes {
    pub(super) fn split(t: &BlockTensor) -> Option<GgufPlanes> {
        let spec = block_planes(t.ty)?;
        let format = format_index(&t.ty.name().to_lowercase())?;
        let size = t.ty.type_size();
        let n = t.bytes.len() / size;
        let meta_len: usize = spec.meta.iter().map(|(a, b)| b - a).sum();
        let range_len = |r: Option<(usize, usize)>| r.map_or(0, |(a, b)| b - a);
        let mut out = GgufPlanes {
            format,
            meta: Vec::with_capacity(n * meta_len),
            qs: Vec::with_capacity(n * range_len(Some(spec.qs))),
            qh: Vec::with_capacity(n * range_len(spec.qh)),
        };
        for block in t.bytes.chunks_exact(size) {
            for &(a, b) in spec.meta {
                out.meta.extend_from_slice(&block[a..b]);
            }
            out.qs.extend_from_slice(&block[spec.qs.0..spec.qs.1]);
            if let Some((a, b)) = spec.qh {
                out.qh.extend_from_slice(&block[a..b]);
            }
        }
        Some(out)
    }

    /// The blocks as the file lays them out again (the split's inverse, for its test).
    #[cfg(test)]
    fn join(&self, ty: GgmlType) -> Vec<u8> {
        let Some(spec) = block_planes(ty) else {
            return Vec::new();
        };
        let size = ty.type_size();
        let meta_len: usize = spec.meta.iter().map(|(a, b)| b - a).sum();
        let qs_len = spec.qs.1 - spec.qs.0;
        let qh_len = spec.qh.map_or(0, |(a, b)| b - a);
        let n = self.qs.len() / qs_len;
        let mut bytes = vec![0u8; n * size];
        for (i, block) in bytes.chunks_exact_mut(size).enumerate() {
            let mut at = i * meta_len;
            for &(a, b) in spec.meta {
                block[a..b].copy_from_slice(&self.meta[at..at + b - a]);
                at += b - a;
            }
            block[spec.qs.0..spec.qs.1].copy_from_slice(&self.qs[i * qs_len..(i + 1) * qs_len]);
            if let Some((a, b)) = spec.qh {
                block[a..b].copy_from_slice(&self.qh[i * qh_len..(i + 1) * qh_len]);
            }
        }
        bytes
    }
}

fn codes_of<'a>(w: &'a MatrixData, op: &'static str) -> Result<&'a CodedCodes> {
    match &w.codes {
        Codes::Coded(c) => Ok(c),
        _ => Err(RuntimeError::Unsupported(format!(
            "{op}: a matrix of another format reached the look-up-table / GGUF kernels"
        ))),
    }
}

impl CudaBackend {
    /// Dynamic shared memory of the matvec: x padded by 4 floats per 32, then its per-16 sums.
    fn coded_smem(cols: usize) -> usize {
        4 * (cols + cols / CHUNK * 4 + cols / 16)
    }

    #[allow(clippy::too_many_arguments)]
    fn coded_linear(
        &self,
        what: &str,
        (rows, cols): (usize, usize),
        format: usize,
        bpr: usize,
        planes: [&[u8]; 3],
        bias: Option<&[f32]>,
        host_bytes: usize,
    ) -> Result<CudaResidentLinear> {
        let name = CODED_FORMATS[format];
        if !cols.is_multiple_of(CHUNK) {
            return Err(RuntimeError::Unsupported(format!(
                "{what}: the CUDA kernels of {name} take 32-column chunks ({cols} columns); \
                 use --device cpu"
            )));
        }
        let smem = Self::coded_smem(cols);
        if smem > self.dev().smem_optin {
            return Err(RuntimeError::Unsupported(format!(
                "{what}: {cols} columns need {smem} B of shared memory for the {name} matvec, \
                 this GPU allows {}",
                self.dev().smem_optin
            )));
        }
        for v in [rows, cols, bpr] {
            i32_of("coded linear", v)?;
        }
        if let Some(b) = bias {
            check_len("coded linear", "bias", b.len(), rows)?;
        }
        let [meta, qs, qh] = planes;
        let dev = self.dev();
        let codes = CodedCodes {
            format,
            bpr,
            meta: dev.upload_new(meta)?,
            high: if qh.is_empty() {
                None
            } else {
                Some(dev.upload_new(qh)?)
            },
        };
        Ok(CudaResidentLinear {
            weight: CudaMatrix {
                inner: Arc::new(MatrixData {
                    mem: dev.upload_new(qs)?,
                    rows,
                    cols,
                    dtype: DType::F32,
                    codes: Codes::Coded(codes),
                }),
            },
            bias: bias.map(|b| self.upload(b)).transpose()?,
            host_bytes,
            format: name.into(),
        })
    }

    /// Uploads a look-up-table weight (2, 3 or 4 bits); `what` names it in errors.
    pub fn upload_lut_linear(
        &self,
        q: &LutQuantized,
        bias: Option<&[f32]>,
        what: &str,
    ) -> Result<CudaResidentLinear> {
        let format = format_index(&format!("lut{}", q.bits())).ok_or_else(|| {
            RuntimeError::Unsupported(format!(
                "{what}: {}-bit look-up-table codes have no CUDA kernels (2, 3, 4)",
                q.bits()
            ))
        })?;
        let levels = q.levels();
        let mut tables = Vec::with_capacity(4 * q.rows() * levels);
        for (row, &scale) in q.tables().chunks_exact(levels).zip(q.scales()) {
            for v in &row_values(row, scale)[..levels] {
                tables.extend_from_slice(&v.to_le_bytes());
            }
        }
        self.coded_linear(
            what,
            (q.rows(), q.cols()),
            format,
            q.row_bytes(),
            [&tables, q.codes(), &[]],
            bias,
            q.size_in_bytes(),
        )
    }

    /// Uploads a GGUF weight in its blocks, or `None` for a type the kernels do not read.
    pub fn upload_gguf_linear(
        &self,
        t: &BlockTensor,
        bias: Option<&[f32]>,
        what: &str,
    ) -> Result<Option<CudaResidentLinear>> {
        t.check()
            .map_err(|e| RuntimeError::Config(format!("{what}: {e}")))?;
        let Some(planes) = GgufPlanes::split(t) else {
            return Ok(None);
        };
        self.coded_linear(
            what,
            (t.rows, t.cols),
            planes.format,
            t.cols / t.ty.block_size(),
            [&planes.meta, &planes.qs, &planes.qh],
            bias,
            t.bytes.len(),
        )
        .map(Some)
    }

    /// Threads per row set and rows per thread: the widest set a row's chunks fill, narrowed
    /// while the launch still has three blocks per SM.
    fn coded_schedule(&self, cols: usize, rows: &[usize], swiglu: bool) -> (usize, usize) {
        let chunks = cols / CHUNK;
        let widest = chunks
            .div_ceil(UNROLL)
            .next_power_of_two()
            .clamp(NARROWEST_TPR, THREADS);
        let sm = self.dev().sm_count as usize;
        let blocks_for = |tpr: usize, r: usize| -> usize {
            rows.iter().map(|n| n.div_ceil(THREADS / tpr * r)).sum()
        };
        let mut tpr = widest;
        while tpr > NARROWEST_TPR && blocks_for(tpr / 2, 1) >= 3 * sm {
            tpr /= 2;
        }
        let r = if !swiglu && blocks_for(tpr, 2) >= 3 * sm {
            2
        } else {
            1
        };
        (tpr, r)
    }

    /// `y_i = W_i · x (+ b_i) (+ y_i)` for up to three matrices of one coded format, m ≤ 4
    /// token rows, in one launch; with `norm`, x is RMS-normalised inside it.
    pub(super) fn coded_matvec(
        &self,
        x: &CudaBuffer,
        m: usize,
        items: &[(&CudaMatrix, Option<&CudaBuffer>, u64)],
        accumulate: bool,
        norm: Option<(&CudaBuffer, f32)>,
    ) -> Result<()> {
        let Some(first) = items.first() else {
            return Ok(());
        };
        if items.len() > MAX_ITEMS {
            return Err(RuntimeError::Unsupported(format!(
                "coded matvec: {} projections in one launch (at most {MAX_ITEMS})",
                items.len()
            )));
        }
        let w0 = &first.0.inner;
        let codes = codes_of(w0, "coded matvec")?;
        let row_counts: Vec<usize> = items.iter().map(|it| it.0.inner.rows).collect();
        let (tpr, r) = self.coded_schedule(w0.cols, &row_counts, false);
        let per_block = THREADS / tpr * r;
        let mut group = CdGroup::default();
        let mut end = 0usize;
        for (slot, (w, bias, y)) in group.item.iter_mut().zip(items) {
            end += w.inner.rows.div_ceil(per_block);
            *slot = item_of(&w.inner, bias.map_or(0, |b| b.mem.ptr), *y, end)?;
        }
        group.count = items.len() as i32;
        let kernels = &self.k().coded;
        let mut args = vec![Arg::Coded(group), Arg::Ptr(x.mem.ptr)];
        let kernel = match norm {
            None => &kernels.matvec[codes.format][r - 1],
            Some((w, eps)) => {
                args.extend([Arg::Ptr(w.mem.ptr), Arg::F32(eps)]);
                &kernels.matvec_norm[codes.format][r - 1]
            }
        };
        args.extend(shape_args(w0, codes, tpr)?);
        if norm.is_none() {
            args.push(Arg::I32(accumulate as i32));
        }
        self.launch_projection(
            kernel,
            (blocks(end, 1), m as u32, 1),
            (THREADS as u32, 1, 1),
            Self::coded_smem(w0.cols),
            &mut args,
        )
    }

    /// `gate ← silu(W_g · x) ⊙ (W_u · x)` for coded gate and up matrices of one format
    /// (m ≤ 4), optionally with the input norm fused.
    pub(super) fn coded_swiglu(
        &self,
        x: &CudaBuffer,
        m: usize,
        g: &MatrixData,
        u: &MatrixData,
        gate: &mut CudaBuffer,
        norm: Option<(&CudaBuffer, f32)>,
    ) -> Result<()> {
        let codes = codes_of(g, "coded swiglu")?;
        let (tpr, _) = self.coded_schedule(g.cols, &[g.rows], true);
        let grid = g.rows.div_ceil(THREADS / tpr);
        let mut group = CdGroup::default();
        for (slot, w) in group.item.iter_mut().zip([g, u]) {
            *slot = item_of(w, 0, gate.mem.ptr, grid)?;
        }
        group.count = 2;
        let kernels = &self.k().coded;
        let mut args = vec![Arg::Coded(group), Arg::Ptr(x.mem.ptr)];
        let kernel = match norm {
            None => &kernels.swiglu[codes.format],
            Some((w, eps)) => {
                args.extend([Arg::Ptr(w.mem.ptr), Arg::F32(eps)]);
                &kernels.swiglu_norm[codes.format]
            }
        };
        args.extend(shape_args(g, codes, tpr)?);
        self.launch_projection(
            kernel,
            (blocks(grid, 1), m as u32, 1),
            (THREADS as u32, 1, 1),
            Self::coded_smem(g.cols),
            &mut args,
        )
    }

    /// Prefill: the f32 panel of the whole matrix, then the GEMM (which adds the bias).
    pub(super) fn coded_gemm(
        &self,
        x: &CudaBuffer,
        m: usize,
        w: &MatrixData,
        bias: Option<&CudaBuffer>,
        y: &mut CudaBuffer,
        accumulate: bool,
    ) -> Result<()> {
        let c = codes_of(w, "coded gemm")?;
        let panel = self.dev().alloc(4 * w.rows * w.cols)?;
        self.launch(
            &self.k().coded.dequant_f32[c.format],
            (blocks(w.rows * (w.cols / CHUNK), 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [
                Arg::CodedItem(item_of(w, 0, 0, 0)?),
                Arg::Ptr(panel.ptr),
                Arg::I32(i32_of("coded gemm", w.cols)?),
                Arg::I32(i32_of("coded gemm", c.bpr)?),
            ],
        )?;
        // The panel's stream-ordered free follows the GEMM on the same stream.
        self.gemm(
            x,
            m,
            WeightRef::tf32_panel(&panel, w.rows, w.cols),
            bias,
            y,
            accumulate,
        )
    }

    /// `out[t, :] = Ŵ[tokens[t], :]` from a coded table (a tied embedding).
    pub(super) fn coded_gather(
        &self,
        w: &MatrixData,
        tokens: &super::CudaIndex,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let c = codes_of(w, "embedding")?;
        let ntok = tokens.grid_rows()?;
        if ntok == 0 {
            return Ok(());
        }
        self.launch(
            &self.k().coded.gather_f32[c.format],
            (blocks(w.cols / CHUNK, 64), ntok, 1),
            (64, 1, 1),
            0,
            &mut [
                Arg::CodedItem(item_of(w, 0, 0, 0)?),
                Arg::Ptr(tokens.mem.ptr),
                Arg::Ptr(out.mem.ptr),
                Arg::I32(i32_of("embedding", w.cols)?),
                Arg::I32(i32_of("embedding", c.bpr)?),
            ],
        )
    }
}

/// The kernels' item of `w` writing `y` (with `bias`; 0: none), its blocks ending at `end`.
fn item_of(w: &MatrixData, bias: u64, y: u64, end: usize) -> Result<CdItem> {
    let c = codes_of(w, "coded kernels")?;
    Ok(CdItem {
        meta: c.meta.ptr,
        qs: w.mem.ptr,
        qh: c.high.as_ref().map_or(0, |h| h.ptr),
        bias,
        y,
        rows: i32_of("coded kernels", w.rows)?,
        block_end: i32_of("coded kernels", end)?,
    })
}

/// The matvecs' shape arguments after the operands: columns, `bpr`, threads per row set.
fn shape_args(w: &MatrixData, c: &CodedCodes, tpr: usize) -> Result<[Arg; 3]> {
    Ok([
        Arg::I32(i32_of("coded matvec", w.cols)?),
        Arg::I32(i32_of("coded matvec", c.bpr)?),
        Arg::I32(tpr as i32),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels' field sizes (`Fmt*::META`, `QS`, `QH` in kernels/coded.cu): a change on
    /// either side shows here.
    const KERNEL_PLANES: [(GgmlType, usize, usize, usize); 10] = [
        (GgmlType::Q4_0, 2, 16, 0),
        (GgmlType::Q4_1, 4, 16, 0),
        (GgmlType::Q5_0, 2, 16, 4),
        (GgmlType::Q5_1, 4, 16, 4),
        (GgmlType::Q8_0, 2, 32, 0),
        (GgmlType::Q2K, 20, 64, 0),
        (GgmlType::Q3K, 14, 64, 32),
        (GgmlType::Q4K, 16, 128, 0),
        (GgmlType::Q5K, 16, 128, 32),
        (GgmlType::Q6K, 18, 128, 64),
    ];

    #[test]
    fn every_block_byte_lands_in_one_plane_and_back() {
        for (ty, meta, qs, qh) in KERNEL_PLANES {
            let (rows, cols) = (3, 2 * ty.block_size());
            let n = rows * cols / ty.block_size() * ty.type_size();
            // Distinct bytes per position, so a misplaced field cannot go unnoticed.
            let bytes: Vec<u8> = (0..n).map(|i| (i * 7 + i / 251) as u8).collect();
            let t = BlockTensor {
                ty,
                rows,
                cols,
                bytes: bytes.clone(),
            };
            let planes = GgufPlanes::split(&t).expect("a block type");
            let blocks = n / ty.type_size();
            assert_eq!(meta + qs + qh, ty.type_size(), "{ty}");
            assert_eq!(planes.meta.len(), blocks * meta, "{ty} meta");
            assert_eq!(planes.qs.len(), blocks * qs, "{ty} qs");
            assert_eq!(planes.qh.len(), blocks * qh, "{ty} qh");
            assert_eq!(planes.join(ty), bytes, "{ty}");
            assert_eq!(
                CODED_FORMATS[planes.format],
                ty.to_string().to_lowercase(),
                "{ty}"
            );
        }
    }

    #[test]
    fn other_types_have_no_planes() {
        for ty in [GgmlType::F16, GgmlType::IQ4NL, GgmlType::F32] {
            let t = BlockTensor {
                ty,
                rows: 1,
                cols: ty.block_size(),
                bytes: vec![0; ty.type_size()],
            };
            assert!(GgufPlanes::split(&t).is_none(), "{ty}");
        }
    }
}

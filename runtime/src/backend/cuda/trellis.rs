//! Trellis-coded projections (QTIP / YAQA tiles) on the CUDA backend, inside a [`CudaMatrix`]
//! (no dequantized copy), so every projection op of the backend takes them: q/k/v share one
//! launch of each stage, gate/up end in SwiGLU, the input RMSNorm folds into the input
//! transform, the residual add into the output transform. Decode (m ≤ 4 tokens) runs two or
//! three launches per projection set (kernels/trellis.cu): `tr_prepare` (norm, signs, H_in,
//! f16 planes; only for inputs with a dense Hadamard factor — the matvec's prologue transforms
//! power-of-two inputs), `tr_matvec` (tiles decoded into tensor-core fragments), `tr_finish`
//! (H_outᵀ, signs and scale, bias, store / add / SwiGLU). Prefill runs the same two transforms
//! around `tr_gemm`, which decodes each tile once into tensor-core fragments for 64 or 128
//! tokens.

use super::device::DeviceMem;
use super::group::{refine_scratch_bytes, RefineOperand};
use super::resident::CudaResidentLinear;
use super::trellis_layout::{pack_units, units, UNIT_COLS};
use super::{
    blocks, i32_of, Arg, Codes, CudaBackend, CudaBuffer, CudaMatrix, MatrixData, MATVEC_MAX_TOKENS,
    MAX_GRID_YZ,
};
use crate::backend::Backend;
use crate::error::{check_len, Result, RuntimeError};
use crate::resident::trellis::ONE_MAD_SCALE;
use sfx_formats::resident::{Rotation, SmallHadamard, TileOrder, TrellisCode, TrellisQuantized};
use sfx_formats::DType;
use std::sync::Arc;

/// Projections one launch takes (`TR_MAX_ITEMS`).
const MAX_ITEMS: usize = 3;
/// Threads of a matvec block (`TrMvShape`): 32 warps for 2-bit codes in one-row groups, 16
/// otherwise (the wider codes' registers).
fn mv_threads(k: u8, r: usize) -> usize {
    if k == 2 && r == 1 {
        1024
    } else {
        512
    }
}
/// HYB table rows the kernels take (`TR_HYB_Q`), and the table in shared memory: the rows
/// twice (the second time with the sign flip folded in), 32 copies (`TR_LUT_WORDS`).
const HYB_Q: u8 = 9;
const LUT_BYTES: usize = (2 << HYB_Q) * 32 * 4;
/// Padding between planes, in words (`TR_PLANE_PAD_WORDS`).
const PLANE_PAD_WORDS: usize = 8;
/// Zeros the row-major B loads read in place of a plane (`TR_ZERO_WORDS`).
const ZERO_WORDS: usize = 16 * 8;
/// Longest row of a transform row block (`TR_ROW_MAX`).
const ROW_MAX: usize = 512;
/// The prefill GEMM's block: tile rows (one a warp, `TR_GEMM_WARPS`).
const GEMM_WARPS: usize = 8;

/// Shared memory of a prefill GEMM block of `tokens` (64 or 128) tokens (`TrGemmShape`): the
/// compact HYB table and two stages of 16 (64 tokens) or 8 tiles (128) per token row, each
/// row 8 words a tile + 8.
fn gemm_smem(tokens: usize) -> usize {
    let stage_tiles = if tokens == 64 { 16 } else { 8 };
    ((1 << HYB_Q) + 2 * tokens * (stage_tiles * 8 + 8)) * 4
}

/// A dense ±1 Hadamard factor on the device (None for m = 1: a plain Walsh–Hadamard
/// transform).
struct DeviceFactor {
    entries: Option<DeviceMem>,
    /// The order of the dense factor, or under a block rotation the number of blocks (the
    /// kernels read `m > 1` without entries as the identity: no mix across rows).
    m: usize,
    /// Length of the transformed blocks under a block rotation, 0 for a full transform.
    block: usize,
    /// The transform's normalisation, `1/√n` (full) or `1/√b` (blocks).
    inv_sqrt: f32,
}

impl DeviceFactor {
    fn ptr(&self) -> u64 {
        self.entries.as_ref().map_or(0, |e| e.ptr)
    }

    /// Same transform of the same order (items of one launch share its normalisation).
    fn same_as(&self, other: &DeviceFactor) -> bool {
        self.m == other.m
            && self.block == other.block
            && self.entries.is_some() == other.entries.is_some()
    }
}

/// Block lengths the CUDA kernels transform under a block rotation (a warp holds a block in
/// its registers, 1–8 values a lane).
const ROTATION_BLOCKS: [usize; 4] = [32, 64, 128, 256];

/// What a trellis-coded [`CudaMatrix`] holds beside its packed tiles.
pub(super) struct TrellisCodes {
    code: TrellisCode,
    k: u8,
    order: TileOrder,
    n_units: usize,
    /// HYB's table as f16 pairs (low half the first value); None for computed codes.
    lut: Option<DeviceMem>,
    su: DeviceMem,
    /// Output signs × weight scale × the code's value scale (1MAD computes integers).
    sv: DeviceMem,
    had_in: DeviceFactor,
    had_out: DeviceFactor,
    /// Decode scratch for up to `MATVEC_MAX_TOKENS` tokens: the input planes (hi, lo f16), their
    /// scales σ, and the rotated outputs Ŵ·x'σ.
    planes: DeviceMem,
    sigma: DeviceMem,
    rotated: DeviceMem,
}

impl TrellisCodes {
    pub(super) fn same_format(&self, other: &TrellisCodes) -> bool {
        self.code == other.code && self.k == other.k && self.order == other.order
    }

    fn code_index(&self) -> usize {
        match self.code {
            TrellisCode::Hyb { .. } => 0,
            TrellisCode::OneMad => 1,
            TrellisCode::ThreeInst => 2,
        }
    }

    fn k_index(&self) -> usize {
        usize::from(self.k) - 2
    }

    fn mma(&self) -> bool {
        self.order == TileOrder::Mma
    }

    fn pcols(&self) -> usize {
        self.n_units * UNIT_COLS
    }

    fn lut_ptr(&self) -> u64 {
        self.lut.as_ref().map_or(0, |l| l.ptr)
    }
}

/// The kernels' `TrItem` / `TrGroup` (kernels/trellis.cu), passed by value.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct TrItem {
    codes: u64,
    planes: u64,
    y: u64,
    su: u64,
    sigma: u64,
    rows: i32,
    group_end: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct TrGroup {
    item: [TrItem; MAX_ITEMS],
    count: i32,
}

/// The kernels' `TrPrepItem` / `TrPrep`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct TrPrepItem {
    su: u64,
    hm: u64,
    m: i32,
    planes: u64,
    sigma: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct TrPrep {
    item: [TrPrepItem; MAX_ITEMS],
    count: i32,
}

/// The kernels' `TrFinishItem` / `TrFinish`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct TrFinishItem {
    rot: u64,
    sigma: u64,
    sv: u64,
    hm: u64,
    bias: u64,
    y: u64,
    m: i32,
    n: i32,
    inv_sqrt_n: f32,
    refine: RefineOperand,
    rx: u64,
    rnw: u64,
    reps: f32,
    rlen: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct TrFinish {
    item: [TrFinishItem; MAX_ITEMS],
    count: i32,
}

/// A decode row's refinements for `tr_finish`: each item's operand (or none) and the
/// projections' input with its norm, from which the finish gathers the selected values.
struct FinishRefinement<'a> {
    operands: &'a [Option<RefineOperand>],
    x: &'a CudaBuffer,
    norm: Option<(&'a CudaBuffer, f32)>,
}

fn trellis_of<'a>(w: &'a MatrixData, op: &'static str) -> Result<&'a TrellisCodes> {
    match &w.codes {
        Codes::Trellis(c) => Ok(c),
        _ => Err(RuntimeError::Unsupported(format!(
            "{op}: a matrix of another format reached the trellis kernels"
        ))),
    }
}

/// `1/√n` as the CPU transform rounds it (`hadamard.rs`).
fn inv_sqrt(n: usize) -> f32 {
    (1.0 / (n as f64).sqrt()) as f32
}

/// The kernels' `row_view` of a transform over n = m·p values: (P = min(p, 512), n/P rows).
fn row_view(n: usize, m: usize) -> (usize, usize) {
    let row = (n / m.max(1)).clamp(1, ROW_MAX);
    (row, (n / row).max(1))
}

/// Output rows a decode transform block takes (the kernels' `RB · P`).
fn block_rows(n: usize, m: usize) -> usize {
    let (row, rows) = row_view(n, m);
    (ROW_MAX / row).min(rows) * row
}

/// Most shared memory a refined finish's read-ahead operands take (`TR_READ_AHEAD_MAX`): past
/// it the finish reads its operand the old way, in refine_rows' scratch.
const FINISH_READ_AHEAD_MAX: usize = 40960;

/// Row blocks of a transform over n = m·p values (the kernels' `row_view`): rows of
/// P = min(p, 512) values, min(512/P, rows) of them per block, one thread a value. Returns
/// (blocks, threads).
fn row_blocks(n: usize, m: usize) -> (u32, u32) {
    let (row, rows) = row_view(n, m);
    let per_block = (ROW_MAX / row).min(rows);
    (
        rows.div_ceil(per_block) as u32,
        (per_block * row).next_multiple_of(32) as u32,
    )
}

/// A launch's (grid, block) dimensions.
type LaunchDims = ((u32, u32, u32), (u32, u32, u32));

/// The launch grid of a transform over `items` row views (n, m) and `tokens` vectors: the
/// widest item's blocks and threads (blocks past an item's rows return at once).
fn transform_grid(
    what: &str,
    views: impl Iterator<Item = (usize, usize)>,
    items: usize,
    tokens: usize,
) -> Result<LaunchDims> {
    let (blocks, threads) = views
        .map(|(n, m)| row_blocks(n, m))
        .fold((1, 32), |a, b| (a.0.max(b.0), a.1.max(b.1)));
    let z = u32::try_from(tokens)
        .ok()
        .filter(|&z| z <= MAX_GRID_YZ)
        .ok_or_else(|| {
            RuntimeError::Unsupported(format!(
                "{what}: {tokens} tokens in one launch (at most {MAX_GRID_YZ})"
            ))
        })?;
    Ok(((blocks, items as u32, z), (threads, 1, 1)))
}

/// Words of one plane in the matvec's shared memory.
fn plane_words(pcols: usize) -> usize {
    pcols / 2 + PLANE_PAD_WORDS
}

/// Shared memory of a matvec launch of `threads`: the HYB table's copies, two planes per item,
/// the zeros row-major B loads read, and every warp's partial rows of `gpb` groups of `r` tile
/// rows — a region the input transform of `prologue_cols` columns (with its row pads and
/// reduction slots) borrows first where the matvec runs it.
fn matvec_smem(
    hyb: bool,
    items: usize,
    pcols: usize,
    gpb: usize,
    r: usize,
    threads: usize,
    prologue_cols: Option<usize>,
) -> usize {
    let lut = if hyb { LUT_BYTES } else { 0 };
    let partials = threads / 32 * gpb * r * 16;
    // The transform's buffer: n values, a pad float per warp row, 64 reduction slots.
    let region = prologue_cols.map_or(partials, |n| partials.max(n + 128));
    lut + (items * 2 * plane_words(pcols) + ZERO_WORDS + region) * 4
}

/// A prefill's per-token buffers in place of a matrix's decode scratch: `values` (what
/// tr_prepare writes: f16 planes [m][2][pcols]; what tr_finish reads: rotated outputs
/// [m][rows]) and the planes' scales σ [m].
#[derive(Clone, Copy)]
struct PrefillBuffers {
    values: u64,
    sigma: u64,
}

/// The input transform a matvec runs in its prologue: the raw input and the fused norm.
#[derive(Clone, Copy)]
struct Prologue<'a> {
    x: &'a CudaBuffer,
    norm: Option<(&'a CudaBuffer, f32)>,
}

impl CudaBackend {
    /// Uploads `q` (and `bias`); `what` names the projection in errors.
    pub fn upload_trellis_linear(
        &self,
        q: &TrellisQuantized,
        bias: Option<&[f32]>,
        what: &str,
    ) -> Result<CudaResidentLinear> {
        let (rows, cols) = (q.rows(), q.cols());
        let s = q.scheme();
        let refuse =
            |why: String| RuntimeError::Unsupported(format!("{what}: {why}; use --device cpu"));
        if self.dev().compute.0 < 8 {
            return Err(refuse(format!(
                "trellis-coded weights run on tensor-core f16 MMAs (compute capability 8.0+), \
                 this GPU is {}.{}",
                self.dev().compute.0,
                self.dev().compute.1
            )));
        }
        if !(2..=4).contains(&s.k) || s.l != 16 {
            return Err(refuse(format!(
                "the CUDA trellis kernels take K = 2–4 bits with 16-bit states (this projection: \
                 K = {}, L = {})",
                s.k, s.l
            )));
        }
        if let TrellisCode::Hyb { q: tq } = s.code {
            if tq != HYB_Q || q.tlut().len() != 2 << HYB_Q {
                return Err(refuse(format!(
                    "the CUDA trellis kernels take HYB tables of 2^{HYB_Q} rows (this one: 2^{tq})"
                )));
            }
        }
        let optin = self.dev().smem_optin;
        let n_units = units(cols);
        let pcols = n_units * UNIT_COLS;
        let hyb = matches!(s.code, TrellisCode::Hyb { .. });
        let need = matvec_smem(hyb, 1, pcols, 1, 1, 1024, None);
        if need > optin {
            return Err(refuse(format!(
                "{rows}×{cols} needs {need} B of shared memory for its matvec, this GPU \
                 allows {optin}"
            )));
        }
        for v in [rows, cols, pcols, n_units] {
            i32_of("trellis_linear", v)?;
        }
        if let Some(b) = bias {
            check_len("trellis_linear", "bias", b.len(), rows)?;
        }
        let upload = |bytes: &[u8]| self.dev().upload_new(bytes);
        let upload_f32 = |v: &[f32]| upload(bytemuck::cast_slice(v));
        let factor = |f: &SmallHadamard, n: usize| -> Result<DeviceFactor> {
            if s.rotation != Rotation::Full {
                let block = s.rotation.block_len(n);
                if !ROTATION_BLOCKS.contains(&block) {
                    return Err(refuse(format!(
                        "a block rotation of {n} values in blocks of {block} (the CUDA kernels \
                         take blocks of {ROTATION_BLOCKS:?})"
                    )));
                }
                return Ok(DeviceFactor {
                    entries: None,
                    m: n / block,
                    block,
                    inv_sqrt: inv_sqrt(block),
                });
            }
            let m = f.order();
            let entries = if m > 1 {
                let e: Vec<f32> = f.entries().iter().map(|&v| f32::from(v)).collect();
                Some(upload_f32(&e)?)
            } else {
                None
            };
            Ok(DeviceFactor {
                entries,
                m,
                block: 0,
                inv_sqrt: inv_sqrt(n),
            })
        };
        let packed = pack_units(q);
        let mem = upload(bytemuck::cast_slice(&packed))?;
        let lut = if hyb {
            let words: Vec<u32> = q
                .tlut()
                .chunks_exact(2)
                .map(|p| u32::from(p[0].to_bits()) | u32::from(p[1].to_bits()) << 16)
                .collect();
            Some(upload(bytemuck::cast_slice(&words))?)
        } else {
            None
        };
        // 1MAD's values are integers on the device: its scale goes with sv.
        let code_scale = if s.code == TrellisCode::OneMad {
            ONE_MAD_SCALE
        } else {
            1.0
        };
        let su: Vec<f32> = q.su().iter().map(|v| v.to_f32()).collect();
        let sv: Vec<f32> = q.sv().iter().map(|v| v * code_scale).collect();
        let codes = TrellisCodes {
            code: s.code,
            k: s.k,
            order: s.order,
            n_units,
            lut,
            su: upload_f32(&su)?,
            sv: upload_f32(&sv)?,
            had_in: factor(q.had_in(), cols)?,
            had_out: factor(q.had_out(), rows)?,
            planes: self.dev().alloc_zeroed(MATVEC_MAX_TOKENS * 2 * pcols * 2)?,
            sigma: self.dev().alloc_zeroed(MATVEC_MAX_TOKENS * 4)?,
            rotated: self.dev().alloc_zeroed(MATVEC_MAX_TOKENS * rows * 4)?,
        };
        Ok(CudaResidentLinear {
            weight: CudaMatrix {
                inner: Arc::new(MatrixData {
                    mem,
                    rows,
                    cols,
                    dtype: DType::F32,
                    codes: Codes::Trellis(codes),
                }),
            },
            bias: bias.map(|b| self.upload(b)).transpose()?,
            host_bytes: q.size_in_bytes(),
            format: s.name(),
        })
    }

    /// The input transform of up to three items over the same x (m tokens): the planes and
    /// scales each item's matvec reads, or (prefill) those of `PrefillBuffers`.
    fn trellis_prepare(
        &self,
        x: &CudaBuffer,
        m: usize,
        items: &[(&MatrixData, Option<PrefillBuffers>)],
        norm: Option<(&CudaBuffer, f32)>,
    ) -> Result<()> {
        let w0 = items[0].0;
        let c0 = trellis_of(w0, "trellis prepare")?;
        let n = w0.cols;
        let mut p = TrPrep {
            count: items.len() as i32,
            ..TrPrep::default()
        };
        let mut views = Vec::with_capacity(items.len());
        for (slot, (w, out)) in p.item.iter_mut().zip(items) {
            let c = trellis_of(w, "trellis prepare")?;
            if !c.had_in.same_as(&c0.had_in) {
                return Err(RuntimeError::Unsupported(format!(
                    "trellis prepare: projections of {n} inputs with different input transforms \
                     in one launch"
                )));
            }
            views.push((n, c.had_in.m));
            *slot = TrPrepItem {
                su: c.su.ptr,
                hm: c.had_in.ptr(),
                m: i32_of("trellis prepare", c.had_in.m)?,
                planes: out.map_or(c.planes.ptr, |o| o.values),
                sigma: out.map_or(c.sigma.ptr, |o| o.sigma),
            };
        }
        let k = &self.k().trellis;
        let order = usize::from(c0.mma());
        let mut args = vec![Arg::TrellisPrep(p), Arg::Ptr(x.mem.ptr)];
        let tail = [
            Arg::I32(i32_of("trellis prepare", n)?),
            Arg::I32(i32_of("trellis prepare", c0.pcols())?),
            Arg::F32(c0.had_in.inv_sqrt),
        ];
        if norm.is_none() {
            if let Some(((grid, block), smem)) = self.token_transform_dims(&views, m)? {
                args.extend(tail);
                return self.launch(&k.prepare_tokens[order], grid, block, smem, &mut args);
            }
        }
        let kernel = match norm {
            None => &k.prepare[0][order],
            Some((w, eps)) => {
                args.extend([Arg::Ptr(w.mem.ptr), Arg::F32(eps)]);
                &k.prepare[1][order]
            }
        };
        args.extend(tail);
        let (grid, block) = transform_grid("trellis prepare", views.into_iter(), items.len(), m)?;
        self.launch_dependent(self.inner.pdl.trellis, kernel, grid, block, 0, &mut args)
    }

    /// The output transform of up to three items (m tokens), reading each item's rotated
    /// outputs and σ at `rot` (None: its decode scratch): `y (+)= …`, or with `swiglu` (items
    /// gate, up) `y_gate = silu(g)·u`.
    fn trellis_finish(
        &self,
        m: usize,
        items: &[(
            &MatrixData,
            Option<PrefillBuffers>,
            Option<&CudaBuffer>,
            u64,
        )],
        accumulate: bool,
        swiglu: bool,
        refine: Option<FinishRefinement<'_>>,
    ) -> Result<()> {
        let mut f = TrFinish {
            count: items.len() as i32,
            ..TrFinish::default()
        };
        let mut views = Vec::with_capacity(items.len());
        for (k, (slot, (w, rot, bias, y))) in f.item.iter_mut().zip(items).enumerate() {
            let c = trellis_of(w, "trellis finish")?;
            views.push((w.rows, c.had_out.m));
            *slot = TrFinishItem {
                rot: rot.map_or(c.rotated.ptr, |r| r.values),
                sigma: rot.map_or(c.sigma.ptr, |r| r.sigma),
                sv: c.sv.ptr,
                hm: c.had_out.ptr(),
                bias: bias.map_or(0, |b| b.mem.ptr),
                y: *y,
                m: i32_of("trellis finish", c.had_out.m)?,
                n: i32_of("trellis finish", w.rows)?,
                inv_sqrt_n: c.had_out.inv_sqrt,
                ..TrFinishItem::default()
            };
            if let Some(r) = refine.as_ref().filter(|_| m == 1) {
                if let Some(op) = r.operands.get(k).copied().flatten() {
                    slot.refine = op;
                    slot.rx = r.x.mem.ptr;
                    slot.rlen = i32_of("trellis finish", r.x.len)?;
                    if let Some((nw, eps)) = r.norm {
                        slot.rnw = nw.mem.ptr;
                        slot.reps = eps;
                    }
                }
            }
        }
        let k = &self.k().trellis;
        let rf = RefineOperand::entry(f.item.iter().map(|it| &it.refine));
        let (kernel, launched, mut args) = if swiglu {
            (&k.finish_swiglu[rf], 1, vec![Arg::TrellisFinish(f)])
        } else {
            (
                &k.finish[rf],
                items.len(),
                vec![Arg::TrellisFinish(f), Arg::I32(accumulate as i32)],
            )
        };
        if !swiglu && refine.is_none() {
            if let Some(((grid, block), smem)) = self.token_transform_dims(&views, m)? {
                return self.launch(&k.finish_tokens, grid, block, smem, &mut args);
            }
        }
        let (grid, block) = transform_grid("trellis finish", views.iter().copied(), launched, m)?;
        // A refined finish's deltas ([items][ROW_MAX]), then refine_rows' scratch or the
        // read-ahead regions of its operands (a SwiGLU block reads both items', any other
        // block its own item's), whichever is larger.
        let refined = f.item.iter().any(|it| it.refine.has_columns());
        let smem = if refined {
            // The kernel reads ahead only where its block's regions fit the cap.
            let ahead = f.item[..items.len()]
                .iter()
                .zip(&views)
                .map(|(it, &(n, m))| it.refine.read_ahead_bytes(block_rows(n, m)));
            let ahead = if swiglu {
                Some(ahead.sum()).filter(|&t| t <= FINISH_READ_AHEAD_MAX)
            } else {
                ahead.filter(|&b| b <= FINISH_READ_AHEAD_MAX).max()
            };
            let scratch = refine_scratch_bytes(block.0 as usize).max(ahead.unwrap_or(0));
            4 * ROW_MAX * if swiglu { 2 } else { 1 } + scratch
        } else {
            0
        };
        self.launch_dependent(self.inner.pdl.trellis, kernel, grid, block, smem, &mut args)
    }

    /// The launch of a prefill transform (`tr_prepare_tokens`, `tr_finish_tokens`) over items
    /// of row views `(n, m)`: one block per (token, item), with two copies of the vector and
    /// the row mix's coefficients in shared memory. None for decode (m ≤ 4: the row blocks
    /// spread a vector over SMs) or where that does not fit.
    fn token_transform_dims(
        &self,
        views: &[(usize, usize)],
        tokens: usize,
    ) -> Result<Option<(LaunchDims, usize)>> {
        let floats = |&(n, m): &(usize, usize)| {
            let (_, rows) = row_view(n, m);
            2 * n + rows * rows.next_multiple_of(4)
        };
        let smem = 4 * views.iter().map(floats).max().unwrap_or(0);
        let n = views.iter().map(|v| v.0).max().unwrap_or(0);
        // The kernels' static reduction slots come out of the same opt-in limit.
        if tokens <= MATVEC_MAX_TOKENS
            || !self.inner.trellis_token_transforms
            || smem + 256 > self.dev().smem_optin
        {
            return Ok(None);
        }
        let grid_x = u32::try_from(tokens).map_err(|_| {
            RuntimeError::Unsupported(format!("trellis transform: {tokens} tokens in one launch"))
        })?;
        let threads = n.next_multiple_of(32).min(ROW_MAX) as u32;
        Ok(Some((
            ((grid_x, views.len() as u32, 1), (threads, 1, 1)),
            smem,
        )))
    }

    /// Tokens per block of the prefill GEMM: 128 where that still gives every SM work.
    fn trellis_gemm_tokens(&self, m: usize) -> usize {
        self.inner
            .trellis_gemm_tokens
            .unwrap_or(if m >= 256 { 128 } else { 64 })
    }

    /// Tile rows per row group of a matvec (`SFX_TR_ROWS` = 1 or 2 forces it): two share
    /// each x fragment between two MMAs but hold twice the codes in registers.
    fn trellis_rows(&self) -> usize {
        self.inner.trellis_rows.unwrap_or(1)
    }

    /// The decode matvec of up to three items of one format: each item's rotated outputs land
    /// in its scratch. With `prologue` the blocks run the input transform themselves and
    /// false comes back if they cannot (a dense factor, or shared memory): then
    /// `trellis_prepare` must run first and the matvec is launched again without it.
    fn trellis_launch_matvec(
        &self,
        m: usize,
        items: &[&MatrixData],
        prologue: Option<Prologue<'_>>,
    ) -> Result<bool> {
        let w0 = items[0];
        let c0 = trellis_of(w0, "trellis matvec")?;
        let r = self.trellis_rows();
        let mut g = TrGroup {
            count: items.len() as i32,
            ..TrGroup::default()
        };
        let mut end = 0usize;
        let mut dense_input = false;
        for (slot, w) in g.item.iter_mut().zip(items) {
            let c = trellis_of(w, "trellis matvec")?;
            if !c.had_in.same_as(&c0.had_in) {
                return Err(RuntimeError::Unsupported(format!(
                    "trellis matvec: projections of {} inputs with different input transforms \
                     in one launch",
                    w0.cols
                )));
            }
            dense_input |= c.had_in.entries.is_some();
            end += (w.rows / 16).div_ceil(r);
            *slot = TrItem {
                codes: w.mem.ptr,
                planes: c.planes.ptr,
                y: c.rotated.ptr,
                su: c.su.ptr,
                sigma: c.sigma.ptr,
                rows: i32_of("trellis matvec", w.rows)?,
                group_end: i32_of("trellis matvec", end)?,
            };
        }
        if prologue.is_some() && (dense_input || !self.inner.trellis_prologue) {
            return Ok(false);
        }
        let total = end;
        if total == 0 {
            return Ok(true);
        }
        let k = &self.k().trellis;
        let kernel = &k.matvec[c0.code_index()][c0.k_index()][usize::from(c0.mma())][r - 1];
        let hyb = c0.lut.is_some();
        let pcols = c0.pcols();
        let optin = self.dev().smem_optin;
        let threads = mv_threads(c0.k, r);
        // A block rotation's prologue transforms in registers: only the reduction slots.
        let prologue_cols = prologue.map(|_| if c0.had_in.block > 0 { 0 } else { w0.cols });
        let smem_for =
            |gpb: usize| matvec_smem(hyb, items.len(), pcols, gpb, r, threads, prologue_cols);
        // Enough row groups per block that the grid fills the GPU once (a block's table copies
        // and planes are paid once per block), fewer if the partial sums would not fit.
        let per_sm = kernel.blocks_per_sm(threads, smem_for(1)).max(1);
        let target = self.dev().sm_count as usize * per_sm;
        let mut gpb = total.div_ceil(target).max(1);
        while gpb > 1 && smem_for(gpb) > optin {
            gpb = gpb.div_ceil(2);
        }
        let smem = smem_for(gpb);
        if smem > optin {
            if prologue.is_some() {
                return Ok(false);
            }
            return Err(RuntimeError::Unsupported(format!(
                "trellis matvec: {} items of {} columns need {smem} B of shared memory, this \
                 GPU allows {optin}",
                items.len(),
                w0.cols
            )));
        }
        let (x, nw, eps) = match prologue {
            Some(p) => (
                p.x.mem.ptr,
                p.norm.map_or(0, |(w, _)| w.mem.ptr),
                p.norm.map_or(0.0, |(_, e)| e),
            ),
            None => (0, 0, 0.0),
        };
        self.launch_dependent(
            self.inner.pdl.trellis,
            kernel,
            (blocks(total, gpb), m as u32, 1),
            (threads as u32, 1, 1),
            smem,
            &mut [
                Arg::Trellis(g),
                Arg::Ptr(c0.lut_ptr()),
                Arg::I32(i32_of("trellis matvec", c0.n_units)?),
                Arg::I32(i32_of("trellis matvec", gpb)?),
                Arg::I32(i32_of("trellis matvec", total)?),
                Arg::Ptr(x),
                Arg::Ptr(nw),
                Arg::F32(eps),
                Arg::I32(i32_of("trellis matvec", w0.cols)?),
                Arg::F32(c0.had_in.inv_sqrt),
                Arg::I32(i32_of("trellis matvec", c0.had_in.block)?),
            ],
        )?;
        Ok(true)
    }

    /// The input transform and the matvec of up to three items over the same x: in one
    /// launch where the matvec can run the transform, else tr_prepare then the matvec.
    fn trellis_transform_matvec(
        &self,
        x: &CudaBuffer,
        m: usize,
        ws: &[&MatrixData],
        norm: Option<(&CudaBuffer, f32)>,
    ) -> Result<()> {
        if self.trellis_launch_matvec(m, ws, Some(Prologue { x, norm }))? {
            return Ok(());
        }
        let prep: Vec<(&MatrixData, Option<PrefillBuffers>)> =
            ws.iter().map(|w| (*w, None)).collect();
        self.trellis_prepare(x, m, &prep, norm)?;
        self.trellis_launch_matvec(m, ws, None).map(|_| ())
    }

    /// `y_i (+)= W_i · x (+ b_i)` for up to three trellis matrices of one format, m ≤ 4 token
    /// rows; with `norm`, x is RMS-normalised inside the input transform.
    pub(super) fn trellis_matvec(
        &self,
        x: &CudaBuffer,
        m: usize,
        items: &[(&CudaMatrix, Option<&CudaBuffer>, u64)],
        accumulate: bool,
        norm: Option<(&CudaBuffer, f32)>,
        refine: &[Option<RefineOperand>],
    ) -> Result<()> {
        if items.is_empty() {
            return Ok(());
        }
        if items.len() > MAX_ITEMS || m > MATVEC_MAX_TOKENS {
            return Err(RuntimeError::Unsupported(format!(
                "trellis matvec: {} projections of {m} tokens in one launch (at most \
                 {MAX_ITEMS} of {MATVEC_MAX_TOKENS})",
                items.len()
            )));
        }
        let ws: Vec<&MatrixData> = items.iter().map(|it| &*it.0.inner).collect();
        self.trellis_transform_matvec(x, m, &ws, norm)?;
        let fin: Vec<_> = items
            .iter()
            .map(|(w, bias, y)| (&*w.inner, None, *bias, *y))
            .collect();
        let refine = refine
            .iter()
            .any(Option::is_some)
            .then_some(FinishRefinement {
                operands: refine,
                x,
                norm,
            });
        self.trellis_finish(m, &fin, accumulate, false, refine)
    }

    /// `gate ← silu(W_g · x) ⊙ (W_u · x)` for trellis gate and up matrices of one format (m ≤
    /// 4), optionally with the input norm fused.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn trellis_swiglu(
        &self,
        x: &CudaBuffer,
        m: usize,
        g: &MatrixData,
        u: &MatrixData,
        gate: &mut CudaBuffer,
        norm: Option<(&CudaBuffer, f32)>,
        refine: Option<[RefineOperand; 2]>,
    ) -> Result<()> {
        let (gc, uc) = (
            trellis_of(g, "trellis swiglu")?,
            trellis_of(u, "trellis swiglu")?,
        );
        if !gc.had_out.same_as(&uc.had_out) {
            return Err(RuntimeError::Unsupported(format!(
                "trellis swiglu: gate and up of {} rows with different output transforms \
                 (orders {} and {}, blocks {} and {})",
                g.rows, gc.had_out.m, uc.had_out.m, gc.had_out.block, uc.had_out.block
            )));
        }
        self.trellis_transform_matvec(x, m, &[g, u], norm)?;
        let operands = refine.map(|r| r.map(Some));
        let refine = operands.as_ref().map(|ops| FinishRefinement {
            operands: ops,
            x,
            norm,
        });
        self.trellis_finish(
            m,
            &[(g, None, None, gate.mem.ptr), (u, None, None, gate.mem.ptr)],
            false,
            true,
            refine,
        )
    }

    /// Prefill (m > 4): the input transform into f16 planes, `tr_gemm` (each tile decoded
    /// once per 64 or 128 tokens into tensor-core fragments), then the output transform (with
    /// the bias and the residual add).
    pub(super) fn trellis_gemm(
        &self,
        x: &CudaBuffer,
        m: usize,
        w: &MatrixData,
        bias: Option<&CudaBuffer>,
        y: &mut CudaBuffer,
        accumulate: bool,
    ) -> Result<()> {
        let c = trellis_of(w, "trellis gemm")?;
        let (rows, cols) = (w.rows, w.cols);
        let pcols = c.pcols();
        // Columns past the matrix stay zero in the planes, as in the decode scratch: the GEMM
        // skips their tiles, but its stages copy them.
        let planes = if pcols > cols {
            self.dev().alloc_zeroed(2 * m * 2 * pcols)?
        } else {
            self.dev().alloc(2 * m * 2 * pcols)?
        };
        let sigma = self.dev().alloc(4 * m)?;
        let out = PrefillBuffers {
            values: planes.ptr,
            sigma: sigma.ptr,
        };
        self.trellis_prepare(x, m, &[(w, Some(out))], None)?;
        let rotated = self.dev().alloc(4 * m * rows)?;
        let tokens = self.trellis_gemm_tokens(m);
        let gemm = &self.k().trellis.gemm[c.code_index()][c.k_index()][usize::from(c.mma())]
            [usize::from(tokens == 128)];
        let grid_y = u32::try_from(m.div_ceil(tokens))
            .ok()
            .filter(|&b| b <= MAX_GRID_YZ)
            .ok_or_else(|| {
                RuntimeError::Unsupported(format!("trellis gemm: {m} tokens in one launch"))
            })?;
        self.launch(
            gemm,
            ((rows / 16).div_ceil(GEMM_WARPS) as u32, grid_y, 1),
            (GEMM_WARPS as u32 * 32, 1, 1),
            gemm_smem(tokens),
            &mut [
                Arg::Ptr(w.mem.ptr),
                Arg::Ptr(c.lut_ptr()),
                Arg::Ptr(planes.ptr),
                Arg::Ptr(rotated.ptr),
                Arg::I32(i32_of("trellis gemm", rows)?),
                Arg::I32(i32_of("trellis gemm", cols)?),
                Arg::I32(i32_of("trellis gemm", m)?),
                Arg::I32(i32_of("trellis gemm", c.n_units)?),
            ],
        )?;
        // Stream-ordered frees: the buffers go after the work queued before them.
        drop(planes);
        self.trellis_finish(
            m,
            &[(
                w,
                Some(PrefillBuffers {
                    values: rotated.ptr,
                    sigma: sigma.ptr,
                }),
                bias,
                y.mem.ptr,
            )],
            accumulate,
            false,
            None,
        )
    }
}

#[cfg(test)]
mod tests {
    //! A model of the row-block transforms (trellis.cu: `row_view`, `row_slot`, `row_coeff`,
    //! `row_fwht`) run over the grid `row_blocks` launches, checked against the CPU transform
    //! (`resident::hadamard`) for sizes with and without a dense factor, including rows shorter
    //! than a warp and factors split as H_m ⊗ H_q.
    use super::*;
    use crate::backend::cpu::SimdLevel;
    use crate::resident::hadamard::{fwht_scaled, Hadamard};

    /// The kernels' transform of `x` (transposed for tr_finish), ÷ √n (÷ √b under a block
    /// rotation: m > 1 blocks and no factor entries): every output written by exactly one
    /// thread of the launch.
    fn row_block_model(x: &[f32], m: usize, hm: &[f32], transpose: bool) -> Vec<f32> {
        let n = x.len();
        let (blocks, threads) = row_blocks(n, m);
        let p = n / m;
        let row = p.min(ROW_MAX);
        let lq = (p / row).trailing_zeros();
        let rows = n / row;
        let per_block = (ROW_MAX / row).min(rows);
        let identity = m > 1 && hm.is_empty();
        let norm = if identity { inv_sqrt(p) } else { inv_sqrt(n) };
        let coeff = |r: usize, k: usize| {
            if identity {
                return if r == k { 1.0 } else { 0.0 };
            }
            let (i, ik) = (r >> lq, k >> lq);
            let h = if m == 1 {
                1.0
            } else if transpose {
                hm[ik * m + i]
            } else {
                hm[i * m + ik]
            };
            if (r & k & ((1 << lq) - 1)).count_ones() % 2 == 1 {
                -h
            } else {
                h
            }
        };
        let mut out = vec![f32::NAN; n];
        for b in 0..blocks as usize {
            if b * per_block >= rows {
                continue;
            }
            // The block's values, one per thread, then the butterflies in increasing span.
            let mut v = vec![0.0f32; threads as usize];
            for (t, val) in v.iter_mut().enumerate() {
                let (r, c) = (b * per_block + t / row, t % row);
                if t < per_block * row && r < rows {
                    *val = (0..rows).fold(0.0, |a, k| coeff(r, k).mul_add(x[k * row + c], a));
                }
            }
            let mut h = 1;
            while h < row {
                let prev = v.clone();
                for (t, val) in v.iter_mut().enumerate() {
                    let other = prev[t ^ h];
                    *val = if t & h != 0 {
                        other - prev[t]
                    } else {
                        prev[t] + other
                    };
                }
                h <<= 1;
            }
            for (t, &val) in v.iter().enumerate() {
                let (r, c) = (b * per_block + t / row, t % row);
                if t < per_block * row && r < rows {
                    assert!(
                        out[r * row + c].is_nan(),
                        "output {} written twice",
                        r * row + c
                    );
                    out[r * row + c] = val * norm;
                }
            }
        }
        out
    }

    #[test]
    fn row_blocks_match_the_cpu_transform() {
        // 16, 64: rows shorter than a warp or a block; 576 = 36·16; 14336 = 28·512;
        // 28672 = 28·2·512 (H_28 ⊗ H_2 across rows); 11008 = 172·64 (eight rows a block).
        for n in [16, 64, 1024, 4096, 576, 14336, 28672, 11008] {
            let had = Hadamard::new(n).expect("a Hadamard order");
            let m = had.small_order();
            let hm: Vec<f32> = had.small_factor().iter().map(|&v| f32::from(v)).collect();
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 7919 % 1009) as f32 - 504.0) / 97.0)
                .collect();
            for transpose in [false, true] {
                let got = row_block_model(&x, m, &hm, transpose);
                let mut want = x.clone();
                if transpose {
                    had.apply_transpose(&mut want).expect("length");
                } else {
                    had.apply(&mut want).expect("length");
                }
                let scale = want.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-5 * scale,
                        "n {n} (m {m}) transpose {transpose}: [{i}] {g} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn row_blocks_match_the_cpu_block_rotation() {
        // 576 in blocks of 64 (SmolLM2), 4096 and 14336 in blocks of 128 (Llama-3.1-8B), 11008
        // in 256s: the kernels' view of m = n/b rows of b values with no mix across them.
        for (n, b) in [(576, 64), (4096, 128), (14336, 128), (11008, 256), (96, 32)] {
            let had = Hadamard::blocks(n, b).expect("a block rotation");
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 7919 % 1009) as f32 - 504.0) / 97.0)
                .collect();
            for transpose in [false, true] {
                let got = row_block_model(&x, n / b, &[], transpose);
                let mut want = x.clone();
                had.apply(&mut want).expect("length");
                let scale = want.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-5 * scale,
                        "n {n} b {b} transpose {transpose}: [{i}] {g} vs {w}"
                    );
                }
            }
        }
    }

    /// The matvec prologue's two-pass transform (trellis.cu `prologue_planes`): the threads'
    /// pass-2 slots cover every (row, position) once, neither pass's shared accesses conflict
    /// beyond two ways, and the two passes reproduce the CPU transform.
    #[test]
    fn prologue_passes_cover_the_buffer_and_match_the_cpu_transform() {
        for threads in [512usize, 1024] {
            let w = threads / 32;
            for e in [1usize, 2, 4, 8] {
                let (chunk, row) = (32 * e, 32 * e + 1);
                let n = threads * e;
                let x: Vec<f32> = (0..n)
                    .map(|i| ((i * 7919 % 1013) as f32 - 506.0) / 97.0)
                    .collect();
                // Pass 1: warp r's contiguous chunk, lane l holding values l + 32i.
                let mut buf = vec![f32::NAN; w * row];
                for r in 0..w {
                    let mut v = x[r * chunk..(r + 1) * chunk].to_vec();
                    fwht_scaled(SimdLevel::detect(), &mut v, 1.0);
                    for (p, val) in v.into_iter().enumerate() {
                        buf[r * row + p] = val;
                    }
                }
                // Pass 2: thread (warp, lane) holds row gi of positions p0..p0 + e.
                let mut seen = vec![0u8; w * row];
                let mut out = vec![0.0f32; n];
                for warp in 0..w {
                    let mut banks = vec![vec![0usize; 32]; e];
                    for lane in 0..32 {
                        let gi = lane % w;
                        let p0 = (warp * (32 / w) + lane / w) * e;
                        for j in 0..e {
                            seen[gi * row + p0 + j] += 1;
                            banks[j][(gi * row + p0 + j) % 32] += 1;
                        }
                    }
                    for b in &banks {
                        assert!(b.iter().all(|&c| c <= 2), "threads {threads} e {e}: {b:?}");
                    }
                }
                for r in 0..w {
                    assert!(seen[r * row..r * row + chunk].iter().all(|&c| c == 1));
                }
                for p in 0..chunk {
                    let mut col: Vec<f32> = (0..w).map(|r| buf[r * row + p]).collect();
                    fwht_scaled(SimdLevel::detect(), &mut col, 1.0);
                    for (r, val) in col.into_iter().enumerate() {
                        out[r * chunk + p] = val;
                    }
                }
                let mut want = x.clone();
                fwht_scaled(SimdLevel::detect(), &mut want, 1.0);
                assert_eq!(out, want, "threads {threads} e {e}");
            }
        }
    }
}

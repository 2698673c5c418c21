//! Group-quantized projections (RTN / AWQ codes) on the CUDA backend, inside a
//! [`CudaMatrix`] (no dequantized copy), so every projection op of the backend takes them
//! (q/k/v in one launch, gate/up with SwiGLU in one, the input RMSNorm folded in, the
//! residual added in the epilogue). 2-, 3- and 4-bit codes with groups of 2ⁿ · 128 columns are
//! re-laid out at load into the tensor-core tile layout (kernels/group_mma.cu, docs/format.md
//! "CUDA tile layout"); other widths and groups stay as the `.sfx` file stores them, for the
//! CUDA-core kernels of kernels/group.cu. Prefill dequantizes the matrix into a transient f32
//! panel (stream-ordered allocation, freed after the GEMM) for cuBLAS's TF32 GEMM.

use super::device::DeviceMem;
use super::kernels::{GROUP_BITS, TILE_BITS};
use super::resident::CudaResidentLinear;
use super::{
    blocks, i32_of, Arg, Codes, CudaBackend, CudaBuffer, CudaMatrix, MatrixData, WeightRef,
};
use crate::backend::refine::FusedColumns;
use crate::backend::Backend;
use crate::error::{check_len, Result, RuntimeError};
use sfx_formats::resident::GroupQuantized;
use sfx_formats::DType;
use std::sync::Arc;

/// Columns per code chunk of the kernels (`GQ_CHUNK`), threads per block (`GQ_THREADS`).
const CHUNK: usize = 32;
const THREADS: usize = 256;
/// Blocks per SM a file-layout matvec keeps when its row sets narrow (`group_schedule`), and
/// the narrowest set. Measured on the H200 (8B shape, tg128): rtn3 286 tok/s keeping 8 blocks
/// per SM, 299 keeping 1 (down to 8 threads a row), 309 at 16 threads a row everywhere, 272 at
/// 8; rtn2 and rtn4 (only the head runs here) within 1 % of each other.
const WIDE_BLOCKS_PER_SM: usize = 1;
const NARROWEST_TPR: usize = 16;
/// Projections one launch takes (`GQ_MAX_ITEMS`).
const MAX_ITEMS: usize = 3;

/// What a group-coded [`CudaMatrix`] holds beside its codes.
pub(super) struct GroupCodes {
    bits: u8,
    group: usize,
    /// Bytes of a row in the file layout.
    row_bytes: usize,
    layout: CodeLayout,
}

/// How the codes lie in device memory.
enum CodeLayout {
    /// As the file stores them (row-major bit streams, f16 scales and u8 zero points apart):
    /// the CUDA-core kernels of group.cu (the head's 6 and 8 bits, groups that are not
    /// 2ⁿ · 128 columns, and GPUs without bf16 MMA).
    Rows { scales: DeviceMem, zeros: DeviceMem },
    /// Re-laid out at load into MMA fragment order, 16 rows × 32 columns per lane chunk, scale
    /// and zero point packed per (tile, group, row): the tensor-core kernels of
    /// group_mma.cu (2, 3 and 4 bits on sm_80+; docs/format.md, "CUDA tile layout").
    Tiles {
        scale_zero: DeviceMem,
        super_chunks: usize,
    },
}

impl GroupCodes {
    pub(super) fn same_format(&self, other: &GroupCodes) -> bool {
        self.bits == other.bits
            && self.group == other.group
            && matches!(
                (&self.layout, &other.layout),
                (CodeLayout::Rows { .. }, CodeLayout::Rows { .. })
                    | (CodeLayout::Tiles { .. }, CodeLayout::Tiles { .. })
            )
    }

    /// Index of the tile kernels' code width in [`TILE_BITS`] (checked at upload).
    fn tile_index(&self) -> usize {
        tile_index(self.bits)
    }

    /// Index of the file-layout kernels' code width in [`GROUP_BITS`] (checked at upload).
    fn bits_index(&self) -> usize {
        GROUP_BITS.iter().position(|&b| b == self.bits).unwrap_or(0)
    }

    /// Chunks a thread loads at once (`GqUnroll<B>::U`).
    fn unroll(&self) -> usize {
        match self.bits {
            2 => 4,
            6 | 8 => 1,
            _ => 2,
        }
    }
}

/// The kernels' `RefineOp` (kernels/refine_epilogue.cuh): a decode row's refinement applied
/// by the projection launch ([`FusedColumns`]); `sel` 0 is none.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub(super) struct RefineOperand {
    sel: u64,
    cols: u64,
    scales: u64,
    selected: i32,
    unit_bytes: i32,
    staged: i32,
    lagged: [u64; 2],
}

impl RefineOperand {
    /// Adds fetch lag's contributions `addends` (`rows` values each, at most two) to the
    /// projection's output rows.
    pub(super) fn with_lagged(mut self, addends: &[&CudaBuffer], rows: usize) -> Result<Self> {
        let op = "fused refinement";
        if addends.len() > self.lagged.len() {
            return Err(RuntimeError::Unsupported(format!(
                "{op}: {} lagged contributions in one launch (at most 2)",
                addends.len()
            )));
        }
        for (slot, a) in self.lagged.iter_mut().zip(addends) {
            check_len(op, "lagged contribution", a.len, rows)?;
            *slot = a.mem.ptr;
        }
        Ok(self)
    }

    /// Shared-memory bytes of this operand's read-ahead region for `rows` output rows of a
    /// block (the kernels' `refine_prefetch_bytes`, rounded up to 16); 0 without columns.
    pub(super) fn read_ahead_bytes(&self, rows: usize) -> usize {
        if !self.has_columns() {
            return 0;
        }
        let selected = self.selected.max(0) as usize;
        (4 * rows + 16 * selected.div_ceil(2) + selected * (rows / 2)).next_multiple_of(16)
    }

    /// Whether the launch computes refinement deltas (needs their shared memory).
    pub(super) fn has_columns(&self) -> bool {
        self.sel != 0
    }

    /// Whether the launch adds anything for this operand (refinement deltas or lagged
    /// contributions).
    fn is_active(&self) -> bool {
        self.has_columns() || self.lagged.iter().any(|&p| p != 0)
    }

    /// Index of the kernel entries for a launch carrying `ops` (its items' operands, as
    /// placed in the launch's arguments): 1, the `_rf` entries, only where one of them adds
    /// something; 0, the plain entries (no refinement code), otherwise.
    pub(super) fn entry<'a>(ops: impl IntoIterator<Item = &'a RefineOperand>) -> usize {
        usize::from(ops.into_iter().any(RefineOperand::is_active))
    }

    /// The operand of `r` for a projection of `rows` outputs over `row_len` inputs, checked
    /// against the buffers it names (the kernel reads `selected` indices, each entry's column
    /// of `unit_bytes`, and `rows` scales).
    pub(super) fn of(
        r: &FusedColumns<'_, CudaBackend>,
        rows: usize,
        row_len: usize,
    ) -> Result<Self> {
        let op = "fused refinement";
        let columns = if r.staged { r.selected } else { row_len };
        let shape = |msg: String| RuntimeError::Shape { op, msg };
        if r.sel.len < r.selected {
            return Err(shape(format!(
                "{} indices for {} selected",
                r.sel.len, r.selected
            )));
        }
        if r.unit_bytes < rows.div_ceil(2) {
            return Err(shape(format!(
                "columns of {} B for {rows} rows",
                r.unit_bytes
            )));
        }
        if columns
            .checked_mul(r.unit_bytes)
            .is_none_or(|n| n > r.store.len)
        {
            return Err(shape(format!(
                "{columns} columns of {} B in a store of {} B",
                r.unit_bytes, r.store.len
            )));
        }
        if r.scales.len != rows {
            return Err(shape(format!("{} scales for {rows} rows", r.scales.len)));
        }
        Ok(Self {
            sel: r.sel.mem.ptr,
            cols: r.store.device_ptr(),
            scales: r.scales.mem.ptr,
            selected: i32_of(op, r.selected)?,
            unit_bytes: i32_of(op, r.unit_bytes)?,
            staged: i32::from(r.staged),
            lagged: [0; 2],
        })
    }
}

/// Shared-memory bytes of the kernels' `refine_rows` scratch for a block of `threads` threads
/// (`RE_SCRATCH_BYTES`): only refined launches ask for it, so unrefined ones keep the
/// occupancy their plans assume.
pub(super) const fn refine_scratch_bytes(threads: usize) -> usize {
    128 * 8 + threads * 8
}

/// The kernels' `GqItem` / `GqGroup` (kernels/group.cu), passed by value.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct GqItem {
    codes: u64,
    scales: u64,
    zeros: u64,
    bias: u64,
    y: u64,
    rows: i32,
    block_end: i32,
    refine: RefineOperand,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct GqGroup {
    item: [GqItem; MAX_ITEMS],
    count: i32,
}

/// The tile kernels' `GtItem` / `GtGroup` (kernels/group_mma.cu), passed by value.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct GtItem {
    codes: u64,
    scale_zero: u64,
    bias: u64,
    y: u64,
    rows: i32,
    block_end: i32,
    refine: RefineOperand,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct GtGroup {
    item: [GtItem; MAX_ITEMS],
    count: i32,
}

/// Rows per tile of the tile layout (one MMA's M).
const TILE_ROWS: usize = 16;

/// Launch geometry of one group matvec: threads per row set and rows per thread.
struct Schedule {
    tpr: usize,
    rows: usize,
}

impl Schedule {
    fn rows_per_block(&self) -> usize {
        THREADS / self.tpr * self.rows
    }
}

fn codes_of<'a>(w: &'a MatrixData, op: &'static str) -> Result<&'a GroupCodes> {
    match &w.codes {
        Codes::Group(c) => Ok(c),
        _ => Err(RuntimeError::Unsupported(format!(
            "{op}: a matrix of another format reached the group kernels"
        ))),
    }
}

impl CudaBackend {
    /// Uploads `q` (and `bias`); `what` names the projection in errors. The kernels take
    /// 32-column chunks inside one group, so columns and the group size must be multiples of
    /// 32 (every Llama/Qwen/SmolLM size is; group 128 is the converter's default).
    pub fn upload_group_linear(
        &self,
        q: &GroupQuantized,
        bias: Option<&[f32]>,
        what: &str,
    ) -> Result<CudaResidentLinear> {
        let (rows, cols, group) = (q.rows(), q.cols(), q.group_size());
        if !GROUP_BITS.contains(&q.bits()) {
            return Err(RuntimeError::Unsupported(format!(
                "{what}: {}-bit codes have no CUDA kernels (widths: {GROUP_BITS:?})",
                q.bits()
            )));
        }
        if !cols.is_multiple_of(CHUNK) || !group.is_multiple_of(CHUNK) {
            return Err(RuntimeError::Unsupported(format!(
                "{what}: the CUDA group kernels need columns and group size in multiples of \
                 {CHUNK} (this projection: {cols} columns, group {group}); use --device cpu"
            )));
        }
        // The tile kernels take one scale per 128-column unit and find its group by a shift:
        // groups of 2ⁿ units (128 is the converter's).
        let tiles = self.inner.group_tiles
            && TILE_BITS.contains(&q.bits())
            && group.is_multiple_of(TILE_UNIT_COLS)
            && (group / TILE_UNIT_COLS).is_power_of_two();
        let super_chunks = (cols / CHUNK).div_ceil(TileWidth::of(q.bits()).chunks);
        let smem = if tiles {
            // The smallest plan, as SwiGLU's gate (two tiles per block), must fit.
            Self::tile_smem(super_chunks, q.bits(), TilePlan::DEFAULT, true)
        } else {
            Self::group_smem(cols)
        };
        if smem > self.dev().smem_optin {
            return Err(RuntimeError::Unsupported(format!(
                "{what}: {cols} columns need {smem} B of shared memory for the group matvec, \
                 this GPU allows {}",
                self.dev().smem_optin
            )));
        }
        for v in [rows, cols, q.row_bytes(), q.groups_per_row(), group] {
            i32_of("group_linear", v)?;
        }
        if let Some(b) = bias {
            check_len("group_linear", "bias", b.len(), rows)?;
        }
        let upload = |bytes: &[u8]| self.dev().upload_new(bytes);
        let scale_bytes: Vec<u8> = q
            .scales()
            .iter()
            .flat_map(|s| s.to_bits().to_le_bytes())
            .collect();
        let file_codes = upload(q.codes())?;
        let (scales, zeros) = (upload(&scale_bytes)?, upload(q.zeros())?);
        let (mem, layout) = if tiles {
            let packed = self.pack_tiles(q, &file_codes, &scales, &zeros, super_chunks)?;
            (packed.0, packed.1)
        } else {
            (file_codes, CodeLayout::Rows { scales, zeros })
        };
        let codes = GroupCodes {
            bits: q.bits(),
            group,
            row_bytes: q.row_bytes(),
            layout,
        };
        Ok(CudaResidentLinear {
            weight: CudaMatrix {
                inner: Arc::new(MatrixData {
                    mem,
                    rows,
                    cols,
                    dtype: DType::F32,
                    codes: Codes::Group(codes),
                }),
            },
            bias: bias.map(|b| self.upload(b)).transpose()?,
            host_bytes: q.size_in_bytes(),
            format: format!("q{}g{group}", q.bits()),
        })
    }

    /// Dynamic shared memory of the group matvec: x padded by 4 floats per 32, then the
    /// per-chunk sums.
    fn group_smem(cols: usize) -> usize {
        4 * (cols + cols / CHUNK * 4 + cols / CHUNK)
    }

    /// Re-lays file-layout codes, scales and zero points (already on the device) out into
    /// the tile layout, on the device; the file-layout buffers are freed by the caller.
    fn pack_tiles(
        &self,
        q: &GroupQuantized,
        file_codes: &DeviceMem,
        scales: &DeviceMem,
        zeros: &DeviceMem,
        super_chunks: usize,
    ) -> Result<(DeviceMem, CodeLayout)> {
        let (rows, cols) = (q.rows(), q.cols());
        let tiles = rows.div_ceil(TILE_ROWS);
        let gpr = q.groups_per_row();
        let width = TileWidth::of(q.bits());
        let k = &self.k().group.tile;
        let packed = self
            .dev()
            .alloc(tiles * super_chunks * 32 * width.lane_bytes)?;
        // One thread per (tile, chunk, lane); at 3 bits per (tile, chunk pair, lane).
        let threads = tiles * super_chunks * width.chunks * 32 / width.chunks_per_thread;
        self.launch(
            &k.pack_codes[tile_index(q.bits())],
            (blocks(threads, 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [
                Arg::Ptr(file_codes.ptr),
                Arg::Ptr(packed.ptr),
                Arg::I32(i32_of("group tiles", rows)?),
                Arg::I32(i32_of("group tiles", cols)?),
                Arg::I32(i32_of("group tiles", q.row_bytes())?),
                Arg::I32(i32_of("group tiles", super_chunks)?),
            ],
        )?;
        let scale_zero = self.dev().alloc(tiles * gpr * 8 * 8)?;
        self.launch(
            &k.pack_scales,
            (blocks(tiles * gpr * 8, 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [
                Arg::Ptr(scales.ptr),
                Arg::Ptr(zeros.ptr),
                Arg::Ptr(scale_zero.ptr),
                Arg::I32(i32_of("group tiles", rows)?),
                Arg::I32(i32_of("group tiles", gpr)?),
            ],
        )?;
        Ok((
            packed,
            CodeLayout::Tiles {
                scale_zero,
                super_chunks,
            },
        ))
    }

    /// Threads per row set: enough that each thread's first batch of `unroll` chunks covers
    /// the row (a power of two, 8..256, so sets stay inside warps or span whole ones). Rows
    /// per thread: the most (of `choices`) that still leave three blocks per SM, since bytes
    /// in flight per thread grow with rows and blocks per SM hide each other's latency;
    /// `SFX_GROUP_ROWS` forces it for tuning runs. Every block stages (and normalises) all of
    /// x before it multiplies, so where rows are plentiful — the head: 128K rows of 8-bit codes
    /// took 16K blocks of 8 rows, each staging x for 32 KB of codes — the sets narrow (each
    /// thread then takes its chunks in turn) while the grid keeps [`WIDE_BLOCKS_PER_SM`] blocks
    /// per SM (`SFX_GROUP_WIDE` sets that for tuning runs); `SFX_GROUP_TPR` forces the width.
    fn group_schedule(
        &self,
        codes: &GroupCodes,
        cols: usize,
        rows: &[usize],
        choices: &[usize],
    ) -> Schedule {
        let threads_needed = (cols / CHUNK).div_ceil(codes.unroll());
        let widest = threads_needed.next_power_of_two().clamp(8, THREADS);
        let sm = self.dev().sm_count as usize;
        let blocks_for = |tpr: usize, r: usize| -> usize {
            let per_block = THREADS / tpr * r;
            rows.iter().map(|n| n.div_ceil(per_block)).sum()
        };
        let forced = self
            .inner
            .group_rows
            .and_then(|f| choices.iter().copied().find(|&r| r <= f));
        let rows_for = |tpr: usize| {
            forced.unwrap_or_else(|| {
                choices
                    .iter()
                    .copied()
                    .find(|&r| blocks_for(tpr, r) >= 3 * sm)
                    .unwrap_or(1)
            })
        };
        let tpr = match self.inner.group_tpr {
            Some(t) => t.min(widest),
            None => {
                let keep = self.inner.group_wide.unwrap_or(WIDE_BLOCKS_PER_SM) * sm;
                let mut tpr = widest;
                while tpr > NARROWEST_TPR && blocks_for(tpr / 2, rows_for(tpr / 2)) >= keep {
                    tpr /= 2;
                }
                tpr
            }
        };
        Schedule {
            tpr,
            rows: rows_for(tpr),
        }
    }

    /// `y_i = W_i · x (+ b_i) (+ y_i)` for up to three group-coded matrices of one format,
    /// m ≤ 4 token rows, in one launch; with `norm`, x is RMS-normalised inside it.
    pub(super) fn group_matvec(
        &self,
        x: &CudaBuffer,
        m: usize,
        items: &[(&CudaMatrix, Option<&CudaBuffer>, u64)],
        accumulate: bool,
        norm: Option<(&CudaBuffer, f32)>,
        refine: &[Option<RefineOperand>],
    ) -> Result<()> {
        let Some(first) = items.first() else {
            return Ok(());
        };
        let refine_of = |k: usize| refine.get(k).copied().flatten();
        let operands = m == 1 && refine.iter().any(Option::is_some);
        let refined = operands && refine.iter().flatten().any(RefineOperand::has_columns);
        if items.len() > MAX_ITEMS {
            return Err(RuntimeError::Unsupported(format!(
                "group matvec: {} projections in one launch (at most {MAX_ITEMS})",
                items.len()
            )));
        }
        let w0 = &first.0.inner;
        let codes = codes_of(w0, "group matvec")?;
        if let CodeLayout::Tiles { .. } = codes.layout {
            return self.tile_matvec(x, m, items, accumulate, norm, refine);
        }
        let row_counts: Vec<usize> = items.iter().map(|it| it.0.inner.rows).collect();
        let sched = self.group_schedule(codes, w0.cols, &row_counts, &[4, 2, 1]);
        let mut group = GqGroup::default();
        let mut end = 0usize;
        for (slot, (w, bias, y)) in group.item.iter_mut().zip(items) {
            let (scales, zeros) = row_operands(&w.inner, "group matvec")?;
            end += w.inner.rows.div_ceil(sched.rows_per_block());
            *slot = GqItem {
                codes: w.inner.mem.ptr,
                scales,
                zeros,
                bias: bias.map_or(0, |b| b.mem.ptr),
                y: *y,
                rows: i32_of("group matvec", w.inner.rows)?,
                block_end: i32_of("group matvec", end)?,
                refine: RefineOperand::default(),
            };
        }
        if operands {
            for (k, slot) in group.item.iter_mut().enumerate().take(items.len()) {
                slot.refine = refine_of(k).unwrap_or_default();
            }
        }
        group.count = items.len() as i32;
        let ri = match sched.rows {
            4 => 2,
            2 => 1,
            _ => 0,
        };
        let kernels = &self.k().group;
        let mut args = vec![Arg::GroupCodes(group), Arg::Ptr(x.mem.ptr)];
        let rf = RefineOperand::entry(group.item.iter().map(|it| &it.refine));
        let kernel = match norm {
            None => &kernels.matvec[rf][codes.bits_index()][ri],
            Some((w, eps)) => {
                args.extend([Arg::Ptr(w.mem.ptr), Arg::F32(eps)]);
                &kernels.matvec_norm[rf][codes.bits_index()][ri]
            }
        };
        args.extend(self.group_shape_args(w0, codes, sched.tpr)?);
        if norm.is_none() {
            args.push(Arg::I32(accumulate as i32));
        }
        // Refined: the block's row deltas and refine_rows' scratch (kernels/group.cu).
        let refine_smem = if refined {
            4 * sched.rows_per_block() + refine_scratch_bytes(THREADS)
        } else {
            0
        };
        self.launch_projection(
            kernel,
            (blocks(end, 1), m as u32, 1),
            (THREADS as u32, 1, 1),
            Self::group_smem(w0.cols) + refine_smem,
            &mut args,
        )
    }

    /// `gate ← silu(W_g · x) ⊙ (W_u · x)` for group-coded gate and up matrices of one format
    /// (m ≤ 4), optionally with the input norm fused.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn group_swiglu(
        &self,
        x: &CudaBuffer,
        m: usize,
        g: &MatrixData,
        u: &MatrixData,
        gate: &mut CudaBuffer,
        norm: Option<(&CudaBuffer, f32)>,
        refine: Option<[RefineOperand; 2]>,
    ) -> Result<()> {
        let gc = codes_of(g, "group swiglu")?;
        let refine = refine.filter(|_| m == 1);
        if let CodeLayout::Tiles { .. } = gc.layout {
            return self.tile_swiglu(x, m, g, u, gate, norm, refine);
        }
        let sched = self.group_schedule(gc, g.cols, &[g.rows], &[2, 1]);
        let rows = i32_of("group swiglu", g.rows)?;
        let mut group = GqGroup::default();
        let grid = g.rows.div_ceil(sched.rows_per_block());
        for (k, (slot, w)) in group.item.iter_mut().zip([g, u]).enumerate() {
            let (scales, zeros) = row_operands(w, "group swiglu")?;
            *slot = GqItem {
                codes: w.mem.ptr,
                scales,
                zeros,
                bias: 0,
                y: gate.mem.ptr,
                rows,
                block_end: i32_of("group swiglu", grid)?,
                refine: refine.map_or_else(RefineOperand::default, |r| r[k]),
            };
        }
        group.count = 2;
        let ri = usize::from(sched.rows == 2);
        let kernels = &self.k().group;
        let mut args = vec![Arg::GroupCodes(group), Arg::Ptr(x.mem.ptr)];
        let rf = RefineOperand::entry(group.item.iter().map(|it| &it.refine));
        let kernel = match norm {
            None => &kernels.swiglu[rf][gc.bits_index()][ri],
            Some((w, eps)) => {
                args.extend([Arg::Ptr(w.mem.ptr), Arg::F32(eps)]);
                &kernels.swiglu_norm[rf][gc.bits_index()][ri]
            }
        };
        args.extend(self.group_shape_args(g, gc, sched.tpr)?);
        let refine_smem = if refine.is_some() {
            4 * 2 * sched.rows_per_block() + refine_scratch_bytes(THREADS)
        } else {
            0
        };
        self.launch_projection(
            kernel,
            (blocks(grid, 1), m as u32, 1),
            (THREADS as u32, 1, 1),
            Self::group_smem(g.cols) + refine_smem,
            &mut args,
        )
    }

    /// The kernels' shape arguments after the operands: columns, row bytes, groups per row,
    /// group size, threads per row set (sizes checked to fit i32 at upload).
    fn group_shape_args(&self, w: &MatrixData, c: &GroupCodes, tpr: usize) -> Result<[Arg; 5]> {
        Ok([
            Arg::I32(i32_of("group matvec", w.cols)?),
            Arg::I32(i32_of("group matvec", c.row_bytes)?),
            Arg::I32(i32_of("group matvec", w.cols.div_ceil(c.group))?),
            Arg::I32(i32_of("group matvec", c.group)?),
            Arg::I32(tpr as i32),
        ])
    }

    /// Prefill: the f32 panel of the whole matrix, then the GEMM (which adds the bias).
    pub(super) fn group_gemm(
        &self,
        x: &CudaBuffer,
        m: usize,
        w: &MatrixData,
        bias: Option<&CudaBuffer>,
        y: &mut CudaBuffer,
        accumulate: bool,
    ) -> Result<()> {
        let c = codes_of(w, "group gemm")?;
        let panel = self.dev().alloc(4 * w.rows * w.cols)?;
        let gpr = Arg::I32(i32_of("group gemm", w.cols.div_ceil(c.group))?);
        let (rows, cols) = (
            Arg::I32(i32_of("group gemm", w.rows)?),
            Arg::I32(i32_of("group gemm", w.cols)?),
        );
        let group = Arg::I32(i32_of("group gemm", c.group)?);
        match &c.layout {
            CodeLayout::Rows { scales, zeros } => self.launch(
                &self.k().group.dequant_f32[c.bits_index()],
                (blocks(w.rows * (w.cols / CHUNK), 256), 1, 1),
                (256, 1, 1),
                0,
                &mut [
                    Arg::Ptr(w.mem.ptr),
                    Arg::Ptr(scales.ptr),
                    Arg::Ptr(zeros.ptr),
                    Arg::Ptr(panel.ptr),
                    rows,
                    cols,
                    Arg::I32(i32_of("group gemm", c.row_bytes)?),
                    gpr,
                    group,
                ],
            )?,
            CodeLayout::Tiles {
                scale_zero,
                super_chunks,
            } => self.launch(
                &self.k().group.tile.dequant_f32[c.tile_index()],
                (
                    blocks(w.rows.div_ceil(TILE_ROWS) * (w.cols / CHUNK) * 32, 256),
                    1,
                    1,
                ),
                (256, 1, 1),
                0,
                &mut [
                    Arg::Ptr(w.mem.ptr),
                    Arg::Ptr(scale_zero.ptr),
                    Arg::Ptr(panel.ptr),
                    rows,
                    cols,
                    Arg::I32(i32_of("group gemm", *super_chunks)?),
                    gpr,
                    group,
                ],
            )?,
        }
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
}

impl CudaBackend {
    /// `out[t, :] = Ŵ[tokens[t], :]` from a group-coded table (either layout).
    pub(super) fn group_gather(
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
        let chunks = w.cols / CHUNK;
        let rows = Arg::I32(i32_of("embedding", w.rows)?);
        let cols = Arg::I32(i32_of("embedding", w.cols)?);
        let gpr = Arg::I32(i32_of("embedding", w.cols.div_ceil(c.group))?);
        let group = Arg::I32(i32_of("embedding", c.group)?);
        match &c.layout {
            CodeLayout::Rows { scales, zeros } => self.launch(
                &self.k().group.gather_f32[c.bits_index()],
                (blocks(chunks, 64), ntok, 1),
                (64, 1, 1),
                0,
                &mut [
                    Arg::Ptr(w.mem.ptr),
                    Arg::Ptr(scales.ptr),
                    Arg::Ptr(zeros.ptr),
                    Arg::Ptr(tokens.mem.ptr),
                    Arg::Ptr(out.mem.ptr),
                    rows,
                    cols,
                    Arg::I32(i32_of("embedding", c.row_bytes)?),
                    gpr,
                    group,
                ],
            ),
            CodeLayout::Tiles {
                scale_zero,
                super_chunks,
            } => self.launch(
                &self.k().group.tile.gather_f32[c.tile_index()],
                (blocks(chunks * 4, 128), ntok, 1),
                (128, 1, 1),
                0,
                &mut [
                    Arg::Ptr(w.mem.ptr),
                    Arg::Ptr(scale_zero.ptr),
                    Arg::Ptr(tokens.mem.ptr),
                    Arg::Ptr(out.mem.ptr),
                    rows,
                    cols,
                    Arg::I32(i32_of("embedding", *super_chunks)?),
                    gpr,
                    group,
                ],
            ),
        }
    }
}

/// How one tile matvec launch cuts its work: `tiles` tiles per block (SwiGLU: that many gate
/// and up tiles each), `stages` ring slots per warp (stages − 1 units in flight ahead of the
/// one being multiplied) and `seq` sets of `tiles` tiles taken one after another by a block
/// (x staged once, the ring running on across them), by blocks of `warps` warps (8, or 16
/// with one tile and three slots: the `_w16` kernels).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct TilePlan {
    pub tiles: usize,
    pub stages: usize,
    pub seq: usize,
    pub warps: usize,
}

impl TilePlan {
    /// What every uploaded matrix must fit (checked at upload).
    const DEFAULT: TilePlan = TilePlan {
        tiles: 1,
        stages: 3,
        seq: 1,
        warps: 8,
    };

    /// `SFX_GT_PLAN=tiles,stages[,seq[,warps]]` (tiles 1, 2, 4; stages 3, 4; seq 1–16; warps
    /// 8, or 16 with 1,3) forces the plan of every tile launch, for tuning runs; None when
    /// unset or malformed.
    pub(super) fn from_env() -> Option<TilePlan> {
        Self::parse(&std::env::var("SFX_GT_PLAN").ok()?)
    }

    fn parse(v: &str) -> Option<TilePlan> {
        let p: Vec<usize> = v
            .split(',')
            .map(|x| x.trim().parse().ok())
            .collect::<Option<_>>()?;
        let (tiles, stages, seq, warps) = match p[..] {
            [t, s] => (t, s, 1, 8),
            [t, s, q] => (t, s, q, 8),
            [t, s, q, w] => (t, s, q, w),
            _ => return None,
        };
        let plan = TilePlan {
            tiles,
            stages,
            seq,
            warps,
        };
        (plan.kernel_index(false).is_some() && (1..=16).contains(&seq)).then_some(plan)
    }

    /// Index into the kernel tables (`_r{1,2,4}_s{3,4}`, then `_r1_s3_w16`; SwiGLU tables
    /// stop at two tiles before the wide kernel); None for a plan with no kernel.
    fn kernel_index(&self, swiglu: bool) -> Option<usize> {
        match (self.tiles, self.stages, self.warps) {
            (1, 3, 16) => Some(if swiglu { 4 } else { 6 }),
            (1 | 2 | 4, 3 | 4, 8) if !(swiglu && self.tiles == 4) => {
                Some(2 * (self.tiles.trailing_zeros() as usize) + usize::from(self.stages == 4))
            }
            _ => None,
        }
    }
}

/// Static shared memory of a tile block of `warps` warps at most (`red`, double-buffered,
/// and `ss_red` in group_mma.cu).
const fn tile_static_smem(warps: usize) -> usize {
    2 * warps * 2 * 16 * 4 + warps * 4
}

/// Tile sets a block takes in sequence: where at most two blocks fit an SM's shared memory,
/// enough that the launch runs in one wave — a later wave of such blocks restarts every ring
/// and stages x again, with too few other blocks on the SM to overlap it (x staged once and
/// the ring running on across the sets instead). Measured on the H200, Llama-3.1-8B shapes:
/// the rtn4 down projection (256 blocks of 117 KB, one an SM) 20.7 → 18.1 µs at two sets;
/// rtn4 gate/up (896 blocks, two an SM) at four sets with the rest: tg128 449 → 464. Where
/// three or more blocks fit, the launch keeps one set a block: there fewer blocks lost more
/// than the staging saved (rtn2 gate/up, three an SM: tg128 521 → 507 at three sets).
/// `every_launch` (`SFX_GT_ONE_WAVE=1`, for comparison) sizes every launch to one wave.
fn sequential_sets(
    blocks: usize,
    smem_block: usize,
    smem_per_sm: usize,
    sm_count: usize,
    every_launch: bool,
) -> usize {
    let per_sm = blocks_per_sm(smem_block, smem_per_sm).max(1);
    if per_sm > 2 && !every_launch {
        return 1;
    }
    blocks.div_ceil(per_sm * sm_count.max(1)).clamp(1, 16)
}

/// Blocks of `smem_block` bytes (the driver's per-block reserve included) that an SM's shared
/// memory holds at once.
fn blocks_per_sm(smem_block: usize, smem_per_sm: usize) -> usize {
    smem_per_sm / smem_block.max(1)
}

/// Columns of a warp's unit of work (`GtUnit`).
const TILE_UNIT_COLS: usize = 128;

/// Index of a tile-layout code width in the kernel tables ([`TILE_BITS`]).
fn tile_index(bits: u8) -> usize {
    TILE_BITS.iter().position(|&b| b == bits).unwrap_or(0)
}

/// A tile-layout super-chunk of one code width (`GtSuper`): 32-column chunks in it, a lane's
/// bytes of it, and chunks one packing thread writes (3 bits interleave chunk pairs).
struct TileWidth {
    chunks: usize,
    lane_bytes: usize,
    chunks_per_thread: usize,
}

impl TileWidth {
    fn of(bits: u8) -> Self {
        match bits {
            3 => Self {
                chunks: 4,
                lane_bytes: 24,
                chunks_per_thread: 2,
            },
            4 => Self {
                chunks: 2,
                lane_bytes: 16,
                chunks_per_thread: 1,
            },
            _ => Self {
                chunks: 4,
                lane_bytes: 16,
                chunks_per_thread: 1,
            },
        }
    }
}

impl CudaBackend {
    /// Dynamic shared memory of a tile matvec: three bf16 planes of x over whole 128-column
    /// units, each 4 words longer (bank offset), then every warp's ring (`GtSlot`: per tile
    /// and lane its bytes of the unit's super-chunks, 8 B of scale/zero).
    fn tile_smem(super_chunks: usize, bits: u8, plan: TilePlan, swiglu: bool) -> usize {
        let width = TileWidth::of(bits);
        let per_unit = TILE_UNIT_COLS / (CHUNK * width.chunks); // super-chunks per unit
        let padded_cols = super_chunks.div_ceil(per_unit) * TILE_UNIT_COLS;
        let tiles = plan.tiles * if swiglu { 2 } else { 1 };
        let slot_per_tile = 32 * (width.lane_bytes * per_unit + 8);
        4 * 3 * (padded_cols / 2 + 4) + plan.warps * plan.stages * tiles * slot_per_tile
    }

    /// The plan of a tile launch: one tile per block and three ring slots (measured best on
    /// every Llama-3.1-8B projection at 2 and 4 bits, H200: rtn2 tg128 449.7 tok/s vs 440.3
    /// at two tiles, 403.5 at four, 434.5 at four slots; more, smaller blocks hide each
    /// other's latency and share an SM's issue slots better than a deeper ring), unless
    /// `SFX_GT_PLAN` says otherwise (SwiGLU takes two tiles at most).
    fn tile_plan(&self, swiglu: bool) -> TilePlan {
        match self.inner.tile_plan {
            Some(p) => TilePlan {
                tiles: if swiglu { p.tiles.min(2) } else { p.tiles },
                ..p
            },
            None => TilePlan::DEFAULT,
        }
    }

    /// [`CudaBackend::group_matvec`] over the tile layout: tensor-core matvecs.
    fn tile_matvec(
        &self,
        x: &CudaBuffer,
        m: usize,
        items: &[(&CudaMatrix, Option<&CudaBuffer>, u64)],
        accumulate: bool,
        norm: Option<(&CudaBuffer, f32)>,
        refine: &[Option<RefineOperand>],
    ) -> Result<()> {
        let parts: Vec<TileItem> = items
            .iter()
            .enumerate()
            .map(|(k, (w, bias, y))| TileItem {
                w: &w.inner,
                bias: bias.map_or(0, |b| b.mem.ptr),
                y: *y,
                refine: refine.get(k).copied().flatten().filter(|_| m == 1),
            })
            .collect();
        self.launch_tiles(x, m, &parts, norm, accumulate, false)
    }

    /// [`CudaBackend::group_swiglu`] over the tile layout: gate and up as the launch's two
    /// items, every block taking the same tiles of both.
    #[allow(clippy::too_many_arguments)]
    fn tile_swiglu(
        &self,
        x: &CudaBuffer,
        m: usize,
        g: &MatrixData,
        u: &MatrixData,
        gate: &mut CudaBuffer,
        norm: Option<(&CudaBuffer, f32)>,
        refine: Option<[RefineOperand; 2]>,
    ) -> Result<()> {
        let mut parts = [g, u].map(|w| TileItem {
            w,
            bias: 0,
            y: gate.mem.ptr,
            refine: None,
        });
        if let Some(r) = refine {
            parts[0].refine = Some(r[0]);
            parts[1].refine = Some(r[1]);
        }
        self.launch_tiles(x, m, &parts, norm, false, true)
    }

    /// One tile launch: plans it, fills the kernels' `GtGroup` (`swiglu`: gate and up items
    /// sharing row sets) and launches the plan's kernel over (row sets, tokens).
    fn launch_tiles(
        &self,
        x: &CudaBuffer,
        m: usize,
        items: &[TileItem],
        norm: Option<(&CudaBuffer, f32)>,
        accumulate: bool,
        swiglu: bool,
    ) -> Result<()> {
        let w0 = items[0].w;
        let c = codes_of(w0, "tile matvec")?;
        let CodeLayout::Tiles { super_chunks, .. } = c.layout else {
            return Err(RuntimeError::Unsupported(
                "tile matvec: codes are not in the tile layout".into(),
            ));
        };
        let mut plan = self.tile_plan(swiglu);
        // Tile rows of each item that owns blocks: SwiGLU's up item shares the gate's blocks.
        let owned_tiles: Vec<usize> = items
            .iter()
            .take(if swiglu { 1 } else { items.len() })
            .map(|it| it.w.rows.div_ceil(TILE_ROWS))
            .collect();
        if self.inner.tile_plan.is_none() {
            let dev = self.dev();
            let block_smem = |p: TilePlan| {
                Self::tile_smem(super_chunks, c.bits, p, swiglu)
                    + tile_static_smem(p.warps)
                    + dev.smem_reserved_per_block
            };
            // Where one block of 8 warps fills an SM, 16 warps put twice the units in flight
            // for the same staged x.
            let wide = TilePlan { warps: 16, ..plan };
            if self.inner.tile_wide
                && wide.kernel_index(swiglu).is_some()
                && blocks_per_sm(block_smem(plan), dev.smem_per_sm) == 1
                && Self::tile_smem(super_chunks, c.bits, wide, swiglu) <= dev.smem_optin
            {
                plan = wide;
            }
            let tile_blocks: usize = owned_tiles.iter().map(|t| t.div_ceil(plan.tiles)).sum();
            plan.seq = sequential_sets(
                tile_blocks,
                block_smem(plan),
                dev.smem_per_sm,
                dev.sm_count as usize,
                self.inner.tile_one_wave,
            );
        }
        // The refined items' rows, one delta each (SwiGLU: gate and up).
        let refined = items
            .iter()
            .filter(|it| it.refine.is_some_and(|r| r.has_columns()))
            .count();
        let refine_smem = if refined > 0 {
            let deltas = plan.seq * plan.tiles * TILE_ROWS * if swiglu { 2 } else { 1 };
            4 * deltas + refine_scratch_bytes(32 * plan.warps)
        } else {
            0
        };
        let smem = Self::tile_smem(super_chunks, c.bits, plan, swiglu) + refine_smem;
        if smem > self.dev().smem_optin {
            return Err(RuntimeError::Unsupported(format!(
                "tile matvec: {} columns need {smem} B of shared memory, this GPU allows {}",
                w0.cols,
                self.dev().smem_optin
            )));
        }
        let mut group = GtGroup {
            count: items.len() as i32,
            ..GtGroup::default()
        };
        let mut end = 0usize;
        for (k, (slot, it)) in group.item.iter_mut().zip(items).enumerate() {
            end += owned_tiles
                .get(k)
                .map_or(0, |t| t.div_ceil(plan.tiles * plan.seq));
            *slot = GtItem {
                codes: it.w.mem.ptr,
                scale_zero: tile_operand(it.w, "tile matvec")?,
                bias: it.bias,
                y: it.y,
                rows: i32_of("tile matvec", it.w.rows)?,
                block_end: i32_of("tile matvec", end)?,
                refine: it.refine.unwrap_or_default(),
            };
        }
        let mut args = vec![Arg::GroupTiles(group), Arg::Ptr(x.mem.ptr)];
        if let Some((w, eps)) = norm {
            args.extend([Arg::Ptr(w.mem.ptr), Arg::F32(eps)]);
        }
        args.extend([
            Arg::I32(i32_of("tile matvec", w0.cols)?),
            Arg::I32(i32_of("tile matvec", super_chunks)?),
            Arg::I32(i32_of("tile matvec", w0.cols.div_ceil(c.group))?),
            // Groups of the tile layout are a power of two of chunks (upload_group_linear).
            Arg::I32((c.group / CHUNK).trailing_zeros() as i32),
        ]);
        if norm.is_none() && !swiglu {
            args.push(Arg::I32(accumulate as i32));
        }
        args.push(Arg::I32(plan.seq as i32));
        let k = &self.k().group.tile;
        let rf = RefineOperand::entry(group.item.iter().map(|it| &it.refine));
        let family: &[super::device::Kernel] = match (swiglu, norm.is_some()) {
            (false, false) => &k.matvec[rf][c.tile_index()],
            (false, true) => &k.matvec_norm[rf][c.tile_index()],
            (true, false) => &k.swiglu[rf][c.tile_index()],
            (true, true) => &k.swiglu_norm[rf][c.tile_index()],
        };
        let kernel = plan
            .kernel_index(swiglu)
            .and_then(|i| family.get(i))
            .ok_or_else(|| {
                RuntimeError::Unsupported(format!("tile matvec: no kernel for plan {plan:?}"))
            })?;
        self.launch_projection(
            kernel,
            (blocks(end, 1), m as u32, 1),
            ((32 * plan.warps) as u32, 1, 1),
            smem,
            &mut args,
        )
    }
}

/// One matrix of a tile launch and where its rows go.
struct TileItem<'a> {
    w: &'a MatrixData,
    bias: u64,
    y: u64,
    refine: Option<RefineOperand>,
}

/// Scale and zero-point pointers of a file-layout matrix.
fn row_operands(w: &MatrixData, op: &'static str) -> Result<(u64, u64)> {
    match &codes_of(w, op)?.layout {
        CodeLayout::Rows { scales, zeros } => Ok((scales.ptr, zeros.ptr)),
        CodeLayout::Tiles { .. } => Err(RuntimeError::Unsupported(format!(
            "{op}: tile-layout codes mixed with file-layout ones"
        ))),
    }
}

/// The packed scale/zero pointer of a tile-layout matrix.
fn tile_operand(w: &MatrixData, op: &'static str) -> Result<u64> {
    match &codes_of(w, op)?.layout {
        CodeLayout::Tiles { scale_zero, .. } => Ok(scale_zero.ptr),
        CodeLayout::Rows { .. } => Err(RuntimeError::Unsupported(format!(
            "{op}: file-layout codes mixed with tile-layout ones"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_indices_follow_the_kernel_tables() {
        // kernels.rs loads `_r{1,2,4}_s{3,4}`, then `_r1_s3_w16`, in this order (SwiGLU: no
        // r4).
        let names = [
            "r1_s3",
            "r1_s4",
            "r2_s3",
            "r2_s4",
            "r4_s3",
            "r4_s4",
            "r1_s3_w16",
        ];
        for swiglu in [false, true] {
            let table: Vec<&str> = names
                .iter()
                .copied()
                .filter(|n| !(swiglu && n.starts_with("r4")))
                .collect();
            for (i, name) in table.iter().enumerate() {
                let (t, rest) = name[1..].split_once("_s").expect("r{t}_s{s}");
                let (s, w) = rest.split_once("_w").unwrap_or((rest, "8"));
                let plan = TilePlan {
                    tiles: t.parse().expect("tiles"),
                    stages: s.parse().expect("stages"),
                    seq: 1,
                    warps: w.parse().expect("warps"),
                };
                assert_eq!(plan.kernel_index(swiglu), Some(i), "{name} swiglu={swiglu}");
            }
        }
        let no_kernel = TilePlan {
            tiles: 2,
            stages: 8,
            ..TilePlan::DEFAULT
        };
        assert_eq!(no_kernel.kernel_index(false), None);
        let four_swiglu = TilePlan {
            tiles: 4,
            ..TilePlan::DEFAULT
        };
        assert_eq!(four_swiglu.kernel_index(true), None);
        let wide_two_tiles = TilePlan {
            tiles: 2,
            warps: 16,
            ..TilePlan::DEFAULT
        };
        assert_eq!(wide_two_tiles.kernel_index(false), None);
    }

    #[test]
    fn launches_of_big_blocks_run_in_one_wave() {
        // H200: 132 SMs, 228 KB of shared memory each.
        let sm = 233_472;
        const STATIC: usize = tile_static_smem(8);
        // rtn4 down: 256 tiles, 117 KB + static and reserve: one block an SM, two sets.
        let down4 = CudaBackend::tile_smem(224, 4, TilePlan::DEFAULT, false);
        assert_eq!(
            sequential_sets(256, down4 + STATIC + 1024, sm, 132, false),
            2
        );
        // rtn2 down: 105 KB, two blocks an SM, 256 blocks in 264 slots: one set.
        let down2 = CudaBackend::tile_smem(112, 2, TilePlan::DEFAULT, false);
        assert_eq!(
            sequential_sets(256, down2 + STATIC + 1024, sm, 132, false),
            1
        );
        // rtn4 gate/up (86 KB, two blocks an SM): 896 blocks take four sets each (224 blocks).
        let gate_up4 = CudaBackend::tile_smem(64, 4, TilePlan::DEFAULT, true);
        assert_eq!(
            sequential_sets(896, gate_up4 + STATIC + 1024, sm, 132, false),
            4
        );
        // rtn2 gate/up (62 KB, three an SM): one set, unless every launch is asked to run in
        // one wave (896 blocks over 396 slots: three sets).
        let gate_up2 = CudaBackend::tile_smem(32, 2, TilePlan::DEFAULT, true);
        assert_eq!(
            sequential_sets(896, gate_up2 + STATIC + 1024, sm, 132, false),
            1
        );
        assert_eq!(
            sequential_sets(896, gate_up2 + STATIC + 1024, sm, 132, true),
            3
        );
        // One wave already: one set.
        assert_eq!(sequential_sets(100, 200_000, sm, 132, false), 1);
        assert_eq!(sequential_sets(200, 90_000, sm, 132, true), 1);
    }

    #[test]
    fn plans_parse_from_the_environment_syntax() {
        let p = |tiles, stages, seq, warps| {
            Some(TilePlan {
                tiles,
                stages,
                seq,
                warps,
            })
        };
        assert_eq!(TilePlan::parse("1,3"), p(1, 3, 1, 8));
        assert_eq!(TilePlan::parse("1, 4, 4"), p(1, 4, 4, 8));
        assert_eq!(TilePlan::parse("2,4,2"), p(2, 4, 2, 8));
        assert_eq!(TilePlan::parse("1,3,2,16"), p(1, 3, 2, 16));
        for bad in [
            "",
            "1",
            "3,3",
            "1,8",
            "1,3,0",
            "1,3,17",
            "1,x",
            "1,3,2,2",
            "2,3,1,16",
            "1,3,1,8,1",
        ] {
            assert_eq!(TilePlan::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn tile_smem_counts_planes_and_rings() {
        // Llama-3.1-8B gate/up at 2 bits: 4096 columns = 32 super-chunks of 128; planes
        // 3 × (2048 + 4) words; rings 8 warps × stages × 4 tiles × 768 B.
        let plan = TilePlan {
            tiles: 2,
            ..TilePlan::DEFAULT
        };
        assert_eq!(
            CudaBackend::tile_smem(32, 2, plan, true),
            12 * 2052 + 8 * 3 * 4 * 768
        );
        // Its down projection (14336 columns) in the default plan: x dominates.
        assert_eq!(
            CudaBackend::tile_smem(112, 2, TilePlan::DEFAULT, false),
            12 * (14336 / 2 + 4) + 8 * 3 * 768
        );
        // At 3 bits a lane's share of a unit is 24 B of codes, 8 B of scale/zero.
        assert_eq!(
            CudaBackend::tile_smem(112, 3, TilePlan::DEFAULT, false),
            12 * (14336 / 2 + 4) + 8 * 3 * 32 * 32
        );
        // At 4 bits two 64-column super-chunks (16 B a lane each) make a unit.
        assert_eq!(
            CudaBackend::tile_smem(224, 4, TilePlan::DEFAULT, false),
            12 * (14336 / 2 + 4) + 8 * 3 * 32 * 40
        );
    }
}

//! Weight refinement on the device (kernels/refine.cu): the channel selection S(x) and the
//! gather-accumulate of the selected columns, read from wherever the byte store lies —
//! host memory mapped into the device (the ram tier) or device memory.

use super::{blocks, i32_of, Arg, CudaBackend, CudaBuffer, CudaIndex, MAX_GRID_YZ};
use crate::backend::refine::{
    columns_check, gather_check, select_check, stage_check, ColumnTarget, StageTarget,
    MAX_COLUMN_TARGETS,
};
use crate::error::{Result, RuntimeError};

/// Channels a selection block takes (`RS_CHUNK`); output rows of a gather block (`RC_SLAB`)
/// and its threads; the columns one gather block takes when a slab's columns are split
/// (`RC_IN_FLIGHT` × warps: one round of reads each), and the most splits.
const SELECT_THREADS: usize = 1024;
const COLUMN_SLAB: usize = 1024;
const COLUMN_THREADS: usize = 256;
const COLUMNS_PER_SPLIT: usize = 32;
const MAX_SPLITS: usize = 32;
/// Slabs a split launch may have: its tickets sit in a region of this many words at the
/// scratch's start whatever the launch's shape, so launches of different shapes can share one
/// scratch (every ticket is zero between launches; no launch's partials land on another's
/// tickets). 128 slabs are 131,072 output rows; a launch with more runs unsplit.
const TICKET_WORDS: usize = 128;
/// Threads of a staging block (one selected column each) and of a value gather (one row).
const STAGE_THREADS: u32 = 128;
const GATHER_THREADS: u32 = 256;

/// The kernel's `ColumnTarget`, field for field.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct ColumnTargetParams {
    cols: u64,
    out: u64,
    scales: u64,
    unit_bytes: i32,
    out_dim: i32,
    first_block: i32,
    aligned: i32,
    accumulate: i32,
}

/// The kernel's `ColumnParams`, field for field.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct ColumnParams {
    sel: u64,
    vals: u64,
    row_len: i32,
    selected: i32,
    cols_per_split: i32,
    n_blocks: i32,
    partial: u64,
    tickets: u64,
    n_targets: i32,
    t: [ColumnTargetParams; MAX_COLUMN_TARGETS],
}

/// The kernel's `StageTarget`, field for field.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct StageTargetParams {
    store: u64,
    dst: u64,
    unit_bytes: i32,
    pad: i32,
}

/// The kernel's `StageParams`, field for field.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct StageParams {
    sel: u64,
    row_len: i32,
    selected: i32,
    n_targets: i32,
    pad: i32,
    t: [StageTargetParams; MAX_COLUMN_TARGETS],
}

/// Rows of a launch as its grid extent: the selection's y, the gather's z.
fn rows_check(op: &'static str, rows: usize) -> Result<u32> {
    u32::try_from(rows)
        .ok()
        .filter(|&r| r <= MAX_GRID_YZ)
        .ok_or_else(|| RuntimeError::Shape {
            op,
            msg: format!("{rows} rows in one launch (at most {MAX_GRID_YZ})"),
        })
}

/// Output slabs of a gather launch into outputs of `out_dims` rows.
fn slabs_of(out_dims: &[usize]) -> usize {
    out_dims.iter().map(|d| d.div_ceil(COLUMN_SLAB)).sum()
}

/// How a gather launch of `slabs` slabs splits each slab's columns: `(splits, columns per
/// split)`. A decode row splits so every block issues its reads in one round (bytes in flight
/// are what the bus needs); prefill rows, and launches with more slabs than the scratch has
/// tickets, keep one block per slab and need no scratch.
fn column_splits(rows: usize, selected: usize, slabs: usize) -> (usize, usize) {
    if rows != 1 || selected <= COLUMNS_PER_SPLIT || slabs > TICKET_WORDS {
        return (1, selected.max(1));
    }
    let splits = selected.div_ceil(COLUMNS_PER_SPLIT).min(MAX_SPLITS);
    (splits, selected.div_ceil(splits))
}

/// Scratch of a gather launch: [`TICKET_WORDS`] tickets (u32 in f32 slots; a launch uses one
/// per slab), then the split partials, `[slabs, splits, COLUMN_SLAB]`.
pub(super) fn scratch_len(rows: usize, selected: usize, out_dims: &[usize]) -> usize {
    let slabs = slabs_of(out_dims);
    let (splits, _) = column_splits(rows, selected, slabs);
    if splits == 1 {
        return 0;
    }
    TICKET_WORDS + slabs * splits * COLUMN_SLAB
}

impl CudaBackend {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn stage_selected_units_kernel(
        &self,
        rows: usize,
        row_len: usize,
        sel: &CudaIndex,
        selected: usize,
        targets: &mut [StageTarget<'_, Self>],
    ) -> Result<()> {
        let op = "stage_selected_units";
        stage_check(rows, row_len, sel.len, selected, targets, |s| s.len)?;
        if rows == 0 || selected == 0 || targets.is_empty() {
            return Ok(());
        }
        let mut params = StageParams {
            sel: sel.mem.ptr,
            row_len: i32_of(op, row_len)?,
            selected: i32_of(op, selected)?,
            n_targets: targets.len() as i32,
            ..Default::default()
        };
        for (slot, t) in params.t.iter_mut().zip(targets.iter()) {
            *slot = StageTargetParams {
                store: t.store.device_ptr() + t.offset as u64,
                dst: t.dst.device_ptr(),
                unit_bytes: i32_of(op, t.unit_bytes)?,
                pad: 0,
            };
        }
        self.launch(
            &self.k().refine_stage_units,
            (
                u32::try_from(selected).map_err(|_| RuntimeError::Shape {
                    op,
                    msg: format!("{selected} selected channels in one launch"),
                })?,
                rows_check(op, rows)?,
                targets.len() as u32,
            ),
            (STAGE_THREADS, 1, 1),
            0,
            &mut [Arg::Stage(params)],
        )
    }

    pub(super) fn gather_selected_values_kernel(
        &self,
        x: &CudaBuffer,
        row_len: usize,
        norm: Option<(&CudaBuffer, f32)>,
        sel: &CudaIndex,
        selected: usize,
        values: &mut CudaBuffer,
    ) -> Result<()> {
        let op = "gather_selected_values";
        let rows = gather_check(
            x.len,
            row_len,
            norm.map(|(w, _)| w.len),
            sel.len,
            selected,
            values.len,
        )?;
        if rows == 0 || selected == 0 {
            return Ok(());
        }
        let (w, eps) = norm.map_or((0, 0.0), |(w, eps)| (w.mem.ptr, eps));
        self.launch(
            &self.k().refine_gather_values,
            (rows_check(op, rows)?, 1, 1),
            (GATHER_THREADS, 1, 1),
            0,
            &mut [
                Arg::Ptr(x.mem.ptr),
                Arg::Ptr(w),
                Arg::F32(eps),
                Arg::I32(i32_of(op, row_len)?),
                Arg::Ptr(sel.mem.ptr),
                Arg::I32(i32_of(op, selected)?),
                Arg::Ptr(values.mem.ptr),
            ],
        )
    }

    pub(super) fn select_channels_kernel(
        &self,
        x: &CudaBuffer,
        row_len: usize,
        norm: Option<(&CudaBuffer, f32)>,
        k_per_1024: usize,
        sel: &mut CudaIndex,
        values: &mut CudaBuffer,
    ) -> Result<()> {
        let op = "select_channels";
        let (rows, per_row) = select_check(
            x.len,
            row_len,
            norm.map(|(w, _)| w.len),
            k_per_1024,
            sel.len,
            values.len,
        )?;
        if rows == 0 || per_row == 0 {
            return Ok(());
        }
        let (w, eps) = norm.map_or((0, 0.0), |(w, eps)| (w.mem.ptr, eps));
        self.launch(
            &self.k().refine_select,
            (blocks(row_len, SELECT_THREADS), rows_check(op, rows)?, 1),
            (SELECT_THREADS as u32, 1, 1),
            0,
            &mut [
                Arg::Ptr(x.mem.ptr),
                Arg::Ptr(w),
                Arg::F32(eps),
                Arg::I32(i32_of(op, row_len)?),
                Arg::I32(i32_of(op, k_per_1024)?),
                Arg::Ptr(sel.mem.ptr),
                Arg::Ptr(values.mem.ptr),
                Arg::I32(i32_of(op, per_row)?),
            ],
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn add_selected_columns_kernel(
        &self,
        rows: usize,
        row_len: usize,
        sel: &CudaIndex,
        values: &CudaBuffer,
        selected: usize,
        targets: &mut [ColumnTarget<'_, Self>],
        scratch: &mut CudaBuffer,
    ) -> Result<()> {
        let op = "add_selected_columns";
        let check = columns_check::<Self>(
            rows,
            row_len,
            sel.len,
            values.len,
            selected,
            targets,
            |s| s.len,
            |b| b.len,
        )?;
        if rows == 0 || selected == 0 {
            return Ok(());
        }
        let need = scratch_len(rows, selected, &check.out_dims);
        if scratch.len < need {
            return Err(RuntimeError::Shape {
                op,
                msg: format!("scratch of {} for {need}", scratch.len),
            });
        }
        let (splits, per_split) = column_splits(rows, selected, slabs_of(&check.out_dims));
        let mut params = ColumnParams {
            sel: sel.mem.ptr,
            vals: values.mem.ptr,
            row_len: i32_of(op, row_len)?,
            selected: i32_of(op, selected)?,
            cols_per_split: i32_of(op, per_split)?,
            n_targets: targets.len() as i32,
            ..Default::default()
        };
        let mut grid = 0usize;
        for ((slot, t), &out_dim) in params.t.iter_mut().zip(targets.iter()).zip(&check.out_dims) {
            let cols = t.store.device_ptr() + t.offset as u64;
            *slot = ColumnTargetParams {
                cols,
                out: t.out.mem.ptr,
                scales: t.scales.mem.ptr,
                unit_bytes: i32_of(op, t.unit_bytes)?,
                out_dim: i32_of(op, out_dim)?,
                first_block: i32_of(op, grid)?,
                aligned: i32::from(cols.is_multiple_of(16) && t.unit_bytes.is_multiple_of(16)),
                accumulate: i32::from(t.accumulate),
            };
            grid += out_dim.div_ceil(COLUMN_SLAB);
        }
        params.n_blocks = i32_of(op, grid)?;
        // Tickets first, then the partials.
        params.tickets = scratch.mem.ptr;
        params.partial = scratch.mem.ptr + (TICKET_WORDS * 4) as u64;
        self.launch(
            &self.k().refine_columns,
            (blocks(grid, 1), splits as u32, rows_check(op, rows)?),
            (COLUMN_THREADS as u32, 1, 1),
            0,
            &mut [Arg::Columns(params)],
        )
    }
}

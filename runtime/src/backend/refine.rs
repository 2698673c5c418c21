//! The device side of selective weight refinement (issue 14): what the channel selection and
//! the column gather-accumulate of one projection set read and write, and the checks every
//! backend runs before touching memory.
//!
//! A projection's refinement is `in_dim` columns of `unit_bytes` bytes each (docs/format.md,
//! `column_nibbles`): column `i` holds the 4-bit levels `nibble − 8` of `C[:, i]`, element
//! `e` in byte `e / 2`, low nibble first. With the columns in host memory the device reads
//! directly ([`Backend::alloc_host_byte_store`]), a decode step reads only the selected
//! columns, one contiguous read each, and never waits on the host.

use super::Backend;
use crate::error::{Result, RuntimeError};
use crate::refine::select::{selected_count, CHUNK};

/// One projection of a set whose columns [`Backend::add_selected_columns`] adds.
pub struct ColumnTarget<'a, B: Backend> {
    /// The columns: `in_dim` units of `unit_bytes` bytes from byte `offset` of `store`.
    pub store: &'a B::ByteStore,
    pub offset: usize,
    pub unit_bytes: usize,
    /// Per-output-row scales (`out_dim` values: the buffer's length).
    pub scales: &'a B::Buffer,
    /// The projection's output `[rows, out_dim]`: accumulated into, or overwritten (a delta
    /// that a branch computes beside the projection, added to its output after the join).
    pub out: &'a mut B::Buffer,
    pub accumulate: bool,
}

/// One projection whose selected columns [`Backend::stage_selected_units`] copies.
pub struct StageTarget<'a, B: Backend> {
    /// The columns: `row_len` units of `unit_bytes` bytes from byte `offset` of `store`.
    pub store: &'a B::ByteStore,
    pub offset: usize,
    pub unit_bytes: usize,
    /// Where the selected units go, in selection order.
    pub dst: &'a mut B::ByteStore,
}

/// Most projections one [`Backend::add_selected_columns`] or
/// [`Backend::stage_selected_units`] call takes (q, k, v).
pub const MAX_COLUMN_TARGETS: usize = 3;

/// A decode row's refinement of one projection, applied by the projection's own launch
/// where the backend can ([`Backend::fuses_refinement`]): `y[e] += scales[e] · Σ_j x̂[i_j] ·
/// level(C_j)[e]` over the `selected` channels `i_j = sel[j]` of the projection's input x̂
/// (normalised as the projection normalises it), C_j being column `i_j` of `store` or, with
/// `staged`, column `j` (fetch lead copied the selected columns there in selection order).
/// An index of the input's length or more names no channel and adds nothing.
pub struct FusedColumns<'a, B: Backend> {
    pub sel: &'a B::Index,
    pub selected: usize,
    pub store: &'a B::ByteStore,
    pub staged: bool,
    pub unit_bytes: usize,
    /// Per-output-row scales (`out_dim` values).
    pub scales: &'a B::Buffer,
}

impl<B: Backend> Clone for FusedColumns<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for FusedColumns<'_, B> {}

/// [`FusedColumns`] as separate ops — the values gathered ([`Backend::gather_selected_values`]),
/// the columns added into a delta ([`Backend::add_selected_columns`]) and the delta added to
/// `y` — for one decode row of input `x[row_len]` (with `norm`, its RMSNorm). The backends'
/// default projections run this after the unrefined product; it is the reference the fused
/// launches are checked against.
pub fn apply_fused_columns<B: Backend>(
    b: &B,
    x: &B::Buffer,
    row_len: usize,
    norm: Option<(&B::Buffer, f32)>,
    refine: &FusedColumns<'_, B>,
    y: &mut B::Buffer,
) -> Result<()> {
    let n = refine.selected;
    if b.buffer_len(x) != row_len {
        return Err(shape_err(
            "fused refinement",
            format!("one row of {row_len} in an input of {}", b.buffer_len(x)),
        ));
    }
    if n == 0 {
        return Ok(());
    }
    let mut values = b.alloc(n)?;
    b.gather_selected_values(x, row_len, norm, refine.sel, n, &mut values)?;
    let out_dim = b.buffer_len(refine.scales);
    let mut delta = b.alloc(out_dim)?;
    let mut scratch = b.alloc(b.selected_columns_scratch_len(1, n, &[out_dim]).max(1))?;
    let staged_order;
    let (sel, columns) = if refine.staged {
        let order: Vec<u32> = (0..n as u32).collect();
        let mut idx = b.alloc_index(n)?;
        b.write_index(&mut idx, &order)?;
        staged_order = idx;
        (&staged_order, n)
    } else {
        (refine.sel, row_len)
    };
    // Staged: entry j's column is column j (an index past the input staged zeros and
    // gathered a zero value); unstaged: column sel[j] of the input's columns.
    let mut targets = [ColumnTarget {
        store: refine.store,
        offset: 0,
        unit_bytes: refine.unit_bytes,
        scales: refine.scales,
        out: &mut delta,
        accumulate: false,
    }];
    b.add_selected_columns(1, columns, sel, &values, n, &mut targets, &mut scratch)?;
    b.add_assign(y, &delta)
}

fn shape_err(op: &'static str, msg: String) -> RuntimeError {
    RuntimeError::Shape { op, msg }
}

/// Checks a [`Backend::select_channels`] call; returns `(rows, selected per row)`.
/// Rows of `row_len` in an input of `x_len`, with a norm weight of `norm_len` if any.
fn input_rows(
    op: &'static str,
    x_len: usize,
    row_len: usize,
    norm_len: Option<usize>,
) -> Result<usize> {
    if row_len == 0 || !x_len.is_multiple_of(row_len) {
        return Err(shape_err(
            op,
            format!("rows of {row_len} over an input of {x_len}"),
        ));
    }
    if let Some(n) = norm_len.filter(|&n| n != row_len) {
        return Err(shape_err(
            op,
            format!("a norm weight of {n} for rows of {row_len}"),
        ));
    }
    Ok(x_len / row_len)
}

pub fn select_check(
    x_len: usize,
    row_len: usize,
    norm_len: Option<usize>,
    k_per_1024: usize,
    sel_len: usize,
    values_len: usize,
) -> Result<(usize, usize)> {
    let op = "select_channels";
    let rows = input_rows(op, x_len, row_len, norm_len)?;
    if k_per_1024 > CHUNK {
        return Err(shape_err(
            op,
            format!("k = {k_per_1024} per {CHUNK} channels: at most {CHUNK}"),
        ));
    }
    let per_row = selected_count(k_per_1024, row_len);
    if rows * per_row > sel_len.min(values_len) {
        return Err(shape_err(
            op,
            format!(
                "{rows} rows of {per_row} selected channels do not fit an index of {sel_len} \
                 and values of {values_len}"
            ),
        ));
    }
    Ok((rows, per_row))
}

/// Checks [`Backend::stage_selected_units`]'s shapes (`sel_len` indices; each target's
/// store and destination sized by `bytes`).
pub fn stage_check<B: Backend>(
    rows: usize,
    row_len: usize,
    sel_len: usize,
    selected: usize,
    targets: &[StageTarget<'_, B>],
    bytes: impl Fn(&B::ByteStore) -> usize,
) -> Result<()> {
    let op = "stage_selected_units";
    if targets.len() > MAX_COLUMN_TARGETS {
        return Err(shape_err(
            op,
            format!(
                "{} targets in one call (at most {MAX_COLUMN_TARGETS})",
                targets.len()
            ),
        ));
    }
    let units = rows.saturating_mul(selected);
    if units > sel_len {
        return Err(shape_err(
            op,
            format!("{rows} rows of {selected} selected channels from an index of {sel_len}"),
        ));
    }
    for (n, t) in targets.iter().enumerate() {
        let (unit_bytes, offset) = (t.unit_bytes, t.offset);
        let store_len = bytes(t.store);
        let end = row_len
            .checked_mul(unit_bytes)
            .and_then(|b| b.checked_add(offset));
        if end.is_none_or(|e| e > store_len) {
            return Err(shape_err(
                op,
                format!(
                    "target {n}: {row_len} columns of {unit_bytes} bytes from byte {offset} of a \
                     store of {store_len}"
                ),
            ));
        }
        let dst_len = bytes(t.dst);
        if units.checked_mul(unit_bytes).is_none_or(|n| n > dst_len) {
            return Err(shape_err(
                op,
                format!(
                    "target {n}: {units} units of {unit_bytes} bytes into a destination of \
                     {dst_len}"
                ),
            ));
        }
    }
    Ok(())
}

/// Checks [`Backend::gather_selected_values`]'s shapes; returns the rows.
pub fn gather_check(
    x_len: usize,
    row_len: usize,
    norm_len: Option<usize>,
    sel_len: usize,
    selected: usize,
    values_len: usize,
) -> Result<usize> {
    let op = "gather_selected_values";
    let rows = input_rows(op, x_len, row_len, norm_len)?;
    if rows * selected > sel_len.min(values_len) {
        return Err(shape_err(
            op,
            format!(
                "{rows} rows of {selected} channels from an index of {sel_len} into values of {values_len}"
            ),
        ));
    }
    Ok(rows)
}

/// What [`Backend::add_selected_columns`] checked: per target its output size.
pub struct ColumnCheck {
    pub out_dims: Vec<usize>,
}

/// Checks an [`Backend::add_selected_columns`] call. `store_len` gives a target's store
/// size in bytes, `buffer_len` a buffer's length.
#[allow(clippy::too_many_arguments)]
pub fn columns_check<B: Backend>(
    rows: usize,
    row_len: usize,
    sel_len: usize,
    values_len: usize,
    selected: usize,
    targets: &[ColumnTarget<'_, B>],
    store_len: impl Fn(&B::ByteStore) -> usize,
    buffer_len: impl Fn(&B::Buffer) -> usize,
) -> Result<ColumnCheck> {
    let op = "add_selected_columns";
    if selected > row_len || rows * selected > sel_len.min(values_len) {
        return Err(shape_err(
            op,
            format!(
                "{rows} rows of {selected} selected channels of {row_len} from an index of \
                 {sel_len} and values of {values_len}"
            ),
        ));
    }
    if targets.is_empty() || targets.len() > MAX_COLUMN_TARGETS {
        return Err(shape_err(
            op,
            format!("{} targets (1 to {MAX_COLUMN_TARGETS})", targets.len()),
        ));
    }
    let mut out_dims = Vec::with_capacity(targets.len());
    for (i, t) in targets.iter().enumerate() {
        let out_dim = buffer_len(t.scales);
        if out_dim == 0 || t.unit_bytes < out_dim.div_ceil(2) {
            return Err(shape_err(
                op,
                format!(
                    "target {i}: {out_dim} scales for columns of {} bytes",
                    t.unit_bytes
                ),
            ));
        }
        let end = row_len
            .checked_mul(t.unit_bytes)
            .and_then(|b| b.checked_add(t.offset));
        let have = store_len(t.store);
        if end.is_none_or(|e| e > have) {
            return Err(shape_err(
                op,
                format!(
                    "target {i}: {row_len} columns of {} bytes from byte {} of a store of {have}",
                    t.unit_bytes, t.offset
                ),
            ));
        }
        let out_len = buffer_len(t.out);
        if out_len != rows * out_dim {
            return Err(shape_err(
                op,
                format!("target {i}: output of {out_len} for {rows} rows of {out_dim}"),
            ));
        }
        out_dims.push(out_dim);
    }
    Ok(ColumnCheck { out_dims })
}

/// [`Backend::rms_norm_swiglu_refined`] by separate ops: the norm, gate and up with their
/// refinements ([`Backend::rms_norm_matmul_group`]), then SwiGLU. The default, and the
/// devices' path where their launches cannot take it.
#[allow(clippy::too_many_arguments)]
pub fn swiglu_refined_by_ops<B: Backend>(
    b: &B,
    x: &B::Buffer,
    norm: &B::Buffer,
    eps: f32,
    normed: &mut B::Buffer,
    m: usize,
    w_gate: &B::Matrix,
    w_up: &B::Matrix,
    gate: &mut B::Buffer,
    up: &mut B::Buffer,
    refine: [&FusedColumns<'_, B>; 2],
) -> Result<()> {
    let items = &mut [
        super::GroupItem {
            refine: Some(*refine[0]),
            ..super::GroupItem::new(w_gate, None, gate)
        },
        super::GroupItem {
            refine: Some(*refine[1]),
            ..super::GroupItem::new(w_up, None, up)
        },
    ];
    b.rms_norm_matmul_group(x, norm, eps, normed, m, items)?;
    b.silu_mul(gate, up)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBuffer;
    use crate::CpuBackend;

    #[test]
    fn selection_checks_name_the_bad_field() {
        assert_eq!(
            select_check(8192, 4096, Some(4096), 16, 128, 128).unwrap(),
            (2, 64)
        );
        let msg = |r: Result<(usize, usize)>| r.unwrap_err().to_string();
        assert!(msg(select_check(4000, 4096, None, 16, 64, 64)).contains("rows of 4096"));
        assert!(msg(select_check(4096, 4096, Some(576), 16, 64, 64)).contains("norm weight of 576"));
        assert!(msg(select_check(4096, 4096, None, 2048, 4096, 4096)).contains("k = 2048"));
        assert!(msg(select_check(4096, 4096, None, 16, 64, 63)).contains("values of 63"));
    }

    /// [`stage_check`] of one row over `targets` given as (store bytes, offset, unit bytes,
    /// destination bytes).
    fn stage(rows: usize, sel_len: usize, targets: &[(usize, usize, usize, usize)]) -> Result<()> {
        let stores: Vec<Vec<u8>> = targets.iter().map(|&(s, ..)| vec![0u8; s]).collect();
        let mut dsts: Vec<Vec<u8>> = targets.iter().map(|&(.., d)| vec![0u8; d]).collect();
        let list: Vec<StageTarget<'_, CpuBackend>> = stores
            .iter()
            .zip(dsts.iter_mut())
            .zip(targets)
            .map(|((store, dst), &(_, offset, unit_bytes, _))| StageTarget {
                store,
                offset,
                unit_bytes,
                dst,
            })
            .collect();
        stage_check(rows, 4096, sel_len, 64, &list, |s| s.len())
    }

    #[test]
    fn lead_checks_name_the_bad_field() {
        let q = (4096 * 2048, 0, 2048, 64 * 2048);
        let kv = (4096 * 512, 0, 512, 64 * 512);
        assert!(stage(1, 64, &[q, kv, kv]).is_ok());
        let msg = |r: Result<()>| r.unwrap_err().to_string();
        assert!(msg(stage(1, 64, &[q, kv, kv, kv])).contains("4 targets"));
        assert!(msg(stage(2, 64, &[q])).contains("index of 64"));
        assert!(msg(stage(1, 64, &[q, (4096 * 16, 1, 16, 1 << 20)]))
            .contains("target 1: 4096 columns of 16 bytes from byte 1"));
        assert!(msg(stage(1, 64, &[(1 << 20, 0, 16, 1023)]))
            .contains("target 0: 64 units of 16 bytes into a destination of 1023"));
        assert_eq!(
            gather_check(8192, 4096, Some(4096), 128, 64, 128).unwrap(),
            2
        );
        let msg = |r: Result<usize>| r.unwrap_err().to_string();
        assert!(msg(gather_check(4000, 4096, None, 64, 64, 64)).contains("rows of 4096"));
        assert!(msg(gather_check(4096, 4096, Some(576), 64, 64, 64)).contains("norm weight of 576"));
        assert!(msg(gather_check(8192, 4096, None, 128, 64, 127)).contains("values of 127"));
    }

    #[test]
    fn column_checks_name_the_bad_target() {
        // 100 columns of 8 bytes (16 output rows), 16 selected per row, one row.
        let store = vec![0u8; 100 * 8];
        let scales = CpuBuffer(vec![1.0; 16]);
        let (mut a, mut short) = (CpuBuffer(vec![0.0; 16]), CpuBuffer(vec![0.0; 15]));
        fn target<'a>(
            store: &'a Vec<u8>,
            scales: &'a CpuBuffer,
            offset: usize,
            unit_bytes: usize,
            out: &'a mut CpuBuffer,
        ) -> ColumnTarget<'a, CpuBackend> {
            ColumnTarget {
                store,
                offset,
                unit_bytes,
                scales,
                out,
                accumulate: true,
            }
        }
        fn check(
            targets: &[ColumnTarget<'_, CpuBackend>],
            selected: usize,
        ) -> std::result::Result<Vec<usize>, String> {
            columns_check::<CpuBackend>(1, 100, 16, 16, selected, targets, |s| s.len(), |b| b.len())
                .map(|c| c.out_dims)
                .map_err(|e| e.to_string())
        }
        assert_eq!(
            check(&[target(&store, &scales, 0, 8, &mut a)], 16).unwrap(),
            [16]
        );
        let e = check(&[target(&store, &scales, 0, 8, &mut a)], 17).unwrap_err();
        assert!(e.contains("17 selected"), "{e}");
        let e = check(&[target(&store, &scales, 1, 8, &mut a)], 16).unwrap_err();
        assert!(e.contains("target 0") && e.contains("from byte 1"), "{e}");
        let e = check(&[target(&store, &scales, 0, 7, &mut a)], 16).unwrap_err();
        assert!(e.contains("columns of 7 bytes"), "{e}");
        let e = check(
            &[
                target(&store, &scales, 0, 8, &mut a),
                target(&store, &scales, 0, 8, &mut short),
            ],
            16,
        )
        .unwrap_err();
        assert!(e.contains("target 1: output of 15"), "{e}");
        assert!(check(&[], 16).unwrap_err().contains("0 targets"));
    }
}

//! The refinement engine in the backend ([`super::Refiner::place_in_backend`]): every
//! projection's columns copied once into a byte store the backend's kernels read (page-locked
//! host memory mapped into the device on CUDA), each set refined by two backend ops —
//! [`Backend::select_channels`] and [`Backend::add_selected_columns`] — and, for a decode row,
//! run as a branch beside the set's resident projection into a per-set delta that the finish
//! adds after the join. Nothing waits on the host, so a step with refinement is captured into
//! the step graph like one without.

use super::engine::{ColumnSource, RefineCounters, RefinementPlan, SetInput};
use super::select::selected_count;
use crate::backend::refine::ColumnTarget;
use crate::backend::Backend;
use crate::error::{Result, RuntimeError};
use crate::observe::ProjectionSet;
use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};

/// One projection's columns in a backend byte store, with its scales.
struct PlacedColumns<B: Backend> {
    store: B::ByteStore,
    unit_bytes: usize,
    scales: B::Buffer,
}

/// Where a set's selection goes: `rows` rows of up to `per_row` channels, their values, and
/// the gather's scratch.
struct Selection<B: Backend> {
    rows: usize,
    sel: B::Index,
    values: B::Buffer,
    scratch: B::Buffer,
}

impl<B: Backend> Selection<B> {
    fn new(b: &B, rows: usize, per_row: usize, scratch: usize) -> Result<Self> {
        let n = (rows * per_row).max(1);
        Ok(Self {
            rows,
            sel: b.alloc_index(n)?,
            values: b.alloc(n)?,
            scratch: b.alloc(scratch.max(1))?,
        })
    }
}

/// Source of [`Placed::graph_id`]s.
static NEXT_GRAPH_ID: AtomicU64 = AtomicU64::new(1);

/// The refinement the backend reads itself.
pub(super) struct Placed<B: Backend> {
    /// `[layer][set]`: the set's projections in graph order.
    layers: Vec<[Vec<PlacedColumns<B>>; 4]>,
    /// A decode step's selection: reallocated only by [`Placed::set_budgets`] (a captured
    /// step graph points into it, and a new budget gets a new graph).
    step: Selection<B>,
    /// Those of a chunk of rows, grown as chunks need.
    chunk: Option<Selection<B>>,
    /// Per set, a decode row's refinement of each projection, computed by a branch beside
    /// the projection ([`Placed::start`]) and added to its output after the join.
    deltas: [Vec<B::Buffer>; 4],
    /// The `(layer, set)` whose branch is running.
    started: Option<(usize, ProjectionSet)>,
    /// Most channels one row of any set selects.
    max_selected: usize,
    /// Units and bytes one token's refinement reads: the selection's size is fixed by k.
    units_per_token: u64,
    bytes_per_token: u64,
    /// Bytes of the byte stores.
    pub(super) store_bytes: u64,
    /// Distinguishes this engine's captured step graphs from another's.
    pub(super) graph_id: u64,
}

impl<B: Backend> Placed<B> {
    /// Copies every source's columns (`column_bytes` gives a source's `inp · unit_bytes`
    /// bytes) into host byte stores and sizes the selection for budgets `k`.
    pub(super) fn new<'s>(
        b: &B,
        plan: &RefinementPlan,
        k: [usize; 4],
        mut column_bytes: impl FnMut(&ColumnSource) -> Result<Cow<'s, [u8]>>,
    ) -> Result<Self> {
        let mut layers = Vec::with_capacity(plan.layers.len());
        let mut stored = 0u64;
        for l in &plan.layers {
            let mut sets: [Vec<PlacedColumns<B>>; 4] = Default::default();
            for (sources, placed) in l.sets.iter().zip(sets.iter_mut()) {
                for src in sources {
                    let want = src.inp.checked_mul(src.unit_bytes).ok_or_else(|| {
                        RuntimeError::Config(format!(
                            "refinement columns of {} × {} bytes overflow",
                            src.inp, src.unit_bytes
                        ))
                    })?;
                    let data = column_bytes(src)?;
                    if data.len() != want {
                        return Err(RuntimeError::Config(format!(
                            "refinement columns: {} bytes where {} columns of {} need {want}",
                            data.len(),
                            src.inp,
                            src.unit_bytes
                        )));
                    }
                    let mut store = b.alloc_host_byte_store(want)?;
                    b.write_byte_store(&mut store, 0, &data)?;
                    stored += want as u64;
                    placed.push(PlacedColumns {
                        store,
                        unit_bytes: src.unit_bytes,
                        scales: b.upload(&src.scales)?,
                    });
                }
            }
            layers.push(sets);
        }
        let mut deltas: [Vec<B::Buffer>; 4] = Default::default();
        if let Some(l) = plan.layers.first() {
            for (d, sources) in deltas.iter_mut().zip(&l.sets) {
                for src in sources {
                    d.push(b.alloc(src.out)?);
                }
            }
        }
        let mut placed = Placed {
            layers,
            step: Selection::new(b, 1, 1, 0)?,
            chunk: None,
            deltas,
            started: None,
            max_selected: 0,
            units_per_token: 0,
            bytes_per_token: 0,
            store_bytes: stored,
            graph_id: 0,
        };
        placed.set_budgets(b, plan, k)?;
        Ok(placed)
    }

    /// Sizes the selection for budgets `k` and takes a new step-graph id.
    pub(super) fn set_budgets(
        &mut self,
        b: &B,
        plan: &RefinementPlan,
        k: [usize; 4],
    ) -> Result<()> {
        let (mut units, mut bytes, mut max_selected, mut scratch) = (0u64, 0u64, 0usize, 0);
        for l in &plan.layers {
            for set in ProjectionSet::ALL {
                let sources = &l.sets[set.index()];
                let Some(inp) = sources.first().map(|s| s.inp) else {
                    continue;
                };
                let selected = selected_count(k[set.index()], inp);
                max_selected = max_selected.max(selected);
                let outs: Vec<usize> = sources.iter().map(|s| s.out).collect();
                scratch = scratch.max(b.selected_columns_scratch_len(1, selected, &outs));
                for src in sources {
                    units += selected as u64;
                    bytes += (selected * src.unit_bytes) as u64;
                }
            }
        }
        self.step = Selection::new(b, 1, max_selected, scratch)?;
        self.chunk = None;
        self.max_selected = max_selected;
        self.units_per_token = units;
        self.bytes_per_token = bytes;
        self.graph_id = NEXT_GRAPH_ID.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The engine's counters after `tokens` tokens: every selected unit is applied (the ram
    /// tier has them all) and a token reads a fixed number of units.
    pub(super) fn counters(&self, tokens: u64) -> RefineCounters {
        RefineCounters {
            tokens,
            units_selected: tokens * self.units_per_token,
            units_applied: tokens * self.units_per_token,
            units_skipped: 0,
            units_failed: 0,
            bytes_applied: tokens * self.bytes_per_token,
        }
    }

    /// A new forward chunk: no branch is running.
    pub(super) fn begin_chunk(&mut self) {
        self.started = None;
    }

    /// Starts set `set` of layer `layer` (budget `k`, `inp` input channels) for a decode
    /// row as a branch into the set's deltas. Chunks of rows and a second start before the
    /// finish do nothing: the finish then refines in order.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start(
        &mut self,
        b: &B,
        layer: usize,
        set: ProjectionSet,
        k: usize,
        inp: usize,
        rows: usize,
        input: &SetInput<'_, B>,
    ) -> Result<()> {
        if rows != 1 || self.started.is_some() {
            return Ok(());
        }
        let mut deltas = std::mem::take(&mut self.deltas[set.index()]);
        b.begin_branch()?;
        let ran = {
            let mut outs: Vec<&mut B::Buffer> = deltas.iter_mut().collect();
            self.refine(b, layer, set, k, inp, rows, input, &mut outs, false)
        };
        let ended = b.end_branch();
        self.deltas[set.index()] = deltas;
        ran?;
        ended?;
        self.started = Some((layer, set));
        Ok(())
    }

    /// Finishes set `set` of layer `layer`: joins its branch and adds the deltas to
    /// `outputs`, or, when no branch ran, refines `outputs` in order.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn finish(
        &mut self,
        b: &B,
        layer: usize,
        set: ProjectionSet,
        k: usize,
        inp: usize,
        rows: usize,
        input: &SetInput<'_, B>,
        outputs: &mut [&mut B::Buffer],
    ) -> Result<()> {
        if self.started == Some((layer, set)) {
            self.started = None;
            b.join_branch()?;
            for (y, d) in outputs.iter_mut().zip(&self.deltas[set.index()]) {
                b.add_assign(y, d)?;
            }
            return Ok(());
        }
        self.refine(b, layer, set, k, inp, rows, input, outputs, true)
    }

    /// The selection (with the set's norm applied by the selection itself), then the
    /// selected columns of every projection of the set in one launch, added to `outputs` or
    /// (`accumulate` false) written over them.
    #[allow(clippy::too_many_arguments)]
    fn refine(
        &mut self,
        b: &B,
        layer: usize,
        set: ProjectionSet,
        k: usize,
        inp: usize,
        rows: usize,
        input: &SetInput<'_, B>,
        outputs: &mut [&mut B::Buffer],
        accumulate: bool,
    ) -> Result<()> {
        let selected = selected_count(k, inp);
        let buffers = if rows <= 1 {
            &mut self.step
        } else {
            if self.chunk.as_ref().is_none_or(|c| c.rows < rows) {
                self.chunk = Some(Selection::new(b, rows, self.max_selected, 0)?);
            }
            match self.chunk.as_mut() {
                Some(c) => c,
                None => return Err(RuntimeError::EmptyInput),
            }
        };
        let (raw, norm) = match *input {
            SetInput::Plain(x) => (x, None),
            SetInput::Normed { raw, norm, eps, .. } => (raw, Some((norm, eps))),
        };
        b.select_channels(raw, inp, norm, k, &mut buffers.sel, &mut buffers.values)?;
        let cols = &self.layers[layer][set.index()];
        let mut targets: Vec<ColumnTarget<'_, B>> = cols
            .iter()
            .zip(outputs.iter_mut())
            .map(|(c, y)| ColumnTarget {
                store: &c.store,
                offset: 0,
                unit_bytes: c.unit_bytes,
                scales: &c.scales,
                out: &mut **y,
                accumulate,
            })
            .collect();
        b.add_selected_columns(
            rows,
            inp,
            &buffers.sel,
            &buffers.values,
            selected,
            &mut targets,
            &mut buffers.scratch,
        )
    }
}

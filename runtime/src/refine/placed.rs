//! The refinement engine in the backend ([`super::Refiner::place_in_backend`]): every
//! projection's columns copied once into a byte store the backend's kernels read (page-locked
//! host memory mapped into the device on CUDA), each set refined by backend ops —
//! [`Backend::select_channels`] and [`Backend::add_selected_columns`] — and, for a decode row,
//! run as a branch beside the set's resident projection. Nothing waits on the host, so a step
//! with refinement is captured into the step graph like one without.
//!
//! Fetch lead and lag (docs/method.md §3) run here too:
//! - **lead** (q/k/v, gate/up): when the residual stream `s` blocks before the set's input is
//!   complete, a branch selects the set's channels from it (normalised by the set's own
//!   RMSNorm) and, for a decode row, stages the selected columns in backend memory
//!   ([`Backend::stage_selected_units`]: on CUDA the bus transfer, early); when the real
//!   input exists, its values at those channels ([`Backend::gather_selected_values`]) weight
//!   the staged columns beside the projection;
//! - **lag** (o, down): the branch beside the projection refines into the layer's own delta,
//!   and the delta is joined and added to the residual stream `s` blocks later.
//!
//! Selections read buffers the main stream overwrites later (the residual stream, a
//! projection's input), so they run on the near lane, which has no backlog when they fork,
//! and the main stream joins them before that write: lead's before the next residual add
//! (o's or down's), lag's one position later. Only the bus transfers run on the far lane.

use super::engine::{stream_position, ColumnSource, RefineCounters, RefinementPlan, SetInput};
use super::select::selected_count;
use crate::backend::refine::{ColumnTarget, FusedColumns, StageTarget};
use crate::backend::{Backend, BranchLane, BranchMark};
use crate::error::{Result, RuntimeError};
use crate::observe::ProjectionSet;
use std::borrow::Cow;
use std::collections::BTreeMap;
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

/// A decode row's fetch lead of one (layer, set): the channels selected from the earlier
/// stream, and each projection's selected columns staged in backend memory.
struct LeadStage<B: Backend> {
    sel: B::Index,
    staged: Vec<B::ByteStore>,
}

/// A selection made ahead of its set's input (fetch lead), for the current chunk.
enum Led<B: Backend> {
    /// A decode row: in the (layer, set)'s [`LeadStage`], staged by the far branch ending at
    /// the mark.
    Staged(BranchMark),
    /// A chunk of rows: the selection only (the columns are read at the real input).
    Rows(B::Index),
}

/// A lagged contribution waiting for its position in the residual stream.
struct Lagged<B: Backend> {
    due: usize,
    /// The position the set writes (its contribution's normal place).
    own: usize,
    /// The far branch's end, and the near branch's selection that read the set's input
    /// (None: the work ran in order).
    end: Option<BranchMark>,
    consumed: Option<BranchMark>,
    delta: LagDelta<B>,
}

enum LagDelta<B: Backend> {
    /// A decode row's: the (layer, set)'s buffer in `lag_deltas`.
    Layer(usize, usize),
    /// A chunk's.
    Owned(B::Buffer),
}

/// The gather's target for projection `c` reading its columns from `store`.
fn column_target<'a, B: Backend>(
    c: &'a PlacedColumns<B>,
    store: &'a B::ByteStore,
    out: &'a mut B::Buffer,
    accumulate: bool,
) -> ColumnTarget<'a, B> {
    ColumnTarget {
        store,
        offset: 0,
        unit_bytes: c.unit_bytes,
        scales: &c.scales,
        out,
        accumulate,
    }
}

/// Source of [`Placed::graph_id`]s.
static NEXT_GRAPH_ID: AtomicU64 = AtomicU64::new(1);

/// The slot of a set that adds into the residual stream (o, down: fetch lag's) in the
/// per-layer `[_; 2]` arrays.
fn lag_index(set: ProjectionSet) -> Option<usize> {
    match set {
        ProjectionSet::O => Some(0),
        ProjectionSet::Down => Some(1),
        _ => None,
    }
}

/// The slot of a set that reads the residual stream (q/k/v, gate/up: fetch lead's).
fn lead_index(set: ProjectionSet) -> Option<usize> {
    match set {
        ProjectionSet::Qkv => Some(0),
        ProjectionSet::GateUp => Some(1),
        _ => None,
    }
}

/// `[layer][o, down]`: a decode row's lagged refinement buffers, for the lag sets whose
/// `shift` is non-zero (a set of one projection; wider lag sets are not lagged).
fn lag_deltas_for<B: Backend>(
    b: &B,
    plan: &RefinementPlan,
    shift: [usize; 4],
) -> Result<Vec<[Option<B::Buffer>; 2]>> {
    let mut lag_deltas = Vec::with_capacity(plan.layers.len());
    for l in &plan.layers {
        let mut d: [Option<B::Buffer>; 2] = [None, None];
        for set in [ProjectionSet::O, ProjectionSet::Down] {
            let sources = &l.sets[set.index()];
            if let Some(slot) = lag_index(set).filter(|_| shift[set.index()] > 0) {
                if sources.len() == 1 {
                    d[slot] = Some(b.alloc(sources[0].out)?);
                }
            }
        }
        lag_deltas.push(d);
    }
    Ok(lag_deltas)
}

/// The refinement the backend reads itself.
pub(super) struct Placed<B: Backend> {
    /// `[layer][set]`: the set's projections in graph order.
    layers: Vec<[Vec<PlacedColumns<B>>; 4]>,
    /// `[layer]`: the RMSNorm weights of q/k/v and gate/up (fetch lead's selection source).
    norms: Vec<[B::Buffer; 2]>,
    eps: f32,
    hidden: usize,
    /// Lead (q/k/v, gate/up) or lag (o, down) per set, in half blocks.
    shift: [usize; 4],
    /// A decode step's selection (the near lane's): reallocated only by
    /// [`Placed::set_budgets`] (a captured step graph points into it, and a new budget gets a
    /// new graph).
    step: Selection<B>,
    /// `[layer][o, down]`: a decode row's lagged selection, read by the far lane's fetch.
    lag_selections: Vec<[Option<Selection<B>>; 2]>,
    /// Lead selections from the residual stream not yet joined: the main stream waits for
    /// them before its next residual add.
    stream_reads: Vec<BranchMark>,
    /// Those of a chunk of rows, grown as chunks need.
    chunk: Option<Selection<B>>,
    /// Per set, a decode row's refinement of each projection, computed by a branch beside
    /// the projection ([`Placed::start`]) and added to its output after the join.
    deltas: [Vec<B::Buffer>; 4],
    /// `[layer][o, down]`: a decode row's lagged refinement (fetch lag).
    lag_deltas: Vec<[Option<B::Buffer>; 2]>,
    /// `[layer][q/k/v, gate/up]`: a decode row's fetch lead.
    lead_stages: Vec<[Option<LeadStage<B>>; 2]>,
    /// `0, 1, …` up to the most channels a row selects: the gather reads staged columns
    /// through it.
    identity: B::Index,
    /// This chunk's selections made ahead, by (layer, set index).
    led: BTreeMap<(usize, usize), Led<B>>,
    lagged: Vec<Lagged<B>>,
    /// The `(layer, set)` whose branch is running, and the mark of its end.
    started: Option<(usize, ProjectionSet, BranchMark, Option<BranchMark>)>,
    /// The `(layer, set)` readied for fused launches ([`Placed::prepare_fused`]), and whether
    /// its columns are fetch lead's staged ones.
    fused: Option<(usize, ProjectionSet, bool)>,
    /// `(layer, o/down slot)` of the lagged contributions handed to the projection whose
    /// residual add lands at their position ([`Placed::take_due`]).
    due_now: Vec<(usize, usize)>,
    /// A fused set's selection made on the stream: indices, and values nobody reads (the
    /// launches gather their own), apart from the branches' buffers.
    fused_sel: B::Index,
    fused_values: B::Buffer,
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
    /// bytes) into host byte stores and sizes the selection for budgets `k` and the lead/lag
    /// `shift` (half blocks per set).
    pub(super) fn new<'s>(
        b: &B,
        plan: &RefinementPlan,
        k: [usize; 4],
        shift: [usize; 4],
        mut column_bytes: impl FnMut(&ColumnSource) -> Result<Cow<'s, [u8]>>,
    ) -> Result<Self> {
        let mut layers = Vec::with_capacity(plan.layers.len());
        let mut norms = Vec::with_capacity(plan.layers.len());
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
            norms.push([b.upload(&l.attn_norm)?, b.upload(&l.mlp_norm)?]);
        }
        let mut deltas: [Vec<B::Buffer>; 4] = Default::default();
        if let Some(l) = plan.layers.first() {
            for (d, sources) in deltas.iter_mut().zip(&l.sets) {
                for src in sources {
                    d.push(b.alloc(src.out)?);
                }
            }
        }
        let lag_deltas = lag_deltas_for(b, plan, shift)?;
        let mut placed = Placed {
            layers,
            norms,
            eps: plan.eps,
            hidden: plan.hidden,
            shift,
            step: Selection::new(b, 1, 1, 0)?,
            lag_selections: Vec::new(),
            stream_reads: Vec::new(),
            chunk: None,
            deltas,
            lag_deltas,
            lead_stages: Vec::new(),
            identity: b.alloc_index(1)?,
            led: BTreeMap::new(),
            lagged: Vec::new(),
            started: None,
            fused: None,
            due_now: Vec::new(),
            fused_sel: b.alloc_index(1)?,
            fused_values: b.alloc(1)?,
            max_selected: 0,
            units_per_token: 0,
            bytes_per_token: 0,
            store_bytes: stored,
            graph_id: 0,
        };
        placed.set_budgets(b, plan, k)?;
        Ok(placed)
    }

    /// Changes the lead/lag `shift` (half blocks per set) and the budgets `k`: the lagged
    /// deltas follow the shift, the selections and staging the budgets.
    pub(super) fn set_schedule(
        &mut self,
        b: &B,
        plan: &RefinementPlan,
        k: [usize; 4],
        shift: [usize; 4],
    ) -> Result<()> {
        if shift != self.shift {
            self.lag_deltas = lag_deltas_for(b, plan, shift)?;
            self.shift = shift;
        }
        self.set_budgets(b, plan, k)
    }

    /// Sizes the selection (and fetch lead's staging) for budgets `k` and takes a new
    /// step-graph id.
    pub(super) fn set_budgets(
        &mut self,
        b: &B,
        plan: &RefinementPlan,
        k: [usize; 4],
    ) -> Result<()> {
        let (mut units, mut bytes, mut max_selected, mut scratch) = (0u64, 0u64, 0usize, 0);
        let mut lead_stages = Vec::with_capacity(plan.layers.len());
        let mut lag_selections = Vec::with_capacity(plan.layers.len());
        for (li, l) in plan.layers.iter().enumerate() {
            let mut stages: [Option<LeadStage<B>>; 2] = [None, None];
            let mut lag_sel: [Option<Selection<B>>; 2] = [None, None];
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
                if let Some(ls) = lag_index(set) {
                    if self.lag_deltas.get(li).is_some_and(|d| d[ls].is_some()) {
                        let scr = b.selected_columns_scratch_len(1, selected, &outs);
                        lag_sel[ls] = Some(Selection::new(b, 1, selected, scr)?);
                    }
                }
                let Some(slot) = lead_index(set) else {
                    continue;
                };
                if self.shift[set.index()] == 0 || k[set.index()] == 0 {
                    continue;
                }
                stages[slot] = Some(LeadStage {
                    sel: b.alloc_index(selected.max(1))?,
                    staged: sources
                        .iter()
                        .map(|s| b.alloc_byte_store((selected * s.unit_bytes).max(1)))
                        .collect::<Result<_>>()?,
                });
            }
            lead_stages.push(stages);
            lag_selections.push(lag_sel);
        }
        self.step = Selection::new(b, 1, max_selected, scratch)?;
        self.lag_selections = lag_selections;
        self.chunk = None;
        self.lead_stages = lead_stages;
        self.fused_sel = b.alloc_index(max_selected.max(1))?;
        self.fused_values = b.alloc(max_selected.max(1))?;
        let identity: Vec<u32> = (0..max_selected.max(1) as u32).collect();
        self.identity = b.alloc_index(identity.len())?;
        b.write_index(&mut self.identity, &identity)?;
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

    /// Fetch lead (q/k/v, gate/up) or lag (o, down) of `set`, in half blocks.
    pub(super) fn shift(&self, set: ProjectionSet) -> usize {
        self.shift[set.index()]
    }

    /// A new forward chunk: no branch is running, nothing is selected ahead or lagged.
    pub(super) fn begin_chunk(&mut self) {
        self.started = None;
        self.fused = None;
        self.due_now.clear();
        self.led.clear();
        self.lagged.clear();
        self.stream_reads.clear();
    }

    /// The main stream is about to add into the residual stream: lead selections still
    /// reading it are joined first (they forked onto an idle lane, so by now they are done).
    pub(super) fn settle_stream_reads(&mut self, b: &B) -> Result<()> {
        for m in self.stream_reads.drain(..) {
            b.join_branch(m)?;
        }
        Ok(())
    }

    /// The residual stream `h` (`rows` rows) is complete at position `pos`: lagged
    /// contributions due here are joined and added, branches whose selection read an input
    /// the main stream may overwrite next are waited for, and every q/k/v and gate/up set
    /// whose fetch lead points here selects its channels (decode: and stages their columns)
    /// with `k` the budgets per set.
    pub(super) fn at_stream(
        &mut self,
        b: &B,
        pos: usize,
        rows: usize,
        k: [usize; 4],
        h: &mut B::Buffer,
    ) -> Result<()> {
        // The projection that landed here added these itself.
        self.due_now.clear();
        let mut i = 0;
        while i < self.lagged.len() {
            if self.lagged[i].due > pos {
                i += 1;
                continue;
            }
            let done = self.lagged.swap_remove(i);
            self.add_lagged(b, done, h)?;
        }
        // A branch's selection read its set's input; the main stream overwrites that input one
        // layer later, so it waits from the second position after (by then the selection
        // has long run).
        for l in &mut self.lagged {
            if l.own + 1 < pos {
                if let Some(m) = l.consumed.take() {
                    b.join_branch(m)?;
                }
            }
        }
        for set in [ProjectionSet::Qkv, ProjectionSet::GateUp] {
            let lead = self.shift[set.index()];
            let budget = k[set.index()];
            if lead == 0 || budget == 0 {
                continue;
            }
            for layer in 0..self.layers.len() {
                let own = stream_position(layer, set);
                let sources = &self.layers[layer][set.index()];
                if own.saturating_sub(lead) != pos || own <= pos || sources.is_empty() {
                    continue;
                }
                self.select_ahead(b, layer, set, budget, rows, h)?;
            }
        }
        Ok(())
    }

    /// Fetch lead of (layer, set) from the stream `h`: the selection (normalised by the set's
    /// own RMSNorm), and for a decode row the columns staged, on a branch.
    fn select_ahead(
        &mut self,
        b: &B,
        layer: usize,
        set: ProjectionSet,
        k: usize,
        rows: usize,
        h: &B::Buffer,
    ) -> Result<()> {
        let slot = lead_index(set).ok_or(RuntimeError::EmptyInput)?;
        let norm = Some((&self.norms[layer][slot], self.eps));
        let cols = &self.layers[layer][set.index()];
        let inp = self.hidden;
        let selected = selected_count(k, inp);
        if rows != 1 {
            let mut sel = b.alloc_index((rows * selected).max(1))?;
            let mut values = b.alloc((rows * selected).max(1))?;
            b.select_channels(h, inp, norm, k, &mut sel, &mut values)?;
            self.led.insert((layer, set.index()), Led::Rows(sel));
            return Ok(());
        }
        let Some(stage) = self.lead_stages[layer][slot].as_mut() else {
            return Err(RuntimeError::Config(format!(
                "layer {layer} {}: fetch lead without its staging",
                set.name()
            )));
        };
        // The selection reads the stream: near lane. The transfer: far lane, after it.
        b.begin_branch(BranchLane::Near)?;
        let ran = b.select_channels(h, inp, norm, k, &mut stage.sel, &mut self.step.values);
        let selected_at = b.end_branch();
        ran?;
        let selected_at = selected_at?;
        self.stream_reads.push(selected_at);
        b.begin_branch(BranchLane::Far)?;
        let ran = (|| -> Result<()> {
            b.branch_wait(selected_at)?;
            // Every projection of the set in one launch: the lane runs one transfer at a time.
            let mut targets: Vec<StageTarget<'_, B>> = cols
                .iter()
                .zip(stage.staged.iter_mut())
                .map(|(c, dst)| StageTarget {
                    store: &c.store,
                    offset: 0,
                    unit_bytes: c.unit_bytes,
                    dst,
                })
                .collect();
            b.stage_selected_units(1, inp, &stage.sel, selected, &mut targets)
        })();
        let ended = b.end_branch();
        ran?;
        self.led.insert((layer, set.index()), Led::Staged(ended?));
        Ok(())
    }

    /// A decode row's lagged contributions due at stream position `pos` (at most two), taken
    /// for the projection whose residual add lands there to add them in its launch: their
    /// branches joined (the fetch waited for the selection, so its end covers both).
    /// [`Placed::at_stream`] adds any others as before.
    pub(super) fn take_due(&mut self, b: &B, pos: usize) -> Result<()> {
        self.due_now.clear();
        let mut i = 0;
        while i < self.lagged.len() && self.due_now.len() < 2 {
            let l = &self.lagged[i];
            let LagDelta::Layer(layer, slot) = l.delta else {
                i += 1;
                continue;
            };
            if l.due > pos {
                i += 1;
                continue;
            }
            let done = self.lagged.swap_remove(i);
            if let Some(m) = done.end {
                b.join_branch(m)?;
            }
            self.due_now.push((layer, slot));
        }
        Ok(())
    }

    /// The contributions [`Placed::take_due`] took.
    pub(super) fn due_buffers(&self) -> Vec<&B::Buffer> {
        self.due_now
            .iter()
            .filter_map(|&(layer, slot)| self.lag_deltas[layer][slot].as_ref())
            .collect()
    }

    /// Joins a lagged contribution's branch and adds it to the stream.
    fn add_lagged(&mut self, b: &B, done: Lagged<B>, h: &mut B::Buffer) -> Result<()> {
        if let Some(m) = done.end {
            b.join_branch(m)?;
        }
        match done.delta {
            LagDelta::Owned(d) => b.add_assign(h, &d),
            LagDelta::Layer(layer, slot) => match &self.lag_deltas[layer][slot] {
                Some(d) => b.add_assign(h, d),
                None => Err(RuntimeError::EmptyInput),
            },
        }
    }

    /// End of the forward chunk: lagged contributions due past the last block are added
    /// before the final norm.
    pub(super) fn finish_chunk(&mut self, b: &B, h: &mut B::Buffer) -> Result<()> {
        self.settle_stream_reads(b)?;
        for done in std::mem::take(&mut self.lagged) {
            self.add_lagged(b, done, h)?;
        }
        self.led.clear();
        Ok(())
    }

    /// Starts set `set` of layer `layer` (budget `k`, `inp` input channels) for a decode
    /// row as a branch into the set's deltas; under fetch lag, a near branch selecting and a
    /// far branch fetching into the layer's lag delta. Chunks of rows and a second start
    /// before the finish do nothing: the finish then refines in order.
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
        if let Some(slot) = self.lag_slot(layer, set) {
            return self.start_lagged(b, layer, set, slot, k, inp, input);
        }
        let mut deltas = std::mem::take(&mut self.deltas[set.index()]);
        // Under fetch lead the branch first waits for its staging (far lane).
        let staged = match self.led.get(&(layer, set.index())) {
            Some(Led::Staged(m)) => Some(*m),
            _ => None,
        };
        b.begin_branch(BranchLane::Near)?;
        let ran = (|| -> Result<()> {
            if let Some(m) = staged {
                b.branch_wait(m)?;
            }
            let mut outs: Vec<&mut B::Buffer> = deltas.iter_mut().collect();
            self.refine(b, layer, set, k, inp, rows, input, &mut outs, false)
        })();
        let ended = b.end_branch();
        self.deltas[set.index()] = deltas;
        ran?;
        self.started = Some((layer, set, ended?, None));
        Ok(())
    }

    /// [`Placed::start`] of a lagged set: the selection (which reads the set's input) on the
    /// near lane, the fetch into the layer's lag delta on the lag lane after it.
    #[allow(clippy::too_many_arguments)]
    fn start_lagged(
        &mut self,
        b: &B,
        layer: usize,
        set: ProjectionSet,
        slot: usize,
        k: usize,
        inp: usize,
        input: &SetInput<'_, B>,
    ) -> Result<()> {
        let (raw, norm) = input.raw_and_norm();
        let selected = selected_count(k, inp);
        let (Some(sel), Some(delta)) = (
            self.lag_selections[layer][slot].as_mut(),
            self.lag_deltas[layer][slot].as_mut(),
        ) else {
            return Err(RuntimeError::Config(format!(
                "layer {layer} {}: fetch lag without its buffers",
                set.name()
            )));
        };
        b.begin_branch(BranchLane::Near)?;
        let ran = b.select_channels(raw, inp, norm, k, &mut sel.sel, &mut sel.values);
        let consumed = b.end_branch();
        ran?;
        let consumed = consumed?;
        let cols = &self.layers[layer][set.index()];
        b.begin_branch(BranchLane::Lag)?;
        let ran = (|| -> Result<()> {
            b.branch_wait(consumed)?;
            let c = cols.first().ok_or(RuntimeError::EmptyInput)?;
            let mut targets = [column_target(c, &c.store, &mut *delta, false)];
            b.add_selected_columns(
                1,
                inp,
                &sel.sel,
                &sel.values,
                selected,
                &mut targets,
                &mut sel.scratch,
            )
        })();
        let ended = b.end_branch();
        ran?;
        self.started = Some((layer, set, ended?, Some(consumed)));
        Ok(())
    }

    /// The lag delta slot of a decode row's (layer, set) under fetch lag.
    fn lag_slot(&self, layer: usize, set: ProjectionSet) -> Option<usize> {
        let slot = lag_index(set)?;
        self.lag_deltas
            .get(layer)
            .and_then(|d| d[slot].as_ref())
            .map(|_| slot)
    }

    /// Readies (layer, set) of a decode row for launches that apply its refinement
    /// themselves: fetch lead's selection once its staging is done (the main stream waits for
    /// the far lane here), or the selection from the real input now, on the stream.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn prepare_fused(
        &mut self,
        b: &B,
        layer: usize,
        set: ProjectionSet,
        k: usize,
        inp: usize,
        input: &SetInput<'_, B>,
    ) -> Result<()> {
        let staged = match self.led.remove(&(layer, set.index())) {
            Some(Led::Staged(m)) => {
                b.join_branch(m)?;
                true
            }
            Some(Led::Rows(_)) => {
                return Err(RuntimeError::Config(format!(
                    "layer {layer} {}: a chunk's selection reached a decode row's fused launch",
                    set.name()
                )))
            }
            None => {
                let (raw, norm) = input.raw_and_norm();
                b.select_channels(
                    raw,
                    inp,
                    norm,
                    k,
                    &mut self.fused_sel,
                    &mut self.fused_values,
                )?;
                false
            }
        };
        self.fused = Some((layer, set, staged));
        Ok(())
    }

    /// The operands of the set [`Placed::prepare_fused`] readied, one per projection.
    pub(super) fn fused_columns(
        &self,
        layer: usize,
        set: ProjectionSet,
        k: usize,
        inp: usize,
    ) -> Result<Vec<FusedColumns<'_, B>>> {
        let Some((l, s, staged)) = self.fused.filter(|&(l, s, _)| (l, s) == (layer, set)) else {
            return Err(RuntimeError::Config(format!(
                "layer {layer} {}: fused refinement asked for before it was prepared",
                set.name()
            )));
        };
        let selected = selected_count(k, inp);
        let cols = &self.layers[l][s.index()];
        // On the stream: each projection's own columns at their channels; fetch lead's: the
        // copies staged in selection order.
        let (sel, stores): (&B::Index, Vec<&B::ByteStore>) = if staged {
            let stage = lead_index(s)
                .and_then(|slot| self.lead_stages[l][slot].as_ref())
                .ok_or(RuntimeError::EmptyInput)?;
            (&stage.sel, stage.staged.iter().collect())
        } else {
            (&self.fused_sel, cols.iter().map(|c| &c.store).collect())
        };
        Ok(cols
            .iter()
            .zip(stores)
            .map(|(c, store)| FusedColumns {
                sel,
                selected,
                store,
                staged,
                unit_bytes: c.unit_bytes,
                scales: &c.scales,
            })
            .collect())
    }

    /// Finishes set `set` of layer `layer`: joins its branch and adds the deltas to
    /// `outputs` (under fetch lag: queues them for their position), or, when no branch ran,
    /// refines `outputs` in order (under fetch lag: into a buffer queued likewise).
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
        if self.fused.is_some_and(|(l, s, _)| (l, s) == (layer, set)) {
            // The projections' launches applied it.
            self.fused = None;
            return Ok(());
        }
        let own = stream_position(layer, set);
        let lag = match set {
            ProjectionSet::O | ProjectionSet::Down => self.shift[set.index()],
            _ => 0,
        };
        if let Some((l, s, end, consumed)) = self.started {
            if (l, s) == (layer, set) {
                self.started = None;
                if lag > 0 {
                    let slot = self.lag_slot(layer, set).ok_or(RuntimeError::EmptyInput)?;
                    self.lagged.push(Lagged {
                        due: own + 1 + lag,
                        own,
                        end: Some(end),
                        consumed,
                        delta: LagDelta::Layer(layer, slot),
                    });
                    return Ok(());
                }
                b.join_branch(end)?;
                for (y, d) in outputs.iter_mut().zip(&self.deltas[set.index()]) {
                    b.add_assign(y, d)?;
                }
                return Ok(());
            }
        }
        if lag > 0 {
            let out_len = b.buffer_len(outputs.first().ok_or(RuntimeError::EmptyInput)?);
            let mut delta = b.alloc(out_len)?;
            self.refine(b, layer, set, k, inp, rows, input, &mut [&mut delta], false)?;
            self.lagged.push(Lagged {
                due: own + 1 + lag,
                own,
                end: None,
                consumed: None,
                delta: LagDelta::Owned(delta),
            });
            return Ok(());
        }
        if let Some(Led::Staged(m)) = self.led.get(&(layer, set.index())) {
            b.join_branch(*m)?;
        }
        self.refine(b, layer, set, k, inp, rows, input, outputs, true)
    }

    /// The selection (with the set's norm applied by the selection itself; under fetch lead
    /// the one made ahead, with the real input's values gathered at it), then the selected
    /// columns of every projection of the set in one launch, added to `outputs` or
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
        let (raw, norm) = input.raw_and_norm();
        let cols = &self.layers[layer][set.index()];
        match self.led.remove(&(layer, set.index())) {
            Some(Led::Staged(_)) => {
                let stage = lead_index(set)
                    .and_then(|slot| self.lead_stages[layer][slot].as_ref())
                    .ok_or(RuntimeError::EmptyInput)?;
                b.gather_selected_values(
                    raw,
                    inp,
                    norm,
                    &stage.sel,
                    selected,
                    &mut buffers.values,
                )?;
                let mut targets: Vec<ColumnTarget<'_, B>> = cols
                    .iter()
                    .zip(&stage.staged)
                    .zip(outputs.iter_mut())
                    .map(|((c, s), y)| column_target(c, s, &mut **y, accumulate))
                    .collect();
                b.add_selected_columns(
                    rows,
                    selected,
                    &self.identity,
                    &buffers.values,
                    selected,
                    &mut targets,
                    &mut buffers.scratch,
                )
            }
            led => {
                // A chunk's selection made ahead (the real input's values at it), or the
                // selection from the real input itself.
                let ahead = match led {
                    Some(Led::Rows(sel)) => Some(sel),
                    _ => None,
                };
                let sel = match ahead.as_ref() {
                    Some(sel) => {
                        b.gather_selected_values(
                            raw,
                            inp,
                            norm,
                            sel,
                            selected,
                            &mut buffers.values,
                        )?;
                        sel
                    }
                    None => {
                        b.select_channels(
                            raw,
                            inp,
                            norm,
                            k,
                            &mut buffers.sel,
                            &mut buffers.values,
                        )?;
                        &buffers.sel
                    }
                };
                let mut targets: Vec<ColumnTarget<'_, B>> = cols
                    .iter()
                    .zip(outputs.iter_mut())
                    .map(|(c, y)| column_target(c, &c.store, &mut **y, accumulate))
                    .collect();
                b.add_selected_columns(
                    rows,
                    inp,
                    sel,
                    &buffers.values,
                    selected,
                    &mut targets,
                    &mut buffers.scratch,
                )
            }
        }
    }
}

//! The refinement engine: per token, select the channels (or MLP neurons) whose extra
//! precision matters, fetch their 4-bit refinement units from the store and add them to the
//! resident projections' outputs (docs/method.md §2, eq. 2 and eq. 5–6), optionally selecting
//! from an earlier point of the residual stream (fetch lead) or adding the result later
//! (fetch lag, §3).
//!
//! Positions in the residual stream are counted in half blocks: stream `2l` is the input of
//! layer l's attention half, `2l + 1` the input of its MLP half, `2L` the input of the final
//! norm. qkv reads `2l`, gate/up read `2l + 1`; o writes `2l + 1`, down writes `2l + 2`.
//! A lead of s blocks selects qkv's channels from stream `2l − 2s` (normalised by layer l's
//! own RMSNorm, the channels' values still taken from the real input); a lag of s blocks adds
//! o's refinement at stream `2l + 1 + 2s` instead of `2l + 1`.
//!
//! The engine runs in one of two places:
//! - **host-driven** (every tier, lead/lag, bundles): the selection and the fetch on the
//!   host, through three backend ops (`read_rows`, `add_nibble_units`, `add_assign`);
//! - **in the backend** ([`Refiner::place_in_backend`]; ram tier, channels, lead/lag too):
//!   see [`super::placed`].

use super::placed::Placed;
use super::plan::nibble_level;
use super::select::select_top_k;
use super::store::{Fetched, RefinementStore, StoreStats, UnitKey, UnitRef};
// Fetch lead's host-side selection normalises with the CPU backend's arithmetic, so the engine
// in the backend selects the same channels from the same stream.
use crate::backend::cpu::rms_norm_row;
use crate::backend::refine::FusedColumns;
use crate::backend::Backend;
use crate::error::{Result, RuntimeError};
use crate::observe::ProjectionSet;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

/// One projection's channel-wise refinement: `inp` units (columns) of `unit_bytes` bytes at
/// `offset + i · unit_bytes` in the backing file.
#[derive(Debug, Clone)]
pub struct ColumnSource {
    pub key_base: u64,
    pub offset: u64,
    pub unit_bytes: usize,
    pub out: usize,
    pub inp: usize,
    /// Per-output-row scales.
    pub scales: Vec<f32>,
}

/// One layer's neuron bundles (docs/format.md, `neuron_bundles`).
#[derive(Debug, Clone)]
pub struct BundleSource {
    pub key_base: u64,
    pub offset: u64,
    pub hidden: usize,
    pub neurons: usize,
    /// Per neuron: scale of the gate / up refinement row.
    pub gate_scales: Vec<f32>,
    pub up_scales: Vec<f32>,
    /// Per hidden row: scales of the down refinement column and of the down copy.
    pub down_refine_scales: Vec<f32>,
    pub down_copy_scales: Vec<f32>,
}

impl BundleSource {
    fn part_bytes(&self) -> usize {
        self.hidden.div_ceil(2)
    }
    pub(crate) fn unit_bytes(&self) -> usize {
        4 * self.part_bytes()
    }
}

/// What one decoder layer can refine. `sets` follows [`ProjectionSet::ALL`]; projections in
/// graph order (q, k, v | o | gate, up | down); an empty set has no refinement stored.
#[derive(Debug, Clone, Default)]
pub struct LayerSources {
    pub sets: [Vec<ColumnSource>; 4],
    pub bundles: Option<BundleSource>,
    /// Host copies of the layer's RMSNorm weights (input, post-attention), for fetch lead.
    pub attn_norm: Vec<f32>,
    pub mlp_norm: Vec<f32>,
}

/// Everything stored for refinement in a model file.
#[derive(Debug, Clone, Default)]
pub struct RefinementPlan {
    pub layers: Vec<LayerSources>,
    pub hidden: usize,
    pub eps: f32,
    /// Per set, the ladder rung its columns were fitted at (`None`: a file fitted at one k).
    pub fitted_k: [Option<usize>; 4],
}

/// MLP refinement scheme used at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum MlpMode {
    /// Channel-wise columns for gate/up and down.
    Channels,
    /// Neuron bundles (eq. 5–6) instead of the gate/up and down columns.
    Bundles,
}

/// The largest k per 1024 at which a staged set is refined inside its projections' launches
/// ([`Refiner::fuses_set`]). Above it each block's share of the columns outweighs the launch
/// it saves: on an H100 (8B shape, s = 1,0.5,1,0.5, rtn2 and qtip2) the fused launches ran
/// 1.12–1.13× the branch path's speed at k = 4, 1.04–1.13× at 8, 0.99–1.05× at 16 and
/// 0.89–0.98× at 24 and 32.
pub const FUSED_MAX_K: usize = 16;

/// Neurons per 1024 selected by neuron bundles at down-projection budget `k_down`:
/// k_n = round(3k/4), the method's pairing of bundle and channel budgets (docs/method.md §2),
/// under which bundles fetch as many bytes as the gate/up and down channels they replace.
pub fn bundle_budget(k_down: usize) -> usize {
    (3 * k_down + 2) / 4
}

/// Run-time refinement settings.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RefineSettings {
    /// Budgets k per 1024 channels per projection set ([`ProjectionSet::index`] order).
    pub k: [usize; 4],
    /// Lead (qkv, gu) or lag (o, d) in blocks, multiples of 0.5.
    pub s: [f32; 4],
    pub mlp: MlpMode,
    /// Neurons per 1024 for bundles.
    pub bundle_k: usize,
}

impl RefineSettings {
    /// Every set's budget 0 and no neuron bundles: nothing is ever selected.
    pub fn selects_nothing(&self) -> bool {
        self.k.iter().all(|&k| k == 0) && !(self.mlp == MlpMode::Bundles && self.bundle_k > 0)
    }
}

/// Work done by the engine since the last reset.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct RefineCounters {
    /// Token rows refined.
    pub tokens: u64,
    /// Units (columns or bundles) selected.
    pub units_selected: u64,
    /// Units applied (available in time).
    pub units_applied: u64,
    /// Units not applied this step (miss under `skip`, or a failed tier).
    pub units_skipped: u64,
    pub units_failed: u64,
    /// Bytes of the applied units.
    pub bytes_applied: u64,
}

/// A projection set's input as the layer has it.
pub enum SetInput<'a, B: Backend> {
    /// The input itself (o: the attention output; down: the activation).
    Plain(&'a B::Buffer),
    /// The RMSNorm of the residual stream `raw` by `norm` (qkv, gate/up). `normed` holds it
    /// for the host-driven engine; the engine in the backend selects from `raw` itself, so
    /// the projection may fuse the norm and leave `normed` unwritten.
    Normed {
        raw: &'a B::Buffer,
        norm: &'a B::Buffer,
        eps: f32,
        normed: &'a B::Buffer,
    },
}

impl<'a, B: Backend> SetInput<'a, B> {
    /// What the backend's selection and gathers read: the raw input and, for a normed set,
    /// the norm they apply themselves.
    pub(super) fn raw_and_norm(&self) -> (&'a B::Buffer, Option<(&'a B::Buffer, f32)>) {
        match *self {
            SetInput::Plain(x) => (x, None),
            SetInput::Normed { raw, norm, eps, .. } => (raw, Some((norm, eps))),
        }
    }

    /// [`SetInput::Normed`].
    pub fn normed(
        raw: &'a B::Buffer,
        norm: &'a B::Buffer,
        eps: f32,
        normed: &'a B::Buffer,
    ) -> Self {
        SetInput::Normed {
            raw,
            norm,
            eps,
            normed,
        }
    }

    /// The set's input values (the normalised rows for a normed input).
    fn values(&self) -> &'a B::Buffer {
        match *self {
            SetInput::Plain(x) => x,
            SetInput::Normed { normed, .. } => normed,
        }
    }
}

/// Where [`Refiner::fetch`] puts a unit.
#[derive(Clone, Copy)]
enum FetchInto {
    /// `unit`, replacing what it held (bundles read a unit's parts from it).
    Unit,
    /// The end of `staged` (channels gather a projection's units there).
    Staged,
}

/// The engine: a plan, a store and settings, plus per-forward scratch state.
pub struct Refiner<B: Backend> {
    /// Shared so a call can hold its layer's sources while mutating the engine's counters and
    /// scratch (a refcount bump per call instead of copying every scale vector).
    plan: Arc<RefinementPlan>,
    /// The host-driven engine's store (`None` for an engine built in the backend).
    store: Option<Arc<dyn RefinementStore>>,
    /// The engine in the backend, once placed there.
    placed: Option<Placed<B>>,
    settings: RefineSettings,
    counters: RefineCounters,
    /// Fetch lead: per (layer, set index), the channels selected for each row of the current
    /// chunk from the earlier stream, whose units were prefetched at selection time.
    pending: BTreeMap<(usize, usize), Vec<Vec<usize>>>,
    /// Lagged contributions `(due position, [rows, hidden] buffer)`.
    lagged: Vec<(usize, B::Buffer)>,
    rows: usize,
    /// Host copies of the MLP input and pre-activation gate/up rows for bundles.
    bundle_inputs: Option<(Vec<f32>, Vec<f32>, Vec<f32>)>,
    unit: Vec<u8>,
    staged: Vec<u8>,
    staged2: Vec<u8>,
    weights: Vec<f32>,
    weights2: Vec<f32>,
    sel: Vec<usize>,
}

/// The stream position of set `set`'s input in layer `layer` (module docs): q/k/v and o read
/// `2l`, gate/up and down `2l + 1`, so o's contribution lands at `2l + 1` and down's at
/// `2l + 2`.
pub(super) fn stream_position(layer: usize, set: ProjectionSet) -> usize {
    2 * layer + usize::from(matches!(set, ProjectionSet::GateUp | ProjectionSet::Down))
}

fn half_blocks(s: f32) -> Result<usize> {
    let h = s * 2.0;
    if !(0.0..=64.0).contains(&h) || h.fract() != 0.0 {
        return Err(RuntimeError::Config(format!(
            "lead/lag s = {s}: must be a multiple of 0.5 between 0 and 32 blocks"
        )));
    }
    Ok(h as usize)
}

/// Lead/lag per set: multiples of half a block (see [`half_blocks`]).
fn check_shifts(s: [f32; 4]) -> Result<()> {
    for v in s {
        half_blocks(v)?;
    }
    Ok(())
}

/// Budgets k per set and neurons per 1024 for bundles: at most every channel.
fn check_budgets(k: [usize; 4], bundle_k: usize) -> Result<()> {
    if k.iter().chain([&bundle_k]).any(|&k| k > 1024) {
        return Err(RuntimeError::Config(format!(
            "refinement budgets {k:?} / bundles {bundle_k}: at most 1024 per 1024 channels"
        )));
    }
    Ok(())
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

impl<B: Backend> Refiner<B> {
    pub fn new(
        plan: RefinementPlan,
        store: Arc<dyn RefinementStore>,
        settings: RefineSettings,
    ) -> Result<Self> {
        Self::with_store(plan, Some(store), settings)
    }

    fn with_store(
        plan: RefinementPlan,
        store: Option<Arc<dyn RefinementStore>>,
        settings: RefineSettings,
    ) -> Result<Self> {
        check_shifts(settings.s)?;
        check_budgets(settings.k, settings.bundle_k)?;
        if settings.mlp == MlpMode::Bundles && plan.layers.iter().any(|l| l.bundles.is_none()) {
            return Err(RuntimeError::Config(
                "--mlp bundles: the model file has no neuron bundles (convert with --mlp bundles or both)"
                    .into(),
            ));
        }
        Ok(Self {
            plan: Arc::new(plan),
            store,
            placed: None,
            settings,
            counters: RefineCounters::default(),
            pending: BTreeMap::new(),
            lagged: Vec::new(),
            rows: 0,
            bundle_inputs: None,
            unit: Vec::new(),
            staged: Vec::new(),
            staged2: Vec::new(),
            weights: Vec::new(),
            weights2: Vec::new(),
            sel: Vec::new(),
        })
    }

    pub fn settings(&self) -> &RefineSettings {
        &self.settings
    }

    /// Whether the settings select nothing anywhere: every set's budget 0 and no neuron
    /// bundles. A step with such an engine is the resident base's, so the model runs it without
    /// the engine: attached, it still cost a decode step on CUDA 6.8 % (SmolLM2, H100), which
    /// made `sfx tune` report that even no refinement missed every budget.
    pub fn selects_nothing(&self) -> bool {
        self.settings.selects_nothing()
    }

    /// Work done since the last reset. In the backend every selected unit is applied (the
    /// ram tier has them all) and a token reads a fixed number of units, so the counts follow
    /// from the tokens.
    pub fn counters(&self) -> RefineCounters {
        match &self.placed {
            None => self.counters.clone(),
            Some(p) => p.counters(self.counters.tokens),
        }
    }

    pub fn store_stats(&self) -> StoreStats {
        self.store.as_ref().map(|s| s.stats()).unwrap_or_default()
    }

    /// The RAM cache budget of the store the refinement reads through (the ssd tier's), if
    /// there is one.
    pub fn store_cache_budget(&self) -> Option<u64> {
        self.store.as_ref().and_then(|s| s.ram_cache_budget())
    }

    pub fn reset_counters(&mut self) {
        self.counters = RefineCounters::default();
        if let Some(s) = &self.store {
            s.reset_stats();
        }
    }

    /// Whether the engine runs in the backend ([`Refiner::place_in_backend`]).
    pub fn in_backend(&self) -> bool {
        self.placed.is_some()
    }

    /// Bytes of the columns copied into backend byte stores (0 for the host-driven engine).
    pub fn backend_bytes(&self) -> u64 {
        self.placed.as_ref().map_or(0, |p| p.store_bytes)
    }

    /// A key of this engine's step graphs: `Some` when a decode step with it can be captured
    /// (it runs in the backend), unique per engine.
    pub fn graph_id(&self) -> Option<u64> {
        self.placed.as_ref().map(|p| p.graph_id)
    }

    /// Why the engine cannot run in the backend with these settings, if it cannot.
    pub fn backend_blocker(&self) -> Option<String> {
        if self.settings.mlp == MlpMode::Bundles {
            return Some("neuron bundles run host-driven".into());
        }
        None
    }

    /// Moves the engine into the backend: every projection's columns copied once into a byte
    /// store the backend's kernels read ([`Backend::alloc_host_byte_store`]: page-locked host
    /// memory mapped into the device on CUDA), `column_bytes` giving a source's
    /// `inp · unit_bytes` bytes. From then on each set is refined by
    /// [`Backend::select_channels`] and [`Backend::add_selected_columns`].
    pub fn place_in_backend<'s>(
        &mut self,
        b: &B,
        column_bytes: impl FnMut(&ColumnSource) -> Result<Cow<'s, [u8]>>,
    ) -> Result<()> {
        if let Some(why) = self.backend_blocker() {
            return Err(RuntimeError::Config(format!(
                "refinement cannot run in the backend: {why}"
            )));
        }
        let shift = self.shifts();
        self.placed = Some(Placed::new(
            b,
            &self.plan,
            self.settings.k,
            shift,
            column_bytes,
        )?);
        Ok(())
    }

    /// Changes the budgets k per set (a benchmark's k ladder over one placed copy of the
    /// columns). An engine in the backend gets a new step-graph id: captured steps hold the
    /// old selection sizes.
    pub fn set_budgets(&mut self, b: &B, k: [usize; 4]) -> Result<()> {
        check_budgets(k, self.settings.bundle_k)?;
        self.settings.k = k;
        if let Some(p) = self.placed.as_mut() {
            p.set_budgets(b, &self.plan, k)?;
        }
        Ok(())
    }

    /// Changes the budgets k and the lead/lag s per set (a tuner's candidates over one copy
    /// of the columns: placing an 8B model's columns again per candidate costs seconds). Like
    /// [`Refiner::set_budgets`], an engine in the backend gets a new step-graph id.
    pub fn set_schedule(&mut self, b: &B, k: [usize; 4], s: [f32; 4]) -> Result<()> {
        check_shifts(s)?;
        check_budgets(k, self.settings.bundle_k)?;
        self.settings.k = k;
        self.settings.s = s;
        let shift = self.shifts();
        if let Some(p) = self.placed.as_mut() {
            p.set_schedule(b, &self.plan, k, shift)?;
        }
        Ok(())
    }

    /// An engine built in the backend from the start (no host store): synthetic refinement
    /// of a benchmark's random model, `column_bytes` making each source's columns.
    pub fn new_in_backend<'s>(
        plan: RefinementPlan,
        settings: RefineSettings,
        b: &B,
        column_bytes: impl FnMut(&ColumnSource) -> Result<Cow<'s, [u8]>>,
    ) -> Result<Self> {
        let mut r = Self::with_store(plan, None, settings)?;
        r.place_in_backend(b, column_bytes)?;
        Ok(r)
    }

    fn lead(&self, set: ProjectionSet) -> usize {
        // Validated in `new` and `set_schedule`.
        half_blocks(self.settings.s[set.index()]).unwrap_or(0)
    }

    /// Lead/lag of every set, in half blocks.
    fn shifts(&self) -> [usize; 4] {
        ProjectionSet::ALL.map(|set| self.lead(set))
    }

    /// Starts a forward chunk of `rows` token rows.
    pub fn begin_chunk(&mut self, rows: usize) {
        if let Some(p) = self.placed.as_mut() {
            p.begin_chunk();
        }
        self.pending.clear();
        self.lagged.clear();
        self.rows = rows;
        self.counters.tokens += rows as u64;
    }

    /// The residual stream at position `pos` is complete: add the lagged contributions due
    /// here, then, for every qkv / gate-up set whose fetch lead points at this position,
    /// select its channels from this stream (normalised by that layer's own RMSNorm) and start
    /// fetching them.
    pub fn at_stream(&mut self, b: &B, pos: usize, h: &mut B::Buffer) -> Result<()> {
        if let Some(p) = self.placed.as_mut() {
            return p.at_stream(b, pos, self.rows, self.settings.k, h);
        }
        let mut i = 0;
        while i < self.lagged.len() {
            if self.lagged[i].0 <= pos {
                let (_, delta) = self.lagged.swap_remove(i);
                b.add_assign(h, &delta)?;
            } else {
                i += 1;
            }
        }
        let mut raw: Option<Vec<f32>> = None;
        for set in [ProjectionSet::Qkv, ProjectionSet::GateUp] {
            let lead = self.lead(set);
            let k = self.settings.k[set.index()];
            if lead == 0 || k == 0 {
                continue;
            }
            for layer in 0..self.plan.layers.len() {
                let own = stream_position(layer, set);
                if own.saturating_sub(lead) != pos || own <= pos {
                    continue;
                }
                let plan = Arc::clone(&self.plan);
                let sources = &plan.layers[layer].sets[set.index()];
                if sources.is_empty() {
                    continue;
                }
                let hidden = self.plan.hidden;
                let rows = self.rows;
                if raw.is_none() {
                    let mut v = vec![0.0f32; rows * hidden];
                    b.read_rows(h, hidden, 0, &mut v)?;
                    raw = Some(v);
                }
                let raw = raw.as_deref().unwrap_or(&[]);
                let l = &self.plan.layers[layer];
                let w = if set == ProjectionSet::Qkv {
                    &l.attn_norm
                } else {
                    &l.mlp_norm
                };
                let mut normed = Vec::with_capacity(hidden);
                let mut per_row = Vec::with_capacity(rows);
                for r in raw.chunks_exact(hidden) {
                    rms_norm_row(r, w, self.plan.eps, &mut normed);
                    let mut sel = Vec::new();
                    select_top_k(&normed, k, &mut sel);
                    for src in sources {
                        for &i in &sel {
                            let at = UnitRef {
                                offset: src.offset + (i * src.unit_bytes) as u64,
                                len: src.unit_bytes as u32,
                            };
                            if let Some(store) = &self.store {
                                store.prefetch(UnitKey(src.key_base | i as u64), at);
                            }
                        }
                    }
                    per_row.push(sel);
                }
                self.pending.insert((layer, set.index()), per_row);
            }
        }
        Ok(())
    }

    /// End of the forward chunk: lagged contributions due past the last block are added
    /// before the final norm.
    pub fn finish_chunk(&mut self, b: &B, h: &mut B::Buffer) -> Result<()> {
        if let Some(p) = self.placed.as_mut() {
            return p.finish_chunk(b, h);
        }
        for (_, delta) in self.lagged.drain(..) {
            b.add_assign(h, &delta)?;
        }
        self.pending.clear();
        Ok(())
    }

    /// Whether layer `layer`'s MLP runs with neuron bundles.
    pub fn uses_bundles(&self, layer: usize) -> bool {
        self.settings.mlp == MlpMode::Bundles
            && self.settings.bundle_k > 0
            && self
                .plan
                .layers
                .get(layer)
                .is_some_and(|l| l.bundles.is_some())
    }

    /// Fetches unit `index` of a source into `self.unit` (replacing it) or onto the end of
    /// `self.staged` (the channel path gathers its units there with no second copy); counts
    /// the outcome. On failure the target is as it was.
    fn fetch(
        &mut self,
        key_base: u64,
        offset: u64,
        unit_bytes: usize,
        index: usize,
        into: FetchInto,
    ) -> bool {
        self.counters.units_selected += 1;
        let at = UnitRef {
            offset: offset + (index * unit_bytes) as u64,
            len: unit_bytes as u32,
        };
        let Some(store) = self.store.as_ref() else {
            self.counters.units_failed += 1;
            return false;
        };
        let out = match into {
            FetchInto::Unit => {
                self.unit.clear();
                &mut self.unit
            }
            FetchInto::Staged => &mut self.staged,
        };
        let before = out.len();
        let fetched = store.fetch(UnitKey(key_base | index as u64), at, out);
        let applied =
            matches!(fetched, Fetched::Hit | Fetched::Loaded) && out.len() == before + unit_bytes;
        if applied {
            self.counters.units_applied += 1;
            self.counters.bytes_applied += unit_bytes as u64;
            return true;
        }
        out.truncate(before);
        if fetched == Fetched::Failed {
            self.counters.units_failed += 1;
        } else {
            self.counters.units_skipped += 1;
        }
        false
    }

    /// Starts the refinement of set `set` of layer `layer` beside its projection: in the
    /// backend and for a decode row, the selection and the gather run as a branch
    /// ([`Backend::begin_branch`]) into the set's deltas while the resident projection runs,
    /// and [`Refiner::refine_set`] joins it and adds them. Otherwise it does nothing and
    /// `refine_set` does the work. Call it once the set's input exists.
    pub fn start_set(
        &mut self,
        b: &B,
        layer: usize,
        set: ProjectionSet,
        input: SetInput<'_, B>,
    ) -> Result<()> {
        let k = self.settings.k[set.index()];
        let Some(p) = self.placed.as_mut() else {
            return Ok(());
        };
        // o and down add into the residual stream next: fetch lead's selections from it must
        // have read it by then.
        if matches!(set, ProjectionSet::O | ProjectionSet::Down) {
            p.settle_stream_reads(b)?;
        }
        match self.plan.layers.get(layer).map(|l| &l.sets[set.index()]) {
            Some(sources) if k > 0 && !sources.is_empty() => {
                p.start(b, layer, set, k, sources[0].inp, self.rows, &input)
            }
            _ => Ok(()),
        }
    }

    /// Whether a decode row's set `set` of layer `layer` is refined by its projections'
    /// own launches ([`FusedColumns`]): the engine runs in the backend, the set has a budget,
    /// fetch lead staged its columns (q/k/v and gate/up with s > 0; o and down never: without
    /// lag they would read host memory in the launch, with lag they land later), and the
    /// backend fuses refinement into every one of `weights` (the set's matrices, graph order).
    pub fn fuses_set(
        &self,
        b: &B,
        layer: usize,
        set: ProjectionSet,
        rows: usize,
        weights: &[&B::Matrix],
    ) -> bool {
        let Some(p) = &self.placed else {
            return false;
        };
        let k = self.settings.k[set.index()];
        // Only sets whose columns fetch lead staged ahead: a launch that reads its columns
        // from host memory itself waits on the bus inside the projection (H100, 8B shape:
        // rtn2 at k = 4 went from 0.56 to 0.29 × base), while the branch path overlaps it.
        let staged = matches!(set, ProjectionSet::Qkv | ProjectionSet::GateUp) && p.shift(set) > 0;
        let sources = self.plan.layers.get(layer).map(|l| &l.sets[set.index()]);
        rows == 1
            && (1..=FUSED_MAX_K).contains(&k)
            && staged
            && sources.is_some_and(|s| !s.is_empty() && s.len() == weights.len())
            && weights.iter().all(|w| b.fuses_refinement(w))
    }

    /// Readies a set that [`Refiner::fuses_set`] for its fused launches: the selection from
    /// its input now (on the stream), or fetch lead's, made ahead, once its staging is done.
    /// [`Refiner::fused_columns`] then gives the launches' operands, and
    /// [`Refiner::refine_set`] has nothing left to do for it.
    pub fn prepare_fused(
        &mut self,
        b: &B,
        layer: usize,
        set: ProjectionSet,
        input: SetInput<'_, B>,
    ) -> Result<()> {
        let k = self.settings.k[set.index()];
        let inp = self.set_input_len(layer, set)?;
        let p = self.placed.as_mut().ok_or(RuntimeError::EmptyInput)?;
        if matches!(set, ProjectionSet::O | ProjectionSet::Down) {
            p.settle_stream_reads(b)?;
        }
        p.prepare_fused(b, layer, set, k, inp, &input)
    }

    /// The fused launches' operands of the set [`Refiner::prepare_fused`] readied, one per
    /// projection in graph order.
    pub fn fused_columns(
        &self,
        layer: usize,
        set: ProjectionSet,
    ) -> Result<Vec<FusedColumns<'_, B>>> {
        let k = self.settings.k[set.index()];
        let inp = self.set_input_len(layer, set)?;
        let p = self.placed.as_ref().ok_or(RuntimeError::EmptyInput)?;
        p.fused_columns(layer, set, k, inp)
    }

    /// Whether the projection `w` whose residual add lands at a stream position takes fetch
    /// lag's contributions due there into its own launch (decode rows, in the backend, where
    /// the backend fuses refinement into `w`).
    pub fn takes_lagged(&self, b: &B, rows: usize, w: &B::Matrix) -> bool {
        self.placed.is_some() && rows == 1 && b.fuses_refinement(w)
    }

    /// Readies the lagged contributions due at stream position `pos` for the projection
    /// that lands there ([`Refiner::takes_lagged`]); [`Refiner::lagged_due`] lists them.
    pub fn take_lagged_due(&mut self, b: &B, pos: usize) -> Result<()> {
        match self.placed.as_mut() {
            Some(p) => p.take_due(b, pos),
            None => Ok(()),
        }
    }

    /// The contributions [`Refiner::take_lagged_due`] readied.
    pub fn lagged_due(&self) -> Vec<&B::Buffer> {
        self.placed
            .as_ref()
            .map_or_else(Vec::new, |p| p.due_buffers())
    }

    /// Input channels of `set` in layer `layer`.
    fn set_input_len(&self, layer: usize, set: ProjectionSet) -> Result<usize> {
        self.plan
            .layers
            .get(layer)
            .and_then(|l| l.sets[set.index()].first())
            .map(|s| s.inp)
            .ok_or_else(|| {
                RuntimeError::Config(format!("layer {layer} {}: no refinement", set.name()))
            })
    }

    /// Channel-wise refinement of projection set `set` of layer `layer` (eq. 2): for every
    /// row of `x` (the set's real input), select S(x) — from an earlier stream position under
    /// fetch lead — and add `Σ_{i∈S} x_i C[:, i]` to each projection's output in `outputs`
    /// (graph order), or queue it under fetch lag.
    pub fn refine_set(
        &mut self,
        b: &B,
        layer: usize,
        set: ProjectionSet,
        input: SetInput<'_, B>,
        outputs: &mut [&mut B::Buffer],
    ) -> Result<()> {
        let k = self.settings.k[set.index()];
        let plan = Arc::clone(&self.plan);
        let Some(sources) = plan.layers.get(layer).map(|l| &l.sets[set.index()]) else {
            return Ok(());
        };
        if k == 0 || sources.is_empty() {
            return Ok(());
        }
        if sources.len() != outputs.len() {
            return Err(RuntimeError::Config(format!(
                "layer {layer} {}: {} refinement sources for {} outputs",
                set.name(),
                sources.len(),
                outputs.len()
            )));
        }
        let inp = sources[0].inp;
        let rows = self.rows;
        if let Some(p) = self.placed.as_mut() {
            return p.finish(b, layer, set, k, inp, rows, &input, outputs);
        }
        let x = input.values();
        let mut xrows = vec![0.0f32; rows * inp];
        b.read_rows(x, inp, 0, &mut xrows)?;
        // Under fetch lead the selection was made (and prefetched) earlier, from the stream.
        let own_pos = stream_position(layer, set);
        let led = match set {
            ProjectionSet::Qkv | ProjectionSet::GateUp => {
                self.pending.remove(&(layer, set.index()))
            }
            _ => None,
        };
        let lag = match set {
            ProjectionSet::O | ProjectionSet::Down => self.lead(set),
            _ => 0,
        };
        let mut lag_buf = if lag > 0 {
            Some(b.alloc(rows * sources[0].out)?)
        } else {
            None
        };
        for r in 0..rows {
            let xr = &xrows[r * inp..(r + 1) * inp];
            let mut sel = std::mem::take(&mut self.sel);
            match led.as_ref().and_then(|rows| rows.get(r)) {
                Some(s) => {
                    sel.clear();
                    sel.extend_from_slice(s);
                }
                None => select_top_k(xr, k, &mut sel),
            }
            for (src, y) in sources.iter().zip(outputs.iter_mut()) {
                self.staged.clear();
                self.weights.clear();
                for &i in &sel {
                    if self.fetch(
                        src.key_base,
                        src.offset,
                        src.unit_bytes,
                        i,
                        FetchInto::Staged,
                    ) {
                        self.weights.push(xr[i]);
                    }
                }
                if self.weights.is_empty() {
                    continue;
                }
                let target: &mut B::Buffer = match lag_buf.as_mut() {
                    Some(buf) => buf,
                    None => y,
                };
                b.add_nibble_units(
                    target,
                    src.out,
                    r,
                    &self.staged,
                    src.unit_bytes,
                    &self.weights,
                    &src.scales,
                )?;
            }
            self.sel = sel;
        }
        if let Some(buf) = lag_buf {
            // o writes stream 2l + 1, down writes 2l + 2.
            let due = own_pos + 1 + lag;
            self.lagged.push((due, buf));
        }
        Ok(())
    }

    /// Keeps host copies of the MLP input and the pre-activation gate/up outputs of layer
    /// `layer` (bundles recompute h'_j from them).
    pub fn capture_mlp_inputs(
        &mut self,
        b: &B,
        layer: usize,
        x: &B::Buffer,
        gate: &B::Buffer,
        up: &B::Buffer,
    ) -> Result<()> {
        let Some(src) = self.plan.layers.get(layer).and_then(|l| l.bundles.as_ref()) else {
            return Ok(());
        };
        let rows = self.rows;
        let mut xs = vec![0.0f32; rows * src.hidden];
        let mut gs = vec![0.0f32; rows * src.neurons];
        let mut us = vec![0.0f32; rows * src.neurons];
        b.read_rows(x, src.hidden, 0, &mut xs)?;
        b.read_rows(gate, src.neurons, 0, &mut gs)?;
        b.read_rows(up, src.neurons, 0, &mut us)?;
        self.bundle_inputs = Some((xs, gs, us));
        Ok(())
    }

    /// Neuron-bundle refinement of layer `layer`'s MLP (eq. 6): `act` holds h = φ(g) ⊙ u,
    /// `y` the resident down projection's output. Honours the down set's lag.
    pub fn apply_bundles(
        &mut self,
        b: &B,
        layer: usize,
        act: &B::Buffer,
        y: &mut B::Buffer,
    ) -> Result<()> {
        let plan = Arc::clone(&self.plan);
        let Some(src) = plan.layers.get(layer).and_then(|l| l.bundles.as_ref()) else {
            return Ok(());
        };
        let Some((xs, gs, us)) = self.bundle_inputs.take() else {
            return Err(RuntimeError::Config(
                "apply_bundles without capture_mlp_inputs".into(),
            ));
        };
        let (hidden, neurons, rows) = (src.hidden, src.neurons, self.rows);
        let mut hs = vec![0.0f32; rows * neurons];
        b.read_rows(act, neurons, 0, &mut hs)?;
        let lag = self.lead(ProjectionSet::Down);
        let mut lag_buf = if lag > 0 {
            Some(b.alloc(rows * hidden)?)
        } else {
            None
        };
        let pb = src.part_bytes();
        let ub = src.unit_bytes();
        for r in 0..rows {
            let xr = &xs[r * hidden..(r + 1) * hidden];
            let hr = &hs[r * neurons..(r + 1) * neurons];
            let mut sel = std::mem::take(&mut self.sel);
            select_top_k(hr, self.settings.bundle_k, &mut sel);
            self.staged.clear();
            self.staged2.clear();
            self.weights.clear();
            self.weights2.clear();
            for &j in &sel {
                if !self.fetch(src.key_base, src.offset, ub, j, FetchInto::Unit) {
                    continue;
                }
                let u = &self.unit;
                let dot = |part: usize| -> f32 {
                    let bytes = &u[part * pb..(part + 1) * pb];
                    (0..hidden).map(|e| nibble_level(bytes, e) * xr[e]).sum()
                };
                let g = gs[r * neurons + j] + src.gate_scales[j] * dot(0);
                let up = us[r * neurons + j] + src.up_scales[j] * dot(1);
                let h_new = silu(g) * up;
                // Σ_j d_j (h'_j − h_j) + c^d_j h_j, each a nibble vector with its own scales.
                self.staged.extend_from_slice(&u[3 * pb..4 * pb]);
                self.weights.push(h_new - hr[j]);
                self.staged2.extend_from_slice(&u[2 * pb..3 * pb]);
                self.weights2.push(hr[j]);
            }
            self.sel = sel;
            if self.weights.is_empty() {
                continue;
            }
            let target: &mut B::Buffer = match lag_buf.as_mut() {
                Some(buf) => buf,
                None => y,
            };
            b.add_nibble_units(
                target,
                hidden,
                r,
                &self.staged,
                pb,
                &self.weights,
                &src.down_copy_scales,
            )?;
            b.add_nibble_units(
                target,
                hidden,
                r,
                &self.staged2,
                pb,
                &self.weights2,
                &src.down_refine_scales,
            )?;
        }
        if let Some(buf) = lag_buf {
            self.lagged.push((2 * layer + 2 + lag, buf));
        }
        Ok(())
    }
}

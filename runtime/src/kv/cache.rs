//! [`QuantKvCache`]: the method's KV cache (docs/method.md §5) behind [`KvCache`].
//!
//! Per layer and KV head: the first `sinks` positions in FP16, then encoded tiles of the base
//! (KVarN: 128 tokens each), then the current partial tile in FP16 (the *tail*). A tail that
//! fills is encoded when its positions are committed, and — with refinement on — the
//! sub-interval indices of every element are packed per token group and pushed to the
//! backing tier. Without a base (`--kv f16`) every position stays FP16.
//!
//! Single-token appends (decode) run [`attend_head`]: resident attention, eq. 7 selection and
//! eq. 8 correction. Multi-token appends (prefill chunks) attend exactly over the new tokens
//! and over the earlier positions as stored, through the backend's attention kernel.

use std::marker::PhantomData;
use std::sync::Arc;

use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use super::attend::{
    attend_head, refined_token, unit_bit_offsets, HeadOutcome, HeadView, RefineStep,
};
use super::base::KvBase;
use super::bitpack;
use super::spec::KvConfig;
use super::tier::{KvTier, TierBytes};
use crate::backend::cpu::SimdLevel;
use crate::backend::{AttentionShape, Backend, KvDtype, KvLayout};
use crate::error::{Result, RuntimeError};
use crate::kv_cache::{check_append, check_commit, FloatKvCache, KvCache, KvShape};

#[derive(Default, Clone)]
struct HeadStore {
    sink_k: Vec<f16>,
    sink_v: Vec<f16>,
    tiles: Vec<u8>,
    tail_k: Vec<f16>,
    tail_v: Vec<f16>,
}

struct RefineState {
    config: super::spec::KvRefineConfig,
    tier: KvTier,
    unit_bytes: usize,
    per_tile: usize,
}

/// Counters since construction or [`QuantKvCache::reset_stats`].
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct KvCacheStats {
    /// Single-token attention calls (layers × decode steps).
    pub decode_attentions: u64,
    /// Eligible (encoded) token groups summed over decode attentions and KV heads.
    pub eligible_groups: u64,
    pub selected_groups: u64,
    pub applied_groups: u64,
    /// Selected groups left at resident precision (cache miss skipped, or tier failure).
    pub missed_groups: u64,
    pub bytes_fetched: u64,
    pub tiles_encoded: u64,
}

impl KvCacheStats {
    /// Adds another run's counters (e.g. of the next evaluated part).
    pub fn merge(&mut self, s: &KvCacheStats) {
        self.decode_attentions += s.decode_attentions;
        self.eligible_groups += s.eligible_groups;
        self.selected_groups += s.selected_groups;
        self.applied_groups += s.applied_groups;
        self.missed_groups += s.missed_groups;
        self.bytes_fetched += s.bytes_fetched;
        self.tiles_encoded += s.tiles_encoded;
    }
}

/// Bytes per tier, in the units the method reports.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct KvBytes {
    /// Fast memory: FP16 sinks and tail buffers as allocated (each a full tile of tokens for
    /// quantized bases) plus encoded tiles.
    pub resident: u64,
    #[serde(flatten)]
    pub tier: TierBytes,
}

pub struct QuantKvCache<B: Backend> {
    shape: KvShape,
    capacity: usize,
    config: KvConfig,
    base: Option<Arc<dyn KvBase>>,
    /// Leading positions kept FP16 (all of them without a base).
    sink_tokens: usize,
    tile: usize,
    /// `[layer][kv head]`.
    heads: Vec<Vec<HeadStore>>,
    /// Positions stored per layer, including appended-but-uncommitted ones.
    stored: Vec<usize>,
    len: usize,
    refine: Option<RefineState>,
    stats: KvCacheStats,
    last_selection: Vec<Vec<Vec<usize>>>,
    /// SIMD tier of the host-side attention kernels.
    simd: SimdLevel,
    _backend: PhantomData<fn() -> B>,
}

impl<B: Backend> QuantKvCache<B> {
    pub fn new(shape: KvShape, capacity: usize, config: &KvConfig) -> Result<Self> {
        let bad = |m: String| RuntimeError::Config(format!("KV cache {}: {m}", config.label()));
        let base = config.base.build(shape.head_dim).map_err(bad)?;
        let d = shape.head_dim;
        let (sink_tokens, tile) = match &base {
            None => (capacity, 0),
            Some(b) => (config.sinks.min(capacity), b.tile_tokens()),
        };
        let max_tiles = capacity
            .saturating_sub(sink_tokens)
            .checked_div(tile)
            .unwrap_or(0);
        let refine = match (&config.refine, &base) {
            (Some(r), Some(_)) if !r.bits.is_none() => {
                let (unit_bytes, per_tile) = r.unit_layout(tile, d).map_err(bad)?;
                let tier = KvTier::new(
                    &r.tier,
                    shape.layers * shape.kv_heads,
                    max_tiles,
                    per_tile,
                    unit_bytes,
                )
                .map_err(|e| bad(e.to_string()))?;
                Some(RefineState {
                    config: r.clone(),
                    tier,
                    unit_bytes,
                    per_tile,
                })
            }
            _ => None,
        };
        let tile_bytes = base.as_ref().map_or(0, |b| b.tile_bytes());
        let mut heads = Vec::with_capacity(shape.layers);
        for _ in 0..shape.layers {
            let mut layer = Vec::with_capacity(shape.kv_heads);
            for _ in 0..shape.kv_heads {
                let mut h = HeadStore::default();
                // Encoded tiles are the bulk: reserve them once so growth never doubles them.
                h.tiles
                    .try_reserve_exact(max_tiles * tile_bytes)
                    .map_err(|e| bad(format!("reserving {max_tiles} tiles: {e}")))?;
                layer.push(h);
            }
            heads.push(layer);
        }
        Ok(Self {
            shape,
            capacity,
            config: config.clone(),
            base,
            sink_tokens,
            tile,
            heads,
            stored: vec![0; shape.layers],
            len: 0,
            refine,
            stats: KvCacheStats::default(),
            last_selection: vec![vec![Vec::new(); shape.kv_heads]; shape.layers],
            simd: SimdLevel::detect(),
            _backend: PhantomData,
        })
    }

    /// A cache holding the first `len` positions of a float cache (a prefill computed with
    /// exact keys and values), encoded from the uncompressed values.
    pub fn from_f32(
        backend: &B,
        float: &FloatKvCache<B>,
        len: usize,
        capacity: usize,
        config: &KvConfig,
    ) -> Result<Self> {
        let shape = float.shape();
        if len > float.len() || len > capacity {
            return Err(RuntimeError::CacheMismatch(format!(
                "importing {len} positions from a float cache of {} into capacity {capacity}",
                float.len()
            )));
        }
        let mut cache = Self::new(shape, capacity, config)?;
        let layout = float.layout();
        let d = shape.head_dim;
        let mut kbuf = vec![0.0f32; layout.buffer_len()];
        let mut vbuf = vec![0.0f32; layout.buffer_len()];
        for layer in 0..shape.layers {
            let (k, v) = float.layer(layer).ok_or_else(|| {
                RuntimeError::CacheMismatch(format!("float cache has no layer {layer}"))
            })?;
            backend.download_kv(k, &mut kbuf)?;
            backend.download_kv(v, &mut vbuf)?;
            // [kv_heads, capacity, d] → per-head rows 0..len.
            let rows: Vec<(Vec<f32>, Vec<f32>)> = (0..shape.kv_heads)
                .map(|j| {
                    let off = j * layout.capacity * d;
                    (
                        kbuf[off..off + len * d].to_vec(),
                        vbuf[off..off + len * d].to_vec(),
                    )
                })
                .collect();
            cache.ingest_layer(layer, rows)?;
        }
        cache.len = len;
        Ok(cache)
    }

    /// Stores exact per-head rows `[n, d]` (model frame) of one layer: sinks and tail in FP16,
    /// full tiles encoded straight from the f32 values.
    fn ingest_layer(&mut self, layer: usize, rows: Vec<(Vec<f32>, Vec<f32>)>) -> Result<()> {
        let d = self.shape.head_dim;
        let base = self.base.clone();
        let (sink_tokens, tile) = (self.sink_tokens, self.tile);
        let refine = self.unit_params();
        let heads = &mut self.heads[layer];
        // Tiles are independent per head: encode heads in parallel, push units afterwards
        // (the tier is appended in a fixed order, so files are deterministic).
        let results: Vec<(usize, Vec<Vec<u8>>)> = heads
            .par_iter_mut()
            .zip(rows.into_par_iter())
            .map(|(h, (mut k, mut v))| {
                let n = k.len() / d;
                if let Some(b) = &base {
                    for t in 0..n {
                        b.to_code_frame(&mut k[t * d..(t + 1) * d]);
                        b.to_code_frame(&mut v[t * d..(t + 1) * d]);
                    }
                }
                let ns = n.min(sink_tokens.saturating_sub(h.sink_k.len() / d));
                push_f16(&mut h.sink_k, &k[..ns * d]);
                push_f16(&mut h.sink_v, &v[..ns * d]);
                let mut units_per_tile = Vec::new();
                let mut t = ns;
                if let Some(b) = &base {
                    while h.tail_k.is_empty() && n - t >= tile {
                        let units = encode_into(
                            b.as_ref(),
                            &k[t * d..(t + tile) * d],
                            &v[t * d..(t + tile) * d],
                            refine,
                            &mut h.tiles,
                        );
                        units_per_tile.push(units);
                        t += tile;
                    }
                }
                push_f16(&mut h.tail_k, &k[t * d..]);
                push_f16(&mut h.tail_v, &v[t * d..]);
                (n, units_per_tile)
            })
            .collect();
        let n_added = results.first().map_or(0, |(n, _)| *n);
        self.store_units(layer, results.into_iter().map(|(_, units)| units));
        self.stored[layer] += n_added;
        self.flush_layer(layer);
        Ok(())
    }

    pub fn config(&self) -> &KvConfig {
        &self.config
    }

    pub fn stats(&self) -> &KvCacheStats {
        &self.stats
    }

    pub fn reset_stats(&mut self) {
        self.stats = KvCacheStats::default();
        if let Some(r) = &self.refine {
            r.tier.reset_stats();
        }
    }

    /// Replaces the refinement tier's read path and warning sink ([`KvTier::set_io_hooks`]);
    /// nothing without refinement.
    pub fn set_tier_io_hooks(
        &mut self,
        wrap: Option<super::tier::ReaderWrap>,
        warn: Option<crate::refine::store::WarnSink>,
    ) {
        if let Some(r) = self.refine.as_mut() {
            r.tier.set_io_hooks(wrap, warn);
        }
    }

    /// Refinement tier statistics (SSD tier: hits, misses, cache occupancy).
    pub fn tier_stats(&self) -> Option<crate::refine::store::StoreStats> {
        self.refine.as_ref().and_then(|r| r.tier.store_stats())
    }

    /// Waits for background refinement loads to finish (SSD tier).
    pub fn wait_idle(&self, timeout: std::time::Duration) -> bool {
        self.refine
            .as_ref()
            .is_none_or(|r| r.tier.wait_idle(timeout))
    }

    /// Groups selected by the last decode step, per layer and KV head (tile · groups per tile
    /// + group).
    pub fn last_selection(&self, layer: usize, head: usize) -> &[usize] {
        self.last_selection
            .get(layer)
            .and_then(|l| l.get(head))
            .map_or(&[], Vec::as_slice)
    }

    /// Resident tile codec, if any.
    pub fn base(&self) -> Option<&Arc<dyn KvBase>> {
        self.base.as_ref()
    }

    /// Bytes per tier now.
    pub fn bytes(&self) -> KvBytes {
        KvBytes {
            resident: self.resident_bytes() as u64,
            tier: self
                .refine
                .as_ref()
                .map(|r| r.tier.bytes())
                .unwrap_or_default(),
        }
    }

    /// Resident bytes the format prescribes for `positions` committed positions: FP16 sink and
    /// tail buffers of one tile each (counted whole, as allocated) and `tile_bytes` per full
    /// tile, per layer and KV head; FP16 for every position without a base.
    pub fn resident_bytes_for(&self, positions: usize) -> usize {
        let heads = self.shape.layers * self.shape.kv_heads;
        match &self.base {
            None => positions * self.shape.head_dim * 4 * heads,
            Some(b) => {
                let tiles = positions.saturating_sub(self.sink_tokens) / self.tile;
                self.fixed_fp16_bytes() + tiles * b.tile_bytes() * heads
            }
        }
    }

    /// The view of head `j` of `layer` (every stored position).
    fn view<'a>(&'a self, layer: usize, j: usize) -> HeadView<'a> {
        let h = &self.heads[layer][j];
        HeadView {
            head_dim: self.shape.head_dim,
            sink_k: &h.sink_k,
            sink_v: &h.sink_v,
            tiles: &h.tiles,
            tail_k: &h.tail_k,
            tail_v: &h.tail_v,
            base: self.base.as_deref(),
        }
    }

    /// Drops positions `len..` of every head of `layer` that are only in FP16 storage.
    fn rollback_layer(&mut self, layer: usize, len: usize) -> Result<()> {
        let d = self.shape.head_dim;
        let tile = self.tile;
        let tile_bytes = self.base.as_ref().map_or(1, |b| b.tile_bytes().max(1));
        for h in &mut self.heads[layer] {
            let n_sink = h.sink_k.len() / d;
            let n_tiles = h.tiles.len() / tile_bytes;
            let fixed = n_sink + n_tiles * tile;
            if len < fixed && (len < n_sink || n_tiles > 0) {
                if len >= n_sink && (len - n_sink).is_multiple_of(tile.max(1)) && tile > 0 {
                    // Cut at a tile boundary: whole tiles can be dropped.
                    let keep = (len - n_sink) / tile;
                    h.tiles.truncate(keep * tile_bytes);
                    h.tail_k.clear();
                    h.tail_v.clear();
                    continue;
                }
                if n_tiles == 0 {
                    h.sink_k.truncate(len * d);
                    h.sink_v.truncate(len * d);
                    h.tail_k.clear();
                    h.tail_v.clear();
                    continue;
                }
                return Err(RuntimeError::CacheMismatch(format!(
                    "cannot truncate to {len} positions: position {len} is inside an encoded \
                     tile (tiles start at {n_sink}, {tile} tokens each)"
                )));
            }
            let keep_tail = len.saturating_sub(fixed).min(h.tail_k.len() / d);
            h.tail_k.truncate(keep_tail * d);
            h.tail_v.truncate(keep_tail * d);
        }
        self.stored[layer] = len.min(self.stored[layer]);
        Ok(())
    }

    /// Encodes full tails of `layer` into tiles (and refinement units).
    fn flush_layer(&mut self, layer: usize) {
        let Some(base) = self.base.clone() else {
            return;
        };
        let d = self.shape.head_dim;
        let tile = self.tile;
        let refine = self.unit_params();
        let results: Vec<Vec<Vec<u8>>> = self.heads[layer]
            .par_iter_mut()
            .map(|h| {
                let mut out = Vec::new();
                let mut k = vec![0.0f32; tile * d];
                let mut v = vec![0.0f32; tile * d];
                while h.tail_k.len() >= tile * d {
                    h.tail_k[..tile * d].convert_to_f32_slice(&mut k);
                    h.tail_v[..tile * d].convert_to_f32_slice(&mut v);
                    out.push(encode_into(base.as_ref(), &k, &v, refine, &mut h.tiles));
                    h.tail_k.drain(..tile * d);
                    h.tail_v.drain(..tile * d);
                }
                out
            })
            .collect();
        self.store_units(layer, results);
    }

    /// Counts the tiles each head of `layer` just encoded and pushes their refinement units to
    /// the tier, heads in order (so the spill file is deterministic).
    fn store_units(&mut self, layer: usize, per_head: impl IntoIterator<Item = Vec<Vec<u8>>>) {
        let kv_heads = self.shape.kv_heads;
        for (j, units) in per_head.into_iter().enumerate() {
            self.stats.tiles_encoded += units.len() as u64;
            if let Some(r) = self.refine.as_mut() {
                for u in units {
                    r.tier.push_tile(layer * kv_heads + j, &u);
                }
            }
        }
    }

    /// What [`encode_into`] needs to produce refinement units: bits, group, unit bytes.
    fn unit_params(&self) -> Option<(super::base::RefineBits, usize, usize)> {
        self.refine
            .as_ref()
            .map(|r| (r.config.bits, r.config.group, r.unit_bytes))
    }

    /// Encoded tiles held by one head.
    fn tile_count(&self, h: &HeadStore) -> usize {
        self.base
            .as_ref()
            .map_or(0, |b| h.tiles.len() / b.tile_bytes().max(1))
    }

    /// FP16 sink and partial-tile buffers of a quantized base, all layers and heads (allocated
    /// whole, so counted whole).
    fn fixed_fp16_bytes(&self) -> usize {
        (self.sink_tokens + self.tile)
            * self.shape.head_dim
            * 4
            * self.shape.layers
            * self.shape.kv_heads
    }

    /// Appends code-frame rows `[n, kv_heads·d]` to `layer`'s FP16 storage.
    fn push_rows(&mut self, layer: usize, k: &[f32], v: &[f32], n: usize) {
        let d = self.shape.head_dim;
        let kv = self.shape.kv_heads;
        for t in 0..n {
            let pos = self.stored[layer] + t;
            for (j, h) in self.heads[layer].iter_mut().enumerate() {
                let src = (t * kv + j) * d;
                let (kr, vr) = (&k[src..src + d], &v[src..src + d]);
                if pos < self.sink_tokens {
                    push_f16(&mut h.sink_k, kr);
                    push_f16(&mut h.sink_v, vr);
                } else {
                    push_f16(&mut h.tail_k, kr);
                    push_f16(&mut h.tail_v, vr);
                }
            }
        }
        self.stored[layer] += n;
    }

    fn to_code_frame_rows(&self, x: &mut [f32]) {
        if let Some(b) = &self.base {
            for row in x.chunks_exact_mut(self.shape.head_dim) {
                b.to_code_frame(row);
            }
        }
    }

    fn to_model_frame_rows(&self, x: &mut [f32]) {
        if let Some(b) = &self.base {
            for row in x.chunks_exact_mut(self.shape.head_dim) {
                b.to_model_frame(row);
            }
        }
    }

    /// Decode: one new token, already pushed to storage.
    fn attend_decode(&mut self, layer: usize, n_heads: usize, q: &mut [f32]) -> Vec<f32> {
        let d = self.shape.head_dim;
        let kv = self.shape.kv_heads;
        let gq = n_heads / kv;
        let scale = 1.0 / (d as f32).sqrt();
        self.to_code_frame_rows(q);
        q.iter_mut().for_each(|x| *x *= scale);
        let mut out = vec![0.0f32; n_heads * d];
        let refine = self.refine.as_ref();
        let level = self.simd;
        let this = &*self;
        let outcomes: Vec<HeadOutcome> = out
            .par_chunks_mut(gq * d)
            .zip(q.par_chunks(gq * d))
            .enumerate()
            .map(|(j, (o, qj))| {
                let view = this.view(layer, j);
                match refine {
                    Some(r) => {
                        let fetch = |tile: usize, group: usize, buf: &mut Vec<u8>| {
                            r.tier.fetch(layer * kv + j, tile, group, buf)
                        };
                        let step = RefineStep {
                            bits: r.config.bits,
                            group: r.config.group,
                            fraction: r.config.fraction,
                            fetch: &fetch,
                        };
                        attend_head(level, &view, qj, o, Some(&step))
                    }
                    None => attend_head(level, &view, qj, o, None),
                }
            })
            .collect();
        self.to_model_frame_rows(&mut out);
        self.stats.decode_attentions += 1;
        let per_tile = self.refine.as_ref().map_or(0, |r| r.per_tile);
        for (j, oc) in outcomes.into_iter().enumerate() {
            if per_tile > 0 {
                let n_tiles = self.tile_count(&self.heads[layer][j]);
                self.stats.eligible_groups += (n_tiles * per_tile) as u64;
            }
            self.stats.selected_groups += oc.selected.len() as u64;
            self.stats.applied_groups += oc.applied as u64;
            self.stats.missed_groups += oc.missed as u64;
            self.stats.bytes_fetched += oc.bytes_fetched;
            self.last_selection[layer][j] = oc.selected;
        }
        out
    }

    /// Prefill chunk: exact new rows attend over the stored positions (as stored) and
    /// themselves, through the backend's kernel.
    #[allow(clippy::too_many_arguments)]
    fn attend_chunk(
        &self,
        backend: &B,
        layer: usize,
        n_heads: usize,
        q: &mut [f32],
        k_new: &[f32],
        v_new: &[f32],
    ) -> Result<Vec<f32>> {
        let views: Vec<HeadView<'_>> = (0..self.shape.kv_heads)
            .map(|j| self.view(layer, j))
            .collect();
        attend_chunk_as_stored(
            backend,
            self.base.as_deref(),
            &views,
            n_heads,
            q,
            k_new,
            v_new,
        )
    }
}

/// A prefill chunk's attention: the chunk's exact rows (`k_new`, `v_new`: `[n_new, kv_heads ·
/// d]`, code frame) attend causally over every position the heads' `views` store (as
/// stored: tiles dequantized) and over themselves, through the backend's attention kernel.
/// `q` (`[n_new, n_heads · d]`, model frame) is rotated in place; the result is in the
/// model frame.
pub(crate) fn attend_chunk_as_stored<B: Backend>(
    backend: &B,
    base: Option<&dyn KvBase>,
    views: &[HeadView<'_>],
    n_heads: usize,
    q: &mut [f32],
    k_new: &[f32],
    v_new: &[f32],
) -> Result<Vec<f32>> {
    let kv = views.len();
    let Some(d) = views.first().map(|v| v.head_dim) else {
        return Err(RuntimeError::CacheMismatch(
            "attention over no KV heads".into(),
        ));
    };
    let n_new = k_new.len() / (kv * d);
    let past = views[0].len();
    let total = past + n_new;
    let mut kc = vec![0.0f32; kv * total * d];
    let mut vc = vec![0.0f32; kv * total * d];
    for (j, view) in views.iter().enumerate() {
        if view.len() != past {
            return Err(RuntimeError::CacheMismatch(format!(
                "KV head {j} stores {} positions, head 0 {past}",
                view.len()
            )));
        }
        let kd = &mut kc[j * total * d..(j + 1) * total * d];
        let vd = &mut vc[j * total * d..(j + 1) * total * d];
        dequantize_head(view, &mut kd[..past * d], &mut vd[..past * d]);
        for t in 0..n_new {
            let src = (t * kv + j) * d;
            kd[(past + t) * d..(past + t + 1) * d].copy_from_slice(&k_new[src..src + d]);
            vd[(past + t) * d..(past + t + 1) * d].copy_from_slice(&v_new[src..src + d]);
        }
    }
    if let Some(b) = base {
        q.chunks_exact_mut(d).for_each(|row| b.to_code_frame(row));
    }
    let layout = KvLayout {
        kv_heads: kv,
        head_dim: d,
        capacity: total,
    };
    let shape = AttentionShape {
        n_heads,
        kv: layout,
        past,
        n_queries: n_new,
    };
    let qb = backend.upload(q)?;
    let kb = backend.upload_kv(&kc, KvDtype::F32)?;
    let vb = backend.upload_kv(&vc, KvDtype::F32)?;
    let mut ob = backend.alloc(n_new * n_heads * d)?;
    let positions: Vec<u32> = (past..total).map(|p| p as u32).collect();
    let mut pb = backend.alloc_index(n_new)?;
    backend.write_index(&mut pb, &positions)?;
    let mut scratch = backend.alloc(backend.attention_scratch_len(layout, n_heads).max(1))?;
    backend.attention(&qb, &kb, &vb, &shape, &pb, &mut scratch, &mut ob)?;
    let mut out = vec![0.0f32; n_new * n_heads * d];
    backend.download(&ob, &mut out)?;
    if let Some(b) = base {
        out.chunks_exact_mut(d)
            .for_each(|row| b.to_model_frame(row));
    }
    Ok(out)
}

impl<B: Backend> QuantKvCache<B> {
    /// Every stored position of one head as attention sees it without refinement: token-major
    /// `[n, d]` keys and values in the code frame (diagnostics and tests).
    pub fn dequantized_head(&self, layer: usize, head: usize) -> (Vec<f32>, Vec<f32>) {
        let view = self.view(layer, head);
        let n = view.len() * self.shape.head_dim;
        let (mut k, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
        dequantize_head(&view, &mut k, &mut v);
        (k, v)
    }

    /// Refined keys and values (`[g, d]` each, code frame) of group `group` (tile · groups per
    /// tile + group) of one head, fetched from the tier; `None` when unavailable.
    pub fn refined_group(
        &self,
        layer: usize,
        head: usize,
        group: usize,
    ) -> Option<(Vec<f32>, Vec<f32>)> {
        let r = self.refine.as_ref()?;
        let base = self.base.as_ref()?;
        let d = self.shape.head_dim;
        let g = r.config.group;
        let (ti, gt) = (group / r.per_tile, group % r.per_tile);
        let mut unit = Vec::new();
        if !r
            .tier
            .fetch(layer * self.shape.kv_heads + head, ti, gt, &mut unit)
            .has_bytes()
        {
            return None;
        }
        let tb = base.tile_bytes();
        let tile = self.heads[layer][head].tiles.get(ti * tb..(ti + 1) * tb)?;
        let (mut k, mut v) = (vec![0.0f32; g * d], vec![0.0f32; g * d]);
        let mut sub = vec![0u8; d];
        for t in 0..g {
            let rows = t * d..(t + 1) * d;
            refined_token(
                base.as_ref(),
                tile,
                &unit,
                r.config.bits,
                g,
                t,
                gt * g + t,
                &mut sub,
                &mut k[rows.clone()],
                &mut v[rows],
            );
        }
        Some((k, v))
    }
}

/// Every stored position of one head, dequantized: token-major `[n, d]` keys and values.
fn dequantize_head(view: &HeadView<'_>, k: &mut [f32], v: &mut [f32]) {
    let d = view.head_dim;
    let ns = view.sink_k.len();
    view.sink_k.convert_to_f32_slice(&mut k[..ns]);
    view.sink_v.convert_to_f32_slice(&mut v[..ns]);
    let mut off = ns;
    if let Some(b) = view.base {
        let (tile, tb) = (b.tile_tokens(), b.tile_bytes());
        let mut kcm = vec![0.0f32; tile * d];
        for bytes in view.tiles.chunks_exact(tb.max(1)) {
            b.decode_keys(bytes, &mut kcm);
            for t in 0..tile {
                for c in 0..d {
                    k[off + t * d + c] = kcm[c * tile + t];
                }
            }
            b.decode_values(bytes, &mut v[off..off + tile * d]);
            off += tile * d;
        }
    }
    let nt = view.tail_k.len();
    view.tail_k.convert_to_f32_slice(&mut k[off..off + nt]);
    view.tail_v.convert_to_f32_slice(&mut v[off..off + nt]);
}

fn push_f16(dst: &mut Vec<f16>, src: &[f32]) {
    dst.extend(src.iter().map(|&x| f16::from_f32(x)));
}

/// Encodes one tile (code frame, `[tile, d]`) onto `tiles`; returns its refinement units
/// (empty without refinement): per token group, key indices then value indices.
pub(crate) fn encode_into(
    base: &dyn KvBase,
    k: &[f32],
    v: &[f32],
    refine: Option<(super::base::RefineBits, usize, usize)>,
    tiles: &mut Vec<u8>,
) -> Vec<u8> {
    let d = base.head_dim();
    let tile = base.tile_tokens();
    let start = tiles.len();
    tiles.resize(start + base.tile_bytes(), 0);
    let Some((bits, group, unit_bytes)) = refine else {
        base.encode_tile(
            k,
            v,
            super::base::RefineBits::NONE,
            &mut tiles[start..],
            &mut [],
            &mut [],
        );
        return Vec::new();
    };
    let mut ks = vec![0u8; tile * d];
    let mut vs = vec![0u8; tile * d];
    base.encode_tile(k, v, bits, &mut tiles[start..], &mut ks, &mut vs);
    let per_tile = tile / group;
    let mut units = vec![0u8; per_tile * unit_bytes];
    let (k_at, v_at) = unit_bit_offsets(bits, group, d, 0);
    for (g, unit) in units.chunks_exact_mut(unit_bytes).enumerate() {
        let rows = g * group * d..(g + 1) * group * d;
        bitpack::pack(&ks[rows.clone()], bits.key, unit, k_at);
        bitpack::pack(&vs[rows], bits.value, unit, v_at);
    }
    units
}

impl<B: Backend> KvCache<B> for QuantKvCache<B> {
    fn shape(&self) -> KvShape {
        self.shape
    }
    fn len(&self) -> usize {
        self.len
    }
    fn capacity(&self) -> usize {
        self.capacity
    }
    fn clear(&mut self) {
        for layer in &mut self.heads {
            for h in layer {
                h.sink_k.clear();
                h.sink_v.clear();
                h.tiles.clear();
                h.tail_k.clear();
                h.tail_v.clear();
            }
        }
        self.stored.iter_mut().for_each(|s| *s = 0);
        self.len = 0;
        if let Some(r) = self.refine.as_mut() {
            r.tier.clear();
        }
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        if len >= self.len {
            return Ok(());
        }
        for layer in 0..self.shape.layers {
            self.rollback_layer(layer, len)?;
            let kept: Vec<usize> = self.heads[layer]
                .iter()
                .map(|h| self.tile_count(h))
                .collect();
            if let Some(r) = self.refine.as_mut() {
                for (j, n) in kept.into_iter().enumerate() {
                    r.tier.truncate_tiles(layer * self.shape.kv_heads + j, n);
                }
            }
        }
        self.len = len;
        Ok(())
    }

    fn append_and_attend(
        &mut self,
        backend: &B,
        layer: usize,
        n_heads: usize,
        n_new: usize,
        _positions: &B::Index,
        q: &B::Buffer,
        k: &B::Buffer,
        v: &B::Buffer,
        out: &mut B::Buffer,
    ) -> Result<()> {
        let (d, kv) = (self.shape.head_dim, self.shape.kv_heads);
        check_append(self.shape, self.len, self.capacity, layer, n_heads, n_new)?;
        // A forward that failed midway left uncommitted positions behind: drop them.
        if self.stored[layer] != self.len {
            self.rollback_layer(layer, self.len)?;
        }
        let mut qh = vec![0.0f32; n_new * n_heads * d];
        let mut kh = vec![0.0f32; n_new * kv * d];
        let mut vh = vec![0.0f32; n_new * kv * d];
        backend.download(q, &mut qh)?;
        backend.download(k, &mut kh)?;
        backend.download(v, &mut vh)?;
        self.to_code_frame_rows(&mut kh);
        self.to_code_frame_rows(&mut vh);
        let result = if n_new == 1 {
            self.push_rows(layer, &kh, &vh, 1);
            self.attend_decode(layer, n_heads, &mut qh)
        } else {
            let o = self.attend_chunk(backend, layer, n_heads, &mut qh, &kh, &vh)?;
            self.push_rows(layer, &kh, &vh, n_new);
            o
        };
        if backend.buffer_len(out) == result.len() {
            backend.upload_into(out, &result)?;
        } else {
            *out = backend.upload(&result)?;
        }
        Ok(())
    }

    fn commit(&mut self, n_new: usize) -> Result<()> {
        check_commit(&self.stored, self.len, n_new, self.capacity)?;
        let target = self.len + n_new;
        for layer in 0..self.shape.layers {
            self.flush_layer(layer);
        }
        self.len = target;
        Ok(())
    }

    fn tier_bytes(&self) -> Option<KvBytes> {
        Some(self.bytes())
    }

    fn resident_bytes(&self) -> usize {
        let d = self.shape.head_dim;
        match &self.base {
            None => self.len * d * 4 * self.shape.layers * self.shape.kv_heads,
            Some(_) => {
                let tiles: usize = self.heads.iter().flatten().map(|h| h.tiles.len()).sum();
                self.fixed_fp16_bytes() + tiles
            }
        }
    }
}

//! [`BackendKvarnCache`]: a KVarN cache whose rows, tiles and decode attention live in the
//! backend — device memory on CUDA, so a decode step never leaves the device — with its
//! refinement units (eq. 7/8, RAM tier) in host memory the device reads directly.
//!
//! Per layer the backend holds, for every KV head, an FP16 sink store of `sinks` rows, a
//! store of `tile_capacity` encoded tile records and an FP16 tail store of one tile of rows,
//! all in the code frame. How many of each are filled follows from the committed length
//! alone (sinks first, then whole tiles, then the tail), so nothing per position is kept on
//! the host.
//!
//! With refinement, each layer also has a units store of `tile_capacity` tiles' refinement
//! units per KV head ([`Backend::alloc_host_byte_store`]: page-locked, device-mapped host memory
//! on CUDA), written as tiles are encoded; a step reads only the units of the groups it
//! selects, over the bus.
//!
//! A decode step is one backend op, [`Backend::kvarn_decode`]: the key, value and query rows
//! rotated into the code frame, the key and value rows written at the slot the position
//! names, attention over the layer (with refinement: eq. 7's group selection and eq. 8's
//! correction), the output rotated back — all reading the position from the device, so the
//! step is captured into the model's step graph and replayed. When a commit fills the tail,
//! its rows are read back, encoded on the host by the same encoder as the host cache, and the
//! records and units written into their stores ([`Backend::write_byte_store`]): one round trip
//! per tile of tokens (128 steps).
//!
//! A prefill chunk attends on the host path the host cache uses ([`attend_chunk_as_stored`]):
//! the layer's stored rows and records are read back and dequantized, and the chunk's rows
//! are staged on the host until its commit writes them.
//!
//! On the CPU backend every rounding step is the host cache's ([`super::QuantKvCache`]): the
//! two give the same bits (tested below), so the host cache checks this one, and the device's
//! kernels are checked against the CPU backend's within the conformance bounds.

use std::sync::Arc;

use half::f16;
use rayon::prelude::*;

use super::attend::HeadView;
use super::base::{KvBase, RefineBits};
use super::cache::{attend_chunk_as_stored, encode_into, KvBytes, KvCacheStats};
use super::spec::{KvBaseChoice, KvConfig, KvTierConfig};
use super::tier::TierBytes;
use super::Kvarn;
use crate::backend::kvarn::{KvarnLayerMut, KvarnRefineSpec, KvarnShape};
use crate::backend::{Backend, KvDtype, KvLayout};
use crate::error::{Result, RuntimeError};
use crate::kv_cache::{check_append, check_commit, FloatKvCache, KvCache, KvShape};

/// A layer's units store: host memory the device reads, or device memory (`vram`).
fn alloc_units<B: Backend>(backend: &B, r: RefineGeometry) -> Result<B::ByteStore> {
    if r.in_device {
        backend.alloc_byte_store(r.store)
    } else {
        backend.alloc_host_byte_store(r.store)
    }
}

/// One layer's stores in the backend.
struct LayerStores<B: Backend> {
    sink_k: B::KvStore,
    sink_v: B::KvStore,
    tiles: B::ByteStore,
    tail_k: B::KvStore,
    tail_v: B::KvStore,
    /// Refinement units `[kv_heads, tile_capacity, groups per tile, unit]` (host memory the
    /// device reads), with refinement.
    units: Option<B::ByteStore>,
}

/// [`Backend::kvarn_decode`]'s scratch, allocated on the first decode step (its length
/// depends on the number of query heads).
struct StepScratch<B: Backend> {
    n_heads: usize,
    buffer: B::Buffer,
}

/// What the stores of one layer hold room for, per KV head.
struct Geometry {
    /// Sink rows (FP16, never encoded) and tokens per tile (the tail's rows).
    sinks: usize,
    tile: usize,
    tile_capacity: usize,
    /// Bytes of one tile record, and of a layer's tile store (all KV heads).
    record: usize,
    tile_bytes: usize,
    refine: Option<RefineGeometry>,
}

/// The refinement units of a layer.
#[derive(Clone, Copy)]
struct RefineGeometry {
    spec: KvarnRefineSpec,
    unit: usize,
    per_tile: usize,
    /// Bytes of a layer's units store (all KV heads).
    store: usize,
    /// Units in device memory rather than host memory.
    in_device: bool,
}

impl RefineGeometry {
    /// What the encoder needs to produce units: bits, group, unit bytes.
    fn encoder(&self) -> (RefineBits, usize, usize) {
        (self.spec.bits, self.spec.group, self.unit)
    }

    /// Byte offset of tile `tile`'s first unit of KV head `head` in a layer's units store.
    fn offset(&self, head: usize, tile: usize, tile_capacity: usize) -> usize {
        (head * tile_capacity + tile) * self.per_tile * self.unit
    }
}

impl Geometry {
    /// What `n` committed positions fill: encoded tiles only once the tail is flushed, which
    /// every commit does.
    fn fill(&self, n: usize) -> Fill {
        let sinks = n.min(self.sinks);
        let rest = n - sinks;
        Fill {
            sinks,
            tiles: rest / self.tile,
            tail: rest % self.tile,
        }
    }
}

/// Filled sinks, encoded tiles and tail rows of one head after `n` positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fill {
    sinks: usize,
    tiles: usize,
    tail: usize,
}

pub struct BackendKvarnCache<B: Backend> {
    /// Commits write and encode through it ([`KvCache::commit`] takes no backend).
    backend: B,
    shape: KvShape,
    capacity: usize,
    config: KvConfig,
    base: Arc<Kvarn>,
    geo: Geometry,
    layers: Vec<LayerStores<B>>,
    /// Positions appended per layer, including uncommitted ones.
    stored: Vec<usize>,
    /// A prefill chunk's code-frame rows `[n, kv_heads · d]` (keys, values) per layer, written
    /// at its commit.
    staged: Vec<Option<(Vec<f32>, Vec<f32>)>>,
    scratch: Option<StepScratch<B>>,
    len: usize,
    /// [`KvCache::graph_id`].
    id: u64,
    stats: KvCacheStats,
}

impl<B: Backend> BackendKvarnCache<B> {
    /// An empty cache of `capacity` positions. `config` must name a KVarN base, and
    /// refinement, if any, in the RAM tier ([`runs_in_backend`]).
    pub fn new(backend: &B, shape: KvShape, capacity: usize, config: &KvConfig) -> Result<Self> {
        let (d, kv) = (shape.head_dim, shape.kv_heads);
        Self::with_stores(backend, shape, capacity, config, |_, g| {
            Ok(LayerStores {
                sink_k: backend.alloc_kv(kv * g.sinks * d, KvDtype::F16)?,
                sink_v: backend.alloc_kv(kv * g.sinks * d, KvDtype::F16)?,
                tiles: backend.alloc_byte_store(g.tile_bytes)?,
                tail_k: backend.alloc_kv(kv * g.tile * d, KvDtype::F16)?,
                tail_v: backend.alloc_kv(kv * g.tile * d, KvDtype::F16)?,
                units: g.refine.map(|r| alloc_units(backend, r)).transpose()?,
            })
        })
    }

    /// The cache's geometry from `config` (checked), with each layer's stores made in order
    /// by `layer_stores` (allocated empty, or uploaded filled by an import).
    fn with_stores(
        backend: &B,
        shape: KvShape,
        capacity: usize,
        config: &KvConfig,
        mut layer_stores: impl FnMut(&Kvarn, &Geometry) -> Result<LayerStores<B>>,
    ) -> Result<Self> {
        let bad = |m: String| RuntimeError::Config(format!("KV cache {}: {m}", config.label()));
        let KvBaseChoice::Kvarn(bits) = config.base else {
            return Err(bad(
                "the backend cache holds KVarN tiles; use a float cache".into(),
            ));
        };
        if !runs_in_backend(config) {
            return Err(bad(
                "refinement from the SSD tier runs in the host cache (QuantKvCache)".into(),
            ));
        }
        let base = Arc::new(Kvarn::new(bits, shape.head_dim).map_err(bad)?);
        let sinks = config.sinks.min(capacity);
        let tile = base.tile_tokens();
        let tile_capacity = (capacity - sinks) / tile;
        let record = base.tile_bytes();
        let tile_bytes = shape
            .kv_heads
            .checked_mul(tile_capacity)
            .and_then(|n| n.checked_mul(record))
            .ok_or_else(|| bad(format!("{capacity} positions overflow the tile store")))?;
        let refine = match &config.refine {
            Some(r) if !r.bits.is_none() => {
                let (unit, per_tile) = r.unit_layout(tile, shape.head_dim).map_err(bad)?;
                let spec = KvarnRefineSpec {
                    bits: r.bits,
                    group: r.group,
                    fraction: r.fraction,
                };
                let store = (shape.kv_heads * tile_capacity)
                    .checked_mul(per_tile * unit)
                    .ok_or_else(|| bad(format!("{capacity} positions overflow the units")))?;
                Some(RefineGeometry {
                    spec,
                    unit,
                    per_tile,
                    store,
                    in_device: r.tier == KvTierConfig::Device,
                })
            }
            _ => None,
        };
        let geo = Geometry {
            sinks,
            tile,
            tile_capacity,
            record,
            tile_bytes,
            refine,
        };
        let layers = (0..shape.layers)
            .map(|_| layer_stores(&base, &geo))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            backend: backend.clone(),
            shape,
            capacity,
            config: config.clone(),
            base,
            geo,
            layers,
            stored: vec![0; shape.layers],
            staged: vec![None; shape.layers],
            scratch: None,
            len: 0,
            id: crate::kv_cache::next_cache_id(),
            stats: KvCacheStats::default(),
        })
    }

    /// A cache holding the first `len` positions of a float cache (a prefill computed with
    /// exact keys and values), encoded as the host cache's import encodes them: full tiles
    /// straight from the f32 values, sinks and tail rounded to FP16. Each layer's stores are
    /// uploaded filled, not allocated empty first.
    pub fn from_float(
        backend: &B,
        float: &FloatKvCache<B>,
        len: usize,
        capacity: usize,
        config: &KvConfig,
    ) -> Result<Self> {
        if len > float.len() || len > capacity {
            return Err(RuntimeError::CacheMismatch(format!(
                "importing {len} positions from a float cache of {} into capacity {capacity}",
                float.len()
            )));
        }
        let shape = float.shape();
        let layout = float.layout();
        let (d, kv) = (shape.head_dim, shape.kv_heads);
        let mut kbuf = vec![0.0f32; layout.buffer_len()];
        let mut vbuf = vec![0.0f32; layout.buffer_len()];
        let mut layer = 0;
        let mut cache = Self::with_stores(backend, shape, capacity, config, |base, g| {
            let (k, v) = float.layer(layer).ok_or_else(|| {
                RuntimeError::CacheMismatch(format!("float cache has no layer {layer}"))
            })?;
            layer += 1;
            backend.download_kv(k, &mut kbuf)?;
            backend.download_kv(v, &mut vbuf)?;
            let fill = g.fill(len);
            let (sinks, tile, record) = (g.sinks, g.tile, g.record);
            let mut sink = (vec![0.0f32; kv * sinks * d], vec![0.0f32; kv * sinks * d]);
            let mut tail = (vec![0.0f32; kv * tile * d], vec![0.0f32; kv * tile * d]);
            let mut tiles = vec![0u8; g.tile_bytes];
            let encoder = g.refine.map(|r| r.encoder());
            // Heads are independent: rotate and encode them in parallel.
            let heads: Vec<_> = tiles
                .par_chunks_mut(g.tile_capacity * record)
                .enumerate()
                .map(|(j, recs)| {
                    let at = |buf: &[f32]| buf[j * layout.capacity * d..][..len * d].to_vec();
                    let (mut kr, mut vr) = (at(&kbuf), at(&vbuf));
                    kr.chunks_exact_mut(d).for_each(|r| base.to_code_frame(r));
                    vr.chunks_exact_mut(d).for_each(|r| base.to_code_frame(r));
                    let first = fill.sinks;
                    let mut encoded = Vec::with_capacity(fill.tiles * record);
                    let mut units = Vec::new();
                    for t in 0..fill.tiles {
                        let r = (first + t * tile) * d..(first + (t + 1) * tile) * d;
                        units.extend(encode_into(
                            base,
                            &kr[r.clone()],
                            &vr[r],
                            encoder,
                            &mut encoded,
                        ));
                    }
                    recs[..encoded.len()].copy_from_slice(&encoded);
                    let tail_rows = (first + fill.tiles * tile) * d..len * d;
                    (kr, vr, tail_rows, units)
                })
                .collect();
            let mut units = g.refine.map(|r| alloc_units(backend, r)).transpose()?;
            for (j, (kr, vr, tail_rows, head_units)) in heads.into_iter().enumerate() {
                if let (Some(store), Some(r)) = (units.as_mut(), g.refine) {
                    backend.write_byte_store(
                        store,
                        r.offset(j, 0, g.tile_capacity),
                        &head_units,
                    )?;
                }
                let ns = fill.sinks * d;
                sink.0[j * sinks * d..][..ns].copy_from_slice(&kr[..ns]);
                sink.1[j * sinks * d..][..ns].copy_from_slice(&vr[..ns]);
                let nt = tail_rows.len();
                tail.0[j * tile * d..][..nt].copy_from_slice(&kr[tail_rows.clone()]);
                tail.1[j * tile * d..][..nt].copy_from_slice(&vr[tail_rows]);
            }
            Ok(LayerStores {
                sink_k: backend.upload_kv(&sink.0, KvDtype::F16)?,
                sink_v: backend.upload_kv(&sink.1, KvDtype::F16)?,
                tiles: backend.upload_byte_store(&tiles)?,
                tail_k: backend.upload_kv(&tail.0, KvDtype::F16)?,
                tail_v: backend.upload_kv(&tail.1, KvDtype::F16)?,
                units,
            })
        })?;
        cache.stats.tiles_encoded += (cache.geo.fill(len).tiles * kv * shape.layers) as u64;
        cache.stored.iter_mut().for_each(|s| *s = len);
        cache.len = len;
        Ok(cache)
    }

    pub fn config(&self) -> &KvConfig {
        &self.config
    }

    pub fn stats(&self) -> &KvCacheStats {
        &self.stats
    }

    pub fn reset_stats(&mut self) {
        self.stats = KvCacheStats::default();
    }

    /// Bytes now, as the format counts them: the FP16 sink and tail stores whole (as
    /// allocated) and one record per encoded tile, per layer and KV head. The tile store's
    /// unfilled capacity is allocated too ([`KvCache::resident_bytes`] counts it).
    pub fn bytes(&self) -> KvBytes {
        let heads = self.shape.layers * self.shape.kv_heads;
        let tiles = self.geo.fill(self.len).tiles * heads;
        KvBytes {
            resident: ((self.fixed_fp16_bytes() + tiles * self.geo.record) as u64),
            tier: TierBytes {
                backing: self
                    .geo
                    .refine
                    .map_or(0, |r| (tiles * r.per_tile * r.unit) as u64),
                ..TierBytes::default()
            },
        }
    }

    fn fixed_fp16_bytes(&self) -> usize {
        (self.geo.sinks + self.geo.tile)
            * self.shape.head_dim
            * 4
            * self.shape.layers
            * self.shape.kv_heads
    }

    fn kvarn_shape(&self, n_heads: usize, f: Fill) -> KvarnShape {
        KvarnShape {
            n_heads,
            kv_heads: self.shape.kv_heads,
            head_dim: self.shape.head_dim,
            bits: self.base.bits(),
            tile_tokens: self.geo.tile,
            sinks: f.sinks,
            sink_capacity: self.geo.sinks,
            tiles: f.tiles,
            tile_capacity: self.geo.tile_capacity,
            tail: f.tail,
            tail_capacity: self.geo.tile,
            refine: self.geo.refine.map(|r| r.spec),
        }
    }

    /// Decode: one token's rows rotated, written and attended to in the backend, every
    /// launch reading the position from the device (a captured step replays at the next).
    #[allow(clippy::too_many_arguments)]
    fn decode(
        &mut self,
        backend: &B,
        layer: usize,
        n_heads: usize,
        positions: &B::Index,
        q: &B::Buffer,
        k: &B::Buffer,
        v: &B::Buffer,
        out: &mut B::Buffer,
    ) -> Result<()> {
        let shape = self.kvarn_shape(n_heads, self.geo.fill(self.len));
        if self.scratch.as_ref().is_none_or(|s| s.n_heads != n_heads) {
            self.scratch = Some(StepScratch {
                n_heads,
                buffer: backend.alloc(backend.kvarn_decode_scratch_len(&shape))?,
            });
        }
        let Some(scratch) = self.scratch.as_mut() else {
            return Err(RuntimeError::Unsupported("decode scratch missing".into()));
        };
        let st = &mut self.layers[layer];
        let stores = KvarnLayerMut {
            sink_k: &mut st.sink_k,
            sink_v: &mut st.sink_v,
            tiles: &st.tiles,
            tail_k: &mut st.tail_k,
            tail_v: &mut st.tail_v,
            units: st.units.as_ref(),
        };
        backend.kvarn_decode(q, k, v, stores, &shape, positions, &mut scratch.buffer, out)
    }

    /// Per KV head: the layer's stored sink and tail rows (FP16) and tile records, read back.
    #[allow(clippy::type_complexity)]
    fn read_back(
        &self,
        backend: &B,
        layer: usize,
        fill: Fill,
    ) -> Result<Vec<(Vec<f16>, Vec<f16>, Vec<u8>, Vec<f16>, Vec<f16>)>> {
        let (d, kv) = (self.shape.head_dim, self.shape.kv_heads);
        let st = &self.layers[layer];
        let rows = |store: &B::KvStore, cap: usize, n: usize| -> Result<Vec<Vec<f16>>> {
            let mut all = vec![0.0f32; kv * cap * d];
            if n > 0 {
                backend.download_kv(store, &mut all)?;
            }
            Ok((0..kv)
                .map(|j| {
                    all[j * cap * d..][..n * d]
                        .iter()
                        .map(|&x| f16::from_f32(x))
                        .collect()
                })
                .collect())
        };
        let (sk, sv) = (
            rows(&st.sink_k, self.geo.sinks, fill.sinks)?,
            rows(&st.sink_v, self.geo.sinks, fill.sinks)?,
        );
        let (tk, tv) = (
            rows(&st.tail_k, self.geo.tile, fill.tail)?,
            rows(&st.tail_v, self.geo.tile, fill.tail)?,
        );
        let mut out = Vec::with_capacity(kv);
        for (j, (((sk, sv), tk), tv)) in sk.into_iter().zip(sv).zip(tk).zip(tv).enumerate() {
            let mut recs = vec![0u8; fill.tiles * self.geo.record];
            backend.read_byte_store(
                &st.tiles,
                j * self.geo.tile_capacity * self.geo.record,
                &mut recs,
            )?;
            out.push((sk, sv, recs, tk, tv));
        }
        Ok(out)
    }

    /// Prefill chunk: attention on the host over the layer as stored; rows staged.
    #[allow(clippy::too_many_arguments)]
    fn prefill(
        &mut self,
        backend: &B,
        layer: usize,
        n_heads: usize,
        n_new: usize,
        q: &B::Buffer,
        k: &B::Buffer,
        v: &B::Buffer,
        out: &mut B::Buffer,
    ) -> Result<()> {
        let (d, kv) = (self.shape.head_dim, self.shape.kv_heads);
        let mut qh = vec![0.0f32; n_new * n_heads * d];
        let mut kh = vec![0.0f32; n_new * kv * d];
        let mut vh = vec![0.0f32; n_new * kv * d];
        backend.download(q, &mut qh)?;
        backend.download(k, &mut kh)?;
        backend.download(v, &mut vh)?;
        for x in [&mut kh, &mut vh] {
            x.chunks_exact_mut(d)
                .for_each(|r| self.base.to_code_frame(r));
        }
        let stored = self.read_back(backend, layer, self.geo.fill(self.len))?;
        let base: &dyn KvBase = self.base.as_ref();
        let views: Vec<HeadView<'_>> = stored
            .iter()
            .map(|(sk, sv, tiles, tk, tv)| HeadView {
                head_dim: d,
                sink_k: sk,
                sink_v: sv,
                tiles,
                tail_k: tk,
                tail_v: tv,
                base: Some(base),
            })
            .collect();
        let o = attend_chunk_as_stored(backend, Some(base), &views, n_heads, &mut qh, &kh, &vh)?;
        crate::error::check_len(
            "kvarn cache",
            "attention output",
            backend.buffer_len(out),
            o.len(),
        )?;
        backend.upload_into(out, &o)?;
        self.staged[layer] = Some((kh, vh));
        Ok(())
    }

    /// Writes rows `[n, kv_heads · d]` into a layer's sink or tail stores at `slots`.
    fn write_rows(
        backend: &B,
        layout: KvLayout,
        (k, v): (&[f32], &[f32]),
        (kc, vc): (&mut B::KvStore, &mut B::KvStore),
        slots: std::ops::Range<usize>,
    ) -> Result<()> {
        if slots.is_empty() {
            return Ok(());
        }
        let idx: Vec<u32> = slots.map(|s| s as u32).collect();
        let mut index = backend.alloc_index(idx.len())?;
        backend.write_index(&mut index, &idx)?;
        let (kb, vb) = (backend.upload(k)?, backend.upload(v)?);
        backend.write_kv(&kb, &vb, kc, vc, layout, &index)
    }

    /// Makes positions `len..len + n_new` of `layer` stored: staged prefill rows written to
    /// their sink and tail slots, and every tail that filled encoded into tile records.
    fn commit_layer(&mut self, backend: &B, layer: usize, n_new: usize) -> Result<()> {
        let (d, kv) = (self.shape.head_dim, self.shape.kv_heads);
        let row = kv * d;
        let (before, after) = (self.geo.fill(self.len), self.geo.fill(self.len + n_new));
        let staged = self.staged[layer].take();
        let to_sinks = after.sinks - before.sinks;
        let sink_layout = KvLayout {
            kv_heads: kv,
            head_dim: d,
            capacity: self.geo.sinks,
        };
        let tail_layout = KvLayout {
            capacity: self.geo.tile,
            ..sink_layout
        };
        if let Some((k, v)) = &staged {
            let st = &mut self.layers[layer];
            Self::write_rows(
                backend,
                sink_layout,
                (&k[..to_sinks * row], &v[..to_sinks * row]),
                (&mut st.sink_k, &mut st.sink_v),
                before.sinks..after.sinks,
            )?;
        }
        let new_tiles = after.tiles - before.tiles;
        if new_tiles == 0 {
            if let Some((k, v)) = &staged {
                let st = &mut self.layers[layer];
                Self::write_rows(
                    backend,
                    tail_layout,
                    (&k[to_sinks * row..], &v[to_sinks * row..]),
                    (&mut st.tail_k, &mut st.tail_v),
                    before.tail..after.tail,
                )?;
            }
            return Ok(());
        }
        // Tiles filled: the rows after the sinks, in order, are the tail as it was stored
        // (decode rows are there already) followed by the staged rows, FP16-rounded as the
        // tail store rounds them.
        let on_device = if staged.is_some() {
            before.tail
        } else {
            before.tail + n_new
        };
        let mut tk = vec![0.0f32; kv * self.geo.tile * d];
        let mut tv = vec![0.0f32; kv * self.geo.tile * d];
        let st = &self.layers[layer];
        if on_device > 0 {
            backend.download_kv(&st.tail_k, &mut tk)?;
            backend.download_kv(&st.tail_v, &mut tv)?;
        }
        let staged_rows = |x: &[f32], j: usize| -> Vec<f32> {
            x[to_sinks * row..]
                .chunks_exact(row)
                .flat_map(|r| {
                    r[j * d..(j + 1) * d]
                        .iter()
                        .map(|&e| f16::from_f32(e).to_f32())
                })
                .collect()
        };
        let (base, tile, record) = (self.base.as_ref(), self.geo.tile, self.geo.record);
        let encoder = self.geo.refine.map(|r| r.encoder());
        // Per KV head: tile records, their units, and the rows left in the tail.
        type Encoded = (Vec<u8>, Vec<u8>, Vec<f32>, Vec<f32>);
        let per_head: Vec<Encoded> = (0..kv)
            .into_par_iter()
            .map(|j| {
                let mut k = tk[j * tile * d..][..on_device * d].to_vec();
                let mut v = tv[j * tile * d..][..on_device * d].to_vec();
                if let Some((sk, sv)) = &staged {
                    k.extend(staged_rows(sk, j));
                    v.extend(staged_rows(sv, j));
                }
                let mut recs = Vec::with_capacity(new_tiles * record);
                let mut units = Vec::new();
                for t in 0..new_tiles {
                    let r = t * tile * d..(t + 1) * tile * d;
                    units.extend(encode_into(base, &k[r.clone()], &v[r], encoder, &mut recs));
                }
                let rest = new_tiles * tile * d;
                (recs, units, k[rest..].to_vec(), v[rest..].to_vec())
            })
            .collect();
        let cap = self.geo.tile_capacity;
        let refine = self.geo.refine;
        let st = &mut self.layers[layer];
        let mut rest_k = vec![0.0f32; after.tail * row];
        let mut rest_v = vec![0.0f32; after.tail * row];
        for (j, (recs, units, k, v)) in per_head.into_iter().enumerate() {
            backend.write_byte_store(&mut st.tiles, (j * cap + before.tiles) * record, &recs)?;
            if let (Some(store), Some(r)) = (st.units.as_mut(), refine) {
                backend.write_byte_store(store, r.offset(j, before.tiles, cap), &units)?;
            }
            for t in 0..after.tail {
                rest_k[t * row + j * d..][..d].copy_from_slice(&k[t * d..(t + 1) * d]);
                rest_v[t * row + j * d..][..d].copy_from_slice(&v[t * d..(t + 1) * d]);
            }
        }
        Self::write_rows(
            backend,
            tail_layout,
            (&rest_k, &rest_v),
            (&mut st.tail_k, &mut st.tail_v),
            0..after.tail,
        )?;
        self.stats.tiles_encoded += (new_tiles * kv) as u64;
        Ok(())
    }
}

/// Whether `config` runs in a [`BackendKvarnCache`]: a KVarN base, without refinement or
/// with its units in the RAM tier (or in device memory, `vram`). The SSD tier (a spill file
/// behind a RAM cache with a miss policy) and the all-FP16 reference run in the host cache.
pub fn runs_in_backend(config: &KvConfig) -> bool {
    matches!(config.base, KvBaseChoice::Kvarn(_))
        && config
            .refine
            .as_ref()
            .is_none_or(|r| matches!(r.tier, KvTierConfig::Ram | KvTierConfig::Device))
}

/// The cache a run of `config` uses: [`BackendKvarnCache`] where [`runs_in_backend`], else the
/// host cache.
pub fn new_quantized_cache<B: Backend>(
    backend: &B,
    shape: KvShape,
    capacity: usize,
    config: &KvConfig,
) -> Result<Box<dyn KvCache<B>>> {
    Ok(if runs_in_backend(config) {
        Box::new(BackendKvarnCache::new(backend, shape, capacity, config)?)
    } else {
        Box::new(super::QuantKvCache::<B>::new(shape, capacity, config)?)
    })
}

impl<B: Backend> KvCache<B> for BackendKvarnCache<B> {
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
        self.len = 0;
        self.stored.iter_mut().for_each(|s| *s = 0);
        self.staged.iter_mut().for_each(|s| *s = None);
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        if len >= self.len {
            return Ok(());
        }
        let (now, then) = (self.geo.fill(self.len), self.geo.fill(len));
        // Rows stay where they are; only a cut inside an encoded tile loses exact values.
        if then.tiles < now.tiles && then.tail > 0 {
            return Err(RuntimeError::CacheMismatch(format!(
                "cannot truncate to {len} positions: position {len} is inside an encoded tile \
                 (tiles start at {}, {} tokens each)",
                self.geo.sinks, self.geo.tile
            )));
        }
        self.len = len;
        self.stored.iter_mut().for_each(|s| *s = len);
        self.staged.iter_mut().for_each(|s| *s = None);
        Ok(())
    }

    fn append_and_attend(
        &mut self,
        backend: &B,
        layer: usize,
        n_heads: usize,
        n_new: usize,
        positions: &B::Index,
        q: &B::Buffer,
        k: &B::Buffer,
        v: &B::Buffer,
        out: &mut B::Buffer,
    ) -> Result<()> {
        check_append(self.shape, self.len, self.capacity, layer, n_heads, n_new)?;
        // A forward that failed midway left uncommitted positions behind: drop them (a
        // decode row written past the committed length is simply not counted).
        self.stored[layer] = self.len;
        self.staged[layer] = None;
        if n_new == 1 {
            self.decode(backend, layer, n_heads, positions, q, k, v, out)?;
        } else {
            self.prefill(backend, layer, n_heads, n_new, q, k, v, out)?;
        }
        self.stored[layer] = self.len + n_new;
        Ok(())
    }

    fn commit(&mut self, n_new: usize) -> Result<()> {
        let target = self.len + n_new;
        // A replayed decode step ran on the device alone: its layers appended nothing here.
        let replayed = n_new == 1 && self.stored.iter().all(|&s| s == self.len);
        if replayed {
            self.stored.iter_mut().for_each(|s| *s = target);
        }
        check_commit(&self.stored, self.len, n_new, self.capacity)?;
        let backend = self.backend.clone();
        for layer in 0..self.shape.layers {
            self.commit_layer(&backend, layer, n_new)?;
        }
        if n_new == 1 {
            self.stats.decode_attentions += self.shape.layers as u64;
            // Every selected unit is in the RAM tier, so the counts follow from the fill.
            if let Some(r) = self.geo.refine {
                let heads = (self.shape.layers * self.shape.kv_heads) as u64;
                let eligible = self.geo.fill(self.len).tiles * r.per_tile;
                let selected = r.spec.selected(eligible) as u64;
                self.stats.eligible_groups += eligible as u64 * heads;
                self.stats.selected_groups += selected * heads;
                self.stats.applied_groups += selected * heads;
                self.stats.bytes_fetched += selected * r.unit as u64 * heads;
            }
        }
        self.len = target;
        Ok(())
    }

    fn tier_bytes(&self) -> Option<KvBytes> {
        Some(self.bytes())
    }

    fn resident_bytes(&self) -> usize {
        self.fixed_fp16_bytes()
            + self.geo.tile_capacity * self.geo.record * self.shape.layers * self.shape.kv_heads
    }

    /// Every op of a decode step is a device op that reads the position from the device;
    /// stores never move after creation (commits write into them).
    fn graph_id(&self) -> Option<u64> {
        Some(self.id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::kv::{KvBits, QuantKvCache};
    use crate::test_util::lcg;

    const SHAPE: KvShape = KvShape {
        layers: 2,
        kv_heads: 2,
        head_dim: 64,
    };
    const HEADS: usize = 6;

    fn rows(n: usize, width: usize, seed: &mut u64) -> Vec<f32> {
        (0..n * width).map(|_| 2.0 * lcg(seed)).collect()
    }

    /// One forward of `n` tokens through both caches (every layer, then commit); the outputs
    /// must be the same bits.
    fn step(
        b: &CpuBackend,
        host: &mut QuantKvCache<CpuBackend>,
        dev: &mut BackendKvarnCache<CpuBackend>,
        n: usize,
        seed: &mut u64,
    ) {
        let d = SHAPE.head_dim;
        let mut pos = b.alloc_index(n).unwrap();
        let at: Vec<u32> = (host.len()..host.len() + n).map(|p| p as u32).collect();
        b.write_index(&mut pos, &at).unwrap();
        for layer in 0..SHAPE.layers {
            let q = b.upload(&rows(n, HEADS * d, seed)).unwrap();
            let k = b.upload(&rows(n, SHAPE.kv_heads * d, seed)).unwrap();
            let v = b.upload(&rows(n, SHAPE.kv_heads * d, seed)).unwrap();
            let mut outs = [
                b.alloc(n * HEADS * d).unwrap(),
                b.alloc(n * HEADS * d).unwrap(),
            ];
            host.append_and_attend(b, layer, HEADS, n, &pos, &q, &k, &v, &mut outs[0])
                .unwrap();
            dev.append_and_attend(b, layer, HEADS, n, &pos, &q, &k, &v, &mut outs[1])
                .unwrap();
            let [h, dv] = outs.map(|o| {
                let mut x = vec![0.0f32; n * HEADS * d];
                b.download(&o, &mut x).unwrap();
                x
            });
            let same = h.iter().zip(&dv).all(|(a, c)| a.to_bits() == c.to_bits());
            assert!(same, "layer {layer}, {n} tokens after {}", host.len());
        }
        host.commit(n).unwrap();
        dev.commit(n).unwrap();
    }

    /// Prefill chunks and decode steps across sink, tile and flush boundaries, truncation at
    /// a tile boundary and inside the tail: the backend cache gives the host cache's bits.
    #[test]
    fn matches_the_host_cache_bit_for_bit() {
        let b = CpuBackend::new();
        let refine = |bits: RefineBits, group: usize, fraction: f64| {
            Some(crate::kv::KvRefineConfig {
                bits,
                group,
                fraction,
                tier: KvTierConfig::Ram,
            })
        };
        let in_device = |r: Option<crate::kv::KvRefineConfig>| {
            r.map(|r| crate::kv::KvRefineConfig {
                tier: KvTierConfig::Device,
                ..r
            })
        };
        let configs = [
            (KvBits { key: 2, value: 2 }, None),
            (KvBits { key: 3, value: 2 }, None),
            (
                KvBits { key: 2, value: 2 },
                refine(RefineBits { key: 4, value: 4 }, 2, 1.0 / 8.0),
            ),
            (
                KvBits { key: 2, value: 1 },
                refine(RefineBits { key: 0, value: 1 }, 4, 1.0 / 16.0),
            ),
            (
                KvBits { key: 3, value: 2 },
                in_device(refine(RefineBits { key: 4, value: 4 }, 2, 1.0 / 4.0)),
            ),
        ];
        for (bits, refine) in configs {
            let config = KvConfig {
                sinks: 5,
                refine,
                ..KvConfig::base(KvBaseChoice::Kvarn(bits))
            };
            let cap = 5 + 4 * 128 + 40;
            let mut host = QuantKvCache::<CpuBackend>::new(SHAPE, cap, &config).unwrap();
            let mut dev = BackendKvarnCache::new(&b, SHAPE, cap, &config).unwrap();
            let mut seed = 7u64;
            for n in [3, 1, 1, 140, 1] {
                step(&b, &mut host, &mut dev, n, &mut seed);
            }
            // 146 stored: the first tile encoded at the 140-token commit. Decode across the
            // next flush (position 261).
            for _ in 0..120 {
                step(&b, &mut host, &mut dev, 1, &mut seed);
            }
            let (ds, hs) = (dev.stats(), host.stats());
            assert_eq!(ds.tiles_encoded, hs.tiles_encoded);
            assert_eq!(
                (ds.eligible_groups, ds.selected_groups, ds.bytes_fetched),
                (hs.eligible_groups, hs.selected_groups, hs.bytes_fetched)
            );
            assert_eq!(dev.bytes().resident, host.bytes().resident);
            assert_eq!(dev.bytes().tier.backing, host.bytes().tier.backing);
            // Into the tail, then back to a tile boundary; a cut inside a tile is refused.
            for cut in [263, 261] {
                host.truncate(cut).unwrap();
                dev.truncate(cut).unwrap();
                step(&b, &mut host, &mut dev, 1, &mut seed);
            }
            assert!(dev.truncate(200).is_err());
            step(&b, &mut host, &mut dev, 200, &mut seed);
            for _ in 0..3 {
                step(&b, &mut host, &mut dev, 1, &mut seed);
            }
        }
    }

    /// An imported float prefill encodes as the host cache's import does (tiles and units).
    #[test]
    fn imports_a_float_cache_as_the_host_cache_does() {
        let b = CpuBackend::new();
        let d = SHAPE.head_dim;
        let config = KvConfig {
            sinks: 3,
            refine: Some(crate::kv::KvRefineConfig {
                bits: RefineBits { key: 0, value: 1 },
                group: 4,
                fraction: 1.0 / 16.0,
                tier: KvTierConfig::Ram,
            }),
            ..KvConfig::base(KvBaseChoice::Kvarn(KvBits { key: 2, value: 1 }))
        };
        let (len, cap) = (3 + 2 * 128 + 17, 400);
        let mut float = FloatKvCache::with_dtype(&b, SHAPE, len, KvDtype::F32).unwrap();
        let mut seed = 11u64;
        let positions = pos_index(&b, len);
        for layer in 0..SHAPE.layers {
            let q = b.upload(&rows(len, HEADS * d, &mut seed)).unwrap();
            let k = b.upload(&rows(len, SHAPE.kv_heads * d, &mut seed)).unwrap();
            let v = b.upload(&rows(len, SHAPE.kv_heads * d, &mut seed)).unwrap();
            let mut o = b.alloc(len * HEADS * d).unwrap();
            float
                .append_and_attend(&b, layer, HEADS, len, &positions, &q, &k, &v, &mut o)
                .unwrap();
        }
        float.commit(len).unwrap();
        let mut host = QuantKvCache::from_f32(&b, &float, len, cap, &config).unwrap();
        let mut dev = BackendKvarnCache::from_float(&b, &float, len, cap, &config).unwrap();
        assert_eq!(dev.len(), len);
        for _ in 0..4 {
            step(&b, &mut host, &mut dev, 1, &mut seed);
        }
    }

    fn pos_index(b: &CpuBackend, n: usize) -> <CpuBackend as Backend>::Index {
        let mut idx = b.alloc_index(n).unwrap();
        let p: Vec<u32> = (0..n as u32).collect();
        b.write_index(&mut idx, &p).unwrap();
        idx
    }
}

//! Key/value cache behind a small trait, so the resident KV formats of the method (KVarN with
//! nested refinement, §5) can replace the float cache without touching the graph.
//!
//! The trait owns both storing new keys/values and attending over them, because a quantized
//! cache's attention depends on its storage (resident codes, an FP16 sink/partial block, the
//! refinement correction of eq. 8). The float cache simply calls the backend's attention.

use crate::backend::{AttentionShape, Backend, KvDtype, KvLayout, RopeTable};
use crate::error::{Result, RuntimeError};
use sfx_formats::ModelConfig;
use std::sync::atomic::{AtomicU64, Ordering};

/// What a cache was built for; the model checks it before a forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl KvShape {
    pub fn of(config: &ModelConfig) -> Self {
        Self {
            layers: config.num_hidden_layers,
            kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
        }
    }
}

/// A per-sequence KV cache. A forward of n tokens calls [`KvCache::append_and_attend`] once
/// per layer (all at positions `len()..len() + n`) and then [`KvCache::commit`] once; a
/// forward that fails midway leaves `len()` unchanged.
pub trait KvCache<B: Backend>: Send {
    fn shape(&self) -> KvShape;
    /// Committed positions.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Maximum positions the cache can hold.
    fn capacity(&self) -> usize;
    /// Forgets every position (storage is kept for reuse).
    fn clear(&mut self);
    /// Keeps the first `len` positions (no-op if `len >= self.len()`). A quantized cache
    /// refuses a cut inside an encoded tile (its exact values are gone).
    fn truncate(&mut self, len: usize) -> Result<()>;
    /// Stores `k`, `v` (`[n_new, kv_heads · head_dim]`, after RoPE) of `layer` at positions
    /// `len()..len() + n_new` and writes causal attention of `q` (`[n_new, n_heads ·
    /// head_dim]`) over positions `0..len() + n_new` into `out`. `positions` holds those
    /// positions on the device (what captured kernels read).
    #[allow(clippy::too_many_arguments)]
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
    ) -> Result<()>;
    /// [`KvCache::append_and_attend`] of `q` and `k` before RoPE: rotates both at `positions`
    /// (`rope`'s angles) first. A cache whose backend rotates inside its attention
    /// ([`Backend::rope_write_kv_attention`]) does the three in one step; `q` and `k` hold
    /// unspecified values afterwards.
    #[allow(clippy::too_many_arguments)]
    fn rope_append_and_attend(
        &mut self,
        backend: &B,
        layer: usize,
        n_heads: usize,
        n_new: usize,
        positions: &B::Index,
        rope: &RopeTable<B>,
        q: &mut B::Buffer,
        k: &mut B::Buffer,
        v: &B::Buffer,
        out: &mut B::Buffer,
    ) -> Result<()> {
        let s = self.shape();
        backend.rope_qk(q, n_heads, k, s.kv_heads, s.head_dim, rope, positions)?;
        self.append_and_attend(backend, layer, n_heads, n_new, positions, q, k, v, out)
    }
    /// Makes the `n_new` positions appended to every layer part of the sequence.
    fn commit(&mut self, n_new: usize) -> Result<()>;
    /// Device bytes held (for memory accounting).
    fn resident_bytes(&self) -> usize;
    /// A quantized cache's bytes per tier, its spill cache's occupancy and budget included
    /// (`sfx-run --soak` watches them); `None` for a float cache, which has no tiers.
    fn tier_bytes(&self) -> Option<crate::kv::KvBytes> {
        None
    }
    /// An identity that stays fixed while the cache's device storage does, when a decode
    /// step over this cache may be captured into a graph and replayed: every op of its
    /// `append_and_attend` is a device op reading positions from the device, with no host
    /// state changed. `None` (the default) for caches that do host work per step.
    fn graph_id(&self) -> Option<u64> {
        None
    }
}

/// Fresh identities for [`KvCache::graph_id`].
pub(crate) fn next_cache_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// `CacheFull` unless `n_new` more positions fit after `len`.
pub(crate) fn check_room(len: usize, n_new: usize, capacity: usize) -> Result<()> {
    if len.checked_add(n_new).is_none_or(|end| end > capacity) {
        return Err(RuntimeError::CacheFull {
            cached: len,
            new: n_new,
            capacity,
        });
    }
    Ok(())
}

/// The checks a quantized cache makes before appending `n_new` positions to `layer`: room
/// after `len`, the layer exists, query heads group over the KV heads.
pub(crate) fn check_append(
    shape: KvShape,
    len: usize,
    capacity: usize,
    layer: usize,
    n_heads: usize,
    n_new: usize,
) -> Result<()> {
    check_room(len, n_new, capacity)?;
    if layer >= shape.layers {
        return Err(RuntimeError::CacheMismatch(format!(
            "layer {layer} requested, cache has {} layers",
            shape.layers
        )));
    }
    let kv = shape.kv_heads;
    if kv == 0 || !n_heads.is_multiple_of(kv) {
        return Err(RuntimeError::CacheMismatch(format!(
            "{n_heads} query heads are not a multiple of {kv} KV heads"
        )));
    }
    Ok(())
}

/// The checks of a quantized cache's commit of `n_new` positions after `len`: room, and every
/// layer holding exactly `len + n_new` positions (`stored`).
pub(crate) fn check_commit(
    stored: &[usize],
    len: usize,
    n_new: usize,
    capacity: usize,
) -> Result<()> {
    check_room(len, n_new, capacity)?;
    let target = len + n_new;
    if let Some(bad) = stored.iter().position(|&s| s != target) {
        return Err(RuntimeError::CacheMismatch(format!(
            "commit of {n_new} positions: layer {bad} holds {} (expected {target})",
            stored[bad]
        )));
    }
    Ok(())
}

/// Float cache: per layer one K and one V store `[kv_heads, capacity, head_dim]` of f32 or
/// f16 elements, allocated up front (SmolLM2-135M at 2048 positions, f32: 94 MB), plus the
/// attention kernel's scratch, so a decode step allocates nothing.
pub struct FloatKvCache<B: Backend> {
    shape: KvShape,
    layout: KvLayout,
    dtype: KvDtype,
    keys: Vec<B::KvStore>,
    values: Vec<B::KvStore>,
    scratch: Option<(usize, B::Buffer)>,
    len: usize,
    id: u64,
}

impl<B: Backend> FloatKvCache<B> {
    /// An f32 cache.
    pub fn new(backend: &B, shape: KvShape, capacity: usize) -> Result<Self> {
        Self::with_dtype(backend, shape, capacity, KvDtype::F32)
    }

    pub fn with_dtype(
        backend: &B,
        shape: KvShape,
        capacity: usize,
        dtype: KvDtype,
    ) -> Result<Self> {
        let layout = KvLayout {
            kv_heads: shape.kv_heads,
            head_dim: shape.head_dim,
            capacity,
        };
        let len = shape
            .kv_heads
            .checked_mul(shape.head_dim)
            .and_then(|x| x.checked_mul(capacity))
            .ok_or_else(|| RuntimeError::CacheMismatch(format!("capacity {capacity} overflows")))?;
        let mut keys = Vec::with_capacity(shape.layers);
        let mut values = Vec::with_capacity(shape.layers);
        for _ in 0..shape.layers {
            keys.push(backend.alloc_kv(len, dtype)?);
            values.push(backend.alloc_kv(len, dtype)?);
        }
        Ok(Self {
            shape,
            layout,
            dtype,
            keys,
            values,
            scratch: None,
            len: 0,
            id: next_cache_id(),
        })
    }

    /// One layer's raw `[kv_heads, capacity, head_dim]` key and value stores (positions
    /// `len()..` hold stale data).
    pub fn layer(&self, layer: usize) -> Option<(&B::KvStore, &B::KvStore)> {
        Some((self.keys.get(layer)?, self.values.get(layer)?))
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }
}

impl<B: Backend> FloatKvCache<B> {
    /// What a step of `n_new` positions at `layer` works on: its attention shape, the layer's
    /// key and value stores, and the attention scratch (sized for this head count, allocated
    /// on first use: a model asks with one head count, and capture happens only after an
    /// eager step has made it).
    #[allow(clippy::type_complexity)]
    fn step_parts(
        &mut self,
        backend: &B,
        layer: usize,
        n_heads: usize,
        n_new: usize,
    ) -> Result<(
        AttentionShape,
        &mut B::KvStore,
        &mut B::KvStore,
        &mut B::Buffer,
    )> {
        check_room(self.len, n_new, self.layout.capacity)?;
        let need = backend.attention_scratch_len(self.layout, n_heads);
        if self
            .scratch
            .as_ref()
            .is_none_or(|(heads, _)| *heads != n_heads)
        {
            self.scratch = Some((n_heads, backend.alloc(need.max(1))?));
        }
        let (Some(kc), Some(vc)) = (self.keys.get_mut(layer), self.values.get_mut(layer)) else {
            return Err(RuntimeError::CacheMismatch(format!(
                "layer {layer} requested, cache has {} layers",
                self.shape.layers
            )));
        };
        let Some((_, scratch)) = self.scratch.as_mut() else {
            return Err(RuntimeError::CacheMismatch(
                "attention scratch missing".into(),
            ));
        };
        let shape = AttentionShape {
            n_heads,
            kv: self.layout,
            past: self.len,
            n_queries: n_new,
        };
        Ok((shape, kc, vc, scratch))
    }
}

impl<B: Backend> KvCache<B> for FloatKvCache<B> {
    fn shape(&self) -> KvShape {
        self.shape
    }
    fn len(&self) -> usize {
        self.len
    }
    fn capacity(&self) -> usize {
        self.layout.capacity
    }
    fn clear(&mut self) {
        self.len = 0;
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.len = self.len.min(len);
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
        let (shape, kc, vc, scratch) = self.step_parts(backend, layer, n_heads, n_new)?;
        backend.write_kv(k, v, kc, vc, shape.kv, positions)?;
        backend.attention(q, kc, vc, &shape, positions, scratch, out)
    }

    fn rope_append_and_attend(
        &mut self,
        backend: &B,
        layer: usize,
        n_heads: usize,
        n_new: usize,
        positions: &B::Index,
        rope: &RopeTable<B>,
        q: &mut B::Buffer,
        k: &mut B::Buffer,
        v: &B::Buffer,
        out: &mut B::Buffer,
    ) -> Result<()> {
        let (shape, kc, vc, scratch) = self.step_parts(backend, layer, n_heads, n_new)?;
        backend.rope_write_kv_attention(q, k, v, rope, kc, vc, &shape, positions, scratch, out)
    }

    fn commit(&mut self, n_new: usize) -> Result<()> {
        check_room(self.len, n_new, self.layout.capacity)?;
        self.len += n_new;
        Ok(())
    }

    fn resident_bytes(&self) -> usize {
        2 * self.shape.layers * self.layout.buffer_len() * self.dtype.size_in_bytes()
    }

    fn graph_id(&self) -> Option<u64> {
        // The scratch is (re)allocated only when the head count changes, which changes the
        // id too.
        let heads = self.scratch.as_ref().map_or(0, |(h, _)| *h as u64);
        Some(self.id ^ (heads << 48))
    }
}

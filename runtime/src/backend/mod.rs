//! The compute boundary. A [`Backend`] owns activation buffers and resident float weight
//! matrices and implements every op the decoder graph needs; the graph in [`crate::model`] is
//! written once against this trait.
//!
//! Following candle's `BackendStorage`/`BackendDevice` split, a new device (CUDA, Metal) is a
//! new module with its own `Buffer`/`Matrix` types and kernels, not an edit of the graph.
//! Quantized and refined linears are not backend ops: they implement [`crate::linear::Linear`]
//! for the backends they have kernels for.
//!
//! Everything a decode step reads that changes from token to token — token ids, positions,
//! the cache length — lives in device buffers ([`Backend::Index`]), never in kernel
//! arguments, so one captured step ([`Backend::Graph`]) replays at every position. RoPE
//! angles are a resident table ([`RopeTable`]) indexed by those positions. Design and
//! measurements: docs/decisions.md, "CUDA backend".

pub mod cpu;
pub mod cuda;
pub mod kvarn;
pub mod refine;

use crate::error::{Result, RuntimeError};
pub use kvarn::{KvarnLayer, KvarnLayerMut, KvarnRefineSpec, KvarnShape, KvarnSlot};
use sfx_formats::{DType, TensorView};

/// How a float checkpoint tensor is stored once resident.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightPrecision {
    /// Keep BF16 as BF16 and F32 as F32; F16 widens to F32 (BF16 would drop 3 mantissa bits).
    #[default]
    Native,
    /// Widen everything to F32 (exact path; 2× the memory of BF16).
    F32,
    /// Round everything to BF16 (nearest-even), as an exported BF16 checkpoint would have it.
    Bf16,
}

impl WeightPrecision {
    /// The resident dtype for a source tensor of dtype `src`.
    pub fn resident_dtype(self, src: DType) -> DType {
        match (self, src) {
            (WeightPrecision::F32, _) => DType::F32,
            (WeightPrecision::Bf16, _) => DType::BF16,
            (WeightPrecision::Native, DType::BF16) => DType::BF16,
            (WeightPrecision::Native, _) => DType::F32,
        }
    }
}

/// Layout of one layer's K or V cache buffer: `[kv_heads, capacity, head_dim]`, so that one KV
/// head's keys are one contiguous `[positions, head_dim]` matrix (what the per-head attention
/// GEMMs want).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub kv_heads: usize,
    pub head_dim: usize,
    pub capacity: usize,
}

impl KvLayout {
    pub fn buffer_len(&self) -> usize {
        self.kv_heads * self.capacity * self.head_dim
    }
}

/// Shape of one causal attention call: `n_queries` new tokens at positions
/// `past..past + n_queries` attend to cache positions `0..=their own position`.
///
/// `past` is what the host knows when it issues the call; it is used for checks and by
/// backends that schedule on the host. A kernel that may be captured into a step graph reads
/// each query's position from the positions buffer instead (the graph replays at other
/// positions), and sizes its grid from `kv.capacity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub n_heads: usize,
    pub kv: KvLayout,
    pub past: usize,
    pub n_queries: usize,
}

/// Element type of a float KV cache. F16 halves the bytes every decode step streams at long
/// context (an 8B model at 32K: 4.3 GB instead of 8.6 GB per token).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvDtype {
    #[default]
    F32,
    F16,
}

impl KvDtype {
    pub fn size_in_bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
        }
    }
}

/// How a matmul's result combines with what the output buffer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulOut {
    /// `y = x·wᵀ (+ bias)`.
    Store,
    /// `y += x·wᵀ (+ bias)`: the residual add fused into the projection (o, down).
    Accumulate,
}

/// One projection of a group sharing its input (q/k/v): weight, optional bias, output.
pub struct GroupItem<'a, B: Backend> {
    pub weight: &'a B::Matrix,
    pub bias: Option<&'a B::Buffer>,
    pub out: &'a mut B::Buffer,
    /// A decode row's refinement of this projection ([`refine::FusedColumns`]).
    pub refine: Option<refine::FusedColumns<'a, B>>,
}

impl<'a, B: Backend> GroupItem<'a, B> {
    /// An unrefined projection.
    pub fn new(weight: &'a B::Matrix, bias: Option<&'a B::Buffer>, out: &'a mut B::Buffer) -> Self {
        Self {
            weight,
            bias,
            out,
            refine: None,
        }
    }
}

/// cos/sin of θ_j·p for positions `0..positions`, each `[positions, head_dim / 2]` on the
/// device ([`crate::model::rope_cos_sin`] from 0). Kernels index it by the positions buffer.
pub struct RopeTable<B: Backend> {
    pub cos: B::Buffer,
    pub sin: B::Buffer,
    pub positions: usize,
    pub half: usize,
}

/// [`Backend::rope_write_kv_attention`] as its three ops, for backends (and shapes) that do not
/// fuse them.
#[allow(clippy::too_many_arguments)]
pub fn rope_write_kv_attention_unfused<B: Backend>(
    b: &B,
    q: &mut B::Buffer,
    k: &mut B::Buffer,
    v: &B::Buffer,
    table: &RopeTable<B>,
    k_cache: &mut B::KvStore,
    v_cache: &mut B::KvStore,
    shape: &AttentionShape,
    positions: &B::Index,
    scratch: &mut B::Buffer,
    out: &mut B::Buffer,
) -> Result<()> {
    let kv = shape.kv;
    b.rope_qk(
        q,
        shape.n_heads,
        k,
        kv.kv_heads,
        kv.head_dim,
        table,
        positions,
    )?;
    b.write_kv(k, v, k_cache, v_cache, kv, positions)?;
    b.attention(q, k_cache, v_cache, shape, positions, scratch, out)
}

impl AttentionShape {
    /// The checks every backend's attention makes before touching memory: head grouping,
    /// capacity, and the lengths of queries, output and both cache stores.
    pub fn check(&self, q_len: usize, out_len: usize, k_len: usize, v_len: usize) -> Result<()> {
        let s = self;
        let bad = |msg: String| {
            Err(RuntimeError::Shape {
                op: "attention",
                msg,
            })
        };
        if s.kv.head_dim == 0 {
            return bad("head_dim is 0".into());
        }
        if s.kv.kv_heads == 0 || !s.n_heads.is_multiple_of(s.kv.kv_heads) {
            return bad(format!(
                "{} query heads are not a multiple of {} KV heads",
                s.n_heads, s.kv.kv_heads
            ));
        }
        if s.past + s.n_queries > s.kv.capacity {
            return bad(format!(
                "{} positions exceed cache capacity {}",
                s.past + s.n_queries,
                s.kv.capacity
            ));
        }
        let qn = s.n_queries * s.q_dim();
        for (what, len, want) in [
            ("queries", q_len, qn),
            ("output", out_len, qn),
            ("key cache", k_len, s.kv.buffer_len()),
            ("value cache", v_len, s.kv.buffer_len()),
        ] {
            crate::error::check_len("attention", what, len, want)?;
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.kv.head_dim
    }
    /// Query heads per KV head (grouped-query attention).
    pub fn group(&self) -> usize {
        self.n_heads / self.kv.kv_heads.max(1)
    }
}

/// Ops of the decoder graph. All activations are f32 row-major `[rows, cols]` buffers; the
/// buffer length carries the row count where a parameter does not.
///
/// Every op checks the lengths it is given and returns [`crate::RuntimeError::Shape`] rather
/// than panicking, so a graph bug surfaces as a message naming the op.
///
/// Ops are asynchronous where the device is: they enqueue work in order on one stream, and
/// only `download`, `download_index`, `read_rows` and `synchronize` wait for it.
pub trait Backend: Clone + Send + Sync + Sized + 'static {
    /// An f32 activation buffer resident on the device.
    type Buffer: Send + Sync;
    /// A weight matrix `[rows, cols]` resident on the device: float (BF16 or F32) from
    /// [`Backend::upload_matrix`], or a coded format a backend builds itself (CUDA: group
    /// codes), which its projection ops then take like a float one. Cloning shares storage,
    /// which is how tied embeddings avoid a second copy.
    type Matrix: Send + Sync + Clone;
    /// u32 values on the device (token ids, positions), with a host staging area so a step
    /// graph can pick up new values without re-recording.
    type Index: Send + Sync;
    /// One layer's K or V cache storage `[kv_heads, capacity, head_dim]` of a [`KvDtype`].
    type KvStore: Send + Sync;
    /// Bytes kernels read: a KVarN layer's encoded tile records ([`KvarnLayer`]) or
    /// refinement units (KV groups, weight columns) in host memory the device reads directly.
    type ByteStore: Send + Sync;
    /// A captured sequence of ops, replayed by one launch ([`Backend::launch_graph`]).
    type Graph: Send;

    fn name(&self) -> String;
    /// [`Backend::name`] less what changes only the speed, never the results (the CPU's thread
    /// count): what a reproducible record such as a quality receipt names.
    fn numerics_name(&self) -> String {
        self.name()
    }

    /// Runs one whole forward pass. The CPU backend moves it onto a rayon worker so the ~200
    /// parallel ops of a decode step fork from inside the pool instead of handing off from an
    /// outside thread each time (measured: 9–15 % of decode time in context switches
    /// otherwise). A device backend binds its context to the calling thread.
    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    /// A zero-filled buffer of `len` f32 values.
    fn alloc(&self, len: usize) -> Result<Self::Buffer>;
    fn upload(&self, host: &[f32]) -> Result<Self::Buffer>;
    /// Copies the whole buffer to `out` (`out.len()` must equal the buffer length); waits for
    /// the work queued before it.
    fn download(&self, buf: &Self::Buffer, out: &mut [f32]) -> Result<()>;
    fn buffer_len(&self, buf: &Self::Buffer) -> usize;
    /// Overwrites the whole buffer with `host` (`host.len()` must equal its length).
    fn upload_into(&self, buf: &mut Self::Buffer, host: &[f32]) -> Result<()>;

    /// A zero-filled index buffer of `len` values.
    fn alloc_index(&self, len: usize) -> Result<Self::Index>;
    /// Sets the index buffer to `values` (ordered after the work queued before it).
    fn write_index(&self, idx: &mut Self::Index, values: &[u32]) -> Result<()> {
        self.stage_index(idx, values)?;
        self.upload_staged_index(idx)
    }
    /// Writes `values` to the host staging area only; [`Backend::upload_staged_index`] (or a
    /// replayed graph that recorded it) moves them to the device.
    fn stage_index(&self, idx: &mut Self::Index, values: &[u32]) -> Result<()>;
    /// Enqueues staging → device for the whole index buffer (recordable into a graph).
    fn upload_staged_index(&self, idx: &Self::Index) -> Result<()>;
    fn download_index(&self, idx: &Self::Index, out: &mut [u32]) -> Result<()>;

    /// Makes a 2-D checkpoint tensor resident with the given precision policy.
    fn upload_matrix(
        &self,
        name: &str,
        view: &TensorView<'_>,
        precision: WeightPrecision,
    ) -> Result<Self::Matrix>;
    /// A `[rows, cols]` matrix (BF16 or F32) of values uniform in `[-scale, scale)`, drawn
    /// element by element from [`synthetic_value`] so every backend makes the same matrix
    /// for the same seed. Synthetic models of real shapes are built from these on the device.
    fn random_matrix(
        &self,
        rows: usize,
        cols: usize,
        dtype: DType,
        seed: u64,
        scale: f32,
    ) -> Result<Self::Matrix>;
    /// `(rows, cols)`; for a linear weight that is `(out_dim, in_dim)`.
    fn matrix_dims(&self, w: &Self::Matrix) -> (usize, usize);
    fn matrix_dtype(&self, w: &Self::Matrix) -> DType;

    /// A zero-filled KV store of `len` elements.
    fn alloc_kv(&self, len: usize, dtype: KvDtype) -> Result<Self::KvStore>;
    /// A KV store holding `host` (rounded to `dtype`).
    fn upload_kv(&self, host: &[f32], dtype: KvDtype) -> Result<Self::KvStore>;
    /// Copies the whole store, widened to f32, to `out`.
    fn download_kv(&self, kv: &Self::KvStore, out: &mut [f32]) -> Result<()>;
    /// A byte store (device memory on CUDA) holding `bytes`.
    fn upload_byte_store(&self, bytes: &[u8]) -> Result<Self::ByteStore>;
    /// A zero-filled byte store of `len` bytes (device memory on CUDA).
    fn alloc_byte_store(&self, len: usize) -> Result<Self::ByteStore>;
    /// A zero-filled byte store of `len` bytes in host memory that the device's kernels read
    /// directly (page-locked and mapped on CUDA; on the CPU the same as
    /// [`Backend::alloc_byte_store`]): the backing tier of refinement — KV groups and weight
    /// columns — of which a decode step reads only the few units it selects. Written and read
    /// through [`Backend::write_byte_store`] and [`Backend::read_byte_store`].
    fn alloc_host_byte_store(&self, len: usize) -> Result<Self::ByteStore>;
    /// Copies `bytes` into `store` from byte `offset` (a tile record as its tile fills),
    /// ordered after the ops queued before it.
    fn write_byte_store(
        &self,
        store: &mut Self::ByteStore,
        offset: usize,
        bytes: &[u8],
    ) -> Result<()>;
    /// Host copy of `out.len()` bytes of `store` from byte `offset`; waits for the ops
    /// queued before it.
    fn read_byte_store(&self, store: &Self::ByteStore, offset: usize, out: &mut [u8])
        -> Result<()>;

    /// `out[t] = table[tokens[t]]` (token ids must already be checked against the vocab).
    fn embedding(
        &self,
        table: &Self::Matrix,
        tokens: &Self::Index,
        out: &mut Self::Buffer,
    ) -> Result<()>;

    /// `y[m, rows] = x[m, cols] · wᵀ (+ bias)`, stored or accumulated into `y`.
    fn matmul_t(
        &self,
        x: &Self::Buffer,
        m: usize,
        w: &Self::Matrix,
        bias: Option<&Self::Buffer>,
        y: &mut Self::Buffer,
        out: MatmulOut,
    ) -> Result<()>;

    /// Several projections of the same input (q, k, v): one launch where the device can.
    /// Items with a refinement ([`GroupItem::refine`], one row) get it added.
    fn matmul_t_group(
        &self,
        x: &Self::Buffer,
        m: usize,
        items: &mut [GroupItem<'_, Self>],
    ) -> Result<()> {
        for it in items.iter_mut() {
            self.matmul_t(x, m, it.weight, it.bias, it.out, MatmulOut::Store)?;
            if let Some(r) = &it.refine {
                let row_len = self.matrix_dims(it.weight).1;
                refine::apply_fused_columns(self, x, row_len, None, r, it.out)?;
            }
        }
        Ok(())
    }

    /// Whether this backend's launches of `w` apply a [`refine::FusedColumns`] themselves
    /// (no launch of its own). The ops take refinements either way; where this is false they
    /// add them by separate ops ([`refine::apply_fused_columns`]), which the refinement
    /// engine then prefers to schedule itself, beside the projection.
    fn fuses_refinement(&self, _w: &Self::Matrix) -> bool {
        false
    }

    /// This backend computing with its reference numerics, for a model other results are
    /// measured against (a KL reference): the CPU's f32 decode activations instead of int8
    /// blocks. Backends with one set of numerics return themselves.
    fn with_reference_numerics(&self) -> Self {
        self.clone()
    }

    /// [`Backend::matmul_t`] of one decode row with its refinement (if any) and fetch lag's
    /// contributions of earlier sets due here (`lagged`, each of `y`'s length) added — o and
    /// down, `out` accumulating into the residual stream.
    #[allow(clippy::too_many_arguments)]
    fn matmul_t_refined(
        &self,
        x: &Self::Buffer,
        m: usize,
        w: &Self::Matrix,
        bias: Option<&Self::Buffer>,
        y: &mut Self::Buffer,
        out: MatmulOut,
        refine: Option<&refine::FusedColumns<'_, Self>>,
        lagged: &[&Self::Buffer],
    ) -> Result<()> {
        self.matmul_t(x, m, w, bias, y, out)?;
        if let Some(r) = refine {
            let row_len = self.matrix_dims(w).1;
            refine::apply_fused_columns(self, x, row_len, None, r, y)?;
        }
        for l in lagged {
            self.add_assign(y, l)?;
        }
        Ok(())
    }

    /// [`Backend::rms_norm_swiglu`] of one decode row with gate's and up's refinements added
    /// before SwiGLU.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_swiglu_refined(
        &self,
        x: &Self::Buffer,
        norm: &Self::Buffer,
        eps: f32,
        normed: &mut Self::Buffer,
        m: usize,
        w_gate: &Self::Matrix,
        w_up: &Self::Matrix,
        gate: &mut Self::Buffer,
        up: &mut Self::Buffer,
        refine: [&refine::FusedColumns<'_, Self>; 2],
    ) -> Result<()> {
        refine::swiglu_refined_by_ops(
            self, x, norm, eps, normed, m, w_gate, w_up, gate, up, refine,
        )
    }

    /// SwiGLU MLP input: `gate ← silu(x·w_gateᵀ) ⊙ (x·w_upᵀ)`; `up` is scratch (its contents
    /// are unspecified afterwards).
    fn matmul_t_swiglu(
        &self,
        x: &Self::Buffer,
        m: usize,
        w_gate: &Self::Matrix,
        w_up: &Self::Matrix,
        gate: &mut Self::Buffer,
        up: &mut Self::Buffer,
    ) -> Result<()> {
        self.matmul_t(x, m, w_gate, None, gate, MatmulOut::Store)?;
        self.matmul_t(x, m, w_up, None, up, MatmulOut::Store)?;
        self.silu_mul(gate, up)
    }

    /// `items[i].out = rms_norm(x; norm) · W_iᵀ (+ b_i)`: the pre-attention norm and the
    /// q/k/v projections (or the final norm and the head). `normed` is scratch of `x`'s size
    /// that receives the normalised rows where a backend materialises them (the default);
    /// a device that fuses the norm into the projection leaves it unspecified.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_matmul_group(
        &self,
        x: &Self::Buffer,
        norm: &Self::Buffer,
        eps: f32,
        normed: &mut Self::Buffer,
        m: usize,
        items: &mut [GroupItem<'_, Self>],
    ) -> Result<()> {
        self.rms_norm(x, norm, eps, normed)?;
        self.matmul_t_group(normed, m, items)
    }

    /// [`Backend::matmul_t_swiglu`] of `rms_norm(x; norm)` (the MLP's norm fused in), with
    /// `normed` as in [`Backend::rms_norm_matmul_group`].
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_swiglu(
        &self,
        x: &Self::Buffer,
        norm: &Self::Buffer,
        eps: f32,
        normed: &mut Self::Buffer,
        m: usize,
        w_gate: &Self::Matrix,
        w_up: &Self::Matrix,
        gate: &mut Self::Buffer,
        up: &mut Self::Buffer,
    ) -> Result<()> {
        self.rms_norm(x, norm, eps, normed)?;
        self.matmul_t_swiglu(normed, m, w_gate, w_up, gate, up)
    }

    /// Row-wise RMSNorm (Zhang & Sennrich 2019, eq. 4): `out = x / sqrt(mean(x²) + eps) · w`;
    /// the row length is `weight`'s length.
    fn rms_norm(
        &self,
        x: &Self::Buffer,
        weight: &Self::Buffer,
        eps: f32,
        out: &mut Self::Buffer,
    ) -> Result<()>;
    /// In-place RMSNorm (Qwen3's per-head q/k norm: rows are heads).
    fn rms_norm_in_place(
        &self,
        x: &mut Self::Buffer,
        weight: &Self::Buffer,
        eps: f32,
    ) -> Result<()>;

    /// Rotary embedding, Hugging Face "rotate_half" pairing (i, i + head_dim/2), on
    /// `x[n_tokens, n_heads * head_dim]`; token `t` is rotated by the angles of position
    /// `positions[t]` (rows of `table`).
    fn rope(
        &self,
        x: &mut Self::Buffer,
        n_heads: usize,
        head_dim: usize,
        table: &RopeTable<Self>,
        positions: &Self::Index,
    ) -> Result<()>;

    /// [`Backend::rope`] of queries (`n_heads`) and keys (`kv_heads`) at the same positions:
    /// one launch where the device can.
    #[allow(clippy::too_many_arguments)]
    fn rope_qk(
        &self,
        q: &mut Self::Buffer,
        n_heads: usize,
        k: &mut Self::Buffer,
        kv_heads: usize,
        head_dim: usize,
        table: &RopeTable<Self>,
        positions: &Self::Index,
    ) -> Result<()> {
        self.rope(q, n_heads, head_dim, table, positions)?;
        self.rope(k, kv_heads, head_dim, table, positions)
    }

    /// Scatters `k[n, kv_heads * head_dim]` and `v` (token-major, as the projections produce
    /// them) into `[kv_heads, capacity, head_dim]` stores at rows `positions[t]`.
    fn write_kv(
        &self,
        k: &Self::Buffer,
        v: &Self::Buffer,
        k_cache: &mut Self::KvStore,
        v_cache: &mut Self::KvStore,
        layout: KvLayout,
        positions: &Self::Index,
    ) -> Result<()>;

    /// f32 elements of scratch that [`Backend::attention`] needs for caches of `layout`
    /// (split-K partial results); allocated once with the cache.
    fn attention_scratch_len(&self, _layout: KvLayout, _n_heads: usize) -> usize {
        0
    }

    /// Causal grouped-query attention of `q[n_queries, n_heads * head_dim]` over cache
    /// stores already holding every position up to each query's own (`positions[t]`);
    /// softmax scale 1/√head_dim.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Buffer,
        k_cache: &Self::KvStore,
        v_cache: &Self::KvStore,
        shape: &AttentionShape,
        positions: &Self::Index,
        scratch: &mut Self::Buffer,
        out: &mut Self::Buffer,
    ) -> Result<()>;

    /// Rotates every row of `row_len` values (a power of two, at most
    /// [`kvarn::HADAMARD_MAX_ROW`]) in place by the normalised Sylvester Hadamard matrix
    /// H/√row_len — the KVarN code frame of a head vector, and its own inverse. The butterflies
    /// run in increasing span, each sum and difference rounded, then the scale: every backend
    /// rounds as the CPU's transform does.
    fn hadamard_rows(&self, x: &mut Self::Buffer, row_len: usize) -> Result<()>;

    /// Decode attention of one token's `n_heads` query heads (`q[n_heads · head_dim]`, in
    /// the code frame; the op scales each element by 1/√head_dim as it reads it, one f32
    /// rounding, as the host cache does) over every stored position of a
    /// KVarN layer (sinks, then the encoded tiles, then the tail); `out` receives the outputs
    /// in the code frame. `scratch` holds [`Backend::kvarn_scratch_len`] elements (split-K
    /// partials of devices that split the positions). Tiles are read as stored: a key is `(code·A + Z)·B` with A and Z
    /// per channel and B per token, a value the same with A and Z per token and B per channel.
    ///
    /// With `shape.refine` (and `layer.units`), eq. 7 and 8 follow: each tile group's score
    /// is the largest, over the KV head's query heads, of its tokens' summed attention
    /// weights; the top fraction of groups per KV head (ties to the lower group) have their
    /// keys and values refined from their units (code + sub-interval centre) and the
    /// output corrected by the change of their weights and values (the host cache's
    /// `attend_head`).
    fn kvarn_attention(
        &self,
        q: &Self::Buffer,
        layer: &KvarnLayer<'_, Self>,
        shape: &KvarnShape,
        scratch: &mut Self::Buffer,
        out: &mut Self::Buffer,
    ) -> Result<()>;

    /// One decode step of a KVarN layer at the position `positions[0]` (read on the device,
    /// so a captured step replays at the next position): rotates `k` and `v` (`[kv_heads ·
    /// head_dim]`, model frame) into the code frame and writes them, FP16, to the sink or
    /// tail row [`KvarnShape::decode_at`] names; rotates `q` and attends as
    /// [`Backend::kvarn_attention`] over the layer that position sees; writes the output
    /// rotated back to the model frame into `out`. `shape` gives the geometry and
    /// capacities; its fill counts are ignored (they follow from the position). `scratch`
    /// holds [`Backend::kvarn_decode_scratch_len`] elements. The default composes the
    /// separate ops; a device may fuse them.
    #[allow(clippy::too_many_arguments)]
    fn kvarn_decode(
        &self,
        q: &Self::Buffer,
        k: &Self::Buffer,
        v: &Self::Buffer,
        layer: KvarnLayerMut<'_, Self>,
        shape: &KvarnShape,
        positions: &Self::Index,
        scratch: &mut Self::Buffer,
        out: &mut Self::Buffer,
    ) -> Result<()> {
        kvarn::kvarn_decode_unfused(self, q, k, v, layer, shape, positions, scratch, out)
    }

    /// f32 elements of scratch [`Backend::kvarn_decode`] needs for layers of `shape`'s
    /// capacities.
    fn kvarn_decode_scratch_len(&self, shape: &KvarnShape) -> usize {
        shape.n_heads * shape.head_dim + self.kvarn_scratch_len(shape)
    }

    /// f32 elements of scratch [`Backend::kvarn_attention`] needs for layers of `shape`'s
    /// capacities (split-K partials); at least 1.
    fn kvarn_scratch_len(&self, _shape: &KvarnShape) -> usize {
        1
    }

    /// One decode step's attention block after the projections: [`Backend::rope_qk`] of `q`
    /// and `k` at `positions`, [`Backend::write_kv`] of the rotated keys and `v`, then
    /// [`Backend::attention`] of the rotated queries. A device may do all three in one launch
    /// (the attention blocks rotate as they read and write the rows they attend to), so `q`
    /// and `k` hold unspecified values afterwards.
    #[allow(clippy::too_many_arguments)]
    fn rope_write_kv_attention(
        &self,
        q: &mut Self::Buffer,
        k: &mut Self::Buffer,
        v: &Self::Buffer,
        table: &RopeTable<Self>,
        k_cache: &mut Self::KvStore,
        v_cache: &mut Self::KvStore,
        shape: &AttentionShape,
        positions: &Self::Index,
        scratch: &mut Self::Buffer,
        out: &mut Self::Buffer,
    ) -> Result<()> {
        rope_write_kv_attention_unfused(
            self, q, k, v, table, k_cache, v_cache, shape, positions, scratch, out,
        )
    }

    /// SwiGLU (Shazeer 2020): `gate ← silu(gate) ⊙ up`.
    fn silu_mul(&self, gate: &mut Self::Buffer, up: &Self::Buffer) -> Result<()>;

    /// Residual add: `acc += x`.
    fn add_assign(&self, acc: &mut Self::Buffer, x: &Self::Buffer) -> Result<()>;

    /// Index of the largest value of each `cols`-wide row of `x` (ties: the lowest index, as
    /// `torch.argmax`) into `out` (one per row): greedy decoding without downloading logits.
    fn argmax_rows(&self, x: &Self::Buffer, cols: usize, out: &mut Self::Index) -> Result<()>;

    /// Host copy of rows `first..first + out.len() / row_len` of `src[_, row_len]`. The
    /// refinement engine's selection and neuron-bundle math read activations through this
    /// (one token row at decode: a few KB).
    fn read_rows(
        &self,
        src: &Self::Buffer,
        row_len: usize,
        first: usize,
        out: &mut [f32],
    ) -> Result<()>;

    /// The refinement accumulate of docs/method.md eq. 2 / 6:
    /// `y[row, e] += Σ_j weights[j] · level_j[e] · scales[e]` for `e < row_len`, where unit
    /// `j` is the `unit_bytes` bytes at `units[j · unit_bytes..]` holding 4-bit levels as
    /// `nibble − 8`, element `e` in byte `e / 2`, low nibble first (docs/format.md,
    /// `column_nibbles`). `scales` has `row_len` entries (per output row of the projection).
    #[allow(clippy::too_many_arguments)]
    fn add_nibble_units(
        &self,
        y: &mut Self::Buffer,
        row_len: usize,
        row: usize,
        units: &[u8],
        unit_bytes: usize,
        weights: &[f32],
        scales: &[f32],
    ) -> Result<()>;

    /// Channel selection S(x) (docs/method.md §2) of every row of `x[rows, row_len]` — of
    /// `rms_norm(x; w)` when `norm` gives `(w, eps)`, normalised as [`Backend::rms_norm`]
    /// does, so a projection whose norm is fused into its matvec need not write its input:
    /// the indices of the `chunk_budget(k, len)` largest |x_i| of each 1024-channel chunk
    /// (ties to the lower index; a NaN above every number), ascending, written to
    /// `sel[row · selected_count(k, row_len)..]` with their values at the same places of
    /// `values` — the order and tie rule of [`crate::refine::select::select_top_k`], so both
    /// backends select the same channels.
    fn select_channels(
        &self,
        x: &Self::Buffer,
        row_len: usize,
        norm: Option<(&Self::Buffer, f32)>,
        k_per_1024: usize,
        sel: &mut Self::Index,
        values: &mut Self::Buffer,
    ) -> Result<()>;

    /// f32 elements of scratch [`Backend::add_selected_columns`] needs for `rows` rows of
    /// `selected` channels into outputs of `out_dims` rows (split partial sums); 0 where the
    /// backend needs none. One scratch of the largest of these lengths serves launches of
    /// every shape in turn (the refinement engine keeps one for all of a step's sets).
    fn selected_columns_scratch_len(
        &self,
        _rows: usize,
        _selected: usize,
        _out_dims: &[usize],
    ) -> usize {
        0
    }

    /// The refinement accumulate of docs/method.md eq. 2 for up to three projections of one input
    /// (q, k, v; gate, up): for every row `r < rows` and every target,
    /// `out[r, e] += scales[e] · Σ_j v_j · level(C[:, i_j])[e]` over the `selected` channels
    /// `i_j = sel[r · selected + j]` with values `v_j = values[r · selected + j]`
    /// ([`Backend::select_channels`]'s output), where column `i` is the `unit_bytes` bytes at
    /// `offset + i · unit_bytes` of the target's store ([`refine::ColumnTarget`]). Only the
    /// selected columns are read, each in one piece; an index of `row_len` or more names no
    /// column and is skipped. `scratch` has
    /// [`Backend::selected_columns_scratch_len`] elements, zero before the first call (the
    /// op leaves it so).
    #[allow(clippy::too_many_arguments)]
    fn add_selected_columns(
        &self,
        rows: usize,
        row_len: usize,
        sel: &Self::Index,
        values: &Self::Buffer,
        selected: usize,
        targets: &mut [refine::ColumnTarget<'_, Self>],
        scratch: &mut Self::Buffer,
    ) -> Result<()>;

    /// Fetch lead's staging (docs/method.md §3) for up to [`refine::MAX_COLUMN_TARGETS`]
    /// projections of one input in one call: for every target, row `r < rows` and
    /// `j < selected`, the `unit_bytes` bytes of column `i = sel[r · selected + j]` of its
    /// `store` (at `offset + i · unit_bytes`) copied to `(r · selected + j) · unit_bytes` of
    /// its `dst`, zeros for an index of `row_len` or more; [`Backend::add_selected_columns`]
    /// then reads them from `dst` through the identity index. On a device, `store` is host
    /// memory and `dst` device memory: the bus transfer happens here, early, and the gather
    /// reads device memory.
    fn stage_selected_units(
        &self,
        rows: usize,
        row_len: usize,
        sel: &Self::Index,
        selected: usize,
        targets: &mut [refine::StageTarget<'_, Self>],
    ) -> Result<()>;

    /// `values[r · selected + j] = x̂[r, sel[r · selected + j]]` (0 for an index of `row_len`
    /// or more), x̂ the rows of `x`, or with `norm` their RMSNorm as [`Backend::rms_norm`]
    /// computes it: fetch lead's real input at the channels chosen from an earlier stream.
    fn gather_selected_values(
        &self,
        x: &Self::Buffer,
        row_len: usize,
        norm: Option<(&Self::Buffer, f32)>,
        sel: &Self::Index,
        selected: usize,
        values: &mut Self::Buffer,
    ) -> Result<()>;

    /// Copies rows `first..first + dst_rows` of `src[_, row_len]` into `dst`
    /// (selects the positions that need logits).
    fn copy_rows(
        &self,
        src: &Self::Buffer,
        row_len: usize,
        first: usize,
        dst: &mut Self::Buffer,
    ) -> Result<()>;

    /// Waits for every op queued so far.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// Which launch configuration a decode step at context `past` gets, for backends whose
    /// kernels schedule differently at short and long context: a captured step is keyed by
    /// it, so crossing the boundary re-captures instead of replaying the other schedule.
    fn step_schedule(&self, _past: usize) -> u32 {
        0
    }

    /// Starts a branch on `lane`: the ops that follow, up to [`Backend::end_branch`], may run
    /// concurrently with the ops queued after it (a device: a stream per lane, ordered after
    /// everything queued so far and after the lane's earlier branches; captured, a parallel
    /// path of the step graph), until [`Backend::join_branch`] of one of its marks orders
    /// what follows after the branch's work up to that mark. One branch at a time; a branch
    /// may be joined long after it ended (fetch lag), within 500 later marks. Backends that
    /// run ops in order keep the defaults, which do nothing.
    fn begin_branch(&self, _lane: BranchLane) -> Result<()> {
        Ok(())
    }
    /// Inside a branch: the ops that follow wait for another branch's work up to `mark`.
    fn branch_wait(&self, _mark: BranchMark) -> Result<()> {
        Ok(())
    }
    /// Ends the running branch; returns the mark of its end.
    fn end_branch(&self) -> Result<BranchMark> {
        Ok(BranchMark(0))
    }
    /// What follows waits for the branch's ops up to `mark`.
    fn join_branch(&self, _mark: BranchMark) -> Result<()> {
        Ok(())
    }

    /// Whether selective weight refinement should run in the backend
    /// ([`crate::refine::Refiner::place_in_backend`]) rather than host-driven: true where the
    /// device reads host memory directly, so a step never waits on the host.
    fn refinement_in_backend(&self) -> bool {
        false
    }

    /// Whether [`Backend::begin_capture`] can record a step graph.
    fn supports_graphs(&self) -> bool {
        false
    }
    /// Starts recording the ops that follow (they are not executed until launched).
    fn begin_capture(&self) -> Result<()> {
        Err(RuntimeError::Unsupported(format!(
            "{}: no step graphs",
            self.name()
        )))
    }
    /// Stops recording and returns the graph (also after a failed op, so capture never
    /// stays open).
    fn end_capture(&self) -> Result<Self::Graph> {
        Err(RuntimeError::Unsupported(format!(
            "{}: no step graphs",
            self.name()
        )))
    }
    fn launch_graph(&self, _graph: &Self::Graph) -> Result<()> {
        Err(RuntimeError::Unsupported(format!(
            "{}: no step graphs",
            self.name()
        )))
    }

    /// Device time per kernel of the launches so far (and forgets them), for backends that
    /// were asked to profile (CUDA: `SFX_PROFILE_KERNELS=1`); empty otherwise.
    fn take_kernel_times(&self) -> Result<Vec<KernelTime>> {
        Ok(Vec::new())
    }

    /// Bytes of device memory in use on this backend's device (the whole device's: total less
    /// free), for backends with memory of their own, which a process's resident set does not
    /// show; `None` where the host's memory is the device's (the CPU).
    fn device_memory_in_use(&self) -> Result<Option<u64>> {
        Ok(None)
    }
}

/// Time spent in one kernel at one grid size over the profiled launches.
#[derive(Clone, Debug, serde::Serialize)]
pub struct KernelTime {
    pub kernel: String,
    pub grid: [u32; 3],
    pub launches: usize,
    pub total_us: f64,
}

/// The argument checks of [`Backend::add_nibble_units`], shared by every backend.
pub(crate) fn check_nibble_units(
    y_len: usize,
    row_len: usize,
    row: usize,
    units: usize,
    unit_bytes: usize,
    weights: usize,
    scales: usize,
) -> Result<()> {
    let bad = |msg: String| {
        Err(RuntimeError::Shape {
            op: "add_nibble_units",
            msg,
        })
    };
    if unit_bytes < row_len.div_ceil(2) || units != weights * unit_bytes {
        return bad(format!(
            "{units} bytes of units of {unit_bytes} bytes for {weights} weights and rows of \
             {row_len}"
        ));
    }
    if scales != row_len || (row + 1) * row_len > y_len {
        return bad(format!(
            "{scales} scales, row {row} of {row_len} in a buffer of {y_len}"
        ));
    }
    Ok(())
}

/// Where a branch runs: branches of one lane run in order, the two lanes independently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BranchLane {
    /// Short work the main stream joins soon (a projection's refinement beside it).
    Near,
    /// Fetch lead's staging, joined at the projection that reads it: never held up by a
    /// near branch.
    Far,
    /// Fetch lag's gathers, joined a block or more later: their own lane, so a lagged
    /// gather and a lead's staging never wait for each other.
    Lag,
}

/// A point a branch reached ([`Backend::end_branch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BranchMark(pub usize);

/// 64 synthetic random bits for element `index` of a stream drawn with `seed`: the
/// SplitMix64 hash of (seed, index). Synthetic weights ([`synthetic_value`]) and synthetic
/// low-bit codes both come from it.
#[inline]
pub fn synthetic_bits(seed: u64, index: u64) -> u64 {
    let mut z = seed
        .wrapping_add(index.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The synthetic weight of element `index` of a matrix drawn with `seed`: uniform in
/// `[-1, 1)` from [`synthetic_bits`]. The CUDA kernel computes the same function bit for bit
/// (an integer hash and one exact conversion), so a synthetic model is the same model on
/// every backend.
#[inline]
pub fn synthetic_value(seed: u64, index: u64) -> f32 {
    let z = synthetic_bits(seed, index);
    // 24 random bits → an exact f32 in [0, 1), then [-1, 1).
    ((z >> 40) as f32) * (2.0 / 16_777_216.0) - 1.0
}

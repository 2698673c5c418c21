//! The Llama-family decoder (Llama 1–3, Mistral, Qwen2, Qwen3, SmolLM) written once against
//! [`Backend`]:
//! embed → N × [RMSNorm → q,k,v (+bias) → (q/k norm) → RoPE → attention → o → residual;
//! RMSNorm → gate, up → SiLU·mul → down → residual] → RMSNorm → output head.

mod layer;
mod layerwise;
mod logits;
mod rope;

pub use layer::DecoderLayer;
pub(crate) use layer::LayerScratch;
pub use layerwise::LayerwiseRunner;
pub use logits::{Logits, LogitsMode};
pub use rope::rope_cos_sin;

use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, GroupItem, KvDtype, RopeTable, WeightPrecision};
use crate::error::{Result, RuntimeError};
use crate::kv_cache::{FloatKvCache, KvCache, KvShape};
use crate::linear::{
    check_shape, require, FloatLinearFactory, Linear, LinearFactory, LinearRole, LinearSpec,
};
use crate::observe::ActivationObserver;
use crate::refine::Refiner;
use sfx_formats::{ModelConfig, TensorSource};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Load- and run-time options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelOptions {
    /// Storage of float weights (embedding, linears). Norms and biases are always f32.
    pub precision: WeightPrecision,
    /// Longest run of tokens pushed through the graph at once; longer inputs are processed in
    /// consecutive chunks (exact for a causal model). Bounds activation memory — the MLP
    /// buffers of an 8B model are 2 × 14336 × 4 B = 115 KB per token — while 512 rows keep
    /// the GEMMs at full speed.
    pub prefill_chunk: usize,
    /// Element type of the caches [`Model::new_cache`] makes.
    pub kv_dtype: KvDtype,
    /// Capture decode steps into a graph and replay it (backends that support graphs, over
    /// caches that allow it); off runs every op as a separate launch.
    pub step_graphs: bool,
}

impl Default for ModelOptions {
    fn default() -> Self {
        Self {
            precision: WeightPrecision::Native,
            prefill_chunk: 512,
            kv_dtype: KvDtype::F32,
            step_graphs: true,
        }
    }
}

/// What the output head hands back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum HeadOut {
    Logits,
    /// The argmax token of each row, computed on the device (greedy decoding).
    Argmax,
}

/// Buffers of one chunk size, reused by every forward of that many tokens (a decode step
/// allocates nothing: its set is made once).
struct StepBuffers<B: Backend> {
    tokens: B::Index,
    positions: B::Index,
    h: B::Buffer,
    scratch: LayerScratch<B>,
    /// Per number of logit rows: selected rows, normed rows, head output, argmax ids.
    heads: HashMap<usize, HeadBuffers<B>>,
}

struct HeadBuffers<B: Backend> {
    sel: B::Buffer,
    normed: B::Buffer,
    logits: B::Buffer,
    ids: B::Index,
}

/// Identity of a captured decode step: it replays only over the same cache storage, rope
/// table and head output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct GraphKey {
    cache: u64,
    rope: u64,
    head: HeadOut,
    schedule: u32,
    /// The refinement engine's graph id (0: none).
    refine: u64,
}

/// The run-time state a forward needs besides the weights: the resident RoPE table, the
/// buffer pool, and the captured decode step.
struct StepState<B: Backend> {
    rope: RopeTable<B>,
    rope_generation: u64,
    pool: HashMap<usize, StepBuffers<B>>,
    /// Key of the last eager decode step: a step with the same key is captured.
    warm: Option<GraphKey>,
    graph: Option<(GraphKey, B::Graph)>,
}

/// Chunk sizes kept in the pool besides the decode set (n = 1).
const POOL_SIZES: usize = 4;

/// A loaded decoder on backend `B`.
pub struct Model<B: Backend = CpuBackend> {
    config: ModelConfig,
    backend: B,
    /// The token table, read by row gathers; a tied head is the same linear.
    embed: Arc<dyn Linear<B>>,
    layers: Vec<DecoderLayer<B>>,
    final_norm: B::Buffer,
    lm_head: Box<dyn Linear<B>>,
    inv_freq: Vec<f32>,
    eps: f32,
    prefill_chunk: usize,
    kv_dtype: KvDtype,
    step_graphs: bool,
    state: Mutex<StepState<B>>,
}

impl<B: Backend> Model<B> {
    /// Loads float weights (`options.precision`) from Hugging Face-named tensors.
    pub fn load(
        backend: B,
        config: &ModelConfig,
        tensors: &dyn TensorSource,
        options: &ModelOptions,
    ) -> Result<Self> {
        let factory = FloatLinearFactory {
            precision: options.precision,
        };
        Self::load_with(backend, config, tensors, &factory, options)
    }

    /// Loads with every projection, the embedding and an untied output head built by
    /// `factory` (a float factory keeps the embedding at `options.precision`).
    pub fn load_with(
        backend: B,
        config: &ModelConfig,
        tensors: &dyn TensorSource,
        factory: &dyn LinearFactory<B>,
        options: &ModelOptions,
    ) -> Result<Self> {
        validate_config(config)?;
        if options.prefill_chunk == 0 {
            return Err(RuntimeError::Config(
                "prefill_chunk must be at least 1".into(),
            ));
        }
        let c = config;
        let embed_name = "model.embed_tokens.weight";
        let embed = factory.load_embedding(
            &backend,
            tensors,
            &LinearSpec {
                layer: None,
                role: LinearRole::Embedding,
                weight_name: embed_name,
                bias_name: None,
                out_dim: c.vocab_size,
                in_dim: c.hidden_size,
            },
            options.precision,
        )?;

        let layers = (0..c.num_hidden_layers)
            .map(|i| DecoderLayer::load(&backend, c, tensors, factory, i))
            .collect::<Result<Vec<_>>>()?;

        let norm_name = "model.norm.weight";
        let view = require(tensors, norm_name, "final RMSNorm")?;
        check_shape(norm_name, view.shape, &[c.hidden_size])?;
        let final_norm = backend.upload(&view.to_f32_vec())?;

        let head_spec = |weight_name| LinearSpec {
            layer: None,
            role: LinearRole::LmHead,
            weight_name,
            bias_name: None,
            out_dim: c.vocab_size,
            in_dim: c.hidden_size,
        };
        let lm_head = if c.tie_word_embeddings {
            factory.tied_lm_head(&backend, &embed, &head_spec(embed_name))?
        } else {
            if !tensors.contains("lm_head.weight") {
                return Err(RuntimeError::MissingTensor {
                    name: "lm_head.weight".into(),
                    why: "output head; config.json has tie_word_embeddings = false".into(),
                });
            }
            factory.load(&backend, tensors, &head_spec("lm_head.weight"))?
        };

        Self::assemble(backend, c, embed, layers, final_norm, lm_head, options)
    }

    /// A model from resident parts (loaders and synthetic models end here).
    pub(crate) fn assemble(
        backend: B,
        c: &ModelConfig,
        embed: Arc<dyn Linear<B>>,
        layers: Vec<DecoderLayer<B>>,
        final_norm: B::Buffer,
        lm_head: Box<dyn Linear<B>>,
        options: &ModelOptions,
    ) -> Result<Self> {
        let inv_freq: Vec<f32> = c.rope_inv_freq().iter().map(|&f| f as f32).collect();
        let rope = build_rope(&backend, &inv_freq, 0)?;
        Ok(Self {
            inv_freq,
            eps: c.rms_norm_eps as f32,
            config: c.clone(),
            embed,
            layers,
            final_norm,
            lm_head,
            prefill_chunk: options.prefill_chunk,
            kv_dtype: options.kv_dtype,
            step_graphs: options.step_graphs,
            state: Mutex::new(StepState {
                rope,
                rope_generation: 0,
                pool: HashMap::new(),
                warm: None,
                graph: None,
            }),
            backend,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn layers(&self) -> &[DecoderLayer<B>] {
        &self.layers
    }

    pub fn lm_head(&self) -> &dyn Linear<B> {
        &*self.lm_head
    }

    pub fn embedding(&self) -> &dyn Linear<B> {
        &*self.embed
    }

    /// Bytes of weights resident on the device. A tied head shares the embedding and is
    /// counted once.
    pub fn resident_bytes(&self) -> usize {
        let embed = self.embed.resident_bytes();
        let layers: usize = self
            .layers
            .iter()
            .flat_map(|l| l.linears().map(|(_, lin)| lin.resident_bytes()))
            .sum();
        let head = if self.config.tie_word_embeddings {
            0
        } else {
            self.lm_head.resident_bytes()
        };
        embed + layers + head
    }

    /// A float KV cache for up to `capacity` positions, of the model's KV dtype.
    pub fn new_cache(&self, capacity: usize) -> Result<FloatKvCache<B>> {
        self.new_cache_with(capacity, self.kv_dtype)
    }

    pub fn new_cache_with(&self, capacity: usize, dtype: KvDtype) -> Result<FloatKvCache<B>> {
        FloatKvCache::with_dtype(&self.backend, KvShape::of(&self.config), capacity, dtype)
    }

    /// Whether decode steps are captured into graphs on this backend.
    pub fn uses_step_graphs(&self) -> bool {
        self.step_graphs && self.backend.supports_graphs()
    }

    /// Turns step graphs on or off (benchmarks measure both); drops a captured graph.
    pub fn set_step_graphs(&mut self, on: bool) {
        self.step_graphs = on;
        if let Ok(st) = self.state.get_mut() {
            st.graph = None;
            st.warm = None;
        }
    }

    /// Runs `tokens` (appended after the cache's positions) through the model, stores their
    /// keys/values in `cache`, and returns logits for the positions `mode` selects.
    ///
    /// Inputs longer than `prefill_chunk` run in chunks. On error the cache keeps the
    /// positions of the chunks that completed.
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut dyn KvCache<B>,
        mode: LogitsMode,
    ) -> Result<Logits> {
        self.forward_inner(tokens, cache, mode, HeadOut::Logits, None, None)?
            .into_logits()
    }

    /// Greedy decoding: runs `tokens` like [`Model::forward`] and returns the most probable
    /// next token after the last one, chosen on the device (only its id is downloaded).
    pub fn forward_greedy(&self, tokens: &[u32], cache: &mut dyn KvCache<B>) -> Result<u32> {
        self.forward_greedy_with(tokens, cache, None)
    }

    /// [`Model::forward_greedy`] with selective refinement when `refiner` is given.
    pub fn forward_greedy_with(
        &self,
        tokens: &[u32],
        cache: &mut dyn KvCache<B>,
        refiner: Option<&mut Refiner<B>>,
    ) -> Result<u32> {
        let out = self.forward_inner(
            tokens,
            cache,
            LogitsMode::Last,
            HeadOut::Argmax,
            None,
            refiner,
        )?;
        match out {
            HeadResult::Ids(ids) => ids.last().copied().ok_or(RuntimeError::EmptyInput),
            HeadResult::Logits(..) => Err(RuntimeError::EmptyInput),
        }
    }

    /// [`Model::forward`] with selective refinement: `refiner` adds the fetched refinement
    /// of each token's selected channels (docs/method.md §2–3).
    pub fn forward_refined(
        &self,
        tokens: &[u32],
        cache: &mut dyn KvCache<B>,
        mode: LogitsMode,
        refiner: &mut Refiner<B>,
    ) -> Result<Logits> {
        self.forward_inner(tokens, cache, mode, HeadOut::Logits, None, Some(refiner))?
            .into_logits()
    }

    /// [`Model::forward`] that also hands every projection set's input to `observer`
    /// (downloaded to the host; see [`crate::observe`]).
    pub fn forward_observed(
        &self,
        tokens: &[u32],
        cache: &mut dyn KvCache<B>,
        mode: LogitsMode,
        observer: &mut dyn ActivationObserver,
    ) -> Result<Logits> {
        self.forward_inner(tokens, cache, mode, HeadOut::Logits, Some(observer), None)?
            .into_logits()
    }

    fn forward_inner(
        &self,
        tokens: &[u32],
        cache: &mut dyn KvCache<B>,
        mode: LogitsMode,
        head: HeadOut,
        observer: Option<&mut dyn ActivationObserver>,
        refiner: Option<&mut Refiner<B>>,
    ) -> Result<HeadResult> {
        if tokens.is_empty() {
            return Err(RuntimeError::EmptyInput);
        }
        let vocab = self.config.vocab_size;
        if let Some(index) = tokens.iter().position(|&t| t as usize >= vocab) {
            return Err(RuntimeError::TokenOutOfRange {
                token: tokens[index],
                index,
                vocab,
            });
        }
        let want = KvShape::of(&self.config);
        if cache.shape() != want {
            return Err(RuntimeError::CacheMismatch(format!(
                "cache is {:?}, model needs {:?}",
                cache.shape(),
                want
            )));
        }
        if cache.len() + tokens.len() > cache.capacity() {
            return Err(RuntimeError::CacheFull {
                cached: cache.len(),
                new: tokens.len(),
                capacity: cache.capacity(),
            });
        }

        let refiner = refiner.filter(|r| !r.selects_nothing());
        self.backend
            .run(|| self.forward_checked(tokens, cache, mode, head, observer, refiner))
    }

    fn forward_checked(
        &self,
        tokens: &[u32],
        cache: &mut dyn KvCache<B>,
        mode: LogitsMode,
        head: HeadOut,
        mut observer: Option<&mut dyn ActivationObserver>,
        mut refiner: Option<&mut Refiner<B>>,
    ) -> Result<HeadResult> {
        let vocab = self.config.vocab_size;
        let n = tokens.len();
        let rows = mode.rows(n);
        let first_row = n - rows;
        let first_position = cache.len() + first_row;
        let mut state = self
            .state
            .lock()
            .map_err(|_| RuntimeError::Unsupported("model state poisoned by a panic".into()))?;
        let st = &mut *state;
        self.ensure_rope(st, cache.len() + n)?;
        let mut out = HeadResult::empty(head, rows, vocab, first_position);
        let mut start = 0;
        for chunk in tokens.chunks(self.prefill_chunk) {
            let end = start + chunk.len();
            // Rows of this chunk that fall in the selected tail.
            let chunk_rows = end - first_row.clamp(start, end);
            // A refinement engine in the backend never waits on the host: its steps capture.
            let graphable = chunk.len() == 1
                && chunk_rows == 1
                && observer.is_none()
                && refiner.as_deref().is_none_or(|r| r.graph_id().is_some())
                && self.uses_step_graphs()
                && cache.graph_id().is_some();
            if graphable {
                self.decode_step(st, chunk[0], cache, head, &mut refiner)?;
            } else {
                self.forward_chunk(
                    st,
                    chunk,
                    cache,
                    chunk_rows,
                    head,
                    &mut observer,
                    &mut refiner,
                )?;
            }
            if chunk_rows > 0 {
                self.collect(st, chunk.len(), chunk_rows, &mut out)?;
            }
            start = end;
        }
        Ok(out)
    }

    /// Makes sure the RoPE table covers positions `0..needed` (grown to a power of two, so a
    /// long generation rebuilds it a handful of times; each rebuild retires the step graph).
    fn ensure_rope(&self, st: &mut StepState<B>, needed: usize) -> Result<()> {
        if needed <= st.rope.positions {
            return Ok(());
        }
        let positions = needed.next_power_of_two().max(1024);
        st.rope = build_rope(&self.backend, &self.inv_freq, positions)?;
        st.rope_generation += 1;
        Ok(())
    }

    /// The buffer set for chunks of `n` tokens, made on first use.
    fn buffers<'s>(
        &self,
        pool: &'s mut HashMap<usize, StepBuffers<B>>,
        n: usize,
    ) -> Result<&'s mut StepBuffers<B>> {
        if !pool.contains_key(&n) {
            // The decode set stays: a captured step graph points into it.
            if pool.len() > POOL_SIZES {
                if let Some(&victim) = pool.keys().find(|&&k| k != 1) {
                    pool.remove(&victim);
                }
            }
            let b = &self.backend;
            let set = StepBuffers {
                tokens: b.alloc_index(n)?,
                positions: b.alloc_index(n)?,
                h: b.alloc(n * self.config.hidden_size)?,
                scratch: LayerScratch::new(b, &self.config, n)?,
                heads: HashMap::new(),
            };
            pool.insert(n, set);
        }
        pool.get_mut(&n)
            .ok_or_else(|| RuntimeError::Unsupported("buffer pool lost a set".into()))
    }

    /// One pass of `tokens` through the graph (ops enqueued, cache committed).
    #[allow(clippy::too_many_arguments)]
    fn forward_chunk(
        &self,
        st: &mut StepState<B>,
        tokens: &[u32],
        cache: &mut dyn KvCache<B>,
        logit_rows: usize,
        head: HeadOut,
        observer: &mut Option<&mut dyn ActivationObserver>,
        refiner: &mut Option<&mut Refiner<B>>,
    ) -> Result<()> {
        let b = &self.backend;
        let n = tokens.len();
        let past = cache.len();
        let StepState { rope, pool, .. } = st;
        let bufs = self.buffers(pool, n)?;
        let positions: Vec<u32> = (past..past + n).map(|p| p as u32).collect();
        b.write_index(&mut bufs.tokens, tokens)?;
        b.write_index(&mut bufs.positions, &positions)?;
        self.enqueue_chunk(bufs, rope, n, cache, logit_rows, head, observer, refiner)?;
        cache.commit(n)
    }

    /// One decode step: replays the captured graph when its key matches, captures it when an
    /// eager step with the same key ran before (so every buffer it touches exists), and runs
    /// eagerly otherwise.
    fn decode_step(
        &self,
        st: &mut StepState<B>,
        token: u32,
        cache: &mut dyn KvCache<B>,
        head: HeadOut,
        refiner: &mut Option<&mut Refiner<B>>,
    ) -> Result<()> {
        let b = &self.backend;
        let key = GraphKey {
            cache: cache.graph_id().unwrap_or(0),
            rope: st.rope_generation,
            head,
            schedule: b.step_schedule(cache.len()),
            refine: refiner.as_deref().and_then(Refiner::graph_id).unwrap_or(0),
        };
        let pos = cache.len() as u32;
        let StepState {
            rope,
            pool,
            warm,
            graph,
            ..
        } = st;
        let bufs = self.buffers(pool, 1)?;
        b.stage_index(&mut bufs.tokens, &[token])?;
        b.stage_index(&mut bufs.positions, &[pos])?;
        match graph {
            Some((k, g)) if *k == key => {
                // The replayed ops are the engine's; its host-side count is not.
                if let Some(r) = refiner.as_deref_mut() {
                    r.begin_chunk(1);
                }
                b.launch_graph(g)?
            }
            _ if *warm == Some(key) => {
                *graph = None;
                b.begin_capture()?;
                let recorded = self.enqueue_staged(bufs, rope, cache, head, refiner);
                let captured = b.end_capture();
                recorded?;
                let g = captured?;
                b.launch_graph(&g)?;
                *graph = Some((key, g));
            }
            _ => {
                self.enqueue_staged(bufs, rope, cache, head, refiner)?;
                *warm = Some(key);
            }
        }
        cache.commit(1)
    }

    /// The decode step's ops: staged token and position uploads, then the chunk.
    fn enqueue_staged(
        &self,
        bufs: &mut StepBuffers<B>,
        rope: &RopeTable<B>,
        cache: &mut dyn KvCache<B>,
        head: HeadOut,
        refiner: &mut Option<&mut Refiner<B>>,
    ) -> Result<()> {
        let b = &self.backend;
        b.upload_staged_index(&bufs.tokens)?;
        b.upload_staged_index(&bufs.positions)?;
        self.enqueue_chunk(bufs, rope, 1, cache, 1, head, &mut None, refiner)
    }

    /// Enqueues the whole graph for `n` tokens whose ids and positions are in `bufs`.
    #[allow(clippy::too_many_arguments)]
    fn enqueue_chunk(
        &self,
        bufs: &mut StepBuffers<B>,
        rope: &RopeTable<B>,
        n: usize,
        cache: &mut dyn KvCache<B>,
        logit_rows: usize,
        head: HeadOut,
        observer: &mut Option<&mut dyn ActivationObserver>,
        refiner: &mut Option<&mut Refiner<B>>,
    ) -> Result<()> {
        let b = &self.backend;
        let c = &self.config;
        let hidden = c.hidden_size;
        let StepBuffers {
            tokens,
            positions,
            h,
            scratch,
            heads,
        } = bufs;
        self.embed.gather_rows(b, tokens, h)?;
        if let Some(r) = refiner.as_deref_mut() {
            r.begin_chunk(n);
            r.at_stream(b, 0, h)?;
        }
        for (li, l) in self.layers.iter().enumerate() {
            l.forward(
                b, c, self.eps, rope, positions, h, n, scratch, cache, li, li, observer, refiner,
            )?;
        }
        if let Some(r) = refiner.as_deref_mut() {
            r.finish_chunk(b, h)?;
        }
        if logit_rows == 0 {
            return Ok(());
        }
        let hb = match heads.entry(logit_rows) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(HeadBuffers {
                sel: b.alloc(logit_rows * hidden)?,
                normed: b.alloc(logit_rows * hidden)?,
                logits: b.alloc(logit_rows * c.vocab_size)?,
                ids: b.alloc_index(logit_rows)?,
            }),
        };
        let rows_in: &B::Buffer = if logit_rows == n {
            h
        } else {
            b.copy_rows(h, hidden, n - logit_rows, &mut hb.sel)?;
            &hb.sel
        };
        match self.lm_head.matrix_parts() {
            // The final norm fuses into a head held as a backend matrix.
            Some((w, bias)) => {
                let items = &mut [GroupItem::new(w, bias, &mut hb.logits)];
                b.rms_norm_matmul_group(
                    rows_in,
                    &self.final_norm,
                    self.eps,
                    &mut hb.normed,
                    logit_rows,
                    items,
                )?;
            }
            None => {
                b.rms_norm(rows_in, &self.final_norm, self.eps, &mut hb.normed)?;
                self.lm_head
                    .forward(b, &hb.normed, logit_rows, &mut hb.logits)?;
            }
        }
        if head == HeadOut::Argmax {
            b.argmax_rows(&hb.logits, c.vocab_size, &mut hb.ids)?;
        }
        Ok(())
    }

    /// Downloads the head output of the last chunk (of `n` tokens, `rows` logit rows).
    fn collect(
        &self,
        st: &mut StepState<B>,
        n: usize,
        rows: usize,
        out: &mut HeadResult,
    ) -> Result<()> {
        let b = &self.backend;
        let hb = st
            .pool
            .get(&n)
            .and_then(|set| set.heads.get(&rows))
            .ok_or_else(|| RuntimeError::Unsupported("head buffers missing".into()))?;
        match out {
            HeadResult::Logits(v, _) => {
                let at = v.len();
                v.resize(at + rows * self.config.vocab_size, 0.0);
                b.download(&hb.logits, &mut v[at..])
            }
            HeadResult::Ids(v) => {
                let at = v.len();
                v.resize(at + rows, 0);
                b.download_index(&hb.ids, &mut v[at..])
            }
        }
    }
}

/// A forward's output: logits (with the first position they belong to) or argmax ids.
enum HeadResult {
    Logits(Vec<f32>, LogitsMeta),
    Ids(Vec<u32>),
}

#[derive(Clone, Copy)]
struct LogitsMeta {
    vocab: usize,
    first_position: usize,
}

impl HeadResult {
    fn empty(head: HeadOut, rows: usize, vocab: usize, first_position: usize) -> Self {
        match head {
            HeadOut::Logits => HeadResult::Logits(
                Vec::with_capacity(rows * vocab),
                LogitsMeta {
                    vocab,
                    first_position,
                },
            ),
            HeadOut::Argmax => HeadResult::Ids(Vec::with_capacity(rows)),
        }
    }

    fn into_logits(self) -> Result<Logits> {
        match self {
            HeadResult::Logits(v, m) => Ok(Logits::new(v, m.vocab, m.first_position)),
            HeadResult::Ids(_) => Err(RuntimeError::Unsupported(
                "argmax output where logits were asked for".into(),
            )),
        }
    }
}

/// The resident RoPE table for positions `0..positions`.
fn build_rope<B: Backend>(b: &B, inv_freq: &[f32], positions: usize) -> Result<RopeTable<B>> {
    let (cos, sin) = rope_cos_sin(inv_freq, 0, positions);
    // A zero-position table still needs a (one-element) buffer on every backend.
    let pad = |v: Vec<f32>| if v.is_empty() { vec![0.0] } else { v };
    Ok(RopeTable {
        cos: b.upload(&pad(cos))?,
        sin: b.upload(&pad(sin))?,
        positions,
        half: inv_freq.len(),
    })
}

impl Model<CpuBackend> {
    /// Loads onto the CPU backend with the best SIMD tier of this machine.
    pub fn load_cpu(
        config: &ModelConfig,
        tensors: &dyn TensorSource,
        options: &ModelOptions,
    ) -> Result<Self> {
        Self::load(CpuBackend::new(), config, tensors, options)
    }
}

/// Rejects configs the graph cannot run (ModelConfig's fields are public, so a hand-built one
/// has not necessarily been through the config.json checks).
/// The structural checks every graph over a `ModelConfig` needs (dimensions, head grouping,
/// RoPE pairing, token-id range); `Model::load_with` and YAQA's autograd graph both run them.
pub fn validate_config(c: &ModelConfig) -> Result<()> {
    let bad = |msg: String| Err(RuntimeError::Config(msg));
    if c.hidden_size == 0 || c.intermediate_size == 0 || c.vocab_size == 0 || c.head_dim == 0 {
        return bad(format!(
            "zero dimension (hidden_size {}, intermediate_size {}, vocab_size {}, head_dim {})",
            c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
        ));
    }
    if c.num_attention_heads == 0 || c.num_key_value_heads == 0 {
        return bad("num_attention_heads and num_key_value_heads must be at least 1".into());
    }
    if !c.num_attention_heads.is_multiple_of(c.num_key_value_heads) {
        return bad(format!(
            "num_attention_heads {} is not a multiple of num_key_value_heads {}",
            c.num_attention_heads, c.num_key_value_heads
        ));
    }
    if !c.head_dim.is_multiple_of(2) {
        return bad(format!(
            "head_dim {} is odd; RoPE pairs dimensions",
            c.head_dim
        ));
    }
    if u32::try_from(c.vocab_size).is_err() {
        return bad(format!(
            "vocab_size {} does not fit token ids (u32)",
            c.vocab_size
        ));
    }
    Ok(())
}

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
use crate::backend::{Backend, WeightPrecision};
use crate::error::{Result, RuntimeError};
use crate::kv_cache::{F32KvCache, KvCache, KvShape};
use crate::linear::{
    check_shape, require, FloatLinearFactory, Linear, LinearFactory, LinearRole, LinearSpec,
};
use crate::observe::ActivationObserver;
use crate::refine::Refiner;
use sfx_formats::{ModelConfig, TensorSource};

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
}

impl Default for ModelOptions {
    fn default() -> Self {
        Self {
            precision: WeightPrecision::Native,
            prefill_chunk: 512,
        }
    }
}

/// A loaded decoder on backend `B`.
pub struct Model<B: Backend = CpuBackend> {
    config: ModelConfig,
    backend: B,
    embed: B::Matrix,
    layers: Vec<DecoderLayer<B>>,
    final_norm: B::Buffer,
    lm_head: Box<dyn Linear<B>>,
    inv_freq: Vec<f32>,
    eps: f32,
    prefill_chunk: usize,
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

    /// Loads with every projection (and an untied output head) built by `factory`; the
    /// embedding stays a float table stored per `options.precision`.
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
        let view = require(tensors, embed_name, "token embedding")?;
        check_shape(embed_name, view.shape, &[c.vocab_size, c.hidden_size])?;
        let embed = backend.upload_matrix(embed_name, &view, options.precision)?;

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

        Ok(Self {
            inv_freq: c.rope_inv_freq().iter().map(|&f| f as f32).collect(),
            eps: c.rms_norm_eps as f32,
            config: c.clone(),
            backend,
            embed,
            layers,
            final_norm,
            lm_head,
            prefill_chunk: options.prefill_chunk,
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

    /// Bytes of weights resident on the device. A tied head shares the embedding and is
    /// counted once.
    pub fn resident_bytes(&self) -> usize {
        let (rows, cols) = self.backend.matrix_dims(&self.embed);
        let embed = rows * cols * self.backend.matrix_dtype(&self.embed).size_in_bytes();
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

    /// A float KV cache for up to `capacity` positions.
    pub fn new_cache(&self, capacity: usize) -> Result<F32KvCache<B>> {
        F32KvCache::new(&self.backend, KvShape::of(&self.config), capacity)
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
        self.forward_inner(tokens, cache, mode, None, None)
    }

    /// [`Model::forward`] with selective refinement: `refiner` adds the fetched refinement
    /// of each token's selected channels (method.md §2–3).
    pub fn forward_refined(
        &self,
        tokens: &[u32],
        cache: &mut dyn KvCache<B>,
        mode: LogitsMode,
        refiner: &mut Refiner<B>,
    ) -> Result<Logits> {
        self.forward_inner(tokens, cache, mode, None, Some(refiner))
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
        self.forward_inner(tokens, cache, mode, Some(observer), None)
    }

    fn forward_inner(
        &self,
        tokens: &[u32],
        cache: &mut dyn KvCache<B>,
        mode: LogitsMode,
        observer: Option<&mut dyn ActivationObserver>,
        refiner: Option<&mut Refiner<B>>,
    ) -> Result<Logits> {
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

        self.backend
            .run(|| self.forward_checked(tokens, cache, mode, observer, refiner))
    }

    fn forward_checked(
        &self,
        tokens: &[u32],
        cache: &mut dyn KvCache<B>,
        mode: LogitsMode,
        mut observer: Option<&mut dyn ActivationObserver>,
        mut refiner: Option<&mut Refiner<B>>,
    ) -> Result<Logits> {
        let vocab = self.config.vocab_size;
        let n = tokens.len();
        let rows = mode.rows(n);
        let first_row = n - rows;
        let first_position = cache.len() + first_row;
        let mut logits = Vec::with_capacity(rows * vocab);
        let mut start = 0;
        for chunk in tokens.chunks(self.prefill_chunk) {
            let end = start + chunk.len();
            // Rows of this chunk that fall in the selected tail.
            let chunk_rows = end - first_row.clamp(start, end);
            self.forward_chunk(
                chunk,
                cache,
                chunk_rows,
                &mut logits,
                &mut observer,
                &mut refiner,
            )?;
            start = end;
        }
        Ok(Logits::new(logits, vocab, first_position))
    }

    /// One pass of `tokens` through the graph; appends logits of its last `logit_rows` rows.
    fn forward_chunk(
        &self,
        tokens: &[u32],
        cache: &mut dyn KvCache<B>,
        logit_rows: usize,
        logits: &mut Vec<f32>,
        observer: &mut Option<&mut dyn ActivationObserver>,
        refiner: &mut Option<&mut Refiner<B>>,
    ) -> Result<()> {
        let b = &self.backend;
        let c = &self.config;
        let n = tokens.len();
        let hidden = c.hidden_size;
        let past = cache.len();

        let mut h = b.alloc(n * hidden)?;
        b.embedding(&self.embed, tokens, &mut h)?;
        let (cos, sin) = rope_cos_sin(&self.inv_freq, past, n);
        let (cos, sin) = (b.upload(&cos)?, b.upload(&sin)?);

        let mut scratch = LayerScratch::new(b, c, n)?;
        if let Some(r) = refiner.as_deref_mut() {
            r.begin_chunk(n);
            r.at_stream(b, 0, &mut h)?;
        }
        for (li, l) in self.layers.iter().enumerate() {
            let rope = (&cos, &sin);
            l.forward(
                b,
                c,
                self.eps,
                rope,
                &mut h,
                n,
                &mut scratch,
                cache,
                li,
                li,
                observer,
                refiner,
            )?;
        }
        if let Some(r) = refiner.as_deref_mut() {
            r.finish_chunk(b, &mut h)?;
        }
        cache.commit(n)?;

        if logit_rows > 0 {
            let mut sel = b.alloc(logit_rows * hidden)?;
            b.copy_rows(&h, hidden, n - logit_rows, &mut sel)?;
            let mut normed = b.alloc(logit_rows * hidden)?;
            b.rms_norm(&sel, &self.final_norm, self.eps, &mut normed)?;
            let mut out = b.alloc(logit_rows * c.vocab_size)?;
            self.lm_head.forward(b, &normed, logit_rows, &mut out)?;
            let at = logits.len();
            logits.resize(at + logit_rows * c.vocab_size, 0.0);
            b.download(&out, &mut logits[at..])?;
        }
        Ok(())
    }
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

//! The float decoder as a candle-core autograd graph, mirroring `sfx_runtime::model`'s math
//! op for op (RMSNorm, rotate-half RoPE with the runtime's own angle table, causal GQA
//! attention with scale 1/√head_dim, SiLU-gated MLP, tied or untied output head).
//!
//! The graph is tracked from the embedding output, a candle [`Var`]; the weights are plain
//! constants. candle's `backward` deletes the gradient of every intermediate node once it has
//! propagated it (only leaves keep theirs), so the output gradient g_t of a linear cannot be
//! read from the `GradStore` afterwards. Each decoder linear is therefore a small custom op,
//! [`LinearOp`]: forward y = x·Wᵀ, backward ∂x = g·W (the textbook matmul rule), and, on the
//! way, G_b = gᵀx = Σ_t g_t x_tᵀ — YAQA's per-sequence gradient — formed once from the g and x
//! it is handed and parked in the projection's capture slot. All other ops (norms, RoPE,
//! attention, softmax, the loss) are differentiated by candle.
//!
//! Why the linears are not candle matmuls on tracked weights (the first version; numbers in
//! docs/decisions.md): that works too — the weight's own gradient is G_b — but candle's matmul
//! backward builds every weight gradient in a zero-filled weight-sized buffer plus an add,
//! and forms one for the (untracked) tied output head as well. The custom op computes the
//! same three products on faer without those buffers: 2.1 GB lower peak memory at T = 512 and
//! ~5 % less time per sequence.

use super::{GuidedSaliency, YaqaError};
use candle_core::{CpuStorage, CustomOp1, Device, Layout, Shape, Tensor, Var, D};
use faer::{Accum, MatMut, MatRef, Par};
use sfx_formats::{ModelConfig, TensorSource};
use std::sync::{Arc, Mutex};

/// candle errors with the step that produced them.
pub(super) trait Ctx<T> {
    fn ctx(self, what: &str) -> Result<T, YaqaError>;
}

impl<T> Ctx<T> for candle_core::Result<T> {
    fn ctx(self, what: &str) -> Result<T, YaqaError> {
        self.map_err(|source| YaqaError::Candle {
            context: what.to_string(),
            source: Box::new(source),
        })
    }
}

/// A weight `[rows, cols]` (row-major f32) shared with the ops of each forward graph.
#[derive(Clone)]
struct Weight {
    data: Arc<Vec<f32>>,
    rows: usize,
    cols: usize,
}

/// Where the backward pass of one linear leaves its G_b.
type Capture = Arc<Mutex<Option<Vec<f32>>>>;

/// Where the backward pass of one linear appends its GuidedQuant saliencies, when asked for.
type SaliencySlot = Arc<Mutex<GuidedSaliency>>;

/// Locks a slot; a poisoned lock only means another thread panicked mid-write, and every
/// writer replaces or adds whole values, so the content is still usable.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One decoder projection: checkpoint name, weight, optional bias and G_b capture slot.
pub(super) struct Projection {
    pub name: String,
    weight: Weight,
    bias: Option<Tensor>,
    capture: Capture,
    saliency: Option<SaliencySlot>,
}

impl Projection {
    /// Output features (rows of W).
    pub fn rows(&self) -> usize {
        self.weight.rows
    }
    /// Input features (columns of W).
    pub fn cols(&self) -> usize {
        self.weight.cols
    }

    /// `x [T, in] · Wᵀ (+ b)`, capturing G_b in the backward pass.
    fn forward(&self, x: &Tensor) -> Result<Tensor, YaqaError> {
        let op = LinearOp {
            w: self.weight.clone(),
            capture: Some(self.capture.clone()),
            saliency: self.saliency.clone(),
        };
        let y = x.apply_op1(op).ctx(&self.name)?;
        match &self.bias {
            Some(b) => y.broadcast_add(b).ctx(&self.name),
            None => Ok(y),
        }
    }

    /// The G_b left by the last backward pass through this projection, if any.
    pub fn take_gradient(&self) -> Option<Vec<f32>> {
        lock(&self.capture).take()
    }

    /// The GuidedQuant saliencies of every backward pass since [`Graph::collect_saliency`],
    /// if collecting; the slot is left empty.
    pub fn take_saliency(&self) -> Option<GuidedSaliency> {
        self.saliency
            .as_ref()
            .map(|g| std::mem::take(&mut *lock(g)))
    }
}

/// `y = x·Wᵀ` for a constant W; see the module docs.
struct LinearOp {
    w: Weight,
    capture: Option<Capture>,
    saliency: Option<SaliencySlot>,
}

/// The f32 values of a CPU tensor's storage, which must be contiguous.
fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    let CpuStorage::F32(v) = s else {
        candle_core::bail!("sfx_linear: expected f32 storage")
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("sfx_linear: input is not contiguous"),
    }
}

/// `x` as a contiguous host vector with its row count, checked to have `cols` columns.
fn host_rows(x: &Tensor, cols: usize) -> candle_core::Result<(Vec<f32>, usize)> {
    let (rows, c) = x.dims2()?;
    if c != cols {
        candle_core::bail!("sfx_linear: {c} columns, expected {cols}");
    }
    Ok((x.flatten_all()?.to_vec1::<f32>()?, rows))
}

impl CustomOp1 for LinearOp {
    fn name(&self) -> &'static str {
        "sfx_linear"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (t, inp) = l.shape().dims2()?;
        let (out, cols) = (self.w.rows, self.w.cols);
        if inp != cols {
            candle_core::bail!("sfx_linear: input has {inp} features, weight {out}×{cols}");
        }
        let x = f32_slice(s, l)?;
        let mut y = vec![0.0f32; t * out];
        faer::linalg::matmul::matmul(
            MatMut::from_row_major_slice_mut(&mut y, t, out),
            Accum::Replace,
            MatRef::from_row_major_slice(x, t, inp),
            MatRef::from_row_major_slice(&self.w.data, out, cols).transpose(),
            1.0f32,
            Par::rayon(0),
        );
        Ok((CpuStorage::F32(y), Shape::from((t, out))))
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let (out, inp) = (self.w.rows, self.w.cols);
        let (g, t) = host_rows(grad, out)?;
        let gm = MatRef::from_row_major_slice(&g, t, out);
        if let Some(capture) = &self.capture {
            let (x, tx) = host_rows(arg, inp)?;
            if tx != t {
                candle_core::bail!("sfx_linear: {tx} input rows, {t} gradient rows");
            }
            let mut gb = vec![0.0f32; out * inp];
            faer::linalg::matmul::matmul(
                MatMut::from_row_major_slice_mut(&mut gb, out, inp),
                Accum::Replace,
                gm.transpose(),
                MatRef::from_row_major_slice(&x, t, inp),
                1.0f32,
                Par::rayon(0),
            );
            *lock(capture) = Some(gb);
        }
        if let Some(saliency) = &self.saliency {
            lock(saliency)
                .push(&g, t)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        }
        let mut dx = vec![0.0f32; t * inp];
        faer::linalg::matmul::matmul(
            MatMut::from_row_major_slice_mut(&mut dx, t, inp),
            Accum::Replace,
            gm,
            MatRef::from_row_major_slice(&self.w.data, out, inp),
            1.0f32,
            Par::rayon(0),
        );
        Tensor::from_vec(dx, (t, inp), arg.device()).map(Some)
    }
}

struct Layer {
    attn_norm: Tensor,
    q: Projection,
    k: Projection,
    v: Projection,
    o: Projection,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    mlp_norm: Tensor,
    gate: Projection,
    up: Projection,
    down: Projection,
}

/// The loaded model: f32 weights on the CPU, projections tracked.
pub(super) struct Graph {
    config: ModelConfig,
    embed: Weight,
    layers: Vec<Layer>,
    final_norm: Tensor,
    /// `None` when the head is tied to the embedding.
    lm_head: Option<Weight>,
    inv_freq: Vec<f32>,
}

/// The graph's outputs for one sequence.
pub(super) struct Forward {
    /// `[T, vocab]`, attached to the graph.
    pub logits: Tensor,
}

impl Graph {
    pub fn load(config: &ModelConfig, tensors: &dyn TensorSource) -> Result<Self, YaqaError> {
        validate_config(config)?;
        let c = config;
        let hidden = c.hidden_size;
        let embed = weight(tensors, "model.embed_tokens.weight", c.vocab_size, hidden)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let proj = |name: &str, out: usize, inp: usize, bias: bool| {
                projection(tensors, &format!("{p}.{name}"), out, inp, bias)
            };
            let norm =
                |name: &str, len: usize| load(tensors, &format!("{p}.{name}.weight"), &[len]);
            let qkv_bias = c.attention_bias;
            layers.push(Layer {
                attn_norm: norm("input_layernorm", hidden)?,
                q: proj("self_attn.q_proj", c.q_dim(), hidden, qkv_bias)?,
                k: proj("self_attn.k_proj", c.kv_dim(), hidden, qkv_bias)?,
                v: proj("self_attn.v_proj", c.kv_dim(), hidden, qkv_bias)?,
                o: proj("self_attn.o_proj", hidden, c.q_dim(), false)?,
                q_norm: c
                    .qk_norm
                    .then(|| norm("self_attn.q_norm", c.head_dim))
                    .transpose()?,
                k_norm: c
                    .qk_norm
                    .then(|| norm("self_attn.k_norm", c.head_dim))
                    .transpose()?,
                mlp_norm: norm("post_attention_layernorm", hidden)?,
                gate: proj("mlp.gate_proj", c.intermediate_size, hidden, false)?,
                up: proj("mlp.up_proj", c.intermediate_size, hidden, false)?,
                down: proj("mlp.down_proj", hidden, c.intermediate_size, false)?,
            });
        }
        let final_norm = load(tensors, "model.norm.weight", &[hidden])?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(weight(tensors, "lm_head.weight", c.vocab_size, hidden)?)
        };
        Ok(Self {
            inv_freq: c.rope_inv_freq().iter().map(|&f| f as f32).collect(),
            config: c.clone(),
            embed,
            layers,
            final_norm,
            lm_head,
        })
    }

    /// From now on every backward pass also appends each projection's GuidedQuant saliencies
    /// over `groups` groups of output channels ([`GuidedSaliency`]), starting from none.
    pub fn collect_saliency(&mut self, groups: usize) -> Result<(), YaqaError> {
        for l in &mut self.layers {
            for p in [
                &mut l.q,
                &mut l.k,
                &mut l.v,
                &mut l.o,
                &mut l.gate,
                &mut l.up,
                &mut l.down,
            ] {
                let s = GuidedSaliency::new(p.rows(), groups)?;
                p.saliency = Some(Arc::new(Mutex::new(s)));
            }
        }
        Ok(())
    }

    /// Every decoder projection, layer by layer in q, k, v, o, gate, up, down order.
    pub fn projections(&self) -> impl Iterator<Item = &Projection> {
        self.layers
            .iter()
            .flat_map(|l| [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down])
    }

    /// All-position logits of `tokens` (already range-checked by the caller).
    pub fn forward(&self, tokens: &[u32]) -> Result<Forward, YaqaError> {
        let c = &self.config;
        let dev = &Device::Cpu;
        let t = tokens.len();
        let eps = c.rms_norm_eps;
        let (heads, kv_heads, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let group = heads / kv_heads;
        let half = hd / 2;

        for p in self.projections() {
            p.take_gradient();
        }
        // The embedding rows, gathered on the host, are the graph's one tracked leaf.
        let hidden = c.hidden_size;
        let mut rows = Vec::with_capacity(t * hidden);
        for &id in tokens {
            let at = id as usize * hidden;
            let row = self.embed.data.get(at..at + hidden).ok_or_else(|| {
                YaqaError::Config(format!("token {id} is outside the embedding table"))
            })?;
            rows.extend_from_slice(row);
        }
        let h0 = Var::from_vec(rows, (t, hidden), dev).ctx("embedding")?;
        let mut h = h0.as_tensor().clone();

        // The runtime's own angle table, so both sides carry identical f32 angles.
        let (cos, sin) = sfx_runtime::model::rope_cos_sin(&self.inv_freq, 0, t);
        let cos = Tensor::from_vec(cos, (t, 1, half), dev).ctx("rope cos")?;
        let sin = Tensor::from_vec(sin, (t, 1, half), dev).ctx("rope sin")?;
        let mask = causal_mask(t, group)?;
        let scale = 1.0 / (hd as f64).sqrt();

        for (li, l) in self.layers.iter().enumerate() {
            let what = |s: &str| format!("layer {li} {s}");
            let xn = rms_norm(&h, &l.attn_norm, eps).ctx(&what("attention RMSNorm"))?;
            let mut q = l.q.forward(&xn)?.reshape((t, heads, hd)).ctx(&what("q"))?;
            let mut k =
                l.k.forward(&xn)?
                    .reshape((t, kv_heads, hd))
                    .ctx(&what("k"))?;
            let v =
                l.v.forward(&xn)?
                    .reshape((t, kv_heads, hd))
                    .ctx(&what("v"))?;
            if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                q = rms_norm(&q, qn, eps).ctx(&what("q norm"))?;
                k = rms_norm(&k, kn, eps).ctx(&what("k norm"))?;
            }
            let q = rope(&q, &cos, &sin, half).ctx(&what("q rope"))?;
            let k = rope(&k, &cos, &sin, half).ctx(&what("k rope"))?;
            let a = attention(&q, &k, &v, &mask, scale, group).ctx(&what("attention"))?;
            let o = l.o.forward(&a)?;
            h = (h + o).ctx(&what("attention residual"))?;

            let xn = rms_norm(&h, &l.mlp_norm, eps).ctx(&what("MLP RMSNorm"))?;
            let gate = l.gate.forward(&xn)?;
            let up = l.up.forward(&xn)?;
            let act = (gate.silu().ctx(&what("silu"))? * up).ctx(&what("gate·up"))?;
            let d = l.down.forward(&act)?;
            h = (h + d).ctx(&what("MLP residual"))?;
        }
        let xn = rms_norm(&h, &self.final_norm, eps).ctx("final RMSNorm")?;
        let head = LinearOp {
            w: self.lm_head.as_ref().unwrap_or(&self.embed).clone(),
            capture: None,
            saliency: None,
        };
        let logits = xn.apply_op1(head).ctx("output head")?;
        Ok(Forward { logits })
    }
}

/// `Σ_t −log softmax(logits_t)[labels_t]` as a scalar attached to the graph.
pub(super) fn nll_sum(logits: &Tensor, labels: &[u32]) -> candle_core::Result<Tensor> {
    let t = labels.len();
    // Softmax is shift-invariant, so subtracting a detached row max changes neither the value
    // nor the gradient, and spares the max's backward pass.
    let m = logits.max_keepdim(D::Minus1)?.detach();
    let lse = (logits
        .broadcast_sub(&m)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        + m)?;
    let idx = Tensor::from_slice(labels, (t, 1), logits.device())?;
    let picked = logits.gather(&idx, D::Minus1)?;
    (lse - picked)?.sum_all()
}

/// `x / sqrt(mean(x²) + eps) · w` over the last dimension, in the runtime's order of operations.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let inv = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    x.broadcast_mul(&inv)?.broadcast_mul(w)
}

/// Hugging Face rotate-half RoPE on `x [T, heads, head_dim]`: pairs (i, i + half).
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, half: usize) -> candle_core::Result<Tensor> {
    let a = x.narrow(D::Minus1, 0, half)?;
    let b = x.narrow(D::Minus1, half, half)?;
    let lo = (a.broadcast_mul(cos)? - b.broadcast_mul(sin)?)?;
    let hi = (b.broadcast_mul(cos)? + a.broadcast_mul(sin)?)?;
    Tensor::cat(&[&lo, &hi], D::Minus1)
}

/// Additive causal mask for the grouped score layout of [`attention`]: row `r` is query
/// position `r % T` of one of the `group` query heads sharing a KV head.
fn causal_mask(t: usize, group: usize) -> Result<Tensor, YaqaError> {
    let mut m = vec![0.0f32; group * t * t];
    for (r, row) in m.chunks_exact_mut(t).enumerate() {
        row[r % t + 1..].fill(f32::NEG_INFINITY);
    }
    Tensor::from_vec(m, (group * t, t), &Device::Cpu).ctx("causal mask")
}

/// Causal grouped-query attention. The `group` query heads of each KV head are stacked into
/// one `[group·T, head_dim]` matrix per KV head, so keys and values are never repeated.
fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    scale: f64,
    group: usize,
) -> candle_core::Result<Tensor> {
    let (t, heads, hd) = q.dims3()?;
    let kv_heads = heads / group;
    // Query head h = kv·group + g (the runtime's and transformers' GQA mapping).
    let q = q
        .reshape((t, kv_heads, group, hd))?
        .permute((1, 2, 0, 3))?
        .reshape((kv_heads, group * t, hd))?;
    let k = k.transpose(0, 1)?.contiguous()?;
    let v = v.transpose(0, 1)?.contiguous()?;
    // Scaling q (T·d values) rather than the scores (T² per head) saves a score-sized tensor
    // per layer in the graph.
    let scores = (q * scale)?.matmul(&k.t()?)?.broadcast_add(mask)?;
    // Every row has its diagonal unmasked, so the max is finite; detached as in `nll_sum`.
    let m = scores.max_keepdim(D::Minus1)?.detach();
    let e = scores.broadcast_sub(&m)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v)?
        .reshape((kv_heads, group, t, hd))?
        .permute((2, 0, 1, 3))?
        .reshape((t, heads * hd))
}

/// The f32 values of tensor `name`, checked to have `shape`.
fn load_f32(
    tensors: &dyn TensorSource,
    name: &str,
    shape: &[usize],
) -> Result<Vec<f32>, YaqaError> {
    let view = tensors.tensor(name).map_err(|source| YaqaError::Tensor {
        name: name.to_string(),
        source: Box::new(source),
    })?;
    if view.shape != shape {
        return Err(YaqaError::Shape {
            name: name.to_string(),
            expected: shape.to_vec(),
            actual: view.shape.to_vec(),
        });
    }
    Ok(view.to_f32_vec())
}

fn load(tensors: &dyn TensorSource, name: &str, shape: &[usize]) -> Result<Tensor, YaqaError> {
    Tensor::from_vec(load_f32(tensors, name, shape)?, shape, &Device::Cpu).ctx(name)
}

fn weight(
    tensors: &dyn TensorSource,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<Weight, YaqaError> {
    Ok(Weight {
        data: Arc::new(load_f32(tensors, name, &[rows, cols])?),
        rows,
        cols,
    })
}

fn projection(
    tensors: &dyn TensorSource,
    prefix: &str,
    out: usize,
    inp: usize,
    bias: bool,
) -> Result<Projection, YaqaError> {
    let name = format!("{prefix}.weight");
    let weight = weight(tensors, &name, out, inp)?;
    let bias = if bias {
        Some(load(tensors, &format!("{prefix}.bias"), &[out])?)
    } else {
        None
    };
    Ok(Projection {
        name,
        weight,
        bias,
        capture: Capture::default(),
        saliency: None,
    })
}

/// The runtime's config checks plus what this graph needs besides: `ModelConfig`'s fields are
/// public, so a hand-built one has not necessarily passed the config.json parser.
fn validate_config(c: &ModelConfig) -> Result<(), YaqaError> {
    sfx_runtime::model::validate_config(c).map_err(|e| match e {
        sfx_runtime::RuntimeError::Config(msg) => YaqaError::Config(msg),
        other => YaqaError::Config(other.to_string()),
    })?;
    let bad = |msg: String| Err(YaqaError::Config(msg));
    // Beyond the runtime's checks: the graph loops over layers and computes RoPE
    // frequencies and the norm's epsilon once, so these must be usable up front.
    if c.num_hidden_layers == 0 {
        return bad("num_hidden_layers must be at least 1".into());
    }
    if !(c.rms_norm_eps.is_finite() && c.rms_norm_eps >= 0.0) {
        return bad(format!(
            "rms_norm_eps {} must be finite and ≥ 0",
            c.rms_norm_eps
        ));
    }
    if !(c.rope_theta.is_finite() && c.rope_theta > 0.0) {
        return bad(format!(
            "rope_theta {} must be finite and > 0",
            c.rope_theta
        ));
    }
    Ok(())
}

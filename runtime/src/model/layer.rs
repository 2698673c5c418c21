//! One decoder block's weights and its loading from Hugging Face tensor names.

use crate::backend::{Backend, GroupItem, MatmulOut, RopeTable};
use crate::error::{Result, RuntimeError};
use crate::kv_cache::KvCache;
use crate::linear::{check_shape, require, Linear, LinearFactory, LinearRole, LinearSpec};
use crate::observe::{ActivationObserver, ProjectionSet};
use crate::refine::engine::SetInput;
use crate::refine::Refiner;
use sfx_formats::{ModelConfig, TensorSource};

/// Weights of one Llama-family block: pre-norm attention and pre-norm SwiGLU MLP.
pub struct DecoderLayer<B: Backend> {
    pub(crate) attn_norm: B::Buffer,
    pub(crate) q_proj: Box<dyn Linear<B>>,
    pub(crate) k_proj: Box<dyn Linear<B>>,
    pub(crate) v_proj: Box<dyn Linear<B>>,
    pub(crate) o_proj: Box<dyn Linear<B>>,
    /// Qwen3's per-head RMSNorm on queries and keys (before RoPE).
    pub(crate) q_norm: Option<B::Buffer>,
    pub(crate) k_norm: Option<B::Buffer>,
    pub(crate) mlp_norm: B::Buffer,
    pub(crate) gate_proj: Box<dyn Linear<B>>,
    pub(crate) up_proj: Box<dyn Linear<B>>,
    pub(crate) down_proj: Box<dyn Linear<B>>,
}

impl<B: Backend> DecoderLayer<B> {
    pub(crate) fn load(
        backend: &B,
        config: &ModelConfig,
        tensors: &dyn TensorSource,
        factory: &dyn LinearFactory<B>,
        i: usize,
    ) -> Result<Self> {
        let c = config;
        let p = format!("model.layers.{i}");
        let hidden = c.hidden_size;
        let linear = |role: LinearRole, name: &str, out_dim: usize, in_dim: usize, bias: bool| {
            let weight_name = format!("{p}.{name}.weight");
            let bias_name = bias.then(|| format!("{p}.{name}.bias"));
            let spec = LinearSpec {
                layer: Some(i),
                role,
                weight_name: &weight_name,
                bias_name: bias_name.as_deref(),
                out_dim,
                in_dim,
            };
            factory.load(backend, tensors, &spec)
        };
        let norm = |name: &str, len: usize, why: &str| -> Result<B::Buffer> {
            let full = format!("{p}.{name}.weight");
            let view = require(tensors, &full, why)?;
            check_shape(&full, view.shape, &[len])?;
            backend.upload(&view.to_f32_vec())
        };
        let qkv_bias = c.attention_bias;
        Ok(Self {
            attn_norm: norm("input_layernorm", hidden, "attention RMSNorm")?,
            q_proj: linear(
                LinearRole::Query,
                "self_attn.q_proj",
                c.q_dim(),
                hidden,
                qkv_bias,
            )?,
            k_proj: linear(
                LinearRole::Key,
                "self_attn.k_proj",
                c.kv_dim(),
                hidden,
                qkv_bias,
            )?,
            v_proj: linear(
                LinearRole::Value,
                "self_attn.v_proj",
                c.kv_dim(),
                hidden,
                qkv_bias,
            )?,
            o_proj: linear(
                LinearRole::AttnOutput,
                "self_attn.o_proj",
                hidden,
                c.q_dim(),
                false,
            )?,
            q_norm: if c.qk_norm {
                Some(norm(
                    "self_attn.q_norm",
                    c.head_dim,
                    "Qwen3 query norm (qk_norm)",
                )?)
            } else {
                None
            },
            k_norm: if c.qk_norm {
                Some(norm(
                    "self_attn.k_norm",
                    c.head_dim,
                    "Qwen3 key norm (qk_norm)",
                )?)
            } else {
                None
            },
            mlp_norm: norm("post_attention_layernorm", hidden, "MLP RMSNorm")?,
            gate_proj: linear(
                LinearRole::Gate,
                "mlp.gate_proj",
                c.intermediate_size,
                hidden,
                false,
            )?,
            up_proj: linear(
                LinearRole::Up,
                "mlp.up_proj",
                c.intermediate_size,
                hidden,
                false,
            )?,
            down_proj: linear(
                LinearRole::Down,
                "mlp.down_proj",
                hidden,
                c.intermediate_size,
                false,
            )?,
        })
    }

    /// Every projection of the block with its role.
    pub fn linears(&self) -> [(LinearRole, &dyn Linear<B>); 7] {
        [
            (LinearRole::Query, &*self.q_proj),
            (LinearRole::Key, &*self.k_proj),
            (LinearRole::Value, &*self.v_proj),
            (LinearRole::AttnOutput, &*self.o_proj),
            (LinearRole::Gate, &*self.gate_proj),
            (LinearRole::Up, &*self.up_proj),
            (LinearRole::Down, &*self.down_proj),
        ]
    }
}

/// Activation buffers of one chunk of `n` tokens, reused by every layer of that chunk.
pub(crate) struct LayerScratch<B: Backend> {
    xn: B::Buffer,
    q: B::Buffer,
    k: B::Buffer,
    v: B::Buffer,
    attn: B::Buffer,
    tmp: B::Buffer,
    gate: B::Buffer,
    up: B::Buffer,
}

impl<B: Backend> LayerScratch<B> {
    pub(crate) fn new(b: &B, c: &ModelConfig, n: usize) -> Result<Self> {
        let (hidden, q_dim, kv_dim, ffn) =
            (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        Ok(Self {
            xn: b.alloc(n * hidden)?,
            q: b.alloc(n * q_dim)?,
            k: b.alloc(n * kv_dim)?,
            v: b.alloc(n * kv_dim)?,
            attn: b.alloc(n * q_dim)?,
            tmp: b.alloc(n * hidden)?,
            gate: b.alloc(n * ffn)?,
            up: b.alloc(n * ffn)?,
        })
    }
}

impl<B: Backend> DecoderLayer<B> {
    /// Runs the block on the residual stream `h` (`n` tokens at the device-side `positions`):
    /// attention over `cache`'s layer `cache_layer` (the full model uses its layer index; the
    /// layer-wise runner a one-layer cache), observer calls tagged with `layer`.
    ///
    /// Without a refiner, projections held as backend matrices take the fused paths (q/k/v in one group, gate
    /// and up with SwiGLU, o and down accumulating into `h`); the backends' defaults of those
    /// ops are the unfused sequence, so the CPU computes the same numbers either way.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
        &self,
        b: &B,
        c: &ModelConfig,
        eps: f32,
        rope: &RopeTable<B>,
        positions: &B::Index,
        h: &mut B::Buffer,
        n: usize,
        s: &mut LayerScratch<B>,
        cache: &mut dyn KvCache<B>,
        cache_layer: usize,
        layer: usize,
        observer: &mut Option<&mut dyn ActivationObserver>,
        refiner: &mut Option<&mut Refiner<B>>,
    ) -> Result<()> {
        // With nothing reading the normalised input, the norm fuses into the projections (an
        // engine in the backend selects from the residual stream and the norm itself).
        let in_backend = refiner.as_deref().is_some_and(Refiner::in_backend);
        let plain = observer.is_none() && (refiner.is_none() || in_backend);
        let qkv_parts = match (
            self.q_proj.matrix_parts(),
            self.k_proj.matrix_parts(),
            self.v_proj.matrix_parts(),
        ) {
            (Some(q), Some(k), Some(v)) => Some([q, k, v]),
            _ => None,
        };
        // A decode row's refinement goes into the projections' own launches where the
        // backend can (`fuses_set`); otherwise each set's refinement starts once its input
        // exists and runs beside the projection (in the backend), and `refine_set` then
        // finishes it.
        let fuse_qkv = plain
            && qkv_parts.is_some_and(|p| {
                let ws = p.map(|(w, _)| w);
                fuses(refiner, b, layer, ProjectionSet::Qkv, n, &ws)
            });
        if let Some(r) = refiner.as_deref_mut() {
            let input = SetInput::normed(h, &self.attn_norm, eps, &s.xn);
            if fuse_qkv {
                r.prepare_fused(b, layer, ProjectionSet::Qkv, input)?;
            } else {
                r.start_set(b, layer, ProjectionSet::Qkv, input)?;
            }
        }
        match qkv_parts {
            Some([(wq, bq), (wk, bk), (wv, bv)]) => {
                let items = &mut [
                    GroupItem::new(wq, bq, &mut s.q),
                    GroupItem::new(wk, bk, &mut s.k),
                    GroupItem::new(wv, bv, &mut s.v),
                ];
                if let (true, Some(r)) = (fuse_qkv, refiner.as_deref()) {
                    for (it, f) in items
                        .iter_mut()
                        .zip(r.fused_columns(layer, ProjectionSet::Qkv)?)
                    {
                        it.refine = Some(f);
                    }
                }
                if plain {
                    b.rms_norm_matmul_group(h, &self.attn_norm, eps, &mut s.xn, n, items)?;
                } else {
                    b.rms_norm(h, &self.attn_norm, eps, &mut s.xn)?;
                    observe(b, observer, layer, ProjectionSet::Qkv, &s.xn, n)?;
                    b.matmul_t_group(&s.xn, n, items)?;
                }
            }
            _ => {
                b.rms_norm(h, &self.attn_norm, eps, &mut s.xn)?;
                observe(b, observer, layer, ProjectionSet::Qkv, &s.xn, n)?;
                self.q_proj.forward(b, &s.xn, n, &mut s.q)?;
                self.k_proj.forward(b, &s.xn, n, &mut s.k)?;
                self.v_proj.forward(b, &s.xn, n, &mut s.v)?;
            }
        }
        if let Some(r) = refiner.as_deref_mut() {
            let input = SetInput::normed(h, &self.attn_norm, eps, &s.xn);
            let outs = &mut [&mut s.q, &mut s.k, &mut s.v];
            r.refine_set(b, layer, ProjectionSet::Qkv, input, outs)?;
        }
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            b.rms_norm_in_place(&mut s.q, qn, eps)?;
            b.rms_norm_in_place(&mut s.k, kn, eps)?;
        }
        cache.rope_append_and_attend(
            b,
            cache_layer,
            c.num_attention_heads,
            n,
            positions,
            rope,
            &mut s.q,
            &mut s.k,
            &s.v,
            &mut s.attn,
        )?;
        observe(b, observer, layer, ProjectionSet::O, &s.attn, n)?;
        // o and down add into the residual stream, their refinement with them or after them.
        // Fetch lag's contributions due where o's add lands go into its launch too.
        let o_parts = self.o_proj.matrix_parts();
        let fuse_o =
            o_parts.is_some_and(|(w, _)| fuses(refiner, b, layer, ProjectionSet::O, n, &[w]));
        let lag_into_o = o_parts
            .is_some_and(|(w, _)| refiner.as_deref().is_some_and(|r| r.takes_lagged(b, n, w)));
        match (o_parts, refiner.as_deref_mut()) {
            (Some((w, bias)), Some(r)) if fuse_o || lag_into_o => {
                let proj = InLaunch {
                    layer,
                    set: ProjectionSet::O,
                    fuse: fuse_o,
                    w,
                    bias,
                };
                proj.residual_add(b, r, &s.attn, n, h)?;
            }
            (_, r) => {
                if let Some(r) = r {
                    r.start_set(b, layer, ProjectionSet::O, SetInput::Plain(&s.attn))?;
                }
                self.o_proj.forward_add(b, &s.attn, n, h, &mut s.tmp)?;
            }
        }
        if let Some(r) = refiner.as_deref_mut() {
            r.refine_set(
                b,
                layer,
                ProjectionSet::O,
                SetInput::Plain(&s.attn),
                &mut [h],
            )?;
            r.at_stream(b, 2 * layer + 1, h)?;
        }

        let gate_up = match (self.gate_proj.matrix_parts(), self.up_proj.matrix_parts()) {
            (Some((wg, None)), Some((wu, None))) => Some((wg, wu)),
            _ => None,
        };
        let bundles = refiner.as_deref().is_some_and(|r| r.uses_bundles(layer));
        let fused_mlp = gate_up.filter(|_| refiner.is_none());
        match fused_mlp {
            // The norm fused into gate and up, their refinement added before SwiGLU.
            None if plain && !bundles && gate_up.is_some() => {
                let fuse_gu = gate_up.is_some_and(|(wg, wu)| {
                    fuses(refiner, b, layer, ProjectionSet::GateUp, n, &[wg, wu])
                });
                if let (Some((wg, wu)), Some(r), true) = (gate_up, refiner.as_deref_mut(), fuse_gu)
                {
                    let input = SetInput::normed(h, &self.mlp_norm, eps, &s.xn);
                    r.prepare_fused(b, layer, ProjectionSet::GateUp, input)?;
                    let f = r.fused_columns(layer, ProjectionSet::GateUp)?;
                    let [fg, fu] = f.as_slice() else {
                        return Err(RuntimeError::EmptyInput);
                    };
                    b.rms_norm_swiglu_refined(
                        h,
                        &self.mlp_norm,
                        eps,
                        &mut s.xn,
                        n,
                        wg,
                        wu,
                        &mut s.gate,
                        &mut s.up,
                        [fg, fu],
                    )?;
                    let input = SetInput::normed(h, &self.mlp_norm, eps, &s.xn);
                    let outs = &mut [&mut s.gate, &mut s.up];
                    r.refine_set(b, layer, ProjectionSet::GateUp, input, outs)?;
                } else if let (Some((wg, wu)), Some(r)) = (gate_up, refiner.as_deref_mut()) {
                    let input = SetInput::normed(h, &self.mlp_norm, eps, &s.xn);
                    r.start_set(b, layer, ProjectionSet::GateUp, input)?;
                    let items = &mut [
                        GroupItem::new(wg, None, &mut s.gate),
                        GroupItem::new(wu, None, &mut s.up),
                    ];
                    b.rms_norm_matmul_group(h, &self.mlp_norm, eps, &mut s.xn, n, items)?;
                    let input = SetInput::normed(h, &self.mlp_norm, eps, &s.xn);
                    r.refine_set(
                        b,
                        layer,
                        ProjectionSet::GateUp,
                        input,
                        &mut [&mut s.gate, &mut s.up],
                    )?;
                    b.silu_mul(&mut s.gate, &s.up)?;
                }
            }
            Some((wg, wu)) if observer.is_none() => {
                b.rms_norm_swiglu(
                    h,
                    &self.mlp_norm,
                    eps,
                    &mut s.xn,
                    n,
                    wg,
                    wu,
                    &mut s.gate,
                    &mut s.up,
                )?;
            }
            Some((wg, wu)) => {
                b.rms_norm(h, &self.mlp_norm, eps, &mut s.xn)?;
                observe(b, observer, layer, ProjectionSet::GateUp, &s.xn, n)?;
                b.matmul_t_swiglu(&s.xn, n, wg, wu, &mut s.gate, &mut s.up)?;
            }
            None => {
                b.rms_norm(h, &self.mlp_norm, eps, &mut s.xn)?;
                observe(b, observer, layer, ProjectionSet::GateUp, &s.xn, n)?;
                self.gate_proj.forward(b, &s.xn, n, &mut s.gate)?;
                self.up_proj.forward(b, &s.xn, n, &mut s.up)?;
                if let Some(r) = refiner.as_deref_mut() {
                    if bundles {
                        r.capture_mlp_inputs(b, layer, &s.xn, &s.gate, &s.up)?;
                    } else {
                        let input = SetInput::normed(h, &self.mlp_norm, eps, &s.xn);
                        let outs = &mut [&mut s.gate, &mut s.up];
                        r.refine_set(b, layer, ProjectionSet::GateUp, input, outs)?;
                    }
                }
                b.silu_mul(&mut s.gate, &s.up)?;
            }
        }
        observe(b, observer, layer, ProjectionSet::Down, &s.gate, n)?;
        match refiner.as_deref_mut() {
            None => self.down_proj.forward_add(b, &s.gate, n, h, &mut s.tmp)?,
            Some(r) => {
                if bundles {
                    self.down_proj.forward(b, &s.gate, n, &mut s.tmp)?;
                    r.apply_bundles(b, layer, &s.gate, &mut s.tmp)?;
                    b.add_assign(h, &s.tmp)?;
                } else {
                    let parts = self.down_proj.matrix_parts();
                    let fuse_down = parts
                        .is_some_and(|(w, _)| r.fuses_set(b, layer, ProjectionSet::Down, n, &[w]));
                    let lag_into_down = parts.is_some_and(|(w, _)| r.takes_lagged(b, n, w));
                    match parts {
                        Some((w, bias)) if fuse_down || lag_into_down => {
                            let proj = InLaunch {
                                layer,
                                set: ProjectionSet::Down,
                                fuse: fuse_down,
                                w,
                                bias,
                            };
                            proj.residual_add(b, r, &s.gate, n, h)?;
                        }
                        _ => {
                            r.start_set(b, layer, ProjectionSet::Down, SetInput::Plain(&s.gate))?;
                            self.down_proj.forward_add(b, &s.gate, n, h, &mut s.tmp)?;
                        }
                    }
                    let input = SetInput::Plain(&s.gate);
                    r.refine_set(b, layer, ProjectionSet::Down, input, &mut [h])?;
                }
                r.at_stream(b, 2 * layer + 2, h)?;
            }
        }
        Ok(())
    }
}

/// o or down of a decode row whose launch adds, besides its product, its own refinement
/// (`fuse`) and fetch lag's contributions due where its residual add lands.
struct InLaunch<'a, B: Backend> {
    layer: usize,
    set: ProjectionSet,
    fuse: bool,
    w: &'a B::Matrix,
    bias: Option<&'a B::Buffer>,
}

impl<B: Backend> InLaunch<'_, B> {
    /// `h += W·x (+ b)` with the refinement and the lagged contributions, in one launch where
    /// the backend can.
    fn residual_add(
        &self,
        b: &B,
        r: &mut Refiner<B>,
        x: &B::Buffer,
        n: usize,
        h: &mut B::Buffer,
    ) -> Result<()> {
        let (layer, set) = (self.layer, self.set);
        if self.fuse {
            r.prepare_fused(b, layer, set, SetInput::Plain(x))?;
        } else {
            r.start_set(b, layer, set, SetInput::Plain(x))?;
        }
        // o lands at stream position 2l + 1, down at 2l + 2 (refine::engine::stream_position).
        let lands = 2 * layer + 1 + usize::from(set == ProjectionSet::Down);
        r.take_lagged_due(b, lands)?;
        let f = match self.fuse {
            true => r.fused_columns(layer, set)?,
            false => Vec::new(),
        };
        let lagged = r.lagged_due();
        let acc = MatmulOut::Accumulate;
        b.matmul_t_refined(x, n, self.w, self.bias, h, acc, f.first(), &lagged)
    }
}

/// Whether `refiner` refines set `set` of `layer` inside the launches of `weights`.
fn fuses<B: Backend>(
    refiner: &Option<&mut Refiner<B>>,
    b: &B,
    layer: usize,
    set: ProjectionSet,
    rows: usize,
    weights: &[&B::Matrix],
) -> bool {
    refiner
        .as_deref()
        .is_some_and(|r| r.fuses_set(b, layer, set, rows, weights))
}

/// Downloads `x` (`rows` rows) and hands it to the observer, if there is one.
fn observe<B: Backend>(
    b: &B,
    observer: &mut Option<&mut dyn ActivationObserver>,
    layer: usize,
    set: ProjectionSet,
    x: &B::Buffer,
    rows: usize,
) -> Result<()> {
    if let Some(o) = observer.as_deref_mut() {
        let mut host = vec![0.0f32; b.buffer_len(x)];
        b.download(x, &mut host)?;
        o.observe(layer, set, &host, rows);
    }
    Ok(())
}

//! One decoder block of the conversion: statistics, resident quantization with folding,
//! refinement fitting, held-out error measurement and the block's sections.

use super::{ConvertError, ConvertOptions, Sink};
use crate::quant::awq::{fold_into_norm, fold_into_rows, scale_columns};
use crate::quant::{InputStats, Kron, ResidentQuantizer, ResidentWeight, SetContext, WeightView};
use crate::refine::bundles::build_bundles;
use crate::refine::{fit_refinement, quantize_columns_4bit, RefinementColumns};
use crate::stats::{mask_top_k, RefinementStats};
use crate::yaqa::{GuidedHessian, GuidedSaliency};
use faer::{Accum, MatMut, MatRef, Par};
use sfx_formats::sfx::Layout;
use sfx_formats::{FormatError, TensorSource};
use sfx_runtime::model::DecoderLayer;
use sfx_runtime::refine::{bundle_budget, bundles_section, columns_section};
use sfx_runtime::{
    CpuBackend, FloatLinearFactory, LayerwiseRunner, ProjectionSet, WeightPrecision,
};
use std::collections::BTreeMap;
use std::time::Instant;

/// Held-out projection-output error of one projection set, summed over its projections and
/// the held-out tokens: `signal` = Σ‖W'x‖², `base` = Σ‖W'x − Ŵx‖², `plain` / `fitted` the same
/// after adding the 4-bit plain residual R / fitted C on the top-k channels of x.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct SetReport {
    pub set: String,
    pub k: usize,
    pub signal: f64,
    pub base: f64,
    pub plain: f64,
    pub fitted: f64,
}

/// What one block's conversion measured.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct LayerReport {
    pub layer: usize,
    /// Empty when no held-out text was given.
    pub sets: Vec<SetReport>,
    /// Quantizer record per set name (e.g. AWQ's α and objectives).
    pub quant_info: BTreeMap<String, BTreeMap<String, f64>>,
    pub seconds: f64,
}

pub(super) struct LayerContext<'a> {
    pub runner: &'a LayerwiseRunner<CpuBackend>,
    pub tensors: &'a dyn TensorSource,
    pub quantizer: &'a dyn ResidentQuantizer,
    pub options: &'a ConvertOptions,
    /// YAQA's Kronecker factors keyed by weight name.
    pub kron: Option<&'a std::collections::BTreeMap<String, crate::yaqa::KroneckerFactors>>,
    /// SqueezeLLM's Fisher diagonal keyed by weight name (`rows, cols, values`).
    pub fisher: Option<&'a crate::yaqa::Gradients>,
    /// LNQ's GuidedQuant saliencies keyed by weight name.
    pub guided: Option<&'a BTreeMap<String, GuidedSaliency>>,
}

/// One float projection on its way to the file.
struct Proj {
    /// `model.layers.{i}.{name}`.
    prefix: String,
    /// `W' = W·diag(s)` once the set is quantized (folding applied to rows as needed).
    w: Vec<f32>,
    rows: usize,
    cols: usize,
    bias: Option<Vec<f32>>,
    q: Option<ResidentWeight>,
    /// The 4-bit refinement per rung: `(section rung, columns)` ([`ConvertOptions::rungs`]).
    refine: Vec<(Option<usize>, RefinementColumns)>,
}

impl Proj {
    fn quantized(&self) -> Result<&ResidentWeight, ConvertError> {
        self.q
            .as_ref()
            .ok_or_else(|| ConvertError::Options(format!("{}: not quantized", self.prefix)))
    }

    fn residual(&self) -> Result<Vec<f32>, ConvertError> {
        let deq = self.quantized()?.dequantize(&self.prefix)?;
        Ok(self.w.iter().zip(&deq).map(|(w, q)| w - q).collect())
    }
}

pub(super) fn load_vector(
    tensors: &dyn TensorSource,
    name: &str,
    len: usize,
) -> Result<Vec<f32>, ConvertError> {
    let view = tensors.tensor(name)?;
    if view.shape != [len] {
        return Err(shape_error(name, view.shape, &[len]));
    }
    Ok(view.to_f32_vec())
}

fn shape_error(name: &str, actual: &[usize], expected: &[usize]) -> ConvertError {
    ConvertError::Format(FormatError::invalid(
        std::path::Path::new(name),
        format!("shape {actual:?}, config implies {expected:?}"),
    ))
}

fn load_proj(
    tensors: &dyn TensorSource,
    prefix: String,
    rows: usize,
    cols: usize,
    bias: bool,
) -> Result<Proj, ConvertError> {
    let name = format!("{prefix}.weight");
    let view = tensors.tensor(&name)?;
    if view.shape != [rows, cols] {
        return Err(shape_error(&name, view.shape, &[rows, cols]));
    }
    let bias = if bias {
        Some(load_vector(tensors, &format!("{prefix}.bias"), rows)?)
    } else {
        None
    };
    Ok(Proj {
        prefix,
        w: view.to_f32_vec(),
        rows,
        cols,
        bias,
        q: None,
        refine: Vec::new(),
    })
}

/// `x [n, in] · wᵀ` for `w [out, in]`, row-major `[n, out]`.
fn x_wt(x: &[f32], n: usize, w: &[f32], out: usize, inp: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; n * out];
    faer::linalg::matmul::matmul(
        MatMut::from_row_major_slice_mut(&mut y, n, out),
        Accum::Replace,
        MatRef::from_row_major_slice(x, n, inp),
        MatRef::from_row_major_slice(w, out, inp).transpose(),
        1.0f32,
        Par::rayon(0),
    );
    y
}

fn sum_sq(v: &[f32]) -> f64 {
    v.iter().map(|&a| (a as f64) * (a as f64)).sum()
}

/// `Σ‖e − z·cᵀ‖²` for the refinement `c` applied to the masked inputs `z`.
fn refined_error(e: &[f32], z: &[f32], n: usize, c: &RefinementColumns) -> f64 {
    let corr = x_wt(z, n, &c.dequantize(), c.out, c.in_dim);
    e.iter()
        .zip(&corr)
        .map(|(&a, &b)| {
            let d = (a - b) as f64;
            d * d
        })
        .sum()
}

/// Divides each row's channel i by `s_i`, or borrows `x` when there are no scales.
fn scaled<'x>(x: &'x [f32], inv: &Option<Vec<f32>>) -> std::borrow::Cow<'x, [f32]> {
    match inv {
        None => std::borrow::Cow::Borrowed(x),
        Some(inv) => std::borrow::Cow::Owned(
            x.chunks_exact(inv.len())
                .flat_map(|row| row.iter().zip(inv).map(|(a, b)| a * b))
                .collect(),
        ),
    }
}

impl LayerContext<'_> {
    fn set_in_dim(&self, set: ProjectionSet) -> usize {
        let c = self.runner.config();
        match set {
            ProjectionSet::Qkv | ProjectionSet::GateUp => c.hidden_size,
            ProjectionSet::O => c.q_dim(),
            ProjectionSet::Down => c.intermediate_size,
        }
    }

    /// Converts block `l`; returns its report, the resident bits of its linears and their
    /// weight count. `calib_h` / `held_h` advance to the next block's input.
    pub(super) fn process(
        &self,
        l: usize,
        calib_h: &mut [Vec<f32>],
        held_h: &mut [Vec<f32>],
        sink: &mut Sink<'_>,
    ) -> Result<(LayerReport, u64, u64), ConvertError> {
        let t0 = Instant::now();
        let c = self.runner.config().clone();
        let t = self.tensors;
        let p = format!("model.layers.{l}");
        let dims = |name: &str| -> (usize, usize, bool) {
            match name {
                "self_attn.q_proj" => (c.q_dim(), c.hidden_size, c.attention_bias),
                "self_attn.k_proj" | "self_attn.v_proj" => {
                    (c.kv_dim(), c.hidden_size, c.attention_bias)
                }
                "self_attn.o_proj" => (c.hidden_size, c.q_dim(), false),
                "mlp.gate_proj" | "mlp.up_proj" => (c.intermediate_size, c.hidden_size, false),
                _ => (c.hidden_size, c.intermediate_size, false),
            }
        };
        let mut sets: Vec<Vec<Proj>> = ProjectionSet::ALL
            .iter()
            .map(|set| {
                set.projections()
                    .iter()
                    .map(|n| {
                        let (rows, cols, bias) = dims(n);
                        load_proj(t, format!("{p}.{n}"), rows, cols, bias)
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<_, _>>()?;
        let mut attn_norm = load_vector(t, &format!("{p}.input_layernorm.weight"), c.hidden_size)?;
        let mut mlp_norm = load_vector(
            t,
            &format!("{p}.post_attention_layernorm.weight"),
            c.hidden_size,
        )?;
        let qk_norms = if c.qk_norm {
            Some([
                load_vector(t, &format!("{p}.self_attn.q_norm.weight"), c.head_dim)?,
                load_vector(t, &format!("{p}.self_attn.k_norm.weight"), c.head_dim)?,
            ])
        } else {
            None
        };
        let factory = FloatLinearFactory {
            precision: WeightPrecision::F32,
        };
        let block = self.runner.load_layer(t, &factory, l)?;

        // 1. Input statistics (activation-aware quantizers only).
        let (input_stats, guided) = if self.quantizer.needs_calibration() {
            let (stats, guided) = self.input_stats(&block, l, calib_h)?;
            (Some(stats), guided)
        } else {
            (None, BTreeMap::new())
        };

        // 2. Resident quantization, o and down first (their scales fold into v and up).
        let gqa = c.num_key_value_heads != c.num_attention_heads;
        let mut inv_scales: [Option<Vec<f32>>; 4] = Default::default();
        let mut quant_info = BTreeMap::new();
        use ProjectionSet::{Down, GateUp, Qkv, O};
        for set in [O, Down, Qkv, GateUp] {
            let i = set.index();
            let quantized = {
                let views: Vec<WeightView<'_>> = sets[i]
                    .iter()
                    .map(|p| WeightView {
                        name: &p.prefix,
                        data: &p.w,
                        rows: p.rows,
                        cols: p.cols,
                        kron: self
                            .kron
                            .and_then(|m| m.get(&format!("{}.weight", p.prefix)))
                            .map(|f| Kron {
                                h_in: &f.h_in,
                                h_out: &f.h_out,
                            }),
                        fisher: self
                            .fisher
                            .and_then(|m| m.get(&format!("{}.weight", p.prefix)))
                            .map(|(_, _, f)| &f[..]),
                        imatrix: self
                            .options
                            .imatrix
                            .as_deref()
                            .and_then(|m| m.get(&format!("{}.weight", p.prefix))),
                        guided: guided.get(&format!("{}.weight", p.prefix)),
                    })
                    .collect();
                let context = SetContext {
                    set,
                    scales_foldable: set != O || !gqa,
                };
                let stats = input_stats.as_ref().map(|s| &s[i]);
                self.quantizer.quantize_set(&views, stats, context)?
            };
            if let Some(s) = &quantized.input_scales {
                for proj in &mut sets[i] {
                    proj.w = scale_columns(&proj.w, proj.cols, s);
                }
                match set {
                    O => {
                        let v = &mut sets[Qkv.index()][2];
                        fold_into_rows(&mut v.w, v.cols, s);
                        if let Some(b) = &mut v.bias {
                            fold_into_rows(b, 1, s);
                        }
                    }
                    Down => {
                        let up = &mut sets[GateUp.index()][1];
                        fold_into_rows(&mut up.w, up.cols, s);
                    }
                    Qkv => fold_into_norm(&mut attn_norm, s),
                    GateUp => fold_into_norm(&mut mlp_norm, s),
                }
                inv_scales[i] = Some(s.iter().map(|v| 1.0 / v).collect());
            }
            for (proj, w) in sets[i].iter_mut().zip(quantized.weights) {
                proj.q = Some(w);
            }
            if !quantized.info.is_empty() {
                quant_info.insert(set.name().to_string(), quantized.info);
            }
        }

        // 3. Refinement statistics on the inputs the quantized weights see; held-out inputs;
        //    advance the residual streams.
        //    A ladder gathers every rung's statistics in this one pass.
        let o = self.options;
        let mut stats: Vec<Vec<RefinementStats>> = ProjectionSet::ALL
            .iter()
            .map(|&s| {
                o.rungs(s)
                    .iter()
                    .map(|&k| RefinementStats::new(self.set_in_dim(s), k))
                    .collect()
            })
            .collect();
        let mut bundle_stats: Vec<RefinementStats> = if o.fit && o.mlp.bundles() {
            o.rungs(Down)
                .iter()
                .map(|&k| RefinementStats::new(c.intermediate_size, bundle_budget(k)))
                .collect()
        } else {
            Vec::new()
        };
        for h in calib_h.iter_mut() {
            let mut obs = |_l: usize, set: ProjectionSet, x: &[f32], rows: usize| {
                let x = scaled(x, &inv_scales[set.index()]);
                for st in &mut stats[set.index()] {
                    st.add_rows(&x, rows);
                }
                if set == Down {
                    for b in &mut bundle_stats {
                        b.add_rows(&x, rows);
                    }
                }
            };
            self.runner.forward_layer(&block, l, h, Some(&mut obs))?;
        }
        let mut held_x: [Vec<f32>; 4] = Default::default();
        for h in held_h.iter_mut() {
            let mut obs = |_l: usize, set: ProjectionSet, x: &[f32], _rows: usize| {
                held_x[set.index()].extend_from_slice(&scaled(x, &inv_scales[set.index()]));
            };
            self.runner.forward_layer(&block, l, h, Some(&mut obs))?;
        }
        drop(block);

        // 4. Refinement per set: R = W' − Ŵ, fitted C at every rung, 4-bit columns,
        //    held-out errors at the file's default budget.
        let mut reports = Vec::new();
        for set in ProjectionSet::ALL {
            let i = set.index();
            let k = o.k[i];
            let residuals = sets[i]
                .iter()
                .map(Proj::residual)
                .collect::<Result<Vec<_>, _>>()?;
            let measure = !held_x[i].is_empty();
            let stacked: Vec<f32> = if o.fit || measure {
                residuals.concat()
            } else {
                Vec::new()
            };
            let fit_at = |st: &RefinementStats| {
                fit_refinement(&stacked, st, o.fit_spec).map_err(|source| ConvertError::Refine {
                    layer: l,
                    set: set.name(),
                    source,
                })
            };
            let in_dim = self.set_in_dim(set);
            let n_held = held_x[i].len() / in_dim;
            let z: Vec<f32> = if measure {
                held_x[i]
                    .chunks_exact(in_dim)
                    .flat_map(|row| mask_top_k(row, k))
                    .collect()
            } else {
                Vec::new()
            };
            let mut rep = SetReport {
                set: set.name().to_string(),
                k,
                ..Default::default()
            };
            // The plain residual's columns are written without --fit and scored against the
            // held-out text; a fitted conversion with no held-out text never reads them, and
            // their grid search costs as much as the fitted columns' own.
            let plain: Vec<Option<RefinementColumns>> = sets[i]
                .iter()
                .zip(&residuals)
                .map(|(proj, r)| {
                    (!o.fit || measure).then(|| quantize_columns_4bit(r, proj.rows, proj.cols))
                })
                .collect();
            for (rung, st) in o.rungs(set).into_iter().zip(&stats[i]) {
                let at_default = rung == k;
                let fitted = if o.fit || (measure && at_default) {
                    Some(fit_at(st)?)
                } else {
                    None
                };
                let mut row0 = 0;
                for ((proj, r), plain) in sets[i].iter_mut().zip(&residuals).zip(&plain) {
                    let (rows, cols) = (proj.rows, proj.cols);
                    let fit = fitted.as_ref().map(|f| {
                        quantize_columns_4bit(&f[row0 * cols..(row0 + rows) * cols], rows, cols)
                    });
                    row0 += rows;
                    if measure && at_default {
                        let x = &held_x[i];
                        rep.signal += sum_sq(&x_wt(x, n_held, &proj.w, rows, cols));
                        let e = x_wt(x, n_held, r, rows, cols);
                        rep.base += sum_sq(&e);
                        if let Some(plain) = plain {
                            rep.plain += refined_error(&e, &z, n_held, plain);
                        }
                        if let Some(f) = &fit {
                            rep.fitted += refined_error(&e, &z, n_held, f);
                        }
                    }
                    // Both are present when chosen: --fit fits every rung, and the plain
                    // columns are quantized whenever --fit is off.
                    let columns = if o.fit { fit } else { plain.clone() };
                    if let Some(columns) = columns {
                        proj.refine.push((o.section_rung(rung), columns));
                    }
                }
            }
            if measure {
                reports.push(rep);
            }
        }

        // 5. Sections: norms, then per projection codes / scales / zeros / bias / refinement,
        //    then the MLP's neuron bundles.
        let hidden = c.hidden_size as u64;
        sink.put_f32(
            format!("{p}.input_layernorm.weight"),
            vec![hidden],
            &attn_norm,
        )?;
        if let Some([qn, kn]) = &qk_norms {
            let hd = vec![c.head_dim as u64];
            sink.put_f32(format!("{p}.self_attn.q_norm.weight"), hd.clone(), qn)?;
            sink.put_f32(format!("{p}.self_attn.k_norm.weight"), hd, kn)?;
        }
        sink.put_f32(
            format!("{p}.post_attention_layernorm.weight"),
            vec![hidden],
            &mlp_norm,
        )?;
        let (mut code_bits, mut weights) = (0u64, 0u64);
        let tier = o.refine_tier;
        for set in ProjectionSet::ALL {
            let channels = o.mlp.channels() || matches!(set, Qkv | O);
            for proj in &sets[set.index()] {
                let (rows, cols) = (proj.rows as u64, proj.cols as u64);
                let name = &proj.prefix;
                match proj.quantized()? {
                    ResidentWeight::Group(q) => sink.put_group(&format!("{name}.weight"), q)?,
                    ResidentWeight::Trellis(t) => sink.put_trellis(name, t)?,
                    ResidentWeight::Gguf(t) => sink.put_gguf(&format!("{name}.weight"), t)?,
                    ResidentWeight::Lut(q) => sink.put_lut(&format!("{name}.weight"), q)?,
                }
                code_bits += 8 * proj.quantized()?.size_in_bytes() as u64;
                weights += rows * cols;
                if let Some(b) = &proj.bias {
                    sink.put_f32(format!("{name}.bias"), vec![rows], b)?;
                }
                for (rung, r) in proj.refine.iter().filter(|_| channels) {
                    let layout = Layout::ColumnNibbles {
                        out: rows,
                        inp: cols,
                    };
                    let section = columns_section(name, *rung);
                    sink.put(section.clone(), tier, layout, &r.packed)?;
                    sink.put_f16(format!("{section}.scales"), vec![rows], &r.row_scales)?;
                }
            }
        }
        if o.mlp.bundles() {
            let gu = &sets[GateUp.index()];
            let down = &sets[Down.index()][0];
            let d_res = down.residual()?;
            let (gate_res, up_res) = (gu[0].residual()?, gu[1].residual()?);
            let (hidden, ffn) = (c.hidden_size, c.intermediate_size);
            for (ri, rung) in o.rungs(Down).into_iter().enumerate() {
                let d_ref = match bundle_stats.get(ri) {
                    Some(bs) => fit_refinement(&d_res, bs, o.fit_spec).map_err(|source| {
                        ConvertError::Refine {
                            layer: l,
                            set: "bundles",
                            source,
                        }
                    })?,
                    None => d_res.clone(),
                };
                let b = build_bundles(&gate_res, &up_res, &d_ref, &down.w, hidden, ffn);
                let layout = Layout::NeuronBundles {
                    neurons: ffn as u64,
                    hidden: hidden as u64,
                };
                let section = bundles_section(&p, o.section_rung(rung));
                sink.put(section.clone(), tier, layout, &b.packed)?;
                sink.put_f16(
                    format!("{section}.row_scales"),
                    vec![2, ffn as u64],
                    &b.row_scales,
                )?;
                sink.put_f16(
                    format!("{section}.col_scales"),
                    vec![2, hidden as u64],
                    &b.col_scales,
                )?;
            }
        }

        let report = LayerReport {
            layer: l,
            sets: reports,
            quant_info,
            seconds: t0.elapsed().as_secs_f64(),
        };
        Ok((report, code_bits, weights))
    }

    /// Advances the streams through float block `l` without converting it: how a resumed
    /// conversion rebuilds the streams of the blocks its checkpoint says are done.
    pub(super) fn replay(
        &self,
        l: usize,
        calib_h: &mut [Vec<f32>],
        held_h: &mut [Vec<f32>],
    ) -> Result<(), ConvertError> {
        let factory = FloatLinearFactory {
            precision: WeightPrecision::F32,
        };
        let block = self.runner.load_layer(self.tensors, &factory, l)?;
        for h in calib_h.iter_mut().chain(held_h.iter_mut()) {
            // An observer, even one that ignores what it sees, keeps the norm and the
            // projections unfused: the arithmetic of `process`'s pass, bit for bit.
            let mut ignore = |_l: usize, _s: ProjectionSet, _x: &[f32], _rows: usize| {};
            self.runner.forward_layer(&block, l, h, Some(&mut ignore))?;
        }
        Ok(())
    }

    /// `E[x xᵀ]` and `E|x|` per projection set over the calibration sequences (the streams
    /// are not advanced: this pass runs on copies) and, with GuidedQuant saliencies, each
    /// projection's guided Hessians over the sequences they were measured on, keyed by weight
    /// name: formed here, one layer at a time, from the inputs the quantized model's stream
    /// gives the layer (see `GuidedSaliency`).
    fn input_stats(
        &self,
        block: &DecoderLayer<CpuBackend>,
        l: usize,
        calib_h: &[Vec<f32>],
    ) -> Result<([InputStats; 4], BTreeMap<String, GuidedHessian>), ConvertError> {
        // Weight name → (its saliencies, the Hessians being summed), per set.
        let mut guided: Vec<Vec<(String, &GuidedSaliency, GuidedHessian)>> = ProjectionSet::ALL
            .iter()
            .map(|&set| {
                set.projections()
                    .iter()
                    .filter_map(|n| {
                        let name = format!("model.layers.{l}.{n}.weight");
                        let s = self.guided?.get(&name)?;
                        let h = GuidedHessian::zeros(self.set_in_dim(set), s.groups);
                        Some((name, s, h))
                    })
                    .collect()
            })
            .collect();
        let mut acc: Vec<(Vec<f32>, Vec<f64>, u64)> = ProjectionSet::ALL
            .iter()
            .map(|&s| {
                let d = self.set_in_dim(s);
                (vec![0.0f32; d * d], vec![0.0f64; d], 0)
            })
            .collect();
        let mut failure = None;
        for (b, h) in calib_h.iter().enumerate() {
            let mut h = h.clone();
            let mut obs = |_l: usize, set: ProjectionSet, x: &[f32], rows: usize| {
                for (name, saliency, hessian) in &mut guided[set.index()] {
                    // Sequence b's saliencies cover its predicted positions (all but the last
                    // token); sequences past the gradient pass have none.
                    let Some(s) = saliency.sequences.get(b) else {
                        continue;
                    };
                    let t = (s.len() / saliency.groups).min(rows);
                    let (d, g) = (hessian.cols, saliency.groups);
                    if let Err(e) = hessian.accumulate(&x[..t * d], &s[..t * g], t) {
                        failure.get_or_insert((name.clone(), e));
                    }
                }
                let (gram, abs, n) = &mut acc[set.index()];
                let d = abs.len();
                faer::linalg::matmul::matmul(
                    MatMut::from_row_major_slice_mut(gram, d, d),
                    Accum::Add,
                    MatRef::from_row_major_slice(x, rows, d).transpose(),
                    MatRef::from_row_major_slice(x, rows, d),
                    1.0f32,
                    Par::rayon(0),
                );
                for row in x.chunks_exact(d) {
                    for (a, &v) in abs.iter_mut().zip(row) {
                        *a += v.abs() as f64;
                    }
                }
                *n += rows as u64;
            };
            self.runner
                .forward_layer(block, l, &mut h, Some(&mut obs))?;
        }
        if let Some((name, e)) = failure {
            return Err(ConvertError::Options(format!(
                "{name}: guided Hessian of layer {l}: {e}"
            )));
        }
        let stats: Vec<InputStats> = acc
            .into_iter()
            .map(|(gram, abs, n)| {
                let inv = 1.0 / n.max(1) as f64;
                InputStats {
                    cols: abs.len(),
                    tokens: n,
                    gram: gram.iter().map(|&g| (g as f64 * inv) as f32).collect(),
                    abs_mean: abs.iter().map(|&a| (a * inv) as f32).collect(),
                }
            })
            .collect();
        let stats: [InputStats; 4] = stats
            .try_into()
            .map_err(|_| ConvertError::Options("internal: four projection sets".into()))?;
        let hessians = guided
            .into_iter()
            .flatten()
            .map(|(name, _, h)| (name, h))
            .collect();
        Ok((stats, hessians))
    }
}

//! Why refinement recovers less of a trellis base's error than of AWQ's: the fitted columns'
//! held-out projection error for QTIP 2-bit with its error feedback (LDLQ on H = E[xxᵀ]) and
//! without it (H = I: each rotated weight rounded on its own, same trellis, same Hadamard
//! rotation), and with LDLQ on the inputs the refinement leaves to the base
//! (H_rest = E[(x − z)(x − z)ᵀ], z = the top-k part of x), for both fit priors and two ridge sizes, against the in-sample ceiling (the
//! unquantized least-squares C on the held-out inputs themselves).
//!
//! Per layer and projection set: W from the float checkpoint, inputs from the float model
//! (calibration text for H, M and G; held-out text for the errors), k = 16 per 1024. Errors
//! are Σ over held-out tokens of ‖(W − Ŵ)x − C z‖², reported over the base error Σ‖(W − Ŵ)x‖²
//! (as `sfx-convert` reports them), C quantized to 4 bits as stored.
//!
//! ```text
//! cargo run --release -p sfx-calibration --example trellis_recovery -- \
//!     <float model> [calib_seqs] [heldout_seqs] [layers,...] [calib text] [held-out text]
//! ```

mod common;

use anyhow::{anyhow, Context, Result};
use faer::Mat;
use sfx_calibration::quant::{InputStats, Qtip, ResidentQuantizer, SetContext, WeightView};
use sfx_calibration::refine::{fit_refinement, quantize_columns_4bit, FitPrior, FitSpec, Lambda};
use sfx_calibration::stats::{mask_top_k, RefinementStats};
use sfx_formats::checkpoint::Checkpoint;
use sfx_formats::corpus;
use sfx_runtime::{LogitsMode, Model, ModelOptions, ProjectionSet};
use std::collections::BTreeMap;
use std::time::Instant;
use tokenizers::Tokenizer;

const SEQ: usize = 512;
const K: usize = 16;

/// `count` windows of `SEQ` tokens spread evenly over `text`.
fn windows(tok: &Tokenizer, text: &str, count: usize) -> Result<Vec<Vec<u32>>> {
    let ids = tok
        .encode(text, false)
        .map_err(|e| anyhow!("tokenize: {e}"))?
        .get_ids()
        .to_vec();
    if ids.len() < count * SEQ {
        return Err(anyhow!(
            "text has {} tokens, need {}",
            ids.len(),
            count * SEQ
        ));
    }
    let stride = (ids.len() - SEQ) / count.max(1);
    Ok((0..count)
        .map(|i| ids[i * stride..i * stride + SEQ].to_vec())
        .collect())
}

fn to_mat(v: &[f32], rows: usize, cols: usize) -> Mat<f64> {
    Mat::from_fn(rows, cols, |i, j| v[i * cols + j] as f64)
}

/// Σ‖E − Z Cᵀ‖² with E = X Rᵀ.
fn error(e: &Mat<f64>, z: &Mat<f64>, c: Option<&Mat<f64>>) -> f64 {
    match c {
        None => e.squared_norm_l2(),
        Some(c) => (e - z * c.transpose()).squared_norm_l2(),
    }
}

/// Per-set accumulators for every fit variant.
#[derive(Default)]
struct Sums {
    signal: f64,
    base: f64,
    /// name → Σ error
    fits: BTreeMap<String, f64>,
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let source = args
        .get(1)
        .context("usage: trellis_recovery <float model> …")?;
    let n_calib: usize = args.get(2).map_or(Ok(32), |s| s.parse())?;
    let n_held: usize = args.get(3).map_or(Ok(4), |s| s.parse())?;
    let calib_name = args.get(5).map_or("brown", |s| s.as_str());
    let held_name = args.get(6).map_or("austen/persuasion", |s| s.as_str());
    let assets = corpus::assets_dir();
    let t0 = Instant::now();
    let ckpt = Checkpoint::open(source)?;
    let model = Model::load_cpu(
        &ckpt.config,
        ckpt.tensors.as_ref(),
        &ModelOptions::default(),
    )?;
    let tok = common::tokenizer(&ckpt)?;
    let n_layers = ckpt.config.num_hidden_layers;
    let layers: Vec<usize> = match args.get(4) {
        Some(s) => s.split(',').map(|v| v.parse()).collect::<Result<_, _>>()?,
        None => vec![3, n_layers / 2, n_layers - 3],
    };
    let calib = windows(
        &tok,
        &corpus::load_named_text(&assets, calib_name)?,
        n_calib,
    )?;
    let held = windows(&tok, &corpus::load_named_text(&assets, held_name)?, n_held)?;
    eprintln!(
        "loaded in {:.1}s; layers {layers:?}; {n_calib}×{SEQ} {calib_name} tokens, \
         {n_held}×{SEQ} {held_name} tokens",
        t0.elapsed().as_secs_f64()
    );

    // Calibration pass: H = Σ x xᵀ (f64) and M, G at k; held-out inputs.
    type Key = (usize, ProjectionSet);
    let mut gram: BTreeMap<Key, (Vec<f64>, u64)> = BTreeMap::new();
    let mut stats: BTreeMap<Key, RefinementStats> = BTreeMap::new();
    let mut held_stats: BTreeMap<Key, RefinementStats> = BTreeMap::new();
    let mut heldx: BTreeMap<Key, (Vec<f32>, usize)> = BTreeMap::new();
    {
        let mut obs = |layer: usize, set: ProjectionSet, x: &[f32], rows: usize| {
            if !layers.contains(&layer) {
                return;
            }
            let d = x.len() / rows;
            let (g, n) = gram
                .entry((layer, set))
                .or_insert_with(|| (vec![0.0; d * d], 0));
            for row in x.chunks_exact(d) {
                for (i, &a) in row.iter().enumerate() {
                    if a == 0.0 {
                        continue;
                    }
                    let gi = &mut g[i * d..(i + 1) * d];
                    for (gij, &b) in gi.iter_mut().zip(row) {
                        *gij += f64::from(a) * f64::from(b);
                    }
                }
            }
            *n += rows as u64;
            stats
                .entry((layer, set))
                .or_insert_with(|| RefinementStats::new(d, K))
                .add_rows(x, rows);
        };
        for seq in &calib {
            let mut cache = model.new_cache(SEQ)?;
            model.forward_observed(seq, &mut cache, LogitsMode::None, &mut obs)?;
        }
        let mut obs = |layer: usize, set: ProjectionSet, x: &[f32], rows: usize| {
            if layers.contains(&layer) {
                let d = x.len() / rows;
                let e = heldx.entry((layer, set)).or_default();
                e.0.extend_from_slice(x);
                e.1 += rows;
                held_stats
                    .entry((layer, set))
                    .or_insert_with(|| RefinementStats::new(d, K))
                    .add_rows(x, rows);
            }
        };
        for seq in &held {
            let mut cache = model.new_cache(SEQ)?;
            model.forward_observed(seq, &mut cache, LogitsMode::None, &mut obs)?;
        }
    }
    eprintln!("statistics in {:.1}s", t0.elapsed().as_secs_f64());

    let qtip = Qtip::new(2);
    let fits: Vec<(String, FitSpec)> = [
        ("residual 1x", FitPrior::Residual, 1.0),
        ("residual 0.1x", FitPrior::Residual, 0.1),
        ("zero 1x", FitPrior::Zero, 1.0),
        ("zero 0.1x", FitPrior::Zero, 0.1),
    ]
    .into_iter()
    .map(|(n, prior, m)| {
        (
            n.to_string(),
            FitSpec {
                lambda: Lambda::MeanDiag(m),
                prior,
            },
        )
    })
    .collect();
    // sums[(variant, set)]
    let mut sums: BTreeMap<(&str, ProjectionSet), Sums> = BTreeMap::new();
    for &layer in &layers {
        for set in ProjectionSet::ALL {
            let key = (layer, set);
            let (g, n) = &gram[&key];
            let d = stats[&key].in_dim;
            let h: Vec<f32> = g.iter().map(|&v| (v / *n as f64) as f32).collect();
            let identity: Vec<f32> = (0..d * d)
                .map(|i| if i / d == i % d { 1.0 } else { 0.0 })
                .collect();
            let mut w = Vec::new();
            let mut shapes = Vec::new();
            for p in set.projections() {
                let name = format!("model.layers.{layer}.{p}.weight");
                let view = ckpt.tensors.tensor(&name)?;
                shapes.push((name, view.shape[0], view.shape[1]));
                w.push(view.to_f32_vec());
            }
            let views: Vec<WeightView<'_>> = shapes
                .iter()
                .zip(&w)
                .map(|((name, rows, cols), data)| WeightView {
                    name,
                    data,
                    rows: *rows,
                    cols: *cols,
                    kron: None,
                    fisher: None,
                    imatrix: None,
                    guided: None,
                })
                .collect();
            let (xh, rows) = &heldx[&key];
            let xm = to_mat(xh, *rows, d);
            let z: Vec<f32> = xh.chunks_exact(d).flat_map(|r| mask_top_k(r, K)).collect();
            let zm = to_mat(&z, *rows, d);
            // E[(x − z)(x − z)ᵀ] = H − G − Gᵀ + M: the inputs the refinement leaves to the
            // base, for a base that rounds knowing the top-k channels will be corrected.
            let st = &stats[&key];
            let inv = 1.0 / st.n as f64;
            let h_rest: Vec<f32> = (0..d * d)
                .map(|ij| {
                    let (i, j) = (ij / d, ij % d);
                    let v = g[ij] / *n as f64 - (st.g[ij] + st.g[j * d + i]) * inv + st.m[ij] * inv;
                    v as f32
                })
                .collect();
            for (variant, hess) in [
                ("LDLQ (H = E[xx^T])", &h),
                ("LDLQ on H_rest", &h_rest),
                ("no feedback (H = I)", &identity),
            ] {
                let input = InputStats {
                    cols: d,
                    tokens: *n,
                    gram: hess.clone(),
                    abs_mean: vec![0.0; d],
                };
                let t = Instant::now();
                let q = qtip.quantize_set(
                    &views,
                    Some(&input),
                    SetContext {
                        set,
                        scales_foldable: false,
                    },
                )?;
                let mut r = Vec::new();
                for (qw, (v, (name, _, _))) in q.weights.iter().zip(views.iter().zip(&shapes)) {
                    let deq = qw.dequantize(name)?;
                    r.extend(v.data.iter().zip(&deq).map(|(a, b)| a - b));
                }
                let out = r.len() / d;
                let e = &xm * to_mat(&r, out, d).transpose();
                let s = sums.entry((variant, set)).or_default();
                let wall: Vec<f32> = w.concat();
                s.signal += (&xm * to_mat(&wall, out, d).transpose()).squared_norm_l2();
                s.base += error(&e, &zm, None);
                let plain = quantize_columns_4bit(&r, out, d).dequantize();
                *s.fits.entry("plain R".into()).or_default() +=
                    error(&e, &zm, Some(&to_mat(&plain, out, d)));
                for (name, spec) in &fits {
                    let c = fit_refinement(&r, &stats[&key], *spec)?;
                    let c = quantize_columns_4bit(&c, out, d).dequantize();
                    *s.fits.entry(name.clone()).or_default() +=
                        error(&e, &zm, Some(&to_mat(&c, out, d)));
                }
                // The least squares on the held-out inputs themselves, unquantized (the 4-bit
                // levels of a nearly unregularised C are dominated by a few huge entries): no
                // C at this k does better on this text.
                let ceiling = fit_refinement(
                    &r,
                    &held_stats[&key],
                    FitSpec {
                        lambda: Lambda::MeanDiag(1e-6),
                        prior: FitPrior::Zero,
                    },
                )?;
                *s.fits.entry("in-sample f32 ceiling".into()).or_default() +=
                    error(&e, &zm, Some(&to_mat(&ceiling, out, d)));
                eprintln!(
                    "layer {layer} {} {variant}: {:.1}s",
                    set.name(),
                    t.elapsed().as_secs_f64()
                );
            }
        }
    }

    println!("held-out error over base error, k = {K}, layers {layers:?} (sum over layers)");
    for ((variant, set), s) in &sums {
        let fits: Vec<String> = s
            .fits
            .iter()
            .map(|(n, v)| format!("{n} {:.3}", v / s.base))
            .collect();
        println!(
            "{variant:<20} {:<4} base/signal {:.3e}  {}",
            set.name(),
            s.base / s.signal,
            fits.join("  ")
        );
    }
    Ok(())
}

//! Projection-output error of plain vs fitted refinement on the real SmolLM2-135M.
//!
//! Resident quantizer: RTN 3-bit, group 128 (`sfx_calibration::quant::Rtn`). "Float" W is the
//! checkpoint's weight as loaded (the bundled GGUF is Q4_1, so W = its dequantization).
//! Statistics M, G are collected on Brown calibration text; errors are measured on held-out
//! wiki text as the mean over tokens of ‖Wx − y‖² summed over the set's outputs, with
//! y = Ŵx, Ŵx + plain refinement (4-bit R), Ŵx + fitted refinement (4-bit C) at the same k.
//!
//! ```text
//! cargo run --release -p sfx-calibration --example refine_error -- [calib_seqs] [heldout_seqs] [layers,...]
//! ```

mod common;

use anyhow::{Context, Result};
use faer::Mat;
use sfx_calibration::quant::{Rtn, WeightView};
use sfx_calibration::refine::{fit_refinement, quantize_columns_4bit};
use sfx_calibration::stats::{mask_top_k, RefinementStats};
use sfx_formats::checkpoint::Checkpoint;
use sfx_formats::corpus;
use sfx_runtime::{LogitsMode, Model, ModelOptions, ProjectionSet};
use std::collections::BTreeMap;
use std::time::Instant;
use tokenizers::Tokenizer;

const SEQ: usize = 512;
const KS: [usize; 2] = [16, 32];

/// Token sequences of `SEQ` tokens from `text`.
fn sequences(tok: &Tokenizer, text: &str, count: usize) -> Result<Vec<Vec<u32>>> {
    let ids = common::prefix_tokens(tok, text, count * SEQ)?;
    Ok(ids.chunks(SEQ).map(|c| c.to_vec()).collect())
}

/// Mean over rows of ‖X Rᵀ − Z Cᵀ‖² (per row, summed over outputs); `c = None` → Z Cᵀ = 0.
fn error(x: &Mat<f64>, z: &Mat<f64>, r: &Mat<f64>, c: Option<&Mat<f64>>) -> f64 {
    let mut e = x * r.transpose();
    if let Some(c) = c {
        e -= z * c.transpose();
    }
    e.squared_norm_l2() / x.nrows() as f64
}

fn to_mat(v: &[f32], rows: usize, cols: usize) -> Mat<f64> {
    Mat::from_fn(rows, cols, |i, j| v[i * cols + j] as f64)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let n_calib: usize = args.get(1).map_or(Ok(8), |s| s.parse())?;
    let n_held: usize = args.get(2).map_or(Ok(4), |s| s.parse())?;
    let assets = corpus::assets_dir();
    let t0 = Instant::now();
    let ckpt = Checkpoint::open(
        assets
            .join("SmolLM2-135M-Instruct.Q4_1.gguf")
            .to_str()
            .context("path")?,
    )?;
    let model = Model::load_cpu(
        &ckpt.config,
        ckpt.tensors.as_ref(),
        &ModelOptions::default(),
    )?;
    let tok = common::tokenizer(&ckpt)?;
    let n_layers = ckpt.config.num_hidden_layers;
    let layers: Vec<usize> = match args.get(3) {
        Some(s) => s.split(',').map(|v| v.parse()).collect::<Result<_, _>>()?,
        None => vec![0, n_layers / 3, 2 * n_layers / 3, n_layers - 1],
    };
    let calib = sequences(&tok, &corpus::brown_text(&assets)?, n_calib)?;
    let held = sequences(&tok, &corpus::wiki_text(&assets)?, n_held)?;
    eprintln!(
        "loaded in {:.1}s; layers {layers:?}; calibration {n_calib}×{SEQ} Brown tokens, held-out {n_held}×{SEQ} wiki tokens",
        t0.elapsed().as_secs_f64()
    );

    // Calibration pass: M, G per (layer, set, k).
    let t1 = Instant::now();
    let mut stats: BTreeMap<(usize, ProjectionSet), Vec<RefinementStats>> = BTreeMap::new();
    {
        let mut obs = |layer: usize, set: ProjectionSet, x: &[f32], rows: usize| {
            if !layers.contains(&layer) {
                return;
            }
            let d = x.len() / rows;
            let e = stats
                .entry((layer, set))
                .or_insert_with(|| KS.iter().map(|&k| RefinementStats::new(d, k)).collect());
            for s in e.iter_mut() {
                s.add_rows(x, rows);
            }
        };
        for seq in &calib {
            let mut cache = model.new_cache(SEQ)?;
            model.forward_observed(seq, &mut cache, LogitsMode::None, &mut obs)?;
        }
    }
    eprintln!("calibration pass {:.1}s", t1.elapsed().as_secs_f64());

    // Held-out inputs.
    let mut heldx: BTreeMap<(usize, ProjectionSet), (Vec<f32>, usize)> = BTreeMap::new();
    {
        let mut obs = |layer: usize, set: ProjectionSet, x: &[f32], rows: usize| {
            if layers.contains(&layer) {
                let e = heldx.entry((layer, set)).or_default();
                e.0.extend_from_slice(x);
                e.1 += rows;
            }
        };
        for seq in &held {
            let mut cache = model.new_cache(SEQ)?;
            model.forward_observed(seq, &mut cache, LogitsMode::None, &mut obs)?;
        }
    }

    // sums[set] = [Ŵ, plain k16, fitted k16, plain k32, fitted k32]
    let mut sums: BTreeMap<ProjectionSet, [f64; 5]> = BTreeMap::new();
    let (mut t_fit, mut t_quant) = (0.0, 0.0);
    let rtn = Rtn::new(3);
    for &layer in &layers {
        for set in ProjectionSet::ALL {
            let (mut w, mut wq, mut out, mut d) = (Vec::new(), Vec::new(), 0, 0);
            for p in set.projections() {
                let name = format!("model.layers.{layer}.{p}.weight");
                let view = ckpt.tensors.tensor(&name)?;
                let (rows, cols) = (view.shape[0], view.shape[1]);
                let wf = view.to_f32_vec();
                let q = rtn.quantize_group(WeightView {
                    kron: None,
                    fisher: None,
                    imatrix: None,
                    guided: None,
                    name: &name,
                    data: &wf,
                    rows,
                    cols,
                })?;
                wq.extend(q.dequantize());
                w.extend(wf);
                out += rows;
                d = cols;
            }
            let r: Vec<f32> = w.iter().zip(&wq).map(|(a, b)| a - b).collect();
            let (xh, rows) = &heldx[&(layer, set)];
            let xm = to_mat(xh, *rows, d);
            let rm = to_mat(&r, out, d);
            let acc = sums.entry(set).or_default();
            acc[0] += error(&xm, &xm, &rm, None);
            let tq = Instant::now();
            let plain = quantize_columns_4bit(&r, out, d).dequantize();
            t_quant += tq.elapsed().as_secs_f64();
            let plain = to_mat(&plain, out, d);
            for (ki, st) in stats[&(layer, set)].iter().enumerate() {
                let k = st.k_per_1024;
                let z: Vec<f32> = xh.chunks(d).flat_map(|row| mask_top_k(row, k)).collect();
                let zm = to_mat(&z, *rows, d);
                let tf = Instant::now();
                let c = fit_refinement(&r, st, Default::default())?;
                t_fit += tf.elapsed().as_secs_f64();
                let cq = to_mat(&quantize_columns_4bit(&c, out, d).dequantize(), out, d);
                acc[1 + 2 * ki] += error(&xm, &zm, &rm, Some(&plain));
                acc[2 + 2 * ki] += error(&xm, &zm, &rm, Some(&cq));
            }
        }
    }
    let nl = layers.len() as f64;
    println!(
        "RTN3 g128, held-out wiki {}×{SEQ} tokens, calibration Brown {}×{SEQ}; layers {:?}",
        n_held, n_calib, layers
    );
    println!("mean over tokens and layers of ‖Wx − y‖² (relative to Ŵx in parentheses)");
    println!(
        "| set | Ŵx | +plain k16 | +fitted k16 | +plain k32 | +fitted k32 |\n|---|---|---|---|---|---|"
    );
    for (set, a) in &sums {
        let base = a[0];
        let cell = |v: f64| format!("{:.4e} ({:.3})", v / nl, v / base);
        println!(
            "| {} | {:.4e} | {} | {} | {} | {} |",
            set.name(),
            base / nl,
            cell(a[1]),
            cell(a[2]),
            cell(a[3]),
            cell(a[4])
        );
    }
    println!(
        "fit (all solves) {t_fit:.2}s, 4-bit quantization of R {t_quant:.2}s, total {:.1}s",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

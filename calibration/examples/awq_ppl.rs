//! AWQ vs RTN perplexity on the real SmolLM2-135M (group 128, 3 and 4 bits).
//!
//! "Float" is the checkpoint as loaded (the bundled GGUF is Q4_1, so W = its dequantization).
//! Calibration: projection-set inputs from `forward_observed` on Brown text (`calib_seqs` × 512
//! tokens, every `stride`-th token kept as the sample). Every decoder linear is quantized:
//! - down: AWQ (+ clip), scales folded into up_proj's float rows *before* gate/up are searched;
//! - gate/up: AWQ (+ clip), scales folded into post_attention_layernorm;
//! - o: AWQ folded into v_proj rows only without GQA; SmolLM2-135M has GQA (9 heads, 3 KV
//!   heads), so o uses RTN there, as llm-awq does when v and o shapes differ;
//! - q/k/v: AWQ (clip for v only), scales folded into input_layernorm.
//!
//! PPL is measured by building the model from an `OwnedTensors` of f32 tensors holding the
//! folded norms and the DEQUANTIZED weights (`Q(W·diag s)` dequantized); RTN goes through
//! the same dequantized path. Scored: the first 512-token wiki window (511 predictions).
//!
//! ```text
//! cargo run --release -p sfx-calibration --example awq_ppl -- [calib_seqs=8] [stride=4] [clip_steps=20]
//! ```

mod common;

use anyhow::{Context, Result};
use sfx_calibration::quant::awq::{fold_into_norm, fold_into_rows, Awq};
use sfx_calibration::quant::{Rtn, WeightView};
use sfx_formats::checkpoint::Checkpoint;
use sfx_formats::{corpus, ModelConfig, OwnedTensors};
use sfx_runtime::eval::log_softmax_at;
use sfx_runtime::{LogitsMode, Model, ModelOptions, ProjectionSet};
use std::collections::BTreeMap;
use std::time::Instant;

const SEQ: usize = 512;

/// All tensors as f32, by name, with shapes.
type Tensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

fn to_owned(t: &Tensors) -> OwnedTensors {
    let mut o = OwnedTensors::new();
    for (name, (shape, v)) in t {
        o.insert_f32(name.clone(), shape.clone(), v);
    }
    o
}

fn ppl(config: &ModelConfig, t: &Tensors, window: &[u32]) -> Result<f64> {
    let owned = to_owned(t);
    let model = Model::load_cpu(config, &owned, &ModelOptions::default())?;
    let mut cache = model.new_cache(window.len())?;
    let logits = model.forward(window, &mut cache, LogitsMode::All)?;
    let mut nll = 0.0;
    for i in 0..window.len() - 1 {
        let row = logits.row(i).context("logits row")?;
        nll -= log_softmax_at(row, window[i + 1] as usize);
    }
    Ok((nll / (window.len() - 1) as f64).exp())
}

fn lin(layer: usize, p: &str) -> String {
    format!("model.layers.{layer}.{p}.weight")
}

fn view<'a>(t: &'a Tensors, name: &'a str) -> WeightView<'a> {
    let (shape, data) = &t[name];
    WeightView {
        kron: None,
        fisher: None,
        imatrix: None,
        guided: None,
        name,
        data,
        rows: shape[0],
        cols: shape[1],
    }
}

const LINEARS: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

fn rtn_tensors(base: &Tensors, n_layers: usize, bits: u8) -> Result<Tensors> {
    let mut t = base.clone();
    for l in 0..n_layers {
        for p in LINEARS {
            let name = lin(l, p);
            let q = Rtn::new(bits).quantize_group(view(base, &name))?;
            t.get_mut(&name).context("tensor")?.1 = q.dequantize();
        }
    }
    Ok(t)
}

/// Per set name: (Σ AWQ/RTN objective ratio, Σ α, layers).
type SetLogs = BTreeMap<&'static str, (f64, f64, usize)>;

type Samples = BTreeMap<(usize, ProjectionSet), (Vec<f32>, usize)>;

/// AWQ on set `names` of `t` (in place: weights ← dequantized Q(W·diag s)); returns s and α.
fn awq_set(
    t: &mut Tensors,
    awq: &Awq,
    names: &[String],
    clip: &[bool],
    x: &(Vec<f32>, usize),
    log: &mut (f64, f64, usize),
) -> Result<(Vec<f32>, f32)> {
    let set = {
        let views: Vec<WeightView<'_>> = names.iter().map(|n| view(t, n)).collect();
        awq.quantize_set(&views, &x.0, x.1, clip)?
    };
    log.0 += set.error / set.rtn_error;
    log.1 += set.alpha as f64;
    log.2 += 1;
    for (n, q) in names.iter().zip(&set.weights) {
        t.get_mut(n).context("tensor")?.1 = q.dequantize();
    }
    Ok((set.scales, set.alpha))
}

fn awq_tensors(
    base: &Tensors,
    config: &ModelConfig,
    samples: &Samples,
    bits: u8,
    clip_steps: usize,
) -> Result<(Tensors, SetLogs)> {
    let awq = Awq {
        clip_steps,
        ..Awq::new(bits)
    };
    let gqa = config.num_key_value_heads != config.num_attention_heads;
    let mut t = base.clone();
    let mut logs = SetLogs::new();
    for l in 0..config.num_hidden_layers {
        let x = |set| samples.get(&(l, set)).context("missing sample");
        // down ← up rows.
        let (s, _) = awq_set(
            &mut t,
            &awq,
            &[lin(l, "mlp.down_proj")],
            &[true],
            x(ProjectionSet::Down)?,
            logs.entry("d").or_default(),
        )?;
        let up = t.get_mut(&lin(l, "mlp.up_proj")).context("up")?;
        let cols = up.0[1];
        fold_into_rows(&mut up.1, cols, &s);
        // gate/up ← post_attention_layernorm.
        let (s, _) = awq_set(
            &mut t,
            &awq,
            &[lin(l, "mlp.gate_proj"), lin(l, "mlp.up_proj")],
            &[true, true],
            x(ProjectionSet::GateUp)?,
            logs.entry("gu").or_default(),
        )?;
        fold_into_norm(
            &mut t
                .get_mut(&lin(l, "post_attention_layernorm"))
                .context("ln2")?
                .1,
            &s,
        );
        // o: RTN under GQA, else AWQ folded into v rows.
        let o = lin(l, "self_attn.o_proj");
        if gqa {
            let q = Rtn::new(bits).quantize_group(view(&t, &o))?;
            t.get_mut(&o).context("o")?.1 = q.dequantize();
        } else {
            let (s, _) = awq_set(
                &mut t,
                &awq,
                std::slice::from_ref(&o),
                &[true],
                x(ProjectionSet::O)?,
                logs.entry("o").or_default(),
            )?;
            let v = t.get_mut(&lin(l, "self_attn.v_proj")).context("v")?;
            let cols = v.0[1];
            fold_into_rows(&mut v.1, cols, &s);
        }
        // q, k, v ← input_layernorm.
        let (s, _) = awq_set(
            &mut t,
            &awq,
            &[
                lin(l, "self_attn.q_proj"),
                lin(l, "self_attn.k_proj"),
                lin(l, "self_attn.v_proj"),
            ],
            &[false, false, true],
            x(ProjectionSet::Qkv)?,
            logs.entry("qkv").or_default(),
        )?;
        fold_into_norm(
            &mut t.get_mut(&lin(l, "input_layernorm")).context("ln1")?.1,
            &s,
        );
        eprintln!("awq{bits} layer {l} done");
    }
    Ok((t, logs))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let n_calib: usize = args.get(1).map_or(Ok(8), |s| s.parse())?;
    let stride: usize = args.get(2).map_or(Ok(4), |s| s.parse())?;
    let clip_steps: usize = args.get(3).map_or(Ok(20), |s| s.parse())?;
    let assets = corpus::assets_dir();
    let t0 = Instant::now();
    let ckpt = Checkpoint::open(
        assets
            .join("SmolLM2-135M-Instruct.Q4_1.gguf")
            .to_str()
            .context("path")?,
    )?;
    let config = ckpt.config.clone();
    let tok = common::tokenizer(&ckpt)?;
    let mut base: Tensors = BTreeMap::new();
    for name in ckpt.tensors.tensor_names() {
        let v = ckpt.tensors.tensor(&name)?;
        base.insert(name, (v.shape.to_vec(), v.to_f32_vec()));
    }
    let calib = common::prefix_tokens(&tok, &corpus::brown_text(&assets)?, n_calib * SEQ)?;
    let window = common::prefix_tokens(&tok, &corpus::wiki_text(&assets)?, SEQ)?;

    // Calibration pass on the float model: every `stride`-th input row per (layer, set).
    let t1 = Instant::now();
    let mut samples: Samples = BTreeMap::new();
    {
        let model = Model::load_cpu(&config, &to_owned(&base), &ModelOptions::default())?;
        let mut obs = |layer: usize, set: ProjectionSet, x: &[f32], rows: usize| {
            let d = x.len() / rows;
            let e = samples.entry((layer, set)).or_default();
            for row in x.chunks_exact(d).step_by(stride) {
                e.0.extend_from_slice(row);
                e.1 += 1;
            }
        };
        for seq in calib.chunks(SEQ) {
            let mut cache = model.new_cache(SEQ)?;
            model.forward_observed(seq, &mut cache, LogitsMode::None, &mut obs)?;
        }
    }
    let n_rows = samples.values().next().map_or(0, |v| v.1);
    let calib_s = t1.elapsed().as_secs_f64();
    eprintln!(
        "loaded + calibration {:.1}s ({n_rows} sample rows per set)",
        t0.elapsed().as_secs_f64()
    );

    let mut rows = vec![("float".to_string(), ppl(&config, &base, &window)?, 0.0)];
    let mut notes = Vec::new();
    for bits in [3u8, 4] {
        let tq = Instant::now();
        let rtn = rtn_tensors(&base, config.num_hidden_layers, bits)?;
        let rtn_q = tq.elapsed().as_secs_f64();
        rows.push((format!("rtn{bits}"), ppl(&config, &rtn, &window)?, rtn_q));
        drop(rtn);
        let tq = Instant::now();
        let (awq, logs) = awq_tensors(&base, &config, &samples, bits, clip_steps)?;
        let awq_q = tq.elapsed().as_secs_f64();
        rows.push((format!("awq{bits}"), ppl(&config, &awq, &window)?, awq_q));
        for (set, (ratio, alpha, n)) in logs {
            notes.push(format!(
                "awq{bits} {set}: mean calib-objective AWQ/RTN {:.3}, mean α {:.2} over {n} layers",
                ratio / n as f64,
                alpha / n as f64
            ));
        }
    }
    println!(
        "SmolLM2-135M (Q4_1 GGUF dequantized = float), group 128; calibration Brown {n_calib}×{SEQ} \
         ({n_rows} rows/set, stride {stride}); clip steps {clip_steps}; PPL on wiki window 0 ({SEQ} tokens)"
    );
    println!("| variant | PPL | quantize time (s) |\n|---|---|---|");
    for (name, p, t) in &rows {
        println!("| {name} | {p:.3} | {t:.1} |");
    }
    for n in notes {
        println!("{n}");
    }
    println!(
        "calibration pass {calib_s:.1}s, total {:.1}s",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

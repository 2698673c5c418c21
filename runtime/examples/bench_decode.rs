//! Decode and prefill throughput of the float CPU runtime.
//!
//! cargo run --release -p sfx-runtime --example bench_decode -- \
//!     [MODEL (.gguf / HF folder / hub id)] [--precision bf16|f32|native] [--decode N]
//!     [--prefill N] [--context N] [--chunk N] [--vs MODEL2 ...] [--rounds N]
//!
//! With `--vs`, the models (any of .gguf / HF folder / .sfx) decode side by side: `--rounds`
//! interleaved rounds of `--decode` steps each (A, B, …, A, B, …), reporting each model's
//! median tok/s, resident bytes, and its speed ratio to the first model — on a noisy machine
//! only the ratio measured this way means anything.
//!
//! `--as-code 1mad|3inst|hyb` loads every trellis projection of a .sfx with its tile bytes
//! reinterpreted under another code (same K, same bytes per tile): the outputs are then
//! meaningless, but the decode work per token is exactly that of a model quantized with that
//! code (the kernels' cost does not depend on the tile contents). For speed comparisons of
//! codes before a conversion with that code exists.
//!
//! Prints decode tokens/s with the implied weight-streaming bandwidth next to a measured
//! memory-read bandwidth (the ceiling for a memory-bound matvec), and prefill tokens/s for
//! last-position logits (generation) and all-position logits (perplexity).

use rayon::prelude::*;
use sfx_formats::checkpoint::Checkpoint;
use sfx_runtime::{Backend, KvCache, LogitsMode, Model, ModelOptions, WeightPrecision};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut model_path = "assets/SmolLM2-135M-Instruct.Q4_1.gguf".to_string();
    let mut precision = WeightPrecision::Bf16;
    let mut decode_steps = 128usize;
    let mut prefill = 2048usize;
    let mut context = 16usize;
    let mut chunk = ModelOptions::default().prefill_chunk;
    let mut versus: Vec<String> = Vec::new();
    let mut rounds = 5usize;
    let mut as_code: Option<sfx_formats::resident::TrellisCode> = None;
    while let Some(a) = args.next() {
        let mut num = |name: &str| -> Result<usize, Box<dyn std::error::Error>> {
            Ok(args
                .next()
                .ok_or(format!("{name} needs a value"))?
                .parse()?)
        };
        match a.as_str() {
            "--precision" => {
                precision = match args.next().as_deref() {
                    Some("bf16") => WeightPrecision::Bf16,
                    Some("f32") => WeightPrecision::F32,
                    Some("native") => WeightPrecision::Native,
                    other => return Err(format!("--precision: unknown {other:?}").into()),
                }
            }
            "--decode" => decode_steps = num("--decode")?,
            "--prefill" => prefill = num("--prefill")?,
            "--context" => context = num("--context")?.max(1),
            "--chunk" => chunk = num("--chunk")?,
            "--rounds" => rounds = num("--rounds")?.max(1),
            "--as-code" => {
                let c = args.next().ok_or("--as-code needs a code")?;
                as_code = Some(
                    sfx_formats::resident::TrellisCode::parse(&c)
                        .ok_or(format!("--as-code: unknown code {c:?}"))?,
                );
            }
            "--vs" => versus.push(args.next().ok_or("--vs needs a model")?),
            s if !s.starts_with("--") => model_path = s.to_string(),
            s => return Err(format!("unknown option {s}").into()),
        }
    }

    if !versus.is_empty() {
        let opts = ModelOptions {
            precision,
            prefill_chunk: chunk,
            ..ModelOptions::default()
        };
        let mut paths = vec![model_path];
        paths.extend(versus);
        return side_by_side(&paths, &opts, decode_steps.max(8), context, rounds, as_code);
    }
    let t = Instant::now();
    let ck = Checkpoint::open(&model_path)?;
    let read_s = t.elapsed().as_secs_f64();
    let opts = ModelOptions {
        precision,
        prefill_chunk: chunk,
        ..ModelOptions::default()
    };
    let t = Instant::now();
    let model = Model::load_cpu(&ck.config, &*ck.tensors, &opts)?;
    drop(ck.tensors);
    let load_s = t.elapsed().as_secs_f64();
    let weight_mb = model.resident_bytes() as f64 / 1e6;
    println!(
        "model {model_path}: {} layers, hidden {}, vocab {}; {:.1} MB resident ({precision:?}); \
         read {read_s:.2} s, load {load_s:.2} s; backend {}",
        model.config().num_hidden_layers,
        model.config().hidden_size,
        model.config().vocab_size,
        weight_mb,
        model.backend().name()
    );

    let bw = read_bandwidth_gbs();
    println!("memory read bandwidth (rayon, 512 MiB sum): {bw:.1} GB/s");

    let vocab = model.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..context as u32)
        .map(|i| (i * 7919 + 1) % vocab)
        .collect();
    if decode_steps > 0 {
        let mut cache = model.new_cache(context + decode_steps + 1)?;
        let next = step(&model, &mut cache, &prompt)?;
        // Warm-up steps (page faults, rayon start) are not timed.
        let next = steps(&model, &mut cache, next, 4.min(decode_steps))?;
        let timed = decode_steps - 4.min(decode_steps);
        let t = Instant::now();
        steps(&model, &mut cache, next, timed)?;
        let s = t.elapsed().as_secs_f64();
        let per_tok = s / timed.max(1) as f64;
        println!(
            "decode: {timed} steps after {} context tokens: {:.1} tok/s ({:.2} ms/token, {:.1} GB/s of weights = {:.0} % of measured bandwidth)",
            cache.len() - timed,
            1.0 / per_tok,
            per_tok * 1e3,
            weight_mb / 1e3 / per_tok,
            100.0 * weight_mb / 1e3 / per_tok / bw
        );
    }
    if prefill > 0 {
        let tokens: Vec<u32> = (0..prefill as u32)
            .map(|i| (i * 7919 + 3) % vocab)
            .collect();
        let mut cache = model.new_cache(prefill)?;
        // Warm-up on a short prefix.
        model.forward(&tokens[..64.min(prefill)], &mut cache, LogitsMode::Last)?;
        for mode in [LogitsMode::Last, LogitsMode::All] {
            cache.clear();
            let t = Instant::now();
            let l = model.forward(&tokens, &mut cache, mode)?;
            let s = t.elapsed().as_secs_f64();
            println!(
                "prefill {prefill} tokens, logits {mode:?} ({} rows): {:.2} s = {:.0} tok/s",
                l.rows(),
                s,
                prefill as f64 / s
            );
        }
    }
    Ok(())
}

/// Trellis projections relabelled to another code (speed measurements only).
struct Relabel<'f> {
    inner: sfx_runtime::SfxLinearFactory<'f>,
    code: sfx_formats::resident::TrellisCode,
}

impl sfx_runtime::LinearFactory<sfx_runtime::CpuBackend> for Relabel<'_> {
    fn load(
        &self,
        backend: &sfx_runtime::CpuBackend,
        tensors: &dyn sfx_formats::TensorSource,
        spec: &sfx_runtime::LinearSpec<'_>,
    ) -> sfx_runtime::error::Result<Box<dyn sfx_runtime::Linear<sfx_runtime::CpuBackend>>> {
        use sfx_formats::resident::{TrellisParts, TrellisQuantized};
        let Ok(t) = self.inner.trellis_quantized(spec) else {
            return self.inner.load(backend, tensors, spec);
        };
        let mut scheme = *t.scheme();
        scheme.code = self.code;
        let tlut = if self.code.table_rows() == 0 {
            Vec::new()
        } else {
            sfx_runtime::resident::trellis::hyb_gaussian_tlut(9)
                .iter()
                .flat_map(|p| [half::f16::from_f32(p[0]), half::f16::from_f32(p[1])])
                .collect()
        };
        let w = TrellisQuantized::from_parts(TrellisParts {
            scheme,
            rows: t.rows(),
            cols: t.cols(),
            tiles: t.tiles().to_vec(),
            su: t.su().to_vec(),
            sv: t.sv().to_vec(),
            tlut,
            had_in: t.had_in().clone(),
            had_out: t.had_out().clone(),
        })
        .map_err(|e| sfx_runtime::RuntimeError::Unsupported(e.to_string()))?;
        Ok(Box::new(sfx_runtime::resident::TrellisLinear::new(
            w, None,
        )?))
    }
}

fn load_any(
    path: &str,
    opts: &ModelOptions,
    as_code: Option<sfx_formats::resident::TrellisCode>,
) -> Result<Model<sfx_runtime::CpuBackend>, Box<dyn std::error::Error>> {
    if sfx_runtime::sfx_model::is_sfx_file(std::path::Path::new(path)) {
        let file = sfx_formats::sfx::SfxFile::open(path)?;
        let Some(code) = as_code else {
            return Ok(sfx_runtime::load_sfx_model(&file, opts)?);
        };
        let config = sfx_runtime::sfx_model::sfx_config(&file)?.clone();
        let tensors = sfx_runtime::SfxTensors::new(&file)?;
        let factory = Relabel {
            inner: sfx_runtime::SfxLinearFactory::new(&file, opts.precision),
            code,
        };
        Ok(Model::load_with(
            sfx_runtime::CpuBackend::new(),
            &config,
            &tensors,
            &factory,
            opts,
        )?)
    } else {
        let ck = Checkpoint::open(path)?;
        Ok(Model::load_cpu(&ck.config, &*ck.tensors, opts)?)
    }
}

/// Interleaved decode rounds over several models; median tok/s and ratio to the first.
fn side_by_side(
    paths: &[String],
    opts: &ModelOptions,
    n_steps: usize,
    context: usize,
    rounds: usize,
    as_code: Option<sfx_formats::resident::TrellisCode>,
) -> Result<(), Box<dyn std::error::Error>> {
    // The relabelling applies to the second and later models (the first is the reference).
    let models = paths
        .iter()
        .enumerate()
        .map(|(i, p)| load_any(p, opts, if i == 0 { None } else { as_code }))
        .collect::<Result<Vec<_>, _>>()?;
    let vocab = models[0].config().vocab_size as u32;
    let prompt: Vec<u32> = (0..context as u32)
        .map(|i| (i * 7919 + 1) % vocab)
        .collect();
    let mut secs = vec![Vec::new(); models.len()];
    for _ in 0..rounds {
        for (m, model) in models.iter().enumerate() {
            let mut cache = model.new_cache(context + n_steps + 8)?;
            let next = step(model, &mut cache, &prompt)?;
            let next = steps(model, &mut cache, next, 4)?;
            let t = Instant::now();
            steps(model, &mut cache, next, n_steps)?;
            secs[m].push(t.elapsed().as_secs_f64() / n_steps as f64);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let base = median(&mut secs[0].clone());
    println!("{{\"rounds\": {rounds}, \"steps\": {n_steps}, \"context\": {context}, \"models\": [");
    for (m, (path, model)) in paths.iter().zip(&models).enumerate() {
        let s = median(&mut secs[m]);
        println!(
            "  {{\"model\": {path:?}, \"tok_s\": {:.2}, \"ms_per_token\": {:.3}, \"resident_bytes\": {}, \"speed_vs_first\": {:.3}}}{}",
            1.0 / s,
            s * 1e3,
            model.resident_bytes(),
            base / s,
            if m + 1 < paths.len() { "," } else { "" }
        );
    }
    println!("]}}");
    Ok(())
}

type Cpu = sfx_runtime::CpuBackend;

/// One forward of `tokens`; the argmax of the last position.
fn step(
    model: &Model<Cpu>,
    cache: &mut dyn KvCache<Cpu>,
    tokens: &[u32],
) -> Result<u32, Box<dyn std::error::Error>> {
    Ok(argmax(
        model
            .forward(tokens, cache, LogitsMode::Last)?
            .last()
            .unwrap_or(&[]),
    ))
}

/// `n` greedy decode steps from `next`; the last token.
fn steps(
    model: &Model<Cpu>,
    cache: &mut dyn KvCache<Cpu>,
    mut next: u32,
    n: usize,
) -> Result<u32, Box<dyn std::error::Error>> {
    for _ in 0..n {
        next = step(model, cache, &[next])?;
    }
    Ok(next)
}

fn argmax(row: &[f32]) -> u32 {
    row.iter()
        .enumerate()
        .fold((0usize, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv {
                (i, v)
            } else {
                (bi, bv)
            }
        })
        .0 as u32
}

/// Best of 3 parallel sums over 512 MiB: the streaming-read ceiling for decode matvecs.
fn read_bandwidth_gbs() -> f64 {
    let data = vec![1.0f32; 128 << 20];
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        let s: f32 = data
            .par_chunks(1 << 16)
            .map(|c| {
                let mut acc = [0.0f32; 16];
                for ch in c.chunks_exact(16) {
                    for j in 0..16 {
                        acc[j] += ch[j];
                    }
                }
                acc.iter().sum::<f32>()
            })
            .sum();
        std::hint::black_box(s);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (data.len() * 4) as f64 / best / 1e9
}

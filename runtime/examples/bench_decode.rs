//! Decode and prefill throughput of the float CPU runtime.
//!
//! cargo run --release -p sfx-runtime --example bench_decode -- \
//!     [MODEL (.gguf / HF folder / hub id)] [--precision bf16|f32|native] [--decode N]
//!     [--prefill N] [--context N] [--chunk N]
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
            s if !s.starts_with("--") => model_path = s.to_string(),
            s => return Err(format!("unknown option {s}").into()),
        }
    }

    let t = Instant::now();
    let ck = Checkpoint::open(&model_path)?;
    let read_s = t.elapsed().as_secs_f64();
    let opts = ModelOptions {
        precision,
        prefill_chunk: chunk,
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
        let mut next = argmax(
            model
                .forward(&prompt, &mut cache, LogitsMode::Last)?
                .last()
                .unwrap_or(&[]),
        );
        // Warm-up steps (page faults, rayon start) are not timed.
        for _ in 0..4.min(decode_steps) {
            next = argmax(
                model
                    .forward(&[next], &mut cache, LogitsMode::Last)?
                    .last()
                    .unwrap_or(&[]),
            );
        }
        let steps = decode_steps - 4.min(decode_steps);
        let t = Instant::now();
        for _ in 0..steps {
            next = argmax(
                model
                    .forward(&[next], &mut cache, LogitsMode::Last)?
                    .last()
                    .unwrap_or(&[]),
            );
        }
        let s = t.elapsed().as_secs_f64();
        let per_tok = s / steps.max(1) as f64;
        println!(
            "decode: {steps} steps after {} context tokens: {:.1} tok/s ({:.2} ms/token, {:.1} GB/s of weights = {:.0} % of measured bandwidth)",
            cache.len() - steps,
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

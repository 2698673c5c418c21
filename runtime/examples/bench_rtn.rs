//! Decode throughput of RTN group-quantized linears vs the BF16 float model on the CPU.
//!
//! cargo run --release -p sfx-runtime --example bench_rtn -- [MODEL] [--decode N] [--group G]
//!
//! Loads the model once per setting (bf16, rtn4, rtn3, rtn2; embeddings and the tied head
//! stay BF16), then times greedy decode steps after a 16-token prompt (4 untimed warm-up steps).

use sfx_formats::checkpoint::Checkpoint;
use sfx_runtime::resident::RtnFactory;
use sfx_runtime::{
    CpuBackend, FloatLinearFactory, KvCache, LinearFactory, LogitsMode, Model, ModelOptions,
    WeightPrecision,
};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut model_path = "assets/SmolLM2-135M-Instruct.Q4_1.gguf".to_string();
    let mut steps = 128usize;
    let mut group = 128usize;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--decode" => steps = args.next().ok_or("--decode needs a value")?.parse()?,
            "--group" => group = args.next().ok_or("--group needs a value")?.parse()?,
            s if !s.starts_with("--") => model_path = s.to_string(),
            s => return Err(format!("unknown option {s}").into()),
        }
    }
    let ck = Checkpoint::open(&model_path)?;
    let opts = ModelOptions {
        precision: WeightPrecision::Bf16,
        ..Default::default()
    };
    let float = FloatLinearFactory {
        precision: WeightPrecision::Bf16,
    };
    let settings: Vec<(String, Box<dyn LinearFactory<CpuBackend>>)> = vec![
        ("bf16".into(), Box::new(float)),
        (format!("rtn4-g{group}"), Box::new(rtn(4, group))),
        (format!("rtn3-g{group}"), Box::new(rtn(3, group))),
        (format!("rtn2-g{group}"), Box::new(rtn(2, group))),
    ];
    for (name, factory) in &settings {
        let t = Instant::now();
        let model = Model::load_with(
            CpuBackend::new(),
            &ck.config,
            &*ck.tensors,
            &**factory,
            &opts,
        )?;
        let load_s = t.elapsed().as_secs_f64();
        let (mut lin_bytes, mut lin_params) = (0usize, 0usize);
        for layer in model.layers() {
            for (_, l) in layer.linears() {
                lin_bytes += l.resident_bytes();
                lin_params += l.in_dim() * l.out_dim();
            }
        }
        let vocab = model.config().vocab_size as u32;
        let prompt: Vec<u32> = (0..16u32).map(|i| (i * 7919 + 1) % vocab).collect();
        let mut cache = model.new_cache(prompt.len() + steps + 8)?;
        let mut next = argmax(
            model
                .forward(&prompt, &mut cache, LogitsMode::Last)?
                .last()
                .unwrap_or(&[]),
        );
        for _ in 0..4 {
            next = argmax(
                model
                    .forward(&[next], &mut cache, LogitsMode::Last)?
                    .last()
                    .unwrap_or(&[]),
            );
        }
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
        println!(
            "{name:>10}: decode {:.1} tok/s ({:.2} ms/token), decoder linears {:.2} bits/weight \
             ({:.1} MB), model {:.1} MB resident, load {load_s:.2} s, {} cached",
            steps as f64 / s,
            s / steps as f64 * 1e3,
            8.0 * lin_bytes as f64 / lin_params as f64,
            lin_bytes as f64 / 1e6,
            model.resident_bytes() as f64 / 1e6,
            cache.len()
        );
    }
    Ok(())
}

fn rtn(bits: u8, group: usize) -> RtnFactory {
    RtnFactory {
        group_size: group,
        ..RtnFactory::new(bits)
    }
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

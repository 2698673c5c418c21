//! Decode matvec throughput of the CPU's group-code kernels at every width, f32 against int8
//! activations, on a matrix that stays in L2 (compute bound) and on one several times the last
//! level cache (memory bound): GB/s of weight bytes and weights per ns, best of `--reps`.
//!
//! RAYON_NUM_THREADS=1 cargo run --release -p sfx-runtime --example bench_matvec -- [--reps 50]

use sfx_formats::resident::{minmax_grid, GroupQuantized};
use sfx_runtime::backend::cpu::{CpuBuffer, DecodeActivations};
use sfx_runtime::linear::Linear;
use sfx_runtime::resident::GroupQuantLinear;
use sfx_runtime::CpuBackend;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut reps = 50usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--reps" => reps = args.next().ok_or("--reps needs a value")?.parse()?,
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    let mut seed = 1u64;
    let mut rnd = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    println!(
        "threads {}; | shape | bits | MB | f32 GB/s | int8 GB/s | int8 weights/ns | speedup |",
        rayon::current_num_threads()
    );
    for &(rows, cols) in &[
        (1536usize, 576usize),
        (576, 1536),
        (49152, 576),
        (14336, 4096),
    ] {
        let w: Vec<f32> = (0..rows * cols).map(|_| rnd()).collect();
        let x = CpuBuffer((0..cols).map(|_| rnd()).collect());
        for bits in [2u8, 3, 4, 6, 8] {
            let q = GroupQuantized::quantize_with(&w, rows, cols, bits, 128, minmax_grid)?;
            let bytes = q.size_in_bytes() as f64;
            let lin = GroupQuantLinear::new(q, None)?;
            let mut y = CpuBuffer(vec![0.0; rows]);
            let mut time = |acts| -> Result<f64, Box<dyn std::error::Error>> {
                let b = CpuBackend::new().with_decode_activations(acts);
                lin.forward(&b, &x, 1, &mut y)?;
                let mut best = f64::MAX;
                for _ in 0..reps {
                    let t = Instant::now();
                    lin.forward(&b, &x, 1, &mut y)?;
                    best = best.min(t.elapsed().as_secs_f64());
                }
                Ok(best)
            };
            let (tf, ti) = (
                time(DecodeActivations::F32)?,
                time(DecodeActivations::Int8)?,
            );
            println!(
                "| {rows}×{cols} | {bits} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2}× |",
                bytes / 1e6,
                bytes / tf / 1e9,
                bytes / ti / 1e9,
                (rows * cols) as f64 / ti / 1e9,
                tf / ti
            );
        }
    }
    Ok(())
}

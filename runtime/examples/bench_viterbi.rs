//! Trellis quantization (Viterbi) speed and error on Gaussian tiles, single thread:
//! `cargo run --release -p sfx-runtime --example bench_viterbi -- [K] [TILES] [hyb|1mad|3inst]`.
//! Prints ms per 16×16 tile and the MSE per weight (unit-variance targets) for the two-pass
//! tail-biting search the converter uses.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sfx_runtime::resident::trellis::{
    hyb_gaussian_tlut, Code, TailBiting, TrellisQuantizer, TrellisSpec,
};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let nums: Vec<u32> = std::env::args()
        .skip(1)
        .filter_map(|s| s.parse().ok())
        .collect();
    let k = *nums.first().unwrap_or(&2);
    let tiles = *nums.get(1).unwrap_or(&64) as usize;
    let name = std::env::args()
        .skip(1)
        .find(|s| s.parse::<u32>().is_err())
        .unwrap_or_else(|| "hyb".into());
    let code = match name.as_str() {
        "1mad" => Code::OneMad,
        "3inst" => Code::ThreeInst,
        _ => Code::Hyb {
            q: 9,
            tlut: hyb_gaussian_tlut(9),
        },
    };
    let spec = TrellisSpec::qtip(k, code.values_per_step() as u32)?;
    let quantizer = TrellisQuantizer::new(spec, &code)?;
    // Codes are unit-variance; scale targets to the code's RMS as the converter does.
    let mut rng = StdRng::seed_from_u64(7);
    let targets: Vec<Vec<f32>> = (0..tiles)
        .map(|_| {
            (0..spec.tile())
                .map(|_| {
                    // Box–Muller: the runtime has no rand_distr dependency.
                    let u1: f64 = rng.random::<f64>().max(1e-300);
                    let u2: f64 = rng.random();
                    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
                })
                .collect()
        })
        .collect();
    let t0 = Instant::now();
    let mut mse = 0.0f64;
    for t in &targets {
        mse += f64::from(quantizer.quantize_with(t, TailBiting::TwoPass)?.mse);
    }
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "{name} K={k}: {:.2} ms/tile, MSE {:.4} ({tiles} tiles)",
        secs * 1e3 / tiles as f64,
        mse / tiles as f64
    );
    Ok(())
}

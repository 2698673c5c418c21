//! Trellis decode matvec vs the float matvec on one projection shape, single thread:
//! `cargo run --release -p sfx-runtime --example bench_trellis -- [ROWS COLS K]`.
//! Prints ns per weight for the AVX-512 kernel, the portable decoder and an f32 matvec.

use half::f16;
use sfx_formats::resident::{
    SmallHadamard, TileOrder, TrellisCode, TrellisParts, TrellisQuantized, TrellisScheme,
};
use sfx_runtime::resident::hadamard::Hadamard;
use sfx_runtime::resident::trellis::hyb_gaussian_tlut;
use sfx_runtime::resident::TrellisLinear;
use sfx_runtime::SimdLevel;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|s| s.parse().ok())
        .collect();
    let (rows, cols, k) = (
        *a.first().unwrap_or(&1536),
        *a.get(1).unwrap_or(&576),
        *a.get(2).unwrap_or(&2),
    );
    let code = std::env::args()
        .find_map(|s| TrellisCode::parse(&s))
        .unwrap_or(TrellisCode::Hyb { q: 9 });
    let scheme = TrellisScheme {
        code,
        l: 16,
        k: k as u8,
        order: TileOrder::RowMajor,
        rotation: sfx_formats::resident::Rotation::Full,
    };
    let n = TrellisQuantized::tile_stream_len(&scheme, rows, cols).ok_or("overflow")?;
    let mut s = 1u64;
    let tiles: Vec<u8> = (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
            (s >> 56) as u8
        })
        .collect();
    let small = |n: usize| -> Result<SmallHadamard, Box<dyn std::error::Error>> {
        let h = Hadamard::new(n)?;
        Ok(SmallHadamard::new(h.small_order(), h.small_factor())?)
    };
    let w = TrellisQuantized::from_parts(TrellisParts {
        scheme,
        rows,
        cols,
        tiles,
        su: vec![f16::ONE; cols],
        sv: vec![1.0; rows],
        tlut: if code.table_rows() == 0 {
            Vec::new()
        } else {
            hyb_gaussian_tlut(9)
                .iter()
                .flat_map(|p| [f16::from_f32(p[0]), f16::from_f32(p[1])])
                .collect()
        },
        had_in: small(cols)?,
        had_out: small(rows)?,
    })?;
    let lin = TrellisLinear::new(w, None)?;
    println!("fast kernel available: {}", lin.has_fast_kernel());
    let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut y = vec![0.0f32; rows];
    let wf: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.11).cos()).collect();
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
    let reps = 200;
    pool.install(|| {
        for (name, level) in [
            ("avx512 kernel", SimdLevel::Avx512),
            ("portable", SimdLevel::Scalar),
        ] {
            lin.matvec_rotated(level, &x, &mut y);
            let t = Instant::now();
            for _ in 0..reps {
                lin.matvec_rotated(level, &x, &mut y);
            }
            let ns = t.elapsed().as_secs_f64() * 1e9 / (reps * rows * cols) as f64;
            println!(
                "{name}: {ns:.3} ns/weight ({rows}×{cols}, K={k}, {})",
                code.name()
            );
        }
        let t = Instant::now();
        for _ in 0..reps {
            for (r, yv) in y.iter_mut().enumerate() {
                *yv = wf[r * cols..(r + 1) * cols]
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| a * b)
                    .sum();
            }
        }
        let ns = t.elapsed().as_secs_f64() * 1e9 / (reps * rows * cols) as f64;
        println!("f32 matvec (autovectorised, L2-resident for small shapes): {ns:.3} ns/weight");
    });
    std::hint::black_box(&y);
    Ok(())
}

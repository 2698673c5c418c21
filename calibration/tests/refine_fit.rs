//! Fitted refinement: the solve, and the objective it minimises checked by direct evaluation.

use sfx_calibration::refine::{
    default_lambda, fit_refinement, fit_refinement_f64, quantize_columns_4bit, FitPrior, FitSpec,
    Lambda,
};
use sfx_calibration::stats::{mask_top_k, RefinementStats};

/// Small deterministic generator (SplitMix64 + Box–Muller).
struct Rng(u64);
impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

fn frob(v: impl Iterator<Item = f64>) -> f64 {
    v.map(|x| x * x).sum::<f64>().sqrt()
}

/// C (M + λI) = R G + λP for every prior P (R or 0) and both forms of λ.
#[test]
fn solve_satisfies_normal_equations() {
    let mut rng = Rng(1);
    for (d, out) in [(37usize, 11usize), (200, 64), (1100, 40)] {
        // M = BᵀB / d (SPD-ish, possibly ill-conditioned), G arbitrary; channel 3 never
        // selected (its row and column of M and column of G are zero, as in real statistics).
        let b: Vec<f64> = (0..d * d).map(|_| rng.normal()).collect();
        let mut st = RefinementStats::new(d, 16);
        st.n = 3; // the stats hold sums: means are m/3, g/3
        for i in 0..d {
            for j in 0..=i {
                let v: f64 = (0..d).map(|t| b[t * d + i] * b[t * d + j]).sum::<f64>() / d as f64;
                let v = if i == 3 || j == 3 { 0.0 } else { v };
                st.m[i * d + j] = 3.0 * v;
                st.m[j * d + i] = 3.0 * v;
            }
        }
        for (idx, v) in st.g.iter_mut().enumerate() {
            *v = if idx % d == 3 {
                0.0
            } else {
                3.0 * rng.normal()
            };
        }
        let r: Vec<f32> = (0..out * d).map(|_| rng.normal() as f32).collect();
        let rg = |o: usize, j: usize| -> f64 {
            (0..d)
                .map(|i| r[o * d + i] as f64 * st.g[i * d + j] / 3.0)
                .sum::<f64>()
        };
        for (prior, lambda) in [
            (FitPrior::Residual, Lambda::MeanDiag(1.0)),
            (FitPrior::Zero, Lambda::MeanDiag(0.1)),
            (FitPrior::Zero, Lambda::Absolute(0.37)),
        ] {
            let lam = match lambda {
                Lambda::MeanDiag(m) => m * default_lambda(&st),
                Lambda::Absolute(v) => v,
            };
            let p = |o: usize, j: usize| -> f64 {
                match prior {
                    FitPrior::Residual => r[o * d + j] as f64,
                    FitPrior::Zero => 0.0,
                }
            };
            let spec = FitSpec { lambda, prior };
            let c = fit_refinement_f64(&r, &st, spec).unwrap();
            // Residual of C (M + λI) − (R G + λP), relative to the right-hand side.
            let (mut res, mut rhs) = (Vec::new(), Vec::new());
            for o in 0..out {
                for j in 0..d {
                    let lhs: f64 = (0..d)
                        .map(|i| c[o * d + i] * st.m[i * d + j] / 3.0)
                        .sum::<f64>()
                        + lam * c[o * d + j];
                    let want = rg(o, j) + lam * p(o, j);
                    res.push(lhs - want);
                    rhs.push(want);
                }
            }
            let rel = frob(res.into_iter()) / frob(rhs.into_iter());
            assert!(rel < 1e-8, "d = {d}, {prior:?}: relative residual {rel:e}");
            // The f32 wrapper is the same solution rounded.
            let c32 = fit_refinement(&r, &st, spec).unwrap();
            assert!(c32
                .iter()
                .zip(&c)
                .all(|(a, b)| (*a as f64 - b).abs() <= 1e-6 * (1.0 + b.abs())));
        }
    }
}

#[test]
fn lambda_and_prior_parse() {
    assert_eq!(Lambda::parse("0.1x"), Some(Lambda::MeanDiag(0.1)));
    assert_eq!(Lambda::parse("2"), Some(Lambda::Absolute(2.0)));
    for bad in ["0x", "-1", "x", "", "nan", "infx", "1y"] {
        assert_eq!(Lambda::parse(bad), None, "{bad}");
    }
    assert_eq!(Lambda::default(), Lambda::MeanDiag(1.0));
    assert_eq!(Lambda::default().describe(), "mean_diag_m");
    assert_eq!(Lambda::MeanDiag(0.1).describe(), "0.1x_mean_diag_m");
    for p in [FitPrior::Residual, FitPrior::Zero] {
        assert_eq!(FitPrior::parse(p.as_str()), Some(p));
    }
    assert_eq!(FitPrior::parse("ridge"), None);
}

/// Correlated, heavy-tailed synthetic activations: x = A u with a few outlier channels.
fn sample(rng: &mut Rng, a: &[f64], d: usize, scales: &[f64]) -> Vec<f32> {
    let u: Vec<f64> = (0..d).map(|_| rng.normal()).collect();
    (0..d)
        .map(|i| (scales[i] * (0..d).map(|j| a[i * d + j] * u[j]).sum::<f64>()) as f32)
        .collect()
}

/// E‖R x − C z_k(x)‖² over `xs`, by direct evaluation.
fn objective(r: &[f32], c: &[f32], xs: &[Vec<f32>], d: usize, out: usize, k: usize) -> f64 {
    let mut total = 0.0;
    for x in xs {
        let z = mask_top_k(x, k);
        for o in 0..out {
            let e: f64 = (0..d)
                .map(|i| r[o * d + i] as f64 * x[i] as f64 - c[o * d + i] as f64 * z[i] as f64)
                .sum();
            total += e * e;
        }
    }
    total / xs.len() as f64
}

#[test]
fn fitted_beats_plain_on_correlated_data() {
    let mut rng = Rng(7);
    let (d, out, k) = (96usize, 24usize, 128usize); // k = 128/1024 → 12 of 96 channels
                                                    // Mixing: identity + strong low-rank correlation.
    let v: Vec<f64> = (0..d * 3).map(|_| rng.normal()).collect();
    let mut a = vec![0.0f64; d * d];
    for i in 0..d {
        a[i * d + i] = 0.5;
        for j in 0..d {
            a[i * d + j] += (0..3).map(|t| v[i * 3 + t] * v[j * 3 + t]).sum::<f64>() / 3.0;
        }
    }
    let scales: Vec<f64> = (0..d)
        .map(|i| if i % 17 == 0 { 6.0 } else { 1.0 })
        .collect();
    let r: Vec<f32> = (0..out * d).map(|_| (0.01 * rng.normal()) as f32).collect();

    let mut st = RefinementStats::new(d, k);
    let train: Vec<Vec<f32>> = (0..4000)
        .map(|_| sample(&mut rng, &a, d, &scales))
        .collect();
    for chunk in train.chunks(512) {
        let flat: Vec<f32> = chunk.iter().flatten().copied().collect();
        st.add_rows(&flat, chunk.len());
    }
    let c = fit_refinement(&r, &st, Default::default()).unwrap();
    let test: Vec<Vec<f32>> = (0..2000)
        .map(|_| sample(&mut rng, &a, d, &scales))
        .collect();

    let zero = vec![0.0f32; out * d];
    let none = objective(&r, &zero, &test, d, out, k);
    let plain = objective(&r, &r, &test, d, out, k);
    let fitted = objective(&r, &c, &test, d, out, k);
    let plain_q = objective(
        &r,
        &quantize_columns_4bit(&r, out, d).dequantize(),
        &test,
        d,
        out,
        k,
    );
    let fitted_q = objective(
        &r,
        &quantize_columns_4bit(&c, out, d).dequantize(),
        &test,
        d,
        out,
        k,
    );
    eprintln!("none {none:.4e} plain {plain:.4e} fitted {fitted:.4e} plain4 {plain_q:.4e} fitted4 {fitted_q:.4e}");
    assert!(plain < none);
    assert!(fitted < 0.9 * plain, "fitted {fitted} vs plain {plain}");
    assert!(
        fitted_q < plain_q,
        "4-bit: fitted {fitted_q} vs plain {plain_q}"
    );
    // λ → 0 on the training set is the unregularised least-squares optimum: the training
    // objective (plus λ‖C − R‖²) of the fitted C is no worse than that of C = R.
    let lam = default_lambda(&st);
    let reg = |cm: &[f32]| {
        objective(&r, cm, &train, d, out, k)
            + lam
                * cm.iter()
                    .zip(&r)
                    .map(|(x, y)| ((x - y) as f64).powi(2))
                    .sum::<f64>()
    };
    assert!(reg(&c) <= reg(&r) * (1.0 + 1e-9));
}

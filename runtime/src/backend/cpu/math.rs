//! Scalar math that the vectorized loops inline: a branch-free `exp` and horizontal helpers,
//! plus the `multiversioned!` macro that compiles one portable body per SIMD tier.

/// Compiles the portable function `$body` three times — baseline, AVX2+FMA and AVX-512 — and
/// defines `$name(level, args..)` that runs the copy for `level`. LLVM vectorizes the same
/// loop 4, 8 or 16 lanes wide; the bodies must be `#[inline(always)]` so they are compiled
/// inside the `#[target_feature]` wrapper.
macro_rules! multiversioned {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? = $body:path;) => {
        $(#[$meta])*
        $vis fn $name(level: $crate::backend::cpu::SimdLevel, $($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                $(#[$meta])*
                #[target_feature(enable = "avx512f,avx2,fma")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? { $body($($arg),*) }
                $(#[$meta])*
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? { $body($($arg),*) }
                // The support check is a cached atomic load (ns); keeping it makes the unsafe
                // calls sound even if a caller forges a `SimdLevel`.
                match level {
                    $crate::backend::cpu::SimdLevel::Avx512 if level.is_supported() => {
                        // SAFETY: AVX-512F, AVX2 and FMA were detected at run time.
                        return unsafe { avx512($($arg),*) };
                    }
                    $crate::backend::cpu::SimdLevel::Avx2 if level.is_supported() => {
                        // SAFETY: AVX2 and FMA were detected at run time.
                        return unsafe { avx2($($arg),*) };
                    }
                    _ => {}
                }
            }
            let _ = level;
            $body($($arg),*)
        }
    };
}
pub(crate) use multiversioned;

/// `e^x` to ~2 ulp for x in [-87.3, 88.3], clamped outside (so exp(-inf) → ~1e-38, not NaN).
/// Branch-free so softmax/SiLU loops vectorize: std's `expf` is a libm call per element, and
/// softmax over a 2048-token prefill needs ~300M of them (Cephes `expf` polynomial).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // 1.5·2^23: adding it rounds to an integer held in the low mantissa bits.
    const SHIFTER: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Bounds keep 2^n a normal float: n stays in [-126, 127].
    let x = x.clamp(-87.3, 88.3);
    let t = x * LOG2E + SHIFTER;
    let n = t - SHIFTER;
    let n_int = (t.to_bits() as i32).wrapping_sub(SHIFTER.to_bits() as i32);
    let r = x - n * LN2_HI - n * LN2_LO;
    let r2 = r * r;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let p = p * r2 + r + 1.0;
    let scale = f32::from_bits(((n_int + 127) as u32) << 23);
    p * scale
}

/// SiLU(x) = x·σ(x) (Elfwing et al. 2018).
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// Dot product with 16 independent partial sums so LLVM can vectorize without reassociating.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    const L: usize = 16;
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; L];
    let mut ca = a.chunks_exact(L);
    let mut cb = b.chunks_exact(L);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for j in 0..L {
            acc[j] += x[j] * y[j];
        }
    }
    let mut s: f32 = 0.0;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s += x * y;
    }
    s + acc.iter().sum::<f32>()
}

/// Sum of squares with 16 partial sums (RMSNorm's reduction).
#[inline(always)]
pub fn sum_squares(a: &[f32]) -> f32 {
    const L: usize = 16;
    let mut acc = [0.0f32; L];
    let mut c = a.chunks_exact(L);
    for x in &mut c {
        for j in 0..L {
            acc[j] += x[j] * x[j];
        }
    }
    let mut s: f32 = c.remainder().iter().map(|x| x * x).sum();
    s += acc.iter().sum::<f32>();
    s
}

/// `y += a · x`.
#[inline(always)]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// Max of a slice (−∞ for an empty one), 16 lanes wide.
#[inline(always)]
pub fn max(a: &[f32]) -> f32 {
    const L: usize = 16;
    let mut acc = [f32::NEG_INFINITY; L];
    let mut c = a.chunks_exact(L);
    for x in &mut c {
        for j in 0..L {
            acc[j] = acc[j].max(x[j]);
        }
    }
    let m = c
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    acc.iter().fold(m, |m, &x| m.max(x))
}

/// `x ← exp(x − shift)` in place; returns the sum of the results.
#[inline(always)]
pub fn exp_shift_sum(x: &mut [f32], shift: f32) -> f32 {
    const L: usize = 16;
    let mut acc = [0.0f32; L];
    let mut c = x.chunks_exact_mut(L);
    for v in &mut c {
        for j in 0..L {
            v[j] = exp(v[j] - shift);
            acc[j] += v[j];
        }
    }
    let mut s = 0.0f32;
    for v in c.into_remainder() {
        *v = exp(*v - shift);
        s += *v;
    }
    s + acc.iter().sum::<f32>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_std_to_3_ulp() {
        // Relative error bound 4e-7 ≈ 3 ulp of f32 over the whole unclamped range.
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.001_37;
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NEG_INFINITY) >= 0.0 && exp(f32::NEG_INFINITY) < 1e-37);
        assert!(exp(1000.0).is_finite());
    }

    #[test]
    fn silu_matches_definition() {
        for &x in &[-100.0f32, -10.0, -1.0, -1e-3, 0.0, 0.5, 3.0, 20.0, 100.0] {
            let want = x as f64 / (1.0 + (-(x as f64)).exp());
            let got = silu(x) as f64;
            assert!(
                (got - want).abs() <= 1e-6 * want.abs().max(1e-30),
                "x={x}: {got} vs {want}"
            );
        }
    }
}

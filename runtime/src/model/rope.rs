//! RoPE angles (Su et al. 2021, eq. 34) for a run of positions, as Hugging Face computes them.

/// cos/sin of θ_j·p for positions `start..start + n` and pairs `j < head_dim / 2`, each
/// `[n, head_dim / 2]` row-major.
///
/// The angle is formed in f32 (`p as f32 · θ_j as f32`) exactly as transformers'
/// `LlamaRotaryEmbedding` does (an f32 outer product), so our rotations carry the same
/// rounding as the reference the golden logits come from; at p = 2000 an f32 angle is only
/// good to ~1e-4 rad, which would otherwise be a systematic difference. cos/sin themselves
/// are evaluated in f64 and rounded (≤ 0.5 ulp vs torch's ≤ 1–2 ulp).
pub fn rope_cos_sin(inv_freq: &[f32], start: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
    let half = inv_freq.len();
    let mut cos = Vec::with_capacity(n * half);
    let mut sin = Vec::with_capacity(n * half);
    for t in 0..n {
        let p = (start + t) as f32;
        for &f in inv_freq {
            let a = (p * f) as f64;
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    (cos, sin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn position_zero_is_identity_and_angles_scale_with_position() {
        let inv = [1.0f32, 0.1, 0.01];
        let (c, s) = rope_cos_sin(&inv, 0, 3);
        assert_eq!(&c[..3], &[1.0, 1.0, 1.0]);
        assert_eq!(&s[..3], &[0.0, 0.0, 0.0]);
        assert!((s[3 * 2] - (2.0f64).sin() as f32).abs() < 1e-7);
        assert!((c[3 * 2 + 1] - (0.2f64).cos() as f32).abs() < 1e-7);
    }
}

//! Next-token selection: greedy, or temperature + top-k + top-p (nucleus) sampling with a
//! seeded generator so runs are reproducible.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the smallest set of tokens whose probability mass reaches `top_p` (1.0 = all).
    pub top_p: f32,
    /// Keep at most this many tokens (0 = no limit).
    pub top_k: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        }
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

/// Index of the largest logit; ties go to the lowest index (as torch.argmax).
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = StdRng::seed_from_u64(params.seed);
        Self { params, rng }
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature <= 0.0 || logits.len() < 2 {
            return argmax(logits) as u32;
        }
        let inv_t = 1.0 / self.params.temperature as f64;
        let mut cand: Vec<(usize, f64)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (i, l as f64 * inv_t))
            .collect();
        if cand.is_empty() {
            return argmax(logits) as u32;
        }
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if self.params.top_k > 0 {
            cand.truncate(self.params.top_k);
        }
        let max = cand[0].1;
        let mut probs: Vec<f64> = cand.iter().map(|(_, l)| (l - max).exp()).collect();
        let z: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= z);
        if self.params.top_p < 1.0 {
            let mut mass = 0.0;
            let mut keep = probs.len();
            for (i, p) in probs.iter().enumerate() {
                mass += p;
                if mass >= self.params.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            let z: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= z);
        }
        let mut u: f64 = self.rng.random::<f64>();
        for (i, p) in probs.iter().enumerate() {
            if u < *p {
                return cand[i].0 as u32;
            }
            u -= p;
        }
        cand[probs.len() - 1].0 as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.1, 3.0, 2.9, 3.0]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_seed_reproducible() {
        let logits = [0.0f32, 1.0, 2.0, 0.5];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 1,
            ..Default::default()
        });
        assert!((0..20).all(|_| s.sample(&logits) == 2));
        let p = SamplingParams {
            temperature: 1.0,
            seed: 7,
            ..Default::default()
        };
        let (mut a, mut b) = (Sampler::new(p.clone()), Sampler::new(p));
        let xs: Vec<u32> = (0..50).map(|_| a.sample(&logits)).collect();
        let ys: Vec<u32> = (0..50).map(|_| b.sample(&logits)).collect();
        assert_eq!(xs, ys);
    }

    #[test]
    fn sampling_frequencies_follow_softmax() {
        // p = softmax([0, ln 3]) = [0.25, 0.75]; 20000 draws → within 4 standard deviations.
        let logits = [0.0f32, 3f32.ln()];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: 1,
            ..Default::default()
        });
        let n = 20000;
        let ones = (0..n).filter(|_| s.sample(&logits) == 1).count() as f64;
        let sd = (n as f64 * 0.75 * 0.25).sqrt();
        assert!((ones - 0.75 * n as f64).abs() < 4.0 * sd, "{ones}");
    }

    #[test]
    fn top_p_cuts_the_tail() {
        // p ≈ [0.665, 0.245, 0.090]: top_p 0.6 keeps only the first token.
        let logits = [2.0f32, 1.0, 0.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.6,
            seed: 3,
            ..Default::default()
        });
        assert!((0..100).all(|_| s.sample(&logits) == 0));
    }
}

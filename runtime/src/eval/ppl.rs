//! Negative log-likelihood accumulation and the llama-perplexity style estimate.

/// log p(target) under softmax(logits), computed with the max subtracted so large logits do
/// not overflow. f64 accumulation: a 49K-way sum in f32 loses ~1e-4 relative precision.
pub fn log_softmax_at(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| ((l as f64) - max).exp()).sum();
    (logits[target] as f64) - max - sum.ln()
}

/// Running sums of per-token NLL.
#[derive(Debug, Clone, Default)]
pub struct NllAccumulator {
    sum: f64,
    sum_sq: f64,
    count: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct PplSummary {
    pub ppl: f64,
    /// Standard error of the PPL estimate, as llama-perplexity prints after "+/-":
    /// PPL · sqrt(Var(nll) / (n − 1)).
    pub ppl_stderr: f64,
    pub mean_nll: f64,
    pub tokens: u64,
}

impl NllAccumulator {
    pub fn push(&mut self, nll: f64) {
        self.sum += nll;
        self.sum_sq += nll * nll;
        self.count += 1;
    }

    pub fn merge(&mut self, other: &NllAccumulator) {
        self.sum += other.sum;
        self.sum_sq += other.sum_sq;
        self.count += other.count;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn summary(&self) -> Option<PplSummary> {
        if self.count == 0 {
            return None;
        }
        let n = self.count as f64;
        let mean = self.sum / n;
        let var = (self.sum_sq / n - mean * mean).max(0.0);
        let ppl = mean.exp();
        let stderr = if self.count > 1 {
            ppl * (var / (n - 1.0)).sqrt()
        } else {
            0.0
        };
        Some(PplSummary {
            ppl,
            ppl_stderr: stderr,
            mean_nll: mean,
            tokens: self.count,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_matches_direct_formula() {
        let logits = [1.0f32, 2.0, 3.0, -1.0];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        for t in 0..4 {
            let direct = ((logits[t] as f64).exp() / z).ln();
            assert!((log_softmax_at(&logits, t) - direct).abs() < 1e-12);
        }
        // Stable for logits whose exp overflows f64.
        let big = [1000.0f32, 1000.0];
        assert!((log_softmax_at(&big, 0) - 0.5f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn ppl_and_stderr_follow_llama_perplexity() {
        let mut acc = NllAccumulator::default();
        let nlls = [1.0, 2.0, 3.0, 4.0];
        for x in nlls {
            acc.push(x);
        }
        let s = acc.summary().unwrap();
        // mean 2.5, population variance 1.25, stderr of mean sqrt(1.25/3).
        assert!((s.ppl - 2.5f64.exp()).abs() < 1e-12);
        assert!((s.ppl_stderr - 2.5f64.exp() * (1.25f64 / 3.0).sqrt()).abs() < 1e-12);
        assert_eq!(s.tokens, 4);
        assert!(NllAccumulator::default().summary().is_none());
    }
}

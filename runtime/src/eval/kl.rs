//! KL divergence to a reference model per the protocol: the reference's 1024 most probable
//! tokens are kept as separate categories and all others lumped into one, in both
//! distributions; KL(p_ref ‖ p_test) over those 1025 categories.

/// How many of the reference's most probable tokens keep their own category.
pub const KL_TOP_K: usize = 1024;

/// Full-vocabulary log-softmax in f64 (see [`super::ppl::log_softmax_at`] for why f64).
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = logits
        .iter()
        .map(|&l| ((l as f64) - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    logits.iter().map(|&l| l as f64 - lse).collect()
}

/// The reference's side of [`lumped_kl`] for one position, computed once: its top-`k` tokens
/// with their log-probabilities, the lumped rest and its argmax. A tuner scoring many
/// configurations against one float model keeps these (12 bytes per category) instead of the
/// reference's full logits or a second run of it.
#[derive(Debug, Clone)]
pub struct ReferenceRow {
    top: Vec<(u32, f64)>,
    rest: f64,
    argmax: usize,
}

fn argmax(v: &[f64]) -> usize {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i)
}

impl ReferenceRow {
    pub fn new(reference: &[f32], k: usize) -> Self {
        let lr = log_softmax(reference);
        let k = k.min(lr.len());
        let mut order: Vec<usize> = (0..lr.len()).collect();
        // Partial selection: only the top-k set matters, not its internal order.
        order.select_nth_unstable_by(k.saturating_sub(1), |&a, &b| lr[b].total_cmp(&lr[a]));
        let top: Vec<(u32, f64)> = order[..k].iter().map(|&i| (i as u32, lr[i])).collect();
        let pr_top: f64 = top.iter().map(|&(_, l)| l.exp()).sum();
        Self {
            top,
            rest: (1.0 - pr_top).max(0.0),
            argmax: argmax(&lr),
        }
    }

    /// KL(p_ref ‖ p_test) over the reference's categories, and whether the argmaxes agree.
    pub fn kl(&self, test: &[f32]) -> (f64, bool) {
        let lt = log_softmax(test);
        let mut kl = 0.0;
        let mut pt_top = 0.0;
        for &(i, lr) in &self.top {
            let lt = lt[i as usize];
            pt_top += lt.exp();
            kl += lr.exp() * (lr - lt);
        }
        let pt_rest = (1.0 - pt_top).max(f64::MIN_POSITIVE);
        if self.rest > 0.0 {
            kl += self.rest * (self.rest.ln() - pt_rest.ln());
        }
        (kl.max(0.0), self.argmax == argmax(&lt))
    }
}

/// KL(p_ref ‖ p_test) over the top-`k` categories of the reference plus one lumped rest
/// category. Also returns whether both distributions share their argmax.
pub fn lumped_kl(reference: &[f32], test: &[f32], k: usize) -> (f64, bool) {
    debug_assert_eq!(reference.len(), test.len());
    ReferenceRow::new(reference, k).kl(test)
}

#[derive(Debug, Clone, Default)]
pub struct KlAccumulator {
    values: Vec<f64>,
    same_top1: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct KlSummary {
    pub mean: f64,
    pub median: f64,
    pub p99: f64,
    pub max: f64,
    /// Percentage of positions where both models' most probable token agree.
    pub same_top1_pct: f64,
    pub tokens: u64,
}

impl KlAccumulator {
    pub fn push(&mut self, reference: &ReferenceRow, test: &[f32]) {
        let (kl, same) = reference.kl(test);
        self.values.push(kl);
        self.same_top1 += same as u64;
    }

    pub fn merge(&mut self, other: &KlAccumulator) {
        self.values.extend_from_slice(&other.values);
        self.same_top1 += other.same_top1;
    }

    pub fn summary(&self) -> Option<KlSummary> {
        if self.values.is_empty() {
            return None;
        }
        let mut v = self.values.clone();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        // Linear interpolation between order statistics, as numpy.percentile's default.
        let pct = |q: f64| {
            let pos = q * (n - 1) as f64;
            let lo = pos.floor() as usize;
            let hi = pos.ceil() as usize;
            v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
        };
        Some(KlSummary {
            mean: v.iter().sum::<f64>() / n as f64,
            median: pct(0.5),
            p99: pct(0.99),
            max: v[n - 1],
            same_top1_pct: 100.0 * self.same_top1 as f64 / n as f64,
            tokens: n as u64,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference computation written out directly from the definition on a tiny vocabulary.
    fn kl_by_definition(r: &[f64], t: &[f64], top: &[usize]) -> f64 {
        let norm = |v: &[f64]| {
            let z: f64 = v.iter().map(|x| x.exp()).sum();
            v.iter().map(|x| x.exp() / z).collect::<Vec<_>>()
        };
        let (pr, pt) = (norm(r), norm(t));
        let mut kl = 0.0;
        for &i in top {
            kl += pr[i] * (pr[i] / pt[i]).ln();
        }
        let rest_r: f64 = (0..r.len())
            .filter(|i| !top.contains(i))
            .map(|i| pr[i])
            .sum();
        let rest_t: f64 = (0..r.len())
            .filter(|i| !top.contains(i))
            .map(|i| pt[i])
            .sum();
        if top.len() == r.len() {
            return kl;
        }
        kl + rest_r * (rest_r / rest_t).ln()
    }

    #[test]
    fn lumped_kl_matches_definition() {
        let r = [2.0f32, 1.0, 0.5, -1.0, 0.0, 3.0];
        let t = [1.5f32, 1.2, 0.1, -0.5, 0.3, 2.0];
        let rd: Vec<f64> = r.iter().map(|&x| x as f64).collect();
        let td: Vec<f64> = t.iter().map(|&x| x as f64).collect();
        // Top-2 of the reference are indices 5 and 0.
        let (kl, same) = lumped_kl(&r, &t, 2);
        assert!((kl - kl_by_definition(&rd, &td, &[5, 0])).abs() < 1e-12);
        assert!(same);
        // With k ≥ vocabulary this is the ordinary KL.
        let (full, _) = lumped_kl(&r, &t, 100);
        assert!((full - kl_by_definition(&rd, &td, &[0, 1, 2, 3, 4, 5])).abs() < 1e-12);
        assert!(full >= kl - 1e-12, "lumping can only lose information");
    }

    #[test]
    fn identical_distributions_have_zero_kl() {
        let r = [0.1f32, 0.7, -2.0, 5.0];
        let (kl, same) = lumped_kl(&r, &r, 2);
        assert!(kl.abs() < 1e-15 && same);
    }

    #[test]
    fn summary_percentiles() {
        let acc = KlAccumulator {
            values: (1..=101).map(|x| x as f64).collect(),
            same_top1: 50,
        };
        let s = acc.summary().unwrap();
        assert_eq!(s.median, 51.0);
        assert!((s.p99 - 100.0).abs() < 1e-12);
        assert!((s.mean - 51.0).abs() < 1e-12);
        assert!((s.same_top1_pct - 100.0 * 50.0 / 101.0).abs() < 1e-12);
    }
}

//! The tuner's search (docs/method.md §6): for a slowdown budget, the refinement settings
//! with the lowest KL to the float model whose measured slowdown stays within it.
//!
//! 1. For each combination of fetch lead/lag and MLP scheme, the largest common k of the
//!    fitted ladder whose slowdown meets the budget (the ladder is walked upwards and the walk
//!    stops at the first rung over budget: slowdown grows with k).
//! 2. Of those — and of the choices already made for smaller budgets, which fit this one
//!    too — the one with the lowest KL. (Raising never lowers a set, so without them a larger
//!    budget could miss a smaller budget's uneven choice and end up worse.)
//! 3. Then single sets' budgets are raised a rung at a time — the move that lowers KL most
//!    among those still within the budget — until no move helps. When not even the smallest
//!    common rung fits, the raising starts from no refinement at all (k = 0 per set, no
//!    lead/lag, channels): a tight budget still refines the sets it can afford.
//! 4. A configuration fits a budget only when a second speed measurement agrees: nothing is
//!    chosen on one lucky measurement, at the cost of measuring fitting configurations
//!    twice.
//!
//! Measurements come from a [`Measure`] (the machine and the model) and are kept, so one
//! configuration is measured once for every budget: the same measurements give the same
//! choices.

use std::collections::HashMap;

/// How the MLP is refined (docs/method.md §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scheme {
    /// Channel columns for gate/up and down.
    Channels,
    /// Neuron bundles (k_n = round(3 k_d / 4)); the gate/up budget is unused.
    Bundles,
}

impl Scheme {
    pub fn name(self) -> &'static str {
        match self {
            Scheme::Channels => "channels",
            Scheme::Bundles => "bundles",
        }
    }
}

/// One refinement configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Candidate {
    /// Budgets k per 1024 channels per set (qkv, o, gu, d).
    pub k: [usize; 4],
    /// Lead (qkv, gu) / lag (o, d) per set in half blocks.
    pub half_blocks: [u8; 4],
    pub scheme: Scheme,
}

impl Candidate {
    /// Lead/lag per set in blocks.
    pub fn s(&self) -> [f32; 4] {
        self.half_blocks.map(|h| f32::from(h) / 2.0)
    }

    /// Neurons per 1024 under bundles: round(3 k_d / 4).
    pub fn bundle_k(&self) -> usize {
        sfx_runtime::refine::bundle_budget(self.k[3])
    }

    /// `k16 s0 channels`, `k8,16,8,16 s0,0.5,0,0.5 bundles`.
    pub fn label(&self) -> String {
        let list = |v: Vec<String>| {
            if v.iter().all(|x| *x == v[0]) {
                v[0].clone()
            } else {
                v.join(",")
            }
        };
        format!(
            "k{} s{} {}",
            list(self.k.iter().map(|k| k.to_string()).collect()),
            list(self.s().iter().map(|s| s.to_string()).collect()),
            self.scheme.name()
        )
    }
}

/// What the search may choose from.
#[derive(Debug, Clone)]
pub struct Space {
    /// The fitted budgets, increasing.
    pub ladder: Vec<usize>,
    /// Lead/lag combinations in half blocks per set.
    pub shifts: Vec<[u8; 4]>,
    pub schemes: Vec<Scheme>,
}

/// Measures configurations on the machine.
pub trait Measure {
    type Error;
    /// Decode time with `c` over the resident base's, minus one (0.05 = 5 % slower).
    fn slowdown(&mut self, c: &Candidate) -> Result<f64, Self::Error>;
    /// Mean KL to the float model on held-out text.
    fn kl(&mut self, c: &Candidate) -> Result<f64, Self::Error>;
}

/// A budget's choice: `None` when nothing fits, not even running without refinement.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub budget: f64,
    pub candidate: Option<Candidate>,
    pub slowdown: f64,
    pub kl: f64,
}

/// A configuration that fits a budget: (KL, slowdown, configuration).
type Scored = (f64, f64, Candidate);

/// The search with its measurements kept.
pub struct Tuner<M: Measure> {
    measure: M,
    slowdowns: HashMap<Candidate, f64>,
    /// Second measurements of the configurations whose first one met a budget.
    confirmations: HashMap<Candidate, f64>,
    kls: HashMap<Candidate, f64>,
    /// Every budget's choice so far, to start larger budgets from.
    chosen: Vec<Candidate>,
}

impl<M: Measure> Tuner<M> {
    pub fn new(measure: M) -> Self {
        Self {
            measure,
            slowdowns: HashMap::new(),
            confirmations: HashMap::new(),
            kls: HashMap::new(),
            chosen: Vec::new(),
        }
    }

    pub fn measure(&mut self) -> &mut M {
        &mut self.measure
    }

    /// Speed measurements (first and confirming) and KL measurements so far.
    pub fn measured(&self) -> (usize, usize) {
        (
            self.slowdowns.len() + self.confirmations.len(),
            self.kls.len(),
        )
    }

    fn slowdown(&mut self, c: &Candidate) -> Result<f64, M::Error> {
        if let Some(&v) = self.slowdowns.get(c) {
            return Ok(v);
        }
        let v = self.measure.slowdown(c)?;
        self.slowdowns.insert(*c, v);
        Ok(v)
    }

    fn kl(&mut self, c: &Candidate) -> Result<f64, M::Error> {
        if let Some(&v) = self.kls.get(c) {
            return Ok(v);
        }
        let v = self.measure.kl(c)?;
        self.kls.insert(*c, v);
        Ok(v)
    }

    /// Whether `c` meets `budget` on two measurements (module docs, step 4): its first
    /// measurement when it does.
    fn fits(&mut self, c: &Candidate, budget: f64) -> Result<Option<f64>, M::Error> {
        let first = self.slowdown(c)?;
        if first > budget {
            return Ok(None);
        }
        let second = match self.confirmations.get(c) {
            Some(&v) => v,
            None => {
                let v = self.measure.slowdown(c)?;
                self.confirmations.insert(*c, v);
                v
            }
        };
        Ok((second <= budget).then_some(first))
    }

    /// `(KL, first slowdown, c)` when `c` fits `budget` ([`Tuner::fits`]).
    fn scored(&mut self, c: Candidate, budget: f64) -> Result<Option<Scored>, M::Error> {
        match self.fits(&c, budget)? {
            Some(sd) => Ok(Some((self.kl(&c)?, sd, c))),
            None => Ok(None),
        }
    }

    /// The confirming measurement of a configuration that fits ([`Tuner::choose`]).
    pub fn confirmation(&self, c: &Candidate) -> Option<f64> {
        self.confirmations.get(c).copied()
    }

    /// The lowest-KL configuration of `space` within `budget` (module docs).
    pub fn choose(&mut self, space: &Space, budget: f64) -> Result<Choice, M::Error> {
        // Lower KL wins, then lower slowdown.
        let mut best: Option<Scored> = None;
        let better = |a: &Scored, b: &Option<Scored>| match b {
            None => true,
            Some(b) => (a.0, a.1) < (b.0, b.1),
        };
        // Where raising may start: per (s, scheme) the largest common k within the budget,
        // and the smaller budgets' choices.
        let mut starts = Vec::new();
        for &scheme in &space.schemes {
            for &half_blocks in &space.shifts {
                let mut largest = None;
                for &k in &space.ladder {
                    let c = Candidate {
                        k: [k; 4],
                        half_blocks,
                        scheme,
                    };
                    if self.fits(&c, budget)?.is_none() {
                        break;
                    }
                    largest = Some(c);
                }
                if let Some(c) = largest {
                    starts.push(c);
                }
            }
        }
        starts.extend(self.chosen.iter().copied());
        for c in starts {
            if let Some(entry) = self.scored(c, budget)? {
                if better(&entry, &best) {
                    best = Some(entry);
                }
            }
        }
        if best.is_none() {
            let none = Candidate {
                k: [0; 4],
                half_blocks: [0; 4],
                scheme: Scheme::Channels,
            };
            best = self.scored(none, budget)?;
        }
        while let Some(current) = best {
            let c0 = current.2;
            let mut step: Option<Scored> = None;
            for set in 0..4 {
                if c0.scheme == Scheme::Bundles && set == 2 {
                    continue;
                }
                let Some(&next) = space.ladder.iter().find(|&&r| r > c0.k[set]) else {
                    continue;
                };
                let mut c = c0;
                c.k[set] = next;
                let Some(entry) = self.scored(c, budget)? else {
                    continue;
                };
                if entry.0 < current.0 && better(&entry, &step) {
                    step = Some(entry);
                }
            }
            match step {
                Some(s) => best = Some(s),
                None => break,
            }
        }
        if let Some((_, _, c)) = best {
            self.chosen.push(c);
        }
        Ok(match best {
            Some((kl, slowdown, c)) => Choice {
                budget,
                candidate: Some(c),
                slowdown,
                kl,
            },
            None => Choice {
                budget,
                candidate: None,
                slowdown: 0.0,
                kl: f64::NAN,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A machine where each set's channels cost time in proportion to k (bundles and lead/lag
    /// cost differently) and KL falls with every set's k; lead/lag costs accuracy.
    struct Model {
        calls: usize,
    }

    impl Measure for Model {
        type Error = std::convert::Infallible;
        fn slowdown(&mut self, c: &Candidate) -> Result<f64, Self::Error> {
            self.calls += 1;
            let per_k = [0.0010, 0.0004, 0.0020, 0.0012];
            let mut t: f64 = (0..4)
                .filter(|&i| !(c.scheme == Scheme::Bundles && i == 2))
                .map(|i| per_k[i] * c.k[i] as f64)
                .sum();
            if c.scheme == Scheme::Bundles {
                t += 0.0015 * c.bundle_k() as f64;
            }
            // Lead/lag hides some of the transfer time.
            let hidden = c.half_blocks.iter().map(|&h| f64::from(h)).sum::<f64>() * 0.05;
            Ok(t * (1.0 - hidden.min(0.5)))
        }
        fn kl(&mut self, c: &Candidate) -> Result<f64, Self::Error> {
            let weight = [0.3, 0.1, 0.4, 0.2];
            let mut kl: f64 = (0..4)
                .map(|i| {
                    let k = if c.scheme == Scheme::Bundles && i == 2 {
                        // Bundles refine gate/up through the neurons.
                        c.bundle_k() as f64 * 1.1
                    } else {
                        c.k[i] as f64
                    };
                    weight[i] / (1.0 + k / 8.0)
                })
                .sum();
            kl *= 1.0 + 0.08 * c.half_blocks.iter().map(|&h| f64::from(h)).sum::<f64>();
            Ok(kl)
        }
    }

    fn space() -> Space {
        Space {
            ladder: vec![4, 8, 16, 32, 64],
            shifts: vec![[0; 4], [1, 1, 1, 1], [2, 0, 2, 0]],
            schemes: vec![Scheme::Channels, Scheme::Bundles],
        }
    }

    fn all_candidates(space: &Space) -> Vec<Candidate> {
        let mut v = Vec::new();
        for &scheme in &space.schemes {
            for &half_blocks in &space.shifts {
                for &a in &space.ladder {
                    for &b in &space.ladder {
                        for &c in &space.ladder {
                            for &d in &space.ladder {
                                v.push(Candidate {
                                    k: [a, b, c, d],
                                    half_blocks,
                                    scheme,
                                });
                            }
                        }
                    }
                }
            }
        }
        v
    }

    #[test]
    fn choices_meet_the_budget_and_no_single_raise_improves_them() {
        let space = space();
        let mut t = Tuner::new(Model { calls: 0 });
        let mut reference = Model { calls: 0 };
        for budget in [0.025, 0.05, 0.1, 0.2] {
            let c = t.choose(&space, budget).unwrap();
            let cand = c.candidate.expect("something fits");
            assert!(
                t.confirmation(&cand).unwrap() <= budget,
                "confirmed within the budget"
            );
            assert!(c.slowdown <= budget, "{budget}: {c:?}");
            assert_eq!(c.slowdown, reference.slowdown(&cand).unwrap());
            assert_eq!(c.kl, reference.kl(&cand).unwrap());
            // At least as good as every common-k configuration within the budget.
            for x in all_candidates(&space)
                .into_iter()
                .filter(|x| x.k.iter().all(|&k| k == x.k[0]))
            {
                if reference.slowdown(&x).unwrap() <= budget {
                    assert!(c.kl <= reference.kl(&x).unwrap() + 1e-15, "{budget}: {x:?}");
                }
            }
            // A local optimum: no set's next rung fits and lowers KL.
            for set in 0..4 {
                if let Some(&next) = space.ladder.iter().find(|&&r| r > cand.k[set]) {
                    let mut x = cand;
                    x.k[set] = next;
                    if cand.scheme == Scheme::Bundles && set == 2 {
                        continue;
                    }
                    let fits = reference.slowdown(&x).unwrap() <= budget;
                    assert!(
                        !fits || reference.kl(&x).unwrap() >= c.kl,
                        "{budget}: {x:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn larger_budgets_never_choose_worse_and_measurements_are_kept() {
        let space = space();
        let mut t = Tuner::new(Model { calls: 0 });
        let kls: Vec<f64> = [0.025, 0.05, 0.1, 0.2]
            .iter()
            .map(|&b| t.choose(&space, b).unwrap().kl)
            .collect();
        assert!(kls.windows(2).all(|w| w[1] <= w[0]), "{kls:?}");
        let calls = t.measure().calls;
        let again = t.choose(&space, 0.05).unwrap();
        assert_eq!(
            t.measure().calls,
            calls,
            "a repeated budget measures nothing new"
        );
        assert_eq!(again.kl, kls[1]);
        let (speed, kl) = t.measured();
        assert!(speed < all_candidates(&space).len() / 10 && kl < speed);
    }

    #[test]
    fn a_tight_budget_refines_single_sets_or_nothing() {
        let mut t = Tuner::new(Model { calls: 0 });
        // k = 4 on every set costs 0.4·(1 + 0.4 + 2 + 1.2) % = 1.84 %: too much for 0.5 %.
        let c = t.choose(&space(), 0.005).unwrap();
        let cand = c.candidate.expect("single sets fit");
        assert!(
            cand.k.contains(&0) && cand.k.iter().any(|&k| k > 0),
            "{cand:?}"
        );
        assert!(c.slowdown <= 0.005);
        // Below the cost of no refinement at all (0 here), nothing.
        let c = t.choose(&space(), -0.01).unwrap();
        assert_eq!(c.candidate, None);
    }

    /// A machine whose first measurement of every configuration is lucky (too fast).
    struct Lucky {
        inner: Model,
        seen: std::collections::HashSet<Candidate>,
    }

    impl Measure for Lucky {
        type Error = std::convert::Infallible;
        fn slowdown(&mut self, c: &Candidate) -> Result<f64, Self::Error> {
            let true_cost = self.inner.slowdown(c)?;
            Ok(if self.seen.insert(*c) {
                true_cost * 0.5
            } else {
                true_cost
            })
        }
        fn kl(&mut self, c: &Candidate) -> Result<f64, Self::Error> {
            self.inner.kl(c)
        }
    }

    #[test]
    fn a_choice_over_budget_on_its_second_measurement_is_dropped() {
        let mut t = Tuner::new(Lucky {
            inner: Model { calls: 0 },
            seen: Default::default(),
        });
        let mut truth = Model { calls: 0 };
        for budget in [0.025, 0.05, 0.1] {
            let c = t.choose(&space(), budget).unwrap();
            let cand = c.candidate.expect("something fits");
            assert!(
                truth.slowdown(&cand).unwrap() <= budget,
                "{budget}: {cand:?}"
            );
        }
    }

    /// Down is cheap and matters most; every other set is dear.
    struct Uneven;

    impl Measure for Uneven {
        type Error = std::convert::Infallible;
        fn slowdown(&mut self, c: &Candidate) -> Result<f64, Self::Error> {
            let cost = [0.01, 0.01, 0.01, 0.001];
            Ok((0..4).map(|i| cost[i] * c.k[i] as f64).sum())
        }
        fn kl(&mut self, c: &Candidate) -> Result<f64, Self::Error> {
            let weight = [0.01, 0.01, 0.01, 1.0];
            Ok((0..4).map(|i| weight[i] / (1.0 + c.k[i] as f64)).sum())
        }
    }

    #[test]
    fn a_larger_budget_starts_from_the_smaller_budgets_choices() {
        let space = Space {
            ladder: vec![4, 8],
            shifts: vec![[0; 4]],
            schemes: vec![Scheme::Channels],
        };
        let mut t = Tuner::new(Uneven);
        // 1 %: no common k fits; from k = 0 the down set is raised to 8.
        let small = t.choose(&space, 0.01).unwrap();
        assert_eq!(small.candidate.unwrap().k, [0, 0, 0, 8]);
        // 12.5 %: common k = 4 fits (12.4 %) and no single raise from it does, but it is
        // worse than the 1 % choice, which fits too and can be raised from.
        let large = t.choose(&space, 0.125).unwrap();
        let mut fresh = Tuner::new(Uneven);
        let alone = fresh.choose(&space, 0.125).unwrap();
        assert_eq!(
            alone.candidate.unwrap().k,
            [4, 4, 4, 4],
            "the trap this guards"
        );
        assert!(
            large.kl < small.kl && large.kl < alone.kl,
            "{large:?} vs {small:?}"
        );
        assert!(large.slowdown <= 0.125);
    }

    #[test]
    fn labels_compress_equal_values() {
        let c = Candidate {
            k: [16; 4],
            half_blocks: [0; 4],
            scheme: Scheme::Channels,
        };
        assert_eq!(c.label(), "k16 s0 channels");
        let c = Candidate {
            k: [8, 16, 8, 16],
            half_blocks: [0, 1, 0, 1],
            scheme: Scheme::Bundles,
        };
        assert_eq!(c.label(), "k8,16,8,16 s0,0.5,0,0.5 bundles");
        assert_eq!(c.bundle_k(), 12);
    }
}

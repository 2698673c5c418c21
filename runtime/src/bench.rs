//! llama-bench-style speed measurement of a loaded model: prompt processing (`pp N`: one
//! forward of N tokens after a context of `depth`) and generation (`tg N`: N single-token
//! decode steps, greedy on the device, after the same context), each repeated and reported
//! as tokens/s mean ± sample sd.
//!
//! The context of a depth is prefilled once per test set and cut back to `depth` before every
//! repetition (a float cache truncates without cost), so long-context rows do not re-prefill
//! 32K tokens per repetition; every repetition is preceded by an untimed warm-up run (which
//! also captures the step graph).

use crate::backend::Backend;
use crate::error::Result;
use crate::kv_cache::KvCache;
use crate::model::{LogitsMode, Model};
use std::time::Instant;

/// One row of the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchTest {
    /// Process a prompt of this many tokens.
    Prompt(usize),
    /// Generate this many tokens one at a time.
    Generate(usize),
}

impl BenchTest {
    pub fn label(&self, depth: usize) -> String {
        let base = match self {
            BenchTest::Prompt(n) => format!("pp{n}"),
            BenchTest::Generate(n) => format!("tg{n}"),
        };
        if depth > 0 {
            format!("{base} @ d{depth}")
        } else {
            base
        }
    }

    fn tokens(&self) -> usize {
        match *self {
            BenchTest::Prompt(n) | BenchTest::Generate(n) => n,
        }
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchResult {
    pub test: String,
    pub depth: usize,
    /// Tokens processed per repetition.
    pub tokens: usize,
    /// tokens/s of every timed repetition.
    pub samples: Vec<f64>,
    pub mean: f64,
    pub sd: f64,
    /// Bytes a decode step reads from device memory (weights + KV at the mean context of
    /// the run); 0 for prompt tests.
    pub bytes_per_token: f64,
}

fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len().max(1) as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = if v.len() > 1 {
        v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (v.len() - 1) as f64
    } else {
        0.0
    };
    (mean, var.sqrt())
}

/// Pseudo-random token ids below `vocab` (weights are random too: values do not matter).
fn tokens(vocab: usize, n: usize, seed: u64) -> Vec<u32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}

/// Weight bytes a decode step streams: every projection and the output head (the embedding
/// is a one-row gather).
pub fn weight_bytes_per_token<B: Backend>(model: &Model<B>) -> f64 {
    let layers: usize = model
        .layers()
        .iter()
        .flat_map(|l| l.linears().map(|(_, lin)| lin.resident_bytes()))
        .sum();
    (layers + model.lm_head().resident_bytes()) as f64
}

/// Runs `tests` at every depth, `reps` timed repetitions each, on caches of `kv_dtype`.
pub fn run<B: Backend>(
    model: &Model<B>,
    tests: &[BenchTest],
    depths: &[usize],
    reps: usize,
    kv_dtype: crate::backend::KvDtype,
    seed: u64,
    mut progress: impl FnMut(&str),
) -> Result<Vec<BenchResult>> {
    let c = model.config();
    let vocab = c.vocab_size;
    let longest = tests.iter().map(BenchTest::tokens).max().unwrap_or(1);
    let kv_bytes_per_position =
        2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * kv_dtype.size_in_bytes();
    let weights = weight_bytes_per_token(model);
    let mut out = Vec::new();
    for &depth in depths {
        let mut cache = model.new_cache_with(depth + longest + 1, kv_dtype)?;
        if depth > 0 {
            progress(&format!("prefilling a context of {depth} tokens"));
            let ctx = tokens(vocab, depth, seed ^ depth as u64);
            model.forward(&ctx, &mut cache, LogitsMode::None)?;
            model.backend().synchronize()?;
        }
        for test in tests {
            let label = test.label(depth);
            progress(&label);
            let mut samples = Vec::with_capacity(reps);
            for rep in 0..=reps {
                cache.truncate(depth)?;
                let t0 = Instant::now();
                match *test {
                    BenchTest::Prompt(n) => {
                        let prompt = tokens(vocab, n, seed ^ (rep as u64 + 1) << 20);
                        model.forward(&prompt, &mut cache, LogitsMode::Last)?;
                    }
                    BenchTest::Generate(n) => {
                        let mut t = tokens(vocab, 1, seed ^ rep as u64)[0];
                        for _ in 0..n {
                            t = model.forward_greedy(&[t], &mut cache)?;
                        }
                    }
                }
                model.backend().synchronize()?;
                let secs = t0.elapsed().as_secs_f64();
                // Repetition 0 warms up (module loads, graph capture, allocator).
                if rep > 0 {
                    samples.push(test.tokens() as f64 / secs.max(1e-12));
                }
            }
            let (mean, sd) = mean_sd(&samples);
            let bytes_per_token = match *test {
                BenchTest::Prompt(_) => 0.0,
                BenchTest::Generate(n) => {
                    weights + kv_bytes_per_position as f64 * (depth as f64 + (n as f64 + 1.0) / 2.0)
                }
            };
            out.push(BenchResult {
                test: label,
                depth,
                tokens: test.tokens(),
                samples,
                mean,
                sd,
                bytes_per_token,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelOptions;
    use sfx_formats::DType;

    #[test]
    fn bench_runs_every_test_at_every_depth() {
        let c = crate::synthetic::preset("tiny").unwrap();
        let m = Model::synthetic(
            crate::CpuBackend::new(),
            &c,
            DType::BF16,
            3,
            &ModelOptions::default(),
        )
        .unwrap();
        let r = run(
            &m,
            &[BenchTest::Prompt(9), BenchTest::Generate(4)],
            &[0, 5],
            2,
            crate::backend::KvDtype::F16,
            1,
            |_| {},
        )
        .unwrap();
        let labels: Vec<&str> = r.iter().map(|x| x.test.as_str()).collect();
        assert_eq!(labels, ["pp9", "tg4", "pp9 @ d5", "tg4 @ d5"]);
        assert!(r.iter().all(|x| x.samples.len() == 2 && x.mean > 0.0));
        assert!(r[3].bytes_per_token > r[1].bytes_per_token);
    }
}

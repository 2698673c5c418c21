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
use crate::refine::Refiner;
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
    /// The KV cache ([`BenchKv::label`]).
    pub kv: String,
    /// Whether the cache lets decode steps replay as captured graphs.
    pub graph_capable: bool,
    /// tokens/s of every timed repetition.
    pub samples: Vec<f64>,
    pub mean: f64,
    pub sd: f64,
    /// Bytes a decode step reads from device memory (weights + KV at the mean context of
    /// the run); 0 for prompt tests.
    pub bytes_per_token: f64,
    /// A quantized cache's bytes per tier at the end of the row (resident: FP16 sink and tail
    /// stores plus encoded tiles; backing: refinement units, in the tier the label names), as
    /// the cache counts them; none for a float cache.
    pub kv_bytes: Option<crate::kv::KvBytes>,
    /// Refinement unit bytes a generated token read (all layers and KV heads; the cache's
    /// own counter over the timed repetitions); 0 without refinement.
    pub kv_refine_read_per_token: f64,
    /// Selective weight refinement of the row ([`BenchRefine`]): `k16` and where it runs;
    /// empty for the resident base alone.
    pub refine: String,
    /// Weight refinement bytes a generated token read (the engine's counter over the timed
    /// repetitions); 0 without refinement.
    pub refine_read_per_token: f64,
}

/// ` s0.5` (one lead/lag for every set), ` s0.5,1,1,0.5` (per set), or nothing at s = 0.
fn shift_label(s: [f32; 4]) -> String {
    if s == [0.0; 4] {
        String::new()
    } else if s.iter().all(|&v| v == s[0]) {
        format!(" s{}", s[0])
    } else {
        format!(" s{},{},{},{}", s[0], s[1], s[2], s[3])
    }
}

/// Weight-refinement rows of a run: `refiner` measured at every budget of `ks` (k per 1024
/// channels, every projection set), each beside the base row (no refinement) of the same
/// test, depth and cache.
pub struct BenchRefine<'r, B: Backend> {
    pub refiner: &'r mut Refiner<B>,
    pub ks: Vec<usize>,
    /// Where the engine reads from, for the rows' labels (e.g. `ram`).
    pub tier: String,
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

/// KV bytes a decode step reads at a context of `ctx` positions: every position of a float
/// cache, or a KVarN cache's filled sink rows, encoded tiles and tail rows.
fn kv_bytes_read(c: &sfx_formats::ModelConfig, kv: &BenchKv, ctx: usize) -> f64 {
    let heads = (c.num_hidden_layers * c.num_key_value_heads) as f64;
    let d = c.head_dim;
    match kv {
        BenchKv::Float(dtype) => heads * (2 * d * dtype.size_in_bytes() * ctx) as f64,
        BenchKv::Quantized(config) => {
            let Ok(Some(base)) = config.base.build(d) else {
                return 0.0;
            };
            let sinks = ctx.min(config.sinks);
            let rest = ctx - sinks;
            let (tiles, tail) = (rest / base.tile_tokens(), rest % base.tile_tokens());
            heads * ((sinks + tail) * d * 4 + tiles * base.tile_bytes()) as f64
        }
    }
}

/// The KV cache a row runs on.
#[derive(Debug, Clone)]
pub enum BenchKv {
    /// The model's float cache of this element type.
    Float(crate::backend::KvDtype),
    /// A quantized cache ([`crate::kv::new_quantized_cache`]'s choice), encoded from the float
    /// prefill of the depth as a quantized prefill encodes it.
    Quantized(crate::kv::KvConfig),
}

impl BenchKv {
    pub fn label(&self) -> String {
        match self {
            BenchKv::Float(dtype) => dtype.as_str().to_string(),
            BenchKv::Quantized(c) => format!("kvarn {}", c.label()),
        }
    }
}

/// A row's quantized cache, kept as its type so the row can read its bytes and counters.
enum QuantizedCache<B: Backend> {
    Host(crate::kv::QuantKvCache<B>),
    Device(crate::kv::BackendKvarnCache<B>),
}

impl<B: Backend> QuantizedCache<B> {
    fn cache(&mut self) -> &mut dyn KvCache<B> {
        match self {
            QuantizedCache::Host(c) => c,
            QuantizedCache::Device(c) => c,
        }
    }

    fn bytes(&self) -> crate::kv::KvBytes {
        match self {
            QuantizedCache::Host(c) => c.bytes(),
            QuantizedCache::Device(c) => c.bytes(),
        }
    }

    fn bytes_fetched(&self) -> u64 {
        match self {
            QuantizedCache::Host(c) => c.stats().bytes_fetched,
            QuantizedCache::Device(c) => c.stats().bytes_fetched,
        }
    }

    fn reset_stats(&mut self) {
        match self {
            QuantizedCache::Host(c) => c.reset_stats(),
            QuantizedCache::Device(c) => c.reset_stats(),
        }
    }
}

/// The cache of one row at `depth`: the float cache cut back, or a quantized cache encoded
/// from it (cut back too when the cut is on a tile boundary, else encoded again).
fn row_cache<'c, B: Backend>(
    model: &Model<B>,
    float: &'c mut crate::kv_cache::FloatKvCache<B>,
    kv: &BenchKv,
    depth: usize,
    capacity: usize,
    quantized: &'c mut Option<QuantizedCache<B>>,
) -> Result<&'c mut dyn KvCache<B>> {
    match kv {
        BenchKv::Float(_) => {
            float.truncate(depth)?;
            Ok(float)
        }
        BenchKv::Quantized(config) => {
            let reusable = match quantized.as_mut() {
                Some(q) => q.cache().truncate(depth).is_ok(),
                None => false,
            };
            if !reusable {
                let b = model.backend();
                *quantized = Some(if crate::kv::runs_in_backend(config) {
                    QuantizedCache::Device(crate::kv::BackendKvarnCache::from_float(
                        b, float, depth, capacity, config,
                    )?)
                } else {
                    QuantizedCache::Host(crate::kv::QuantKvCache::from_f32(
                        b, float, depth, capacity, config,
                    )?)
                });
            }
            match quantized.as_mut() {
                Some(q) => Ok(q.cache()),
                None => Err(crate::error::RuntimeError::EmptyInput),
            }
        }
    }
}

/// Runs `tests` at every depth on every KV cache of `kvs`, `reps` timed repetitions each.
/// The context of a depth is prefilled once into a float cache of `prefill_dtype`; quantized
/// caches are encoded from it.
#[allow(clippy::too_many_arguments)]
pub fn run<B: Backend>(
    model: &Model<B>,
    tests: &[BenchTest],
    depths: &[usize],
    reps: usize,
    prefill_dtype: crate::backend::KvDtype,
    kvs: &[BenchKv],
    seed: u64,
    mut refine: Option<BenchRefine<'_, B>>,
    mut progress: impl FnMut(&str),
) -> Result<Vec<BenchResult>> {
    // Budget 0 is the base row.
    let budgets: Vec<usize> = std::iter::once(0)
        .chain(refine.iter().flat_map(|r| r.ks.iter().copied()))
        .collect();
    let tier = refine.as_ref().map(|r| r.tier.clone()).unwrap_or_default();
    let c = model.config();
    let vocab = c.vocab_size;
    let longest = tests.iter().map(BenchTest::tokens).max().unwrap_or(1);
    let weights = weight_bytes_per_token(model);
    let mut out = Vec::new();
    for &depth in depths {
        let capacity = depth + longest + 1;
        let mut float = model.new_cache_with(capacity, prefill_dtype)?;
        if depth > 0 {
            progress(&format!("prefilling a context of {depth} tokens"));
            let ctx = tokens(vocab, depth, seed ^ depth as u64);
            model.forward(&ctx, &mut float, LogitsMode::None)?;
            model.backend().synchronize()?;
        }
        for kv in kvs {
            let mut quantized: Option<QuantizedCache<B>> = None;
            for (test, &k) in tests
                .iter()
                .flat_map(|t| budgets.iter().map(move |k| (t, k)))
            {
                let label = test.label(depth);
                let mut refiner = match (k, refine.as_mut()) {
                    (0, _) | (_, None) => None,
                    (k, Some(r)) => {
                        r.refiner.set_budgets(model.backend(), [k; 4])?;
                        Some(&mut *r.refiner)
                    }
                };
                let refine_label = match &refiner {
                    Some(r) => format!(
                        "k{k}{} {tier}{}",
                        shift_label(r.settings().s),
                        if r.in_backend() { "" } else { " (host-driven)" }
                    ),
                    None => String::new(),
                };
                progress(&format!(
                    "{label}, {} KV{}",
                    kv.label(),
                    if refine_label.is_empty() {
                        String::new()
                    } else {
                        format!(", refinement {refine_label}")
                    }
                ));
                let mut samples = Vec::with_capacity(reps);
                let mut graph_capable = false;
                let mut fetched = 0u64;
                let mut refine_read = 0u64;
                for rep in 0..=reps {
                    if let Some(q) = quantized.as_mut() {
                        q.reset_stats();
                    }
                    if let Some(r) = refiner.as_deref_mut() {
                        r.reset_counters();
                    }
                    let cache = row_cache(model, &mut float, kv, depth, capacity, &mut quantized)?;
                    graph_capable = cache.graph_id().is_some();
                    let t0 = Instant::now();
                    match *test {
                        BenchTest::Prompt(n) => {
                            let prompt = tokens(vocab, n, seed ^ (rep as u64 + 1) << 20);
                            match refiner.as_deref_mut() {
                                Some(r) => {
                                    model.forward_refined(&prompt, cache, LogitsMode::Last, r)?;
                                }
                                None => {
                                    model.forward(&prompt, cache, LogitsMode::Last)?;
                                }
                            }
                        }
                        BenchTest::Generate(n) => {
                            let mut t = tokens(vocab, 1, seed ^ rep as u64)[0];
                            for _ in 0..n {
                                t = model.forward_greedy_with(
                                    &[t],
                                    cache,
                                    refiner.as_deref_mut(),
                                )?;
                            }
                        }
                    }
                    model.backend().synchronize()?;
                    let secs = t0.elapsed().as_secs_f64();
                    // Repetition 0 warms up (module loads, graph capture, allocator).
                    if rep > 0 {
                        samples.push(test.tokens() as f64 / secs.max(1e-12));
                        fetched += quantized.as_ref().map_or(0, QuantizedCache::bytes_fetched);
                        refine_read += refiner.as_ref().map_or(0, |r| r.counters().bytes_applied);
                    }
                }
                // A timed repetition's total, per generated token.
                let per_token = |total: u64| match *test {
                    BenchTest::Generate(n) if reps > 0 => total as f64 / (reps * n) as f64,
                    _ => 0.0,
                };
                let refine_read_per_token = per_token(refine_read);
                let kv_refine_read_per_token = per_token(fetched);
                // A float row never builds a quantized cache: none.
                let kv_bytes = quantized.as_ref().map(QuantizedCache::bytes);
                let (mean, sd) = mean_sd(&samples);
                let bytes_per_token = match *test {
                    BenchTest::Prompt(_) => 0.0,
                    BenchTest::Generate(n) => {
                        // At the run's mean context.
                        let ctx = depth + n.div_ceil(2);
                        weights + kv_bytes_read(c, kv, ctx)
                    }
                };
                out.push(BenchResult {
                    test: label,
                    depth,
                    tokens: test.tokens(),
                    kv: kv.label(),
                    graph_capable,
                    samples,
                    mean,
                    sd,
                    bytes_per_token,
                    kv_bytes,
                    kv_refine_read_per_token,
                    refine: refine_label,
                    refine_read_per_token,
                });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelOptions;
    use sfx_formats::DType;

    fn tiny_model(preset: &str) -> Model<crate::CpuBackend> {
        let c = crate::synthetic::preset(preset).unwrap();
        Model::synthetic(
            crate::CpuBackend::new(),
            &c,
            DType::BF16,
            3,
            &ModelOptions::default(),
        )
        .unwrap()
    }

    #[test]
    fn bench_runs_every_test_at_every_depth() {
        let m = tiny_model("tiny");
        let r = run(
            &m,
            &[BenchTest::Prompt(9), BenchTest::Generate(4)],
            &[0, 5],
            2,
            crate::backend::KvDtype::F16,
            &[BenchKv::Float(crate::backend::KvDtype::F16)],
            1,
            None,
            |_| {},
        )
        .unwrap();
        let labels: Vec<&str> = r.iter().map(|x| x.test.as_str()).collect();
        assert_eq!(labels, ["pp9", "tg4", "pp9 @ d5", "tg4 @ d5"]);
        assert!(r.iter().all(|x| x.samples.len() == 2 && x.mean > 0.0));
        assert!(r[3].bytes_per_token > r[1].bytes_per_token);
    }

    /// A KVarN row at a depth past the first tile: its cache is encoded from the float
    /// prefill, cut back between repetitions, and reads fewer KV bytes than the f16 row.
    #[test]
    fn bench_runs_a_quantized_cache_beside_the_float_one() {
        use crate::kv::{KvBaseChoice, KvBits, KvConfig};
        let m = tiny_model("tiny-qwen3");
        let kvarn = KvConfig {
            sinks: 4,
            ..KvConfig::base(KvBaseChoice::Kvarn(KvBits { key: 2, value: 2 }))
        };
        let f16 = crate::backend::KvDtype::F16;
        let r = run(
            &m,
            &[BenchTest::Prompt(3), BenchTest::Generate(6)],
            &[4 + 128 + 120],
            2,
            f16,
            &[BenchKv::Float(f16), BenchKv::Quantized(kvarn)],
            1,
            None,
            |_| {},
        )
        .unwrap();
        let kv: Vec<&str> = r.iter().map(|x| x.kv.as_str()).collect();
        assert_eq!(kv, ["f16", "f16", "kvarn 2/2", "kvarn 2/2"]);
        assert!(r.iter().all(|x| x.samples.len() == 2 && x.mean > 0.0));
        assert!(r[3].bytes_per_token < r[1].bytes_per_token);
    }

    /// A refined KVarN row reports the cache's bytes per tier and the units each token read,
    /// equal to the record and unit sizes of docs/format.md worked out by hand: 2/2 records
    /// of 128 tokens hold 32·d bytes of key codes, 4·d of key A and Z, 256 of key B, 32·d of
    /// value codes, 2·d of value B and 512 of value A and Z; a +4/+4 unit of 2 tokens holds
    /// 2·d bytes, 64 units a tile.
    #[test]
    fn bench_reports_kv_bytes_per_tier() {
        use crate::kv::RefineBits;
        use crate::kv::{KvBaseChoice, KvBits, KvConfig, KvRefineConfig, KvTierConfig};
        let m = tiny_model("tiny-qwen3");
        let c = m.config().clone();
        let kvarn = KvConfig {
            sinks: 4,
            refine: Some(KvRefineConfig {
                bits: RefineBits { key: 4, value: 4 },
                group: 2,
                fraction: 1.0 / 8.0,
                tier: KvTierConfig::Ram,
            }),
            ..KvConfig::base(KvBaseChoice::Kvarn(KvBits { key: 2, value: 2 }))
        };
        let f16 = crate::backend::KvDtype::F16;
        // Two tiles after the sinks, 10 tail rows; 6 more tokens stay inside the tail.
        let depth = 4 + 2 * 128 + 10;
        let r = run(
            &m,
            &[BenchTest::Generate(6)],
            &[depth],
            2,
            f16,
            &[BenchKv::Float(f16), BenchKv::Quantized(kvarn)],
            1,
            None,
            |_| {},
        )
        .unwrap();
        assert!(r[0].kv_bytes.is_none() && r[0].kv_refine_read_per_token == 0.0);
        let b = r[1].kv_bytes.as_ref().expect("a quantized row has bytes");
        let (d, heads) = (c.head_dim, c.num_hidden_layers * c.num_key_value_heads);
        let record = (70 * d + 768).next_multiple_of(8);
        let fp16_rows = (4 + 128) * d * 4; // sink and tail stores, keys and values
        assert_eq!(b.resident as usize, (fp16_rows + 2 * record) * heads);
        assert_eq!(b.tier.backing as usize, 2 * 64 * 2 * d * heads);
        // 128 eligible groups a KV head, 1/8 of them selected at every step.
        let per_token = (16 * 2 * d * heads) as f64;
        assert_eq!(r[1].kv_refine_read_per_token, per_token);
    }
}

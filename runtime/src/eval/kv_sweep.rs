//! Long-context evaluation of KV cache configurations side by side (docs/method.md §5 and §7):
//! each part is prefilled once with exact attention (the float cache), then every
//! configuration encodes that prefill into its own cache — exactly what a quantized cache
//! does at prefill, "from the uncompressed K/V" — and scores the remaining tokens one at a
//! time through the decode path. KL is measured against a reference run with every position
//! in FP16 (`--kv f16`), of this model or of a separate reference model.

use std::time::Instant;

use super::kl::{KlAccumulator, KlSummary, ReferenceRow, KL_TOP_K};
use super::ppl::{log_softmax_at, NllAccumulator, PplSummary};
use super::runner::EvalPart;
use crate::backend::Backend;
use crate::error::{Result, RuntimeError};
use crate::kv::{
    runs_in_backend, BackendKvarnCache, KvBaseChoice, KvCacheStats, KvConfig, QuantKvCache,
};
use crate::kv_cache::KvCache;
use crate::model::{LogitsMode, Model};
use crate::refine::store::StoreStats;
use crate::refine::Refiner;

/// One configuration's result over all parts.
#[derive(Debug, Clone, serde::Serialize)]
pub struct KvRun {
    pub label: String,
    pub ppl: PplSummary,
    pub kl: Option<KlSummary>,
    pub parts: Vec<KvPartResult>,
    /// Wall time of the decode steps only (the shared prefill is excluded).
    pub decode_seconds: f64,
    pub decode_tokens_per_second: f64,
    pub stats: KvCacheStats,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier: Option<StoreStats>,
    /// Bytes at the end of the last part (resident, backing, RAM cache).
    pub bytes: crate::kv::cache::KvBytes,
    /// Highest RAM-cache occupancy over the whole run (SSD tier).
    pub cache_peak_bytes: u64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct KvPartResult {
    pub name: String,
    pub ppl: PplSummary,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl: Option<KlSummary>,
}

/// Model (and optional weight refiner) of one side of the comparison.
pub struct KvSide<'a, B: Backend> {
    pub model: &'a Model<B>,
    pub refiner: Option<&'a mut Refiner<B>>,
}

impl<B: Backend> KvSide<'_, B> {
    fn forward(&mut self, tokens: &[u32], cache: &mut dyn KvCache<B>) -> Result<Vec<f32>> {
        let logits = match self.refiner.as_deref_mut() {
            Some(r) => self
                .model
                .forward_refined(tokens, cache, LogitsMode::Last, r)?,
            None => self.model.forward(tokens, cache, LogitsMode::Last)?,
        };
        super::ModelScorer::<B>::last_row(logits)
    }

    /// Exact prefill of `tokens`: the float cache and the last position's logits.
    fn prefill(
        &mut self,
        tokens: &[u32],
        capacity: usize,
    ) -> Result<(crate::FloatKvCache<B>, Vec<f32>)> {
        let mut cache = self.model.new_cache(capacity)?;
        let logits = self.forward(tokens, &mut cache)?;
        Ok((cache, logits))
    }
}

fn is_reference_config(c: &KvConfig) -> bool {
    c.base == KvBaseChoice::F16 && c.refine.is_none()
}

/// Scores `configs` on `parts` (long-context parts, scored through decode). The reference for
/// KL is `reference` with FP16 KV when given, else `model` itself with FP16 KV (a config equal
/// to the reference then reuses its logits: KL 0 by construction, not re-measured).
pub fn kv_sweep<'a, B: Backend>(
    mut model: KvSide<'a, B>,
    mut reference: Option<KvSide<'a, B>>,
    parts: &[EvalPart],
    configs: &[KvConfig],
    mut progress: impl FnMut(&str),
) -> Result<Vec<KvRun>> {
    let vocab = model.model.config().vocab_size;
    struct Acc {
        nll: NllAccumulator,
        kl: KlAccumulator,
        parts: Vec<KvPartResult>,
        seconds: f64,
        tokens: u64,
        stats: KvCacheStats,
        tier: Option<StoreStats>,
        bytes: crate::kv::cache::KvBytes,
    }
    let mut accs: Vec<Acc> = configs
        .iter()
        .map(|_| Acc {
            nll: NllAccumulator::default(),
            kl: KlAccumulator::default(),
            parts: Vec::new(),
            seconds: 0.0,
            tokens: 0,
            stats: KvCacheStats::default(),
            tier: None,
            bytes: Default::default(),
        })
        .collect();
    let f16 = KvConfig::base(KvBaseChoice::F16);
    for part in parts {
        if !part.through_decode || part.first_scored == 0 || part.first_scored >= part.tokens.len()
        {
            return Err(RuntimeError::Config(format!(
                "part '{}': KV sweeps need a long-context part scored through decode",
                part.name
            )));
        }
        let n = part.tokens.len();
        let prefix = &part.tokens[..part.first_scored];
        progress(&format!("{}: prefill {} tokens", part.name, prefix.len()));
        // The exact prefill of the model under test; an internal reference shares it.
        let (float, first) = model.prefill(prefix, n)?;
        // Reference logits of every scored position (FP16 KV).
        let external = reference
            .as_mut()
            .map(|r| r.prefill(prefix, n))
            .transpose()?;
        let (ref_float, ref_first) = external.as_ref().map_or((&float, &first), |(f, l)| (f, l));
        let backend = model.model.backend();
        let mut ref_cache = QuantKvCache::from_f32(backend, ref_float, prefix.len(), n, &f16)?;
        let mut reference_logits = Vec::with_capacity((n - part.first_scored) * vocab);
        let side = reference.as_mut().unwrap_or(&mut model);
        let ref_seconds = decode_scored(side, &mut ref_cache, part, ref_first, |_, l| {
            reference_logits.extend_from_slice(l)
        })?;
        // Only the counters outlive the reference pass; its caches are freed before the sweep.
        let (ref_stats, ref_bytes) = (ref_cache.stats().clone(), ref_cache.bytes());
        drop((ref_cache, external));
        progress(&format!("{}: FP16-KV reference done", part.name));
        for (ci, config) in configs.iter().enumerate() {
            let acc = &mut accs[ci];
            let mut nll = NllAccumulator::default();
            let mut kl = KlAccumulator::default();
            if reference.is_none() && is_reference_config(config) {
                // The reference run is this configuration: its decode time and bytes count.
                acc.seconds += ref_seconds;
                acc.tokens += (n - 1 - part.first_scored) as u64;
                acc.stats.merge(&ref_stats);
                acc.bytes = ref_bytes.clone();
                for pos in part.first_scored..n {
                    let j = pos - part.first_scored;
                    let l = &reference_logits[j * vocab..(j + 1) * vocab];
                    nll.push(-log_softmax_at(l, part.tokens[pos] as usize));
                    kl.push(&ReferenceRow::new(l, KL_TOP_K), l);
                }
            } else {
                let backend = model.model.backend();
                let score = |j: usize, l: &[f32]| {
                    nll.push(-log_softmax_at(
                        l,
                        part.tokens[part.first_scored + j] as usize,
                    ));
                    let r = &reference_logits[j * vocab..(j + 1) * vocab];
                    kl.push(&ReferenceRow::new(r, KL_TOP_K), l);
                };
                if runs_in_backend(config) {
                    let mut cache =
                        BackendKvarnCache::from_float(backend, &float, prefix.len(), n, config)?;
                    acc.seconds += decode_scored(&mut model, &mut cache, part, &first, score)?;
                    acc.stats.merge(cache.stats());
                    acc.bytes = cache.bytes();
                } else {
                    let mut cache =
                        QuantKvCache::from_f32(backend, &float, prefix.len(), n, config)?;
                    acc.seconds += decode_scored(&mut model, &mut cache, part, &first, score)?;
                    cache.wait_idle(std::time::Duration::from_secs(5));
                    acc.stats.merge(cache.stats());
                    if let Some(s) = cache.tier_stats() {
                        acc.tier.get_or_insert_with(StoreStats::default).merge(&s);
                    }
                    acc.bytes = cache.bytes();
                }
                acc.tokens += (n - 1 - part.first_scored) as u64;
            }
            let ppl = nll.summary().ok_or(RuntimeError::EmptyInput)?;
            progress(&format!(
                "{}: {:<28} PPL {:.4}  KL {:.5}",
                part.name,
                config.label(),
                ppl.ppl,
                kl.summary().map_or(f64::NAN, |k| k.mean)
            ));
            acc.parts.push(KvPartResult {
                name: part.name.clone(),
                ppl,
                kl: kl.summary(),
            });
            acc.nll.merge(&nll);
            acc.kl.merge(&kl);
        }
    }
    configs
        .iter()
        .zip(accs)
        .map(|(c, a)| {
            Ok(KvRun {
                label: c.label(),
                ppl: a.nll.summary().ok_or(RuntimeError::EmptyInput)?,
                kl: a.kl.summary(),
                parts: a.parts,
                decode_seconds: a.seconds,
                decode_tokens_per_second: a.tokens as f64 / a.seconds.max(1e-9),
                stats: a.stats,
                cache_peak_bytes: a.tier.as_ref().map_or(0, |t| t.cache_peak_bytes),
                tier: a.tier,
                bytes: a.bytes,
            })
        })
        .collect()
}

/// Scores the span of `part` after its prefill: `f(j, logits)` for scored position
/// `first_scored + j`, starting from the prefill's last logits `first`, decoding one token at
/// a time through `cache`. Returns the seconds spent in the loop.
fn decode_scored<B: Backend>(
    side: &mut KvSide<'_, B>,
    cache: &mut dyn KvCache<B>,
    part: &EvalPart,
    first: &[f32],
    mut f: impl FnMut(usize, &[f32]),
) -> Result<f64> {
    let t0 = Instant::now();
    f(0, first);
    for pos in part.first_scored..part.tokens.len() - 1 {
        let logits = side.forward(&[part.tokens[pos]], cache)?;
        f(pos + 1 - part.first_scored, &logits);
    }
    Ok(t0.elapsed().as_secs_f64())
}

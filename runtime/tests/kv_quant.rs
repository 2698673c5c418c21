//! Quantized KV cache against independent recomputation: eq. 8 correction vs attention
//! recomputed from scratch, the FP16 base vs the float cache, resident bytes vs the KVarN
//! record arithmetic, and the SSD cache budget.

use half::f16;
use sfx_runtime::backend::Backend;
use sfx_runtime::kv::{
    KvBaseChoice, KvBits, KvConfig, KvRefineConfig, KvTierConfig, QuantKvCache, RefineBits,
};
use sfx_runtime::refine::MissPolicy;
use sfx_runtime::{CpuBackend, FloatKvCache, KvCache, KvShape};

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

const D: usize = 64;

/// Keys with two loud channels (what KVarN's per-channel scales are for) and a few tokens
/// that attract attention, so selection has something to find.
fn kv_rows(rng: &mut Lcg, n: usize, kv_heads: usize, first_pos: usize) -> (Vec<f32>, Vec<f32>) {
    let mut k = rng.vec(n * kv_heads * D, 1.0);
    let v = rng.vec(n * kv_heads * D, 1.0);
    for t in 0..n {
        for j in 0..kv_heads {
            let row = &mut k[(t * kv_heads + j) * D..(t * kv_heads + j + 1) * D];
            row[3] *= 6.0;
            row[17] += 4.0;
            if (first_pos + t) % 37 == 5 {
                row.iter_mut().for_each(|x| *x *= 2.5);
            }
        }
    }
    (k, v)
}

/// Fills `cache` with `n` positions through multi-token appends (prefill chunks) and commits.
fn fill(
    b: &CpuBackend,
    cache: &mut dyn KvCache<CpuBackend>,
    rng: &mut Lcg,
    n: usize,
    n_heads: usize,
) {
    let shape = cache.shape();
    let mut done = 0;
    while done < n {
        let m = (n - done).min(100);
        for layer in 0..shape.layers {
            let (k, v) = kv_rows(rng, m, shape.kv_heads, done);
            let q = rng.vec(m * n_heads * D, 1.0);
            let (qb, kb, vb) = (
                b.upload(&q).unwrap(),
                b.upload(&k).unwrap(),
                b.upload(&v).unwrap(),
            );
            let mut out = b.alloc(m * n_heads * D).unwrap();
            cache
                .append_and_attend(
                    b,
                    layer,
                    n_heads,
                    m,
                    &positions_of(cache.len(), m),
                    &qb,
                    &kb,
                    &vb,
                    &mut out,
                )
                .unwrap();
        }
        cache.commit(m).unwrap();
        done += m;
    }
}

fn ram_refine(group: usize, fraction: f64) -> KvRefineConfig {
    KvRefineConfig {
        bits: RefineBits { key: 4, value: 4 },
        group,
        fraction,
        tier: KvTierConfig::Ram,
    }
}

/// One decode step on layer 0..layers; returns layer 0's attention output.
fn decode_step(
    b: &CpuBackend,
    cache: &mut dyn KvCache<CpuBackend>,
    rng: &mut Lcg,
    n_heads: usize,
    q_scale: f32,
    q_seed: Option<u64>,
) -> (Vec<f32>, Vec<f32>) {
    let shape = cache.shape();
    let pos = cache.len();
    let mut first = (Vec::new(), Vec::new());
    for layer in 0..shape.layers {
        let (k, v) = kv_rows(rng, 1, shape.kv_heads, pos);
        // A fixed query seed makes consecutive steps attend alike, as real decoding does.
        let q = match q_seed {
            Some(seed) => Lcg(seed + layer as u64).vec(n_heads * D, q_scale),
            None => rng.vec(n_heads * D, q_scale),
        };
        let (qb, kb, vb) = (
            b.upload(&q).unwrap(),
            b.upload(&k).unwrap(),
            b.upload(&v).unwrap(),
        );
        let mut out = b.alloc(n_heads * D).unwrap();
        cache
            .append_and_attend(
                b,
                layer,
                n_heads,
                1,
                &positions_of(cache.len(), 1),
                &qb,
                &kb,
                &vb,
                &mut out,
            )
            .unwrap();
        if layer == 0 {
            let mut o = vec![0.0f32; n_heads * D];
            b.download(&out, &mut o).unwrap();
            first = (q, o);
        }
    }
    cache.commit(1).unwrap();
    first
}

/// Softmax attention of one query over `[n, D]` keys/values, in f64.
fn attend_f64(q: &[f32], k: &[f32], v: &[f32]) -> Vec<f64> {
    let n = k.len() / D;
    let s: Vec<f64> = (0..n)
        .map(|i| {
            q.iter()
                .zip(&k[i * D..(i + 1) * D])
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum::<f64>()
                / (D as f64).sqrt()
        })
        .collect();
    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let z: f64 = w.iter().sum();
    let mut o = vec![0.0f64; D];
    for i in 0..n {
        for c in 0..D {
            o[c] += w[i] / z * f64::from(v[i * D + c]);
        }
    }
    o
}

#[test]
fn eq8_correction_equals_attention_recomputed_with_refined_tokens() {
    let b = CpuBackend::new();
    let shape = KvShape {
        layers: 1,
        kv_heads: 2,
        head_dim: D,
    };
    let n_heads = 4;
    let config = KvConfig {
        base: KvBaseChoice::Kvarn(KvBits { key: 2, value: 2 }),
        sinks: 8,
        refine: Some(ram_refine(2, 1.0 / 16.0)),
    };
    let mut cache = QuantKvCache::<CpuBackend>::new(shape, 1024, &config).unwrap();
    let mut rng = Lcg(7);
    // 8 sinks + 3 tiles + a 37-token tail.
    fill(&b, &mut cache, &mut rng, 8 + 3 * 128 + 36, n_heads);
    let (q, out) = decode_step(&b, &mut cache, &mut rng, n_heads, 3.0, None);
    let base = cache.base().unwrap().clone();
    let gq = n_heads / shape.kv_heads;
    let mut worst = 0.0f64;
    let mut moved = 0.0f64;
    for j in 0..shape.kv_heads {
        let selected = cache.last_selection(0, j).to_vec();
        // 3 tiles × 64 groups = 192 eligible, 1/16 → 12 selected.
        assert_eq!(selected.len(), 12, "head {j}");
        let (k_res, v_res) = cache.dequantized_head(0, j);
        let (mut k, mut v) = (k_res.clone(), v_res.clone());
        for &gi in &selected {
            let (kr, vr) = cache
                .refined_group(0, j, gi)
                .expect("RAM tier serves every unit");
            let pos = 8 + gi * 2;
            k[pos * D..(pos + 2) * D].copy_from_slice(&kr);
            v[pos * D..(pos + 2) * D].copy_from_slice(&vr);
        }
        // Eq. 7 recomputed: softmax weights from the resident keys, summed per 2-token group
        // of the encoded tiles, max over the query heads of this KV head; the top 12.
        let n = k_res.len() / D;
        let mut group_score = vec![f64::NEG_INFINITY; 3 * 64];
        for hl in 0..gq {
            let h = j * gq + hl;
            let mut qc = q[h * D..(h + 1) * D].to_vec();
            base.to_code_frame(&mut qc);
            let s: Vec<f64> = (0..n)
                .map(|i| {
                    qc.iter()
                        .zip(&k_res[i * D..(i + 1) * D])
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum::<f64>()
                        / 8.0
                })
                .collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
            for (gi, score) in group_score.iter_mut().enumerate() {
                let pos = 8 + 2 * gi;
                let w = ((s[pos] - m).exp() + (s[pos + 1] - m).exp()) / z;
                *score = score.max(w);
            }
        }
        let mut order: Vec<usize> = (0..group_score.len()).collect();
        order.sort_by(|&a, &b| group_score[b].total_cmp(&group_score[a]));
        let mut top: Vec<usize> = order[..12].to_vec();
        top.sort_unstable();
        assert_eq!(selected, top, "head {j}: eq. 7 selection");
        for hl in 0..gq {
            let h = j * gq + hl;
            let mut qc = q[h * D..(h + 1) * D].to_vec();
            base.to_code_frame(&mut qc);
            let to_model = |o: Vec<f64>| {
                let mut x: Vec<f32> = o.iter().map(|&y| y as f32).collect();
                base.to_model_frame(&mut x);
                x
            };
            let want = to_model(attend_f64(&qc, &k, &v));
            let unrefined = to_model(attend_f64(&qc, &k_res, &v_res));
            let got = &out[h * D..(h + 1) * D];
            for c in 0..D {
                worst = worst.max(f64::from((got[c] - want[c]).abs()));
                moved = moved.max(f64::from((want[c] - unrefined[c]).abs()));
            }
        }
    }
    // f32 accumulation over 429 positions vs f64: a few e-7 observed.
    assert!(
        worst < 2e-5,
        "corrected output differs from recomputation by {worst}"
    );
    // The refinement must have changed the output far beyond that tolerance.
    assert!(moved > 1e-3, "refinement moved the output by only {moved}");
}

#[test]
fn f16_base_matches_float_cache_fed_fp16_values() {
    let b = CpuBackend::new();
    let shape = KvShape {
        layers: 2,
        kv_heads: 3,
        head_dim: D,
    };
    let n_heads = 9;
    let mut quant =
        QuantKvCache::<CpuBackend>::new(shape, 512, &KvConfig::base(KvBaseChoice::F16)).unwrap();
    let mut float = FloatKvCache::new(&b, shape, 512).unwrap();
    let round = |x: &[f32]| -> Vec<f32> { x.iter().map(|&y| f16::from_f32(y).to_f32()).collect() };
    let mut rng = Lcg(11);
    for step in 0..300 {
        let n = if step == 0 { 150 } else { 1 };
        for layer in 0..2 {
            let (k, v) = kv_rows(&mut rng, n, 3, 0);
            let q = rng.vec(n * n_heads * D, 2.0);
            let qb = b.upload(&q).unwrap();
            let (kb, vb) = (b.upload(&k).unwrap(), b.upload(&v).unwrap());
            let (kr, vr) = (b.upload(&round(&k)).unwrap(), b.upload(&round(&v)).unwrap());
            let mut o1 = b.alloc(n * n_heads * D).unwrap();
            let mut o2 = b.alloc(n * n_heads * D).unwrap();
            quant
                .append_and_attend(
                    &b,
                    layer,
                    n_heads,
                    n,
                    &positions_of(quant.len(), n),
                    &qb,
                    &kb,
                    &vb,
                    &mut o1,
                )
                .unwrap();
            float
                .append_and_attend(
                    &b,
                    layer,
                    n_heads,
                    n,
                    &positions_of(float.len(), n),
                    &qb,
                    &kr,
                    &vr,
                    &mut o2,
                )
                .unwrap();
            let (mut a, mut c) = (vec![0.0; n * n_heads * D], vec![0.0; n * n_heads * D]);
            b.download(&o1, &mut a).unwrap();
            b.download(&o2, &mut c).unwrap();
            // The multi-token step uses exact (unrounded) new keys, as a prefill does.
            let tol = if n > 1 { 2e-2 } else { 2e-5 };
            let worst = a
                .iter()
                .zip(&c)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0f32, f32::max);
            assert!(worst < tol, "step {step} layer {layer}: {worst}");
        }
        quant.commit(n).unwrap();
        float.commit(n).unwrap();
    }
}

#[test]
fn resident_bytes_follow_the_kvarn_record_and_stay_within_budget() {
    let b = CpuBackend::new();
    let shape = KvShape {
        layers: 2,
        kv_heads: 1,
        head_dim: D,
    };
    let config = KvConfig {
        base: KvBaseChoice::Kvarn(KvBits { key: 3, value: 2 }),
        sinks: 128,
        refine: Some(ram_refine(4, 1.0 / 32.0)),
    };
    let capacity = 128 + 4 * 128;
    let mut cache = QuantKvCache::<CpuBackend>::new(shape, capacity, &config).unwrap();
    // KVarN record, D = 64, G = 128, 3/2 bits (docs/format.md, "KVarN tile record"):
    // K codes 64·128·3/8 = 3072, s_col_K + zp_K 2·64·2 = 256, s_row_K 128·2 = 256;
    // V codes 64·128·2/8 = 2048, s_col_V 128, s_row_V + zp_V 2·128·2 = 512 → 6272 (8-aligned).
    let tile_bytes = 6272;
    let fp16_buffers = (128 + 128) * D * 2 * 2; // sinks + partial tile, K and V
    let budget = cache.resident_bytes_for(capacity);
    let mut rng = Lcg(3);
    for _ in 0..capacity {
        decode_step(&b, &mut cache, &mut rng, 2, 1.0, None);
        let len = cache.len();
        let tiles = len.saturating_sub(128) / 128;
        let want = (fp16_buffers + tiles * tile_bytes) * shape.layers * shape.kv_heads;
        assert_eq!(cache.resident_bytes(), want, "at {len} positions");
        assert!(cache.resident_bytes() <= budget);
        // Refinement bits: 4 + 4 per element of every encoded token, in the backing tier.
        let backing = (tiles * 128 * D) as u64 * shape.layers as u64;
        assert_eq!(cache.bytes().tier.backing, backing, "at {len} positions");
    }
    assert_eq!(
        cache.stats().decode_attentions,
        (capacity * shape.layers) as u64
    );
}

#[test]
fn ssd_tier_stays_within_its_cache_budget_and_waiting_matches_ram() {
    let b = CpuBackend::new();
    let shape = KvShape {
        layers: 2,
        kv_heads: 2,
        head_dim: D,
    };
    let n_heads = 4;
    // 125 units of 2 tokens × 64 × (4 + 4) bits = 128 B, of 768 stored; a step selects
    // 4 heads × 24 = 96 (an LRU smaller than one step's working set never hits).
    let budget = 16000u64;
    let dir = std::env::temp_dir();
    let base = KvBaseChoice::Kvarn(KvBits { key: 2, value: 2 });
    let with_tier = |tier: KvTierConfig| KvConfig {
        base,
        sinks: 16,
        refine: Some(KvRefineConfig {
            tier,
            ..ram_refine(2, 1.0 / 8.0)
        }),
    };
    let ssd = |policy| KvTierConfig::Ssd {
        dir: dir.clone(),
        cache_budget: budget,
        policy,
    };
    let mut outputs = Vec::new();
    for tier in [
        KvTierConfig::Ram,
        ssd(MissPolicy::Wait),
        ssd(MissPolicy::Skip),
    ] {
        let skip = matches!(
            tier,
            KvTierConfig::Ssd {
                policy: MissPolicy::Skip,
                ..
            }
        );
        let is_ssd = tier != KvTierConfig::Ram;
        let mut cache = QuantKvCache::<CpuBackend>::new(shape, 1024, &with_tier(tier)).unwrap();
        let mut rng = Lcg(5);
        fill(&b, &mut cache, &mut rng, 16 + 3 * 128, n_heads);
        let mut outs = Vec::new();
        for _ in 0..40 {
            let (_, o) = decode_step(&b, &mut cache, &mut rng, n_heads, 3.0, Some(99));
            outs.push(o);
            if is_ssd {
                let st = cache.tier_stats().unwrap();
                assert!(
                    st.cache_bytes <= budget && st.cache_peak_bytes <= budget,
                    "{st:?}"
                );
            }
        }
        let stats = cache.stats().clone();
        assert!(stats.selected_groups > 0);
        if skip {
            // The most recent units enter the cache as they are written; older selected ones
            // miss and are skipped at first.
            assert!(stats.missed_groups > 0, "{stats:?}");
        } else {
            assert_eq!(stats.applied_groups, stats.selected_groups, "{stats:?}");
        }
        if is_ssd {
            let st = cache.tier_stats().unwrap();
            assert!(st.hits > 0 && st.misses > 0, "{st:?}");
        }
        outputs.push(outs);
    }
    // Waiting on misses gives exactly the RAM tier's result; skipping differs.
    assert_eq!(outputs[0], outputs[1]);
    assert_ne!(outputs[0], outputs[2]);
}

#[test]
fn truncation_inside_an_encoded_tile_is_refused() {
    let b = CpuBackend::new();
    let shape = KvShape {
        layers: 1,
        kv_heads: 1,
        head_dim: D,
    };
    let config = KvConfig {
        sinks: 8,
        ..KvConfig::base(KvBaseChoice::Kvarn(KvBits { key: 2, value: 2 }))
    };
    let mut cache = QuantKvCache::<CpuBackend>::new(shape, 512, &config).unwrap();
    let mut rng = Lcg(1);
    fill(&b, &mut cache, &mut rng, 8 + 128 + 10, 1);
    assert!(cache.truncate(8 + 64).is_err());
    assert_eq!(cache.len(), 8 + 128 + 10);
    cache.truncate(8 + 128 + 4).unwrap();
    assert_eq!(cache.len(), 8 + 128 + 4);
    cache.truncate(8 + 128).unwrap();
    assert_eq!(cache.resident_bytes(), cache.resident_bytes_for(8 + 128));
}

/// Device-side positions `start..start + n` (the CPU backend's index buffer).
fn positions_of(start: usize, n: usize) -> sfx_runtime::backend::cpu::CpuIndex {
    sfx_runtime::backend::cpu::CpuIndex((start..start + n).map(|p| p as u32).collect())
}

//! The decoder graph on small random models: against an independent f64 reference
//! implementation, prefill/decode consistency, chunking, and the load/run error paths.

use serde_json::json;
use sfx_formats::{DType, ModelConfig, OwnedTensors};
use sfx_runtime::{
    CpuBackend, KvCache, LogitsMode, Model, ModelOptions, RuntimeError, SimdLevel, WeightPrecision,
};
use std::path::Path;

fn config(arch: &str, tied: bool) -> ModelConfig {
    let mut j = json!({
        "model_type": arch, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 97,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": tied
    });
    if arch == "qwen3" {
        j["head_dim"] = json!(16); // q_dim 96 ≠ hidden 48, as in real Qwen3 models
    }
    ModelConfig::from_hf_json(&j, Path::new("synthetic/config.json")).unwrap()
}

struct Rng(u64);
impl Rng {
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

/// Random weights with 1/√fan_in scaling so activations stay O(1) through the layers.
fn weights(c: &ModelConfig, seed: u64) -> OwnedTensors {
    let mut r = Rng(seed);
    let mut t = OwnedTensors::new();
    let (h, q, kv, f, v) = (
        c.hidden_size,
        c.q_dim(),
        c.kv_dim(),
        c.intermediate_size,
        c.vocab_size,
    );
    let mut lin = |t: &mut OwnedTensors, name: String, out: usize, inp: usize| {
        t.insert_f32(
            name,
            vec![out, inp],
            &r.vec(out * inp, 1.0 / (inp as f32).sqrt()),
        );
    };
    lin(&mut t, "model.embed_tokens.weight".into(), v, h);
    if !c.tie_word_embeddings {
        lin(&mut t, "lm_head.weight".into(), v, h);
    }
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        lin(&mut t, format!("{p}.self_attn.q_proj.weight"), q, h);
        lin(&mut t, format!("{p}.self_attn.k_proj.weight"), kv, h);
        lin(&mut t, format!("{p}.self_attn.v_proj.weight"), kv, h);
        lin(&mut t, format!("{p}.self_attn.o_proj.weight"), h, q);
        lin(&mut t, format!("{p}.mlp.gate_proj.weight"), f, h);
        lin(&mut t, format!("{p}.mlp.up_proj.weight"), f, h);
        lin(&mut t, format!("{p}.mlp.down_proj.weight"), h, f);
    }
    let mut r = Rng(seed ^ 0x5eed);
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        for n in ["input_layernorm", "post_attention_layernorm"] {
            let w: Vec<f32> = r.vec(h, 0.3).iter().map(|x| 1.0 + x).collect();
            t.insert_f32(format!("{p}.{n}.weight"), vec![h], &w);
        }
        if c.attention_bias {
            t.insert_f32(
                format!("{p}.self_attn.q_proj.bias"),
                vec![q],
                &r.vec(q, 0.2),
            );
            t.insert_f32(
                format!("{p}.self_attn.k_proj.bias"),
                vec![kv],
                &r.vec(kv, 0.2),
            );
            t.insert_f32(
                format!("{p}.self_attn.v_proj.bias"),
                vec![kv],
                &r.vec(kv, 0.2),
            );
        }
        if c.qk_norm {
            for n in ["q_norm", "k_norm"] {
                let w: Vec<f32> = r.vec(c.head_dim, 0.3).iter().map(|x| 1.0 + x).collect();
                t.insert_f32(format!("{p}.self_attn.{n}.weight"), vec![c.head_dim], &w);
            }
        }
    }
    let w: Vec<f32> = r.vec(h, 0.3).iter().map(|x| 1.0 + x).collect();
    t.insert_f32("model.norm.weight", vec![h], &w);
    t
}

/// The decoder written out directly in f64 from the Hugging Face modeling code, one token
/// at a time with full causal attention: shares no code with the runtime.
fn reference_logits(c: &ModelConfig, t: &OwnedTensors, tokens: &[u32]) -> Vec<Vec<f64>> {
    use sfx_formats::TensorSource;
    let get = |n: &str| -> Vec<f64> {
        t.tensor(n)
            .unwrap()
            .to_f32_vec()
            .into_iter()
            .map(|x| x as f64)
            .collect()
    };
    let (h, hd) = (c.hidden_size, c.head_dim);
    let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
    let eps = c.rms_norm_eps;
    let matvec = |w: &[f64], x: &[f64]| -> Vec<f64> {
        w.chunks(x.len())
            .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
            .collect()
    };
    let rms = |x: &[f64], w: &[f64]| -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        x.iter()
            .zip(w)
            .map(|(v, g)| v / (ms + eps).sqrt() * g)
            .collect()
    };
    let rope = |x: &mut [f64], pos: usize| {
        let half = hd / 2;
        for head in x.chunks_mut(hd) {
            for i in 0..half {
                let theta = (pos as f64) * c.rope_theta.powf(-2.0 * i as f64 / hd as f64);
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * theta.cos() - b * theta.sin();
                head[i + half] = b * theta.cos() + a * theta.sin();
            }
        }
    };
    let embed = get("model.embed_tokens.weight");
    let mut hs: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&tok| embed[tok as usize * h..][..h].to_vec())
        .collect();
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let (wq, wk, wv, wo) = (
            get(&format!("{p}.self_attn.q_proj.weight")),
            get(&format!("{p}.self_attn.k_proj.weight")),
            get(&format!("{p}.self_attn.v_proj.weight")),
            get(&format!("{p}.self_attn.o_proj.weight")),
        );
        let mut qs = vec![];
        let mut ks = vec![];
        let mut vs = vec![];
        for (pos, x) in hs.iter().enumerate() {
            let xn = rms(x, &get(&format!("{p}.input_layernorm.weight")));
            let (mut q, mut k, mut v) = (matvec(&wq, &xn), matvec(&wk, &xn), matvec(&wv, &xn));
            if c.attention_bias {
                for (a, b) in q.iter_mut().zip(get(&format!("{p}.self_attn.q_proj.bias"))) {
                    *a += b;
                }
                for (a, b) in k.iter_mut().zip(get(&format!("{p}.self_attn.k_proj.bias"))) {
                    *a += b;
                }
                for (a, b) in v.iter_mut().zip(get(&format!("{p}.self_attn.v_proj.bias"))) {
                    *a += b;
                }
            }
            if c.qk_norm {
                let (qn, kn) = (
                    get(&format!("{p}.self_attn.q_norm.weight")),
                    get(&format!("{p}.self_attn.k_norm.weight")),
                );
                q = q.chunks(hd).flat_map(|hq| rms(hq, &qn)).collect();
                k = k.chunks(hd).flat_map(|hk| rms(hk, &kn)).collect();
            }
            rope(&mut q, pos);
            rope(&mut k, pos);
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for pos in 0..hs.len() {
            let mut attn = vec![0.0; nh * hd];
            for head in 0..nh {
                let g = head / (nh / nkv);
                let qh = &qs[pos][head * hd..][..hd];
                let sc: Vec<f64> = (0..=pos)
                    .map(|j| {
                        qh.iter()
                            .zip(&ks[j][g * hd..][..hd])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = sc.iter().map(|s| (s - m).exp()).sum();
                for j in 0..=pos {
                    let p = (sc[j] - m).exp() / z;
                    for d in 0..hd {
                        attn[head * hd + d] += p * vs[j][g * hd + d];
                    }
                }
            }
            let o = matvec(&wo, &attn);
            for (a, b) in hs[pos].iter_mut().zip(o) {
                *a += b;
            }
            let xn = rms(
                &hs[pos],
                &get(&format!("{p}.post_attention_layernorm.weight")),
            );
            let gate = matvec(&get(&format!("{p}.mlp.gate_proj.weight")), &xn);
            let up = matvec(&get(&format!("{p}.mlp.up_proj.weight")), &xn);
            let act: Vec<f64> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let d = matvec(&get(&format!("{p}.mlp.down_proj.weight")), &act);
            for (a, b) in hs[pos].iter_mut().zip(d) {
                *a += b;
            }
        }
    }
    let head = if c.tie_word_embeddings {
        embed.clone()
    } else {
        get("lm_head.weight")
    };
    let norm = get("model.norm.weight");
    hs.iter().map(|x| matvec(&head, &rms(x, &norm))).collect()
}

fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

/// Every architecture variant, every SIMD tier, F32 weights, prefill of 40 tokens (so the
/// GEMM and the blocked prefill attention run) against the f64 reference. Tolerance: 2e-5
/// of the largest |logit| — f32 arithmetic through 2 layers with sums of ≤ 80 terms.
#[test]
fn prefill_matches_f64_reference_for_every_arch_and_tier() {
    for (arch, tied) in [
        ("llama", true),
        ("llama", false),
        ("qwen2", true),
        ("qwen3", false),
    ] {
        let c = config(arch, tied);
        let t = weights(&c, 42);
        let tokens: Vec<u32> = (0..40u32)
            .map(|i| (i * 37 + 11) % c.vocab_size as u32)
            .collect();
        let want = reference_logits(&c, &t, &tokens);
        for level in SimdLevel::supported() {
            let opts = ModelOptions {
                precision: WeightPrecision::F32,
                ..Default::default()
            };
            let m = Model::load(CpuBackend::with_simd(level).unwrap(), &c, &t, &opts).unwrap();
            let mut cache = m.new_cache(64).unwrap();
            let got = m.forward(&tokens, &mut cache, LogitsMode::All).unwrap();
            assert_eq!(got.rows(), tokens.len());
            assert_eq!(got.first_position(), 0);
            for (p, w) in want.iter().enumerate() {
                let w32: Vec<f32> = w.iter().map(|&x| x as f32).collect();
                let d = max_rel_diff(got.row(p).unwrap(), &w32);
                assert!(
                    d < 2e-5,
                    "{arch} tied={tied} {level:?} position {p}: rel diff {d}"
                );
            }
        }
    }
}

/// Prefill of n tokens then one decode step equals prefill of n + 1 (last logits), for the
/// BF16 and F32 paths (decode uses the matvec and split-K attention, prefill the GEMM and
/// blocked attention). Tolerance 1e-4 of the largest |logit|.
#[test]
fn prefill_then_decode_equals_longer_prefill() {
    for (arch, precision) in [
        ("llama", WeightPrecision::Bf16),
        ("qwen3", WeightPrecision::F32),
        ("qwen2", WeightPrecision::Bf16),
    ] {
        let c = config(arch, true);
        let t = weights(&c, 7);
        let opts = ModelOptions {
            precision,
            ..Default::default()
        };
        let m = Model::load(CpuBackend::new(), &c, &t, &opts).unwrap();
        let tokens: Vec<u32> = (0..30u32).map(|i| (i * 13 + 5) % 97).collect();
        let mut full = m.new_cache(64).unwrap();
        let want = m.forward(&tokens, &mut full, LogitsMode::Last).unwrap();
        let mut inc = m.new_cache(64).unwrap();
        m.forward(&tokens[..29], &mut inc, LogitsMode::None)
            .unwrap();
        let got = m
            .forward(&tokens[29..], &mut inc, LogitsMode::Last)
            .unwrap();
        assert_eq!(inc.len(), 30);
        assert_eq!(got.first_position(), 29);
        let d = max_rel_diff(got.last().unwrap(), want.last().unwrap());
        assert!(d < 1e-4, "{arch}: rel diff {d}");

        // Token-by-token decode of the whole sequence matches All-position prefill.
        let mut all_cache = m.new_cache(64).unwrap();
        let all = m.forward(&tokens, &mut all_cache, LogitsMode::All).unwrap();
        let mut step = m.new_cache(64).unwrap();
        for (p, tok) in tokens.iter().enumerate() {
            let l = m.forward(&[*tok], &mut step, LogitsMode::Last).unwrap();
            let d = max_rel_diff(l.last().unwrap(), all.row(p).unwrap());
            assert!(d < 1e-4, "{arch} position {p}: rel diff {d}");
        }
    }
}

/// Chunked prefill (chunk 7, so chunks straddle the selected tail) equals one pass.
#[test]
fn chunked_prefill_is_exact() {
    let c = config("llama", true);
    let t = weights(&c, 9);
    let tokens: Vec<u32> = (0..40u32).map(|i| (i * 31 + 2) % 97).collect();
    let one = Model::load(CpuBackend::new(), &c, &t, &ModelOptions::default()).unwrap();
    let chunked = Model::load(
        CpuBackend::new(),
        &c,
        &t,
        &ModelOptions {
            prefill_chunk: 7,
            ..Default::default()
        },
    )
    .unwrap();
    let mut c1 = one.new_cache(40).unwrap();
    let mut c2 = chunked.new_cache(40).unwrap();
    let a = one
        .forward(&tokens, &mut c1, LogitsMode::LastN(10))
        .unwrap();
    let b = chunked
        .forward(&tokens, &mut c2, LogitsMode::LastN(10))
        .unwrap();
    assert_eq!((a.rows(), b.rows(), b.first_position()), (10, 10, 30));
    assert!(max_rel_diff(b.as_slice(), a.as_slice()) < 1e-5);
}

#[test]
fn cache_clear_and_truncate_replay_identically() {
    let c = config("llama", true);
    let t = weights(&c, 3);
    let m = Model::load(CpuBackend::new(), &c, &t, &ModelOptions::default()).unwrap();
    let mut cache = m.new_cache(32).unwrap();
    let a = m
        .forward(&[1, 2, 3, 4], &mut cache, LogitsMode::Last)
        .unwrap();
    cache.truncate(2).unwrap();
    let b = m.forward(&[3, 4], &mut cache, LogitsMode::Last).unwrap();
    cache.clear();
    let c2 = m
        .forward(&[1, 2, 3, 4], &mut cache, LogitsMode::Last)
        .unwrap();
    assert_eq!(a.last(), c2.last());
    assert!(max_rel_diff(b.last().unwrap(), a.last().unwrap()) < 1e-5);
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let c = config("llama", true);
    let t = weights(&c, 1);
    let m = Model::load(CpuBackend::new(), &c, &t, &ModelOptions::default()).unwrap();
    let mut cache = m.new_cache(4).unwrap();
    assert!(matches!(
        m.forward(&[], &mut cache, LogitsMode::Last),
        Err(RuntimeError::EmptyInput)
    ));
    let e = m
        .forward(&[1, 97], &mut cache, LogitsMode::Last)
        .unwrap_err();
    assert!(
        matches!(
            e,
            RuntimeError::TokenOutOfRange {
                token: 97,
                index: 1,
                vocab: 97
            }
        ),
        "{e}"
    );
    let e = m
        .forward(&[1, 2, 3, 4, 5], &mut cache, LogitsMode::Last)
        .unwrap_err();
    assert!(
        matches!(
            e,
            RuntimeError::CacheFull {
                cached: 0,
                new: 5,
                capacity: 4
            }
        ),
        "{e}"
    );
    assert_eq!(cache.len(), 0);

    let other = config("qwen3", true);
    let mut wrong =
        sfx_runtime::FloatKvCache::new(m.backend(), sfx_runtime::KvShape::of(&other), 8).unwrap();
    assert!(matches!(
        m.forward(&[1], &mut wrong, LogitsMode::Last),
        Err(RuntimeError::CacheMismatch(_))
    ));
}

#[test]
fn missing_and_misshaped_tensors_are_named() {
    let c = config("qwen2", false);
    let full = weights(&c, 1);
    use sfx_formats::TensorSource;
    let copy_without = |skip: &str, reshape: Option<(&str, Vec<usize>)>| {
        let mut t = OwnedTensors::new();
        for name in full.tensor_names() {
            if name == skip {
                continue;
            }
            let v = full.tensor(&name).unwrap();
            let shape = match &reshape {
                Some((n, s)) if *n == name => s.clone(),
                _ => v.shape.to_vec(),
            };
            t.insert_raw(name, DType::F32, shape, v.data.to_vec())
                .unwrap();
        }
        t
    };
    let load = |t: &OwnedTensors| Model::load(CpuBackend::new(), &c, t, &ModelOptions::default());

    let e = load(&copy_without("model.layers.1.mlp.up_proj.weight", None))
        .err()
        .unwrap();
    let msg = e.to_string();
    assert!(
        msg.contains("model.layers.1.mlp.up_proj.weight") && msg.contains("up projection"),
        "{msg}"
    );

    let e = load(&copy_without("model.layers.0.self_attn.k_proj.bias", None))
        .err()
        .unwrap();
    assert!(
        e.to_string()
            .contains("model.layers.0.self_attn.k_proj.bias"),
        "{e}"
    );

    let e = load(&copy_without("lm_head.weight", None)).err().unwrap();
    assert!(e.to_string().contains("tie_word_embeddings"), "{e}");

    // Same element count, transposed shape: must be caught by the shape check.
    let name = "model.layers.0.mlp.gate_proj.weight";
    let e = load(&copy_without(
        "",
        Some((name, vec![c.hidden_size, c.intermediate_size])),
    ))
    .err()
    .unwrap();
    assert!(
        matches!(&e, RuntimeError::TensorShape { name: n, .. } if n == name),
        "{e}"
    );
}

/// BF16 storage halves the linear weights' bytes and a tied head is not counted twice.
#[test]
fn resident_bytes_reflect_precision_and_tying() {
    let c = config("llama", true);
    let t = weights(&c, 1);
    let f32m = Model::load(
        CpuBackend::new(),
        &c,
        &t,
        &ModelOptions {
            precision: WeightPrecision::F32,
            ..Default::default()
        },
    )
    .unwrap();
    let bf16m = Model::load(
        CpuBackend::new(),
        &c,
        &t,
        &ModelOptions {
            precision: WeightPrecision::Bf16,
            ..Default::default()
        },
    )
    .unwrap();
    let params = c.vocab_size * c.hidden_size
        + c.num_hidden_layers
            * (2 * c.hidden_size * c.q_dim()
                + 2 * c.hidden_size * c.kv_dim()
                + 3 * c.hidden_size * c.intermediate_size);
    assert_eq!(f32m.resident_bytes(), 4 * params);
    assert_eq!(bf16m.resident_bytes(), 2 * params);
}

#[test]
fn layerwise_runner_sees_what_the_full_forward_sees() {
    // The converter's block-at-a-time pass must hand every projection set exactly the inputs
    // the whole-model forward produces (same kernels, so equal up to f32 rounding noise).
    use sfx_runtime::{FloatLinearFactory, LayerwiseRunner, ProjectionSet};
    use std::collections::BTreeMap;
    for arch in ["llama", "qwen2", "qwen3"] {
        let c = config(arch, true);
        let t = weights(&c, 11);
        let tokens: Vec<u32> = (0..19).map(|i| (i * 7 % 97) as u32).collect();
        let opts = ModelOptions {
            precision: WeightPrecision::F32,
            ..Default::default()
        };
        let model = Model::load_cpu(&c, &t, &opts).unwrap();
        let mut full: BTreeMap<(usize, ProjectionSet), Vec<f32>> = BTreeMap::new();
        let mut cache = model.new_cache(tokens.len()).unwrap();
        let mut obs = |l: usize, s: ProjectionSet, x: &[f32], _rows: usize| {
            full.insert((l, s), x.to_vec());
        };
        model
            .forward_observed(&tokens, &mut cache, LogitsMode::None, &mut obs)
            .unwrap();

        let runner = LayerwiseRunner::new(CpuBackend::new(), &c).unwrap();
        let factory = FloatLinearFactory {
            precision: WeightPrecision::F32,
        };
        let mut h = runner.embed(&t, &tokens).unwrap();
        for l in 0..c.num_hidden_layers {
            let block = runner.load_layer(&t, &factory, l).unwrap();
            let mut seen: BTreeMap<(usize, ProjectionSet), Vec<f32>> = BTreeMap::new();
            let mut obs = |l: usize, s: ProjectionSet, x: &[f32], _rows: usize| {
                seen.insert((l, s), x.to_vec());
            };
            runner
                .forward_layer(&block, l, &mut h, Some(&mut obs))
                .unwrap();
            for set in ProjectionSet::ALL {
                let a = &full[&(l, set)];
                let b = &seen[&(l, set)];
                assert!(
                    max_rel_diff(a, b) < 1e-5,
                    "{arch} layer {l} {set:?}: {}",
                    max_rel_diff(a, b)
                );
            }
        }
        assert!(runner
            .load_layer(&t, &factory, c.num_hidden_layers)
            .is_err());
        assert!(runner.embed(&t, &[97]).is_err());
    }
}

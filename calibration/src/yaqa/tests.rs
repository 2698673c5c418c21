//! Checks of the YAQA math that do not depend on PyTorch: the candle forward against the
//! runtime's forward, G_b against central finite differences of the loss, the factors against
//! explicit sums of G_bᵀG_b / G_bG_bᵀ, and input validation.

use super::*;
use crate::test_util::lcg_vec;
use faer::{Mat, Side};
use serde_json::json;
use sfx_formats::OwnedTensors;
use sfx_runtime::{LogitsMode, Model, ModelOptions, WeightPrecision};
use std::path::Path;

const VOCAB: usize = 40;

/// 2 layers, GQA (4 query heads on 2 KV heads), head_dim 6, vocabulary 40.
fn tiny_config(qwen3: bool) -> ModelConfig {
    let mut j = json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 16, "intermediate_size": 20, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 6,
        "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 1000.0,
        "tie_word_embeddings": true
    });
    if qwen3 {
        // Per-head q/k norms, q/k/v biases and an untied head: every optional branch.
        j["model_type"] = json!("qwen3");
        j["attention_bias"] = json!(true);
        j["tie_word_embeddings"] = json!(false);
        j["rope_scaling"] = json!({"rope_type": "linear", "factor": 2.0});
    }
    ModelConfig::from_hf_json(&j, Path::new("tiny/config.json")).unwrap()
}

/// Random weights at a scale that keeps activations O(1) and the output distribution far
/// from uniform, so every term of the gradient matters.
fn tiny_weights(c: &ModelConfig, seed: u64) -> OwnedTensors {
    let mut t = OwnedTensors::new();
    let mut s = seed;
    let mut put = |t: &mut OwnedTensors, name: String, shape: Vec<usize>, centre: f32, amp: f32| {
        s += 1;
        let n = shape.iter().product();
        let v: Vec<f32> = lcg_vec(n, s).iter().map(|x| centre + amp * x).collect();
        t.insert_f32(name, shape, &v);
    };
    let (h, f, q, kv) = (c.hidden_size, c.intermediate_size, c.q_dim(), c.kv_dim());
    let lin = |inp: usize| 1.7 / (inp as f32).sqrt();
    put(
        &mut t,
        "model.embed_tokens.weight".into(),
        vec![VOCAB, h],
        0.0,
        1.0,
    );
    put(&mut t, "model.norm.weight".into(), vec![h], 1.0, 0.3);
    if !c.tie_word_embeddings {
        put(&mut t, "lm_head.weight".into(), vec![VOCAB, h], 0.0, 0.6);
    }
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        put(
            &mut t,
            format!("{p}.input_layernorm.weight"),
            vec![h],
            1.0,
            0.3,
        );
        put(
            &mut t,
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            1.0,
            0.3,
        );
        for (name, out, inp) in [
            ("self_attn.q_proj", q, h),
            ("self_attn.k_proj", kv, h),
            ("self_attn.v_proj", kv, h),
            ("self_attn.o_proj", h, q),
            ("mlp.gate_proj", f, h),
            ("mlp.up_proj", f, h),
            ("mlp.down_proj", h, f),
        ] {
            put(
                &mut t,
                format!("{p}.{name}.weight"),
                vec![out, inp],
                0.0,
                lin(inp),
            );
        }
        if c.attention_bias {
            for (name, out) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                put(
                    &mut t,
                    format!("{p}.self_attn.{name}.bias"),
                    vec![out],
                    0.0,
                    0.3,
                );
            }
        }
        if c.qk_norm {
            for name in ["q_norm", "k_norm"] {
                put(
                    &mut t,
                    format!("{p}.self_attn.{name}.weight"),
                    vec![c.head_dim],
                    1.0,
                    0.3,
                );
            }
        }
    }
    t
}

fn tokens(n: usize, seed: u64) -> Vec<u32> {
    lcg_vec(n, seed)
        .iter()
        .map(|x| (((x + 1.0) * 0.5 * VOCAB as f32) as u32).min(VOCAB as u32 - 1))
        .collect()
}

/// A copy of `src` with `name` replaced by `values`.
fn with_tensor(src: &OwnedTensors, name: &str, values: &[f32]) -> OwnedTensors {
    let mut t = OwnedTensors::new();
    for n in src.tensor_names() {
        let v = src.tensor(&n).unwrap();
        if n == name {
            t.insert_f32(n.clone(), v.shape.to_vec(), values);
        } else {
            t.insert_f32(n.clone(), v.shape.to_vec(), &v.to_f32_vec());
        }
    }
    t
}

fn loss(c: &ModelConfig, t: &OwnedTensors, toks: &[u32], labels: &[u32]) -> f64 {
    sequence_loss_and_gradients(c, t, toks, labels)
        .unwrap()
        .loss
}

#[test]
fn candle_forward_matches_runtime_forward() {
    for qwen3 in [false, true] {
        let c = tiny_config(qwen3);
        let w = tiny_weights(&c, 11);
        let toks = tokens(9, 3);
        let got = Graph::load(&c, &w)
            .unwrap()
            .forward(&toks)
            .unwrap()
            .logits
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let opts = ModelOptions {
            precision: WeightPrecision::F32,
            ..Default::default()
        };
        let model = Model::load_cpu(&c, &w, &opts).unwrap();
        let mut cache = model.new_cache(toks.len()).unwrap();
        let want = model
            .forward(&toks, &mut cache, LogitsMode::All)
            .unwrap()
            .into_vec();
        assert_eq!(got.len(), want.len());
        let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
        let err = got
            .iter()
            .zip(&want)
            .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        // f32 rounding of differently ordered sums only.
        assert!(
            err <= 1e-5 * scale.max(1.0),
            "qwen3={qwen3}: max |Δlogit| {err} (scale {scale})"
        );
    }
}

/// Central difference of the loss along `dir` in weight `name`, Richardson-extrapolated over
/// steps ε and 2ε so the O(ε²) truncation error cancels; ε is 3e-3 of the weight's RMS per
/// unit of `dir`'s RMS: large enough that f32 rounding of the loss stays far below the
/// tolerances, small enough for the O(ε⁴) remainder (1e-2 left 1.7e-3 on one Qwen3 o_proj).
fn directional_fd(
    c: &ModelConfig,
    w: &OwnedTensors,
    name: &str,
    dir: &[f32],
    toks: &[u32],
    labels: &[u32],
) -> f64 {
    let w0 = w.tensor(name).unwrap().to_f32_vec();
    let rms = |v: &[f32]| (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
    let eps = 3e-3 * rms(&w0) / rms(dir);
    let at = |step: f32| {
        let v: Vec<f32> = w0.iter().zip(dir).map(|(a, d)| a + step * d).collect();
        loss(c, &with_tensor(w, name, &v), toks, labels)
    };
    let d1 = (at(eps) - at(-eps)) / (2.0 * eps as f64);
    let d2 = (at(2.0 * eps) - at(-2.0 * eps)) / (4.0 * eps as f64);
    (4.0 * d1 - d2) / 3.0
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// ∂loss/∂W = G_b for every projection of both tiny models, by directional derivatives:
/// along G_b itself (the derivative is ‖G_b‖², so any error in G_b's scale or in the part of
/// it along itself shows) and along a random direction r, where the expected ⟨G_b, r⟩ is
/// ~‖G_b‖·‖r‖/√n; both are compared with a tolerance relative to the derivative's own size.
#[test]
fn gradients_match_finite_differences() {
    let mut worst = (0f64, 0f64);
    for qwen3 in [false, true] {
        let c = tiny_config(qwen3);
        let w = tiny_weights(&c, 5);
        let toks = tokens(7, 9);
        let labels = tokens(7, 21);
        let grads = sequence_gradients(&c, &w, &toks, &labels).unwrap();
        assert_eq!(grads.len(), 7 * c.num_hidden_layers);
        for (k, (name, (rows, cols, g))) in grads.iter().enumerate() {
            assert_eq!(g.len(), rows * cols);
            let along_g = directional_fd(&c, &w, name, g, &toks, &labels);
            let e_g = (along_g - dot(g, g)).abs() / dot(g, g);
            let r = lcg_vec(g.len(), 1000 + k as u64);
            let along_r = directional_fd(&c, &w, name, &r, &toks, &labels);
            // Scale of ⟨G_b, r⟩ for a random r: ‖G_b‖·‖r‖/√n.
            let scale = (dot(g, g) * dot(&r, &r) / g.len() as f64).sqrt();
            let e_r = (along_r - dot(g, &r)).abs() / scale;
            eprintln!("qwen3={qwen3} {name}: rel err along G {e_g:.1e}, along r {e_r:.1e}");
            assert!(
                e_g <= 1e-3,
                "qwen3={qwen3} {name}: along G_b fd {along_g} vs {}",
                dot(g, g)
            );
            assert!(
                e_r <= 1e-2,
                "qwen3={qwen3} {name}: along r fd {along_r} vs {}",
                dot(g, &r)
            );
            worst = (worst.0.max(e_g), worst.1.max(e_r));
        }
    }
    eprintln!(
        "worst relative errors: along G {:.1e}, along r {:.1e}",
        worst.0, worst.1
    );
}

#[test]
fn single_entries_match_finite_differences() {
    let c = tiny_config(false);
    let w = tiny_weights(&c, 8);
    let toks = tokens(6, 2);
    let labels = tokens(6, 4);
    let grads = sequence_gradients(&c, &w, &toks, &labels).unwrap();
    for name in [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
    ] {
        let (_, _, g) = &grads[name];
        let w0 = w.tensor(name).unwrap().to_f32_vec();
        // The largest-magnitude gradient entry: a well-conditioned finite difference.
        let (i, gi) =
            g.iter().enumerate().fold(
                (0, 0f32),
                |a, (i, &v)| if v.abs() > a.1.abs() { (i, v) } else { a },
            );
        let eps = 1e-2f32;
        let at = |step: f32| {
            let mut v = w0.clone();
            v[i] += step;
            loss(&c, &with_tensor(&w, name, &v), &toks, &labels)
        };
        let d1 = (at(eps) - at(-eps)) / (2.0 * eps as f64);
        let d2 = (at(2.0 * eps) - at(-2.0 * eps)) / (4.0 * eps as f64);
        let fd = (4.0 * d1 - d2) / 3.0;
        assert!(
            (fd - gi as f64).abs() <= 2e-3 * (gi.abs() as f64),
            "{name}[{i}]: fd {fd} vs {gi}"
        );
    }
}

/// The labels sketch_b draws for sequence b (same RNG stream and sampler).
fn sketch_labels(c: &ModelConfig, w: &OwnedTensors, toks: &[u32], seed: u64, b: u64) -> Vec<u32> {
    let logits = Graph::load(c, w)
        .unwrap()
        .forward(toks)
        .unwrap()
        .logits
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    sample_labels(&logits, c.vocab_size, &mut label_rng(seed, b), 0).unwrap()
}

#[test]
fn sketch_factors_are_sums_of_gradient_products_and_psd() {
    let c = tiny_config(false);
    let w = tiny_weights(&c, 17);
    let seqs = vec![tokens(8, 31), tokens(5, 32)];
    let opts = SketchOptions {
        seed: 99,
        ..Default::default()
    };
    let mut calls = Vec::new();
    let factors = sketch_b(&c, &w, &seqs, &opts, &mut |d, n| calls.push((d, n))).unwrap();
    assert_eq!(calls, vec![(0, 2), (1, 2), (2, 2)]);
    assert_eq!(factors.len(), 14);

    let per_seq: Vec<_> = seqs
        .iter()
        .enumerate()
        .map(|(b, s)| {
            let labels = sketch_labels(&c, &w, s, opts.seed, b as u64);
            sequence_gradients(&c, &w, s, &labels).unwrap()
        })
        .collect();
    for (name, f) in &factors {
        assert_eq!((f.sequences, f.tokens), (2, 13), "{name}");
        let (rows, cols) = (f.rows, f.cols);
        let mut h_in = vec![0f64; cols * cols];
        let mut h_out = vec![0f64; rows * rows];
        for grads in &per_seq {
            let (r, cc, g) = &grads[name];
            assert_eq!((*r, *cc), (rows, cols));
            let g = |i: usize, j: usize| g[i * cols + j] as f64;
            for a in 0..cols {
                for b in 0..cols {
                    h_in[a * cols + b] += (0..rows).map(|i| g(i, a) * g(i, b)).sum::<f64>();
                }
            }
            for a in 0..rows {
                for b in 0..rows {
                    h_out[a * rows + b] += (0..cols).map(|j| g(a, j) * g(b, j)).sum::<f64>();
                }
            }
        }
        for (got, want, n, which) in [
            (&f.h_in, &h_in, cols, "h_in"),
            (&f.h_out, &h_out, rows, "h_out"),
        ] {
            let scale = want.iter().fold(0f64, |a, v| a.max(v.abs()));
            assert!(scale > 0.0, "{name} {which} is zero");
            for i in 0..n {
                for j in 0..n {
                    assert_eq!(
                        got[i * n + j],
                        got[j * n + i],
                        "{name} {which} not symmetric"
                    );
                    let e = (got[i * n + j] as f64 - want[i * n + j]).abs();
                    assert!(
                        e <= 1e-5 * scale,
                        "{name} {which}[{i},{j}]: {} vs {}",
                        got[i * n + j],
                        want[i * n + j]
                    );
                }
            }
            let m = Mat::<f64>::from_fn(n, n, |i, j| got[i * n + j] as f64);
            let eig = m.self_adjoint_eigenvalues(Side::Lower).unwrap();
            let min = eig.iter().cloned().fold(f64::INFINITY, f64::min);
            assert!(
                min >= -1e-5 * scale,
                "{name} {which}: eigenvalue {min} (max {scale})"
            );
        }
    }
}

#[test]
fn shards_reproduce_the_whole_run() {
    let c = tiny_config(false);
    let w = tiny_weights(&c, 23);
    let seqs = vec![tokens(6, 41), tokens(7, 42), tokens(4, 43)];
    let opts = SketchOptions {
        seed: 5,
        ..Default::default()
    };
    let whole = sketch_b(&c, &w, &seqs, &opts, &mut |_, _| {}).unwrap();
    let mut a = sketch_b(&c, &w, &seqs[..1], &opts, &mut |_, _| {}).unwrap();
    let shard2 = SketchOptions {
        first_sequence: 1,
        ..opts.clone()
    };
    let b = sketch_b(&c, &w, &seqs[1..], &shard2, &mut |_, _| {}).unwrap();
    for (name, f) in a.iter_mut() {
        f.merge(&b[name]).unwrap();
        let want = &whole[name];
        assert_eq!((f.sequences, f.tokens), (want.sequences, want.tokens));
        let close = |x: &[f32], y: &[f32]| {
            let s = y.iter().fold(0f32, |m, v| m.max(v.abs()));
            x.iter().zip(y).all(|(p, q)| (p - q).abs() <= 1e-5 * s)
        };
        assert!(
            close(&f.h_in, &want.h_in) && close(&f.h_out, &want.h_out),
            "{name}"
        );
    }
    // A different seed draws different labels, hence different factors.
    let other = sketch_b(
        &c,
        &w,
        &seqs,
        &SketchOptions { seed: 6, ..opts },
        &mut |_, _| {},
    )
    .unwrap();
    let name = "model.layers.0.mlp.up_proj.weight";
    assert_ne!(other[name].h_in, whole[name].h_in);
}

#[test]
fn sampler_follows_the_softmax() {
    let logits = [0.0f32, 1.0, 2.0, f32::NEG_INFINITY];
    let rows: Vec<f32> = (0..20000).flat_map(|_| logits).collect();
    let labels = sample_labels(&rows, 4, &mut label_rng(1, 2), 0).unwrap();
    let mut counts = [0usize; 4];
    for l in &labels {
        counts[*l as usize] += 1;
    }
    let z: f64 = (0..3).map(|i| (i as f64).exp()).sum();
    for (i, &n) in counts.iter().take(3).enumerate() {
        let p = (i as f64).exp() / z;
        let freq = n as f64 / labels.len() as f64;
        // 5 binomial standard deviations.
        assert!(
            (freq - p).abs() < 5.0 * (p * (1.0 - p) / 20000.0).sqrt(),
            "{i}: {freq} vs {p}"
        );
    }
    assert_eq!(counts[3], 0);
    let again = sample_labels(&rows, 4, &mut label_rng(1, 2), 0).unwrap();
    assert_eq!(labels, again);
    let nan = [0.0f32, f32::NAN];
    assert!(matches!(
        sample_labels(&nan, 2, &mut label_rng(1, 2), 3),
        Err(YaqaError::NonFinite { sequence: 3, .. })
    ));
}

#[test]
fn bad_inputs_are_named_errors() {
    let c = tiny_config(false);
    let w = tiny_weights(&c, 1);
    let opts = SketchOptions::default();
    let run = |seqs: &[Vec<u32>], o: &SketchOptions| sketch_b(&c, &w, seqs, o, &mut |_, _| {});

    assert!(matches!(run(&[], &opts), Err(YaqaError::NoSequences)));
    assert!(matches!(
        run(&[vec![1, 2], vec![]], &opts),
        Err(YaqaError::EmptySequence { sequence: 1 })
    ));
    let e = run(&[vec![1, 2, VOCAB as u32]], &opts).unwrap_err();
    assert!(
        matches!(e, YaqaError::TokenOutOfRange { position: 2, .. }),
        "{e}"
    );
    let short = SketchOptions {
        max_len: 2,
        ..Default::default()
    };
    assert!(matches!(
        run(&[vec![1, 2, 3]], &short),
        Err(YaqaError::SequenceTooLong { len: 3, .. })
    ));
    let zero = SketchOptions {
        max_len: 0,
        ..Default::default()
    };
    assert!(run(&[vec![1]], &zero)
        .unwrap_err()
        .to_string()
        .contains("max_len"));

    assert!(matches!(
        sequence_gradients(&c, &w, &[1, 2], &[1]),
        Err(YaqaError::LabelCount {
            tokens: 2,
            labels: 1
        })
    ));
    assert!(matches!(
        sequence_gradients(&c, &w, &[1, 2], &[1, 99]),
        Err(YaqaError::LabelOutOfRange {
            position: 1,
            label: 99,
            ..
        })
    ));

    let name = "model.layers.1.mlp.gate_proj.weight";
    let mut missing = OwnedTensors::new();
    for n in w.tensor_names().into_iter().filter(|n| n != name) {
        let v = w.tensor(&n).unwrap();
        missing.insert_f32(n.clone(), v.shape.to_vec(), &v.to_f32_vec());
    }
    let e = sketch_b(&c, &missing, &[vec![1]], &opts, &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains(name), "{e}");

    let mut reshaped = with_tensor(&missing, "model.norm.weight", &[1.0; 16]);
    reshaped.insert_f32(name, vec![3], &[0.0; 3]);
    let e = sketch_b(&c, &reshaped, &[vec![1]], &opts, &mut |_, _| {}).unwrap_err();
    assert!(
        matches!(&e, YaqaError::Shape { name: n, .. } if n == name),
        "{e}"
    );

    let mut bad = c.clone();
    bad.num_key_value_heads = 3;
    let e = sketch_b(&bad, &w, &[vec![1]], &opts, &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("num_key_value_heads"), "{e}");

    let mut f = KroneckerFactors::zeros(2, 3);
    assert!(matches!(
        f.accumulate(&[0.0; 5], 1),
        Err(YaqaError::GradientSize { .. })
    ));
    assert!(matches!(
        f.merge(&KroneckerFactors::zeros(3, 2)),
        Err(YaqaError::MergeShape { .. })
    ));
}

#[test]
fn guided_saliencies_and_hessians_are_the_defined_sums() {
    // Saliencies: two groups of a 5-row output ([0, 2) and [2, 5)), 3 tokens.
    let (rows, cols, t) = (5usize, 4usize, 3usize);
    let g = lcg_vec(t * rows, 4);
    let mut sal = GuidedSaliency::new(rows, 2).unwrap();
    sal.push(&g, t).unwrap();
    assert_eq!(
        (group_rows(rows, 2, 0), group_rows(rows, 2, 1)),
        (0..2, 2..5)
    );
    let s = &sal.sequences[0];
    for tok in 0..t {
        let sq = |c: usize| f64::from(g[tok * rows + c]).powi(2);
        let want = [(sq(0) + sq(1)) / 2.0, (sq(2) + sq(3) + sq(4)) / 3.0];
        for (group, w) in want.iter().enumerate() {
            assert!((f64::from(s[tok * 2 + group]) - w).abs() <= 1e-6 * w.max(1e-6));
        }
    }
    assert!(GuidedSaliency::new(3, 4).is_err() && GuidedSaliency::new(3, 0).is_err());
    assert!(GuidedSaliency::new(rows, 2)
        .unwrap()
        .push(&g[1..], t)
        .is_err());

    // Hessians against explicit f64 sums, accumulated twice.
    let x = lcg_vec(t * cols, 3);
    let mut h = GuidedHessian::zeros(cols, 2);
    h.accumulate(&x, s, t).unwrap();
    h.accumulate(&x, s, t).unwrap();
    for group in 0..2 {
        for i in 0..cols {
            for j in 0..cols {
                let want: f64 = 2.0
                    * (0..t)
                        .map(|tok| {
                            f64::from(s[tok * 2 + group])
                                * f64::from(x[tok * cols + i])
                                * f64::from(x[tok * cols + j])
                        })
                        .sum::<f64>();
                let got = f64::from(h.block(group)[i * cols + j]);
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1e-3),
                    "{group} {i} {j}"
                );
            }
        }
    }
    assert_eq!(h.tokens, 6);
    assert!(h.accumulate(&x[1..], s, t).is_err());

    // Through the model: with one predicted position, G_b = g xᵀ, so the Fisher diagonal
    // (G_b ⊙ G_b, whose G_b the finite-difference tests check) is g_c² x_j², and with one
    // group per output channel the saliency is g_c²: entry [c][j] of the Fisher divided by
    // channel c's saliency is x_j² whatever c is.
    let c = tiny_config(false);
    let w = tiny_weights(&c, 5);
    let name = "model.layers.1.self_attn.v_proj.weight";
    let kv = c.kv_dim();
    let seqs = [tokens(2, 9)];
    let opts = SketchOptions::default();
    let stats = guided_statistics(&c, &w, &seqs, kv, &opts, &mut |_, _| {}).unwrap();
    let fisher = fisher_diagonal(&c, &w, &seqs, &opts, &mut |_, _| {}).unwrap();
    assert_eq!(stats.fisher, fisher);
    let sal = &stats.saliency[name];
    assert_eq!((sal.rows, sal.groups, sal.sequences.len()), (kv, kv, 1));
    assert_eq!(sal.sequences[0].len(), kv);
    let (_, hidden, f) = &fisher[name];
    let s = &sal.sequences[0];
    let reference = (0..kv).max_by(|&a, &b| s[a].total_cmp(&s[b])).unwrap();
    assert!(s[reference] > 0.0);
    for ch in (0..kv).filter(|&ch| s[ch] > 1e-6 * s[reference]) {
        for j in 0..*hidden {
            let x2 = f[reference * hidden + j] / s[reference];
            let got = f[ch * hidden + j] / s[ch];
            assert!(
                (got - x2).abs() <= 1e-3 * x2.max(1e-6),
                "channel {ch} input {j}: {got} vs {x2}"
            );
        }
    }
}

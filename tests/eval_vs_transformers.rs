//! The float reference against an independent implementation: PyTorch + transformers loading
//! the same GGUF with its own dequantizer and tokenizer (`scripts/golden/eval_ppl.py`, fixture
//! `tests/fixtures/transformers_eval.json`). Our tokenizer must produce the identical token
//! stream for every canonical text, and our NLLs must agree per window and per token.

use crate::common::{assets, fixture, gguf};
use serde_json::Value;
use sfx_formats::checkpoint::Checkpoint;
use sfx_formats::corpus;
use sfx_runtime::eval::spec::LONG_SCORED_TOKENS;
use sfx_runtime::eval::{evaluate, long_context_part, window_parts, ModelScorer};
use sfx_runtime::{Model, ModelOptions};
use sha2::{Digest, Sha256};
use std::process::Command;
use tokenizers::Tokenizer;

fn ids_sha256(ids: &[u32]) -> String {
    let mut h = Sha256::new();
    for id in ids {
        h.update(id.to_le_bytes());
    }
    format!("{:x}", h.finalize())
}

/// The GGUF dequantized in memory with F32 weights: the exact path, comparable to transformers'
/// float32 evaluation.
fn gguf_model() -> (Checkpoint, Model) {
    let ckpt = Checkpoint::open(gguf().to_str().unwrap()).unwrap();
    let model = Model::load_cpu(
        &ckpt.config,
        ckpt.tensors.as_ref(),
        &ModelOptions::default(),
    )
    .unwrap();
    (ckpt, model)
}

fn tokenizer(ckpt: &Checkpoint) -> Tokenizer {
    Tokenizer::from_bytes(ckpt.tokenizer_json.as_ref().unwrap().as_bytes()).unwrap()
}

fn encode(tok: &Tokenizer, text: &str) -> Vec<u32> {
    tok.encode_fast(text, false).unwrap().get_ids().to_vec()
}

#[test]
fn token_streams_match_transformers_on_every_text() {
    let fx = fixture("transformers_eval.json");
    let ckpt = Checkpoint::open(gguf().to_str().unwrap()).unwrap();
    let tok = tokenizer(&ckpt);
    let mut texts = vec![("wiki".to_string(), corpus::wiki_text(&assets()).unwrap())];
    for novel in corpus::AUSTEN_NOVELS {
        texts.push((
            novel.to_string(),
            corpus::austen_text(&assets(), novel).unwrap(),
        ));
    }
    for (name, text) in texts {
        let want = &fx["token_counts"][&name];
        let ids = encode(&tok, &text);
        assert_eq!(
            ids.len() as u64,
            want["tokens"].as_u64().unwrap(),
            "{name}: token count"
        );
        assert_eq!(
            ids_sha256(&ids),
            want["ids_sha256_u32le"].as_str().unwrap(),
            "{name}: ids"
        );
    }
}

/// Per-window mean NLL on wiki through the exact (F32, GGUF-dequantized) path. Both sides run
/// float32 from the same dequantized weights; the only differences are summation order and
/// kernels, so the windows agree to 0.05 % (measured: see docs/results.md).
#[test]
fn wiki_window_nll_matches_transformers() {
    let fx = fixture("transformers_eval.json");
    let (ckpt, model) = gguf_model();
    let ids = encode(&tokenizer(&ckpt), &corpus::wiki_text(&assets()).unwrap());
    let parts = window_parts(&ids, 2048, 2);
    let mut scorer = ModelScorer::new(&model, 2048).unwrap();
    let res = evaluate::<_, ModelScorer<sfx_runtime::CpuBackend>>(
        &parts,
        &mut scorer,
        None,
        |_, _, _| {},
    )
    .unwrap();
    let want = fx["wiki:8"]["windows"].as_array().unwrap();
    for (ours, theirs) in res.parts.iter().zip(want) {
        let t = theirs["mean_nll"].as_f64().unwrap();
        let rel = (ours.ppl.mean_nll - t).abs() / t;
        eprintln!(
            "{}: ours {:.6} transformers {t:.6} (rel {rel:.2e})",
            ours.name, ours.ppl.mean_nll
        );
        assert!(
            rel < 5e-4,
            "{}: mean NLL {} vs transformers {t}",
            ours.name,
            ours.ppl.mean_nll
        );
        assert_eq!(ours.ppl.tokens, theirs["n_scored"].as_u64().unwrap());
    }
}

/// Per-token NLLs of the long-context protocol on Emma (prefill 1792 tokens, then 255
/// decode steps) through `model`'s decode path, with transformers' for the same tokens.
fn emma_decode_nlls(ckpt: &Checkpoint, model: &Model) -> (Vec<f64>, Vec<f64>, f64) {
    let fx = fixture("transformers_eval.json");
    let want = &fx["austen-long:2048"]["novels"]["emma"];
    let ids = encode(
        &tokenizer(ckpt),
        &corpus::austen_text(&assets(), "emma").unwrap(),
    );
    let part = long_context_part("emma", &ids, 2048, LONG_SCORED_TOKENS);
    assert_eq!(
        ids_sha256(&part.tokens),
        want["window_ids_sha256_u32le"].as_str().unwrap()
    );
    let theirs: Vec<f64> = want["nll"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(theirs.len(), LONG_SCORED_TOKENS);
    let mut scorer = ModelScorer::new(model, 2048).unwrap();
    let mut ours = Vec::new();
    let prefix = &part.tokens[..part.first_scored];
    let mut logits = sfx_runtime::eval::Scorer::prefill_last(&mut scorer, prefix).unwrap();
    for pos in part.first_scored..part.tokens.len() {
        ours.push(-sfx_runtime::eval::log_softmax_at(
            &logits,
            part.tokens[pos] as usize,
        ));
        if pos + 1 < part.tokens.len() {
            logits = sfx_runtime::eval::Scorer::decode_step(&mut scorer, part.tokens[pos]).unwrap();
        }
    }
    (ours, theirs, want["mean_nll"].as_f64().unwrap())
}

/// Largest per-token NLL difference and the relative difference of the means.
fn nll_agreement(ours: &[f64], theirs: &[f64], their_mean: f64) -> (f64, f64) {
    let max_abs = ours
        .iter()
        .zip(theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    let mean: f64 = ours.iter().sum::<f64>() / ours.len() as f64;
    (max_abs, (mean - their_mean).abs() / their_mean)
}

/// Long-context protocol on one novel: every scored token's NLL is compared with
/// transformers' (tolerance 0.02 nats absolute per token: f32 accumulation-order noise on
/// logits is ~1e-4, measured max in docs/results.md).
#[test]
fn long_context_decode_path_matches_transformers_per_token() {
    let (ckpt, model) = gguf_model();
    let (ours, theirs, t) = emma_decode_nlls(&ckpt, &model);
    let (max_abs, mean_rel) = nll_agreement(&ours, &theirs, t);
    eprintln!("emma: max |ΔNLL| per token {max_abs:.2e}, mean {mean_rel:.2e}");
    assert!(max_abs < 0.02, "max per-token NLL difference {max_abs}");
    assert!(mean_rel < 5e-4, "mean NLL differs by {mean_rel} (relative)");
}

/// The same GGUF run in its own Q4_1/Q8_0 blocks (no f32 copy): with f32 activations its
/// weights are llama.cpp's dequantized values exactly, so it meets the float path's bounds;
/// with int8 activations (the tools' default, as llama.cpp runs these files) each decode
/// input is rounded to 1/254 of its block's largest, which moves the per-token NLLs by at
/// most BOUND (measured, docs/results.md).
#[test]
fn gguf_blocks_decode_matches_transformers_per_token() {
    use sfx_runtime::backend::cpu::DecodeActivations;
    use sfx_runtime::resident::{runs_in_blocks, GgufBlockFactory};
    use sfx_runtime::CpuBackend;
    let ckpt = Checkpoint::open_keeping_blocks(gguf().to_str().unwrap(), runs_in_blocks).unwrap();
    assert!(
        ckpt.blocks
            .contains_key("model.layers.0.mlp.down_proj.weight")
            && ckpt.blocks.contains_key("model.embed_tokens.weight"),
        "the Q4_1 projections and the Q8_0 embedding stay in blocks"
    );
    assert!(!ckpt.tensors.contains("model.layers.0.mlp.down_proj.weight"));
    let factory = GgufBlockFactory {
        blocks: &ckpt.blocks,
        precision: sfx_runtime::WeightPrecision::Native,
    };
    for (acts, max_bound, mean_bound) in [
        (DecodeActivations::F32, 0.02, 5e-4),
        (DecodeActivations::Int8, INT8_MAX_NLL, INT8_MEAN_NLL),
    ] {
        let backend = CpuBackend::new().with_decode_activations(acts);
        let model = Model::load_with(
            backend,
            &ckpt.config,
            ckpt.tensors.as_ref(),
            &factory,
            &ModelOptions::default(),
        )
        .unwrap();
        let (ours, theirs, t) = emma_decode_nlls(&ckpt, &model);
        let (max_abs, mean_rel) = nll_agreement(&ours, &theirs, t);
        eprintln!(
            "emma, GGUF blocks, {} activations: max |ΔNLL| per token {max_abs:.2e}, mean {mean_rel:.2e}",
            acts.as_str()
        );
        assert!(
            max_abs < max_bound,
            "{acts:?}: max per-token NLL difference {max_abs}"
        );
        assert!(
            mean_rel < mean_bound,
            "{acts:?}: mean NLL differs by {mean_rel}"
        );
    }
}

/// Bounds of [`gguf_blocks_decode_matches_transformers_per_token`] with int8 activations:
/// measured 0.242 nats on the worst token and 1.18e-3 on the mean (relative), about 1.6× and
/// 2.5× under these; a misread code or scale moves every token by O(1).
const INT8_MAX_NLL: f64 = 0.4;
const INT8_MEAN_NLL: f64 = 3e-3;

/// The product path: `sfx-convert import-gguf` writes a BF16 Hugging Face folder and
/// `sfx-run <folder> --ppl wiki:1 --json` evaluates it. BF16 rounding of the weights moves the
/// PPL slightly; the acceptance bound for the float reference is 0.5 %.
#[test]
fn imported_bf16_folder_evaluates_within_half_a_percent() {
    let fx = fixture("transformers_eval.json");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("smollm2");
    let st = Command::new(env!("CARGO_BIN_EXE_sfx-convert"))
        .args([
            "import-gguf",
            gguf().to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ])
        .status()
        .unwrap();
    assert!(st.success());
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    let o = Command::new(env!("CARGO_BIN_EXE_sfx-run"))
        .args([out.to_str().unwrap(), "--ppl", "wiki:1", "--json"])
        .env("SFX_ASSETS", assets())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let ours = v["ppl"].as_f64().unwrap();
    let theirs = fx["wiki:8"]["windows"][0]["ppl"].as_f64().unwrap();
    let rel = (ours - theirs).abs() / theirs;
    eprintln!(
        "bf16 folder wiki window 0: PPL {ours:.4} vs transformers f32 {theirs:.4} (rel {rel:.2e})"
    );
    assert!(rel < 5e-3, "PPL {ours} vs {theirs}");
    assert_eq!(v["scored_tokens"].as_u64(), Some(2047));
}

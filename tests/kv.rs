//! KV refinement on the real SmolLM2-135M: every position scored through the decode path
//! after an exact prefill. The FP16-KV run is checked against the float cache through the
//! ordinary evaluation path (independent code); KVarN 2/2 must cost KL and nested refinement
//! must recover most of it; generation runs end to end with a quantized cache.

use crate::common::{assets, float_model, gguf};
use sfx_runtime::eval::kv_sweep::{kv_sweep, KvSide};
use sfx_runtime::eval::{evaluate, EvalPart, ModelScorer};
use sfx_runtime::kv::{KvBaseChoice, KvBits, KvConfig, KvRefineConfig, KvTierConfig, RefineBits};
use std::process::Command;

/// The last 640 tokens of Emma: a 384-token prefill (128 sinks + 2 encoded tiles) and 256
/// positions scored one at a time.
fn emma_part() -> EvalPart {
    let (ckpt, _) = float_model();
    let text = sfx_formats::corpus::austen_text(&assets(), "emma").unwrap();
    let tok = tokenizers::Tokenizer::from_bytes(ckpt.tokenizer_json.as_ref().unwrap().as_bytes())
        .unwrap();
    let ids = tok
        .encode_fast(text.as_str(), false)
        .unwrap()
        .get_ids()
        .to_vec();
    EvalPart {
        name: "emma".into(),
        tokens: ids[ids.len() - 640..].to_vec(),
        first_scored: 384,
        through_decode: true,
    }
}

#[test]
fn kvarn_costs_kl_and_refinement_recovers_it() {
    let (_, model) = float_model();
    let part = emma_part();
    let base = KvBaseChoice::Kvarn(KvBits { key: 2, value: 2 });
    let refined = KvConfig {
        refine: Some(KvRefineConfig {
            bits: RefineBits { key: 4, value: 4 },
            group: 2,
            fraction: 1.0 / 16.0,
            tier: KvTierConfig::Ram,
        }),
        ..KvConfig::base(base)
    };
    let configs = [
        KvConfig::base(KvBaseChoice::F16),
        KvConfig::base(base),
        refined,
    ];
    let side = KvSide {
        model,
        refiner: None,
    };
    let runs = kv_sweep(side, None, std::slice::from_ref(&part), &configs, |_| {}).unwrap();
    let kl = |i: usize| runs[i].kl.unwrap().mean;

    // Independent path: the float (f32) cache through the standard long-context driver.
    let mut scorer = ModelScorer::new(model, part.tokens.len()).unwrap();
    let no_reference: Option<&mut ModelScorer<'_, sfx_runtime::CpuBackend>> = None;
    let float = evaluate(&[part], &mut scorer, no_reference, |_, _, _| {}).unwrap();
    let rel = (runs[0].ppl.ppl / float.ppl.ppl - 1.0).abs();
    assert!(
        rel < 2e-3,
        "FP16 KV PPL {} vs float cache {}",
        runs[0].ppl.ppl,
        float.ppl.ppl
    );

    // Measured: KL 2/2 ≈ 0.09, refined ≈ 0.02 (8 of 128 groups per head per step).
    assert!(kl(1) > 0.02, "KVarN 2/2 KL {} suspiciously small", kl(1));
    assert!(
        kl(2) < 0.5 * kl(1),
        "refined KL {} vs base {}",
        kl(2),
        kl(1)
    );
    let s = &runs[2].stats;
    assert_eq!(s.applied_groups, s.selected_groups);
    // Per head and layer (30 × 3): 2 tiles × 64 groups → 8 selected for the first 128 decode
    // steps; the 128th decoded token completes a third tile → 12 for the remaining 127.
    assert_eq!(s.selected_groups, (128 * 8 + 127 * 12) * 30 * 3);
    assert_eq!(s.tiles_encoded, 3 * 30 * 3);
}

#[test]
fn generation_runs_with_a_quantized_refined_cache() {
    let out = Command::new(env!("CARGO_BIN_EXE_sfx-run"))
        .args([
            gguf().to_str().unwrap(),
            "-p",
            "The history of the printing press",
            "-n",
            "300",
            "--temp",
            "0",
            "--ignore-eos",
            "--kv",
            "2/2",
            "--kv-sinks",
            "16",
            "--kv-tier",
            "ssd",
            "--kv-cache",
            "64KiB",
            "--json",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let text = v["completion"].as_str().unwrap_or_default();
    assert!(text.len() > 200, "{v}");
    assert_eq!(
        v["kv_cache"]["config"],
        "2/2 +4/+4 g2 1/128 ssd 64 KiB skip"
    );
}

//! Running `.sfx` containers (resident base, no refinement): a container written per
//! docs/format.md ("Model sections written by `sfx-convert`") must load into exactly the
//! model that quantizing the same float checkpoint at load time gives (`RtnFactory`), and
//! every damaged section must be an error naming it.
//!
//! The containers here are written by this test with `SfxWriter` from
//! `GroupQuantized::quantize_with(.., 4, 128, minmax_grid)` — the same quantizer `RtnFactory`
//! runs — so the expected logits come from an independent load path (float checkpoint →
//! quantize at load), not from the code under test.

use crate::common::{assets, gguf};
use serde_json::{json, Value};
use sfx_formats::checkpoint::Checkpoint;
use sfx_formats::resident::{minmax_grid, GroupQuantized};
use sfx_formats::sfx::{
    Codec, Layout, Provenance, SectionSpec, SfxFile, SfxMetadata, SfxWriter, Tier,
};
use sfx_formats::{DType, ModelConfig, OwnedTensors, TensorSource};
use sfx_runtime::eval::{evaluate, window_parts, ModelScorer};
use sfx_runtime::resident::RtnFactory;
use sfx_runtime::{load_sfx_model, CpuBackend, LogitsMode, Model, ModelOptions};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const RUN: &str = env!("CARGO_BIN_EXE_sfx-run");
const SFX: &str = env!("CARGO_BIN_EXE_sfx");
const BITS: u8 = 4;
const GROUP: usize = 128;

fn is_projection(name: &str) -> bool {
    name.starts_with("model.layers.") && name.ends_with("_proj.weight")
}

/// The sections `sfx-convert` writes for a resident-only model (docs/format.md): projections
/// as packed codes + F16 scales + u8 zeros, embedding / head in their source dtype, every
/// other tensor (norms, biases) dense F32. `codec` applies to every section.
fn model_sections(tensors: &dyn TensorSource, codec: Codec) -> Vec<(SectionSpec, Vec<u8>)> {
    let res = |name: &str, layout: Layout| SectionSpec::new(name, Tier::Resident, codec, layout);
    let mut out = Vec::new();
    for name in tensors.tensor_names() {
        let t = tensors.tensor(&name).expect("listed tensor");
        let shape: Vec<u64> = t.shape.iter().map(|&d| d as u64).collect();
        if is_projection(&name) {
            let (rows, cols) = (t.shape[0], t.shape[1]);
            let q = GroupQuantized::quantize_with(
                &t.to_f32_vec(),
                rows,
                cols,
                BITS,
                GROUP,
                minmax_grid,
            )
            .expect("quantize");
            let codes = Layout::PackedCodes {
                rows: rows as u64,
                cols: cols as u64,
                bits: BITS as u64,
                group: GROUP as u64,
            };
            out.push((res(&name, codes), q.codes().to_vec()));
            let scales = Layout::Dense {
                dtype: DType::F16,
                shape: vec![rows as u64, cols.div_ceil(GROUP) as u64],
            };
            let sb = q.scales().iter().flat_map(|s| s.to_le_bytes()).collect();
            out.push((res(&format!("{name}.scales"), scales), sb));
            out.push((
                res(&format!("{name}.zeros"), Layout::Bytes),
                q.zeros().to_vec(),
            ));
        } else if name == "model.embed_tokens.weight" || name == "lm_head.weight" {
            let l = Layout::Dense {
                dtype: t.dtype,
                shape,
            };
            out.push((res(&name, l), t.data.to_vec()));
        } else {
            let l = Layout::Dense {
                dtype: DType::F32,
                shape,
            };
            let b = t
                .to_f32_vec()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            out.push((res(&name, l), b));
        }
    }
    out
}

fn write_sfx(
    path: &Path,
    config: Option<&ModelConfig>,
    tokenizer_json: Option<String>,
    tokenizer_config: Option<Value>,
    sections: &[(SectionSpec, Vec<u8>)],
) {
    let mut w = SfxWriter::create(path).expect("create .sfx");
    for (spec, bytes) in sections {
        w.add_section(spec.clone(), bytes).expect("add section");
    }
    let meta = SfxMetadata {
        config: config.cloned(),
        tokenizer_json,
        tokenizer_config,
        provenance: Provenance {
            tool: "tests/sfx_model.rs".into(),
            tool_version: "0".into(),
            source_id: "SmolLM2-135M-Instruct.Q4_1.gguf".into(),
            ..Provenance::default()
        },
        // `refine` as the converter records it; this loader ignores it (no refinement
        // sections are written), `sfx inspect` reports it.
        params: [
            (
                "quant".to_string(),
                json!({"method": "rtn", "bits": BITS, "group": GROUP, "packing": "group-asym-v1"}),
            ),
            (
                "refine".to_string(),
                json!({"fit": true, "lambda": "mean_diag_m", "k": {"qkv": 16, "o": 8, "gu": 16, "d": 4},
                    "mlp": "channels", "tier": "ram"}),
            ),
        ]
        .into_iter()
        .collect(),
    };
    w.finish(&meta).expect("finish .sfx");
}

/// The real SmolLM2 (GGUF dequantized in memory) as a 4-bit g128 container, written once per
/// test binary under cargo's per-target temp dir and shared by the tests below.
fn real_sfx() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let ck = Checkpoint::open(gguf().to_str().expect("utf-8 path")).expect("open GGUF");
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("sfx_model_test");
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("smollm2-rtn4-g128.sfx");
        write_sfx(
            &path,
            Some(&ck.config),
            ck.tokenizer_json.clone(),
            ck.tokenizer_config.clone(),
            &model_sections(ck.tensors.as_ref(), Codec::Raw),
        );
        path
    })
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Logits of a 6-token prefill (panel GEMM path) and one decode step (matvec path).
fn prefill_and_step(m: &Model<CpuBackend>, ids: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let mut cache = m.new_cache(ids.len() + 1).expect("cache");
    let a = m
        .forward(ids, &mut cache, LogitsMode::All)
        .expect("prefill");
    let b = m
        .forward(&[ids[0]], &mut cache, LogitsMode::Last)
        .expect("step");
    (a.into_vec(), b.into_vec())
}

#[test]
fn sfx_logits_match_rtn_quantized_at_load() {
    let path = real_sfx();
    let ck = Checkpoint::open(gguf().to_str().expect("utf-8 path")).expect("open GGUF");
    let opts = ModelOptions::default();
    let rtn = Model::load_with(
        CpuBackend::new(),
        &ck.config,
        &*ck.tensors,
        &RtnFactory::new(BITS),
        &opts,
    )
    .expect("rtn model");
    let file = SfxFile::open(path).expect("open .sfx");
    let sfx = load_sfx_model(&file, &opts).expect("load .sfx");
    let tok = tokenizers::Tokenizer::from_bytes(ck.tokenizer_json.as_deref().expect("tokenizer"))
        .expect("tokenizer");
    let ids = tok
        .encode("The capital of France is Paris, and", false)
        .expect("encode")
        .get_ids()
        .to_vec();
    assert!(ids.len() >= 4, "{ids:?}");
    let (want_a, want_b) = prefill_and_step(&rtn, &ids);
    let (got_a, got_b) = prefill_and_step(&sfx, &ids);
    // Same codes, same kernels, same order of operations: expected bitwise equal; 1e-5 is the
    // brief's tolerance.
    assert!(
        max_abs_diff(&got_a, &want_a) <= 1e-5,
        "prefill: {}",
        max_abs_diff(&got_a, &want_a)
    );
    assert!(
        max_abs_diff(&got_b, &want_b) <= 1e-5,
        "decode: {}",
        max_abs_diff(&got_b, &want_b)
    );
    // And the container really is quantized: far from the float model's logits.
    let float = Model::load_cpu(&ck.config, &*ck.tensors, &opts).expect("float model");
    let (float_a, _) = prefill_and_step(&float, &ids);
    assert!(
        max_abs_diff(&got_a, &float_a) > 1e-2,
        "quantized logits equal float ones"
    );
    // Resident size: the quantized linears as RtnFactory builds them, plus the float tables.
    assert_eq!(sfx.resident_bytes(), rtn.resident_bytes());
}

fn run(bin: &str, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(bin)
        .args(args)
        .env("SFX_ASSETS", assets())
        .output()
        .expect("spawn");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `sfx-run x.sfx --ppl wiki:1 --kl-ref <gguf> --json` on a 128-token window: the perplexity
/// must equal the one of the RTN model quantized at load, scored in-process on the same
/// window (tokenized here independently of the CLI).
#[test]
fn sfx_run_ppl_and_kl_on_sfx_container() {
    let path = real_sfx();
    let g = gguf();
    let (ok, stdout, stderr) = run(
        RUN,
        &[
            path.to_str().expect("utf-8"),
            "--ppl",
            "wiki:1",
            "--ctx",
            "128",
            "--kl-ref",
            g.to_str().expect("utf-8"),
            "--json",
        ],
    );
    assert!(ok, "sfx-run failed: {stderr}");
    let v: Value = serde_json::from_str(&stdout).expect("JSON report");
    let ppl = v["ppl"].as_f64().expect("ppl");
    assert_eq!(v["scored_tokens"].as_u64(), Some(127), "{v}");
    let kl = v["kl"]["mean"].as_f64().expect("kl.mean");
    assert!(kl.is_finite() && kl > 0.0, "KL to the float model: {kl}");

    let ck = Checkpoint::open(g.to_str().expect("utf-8")).expect("open GGUF");
    let tok = tokenizers::Tokenizer::from_bytes(ck.tokenizer_json.as_deref().expect("tokenizer"))
        .expect("tokenizer");
    let text = sfx_formats::corpus::wiki_text(&assets()).expect("wiki text");
    let ids = tok
        .encode_fast(text.as_str(), false)
        .expect("encode")
        .get_ids()
        .to_vec();
    let parts = window_parts(&ids, 128, 1);
    let rtn = Model::load_with(
        CpuBackend::new(),
        &ck.config,
        &*ck.tensors,
        &RtnFactory::new(BITS),
        &ModelOptions::default(),
    )
    .expect("rtn model");
    let mut scorer = ModelScorer::new(&rtn, 128).expect("scorer");
    let want = evaluate::<_, ModelScorer<'_, CpuBackend>>(&parts, &mut scorer, None, |_, _, _| {})
        .expect("evaluate")
        .ppl
        .ppl;
    assert!(
        (ppl - want).abs() <= 1e-4 * want,
        "sfx-run ppl {ppl}, RTN at load {want}"
    );
}

/// Generation through a renamed container (detected by magic bytes, not the extension) with
/// the tokenizer and chat template from its metadata; and `sfx inspect` on it.
#[test]
fn sfx_run_generates_and_inspect_reports_bits() {
    let path = real_sfx();
    let d = tempfile::tempdir().expect("tempdir");
    let renamed = d.path().join("model.bin");
    std::os::unix::fs::symlink(path, &renamed).expect("symlink");
    let (ok, stdout, stderr) = run(
        RUN,
        &[
            renamed.to_str().expect("utf-8"),
            "-p",
            "Hello",
            "--chat",
            "-n",
            "4",
            "--temp",
            "0",
            "--json",
        ],
    );
    assert!(ok, "sfx-run -p failed: {stderr}");
    let v: Value = serde_json::from_str(&stdout).expect("JSON report");
    assert!(
        v["generated_tokens"].as_u64().is_some_and(|n| n >= 1),
        "{v}"
    );

    let (ok, stdout, stderr) = run(SFX, &["inspect", path.to_str().expect("utf-8"), "--json"]);
    assert!(ok, "sfx inspect failed: {stderr}");
    let v: Value = serde_json::from_str(&stdout).expect("JSON report");
    // Independent count: the quantized linears RtnFactory builds from the float checkpoint.
    let ck = Checkpoint::open(gguf().to_str().expect("utf-8")).expect("open GGUF");
    let rtn = Model::load_with(
        CpuBackend::new(),
        &ck.config,
        &*ck.tensors,
        &RtnFactory::new(BITS),
        &ModelOptions::default(),
    )
    .expect("rtn model");
    let (mut bytes, mut weights) = (0usize, 0usize);
    for layer in rtn.layers() {
        for (_, l) in layer.linears() {
            bytes += l.resident_bytes();
            weights += l.in_dim() * l.out_dim();
        }
    }
    let want = bytes as f64 * 8.0 / weights as f64;
    let got = v["resident_linears"]["bits_per_weight"]
        .as_f64()
        .expect("bits_per_weight");
    assert!((got - want).abs() < 1e-9, "inspect {got} vs {want}");
    assert_eq!(
        v["resident_linears"]["count"].as_u64(),
        Some(7 * ck.config.num_hidden_layers as u64)
    );
    assert_eq!(v["quant"]["bits"].as_u64(), Some(u64::from(BITS)));
    let (ok, text, stderr) = run(SFX, &["inspect", path.to_str().expect("utf-8")]);
    assert!(ok, "sfx inspect failed: {stderr}");
    for needle in [
        format!("{want:.3} bits/weight"),
        "rtn 4 bits, group 128".to_string(),
        "d 4, gu 16, o 8, qkv 16".to_string(),
        "tier resident".to_string(),
    ] {
        assert!(
            text.contains(&needle),
            "inspect output lacks '{needle}':\n{text}"
        );
    }
}

// ---- damaged containers, on a small random model (fast) ----

fn tiny_config() -> ModelConfig {
    let j = json!({
        "model_type": "llama", "hidden_size": 48, "intermediate_size": 136, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 97,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": false
    });
    ModelConfig::from_hf_json(&j, Path::new("tiny/config.json")).expect("config")
}

/// Deterministic random weights (LCG) with 1/√fan_in scaling; untied head.
fn tiny_tensors(c: &ModelConfig) -> OwnedTensors {
    let mut s = 7u64;
    let mut rnd = |n: usize, scale: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale
            })
            .collect()
    };
    let (h, q, kv, f, v) = (
        c.hidden_size,
        c.q_dim(),
        c.kv_dim(),
        c.intermediate_size,
        c.vocab_size,
    );
    let mut t = OwnedTensors::new();
    let mut lin = |t: &mut OwnedTensors, name: String, out: usize, inp: usize| {
        t.insert_f32(
            name,
            vec![out, inp],
            &rnd(out * inp, 1.0 / (inp as f32).sqrt()),
        );
    };
    lin(&mut t, "model.embed_tokens.weight".into(), v, h);
    lin(&mut t, "lm_head.weight".into(), v, h);
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        lin(&mut t, format!("{p}.self_attn.q_proj.weight"), q, h);
        lin(&mut t, format!("{p}.self_attn.k_proj.weight"), kv, h);
        lin(&mut t, format!("{p}.self_attn.v_proj.weight"), kv, h);
        lin(&mut t, format!("{p}.self_attn.o_proj.weight"), h, q);
        lin(&mut t, format!("{p}.mlp.gate_proj.weight"), f, h);
        lin(&mut t, format!("{p}.mlp.up_proj.weight"), f, h);
        lin(&mut t, format!("{p}.mlp.down_proj.weight"), h, f);
        for n in ["input_layernorm", "post_attention_layernorm"] {
            t.insert_f32(format!("{p}.{n}.weight"), vec![h], &vec![1.0; h]);
        }
    }
    t.insert_f32("model.norm.weight", vec![h], &vec![1.0; h]);
    t
}

/// Writes `sections` as a tiny-model container and loads it.
fn load_tiny(
    name: &str,
    config: Option<&ModelConfig>,
    sections: &[(SectionSpec, Vec<u8>)],
) -> Result<Model<CpuBackend>, String> {
    let d = tempfile::tempdir().expect("tempdir");
    let p = d.path().join(name);
    write_sfx(&p, config, None, None, sections);
    let f = SfxFile::open(&p).map_err(|e| e.to_string())?;
    load_sfx_model(&f, &ModelOptions::default()).map_err(|e| e.to_string())
}

/// zstd-compressed sections, untied float head, 136 = 128 + 8 columns (a short last group):
/// still the RTN-at-load model exactly.
#[test]
fn tiny_zstd_container_matches_rtn_at_load() {
    let c = tiny_config();
    let t = tiny_tensors(&c);
    let m = load_tiny("ok.sfx", Some(&c), &model_sections(&t, Codec::Zstd)).expect("load");
    let mut factory = RtnFactory::new(BITS);
    // The container keeps the untied head in its source dtype (F32 here); compare like for like.
    factory.head_precision = sfx_runtime::WeightPrecision::Native;
    let rtn = Model::load_with(
        CpuBackend::new(),
        &c,
        &t,
        &factory,
        &ModelOptions::default(),
    )
    .expect("rtn");
    let ids = [3u32, 14, 15, 92, 65, 35];
    let (a, b) = prefill_and_step(&m, &ids);
    let (wa, wb) = prefill_and_step(&rtn, &ids);
    assert!(max_abs_diff(&a, &wa) <= 1e-5 && max_abs_diff(&b, &wb) <= 1e-5);
}

#[test]
fn missing_zeros_section_is_named() {
    let c = tiny_config();
    let gone = "model.layers.1.mlp.down_proj.weight.zeros";
    let mut s = model_sections(&tiny_tensors(&c), Codec::Raw);
    s.retain(|(spec, _)| spec.name != gone);
    let e = load_tiny("nozeros.sfx", Some(&c), &s)
        .err()
        .expect("must fail");
    assert!(
        e.contains(&format!("'{gone}'")) && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn scales_with_wrong_shape_are_named() {
    let c = tiny_config();
    let bad = "model.layers.0.self_attn.k_proj.weight.scales";
    let mut s = model_sections(&tiny_tensors(&c), Codec::Raw);
    let (spec, _) = s
        .iter_mut()
        .find(|(spec, _)| spec.name == bad)
        .expect("section");
    // Transposed: same byte count, so only the shape check can catch it.
    let Layout::Dense { shape, .. } = &mut spec.layout else {
        panic!("scales are dense")
    };
    shape.reverse();
    let e = load_tiny("badscales.sfx", Some(&c), &s)
        .err()
        .expect("must fail");
    assert!(
        e.contains(&format!("'{bad}'")) && e.contains("[16, 1]"),
        "{e}"
    );
}

#[test]
fn codes_not_matching_the_config_and_missing_config_are_errors() {
    let c = tiny_config();
    let s = model_sections(&tiny_tensors(&c), Codec::Raw);
    let e = load_tiny("noconfig.sfx", None, &s)
        .err()
        .expect("must fail");
    assert!(e.contains("no model config"), "{e}");
    let mut wider = c.clone();
    wider.intermediate_size = 144;
    let e = load_tiny("wider.sfx", Some(&wider), &s)
        .err()
        .expect("must fail");
    assert!(
        e.contains("'model.layers.0.mlp.gate_proj.weight'") && e.contains("[144, 48]"),
        "{e}"
    );
}

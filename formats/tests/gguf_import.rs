//! Import of small synthetic GGUF models of every supported architecture: names, shapes,
//! the Q/K un-permutation (llama/mistral only), config.json fields, rope scaling, and the
//! errors for incomplete or inconsistent files.

#[path = "common/gguf_writer.rs"]
mod gguf_writer;
#[path = "common/iq_fixture.rs"]
mod iq_fixture;

use gguf_writer::{s, tiny_tokenizer, GgufBuilder, V};
use serde_json::{json, Value};
use sfx_formats::gguf::{import_gguf, import_gguf_to_folder_in_chunks, ImportedModel};
use sfx_formats::TensorSource;

const HIDDEN: usize = 8;
const HEADS: usize = 2;
const KV_HEADS: usize = 1;
const FFN: usize = 16;
const VOCAB: usize = 259; // tiny_tokenizer without merges

/// Distinct, exactly representable values for tensor `seed`.
fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|i| seed as f32 * 1000.0 + i as f32).collect()
}

/// llama.cpp's Q/K permutation (convert_hf_to_gguf: reshape(n_head, 2, d/2, cols)
/// .swapaxes(1, 2)), applied to a row-major [rows, cols] HF matrix.
fn permute(w: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
    let half = rows / n_head / 2;
    let mut out = vec![0.0; w.len()];
    for h in 0..n_head {
        for i in 0..half {
            for sidx in 0..2 {
                let dst = h * 2 * half + 2 * i + sidx;
                let src = h * 2 * half + sidx * half + i;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// (HF name, HF shape, HF-layout values) of each tensor.
type HfTensors = Vec<(String, Vec<usize>, Vec<f32>)>;

struct Spec {
    arch: &'static str,
    head_dim: usize,
    biases: bool,
    qk_norm: bool,
    lm_head: bool,
}

/// A one-layer model; returns the builder and the HF-layout values of every tensor.
fn model(spec: &Spec) -> (GgufBuilder, HfTensors) {
    model_sized(spec, HIDDEN, FFN)
}

/// [`model`] with a chosen hidden and feed-forward width.
fn model_sized(spec: &Spec, hidden: usize, ffn: usize) -> (GgufBuilder, HfTensors) {
    let a = spec.arch;
    let hd = spec.head_dim;
    let (q, kv) = (HEADS * hd, KV_HEADS * hd);
    let mut g = tiny_tokenizer(Some("gpt2"), &[]);
    g.kvs.retain(|(k, _)| k != "general.architecture");
    g = g
        .kv("general.architecture", s(a))
        .kv(&format!("{a}.block_count"), V::U32(1))
        .kv(&format!("{a}.context_length"), V::U32(2048))
        .kv(&format!("{a}.embedding_length"), V::U32(hidden as u32))
        .kv(&format!("{a}.feed_forward_length"), V::U32(ffn as u32))
        .kv(&format!("{a}.attention.head_count"), V::U32(HEADS as u32))
        .kv(
            &format!("{a}.attention.head_count_kv"),
            V::U32(KV_HEADS as u32),
        )
        .kv(&format!("{a}.rope.freq_base"), V::F32(1_000_000.0))
        .kv(
            &format!("{a}.attention.layer_norm_rms_epsilon"),
            V::F32(1e-6),
        );
    if hd != hidden / HEADS {
        g = g.kv(&format!("{a}.attention.key_length"), V::U32(hd as u32));
        g = g.kv(&format!("{a}.attention.value_length"), V::U32(hd as u32));
    }
    let mut t: Vec<(&str, String, Vec<usize>)> = vec![
        (
            "token_embd.weight",
            "model.embed_tokens.weight".into(),
            vec![VOCAB, hidden],
        ),
        (
            "output_norm.weight",
            "model.norm.weight".into(),
            vec![hidden],
        ),
        (
            "blk.0.attn_norm.weight",
            "model.layers.0.input_layernorm.weight".into(),
            vec![hidden],
        ),
        (
            "blk.0.ffn_norm.weight",
            "model.layers.0.post_attention_layernorm.weight".into(),
            vec![hidden],
        ),
        (
            "blk.0.attn_q.weight",
            "model.layers.0.self_attn.q_proj.weight".into(),
            vec![q, hidden],
        ),
        (
            "blk.0.attn_k.weight",
            "model.layers.0.self_attn.k_proj.weight".into(),
            vec![kv, hidden],
        ),
        (
            "blk.0.attn_v.weight",
            "model.layers.0.self_attn.v_proj.weight".into(),
            vec![kv, hidden],
        ),
        (
            "blk.0.attn_output.weight",
            "model.layers.0.self_attn.o_proj.weight".into(),
            vec![hidden, q],
        ),
        (
            "blk.0.ffn_gate.weight",
            "model.layers.0.mlp.gate_proj.weight".into(),
            vec![ffn, hidden],
        ),
        (
            "blk.0.ffn_up.weight",
            "model.layers.0.mlp.up_proj.weight".into(),
            vec![ffn, hidden],
        ),
        (
            "blk.0.ffn_down.weight",
            "model.layers.0.mlp.down_proj.weight".into(),
            vec![hidden, ffn],
        ),
    ];
    if spec.lm_head {
        t.push((
            "output.weight",
            "lm_head.weight".into(),
            vec![VOCAB, hidden],
        ));
    }
    if spec.biases {
        t.push((
            "blk.0.attn_q.bias",
            "model.layers.0.self_attn.q_proj.bias".into(),
            vec![q],
        ));
        t.push((
            "blk.0.attn_k.bias",
            "model.layers.0.self_attn.k_proj.bias".into(),
            vec![kv],
        ));
        t.push((
            "blk.0.attn_v.bias",
            "model.layers.0.self_attn.v_proj.bias".into(),
            vec![kv],
        ));
    }
    if spec.qk_norm {
        t.push((
            "blk.0.attn_q_norm.weight",
            "model.layers.0.self_attn.q_norm.weight".into(),
            vec![hd],
        ));
        t.push((
            "blk.0.attn_k_norm.weight",
            "model.layers.0.self_attn.k_norm.weight".into(),
            vec![hd],
        ));
    }
    let permuted = matches!(a, "llama" | "mistral");
    let mut hf = Vec::new();
    for (seed, (gname, hname, shape)) in t.into_iter().enumerate() {
        let n: usize = shape.iter().product();
        let v = values(n, seed);
        let heads = if gname.starts_with("blk.0.attn_q.") {
            HEADS
        } else if gname.starts_with("blk.0.attn_k.") {
            KV_HEADS
        } else {
            0
        };
        let stored = if permuted && heads > 0 {
            let cols = if shape.len() == 2 { shape[1] } else { 1 };
            permute(&v, shape[0], cols, heads)
        } else {
            v.clone()
        };
        let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        g = g.f32_tensor(gname, &dims, &stored);
        hf.push((hname, shape, v));
    }
    (g, hf)
}

fn import(g: &GgufBuilder) -> Result<ImportedModel, String> {
    let d = tempfile::tempdir().unwrap();
    import_gguf(g.write(d.path(), "m.gguf")).map_err(|e| e.to_string())
}

fn check_tensors(m: &ImportedModel, hf: &HfTensors) {
    assert_eq!(m.tensors.len(), hf.len());
    for (name, shape, v) in hf {
        let t = m.tensors.tensor(name).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(t.shape, shape.as_slice(), "{name}");
        assert_eq!(t.to_f32_vec(), *v, "{name}: values (after un-permutation)");
    }
}

#[test]
fn llama_is_unpermuted_and_configured() {
    let spec = Spec {
        arch: "llama",
        head_dim: 4,
        biases: false,
        qk_norm: false,
        lm_head: true,
    };
    let (g, hf) = model(&spec);
    let m = import(&g).unwrap();
    check_tensors(&m, &hf);
    let c = &m.hf_config;
    assert_eq!(c["architectures"], json!(["LlamaForCausalLM"]));
    assert_eq!(c["tie_word_embeddings"], false);
    assert_eq!(c["head_dim"], 4);
    assert_eq!(c["num_key_value_heads"], 1);
    assert_eq!(c["rms_norm_eps"], 1e-6);
    assert_eq!(c["rope_theta"], 1e6);
    assert_eq!(c["vocab_size"], VOCAB);
    assert_eq!(c["bos_token_id"], 256);
    assert_eq!(c["eos_token_id"], 257);
    assert!(m.source_sha256.as_ref().is_some_and(|h| h.len() == 64));
    sfx_formats::ModelConfig::from_hf_json(c, std::path::Path::new("config.json")).unwrap();
}

#[test]
fn mistral_qwen2_qwen3() {
    let spec = Spec {
        arch: "mistral",
        head_dim: 4,
        biases: false,
        qk_norm: false,
        lm_head: false,
    };
    let (g, hf) = model(&spec);
    let m = import(&g).unwrap();
    check_tensors(&m, &hf);
    assert_eq!(m.hf_config["architectures"], json!(["MistralForCausalLM"]));
    assert_eq!(m.hf_config["tie_word_embeddings"], true);

    // Qwen2: biases, no permutation.
    let spec = Spec {
        arch: "qwen2",
        head_dim: 4,
        biases: true,
        qk_norm: false,
        lm_head: false,
    };
    let (g, hf) = model(&spec);
    let m = import(&g).unwrap();
    check_tensors(&m, &hf);
    assert_eq!(m.hf_config["architectures"], json!(["Qwen2ForCausalLM"]));
    assert_eq!(m.hf_config["attention_bias"], true);

    // Qwen3: q/k norms and head_dim (6) ≠ hidden / heads (4).
    let spec = Spec {
        arch: "qwen3",
        head_dim: 6,
        biases: false,
        qk_norm: true,
        lm_head: true,
    };
    let (g, hf) = model(&spec);
    let m = import(&g).unwrap();
    check_tensors(&m, &hf);
    assert_eq!(m.hf_config["architectures"], json!(["Qwen3ForCausalLM"]));
    assert_eq!(m.hf_config["head_dim"], 6);
    assert_eq!(m.hf_config["model_type"], "qwen3");
    let cfg = sfx_formats::ModelConfig::from_hf_json(&m.hf_config, std::path::Path::new("c.json"))
        .unwrap();
    assert!(cfg.qk_norm);
    assert_eq!(cfg.head_dim, 6);
}

#[test]
fn rope_scaling_variants() {
    let spec = Spec {
        arch: "llama",
        head_dim: 4,
        biases: false,
        qk_norm: false,
        lm_head: false,
    };
    let (g, _) = model(&spec);
    let m = import(
        &g.clone()
            .kv("llama.rope.scaling.type", s("linear"))
            .kv("llama.rope.scaling.factor", V::F32(2.0)),
    )
    .unwrap();
    assert_eq!(
        m.hf_config["rope_scaling"],
        json!({"rope_type": "linear", "factor": 2.0})
    );
    let err = import(&g.clone().kv("llama.rope.scaling.type", s("yarn"))).unwrap_err();
    assert!(
        err.contains("rope scaling type 'yarn'") && err.contains("not supported"),
        "{err}"
    );
    // A rope_freqs tensor (llama3 style) with a head_dim of 4 has only 2 frequencies: too
    // few to recover the parameters, which must be an error, not a guess.
    let err = import(&g.clone().f32_tensor("rope_freqs.weight", &[2], &[1.0, 8.0])).unwrap_err();
    assert!(
        err.contains("rope_freqs.weight") && err.contains("cannot be recovered"),
        "{err}"
    );
    // All-ones factors mean no scaling; the tensor is not exported.
    let m = import(&g.f32_tensor("rope_freqs.weight", &[2], &[1.0, 1.0])).unwrap();
    assert_eq!(m.hf_config["rope_scaling"], Value::Null);
    assert!(!m.tensors.contains("rope_freqs.weight"));
}

#[test]
fn incomplete_or_inconsistent_models_are_rejected() {
    let spec = Spec {
        arch: "llama",
        head_dim: 4,
        biases: false,
        qk_norm: false,
        lm_head: false,
    };
    let (g, _) = model(&spec);

    let mut missing = g.clone();
    missing.tensors.retain(|t| t.name != "blk.0.ffn_up.weight");
    let err = import(&missing).unwrap_err();
    assert!(
        err.contains("model.layers.0.mlp.up_proj.weight") && err.contains("missing"),
        "{err}"
    );

    let mut wrong = g.clone();
    let t = wrong
        .tensors
        .iter_mut()
        .find(|t| t.name == "blk.0.attn_k.weight")
        .unwrap();
    t.dims = vec![HIDDEN as u64, 8];
    t.data = vec![0u8; 8 * HIDDEN * 4];
    let err = import(&wrong).unwrap_err();
    assert!(
        err.contains("blk.0.attn_k.weight") && err.contains("does not match"),
        "{err}"
    );

    let err = import(
        &g.clone()
            .f32_tensor("blk.0.ffn_gate_exps.weight", &[1], &[0.0]),
    )
    .unwrap_err();
    assert!(
        err.contains("blk.0.ffn_gate_exps.weight") && err.contains("no Hugging Face"),
        "{err}"
    );

    let err = import(&g.clone().f32_tensor(
        "blk.1.attn_norm.weight",
        &[HIDDEN as u64],
        &[0.0; HIDDEN],
    ))
    .unwrap_err();
    assert!(
        err.contains("blk.1.attn_norm.weight") && err.contains("block_count is 1"),
        "{err}"
    );

    // Found by the `gguf_file` fuzz target (2026-12-05): a block_count of 2^30 with one
    // layer's tensors made the completeness check spell out 2^30 layers' names before
    // looking any up (minutes and gigabytes); it now stops at the first missing one.
    let mut huge_depth = g.clone();
    for (k, v) in huge_depth.kvs.iter_mut() {
        if k == "llama.block_count" {
            *v = V::U32(1 << 30);
        }
    }
    let err = import(&huge_depth).unwrap_err();
    assert!(
        err.contains("model.layers.1.input_layernorm.weight") && err.contains("missing"),
        "{err}"
    );

    let mut no_heads = g.clone();
    no_heads
        .kvs
        .retain(|(k, _)| k != "llama.attention.head_count");
    let err = import(&no_heads).unwrap_err();
    assert!(
        err.contains("'llama.attention.head_count' is missing"),
        "{err}"
    );

    let err = import(&g.clone().kv("llama.rope.dimension_count", V::U32(2))).unwrap_err();
    assert!(err.contains("partial rotary"), "{err}");
}

/// The folder writer streams each tensor in chunks of rows; with chunks of one row (one head
/// of rows for the permuted Q and K) every chunk boundary is crossed, and the BF16 bytes must
/// still be the model's values, rows in Hugging Face order.
#[test]
fn small_model_writes_a_loadable_folder() {
    for (arch, chunk) in [
        ("qwen2", 1 << 24),
        ("llama", 1 << 24),
        ("llama", 1),
        ("llama", 8 * HIDDEN),
    ] {
        let spec = Spec {
            arch,
            head_dim: 4,
            // llama's attention biases come with an o_proj bias this model does not have.
            biases: arch == "qwen2",
            qk_norm: false,
            lm_head: true,
        };
        let (g, hf) = model(&spec);
        let m = import(&g).unwrap();
        let d = tempfile::tempdir().unwrap();
        let gguf = g.write(d.path(), "m.gguf");
        let out = d.path().join("nested/out");
        let mut seen = Vec::new();
        let seen_cell = std::cell::RefCell::new(&mut seen);
        let written = import_gguf_to_folder_in_chunks(&gguf, &out, chunk, |a, b| {
            seen_cell.borrow_mut().push((a, b))
        })
        .unwrap();
        let n = hf.len();
        assert_eq!(seen, (1..=n).map(|i| (i, n)).collect::<Vec<_>>());
        assert_eq!(written.tensors, n);
        let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
        assert_eq!(written.safetensors_bytes, bytes.len() as u64);
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, shape, v) in &hf {
            let t = st.tensor(name).unwrap();
            assert_eq!(t.shape(), shape.as_slice());
            let want: Vec<u8> = v
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect();
            assert_eq!(t.data(), want.as_slice(), "{arch} chunk {chunk}: {name}");
        }
        // Writing again over an existing folder replaces the files atomically.
        import_gguf_to_folder_in_chunks(&gguf, &out, chunk, |_, _| {}).unwrap();
        let cfg: Value =
            serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(cfg, m.hf_config);
        assert_eq!(written.hf_config, m.hf_config);
        assert_eq!(std::fs::read_dir(&out).unwrap().count(), 5);
    }
}

/// A model whose weights are i-quants (the blocks of `tests/fixtures/iq_dequant_reference.json`,
/// repeated to fill each matrix) imports to exactly gguf-py's values, the permuted Q rows
/// included; before IQ4_NL had a decoder one such tensor made the whole file fail. A type
/// still without a decoder fails the import, naming the tensor and the type.
#[test]
fn iq_quantized_weights_import_to_gguf_py_values() {
    const WIDE: usize = 256; // a whole IQ super-block per row
    let spec = Spec {
        arch: "llama",
        head_dim: WIDE / HEADS,
        biases: false,
        qk_norm: false,
        lm_head: true,
    };
    let (mut g, _) = model_sized(&spec, WIDE, WIDE);
    let cases = iq_fixture::cases();
    let case = |name: &str| cases.iter().find(|c| c.ty.name() == name).unwrap();
    let plan = [
        (
            "blk.0.attn_q.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "IQ4_NL",
        ),
        (
            "blk.0.attn_v.weight",
            "model.layers.0.self_attn.v_proj.weight",
            "IQ4_NL",
        ),
        (
            "blk.0.attn_output.weight",
            "model.layers.0.self_attn.o_proj.weight",
            "IQ4_XS",
        ),
        (
            "blk.0.ffn_gate.weight",
            "model.layers.0.mlp.gate_proj.weight",
            "IQ2_XXS",
        ),
        (
            "blk.0.ffn_up.weight",
            "model.layers.0.mlp.up_proj.weight",
            "IQ2_XS",
        ),
        (
            "blk.0.ffn_down.weight",
            "model.layers.0.mlp.down_proj.weight",
            "IQ2_S",
        ),
        ("token_embd.weight", "model.embed_tokens.weight", "IQ3_XXS"),
        ("output.weight", "lm_head.weight", "IQ3_S"),
    ];
    let mut want = Vec::new();
    for (gguf_name, hf_name, ty) in plan {
        let c = case(ty);
        let t = g.tensors.iter_mut().find(|t| t.name == gguf_name).unwrap();
        let n = (t.dims[0] * t.dims[1]) as usize;
        let reps = n.div_ceil(c.n);
        let n_bytes = n / c.ty.block_size() * c.ty.type_size();
        t.ty = c.ty.id();
        t.data = c.blocks.repeat(reps)[..n_bytes].to_vec();
        let mut values = c.want.repeat(reps);
        values.truncate(n);
        want.push((gguf_name, hf_name, values, t.dims[1] as usize));
    }
    let m = import(&g).unwrap();
    for (gguf_name, hf_name, gguf_order, rows) in want {
        let got = m.tensors.tensor(hf_name).unwrap().to_f32_vec();
        // Q rows come back un-permuted: permuting them again gives the file's order.
        let got = if gguf_name.contains("attn_q") {
            permute(&got, rows, WIDE, HEADS)
        } else {
            got
        };
        iq_fixture::assert_bits(gguf_name, &got, &gguf_order);
    }

    // IQ1_S (id 19, 50 bytes per 256 weights) has no decoder yet.
    let t = g
        .tensors
        .iter_mut()
        .find(|t| t.name == "blk.0.ffn_up.weight")
        .unwrap();
    t.ty = 19;
    t.data = vec![0u8; WIDE * WIDE / 256 * 50];
    let err = import(&g).unwrap_err();
    for part in ["blk.0.ffn_up.weight", "IQ1_S", "not supported", "IQ4_NL"] {
        assert!(err.contains(part), "{part:?} missing from: {err}");
    }
}

/// Writes this file's one-layer Llama model (tokenizer included) as the seed of the
/// `gguf_file` fuzz target: `SFX_WRITE_FUZZ_SEEDS=1 cargo test -p sfx-formats --test
/// gguf_import -- --ignored fuzz_seed`.
#[test]
#[ignore = "writes fuzz/seeds; run by hand"]
fn fuzz_seed() {
    if std::env::var("SFX_WRITE_FUZZ_SEEDS").as_deref() != Ok("1") {
        return;
    }
    let spec = Spec {
        arch: "llama",
        head_dim: 8,
        biases: false,
        qk_norm: false,
        lm_head: true,
    };
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/gguf_file");
    std::fs::create_dir_all(&dir).unwrap();
    let (g, hf) = model(&spec);
    let path = g.write(&dir, "llama-one-layer.gguf");
    // The seed is a file the importer takes, so the fuzzer starts from the deep paths.
    let gguf = sfx_formats::gguf::GgufFile::open(&path).unwrap();
    check_tensors(&sfx_formats::gguf::import_from_gguf(&gguf).unwrap(), &hf);
}

//! The tokenizer rebuilt from GGUF metadata: the real SmolLM2 tokenizer against the golden
//! ids made with transformers (with llama.cpp's "smollm" digit split), and the pre-tokenizer
//! wiring of every supported `tokenizer.ggml.pre` on a synthetic vocabulary.

#[path = "common/assets.rs"]
mod assets;

#[path = "common/gguf_writer.rs"]
mod gguf_writer;

use gguf_writer::{s, tiny_tokenizer, V};
use serde_json::Value;
use sfx_formats::gguf::{tokenizer_from_gguf, GgufFile};
use std::path::Path;
use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

fn golden() -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/golden_smollm2.json");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn golden_prompts_tokenize_exactly_and_round_trip() {
    let path = assets::smollm2_gguf();
    let gold = golden();
    let g = GgufFile::open(&path).unwrap();
    let tok = tokenizer_from_gguf(&g).unwrap().tokenizer;
    let prompts = gold["prompts"].as_array().unwrap();
    assert!(!prompts.is_empty());
    for p in prompts {
        let name = p["name"].as_str().unwrap();
        let text = p["text"].as_str().unwrap();
        let enc = tok.encode(text, false).unwrap();
        assert_eq!(
            enc.get_ids(),
            u32s(&p["ids"]).as_slice(),
            "prompt '{name}' ids"
        );
        let tokens: Vec<&str> = p["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect();
        assert_eq!(
            enc.get_tokens(),
            tokens.as_slice(),
            "prompt '{name}' tokens"
        );
        if p["decode_roundtrip"].as_bool() == Some(true) {
            assert_eq!(
                tok.decode(enc.get_ids(), false).unwrap(),
                text,
                "prompt '{name}' decode"
            );
        }
    }
    // Without llama.cpp's digit split (transformers' own GGUF conversion), digits tokenize
    // differently: the golden file records that too, and we must not match it.
    if let Some(unpatched) = gold["unpatched_transformers_tokenizer_ids"]["digits"].as_array() {
        let digits = prompts.iter().find(|p| p["name"] == "digits").unwrap();
        let ours = tok.encode(digits["text"].as_str().unwrap(), false).unwrap();
        let unpatched: Vec<u32> = unpatched
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        assert_ne!(ours.get_ids(), unpatched.as_slice());
    }
}

#[test]
fn real_model_special_tokens_and_configs() {
    let path = assets::smollm2_gguf();
    let g = GgufFile::open(&path).unwrap();
    let t = tokenizer_from_gguf(&g).unwrap();
    assert_eq!(t.special.bos, Some(1));
    assert_eq!(t.special.eos, Some(2));
    assert!(!t.special.add_bos);
    let tok = &t.tokenizer;
    assert_eq!(tok.get_vocab_size(true), 49152);
    // Control tokens are matched whole and are special.
    let enc = tok.encode("<|im_start|>user\nHi<|im_end|>", false).unwrap();
    assert_eq!(enc.get_ids()[0], 1);
    assert_eq!(*enc.get_ids().last().unwrap(), 2);
    assert_eq!(tok.decode(enc.get_ids(), true).unwrap(), "user\nHi");
    // No BOS is added.
    assert_eq!(
        tok.encode("Hi", true).unwrap().get_ids(),
        tok.encode("Hi", false).unwrap().get_ids()
    );
    // The serialized tokenizer.json reloads to an identical tokenizer.
    let reloaded: tokenizers::Tokenizer = t.tokenizer_json.parse().unwrap();
    let text = "Reloaded: 3.14 — naïve <|im_end|>";
    assert_eq!(
        reloaded.encode(text, false).unwrap().get_ids(),
        tok.encode(text, false).unwrap().get_ids()
    );
    assert_eq!(
        t.tokenizer_config["added_tokens_decoder"]["1"]["content"],
        "<|im_start|>"
    );
    assert_eq!(
        t.tokenizer_config["added_tokens_decoder"]["1"]["special"],
        true
    );
    assert_eq!(t.tokenizer_config["clean_up_tokenization_spaces"], false);
}

/// How the tokenizer's pre-tokenizer splits `text` (byte-level symbols, e.g. Ġ for space).
fn pieces(tok: &tokenizers::Tokenizer, text: &str) -> Vec<String> {
    let mut pts = PreTokenizedString::from(text);
    tok.get_pre_tokenizer()
        .unwrap()
        .pre_tokenize(&mut pts)
        .unwrap();
    pts.get_splits(OffsetReferential::Original, OffsetType::Byte)
        .into_iter()
        .map(|(s, _, _)| s.to_string())
        .collect()
}

fn build(g: gguf_writer::GgufBuilder) -> Result<sfx_formats::gguf::GgufTokenizer, String> {
    let d = tempfile::tempdir().unwrap();
    let f = GgufFile::open(g.write(d.path(), "tok.gguf")).unwrap();
    tokenizer_from_gguf(&f).map_err(|e| e.to_string())
}

#[test]
fn pre_tokenizers_split_like_llama_cpp() {
    let text = "Hello world 12345 it's";
    let cases: [(Option<&str>, &[&str]); 6] = [
        (
            Some("smollm"),
            &["Hello", "Ġworld", "Ġ", "1", "2", "3", "4", "5", "Ġit", "'s"],
        ),
        (Some("gpt2"), &["Hello", "Ġworld", "Ġ12345", "Ġit", "'s"]),
        (
            Some("llama-bpe"),
            &["Hello", "Ġworld", "Ġ", "123", "45", "Ġit", "'s"],
        ),
        (
            Some("qwen2"),
            &["Hello", "Ġworld", "Ġ", "1", "2", "3", "4", "5", "Ġit", "'s"],
        ),
        // llama.cpp's default: punctuation first, then GPT-2, then digit runs, then triples.
        (
            Some("default"),
            &["Hello", "Ġworld", "Ġ", "123", "45", "Ġit", "'", "s"],
        ),
        (
            None,
            &["Hello", "Ġworld", "Ġ", "123", "45", "Ġit", "'", "s"],
        ),
    ];
    for (pre, want) in cases {
        let t = build(tiny_tokenizer(pre, &[])).unwrap();
        assert_eq!(pieces(&t.tokenizer, text), want, "pre-tokenizer {pre:?}");
    }
    // Llama-3 and Qwen2 keep newlines apart from letters; contractions case-insensitive.
    let t = build(tiny_tokenizer(Some("llama-bpe"), &[])).unwrap();
    assert_eq!(
        pieces(&t.tokenizer, "A\n\nB IT'S"),
        ["A", "ĊĊ", "B", "ĠIT", "'S"]
    );
    // Qwen2 normalizes to NFC: "e" + combining acute becomes "é" (two UTF-8 bytes, Ã©).
    let t = build(tiny_tokenizer(Some("qwen2"), &[])).unwrap();
    let enc = t.tokenizer.encode("e\u{301}", false).unwrap();
    assert_eq!(enc.get_tokens(), ["Ã", "©"]);
}

#[test]
fn merges_added_tokens_and_bos() {
    let merges = [("Ġ", "w"), ("Ġw", "o"), ("l", "o")];
    let t = build(tiny_tokenizer(Some("gpt2"), &merges)).unwrap();
    let enc = t.tokenizer.encode("lo wo<tool>x</s>", false).unwrap();
    // 259.. are the merged tokens: "Ġw" 259, "Ġwo" 260, "lo" 261; <tool> 258, </s> 257.
    assert_eq!(enc.get_ids(), [261, 260, 258, b'x' as u32, 257]);
    // Control tokens are special (dropped when skipping), user-defined ones are not.
    assert_eq!(
        t.tokenizer.decode(enc.get_ids(), true).unwrap(),
        "lo wo<tool>x"
    );
    assert!(!t.special.add_bos);

    // add_bos_token / add_eos_token → a template post-processor.
    let g = tiny_tokenizer(Some("gpt2"), &merges)
        .kv("tokenizer.ggml.add_bos_token", V::Bool(true))
        .kv("tokenizer.ggml.add_eos_token", V::Bool(true));
    let t = build(g).unwrap();
    let ids = t.tokenizer.encode("lo", true).unwrap().get_ids().to_vec();
    assert_eq!(ids, [256, 261, 257]);
    assert_eq!(t.tokenizer.encode("lo", false).unwrap().get_ids(), [261]);
    assert_eq!(t.tokenizer_config["add_bos_token"], true);
    // llama-bpe adds BOS by default when the key is absent, as llama.cpp does.
    let t = build(tiny_tokenizer(Some("llama-bpe"), &merges)).unwrap();
    assert_eq!(
        t.tokenizer.encode("lo", true).unwrap().get_ids(),
        [256, 261]
    );
    // End-of-turn distinct from EOS → generation_config lists both.
    let t = build(tiny_tokenizer(Some("gpt2"), &[]).kv("tokenizer.ggml.eot_token_id", V::U32(258)))
        .unwrap();
    assert_eq!(
        t.generation_config["eos_token_id"],
        serde_json::json!([257, 258])
    );
}

#[test]
fn tokenizer_errors_name_the_problem() {
    let err = build(tiny_tokenizer(Some("deepseek-coder"), &[])).unwrap_err();
    assert!(
        err.contains("tokenizer.ggml.pre 'deepseek-coder' is not supported"),
        "{err}"
    );
    let mut g = tiny_tokenizer(Some("gpt2"), &[]);
    g.kvs.retain(|(k, _)| k != "tokenizer.ggml.model");
    let err = build(g.kv("tokenizer.ggml.model", s("bert"))).unwrap_err();
    assert!(
        err.contains("tokenizer.ggml.model 'bert' (WordPiece) is not supported"),
        "{err}"
    );
    let err = build(
        tiny_tokenizer(Some("gpt2"), &[]).kv("tokenizer.ggml.padding_token_id", V::U32(100_000)),
    )
    .unwrap_err();
    assert!(
        err.contains("tokenizer.ggml.padding_token_id") && err.contains("outside the vocabulary"),
        "{err}"
    );
    let mut g = tiny_tokenizer(Some("gpt2"), &[]);
    g.kvs.retain(|(k, _)| k != "tokenizer.ggml.merges");
    let err = build(g).unwrap_err();
    assert!(err.contains("'tokenizer.ggml.merges' is missing"), "{err}");
    let mut g = tiny_tokenizer(Some("gpt2"), &[]);
    g.kvs.retain(|(k, _)| k != "tokenizer.ggml.bos_token_id");
    let err = build(g.kv("tokenizer.ggml.bos_token_id", s("1"))).unwrap_err();
    assert!(
        err.contains("tokenizer.ggml.bos_token_id") && err.contains("has type string"),
        "{err}"
    );
    // A merge whose result is not in the vocabulary.
    let mut g = tiny_tokenizer(Some("gpt2"), &[]);
    g.kvs.retain(|(k, _)| k != "tokenizer.ggml.merges");
    let err = build(g.kv("tokenizer.ggml.merges", gguf_writer::str_arr(&["a b"]))).unwrap_err();
    assert!(err.contains("building the BPE tokenizer failed"), "{err}");
}

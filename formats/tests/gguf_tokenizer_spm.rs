//! SentencePiece (`tokenizer.ggml.model = "llama"`) vocabularies: the real Llama-2 vocabulary of
//! llama.cpp's vocab-only `ggml-vocab-llama-spm.gguf` (an asset: `scripts/fetch_assets.sh`) against the ids `sentencepiece` (and, for text that
//! holds special-token strings, transformers' legacy Llama tokenizer) gives, from
//! `tests/fixtures/spm_llama_reference.json` (scripts/golden/make_spm_fixtures.py); and the
//! metadata switches on a hand-made vocabulary.

#[path = "common/assets.rs"]
mod assets;

#[path = "common/gguf_writer.rs"]
mod gguf_writer;

use gguf_writer::{i32_arr, s, str_arr, GgufBuilder, V};
use serde_json::Value;
use sfx_formats::corpus;
use sfx_formats::gguf::{tokenizer_from_gguf, GgufFile, GgufTokenizer};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use tokenizers::Tokenizer;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

fn reference() -> Value {
    let p = fixtures().join("spm_llama_reference.json");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap()
}

/// The vocabulary GGUF, fetched with the other assets (a third party's file: not committed).
fn llama_spm_gguf() -> PathBuf {
    assets::asset("vocab/ggml-vocab-llama-spm.gguf")
}

fn llama_spm() -> GgufTokenizer {
    let g = GgufFile::open(llama_spm_gguf()).unwrap();
    tokenizer_from_gguf(&g).unwrap()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn sha256_ids(ids: &[u32]) -> String {
    let mut h = Sha256::new();
    for id in ids {
        h.update(id.to_le_bytes());
    }
    format!("{:x}", h.finalize())
}

/// Every reference text: ids (BOS first) and the decoded text, with the tokenizer as built and as
/// `sfx-run` gets it (the serialized tokenizer.json parsed again).
#[test]
fn llama_vocab_encodes_like_sentencepiece() {
    let reference = reference();
    let t = llama_spm();
    let gguf = std::fs::read(llama_spm_gguf()).unwrap();
    assert_eq!(
        format!("{:x}", Sha256::digest(&gguf)),
        reference["gguf_sha256"].as_str().unwrap(),
        "the fixture was made from another GGUF"
    );
    assert_eq!(t.tokenizer.get_vocab_size(true), 32000);
    let reloaded = Tokenizer::from_str(&t.tokenizer_json).unwrap();
    let texts = reference["texts"].as_array().unwrap();
    assert!(texts.len() > 70, "{} texts", texts.len());
    let mut failures = Vec::new();
    for (which, tok) in [("built", &t.tokenizer), ("reloaded", &reloaded)] {
        for r in texts {
            let name = r["name"].as_str().unwrap();
            let text = r["text"].as_str().unwrap();
            let want = u32s(&r["ids"]);
            let enc = tok.encode(text, true).unwrap();
            if enc.get_ids() != want.as_slice() {
                failures.push(format!(
                    "{which} {name} {text:?}: ids {:?}, reference {want:?} ({})",
                    enc.get_ids(),
                    r["reference"]
                ));
                continue;
            }
            let decoded = tok.decode(&want, true).unwrap();
            if decoded != r["decoded"].as_str().unwrap() {
                failures.push(format!(
                    "{which} {name}: decoded {decoded:?}, reference {:?}",
                    r["decoded"]
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} mismatches:\n{}",
        failures.len(),
        2 * texts.len(),
        failures.join("\n")
    );
}

/// The canonical texts (about 9 MB): id count, ids digest (by chunk, to point at the first
/// difference) and the decoded text, with the tokenizer as `sfx-run` loads it.
#[test]
fn llama_vocab_encodes_canonical_texts_like_sentencepiece() {
    let reference = reference();
    let tok = Tokenizer::from_str(&llama_spm().tokenizer_json).unwrap();
    let assets = corpus::assets_dir();
    assert!(
        assets.join("wiki").is_dir() && assets.join("austen").is_dir(),
        "assets not found at {}: run scripts/fetch_assets.sh (make test does)",
        assets.display()
    );
    let canonical = reference["canonical"].as_object().unwrap();
    assert_eq!(canonical.len(), 7);
    let mut failures = Vec::new();
    for (name, r) in canonical {
        let source = if name == "wiki" {
            name.clone()
        } else {
            format!("austen/{name}")
        };
        let text = corpus::load_named_text(&assets, &source).unwrap();
        assert_eq!(
            format!("{:x}", Sha256::digest(text.as_bytes())),
            r["text_sha256"].as_str().unwrap(),
            "{name}: not the text the reference encoded"
        );
        let ids = tok.encode(text.as_str(), true).unwrap().get_ids().to_vec();
        if sha256_ids(&ids) != r["ids_sha256"].as_str().unwrap() {
            let chunk = r["chunk"].as_u64().unwrap() as usize;
            let first_bad = ids
                .chunks(chunk)
                .zip(r["chunk_sha256"].as_array().unwrap())
                .position(|(c, want)| sha256_ids(c) != want.as_str().unwrap());
            failures.push(format!(
                "{name}: {} ids (reference {}); first differing chunk of {chunk}: {first_bad:?}; \
                 head equal: {}, tail equal: {}",
                ids.len(),
                r["n_ids"],
                ids[..64.min(ids.len())] == u32s(&r["head"])[..],
                ids[ids.len().saturating_sub(64)..] == u32s(&r["tail"])[..],
            ));
            continue;
        }
        let decoded = tok.decode(&ids, true).unwrap();
        let decoded_sha = format!("{:x}", Sha256::digest(decoded.as_bytes()));
        if decoded_sha != r["decoded_sha256"].as_str().unwrap() {
            failures.push(format!("{name}: decoded text differs from the reference's"));
        }
        assert_eq!(
            decoded == text,
            r["decoded_equals_text"].as_bool().unwrap(),
            "{name}: round trip"
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn llama_vocab_special_tokens_and_configs() {
    let t = llama_spm();
    assert_eq!(t.special.bos, Some(1));
    assert_eq!(t.special.eos, Some(2));
    assert_eq!(t.special.unk, Some(0));
    assert!(t.special.add_bos && !t.special.add_eos);
    assert_eq!(t.tokenizer_config["bos_token"], "<s>");
    assert_eq!(t.tokenizer_config["unk_token"], "<unk>");
    assert_eq!(t.tokenizer_config["add_bos_token"], true);
    assert_eq!(t.tokenizer_config["clean_up_tokenization_spaces"], false);
    assert_eq!(t.tokenizer_config["model_max_length"], 4096);
    assert_eq!(
        t.tokenizer_config["added_tokens_decoder"]["2"]["special"],
        true
    );
    assert_eq!(t.generation_config["eos_token_id"], 2);
    // Byte pieces are ordinary vocabulary entries reached by byte fallback, not added tokens.
    assert!(t.tokenizer_config["added_tokens_decoder"]
        .get("3")
        .is_none());
    let json: Value = serde_json::from_str(&t.tokenizer_json).unwrap();
    assert_eq!(json["model"]["byte_fallback"], true);
    assert_eq!(json["model"]["unk_token"], "<unk>");
    // Without special tokens: no BOS; skip_special_tokens=false keeps "<s>" in the text.
    let tok = &t.tokenizer;
    assert_eq!(tok.encode("Hi", false).unwrap().get_ids(), [6324]);
    assert_eq!(tok.decode(&[1, 6324], false).unwrap(), "<s> Hi");
}

/// A hand-made SentencePiece vocabulary: pieces and scores chosen so the result can be worked
/// out by hand (see the unit tests of the merge derivation).
fn tiny_spm() -> GgufBuilder {
    let pieces: [(&str, f32, i32); 13] = [
        ("<unk>", 0.0, 2),
        ("<s>", 0.0, 3),
        ("</s>", 0.0, 3),
        ("<0x0A>", 0.0, 6),
        ("▁", -100.0, 1),
        ("a", -101.0, 1),
        ("b", -102.0, 1),
        ("c", -103.0, 1),
        ("ab", -5.0, 1),
        ("bc", -2.0, 1),
        ("abc", -1.0, 1),
        ("▁a", -7.0, 1),
        ("▁▁", -1e9, 1),
    ];
    let tokens: Vec<&str> = pieces.iter().map(|p| p.0).collect();
    let scores = V::Arr(6, pieces.iter().map(|p| V::F32(p.1)).collect());
    let types: Vec<i32> = pieces.iter().map(|p| p.2).collect();
    GgufBuilder::new()
        .kv("general.architecture", s("llama"))
        .kv("tokenizer.ggml.model", s("llama"))
        .kv("tokenizer.ggml.tokens", str_arr(&tokens))
        .kv("tokenizer.ggml.scores", scores)
        .kv("tokenizer.ggml.token_type", i32_arr(&types))
}

fn build(g: GgufBuilder) -> Result<GgufTokenizer, String> {
    let d = tempfile::tempdir().unwrap();
    let f = GgufFile::open(g.write(d.path(), "tok.gguf")).unwrap();
    tokenizer_from_gguf(&f).map_err(|e| e.to_string())
}

fn without(mut g: GgufBuilder, key: &str) -> GgufBuilder {
    g.kvs.retain(|(k, _)| k != key);
    g
}

fn ids(t: &GgufTokenizer, text: &str) -> Vec<u32> {
    t.tokenizer.encode(text, true).unwrap().get_ids().to_vec()
}

#[test]
fn tiny_vocab_merges_by_score_with_llama_cpp_defaults() {
    // No bos/eos/unk ids and no add_bos_token in the file: 1/2/0 and BOS, as llama.cpp.
    let t = build(tiny_spm()).unwrap();
    assert_eq!(
        (t.special.bos, t.special.eos, t.special.unk),
        (Some(1), Some(2), Some(0))
    );
    // "▁abc": of ▁a (-7), ab (-5) and bc (-2), bc joins first, then a+bc = abc (-1).
    assert_eq!(ids(&t, "abc"), [1, 4, 10]);
    // "▁ab▁c": ab (-5) beats ▁a (-7), and nothing joins "ab" to its neighbours.
    assert_eq!(ids(&t, "ab c"), [1, 4, 8, 4, 7]);
    // "▁▁▁a": ▁a (-7) before any ▁▁ (-1e9), then the first two ▁ join.
    assert_eq!(ids(&t, "  a"), [1, 12, 11]);
    // No piece for "d" and no byte piece <0x64> either: the unknown piece; "\n" has its byte
    // piece. (Not both in one text: `tokenizers` then emits the byte before the pending unknown.)
    assert_eq!(ids(&t, "d"), [1, 4, 0]);
    assert_eq!(ids(&t, "\n"), [1, 4, 3]);
    assert_eq!(t.tokenizer.decode(&ids(&t, "ab c"), true).unwrap(), "ab c");
    assert_eq!(t.tokenizer.decode(&ids(&t, " a\n"), true).unwrap(), " a\n");
}

#[test]
fn tiny_vocab_metadata_switches() {
    let g = tiny_spm()
        .kv("tokenizer.ggml.add_bos_token", V::Bool(false))
        .kv("tokenizer.ggml.add_eos_token", V::Bool(true))
        .kv("tokenizer.ggml.add_space_prefix", V::Bool(false));
    let t = build(g).unwrap();
    // No "▁" prefix, EOS instead of BOS, and decoding strips no space.
    assert_eq!(ids(&t, "abc"), [10, 2]);
    assert_eq!(ids(&t, " abc"), [4, 10, 2]);
    assert_eq!(t.tokenizer.decode(&[4, 10], true).unwrap(), " abc");
    assert_eq!(t.tokenizer_config["add_bos_token"], false);

    // Without scores the vocabulary order ranks the merges (the unit tests check the order).
    let t = build(without(tiny_spm(), "tokenizer.ggml.scores")).unwrap();
    assert_eq!(ids(&t, "abc"), [1, 4, 10]);
    assert_eq!(ids(&t, "ab c"), [1, 4, 8, 4, 7]);
}

#[test]
fn tiny_vocab_errors_name_the_problem() {
    let short = V::Arr(6, vec![V::F32(0.0); 3]);
    let err =
        build(without(tiny_spm(), "tokenizer.ggml.scores").kv("tokenizer.ggml.scores", short))
            .unwrap_err();
    assert!(
        err.contains("tokenizer.ggml.scores") && err.contains("3 entries for 13 tokens"),
        "{err}"
    );
    let err = build(
        without(tiny_spm(), "tokenizer.ggml.scores")
            .kv("tokenizer.ggml.scores", str_arr(&["x"; 13])),
    )
    .unwrap_err();
    assert!(
        err.contains("tokenizer.ggml.scores") && err.contains("array of f32"),
        "{err}"
    );
    let err = build(tiny_spm().kv("tokenizer.ggml.bos_token_id", V::U32(13))).unwrap_err();
    assert!(
        err.contains("tokenizer.ggml.bos_token_id") && err.contains("outside the vocabulary"),
        "{err}"
    );
    for model in ["bert", "t5", "rwkv"] {
        let g = without(tiny_spm(), "tokenizer.ggml.model").kv("tokenizer.ggml.model", s(model));
        let err = build(g).unwrap_err();
        assert!(
            err.contains(&format!("tokenizer.ggml.model '{model}'"))
                && err.contains("is not supported"),
            "{err}"
        );
    }
}

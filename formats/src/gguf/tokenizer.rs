//! A Hugging Face `tokenizers` tokenizer (and `tokenizer_config.json` /
//! `generation_config.json`) rebuilt from a GGUF's embedded `tokenizer.ggml.*` metadata.
//!
//! Supported: `tokenizer.ggml.model = "gpt2"` (byte-level BPE) with the pre-tokenizers below,
//! each expressed with the same regexes llama.cpp's `llm_tokenizer_bpe` uses for it
//! (llama.cpp applies its regex list in sequence, each splitting the pieces of the previous
//! one and keeping unmatched text as pieces: exactly `Split(..., "Isolated")` in a
//! `Sequence`). SentencePiece (`"llama"`) and other vocab types are rejected with a clear
//! error.
//!
//! | `tokenizer.ggml.pre`                  | pre-tokenizer                                            |
//! |---------------------------------------|----------------------------------------------------------|
//! | `smollm`                              | `\p{N}` isolated, then GPT-2 byte-level regex            |
//! | `gpt2`, `gpt-2`                       | GPT-2 byte-level regex                                   |
//! | `llama-bpe`, `llama3`, `llama-v3`     | Llama-3 regex, byte-level without regex; ignore_merges   |
//! | `qwen2`                               | Qwen2 regex (single digits), byte-level without regex; NFC |
//! | `default` or absent                   | llama.cpp's default list of four regexes                 |

use super::{GgufError, GgufFile};
use serde_json::{json, Map, Value};
use tokenizers::Tokenizer;

/// GGUF token types (`llama_token_type`).
pub mod token_type {
    pub const NORMAL: i64 = 1;
    pub const UNKNOWN: i64 = 2;
    pub const CONTROL: i64 = 3;
    pub const USER_DEFINED: i64 = 4;
    pub const UNUSED: i64 = 5;
    pub const BYTE: i64 = 6;
}

/// GPT-2's regex, as the `ByteLevel` pre-tokenizer applies it with `use_regex: true`.
const GPT2_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
/// llama.cpp's Llama-3 regex (the original's `(?i:...)` contractions spelled out).
const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// llama.cpp's Qwen2 regex: as Llama-3 but one digit per piece.
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// llama.cpp's fallback list for `default` (and for files without `tokenizer.ggml.pre`).
const DEFAULT_REGEXES: [&str; 4] = [
    r"[\p{P}\$\+<=>\^~\|]+",
    GPT2_REGEX,
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
];

/// The tokenizer pieces rebuilt from a GGUF.
#[derive(Clone)]
pub struct GgufTokenizer {
    pub tokenizer: Tokenizer,
    /// `tokenizer.json`, as `tokenizers` serializes `tokenizer` (vocab in id order).
    pub tokenizer_json: String,
    pub tokenizer_config: Value,
    pub generation_config: Value,
    pub special: SpecialTokens,
}

impl std::fmt::Debug for GgufTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufTokenizer")
            .field("vocab_size", &self.tokenizer.get_vocab_size(true))
            .field("special", &self.special)
            .finish()
    }
}

/// Special token ids from `tokenizer.ggml.*_token_id`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// End-of-turn (e.g. Llama-3's `<|eot_id|>`), when distinct from `eos`.
    pub eot: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
}

/// How a `tokenizer.ggml.pre` value is expressed in `tokenizer.json`.
struct PreTokenizerSpec {
    pre_tokenizer: Value,
    normalizer: Value,
    ignore_merges: bool,
    /// llama.cpp's default for `add_bos` when `tokenizer.ggml.add_bos_token` is absent.
    default_add_bos: bool,
    clean_up_tokenization_spaces: bool,
}

fn split_isolated(regex: &str) -> Value {
    json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false})
}

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn pre_tokenizer_spec(pre: &str) -> Result<PreTokenizerSpec, GgufError> {
    let spec =
        |pre_tokenizer, normalizer, ignore_merges, default_add_bos, clean| PreTokenizerSpec {
            pre_tokenizer,
            normalizer,
            ignore_merges,
            default_add_bos,
            clean_up_tokenization_spaces: clean,
        };
    Ok(match pre {
        "smollm" => spec(
            json!({"type": "Sequence", "pretokenizers": [split_isolated(r"\p{N}"), byte_level(true)]}),
            Value::Null,
            false,
            false,
            false,
        ),
        "gpt2" | "gpt-2" => spec(byte_level(true), Value::Null, false, false, true),
        "llama-bpe" | "llama3" | "llama-v3" => spec(
            json!({"type": "Sequence", "pretokenizers": [split_isolated(LLAMA3_REGEX), byte_level(false)]}),
            Value::Null,
            true,
            true,
            true,
        ),
        "qwen2" => spec(
            json!({"type": "Sequence", "pretokenizers": [split_isolated(QWEN2_REGEX), byte_level(false)]}),
            json!({"type": "NFC"}),
            false,
            false,
            false,
        ),
        "default" => {
            let mut seq: Vec<Value> = DEFAULT_REGEXES.iter().map(|r| split_isolated(r)).collect();
            seq.push(byte_level(false));
            spec(
                json!({"type": "Sequence", "pretokenizers": seq}),
                Value::Null,
                false,
                false,
                true,
            )
        }
        other => {
            return Err(GgufError::Tokenizer(format!(
                "tokenizer.ggml.pre '{other}' is not supported \
                 (supported: smollm, gpt2, llama-bpe/llama3, qwen2, default)"
            )))
        }
    })
}

/// Builds the tokenizer, `tokenizer_config.json` and `generation_config.json` from `gguf`.
pub fn tokenizer_from_gguf(gguf: &GgufFile) -> Result<GgufTokenizer, GgufError> {
    let model = gguf.get_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        let what = match model {
            "llama" => " (SentencePiece)",
            "bert" => " (WordPiece)",
            "t5" => " (Unigram)",
            _ => "",
        };
        return Err(GgufError::Tokenizer(format!(
            "tokenizer.ggml.model '{model}'{what} is not supported; only 'gpt2' (byte-level BPE)"
        )));
    }
    let pre = gguf.opt_str("tokenizer.ggml.pre")?.unwrap_or("default");
    let spec = pre_tokenizer_spec(pre)?;

    let tokens = gguf.get_str_array("tokenizer.ggml.tokens")?;
    if tokens.is_empty() {
        return Err(GgufError::Tokenizer(
            "tokenizer.ggml.tokens is empty".into(),
        ));
    }
    let n = tokens.len();
    let types = match gguf.get("tokenizer.ggml.token_type") {
        None => vec![token_type::NORMAL; n],
        Some(_) => gguf.get_int_array("tokenizer.ggml.token_type")?,
    };
    if types.len() != n {
        return Err(GgufError::Tokenizer(format!(
            "tokenizer.ggml.token_type has {} entries for {n} tokens",
            types.len()
        )));
    }
    let merges_raw = gguf.get_str_array("tokenizer.ggml.merges")?;

    let id_key = |key: &str| -> Result<Option<u32>, GgufError> {
        match gguf.opt_u32(key)? {
            Some(id) if id as usize >= n => Err(GgufError::metadata(
                key,
                format!("token id {id} is outside the vocabulary of {n} tokens"),
            )),
            other => Ok(other),
        }
    };
    let mut special = SpecialTokens {
        bos: id_key("tokenizer.ggml.bos_token_id")?,
        eos: id_key("tokenizer.ggml.eos_token_id")?,
        eot: id_key("tokenizer.ggml.eot_token_id")?,
        unk: id_key("tokenizer.ggml.unknown_token_id")?,
        pad: id_key("tokenizer.ggml.padding_token_id")?,
        add_bos: gguf
            .opt_bool("tokenizer.ggml.add_bos_token")?
            .unwrap_or(spec.default_add_bos),
        add_eos: gguf
            .opt_bool("tokenizer.ggml.add_eos_token")?
            .unwrap_or(false),
    };
    if special.eot == special.eos {
        special.eot = None;
    }
    if special.add_bos && special.bos.is_none() {
        return Err(GgufError::Tokenizer(
            "tokenizer.ggml.add_bos_token is true but there is no bos_token_id".into(),
        ));
    }
    if special.add_eos && special.eos.is_none() {
        return Err(GgufError::Tokenizer(
            "tokenizer.ggml.add_eos_token is true but there is no eos_token_id".into(),
        ));
    }

    // Vocabulary: token string → id. A duplicated string keeps its first id (the later
    // duplicate can never be produced by BPE anyway).
    let mut vocab = Map::with_capacity(n);
    for (id, tok) in tokens.iter().enumerate() {
        if !vocab.contains_key(tok) {
            vocab.insert(tok.clone(), json!(id));
        }
    }
    // Merges "a b": split at the first space after the first byte, as llama.cpp does (a
    // byte-level token never contains a real space, but the left part may itself be " ").
    let mut merges = Vec::with_capacity(merges_raw.len());
    for (i, m) in merges_raw.iter().enumerate() {
        let split = m
            .char_indices()
            .skip(1)
            .find(|&(_, c)| c == ' ')
            .map(|(p, _)| p)
            .ok_or_else(|| {
                GgufError::Tokenizer(format!("merge #{i} {m:?} has no space separator"))
            })?;
        merges.push(json!([&m[..split], &m[split + 1..]]));
    }

    // Control and user-defined tokens are matched in raw text before pre-tokenization, as
    // llama.cpp does; control (and unknown) tokens are "special" (skipped when decoding with
    // skip_special_tokens, like the original Hugging Face tokenizer's special tokens).
    let mut added = Vec::new();
    let mut added_decoder = Map::new();
    for (id, (&ty, tok)) in types.iter().zip(tokens).enumerate() {
        let is_special = match ty {
            token_type::CONTROL | token_type::UNKNOWN => true,
            token_type::USER_DEFINED => false,
            _ => continue,
        };
        let entry = json!({
            "id": id, "content": tok, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": is_special,
        });
        added_decoder.insert(
            id.to_string(),
            json!({
                "content": tok, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": is_special,
            }),
        );
        added.push(entry);
    }

    let mut processors = vec![
        json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true}),
    ];
    if special.add_bos || special.add_eos {
        processors.push(template_processor(tokens, &special));
    }
    let post_processor = if processors.len() == 1 {
        processors.pop().expect("one element")
    } else {
        json!({"type": "Sequence", "processors": processors})
    };

    let tokenizer_value = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": spec.normalizer,
        "pre_tokenizer": spec.pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": spec.ignore_merges,
            "vocab": vocab,
            "merges": merges,
        },
    });
    let tokenizer: Tokenizer = serde_json::from_value(tokenizer_value)
        .map_err(|e| GgufError::Tokenizer(format!("building the BPE tokenizer failed: {e}")))?;
    let tokenizer_json = tokenizer
        .to_string(false)
        .map_err(|e| GgufError::Tokenizer(format!("serializing tokenizer.json failed: {e}")))?;

    let tok_str = |id: Option<u32>| id.map(|i| tokens[i as usize].clone());
    let mut config = Map::new();
    config.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    config.insert("add_bos_token".into(), json!(special.add_bos));
    config.insert("add_eos_token".into(), json!(special.add_eos));
    config.insert("bos_token".into(), json!(tok_str(special.bos)));
    config.insert("eos_token".into(), json!(tok_str(special.eos)));
    config.insert("unk_token".into(), json!(tok_str(special.unk)));
    if special.pad.is_some() {
        config.insert("pad_token".into(), json!(tok_str(special.pad)));
    }
    config.insert(
        "clean_up_tokenization_spaces".into(),
        json!(spec.clean_up_tokenization_spaces),
    );
    if let Some(ctx) = context_length(gguf)? {
        config.insert("model_max_length".into(), json!(ctx));
    }
    if let Some(t) = gguf.opt_str("tokenizer.chat_template")? {
        config.insert("chat_template".into(), json!(t));
    }
    config.insert("added_tokens_decoder".into(), Value::Object(added_decoder));

    let mut generation = Map::new();
    if let Some(b) = special.bos {
        generation.insert("bos_token_id".into(), json!(b));
    }
    match (special.eos, special.eot) {
        (Some(e), Some(t)) => generation.insert("eos_token_id".into(), json!([e, t])),
        (Some(e), None) => generation.insert("eos_token_id".into(), json!(e)),
        (None, Some(t)) => generation.insert("eos_token_id".into(), json!(t)),
        (None, None) => None,
    };
    if let Some(p) = special.pad {
        generation.insert("pad_token_id".into(), json!(p));
    }

    Ok(GgufTokenizer {
        tokenizer,
        tokenizer_json,
        tokenizer_config: Value::Object(config),
        generation_config: Value::Object(generation),
        special,
    })
}

/// `{arch}.context_length`, when the file names its architecture.
fn context_length(gguf: &GgufFile) -> Result<Option<u64>, GgufError> {
    match gguf.opt_str("general.architecture")? {
        Some(arch) => gguf.opt_u64(&format!("{arch}.context_length")),
        None => Ok(None),
    }
}

/// `TemplateProcessing` that adds BOS and/or EOS around each sequence.
fn template_processor(tokens: &[String], special: &SpecialTokens) -> Value {
    let name =
        |id: Option<u32>, on: bool| id.filter(|_| on).map(|i| (i, tokens[i as usize].clone()));
    let bos = name(special.bos, special.add_bos);
    let eos = name(special.eos, special.add_eos);
    let part = |seq: &str, type_id: u32| {
        let mut out = Vec::new();
        if let Some((_, b)) = &bos {
            out.push(json!({"SpecialToken": {"id": b, "type_id": type_id}}));
        }
        out.push(json!({"Sequence": {"id": seq, "type_id": type_id}}));
        if let Some((_, e)) = &eos {
            out.push(json!({"SpecialToken": {"id": e, "type_id": type_id}}));
        }
        out
    };
    let single = part("A", 0);
    let mut pair = part("A", 0);
    pair.extend(part("B", 1));
    let mut specials = Map::new();
    for (id, t) in bos.iter().chain(eos.iter()) {
        specials.insert(t.clone(), json!({"id": t, "ids": [id], "tokens": [t]}));
    }
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials})
}

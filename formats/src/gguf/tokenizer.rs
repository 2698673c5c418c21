//! A Hugging Face `tokenizers` tokenizer (and `tokenizer_config.json` /
//! `generation_config.json`) rebuilt from a GGUF's embedded `tokenizer.ggml.*` metadata.
//!
//! | `tokenizer.ggml.model` | rebuilt as                                                        |
//! |------------------------|-------------------------------------------------------------------|
//! | `gpt2`                 | byte-level BPE with the file's merges; pre-tokenizer below         |
//! | `llama`                | SentencePiece BPE: merges derived from the scores, byte fallback  |
//! | anything else          | an error naming the value (`bert`, `t5`, `rwkv`, `none`, ...)      |
//!
//! `gpt2`: the pre-tokenizers below are each expressed with the same regexes llama.cpp's
//! `llm_tokenizer_bpe` uses for them (llama.cpp applies its regex list in sequence, each
//! splitting the pieces of the previous one and keeping unmatched text as pieces: exactly
//! `Split(..., "Isolated")` in a `Sequence`).
//!
//! | `tokenizer.ggml.pre`                  | pre-tokenizer                                            |
//! |---------------------------------------|----------------------------------------------------------|
//! | `smollm`                              | `\p{N}` isolated, then GPT-2 byte-level regex            |
//! | `gpt2`, `gpt-2`                       | GPT-2 byte-level regex                                   |
//! | `llama-bpe`, `llama3`, `llama-v3`     | Llama-3 regex, byte-level without regex; ignore_merges   |
//! | `qwen2`                               | Qwen2 regex (single digits), byte-level without regex; NFC |
//! | `default` or absent                   | llama.cpp's default list of four regexes                 |
//!
//! `llama` (Llama-1/2, Mistral-7B-v0.1, TinyLlama, ...): the `tokenizer.json` those models ship
//! (Hugging Face's legacy `LlamaTokenizerFast`), which encodes like `sentencepiece` itself. A GGUF
//! stores no merges for these, only piece scores, so the merges are derived from them
//! (`sentencepiece_merges`); `tokenizer.ggml.pre` and any `tokenizer.ggml.merges` are ignored,
//! as llama.cpp ignores them. Text gets a "▁" prefix (unless `tokenizer.ggml.add_space_prefix` is
//! false) and spaces become "▁" in a normalizer, not a pre-tokenizer, so that each stretch of text
//! between special tokens gets its own prefix, as the legacy tokenizer does; characters without a
//! piece are written as `<0xNN>` byte pieces. BOS is added unless
//! `tokenizer.ggml.add_bos_token` is false, and the BOS/EOS/unknown ids default to 1/2/0, as in
//! llama.cpp.

use super::{GgufError, GgufFile};
use serde_json::{json, Map, Value};
use std::collections::HashMap;
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

/// The vocabulary types of `tokenizer.ggml.model` that can be rebuilt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum VocabKind {
    /// `gpt2`: byte-level BPE with merges in the file.
    ByteLevelBpe,
    /// `llama`: SentencePiece BPE, merges implied by the piece scores.
    SentencePieceBpe,
}

fn vocab_kind(model: &str) -> Result<VocabKind, GgufError> {
    match model {
        "gpt2" => Ok(VocabKind::ByteLevelBpe),
        "llama" => Ok(VocabKind::SentencePieceBpe),
        other => {
            let what = match other {
                "bert" => " (WordPiece)",
                "t5" | "ugm" => " (SentencePiece Unigram)",
                "rwkv" => " (RWKV trie)",
                "none" | "no_vocab" => " (no vocabulary)",
                _ => "",
            };
            Err(GgufError::Tokenizer(format!(
                "tokenizer.ggml.model '{other}'{what} is not supported \
                 (supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)"
            )))
        }
    }
}

/// The parts of `tokenizer.json` that depend on the vocabulary type.
struct ModelParts {
    /// The `BPE` model's fields other than `vocab`.
    unk_token: Value,
    fuse_unk: bool,
    byte_fallback: bool,
    ignore_merges: bool,
    merges: Vec<Value>,
    normalizer: Value,
    pre_tokenizer: Value,
    decoder: Value,
    /// Post-processors that run before the BOS/EOS template.
    post_processors: Vec<Value>,
    /// llama.cpp's default for `add_bos` when `tokenizer.ggml.add_bos_token` is absent.
    default_add_bos: bool,
    clean_up_tokenization_spaces: bool,
}

/// Byte-level BPE (`gpt2`): the file's merges and the pre-tokenizer `tokenizer.ggml.pre` names.
fn byte_level_parts(gguf: &GgufFile) -> Result<ModelParts, GgufError> {
    let pre = gguf.opt_str("tokenizer.ggml.pre")?.unwrap_or("default");
    let spec = pre_tokenizer_spec(pre)?;
    let merges_raw = gguf.get_str_array("tokenizer.ggml.merges")?;
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
    Ok(ModelParts {
        unk_token: Value::Null,
        fuse_unk: false,
        byte_fallback: false,
        ignore_merges: spec.ignore_merges,
        merges,
        normalizer: spec.normalizer,
        pre_tokenizer: spec.pre_tokenizer,
        decoder: json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
        post_processors: vec![
            json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true}),
        ],
        default_add_bos: spec.default_add_bos,
        clean_up_tokenization_spaces: spec.clean_up_tokenization_spaces,
    })
}

/// The SentencePiece whitespace symbol (U+2581).
const METASPACE: &str = "\u{2581}";

/// SentencePiece BPE (`llama`), as Hugging Face's legacy Llama `tokenizer.json`.
fn sentencepiece_parts(
    gguf: &GgufFile,
    tokens: &[String],
    types: &[i64],
    unk: Option<u32>,
) -> Result<ModelParts, GgufError> {
    let n = tokens.len();
    // Without scores every piece ties and the vocabulary order decides, as in llama.cpp.
    let no_scores;
    let scores = match gguf.get("tokenizer.ggml.scores") {
        Some(_) => gguf.get_f32_array("tokenizer.ggml.scores")?,
        None => {
            no_scores = vec![0.0f32; n];
            &no_scores[..]
        }
    };
    if scores.len() != n {
        return Err(GgufError::metadata(
            "tokenizer.ggml.scores",
            format!("{} entries for {n} tokens", scores.len()),
        ));
    }
    let add_space_prefix = gguf
        .opt_bool("tokenizer.ggml.add_space_prefix")?
        .unwrap_or(true);
    let merges = sentencepiece_merges(tokens, scores, types)
        .into_iter()
        .map(|(a, b)| json!([a, b]))
        .collect();

    // A normalizer (not a Metaspace pre-tokenizer) so that the prefix is added even when the
    // text already starts with a space or "▁", as sentencepiece does.
    let mut normalizers = Vec::new();
    if add_space_prefix {
        normalizers.push(json!({"type": "Prepend", "prepend": METASPACE}));
    }
    normalizers.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": METASPACE}));
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": METASPACE}, "content": " "}),
        json!({"type": "ByteFallback"}),
        // Strip works on each token: fuse first so it removes only the text's first space.
        json!({"type": "Fuse"}),
    ];
    if add_space_prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    Ok(ModelParts {
        unk_token: json!(unk.map(|u| tokens[u as usize].as_str())),
        fuse_unk: true,
        byte_fallback: true,
        ignore_merges: false,
        merges,
        normalizer: json!({"type": "Sequence", "normalizers": normalizers}),
        pre_tokenizer: Value::Null,
        decoder: json!({"type": "Sequence", "decoders": decoders}),
        post_processors: Vec::new(),
        default_add_bos: true,
        clean_up_tokenization_spaces: false,
    })
}

/// The BPE merges a SentencePiece BPE vocabulary implies, best first.
///
/// SentencePiece keeps no merge list: it repeatedly joins the adjacent pair whose concatenation
/// is the highest-scoring piece. A ranked merge list behaves the same when it holds every way of
/// cutting each piece into two pieces, ranked by the whole piece's score (ties by the lower id,
/// the vocabulary order Hugging Face's SentencePiece extractor walks; the cuts of one piece by
/// the ids of their halves). Only normal pieces take part: SentencePiece never builds control,
/// unknown, byte or unused pieces by joining (it may form an unused piece and split it again at
/// the end, which a merge list cannot express; Llama-family vocabularies have none), and
/// user-defined pieces are matched whole, here as added tokens. A string listed twice keeps its
/// first id, like the vocabulary.
fn sentencepiece_merges<'a>(
    tokens: &'a [String],
    scores: &[f32],
    types: &[i64],
) -> Vec<(&'a str, &'a str)> {
    let mut normal: HashMap<&str, usize> = HashMap::new();
    for (id, (tok, &ty)) in tokens.iter().zip(types).enumerate() {
        if ty == token_type::NORMAL {
            normal.entry(tok.as_str()).or_insert(id);
        }
    }
    // (whole, left, right) ids.
    let mut cuts: Vec<(usize, usize, usize)> = Vec::new();
    for (&piece, &id) in &normal {
        for (at, _) in piece.char_indices().skip(1) {
            if let (Some(&l), Some(&r)) = (normal.get(&piece[..at]), normal.get(&piece[at..])) {
                cuts.push((id, l, r));
            }
        }
    }
    let score = |id: usize| scores.get(id).copied().unwrap_or(0.0);
    cuts.sort_by(|a, b| {
        score(b.0)
            .total_cmp(&score(a.0))
            .then(a.0.cmp(&b.0))
            .then(a.1.cmp(&b.1))
            .then(a.2.cmp(&b.2))
    });
    cuts.into_iter()
        .map(|(_, l, r)| (tokens[l].as_str(), tokens[r].as_str()))
        .collect()
}

/// Builds the tokenizer, `tokenizer_config.json` and `generation_config.json` from `gguf`.
pub fn tokenizer_from_gguf(gguf: &GgufFile) -> Result<GgufTokenizer, GgufError> {
    let kind = vocab_kind(gguf.get_str("tokenizer.ggml.model")?)?;

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

    // llama.cpp's fixed ids for a SentencePiece vocabulary that names none (when they exist).
    let spm = kind == VocabKind::SentencePieceBpe;
    let fallback = |id: u32| (spm && (id as usize) < n).then_some(id);
    let id_key = |key: &str, default: Option<u32>| -> Result<Option<u32>, GgufError> {
        match gguf.opt_u32(key)? {
            Some(id) if id as usize >= n => Err(GgufError::metadata(
                key,
                format!("token id {id} is outside the vocabulary of {n} tokens"),
            )),
            Some(id) => Ok(Some(id)),
            None => Ok(default),
        }
    };
    let bos = id_key("tokenizer.ggml.bos_token_id", fallback(1))?;
    let eos = id_key("tokenizer.ggml.eos_token_id", fallback(2))?;
    let unk = id_key("tokenizer.ggml.unknown_token_id", fallback(0))?;
    let parts = match kind {
        VocabKind::ByteLevelBpe => byte_level_parts(gguf)?,
        VocabKind::SentencePieceBpe => sentencepiece_parts(gguf, tokens, &types, unk)?,
    };
    let mut special = SpecialTokens {
        bos,
        eos,
        eot: id_key("tokenizer.ggml.eot_token_id", None)?,
        unk,
        pad: id_key("tokenizer.ggml.padding_token_id", None)?,
        add_bos: gguf
            .opt_bool("tokenizer.ggml.add_bos_token")?
            .unwrap_or(parts.default_add_bos),
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

    let mut processors = parts.post_processors;
    if special.add_bos || special.add_eos {
        processors.push(template_processor(tokens, &special));
    }
    let post_processor = match processors.len() {
        0 => Value::Null,
        1 => processors.swap_remove(0),
        _ => json!({"type": "Sequence", "processors": processors}),
    };

    let tokenizer_value = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": parts.normalizer,
        "pre_tokenizer": parts.pre_tokenizer,
        "post_processor": post_processor,
        "decoder": parts.decoder,
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": parts.unk_token,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": parts.fuse_unk,
            "byte_fallback": parts.byte_fallback,
            "ignore_merges": parts.ignore_merges,
            "vocab": vocab,
            "merges": parts.merges,
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
        json!(parts.clean_up_tokenization_spaces),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-made SentencePiece vocabulary: (piece, score, type).
    fn vocab() -> (Vec<String>, Vec<f32>, Vec<i64>) {
        use token_type::*;
        let pieces: [(&str, f32, i64); 18] = [
            ("<unk>", 0.0, UNKNOWN),
            ("<s>", 0.0, CONTROL),
            ("</s>", 0.0, CONTROL),
            ("<0x61>", 0.0, BYTE),
            ("▁", -100.0, NORMAL),
            ("a", -101.0, NORMAL),
            ("b", -102.0, NORMAL),
            ("c", -103.0, NORMAL),
            ("ab", -5.0, NORMAL),
            ("bc", -2.0, NORMAL),
            ("abc", -1.0, NORMAL),
            ("▁a", -7.0, NORMAL),
            ("<", -104.0, NORMAL),
            ("s>", -105.0, NORMAL),
            ("ca", -0.5, UNUSED),
            ("▁ab", -0.1, USER_DEFINED),
            ("b", -0.2, NORMAL),
            ("ba", -2.0, NORMAL),
        ];
        (
            pieces.iter().map(|p| p.0.to_string()).collect(),
            pieces.iter().map(|p| p.1).collect(),
            pieces.iter().map(|p| p.2).collect(),
        )
    }

    #[test]
    fn merges_follow_the_joined_piece_score() {
        let (tokens, scores, types) = vocab();
        let merges = sentencepiece_merges(&tokens, &scores, &types);
        // By hand: "abc" (-1) first, both of its cuts, the one with the lower left id first;
        // then "bc" and "ba" (tied at -2: lower id first, although "ba" is a later piece than
        // "ab"), "ab" (-5) and "▁a" (-7). Left out: the control "<s>" (though "<" and "s>" are
        // pieces), the unused "ca" and user-defined "▁ab" (whatever their scores), the byte
        // piece, and the duplicate "b" (its better score is never looked at).
        assert_eq!(
            merges,
            [
                ("a", "bc"),
                ("ab", "c"),
                ("b", "c"),
                ("b", "a"),
                ("a", "b"),
                ("▁", "a"),
            ]
        );
    }

    #[test]
    fn merges_without_scores_follow_the_vocabulary_order() {
        let (tokens, _, types) = vocab();
        let zeros = vec![0.0; tokens.len()];
        let merges = sentencepiece_merges(&tokens, &zeros, &types);
        assert_eq!(
            merges,
            [
                ("a", "b"),
                ("b", "c"),
                ("a", "bc"),
                ("ab", "c"),
                ("▁", "a"),
                ("b", "a"),
            ]
        );
    }

    #[test]
    fn unsupported_vocab_types_name_the_field() {
        for (model, what) in [
            ("bert", "WordPiece"),
            ("t5", "Unigram"),
            ("rwkv", "RWKV"),
            ("none", "no vocabulary"),
            ("plamo2", ""),
        ] {
            let err = vocab_kind(model).unwrap_err().to_string();
            assert!(
                err.contains(&format!("tokenizer.ggml.model '{model}'"))
                    && err.contains(what)
                    && err.contains("not supported"),
                "{err}"
            );
        }
        assert_eq!(vocab_kind("llama").unwrap(), VocabKind::SentencePieceBpe);
        assert_eq!(vocab_kind("gpt2").unwrap(), VocabKind::ByteLevelBpe);
    }
}

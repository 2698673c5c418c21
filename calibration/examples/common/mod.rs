//! Shared by the calibration examples.

use anyhow::{anyhow, Context, Result};
use sfx_formats::checkpoint::Checkpoint;
use tokenizers::Tokenizer;

/// The checkpoint's own tokenizer (its tokenizer.json).
#[allow(dead_code)] // not every example tokenizes
pub fn tokenizer(ckpt: &Checkpoint) -> Result<Tokenizer> {
    Tokenizer::from_bytes(
        ckpt.tokenizer_json
            .as_deref()
            .context("no tokenizer.json")?,
    )
    .map_err(|e| anyhow!("tokenizer: {e}"))
}

#[allow(dead_code)] // not every example reads a text prefix
/// The first `want` tokens of `text`, tokenizing only a prefix long enough for them
/// (≈ 4 characters per token; 8 is generous) so the 6 MB Brown text is not tokenized whole.
pub fn prefix_tokens(tok: &Tokenizer, text: &str, want: usize) -> Result<Vec<u32>> {
    let mut end = (want * 8).min(text.len());
    while !text.is_char_boundary(end) {
        end += 1;
    }
    let ids = tok
        .encode(&text[..end], false)
        .map_err(|e| anyhow!("tokenize: {e}"))?
        .get_ids()
        .to_vec();
    if ids.len() < want {
        return Err(anyhow!("text gives only {} tokens, need {want}", ids.len()));
    }
    Ok(ids[..want].to_vec())
}

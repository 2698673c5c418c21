//! A GGUF file of arbitrary bytes through what `sfx-run model.gguf` does with one: the header
//! (metadata and tensor table), the tokenizer, and the import into a model (config, tensor
//! shapes, dequantization). Any panic, hang or oversized allocation is a bug.
#![no_main]
use libfuzzer_sys::fuzz_target;
use sfx_formats::gguf::{import_from_gguf, tokenizer_from_gguf, GgufFile};

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let Some(f) = common::temp_file(data) else {
        return;
    };
    let Ok(gguf) = GgufFile::open(f.path()) else {
        return;
    };
    let _ = tokenizer_from_gguf(&gguf);
    let _ = import_from_gguf(&gguf);
});

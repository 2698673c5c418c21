//! A Hugging Face `config.json` of arbitrary text through `ModelConfig::from_hf_json`, and the
//! derived quantities the runtime sizes buffers from. Any panic or oversized allocation is a
//! bug.
#![no_main]
use libfuzzer_sys::fuzz_target;
use sfx_formats::ModelConfig;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let Ok(c) = ModelConfig::from_hf_json(&json, Path::new("config.json")) else {
        return;
    };
    let _ = c.q_dim();
    let _ = c.kv_dim();
    let _ = c.rope_inv_freq();
});

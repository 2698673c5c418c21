//! A `.safetensors` file of arbitrary bytes through the checkpoint reader: the header, every
//! tensor's view and its conversion to f32. Any panic or oversized allocation is a bug.
#![no_main]
use libfuzzer_sys::fuzz_target;
use sfx_formats::checkpoint::SafetensorsCheckpoint;
use sfx_formats::TensorSource;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let Some(f) = common::temp_file(data) else {
        return;
    };
    let Ok(ck) = SafetensorsCheckpoint::open_file(f.path()) else {
        return;
    };
    for name in ck.tensor_names() {
        if let Ok(t) = ck.tensor(&name) {
            let _ = t.to_f32_vec();
        }
    }
});

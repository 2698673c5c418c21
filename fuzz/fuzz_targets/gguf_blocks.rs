//! Every GGUF block dequantizer on arbitrary block bytes: the first byte picks the type, the
//! rest is cut to whole blocks. Dequantization must never panic; a non-finite value from
//! garbage scales is allowed (the bytes are not a real tensor).
#![no_main]
use libfuzzer_sys::fuzz_target;
use sfx_formats::gguf::{dequantize_to_vec, GgmlType};

const TYPES: [GgmlType; 13] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

fuzz_target!(|data: &[u8]| {
    let Some((&pick, bytes)) = data.split_first() else {
        return;
    };
    let ty = TYPES[pick as usize % TYPES.len()];
    let blocks = bytes.len() / ty.type_size();
    let n = blocks * ty.block_size();
    let out = dequantize_to_vec(ty, &bytes[..blocks * ty.type_size()], n)
        .expect("whole blocks of a supported type dequantize");
    assert_eq!(out.len(), n);
    // A wrong length is an error, not a panic.
    if n > 0 {
        assert!(dequantize_to_vec(ty, &bytes[..blocks * ty.type_size()], n + 1).is_err());
    }
});

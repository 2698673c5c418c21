//! gguf-py's dequantization of random i-quant blocks (`tests/fixtures/iq_dequant_reference.json`,
//! made by `scripts/golden/make_iq_fixtures.py`), for the tests that compare against it.
#![allow(dead_code)]

use serde_json::Value;
use sfx_formats::gguf::GgmlType;
use std::path::Path;

pub struct Case {
    pub ty: GgmlType,
    /// Values the blocks hold.
    pub n: usize,
    pub blocks: Vec<u8>,
    /// gguf-py's values.
    pub want: Vec<f32>,
}

pub fn unhex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd hex length");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex digit"))
        .collect()
}

pub fn cases() -> Vec<Case> {
    let p =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/iq_dequant_reference.json");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let doc: Value = serde_json::from_str(&text).unwrap();
    let cases: Vec<Case> = doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let id = c["type_id"].as_u64().unwrap() as u32;
            let ty = GgmlType::from_id(id).unwrap();
            assert_eq!(ty.name(), c["type"].as_str().unwrap());
            let want: Vec<f32> = unhex(c["f32_le_hex"].as_str().unwrap())
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let n = c["n_values"].as_u64().unwrap() as usize;
            assert_eq!(want.len(), n);
            Case {
                ty,
                n,
                blocks: unhex(c["blocks_hex"].as_str().unwrap()),
                want,
            }
        })
        .collect();
    let names: Vec<&str> = cases.iter().map(|c| c.ty.name()).collect();
    assert_eq!(
        names,
        ["IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"]
    );
    cases
}

pub fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: element {i} (block {}) is {} ({:#010x}), gguf-py gives {} ({:#010x})",
            i / 256,
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

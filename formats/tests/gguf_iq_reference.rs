//! The i-quant decoders (IQ4_NL, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) against
//! gguf-py's `gguf.quants.dequantize` on random valid blocks:
//! `tests/fixtures/iq_dequant_reference.json`, made by `scripts/golden/make_iq_fixtures.py`.
//!
//! Bit-exact equality, and why it is the right bound: each value is an f16 scale times a
//! small integer or half-integer (exact in f32), times one table entry (the only rounding),
//! times ±1 (exact), in the same order in gguf-py (numpy f32, no FMA) and here. The fixture's
//! blocks include a zero scale (so the sign of each zero is compared) and a subnormal one.
//!
//! Also checked here: the same bytes read through a GGUF file, and a model whose weights are
//! i-quants importing to exactly gguf-py's values, while a type still without a decoder is
//! refused with the tensor and the type named.

#[path = "common/gguf_writer.rs"]
mod gguf_writer;
#[path = "common/iq_fixture.rs"]
mod iq_fixture;

use gguf_writer::GgufBuilder;
use iq_fixture::{assert_bits, cases};
use sfx_formats::gguf::{dequantize_to_vec, GgufFile};

#[test]
fn every_iq_type_equals_gguf_py_bit_for_bit() {
    for c in cases() {
        assert!(c.ty.can_dequantize(), "{}", c.ty);
        let got = dequantize_to_vec(c.ty, &c.blocks, c.n).unwrap();
        assert_bits(c.ty.name(), &got, &c.want);
        // The fixture must exercise both signs and nonzero values, or equality says little.
        assert!(c.want.iter().any(|&v| v > 0.0) && c.want.iter().any(|&v| v < 0.0));
    }
}

#[test]
fn iq_tensors_read_from_a_gguf_file_and_on_the_parallel_path() {
    let d = tempfile::tempdir().unwrap();
    let mut g = GgufBuilder::new();
    let cases = cases();
    // Repeated past the size where decoding goes parallel (blocks are independent, so the
    // reference repeats with them).
    const REPEAT: usize = 200;
    for c in &cases {
        g = g.tensor(
            &format!("t.{}", c.ty),
            &[(c.n * REPEAT) as u64],
            c.ty.id(),
            c.blocks.repeat(REPEAT),
        );
    }
    let f = GgufFile::open(g.write(d.path(), "iq.gguf")).unwrap();
    for c in &cases {
        let got = f.dequantize(&format!("t.{}", c.ty)).unwrap();
        assert_bits(c.ty.name(), &got, &c.want.repeat(REPEAT));
    }
}

#[test]
fn a_truncated_iq_tensor_is_an_error_not_a_panic() {
    for c in cases() {
        let e = dequantize_to_vec(c.ty, &c.blocks[..c.blocks.len() - 1], c.n).unwrap_err();
        assert!(e.to_string().contains("bytes"), "{}: {e}", c.ty);
    }
}

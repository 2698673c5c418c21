//! llama.cpp's GGUF importance-matrix layout read through `Imatrix::read`: `.in_sum2` divided
//! by `.counts`, 1 where no token reached a tensor, HF names, expert tensors refused.

#[path = "common/gguf_writer.rs"]
mod gguf_writer;

use gguf_writer::{s, GgufBuilder};
use sfx_formats::gguf::Imatrix;

#[test]
fn gguf_importance_is_sums_over_counts() {
    let d = tempfile::tempdir().unwrap();
    let g = GgufBuilder::new()
        .kv("general.type", s("imatrix"))
        .f32_tensor("blk.0.attn_q.weight.in_sum2", &[3, 1], &[2.0, 4.0, 6.0])
        .f32_tensor("blk.0.attn_q.weight.counts", &[1, 1], &[2.0])
        .f32_tensor("blk.1.ffn_down.weight.in_sum2", &[2, 1], &[5.0, 7.0])
        .f32_tensor("blk.1.ffn_down.weight.counts", &[1, 1], &[0.0])
        .f32_tensor("output.weight.in_sum2", &[1, 1], &[9.0])
        .f32_tensor("output.weight.counts", &[1, 1], &[3.0]);
    let m = Imatrix::read(&g.write(d.path(), "m.gguf")).unwrap();
    assert_eq!(m.layout, "gguf");
    assert_eq!(
        m.get("model.layers.0.self_attn.q_proj.weight"),
        Some(&[1.0, 2.0, 3.0][..])
    );
    assert_eq!(
        m.get("model.layers.1.mlp.down_proj.weight"),
        Some(&[1.0, 1.0][..])
    );
    assert_eq!(m.get("lm_head.weight"), Some(&[3.0][..]));

    let experts = GgufBuilder::new()
        .f32_tensor("blk.0.ffn_down.weight.in_sum2", &[2, 2], &[1.0; 4])
        .f32_tensor("blk.0.ffn_down.weight.counts", &[1, 2], &[1.0, 1.0]);
    let e = Imatrix::read(&experts.write(d.path(), "e.gguf")).unwrap_err();
    assert!(e.to_string().contains("experts"), "{e}");
    let no_counts =
        GgufBuilder::new().f32_tensor("blk.0.attn_k.weight.in_sum2", &[2, 1], &[1.0; 2]);
    let e = Imatrix::read(&no_counts.write(d.path(), "n.gguf")).unwrap_err();
    assert!(e.to_string().contains("counts"), "{e}");
    let model = GgufBuilder::new().f32_tensor("blk.0.attn_k.weight", &[2, 1], &[1.0; 2]);
    let e = Imatrix::read(&model.write(d.path(), "model.gguf")).unwrap_err();
    assert!(e.to_string().contains("in_sum2"), "{e}");
    std::fs::write(d.path().join("short"), b"GG").unwrap();
    assert!(Imatrix::read(&d.path().join("short")).is_err());
}

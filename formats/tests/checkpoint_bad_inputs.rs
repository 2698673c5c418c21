//! Malformed Hugging Face checkpoints must fail with an error naming the problem, never panic
//! or allocate from an untrusted size.

use sfx_formats::checkpoint::{Checkpoint, SafetensorsCheckpoint};
use std::path::Path;

const CONFIG: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":8,
"intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1,
"vocab_size":32,"rms_norm_eps":1e-5,"rope_theta":10000.0,"tie_word_embeddings":true}"#;

/// A valid safetensors file with one BF16 tensor `w` of shape [2, 3], built by hand from the
/// format description (8-byte LE header length, JSON header, data).
fn safetensors_bytes() -> Vec<u8> {
    let header = r#"{"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]}}"#;
    let mut padded = header.to_string();
    while !padded.len().is_multiple_of(8) {
        padded.push(' ');
    }
    let mut out = (padded.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(padded.as_bytes());
    for v in [1.0f32, 2.0, 3.0, -1.0, 0.5, 0.25] {
        out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes());
    }
    out
}

fn write_dir(dir: &Path, config: &str, st: &[u8]) {
    std::fs::write(dir.join("config.json"), config).unwrap();
    std::fs::write(dir.join("model.safetensors"), st).unwrap();
}

fn open_err(dir: &Path) -> String {
    Checkpoint::from_hf_dir(dir).unwrap_err().to_string()
}

#[test]
fn valid_file_reads_back_exact_values() {
    let d = tempfile::tempdir().unwrap();
    write_dir(d.path(), CONFIG, &safetensors_bytes());
    let c = Checkpoint::from_hf_dir(d.path()).unwrap();
    let t = c.tensors.tensor("w").unwrap();
    assert_eq!(t.shape, &[2, 3]);
    assert_eq!(t.to_f32_vec(), vec![1.0, 2.0, 3.0, -1.0, 0.5, 0.25]);
}

#[test]
fn truncated_safetensors_is_rejected_at_every_cut() {
    let full = safetensors_bytes();
    let d = tempfile::tempdir().unwrap();
    for cut in [0, 4, 8, 20, full.len() - 1] {
        write_dir(d.path(), CONFIG, &full[..cut]);
        let msg = open_err(d.path());
        assert!(msg.contains("model.safetensors"), "cut {cut}: {msg}");
    }
}

#[test]
fn header_length_beyond_file_is_rejected() {
    let mut bytes = safetensors_bytes();
    bytes[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let d = tempfile::tempdir().unwrap();
    write_dir(d.path(), CONFIG, &bytes);
    let msg = open_err(d.path());
    assert!(msg.contains("invalid safetensors"), "{msg}");
}

#[test]
fn overflowing_shape_is_rejected() {
    let header = format!(
        r#"{{"w":{{"dtype":"BF16","shape":[{},{}],"data_offsets":[0,12]}}}}"#,
        u64::MAX / 2,
        4
    );
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&[0u8; 12]);
    let d = tempfile::tempdir().unwrap();
    write_dir(d.path(), CONFIG, &bytes);
    let msg = open_err(d.path());
    assert!(msg.contains("invalid safetensors"), "{msg}");
}

#[test]
fn config_missing_hidden_size_is_named() {
    let d = tempfile::tempdir().unwrap();
    write_dir(
        d.path(),
        &CONFIG.replace(r#""hidden_size":8,"#, ""),
        &safetensors_bytes(),
    );
    let msg = open_err(d.path());
    assert!(
        msg.contains("hidden_size") && msg.contains("config.json"),
        "{msg}"
    );
}

#[test]
fn unsupported_dtype_is_named() {
    let header = r#"{"ids":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&[0u8; 8]);
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("x.safetensors"), &bytes).unwrap();
    let e = SafetensorsCheckpoint::open_file(&d.path().join("x.safetensors"))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("ids") && e.contains("I64"), "{e}");
}

#[test]
fn sharded_index_pointing_outside_or_missing_tensor_is_rejected() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("config.json"), CONFIG).unwrap();
    std::fs::write(
        d.path().join("model-00001-of-00001.safetensors"),
        safetensors_bytes(),
    )
    .unwrap();
    let idx = d.path().join("model.safetensors.index.json");
    std::fs::write(&idx, r#"{"weight_map":{"w":"../evil.safetensors"}}"#).unwrap();
    assert!(open_err(d.path()).contains("outside"));
    std::fs::write(
        &idx,
        r#"{"weight_map":{"w":"model-00001-of-00001.safetensors","v":"model-00001-of-00001.safetensors"}}"#,
    )
    .unwrap();
    let msg = open_err(d.path());
    assert!(msg.contains("'v'"), "{msg}");
    std::fs::write(
        &idx,
        r#"{"weight_map":{"w":"model-00001-of-00001.safetensors"}}"#,
    )
    .unwrap();
    let c = Checkpoint::from_hf_dir(d.path()).unwrap();
    assert_eq!(c.tensors.tensor_names(), vec!["w".to_string()]);
}

#[test]
fn missing_weights_file_is_named() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("config.json"), CONFIG).unwrap();
    assert!(open_err(d.path()).contains("model.safetensors"));
}

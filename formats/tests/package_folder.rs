//! Output folders: written from a container's metadata, verified file by file, and moved into
//! place only whole. Every file of a folder is corrupted in turn; the verifier must name it.

use sfx_formats::config::ModelConfig;
use sfx_formats::package::{
    publish_staged, verify_folder, write_folder_files, FolderInputs, MANIFEST_FILE, MODEL_FILE,
    QUALITY_FILE,
};
use sfx_formats::sfx::{Codec, Layout, Provenance, SectionSpec, SfxMetadata, SfxWriter, Tier};
use std::path::Path;

fn config() -> ModelConfig {
    let json = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": true, "bos_token_id": 1, "eos_token_id": 2
    });
    ModelConfig::from_hf_json(&json, Path::new("config.json")).unwrap()
}

/// A staged folder holding a small container with a configuration, tokenizer and params,
/// beside `out` (as the converter assembles one, so the final rename stays on one file system).
fn staged_folder(out: &Path) -> std::path::PathBuf {
    let name = out.file_name().unwrap().to_string_lossy().into_owned();
    let staging = out.with_file_name(format!(".{name}.staging"));
    std::fs::create_dir_all(&staging).unwrap();
    let mut w = SfxWriter::create(staging.join(MODEL_FILE)).unwrap();
    w.add_section(
        SectionSpec::new("embed", Tier::Resident, Codec::Raw, Layout::Bytes),
        &[7u8; 5000],
    )
    .unwrap();
    w.add_section(
        SectionSpec::new("refine.0.q", Tier::Ram, Codec::Raw, Layout::Bytes),
        &[3u8; 3000],
    )
    .unwrap();
    let mut meta = SfxMetadata {
        config: Some(config()),
        tokenizer_json: Some(r#"{"model":{"vocab":{"a":0,"b":1}}}"#.into()),
        tokenizer_config: Some(serde_json::json!({"chat_template": "{{ messages }}"})),
        provenance: Provenance {
            tool: "sfx-convert".into(),
            tool_version: "0.1.0".into(),
            source_id: "HuggingFaceTB/SmolLM2-135M-Instruct".into(),
            calibration_text_sha256: Some("ab".repeat(32)),
            ..Default::default()
        },
        ..Default::default()
    };
    meta.params.insert(
        "quant".into(),
        serde_json::json!({"method": "awq", "bits": 3, "name": "awq3-g128", "bits_per_weight": 3.2}),
    );
    meta.params.insert(
        "refine".into(),
        serde_json::json!({"k": {"qkv": 16}, "tier": "ram", "fit": true}),
    );
    w.finish(&meta).unwrap();
    let inputs = FolderInputs {
        command_line: vec!["sfx-convert".into(), "--quant".into(), "awq3".into()],
        git_revision: Some("abc1234".into()),
        license: Some("apache-2.0".into()),
        base_model: Some("HuggingFaceTB/SmolLM2-135M-Instruct".into()),
        quality: Some(serde_json::json!({
            "text": "wiki", "windows": 2, "window": 2048, "scored_tokens": 4094,
            "device": "cpu", "command": "sfx-run . --ppl wiki:2",
            "base": {"ppl": 30.5, "kl_mean": 0.41234, "kl_p99": 2.5, "same_top1_pct": 71.5},
            "refined": {"ppl": 21.25, "kl_mean": 0.2, "kl_p99": 1.5, "same_top1_pct": 80.0,
                        "k": [16, 16, 16, 16]},
        })),
        ..Default::default()
    };
    write_folder_files(&staging, &inputs).unwrap();
    staging
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn a_folder_verifies_and_a_flipped_byte_in_any_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let staging = staged_folder(&out);
    publish_staged(&staging, &out).unwrap();
    assert!(!staging.exists());
    let report = verify_folder(&out).unwrap();
    let mut names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "README.md",
            "config.json",
            "generation_config.json",
            MANIFEST_FILE,
            MODEL_FILE,
            QUALITY_FILE,
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
    assert_eq!(report.files, names.len() - 1);
    assert_eq!(report.sections, 2);
    assert!(report.unlisted.is_empty());

    for name in &names {
        let bad = dir.path().join(format!("bad-{name}"));
        copy_dir(&out, &bad);
        let path = bad.join(name);
        let mut bytes = std::fs::read(&path).unwrap();
        let at = bytes.len() / 2;
        bytes[at] ^= 0x20;
        std::fs::write(&path, &bytes).unwrap();
        let err = verify_folder(&bad).expect_err(name).to_string();
        assert!(err.contains(name.as_str()), "{name}: {err}");
        std::fs::remove_dir_all(&bad).unwrap();
    }

    // A missing file is named too; a file the manifest does not list is reported, not fatal.
    let gone = dir.path().join("gone");
    copy_dir(&out, &gone);
    std::fs::remove_file(gone.join("tokenizer.json")).unwrap();
    let err = verify_folder(&gone).unwrap_err().to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
    std::fs::write(out.join("notes.txt"), b"mine").unwrap();
    assert_eq!(verify_folder(&out).unwrap().unlisted, ["notes.txt"]);
}

#[test]
fn the_folder_files_say_what_the_container_holds() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let staging = staged_folder(&out);
    publish_staged(&staging, &out).unwrap();
    let read = |n: &str| std::fs::read_to_string(out.join(n)).unwrap();
    let config: serde_json::Value = serde_json::from_str(&read("config.json")).unwrap();
    assert_eq!(
        ModelConfig::from_hf_json(&config, Path::new("config.json")).unwrap(),
        self::config()
    );
    let q = &config["quantization_config"];
    assert_eq!(q["quant_method"], "strataflux");
    assert_eq!(q["resident"]["name"], "awq3-g128");
    assert_eq!(q["refinement"]["k"]["qkv"], 16);
    let generation: serde_json::Value =
        serde_json::from_str(&read("generation_config.json")).unwrap();
    assert_eq!(generation["eos_token_id"], serde_json::json!([2]));
    let manifest: serde_json::Value = serde_json::from_str(&read(MANIFEST_FILE)).unwrap();
    assert_eq!(manifest["git_revision"], "abc1234");
    assert_eq!(manifest["command_line"][2], "awq3");
    assert_eq!(manifest["calibration_text_sha256"], "ab".repeat(32));
    // The card's front matter: the keys the Hub reads, each on its own line.
    let card = read("README.md");
    let front = card
        .strip_prefix("---\n")
        .and_then(|c| c.split_once("\n---\n"))
        .map(|(f, _)| f)
        .expect("front matter");
    for key in [
        "base_model: \"HuggingFaceTB/SmolLM2-135M-Instruct\"",
        "base_model_relation: quantized",
        "license: \"apache-2.0\"",
        "library_name: strataflux",
        "pipeline_tag: text-generation",
        "tags:",
    ] {
        assert!(front.lines().any(|l| l == key), "{key} in\n{front}");
    }
    // The quality receipt as written, and as the card's table.
    let receipt: serde_json::Value = serde_json::from_str(&read(QUALITY_FILE)).unwrap();
    assert_eq!(receipt["base"]["kl_mean"], 0.41234);
    for row in [
        "| resident base | 30.500 | 0.4123 | 2.5000 | 71.5 % |",
        "| refined, k = [16,16,16,16] | 21.250 | 0.2000 | 1.5000 | 80.0 % |",
        "`sfx-run . --ppl wiki:2`",
    ] {
        assert!(card.contains(row), "{row} in\n{card}");
    }
}

#[test]
fn publishing_replaces_an_earlier_folder_and_refuses_anything_else() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    publish_staged(&staged_folder(&out), &out).unwrap();
    // Again over the first: replaced whole.
    std::fs::write(out.join("stale.txt"), b"x").unwrap();
    publish_staged(&staged_folder(&out), &out).unwrap();
    assert!(!out.join("stale.txt").exists());
    verify_folder(&out).unwrap();
    // A folder that is not an output folder, or a file, is left alone.
    let other = dir.path().join("photos");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("cat.jpg"), b"meow").unwrap();
    let staging = staged_folder(&other);
    let err = publish_staged(&staging, &other).unwrap_err().to_string();
    assert!(err.contains("not an output folder"), "{err}");
    assert_eq!(std::fs::read(other.join("cat.jpg")).unwrap(), b"meow");
}

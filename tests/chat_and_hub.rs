//! Chat-template rendering against transformers' `apply_chat_template` (the golden fixture's
//! chat prompt), and Hub-id resolution through a standard Hugging Face cache.

use sfx_formats::checkpoint::Checkpoint;
use sfx_runtime::chat::{render_chat, ChatMessage};
mod common;
use common::{fixture, gguf};

#[test]
fn chat_template_renders_like_transformers() {
    let golden = fixture("golden_smollm2.json");
    let chat = golden["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "chat")
        .expect("golden has a chat prompt");
    let ckpt = Checkpoint::open(gguf().to_str().unwrap()).unwrap();
    let template = ckpt.chat_template().expect("SmolLM2 has a chat template");
    let messages = [ChatMessage {
        role: "user".into(),
        content: "What is the capital of France? Answer in one word.".into(),
    }];
    let ours = render_chat(template, &messages, true, "<|im_start|>", "<|im_end|>").unwrap();
    assert_eq!(ours, chat["text"].as_str().unwrap());
}

/// A Hub id resolves from a standard HF cache laid out by hand
/// (`$HF_HOME/hub/models--org--name/{refs/main, snapshots/<rev>/…}`), with downloads forbidden.
/// The only test in this file that sets environment variables (tests in one file share a
/// process).
#[test]
fn hub_id_resolves_from_hf_cache_offline() {
    let home = tempfile::tempdir().unwrap();
    let repo = home.path().join("hub/models--sfx-test--tiny-llama");
    let rev = "0123456789abcdef0123456789abcdef01234567";
    let snap = repo.join("snapshots").join(rev);
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), rev).unwrap();
    std::fs::write(
        snap.join("config.json"),
        r#"{"model_type":"llama","hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,
            "num_attention_heads":2,"num_key_value_heads":1,"vocab_size":32}"#,
    )
    .unwrap();
    let header = r#"{"model.norm.weight":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    let mut st = (header.len() as u64).to_le_bytes().to_vec();
    st.extend_from_slice(header.as_bytes());
    for v in [1.5f32, -2.0] {
        st.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(snap.join("model.safetensors"), st).unwrap();

    std::env::set_var("HF_HOME", home.path());
    std::env::remove_var("HF_HUB_CACHE");
    std::env::set_var("HF_HUB_OFFLINE", "1");
    let c = Checkpoint::open("sfx-test/tiny-llama").unwrap();
    assert_eq!(c.config.hidden_size, 8);
    assert_eq!(
        c.tensors.tensor("model.norm.weight").unwrap().to_f32_vec(),
        vec![1.5, -2.0]
    );
    // HF_HUB_CACHE alone (as transformers honours it) and a revision pinned by commit hash.
    std::env::remove_var("HF_HOME");
    std::env::set_var("HF_HUB_CACHE", home.path().join("hub"));
    let pinned = Checkpoint::open(&format!("sfx-test/tiny-llama@{rev}")).unwrap();
    assert_eq!(pinned.config.intermediate_size, 16);
    // Not in the cache and offline: a clear error naming the repo and the reason.
    let e = Checkpoint::open("sfx-test/absent-model")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("sfx-test/absent-model") && e.contains("HF_HUB_OFFLINE"),
        "{e}"
    );
}

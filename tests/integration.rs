//! The package's CLI-level integration tests, one module per file, in one test binary: each
//! binary of its own linked the runtime and re-instantiated the model's generics (cargo's
//! timings: 9 to 32 s of compile each), and ran its slowest test alone on an idle core.
//! `chat_and_hub` stays apart (it sets HF_HOME and HF_HUB_* for its own process), and so does
//! `cuda_agreement` (its own harness). Run one file's tests by its module name:
//! `cargo test --test integration convert::`.

mod common;

mod cli_errors;
mod convert;
mod determinism;
mod eval_vs_transformers;
mod faults;
mod ggml_quant;
mod gguf_base;
mod kv;
mod qtip;
mod qtip_import;
mod refine;
mod resume;
mod sfx_model;
mod sqllm;
mod tune;

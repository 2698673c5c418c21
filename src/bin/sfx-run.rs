//! `sfx-run`: generate text with a model, or evaluate it (perplexity, KL) per the project's
//! evaluation protocol.

use anyhow::{anyhow, bail, Context, Result};
use clap::{Parser, ValueEnum};
use sfx_formats::corpus;
use sfx_formats::sfx::SfxFile;
use sfx_formats::ModelConfig;
use sfx_runtime::backend::KvDtype;
use sfx_runtime::chat::{render_chat, ChatMessage};
use sfx_runtime::eval::spec::{EvalSpec, LONG_NOVELS};
use sfx_runtime::eval::{
    evaluate, evaluate_against, long_context_part, reference_rows, window_parts, EvalPart,
    EvalResult, ModelScorer, PartResult,
};
use sfx_runtime::kv::spec::parse_fraction;
use sfx_runtime::kv::{
    new_quantized_cache, KvBaseChoice, KvConfig, KvRefineConfig, KvTierConfig, RefineBits,
};
use sfx_runtime::refine::{
    file_settings, open_refinement, plan_from_sfx, MissPolicy, MlpMode, RefineOpenOptions, Refiner,
    TierChoice,
};
use sfx_runtime::resident::ResidentKernels;
use sfx_runtime::sampling::{Sampler, SamplingParams};
use sfx_runtime::sfx_model::{is_sfx_file, load_sfx_model_on, sfx_tokenizer_json};
use sfx_runtime::{Backend, KvCache, KvShape, LogitsMode, Model, ModelOptions, WeightPrecision};
use std::io::Write;
use std::time::Instant;
use strataflux::bench::per_set;
use strataflux::device::{with_backend, DeviceChoice, OnBackend};
use strataflux::model_open::load_checkpoint_model;
use strataflux::soak::{mib, SoakSample};
use tokenizers::Tokenizer;

#[derive(Parser, Clone)]
#[command(
    name = "sfx-run",
    version,
    about = "Run a model: generate text, or measure perplexity / KL",
    long_about = "Run a model: generate text, or measure perplexity / KL.\n\n\
        MODEL is a .gguf file (on the CPU its Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and Q2_K–Q6_K weights \
        run in their own blocks; other types, and every type on CUDA, are dequantized at \
        load), a Hugging Face folder (safetensors, memory-mapped), a Hub repo id \
        (org/name[@revision]; the standard HF cache is used, HF_HUB_OFFLINE=1 forbids downloads) or a .sfx container written by sfx-convert \
        (recognised by its magic bytes; tokenizer and chat template come from its metadata). \
        A .sfx runs its low-bit resident base plus selective refinement: per token, the top-k \
        input channels per 1024 of every projection set fetch their 4-bit refinement columns \
        (or MLP neuron bundles) from the ram or ssd tier; see the \"Refinement\" options. \
        With --ppl, base and refined are measured side by side in one run.\n\n\
        Generation: sfx-run MODEL -p \"prompt\" [--chat] streams the continuation to stdout and \
        reports prompt and generation speed on stderr.\n\n\
        Evaluation: --ppl wiki:N scores the first N \
        non-overlapping 2048-token windows of the Wikipedia text (each from an empty cache); \
        --ppl austen-long:L prefills L-256 tokens of each of four Austen novels and scores the \
        last 256 one at a time through the decode path. --kl-ref MODEL adds the KL divergence to \
        a reference model on the same positions (its top 1024 tokens kept, the rest lumped).\n\n\
        Texts come from $SFX_ASSETS (default ./assets); fetch them with `sfx fetch`."
)]
struct Cli {
    /// Model: .gguf file, Hugging Face folder, Hub repo id, .sfx container, or an sfx-convert
    /// output folder (its model.sfx).
    model: String,

    /// Prompt to continue (or, with --chat, the user message).
    #[arg(short, long)]
    prompt: Option<String>,
    /// Read the prompt from a file instead.
    #[arg(long, conflicts_with = "prompt")]
    prompt_file: Option<std::path::PathBuf>,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    chat: bool,
    /// System message for --chat.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Maximum number of tokens to generate.
    #[arg(short = 'n', long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature; 0 = greedy (argmax).
    #[arg(long = "temp", default_value_t = 0.7)]
    temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens with this much probability.
    #[arg(long, default_value_t = 0.9)]
    top_p: f32,
    /// Keep only the K most probable tokens (0 = no limit).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Random seed for sampling (runs are reproducible).
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Keep generating after an end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,

    /// Soak test: generate this many tokens in this one process, as back-to-back generations
    /// of -n tokens (each from the prompt in a fresh KV cache, sampling, end-of-sequence
    /// ignored), sampling resident memory, decode speed, the bounded caches' occupancy and,
    /// on a GPU, the device memory in use every --soak-every tokens. Exits 1 when resident
    /// or device memory at some position of a later generation exceeds the second
    /// generation's at that position by more than 16 MiB (the first warms up; memory rises
    /// within each generation as its KV cache fills), or a cache holds more than its budget;
    /// speed drift is reported, not judged.
    #[arg(long, value_name = "TOKENS", help_heading = "Soak")]
    soak: Option<usize>,
    /// Tokens between two soak samples.
    #[arg(
        long,
        default_value_t = 250,
        value_name = "TOKENS",
        help_heading = "Soak"
    )]
    soak_every: usize,
    /// Write the soak's samples to this CSV file (scripts/soak_plot.py draws it).
    #[arg(long, value_name = "FILE", requires = "soak", help_heading = "Soak")]
    soak_log: Option<std::path::PathBuf>,

    /// Evaluate perplexity: wiki:N, austen-long:L, austen/<novel>:N, brown:N or FILE:N.
    #[arg(long, value_name = "SPEC")]
    ppl: Option<String>,
    /// Window length in tokens for windowed --ppl texts.
    #[arg(long, default_value_t = 2048)]
    ctx: usize,
    /// Reference model for KL divergence (same forms as MODEL, .sfx included).
    #[arg(long, value_name = "MODEL", requires = "ppl")]
    kl_ref: Option<String>,

    /// Storage of float weights: native keeps BF16 as BF16 (f32 accumulation); f32 widens.
    #[arg(long, value_enum, default_value_t = Precision::Native)]
    precision: Precision,
    /// Worker threads (default: all cores; also RAYON_NUM_THREADS).
    #[arg(short = 't', long)]
    threads: Option<usize>,
    /// Where the model runs: cpu, cuda, cuda:N, or auto (the GPU when one is present, for
    /// every model form: every resident format a .sfx holds has CUDA kernels, except GGUF
    /// blocks kept by `sfx-convert --quant gguf`, which CUDA dequantizes at load, at
    /// --precision). On the CPU, coded projections decode against int8 activation blocks of 32
    /// (as llama.cpp does); SFX_CPU_ACTIVATIONS=f32 keeps f32 activations (the reference
    /// numerics).
    #[arg(long, default_value = "auto")]
    device: DeviceChoice,
    /// Device of the --kl-ref model (default: the same as --device).
    #[arg(long, requires = "kl_ref")]
    kl_ref_device: Option<DeviceChoice>,
    /// Element type of the float KV cache: f32 or f16 (the default cache when --kv is not
    /// given).
    #[arg(long, default_value = "f32")]
    kv_dtype: String,
    /// Run every op of a decode step as its own launch instead of replaying a captured step
    /// graph (CUDA).
    #[arg(long)]
    no_graphs: bool,
    /// Print a JSON report on stdout instead of text.
    #[arg(long)]
    json: bool,

    /// .sfx: run the resident base only (no refinement).
    #[arg(long, help_heading = "Refinement (.sfx)")]
    no_refine: bool,
    /// .sfx: apply the tuning profile (MODEL.tune.json, written by `sfx tune`) of this
    /// slowdown budget, e.g. 5%. Without it the profile's default (5 %, else its smallest
    /// budget) applies when one was measured on this kind of device; --k, --s, --mlp and
    /// --bundle-k override single settings.
    #[arg(long, help_heading = "Refinement (.sfx)")]
    budget: Option<String>,
    /// .sfx: ignore the tuning profile (run the file's own budgets, or --k/--s).
    #[arg(long, help_heading = "Refinement (.sfx)", conflicts_with = "budget")]
    no_tune: bool,
    /// .sfx: refinement budgets k per 1024 input channels, one value or qkv,o,gu,d
    /// (default: the tuning profile's, else the budgets the file was fitted for). A file
    /// fitted at a ladder of k reads, per set, the largest fitted k not above the budget.
    #[arg(long, help_heading = "Refinement (.sfx)")]
    k: Option<String>,
    /// .sfx: fetch lead (qkv, gu) / lag (o, d) in blocks, multiples of 0.5: one value or
    /// qkv,o,gu,d. Lead selects channels from the residual stream s blocks earlier; lag adds
    /// the refinement s blocks later. Default: the tuning profile's, else 0.
    #[arg(long, help_heading = "Refinement (.sfx)")]
    s: Option<String>,
    /// .sfx: MLP refinement, channels or bundles (default: channels when the file has them).
    #[arg(long, help_heading = "Refinement (.sfx)")]
    mlp: Option<String>,
    /// .sfx: neurons per 1024 selected by neuron bundles (default: the file's, round(3k_d/4)).
    #[arg(long, help_heading = "Refinement (.sfx)")]
    bundle_k: Option<usize>,
    /// .sfx: read refinement from ram (memory map) or ssd (bounded RAM cache + background
    /// loader threads); default: the tier recorded in the file. With --device cuda the ram
    /// tier's columns are copied at load into page-locked host memory the GPU reads, and the
    /// selection and gather run on the GPU inside the step graph (channels, --s 0; other
    /// settings run host-driven, with a note).
    #[arg(long, help_heading = "Refinement (.sfx)")]
    refine_tier: Option<String>,
    /// .sfx, ssd tier: RAM cache budget shared by all projection sets (e.g. 1MiB, 128MiB, 2GiB).
    #[arg(long, default_value = "128MiB", help_heading = "Refinement (.sfx)")]
    weight_cache: String,
    /// .sfx, ssd tier: on a cache miss, skip (use the resident value this step, load for later
    /// steps; never blocks) or wait (read now).
    #[arg(long, default_value = "skip", help_heading = "Refinement (.sfx)")]
    miss: String,
    /// .sfx, ram tier: pin the refinement sections in RAM (mlock; best effort).
    #[arg(long, help_heading = "Refinement (.sfx)")]
    mlock: bool,
    /// .sfx with --ppl: skip the unrefined base pass (by default base and refined are both
    /// measured, side by side). With --kv: also skip each KV base's unrefined run.
    #[arg(long, help_heading = "Refinement (.sfx)")]
    no_base: bool,
    /// .sfx with --ppl: evaluate the base and then every budget of this list (k per 1024 for
    /// all four sets, e.g. 4,8,16,32,64 on a file fitted with that --k-ladder) in one call,
    /// against one pass of the --kl-ref model: what each budget buys. Other refinement
    /// settings apply to every budget as to a single run.
    #[arg(
        long,
        value_name = "LIST",
        help_heading = "Refinement (.sfx)",
        requires = "ppl"
    )]
    k_sweep: Option<String>,

    /// Resident KV format(s): f16, or KVarN K/V bits 2/2, 3/2, 3/3, 2/1 (comma list). With
    /// --ppl austen-long:L every format is evaluated with and without KV refinement, side by
    /// side, against an FP16-KV reference. Generation uses the last configuration.
    #[arg(long, value_name = "LIST", help_heading = "KV cache")]
    kv: Option<String>,
    /// KV refinement bits +K/+V (comma list), `auto` (+4/+4; +0/+1 for 1-bit values) or `off`.
    #[arg(long, default_value = "auto", help_heading = "KV cache")]
    kv_refine: String,
    /// Tokens per refinement group, 2 or 4 (comma list for sweeps).
    #[arg(long, default_value = "2", help_heading = "KV cache")]
    kv_group: String,
    /// Fraction of eligible token groups refined per step and KV head, e.g. 1/128 (comma list).
    #[arg(long, default_value = "1/128", help_heading = "KV cache")]
    kv_fraction: String,
    /// Leading positions kept in FP16 (attention sinks).
    #[arg(long, default_value_t = 128, help_heading = "KV cache")]
    kv_sinks: usize,
    /// Backing tier of KV refinement bits: ram (on a GPU: page-locked host memory the
    /// attention reads directly), vram (device memory beside the tiles; on the CPU the same as
    /// ram), or ssd (a per-session spill file behind a RAM cache of --kv-cache bytes; runs in
    /// the host cache); comma list for sweeps.
    #[arg(long, default_value = "ram", help_heading = "KV cache")]
    kv_tier: String,
    /// ssd tier: RAM cache budget for KV refinement, shared by all layers and heads (comma
    /// list for sweeps).
    #[arg(long, default_value = "128MiB", help_heading = "KV cache")]
    kv_cache: String,
    /// ssd tier: on a cache miss, skip (resident value this step, load in the background) or
    /// wait (read now).
    #[arg(long, default_value = "skip", help_heading = "KV cache")]
    kv_miss: String,
    /// ssd tier: directory of the spill file (default: the system temp dir).
    #[arg(long, help_heading = "KV cache")]
    kv_spill_dir: Option<std::path::PathBuf>,
}

/// "128MiB", "4 MiB", "1GiB", "512KiB", "1000000" → bytes.
fn parse_bytes(flag: &str, s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| anyhow!("--{flag} {s:?}: expected a size like 128MiB"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" | "kib" => 1024.0,
        "m" | "mb" | "mib" => 1024.0 * 1024.0,
        "g" | "gb" | "gib" => 1024.0 * 1024.0 * 1024.0,
        other => bail!("--{flag} {s:?}: unknown unit {other:?} (use KiB, MiB, GiB)"),
    };
    Ok((n * mult) as u64)
}

/// The refinement engine for a `.sfx` model, per the CLI options; `None` for float models,
/// `--no-refine`, files without refinement, or refinement that failed verification (then
/// with one warning).
fn build_refiner<B: Backend>(cli: &Cli, loaded: &Loaded<B>) -> Result<Option<Refiner<B>>> {
    let Some((path, file)) = &loaded.sfx else {
        return Ok(None);
    };
    if cli.no_refine {
        return Ok(None);
    }
    let profile = tuning_profile(cli, path, file, &loaded.model.backend().name())?;
    if let Some(p) = &profile {
        if p.k == [0; 4] && cli.k.is_none() {
            eprintln!(
                "tuning profile: nothing fits the {:.1} % budget on this machine; running the \
                 resident base",
                100.0 * p.budget
            );
            return Ok(None);
        }
    }
    let k = match &cli.k {
        Some(k) => Some(per_set("k", k)?),
        None => profile.as_ref().map(|p| p.k),
    };
    let plan = plan_from_sfx(file, &loaded.info.config, k)?;
    let mut settings = file_settings(file, &plan);
    if let Some(k) = k {
        settings.k = k;
        settings.bundle_k = sfx_runtime::refine::bundle_budget(k[3]);
    }
    settings.s = match (&cli.s, &profile) {
        (Some(s), _) => per_set("s", s)?,
        (None, Some(p)) => p.s,
        (None, None) => [0.0; 4],
    };
    let mlp = cli
        .mlp
        .clone()
        .or_else(|| profile.as_ref().map(|p| p.mlp.clone()));
    if let Some(m) = &mlp {
        settings.mlp = match m.as_str() {
            "channels" => MlpMode::Channels,
            "bundles" => MlpMode::Bundles,
            other => bail!("--mlp {other:?}: expected channels or bundles"),
        };
    }
    if let (None, Some(p)) = (cli.k.as_ref(), &profile) {
        settings.bundle_k = p.bundle_k;
    }
    if let Some(n) = cli.bundle_k {
        settings.bundle_k = n;
    }
    let options = RefineOpenOptions {
        tier: match cli.refine_tier.as_deref() {
            None => TierChoice::AsStored,
            Some("ram") => TierChoice::Ram,
            Some("ssd") => TierChoice::Ssd,
            Some(other) => bail!("--refine-tier {other:?}: expected ram or ssd"),
        },
        cache_bytes: parse_bytes("weight-cache", &cli.weight_cache)?,
        miss: match cli.miss.as_str() {
            "skip" => MissPolicy::Skip,
            "wait" => MissPolicy::Wait,
            other => bail!("--miss {other:?}: expected skip or wait"),
        },
        mlock: cli.mlock,
        ..RefineOpenOptions::default()
    };
    let warn = |m: &str| eprintln!("{m}");
    Ok(open_refinement(
        loaded.model.backend(),
        file,
        path,
        plan,
        Some(settings),
        &options,
        &warn,
    )?)
}

/// The tuning profile this run applies (module docs of `strataflux::tune`): `--budget`'s, or
/// the default of the profile measured on this machine (or another of the same device kind,
/// with a note); `None` with `--no-tune`, without a sidecar, or without a profile for this
/// kind of device. A `--budget` that cannot be honoured is an error.
fn tuning_profile(
    cli: &Cli,
    path: &std::path::Path,
    file: &SfxFile,
    backend_name: &str,
) -> Result<Option<sfx_formats::tune::BudgetProfile>> {
    use sfx_formats::tune::{parse_budget, sidecar_path, TuneFile};
    if cli.no_tune {
        return Ok(None);
    }
    let budget = cli
        .budget
        .as_deref()
        .map(|b| {
            parse_budget(b).ok_or_else(|| anyhow!("--budget {b:?}: expected a percentage like 5%"))
        })
        .transpose()?;
    let sidecar = sidecar_path(path);
    let tune = match TuneFile::read(&sidecar, &file.content_digest()) {
        Ok(t) => t,
        Err(e) if budget.is_none() => {
            eprintln!("warning: tuning profile ignored: {e}");
            None
        }
        Err(e) => return Err(e.into()),
    };
    let Some(tune) = tune else {
        if budget.is_some() {
            bail!(
                "--budget: {} has no tuning profile ({} does not exist): run `sfx tune {}` first",
                path.display(),
                sidecar.display(),
                path.display()
            );
        }
        return Ok(None);
    };
    let machine = strataflux::tune::machine_for(backend_name);
    let Some((entry, exact)) = tune.for_machine(&machine, cli.refine_tier.as_deref()) else {
        if budget.is_some() {
            let stand_ins: Vec<&str> = tune
                .machines
                .iter()
                .filter(|m| m.machine.device == machine.device)
                .filter_map(|m| m.speed_model.as_deref())
                .collect();
            let also = if stand_ins.is_empty() {
                String::new()
            } else {
                format!(
                    " (its profiles timed on {} describe another model's speed and are never \
                     applied)",
                    stand_ins.join(", ")
                )
            };
            bail!(
                "--budget: {} has no profile measured on a {} device{also}: run `sfx tune \
                 --device {}` here",
                sidecar.display(),
                machine.device,
                machine.device
            );
        }
        return Ok(None);
    };
    let profile = match budget {
        Some(b) => entry.budget(b).ok_or_else(|| {
            let have: Vec<String> = entry
                .profiles
                .iter()
                .map(|p| format!("{}%", 100.0 * p.budget))
                .collect();
            anyhow!(
                "--budget {:.1}%: not tuned on this machine (tuned: {}); run sfx tune --budget",
                100.0 * b,
                have.join(", ")
            )
        })?,
        None => match entry.default_profile() {
            Some(p) => p,
            None => return Ok(None),
        },
    };
    {
        let (k, s) = profile.k_and_s();
        eprintln!(
            "tuning profile: {:.1} % budget: k {k} s {s} {}; measured {:+.1} % slower, KL {}{}",
            100.0 * profile.budget,
            profile.mlp,
            100.0 * profile.remeasured_slowdown,
            profile
                .kl
                .map_or("not measured".into(), |v| format!("{v:.4}")),
            if exact {
                String::new()
            } else {
                format!(
                    " (measured on another machine: {})",
                    entry.machine.description
                )
            }
        );
    }
    Ok(Some(profile.clone()))
}

/// JSON record of a refinement run: settings, engine counters and tier statistics.
fn refine_report<B: Backend>(r: &Refiner<B>, options_tier: &Option<String>) -> serde_json::Value {
    let c = r.counters();
    let st = r.store_stats();
    let tokens = c.tokens.max(1) as f64;
    serde_json::json!({
        "settings": r.settings(),
        "tier": options_tier.clone().unwrap_or_else(|| "as stored".into()),
        "engine": if r.in_backend() { "backend" } else { "host-driven" },
        "backend_column_bytes": r.backend_bytes(),
        "counters": c,
        "store": st,
        "fetched_bytes_per_token": c.bytes_applied as f64 / tokens,
        "selected_units_per_token": c.units_selected as f64 / tokens,
        "applied_fraction": c.units_applied as f64 / (c.units_selected.max(1)) as f64,
        "cache_hit_rate": st.hit_rate(),
    })
}

#[derive(Clone, Copy, ValueEnum)]
enum Precision {
    Native,
    F32,
    Bf16,
}

impl From<Precision> for WeightPrecision {
    fn from(p: Precision) -> Self {
        match p {
            Precision::Native => WeightPrecision::Native,
            Precision::F32 => WeightPrecision::F32,
            Precision::Bf16 => WeightPrecision::Bf16,
        }
    }
}

/// What the CLI needs besides the model: where it came from, its config and the tokenizer
/// side files. Filled from a checkpoint (float path) or from a `.sfx` container's metadata.
struct ModelInfo {
    origin: String,
    config: ModelConfig,
    tokenizer_config: Option<serde_json::Value>,
    /// `generation_config.json`; a `.sfx` container does not carry one (the eos ids come from
    /// the config and the tokenizer config).
    generation_config: Option<serde_json::Value>,
}

impl ModelInfo {
    fn chat_template(&self) -> Option<&str> {
        self.tokenizer_config
            .as_ref()?
            .get("chat_template")?
            .as_str()
    }
}

struct Loaded<B: Backend> {
    info: ModelInfo,
    model: Model<B>,
    /// The container and its path when the model is a `.sfx` (its refinement is read from it).
    sfx: Option<(std::path::PathBuf, SfxFile)>,
    tokenizer: Tokenizer,
    load_seconds: f64,
}

/// Refuses to report results computed from a `.sfx` that changed on disk during the run: after
/// a truncation or an in-place rewrite, bytes read through its map (the ram tier's refinement)
/// may not be the verified ones. A file replaced by a rename is another inode and passes.
fn ensure_model_unchanged<B: Backend>(loaded: &Loaded<B>) -> Result<()> {
    if let Some((_, file)) = &loaded.sfx {
        file.check_unchanged()
            .context("refusing to report this run's results")?;
    }
    Ok(())
}

/// Load-time options from the command line.
fn model_options(cli: &Cli) -> Result<ModelOptions> {
    Ok(ModelOptions {
        precision: cli.precision.into(),
        kv_dtype: match cli.kv_dtype.as_str() {
            "f32" => KvDtype::F32,
            "f16" => KvDtype::F16,
            other => bail!("--kv-dtype {other:?}: expected f32 or f16"),
        },
        step_graphs: !cli.no_graphs,
        ..ModelOptions::default()
    })
}

fn load<B: ResidentKernels>(backend: B, spec: &str, cli: &Cli) -> Result<Loaded<B>> {
    // A `.sfx` container is recognised by its magic bytes, not its name, so a renamed file
    // still loads and a folder or GGUF never takes this path.
    if is_sfx_file(std::path::Path::new(spec)) {
        return load_sfx(backend, spec, cli);
    }
    let t0 = Instant::now();
    let options = model_options(cli)?;
    let (model, ckpt) = load_checkpoint_model(backend, spec, &options)?;
    let json = ckpt
        .tokenizer_json
        .as_deref()
        .ok_or_else(|| anyhow!("{spec}: no tokenizer.json"))?;
    let tokenizer = Tokenizer::from_bytes(json.as_bytes())
        .map_err(|e| anyhow!("{spec}: tokenizer.json: {e}"))?;
    Ok(Loaded {
        info: ModelInfo {
            origin: ckpt.origin,
            config: ckpt.config,
            tokenizer_config: ckpt.tokenizer_config,
            generation_config: ckpt.generation_config,
        },
        model,
        sfx: None,
        tokenizer,
        load_seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Loads the resident base of a converter-written `.sfx` container (refinement sections are
/// not used yet); tokenizer and chat template come from its metadata. `precision` applies to
/// the float tables (embedding, untied head) as for float models.
fn load_sfx<B: ResidentKernels>(backend: B, spec: &str, cli: &Cli) -> Result<Loaded<B>> {
    let t0 = Instant::now();
    let file = SfxFile::open(spec).with_context(|| format!("opening model {spec}"))?;
    let options = model_options(cli)?;
    let model = load_sfx_model_on(backend, &file, &options)
        .with_context(|| format!("loading model {spec}"))?;
    let json = sfx_tokenizer_json(&file)
        .ok_or_else(|| anyhow!("{spec}: the container's metadata has no tokenizer_json"))?;
    let tokenizer = Tokenizer::from_bytes(json.as_bytes())
        .map_err(|e| anyhow!("{spec}: embedded tokenizer.json: {e}"))?;
    let meta = file.metadata();
    Ok(Loaded {
        info: ModelInfo {
            origin: spec.to_string(),
            config: model.config().clone(),
            tokenizer_config: meta.tokenizer_config.clone(),
            generation_config: None,
        },
        model,
        sfx: Some((std::path::PathBuf::from(spec), file)),
        tokenizer,
        load_seconds: t0.elapsed().as_secs_f64(),
    })
}

fn main() -> Result<()> {
    let mut cli = Cli::parse();
    cli.model = sfx_formats::package::container_spec(&cli.model);
    // Before any file is mapped: a model truncated under the run ends it with a message.
    strataflux::mapped::exit_clearly_on_sigbus(std::path::Path::new(&cli.model));
    if let Some(n) = cli.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("configuring the thread pool")?;
    }
    if cli.ppl.is_some() && (cli.prompt.is_some() || cli.prompt_file.is_some()) {
        bail!("--ppl and --prompt are separate modes; run them separately");
    }
    with_backend(cli.device, Main(&cli))
}

/// The whole command on the chosen backend.
struct Main<'a>(&'a Cli);

impl OnBackend for Main<'_> {
    type Output = ();
    fn run<B: ResidentKernels>(self, backend: B) -> Result<()> {
        let cli = self.0;
        let loaded = load(backend, &cli.model, cli)?;
        if !cli.json {
            eprintln!(
                "loaded {} ({:?}, {} layers, {:.1} MB resident) in {:.1} s on {}",
                loaded.info.origin,
                loaded.info.config.arch,
                loaded.info.config.num_hidden_layers,
                loaded.model.resident_bytes() as f64 / 1e6,
                loaded.load_seconds,
                loaded.model.backend().name()
            );
        }
        if let Some(spec) = cli.ppl.clone() {
            return run_eval(cli, &loaded, &spec);
        }
        let prompt = match (&cli.prompt, &cli.prompt_file) {
            (Some(p), _) => p.clone(),
            (None, Some(f)) => std::fs::read_to_string(f)
                .with_context(|| format!("reading prompt file {}", f.display()))?,
            (None, None) => bail!("nothing to do: give a prompt (-p) or an evaluation (--ppl)"),
        };
        let mut refiner = build_refiner(cli, &loaded)?;
        if let Some(tokens) = cli.soak {
            return soak(cli, &loaded, &prompt, refiner.as_mut(), tokens);
        }
        generate(cli, &loaded, &prompt, refiner.as_mut())
    }
}

/// Text of a special token, for chat templates that reference `bos_token` / `eos_token`.
fn special_token<B: Backend>(loaded: &Loaded<B>, key: &str, id: Option<u32>) -> String {
    let from_config = loaded
        .info
        .tokenizer_config
        .as_ref()
        .and_then(|c| c.get(key))
        .and_then(|v| {
            v.as_str()
                .or_else(|| v.get("content").and_then(|c| c.as_str()))
        })
        .map(str::to_string);
    from_config
        .or_else(|| id.and_then(|i| loaded.tokenizer.id_to_token(i)))
        .unwrap_or_default()
}

fn eos_ids<B: Backend>(loaded: &Loaded<B>) -> Vec<u32> {
    let mut ids = loaded.info.config.eos_token_ids.clone();
    if let Some(g) = loaded
        .info
        .generation_config
        .as_ref()
        .and_then(|g| g.get("eos_token_id"))
    {
        let extra: Vec<u32> = match g {
            serde_json::Value::Array(a) => a
                .iter()
                .filter_map(|v| v.as_u64())
                .map(|v| v as u32)
                .collect(),
            v => v.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
        };
        ids.extend(extra);
    }
    if let Some(t) = loaded
        .tokenizer
        .token_to_id(&special_token(loaded, "eos_token", None))
    {
        ids.push(t);
    }
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// The prompt's token ids (through the chat template with --chat), checked against the
/// model's context.
fn prompt_token_ids<B: Backend>(cli: &Cli, loaded: &Loaded<B>, prompt: &str) -> Result<Vec<u32>> {
    let text = if cli.chat {
        let template = loaded.info.chat_template().ok_or_else(|| {
            anyhow!(
                "{}: the model has no chat template (drop --chat)",
                cli.model
            )
        })?;
        let mut messages = Vec::new();
        if let Some(s) = &cli.system {
            messages.push(ChatMessage {
                role: "system".into(),
                content: s.clone(),
            });
        }
        messages.push(ChatMessage {
            role: "user".into(),
            content: prompt.to_string(),
        });
        let bos = special_token(loaded, "bos_token", loaded.info.config.bos_token_id);
        let eos = special_token(
            loaded,
            "eos_token",
            loaded.info.config.eos_token_ids.first().copied(),
        );
        render_chat(template, &messages, true, &bos, &eos)?
    } else {
        prompt.to_string()
    };
    // The chat template writes special tokens as text; they must be parsed as such.
    let encoding = loaded
        .tokenizer
        .encode(text.as_str(), false)
        .map_err(|e| anyhow!("tokenizing the prompt: {e}"))?;
    let prompt_ids: Vec<u32> = encoding.get_ids().to_vec();
    if prompt_ids.is_empty() {
        bail!("the prompt is empty after tokenization");
    }
    let max_ctx = loaded.info.config.max_position_embeddings;
    if prompt_ids.len() >= max_ctx {
        bail!(
            "prompt has {} tokens; the model's context is {max_ctx}",
            prompt_ids.len()
        );
    }
    Ok(prompt_ids)
}

/// A fresh KV cache of `capacity` positions as the options ask (--kv, else the float cache of
/// --kv-dtype), and its label for reports.
fn new_kv_cache<B: Backend>(
    cli: &Cli,
    model: &Model<B>,
    capacity: usize,
) -> Result<(Box<dyn KvCache<B>>, String)> {
    let kv_config = kv_configs(cli)?.pop();
    let kv_label = kv_config
        .as_ref()
        .map_or_else(|| cli.kv_dtype.clone(), KvConfig::label);
    let cache: Box<dyn KvCache<B>> = match &kv_config {
        Some(config) => new_quantized_cache(
            model.backend(),
            KvShape::of(model.config()),
            capacity,
            config,
        )?,
        None => Box::new(model.new_cache(capacity)?),
    };
    Ok((cache, kv_label))
}

fn generate<B: Backend>(
    cli: &Cli,
    loaded: &Loaded<B>,
    prompt: &str,
    mut refiner: Option<&mut Refiner<B>>,
) -> Result<()> {
    let prompt_ids = prompt_token_ids(cli, loaded, prompt)?;
    let max_ctx = loaded.info.config.max_position_embeddings;
    let capacity = (prompt_ids.len() + cli.max_tokens).min(max_ctx);
    let model = &loaded.model;
    let (mut cache, kv_label) = new_kv_cache(cli, model, capacity)?;
    let mut sampler = Sampler::new(SamplingParams {
        temperature: cli.temperature,
        top_p: cli.top_p,
        top_k: cli.top_k,
        seed: cli.seed,
    });
    let eos = eos_ids(loaded);

    let t0 = Instant::now();
    let logits = last_logits(model, refiner.as_deref_mut(), &prompt_ids, cache.as_mut())?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let mut next = sampler.sample(logits.last().ok_or_else(|| anyhow!("no logits"))?);

    let mut generated: Vec<u32> = Vec::new();
    let mut printed = 0usize;
    let mut stdout = std::io::stdout().lock();
    if !cli.json && !cli.chat {
        write!(stdout, "{prompt}")?;
    }
    let t1 = Instant::now();
    let mut stop_reason = "length";
    while generated.len() < cli.max_tokens {
        if !cli.ignore_eos && eos.contains(&next) {
            stop_reason = "eos";
            break;
        }
        generated.push(next);
        if !cli.json {
            // Decode everything so far and print the new suffix: byte-level BPE tokens can
            // split a UTF-8 character, so hold back text ending in a replacement character.
            let text = loaded
                .tokenizer
                .decode(&generated, true)
                .map_err(|e| anyhow!("decoding: {e}"))?;
            if !text.ends_with('\u{FFFD}') && text.len() > printed {
                write!(stdout, "{}", &text[printed..])?;
                stdout.flush()?;
                printed = text.len();
            }
        }
        if cache.len() >= capacity {
            stop_reason = "context";
            break;
        }
        let logits = last_logits(model, refiner.as_deref_mut(), &[next], cache.as_mut())?;
        next = sampler.sample(logits.last().ok_or_else(|| anyhow!("no logits"))?);
    }
    let gen_s = t1.elapsed().as_secs_f64();
    ensure_model_unchanged(loaded)?;
    let refine = refiner
        .as_deref()
        .map(|r| refine_report(r, &cli.refine_tier));
    let text = loaded
        .tokenizer
        .decode(&generated, true)
        .map_err(|e| anyhow!("decoding: {e}"))?;
    if !cli.json && text.len() > printed {
        write!(stdout, "{}", &text[printed..])?;
    }
    let prompt_tps = prompt_ids.len() as f64 / prefill_s.max(1e-9);
    // The first generated token comes from the prefill; decode steps = generated - 1.
    let decode_steps = generated.len().saturating_sub(1);
    let gen_tps = decode_steps as f64 / gen_s.max(1e-9);
    if cli.json {
        let v = serde_json::json!({
            "model": loaded.info.origin,
            "prompt": prompt,
            "completion": text,
            "kv_cache": {
                "config": kv_label,
                "resident_bytes": cache.resident_bytes(),
            },
            "prompt_tokens": prompt_ids.len(),
            "generated_tokens": generated.len(),
            "stop_reason": stop_reason,
            "prompt_tokens_per_second": prompt_tps,
            "generation_tokens_per_second": gen_tps,
            "refine": refine,
            "threads": rayon::current_num_threads(),
            "backend": model.backend().name(),
        });
        writeln!(stdout, "{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        writeln!(stdout)?;
        eprintln!(
            "prompt: {} tokens, {:.1} tok/s | generation: {} tokens, {:.2} tok/s | stop: {}",
            prompt_ids.len(),
            prompt_tps,
            generated.len(),
            gen_tps,
            stop_reason
        );
        if let Some(r) = &refine {
            eprintln!(
                "refinement: {:.0} bytes/token fetched, {:.1} units selected/token, {:.1} % applied, cache hit rate {:.3}",
                r["fetched_bytes_per_token"].as_f64().unwrap_or(0.0),
                r["selected_units_per_token"].as_f64().unwrap_or(0.0),
                100.0 * r["applied_fraction"].as_f64().unwrap_or(0.0),
                r["cache_hit_rate"].as_f64().unwrap_or(0.0)
            );
        }
    }
    Ok(())
}

/// The last position's logits of a forward of `ids`, refined when there is a refiner.
fn last_logits<B: Backend>(
    model: &Model<B>,
    refiner: Option<&mut Refiner<B>>,
    ids: &[u32],
    cache: &mut dyn KvCache<B>,
) -> Result<sfx_runtime::Logits> {
    Ok(match refiner {
        Some(r) => model.forward_refined(ids, cache, LogitsMode::Last, r)?,
        None => model.forward(ids, cache, LogitsMode::Last)?,
    })
}

/// `--soak TOKENS`: generations of -n tokens back to back until TOKENS are generated, sampled
/// every --soak-every tokens (strataflux::soak says what is judged).
fn soak<B: Backend>(
    cli: &Cli,
    loaded: &Loaded<B>,
    prompt: &str,
    mut refiner: Option<&mut Refiner<B>>,
    total: usize,
) -> Result<()> {
    if cli.soak_every == 0 || total == 0 {
        bail!("--soak and --soak-every must be at least 1");
    }
    let prompt_ids = prompt_token_ids(cli, loaded, prompt)?;
    let max_ctx = loaded.info.config.max_position_embeddings;
    // The prompt's prefill yields the first token; -n decode steps follow within the context.
    let per_generation = cli.max_tokens.min(max_ctx - prompt_ids.len());
    if per_generation == 0 {
        bail!("-n 0: a soak needs tokens per generation");
    }
    let model = &loaded.model;
    let mut sampler = Sampler::new(SamplingParams {
        temperature: cli.temperature,
        top_p: cli.top_p,
        top_k: cli.top_k,
        seed: cli.seed,
    });
    let weight_budget = refiner.as_deref().and_then(|r| r.store_cache_budget());
    let mut samples: Vec<SoakSample> = Vec::new();
    let (mut done, mut generation) = (0usize, 0usize);
    let (mut interval_s, mut interval_steps) = (0.0f64, 0usize);
    let started = Instant::now();
    let mut kv_label = String::new();
    while done < total {
        let (mut cache, label) = new_kv_cache(cli, model, prompt_ids.len() + per_generation)?;
        kv_label = label;
        let logits = last_logits(model, refiner.as_deref_mut(), &prompt_ids, cache.as_mut())?;
        let mut next = sampler.sample(logits.last().ok_or_else(|| anyhow!("no logits"))?);
        for position in 1..=per_generation {
            if done == total {
                break;
            }
            let t = Instant::now();
            let logits = last_logits(model, refiner.as_deref_mut(), &[next], cache.as_mut())?;
            interval_s += t.elapsed().as_secs_f64();
            interval_steps += 1;
            next = sampler.sample(logits.last().ok_or_else(|| anyhow!("no logits"))?);
            done += 1;
            if done % cli.soak_every != 0 && done != total {
                continue;
            }
            let (rss, peak) = strataflux::soak::process_memory()?;
            let kv = cache.tier_bytes();
            let weight_cache = refiner.as_deref().map(|r| r.store_stats().cache_bytes);
            let s = SoakSample {
                tokens: done,
                generation,
                position,
                tokens_per_second: interval_steps as f64 / interval_s.max(1e-9),
                rss_bytes: rss,
                rss_peak_bytes: peak,
                weight_cache_bytes: weight_budget.and(weight_cache),
                weight_cache_budget: weight_budget,
                kv_cache_bytes: kv
                    .as_ref()
                    .filter(|b| b.tier.cache_budget > 0)
                    .map(|b| b.tier.cache),
                kv_cache_budget: kv.as_ref().map(|b| b.tier.cache_budget).filter(|&b| b > 0),
                device_bytes: model.backend().device_memory_in_use()?,
            };
            (interval_s, interval_steps) = (0.0, 0);
            if !cli.json {
                eprintln!(
                    "soak {done}/{total} tokens (generation {generation}, position {position}): \
                     {:.1} tok/s, RSS {:.1} MiB{}{}{}",
                    s.tokens_per_second,
                    mib(s.rss_bytes),
                    s.device_bytes.map_or_else(String::new, |b| format!(
                        ", device memory {:.1} MiB",
                        mib(b)
                    )),
                    s.weight_cache_bytes
                        .map_or_else(String::new, |b| format!(", refinement cache {b} B")),
                    s.kv_cache_bytes
                        .map_or_else(String::new, |b| format!(", KV spill cache {b} B")),
                );
            }
            samples.push(s);
        }
        generation += 1;
    }
    ensure_model_unchanged(loaded)?;
    let summary = strataflux::soak::summarize(&samples, generation);
    if let Some(path) = &cli.soak_log {
        strataflux::soak::write_csv(path, &samples)?;
    }
    let wall_s = started.elapsed().as_secs_f64();
    if cli.json {
        let v = serde_json::json!({
            "model": loaded.info.origin,
            "kv_cache": kv_label,
            "tokens_per_generation": per_generation,
            "wall_seconds": wall_s,
            "summary": summary,
            "samples": samples,
            "threads": rayon::current_num_threads(),
            "backend": model.backend().name(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        eprintln!(
            "soak: {} tokens in {} generations of {per_generation} ({kv_label} KV) in {wall_s:.0} s; \
             RSS {:.1} MiB at most in the second generation, {:.1} at most after it, last {:.1} \
             (growth at like positions {:.2} MiB){}; \
             decode {:.1} tok/s in the first generation, {:.1} in the last ({:+.1} %)",
            summary.tokens,
            summary.generations,
            mib(summary.rss_reference_bytes),
            mib(summary.rss_max_bytes),
            mib(summary.rss_last_bytes),
            mib(summary.rss_growth_bytes),
            summary
                .device_growth_bytes
                .map_or_else(String::new, |g| format!(
                    "; device memory {:.1} MiB at most in the second generation, {:.1} after \
                     it (growth at like positions {:.2} MiB)",
                    mib(summary.device_reference_bytes.unwrap_or(0)),
                    mib(summary.device_max_bytes.unwrap_or(0)),
                    mib(g)
                )),
            summary.first_generation_tokens_per_second,
            summary.last_generation_tokens_per_second,
            100.0 * summary.speed_drift
        );
    }
    if !summary.failures.is_empty() {
        bail!("soak failed: {}", summary.failures.join("; "));
    }
    Ok(())
}

fn tokenize(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    // Protocol: the whole canonical text, no BOS, no special tokens.
    Ok(tokenizer
        .encode_fast(text, false)
        .map_err(|e| anyhow!("tokenizing: {e}"))?
        .get_ids()
        .to_vec())
}

fn eval_parts<B: Backend>(
    loaded: &Loaded<B>,
    spec: &EvalSpec,
    verbose: bool,
) -> Result<(Vec<EvalPart>, serde_json::Value)> {
    let assets = corpus::assets_dir();
    match spec {
        EvalSpec::Windows {
            text,
            windows,
            window,
        } => {
            let body = corpus::load_named_text(&assets, text).with_context(|| {
                format!("loading text '{text}' (assets in {})", assets.display())
            })?;
            let ids = tokenize(&loaded.tokenizer, &body)?;
            let parts = window_parts(&ids, *window, *windows);
            if parts.is_empty() {
                bail!(
                    "text '{text}' has {} tokens: not one full window of {window}",
                    ids.len()
                );
            }
            if parts.len() < *windows && verbose {
                eprintln!(
                    "note: '{text}' has {} tokens: only {} windows of {window} (asked for {windows})",
                    ids.len(),
                    parts.len()
                );
            }
            let meta = serde_json::json!({"text": text, "text_tokens": ids.len(), "window": window, "windows": parts.len()});
            Ok((parts, meta))
        }
        EvalSpec::AustenLong { context, scored } => {
            let mut parts = Vec::new();
            let mut lens = serde_json::Map::new();
            for novel in LONG_NOVELS {
                let body = corpus::austen_text(&assets, novel).with_context(|| {
                    format!("loading austen/{novel} (assets in {})", assets.display())
                })?;
                let ids = tokenize(&loaded.tokenizer, &body)?;
                if ids.len() < *context {
                    bail!(
                        "austen/{novel} has {} tokens, fewer than the context {context}",
                        ids.len()
                    );
                }
                lens.insert(novel.to_string(), ids.len().into());
                parts.push(long_context_part(novel, &ids, *context, *scored));
            }
            let meta = serde_json::json!({"text": "austen-long", "context": context, "scored_per_novel": scored, "text_tokens": lens});
            Ok((parts, meta))
        }
    }
}

fn run_eval<B: ResidentKernels>(cli: &Cli, loaded: &Loaded<B>, spec_str: &str) -> Result<()> {
    let spec = EvalSpec::parse(spec_str, Some(cli.ctx))?;
    if cli.kv.is_some() {
        return run_kv_eval(cli, loaded, spec_str, &spec);
    }
    let Some(r) = &cli.kl_ref else {
        return eval_against::<B, B>(cli, loaded, None, spec_str, &spec);
    };
    // The reference may live on another device (--kl-ref-device): CPU vs CUDA agreement.
    let device = cli.kl_ref_device.unwrap_or(cli.device);
    with_backend(
        device,
        RefTask {
            cli,
            loaded,
            spec_str,
            spec: &spec,
            reference: r,
        },
    )
}

/// An evaluation with its KL reference loaded on its own backend.
struct RefTask<'a, B: Backend> {
    cli: &'a Cli,
    loaded: &'a Loaded<B>,
    spec_str: &'a str,
    spec: &'a EvalSpec,
    reference: &'a str,
}

impl<B: Backend> OnBackend for RefTask<'_, B> {
    type Output = ();
    fn run<R: ResidentKernels>(self, backend: R) -> Result<()> {
        let cli = self.cli;
        let l = load(backend.with_reference_numerics(), self.reference, cli)?;
        if !cli.json {
            eprintln!(
                "KL reference {} loaded in {:.1} s on {}",
                l.info.origin,
                l.load_seconds,
                l.model.backend().name()
            );
        }
        eval_against(cli, self.loaded, Some(&l), self.spec_str, self.spec)
    }
}

fn eval_against<B: Backend, R: Backend>(
    cli: &Cli,
    loaded: &Loaded<B>,
    reference: Option<&Loaded<R>>,
    spec_str: &str,
    spec: &EvalSpec,
) -> Result<()> {
    let (parts, meta) = eval_parts(loaded, spec, !cli.json)?;
    let longest = parts.iter().map(|p| p.tokens.len()).max().unwrap_or(0);
    let max_ctx = loaded.info.config.max_position_embeddings;
    if longest > max_ctx {
        bail!("evaluation needs {longest} positions; the model's context is {max_ctx}");
    }
    let mut ref_scorer = match reference {
        Some(r) => Some(ModelScorer::new(&r.model, longest)?),
        None => None,
    };
    if let Some(list) = &cli.k_sweep {
        return eval_k_sweep(cli, loaded, ref_scorer, &parts, &meta, spec_str, list);
    }
    let mut refiner = build_refiner(cli, loaded)?;
    // Base and refined side by side in one run (speed ratios are only meaningful that way).
    let passes: &[bool] = match (&refiner, cli.no_base) {
        (None, _) => &[false],
        (Some(_), true) => &[true],
        (Some(_), false) => &[false, true],
    };
    if !cli.json {
        eprintln!(
            "evaluating {spec_str}: {} part(s), {} scored tokens{}",
            parts.len(),
            parts
                .iter()
                .map(|p| p.tokens.len() - p.first_scored)
                .sum::<usize>(),
            if passes.len() == 2 {
                ", base then refined"
            } else {
                ""
            }
        );
    }
    let json = cli.json;
    let mut runs = Vec::new();
    for &refined in passes {
        let mut scorer = match (refined, refiner.take()) {
            (true, Some(r)) => ModelScorer::with_refiner(&loaded.model, longest, r)?,
            (_, r) => {
                refiner = r;
                ModelScorer::new(&loaded.model, longest)?
            }
        };
        let t0 = Instant::now();
        let (mut nll_sum, mut nll_count) = (0.0f64, 0u64);
        if !json && passes.len() == 2 {
            eprint!("{}: ", if refined { "refined" } else { "base" });
        }
        let progress = |done: usize, total: usize, r: &PartResult| {
            if json {
                return;
            }
            // llama-perplexity prints the running PPL after each chunk: "[1]12.34,[2]..."
            nll_sum += r.ppl.mean_nll * r.ppl.tokens as f64;
            nll_count += r.ppl.tokens;
            let so_far = (nll_sum / nll_count.max(1) as f64).exp();
            eprint!("[{done}]{so_far:.4},");
            if done == total {
                eprintln!();
            }
        };
        let result = evaluate(&parts, &mut scorer, ref_scorer.as_mut(), progress)?;
        let seconds = t0.elapsed().as_secs_f64();
        let report = scorer.refiner().map(|r| refine_report(r, &cli.refine_tier));
        runs.push(EvalRun {
            refined,
            result,
            seconds,
            refine: report,
        });
    }
    report_eval(cli, loaded, spec_str, &meta, &runs)
}

/// `--k-sweep`: the base and each budget against one reference pass (the reference's
/// predictions are reduced once to [`sfx_runtime::eval::ReferenceRow`]s and kept).
#[allow(clippy::too_many_arguments)]
fn eval_k_sweep<B: Backend, R: Backend>(
    cli: &Cli,
    loaded: &Loaded<B>,
    reference: Option<ModelScorer<'_, R>>,
    parts: &[EvalPart],
    meta: &serde_json::Value,
    spec_str: &str,
    list: &str,
) -> Result<()> {
    let ks = strataflux::bench::parse_list("--k-sweep", list, true)?;
    if let Some(k) = ks.iter().find(|&&k| k > 1024) {
        bail!("--k-sweep {list:?}: {k} is more than the 1024 channels a budget is counted in");
    }
    if loaded.sfx.is_none() || cli.no_refine {
        bail!("--k-sweep needs a .sfx model with refinement (and no --no-refine)");
    }
    let longest = parts.iter().map(|p| p.tokens.len()).max().unwrap_or(0);
    let t0 = Instant::now();
    let rows = match reference {
        Some(mut r) => {
            if !cli.json {
                eprintln!("reference pass over {spec_str}…");
            }
            Some(reference_rows(parts, &mut r)?)
        }
        None => None,
    };
    let reference_seconds = t0.elapsed().as_secs_f64();
    let mut budgets: Vec<Option<usize>> = Vec::new();
    if !cli.no_base {
        budgets.push(None);
    }
    budgets.extend(ks.iter().map(|&k| Some(k)));
    let mut runs = Vec::new();
    for k in &budgets {
        let mut scorer = match k {
            None => ModelScorer::new(&loaded.model, longest)?,
            Some(k) => {
                let mut at_k = cli.clone();
                at_k.k = Some(k.to_string());
                let refiner = build_refiner(&at_k, loaded)?
                    .ok_or_else(|| anyhow!("--k-sweep: the model has no refinement to run"))?;
                ModelScorer::with_refiner(&loaded.model, longest, refiner)?
            }
        };
        let t = Instant::now();
        let result = match &rows {
            Some(rows) => evaluate_against(parts, &mut scorer, rows, |_, _, _| {})?,
            None => evaluate::<_, ModelScorer<'_, B>>(parts, &mut scorer, None, |_, _, _| {})?,
        };
        let seconds = t.elapsed().as_secs_f64();
        if !cli.json {
            let label = k.map_or("base".to_string(), |k| format!("k = {k}"));
            let kl = result.kl.as_ref().map_or(String::new(), |kl| {
                format!(
                    "  KLD = {:.6}  same top-1 = {:.2} %",
                    kl.mean, kl.same_top1_pct
                )
            });
            println!(
                "{label:>8}: PPL = {:.4} +/- {:.5}{kl}  ({seconds:.1} s)",
                result.ppl.ppl, result.ppl.ppl_stderr
            );
        }
        let refine = scorer.refiner().map(|r| refine_report(r, &cli.refine_tier));
        runs.push((
            *k,
            EvalRun {
                refined: k.is_some(),
                result,
                seconds,
                refine,
            },
        ));
    }
    ensure_model_unchanged(loaded)?;
    if cli.json {
        let v = serde_json::json!({
            "model": loaded.info.origin,
            "kl_reference": cli.kl_ref,
            "eval": spec_str,
            "data": meta,
            "scored_tokens": runs.first().map(|(_, r)| r.result.ppl.tokens),
            "reference_seconds": reference_seconds,
            "threads": rayon::current_num_threads(),
            "runs": runs.iter().map(|(k, r)| {
                let mut j = run_json(r);
                j["k"] = serde_json::json!(k);
                j["same_top1_pct"] = serde_json::json!(r.result.kl.as_ref().map(|kl| kl.same_top1_pct));
                j
            }).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    }
    Ok(())
}

/// One evaluation pass (base or refined).
struct EvalRun {
    refined: bool,
    result: EvalResult,
    seconds: f64,
    refine: Option<serde_json::Value>,
}

fn run_json(r: &EvalRun) -> serde_json::Value {
    let scored = r.result.ppl.tokens;
    serde_json::json!({
        "ppl": r.result.ppl.ppl,
        "ppl_stderr": r.result.ppl.ppl_stderr,
        "mean_nll": r.result.ppl.mean_nll,
        "kl": r.result.kl,
        "seconds": r.seconds,
        "scored_tokens_per_second": scored as f64 / r.seconds.max(1e-9),
        "refine": r.refine,
    })
}

fn report_eval<B: Backend>(
    cli: &Cli,
    loaded: &Loaded<B>,
    spec: &str,
    meta: &serde_json::Value,
    runs: &[EvalRun],
) -> Result<()> {
    let Some(main) = runs.last() else {
        bail!("no evaluation pass ran");
    };
    ensure_model_unchanged(loaded)?;
    let r = &main.result;
    let scored = r.ppl.tokens;
    if cli.json {
        let mut v = serde_json::json!({
            "model": loaded.info.origin,
            "kl_reference": cli.kl_ref,
            "eval": spec,
            "data": meta,
            "refined": main.refined,
            "ppl": r.ppl.ppl,
            "ppl_stderr": r.ppl.ppl_stderr,
            "mean_nll": r.ppl.mean_nll,
            "scored_tokens": scored,
            "kl": r.kl,
            "parts": r.parts,
            "seconds": main.seconds,
            "scored_tokens_per_second": scored as f64 / main.seconds.max(1e-9),
            "threads": rayon::current_num_threads(),
            "precision": format!("{:?}", WeightPrecision::from(cli.precision)),
            "refine": main.refine,
        });
        if let (Some(base), true) = (runs.first(), runs.len() > 1) {
            v["base"] = run_json(base);
            v["refined_over_base_time"] = serde_json::json!(main.seconds / base.seconds.max(1e-9));
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    if let (Some(base), true) = (runs.first(), runs.len() > 1) {
        print!(
            "base (no refinement): PPL = {:.4} +/- {:.5}",
            base.result.ppl.ppl, base.result.ppl.ppl_stderr
        );
        if let Some(k) = &base.result.kl {
            print!(
                "  KLD = {:.6}  same top-1 = {:.2} %",
                k.mean, k.same_top1_pct
            );
        }
        println!(
            "  ({:.1} tok/s)",
            base.result.ppl.tokens as f64 / base.seconds.max(1e-9)
        );
        println!("refined:");
    }
    for p in &r.parts {
        print!(
            "{:>16}: PPL = {:.4} +/- {:.5}",
            p.name, p.ppl.ppl, p.ppl.ppl_stderr
        );
        if let Some(k) = &p.kl {
            print!(
                "  KLD = {:.6}  same top-1 = {:.2} %",
                k.mean, k.same_top1_pct
            );
        }
        println!();
    }
    println!(
        "Final estimate: PPL = {:.4} +/- {:.5}",
        r.ppl.ppl, r.ppl.ppl_stderr
    );
    if let Some(k) = &r.kl {
        println!();
        println!(
            "====== KL divergence statistics (vs {}) ======",
            cli.kl_ref.as_deref().unwrap_or("?")
        );
        println!("Mean    KLD: {:10.6}", k.mean);
        println!("Maximum KLD: {:10.6}", k.max);
        println!("99.0%   KLD: {:10.6}", k.p99);
        println!("Median  KLD: {:10.6}", k.median);
        println!("Same top-1 : {:9.3} %", k.same_top1_pct);
        println!("Tokens     : {}", k.tokens);
    }
    if let Some(rf) = &main.refine {
        println!(
            "Refinement : {:.0} bytes/token fetched, {:.1} units selected/token, {:.1} % applied, cache hit rate {:.3}",
            rf["fetched_bytes_per_token"].as_f64().unwrap_or(0.0),
            rf["selected_units_per_token"].as_f64().unwrap_or(0.0),
            100.0 * rf["applied_fraction"].as_f64().unwrap_or(0.0),
            rf["cache_hit_rate"].as_f64().unwrap_or(0.0)
        );
    }
    eprintln!(
        "{scored} tokens scored in {:.1} s ({:.1} tok/s, {} threads)",
        main.seconds,
        scored as f64 / main.seconds.max(1e-9),
        rayon::current_num_threads()
    );
    Ok(())
}

/// Comma list of `T`, naming the flag in errors.
fn list<T>(flag: &str, s: &str, parse: impl Fn(&str) -> Result<T, String>) -> Result<Vec<T>> {
    s.split(',')
        .map(|p| parse(p.trim()).map_err(|e| anyhow!("--{flag}: {e}")))
        .collect()
}

/// The KV configurations the flags describe, in evaluation order: per base, the base alone
/// (unless --no-base) and then every refinement setting. Empty without --kv.
fn kv_configs(cli: &Cli) -> Result<Vec<KvConfig>> {
    let Some(kv) = &cli.kv else {
        return Ok(Vec::new());
    };
    let bases = list("kv", kv, |p| p.parse::<KvBaseChoice>())?;
    let refine_off = cli.kv_refine.trim().eq_ignore_ascii_case("off");
    let refine_bits: Vec<Option<RefineBits>> = if refine_off {
        Vec::new()
    } else {
        list("kv-refine", &cli.kv_refine, |p| {
            if p.eq_ignore_ascii_case("auto") {
                Ok(None)
            } else {
                p.parse::<RefineBits>().map(Some)
            }
        })?
    };
    let groups = list("kv-group", &cli.kv_group, |p| match p.parse::<usize>() {
        Ok(g @ (1 | 2 | 4 | 8)) => Ok(g),
        _ => Err(format!("'{p}': token group must be 1, 2, 4 or 8")),
    })?;
    let fractions = list("kv-fraction", &cli.kv_fraction, parse_fraction)?;
    let policy = cli
        .kv_miss
        .parse::<MissPolicy>()
        .map_err(|e| anyhow!("--kv-miss: {e}"))?;
    let mut tiers = Vec::new();
    for t in cli.kv_tier.split(',') {
        match t.trim() {
            "ram" => tiers.push(KvTierConfig::Ram),
            "vram" => tiers.push(KvTierConfig::Device),
            "ssd" => {
                for size in cli.kv_cache.split(',') {
                    tiers.push(KvTierConfig::Ssd {
                        dir: cli.kv_spill_dir.clone().unwrap_or_else(std::env::temp_dir),
                        cache_budget: parse_bytes("kv-cache", size)?,
                        policy,
                    });
                }
            }
            other => bail!("--kv-tier {other:?}: expected ram, vram or ssd (comma list)"),
        }
    }
    let mut out = Vec::new();
    for base in bases {
        let plain = KvConfig {
            sinks: cli.kv_sinks,
            ..KvConfig::base(base)
        };
        let refinable = base != KvBaseChoice::F16;
        if !cli.no_base || !refinable || refine_off {
            out.push(plain.clone());
        }
        if !refinable {
            continue;
        }
        for rb in &refine_bits {
            let bits = rb.unwrap_or_else(|| base.default_refine_bits());
            for tier in &tiers {
                for &group in &groups {
                    for &fraction in &fractions {
                        out.push(KvConfig {
                            refine: Some(KvRefineConfig {
                                bits,
                                group,
                                fraction,
                                tier: tier.clone(),
                            }),
                            ..plain.clone()
                        });
                    }
                }
            }
        }
    }
    Ok(out)
}

/// Bytes per 1,024 positions the format prescribes for a configuration: resident (encoded
/// tiles, or FP16 without a base) and backing refinement bits; plus the fixed FP16 sink and
/// tail buffers. All layers and KV heads.
fn kv_bytes_per_1k(config: &KvConfig, shape: KvShape) -> Result<serde_json::Value> {
    let heads = (shape.layers * shape.kv_heads) as f64;
    let d = shape.head_dim as f64;
    let base = config
        .base
        .build(shape.head_dim)
        .map_err(|e| anyhow!("--kv {}: {e}", config.base))?;
    Ok(match base {
        None => serde_json::json!({
            "resident": 1024.0 * d * 4.0 * heads,
            "backing": 0.0,
            "fixed_fp16_buffers": 0.0,
        }),
        Some(b) => {
            let tiles = 1024.0 / b.tile_tokens() as f64;
            let refine = config.refine.as_ref().map_or(0.0, |r| {
                1024.0 * d * f64::from(r.bits.key + r.bits.value) / 8.0
            });
            serde_json::json!({
                "resident": tiles * b.tile_bytes() as f64 * heads,
                "backing": refine * heads,
                "fixed_fp16_buffers": (config.sinks + b.tile_tokens()) as f64 * d * 4.0 * heads,
            })
        }
    })
}

/// `--kv` with `--ppl austen-long:L`: every KV configuration side by side on one shared exact
/// prefill per novel, KL against FP16 KV (this model's, or --kl-ref's).
fn run_kv_eval<B: ResidentKernels>(
    cli: &Cli,
    loaded: &Loaded<B>,
    spec_str: &str,
    spec: &EvalSpec,
) -> Result<()> {
    use sfx_runtime::eval::kv_sweep::{kv_sweep, KvSide};
    if !matches!(spec, EvalSpec::AustenLong { .. }) {
        bail!(
            "--kv evaluates the decode path: use --ppl austen-long:L (windowed texts score whole \
             windows at once, where attention runs on exact keys and values)"
        );
    }
    let configs = kv_configs(cli)?;
    if configs.is_empty() {
        bail!("--kv gave no configuration to evaluate");
    }
    let (parts, meta) = eval_parts(loaded, spec, !cli.json)?;
    let max_ctx = loaded.info.config.max_position_embeddings;
    if let Some(p) = parts.iter().find(|p| p.tokens.len() > max_ctx) {
        bail!(
            "evaluation needs {} positions; the model's context is {max_ctx}",
            p.tokens.len()
        );
    }
    // The KV sweep's reference runs on the model's device.
    let reference = match &cli.kl_ref {
        Some(r) => Some(load(
            loaded.model.backend().with_reference_numerics(),
            r,
            cli,
        )?),
        None => None,
    };
    let mut refiner = build_refiner(cli, loaded)?;
    let mut ref_refiner = match &reference {
        Some(r) => build_refiner(cli, r)?,
        None => None,
    };
    if !cli.json {
        eprintln!(
            "evaluating {spec_str} with {} KV configuration(s) on {} novel(s){}",
            configs.len(),
            parts.len(),
            if refiner.is_some() {
                ", weight refinement on"
            } else {
                ""
            }
        );
    }
    let json = cli.json;
    let t0 = Instant::now();
    let runs = kv_sweep(
        KvSide {
            model: &loaded.model,
            refiner: refiner.as_mut(),
        },
        reference.as_ref().map(|r| KvSide {
            model: &r.model,
            refiner: ref_refiner.as_mut(),
        }),
        &parts,
        &configs,
        // Progress goes to stderr in --json mode too: these runs take minutes per novel.
        |msg| eprintln!("[{:6.1} s] {msg}", t0.elapsed().as_secs_f64()),
    )?;
    let shape = KvShape::of(&loaded.info.config);
    let mut rows = Vec::new();
    for (c, r) in configs.iter().zip(&runs) {
        let mut v = serde_json::to_value(r)?;
        v["base"] = serde_json::json!(c.base.to_string());
        v["sinks"] = serde_json::json!(c.sinks);
        v["refine"] = match &c.refine {
            None => serde_json::Value::Null,
            Some(rf) => serde_json::json!({
                "bits": rf.bits.to_string(),
                "group": rf.group,
                "fraction": rf.fraction,
                "tier": match &rf.tier { KvTierConfig::Ram => "ram", KvTierConfig::Device => "vram", KvTierConfig::Ssd { .. } => "ssd" },
            }),
        };
        v["bytes_per_1k_tokens"] = kv_bytes_per_1k(c, shape)?;
        rows.push(v);
    }
    ensure_model_unchanged(loaded)?;
    if json {
        let v = serde_json::json!({
            "model": loaded.info.origin,
            "kl_reference": cli.kl_ref.clone().unwrap_or_else(|| "same model, f16 KV".into()),
            "weight_refinement": refiner.as_ref().map(|r| refine_report(r, &cli.refine_tier)),
            "eval": spec_str,
            "data": meta,
            "threads": rayon::current_num_threads(),
            "runs": rows,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{:<30} {:>9} {:>9} {:>8} {:>9} {:>11} {:>11} {:>9}",
        "KV configuration", "PPL", "KL", "top-1 %", "tok/s", "res MB/1K", "back MB/1K", "refined"
    );
    for (row, r) in rows.iter().zip(&runs) {
        let kl = r.kl.as_ref();
        let per1k = &row["bytes_per_1k_tokens"];
        let applied = if r.stats.selected_groups > 0 {
            format!(
                "{:.1} %",
                100.0 * r.stats.applied_groups as f64 / r.stats.selected_groups as f64
            )
        } else {
            "-".into()
        };
        println!(
            "{:<30} {:>9.4} {:>9.5} {:>8.2} {:>9.1} {:>11.3} {:>11.3} {:>9}",
            r.label,
            r.ppl.ppl,
            kl.map_or(f64::NAN, |k| k.mean),
            kl.map_or(f64::NAN, |k| k.same_top1_pct),
            r.decode_tokens_per_second,
            per1k["resident"].as_f64().unwrap_or(0.0) / 1e6,
            per1k["backing"].as_f64().unwrap_or(0.0) / 1e6,
            applied
        );
    }
    Ok(())
}

//! `sfx tune`: measure this machine and the model, choose refinement settings per slowdown
//! budget ([`sfx_calibration::tune`]), and keep them in the model's tuning sidecar
//! ([`sfx_formats::tune`]) for `sfx-run` to apply.
//!
//! Speed: the resident base and a configuration decode the same tokens from the same
//! context, alternating, several rounds; the slowdown is the median of the per-round time
//! ratios (a shared machine drifts between rounds, rarely within one pair). KL: against the
//! float model's predictions on held-out text, computed once and kept.

use crate::device::{with_backend, DeviceChoice, OnBackend};
use crate::heldout::{float_reference_rows, scoring_options, text_windows};
use anyhow::{anyhow, bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use sfx_calibration::tune::{Candidate, Measure, Scheme, Space, Tuner};
use sfx_formats::sfx::{SfxFile, Tier};
use sfx_formats::tune::{sidecar_path, BudgetProfile, Machine, MachineProfiles, TuneFile};
use sfx_runtime::backend::Backend;
use sfx_runtime::eval::{evaluate_against, EvalPart, ModelScorer, ReferenceRow};
use sfx_runtime::refine::{
    file_budgets, file_ladder, file_settings, open_refinement, plan_from_sfx, MlpMode,
    RefineOpenOptions, RefineSettings, Refiner, TierChoice,
};
use sfx_runtime::resident::ResidentKernels;
use sfx_runtime::sfx_model::load_sfx_model_on;
use sfx_runtime::synthetic::{self, SyntheticWeights};
use sfx_runtime::{LogitsMode, Model};
use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The ladder searched when a file was fitted at one k (its one C then serves every rung).
const DEFAULT_LADDER: [usize; 5] = [4, 8, 16, 32, 64];

/// Everything `sfx tune` was asked for.
pub struct TuneArgs {
    pub model: PathBuf,
    /// Slowdown budgets as fractions.
    pub budgets: Vec<f64>,
    pub device: DeviceChoice,
    /// `None`: the tier the file's refinement is stored in.
    pub tier: Option<Tier>,
    /// The float model the KL is measured against.
    pub kl_ref: Option<String>,
    /// Held-out text, windows and window length of the KL measurement.
    pub text: String,
    pub windows: usize,
    pub window: usize,
    /// Lead/lag values tried (blocks): the lead sets share one, the lag sets another.
    pub shifts: Vec<f32>,
    /// MLP schemes tried; empty: those the file has.
    pub schemes: Vec<Scheme>,
    /// Decode speed: context before the timed tokens, timed tokens, alternating rounds.
    pub context: usize,
    pub tokens: usize,
    pub rounds: usize,
    /// Time candidates on a synthetic model of this architecture (a preset name) in the
    /// file's formats, with refinement columns of its sizes; KL still from the file.
    pub speed_model: Option<String>,
    pub json: bool,
}

/// The machine a backend runs on, as a profile records it: `sfx tune` when it measures,
/// `sfx-run` when it picks a profile.
pub fn machine_for(backend_name: &str) -> Machine {
    let device = if backend_name.starts_with("cuda") {
        "cuda"
    } else {
        "cpu"
    };
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    Machine {
        device: device.into(),
        description: if device == "cpu" {
            cpu
        } else {
            format!("{backend_name}, host {cpu}")
        },
        threads: rayon::current_num_threads(),
    }
}

/// Lead/lag combinations: lead sets (qkv, gu) share one value, lag sets (o, d) another.
fn shift_space(values: &[f32]) -> Result<Vec<[u8; 4]>> {
    let halves: Vec<u8> = values
        .iter()
        .map(|&s| {
            let h = s * 2.0;
            if !(0.0..=8.0).contains(&h) || h.fract() != 0.0 {
                bail!("--s {s}: lead/lag values are multiples of 0.5 between 0 and 4 blocks");
            }
            Ok(h as u8)
        })
        .collect::<Result<_>>()?;
    let mut out = Vec::new();
    for &lead in &halves {
        for &lag in &halves {
            out.push([lead, lag, lead, lag]);
        }
    }
    Ok(out)
}

/// A log line above the progress bar, or on stderr when the bar is not drawn (not a
/// terminal), so a log file keeps every measurement.
fn say(progress: &ProgressBar, line: String) {
    if progress.is_hidden() {
        eprintln!("{line}");
    } else {
        progress.println(line);
    }
}

/// What one configuration measured besides the search's numbers.
#[derive(Default, Clone, Copy)]
struct Extra {
    ppl: f64,
    fetched_per_token: f64,
    read_gbps: f64,
}

/// Decode timing on one model: its prefilled context, the context's next token, the
/// timed tokens.
struct Timing<B: Backend> {
    cache: sfx_runtime::FloatKvCache<B>,
    context: usize,
    first_token: u32,
    tokens: usize,
}

impl<B: ResidentKernels> Timing<B> {
    /// Prefills `prompt` into a cache for `model` and takes its greedy next token.
    fn new(model: &Model<B>, prompt: &[u32], tokens: usize) -> Result<Self> {
        let mut cache = model.new_cache(prompt.len() + tokens + 1)?;
        let logits = model
            .forward(prompt, &mut cache, LogitsMode::Last)?
            .into_vec();
        let first_token = logits
            .iter()
            .enumerate()
            .max_by(|x, y| x.1.total_cmp(y.1))
            .map_or(0, |(i, _)| i as u32);
        Ok(Self {
            cache,
            context: prompt.len(),
            first_token,
            tokens,
        })
    }

    /// Seconds to decode the timed tokens after the context, refined by `refiner`.
    fn decode_seconds(
        &mut self,
        model: &Model<B>,
        mut refiner: Option<&mut Refiner<B>>,
    ) -> Result<f64> {
        use sfx_runtime::KvCache;
        self.cache.truncate(self.context)?;
        let t0 = Instant::now();
        let mut t = self.first_token;
        for _ in 0..self.tokens {
            t = model.forward_greedy_with(&[t], &mut self.cache, refiner.as_deref_mut())?;
        }
        model.backend().synchronize()?;
        Ok(t0.elapsed().as_secs_f64())
    }
}

/// A synthetic stand-in the candidates are timed on (`--speed-model`): another
/// architecture's shapes in the file's formats, and one refinement engine over random
/// columns of that architecture's sizes, rescheduled per candidate.
struct SpeedModel<B: Backend> {
    model: Model<B>,
    refiner: Refiner<B>,
    /// What the profile records, e.g. `llama-3.1-8b (synthetic, 3-bit g128, 8-bit g128 head)`.
    label: String,
}

/// The machine and model behind [`Measure`].
struct Bench<'a, B: Backend> {
    /// The file's model: every KL, and the speed unless `speed_model` stands in.
    model: &'a Model<B>,
    speed_model: Option<SpeedModel<B>>,
    file: &'a SfxFile,
    path: &'a Path,
    tier: TierChoice,
    parts: &'a [EvalPart],
    reference: &'a [Vec<ReferenceRow>],
    window: usize,
    timing: Timing<B>,
    rounds: usize,
    extra: HashMap<Candidate, Extra>,
    progress: ProgressBar,
}

impl<B: ResidentKernels> Bench<'_, B> {
    fn refiner(&self, c: &Candidate) -> Result<Refiner<B>> {
        let plan = plan_from_sfx(self.file, self.model.config(), Some(c.k))?;
        let mut settings = file_settings(self.file, &plan);
        settings.k = c.k;
        settings.s = c.s();
        settings.bundle_k = c.bundle_k();
        settings.mlp = match c.scheme {
            Scheme::Channels => MlpMode::Channels,
            Scheme::Bundles => MlpMode::Bundles,
        };
        let options = RefineOpenOptions {
            tier: self.tier,
            // Checked once before the search.
            verify: false,
            ..RefineOpenOptions::default()
        };
        let quiet = |_: &str| {};
        open_refinement(
            self.model.backend(),
            self.file,
            self.path,
            plan,
            Some(settings),
            &options,
            &quiet,
        )?
        .ok_or_else(|| anyhow!("{}: no usable refinement", self.path.display()))
    }

    /// Seconds the timed model decodes the timed tokens unrefined.
    fn base_seconds(&mut self) -> Result<f64> {
        let model = self.speed_model.as_ref().map_or(self.model, |p| &p.model);
        self.timing.decode_seconds(model, None)
    }

    fn note(&self, c: &Candidate, what: String) {
        self.progress.inc(1);
        // Logged with --json too (stdout holds the JSON).
        say(&self.progress, format!("  {:<36} {what}", c.label()));
    }
}

impl<B: ResidentKernels> Measure for Bench<'_, B> {
    type Error = anyhow::Error;

    fn slowdown(&mut self, c: &Candidate) -> Result<f64> {
        self.progress.set_message(format!("speed {}", c.label()));
        let mut own;
        let (model, r) = match self.speed_model.as_mut() {
            Some(p) => {
                p.refiner.set_schedule(p.model.backend(), c.k, c.s())?;
                (&p.model, &mut p.refiner)
            }
            None => {
                own = self.refiner(c)?;
                (self.model, &mut own)
            }
        };
        let timing = &mut self.timing;
        // One untimed pass each warms caches and the refinement's pages.
        timing.decode_seconds(model, None)?;
        timing.decode_seconds(model, Some(&mut *r))?;
        let mut ratios = Vec::with_capacity(self.rounds);
        let (mut bytes, mut secs) = (0u64, 0.0);
        for _ in 0..self.rounds {
            let base = timing.decode_seconds(model, None)?;
            r.reset_counters();
            let refined = timing.decode_seconds(model, Some(&mut *r))?;
            bytes += r.counters().bytes_applied;
            secs += refined;
            ratios.push(refined / base.max(1e-12));
        }
        ratios.sort_by(f64::total_cmp);
        let slowdown = ratios[ratios.len() / 2] - 1.0;
        let e = self.extra.entry(*c).or_default();
        e.fetched_per_token = bytes as f64 / (self.rounds * timing.tokens) as f64;
        e.read_gbps = bytes as f64 / secs.max(1e-12) / 1e9;
        self.note(c, format!("slowdown {:+.1} %", 100.0 * slowdown));
        Ok(slowdown)
    }

    fn kl(&mut self, c: &Candidate) -> Result<f64> {
        self.progress.set_message(format!("KL {}", c.label()));
        let r = self.refiner(c)?;
        let mut scorer = ModelScorer::with_refiner(self.model, self.window, r)?;
        let res = evaluate_against(self.parts, &mut scorer, self.reference, |_, _, _| {})?;
        let kl = res
            .kl
            .ok_or_else(|| anyhow!("no KL: the tuning text scored no tokens"))?;
        self.extra.entry(*c).or_default().ppl = res.ppl.ppl;
        self.note(c, format!("KL {:.4}  PPL {:.3}", kl.mean, res.ppl.ppl));
        Ok(kl.mean)
    }
}

struct Task<'a> {
    args: &'a TuneArgs,
    file: &'a SfxFile,
    parts: &'a [EvalPart],
    reference: &'a [Vec<ReferenceRow>],
    space: Space,
}

/// A tuning run's result, for the table, `--json` and the sidecar.
struct Outcome {
    entry: MachineProfiles,
    measured: (usize, usize),
    seconds: f64,
}

impl OnBackend for Task<'_> {
    type Output = Outcome;
    fn run<B: ResidentKernels>(self, backend: B) -> Result<Outcome> {
        let a = self.args;
        let t0 = Instant::now();
        let model = load_sfx_model_on(backend, self.file, &scoring_options())
            .with_context(|| format!("loading {}", a.model.display()))?;
        let backend_name = model.backend().name();
        let machine = machine_for(&backend_name);
        let tier = match a.tier {
            None => TierChoice::AsStored,
            Some(Tier::Ssd) => TierChoice::Ssd,
            Some(_) => TierChoice::Ram,
        };
        let tier_name = match (a.tier, self.file.sections().any(|s| s.tier == Tier::Ssd)) {
            (Some(t), _) => t.as_str().to_string(),
            (None, true) => "ssd".into(),
            (None, false) => "ram".into(),
        };
        let prompt = &self.parts[0].tokens[..a.context.min(self.parts[0].tokens.len())];
        let speed_model = match &a.speed_model {
            None => None,
            Some(preset) => Some(speed_model(model.backend().clone(), self.file, preset)?),
        };
        let timing = match &speed_model {
            None => Timing::new(&model, prompt, a.tokens)?,
            Some(p) => {
                // The text's ids are the file's tokenizer's; a smaller vocabulary wraps them
                // (the stand-in's speed does not depend on which ids it reads).
                let vocab = p.model.config().vocab_size as u32;
                let ids: Vec<u32> = prompt.iter().map(|&t| t % vocab).collect();
                Timing::new(&p.model, &ids, a.tokens)?
            }
        };
        let max_measurements = self.space.schemes.len()
            * self.space.shifts.len()
            * self.space.ladder.len()
            * 2
            * a.budgets.len().max(1);
        // Not a terminal (a log file): no bar, every measurement a line on stderr.
        let progress = if a.json || !std::io::stderr().is_terminal() {
            ProgressBar::hidden()
        } else {
            ProgressBar::new(max_measurements as u64)
        };
        progress.set_style(
            ProgressStyle::with_template(
                "{elapsed_precise} [{bar:30}] {pos} measured (≤ {len}), ETA ≤ {eta} {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        let bench = Bench {
            model: &model,
            file: self.file,
            path: &a.model,
            tier,
            parts: self.parts,
            reference: self.reference,
            window: a.window,
            speed_model,
            timing,
            rounds: a.rounds,
            extra: HashMap::new(),
            progress: progress.clone(),
        };
        let mut tuner = Tuner::new(bench);
        let base_seconds = tuner.measure().base_seconds()?;
        let mut profiles = Vec::new();
        // Ascending, so each budget can start from the smaller budgets' choices.
        for &budget in &a.budgets {
            say(&progress, format!("budget {:.1} %", 100.0 * budget));
            let choice = tuner.choose(&self.space, budget)?;
            let Some(c) = choice.candidate else {
                say(
                    &progress,
                    format!(
                        "  nothing fits {:.1} %: even no refinement measured slower",
                        100.0 * budget
                    ),
                );
                profiles.push(BudgetProfile {
                    budget,
                    k: [0; 4],
                    s: [0.0; 4],
                    mlp: "channels".into(),
                    bundle_k: 0,
                    slowdown: 0.0,
                    confirmed_slowdown: 0.0,
                    remeasured_slowdown: 0.0,
                    kl: None,
                    ppl: None,
                    fetched_bytes_per_token: 0.0,
                });
                continue;
            };
            let confirmed = tuner.confirmation(&c).unwrap_or(f64::NAN);
            // A fresh measurement after the search, outside the kept ones.
            let remeasured = tuner.measure().slowdown(&c)?;
            let extra = tuner.measure().extra.get(&c).copied().unwrap_or_default();
            profiles.push(BudgetProfile {
                budget,
                k: c.k,
                s: c.s(),
                mlp: c.scheme.name().into(),
                bundle_k: c.bundle_k(),
                slowdown: choice.slowdown,
                confirmed_slowdown: confirmed,
                remeasured_slowdown: remeasured,
                kl: Some(choice.kl),
                ppl: Some(extra.ppl),
                fetched_bytes_per_token: extra.fetched_per_token,
            });
        }
        progress.finish_and_clear();
        let measured = tuner.measured();
        let bench = tuner.measure();
        let speed_label = bench.speed_model.as_ref().map(|p| p.label.clone());
        let read_gbps = bench
            .extra
            .values()
            .map(|e| e.read_gbps)
            .fold(0.0, f64::max);
        let entry = MachineProfiles {
            machine,
            tier: tier_name,
            measured_at: utc_now(),
            base_tokens_per_s: a.tokens as f64 / base_seconds.max(1e-12),
            refine_read_gbps: read_gbps,
            text: format!("{}:{}x{}", a.text, self.parts.len(), a.window),
            scored_tokens: self
                .parts
                .iter()
                .map(|p| (p.tokens.len() - p.first_scored) as u64)
                .sum(),
            reference: a.kl_ref.clone().unwrap_or_default(),
            speed_model: speed_label,
            profiles,
        };
        Ok(Outcome {
            entry,
            measured,
            seconds: t0.elapsed().as_secs_f64(),
        })
    }
}

/// The synthetic model of `preset` in `file`'s resident formats, with refinement columns of
/// its sizes placed in the backend (on CUDA: pinned host memory the GPU reads, as a real
/// file's ram tier).
fn speed_model<B: ResidentKernels>(
    backend: B,
    file: &SfxFile,
    preset: &str,
) -> Result<SpeedModel<B>> {
    let t0 = Instant::now();
    let config = synthetic::preset(preset)?;
    let (dtype, weights, head) = synthetic::formats_of(file)?;
    let options = sfx_runtime::ModelOptions {
        precision: sfx_runtime::WeightPrecision::Native,
        ..sfx_runtime::ModelOptions::default()
    };
    let seed = 1;
    let model = Model::synthetic_with(backend, &config, dtype, weights, head, seed, &options)
        .with_context(|| format!("--speed-model {preset}: building the synthetic model"))?;
    let settings = RefineSettings {
        k: [16; 4],
        s: [0.0; 4],
        mlp: MlpMode::Channels,
        bundle_k: 0,
    };
    let refiner = Refiner::new_in_backend(
        synthetic::refinement_plan(&config),
        settings,
        model.backend(),
        |src| {
            Ok(std::borrow::Cow::Owned(synthetic::refinement_columns(
                src, seed,
            )))
        },
    )
    .with_context(|| format!("--speed-model {preset}: placing its refinement columns"))?;
    model.backend().synchronize()?;
    let format = |w: SyntheticWeights| match w {
        SyntheticWeights::Float => format!("{dtype:?}").to_lowercase(),
        SyntheticWeights::Group { bits, group } => format!("{bits}-bit g{group}"),
        SyntheticWeights::Trellis { code, k, rotation } => {
            format!(
                "{k}-bit trellis {} ({} rotation)",
                code.name(),
                rotation.name()
            )
        }
        SyntheticWeights::Lut { bits } => format!("{bits}-bit look-up-table"),
        SyntheticWeights::Gguf { ty } => format!("GGUF {ty}"),
    };
    let label = format!(
        "{preset} (synthetic, {}, {} head)",
        format(weights),
        format(head)
    );
    eprintln!(
        "speed model {label}: {:.2} GiB resident, {:.2} GiB of refinement columns, ready in \
         {:.1} s",
        model.resident_bytes() as f64 / (1u64 << 30) as f64,
        refiner.backend_bytes() as f64 / (1u64 << 30) as f64,
        t0.elapsed().as_secs_f64()
    );
    Ok(SpeedModel {
        model,
        refiner,
        label,
    })
}

/// RFC 3339 UTC time from the system clock (days-from-civil arithmetic; no time crate).
fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

pub fn run(mut a: TuneArgs) -> Result<()> {
    a.model = sfx_formats::package::container_path(&a.model);
    if a.budgets.is_empty() {
        bail!("--budget: give at least one slowdown budget, e.g. 5% or 2.5%,5%,10%,20%");
    }
    if a.rounds == 0 || a.tokens == 0 || a.windows == 0 || a.window < 2 {
        bail!("--rounds, --tokens and --windows must be at least 1, --ctx at least 2");
    }
    let Some(reference) = a.kl_ref.as_deref() else {
        bail!(
            "--kl-ref: the float model the KL is measured against is required (the Hugging \
             Face folder, hub id or .gguf this file was converted from)"
        );
    };
    if let Some(preset) = &a.speed_model {
        // Named before any measurement (the float reference alone takes seconds to minutes).
        synthetic::preset(preset).with_context(|| format!("--speed-model {preset:?}"))?;
    }
    let file = SfxFile::open(&a.model).with_context(|| format!("opening {}", a.model.display()))?;
    let config = file
        .metadata()
        .config
        .clone()
        .ok_or_else(|| anyhow!("{}: no model config in the metadata", a.model.display()))?;
    let plan = plan_from_sfx(&file, &config, None)?;
    let has_channels = plan.layers.iter().any(|l| !l.sets[2].is_empty());
    let has_bundles = plan.layers.iter().any(|l| l.bundles.is_some());
    if !has_channels && !has_bundles {
        bail!("{}: no refinement to tune", a.model.display());
    }
    let schemes: Vec<Scheme> = if a.schemes.is_empty() {
        [
            (Scheme::Channels, has_channels),
            (Scheme::Bundles, has_bundles),
        ]
        .into_iter()
        .filter_map(|(s, has)| has.then_some(s))
        .collect()
    } else {
        for s in &a.schemes {
            let has = match s {
                Scheme::Channels => has_channels,
                Scheme::Bundles => has_bundles,
            };
            if !has {
                bail!(
                    "--mlp {}: the file stores no {} refinement",
                    s.name(),
                    s.name()
                );
            }
        }
        a.schemes.clone()
    };
    let schemes = match &a.speed_model {
        // The stand-in's random refinement has channel columns only.
        Some(preset) if schemes.contains(&Scheme::Bundles) => {
            if !a.schemes.is_empty() {
                bail!(
                    "--mlp bundles with --speed-model {preset}: a synthetic speed model has \
                     channel columns only (tune bundles on the file's own speed)"
                );
            }
            if !has_channels {
                bail!(
                    "--speed-model {preset}: {} stores neuron bundles only; a synthetic speed \
                     model times channel columns",
                    a.model.display()
                );
            }
            vec![Scheme::Channels]
        }
        _ => schemes,
    };
    let mut ladder = file_ladder(&file);
    if ladder.is_empty() {
        let k = file_budgets(&file);
        eprintln!(
            "note: {} was fitted at one k ({k:?}); its C serves every budget searched \
             ({DEFAULT_LADDER:?}). Convert with --k-ladder to fit each.",
            a.model.display()
        );
        ladder = DEFAULT_LADDER.to_vec();
    }
    let space = Space {
        ladder,
        shifts: shift_space(&a.shifts)?,
        schemes,
    };
    // The refinement is checked once here; each configuration then opens it unverified.
    file.verify_where(|s| s.tier != Tier::Resident)
        .with_context(|| format!("{}: refinement sections", a.model.display()))?;

    let parts = text_windows(&file, &a.model, "--text", &a.text, a.window, a.windows)?;
    if a.context >= a.window {
        bail!(
            "--context {} must be shorter than --ctx {}",
            a.context,
            a.window
        );
    }
    let t0 = Instant::now();
    let rows = float_reference_rows(a.device, reference, &parts)?;
    eprintln!(
        "float reference {reference}: {} scored tokens of {} in {:.1} s",
        rows.iter().map(Vec::len).sum::<usize>(),
        a.text,
        t0.elapsed().as_secs_f64()
    );
    let outcome = with_backend(
        a.device,
        Task {
            args: &a,
            file: &file,
            parts: &parts,
            reference: &rows,
            space: space.clone(),
        },
    )?;
    // A profile measured on a file that changed on disk meanwhile would describe another file.
    file.check_unchanged()
        .context("refusing to write a tuning profile from this run")?;
    let sidecar = sidecar_path(&a.model);
    let digest = file.content_digest();
    let mut tune_file = match TuneFile::read(&sidecar, &digest) {
        Ok(Some(f)) => f,
        Ok(None) => TuneFile::new(digest),
        Err(e) => {
            eprintln!("warning: replacing an unusable tuning profile: {e}");
            TuneFile::new(digest)
        }
    };
    tune_file.put(outcome.entry.clone());
    tune_file
        .write(&sidecar)
        .with_context(|| format!("writing {}", sidecar.display()))?;
    if a.json {
        let v = serde_json::json!({
            "sidecar": sidecar.display().to_string(),
            "ladder": space.ladder,
            "configurations_measured": {"speed": outcome.measured.0, "kl": outcome.measured.1},
            "seconds": outcome.seconds,
            "result": outcome.entry,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    print_profiles(&outcome.entry);
    println!(
        "\n{} speed and {} KL measurements in {:.0} s; profile written to {}",
        outcome.measured.0,
        outcome.measured.1,
        outcome.seconds,
        sidecar.display()
    );
    Ok(())
}

/// The profiles of one machine as a markdown table.
pub fn print_profiles(m: &MachineProfiles) {
    println!(
        "{} ({} threads), {} tier: base {:.1} tok/s; KL on {} ({} tokens) vs {}; measured {}",
        m.machine.description,
        m.machine.threads,
        m.tier,
        m.base_tokens_per_s,
        m.text,
        m.scored_tokens,
        m.reference,
        m.measured_at
    );
    if let Some(speed) = &m.speed_model {
        println!("speed measured on {speed}, not on this file's model (never applied by sfx-run)");
    }
    println!(
        "| budget | k (qkv,o,gu,d) | s | mlp | slowdown | confirmed | re-measured | KL | PPL | \
         fetched/token |"
    );
    println!("| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for p in &m.profiles {
        let (k, s) = p.k_and_s();
        println!(
            "| {:.1} % | {k} | {s} | {} | {:+.1} % | {:+.1} % | {:+.1} % | {} | {} | {:.0} KiB |",
            100.0 * p.budget,
            p.mlp,
            100.0 * p.slowdown,
            100.0 * p.confirmed_slowdown,
            100.0 * p.remeasured_slowdown,
            p.kl.map_or("–".into(), |v| format!("{v:.4}")),
            p.ppl.map_or("–".into(), |v| format!("{v:.3}")),
            p.fetched_bytes_per_token / 1024.0
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shift_space_pairs_lead_and_lag_values() {
        let s = shift_space(&[0.0, 1.0]).unwrap();
        assert_eq!(
            s,
            vec![[0, 0, 0, 0], [0, 2, 0, 2], [2, 0, 2, 0], [2, 2, 2, 2]]
        );
        assert!(shift_space(&[0.3]).is_err());
        assert!(shift_space(&[9.0]).is_err());
    }

    #[test]
    fn utc_now_is_rfc3339() {
        let t = utc_now();
        assert_eq!(t.len(), 20, "{t}");
        assert!(t.starts_with("20") && t.ends_with('Z'), "{t}");
    }
}

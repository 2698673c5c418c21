//! `sfx bench`: llama-bench-style speed table for a model file or a synthetic model of a real
//! architecture (random weights generated on the device; nothing to download).

use crate::device::{with_backend, DeviceChoice, OnBackend};
use crate::model_open::load_checkpoint_model;
use anyhow::{bail, Context, Result};
use sfx_calibration::quant::ggml_quant::GGML_QUANTS;
use sfx_formats::resident::{Rotation, TrellisCode};
use sfx_formats::sfx::SfxFile;
use sfx_formats::DType;
use sfx_runtime::backend::KvDtype;
use sfx_runtime::bench::{self, BenchResult, BenchTest};
use sfx_runtime::refine::{
    open_refinement, plan_from_sfx, MlpMode, RefineOpenOptions, RefineSettings, Refiner, TierChoice,
};
use sfx_runtime::resident::ResidentKernels;
use sfx_runtime::sfx_model::{is_sfx_file, load_sfx_model_on};
use sfx_runtime::synthetic::{self, SyntheticWeights};
use sfx_runtime::{Model, ModelOptions, WeightPrecision};
use std::time::Instant;

/// Everything `sfx bench` was asked for.
pub struct BenchArgs {
    pub model: Option<String>,
    pub synthetic: Option<String>,
    pub prompt: Vec<usize>,
    pub generate: Vec<usize>,
    pub depths: Vec<usize>,
    pub reps: usize,
    pub device: DeviceChoice,
    /// Step graphs: on, off, or both (every row twice).
    pub graphs: Vec<bool>,
    pub dtype: DType,
    /// Projections of a synthetic model: float (`dtype`) or a resident format.
    pub weights: SyntheticWeights,
    /// The --quant name, for the model label.
    pub quant: String,
    /// The head's format: float (`dtype`) or group codes (`--head`; a tied embedding is the
    /// head's table).
    pub head: SyntheticWeights,
    /// Element type of the float cache the depth is prefilled into (and of the float rows).
    pub kv: KvDtype,
    /// The KV caches to measure (--kv); the float cache of `kv` alone when empty.
    pub kv_caches: Vec<bench::BenchKv>,
    /// Weight-refinement budgets to measure beside the base (`--k`); none: the base alone.
    pub refine_k: Vec<usize>,
    /// A synthetic model gets refinement columns (`--fit`).
    pub fit: bool,
    /// Fetch lead (q/k/v, gate/up) or lag (o, down) per set of the `--k` rows, in blocks.
    pub refine_s: [f32; 4],
    pub seed: u64,
    pub json: bool,
}

/// A per-set setting (`--k`, `--s`): one value for every projection set, or four in the
/// order q/k/v, o, gate/up, down.
pub fn per_set<T: std::str::FromStr + Copy>(what: &str, s: &str) -> Result<[T; 4]> {
    let v: Vec<T> = s
        .split(',')
        .map(|p| {
            p.trim()
                .parse::<T>()
                .map_err(|_| anyhow::anyhow!("--{what} {s:?}: {p:?} is not a number"))
        })
        .collect::<Result<_>>()?;
    match v[..] {
        [a] => Ok([a; 4]),
        [a, b, c, d] => Ok([a, b, c, d]),
        _ => bail!("--{what} {s:?}: give one value or four (qkv,o,gu,d)"),
    }
}

/// How `--kv` entries with refinement (`2/2+4/4`) refine: tokens per group and the fraction
/// of a KV head's groups selected per step.
#[derive(Debug, Clone, Copy)]
pub struct KvRefineArgs {
    pub sinks: usize,
    pub group: usize,
    pub fraction: f64,
}

/// Parses `--kv`: a comma list of f16 / f32 (the float cache) and KVarN bases (2/2, 3/2, 3/3,
/// 2/1, or kvarn:2/2), each optionally with refinement bits (`2/2+4/4`: +4 key and +4 value
/// bits per element, units in host RAM; `2/2+4/4@vram`: in device memory) refined as `args`
/// says.
pub fn parse_kv_caches(s: &str, args: KvRefineArgs) -> Result<Vec<bench::BenchKv>> {
    use sfx_runtime::kv::{KvBaseChoice, KvConfig, KvRefineConfig, KvTierConfig, RefineBits};
    s.split(',')
        .filter(|t| !t.trim().is_empty())
        .map(|t| {
            let (t, tier) = match t.trim().split_once('@') {
                Some((t, "vram")) => (t, KvTierConfig::Device),
                Some((t, "ram")) => (t, KvTierConfig::Ram),
                Some((_, other)) => bail!("--kv {t:?}: tier {other:?} (ram or vram)"),
                None => (t, KvTierConfig::Ram),
            };
            let (base, refine) = match t.trim().split_once('+') {
                Some((b, r)) => (b.trim(), Some(r.trim())),
                None => (t.trim(), None),
            };
            match (base, refine) {
                ("f16", None) => return Ok(bench::BenchKv::Float(KvDtype::F16)),
                ("f32", None) => return Ok(bench::BenchKv::Float(KvDtype::F32)),
                _ => {}
            }
            let base = match base.parse::<KvBaseChoice>() {
                Ok(b @ KvBaseChoice::Kvarn(_)) => b,
                Ok(KvBaseChoice::F16) if refine.is_none() => {
                    return Ok(bench::BenchKv::Float(KvDtype::F16))
                }
                Ok(KvBaseChoice::F16) => bail!("--kv {t:?}: a float cache has nothing to refine"),
                Err(e) => bail!("--kv {:?}: {e}", t.trim()),
            };
            let refine = refine
                .map(|r| -> Result<KvRefineConfig> {
                    let bits = r
                        .parse::<RefineBits>()
                        .map_err(|e| anyhow::anyhow!("--kv {t:?}: {e}"))?;
                    Ok(KvRefineConfig {
                        bits,
                        group: args.group,
                        fraction: args.fraction,
                        tier: tier.clone(),
                    })
                })
                .transpose()?;
            Ok(bench::BenchKv::Quantized(KvConfig {
                sinks: args.sinks,
                refine,
                ..KvConfig::base(base)
            }))
        })
        .collect()
}

/// Parses "512", "128,256" into sizes (every entry a number; 0 allowed only for depths).
pub fn parse_list(flag: &str, s: &str, allow_zero: bool) -> Result<Vec<usize>> {
    if s.trim().is_empty() {
        bail!("{flag}: empty list");
    }
    let v: Vec<usize> = s
        .split(',')
        .map(|p| {
            p.trim()
                .parse::<usize>()
                .with_context(|| format!("{flag} {s:?}: {p:?} is not a whole number"))
        })
        .collect::<Result<_>>()?;
    if !allow_zero && v.contains(&0) {
        bail!("{flag} {s:?}: token counts must be at least 1 (leave the flag out to skip)");
    }
    Ok(v)
}

/// `--head`: bf16 / f32 (the float `dtype`) or group codes q2, q3, q4, q6, q8 (group 128);
/// `auto` is what `sfx-convert` writes by default for `weights` (q8 beside coded projections,
/// the float `dtype` beside float ones).
pub fn parse_head(s: &str, weights: SyntheticWeights) -> Result<SyntheticWeights> {
    match s {
        "auto" if weights == SyntheticWeights::Float => Ok(SyntheticWeights::Float),
        "auto" => Ok(SyntheticWeights::Group {
            bits: 8,
            group: 128,
        }),
        "float" | "bf16" | "f32" => Ok(SyntheticWeights::Float),
        _ => match s.strip_prefix('q').and_then(|b| b.parse::<u8>().ok()) {
            Some(bits) if sfx_formats::resident::SUPPORTED_BITS.contains(&bits) => {
                Ok(SyntheticWeights::Group { bits, group: 128 })
            }
            _ => bail!("--head {s:?}: expected auto, bf16 (the --dtype), q2, q3, q4, q6 or q8"),
        },
    }
}

/// `--quant`: float, group codes rtnN / awqN (group 128), trellis tiles qtipN / yaqaN with
/// `code` (`--trellis-code`: hyb, 1mad, 3inst), look-up-table codes sqllmN (N = 2, 3, 4), or
/// a llama.cpp block type for every projection (q2_k … q6_k, q4_0 … q8_0: GGUF blocks as a
/// GGUF-resident file keeps them).
pub fn parse_quant(s: &str, code: &str, rotation: &str) -> Result<SyntheticWeights> {
    if s == "float" {
        return Ok(SyntheticWeights::Float);
    }
    if let Some(&(_, ty)) = GGML_QUANTS.iter().find(|(name, _)| *name == s) {
        return Ok(SyntheticWeights::Gguf { ty });
    }
    let bits = |prefixes: &[&str]| {
        prefixes
            .iter()
            .find_map(|p| s.strip_prefix(p))
            .and_then(|b| b.parse::<u8>().ok())
            .filter(|b| (2..=4).contains(b))
    };
    if let Some(bits) = bits(&["rtn", "awq"]) {
        return Ok(SyntheticWeights::Group { bits, group: 128 });
    }
    if let Some(bits) = bits(&["sqllm"]) {
        return Ok(SyntheticWeights::Lut { bits });
    }
    if let Some(k) = bits(&["qtip", "yaqa"]) {
        let code = TrellisCode::parse(code)
            .with_context(|| format!("--trellis-code {code:?}: expected hyb, 1mad or 3inst"))?;
        let rotation = Rotation::parse(rotation).with_context(|| {
            format!("--rotation {rotation:?}: expected full or bN (N a power of two, 16 … 4096)")
        })?;
        return Ok(SyntheticWeights::Trellis { code, k, rotation });
    }
    let ggml: Vec<&str> = GGML_QUANTS.iter().map(|(name, _)| *name).collect();
    bail!(
        "--quant {s:?}: expected float, rtn2, rtn3, rtn4, awq2, awq3, awq4, qtip2, qtip3, qtip4, \
         yaqa2, yaqa3, yaqa4, sqllm2, sqllm3, sqllm4, or a llama.cpp type: {}",
        ggml.join(", ")
    )
}

struct Task<'a>(&'a BenchArgs);

/// One table row with its context.
#[derive(serde::Serialize)]
struct Row {
    model: String,
    size_bytes: u64,
    params: u64,
    backend: String,
    graphs: bool,
    #[serde(flatten)]
    result: BenchResult,
    /// bytes_per_token × mean tokens/s (decode rows).
    effective_gbps: f64,
}

/// The model of `spec`, its origin, and for a `.sfx` the container it was loaded from (kept
/// to refuse results should the file change on disk during the run).
fn load<B: ResidentKernels>(
    backend: B,
    spec: &str,
    options: &ModelOptions,
) -> Result<(Model<B>, String, Option<SfxFile>)> {
    if is_sfx_file(std::path::Path::new(spec)) {
        let file = SfxFile::open(spec).with_context(|| format!("opening model {spec}"))?;
        let m = load_sfx_model_on(backend, &file, options)
            .with_context(|| format!("loading model {spec}"))?;
        return Ok((m, spec.to_string(), Some(file)));
    }
    let (m, ckpt) = load_checkpoint_model(backend, spec, options)?;
    Ok((m, ckpt.origin, None))
}

impl OnBackend for Task<'_> {
    type Output = Vec<Row>;
    fn run<B: ResidentKernels>(self, backend: B) -> Result<Vec<Row>> {
        run_on(self.0, backend)
    }
}

fn run_on<B: ResidentKernels>(a: &BenchArgs, backend: B) -> Result<Vec<Row>> {
    let backend_name = backend.name();
    let options = ModelOptions {
        precision: WeightPrecision::Native,
        kv_dtype: a.kv,
        ..ModelOptions::default()
    };
    let t0 = Instant::now();
    if !a.refine_k.is_empty() && a.synthetic.is_some() && !a.fit {
        bail!("--k with --synthetic: add --fit to give the synthetic model refinement columns");
    }
    if a.fit && a.synthetic.is_none() {
        bail!("--fit is for synthetic models; a .sfx model refines from its own sections");
    }
    let mut loaded_from: Option<SfxFile> = None;
    let (mut model, name, params) = match (&a.synthetic, &a.model) {
        (Some(preset), _) => {
            let config = synthetic::preset(preset)?;
            let m = Model::synthetic_with(
                backend, &config, a.dtype, a.weights, a.head, a.seed, &options,
            )
            .with_context(|| format!("building the synthetic {preset}"))?;
            let dt = match a.dtype {
                DType::F32 => "F32",
                _ => "BF16",
            };
            let head = match a.head {
                SyntheticWeights::Group { bits, group } => format!("q{bits}g{group}"),
                _ => dt.to_string(),
            };
            let label = match a.weights {
                SyntheticWeights::Float if a.head == SyntheticWeights::Float => dt.to_string(),
                SyntheticWeights::Float => format!("{dt}, {head} head"),
                SyntheticWeights::Group { .. } => format!("{} g128, {head} head", a.quant),
                SyntheticWeights::Trellis { code, rotation, .. } => {
                    format!(
                        "{} {} {}, {head} head",
                        a.quant,
                        code.name(),
                        rotation.name()
                    )
                }
                SyntheticWeights::Lut { .. } | SyntheticWeights::Gguf { .. } => {
                    format!("{}, {head} head", a.quant)
                }
            };
            (
                m,
                format!("{preset} {label} (synthetic)"),
                synthetic::parameter_count(&config),
            )
        }
        (None, Some(spec)) => {
            let (m, origin, file) = load(backend, spec, &options)?;
            loaded_from = file;
            let params = synthetic::parameter_count(m.config());
            (m, origin, params)
        }
        (None, None) => bail!("give a model (-m FILE) or --synthetic NAME"),
    };
    model.backend().synchronize()?;
    // Loading's kernels are not the benchmark's.
    model.backend().take_kernel_times()?;
    if !a.json {
        eprintln!(
            "{name}: {:.2} GiB resident on {backend_name}, ready in {:.1} s",
            model.resident_bytes() as f64 / (1u64 << 30) as f64,
            t0.elapsed().as_secs_f64()
        );
    }
    let mut refiner = match a.refine_k.first() {
        None => None,
        Some(&k) => {
            let t1 = Instant::now();
            let r = bench_refiner(a, &model, k)?;
            if !a.json {
                eprintln!(
                    "refinement: {} of columns {} in {:.1} s",
                    human_bytes(r.backend_bytes()),
                    if r.in_backend() {
                        "placed in the backend (CUDA: host memory the GPU reads)"
                    } else {
                        "read host-driven"
                    },
                    t1.elapsed().as_secs_f64()
                );
            }
            Some(r)
        }
    };
    let mut tests: Vec<BenchTest> = a.prompt.iter().map(|&n| BenchTest::Prompt(n)).collect();
    tests.extend(a.generate.iter().map(|&n| BenchTest::Generate(n)));
    let mut rows = Vec::new();
    for &graphs in &a.graphs {
        model.set_step_graphs(graphs);
        let json = a.json;
        let kvs = if a.kv_caches.is_empty() {
            vec![bench::BenchKv::Float(a.kv)]
        } else {
            a.kv_caches.clone()
        };
        let results = bench::run(
            &model,
            &tests,
            &a.depths,
            a.reps,
            a.kv,
            &kvs,
            a.seed,
            refiner.as_mut().map(|r| bench::BenchRefine {
                refiner: r,
                ks: a.refine_k.clone(),
                tier: "ram".into(),
            }),
            |what| {
                if !json {
                    eprintln!("  {what} (graphs {})", if graphs { "on" } else { "off" });
                }
            },
        )?;
        for r in results {
            rows.push(Row {
                model: name.clone(),
                size_bytes: model.resident_bytes() as u64,
                params,
                backend: backend_name.clone(),
                graphs: graphs && model.uses_step_graphs() && r.graph_capable,
                effective_gbps: r.bytes_per_token * r.mean / 1e9,
                result: r,
            });
        }
    }
    print_kernel_times(&model.backend().take_kernel_times()?);
    // Rows measured on a file that changed on disk meanwhile are refused, as sfx-run refuses
    // its results.
    if let Some(file) = &loaded_from {
        file.check_unchanged()
            .context("refusing to report this run's results")?;
    }
    Ok(rows)
}

/// The refinement engine of `--k` rows at budget `k`: a synthetic model's random columns
/// placed in the backend, or a .sfx model's own sections (ram tier, in the backend where the
/// backend prefers it).
fn bench_refiner<B: ResidentKernels>(
    a: &BenchArgs,
    model: &Model<B>,
    k: usize,
) -> Result<Refiner<B>> {
    let settings = RefineSettings {
        k: [k; 4],
        s: a.refine_s,
        mlp: MlpMode::Channels,
        bundle_k: sfx_runtime::refine::bundle_budget(k),
    };
    if a.synthetic.is_some() {
        let plan = synthetic::refinement_plan(model.config());
        let seed = a.seed;
        return Refiner::new_in_backend(plan, settings, model.backend(), |src| {
            Ok(std::borrow::Cow::Owned(synthetic::refinement_columns(
                src, seed,
            )))
        })
        .context("building the synthetic refinement");
    }
    let spec = a.model.as_deref().unwrap_or_default();
    if !is_sfx_file(std::path::Path::new(spec)) {
        bail!("--k: {spec} is not a .sfx model (only .sfx files carry refinement)");
    }
    let file = SfxFile::open(spec).with_context(|| format!("opening model {spec}"))?;
    if a.refine_k.len() > 1 && !sfx_runtime::refine::file_ladder(&file).is_empty() {
        bail!(
            "--k {:?}: {spec} is fitted at a ladder of k, one refinement per rung; measure one \
             --k per run (the rows of one run share one engine)",
            a.refine_k
        );
    }
    let plan = plan_from_sfx(&file, model.config(), Some(settings.k))?;
    let options = RefineOpenOptions {
        tier: TierChoice::Ram,
        ..RefineOpenOptions::default()
    };
    let warn = |m: &str| eprintln!("{m}");
    open_refinement(
        model.backend(),
        &file,
        std::path::Path::new(spec),
        plan,
        Some(settings),
        &options,
        &warn,
    )?
    .ok_or_else(|| anyhow::anyhow!("--k: {spec} has no usable refinement"))
}

/// The per-kernel profile (`SFX_PROFILE_KERNELS=1` on CUDA) on stderr, the table on stdout
/// stays the benchmark's.
fn print_kernel_times(times: &[sfx_runtime::backend::KernelTime]) {
    if times.is_empty() {
        return;
    }
    let total: f64 = times.iter().map(|k| k.total_us).sum();
    eprintln!("| kernel | grid | launches | total µs | mean µs | share |");
    eprintln!("| --- | --- | ---: | ---: | ---: | ---: |");
    for k in times {
        eprintln!(
            "| {} | {}×{}×{} | {} | {:.1} | {:.2} | {:.1} % |",
            k.kernel,
            k.grid[0],
            k.grid[1],
            k.grid[2],
            k.launches,
            k.total_us,
            k.total_us / k.launches as f64,
            100.0 * k.total_us / total
        );
    }
}

fn human_bytes(b: u64) -> String {
    let gib = b as f64 / (1u64 << 30) as f64;
    if gib >= 1.0 {
        format!("{gib:.2} GiB")
    } else {
        format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64)
    }
}

fn human_params(p: u64) -> String {
    if p >= 1_000_000_000 {
        format!("{:.2} B", p as f64 / 1e9)
    } else {
        format!("{:.2} M", p as f64 / 1e6)
    }
}

pub fn run(mut a: BenchArgs) -> Result<()> {
    a.model = a.model.map(|m| sfx_formats::package::container_spec(&m));
    if a.reps == 0 {
        bail!("-r/--repetitions must be at least 1");
    }
    if a.prompt.is_empty() && a.generate.is_empty() {
        bail!("nothing to measure: give -p and/or -n");
    }
    let rows = with_backend(a.device, Task(&a))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!("| model | size | params | backend | graphs | kv | refine | test | t/s | GB/s |");
    println!("| --- | ---: | ---: | --- | --- | --- | --- | ---: | ---: | ---: |");
    for r in &rows {
        let gbps = if r.effective_gbps > 0.0 {
            format!("{:.0}", r.effective_gbps)
        } else {
            "".into()
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {:.2} ± {:.2} | {} |",
            r.model,
            human_bytes(r.size_bytes),
            human_params(r.params),
            r.backend,
            if r.graphs { "on" } else { "off" },
            r.result.kv,
            if r.result.refine.is_empty() {
                "-"
            } else {
                &r.result.refine
            },
            r.result.test,
            r.result.mean,
            r.result.sd,
            gbps
        );
    }
    print_kv_bytes(&rows);
    print_refinement(&rows);
    Ok(())
}

/// A table for weight-refinement generation rows: speed against the base row of the same
/// test, cache and graphs setting, the bytes a token fetched and the rate they were read at.
fn print_refinement(rows: &[Row]) {
    let refined: Vec<&Row> = rows
        .iter()
        .filter(|r| !r.result.refine.is_empty() && r.result.test.starts_with("tg"))
        .collect();
    if refined.is_empty() {
        return;
    }
    println!();
    println!("| kv | test | refine | t/s | × base | fetched per token | host read GB/s |");
    println!("| --- | ---: | --- | ---: | ---: | ---: | ---: |");
    for r in refined {
        let base = rows.iter().find(|b| {
            b.result.refine.is_empty()
                && b.result.test == r.result.test
                && b.result.kv == r.result.kv
                && b.graphs == r.graphs
        });
        let ratio = base.map_or(String::new(), |b| {
            format!("{:.3}", r.result.mean / b.result.mean.max(1e-12))
        });
        println!(
            "| {} | {} | {} | {:.2} | {} | {:.2} MiB | {:.1} |",
            r.result.kv,
            r.result.test,
            r.result.refine,
            r.result.mean,
            ratio,
            r.result.refine_read_per_token / (1u64 << 20) as f64,
            r.result.refine_read_per_token * r.result.mean / 1e9
        );
    }
}

/// A second table for generation rows on quantized caches: the cache's bytes per tier at the
/// row's end and the refinement bytes each token read.
fn print_kv_bytes(rows: &[Row]) {
    let kv_rows: Vec<_> = rows
        .iter()
        .filter_map(|r| Some((r, r.result.kv_bytes.as_ref()?)))
        .filter(|(r, _)| r.result.test.starts_with("tg"))
        .collect();
    if kv_rows.is_empty() {
        return;
    }
    println!();
    println!("| kv | test | resident KV | refinement store | refinement read per token |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    for (r, b) in kv_rows {
        println!(
            "| {} | {} | {} | {} | {:.1} KiB |",
            r.result.kv,
            r.result.test,
            human_bytes(b.resident),
            human_bytes(b.tier.backing),
            r.result.kv_refine_read_per_token / 1024.0
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quant_names_pick_their_synthetic_formats() {
        use sfx_formats::gguf::GgmlType;
        let q = |s: &str| parse_quant(s, "hyb", "full");
        assert_eq!(q("sqllm3").unwrap(), SyntheticWeights::Lut { bits: 3 });
        assert_eq!(
            q("q2_k").unwrap(),
            SyntheticWeights::Gguf { ty: GgmlType::Q2K }
        );
        assert_eq!(
            q("q8_0").unwrap(),
            SyntheticWeights::Gguf { ty: GgmlType::Q8_0 }
        );
        assert_eq!(
            q("awq3").unwrap(),
            SyntheticWeights::Group {
                bits: 3,
                group: 128
            }
        );
        for bad in ["sqllm1", "sqllm5", "q7_k", "Q2_K", "sqllm"] {
            assert!(q(bad).is_err(), "{bad}");
        }
        assert_eq!(
            parse_quant("qtip2", "1mad", "b128").unwrap(),
            SyntheticWeights::Trellis {
                code: TrellisCode::OneMad,
                k: 2,
                rotation: Rotation::Blocks { max_log2: 7 }
            }
        );
        assert!(parse_quant("qtip2", "hyb", "b100").is_err());
    }

    #[test]
    fn kv_lists_name_float_caches_and_kvarn_bases() {
        let args = KvRefineArgs {
            sinks: 64,
            group: 2,
            fraction: 1.0 / 128.0,
        };
        let kvs = parse_kv_caches("f16, 2/2,kvarn:3/2,f32, 2/2+4/4,3/2+4/4@vram", args).unwrap();
        let labels: Vec<String> = kvs.iter().map(bench::BenchKv::label).collect();
        assert_eq!(
            labels,
            [
                "f16",
                "kvarn 2/2",
                "kvarn 3/2",
                "f32",
                "kvarn 2/2 +4/+4 g2 1/128 ram",
                "kvarn 3/2 +4/+4 g2 1/128 vram"
            ]
        );
        assert!(parse_kv_caches("2/2+4/4@ssd", args).is_err());
        assert!(matches!(&kvs[1], bench::BenchKv::Quantized(c) if c.sinks == 64));
        assert!(parse_kv_caches("", args).unwrap().is_empty());
        let e = parse_kv_caches("2/2,9/9", args).unwrap_err().to_string();
        assert!(e.contains("--kv \"9/9\""), "{e}");
        let e = parse_kv_caches("2/2+9/4", args).unwrap_err().to_string();
        assert!(e.contains("must be 0..=8"), "{e}");
        assert!(parse_kv_caches("f16+4/4", args).is_err());
    }
}

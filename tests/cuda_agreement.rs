//! SmolLM2 on CUDA against the CPU backend, on the real model (F32 weights: the GGUF's own
//! dequantized values on both): logits at every position of the golden prompts, greedy
//! continuations through the decode path (step graphs), and wiki:2 perplexity and KL; then
//! the converter's resident `.sfx` files (rtn2 and awq4: the tensor-core tile kernels; rtn3
//! and awq3: the CUDA-core ones; refinement off) on both backends: the same codes through the
//! CUDA group kernels and the CPU ones, mean KL over a wiki window and greedy continuations
//! (a divergence reports the CPU's top-2 logit gap there, to tell near-ties from errors), also
//! with quantized heads (`--head q8`, `--head q4`: the tied embedding gathered from codes), and
//! the trellis files (qtip2, yaqa2: the CUDA trellis kernels against the CPU's), and KVarN KV
//! caches held and attended to on the device (every base) against the same cache on the CPU. On a machine
//! without a GPU every case is reported as ignored, by name.

mod common;

use libtest_mimic::{Arguments, Failed, Trial};
use sfx_formats::checkpoint::Checkpoint;
use sfx_formats::sfx::SfxFile;
use sfx_runtime::backend::cuda::CudaBackend;
use sfx_runtime::sampling::argmax;
use sfx_runtime::sfx_model::load_sfx_model_on;
use sfx_runtime::{Backend, CpuBackend, LogitsMode, Model, ModelOptions};
use std::sync::OnceLock;

/// Largest |Δlogit| allowed at any position and vocabulary entry (logits are O(10); FP32 on
/// both sides, different summation orders and cuBLAS's FP32 GEMM in prefill).
const MAX_ABS_LOGIT: f64 = 2e-3;
/// Bounds of the issue: PPL within 0.1 %, mean KL(CPU ‖ CUDA) below 1e-4.
const PPL_REL: f64 = 1e-3;
const MEAN_KL: f64 = 1e-4;
/// Tokens the decode-only comparison of a `.sfx` file feeds one at a time.
const DECODE_TOKENS: usize = 128;

fn cuda_model() -> &'static Model<CudaBackend> {
    static M: OnceLock<Model<CudaBackend>> = OnceLock::new();
    M.get_or_init(|| {
        let ckpt = Checkpoint::open(common::gguf().to_str().unwrap()).unwrap();
        let b = CudaBackend::new(0).expect("CUDA backend");
        Model::load(b, &ckpt.config, &*ckpt.tensors, &common::f32_options()).unwrap()
    })
}

fn all_logits<B: Backend>(m: &Model<B>, ids: &[u32]) -> Vec<f32> {
    let mut cache = m.new_cache(ids.len()).unwrap();
    m.forward(ids, &mut cache, LogitsMode::All)
        .unwrap()
        .into_vec()
}

/// Logits of `ids` fed one token per step through the decode path (no prefill GEMM).
fn decode_logits<B: Backend>(m: &Model<B>, ids: &[u32]) -> Vec<f32> {
    let mut cache = m.new_cache(ids.len()).unwrap();
    let mut out = Vec::new();
    for &t in ids {
        out.extend(
            m.forward(&[t], &mut cache, LogitsMode::All)
                .unwrap()
                .into_vec(),
        );
    }
    out
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).abs())
        .fold(0.0, f64::max)
}

fn greedy<B: Backend>(m: &Model<B>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = m.new_cache(prompt.len() + n).unwrap();
    let mut next = m.forward_greedy(prompt, &mut cache).unwrap();
    let mut out = vec![next];
    for _ in 1..n {
        next = m.forward_greedy(&[next], &mut cache).unwrap();
        out.push(next);
    }
    out
}

/// The gap between the two largest logits after `ids` on `m`.
fn top2_gap<B: Backend>(m: &Model<B>, ids: &[u32], vocab: usize) -> f32 {
    let logits = all_logits(m, ids);
    let last = &logits[logits.len() - vocab..];
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in last {
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    a - b
}

fn ppl(logits: &[f32], ids: &[u32], vocab: usize) -> f64 {
    let mut nll = 0.0f64;
    for t in 0..ids.len() - 1 {
        let row = &logits[t * vocab..(t + 1) * vocab];
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let lse = row.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln() + m;
        nll += lse - row[ids[t + 1] as usize] as f64;
    }
    (nll / (ids.len() - 1) as f64).exp()
}

/// Token ids of a golden prompt.
fn prompt_ids(p: &serde_json::Value) -> Result<Vec<u32>, Failed> {
    Ok(p["ids"]
        .as_array()
        .ok_or("prompt without ids")?
        .iter()
        .map(|v| v.as_u64().unwrap_or(0) as u32)
        .collect())
}

fn report(name: &str, v: serde_json::Value) {
    eprintln!("{name}: {v}");
    if let Some(dir) = std::env::var_os("SFX_AGREEMENT_OUT") {
        let p = std::path::Path::new(&dir).join(format!("{name}.json"));
        let _ = std::fs::write(p, v.to_string());
    }
}

fn golden_logits() -> Result<(), Failed> {
    let (_, cpu) = common::float_model();
    let gpu = cuda_model();
    let vocab = cpu.config().vocab_size;
    let golden = common::fixture("golden_smollm2.json");
    let mut rows = Vec::new();
    let mut worst = 0.0f64;
    for p in golden["prompts"]
        .as_array()
        .ok_or("fixture has no prompts")?
    {
        let ids = prompt_ids(p)?;
        let a = all_logits(cpu, &ids);
        let b = all_logits(gpu, &ids);
        let max_abs = max_abs_diff(&a, &b);
        let argmax_same = (0..ids.len())
            .filter(|&t| {
                argmax(&a[t * vocab..(t + 1) * vocab]) == argmax(&b[t * vocab..(t + 1) * vocab])
            })
            .count();
        worst = worst.max(max_abs);
        rows.push(
            serde_json::json!({"prompt": p["name"], "positions": ids.len(),
            "max_abs_logit_diff": max_abs, "same_argmax_positions": argmax_same}),
        );
    }
    report(
        "golden_logits",
        serde_json::json!({"bound": MAX_ABS_LOGIT, "prompts": rows}),
    );
    if worst > MAX_ABS_LOGIT {
        return Err(format!("max |Δlogit| {worst:.3e} > {MAX_ABS_LOGIT:.0e}").into());
    }
    Ok(())
}

fn greedy_continuations() -> Result<(), Failed> {
    let (_, cpu) = common::float_model();
    let gpu = cuda_model();
    let golden = common::fixture("golden_smollm2.json");
    let mut rows = Vec::new();
    let mut differ = Vec::new();
    for p in golden["prompts"]
        .as_array()
        .ok_or("fixture has no prompts")?
    {
        let ids = prompt_ids(p)?;
        let a = greedy(cpu, &ids, 48);
        let b = greedy(gpu, &ids, 48);
        let same = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        if a != b {
            differ.push(format!("{}: first difference at token {same}", p["name"]));
        }
        rows.push(serde_json::json!({"prompt": p["name"], "tokens": 48, "identical_prefix": same}));
    }
    report(
        "greedy",
        serde_json::json!({"uses_step_graphs": gpu.uses_step_graphs(), "prompts": rows}),
    );
    if !differ.is_empty() {
        return Err(differ.join("; ").into());
    }
    Ok(())
}

fn wiki2() -> Result<(), Failed> {
    let (ckpt, cpu) = common::float_model();
    let gpu = cuda_model();
    let vocab = cpu.config().vocab_size;
    let text = sfx_formats::corpus::wiki_text(&common::assets()).map_err(|e| e.to_string())?;
    let tok = tokenizers::Tokenizer::from_bytes(
        ckpt.tokenizer_json
            .as_ref()
            .ok_or("no tokenizer")?
            .as_bytes(),
    )
    .map_err(|e| e.to_string())?;
    let all = tok
        .encode_fast(text.as_str(), false)
        .map_err(|e| e.to_string())?;
    let ids = all.get_ids();
    let (mut ppl_cpu, mut ppl_gpu, mut kl_sum, mut positions) = (0.0, 0.0, 0.0, 0usize);
    for w in ids.chunks_exact(2048).take(2) {
        let a = all_logits(cpu, w);
        let b = all_logits(gpu, w);
        ppl_cpu += ppl(&a, w, vocab).ln();
        ppl_gpu += ppl(&b, w, vocab).ln();
        // Every scored position (all but the last row predict a token).
        let n = w.len() - 1;
        kl_sum += common::mean_kl(&a[..n * vocab], &b[..n * vocab], vocab) * n as f64;
        positions += n;
    }
    let (ppl_cpu, ppl_gpu) = ((ppl_cpu / 2.0).exp(), (ppl_gpu / 2.0).exp());
    let kl = kl_sum / positions as f64;
    let rel = (ppl_gpu - ppl_cpu).abs() / ppl_cpu;
    report(
        "wiki2",
        serde_json::json!({"ppl_cpu": ppl_cpu, "ppl_cuda": ppl_gpu,
        "ppl_rel_diff": rel, "mean_kl_cpu_cuda": kl, "positions": positions,
        "bounds": {"ppl_rel": PPL_REL, "mean_kl": MEAN_KL}}),
    );
    if rel > PPL_REL || kl > MEAN_KL || !kl.is_finite() {
        return Err(
            format!("PPL {ppl_cpu:.4} vs {ppl_gpu:.4} (rel {rel:.2e}), KL {kl:.2e}").into(),
        );
    }
    Ok(())
}

/// Prompt tokens of the KVarN case: past the 128 sinks and the first tile, into the tail.
const KVARN_PROMPT: usize = 300;
/// Decode steps after it: across the tail's flush at position 384.
const KVARN_DECODE: usize = 150;

/// Share of a KVarN base's own KL (CPU, against the float cache) that CPU and CUDA may differ
/// by. Keys and values reach the encoder from different matmuls (differences of ~1e-6), and
/// at 2 bits an element near a rounding boundary then lands on a different code: the two
/// caches hold slightly different codes, so their gap scales with the base's coarseness
/// (measured on the H200: 2/2 1.1e-3, 2/1 1.1e-4, 3/2 2.3e-5, 3/3 9.5e-6 — below 1 % of each
/// base's own KL).
const KVARN_KL_SHARE: f64 = 0.02;
/// Steps whose greedy token may differ (near-ties after such a code flip).
const KVARN_ARGMAX_MISSES: usize = 2;

/// The KVarN cache in the backend ([`BackendKvarnCache`]) on both backends with the F32 model:
/// a prompt prefilled through the cache (chunks attend to earlier ones as stored) and decode
/// steps over the device-resident tiles, sinks and tail, across a tile flush. Every step's
/// logits: mean KL(CPU ‖ CUDA) within [`KVARN_KL_SHARE`] of the base's own KL on the CPU (or
/// the float bound, whichever is larger), greedy tokens the same but for
/// [`KVARN_ARGMAX_MISSES`] steps.
///
/// With `refine` (bits, group, fraction; units in the RAM tier), every step also selects
/// groups (eq. 7) and corrects (eq. 8) on both backends; the two may select differently where
/// their codes differ, which the same KL share bounds.
fn kvarn_decode(
    key: u32,
    value: u32,
    refine: Option<(u32, u32, usize, f64)>,
) -> Result<(), Failed> {
    use sfx_runtime::kv::{
        BackendKvarnCache, KvBaseChoice, KvBits, KvConfig, KvRefineConfig, KvTierConfig, RefineBits,
    };
    use sfx_runtime::{KvCache, KvShape};
    let (_, cpu) = common::float_model();
    let gpu = cuda_model();
    let vocab = cpu.config().vocab_size;
    let ids = common::wiki_tokens(KVARN_PROMPT + KVARN_DECODE);
    let config = KvConfig {
        refine: refine.map(|(rk, rv, group, fraction)| KvRefineConfig {
            bits: RefineBits { key: rk, value: rv },
            group,
            fraction,
            tier: KvTierConfig::Ram,
        }),
        ..KvConfig::base(KvBaseChoice::Kvarn(KvBits { key, value }))
    };
    let name = match refine {
        None => format!("kvarn_{key}_{value}"),
        Some((rk, rv, g, _)) => format!("kvarn_{key}_{value}_refined_{rk}_{rv}_g{g}"),
    };
    fn run<B: Backend>(m: &Model<B>, ids: &[u32], config: &KvConfig) -> Result<Vec<f32>, Failed> {
        let shape = KvShape::of(m.config());
        let mut cache = BackendKvarnCache::new(m.backend(), shape, ids.len(), config)
            .map_err(|e| e.to_string())?;
        let mut out = m
            .forward(&ids[..KVARN_PROMPT], &mut cache, LogitsMode::Last)
            .map_err(|e| e.to_string())?
            .into_vec();
        for &t in &ids[KVARN_PROMPT..ids.len() - 1] {
            let l = m.forward(&[t], &mut cache, LogitsMode::Last);
            out.extend(l.map_err(|e| e.to_string())?.into_vec());
        }
        if cache.len() != ids.len() - 1 {
            return Err(format!("cache holds {} positions", cache.len()).into());
        }
        Ok(out)
    }
    let a = run(cpu, &ids, &config)?;
    let b = run(gpu, &ids, &config)?;
    let kl = common::mean_kl(&a, &b, vocab);
    // The base's own KL: the same steps through the CPU's float cache.
    let exact = {
        let mut cache = cpu.new_cache(ids.len()).map_err(|e| e.to_string())?;
        let mut out = cpu
            .forward(&ids[..KVARN_PROMPT], &mut cache, LogitsMode::Last)
            .map_err(|e| e.to_string())?
            .into_vec();
        for &t in &ids[KVARN_PROMPT..ids.len() - 1] {
            let l = cpu.forward(&[t], &mut cache, LogitsMode::Last);
            out.extend(l.map_err(|e| e.to_string())?.into_vec());
        }
        out
    };
    let base_kl = common::mean_kl(&exact, &a, vocab);
    let bound = MEAN_KL.max(KVARN_KL_SHARE * base_kl);
    let greedy = |l: &[f32]| l.chunks_exact(vocab).map(argmax).collect::<Vec<_>>();
    let (ga, gb) = (greedy(&a), greedy(&b));
    let same = ga.iter().zip(&gb).filter(|(x, y)| x == y).count();
    report(
        &name,
        serde_json::json!({"steps": ga.len(), "mean_kl_cpu_cuda": kl,
        "max_abs_logit_diff": max_abs_diff(&a, &b), "same_argmax": same,
        "base_kl_cpu": base_kl, "bound_mean_kl": bound}),
    );
    if kl > bound || !kl.is_finite() || same + KVARN_ARGMAX_MISSES < ga.len() {
        return Err(format!(
            "KL {kl:.2e} (bound {bound:.2e}), argmax equal at {same}/{} steps",
            ga.len()
        )
        .into());
    }
    Ok(())
}

/// Converts SmolLM2 to `quant` with `--head head` (no fit; AWQ on a small search grid) with
/// this build's `sfx-convert` (`$SFX_CONVERT` when the test binary runs on another machine).
/// `$SFX_AGREEMENT_SFX=dir` supplies files converted elsewhere as `dir/{quant}-head-{head}.sfx`
/// (a trellis conversion takes ~25 min on 2 cores; the file is the same either way:
/// conversions are deterministic).
fn converted(quant: &str, head: &str) -> Result<std::path::PathBuf, Failed> {
    converted_with(quant, head, &[])
}

/// [`converted`] with extra `sfx-convert` arguments (`--fit` and its calibration), named by
/// them (`awq3-head-bf16-fit.sfx`).
fn converted_with(quant: &str, head: &str, extra: &[&str]) -> Result<std::path::PathBuf, Failed> {
    let tag = if extra.contains(&"--fit") { "-fit" } else { "" };
    let name = format!("{quant}-head-{head}{tag}.sfx");
    if let Some(dir) = std::env::var_os("SFX_AGREEMENT_SFX") {
        let p = std::path::Path::new(&dir).join(&name);
        if p.is_file() {
            return Ok(p);
        }
    }
    let dir = std::env::temp_dir().join("sfx_cuda_agreement");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let out = dir.join(name);
    let convert =
        std::env::var_os("SFX_CONVERT").unwrap_or_else(|| env!("CARGO_BIN_EXE_sfx-convert").into());
    let status = std::process::Command::new(convert)
        .args(["--quant", quant, "--head", head, "--awq-grid", "5,5"])
        .args(extra)
        .arg(common::gguf())
        .arg("-o")
        .arg(&out)
        .stderr(std::process::Stdio::null())
        .status()
        .map_err(|e| e.to_string())?;
    if !status.success() {
        return Err(format!("sfx-convert --quant {quant} failed: {status}").into());
    }
    Ok(out)
}

/// `file`'s model loaded on the CPU and on CUDA.
fn on_both_backends(file: &SfxFile) -> Result<(Model<CpuBackend>, Model<CudaBackend>), Failed> {
    let options = ModelOptions::default();
    let cpu = load_sfx_model_on(CpuBackend::new(), file, &options).map_err(|e| e.to_string())?;
    let gpu = load_sfx_model_on(
        CudaBackend::new(0).map_err(|e| e.to_string())?,
        file,
        &options,
    )
    .map_err(|e| e.to_string())?;
    Ok((cpu, gpu))
}

/// The same `.sfx` on CPU and CUDA: mean KL(CPU ‖ CUDA) over 1024 wiki tokens (prefill: group
/// codes through TF32 panels, trellis codes through tensor-core tiles on f16 inputs), the same
/// over the first 128 fed one at a time (decode only: the matvecs), and greedy continuations.
fn sfx_agreement(quant: &'static str, head: &'static str) -> Result<(), Failed> {
    sfx_agreement_of(&converted(quant, head)?, quant, head)
}

/// [`sfx_agreement`] of the container at `path`, reported as `quant` with `head`.
fn sfx_agreement_of(path: &std::path::Path, quant: &str, head: &str) -> Result<(), Failed> {
    let file = SfxFile::open(path).map_err(|e| e.to_string())?;
    let (cpu, gpu) = on_both_backends(&file)?;
    let vocab = cpu.config().vocab_size;
    let tokenizer = sfx_runtime::sfx_model::sfx_tokenizer_json(&file).ok_or("no tokenizer")?;
    let ids = common::wiki_tokens_with(tokenizer, 1024);
    let a = all_logits(&cpu, &ids);
    let b = all_logits(&gpu, &ids);
    let kl = common::mean_kl(&a, &b, vocab);
    let max_abs = max_abs_diff(&a, &b);
    // The decode path alone (matvec kernels, none of the prefill GEMMs) over the first tokens:
    // tells a prefill-precision gap from a decode-kernel one.
    let dec_ids = &ids[..DECODE_TOKENS.min(ids.len())];
    let (da, db) = (decode_logits(&cpu, dec_ids), decode_logits(&gpu, dec_ids));
    let decode_kl = common::mean_kl(&da, &db, vocab);
    let decode_max_abs = max_abs_diff(&da, &db);
    let golden = common::fixture("golden_smollm2.json");
    let mut differ = Vec::new();
    let mut prompts = 0;
    for p in golden["prompts"]
        .as_array()
        .ok_or("fixture has no prompts")?
    {
        let ids = prompt_ids(p)?;
        let (x, y) = (greedy(&cpu, &ids, 32), greedy(&gpu, &ids, 32));
        if x != y {
            let same = x.iter().zip(&y).take_while(|(u, v)| u == v).count();
            let mut prefix = ids.clone();
            prefix.extend(&x[..same]);
            let gap = top2_gap(&cpu, &prefix, vocab);
            differ.push(format!(
                "{}: first difference at token {same} (CPU top-2 gap there {gap:.3e})",
                p["name"]
            ));
        }
        prompts += 1;
    }
    report(
        &format!("sfx_{quant}_head_{head}"),
        serde_json::json!({"quant": quant, "head": head, "positions": ids.len(), "mean_kl_cpu_cuda": kl,
        "max_abs_logit_diff": max_abs, "decode_positions": dec_ids.len(),
        "decode_mean_kl_cpu_cuda": decode_kl, "decode_max_abs_logit_diff": decode_max_abs,
        "greedy_prompts": prompts, "greedy_identical": prompts - differ.len(),
        "greedy_differences": differ, "bound_mean_kl": MEAN_KL}),
    );
    if kl > MEAN_KL || !kl.is_finite() {
        return Err(format!("{quant}: mean KL {kl:.2e} > {MEAN_KL:.0e}").into());
    }
    if !differ.is_empty() {
        return Err(format!("{quant}: {}", differ.join("; ")).into());
    }
    Ok(())
}

/// Mean over positions of KL(p ‖ q) per position.
fn position_kl(p: &[f32], q: &[f32], vocab: usize) -> Vec<f64> {
    p.chunks_exact(vocab)
        .zip(q.chunks_exact(vocab))
        .map(|(a, b)| common::mean_kl(a, b, vocab))
        .collect()
}

/// A `--fit` file refined on both backends (ram tier): the CPU's host-driven engine against
/// CUDA's engine in the backend (selection and column gather on the device, columns read from
/// mapped host memory, decode steps captured into step graphs with the gathers on a branch).
///
/// Refinement is discontinuous in its input: a channel whose |x| ties the k-th largest to a
/// rounding error can be selected on one backend and not the other, and from that token on the
/// two runs differ by a column's worth (measured: every set alone and each pair of sets give
/// decode logits equal to 3e-11 in KL; all four sets diverge at a near tie in one run). So the
/// strict bound is checked where no tie occurs — the decode path with the attention sets
/// (qkv, o) and with the MLP sets (gate/up, down) — and with every set at k = 16 the two
/// backends must be equally close to the float model (KL to the GGUF's own F32 logits within
/// 10 %), with the first diverging position reported. Also: the units and bytes each engine
/// counted, and how far refinement moved the logits (so agreement is not agreement of two
/// engines that did nothing).
fn sfx_refined_agreement(quant: &'static str) -> Result<(), Failed> {
    use sfx_runtime::refine::{
        file_settings, open_refinement, plan_from_sfx, MlpMode, RefineOpenOptions, Refiner,
        TierChoice,
    };
    let path = converted_with(
        quant,
        "bf16",
        &[
            "--fit",
            "--calib",
            "wiki",
            "--calib-seqs",
            "8",
            "--calib-len",
            "256",
            "--heldout",
            "none",
        ],
    )?;
    let file = SfxFile::open(&path).map_err(|e| e.to_string())?;
    let (cpu, gpu) = on_both_backends(&file)?;
    let config = cpu.config().clone();
    let vocab = config.vocab_size;
    let plan = plan_from_sfx(&file, &config, None).map_err(|e| e.to_string())?;
    let ram = RefineOpenOptions {
        tier: TierChoice::Ram,
        ..RefineOpenOptions::default()
    };
    let warn = |m: &str| eprintln!("{m}");
    let engines = |k: [usize; 4]| -> Result<(Refiner<CpuBackend>, Refiner<CudaBackend>), Failed> {
        let mut settings = file_settings(&file, &plan);
        settings.k = k;
        settings.mlp = MlpMode::Channels;
        let rc = open_refinement(
            cpu.backend(),
            &file,
            &path,
            plan.clone(),
            Some(settings.clone()),
            &ram,
            &warn,
        )
        .map_err(|e| e.to_string())?
        .ok_or("no refinement in the file")?;
        let rg = open_refinement(
            gpu.backend(),
            &file,
            &path,
            plan.clone(),
            Some(settings),
            &ram,
            &warn,
        )
        .map_err(|e| e.to_string())?
        .ok_or("no refinement in the file")?;
        if rc.in_backend() || !rg.in_backend() {
            return Err(
                "expected the host-driven engine on the CPU and the backend engine on CUDA".into(),
            );
        }
        Ok((rc, rg))
    };
    let tokenizer = sfx_runtime::sfx_model::sfx_tokenizer_json(&file).ok_or("no tokenizer")?;
    let ids = common::wiki_tokens_with(tokenizer, 512);
    fn prefill<B: Backend>(m: &Model<B>, ids: &[u32], r: Option<&mut Refiner<B>>) -> Vec<f32> {
        let mut cache = m.new_cache(ids.len()).unwrap();
        match r {
            Some(r) => m.forward_refined(ids, &mut cache, LogitsMode::All, r),
            None => m.forward(ids, &mut cache, LogitsMode::All),
        }
        .unwrap()
        .into_vec()
    }
    fn decode<B: Backend>(m: &Model<B>, ids: &[u32], r: &mut Refiner<B>) -> Vec<f32> {
        let mut cache = m.new_cache(ids.len()).unwrap();
        let mut out = Vec::new();
        for &t in ids {
            out.extend(
                m.forward_refined(&[t], &mut cache, LogitsMode::Last, r)
                    .unwrap()
                    .into_vec(),
            );
        }
        out
    }
    let dec_ids = &ids[..DECODE_TOKENS.min(ids.len())];
    // The strict bound, on the decode path, for the attention sets and the MLP sets.
    let mut pairs = Vec::new();
    for k in [[16, 16, 0, 0], [0, 0, 16, 16]] {
        let (mut rc, mut rg) = engines(k)?;
        let (da, db) = (
            decode(&cpu, dec_ids, &mut rc),
            decode(&gpu, dec_ids, &mut rg),
        );
        let kl = common::mean_kl(&da, &db, vocab);
        let (cc, cg) = (rc.counters(), rg.counters());
        if cc != cg {
            return Err(format!("k {k:?}: counters differ: CPU {cc:?}, CUDA {cg:?}").into());
        }
        pairs.push(serde_json::json!({"k": k, "decode_mean_kl_cpu_cuda": kl,
            "decode_max_abs_logit_diff": max_abs_diff(&da, &db), "counters": cg}));
        if kl > MEAN_KL || !kl.is_finite() {
            return Err(format!("{quant} k {k:?}: decode mean KL {kl:.2e} > {MEAN_KL:.0e}").into());
        }
    }
    // Every set: as close to the float model on both backends.
    let (mut rc, mut rg) = engines([16; 4])?;
    let float = {
        let ckpt = Checkpoint::open(common::gguf().to_str().ok_or("gguf path")?)
            .map_err(|e| e.to_string())?;
        Model::load(
            CpuBackend::new(),
            &ckpt.config,
            &*ckpt.tensors,
            &common::f32_options(),
        )
        .map_err(|e| e.to_string())?
    };
    let reference = prefill(&float, &ids, None);
    let base = prefill(&cpu, &ids, None);
    let a = prefill(&cpu, &ids, Some(&mut rc));
    let b = prefill(&gpu, &ids, Some(&mut rg));
    let (kl_cpu, kl_gpu) = (
        common::mean_kl(&reference, &a, vocab),
        common::mean_kl(&reference, &b, vocab),
    );
    let kl_base = common::mean_kl(&reference, &base, vocab);
    let refine_effect = common::mean_kl(&a, &base, vocab);
    let kl = common::mean_kl(&a, &b, vocab);
    rc.reset_counters();
    rg.reset_counters();
    let (da, db) = (
        decode(&cpu, dec_ids, &mut rc),
        decode(&gpu, dec_ids, &mut rg),
    );
    let dref = decode_logits(&float, dec_ids);
    let (dkl_cpu, dkl_gpu) = (
        common::mean_kl(&dref, &da, vocab),
        common::mean_kl(&dref, &db, vocab),
    );
    let per_position = position_kl(&da, &db, vocab);
    let first_divergence = per_position.iter().position(|&k| k > 1e-6);
    let decode_kl = common::mean_kl(&da, &db, vocab);
    let (cc, cg) = (rc.counters(), rg.counters());
    report(
        &format!("sfx_{quant}_fit_refined"),
        serde_json::json!({"quant": quant, "positions": ids.len(),
        "pairs_of_sets": pairs,
        "all_sets_k16": {
            "mean_kl_cpu_cuda": kl, "decode_mean_kl_cpu_cuda": decode_kl,
            "decode_max_abs_logit_diff": max_abs_diff(&da, &db),
            "decode_first_position_over_1e-6": first_divergence,
            "decode_positions_over_1e-6": per_position.iter().filter(|&&k| k > 1e-6).count(),
            "mean_kl_float_cpu_refined": kl_cpu, "mean_kl_float_cuda_refined": kl_gpu,
            "mean_kl_float_base": kl_base,
            "decode_mean_kl_float_cpu_refined": dkl_cpu,
            "decode_mean_kl_float_cuda_refined": dkl_gpu,
            "mean_kl_refined_vs_base_cpu": refine_effect,
            "cpu_counters": cc, "cuda_counters": cg,
            "cuda_column_bytes_in_host_memory": rg.backend_bytes()},
        "bound_mean_kl": MEAN_KL}),
    );
    if cc != cg {
        return Err(format!("counters differ: CPU {cc:?}, CUDA {cg:?}").into());
    }
    for (what, c, g) in [("prefill", kl_cpu, kl_gpu), ("decode", dkl_cpu, dkl_gpu)] {
        if !g.is_finite() || (g - c).abs() > 0.1 * c {
            return Err(format!(
                "{quant}: {what} KL to the float model {g:.4e} on CUDA, {c:.4e} on the CPU"
            )
            .into());
        }
    }
    if refine_effect < 0.1 * kl_base {
        return Err(format!(
            "refinement moved the logits by KL {refine_effect:.2e} only (base KL {kl_base:.2e})"
        )
        .into());
    }
    Ok(())
}

fn main() {
    let mut args = Arguments::from_args();
    // The cases share one CUDA model and stream; run them one after another.
    args.test_threads = Some(1);
    let gpu = CudaBackend::available();
    if !gpu {
        eprintln!(
            "cuda_agreement: no CUDA device (or no embedded kernels): cases reported as ignored"
        );
    }
    let trials = vec![
        Trial::test("cuda::smollm2::golden_prompt_logits", golden_logits).with_ignored_flag(!gpu),
        Trial::test("cuda::smollm2::greedy_continuations", greedy_continuations)
            .with_ignored_flag(!gpu),
        Trial::test("cuda::smollm2::wiki2_ppl_and_kl", wiki2).with_ignored_flag(!gpu),
        // KVarN KV caches in device memory, every base the CPU has.
        Trial::test("cuda::smollm2::kvarn_2_2", || kvarn_decode(2, 2, None))
            .with_ignored_flag(!gpu),
        Trial::test("cuda::smollm2::kvarn_3_2", || kvarn_decode(3, 2, None))
            .with_ignored_flag(!gpu),
        Trial::test("cuda::smollm2::kvarn_3_3", || kvarn_decode(3, 3, None))
            .with_ignored_flag(!gpu),
        Trial::test("cuda::smollm2::kvarn_2_1", || kvarn_decode(2, 1, None))
            .with_ignored_flag(!gpu),
        // Refined: the paper's +4/+4 in groups of 2 (a larger fraction than its 1/128 so the
        // short run selects several groups per head), and values-only bits over 2/1.
        Trial::test("cuda::smollm2::kvarn_2_2_refined", || {
            kvarn_decode(2, 2, Some((4, 4, 2, 1.0 / 8.0)))
        })
        .with_ignored_flag(!gpu),
        Trial::test("cuda::smollm2::kvarn_2_1_refined", || {
            kvarn_decode(2, 1, Some((0, 1, 4, 1.0 / 16.0)))
        })
        .with_ignored_flag(!gpu),
        Trial::test("cuda::smollm2_sfx::rtn3", || sfx_agreement("rtn3", "bf16"))
            .with_ignored_flag(!gpu),
        Trial::test("cuda::smollm2_sfx::awq3", || sfx_agreement("awq3", "bf16"))
            .with_ignored_flag(!gpu),
        Trial::test("cuda::smollm2_sfx::rtn2", || sfx_agreement("rtn2", "bf16"))
            .with_ignored_flag(!gpu),
        Trial::test("cuda::smollm2_sfx::awq4", || sfx_agreement("awq4", "bf16"))
            .with_ignored_flag(!gpu),
        // Coded heads: the tied embedding gathered from 8-bit file-layout codes (CUDA-core
        // head matvec) and from 4-bit tile-layout codes (tensor-core head matvec).
        Trial::test("cuda::smollm2_sfx::rtn3_head_q8", || {
            sfx_agreement("rtn3", "q8")
        })
        .with_ignored_flag(!gpu),
        Trial::test("cuda::smollm2_sfx::awq4_head_q4", || {
            sfx_agreement("awq4", "q4")
        })
        .with_ignored_flag(!gpu),
        // Trellis tiles (HYB, K = 2, row-major) with the default q8 head: QTIP's LDLQ and
        // YAQA's two-sided LDLQ roundings of the same format.
        Trial::test("cuda::smollm2_sfx::qtip2", || sfx_agreement("qtip2", "q8"))
            .with_ignored_flag(!gpu),
        Trial::test("cuda::smollm2_sfx::yaqa2", || sfx_agreement("yaqa2", "q8"))
            .with_ignored_flag(!gpu),
        // A llama.cpp GGUF's blocks kept as the base (the asset's Q4_1 projections): the CPU
        // runs the blocks, CUDA (no block kernels yet) their dequantized values.
        Trial::test("cuda::smollm2_sfx::gguf_q4_1", || {
            let g = common::gguf();
            let g = g.to_str().ok_or("asset path is not UTF-8")?;
            let extra = [&["--float-source", g][..], &common::QUICK_CALIBRATION].concat();
            let path = converted_with("gguf", "q8", &extra)?;
            sfx_agreement_of(&path, "gguf", "q8")
        })
        .with_ignored_flag(!gpu),
        // Weight refinement: the fitted columns of an awq3 file, host-driven on the CPU and
        // in the backend on CUDA.
        Trial::test("cuda::smollm2_sfx::awq3_fit_refined", || {
            sfx_refined_agreement("awq3")
        })
        .with_ignored_flag(!gpu),
    ];
    libtest_mimic::run(&args, trials).exit();
}

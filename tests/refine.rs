//! Selective refinement at decode time on the real SmolLM2-135M (rtn3 base): refinement
//! lowers KL to the float model at every budget, fitted beats plain, neuron bundles work,
//! the ram and ssd(wait) tiers agree bit for bit, skip never blocks on I/O, and a failing
//! tier degrades to resident precision with one warning.

use crate::common::{
    assets, f32_options as opts, float_model, gguf, logits, mean_kl, wiki_tokens as tokens,
};
use sfx_formats::sfx::SfxFile;
use sfx_runtime::refine::store::{MissPolicy, RefinementStore, SsdStore, UnitReader};
use sfx_runtime::refine::{
    file_settings, open_refinement, plan_from_sfx, MlpMode, RefineOpenOptions, Refiner, TierChoice,
};
use sfx_runtime::{load_sfx_model, CpuBackend, LogitsMode};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

fn out_dir() -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("refine_test");
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn convert(name: &str, extra: &[&str]) -> PathBuf {
    let path = out_dir().join(name);
    let g = gguf();
    let mut args = vec![
        "--quant",
        "rtn3",
        "--head",
        "bf16",
        g.to_str().unwrap(),
        "-o",
        path.to_str().unwrap(),
    ];
    args.extend_from_slice(&[
        "--calib-seqs",
        "8",
        "--calib-len",
        "256",
        "--heldout",
        "none",
    ]);
    args.extend_from_slice(extra);
    let out = Command::new(env!("CARGO_BIN_EXE_sfx-convert"))
        .args(&args)
        .env("SFX_ASSETS", assets())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    path
}

/// rtn3 with plain refinement (channels + bundles), and with fitted refinement, k = 16.
fn containers() -> &'static (PathBuf, PathBuf) {
    static C: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    C.get_or_init(|| {
        (
            convert("rtn3-plain.sfx", &["--mlp", "both"]),
            convert("rtn3-fit.sfx", &["--fit"]),
        )
    })
}

fn refiner(
    file: &SfxFile,
    path: &Path,
    k: usize,
    mlp: MlpMode,
    options: &RefineOpenOptions,
) -> Refiner<CpuBackend> {
    refiner_with_shift(file, path, k, [0.0; 4], mlp, options)
}

/// [`refiner`] with fetch lead/lag `s` per set.
fn refiner_with_shift(
    file: &SfxFile,
    path: &Path,
    k: usize,
    s: [f32; 4],
    mlp: MlpMode,
    options: &RefineOpenOptions,
) -> Refiner<CpuBackend> {
    let config = file.metadata().config.clone().unwrap();
    let plan = plan_from_sfx(file, &config, Some([k; 4])).unwrap();
    let mut settings = file_settings(file, &plan);
    settings.k = [k; 4];
    settings.s = s;
    settings.bundle_k = (3 * k + 2) / 4;
    settings.mlp = mlp;
    let warn = |m: &str| panic!("unexpected warning: {m}");
    open_refinement(
        &CpuBackend::new(),
        file,
        path,
        plan,
        Some(settings),
        options,
        &warn,
    )
    .unwrap()
    .unwrap()
}

#[test]
fn refinement_lowers_kl_at_every_budget_and_fitted_beats_plain() {
    let (plain_path, fit_path) = containers();
    let (ckpt, float) = float_model();
    let vocab = ckpt.config.vocab_size;
    let ids = tokens(160);
    let reference = logits(float, &ids, None);
    let plain = SfxFile::open(plain_path).unwrap();
    let model = load_sfx_model(&plain, &opts()).unwrap();
    let kl_base = mean_kl(&reference, &logits(&model, &ids, None), vocab);
    let ram = RefineOpenOptions::default();
    let mut last = kl_base;
    for k in [4, 16, 64] {
        let mut r = refiner(&plain, plain_path, k, MlpMode::Channels, &ram);
        let kl = mean_kl(&reference, &logits(&model, &ids, Some(&mut r)), vocab);
        eprintln!("plain k={k}: KL {kl:.4} (base {kl_base:.4})");
        assert!(kl < last, "k={k}: KL {kl} not below {last}");
        last = kl;
        let c = r.counters();
        assert_eq!(
            c.units_applied, c.units_selected,
            "ram tier applies everything"
        );
    }
    let mut r = refiner(&plain, plain_path, 16, MlpMode::Bundles, &ram);
    let kl_bundles = mean_kl(&reference, &logits(&model, &ids, Some(&mut r)), vocab);
    eprintln!("plain bundles k=16: KL {kl_bundles:.4}");
    assert!(
        kl_bundles < 0.9 * kl_base,
        "bundles {kl_bundles} vs base {kl_base}"
    );

    let mut r = refiner(&plain, plain_path, 16, MlpMode::Channels, &ram);
    let kl_plain16 = mean_kl(&reference, &logits(&model, &ids, Some(&mut r)), vocab);
    let fit = SfxFile::open(fit_path).unwrap();
    let fit_model = load_sfx_model(&fit, &opts()).unwrap();
    let mut r = refiner(&fit, fit_path, 16, MlpMode::Channels, &ram);
    let kl_fit16 = mean_kl(&reference, &logits(&fit_model, &ids, Some(&mut r)), vocab);
    eprintln!("k=16: plain {kl_plain16:.4}, fitted {kl_fit16:.4}");
    assert!(
        kl_fit16 <= kl_plain16,
        "fitted {kl_fit16} vs plain {kl_plain16}"
    );
}

#[test]
fn ram_and_ssd_wait_tiers_give_identical_logits() {
    let (path, _) = containers();
    let file = SfxFile::open(path).unwrap();
    let model = load_sfx_model(&file, &opts()).unwrap();
    let ids = tokens(48);
    let ram = RefineOpenOptions::default();
    let ssd = RefineOpenOptions {
        tier: TierChoice::Ssd,
        cache_bytes: 1 << 20,
        miss: MissPolicy::Wait,
        ..RefineOpenOptions::default()
    };
    for mlp in [MlpMode::Channels, MlpMode::Bundles] {
        let mut a = refiner(&file, path, 16, mlp, &ram);
        let mut b = refiner(&file, path, 16, mlp, &ssd);
        let la = logits(&model, &ids, Some(&mut a));
        let lb = logits(&model, &ids, Some(&mut b));
        assert!(la == lb, "{mlp:?}: ram and ssd(wait) logits differ");
        let st = b.store_stats();
        assert!(st.misses > 0 && st.hits > 0, "{st:?}");
        assert!(st.cache_peak_bytes <= 1 << 20, "cache over budget: {st:?}");
    }
}

/// The engine in the backend (the columns copied into a backend byte store, selection and
/// accumulate as backend ops — the CUDA path's structure) gives the host-driven engine's
/// logits bit for bit on the CPU backend, prefill rows and decode steps alike, and counts the
/// same units and bytes — at s = 0 and under fetch lead and lag (selection from an earlier
/// stream, staged columns, contributions added later), which the host-driven engine
/// implements independently; settings it does not cover stay host-driven with one note.
#[test]
fn engine_in_the_backend_matches_the_host_driven_engine() {
    let (_, path) = containers();
    let file = SfxFile::open(path).unwrap();
    let model = load_sfx_model(&file, &opts()).unwrap();
    let ids = tokens(40);
    let host = RefineOpenOptions {
        in_backend: Some(false),
        ..RefineOpenOptions::default()
    };
    let placed = RefineOpenOptions {
        in_backend: Some(true),
        ..RefineOpenOptions::default()
    };
    let shifts = [
        (4, [0.0; 4]),
        (16, [0.0; 4]),
        (16, [0.5, 1.0, 1.0, 0.5]),
        (8, [1.5, 0.5, 0.5, 2.0]),
    ];
    for (k, s) in shifts {
        let mut a = refiner_with_shift(&file, path, k, s, MlpMode::Channels, &host);
        let mut b = refiner_with_shift(&file, path, k, s, MlpMode::Channels, &placed);
        assert!(!a.in_backend() && b.in_backend() && b.backend_bytes() > 0);
        assert!(b.graph_id().is_some() && a.graph_id().is_none());
        // Prefill rows, then decode steps one token at a time.
        let (pre, steps) = ids.split_at(24);
        let run = |r: &mut Refiner<CpuBackend>| {
            let mut cache = model.new_cache(ids.len()).unwrap();
            let mut out = model
                .forward_refined(pre, &mut cache, LogitsMode::All, r)
                .unwrap()
                .into_vec();
            for &t in steps {
                out.extend(
                    model
                        .forward_refined(&[t], &mut cache, LogitsMode::Last, r)
                        .unwrap()
                        .into_vec(),
                );
            }
            out
        };
        let (la, lb) = (run(&mut a), run(&mut b));
        assert!(
            la == lb,
            "k={k} s={s:?}: in-backend logits differ from host-driven ones"
        );
        let (ca, cb) = (a.counters(), b.counters());
        assert_eq!(ca, cb, "k={k} s={s:?}: counters");
        assert!(cb.bytes_applied > 0);
        // Lead and lag change what is refined: the shifted run is not the s = 0 one.
        if s != [0.0; 4] {
            let mut z = refiner(&file, path, k, MlpMode::Channels, &placed);
            assert!(run(&mut z) != lb, "k={k} s={s:?}: same logits as s = 0");
        }
    }
    // Neuron bundles are host-driven: the placed request falls back with one note.
    let (plain_path, _) = containers();
    let plain = SfxFile::open(plain_path).unwrap();
    let config = plain.metadata().config.clone().unwrap();
    let plan = plan_from_sfx(&plain, &config, None).unwrap();
    let mut settings = file_settings(&plain, &plan);
    settings.mlp = MlpMode::Bundles;
    settings.bundle_k = 12;
    let notes = Mutex::new(Vec::<String>::new());
    let warn = |m: &str| notes.lock().unwrap().push(m.to_string());
    let r = open_refinement(
        &CpuBackend::new(),
        &plain,
        plain_path,
        plan,
        Some(settings),
        &placed,
        &warn,
    )
    .unwrap()
    .unwrap();
    assert!(!r.in_backend());
    let notes = notes.lock().unwrap();
    assert!(
        notes.len() == 1 && notes[0].contains("bundles"),
        "{notes:?}"
    );
}

/// Reads the file, slowly; or fails every read.
struct SlowReader {
    file: std::fs::File,
    delay: Duration,
    fail: bool,
}

impl UnitReader for SlowReader {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        if self.fail {
            return Err(std::io::Error::other("injected read failure"));
        }
        std::thread::sleep(self.delay);
        std::os::unix::fs::FileExt::read_exact_at(&self.file, buf, offset)
    }
}

fn engine_with(file: &SfxFile, store: Arc<dyn RefinementStore>) -> Refiner<CpuBackend> {
    let config = file.metadata().config.clone().unwrap();
    let plan = plan_from_sfx(file, &config, None).unwrap();
    let settings = file_settings(file, &plan);
    Refiner::new(plan, store, settings).unwrap()
}

#[test]
fn skip_never_blocks_and_a_failing_tier_degrades_to_the_base() {
    let (path, _) = containers();
    let file = SfxFile::open(path).unwrap();
    let model = load_sfx_model(&file, &opts()).unwrap();
    let ids = tokens(8);
    let base = logits(&model, &ids, None);

    // Every read takes 100 ms; 8 tokens select ~19k units. Waiting would take half an hour;
    // skip must finish the forward at resident-or-better speed.
    let reader = SlowReader {
        file: std::fs::File::open(path).unwrap(),
        delay: Duration::from_millis(100),
        fail: false,
    };
    let store = Arc::new(SsdStore::new(
        Arc::new(reader),
        16 << 20,
        MissPolicy::Skip,
        2,
    ));
    let mut r = engine_with(&file, store);
    let t0 = Instant::now();
    let skipped = logits(&model, &ids, Some(&mut r));
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(20), "skip forward took {took:?}");
    let c = r.counters().clone();
    assert!(c.units_skipped > 0, "{c:?}");
    assert!(skipped.iter().all(|v| v.is_finite()));

    // A tier whose reads fail: one warning, every unit skipped, logits exactly the base's.
    let warnings = Arc::new(Mutex::new(Vec::<String>::new()));
    let sink = {
        let w = Arc::clone(&warnings);
        Arc::new(move |m: &str| w.lock().unwrap().push(m.to_string()))
    };
    let reader = SlowReader {
        file: std::fs::File::open(path).unwrap(),
        delay: Duration::ZERO,
        fail: true,
    };
    let store = SsdStore::with_options(
        Arc::new(reader),
        sfx_runtime::refine::store::SsdOptions {
            cache_budget_bytes: 16 << 20,
            policy: MissPolicy::Wait,
            warn: sink,
            ..Default::default()
        },
    );
    let mut r = engine_with(&file, Arc::new(store));
    let failed = logits(&model, &ids, Some(&mut r));
    assert!(
        failed == base,
        "a failed tier must leave the resident output untouched"
    );
    assert_eq!(
        warnings.lock().unwrap().len(),
        1,
        "{:?}",
        warnings.lock().unwrap()
    );
    assert!(r.counters().units_failed > 0);
}

#[test]
fn corrupt_refinement_is_refused_with_one_warning() {
    let (path, _) = containers();
    let bytes = std::fs::read(path).unwrap();
    let file = SfxFile::open(path).unwrap();
    let victim = file
        .sections()
        .find(|s| s.name == "model.layers.3.mlp.up_proj.refine")
        .unwrap();
    let mut bad = bytes.clone();
    bad[victim.offset as usize + 17] ^= 0x40;
    let bad_path = out_dir().join("bitflip.sfx");
    std::fs::write(&bad_path, &bad).unwrap();
    let bad_file = SfxFile::open(&bad_path).unwrap();
    let config = bad_file.metadata().config.clone().unwrap();
    let warnings = Mutex::new(Vec::<String>::new());
    let warn = |m: &str| warnings.lock().unwrap().push(m.to_string());
    let plan = plan_from_sfx(&bad_file, &config, None).unwrap();
    let r = open_refinement::<CpuBackend>(
        &CpuBackend::new(),
        &bad_file,
        &bad_path,
        plan,
        None,
        &RefineOpenOptions::default(),
        &warn,
    )
    .unwrap();
    assert!(r.is_none());
    let w = warnings.lock().unwrap();
    assert_eq!(w.len(), 1);
    assert!(
        w[0].contains("model.layers.3.mlp.up_proj.refine"),
        "{}",
        w[0]
    );
    // The CLI keeps running at resident precision.
    let out = Command::new(env!("CARGO_BIN_EXE_sfx-run"))
        .args([
            bad_path.to_str().unwrap(),
            "--ppl",
            "wiki:1",
            "--ctx",
            "64",
            "--json",
        ])
        .env("SFX_ASSETS", assets())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(
        stderr.matches("warning: refinement disabled").count(),
        1,
        "{stderr}"
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["refined"], false);
    std::fs::remove_file(&bad_path).unwrap();
}

/// `sfx-run --soak` (issue 20): several generations in one process on the ssd tiers of the
/// weights and of a KVarN cache, sampled every 50 tokens: the report has every sample, both
/// caches report their occupancy within budget, memory passes the verdict; a soak too short
/// to reach a third generation (memory is judged against the second) fails and says why.
#[test]
fn soak_samples_every_interval_and_judges_memory_and_caches() {
    let (_, fitted) = containers();
    let dir = out_dir().join("soak");
    std::fs::create_dir_all(&dir).unwrap();
    let csv = dir.join("soak.csv");
    let run = |soak: &str, n: &str, log: Option<&Path>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sfx-run"));
        cmd.arg(fitted).args([
            "-p",
            "The history of the city begins",
            "-n",
            n,
            "--soak",
            soak,
            "--soak-every",
            "50",
            "--device",
            "cpu",
            "--refine-tier",
            "ssd",
            "--weight-cache",
            "2MiB",
            "--kv",
            "3/2",
            "--kv-tier",
            "ssd",
            "--kv-cache",
            "64KiB",
            "--json",
        ]);
        if let Some(l) = log {
            cmd.arg("--soak-log").arg(l);
        }
        cmd.output().unwrap()
    };
    let out = run("600", "150", Some(&csv));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let s = &v["summary"];
    assert_eq!(s["tokens"], 600, "{s}");
    assert_eq!(s["generations"], 4, "{s}");
    assert_eq!(v["samples"].as_array().unwrap().len(), 12);
    assert_eq!(s["failures"].as_array().unwrap().len(), 0, "{s}");
    let weight = s["weight_cache_max_bytes"]
        .as_u64()
        .expect("ssd tier cache");
    assert!(weight > 0 && weight <= 2 << 20, "{s}");
    assert_eq!(s["weight_cache_budget"], 2 << 20);
    assert_eq!(s["kv_cache_budget"], 64 << 10);
    assert!(s["kv_cache_max_bytes"].as_u64().expect("KV spill cache") <= 64 << 10);
    let rows = std::fs::read_to_string(&csv).unwrap();
    assert_eq!(rows.lines().count(), 13, "{rows}");
    assert!(
        rows.lines().last().unwrap().starts_with("600,3,150,"),
        "{rows}"
    );

    let short = run("300", "200", None);
    assert_eq!(short.status.code(), Some(1));
    let err = String::from_utf8_lossy(&short.stderr);
    assert!(err.contains("no sample in a third generation"), "{err}");
}

//! The fault matrix of issue 20 (docs/measurements/issue20/fault_matrix.md), one test per
//! group of rows, on the real SmolLM2-135M:
//! - SSD-tier reads that fail, come back short, slow or corrupted at random during decode, for
//!   the weight refinement and the KV spill tier, under skip and wait: one warning, resident
//!   precision for every unit not delivered, no corrupted unit ever applied (the logits equal
//!   a replay that applies exactly the delivered units from the verified file), no panic;
//! - the `.sfx` truncated, rewritten in place or replaced by a rename while `sfx-run` has it
//!   mapped: a clear error (exit 1, the file named) or an identical answer, never a silent
//!   SIGBUS and never a wrong answer with exit 0;
//! - the disk filling up during a conversion (RLIMIT_FSIZE: writes fail with EFBIG): a clear
//!   error naming the output, the previous output untouched, resumable state or none;
//! - `kill -9` at random points of a conversion: the previous output untouched or the whole
//!   new one, and only the documented partial state left;
//! - two `sfx-run` processes on one file at once: both give the solo run's output.

use crate::common::{assets, f32_options as opts, float_model, quick_args, stdout_of, wiki_tokens};
use sfx_formats::sfx::SfxFile;
use sfx_runtime::kv::tier::ReaderWrap;
use sfx_runtime::kv::{
    KvBaseChoice, KvBits, KvConfig, KvRefineConfig, KvTierConfig, QuantKvCache, RefineBits,
};
use sfx_runtime::refine::fault::{FaultCounts, FaultPlan, FaultReader};
use sfx_runtime::refine::open::unit_checksums;
use sfx_runtime::refine::store::{
    Fetched, MissPolicy, RamStore, RefinementStore, SsdOptions, SsdStore, StoreStats, UnitCheck,
    UnitKey, UnitReader, UnitRef, WarnSink,
};
use sfx_runtime::refine::{file_settings, plan_from_sfx, RefinementPlan, Refiner};
use sfx_runtime::sfx_model::sfx_tokenizer_json;
use sfx_runtime::{load_sfx_model, CpuBackend, KvCache, LogitsMode, Model};
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

fn out_dir(sub: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("faults_test")
        .join(sub);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The shared refined container (rtn4, fitted channels and neuron bundles at k = 8, ram tier
/// as stored), converted once per test binary by the convert tests' helper.
fn container() -> &'static PathBuf {
    crate::convert::rtn4_fit_k8_path()
}

/// A warning sink that records every message.
fn capture() -> (WarnSink, Arc<Mutex<Vec<String>>>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let l = Arc::clone(&log);
    let sink: WarnSink = Arc::new(move |m: &str| l.lock().unwrap().push(m.to_string()));
    (sink, log)
}

/// Exactly one warning when a read went wrong, none otherwise; the warning names the tier,
/// the fault and the fallback.
fn check_warnings(what: &str, faults: FaultCounts, log: &[String], source: &str) {
    if faults.faulty() == 0 {
        assert!(log.is_empty(), "{what}: {log:?}");
        return;
    }
    assert_eq!(log.len(), 1, "{what}: {faults:?} gave {log:?}");
    let w = &log[0];
    assert!(
        w.starts_with("warning: refinement tier ssd failed")
            && w.contains(source)
            && w.contains("continuing at resident precision")
            && (w.contains("injected read failure")
                || w.contains("injected short read")
                || w.contains("checksum mismatch")),
        "{what}: {w}"
    );
}

// ---------------------------------------------------------------------------------------------
// Weight refinement, ssd tier
// ---------------------------------------------------------------------------------------------

/// One fetch as the engine saw it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Seen {
    key: UnitKey,
    at: UnitRef,
    applied: bool,
}

/// Passes fetches through to `inner`, recording each outcome and counting served units whose
/// bytes differ from the file's (`truth`: the same file mapped, never faulted).
struct Recording {
    inner: Arc<dyn RefinementStore>,
    truth: RamStore,
    seen: Mutex<Vec<Seen>>,
    corrupt: AtomicU64,
}

impl RefinementStore for Recording {
    fn fetch(&self, key: UnitKey, at: UnitRef, out: &mut Vec<u8>) -> Fetched {
        let before = out.len();
        let got = self.inner.fetch(key, at, out);
        let applied = got.has_bytes();
        if applied && self.truth.bytes(at.offset, at.len as usize) != Some(&out[before..]) {
            self.corrupt.fetch_add(1, Ordering::Relaxed);
        }
        self.seen.lock().unwrap().push(Seen { key, at, applied });
        got
    }
    fn stats(&self) -> StoreStats {
        self.inner.stats()
    }
    fn reset_stats(&self) {
        self.inner.reset_stats()
    }
    fn name(&self) -> &'static str {
        "recording"
    }
    fn prefetch(&self, key: UnitKey, at: UnitRef) {
        self.inner.prefetch(key, at)
    }
}

/// Replays a recorded run: the n-th fetch must be the recorded n-th; it gets the file's true
/// bytes if the recorded run applied that unit, and nothing otherwise.
struct Replay {
    truth: RamStore,
    seen: Vec<Seen>,
    next: AtomicUsize,
    diverged: AtomicBool,
}

impl RefinementStore for Replay {
    fn fetch(&self, key: UnitKey, at: UnitRef, out: &mut Vec<u8>) -> Fetched {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        match self.seen.get(i) {
            Some(s) if s.key == key && s.at == at => {
                if !s.applied {
                    return Fetched::Failed;
                }
                match self.truth.bytes(at.offset, at.len as usize) {
                    Some(b) => {
                        out.extend_from_slice(b);
                        Fetched::Hit
                    }
                    None => Fetched::Failed,
                }
            }
            _ => {
                self.diverged.store(true, Ordering::Relaxed);
                Fetched::Failed
            }
        }
    }
    fn stats(&self) -> StoreStats {
        StoreStats::default()
    }
    fn reset_stats(&self) {}
    fn name(&self) -> &'static str {
        "replay"
    }
}

/// The container's model, plan, unit checksums and 10 wiki tokens (its own tokenizer).
struct Weights {
    file: SfxFile,
    model: Model<CpuBackend>,
    plan: RefinementPlan,
    sums: Arc<dyn UnitCheck>,
    ids: Vec<u32>,
}

fn weights() -> Weights {
    let file = SfxFile::open(container()).unwrap();
    let model = load_sfx_model(&file, &opts()).unwrap();
    let config = file.metadata().config.clone().unwrap();
    let plan = plan_from_sfx(&file, &config, None).unwrap();
    let t = Instant::now();
    let sums = unit_checksums(&file, &plan).unwrap();
    eprintln!(
        "unit checksums: {} units, {} bytes of RAM, {:.1} ms",
        sums.units(),
        sums.heap_bytes(),
        t.elapsed().as_secs_f64() * 1e3
    );
    let ids = crate::common::wiki_tokens_with(sfx_tokenizer_json(&file).unwrap(), 10);
    Weights {
        file,
        model,
        plan,
        sums: Arc::new(sums),
        ids,
    }
}

impl Weights {
    /// A 6-token prefill then 4 decode steps: every position's logits.
    fn run(&self, store: Option<Arc<dyn RefinementStore>>) -> Vec<f32> {
        let mut r = store.map(|s| {
            Refiner::new(self.plan.clone(), s, file_settings(&self.file, &self.plan)).unwrap()
        });
        let m = &self.model;
        let mut cache = m.new_cache(self.ids.len()).unwrap();
        let (pre, steps) = self.ids.split_at(6);
        let mut fwd = |ids: &[u32], mode| match r.as_mut() {
            Some(r) => m.forward_refined(ids, &mut cache, mode, r),
            None => m.forward(ids, &mut cache, mode),
        };
        let mut out = fwd(pre, LogitsMode::All).unwrap().into_vec();
        for &t in steps {
            out.extend(fwd(&[t], LogitsMode::Last).unwrap().into_vec());
        }
        out
    }

    fn truth(&self) -> RamStore {
        RamStore::open(container()).unwrap()
    }

    /// A run through an ssd store over the file with `plan`'s faults; the logits, what the
    /// engine saw, the corrupted units it was served, the faults and the warnings.
    fn faulty_run(
        &self,
        plan: FaultPlan,
        policy: MissPolicy,
    ) -> (Vec<f32>, Vec<Seen>, u64, FaultCounts, Vec<String>) {
        let file = std::fs::File::open(container()).unwrap();
        let reader = Arc::new(FaultReader::new(Arc::new(file), plan));
        let (sink, log) = capture();
        let store = SsdStore::with_options(
            reader.clone(),
            SsdOptions {
                // A tenth of what 10 tokens select: most fetches read the file.
                cache_budget_bytes: 256 << 10,
                policy,
                loader_threads: 2,
                source: "rtn4-fit-k8.sfx".into(),
                warn: sink,
                check: Some(Arc::clone(&self.sums)),
                ..SsdOptions::default()
            },
        );
        let rec = Arc::new(Recording {
            inner: Arc::new(store),
            truth: self.truth(),
            seen: Mutex::new(Vec::new()),
            corrupt: AtomicU64::new(0),
        });
        let logits = self.run(Some(rec.clone()));
        // The engine is gone: the last reference drops the store, joining its loaders, so
        // every read they started has been counted and has warned.
        let rec = Arc::into_inner(rec).expect("the engine released the store");
        let Recording {
            inner,
            seen,
            corrupt,
            ..
        } = rec;
        drop(inner);
        let log = log.lock().unwrap().clone();
        (
            logits,
            seen.into_inner().unwrap(),
            corrupt.into_inner(),
            reader.counts(),
            log,
        )
    }
}

/// Rows "weights × ssd × skip/wait × fail/short/flip/slow/mixed at random": no corrupted unit
/// is ever applied (checked unit by unit, and end to end: the logits equal a replay that
/// applies exactly the delivered units from the verified file and the resident base for every
/// other), one warning once a read went wrong, and waiting on slow reads is exact.
#[test]
fn weight_ssd_tier_applies_only_verified_units_under_random_faults() {
    let w = weights();
    let ram = w.run(Some(Arc::new(w.truth())));
    let delay = Duration::from_micros(100);
    let plans = [
        (
            "flip",
            FaultPlan {
                seed: 11,
                flip: 3e-4,
                ..FaultPlan::default()
            },
        ),
        (
            "fail+short",
            FaultPlan {
                seed: 12,
                fail: 2e-4,
                short: 2e-4,
                ..FaultPlan::default()
            },
        ),
        (
            "slow",
            FaultPlan {
                seed: 13,
                slow: 0.05,
                delay,
                ..FaultPlan::default()
            },
        ),
        (
            "mixed",
            FaultPlan {
                seed: 14,
                fail: 1e-4,
                short: 1e-4,
                flip: 2e-4,
                slow: 0.02,
                delay,
            },
        ),
    ];
    for policy in [MissPolicy::Skip, MissPolicy::Wait] {
        for (name, plan) in plans {
            let what = format!("weights ssd {policy} {name}");
            let (logits, seen, corrupt, faults, log) = w.faulty_run(plan, policy);
            let applied = seen.iter().filter(|s| s.applied).count();
            eprintln!(
                "{what}: {} fetches, {applied} applied, {faults:?}, warnings {log:?}",
                seen.len()
            );
            assert_eq!(corrupt, 0, "{what}: {corrupt} corrupted units applied");
            assert!(logits.iter().all(|v| v.is_finite()), "{what}");
            check_warnings(&what, faults, &log, "rtn4-fit-k8.sfx");
            let n = seen.len();
            let replay = Arc::new(Replay {
                truth: w.truth(),
                seen,
                next: AtomicUsize::new(0),
                diverged: AtomicBool::new(false),
            });
            let replayed = w.run(Some(replay.clone()));
            assert!(
                !replay.diverged.load(Ordering::Relaxed),
                "{what}: fetches diverged"
            );
            assert_eq!(replay.next.load(Ordering::Relaxed), n, "{what}");
            assert!(
                replayed == logits,
                "{what}: logits differ from the replay's"
            );
            if name == "slow" && policy == MissPolicy::Wait {
                assert!(
                    applied == n && logits == ram,
                    "{what}: waiting is not exact"
                );
            }
        }
    }
}

/// Plans in which every read goes wrong in one way, with the words its warning must contain.
fn every_read_goes_wrong() -> [(&'static str, FaultPlan, &'static str); 3] {
    [
        (
            "fail",
            FaultPlan {
                fail: 1.0,
                ..FaultPlan::default()
            },
            "injected read failure",
        ),
        (
            "short",
            FaultPlan {
                short: 1.0,
                ..FaultPlan::default()
            },
            "injected short read",
        ),
        (
            "flip",
            FaultPlan {
                flip: 1.0,
                ..FaultPlan::default()
            },
            "checksum mismatch",
        ),
    ]
}

/// Rows "weights × ssd × skip/wait × every read failing / short / corrupted": the logits are
/// exactly the resident base's, with one warning naming the fault.
#[test]
fn weight_ssd_tier_whose_every_read_goes_wrong_runs_at_the_base() {
    let w = weights();
    let base = w.run(None);
    for policy in [MissPolicy::Skip, MissPolicy::Wait] {
        for (name, plan, says) in every_read_goes_wrong() {
            let what = format!("weights ssd {policy} every read {name}");
            let (logits, seen, corrupt, faults, log) = w.faulty_run(plan, policy);
            assert!(faults.reads > 0, "{what}");
            assert_eq!(corrupt, 0, "{what}");
            assert!(
                seen.iter().all(|s| !s.applied),
                "{what}: a unit was applied"
            );
            assert!(logits == base, "{what}: logits are not the base's");
            assert_eq!(log.len(), 1, "{what}: {log:?}");
            assert!(log[0].contains(says), "{what}: {}", log[0]);
            eprintln!("{what}: {}", log[0]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// KV refinement, ssd tier (the spill file)
// ---------------------------------------------------------------------------------------------

const SINKS: usize = 16;
/// KVarN tiles are 128 tokens: the prefill leaves two encoded tiles behind the sinks.
const PREFILL: usize = SINKS + 2 * 128;
const DECODE: usize = 12;

fn kvarn22() -> KvBaseChoice {
    KvBaseChoice::Kvarn(KvBits { key: 2, value: 2 })
}

fn kv_refined(tier: KvTierConfig) -> KvConfig {
    KvConfig {
        base: kvarn22(),
        sinks: SINKS,
        refine: Some(KvRefineConfig {
            bits: RefineBits { key: 4, value: 4 },
            group: 2,
            fraction: 1.0 / 16.0,
            tier,
        }),
    }
}

fn kv_ssd(cache_budget: u64, policy: MissPolicy) -> KvConfig {
    kv_refined(KvTierConfig::Ssd {
        dir: out_dir("kv_spill"),
        cache_budget,
        policy,
    })
}

/// Decodes the DECODE tokens after an exact float prefill, through a quantized cache of
/// `config` whose spill-file reads go through `plan`'s faults: the logits of every step,
/// the cache's counters, the faults and the warnings.
fn kv_decode(
    config: &KvConfig,
    plan: Option<FaultPlan>,
) -> (
    Vec<f32>,
    sfx_runtime::kv::KvCacheStats,
    FaultCounts,
    Vec<String>,
) {
    static PREFILLED: OnceLock<(Vec<u32>, sfx_runtime::FloatKvCache<CpuBackend>)> = OnceLock::new();
    let (_, model) = float_model();
    let (ids, float) = PREFILLED.get_or_init(|| {
        let ids = wiki_tokens(PREFILL + DECODE);
        let mut float = model.new_cache(ids.len()).unwrap();
        model
            .forward(&ids[..PREFILL], &mut float, LogitsMode::Last)
            .unwrap();
        (ids, float)
    });
    let mut cache =
        QuantKvCache::<CpuBackend>::from_f32(model.backend(), float, PREFILL, ids.len(), config)
            .unwrap();
    let faults = Arc::new(Mutex::new(None::<Arc<FaultReader>>));
    let (sink, log) = capture();
    if let Some(plan) = plan {
        let slot = Arc::clone(&faults);
        let wrap: ReaderWrap = Arc::new(move |inner: Arc<dyn UnitReader>| {
            let r = Arc::new(FaultReader::new(inner, plan));
            *slot.lock().unwrap() = Some(Arc::clone(&r));
            r as Arc<dyn UnitReader>
        });
        cache.set_tier_io_hooks(Some(wrap), Some(sink));
    }
    let mut logits = Vec::new();
    for &t in &ids[PREFILL..] {
        let kv: &mut dyn KvCache<CpuBackend> = &mut cache;
        logits.extend(
            model
                .forward(&[t], kv, LogitsMode::Last)
                .unwrap()
                .into_vec(),
        );
    }
    let stats = cache.stats().clone();
    drop(cache); // joins the spill store's loader
    let counts = faults
        .lock()
        .unwrap()
        .as_ref()
        .map(|r| r.counts())
        .unwrap_or_default();
    let log = log.lock().unwrap().clone();
    (logits, stats, counts, log)
}

/// Rows "KV × ssd × skip/wait": every read failing or corrupted gives exactly the logits of
/// the KVarN base without refinement (one warning naming the fault); random faults never
/// panic and warn once; waiting on slow reads is exactly the ram tier.
#[test]
fn kv_ssd_tier_faults_fall_back_to_the_resident_base() {
    let base = KvConfig {
        base: kvarn22(),
        sinks: SINKS,
        refine: None,
    };
    let (base_logits, _, _, _) = kv_decode(&base, None);
    let (ram_logits, ram_stats, _, _) = kv_decode(&kv_refined(KvTierConfig::Ram), None);
    assert!(ram_stats.applied_groups > 0 && ram_logits != base_logits);

    for policy in [MissPolicy::Skip, MissPolicy::Wait] {
        // Skip reads in the background and serves what landed in the cache: it needs room
        // for a step's selection (720 units of 128 bytes) to ever apply one. Wait serves its
        // reads directly: no cache, so every unit is read.
        let budget = if policy == MissPolicy::Wait {
            0
        } else {
            1 << 20
        };
        for (name, plan, says) in every_read_goes_wrong() {
            let what = format!("kv ssd {policy} every read {name}");
            let (logits, stats, faults, log) = kv_decode(&kv_ssd(budget, policy), Some(plan));
            eprintln!("{what}: {stats:?} {faults:?} {log:?}");
            assert!(faults.reads > 0, "{what}");
            assert_eq!(stats.applied_groups, 0, "{what}");
            assert!(stats.missed_groups > 0, "{what}");
            assert!(logits == base_logits, "{what}: logits are not the base's");
            assert_eq!(log.len(), 1, "{what}: {log:?}");
            assert!(
                log[0].contains("KV spill file") && log[0].contains(says),
                "{what}: {}",
                log[0]
            );
        }
        let delay = Duration::from_micros(100);
        for (name, plan) in [
            (
                "slow",
                FaultPlan {
                    seed: 3,
                    slow: 0.3,
                    delay,
                    ..FaultPlan::default()
                },
            ),
            (
                "mixed",
                FaultPlan {
                    seed: 4,
                    fail: 1e-4,
                    short: 1e-4,
                    flip: 2e-4,
                    slow: 0.02,
                    delay,
                },
            ),
        ] {
            let what = format!("kv ssd {policy} {name}");
            let small = if policy == MissPolicy::Wait {
                16 << 10
            } else {
                budget
            };
            let (logits, stats, faults, log) = kv_decode(&kv_ssd(small, policy), Some(plan));
            eprintln!("{what}: {stats:?} {faults:?} {log:?}");
            assert!(logits.iter().all(|v| v.is_finite()), "{what}");
            assert_eq!(
                stats.applied_groups + stats.missed_groups,
                stats.selected_groups,
                "{what}"
            );
            check_warnings(&what, faults, &log, "KV spill file");
            if name == "slow" && policy == MissPolicy::Wait {
                assert!(logits == ram_logits, "{what}: waiting is not the ram tier");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The `.sfx` changed under a running sfx-run
// ---------------------------------------------------------------------------------------------

const PROMPT: &str = "The history of the printing press";

fn run_args(model: &Path, tier: &str, tokens: usize) -> Vec<String> {
    let mut a: Vec<String> = [
        model.to_str().unwrap(),
        "-p",
        PROMPT,
        "-n",
        &tokens.to_string(),
        "--temp",
        "0",
        "--ignore-eos",
        "--refine-tier",
        tier,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if tier == "ssd" {
        // Small: units keep being read from the file all run long.
        a.extend(["--weight-cache", "256KiB", "--miss", "wait"].map(String::from));
    }
    a
}

/// A private copy of the container (the tests below damage theirs).
fn copy_of(name: &str) -> PathBuf {
    let p = out_dir("mapped").join(name);
    std::fs::copy(container(), &p).unwrap();
    p
}

/// Runs sfx-run with `args`; once it has printed `after` bytes of generated text (so the model
/// is loaded and decoding), calls `mutate`, then collects the rest.
fn run_and_mutate(args: &[String], after: usize, mutate: impl FnOnce()) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sfx-run"))
        .args(args)
        .env("SFX_ASSETS", assets())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let err_reader = std::thread::spawn(move || {
        let mut s = Vec::new();
        let mut e = stderr;
        e.read_to_end(&mut s).unwrap();
        s
    });
    let mut out = Vec::new();
    let mut buf = [0u8; 256];
    while out.len() < PROMPT.len() + after {
        let n = stdout.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "sfx-run ended before generating: {}",
            String::from_utf8_lossy(&out)
        );
        out.extend_from_slice(&buf[..n]);
    }
    mutate();
    stdout.read_to_end(&mut out).unwrap();
    let status = child.wait().unwrap();
    Output {
        status,
        stdout: out,
        stderr: err_reader.join().unwrap(),
    }
}

fn solo(tier: &str, tokens: usize) -> Vec<u8> {
    stdout_of(
        Command::new(env!("CARGO_BIN_EXE_sfx-run"))
            .args(run_args(container(), tier, tokens))
            .env("SFX_ASSETS", assets()),
    )
    .into_bytes()
}

/// Fails with status 1 (not a signal) and a message naming `file` and `needle`.
fn failed_clearly(what: &str, o: &Output, file: &Path, needle: &str) -> String {
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(
        (o.status.code(), o.status.signal()),
        (Some(1), None),
        "{what}: {stderr}"
    );
    assert!(
        stderr.contains(&*file.to_string_lossy()) && stderr.contains(needle),
        "{what}: no {needle:?} naming the file in:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{what}: {stderr}");
    stderr
}

/// Rows "`.sfx` truncated while mapped × ram / ssd tier": the ram tier reads the lost pages
/// through its map (SIGBUS: a message naming the file, exit 1); the ssd tier's reads come back
/// short (one warning, resident precision), and the run refuses to report its result.
#[test]
fn sfx_truncated_while_mapped_ends_with_a_clear_error() {
    for tier in ["ram", "ssd"] {
        let path = copy_of(&format!("truncated-{tier}.sfx"));
        let len = std::fs::metadata(&path).unwrap().len();
        let o = run_and_mutate(&run_args(&path, tier, 150), 20, || {
            let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            f.set_len(len / 2).unwrap();
        });
        let stderr = failed_clearly(&format!("truncated, {tier} tier"), &o, &path, "truncated");
        if tier == "ssd" {
            assert!(
                stderr.contains("warning: refinement tier ssd failed")
                    && stderr.contains("changed on disk"),
                "{stderr}"
            );
        }
        eprintln!("truncated, {tier} tier:\n{stderr}");
        std::fs::remove_file(&path).unwrap();
    }
}

/// Rows "`.sfx` rewritten in place (same size) while mapped × ram / ssd tier": the ram tier
/// would read other bytes through its map, the ssd tier refuses units failing their checksum;
/// either way the run ends with exit 1 instead of reporting a result.
#[test]
fn sfx_rewritten_in_place_while_mapped_is_never_reported_as_success() {
    for tier in ["ram", "ssd"] {
        let path = copy_of(&format!("rewritten-{tier}.sfx"));
        let file = SfxFile::open(&path).unwrap();
        // Every refinement section's bytes, overwritten where they lie.
        let sections: Vec<(u64, usize)> = file
            .sections()
            .filter(|s| s.name.ends_with(".refine") || s.name.ends_with(".bundles"))
            .map(|s| (s.offset, s.bytes.len()))
            .collect();
        drop(file);
        assert!(!sections.is_empty());
        let o = run_and_mutate(&run_args(&path, tier, 150), 20, || {
            let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            for &(off, len) in &sections {
                f.write_all_at(&vec![0xA5; len], off).unwrap();
            }
        });
        let stderr = failed_clearly(
            &format!("rewritten, {tier} tier"),
            &o,
            &path,
            "changed on disk",
        );
        if tier == "ssd" {
            assert!(stderr.contains("checksum mismatch"), "{stderr}");
        }
        eprintln!("rewritten in place, {tier} tier:\n{stderr}");
        std::fs::remove_file(&path).unwrap();
    }
}

/// Rows "`.sfx` replaced by a rename while mapped × ram / ssd tier": the running process
/// keeps the inode it opened and answers exactly as a solo run.
#[test]
fn sfx_replaced_by_a_rename_while_mapped_changes_nothing() {
    for tier in ["ram", "ssd"] {
        let want = solo(tier, 80);
        let path = copy_of(&format!("renamed-{tier}.sfx"));
        let other = path.with_extension("new");
        std::fs::write(&other, vec![0x5Au8; 1 << 20]).unwrap();
        let o = run_and_mutate(&run_args(&path, tier, 80), 20, || {
            std::fs::rename(&other, &path).unwrap();
        });
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "renamed, {tier} tier: {stderr}");
        assert!(!stderr.contains("warning"), "{stderr}");
        assert!(
            o.stdout == want,
            "renamed, {tier} tier: output differs from a solo run"
        );
        std::fs::remove_file(&path).unwrap();
    }
}

/// Row "two processes × one file × ram and ssd tiers (weights and KV)": concurrent runs give
/// the solo run's output, bit for bit.
#[test]
fn two_processes_running_the_same_file_at_once_agree_with_a_solo_run() {
    let kv = [
        "--kv",
        "2/2",
        "--kv-sinks",
        "16",
        "--kv-tier",
        "ssd",
        "--kv-cache",
        "64KiB",
        "--kv-miss",
        "wait",
        "--kv-spill-dir",
    ];
    let spill = out_dir("spill");
    let args = |tier: &str| {
        let mut a = run_args(container(), tier, 160);
        a.extend(kv.iter().map(|s| s.to_string()));
        a.push(spill.to_string_lossy().into_owned());
        a
    };
    let cmd = |tier: &str| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_sfx-run"));
        c.args(args(tier)).env("SFX_ASSETS", assets());
        c
    };
    for tier in ["ram", "ssd"] {
        let solo = cmd(tier).output().unwrap();
        assert!(
            solo.status.success(),
            "{}",
            String::from_utf8_lossy(&solo.stderr)
        );
        let children: Vec<_> = (0..2)
            .map(|_| {
                cmd(tier)
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for c in children {
            let o = c.wait_with_output().unwrap();
            let stderr = String::from_utf8_lossy(&o.stderr);
            assert!(o.status.success(), "{tier}: {stderr}");
            assert!(!stderr.contains("warning"), "{tier}: {stderr}");
            assert!(
                o.stdout == solo.stdout,
                "{tier}: concurrent output differs from solo"
            );
        }
    }
    // Spill files are unlinked at creation: nothing is left behind.
    assert_eq!(std::fs::read_dir(&spill).unwrap().count(), 0);
}

/// Row "disk full during decode × KV ssd tier (spill writes fail)": one warning, KV refinement
/// off from there, the answer of the KVarN base without refinement (which refinement does
/// change over these 300 tokens), exit 0.
#[test]
fn kv_spill_writes_failing_during_decode_fall_back_to_the_base() {
    let spill = out_dir("spill_full");
    let cmd = |refine: &str| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_sfx-run"));
        c.arg(crate::common::gguf())
            .args(["-p", PROMPT, "-n", "300", "--temp", "0", "--ignore-eos"])
            .args(["--kv", "2/2", "--kv-sinks", "16", "--kv-refine", refine])
            .args([
                "--kv-tier",
                "ssd",
                "--kv-cache",
                "64KiB",
                "--kv-miss",
                "wait",
            ])
            .arg("--kv-spill-dir")
            .arg(&spill)
            .env("SFX_ASSETS", assets());
        c
    };
    let ok = |c: &mut Command| {
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        o
    };
    let base = ok(&mut cmd("off"));
    let refined = ok(&mut cmd("auto"));
    assert!(refined.stdout != base.stdout, "refinement changed nothing");
    // Room for the first tile's units of a few heads, not for all 90.
    let mut c = cmd("auto");
    with_file_size_limit(&mut c, 64 << 10);
    let full = ok(&mut c);
    let stderr = String::from_utf8_lossy(&full.stderr);
    eprintln!("KV spill disk full:\n{stderr}");
    assert_eq!(
        stderr
            .matches("warning: KV spill file write failed")
            .count(),
        1,
        "{stderr}"
    );
    assert!(stderr.contains("File too large") && stderr.contains("KV refinement disabled"));
    assert!(
        full.stdout == base.stdout,
        "not the unrefined base's answer"
    );
    assert_eq!(std::fs::read_dir(&spill).unwrap().count(), 0);
}

// ---------------------------------------------------------------------------------------------
// Conversion: disk full, kill -9
// ---------------------------------------------------------------------------------------------

fn convert_args(out: &Path, extra: &[&str]) -> Vec<String> {
    let mut a = quick_args("rtn4", &[], out);
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

fn converter(out: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_sfx-convert"));
    c.args(convert_args(out, extra))
        .env("SFX_ASSETS", assets())
        .env("RAYON_NUM_THREADS", "2");
    c
}

/// The cheapest conversion, uninterrupted: its bytes and how long it took.
fn reference() -> &'static (Vec<u8>, Duration) {
    static R: OnceLock<(Vec<u8>, Duration)> = OnceLock::new();
    R.get_or_init(|| {
        let out = out_dir("convert_reference").join("ref.sfx");
        let t = Instant::now();
        let o = converter(&out, &[]).output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let took = t.elapsed();
        (std::fs::read(&out).unwrap(), took)
    })
}

/// The partial-state folder of an output.
fn partial(out: &Path) -> PathBuf {
    out.with_file_name(format!(
        ".{}.resume",
        out.file_name().unwrap().to_string_lossy()
    ))
}

/// Every entry of `dir`, by name, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

const PREVIOUS: &[u8] = b"the previous output, which a failed conversion must leave alone\n";

/// A folder holding only `out.sfx` with the previous output's bytes.
fn previous_output(sub: &str) -> PathBuf {
    let dir = out_dir(sub);
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("out.sfx");
    std::fs::write(&out, PREVIOUS).unwrap();
    out
}

/// Limits the files `c` writes to `limit` bytes (RLIMIT_FSIZE, SIGXFSZ ignored, so a write
/// past it fails with EFBIG as on a full disk); works as root and not, without mounts.
fn with_file_size_limit(c: &mut Command, limit: u64) {
    // SAFETY: only async-signal-safe libc calls between fork and exec.
    unsafe {
        c.pre_exec(move || {
            let lim = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0
                || libc::signal(libc::SIGXFSZ, libc::SIG_IGN) == libc::SIG_ERR
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// `sfx-convert` on a disk that is full after `limit` bytes of any one file.
fn limited(out: &Path, limit: u64) -> Output {
    let mut c = converter(out, &[]);
    with_file_size_limit(&mut c, limit);
    c.output().unwrap()
}

/// Rows "disk full during conversion, early and late": exit 1 with a message naming the
/// output and the failed write, the previous output byte-identical, nothing beside it but the
/// documented partial state — none before the first block's checkpoint; after it, the
/// `.NAME.resume` folder, from which `--resume` (with room again) ends byte-identical to an
/// uninterrupted conversion.
#[test]
fn disk_full_during_conversion_is_a_clear_error_and_leaves_the_previous_output() {
    let (want, _) = reference();
    for (when, limit) in [("early", 1u64 << 20), ("late", want.len() as u64 / 2)] {
        let out = previous_output(&format!("disk_full_{when}"));
        let o = limited(&out, limit);
        let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
        eprintln!("disk full ({when}, {limit} bytes):\n{stderr}");
        assert_eq!(o.status.code(), Some(1), "{when}: {stderr}");
        assert!(
            stderr.contains("out.sfx") && stderr.contains("File too large"),
            "{when}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert_eq!(
            std::fs::read(&out).unwrap(),
            PREVIOUS,
            "{when}: output touched"
        );
        let dir = out.parent().unwrap();
        let state = partial(&out);
        if when == "early" {
            assert_eq!(names(dir), ["out.sfx"], "{when}: left behind");
        } else {
            assert_eq!(names(dir), [".out.sfx.resume", "out.sfx"], "{when}");
            assert_eq!(
                names(&state),
                ["checkpoint.json", "lock", "model.sfx.part"],
                "{when}"
            );
            assert!(stderr.contains("rerun with --resume"), "{stderr}");
            let o = converter(&out, &["--resume"]).output().unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            assert!(
                std::fs::read(&out).unwrap() == *want,
                "resumed output differs"
            );
            assert_eq!(names(dir), ["out.sfx"]);
        }
    }
}

/// Every file of an output folder, by name (sorted), with its bytes.
fn folder_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    names(dir)
        .into_iter()
        .map(|n| {
            let bytes = std::fs::read(dir.join(&n)).unwrap();
            (n, bytes)
        })
        .collect()
}

/// The names of the files that differ between two folders' listings (or are in one only).
fn differing(a: &[(String, Vec<u8>)], b: &[(String, Vec<u8>)]) -> Vec<String> {
    let mut out: Vec<String> = a
        .iter()
        .filter(|(n, x)| b.iter().find(|(m, _)| m == n).is_none_or(|(_, y)| x != y))
        .map(|(n, _)| n.clone())
        .collect();
    out.extend(
        b.iter()
            .filter(|(n, _)| !a.iter().any(|(m, _)| m == n))
            .map(|(n, _)| n.clone()),
    );
    out
}

/// Row "disk full during a folder conversion": an earlier output folder stays byte for byte
/// what it was, the failure names the partial state, and `--resume` with room again ends with
/// the same folder an uninterrupted conversion writes.
#[test]
fn disk_full_during_a_folder_conversion_leaves_the_previous_folder() {
    let dir = out_dir("disk_full_folder");
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("out");
    // No quality receipt: the folder's other files are what this row is about, and the
    // receipt's evaluation would be most of the run.
    let quality = ["--quality", "none"];
    let o = converter(&out, &quality).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let before = folder_files(&out);
    let model = before
        .iter()
        .find(|(n, _)| n == "model.sfx")
        .map(|(_, b)| b.len() as u64)
        .expect("the folder holds model.sfx");

    let mut c = converter(&out, &quality);
    with_file_size_limit(&mut c, model / 2);
    let o = c.output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("File too large") && stderr.contains("rerun with --resume"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    let changed = differing(&before, &folder_files(&out));
    assert!(
        changed.is_empty(),
        "the previous folder changed: {changed:?}"
    );
    assert_eq!(names(&dir), [".out.resume", "out"]);

    let resume = ["--quality", "none", "--resume"];
    let o = converter(&out, &resume).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let changed = differing(&before, &folder_files(&out));
    assert!(
        changed.is_empty(),
        "the resumed folder differs from the uninterrupted one: {changed:?}"
    );
    assert_eq!(names(&dir), ["out"]);
}

/// Row "kill -9 at random points of a conversion": at every point the output path holds the
/// previous output or the whole new one, beside it at most the `.NAME.resume` folder with
/// known files only; with a checkpoint a fresh run refuses and names `--resume`, without one
/// it starts over (the state is cleared).
#[test]
fn kill_9_at_random_points_of_a_conversion_leaves_a_clean_state() {
    let (want, took) = reference();
    let out = previous_output("kill9");
    let dir = out.parent().unwrap().to_path_buf();
    let state = partial(&out);
    let known = ["checkpoint.json", "lock", "model.sfx.part"];
    // Deterministic random points, one in each stretch of the run (as fractions of the
    // reference run's time): opening the model and calibrating, the early blocks, the late
    // blocks, and the end (head, metadata, the rename, or just after it).
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut points = Vec::new();
    for (lo, hi) in [(0.0, 0.25), (0.25, 0.6), (0.6, 0.9), (0.9, 1.1)] {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        points.push(lo + (hi - lo) * ((seed >> 11) as f64 / (1u64 << 53) as f64));
    }
    for f in points {
        let at = took.mul_f64(f);
        let mut child = converter(&out, &[])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(at);
        let finished = child.try_wait().unwrap().is_some();
        let _ = child.kill();
        let status = child.wait().unwrap();
        let bytes = std::fs::read(&out).unwrap();
        let whole = bytes == *want;
        // A run that ended by itself converted (it did not refuse over leftover state).
        assert!(
            !finished || (status.success() && whole),
            "at {f:.2}: {status:?}"
        );
        assert!(bytes == PREVIOUS || whole, "at {f:.2}: a partial output");
        let beside = names(&dir);
        assert!(
            beside == ["out.sfx"] || beside == [".out.sfx.resume", "out.sfx"],
            "at {f:.2}: {beside:?}"
        );
        let inside = names(&state);
        for n in &inside {
            // A checkpoint being replaced when the kill came leaves its temporary.
            assert!(
                known.contains(&n.as_str())
                    || (n.starts_with(".checkpoint.json.") && n.ends_with(".tmp")),
                "at {f:.2}: unexpected {n} in {inside:?}"
            );
        }
        let checkpointed = inside.iter().any(|n| n == "checkpoint.json");
        eprintln!(
            "kill -9 at {:.1} s ({f:.2} of the run): {}; output {}; beside it {beside:?}, in \
             the state folder {inside:?}",
            at.as_secs_f64(),
            if finished {
                "already finished"
            } else {
                "killed"
            },
            if whole {
                "the new container"
            } else {
                "the previous bytes"
            },
        );
        if !finished {
            assert_eq!(status.signal(), Some(9));
        }
        if checkpointed && !whole {
            let o = converter(&out, &[]).output().unwrap();
            let stderr = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(1), "{stderr}");
            assert!(stderr.contains("pass --resume"), "{stderr}");
            assert_eq!(std::fs::read(&out).unwrap(), PREVIOUS);
            // What the message says to do to start over.
            std::fs::remove_dir_all(&state).unwrap();
        }
        if whole {
            std::fs::write(&out, PREVIOUS).unwrap();
            let _ = std::fs::remove_dir_all(&state);
        }
    }
}

/// Row "`.sfx` truncated while `sfx bench` measures it": the command ends with exit 1 naming
/// the file (the SIGBUS message, a load error, or the changed-file refusal, depending on when
/// the cut lands) and reports no result.
#[test]
fn sfx_bench_on_a_file_truncated_under_it_reports_nothing() {
    let path = copy_of("bench-truncated.sfx");
    let len = std::fs::metadata(&path).unwrap().len();
    let child = Command::new(env!("CARGO_BIN_EXE_sfx"))
        .args(["bench", "-m"])
        .arg(&path)
        .args(["-p", "0", "-n", "300", "-r", "3", "--device", "cpu"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(len / 2).unwrap();
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(
        (o.status.code(), o.status.signal()),
        (Some(1), None),
        "{stderr}"
    );
    // The error itself (not only the progress lines before it) names the file.
    let error = stderr.split_once("Error:").map_or("", |(_, e)| e);
    assert!(
        error.contains(&*path.to_string_lossy()) && !stderr.contains("panicked"),
        "{stderr}"
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        !stdout.contains("tg300"),
        "a result was reported:\n{stdout}"
    );
    eprintln!("sfx bench, truncated:\n{stderr}");
    std::fs::remove_file(&path).unwrap();
}

//! Fault injection into the SSD tiers' reads (runtime/src/refine/fault.rs): reads that fail,
//! come back short, slow or with a flipped bit, at random. Under skip and wait, the weight
//! refinement store and the KV spill tier must never hand out a unit whose bytes differ from
//! the verified (or written) ones, must say so with exactly one warning once a read went
//! wrong, and must never panic or hang. The same faults without a unit check do hand out
//! corrupted units: that is what the check is for.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sfx_runtime::kv::tier::{KvTier, ReaderWrap};
use sfx_runtime::kv::KvTierConfig;
use sfx_runtime::refine::fault::{FaultPlan, FaultReader};
use sfx_runtime::refine::store::{
    Fetched, MissPolicy, RefinementStore, SsdOptions, SsdStore, UnitCheck, UnitChecksums, UnitKey,
    UnitReader, UnitRef, WarnSink,
};

#[path = "common/rng.rs"]
mod rng;
use rng::{random_bytes, Rng};

/// A warning sink that records every message.
fn capture() -> (WarnSink, Arc<Mutex<Vec<String>>>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let l = Arc::clone(&log);
    let sink: WarnSink = Arc::new(move |m: &str| l.lock().unwrap().push(m.to_string()));
    (sink, log)
}

/// The fault mixes of these tests: every kind alone, then all together at rates that let a
/// run apply many units before its first fault.
fn plans(seed: u64) -> Vec<(&'static str, FaultPlan)> {
    let delay = Duration::from_micros(200);
    let p = |fail, short, flip, slow| FaultPlan {
        seed,
        fail,
        short,
        flip,
        slow,
        delay,
    };
    vec![
        ("fail", p(0.002, 0.0, 0.0, 0.0)),
        ("short", p(0.0, 0.002, 0.0, 0.0)),
        ("flip", p(0.0, 0.0, 0.002, 0.0)),
        ("slow", p(0.0, 0.0, 0.0, 0.2)),
        ("mixed", p(0.0005, 0.0005, 0.001, 0.05)),
    ]
}

/// A file of `units` units of `unit_len` bytes in three regions with gaps between them, as
/// refinement sections lie in a container; its bytes and the regions `(offset, units)`.
fn regions_file(unit_len: u32, units: u64) -> (tempfile::NamedTempFile, Vec<u8>, Vec<(u64, u64)>) {
    let per = units / 3;
    let regions = vec![
        (4096, per),
        (4096 + per * u64::from(unit_len) + 8192, per),
        (
            2 * (4096 + per * u64::from(unit_len)) + 8192,
            units - 2 * per,
        ),
    ];
    let (last_off, last_n) = regions[2];
    let data = random_bytes((last_off + last_n * u64::from(unit_len)) as usize, 42);
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(&data).unwrap();
    f.flush().unwrap();
    (f, data, regions)
}

#[test]
fn fault_reader_is_deterministic_and_keeps_its_rates() {
    let data = random_bytes(64 * 1000, 1);
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(&data).unwrap();
    f.flush().unwrap();
    let plan = FaultPlan {
        seed: 9,
        fail: 0.1,
        short: 0.1,
        flip: 0.1,
        slow: 0.1,
        delay: Duration::ZERO,
    };
    let run = || {
        let r = FaultReader::new(Arc::new(f.reopen().unwrap()), plan);
        let outcomes: Vec<Result<Vec<u8>, String>> = (0..4000u64)
            .map(|i| {
                let mut buf = vec![0u8; 64];
                r.read_at((i * 7919 % 1000) * 64, &mut buf)
                    .map(|()| buf)
                    .map_err(|e| e.to_string())
            })
            .collect();
        (outcomes, r.counts())
    };
    let (a, ca) = run();
    let (b, cb) = run();
    assert_eq!(a, b, "same seed, same reads: same faults");
    assert_eq!(ca, cb);
    assert_eq!(ca.reads, 4000);
    for (n, what) in [
        (ca.failed, "failed"),
        (ca.short, "short"),
        (ca.flipped, "flipped"),
        (ca.slow, "slow"),
    ] {
        assert!((300..500).contains(&n), "{what}: {n} of 4000 at p = 0.1");
    }
    // A flipped read differs from the file in exactly one bit; a clean one not at all.
    let mut flipped = 0;
    for (i, o) in a.iter().enumerate() {
        let off = ((i as u64 * 7919 % 1000) * 64) as usize;
        if let Ok(buf) = o {
            let bits: u32 = buf
                .iter()
                .zip(&data[off..off + 64])
                .map(|(x, y)| (x ^ y).count_ones())
                .sum();
            assert!(bits <= 1);
            flipped += bits as u64;
        }
    }
    assert_eq!(flipped, ca.flipped);
}

#[test]
fn unit_checksums_refuse_what_they_do_not_describe() {
    let data = random_bytes(1000, 3);
    let sums =
        UnitChecksums::from_regions(vec![(100, 10, &data[100..200]), (500, 25, &data[500..600])])
            .unwrap();
    assert_eq!(sums.units(), 14);
    let at = |offset, len| UnitRef { offset, len };
    let check = |u: UnitRef| {
        let (s, e) = (u.offset as usize, u.offset as usize + u.len as usize);
        sums.check(u, &data[s..e])
    };
    assert_eq!(check(at(110, 10)), Ok(()));
    assert_eq!(check(at(575, 25)), Ok(()));
    for bad in [
        at(105, 10),
        at(110, 20),
        at(90, 10),
        at(200, 10),
        at(600, 25),
        at(0, 1),
    ] {
        let e = check(bad).unwrap_err();
        assert!(e.contains("no verified unit"), "{bad:?}: {e}");
    }
    let mut flipped = data[110..120].to_vec();
    flipped[3] ^= 0x10;
    assert!(sums
        .check(at(110, 10), &flipped)
        .unwrap_err()
        .contains("checksum mismatch"));
    // Malformed plans are errors, not silently unchecked units.
    assert!(UnitChecksums::from_regions(vec![(0, 10, &data[..95])]).is_err());
    assert!(
        UnitChecksums::from_regions(vec![(0, 10, &data[..100]), (50, 10, &data[..10])]).is_err()
    );
    assert!(UnitChecksums::from_regions(vec![(0, 0, &data[..0])]).is_err());
}

/// Fetches a random stream of units through `store` (skipped loads given time to land every
/// so often) and returns how many served units differed from the file, and how many were
/// served at all.
fn fetch_stream(store: &SsdStore, data: &[u8], units: &[UnitRef], seed: u64) -> (u64, u64) {
    let mut rng = Rng(seed);
    let (mut corrupt, mut served) = (0, 0);
    let mut out = Vec::new();
    for i in 0..6000u64 {
        // Skewed towards a hot set, as channel selection is.
        let k = (rng.below(units.len() as u64) * rng.below(units.len() as u64) / units.len() as u64)
            as usize;
        let u = units[k];
        out.clear();
        let got = store.fetch(UnitKey(k as u64), u, &mut out);
        if got.has_bytes() {
            served += 1;
            let want = &data[u.offset as usize..(u.offset + u64::from(u.len)) as usize];
            if out != want {
                corrupt += 1;
            }
        } else {
            assert!(out.is_empty(), "{got:?} left bytes in out");
        }
        // A decode step's worth of fetches, then time for the loads to land.
        if i % 100 == 99 {
            store.wait_idle(Duration::from_secs(5));
        }
    }
    (corrupt, served)
}

#[test]
fn weight_store_serves_only_verified_units_under_random_faults() {
    let unit_len = 288u32; // ceil(576 / 2): a SmolLM2 column of a 576-row projection
    let (f, data, regions) = regions_file(unit_len, 1500);
    let units: Vec<UnitRef> = regions
        .iter()
        .flat_map(|&(off, n)| {
            (0..n).map(move |i| UnitRef {
                offset: off + i * u64::from(unit_len),
                len: unit_len,
            })
        })
        .collect();
    let sums: Arc<dyn UnitCheck> = Arc::new(
        UnitChecksums::from_regions(
            regions
                .iter()
                .map(|&(off, n)| {
                    let (s, e) = (off as usize, (off + n * u64::from(unit_len)) as usize);
                    (off, unit_len, &data[s..e])
                })
                .collect(),
        )
        .unwrap(),
    );
    for policy in [MissPolicy::Skip, MissPolicy::Wait] {
        for seed in [1, 2] {
            for (name, plan) in plans(seed) {
                let what = format!("{policy} seed {seed} {name}");
                let reader = Arc::new(FaultReader::new(Arc::new(f.reopen().unwrap()), plan));
                let (sink, log) = capture();
                let store = SsdStore::with_options(
                    reader.clone(),
                    SsdOptions {
                        // 100 units of 1500: most fetches of the stream read the file.
                        cache_budget_bytes: 100 * u64::from(unit_len),
                        policy,
                        loader_threads: 2,
                        warn: sink,
                        check: Some(Arc::clone(&sums)),
                        ..SsdOptions::default()
                    },
                );
                let (corrupt, served) = fetch_stream(&store, &data, &units, seed);
                let failed = store.is_failed();
                drop(store); // joins the loaders: every read they started has reported
                let faults = reader.counts();
                let log = log.lock().unwrap();
                assert_eq!(corrupt, 0, "{what}: {corrupt} corrupted units served");
                assert!(served > 0, "{what}: nothing served");
                if faults.faulty() == 0 {
                    assert!(log.is_empty() && !failed, "{what}: {log:?}");
                } else {
                    assert!(failed, "{what}: {faults:?} but the tier is still on");
                    assert_eq!(log.len(), 1, "{what}: {log:?}");
                    let w = &log[0];
                    assert!(
                        w.starts_with("warning: refinement tier ssd failed")
                            && w.contains("continuing at resident precision")
                            && (w.contains("injected read failure")
                                || w.contains("injected short read")
                                || w.contains("checksum mismatch")),
                        "{what}: {w}"
                    );
                }
                eprintln!("{what}: {served} served, {faults:?}, failed {failed}");
            }
        }
    }

    // The control: the same flips through a store that trusts its reader hand out corrupted
    // units (what the ssd tier did before units were checked).
    for policy in [MissPolicy::Skip, MissPolicy::Wait] {
        let plan = FaultPlan {
            seed: 1,
            flip: 0.05,
            ..FaultPlan::default()
        };
        let reader = Arc::new(FaultReader::new(Arc::new(f.reopen().unwrap()), plan));
        let (sink, log) = capture();
        let store = SsdStore::with_options(
            reader.clone(),
            SsdOptions {
                cache_budget_bytes: 100 * u64::from(unit_len),
                policy,
                warn: sink,
                check: None,
                ..SsdOptions::default()
            },
        );
        let (corrupt, _) = fetch_stream(&store, &data, &units, 1);
        drop(store);
        assert!(
            corrupt > 0,
            "{policy}: the control served no corrupted unit"
        );
        assert!(
            log.lock().unwrap().is_empty(),
            "flips are silent without a check"
        );
    }
}

#[test]
fn kv_spill_tier_serves_only_written_units_under_random_faults() {
    let (heads, max_tiles, per_tile, unit_bytes) = (4usize, 6usize, 32usize, 128usize);
    for policy in [MissPolicy::Skip, MissPolicy::Wait] {
        for seed in [1, 2] {
            for (name, plan) in plans(seed) {
                let what = format!("{policy} seed {seed} {name}");
                let config = KvTierConfig::Ssd {
                    dir: std::env::temp_dir(),
                    // 40 units of 768 stored.
                    cache_budget: 40 * unit_bytes as u64,
                    policy,
                };
                let mut tier =
                    KvTier::new(&config, heads, max_tiles, per_tile, unit_bytes).unwrap();
                let mut written = vec![Vec::new(); heads];
                let mut rng = Rng(seed);
                for _ in 0..max_tiles {
                    for (h, w) in written.iter_mut().enumerate() {
                        let tile = random_bytes(per_tile * unit_bytes, rng.next());
                        tier.push_tile(h, &tile);
                        w.push(tile);
                    }
                }
                let faults = Arc::new(Mutex::new(None::<Arc<FaultReader>>));
                let slot = Arc::clone(&faults);
                let wrap: ReaderWrap = Arc::new(move |inner: Arc<dyn UnitReader>| {
                    let r = Arc::new(FaultReader::new(inner, plan));
                    *slot.lock().unwrap() = Some(Arc::clone(&r));
                    r as Arc<dyn UnitReader>
                });
                let (sink, log) = capture();
                tier.set_io_hooks(Some(wrap), Some(sink));
                let (mut corrupt, mut served) = (0, 0);
                let mut out = Vec::new();
                let n = (heads * max_tiles * per_tile) as u64;
                for i in 0..4000 {
                    // Skewed towards a hot set, as attention's selection is.
                    let k = (rng.below(n) * rng.below(n) / n) as usize;
                    let (h, t, g) = (
                        k / (max_tiles * per_tile),
                        k / per_tile % max_tiles,
                        k % per_tile,
                    );
                    if tier.fetch(h, t, g, &mut out).has_bytes() {
                        served += 1;
                        corrupt += u64::from(
                            out[..] != written[h][t][g * unit_bytes..(g + 1) * unit_bytes],
                        );
                    }
                    // A decode step's worth of fetches, then time for the loads to land.
                    if i % 50 == 49 {
                        tier.wait_idle(Duration::from_secs(5));
                    }
                }
                let failed = tier.store_stats().is_some_and(|s| s.failed > 0);
                drop(tier);
                let counts = faults.lock().unwrap().as_ref().unwrap().counts();
                let log = log.lock().unwrap();
                eprintln!("{what}: {served} served, {counts:?}, failed fetches {failed}");
                assert_eq!(corrupt, 0, "{what}: {corrupt} corrupted KV units served");
                assert!(served > 0, "{what}");
                if counts.faulty() == 0 {
                    assert!(log.is_empty(), "{what}: {log:?}");
                } else {
                    assert_eq!(log.len(), 1, "{what}: {log:?}");
                    assert!(
                        log[0].contains("KV spill file") && log[0].contains("resident precision"),
                        "{what}: {}",
                        log[0]
                    );
                }
            }
        }
    }
}

#[test]
fn fetched_outcomes_leave_out_empty_when_nothing_is_served() {
    // The store's contract the engine relies on: only Hit and Loaded put bytes in `out`,
    // whatever a failing reader wrote into its buffer before it gave up.
    let data = random_bytes(10_000, 5);
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(&data).unwrap();
    f.flush().unwrap();
    let plan = FaultPlan {
        seed: 1,
        short: 1.0,
        ..FaultPlan::default()
    };
    let (sink, log) = capture();
    let store = SsdStore::with_options(
        Arc::new(FaultReader::new(Arc::new(f.reopen().unwrap()), plan)),
        SsdOptions {
            policy: MissPolicy::Wait,
            warn: sink,
            ..SsdOptions::default()
        },
    );
    let mut out = vec![7u8; 3];
    let u = UnitRef {
        offset: 100,
        len: 64,
    };
    assert_eq!(store.fetch(UnitKey(0), u, &mut out), Fetched::Failed);
    assert_eq!(out, [7, 7, 7]);
    drop(store);
    let log = log.lock().unwrap();
    assert!(
        log.len() == 1 && log[0].contains("injected short read: 32 of 64 bytes"),
        "{log:?}"
    );
}

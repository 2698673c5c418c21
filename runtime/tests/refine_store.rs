//! Refinement tiers (runtime/src/refine/store.rs): RAM map vs SSD cache equivalence, the
//! non-blocking skip policy, the cache budget and LRU order, fault handling and accounting.

use std::io::{self, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sfx_runtime::refine::store::{
    Fetched, MissPolicy, RamStore, RefinementStore, SsdOptions, SsdStore, StoreStats, UnitKey,
    UnitReader, UnitRef, WarnSink,
};

#[path = "common/rng.rs"]
mod rng;
use rng::{random_bytes, Rng};

/// In-memory reader with an optional per-read delay and injectable failure.
struct MemReader {
    data: Vec<u8>,
    delay: Duration,
    reads: AtomicUsize,
    /// Reads with index >= this fail (usize::MAX: never).
    fail_from: usize,
}

impl MemReader {
    fn new(data: Vec<u8>) -> Self {
        MemReader {
            data,
            delay: Duration::ZERO,
            reads: AtomicUsize::new(0),
            fail_from: usize::MAX,
        }
    }
    fn slow(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }
    fn failing_from(mut self, n: usize) -> Self {
        self.fail_from = n;
        self
    }
    fn reads(&self) -> usize {
        self.reads.load(Ordering::SeqCst)
    }
}

impl UnitReader for MemReader {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let i = self.reads.fetch_add(1, Ordering::SeqCst);
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
        if i >= self.fail_from {
            return Err(io::Error::other("injected device error"));
        }
        let start = offset as usize;
        let src = self
            .data
            .get(start..start + buf.len())
            .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

/// A warning sink that records every message.
fn capture() -> (WarnSink, Arc<Mutex<Vec<String>>>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let l = Arc::clone(&log);
    let sink: WarnSink = Arc::new(move |m: &str| l.lock().unwrap().push(m.to_string()));
    (sink, log)
}

fn ssd(reader: Arc<dyn UnitReader>, budget: u64, policy: MissPolicy, warn: WarnSink) -> SsdStore {
    SsdStore::with_options(
        reader,
        SsdOptions {
            cache_budget_bytes: budget,
            policy,
            loader_threads: 2,
            warn,
            ..SsdOptions::default()
        },
    )
}

fn unit(offset: u64, len: u32) -> UnitRef {
    UnitRef { offset, len }
}

#[test]
fn stores_are_send_sync_and_policy_parses() {
    fn assert_send_sync<T: Send + Sync + ?Sized>() {}
    assert_send_sync::<RamStore>();
    assert_send_sync::<SsdStore>();
    assert_send_sync::<dyn RefinementStore>();
    assert_eq!("skip".parse::<MissPolicy>(), Ok(MissPolicy::Skip));
    assert_eq!("Wait".parse::<MissPolicy>(), Ok(MissPolicy::Wait));
    assert!("later".parse::<MissPolicy>().is_err());
    assert_eq!(MissPolicy::Wait.to_string(), "wait");
    // Layout arithmetic of docs/format.md: column i = ceil(out/2) bytes, bundle j = 4·ceil(h/2).
    assert_eq!(UnitRef::column(4096, 7, 3), Some(unit(4096 + 12, 4)));
    assert_eq!(UnitRef::bundle(8192, 5, 2), Some(unit(8192 + 24, 12)));
    assert_eq!(UnitRef::column(u64::MAX, 8, 1), None);
}

#[test]
fn ram_and_ssd_wait_return_identical_bytes() {
    let data = random_bytes(300_000, 1);
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(&data).unwrap();
    f.flush().unwrap();

    let ram = RamStore::open(f.path()).unwrap();
    let ssd = SsdStore::open(f.path(), 1 << 20, MissPolicy::Wait, 2).unwrap();
    assert_eq!((ram.name(), ssd.name()), ("ram", "ssd"));
    assert_eq!(ram.len(), data.len() as u64);

    let mut rng = Rng(7);
    let units: Vec<UnitRef> = (0..300)
        .map(|_| {
            let len = 1 + rng.below(5000) as u32;
            unit(rng.below(data.len() as u64 - u64::from(len)), len)
        })
        .collect();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for pass in 0..2 {
        for (k, &u) in units.iter().enumerate() {
            let key = UnitKey(k as u64);
            // `fetch` appends (the engine gathers a projection's units back to back).
            a.clear();
            b.clear();
            assert_eq!(ram.fetch(key, u, &mut a), Fetched::Hit);
            let got = ssd.fetch(key, u, &mut b);
            let expect = if pass == 0 {
                Fetched::Loaded
            } else {
                Fetched::Hit
            };
            // Second pass: everything still cached unless evicted (budget 1 MiB < total).
            assert!(
                got == expect || (pass == 1 && got == Fetched::Loaded),
                "{got:?}"
            );
            let want = &data[u.offset as usize..(u.offset + u64::from(u.len)) as usize];
            assert_eq!(a, want);
            assert_eq!(b, want);
        }
    }
    let rs = ram.stats();
    assert_eq!((rs.hits, rs.misses, rs.failed), (600, 0, 0));
    let ss = ssd.stats();
    assert_eq!(ss.hits + ss.misses, 600);
    assert_eq!(ss.bytes_served, rs.bytes_served);
    assert!(ss.cache_peak_bytes <= 1 << 20);
}

#[test]
fn skip_never_blocks_and_loads_in_background() {
    let data = random_bytes(10_000, 2);
    let reader = Arc::new(MemReader::new(data.clone()).slow(Duration::from_millis(300)));
    let (sink, log) = capture();
    let store = ssd(reader.clone(), 1 << 16, MissPolicy::Skip, sink);
    let u = unit(1000, 640);
    let mut out = vec![1, 2, 3];

    let t = Instant::now();
    assert_eq!(store.fetch(UnitKey(5), u, &mut out), Fetched::Skipped);
    // The same key again while its load is in flight: still skipped, no second read queued.
    assert_eq!(store.fetch(UnitKey(5), u, &mut out), Fetched::Skipped);
    let elapsed = t.elapsed();
    assert!(
        elapsed < Duration::from_millis(50),
        "skip blocked for {elapsed:?}"
    );
    assert_eq!(out, [1, 2, 3], "a skipped fetch must leave out as it was");

    assert!(
        store.wait_idle(Duration::from_secs(3)),
        "background load never finished"
    );
    assert_eq!(store.fetch(UnitKey(5), u, &mut out), Fetched::Hit);
    assert_eq!(out[..3], [1, 2, 3], "a fetch appends to what out held");
    assert_eq!(out[3..], data[1000..1640]);
    assert_eq!(reader.reads(), 1, "in-flight key was read twice");
    let s = store.stats();
    assert_eq!((s.hits, s.misses, s.skipped, s.failed), (1, 2, 2, 0));
    assert_eq!(s.bytes_read_from_backing, 640);
    assert!(log.lock().unwrap().is_empty());
}

#[test]
fn skip_with_full_queue_drops_requests_without_blocking() {
    let reader = Arc::new(MemReader::new(vec![0; 100_000]).slow(Duration::from_millis(300)));
    let (sink, _log) = capture();
    let store = SsdStore::with_options(
        reader.clone(),
        SsdOptions {
            cache_budget_bytes: 1 << 20,
            policy: MissPolicy::Skip,
            loader_threads: 1,
            queue_capacity: 2,
            warn: sink,
            ..SsdOptions::default()
        },
    );
    let mut out = Vec::new();
    let t = Instant::now();
    for k in 0..50u64 {
        assert_eq!(
            store.fetch(UnitKey(k), unit(k * 100, 100), &mut out),
            Fetched::Skipped
        );
    }
    let elapsed = t.elapsed();
    assert!(
        elapsed < Duration::from_millis(50),
        "full queue blocked for {elapsed:?}"
    );
    // At most one job being read plus two queued were accepted; the rest were dropped.
    assert!(store.in_flight() <= 3, "{} in flight", store.in_flight());
    assert_eq!(store.stats().skipped, 50);
}

#[test]
fn cache_stays_within_budget_under_random_stream() {
    let data = random_bytes(200_000, 3);
    let reader = Arc::new(MemReader::new(data.clone()));
    let (sink, _log) = capture();
    let budget = 20_000u64;
    let store = ssd(reader.clone(), budget, MissPolicy::Wait, sink);
    // 64 units of 100..3000 bytes, accessed with a skewed random stream.
    let mut rng = Rng(11);
    let units: Vec<UnitRef> = (0..64)
        .map(|i| unit(i * 3000, 100 + rng.below(2900) as u32))
        .collect();
    let mut out = Vec::new();
    for _ in 0..3000 {
        let k = (rng.below(64) * rng.below(64) / 64) as usize; // skewed towards small keys
        let u = units[k];
        out.clear();
        let got = store.fetch(UnitKey(k as u64), u, &mut out);
        assert!(got.has_bytes(), "{got:?}");
        assert_eq!(
            out,
            &data[u.offset as usize..u.offset as usize + u.len as usize]
        );
        let s = store.stats();
        assert!(
            s.cache_bytes <= budget,
            "cache {} > budget {budget}",
            s.cache_bytes
        );
    }
    let s = store.stats();
    assert!(s.cache_peak_bytes <= budget);
    assert!(
        s.cache_peak_bytes > budget / 2,
        "cache was barely used: {s:?}"
    );
    assert!(s.hits > 0 && s.misses > 0);

    // A unit larger than the whole budget is served under Wait but never cached.
    let big = unit(100_000, 50_000);
    out.clear();
    assert_eq!(store.fetch(UnitKey(999), big, &mut out), Fetched::Loaded);
    assert_eq!(out, &data[100_000..150_000]);
    assert!(!store.contains(UnitKey(999)));
    assert_eq!(store.fetch(UnitKey(999), big, &mut out), Fetched::Loaded);
    assert!(store.stats().cache_peak_bytes <= budget);
}

#[test]
fn lru_evicts_least_recently_used() {
    let data = random_bytes(10_000, 4);
    let reader = Arc::new(MemReader::new(data));
    let (sink, _log) = capture();
    let store = ssd(reader.clone(), 300, MissPolicy::Wait, sink);
    let u = |k: u64| unit(k * 100, 100);
    let mut out = Vec::new();
    let mut fetch = |k: u64| {
        out.clear();
        store.fetch(UnitKey(k), u(k), &mut out)
    };
    assert_eq!(fetch(1), Fetched::Loaded);
    assert_eq!(fetch(2), Fetched::Loaded);
    assert_eq!(fetch(3), Fetched::Loaded);
    assert_eq!(fetch(1), Fetched::Hit); // 1 is now the most recent; 2 the least
    assert_eq!(fetch(4), Fetched::Loaded); // evicts 2
    assert_eq!(fetch(3), Fetched::Hit); // order now: 1, 4, 3
    assert_eq!(fetch(2), Fetched::Loaded); // evicts 1
    assert_eq!(fetch(4), Fetched::Hit);
    assert_eq!(fetch(3), Fetched::Hit);
    assert_eq!(fetch(1), Fetched::Loaded);
    let present: Vec<u64> = (1..=4).filter(|&k| store.contains(UnitKey(k))).collect();
    assert_eq!(present, vec![1, 3, 4]); // 2 was least recently used when 1 came back
    assert_eq!(store.stats().cache_peak_bytes, 300);
}

#[test]
fn failing_reader_fails_softly_and_warns_once() {
    let data = random_bytes(10_000, 5);
    // Two reads succeed, then the device fails.
    let reader = Arc::new(MemReader::new(data.clone()).failing_from(2));
    let (sink, log) = capture();
    let store = ssd(reader.clone(), 1 << 20, MissPolicy::Wait, sink);
    let mut out = Vec::new();
    assert_eq!(
        store.fetch(UnitKey(0), unit(0, 64), &mut out),
        Fetched::Loaded
    );
    assert_eq!(
        store.fetch(UnitKey(1), unit(64, 64), &mut out),
        Fetched::Loaded
    );
    out = vec![9; 10];
    assert_eq!(
        store.fetch(UnitKey(2), unit(4096, 128), &mut out),
        Fetched::Failed
    );
    assert_eq!(
        out, [9; 10],
        "a failed fetch must leave out as it was (no partial bytes)"
    );
    assert!(store.is_failed());
    // Every later fetch fails quickly, cached units included, without further reads.
    for k in 0..100 {
        assert_eq!(
            store.fetch(UnitKey(k % 4), unit(k * 64, 64), &mut out),
            Fetched::Failed
        );
        assert_eq!(out, [9; 10]);
    }
    assert_eq!(reader.reads(), 3);
    let log = log.lock().unwrap();
    assert_eq!(log.len(), 1, "{log:?}");
    assert!(
        log[0].starts_with("warning: refinement tier ssd failed"),
        "{}",
        log[0]
    );
    assert!(log[0].contains("offset 4096") && log[0].contains("injected device error"));
    assert!(log[0].contains("continuing at resident precision"));
    let s = store.stats();
    assert_eq!(s.failed, 101);
    assert_eq!(s.cache_bytes, 0);
}

#[test]
fn failing_reader_under_skip_and_short_file_read() {
    // Background failure under Skip: skipped first, failed afterwards, one warning.
    let reader = Arc::new(MemReader::new(vec![0; 1000]).failing_from(0));
    let (sink, log) = capture();
    let store = ssd(reader, 1 << 20, MissPolicy::Skip, sink);
    let mut out = Vec::new();
    assert_eq!(
        store.fetch(UnitKey(0), unit(0, 10), &mut out),
        Fetched::Skipped
    );
    assert!(store.wait_idle(Duration::from_secs(2)));
    assert_eq!(
        store.fetch(UnitKey(0), unit(0, 10), &mut out),
        Fetched::Failed
    );
    assert_eq!(
        store.fetch(UnitKey(1), unit(10, 10), &mut out),
        Fetched::Failed
    );
    assert_eq!(log.lock().unwrap().len(), 1);
    drop(store);

    // Two loaders failing concurrently still produce exactly one warning.
    let reader = Arc::new(
        MemReader::new(vec![0; 1000])
            .slow(Duration::from_millis(100))
            .failing_from(0),
    );
    let (sink, log) = capture();
    let store = ssd(reader.clone(), 1 << 20, MissPolicy::Skip, sink);
    assert_eq!(
        store.fetch(UnitKey(0), unit(0, 10), &mut out),
        Fetched::Skipped
    );
    assert_eq!(
        store.fetch(UnitKey(1), unit(10, 10), &mut out),
        Fetched::Skipped
    );
    assert!(store.wait_idle(Duration::from_secs(2)));
    assert_eq!(
        reader.reads(),
        2,
        "both loads should have been read concurrently"
    );
    let warnings = log.lock().unwrap().clone();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    drop(store);

    // A short read of a real file (unit past EOF) through the `File` reader.
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(&random_bytes(5000, 6)).unwrap();
    f.flush().unwrap();
    let (sink, log) = capture();
    let file = std::fs::File::open(f.path()).unwrap();
    let store = ssd(Arc::new(file), 1 << 20, MissPolicy::Wait, sink);
    out = vec![1; 3];
    assert_eq!(
        store.fetch(UnitKey(0), unit(4000, 2000), &mut out),
        Fetched::Failed
    );
    assert_eq!(out, [1, 1, 1]);
    assert_eq!(
        store.fetch(UnitKey(1), unit(0, 10), &mut out),
        Fetched::Failed
    );
    let log = log.lock().unwrap();
    assert_eq!(log.len(), 1);
    assert!(log[0].contains("offset 4000"), "{}", log[0]);
}

#[test]
fn ram_out_of_range_fails_once_and_lock_is_best_effort() {
    let data = random_bytes(20_000, 8);
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(&data).unwrap();
    f.flush().unwrap();
    let (sink, log) = capture();
    let mut ram = RamStore::open(f.path()).unwrap().with_warn_sink(sink);
    // mlock may be refused by RLIMIT_MEMLOCK; either way, no panic and the store still works.
    let locked = ram.lock(&[(0, 8192), (10_000, 1_000_000)]);
    assert!(locked <= 20_000);
    let warnings_after_lock = log.lock().unwrap().len();
    assert!(warnings_after_lock <= 1);

    let mut out = vec![7];
    assert_eq!(
        ram.fetch(UnitKey(0), unit(19_990, 20), &mut out),
        Fetched::Failed
    );
    assert_eq!(out, [7]);
    assert_eq!(
        ram.fetch(UnitKey(1), unit(u64::MAX - 2, 20), &mut out),
        Fetched::Failed
    );
    out.clear();
    assert_eq!(
        ram.fetch(UnitKey(2), unit(19_980, 20), &mut out),
        Fetched::Hit
    );
    assert_eq!(out, &data[19_980..]);
    assert_eq!(log.lock().unwrap().len(), warnings_after_lock + 1);
    let s = ram.stats();
    assert_eq!((s.hits, s.failed, s.bytes_served), (1, 2, 20));
}

#[test]
fn hit_counts_are_exact_for_scripted_sequences() {
    let data = random_bytes(10_000, 9);
    let reader = Arc::new(MemReader::new(data));
    let (sink, _log) = capture();
    let store = ssd(reader.clone(), 1 << 20, MissPolicy::Wait, sink);
    let mut out = Vec::new();
    let script = [1u64, 2, 1, 1, 3, 2, 4, 1, 4, 4];
    for &k in &script {
        store.fetch(UnitKey(k), unit(k * 100, 50 + k as u32), &mut out);
    }
    let s = store.stats();
    let distinct: u64 = [1u64, 2, 3, 4].iter().map(|k| 50 + k).sum();
    let served: u64 = script.iter().map(|k| 50 + k).sum();
    assert_eq!(
        s,
        StoreStats {
            hits: 6,
            misses: 4,
            skipped: 0,
            failed: 0,
            bytes_read_from_backing: distinct,
            bytes_served: served,
            cache_bytes: distinct,
            cache_peak_bytes: distinct,
        }
    );
    assert_eq!(reader.reads(), 4);
    store.reset_stats();
    let s = store.stats();
    assert_eq!((s.hits, s.misses, s.bytes_served), (0, 0, 0));
    assert_eq!((s.cache_bytes, s.cache_peak_bytes), (distinct, distinct));
    store.fetch(UnitKey(3), unit(300, 53), &mut out);
    assert_eq!((store.stats().hits, store.stats().misses), (1, 0));
    // Stats serialize for reports.
    let json = serde_json::to_string(&store.stats()).unwrap();
    assert!(json.contains("\"cache_peak_bytes\""));
}

#[test]
fn concurrent_wait_fetchers_share_one_read() {
    let data = random_bytes(10_000, 10);
    let reader = Arc::new(MemReader::new(data.clone()).slow(Duration::from_millis(100)));
    let (sink, _log) = capture();
    let store = Arc::new(ssd(reader.clone(), 1 << 20, MissPolicy::Wait, sink));
    let handles: Vec<_> = (0..6)
        .map(|_| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                let mut out = Vec::new();
                let r = store.fetch(UnitKey(42), unit(500, 300), &mut out);
                (r, out)
            })
        })
        .collect();
    for h in handles {
        let (r, out) = h.join().unwrap();
        assert!(r.has_bytes(), "{r:?}");
        assert_eq!(out, &data[500..800]);
    }
    assert_eq!(reader.reads(), 1, "duplicate reads of one in-flight key");
    let s = store.stats();
    assert_eq!(s.hits + s.misses, 6);
}

#[test]
fn drop_joins_loader_threads_without_hanging() {
    let reader = Arc::new(MemReader::new(vec![0; 100_000]).slow(Duration::from_millis(300)));
    let (sink, _log) = capture();
    let store = ssd(reader.clone(), 1 << 20, MissPolicy::Skip, sink);
    let mut out = Vec::new();
    for k in 0..40u64 {
        store.fetch(UnitKey(k), unit(k * 1000, 1000), &mut out);
    }
    let t = Instant::now();
    drop(store);
    let elapsed = t.elapsed();
    // Each of the 2 loaders finishes at most the read it is in; queued jobs are not read.
    assert!(
        elapsed < Duration::from_millis(1000),
        "drop took {elapsed:?}"
    );
    assert!(
        reader.reads() <= 4,
        "{} reads after shutdown",
        reader.reads()
    );
    // The loaders held the last other references to the reader: all threads are gone.
    assert_eq!(Arc::strong_count(&reader), 1);
}

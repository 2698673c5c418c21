//! Refinement tiers: where fetched refinement units (one column, one neuron bundle) come from.
//!
//! A *unit* is the smallest thing the decode-time engine fetches: one column of a
//! `column_nibbles` section (`ceil(out/2)` bytes) or one neuron bundle of a `neuron_bundles`
//! section (`4·ceil(hidden/2)` bytes), see docs/format.md "Layouts". Both layouts were chosen
//! so that a unit is one contiguous byte range of the `.sfx` file; a tier therefore only needs
//! an absolute file offset and a length ([`UnitRef`]) plus a stable identity ([`UnitKey`],
//! assigned by the engine) to cache it.
//!
//! Two tiers (docs/method.md §4):
//! - [`RamStore`]: the whole file memory-mapped; every fetch is a copy out of the map.
//! - [`SsdStore`]: positioned reads through a bounded LRU cache, with background loader
//!   threads and a miss policy ([`MissPolicy::Skip`] or [`MissPolicy::Wait`]).
//!
//! Faults never abort decoding: refinement only *improves* the resident weights, so when a
//! tier cannot deliver a unit the caller keeps the resident precision ([`Fetched::Failed`]),
//! and the store says so once on its warning sink.
//!
//! Units read back from the backing file are checked before they are cached or served
//! ([`UnitCheck`], e.g. [`UnitChecksums`]: a CRC-32 per unit taken from bytes already verified
//! against the section's SHA-256): a bad sector, a flaky device or a file rewritten in place
//! would otherwise hand the engine bytes nobody verified. A unit that fails its check fails
//! the tier like a read error.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::fs::File;
use std::io;
use std::path::Path;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use memmap2::{Mmap, MmapOptions};
use serde::Serialize;

/// Identity of one refinement unit, chosen by the engine (e.g. set/layer/projection/channel
/// packed into 64 bits). The store only compares keys; it never interprets them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct UnitKey(pub u64);

/// Where a unit lives: absolute byte offset in the `.sfx` file and its length in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct UnitRef {
    pub offset: u64,
    pub len: u32,
}

impl UnitRef {
    /// One past the last byte, `None` on overflow.
    pub fn end(&self) -> Option<u64> {
        self.offset.checked_add(u64::from(self.len))
    }

    /// Column `i` of a `column_nibbles` section `[out, in]` whose first byte is at
    /// `section_offset`: `ceil(out/2)` bytes at `section_offset + i·ceil(out/2)`.
    /// `None` when the length does not fit a `u32` or the offset overflows.
    pub fn column(section_offset: u64, out: u64, i: u64) -> Option<UnitRef> {
        Self::strided(section_offset, out.div_ceil(2), i)
    }

    /// Neuron bundle `j` of a `neuron_bundles` section `[neurons, hidden]` whose first byte is
    /// at `section_offset`: `4·ceil(hidden/2)` bytes at `section_offset + j·4·ceil(hidden/2)`.
    pub fn bundle(section_offset: u64, hidden: u64, j: u64) -> Option<UnitRef> {
        Self::strided(section_offset, hidden.div_ceil(2).checked_mul(4)?, j)
    }

    fn strided(section_offset: u64, stride: u64, index: u64) -> Option<UnitRef> {
        let len = u32::try_from(stride).ok()?;
        let offset = section_offset.checked_add(stride.checked_mul(index)?)?;
        Some(UnitRef { offset, len })
    }
}

/// What to do when a unit is not in the RAM cache (docs/method.md §4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum MissPolicy {
    /// Use the resident value this step; a loader thread fetches the unit for later steps.
    /// The paper default: decode latency never waits on the SSD.
    #[default]
    Skip,
    /// Read the unit now (exact refinement, latency includes the read).
    Wait,
}

impl FromStr for MissPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "skip" => Ok(MissPolicy::Skip),
            "wait" => Ok(MissPolicy::Wait),
            other => Err(format!(
                "unknown miss policy {other:?} (expected \"skip\" or \"wait\")"
            )),
        }
    }
}

impl fmt::Display for MissPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MissPolicy::Skip => "skip",
            MissPolicy::Wait => "wait",
        })
    }
}

/// Outcome of [`RefinementStore::fetch`]. Only `Hit` and `Loaded` put bytes in `out`; after
/// `Skipped` and `Failed`, `out` is empty and the caller uses the resident precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fetched {
    /// Served from RAM (the map or the cache).
    Hit,
    /// A miss read synchronously ([`MissPolicy::Wait`]).
    Loaded,
    /// A miss under [`MissPolicy::Skip`]: the load was queued in the background (or dropped
    /// when the queue was full); the caller uses the resident precision this step.
    Skipped,
    /// The unit is unavailable (the tier failed, or the unit lies outside the file).
    Failed,
}

impl Fetched {
    /// Whether `out` holds the unit.
    pub fn has_bytes(self) -> bool {
        matches!(self, Fetched::Hit | Fetched::Loaded)
    }
}

/// Counters of one store since construction or the last [`RefinementStore::reset_stats`].
///
/// `hits + misses + (fetches after the tier failed)` is the number of fetches; every miss is
/// then `Skipped`, `Loaded` or `Failed`. `bytes_served` counts bytes copied out to callers
/// (hits and loads), `bytes_read_from_backing` bytes read from the reader (foreground and
/// background). `cache_bytes` is the current cache occupancy, `cache_peak_bytes` its maximum
/// since the last reset (both 0 for the RAM tier, which has no cache).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StoreStats {
    pub hits: u64,
    pub misses: u64,
    pub skipped: u64,
    pub failed: u64,
    pub bytes_read_from_backing: u64,
    pub bytes_served: u64,
    pub cache_bytes: u64,
    pub cache_peak_bytes: u64,
}

impl StoreStats {
    /// Adds another store's counters; occupancy is the latest, the peak the larger.
    pub fn merge(&mut self, s: &StoreStats) {
        self.hits += s.hits;
        self.misses += s.misses;
        self.skipped += s.skipped;
        self.failed += s.failed;
        self.bytes_read_from_backing += s.bytes_read_from_backing;
        self.bytes_served += s.bytes_served;
        self.cache_bytes = s.cache_bytes;
        self.cache_peak_bytes = self.cache_peak_bytes.max(s.cache_peak_bytes);
    }

    /// `hits / (hits + misses)`, 0 when nothing was fetched.
    pub fn hit_rate(&self) -> f64 {
        let total = self.hits + self.misses;
        if total == 0 {
            0.0
        } else {
            self.hits as f64 / total as f64
        }
    }
}

/// Positioned reads of the backing file. `read_at` must fill `buf` completely or return an
/// error (a short read is an error, never partial success).
pub trait UnitReader: Send + Sync {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
}

impl UnitReader for File {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        // `read_exact_at` is a positioned read (pread): no shared cursor, so loader threads
        // and the foreground can read the same `File` concurrently without a lock.
        std::os::unix::fs::FileExt::read_exact_at(self, buf, offset)
    }
}

/// Checks a unit read from the backing file before the SSD tier caches or serves it; `Err`
/// says why it was refused. Called off the decode thread under [`MissPolicy::Skip`] (loader
/// threads) and on it under [`MissPolicy::Wait`], only for reads, never for cache hits.
pub trait UnitCheck: Send + Sync {
    fn check(&self, at: UnitRef, data: &[u8]) -> Result<(), String>;
}

/// The checksum of one unit: CRC-32 (IEEE), hardware-accelerated. A CRC, not a cryptographic
/// hash: it guards against corruption between the verified section and a later read (any
/// burst of up to 32 flipped bits, and all but 2^-32 of other damage), while the section's
/// SHA-256 remains what vouches for the file.
pub fn unit_checksum(data: &[u8]) -> u32 {
    crc32fast::hash(data)
}

/// One strided run of units: `sums.len()` units of `unit_len` bytes from `offset` on.
struct ChecksumRegion {
    offset: u64,
    unit_len: u32,
    sums: Vec<u32>,
}

/// [`unit_checksum`] of every unit of some strided regions of the backing file (a refinement
/// section's columns or neuron bundles), kept in RAM: 4 bytes per unit. A unit the regions do
/// not describe is refused (it is not one whose bytes were verified).
#[derive(Default)]
pub struct UnitChecksums {
    /// Sorted by offset, non-overlapping.
    regions: Vec<ChecksumRegion>,
}

impl UnitChecksums {
    /// Checksums of every unit of each region `(offset, unit_len, bytes)`, `bytes` being the
    /// region's verified contents (a whole number of units). Regions are hashed in parallel.
    /// Errors on an empty unit, a partial unit or overlapping regions (a malformed plan).
    pub fn from_regions(regions: Vec<(u64, u32, &[u8])>) -> Result<Self, String> {
        use rayon::prelude::*;
        for &(offset, unit_len, bytes) in &regions {
            if unit_len == 0 || !bytes.len().is_multiple_of(unit_len as usize) {
                return Err(format!(
                    "unit checksums: region at offset {offset} has {} bytes, not a whole \
                     number of {unit_len}-byte units",
                    bytes.len()
                ));
            }
        }
        let mut regions: Vec<ChecksumRegion> = regions
            .into_par_iter()
            .map(|(offset, unit_len, bytes)| ChecksumRegion {
                offset,
                unit_len,
                sums: bytes
                    .chunks_exact(unit_len as usize)
                    .map(unit_checksum)
                    .collect(),
            })
            .collect();
        regions.sort_by_key(|r| r.offset);
        for w in regions.windows(2) {
            let end = w[0]
                .offset
                .saturating_add(u64::from(w[0].unit_len).saturating_mul(w[0].sums.len() as u64));
            if end > w[1].offset {
                return Err(format!(
                    "unit checksums: regions at offsets {} and {} overlap",
                    w[0].offset, w[1].offset
                ));
            }
        }
        Ok(UnitChecksums { regions })
    }

    /// Units described.
    pub fn units(&self) -> u64 {
        self.regions.iter().map(|r| r.sums.len() as u64).sum()
    }

    /// RAM held by the checksums.
    pub fn heap_bytes(&self) -> u64 {
        self.units() * 4 + (self.regions.len() * std::mem::size_of::<ChecksumRegion>()) as u64
    }

    /// The recorded checksum of the unit at `at`, `None` when no region has a unit there.
    fn expected(&self, at: UnitRef) -> Option<u32> {
        let i = self.regions.partition_point(|r| r.offset <= at.offset);
        let r = &self.regions[i.checked_sub(1)?];
        let rel = at.offset - r.offset;
        let len = u64::from(r.unit_len);
        if at.len != r.unit_len || !rel.is_multiple_of(len) {
            return None;
        }
        r.sums.get(usize::try_from(rel / len).ok()?).copied()
    }
}

impl UnitCheck for UnitChecksums {
    fn check(&self, at: UnitRef, data: &[u8]) -> Result<(), String> {
        match self.expected(at) {
            Some(want) if unit_checksum(data) == want => Ok(()),
            Some(_) => Err(
                "checksum mismatch: the bytes read back differ from those verified at open".into(),
            ),
            None => Err("no verified unit at this offset and length".into()),
        }
    }
}

/// A tier of refinement units, shared by the engine's worker threads.
pub trait RefinementStore: Send + Sync {
    /// Appends the unit's `at.len` bytes to `out` when available ([`Fetched::Hit`] or
    /// [`Fetched::Loaded`]) and leaves `out` as it was otherwise, so a caller gathers the
    /// selected units straight into one staging buffer; never blocks on I/O under
    /// [`MissPolicy::Skip`].
    fn fetch(&self, key: UnitKey, at: UnitRef, out: &mut Vec<u8>) -> Fetched;
    fn stats(&self) -> StoreStats;
    fn reset_stats(&self);
    /// The budget of the RAM cache in front of a slower tier (`None`: no such cache).
    fn ram_cache_budget(&self) -> Option<u64> {
        None
    }
    /// `"ram"` or `"ssd"`.
    fn name(&self) -> &'static str;
    /// Starts loading a unit that will be fetched soon (fetch lead); never blocks. Tiers
    /// without a slow backing store ignore it.
    fn prefetch(&self, _key: UnitKey, _at: UnitRef) {}
}

/// Where a store's one-time warnings go; [`stderr_warn_sink`] by default. Injectable so that
/// tests (and embedders with their own logging) can capture them.
pub type WarnSink = Arc<dyn Fn(&str) + Send + Sync>;

/// The default warning sink: one line on stderr.
pub fn stderr_warn_sink() -> WarnSink {
    Arc::new(|msg: &str| eprintln!("{msg}"))
}

/// Locks a mutex, ignoring poisoning: no code in this module panics while holding a lock, and
/// a refinement tier must keep working (or fail softly) rather than propagate a panic.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Hot-path counters. Relaxed atomics: each is an independent tally, read only for reports.
#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    skipped: AtomicU64,
    failed: AtomicU64,
    bytes_read: AtomicU64,
    bytes_served: AtomicU64,
}

impl Counters {
    fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    fn snapshot(&self, cache_bytes: u64, cache_peak_bytes: u64) -> StoreStats {
        StoreStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            skipped: self.skipped.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            bytes_read_from_backing: self.bytes_read.load(Ordering::Relaxed),
            bytes_served: self.bytes_served.load(Ordering::Relaxed),
            cache_bytes,
            cache_peak_bytes,
        }
    }

    fn reset(&self) {
        for c in [
            &self.hits,
            &self.misses,
            &self.skipped,
            &self.failed,
            &self.bytes_read,
            &self.bytes_served,
        ] {
            c.store(0, Ordering::Relaxed);
        }
    }
}

fn source_prefix(source: &str) -> String {
    if source.is_empty() {
        String::new()
    } else {
        format!("{source}: ")
    }
}

// ---------------------------------------------------------------------------------------------
// RAM tier
// ---------------------------------------------------------------------------------------------

/// The RAM tier: the whole `.sfx` file memory-mapped; refinement is read straight from the map
/// (the OS page cache is the "RAM"). Every in-range fetch is a [`Fetched::Hit`].
pub struct RamStore {
    map: Mmap,
    /// Kept to map sub-ranges for [`RamStore::lock`].
    file: File,
    /// Extra mappings of the locked ranges; mlock lasts as long as these live.
    locked: Vec<Mmap>,
    counters: Counters,
    warned: AtomicBool,
    warn: WarnSink,
    source: String,
}

impl RamStore {
    /// Maps the file at `path`.
    pub fn open(path: &Path) -> io::Result<Self> {
        let file = File::open(path)?;
        Self::from_file(file, path.display().to_string())
    }

    /// Maps `file`; `source` names it in warnings (may be empty).
    pub fn from_file(file: File, source: impl Into<String>) -> io::Result<Self> {
        // SAFETY: the map is read-only; like every reader of `.sfx` files in this workspace we
        // rely on the file not being truncated or rewritten while it is mapped.
        let map = unsafe { Mmap::map(&file) }?;
        Ok(RamStore {
            map,
            file,
            locked: Vec::new(),
            counters: Counters::default(),
            warned: AtomicBool::new(false),
            warn: stderr_warn_sink(),
            source: source.into(),
        })
    }

    /// Replaces the warning sink (default: stderr).
    pub fn with_warn_sink(mut self, sink: WarnSink) -> Self {
        self.warn = sink;
        self
    }

    /// Length of the mapped file in bytes.
    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The mapped bytes `offset..offset + len`, or `None` past the end of the file.
    pub fn bytes(&self, offset: u64, len: usize) -> Option<&[u8]> {
        let start = usize::try_from(offset).ok()?;
        self.map.get(start..start.checked_add(len)?)
    }

    /// Pins the given `(offset, len)` byte ranges in RAM (mlock), so that refinement never
    /// page-faults to disk. Returns the number of bytes locked. Locking is best effort: the
    /// first failure (typically `RLIMIT_MEMLOCK`) prints one warning and stops locking; the
    /// store keeps working unlocked. Ranges outside the file are clipped.
    ///
    /// Why separate mappings: memmap2 only locks whole maps, and mlock of a second shared map
    /// of the same file pins the same page-cache pages the main map reads.
    pub fn lock(&mut self, ranges: &[(u64, u64)]) -> u64 {
        let file_len = self.len();
        let mut locked = 0u64;
        for &(offset, len) in ranges {
            let end = offset.saturating_add(len).min(file_len);
            if offset >= end {
                continue;
            }
            let len = end - offset;
            let Ok(map_len) = usize::try_from(len) else {
                continue;
            };
            // SAFETY: as in `from_file`.
            let res = unsafe {
                MmapOptions::new()
                    .offset(offset)
                    .len(map_len)
                    .map(&self.file)
            }
            .and_then(|m| m.lock().map(|()| m));
            match res {
                Ok(m) => {
                    self.locked.push(m);
                    locked += len;
                }
                Err(e) => {
                    (self.warn)(&format!(
                        "warning: refinement tier ram: mlock of {len} bytes at offset {offset} \
                         failed ({}{e}); continuing without locking",
                        source_prefix(&self.source)
                    ));
                    break;
                }
            }
        }
        locked
    }
}

impl RefinementStore for RamStore {
    fn fetch(&self, _key: UnitKey, at: UnitRef, out: &mut Vec<u8>) -> Fetched {
        match self.bytes(at.offset, at.len as usize) {
            Some(bytes) => {
                out.extend_from_slice(bytes);
                Counters::add(&self.counters.hits, 1);
                Counters::add(&self.counters.bytes_served, u64::from(at.len));
                Fetched::Hit
            }
            None => {
                // A unit outside the file is an engine/metadata bug, not an I/O fault: the
                // store stays usable for other units, but we say so once.
                Counters::add(&self.counters.failed, 1);
                if !self.warned.swap(true, Ordering::Relaxed) {
                    (self.warn)(&format!(
                        "warning: refinement tier ram: unit of {} bytes at offset {} is outside \
                         the mapped file ({}{} bytes); continuing at resident precision",
                        at.len,
                        at.offset,
                        source_prefix(&self.source),
                        self.len()
                    ));
                }
                Fetched::Failed
            }
        }
    }

    fn stats(&self) -> StoreStats {
        self.counters.snapshot(0, 0)
    }

    fn reset_stats(&self) {
        self.counters.reset();
    }

    fn name(&self) -> &'static str {
        "ram"
    }
}

// ---------------------------------------------------------------------------------------------
// SSD tier
// ---------------------------------------------------------------------------------------------

/// Construction options of [`SsdStore`]; [`SsdStore::new`] uses the defaults for the rest.
pub struct SsdOptions {
    /// RAM cache budget in bytes, shared by all units of all projection sets.
    pub cache_budget_bytes: u64,
    pub policy: MissPolicy,
    /// Background loader threads (at least one is started).
    pub loader_threads: usize,
    /// Capacity of the background load queue; requests beyond it are dropped, not waited for.
    pub queue_capacity: usize,
    /// Names the backing file in warnings (may be empty).
    pub source: String,
    pub warn: WarnSink,
    /// Checks every unit read from the backing file; `None` trusts the reader (tests of the
    /// store's mechanics only: a tier over a real file should always check).
    pub check: Option<Arc<dyn UnitCheck>>,
}

impl Default for SsdOptions {
    fn default() -> Self {
        SsdOptions {
            cache_budget_bytes: 128 << 20,
            policy: MissPolicy::Skip,
            loader_threads: 2,
            queue_capacity: 4096,
            source: String::new(),
            warn: stderr_warn_sink(),
            check: None,
        }
    }
}

struct Entry {
    at: UnitRef,
    data: Arc<Vec<u8>>,
    /// Last-use tick; the key of this entry in `Cache::lru`.
    tick: u64,
}

/// LRU cache plus the set of in-flight loads, all under one mutex so that "is it cached?",
/// "is it being loaded?" and "claim the load" are one atomic step (this is what makes the
/// in-flight de-duplication and the exact hit/miss accounting race-free).
#[derive(Default)]
struct Cache {
    entries: HashMap<UnitKey, Entry>,
    /// tick -> key, oldest first. A BTreeMap keeps touch/evict O(log n) without an intrusive
    /// list; n is at most budget / smallest unit (tens of thousands), so this is cheap.
    lru: BTreeMap<u64, UnitKey>,
    tick: u64,
    bytes: u64,
    peak: u64,
    in_flight: HashSet<UnitKey>,
}

impl Cache {
    /// The cached bytes of `key`, marking it most recently used. An entry recorded for a
    /// different location is stale (the engine reused a key) and is dropped.
    fn get(&mut self, key: UnitKey, at: UnitRef) -> Option<Arc<Vec<u8>>> {
        let entry = self.entries.get(&key)?;
        if entry.at != at {
            self.remove(key);
            return None;
        }
        self.tick += 1;
        let tick = self.tick;
        let entry = self.entries.get_mut(&key)?;
        self.lru.remove(&entry.tick);
        entry.tick = tick;
        self.lru.insert(tick, key);
        Some(Arc::clone(&entry.data))
    }

    fn remove(&mut self, key: UnitKey) {
        if let Some(e) = self.entries.remove(&key) {
            self.lru.remove(&e.tick);
            self.bytes -= e.data.len() as u64;
        }
    }

    /// Inserts (or replaces) a unit, evicting least recently used units until it fits. A unit
    /// larger than the whole budget is not cached at all (evicting everything for it would
    /// only thrash), so the cache never exceeds `budget`.
    fn insert(&mut self, key: UnitKey, at: UnitRef, data: Arc<Vec<u8>>, budget: u64) {
        let len = data.len() as u64;
        if len > budget {
            return;
        }
        self.remove(key);
        while self.bytes + len > budget {
            let Some((_, victim)) = self.lru.pop_first() else {
                break;
            };
            if let Some(e) = self.entries.remove(&victim) {
                self.bytes -= e.data.len() as u64;
            }
        }
        self.tick += 1;
        self.lru.insert(self.tick, key);
        self.entries.insert(
            key,
            Entry {
                at,
                data,
                tick: self.tick,
            },
        );
        self.bytes += len;
        self.peak = self.peak.max(self.bytes);
    }

    fn clear(&mut self) {
        self.entries.clear();
        self.lru.clear();
        self.bytes = 0;
    }
}

struct Job {
    key: UnitKey,
    at: UnitRef,
}

/// State shared by the store and its loader threads.
struct Shared {
    reader: Arc<dyn UnitReader>,
    budget: u64,
    cache: Mutex<Cache>,
    /// Signalled whenever an in-flight load ends (loaded, dropped or failed).
    load_done: Condvar,
    failed: AtomicBool,
    shutdown: AtomicBool,
    counters: Counters,
    warn: WarnSink,
    source: String,
    check: Option<Arc<dyn UnitCheck>>,
}

impl Shared {
    /// Reads a whole unit into `buf` (resized to `at.len`). Allocation failure and offset
    /// overflow are reported as I/O errors, so that nothing here can abort the process.
    fn read_unit(&self, at: UnitRef, buf: &mut Vec<u8>) -> io::Result<()> {
        buf.clear();
        if at.end().is_none() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "unit offset + length overflows",
            ));
        }
        let len = at.len as usize;
        buf.try_reserve_exact(len)
            .map_err(|e| io::Error::new(io::ErrorKind::OutOfMemory, e))?;
        buf.resize(len, 0);
        let res = self.reader.read_at(at.offset, buf).and_then(|()| {
            Counters::add(&self.counters.bytes_read, u64::from(at.len));
            match &self.check {
                Some(check) => check
                    .check(at, buf)
                    .map_err(|why| io::Error::new(io::ErrorKind::InvalidData, why)),
                None => Ok(()),
            }
        });
        if res.is_err() {
            // Nothing of a failed or refused read may reach a caller or the cache.
            buf.clear();
        }
        res
    }

    /// Marks the tier failed. The first failure prints the one warning and frees the cache
    /// (every later fetch returns `Failed`, so cached units could never be served again).
    /// Must not be called with the cache lock held.
    fn fail(&self, at: UnitRef, err: &io::Error) {
        if self.failed.swap(true, Ordering::AcqRel) {
            return;
        }
        (self.warn)(&format!(
            "warning: refinement tier ssd failed ({}read of {} bytes at file offset {}: {err}); \
             continuing at resident precision",
            source_prefix(&self.source),
            at.len,
            at.offset
        ));
        lock(&self.cache).clear();
    }

    /// Ends the in-flight load of `key`, caching `data` when the tier is still healthy, and
    /// wakes waiters.
    fn finish(&self, key: UnitKey, data: Option<(UnitRef, Arc<Vec<u8>>)>) {
        let mut cache = lock(&self.cache);
        cache.in_flight.remove(&key);
        if let Some((at, data)) = data {
            if !self.failed.load(Ordering::Acquire) {
                cache.insert(key, at, data, self.budget);
            }
        }
        drop(cache);
        self.load_done.notify_all();
    }

    fn loader(&self, rx: &Mutex<Receiver<Job>>) {
        loop {
            // The receiver lock is held only while waiting for the next job, never during I/O.
            let job = lock(rx).recv();
            let Ok(job) = job else {
                return; // sender dropped: the store is being dropped
            };
            // On shutdown or after a failure, drain the queue without reading so Drop is quick.
            if self.shutdown.load(Ordering::Acquire) || self.failed.load(Ordering::Acquire) {
                self.finish(job.key, None);
                continue;
            }
            let mut buf = Vec::new();
            match self.read_unit(job.at, &mut buf) {
                Ok(()) => self.finish(job.key, Some((job.at, Arc::new(buf)))),
                Err(e) => {
                    self.fail(job.at, &e);
                    self.finish(job.key, None);
                }
            }
        }
    }
}

/// The SSD tier: positioned reads of the `.sfx` file through a bounded RAM cache.
///
/// Why one LRU over all units: the selected channels of all projection sets (q/k/v, o,
/// gate/up bundles, down) compete for the same RAM, and their reuse rates differ per model and
/// prompt; one shared budget lets the cache follow whichever set currently recurs most instead
/// of stranding memory in fixed per-set partitions (docs/method.md §4: one LRU over all four
/// projection sets).
///
/// Why [`MissPolicy::Skip`] never blocks: a decode step touches thousands of units and an SSD
/// read costs ~100 µs; waiting on misses would make the step latency the sum of reads. Under
/// Skip a miss costs one mutex section and a non-blocking `try_send`; if the load queue is
/// full the request is dropped (the unit will be requested again the next time it is
/// selected), so the decode thread never waits on the loaders.
pub struct SsdStore {
    shared: Arc<Shared>,
    policy: MissPolicy,
    tx: Option<SyncSender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl SsdStore {
    /// A store reading through `reader`, with a cache of `cache_budget_bytes`, the given miss
    /// policy and `loader_threads` background loaders (at least one), warning on stderr.
    pub fn new(
        reader: Arc<dyn UnitReader>,
        cache_budget_bytes: u64,
        policy: MissPolicy,
        loader_threads: usize,
    ) -> Self {
        Self::with_options(
            reader,
            SsdOptions {
                cache_budget_bytes,
                policy,
                loader_threads,
                ..SsdOptions::default()
            },
        )
    }

    /// Opens the file at `path` as the backing reader.
    pub fn open(
        path: &Path,
        cache_budget_bytes: u64,
        policy: MissPolicy,
        loader_threads: usize,
    ) -> io::Result<Self> {
        let file = File::open(path)?;
        Ok(Self::with_options(
            Arc::new(file),
            SsdOptions {
                cache_budget_bytes,
                policy,
                loader_threads,
                source: path.display().to_string(),
                ..SsdOptions::default()
            },
        ))
    }

    pub fn with_options(reader: Arc<dyn UnitReader>, opts: SsdOptions) -> Self {
        let shared = Arc::new(Shared {
            reader,
            budget: opts.cache_budget_bytes,
            cache: Mutex::new(Cache::default()),
            load_done: Condvar::new(),
            failed: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            counters: Counters::default(),
            warn: opts.warn,
            source: opts.source,
            check: opts.check,
        });
        let (tx, rx) = sync_channel::<Job>(opts.queue_capacity.max(1));
        let rx = Arc::new(Mutex::new(rx));
        let mut threads = Vec::new();
        for i in 0..opts.loader_threads.max(1) {
            let worker = Arc::clone(&shared);
            let rx = Arc::clone(&rx);
            let spawned = std::thread::Builder::new()
                .name(format!("sfx-refine-loader-{i}"))
                .spawn(move || worker.loader(&rx));
            match spawned {
                Ok(h) => threads.push(h),
                Err(e) => {
                    (shared.warn)(&format!(
                        "warning: refinement tier ssd: could not start loader thread {i} ({e})"
                    ));
                    break;
                }
            }
        }
        // Without any loader, queued loads would never finish; no sender means Skip misses
        // are simply dropped (the caller still gets `Skipped`, never a hang).
        let tx = if threads.is_empty() { None } else { Some(tx) };
        SsdStore {
            shared,
            policy: opts.policy,
            tx,
            threads,
        }
    }

    pub fn policy(&self) -> MissPolicy {
        self.policy
    }

    pub fn cache_budget_bytes(&self) -> u64 {
        self.shared.budget
    }

    /// Whether a read error has disabled this tier.
    pub fn is_failed(&self) -> bool {
        self.shared.failed.load(Ordering::Acquire)
    }

    /// Whether `key` is cached (does not count as a use for LRU or in the stats).
    pub fn contains(&self, key: UnitKey) -> bool {
        lock(&self.shared.cache).entries.contains_key(&key)
    }

    /// Number of background or foreground loads in flight.
    pub fn in_flight(&self) -> usize {
        lock(&self.shared.cache).in_flight.len()
    }

    /// Queues a background load of `key` unless it is cached or already in flight, whatever
    /// the miss policy; never blocks. Returns whether a load was queued.
    pub fn prefetch(&self, key: UnitKey, at: UnitRef) -> bool {
        if self.is_failed() {
            return false;
        }
        let mut cache = lock(&self.shared.cache);
        if cache.entries.get(&key).is_some_and(|e| e.at == at) {
            return false;
        }
        self.enqueue(&mut cache, key, at)
    }

    /// Caches bytes the caller already holds (a unit it has just written to the backing file)
    /// as the most recently used unit, so the next fetch needs no read-back. Same budget and
    /// eviction as loaded units; ignored once the tier has failed.
    pub fn insert(&self, key: UnitKey, at: UnitRef, data: Vec<u8>) {
        if self.is_failed() || data.len() != at.len as usize {
            return;
        }
        lock(&self.shared.cache).insert(key, at, Arc::new(data), self.shared.budget);
    }

    /// Waits until no load is in flight or `timeout` passes; returns whether it went idle.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut cache = lock(&self.shared.cache);
        while !cache.in_flight.is_empty() {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            cache = self
                .shared
                .load_done
                .wait_timeout(cache, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }

    /// Claims and queues a background load (called with the cache lock held, so claim and
    /// enqueue are atomic with respect to other fetchers and the loaders).
    fn enqueue(&self, cache: &mut Cache, key: UnitKey, at: UnitRef) -> bool {
        if cache.in_flight.contains(&key) {
            return false;
        }
        let Some(tx) = &self.tx else {
            return false;
        };
        match tx.try_send(Job { key, at }) {
            Ok(()) => {
                cache.in_flight.insert(key);
                true
            }
            // Full: drop the request rather than block the decode thread.
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => false,
        }
    }

    fn failed(&self) -> Fetched {
        Counters::add(&self.shared.counters.failed, 1);
        Fetched::Failed
    }

    fn serve(&self, data: &[u8], out: &mut Vec<u8>, how: Fetched) -> Fetched {
        out.extend_from_slice(data);
        if how == Fetched::Hit {
            Counters::add(&self.shared.counters.hits, 1);
        }
        Counters::add(&self.shared.counters.bytes_served, data.len() as u64);
        how
    }
}

impl RefinementStore for SsdStore {
    fn ram_cache_budget(&self) -> Option<u64> {
        Some(self.cache_budget_bytes())
    }

    fn fetch(&self, key: UnitKey, at: UnitRef, out: &mut Vec<u8>) -> Fetched {
        let shared = &*self.shared;
        // Fast path once failed: no lock, no I/O.
        if shared.failed.load(Ordering::Acquire) {
            return self.failed();
        }
        let mut cache = lock(&shared.cache);
        if let Some(data) = cache.get(key, at) {
            drop(cache); // copy outside the lock; the Arc keeps the bytes alive under eviction
            return self.serve(&data, out, Fetched::Hit);
        }
        Counters::add(&shared.counters.misses, 1);
        match self.policy {
            MissPolicy::Skip => {
                self.enqueue(&mut cache, key, at);
                drop(cache);
                Counters::add(&shared.counters.skipped, 1);
                Fetched::Skipped
            }
            MissPolicy::Wait => {
                // Another thread (a loader or a Wait fetcher) is reading this key: wait for it
                // instead of issuing a duplicate read.
                while cache.in_flight.contains(&key) {
                    cache = shared
                        .load_done
                        .wait(cache)
                        .unwrap_or_else(PoisonError::into_inner);
                    if shared.failed.load(Ordering::Acquire) {
                        drop(cache);
                        return self.failed();
                    }
                    if let Some(data) = cache.get(key, at) {
                        drop(cache);
                        return self.serve(&data, out, Fetched::Loaded);
                    }
                }
                // Not cached (e.g. larger than the budget, or evicted at once): read it here.
                cache.in_flight.insert(key);
                drop(cache);
                let mut unit = Vec::new();
                match shared.read_unit(at, &mut unit) {
                    Ok(()) => {
                        out.extend_from_slice(&unit);
                        let cached =
                            (u64::from(at.len) <= shared.budget).then(|| (at, Arc::new(unit)));
                        shared.finish(key, cached);
                        Counters::add(&shared.counters.bytes_served, u64::from(at.len));
                        Fetched::Loaded
                    }
                    Err(e) => {
                        shared.fail(at, &e);
                        shared.finish(key, None);
                        self.failed()
                    }
                }
            }
        }
    }

    fn stats(&self) -> StoreStats {
        let (bytes, peak) = {
            let c = lock(&self.shared.cache);
            (c.bytes, c.peak)
        };
        self.shared.counters.snapshot(bytes, peak)
    }

    fn reset_stats(&self) {
        let mut c = lock(&self.shared.cache);
        self.shared.counters.reset();
        c.peak = c.bytes;
    }

    fn name(&self) -> &'static str {
        "ssd"
    }

    fn prefetch(&self, key: UnitKey, at: UnitRef) {
        SsdStore::prefetch(self, key, at);
    }
}

impl Drop for SsdStore {
    /// Stops the loaders: queued jobs are drained without reading, a read in progress
    /// finishes, then every thread is joined.
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.tx = None; // disconnects the queue: `recv` fails once it is drained
        for h in self.threads.drain(..) {
            // A loader that panicked has nothing left to clean up; ignore its payload.
            let _ = h.join();
        }
    }
}

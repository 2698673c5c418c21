//! Backing tier of KV refinement units. A unit is one token group of one KV head of one layer:
//! the sub-interval indices of its keys then its values, one little-endian bit stream
//! (`ceil(g·d·(bk + bv) / 8)` bytes), so selecting a group is one contiguous read.
//!
//! - RAM: units kept in process memory; a fetch is a copy.
//! - SSD: units appended to a per-session spill file (unlinked at creation, so it disappears
//!   with the process) and read back through [`SsdStore`]'s bounded LRU cache with its skip /
//!   wait miss policy. Units just written enter the cache directly (docs/method.md §4: newly
//!   produced refinement bits serve later selections without read-back); the cache budget is
//!   shared by all layers and heads. Every unit read back is checked against the CRC-32 taken
//!   when it was written ([`SpillSums`], 4 bytes of RAM per unit), so a device that returns
//!   other bytes than were written fails the tier instead of corrupting attention.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Arc, PoisonError, RwLock};

use super::spec::KvTierConfig;
use crate::refine::store::{
    stderr_warn_sink, unit_checksum, Fetched, RefinementStore, SsdOptions, SsdStore, StoreStats,
    UnitCheck, UnitKey, UnitReader, UnitRef, WarnSink,
};

/// Wraps the spill file's reader: fault injection in tests, or instrumented I/O.
pub type ReaderWrap = Arc<dyn Fn(Arc<dyn UnitReader>) -> Arc<dyn UnitReader> + Send + Sync>;

/// The CRC-32 of every unit written to a spill file, by unit index (units are appended back to
/// back, all `unit_bytes` long, so unit `i` is at byte `i · unit_bytes`).
struct SpillSums {
    unit_bytes: usize,
    sums: RwLock<Vec<u32>>,
}

impl SpillSums {
    fn new(unit_bytes: usize) -> Arc<Self> {
        Arc::new(SpillSums {
            unit_bytes,
            sums: RwLock::new(Vec::new()),
        })
    }

    /// Records the units of a tile just written at byte `offset`.
    fn record(&self, offset: u64, units: &[u8]) {
        let mut sums = self.sums.write().unwrap_or_else(PoisonError::into_inner);
        let first = offset / self.unit_bytes.max(1) as u64;
        // push_tile appends back to back, so `first` is the next index. Were it past the end
        // (a gap), nothing is recorded: units never recorded fail their check, never pass it.
        if first > sums.len() as u64 {
            return;
        }
        sums.truncate(first as usize);
        sums.extend(units.chunks_exact(self.unit_bytes).map(unit_checksum));
    }
}

impl UnitCheck for SpillSums {
    fn check(&self, at: UnitRef, data: &[u8]) -> Result<(), String> {
        let ub = self.unit_bytes as u64;
        let sums = self.sums.read().unwrap_or_else(PoisonError::into_inner);
        let want = (at.len as usize == self.unit_bytes && ub > 0 && at.offset.is_multiple_of(ub))
            .then(|| usize::try_from(at.offset / ub).ok())
            .flatten()
            .and_then(|i| sums.get(i).copied());
        match want {
            Some(w) if unit_checksum(data) == w => Ok(()),
            Some(_) => {
                Err("checksum mismatch: the bytes read back differ from those written".into())
            }
            None => Err("no unit was written at this offset and length".into()),
        }
    }
}

/// Byte counts of a tier.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct TierBytes {
    /// Refinement bytes stored in the backing tier (RAM or spill file).
    pub backing: u64,
    /// RAM cache occupancy now and at its peak (SSD tier only).
    pub cache: u64,
    pub cache_peak: u64,
    pub cache_budget: u64,
}

enum Kind {
    Ram {
        /// Per (layer, head): units of its tiles in order.
        units: Vec<Vec<u8>>,
    },
    Ssd {
        file: Arc<File>,
        sums: Arc<SpillSums>,
        store: SsdStore,
        /// Per (layer, head): file offset of each stored tile's first unit.
        offsets: Vec<Vec<u64>>,
        next: u64,
        failed: bool,
        dir: std::path::PathBuf,
        budget: u64,
        policy: crate::refine::MissPolicy,
    },
}

pub struct KvTier {
    kind: Kind,
    unit_bytes: usize,
    per_tile: usize,
    max_tiles: usize,
    warn: WarnSink,
    wrap: Option<ReaderWrap>,
}

static SPILL_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A fresh spill file in `dir`, already unlinked (the open handle keeps it alive).
fn spill_file(dir: &Path) -> io::Result<File> {
    let seq = SPILL_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = dir.join(format!(".sfx-kv-spill-{}-{seq}", std::process::id()));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)?;
    std::fs::remove_file(&path)?;
    Ok(file)
}

fn ssd_store(
    file: &Arc<File>,
    sums: &Arc<SpillSums>,
    budget: u64,
    policy: crate::refine::MissPolicy,
    warn: &WarnSink,
    wrap: Option<&ReaderWrap>,
) -> SsdStore {
    let reader = Arc::clone(file) as Arc<dyn UnitReader>;
    SsdStore::with_options(
        match wrap {
            Some(w) => w(reader),
            None => reader,
        },
        SsdOptions {
            cache_budget_bytes: budget,
            policy,
            loader_threads: 1,
            source: "KV spill file".into(),
            warn: Arc::clone(warn),
            check: Some(Arc::clone(sums) as Arc<dyn UnitCheck>),
            ..SsdOptions::default()
        },
    )
}

impl KvTier {
    /// A tier for `heads` (layers × KV heads) streams of up to `max_tiles` tiles of
    /// `per_tile` units of `unit_bytes`.
    pub fn new(
        config: &KvTierConfig,
        heads: usize,
        max_tiles: usize,
        per_tile: usize,
        unit_bytes: usize,
    ) -> io::Result<Self> {
        let warn = stderr_warn_sink();
        let kind = match config {
            // The host cache has no device memory: its units stay in RAM.
            KvTierConfig::Ram | KvTierConfig::Device => Kind::Ram {
                units: (0..heads).map(|_| Vec::new()).collect(),
            },
            KvTierConfig::Ssd {
                dir,
                cache_budget,
                policy,
            } => {
                let file = Arc::new(spill_file(dir).map_err(|e| {
                    io::Error::new(
                        e.kind(),
                        format!("creating the KV spill file in {}: {e}", dir.display()),
                    )
                })?);
                let sums = SpillSums::new(unit_bytes);
                let store = ssd_store(&file, &sums, *cache_budget, *policy, &warn, None);
                Kind::Ssd {
                    file,
                    sums,
                    store,
                    offsets: (0..heads).map(|_| Vec::new()).collect(),
                    next: 0,
                    failed: false,
                    dir: dir.clone(),
                    budget: *cache_budget,
                    policy: *policy,
                }
            }
        };
        Ok(KvTier {
            kind,
            unit_bytes,
            per_tile,
            max_tiles,
            warn,
            wrap: None,
        })
    }

    /// Replaces the SSD tier's read path (`wrap` around the spill file's reader, e.g. a
    /// [`crate::refine::fault::FaultReader`]) and warning sink (default: stderr). The store
    /// is rebuilt with an empty cache, so later fetches of units already stored are read back
    /// through `wrap`; the RAM tier ignores the reader.
    pub fn set_io_hooks(&mut self, wrap: Option<ReaderWrap>, warn: Option<WarnSink>) {
        if let Some(w) = warn {
            self.warn = w;
        }
        self.wrap = wrap;
        if let Kind::Ssd {
            file,
            sums,
            store,
            budget,
            policy,
            ..
        } = &mut self.kind
        {
            *store = ssd_store(file, sums, *budget, *policy, &self.warn, self.wrap.as_ref());
        }
    }

    pub fn name(&self) -> &'static str {
        match self.kind {
            Kind::Ram { .. } => "ram",
            Kind::Ssd { .. } => "ssd",
        }
    }

    pub fn unit_bytes(&self) -> usize {
        self.unit_bytes
    }

    fn key(&self, head: usize, tile: usize, group: usize) -> UnitKey {
        UnitKey(((head * self.max_tiles + tile) * self.per_tile + group) as u64)
    }

    /// Stores the units of the next tile of stream `head` (`per_tile · unit_bytes` bytes).
    /// A write failure disables the SSD tier with one warning (decoding continues at
    /// resident precision, as for read failures).
    pub fn push_tile(&mut self, head: usize, units: &[u8]) {
        debug_assert_eq!(units.len(), self.per_tile * self.unit_bytes);
        let unit_bytes = self.unit_bytes;
        let per_tile = self.per_tile;
        let max_tiles = self.max_tiles;
        match &mut self.kind {
            Kind::Ram { units: all } => all[head].extend_from_slice(units),
            Kind::Ssd {
                file,
                sums,
                store,
                offsets,
                next,
                failed,
                ..
            } => {
                let tile = offsets[head].len();
                offsets[head].push(*next);
                if *failed {
                    return;
                }
                if let Err(e) = file.write_all_at(units, *next) {
                    *failed = true;
                    (self.warn)(&format!(
                        "warning: KV spill file write failed ({e}); KV refinement disabled"
                    ));
                    return;
                }
                sums.record(*next, units);
                for (g, unit) in units.chunks_exact(unit_bytes).enumerate() {
                    let at = UnitRef {
                        offset: *next + (g * unit_bytes) as u64,
                        len: unit_bytes as u32,
                    };
                    let key = UnitKey(((head * max_tiles + tile) * per_tile + g) as u64);
                    store.insert(key, at, unit.to_vec());
                }
                *next += units.len() as u64;
            }
        }
    }

    /// Unit `group` of tile `tile` of stream `head`, replacing what `out` held.
    pub fn fetch(&self, head: usize, tile: usize, group: usize, out: &mut Vec<u8>) -> Fetched {
        let ub = self.unit_bytes;
        match &self.kind {
            Kind::Ram { units } => {
                let start = (tile * self.per_tile + group) * ub;
                match units.get(head).and_then(|u| u.get(start..start + ub)) {
                    Some(bytes) => {
                        out.clear();
                        out.extend_from_slice(bytes);
                        Fetched::Hit
                    }
                    None => Fetched::Failed,
                }
            }
            Kind::Ssd {
                store,
                offsets,
                failed,
                ..
            } => {
                let Some(&base) = offsets.get(head).and_then(|o| o.get(tile)) else {
                    return Fetched::Failed;
                };
                if *failed {
                    return Fetched::Failed;
                }
                let at = UnitRef {
                    offset: base + (group * ub) as u64,
                    len: ub as u32,
                };
                // The store appends (the weight engine gathers units back to back); a KV
                // fetch replaces, as the RAM arm does.
                out.clear();
                store.fetch(self.key(head, tile, group), at, out)
            }
        }
    }

    /// Forgets every unit (a cleared cache reuses the tier).
    pub fn clear(&mut self) {
        let warn = Arc::clone(&self.warn);
        let unit_bytes = self.unit_bytes;
        match &mut self.kind {
            Kind::Ram { units } => units.iter_mut().for_each(Vec::clear),
            Kind::Ssd {
                file,
                sums,
                store,
                offsets,
                next,
                failed,
                dir,
                budget,
                policy,
            } => {
                // A new file and store: cached or in-flight units of the old session must not
                // be served under reused keys.
                match spill_file(dir) {
                    Ok(f) => {
                        *file = Arc::new(f);
                        *failed = false;
                    }
                    Err(e) => {
                        *failed = true;
                        warn(&format!(
                            "warning: new KV spill file failed ({e}); KV refinement disabled"
                        ));
                    }
                }
                *sums = SpillSums::new(unit_bytes);
                *store = ssd_store(file, sums, *budget, *policy, &warn, self.wrap.as_ref());
                offsets.iter_mut().for_each(Vec::clear);
                *next = 0;
            }
        }
    }

    /// Drops the units of tiles `n_tiles..` of stream `head`.
    pub fn truncate_tiles(&mut self, head: usize, n_tiles: usize) {
        let len = n_tiles * self.per_tile * self.unit_bytes;
        match &mut self.kind {
            Kind::Ram { units } => units[head].truncate(len),
            Kind::Ssd { offsets, .. } => offsets[head].truncate(n_tiles),
        }
    }

    pub fn bytes(&self) -> TierBytes {
        match &self.kind {
            Kind::Ram { units } => TierBytes {
                backing: units.iter().map(|u| u.len() as u64).sum(),
                ..TierBytes::default()
            },
            Kind::Ssd { store, offsets, .. } => {
                let s = store.stats();
                let tiles: usize = offsets.iter().map(Vec::len).sum();
                TierBytes {
                    backing: (tiles * self.per_tile * self.unit_bytes) as u64,
                    cache: s.cache_bytes,
                    cache_peak: s.cache_peak_bytes,
                    cache_budget: store.cache_budget_bytes(),
                }
            }
        }
    }

    /// Cache statistics of the SSD tier (`None` for RAM).
    pub fn store_stats(&self) -> Option<StoreStats> {
        match &self.kind {
            Kind::Ram { .. } => None,
            Kind::Ssd { store, .. } => Some(store.stats()),
        }
    }

    pub fn reset_stats(&self) {
        if let Kind::Ssd { store, .. } = &self.kind {
            store.reset_stats();
        }
    }

    /// Waits for background loads (tests and end-of-run accounting).
    pub fn wait_idle(&self, timeout: std::time::Duration) -> bool {
        match &self.kind {
            Kind::Ram { .. } => true,
            Kind::Ssd { store, .. } => store.wait_idle(timeout),
        }
    }
}

//! Opening a container's refinement for a run: verify, pick the tier, build the engine — or
//! degrade to resident precision with one warning when the refinement cannot be trusted.

use super::engine::{RefineSettings, RefinementPlan, Refiner};
use super::plan::file_settings;
use super::store::{MissPolicy, RamStore, RefinementStore, SsdStore};
use crate::backend::Backend;
use crate::error::{Result, RuntimeError};
use sfx_formats::sfx::{SfxFile, Tier};
use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

/// Where refinement units are read from at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TierChoice {
    /// The tier the converter recorded for the sections.
    AsStored,
    Ram,
    Ssd,
}

#[derive(Debug, Clone)]
pub struct RefineOpenOptions {
    pub tier: TierChoice,
    /// SSD tier: RAM cache budget shared by all projection sets.
    pub cache_bytes: u64,
    pub miss: MissPolicy,
    pub loader_threads: usize,
    /// RAM tier: pin the refinement sections in memory.
    pub mlock: bool,
    /// Check the refinement sections' SHA-256 before using them.
    pub verify: bool,
    /// RAM tier: run the engine in the backend ([`Refiner::place_in_backend`]: the columns
    /// copied once into host memory the device reads) — `None` takes the backend's
    /// preference ([`Backend::refinement_in_backend`]). Settings the backend path does not
    /// cover (lead/lag, bundles) stay host-driven, with a note through `warn`.
    pub in_backend: Option<bool>,
}

impl Default for RefineOpenOptions {
    fn default() -> Self {
        Self {
            tier: TierChoice::AsStored,
            cache_bytes: 128 << 20,
            miss: MissPolicy::Skip,
            loader_threads: 2,
            mlock: false,
            verify: true,
            in_backend: None,
        }
    }
}

/// Builds the refinement engine for `file` (opened from `path`) from its `plan`
/// ([`plan_from_sfx`](super::plan_from_sfx)). `settings` overrides the file's budgets. Returns `Ok(None)` when the file has no refinement, and also — after one
/// warning through `warn` — when its refinement fails its checksum or cannot be opened: the
/// model then runs at resident precision instead of producing silently wrong output. Malformed
/// refinement sections (shapes, layouts) are errors.
pub fn open_refinement<B: Backend>(
    backend: &B,
    file: &SfxFile,
    path: &Path,
    plan: RefinementPlan,
    settings: Option<RefineSettings>,
    options: &RefineOpenOptions,
    warn: &dyn Fn(&str),
) -> Result<Option<Refiner<B>>> {
    let has_any = plan
        .layers
        .iter()
        .any(|l| l.sets.iter().any(|s| !s.is_empty()) || l.bundles.is_some());
    if !has_any {
        return Ok(None);
    }
    let backing = |s: &sfx_formats::sfx::SectionView<'_>| s.tier != Tier::Resident;
    if options.verify {
        if let Err(e) = file.verify_where(backing) {
            warn(&format!(
                "warning: refinement disabled, running at resident precision: {e}"
            ));
            return Ok(None);
        }
    }
    let stored_ssd = file.sections().any(|s| s.tier == Tier::Ssd);
    let use_ssd = match options.tier {
        TierChoice::AsStored => stored_ssd,
        TierChoice::Ram => false,
        TierChoice::Ssd => true,
    };
    let settings = settings.unwrap_or_else(|| file_settings(file, &plan));
    // The ram tier's map, kept to copy its columns from if the engine runs in the backend.
    let mut placement: Option<Arc<RamStore>> = None;
    let store: Arc<dyn RefinementStore> = if use_ssd {
        match SsdStore::open(
            path,
            options.cache_bytes,
            options.miss,
            options.loader_threads,
        ) {
            Ok(s) => Arc::new(s),
            Err(e) => {
                warn(&format!(
                    "warning: refinement disabled, running at resident precision: cannot open {} for the ssd tier: {e}",
                    path.display()
                ));
                return Ok(None);
            }
        }
    } else {
        match RamStore::open(path) {
            Ok(mut s) => {
                if options.mlock {
                    let ranges: Vec<(u64, u64)> = file
                        .sections()
                        .filter(|v| backing(v))
                        .map(|v| (v.offset, v.bytes.len() as u64))
                        .collect();
                    s.lock(&ranges);
                }
                let s = Arc::new(s);
                placement = Some(s.clone());
                s
            }
            Err(e) => {
                warn(&format!(
                    "warning: refinement disabled, running at resident precision: cannot map {}: {e}",
                    path.display()
                ));
                return Ok(None);
            }
        }
    };
    let mut r = Refiner::new(plan, store, settings)?;
    let in_backend = options
        .in_backend
        .unwrap_or_else(|| backend.refinement_in_backend());
    if let Some(ram) = placement.filter(|_| in_backend) {
        match r.backend_blocker() {
            None => r.place_in_backend(backend, |src| {
                let len = src.inp * src.unit_bytes;
                ram.bytes(src.offset, len)
                    .map(Cow::Borrowed)
                    .ok_or_else(|| {
                        RuntimeError::Config(format!(
                            "{}: refinement columns at byte {} ({len} bytes) lie past the end of \
                         the file",
                            path.display(),
                            src.offset
                        ))
                    })
            })?,
            Some(why) => warn(&format!(
                "note: refinement runs host-driven on {}: {why}",
                backend.name()
            )),
        }
    }
    Ok(Some(r))
}

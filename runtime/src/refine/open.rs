//! Opening a container's refinement for a run: verify, pick the tier, build the engine — or
//! degrade to resident precision with one warning when the refinement cannot be trusted.

use super::engine::{RefineSettings, RefinementPlan, Refiner};
use super::plan::file_settings;
use super::store::{
    MissPolicy, RamStore, RefinementStore, SsdOptions, SsdStore, UnitChecksums, UnitReader,
};
use crate::backend::Backend;
use crate::error::{Result, RuntimeError};
use sfx_formats::sfx::{SfxFile, Tier};
use std::borrow::Cow;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

/// A handle on the inode `file` was mapped from (a path renamed over since would be another
/// file, whose bytes were never verified), or the path opened for a file read from memory.
fn backing_file(file: &SfxFile, path: &Path) -> std::io::Result<File> {
    match file.file() {
        Some(f) => f.try_clone(),
        None => File::open(path),
    }
}

/// The CRC-32 of every unit the plan can fetch (columns and neuron bundles), taken from the
/// mapped file's bytes: the ssd tier checks each unit it reads back against them.
/// [`open_refinement`] computes them right after the sections' SHA-256 was verified (when
/// `verify` is on), from the same map.
pub fn unit_checksums(file: &SfxFile, plan: &RefinementPlan) -> Result<UnitChecksums> {
    let mut sections: Vec<(u64, &[u8])> = file
        .sections()
        .filter(|s| s.tier != Tier::Resident)
        .map(|s| (s.offset, s.bytes))
        .collect();
    sections.sort_by_key(|&(o, _)| o);
    let bytes_at = |offset: u64, len: usize| -> Option<&[u8]> {
        let i = sections
            .partition_point(|&(o, _)| o <= offset)
            .checked_sub(1)?;
        let (o, b) = sections[i];
        let start = usize::try_from(offset - o).ok()?;
        b.get(start..start.checked_add(len)?)
    };
    let region = |offset: u64, unit: usize, units: usize| -> Result<(u64, u32, &[u8])> {
        let outside = || {
            RuntimeError::Config(format!(
                "{}: refinement units at byte {offset} ({units} of {unit} bytes) are not inside \
                 a refinement section",
                file.path().display()
            ))
        };
        let len = unit.checked_mul(units).ok_or_else(outside)?;
        let bytes = bytes_at(offset, len).ok_or_else(outside)?;
        Ok((offset, u32::try_from(unit).map_err(|_| outside())?, bytes))
    };
    let mut regions = Vec::new();
    for layer in &plan.layers {
        for src in layer.sets.iter().flatten() {
            regions.push(region(src.offset, src.unit_bytes, src.inp)?);
        }
        if let Some(b) = &layer.bundles {
            regions.push(region(b.offset, b.unit_bytes(), b.neurons)?);
        }
    }
    UnitChecksums::from_regions(regions)
        .map_err(|m| RuntimeError::Config(format!("{}: {m}", file.path().display())))
}

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
        let check = Arc::new(unit_checksums(file, &plan)?);
        match backing_file(file, path) {
            Ok(f) => Arc::new(SsdStore::with_options(
                Arc::new(f) as Arc<dyn UnitReader>,
                SsdOptions {
                    cache_budget_bytes: options.cache_bytes,
                    policy: options.miss,
                    loader_threads: options.loader_threads,
                    source: path.display().to_string(),
                    check: Some(check),
                    ..SsdOptions::default()
                },
            )),
            Err(e) => {
                warn(&format!(
                    "warning: refinement disabled, running at resident precision: cannot open {} for the ssd tier: {e}",
                    path.display()
                ));
                return Ok(None);
            }
        }
    } else {
        match backing_file(file, path)
            .and_then(|f| RamStore::from_file(f, path.display().to_string()))
        {
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

//! Tuning profiles: what `sfx tune` chose for a model file on a machine, per slowdown budget
//! (docs/format.md, "Tuning profiles").
//!
//! A profile lives in a JSON sidecar next to the model (`model.sfx.tune.json`), not inside the
//! `.sfx`: the container stays byte-identical to what the converter wrote (its checksums and
//! any published hash keep holding), and tuning on a second machine adds an entry instead of
//! rewriting gigabytes. The sidecar names the container it was measured with by
//! [`SfxFile::content_digest`](crate::sfx::SfxFile::content_digest), so a profile is never
//! applied to another file. Writes are atomic.

use crate::error::FormatError;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The `format` field of a sidecar.
pub const TUNE_FORMAT: &str = "sfx-tune-profile";
/// Version this build writes and reads.
pub const TUNE_VERSION: u32 = 1;
/// Largest sidecar read (a profile is a few KiB per machine).
const MAX_SIDECAR_BYTES: u64 = 16 << 20;

/// The sidecar of a model file: `{path}.tune.json`.
pub fn sidecar_path(model: &Path) -> PathBuf {
    let mut name = model.as_os_str().to_owned();
    name.push(".tune.json");
    PathBuf::from(name)
}

/// The machine a profile was measured on. Two runs match when device and description do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    /// `cpu` or `cuda`.
    pub device: String,
    /// The processor (CPU model name) or GPU name, with the host's CPU for a GPU.
    pub description: String,
    /// Threads the CPU backend ran with (a CPU profile is only valid at that count).
    pub threads: usize,
}

/// One budget's choice and what was measured for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BudgetProfile {
    /// Allowed slowdown against the resident base, as a fraction (0.05 = 5 %).
    pub budget: f64,
    /// Budgets k per 1024 channels per set (qkv, o, gu, d); all 0: nothing fits.
    pub k: [usize; 4],
    /// Fetch lead (qkv, gu) / lag (o, d) per set, in blocks.
    pub s: [f32; 4],
    /// `channels` or `bundles`.
    pub mlp: String,
    /// Neurons per 1024 under bundles.
    pub bundle_k: usize,
    /// The slowdown the search measured, the measurement that confirmed it, and a fresh
    /// measurement after the search.
    pub slowdown: f64,
    pub confirmed_slowdown: f64,
    pub remeasured_slowdown: f64,
    /// Mean KL to the float model and PPL on the tuning text; `None` when nothing fits the
    /// budget (JSON has no NaN: it would be written as null and not read back as a number).
    pub kl: Option<f64>,
    pub ppl: Option<f64>,
    /// Refinement bytes a decoded token fetched.
    pub fetched_bytes_per_token: f64,
}

/// Everything one `sfx tune` run measured on one machine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MachineProfiles {
    pub machine: Machine,
    /// Tier the refinement was read from (`ram`, `ssd`).
    pub tier: String,
    /// UTC time of the run (RFC 3339).
    pub measured_at: String,
    /// Resident base decode speed, tokens/s.
    pub base_tokens_per_s: f64,
    /// Rate the refinement units were read at in the largest measured configuration, GB/s.
    pub refine_read_gbps: f64,
    /// Text the KL was measured on, and scored tokens.
    pub text: String,
    pub scored_tokens: u64,
    /// The float model the KL is to.
    pub reference: String,
    /// Where the speed was measured when not on this file's model: a synthetic model of
    /// another architecture in the file's formats (`sfx tune --speed-model`), e.g.
    /// `llama-3.1-8b (synthetic, 3-bit g128, 8-bit g128 head)`. Such an entry says what this machine
    /// affords that model; `sfx-run` never applies it to this file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speed_model: Option<String>,
    pub profiles: Vec<BudgetProfile>,
}

/// A sidecar: every machine's profiles for one container.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TuneFile {
    pub format: String,
    pub version: u32,
    /// [`SfxFile::content_digest`](crate::sfx::SfxFile::content_digest) of the container.
    pub model_digest: String,
    pub machines: Vec<MachineProfiles>,
}

impl TuneFile {
    pub fn new(model_digest: String) -> Self {
        Self {
            format: TUNE_FORMAT.into(),
            version: TUNE_VERSION,
            model_digest,
            machines: Vec::new(),
        }
    }

    /// Reads and checks a sidecar: format, version, and that it belongs to `model_digest`.
    /// `Ok(None)` when there is none.
    pub fn read(path: &Path, model_digest: &str) -> Result<Option<Self>, FormatError> {
        let bad = |msg: String| FormatError::invalid(path, msg);
        let len = match std::fs::metadata(path) {
            Ok(m) => m.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(FormatError::io(path, e)),
        };
        if len > MAX_SIDECAR_BYTES {
            return Err(bad(format!(
                "{len} bytes: larger than any tuning profile ({MAX_SIDECAR_BYTES} at most)"
            )));
        }
        let bytes = std::fs::read(path).map_err(|e| FormatError::io(path, e))?;
        let file: TuneFile = serde_json::from_slice(&bytes)
            .map_err(|e| bad(format!("not a tuning profile: {e}")))?;
        if file.format != TUNE_FORMAT {
            return Err(bad(format!(
                "field 'format' is {:?}, expected {TUNE_FORMAT:?}",
                file.format
            )));
        }
        if file.version != TUNE_VERSION {
            return Err(bad(format!(
                "field 'version' is {}, this build reads {TUNE_VERSION}",
                file.version
            )));
        }
        if file.model_digest != model_digest {
            return Err(bad(format!(
                "field 'model_digest' is {}, but the model file's is {model_digest}: the profile \
                 was tuned for another file (re-run sfx tune)",
                file.model_digest
            )));
        }
        for m in &file.machines {
            for p in &m.profiles {
                if !(p.budget.is_finite() && p.budget >= 0.0) || p.k.iter().any(|&k| k > 1024) {
                    return Err(bad(format!(
                        "machine {:?}: a profile with budget {} and k {:?} is out of range",
                        m.machine.description, p.budget, p.k
                    )));
                }
            }
        }
        Ok(Some(file))
    }

    /// Replaces the entry of the same machine, tier and speed model (or adds one).
    pub fn put(&mut self, entry: MachineProfiles) {
        self.machines.retain(|m| {
            !(m.machine == entry.machine
                && m.tier == entry.tier
                && m.speed_model == entry.speed_model)
        });
        self.machines.push(entry);
    }

    /// The entry measured on `machine` (any tier when `tier` is `None`), else one measured on
    /// another machine of the same device kind (the caller says so). Entries whose speed was
    /// measured on another model ([`MachineProfiles::speed_model`]) are never returned.
    pub fn for_machine(
        &self,
        machine: &Machine,
        tier: Option<&str>,
    ) -> Option<(&MachineProfiles, bool)> {
        let tier_ok =
            |m: &&MachineProfiles| m.speed_model.is_none() && tier.is_none_or(|t| m.tier == t);
        self.machines
            .iter()
            .filter(tier_ok)
            .find(|m| m.machine == *machine)
            .map(|m| (m, true))
            .or_else(|| {
                self.machines
                    .iter()
                    .filter(tier_ok)
                    .find(|m| m.machine.device == machine.device)
                    .map(|m| (m, false))
            })
    }

    /// Writes the sidecar atomically.
    pub fn write(&self, path: &Path) -> Result<(), FormatError> {
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| FormatError::invalid(path, e.to_string()))?;
        crate::atomic::write_atomic(path, text.as_bytes())
    }
}

impl BudgetProfile {
    /// The settings as `sfx-run` flags read: `("16,16,32,16", "0,0,0,0")` for k and s.
    pub fn k_and_s(&self) -> (String, String) {
        (
            self.k.map(|k| k.to_string()).join(","),
            self.s.map(|s| s.to_string()).join(","),
        )
    }
}

impl MachineProfiles {
    /// The profile of `budget` (a fraction), exactly or within 1e-9.
    pub fn budget(&self, budget: f64) -> Option<&BudgetProfile> {
        self.profiles
            .iter()
            .find(|p| (p.budget - budget).abs() < 1e-9)
    }

    /// What `sfx-run` applies when no budget is asked for: 5 % (the method's usual operating
    /// point) when tuned, else the smallest budget tuned.
    pub fn default_profile(&self) -> Option<&BudgetProfile> {
        self.budget(0.05).or_else(|| {
            self.profiles
                .iter()
                .min_by(|a, b| a.budget.total_cmp(&b.budget))
        })
    }
}

/// Parses "5%", "2.5 %", "0.05" into a fraction; `None` for anything else or a negative
/// or non-finite value.
pub fn parse_budget(s: &str) -> Option<f64> {
    let t = s.trim();
    let v = match t.strip_suffix('%') {
        Some(p) => p.trim().parse::<f64>().ok()? / 100.0,
        None => t.parse::<f64>().ok()?,
    };
    (v.is_finite() && v >= 0.0).then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine(desc: &str) -> Machine {
        Machine {
            device: "cpu".into(),
            description: desc.into(),
            threads: 2,
        }
    }

    fn entry(desc: &str, budgets: &[f64]) -> MachineProfiles {
        MachineProfiles {
            machine: machine(desc),
            tier: "ram".into(),
            measured_at: "2026-12-04T00:00:00Z".into(),
            base_tokens_per_s: 50.0,
            refine_read_gbps: 1.0,
            text: "austen/persuasion:4".into(),
            scored_tokens: 100,
            reference: "smol-bf16".into(),
            speed_model: None,
            profiles: budgets
                .iter()
                .map(|&b| BudgetProfile {
                    budget: b,
                    k: [16; 4],
                    s: [0.0; 4],
                    mlp: "channels".into(),
                    bundle_k: 12,
                    slowdown: b / 2.0,
                    confirmed_slowdown: b / 2.0,
                    remeasured_slowdown: b / 2.0,
                    kl: Some(0.5),
                    ppl: Some(20.0),
                    fetched_bytes_per_token: 1e5,
                })
                .collect(),
        }
    }

    #[test]
    fn sidecar_round_trips_and_rejects_another_model() {
        let dir = tempfile::tempdir().unwrap();
        let path = sidecar_path(&dir.path().join("m.sfx"));
        assert!(path.to_string_lossy().ends_with("m.sfx.tune.json"));
        assert!(TuneFile::read(&path, "abc").unwrap().is_none());
        let mut f = TuneFile::new("abc".into());
        f.put(entry("cpu A", &[0.05, 0.1]));
        f.put(entry("cpu B", &[0.2]));
        f.put(entry("cpu A", &[0.025]));
        assert_eq!(f.machines.len(), 2, "same machine and tier replaced");
        f.write(&path).unwrap();
        let back = TuneFile::read(&path, "abc").unwrap().unwrap();
        assert_eq!(back, f);
        let e = TuneFile::read(&path, "xyz").unwrap_err().to_string();
        assert!(
            e.contains("model_digest") && e.contains("another file"),
            "{e}"
        );

        let (m, exact) = back.for_machine(&machine("cpu B"), None).unwrap();
        assert!(exact && m.machine.description == "cpu B");
        let (_, exact) = back.for_machine(&machine("cpu C"), None).unwrap();
        assert!(!exact, "another machine of the same kind is a fallback");
        let gpu = Machine {
            device: "cuda".into(),
            ..machine("H200")
        };
        assert!(back.for_machine(&gpu, None).is_none());
        assert!(back.for_machine(&machine("cpu A"), Some("ssd")).is_none());
    }

    /// An entry timed on another model sits beside this machine's own, is kept apart by
    /// `put`, reads back, and is never what `sfx-run` applies.
    #[test]
    fn an_entry_timed_on_another_model_is_listed_not_applied() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.sfx.tune.json");
        let mut f = TuneFile::new("abc".into());
        let mut proxy = entry("cpu A", &[0.05]);
        proxy.speed_model = Some("llama-3.1-8b (synthetic, rtn3 g128, q8 head)".into());
        f.put(proxy.clone());
        assert!(f.for_machine(&machine("cpu A"), None).is_none());
        f.put(entry("cpu A", &[0.1]));
        f.put(proxy);
        assert_eq!(f.machines.len(), 2);
        let (m, exact) = f.for_machine(&machine("cpu A"), None).unwrap();
        assert!(exact && m.speed_model.is_none() && m.budget(0.1).is_some());
        f.write(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.matches("speed_model").count(), 1, "{text}");
        assert_eq!(TuneFile::read(&path, "abc").unwrap().unwrap(), f);
    }

    #[test]
    fn a_budget_nothing_fits_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.sfx.tune.json");
        let mut m = entry("a", &[0.025, 0.05]);
        m.profiles[0].k = [0; 4];
        m.profiles[0].kl = None;
        m.profiles[0].ppl = None;
        let mut f = TuneFile::new("d".into());
        f.put(m);
        f.write(&path).unwrap();
        let back = TuneFile::read(&path, "d").unwrap().unwrap();
        assert_eq!(back, f);
        assert_eq!(back.machines[0].profiles[0].kl, None);
    }

    #[test]
    fn default_profile_is_five_percent_or_the_smallest() {
        assert_eq!(
            entry("a", &[0.1, 0.05, 0.2])
                .default_profile()
                .unwrap()
                .budget,
            0.05
        );
        assert_eq!(
            entry("a", &[0.1, 0.025]).default_profile().unwrap().budget,
            0.025
        );
        assert!(entry("a", &[]).default_profile().is_none());
    }

    #[test]
    fn bad_sidecars_name_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.tune.json");
        let mut f = TuneFile::new("d".into());
        f.version = 99;
        f.write(&path).unwrap();
        let e = TuneFile::read(&path, "d").unwrap_err().to_string();
        assert!(e.contains("'version'"), "{e}");
        std::fs::write(&path, b"{\"format\": 3}").unwrap();
        let e = TuneFile::read(&path, "d").unwrap_err().to_string();
        assert!(e.contains("not a tuning profile"), "{e}");
        let mut f = TuneFile::new("d".into());
        let mut m = entry("a", &[0.05]);
        m.profiles[0].k = [2000, 0, 0, 0];
        f.put(m);
        f.write(&path).unwrap();
        let e = TuneFile::read(&path, "d").unwrap_err().to_string();
        assert!(e.contains("out of range"), "{e}");
    }

    #[test]
    fn budgets_parse_as_fractions() {
        assert_eq!(parse_budget("5%"), Some(0.05));
        assert_eq!(parse_budget(" 2.5 % "), Some(0.025));
        assert_eq!(parse_budget("0.1"), Some(0.1));
        assert_eq!(parse_budget("-1%"), None);
        assert_eq!(parse_budget("five"), None);
        assert_eq!(parse_budget("nan"), None);
    }
}

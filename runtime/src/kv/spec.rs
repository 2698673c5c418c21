//! What a quantized KV cache is built from: the resident base, sink tokens and the refinement
//! settings, parsed from the command line forms (`--kv 2/2 --kv-refine +4/+4 --kv-group 2
//! --kv-fraction 1/128 --kv-tier ssd --kv-cache 128MiB --kv-miss skip`).

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use super::base::{KvBase, KvBits, RefineBits};
use super::kvarn::Kvarn;
use crate::refine::MissPolicy;

/// Resident KV format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvBaseChoice {
    /// Every position in FP16 (the reference the quantized bases are measured against).
    F16,
    /// KVarN with these key/value bits.
    Kvarn(KvBits),
}

impl fmt::Display for KvBaseChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvBaseChoice::F16 => f.write_str("f16"),
            KvBaseChoice::Kvarn(b) => write!(f, "{b}"),
        }
    }
}

impl FromStr for KvBaseChoice {
    type Err = String;
    /// `f16`, or KVarN `K/V` bits (`2/2`, `3/2`, `3/3`, `2/1`, …; `kvarn:2/2` also accepted).
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("f16") || t.eq_ignore_ascii_case("fp16") {
            return Ok(KvBaseChoice::F16);
        }
        let t = t.strip_prefix("kvarn:").unwrap_or(t);
        t.parse::<KvBits>()
            .map(KvBaseChoice::Kvarn)
            .map_err(|e| format!("--kv {e} (or f16)"))
    }
}

impl KvBaseChoice {
    /// The tile codec for `head_dim`, `None` for FP16.
    pub fn build(self, head_dim: usize) -> Result<Option<Arc<dyn KvBase>>, String> {
        match self {
            KvBaseChoice::F16 => Ok(None),
            KvBaseChoice::Kvarn(bits) => Ok(Some(Arc::new(Kvarn::new(bits, head_dim)?))),
        }
    }

    /// Refinement bits used when none are given: +4/+4, except values-only +0/+1 for the
    /// 1-bit-value base (paper App. C.5: lowest KL at matched payload for 2/1).
    pub fn default_refine_bits(self) -> RefineBits {
        match self {
            KvBaseChoice::Kvarn(KvBits { value: 1, .. }) => RefineBits { key: 0, value: 1 },
            _ => RefineBits { key: 4, value: 4 },
        }
    }
}

/// Where refinement bits live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvTierConfig {
    /// In process memory (host RAM; a GPU reads it zero-copy).
    Ram,
    /// Device memory beside the tiles (a backend cache only; the host cache keeps it in RAM):
    /// a step's selected units are read at device-memory latency instead of over the bus.
    Device,
    /// A per-session spill file in `dir` (deleted on close) behind a RAM cache of
    /// `cache_budget` bytes shared by all layers and heads.
    Ssd {
        dir: PathBuf,
        cache_budget: u64,
        policy: MissPolicy,
    },
}

/// Nested refinement settings.
#[derive(Clone, Debug, PartialEq)]
pub struct KvRefineConfig {
    pub bits: RefineBits,
    /// Consecutive tokens of one KV head stored and selected together (2 or 4).
    pub group: usize,
    /// Fraction of the eligible (encoded) groups per KV head refined each step.
    pub fraction: f64,
    pub tier: KvTierConfig,
}

impl KvRefineConfig {
    /// Bytes of one refinement unit (a group's key then value sub-interval indices, one bit
    /// stream) and units per tile, for tiles of `tile` tokens of `head_dim`; the group must
    /// divide the tile.
    pub fn unit_layout(&self, tile: usize, head_dim: usize) -> Result<(usize, usize), String> {
        if self.group == 0 || !tile.is_multiple_of(self.group) {
            return Err(format!(
                "token group {} must divide the tile of {tile} tokens",
                self.group
            ));
        }
        let unit =
            super::bitpack::packed_len(self.group * head_dim, self.bits.key + self.bits.value);
        Ok((unit, tile / self.group))
    }
}

/// A quantized KV cache configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct KvConfig {
    pub base: KvBaseChoice,
    /// Leading positions kept in FP16 (attention sinks).
    pub sinks: usize,
    pub refine: Option<KvRefineConfig>,
}

impl KvConfig {
    /// Base only, 128 FP16 sinks.
    pub fn base(base: KvBaseChoice) -> Self {
        KvConfig {
            base,
            sinks: 128,
            refine: None,
        }
    }

    /// Short label for reports, e.g. `2/2`, `2/2 +4/+4 g2 1/128 ram`.
    pub fn label(&self) -> String {
        match &self.refine {
            None => self.base.to_string(),
            Some(r) => {
                let tier = match &r.tier {
                    KvTierConfig::Ram => "ram".to_string(),
                    KvTierConfig::Device => "vram".to_string(),
                    KvTierConfig::Ssd {
                        cache_budget,
                        policy,
                        ..
                    } if cache_budget % (1 << 20) == 0 => {
                        format!("ssd {} MiB {policy}", cache_budget >> 20)
                    }
                    KvTierConfig::Ssd {
                        cache_budget,
                        policy,
                        ..
                    } => format!("ssd {} KiB {policy}", cache_budget >> 10),
                };
                format!(
                    "{} {} g{} {} {tier}",
                    self.base,
                    r.bits,
                    r.group,
                    fraction_label(r.fraction)
                )
            }
        }
    }
}

/// `1/128` for 0.0078125; decimal otherwise.
pub fn fraction_label(f: f64) -> String {
    if f > 0.0 {
        let inv = 1.0 / f;
        if (inv - inv.round()).abs() < 1e-9 {
            return format!("1/{}", inv.round() as u64);
        }
    }
    format!("{f}")
}

/// Parses `1/128`, `0.01` or `1%` into a fraction in (0, 1].
pub fn parse_fraction(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let v = if let Some((a, b)) = t.split_once('/') {
        let a: f64 = a
            .trim()
            .parse()
            .map_err(|_| format!("fraction '{s}': '{a}' is not a number"))?;
        let b: f64 = b
            .trim()
            .parse()
            .map_err(|_| format!("fraction '{s}': '{b}' is not a number"))?;
        a / b
    } else if let Some(p) = t.strip_suffix('%') {
        p.trim()
            .parse::<f64>()
            .map_err(|_| format!("fraction '{s}' is not a percentage"))?
            / 100.0
    } else {
        t.parse()
            .map_err(|_| format!("fraction '{s}': expected 1/128, 0.01 or 1%"))?
    };
    if v.is_finite() && v > 0.0 && v <= 1.0 {
        Ok(v)
    } else {
        Err(format!("fraction '{s}' must be in (0, 1]"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_bases_and_fractions() {
        assert_eq!("f16".parse::<KvBaseChoice>(), Ok(KvBaseChoice::F16));
        assert_eq!(
            "3/2".parse::<KvBaseChoice>(),
            Ok(KvBaseChoice::Kvarn(KvBits { key: 3, value: 2 }))
        );
        assert!("9/2".parse::<KvBaseChoice>().is_err());
        assert!("2".parse::<KvBaseChoice>().is_err());
        assert_eq!(parse_fraction("1/128"), Ok(1.0 / 128.0));
        assert_eq!(parse_fraction("1%"), Ok(0.01));
        assert!(parse_fraction("0").is_err());
        assert!(parse_fraction("2").is_err());
        assert_eq!(fraction_label(1.0 / 64.0), "1/64");
        assert_eq!(
            "+0/+1".parse::<RefineBits>(),
            Ok(RefineBits { key: 0, value: 1 })
        );
        assert_eq!(
            KvBaseChoice::Kvarn(KvBits { key: 2, value: 1 }).default_refine_bits(),
            RefineBits { key: 0, value: 1 }
        );
    }
}

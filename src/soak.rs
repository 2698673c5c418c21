//! `sfx-run --soak`: many tokens in one process, sampled for memory and speed.
//!
//! A soak generates back-to-back generations (each from the same prompt in a fresh KV cache,
//! sampling, end-of-sequence ignored) until the total is reached, and every `every` tokens
//! records the process's resident memory, the decode speed over the interval, and the
//! occupancy of the bounded caches (the refinement store's RAM cache on the ssd tier, the KV
//! refinement spill cache). A long run is where leaks, caches that outgrow their budgets and
//! slow drifts show; one generation cannot be longer than the model's context, hence the
//! repetition. What it asserts (the verdict): resident memory at each sampled position of a
//! generation does not exceed the same position's in the second generation (the first one
//! warms up) by more than [`RSS_GROWTH_ALLOWED`] — like positions, because a KV cache's pages
//! are touched as it fills, so memory rises within every generation and falls when its cache
//! is freed — and no cache holds more than its budget. On a device with memory of its own (a
//! GPU) the device memory in use is judged by the same rule, since a leak of device buffers
//! never shows in the process's resident set. Speed drift is reported, not judged: a
//! shared machine's noise is larger than any fair bound.

use anyhow::{Context, Result};
use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;

/// RSS growth a soak tolerates against its second generation at like positions: allocator
/// arenas and lazily touched pages of the mapped model settle within a few MB; a leak of a
/// kilobyte a token exceeds this within 20,000 tokens.
pub const RSS_GROWTH_ALLOWED: u64 = 16 << 20;

/// One sample, taken after `tokens` generated tokens in all.
#[derive(Clone, Debug, Serialize)]
pub struct SoakSample {
    pub tokens: usize,
    /// Generation index (0-based) and decode position within it when sampled.
    pub generation: usize,
    pub position: usize,
    /// Decode steps per second since the previous sample (prefills excluded).
    pub tokens_per_second: f64,
    pub rss_bytes: u64,
    pub rss_peak_bytes: u64,
    /// Refinement store RAM cache (ssd tier): bytes held and the budget.
    pub weight_cache_bytes: Option<u64>,
    pub weight_cache_budget: Option<u64>,
    /// KV refinement spill cache (ssd tier): bytes held and the budget.
    pub kv_cache_bytes: Option<u64>,
    pub kv_cache_budget: Option<u64>,
    /// Device memory in use (the whole device's), on a backend with memory of its own.
    pub device_bytes: Option<u64>,
}

/// What a soak concludes from its samples.
#[derive(Clone, Debug, Serialize)]
pub struct SoakSummary {
    pub tokens: usize,
    pub generations: usize,
    pub samples: usize,
    /// The second generation's largest RSS (the reference: the first warms up), the largest
    /// and the last of the generations after it, and the growth: the largest excess of a later
    /// generation's RSS over the second's at the same position.
    pub rss_reference_bytes: u64,
    pub rss_max_bytes: u64,
    pub rss_last_bytes: u64,
    pub rss_growth_bytes: u64,
    /// The same for device memory, on a backend with memory of its own.
    pub device_reference_bytes: Option<u64>,
    pub device_max_bytes: Option<u64>,
    pub device_growth_bytes: Option<u64>,
    /// Mean decode speed of the first and the last complete generation (same positions, so
    /// attention's growth with context cancels), and their ratio − 1.
    pub first_generation_tokens_per_second: f64,
    pub last_generation_tokens_per_second: f64,
    pub speed_drift: f64,
    /// Largest cache occupancy seen against its budget (None: no such cache).
    pub weight_cache_max_bytes: Option<u64>,
    pub weight_cache_budget: Option<u64>,
    pub kv_cache_max_bytes: Option<u64>,
    pub kv_cache_budget: Option<u64>,
    /// Everything the verdict found wrong; empty when the soak passed.
    pub failures: Vec<String>,
}

/// Resident and peak resident memory of this process (`VmRSS`, `VmHWM` of /proc/self/status).
pub fn process_memory() -> Result<(u64, u64)> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    parse_status(&status).context("/proc/self/status has no VmRSS or VmHWM line")
}

fn parse_status(status: &str) -> Option<(u64, u64)> {
    let field = |name: &str| {
        status.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.trim();
            let kb: u64 = rest.strip_suffix("kB")?.trim().parse().ok()?;
            Some(kb * 1024)
        })
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// The verdict over `samples` of a soak of `generations` generations.
pub fn summarize(samples: &[SoakSample], generations: usize) -> SoakSummary {
    let tokens = samples.last().map_or(0, |s| s.tokens);
    let reference: Vec<&SoakSample> = samples.iter().filter(|s| s.generation == 1).collect();
    let later: Vec<&SoakSample> = samples.iter().filter(|s| s.generation >= 2).collect();
    let warm = reference.iter().map(|s| s.rss_bytes).max().unwrap_or(0);
    let rss_max = later.iter().map(|s| s.rss_bytes).max().unwrap_or(0);
    let rss_last = later.last().map_or(0, |s| s.rss_bytes);
    let growth = growth_at_like_positions(&reference, &later, |s| Some(s.rss_bytes)).unwrap_or(0);
    let device_growth = growth_at_like_positions(&reference, &later, |s| s.device_bytes);
    // Compare the last generation that reached the first one's last sampled position (a
    // soak's final generation may be cut short) at the positions both reached.
    let last_position = |g: usize| {
        samples
            .iter()
            .filter(|s| s.generation == g)
            .map(|s| s.position)
            .max()
    };
    let upto = last_position(0).unwrap_or(0);
    let last_g = (0..generations.max(1))
        .rev()
        .find(|&g| last_position(g) == Some(upto))
        .unwrap_or(0);
    let mean_speed = |g: usize| {
        let v: Vec<f64> = samples
            .iter()
            .filter(|s| s.generation == g && s.position <= upto)
            .map(|s| s.tokens_per_second)
            .collect();
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    let first = mean_speed(0);
    let last = mean_speed(last_g);
    let peak = |f: fn(&SoakSample) -> Option<u64>| samples.iter().filter_map(f).max();
    let budget = |f: fn(&SoakSample) -> Option<u64>| samples.iter().find_map(f);
    let mut s = SoakSummary {
        tokens,
        generations,
        samples: samples.len(),
        rss_reference_bytes: warm,
        rss_max_bytes: rss_max,
        rss_last_bytes: rss_last,
        rss_growth_bytes: growth,
        device_reference_bytes: reference.iter().filter_map(|s| s.device_bytes).max(),
        device_max_bytes: later.iter().filter_map(|s| s.device_bytes).max(),
        device_growth_bytes: device_growth,
        first_generation_tokens_per_second: first,
        last_generation_tokens_per_second: last,
        speed_drift: if first > 0.0 { last / first - 1.0 } else { 0.0 },
        weight_cache_max_bytes: peak(|s| s.weight_cache_bytes),
        weight_cache_budget: budget(|s| s.weight_cache_budget),
        kv_cache_max_bytes: peak(|s| s.kv_cache_bytes),
        kv_cache_budget: budget(|s| s.kv_cache_budget),
        failures: Vec::new(),
    };
    if later.is_empty() {
        s.failures.push(format!(
            "no sample in a third generation ({generations} generation(s)): memory is judged \
             against the second; give --soak more than twice -n tokens, and --soak-every fewer \
             than -n"
        ));
    }
    // Resident and device memory are judged by one rule; a backend without memory of its own
    // has no device figures to judge.
    let memories = [
        ("resident memory", Some((s.rss_growth_bytes, rss_max, warm))),
        (
            "device memory in use",
            s.device_growth_bytes.map(|g| {
                (
                    g,
                    s.device_max_bytes.unwrap_or(0),
                    s.device_reference_bytes.unwrap_or(0),
                )
            }),
        ),
    ];
    for (what, figures) in memories {
        if let Some((grew, largest, against)) = figures.filter(|f| f.0 > RSS_GROWTH_ALLOWED) {
            s.failures.push(format!(
                "{what} grew {:.1} MiB over the second generation's at the same position \
                 (largest {:.1} MiB against {:.1}; {} MiB allowed)",
                mib(grew),
                mib(largest),
                mib(against),
                RSS_GROWTH_ALLOWED >> 20
            ));
        }
    }
    for (what, held, cap) in [
        (
            "refinement RAM cache",
            s.weight_cache_max_bytes,
            s.weight_cache_budget,
        ),
        ("KV spill cache", s.kv_cache_max_bytes, s.kv_cache_budget),
    ] {
        if let (Some(h), Some(c)) = (held, cap) {
            if h > c {
                s.failures
                    .push(format!("the {what} held {h} bytes, over its budget of {c}"));
            }
        }
    }
    s
}

/// The largest excess of a later sample's value over the reference generation's at the same
/// position; `None` when no pair of samples has the value.
fn growth_at_like_positions(
    reference: &[&SoakSample],
    later: &[&SoakSample],
    value: impl Fn(&SoakSample) -> Option<u64>,
) -> Option<u64> {
    later
        .iter()
        .filter_map(|s| {
            let at = reference.iter().find(|r| r.position == s.position)?;
            Some(value(s)?.saturating_sub(value(at)?))
        })
        .max()
}

/// Bytes in MiB, for messages.
pub fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// The samples as CSV (one header line), written atomically.
pub fn write_csv(path: &Path, samples: &[SoakSample]) -> Result<()> {
    let mut out = String::from(
        "tokens,generation,position,tokens_per_second,rss_bytes,rss_peak_bytes,\
         weight_cache_bytes,weight_cache_budget,kv_cache_bytes,kv_cache_budget,device_bytes\n",
    );
    let opt = |v: Option<u64>| v.map_or_else(String::new, |v| v.to_string());
    for s in samples {
        // Writing to a String cannot fail.
        let _ = writeln!(
            out,
            "{},{},{},{:.3},{},{},{},{},{},{},{}",
            s.tokens,
            s.generation,
            s.position,
            s.tokens_per_second,
            s.rss_bytes,
            s.rss_peak_bytes,
            opt(s.weight_cache_bytes),
            opt(s.weight_cache_budget),
            opt(s.kv_cache_bytes),
            opt(s.kv_cache_budget),
            opt(s.device_bytes)
        );
    }
    sfx_formats::atomic::write_atomic(path, out.as_bytes())
        .with_context(|| format!("writing the soak log {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(tokens: usize, generation: usize, position: usize, tps: f64, rss: u64) -> SoakSample {
        SoakSample {
            tokens,
            generation,
            position,
            tokens_per_second: tps,
            rss_bytes: rss,
            rss_peak_bytes: rss,
            weight_cache_bytes: Some(900),
            weight_cache_budget: Some(1000),
            kv_cache_bytes: None,
            kv_cache_budget: None,
            device_bytes: None,
        }
    }

    #[test]
    fn reads_the_status_fields_in_bytes() {
        let status = "Name:\tsfx-run\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\nThreads:\t3\n";
        assert_eq!(parse_status(status), Some((100 << 20, 200 << 20)));
        assert_eq!(parse_status("VmRSS:\t1 kB\n"), None);
        assert!(process_memory().expect("this process's status").0 > 0);
    }

    #[test]
    fn flat_memory_passes_and_a_leak_or_an_overfull_cache_fails() {
        const MB: u64 = 1 << 20;
        let flat: Vec<SoakSample> = (0..3)
            .flat_map(|g| (1..=4).map(move |p| (g, p)))
            .map(|(g, p)| {
                sample(
                    g * 4 + p,
                    g,
                    p,
                    100.0 - p as f64,
                    500 * MB + (g as u64) * MB,
                )
            })
            .collect();
        let s = summarize(&flat, 3);
        assert!(s.failures.is_empty(), "{:?}", s.failures);
        assert_eq!(s.rss_growth_bytes, MB);

        // Memory rising within every generation (a KV cache filling) and falling back with the
        // next cache is not growth.
        let mut sawtooth = flat.clone();
        for x in sawtooth.iter_mut() {
            x.rss_bytes += 30 * MB * x.position as u64;
        }
        let s = summarize(&sawtooth, 3);
        assert!(s.failures.is_empty(), "{:?}", s.failures);
        assert_eq!(s.rss_growth_bytes, MB);
        assert_eq!(s.tokens, 12);
        assert!(s.speed_drift.abs() < 1e-12);

        // 20 MB more in the last generation: a leak.
        let mut leak = flat.clone();
        for x in leak.iter_mut().filter(|x| x.generation == 2) {
            x.rss_bytes += 20 * MB;
        }
        let s = summarize(&leak, 3);
        assert_eq!(s.failures.len(), 1, "{:?}", s.failures);
        assert!(s.failures[0].contains("resident memory grew"));

        let mut over = flat.clone();
        over[5].weight_cache_bytes = Some(1001);
        let s = summarize(&over, 3);
        assert_eq!(s.failures.len(), 1, "{:?}", s.failures);
        assert!(s.failures[0].contains("over its budget"));

        // Slower last generation at the same positions: drift reported, not failed.
        let mut slow = flat;
        for x in slow.iter_mut().filter(|x| x.generation == 2) {
            x.tokens_per_second /= 2.0;
        }
        let s = summarize(&slow, 3);
        assert!((s.speed_drift + 0.5).abs() < 1e-9, "{}", s.speed_drift);
        assert!(s.failures.is_empty());
    }

    #[test]
    fn device_memory_is_judged_like_resident_memory_where_a_backend_reports_it() {
        const MB: u64 = 1 << 20;
        let soak = |leak_per_generation: u64| -> Vec<SoakSample> {
            (0..4)
                .flat_map(|g| (1..=3).map(move |p| (g, p)))
                .map(|(g, p)| SoakSample {
                    device_bytes: Some(2000 * MB + g as u64 * leak_per_generation),
                    ..sample(g * 3 + p, g, p, 50.0, 400 * MB)
                })
                .collect()
        };
        let s = summarize(&soak(MB), 4);
        assert!(s.failures.is_empty(), "{:?}", s.failures);
        assert_eq!(s.device_growth_bytes, Some(2 * MB));
        assert_eq!(s.rss_growth_bytes, 0);
        // 10 MiB of device buffers kept per generation: 20 MiB by the last, over the bound,
        // while the resident set stays flat.
        let s = summarize(&soak(10 * MB), 4);
        assert_eq!(s.failures.len(), 1, "{:?}", s.failures);
        assert!(s.failures[0].starts_with("device memory in use grew 20.0 MiB"));
        // The CPU reports none: nothing judged, nothing failed.
        let cpu: Vec<SoakSample> = soak(10 * MB)
            .into_iter()
            .map(|x| SoakSample {
                device_bytes: None,
                ..x
            })
            .collect();
        let s = summarize(&cpu, 4);
        assert_eq!(s.device_growth_bytes, None);
        assert!(s.failures.is_empty(), "{:?}", s.failures);
    }

    #[test]
    fn a_soak_of_two_generations_says_what_to_change() {
        let two = [
            sample(4, 0, 4, 100.0, 1 << 20),
            sample(8, 1, 4, 100.0, 1 << 20),
        ];
        let s = summarize(&two, 2);
        assert!(s.failures[0].contains("no sample in a third generation"));
    }
}

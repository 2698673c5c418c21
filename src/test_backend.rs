//! `sfx test-backend`: the conformance suite as a product command, so a user can check their
//! GPU (every op against the CPU backend with its stated bound) or the CPU backend itself
//! (against plain f64 loops).

use crate::device::{with_backend, DeviceChoice, OnBackend, Resolved};
use anyhow::{bail, Result};
use sfx_runtime::conformance::{cases, run_case, CaseResult};
use sfx_runtime::resident::ResidentKernels;

pub struct TestArgs {
    pub device: DeviceChoice,
    /// Only ops whose name contains this.
    pub op: Option<String>,
    pub seed: Option<u64>,
    pub json: bool,
}

struct Task<'a> {
    args: &'a TestArgs,
    is_cpu: bool,
    seed: u64,
}

impl OnBackend for Task<'_> {
    type Output = Vec<CaseResult>;
    fn run<B: ResidentKernels>(self, backend: B) -> Result<Vec<CaseResult>> {
        let all = cases();
        let selected: Vec<_> = all
            .iter()
            .enumerate()
            .filter(|(_, c)| self.args.op.as_deref().is_none_or(|o| c.op.contains(o)))
            .collect();
        if selected.is_empty() {
            let mut ops: Vec<&str> = all.iter().map(|c| c.op).collect();
            ops.dedup();
            bail!(
                "--op {:?} matches no op; ops: {}",
                self.args.op.as_deref().unwrap_or(""),
                ops.join(", ")
            );
        }
        let mut out = Vec::new();
        for (i, c) in selected {
            let r = run_case(c, &backend, self.is_cpu, self.seed.wrapping_add(i as u64));
            if !self.args.json {
                print_row(&r);
            }
            out.push(r);
        }
        Ok(out)
    }
}

fn print_row(r: &CaseResult) {
    println!(
        "| {} | {} | {} | {:.2e} | {:.0e} | {} |",
        r.op,
        r.family,
        r.reference,
        r.error,
        r.bound,
        match (&r.failure, r.passed) {
            (Some(f), _) => format!("FAIL: {f}"),
            (None, true) => "ok".into(),
            (None, false) => "FAIL".into(),
        }
    );
}

pub fn run(args: TestArgs) -> Result<()> {
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    let resolved = args.device.resolve();
    let is_cpu = resolved == Resolved::Cpu;
    if !args.json {
        eprintln!(
            "conformance on {} against {} (seed {seed}; replay with --seed {seed})",
            if is_cpu { "the CPU backend" } else { "CUDA" },
            if is_cpu {
                "f64 reference loops"
            } else {
                "the CPU backend"
            },
        );
        println!("| op | shape family | reference | error | bound | result |");
        println!("| --- | --- | --- | ---: | ---: | --- |");
    }
    let results = with_backend(
        args.device,
        Task {
            args: &args,
            is_cpu,
            seed,
        },
    )?;
    let failed = results.iter().filter(|r| !r.passed).count();
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "seed": seed,
                "backend": results.first().map(|r| r.backend.clone()),
                "passed": results.len() - failed,
                "failed": failed,
                "cases": results,
            }))?
        );
    } else {
        eprintln!(
            "{} cases on {}: {} passed, {failed} failed",
            results.len(),
            results.first().map_or("?".into(), |r| r.backend.clone()),
            results.len() - failed
        );
    }
    if failed > 0 {
        bail!("{failed} conformance case(s) failed");
    }
    Ok(())
}

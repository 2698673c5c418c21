//! `sfx test-backend`: the conformance suite as a product command, so a user can check their
//! GPU (every op against the CPU backend with its stated bound) or the CPU backend itself
//! (against plain f64 loops).

use crate::device::{with_backend, DeviceChoice, OnBackend, Resolved};
use anyhow::{bail, Result};
use sfx_runtime::conformance::{cases, run_case, CaseResult};
use sfx_runtime::resident::ResidentKernels;

pub struct TestArgs {
    pub device: DeviceChoice,
    /// Only ops whose name contains one of these (all ops when empty).
    pub op: Vec<String>,
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
        // The suite checks the reference numerics: f32 activations on the CPU (the int8
        // decode kernels have their own cases in the runtime's backend_ops tests).
        let backend = backend.with_reference_numerics();
        let all = cases();
        let selected: Vec<_> = all
            .iter()
            .enumerate()
            .filter(|(_, c)| selects(&self.args.op, c.op))
            .collect();
        if selected.is_empty() {
            // Each op once, in the suite's order (cases of one op are not all adjacent).
            let mut ops: Vec<&str> = Vec::new();
            for c in &all {
                if !ops.contains(&c.op) {
                    ops.push(c.op);
                }
            }
            bail!(
                "--op {} matches no op; ops: {}",
                self.args
                    .op
                    .iter()
                    .map(|o| format!("{o:?}"))
                    .collect::<Vec<_>>()
                    .join(" / "),
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

/// Whether an op is selected by the `--op` filters: any of them is part of its name, or there
/// are none.
fn selects(filters: &[String], op: &str) -> bool {
    filters.is_empty() || filters.iter().any(|f| op.contains(f.as_str()))
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

#[cfg(test)]
mod tests {
    use super::selects;

    #[test]
    fn op_filters_select_any_match_or_everything() {
        let f = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(selects(&f(&[]), "attention"));
        assert!(selects(&f(&["group"]), "group_swiglu"));
        assert!(!selects(&f(&["group"]), "model_decode"));
        assert!(selects(&f(&["group", "model_decode"]), "model_decode"));
        assert!(!selects(&f(&["group", "model_decode"]), "attention"));
    }
}

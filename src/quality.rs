//! The quality receipt of a conversion (`quality.json` in an output folder, and the card's
//! quality table): perplexity and KL divergence of the resident base and of the refined model
//! against the float source, on held-out text, with the `sfx-run` command that measures the
//! same numbers again.
//!
//! The refined row runs the file's own defaults (its fitted budgets, s = 0, as stored), which
//! is what `sfx-run out/ --no-tune` runs; a tuning profile measured later may choose others.

use crate::device::{with_backend, DeviceChoice, OnBackend};
use crate::heldout::{float_reference_rows, scoring_options, text_windows};
use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use sfx_formats::sfx::SfxFile;
use sfx_runtime::eval::{
    evaluate_against, EvalPart, EvalResult, EvalSpec, ModelScorer, ReferenceRow,
};
use sfx_runtime::refine::{file_settings, open_refinement, plan_from_sfx, RefineOpenOptions};
use sfx_runtime::resident::ResidentKernels;
use sfx_runtime::sfx_model::load_sfx_model_on;
use std::path::Path;
use std::time::Instant;

/// Version of `quality.json`'s layout. 2: no `seconds`, and `device` without the CPU's thread
/// count, so that the same conversion writes the same bytes (issue 20, determinism).
pub const RECEIPT_VERSION: u32 = 2;

/// The held-out text of a receipt: `TEXT:N` windows of `window` tokens (`wiki:2`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QualityText {
    pub text: String,
    pub windows: usize,
    pub window: usize,
}

impl QualityText {
    /// `TEXT:N` (wiki, brown, austen/<novel> or a file) with windows of `window` tokens.
    pub fn parse(spec: &str, window: usize) -> Result<Self> {
        match EvalSpec::parse(spec, Some(window)).map_err(|e| anyhow!("--quality: {e}"))? {
            EvalSpec::Windows {
                text,
                windows,
                window,
            } => {
                // EvalSpec refuses zero windows; their length is --quality-ctx's.
                if window < 2 {
                    bail!("--quality-ctx {window}: a window holds at least 2 tokens");
                }
                Ok(Self {
                    text,
                    windows,
                    window,
                })
            }
            EvalSpec::AustenLong { .. } => bail!(
                "--quality {spec:?}: a receipt scores windows of a text (e.g. wiki:2), not \
                 austen-long"
            ),
        }
    }

    /// The `--ppl` spec that scores the same windows.
    fn ppl_spec(&self) -> String {
        format!("{}:{}", self.text, self.windows)
    }
}

/// Measures the receipt of the container at `sfx_path` (which users will run as `run_as`,
/// e.g. `.` inside its folder) against the float model `reference` (the conversion's source)
/// on `device`.
pub fn measure(
    sfx_path: &Path,
    run_as: &str,
    reference: &str,
    text: &QualityText,
    device: DeviceChoice,
    say: &dyn Fn(&str),
) -> Result<Value> {
    let t0 = Instant::now();
    let file =
        SfxFile::open(sfx_path).with_context(|| format!("opening {}", sfx_path.display()))?;
    let parts = text_windows(
        &file,
        sfx_path,
        "--quality",
        &text.text,
        text.window,
        text.windows,
    )?;
    say(&format!(
        "quality receipt: the float model on {} ({} tokens)",
        text.ppl_spec(),
        text.windows * text.window
    ));
    let rows = float_reference_rows(device, reference, &parts)?;
    let (backend, base, refined) = with_backend(
        device,
        ReceiptTask {
            file: &file,
            path: sfx_path,
            parts: &parts,
            reference: &rows,
            say,
        },
    )?;
    let row = |r: &EvalResult| -> Result<Value> {
        let kl =
            r.kl.as_ref()
                .ok_or_else(|| anyhow!("--quality {}: no token was scored", text.ppl_spec()))?;
        Ok(json!({
            "ppl": r.ppl.ppl,
            "ppl_stderr": r.ppl.ppl_stderr,
            "kl_mean": kl.mean,
            "kl_median": kl.median,
            "kl_p99": kl.p99,
            "same_top1_pct": kl.same_top1_pct,
        }))
    };
    let mut command = vec![
        "sfx-run".to_string(),
        run_as.to_string(),
        "--ppl".into(),
        text.ppl_spec(),
        "--ctx".into(),
        text.window.to_string(),
        "--kl-ref".into(),
        reference.to_string(),
        "--no-tune".into(),
    ];
    if device != DeviceChoice::Auto {
        command.extend(["--device".into(), device.to_string()]);
    }
    let receipt = Ok(json!({
        "format": "strataflux-quality",
        "version": RECEIPT_VERSION,
        "text": text.text,
        "windows": text.windows,
        "window": text.window,
        "scored_tokens": base.ppl.tokens,
        "reference": reference,
        "device": backend,
        "base": row(&base)?,
        "refined": refined.as_ref().map(|(r, k)| -> Result<Value> {
            let mut v = row(r)?;
            v["k"] = json!(k);
            Ok(v)
        }).transpose()?,
        "command": command.join(" "),
    }));
    say(&format!(
        "quality receipt: {:.1} s",
        t0.elapsed().as_secs_f64()
    ));
    receipt
}

/// Base and refined passes over the windows on one backend.
struct ReceiptTask<'a> {
    file: &'a SfxFile,
    path: &'a Path,
    parts: &'a [EvalPart],
    reference: &'a [Vec<ReferenceRow>],
    say: &'a dyn Fn(&str),
}

type Passes = (String, EvalResult, Option<(EvalResult, [usize; 4])>);

impl OnBackend for ReceiptTask<'_> {
    type Output = Passes;
    fn run<B: ResidentKernels>(self, backend: B) -> Result<Passes> {
        let model = load_sfx_model_on(backend, self.file, &scoring_options())
            .with_context(|| format!("loading {}", self.path.display()))?;
        let capacity = self.parts.iter().map(|p| p.tokens.len()).max().unwrap_or(0);
        (self.say)("quality receipt: the resident base");
        let mut scorer = ModelScorer::new(&model, capacity)?;
        let base = evaluate_against(self.parts, &mut scorer, self.reference, |_, _, _| {})?;
        drop(scorer);
        let plan = plan_from_sfx(self.file, model.config(), None)?;
        let settings = file_settings(self.file, &plan);
        let k = settings.k;
        let refiner = open_refinement(
            model.backend(),
            self.file,
            self.path,
            plan,
            Some(settings),
            &RefineOpenOptions::default(),
            self.say,
        )?;
        let refined = match refiner {
            Some(r) => {
                (self.say)("quality receipt: the refined model");
                let mut scorer = ModelScorer::with_refiner(&model, capacity, r)?;
                let res = evaluate_against(self.parts, &mut scorer, self.reference, |_, _, _| {})?;
                Some((res, k))
            }
            None => None,
        };
        Ok((model.backend().numerics_name(), base, refined))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_parse_with_their_window() {
        assert_eq!(
            QualityText::parse("wiki:2", 2048).unwrap(),
            QualityText {
                text: "wiki".into(),
                windows: 2,
                window: 2048
            }
        );
        assert_eq!(
            QualityText::parse("brown:1", 256).unwrap().ppl_spec(),
            "brown:1"
        );
        for bad in ["wiki", "wiki:x", "wiki:0", "austen-long:2048"] {
            assert!(QualityText::parse(bad, 2048).is_err(), "{bad}");
        }
        assert!(QualityText::parse("wiki:1", 1).is_err());
    }
}

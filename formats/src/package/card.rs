//! What an output folder says about its model in words: `config.json`'s
//! `quantization_config` block and the `README.md` model card (Hugging Face's YAML front
//! matter, then how to run it and what it holds), both from the container's metadata.

use super::{FolderInputs, MANIFEST_FILE, MODEL_FILE, QUALITY_FILE};
use crate::sfx::{SfxFile, SfxMetadata};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt::Write;

/// `config.json`'s `quantization_config`: the resident base, the head, the refinement and the
/// container's format version, as the converter recorded them.
pub(super) fn quantization_config(params: &BTreeMap<String, Value>) -> Value {
    let mut m = serde_json::Map::new();
    m.insert("quant_method".into(), "strataflux".into());
    m.insert("format".into(), "sfx".into());
    m.insert("format_version".into(), crate::sfx::VERSION.into());
    for (key, field) in [
        ("quant", "resident"),
        ("head", "head"),
        ("refine", "refinement"),
    ] {
        if let Some(v) = params.get(key) {
            m.insert(field.into(), v.clone());
        }
    }
    Value::Object(m)
}

/// Stored bytes per tier (`resident`, `ram`, `ssd`).
pub(super) fn tier_bytes(sfx: &SfxFile) -> BTreeMap<&'static str, u64> {
    let mut tiers = BTreeMap::new();
    for s in sfx.sections() {
        *tiers.entry(s.tier.as_str()).or_insert(0) += s.bytes.len() as u64;
    }
    tiers
}

/// A YAML string scalar: JSON's quoting is valid YAML.
fn yaml_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

fn gib(bytes: u64) -> String {
    format!("{:.3} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn field<'a>(v: Option<&'a Value>, key: &str) -> Option<&'a Value> {
    v.and_then(|v| v.get(key))
}

fn text(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
        None => "-".into(),
    }
}

/// The `README.md` model card.
pub(super) fn model_card(
    meta: &SfxMetadata,
    tiers: &BTreeMap<&'static str, u64>,
    inputs: &FolderInputs,
) -> String {
    let quant = meta.params.get("quant");
    let head = meta.params.get("head");
    let refine = meta.params.get("refine");
    let name = text(field(quant, "name"));
    let source = &meta.provenance.source_id;
    let mut s = String::from("---\n");
    if let Some(b) = &inputs.base_model {
        let _ = writeln!(s, "base_model: {}", yaml_str(b));
        s.push_str("base_model_relation: quantized\n");
    }
    let _ = writeln!(
        s,
        "license: {}",
        yaml_str(inputs.license.as_deref().unwrap_or("other"))
    );
    s.push_str("library_name: strataflux\n");
    s.push_str("pipeline_tag: text-generation\n");
    s.push_str("tags:\n  - strataflux\n  - quantized\n");
    if let Some(m) = field(quant, "method").and_then(Value::as_str) {
        let _ = writeln!(s, "  - {}", yaml_str(m));
    }
    if let Some(b) = field(quant, "bits").and_then(Value::as_u64) {
        let _ = writeln!(s, "  - {}", yaml_str(&format!("{b}-bit")));
    }
    if refine.is_some() {
        s.push_str("  - selective-refinement\n");
    }
    s.push_str("---\n\n");

    let _ = writeln!(s, "# {} — StrataFlux {name}\n", display_name(source));
    let _ = writeln!(
        s,
        "`{source}` quantized by `{}` {}: low-bit resident codes for fast memory{}.\n",
        meta.provenance.tool,
        meta.provenance.tool_version,
        if refine.is_some() {
            ", plus 4-bit refinement columns that decoding reads for the few input channels \
             each token needs"
        } else {
            ""
        }
    );
    s.push_str("## Run it\n\n```sh\n");
    let _ = writeln!(
        s,
        "sfx verify .                    # every file against {MANIFEST_FILE}"
    );
    let _ = writeln!(s, "sfx-run {MODEL_FILE} --chat -p \"Hello\"");
    let _ = writeln!(s, "sfx-run {MODEL_FILE} --ppl wiki:8 --json");
    let _ = writeln!(s, "sfx bench {MODEL_FILE} -p 512 -n 128");
    s.push_str("```\n\n## Bytes per tier\n\n| tier | where it lives | bytes |\n|---|---|---:|\n");
    for (tier, bytes) in tiers {
        let place = match *tier {
            "resident" => "device memory (VRAM) or the CPU's RAM: read every token",
            "ram" => "host RAM: read only for the selected channels",
            "ssd" => "disk, cached in RAM: read only for the selected channels",
            _ => "-",
        };
        let _ = writeln!(s, "| {tier} | {place} | {} ({bytes}) |", gib(*bytes));
    }
    if let Some(q) = &inputs.quality {
        quality_table(&mut s, q);
    }
    s.push_str("\n## Conversion\n\n| | |\n|---|---|\n");
    let _ = writeln!(s, "| resident base | {name} |");
    let _ = writeln!(
        s,
        "| bits per weight (base) | {} |",
        text(field(quant, "bits_per_weight"))
    );
    let _ = writeln!(s, "| head | {} |", text(field(head, "format")));
    if let Some(r) = refine {
        let _ = writeln!(
            s,
            "| refinement budgets k per 1024 channels | {} |",
            text(r.get("k"))
        );
        let _ = writeln!(s, "| refinement tier | {} |", text(r.get("tier")));
        let _ = writeln!(s, "| fitted | {} |", text(r.get("fit")));
    }
    if let Some(c) = meta.params.get("calibration") {
        let _ = writeln!(
            s,
            "| calibration | {} sequences × {} tokens of {} |",
            text(c.get("sequences")),
            text(c.get("length")),
            text(c.get("source"))
        );
    }
    let p = &meta.provenance;
    let _ = writeln!(s, "| source | `{}` |", p.source_id);
    if let Some(r) = &p.source_revision {
        let _ = writeln!(s, "| source revision | `{r}` |");
    }
    for (file, sha) in &p.source_files_sha256 {
        let _ = writeln!(s, "| source file `{file}` | sha256 `{sha}` |");
    }
    let _ = writeln!(
        s,
        "\nThe exact command, tool revision and every file's SHA-256 are in `{MANIFEST_FILE}`."
    );
    s
}

/// The receipt as a table: base and refined rows against the float source.
fn quality_table(s: &mut String, q: &Value) {
    let _ = writeln!(
        s,
        "\n## Quality\n\nAgainst the float source on held-out text (`{}`, {} × {}-token \
         windows, {} scored tokens, measured on {}; `{QUALITY_FILE}`):\n",
        text(q.get("text")),
        text(q.get("windows")),
        text(q.get("window")),
        text(q.get("scored_tokens")),
        text(q.get("device")),
    );
    s.push_str("| model | PPL | KL mean | KL p99 | same top-1 |\n|---|---:|---:|---:|---:|\n");
    let row = |s: &mut String, label: &str, r: &Value| {
        let num = |k: &str, digits: usize| {
            r.get(k)
                .and_then(Value::as_f64)
                .map_or_else(|| "-".to_string(), |v| format!("{v:.digits$}"))
        };
        let _ = writeln!(
            s,
            "| {label} | {} | {} | {} | {} % |",
            num("ppl", 3),
            num("kl_mean", 4),
            num("kl_p99", 4),
            num("same_top1_pct", 1)
        );
    };
    if let Some(b) = q.get("base") {
        row(s, "resident base", b);
    }
    if let Some(r) = q.get("refined").filter(|r| !r.is_null()) {
        row(s, &format!("refined, k = {}", text(r.get("k"))), r);
    }
    let _ = writeln!(
        s,
        "\nTo measure it again, in this folder: `{}`",
        text(q.get("command"))
    );
}

/// The source's last path component (a Hub id's name, a file's stem).
fn display_name(source: &str) -> String {
    let last = source.rsplit(['/', '\\']).next().unwrap_or(source);
    last.strip_suffix(".gguf").unwrap_or(last).to_string()
}

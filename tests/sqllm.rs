//! `sfx-convert --quant sqllmN`: SqueezeLLM's per-row look-up-table codes on SmolLM2, end to
//! end (the Fisher pass, the k-means, the container sections, the CPU kernels, refinement on
//! top).

use crate::common::{assets, gguf, kl_to_float, stdout_of};
use sfx_formats::gguf::GgufFile;
use sfx_formats::resident::get_code;
use sfx_formats::sfx::{Layout, SfxFile};
use std::path::PathBuf;
use std::process::Command;

/// A quick conversion of the asset to `name` in this module's folder.
fn quick_convert(quant: &str, extra: &[&str], name: &str) -> PathBuf {
    crate::common::quick_convert("sqllm_test", quant, extra, name)
}

/// The container's own sections, read without the runtime: every stored weight of layer 3's
/// `v_proj` and `down_proj` (rows in the GGUF's order) is its row's level nearest to the float
/// weight, the levels stay within the signed 8-bit grid, and the decoded weights are close to
/// the float ones (a table or code read from the wrong row would put them far off). Then the
/// model runs: closer to float than round-to-nearest 4-bit at about the same bytes, and the
/// refinement columns bring it closer still.
#[test]
fn an_sqllm4_container_holds_each_rows_nearest_levels_and_runs() {
    let out = quick_convert("sqllm4", &[], "smollm2.sqllm4.sfx");
    let sfx = SfxFile::open(&out).unwrap();
    let params = &sfx.metadata().params;
    assert_eq!(params["quant"]["method"], "sqllm");
    assert_eq!(params["quant"]["packing"], "lut-v1");
    assert_eq!(params["quant"]["group"], serde_json::Value::Null);
    assert_eq!(params["sqllm"]["sensitivity"], "fisher-diagonal");
    assert_eq!(params["sqllm"]["sequences"], 1);
    let bpw = params["quant"]["bits_per_weight"].as_f64().unwrap();
    assert!((4.0..4.3).contains(&bpw), "bits per weight {bpw}");

    let file = GgufFile::open(gguf()).unwrap();
    for (gguf_name, hf) in [
        ("attn_v", "self_attn.v_proj"),
        ("ffn_down", "mlp.down_proj"),
    ] {
        let info = file
            .tensor_info(&format!("blk.3.{gguf_name}.weight"))
            .unwrap();
        let (cols, rows) = (info.dims[0] as usize, info.dims[1] as usize);
        let w = file.dequantize_info(info).unwrap();
        let name = format!("model.layers.3.{hf}.weight");
        let codes = sfx.section(&name).unwrap();
        assert_eq!(
            *codes.layout,
            Layout::PackedCodes {
                rows: rows as u64,
                cols: cols as u64,
                bits: 4,
                group: cols as u64
            }
        );
        let tables = sfx.section(&format!("{name}.table")).unwrap();
        assert_eq!(tables.bytes.len(), rows * 16);
        let scales = sfx.section(&format!("{name}.scales")).unwrap();
        let rb = cols / 2;
        let (mut err2, mut norm2) = (0.0f64, 0.0f64);
        for r in 0..rows {
            let s = half::f16::from_le_bytes([scales.bytes[2 * r], scales.bytes[2 * r + 1]]);
            let levels: Vec<f32> = tables.bytes[r * 16..(r + 1) * 16]
                .iter()
                .map(|&b| f32::from(b as i8) * s.to_f32())
                .collect();
            assert!(
                tables.bytes[r * 16..(r + 1) * 16]
                    .iter()
                    .all(|&b| b as i8 != -128),
                "{name} row {r}: level −128 is outside the grid"
            );
            for c in 0..cols {
                let v = w[r * cols + c];
                let got = levels[usize::from(get_code(&codes.bytes[r * rb..], c, 4))];
                let best = levels
                    .iter()
                    .map(|l| (l - v).abs())
                    .fold(f32::INFINITY, f32::min);
                assert!(
                    (got - v).abs() <= best * (1.0 + 1e-6) + 1e-9,
                    "{name} [{r}, {c}]: {v} stored as {got}, a level {best} away exists"
                );
                err2 += f64::from(got - v).powi(2);
                norm2 += f64::from(v).powi(2);
            }
        }
        // 16 levels a row: the best 16 levels for a Gaussian (Lloyd–Max) leave a relative
        // RMS error of 0.097; weighting by sensitivity trades some of it away from the
        // insensitive weights (measured 0.107 on v_proj). A table or code read from the wrong
        // row would be of the order of 1.
        let rel = (err2 / norm2).sqrt();
        eprintln!("{name}: relative error {rel:.4}");
        assert!(rel < 0.2, "{name}: relative error {rel}");
    }

    let base = kl_to_float(&out, &["--k", "0"]);
    let refined = kl_to_float(&out, &["--k", "16"]);
    // On this window with the same calibration and head, rtn4 (group 128, 4.20 bits/weight)
    // measured KL 0.416 and sqllm4 (4.21 bits/weight) 0.298: the Fisher-weighted tables must
    // stay clearly below round-to-nearest at the same bytes.
    assert!(base > 0.0 && base < 0.37, "sqllm4 base KL {base}");
    assert!(
        refined < 0.7 * base,
        "k = 16: KL {refined} vs the base's {base}"
    );
    std::fs::remove_file(&out).unwrap();
}

/// Without gradients there is no SqueezeLLM: `--base` refits keep the file's codes (no Fisher
/// pass), and a 2-bit conversion writes 2-bit tables.
#[test]
fn an_sqllm2_refit_keeps_the_codes_without_a_fisher_pass() {
    let out = quick_convert("sqllm2", &[], "smollm2.sqllm2.sfx");
    let dir = out.parent().unwrap();
    let refit = dir.join("smollm2.sqllm2-refit.sfx");
    let log = stdout_of(
        Command::new(env!("CARGO_BIN_EXE_sfx-convert"))
            .args(["--base".as_ref(), out.as_os_str()])
            .arg(gguf())
            .arg("-o")
            .arg(&refit)
            .args(crate::common::QUICK_CALIBRATION)
            .args(["--k", "8"])
            .env("SFX_ASSETS", assets()),
    );
    assert!(!log.contains("Fisher"), "{log}");
    let (a, b) = (SfxFile::open(&out).unwrap(), SfxFile::open(&refit).unwrap());
    for suffix in ["", ".table", ".scales"] {
        let name = format!("model.layers.7.mlp.up_proj.weight{suffix}");
        assert_eq!(
            a.section(&name).unwrap().bytes,
            b.section(&name).unwrap().bytes,
            "{name}"
        );
    }
    assert_eq!(
        a.section("model.layers.7.mlp.up_proj.weight.table")
            .unwrap()
            .bytes
            .len(),
        1536 * 4
    );
    assert_eq!(b.metadata().params["quant"]["method"], "sqllm");
    std::fs::remove_file(&out).unwrap();
    std::fs::remove_file(&refit).unwrap();
}

//! Building a [`RefinementPlan`] from a `.sfx` container (docs/format.md, "Model sections
//! written by `sfx-convert`"), and the file's default run-time settings.

use super::engine::{
    BundleSource, ColumnSource, LayerSources, MlpMode, RefineSettings, RefinementPlan,
};
use crate::error::{Result, RuntimeError};
use crate::observe::ProjectionSet;
use sfx_formats::sfx::{Codec, Layout, SfxFile, Tier};
use sfx_formats::{DType, FormatError, ModelConfig};

fn err(file: &SfxFile, section: &str, msg: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Format(FormatError::invalid(
        file.path(),
        format!("section '{section}': {msg}"),
    ))
}

/// F16 or F32 dense section as f32, with the expected element count.
fn dense_f32(file: &SfxFile, name: &str, len: usize) -> Result<Vec<f32>> {
    let s = file
        .section(name)
        .map_err(|_| err(file, name, "missing (refinement scales)"))?;
    let Layout::Dense { dtype, shape } = s.layout else {
        return Err(err(file, name, "not a dense section"));
    };
    if shape.iter().product::<u64>() != len as u64 {
        return Err(err(
            file,
            name,
            format!("shape {shape:?}, expected {len} values"),
        ));
    }
    let bytes = s.decode().map_err(RuntimeError::Format)?;
    Ok(match dtype {
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
    })
}

/// A refinement payload must be raw (one unit = one read) and live in a backing tier.
fn check_payload(file: &SfxFile, name: &str, codec: Codec, tier: Tier) -> Result<()> {
    if codec != Codec::Raw {
        return Err(err(
            file,
            name,
            "refinement must be stored raw for random access",
        ));
    }
    if tier == Tier::Resident {
        return Err(err(file, name, "refinement in the resident tier"));
    }
    Ok(())
}

/// The budgets k a file's refinement was fitted at, one C per rung (`params.refine.ladder`,
/// written by `sfx-convert --k-ladder`); empty for a file fitted at one k per set.
pub fn file_ladder(file: &SfxFile) -> Vec<usize> {
    file.metadata()
        .params
        .get("refine")
        .and_then(|r| r.get("ladder"))
        .and_then(|l| l.as_array())
        .map(|l| {
            l.iter()
                .filter_map(|v| v.as_u64().map(|k| k as usize))
                .collect()
        })
        .unwrap_or_default()
}

/// The ladder rung a set running at budget `k` reads: the largest fitted k not above it (C
/// is fitted for the channels *not* selected, so a C fitted at a larger k than the run's
/// over-trusts channels that are no longer fetched), or the smallest rung below the ladder.
pub fn ladder_rung(ladder: &[usize], k: usize) -> Option<usize> {
    ladder
        .iter()
        .copied()
        .filter(|&r| r <= k)
        .max()
        .or_else(|| ladder.iter().copied().min())
}

/// Name of a projection's refinement columns (`{prefix}.refine`; `{prefix}.refine.k{K}` for
/// rung K of a ladder), shared by the converter that writes them and the plan that reads them.
pub fn columns_section(projection: &str, rung: Option<usize>) -> String {
    match rung {
        None => format!("{projection}.refine"),
        Some(k) => format!("{projection}.refine.k{k}"),
    }
}

/// Name of a layer's neuron bundles (`model.layers.{l}.mlp.bundles`, `….k{K}` for rung K).
pub fn bundles_section(layer_prefix: &str, rung: Option<usize>) -> String {
    match rung {
        None => format!("{layer_prefix}.mlp.bundles"),
        Some(k) => format!("{layer_prefix}.mlp.bundles.k{k}"),
    }
}

/// What a refinement payload section holds, read back from its name ([`columns_section`],
/// [`bundles_section`]): `Some((is_bundles, rung))`, `None` for any other section (scales
/// included).
pub fn refinement_payload(name: &str) -> Option<(bool, Option<usize>)> {
    let rung = |tail: &str| -> Option<Option<usize>> {
        match tail {
            "" => Some(None),
            t => t.strip_prefix(".k")?.parse().ok().map(Some),
        }
    };
    if let Some((_, tail)) = name.rsplit_once(".mlp.bundles") {
        return rung(tail).map(|r| (true, r));
    }
    let (_, tail) = name.rsplit_once(".refine")?;
    rung(tail).map(|r| (false, r))
}

/// The budgets a file runs at by default (`params.refine.k`; 16 per set when unrecorded).
pub fn file_budgets(file: &SfxFile) -> [usize; 4] {
    let refine = file.metadata().params.get("refine");
    let k_of = |set: &str| {
        refine
            .and_then(|r| r.get("k"))
            .and_then(|k| k.get(set))
            .and_then(|v| v.as_u64())
            .unwrap_or(16) as usize
    };
    [k_of("qkv"), k_of("o"), k_of("gu"), k_of("d")]
}

/// Reads the refinement sections of `file` a run at budgets `k` per set uses (`None`: the
/// file's own budgets): for a ladder file, each set's rung ([`ladder_rung`]; bundles follow
/// the down set's). Sets without sections are left empty (the engine skips them); shapes are
/// checked against `config`.
pub fn plan_from_sfx(
    file: &SfxFile,
    config: &ModelConfig,
    k: Option<[usize; 4]>,
) -> Result<RefinementPlan> {
    let c = config;
    let ladder = file_ladder(file);
    let k = k.unwrap_or_else(|| file_budgets(file));
    let rungs: [Option<usize>; 4] = k.map(|k| ladder_rung(&ladder, k));
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    let mut next_key = 0u64;
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let mut layer = LayerSources {
            attn_norm: dense_f32(file, &format!("{p}.input_layernorm.weight"), c.hidden_size)?,
            mlp_norm: dense_f32(
                file,
                &format!("{p}.post_attention_layernorm.weight"),
                c.hidden_size,
            )?,
            ..Default::default()
        };
        for set in ProjectionSet::ALL {
            for proj in set.projections() {
                let name = columns_section(&format!("{p}.{proj}"), rungs[set.index()]);
                let Ok(s) = file.section(&name) else {
                    continue;
                };
                let Layout::ColumnNibbles { out, inp } = *s.layout else {
                    return Err(err(file, &name, "expected a column_nibbles layout"));
                };
                check_payload(file, &name, s.codec, s.tier)?;
                let (out, inp) = (out as usize, inp as usize);
                let scales = dense_f32(file, &format!("{name}.scales"), out)?;
                layer.sets[set.index()].push(ColumnSource {
                    key_base: next_key << 32,
                    offset: s.offset,
                    unit_bytes: out.div_ceil(2),
                    out,
                    inp,
                    scales,
                });
                next_key += 1;
            }
            let got = layer.sets[set.index()].len();
            if got != 0 && got != set.projections().len() {
                return Err(err(
                    file,
                    &format!("{p}.{}", set.projections()[0]),
                    format!(
                        "refinement present for {got} of the {} set's projections",
                        set.name()
                    ),
                ));
            }
        }
        let name = bundles_section(&p, rungs[ProjectionSet::Down.index()]);
        if let Ok(s) = file.section(&name) {
            let Layout::NeuronBundles { neurons, hidden } = *s.layout else {
                return Err(err(file, &name, "expected a neuron_bundles layout"));
            };
            check_payload(file, &name, s.codec, s.tier)?;
            let (neurons, hidden) = (neurons as usize, hidden as usize);
            if (neurons, hidden) != (c.intermediate_size, c.hidden_size) {
                return Err(err(file, &name, "bundle shape does not match the config"));
            }
            let rows = dense_f32(file, &format!("{name}.row_scales"), 2 * neurons)?;
            let cols = dense_f32(file, &format!("{name}.col_scales"), 2 * hidden)?;
            layer.bundles = Some(BundleSource {
                key_base: next_key << 32,
                offset: s.offset,
                hidden,
                neurons,
                gate_scales: rows[..neurons].to_vec(),
                up_scales: rows[neurons..].to_vec(),
                down_refine_scales: cols[..hidden].to_vec(),
                down_copy_scales: cols[hidden..].to_vec(),
            });
            next_key += 1;
        }
        layers.push(layer);
    }
    Ok(RefinementPlan {
        layers,
        hidden: c.hidden_size,
        eps: c.rms_norm_eps as f32,
        fitted_k: rungs,
    })
}

/// Settings the file was built for: its budgets, no lead/lag, channel-wise MLP (bundles when
/// the file has only bundles).
pub fn file_settings(file: &SfxFile, plan: &RefinementPlan) -> RefineSettings {
    let refine = file.metadata().params.get("refine");
    let k = file_budgets(file);
    let has_channels = plan
        .layers
        .iter()
        .any(|l| !l.sets[ProjectionSet::GateUp.index()].is_empty());
    let has_bundles = plan.layers.iter().any(|l| l.bundles.is_some());
    let bundle_k = refine
        .and_then(|r| r.get("bundle_k"))
        .and_then(|v| v.as_u64())
        .map_or(super::engine::bundle_budget(k[3]), |v| v as usize);
    RefineSettings {
        k,
        s: [0.0; 4],
        mlp: if has_bundles && !has_channels {
            MlpMode::Bundles
        } else {
            MlpMode::Channels
        },
        bundle_k,
    }
}

/// Level `nibble − 8` of element `e` of a refinement unit: element `e` in byte `e / 2`, the
/// low nibble first (the `column_nibbles` layout, docs/format.md).
#[inline(always)]
pub fn nibble_level(unit: &[u8], e: usize) -> f32 {
    let b = unit[e / 2];
    let q = if e.is_multiple_of(2) {
        b & 0x0F
    } else {
        b >> 4
    };
    (q as i32 - 8) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rungs_are_the_largest_fitted_k_not_above_the_budget() {
        let ladder = [4, 8, 16, 32, 64];
        assert_eq!(ladder_rung(&ladder, 16), Some(16));
        assert_eq!(ladder_rung(&ladder, 31), Some(16));
        assert_eq!(ladder_rung(&ladder, 1000), Some(64));
        assert_eq!(ladder_rung(&ladder, 2), Some(4));
        assert_eq!(ladder_rung(&[], 16), None);
    }

    #[test]
    fn section_names_round_trip() {
        let p = "model.layers.3.mlp.down_proj";
        for rung in [None, Some(8), Some(64)] {
            assert_eq!(
                refinement_payload(&columns_section(p, rung)),
                Some((false, rung))
            );
            let b = bundles_section("model.layers.3", rung);
            assert_eq!(refinement_payload(&b), Some((true, rung)));
            assert_eq!(refinement_payload(&format!("{b}.row_scales")), None);
            let scales = format!("{}.scales", columns_section(p, rung));
            assert_eq!(refinement_payload(&scales), None);
        }
        assert_eq!(
            refinement_payload("model.layers.3.mlp.down_proj.weight"),
            None
        );
    }
}

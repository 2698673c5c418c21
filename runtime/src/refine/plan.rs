//! Building a [`RefinementPlan`] from a `.sfx` container (docs/format.md, "Model sections
//! written by `sfx-convert`"), and the file's default run-time settings.

use super::engine::{
    BundleSource, ColumnSource, LayerSources, MlpMode, RefineSettings, RefinementPlan,
};
use crate::error::{Result, RuntimeError};
use crate::observe::ProjectionSet;
use sfx_formats::sfx::{Codec, Layout, SfxFile, Tier};
use sfx_formats::{DType, FormatError, ModelConfig};

/// Projections of each set in graph order ([`ProjectionSet::ALL`] order).
const SET_PROJECTIONS: [&[&str]; 4] = [
    &["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    &["self_attn.o_proj"],
    &["mlp.gate_proj", "mlp.up_proj"],
    &["mlp.down_proj"],
];

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

/// Reads every refinement section of `file`. Sets without sections are left empty (the
/// engine skips them); shapes are checked against `config`.
pub fn plan_from_sfx(file: &SfxFile, config: &ModelConfig) -> Result<RefinementPlan> {
    let c = config;
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
            for proj in SET_PROJECTIONS[set.index()] {
                let name = format!("{p}.{proj}.refine");
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
            if got != 0 && got != SET_PROJECTIONS[set.index()].len() {
                return Err(err(
                    file,
                    &format!("{p}.{}", SET_PROJECTIONS[set.index()][0]),
                    format!(
                        "refinement present for {got} of the {} set's projections",
                        set.name()
                    ),
                ));
            }
        }
        let name = format!("{p}.mlp.bundles");
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
    })
}

/// Settings the file was built for: its budgets, no lead/lag, channel-wise MLP (bundles when
/// the file has only bundles).
pub fn file_settings(file: &SfxFile, plan: &RefinementPlan) -> RefineSettings {
    let refine = file.metadata().params.get("refine");
    let k_of = |set: &str| {
        refine
            .and_then(|r| r.get("k"))
            .and_then(|k| k.get(set))
            .and_then(|v| v.as_u64())
            .unwrap_or(16) as usize
    };
    let k = [k_of("qkv"), k_of("o"), k_of("gu"), k_of("d")];
    let has_channels = plan
        .layers
        .iter()
        .any(|l| !l.sets[ProjectionSet::GateUp.index()].is_empty());
    let has_bundles = plan.layers.iter().any(|l| l.bundles.is_some());
    let bundle_k = refine
        .and_then(|r| r.get("bundle_k"))
        .and_then(|v| v.as_u64())
        .map_or((3 * k[3] + 2) / 4, |v| v as usize);
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

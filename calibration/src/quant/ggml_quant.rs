//! `sfx-convert --quant q2_k … q6_k | q4_0 … q8_0`: a float model quantized into llama.cpp's
//! block types by llama.cpp's own rounding ([`super::ggml_rounding`]), one type for every
//! projection — what `llama-quantize --pure` writes for the decoder's projections, without an
//! importance matrix. The blocks are stored as a GGUF base's are (`gguf_blocks` sections) and
//! run on the same kernels.
//!
//! The k-quants need rows that are whole 256-weight super-blocks. Where a projection's input
//! width is not (SmolLM2's 576), it takes the type llama.cpp falls back to: Q2_K and Q3_K →
//! Q4_0, Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0. A width that is not a multiple of 32 either is
//! refused (llama.cpp would store it as F16, which is not a resident format here).

use super::ggml_rounding::quantize_row;
use super::InputStats;
use super::{QuantError, QuantizedSet, ResidentQuantizer, ResidentWeight, SetContext, WeightView};
use rayon::prelude::*;
use sfx_formats::gguf::{BlockTensor, GgmlType};
use std::collections::BTreeMap;

/// `--quant` names and the block type each asks for.
pub const GGML_QUANTS: [(&str, GgmlType); 10] = [
    ("q2_k", GgmlType::Q2K),
    ("q3_k", GgmlType::Q3K),
    ("q4_k", GgmlType::Q4K),
    ("q5_k", GgmlType::Q5K),
    ("q6_k", GgmlType::Q6K),
    ("q4_0", GgmlType::Q4_0),
    ("q4_1", GgmlType::Q4_1),
    ("q5_0", GgmlType::Q5_0),
    ("q5_1", GgmlType::Q5_1),
    ("q8_0", GgmlType::Q8_0),
];

/// Where the importance of llama.cpp's weighted rounding comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Importance {
    /// No weighting: `llama-quantize` without `--imatrix`.
    None,
    /// Each input column's E[x²] over the calibration text (what `llama-imatrix`
    /// accumulates), from the converter's own statistics.
    Calibration,
    /// A user's importance matrix, one vector per weight ([`WeightView::imatrix`]).
    File,
}

/// Quantizes every projection into one llama.cpp block type (or its fallback).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GgmlQuant {
    pub target: GgmlType,
    pub importance: Importance,
}

impl GgmlQuant {
    /// The quantizer named `q4_k`, `q8_0` … (see [`GGML_QUANTS`]).
    pub fn parse(name: &str) -> Option<Self> {
        GGML_QUANTS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(_, target)| Self {
                target,
                importance: Importance::None,
            })
    }

    /// The `--quant` name, e.g. `q4_k`.
    pub fn quant_name(self) -> &'static str {
        GGML_QUANTS
            .iter()
            .find(|(_, t)| *t == self.target)
            .map_or("?", |(n, _)| n)
    }

    /// The type a projection `cols` wide is stored in: the target, or llama.cpp's fallback
    /// when rows are not whole blocks of it; `None` when no block type fits.
    pub fn type_for(self, cols: usize) -> Option<GgmlType> {
        let fits = |t: GgmlType| cols > 0 && cols.is_multiple_of(t.block_size());
        if fits(self.target) {
            return Some(self.target);
        }
        let fallback = match self.target {
            GgmlType::Q2K | GgmlType::Q3K => GgmlType::Q4_0,
            GgmlType::Q4K => GgmlType::Q5_0,
            GgmlType::Q5K => GgmlType::Q5_1,
            GgmlType::Q6K => GgmlType::Q8_0,
            _ => return None,
        };
        fits(fallback).then_some(fallback)
    }

    /// One weight's blocks, rows quantized in parallel; `importance` (one value per input
    /// column) selects llama.cpp's weighted rounding.
    pub fn quantize(
        self,
        w: &WeightView<'_>,
        importance: Option<&[f32]>,
    ) -> Result<BlockTensor, QuantError> {
        let bad = |message: String| QuantError::Base {
            name: w.name.to_string(),
            message,
        };
        let ty = self.type_for(w.cols).ok_or_else(|| {
            bad(format!(
                "{} input columns are not a multiple of 32: no {} fallback fits",
                w.cols,
                self.target.name()
            ))
        })?;
        if let Some(i) = w.data.iter().position(|v| !v.is_finite()) {
            return Err(bad(format!(
                "weight [{}, {}] is not finite ({})",
                i / w.cols,
                i % w.cols,
                w.data[i]
            )));
        }
        let rows: Vec<Vec<u8>> = w
            .data
            .par_chunks(w.cols)
            .map(|row| {
                let mut bytes = Vec::new();
                // The width was checked against the type above.
                quantize_row(ty, row, importance, &mut bytes).map(|()| bytes)
            })
            .collect::<Option<_>>()
            .ok_or_else(|| {
                bad(format!(
                    "{} cannot be written ({} importance values for {} columns)",
                    ty.name(),
                    importance.map_or(0, <[f32]>::len),
                    w.cols
                ))
            })?;
        Ok(BlockTensor {
            ty,
            rows: w.rows,
            cols: w.cols,
            bytes: rows.concat(),
        })
    }
}

impl ResidentQuantizer for GgmlQuant {
    fn name(&self) -> String {
        let suffix = match self.importance {
            Importance::None => "",
            Importance::Calibration | Importance::File => "-imatrix",
        };
        format!("{}{suffix}", self.quant_name())
    }

    fn needs_calibration(&self) -> bool {
        self.importance == Importance::Calibration
    }

    fn quantize_set(
        &self,
        weights: &[WeightView<'_>],
        stats: Option<&InputStats>,
        _context: SetContext,
    ) -> Result<QuantizedSet, QuantError> {
        // The set's projections share their input, so one importance vector serves them all:
        // the diagonal of E[x xᵀ].
        let importance: Option<Vec<f32>> = match (self.importance, stats) {
            (Importance::None | Importance::File, _) => None,
            (Importance::Calibration, Some(s)) => {
                Some((0..s.cols).map(|i| s.gram[i * s.cols + i]).collect())
            }
            (Importance::Calibration, None) => {
                return Err(QuantError::MissingStats {
                    name: weights
                        .first()
                        .map_or_else(String::new, |w| w.name.to_string()),
                    method: "an importance-weighted llama.cpp type",
                    what: "E[x²] of the projections' input",
                })
            }
        };
        Ok(QuantizedSet {
            weights: weights
                .iter()
                .map(|w| {
                    let from_file = match self.importance {
                        Importance::File => {
                            Some(w.imatrix.ok_or_else(|| QuantError::MissingImportance {
                                name: w.name.to_string(),
                            })?)
                        }
                        _ => None,
                    };
                    self.quantize(w, from_file.or(importance.as_deref()))
                        .map(ResidentWeight::Gguf)
                })
                .collect::<Result<_, _>>()?,
            input_scales: None,
            info: BTreeMap::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fallbacks_follow_llama_quantize() {
        let q = |n| GgmlQuant::parse(n).unwrap();
        assert_eq!(q("q4_k").type_for(1536), Some(GgmlType::Q4K));
        assert_eq!(q("q2_k").type_for(576), Some(GgmlType::Q4_0));
        assert_eq!(q("q3_k").type_for(576), Some(GgmlType::Q4_0));
        assert_eq!(q("q4_k").type_for(576), Some(GgmlType::Q5_0));
        assert_eq!(q("q5_k").type_for(576), Some(GgmlType::Q5_1));
        assert_eq!(q("q6_k").type_for(576), Some(GgmlType::Q8_0));
        assert_eq!(q("q8_0").type_for(576), Some(GgmlType::Q8_0));
        assert_eq!(q("q6_k").type_for(100), None);
        assert_eq!(q("q4_0").type_for(0), None);
        assert!(GgmlQuant::parse("q4_k_m").is_none());
        for (name, _) in GGML_QUANTS {
            assert_eq!(q(name).quant_name(), name);
        }
    }

    #[test]
    fn a_non_finite_weight_is_named() {
        let mut data = vec![0.5f32; 2 * 256];
        data[256 + 3] = f32::NAN;
        let w = WeightView {
            name: "model.layers.0.mlp.down_proj",
            data: &data,
            rows: 2,
            cols: 256,
            kron: None,
            fisher: None,
            imatrix: None,
            guided: None,
        };
        let e = GgmlQuant::parse("q4_k")
            .unwrap()
            .quantize(&w, None)
            .unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("down_proj") && msg.contains("[1, 3]"), "{msg}");
    }
}

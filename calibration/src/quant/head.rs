//! The output head and the token embedding as group codes (`sfx-convert --head q4|q6|q8`).
//!
//! The head is one matrix but the largest of a small model (SmolLM2: 28 M of 135 M weights)
//! and a tied one is the embedding too, so its bits are chosen on their own: 4, 6 or 8 per
//! weight in asymmetric groups of 128 (the projections' layout, so every backend's group
//! kernels run it). Per group the grid is the min/max range shrunk by the clip ratio (1.0 down
//! to 0.625 in 16 steps) that minimises Σᵢ cᵢ (wᵢ − ŵᵢ)², where cᵢ = E[xᵢ²] over the head's
//! calibration inputs (the final-normed residual stream) when they are given — the diagonal
//! of the output error's Hessian, llama.cpp's "importance matrix" criterion — and 1 otherwise
//! (an untied embedding, whose rows are inputs, not a product).

use super::awq::{fake_quant, shrink_grid};
use super::QuantError;
use half::f16;
use rayon::prelude::*;
use sfx_formats::resident::{GroupQuantized, DEFAULT_GROUP_SIZE};

/// Clip ratios searched per group: 1.0, 0.975, …, 0.625.
const CLIP_STEPS: usize = 16;
const CLIP_STEP: f32 = 0.025;

/// A head / embedding table of `bits` bits per code in groups of [`DEFAULT_GROUP_SIZE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableQuant {
    pub bits: u8,
    pub group: usize,
}

impl TableQuant {
    pub fn new(bits: u8) -> Self {
        Self {
            bits,
            group: DEFAULT_GROUP_SIZE,
        }
    }

    /// Quantizes `w` (`[rows, cols]`, row-major) with per-column error weights `importance`
    /// (`cols` values ≥ 0; `None`: uniform).
    pub fn quantize(
        &self,
        name: &str,
        w: &[f32],
        rows: usize,
        cols: usize,
        importance: Option<&[f32]>,
    ) -> Result<GroupQuantized, QuantError> {
        let layout = |source| QuantError::Layout {
            name: name.to_string(),
            source,
        };
        if let Some(c) = importance {
            if c.len() != cols || c.iter().any(|v| !(v.is_finite() && *v >= 0.0)) {
                return Err(layout(sfx_formats::resident::ResidentError::Invalid(
                    format!(
                        "{} importance weights for {cols} columns (each finite and ≥ 0)",
                        c.len()
                    ),
                )));
            }
        }
        if rows.checked_mul(cols) != Some(w.len()) || cols == 0 {
            // quantize_with reports the shape precisely.
            return GroupQuantized::quantize_with(w, rows, cols, self.bits, self.group, |_, _| {
                (f16::ONE, 0)
            })
            .map_err(layout);
        }
        let (bits, group) = (self.bits, self.group);
        let grids: Vec<(f16, u8)> = w
            .par_chunks(cols)
            .flat_map_iter(|row| {
                row.chunks(group).enumerate().map(move |(g, vals)| {
                    let c = importance.map(|c| &c[g * group..g * group + vals.len()]);
                    best_grid(vals, c, bits)
                })
            })
            .collect();
        let mut next = grids.into_iter();
        GroupQuantized::quantize_with(w, rows, cols, bits, group, |vals, b| {
            next.next().unwrap_or_else(|| shrink_grid(vals, b, 1.0))
        })
        .map_err(layout)
    }
}

/// The clip ratio's grid with the least weighted squared error (ties keep the wider range).
fn best_grid(vals: &[f32], c: Option<&[f32]>, bits: u8) -> (f16, u8) {
    let mut best = shrink_grid(vals, bits, 1.0);
    let mut best_err = f64::INFINITY;
    for step in 0..CLIP_STEPS {
        let ratio = 1.0 - CLIP_STEP * step as f32;
        let (s, z) = shrink_grid(vals, bits, ratio);
        let err: f64 = vals
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                let d = f64::from(v - fake_quant(v, s, z, bits));
                c.map_or(1.0, |c| f64::from(c[i])) * d * d
            })
            .sum();
        if err < best_err {
            (best, best_err) = ((s, z), err);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Heavy-tailed rows (cubed uniforms): the clip search must never be worse than min/max
    /// RTN in the weighted error it minimises, and strictly better somewhere at 4 bits.
    #[test]
    fn clip_search_never_loses_to_minmax() {
        let (rows, cols) = (24, 320);
        let w: Vec<f32> = crate::test_util::lcg_vec(rows * cols, 7)
            .iter()
            .map(|v| v.powi(3))
            .collect();
        let c: Vec<f32> = (0..cols).map(|i| 0.1 + (i % 7) as f32).collect();
        for bits in [4u8, 6, 8] {
            let t = TableQuant::new(bits);
            let ours = t
                .quantize("t", &w, rows, cols, Some(&c))
                .unwrap()
                .dequantize();
            let rtn = GroupQuantized::quantize_with(&w, rows, cols, bits, 128, |v, b| {
                shrink_grid(v, b, 1.0)
            })
            .unwrap()
            .dequantize();
            let err = |d: &[f32]| -> f64 {
                w.iter()
                    .zip(d)
                    .enumerate()
                    .map(|(i, (a, b))| f64::from(c[i % cols]) * f64::from(a - b).powi(2))
                    .sum()
            };
            let (e_ours, e_rtn) = (err(&ours), err(&rtn));
            assert!(
                e_ours <= e_rtn * (1.0 + 1e-9),
                "{bits}b: {e_ours} > {e_rtn}"
            );
            if bits == 4 {
                assert!(
                    e_ours < 0.95 * e_rtn,
                    "4b clip search gained nothing: {e_ours} vs {e_rtn}"
                );
            }
        }
    }

    #[test]
    fn bad_importance_is_an_error() {
        let t = TableQuant::new(8);
        assert!(t
            .quantize("t", &[0.5; 256], 2, 128, Some(&[1.0; 3]))
            .is_err());
        assert!(t
            .quantize("t", &[0.5; 256], 2, 128, Some(&[f32::NAN; 128]))
            .is_err());
        assert!(t.quantize("t", &[0.5; 255], 2, 128, None).is_err());
    }
}

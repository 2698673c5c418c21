//! Neuron bundles (docs/method.md §2, eq. 5–6): the MLP refinement read one intermediate
//! neuron at a time. Bundle j packs four `hidden`-long 4-bit vectors — gate refinement row j, up
//! refinement row j, down refinement column j, and a 4-bit copy of the float down column j —
//! so one selected neuron is one contiguous read (`docs/format.md`, layout `neuron_bundles`).
//!
//! Scales: the gate/up rows get one scale per neuron (the row is the unit read and used);
//! the two down vectors get one scale per output (hidden) row shared across neurons, exactly
//! like channel-wise refinement columns, so they reuse [`quantize_columns_4bit`].

use super::{grid_search_scale, quantize_columns_4bit, quantize_level, RefinementColumns};
use half::f16;
use rayon::prelude::*;

/// Packed bundles for one layer's MLP.
#[derive(Debug, Clone, PartialEq)]
pub struct NeuronBundles {
    pub neurons: usize,
    pub hidden: usize,
    /// `neurons × bundle_bytes()` bytes.
    pub packed: Vec<u8>,
    /// `[2, neurons]`: scales of the gate rows, then of the up rows.
    pub row_scales: Vec<f16>,
    /// `[2, hidden]`: per-output-row scales of the down refinement, then of the down copy.
    pub col_scales: Vec<f16>,
}

/// The four parts of a bundle, in storage order.
pub const PARTS: [&str; 4] = ["gate_refine", "up_refine", "down_refine", "down_copy"];

/// Rows of `a` (`rows × cols`, row-major) as 4-bit nibble vectors with one grid-searched
/// scale per row: returns (`rows × ceil(cols/2)` bytes, scales).
fn quantize_rows_4bit(a: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<f16>) {
    let cb = cols.div_ceil(2);
    let scales: Vec<f16> = a.par_chunks(cols.max(1)).map(grid_search_scale).collect();
    let mut packed = vec![0x88u8; rows * cb];
    packed
        .par_chunks_mut(cb.max(1))
        .zip(a.par_chunks(cols.max(1)))
        .zip(scales.par_iter())
        .for_each(|((out, row), s)| {
            let s = s.to_f32();
            for (i, &v) in row.iter().enumerate() {
                let nib = (quantize_level(v, s) + 8) as u8;
                let byte = &mut out[i / 2];
                *byte = if i % 2 == 0 {
                    (*byte & 0xF0) | nib
                } else {
                    (*byte & 0x0F) | (nib << 4)
                };
            }
        });
    (packed, scales)
}

/// Builds bundles from the gate and up refinement (`[neurons, hidden]` each), the down
/// refinement and the float down weight (`[hidden, neurons]` each), all row-major.
pub fn build_bundles(
    gate_refine: &[f32],
    up_refine: &[f32],
    down_refine: &[f32],
    down_weight: &[f32],
    hidden: usize,
    neurons: usize,
) -> NeuronBundles {
    let n = hidden * neurons;
    assert!(
        [gate_refine, up_refine, down_refine, down_weight]
            .iter()
            .all(|a| a.len() == n),
        "build_bundles: every part must hold hidden × neurons values"
    );
    let (gate, gate_s) = quantize_rows_4bit(gate_refine, neurons, hidden);
    let (up, up_s) = quantize_rows_4bit(up_refine, neurons, hidden);
    let down: RefinementColumns = quantize_columns_4bit(down_refine, hidden, neurons);
    let copy: RefinementColumns = quantize_columns_4bit(down_weight, hidden, neurons);
    let cb = hidden.div_ceil(2);
    let mut packed = vec![0u8; neurons * 4 * cb];
    packed
        .par_chunks_mut((4 * cb).max(1))
        .enumerate()
        .for_each(|(j, b)| {
            b[..cb].copy_from_slice(&gate[j * cb..(j + 1) * cb]);
            b[cb..2 * cb].copy_from_slice(&up[j * cb..(j + 1) * cb]);
            b[2 * cb..3 * cb].copy_from_slice(down.column(j));
            b[3 * cb..].copy_from_slice(copy.column(j));
        });
    NeuronBundles {
        neurons,
        hidden,
        packed,
        row_scales: gate_s.into_iter().chain(up_s).collect(),
        col_scales: down.row_scales.into_iter().chain(copy.row_scales).collect(),
    }
}

impl NeuronBundles {
    /// Bytes of one bundle.
    pub fn bundle_bytes(&self) -> usize {
        4 * self.hidden.div_ceil(2)
    }

    /// The packed bytes of neuron `j` (one contiguous read).
    pub fn bundle(&self, j: usize) -> &[u8] {
        let b = self.bundle_bytes();
        &self.packed[j * b..(j + 1) * b]
    }

    /// Dequantized part `part` (index into [`PARTS`]) of neuron `j`, length `hidden`.
    pub fn part(&self, j: usize, part: usize) -> Vec<f32> {
        let cb = self.hidden.div_ceil(2);
        let bytes = &self.bundle(j)[part * cb..(part + 1) * cb];
        (0..self.hidden)
            .map(|i| {
                let byte = bytes[i / 2];
                let nib = if i % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                let scale = match part {
                    0 | 1 => self.row_scales[part * self.neurons + j],
                    _ => self.col_scales[(part - 2) * self.hidden + i],
                };
                (nib as i32 - 8) as f32 * scale.to_f32()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::lcg_vec as lcg;

    #[test]
    fn every_part_round_trips_within_half_a_step() {
        // Odd hidden exercises the padded high nibble; each bundle must decode to its own
        // neuron's row/column (gate/up: row j; down parts: column j of [hidden, neurons]).
        let (hidden, neurons) = (13, 7);
        let g = lcg(hidden * neurons, 1);
        let u: Vec<f32> = lcg(hidden * neurons, 2).iter().map(|v| v * 3.0).collect();
        let d = lcg(hidden * neurons, 3);
        let w: Vec<f32> = lcg(hidden * neurons, 4).iter().map(|v| v * 0.1).collect();
        let b = build_bundles(&g, &u, &d, &w, hidden, neurons);
        assert_eq!(b.packed.len(), neurons * 4 * 7);
        for j in 0..neurons {
            let want: [Vec<f32>; 4] = [
                g[j * hidden..(j + 1) * hidden].to_vec(),
                u[j * hidden..(j + 1) * hidden].to_vec(),
                (0..hidden).map(|i| d[i * neurons + j]).collect(),
                (0..hidden).map(|i| w[i * neurons + j]).collect(),
            ];
            for (p, want) in want.iter().enumerate() {
                let got = b.part(j, p);
                for (i, (&a, &e)) in got.iter().zip(want).enumerate() {
                    let step = match p {
                        0 | 1 => b.row_scales[p * neurons + j].to_f32(),
                        _ => b.col_scales[(p - 2) * hidden + i].to_f32(),
                    };
                    // Clipping by the grid search can exceed half a step only at the row's
                    // extremes; bound by the clipped amount instead there.
                    let clip = (e.abs() - 7.0 * step).max(0.0);
                    assert!(
                        (a - e).abs() <= 0.5 * step + clip + 1e-6,
                        "neuron {j} part {p} elem {i}: {a} vs {e} (step {step})"
                    );
                }
            }
            // Padding nibble of the odd hidden size is level 0.
            assert_eq!(b.bundle(j)[6] >> 4, 8);
        }
    }
}

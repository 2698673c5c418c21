//! Round-to-nearest (RTN): asymmetric min/max grid per group of input channels, no
//! calibration data. Per group: `scale = (max − min) / (2^b − 1)` (≥ 1e-5, rounded up to f16),
//! `zero = clamp(round(−min / scale), 0, 2^b − 1)`, `q = clamp(round(w / scale) + zero)`,
//! `ŵ = (q − zero)·scale`, with `[min, max]` widened to contain 0
//! (`sfx_formats::resident::minmax_grid`). The baseline every other quantizer must beat,
//! and AWQ's inner quantizer.

use super::{
    GroupQuantized, InputStats, QuantError, QuantizedSet, ResidentQuantizer, ResidentWeight,
    SetContext, WeightView, DEFAULT_GROUP_SIZE,
};
use sfx_formats::resident::minmax_grid;

/// RTN at `bits` ∈ {2, 3, 4} with groups of `group_size` input channels (a multiple of 8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rtn {
    pub bits: u8,
    pub group_size: usize,
}

impl Rtn {
    /// `bits`-bit RTN with the default group of 128.
    pub fn new(bits: u8) -> Self {
        Self {
            bits,
            group_size: DEFAULT_GROUP_SIZE,
        }
    }

    /// Quantizes straight to the group layout.
    pub fn quantize_group(&self, weight: WeightView<'_>) -> Result<GroupQuantized, QuantError> {
        GroupQuantized::quantize_with(
            weight.data,
            weight.rows,
            weight.cols,
            self.bits,
            self.group_size,
            minmax_grid,
        )
        .map_err(|source| QuantError::Layout {
            name: weight.name.to_string(),
            source,
        })
    }
}

impl ResidentQuantizer for Rtn {
    fn name(&self) -> String {
        format!("rtn{}-g{}", self.bits, self.group_size)
    }

    fn quantize_set(
        &self,
        weights: &[WeightView<'_>],
        _stats: Option<&InputStats>,
        _context: SetContext,
    ) -> Result<QuantizedSet, QuantError> {
        let weights = weights
            .iter()
            .map(|w| self.quantize_group(*w).map(ResidentWeight::Group))
            .collect::<Result<_, _>>()?;
        Ok(QuantizedSet {
            weights,
            input_scales: None,
            info: Default::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CTX: SetContext = SetContext {
        set: sfx_runtime::ProjectionSet::Qkv,
        scales_foldable: true,
    };

    fn view<'a>(data: &'a [f32], rows: usize, cols: usize) -> WeightView<'a> {
        WeightView {
            kron: None,
            fisher: None,
            imatrix: None,
            guided: None,
            name: "w",
            data,
            rows,
            cols,
        }
    }

    /// One group of 8 worked by hand at 2 bits: min −0.3, max 0.9 → scale 1.2/3 = 0.4
    /// (f16 round-up: 0.400146484375, f16 spacing 2^-12 there), zero round(0.3/0.4) = round(0.75) = 1,
    /// q = clamp(round(w/0.4) + 1, 0, 3).
    #[test]
    fn two_bit_group_matches_hand_computation() {
        let w = [-0.3f32, 0.9, 0.0, 0.1, 0.2, 0.5, 0.7, -0.1];
        let q = Rtn {
            bits: 2,
            group_size: 8,
        }
        .quantize_group(view(&w, 1, 8))
        .unwrap();
        let s = q.scales()[0].to_f32();
        assert_eq!(s, 1639.0 / 4096.0); // 0.400146484375
        assert_eq!(q.zeros(), &[1]);
        // round(w/s): -0.75→-1, 2.25→2, 0, 0.25→0, 0.4998→0, 1.25→1, 1.75→2, -0.25→0;
        // plus zero 1, clamped to [0, 3].
        let want = [0u8, 3, 1, 1, 1, 2, 3, 1];
        for (i, &c) in want.iter().enumerate() {
            assert_eq!(q.code(0, i), Some(c), "code {i}");
        }
        let mut row = [0.0f32; 8];
        q.dequantize_row(0, &mut row).unwrap();
        for (a, &c) in row.iter().zip(&want) {
            assert_eq!(*a, (f32::from(c) - 1.0) * s);
        }
    }

    /// 4-bit, a group of 16 values 0..15 scaled by 0.1 minus 0.5: min −0.5, max 1.0 →
    /// scale 0.1 (f16 round-up 0.10003662109375), zero round(5.0) = 5 (4.998 → 5).
    #[test]
    fn four_bit_group_matches_hand_computation() {
        let w: Vec<f32> = (0..16).map(|i| i as f32 * 0.1 - 0.5).collect();
        let q = Rtn {
            bits: 4,
            group_size: 16,
        }
        .quantize_group(view(&w, 1, 16))
        .unwrap();
        assert_eq!(q.scales()[0].to_f32(), 1639.0 / 16384.0); // 0.10003662109375
        assert_eq!(q.zeros(), &[5]);
        for i in 0..16 {
            assert_eq!(q.code(0, i), Some(i as u8), "code {i}");
        }
        assert_eq!(q.codes()[0], 0x10);
    }

    /// Max |w − ŵ| ≤ scale/2 in every group (plus f32 rounding), for 2/3/4 bits, with a tail
    /// group (576 = 4·128 + 64), an all-positive row and outliers; and the result is
    /// deterministic.
    #[test]
    fn reconstruction_error_is_at_most_half_a_step() {
        let (rows, cols) = (7, 576);
        let seed = 3u64;
        let mut w: Vec<f32> = crate::test_util::lcg_vec(rows * cols, seed)
            .into_iter()
            .map(|v| 0.05 * v)
            .collect();
        w[5] = 3.0;
        w[cols + 200] = -2.0;
        for v in &mut w[2 * cols..3 * cols] {
            *v = v.abs() + 0.01;
        }
        for bits in 2..=4u8 {
            let rtn = Rtn::new(bits);
            let q = rtn.quantize_group(view(&w, rows, cols)).unwrap();
            assert_eq!(q, rtn.quantize_group(view(&w, rows, cols)).unwrap());
            let deq = q.dequantize();
            let gpr = q.groups_per_row();
            assert_eq!(gpr, 5);
            for r in 0..rows {
                for i in 0..cols {
                    let s = q.scales()[r * gpr + i / 128].to_f32();
                    let err = (w[r * cols + i] - deq[r * cols + i]).abs();
                    assert!(
                        err <= s / 2.0 * (1.0 + 1e-5) + 1e-7,
                        "{bits} bits [{r},{i}]: err {err} > scale/2 {}",
                        s / 2.0
                    );
                }
            }
            let bpw = bits as f64 + 24.0 * 5.0 / 576.0;
            assert!((q.bits_per_weight() - bpw).abs() < 1e-12);
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let w = [0.0f32; 10];
        assert!(Rtn::new(4)
            .quantize_set(&[view(&w, 3, 3)], None, CTX)
            .is_err());
        assert!(Rtn::new(5)
            .quantize_set(&[view(&w, 1, 10)], None, CTX)
            .is_err());
        assert_eq!(Rtn::new(3).name(), "rtn3-g128");
    }
}

//! What a conversion carries from one block to the next, recorded after every block so that
//! an interrupted conversion can go on from its last finished block ([`super::convert`]'s
//! `resume`) and end byte-identical to one that ran straight through.
//!
//! The residual streams are not recorded: they are the *float* model's hidden states, a pure
//! function of the weights and the token windows, so a resumed run recomputes them by running
//! the finished blocks again (one forward pass per block, a fraction of converting it) and
//! checks the result against [`ConvertState::streams_sha256`]. Recording them instead would
//! write the whole calibration activation set (SmolLM2, 32 × 512 tokens: 38 MB) at every
//! block.

use super::{LayerReport, SetReport};
use rayon::prelude::*;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// The converter's state after its first `blocks_done` blocks; with the writer's checkpoint,
/// everything a resumed conversion needs.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ConvertState {
    pub blocks_done: usize,
    /// The finished blocks' reports (AWQ's α per layer goes into the file's metadata).
    pub layers: Vec<LayerRecord>,
    /// Resident bits of the quantized linears so far and their weight count.
    pub code_bits: u64,
    pub weights: u64,
    pub bytes_by_tier: BTreeMap<String, u64>,
    pub refine_bytes: u64,
    pub refine_zstd_bytes: u64,
    /// Model-wide sections written so far (trellis table, Hadamard factors); a resumed run
    /// reads their bytes back from the partial file.
    pub shared: Vec<String>,
    /// SHA-256 over the calibration and held-out residual streams entering block
    /// `blocks_done` ([`streams_sha256`]).
    pub streams_sha256: String,
}

/// A [`LayerReport`] with every float as its IEEE bit pattern: JSON's decimal text does not
/// promise to give back the same `f64`, and the report's α values are written into the file.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LayerRecord {
    pub layer: usize,
    /// `(set, k, [signal, base, plain, fitted])`.
    pub sets: Vec<(String, usize, [u64; 4])>,
    pub quant_info: BTreeMap<String, BTreeMap<String, u64>>,
    pub seconds: u64,
}

impl From<&LayerReport> for LayerRecord {
    fn from(r: &LayerReport) -> Self {
        Self {
            layer: r.layer,
            sets: r
                .sets
                .iter()
                .map(|s| {
                    let v = [s.signal, s.base, s.plain, s.fitted].map(f64::to_bits);
                    (s.set.clone(), s.k, v)
                })
                .collect(),
            quant_info: r
                .quant_info
                .iter()
                .map(|(set, m)| {
                    let m = m.iter().map(|(k, v)| (k.clone(), v.to_bits())).collect();
                    (set.clone(), m)
                })
                .collect(),
            seconds: r.seconds.to_bits(),
        }
    }
}

impl From<&LayerRecord> for LayerReport {
    fn from(r: &LayerRecord) -> Self {
        Self {
            layer: r.layer,
            sets: r
                .sets
                .iter()
                .map(|(set, k, v)| {
                    let [signal, base, plain, fitted] = v.map(f64::from_bits);
                    SetReport {
                        set: set.clone(),
                        k: *k,
                        signal,
                        base,
                        plain,
                        fitted,
                    }
                })
                .collect(),
            quant_info: r
                .quant_info
                .iter()
                .map(|(set, m)| {
                    let m = m
                        .iter()
                        .map(|(k, v)| (k.clone(), f64::from_bits(*v)))
                        .collect();
                    (set.clone(), m)
                })
                .collect(),
            seconds: f64::from_bits(r.seconds),
        }
    }
}

/// SHA-256 of the streams' bit patterns: a hash per sequence (in parallel: the calibration
/// set is tens of MB), then one over the count and those hashes in order.
pub fn streams_sha256(calib: &[Vec<f32>], held: &[Vec<f32>]) -> String {
    let per: Vec<[u8; 32]> = calib
        .par_iter()
        .chain(held.par_iter())
        .map(|s| Sha256::digest(bytemuck::cast_slice::<f32, u8>(s)).into())
        .collect();
    let mut h = Sha256::new();
    h.update((calib.len() as u64).to_le_bytes());
    h.update((held.len() as u64).to_le_bytes());
    for p in &per {
        h.update(p);
    }
    format!("{:x}", h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_record_gives_back_every_float_bit_for_bit() {
        // 0.1 + 0.2 needs 17 significant digits; NaN and -0.0 have no exact decimal round trip.
        let awkward = [0.1 + 0.2, f64::NAN, -0.0, 1e-310, f64::MAX];
        let report = LayerReport {
            layer: 3,
            sets: vec![SetReport {
                set: "qkv".into(),
                k: 16,
                signal: awkward[0],
                base: awkward[1],
                plain: awkward[2],
                fitted: awkward[3],
            }],
            quant_info: BTreeMap::from([(
                "o".to_string(),
                BTreeMap::from([("alpha".to_string(), awkward[4])]),
            )]),
            seconds: 1.5,
        };
        let json = serde_json::to_string(&LayerRecord::from(&report)).unwrap();
        let back = LayerReport::from(&serde_json::from_str::<LayerRecord>(&json).unwrap());
        assert_eq!(LayerRecord::from(&back), LayerRecord::from(&report));
        assert_eq!(back.sets[0].signal.to_bits(), awkward[0].to_bits());
        assert!(back.sets[0].base.is_nan());
        assert!(back.sets[0].plain.is_sign_negative());
    }

    #[test]
    fn streams_hash_sees_one_changed_bit_and_where_a_sequence_ends() {
        let a = vec![vec![1.0f32, 2.0], vec![3.0]];
        let base = streams_sha256(&a, &[]);
        let mut b = a.clone();
        b[1][0] = f32::from_bits(3.0f32.to_bits() ^ 1);
        assert_ne!(streams_sha256(&b, &[]), base);
        // The same values split differently between calibration and held-out streams.
        assert_ne!(streams_sha256(&a[..1], &a[1..]), base);
        assert_eq!(streams_sha256(&a, &[]), base);
    }
}

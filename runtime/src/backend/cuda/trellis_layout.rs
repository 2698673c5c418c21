//! The CUDA in-memory layout of trellis tiles (docs/format.md, "CUDA trellis layout"), packed on
//! the host at upload from the file's tile streams.
//!
//! A warp decodes one tile per MMA: lane c owns bits `[8Kc, 8Kc + 8K)` of the tile's stream (its
//! K bytes) and takes the next 16 bits from lane c + 1. The layout gives each lane its K bytes of
//! 16 consecutive column tiles (a *unit*, 256 columns) as K 16-byte words, and the 32 lanes'
//! words of one chunk lie contiguous, so one coalesced 512-byte load per chunk feeds the warp:
//! uint4 `((tile_row · units + unit) · K + chunk) · 32 + lane` holds big-endian words
//! `4·chunk .. 4·chunk + 4` of the lane's 16K-byte string (tile 0's K bytes, tile 1's, …).
//! Tiles past the matrix's columns are zero bytes.

use rayon::prelude::*;
use sfx_formats::resident::{TrellisQuantized, TILE_SIDE};

/// Column tiles per unit.
pub(super) const UNIT_TILES: usize = 16;
/// Columns per unit.
pub(super) const UNIT_COLS: usize = UNIT_TILES * TILE_SIDE;
const LANES: usize = 32;

/// Units per tile row of a matrix with `cols` columns.
pub(super) fn units(cols: usize) -> usize {
    cols.div_ceil(UNIT_COLS)
}

/// The packed codes of `w` as u32 words (native order; each 16-byte group is one lane's
/// chunk).
pub(super) fn pack_units(w: &TrellisQuantized) -> Vec<u32> {
    let k = usize::from(w.scheme().k);
    let (tile_rows, col_tiles) = (w.rows() / TILE_SIDE, w.cols() / TILE_SIDE);
    let row_words = units(w.cols()) * LANES * 4 * k;
    let mut out = vec![0u32; tile_rows * row_words];
    // Tile rows in parallel: an 8B model packs ~2 GB at load.
    out.par_chunks_mut(row_words.max(1))
        .enumerate()
        .for_each(|(tr, row_out)| pack_tile_row(w, tr, k, col_tiles, row_out));
    out
}

/// One tile row's units into `out` (its `units · 32 · 4K` words).
fn pack_tile_row(w: &TrellisQuantized, tr: usize, k: usize, col_tiles: usize, out: &mut [u32]) {
    let words_per_lane = 4 * k;
    let mut lane_bytes = vec![0u8; UNIT_TILES * k];
    for u in 0..units(w.cols()) {
        let base = u * LANES * words_per_lane;
        for lane in 0..LANES {
            for t in 0..UNIT_TILES {
                let tc = u * UNIT_TILES + t;
                let dst = &mut lane_bytes[t * k..(t + 1) * k];
                if tc < col_tiles {
                    dst.copy_from_slice(&w.tile(tr, tc)[lane * k..(lane + 1) * k]);
                } else {
                    dst.fill(0);
                }
            }
            for (j, word) in lane_bytes.chunks_exact(4).enumerate() {
                let (chunk, i) = (j / 4, j % 4);
                let v = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
                out[base + (chunk * LANES + lane) * 4 + i] = v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! A model of the kernels' lane arithmetic (trellis.cu: `own_bits`, `tile_window`, the
    //! matvec's two-tile word window at K = 2, `window_state`, `decode_window`, the fragment
    //! registers of both tile orders, the B planes and the output
    //! reduction), run on the packed layout and checked against the trellis module's own
    //! decoder (`decode_rotated`), so the layout and the index algebra are verified without a
    //! GPU; the CUDA conformance suite then checks the kernels themselves.
    use super::*;
    use crate::resident::trellis_linear::decode_rotated;
    use crate::resident::trellis_linear::test_weights::weight;
    use half::f16;
    use sfx_formats::resident::{TileOrder, TrellisCode};

    fn lcg(seed: &mut u64) -> u64 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *seed >> 33
    }

    fn unit_word(words: &[u32], j: usize) -> u32 {
        words[j]
    }

    fn own_bits(words: &[u32], k: usize, t: usize) -> u32 {
        match k {
            4 => unit_word(words, t),
            2 => {
                let v = unit_word(words, t >> 1);
                if t & 1 == 1 {
                    v & 0xffff
                } else {
                    v >> 16
                }
            }
            _ => {
                let bit = 24 * t;
                let (j, o) = (bit >> 5, bit & 31);
                let a = unit_word(words, j);
                let b = if o > 8 { unit_word(words, j + 1) } else { 0 };
                let joined = (u64::from(a) << 32) | u64::from(b);
                ((joined << o) >> 32) as u32 >> 8
            }
        }
    }

    fn window_state(lo: u32, hi: u32, k: usize, o: usize) -> u32 {
        let sh = 8 * k - o;
        ((((u64::from(hi)) << 32) | u64::from(lo)) >> sh) as u32
    }

    fn f16v(bits: u32) -> f64 {
        f64::from(f16::from_bits((bits & 0xffff) as u16).to_f32())
    }

    /// CUDA's `__byte_perm(x, y, s)`: byte i of the result is byte (s >> 4i) & 7 of y ‖ x.
    fn byte_perm(x: u32, y: u32, s: u32) -> u32 {
        let bytes = (u64::from(y) << 32) | u64::from(x);
        (0..4).fold(0, |r, i| {
            let sel = (s >> (4 * i)) & 7;
            r | ((((bytes >> (8 * sel)) & 0xff) as u32) << (8 * i))
        })
    }

    /// `tile_window`: own ‖ the first 16 bits of next, as (lo, hi).
    fn tile_window(k: usize, own: u32, next: u32) -> (u32, u32) {
        ((own << 16) | (next >> (8 * k - 16)), own >> 16)
    }

    /// The matvec's windows of tile t for every lane: at K = 2 one byte permutation of the
    /// lane's word of two tiles and lane c + 1's (shuffled once per pair of tiles), else
    /// `tile_window` of the lanes' own bits.
    fn matvec_windows(words: &[Vec<u32>], k: usize, t: usize) -> Vec<(u32, u32)> {
        (0..32)
            .map(|l| {
                if k == 2 {
                    let (v, next) = (
                        unit_word(&words[l], t >> 1),
                        unit_word(&words[(l + 1) & 31], t >> 1),
                    );
                    (
                        byte_perm(v, next, if t & 1 == 1 { 0x1054 } else { 0x3276 }),
                        0,
                    )
                } else {
                    tile_window(
                        k,
                        own_bits(&words[l], k, t),
                        own_bits(&words[(l + 1) & 31], k, t),
                    )
                }
            })
            .collect()
    }

    /// The lane's four pairs as (low, high) values of the A operand(s) from its window: for
    /// 3INST the sum of the two MMAs' operands.
    fn decode_window(
        code: TrellisCode,
        k: usize,
        (lo, hi): (u32, u32),
        tlut: &[f16],
    ) -> [[f64; 2]; 4] {
        let mut out = [[0.0; 2]; 4];
        match code {
            TrellisCode::Hyb { .. } => {
                for (i, pair) in out.iter_mut().enumerate() {
                    let s = window_state(lo, hi, k, 2 * k * i);
                    let h = s.wrapping_mul(s).wrapping_add(s);
                    let idx = ((h >> 6) & 511) as usize;
                    let v = (u32::from(tlut[2 * idx + 1].to_bits()) << 16
                        | u32::from(tlut[2 * idx].to_bits()))
                        ^ (h & 0x8000);
                    *pair = [f16v(v), f16v(v >> 16)];
                }
            }
            TrellisCode::OneMad | TrellisCode::ThreeInst => {
                for (j, pair) in out.iter_mut().enumerate() {
                    for (e, slot) in pair.iter_mut().enumerate() {
                        let s = window_state(lo, hi, k, k * (2 * j + e)) & 0xffff;
                        *slot = if code == TrellisCode::OneMad {
                            let y = s.wrapping_mul(34_038_481).wrapping_add(76_625_530);
                            let sum: u32 = y.to_le_bytes().iter().map(|&b| u32::from(b)).sum();
                            // dp4a onto 0x6400 (1024.0), then − 1534 in f16.
                            let c = f16::from_bits((0x6400 + sum) as u16).to_f64();
                            f64::from(f16::from_f64(c - 1534.0).to_f32())
                        } else {
                            let y = s.wrapping_mul(89_226_354).wrapping_add(64_248_484);
                            let m = (y & 0x8FFF_8FFF) ^ 0x3B60_3B60;
                            f16v(m >> 16) + f16v(m)
                        };
                    }
                }
            }
        }
        out
    }

    /// The hi plane of x as tr_prepare stores it (mma order: each tile permuted), unscaled.
    fn plane(w: &TrellisQuantized, x: &[f32]) -> Vec<f64> {
        let mma = w.scheme().order == TileOrder::Mma;
        let pcols = units(w.cols()) * UNIT_COLS;
        (0..pcols)
            .map(|i| {
                let col = if mma {
                    let q = i & 15;
                    (i & !15) | ((q & 1) | ((q >> 2) << 1) | (((q >> 1) & 1) << 3))
                } else {
                    i
                };
                if col < w.cols() {
                    f64::from(x[col])
                } else {
                    0.0
                }
            })
            .collect()
    }

    /// Lane `lane`'s K·4 words of unit `u` of tile row `tr` in the packed layout.
    fn lane_words(packed: &[u32], k: usize, n_units: usize, tr: usize, u: usize) -> Vec<Vec<u32>> {
        (0..32)
            .map(|lane| {
                (0..4 * k)
                    .map(|j| {
                        let (chunk, i) = (j / 4, j % 4);
                        packed[((tr * n_units + u) * k + chunk) * 32 * 4 + lane * 4 + i]
                    })
                    .collect()
            })
            .collect()
    }

    /// 1MAD's integer values scaled back to the code's values.
    fn code_scale(w: &TrellisQuantized) -> f64 {
        if w.scheme().code == TrellisCode::OneMad {
            f64::from(crate::resident::trellis::ONE_MAD_SCALE)
        } else {
            1.0
        }
    }

    /// The kernels' matvec over the packed layout for one token: Ŵ · x as the MMAs sum it
    /// (f64 products; x enters unsplit), with 1MAD's integer values scaled back.
    fn emulate(w: &TrellisQuantized, x: &[f32]) -> Vec<f64> {
        let k = usize::from(w.scheme().k);
        let mma = w.scheme().order == TileOrder::Mma;
        let packed = pack_units(w);
        let n_units = units(w.cols());
        let plane = plane(w, x);
        let scale = code_scale(w);
        let mut y = vec![0.0f64; w.rows()];
        for tr in 0..w.rows() / 16 {
            let mut d = [[0.0f64; 4]; 32];
            for u in 0..n_units {
                let words = lane_words(&packed, k, n_units, tr, u);
                for t in 0..UNIT_TILES {
                    let windows = matvec_windows(&words, k, t);
                    // A and B as full matrices from the lanes' fragments.
                    let mut a = [[0.0f64; 16]; 16];
                    let mut b = [[0.0f64; 8]; 16];
                    for (lane, &window) in windows.iter().enumerate() {
                        let (g, tq) = (lane >> 2, lane & 3);
                        let pairs = decode_window(w.scheme().code, k, window, w.tlut());
                        let regs = if mma { [0, 1, 2, 3] } else { [0, 2, 1, 3] };
                        for (j, pair) in pairs.iter().enumerate() {
                            let (row, col) = match regs[j] {
                                0 => (g, 2 * tq),
                                1 => (g + 8, 2 * tq),
                                2 => (g, 2 * tq + 8),
                                _ => (g + 8, 2 * tq + 8),
                            };
                            a[row][col] = pair[0];
                            a[row][col + 1] = pair[1];
                        }
                        // B: the lane's 4 plane values at its offset, or zeros.
                        let (boff, keep) = if mma {
                            (4 * tq, true)
                        } else {
                            let l = lane >> 3;
                            (8 * (tq & 1) + 4 * (l >> 1), (tq >> 1) == (l & 1))
                        };
                        let base = (u * UNIT_TILES + t) * 16 + boff;
                        // hi plane carries x, lo plane zero (x unsplit here).
                        let lo_plane = if mma {
                            g & 1 == 1
                        } else {
                            (lane >> 2) & 1 == 1
                        };
                        let v: Vec<f64> = (0..4)
                            .map(|e| {
                                if keep && !lo_plane {
                                    plane[base + e]
                                } else {
                                    0.0
                                }
                            })
                            .collect();
                        b[2 * tq][g] = v[0];
                        b[2 * tq + 1][g] = v[1];
                        b[2 * tq + 8][g] = v[2];
                        b[2 * tq + 9][g] = v[3];
                    }
                    for (lane, dl) in d.iter_mut().enumerate() {
                        let (g, tq) = (lane >> 2, lane & 3);
                        for (e, (r, c)) in [
                            (g, 2 * tq),
                            (g, 2 * tq + 1),
                            (g + 8, 2 * tq),
                            (g + 8, 2 * tq + 1),
                        ]
                        .into_iter()
                        .enumerate()
                        {
                            dl[e] += (0..16).map(|kk| a[r][kk] * b[kk][c]).sum::<f64>();
                        }
                    }
                }
            }
            // The flush's reduction.
            for lane in 0..32 {
                let (g, tq) = (lane >> 2, lane & 3);
                if mma {
                    if tq == 0 {
                        y[tr * 16 + g] = (d[lane][0] + d[lane][1]) * scale;
                        y[tr * 16 + g + 8] = (d[lane][2] + d[lane][3]) * scale;
                    }
                } else {
                    let v = |l: usize| {
                        if l & 3 < 2 {
                            d[l][0] + d[l][1]
                        } else {
                            d[l][2] + d[l][3]
                        }
                    };
                    if tq < 2 {
                        y[tr * 16 + 2 * g + tq] = (v(lane) + v(lane ^ 2)) * scale;
                    }
                }
            }
        }
        y
    }

    /// The prefill GEMM (trellis.cu `tr_gemm_body`) over one n-block of 8 tokens: A from the
    /// lanes' pairs (row-major tiles after the exchange with lane t ^ 2), B from each lane's
    /// 8-byte chunk of the staged planes, the rows each C register lands in.
    fn emulate_gemm(w: &TrellisQuantized, xs: &[Vec<f32>]) -> Vec<Vec<f64>> {
        let k = usize::from(w.scheme().k);
        let mma = w.scheme().order == TileOrder::Mma;
        let packed = pack_units(w);
        let n_units = units(w.cols());
        let planes: Vec<Vec<f64>> = xs.iter().map(|x| plane(w, x)).collect();
        let scale = code_scale(w);
        let mut y = vec![vec![0.0f64; w.rows()]; xs.len()];
        for tr in 0..w.rows() / 16 {
            let mut d = [[0.0f64; 8]; 16];
            for u in 0..n_units {
                let words = lane_words(&packed, k, n_units, tr, u);
                for t in 0..UNIT_TILES {
                    let own: Vec<u32> = (0..32).map(|l| own_bits(&words[l], k, t)).collect();
                    let pairs: Vec<[[f64; 2]; 4]> = (0..32)
                        .map(|l| {
                            let window = tile_window(k, own[l], own[(l + 1) & 31]);
                            decode_window(w.scheme().code, k, window, w.tlut())
                        })
                        .collect();
                    let mut a = [[0.0f64; 16]; 16];
                    let mut b = [[0.0f64; 8]; 16];
                    for lane in 0..32 {
                        let (g, tq) = (lane >> 2, lane & 3);
                        let p = pairs[lane];
                        let fa = if mma {
                            p
                        } else {
                            let (mine, partner) = (p, pairs[lane ^ 2]);
                            if tq < 2 {
                                [mine[0], partner[0], mine[1], partner[1]]
                            } else {
                                [partner[2], mine[2], partner[3], mine[3]]
                            }
                        };
                        for (reg, pair) in fa.iter().enumerate() {
                            let row = g + 8 * (reg & 1);
                            let col = 2 * tq + 8 * (reg >> 1);
                            a[row][col] = pair[0];
                            a[row][col + 1] = pair[1];
                        }
                        let chunk = if mma { tq } else { 2 * (tq & 1) + (tq >> 1) };
                        let base = (u * UNIT_TILES + t) * 16 + 4 * chunk;
                        if let Some(pl) = planes.get(g) {
                            b[2 * tq][g] = pl[base];
                            b[2 * tq + 1][g] = pl[base + 1];
                            b[2 * tq + 8][g] = pl[base + 2];
                            b[2 * tq + 9][g] = pl[base + 3];
                        }
                    }
                    for (r, dr) in d.iter_mut().enumerate() {
                        for (n, dn) in dr.iter_mut().enumerate() {
                            *dn += (0..16).map(|kk| a[r][kk] * b[kk][n]).sum::<f64>();
                        }
                    }
                }
            }
            for (n, yn) in y.iter_mut().enumerate() {
                for g in 0..8 {
                    let (r0, r1) = if mma { (g, g + 8) } else { (2 * g, 2 * g + 1) };
                    yn[tr * 16 + r0] = d[g][n] * scale;
                    yn[tr * 16 + r1] = d[g + 8][n] * scale;
                }
            }
        }
        y
    }

    /// Every code × K × order on 32 × 288 (one full unit and a partial one: zero tiles):
    /// `emulate` of `tokens` random inputs against Ŵ · x from the trellis decoder.
    fn check_against_decoder(
        tokens: usize,
        seed: u64,
        emulate: impl Fn(&TrellisQuantized, &[Vec<f32>]) -> Vec<Vec<f64>>,
    ) {
        let codes = [
            TrellisCode::Hyb { q: 9 },
            TrellisCode::OneMad,
            TrellisCode::ThreeInst,
        ];
        let (rows, cols) = (32, 288);
        for code in codes {
            for k in 2..=4u8 {
                for order in [TileOrder::RowMajor, TileOrder::Mma] {
                    let w = weight(code, k, order, rows, cols);
                    let mut state = seed;
                    let xs: Vec<Vec<f32>> = (0..tokens)
                        .map(|_| {
                            (0..cols)
                                .map(|_| (lcg(&mut state) % 2001) as f32 / 1000.0 - 1.0)
                                .collect()
                        })
                        .collect();
                    let deq = decode_rotated(&w);
                    let got = emulate(&w, &xs);
                    for (n, x) in xs.iter().enumerate() {
                        for r in 0..rows {
                            let want: f64 = (0..cols)
                                .map(|c| f64::from(deq[r * cols + c]) * f64::from(x[c]))
                                .sum();
                            assert!(
                                (got[n][r] - want).abs() <= 1e-5 * (1.0 + want.abs()),
                                "{code:?} K{k} {order:?} token {n} row {r}: {} vs {want}",
                                got[n][r]
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn gemm_fragments_reproduce_the_decoded_product() {
        check_against_decoder(8, 5, emulate_gemm);
    }

    #[test]
    fn packed_lane_arithmetic_reproduces_the_decoded_matvec() {
        check_against_decoder(1, 3, |w, xs| vec![emulate(w, &xs[0])]);
    }

    #[test]
    fn packing_places_each_lane_chunk_contiguously() {
        let w = weight(TrellisCode::Hyb { q: 9 }, 2, TileOrder::RowMajor, 16, 256);
        let packed = pack_units(&w);
        assert_eq!(packed.len(), 32 * 2 * 4);
        // Lane 5's first word: tile 0's bytes 10, 11 then tile 1's bytes 10, 11.
        let (t0, t1) = (w.tile(0, 0), w.tile(0, 1));
        let want = u32::from_be_bytes([t0[10], t0[11], t1[10], t1[11]]);
        assert_eq!(packed[5 * 4], want);
        // Chunk 1 (tiles 8..16) starts after all 32 lanes' chunk 0.
        let t8 = w.tile(0, 8);
        assert_eq!(
            packed[(32 + 5) * 4] >> 16,
            u32::from(t8[10]) << 8 | u32::from(t8[11])
        );
    }
}

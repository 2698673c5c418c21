//! Decode-step attention of the query heads sharing one KV head over a quantized cache:
//! resident scores, the eq. 7 group selection, the resident weighted sum and the eq. 8
//! correction with refined keys and values of the selected groups.
//!
//! Everything here is in the base's code frame (KVarN: Hadamard-rotated); the caller rotates
//! queries in and outputs back. Positions are ordered sinks (FP16) → encoded tiles → tail
//! (FP16, including the token being decoded); only tile tokens are eligible for refinement,
//! the others are already FP16.

use half::f16;
use half::slice::HalfFloatSliceExt;

use rayon::prelude::*;

use super::base::{KvBase, RefineBits};
use super::bitpack;
use crate::backend::cpu::math::{self, multiversioned};
use crate::backend::cpu::SimdLevel;
use crate::refine::store::Fetched;

/// One KV head's stored positions.
pub struct HeadView<'a> {
    pub head_dim: usize,
    /// `[n_sink, head_dim]` keys and values.
    pub sink_k: &'a [f16],
    pub sink_v: &'a [f16],
    /// Encoded tiles, `tile_bytes` each (empty without a base).
    pub tiles: &'a [u8],
    /// `[n_tail, head_dim]` keys and values.
    pub tail_k: &'a [f16],
    pub tail_v: &'a [f16],
    pub base: Option<&'a dyn KvBase>,
}

impl HeadView<'_> {
    fn tile_geometry(&self) -> (usize, usize, usize) {
        match self.base {
            Some(b) if b.tile_bytes() > 0 => (
                b.tile_tokens(),
                b.tile_bytes(),
                self.tiles.len() / b.tile_bytes(),
            ),
            _ => (0, 0, 0),
        }
    }

    /// Positions stored: sinks + tiles + tail.
    pub fn len(&self) -> usize {
        let (tile, _, n_tiles) = self.tile_geometry();
        (self.sink_k.len() + self.tail_k.len()) / self.head_dim.max(1) + tile * n_tiles
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Fetches the refinement unit of (tile, group within tile) into the buffer.
pub type UnitFetch<'a> = dyn Fn(usize, usize, &mut Vec<u8>) -> Fetched + Sync + 'a;

/// Refinement of one decode step.
pub struct RefineStep<'a> {
    pub bits: RefineBits,
    /// Tokens per group; divides the tile length.
    pub group: usize,
    /// Fraction of eligible groups to select (at least one group when any is eligible).
    pub fraction: f64,
    pub fetch: &'a UnitFetch<'a>,
}

/// What one head's step selected and applied.
#[derive(Debug, Default, Clone)]
pub struct HeadOutcome {
    /// Selected groups (tile · groups_per_tile + group), ascending.
    pub selected: Vec<usize>,
    /// Groups whose refinement was applied (fetched).
    pub applied: usize,
    /// Groups whose unit was skipped or failed (resident precision used).
    pub missed: usize,
    pub bytes_fetched: u64,
}

/// Bit offsets of token `t`'s key and value sub-interval indices inside a refinement unit of
/// `g` tokens: all key indices of the group first, then all value indices, token-major.
pub(crate) fn unit_bit_offsets(bits: RefineBits, g: usize, d: usize, t: usize) -> (usize, usize) {
    let (bk, bv) = (bits.key as usize, bits.value as usize);
    (t * d * bk, g * d * bk + t * d * bv)
}

/// Refined key and value (`d` each) of token `t` of a `g`-token unit whose tile position is
/// `tt`; `sub` is `d` bytes of scratch.
#[allow(clippy::too_many_arguments)]
pub(crate) fn refined_token(
    base: &dyn KvBase,
    tile: &[u8],
    unit: &[u8],
    bits: RefineBits,
    g: usize,
    t: usize,
    tt: usize,
    sub: &mut [u8],
    key: &mut [f32],
    value: &mut [f32],
) {
    let d = base.head_dim();
    let (k_at, v_at) = unit_bit_offsets(bits, g, d, t);
    bitpack::unpack(unit, bits.key, k_at, sub);
    base.refined_key(tile, tt, sub, bits.key, key);
    bitpack::unpack(unit, bits.value, v_at, sub);
    base.refined_value(tile, tt, sub, bits.value, value);
}

/// Groups selected among `eligible`: the fraction rounded up, at least one when any exists.
pub fn groups_to_select(eligible: usize, fraction: f64) -> usize {
    if eligible == 0 {
        return 0;
    }
    ((eligible as f64 * fraction).ceil() as usize).clamp(1, eligible)
}

/// Stored positions are processed in blocks of at most this many tokens (FP16 runs are cut
/// at this size; a tile is one block).
const BLOCK: usize = 128;
/// Blocks per parallel task: 1,024 positions amortise the task overhead while an 8K context
/// still gives every thread several tasks per layer.
const BLOCKS_PER_TASK: usize = 8;

#[derive(Clone, Copy)]
enum Source {
    Sink(usize),
    Tile(usize),
    Tail(usize),
}

/// One block of positions: where it is stored and its first position.
#[derive(Clone, Copy)]
struct Block {
    source: Source,
    n: usize,
}

fn blocks(view: &HeadView<'_>) -> Vec<Block> {
    let d = view.head_dim;
    let (tile, _, n_tiles) = view.tile_geometry();
    let mut out = Vec::new();
    let n_sink = view.sink_k.len() / d;
    for b in 0..n_sink.div_ceil(BLOCK) {
        let n = (n_sink - b * BLOCK).min(BLOCK);
        out.push(Block {
            source: Source::Sink(b),
            n,
        });
    }
    for i in 0..n_tiles {
        out.push(Block {
            source: Source::Tile(i),
            n: tile,
        });
    }
    let n_tail = view.tail_k.len() / d;
    for b in 0..n_tail.div_ceil(BLOCK) {
        let n = (n_tail - b * BLOCK).min(BLOCK);
        out.push(Block {
            source: Source::Tail(b),
            n,
        });
    }
    out
}

/// Online-softmax state of a run of blocks, per query head: running max `m`, sum `z` of
/// e^{ℓ−m} and unnormalised output `o`; plus the per-group weight sums of tile blocks
/// (`[group][head]`, relative to the final `m`), for eq. 7.
struct Partial {
    m: Vec<f32>,
    z: Vec<f32>,
    o: Vec<f32>,
    /// First eligible group covered and the group sums.
    first_group: usize,
    group_sums: Vec<f32>,
}

/// f32 lanes of one AVX-512 register.
const LANES: usize = 16;

/// One block into the online softmax: scores, rescale on a new max, e^{ℓ−m}, weighted values,
/// and (group > 0) per-group weight sums written to `gs` (`[n / group][heads]`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn block_body(
    q: &[f32],
    d: usize,
    k_cm: &[f32],
    v_tm: &[f32],
    n: usize,
    w: &mut [f32],
    m: &mut [f32],
    z: &mut [f32],
    o: &mut [f32],
    group: usize,
    gs: &mut [f32],
) {
    let heads = m.len();
    for h in 0..heads {
        let wh = &mut w[..n];
        let qh = &q[h * d..(h + 1) * d];
        // 16 scores stay in one register across the channel loop (a plain axpy per channel
        // would load and store all n scores d times); same summation order as that axpy.
        let mut t0 = 0;
        while t0 + LANES <= n {
            let mut acc = [0.0f32; LANES];
            for (c, &qc) in qh.iter().enumerate() {
                let k = &k_cm[c * n + t0..c * n + t0 + LANES];
                for j in 0..LANES {
                    acc[j] += qc * k[j];
                }
            }
            wh[t0..t0 + LANES].copy_from_slice(&acc);
            t0 += LANES;
        }
        for (t, x) in wh.iter_mut().enumerate().skip(t0) {
            *x = qh
                .iter()
                .enumerate()
                .fold(0.0, |a, (c, &qc)| a + qc * k_cm[c * n + t]);
        }
        let bm = math::max(wh);
        if bm > m[h] {
            let r = math::exp(m[h] - bm);
            z[h] *= r;
            o[h * d..(h + 1) * d].iter_mut().for_each(|x| *x *= r);
            m[h] = bm;
        }
        z[h] += math::exp_shift_sum(wh, m[h]);
        let oh = &mut o[h * d..(h + 1) * d];
        if d.is_multiple_of(LANES) {
            // Output lanes in a register across the token loop; same order as an axpy per token.
            for c0 in (0..d).step_by(LANES) {
                let mut acc = [0.0f32; LANES];
                acc.copy_from_slice(&oh[c0..c0 + LANES]);
                for (t, &wt) in wh.iter().enumerate() {
                    let v = &v_tm[t * d + c0..t * d + c0 + LANES];
                    for j in 0..LANES {
                        acc[j] += wt * v[j];
                    }
                }
                oh[c0..c0 + LANES].copy_from_slice(&acc);
            }
        } else {
            for (t, &wt) in wh.iter().enumerate() {
                math::axpy(wt, &v_tm[t * d..(t + 1) * d], oh);
            }
        }
        if group > 0 {
            for (gi, chunk) in wh.chunks_exact(group).enumerate() {
                gs[gi * heads + h] = chunk.iter().sum();
            }
        }
    }
}

multiversioned! {
    #[allow(clippy::too_many_arguments)]
    fn block_kernel(
        q: &[f32],
        d: usize,
        k_cm: &[f32],
        v_tm: &[f32],
        n: usize,
        w: &mut [f32],
        m: &mut [f32],
        z: &mut [f32],
        o: &mut [f32],
        group: usize,
        gs: &mut [f32],
    ) = block_body;
}

/// FP16 token-major rows → f32 channel-major `[d, n]` (via the token-major `tmp`).
fn f16_to_channel_major(src: &[f16], d: usize, tmp: &mut [f32], out: &mut [f32]) {
    let n = src.len() / d;
    src.convert_to_f32_slice(&mut tmp[..n * d]);
    for t in 0..n {
        for c in 0..d {
            out[c * n + t] = tmp[t * d + c];
        }
    }
}

/// The online softmax over `blocks` (consecutive); `group > 0` records eq. 7 group sums of
/// tile blocks.
fn run_blocks(
    level: SimdLevel,
    view: &HeadView<'_>,
    q: &[f32],
    blocks: &[Block],
    group: usize,
) -> Partial {
    let d = view.head_dim;
    let gq = q.len() / d;
    let (tile, tile_bytes, _) = view.tile_geometry();
    let cap = BLOCK.max(tile);
    let mut kbuf = vec![0.0f32; d * cap];
    let mut vbuf = vec![0.0f32; d * cap];
    let mut tmp = vec![0.0f32; d * cap];
    let mut w = vec![0.0f32; cap];
    let mut m = vec![f32::NEG_INFINITY; gq];
    let mut z = vec![0.0f32; gq];
    let mut o = vec![0.0f32; gq * d];
    let per_tile = tile.checked_div(group).unwrap_or(0);
    let tiles: Vec<usize> = blocks
        .iter()
        .filter_map(|b| match b.source {
            Source::Tile(i) => Some(i),
            _ => None,
        })
        .collect();
    let first_group = tiles.first().map_or(0, |&i| i * per_tile);
    let mut group_sums = vec![0.0f32; tiles.len() * per_tile * gq];
    // m at the time each tile's group sums were taken, to rescale them to the final m.
    let mut m_at: Vec<f32> = Vec::with_capacity(tiles.len() * gq);
    for b in blocks {
        let n = b.n;
        let (k_src, v_src) = match b.source {
            Source::Sink(i) => (
                &view.sink_k[i * BLOCK * d..(i * BLOCK + n) * d],
                &view.sink_v[i * BLOCK * d..(i * BLOCK + n) * d],
            ),
            Source::Tail(i) => (
                &view.tail_k[i * BLOCK * d..(i * BLOCK + n) * d],
                &view.tail_v[i * BLOCK * d..(i * BLOCK + n) * d],
            ),
            Source::Tile(i) => {
                let (Some(base), bytes) =
                    (view.base, &view.tiles[i * tile_bytes..(i + 1) * tile_bytes])
                else {
                    continue;
                };
                base.decode_keys(bytes, &mut kbuf[..d * n]);
                base.decode_values(bytes, &mut vbuf[..n * d]);
                let k = tiles.iter().position(|&t| t == i).unwrap_or(0);
                let gs = if group > 0 {
                    &mut group_sums[k * per_tile * gq..(k + 1) * per_tile * gq]
                } else {
                    &mut []
                };
                block_kernel(
                    level,
                    q,
                    d,
                    &kbuf[..d * n],
                    &vbuf[..n * d],
                    n,
                    &mut w,
                    &mut m,
                    &mut z,
                    &mut o,
                    group,
                    gs,
                );
                m_at.extend_from_slice(&m);
                continue;
            }
        };
        f16_to_channel_major(k_src, d, &mut tmp, &mut kbuf);
        v_src.convert_to_f32_slice(&mut vbuf[..n * d]);
        block_kernel(
            level,
            q,
            d,
            &kbuf[..d * n],
            &vbuf[..n * d],
            n,
            &mut w,
            &mut m,
            &mut z,
            &mut o,
            0,
            &mut [],
        );
    }
    if group > 0 {
        for (k, snap) in m_at.chunks_exact(gq).enumerate() {
            for h in 0..gq {
                let r = (snap[h] - m[h]).exp();
                for g in 0..per_tile {
                    group_sums[(k * per_tile + g) * gq + h] *= r;
                }
            }
        }
    }
    Partial {
        m,
        z,
        o,
        first_group,
        group_sums,
    }
}

/// Attention of the `q.len() / head_dim` query heads of one KV head for one decode position
/// (which must already be stored, as the tail's last token). `q` is in the code frame and
/// pre-scaled by 1/√d; `out` receives the (corrected) outputs in the code frame.
pub fn attend_head(
    level: SimdLevel,
    view: &HeadView<'_>,
    q: &[f32],
    out: &mut [f32],
    refine: Option<&RefineStep<'_>>,
) -> HeadOutcome {
    let d = view.head_dim;
    let gq = q.len() / d;
    let (tile, tile_bytes, n_tiles) = view.tile_geometry();
    let refining = match (refine, view.base) {
        (Some(r), Some(_)) => r.group > 0 && tile > 0 && tile % r.group == 0 && !r.bits.is_none(),
        _ => false,
    };
    let group = if refining {
        refine.map_or(0, |r| r.group)
    } else {
        0
    };
    let all = blocks(view);
    let partials: Vec<Partial> = all
        .par_chunks(BLOCKS_PER_TASK)
        .map(|bs| run_blocks(level, view, q, bs, group))
        .collect();

    // Merge the partial softmaxes.
    let mut maxes = vec![f32::NEG_INFINITY; gq];
    for p in &partials {
        for (m, &pm) in maxes.iter_mut().zip(&p.m) {
            *m = m.max(pm);
        }
    }
    let mut sums = vec![0.0f32; gq];
    out.fill(0.0);
    for p in &partials {
        for h in 0..gq {
            if p.m[h] == f32::NEG_INFINITY {
                continue;
            }
            let r = (p.m[h] - maxes[h]).exp();
            sums[h] += p.z[h] * r;
            math::axpy(r, &p.o[h * d..(h + 1) * d], &mut out[h * d..(h + 1) * d]);
        }
    }
    for h in 0..gq {
        let inv = 1.0 / sums[h];
        out[h * d..(h + 1) * d].iter_mut().for_each(|x| *x *= inv);
    }

    let mut outcome = HeadOutcome::default();
    let (Some(r), Some(base), true) = (refine, view.base, refining) else {
        return outcome;
    };
    let g = r.group;
    let per_tile = tile / g;
    let eligible = n_tiles * per_tile;
    let n_sel = groups_to_select(eligible, r.fraction);
    if n_sel == 0 {
        return outcome;
    }

    // Eq. 7: a group's score is the max over query heads of its summed normalised weights.
    let mut scored: Vec<(f32, usize)> = Vec::with_capacity(eligible);
    for p in &partials {
        let scale: Vec<f32> = (0..gq)
            .map(|h| (p.m[h] - maxes[h]).exp() / sums[h])
            .collect();
        for (k, gsum) in p.group_sums.chunks_exact(gq).enumerate() {
            let s = (0..gq)
                .map(|h| gsum[h] * scale[h])
                .fold(f32::NEG_INFINITY, f32::max);
            scored.push((s, p.first_group + k));
        }
    }
    if n_sel < scored.len() {
        scored.select_nth_unstable_by(n_sel - 1, |a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        scored.truncate(n_sel);
    }
    let mut selected: Vec<usize> = scored.into_iter().map(|(_, gi)| gi).collect();
    selected.sort_unstable();

    // Eq. 8 with exponentials relative to m* = max(m, every resident and refined logit of S)
    // per query head:
    // o' = (Z·o + Σ_S (e^{ℓ'}·v' − e^{ℓ}·v)) / (Z + Σ_S (e^{ℓ'} − e^{ℓ})).
    let bits = r.bits;
    let mut unit = Vec::new();
    let mut sub = vec![0u8; d];
    let zero_sub = vec![0u8; d];
    let mut k_vec = vec![0.0f32; d];
    struct Token {
        old_logits: Vec<f32>,
        new_logits: Vec<f32>,
        v_res: Vec<f32>,
        v_ref: Vec<f32>,
    }
    let mut tokens: Vec<Token> = Vec::new();
    let dot = |qh: &[f32], k: &[f32]| qh.iter().zip(k).map(|(a, b)| a * b).sum::<f32>();
    for &gi in &selected {
        let (ti, gt) = (gi / per_tile, gi % per_tile);
        let fetched = (r.fetch)(ti, gt, &mut unit);
        if !fetched.has_bytes() {
            outcome.missed += 1;
            continue;
        }
        outcome.bytes_fetched += unit.len() as u64;
        outcome.applied += 1;
        let tile_data = &view.tiles[ti * tile_bytes..(ti + 1) * tile_bytes];
        for t in 0..g {
            let tt = gt * g + t;
            let logits = |k: &[f32]| -> Vec<f32> {
                (0..gq).map(|h| dot(&q[h * d..(h + 1) * d], k)).collect()
            };
            let mut v_ref = vec![0.0f32; d];
            let mut v_res = vec![0.0f32; d];
            base.refined_key(tile_data, tt, &zero_sub, 0, &mut k_vec);
            base.refined_value(tile_data, tt, &zero_sub, 0, &mut v_res);
            let old_logits = logits(&k_vec);
            refined_token(
                base, tile_data, &unit, bits, g, t, tt, &mut sub, &mut k_vec, &mut v_ref,
            );
            // With 0 key bits the refined key is the resident one: same logits.
            let new_logits = logits(&k_vec);
            tokens.push(Token {
                old_logits,
                new_logits,
                v_res,
                v_ref,
            });
        }
    }
    outcome.selected = selected;
    if tokens.is_empty() {
        return outcome;
    }
    for h in 0..gq {
        let ms = tokens
            .iter()
            .flat_map(|t| [t.old_logits[h], t.new_logits[h]])
            .fold(maxes[h], f32::max);
        let scale = f64::from(sums[h]) * f64::from(maxes[h] - ms).exp();
        let mut den = scale;
        let mut num: Vec<f64> = out[h * d..(h + 1) * d]
            .iter()
            .map(|&x| scale * f64::from(x))
            .collect();
        for t in &tokens {
            let e_new = f64::from(t.new_logits[h] - ms).exp();
            let e_old = f64::from(t.old_logits[h] - ms).exp();
            den += e_new - e_old;
            for ((n, &vr), &vs) in num.iter_mut().zip(&t.v_ref).zip(&t.v_res) {
                *n += e_new * f64::from(vr) - e_old * f64::from(vs);
            }
        }
        for (o, n) in out[h * d..(h + 1) * d].iter_mut().zip(&num) {
            *o = (n / den) as f32;
        }
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selection_count_rounds_up() {
        assert_eq!(groups_to_select(0, 1.0 / 128.0), 0);
        assert_eq!(groups_to_select(10, 1.0 / 128.0), 1);
        assert_eq!(groups_to_select(3968, 1.0 / 128.0), 31);
        assert_eq!(groups_to_select(5, 1.0), 5);
    }
}

//! Causal grouped-query attention over a `[kv_heads, capacity, head_dim]` f32 cache.
//!
//! Two schedules, one result (both are exact softmax attention, max-subtracted in f32):
//! - **Prefill** (many queries): FlashAttention-2-style online softmax (Dao 2023, Alg. 1) on
//!   blocks of queries × chunks of keys, with both products as faer GEMMs. The query heads
//!   sharing a KV head are stacked into one GEMM so each key chunk is packed once per group.
//!   Key chunks past a block's last query are never touched, so causal prefill does half the
//!   work of full attention. Memory is O(block × chunk), not O(n²). Measured 135–155 GF/s of
//!   causal work on 2 cores (SmolLM2, 512-query chunks at 0–1536 past): ~30 % of a
//!   2048-token prefill.
//! - **Decode** (≤ 4 queries): split-K ("flash-decoding"): each task scores one chunk of keys
//!   for one KV head and returns (max, sum, unnormalised output); partials merge exactly. This
//!   keeps every core streaming the cache at long context, where one KV head per task would
//!   leave cores idle (SmolLM2 has 3 KV heads).

use super::math::{self, multiversioned};
use super::scratch::with_scratch;
use super::spin_pool::SpinPool;
use super::SimdLevel;
use crate::backend::AttentionShape;
use faer::{Accum, MatMut, MatRef, Par};
use rayon::prelude::*;

/// Up to this many queries use the split-K decode schedule.
const DECODE_MAX_QUERIES: usize = 4;
/// Keys per online-softmax step in prefill: the score tile (group·block × chunk f32, 384 KiB
/// for 3 heads × 64 queries × 512 keys) stays in L2.
const PREFILL_KEY_CHUNK: usize = 512;
/// Smallest key chunk per decode task: below ~256 keys the fork/join costs more than the work.
const DECODE_MIN_CHUNK: usize = 256;
/// Decode splits the keys into up to this many chunks per KV head: with SmolLM2's 3 KV heads,
/// 48 tasks, ≥ 2 per thread at 16 threads.
const DECODE_CHUNKS: usize = 16;

/// Computes attention; the caller has checked every buffer length against `s`.
pub(crate) fn attention(
    level: SimdLevel,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: &AttentionShape,
    out: &mut [f32],
) {
    if s.n_queries == 0 {
        return;
    }
    if s.n_queries <= DECODE_MAX_QUERIES {
        decode(super::spin_pool::pool(), level, q, k, v, s, out);
    } else {
        prefill(level, q, k, v, s, out);
    }
}

fn prefill(level: SimdLevel, q: &[f32], k: &[f32], v: &[f32], s: &AttentionShape, out: &mut [f32]) {
    let q_dim = s.q_dim();
    let threads = rayon::current_num_threads().max(1);
    // ≥ 4 blocks per thread so work stealing evens out the triangular (causal) cost.
    let block = s.n_queries.div_ceil(4 * threads).clamp(16, 64);
    out.par_chunks_mut(block * q_dim)
        .enumerate()
        .for_each(|(b, ob)| prefill_block(level, q, k, v, s, b * block, ob));
}

/// Attention for queries `t0..t0 + ob.len() / q_dim`, all heads.
fn prefill_block(
    level: SimdLevel,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: &AttentionShape,
    t0: usize,
    ob: &mut [f32],
) {
    let hd = s.kv.head_dim;
    let nb = ob.len() / s.q_dim();
    let rows = s.group() * nb;
    // Keys up to and including the block's last query position.
    let kend = s.past + t0 + nb;
    let chunk_cap = PREFILL_KEY_CHUNK.min(kend);
    with_scratch(rows * (2 * hd + chunk_cap + 2), |scratch| {
        let (qs, rest) = scratch.split_at_mut(rows * hd);
        let (acc, rest) = rest.split_at_mut(rows * hd);
        let (scores, rest) = rest.split_at_mut(rows * chunk_cap);
        let (row_max, row_sum) = rest.split_at_mut(rows);
        let tiles = Tiles {
            qs,
            acc,
            scores,
            row_max,
            row_sum,
        };
        prefill_heads(level, q, k, v, s, t0, nb, ob, tiles);
    });
}

/// Scratch of one prefill block: stacked scaled queries, output accumulator, score tile and
/// the online-softmax row state.
struct Tiles<'a> {
    qs: &'a mut [f32],
    acc: &'a mut [f32],
    scores: &'a mut [f32],
    row_max: &'a mut [f32],
    row_sum: &'a mut [f32],
}

#[allow(clippy::too_many_arguments)]
fn prefill_heads(
    level: SimdLevel,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: &AttentionShape,
    t0: usize,
    nb: usize,
    ob: &mut [f32],
    tiles: Tiles<'_>,
) {
    let Tiles {
        qs,
        acc,
        scores,
        row_max,
        row_sum,
    } = tiles;
    let hd = s.kv.head_dim;
    let q_dim = s.q_dim();
    let group = s.group();
    let rows = group * nb;
    let scale = 1.0 / (hd as f32).sqrt();
    let kend = s.past + t0 + nb;
    let head_stride = s.kv.capacity * hd;

    for g in 0..s.kv.kv_heads {
        // Stack the group's heads: row hl·nb + i = query t0 + i of head g·group + hl, scaled.
        for hl in 0..group {
            let h = g * group + hl;
            for i in 0..nb {
                let src = &q[(t0 + i) * q_dim + h * hd..][..hd];
                for (d, &x) in qs[(hl * nb + i) * hd..][..hd].iter_mut().zip(src) {
                    *d = x * scale;
                }
            }
        }
        acc.fill(0.0);
        row_max.fill(f32::NEG_INFINITY);
        row_sum.fill(0.0);
        let kh = &k[g * head_stride..][..kend * hd];
        let vh = &v[g * head_stride..][..kend * hd];
        let qm = MatRef::from_row_major_slice(qs, rows, hd);

        let mut c0 = 0;
        while c0 < kend {
            let w = PREFILL_KEY_CHUNK.min(kend - c0);
            let sc = &mut scores[..rows * w];
            let km = MatRef::from_row_major_slice(&kh[c0 * hd..(c0 + w) * hd], w, hd);
            faer::linalg::matmul::matmul(
                MatMut::from_row_major_slice_mut(sc, rows, w),
                Accum::Replace,
                qm,
                km.transpose(),
                1.0f32,
                Par::Seq,
            );
            for r in 0..rows {
                let pos = s.past + t0 + r % nb;
                // Keys c0..c0 + valid are at or before this query's position.
                let valid = (pos + 1).saturating_sub(c0).min(w);
                let srow = &mut sc[r * w..(r + 1) * w];
                srow[valid..].fill(0.0);
                if valid == 0 {
                    continue;
                }
                let (m_new, corr, sum) = softmax_step(level, &mut srow[..valid], row_max[r]);
                row_sum[r] = row_sum[r] * corr + sum;
                row_max[r] = m_new;
                if corr != 1.0 {
                    for a in &mut acc[r * hd..(r + 1) * hd] {
                        *a *= corr;
                    }
                }
            }
            let vm = MatRef::from_row_major_slice(&vh[c0 * hd..(c0 + w) * hd], w, hd);
            faer::linalg::matmul::matmul(
                MatMut::from_row_major_slice_mut(acc, rows, hd),
                Accum::Add,
                MatRef::from_row_major_slice(&scores[..rows * w], rows, w),
                vm,
                1.0f32,
                Par::Seq,
            );
            c0 += w;
        }
        for hl in 0..group {
            let h = g * group + hl;
            for i in 0..nb {
                let r = hl * nb + i;
                // Every query sees at least itself, so row_sum ≥ 1 after max subtraction.
                let inv = 1.0 / row_sum[r];
                let dst = &mut ob[i * q_dim + h * hd..][..hd];
                for (d, &a) in dst.iter_mut().zip(&acc[r * hd..(r + 1) * hd]) {
                    *d = a * inv;
                }
            }
        }
    }
}

/// One online-softmax step on a row of scores: returns (new max, factor rescaling the old
/// sum/output, sum of the new probabilities) and leaves `exp(score − new max)` in `row`.
fn softmax_step(level: SimdLevel, row: &mut [f32], old_max: f32) -> (f32, f32, f32) {
    let m = row_max(level, row).max(old_max);
    let corr = if old_max == f32::NEG_INFINITY {
        0.0
    } else {
        math::exp(old_max - m)
    };
    let sum = exp_shift_sum(level, row, m);
    (m, corr, sum)
}

multiversioned! {
    fn row_max(row: &[f32]) -> f32 = math::max;
}
multiversioned! {
    fn exp_shift_sum(row: &mut [f32], shift: f32) -> f32 = math::exp_shift_sum;
}

/// Per (query, head) partial of split-K decode: running max, sum and unnormalised output.
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    out: Vec<f32>,
}

fn decode(
    pool: &SpinPool,
    level: SimdLevel,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: &AttentionShape,
    out: &mut [f32],
) {
    let hd = s.kv.head_dim;
    let q_dim = s.q_dim();
    let group = s.group();
    let nq = s.n_queries;
    let total = s.past + nq;
    // The split depends on the context length only, never on the thread count: the merge
    // below adds the chunks' partial sums in float, so another split rounds differently. When
    // the split followed the thread count, `sfx-run -t 1` and `-t 2` sampled different text
    // from the same seed once the context passed 2 × DECODE_MIN_CHUNK tokens (issue 20).
    let chunk = total.div_ceil(DECODE_CHUNKS).max(DECODE_MIN_CHUNK);
    let n_chunks = total.div_ceil(chunk);
    let scale = 1.0 / (hd as f32).sqrt();
    let head_stride = s.kv.capacity * hd;

    // Queries regrouped per KV head and pre-scaled: [kv_head][t][hl][hd].
    let mut qg = vec![0.0f32; s.kv.kv_heads * nq * group * hd];
    for g in 0..s.kv.kv_heads {
        for t in 0..nq {
            for hl in 0..group {
                let src = &q[t * q_dim + (g * group + hl) * hd..][..hd];
                let dst = &mut qg[((g * nq + t) * group + hl) * hd..][..hd];
                for (d, &x) in dst.iter_mut().zip(src) {
                    *d = x * scale;
                }
            }
        }
    }

    // On the decode pool, not rayon: this runs between two matvecs of every layer, and a
    // rayon worker woken here would compete with the pool's spinning worker for the cores.
    let mut partials: Vec<Partial> = (0..s.kv.kv_heads * n_chunks)
        .map(|_| Partial {
            max: vec![f32::NEG_INFINITY; nq * group],
            sum: vec![0.0; nq * group],
            out: vec![0.0; nq * group * hd],
        })
        .collect();
    pool.for_each_chunk_mut(&mut partials, 1, |task, one| {
        let p = &mut one[0];
        let g = task / n_chunks;
        let c0 = (task % n_chunks) * chunk;
        let c1 = (c0 + chunk).min(total);
        let kh = &k[g * head_stride..];
        let vh = &v[g * head_stride..];
        let mut scores = vec![0.0f32; group * (c1 - c0)];
        for t in 0..nq {
            let end = (s.past + t + 1).min(c1);
            if end <= c0 {
                continue;
            }
            let w = end - c0;
            let qt = &qg[(g * nq + t) * group * hd..][..group * hd];
            let base = t * group;
            decode_chunk(
                level,
                qt,
                &kh[c0 * hd..end * hd],
                &vh[c0 * hd..end * hd],
                hd,
                &mut scores[..group * w],
                &mut p.out[base * hd..(base + group) * hd],
                &mut p.max[base..base + group],
                &mut p.sum[base..base + group],
            );
        }
    });

    // Exact merge: o = Σ_c e^{m_c − M} o_c / Σ_c e^{m_c − M} l_c.
    for g in 0..s.kv.kv_heads {
        for t in 0..nq {
            for hl in 0..group {
                let i = t * group + hl;
                let parts = &partials[g * n_chunks..(g + 1) * n_chunks];
                let m = parts.iter().fold(f32::NEG_INFINITY, |m, p| m.max(p.max[i]));
                let dst = &mut out[t * q_dim + (g * group + hl) * hd..][..hd];
                dst.fill(0.0);
                let mut l = 0.0f32;
                for p in parts {
                    if p.max[i] == f32::NEG_INFINITY {
                        continue;
                    }
                    let f = math::exp(p.max[i] - m);
                    l += f * p.sum[i];
                    math::axpy(f, &p.out[i * hd..(i + 1) * hd], dst);
                }
                let inv = 1.0 / l;
                for d in dst.iter_mut() {
                    *d *= inv;
                }
            }
        }
    }
}

multiversioned! {
    #[allow(clippy::too_many_arguments)]
    fn decode_chunk(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        hd: usize,
        scores: &mut [f32],
        out: &mut [f32],
        max: &mut [f32],
        sum: &mut [f32],
    ) = decode_chunk_body;
}

/// Scores, softmax partial and weighted value sum of `group` query heads (`q[group, hd]`)
/// against one chunk of keys `k[w, hd]`; each key row is read once for all heads.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn decode_chunk_body(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    hd: usize,
    scores: &mut [f32],
    out: &mut [f32],
    max: &mut [f32],
    sum: &mut [f32],
) {
    let group = max.len();
    let w = k.len() / hd;
    for (j, kj) in k.chunks_exact(hd).enumerate() {
        for hl in 0..group {
            scores[hl * w + j] = math::dot(&q[hl * hd..(hl + 1) * hd], kj);
        }
    }
    for hl in 0..group {
        let row = &mut scores[hl * w..(hl + 1) * w];
        let m = math::max(row);
        max[hl] = m;
        sum[hl] = math::exp_shift_sum(row, m);
    }
    for (j, vj) in v.chunks_exact(hd).enumerate() {
        for hl in 0..group {
            math::axpy(scores[hl * w + j], vj, &mut out[hl * hd..(hl + 1) * hd]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::KvLayout;

    /// Direct O(n²) causal GQA softmax attention in f64.
    fn reference(q: &[f32], k: &[f32], v: &[f32], s: &AttentionShape) -> Vec<f32> {
        let hd = s.kv.head_dim;
        let q_dim = s.q_dim();
        let mut out = vec![0.0f32; s.n_queries * q_dim];
        for t in 0..s.n_queries {
            let pos = s.past + t;
            for h in 0..s.n_heads {
                let g = h / s.group();
                let qv = &q[t * q_dim + h * hd..][..hd];
                let key = |j: usize| &k[(g * s.kv.capacity + j) * hd..][..hd];
                let sc: Vec<f64> = (0..=pos)
                    .map(|j| {
                        qv.iter()
                            .zip(key(j))
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    let o: f64 = (0..=pos)
                        .map(|j| e[j] * v[(g * s.kv.capacity + j) * hd + d] as f64)
                        .sum();
                    out[t * q_dim + h * hd + d] = (o / z) as f32;
                }
            }
        }
        out
    }

    /// A seeded generator of values in [-1, 1) (a 64-bit LCG's high bits).
    fn uniform(seed: u64) -> impl FnMut() -> f32 {
        let mut seed = seed;
        move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    /// The shape of case `(n_heads, kv_heads, head_dim, past, n_queries)` in a cache with
    /// `spare` unused positions, and its q, k, v (scores up to ±8 exercise the max
    /// subtraction).
    fn case_inputs(
        rnd: &mut impl FnMut() -> f32,
        (n_heads, kv_heads, head_dim, past, n_queries): (usize, usize, usize, usize, usize),
        spare: usize,
    ) -> (AttentionShape, Vec<f32>, Vec<f32>, Vec<f32>) {
        let kv = KvLayout {
            kv_heads,
            head_dim,
            capacity: past + n_queries + spare,
        };
        let s = AttentionShape {
            n_heads,
            kv,
            past,
            n_queries,
        };
        let q: Vec<f32> = (0..n_queries * s.q_dim()).map(|_| rnd() * 3.0).collect();
        let k: Vec<f32> = (0..kv.buffer_len()).map(|_| rnd() * 3.0).collect();
        let v: Vec<f32> = (0..kv.buffer_len()).map(|_| rnd()).collect();
        (s, q, k, v)
    }

    /// Decode gives the same bits on 1, 2, 3 and 16 threads: `sfx-run` samples from these
    /// outputs, so a last-bit difference becomes different text from the same seed. Contexts
    /// on both sides of 2 × DECODE_MIN_CHUNK and past DECODE_CHUNKS × DECODE_MIN_CHUNK.
    #[test]
    fn decode_is_bit_identical_across_thread_counts() {
        let mut rnd = uniform(9);
        let pools: Vec<SpinPool> = [0, 1, 2, 15].into_iter().map(SpinPool::new).collect();
        // (n_heads, kv_heads, head_dim, past, n_queries): SmolLM2's attention shape first.
        let cases = [
            (9, 3, 64, 300, 1),
            (9, 3, 64, 1500, 1),
            (9, 3, 64, 5000, 1),
            (4, 2, 16, 700, 3),
        ];
        for &case in &cases {
            let (s, q, k, v) = case_inputs(&mut rnd, case, 0);
            for level in SimdLevel::supported() {
                let outs: Vec<Vec<u32>> = pools
                    .iter()
                    .map(|pool| {
                        let mut got = vec![f32::NAN; s.n_queries * s.q_dim()];
                        decode(pool, level, &q, &k, &v, &s, &mut got);
                        got.iter().map(|x| x.to_bits()).collect()
                    })
                    .collect();
                for (pool, out) in pools.iter().zip(&outs).skip(1) {
                    let differ = out.iter().zip(&outs[0]).filter(|(a, b)| a != b).count();
                    assert!(
                        differ == 0,
                        "{level:?} case {:?}: {differ} outputs differ between 1 and {} threads",
                        case,
                        pool.threads()
                    );
                }
            }
        }
    }

    /// Both schedules, every SIMD tier, with past context, GQA and chunk boundaries crossed.
    /// Tolerance 2e-5 absolute on outputs of magnitude ≤ ~1 (f32 sums of ≤ 1300 terms).
    #[test]
    fn matches_reference_attention() {
        let mut rnd = uniform(5);
        // (n_heads, kv_heads, head_dim, past, n_queries)
        let cases = [
            (4, 2, 8, 0, 1),
            (6, 2, 16, 5, 3),
            (4, 4, 8, 0, 37),
            (6, 3, 16, 600, 1),
            (2, 1, 32, 700, 70),
            (3, 1, 8, 3, 600),
        ];
        for &case in &cases {
            let (s, q, k, v) = case_inputs(&mut rnd, case, 3);
            let want = reference(&q, &k, &v, &s);
            for level in SimdLevel::supported() {
                let mut got = vec![f32::NAN; want.len()];
                attention(level, &q, &k, &v, &s, &mut got);
                let err = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max);
                assert!(err < 2e-5, "{level:?} case {:?}: max err {err}", case);
            }
        }
    }
}

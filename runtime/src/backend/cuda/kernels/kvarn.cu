// KVarN-coded KV cache: decode attention over one layer's stored positions as the quantized
// cache keeps them (issue 15). Per KV head: FP16 sink rows, then encoded tiles, then the FP16
// tail, all in the code frame (rotated by the normalised Hadamard transform). A tile record
// holds key codes [d, tile] (bit i·kb of a little-endian stream, i = channel·tile + token) with
// A, Z per channel and B per token, and value codes [tile, d] with A, Z per token and B per
// channel (docs/format.md, "KVarN tile record"); an element is (code·A + Z)·B, each step
// reconstructed within float rounding of the CPU decoder's value.
//
// Blocks of one KV head (split-K) each walk a run of chunks of at most 128 tokens (one tile,
// or 128 FP16 rows) with an online softmax per query head of the group: thread t scores token
// t of the chunk against every query head, then thread c accumulates output channel c; a
// second launch merges the runs' partial sums.
#include "common.cuh"

#define KV_CHUNK 128
#define KV_MAX_GROUP 8
#define KV_MAX_D 128
// The selection's launch (eq. 7, below): threads of a block, and bins of a radix digit — the
// first is bits 30..20 of a non-negative float (bit 31 is 0), then bits 19..9 and 8..0; each
// thread owns two bins when a digit is found.
#define SEL_THREADS 1024
#define SEL_WARPS (SEL_THREADS / 32)
#define SEL_BINS (2 * SEL_THREADS)

struct KvarnParams {
    const float* q;         // [kv_heads · group][d], code frame (scaled by q_scale on load)
    const __half* sink_k;   // [kv_heads][sink_cap][d]
    const __half* sink_v;
    const uint8_t* tiles;   // [kv_heads][tile_cap][record]
    const __half* tail_k;   // [kv_heads][tail_cap][d]
    const __half* tail_v;
    float* out;             // [kv_heads · group][d]
    float* part;            // split-K partials [kv_heads][splits][group][d + 2], or null
    int group, d;
    int sinks, sink_cap, n_tiles, tile_cap, tail, tail_cap, tile_tokens;
    int kb, vb;
    int record, k_codes, k_a, k_z, k_b, v_codes, v_a, v_z, v_b;
    float q_scale;          // 1/√d, rounded once per element as the host cache does
    int splits;             // blocks per KV head (gridDim.y), each a run of whole chunks
    const uint32_t* pos;    // decode step's position (fill derived from it), or null
    // Eq. 7/8 refinement, when `units` is not null (scratch arrays of the step):
    const uint8_t* units;   // [kv_heads][tile_cap][per_tile][unit_bytes], mapped host memory
    float* glog;            // [kv_heads][tile_cap][per_tile][group]: m + ln Σ e^{ℓ−m} per group
    float* stat;            // [kv_heads · group][d + 2]: merged max M, sum Z, output o = Σ/Z
    uint32_t* keys;         // [kv_heads][tile_cap · per_tile]: score bits of eligible groups
    uint32_t* sel;          // [kv_heads][max_sel]: selected groups, ascending
    uint32_t* sel_count;    // [kv_heads]
    float* cpart;           // [kv_heads][sel_blocks][group][d + 1]: Σ Δ(e·v), Σ Δe per block
    uint32_t* done;         // [kv_heads]: correction blocks finished
    uint32_t* hist;         // [kv_heads][SEL_BINS]: scores per value of their top 11 bits
    uint32_t* score_done;   // [kv_heads]: scoring blocks finished
    double fraction;        // of eligible groups selected (rounded up, at least one)
    int rgroup, per_tile, rkb, rvb, unit_bytes, max_sel, sel_blocks, rotate_out;
    int corr_groups;        // selected groups per correction block
    int cand_cap;           // score bits the selection may gather in shared memory
};

// A layer's fill: from the decode position when there is one (every earlier full tail
// encoded), else as given.
__device__ __forceinline__ void kvarn_fill(const KvarnParams& p, int& sinks, int& n_tiles,
                                           int& tail) {
    sinks = p.sinks, n_tiles = p.n_tiles, tail = p.tail;
    if (p.pos != nullptr) {
        const int at = (int)p.pos[0];
        const int T = p.tile_tokens;
        if (at < p.sink_cap) {
            sinks = at + 1, n_tiles = 0, tail = 0;
        } else {
            sinks = p.sink_cap, n_tiles = (at - p.sink_cap) / T, tail = (at - p.sink_cap) % T + 1;
        }
    }
}

// Element i of an f16 array at byte offset `off` of a record (records of odd geometries put
// arrays at odd offsets, so read bytes).
__device__ __forceinline__ float rec_half(const uint8_t* r, int off, int i) {
    const int at = off + 2 * i;
    return __half2float(__ushort_as_half((unsigned short)(r[at] | (r[at + 1] << 8))));
}

// A code minus its width's centre 2^(bits−1), as a float without a conversion instruction: the
// bits or'ed into the mantissa of 2^23, then 2^23 + centre subtracted (exact for codes below
// 2^23). Centred codes keep the hoisted sums below from cancelling: their terms range over
// about ± half the element's span instead of all of it on one side.
__device__ __forceinline__ float code_float(uint32_t bits, uint32_t mask, float magic) {
    return __uint_as_float((bits & mask) | 0x4b000000u) - magic;
}

// The `bits`-wide code at bit `bit` of a record staged in shared memory as 32-bit words (a
// code may straddle two words; the staging pads one word past the record).
__device__ __forceinline__ float smem_code(const uint32_t* words, int bit, uint32_t mask,
                                           float magic) {
    const int w = bit >> 5;
    return code_float(__funnelshift_r(words[w], words[w + 1], bit & 31), mask, magic);
}

// Per tile, the block stages the record in shared memory (8-byte loads), then scores and
// accumulates from there with the affine terms taken out of the inner loops. A key is
// (code·A + Z)·B with A, Z per channel and B per token; with k = code − centre and
// Z' = Z + A·centre, token t's score is B_t · (Σ_c (q_c·A_c)·k + Σ_c q_c·Z'_c): q·A and the sum
// of q·Z' are computed once per tile. A value is (code·A + Z)·B with A, Z per token and B per
// channel, so channel c accumulates Σ_t (w_t·A_t)·k + Σ_t w_t·Z'_t and takes B_c once per
// tile. The sums are associated differently from the CPU decoder's per-element steps: float
// rounding apart (conformance bound 2e-5). ALIGNED: both code sections start on a word and their codes never straddle one
// (power-of-two widths, rows of whole words), so each code is one shared-memory word shifted
// by a per-thread constant.
template <int MAXG, bool ALIGNED>
__device__ __forceinline__ void kvarn_attn_decode_impl(const KvarnParams& p) {
    extern __shared__ __align__(16) uint8_t dyn[];
    __shared__ __align__(16) float qs[KV_MAX_D][MAXG];  // [channel][query head], scaled
    __shared__ __align__(16) float qa[KV_MAX_D][MAXG];  // q·A of the tile's key channels
    __shared__ __align__(16) float w[KV_CHUNK][MAXG];   // a chunk's scores, then its weights
    __shared__ __align__(16) float wa[KV_CHUNK][MAXG];  // weight·A of the tile's value tokens
    __shared__ float zpart[KV_CHUNK / 32][MAXG];        // per warp: Σ q·Z, then Σ w·Z
    __shared__ float m_run[MAXG], z_run[MAXG], rescale[MAXG], wz[MAXG];
    const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int G = p.group, d = p.d, T = p.tile_tokens;
    // Dynamic shared memory: the staged record (+ one padding word), then the tile's scales.
    const int rec_words = p.record / 4 + 2;
    uint32_t* rec_w = reinterpret_cast<uint32_t*>(dyn);
    const uint8_t* rec_b = dyn;
    float2* v_az = reinterpret_cast<float2*>(dyn + rec_words * 4);  // [T] value A, Z' per token
    float* k_bt = reinterpret_cast<float*>(v_az + T);               // [T] key B per token
    float* v_bc = k_bt + T;                                         // [d] value B per channel
    for (int i = tid; i < G * d; i += KV_CHUNK)
        qs[i % d][i / d] = __fmul_rn(p.q[(size_t)h * G * d + i], p.q_scale);
    for (int i = tid; i < KV_MAX_D * MAXG; i += KV_CHUNK)
        if (i / MAXG >= d || i % MAXG >= G) qs[i / MAXG][i % MAXG] = 0.0f;
    if (tid < MAXG) {
        m_run[tid] = -INFINITY;
        z_run[tid] = 0.0f;
    }
    // The refinement launches after this one count into these (stream order makes it safe).
    if (p.units != nullptr && blockIdx.y == 0) {
        for (int i = tid; i < SEL_BINS; i += KV_CHUNK) p.hist[(size_t)h * SEL_BINS + i] = 0u;
        if (tid == 0) p.score_done[h] = p.done[h] = 0u;
    }
    float o[MAXG];
#pragma unroll
    for (int g = 0; g < MAXG; ++g) o[g] = 0.0f;
    __syncthreads();

    const uint32_t kmask = (1u << p.kb) - 1u, vmask = (1u << p.vb) - 1u;
    const float kc0 = (float)(1u << (p.kb - 1)), vc0 = (float)(1u << (p.vb - 1));
    const float kmagic = 8388608.0f + kc0, vmagic = 8388608.0f + vc0;
    int sinks, n_tiles, tail;
    kvarn_fill(p, sinks, n_tiles, tail);
    const int sink_chunks = (sinks + KV_CHUNK - 1) / KV_CHUNK;
    const int tail_chunks = (tail + KV_CHUNK - 1) / KV_CHUNK;
    const int chunks = sink_chunks + n_tiles + tail_chunks;
    // Split-K: block y of a KV head takes chunks [c0, c1) (possibly none).
    const int per_split = (chunks + p.splits - 1) / p.splits;
    const int c0 = min(chunks, (int)blockIdx.y * per_split), c1 = min(chunks, c0 + per_split);
    for (int ci = c0; ci < c1; ++ci) {
        const bool is_tile = ci >= sink_chunks && ci < sink_chunks + n_tiles;
        const __half *kr = nullptr, *vr = nullptr;
        int n;
        float qz[MAXG];  // Σ_c q_c·Z_c of the tile, per query head
        if (is_tile) {
            n = T;
            const uint2* src = reinterpret_cast<const uint2*>(
                p.tiles + ((size_t)h * p.tile_cap + (ci - sink_chunks)) * p.record);
            uint2* dst = reinterpret_cast<uint2*>(dyn);
            for (int i = tid; i < p.record / 8; i += KV_CHUNK) dst[i] = __ldg(src + i);
            if (tid < 2) rec_w[p.record / 4 + tid] = 0u;
            __syncthreads();
            float zq[MAXG];
#pragma unroll
            for (int g = 0; g < MAXG; ++g) zq[g] = 0.0f;
            if (tid < d) {
                const float a = rec_half(rec_b, p.k_a, tid);
                const float z = fmaf(a, kc0, rec_half(rec_b, p.k_z, tid));
#pragma unroll
                for (int g = 0; g < MAXG; ++g) {
                    qa[tid][g] = qs[tid][g] * a;
                    zq[g] = qs[tid][g] * z;
                }
                v_bc[tid] = rec_half(rec_b, p.v_b, tid);
            }
#pragma unroll
            for (int g = 0; g < MAXG; ++g) {
                const float t = warp_sum(zq[g]);
                if (lane == 0) zpart[warp][g] = t;
            }
            for (int i = tid; i < T; i += KV_CHUNK) {
                const float a = rec_half(rec_b, p.v_a, i);
                v_az[i] = make_float2(a, fmaf(a, vc0, rec_half(rec_b, p.v_z, i)));
                k_bt[i] = rec_half(rec_b, p.k_b, i);
            }
            __syncthreads();
#pragma unroll
            for (int g = 0; g < MAXG; ++g) {
                float t = 0.0f;
#pragma unroll
                for (int wi = 0; wi < KV_CHUNK / 32; ++wi) t += zpart[wi][g];
                qz[g] = t;
            }
        } else if (ci < sink_chunks) {
            const int t0 = ci * KV_CHUNK;
            n = min(KV_CHUNK, sinks - t0);
            kr = p.sink_k + ((size_t)h * p.sink_cap + t0) * d;
            vr = p.sink_v + ((size_t)h * p.sink_cap + t0) * d;
        } else {
            const int t0 = (ci - sink_chunks - n_tiles) * KV_CHUNK;
            n = min(KV_CHUNK, tail - t0);
            kr = p.tail_k + ((size_t)h * p.tail_cap + t0) * d;
            vr = p.tail_v + ((size_t)h * p.tail_cap + t0) * d;
        }
        if (tid < n) {
            float s[MAXG];
#pragma unroll
            for (int g = 0; g < MAXG; ++g) s[g] = 0.0f;
            if (is_tile) {
                auto add_code = [&](int c, float code) {  // channel c of token tid's key codes
                    const float* qc = qa[c];
#pragma unroll
                    for (int g = 0; g < MAXG; ++g) s[g] = fmaf(qc[g], code, s[g]);
                };
                if (ALIGNED) {
                    const int stride = (T * p.kb) >> 5;  // words between channels
                    const uint32_t* kw = rec_w + p.k_codes / 4 + ((tid * p.kb) >> 5);
                    const int sh = (tid * p.kb) & 31;
#pragma unroll 8
                    for (int c = 0; c < d; ++c, kw += stride) add_code(c, code_float(*kw >> sh, kmask, kmagic));
                } else {
                    int bit = p.k_codes * 8 + tid * p.kb;
                    const int step = T * p.kb;
                    for (int c = 0; c < d; ++c, bit += step) add_code(c, smem_code(rec_w, bit, kmask, kmagic));
                }
                const float bt = k_bt[tid];
#pragma unroll
                for (int g = 0; g < MAXG; ++g) s[g] = (s[g] + qz[g]) * bt;
            } else {
                for (int c = 0; c < d; ++c) {
                    const float k = __half2float(kr[(size_t)tid * d + c]);
                    const float* qc = qs[c];
#pragma unroll
                    for (int g = 0; g < MAXG; ++g) s[g] = fmaf(qc[g], k, s[g]);
                }
            }
#pragma unroll
            for (int g = 0; g < MAXG; ++g) w[tid][g] = s[g];
        }
        __syncthreads();
        // Softmax bookkeeping of the chunk: one warp per query head; over a tile also the
        // weights times each token's value A and the sum of weights times its Z.
        for (int g = warp; g < G; g += KV_CHUNK / 32) {
            float mx = -INFINITY;
            for (int t = lane; t < n; t += 32) mx = fmaxf(mx, w[t][g]);
            mx = warp_max(mx);
            const float m_new = fmaxf(m_run[g], mx);
            float sum = 0.0f, zsum = 0.0f;
            for (int t = lane; t < n; t += 32) {
                const float e = expf(w[t][g] - m_new);
                w[t][g] = e;
                sum += e;
                if (is_tile) {
                    const float2 az = v_az[t];
                    wa[t][g] = e * az.x;
                    zsum = fmaf(e, az.y, zsum);
                }
            }
            sum = warp_sum(sum);
            zsum = warp_sum(zsum);
            if (lane == 0) {
                const float r = expf(m_run[g] - m_new);  // 0 for the first chunk (−∞)
                rescale[g] = r;
                z_run[g] = z_run[g] * r + sum;
                m_run[g] = m_new;
                wz[g] = zsum;
            }
        }
        __syncthreads();
        // Eq. 7's group weights of a tile (refining): per group of rgroup tokens and query
        // head, the log of the summed weights relative to the running max, so the selection
        // can rescale them to the merged softmax.
        if (is_tile && p.units != nullptr) {
            const int per = p.per_tile;
            float* gl = p.glog + ((size_t)h * p.tile_cap + (ci - sink_chunks)) * per * G;
            for (int i = tid; i < per * G; i += KV_CHUNK) {
                const int gi = i / G, g = i % G;
                float sum = 0.0f;
                for (int t = 0; t < p.rgroup; ++t) sum += w[gi * p.rgroup + t][g];
                gl[i] = m_run[g] + logf(sum);
            }
        }
        if (tid < d) {
            float acc[MAXG];
#pragma unroll
            for (int g = 0; g < MAXG; ++g) acc[g] = 0.0f;
            if (is_tile) {
                auto add_code = [&](int t, float code) {  // token t of channel tid's value codes
                    const float* wt = wa[t];
#pragma unroll
                    for (int g = 0; g < MAXG; ++g) acc[g] = fmaf(wt[g], code, acc[g]);
                };
                if (ALIGNED) {
                    const int stride = (d * p.vb) >> 5;  // words between tokens
                    const uint32_t* vw = rec_w + p.v_codes / 4 + ((tid * p.vb) >> 5);
                    const int sh = (tid * p.vb) & 31;
#pragma unroll 8
                    for (int t = 0; t < n; ++t, vw += stride) add_code(t, code_float(*vw >> sh, vmask, vmagic));
                } else {
                    int bit = p.v_codes * 8 + tid * p.vb;
                    const int step = d * p.vb;
                    for (int t = 0; t < n; ++t, bit += step) add_code(t, smem_code(rec_w, bit, vmask, vmagic));
                }
                const float bc = v_bc[tid];
#pragma unroll
                for (int g = 0; g < MAXG; ++g) o[g] = fmaf(bc, acc[g] + wz[g], o[g] * rescale[g]);
            } else {
                for (int t = 0; t < n; ++t) {
                    const float v = __half2float(vr[(size_t)t * d + tid]);
                    const float* wt = w[t];
#pragma unroll
                    for (int g = 0; g < MAXG; ++g) acc[g] = fmaf(wt[g], v, acc[g]);
                }
#pragma unroll
                for (int g = 0; g < MAXG; ++g) o[g] = fmaf(o[g], rescale[g], acc[g]);
            }
        }
        __syncthreads();  // the next chunk overwrites w, rescale and the staged record
    }
    if (p.part == nullptr) {
        if (tid < d) {
#pragma unroll
            for (int g = 0; g < MAXG; ++g)
                if (g < G) p.out[((size_t)h * G + g) * d + tid] = o[g] / z_run[g];
        }
        return;
    }
    // Unnormalised partial of this split: max, sum of weights, weighted values.
    float* part = p.part + ((size_t)h * p.splits + blockIdx.y) * G * (d + 2);
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        if (g >= G) break;
        if (tid < d) part[g * (d + 2) + 2 + tid] = o[g];
        if (tid == 0) {
            part[g * (d + 2)] = m_run[g];
            part[g * (d + 2) + 1] = z_run[g];
        }
    }
}

// Up to 4 and up to 8 query heads per KV head (accumulators sized to the group); `_w`: codes
// read a word each (ALIGNED above).
#define KVARN_ATTN_ENTRY(name, maxg, aligned)                                                \
    extern "C" __global__ void __launch_bounds__(KV_CHUNK) name(const KvarnParams p) {      \
        kvarn_attn_decode_impl<maxg, aligned>(p);                                            \
    }
KVARN_ATTN_ENTRY(kvarn_attn_decode_g4, 4, false)
KVARN_ATTN_ENTRY(kvarn_attn_decode_g8, 8, false)
KVARN_ATTN_ENTRY(kvarn_attn_decode_g4_w, 4, true)
KVARN_ATTN_ENTRY(kvarn_attn_decode_g8_w, 8, true)

// The normalised Hadamard rotation of `rows` rows of n values (a power of two ≤ 1024) in shared
// memory, by the block's threads: butterflies in increasing span, each sum and difference
// rounded, then the scale — the CPU transform's operations in its order; one barrier a span
// for all rows.
__device__ __forceinline__ void hadamard_smem(float* v, int rows, int n, float scale) {
    const int half = n / 2;
    for (int h = 1; h < n; h <<= 1) {
        for (int i = threadIdx.x; i < rows * half; i += blockDim.x) {
            const int r = i / half, k = i % half;
            float* row = v + r * n;
            const int j = (k / h) * 2 * h + (k % h);
            const float a = row[j], b = row[j + h];
            row[j] = __fadd_rn(a, b);
            row[j + h] = __fsub_rn(a, b);
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < rows * n; i += blockDim.x) v[i] = __fmul_rn(v[i], scale);
    __syncthreads();
}

// Split-K partials of (KV head h, split s, query head g) live at ((h · splits + s) · group + g)
// · (d + 2): the split's max, its sum of weights, then its d weighted values.
#define KV_MAX_SPLITS 2048

// The merged max M and sum Z of one query head's partials (`first` = its split 0, `stride`
// floats between splits), by one warp; each split's weight e^{m_s − M} (0 for a split that
// took no chunks) is left in `w[s]`.
__device__ __forceinline__ void merge_stats_warp(const float* first, size_t stride, int splits,
                                                 float* w, float& M, float& Z) {
    const int lane = threadIdx.x & 31;
    float m = -INFINITY;
    for (int s = lane; s < splits; s += 32) m = fmaxf(m, first[s * stride]);
    m = warp_max(m);
    float z = 0.0f;
    for (int s = lane; s < splits; s += 32) {
        const float ms = first[s * stride];
        const float e = ms == -INFINITY ? 0.0f : expf(ms - m);
        w[s] = e;
        z = fmaf(first[s * stride + 1], e, z);
    }
    M = m;
    Z = warp_sum(z);
}

// Σ_s w[s] · (channel c of split s's weighted values): loads independent of each other, so
// they overlap.
__device__ __forceinline__ float merge_channel(const float* first, size_t stride, int splits,
                                               const float* w, int c) {
    float acc = 0.0f;
#pragma unroll 8
    for (int s = 0; s < splits; ++s) acc = fmaf(first[s * stride + 2 + c], w[s], acc);
    return acc;
}

// Merges the split-K partials of kvarn_attn_decode: one block per query head, one thread per
// output channel; warp 0 first reduces the splits' maxima and sums. With `rotate` the row is
// rotated back to the model frame (scale 1/√d) before it is written.
extern "C" __global__ void kvarn_attn_merge(const float* __restrict__ part,
                                            float* __restrict__ out, int splits, int group,
                                            int d, int rotate, float scale) {
    __shared__ float row[KV_MAX_D];
    __shared__ float w[KV_MAX_SPLITS];
    __shared__ float z_sh;
    const int qh = blockIdx.x, c = threadIdx.x;  // qh = KV head · group + query head
    const int h = qh / group, g = qh % group;
    const float* first = part + ((size_t)h * splits * group + g) * (d + 2);
    const size_t stride = (size_t)group * (d + 2);
    if (threadIdx.x < 32) {
        float M, Z;
        merge_stats_warp(first, stride, splits, w, M, Z);
        if (threadIdx.x == 0) z_sh = Z;
    }
    __syncthreads();
    const float acc = c < d ? merge_channel(first, stride, splits, w, c) : 0.0f;
    if (!rotate) {
        if (c < d) out[(size_t)qh * d + c] = acc / z_sh;
        return;
    }
    if (c < d) row[c] = acc / z_sh;
    __syncthreads();
    hadamard_smem(row, 1, d, scale);
    if (c < d) out[(size_t)qh * d + c] = row[c];
}

// A KVarN decode step's rows: block r < n_heads rotates query row r into `qs` (f32); the next
// kv_heads blocks rotate key rows, the last kv_heads value rows, each written FP16 to the row
// its position names: sink row `pos` below the sink capacity, else tail row (pos − S) mod T.
extern "C" __global__ void kvarn_decode_rows(const float* __restrict__ q,
                                             const float* __restrict__ k,
                                             const float* __restrict__ v, float* __restrict__ qs,
                                             __half* sink_k, __half* sink_v, __half* tail_k,
                                             __half* tail_v, const uint32_t* __restrict__ pos,
                                             int n_heads, int kv_heads, int d, int sink_cap,
                                             int tile_tokens, float scale) {
    __shared__ float row[KV_MAX_D];
    const int r = blockIdx.x;
    const float* src = r < n_heads ? q + (size_t)r * d
                       : r < n_heads + kv_heads ? k + (size_t)(r - n_heads) * d
                                                : v + (size_t)(r - n_heads - kv_heads) * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) row[i] = src[i];
    __syncthreads();
    hadamard_smem(row, 1, d, scale);
    if (r < n_heads) {
        for (int i = threadIdx.x; i < d; i += blockDim.x) qs[(size_t)r * d + i] = row[i];
        return;
    }
    const bool is_key = r < n_heads + kv_heads;
    const int h = is_key ? r - n_heads : r - n_heads - kv_heads;
    const int at = (int)pos[0];
    __half* dst;
    if (at < sink_cap) {
        dst = (is_key ? sink_k : sink_v) + ((size_t)h * sink_cap + at) * d;
    } else {
        const int slot = (at - sink_cap) % tile_tokens;
        dst = (is_key ? tail_k : tail_v) + ((size_t)h * tile_tokens + slot) * d;
    }
    for (int i = threadIdx.x; i < d; i += blockDim.x) dst[i] = __float2half_rn(row[i]);
}

// The KVarN code frame of a head vector: each row of n values (a power of two, n ≤ 1024) times
// the normalised Sylvester Hadamard matrix, in place. One block per row, n/2 threads.
extern "C" __global__ void kvarn_hadamard_rows(float* __restrict__ x, int n, float scale) {
    __shared__ float v[1024];
    float* row = x + (size_t)blockIdx.x * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) v[i] = row[i];
    __syncthreads();
    hadamard_smem(v, 1, n, scale);
    for (int i = threadIdx.x; i < n; i += blockDim.x) row[i] = v[i];
}

// ---------------------------------------------------------------------------------------------
// Refinement (eq. 7 selection, eq. 8 correction) of a decode step, after the split-K pass.
//
// The selection is spread over the GPU: `kvarn_refine_score` runs several blocks per KV head,
// each merging its share of the split partials and scoring its share of the groups into a
// histogram of the scores' top 11 bits, summed into the head's; the last block of a KV head to
// finish takes the threshold's first digit from that histogram and the other two from the keys
// near it, gathered into shared memory (or from passes over the score bits in L2), and writes
// the picks in group order. One block per KV head doing all of it took 44–59 µs a layer at 32K.

// Score bits a lane holds per round of a pass (their loads issued together).
#define SEL_KEYS_PER_LANE 8
#define SEL_ROUND (SEL_THREADS * SEL_KEYS_PER_LANE)
// A position past the eligible groups (a score's bits never reach it: scores are in [0, 1]).
#define SEL_NO_KEY 0xffffffffu
#define CORR_THREADS 256
#define CORR_WARPS (CORR_THREADS / 32)
// Most selected groups a correction block takes, and most unit words it stages (the host's
// CORR_GROUPS and CORR_UNIT_SMEM).
#define CORR_MAX_GROUPS 16
#define CORR_UNIT_WORDS 2048

// Exclusive prefix sum of `v` over the block's threads (all must call); `tmp` holds one word
// per warp; `total` receives the block's sum.
__device__ __forceinline__ int block_exclusive_sum(int v, int* tmp, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) tmp[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int t = lane < warps ? tmp[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, t, o);
            if (lane >= o) t += y;
        }
        tmp[lane] = t;
    }
    __syncthreads();
    const int before = (warp > 0 ? tmp[warp - 1] : 0) + x - v;
    *total = tmp[warps - 1];
    __syncthreads();  // tmp is reused by the next call
    return before;
}

__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Adds one to `hist[bin]` for each lane where `active`, one atomic per distinct bin of the warp:
// the scores of a warp mostly share their top bits, and lanes would serialise on one address.
// Every lane of the warp calls it.
__device__ __forceinline__ void hist_add_warp(uint32_t* hist, uint32_t bin, bool active) {
    const unsigned act = __ballot_sync(0xffffffffu, active);
    if (!active) return;
    const unsigned same = __match_any_sync(act, bin);
    if ((int)(threadIdx.x & 31) == __ffs(same) - 1) atomicAdd(&hist[bin], (uint32_t)__popc(same));
}

// The bin of `hist` where the count of keys, from the top bin down, reaches `want`; `want`
// becomes the rank within that bin. Every thread of the block calls it; `sh` holds two words.
__device__ __forceinline__ uint32_t top_digit(const uint32_t* hist, int& want, int* tmp, int* sh) {
    const int hi = SEL_BINS - 1 - 2 * (int)threadIdx.x;  // this thread's two bins: hi, hi − 1
    const int c0 = (int)hist[hi], c1 = (int)hist[hi - 1];
    int total;
    const int before = block_exclusive_sum(c0 + c1, tmp, &total);
    if (before < want && before + c0 >= want) {
        sh[0] = hi;
        sh[1] = want - before;
    } else if (before + c0 < want && before + c0 + c1 >= want) {
        sh[0] = hi - 1;
        sh[1] = want - before - c0;
    }
    __syncthreads();
    want = sh[1];
    const uint32_t digit = (uint32_t)sh[0];
    __syncthreads();
    return digit;
}

// Walks items [0, n) in rounds: in each, warp w holds the contiguous run of
// 32 · SEL_KEYS_PER_LANE items at `run`, lane l its items run + e·32 + l, loaded together by
// `load(i, key, group)`; keys past n are SEL_NO_KEY. Every thread calls it (the count of rounds
// is the block's); `f(keys, groups)` may synchronise.
template <typename Load, typename F>
__device__ __forceinline__ void item_rounds(int n, Load&& load, F&& f) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int base = 0; base < n; base += SEL_ROUND) {
        const int run = base + warp * 32 * SEL_KEYS_PER_LANE;
        uint32_t k[SEL_KEYS_PER_LANE], gi[SEL_KEYS_PER_LANE];
#pragma unroll
        for (int e = 0; e < SEL_KEYS_PER_LANE; ++e) {
            const int i = run + e * 32 + lane;
            k[e] = SEL_NO_KEY;
            gi[e] = 0u;
            if (i < n) load(i, k[e], gi[e]);
        }
        f(k, gi);
    }
}

// One radix digit of the selection over items [0, n): the histogram of bits [shift, shift +
// width) of the keys that match `prefix` under `pmask`, then the digit where the count from the
// top reaches `want`; the digit joins the prefix and `want` becomes the rank within it.
template <typename Load>
__device__ __forceinline__ void radix_digit(int n, Load&& load, int shift, uint32_t digit_mask,
                                            uint32_t& prefix, uint32_t& pmask, int& want,
                                            uint32_t* hist, int* tmp, int* sh) {
    for (int i = threadIdx.x; i < SEL_BINS; i += SEL_THREADS) hist[i] = 0u;
    __syncthreads();
    item_rounds(n, load, [&](const uint32_t(&k)[SEL_KEYS_PER_LANE], const uint32_t(&)[SEL_KEYS_PER_LANE]) {
#pragma unroll
        for (int e = 0; e < SEL_KEYS_PER_LANE; ++e)
            hist_add_warp(hist, (k[e] >> shift) & digit_mask,
                          k[e] != SEL_NO_KEY && (k[e] & pmask) == prefix);
    });
    __syncthreads();
    prefix |= top_digit(hist, want, tmp, sh) << shift;
    pmask |= digit_mask << shift;
}

// Passes items [0, n) in order and hands each taken one — key ≥ `lo`, or key equal to `tie`
// among the first `want` such — to `put(position, key, group)` at its position among the taken;
// returns how many were taken. Per round, ballots count each warp's picks and the warps' sums
// place them. Every thread calls it; `wsum` holds 2 · SEL_WARPS words.
template <typename Load, typename Put>
__device__ __forceinline__ int ordered_take(int n, Load&& load, uint32_t lo, uint32_t tie,
                                            int want, int* wsum, Put&& put) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned below = (1u << lane) - 1u;
    int taken = 0, ties_seen = 0;  // block-wide, before the round
    item_rounds(n, load, [&](const uint32_t(&k)[SEL_KEYS_PER_LANE], const uint32_t(&gi)[SEL_KEYS_PER_LANE]) {
        unsigned up[SEL_KEYS_PER_LANE], eq[SEL_KEYS_PER_LANE];
        int n_up = 0, n_eq = 0;
#pragma unroll
        for (int e = 0; e < SEL_KEYS_PER_LANE; ++e) {
            const bool valid = k[e] != SEL_NO_KEY;
            up[e] = __ballot_sync(0xffffffffu, valid && k[e] >= lo);
            eq[e] = __ballot_sync(0xffffffffu, valid && k[e] < lo && k[e] == tie);
            n_up += __popc(up[e]);
            n_eq += __popc(eq[e]);
        }
        if (lane == 0) {
            wsum[warp] = n_up;
            wsum[SEL_WARPS + warp] = n_eq;
        }
        __syncthreads();
        const int u_lane = wsum[lane], e_lane = wsum[SEL_WARPS + lane];
        const int up_before = warp_sum_int(lane < warp ? u_lane : 0);
        const int eq_before = warp_sum_int(lane < warp ? e_lane : 0);
        const int up_round = warp_sum_int(u_lane), eq_round = warp_sum_int(e_lane);
        __syncthreads();  // wsum is rewritten by the next round
        int eqs = ties_seen + eq_before;
        int at = taken + up_before + min(eqs, want) - min(ties_seen, want);
#pragma unroll
        for (int e = 0; e < SEL_KEYS_PER_LANE; ++e) {
            const bool take = ((up[e] >> lane) & 1u) ||
                              (((eq[e] >> lane) & 1u) && eqs + __popc(eq[e] & below) < want);
            const unsigned bt = __ballot_sync(0xffffffffu, take);
            if (take) put(at + __popc(bt & below), k[e], gi[e]);
            at += __popc(bt);
            eqs += __popc(eq[e]);
        }
        taken += up_round + min(ties_seen + eq_round, want) - min(ties_seen, want);
        ties_seen += eq_round;
    });
    return taken;
}

// Eq. 7 per KV head, in `gridDim.y` blocks: each reduces its query heads' split maxima and sums
// (every block needs M and Z; block 0 writes them), merges its share of the output channels
// (one warp per channel, lanes over the splits), and scores its share of the eligible groups —
// the largest over query heads of e^{glog − M}/Z — writing the score bits and adding their top
// 11 bits to the KV head's histogram. The last block to finish selects the top `fraction` by
// radix selection on the bits (non-negative floats order as their bits), ties to the lower
// group as the host breaks them, and writes the selected groups in ascending order: the
// histogram gives the first digit; the keys at or above its bin (those above it number fewer
// than the selection) are gathered in group order into shared memory by one pass over the bits
// in L2, and the other two digits and the picks come from there — or, when they outnumber
// `cand_cap`, from passes over L2. The histogram and the ticket are zeroed by the attention
// launch.
extern "C" __global__ void __launch_bounds__(SEL_THREADS) kvarn_refine_score(const KvarnParams p) {
    __shared__ float sM[KV_MAX_GROUP], sZ[KV_MAX_GROUP], red[SEL_WARPS];
    __shared__ uint32_t hist[SEL_BINS];
    __shared__ int tmp[32], sh[2];
    __shared__ int wsum[2 * SEL_WARPS];
    __shared__ int is_last;
    // [group][splits]: each split's merge weight; then the gathered keys and their groups.
    extern __shared__ float wsplit[];
    const int h = blockIdx.x, y = blockIdx.y, blocks = gridDim.y, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, G = p.group, d = p.d;
    const size_t stride = (size_t)G * (d + 2);
    const float* part = p.part + (size_t)h * p.splits * stride;
    {
        // SEL_WARPS / G whole warps per query head, a split per thread and round: M, then
        // each split's weight e^{m_s − M} (0 for a split that took no chunks) and Z.
        const int wph = SEL_WARPS / G, g = warp / wph, tph = wph * 32;
        const int r = (warp % wph) * 32 + lane;
        const bool mine = g < G;
        const float* first = part + (size_t)min(g, G - 1) * (d + 2);
        float mx = -INFINITY;
        if (mine)
            for (int s = r; s < p.splits; s += tph) mx = fmaxf(mx, first[s * stride]);
        mx = warp_max(mx);
        if (lane == 0) red[warp] = mx;
        __syncthreads();
        float M = -INFINITY;
        if (mine)
            for (int k = 0; k < wph; ++k) M = fmaxf(M, red[g * wph + k]);
        float z = 0.0f;
        if (mine)
            for (int s = r; s < p.splits; s += tph) {
                const float ms = first[s * stride];
                const float e = ms == -INFINITY ? 0.0f : expf(ms - M);
                wsplit[g * p.splits + s] = e;
                z = fmaf(first[s * stride + 1], e, z);
            }
        z = warp_sum(z);
        __syncthreads();  // red is rewritten
        if (lane == 0) red[warp] = z;
        for (int i = tid; i < SEL_BINS; i += SEL_THREADS) hist[i] = 0u;
        __syncthreads();
        if (mine && warp % wph == 0 && lane == 0) {
            float Z = 0.0f;
            for (int k = 0; k < wph; ++k) Z += red[g * wph + k];
            sM[g] = M;
            sZ[g] = Z;
            if (y == 0) {
                p.stat[(size_t)(h * G + g) * (d + 2)] = M;
                p.stat[(size_t)(h * G + g) * (d + 2) + 1] = Z;
            }
        }
        __syncthreads();
    }
    for (int i = y * SEL_WARPS + warp; i < G * d; i += blocks * SEL_WARPS) {
        const int g = i / d, c = i % d;
        const float* first = part + (size_t)g * (d + 2) + 2 + c;
        const float* w = wsplit + g * p.splits;
        float acc = 0.0f;
        for (int s0 = 0; s0 < p.splits; s0 += 128) {  // four loads in flight a lane
            float v[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int s = s0 + 32 * j + lane;
                v[j] = s < p.splits ? first[s * stride] : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int s = s0 + 32 * j + lane;
                if (s < p.splits) acc = fmaf(v[j], w[s], acc);
            }
        }
        acc = warp_sum(acc);
        if (lane == 0) p.stat[(size_t)(h * G + g) * (d + 2) + 2 + c] = acc / sZ[g];
    }
    int sinks, n_tiles, tail;
    kvarn_fill(p, sinks, n_tiles, tail);
    const int n = n_tiles * p.per_tile;
    const int n_sel = n > 0 ? min(n, max(1, (int)ceil((double)n * p.fraction))) : 0;
    if (n_sel == 0) {
        if (y == 0 && tid == 0) p.sel_count[h] = 0u;
        return;
    }
    uint32_t* keys = p.keys + (size_t)h * p.tile_cap * p.per_tile;
    const float* gl = p.glog + (size_t)h * p.tile_cap * p.per_tile * G;
    float inv_z[KV_MAX_GROUP], m[KV_MAX_GROUP];
#pragma unroll
    for (int g = 0; g < KV_MAX_GROUP; ++g) {
        inv_z[g] = g < G ? 1.0f / sZ[g] : 0.0f;
        m[g] = g < G ? sM[g] : 0.0f;
    }
    for (int i0 = y * SEL_THREADS; i0 < n; i0 += blocks * SEL_THREADS) {
        const int i = i0 + tid;
        uint32_t key = 0u;
        if (i < n) {
            float best = 0.0f;
#pragma unroll
            for (int g = 0; g < KV_MAX_GROUP; ++g)
                if (g < G) best = fmaxf(best, expf(gl[(size_t)i * G + g] - m[g]) * inv_z[g]);
            key = __float_as_uint(best);
            keys[i] = key;
        }
        hist_add_warp(hist, key >> 20, i < n);
    }
    __syncthreads();
    uint32_t* ghist = p.hist + (size_t)h * SEL_BINS;
    for (int i = tid; i < SEL_BINS; i += SEL_THREADS)
        if (hist[i] != 0u) atomicAdd(ghist + i, hist[i]);
    __threadfence();
    __syncthreads();
    if (tid == 0) is_last = atomicAdd(&p.score_done[h], 1u) == (uint32_t)(blocks - 1);
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    for (int i = tid; i < SEL_BINS; i += SEL_THREADS) hist[i] = __ldcg(ghist + i);
    __syncthreads();
    int want = n_sel;  // rank among the keys matching the prefix, from the top
    uint32_t prefix = top_digit(hist, want, tmp, sh) << 20, pmask = 0xfff00000u;
    auto from_l2 = [&](int i, uint32_t& k, uint32_t& g) {
        k = __ldcg(keys + i);
        g = (uint32_t)i;
    };
    uint32_t* cand_key = reinterpret_cast<uint32_t*>(wsplit + G * p.splits);
    uint32_t* cand_group = cand_key + p.cand_cap;
    const int n_cand = ordered_take(n, from_l2, prefix, SEL_NO_KEY, 0, wsum,
                                    [&](int at, uint32_t k, uint32_t g) {
                                        if (at < p.cand_cap) {
                                            cand_key[at] = k;
                                            cand_group[at] = g;
                                        }
                                    });
    __syncthreads();
    uint32_t* sel = p.sel + (size_t)h * p.max_sel;
    auto select = [&](int count, auto&& load) {
        radix_digit(count, load, 9, 0x7ffu, prefix, pmask, want, hist, tmp, sh);
        radix_digit(count, load, 0, 0x1ffu, prefix, pmask, want, hist, tmp, sh);
        // `prefix` is the n_sel-th largest key: every larger key, and the first `want` equal.
        ordered_take(count, load, prefix + 1u, prefix, want, wsum,
                     [&](int at, uint32_t, uint32_t g) { sel[at] = g; });
    };
    if (n_cand <= p.cand_cap)
        select(n_cand, [&](int i, uint32_t& k, uint32_t& g) {
            k = cand_key[i];
            g = cand_group[i];
        });
    else
        select(n, from_l2);
    if (tid == 0) p.sel_count[h] = (uint32_t)n_sel;
}

// Bits [bit, bit + bits) of a little-endian byte stream (bits ≤ 8).
__device__ __forceinline__ uint32_t stream_bits(const uint8_t* b, int bit, int bits) {
    const int at = bit >> 3;
    const uint32_t w = (uint32_t)b[at] | ((uint32_t)b[at + 1] << 8);
    return (w >> (bit & 7)) & ((1u << bits) - 1u);
}

// The centre of sub-interval k of 2^bits, in code units: −½ + (k + ½)/2^bits, rounded as the
// host's table (0 without bits).
__device__ __forceinline__ float sub_offset(uint32_t k, int bits) {
    if (bits == 0) return 0.0f;
    const float step = 1.0f / (float)(1u << bits);
    return __fsub_rn(__fmul_rn(__fadd_rn((float)k, 0.5f), step), 0.5f);
}

// ((code + off)·A + Z)·B, each step rounded as the host's refined decoder rounds it.
__device__ __forceinline__ float refined_elem(float code, float off, float a, float z, float b) {
    return __fmul_rn(__fadd_rn(__fmul_rn(__fadd_rn(code, off), a), z), b);
}

// What one token's correction reads from its tile record (per lane: channels lane + 32·j).
struct CorrToken {
    float kB, vA, vZ;
    float kc[KV_MAX_D / 32], kA[KV_MAX_D / 32], kZ[KV_MAX_D / 32], vc[KV_MAX_D / 32],
        vB[KV_MAX_D / 32];
};

// Token tk of a correction block (its selected group tk / rgroup, token tk mod rgroup of the
// group): the record fields its rebuilt keys and values need, loads only.
__device__ __forceinline__ void corr_fetch(const KvarnParams& p, int h, const uint32_t* sel, int tk,
                                           CorrToken& f) {
    const int lane = threadIdx.x & 31, rg = p.rgroup, T = p.tile_tokens, d = p.d;
    const uint32_t gi = sel[tk / rg];
    const int ti = (int)gi / p.per_tile, tt = ((int)gi % p.per_tile) * rg + tk % rg;
    const uint8_t* rec = p.tiles + ((size_t)h * p.tile_cap + ti) * p.record;
    f.kB = rec_half(rec, p.k_b, tt);
    f.vA = rec_half(rec, p.v_a, tt);
    f.vZ = rec_half(rec, p.v_z, tt);
#pragma unroll
    for (int j = 0; j < KV_MAX_D / 32; ++j) {
        const int c = min(lane + 32 * j, d - 1);  // lanes past d read a valid channel, unused
        f.kc[j] = (float)stream_bits(rec, p.k_codes * 8 + (c * T + tt) * p.kb, p.kb);
        f.kA[j] = rec_half(rec, p.k_a, c);
        f.kZ[j] = rec_half(rec, p.k_z, c);
        f.vc[j] = (float)stream_bits(rec, p.v_codes * 8 + (tt * d + c) * p.vb, p.vb);
        f.vB[j] = rec_half(rec, p.v_b, c);
    }
}

// Eq. 8 over the selected groups: block (KV head, run of `corr_groups` selections) reads its
// groups' units from host memory, rebuilds each token's resident and refined key and value,
// and sums per query head Δden = Σ e^{ℓ'−M} − e^{ℓ−M} and Δnum = Σ e^{ℓ'−M}·v' − e^{ℓ−M}·v.
// The last block of a KV head to finish adds the sums of the blocks that had selections, in
// block order, and writes o' = (Z·o + Δnum) / (Z + Δden), rotated back to the model frame when
// asked. Its ticket is zeroed by the attention launch.
extern "C" __global__ void __launch_bounds__(CORR_THREADS) kvarn_refine_correct(const KvarnParams p) {
    extern __shared__ __align__(16) uint8_t ubuf[];
    __shared__ float qs[KV_MAX_GROUP][KV_MAX_D];
    __shared__ float red[CORR_WARPS][KV_MAX_GROUP * (KV_MAX_D + 1)];
    __shared__ float sM[KV_MAX_GROUP], sZ[KV_MAX_GROUP];
    __shared__ int is_last;
    const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int G = p.group, d = p.d, rg = p.rgroup;
    const int count = (int)p.sel_count[h];
    const int cg = p.corr_groups, e0 = b * cg, ne = max(0, min(cg, count - e0));
    // The block's selected groups first, so the unit reads below depend on one load only.
    __shared__ uint32_t sel[CORR_MAX_GROUPS];
    if (tid < ne) sel[tid] = p.sel[(size_t)h * p.max_sel + e0 + tid];
    __syncthreads();
    const int ustride = (p.unit_bytes + 3) & ~3, tokens = ne * rg;
    // Every unit word's read over the bus is issued first, then the record reads of the warp's
    // first two tokens, and only then are the units stored: both latencies overlap.
    const uint8_t* head_units = p.units + (size_t)h * p.tile_cap * p.per_tile * p.unit_bytes;
    const bool word_units = (p.unit_bytes & 3) == 0;
    const int words = p.unit_bytes / 4, total = word_units ? ne * words : 0;
    uint32_t u[CORR_UNIT_WORDS / CORR_THREADS];
#pragma unroll
    for (int r = 0; r < CORR_UNIT_WORDS / CORR_THREADS; ++r) {
        const int i = tid + r * CORR_THREADS, e = i / max(words, 1), w = i % max(words, 1);
        if (i < total)
            u[r] = reinterpret_cast<const uint32_t*>(head_units + (size_t)sel[e] * p.unit_bytes)[w];
    }
    CorrToken first[2];
#pragma unroll
    for (int k = 0; k < 2; ++k)
        if (warp + k * CORR_WARPS < tokens) corr_fetch(p, h, sel, warp + k * CORR_WARPS, first[k]);
    for (int i = tid; i < G * d; i += CORR_THREADS)
        qs[i / d][i % d] = __fmul_rn(p.q[(size_t)h * G * d + i], p.q_scale);
    if (tid < G) {
        sM[tid] = p.stat[(size_t)(h * G + tid) * (d + 2)];
        sZ[tid] = p.stat[(size_t)(h * G + tid) * (d + 2) + 1];
    }
    if (word_units) {
#pragma unroll
        for (int r = 0; r < CORR_UNIT_WORDS / CORR_THREADS; ++r) {
            const int i = tid + r * CORR_THREADS, e = i / max(words, 1), w = i % max(words, 1);
            if (i < total) reinterpret_cast<uint32_t*>(ubuf + e * ustride)[w] = u[r];
        }
    } else {
        for (int i = tid; i < ne * p.unit_bytes; i += CORR_THREADS) {
            const int e = i / p.unit_bytes, b = i % p.unit_bytes;
            ubuf[e * ustride + b] = head_units[(size_t)sel[e] * p.unit_bytes + b];
        }
    }
    __syncthreads();
    constexpr int PER_LANE = KV_MAX_D / 32;
    float num[KV_MAX_GROUP][PER_LANE], den[KV_MAX_GROUP];
#pragma unroll
    for (int g = 0; g < KV_MAX_GROUP; ++g) {
        den[g] = 0.0f;
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) num[g][j] = 0.0f;
    }
    // Token tk's resident and refined keys and values from its fetched record fields and its
    // unit, and its contributions to the sums.
    auto apply = [&](int tk, const CorrToken& f) {
        const int e = tk / rg, t = tk % rg;
        const uint8_t* unit = ubuf + e * ustride;
        float po[KV_MAX_GROUP], pn[KV_MAX_GROUP], v_old[PER_LANE], v_new[PER_LANE];
#pragma unroll
        for (int g = 0; g < KV_MAX_GROUP; ++g) po[g] = pn[g] = 0.0f;
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) {
            v_old[j] = v_new[j] = 0.0f;
            const int c = lane + 32 * j;
            if (c >= d) continue;
            const float k_old = refined_elem(f.kc[j], 0.0f, f.kA[j], f.kZ[j], f.kB);
            const float k_new = refined_elem(
                f.kc[j], sub_offset(p.rkb ? stream_bits(unit, (t * d + c) * p.rkb, p.rkb) : 0u, p.rkb),
                f.kA[j], f.kZ[j], f.kB);
            v_old[j] = refined_elem(f.vc[j], 0.0f, f.vA, f.vZ, f.vB[j]);
            const int vbit = rg * d * p.rkb + (t * d + c) * p.rvb;
            v_new[j] = refined_elem(
                f.vc[j], sub_offset(p.rvb ? stream_bits(unit, vbit, p.rvb) : 0u, p.rvb), f.vA,
                f.vZ, f.vB[j]);
#pragma unroll
            for (int g = 0; g < KV_MAX_GROUP; ++g) {
                if (g < G) {
                    po[g] = fmaf(qs[g][c], k_old, po[g]);
                    pn[g] = fmaf(qs[g][c], k_new, pn[g]);
                }
            }
        }
#pragma unroll
        for (int g = 0; g < KV_MAX_GROUP; ++g) {
            if (g >= G) break;
            const float lo = warp_sum(po[g]), ln = warp_sum(pn[g]);
            const float eo = expf(lo - sM[g]), en = expf(ln - sM[g]);
            den[g] += en - eo;
#pragma unroll
            for (int j = 0; j < PER_LANE; ++j) num[g][j] += en * v_new[j] - eo * v_old[j];
        }
    };
#pragma unroll
    for (int k = 0; k < 2; ++k)
        if (warp + k * CORR_WARPS < tokens) apply(warp + k * CORR_WARPS, first[k]);
    for (int tk = warp + 2 * CORR_WARPS; tk < tokens; tk += CORR_WARPS) {
        CorrToken f;
        corr_fetch(p, h, sel, tk, f);
        apply(tk, f);
    }
#pragma unroll
    for (int g = 0; g < KV_MAX_GROUP; ++g) {
        if (g >= G) break;
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) {
            const int c = lane + 32 * j;
            if (c < d) red[warp][g * (d + 1) + c] = num[g][j];
        }
        if (lane == 0) red[warp][g * (d + 1) + d] = den[g];
    }
    __syncthreads();
    float* mine = p.cpart + ((size_t)h * p.sel_blocks + b) * G * (d + 1);
    for (int i = tid; i < G * (d + 1); i += CORR_THREADS) {
        float s = 0.0f;
        for (int w = 0; w < CORR_WARPS; ++w) s += red[w][i];
        mine[i] = s;
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) is_last = atomicAdd(&p.done[h], 1u) == (uint32_t)(p.sel_blocks - 1);
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    float* rows = &red[0][0];  // [G][d], free again
    for (int i = tid; i < G * d; i += CORR_THREADS) {
        const int g = i / d, c = i % d;
        const float o = p.stat[(size_t)(h * G + g) * (d + 2) + 2 + c];
        if (count == 0) {
            rows[i] = o;
            continue;
        }
        float num_s = 0.0f, den_s = 0.0f;
        const int used = (count + cg - 1) / cg;
#pragma unroll 8
        for (int bb = 0; bb < used; ++bb) {
            const float* ps = p.cpart + ((size_t)h * p.sel_blocks + bb) * G * (d + 1) + g * (d + 1);
            num_s += __ldcg(ps + c);
            den_s += __ldcg(ps + d);
        }
        rows[i] = (sZ[g] * o + num_s) / (sZ[g] + den_s);
    }
    __syncthreads();
    if (p.rotate_out) hadamard_smem(rows, G, d, p.q_scale);
    for (int i = tid; i < G * d; i += CORR_THREADS) p.out[(size_t)h * G * d + i] = rows[i];
}

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
    double fraction;        // of eligible groups selected (rounded up, at least one)
    int rgroup, per_tile, rkb, rvb, unit_bytes, max_sel, sel_blocks, rotate_out;
    int keys_in_smem;       // the selection keeps the score bits in shared memory, not `keys`
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

// The `bits`-wide code at bit `bit` of a record staged in shared memory as 32-bit words (a
// code may straddle two words; the staging pads one word past the record).
__device__ __forceinline__ float smem_code(const uint32_t* words, int bit, uint32_t mask) {
    const int w = bit >> 5;
    return (float)(__funnelshift_r(words[w], words[w + 1], bit & 31) & mask);
}

// Per tile, the block stages the record in shared memory (8-byte loads), widens its scale
// arrays to f32, then scores and accumulates from there. A key is (code·A + Z)·B with A, Z per
// channel and B per token, so token t's score is B_t · Σ_c q_c·(code·A_c + Z_c): B leaves the
// channel loop. A value is (code·A + Z)·B with A, Z per token and B per channel, so channel c
// accumulates Σ_t w_t·(code·A_t + Z_t) and takes B_c once per tile. Each (code·A + Z) is one
// fused multiply-add: the result differs from the CPU's separately rounded steps by float
// rounding only (conformance bound 2e-5).
template <int MAXG>
__device__ __forceinline__ void kvarn_attn_decode_impl(const KvarnParams& p) {
    extern __shared__ __align__(16) uint8_t dyn[];
    __shared__ __align__(16) float qs[KV_MAX_D][MAXG];  // [channel][query head]
    __shared__ __align__(16) float w[KV_CHUNK][MAXG];   // a chunk's scores, then its weights
    __shared__ float m_run[MAXG], z_run[MAXG], rescale[MAXG];
    const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int G = p.group, d = p.d, T = p.tile_tokens;
    // Dynamic shared memory: the staged record (+ one padding word), then the tile's scales.
    const int rec_words = p.record / 4 + 2;
    uint32_t* rec_w = reinterpret_cast<uint32_t*>(dyn);
    const uint8_t* rec_b = dyn;
    float2* k_az = reinterpret_cast<float2*>(dyn + rec_words * 4);  // [d] key A, Z per channel
    float2* v_az = k_az + d;                                        // [T] value A, Z per token
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
    float o[MAXG];
#pragma unroll
    for (int g = 0; g < MAXG; ++g) o[g] = 0.0f;
    __syncthreads();

    const uint32_t kmask = (1u << p.kb) - 1u, vmask = (1u << p.vb) - 1u;
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
        if (is_tile) {
            n = T;
            const uint2* src = reinterpret_cast<const uint2*>(
                p.tiles + ((size_t)h * p.tile_cap + (ci - sink_chunks)) * p.record);
            uint2* dst = reinterpret_cast<uint2*>(dyn);
            for (int i = tid; i < p.record / 8; i += KV_CHUNK) dst[i] = __ldg(src + i);
            if (tid < 2) rec_w[p.record / 4 + tid] = 0u;
            __syncthreads();
            for (int i = tid; i < d; i += KV_CHUNK) {
                k_az[i] = make_float2(rec_half(rec_b, p.k_a, i), rec_half(rec_b, p.k_z, i));
                v_bc[i] = rec_half(rec_b, p.v_b, i);
            }
            for (int i = tid; i < T; i += KV_CHUNK) {
                v_az[i] = make_float2(rec_half(rec_b, p.v_a, i), rec_half(rec_b, p.v_z, i));
                k_bt[i] = rec_half(rec_b, p.k_b, i);
            }
            __syncthreads();
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
            auto add_key = [&](int c, float k) {  // channel c of token tid's key
                const float* qc = qs[c];
#pragma unroll
                for (int g = 0; g < MAXG; ++g) s[g] = fmaf(qc[g], k, s[g]);
            };
            if (is_tile) {
                int bit = p.k_codes * 8 + tid * p.kb;
                const int step = T * p.kb;
                for (int c = 0; c < d; ++c, bit += step) {
                    const float2 az = k_az[c];
                    add_key(c, fmaf(smem_code(rec_w, bit, kmask), az.x, az.y));
                }
                const float bt = k_bt[tid];
#pragma unroll
                for (int g = 0; g < MAXG; ++g) s[g] *= bt;
            } else {
                for (int c = 0; c < d; ++c) add_key(c, __half2float(kr[(size_t)tid * d + c]));
            }
#pragma unroll
            for (int g = 0; g < MAXG; ++g) w[tid][g] = s[g];
        }
        __syncthreads();
        // Softmax bookkeeping of the chunk: one warp per query head.
        for (int g = warp; g < G; g += KV_CHUNK / 32) {
            float mx = -INFINITY;
            for (int t = lane; t < n; t += 32) mx = fmaxf(mx, w[t][g]);
            mx = warp_max(mx);
            const float m_new = fmaxf(m_run[g], mx);
            float sum = 0.0f;
            for (int t = lane; t < n; t += 32) {
                const float e = expf(w[t][g] - m_new);
                w[t][g] = e;
                sum += e;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                const float r = expf(m_run[g] - m_new);  // 0 for the first chunk (−∞)
                rescale[g] = r;
                z_run[g] = z_run[g] * r + sum;
                m_run[g] = m_new;
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
            auto add_value = [&](int t, float v) {  // channel tid of token t's value
                const float* wt = w[t];
#pragma unroll
                for (int g = 0; g < MAXG; ++g) acc[g] = fmaf(wt[g], v, acc[g]);
            };
            if (is_tile) {
                int bit = p.v_codes * 8 + tid * p.vb;
                const int step = d * p.vb;
                for (int t = 0; t < n; ++t, bit += step) {
                    const float2 az = v_az[t];
                    add_value(t, fmaf(smem_code(rec_w, bit, vmask), az.x, az.y));
                }
                const float bc = v_bc[tid];
#pragma unroll
                for (int g = 0; g < MAXG; ++g) o[g] = fmaf(bc, acc[g], o[g] * rescale[g]);
            } else {
                for (int t = 0; t < n; ++t) add_value(t, __half2float(vr[(size_t)t * d + tid]));
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

// Up to 4 and up to 8 query heads per KV head (accumulators sized to the group).
extern "C" __global__ void __launch_bounds__(KV_CHUNK) kvarn_attn_decode_g4(const KvarnParams p) {
    kvarn_attn_decode_impl<4>(p);
}
extern "C" __global__ void __launch_bounds__(KV_CHUNK) kvarn_attn_decode_g8(const KvarnParams p) {
    kvarn_attn_decode_impl<8>(p);
}

// The normalised Hadamard rotation of a row of n values (a power of two ≤ 1024) in shared
// memory, by the block's threads: butterflies in increasing span, each sum and difference
// rounded, then the scale — the CPU transform's operations in its order.
__device__ __forceinline__ void hadamard_smem(float* v, int n, float scale) {
    for (int h = 1; h < n; h <<= 1) {
        for (int i = threadIdx.x; i < n / 2; i += blockDim.x) {
            const int j = (i / h) * 2 * h + (i % h);
            const float a = v[j], b = v[j + h];
            v[j] = __fadd_rn(a, b);
            v[j + h] = __fsub_rn(a, b);
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) v[i] = __fmul_rn(v[i], scale);
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
    hadamard_smem(row, d, scale);
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
    hadamard_smem(row, d, scale);
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
    hadamard_smem(v, n, scale);
    for (int i = threadIdx.x; i < n; i += blockDim.x) row[i] = v[i];
}

// ---------------------------------------------------------------------------------------------
// Refinement (eq. 7 selection, eq. 8 correction) of a decode step, after the split-K pass.

#define SEL_THREADS 1024
#define CORR_THREADS 256
#define CORR_WARPS (CORR_THREADS / 32)
// Selected groups one correction block gathers and applies.
#define CORR_GROUPS 4

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

// Per KV head (one block of SEL_THREADS): merges the split partials of its query heads into
// M, Z and o; scores every eligible group — the largest over query heads of its weight sum
// e^{glog − M}/Z — and selects the top `fraction` by radix selection on the score bits
// (scores are non-negative, so their bits order as the floats do); ties go to the lower
// group, as the host's selection breaks them. Writes the selected groups in ascending order.
extern "C" __global__ void __launch_bounds__(SEL_THREADS) kvarn_refine_select(const KvarnParams p) {
    __shared__ float sM[KV_MAX_GROUP], sZ[KV_MAX_GROUP];
    __shared__ int hist[256];
    __shared__ int tmp[32];
    __shared__ int digit_sh, want_sh;
    // [group][splits]: each split's merge weight; then, when they fit, the score bits.
    extern __shared__ float wsplit[];
    const int h = blockIdx.x, tid = threadIdx.x, G = p.group, d = p.d;
    const int lane = tid & 31, warp = tid >> 5;
    if (tid == 0) p.done[h] = 0u;
    // Merge: warp g reduces query head g's split maxima and sums, then thread (g, c) its
    // channel.
    const size_t stride = (size_t)G * (d + 2);
    if (warp < G) {
        float M, Z;
        merge_stats_warp(p.part + ((size_t)h * p.splits * G + warp) * (d + 2), stride, p.splits,
                         wsplit + warp * p.splits, M, Z);
        if (lane == 0) {
            sM[warp] = M;
            sZ[warp] = Z;
            p.stat[(size_t)(h * G + warp) * (d + 2)] = M;
            p.stat[(size_t)(h * G + warp) * (d + 2) + 1] = Z;
        }
    }
    __syncthreads();
    for (int i = tid; i < G * d; i += SEL_THREADS) {
        const int g = i / d, c = i % d;
        const float* first = p.part + ((size_t)h * p.splits * G + g) * (d + 2);
        p.stat[(size_t)(h * G + g) * (d + 2) + 2 + c] =
            merge_channel(first, stride, p.splits, wsplit + g * p.splits, c) / sZ[g];
    }
    int sinks, n_tiles, tail;
    kvarn_fill(p, sinks, n_tiles, tail);
    const int n = n_tiles * p.per_tile;
    int n_sel = 0;
    if (n > 0) n_sel = min(n, max(1, (int)ceil((double)n * p.fraction)));
    if (tid == 0) p.sel_count[h] = (uint32_t)n_sel;
    if (n_sel == 0) return;
    __syncthreads();
    // Each radix pass and the output pass reread every key: from shared memory they cost a
    // few cycles, from global memory a round trip per key a thread walks.
    uint32_t* keys = p.keys_in_smem ? reinterpret_cast<uint32_t*>(wsplit + G * p.splits)
                                    : p.keys + (size_t)h * p.tile_cap * p.per_tile;
    const float* gl = p.glog + (size_t)h * p.tile_cap * p.per_tile * G;
    // Scores first (independent loads, unrolled), then the passes.
    float inv_z[KV_MAX_GROUP];
#pragma unroll
    for (int g = 0; g < KV_MAX_GROUP; ++g) inv_z[g] = g < G ? 1.0f / sZ[g] : 0.0f;
#pragma unroll 4
    for (int i = tid; i < n; i += SEL_THREADS) {
        float best = 0.0f;
#pragma unroll
        for (int g = 0; g < KV_MAX_GROUP; ++g)
            if (g < G) best = fmaxf(best, expf(gl[(size_t)i * G + g] - sM[g]) * inv_z[g]);
        keys[i] = __float_as_uint(best);
    }
    __syncthreads();
    uint32_t prefix = 0u, pmask = 0u;
    int want = n_sel;  // rank among the keys matching the prefix, from the top
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += SEL_THREADS) hist[i] = 0;
        __syncthreads();
        // Every lane walks the same number of rounds, so the warp votes together. Scores
        // share their top bits: when the whole warp lands on one bin (the common case in the
        // high passes) it adds once, instead of 32 lanes serialising on one address.
        for (int i0 = 0; i0 < n; i0 += SEL_THREADS) {
            const int i = i0 + tid;
            uint32_t bin = 256u;
            if (i < n) {
                const uint32_t k = keys[i];
                if ((k & pmask) == prefix) bin = (k >> shift) & 255u;
            }
            const uint32_t first = __shfl_sync(0xffffffffu, bin, 0);
            if (__all_sync(0xffffffffu, bin == first)) {
                if (lane == 0 && first < 256u) atomicAdd(&hist[first], 32);
            } else if (bin < 256u) {
                atomicAdd(&hist[bin], 1);
            }
        }
        __syncthreads();
        // Counts from the top digit down: the digit where the running count reaches `want`.
        const int c = tid < 256 ? hist[255 - tid] : 0;
        int total;
        const int before = block_exclusive_sum(c, tmp, &total);
        if (tid < 256 && before < want && before + c >= want) {
            digit_sh = 255 - tid;
            want_sh = want - before;
        }
        __syncthreads();
        prefix |= (uint32_t)digit_sh << shift;
        pmask |= 255u << shift;
        want = want_sh;
        __syncthreads();
    }
    // `prefix` is the n_sel-th largest key; take every larger key and the first `want` equal
    // ones. Warp w walks a contiguous run of groups 32 at a time, so the output is in group
    // order: ballots count and place each round's picks.
    const int per_warp = ((n + 32 * 32 - 1) / (32 * 32)) * 32;
    const int w0 = min(n, warp * per_warp), w1 = min(n, w0 + per_warp);
    const unsigned below = (1u << lane) - 1u;
    int gt = 0, eq = 0;
    for (int j = w0; j < w1; j += 32) {
        const int i = j + lane;
        const uint32_t k = i < w1 ? keys[i] : 0u;
        gt += __popc(__ballot_sync(0xffffffffu, i < w1 && k > prefix));
        eq += __popc(__ballot_sync(0xffffffffu, i < w1 && k == prefix));
    }
    // Exclusive sums over warps (lane 0 holds each warp's counts).
    if (lane == 0) {
        hist[warp] = gt;
        hist[32 + warp] = eq;
    }
    __syncthreads();
    if (warp == 0) {
        int g = hist[lane], e = hist[32 + lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int yg = __shfl_up_sync(0xffffffffu, g, o), ye = __shfl_up_sync(0xffffffffu, e, o);
            if (lane >= o) g += yg, e += ye;
        }
        hist[64 + lane] = g - hist[lane];
        hist[96 + lane] = e - hist[32 + lane];
    }
    __syncthreads();
    int out = hist[64 + warp] + min(hist[96 + warp], want);
    int eq_seen = hist[96 + warp];
    uint32_t* sel = p.sel + (size_t)h * p.max_sel;
    for (int j = w0; j < w1; j += 32) {
        const int i = j + lane;
        const uint32_t k = i < w1 ? keys[i] : 0u;
        const bool is_gt = i < w1 && k > prefix, is_eq = i < w1 && k == prefix;
        const unsigned be = __ballot_sync(0xffffffffu, is_eq);
        const bool take = is_gt || (is_eq && eq_seen + __popc(be & below) < want);
        const unsigned bt = __ballot_sync(0xffffffffu, take);
        if (take) sel[out + __popc(bt & below)] = (uint32_t)i;
        out += __popc(bt);
        eq_seen += __popc(be);
    }
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

// Eq. 8 over the selected groups: block (KV head, run of CORR_GROUPS selections) reads its
// groups' units from host memory, rebuilds each token's resident and refined key and value,
// and sums per query head Δden = Σ e^{ℓ'−M} − e^{ℓ−M} and Δnum = Σ e^{ℓ'−M}·v' − e^{ℓ−M}·v.
// The last block of a KV head to finish adds every block's sums in block order and writes
// o' = (Z·o + Δnum) / (Z + Δden), rotated back to the model frame when asked.
extern "C" __global__ void __launch_bounds__(CORR_THREADS) kvarn_refine_correct(const KvarnParams p) {
    extern __shared__ __align__(16) uint8_t ubuf[];
    __shared__ float qs[KV_MAX_GROUP][KV_MAX_D];
    __shared__ float red[CORR_WARPS][KV_MAX_GROUP * (KV_MAX_D + 1)];
    __shared__ float sM[KV_MAX_GROUP], sZ[KV_MAX_GROUP];
    __shared__ int is_last;
    const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int G = p.group, d = p.d, T = p.tile_tokens, rg = p.rgroup;
    const int count = (int)p.sel_count[h];
    const int e0 = b * CORR_GROUPS, ne = max(0, min(CORR_GROUPS, count - e0));
    const uint32_t* sel = p.sel + (size_t)h * p.max_sel + e0;
    const int ustride = (p.unit_bytes + 3) & ~3;
    // Every unit's bytes at once (one pass over all words of all units), so their reads over
    // the bus are in flight together.
    const uint8_t* head_units = p.units + (size_t)h * p.tile_cap * p.per_tile * p.unit_bytes;
    if ((p.unit_bytes & 3) == 0) {
        const int words = p.unit_bytes / 4;
        for (int i = tid; i < ne * words; i += CORR_THREADS) {
            const int e = i / words, w = i % words;
            const uint32_t* src =
                reinterpret_cast<const uint32_t*>(head_units + (size_t)sel[e] * p.unit_bytes);
            reinterpret_cast<uint32_t*>(ubuf + e * ustride)[w] = src[w];
        }
    } else {
        for (int i = tid; i < ne * p.unit_bytes; i += CORR_THREADS) {
            const int e = i / p.unit_bytes, b = i % p.unit_bytes;
            ubuf[e * ustride + b] = head_units[(size_t)sel[e] * p.unit_bytes + b];
        }
    }
    for (int i = tid; i < G * d; i += CORR_THREADS)
        qs[i / d][i % d] = __fmul_rn(p.q[(size_t)h * G * d + i], p.q_scale);
    if (tid < G) {
        sM[tid] = p.stat[(size_t)(h * G + tid) * (d + 2)];
        sZ[tid] = p.stat[(size_t)(h * G + tid) * (d + 2) + 1];
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
    for (int tk = warp; tk < ne * rg; tk += CORR_WARPS) {
        const int e = tk / rg, t = tk % rg;
        const uint32_t gi = sel[e];
        const int ti = (int)gi / p.per_tile, tt = ((int)gi % p.per_tile) * rg + t;
        const uint8_t* rec = p.tiles + ((size_t)h * p.tile_cap + ti) * p.record;
        const uint8_t* unit = ubuf + e * ustride;
        const float kB = rec_half(rec, p.k_b, tt), vA = rec_half(rec, p.v_a, tt),
                    vZ = rec_half(rec, p.v_z, tt);
        float po[KV_MAX_GROUP], pn[KV_MAX_GROUP], v_old[PER_LANE], v_new[PER_LANE];
#pragma unroll
        for (int g = 0; g < KV_MAX_GROUP; ++g) po[g] = pn[g] = 0.0f;
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) {
            v_old[j] = v_new[j] = 0.0f;
            const int c = lane + 32 * j;
            if (c >= d) continue;
            const float kc = (float)stream_bits(rec, p.k_codes * 8 + (c * T + tt) * p.kb, p.kb);
            const float kA = rec_half(rec, p.k_a, c), kZ = rec_half(rec, p.k_z, c);
            const float k_old = refined_elem(kc, 0.0f, kA, kZ, kB);
            const float k_new = refined_elem(
                kc, sub_offset(p.rkb ? stream_bits(unit, (t * d + c) * p.rkb, p.rkb) : 0u, p.rkb),
                kA, kZ, kB);
            const float vc = (float)stream_bits(rec, p.v_codes * 8 + (tt * d + c) * p.vb, p.vb);
            const float vB = rec_half(rec, p.v_b, c);
            v_old[j] = refined_elem(vc, 0.0f, vA, vZ, vB);
            const int vbit = rg * d * p.rkb + (t * d + c) * p.rvb;
            v_new[j] = refined_elem(
                vc, sub_offset(p.rvb ? stream_bits(unit, vbit, p.rvb) : 0u, p.rvb), vA, vZ, vB);
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
#pragma unroll 8
        for (int bb = 0; bb < p.sel_blocks; ++bb) {
            const float* ps = p.cpart + ((size_t)h * p.sel_blocks + bb) * G * (d + 1) + g * (d + 1);
            num_s += __ldcg(ps + c);
            den_s += __ldcg(ps + d);
        }
        rows[i] = (sZ[g] * o + num_s) / (sZ[g] + den_s);
    }
    __syncthreads();
    if (p.rotate_out) {
        for (int g = 0; g < G; ++g) hadamard_smem(rows + g * d, d, p.q_scale);
    }
    for (int i = tid; i < G * d; i += CORR_THREADS) p.out[(size_t)h * G * d + i] = rows[i];
}

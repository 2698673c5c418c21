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
};

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
    // A decode step's fill follows from its position (every earlier full tail encoded).
    int sinks = p.sinks, n_tiles = p.n_tiles, tail = p.tail;
    if (p.pos != nullptr) {
        const int at = (int)p.pos[0];
        if (at < p.sink_cap) {
            sinks = at + 1, n_tiles = 0, tail = 0;
        } else {
            sinks = p.sink_cap, n_tiles = (at - p.sink_cap) / T, tail = (at - p.sink_cap) % T + 1;
        }
    }
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

// Merges the split-K partials of kvarn_attn_decode: one block per query head, one thread per
// output channel. A split that took no chunks has max −∞ and weight 0. With `rotate` the row
// is rotated back to the model frame (scale 1/√d) before it is written.
extern "C" __global__ void kvarn_attn_merge(const float* __restrict__ part,
                                            float* __restrict__ out, int splits, int group,
                                            int d, int rotate, float scale) {
    __shared__ float row[KV_MAX_D];
    const int qh = blockIdx.x, c = threadIdx.x;  // qh = KV head · group + query head
    // Partials of (KV head h, split s, query g) live at ((h · splits + s) · group + g) · (d + 2).
    const int h = qh / group, g = qh % group;
    float m = -INFINITY;
    for (int s = 0; s < splits; ++s)
        m = fmaxf(m, part[(((size_t)h * splits + s) * group + g) * (d + 2)]);
    float z = 0.0f, acc = 0.0f;
    for (int s = 0; s < splits; ++s) {
        const float* ps = part + (((size_t)h * splits + s) * group + g) * (d + 2);
        const float w = ps[0] == -INFINITY ? 0.0f : expf(ps[0] - m);
        z = fmaf(ps[1], w, z);
        if (c < d) acc = fmaf(ps[2 + c], w, acc);
    }
    if (!rotate) {
        if (c < d) out[(size_t)qh * d + c] = acc / z;
        return;
    }
    if (c < d) row[c] = acc / z;
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

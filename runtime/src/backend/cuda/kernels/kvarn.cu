// KVarN-coded KV cache: decode attention over one layer's stored positions as the quantized
// cache keeps them (issue 15). Per KV head: FP16 sink rows, then encoded tiles, then the FP16
// tail, all in the code frame (rotated by the normalised Hadamard transform). A tile record
// holds key codes [d, tile] (bit i·kb of a little-endian stream, i = channel·tile + token) with
// A, Z per channel and B per token, and value codes [tile, d] with A, Z per token and B per
// channel (docs/format.md, "KVarN tile record"); an element is (code·A + Z)·B, each step
// rounded as the CPU decoder rounds it, so a dequantized key or value here is the CPU's, bit
// for bit.
//
// One block per KV head walks the positions in chunks of at most 128 tokens (one tile, or 128
// FP16 rows) with an online softmax per query head of the group: thread t scores token t of
// the chunk against every query head, then thread c accumulates output channel c.
#include "common.cuh"

#define KV_CHUNK 128
#define KV_MAX_GROUP 8
#define KV_MAX_D 128

struct KvarnParams {
    const float* q;         // [kv_heads · group][d], code frame, scaled by 1/√d
    const __half* sink_k;   // [kv_heads][sink_cap][d]
    const __half* sink_v;
    const uint8_t* tiles;   // [kv_heads][tile_cap][record]
    const __half* tail_k;   // [kv_heads][tail_cap][d]
    const __half* tail_v;
    float* out;             // [kv_heads · group][d]
    int group, d;
    int sinks, sink_cap, n_tiles, tile_cap, tail, tail_cap, tile_tokens;
    int kb, vb;
    int record, k_codes, k_a, k_z, k_b, v_codes, v_a, v_z, v_b;
};

// Element i of an f16 array at byte offset `off` of a record (records of odd geometries put
// arrays at odd offsets, so read bytes).
__device__ __forceinline__ float rec_half(const uint8_t* r, int off, int i) {
    const int at = off + 2 * i;
    return __half2float(__ushort_as_half((unsigned short)(r[at] | (r[at + 1] << 8))));
}

// Code `index` of a `bits`-wide little-endian stream at byte offset `off`. Reading the byte
// after a code's last one stays inside the record: metadata follows both code streams.
__device__ __forceinline__ float rec_code(const uint8_t* r, int off, int index, int bits) {
    const int bit = index * bits;
    const uint8_t* p = r + off + (bit >> 3);
    const uint32_t w = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    return (float)((w >> (bit & 7)) & ((1u << bits) - 1u));
}

__device__ __forceinline__ float dequant(float code, float a, float z, float b) {
    return __fmul_rn(__fadd_rn(__fmul_rn(code, a), z), b);
}

extern "C" __global__ void __launch_bounds__(KV_CHUNK) kvarn_attn_decode(const KvarnParams p) {
    __shared__ float qs[KV_MAX_GROUP][KV_MAX_D];
    __shared__ float w[KV_MAX_GROUP][KV_CHUNK];  // a chunk's scores, then its weights
    __shared__ float m_run[KV_MAX_GROUP], z_run[KV_MAX_GROUP], rescale[KV_MAX_GROUP];
    const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int G = p.group, d = p.d;
    for (int i = tid; i < G * d; i += KV_CHUNK) qs[i / d][i % d] = p.q[(size_t)h * G * d + i];
    if (tid < G) {
        m_run[tid] = -INFINITY;
        z_run[tid] = 0.0f;
    }
    float o[KV_MAX_GROUP];
#pragma unroll
    for (int g = 0; g < KV_MAX_GROUP; ++g) o[g] = 0.0f;
    __syncthreads();

    const int sink_chunks = (p.sinks + KV_CHUNK - 1) / KV_CHUNK;
    const int tail_chunks = (p.tail + KV_CHUNK - 1) / KV_CHUNK;
    const int chunks = sink_chunks + p.n_tiles + tail_chunks;
    for (int ci = 0; ci < chunks; ++ci) {
        const uint8_t* rec = nullptr;
        const __half *kr = nullptr, *vr = nullptr;
        int n;
        if (ci < sink_chunks) {
            const int t0 = ci * KV_CHUNK;
            n = min(KV_CHUNK, p.sinks - t0);
            kr = p.sink_k + ((size_t)h * p.sink_cap + t0) * d;
            vr = p.sink_v + ((size_t)h * p.sink_cap + t0) * d;
        } else if (ci < sink_chunks + p.n_tiles) {
            n = p.tile_tokens;
            rec = p.tiles + ((size_t)h * p.tile_cap + (ci - sink_chunks)) * p.record;
        } else {
            const int t0 = (ci - sink_chunks - p.n_tiles) * KV_CHUNK;
            n = min(KV_CHUNK, p.tail - t0);
            kr = p.tail_k + ((size_t)h * p.tail_cap + t0) * d;
            vr = p.tail_v + ((size_t)h * p.tail_cap + t0) * d;
        }
        if (tid < n) {
            float s[KV_MAX_GROUP] = {};
            auto add_key = [&](int c, float k) {  // channel c of token tid's key
#pragma unroll
                for (int g = 0; g < KV_MAX_GROUP; ++g)
                    if (g < G) s[g] = fmaf(qs[g][c], k, s[g]);
            };
            if (rec != nullptr) {
                const float bt = rec_half(rec, p.k_b, tid);
                for (int c = 0; c < d; ++c)
                    add_key(c, dequant(rec_code(rec, p.k_codes, c * n + tid, p.kb),
                                       rec_half(rec, p.k_a, c), rec_half(rec, p.k_z, c), bt));
            } else {
                for (int c = 0; c < d; ++c) add_key(c, __half2float(kr[(size_t)tid * d + c]));
            }
#pragma unroll
            for (int g = 0; g < KV_MAX_GROUP; ++g)
                if (g < G) w[g][tid] = s[g];
        }
        __syncthreads();
        // Softmax bookkeeping of the chunk: one warp per query head.
        for (int g = warp; g < G; g += KV_CHUNK / 32) {
            float mx = -INFINITY;
            for (int t = lane; t < n; t += 32) mx = fmaxf(mx, w[g][t]);
            mx = warp_max(mx);
            const float m_new = fmaxf(m_run[g], mx);
            float sum = 0.0f;
            for (int t = lane; t < n; t += 32) {
                const float e = expf(w[g][t] - m_new);
                w[g][t] = e;
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
            auto add_value = [&](int t, float v) {  // channel tid of token t's value
#pragma unroll
                for (int g = 0; g < KV_MAX_GROUP; ++g)
                    if (g < G) o[g] = fmaf(w[g][t], v, o[g]);
            };
#pragma unroll
            for (int g = 0; g < KV_MAX_GROUP; ++g)
                if (g < G) o[g] *= rescale[g];
            if (rec != nullptr) {
                const float bc = rec_half(rec, p.v_b, tid);
                for (int t = 0; t < n; ++t)
                    add_value(t, dequant(rec_code(rec, p.v_codes, t * d + tid, p.vb),
                                         rec_half(rec, p.v_a, t), rec_half(rec, p.v_z, t), bc));
            } else {
                for (int t = 0; t < n; ++t) add_value(t, __half2float(vr[(size_t)t * d + tid]));
            }
        }
        __syncthreads();  // the next chunk overwrites w and rescale
    }
    if (tid < d) {
#pragma unroll
        for (int g = 0; g < KV_MAX_GROUP; ++g)
            if (g < G) p.out[((size_t)h * G + g) * d + tid] = o[g] / z_run[g];
    }
}

// The KVarN code frame of a head vector: each row of n values (a power of two, n ≤ 1024) times
// the normalised Sylvester Hadamard matrix, in place. One block per row, n/2 threads, one
// butterfly each per stage; stages in increasing span, each sum and difference rounded, then
// the scale — the CPU transform's operations in its order, so both round alike.
extern "C" __global__ void kvarn_hadamard_rows(float* __restrict__ x, int n, float scale) {
    __shared__ float v[1024];
    float* row = x + (size_t)blockIdx.x * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) v[i] = row[i];
    __syncthreads();
    for (int h = 1; h < n; h <<= 1) {
        const int i = threadIdx.x, j = (i / h) * 2 * h + (i % h);
        if (j + h < n) {
            const float a = v[j], b = v[j + h];
            v[j] = __fadd_rn(a, b);
            v[j + h] = __fsub_rn(a, b);
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) row[i] = __fmul_rn(v[i], scale);
}

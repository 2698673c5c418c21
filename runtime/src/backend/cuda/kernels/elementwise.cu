// Row-wise and element-wise ops of the decoder graph. Each is a small share of a step's time;
// what matters is that none reads a host value: token ids and positions come from device
// buffers, so a captured step replays at any position.
#include "common.cuh"

// out[t, :] = table[tokens[t], :]; grid (ceil(cols / 256), n). Ids are checked on the host
// before they are staged; an id past the table (which the host would have refused) reads
// nothing and yields zeros rather than faulting.
__device__ __forceinline__ float table_value(const uint16_t* t, size_t i) { return bf16_bits(t[i]); }
__device__ __forceinline__ float table_value(const float* t, size_t i) { return t[i]; }

template <typename T>
__device__ void embedding_body(const T* __restrict__ table, const uint32_t* __restrict__ tokens,
                               float* __restrict__ out, int cols, int rows) {
    SFX_PDL_TRIGGER();
    const int t = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    const size_t row = tokens[t];
    out[(size_t)t * cols + c] = row < (size_t)rows ? table_value(table, row * cols + c) : 0.0f;
}

extern "C" __global__ void embedding_bf16(const uint16_t* table, const uint32_t* tokens,
                                          float* out, int cols, int rows) {
    embedding_body(table, tokens, out, cols, rows);
}

extern "C" __global__ void embedding_f32(const float* table, const uint32_t* tokens, float* out,
                                         int cols, int rows) {
    embedding_body(table, tokens, out, cols, rows);
}

// RMSNorm of each row: out = (x · 1/sqrt(mean(x²) + eps)) · w, as the CPU reference forms it
// (a correctly rounded division and square root, not rsqrt). One block per row; `out` may
// alias `x` (every thread reads its elements before the barrier and writes only those).
extern "C" __global__ void rms_norm(const float* x, const float* __restrict__ w, float* out,
                                    int cols, float eps) {
    SFX_PDL_TRIGGER();
    __shared__ float red[32];
    const size_t base = (size_t)blockIdx.x * cols;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = x[base + c];
        ss = fmaf(v, v, ss);
    }
    ss = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / (float)cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        out[base + c] = (x[base + c] * inv) * w[c];
    }
}

// Rotary embedding ("rotate_half" pairs i, i + half) of x[n, heads · 2·half] in place, each
// token at the angles of row positions[t] of the [positions, half] cos/sin tables.
// grid (heads, n), block ≥ half (rounded to a warp). Positions past the table (never issued
// by the model) are clamped to its last row so the kernel cannot read out of bounds.
extern "C" __global__ void rope(float* x, const float* __restrict__ cos_t,
                                const float* __restrict__ sin_t,
                                const uint32_t* __restrict__ positions, int heads, int half,
                                int table_positions) {
    SFX_PDL_TRIGGER();
    const int h = blockIdx.x, t = blockIdx.y;
    const size_t p = rope_row(positions[t], table_positions);
    float* head = x + ((size_t)t * heads + h) * (2 * half);
    for (int i = threadIdx.x; i < half; i += blockDim.x)
        rope_rotate(head[i], head[i + half], cos_t[p * half + i], sin_t[p * half + i], head[i],
                    head[i + half]);
}

// RoPE of queries and keys in one launch: grid (heads + kv_heads, n); blocks past `heads`
// rotate the keys.
extern "C" __global__ void rope_qk(float* q, float* k, const float* __restrict__ cos_t,
                                   const float* __restrict__ sin_t,
                                   const uint32_t* __restrict__ positions, int heads,
                                   int kv_heads, int half, int table_positions) {
    SFX_PDL_TRIGGER();
    const bool is_q = (int)blockIdx.x < heads;
    const int h = is_q ? blockIdx.x : blockIdx.x - heads;
    const int t = blockIdx.y;
    const size_t p = rope_row(positions[t], table_positions);
    float* head = (is_q ? q + ((size_t)t * heads + h) * (2 * half)
                        : k + ((size_t)t * kv_heads + h) * (2 * half));
    for (int i = threadIdx.x; i < half; i += blockDim.x)
        rope_rotate(head[i], head[i + half], cos_t[p * half + i], sin_t[p * half + i], head[i],
                    head[i + half]);
}

// Token-major k/v[n, kv_heads · d] → [kv_heads, capacity, d] stores at rows positions[t].
// grid (kv_heads, n).
template <typename T>
__device__ void write_kv_body(const float* __restrict__ k, const float* __restrict__ v,
                              T* __restrict__ kc, T* __restrict__ vc,
                              const uint32_t* __restrict__ positions, int kv_heads, int d,
                              int capacity) {
    const int h = blockIdx.x, t = blockIdx.y;
    if (positions[t] >= (uint32_t)capacity) return;  // refused on the host; never written
    const size_t src = ((size_t)t * kv_heads + h) * d;
    const size_t dst = ((size_t)h * capacity + positions[t]) * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        kv_store(kc + dst + i, k[src + i]);
        kv_store(vc + dst + i, v[src + i]);
    }
}

extern "C" __global__ void write_kv_f32(const float* k, const float* v, float* kc, float* vc,
                                        const uint32_t* positions, int kv_heads, int d,
                                        int capacity) {
    SFX_PDL_TRIGGER();
    write_kv_body(k, v, kc, vc, positions, kv_heads, d, capacity);
}

extern "C" __global__ void write_kv_f16(const float* k, const float* v, __half* kc, __half* vc,
                                        const uint32_t* positions, int kv_heads, int d,
                                        int capacity) {
    SFX_PDL_TRIGGER();
    write_kv_body(k, v, kc, vc, positions, kv_heads, d, capacity);
}

// gate ← silu(gate) · up; SiLU(x) = x / (1 + e^−x).
extern "C" __global__ void silu_mul(float* gate, const float* __restrict__ up, size_t n) {
    SFX_PDL_TRIGGER();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float g = gate[i];
    gate[i] = (g / (1.0f + expf(-g))) * up[i];
}

extern "C" __global__ void add_assign(float* acc, const float* __restrict__ x, size_t n) {
    SFX_PDL_TRIGGER();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) acc[i] += x[i];
}

// y[t, r] += bias[r] for y[rows, cols].
extern "C" __global__ void add_bias_rows(float* y, const float* __restrict__ bias, size_t total,
                                         int cols) {
    SFX_PDL_TRIGGER();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) y[i] += bias[i % cols];
}

// f32 → BF16 (round to nearest even), the tensor-core GEMM's activation operand.
extern "C" __global__ void f32_to_bf16(const float* __restrict__ x, __nv_bfloat16* __restrict__ y,
                                       size_t n) {
    SFX_PDL_TRIGGER();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2bfloat16_rn(x[i]);
}

// Argmax of each row (ties: lowest index; NaN never wins, as on the CPU) in two steps: 64
// blocks per row each reduce a slice to (value, index), then one warp per row merges them. One
// block over a 128K vocabulary would stream it through a single SM (measured 53 µs a token).
#define AM_PARTS 64

__device__ __forceinline__ void am_pick(float& bv, int& bi, float ov, int oi) {
    if (ov > bv || (ov == bv && oi < bi)) {
        bv = ov;
        bi = oi;
    }
}

__device__ __forceinline__ void am_warp(float& bv, int& bi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(SFX_FULL_MASK, bv, o);
        const int oi = __shfl_xor_sync(SFX_FULL_MASK, bi, o);
        am_pick(bv, bi, ov, oi);
    }
}

// grid (AM_PARTS, rows), block 256: part p covers columns [p·cols/P, (p+1)·cols/P).
extern "C" __global__ void argmax_partial(const float* __restrict__ x, float* __restrict__ pv,
                                          int* __restrict__ pi, int cols) {
    SFX_PDL_TRIGGER();
    __shared__ float sv[8];
    __shared__ int si[8];
    const int p = blockIdx.x, row = blockIdx.y;
    const int per = (cols + AM_PARTS - 1) / AM_PARTS;
    const int c0 = p * per, c1 = min(cols, c0 + per);
    const float* xr = x + (size_t)row * cols;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) am_pick(bv, bi, xr[c], c);
    am_warp(bv, bi);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        bv = lane < (int)(blockDim.x >> 5) ? sv[lane] : -INFINITY;
        bi = lane < (int)(blockDim.x >> 5) ? si[lane] : 0x7fffffff;
        am_warp(bv, bi);
        if (lane == 0) {
            pv[row * AM_PARTS + p] = bv;
            pi[row * AM_PARTS + p] = bi;
        }
    }
}

// grid (rows), block 32.
extern "C" __global__ void argmax_final(const float* __restrict__ pv, const int* __restrict__ pi,
                                        uint32_t* __restrict__ ids) {
    SFX_PDL_TRIGGER();
    const int row = blockIdx.x, lane = threadIdx.x;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int p = lane; p < AM_PARTS; p += 32) am_pick(bv, bi, pv[row * AM_PARTS + p], pi[row * AM_PARTS + p]);
    am_warp(bv, bi);
    // A row of NaNs (or -inf only) answers 0, as the CPU's argmax does.
    if (lane == 0) ids[row] = bi == 0x7fffffff ? 0 : (uint32_t)bi;
}

// The synthetic weight of element i: SplitMix64 of (seed, i) → 24 bits → [-1, 1) × scale,
// bit for bit the CPU's `synthetic_value` (integer hash; exact conversions; one rounded
// multiply written with __fmul_rn so it is never contracted into an FMA).
__device__ __forceinline__ float synthetic_value(uint64_t seed, uint64_t i, float scale) {
    uint64_t z = seed + i * 0x9E3779B97F4A7C15ull + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = __fadd_rn(__fmul_rn((float)(uint32_t)(z >> 40), 2.0f / 16777216.0f), -1.0f);
    return __fmul_rn(u, scale);
}

extern "C" __global__ void fill_random_bf16(__nv_bfloat16* __restrict__ out, size_t n,
                                            uint64_t seed, float scale) {
    SFX_PDL_TRIGGER();
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        out[i] = __float2bfloat16_rn(synthetic_value(seed, i, scale));
    }
}

extern "C" __global__ void fill_random_f32(float* __restrict__ out, size_t n, uint64_t seed,
                                           float scale) {
    SFX_PDL_TRIGGER();
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        out[i] = synthetic_value(seed, i, scale);
    }
}

// Refinement accumulate (method eq. 2 / 6) for one output row block:
// y[e] += scales[e] · Σ_j weights[j] · (nibble_j[e] − 8), units of `unit_bytes` bytes,
// element e in byte e/2, low nibble first. The sum over units runs in f32 before the scale,
// as on the CPU.
extern "C" __global__ void add_nibble_units(float* y, const uint8_t* __restrict__ units,
                                            const float* __restrict__ weights,
                                            const float* __restrict__ scales, int n_units,
                                            int unit_bytes, int row_len) {
    SFX_PDL_TRIGGER();
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= row_len) return;
    float acc = 0.0f;
    for (int j = 0; j < n_units; ++j) {
        const float wj = weights[j];
        if (wj == 0.0f) continue;
        const uint8_t byte = units[(size_t)j * unit_bytes + (e >> 1)];
        const int level = (int)((e & 1) ? (byte >> 4) : (byte & 0x0f)) - 8;
        acc += wj * (float)level;
    }
    y[e] += acc * scales[e];
}

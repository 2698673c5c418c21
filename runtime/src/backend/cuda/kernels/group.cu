// Group-quantized weights (RTN / AWQ codes: ŵ[r, i] = (q[r, i] − z[r, g]) · s[r, g], B-bit
// codes in a little-endian bit stream per row, f16 scales and u8 zero points per group):
// the batch-1 matrix–vector product that decode runs, and the f32 dequantization prefill
// feeds to the TF32 tensor-core GEMM.
//
// Matvec. At 2–4 bits the weights are few bytes but many values, so the kernel is bound by
// instructions per weight, not by bytes: each code becomes a float with one shift and one
// logical op — its bits are placed in the top of an f32 mantissa with exponent 0, giving
// f = 1 + q·2^-B exactly — and meets its activation in one FMA. The 1 is taken out per
// 32-column chunk with Σx (Σ f·x = Σx + 2^-B Σ q·x), and the zero point with it:
//   s·(Σ q·x − z·Σx) = s·2^B·Σ f·x − s·(2^B + z)·Σx,
// so a weight costs three instructions and no int→float conversion (that unit runs at a
// sixteenth of the FMA rate on Hopper). A thread owns a 32-column chunk (B four-byte words of
// codes, inside one group: groups are multiples of 32 columns) for R rows at a time; `tpr`
// threads split a row's chunks. x is staged once per block in shared memory, padded by 4
// floats per 32 so the chunk-strided float4 reads of a warp hit distinct banks, with its
// per-chunk sums beside it (reading x through L1 instead measured slower: a warp's chunk-
// strided loads touch 32 lines each). Each next chunk's codes, scale and zero point are
// loaded before the current chunk is multiplied.
#include "common.cuh"

#define GQ_THREADS 256
#define GQ_WARPS (GQ_THREADS / 32)
#define GQ_CHUNK 32  // columns per thread step
#define GQ_PAD(c) ((c) + ((c) >> 5) * 4)

// Code word loads: one 8- or 16-byte load at 2 and 4 bits, three 4-byte loads at 3 bits
// (a 12-byte chunk is only 4-byte aligned).
template <int B>
__device__ __forceinline__ void load_codes(const uint8_t* p, uint32_t (&w)[B]) {
    if constexpr (B == 2) {
        uint2 v;
        asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];"
                     : "=r"(v.x), "=r"(v.y)
                     : "l"(p));
        w[0] = v.x;
        w[1] = v.y;
    } else if constexpr (B == 4) {
        const uint4 v = load_stream(reinterpret_cast<const uint4*>(p));
        w[0] = v.x;
        w[1] = v.y;
        w[2] = v.z;
        w[3] = v.w;
    } else {
#pragma unroll
        for (int i = 0; i < B; ++i) {
            asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];"
                         : "=r"(w[i])
                         : "l"(p + 4 * i));
        }
    }
}

// Code i (0..31) of a chunk as f = 1 + q·2^-B. `i` is a constant after unrolling, so the
// word, offset and shift direction fold away; a code that straddles two words (3 bits) takes a
// funnel shift.
template <int B>
__device__ __forceinline__ float code_f(const uint32_t (&w)[B], int i) {
    constexpr int T = 23 - B;  // mantissa bit of the code's lowest bit
    constexpr uint32_t MASK = ((1u << B) - 1) << T;
    const int bit = B * i, word = bit >> 5, off = bit & 31;
    uint32_t v;
    if (off + B <= 32) {
        v = off >= T ? (w[word] >> (off - T)) : (w[word] << (T - off));
    } else {
        v = __funnelshift_r(w[word], w[word + 1], off) << T;
    }
    return __uint_as_float(0x3F800000u | (v & MASK));
}

template <int B>
__device__ __forceinline__ float chunk_dot(const uint32_t (&w)[B], const float (&xv)[GQ_CHUNK]) {
    // Two partial sums halve the dependent FMA chain.
    float a = 0.0f, b = 0.0f;
#pragma unroll
    for (int i = 0; i < GQ_CHUNK; i += 2) {
        a = fmaf(code_f<B>(w, i), xv[i], a);
        b = fmaf(code_f<B>(w, i + 1), xv[i + 1], b);
    }
    return a + b;
}

template <int B, int R>
__device__ void group_matvec_body(const uint8_t* __restrict__ codes,
                                  const __half* __restrict__ scales,
                                  const uint8_t* __restrict__ zeros,
                                  const float* __restrict__ bias, const float* __restrict__ x,
                                  float* __restrict__ y, int rows, int cols, int row_bytes,
                                  int gpr, int group, int tpr, int accumulate) {
    extern __shared__ __align__(16) float gq_smem[];
    const int chunks = cols / GQ_CHUNK;
    float* xs = gq_smem;                   // [GQ_PAD(cols)]
    float* xsum = gq_smem + GQ_PAD(cols);  // [chunks]
    __shared__ float red[GQ_WARPS][R];
    const int t = blockIdx.y;
    const int sets = GQ_THREADS / tpr, set = threadIdx.x / tpr, sub = threadIdx.x % tpr;
    const int row0 = (blockIdx.x * sets + set) * R;
    constexpr int CHUNK_BYTES = GQ_CHUNK * B / 8;

    int row[R];
#pragma unroll
    for (int r = 0; r < R; ++r) row[r] = min(row0 + r, rows - 1);  // tail rows re-read
    // Codes, scale and zero point of the next chunk are always in flight: the scale is as far
    // from the SM as the codes, and loading it where it is used exposed a DRAM latency per
    // chunk.
    uint32_t w[R][B];
    __half sn[R];
    uint8_t zn[R];
    auto fetch = [&](int chunk) {
        const int g = chunk * GQ_CHUNK / group;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            load_codes<B>(codes + (size_t)row[r] * row_bytes + (size_t)chunk * CHUNK_BYTES, w[r]);
            sn[r] = scales[(size_t)row[r] * gpr + g];
            zn[r] = zeros[(size_t)row[r] * gpr + g];
        }
    };
    int c = sub;
    if (c < chunks) fetch(c);

    const float* xt = x + (size_t)t * cols;
    for (int i = threadIdx.x; i < cols / 4; i += GQ_THREADS) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(xt) + i);
        *reinterpret_cast<float4*>(xs + GQ_PAD(4 * i)) = v;
    }
    __syncthreads();
    for (int k = threadIdx.x; k < chunks; k += GQ_THREADS) {
        const float4* p = reinterpret_cast<const float4*>(xs + GQ_PAD(k * GQ_CHUNK));
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < GQ_CHUNK / 4; ++j) {
            const float4 v = p[j];
            sum += (v.x + v.y) + (v.z + v.w);
        }
        xsum[k] = sum;
    }
    __syncthreads();

    constexpr float TWO_B = (float)(1 << B);
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    while (c < chunks) {
        float xv[GQ_CHUNK];
        const float4* p = reinterpret_cast<const float4*>(xs + GQ_PAD(c * GQ_CHUNK));
#pragma unroll
        for (int j = 0; j < GQ_CHUNK / 4; ++j) {
            const float4 v = p[j];
            xv[4 * j] = v.x;
            xv[4 * j + 1] = v.y;
            xv[4 * j + 2] = v.z;
            xv[4 * j + 3] = v.w;
        }
        const float sx = xsum[c];
        uint32_t cur[R][B];
        float s[R], z[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            s[r] = __half2float(sn[r]);
            z[r] = (float)zn[r];
#pragma unroll
            for (int k = 0; k < B; ++k) cur[r][k] = w[r][k];
        }
        const int next = c + tpr;
        if (next < chunks) fetch(next);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float dot = chunk_dot<B>(cur[r], xv);
            acc[r] = fmaf(s[r] * TWO_B, dot, fmaf(-s[r] * (TWO_B + z[r]), sx, acc[r]));
        }
        c = next;
    }

    // Sum over the tpr threads of each row set: within warps, then across a set's warps.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float v = warp_sum(acc[r]);
        if (lane == 0) red[warp][r] = v;
    }
    __syncthreads();
    if ((int)threadIdx.x < sets * R) {
        const int st = threadIdx.x / R, r = threadIdx.x % R;
        const int wpr = max(tpr / 32, 1), first = st * wpr;
        float total = 0.0f;
        for (int k = 0; k < wpr; ++k) total += red[first + k][r];
        const int out_row = (blockIdx.x * sets + st) * R + r;
        if (out_row < rows) {
            if (bias) total += bias[out_row];
            float* o = y + (size_t)t * rows + out_row;
            *o = accumulate ? *o + total : total;
        }
    }
}

// Dequantizes one 32-column chunk per thread to f32 (prefill: the TF32 GEMM reads the panel;
// a BF16 panel measured mean KL 2.3e-4 against the CPU on SmolLM2 rtn3, over the 1e-4 bound).
template <int B>
__device__ void group_dequant_body(const uint8_t* __restrict__ codes,
                                   const __half* __restrict__ scales,
                                   const uint8_t* __restrict__ zeros,
                                   float* __restrict__ out, int rows, int cols,
                                   int row_bytes, int gpr, int group) {
    const int chunks = cols / GQ_CHUNK;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * chunks) return;
    const int r = (int)(i / chunks), c = (int)(i % chunks);
    uint32_t w[B];
    load_codes<B>(codes + (size_t)r * row_bytes + (size_t)c * (GQ_CHUNK * B / 8), w);
    const int g = c * GQ_CHUNK / group;
    const float s = __half2float(scales[(size_t)r * gpr + g]);
    const float z = (float)zeros[(size_t)r * gpr + g];
    constexpr float TWO_B = (float)(1 << B);
    float4* dst = reinterpret_cast<float4*>(out + (size_t)r * cols + (size_t)c * GQ_CHUNK);
#pragma unroll
    for (int k = 0; k < GQ_CHUNK; k += 4) {
        // (f − 1)·2^B is the code q exactly.
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = ((code_f<B>(w, k + e) - 1.0f) * TWO_B - z) * s;
        dst[k / 4] = make_float4(v[0], v[1], v[2], v[3]);
    }
}

#define SFX_GROUP_MATVEC(B, R)                                                                \
    extern "C" __global__ void __launch_bounds__(GQ_THREADS) group_matvec_b##B##_r##R(        \
        const uint8_t* codes, const __half* scales, const uint8_t* zeros, const float* bias,  \
        const float* x, float* y, int rows, int cols, int row_bytes, int gpr, int group,      \
        int tpr, int accumulate) {                                                            \
        group_matvec_body<B, R>(codes, scales, zeros, bias, x, y, rows, cols, row_bytes, gpr, \
                                group, tpr, accumulate);                                      \
    }

#define SFX_GROUP_DEQUANT(B)                                                                  \
    extern "C" __global__ void group_dequant_f32_b##B(                                       \
        const uint8_t* codes, const __half* scales, const uint8_t* zeros,                     \
        float* out, int rows, int cols, int row_bytes, int gpr, int group) {          \
        group_dequant_body<B>(codes, scales, zeros, out, rows, cols, row_bytes, gpr, group);  \
    }

SFX_GROUP_MATVEC(2, 1)
SFX_GROUP_MATVEC(2, 2)
SFX_GROUP_MATVEC(2, 4)
SFX_GROUP_MATVEC(3, 1)
SFX_GROUP_MATVEC(3, 2)
SFX_GROUP_MATVEC(3, 4)
SFX_GROUP_MATVEC(4, 1)
SFX_GROUP_MATVEC(4, 2)
SFX_GROUP_MATVEC(4, 4)
SFX_GROUP_DEQUANT(2)
SFX_GROUP_DEQUANT(3)
SFX_GROUP_DEQUANT(4)

// Y[m, n] = X[m, k] · W[n, k]ᵀ (+ bias) (+ Y): the prefill GEMM used when cuBLAS is not on the
// machine (a driver-only install) or `SFX_CUDA_GEMM=own` asks for it. Plain shared-memory
// tiling on the CUDA cores with f32 accumulation — exact f32 arithmetic, an order of magnitude
// below cuBLAS's tensor cores, correct for every shape (edges are zero-padded).
#include "common.cuh"

#define GM_TILE 64
#define GM_K 16

template <bool BF16>
__device__ __forceinline__ float load_w(const void* w, size_t at) {
    if (BF16) return bf16_bits(static_cast<const uint16_t*>(w)[at]);
    return static_cast<const float*>(w)[at];
}

// grid (ceil(n / 64), ceil(m / 64)), block (16, 16); each thread computes a 4 × 4 tile.
template <bool BF16>
__device__ void gemm_body(const float* __restrict__ x, const void* __restrict__ w,
                          const float* __restrict__ bias, float* __restrict__ y, int m, int n,
                          int k, int accumulate) {
    __shared__ float xs[GM_K][GM_TILE + 4];
    __shared__ float ws[GM_K][GM_TILE + 4];
    const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * 16 + tx;
    const int m0 = blockIdx.y * GM_TILE, n0 = blockIdx.x * GM_TILE;
    float acc[4][4] = {};
    for (int k0 = 0; k0 < k; k0 += GM_K) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int e = tid + i * 256;       // 64 rows × 16 columns
            const int r = e / GM_K, c = e % GM_K;
            const int kk = k0 + c;
            xs[c][r] = (m0 + r < m && kk < k) ? x[(size_t)(m0 + r) * k + kk] : 0.0f;
            ws[c][r] = (n0 + r < n && kk < k) ? load_w<BF16>(w, (size_t)(n0 + r) * k + kk) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < GM_K; ++kk) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                a[i] = xs[kk][ty * 4 + i];
                b[i] = ws[kk][tx * 4 + i];
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = m0 + ty * 4 + i;
        if (r >= m) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int c = n0 + tx * 4 + j;
            if (c >= n) continue;
            float v = acc[i][j];
            if (bias) v += bias[c];
            float* out = y + (size_t)r * n + c;
            *out = accumulate ? *out + v : v;
        }
    }
}

extern "C" __global__ void gemm_xwt_bf16(const float* x, const void* w, const float* bias,
                                         float* y, int m, int n, int k, int accumulate) {
    gemm_body<true>(x, w, bias, y, m, n, k, accumulate);
}

extern "C" __global__ void gemm_xwt_f32(const float* x, const void* w, const float* bias,
                                        float* y, int m, int n, int k, int accumulate) {
    gemm_body<false>(x, w, bias, y, m, n, k, accumulate);
}

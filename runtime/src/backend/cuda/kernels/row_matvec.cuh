// Pieces shared by the CUDA-core matvec bodies that give each thread 32-column chunks of R
// rows (group.cu's file-layout group codes, coded.cu's look-up-table codes and GGUF blocks):
// x staged in shared memory, the fused RMSNorm's scale, and the sum over a row set's threads.
#pragma once
#include "common.cuh"

// x is staged padded by 4 floats per 32, so the chunk-strided float4 reads of a warp hit
// distinct banks.
#define MV_PAD(c) ((c) + ((c) >> 5) * 4)

// Stages x[t] (`cols` values, a multiple of 4) into `xs`; with NORM stages x ⊙ nw and writes
// each warp's Σ x² to ss_red[warp]. The caller synchronises before reading either.
template <bool NORM, int THREADS>
__device__ __forceinline__ void stage_x(const float* __restrict__ xt,
                                        const float* __restrict__ nw, int cols,
                                        float* __restrict__ xs, float* __restrict__ ss_red) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < cols / 4; i += THREADS) {
        float4 v = __ldg(reinterpret_cast<const float4*>(xt) + i);
        if (NORM) {
            const float4 nv = __ldg(reinterpret_cast<const float4*>(nw) + i);
            ss = fmaf(v.x, v.x, ss);
            ss = fmaf(v.y, v.y, ss);
            ss = fmaf(v.z, v.z, ss);
            ss = fmaf(v.w, v.w, ss);
            v.x *= nv.x;
            v.y *= nv.y;
            v.z *= nv.z;
            v.w *= nv.w;
        }
        *reinterpret_cast<float4*>(xs + MV_PAD(4 * i)) = v;
    }
    if (NORM) {
        ss = warp_sum(ss);
        if ((threadIdx.x & 31) == 0) ss_red[threadIdx.x >> 5] = ss;
    }
}

// sums[k] = Σ of staged columns k·SPAN .. k·SPAN + SPAN − 1 for k < count (SPAN 16 or 32:
// inside one padded 32-column run).
template <int SPAN, int THREADS>
__device__ __forceinline__ void stage_sums(const float* __restrict__ xs, float* __restrict__ sums,
                                           int count) {
    for (int k = threadIdx.x; k < count; k += THREADS) {
        const float4* p = reinterpret_cast<const float4*>(xs + MV_PAD(k * SPAN));
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < SPAN / 4; ++j) {
            const float4 v = p[j];
            sum += (v.x + v.y) + (v.z + v.w);
        }
        sums[k] = sum;
    }
}

// The fused norm's scale, formed as rms_norm forms it: 1 / sqrt(mean(x²) + eps); 1 without.
template <bool NORM, int WARPS>
__device__ __forceinline__ float norm_scale(const float* __restrict__ ss_red, int cols, float eps) {
    if (!NORM) return 1.0f;
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < WARPS; ++k) total += ss_red[k];
    return 1.0f / sqrtf(total / (float)cols + eps);
}

// Chunk c's 32 staged values in registers.
__device__ __forceinline__ void chunk_x(const float* __restrict__ xs, int c, float (&xv)[32]) {
    const float4* p = reinterpret_cast<const float4*>(xs + MV_PAD(c * 32));
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const float4 v = p[k];
        xv[4 * k] = v.x;
        xv[4 * k + 1] = v.y;
        xv[4 * k + 2] = v.z;
        xv[4 * k + 3] = v.w;
    }
}

// Sums each thread's NR partial dots over its row set's `tpr` threads (within the set's lanes
// for tpr ≤ 32, else within warps and then across the set's warps through `red`) and calls
// emit(set, r, total, up_total) once per row r < R of each set (SwiGLU: rows R + r are the up
// rows). Threads of a row set are consecutive; the block has THREADS threads.
template <int R, int NR, bool SWIGLU, int THREADS, class Emit>
__device__ __forceinline__ void reduce_rows(float (&acc)[NR], int tpr, float (*red)[NR],
                                            Emit emit) {
    const int sets = THREADS / tpr, set = threadIdx.x / tpr, sub = threadIdx.x % tpr;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int seg = min(tpr, 32);
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        for (int o = seg / 2; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(SFX_FULL_MASK, acc[r], o);
    }
    if (tpr <= 32) {
        if (sub == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r) emit(set, r, acc[r], SWIGLU ? acc[(R + r) % NR] : 0.0f);
        }
        return;
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < NR; ++r) red[warp][r] = acc[r];
    }
    __syncthreads();
    if ((int)threadIdx.x < sets * R) {
        const int st = threadIdx.x / R, r = threadIdx.x % R;
        const int wpr = tpr / 32, first = st * wpr;
        float total = 0.0f, up_total = 0.0f;
        for (int k = 0; k < wpr; ++k) {
            total += red[first + k][r];
            if (SWIGLU) up_total += red[first + k][(R + r) % NR];
        }
        emit(st, r, total, up_total);
    }
}

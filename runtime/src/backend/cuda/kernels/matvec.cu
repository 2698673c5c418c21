// Batch-1 float matrix–vector products: the decode step's projections and head.
//
// y[r] = Σ_c W[r, c] · x[c] (+ bias[r]) (+ y[r] when accumulating the residual), W row-major
// BF16 or F32, x and y f32, f32 accumulation. At batch 1 these read every weight once per
// token, so the kernel is a streaming read: each thread issues 16-byte loads of R rows for two
// column chunks before using any (R·2 independent loads in flight), weights bypass L1 (x is
// what every block re-reads), 8 warps split the columns and reduce once through shared
// memory. A launch covers a *group* of projections that share x (q, k, v): the block index
// picks the projection, so three small matrices fill the GPU like one large one.
//
// Token rows: gridDim.y tokens (m ≤ 4) each read the weights again; larger m goes to GEMM.
#include "common.cuh"

#define MV_THREADS 256
#define MV_WARPS (MV_THREADS / 32)
#define MV_MAX_ITEMS 3

struct MatvecItem {
    const void* w;       // [rows, cols] BF16 bits or f32
    const float* bias;   // [rows] or null
    float* y;            // [m, rows]
    int rows;
    int block_end;       // exclusive end of this item's blocks in the grid
};

struct MatvecGroup {
    MatvecItem item[MV_MAX_ITEMS];
    int count;
};

// 8 BF16 weights (one uint4) · 8 activations.
__device__ __forceinline__ float dot8_bf16(const uint4 w, const float4 a, const float4 b) {
    float s = bf16_lo(w.x) * a.x;
    s = fmaf(bf16_hi(w.x), a.y, s);
    s = fmaf(bf16_lo(w.y), a.z, s);
    s = fmaf(bf16_hi(w.y), a.w, s);
    s = fmaf(bf16_lo(w.z), b.x, s);
    s = fmaf(bf16_hi(w.z), b.y, s);
    s = fmaf(bf16_lo(w.w), b.z, s);
    s = fmaf(bf16_hi(w.w), b.w, s);
    return s;
}

// 4 f32 weights (one uint4) · 4 activations.
__device__ __forceinline__ float dot4_f32(const uint4 w, const float4 a) {
    float s = __uint_as_float(w.x) * a.x;
    s = fmaf(__uint_as_float(w.y), a.y, s);
    s = fmaf(__uint_as_float(w.z), a.z, s);
    s = fmaf(__uint_as_float(w.w), a.w, s);
    return s;
}

// Per-weight-type vector access: elements per 16-byte chunk, and the chunk's dot product with
// the activations at chunk index i.
template <bool BF16>
struct Chunk;

template <>
struct Chunk<true> {
    static constexpr int ELEMS = 8;
    __device__ static __forceinline__ float dot(const uint4 w, const float* x, int i) {
        const float4* xv = reinterpret_cast<const float4*>(x) + 2 * i;
        return dot8_bf16(w, __ldg(xv), __ldg(xv + 1));
    }
    __device__ static __forceinline__ float scalar(const void* w, size_t at) {
        return bf16_bits(static_cast<const uint16_t*>(w)[at]);
    }
};

template <>
struct Chunk<false> {
    static constexpr int ELEMS = 4;
    __device__ static __forceinline__ float dot(const uint4 w, const float* x, int i) {
        return dot4_f32(w, __ldg(reinterpret_cast<const float4*>(x) + i));
    }
    __device__ static __forceinline__ float scalar(const void* w, size_t at) {
        return static_cast<const float*>(w)[at];
    }
};

// Activations of chunk i, times the RMSNorm weight when the norm is fused (NORM), adding the
// raw values' squares to `ss` (the norm's statistic, reduced with the dot products: every
// block reads all of x anyway, so the norm costs no extra pass over memory).
template <bool BF16, bool NORM>
__device__ __forceinline__ void load_x(const float* x, const float* nw, int i, float (&v)[8],
                                       float& ss) {
    constexpr int E = Chunk<BF16>::ELEMS;
    const float4* xv = reinterpret_cast<const float4*>(x) + (E / 4) * i;
#pragma unroll
    for (int h = 0; h < E / 4; ++h) {
        const float4 a = __ldg(xv + h);
        v[4 * h] = a.x;
        v[4 * h + 1] = a.y;
        v[4 * h + 2] = a.z;
        v[4 * h + 3] = a.w;
    }
    if (NORM) {
        const float4* wv = reinterpret_cast<const float4*>(nw) + (E / 4) * i;
#pragma unroll
        for (int h = 0; h < E / 4; ++h) {
            const float4 w = __ldg(wv + h);
            ss = fmaf(v[4 * h], v[4 * h], ss);
            ss = fmaf(v[4 * h + 1], v[4 * h + 1], ss);
            ss = fmaf(v[4 * h + 2], v[4 * h + 2], ss);
            ss = fmaf(v[4 * h + 3], v[4 * h + 3], ss);
            v[4 * h] *= w.x;
            v[4 * h + 1] *= w.y;
            v[4 * h + 2] *= w.z;
            v[4 * h + 3] *= w.w;
        }
    }
}

// One 16-byte weight chunk · its activations.
template <bool BF16>
__device__ __forceinline__ float dot_chunk(const uint4 w, const float (&v)[8]) {
    if (BF16) {
        return dot8_bf16(w, make_float4(v[0], v[1], v[2], v[3]), make_float4(v[4], v[5], v[6], v[7]));
    }
    return dot4_f32(w, make_float4(v[0], v[1], v[2], v[3]));
}

// Partial sums acc[0..N) of rows `row[r]` of matrices `wm[r]` over this thread's columns (and,
// with NORM, the partial sum of squares of x). The first step's weight loads are issued
// before SFX_PDL_WAIT: weights are never written, so they stream while the previous kernel
// finishes; x is read only after it.
template <int N, bool BF16, bool VEC, bool NORM>
__device__ __forceinline__ void row_partials(const void* const (&wm)[N], const int (&row)[N],
                                             const float* x, const float* nw, int cols,
                                             float (&acc)[N], float& ss) {
#pragma unroll
    for (int r = 0; r < N; ++r) acc[r] = 0.0f;
    ss = 0.0f;
    if (VEC) {
        constexpr int E = Chunk<BF16>::ELEMS;
        const int chunks = cols / E;
        const uint4* wr[N];
#pragma unroll
        for (int r = 0; r < N; ++r) {
            wr[r] = reinterpret_cast<const uint4*>(static_cast<const char*>(wm[r]) +
                                                   (size_t)row[r] * cols * (BF16 ? 2 : 4));
        }
        int i = threadIdx.x;
        uint4 a[N], b[N];
        bool pair = i + MV_THREADS < chunks;
        bool single = !pair && i < chunks;
        if (pair || single) {
#pragma unroll
            for (int r = 0; r < N; ++r) a[r] = load_stream(wr[r] + i);
        }
        if (pair) {
#pragma unroll
            for (int r = 0; r < N; ++r) b[r] = load_stream(wr[r] + i + MV_THREADS);
        }
        SFX_PDL_WAIT();
        while (pair) {
            float va[8], vb[8];
            load_x<BF16, NORM>(x, nw, i, va, ss);
            load_x<BF16, NORM>(x, nw, i + MV_THREADS, vb, ss);
#pragma unroll
            for (int r = 0; r < N; ++r) {
                acc[r] += dot_chunk<BF16>(a[r], va);
                acc[r] += dot_chunk<BF16>(b[r], vb);
            }
            i += 2 * MV_THREADS;
            pair = i + MV_THREADS < chunks;
            single = !pair && i < chunks;
            if (pair || single) {
#pragma unroll
                for (int r = 0; r < N; ++r) a[r] = load_stream(wr[r] + i);
            }
            if (pair) {
#pragma unroll
                for (int r = 0; r < N; ++r) b[r] = load_stream(wr[r] + i + MV_THREADS);
            }
        }
        if (single) {
            float va[8];
            load_x<BF16, NORM>(x, nw, i, va, ss);
#pragma unroll
            for (int r = 0; r < N; ++r) acc[r] += dot_chunk<BF16>(a[r], va);
        }
    } else {
        SFX_PDL_WAIT();
        for (int c = threadIdx.x; c < cols; c += MV_THREADS) {
            float xv = x[c];
            if (NORM) {
                ss = fmaf(xv, xv, ss);
                xv *= nw[c];
            }
#pragma unroll
            for (int r = 0; r < N; ++r) {
                acc[r] = fmaf(Chunk<BF16>::scalar(wm[r], (size_t)row[r] * cols + c), xv, acc[r]);
            }
        }
    }
}

// Block-wide sums: thread r < N of warp 0 returns the total of acc[r] over the block.
template <int N>
__device__ __forceinline__ float reduce_rows(float (&acc)[N], float (*red)[MV_WARPS]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int r = 0; r < N; ++r) {
        const float v = warp_sum(acc[r]);
        if (lane == 0) red[r][warp] = v;
    }
    __syncthreads();
    float total = 0.0f;
    if (threadIdx.x < N) {
#pragma unroll
        for (int k = 0; k < MV_WARPS; ++k) total += red[threadIdx.x][k];
    }
    return total;
}

// The fused norm's scale from the reduced sum of squares (slot `at` of `red`), as
// rms_norm forms it: 1 / sqrt(mean(x²) + eps).
__device__ __forceinline__ float norm_scale(float (*red)[MV_WARPS], int at, int cols, float eps) {
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < MV_WARPS; ++k) ss += red[at][k];
    return 1.0f / sqrtf(ss / (float)cols + eps);
}

template <int R, bool BF16, bool VEC, bool NORM>
__device__ __forceinline__ void matvec_group_body(const MatvecGroup& g, const float* x,
                                                  const float* nw, float eps, int cols,
                                                  int accumulate) {
    __shared__ float red[R + 1][MV_WARPS];
    // The item owning this block, selected with compile-time indices only (a run-time index
    // into the parameter struct would copy it to local memory).
    MatvecItem item = g.item[0];
    int first_block = 0;
#pragma unroll
    for (int k = 1; k < MV_MAX_ITEMS; ++k) {
        if (k < g.count && (int)blockIdx.x >= g.item[k - 1].block_end) {
            item = g.item[k];
            first_block = g.item[k - 1].block_end;
        }
    }
    SFX_PDL_TRIGGER();
    const int t = blockIdx.y;
    const float* xt = x + (size_t)t * cols;
    const int row0 = ((int)blockIdx.x - first_block) * R;
    int row[R];
    const void* wm[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        row[r] = min(row0 + r, item.rows - 1);  // tail rows re-read
        wm[r] = item.w;
    }
    float acc[R + 1];
    float part[R];
    row_partials<R, BF16, VEC, NORM>(wm, row, xt, nw, cols, part, acc[R]);
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = part[r];
    const float total = reduce_rows<R + 1>(acc, red);
    const int r = threadIdx.x;
    if (r < R && row0 + r < item.rows) {
        float v = NORM ? total * norm_scale(red, R, cols, eps) : total;
        if (item.bias) v += item.bias[row0 + r];
        float* out = item.y + (size_t)t * item.rows + row0 + r;
        *out = accumulate ? *out + v : v;
    }
}

// gate ← silu(W_g·x) ⊙ (W_u·x): both rows of a block are read in the same pass over x.
template <int R, bool BF16, bool VEC, bool NORM>
__device__ __forceinline__ void matvec_swiglu_body(const void* wg, const void* wu,
                                                   const float* x, const float* nw, float eps,
                                                   float* out, int rows, int cols) {
    __shared__ float red[2 * R + 1][MV_WARPS];
    SFX_PDL_TRIGGER();
    const int t = blockIdx.y;
    const float* xt = x + (size_t)t * cols;
    const int row0 = blockIdx.x * R;
    // Gate rows then up rows, read in one pass over x.
    int row[2 * R];
    const void* wm[2 * R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        row[r] = row[R + r] = min(row0 + r, rows - 1);
        wm[r] = wg;
        wm[R + r] = wu;
    }
    float acc[2 * R + 1];
    float part[2 * R];
    row_partials<2 * R, BF16, VEC, NORM>(wm, row, xt, nw, cols, part, acc[2 * R]);
#pragma unroll
    for (int r = 0; r < 2 * R; ++r) acc[r] = part[r];
    const float total = reduce_rows<2 * R + 1>(acc, red);
    // Thread r holds gate row r, thread R + r up row r: pair them through shared memory.
    __shared__ float up_row[R];
    const int r = threadIdx.x;
    if (r >= R && r < 2 * R) up_row[r - R] = total;
    __syncthreads();
    if (r < R && row0 + r < rows) {
        // Both products were taken on x ⊙ w: one norm scale applies to each.
        const float scale = NORM ? norm_scale(red, 2 * R, cols, eps) : 1.0f;
        const float g = total * scale;
        out[(size_t)t * rows + row0 + r] = (g / (1.0f + expf(-g))) * up_row[r] * scale;
    }
}

// Each variant with and without the fused RMSNorm of x (`_norm`: x is the raw residual
// stream, nw the norm weight).
#define SFX_MATVEC(R, BF16, VEC, NAME)                                                        \
    extern "C" __global__ void __launch_bounds__(MV_THREADS)                                  \
        matvec_group_##NAME(const MatvecGroup g, const float* x, int cols, int accumulate) {  \
        matvec_group_body<R, BF16, VEC, false>(g, x, nullptr, 0.0f, cols, accumulate);        \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(MV_THREADS)                                  \
        matvec_group_norm_##NAME(const MatvecGroup g, const float* x, const float* nw,        \
                                 float eps, int cols) {                                       \
        matvec_group_body<R, BF16, VEC, true>(g, x, nw, eps, cols, 0);                        \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(MV_THREADS)                                  \
        matvec_swiglu_##NAME(const void* wg, const void* wu, const float* x, float* out,      \
                             int rows, int cols) {                                            \
        matvec_swiglu_body<R, BF16, VEC, false>(wg, wu, x, nullptr, 0.0f, out, rows, cols);   \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(MV_THREADS)                                  \
        matvec_swiglu_norm_##NAME(const void* wg, const void* wu, const float* x,             \
                                  const float* nw, float eps, float* out, int rows,           \
                                  int cols) {                                                 \
        matvec_swiglu_body<R, BF16, VEC, true>(wg, wu, x, nw, eps, out, rows, cols);          \
    }

SFX_MATVEC(1, true, true, bf16_r1)
SFX_MATVEC(2, true, true, bf16_r2)
SFX_MATVEC(4, true, true, bf16_r4)
SFX_MATVEC(1, true, false, bf16_scalar)
SFX_MATVEC(1, false, true, f32_r1)
SFX_MATVEC(2, false, true, f32_r2)
SFX_MATVEC(4, false, true, f32_r4)
SFX_MATVEC(1, false, false, f32_scalar)

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
#include "refine_epilogue.cuh"
#include "packed_codes.cuh"
#include "row_matvec.cuh"

#define GQ_THREADS 256
#define GQ_WARPS (GQ_THREADS / 32)
#define GQ_CHUNK 32  // columns per thread step
#define GQ_PAD(c) MV_PAD(c)
#define GQ_MAX_ITEMS 3

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

// One launch covers up to three projections of the same x (q, k, v: the block index picks
// the item, so three small matrices fill the GPU like one large one), or the gate and up
// projections of the MLP with SwiGLU applied to each row pair (SWIGLU: item 0 gate, item 1
// up, output to item 0's y). With NORM, x is the raw residual stream and the block applies
// RMSNorm while staging it: x ⊙ w goes to shared memory, the sum of squares is reduced in
// the same pass, and the scale multiplies each row's total (every block stages all of x
// anyway, so the norm costs no extra pass and no launch).
struct GqItem {
    const uint8_t* codes;   // [rows, row_bytes]
    const __half* scales;   // [rows, gpr]
    const uint8_t* zeros;   // [rows, gpr]
    const float* bias;      // [rows] or null
    float* y;               // [m, rows]
    int rows;
    int block_end;          // exclusive end of this item's blocks in the grid
    RefineOp refine;        // a decode row's refinement (refine.sel null: none)
};

struct GqGroup {
    GqItem item[GQ_MAX_ITEMS];
    int count;
};

// Chunks a thread loads before it multiplies any: with R rows, U·R·B four-byte words are in
// flight per thread (128 bytes at 2 and 4 bits with R = 4). Bytes in flight are what a
// latency-bound stream is limited by; the first kernel kept one chunk per row in flight and
// ran at a quarter of the bandwidth whatever the width.
template <int B>
struct GqUnroll {
    // 6 and 8 bits (head codes): one chunk is already 24–32 bytes a row.
    static constexpr int U = B == 2 ? 4 : (B >= 6 ? 1 : 2);
};

template <int B, int R, bool NORM, bool SWIGLU, bool REFINE>
__device__ __forceinline__ void gq_matvec_body(const GqGroup& g, const float* __restrict__ x,
                                               const float* __restrict__ nw, float eps,
                                               int cols, int row_bytes, int gpr, int group,
                                               int tpr, int accumulate) {
    constexpr int U = GqUnroll<B>::U;
    constexpr int NR = SWIGLU ? 2 * R : R;  // rows per thread: gate rows, then up rows
    constexpr int CHUNK_BYTES = GQ_CHUNK * B / 8;
    constexpr float TWO_B = (float)(1 << B);
    extern __shared__ __align__(16) float gq_smem[];
    __shared__ float red[GQ_WARPS][NR];
    __shared__ float ss_red[GQ_WARPS];

    // The item owning this block, selected with compile-time indices only (a run-time index
    // into the parameter struct would copy it to local memory).
    GqItem item = g.item[0];
    int first_block = 0;
    if (!SWIGLU) {
#pragma unroll
        for (int k = 1; k < GQ_MAX_ITEMS; ++k) {
            if (k < g.count && (int)blockIdx.x >= g.item[k - 1].block_end) {
                item = g.item[k];
                first_block = g.item[k - 1].block_end;
            }
        }
    }
    SFX_PDL_TRIGGER();
    const int chunks = cols / GQ_CHUNK, chunks_per_group = group / GQ_CHUNK;
    const int sets = GQ_THREADS / tpr, set = threadIdx.x / tpr, sub = threadIdx.x % tpr;
    const int tile0 = ((int)blockIdx.x - first_block) * sets * R;
    const int row0 = tile0 + set * R;

    const uint8_t* codes[NR];
    const __half* scales[NR];
    const uint8_t* zeros[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        const GqItem& it = (SWIGLU && r >= R) ? g.item[1] : item;
        const int row = min(row0 + r % R, item.rows - 1);  // tail rows re-read, not written
        codes[r] = it.codes + (size_t)row * row_bytes;
        scales[r] = it.scales + (size_t)row * gpr;
        zeros[r] = it.zeros + (size_t)row * gpr;
    }

    uint32_t w[U][NR][B];
    __half sn[U][NR];
    uint8_t zn[U][NR];
    auto fetch = [&](int base) {
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const int c = base + j * tpr;
            if (c < chunks) {
                const int gi = c / chunks_per_group;
#pragma unroll
                for (int r = 0; r < NR; ++r) {
                    load_codes<B>(codes[r] + (size_t)c * CHUNK_BYTES, w[j][r]);
                    sn[j][r] = scales[r][gi];
                    zn[j][r] = zeros[r][gi];
                }
            }
        }
    };
    // Weights are never written: their loads go out before x is read (and, under PDL,
    // before the previous kernel has finished).
    int base = sub;
    fetch(base);
    SFX_PDL_WAIT();

    const int t = blockIdx.y;
    const float* xt = x + (size_t)t * cols;
    float* xs = gq_smem;                   // [GQ_PAD(cols)]
    float* xsum = gq_smem + GQ_PAD(cols);  // [chunks]
    stage_x<NORM, GQ_THREADS>(xt, nw, cols, xs, ss_red);
    __syncthreads();
    stage_sums<GQ_CHUNK, GQ_THREADS>(xs, xsum, chunks);
    const float scale = norm_scale<NORM, GQ_WARPS>(ss_red, cols, eps);
    __syncthreads();

    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = 0.0f;
    while (base < chunks) {
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const int c = base + j * tpr;
            if (c < chunks) {
                float xv[GQ_CHUNK];
                chunk_x(xs, c, xv);
                const float sx = xsum[c];
#pragma unroll
                for (int r = 0; r < NR; ++r) {
                    const float s = __half2float(sn[j][r]), z = (float)zn[j][r];
                    const float dot = chunk_dot<B>(w[j][r], xv);
                    acc[r] = fmaf(s * TWO_B, dot, fmaf(-s * (TWO_B + z), sx, acc[r]));
                }
            }
        }
        base += U * tpr;
        if (base < chunks) fetch(base);
    }

    // The block's rows' refinement (decode rows only: one token's selection), in shared
    // memory after x's chunk sums, gate rows then up rows, then refine_rows' scratch (the
    // host sizes both only for refined launches).
    float* rdelta = xsum + chunks;
    const int block_rows = sets * R;
    float* rscratch = rdelta + (SWIGLU ? 2 : 1) * block_rows;
    bool refined[2] = {false, false};
#pragma unroll
    for (int k = 0; k < (SWIGLU ? 2 : 1); ++k) {
        const GqItem& it = k == 1 ? g.item[1] : item;
        if (REFINE && it.refine.sel != nullptr && gridDim.y == 1) {
            refine_rows(it.refine, xt, nw, scale, cols, tile0, block_rows, it.rows,
                        rdelta + k * block_rows, rscratch);
            refined[k] = true;
        }
    }

    auto emit = [&](int st, int r, float total, float up_total) {
        const int out_row = tile0 + st * R + r;
        if (out_row >= item.rows) return;
        const int i = st * R + r;
        const float extra =
            REFINE ? (refined[0] ? rdelta[i] : 0.0f) + lagged_at(item.refine, out_row) : 0.0f;
        projection_out<SWIGLU>(item.y + (size_t)t * item.rows + out_row, total, up_total,
                               scale, item.bias, out_row, accumulate, refined[0] || refined[1],
                               extra, refined[1] ? rdelta[block_rows + i] : 0.0f);
    };
    reduce_rows<R, NR, SWIGLU, GQ_THREADS>(acc, tpr, red, emit);
}

// Dequantizes one 32-column chunk per thread to f32 (prefill: the TF32 GEMM reads the panel;
// a BF16 panel measured mean KL 2.3e-4 against the CPU on SmolLM2 rtn3, over the 1e-4 bound).
template <int B>
__device__ __forceinline__ void group_dequant_chunk(const uint8_t* __restrict__ codes,
                                                    const __half* __restrict__ scales,
                                                    const uint8_t* __restrict__ zeros,
                                                    float* __restrict__ dst, int r, int c,
                                                    int row_bytes, int gpr, int group) {
    uint32_t w[B];
    load_codes<B>(codes + (size_t)r * row_bytes + (size_t)c * (GQ_CHUNK * B / 8), w);
    const int g = c * GQ_CHUNK / group;
    const float s = __half2float(scales[(size_t)r * gpr + g]);
    const float z = (float)zeros[(size_t)r * gpr + g];
    constexpr float TWO_B = (float)(1 << B);
    float4* d4 = reinterpret_cast<float4*>(dst);
#pragma unroll
    for (int k = 0; k < GQ_CHUNK; k += 4) {
        // (f − 1)·2^B is the code q exactly.
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = ((code_f<B>(w, k + e) - 1.0f) * TWO_B - z) * s;
        d4[k / 4] = make_float4(v[0], v[1], v[2], v[3]);
    }
}

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
    group_dequant_chunk<B>(codes, scales, zeros, out + (size_t)r * cols + (size_t)c * GQ_CHUNK,
                           r, c, row_bytes, gpr, group);
}

// Embedding lookup from a coded table (a tied embedding reads the head's codes): one thread
// per (token, 32-column chunk); an id past the table yields zeros rather than faulting (the
// host checks ids before they reach the device).
template <int B>
__device__ void group_gather_body(const uint8_t* __restrict__ codes,
                                  const __half* __restrict__ scales,
                                  const uint8_t* __restrict__ zeros,
                                  const uint32_t* __restrict__ tokens, float* __restrict__ out,
                                  int rows, int cols, int row_bytes, int gpr, int group) {
    SFX_PDL_TRIGGER();
    const int chunks = cols / GQ_CHUNK;
    const int c = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (c >= chunks) return;
    float* dst = out + (size_t)t * cols + (size_t)c * GQ_CHUNK;
    const uint32_t r = tokens[t];
    if (r >= (uint32_t)rows) {
#pragma unroll
        for (int k = 0; k < GQ_CHUNK; ++k) dst[k] = 0.0f;
        return;
    }
    group_dequant_chunk<B>(codes, scales, zeros, dst, (int)r, c, row_bytes, gpr, group);
}

// `_norm`: x is the raw residual stream and nw the RMSNorm weight.
#define SFX_GQ_MATVEC_AS(B, R, RF, TAG)                                                       \
    extern "C" __global__ void __launch_bounds__(GQ_THREADS, 2)                               \
        gq_matvec##TAG##_b##B##_r##R(const GqGroup g, const float* x, int cols,               \
                                     int row_bytes, int gpr, int group, int tpr,              \
                                     int accumulate) {                                        \
        gq_matvec_body<B, R, false, false, RF>(g, x, nullptr, 0.0f, cols, row_bytes, gpr,    \
                                               group, tpr, accumulate);                       \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(GQ_THREADS, 2)                               \
        gq_matvec_norm##TAG##_b##B##_r##R(const GqGroup g, const float* x, const float* nw,   \
                                          float eps, int cols, int row_bytes, int gpr,        \
                                          int group, int tpr) {                               \
        gq_matvec_body<B, R, true, false, RF>(g, x, nw, eps, cols, row_bytes, gpr, group,     \
                                              tpr, 0);                                        \
    }

#define SFX_GQ_SWIGLU_AS(B, R, RF, TAG)                                                       \
    extern "C" __global__ void __launch_bounds__(GQ_THREADS, 2)                               \
        gq_swiglu##TAG##_b##B##_r##R(const GqGroup g, const float* x, int cols,               \
                                     int row_bytes, int gpr, int group, int tpr) {            \
        gq_matvec_body<B, R, false, true, RF>(g, x, nullptr, 0.0f, cols, row_bytes, gpr,     \
                                              group, tpr, 0);                                 \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(GQ_THREADS, 2)                               \
        gq_swiglu_norm##TAG##_b##B##_r##R(const GqGroup g, const float* x, const float* nw,   \
                                          float eps, int cols, int row_bytes, int gpr,        \
                                          int group, int tpr) {                               \
        gq_matvec_body<B, R, true, true, RF>(g, x, nw, eps, cols, row_bytes, gpr, group, tpr, \
                                             0);                                              \
    }

// `_rf` entries apply a decode row's refinement or fetch lag's contributions (the items'
// RefineOp); the plain ones leave that code out, so they keep the unrefined kernel's
// registers and occupancy.
#define SFX_GQ_MATVEC(B, R) SFX_GQ_MATVEC_AS(B, R, false, ) SFX_GQ_MATVEC_AS(B, R, true, _rf)
#define SFX_GQ_SWIGLU(B, R) SFX_GQ_SWIGLU_AS(B, R, false, ) SFX_GQ_SWIGLU_AS(B, R, true, _rf)

#define SFX_GROUP_DEQUANT(B)                                                                  \
    extern "C" __global__ void group_dequant_f32_b##B(                                       \
        const uint8_t* codes, const __half* scales, const uint8_t* zeros,                     \
        float* out, int rows, int cols, int row_bytes, int gpr, int group) {          \
        group_dequant_body<B>(codes, scales, zeros, out, rows, cols, row_bytes, gpr, group);  \
    }                                                                                         \
    extern "C" __global__ void group_gather_f32_b##B(                                        \
        const uint8_t* codes, const __half* scales, const uint8_t* zeros,                     \
        const uint32_t* tokens, float* out, int rows, int cols, int row_bytes, int gpr,       \
        int group) {                                                                          \
        group_gather_body<B>(codes, scales, zeros, tokens, out, rows, cols, row_bytes, gpr,   \
                             group);                                                          \
    }

SFX_GQ_MATVEC(2, 1)
SFX_GQ_MATVEC(2, 2)
SFX_GQ_MATVEC(2, 4)
SFX_GQ_SWIGLU(2, 1)
SFX_GQ_SWIGLU(2, 2)
SFX_GQ_MATVEC(3, 1)
SFX_GQ_MATVEC(3, 2)
SFX_GQ_MATVEC(3, 4)
SFX_GQ_SWIGLU(3, 1)
SFX_GQ_SWIGLU(3, 2)
SFX_GQ_MATVEC(4, 1)
SFX_GQ_MATVEC(4, 2)
SFX_GQ_MATVEC(4, 4)
SFX_GQ_SWIGLU(4, 1)
SFX_GQ_SWIGLU(4, 2)
SFX_GQ_MATVEC(6, 1)
SFX_GQ_MATVEC(6, 2)
SFX_GQ_MATVEC(6, 4)
SFX_GQ_SWIGLU(6, 1)
SFX_GQ_SWIGLU(6, 2)
SFX_GQ_MATVEC(8, 1)
SFX_GQ_MATVEC(8, 2)
SFX_GQ_MATVEC(8, 4)
SFX_GQ_SWIGLU(8, 1)
SFX_GQ_SWIGLU(8, 2)
SFX_GROUP_DEQUANT(2)
SFX_GROUP_DEQUANT(3)
SFX_GROUP_DEQUANT(4)
SFX_GROUP_DEQUANT(6)
SFX_GROUP_DEQUANT(8)

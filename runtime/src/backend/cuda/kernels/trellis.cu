// Trellis-coded weights (QTIP / YAQA: bitshift trellis with 16-bit states over tail-biting
// 16×16 tiles, HYB / 1MAD / 3INST codes, 2–4 bits per weight) on tensor cores. A projection is
//   y = sv ⊙ H_outᵀ · (Ŵ · (H_in · (su ⊙ x)))
// (docs/format.md, "Trellis-coded projections"), run as three launches per projection set
// (two for power-of-two inputs, whose transform the matvec's prologue runs):
//   tr_prepare  x (RMS-normalised when the norm is fused), ⊙ su, the input transform H_in, then
//               split into two f16 planes x'·σ = hi + lo (σ a power of two that puts the
//               largest |x'| just under 2^14): 22 mantissa bits of x', enough that the tensor
//               cores' f16 products match an f32 matvec as closely as the CPU's own rounding;
//   tr_matvec   the tiles decoded straight into mma.sync A fragments (no dequantized copy);
//   tr_finish   ÷σ, the output transform H_outᵀ, ⊙ sv (the code's scale folded in), + bias,
//               then stored, added to the residual stream, or combined by SwiGLU.
// H_n = H_m ⊗ H_{2^k} is a Walsh–Hadamard transform over each row of the [m, 2^k] view and a
// dense ±1 mix across rows; tr_prepare and tr_finish spread a vector over blocks of rows.
//
// Decoding. Lane c of a warp owns bits [8Kc, 8Kc + 8K) of a tile's 256K-bit stream and takes
// the next 16 bits from lane c + 1 by a shuffle (lane 31 from lane 0: the tail-biting wrap), so
// its window holds the 16-bit states of trellis steps 4c..4c+3 (V = 2: HYB) or 8c..8c+7
// (V = 1: 1MAD, 3INST) — sequence positions 8c..8c+7, four f16 pairs, one MMA's A registers:
//   HYB:   h = s·(s + 1); pair = table[(h >> 6) mod 2^9], first value negated by bit 15 of h
//          (only the low 16 bits of s matter, so s needs no mask). The table lies in shared
//          memory with the sign folded in (row (h >> 6) mod 2^10 of a doubled table) and 32
//          times over, copy = lane, so a warp's lookups never share a bank and a step is five
//          instructions: shift, multiply-add, mask, address multiply-add, load. (16 copies
//          make the address one LOP3, (h & 0xffc0) | 4·(lane mod 16), but lanes c and c + 16
//          then share a bank whenever their rows differ with equal parity: measured slower,
//          273 vs 298 tok/s.)
//   1MAD:  y = 34038481·s + 76625530 (mod 2^32); the byte sum of y (one dp4a) lands in the
//          mantissa of 1024.0 and one f16x2 subtraction leaves the exact integers sum − 510;
//          1/147.800537109375 is folded into sv on the host.
//   3INST: y = 89226354·s + 64248484; m = (y & 0x8FFF8FFF) ^ 0x3B603B60 holds two f16 values
//          whose sum is the weight: their halves form two A operands of two MMAs on the same x
//          (each f16 exact, their f32 sum exact as on the CPU).
// Where the positions land in the tile decides how a lane's pairs map to fragment registers:
//   mma order (QTIP's kernel order): the pairs are A registers a0..a3 as they come; B holds
//     x (hi, lo) in columns 0 and 1; output rows g and g + 8 are c0 + c1 and c2 + c3 of lane
//     4g. The planes store each 16-column tile permuted (0 1 8 9 2 3 10 11 …) so lane t reads
//     its four x values at 4t with one 8-byte load.
//   row-major (what sfx-convert writes): lane c = 4g + t decodes half a row, row 2g + t/2,
//     columns 8(t mod 2)..+7. Its pairs go to a0, a2, a1, a3; A row g then mixes two tile rows
//     (lanes t < 2: row 2g, t ≥ 2: row 2g + 1), and A row g + 8 holds their other halves. B
//     takes four x layouts L = 0..3 (top/bottom half × even/odd row), each as hi and lo
//     columns 2L, 2L + 1, zero where a column's k belongs to the other row: then
//     row 2g = D[g][L0] + D[g + 8][L2] and row 2g + 1 = D[g][L1] + D[g + 8][L3], which lane t
//     of group g holds for L = t; one shuffle pairs them up.
// Fragment layouts (PTX ISA, m16n8k16 f16): lane = 4·g + t. A: a0 = (g, 2t..2t+1), a1 =
// (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..). B: b0 = (k 2t..2t+1, n g), b1 = (k
// 2t+8.., n g). C: c0, c1 = (g, 2t..2t+1), c2, c3 = (g+8, ..).
//
// Code layout in memory (docs/format.md, "CUDA trellis layout"): a unit is 16 consecutive
// column tiles (256 columns) of one tile row; for each (tile row, unit) lane c's K bytes of
// each of the 16 tiles are concatenated into 16K bytes = K uint4, read as big-endian words,
// and chunk i of all 32 lanes lies contiguous: uint4 ((tile_row · units + unit) · K + i)·32 + c.
// Columns past the matrix are zero bytes (their x is zero).
#include "common.cuh"
#include "refine_epilogue.cuh"

#define TR_MAX_ITEMS 3
#define TR_UNIT_TILES 16
#define TR_HYB_Q 9
// The HYB table in shared memory: 2^(Q+1) rows (the sign bit folded into the index: rows
// 2^Q.. hold the pairs with the first value negated), 32 copies interleaved (copy = lane), so
// row r starts at byte 128·r = 2·(h & 0xffc0).
#define TR_LUT_ROWS (2 << TR_HYB_Q)
#define TR_LUT_COPIES 32
#define TR_LUT_WORDS (TR_LUT_ROWS * TR_LUT_COPIES)
// Planes of one item are 8 words apart in bank terms, so a warp's 8-byte B reads of the hi
// and lo planes (4 words of offsets each) never share a bank.
#define TR_PLANE_PAD_WORDS 8
// Zeros a row-major B load may read instead of a plane: one unit's 16 tiles of 8 words.
#define TR_ZERO_WORDS (TR_UNIT_TILES * 8)
// Codes (the .sfx scheme byte): HYB, 1MAD, 3INST.
#define TR_HYB 0
#define TR_1MAD 1
#define TR_3INST 2
// Tile orders of the entry points' names: row-major (sfx-convert), mma (QTIP's kernels).
#define rm_ORDER false
#define mma_ORDER true

// Dynamic shared memory of every kernel here: floats for the transforms, words for the matvec.
extern __shared__ __align__(16) float tr_smem[];
extern __shared__ __align__(16) uint32_t tr_words[];

// Item k of a launch's list, with compile-time indices only (a runtime index into a kernel
// parameter array would copy the array to local memory).
template <typename T, int N>
__device__ __forceinline__ T item_at(const T (&items)[N], int k) {
    T it = items[0];
#pragma unroll
    for (int i = 1; i < N; ++i)
        if (k == i) it = items[i];
    return it;
}

// ---------------------------------------------------------------------------------------------
// Transforms (any architecture). A vector of n = m·p values is read as the row-major [m, p]
// view; H_n = H_m ⊗ H_p is a Walsh–Hadamard transform of every row (p a power of two) and a
// dense ±1 mix of the rows at each column. The matvec's prologue transforms a whole
// power-of-two vector in one block (block_fwht_rows); tr_prepare and tr_finish cut every vector
// into row blocks (below).

// Unnormalised FWHT of `chunks` contiguous chunks of 32·E values in shared memory, one warp per
// chunk. Lane c holds values c, c + 32, …, c + 32(E − 1) in registers — strided, so each load
// and store of the warp touches 32 distinct banks (owning E consecutive values instead put
// E/2 lanes on one bank and made this loop the transforms' largest cost). The spans 1…16 are
// five shuffle stages, the spans 32…16E register stages after them: the stages run in
// increasing span as in the CPU transform, so the rounding is the same.
template <int E>
__device__ __forceinline__ void warp_fwht_regs(float (&v)[E]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int mask = 1; mask < 32; mask <<= 1) {
        const bool upper = (lane & mask) != 0;
#pragma unroll
        for (int i = 0; i < E; ++i) {
            const float other = __shfl_xor_sync(SFX_FULL_MASK, v[i], mask);
            v[i] = upper ? other - v[i] : v[i] + other;
        }
    }
#pragma unroll
    for (int h = 1; h < E; h <<= 1) {
#pragma unroll
        for (int i = 0; i < E; ++i) {
            if ((i & h) == 0) {
                const float a = v[i], b = v[i + h];
                v[i] = a + b;
                v[i + h] = a - b;
            }
        }
    }
}

template <int E>
__device__ __forceinline__ void warp_fwht_chunks(float* buf, int chunks) {
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int ch = threadIdx.x >> 5; ch < chunks; ch += warps) {
        float* base = buf + ch * 32 * E + lane;
        float v[E];
#pragma unroll
        for (int i = 0; i < E; ++i) v[i] = base[32 * i];
        warp_fwht_regs<E>(v);
#pragma unroll
        for (int i = 0; i < E; ++i) base[32 * i] = v[i];
    }
}

// Every row of length p (a power of two) of the [m, p] buffer: chunks of up to 512 by warps,
// then the stages across chunks (rows longer than 512) and rows shorter than 32 by plain
// butterflies. Ends with a barrier.
__device__ void block_fwht_rows(float* buf, int m, int p) {
    const int n = m * p;
    int done = 1;  // butterfly span reached so far
    if (p >= 512) {
        warp_fwht_chunks<16>(buf, n / 512);
        done = 512;
    } else if (p == 256) {
        warp_fwht_chunks<8>(buf, n / 256);
        done = 256;
    } else if (p == 128) {
        warp_fwht_chunks<4>(buf, n / 128);
        done = 128;
    } else if (p == 64) {
        warp_fwht_chunks<2>(buf, n / 64);
        done = 64;
    } else if (p == 32) {
        warp_fwht_chunks<1>(buf, n / 32);
        done = 32;
    }
    __syncthreads();
    for (int h = done, lh = __ffs(done) - 1; h < p; h <<= 1, ++lh) {
        for (int i = threadIdx.x; i < n / 2; i += blockDim.x) {
            const int j = ((i >> lh) << (lh + 1)) | (i & (h - 1));
            const float a = buf[j], b = buf[j + h];
            buf[j] = a + b;
            buf[j + h] = a - b;
        }
        __syncthreads();
    }
}

// Row blocks of a transform (tr_prepare, tr_finish). With p = n/m split as p = q·P (P = min(p,
// 512) a power of two), H_n = (H_m ⊗ H_q) ⊗ H_P: the vector is M = n/P rows of P values, and
// since the two factors commute, output row r = H_P · Σ_k C[r][k]·row_k with C = H_m ⊗ H_q
// (Sylvester's H_q: the sign of popcount(j & j')). A block owns RB = min(512/P, M) rows, a
// thread one value: it sums its column over all M input rows (independent loads, no block-wide
// copy of the vector), then the block transforms its own rows only. Every block used to run
// the whole vector's row transforms and take a column slice of the mix: ~1,600 instructions a
// warp on a latency chain, 23.7 µs under ncu for the 8B shape's gate/up finish.
#define TR_ROW_MAX 512

struct RowView {
    int P, lq, M, RB;  // row length, log2 q, rows, rows per block
};

__device__ __forceinline__ RowView row_view(int n, int m) {
    RowView v;
    const int p = n / m;
    v.P = min(p, TR_ROW_MAX);
    v.lq = __ffs(p / v.P) - 1;
    v.M = n / v.P;
    v.RB = min(TR_ROW_MAX / v.P, v.M);
    return v;
}

// A block rotation (I_m ⊗ H_b)/√b: m > 1 blocks and no dense factor. Its row view has rows
// of P = b (≤ 512) values and no mix across them (C = I).
__device__ __forceinline__ bool row_identity(const float* hm, int m) {
    return hm == nullptr && m > 1;
}

// C[r][k] (transposed: C[k][r]) of the row mix: hm (m × m, null for m = 1) ⊗ Sylvester's H_q;
// the identity under a block rotation.
__device__ __forceinline__ float row_coeff(const float* __restrict__ hm, int m, int lq,
                                           bool transpose, int r, int k) {
    if (row_identity(hm, m)) return r == k ? 1.0f : 0.0f;
    const int qm = (1 << lq) - 1;
    const int i = r >> lq, ik = k >> lq;
    const float h = hm == nullptr ? 1.0f : __ldg(hm + (transpose ? ik * m + i : i * m + ik));
    return (__popc(r & k & qm) & 1) ? -h : h;
}

// Unnormalised Walsh–Hadamard transform of rows of P values held one per thread (thread t:
// element t mod P), V vectors at once; `buf` holds 2·V·blockDim floats. Spans below 32 are
// shuffles, the rest go through shared memory (double-buffered: one barrier a stage); spans
// increase as in the CPU transform. Every thread of the block calls it.
template <int V>
__device__ __forceinline__ void row_fwht(float (&v)[V], int P, float* buf) {
    const int t = threadIdx.x;
    for (int h = 1; h < min(P, 32); h <<= 1) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float other = __shfl_xor_sync(SFX_FULL_MASK, v[j], h);
            v[j] = (t & h) ? other - v[j] : v[j] + other;
        }
    }
    int s = 0;
    for (int h = 32; h < P; h <<= 1, s ^= 1) {
        float* b = buf + s * V * blockDim.x;
#pragma unroll
        for (int j = 0; j < V; ++j) b[j * blockDim.x + t] = v[j];
        __syncthreads();
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float other = b[j * blockDim.x + (t ^ h)];
            v[j] = (t & h) ? other - v[j] : v[j] + other;
        }
    }
}

// This thread's place in a row block: its row r, column c, and whether it holds a value.
struct RowSlot {
    int r, c;
    bool valid;
};

__device__ __forceinline__ RowSlot row_slot(const RowView& v) {
    RowSlot s;
    s.r = blockIdx.x * v.RB + (int)threadIdx.x / v.P;
    s.c = (int)threadIdx.x % v.P;
    s.valid = (int)threadIdx.x < v.RB * v.P && s.r < v.M;
    return s;
}

// The row mix's coefficients of a block's rows, C[r][k] (Cᵀ with `transpose`) at
// coef[(r − first row)·M + k], where a dense factor makes them loads: they are weights, so the
// kernels stage them before waiting for the previous kernel. Nothing is staged without a dense
// factor (the coefficients are a popcount: measured, staging them and batching the few loads
// of those mixes made the 4096-wide finish ~1 µs slower) or where they would not fit; the
// caller's barrier after the wait is then skipped too (`staged` is uniform over the block).
#define TR_COEF_MAX 1024
struct RowCoeffs {
    float* coef;
    bool staged;
};

__device__ __forceinline__ RowCoeffs stage_row_coeffs(float* coef, const float* __restrict__ hm,
                                                      int m, const RowView& v, bool transpose) {
    const int first = blockIdx.x * v.RB, rows = min(v.RB, v.M - first);
    if (hm == nullptr || rows * v.M > TR_COEF_MAX) return {coef, false};
    for (int i = threadIdx.x; i < rows * v.M; i += blockDim.x) {
        const int rr = i / v.M, k = i - rr * v.M;
        coef[i] = row_coeff(hm, m, v.lq, transpose, first + rr, k);
    }
    return {coef, true};
}

// C[r][k] from the staged coefficients (after a barrier) or computed in place.
__device__ __forceinline__ float staged_coeff(const RowCoeffs& rc, const float* __restrict__ hm,
                                              int m, const RowView& v, bool transpose, int r,
                                              int k) {
    return rc.staged ? rc.coef[(r - (int)blockIdx.x * v.RB) * v.M + k]
                     : row_coeff(hm, m, v.lq, transpose, r, k);
}

// Loads of a dense row mix issued together: the mix of the 8B shape's 14336-wide vectors has 28
// terms, which eight at a time took four dependent trips to L2.
#define TR_MIX_BATCH 32

// Σ_k C[r][k]·in[k·P + c] (transposed C for the output transform), in k order.
__device__ __forceinline__ float row_mix(const float* __restrict__ in, const RowCoeffs& rc,
                                         const float* __restrict__ hm, int m, const RowView& v,
                                         bool transpose, int r, int c) {
    if (row_identity(hm, m)) return in[r * v.P + c];
    float acc = 0.0f;
    if (!rc.staged) {
#pragma unroll 8
        for (int k = 0; k < v.M; ++k)
            acc = fmaf(row_coeff(hm, m, v.lq, transpose, r, k), in[k * v.P + c], acc);
        return acc;
    }
    for (int k0 = 0; k0 < v.M; k0 += TR_MIX_BATCH) {
        float val[TR_MIX_BATCH];
#pragma unroll
        for (int j = 0; j < TR_MIX_BATCH; ++j)
            val[j] = k0 + j < v.M ? in[(k0 + j) * v.P + c] : 0.0f;
#pragma unroll
        for (int j = 0; j < TR_MIX_BATCH; ++j)
            if (k0 + j < v.M)
                acc = fmaf(staged_coeff(rc, hm, m, v, transpose, r, k0 + j), val[j], acc);
    }
    return acc;
}
struct TrPrepItem {
    const float* su;  // [n] input signs
    const float* hm;  // [m, m] ±1, null when m = 1
    int m;
    __half* planes;   // [tokens][2][pcols] hi, lo (the prefill GEMM reads hi only)
    float* sigma;     // [tokens] the planes' scale σ
};

struct TrPrep {
    TrPrepItem item[TR_MAX_ITEMS];
    int count;
};

// Storage position of column c (mod 16) in the mma-order planes: lane t reads columns 2t,
// 2t + 1, 2t + 8, 2t + 9 as positions 4t..4t+3.
__device__ __forceinline__ int mma_plane_position(int c) {
    return (c & 1) | ((c >> 3) << 1) | (((c >> 1) & 3) << 2);
}

// The planes' scale σ for an input of norm ‖x'‖₂: a power of two that puts the largest |x'_i|
// (≤ ‖x'‖₂) just under 2^14.
__device__ __forceinline__ float plane_sigma(float norm2) {
    int e = 0;
    frexpf(norm2 * 1.001f, &e);  // every |x'_i| ≤ ‖x'‖₂ < 2^e
    return (norm2 > 0.0f && isfinite(norm2)) ? ldexpf(1.0f, 14 - e) : 1.0f;
}

// Column `col` of the planes: v (already ×σ) as hi + lo f16 values.
template <bool MMA>
__device__ __forceinline__ void store_plane_value(__half* hi, __half* lo, int col, float v) {
    const int at = MMA ? (col & ~15) | mma_plane_position(col & 15) : col;
    const __half h = __float2half_rn(v);
    hi[at] = h;
    lo[at] = __float2half_rn(v - __half2float(h));
}

// grid (row blocks, items, tokens). x' = H_in · (su ⊙ x̂) / √n with x̂ = x, or RMSNorm(x)·w under
// NORM; each block writes its rows. The planes' σ comes from ‖x'‖₂ = ‖x̂‖₂ (the transform is
// orthonormal), a bound on every |x'_i| that every block sums alike over its first row's
// threads (which see every element once), so no block needs another's values.
template <bool NORM, bool MMA>
__device__ void tr_prepare_body(const TrPrep& pr, const float* __restrict__ x,
                                const float* __restrict__ nw, float eps, int n, int pcols,
                                float inv_sqrt_n) {
    SFX_PDL_TRIGGER();
    __shared__ float buf[2 * TR_ROW_MAX];
    __shared__ float red[32];
    __shared__ float coef[TR_COEF_MAX];
    const TrPrepItem it = item_at(pr.item, blockIdx.y);
    const int t = blockIdx.z;
    const RowView v = row_view(n, it.m);
    if ((int)blockIdx.x * v.RB >= v.M) return;
    const RowSlot s = row_slot(v);
    const RowCoeffs rc = stage_row_coeffs(coef, it.hm, it.m, v, false);
    SFX_PDL_WAIT();
    if (rc.staged) __syncthreads();
    const float* xt = x + (size_t)t * n;
    float acc = 0.0f, ss = 0.0f, ss_hat = 0.0f;
    if (s.valid) {
        // Each batch's loads go out together: a half (with the norm's weights, a quarter)
        // batch, so the values fit in the registers of a 512-thread block.
        constexpr int B = NORM ? TR_MIX_BATCH / 4 : TR_MIX_BATCH / 2;
        for (int k0 = 0; k0 < v.M; k0 += B) {
            float xs[B], ws[B], us[B];
#pragma unroll
            for (int j = 0; j < B; ++j) {
                const int i = (k0 + j) * v.P + s.c;
                const bool in = k0 + j < v.M;
                xs[j] = in ? xt[i] : 0.0f;
                ws[j] = in && NORM ? nw[i] : 0.0f;
                us[j] = in ? it.su[i] : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < B; ++j) {
                if (k0 + j >= v.M) continue;
                float xv = xs[j];
                if (NORM) {
                    ss = fmaf(xv, xv, ss);
                    xv *= ws[j];
                }
                ss_hat = fmaf(xv, xv, ss_hat);
                const float c = staged_coeff(rc, it.hm, it.m, v, false, s.r, k0 + j);
                acc = fmaf(c, xv * us[j], acc);
            }
        }
        if ((int)threadIdx.x >= v.P) ss = ss_hat = 0.0f;  // counted by the first row
    }
    float scale = inv_sqrt_n, inv_rms = 1.0f;
    if (NORM) {
        inv_rms = 1.0f / sqrtf(block_sum(ss, red) / (float)n + eps);
        scale *= inv_rms;
    }
    const float norm2 = sqrtf(block_sum(ss_hat, red)) * inv_rms;
    float val[1] = {acc};
    row_fwht<1>(val, v.P, buf);
    const int o = s.r * v.P + s.c;
    const float sigma = plane_sigma(norm2);
    if (threadIdx.x == 0 && blockIdx.x == 0) it.sigma[t] = sigma;
    __half* hi = it.planes + (size_t)t * 2 * pcols;
    if (s.valid) store_plane_value<MMA>(hi, hi + pcols, o, val[0] * (scale * sigma));
}

extern "C" __global__ void __launch_bounds__(TR_ROW_MAX)
    tr_prepare_rm(const TrPrep p, const float* x, int n, int pcols, float inv_sqrt_n) {
    tr_prepare_body<false, false>(p, x, nullptr, 0.0f, n, pcols, inv_sqrt_n);
}
extern "C" __global__ void __launch_bounds__(TR_ROW_MAX)
    tr_prepare_mma(const TrPrep p, const float* x, int n, int pcols, float inv_sqrt_n) {
    tr_prepare_body<false, true>(p, x, nullptr, 0.0f, n, pcols, inv_sqrt_n);
}
extern "C" __global__ void __launch_bounds__(TR_ROW_MAX)
    tr_prepare_norm_rm(const TrPrep p, const float* x, const float* nw, float eps, int n,
                       int pcols, float inv_sqrt_n) {
    tr_prepare_body<true, false>(p, x, nw, eps, n, pcols, inv_sqrt_n);
}
extern "C" __global__ void __launch_bounds__(TR_ROW_MAX)
    tr_prepare_norm_mma(const TrPrep p, const float* x, const float* nw, float eps, int n,
                        int pcols, float inv_sqrt_n) {
    tr_prepare_body<true, true>(p, x, nw, eps, n, pcols, inv_sqrt_n);
}

struct TrFinishItem {
    const float* rot;    // [tokens][n] Ŵ·x'σ (decode) or Ŵ·x' (prefill)
    const float* sigma;  // [tokens], null for 1
    const float* sv;     // [n] output signs × weight scale × the code's value scale
    const float* hm;     // [m, m] ±1, null when m = 1
    const float* bias;   // [n] or null
    float* y;            // [tokens][n]
    int m;
    int n;
    float inv_sqrt_n;
    // A decode row's refinement (refine_epilogue.cuh; refine.sel null: none) over the
    // projection's input x[rlen] (its RMSNorm with weight rnw, eps reps), as the prologue
    // normalised it.
    RefineOp refine;
    const float* rx;
    const float* rnw;
    float reps;
    int rlen;
};

// Dynamic shared memory of a refined finish: the deltas of its items' rows
// ([items][TR_ROW_MAX]), then refine_rows' scratch. An unrefined finish has none.
extern __shared__ __align__(16) float tr_finish_smem[];

// The norm's scale of a refined finish's input, formed as rms_norm forms it (1 without a norm).
__device__ __forceinline__ float finish_norm_inv(const TrFinishItem& it, float* red) {
    if (it.rnw == nullptr) return 1.0f;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < it.rlen; i += blockDim.x) ss = fmaf(it.rx[i], it.rx[i], ss);
    ss = block_sum(ss, red);
    return 1.0f / sqrtf(ss / (float)it.rlen + it.reps);
}

// The refinement of the block's output rows [row0, row0 + n) of item `it` into `delta` (every
// thread calls it; nothing without a refinement or beyond one token), the norm's scale formed
// as rms_norm forms it; `scratch` is refine_rows'. Returns whether it ran.
__device__ __forceinline__ bool finish_refinement(const TrFinishItem& it, int row0, int n,
                                                  float* delta, float* red, float* scratch) {
    if (it.refine.sel == nullptr || gridDim.z != 1) return false;
    const float inv = finish_norm_inv(it, red);
    refine_rows(it.refine, it.rx, it.rnw, inv, it.rlen, row0, n, it.n, delta, scratch);
    return true;
}

// Most shared memory a finish's read-ahead operands take (the host sizes the launch's scratch
// by the same rule: `FINISH_READ_AHEAD_MAX`).
#define TR_READ_AHEAD_MAX 40960

// Bytes of item `it`'s read-ahead region for `n` rows per block (16-byte multiple; 0 where it
// has no decode row's columns).
__device__ __forceinline__ int finish_ahead_bytes(const TrFinishItem& it, int n) {
    if (it.refine.sel == nullptr || gridDim.z != 1) return 0;
    return (refine_prefetch_bytes(it.refine.selected, n) + 15) & ~15;
}

// Fetch lead's staged operand read ahead for the finish (refine_epilogue.cuh): the block's
// column pieces, selection and scales copied before the launch waits for the matvec (they come
// from the far lane, joined before the projection's first launch), the input's values after.
// Issues and commits the copies of items [0, count) into `region` where every one qualifies and
// all fit; returns whether it did.
template <int COUNT>
__device__ __forceinline__ bool finish_read_ahead(const TrFinishItem* const (&items)[COUNT],
                                                  int row0, int n, unsigned char* region,
                                                  RefinePrefetch (&pf)[COUNT]) {
    int total = 0;
#pragma unroll
    for (int k = 0; k < COUNT; ++k) {
        const int b = finish_ahead_bytes(*items[k], n);
        if (b == 0 || !refine_prefetchable(items[k]->refine, row0, n, b)) return false;
        total += b;
    }
    if (total > TR_READ_AHEAD_MAX) return false;
#pragma unroll
    for (int k = 0; k < COUNT; ++k) {
        refine_prefetch(items[k]->refine, row0, n, items[k]->n, region, pf[k]);
        region += finish_ahead_bytes(*items[k], n);
    }
    copy_async_commit();
    return true;
}

// The read-ahead refinement of item `it`'s rows [row0, row0 + n) into `delta`, with the norm's
// scale `inv`, and of a second item (SwiGLU's up) in the same passes where `it2` is given
// (every thread calls it).
__device__ __forceinline__ void finish_refinement_ahead(
    const TrFinishItem& it, RefinePrefetch& pf, float inv, int row0, int n, float* delta,
    const TrFinishItem* it2 = nullptr, RefinePrefetch* pf2 = nullptr, float inv2 = 1.0f,
    float* delta2 = nullptr) {
    copy_async_wait<0>();
    __syncthreads();
    auto gather = [&](const TrFinishItem& t, RefinePrefetch& p, float s) {
        for (int j = threadIdx.x; j < t.refine.selected; j += blockDim.x) {
            const uint32_t c = p.sel[j];
            float v = 0.0f;
            if (c < (uint32_t)t.rlen) {
                v = t.rx[c];
                if (t.rnw != nullptr) v = (v * s) * t.rnw[c];
            }
            p.vals[j] = v;
        }
    };
    gather(it, pf, inv);
    if (it2 != nullptr) gather(*it2, *pf2, inv2);
    __syncthreads();
    refine_rows_prefetched(it.refine, pf, [&](int j, uint32_t) { return pf.vals[j]; }, it.rlen,
                           row0, n, it.n, delta);
    if (it2 != nullptr)
        refine_rows_prefetched(it2->refine, *pf2, [&](int j, uint32_t) { return pf2->vals[j]; },
                               it2->rlen, row0, n, it2->n, delta2);
    __syncthreads();
}

struct TrFinish {
    TrFinishItem item[TR_MAX_ITEMS];
    int count;
};

// grid (row blocks, items, tokens): y (+)= sv ⊙ H_outᵀ rot / (σ√n) + bias over the block's
// rows. sv and the bias are weights: read before waiting for the matvec's outputs.
// REFINE: the launch applies a decode row's refinement or fetch lag's contributions (the
// `_rf` entries); without it that code is left out.
template <bool REFINE>
__device__ __forceinline__ void tr_finish_body(const TrFinish& f, int accumulate) {
    SFX_PDL_TRIGGER();
    __shared__ float buf[2 * TR_ROW_MAX];
    __shared__ float coef[TR_COEF_MAX];
    const TrFinishItem it = item_at(f.item, blockIdx.y);
    const int t = blockIdx.z;
    const RowView v = row_view(it.n, it.m);
    if ((int)blockIdx.x * v.RB >= v.M) return;
    const RowSlot s = row_slot(v);
    const int o = s.r * v.P + s.c;
    const float sv = s.valid ? it.sv[o] : 0.0f;
    const float bias = s.valid && it.bias ? it.bias[o] : 0.0f;
    const RowCoeffs rc = stage_row_coeffs(coef, it.hm, it.m, v, true);
    const int row0 = (int)blockIdx.x * v.RB * v.P;
    RefinePrefetch pf[1];
    const TrFinishItem* const ahead_items[1] = {&it};
    const bool ahead =
        REFINE && finish_read_ahead(ahead_items, row0, v.RB * v.P,
                                    reinterpret_cast<unsigned char*>(tr_finish_smem + TR_ROW_MAX), pf);
    SFX_PDL_WAIT();
    if (rc.staged) __syncthreads();
    float val[1] = {s.valid ? row_mix(it.rot + (size_t)t * it.n, rc, it.hm, it.m, v, true, s.r,
                                      s.c)
                            : 0.0f};
    row_fwht<1>(val, v.P, buf);
    float* delta = tr_finish_smem;
    bool refined = false;
    if (REFINE && ahead) {
        finish_refinement_ahead(it, pf[0], finish_norm_inv(it, buf), row0, v.RB * v.P, delta);
        refined = true;
    } else if (REFINE) {
        refined = finish_refinement(it, row0, v.RB * v.P, delta, buf, tr_finish_smem + TR_ROW_MAX);
    }
    if (!s.valid) return;
    const float scale = it.inv_sqrt_n / (it.sigma ? it.sigma[t] : 1.0f);
    float out = val[0] * scale * sv;
    if (it.bias) out += bias;
    if (REFINE) {
        if (refined) out += delta[o - row0];
        out += lagged_at(it.refine, o);
    }
    float* y = it.y + (size_t)t * it.n;
    y[o] = accumulate ? y[o] + out : out;
}

extern "C" __global__ void __launch_bounds__(TR_ROW_MAX)
    tr_finish(const TrFinish f, int accumulate) {
    tr_finish_body<false>(f, accumulate);
}

extern "C" __global__ void __launch_bounds__(TR_ROW_MAX)
    tr_finish_rf(const TrFinish f, int accumulate) {
    tr_finish_body<true>(f, accumulate);
}

// grid (row blocks, 1, tokens): item 0 the gate, item 1 the up projection (one row view: the
// host checks their factors agree); gate ← silu(g) · u.
template <bool REFINE>
__device__ __forceinline__ void tr_finish_swiglu_body(const TrFinish& f) {
    SFX_PDL_TRIGGER();
    __shared__ float buf[2 * 2 * TR_ROW_MAX];
    __shared__ float coef[2][TR_COEF_MAX];
    const int t = blockIdx.z;
    const TrFinishItem& g = f.item[0];
    const TrFinishItem& u = f.item[1];
    const RowView v = row_view(g.n, g.m);
    if ((int)blockIdx.x * v.RB >= v.M) return;
    const RowSlot s = row_slot(v);
    const int o = s.r * v.P + s.c;
    const float gsv = s.valid ? g.sv[o] : 0.0f, usv = s.valid ? u.sv[o] : 0.0f;
    const RowCoeffs gc = stage_row_coeffs(coef[0], g.hm, g.m, v, true);
    const RowCoeffs uc = stage_row_coeffs(coef[1], u.hm, u.m, v, true);
    float* delta = tr_finish_smem;  // [2][TR_ROW_MAX]
    float* scratch = tr_finish_smem + 2 * TR_ROW_MAX;
    const int row0 = (int)blockIdx.x * v.RB * v.P;
    RefinePrefetch pf[2];
    const TrFinishItem* const ahead_items[2] = {&g, &u};
    const bool ahead = REFINE && finish_read_ahead(ahead_items, row0, v.RB * v.P,
                                                   reinterpret_cast<unsigned char*>(scratch), pf);
    SFX_PDL_WAIT();
    if (gc.staged || uc.staged) __syncthreads();
    float val[2] = {0.0f, 0.0f};
    if (s.valid && row_identity(g.hm, g.m)) {
        val[0] = g.rot[(size_t)t * g.n + o];
        val[1] = u.rot[(size_t)t * u.n + o];
    } else if (s.valid) {
        // Both vectors' loads of a batch go out together.
        constexpr int B = TR_MIX_BATCH;
        const float* gr = g.rot + (size_t)t * g.n + s.c;
        const float* ur = u.rot + (size_t)t * u.n + s.c;
        for (int k0 = 0; k0 < v.M; k0 += B) {
            float gs[B], us[B];
#pragma unroll
            for (int j = 0; j < B; ++j) {
                const bool in = k0 + j < v.M;
                gs[j] = in ? gr[(k0 + j) * v.P] : 0.0f;
                us[j] = in ? ur[(k0 + j) * v.P] : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < B; ++j) {
                if (k0 + j >= v.M) continue;
                const int k = k0 + j;
                val[0] = fmaf(staged_coeff(gc, g.hm, g.m, v, true, s.r, k), gs[j], val[0]);
                val[1] = fmaf(staged_coeff(uc, u.hm, u.m, v, true, s.r, k), us[j], val[1]);
            }
        }
    }
    row_fwht<2>(val, v.P, buf);
    bool g_refined = false, u_refined = false;
    if (REFINE && ahead) {
        // Gate and up read one input: its norm's scale once.
        const float inv = finish_norm_inv(g, buf);
        const float u_inv = u.rx == g.rx && u.rnw == g.rnw ? inv : finish_norm_inv(u, buf);
        finish_refinement_ahead(g, pf[0], inv, row0, v.RB * v.P, delta, &u, &pf[1], u_inv,
                                delta + TR_ROW_MAX);
        g_refined = u_refined = true;
    } else if (REFINE) {
        g_refined = finish_refinement(g, row0, v.RB * v.P, delta, buf, scratch);
        u_refined = finish_refinement(u, row0, v.RB * v.P, delta + TR_ROW_MAX, buf, scratch);
    }
    if (!s.valid) return;
    float gv = val[0] * (g.inv_sqrt_n / (g.sigma ? g.sigma[t] : 1.0f)) * gsv;
    float uv = val[1] * (u.inv_sqrt_n / (u.sigma ? u.sigma[t] : 1.0f)) * usv;
    if (g_refined) gv += delta[o - row0];
    if (u_refined) uv += delta[TR_ROW_MAX + o - row0];
    g.y[(size_t)t * g.n + o] = gv / (1.0f + expf(-gv)) * uv;
}

extern "C" __global__ void __launch_bounds__(TR_ROW_MAX) tr_finish_swiglu(const TrFinish f) {
    tr_finish_swiglu_body<false>(f);
}

extern "C" __global__ void __launch_bounds__(TR_ROW_MAX) tr_finish_swiglu_rf(const TrFinish f) {
    tr_finish_swiglu_body<true>(f);
}
// Prefill transforms: one block per (token, item) with the whole vector in shared memory, so
// each value is loaded once. The row blocks above suit decode (a few vectors spread over many
// SMs) but re-read every input row for every output row: at 512 tokens a 14336-wide launch
// took 0.3–0.5 ms. Dynamic shared memory: the vector as [M][P] (the row view), the mixed rows
// [M][P], then the mix's coefficients Cᵀ [M][M4] (M4 = M rounded up to 4, zero columns).

// Where the coefficients start in a prefill transform's shared memory (floats, n values).
__device__ __forceinline__ int token_coeff_offset(int n) { return 2 * n; }

// out = the row mix of buf (C, or Cᵀ with `transpose`), then the Walsh–Hadamard transform of
// each row in place (the order of the row-block kernels). A thread owns four output rows of a
// column: one load of the column's value and one 16-byte coefficient load per four FMAs (per
// FMA the coefficient's index arithmetic and load cost ~8 instructions). Every thread of the
// block calls it.
__device__ void token_mix_fwht(const float* buf, float* out, float* coeff,
                               const float* __restrict__ hm, int m, const RowView& v,
                               bool transpose) {
    if (row_identity(hm, m)) {
        for (int i = threadIdx.x; i < v.M * v.P; i += blockDim.x) out[i] = buf[i];
        __syncthreads();
        block_fwht_rows(out, v.M, v.P);
        return;
    }
    const int M4 = (v.M + 3) & ~3;
    for (int i = threadIdx.x; i < v.M * M4; i += blockDim.x) {
        const int k = i / M4, r = i - k * M4;
        coeff[i] = r < v.M ? row_coeff(hm, m, v.lq, transpose, r, k) : 0.0f;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < (M4 / 4) * v.P; i += blockDim.x) {
        const int q = i / v.P, c = i - q * v.P;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int k = 0; k < v.M; ++k) {
            const float x = buf[k * v.P + c];
            const float4 co = *reinterpret_cast<const float4*>(coeff + k * M4 + 4 * q);
            acc.x = fmaf(co.x, x, acc.x);
            acc.y = fmaf(co.y, x, acc.y);
            acc.z = fmaf(co.z, x, acc.z);
            acc.w = fmaf(co.w, x, acc.w);
        }
        const int r = 4 * q;
        out[r * v.P + c] = acc.x;
        if (r + 1 < v.M) out[(r + 1) * v.P + c] = acc.y;
        if (r + 2 < v.M) out[(r + 2) * v.P + c] = acc.z;
        if (r + 3 < v.M) out[(r + 3) * v.P + c] = acc.w;
    }
    __syncthreads();
    block_fwht_rows(out, v.M, v.P);
}

// grid (tokens, items): tr_prepare's planes and σ (no fused norm: prefill normalises first).
template <bool MMA>
__device__ void tr_prepare_tokens_body(const TrPrep& pr, const float* __restrict__ x, int n,
                                       int pcols, float inv_sqrt_n) {
    __shared__ float red[32];
    float* buf = tr_smem;
    float* out = tr_smem + n;
    const TrPrepItem it = item_at(pr.item, blockIdx.y);
    const int t = blockIdx.x;
    const RowView v = row_view(n, it.m);
    const float* xt = x + (size_t)t * n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float xv = xt[i];
        ss = fmaf(xv, xv, ss);
        buf[i] = xv * it.su[i];
    }
    const float sigma = plane_sigma(sqrtf(block_sum(ss, red)));  // block_sum: a barrier too
    token_mix_fwht(buf, out, tr_smem + token_coeff_offset(n), it.hm, it.m, v, false);
    if (threadIdx.x == 0) it.sigma[t] = sigma;
    __half* hi = it.planes + (size_t)t * 2 * pcols;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        store_plane_value<MMA>(hi, hi + pcols, i, out[i] * (inv_sqrt_n * sigma));
}

extern "C" __global__ void tr_prepare_tokens_rm(const TrPrep p, const float* x, int n, int pcols,
                                                float inv_sqrt_n) {
    tr_prepare_tokens_body<false>(p, x, n, pcols, inv_sqrt_n);
}
extern "C" __global__ void tr_prepare_tokens_mma(const TrPrep p, const float* x, int n,
                                                 int pcols, float inv_sqrt_n) {
    tr_prepare_tokens_body<true>(p, x, n, pcols, inv_sqrt_n);
}

// grid (tokens, items): tr_finish over whole vectors.
extern "C" __global__ void tr_finish_tokens(const TrFinish f, int accumulate) {
    const TrFinishItem it = item_at(f.item, blockIdx.y);
    const int t = blockIdx.x, n = it.n;
    float* buf = tr_smem;
    float* out = tr_smem + n;
    const float* rot = it.rot + (size_t)t * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = rot[i];
    __syncthreads();
    token_mix_fwht(buf, out, tr_smem + token_coeff_offset(n), it.hm, it.m, row_view(n, it.m),
                   true);
    const float scale = it.inv_sqrt_n / (it.sigma ? it.sigma[t] : 1.0f);
    float* y = it.y + (size_t)t * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float o = out[i] * scale * it.sv[i];
        if (it.bias) o += it.bias[i];
        y[i] = accumulate ? y[i] + o : o;
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding (shared by the matvec and the prefill GEMM).

// Word j (compile-time) of a lane's unit string held in K uint4.
template <int K>
__device__ __forceinline__ uint32_t unit_word(const uint4 (&w)[K], int j) {
    const uint4& v = w[j >> 2];
    const int s = j & 3;
    return s == 0 ? v.x : s == 1 ? v.y : s == 2 ? v.z : v.w;
}

// This lane's 8K bits of tile t (compile-time) of the unit, right-aligned.
template <int K>
__device__ __forceinline__ uint32_t own_bits(const uint4 (&w)[K], int t) {
    if (K == 4) return unit_word<K>(w, t);
    if (K == 2) {
        const uint32_t v = unit_word<K>(w, t >> 1);
        return (t & 1) ? (v & 0xffffu) : (v >> 16);
    }
    // K = 3: 24 bits at bit 24t of the big-endian string.
    const int bit = 24 * t, j = bit >> 5, o = bit & 31;
    const uint32_t a = unit_word<K>(w, j);
    const uint32_t b = (o > 8) ? unit_word<K>(w, j + 1) : 0u;
    return __funnelshift_l(b, a, o) >> 8;
}

// The 16-bit state at bit offset `o` of the window own ‖ next16 (8K + 16 bits, MSB first), in
// the low 16 bits (higher bits: garbage unless masked).
template <int K>
__device__ __forceinline__ uint32_t window_state(uint32_t lo, uint32_t hi, int o) {
    const int sh = 8 * K - o;
    return sh >= 32 ? (hi >> (sh - 32)) : __funnelshift_r(lo, hi, sh);
}

__device__ __forceinline__ uint32_t f16x2_sub(uint32_t a, uint32_t b) {
    const __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&a),
                              *reinterpret_cast<const __half2*>(&b));
    return *reinterpret_cast<const uint32_t*>(&r);
}

// A lane's window of one tile, own ‖ next16 (8K + 16 bits): the low 32 bits in `lo`, the rest
// (K > 2) in `hi`, from `own` (this lane's bits) and `next` (lane c + 1's).
template <int K>
__device__ __forceinline__ void tile_window(uint32_t own, uint32_t next, uint32_t& lo,
                                            uint32_t& hi) {
    lo = (own << 16) | (next >> (8 * K - 16));
    hi = own >> 16;
}

// The four f16 pairs (sequence positions 8c + 2j, + 1 of the lane) of one tile from its window
// (tile_window); HYB reads copy `lane` of the replicated table at the start of dynamic shared
// memory (`lane4`: that copy's shared address), and 3INST returns its second halves in `b`.
template <int CODE, int K>
__device__ __forceinline__ void decode_window(uint32_t lo, uint32_t hi, uint32_t lane4,
                                              uint32_t (&a)[4], uint32_t (&b)[4]) {
    if (CODE == TR_HYB) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t s = window_state<K>(lo, hi, 2 * K * i);
            const uint32_t h = s * s + s;
            // Row (h >> 6) mod 2^10 (sign included) of copy `lane`: shared address
            // 2·(h & 0xffc0) + table + 4·lane, as one mask and one multiply-add (the compiler
            // otherwise emits shift, OR and add).
            const uint32_t hm = h & ((uint32_t)(TR_LUT_ROWS - 1) << 6);
            uint32_t addr;
            asm("mad.lo.u32 %0, %1, 2, %2;" : "=r"(addr) : "r"(hm), "r"(lane4));
            asm("ld.shared.u32 %0, [%1];" : "=r"(a[i]) : "r"(addr));
        }
    } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint32_t s0 = window_state<K>(lo, hi, K * 2 * j) & 0xffffu;
            const uint32_t s1 = window_state<K>(lo, hi, K * (2 * j + 1)) & 0xffffu;
            if (CODE == TR_1MAD) {
                const uint32_t y0 = s0 * 34038481u + 76625530u;
                const uint32_t y1 = s1 * 34038481u + 76625530u;
                const uint32_t c0 = __dp4a(y0, 0x01010101u, 0x6400u);
                const uint32_t c1 = __dp4a(y1, 0x01010101u, 0x6400u);
                a[j] = f16x2_sub(__byte_perm(c0, c1, 0x5410), 0x65FE65FEu);  // − 1534
            } else {
                const uint32_t m0 = ((s0 * 89226354u + 64248484u) & 0x8FFF8FFFu) ^ 0x3B603B60u;
                const uint32_t m1 = ((s1 * 89226354u + 64248484u) & 0x8FFF8FFFu) ^ 0x3B603B60u;
                a[j] = __byte_perm(m0, m1, 0x7632);
                b[j] = __byte_perm(m0, m1, 0x5410);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The decode matvec (sm_80+: f16 m16n8k16 MMA).

struct TrItem {
    const uint4* codes;     // unit layout
    const __half* planes;   // [tokens][2][pcols] from tr_prepare (unused with the prologue)
    float* y;               // [tokens][rows] raw sums Ŵ·x'σ
    const float* su;        // [cols] input signs (the prologue's transform)
    float* sigma;           // [tokens] σ, written by the prologue for tr_finish
    int rows;
    int group_end;          // exclusive end of this item's row groups in the launch
};

struct TrGroup {
    TrItem item[TR_MAX_ITEMS];
    int count;
};

// Threads of a matvec block: 32 warps where the registers allow (one block per SM holds the
// 64 KB table once for all of them), 16 for the wider codes and two-row groups.
template <int K, int R>
struct TrMvShape {
    static constexpr int THREADS = (K == 2 && R == 1) ? 1024 : 512;
    static constexpr int WARPS = THREADS / 32;
};

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)

// The launch's item of global row group `grp` (compile-time indices only) and the group's
// index inside it.
__device__ __forceinline__ int item_of(const TrGroup& g, int grp, int& local) {
    int k = 0, start = 0;
#pragma unroll
    for (int i = 1; i < TR_MAX_ITEMS; ++i) {
        if (i < g.count && grp >= g.item[i - 1].group_end) {
            k = i;
            start = g.item[i - 1].group_end;
        }
    }
    local = grp - start;
    return k;
}

// The matvec prologue's input transform where n = THREADS·E (E values a lane): x (RMS-
// normalised with nw) is read once into registers; per item, ⊙ su, then H_n in two passes:
// each warp's 32E contiguous values in registers (shuffles, then register stages), and after
// one barrier the W = THREADS/32 values of each position across the warps, by shuffles
// within W-lane groups. The buffer's row w starts at w·(32E + 1), so neither pass's shared
// accesses conflict (W = 16: two-way in the second); the result goes back in place (each
// value is read by one thread) and out to the planes in column order. The stages run in
// increasing span, as everywhere else. Measured under ncu before this path: the general one
// (8 busy warps, a barrier per cross-chunk stage, x, w and su re-read per item) was half of
// the o projection's 12 µs.
template <int E, bool MMA, int THREADS>
__device__ __forceinline__ void prologue_planes(const TrGroup& g, int k0, int k1, int l0,
                                                const float* __restrict__ x,
                                                const float* __restrict__ nw, float eps, int n,
                                                int pcols, float inv_sqrt_n, uint32_t* planes,
                                                int plane_words, float* buf) {
    constexpr int W = THREADS / 32, ROW = 32 * E + 1, CHUNK = 32 * E;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = blockIdx.y;
    float* sums = buf + W * ROW;  // [2][32] block reductions
    const float* xt = x + (size_t)t * n;
    const int base = warp * CHUNK + lane;  // pass 1: this lane's values base + 32i
    float xv[E];
#pragma unroll
    for (int i = 0; i < E; ++i) xv[i] = xt[base + 32 * i];
    float ss = 0.0f, ss_hat = 0.0f;
    if (nw != nullptr) {
#pragma unroll
        for (int i = 0; i < E; ++i) {
            ss = fmaf(xv[i], xv[i], ss);
            xv[i] *= nw[base + 32 * i];
        }
    }
#pragma unroll
    for (int i = 0; i < E; ++i) ss_hat = fmaf(xv[i], xv[i], ss_hat);
    ss = warp_sum(ss);
    ss_hat = warp_sum(ss_hat);
    if (lane == 0) {
        sums[warp] = ss;
        sums[32 + warp] = ss_hat;
    }
    __syncthreads();
    ss = warp_sum(lane < W ? sums[lane] : 0.0f);
    ss_hat = warp_sum(lane < W ? sums[32 + lane] : 0.0f);
    float inv_rms = 1.0f;
    if (nw != nullptr) inv_rms = 1.0f / sqrtf(ss / (float)n + eps);
    const float sigma = plane_sigma(sqrtf(ss_hat) * inv_rms);
    const float f = inv_sqrt_n * inv_rms * sigma;
    // Pass 2: lanes gi of a W-lane group hold row gi of positions p0 … p0 + E − 1.
    const int gi = lane % W, p0 = (warp * (32 / W) + lane / W) * E;
    for (int k = k0; k <= k1; ++k) {
        const TrItem it = item_at(g.item, k);
        float v[E];
#pragma unroll
        for (int i = 0; i < E; ++i) v[i] = xv[i] * it.su[base + 32 * i];
        warp_fwht_regs<E>(v);
#pragma unroll
        for (int i = 0; i < E; ++i) buf[warp * ROW + lane + 32 * i] = v[i];
        __syncthreads();
        float u[E];
#pragma unroll
        for (int j = 0; j < E; ++j) u[j] = buf[gi * ROW + p0 + j];
#pragma unroll
        for (int mask = 1; mask < W; mask <<= 1) {
            const bool upper = (gi & mask) != 0;
#pragma unroll
            for (int j = 0; j < E; ++j) {
                const float other = __shfl_xor_sync(SFX_FULL_MASK, u[j], mask);
                u[j] = upper ? other - u[j] : u[j] + other;
            }
        }
#pragma unroll
        for (int j = 0; j < E; ++j) buf[gi * ROW + p0 + j] = u[j];
        __syncthreads();
        __half* hi = reinterpret_cast<__half*>(planes + k * 2 * plane_words);
        __half* lo = reinterpret_cast<__half*>(planes + (k * 2 + 1) * plane_words);
        for (int c = threadIdx.x; c < pcols; c += THREADS)
            store_plane_value<MMA>(hi, lo, c,
                                   c < n ? buf[(c / CHUNK) * ROW + c % CHUNK] * f : 0.0f);
        // The block holding the item's first row group publishes σ for tr_finish.
        if (threadIdx.x == 0 && (k > k0 || l0 == 0)) it.sigma[t] = sigma;
        __syncthreads();
    }
}

// The factor a prologue multiplies its transformed values by before the planes, from one pass
// over x: the transform's normalisation × the norm's 1/rms (x RMS-normalised with nw; none
// without) × the planes' σ, which it also returns. Every thread of the block calls it.
__device__ __forceinline__ float prologue_scale(const float* __restrict__ xt,
                                                const float* __restrict__ nw, float eps, int n,
                                                float inv_sqrt, float* sums, float& sigma) {
    float ss = 0.0f, ss_hat = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = xt[i];
        if (nw != nullptr) {
            ss = fmaf(v, v, ss);
            v *= nw[i];
        }
        ss_hat = fmaf(v, v, ss_hat);
    }
    float inv_rms = 1.0f;
    if (nw != nullptr) inv_rms = 1.0f / sqrtf(block_sum(ss, sums) / (float)n + eps);
    sigma = plane_sigma(sqrtf(block_sum(ss_hat, sums)) * inv_rms);
    return inv_sqrt * inv_rms * sigma;
}

// The matvec prologue under a block rotation of 32·E-value blocks: x (RMS-normalised with nw)
// ⊙ su, each block's Walsh–Hadamard transform in one warp's registers (lane c holds values
// c + 32i, the order of warp_fwht_regs), straight to the planes — no shared buffer and no
// pass across blocks, for any n (14336 included, which the full transform sends through
// tr_prepare). The norm and σ need the whole vector first: one pass of sums, then the
// transform pass reads x again (from L1/L2).
template <int E, bool MMA, int THREADS>
__device__ __forceinline__ void prologue_blocks(const TrGroup& g, int k0, int k1, int l0,
                                                const float* __restrict__ x,
                                                const float* __restrict__ nw, float eps, int n,
                                                int pcols, float inv_sqrt_b, uint32_t* planes,
                                                int plane_words, float* sums) {
    constexpr int W = THREADS / 32, B = 32 * E;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = blockIdx.y;
    const float* xt = x + (size_t)t * n;
    float sigma;
    const float f = prologue_scale(xt, nw, eps, n, inv_sqrt_b, sums, sigma);
    const int blocks = n / B;
    for (int k = k0; k <= k1; ++k) {
        const TrItem it = item_at(g.item, k);
        __half* hi = reinterpret_cast<__half*>(planes + k * 2 * plane_words);
        __half* lo = reinterpret_cast<__half*>(planes + (k * 2 + 1) * plane_words);
        for (int b = warp; b < blocks; b += W) {
            const int base = b * B + lane;
            float v[E];
#pragma unroll
            for (int i = 0; i < E; ++i) {
                float xv = xt[base + 32 * i];
                if (nw != nullptr) xv *= nw[base + 32 * i];
                v[i] = xv * it.su[base + 32 * i];
            }
            warp_fwht_regs<E>(v);
#pragma unroll
            for (int i = 0; i < E; ++i) store_plane_value<MMA>(hi, lo, base + 32 * i, v[i] * f);
        }
        for (int c = n + (int)threadIdx.x; c < pcols; c += THREADS)
            store_plane_value<MMA>(hi, lo, c, 0.0f);
        // The block holding the item's first row group publishes σ for tr_finish.
        if (threadIdx.x == 0 && (k > k0 || l0 == 0)) it.sigma[t] = sigma;
    }
    __syncthreads();
}

// A block takes `gpb` consecutive row groups (R tile rows of one item each) and flattens their
// (group, unit) pairs over its warps: warp w takes the w-th contiguous run of them, holding the
// next pair's codes in registers while it decodes the current one (the decode is
// instruction-bound: one pair of prefetch covers the memory latency). A warp's partial sums of
// a group go to shared memory when it moves on (each warp touches a group once, in one run of
// pairs), and the block sums them in warp order at the end: deterministic. (Striding the
// pairs by WARPS instead moved every warp to another group at every pair: ~120 instructions
// of locating and flushing per 16 tiles.) The planes of the items the
// block touches are staged once; HYB's table is copied 32 times over (copy = lane).
//
// With x (power-of-two inputs: no dense factor), the block runs the input transform itself
// instead of reading tr_prepare's planes: x (RMS-normalised with nw), ⊙ su of each item it
// touches, the Walsh–Hadamard transform in the partial sums' region (free until the loop),
// then the planes — the same values tr_prepare writes, one launch fewer per projection set.
// Under a block rotation (blk > 0: blocks of blk values, normalised by inv_sqrt_n = 1/√blk)
// it runs prologue_blocks instead, whatever n.
template <int CODE, int K, bool MMA, int R>
__device__ __forceinline__ void tr_matvec_body(const TrGroup& g, const uint32_t* __restrict__ lut,
                                               int n_units, int gpb, int total_groups,
                                               const float* __restrict__ x,
                                               const float* __restrict__ nw, float eps, int n,
                                               float inv_sqrt_n, int blk) {
    constexpr int THREADS = TrMvShape<K, R>::THREADS, WARPS = TrMvShape<K, R>::WARPS;
    SFX_PDL_TRIGGER();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, tq = lane & 3;
    const int t = blockIdx.y;
    const int pcols = n_units * TR_UNIT_TILES * 16;
    const int plane_words = pcols / 2 + TR_PLANE_PAD_WORDS;
    const int lut_words = CODE == TR_HYB ? TR_LUT_WORDS : 0;
    uint32_t* planes = tr_words + lut_words;
    // Row-major B: the lanes whose x layout holds no values of their tile row read zeros
    // here instead of masking each tile's load (one tile step of 16 tiles).
    uint32_t* zero_words = planes + g.count * 2 * plane_words;
    float* red = reinterpret_cast<float*>(zero_words + TR_ZERO_WORDS);
    const int gb0 = blockIdx.x * gpb;
    const int gb1 = min(gb0 + gpb, total_groups);
    if (gb0 >= gb1) return;
    const int slots = gpb * R * 16;
    const int npairs = (gb1 - gb0) * n_units;

    // Where a group's codes start (its R tile rows at unit 0) and which item it belongs to;
    // recomputed only when a warp moves to another group.
    struct Locus {
        const uint4* codes[R];
        int item;
    };
    auto locate = [&](int gl, Locus& at) {
        int local;
        at.item = item_of(g, gb0 + gl, local);
        const TrItem it = item_at(g.item, at.item);
        const int tiles = it.rows >> 4;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int tr = min(local * R + r, tiles - 1);
            at.codes[r] = it.codes + (size_t)tr * n_units * K * 32 + lane;
        }
    };
    auto load_codes = [&](const Locus& at, int u, uint4 (&w)[R][K]) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int i = 0; i < K; ++i) w[r][i] = load_stream(at.codes[r] + (u * K + i) * 32);
    };
    // A warp takes a contiguous run of pairs (units of one row group after another, in memory
    // order), so it locates a group and flushes its sums once per group rather than per pair.
    const int per_warp = (npairs + WARPS - 1) / WARPS;
    int f = warp * per_warp;
    const int f_end = min(f + per_warp, npairs);
    int gl = f / n_units, u = f - gl * n_units;
    Locus cur{}, pre{};
    locate(gl, cur);
    // Weights are never written: the first pair's codes go out before anything else.
    uint4 wa[R][K], wb[R][K];
    if (f < f_end) load_codes(cur, u, wa);

    if (CODE == TR_HYB) {
        // Row j of the doubled table: pair j mod 2^Q, first value negated from 2^Q on; its 32
        // copies are 8 consecutive 16-byte stores. Every load first, then every store: one
        // memory latency per block (a loop of load-then-store paid it per unrolled step).
        constexpr int PER = TR_LUT_WORDS / 4 / THREADS;
        static_assert(PER * THREADS * 4 == TR_LUT_WORDS, "table stores per thread");
        uint4* rows4 = reinterpret_cast<uint4*>(tr_words);
        uint32_t w[PER];
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            const int j = (k * THREADS + (int)threadIdx.x) / (TR_LUT_COPIES / 4);
            w[k] = __ldg(lut + (j & ((1 << TR_HYB_Q) - 1))) ^ (j >> TR_HYB_Q ? 0x8000u : 0u);
        }
#pragma unroll
        for (int k = 0; k < PER; ++k) rows4[k * THREADS + threadIdx.x] = make_uint4(w[k], w[k], w[k], w[k]);
    }
    for (int i = threadIdx.x; i < TR_ZERO_WORDS; i += THREADS) zero_words[i] = 0u;
    SFX_PDL_WAIT();
    int l0, l1;
    const int k0 = item_of(g, gb0, l0), k1 = item_of(g, gb1 - 1, l1);
    if (x != nullptr && blk > 0) {
        switch (blk) {
            case 32: prologue_blocks<1, MMA, THREADS>(g, k0, k1, l0, x, nw, eps, n, pcols, inv_sqrt_n, planes, plane_words, red); break;
            case 64: prologue_blocks<2, MMA, THREADS>(g, k0, k1, l0, x, nw, eps, n, pcols, inv_sqrt_n, planes, plane_words, red); break;
            case 128: prologue_blocks<4, MMA, THREADS>(g, k0, k1, l0, x, nw, eps, n, pcols, inv_sqrt_n, planes, plane_words, red); break;
            default: prologue_blocks<8, MMA, THREADS>(g, k0, k1, l0, x, nw, eps, n, pcols, inv_sqrt_n, planes, plane_words, red); break;
        }
    } else if (x != nullptr) {
        const int e = n / THREADS;
        bool done = true;
        switch (n >= THREADS ? e : 0) {
            case 1: prologue_planes<1, MMA, THREADS>(g, k0, k1, l0, x, nw, eps, n, pcols, inv_sqrt_n, planes, plane_words, red); break;
            case 2: prologue_planes<2, MMA, THREADS>(g, k0, k1, l0, x, nw, eps, n, pcols, inv_sqrt_n, planes, plane_words, red); break;
            case 4: prologue_planes<4, MMA, THREADS>(g, k0, k1, l0, x, nw, eps, n, pcols, inv_sqrt_n, planes, plane_words, red); break;
            case 8: prologue_planes<8, MMA, THREADS>(g, k0, k1, l0, x, nw, eps, n, pcols, inv_sqrt_n, planes, plane_words, red); break;
            default: done = false;
        }
        if (!done) {
            float* buf = red;         // [n]
            float* sums = red + n;    // [32] block reductions
            const float* xt = x + (size_t)t * n;
            float sigma;
            const float f = prologue_scale(xt, nw, eps, n, inv_sqrt_n, sums, sigma);
            for (int k = k0; k <= k1; ++k) {
                const TrItem it = item_at(g.item, k);
                for (int i = threadIdx.x; i < n; i += THREADS) {
                    const float v = nw != nullptr ? xt[i] * nw[i] : xt[i];
                    buf[i] = v * it.su[i];
                }
                __syncthreads();
                block_fwht_rows(buf, 1, n);
                __half* hi = reinterpret_cast<__half*>(planes + k * 2 * plane_words);
                __half* lo = reinterpret_cast<__half*>(planes + (k * 2 + 1) * plane_words);
                for (int c = threadIdx.x; c < pcols; c += THREADS)
                    store_plane_value<MMA>(hi, lo, c, c < n ? buf[c] * f : 0.0f);
                // The block holding the item's first row group publishes σ for tr_finish.
                if (threadIdx.x == 0 && (k > k0 || l0 == 0)) it.sigma[t] = sigma;
                __syncthreads();
            }
        }
    } else {
        for (int k = k0; k <= k1; ++k) {
            const TrItem it = item_at(g.item, k);
            const uint4* src = reinterpret_cast<const uint4*>(it.planes + (size_t)t * 2 * pcols);
            const int chunks = pcols / 8;  // 16-byte chunks per plane
            for (int i = threadIdx.x; i < 2 * chunks; i += THREADS) {
                const int s = i / chunks, c = i - s * chunks;
                copy16_async(planes + (k * 2 + s) * plane_words + 4 * c, src + i, 16);
            }
        }
        copy_async_commit();
        copy_async_wait<0>();
    }
    for (int i = threadIdx.x; i < WARPS * slots; i += THREADS) red[i] = 0.0f;
    __syncthreads();

    // Shared address of this lane's table copy (the table starts the dynamic allocation).
    const uint32_t lane4 =
        static_cast<uint32_t>(__cvta_generic_to_shared(tr_words)) + 4u * (uint32_t)lane;
    // This lane's B operand: plane, column offset inside a tile, and (row-major layouts)
    // whether its x layout covers its tile row at all.
    int bplane, boff;
    bool bzero;
    if (MMA) {
        bplane = gq & 1;
        boff = 4 * tq;
        bzero = false;
    } else {
        const int L = lane >> 3;
        bplane = (lane >> 2) & 1;
        boff = 8 * (tq & 1) + 4 * (L >> 1);
        bzero = (tq >> 1) != (L & 1);
    }

    float d[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int e = 0; e < 4; ++e) d[r][e] = 0.0f;
    auto flush = [&](int at) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float* dst = red + warp * slots + (at * R + r) * 16;
            if (MMA) {
                if (tq == 0) {
                    dst[gq] = d[r][0] + d[r][1];
                    dst[gq + 8] = d[r][2] + d[r][3];
                }
            } else {
                float v = tq < 2 ? d[r][0] + d[r][1] : d[r][2] + d[r][3];
                v += __shfl_xor_sync(SFX_FULL_MASK, v, 2);
                if (tq < 2) dst[2 * gq + tq] = v;
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) d[r][e] = 0.0f;
        }
    };
    // One pair: decode its 16 tiles (codes `w`) against the planes of its item.
    auto compute = [&](const uint4 (&w)[R][K]) {
        const uint32_t* bsrc =
            bzero ? zero_words
                  : planes + (cur.item * 2 + bplane) * plane_words + u * TR_UNIT_TILES * 8 +
                        boff / 2;
        // K = 2: a word holds this lane's bits of two tiles, so one shuffle of the word serves
        // both and each window is one byte permutation (own ‖ next16 of tile 2j: the high
        // halves; of tile 2j + 1: the low ones) — 1.5 instructions a tile instead of 3.
        uint32_t next_word[R];
#pragma unroll
        for (int tt = 0; tt < TR_UNIT_TILES; ++tt) {
            const uint2 bv = *reinterpret_cast<const uint2*>(bsrc + tt * 8);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                uint32_t lo, hi;
                if (K == 2) {
                    const uint32_t v = unit_word<K>(w[r], tt >> 1);
                    if ((tt & 1) == 0)
                        next_word[r] = __shfl_sync(SFX_FULL_MASK, v, (lane + 1) & 31);
                    lo = __byte_perm(v, next_word[r], (tt & 1) ? 0x1054 : 0x3276);
                    hi = 0;
                } else {
                    const uint32_t own = own_bits<K>(w[r], tt);
                    tile_window<K>(own, __shfl_sync(SFX_FULL_MASK, own, (lane + 1) & 31), lo, hi);
                }
                uint32_t p[4], q[4];
                decode_window<CODE, K>(lo, hi, lane4, p, q);
                uint32_t a[4];
                if (MMA) {
                    a[0] = p[0]; a[1] = p[1]; a[2] = p[2]; a[3] = p[3];
                } else {
                    a[0] = p[0]; a[1] = p[2]; a[2] = p[1]; a[3] = p[3];
                }
                mma_f16(d[r], a, bv.x, bv.y);
                if (CODE == TR_3INST) {
                    if (MMA) {
                        a[0] = q[0]; a[1] = q[1]; a[2] = q[2]; a[3] = q[3];
                    } else {
                        a[0] = q[0]; a[1] = q[2]; a[2] = q[1]; a[3] = q[3];
                    }
                    mma_f16(d[r], a, bv.x, bv.y);
                }
            }
        }
    };
    // One step of the pair loop on codes `w`, prefetching the next pair into `nw`: false at
    // the end of the warp's run.
    auto step = [&](const uint4 (&w)[R][K], uint4 (&nw)[R][K]) -> bool {
        int ng = gl, nu = u + 1;
        if (nu == n_units) {
            nu = 0;
            ++ng;
        }
        const bool more = f + 1 < f_end;
        if (more) {
            if (ng != gl) {
                locate(ng, pre);
                load_codes(pre, nu, nw);
            } else {
                load_codes(cur, nu, nw);
            }
        }
        compute(w);
        if (!more || ng != gl) flush(gl);
        if (ng != gl) cur = pre;
        ++f;
        gl = ng;
        u = nu;
        return more;
    };
    // Two code buffers in turn (no register copies between pairs).
    if (f < f_end) {
        while (step(wa, wb) && step(wb, wa)) {
        }
    }
    __syncthreads();

    for (int s = threadIdx.x; s < (gb1 - gb0) * R * 16; s += THREADS) {
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) total += red[w * slots + s];
        const int sgl = s / (R * 16), r = (s / 16) % R, row = s & 15;
        int local;
        const int k = item_of(g, gb0 + sgl, local);
        const TrItem it = item_at(g.item, k);
        const int tr = local * R + r;
        if (tr < (it.rows >> 4)) it.y[(size_t)t * it.rows + tr * 16 + row] = total;
    }
}

#define SFX_TR_MV_BODY(...) __VA_ARGS__
#else
// Older GPUs have no f16 m16n8k16 MMA: the entry points exist and trap; the backend refuses
// trellis weights below compute capability 8.0.
#define SFX_TR_MV_BODY(...) __trap();
#endif

// Entry points tr_matvec_{hyb,1mad,3inst}_k{K}_{rm,mma}_r{R}.
#define SFX_TR_MATVEC(NAME, CODE, K, ORD, R)                                                  \
    extern "C" __global__ void __launch_bounds__(TrMvShape<K, R>::THREADS, 1)                 \
        tr_matvec_##NAME##_k##K##_##ORD##_r##R(                                                \
            const TrGroup g, const uint32_t* lut, int n_units, int gpb, int total_groups,       \
            const float* x, const float* nw, float eps, int n, float inv_sqrt_n, int blk) {     \
        SFX_TR_MV_BODY(tr_matvec_body<CODE, K, ORD##_ORDER, R>(                                 \
            g, lut, n_units, gpb, total_groups, x, nw, eps, n, inv_sqrt_n, blk);)               \
    }

// Every entry point of a family: both tile orders × two variants (V1, V2) × K × code.
#define SFX_TR_EACH_ORDER(ENTRY, NAME, CODE, K, V1, V2) \
    ENTRY(NAME, CODE, K, rm, V1)                        \
    ENTRY(NAME, CODE, K, rm, V2)                        \
    ENTRY(NAME, CODE, K, mma, V1)                       \
    ENTRY(NAME, CODE, K, mma, V2)
#define SFX_TR_EACH_K(ENTRY, NAME, CODE, V1, V2)        \
    SFX_TR_EACH_ORDER(ENTRY, NAME, CODE, 2, V1, V2)     \
    SFX_TR_EACH_ORDER(ENTRY, NAME, CODE, 3, V1, V2)     \
    SFX_TR_EACH_ORDER(ENTRY, NAME, CODE, 4, V1, V2)
#define SFX_TR_EACH_CODE(ENTRY, V1, V2)                 \
    SFX_TR_EACH_K(ENTRY, hyb, TR_HYB, V1, V2)           \
    SFX_TR_EACH_K(ENTRY, 1mad, TR_1MAD, V1, V2)         \
    SFX_TR_EACH_K(ENTRY, 3inst, TR_3INST, V1, V2)

SFX_TR_EACH_CODE(SFX_TR_MATVEC, 1, 2)

// ---------------------------------------------------------------------------------------------
// The prefill GEMM (sm_80+): Y[t][r] = Σ_c Ŵ[r][c] · x'σ[t][c] for a block of 8 tile rows (one a
// warp) and NT tokens (64 or 128), each tile decoded once into A fragments and multiplied
// against the NT tokens' B fragments (NT/8 MMAs per decode; 3INST: twice) — no dequantized
// copy of the weight. B is the hi plane tr_prepare writes (x'σ rounded to f16: 11 significant
// bits, as TF32 keeps), staged ST tiles (16 at NT = 64, 8 at NT = 128: ~70 KB either way) ×
// NT tokens at a time, double-buffered by cp.async while the warps multiply the previous stage.
//   mma order: the decoded pairs are A's registers as they come (A row = tile row), and the
//     planes hold each tile permuted so lane t's four B values are one 8-byte load at 4t.
//   row-major: lane 4g + t decodes columns 8(t mod 2)..+7 of tile row 2g + t/2; one exchange
//     with lane t ^ 2 (two shuffles) leaves it four columns of each of rows 2g and 2g + 1 —
//     b(t) = 8(t mod 2) + 4(t/2) .. + 3 — so A row g is tile row 2g and A row g + 8 is 2g + 1,
//     and A's k slots 2t, 2t + 1, 2t + 8, 2t + 9 are columns b(t) .. b(t) + 3: B's four values
//     are then the natural-order plane's 8-byte chunk b(t)/4 = 2(t mod 2) + t/2.
#define TR_GEMM_WARPS 8

template <int NT>
struct TrGemmShape {
    static constexpr int ST = NT == 64 ? 16 : 8;  // tiles per stage
    static constexpr int PARTS = TR_UNIT_TILES / ST;
    // Words per staged token row: ST·8 words of f16 pairs + 8, so the eight token rows of a
    // B fragment start 8 banks apart and a half-warp's 8-byte loads cover all 32 banks once.
    static constexpr int STRIDE = ST * 8 + 8;
    static constexpr int STAGE_WORDS = NT * STRIDE;
};

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)

// Copies stage s (unit s / PARTS, part s mod PARTS) of the hi planes of tokens tok0.. (zeros
// past m).
template <int NT>
__device__ __forceinline__ void tr_gemm_stage(uint32_t* dst, const __half* __restrict__ planes,
                                              int s, int tok0, int m, int pcols) {
    using S = TrGemmShape<NT>;
    constexpr int CHUNKS = S::ST * 2;  // 16-byte chunks of a token's stage row
    const int col0 = s * S::ST * 16;   // parts of a unit are contiguous columns
    for (int i = threadIdx.x; i < NT * CHUNKS; i += blockDim.x) {
        const int r = i / CHUNKS, c = i % CHUNKS;
        const int tok = tok0 + r;
        const __half* src = planes + (size_t)min(tok, m - 1) * 2 * pcols + col0 + c * 8;
        copy16_async(dst + r * S::STRIDE + c * 4, src, tok < m ? 16 : 0);
    }
    copy_async_commit();
}

template <int K>
__device__ __forceinline__ void tr_gemm_load_codes(uint4 (&w)[K], const uint4* __restrict__ unit,
                                                   int lane) {
#pragma unroll
    for (int i = 0; i < K; ++i) w[i] = __ldg(unit + i * 32 + lane);
}

// Row-major tiles: the lane's pairs (columns 8(t mod 2) + 2j of row 2g + t/2) exchanged with
// lane t ^ 2 into A registers (rows 2g → A row g, 2g + 1 → A row g + 8; see above).
__device__ __forceinline__ void tr_gemm_exchange(uint32_t (&a)[4], int tq) {
    const bool top = tq < 2;
    const uint32_t r0 = __shfl_xor_sync(SFX_FULL_MASK, top ? a[2] : a[0], 2);
    const uint32_t r1 = __shfl_xor_sync(SFX_FULL_MASK, top ? a[3] : a[1], 2);
    const uint32_t a0 = top ? a[0] : r0, a2 = top ? a[1] : r1;
    const uint32_t a1 = top ? r0 : a[2], a3 = top ? r1 : a[3];
    a[0] = a0;
    a[1] = a1;
    a[2] = a2;
    a[3] = a3;
}

template <int CODE, int K, bool MMA, int NT>
__device__ void tr_gemm_body(const uint4* __restrict__ codes, const uint32_t* __restrict__ lut,
                             const __half* __restrict__ planes, float* __restrict__ y, int rows,
                             int cols, int m, int n_units) {
    using S = TrGemmShape<NT>;
    constexpr int NB = NT / 8;
    uint32_t* table = tr_words;  // the compact HYB table: 2^Q pairs, sign applied per lookup
    uint32_t* stage = tr_words + (1 << TR_HYB_Q);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, tq = lane & 3;
    const int tr = blockIdx.x * TR_GEMM_WARPS + warp;
    const int tok0 = blockIdx.y * NT;
    const bool active = tr < (rows >> 4);
    const int ctiles = cols >> 4, pcols = n_units * 256, stages = n_units * S::PARTS;
    if (CODE == TR_HYB)
        for (int i = threadIdx.x; i < (1 << TR_HYB_Q); i += blockDim.x) table[i] = lut[i];
    const uint4* unit0 = codes + (size_t)min(tr, (rows >> 4) - 1) * n_units * K * 32;
    uint4 w[K], wn[K];
    tr_gemm_load_codes<K>(w, unit0, lane);
    tr_gemm_stage<NT>(stage, planes, 0, tok0, m, pcols);
    // B's 8-byte chunk of a tile for this lane (see above), as a word offset.
    const int chunk = MMA ? tq : 2 * (tq & 1) + (tq >> 1);
    float acc[NB][4];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.0f;
    for (int u = 0; u < n_units; ++u) {
#pragma unroll
        for (int part = 0; part < S::PARTS; ++part) {
            const int s = u * S::PARTS + part;
            if (s + 1 < stages) {
                tr_gemm_stage<NT>(stage + ((s + 1) & 1) * S::STAGE_WORDS, planes, s + 1, tok0,
                                  m, pcols);
                if (part == S::PARTS - 1)
                    tr_gemm_load_codes<K>(wn, unit0 + (size_t)(u + 1) * K * 32, lane);
                copy_async_wait<1>();
            } else {
                copy_async_wait<0>();
            }
            __syncthreads();
            const uint32_t* bs =
                stage + (s & 1) * S::STAGE_WORDS + g * S::STRIDE + 2 * chunk;
            if (active) {
#pragma unroll
                for (int tt = 0; tt < S::ST; ++tt) {
                    const int t = part * S::ST + tt;
                    const uint32_t own = own_bits<K>(w, t);
                    const uint32_t next = __shfl_sync(SFX_FULL_MASK, own, (lane + 1) & 31);
                    if (u * TR_UNIT_TILES + t >= ctiles) break;  // the rest is padding
                    uint32_t a[4], b[4] = {0, 0, 0, 0};
                    uint32_t lo, hi;
                    tile_window<K>(own, next, lo, hi);
                    if (CODE == TR_HYB) {
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const uint32_t st = window_state<K>(lo, hi, 2 * K * i);
                            const uint32_t h = st * st + st;
                            a[i] = table[(h >> 6) & ((1u << TR_HYB_Q) - 1)] ^ (h & 0x8000u);
                        }
                    } else {
                        decode_window<CODE, K>(lo, hi, 0u, a, b);
                    }
                    if (!MMA) {
                        tr_gemm_exchange(a, tq);
                        if (CODE == TR_3INST) tr_gemm_exchange(b, tq);
                    }
#pragma unroll
                    for (int nb = 0; nb < NB; ++nb) {
                        const uint2 bv =
                            *reinterpret_cast<const uint2*>(bs + nb * 8 * S::STRIDE + tt * 8);
                        mma_f16(acc[nb], a, bv.x, bv.y);
                        if (CODE == TR_3INST) mma_f16(acc[nb], b, bv.x, bv.y);
                    }
                }
            }
            // Every warp is done with this buffer before the next stage refills it.
            __syncthreads();
        }
        if (u + 1 < n_units) {
#pragma unroll
            for (int i = 0; i < K; ++i) w[i] = wn[i];
        }
    }
    if (!active) return;
    // C: c0, c1 = (A row g, tokens 2t, 2t + 1 of the n-block), c2, c3 = (A row g + 8, same).
    const int r0 = tr * 16 + (MMA ? g : 2 * g), r1 = r0 + (MMA ? 8 : 1);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
        const int t0 = tok0 + nb * 8 + 2 * tq;
        if (t0 < m) {
            y[(size_t)t0 * rows + r0] = acc[nb][0];
            y[(size_t)t0 * rows + r1] = acc[nb][2];
        }
        if (t0 + 1 < m) {
            y[(size_t)(t0 + 1) * rows + r0] = acc[nb][1];
            y[(size_t)(t0 + 1) * rows + r1] = acc[nb][3];
        }
    }
}
#define SFX_TR_GEMM_BODY(...) __VA_ARGS__
#else
#define SFX_TR_GEMM_BODY(...) __trap();
#endif

// Entry points tr_gemm_{hyb,1mad,3inst}_k{K}_{rm,mma}_t{NT}: grid (tile rows / 8, tokens / NT).
#define SFX_TR_GEMM(NAME, CODE, K, ORD, NT)                                                     \
    extern "C" __global__ void __launch_bounds__(TR_GEMM_WARPS * 32, 2)                         \
        tr_gemm_##NAME##_k##K##_##ORD##_t##NT(const uint4* codes, const uint32_t* lut,           \
                                              const __half* planes, float* y, int rows,         \
                                              int cols, int m, int n_units) {                   \
        SFX_TR_GEMM_BODY(tr_gemm_body<CODE, K, ORD##_ORDER, NT>(codes, lut, planes, y, rows,     \
                                                                cols, m, n_units);)             \
    }

SFX_TR_EACH_CODE(SFX_TR_GEMM, 64, 128)

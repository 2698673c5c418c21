// Selective weight refinement on the device (docs/method.md §2, eq. 2): the channel selection S(x)
// and the gather-accumulate of the selected refinement columns, read where they lie — host
// memory mapped into the device — each warp reading 512 contiguous bytes of a column.
#include "common.cuh"

// Channels per selection chunk (refine::select::CHUNK) and threads of a selection block.
#define RS_CHUNK 1024
// A gather block: 8 warps over 1024 output rows (512 bytes of a column: 16 per lane, 32
// rows), each warp one column at a time with RC_IN_FLIGHT columns' reads outstanding.
#define RC_THREADS 256
#define RC_WARPS (RC_THREADS / 32)
#define RC_SLAB 1024
#define RC_LANE_ROWS 32
#define RC_IN_FLIGHT 4
#define RC_MAX_TARGETS 3
// Shared-memory index of slab row e: one pad word every 32 rows, so a warp's lanes (32 rows
// apart) store to different banks.
#define RC_PAD(e) ((e) + ((e) >> 5))

// Exclusive count of `flag` over the block's lower threads. All threads call it; `warps` is
// 32 ints of shared memory.
__device__ __forceinline__ int block_exclusive_count(bool flag, int* warps) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const unsigned b = __ballot_sync(SFX_FULL_MASK, flag);
    if (lane == 0) warps[w] = __popc(b);
    __syncthreads();
    int before = 0;
    for (int i = 0; i < w; ++i) before += warps[i];
    __syncthreads();
    return before + __popc(b & ((1u << lane) - 1u));
}

// S(x) of one 1024-channel chunk of one row (grid: chunks × rows, 1024 threads): the budget
// round(k·len/1024) (half up, at least 1) of largest |x_i|, ties to the lower index, written in
// ascending index order at the chunk's place in the row's list, each index with its value.
// With `norm_w` the row is first normalised as the rms_norm kernel does it (every block sums
// the whole row's squares), so the projection's fused-norm matvec need not write its input.
// The k-th largest key is found by a radix select over the bits of |x| (sign cleared, so
// unsigned order is the order of the magnitudes and a NaN sorts above every number, as the
// host's total order does), stopping early once a digit's bin holds exactly what is needed.
extern "C" __global__ void __launch_bounds__(RS_CHUNK)
    refine_select(const float* __restrict__ x, const float* __restrict__ norm_w, float eps,
                  int row_len, int k_per_1024, uint32_t* __restrict__ sel,
                  float* __restrict__ vals, int selected) {
    __shared__ unsigned hist[256];
    __shared__ unsigned s_prefix, s_mask;
    __shared__ int s_need, s_done;
    __shared__ int warps[32];
    __shared__ float red[32];
    const int t = threadIdx.x, lane = t & 31;
    const float* row = x + (size_t)blockIdx.y * row_len;
    const int start = blockIdx.x * RS_CHUNK;
    const int len = min(RS_CHUNK, row_len - start);
    int k = (k_per_1024 * len + RS_CHUNK / 2) / RS_CHUNK;
    k = max(1, min(k, len));
    const bool valid = t < len;
    float value = valid ? row[start + t] : 0.0f;
    if (norm_w != nullptr) {
        float ss = 0.0f;
        for (int c = t; c < row_len; c += RS_CHUNK) {
            const float v = row[c];
            ss = fmaf(v, v, ss);
        }
        ss = block_sum(ss, red);
        const float inv = 1.0f / sqrtf(ss / (float)row_len + eps);
        if (valid) value = (value * inv) * norm_w[start + t];
    }
    const unsigned key = valid ? (__float_as_uint(value) & 0x7fffffffu) : 0u;

    unsigned prefix = 0, mask = 0;
    int need = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        if (t < 256) hist[t] = 0;
        __syncthreads();
        // One atomic per distinct digit of a warp, not one per key (magnitudes share few
        // exponents, so the first digit would otherwise serialise on a handful of bins).
        const bool part = valid && (key & mask) == prefix;
        const unsigned digit = part ? (key >> shift) & 255u : 0xffffffffu;
        const unsigned peers = __match_any_sync(SFX_FULL_MASK, digit);
        if (part && lane == __ffs(peers) - 1) atomicAdd(&hist[digit], (unsigned)__popc(peers));
        __syncthreads();
        if (t < 32) {
            // Lane L holds bins 255 − 8L down to 248 − 8L; a scan from the top finds the bin
            // the k-th largest key falls in.
            unsigned c = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) c += hist[255 - 8 * t - i];
            unsigned incl = c;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned v = __shfl_up_sync(SFX_FULL_MASK, incl, o);
                if (t >= o) incl += v;
            }
            const unsigned found = __ballot_sync(SFX_FULL_MASK, incl >= (unsigned)need);
            if (t == __ffs(found) - 1) {
                unsigned before = incl - c;
                for (int i = 0; i < 8; ++i) {
                    const int bin = 255 - 8 * t - i;
                    if (before + hist[bin] >= (unsigned)need) {
                        s_prefix = prefix | ((unsigned)bin << shift);
                        s_mask = mask | (255u << shift);
                        s_need = need - (int)before;
                        // Every key of the bin is taken: no lower digit can change the set.
                        s_done = before + hist[bin] == (unsigned)need;
                        break;
                    }
                    before += hist[bin];
                }
            }
        }
        __syncthreads();
        prefix = s_prefix;
        mask = s_mask;
        need = s_need;
        if (s_done) break;
    }
    // Keys whose determined digits exceed `prefix` are taken, and `need` of those equal to it,
    // lowest indices first.
    const unsigned top = key & mask;
    const bool equal = valid && top == prefix;
    const int rank = block_exclusive_count(equal, warps);
    const bool take = valid && (top > prefix || (equal && rank < need));
    const int pos = block_exclusive_count(take, warps);
    // Every chunk before the last is whole, with a budget of k_per_1024.
    const int first = blockIdx.x * max(1, min(k_per_1024, RS_CHUNK));
    if (take) {
        const size_t at = (size_t)blockIdx.y * selected + first + pos;
        sel[at] = (uint32_t)(start + t);
        vals[at] = value;
    }
}

struct ColumnTarget {
    const uint8_t* cols;  // column 0 of the projection's refinement
    float* out;           // [rows, out_dim]
    const float* scales;  // [out_dim]
    int unit_bytes;
    int out_dim;
    int first_block;  // the target's first slab in the launch's flattened grid
    int aligned;      // columns 16-byte aligned and sized: one load per lane and column
    int accumulate;   // add to `out`, or overwrite it (a branch's delta)
};

struct ColumnParams {
    const uint32_t* sel;  // [rows, selected] channel indices
    const float* vals;    // [rows, selected] their values
    int row_len;
    int selected;
    int cols_per_split;   // columns a block takes; gridDim.y blocks share a slab's columns
    int n_blocks;         // slabs of all targets (gridDim.x)
    float* partial;       // [rows, n_blocks, splits, RC_SLAB] split partial sums
    unsigned* tickets;    // [n_blocks] (splits > 1: one row), zero between launches
    int n_targets;
    ColumnTarget t[RC_MAX_TARGETS];
};

// The 16 bytes (32 rows) of column `col` a lane reads: one load where the piece lies whole in
// an aligned column, bytes otherwise (levels past the column read as 0).
__device__ __forceinline__ uint4 column_piece(const ColumnTarget& tg, uint32_t col, int byte0) {
    const uint8_t* p = tg.cols + (size_t)col * tg.unit_bytes + byte0;
    if (tg.aligned && byte0 + 16 <= tg.unit_bytes) return *reinterpret_cast<const uint4*>(p);
    uint32_t w[4] = {0x88888888u, 0x88888888u, 0x88888888u, 0x88888888u};
    for (int i = 0; i < 16 && byte0 + i < tg.unit_bytes; ++i) {
        const int s = 8 * (i & 3);
        w[i >> 2] = (w[i >> 2] & ~(0xffu << s)) | ((uint32_t)p[i] << s);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// Adds x_i · level for the 8 nibbles of `w` to `acc` (a nibble n is the level n − 8; 2^23 + n
// read as a float is exact, so one subtraction gives the level).
__device__ __forceinline__ void accumulate_nibbles(uint32_t w, float xi, float* acc) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float level = __uint_as_float(0x4b000000u | ((w >> (4 * i)) & 15u)) - 8388616.0f;
        acc[i] = fmaf(xi, level, acc[i]);
    }
}

// eq. 2 for up to three projections of one input. Block (b, split, row) takes a slab of 1024
// output rows of one target and the split's share of the selected columns; its warps' partial
// sums are added in a fixed order. With several splits each block leaves its partial in
// `partial`, and the last of a slab's blocks (ticket) adds them in split order, so the result
// does not depend on timing.
extern "C" __global__ void __launch_bounds__(RC_THREADS) refine_columns(const ColumnParams p) {
    __shared__ float red[RC_WARPS][RC_PAD(RC_SLAB)];
    __shared__ int s_last;
    int ti = 0;
#pragma unroll
    for (int i = 1; i < RC_MAX_TARGETS; ++i)
        if (i < p.n_targets && (int)blockIdx.x >= p.t[i].first_block) ti = i;
    const ColumnTarget& tg = p.t[ti];
    const int slab = (int)blockIdx.x - tg.first_block;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int byte0 = slab * (RC_SLAB / 2) + lane * (RC_LANE_ROWS / 2);
    const size_t r = blockIdx.z;
    const uint32_t* sel = p.sel + r * p.selected;
    const float* vals = p.vals + r * p.selected;
    const int c0 = blockIdx.y * p.cols_per_split;
    const int c1 = min(p.selected, c0 + p.cols_per_split);

    float acc[RC_LANE_ROWS];
#pragma unroll
    for (int i = 0; i < RC_LANE_ROWS; ++i) acc[i] = 0.0f;
    if (byte0 < tg.unit_bytes) {
        for (int j0 = c0 + warp; j0 < c1; j0 += RC_IN_FLIGHT * RC_WARPS) {
            uint4 piece[RC_IN_FLIGHT];
            float xi[RC_IN_FLIGHT];
#pragma unroll
            for (int u = 0; u < RC_IN_FLIGHT; ++u) {
                const int j = j0 + u * RC_WARPS;
                const uint32_t col = j < c1 ? sel[j] : 0xffffffffu;
                const bool ok = col < (uint32_t)p.row_len;
                xi[u] = ok ? vals[j] : 0.0f;
                piece[u] = ok ? column_piece(tg, col, byte0)
                              : make_uint4(0x88888888u, 0x88888888u, 0x88888888u, 0x88888888u);
            }
#pragma unroll
            for (int u = 0; u < RC_IN_FLIGHT; ++u) {
                accumulate_nibbles(piece[u].x, xi[u], acc);
                accumulate_nibbles(piece[u].y, xi[u], acc + 8);
                accumulate_nibbles(piece[u].z, xi[u], acc + 16);
                accumulate_nibbles(piece[u].w, xi[u], acc + 24);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < RC_LANE_ROWS; ++i) red[warp][RC_PAD(lane * RC_LANE_ROWS + i)] = acc[i];
    __syncthreads();
    float sum[RC_SLAB / RC_THREADS];
#pragma unroll
    for (int q = 0; q < RC_SLAB / RC_THREADS; ++q) {
        const int e = q * RC_THREADS + threadIdx.x;
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < RC_WARPS; ++w) s += red[w][RC_PAD(e)];
        sum[q] = s;
    }
    const int splits = gridDim.y;
    if (splits > 1) {
        const size_t slot = (r * p.n_blocks + blockIdx.x);
        float* part = p.partial + (slot * splits + blockIdx.y) * RC_SLAB;
#pragma unroll
        for (int q = 0; q < RC_SLAB / RC_THREADS; ++q) part[q * RC_THREADS + threadIdx.x] = sum[q];
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            const unsigned ticket = atomicAdd(&p.tickets[slot], 1u);
            s_last = ticket == (unsigned)splits - 1;
            if (s_last) p.tickets[slot] = 0;  // ready for the next launch
        }
        __syncthreads();
        if (!s_last) return;
        __threadfence();
        const float* parts = p.partial + slot * splits * RC_SLAB;
#pragma unroll
        for (int q = 0; q < RC_SLAB / RC_THREADS; ++q) {
            const int e = q * RC_THREADS + threadIdx.x;
            float s = 0.0f;
            for (int sp = 0; sp < splits; ++sp) s += __ldcg(parts + sp * RC_SLAB + e);
            sum[q] = s;
        }
    }
#pragma unroll
    for (int q = 0; q < RC_SLAB / RC_THREADS; ++q) {
        const int e = slab * RC_SLAB + q * RC_THREADS + threadIdx.x;
        if (e < tg.out_dim) {
            float* y = tg.out + r * tg.out_dim + e;
            *y = (tg.accumulate ? *y : 0.0f) + sum[q] * tg.scales[e];
        }
    }
}

// Fetch lead's staging (docs/method.md §3) for up to three projections of one input.
struct StageTarget {
    const unsigned char* store;  // column 0 (page-locked host memory mapped into the device)
    unsigned char* dst;          // unit 0 of the staged columns (device memory)
    int unit_bytes;
    int pad;
};

struct StageParams {
    const uint32_t* sel;  // [rows, selected]
    int row_len;
    int selected;
    int n_targets;
    int pad;
    StageTarget t[RC_MAX_TARGETS];
};

// Pieces a staging thread has in flight: a host read is a bus round trip, so each thread issues
// several before it stores any.
#define ST_IN_FLIGHT 4

// Block (j, r, t) copies the `unit_bytes` bytes of column sel[r·selected + j] of target t's
// store to unit r·selected + j of its `dst`, where the real input's gather reads them later;
// an index of `row_len` or more stages zeros. 16-byte pieces where source, destination and
// unit size allow, 4-byte words or bytes otherwise.
extern "C" __global__ void refine_stage_units(const StageParams p) {
    const StageTarget& tg = p.t[blockIdx.z];
    const int unit_bytes = tg.unit_bytes;
    const size_t u = (size_t)blockIdx.y * p.selected + blockIdx.x;
    const uint32_t i = p.sel[u];
    unsigned char* out = tg.dst + u * unit_bytes;
    const unsigned char* src = tg.store + (size_t)i * unit_bytes;
    const bool take = i < (uint32_t)p.row_len;
    const uintptr_t align = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(out) |
                            (uintptr_t)unit_bytes;
    if ((align & 15) == 0) {
        const int n = unit_bytes / 16;
        const uint4* s16 = reinterpret_cast<const uint4*>(src);
        uint4* d16 = reinterpret_cast<uint4*>(out);
        for (int c0 = threadIdx.x; c0 < n; c0 += ST_IN_FLIGHT * blockDim.x) {
            uint4 piece[ST_IN_FLIGHT];
#pragma unroll
            for (int q = 0; q < ST_IN_FLIGHT; ++q) {
                const int c = c0 + q * blockDim.x;
                piece[q] = take && c < n ? s16[c] : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int q = 0; q < ST_IN_FLIGHT; ++q) {
                const int c = c0 + q * blockDim.x;
                if (c < n) d16[c] = piece[q];
            }
        }
    } else if ((align & 3) == 0) {
        for (int c = threadIdx.x; c < unit_bytes / 4; c += blockDim.x)
            reinterpret_cast<uint32_t*>(out)[c] = take ? reinterpret_cast<const uint32_t*>(src)[c] : 0u;
    } else {
        for (int c = threadIdx.x; c < unit_bytes; c += blockDim.x) out[c] = take ? src[c] : 0;
    }
}

// Fetch lead's values: values[r·selected + j] = x̂[r][sel[r·selected + j]], x̂ the row of x, or
// with `norm_w` its RMSNorm as the rms_norm kernel computes it. Block r takes row r; an index
// of `row_len` or more gives 0.
extern "C" __global__ void refine_gather_values(const float* __restrict__ x,
                                                const float* __restrict__ norm_w, float eps,
                                                int row_len, const uint32_t* __restrict__ sel,
                                                int selected, float* __restrict__ values) {
    __shared__ float red[32];
    const float* row = x + (size_t)blockIdx.x * row_len;
    float inv = 1.0f;
    if (norm_w != nullptr) {
        float ss = 0.0f;
        for (int c = threadIdx.x; c < row_len; c += blockDim.x) {
            const float v = row[c];
            ss = fmaf(v, v, ss);
        }
        ss = block_sum(ss, red);
        inv = 1.0f / sqrtf(ss / (float)row_len + eps);
    }
    const size_t base = (size_t)blockIdx.x * selected;
    for (int j = threadIdx.x; j < selected; j += blockDim.x) {
        const uint32_t i = sel[base + j];
        float v = 0.0f;
        if (i < (uint32_t)row_len) {
            v = row[i];
            if (norm_w != nullptr) v = (v * inv) * norm_w[i];
        }
        values[base + j] = v;
    }
}

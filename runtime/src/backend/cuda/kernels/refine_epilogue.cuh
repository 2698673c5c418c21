// A decode row's weight refinement applied by the projection's own launch (docs/method.md §2,
// eq. 2): y[r] += s[r] · Σ_j x̂[c_j] · C_j[r], the selected channels c_j of the projection's
// input x̂ (normalised as the launch normalises it) weighting their 4-bit refinement columns.
// Folding it into the projection leaves a refined decode step with no launch of its own on
// the main stream: each launch in a step graph costs a few µs, and a set's branch (gather,
// add, join) was longer than the 2-bit projection beside it.
#pragma once
#include "common.cuh"

// One projection's refinement operand (mirrored by the host's `RefineOperand`).
struct RefineOp {
    const uint32_t* sel;   // [selected] channels of x; an index ≥ the row length adds nothing
    const uint8_t* cols;   // column of entry j at cols + (staged ? j : sel[j]) · unit_bytes
    const float* scales;   // [rows] the refinement's per-row scales
    int selected;
    int unit_bytes;        // ceil(rows / 2): row r is nibble r & 1 of byte r / 2, level n − 8
    int staged;            // fetch lead staged the columns in selection order
    // Fetch lag's contributions of earlier sets due at this residual add ([rows] each, or
    // null), added with the projection's own output.
    const float* lagged[2];
};

// The lagged contributions to output row `row`.
__device__ __forceinline__ float lagged_at(const RefineOp& op, int row) {
    float v = 0.0f;
    if (op.lagged[0] != nullptr) v += op.lagged[0][row];
    if (op.lagged[1] != nullptr) v += op.lagged[1][row];
    return v;
}

// Selected entries staged in shared memory at a time.
#define RE_TILE 128

// Bytes of shared-memory scratch refine_rows needs for a block of `threads` threads (the
// launch adds it to its dynamic shared memory only when it refines, so an unrefined launch
// keeps the occupancy it was planned for). Mirrored by the host's `refine_scratch_bytes`.
#define RE_SCRATCH_BYTES(threads) (RE_TILE * 8 + (threads) * 8)

// delta[i] = s[row0 + i] · Σ_j x̂[c_j] · C_j[row0 + i] for i < n (0 for rows past `rows`),
// x̂ = x · inv · nw (x where nw is null). Every thread of the block calls it (it
// synchronises); `scratch` is RE_SCRATCH_BYTES(blockDim.x) of shared memory. Threads split
// into byte lanes (consecutive bytes of a column, so a warp's loads are one segment) × entry
// lanes, whose partial sums are added in a fixed order: the result does not depend on timing.
__device__ void refine_rows(const RefineOp& op, const float* __restrict__ x,
                            const float* __restrict__ nw, float inv, int row_len, int row0,
                            int n, int rows, float* __restrict__ delta, float* scratch) {
    float* xv = scratch;                                            // [RE_TILE]
    uint32_t* cj = reinterpret_cast<uint32_t*>(scratch + RE_TILE);  // [RE_TILE]
    float* part = scratch + 2 * RE_TILE;                            // [2 · threads]
    const int tid = threadIdx.x, threads = blockDim.x;
    const int b0 = row0 >> 1;
    const int nb = ((row0 + n - 1) >> 1) - b0 + 1;
    int bw = threads;
    while (bw > 32 && bw / 2 >= nb && bw % 2 == 0) bw >>= 1;
    const int lanes = threads / bw, bi = tid % bw, jl = tid / bw;
    for (int pass = 0; pass < nb; pass += bw) {
        const int byte = b0 + pass + bi;
        const bool live = pass + bi < nb && byte < op.unit_bytes;
        float lo = 0.0f, hi = 0.0f;
        for (int t0 = 0; t0 < op.selected; t0 += RE_TILE) {
            __syncthreads();  // the previous tile is consumed
            for (int e = tid; e < RE_TILE; e += threads) {
                const int j = t0 + e;
                float v = 0.0f;
                uint32_t c = 0xffffffffu;
                if (j < op.selected) {
                    const uint32_t ch = op.sel[j];
                    if (ch < (uint32_t)row_len) {
                        v = x[ch];
                        if (nw != nullptr) v = (v * inv) * nw[ch];
                        c = op.staged ? (uint32_t)j : ch;
                    }
                }
                xv[e] = v;
                cj[e] = c;
            }
            __syncthreads();
            const int tn = min(RE_TILE, op.selected - t0);
            if (live) {
#pragma unroll 4
                for (int e = jl; e < tn; e += lanes) {
                    const uint32_t c = cj[e];
                    if (c == 0xffffffffu) continue;
                    const uint32_t q = op.cols[(size_t)c * op.unit_bytes + byte];
                    lo = fmaf(xv[e], (float)(int)(q & 15u) - 8.0f, lo);
                    hi = fmaf(xv[e], (float)(int)(q >> 4) - 8.0f, hi);
                }
            }
        }
        part[2 * tid] = lo;
        part[2 * tid + 1] = hi;
        __syncthreads();
        if (tid < bw && pass + tid < nb) {
            float s_lo = 0.0f, s_hi = 0.0f;
            for (int k = 0; k < lanes; ++k) {
                s_lo += part[2 * (k * bw + tid)];
                s_hi += part[2 * (k * bw + tid) + 1];
            }
            const int r_lo = 2 * (b0 + pass + tid), r_hi = r_lo + 1;
            if (r_lo >= row0 && r_lo < row0 + n)
                delta[r_lo - row0] = r_lo < rows ? op.scales[r_lo] * s_lo : 0.0f;
            if (r_hi >= row0 && r_hi < row0 + n)
                delta[r_hi - row0] = r_hi < rows ? op.scales[r_hi] * s_hi : 0.0f;
        }
        __syncthreads();
    }
}

// Fetch lead's staged operand read ahead: the block's bytes of each staged column (staged in
// selection order, so their addresses do not depend on the selection), the selection and the
// rows' scales, copied into shared memory by cp.async before the projection issues its own
// loads. refine_rows reads the same data in a chain of dependent loads between the staging of
// x and the projection's loop, a few µs in every wave of blocks; read ahead, it lands while the
// weights do.
struct RefinePrefetch {
    float* scales;   // [n] the block's rows' scales (zeros past the projection's rows)
    uint32_t* sel;   // [selected]
    float* vals;     // [selected] room for the entries' input values, where the caller needs it
    uint8_t* cols;   // [selected][nb] bytes row0 / 2 .. of each staged column
    int nb;
};

// Shared-memory bytes refine_prefetch lays out for `selected` entries and `n` rows.
__device__ __forceinline__ int refine_prefetch_bytes(int selected, int n) {
    return 4 * n + 16 * ((selected + 1) / 2) + selected * (n / 2);
}

// Whether a decode row's operand can be read ahead into `bytes` of shared memory: staged
// columns, whole 16-row tiles and 8-byte pieces.
__device__ __forceinline__ bool refine_prefetchable(const RefineOp& op, int row0, int n,
                                                    int bytes) {
    return op.sel != nullptr && op.staged && op.selected > 0 && (op.unit_bytes & 7) == 0 &&
           (row0 & 15) == 0 && (n & 15) == 0 && (reinterpret_cast<uintptr_t>(op.scales) & 15) == 0 &&
           (reinterpret_cast<uintptr_t>(op.cols) & 7) == 0 &&
           refine_prefetch_bytes(op.selected, n) <= bytes;
}

// Issues the read-ahead copies into `region` (16-byte aligned); every thread calls it and the
// caller commits them as one group, waits for it and synchronises before
// refine_rows_prefetched.
__device__ __forceinline__ void refine_prefetch(const RefineOp& op, int row0, int n, int rows,
                                                unsigned char* region, RefinePrefetch& pf) {
    pf.nb = n / 2;
    pf.scales = reinterpret_cast<float*>(region);
    const int words = 2 * ((op.selected + 1) / 2);  // 8-byte multiples
    pf.sel = reinterpret_cast<uint32_t*>(region + 4 * n);
    pf.vals = reinterpret_cast<float*>(region + 4 * n + 4 * words);
    pf.cols = region + 4 * n + 8 * words;
    for (int q = threadIdx.x; q < n / 4; q += blockDim.x) {
        const int r = row0 + 4 * q;
        const int valid = max(0, min(4, rows - r));
        copy16_async(pf.scales + 4 * q, op.scales + (valid > 0 ? r : 0), 4 * valid);
    }
    for (int j = threadIdx.x; j < op.selected; j += blockDim.x) copy4_async(pf.sel + j, op.sel + j);
    const int pieces = pf.nb / 8;
    for (int e = threadIdx.x; e < op.selected * pieces; e += blockDim.x) {
        const int j = e / pieces, q = e % pieces;
        const int byte = row0 / 2 + 8 * q;
        // Pieces past the column hold rows past the projection's: never emitted.
        if (byte < op.unit_bytes)
            copy8_async(pf.cols + j * pf.nb + 8 * q, op.cols + (size_t)j * op.unit_bytes + byte);
    }
}

// refine_rows from a read-ahead operand: delta[i] for i < n, entry j's x̂[c] = xhat(j, c) (the
// projection's normalised input as it holds it). Few bytes (a tile block's 8): each warp takes
// a byte (two rows) at a time, its lanes the entries, summed by shuffles. Many (a transform
// block's 256): a thread takes a byte and every entry in order. Either way the sums' order is
// fixed; the caller synchronises before reading delta.
template <typename XHat>
__device__ __forceinline__ void refine_rows_prefetched(const RefineOp& op, const RefinePrefetch& pf,
                                                       XHat xhat, int row_len, int row0, int n,
                                                       int rows, float* __restrict__ delta) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    auto store = [&](int b, float lo, float hi) {
        const int i = 2 * b;
        if (i < n) delta[i] = row0 + i < rows ? pf.scales[i] * lo : 0.0f;
        if (i + 1 < n) delta[i + 1] = row0 + i + 1 < rows ? pf.scales[i + 1] * hi : 0.0f;
    };
    // Entry j's two nibbles of byte b (rows 2b and 2b + 1) added to lo and hi.
    auto add_entry = [&](int j, int b, float& lo, float& hi) {
        const uint32_t ch = pf.sel[j];
        if (ch >= (uint32_t)row_len) return;
        const float v = xhat(j, ch);
        const uint32_t q = pf.cols[j * pf.nb + b];
        lo = fmaf(v, (float)(int)(q & 15u) - 8.0f, lo);
        hi = fmaf(v, (float)(int)(q >> 4) - 8.0f, hi);
    };
    if (4 * pf.nb >= (int)blockDim.x) {
        for (int b = threadIdx.x; b < pf.nb; b += blockDim.x) {
            float lo = 0.0f, hi = 0.0f;
            for (int j = 0; j < op.selected; ++j) add_entry(j, b, lo, hi);
            store(b, lo, hi);
        }
        return;
    }
    for (int b = warp; b < pf.nb; b += warps) {
        float lo = 0.0f, hi = 0.0f;
        for (int j = lane; j < op.selected; j += 32) add_entry(j, b, lo, hi);
        lo = warp_sum(lo);
        hi = warp_sum(hi);
        if (lane == 0) store(b, lo, hi);
    }
}

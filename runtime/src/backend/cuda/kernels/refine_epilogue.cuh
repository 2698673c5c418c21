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

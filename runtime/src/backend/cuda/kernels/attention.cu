// Causal grouped-query attention over a float KV cache ([kv_heads, capacity, d] per layer,
// f32 or f16 elements), exact softmax (max-subtracted, f32), scale 1/sqrt(d).
//
// Decode (≤ 4 queries): split-K "flash-decoding". The keys 0..L (L = position + 1, read from
// the device) are cut into at most `max_splits` chunks per KV head; each block scores one
// chunk for all query heads of its KV head (GQA: the keys are read once per group) and writes
// (max, sum, unnormalised output); a second kernel merges the chunks exactly. The grid is
// sized from the cache capacity and blocks past L exit at once, so a captured step replays at
// any length. Each warp copies a 32-key tile of K and V into shared memory with all its
// 16-byte copies in flight at once (a tile costs one memory latency: per-row loads in a
// dependent loop held a 32K-token decode at ~1 TB/s); each lane then scores one key against
// every query head of the block, and P·V reads V from the staged tile.
//
// Prefill (more queries), the exact CUDA-core path (f32 caches, head sizes without a
// tensor-core kernel, GPUs before sm_80; attention_mma.cu has the f16 tensor-core one):
// FlashAttention-2-style online softmax: a block holds 16 queries of
// one head, walks 32-key tiles staged in shared memory, a warp owns 4 queries and a lane one
// key of the tile (scores) or DPL output dimensions (P·V).
#include "common.cuh"

#define ATT_GROUP 8        // query heads per decode block (larger GQA groups use more blocks)
#define ATT_TILE 32        // keys per warp step
#define PF_QUERIES 16      // queries per prefill block
#define PF_WARPS 4

// Elements of T per 16-byte chunk.
template <typename T>
struct Elems {
    static constexpr int N = 16 / sizeof(T);
};

__device__ __forceinline__ void widen16(const uint4 c, float* out, const float*) {
    out[0] = __uint_as_float(c.x);
    out[1] = __uint_as_float(c.y);
    out[2] = __uint_as_float(c.z);
    out[3] = __uint_as_float(c.w);
}

__device__ __forceinline__ void widen16(const uint4 c, float* out, const __half*) {
    const __half2* h = reinterpret_cast<const __half2*>(&c);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __half22float2(h[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

// Lane `lane`'s DPL output dimensions of one V row staged in shared memory (dims lane·DPL..
// within d): one vector load when the lanes cover d exactly (the common head sizes), element loads otherwise.
template <typename T, int DPL>
__device__ __forceinline__ void load_v(const T* row, int lane, int d, float (&v)[DPL]) {
    const int d0 = lane * DPL;
    constexpr int BYTES = DPL * (int)sizeof(T);
    if (d == 32 * DPL && (BYTES == 4 || BYTES == 8 || BYTES == 16)) {
        if constexpr (sizeof(T) == 2) {
            const __half2* h = nullptr;
            uint4 raw = make_uint4(0, 0, 0, 0);
            if constexpr (BYTES == 16) raw = *reinterpret_cast<const uint4*>(row + d0);
            if constexpr (BYTES == 8) {
                const uint2 r2 = *reinterpret_cast<const uint2*>(row + d0);
                raw.x = r2.x;
                raw.y = r2.y;
            }
            if constexpr (BYTES == 4) raw.x = *reinterpret_cast<const unsigned int*>(row + d0);
            h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
            for (int e = 0; e < DPL / 2; ++e) {
                const float2 f = __half22float2(h[e]);
                v[2 * e] = f.x;
                v[2 * e + 1] = f.y;
            }
        } else {
            if constexpr (BYTES == 16) {
                const float4 f = *reinterpret_cast<const float4*>(row + d0);
                const float fv[4] = {f.x, f.y, f.z, f.w};
#pragma unroll
                for (int e = 0; e < DPL; ++e) v[e] = fv[e];
            } else {
#pragma unroll
                for (int e = 0; e < DPL; ++e) v[e] = kv_load(row + d0 + e);
            }
        }
        return;
    }
#pragma unroll
    for (int e = 0; e < DPL; ++e) v[e] = (d0 + e < d) ? kv_load(row + d0 + e) : 0.0f;
}

// Chunk length for L keys over at most max_splits chunks: a multiple of the block's keys per
// step, at least `min_chunk`.
__device__ __forceinline__ int split_chunk(int L, int max_splits, int min_chunk, int step) {
    int c = (L + max_splits - 1) / max_splits;
    c = max(c, min_chunk);
    return (c + step - 1) / step * step;
}

// part layout: [n_queries][n_heads][max_splits][d + 2] = (unnormalised o[d], max, sum).
// Merges the chunks of heads h0..h0+gh of query t: out = Σ_s o_s e^{m_s − M} / Σ_s l_s e^{m_s − M}.
// Partials written by other blocks are read through L2 (__ldcg), never a per-SM cache.
__device__ void combine_heads(const float* part, float* __restrict__ out, int t, int h0, int gh,
                              int n_heads, int d, int max_splits, int n_splits) {
    for (int i = threadIdx.x; i < gh * d; i += blockDim.x) {
        const int h = i / d, c = i % d;
        const float* base = part + ((size_t)t * n_heads + h0 + h) * max_splits * (d + 2);
        float mx = -INFINITY;
        for (int s = 0; s < n_splits; ++s) mx = fmaxf(mx, __ldcg(base + (size_t)s * (d + 2) + d));
        float sum = 0.0f, acc = 0.0f;
        for (int s = 0; s < n_splits; ++s) {
            const float* ps = base + (size_t)s * (d + 2);
            const float f = __expf(__ldcg(ps + d) - mx);
            sum += __ldcg(ps + d + 1) * f;
            acc += __ldcg(ps + c) * f;
        }
        out[((size_t)t * n_heads + h0 + h) * d + c] = acc / sum;
    }
}

// The block's warps merged for head h (their maxima in wm[warp][ATT_GROUP]): mx = the largest
// warp maximum, returned Σ_w e^(m_w − mx)·value(w), two values at once (output component and
// sum, or one of them). A warp that saw no key has m = −inf: its weight is 0, not NaN.
template <typename Value>
__device__ __forceinline__ float2 merge_warps(const float* wm, int warps, int h, float& mx,
                                              Value value) {
    mx = -INFINITY;
    for (int w = 0; w < warps; ++w) mx = fmaxf(mx, wm[w * ATT_GROUP + h]);
    float2 acc = make_float2(0.0f, 0.0f);
    for (int w = 0; w < warps; ++w) {
        const float mw = wm[w * ATT_GROUP + h];
        const float f = mw == -INFINITY ? 0.0f : __expf(mw - mx);
        const float2 v = value(w);
        acc.x += v.x * f;
        acc.y += v.y * f;
    }
    return acc;
}

// `heads_per_block` query heads of one KV head per block: the whole group (≤ 8) at long
// context, where the keys are read once for all of them, or 1 at short context, where the
// per-key work (not memory) is the critical path and 4–8× more blocks finish sooner. HB is
// the most heads a block takes (ATT_GROUP, or 1 for the short-context entry points): the
// per-head loops run to it, so a one-head block does not issue seven heads' predicated work
// (measured: 13 µs per layer at short context, each warp issuing ~1,650 instructions).
// The last block of a (query, head set) to finish merges the chunks (a ticket counter after
// the partials, reset by that block), so decode attention is one launch; where one chunk holds
// every key (short contexts) its block writes the output itself, with no partials or ticket.
// A short-context block is a chain of memory latencies, so each warp's first tile is fetched
// before the queries are staged, and a one-head block splits each score into partial sums
// (two for f16 caches, whose 16-byte chunks hold two groups of four values; one for f32).
//
// With `fresh` (rope_write_kv_attention), the step's RoPE and cache write happen here too: q
// and the new keys arrive unrotated, every block rotates its queries as it stages them, and
// every block whose chunk holds a new position writes that row (rotated key, value) to the
// cache and to shared memory; the tile that holds it is patched from there after its copy
// lands (the copy, issued early, may have read the old row). Blocks that share the row write
// the same values, and a block reads only rows it patched itself or that an earlier step
// wrote, so no block waits for another.
struct FreshKv {
    const float* k;      // [n_new][kv_heads · d], unrotated (null: plain attention)
    const float* v;      // [n_new][kv_heads · d]
    const float* cos_t;  // [table_positions][d/2]
    const float* sin_t;
    int n_new;
    int table_positions;
};

template <typename T, int DPL, int HB>
__device__ void decode_partial_body(const float* __restrict__ q, T* kc, T* vc,
                                    const uint32_t* __restrict__ positions,
                                    float* __restrict__ part, float* __restrict__ out,
                                    int n_heads, int kv_heads, int d, int capacity,
                                    int max_splits, int min_chunk, int heads_per_block,
                                    const FreshKv fresh) {
    extern __shared__ __align__(16) unsigned char smem[];
    SFX_PDL_TRIGGER();
    const int warps = blockDim.x >> 5;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int split = blockIdx.x, kvh = blockIdx.y;
    const int group = n_heads / kv_heads;
    const int head_batches = (group + heads_per_block - 1) / heads_per_block;
    const int t = blockIdx.z / head_batches, hb = blockIdx.z % head_batches;
    const int h0 = kvh * group + hb * heads_per_block;
    const int gh = min(heads_per_block, group - hb * heads_per_block);

    const int L = min((int)positions[t] + 1, capacity);
    const int chunk = split_chunk(L, max_splits, min_chunk, warps * ATT_TILE);
    const int n_splits = (L + chunk - 1) / chunk;
    const int start = split * chunk;
    if (start >= L) return;
    const int end = min(L, start + chunk);

    float* qs = reinterpret_cast<float*>(smem);                  // [ATT_GROUP][d]
    const int row_elems = d + Elems<T>::N;                        // one 16-byte pad per row
    // Per warp: a K tile then a V tile, ATT_TILE rows each; after every warp's tiles, the
    // step's new rows ([ATT_MAX_QUERIES][2][d]: rotated key, value) as the cache stores them.
    T* ktile = reinterpret_cast<T*>(qs + ATT_GROUP * d) + (size_t)warp * 2 * ATT_TILE * row_elems;
    T* vtile = ktile + (size_t)ATT_TILE * row_elems;
    T* fresh_rows = reinterpret_cast<T*>(qs + ATT_GROUP * d) + (size_t)warps * 2 * ATT_TILE * row_elems;

    const size_t head_base = (size_t)kvh * capacity;
    const int row_chunks = d / Elems<T>::N;                       // 16-byte chunks per key row
    // This warp's valid K and V rows of the tile at k0, every copy in flight at once. Rows
    // past the chunk are left as they are: their scores are masked and P·V stops before them.
    auto issue_tile = [&](int k0) {
        const int nvalid = min(ATT_TILE, end - k0);
        for (int u = lane; u < nvalid * row_chunks; u += 32) {
            const int r = u / row_chunks, c = u % row_chunks;
            const size_t src = (head_base + k0 + r) * d;
            copy16_async(ktile + (size_t)r * row_elems + c * Elems<T>::N,
                         reinterpret_cast<const uint4*>(kc + src) + c, 16);
            copy16_async(vtile + (size_t)r * row_elems + c * Elems<T>::N,
                         reinterpret_cast<const uint4*>(vc + src) + c, 16);
        }
        copy_async_commit();
    };
    // The first tile goes out before the queries are staged, so its latency overlaps theirs
    // (a new row it holds may arrive stale: the tile is patched from fresh_rows below).
    int k0 = start + warp * ATT_TILE;
    if (k0 < end) issue_tile(k0);

    const float scale = 1.0f / sqrtf((float)d);
    if (fresh.k == nullptr) {
        for (int i = threadIdx.x; i < gh * d; i += blockDim.x) {
            const int h = i / d, c = i % d;
            qs[i] = q[((size_t)t * n_heads + h0 + h) * d + c] * scale;
        }
    } else {
        const int half = d / 2;
        const size_t qp = rope_row(positions[t], fresh.table_positions) * half;
        for (int i = threadIdx.x; i < gh * half; i += blockDim.x) {
            const int h = i / half, c = i % half;
            const float* head = q + ((size_t)t * n_heads + h0 + h) * d;
            float lo, hi;
            rope_rotate(head[c], head[c + half], fresh.cos_t[qp + c], fresh.sin_t[qp + c], lo, hi);
            qs[h * d + c] = lo * scale;
            qs[h * d + c + half] = hi * scale;
        }
        for (int tn = 0; tn < fresh.n_new; ++tn) {
            const int pn = (int)positions[tn];
            if (pn < start || pn >= end) continue;
            const size_t src = ((size_t)tn * kv_heads + kvh) * d;
            const size_t dst = ((size_t)kvh * capacity + pn) * d;
            const size_t kp = rope_row(pn, fresh.table_positions) * half;
            T* fk = fresh_rows + (size_t)tn * 2 * d;
            T* fv = fk + d;
            for (int c = threadIdx.x; c < half; c += blockDim.x) {
                float lo, hi;
                rope_rotate(fresh.k[src + c], fresh.k[src + c + half], fresh.cos_t[kp + c],
                            fresh.sin_t[kp + c], lo, hi);
                kv_store(kc + dst + c, lo);
                kv_store(kc + dst + c + half, hi);
                kv_store(fk + c, lo);
                kv_store(fk + c + half, hi);
            }
            for (int c = threadIdx.x; c < d; c += blockDim.x) {
                kv_store(vc + dst + c, fresh.v[src + c]);
                kv_store(fv + c, fresh.v[src + c]);
            }
        }
    }
    __syncthreads();

    float m[HB], l[HB], o[HB][DPL];
#pragma unroll
    for (int h = 0; h < HB; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
#pragma unroll
        for (int e = 0; e < DPL; ++e) o[h][e] = 0.0f;
    }

    // Independent partial sums per score, one per group of four values of a chunk (up to
    // SA): one head's score is otherwise a chain of d dependent multiply-adds, the critical
    // path of a short-context block.
    constexpr int SA = HB == 1 ? 4 : 1;
    for (; k0 < end; k0 += warps * ATT_TILE) {
        const int nvalid = min(ATT_TILE, end - k0);
        copy_async_wait<0>();
        if (fresh.k != nullptr) {
            for (int tn = 0; tn < fresh.n_new; ++tn) {
                const int r = (int)positions[tn] - k0;
                if (r < 0 || r >= nvalid) continue;
                const uint4* fk = reinterpret_cast<const uint4*>(fresh_rows + (size_t)tn * 2 * d);
                const uint4* fv = fk + row_chunks;
                for (int c = lane; c < row_chunks; c += 32) {
                    reinterpret_cast<uint4*>(ktile + (size_t)r * row_elems)[c] = fk[c];
                    reinterpret_cast<uint4*>(vtile + (size_t)r * row_elems)[c] = fv[c];
                }
            }
        }
        __syncwarp();
        float s[HB][SA];
#pragma unroll
        for (int h = 0; h < HB; ++h)
#pragma unroll
            for (int a = 0; a < SA; ++a) s[h][a] = 0.0f;
        if (lane < nvalid) {
            const uint4* krow = reinterpret_cast<const uint4*>(ktile + (size_t)lane * row_elems);
            for (int c = 0; c < row_chunks; ++c) {
                float kf[Elems<T>::N];
                widen16(krow[c], kf, (const T*)nullptr);
#pragma unroll
                for (int h = 0; h < HB; ++h) {
                    if (h < gh) {
                        const float4* qh =
                            reinterpret_cast<const float4*>(qs + h * d + c * Elems<T>::N);
#pragma unroll
                        for (int e4 = 0; e4 < Elems<T>::N / 4; ++e4) {
                            const float4 qv = qh[e4];
                            float& acc = s[h][e4 % SA];
                            acc = fmaf(qv.x, kf[4 * e4], acc);
                            acc = fmaf(qv.y, kf[4 * e4 + 1], acc);
                            acc = fmaf(qv.z, kf[4 * e4 + 2], acc);
                            acc = fmaf(qv.w, kf[4 * e4 + 3], acc);
                        }
                    }
                }
            }
        }
        float p[HB];
#pragma unroll
        for (int h = 0; h < HB; ++h) {
            if (h < gh) {
                float sh = s[h][0];
#pragma unroll
                for (int a = 1; a < SA; ++a) sh += s[h][a];
                const float sv = lane < nvalid ? sh : -INFINITY;
                const float m_new = fmaxf(m[h], warp_max(sv));
                const float corr = __expf(m[h] - m_new);
                p[h] = lane < nvalid ? __expf(sv - m_new) : 0.0f;
                l[h] = l[h] * corr + p[h];
#pragma unroll
                for (int e = 0; e < DPL; ++e) o[h][e] *= corr;
                m[h] = m_new;
            } else {
                p[h] = 0.0f;
            }
        }
        // P · V over the valid rows.
#pragma unroll 4
        for (int j = 0; j < nvalid; ++j) {
            float v[DPL];
            load_v<T, DPL>(vtile + (size_t)j * row_elems, lane, d, v);
#pragma unroll
            for (int h = 0; h < HB; ++h) {
                if (h < gh) {
                    const float pj = __shfl_sync(SFX_FULL_MASK, p[h], j);
#pragma unroll
                    for (int e = 0; e < DPL; ++e) o[h][e] = fmaf(pj, v[e], o[h][e]);
                }
            }
        }
        __syncwarp();  // the next tile overwrites ktile and vtile
        if (k0 + warps * ATT_TILE < end) issue_tile(k0 + warps * ATT_TILE);
    }

    // Merge the warps: (m, l, o) per warp through shared memory (the key tiles are done).
    __syncthreads();
    float* wm = reinterpret_cast<float*>(smem);                  // [warps][ATT_GROUP]
    float* wl = wm + warps * ATT_GROUP;                          // [warps][ATT_GROUP]
    float* wo = wl + warps * ATT_GROUP;                          // [warps][ATT_GROUP][d]
#pragma unroll
    for (int h = 0; h < HB; ++h) {
        if (h < gh) {
            const float lw = warp_sum(l[h]);
            if (lane == 0) {
                wm[warp * ATT_GROUP + h] = m[h];
                wl[warp * ATT_GROUP + h] = lw;
            }
#pragma unroll
            for (int e = 0; e < DPL; ++e) {
                const int c = lane * DPL + e;
                if (c < d) wo[((size_t)warp * ATT_GROUP + h) * d + c] = o[h][e];
            }
        }
    }
    __syncthreads();
    // One chunk holds every key (short contexts): this block's merge is the answer, written
    // without partials or tickets (the same values the merge of one chunk computes).
    if (n_splits == 1) {
        for (int i = threadIdx.x; i < gh * d; i += blockDim.x) {
            const int h = i / d, c = i % d;
            float mx;
            const float2 acc = merge_warps(wm, warps, h, mx, [&](int w) {
                return make_float2(wo[((size_t)w * ATT_GROUP + h) * d + c], wl[w * ATT_GROUP + h]);
            });
            out[((size_t)t * n_heads + h0 + h) * d + c] = acc.x / acc.y;
        }
        return;
    }
    for (int i = threadIdx.x; i < gh * (d + 2); i += blockDim.x) {
        const int h = i / (d + 2), c = i % (d + 2);
        float mx;
        const float acc = merge_warps(wm, warps, h, mx, [&](int w) {
            return make_float2(c < d ? wo[((size_t)w * ATT_GROUP + h) * d + c] : wl[w * ATT_GROUP + h], 0.0f);
        }).x;
        float* dst = part + (((size_t)t * n_heads + h0 + h) * max_splits + split) * (d + 2);
        if (c < d) dst[c] = acc;
        else if (c == d) dst[d] = mx;
        else dst[d + 1] = acc;
    }
    // The tickets follow the partials of every query: [4 queries][n_heads] counters (4: the
    // backend's decode query limit, ATT_MAX_QUERIES).
    unsigned int* tickets = reinterpret_cast<unsigned int*>(
        part + (size_t)4 * n_heads * max_splits * (d + 2));
    unsigned int* ticket = tickets + (size_t)t * n_heads + h0;
    __shared__ unsigned int taken;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) taken = atomicAdd(ticket, 1u);
    __syncthreads();
    if (taken != (unsigned int)(n_splits - 1)) return;
    __threadfence();
    combine_heads(part, out, t, h0, gh, n_heads, d, max_splits, n_splits);
    if (threadIdx.x == 0) *ticket = 0u;
}

template <typename T, int DPL>
__device__ void prefill_body(const float* __restrict__ q, const T* __restrict__ kc,
                             const T* __restrict__ vc, const uint32_t* __restrict__ positions,
                             float* __restrict__ out, int n, int n_heads, int kv_heads, int d,
                             int capacity) {
    extern __shared__ __align__(16) unsigned char smem[];
    SFX_PDL_TRIGGER();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int head = blockIdx.y, kvh = head / (n_heads / kv_heads);
    const int q0 = blockIdx.x * PF_QUERIES;
    float* qs = reinterpret_cast<float*>(smem);                  // [PF_QUERIES][d]
    float* ks = qs + PF_QUERIES * d;                              // [ATT_TILE][d + 1]
    float* vs = ks + ATT_TILE * (d + 1);                          // [ATT_TILE][d]

    const float scale = 1.0f / sqrtf((float)d);
    int kmax = 0;  // keys 0..kmax are seen by some query of the block
    for (int i = threadIdx.x; i < PF_QUERIES * d; i += blockDim.x) {
        const int r = i / d, c = i % d;
        qs[i] = q0 + r < n ? q[((size_t)(q0 + r) * n_heads + head) * d + c] * scale : 0.0f;
    }
    for (int r = 0; r < PF_QUERIES && q0 + r < n; ++r) kmax = max(kmax, (int)positions[q0 + r]);
    kmax = min(kmax, capacity - 1);

    constexpr int QPW = PF_QUERIES / PF_WARPS;  // queries per warp
    int qpos[QPW];
#pragma unroll
    for (int i = 0; i < QPW; ++i) {
        const int tq = q0 + warp * QPW + i;
        qpos[i] = tq < n ? (int)positions[tq] : -1;  // -1: no key is valid
    }
    float m[QPW], l[QPW], o[QPW][DPL];
#pragma unroll
    for (int i = 0; i < QPW; ++i) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
#pragma unroll
        for (int e = 0; e < DPL; ++e) o[i][e] = 0.0f;
    }
    const size_t head_base = (size_t)kvh * capacity;
    for (int k0 = 0; k0 <= kmax; k0 += ATT_TILE) {
        __syncthreads();  // previous tile fully consumed (and qs written, first time)
        for (int i = threadIdx.x; i < ATT_TILE * d; i += blockDim.x) {
            const int r = i / d, c = i % d;
            const bool ok = k0 + r <= kmax;
            ks[r * (d + 1) + c] = ok ? kv_load(kc + (head_base + k0 + r) * d + c) : 0.0f;
            vs[r * d + c] = ok ? kv_load(vc + (head_base + k0 + r) * d + c) : 0.0f;
        }
        __syncthreads();
        const int key = k0 + lane;
        float s[QPW];
#pragma unroll
        for (int i = 0; i < QPW; ++i) s[i] = 0.0f;
        const float* krow = ks + lane * (d + 1);
        for (int c = 0; c < d; c += 4) {
            const float k0v = krow[c], k1v = krow[c + 1], k2v = krow[c + 2], k3v = krow[c + 3];
#pragma unroll
            for (int i = 0; i < QPW; ++i) {
                const float4 qv =
                    *reinterpret_cast<const float4*>(qs + (warp * QPW + i) * d + c);
                s[i] = fmaf(qv.x, k0v, s[i]);
                s[i] = fmaf(qv.y, k1v, s[i]);
                s[i] = fmaf(qv.z, k2v, s[i]);
                s[i] = fmaf(qv.w, k3v, s[i]);
            }
        }
        float p[QPW];
#pragma unroll
        for (int i = 0; i < QPW; ++i) {
            const bool ok = key <= qpos[i];
            const float sv = ok ? s[i] : -INFINITY;
            const float tile_max = warp_max(sv);
            if (tile_max == -INFINITY) {  // no valid key for this query in this tile
                p[i] = 0.0f;
                continue;
            }
            const float m_new = fmaxf(m[i], tile_max);
            const float corr = __expf(m[i] - m_new);
            p[i] = ok ? __expf(sv - m_new) : 0.0f;
            l[i] = l[i] * corr + p[i];
#pragma unroll
            for (int e = 0; e < DPL; ++e) o[i][e] *= corr;
            m[i] = m_new;
        }
        const int nk = min(ATT_TILE, kmax + 1 - k0);
        for (int j = 0; j < nk; ++j) {
            float v[DPL];
            if (DPL % 4 == 0 && d == 32 * DPL) {
#pragma unroll
                for (int e = 0; e < DPL; e += 4) {
                    const float4 f = *reinterpret_cast<const float4*>(vs + j * d + lane * DPL + e);
                    v[e] = f.x;
                    v[(e + 1) % DPL] = f.y;
                    v[(e + 2) % DPL] = f.z;
                    v[(e + 3) % DPL] = f.w;
                }
            } else {
#pragma unroll
                for (int e = 0; e < DPL; ++e) {
                    const int c = lane * DPL + e;
                    v[e] = c < d ? vs[j * d + c] : 0.0f;
                }
            }
#pragma unroll
            for (int i = 0; i < QPW; ++i) {
                const float pj = __shfl_sync(SFX_FULL_MASK, p[i], j);
#pragma unroll
                for (int e = 0; e < DPL; ++e) o[i][e] = fmaf(pj, v[e], o[i][e]);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < QPW; ++i) {
        const int tq = q0 + warp * QPW + i;
        if (tq >= n) continue;
        const float inv = 1.0f / warp_sum(l[i]);
#pragma unroll
        for (int e = 0; e < DPL; ++e) {
            const int c = lane * DPL + e;
            if (c < d) out[((size_t)tq * n_heads + head) * d + c] = o[i][e] * inv;
        }
    }
}

#define SFX_ATTENTION(T, TN, DPL)                                                             \
    extern "C" __global__ void attn_decode_##TN##_d##DPL(                                    \
        const float* q, T* kc, T* vc, const uint32_t* positions, float* part, float* out,     \
        int n_heads, int kv_heads, int d, int capacity, int max_splits, int min_chunk,        \
        int heads_per_block, const FreshKv fresh) {                                           \
        decode_partial_body<T, DPL, ATT_GROUP>(q, kc, vc, positions, part, out, n_heads,      \
                                               kv_heads, d, capacity, max_splits, min_chunk,  \
                                               heads_per_block, fresh);                       \
    }                                                                                         \
    extern "C" __global__ void attn_decode1_##TN##_d##DPL(                                   \
        const float* q, T* kc, T* vc, const uint32_t* positions, float* part, float* out,     \
        int n_heads, int kv_heads, int d, int capacity, int max_splits, int min_chunk,        \
        int heads_per_block, const FreshKv fresh) {                                           \
        decode_partial_body<T, DPL, 1>(q, kc, vc, positions, part, out, n_heads, kv_heads, d, \
                                       capacity, max_splits, min_chunk, 1, fresh);            \
    }                                                                                         \
    extern "C" __global__ void attn_prefill_##TN##_d##DPL(                                   \
        const float* q, const T* kc, const T* vc, const uint32_t* positions, float* out,      \
        int n, int n_heads, int kv_heads, int d, int capacity) {                              \
        prefill_body<T, DPL>(q, kc, vc, positions, out, n, n_heads, kv_heads, d, capacity);   \
    }

SFX_ATTENTION(float, f32, 2)
SFX_ATTENTION(float, f32, 4)
SFX_ATTENTION(float, f32, 8)
SFX_ATTENTION(__half, f16, 2)
SFX_ATTENTION(__half, f16, 4)
SFX_ATTENTION(__half, f16, 8)

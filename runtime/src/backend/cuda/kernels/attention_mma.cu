// Prefill attention on tensor cores (sm_80+), for f16 KV caches: FlashAttention-2 with
// mma.sync m16n8k16 (f16 inputs, f32 accumulation).
//
// A block is 4 warps and 64 queries of one head; a warp owns 16 queries, so the scores of a
// 64-key tile (16 × 64) and the output (16 × D) live in its registers, and the softmax never
// leaves them. Key and value tiles are copied to shared memory with cp.async, double
// buffered, so the next tile streams in while the current one is multiplied. The cache is
// already f16, so K and V enter the MMAs exactly; Q (scaled by log2(e)/sqrt(D), so the softmax
// runs on exp2) and the probabilities are rounded to f16, as FlashAttention does — which is
// why the f32 cache keeps the CUDA-core kernel of attention.cu as its exact path.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 f16): lane = 4·g + t. A (16×16, row): a0 = (g,
// 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..). B (16×8, col): b0 = (k
// 2t..2t+1, n g), b1 = (k 2t+8.., n g). C (16×8 f32): c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, ..).
// The scores' C layout of two adjacent 8-key tiles is exactly the A layout of one 16-key
// slice of P, so P·V needs no shuffle.
#include "common.cuh"

#define MMA_WARPS 4
#define MMA_QUERIES (16 * MMA_WARPS)  // queries per block
#define MMA_KEYS 64                   // keys per tile

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Stages keys k0..k0+63 of K and V (rows of D halves) into one buffer pair.
template <int D>
__device__ __forceinline__ void stage_tile(__half* ks, __half* vs, const __half* kc,
                                           const __half* vc, size_t head_base, int k0, int kmax) {
    constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
    constexpr int STRIDE = D + 8;  // halves per shared row (the pad spreads banks)
    for (int u = threadIdx.x; u < MMA_KEYS * CHUNKS; u += MMA_WARPS * 32) {
        const int r = u / CHUNKS, c = u % CHUNKS;
        // A row past the keys the block may see is zero-filled (its scores are masked, and
        // zero V rows keep 0 · V finite); its source is row 0 of the head, a valid address.
        const bool ok = k0 + r <= kmax;
        const size_t row = head_base + (ok ? k0 + r : 0);
        copy16_async(ks + r * STRIDE + c * 8, kc + row * D + c * 8, ok ? 16 : 0);
        copy16_async(vs + r * STRIDE + c * 8, vc + row * D + c * 8, ok ? 16 : 0);
    }
}

template <int D>
__device__ void prefill_mma_body(const float* __restrict__ q, const __half* __restrict__ kc,
                                 const __half* __restrict__ vc,
                                 const uint32_t* __restrict__ positions, float* __restrict__ out,
                                 int n, int n_heads, int kv_heads, int capacity) {
    extern __shared__ __align__(16) unsigned char smem[];
    constexpr int STRIDE = D + 8;
    constexpr int KSTEPS = D / 16;  // 16-dim slices of Q·Kᵀ
    constexpr int DTILES = D / 8;   // 8-dim column tiles of the output
    constexpr int NTILES = MMA_KEYS / 8;
    __half* tiles = reinterpret_cast<__half*>(smem);  // [2][K, V][MMA_KEYS][STRIDE]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int head = blockIdx.y, kvh = head / (n_heads / kv_heads);
    const int q0 = blockIdx.x * MMA_QUERIES;
    const size_t head_base = (size_t)kvh * capacity;

    // Causal extent: the block stages keys 0..kmax (the largest position of its queries);
    // each warp computes only the tiles its own queries reach.
    __shared__ int block_kmax;
    if (threadIdx.x == 0) block_kmax = 0;
    __syncthreads();
    const int qw = q0 + warp * 16;
    const int row_a = qw + g, row_b = qw + g + 8;
    const int pos_a = row_a < n ? (int)positions[row_a] : -1;
    const int pos_b = row_b < n ? (int)positions[row_b] : -1;
    int warp_kmax = max(pos_a, pos_b);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) warp_kmax = max(warp_kmax, __shfl_xor_sync(SFX_FULL_MASK, warp_kmax, o));
    warp_kmax = min(warp_kmax, capacity - 1);
    if (lane == 0) atomicMax(&block_kmax, warp_kmax);
    __syncthreads();
    const int kmax = block_kmax;

    // Q fragments for the warp's 16 queries, pre-scaled.
    const float qscale = 1.4426950408889634f / sqrtf((float)D);
    uint32_t qa[KSTEPS][4];
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // columns 2t.. and 2t+8..
            const int col = s * 16 + half * 8 + 2 * t;
            float2 va = make_float2(0.0f, 0.0f), vb = make_float2(0.0f, 0.0f);
            if (row_a < n)
                va = *reinterpret_cast<const float2*>(q + ((size_t)row_a * n_heads + head) * D + col);
            if (row_b < n)
                vb = *reinterpret_cast<const float2*>(q + ((size_t)row_b * n_heads + head) * D + col);
            qa[s][2 * half] = pack_half2(va.x * qscale, va.y * qscale);
            qa[s][2 * half + 1] = pack_half2(vb.x * qscale, vb.y * qscale);
        }
    }

    float o[DTILES][4];
#pragma unroll
    for (int j = 0; j < DTILES; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m_a = -INFINITY, m_b = -INFINITY;  // running max (log2 units) of rows g and g+8
    float l_a = 0.0f, l_b = 0.0f;            // this thread's share of the running sums

    const int n_tiles = kmax / MMA_KEYS + 1;
    stage_tile<D>(tiles, tiles + MMA_KEYS * STRIDE, kc, vc, head_base, 0, kmax);
    copy_async_commit();
    for (int it = 0; it < n_tiles; ++it) {
        __half* ks = tiles + (size_t)(it & 1) * 2 * MMA_KEYS * STRIDE;
        __half* vs = ks + MMA_KEYS * STRIDE;
        if (it + 1 < n_tiles) {
            __half* nk = tiles + (size_t)((it + 1) & 1) * 2 * MMA_KEYS * STRIDE;
            stage_tile<D>(nk, nk + MMA_KEYS * STRIDE, kc, vc, head_base, (it + 1) * MMA_KEYS,
                          kmax);
        }
        copy_async_commit();
        copy_async_wait<1>();
        __syncthreads();
        const int k0 = it * MMA_KEYS;
        if (k0 <= warp_kmax) {
            float s[NTILES][4];
#pragma unroll
            for (int j = 0; j < NTILES; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
            for (int j = 0; j < NTILES; ++j) {
                const __half* krow = ks + (j * 8 + g) * STRIDE + 2 * t;
#pragma unroll
                for (int ks_ = 0; ks_ < KSTEPS; ++ks_) {
                    const uint32_t b0 = *reinterpret_cast<const uint32_t*>(krow + ks_ * 16);
                    const uint32_t b1 = *reinterpret_cast<const uint32_t*>(krow + ks_ * 16 + 8);
                    mma_f16(s[j], qa[ks_], b0, b1);
                }
            }
            // Causal mask, then the online softmax on rows g (c0, c1) and g + 8 (c2, c3).
            float tmax_a = -INFINITY, tmax_b = -INFINITY;
#pragma unroll
            for (int j = 0; j < NTILES; ++j) {
                const int key = k0 + j * 8 + 2 * t;
                if (key > pos_a) s[j][0] = -INFINITY;
                if (key + 1 > pos_a) s[j][1] = -INFINITY;
                if (key > pos_b) s[j][2] = -INFINITY;
                if (key + 1 > pos_b) s[j][3] = -INFINITY;
                tmax_a = fmaxf(tmax_a, fmaxf(s[j][0], s[j][1]));
                tmax_b = fmaxf(tmax_b, fmaxf(s[j][2], s[j][3]));
            }
            // The four lanes of a quad hold one row between them.
#pragma unroll
            for (int o_ = 1; o_ < 4; o_ <<= 1) {
                tmax_a = fmaxf(tmax_a, __shfl_xor_sync(SFX_FULL_MASK, tmax_a, o_));
                tmax_b = fmaxf(tmax_b, __shfl_xor_sync(SFX_FULL_MASK, tmax_b, o_));
            }
            const float mn_a = fmaxf(m_a, tmax_a), mn_b = fmaxf(m_b, tmax_b);
            // A row that has seen no key yet keeps max −inf: subtract 0 so exp2 gives 0, not NaN.
            const float base_a = mn_a == -INFINITY ? 0.0f : mn_a;
            const float base_b = mn_b == -INFINITY ? 0.0f : mn_b;
            const float corr_a = exp2f(m_a - base_a), corr_b = exp2f(m_b - base_b);
            m_a = mn_a;
            m_b = mn_b;
            l_a *= corr_a;
            l_b *= corr_b;
#pragma unroll
            for (int j = 0; j < DTILES; ++j) {
                o[j][0] *= corr_a;
                o[j][1] *= corr_a;
                o[j][2] *= corr_b;
                o[j][3] *= corr_b;
            }
            uint32_t pa[NTILES / 2][4];
#pragma unroll
            for (int j = 0; j < NTILES; ++j) {
                const float p0 = exp2f(s[j][0] - base_a), p1 = exp2f(s[j][1] - base_a);
                const float p2 = exp2f(s[j][2] - base_b), p3 = exp2f(s[j][3] - base_b);
                l_a += p0 + p1;
                l_b += p2 + p3;
                // Scores of keys 8j.. are columns 0..7 (j even) or 8..15 (j odd) of slice j/2.
                pa[j / 2][(j & 1) * 2] = pack_half2(p0, p1);
                pa[j / 2][(j & 1) * 2 + 1] = pack_half2(p2, p3);
            }
            // O += P · V: B fragments of V (keys × dims, row-major in shared memory) come
            // transposed from ldmatrix, four 8×8 matrices (two dim tiles) per instruction.
#pragma unroll
            for (int kt = 0; kt < MMA_KEYS / 16; ++kt) {
                const int mat = lane >> 3, r = lane & 7;
                const int key = kt * 16 + r + (mat & 1) * 8;
#pragma unroll
                for (int j = 0; j < DTILES; j += 2) {
                    const int dim = j * 8 + (mat >> 1) * 8;
                    uint32_t b0, b1, b2, b3;
                    asm volatile(
                        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                        : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                        : "r"(smem_addr(vs + key * STRIDE + dim)));
                    mma_f16(o[j], pa[kt], b0, b1);
                    mma_f16(o[j + 1], pa[kt], b2, b3);
                }
            }
        }
        __syncthreads();  // the next iteration stages into the buffer just read
    }
    copy_async_wait<0>();

#pragma unroll
    for (int o_ = 1; o_ < 4; o_ <<= 1) {
        l_a += __shfl_xor_sync(SFX_FULL_MASK, l_a, o_);
        l_b += __shfl_xor_sync(SFX_FULL_MASK, l_b, o_);
    }
    const float inv_a = l_a > 0.0f ? 1.0f / l_a : 0.0f;
    const float inv_b = l_b > 0.0f ? 1.0f / l_b : 0.0f;
#pragma unroll
    for (int j = 0; j < DTILES; ++j) {
        const int col = j * 8 + 2 * t;
        if (row_a < n)
            *reinterpret_cast<float2*>(out + ((size_t)row_a * n_heads + head) * D + col) =
                make_float2(o[j][0] * inv_a, o[j][1] * inv_a);
        if (row_b < n)
            *reinterpret_cast<float2*>(out + ((size_t)row_b * n_heads + head) * D + col) =
                make_float2(o[j][2] * inv_b, o[j][3] * inv_b);
    }
}

#define SFX_PREFILL_MMA(D)                                                                    \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32) attn_prefill_mma_f16_d##D(  \
        const float* q, const __half* kc, const __half* vc, const uint32_t* positions,       \
        float* out, int n, int n_heads, int kv_heads, int capacity) {                        \
        prefill_mma_body<D>(q, kc, vc, positions, out, n, n_heads, kv_heads, capacity);       \
    }

#else

// Older GPUs have no m16n8k16 MMA: the entry points exist (one symbol table for every
// architecture) and trap; the backend selects them only on compute capability 8.0+.
#define SFX_PREFILL_MMA(D)                                                                    \
    extern "C" __global__ void attn_prefill_mma_f16_d##D(                                    \
        const float*, const __half*, const __half*, const uint32_t*, float*, int, int, int,   \
        int) {                                                                                \
        __trap();                                                                             \
    }

#endif

SFX_PREFILL_MMA(64)
SFX_PREFILL_MMA(128)

// Shared helpers of the StrataFlux CUDA kernels. Every kernel is `extern "C"` so the Rust side
// loads it by name; activations are f32, weights BF16 (raw u16 bits) or F32, KV f32 or f16.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define SFX_FULL_MASK 0xffffffffu

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(SFX_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(SFX_FULL_MASK, v, o));
    return v;
}

// BF16 bits → f32 is a shift: exact, and no conversion instruction on the load path.
__device__ __forceinline__ float bf16_bits(uint32_t b) { return __uint_as_float(b << 16); }

// The two BF16 values packed in a 32-bit word (low half first, as they lie in memory).
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// KV element widening/narrowing: one template body serves f32 and f16 caches.
__device__ __forceinline__ float kv_load(const float* p) { return *p; }
__device__ __forceinline__ float kv_load(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ void kv_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void kv_store(__half* p, float v) { *p = __float2half_rn(v); }

// RoPE ("rotate_half": the pair i, i + d/2): (a, b) → (a·cos − b·sin, b·cos + a·sin), each
// product and sum rounded on its own as the CPU backend computes it (no fused multiply-add),
// so the rope kernels and the attention that rotates in place agree bit for bit.
__device__ __forceinline__ void rope_rotate(float a, float b, float c, float s, float& lo,
                                            float& hi) {
    lo = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    hi = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

// The cos/sin table row of a position; positions past the table (never issued by the model)
// take its last row so no kernel reads out of bounds.
__device__ __forceinline__ size_t rope_row(uint32_t position, int table_positions) {
    return min(position, (uint32_t)max(table_positions - 1, 0));
}

// Loads that bypass L1 allocation: weights are read once per token, and keeping them out of
// L1 leaves it to the activation vector every block re-reads.
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// 16 bytes global → shared without a register round trip (cp.async, sm_80+): a warp issues
// all of a tile's copies before waiting once, so a tile costs one memory latency, not one per
// row. `bytes` 0 writes zeros (the source address must still be valid). Older GPUs copy
// synchronously through registers.
__device__ __forceinline__ void copy16_async(void* dst, const void* src, int bytes) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)
    const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(bytes));
#else
    *reinterpret_cast<uint4*>(dst) =
        bytes ? __ldg(reinterpret_cast<const uint4*>(src)) : make_uint4(0, 0, 0, 0);
#endif
}

// 8 bytes global → shared without a register round trip (cp.async.ca, sm_80+).
__device__ __forceinline__ void copy8_async(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)
    const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(d), "l"(src));
#else
    *reinterpret_cast<uint2*>(dst) = __ldg(reinterpret_cast<const uint2*>(src));
#endif
}

// 4 bytes global → shared without a register round trip (cp.async.ca, sm_80+).
__device__ __forceinline__ void copy4_async(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)
    const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src));
#else
    *reinterpret_cast<uint32_t*>(dst) = __ldg(reinterpret_cast<const uint32_t*>(src));
#endif
}

// Commits the copies issued so far as one group.
__device__ __forceinline__ void copy_async_commit() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)
    asm volatile("cp.async.commit_group;");
#endif
}

// Waits until at most N committed groups of this thread are still in flight (the copies are
// visible to other threads after a barrier that follows).
template <int N>
__device__ __forceinline__ void copy_async_wait() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
#endif
}

// Sum of a value over the block (blockDim.x a multiple of 32, at most 1024); every thread gets
// the total. `shared` holds at least 32 floats.
__device__ __forceinline__ float block_sum(float v, float* shared) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    const int warps = blockDim.x >> 5;
    float t = lane < warps ? shared[lane] : 0.0f;
    return warp_sum(t);
}

// Programmatic dependent launch (sm_90+): a kernel lets the next grid launch as soon as all
// of its blocks have started (TRIGGER), and a kernel launched with the PDL attribute waits for
// its predecessor's completion and memory (WAIT) only where it first touches data that
// predecessor may write — so a projection streams its weights while the previous kernel drains.
// Both are no-ops on older GPUs and for kernels launched without the attribute.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define SFX_PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#define SFX_PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define SFX_PDL_TRIGGER() \
    do {                  \
    } while (0)
#define SFX_PDL_WAIT() \
    do {               \
    } while (0)
#endif

// A projection row's output from its dot product(s) `total` (and `up_total`: SwiGLU's up
// row), times the fused norm's `scale` (1 without): y = silu(g)·u, or y (+)= v + bias.
// Under SwiGLU both products were taken on x ⊙ w, so the one norm scale applies to each.
// `extra` and `up_extra` are the rows' refinement (refine_epilogue.cuh), added after the
// scale; `refined` false keeps the unrefined arithmetic exactly.
template <bool SWIGLU>
__device__ __forceinline__ void projection_out(float* o, float total, float up_total,
                                               float scale, const float* bias, int row,
                                               int accumulate, bool refined = false,
                                               float extra = 0.0f, float up_extra = 0.0f) {
    if (SWIGLU) {
        const float gv = total * scale + extra;
        const float silu = gv / (1.0f + expf(-gv));
        *o = refined ? silu * (up_total * scale + up_extra) : silu * up_total * scale;
    } else {
        float v = total * scale + extra;
        if (bias) v += bias[row];
        *o = accumulate ? *o + v : v;
    }
}

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)
// D += A·B on tensor cores, f16 inputs and f32 accumulation (mma.sync m16n8k16, sm_80+):
// fragment layouts in the PTX ISA; the callers' comments restate the ones they rely on.
__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

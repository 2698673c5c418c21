// Loads of packed B-bit code chunks (32 codes in B four-byte words, little-endian bit
// streams): the group codes of group.cu and the look-up-table codes of coded.cu share them.
#pragma once
#include "common.cuh"

// Code word loads: one 8- or 16-byte load at 2 and 4 bits, two 16-byte loads at 8 bits,
// B 4-byte loads at 3 and 6 bits (12- and 24-byte chunks are only 4-byte aligned).
template <int B>
__device__ __forceinline__ void load_codes(const uint8_t* p, uint32_t (&w)[B]) {
    if constexpr (B == 2) {
        uint2 v;
        asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];"
                     : "=r"(v.x), "=r"(v.y)
                     : "l"(p));
        w[0] = v.x;
        w[1] = v.y;
    } else if constexpr (B == 4) {
        const uint4 v = load_stream(reinterpret_cast<const uint4*>(p));
        w[0] = v.x;
        w[1] = v.y;
        w[2] = v.z;
        w[3] = v.w;
    } else if constexpr (B == 8) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint4 v = load_stream(reinterpret_cast<const uint4*>(p) + h);
            w[4 * h] = v.x;
            w[4 * h + 1] = v.y;
            w[4 * h + 2] = v.z;
            w[4 * h + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < B; ++i) {
            asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];"
                         : "=r"(w[i])
                         : "l"(p + 4 * i));
        }
    }
}

// Weights decoded 32 at a time on the CUDA cores: look-up-table codes (SqueezeLLM: a B-bit
// code indexes its row's 2^B-entry table) and llama.cpp's GGUF blocks (the legacy 32-weight
// blocks Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the 256-weight K-quant super-blocks Q2_K … Q6_K),
// bit for bit as the file stores them. The batch-1 matrix–vector product that decode runs,
// the f32 dequantization prefill feeds to the TF32 GEMM, and the embedding row gather.
//
// GGUF blocks are split at load into three planes (docs/format.md, "CUDA GGUF planes"): per
// block its scale fields (`meta`: d, dmin and the packed sub-block scales), its low code bits
// (`qs`) and its high code bits (`qh`: Q5_*'s fifth bits, Q3_K's hmask, Q6_K's upper pairs),
// each plane a row-major array of the blocks' fields. The bytes are the file's; only their
// order changes, so a chunk's code bytes are one or two aligned 16-byte loads.
//
// Every GGUF type is affine in 16-weight halves: w = a·q + b for an unsigned code q, so a
// half's dot is a·Σ q·x + b·Σ x with Σ x read from per-16 sums staged beside x. A code becomes
// a float without a conversion (int → float runs at a sixteenth of the FMA rate on Hopper):
// its bits are rotated to the top of an f32 mantissa, f = 1 + q·2^-B.
//
// A thread owns a 32-column chunk for R rows at a time; `tpr` threads split a row's chunks;
// the next chunks' bytes are loaded before the current one is multiplied. x is staged once per
// block in shared memory (RMS-normalised there for the `_norm` entries), as in group.cu.
#include "common.cuh"
#include "packed_codes.cuh"
#include "row_matvec.cuh"

#define CD_THREADS 256
#define CD_WARPS (CD_THREADS / 32)
#define CD_CHUNK 32
#define CD_PAD(c) MV_PAD(c)
#define CD_MAX_ITEMS 3
#define CD_UNROLL 2
// Look-up tables a block stages: every row of the block (at most CD_THREADS / 32 row sets of
// R ≤ 2 rows: the host keeps 32 or more threads on a row for these codes, so a warp's lanes
// read one row's table and never conflict on a bank), twice for SwiGLU's gate and up.
#define CD_LUT_ROWS (2 * (CD_THREADS / 32) * 2)

struct CdItem {
    const uint8_t* meta;  // GGUF: the blocks' scale fields; LUT: f32 tables [rows][2^B]
    const uint8_t* qs;    // GGUF: low code bits; LUT: the packed codes [rows][row_bytes]
    const uint8_t* qh;    // GGUF: high code bits (types without them: null)
    const float* bias;    // [rows] or null
    float* y;             // [m, rows]
    int rows;
    int block_end;        // exclusive end of this item's blocks in the grid
};

struct CdGroup {
    CdItem item[CD_MAX_ITEMS];
    int count;
};

// The registers one chunk's bytes are loaded into: 32 code bytes (`q`), 32 high-bit bytes
// (`h`) and up to four words of scale fields (`m`); each format fills what it reads.
struct CdRegs {
    uint4 q[2];
    uint4 h[2];
    uint32_t m[4];
};

__device__ __forceinline__ uint32_t word_of(const uint4& v, int k) {
    return k == 0 ? v.x : (k == 1 ? v.y : (k == 2 ? v.z : v.w));
}

__device__ __forceinline__ uint32_t ld_u16(const uint8_t* p) {
    return __ldg(reinterpret_cast<const unsigned short*>(p));
}

__device__ __forceinline__ uint32_t ld_u32(const uint8_t* p) {
    return __ldg(reinterpret_cast<const unsigned int*>(p));
}

__device__ __forceinline__ float half_lo(uint32_t w) {
    return __half2float(__ushort_as_half((unsigned short)(w & 0xFFFFu)));
}

__device__ __forceinline__ float half_hi(uint32_t w) {
    return __half2float(__ushort_as_half((unsigned short)(w >> 16)));
}

// A `bits`-wide field of byte l (0..31) of a 32-byte register pair, starting `shift` bits into
// the byte, moved to bits [target, target + bits) of an otherwise zero word: one rotate (the
// field may sit above or below its target, which `shift` decides at run time) and one AND.
__device__ __forceinline__ uint32_t field(const uint4 (&v)[2], int l, int shift, int bits,
                                          int target) {
    const uint32_t w = word_of(v[l >> 4], (l >> 2) & 3);
    const int at = 8 * (l & 3) + shift;
    return __funnelshift_l(w, w, (target - at) & 31) & (((1u << bits) - 1u) << target);
}

// ---- GGUF block types: plane sizes, loads, codes and the affine map of each 16-weight half.
// `blk` is the block's index in the planes (row · blocks per row + block), `sub` the chunk's
// 32-weight index inside its block (0 for the legacy blocks, 0..7 for the K-quants).

// Q4_0: d; 16 bytes of nibbles (weights 0..15 low, 16..31 high). w = d·(q − 8).
struct FmtQ4_0 {
    static constexpr int BLOCK = 32, META = 2, QS = 16, QH = 0;
    static __device__ void load(const CdItem& it, size_t blk, int, CdRegs& r) {
        r.q[0] = load_stream(reinterpret_cast<const uint4*>(it.qs + blk * QS));
        r.m[0] = ld_u16(it.meta + blk * META);
    }
    static constexpr int BITS = 4;
    static __device__ uint32_t mant(const CdRegs& r, int, int l) {
        return field(r.q, l & 15, l >= 16 ? 4 : 0, 4, 23 - BITS);
    }
    static __device__ float2 affine(const CdRegs& r, int, int) {
        const float d = half_lo(r.m[0]);
        return make_float2(d, -8.0f * d);
    }
};

// Q4_1: d, m; nibbles as Q4_0. w = d·q + m.
struct FmtQ4_1 {
    static constexpr int BLOCK = 32, META = 4, QS = 16, QH = 0;
    static __device__ void load(const CdItem& it, size_t blk, int, CdRegs& r) {
        r.q[0] = load_stream(reinterpret_cast<const uint4*>(it.qs + blk * QS));
        r.m[0] = ld_u32(it.meta + blk * META);
    }
    static constexpr int BITS = 4;
    static __device__ uint32_t mant(const CdRegs& r, int s, int l) {
        return FmtQ4_0::mant(r, s, l);
    }
    static __device__ float2 affine(const CdRegs& r, int, int) {
        return make_float2(half_lo(r.m[0]), half_hi(r.m[0]));
    }
};

// Q5_0: d; 32 fifth bits (bit j of weight j); nibbles as Q4_0. w = d·(q − 16).
struct FmtQ5_0 {
    static constexpr int BLOCK = 32, META = 2, QS = 16, QH = 4;
    static __device__ void load(const CdItem& it, size_t blk, int, CdRegs& r) {
        r.q[0] = load_stream(reinterpret_cast<const uint4*>(it.qs + blk * QS));
        r.h[0].x = ld_u32(it.qh + blk * QH);
        r.m[0] = ld_u16(it.meta + blk * META);
    }
    static constexpr int BITS = 5;
    static __device__ uint32_t mant(const CdRegs& r, int, int l) {
        return field(r.q, l & 15, l >= 16 ? 4 : 0, 4, 23 - BITS) |
               (__funnelshift_l(r.h[0].x, r.h[0].x, (22 - l) & 31) & (1u << 22));
    }
    static __device__ float2 affine(const CdRegs& r, int, int) {
        const float d = half_lo(r.m[0]);
        return make_float2(d, -16.0f * d);
    }
};

// Q5_1: d, m; fifth bits and nibbles as Q5_0. w = d·q + m.
struct FmtQ5_1 {
    static constexpr int BLOCK = 32, META = 4, QS = 16, QH = 4;
    static __device__ void load(const CdItem& it, size_t blk, int, CdRegs& r) {
        r.q[0] = load_stream(reinterpret_cast<const uint4*>(it.qs + blk * QS));
        r.h[0].x = ld_u32(it.qh + blk * QH);
        r.m[0] = ld_u32(it.meta + blk * META);
    }
    static constexpr int BITS = 5;
    static __device__ uint32_t mant(const CdRegs& r, int s, int l) {
        return FmtQ5_0::mant(r, s, l);
    }
    static __device__ float2 affine(const CdRegs& r, int, int) {
        return make_float2(half_lo(r.m[0]), half_hi(r.m[0]));
    }
};

// Q8_0: d; 32 signed bytes, read as q + 128. w = d·(q − 128).
struct FmtQ8_0 {
    static constexpr int BLOCK = 32, META = 2, QS = 32, QH = 0;
    static __device__ void load(const CdItem& it, size_t blk, int, CdRegs& r) {
        const uint4* p = reinterpret_cast<const uint4*>(it.qs + blk * QS);
        r.q[0] = load_stream(p);
        r.q[1] = load_stream(p + 1);
        r.m[0] = ld_u16(it.meta + blk * META);
    }
    static constexpr int BITS = 8;
    static __device__ uint32_t mant(const CdRegs& r, int, int l) {
        return field(r.q, l, 0, 8, 23 - BITS) ^ (0x80u << (23 - BITS));
    }
    static __device__ float2 affine(const CdRegs& r, int, int) {
        const float d = half_lo(r.m[0]);
        return make_float2(d, -128.0f * d);
    }
};

// Q2_K: meta = 16 scale bytes (low nibble scale, high nibble min, one per 16 weights), d,
// dmin; 64 code bytes: chunk n·4 + j reads bytes 32n.. 32n + 31 at bits 2j.
// w = d·sc·q − dmin·m.
struct FmtQ2_K {
    static constexpr int BLOCK = 256, META = 20, QS = 64, QH = 0;
    static __device__ void load(const CdItem& it, size_t blk, int sub, CdRegs& r) {
        const uint4* p = reinterpret_cast<const uint4*>(it.qs + blk * QS + 32 * (sub >> 2));
        r.q[0] = load_stream(p);
        r.q[1] = load_stream(p + 1);
        const uint8_t* m = it.meta + blk * META;
        r.m[0] = ld_u16(m + 2 * sub);
        r.m[1] = ld_u32(m + 16);
    }
    static constexpr int BITS = 2;
    static __device__ uint32_t mant(const CdRegs& r, int sub, int l) {
        return field(r.q, l, 2 * (sub & 3), 2, 23 - BITS);
    }
    static __device__ float2 affine(const CdRegs& r, int, int h) {
        const uint32_t s = (r.m[0] >> (8 * h)) & 0xFFu;
        return make_float2(half_lo(r.m[1]) * (float)(s & 0xFu),
                           -half_hi(r.m[1]) * (float)(s >> 4));
    }
};

// Q3_K: meta = 12 bytes of sixteen 6-bit scales (low nibbles in bytes 0..7, high pairs in
// bytes 8..11), d; 64 code bytes as Q2_K; 32 hmask bytes, bit `sub` of byte l set when weight
// l of chunk `sub` is not lowered by 4. w = d·(sc − 32)·(q − 4) with q = low pair | hbit << 2.
struct FmtQ3_K {
    static constexpr int BLOCK = 256, META = 14, QS = 64, QH = 32;
    static __device__ void load(const CdItem& it, size_t blk, int sub, CdRegs& r) {
        const uint4* p = reinterpret_cast<const uint4*>(it.qs + blk * QS + 32 * (sub >> 2));
        r.q[0] = load_stream(p);
        r.q[1] = load_stream(p + 1);
        const uint4* h = reinterpret_cast<const uint4*>(it.qh + blk * QH);
        r.h[0] = load_stream(h);
        r.h[1] = load_stream(h + 1);
        // Scales 2·sub and 2·sub + 1: their low nibbles in bytes i % 8, i % 8 + 1 (shifted by
        // 4 from scale 8 on), their high pairs in bytes 8 + i % 4, 9 + i % 4 (shifted by
        // 2·(i / 4)), i = 2·sub.
        const uint8_t* m = it.meta + blk * META;
        const int i = 2 * sub;
        r.m[0] = ld_u16(m + (i & 7));
        r.m[1] = ld_u16(m + 8 + (i & 3));
        r.m[2] = ld_u16(m + 12);
    }
    static constexpr int BITS = 3;
    static __device__ uint32_t mant(const CdRegs& r, int sub, int l) {
        return field(r.q, l, 2 * (sub & 3), 2, 23 - BITS) | field(r.h, l, sub, 1, 22);
    }
    static __device__ float2 affine(const CdRegs& r, int sub, int h) {
        const int i = 2 * sub;
        const uint32_t lo = (r.m[0] >> (8 * h + 4 * (i >> 3))) & 0xFu;
        const uint32_t hi = (r.m[1] >> (8 * h + 2 * (i >> 2))) & 3u;
        const float a = half_lo(r.m[2]) * (float)((int)(lo | (hi << 4)) - 32);
        return make_float2(a, -4.0f * a);
    }
};

// The 6-bit scale and min of 32-weight chunk j from Q4_K/Q5_K's 12 packed bytes (meta
// bytes 4..15, here the words m[1..3]).
__device__ __forceinline__ uint32_t k4_byte(const CdRegs& r, int i) {
    const int b = 4 + i;
    const uint32_t w = b < 8 ? r.m[1] : (b < 12 ? r.m[2] : r.m[3]);
    return (w >> (8 * (b & 3))) & 0xFFu;
}

__device__ __forceinline__ float2 k4_affine(const CdRegs& r, int j) {
    uint32_t sc, mn;
    if (j < 4) {
        sc = k4_byte(r, j) & 63u;
        mn = k4_byte(r, j + 4) & 63u;
    } else {
        sc = (k4_byte(r, j + 4) & 0xFu) | ((k4_byte(r, j - 4) >> 6) << 4);
        mn = (k4_byte(r, j + 4) >> 4) | ((k4_byte(r, j) >> 6) << 4);
    }
    return make_float2(half_lo(r.m[0]) * (float)sc, -half_hi(r.m[0]) * (float)mn);
}

// Q4_K: meta = d, dmin, 12 scale bytes; 128 code bytes: chunk 2p + t reads bytes 32p ..
// 32p + 31, low nibbles (t = 0) or high. w = d·sc·q − dmin·m.
struct FmtQ4_K {
    static constexpr int BLOCK = 256, META = 16, QS = 128, QH = 0;
    static __device__ void load(const CdItem& it, size_t blk, int sub, CdRegs& r) {
        const uint4* p = reinterpret_cast<const uint4*>(it.qs + blk * QS + 32 * (sub >> 1));
        r.q[0] = load_stream(p);
        r.q[1] = load_stream(p + 1);
        const uint4 m = __ldg(reinterpret_cast<const uint4*>(it.meta + blk * META));
        r.m[0] = m.x;
        r.m[1] = m.y;
        r.m[2] = m.z;
        r.m[3] = m.w;
    }
    static constexpr int BITS = 4;
    static __device__ uint32_t mant(const CdRegs& r, int sub, int l) {
        return field(r.q, l, 4 * (sub & 1), 4, 23 - BITS);
    }
    static __device__ float2 affine(const CdRegs& r, int sub, int) { return k4_affine(r, sub); }
};

// Q5_K: Q4_K plus 32 bytes of fifth bits (bit `sub` of byte l).
struct FmtQ5_K {
    static constexpr int BLOCK = 256, META = 16, QS = 128, QH = 32;
    static __device__ void load(const CdItem& it, size_t blk, int sub, CdRegs& r) {
        FmtQ4_K::load(it, blk, sub, r);
        const uint4* h = reinterpret_cast<const uint4*>(it.qh + blk * QH);
        r.h[0] = load_stream(h);
        r.h[1] = load_stream(h + 1);
    }
    static constexpr int BITS = 5;
    static __device__ uint32_t mant(const CdRegs& r, int sub, int l) {
        return field(r.q, l, 4 * (sub & 1), 4, 23 - BITS) | field(r.h, l, sub, 1, 22);
    }
    static __device__ float2 affine(const CdRegs& r, int sub, int) { return k4_affine(r, sub); }
};

// Q6_K: meta = 16 signed scales (one per 16 weights), d; 128 low-nibble bytes: chunk 4n + k
// reads bytes 64n + 32·(k & 1) .., high nibbles for k ≥ 2; 64 high-pair bytes: bytes
// 32n .. at bits 2k. w = d·sc·(q − 32).
struct FmtQ6_K {
    static constexpr int BLOCK = 256, META = 18, QS = 128, QH = 64;
    static __device__ void load(const CdItem& it, size_t blk, int sub, CdRegs& r) {
        const int n = sub >> 2, k = sub & 3;
        const uint4* p =
            reinterpret_cast<const uint4*>(it.qs + blk * QS + 64 * n + 32 * (k & 1));
        r.q[0] = load_stream(p);
        r.q[1] = load_stream(p + 1);
        const uint4* h = reinterpret_cast<const uint4*>(it.qh + blk * QH + 32 * n);
        r.h[0] = load_stream(h);
        r.h[1] = load_stream(h + 1);
        const uint8_t* m = it.meta + blk * META;
        r.m[0] = ld_u16(m + 2 * sub);
        r.m[1] = ld_u16(m + 16);
    }
    static constexpr int BITS = 6;
    static __device__ uint32_t mant(const CdRegs& r, int sub, int l) {
        const int k = sub & 3;
        return field(r.q, l, k >= 2 ? 4 : 0, 4, 23 - BITS) | field(r.h, l, 2 * k, 2, 21);
    }
    static __device__ float2 affine(const CdRegs& r, int, int h) {
        const int sc = (int)(signed char)((r.m[0] >> (8 * h)) & 0xFFu);
        const float a = half_lo(r.m[1]) * (float)sc;
        return make_float2(a, -32.0f * a);
    }
};

// Code l of a chunk as f = 1 + q·2^-B: its bits placed at the top of an f32 mantissa of
// exponent 0 (the format's `mant`), so a weight costs a rotate, an AND-OR and the FMA.
template <class F>
__device__ __forceinline__ float code_f(const CdRegs& r, int sub, int l) {
    return __uint_as_float(0x3F800000u | F::mant(r, sub, l));
}

// Σ ŵ·x over one chunk of an affine format, per 16-weight half: a·Σ q·x + b·Σ x, with
// Σ q·x = 2^B·(Σ f·x − Σ x) (the 1 of every f taken out with the half's Σ x, as group.cu does).
template <class F>
__device__ __forceinline__ float affine_dot(const CdRegs& r, int sub, const float (&xv)[CD_CHUNK],
                                            float s0, float s1) {
    constexpr float TWO_B = (float)(1 << F::BITS);
    float acc = 0.0f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float a = 0.0f, b = 0.0f;
#pragma unroll
        for (int l = 0; l < 16; l += 2) {
            a = fmaf(code_f<F>(r, sub, 16 * h + l), xv[16 * h + l], a);
            b = fmaf(code_f<F>(r, sub, 16 * h + l + 1), xv[16 * h + l + 1], b);
        }
        const float2 ab = F::affine(r, sub, h);
        const float scale = ab.x * TWO_B;
        acc = fmaf(scale, a + b, fmaf(ab.y - scale, h ? s1 : s0, acc));
    }
    return acc;
}

// The GGUF formats as the body sees them: chunk c of a row lies in block c / CPB.
template <class F>
struct Gguf {
    static constexpr bool TABLE = false;
    static constexpr int ENTRIES = 0;
    // The K-quants with high-bit planes hold 80 bytes of registers a chunk: one in flight.
    static constexpr int UNROLL = F::QH >= 32 ? 1 : CD_UNROLL;
    static constexpr int CPB = F::BLOCK / CD_CHUNK;
    static __device__ __forceinline__ void load(const CdItem& it, int row, int c, int bpr,
                                                CdRegs& r) {
        F::load(it, (size_t)row * bpr + c / CPB, c % CPB, r);
    }
    static __device__ __forceinline__ float dot(const CdRegs& r, int c, const float* /*tab*/,
                                                const float (&xv)[CD_CHUNK], float s0,
                                                float s1) {
        return affine_dot<F>(r, c % CPB, xv, s0, s1);
    }
    // The chunk's 32 weights (prefill panels, embedding rows).
    static __device__ __forceinline__ void dequant(const CdItem& it, int row, int c, int bpr,
                                                   float* __restrict__ dst) {
        // q = (f − 1)·2^B exactly: the matvec's code → float step, without its Σ x fold.
        constexpr float TWO_B = (float)(1 << F::BITS);
        CdRegs r;
        load(it, row, c, bpr, r);
        const int sub = c % CPB;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float2 ab = F::affine(r, sub, h);
#pragma unroll
            for (int l = 0; l < 16; l += 4) {
                float v[4];
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    v[e] = fmaf(ab.x, (code_f<F>(r, sub, 16 * h + l + e) - 1.0f) * TWO_B, ab.y);
                reinterpret_cast<float4*>(dst)[(16 * h + l) / 4] =
                    make_float4(v[0], v[1], v[2], v[3]);
            }
        }
    }
};

// Look-up-table codes: 32 B-bit codes a chunk in B words (a row's codes are one bit stream,
// as group codes with the group spanning the row), each indexing the row's table of 2^B
// values (f32, the row scale already multiplied in).
template <int B>
struct Lut {
    static constexpr bool TABLE = true;
    static constexpr int UNROLL = CD_UNROLL;
    static constexpr int ENTRIES = 1 << B;
    static __device__ __forceinline__ void load(const CdItem& it, int row, int c, int bpr,
                                                CdRegs& r) {
        // bpr is the row's byte count for these codes.
        uint32_t w[B];
        load_codes<B>(it.qs + (size_t)row * bpr + (size_t)c * (CD_CHUNK * B / 8), w);
#pragma unroll
        for (int k = 0; k < B; ++k) r.m[k] = w[k];
    }
    static __device__ __forceinline__ uint32_t code(const CdRegs& r, int i) {
        const int bit = B * i, word = bit >> 5, off = bit & 31;
        const uint32_t v = off + B <= 32 ? (r.m[word] >> off)
                                         : __funnelshift_r(r.m[word], r.m[word + 1], off);
        return v & (ENTRIES - 1);
    }
    static __device__ __forceinline__ float dot(const CdRegs& r, int, const float* tab,
                                                const float (&xv)[CD_CHUNK], float, float) {
        float a = 0.0f, b = 0.0f;
#pragma unroll
        for (int i = 0; i < CD_CHUNK; i += 2) {
            a = fmaf(tab[code(r, i)], xv[i], a);
            b = fmaf(tab[code(r, i + 1)], xv[i + 1], b);
        }
        return a + b;
    }
    static __device__ __forceinline__ void dequant(const CdItem& it, int row, int c, int bpr,
                                                   float* __restrict__ dst) {
        CdRegs r;
        load(it, row, c, bpr, r);
        const float* tab = reinterpret_cast<const float*>(it.meta) + (size_t)row * ENTRIES;
#pragma unroll
        for (int i = 0; i < CD_CHUNK; i += 4) {
            reinterpret_cast<float4*>(dst)[i / 4] =
                make_float4(__ldg(tab + code(r, i)), __ldg(tab + code(r, i + 1)),
                            __ldg(tab + code(r, i + 2)), __ldg(tab + code(r, i + 3)));
        }
    }
};

// One launch covers up to three projections of one x (q, k, v), or gate and up with SwiGLU
// applied to each row pair (SWIGLU: item 0 gate, item 1 up, output to item 0's y); with NORM,
// x is the raw residual stream, RMS-normalised while it is staged.
template <class F, int R, bool NORM, bool SWIGLU>
__device__ __forceinline__ void cd_matvec_body(const CdGroup& g, const float* __restrict__ x,
                                               const float* __restrict__ nw, float eps,
                                               int cols, int bpr, int tpr, int accumulate) {
    constexpr int NR = SWIGLU ? 2 * R : R;
    extern __shared__ __align__(16) float cd_smem[];
    __shared__ float red[CD_WARPS][NR];
    __shared__ float ss_red[CD_WARPS];
    __shared__ __align__(16) float tabs[F::TABLE ? CD_LUT_ROWS * 16 : 1];

    CdItem item = g.item[0];
    int first_block = 0;
    if (!SWIGLU) {
#pragma unroll
        for (int k = 1; k < CD_MAX_ITEMS; ++k) {
            if (k < g.count && (int)blockIdx.x >= g.item[k - 1].block_end) {
                item = g.item[k];
                first_block = g.item[k - 1].block_end;
            }
        }
    }
    SFX_PDL_TRIGGER();
    const int chunks = cols / CD_CHUNK;
    const int sets = CD_THREADS / tpr, set = threadIdx.x / tpr, sub = threadIdx.x % tpr;
    const int block_rows = sets * R;
    const int tile0 = ((int)blockIdx.x - first_block) * block_rows;
    const int row0 = tile0 + set * R;

    int rows[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) rows[r] = min(row0 + r % R, item.rows - 1);
    auto item_of = [&](int r) -> const CdItem& { return (SWIGLU && r >= R) ? g.item[1] : item; };

    // The block's rows' tables (look-up-table codes), gate rows then up rows.
    if constexpr (F::TABLE) {
        constexpr int E = F::ENTRIES;
        for (int k = 0; k < (SWIGLU ? 2 : 1); ++k) {
            const CdItem& it = k == 1 ? g.item[1] : item;
            const float* src = reinterpret_cast<const float*>(it.meta);
            for (int i = threadIdx.x; i < block_rows * E; i += CD_THREADS) {
                const int row = min(tile0 + i / E, it.rows - 1);
                tabs[(k * block_rows) * E + i] = __ldg(src + (size_t)row * E + i % E);
            }
        }
    }

    CdRegs regs[F::UNROLL][NR];
    auto fetch = [&](int base) {
#pragma unroll
        for (int j = 0; j < F::UNROLL; ++j) {
            const int c = base + j * tpr;
            if (c < chunks) {
#pragma unroll
                for (int r = 0; r < NR; ++r) F::load(item_of(r), rows[r], c, bpr, regs[j][r]);
            }
        }
    };
    // Weights are never written: their loads go out before x is read.
    int base = sub;
    fetch(base);
    SFX_PDL_WAIT();

    const int t = blockIdx.y;
    const float* xt = x + (size_t)t * cols;
    float* xs = cd_smem;                   // [CD_PAD(cols)]
    float* xsum = cd_smem + CD_PAD(cols);  // [cols / 16]: sums of 16 columns
    stage_x<NORM, CD_THREADS>(xt, nw, cols, xs, ss_red);
    __syncthreads();
    if constexpr (!F::TABLE) stage_sums<16, CD_THREADS>(xs, xsum, cols / 16);
    const float scale = norm_scale<NORM, CD_WARPS>(ss_red, cols, eps);
    __syncthreads();

    const float* tab[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        const int k = (SWIGLU && r >= R) ? 1 : 0;
        tab[r] = tabs + (k * block_rows + set * R + r % R) * (F::TABLE ? F::ENTRIES : 0);
    }
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = 0.0f;
    while (base < chunks) {
#pragma unroll
        for (int j = 0; j < F::UNROLL; ++j) {
            const int c = base + j * tpr;
            if (c < chunks) {
                float xv[CD_CHUNK];
                chunk_x(xs, c, xv);
                const float s0 = F::TABLE ? 0.0f : xsum[2 * c];
                const float s1 = F::TABLE ? 0.0f : xsum[2 * c + 1];
#pragma unroll
                for (int r = 0; r < NR; ++r) acc[r] += F::dot(regs[j][r], c, tab[r], xv, s0, s1);
            }
        }
        base += F::UNROLL * tpr;
        if (base < chunks) fetch(base);
    }

    auto emit = [&](int st, int r, float total, float up_total) {
        const int out_row = tile0 + st * R + r;
        if (out_row >= item.rows) return;
        projection_out<SWIGLU>(item.y + (size_t)t * item.rows + out_row, total, up_total, scale,
                               item.bias, out_row, accumulate);
    };
    reduce_rows<R, NR, SWIGLU, CD_THREADS>(acc, tpr, red, emit);
}

// One thread per (row, 32-column chunk): the f32 panel prefill's GEMM reads.
template <class F>
__device__ void cd_dequant_body(const CdItem& it, float* __restrict__ out, int cols, int bpr) {
    const int chunks = cols / CD_CHUNK;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)it.rows * chunks) return;
    const int r = (int)(i / chunks), c = (int)(i % chunks);
    F::dequant(it, r, c, bpr, out + (size_t)r * cols + (size_t)c * CD_CHUNK);
}

// Embedding rows by token id (a tied embedding reads the head's blocks): one thread per
// (token, chunk); an id past the table yields zeros (the host checks ids first).
template <class F>
__device__ void cd_gather_body(const CdItem& it, const uint32_t* __restrict__ tokens,
                               float* __restrict__ out, int cols, int bpr) {
    SFX_PDL_TRIGGER();
    const int chunks = cols / CD_CHUNK;
    const int c = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (c >= chunks) return;
    float* dst = out + (size_t)t * cols + (size_t)c * CD_CHUNK;
    const uint32_t r = tokens[t];
    if (r >= (uint32_t)it.rows) {
#pragma unroll
        for (int k = 0; k < CD_CHUNK; ++k) dst[k] = 0.0f;
        return;
    }
    F::dequant(it, (int)r, c, bpr, dst);
}

// `bpr`: blocks per row (GGUF) or bytes per row (look-up-table codes).
#define SFX_CD_FORMAT(NAME, FMT)                                                              \
    extern "C" __global__ void __launch_bounds__(CD_THREADS, 2)                               \
        cd_matvec_##NAME##_r1(const CdGroup g, const float* x, int cols, int bpr, int tpr,    \
                              int accumulate) {                                               \
        cd_matvec_body<FMT, 1, false, false>(g, x, nullptr, 0.0f, cols, bpr, tpr, accumulate); \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(CD_THREADS, 2)                               \
        cd_matvec_##NAME##_r2(const CdGroup g, const float* x, int cols, int bpr, int tpr,    \
                              int accumulate) {                                               \
        cd_matvec_body<FMT, 2, false, false>(g, x, nullptr, 0.0f, cols, bpr, tpr, accumulate); \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(CD_THREADS, 2)                               \
        cd_matvec_norm_##NAME##_r1(const CdGroup g, const float* x, const float* nw,          \
                                   float eps, int cols, int bpr, int tpr) {                   \
        cd_matvec_body<FMT, 1, true, false>(g, x, nw, eps, cols, bpr, tpr, 0);                \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(CD_THREADS, 2)                               \
        cd_matvec_norm_##NAME##_r2(const CdGroup g, const float* x, const float* nw,          \
                                   float eps, int cols, int bpr, int tpr) {                   \
        cd_matvec_body<FMT, 2, true, false>(g, x, nw, eps, cols, bpr, tpr, 0);                \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(CD_THREADS, 2)                               \
        cd_swiglu_##NAME(const CdGroup g, const float* x, int cols, int bpr, int tpr) {       \
        cd_matvec_body<FMT, 1, false, true>(g, x, nullptr, 0.0f, cols, bpr, tpr, 0);         \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(CD_THREADS, 2)                               \
        cd_swiglu_norm_##NAME(const CdGroup g, const float* x, const float* nw, float eps,    \
                              int cols, int bpr, int tpr) {                                   \
        cd_matvec_body<FMT, 1, true, true>(g, x, nw, eps, cols, bpr, tpr, 0);                 \
    }                                                                                         \
    extern "C" __global__ void cd_dequant_f32_##NAME(const CdItem it, float* out, int cols,   \
                                                     int bpr) {                               \
        cd_dequant_body<FMT>(it, out, cols, bpr);                                             \
    }                                                                                         \
    extern "C" __global__ void cd_gather_f32_##NAME(const CdItem it, const uint32_t* tokens,  \
                                                    float* out, int cols, int bpr) {          \
        cd_gather_body<FMT>(it, tokens, out, cols, bpr);                                      \
    }

SFX_CD_FORMAT(lut2, Lut<2>)
SFX_CD_FORMAT(lut3, Lut<3>)
SFX_CD_FORMAT(lut4, Lut<4>)
SFX_CD_FORMAT(q4_0, Gguf<FmtQ4_0>)
SFX_CD_FORMAT(q4_1, Gguf<FmtQ4_1>)
SFX_CD_FORMAT(q5_0, Gguf<FmtQ5_0>)
SFX_CD_FORMAT(q5_1, Gguf<FmtQ5_1>)
SFX_CD_FORMAT(q8_0, Gguf<FmtQ8_0>)
SFX_CD_FORMAT(q2_k, Gguf<FmtQ2_K>)
SFX_CD_FORMAT(q3_k, Gguf<FmtQ3_K>)
SFX_CD_FORMAT(q4_k, Gguf<FmtQ4_K>)
SFX_CD_FORMAT(q5_k, Gguf<FmtQ5_K>)
SFX_CD_FORMAT(q6_k, Gguf<FmtQ6_K>)

// Group-quantized weights (2 and 4 bits) on tensor cores: the batch-1 matrix–vector products
// of decode over codes re-laid out at load time into mma.sync m16n8k16 fragment order, their
// packing kernels, and the f32 dequantization prefill feeds to its GEMM.
//
// Why tensor cores for a matrix–vector product: at 2–4 bits a matvec on CUDA cores is bound
// by instructions per weight (the previous kernel, group.cu, measured ~6 per weight and a
// quarter of the bandwidth). An MMA takes 256 weights per warp instruction, so what remains
// per weight is unpacking: one shift and one logical op give two codes as bf16 128 + q (the
// code in the low mantissa bits of 128.0), one bf16x2 subtraction of 128 + z makes them the
// exact integers q − z. x enters as three bf16 columns of the B operand, x = x₀ + x₁ + x₂
// (8 + 8 + 8 mantissa bits: f32 x exactly), so with exact integer weights and f32
// accumulation the product is an f32 product, as on the CPU; the f16 scale multiplies each
// group's f32 partial sum. Columns 3..7 of the output are dropped (one token per block).
//
// Fragment layouts (PTX ISA, m16n8k16 bf16): lane = 4·g + t. A (16×16, row): a0 = (g,
// 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..). B (16×8, col): b0 = (k
// 2t..2t+1, n g), b1 = (k 2t+8.., n g). C (16×8 f32): c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, ..).
//
// Tile layout (docs/format.md, "CUDA tile layout"). Rows are cut into 16-row tiles and columns
// into 32-column chunks (two k-steps). For each (tile, chunk, lane) the lane's 16 codes — its
// four A registers of both k-steps, pair p = 4·ks + a holding the codes of k and k+1 — form
// B/2 words: pair p at bits B·j and 16 + B·j of word p / (16/B), j = p mod (16/B). A lane's
// words of 8/B consecutive chunks (a super-chunk: 128 columns at 2 bits, 64 at 4) are one
// 16-byte load, the warp's 512 bytes contiguous:
//   word ((tile · n_sc + sc) · 32 + lane) · 4 + (chunk mod (8/B)) · (B/2) + i.
// At 3 bits a super-chunk is a whole 128-column unit, 24 bytes a lane (tile3_word): the
// warp's first 512 bytes hold words 0..3 of each lane, the next 256 words 4..5, so a lane
// loads 16 + 8 bytes. Its chunks go in pairs, three words a pair; the two registers of rows g
// and g + 8 that share columns (a = 2h, 2h + 1: a couple) have their codes in one 6-bit field
// per column, row g's code in bits 0..2 and row g + 8's in bits 3..5 (unpack_b3 reads rows
// g + 8 eight times too large, as 2 bits read them four times), the field of column k in the
// low half-word and of k + 1 sixteen bits above. Six of a pair's eight couples sit whole in
// one word at bit 0 or 6; the other two fill bits 12..15 (+16) of the three words, four bits
// of the field in word 0 or 1 and two in word 2 (tile3_couple).
// Scales and zero points: per (tile, group, g) two words (rows g and g+8), each the f16 scale
// bits | (bf16 bits of 128 + z) << 16. Rows and columns past the matrix are zero codes with
// zero scales (their x is zero, their outputs are not written).
#include "common.cuh"
#include "refine_epilogue.cuh"

#define GT_MAX_ITEMS 3

struct GtItem {
    const uint4* codes;      // tile layout
    const uint2* scale_zero; // [tiles, gpr, 8] (row g, row g + 8)
    const float* bias;       // [rows] or null
    float* y;                // [m, rows]
    int rows;
    int block_end;           // exclusive end of this item's blocks in the grid
    RefineOp refine;         // a decode row's refinement (refine.sel null: none)
};

struct GtGroup {
    GtItem item[GT_MAX_ITEMS];
    int count;
};

// Packing (any architecture): file layout → tile layout.
template <int B>
__device__ __forceinline__ uint32_t file_code(const uint8_t* codes, int row_bytes, int rows,
                                              int cols, int r, int k) {
    if (r >= rows || k >= cols) return 0;
    const int bit = k * B;
    const uint8_t* at = codes + (size_t)r * row_bytes + (bit >> 3);
    // A 3-bit code may straddle two bytes (never past the row's last byte: it would then end
    // in the byte it starts in).
    const uint32_t v = (bit & 7) + B > 8 ? at[0] | (uint32_t)at[1] << 8 : at[0];
    return (v >> (bit & 7)) & ((1u << B) - 1);
}

// Bytes of a lane's share of one super-chunk (16 at 2 and 4 bits, 24 at 3) and of the warp's.
template <int B>
struct GtSuper {
    static constexpr int LANE_BYTES = B == 3 ? 24 : 16;
    static constexpr int BYTES = 32 * LANE_BYTES;
    static constexpr int CHUNKS = B == 4 ? 2 : 4;  // 32-column chunks in one
};

// u32 index of word i (0..5) of a lane inside a 3-bit super-chunk.
__device__ __forceinline__ int tile3_word(int lane, int i) {
    return i < 4 ? lane * 4 + i : 128 + lane * 2 + (i - 4);
}

// Couple j (0..7) of a chunk pair whose words are w[0..2], as one word: row g's codes at bits
// 0..2 (column k) and 16..18 (column k + 1), row g + 8's at 3..5 and 19..21.
__device__ __forceinline__ uint32_t tile3_couple(const uint32_t* w, int j) {
    if (j < 6) return w[j >> 1] >> (6 * (j & 1));
    const uint32_t head = w[j - 6] >> 12, tail = w[2] >> (j == 6 ? 8 : 10);
    return (head & 0x000F000Fu) | (tail & ~0x000F000Fu);
}

// Couple of pair p = 4·ks + a (either register of it) of chunk ci (0, 1) of a pair.
__device__ __forceinline__ int tile3_couple_of(int ci, int p) {
    return 4 * ci + 2 * (p >> 2) + ((p & 3) >> 1);
}

template <int B>
__device__ void pack_codes_body(const uint8_t* __restrict__ codes, uint32_t* __restrict__ out,
                                int rows, int cols, int row_bytes, int n_sc) {
    constexpr int CHUNKS = 8 / B, WORDS = B / 2, PER_WORD = 16 / B;
    const int chunks_pad = n_sc * CHUNKS;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int tiles = (rows + 15) / 16;
    if (i >= (size_t)tiles * chunks_pad * 32) return;
    const int lane = (int)(i % 32), c = (int)(i / 32 % chunks_pad), tile = (int)(i / 32 / chunks_pad);
    const int g = lane >> 2, t = lane & 3;
    uint32_t w[WORDS] = {};
#pragma unroll
    for (int p = 0; p < 8; ++p) {
        const int ks = p >> 2, a = p & 3;
        const int r = tile * 16 + g + (a & 1) * 8;
        const int k = c * 32 + ks * 16 + 2 * t + (a >> 1) * 8;
        const uint32_t lo = file_code<B>(codes, row_bytes, rows, cols, r, k);
        const uint32_t hi = file_code<B>(codes, row_bytes, rows, cols, r, k + 1);
        const int j = p % PER_WORD;
        w[p / PER_WORD] |= (lo << (B * j)) | (hi << (16 + B * j));
    }
    const int sc = c / CHUNKS, sub = c % CHUNKS;
    uint32_t* dst = out + (((size_t)tile * n_sc + sc) * 32 + lane) * 4 + sub * WORDS;
#pragma unroll
    for (int k = 0; k < WORDS; ++k) dst[k] = w[k];
}

extern "C" __global__ void gt_pack_codes_b2(const uint8_t* codes, uint32_t* out, int rows,
                                            int cols, int row_bytes, int n_sc) {
    pack_codes_body<2>(codes, out, rows, cols, row_bytes, n_sc);
}

extern "C" __global__ void gt_pack_codes_b4(const uint8_t* codes, uint32_t* out, int rows,
                                            int cols, int row_bytes, int n_sc) {
    pack_codes_body<4>(codes, out, rows, cols, row_bytes, n_sc);
}

// 3 bits: one thread per (tile, chunk pair, lane) writes the pair's three words.
extern "C" __global__ void gt_pack_codes_b3(const uint8_t* __restrict__ codes,
                                            uint32_t* __restrict__ out, int rows, int cols,
                                            int row_bytes, int n_sc) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int tiles = (rows + 15) / 16;
    if (i >= (size_t)tiles * n_sc * 2 * 32) return;
    const int lane = (int)(i % 32), pair = (int)(i / 32 % (2 * n_sc));
    const int tile = (int)(i / 32 / (2 * n_sc));
    const int g = lane >> 2, t = lane & 3;
    uint32_t w[3] = {0, 0, 0};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int ci = j >> 2, ks = (j >> 1) & 1, h = j & 1;
        const int k = (2 * pair + ci) * 32 + ks * 16 + 2 * t + h * 8;
        const int r = tile * 16 + g;
        // The couple's fields: column k low, k + 1 high; row g in bits 0..2, g + 8 in 3..5.
        const uint32_t lo = file_code<3>(codes, row_bytes, rows, cols, r, k) |
                            file_code<3>(codes, row_bytes, rows, cols, r + 8, k) << 3;
        const uint32_t hi = file_code<3>(codes, row_bytes, rows, cols, r, k + 1) |
                            file_code<3>(codes, row_bytes, rows, cols, r + 8, k + 1) << 3;
        if (j < 6) {
            w[j >> 1] |= (lo | hi << 16) << (6 * (j & 1));
        } else {
            w[j - 6] |= ((lo & 0xF) | (hi & 0xF) << 16) << 12;
            w[2] |= ((lo >> 4) | (hi >> 4) << 16) << (j == 6 ? 12 : 14);
        }
    }
    uint32_t* dst = out + ((size_t)tile * n_sc + pair / 2) * (GtSuper<3>::BYTES / 4);
#pragma unroll
    for (int k = 0; k < 3; ++k) dst[tile3_word(lane, 3 * (pair & 1) + k)] = w[k];
}

// One thread per (tile, group, g).
extern "C" __global__ void gt_pack_scales(const uint16_t* __restrict__ scales,
                                          const uint8_t* __restrict__ zeros,
                                          uint2* __restrict__ out, int rows, int gpr) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int tiles = (rows + 15) / 16;
    if (i >= (size_t)tiles * gpr * 8) return;
    const int g = (int)(i % 8), gi = (int)(i / 8 % gpr), tile = (int)(i / 8 / gpr);
    uint32_t v[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = tile * 16 + g + 8 * h;
        v[h] = r < rows ? (uint32_t)scales[(size_t)r * gpr + gi] |
                              ((0x4300u | zeros[(size_t)r * gpr + gi]) << 16)
                        : 0u;
    }
    out[i] = make_uint2(v[0], v[1]);
}

// The 16 codes a lane holds for one chunk of a tile (any width): pair p = 4·ks + a, its code
// of column k (e = 0) or k + 1 (e = 1).
template <int B>
struct LaneCodes {
    static constexpr int WORDS = B == 3 ? 3 : B / 2;
    uint32_t w[WORDS];

    __device__ __forceinline__ LaneCodes(const uint32_t* __restrict__ codes, int tile, int n_sc,
                                         int c, int lane) {
        constexpr int CHUNKS = GtSuper<B>::CHUNKS;
        const int sc = c / CHUNKS, sub = c % CHUNKS;
        const uint32_t* src = codes + ((size_t)tile * n_sc + sc) * (GtSuper<B>::BYTES / 4);
#pragma unroll
        for (int k = 0; k < WORDS; ++k) {
            w[k] = B == 3 ? src[tile3_word(lane, 3 * (sub >> 1) + k)] : src[lane * 4 + sub * WORDS + k];
        }
    }

    __device__ __forceinline__ uint32_t code(int c, int p, int e) const {
        if (B == 3) {
            const uint32_t m = tile3_couple(w, tile3_couple_of(c & 1, p));
            return (m >> (16 * e + 3 * (p & 1))) & 7u;
        }
        constexpr int PER_WORD = 16 / B;
        return (w[p / PER_WORD] >> (16 * e + B * (p % PER_WORD))) & ((1u << B) - 1);
    }
};

// Prefill: one thread per (tile, chunk, lane) writes its 16 weights (q − z)·s as f32.
template <int B>
__device__ void tile_dequant_body(const uint32_t* __restrict__ codes,
                                  const uint2* __restrict__ sz, float* __restrict__ out,
                                  int rows, int cols, int n_sc, int gpr, int group) {
    const int chunks = cols / 32;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int tiles = (rows + 15) / 16;
    if (i >= (size_t)tiles * chunks * 32) return;
    const int lane = (int)(i % 32), c = (int)(i / 32 % chunks), tile = (int)(i / 32 / chunks);
    const int g = lane >> 2, t = lane & 3;
    const LaneCodes<B> lc(codes, tile, n_sc, c, lane);
    const uint2 szw = sz[((size_t)tile * gpr + (c * 32) / group) * 8 + g];
#pragma unroll
    for (int p = 0; p < 8; ++p) {
        const int ks = p >> 2, a = p & 3;
        const int r = tile * 16 + g + (a & 1) * 8;
        if (r >= rows) continue;
        const uint32_t word = (a & 1) ? szw.y : szw.x;
        const float s = __half2float(__ushort_as_half((unsigned short)(word & 0xffff)));
        const float z = (float)((word >> 16) & 0x7f);
        const int k = c * 32 + ks * 16 + 2 * t + (a >> 1) * 8;
        const float lo = (float)lc.code(c, p, 0), hi = (float)lc.code(c, p, 1);
        *reinterpret_cast<float2*>(out + (size_t)r * cols + k) =
            make_float2((lo - z) * s, (hi - z) * s);
    }
}

extern "C" __global__ void gt_dequant_f32_b2(const uint32_t* codes, const uint2* sz, float* out,
                                             int rows, int cols, int n_sc, int gpr, int group) {
    tile_dequant_body<2>(codes, sz, out, rows, cols, n_sc, gpr, group);
}

extern "C" __global__ void gt_dequant_f32_b3(const uint32_t* codes, const uint2* sz, float* out,
                                             int rows, int cols, int n_sc, int gpr, int group) {
    tile_dequant_body<3>(codes, sz, out, rows, cols, n_sc, gpr, group);
}

extern "C" __global__ void gt_dequant_f32_b4(const uint32_t* codes, const uint2* sz, float* out,
                                             int rows, int cols, int n_sc, int gpr, int group) {
    tile_dequant_body<4>(codes, sz, out, rows, cols, n_sc, gpr, group);
}

// Embedding lookup from tile-layout codes (a tied embedding reads the head's codes): one
// thread per (token, chunk, t): lane 4·(r mod 8) + t holds row r's pairs in its registers
// a ≡ ⌊(r mod 16) / 8⌋ (mod 2), eight columns per thread. An id past the table yields zeros.
template <int B>
__device__ void tile_gather_body(const uint32_t* __restrict__ codes,
                                 const uint2* __restrict__ sz,
                                 const uint32_t* __restrict__ tokens, float* __restrict__ out,
                                 int rows, int cols, int n_sc, int gpr, int group) {
    SFX_PDL_TRIGGER();
    const int chunks = cols / 32;
    const int i = blockIdx.x * blockDim.x + threadIdx.x, tok = blockIdx.y;
    if (i >= chunks * 4) return;
    const int c = i >> 2, t = i & 3;
    const uint32_t r = tokens[tok];
    float* dst = out + (size_t)tok * cols + c * 32;
    if (r >= (uint32_t)rows) {
#pragma unroll
        for (int a = 0; a < 2; ++a)
#pragma unroll
            for (int ks = 0; ks < 2; ++ks)
                *reinterpret_cast<float2*>(dst + ks * 16 + 2 * t + a * 8) = make_float2(0.f, 0.f);
        return;
    }
    const int tile = (int)(r >> 4), g = (int)(r & 7), hi = (int)((r >> 3) & 1);
    const LaneCodes<B> lc(codes, tile, n_sc, c, 4 * g + t);
    const uint2 szw = sz[((size_t)tile * gpr + (c * 32) / group) * 8 + g];
    const uint32_t word = hi ? szw.y : szw.x;
    const float s = __half2float(__ushort_as_half((unsigned short)(word & 0xffff)));
    const float z = (float)((word >> 16) & 0x7f);
#pragma unroll
    for (int p = 0; p < 8; ++p) {
        const int ks = p >> 2, a = p & 3;
        if ((a & 1) != hi) continue;
        const float lo = (float)lc.code(c, p, 0), hv = (float)lc.code(c, p, 1);
        *reinterpret_cast<float2*>(dst + ks * 16 + 2 * t + (a >> 1) * 8) =
            make_float2((lo - z) * s, (hv - z) * s);
    }
}

extern "C" __global__ void gt_gather_f32_b2(const uint32_t* codes, const uint2* sz,
                                            const uint32_t* tokens, float* out, int rows,
                                            int cols, int n_sc, int gpr, int group) {
    tile_gather_body<2>(codes, sz, tokens, out, rows, cols, n_sc, gpr, group);
}

extern "C" __global__ void gt_gather_f32_b3(const uint32_t* codes, const uint2* sz,
                                            const uint32_t* tokens, float* out, int rows,
                                            int cols, int n_sc, int gpr, int group) {
    tile_gather_body<3>(codes, sz, tokens, out, rows, cols, n_sc, gpr, group);
}

extern "C" __global__ void gt_gather_f32_b4(const uint32_t* codes, const uint2* sz,
                                            const uint32_t* tokens, float* out, int rows,
                                            int cols, int n_sc, int gpr, int group) {
    tile_gather_body<4>(codes, sz, tokens, out, rows, cols, n_sc, gpr, group);
}

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// (v & MASK) | magic in one LOP3 (given two immediates, the compiler emits two).
template <uint32_t MASK>
__device__ __forceinline__ uint32_t mask_or(uint32_t v, uint32_t magic) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(v), "n"(MASK), "r"(magic));
    return r;
}

// bf16x2 a − b (exact here: both are integers + 128 below 256).
__device__ __forceinline__ uint32_t bf16x2_sub(uint32_t a, uint32_t b) {
    const __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                     *reinterpret_cast<const __nv_bfloat162*>(&b));
    return *reinterpret_cast<const uint32_t*>(&r);
}

// 3 bits (tile3_couple): row g's register of a couple is its field's low three bits, row
// g + 8's the high three, read as 128 + 8q; with zz1 = 128 + 8z (`zero_x8`) the weights are the
// exact integers 8(q − z), and the caller scales rows g + 8 by 1/8. `w` are the three words of
// chunk `sub`'s pair.
__device__ __forceinline__ void unpack_b3(const uint32_t* w, int sub, int ks, uint32_t zz0,
                                          uint32_t zz1, uint32_t (&a)[4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const uint32_t m = tile3_couple(w, tile3_couple_of(sub & 1, 4 * ks + 2 * h));
        a[2 * h] = bf16x2_sub(mask_or<0x00070007u>(m, 0x43004300u), zz0);
        a[2 * h + 1] = bf16x2_sub(mask_or<0x00380038u>(m, 0x43004300u), zz1);
    }
}

// The A registers of k-step ks of a chunk whose codes are `w` (B/2 words), with 128 + z of
// rows g (zz0) and g + 8 (zz1) duplicated in both halves.
//
// At 2 bits rows g + 8 are unpacked four times too large: pair p + 1 (odd p: a row g + 8
// register) lies two bits above pair p, so one shift serves both and the mask 0xC picks
// 128 + 4q; with zz1 = 128 + 4z (`zero_x4`) the weights are the exact integers 4(q − z), and
// the caller scales rows g + 8 by 1/4 (exact). One shift per two registers instead of one
// each.
template <int B>
__device__ __forceinline__ void unpack_a(const uint32_t* w, int ks, uint32_t zz0, uint32_t zz1,
                                         uint32_t (&a)[4]) {
    constexpr int PER_WORD = 16 / B;
    constexpr uint32_t MASK = ((1u << B) - 1) * 0x10001u;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int p = 4 * ks + r;
        if (B == 2) {
            const uint32_t v = w[0] >> (2 * (p & ~1));
            a[r] = (r & 1) ? bf16x2_sub(mask_or<0x000C000Cu>(v, 0x43004300u), zz1)
                           : bf16x2_sub(mask_or<0x00030003u>(v, 0x43004300u), zz0);
        } else {
            const uint32_t v = w[p / PER_WORD] >> (B * (p % PER_WORD));
            a[r] = bf16x2_sub(mask_or<MASK>(v, 0x43004300u), (r & 1) ? zz1 : zz0);
        }
    }
}

// 128 + z (bf16x2) → 128 + 4z: 4·(128 + z) − 384, exact (integers below 512, even above 256).
__device__ __forceinline__ uint32_t zero_x4(uint32_t zz) {
    const __nv_bfloat162 r = __hfma2(*reinterpret_cast<const __nv_bfloat162*>(&zz),
                                     __float2bfloat162_rn(4.0f), __float2bfloat162_rn(-384.0f));
    return *reinterpret_cast<const uint32_t*>(&r);
}

// 128 + z (bf16x2) → 128 + 8z: 8·(128 + z) − 896, exact (z below 128: integers below 1152,
// multiples of 8 above 1024).
__device__ __forceinline__ uint32_t zero_x8(uint32_t zz) {
    const __nv_bfloat162 r = __hfma2(*reinterpret_cast<const __nv_bfloat162*>(&zz),
                                     __float2bfloat162_rn(8.0f), __float2bfloat162_rn(-896.0f));
    return *reinterpret_cast<const uint32_t*>(&r);
}

// What rows g + 8 of a tile are scaled by beyond their group scale (unpack_a, unpack_b3).
template <int B>
struct HiRowScale {
    static constexpr float VALUE = B == 2 ? 0.25f : B == 3 ? 0.125f : 1.0f;
};

// x ⊙ w (with NORM) over columns [c0, c0 + pcols) split into three bf16 planes in shared
// memory, columns past `cols` zero; returns this thread's partial sum of x² (NORM).
template <bool NORM, int THREADS>
__device__ __forceinline__ float stage_planes(const float* __restrict__ xt,
                                              const float* __restrict__ nw, uint32_t* planes,
                                              int cols, int c0, int pcols, int pstride) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < pcols / 2; i += THREADS) {
        const int c = c0 + 2 * i;
        float v[2] = {0.0f, 0.0f};
        if (c < cols) {  // cols is a multiple of 32
            const float2 xv = __ldg(reinterpret_cast<const float2*>(xt + c));
            v[0] = xv.x;
            v[1] = xv.y;
            if (NORM) {
                const float2 wv = __ldg(reinterpret_cast<const float2*>(nw + c));
                ss = fmaf(v[0], v[0], ss);
                ss = fmaf(v[1], v[1], ss);
                v[0] *= wv.x;
                v[1] *= wv.y;
            }
        }
        uint32_t h[3];
        __nv_bfloat16 p0[2], p1[2], p2[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            p0[e] = __float2bfloat16_rn(v[e]);
            const float r1 = v[e] - __bfloat162float(p0[e]);
            p1[e] = __float2bfloat16_rn(r1);
            p2[e] = __float2bfloat16_rn(r1 - __bfloat162float(p1[e]));
        }
        h[0] = (uint32_t)__bfloat16_as_ushort(p0[0]) | ((uint32_t)__bfloat16_as_ushort(p0[1]) << 16);
        h[1] = (uint32_t)__bfloat16_as_ushort(p1[0]) | ((uint32_t)__bfloat16_as_ushort(p1[1]) << 16);
        h[2] = (uint32_t)__bfloat16_as_ushort(p2[0]) | ((uint32_t)__bfloat16_as_ushort(p2[1]) << 16);
#pragma unroll
        for (int k = 0; k < 3; ++k) planes[k * pstride + i] = h[k];
    }
    return ss;
}

// A warp's unit of work: 128 columns of every tile of its block, one group's scale at most
// (groups are 2ⁿ units, checked at upload): SPU super-chunks (1 at 2 and 3 bits, 2 at 4), so
// every width amortises a unit's waits, copies, scales and loop over the same eight MMAs per
// tile.
template <int B>
struct GtUnit {
    static constexpr int SPU = B == 4 ? 2 : 1;  // super-chunks per unit
    static constexpr int CHUNKS = 4;            // 32-column chunks per unit
};

// Bytes of one warp's ring slot: the codes of NT tiles (SPU super-chunks each), then their
// scale/zero words (8 B per lane each).
template <int B, int NT>
struct GtSlot {
    static constexpr int CODE_BYTES = NT * GtSuper<B>::BYTES * GtUnit<B>::SPU;
    static constexpr int BYTES = CODE_BYTES + NT * 32 * 8;
};

// A block takes R tiles of one item (SwiGLU: R gate tiles and the same R up tiles) over the
// whole row, stages x once, and splits the columns over its warps: warp w takes units w,
// w + WARPS, …; with seq > 1 it then takes the next R tiles, seq times (x staged once, and the
// ring runs on across the tiles instead of draining at the end of each: short rows gave a
// warp 4 units, too few for the ring to reach its steady state). Codes stream through a
// per-warp ring of S slots in shared memory by cp.async,
// S − 1 units ahead of the one being multiplied, so a warp's loads in flight cost no
// registers (register-held prefetch capped the bytes in flight at ~2 super-chunks per warp
// and left the matvecs latency-bound; split-K over more, shorter blocks measured slower still:
// each block pays x staging, reduction and epilogue). Each lane copies and later reads only
// its own bytes of a slot, so its own cp.async.wait_group is all the ordering needed. The
// warps' partial rows are summed in shared memory. WARPS is 8, or 16 where one block fills an
// SM's shared memory anyway (the `_w16` entry points: twice the units in flight for the same
// staged x).
template <int B, int R, int S, bool NORM, bool SWIGLU, int WARPS, bool REFINE>
__device__ __forceinline__ void gt_matvec_body(const GtGroup& g, const float* __restrict__ x,
                                               const float* __restrict__ nw, float eps,
                                               int cols, int n_sc, int gpr, int group_shift,
                                               int accumulate, int seq) {
    constexpr int WORDS = B / 2, SPU = GtUnit<B>::SPU, CHUNKS = GtUnit<B>::CHUNKS;
    constexpr int SC_CHUNKS = GtSuper<B>::CHUNKS;  // chunks per super-chunk
    constexpr int SCB = GtSuper<B>::BYTES;
    constexpr int NT = SWIGLU ? 2 * R : R;  // tiles per block: gate tiles, then up tiles
    using Slot = GtSlot<B, NT>;
    extern __shared__ __align__(16) uint32_t gt_planes[];
    // The warps' partial rows, double-buffered so a tile set refills one while the other is
    // still being read: one barrier a set.
    __shared__ float red[2][WARPS][NT][16];
    __shared__ float ss_red[WARPS];

    // The item owning this block, selected with compile-time indices only.
    GtItem item = g.item[0];
    int first_block = 0;
    if (!SWIGLU) {
#pragma unroll
        for (int k = 1; k < GT_MAX_ITEMS; ++k) {
            if (k < g.count && (int)blockIdx.x >= g.item[k - 1].block_end) {
                item = g.item[k];
                first_block = g.item[k - 1].block_end;
            }
        }
    }
    SFX_PDL_TRIGGER();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, tq = lane & 3;
    const int tiles = (item.rows + 15) / 16;
    const int tile_first = ((int)blockIdx.x - first_block) * R * seq;
    // The codes and scales of tile r of tile set s (tail tiles re-read, not written).
    auto tile_of = [&](int s, int r) { return min(tile_first + s * R + r % R, tiles - 1); };
    auto codes_at_tile = [&](int s, int r) {
        const GtItem& it = (SWIGLU && r >= R) ? g.item[1] : item;
        return reinterpret_cast<const unsigned char*>(it.codes) + (size_t)tile_of(s, r) * n_sc * SCB;
    };
    auto sz_at_tile = [&](int s, int r) {
        const GtItem& it = (SWIGLU && r >= R) ? g.item[1] : item;
        return it.scale_zero + (size_t)tile_of(s, r) * gpr * 8 + gq;
    };

    // Layout of dynamic shared memory: the three x planes (over whole units), then the
    // warps' rings; a lane's bytes of a slot are its share of each tile's super-chunks (16 B,
    // at 3 bits 16 + 8 B apart), then its 8 B of each scale/zero.
    const int n_units = (n_sc + SPU - 1) / SPU;
    const int pcols = n_units * CHUNKS * 32;
    const int pstride = pcols / 2 + 4;  // words; +4 puts the three planes on distinct banks
    unsigned char* ring = reinterpret_cast<unsigned char*>(gt_planes + 3 * pstride) +
                          (size_t)warp * S * Slot::BYTES;
    const int codes_at = lane * 16, sz_at = Slot::CODE_BYTES + lane * 8;
    // Unit `issue_u` of tile set `issue_s` of this warp into the next slot (its group:
    // chunk >> group_shift); one commit group per call, empty past the block's last tile set,
    // so wait_group counts stay uniform. A 4-bit row of an odd number of super-chunks ends in
    // a half unit: its missing half is zeros.
    int issue_u = warp, issue_s = 0, issue_k = 0;
    auto issue = [&]() {
        if (issue_s < seq && issue_u < n_units) {
            unsigned char* slot = ring + issue_k * Slot::BYTES;
            const int gi = min((issue_u * CHUNKS) >> group_shift, gpr - 1);
#pragma unroll
            for (int r = 0; r < NT; ++r) {
                const unsigned char* codes = codes_at_tile(issue_s, r);
#pragma unroll
                for (int h = 0; h < SPU; ++h) {
                    const int sc = issue_u * SPU + h;
                    unsigned char* dst = slot + (r * SPU + h) * SCB;
                    const unsigned char* src = codes + (size_t)min(sc, n_sc - 1) * SCB;
                    copy16_async(dst + codes_at, src + codes_at, sc < n_sc ? 16 : 0);
                    if constexpr (B == 3) copy8_async(dst + 512 + lane * 8, src + 512 + lane * 8);
                }
                copy8_async(slot + sz_at + r * 32 * 8, sz_at_tile(issue_s, r) + (size_t)gi * 8);
            }
        }
        copy_async_commit();
        issue_u += WARPS;
        if (issue_u >= n_units) {
            issue_u = warp;
            ++issue_s;
        }
        issue_k = issue_k == S - 1 ? 0 : issue_k + 1;
    };
    // The block's rows' refinement (decode rows only), in shared memory after the warps'
    // rings, gate rows then up rows; taken before the loop so the epilogues below only read it.
    float* rdelta = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(gt_planes + 3 * pstride) +
                                             (size_t)WARPS * S * Slot::BYTES);
    const int block_rows = seq * R * 16;
    float* rscratch = rdelta + (SWIGLU ? 2 : 1) * block_rows;
    // A staged operand (fetch lead) is read ahead, one scratch share per item, as the oldest
    // copy group: it lands while the weights' first groups do. Both SwiGLU items or neither.
    constexpr int N_REFINED = SWIGLU ? 2 : 1;
    const int share = (RE_SCRATCH_BYTES(WARPS * 32) / N_REFINED) & ~15;
    RefinePrefetch pf[N_REFINED];
    bool read_ahead = false;
    if (REFINE && gridDim.y == 1) {
        read_ahead = true;
#pragma unroll
        for (int k = 0; k < N_REFINED; ++k) {
            const GtItem& it = k == 1 ? g.item[1] : item;
            read_ahead = read_ahead && refine_prefetchable(it.refine, tile_first * 16, block_rows, share);
        }
        if (read_ahead) {
#pragma unroll
            for (int k = 0; k < N_REFINED; ++k) {
                const GtItem& it = k == 1 ? g.item[1] : item;
                refine_prefetch(it.refine, tile_first * 16, block_rows, it.rows,
                                reinterpret_cast<unsigned char*>(rscratch) + k * share, pf[k]);
            }
            copy_async_commit();
        }
    }
    // Weights are never written: their loads go out before x is read.
#pragma unroll
    for (int i = 0; i < S - 1; ++i) issue();
    SFX_PDL_WAIT();

    const int t = blockIdx.y;
    float ss = stage_planes<NORM, WARPS * 32>(x + (size_t)t * cols, nw, gt_planes, cols, 0, pcols, pstride);
    if (NORM) {
        ss = warp_sum(ss);
        if (lane == 0) ss_red[warp] = ss;
    }
    if (REFINE && read_ahead) copy_async_wait<S - 1>();  // the read-ahead group, the oldest
    __syncthreads();
    float scale = 1.0f;
    if (NORM) {
        float total = 0.0f;
#pragma unroll
        for (int k = 0; k < WARPS; ++k) total += ss_red[k];
        scale = 1.0f / sqrtf(total / (float)cols + eps);
    }

    // x̂[c] as the planes hold it (x · nw split in three bf16 parts) times the norm's scale.
    auto xhat = [&](int, uint32_t c) {
        const uint32_t* p = gt_planes + (c >> 1);
        const int sh = (int)(c & 1u) * 16;
        const float p0 = __uint_as_float(((p[0] >> sh) & 0xffffu) << 16);
        const float p1 = __uint_as_float(((p[pstride] >> sh) & 0xffffu) << 16);
        const float p2 = __uint_as_float(((p[2 * pstride] >> sh) & 0xffffu) << 16);
        return ((p0 + p1) + p2) * scale;
    };
    bool refined[2] = {false, false};
#pragma unroll
    for (int k = 0; k < N_REFINED; ++k) {
        const GtItem& it = k == 1 ? g.item[1] : item;
        if (REFINE && it.refine.sel != nullptr && gridDim.y == 1) {
            if (read_ahead) {
                refine_rows_prefetched(it.refine, pf[k], xhat, cols, tile_first * 16, block_rows,
                                       it.rows, rdelta + k * block_rows);
            } else {
                refine_rows(it.refine, x + (size_t)t * cols, nw, scale, cols, tile_first * 16,
                            block_rows, it.rows, rdelta + k * block_rows, rscratch);
            }
            refined[k] = true;
        }
    }

    // Lanes 0..11 read the three x planes as B columns 0..2; the others read plane 2 again,
    // and the output columns 3..7 they feed are dropped at the end (cheaper than zeroing B).
    const uint32_t* bplane0 = gt_planes + min(gq, 2) * pstride + tq + warp * (CHUNKS * 16);
    // Per tile: output columns 2t, 2t + 1 of rows g and g + 8 over the scaled units, and the
    // unit's sums.
    float tot[NT][4], d[NT][4];
#pragma unroll
    for (int r = 0; r < NT; ++r) {
#pragma unroll
        for (int e = 0; e < 4; ++e) tot[r][e] = d[r][e] = 0.0f;
    }
    int read_k = 0;
    for (int set = 0; set < seq; ++set) {
        const uint32_t* bplane = bplane0;
        for (int u = warp; u < n_units; u += WARPS, bplane += WARPS * CHUNKS * 16) {
            copy_async_wait<S - 2>();  // this lane's copies of unit u have landed
            const unsigned char* slot = ring + read_k * Slot::BYTES;
            read_k = read_k == S - 1 ? 0 : read_k + 1;
            uint4 w[NT][SPU];
            uint2 w3[NT];  // 3 bits: words 4 and 5
            uint2 szw[NT];
#pragma unroll
            for (int r = 0; r < NT; ++r) {
#pragma unroll
                for (int h = 0; h < SPU; ++h) {
                    w[r][h] = *reinterpret_cast<const uint4*>(slot + codes_at + (r * SPU + h) * SCB);
                }
                if constexpr (B == 3) w3[r] = *reinterpret_cast<const uint2*>(slot + r * SCB + 512 + lane * 8);
                szw[r] = *reinterpret_cast<const uint2*>(slot + sz_at + r * 32 * 8);
            }
            issue();  // into the slot this warp's previous unit (u − WARPS) left
            uint32_t zz[NT][2];  // 128 + z of rows g and g + 8, in both halves
#pragma unroll
            for (int r = 0; r < NT; ++r) {
                zz[r][0] = __byte_perm(szw[r].x, 0, 0x3232);
                zz[r][1] = __byte_perm(szw[r].y, 0, 0x3232);
                if constexpr (B == 2) zz[r][1] = zero_x4(zz[r][1]);
                if constexpr (B == 3) zz[r][1] = zero_x8(zz[r][1]);
            }
#pragma unroll
            for (int sub = 0; sub < CHUNKS; ++sub) {
#pragma unroll
                for (int ks = 0; ks < 2; ++ks) {
                    const int k0 = sub * 32 + ks * 16;  // column in the unit
                    const uint32_t b0 = bplane[k0 / 2];
                    const uint32_t b1 = bplane[k0 / 2 + 4];
#pragma unroll
                    for (int r = 0; r < NT; ++r) {
                        const uint4& ws = w[r][sub / SC_CHUNKS];
                        uint32_t a[4];
                        if constexpr (B == 3) {
                            const uint32_t words[6] = {ws.x, ws.y, ws.z, ws.w, w3[r].x, w3[r].y};
                            unpack_b3(words + 3 * (sub >> 1), sub, ks, zz[r][0], zz[r][1], a);
                        } else {
                            const uint32_t words[4] = {ws.x, ws.y, ws.z, ws.w};
                            unpack_a<B>(words + (sub % SC_CHUNKS) * WORDS, ks, zz[r][0], zz[r][1], a);
                        }
                        mma_bf16(d[r], a, b0, b1);
                    }
                }
            }
            // The unit's partial sums, scaled by its group's scales (a group of several units is
            // summed in parts).
#pragma unroll
            for (int r = 0; r < NT; ++r) {
                const float s0 = __half2float(__ushort_as_half((unsigned short)(szw[r].x & 0xffff)));
                const float s1 = __half2float(__ushort_as_half((unsigned short)(szw[r].y & 0xffff))) *
                                 HiRowScale<B>::VALUE;
                tot[r][0] = fmaf(s0, d[r][0], tot[r][0]);
                tot[r][1] = fmaf(s0, d[r][1], tot[r][1]);
                tot[r][2] = fmaf(s1, d[r][2], tot[r][2]);
                tot[r][3] = fmaf(s1, d[r][3], tot[r][3]);
#pragma unroll
                for (int e = 0; e < 4; ++e) d[r][e] = 0.0f;
            }
        }
        // Rows g and g + 8 of each tile: the three x columns (lane t holds columns 2t, 2t + 1;
        // columns 3..7 are dropped) summed over the t lanes, then over the warps' column slices.
#pragma unroll
        for (int r = 0; r < NT; ++r) {
            float lo = tq == 0 ? tot[r][0] + tot[r][1] : tq == 1 ? tot[r][0] : 0.0f;
            float hi = tq == 0 ? tot[r][2] + tot[r][3] : tq == 1 ? tot[r][2] : 0.0f;
            lo += __shfl_xor_sync(SFX_FULL_MASK, lo, 1);
            lo += __shfl_xor_sync(SFX_FULL_MASK, lo, 2);
            hi += __shfl_xor_sync(SFX_FULL_MASK, hi, 1);
            hi += __shfl_xor_sync(SFX_FULL_MASK, hi, 2);
            if (tq == 0) {
                red[set & 1][warp][r][gq] = lo;
                red[set & 1][warp][r][gq + 8] = hi;
            }
        }
        __syncthreads();
        if ((int)threadIdx.x < R * 16) {
            const int r = threadIdx.x / 16, i = threadIdx.x % 16;
            const int out_row = (tile_first + set * R + r) * 16 + i;
            if (out_row < item.rows) {
                float total = 0.0f, up_total = 0.0f;
#pragma unroll
                for (int k = 0; k < WARPS; ++k) {
                    total += red[set & 1][k][r][i];
                    if (SWIGLU) up_total += red[set & 1][k][(R + r) % NT][i];
                }
                const int ri = out_row - tile_first * 16;
                const float extra =
                    REFINE ? (refined[0] ? rdelta[ri] : 0.0f) + lagged_at(item.refine, out_row)
                           : 0.0f;
                projection_out<SWIGLU>(item.y + (size_t)t * item.rows + out_row, total, up_total,
                                       scale, item.bias, out_row, accumulate,
                                       refined[0] || refined[1], extra,
                                       refined[1] ? rdelta[block_rows + ri] : 0.0f);
            }
        }
#pragma unroll
        for (int r = 0; r < NT; ++r)
#pragma unroll
            for (int e = 0; e < 4; ++e) tot[r][e] = 0.0f;
    }
    copy_async_wait<0>();  // nothing left in flight when the block exits
}

#define SFX_GT_BODY(...) __VA_ARGS__
#else
// Older GPUs have no bf16 m16n8k16 MMA: the entry points exist (one symbol table for every
// architecture) and trap; the backend uses the tile layout only on compute capability 8.0+.
#define SFX_GT_BODY(...) __trap();
#endif

// Entry points `gt_{matvec,matvec_norm,swiglu,swiglu_norm}[_rf]_b{B}_r{R}_s{S}[_w16]`: R tiles
// per block (SwiGLU: R gate and R up tiles), S ring slots per warp, W warps (8 unless named).
// `_norm`: x is the raw residual stream and nw the RMSNorm weight. `_rf`: the launch applies a
// decode row's refinement or fetch lag's contributions (the items' RefineOp); the plain entries
// leave that code out, so their registers and occupancy are the unrefined kernel's.
#define SFX_GT_MATVEC_AS(B, R, S, W, NAME, RF, TAG)                                       \
    extern "C" __global__ void __launch_bounds__(W * 32, 16 / W)                          \
        gt_matvec##TAG##_b##B##_r##NAME(const GtGroup g, const float* x, int cols,        \
                                        int n_sc, int gpr, int group_shift,               \
                                        int accumulate, int seq) {                        \
        SFX_GT_BODY(gt_matvec_body<B, R, S, false, false, W, RF>(                         \
                        g, x, nullptr, 0.0f, cols, n_sc, gpr, group_shift, accumulate, seq);) \
    }                                                                                     \
    extern "C" __global__ void __launch_bounds__(W * 32, 16 / W)                          \
        gt_matvec_norm##TAG##_b##B##_r##NAME(const GtGroup g, const float* x,             \
                                             const float* nw, float eps, int cols,        \
                                             int n_sc, int gpr, int group_shift,          \
                                             int seq) {                                   \
        SFX_GT_BODY(gt_matvec_body<B, R, S, true, false, W, RF>(                          \
                        g, x, nw, eps, cols, n_sc, gpr, group_shift, 0, seq);)            \
    }

#define SFX_GT_SWIGLU_AS(B, R, S, W, NAME, RF, TAG)                                       \
    extern "C" __global__ void __launch_bounds__(W * 32, 16 / W)                          \
        gt_swiglu##TAG##_b##B##_r##NAME(const GtGroup g, const float* x, int cols,        \
                                        int n_sc, int gpr, int group_shift, int seq) {    \
        SFX_GT_BODY(gt_matvec_body<B, R, S, false, true, W, RF>(                          \
                        g, x, nullptr, 0.0f, cols, n_sc, gpr, group_shift, 0, seq);)      \
    }                                                                                     \
    extern "C" __global__ void __launch_bounds__(W * 32, 16 / W)                          \
        gt_swiglu_norm##TAG##_b##B##_r##NAME(const GtGroup g, const float* x,             \
                                             const float* nw, float eps, int cols,        \
                                             int n_sc, int gpr, int group_shift,          \
                                             int seq) {                                   \
        SFX_GT_BODY(gt_matvec_body<B, R, S, true, true, W, RF>(                           \
                        g, x, nw, eps, cols, n_sc, gpr, group_shift, 0, seq);)            \
    }

#define SFX_GT_MATVEC(B, R, S, W, NAME)                                                   \
    SFX_GT_MATVEC_AS(B, R, S, W, NAME, false, )                                           \
    SFX_GT_MATVEC_AS(B, R, S, W, NAME, true, _rf)

#define SFX_GT_SWIGLU(B, R, S, W, NAME)                                                   \
    SFX_GT_SWIGLU_AS(B, R, S, W, NAME, false, )                                           \
    SFX_GT_SWIGLU_AS(B, R, S, W, NAME, true, _rf)

#define SFX_GT_WIDTH(B)                                                                   \
    SFX_GT_MATVEC(B, 1, 3, 8, 1_s3)                                                       \
    SFX_GT_MATVEC(B, 1, 4, 8, 1_s4)                                                       \
    SFX_GT_MATVEC(B, 2, 3, 8, 2_s3)                                                       \
    SFX_GT_MATVEC(B, 2, 4, 8, 2_s4)                                                       \
    SFX_GT_MATVEC(B, 4, 3, 8, 4_s3)                                                       \
    SFX_GT_MATVEC(B, 4, 4, 8, 4_s4)                                                       \
    SFX_GT_MATVEC(B, 1, 3, 16, 1_s3_w16)                                                  \
    SFX_GT_SWIGLU(B, 1, 3, 8, 1_s3)                                                       \
    SFX_GT_SWIGLU(B, 1, 4, 8, 1_s4)                                                       \
    SFX_GT_SWIGLU(B, 2, 3, 8, 2_s3)                                                       \
    SFX_GT_SWIGLU(B, 2, 4, 8, 2_s4)                                                       \
    SFX_GT_SWIGLU(B, 1, 3, 16, 1_s3_w16)

SFX_GT_WIDTH(2)
SFX_GT_WIDTH(3)
SFX_GT_WIDTH(4)

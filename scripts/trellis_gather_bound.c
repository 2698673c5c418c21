// What bounds the CPU's HYB trellis decode (runtime/src/resident/trellis_kernel.rs): one
// 16-row tile row of K = 2 tiles, 576 columns, decoded and multiplied as the kernel does it,
// in three forms (TSC ticks per weight, best of the repeats):
//   0  the kernel's form: vpermb + shift/mask states, 32-bit hash, gather of f16 pairs from a
//      512-row table, sign by XOR, two vcvtph2ps and two FMAs per 16 states;
//   1  fewer instructions: states by vpermb + masked vpmultishiftqb (no mask op), the hash in
//      16 bits (vpmullw), the sign folded into a 1024-row table of bf16 pairs and one
//      vdpbf16ps per 16 states (bf16 x), still one gather per 16 states;
//   2  form 1 with the gather replaced by an in-register vpermi2d (wrong values, timing only).
// Build: gcc -O2 -march=native -o /tmp/tgb scripts/trellis_gather_bound.c; run: /tmp/tgb
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <x86intrin.h>
#define NT 36  // tiles per tile row (576 columns)
#define K 2
#define ROWS 4096
static uint8_t idx[8][64], ctrl[64];
static uint32_t shiftv[16], lut[512], lut2[1024];
static uint8_t streams[(size_t)ROWS * NT * 32 * K];
static float xs[NT * 16], ys[16];
static uint16_t xb[NT * 32];

__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512vl,f16c,fma"))) static void kernel_form(
    const uint8_t* s, float* y) {
    __m512i shift = _mm512_loadu_si512(shiftv), one = _mm512_set1_epi32(1);
    __m512i qmask = _mm512_set1_epi32(511), sign = _mm512_set1_epi32(0x8000);
    __m128i qs = _mm_cvtsi32_si128(6);
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int tc = 0; tc < NT; tc++) {
        __m512i lo = _mm512_loadu_si512(s + tc * 64);
        __m512 xv = _mm512_loadu_ps(xs + tc * 16);
        for (int g = 0; g < 8; g++) {
            __m512i d = _mm512_permutexvar_epi8(_mm512_loadu_si512(idx[g]), lo);
            __m512i st = _mm512_and_si512(_mm512_srlv_epi32(d, shift), _mm512_set1_epi32(0xffff));
            __m512i h = _mm512_mullo_epi32(st, _mm512_add_epi32(st, one));
            __m512i li = _mm512_and_si512(_mm512_srl_epi32(h, qs), qmask);
            __m512i pair = _mm512_i32gather_epi32(li, (const int*)lut, 4);
            pair = _mm512_xor_si512(pair, _mm512_and_si512(h, sign));
            __m512 w0 = _mm512_cvtph_ps(_mm512_castsi512_si256(pair));
            __m512 w1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(pair, 1));
            acc[2 * g] = _mm512_fmadd_ps(w0, xv, acc[2 * g]);
            acc[2 * g + 1] = _mm512_fmadd_ps(w1, xv, acc[2 * g + 1]);
        }
    }
    for (int r = 0; r < 16; r++) y[r] += _mm512_reduce_add_ps(acc[r]);
}

__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512vl,avx512bf16,f16c,fma"))) static void
lean_form(const uint8_t* s, float* y, int gather) {
    __m512i c = _mm512_loadu_si512(ctrl), one = _mm512_set1_epi16(1);
    __m512i t0 = _mm512_loadu_si512(lut2), t1 = _mm512_loadu_si512(lut2 + 16);
    __m128i qs = _mm_cvtsi32_si128(6);
    __m512 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
    for (int tc = 0; tc < NT; tc++) {
        __m512i lo = _mm512_loadu_si512(s + tc * 64);
        __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + tc * 32);
        for (int g = 0; g < 8; g++) {
            __m512i d = _mm512_permutexvar_epi8(_mm512_loadu_si512(idx[g]), lo);
            __m512i st = _mm512_maskz_multishift_epi64_epi8(0x3333333333333333ULL, c, d);
            __m512i h = _mm512_mullo_epi16(st, _mm512_add_epi16(st, one));
            __m512i li = _mm512_srl_epi32(h, qs);
            __m512i pair = gather ? _mm512_i32gather_epi32(li, (const int*)lut2, 4)
                                  : _mm512_permutex2var_epi32(t0, li, t1);
            acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)pair, xv);
        }
    }
    for (int r = 0; r < 8; r++) {
        y[2 * r] += _mm512_mask_reduce_add_ps(0xff, acc[r]);
        y[2 * r + 1] += _mm512_mask_reduce_add_ps(0xff00, acc[r]);
    }
}

static double run(int form) {
    uint64_t t0 = __rdtsc();
    for (int tr = 0; tr < ROWS; tr++) {
        const uint8_t* s = streams + (size_t)tr * NT * 32 * K;
        if (form == 0) kernel_form(s, ys);
        else lean_form(s, ys, form == 1);
    }
    return (double)(__rdtsc() - t0) / ((double)ROWS * NT * 256);
}

int main(void) {
    for (int g = 0; g < 8; g++)
        for (int i = 0; i < 16; i++) {
            int o = K * 2 * (16 * g + i), b = o >> 3;
            for (int j = 0; j < 4; j++) idx[g][4 * i + j] = (b + 3 - j) % (32 * K);
        }
    for (int i = 0; i < 16; i++) shiftv[i] = 16 - ((K * 2 * i) & 7);
    for (int i = 0; i < 64; i++) ctrl[i] = (uint8_t)((i & 4 ? 32 : 0) + (i & 1 ? 8 : 0));
    srand(1);
    for (int i = 0; i < 512; i++) lut[i] = rand() & 0x3fff3fff;
    for (int i = 0; i < 1024; i++) lut2[i] = rand() & 0x3fff3fff;
    for (size_t i = 0; i < sizeof streams; i++) streams[i] = (uint8_t)rand();
    for (int i = 0; i < NT * 16; i++) xs[i] = 1.0f / (float)(i + 1);
    for (int i = 0; i < NT * 32; i++) xb[i] = 0x3f80;
    double best[3] = {1e9, 1e9, 1e9};
    for (int rep = 0; rep < 8; rep++)
        for (int f = 0; f < 3; f++) {
            double t = run(f);
            if (t < best[f]) best[f] = t;
        }
    printf("ticks per weight (best of 8): kernel form %.3f | fewer instructions, gather %.3f | "
           "fewer instructions, no gather %.3f   (checksum %g)\n",
           best[0], best[1], best[2], ys[0]);
    return 0;
}

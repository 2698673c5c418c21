// Read bandwidth of this machine: sums an array of 512-bit words on OMP_NUM_THREADS threads,
// best of 7 passes. Used for the share of the bound a CPU decode reaches (docs/results.md).
//   gcc -O2 -mavx512f -fopenmp scripts/read_bandwidth.c -o /tmp/bw && OMP_NUM_THREADS=2 /tmp/bw 256
#include <stdio.h>
#include <stdlib.h>
#include <omp.h>
#include <immintrin.h>
int main(int argc, char **argv) {
  size_t mb = argc > 1 ? atol(argv[1]) : 256;
  size_t n = mb * (1 << 20) / 64;
  __m512i *a = aligned_alloc(64, n * 64);
  for (size_t i = 0; i < n; i++) a[i] = _mm512_set1_epi32(i);
  double best = 0;
  for (int r = 0; r < 7; r++) {
    double t0 = omp_get_wtime();
    __m512i acc = _mm512_setzero_si512();
#pragma omp parallel
    {
      __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
#pragma omp for nowait
      for (size_t i = 0; i < n; i += 4) {
        s0 = _mm512_add_epi32(s0, a[i]); s1 = _mm512_add_epi32(s1, a[i+1]);
        s2 = _mm512_add_epi32(s2, a[i+2]); s3 = _mm512_add_epi32(s3, a[i+3]);
      }
#pragma omp critical
      acc = _mm512_add_epi32(acc, _mm512_add_epi32(_mm512_add_epi32(s0, s1), _mm512_add_epi32(s2, s3)));
    }
    double t = omp_get_wtime() - t0;
    double gbs = n * 64 / t / 1e9;
    if (gbs > best) best = gbs;
    if (_mm512_reduce_add_epi32(acc) == 42) printf("!");
  }
  printf("%zu MB, %d threads: %.1f GB/s\n", mb, omp_get_max_threads(), best);
}

// AVX2 versions of the loops in vector_kernels.h (compiled for the baseline ISA with target
// attributes; chosen at run time).
#include <immintrin.h>

#include <cmath>

#include "mantissa/kernels/vector_kernels.h"

namespace mantissa::kernels::detail {

__attribute__((target("avx2"))) void axpy_f32_avx2(float* a, const float* x, float w, int64_t n) {
  const __m256 wv = _mm256_set1_ps(w);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(
        a + j, _mm256_add_ps(_mm256_loadu_ps(a + j), _mm256_mul_ps(wv, _mm256_loadu_ps(x + j))));
  for (; j < n; ++j) a[j] += w * x[j];
}

__attribute__((target("avx2"))) void mul_acc_f32_avx2(float* acc, const float* d, const float* x,
                                                      int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(acc + j,
                     _mm256_add_ps(_mm256_loadu_ps(acc + j),
                                   _mm256_mul_ps(_mm256_loadu_ps(d + j), _mm256_loadu_ps(x + j))));
  for (; j < n; ++j) acc[j] += d[j] * x[j];
}

// Lane-split dot products over columns [k0, k1) for a tile of up to 3 x 4 rows: full 3 x 4 tiles
// keep the 12 lane vectors in registers (3 + 4 loads feed 12 FMAs per 8 columns); the tail
// columns (k1 - k0 not a multiple of 8) go to their lanes one at a time, in order.
__attribute__((target("avx2,fma"))) void dot_lanes_tile_avx2(int rows_a, int rows_b, int64_t k0,
                                                             int64_t k1, const float* const* a,
                                                             const float* const* b,
                                                             float* const* P) {
  constexpr int RB = 4;
  const int64_t k8 = k0 + (k1 - k0) / 8 * 8;
  if (rows_a == 3 && rows_b == RB) {
    __m256 acc[3][RB];
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < RB; ++j) acc[i][j] = _mm256_loadu_ps(P[i * RB + j]);
    for (int64_t k = k0; k < k8; k += 8) {
      const __m256 b0 = _mm256_loadu_ps(b[0] + k), b1 = _mm256_loadu_ps(b[1] + k),
                   b2 = _mm256_loadu_ps(b[2] + k), b3 = _mm256_loadu_ps(b[3] + k);
      for (int i = 0; i < 3; ++i) {
        const __m256 x = _mm256_loadu_ps(a[i] + k);
        acc[i][0] = _mm256_fmadd_ps(x, b0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(x, b1, acc[i][1]);
        acc[i][2] = _mm256_fmadd_ps(x, b2, acc[i][2]);
        acc[i][3] = _mm256_fmadd_ps(x, b3, acc[i][3]);
      }
    }
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < RB; ++j) _mm256_storeu_ps(P[i * RB + j], acc[i][j]);
  } else {
    for (int i = 0; i < rows_a; ++i)
      for (int j = 0; j < rows_b; ++j) {
        __m256 acc = _mm256_loadu_ps(P[i * RB + j]);
        for (int64_t k = k0; k < k8; k += 8)
          acc = _mm256_fmadd_ps(_mm256_loadu_ps(a[i] + k), _mm256_loadu_ps(b[j] + k), acc);
        _mm256_storeu_ps(P[i * RB + j], acc);
      }
  }
  for (int i = 0; i < rows_a; ++i)
    for (int j = 0; j < rows_b; ++j)
      for (int64_t k = k8; k < k1; ++k) {
        float& lane = P[i * RB + j][k % 8];
        lane = std::fma(a[i][k], b[j][k], lane);
      }
}

}  // namespace mantissa::kernels::detail

// AVX2 versions of the loops in vector_kernels.h (compiled for the baseline ISA with target
// attributes; chosen at run time).
#include <immintrin.h>

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

}  // namespace mantissa::kernels::detail

// The AVX2 inner loop of Adam/AdamW (see optim_kernels.h). Compiled for the baseline ISA with a
// target attribute; chosen at run time.
#include <immintrin.h>

#include "mantissa/optim/optim_kernels.h"

namespace mantissa::optim::detail {
namespace {

__attribute__((target("avx2"))) void adam_avx2(float* __restrict p, const float* __restrict g,
                                               float* __restrict m, float* __restrict v, int64_t n,
                                               const AdamScalars& s) {
  const __m256 b1 = _mm256_set1_ps(s.b1), b2 = _mm256_set1_ps(s.b2);
  const __m256 omb1 = _mm256_set1_ps(s.one_minus_b1), omb2 = _mm256_set1_ps(s.one_minus_b2);
  const __m256 neg_step = _mm256_set1_ps(-s.step_size), bc2 = _mm256_set1_ps(s.bc2_sqrt);
  const __m256 eps = _mm256_set1_ps(s.eps), wd = _mm256_set1_ps(s.wd);
  const __m256 decay = _mm256_set1_ps(s.decay);
  const __m256 unscale = _mm256_set1_ps(s.unscale), clip = _mm256_set1_ps(s.clip);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 grad = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(g + j), unscale), clip);
    __m256 param = _mm256_loadu_ps(p + j);
    if (s.decoupled)
      param = _mm256_mul_ps(param, decay);
    else if (s.wd != 0)
      grad = _mm256_add_ps(grad, _mm256_mul_ps(wd, param));
    const __m256 mj =
        _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(m + j), b1), _mm256_mul_ps(omb1, grad));
    const __m256 vj = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(v + j), b2),
                                    _mm256_mul_ps(_mm256_mul_ps(omb2, grad), grad));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vj), bc2), eps);
    _mm256_storeu_ps(m + j, mj);
    _mm256_storeu_ps(v + j, vj);
    _mm256_storeu_ps(p + j,
                     _mm256_add_ps(param, _mm256_mul_ps(neg_step, _mm256_div_ps(mj, denom))));
  }
  for (; j < n; ++j) adam_element(p[j], g[j], m[j], v[j], s);
}

}  // namespace

void adam_update_avx2(float* p, const float* g, float* m, float* v, int64_t n,
                      const AdamScalars& s) {
  adam_avx2(p, g, m, v, n, s);
}

}  // namespace mantissa::optim::detail

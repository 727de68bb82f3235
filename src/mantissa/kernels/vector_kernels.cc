#include "mantissa/kernels/vector_kernels.h"

#include "mantissa/core/convert.h"
#include "mantissa/core/cpu_features.h"

namespace mantissa::kernels::detail {
namespace {

[[maybe_unused]] bool avx2_vectors() {
  static const bool on = cpu_features().avx2 && active_simd_path() == SimdPath::kAvx2;
  return on;
}

}  // namespace

void axpy_f32(float* a, const float* x, int64_t stride, float w, int64_t n) {
#if MANTISSA_HAVE_X86_SIMD
  if (stride == 1 && avx2_vectors()) return axpy_f32_avx2(a, x, w, n);
#endif
  for (int64_t j = 0; j < n; ++j) a[j] += w * x[j * stride];
}

void mul_acc_f32(float* acc, const float* d, const float* x, int64_t stride, int64_t n) {
#if MANTISSA_HAVE_X86_SIMD
  if (stride == 1 && avx2_vectors()) return mul_acc_f32_avx2(acc, d, x, n);
#endif
  for (int64_t j = 0; j < n; ++j) acc[j] += d[j] * x[j * stride];
}

}  // namespace mantissa::kernels::detail

// Internal: short FP32 vector loops used by the direct convolution, with an AVX2 version chosen
// at run time. Both versions do the same IEEE multiply and add per element (no fused
// multiply-add), so they give identical bits.
#pragma once

#include <cstdint>

namespace mantissa::kernels::detail {

// a[j] += w * x[j * stride], j < n.
void axpy_f32(float* a, const float* x, int64_t stride, float w, int64_t n);
// acc[j] += d[j] * x[j * stride], j < n.
void mul_acc_f32(float* acc, const float* d, const float* x, int64_t stride, int64_t n);

#if MANTISSA_HAVE_X86_SIMD
void axpy_f32_avx2(float* a, const float* x, float w, int64_t n);  // stride 1
void mul_acc_f32_avx2(float* acc, const float* d, const float* x, int64_t n);
#endif

}  // namespace mantissa::kernels::detail

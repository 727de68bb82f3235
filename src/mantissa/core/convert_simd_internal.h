// Internal: eight values of f32, f16 or bf16 storage loaded into an AVX2 register as FP32, and
// eight FP32 values stored rounded to nearest even, for the AVX2 kernels that read and write
// 16-bit tensors in their own loops (no FP32 staging pass). The rounding is convert()'s, bit for
// bit: F16C for FP16; for BF16, add 0x7fff plus the lowest kept bit and truncate, a NaN made quiet
// with its top payload bits. Only for code that carries the same target attribute (x86-64 builds).
#pragma once

#if MANTISSA_HAVE_X86_SIMD
#include <immintrin.h>

#include <cstdint>

#include "mantissa/core/dtype.h"

namespace mantissa::simd {

#define MANTISSA_SIMD_IO __attribute__((target("avx2,f16c,fma"))) inline

// Eight 16-bit encodings of FP32 lanes, rounded to nearest even.
MANTISSA_SIMD_IO __m128i to_f16x8(__m256 x) {
  return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
MANTISSA_SIMD_IO __m128i to_bf16x8(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40));
  const __m256i a = _mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff));
  const __m256i v =
      _mm256_blendv_epi8(r, nan, _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000)));
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08));
}
// The encodings of x in t (f16 or bf16).
MANTISSA_SIMD_IO __m128i to_half8(__m256 x, DType t) {
  return t == DType::f16 ? to_f16x8(x) : to_bf16x8(x);
}
// Eight 16-bit encodings widened to FP32 (exact).
MANTISSA_SIMD_IO __m256 from_half8(__m128i h, DType t) {
  return t == DType::f16 ? _mm256_cvtph_ps(h)
                         : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Eight values of storage t (f32, f16 or bf16) at p, as FP32.
MANTISSA_SIMD_IO __m256 load8(const void* p, DType t) {
  if (t == DType::f32) return _mm256_loadu_ps(static_cast<const float*>(p));
  return from_half8(_mm_loadu_si128(static_cast<const __m128i*>(p)), t);
}
// x into eight values of storage t (f32, f16 or bf16) at p, rounded to nearest even.
MANTISSA_SIMD_IO void store8(void* p, DType t, __m256 x) {
  if (t == DType::f32)
    _mm256_storeu_ps(static_cast<float*>(p), x);
  else
    _mm_storeu_si128(static_cast<__m128i*>(p), to_half8(x, t));
}

#undef MANTISSA_SIMD_IO

}  // namespace mantissa::simd
#endif

// AVX-512 conversion kernels between FP32 and FP16/BF16, sixteen values a vector, in
// round-to-nearest-even with or without saturation: F16C's rounding for FP16 (the 512-bit form
// rounds each lane as the 256-bit one does), add-and-truncate for BF16, the AVX2 kernels' steps
// lane for lane, so the same bits as the scalar encoders (the exhaustive tests run every path).
// Stochastic rounding and the FP8 formats use the AVX2 kernels. A last partial vector is read and
// written through masks.
#include <immintrin.h>

#include "mantissa/core/convert_kernels.h"
#include "mantissa/core/convert_simd512_internal.h"

#define MANTISSA_AVX512 MANTISSA_AVX512_TARGET

namespace mantissa::detail {
namespace {

// Sixteen FP32 values to FP16 or BF16 encodings by nearest even.
template <bool kF16>
MANTISSA_AVX512 inline __m256i rne16(__m512 x, bool saturate) {
  if constexpr (kF16) {
    // Saturation clamps first (NaN passes through min/max as the second operand).
    if (saturate)
      x = _mm512_maskz_max_ps(0xffff, _mm512_set1_ps(-65504.0f),
                              _mm512_maskz_min_ps(0xffff, _mm512_set1_ps(65504.0f), x));
    return simd512::to_f16x16(x);
  } else {
    const __m256i h = simd512::to_bf16x16(x);
    if (!saturate) return h;
    // Saturation: a value that rounded to infinity (the encoding's low 15 bits 0x7f80; a NaN's,
    // quiet, never are) takes the largest finite one, as the AVX2 kernel gives (an infinite input
    // included).
    const __mmask16 over = _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)),
                                                   _mm256_set1_epi16(0x7f80));
    return _mm256_mask_sub_epi16(h, over, h, _mm256_set1_epi16(1));
  }
}

template <bool kF16>
MANTISSA_AVX512 void from_f32(const float* src, void* dst_v, size_t n, const CastOptions& opt) {
  if (opt.rounding == Rounding::kStochastic)
    return avx2_kernels().from_f32[kF16 ? kIdxF16 : kIdxBF16](src, dst_v, n, opt);
  uint16_t* dst = static_cast<uint16_t*>(dst_v);
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        rne16<kF16>(_mm512_loadu_ps(src + i), opt.saturate));
  if (i < n) {  // the last one to fifteen: masked (the other lanes read as zero, not stored)
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm256_mask_storeu_epi16(dst + i, m,
                             rne16<kF16>(_mm512_maskz_loadu_ps(m, src + i), opt.saturate));
  }
}

template <bool kF16>
MANTISSA_AVX512 inline __m512 widen(__m256i h) {
  return kF16 ? simd512::from_f16x16(h) : simd512::from_bf16x16(h);
}

template <bool kF16>
MANTISSA_AVX512 void to_f32(const void* src_v, float* dst, size_t n) {
  const uint16_t* src = static_cast<const uint16_t*>(src_v);
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i,
                     widen<kF16>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  if (i < n) {  // the last one to fifteen: masked
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(dst + i, m, widen<kF16>(_mm256_maskz_loadu_epi16(m, src + i)));
  }
}

}  // namespace

const ConvertKernels& avx512_kernels() {
  static const ConvertKernels k = [] {
    ConvertKernels t = avx2_kernels();
    t.from_f32[kIdxF16] = from_f32<true>;
    t.from_f32[kIdxBF16] = from_f32<false>;
    t.to_f32[kIdxF16] = to_f32<true>;
    t.to_f32[kIdxBF16] = to_f32<false>;
    return t;
  }();
  return k;
}

}  // namespace mantissa::detail

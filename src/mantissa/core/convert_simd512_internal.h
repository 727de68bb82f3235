// Internal: the AVX-512 forms of convert_simd_internal.h: sixteen values of f32, f16 or bf16
// storage loaded into a zmm register as FP32, sixteen FP32 lanes stored rounded to nearest even,
// and FP32 lanes rounded through a 16-bit type and back (the values a 16-bit copy would hold).
// The rounding is convert()'s, bit for bit: F16C's for FP16 (the 512-bit form rounds each lane as
// the 256-bit one does); for BF16, add 0x7fff plus the lowest kept bit and truncate, a NaN made
// quiet with its top payload bits. The zero-masking forms with every lane selected: the plain
// intrinsics pass GCC 12 an undefined source that -Wmaybe-uninitialized reports. Only for code
// compiled with the same target attribute (x86-64 builds).
#pragma once

#if MANTISSA_HAVE_X86_SIMD
#include <immintrin.h>

#include <cstdint>

#include "mantissa/core/cpu_features.h"
#include "mantissa/core/dtype.h"

// (avx512bf16 for vcvtneps2bf16, which runs only where kBf16Instructions says the processor has
// it; the compilers emit it for nothing else here.)
#define MANTISSA_AVX512_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c")))

namespace mantissa::simd512 {

#define MANTISSA_SIMD512_IO MANTISSA_AVX512_TARGET inline __attribute__((always_inline))

// BF16's rounding of FP32 lanes, kept in the top half of each lane (the low half zero): the FP32
// value of each lane's BF16 encoding.
MANTISSA_SIMD512_IO __m512i bf16_rounded_bits(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const __m512i lsb =
      _mm512_and_si512(_mm512_maskz_srli_epi32(0xffff, b, 16), _mm512_set1_epi32(1));
  const __m512i r =
      _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb), top);
  const __m512i nan = _mm512_or_si512(_mm512_and_si512(b, top), _mm512_set1_epi32(0x00400000));
  const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(
      _mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_blend_epi32(is_nan, r, nan);
}

// The processor's BF16 encodings of x, when kBf16Instructions and no lane is an FP32 subnormal
// (vcvtneps2bf16 reads those as zero; it otherwise rounds to nearest even and quiets a NaN keeping
// its top payload bits, as the integer rule does); false when the integer rule must make them.
MANTISSA_SIMD512_IO bool bf16_by_instruction(__m512 x, __m256i& h) {
  if (!kBf16Instructions || _mm512_fpclass_ps_mask(x, 0x20) != 0) return false;  // 0x20: denormal
  h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
  return true;
}

// Sixteen FP32 lanes as FP16 and as BF16 encodings, rounded to nearest even.
MANTISSA_SIMD512_IO __m256i to_f16x16(__m512 x) {
  return _mm512_maskz_cvtps_ph(0xffff, x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
MANTISSA_SIMD512_IO __m256i to_bf16x16(__m512 x) {
  __m256i h;
  if (bf16_by_instruction(x, h)) return h;
  return _mm512_maskz_cvtepi32_epi16(0xffff,
                                     _mm512_maskz_srli_epi32(0xffff, bf16_rounded_bits(x), 16));
}

// Sixteen 16-bit encodings (f16 or bf16) widened to FP32 (exact).
MANTISSA_SIMD512_IO __m512 from_f16x16(__m256i h) { return _mm512_maskz_cvtph_ps(0xffff, h); }
MANTISSA_SIMD512_IO __m512 from_bf16x16(__m256i h) {
  return _mm512_castsi512_ps(
      _mm512_maskz_slli_epi32(0xffff, _mm512_maskz_cvtepu16_epi32(0xffff, h), 16));
}
MANTISSA_SIMD512_IO __m512 from_half16(__m256i h, DType t) {
  return t == DType::f16 ? from_f16x16(h) : from_bf16x16(h);
}

// FP32 lanes rounded to nearest even to f16 / bf16 and widened back.
MANTISSA_SIMD512_IO __m512 round_through_f16(__m512 x) { return from_f16x16(to_f16x16(x)); }
MANTISSA_SIMD512_IO __m512 round_through_bf16(__m512 x) {
  __m256i h;
  if (bf16_by_instruction(x, h)) return from_bf16x16(h);
  return _mm512_castsi512_ps(bf16_rounded_bits(x));
}

// Sixteen values of storage t (f32, f16 or bf16) at p, as FP32.
MANTISSA_SIMD512_IO __m512 load16(const void* p, DType t) {
  if (t == DType::f32) return _mm512_loadu_ps(p);
  return from_half16(_mm256_loadu_si256(static_cast<const __m256i*>(p)), t);
}
// x into sixteen values of storage t (f32, f16 or bf16) at p, rounded to nearest even.
MANTISSA_SIMD512_IO void store16(void* p, DType t, __m512 x) {
  if (t == DType::f32)
    _mm512_storeu_ps(p, x);
  else
    _mm256_storeu_si256(static_cast<__m256i*>(p), t == DType::f16 ? to_f16x16(x) : to_bf16x16(x));
}

#undef MANTISSA_SIMD512_IO

}  // namespace mantissa::simd512
#endif

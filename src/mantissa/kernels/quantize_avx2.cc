// AVX2 + F16C path of the FP8 quantization (quantize.h), bit for bit the reference's: 8 lanes
// widened to FP32 (F16C for f16, a shift for bf16), multiplied by the scale, measured on their
// bits (amax, saturated, flushed, NaN: positive floats order as integers), staged in a block that
// the convert family's AVX2 encoder rounds and saturates into the format.
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <limits>

#include "mantissa/core/convert.h"
#include "mantissa/kernels/quantize.h"

#define MANTISSA_AVX2 __attribute__((target("avx2,f16c,fma")))

namespace mantissa::kernels::detail {
namespace {

constexpr size_t kBlock = 256;  // elements staged per encoder call

MANTISSA_AVX2 inline __m256i set1(uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }

MANTISSA_AVX2 inline __m256 load8(const void* src, DType from, size_t i) {
  switch (from) {
    case DType::f16:
      return _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(src) + i)));
    case DType::bf16:
      return _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(
              reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(src) + i))),
          16));
    default:
      return _mm256_loadu_ps(static_cast<const float*>(src) + i);
  }
}

MANTISSA_AVX2 inline int64_t count(__m256i mask) {
  return __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(mask))));
}

const void* offset(const void* src, DType from, size_t i) {
  return static_cast<const char*>(src) + i * dtype_size(from);
}

}  // namespace

MANTISSA_AVX2 QuantizeStats quantize_fp8_avx2(const void* src, DType from, void* dst, DType format,
                                              size_t n, float scale) {
  const __m256i magnitude = set1(0x7fffffffu), inf = set1(0x7f800000u);
  const __m256i overflow = set1(std::bit_cast<uint32_t>(fp8_overflow_threshold(format)) - 1u);
  const __m256i zero = set1(std::bit_cast<uint32_t>(fp8_zero_threshold(format)));
  const __m256 s = _mm256_set1_ps(scale);
  CastOptions saturating;
  saturating.saturate = true;
  QuantizeStats st;
  __m256i max_bits = _mm256_setzero_si256(), nonfinite = _mm256_setzero_si256();
  alignas(32) float block[kBlock];
  uint8_t* q = static_cast<uint8_t*>(dst);
  size_t i = 0;
  for (; i + 8 <= n;) {
    const size_t start = i, end = std::min(n - n % 8, start + kBlock);
    for (; i < end; i += 8) {
      const __m256 x = load8(src, from, i);
      const __m256i ax = _mm256_and_si256(_mm256_castps_si256(x), magnitude);
      const __m256i finite = _mm256_cmpgt_epi32(inf, ax);
      max_bits = _mm256_max_epi32(max_bits, _mm256_and_si256(ax, finite));
      nonfinite = _mm256_or_si256(nonfinite, _mm256_andnot_si256(finite, set1(~0u)));
      st.nan += count(_mm256_cmpgt_epi32(ax, inf));
      const __m256 y = _mm256_mul_ps(x, s);
      const __m256i ay = _mm256_and_si256(_mm256_castps_si256(y), magnitude);
      // overflow threshold <= |y| <= inf (NaN excluded)
      st.saturated +=
          count(_mm256_andnot_si256(_mm256_cmpgt_epi32(ay, inf), _mm256_cmpgt_epi32(ay, overflow)));
      // x finite and non-zero, |y| below the zero threshold
      const __m256i nonzero = _mm256_cmpgt_epi32(ax, _mm256_setzero_si256());
      st.flushed +=
          count(_mm256_and_si256(_mm256_and_si256(finite, nonzero), _mm256_cmpgt_epi32(zero, ay)));
      _mm256_store_ps(block + (i - start), y);
    }
    convert(block, DType::f32, q + start, format, i - start, saturating, SimdPath::kAvx2);
  }
  // Reduce the lanes: the largest finite magnitude's bits, and whether any lane was not finite.
  alignas(32) uint32_t lanes[8], flags[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), max_bits);
  _mm256_store_si256(reinterpret_cast<__m256i*>(flags), nonfinite);
  uint32_t m = 0, any = 0;
  for (int l = 0; l < 8; ++l) {
    m = std::max(m, lanes[l]);
    any |= flags[l];
  }
  st.amax = any ? std::numeric_limits<float>::infinity() : std::bit_cast<float>(m);
  if (i < n)
    st.merge(quantize_fp8_reference(offset(src, from, i), from, q + i, format, n - i, scale));
  st.count = static_cast<int64_t>(n);
  return st;
}

MANTISSA_AVX2 float amax_avx2(const void* src, DType from, size_t n) {
  const __m256i magnitude = set1(0x7fffffffu), inf = set1(0x7f800000u);
  __m256i max_bits = _mm256_setzero_si256(), nonfinite = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i ax = _mm256_and_si256(_mm256_castps_si256(load8(src, from, i)), magnitude);
    const __m256i finite = _mm256_cmpgt_epi32(inf, ax);
    max_bits = _mm256_max_epi32(max_bits, _mm256_and_si256(ax, finite));
    nonfinite = _mm256_or_si256(nonfinite, _mm256_andnot_si256(finite, set1(~0u)));
  }
  alignas(32) uint32_t lanes[8], flags[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), max_bits);
  _mm256_store_si256(reinterpret_cast<__m256i*>(flags), nonfinite);
  uint32_t m = 0, any = 0;
  for (int l = 0; l < 8; ++l) {
    m = std::max(m, lanes[l]);
    any |= flags[l];
  }
  float result = any ? std::numeric_limits<float>::infinity() : std::bit_cast<float>(m);
  if (i < n) result = std::max(result, amax(offset(src, from, i), from, n - i, SimdPath::kScalar));
  return result;
}

}  // namespace mantissa::kernels::detail

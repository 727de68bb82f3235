// The AVX2 + FMA micro-kernel: a 6 x 16 tile of C in 12 ymm accumulators; per k, two loads of B
// and six broadcasts of A feed 12 FMAs. B is a packed sliver, or (kRows) 16 floats read in place
// from the row that b_off lists for each k.
#include <immintrin.h>

#include "mantissa/kernels/gemm_kernels.h"

#define MANTISSA_AVX2 __attribute__((target("avx2,f16c,fma")))

namespace mantissa::kernels::detail {
namespace {

MANTISSA_AVX2 inline __attribute__((always_inline)) __m256 round_f16(__m256 v) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// The 12 accumulators are named variables, not an array: GCC then keeps them in registers without
// the copies it adds around an unrolled array loop (docs/numerics.md has the figures).
#define MANTISSA_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)

template <bool kF16Partials, bool kRows>
MANTISSA_AVX2 void micro_6x16(int64_t kc, const float* a, const float* b, const int64_t* b_off,
                              float* c, int64_t ldc, bool load_c, float beta) {
#define MANTISSA_DECL(i) __m256 c##i##0, c##i##1;
  MANTISSA_ROWS(MANTISSA_DECL)
#undef MANTISSA_DECL
  if (load_c) {
    const __m256 vb = _mm256_set1_ps(beta);
    const bool scale = beta != 1.0f;
#define MANTISSA_LOAD(i)                      \
  c##i##0 = _mm256_loadu_ps(c + (i)*ldc);     \
  c##i##1 = _mm256_loadu_ps(c + (i)*ldc + 8); \
  if (scale) {                                \
    c##i##0 = _mm256_mul_ps(c##i##0, vb);     \
    c##i##1 = _mm256_mul_ps(c##i##1, vb);     \
  }
    MANTISSA_ROWS(MANTISSA_LOAD)
#undef MANTISSA_LOAD
  } else {
#define MANTISSA_ZERO(i) c##i##0 = c##i##1 = _mm256_setzero_ps();
    MANTISSA_ROWS(MANTISSA_ZERO)
#undef MANTISSA_ZERO
  }
#define MANTISSA_FMA(i)                      \
  x = _mm256_broadcast_ss(a + (i));          \
  c##i##0 = _mm256_fmadd_ps(x, b0, c##i##0); \
  c##i##1 = _mm256_fmadd_ps(x, b1, c##i##1);
#define MANTISSA_ROUND(i)       \
  c##i##0 = round_f16(c##i##0); \
  c##i##1 = round_f16(c##i##1);
  for (int64_t k = 0; k < kc; ++k) {
    __m256 b0, b1;
    if constexpr (kRows) {
      const float* row = b + b_off[k];
      b0 = _mm256_loadu_ps(row);
      b1 = _mm256_loadu_ps(row + 8);
    } else {
      // Packed B slivers are 64-byte aligned (kc x 16 floats each, in an aligned buffer).
      b0 = _mm256_load_ps(b);
      b1 = _mm256_load_ps(b + 8);
      b += kNR;
    }
    __m256 x;
    MANTISSA_ROWS(MANTISSA_FMA)
    a += kMR;
    if constexpr (kF16Partials) {
      if ((k + 1) % 16 == 0) {
        MANTISSA_ROWS(MANTISSA_ROUND)
      }
    }
  }
  if constexpr (kF16Partials) {
    MANTISSA_ROWS(MANTISSA_ROUND)
  }
#define MANTISSA_STORE(i)                 \
  _mm256_storeu_ps(c + (i)*ldc, c##i##0); \
  _mm256_storeu_ps(c + (i)*ldc + 8, c##i##1);
  MANTISSA_ROWS(MANTISSA_STORE)
#undef MANTISSA_STORE
#undef MANTISSA_ROUND
#undef MANTISSA_FMA
}
#undef MANTISSA_ROWS

MANTISSA_AVX2 void micro_kernel(int64_t kc, const float* a, const float* b, float* c, int64_t ldc,
                                bool load_c, float beta, bool f16_partials) {
  if (f16_partials)
    micro_6x16<true, false>(kc, a, b, nullptr, c, ldc, load_c, beta);
  else
    micro_6x16<false, false>(kc, a, b, nullptr, c, ldc, load_c, beta);
}

MANTISSA_AVX2 void rows_micro_kernel(int64_t kc, const float* a, const float* b,
                                     const int64_t* b_off, float* c, int64_t ldc, bool load_c,
                                     float beta, bool f16_partials) {
  if (f16_partials)
    micro_6x16<true, true>(kc, a, b, b_off, c, ldc, load_c, beta);
  else
    micro_6x16<false, true>(kc, a, b, b_off, c, ldc, load_c, beta);
}

// 8 x 8 transposes: rows of the source become columns of the destination.
MANTISSA_AVX2 void interleave(const float* const* line, int rows, int64_t kc, float* dst,
                              int64_t dst_stride) {
  const __m256i mask =
      _mm256_cmpgt_epi32(_mm256_set1_epi32(rows), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  int64_t k = 0;
  for (; k + 8 <= kc; k += 8) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i)
      r[i] = i < rows ? _mm256_loadu_ps(line[i] + k) : _mm256_setzero_ps();
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    const __m256 out[8] = {
        _mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
        _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
        _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
        _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
    // Full 8-wide stores where they are safe: 8 rows, or rows that fill the stride exactly (the
    // 8 - rows extra values land where the next position is written next; callers leave 8 floats
    // of slack after the last). Masked stores (slow on AMD) only for ragged edges.
    if (rows == 8 || rows == dst_stride) {
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(dst + (k + j) * dst_stride, out[j]);
    } else {
      for (int j = 0; j < 8; ++j) _mm256_maskstore_ps(dst + (k + j) * dst_stride, mask, out[j]);
    }
  }
  for (; k < kc; ++k)
    for (int i = 0; i < rows; ++i) dst[k * dst_stride + i] = line[i][k];
}

}  // namespace

MicroKernel avx2_micro_kernel() { return micro_kernel; }
RowsMicroKernel avx2_rows_micro_kernel() { return rows_micro_kernel; }
InterleaveFn avx2_interleave() { return interleave; }

}  // namespace mantissa::kernels::detail

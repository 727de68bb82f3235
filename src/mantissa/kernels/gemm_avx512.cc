// The AVX-512 micro-kernels: a 6 x 32 tile of C in 12 zmm accumulators from two 16-column slivers
// of B (per k, two loads of B and six broadcasts of A feed 12 FMAs, twice the AVX2 tile's work
// per instruction), and a 6 x 16 tile in 6 zmm for a sliver without a partner. B is packed, or
// (kRows) read in place from the rows that b_off lists. Each element of C is the same FMA chain
// over k as on the other paths, so the bits are the same.
#include <immintrin.h>

#include <cstdlib>

#include "mantissa/core/convert_simd512_internal.h"
#include "mantissa/kernels/gemm_kernels.h"

#define MANTISSA_AVX512 MANTISSA_AVX512_TARGET

namespace mantissa::kernels::detail {
namespace {

// Sixteen values of a B row at p (element k of the row at p + k), as FP32: stored FP32, 16-bit
// values widened (exact), or FP32 values rounded to nearest even to 16 bits (the values of B's
// 16-bit copy, convert()'s rounding bit for bit: core/convert_simd512_internal.h).
template <int kLoad>
MANTISSA_AVX512 inline __attribute__((always_inline)) __m512 load_b16(const void* p) {
  if constexpr (kLoad == kLoadF32) {
    return _mm512_loadu_ps(p);
  } else if constexpr (kLoad == kLoadF16) {
    return simd512::from_f16x16(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  } else if constexpr (kLoad == kLoadBF16) {
    return simd512::from_bf16x16(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  } else if constexpr (kLoad == kLoadF32AsF16) {
    return simd512::round_through_f16(_mm512_loadu_ps(p));
  } else {
    static_assert(kLoad == kLoadF32AsBF16);
    return simd512::round_through_bf16(_mm512_loadu_ps(p));
  }
}

// Element e of a B row as bytes (B's element size by kLoad).
template <int kLoad>
inline const void* b_at(const void* b, int64_t e) {
  constexpr int64_t es = (kLoad == kLoadF16 || kLoad == kLoadBF16) ? 2 : 4;
  return static_cast<const char*>(b) + e * es;
}

// B rows read in place: a tile reads sixteen or thirty-two values of each of kc rows. Where the
// rows lie far apart (a linear layer's weight rows: 41,772 floats apart in the tutorial CNN's
// fc1), they are more streams than the hardware prefetcher follows, so the loads wait on memory,
// and a tile with more work per value (rounding FP32 to 16 bits as it reads) hides less of the
// wait: such a tile fetches its rows' values 256 bytes ahead (two 32-column tiles in FP32 rows,
// four in 16-bit ones) while it computes. fc1's input gradient at batch 12 (12 x 100 by 100 x
// 41,772, best of 40 calls on 2 threads, 2-core Xeon, 2026-11-27): FP32 B 0.61-0.68 -> 0.58 ms,
// FP32 read as FP16 0.84-0.88 -> 0.60-0.62, FP16 0.60-0.69 -> 0.45-0.48 (distances of 128 to
// 2048 bytes tried). Rows close together (an implicit convolution's taps: shifts of one padded
// chunk, which is in cache) are not prefetched.
constexpr int64_t kRowPrefetchBytes = 256;
template <int kLoad>
inline bool rows_far_apart(int64_t kc, const int64_t* b_off) {
  constexpr int64_t es = (kLoad == kLoadF16 || kLoad == kLoadBF16) ? 2 : 4;
  return kc > 1 && std::abs(b_off[1] - b_off[0]) * es >= 4096;
}
MANTISSA_AVX512 inline __attribute__((always_inline)) void prefetch_row_ahead(const void* p,
                                                                              bool far) {
  if (far) _mm_prefetch(static_cast<const char*>(p) + kRowPrefetchBytes, _MM_HINT_T0);
}

// The accumulators are named variables (as in the AVX2 kernel), so GCC keeps them in registers.
#define MANTISSA_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)

// The rows of a 32-column tile of C, two zmm a row (c<i>0, c<i>1), over a row list ROWS (a macro
// applying its argument to each row index): declared and started from beta * C (load_c) or from
// zero, and stored.
#define MANTISSA_PAIR_DECL(i) __m512 c##i##0, c##i##1;
#define MANTISSA_PAIR_LOAD(i)                  \
  c##i##0 = _mm512_loadu_ps(c + (i)*ldc);      \
  c##i##1 = _mm512_loadu_ps(c + (i)*ldc + 16); \
  if (scale) {                                 \
    c##i##0 = _mm512_mul_ps(c##i##0, vb);      \
    c##i##1 = _mm512_mul_ps(c##i##1, vb);      \
  }
#define MANTISSA_PAIR_ZERO(i) c##i##0 = c##i##1 = _mm512_setzero_ps();
#define MANTISSA_PAIR_START(ROWS)           \
  ROWS(MANTISSA_PAIR_DECL)                  \
  if (load_c) {                             \
    const __m512 vb = _mm512_set1_ps(beta); \
    const bool scale = beta != 1.0f;        \
    ROWS(MANTISSA_PAIR_LOAD)                \
  } else {                                  \
    ROWS(MANTISSA_PAIR_ZERO)                \
  }
#define MANTISSA_PAIR_STORE(i)            \
  _mm512_storeu_ps(c + (i)*ldc, c##i##0); \
  _mm512_storeu_ps(c + (i)*ldc + 16, c##i##1);

// 6 x 32: columns 0-15 from b0, 16-31 from b1 (packed slivers of kc x 16, 64-byte aligned, or
// row k at b0 + b_off[k] and b1 + b_off[k] with kRows).
template <bool kF16Partials, bool kRows, int kLoad = kLoadF32>
MANTISSA_AVX512 void micro_6x32(int64_t kc, const float* a, const void* b0v, const void* b1v,
                                const int64_t* b_off, float* c, int64_t ldc, bool load_c,
                                float beta) {
  const float* b0 = static_cast<const float*>(b0v);
  const float* b1 = static_cast<const float*>(b1v);
  MANTISSA_PAIR_START(MANTISSA_ROWS)
#define MANTISSA_FMA(i)                      \
  x = _mm512_set1_ps(a[i]);                  \
  c##i##0 = _mm512_fmadd_ps(x, v0, c##i##0); \
  c##i##1 = _mm512_fmadd_ps(x, v1, c##i##1);
#define MANTISSA_ROUND(i)                        \
  c##i##0 = simd512::round_through_f16(c##i##0); \
  c##i##1 = simd512::round_through_f16(c##i##1);
  const bool far = kRows && rows_far_apart<kLoad>(kc, b_off);
  for (int64_t k = 0; k < kc; ++k) {
    __m512 v0, v1;
    if constexpr (kRows) {
      const void* p0 = b_at<kLoad>(b0v, b_off[k]);
      const void* p1 = b_at<kLoad>(b1v, b_off[k]);
      prefetch_row_ahead(p0, far);
      prefetch_row_ahead(p1, far);
      v0 = load_b16<kLoad>(p0);
      v1 = load_b16<kLoad>(p1);
    } else {
      v0 = _mm512_load_ps(b0);
      v1 = _mm512_load_ps(b1);
      b0 += kNR;
      b1 += kNR;
    }
    __m512 x;
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
  MANTISSA_ROWS(MANTISSA_PAIR_STORE)
#undef MANTISSA_ROUND
#undef MANTISSA_FMA
}

// 12 x 32 from B rows read in place (row k of the slivers at b0 + b_off[k] and b1 + b_off[k]),
// FP32 partials: two packed A slivers, rows 0-5 at a and rows 6-11 at a + kc * kMR, so each B
// value is loaded (widened, or rounded as B's 16-bit copy holds it) once for twelve rows of A,
// where two 6 x 32 tiles load it twice. Per k, two B vectors and twelve broadcasts feed 24 FMAs
// (24 accumulators, 27 of the 32 zmm registers). Every element is the 6 x 32 tile's FMA chain.
#define MANTISSA_ROWS12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
template <int kLoad>
MANTISSA_AVX512 void micro_12x32_rows(int64_t kc, const float* a, const void* b0v, const void* b1v,
                                      const int64_t* b_off, float* c, int64_t ldc, bool load_c,
                                      float beta) {
  const float* a_hi = a + kc * kMR;
  MANTISSA_PAIR_START(MANTISSA_ROWS12)
#define MANTISSA_FMA(i)                                           \
  x = _mm512_set1_ps((i) < kMR ? a[(i) % kMR] : a_hi[(i) % kMR]); \
  c##i##0 = _mm512_fmadd_ps(x, v0, c##i##0);                      \
  c##i##1 = _mm512_fmadd_ps(x, v1, c##i##1);
  const bool far = rows_far_apart<kLoad>(kc, b_off);
  for (int64_t k = 0; k < kc; ++k) {
    const void* p0 = b_at<kLoad>(b0v, b_off[k]);
    const void* p1 = b_at<kLoad>(b1v, b_off[k]);
    prefetch_row_ahead(p0, far);
    prefetch_row_ahead(p1, far);
    const __m512 v0 = load_b16<kLoad>(p0);
    const __m512 v1 = load_b16<kLoad>(p1);
    __m512 x;
    MANTISSA_ROWS12(MANTISSA_FMA)
    a += kMR;
    a_hi += kMR;
  }
#undef MANTISSA_FMA
  MANTISSA_ROWS12(MANTISSA_PAIR_STORE)
}
#undef MANTISSA_ROWS12
#undef MANTISSA_PAIR_STORE
#undef MANTISSA_PAIR_START
#undef MANTISSA_PAIR_ZERO
#undef MANTISSA_PAIR_LOAD
#undef MANTISSA_PAIR_DECL

// 6 x 16: one sliver, one zmm per row.
template <bool kF16Partials, bool kRows, int kLoad = kLoadF32>
MANTISSA_AVX512 void micro_6x16(int64_t kc, const float* a, const void* bv, const int64_t* b_off,
                                float* c, int64_t ldc, bool load_c, float beta) {
  const float* b = static_cast<const float*>(bv);
#define MANTISSA_DECL(i) __m512 c##i;
  MANTISSA_ROWS(MANTISSA_DECL)
#undef MANTISSA_DECL
  if (load_c) {
    const __m512 vb = _mm512_set1_ps(beta);
    const bool scale = beta != 1.0f;
#define MANTISSA_LOAD(i)               \
  c##i = _mm512_loadu_ps(c + (i)*ldc); \
  if (scale) c##i = _mm512_mul_ps(c##i, vb);
    MANTISSA_ROWS(MANTISSA_LOAD)
#undef MANTISSA_LOAD
  } else {
#define MANTISSA_ZERO(i) c##i = _mm512_setzero_ps();
    MANTISSA_ROWS(MANTISSA_ZERO)
#undef MANTISSA_ZERO
  }
#define MANTISSA_FMA(i) c##i = _mm512_fmadd_ps(_mm512_set1_ps(a[i]), v, c##i);
#define MANTISSA_ROUND(i) c##i = simd512::round_through_f16(c##i);
  const bool far = kRows && rows_far_apart<kLoad>(kc, b_off);
  for (int64_t k = 0; k < kc; ++k) {
    __m512 v;
    if constexpr (kRows) {
      const void* p = b_at<kLoad>(bv, b_off[k]);
      prefetch_row_ahead(p, far);
      v = load_b16<kLoad>(p);
    } else {
      v = _mm512_load_ps(b);
      b += kNR;
    }
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
#define MANTISSA_STORE(i) _mm512_storeu_ps(c + (i)*ldc, c##i);
  MANTISSA_ROWS(MANTISSA_STORE)
#undef MANTISSA_STORE
#undef MANTISSA_ROUND
#undef MANTISSA_FMA
}
#undef MANTISSA_ROWS

MANTISSA_AVX512 void micro_kernel(int64_t kc, const float* a, const float* b, float* c, int64_t ldc,
                                  bool load_c, float beta, bool f16_partials) {
  if (f16_partials)
    micro_6x16<true, false>(kc, a, b, nullptr, c, ldc, load_c, beta);
  else
    micro_6x16<false, false>(kc, a, b, nullptr, c, ldc, load_c, beta);
}

MANTISSA_AVX512 void rows_micro_kernel(int64_t kc, const float* a, const float* b,
                                       const int64_t* b_off, float* c, int64_t ldc, bool load_c,
                                       float beta, bool f16_partials) {
  if (f16_partials)
    micro_6x16<true, true>(kc, a, b, b_off, c, ldc, load_c, beta);
  else
    micro_6x16<false, true>(kc, a, b, b_off, c, ldc, load_c, beta);
}

MANTISSA_AVX512 void pair_micro_kernel(int64_t kc, const float* a, const float* b0, const float* b1,
                                       float* c, int64_t ldc, bool load_c, float beta,
                                       bool f16_partials) {
  if (f16_partials)
    micro_6x32<true, false>(kc, a, b0, b1, nullptr, c, ldc, load_c, beta);
  else
    micro_6x32<false, false>(kc, a, b0, b1, nullptr, c, ldc, load_c, beta);
}

MANTISSA_AVX512 void pair_rows_micro_kernel(int64_t kc, const float* a, const float* b0,
                                            const float* b1, const int64_t* b_off, float* c,
                                            int64_t ldc, bool load_c, float beta,
                                            bool f16_partials) {
  if (f16_partials)
    micro_6x32<true, true>(kc, a, b0, b1, b_off, c, ldc, load_c, beta);
  else
    micro_6x32<false, true>(kc, a, b0, b1, b_off, c, ldc, load_c, beta);
}

template <int kLoad>
MANTISSA_AVX512 void rows16_micro_kernel(int64_t kc, const float* a, const void* b,
                                         const int64_t* b_off, float* c, int64_t ldc, bool load_c,
                                         float beta, bool f16_partials) {
  if (f16_partials)
    micro_6x16<true, true, kLoad>(kc, a, b, b_off, c, ldc, load_c, beta);
  else
    micro_6x16<false, true, kLoad>(kc, a, b, b_off, c, ldc, load_c, beta);
}

template <int kLoad>
MANTISSA_AVX512 void pair_rows16_micro_kernel(int64_t kc, const float* a, const void* b0,
                                              const void* b1, const int64_t* b_off, float* c,
                                              int64_t ldc, bool load_c, float beta,
                                              bool f16_partials) {
  if (f16_partials)
    micro_6x32<true, true, kLoad>(kc, a, b0, b1, b_off, c, ldc, load_c, beta);
  else
    micro_6x32<false, true, kLoad>(kc, a, b0, b1, b_off, c, ldc, load_c, beta);
}

}  // namespace

namespace {
MANTISSA_AVX512 void store_block(const float* src, int64_t src_ld, int64_t rows, int64_t cols,
                                 void* dst, int64_t dst_rs, DType t, DType round) {
  const int64_t es = t == DType::f32 ? 4 : 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = src + r * src_ld;
    char* d = static_cast<char*>(dst) + r * dst_rs * es;
    for (int64_t j = 0; j < cols; j += 16) {
      const __mmask16 m =
          cols - j >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (cols - j)) - 1);
      __m512 v = _mm512_maskz_loadu_ps(m, s + j);
      if (round == DType::f16)
        v = simd512::round_through_f16(v);
      else if (round == DType::bf16)
        v = simd512::round_through_bf16(v);
      if (t == DType::f32)
        _mm512_mask_storeu_ps(d + j * es, m, v);
      else
        _mm256_mask_storeu_epi16(d + j * es, m,
                                 t == DType::f16 ? simd512::to_f16x16(v) : simd512::to_bf16x16(v));
    }
  }
}
}  // namespace

StoreBlockFn avx512_store_block() { return store_block; }
MicroKernel avx512_micro_kernel() { return micro_kernel; }
RowsMicroKernel avx512_rows_micro_kernel() { return rows_micro_kernel; }
PairMicroKernel avx512_pair_micro_kernel() { return pair_micro_kernel; }
PairRowsMicroKernel avx512_pair_rows_micro_kernel() { return pair_rows_micro_kernel; }

Rows16MicroKernel avx512_rows16_micro_kernel(int load) {
  switch (load) {
    case kLoadF16:
      return rows16_micro_kernel<kLoadF16>;
    case kLoadBF16:
      return rows16_micro_kernel<kLoadBF16>;
    case kLoadF32AsF16:
      return rows16_micro_kernel<kLoadF32AsF16>;
    case kLoadF32AsBF16:
      return rows16_micro_kernel<kLoadF32AsBF16>;
  }
  return nullptr;
}

Pair12RowsMicroKernel avx512_pair12_rows_micro_kernel(int load) {
  switch (load) {
    case kLoadF32:
      return micro_12x32_rows<kLoadF32>;
    case kLoadF16:
      return micro_12x32_rows<kLoadF16>;
    case kLoadBF16:
      return micro_12x32_rows<kLoadBF16>;
    case kLoadF32AsF16:
      return micro_12x32_rows<kLoadF32AsF16>;
    case kLoadF32AsBF16:
      return micro_12x32_rows<kLoadF32AsBF16>;
  }
  return nullptr;
}

PairRows16MicroKernel avx512_pair_rows16_micro_kernel(int load) {
  switch (load) {
    case kLoadF16:
      return pair_rows16_micro_kernel<kLoadF16>;
    case kLoadBF16:
      return pair_rows16_micro_kernel<kLoadBF16>;
    case kLoadF32AsF16:
      return pair_rows16_micro_kernel<kLoadF32AsF16>;
    case kLoadF32AsBF16:
      return pair_rows16_micro_kernel<kLoadF32AsBF16>;
  }
  return nullptr;
}

}  // namespace mantissa::kernels::detail

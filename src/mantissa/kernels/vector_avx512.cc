// The AVX-512 versions of vector_kernels.h's ReLU rows, FMA rows and direct convolution rows (6
// outputs by 32 columns a strip, stored in the output's type from the registers), and the tile of
// the lane-split dot products: up to 12 rows of A by 4 rows of B. A zmm register holds the eight
// lanes of two outputs side by side, (A row i, B row j) and (i, j + 1): B's rows are read (widened,
// or rounded as read) in pairs into one register, A's eight values broadcast to both halves, and
// each FMA advances both outputs' lanes. Per eight columns, 2 B pairs and 12 broadcasts of A feed
// 24 FMAs; each B value is read, widened or rounded once for all of A's rows (the AVX2 tile: once
// for every three). Every lane is the same FMA chain as on the other paths, so the bits are the
// same. Also Winograd's input, output-gradient and output transforms, sixteen tiles a vector.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "mantissa/core/convert_simd512_internal.h"
#include "mantissa/kernels/vector_kernels.h"

#define MANTISSA_AVX512 MANTISSA_AVX512_TARGET

namespace mantissa::kernels::detail {
namespace {

constexpr int kTileB = 4;  // B rows of a tile: two pairs

// Eight FP32 values at lo (lanes 0-7) and at hi (lanes 8-15) in one register, and back. (The
// zero-masking forms: the plain ones pass GCC 12 an undefined source that -Wuninitialized reports.)
MANTISSA_AVX512 inline __attribute__((always_inline)) __m512 lanes_pair(const float* lo,
                                                                        const float* hi) {
  return _mm512_maskz_insertf32x8(0xffff, _mm512_maskz_loadu_ps(0x00ff, lo), _mm256_loadu_ps(hi),
                                  1);
}
// Eight values at element k of B rows r0 and r1 (lanes 0-7 and 8-15), as FP32, read as L says.
template <DotRow L>
MANTISSA_AVX512 inline __attribute__((always_inline)) __m512 b_pair(const void* r0, const void* r1,
                                                                    int64_t k) {
  if constexpr (L == DotRow::kF16 || L == DotRow::kBF16) {
    const __m256i h = _mm256_maskz_inserti32x4(
        0xff, _mm256_maskz_loadu_epi16(0x00ff, static_cast<const uint16_t*>(r0) + k),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(r1) + k)), 1);
    return L == DotRow::kF16 ? simd512::from_f16x16(h) : simd512::from_bf16x16(h);
  } else {
    const __m512 x =
        lanes_pair(static_cast<const float*>(r0) + k, static_cast<const float*>(r1) + k);
    if constexpr (L == DotRow::kF32) return x;
    if constexpr (L == DotRow::kF32AsF16) return simd512::round_through_f16(x);
    if constexpr (L == DotRow::kF32AsBF16) return simd512::round_through_bf16(x);
  }
}

// The pair's lanes back to lo and hi.
MANTISSA_AVX512 inline void store_lanes_pair(float* lo, float* hi, __m512 v) {
  _mm256_storeu_ps(lo, _mm512_maskz_extractf32x8_ps(0xff, v, 0));
  _mm256_storeu_ps(hi, _mm512_maskz_extractf32x8_ps(0xff, v, 1));
}

// RA rows of A against four rows of B (rows past rows_b repeat the last one; their lanes go to
// a scratch block), columns [k0, k8), k8 - k0 a multiple of 8.
template <DotRow L, int RA>
MANTISSA_AVX512 void tile(int rows_b, int64_t k0, int64_t k8, const float* const* a,
                          const void* const* b, float* const* P) {
  alignas(32) float scratch[8] = {};
  const void* br[kTileB];
  float* lanes[RA][kTileB];
  for (int j = 0; j < kTileB; ++j) br[j] = b[std::min(j, rows_b - 1)];
  for (int i = 0; i < RA; ++i)
    for (int j = 0; j < kTileB; ++j) lanes[i][j] = j < rows_b ? P[i * kTileB + j] : scratch;
  __m512 acc[RA][2];
#pragma GCC unroll 12
  for (int i = 0; i < RA; ++i) {
    acc[i][0] = lanes_pair(lanes[i][0], lanes[i][1]);
    acc[i][1] = lanes_pair(lanes[i][2], lanes[i][3]);
  }
  for (int64_t k = k0; k < k8; k += 8) {
    const __m512 b01 = b_pair<L>(br[0], br[1], k), b23 = b_pair<L>(br[2], br[3], k);
#pragma GCC unroll 12
    for (int i = 0; i < RA; ++i) {
      const __m512 x = _mm512_maskz_broadcast_f32x8(0xffff, _mm256_loadu_ps(a[i] + k));
      acc[i][0] = _mm512_fmadd_ps(x, b01, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(x, b23, acc[i][1]);
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < RA; ++i) {
    store_lanes_pair(lanes[i][0], lanes[i][1], acc[i][0]);
    store_lanes_pair(lanes[i][2], lanes[i][3], acc[i][1]);
  }
}

template <DotRow L>
void tile_rows(int rows_a, int rows_b, int64_t k0, int64_t k8, const float* const* a,
               const void* const* b, float* const* P) {
  switch (rows_a) {
#define MANTISSA_TILE(r) \
  case r:                \
    return tile<L, r>(rows_b, k0, k8, a, b, P);
    MANTISSA_TILE(1)
    MANTISSA_TILE(2)
    MANTISSA_TILE(3)
    MANTISSA_TILE(4)
    MANTISSA_TILE(5)
    MANTISSA_TILE(6)
    MANTISSA_TILE(7)
    MANTISSA_TILE(8)
    MANTISSA_TILE(9)
    MANTISSA_TILE(10)
    MANTISSA_TILE(11)
    MANTISSA_TILE(12)
#undef MANTISSA_TILE
  }
}

// Element i of a row of storage t, as bytes.
inline const char* at(const void* p, DType t, int64_t i) {
  return static_cast<const char*>(p) + i * static_cast<int64_t>(dtype_size(t));
}
inline char* at(void* p, DType t, int64_t i) {
  return static_cast<char*>(p) + i * static_cast<int64_t>(dtype_size(t));
}

// Sixteen FP32 results into y's storage yt at element i, the lanes `m` selects: stored as they
// are, or rounded to nearest even into f16 / bf16 (convert()'s rounding).
MANTISSA_AVX512 inline void store_lanes(void* y, DType yt, int64_t i, __m512 v, __mmask16 m) {
  if (yt == DType::f32)
    _mm512_mask_storeu_ps(static_cast<float*>(y) + i, m, v);
  else
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + i, m,
                             yt == DType::f16 ? simd512::to_f16x16(v) : simd512::to_bf16x16(v));
}

// a * b rounded to FP32 before anything adds it: the empty asm hides the product from the
// compiler, which would otherwise fuse the multiply and the following add into an FMA.
MANTISSA_AVX512 inline __attribute__((always_inline)) __m512 rounded_product(__m512 a, __m512 b) {
  __m512 p = _mm512_mul_ps(a, b);
  __asm__("" : "+v"(p));
  return p;
}

// Column strips of OB output rows by 16 * V columns from column j (the last vector loads and
// stores only the lanes `last` selects), and the loop over a row's strips: the last 1-31 columns
// are one strip whose last vector is masked (or whole).
template <class Strip>
MANTISSA_AVX512 inline __attribute__((always_inline)) void for_strips(int64_t n, Strip&& strip) {
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) strip(j, std::integral_constant<int, 2>{}, __mmask16{0xffff});
  const int64_t r = n - j;
  if (r == 0) return;
  const int64_t in_last = r > 16 ? r - 16 : r;
  const __mmask16 mask = static_cast<__mmask16>((1u << in_last) - 1);
  if (r > 16)
    strip(j, std::integral_constant<int, 2>{}, mask);
  else
    strip(j, std::integral_constant<int, 1>{}, mask);
}

// The two row kernels' arithmetic (vector_kernels.h), each element in its own lane:
//   kFma (fma_rows): an FMA chain over the taps in order from zero, then + bias (0 when null);
//   kProducts (conv_rows): from the bias, each tap's product rounded and then added, taps in order,
//     tap i's weight at column tap[i].
enum class RowSums { kFma, kProducts };

// A strip of OB output rows by 16 * V columns from column j, the last vector loading and storing
// only the lanes `last` selects.
template <RowSums S, int OB, int V>
MANTISSA_AVX512 inline void row_strip(void* y, DType yt, int64_t ys, const float* bias,
                                      const float* w, int64_t ws, const int64_t* tap,
                                      const float* const* x, int64_t taps, int64_t j,
                                      __mmask16 last) {
  constexpr bool kFma = S == RowSums::kFma;
  __m512 acc[OB][V];
#pragma GCC unroll 8
  for (int o = 0; o < OB; ++o)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) acc[o][v] = kFma ? _mm512_setzero_ps() : _mm512_set1_ps(bias[o]);
  for (int64_t i = 0; i < taps; ++i) {
    __m512 xv[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v)
      xv[v] = _mm512_maskz_loadu_ps(v == V - 1 ? last : __mmask16{0xffff}, x[i] + j + 16 * v);
    const int64_t col = kFma ? i : tap[i];
#pragma GCC unroll 8
    for (int o = 0; o < OB; ++o) {
      const __m512 wv = _mm512_set1_ps(w[o * ws + col]);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v)
        acc[o][v] = kFma ? _mm512_fmadd_ps(wv, xv[v], acc[o][v])
                         : _mm512_add_ps(acc[o][v], rounded_product(wv, xv[v]));
    }
  }
#pragma GCC unroll 8
  for (int o = 0; o < OB; ++o) {
    const __m512 b = _mm512_set1_ps(kFma && bias ? bias[o] : 0.0f);
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v)
      store_lanes(y, yt, o * ys + j + 16 * v, kFma ? _mm512_add_ps(acc[o][v], b) : acc[o][v],
                  v == V - 1 ? last : __mmask16{0xffff});
  }
}

template <RowSums S, int OB>
MANTISSA_AVX512 void row_block(void* y, DType yt, int64_t ys, const float* bias, const float* w,
                               int64_t ws, const int64_t* tap, const float* const* x, int64_t taps,
                               int64_t n) {
  for_strips(n, [&](int64_t j, auto v, __mmask16 last) {
    row_strip<S, OB, decltype(v)::value>(y, yt, ys, bias, w, ws, tap, x, taps, j, last);
  });
}

// Output rows in blocks of up to 6 (12 zmm sums over 32 columns, 2 input vectors, a weight).
template <RowSums S>
MANTISSA_AVX512 void rows(void* y, DType yt, int64_t ys, int64_t O, const float* bias,
                          const float* w, int64_t ws, const int64_t* tap, const float* const* x,
                          int64_t taps, int64_t n) {
  using Block = void (*)(void*, DType, int64_t, const float*, const float*, int64_t, const int64_t*,
                         const float* const*, int64_t, int64_t);
  static constexpr Block kBlocks[] = {row_block<S, 1>, row_block<S, 2>, row_block<S, 3>,
                                      row_block<S, 4>, row_block<S, 5>, row_block<S, 6>};
  const size_t es = dtype_size(yt);
  for (int64_t o0 = 0; o0 < O; o0 += 6)
    kBlocks[std::min<int64_t>(6, O - o0) - 1](
        static_cast<char*>(y) + static_cast<size_t>(o0 * ys) * es, yt, ys,
        bias ? bias + o0 : nullptr, w + o0 * ws, ws, tap, x, taps, n);
}

}  // namespace

// Sixteen windows at a time: the gradient (0 + g) masked by each window position, positions 0 and
// 1 interleaved into 32 columns of r0, 2 and 3 into r1; the last 1-15 windows masked.
MANTISSA_AVX512 void max_pool_2x2_backward_row_avx512(const void* g, DType tg, const uint8_t* codes,
                                                      int64_t n, void* r0, void* r1, DType ty) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  // Lane i's code: bits 2i and 2i + 1 of the 32 bits of sixteen windows' codes.
  const __m512i shift =
      _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i hi =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const size_t sg = dtype_size(tg);
  for (int64_t j = 0; j < n; j += 16) {
    const int64_t m = std::min<int64_t>(16, n - j);
    const __mmask16 in = static_cast<__mmask16>((1u << m) - 1);
    __m512 gv;
    if (tg == DType::f32)
      gv = _mm512_maskz_loadu_ps(in, static_cast<const float*>(g) + j);
    else
      gv = simd512::from_half16(
          _mm256_maskz_loadu_epi16(in, static_cast<const char*>(g) + j * static_cast<int64_t>(sg)),
          tg);
    gv = _mm512_add_ps(_mm512_setzero_ps(), gv);
    // The codes of these windows: (m + 3) / 4 bytes, widened to each lane and shifted to its own.
    const __mmask16 code_bytes = static_cast<__mmask16>((1u << ((m + 3) / 4)) - 1);
    const int word = _mm_cvtsi128_si32(_mm_maskz_loadu_epi8(code_bytes, codes + j / 4));
    const __m512i a = _mm512_and_si512(
        _mm512_maskz_srlv_epi32(0xffff, _mm512_set1_epi32(word), shift), _mm512_set1_epi32(3));
    __m512 v[4];
    for (int k = 0; k < 4; ++k)
      v[k] = _mm512_maskz_mov_ps(_mm512_cmpeq_epi32_mask(a, _mm512_set1_epi32(k)) & in, gv);
    // Columns [2j, 2j + 2m): 2m lanes, the first 16 in the low store.
    const int64_t cols = 2 * m;
    const __mmask16 first =
        cols >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << cols) - 1);
    const __mmask16 second =
        cols > 16 ? static_cast<__mmask16>((1u << (cols - 16)) - 1) : __mmask16{0};
    void* rows[2] = {r0, r1};
    for (int r = 0; r < 2; ++r) {
      store_lanes(rows[r], ty, 2 * j, _mm512_permutex2var_ps(v[2 * r], lo, v[2 * r + 1]), first);
      if (second)
        store_lanes(rows[r], ty, 2 * j + 16, _mm512_permutex2var_ps(v[2 * r], hi, v[2 * r + 1]),
                    second);
    }
  }
}

void fma_rows_avx512(void* y, DType yt, int64_t ys, int64_t O, const float* bias, const float* w,
                     int64_t ws, const float* const* x, int64_t taps, int64_t n) {
  rows<RowSums::kFma>(y, yt, ys, O, bias, w, ws, nullptr, x, taps, n);
}

void conv_rows_avx512(void* y, DType yt, int64_t ys, int64_t O, const float* bias, const float* w,
                      int64_t ws, const int64_t* tap, const float* const* x, int64_t taps,
                      int64_t n) {
  rows<RowSums::kProducts>(y, yt, ys, O, bias, w, ws, tap, x, taps, n);
}

// ReLU rows sixteen values a vector (the AVX2 functions' comparisons, lane for lane; convert()'s
// rounding on the stores), the last n % 16 through the AVX2 rows.
MANTISSA_AVX512 void relu_row_avx512(const void* x, DType tx, void* y, DType ty, int64_t n) {
  const __m512 zero = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = simd512::load16(at(x, tx, i), tx);
    // x > 0 || x != x ? x : 0, lane by lane (greater-than, or unordered).
    const __mmask16 keep =
        _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ) | _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    simd512::store16(at(y, ty, i), ty, _mm512_maskz_mov_ps(keep, v));
  }
  if (i < n) relu_row_avx2(at(x, tx, i), tx, at(y, ty, i), ty, n - i);
}

MANTISSA_AVX512 void relu_backward_row_avx512(const void* g, DType tg, const void* y, DType ty,
                                              void* dx, DType td, int64_t n) {
  const __m512 zero = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    // g where not y <= 0 (y > 0, or NaN), else +0: the bits of g masked, as the FP32 loop.
    const __mmask16 keep = _mm512_cmp_ps_mask(simd512::load16(at(y, ty, i), ty), zero, _CMP_NLE_UQ);
    simd512::store16(at(dx, td, i), td,
                     _mm512_maskz_mov_ps(keep, simd512::load16(at(g, tg, i), tg)));
  }
  if (i < n) relu_backward_row_avx2(at(g, tg, i), tg, at(y, ty, i), ty, at(dx, td, i), td, n - i);
}

void dot_lanes_tile_avx512(DotRow kind, int rows_a, int rows_b, int64_t k0, int64_t k1,
                           const float* const* a, const void* const* b, float* const* P) {
  const int64_t k8 = k0 + (k1 - k0) / 8 * 8;
  switch (kind) {
    case DotRow::kF32:
      tile_rows<DotRow::kF32>(rows_a, rows_b, k0, k8, a, b, P);
      break;
    case DotRow::kF16:
      tile_rows<DotRow::kF16>(rows_a, rows_b, k0, k8, a, b, P);
      break;
    case DotRow::kBF16:
      tile_rows<DotRow::kBF16>(rows_a, rows_b, k0, k8, a, b, P);
      break;
    case DotRow::kF32AsF16:
      tile_rows<DotRow::kF32AsF16>(rows_a, rows_b, k0, k8, a, b, P);
      break;
    case DotRow::kF32AsBF16:
      tile_rows<DotRow::kF32AsBF16>(rows_a, rows_b, k0, k8, a, b, P);
      break;
  }
  if (k8 == k1) return;
  // The tail columns, one at a time into their lanes: the AVX2 tile's, three rows of A at a time.
  for (int i0 = 0; i0 < rows_a; i0 += 3)
    dot_lanes_tile_avx2(kind, std::min(3, rows_a - i0), rows_b, k8, k1, a + i0, b, P + i0 * kTileB);
}

// ---- Winograd F(2x2, 3x3) transforms, sixteen tiles a vector: tiles 0-7 side by side from p0,
// tiles 8-15 from p1 (a row of sixteen when p1 = p0 + 16). Lane l is tile l; the operations are
// those of vector_kernels.h in their order, as the AVX2 kernels do them eight lanes at a time.
namespace {

// Lanes 0, 2, ..., 14 of a, then of b; and lanes 1, 3, ..., 15 of each.
MANTISSA_AVX512 inline __m512 even_lanes16(__m512 a, __m512 b) {
  return _mm512_permutex2var_ps(
      a, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), b);
}
MANTISSA_AVX512 inline __m512 odd_lanes16(__m512 a, __m512 b) {
  return _mm512_permutex2var_ps(
      a, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31), b);
}

// (B^T d B) of sixteen tiles, d[a][b] holding row a, column b of tile l in lane l.
MANTISSA_AVX512 void winograd_input_rows16(const float* p0, const float* p1, int64_t ld, float* v,
                                           int64_t vs) {
  __m512 d[4][4];
  for (int a = 0; a < 4; ++a) {
    const float *r0 = p0 + a * ld, *r1 = p1 + a * ld;
    const __m512 x0 = _mm512_loadu_ps(r0), x1 = _mm512_loadu_ps(r1);
    const __m512 y0 = _mm512_loadu_ps(r0 + 2), y1 = _mm512_loadu_ps(r1 + 2);
    d[a][0] = even_lanes16(x0, x1);
    d[a][1] = odd_lanes16(x0, x1);
    d[a][2] = even_lanes16(y0, y1);
    d[a][3] = odd_lanes16(y0, y1);
  }
  __m512 e[4][4];
  for (int b = 0; b < 4; ++b) {
    e[0][b] = _mm512_sub_ps(d[0][b], d[2][b]);
    e[1][b] = _mm512_add_ps(d[1][b], d[2][b]);
    e[2][b] = _mm512_sub_ps(d[2][b], d[1][b]);
    e[3][b] = _mm512_sub_ps(d[1][b], d[3][b]);
  }
  for (int a = 0; a < 4; ++a) {
    _mm512_storeu_ps(v + (a * 4 + 0) * vs, _mm512_sub_ps(e[a][0], e[a][2]));
    _mm512_storeu_ps(v + (a * 4 + 1) * vs, _mm512_add_ps(e[a][1], e[a][2]));
    _mm512_storeu_ps(v + (a * 4 + 2) * vs, _mm512_sub_ps(e[a][2], e[a][1]));
    _mm512_storeu_ps(v + (a * 4 + 3) * vs, _mm512_sub_ps(e[a][1], e[a][3]));
  }
}

// (A e A^T) of sixteen tiles' 2x2 output gradients. Negation flips the sign bit.
MANTISSA_AVX512 void winograd_dy_rows16(const float* p0, const float* p1, int64_t ld, float* v,
                                        int64_t vs) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  __m512 e[2][2];
  for (int a = 0; a < 2; ++a) {
    const __m512 x0 = _mm512_loadu_ps(p0 + a * ld), x1 = _mm512_loadu_ps(p1 + a * ld);
    e[a][0] = even_lanes16(x0, x1);
    e[a][1] = odd_lanes16(x0, x1);
  }
  __m512 r[4][2];
  for (int b = 0; b < 2; ++b) {
    r[0][b] = e[0][b];
    r[1][b] = _mm512_add_ps(e[0][b], e[1][b]);
    r[2][b] = _mm512_sub_ps(e[0][b], e[1][b]);
    r[3][b] = _mm512_xor_ps(e[1][b], sign);
  }
  for (int a = 0; a < 4; ++a) {
    _mm512_storeu_ps(v + (a * 4 + 0) * vs, r[a][0]);
    _mm512_storeu_ps(v + (a * 4 + 1) * vs, _mm512_add_ps(r[a][0], r[a][1]));
    _mm512_storeu_ps(v + (a * 4 + 2) * vs, _mm512_sub_ps(r[a][0], r[a][1]));
    _mm512_storeu_ps(v + (a * 4 + 3) * vs, _mm512_xor_ps(r[a][1], sign));
  }
}

// A^T m A + bias of sixteen tiles into the two rows of eight at o0 and o1 (elements of t).
MANTISSA_AVX512 void winograd_output_rows16(const float* m, int64_t ms, float bias, char* o0,
                                            char* o1, int64_t ld, DType t) {
  __m512 r[2][4];
  for (int b = 0; b < 4; ++b) {
    const __m512 m0 = _mm512_loadu_ps(m + b * ms), m1 = _mm512_loadu_ps(m + (4 + b) * ms);
    const __m512 m2 = _mm512_loadu_ps(m + (8 + b) * ms), m3 = _mm512_loadu_ps(m + (12 + b) * ms);
    r[0][b] = _mm512_add_ps(_mm512_add_ps(m0, m1), m2);
    r[1][b] = _mm512_sub_ps(_mm512_sub_ps(m1, m2), m3);
  }
  const __m512 bv = _mm512_set1_ps(bias);
  // Tile l's pair (y0, y1) side by side: tiles 0-7 in `first`, 8-15 in `second`.
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const int64_t es = t == DType::f32 ? 4 : 2;
  for (int a = 0; a < 2; ++a) {
    const __m512 y0 = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(r[a][0], r[a][1]), r[a][2]), bv);
    const __m512 y1 = _mm512_add_ps(_mm512_sub_ps(_mm512_sub_ps(r[a][1], r[a][2]), r[a][3]), bv);
    simd512::store16(o0 + a * ld * es, t, _mm512_permutex2var_ps(y0, first, y1));
    simd512::store16(o1 + a * ld * es, t, _mm512_permutex2var_ps(y0, second, y1));
  }
}

// Whether tiles [t, t + 16) of a run are two rows of eight.
inline bool two_rows_of_eight(const int64_t* at) {
  return row_of_eight(at) && row_of_eight(at + 8);
}

}  // namespace

namespace {
// A run of tiles sixteen at a time by Rows16 where they are two rows of eight, by the AVX2 run
// (Run8: groups of eight) elsewhere and for the last fewer than sixteen; returns the tiles done.
template <void (*Rows16)(const float*, const float*, int64_t, float*, int64_t),
          int64_t (*Run8)(const float*, const int64_t*, int64_t, int64_t, float*, int64_t)>
int64_t tile_groups16(const float* plane, const int64_t* at, int64_t n, int64_t ld, float* v,
                      int64_t vs) {
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    if (two_rows_of_eight(at + t))
      Rows16(plane + at[t], plane + at[t + 8], ld, v + t, vs);
    else
      Run8(plane, at + t, 16, ld, v + t, vs);
  }
  return t + Run8(plane, at + t, n - t, ld, v + t, vs);
}
}  // namespace

int64_t winograd_input_run_avx512(const float* plane, const int64_t* at, int64_t n, int64_t ld,
                                  float* v, int64_t vs) {
  return tile_groups16<winograd_input_rows16, winograd_input_run_avx2>(plane, at, n, ld, v, vs);
}

int64_t winograd_dy_run_avx512(const float* plane, const int64_t* at, int64_t n, int64_t ld,
                               float* v, int64_t vs) {
  return tile_groups16<winograd_dy_rows16, winograd_dy_run_avx2>(plane, at, n, ld, v, vs);
}

int64_t winograd_output_run_avx512(const float* m, int64_t ms, int64_t n, float bias, void* y,
                                   const int64_t* at, int64_t ld, DType t) {
  const int64_t es = t == DType::f32 ? 4 : 2;
  char* base = static_cast<char*>(y);
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    if (two_rows_of_eight(at + k))
      winograd_output_rows16(m + k, ms, bias, base + at[k] * es, base + at[k + 8] * es, ld, t);
    else
      winograd_output_run_avx2(m + k, ms, 16, bias, y, at + k, ld, t);
  }
  return k + winograd_output_run_avx2(m + k, ms, n - k, bias, y, at + k, ld, t);
}

// The normalization rows, sixteen values a vector (separate multiplies and adds, as the AVX2
// rows).
MANTISSA_AVX512 int64_t norm_dx_row_avx512(const float* d, const float* x, int64_t n, float mu,
                                           float rs, float scale, float shift, float slope,
                                           float* out) {
  const __m512 m = _mm512_set1_ps(mu), r = _mm512_set1_ps(rs), sc = _mm512_set1_ps(scale),
               sh = _mm512_set1_ps(shift), sl = _mm512_set1_ps(slope);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(d + i), sc), sh);
    const __m512 xhat = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), m), r);
    _mm512_storeu_ps(out + i, _mm512_sub_ps(g, _mm512_mul_ps(xhat, sl)));
  }
  return i + norm_dx_row_avx2(d + i, x + i, n - i, mu, rs, scale, shift, slope, out + i);
}

MANTISSA_AVX512 int64_t norm_dx_row16_avx512(const float* d, const float* x, int64_t n, float mu,
                                             float rs, float scale, float shift, float slope,
                                             void* out, DType t) {
  const __m512 m = _mm512_set1_ps(mu), r = _mm512_set1_ps(rs), sc = _mm512_set1_ps(scale),
               sh = _mm512_set1_ps(shift), sl = _mm512_set1_ps(slope);
  uint16_t* o = static_cast<uint16_t*>(out);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(d + i), sc), sh);
    const __m512 xhat = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), m), r);
    simd512::store16(o + i, t, _mm512_sub_ps(g, _mm512_mul_ps(xhat, sl)));
  }
  return i;
}

MANTISSA_AVX512 int64_t norm_affine_row16_avx512(const float* x, int64_t n, float scale,
                                                 float shift, void* out, DType t) {
  const __m512 sc = _mm512_set1_ps(scale), sh = _mm512_set1_ps(shift);
  uint16_t* o = static_cast<uint16_t*>(out);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    simd512::store16(o + i, t, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), sc), sh));
  return i;
}

MANTISSA_AVX512 int64_t norm_affine_row_avx512(const float* x, int64_t n, float scale, float shift,
                                               float* out) {
  const __m512 sc = _mm512_set1_ps(scale), sh = _mm512_set1_ps(shift);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), sc), sh));
  return i + norm_affine_row_avx2(x + i, n - i, scale, shift, out + i);
}

}  // namespace mantissa::kernels::detail

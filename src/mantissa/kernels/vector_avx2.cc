// AVX2 versions of the loops in vector_kernels.h (compiled for the baseline ISA with target
// attributes; chosen at run time).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "mantissa/core/convert_simd_internal.h"
#include "mantissa/core/error.h"
#include "mantissa/core/float_formats.h"
#include "mantissa/kernels/vector_kernels.h"

namespace mantissa::kernels::detail {
namespace {

// Calls f(std::integral_constant<int, count>{}) for count in [1, kMax]: a runtime block size to the
// template that keeps that many sums in registers.
template <int kMax, class F>
void with_block(int64_t count, F&& f) {
  if constexpr (kMax > 1) {
    if (count == kMax) return f(std::integral_constant<int, kMax>{});
    with_block<kMax - 1>(count, f);
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

// Channels [0, O) in blocks of kMax (the last one smaller): f(o0, block size as with_block gives
// it).
template <int kMax, class F>
void for_blocks(int64_t O, F&& f) {
  for (int64_t o0 = 0; o0 < O; o0 += kMax)
    with_block<kMax>(std::min<int64_t>(kMax, O - o0), [&](auto k) { f(o0, k); });
}

// Lanes [0, n) of a vector selected (n <= 8), for masked loads and stores of a row's tail.
__attribute__((target("avx2"))) inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

}  // namespace

namespace {
// Lanes 0, 2, ..., 14 and 1, 3, ..., 15 of the 16 floats lo:hi.
__attribute__((target("avx2"))) inline __m256 even_lanes(__m256 lo, __m256 hi) {
  return _mm256_castpd_ps(
      _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0x88)), 0xD8));
}
__attribute__((target("avx2"))) inline __m256 odd_lanes(__m256 lo, __m256 hi) {
  return _mm256_castpd_ps(
      _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0xDD)), 0xD8));
}
}  // namespace

namespace {
// (B^T d B) of eight tiles, d[a][b] holding row a, column b of tile l in lane l; stored at v[xi *
// vs].
__attribute__((target("avx2"))) inline void winograd_input_lanes(const __m256 (&d)[4][4], float* v,
                                                                 int64_t vs) {
  __m256 e[4][4];
  for (int b = 0; b < 4; ++b) {
    e[0][b] = _mm256_sub_ps(d[0][b], d[2][b]);
    e[1][b] = _mm256_add_ps(d[1][b], d[2][b]);
    e[2][b] = _mm256_sub_ps(d[2][b], d[1][b]);
    e[3][b] = _mm256_sub_ps(d[1][b], d[3][b]);
  }
  for (int a = 0; a < 4; ++a) {
    _mm256_storeu_ps(v + (a * 4 + 0) * vs, _mm256_sub_ps(e[a][0], e[a][2]));
    _mm256_storeu_ps(v + (a * 4 + 1) * vs, _mm256_add_ps(e[a][1], e[a][2]));
    _mm256_storeu_ps(v + (a * 4 + 2) * vs, _mm256_sub_ps(e[a][2], e[a][1]));
    _mm256_storeu_ps(v + (a * 4 + 3) * vs, _mm256_sub_ps(e[a][1], e[a][3]));
  }
}

// Row a of the eight tiles' results, y[a][0] and y[a][1] in lane l (bias added).
__attribute__((target("avx2"))) inline void winograd_output_lanes(const float* m, int64_t ms,
                                                                  float bias, __m256 (&y)[2][2]) {
  __m256 r[2][4];
  for (int b = 0; b < 4; ++b) {
    const __m256 m0 = _mm256_loadu_ps(m + b * ms), m1 = _mm256_loadu_ps(m + (4 + b) * ms);
    const __m256 m2 = _mm256_loadu_ps(m + (8 + b) * ms), m3 = _mm256_loadu_ps(m + (12 + b) * ms);
    r[0][b] = _mm256_add_ps(_mm256_add_ps(m0, m1), m2);
    r[1][b] = _mm256_sub_ps(_mm256_sub_ps(m1, m2), m3);
  }
  const __m256 bv = _mm256_set1_ps(bias);
  for (int a = 0; a < 2; ++a) {
    y[a][0] = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(r[a][0], r[a][1]), r[a][2]), bv);
    y[a][1] = _mm256_add_ps(_mm256_sub_ps(_mm256_sub_ps(r[a][1], r[a][2]), r[a][3]), bv);
  }
}
}  // namespace

__attribute__((target("avx2"))) void winograd_input_row8_avx2(const float* in, int64_t ld, float* v,
                                                              int64_t vs) {
  __m256 d[4][4];  // d[a][b], lane l: row a, column b of tile l (input columns 2 l + b)
  for (int a = 0; a < 4; ++a) {
    const float* p = in + a * ld;
    const __m256 lo = _mm256_loadu_ps(p), hi = _mm256_loadu_ps(p + 8);
    const __m256 lo2 = _mm256_loadu_ps(p + 2), hi2 = _mm256_loadu_ps(p + 10);
    d[a][0] = even_lanes(lo, hi);
    d[a][1] = odd_lanes(lo, hi);
    d[a][2] = even_lanes(lo2, hi2);
    d[a][3] = odd_lanes(lo2, hi2);
  }
  winograd_input_lanes(d, v, vs);
}

namespace {
// (A e A^T) of eight tiles, e[a][b] holding row a, column b of tile l's output gradient in lane l;
// stored at v[xi * vs]. Negation flips the sign bit, as the scalar -x does.
__attribute__((target("avx2"))) inline void winograd_dy_lanes(const __m256 (&e)[2][2], float* v,
                                                              int64_t vs) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 r[4][2];
  for (int b = 0; b < 2; ++b) {
    r[0][b] = e[0][b];
    r[1][b] = _mm256_add_ps(e[0][b], e[1][b]);
    r[2][b] = _mm256_sub_ps(e[0][b], e[1][b]);
    r[3][b] = _mm256_xor_ps(e[1][b], sign);
  }
  for (int a = 0; a < 4; ++a) {
    _mm256_storeu_ps(v + (a * 4 + 0) * vs, r[a][0]);
    _mm256_storeu_ps(v + (a * 4 + 1) * vs, _mm256_add_ps(r[a][0], r[a][1]));
    _mm256_storeu_ps(v + (a * 4 + 2) * vs, _mm256_sub_ps(r[a][0], r[a][1]));
    _mm256_storeu_ps(v + (a * 4 + 3) * vs, _mm256_xor_ps(r[a][1], sign));
  }
}
}  // namespace

__attribute__((target("avx2"))) void winograd_dy_row8_avx2(const float* in, int64_t ld, float* v,
                                                           int64_t vs) {
  __m256 e[2][2];  // e[a][b], lane l: row a, column b of tile l (columns 2 l + b)
  for (int a = 0; a < 2; ++a) {
    const __m256 lo = _mm256_loadu_ps(in + a * ld), hi = _mm256_loadu_ps(in + a * ld + 8);
    e[a][0] = even_lanes(lo, hi);
    e[a][1] = odd_lanes(lo, hi);
  }
  winograd_dy_lanes(e, v, vs);
}

__attribute__((target("avx2"))) void winograd_dy_gather8_avx2(const float* const* in, int64_t ld,
                                                              float* v, int64_t vs) {
  __m256 e[2][2];
  for (int a = 0; a < 2; ++a) {
    __m128 q[4];  // q[k]: row a of tiles 2 k and 2 k + 1, each tile's two values side by side
    for (int k = 0; k < 4; ++k)
      q[k] = _mm_loadh_pi(
          _mm_loadl_pi(_mm_setzero_ps(), reinterpret_cast<const __m64*>(in[2 * k] + a * ld)),
          reinterpret_cast<const __m64*>(in[2 * k + 1] + a * ld));
    const __m256 lo = _mm256_insertf128_ps(_mm256_castps128_ps256(q[0]), q[1], 1),
                 hi = _mm256_insertf128_ps(_mm256_castps128_ps256(q[2]), q[3], 1);
    e[a][0] = even_lanes(lo, hi);
    e[a][1] = odd_lanes(lo, hi);
  }
  winograd_dy_lanes(e, v, vs);
}

__attribute__((target("avx2"))) void winograd_input_gather8_avx2(const float* const* in, int64_t ld,
                                                                 float* v, int64_t vs) {
  __m256 d[4][4];
  for (int a = 0; a < 4; ++a) {
    __m256 q[4];  // q[l] = row a of tiles l and l + 4
    for (int l = 0; l < 4; ++l)
      q[l] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(in[l] + a * ld)),
                                  _mm_loadu_ps(in[l + 4] + a * ld), 1);
    const __m256 t0 = _mm256_unpacklo_ps(q[0], q[1]), t1 = _mm256_unpackhi_ps(q[0], q[1]);
    const __m256 t2 = _mm256_unpacklo_ps(q[2], q[3]), t3 = _mm256_unpackhi_ps(q[2], q[3]);
    d[a][0] = _mm256_shuffle_ps(t0, t2, 0x44);
    d[a][1] = _mm256_shuffle_ps(t0, t2, 0xEE);
    d[a][2] = _mm256_shuffle_ps(t1, t3, 0x44);
    d[a][3] = _mm256_shuffle_ps(t1, t3, 0xEE);
  }
  winograd_input_lanes(d, v, vs);
}

namespace {
// The groups of eight of a run of tiles (tile t at plane + at[t]) by a transform's side-by-side
// (Row) or gathered (Gather) kernel; returns the tiles done.
template <void (*Row)(const float*, int64_t, float*, int64_t),
          void (*Gather)(const float* const*, int64_t, float*, int64_t)>
__attribute__((target("avx2"))) int64_t tile_groups(const float* plane, const int64_t* at,
                                                    int64_t n, int64_t ld, float* v, int64_t vs) {
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    if (row_of_eight(at + t)) {
      Row(plane + at[t], ld, v + t, vs);
    } else {
      const float* in[8];
      for (int l = 0; l < 8; ++l) in[l] = plane + at[t + l];
      Gather(in, ld, v + t, vs);
    }
  }
  return t;
}
}  // namespace

int64_t winograd_input_run_avx2(const float* plane, const int64_t* at, int64_t n, int64_t ld,
                                float* v, int64_t vs) {
  return tile_groups<winograd_input_row8_avx2, winograd_input_gather8_avx2>(plane, at, n, ld, v,
                                                                            vs);
}

int64_t winograd_dy_run_avx2(const float* plane, const int64_t* at, int64_t n, int64_t ld, float* v,
                             int64_t vs) {
  return tile_groups<winograd_dy_row8_avx2, winograd_dy_gather8_avx2>(plane, at, n, ld, v, vs);
}

// Eight 3x3 filters, filter l's nine values at f + 9 l: value k of every filter gathered into
// one vector (lane l), then the transform of vector_kernels.h lane by lane.
__attribute__((target("avx2"))) void winograd_filter8_avx2(const float* f, float* u, int64_t us) {
  const __m256i at = _mm256_setr_epi32(0, 9, 18, 27, 36, 45, 54, 63);
  __m256 g[3][3];
  for (int a = 0; a < 3; ++a)
    for (int b = 0; b < 3; ++b) g[a][b] = _mm256_i32gather_ps(f + 3 * a + b, at, 4);
  const __m256 half = _mm256_set1_ps(0.5f);
  __m256 t[4][3];  // G g
  for (int j = 0; j < 3; ++j) {
    t[0][j] = g[0][j];
    t[1][j] = _mm256_mul_ps(half, _mm256_add_ps(_mm256_add_ps(g[0][j], g[1][j]), g[2][j]));
    t[2][j] = _mm256_mul_ps(half, _mm256_add_ps(_mm256_sub_ps(g[0][j], g[1][j]), g[2][j]));
    t[3][j] = g[2][j];
  }
  for (int i = 0; i < 4; ++i) {  // (G g) G^T
    _mm256_storeu_ps(u + (i * 4 + 0) * us, t[i][0]);
    _mm256_storeu_ps(u + (i * 4 + 1) * us,
                     _mm256_mul_ps(half, _mm256_add_ps(_mm256_add_ps(t[i][0], t[i][1]), t[i][2])));
    _mm256_storeu_ps(u + (i * 4 + 2) * us,
                     _mm256_mul_ps(half, _mm256_add_ps(_mm256_sub_ps(t[i][0], t[i][1]), t[i][2])));
    _mm256_storeu_ps(u + (i * 4 + 3) * us, t[i][2]);
  }
}

// The two rows of eight tiles side by side: row a's 16 outputs in column order.
__attribute__((target("avx2,f16c,fma"))) void winograd_output_row8_avx2(const float* m, int64_t ms,
                                                                        float bias, void* out,
                                                                        int64_t ld, DType t) {
  __m256 y[2][2];
  winograd_output_lanes(m, ms, bias, y);
  const int64_t es = t == DType::f32 ? 4 : 2;
  for (int a = 0; a < 2; ++a) {
    const __m256 lo = _mm256_unpacklo_ps(y[a][0], y[a][1]),
                 hi = _mm256_unpackhi_ps(y[a][0], y[a][1]);
    char* row = static_cast<char*>(out) + a * ld * es;
    simd::store8(row, t, _mm256_permute2f128_ps(lo, hi, 0x20));
    simd::store8(row + 8 * es, t, _mm256_permute2f128_ps(lo, hi, 0x31));
  }
}

__attribute__((target("avx2,f16c,fma"))) void winograd_output_gather8_avx2(const float* m,
                                                                           int64_t ms, float bias,
                                                                           void* const* out,
                                                                           int64_t ld, DType t) {
  __m256 y[2][2];
  winograd_output_lanes(m, ms, bias, y);
  for (int a = 0; a < 2; ++a) {
    if (t != DType::f32) {
      // Tile l's pair (y0, y1) as two 16-bit encodings side by side: 32 bits per tile.
      const __m128i h0 = simd::to_half8(y[a][0], t), h1 = simd::to_half8(y[a][1], t);
      alignas(16) uint32_t pair[8];
      _mm_store_si128(reinterpret_cast<__m128i*>(pair), _mm_unpacklo_epi16(h0, h1));
      _mm_store_si128(reinterpret_cast<__m128i*>(pair + 4), _mm_unpackhi_epi16(h0, h1));
      for (int l = 0; l < 8; ++l)
        std::memcpy(static_cast<uint16_t*>(out[l]) + a * ld, pair + l, sizeof(uint32_t));
      continue;
    }
    // lo: tiles 0, 1 | 4, 5; hi: tiles 2, 3 | 6, 7; each tile's pair (y0, y1) side by side
    const __m256 lo = _mm256_unpacklo_ps(y[a][0], y[a][1]),
                 hi = _mm256_unpackhi_ps(y[a][0], y[a][1]);
    const __m128 part[4] = {_mm256_castps256_ps128(lo), _mm256_castps256_ps128(hi),
                            _mm256_extractf128_ps(lo, 1), _mm256_extractf128_ps(hi, 1)};
    for (int k = 0; k < 4; ++k) {
      _mm_storel_pi(reinterpret_cast<__m64*>(static_cast<float*>(out[2 * k]) + a * ld), part[k]);
      _mm_storeh_pi(reinterpret_cast<__m64*>(static_cast<float*>(out[2 * k + 1]) + a * ld),
                    part[k]);
    }
  }
}

__attribute__((target("avx2,f16c,fma"))) int64_t winograd_output_run_avx2(const float* m,
                                                                          int64_t ms, int64_t n,
                                                                          float bias, void* y,
                                                                          const int64_t* at,
                                                                          int64_t ld, DType t) {
  const int64_t es = t == DType::f32 ? 4 : 2;
  char* base = static_cast<char*>(y);
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    if (row_of_eight(at + k)) {
      winograd_output_row8_avx2(m + k, ms, bias, base + at[k] * es, ld, t);
    } else {
      void* out[8];
      for (int l = 0; l < 8; ++l) out[l] = base + at[k + l] * es;
      winograd_output_gather8_avx2(m + k, ms, bias, out, ld, t);
    }
  }
  return k;
}

__attribute__((target("avx2"))) void axpy_f32_avx2(float* a, const float* x, float w, int64_t n) {
  const __m256 wv = _mm256_set1_ps(w);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(
        a + j, _mm256_add_ps(_mm256_loadu_ps(a + j), _mm256_mul_ps(wv, _mm256_loadu_ps(x + j))));
  for (; j < n; ++j) a[j] += w * x[j];
}

__attribute__((target("avx2,f16c,fma"))) void max_pool_2x2_row_avx2(const void* r0, const void* r1,
                                                                    DType tx, int64_t n, void* out,
                                                                    DType ty, uint8_t* codes) {
  const int64_t sx = static_cast<int64_t>(dtype_size(tx)),
                sy = static_cast<int64_t>(dtype_size(ty));
  const char* p0 = static_cast<const char*>(r0);
  const char* p1 = static_cast<const char*>(r1);
  const __m256 offset[3] = {_mm256_castsi256_ps(_mm256_set1_epi32(1)),
                            _mm256_castsi256_ps(_mm256_set1_epi32(2)),
                            _mm256_castsi256_ps(_mm256_set1_epi32(3))};
  for (int64_t j = 0; j < n; j += 8) {
    // 16-bit inputs widen exactly in registers (no FP32 staging of the plane).
    const __m256 a0 = simd::load8(p0 + 2 * j * sx, tx), a1 = simd::load8(p0 + (2 * j + 8) * sx, tx),
                 b0 = simd::load8(p1 + 2 * j * sx, tx), b1 = simd::load8(p1 + (2 * j + 8) * sx, tx);
    // The window's four values in window order: top-left, top-right, bottom-left, bottom-right.
    const __m256 c[4] = {even_lanes(a0, a1), odd_lanes(a0, a1), even_lanes(b0, b1),
                         odd_lanes(b0, b1)};
    __m256 best = c[0];
    __m256 won = _mm256_setzero_ps();  // offsets as 32-bit integers
    for (int k = 0; k < 3; ++k) {
      const __m256 cand = c[k + 1];
      // take = !isnan(best) && (cand > best || isnan(cand))
      const __m256 take = _mm256_andnot_ps(_mm256_cmp_ps(best, best, _CMP_UNORD_Q),
                                           _mm256_or_ps(_mm256_cmp_ps(cand, best, _CMP_GT_OQ),
                                                        _mm256_cmp_ps(cand, cand, _CMP_UNORD_Q)));
      best = _mm256_blendv_ps(best, cand, take);
      won = _mm256_blendv_ps(won, offset[k], take);
    }
    simd::store8(static_cast<char*>(out) + j * sy, ty, best);
    // Eight 32-bit offsets (0..3) to 16 bits, lane i's at bits 2i: each shifted into place, then
    // the lanes' disjoint bits ORed together.
    const __m256i w =
        _mm256_sllv_epi32(_mm256_castps_si256(won), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    __m128i o = _mm_or_si128(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    o = _mm_or_si128(o, _mm_shuffle_epi32(o, 0x4e));
    o = _mm_or_si128(o, _mm_shuffle_epi32(o, 0xb1));
    const uint16_t bits = static_cast<uint16_t>(_mm_cvtsi128_si32(o));
    std::memcpy(codes + j / 4, &bits, 2);
  }
}

// OB output channels, 16 columns at a time (2 * OB sums in registers), the weights broadcast per
// tap from L1; then 8 columns at a time, then the last few columns masked (same arithmetic).
template <int OB>
__attribute__((target("avx2"))) void conv_rows_block(float* y, int64_t ys, const float* bias,
                                                     const float* w, int64_t ws, const int64_t* tap,
                                                     const float* const* x, int64_t taps,
                                                     int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m256 acc[OB][2];
#pragma GCC unroll 8
    for (int o = 0; o < OB; ++o) acc[o][0] = acc[o][1] = _mm256_set1_ps(bias[o]);
    for (int64_t i = 0; i < taps; ++i) {
      const __m256 x0 = _mm256_loadu_ps(x[i] + j), x1 = _mm256_loadu_ps(x[i] + j + 8);
#pragma GCC unroll 8
      for (int o = 0; o < OB; ++o) {
        const __m256 wv = _mm256_broadcast_ss(w + o * ws + tap[i]);
        acc[o][0] = _mm256_add_ps(acc[o][0], _mm256_mul_ps(wv, x0));
        acc[o][1] = _mm256_add_ps(acc[o][1], _mm256_mul_ps(wv, x1));
      }
    }
#pragma GCC unroll 8
    for (int o = 0; o < OB; ++o) {
      _mm256_storeu_ps(y + o * ys + j, acc[o][0]);
      _mm256_storeu_ps(y + o * ys + j + 8, acc[o][1]);
    }
  }
  for (; j + 8 <= n; j += 8) {
    __m256 acc[OB];
#pragma GCC unroll 8
    for (int o = 0; o < OB; ++o) acc[o] = _mm256_set1_ps(bias[o]);
    for (int64_t i = 0; i < taps; ++i) {
      const __m256 xv = _mm256_loadu_ps(x[i] + j);
#pragma GCC unroll 8
      for (int o = 0; o < OB; ++o)
        acc[o] = _mm256_add_ps(acc[o], _mm256_mul_ps(_mm256_broadcast_ss(w + o * ws + tap[i]), xv));
    }
#pragma GCC unroll 8
    for (int o = 0; o < OB; ++o) _mm256_storeu_ps(y + o * ys + j, acc[o]);
  }
  if (j < n) {  // the last 1-7 columns, masked (lanes past n neither read nor written)
    const __m256i mask = first_lanes(n - j);
    __m256 acc[OB];
#pragma GCC unroll 8
    for (int o = 0; o < OB; ++o) acc[o] = _mm256_set1_ps(bias[o]);
    for (int64_t i = 0; i < taps; ++i) {
      const __m256 xv = _mm256_maskload_ps(x[i] + j, mask);
#pragma GCC unroll 8
      for (int o = 0; o < OB; ++o)
        acc[o] = _mm256_add_ps(acc[o], _mm256_mul_ps(_mm256_broadcast_ss(w + o * ws + tap[i]), xv));
    }
#pragma GCC unroll 8
    for (int o = 0; o < OB; ++o) _mm256_maskstore_ps(y + o * ys + j, mask, acc[o]);
  }
}

// Output channels in blocks of up to 6 (12 sums, 2 input vectors and a weight: 15 registers).
__attribute__((target("avx2"))) void conv_rows_f32_avx2(float* y, int64_t ys, int64_t O,
                                                        const float* bias, const float* w,
                                                        int64_t ws, const int64_t* tap,
                                                        const float* const* x, int64_t taps,
                                                        int64_t n) {
  for_blocks<6>(O, [&](int64_t o0, auto k) {
    conv_rows_block<decltype(k)::value>(y + o0 * ys, ys, bias + o0, w + o0 * ws, ws, tap, x, taps,
                                        n);
  });
}

// OB output channels by 8 * V columns of fma_rows_f32 (kMasked: the last vector holds only the
// columns the mask selects; a masked store leaves the others untouched).
template <int OB, int V, bool kMasked>
__attribute__((target("avx2,fma"))) inline void conv_fma_strip(float* y, int64_t ys,
                                                               const float* bias, const float* w,
                                                               int64_t ws, const float* const* x,
                                                               int64_t taps, int64_t j,
                                                               __m256i mask) {
  __m256 acc[OB][V];
#pragma GCC unroll 8
  for (int o = 0; o < OB; ++o)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) acc[o][v] = _mm256_setzero_ps();
  for (int64_t i = 0; i < taps; ++i) {
    __m256 xv[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v)
      xv[v] = kMasked && v == V - 1 ? _mm256_maskload_ps(x[i] + j + 8 * v, mask)
                                    : _mm256_loadu_ps(x[i] + j + 8 * v);
#pragma GCC unroll 8
    for (int o = 0; o < OB; ++o) {
      const __m256 wv = _mm256_broadcast_ss(w + o * ws + i);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) acc[o][v] = _mm256_fmadd_ps(wv, xv[v], acc[o][v]);
    }
  }
#pragma GCC unroll 8
  for (int o = 0; o < OB; ++o) {
    const __m256 b = _mm256_set1_ps(bias ? bias[o] : 0.0f);
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) {
      float* dst = y + o * ys + j + 8 * v;
      const __m256 r = _mm256_add_ps(acc[o][v], b);
      if (kMasked && v == V - 1)
        _mm256_maskstore_ps(dst, mask, r);
      else
        _mm256_storeu_ps(dst, r);
    }
  }
}

template <int OB>
__attribute__((target("avx2,fma"))) void conv_fma_block(float* y, int64_t ys, const float* bias,
                                                        const float* w, int64_t ws,
                                                        const float* const* x, int64_t taps,
                                                        int64_t n) {
  const __m256i all = _mm256_set1_epi32(-1);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) conv_fma_strip<OB, 2, false>(y, ys, bias, w, ws, x, taps, j, all);
  // The last 1-15 columns: one strip whose last vector is masked (or whole when it is full).
  const int64_t r = n - j;
  if (r == 0) return;
  const __m256i mask = first_lanes(r > 8 ? r - 8 : r);
  if (r > 8)
    conv_fma_strip<OB, 2, true>(y, ys, bias, w, ws, x, taps, j, mask);
  else if (r == 8)
    conv_fma_strip<OB, 1, false>(y, ys, bias, w, ws, x, taps, j, all);
  else
    conv_fma_strip<OB, 1, true>(y, ys, bias, w, ws, x, taps, j, mask);
}

// Output channels in blocks of up to 6 (12 sums, 2 input vectors and a weight: 15 registers).
__attribute__((target("avx2,fma"))) void fma_rows_f32_avx2(float* y, int64_t ys, int64_t O,
                                                           const float* bias, const float* w,
                                                           int64_t ws, const float* const* x,
                                                           int64_t taps, int64_t n) {
  for_blocks<6>(O, [&](int64_t o0, auto k) {
    conv_fma_block<decltype(k)::value>(y + o0 * ys, ys, bias ? bias + o0 : nullptr, w + o0 * ws, ws,
                                       x, taps, n);
  });
}

// OB output channels by TB taps: OB * TB lane vectors in registers over the segment, TB input
// vectors loaded once per 8 columns and each gradient vector used TB times. The tail (fewer than
// 8 columns) is loaded masked: the lanes past it add 0 * 0, which leaves a sum unchanged (a
// sum that starts at +0 is never -0), so every lane gets exactly its own columns' products.
template <int OB, int TB, bool kMasked>
__attribute__((target("avx2"))) inline void conv_wgrad_step(__m256 (&acc)[OB][TB], const float* dy,
                                                            int64_t ds, const float* const* x,
                                                            int64_t j, __m256i mask) {
  __m256 xv[TB];
#pragma GCC unroll 4
  for (int t = 0; t < TB; ++t)
    xv[t] = kMasked ? _mm256_maskload_ps(x[t] + j, mask) : _mm256_loadu_ps(x[t] + j);
#pragma GCC unroll 8
  for (int o = 0; o < OB; ++o) {
    const float* p = dy + o * ds + j;
    const __m256 d = kMasked ? _mm256_maskload_ps(p, mask) : _mm256_loadu_ps(p);
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) acc[o][t] = _mm256_add_ps(acc[o][t], _mm256_mul_ps(d, xv[t]));
  }
}

template <int OB, int TB>
__attribute__((target("avx2"))) void conv_wgrad_tile(float* lanes, int64_t taps, const float* dy,
                                                     int64_t ds, const float* const* x, int64_t n) {
  __m256 acc[OB][TB];
#pragma GCC unroll 8
  for (int o = 0; o < OB; ++o)
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) acc[o][t] = _mm256_loadu_ps(lanes + (o * taps + t) * 8);
  const __m256i all = _mm256_set1_epi32(-1);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) conv_wgrad_step<OB, TB, false>(acc, dy, ds, x, j, all);
  if (j < n) {
    conv_wgrad_step<OB, TB, true>(acc, dy, ds, x, j, first_lanes(n - j));
  }
#pragma GCC unroll 8
  for (int o = 0; o < OB; ++o)
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) _mm256_storeu_ps(lanes + (o * taps + t) * 8, acc[o][t]);
}

template <int OB>
__attribute__((target("avx2"))) void conv_wgrad_channels(float* lanes, int64_t taps,
                                                         const float* dy, int64_t ds,
                                                         const float* const* x, int64_t n) {
  int64_t t0 = 0;
  for (; t0 + 2 <= taps; t0 += 2) conv_wgrad_tile<OB, 2>(lanes + t0 * 8, taps, dy, ds, x + t0, n);
  if (t0 < taps) conv_wgrad_tile<OB, 1>(lanes + t0 * 8, taps, dy, ds, x + t0, n);
}

// Output channels in blocks of up to 5 by pairs of taps (10 sums, 2 input vectors and a
// gradient: 13 registers).
__attribute__((target("avx2"))) void conv_wgrad_rows_f32_avx2(float* lanes, int64_t O,
                                                              const float* dy, int64_t ds,
                                                              const float* const* x, int64_t taps,
                                                              int64_t n) {
  for_blocks<5>(O, [&](int64_t o0, auto k) {
    conv_wgrad_channels<decltype(k)::value>(lanes + o0 * taps * 8, taps, dy + o0 * ds, ds, x, n);
  });
}

// Lane-split dot products over columns [k0, k1) for a tile of up to 3 x 4 rows: full 3 x 4 tiles
// keep the 12 lane vectors in registers (3 + 4 loads feed 12 FMAs per 8 columns); the tail
// columns (k1 - k0 not a multiple of 8) go to their lanes one at a time, in order.
namespace {

// How a dot tile reads eight values of a B row at element k: FP32 as stored, 16-bit values
// widened (exact), or FP32 values rounded to nearest even to 16 bits and widened back (the values
// a 16-bit copy would hold: convert()'s rounding, bit for bit, see convert_simd_internal.h).
template <DotRow L>
__attribute__((target("avx2,f16c,fma"))) inline __m256 dot_b8(const void* row, int64_t k) {
  if constexpr (L == DotRow::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(row) + k);
  } else if constexpr (L == DotRow::kF16 || L == DotRow::kBF16) {
    return simd::from_half8(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + k)),
        L == DotRow::kF16 ? DType::f16 : DType::bf16);
  } else if constexpr (L == DotRow::kF32AsF16) {
    return _mm256_cvtph_ps(simd::to_f16x8(_mm256_loadu_ps(static_cast<const float*>(row) + k)));
  } else {
    // BF16's rounding kept in the top half of each lane (to_bf16x8 without the packing).
    const __m256i b = _mm256_castps_si256(_mm256_loadu_ps(static_cast<const float*>(row) + k));
    const __m256i top = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(
        _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb), top);
    const __m256i nan = _mm256_or_si256(_mm256_and_si256(b, top), _mm256_set1_epi32(0x00400000));
    const __m256i a = _mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff));
    return _mm256_castsi256_ps(
        _mm256_blendv_epi8(r, nan, _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000))));
  }
}

// One value of a B row (the tile's tail), read as dot_b8 reads it.
template <DotRow L>
inline float dot_b1(const void* row, int64_t k) {
  if constexpr (L == DotRow::kF32) {
    return static_cast<const float*>(row)[k];
  } else if constexpr (L == DotRow::kF16) {
    return static_cast<float>(f16::from_bits(static_cast<const uint16_t*>(row)[k]));
  } else if constexpr (L == DotRow::kBF16) {
    return static_cast<float>(bf16::from_bits(static_cast<const uint16_t*>(row)[k]));
  } else if constexpr (L == DotRow::kF32AsF16) {
    return static_cast<float>(f16(static_cast<const float*>(row)[k]));
  } else {
    return static_cast<float>(bf16(static_cast<const float*>(row)[k]));
  }
}

template <DotRow L>
__attribute__((target("avx2,f16c,fma"))) void dot_tile(int rows_a, int rows_b, int64_t k0,
                                                       int64_t k1, const float* const* a,
                                                       const void* const* b, float* const* P) {
  constexpr int RB = 4;
  const int64_t k8 = k0 + (k1 - k0) / 8 * 8;
  if (rows_a == 3 && rows_b == RB) {
    __m256 acc[3][RB];
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < RB; ++j) acc[i][j] = _mm256_loadu_ps(P[i * RB + j]);
    for (int64_t k = k0; k < k8; k += 8) {
      const __m256 b0 = dot_b8<L>(b[0], k), b1 = dot_b8<L>(b[1], k), b2 = dot_b8<L>(b[2], k),
                   b3 = dot_b8<L>(b[3], k);
      for (int i = 0; i < 3; ++i) {
        const __m256 x = _mm256_loadu_ps(a[i] + k);
        acc[i][0] = _mm256_fmadd_ps(x, b0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(x, b1, acc[i][1]);
        acc[i][2] = _mm256_fmadd_ps(x, b2, acc[i][2]);
        acc[i][3] = _mm256_fmadd_ps(x, b3, acc[i][3]);
      }
    }
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < RB; ++j) _mm256_storeu_ps(P[i * RB + j], acc[i][j]);
  } else {
    for (int i = 0; i < rows_a; ++i)
      for (int j = 0; j < rows_b; ++j) {
        __m256 acc = _mm256_loadu_ps(P[i * RB + j]);
        for (int64_t k = k0; k < k8; k += 8)
          acc = _mm256_fmadd_ps(_mm256_loadu_ps(a[i] + k), dot_b8<L>(b[j], k), acc);
        _mm256_storeu_ps(P[i * RB + j], acc);
      }
  }
  for (int i = 0; i < rows_a; ++i)
    for (int j = 0; j < rows_b; ++j)
      for (int64_t k = k8; k < k1; ++k) {
        float& lane = P[i * RB + j][k % 8];
        lane = std::fma(a[i][k], dot_b1<L>(b[j], k), lane);
      }
}

// R rows of A (R <= kDotColumnRows) against one FP32 B row read as its BF16 copy: each value
// rounded once for all R rows, where the 3 x 4 tile rounds it once for every three rows of A
// (BF16's rounding costs more than the FMAs a value feeds).
template <int R>
__attribute__((target("avx2,f16c,fma"))) void dot_column(int64_t k0, int64_t k1,
                                                         const float* const* a, const void* b,
                                                         float* const* P) {
  const int64_t k8 = k0 + (k1 - k0) / 8 * 8;
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_loadu_ps(P[i]);
  for (int64_t k = k0; k < k8; k += 8) {
    const __m256 bv = dot_b8<DotRow::kF32AsBF16>(b, k);
    for (int i = 0; i < R; ++i) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(a[i] + k), bv, acc[i]);
  }
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(P[i], acc[i]);
  for (int64_t k = k8; k < k1; ++k) {
    const float bk = dot_b1<DotRow::kF32AsBF16>(b, k);
    for (int i = 0; i < R; ++i) {
      float& lane = P[i][k % 8];
      lane = std::fma(a[i][k], bk, lane);
    }
  }
}

void dot_column_rows(int rows_a, int64_t k0, int64_t k1, const float* const* a, const void* b,
                     float* const* P) {
  switch (rows_a) {
#define MANTISSA_COLUMN(r) \
  case r:                  \
    return dot_column<r>(k0, k1, a, b, P);
    MANTISSA_COLUMN(1)
    MANTISSA_COLUMN(2)
    MANTISSA_COLUMN(3)
    MANTISSA_COLUMN(4)
    MANTISSA_COLUMN(5)
    MANTISSA_COLUMN(6)
    MANTISSA_COLUMN(7)
    MANTISSA_COLUMN(8)
    MANTISSA_COLUMN(9)
    MANTISSA_COLUMN(10)
    MANTISSA_COLUMN(11)
    MANTISSA_COLUMN(12)
#undef MANTISSA_COLUMN
  }
  MANTISSA_ASSERT(false, "dot_column_rows: 1 to kDotColumnRows rows of A");
}

}  // namespace

namespace {

// Eight values at element i of a row of storage t, and eight FP32 lanes stored there rounded to
// nearest even (simd::load8/store8: convert()'s bits); the last one to seven of a row through a
// zero-padded block.
struct Row8 {
  const void* p;
  DType t;
};
__attribute__((target("avx2,f16c,fma"))) inline __m256 row_load8(Row8 r, int64_t i, int64_t m) {
  const char* at = static_cast<const char*>(r.p) + i * static_cast<int64_t>(dtype_size(r.t));
  if (m == 8) return simd::load8(at, r.t);
  alignas(32) char pad[32] = {};
  std::memcpy(pad, at, static_cast<size_t>(m) * dtype_size(r.t));
  return simd::load8(pad, r.t);
}
__attribute__((target("avx2,f16c,fma"))) inline void row_store8(void* p, DType t, int64_t i,
                                                                int64_t m, __m256 v) {
  char* at = static_cast<char*>(p) + i * static_cast<int64_t>(dtype_size(t));
  if (m == 8) return simd::store8(at, t, v);
  alignas(32) char pad[32];
  simd::store8(pad, t, v);
  std::memcpy(at, pad, static_cast<size_t>(m) * dtype_size(t));
}

}  // namespace

__attribute__((target("avx2,f16c,fma"))) void relu_row_avx2(const void* x, DType tx, void* y,
                                                            DType ty, int64_t n) {
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t m = std::min<int64_t>(8, n - i);
    const __m256 v = row_load8({x, tx}, i, m);
    // x > 0 || x != x ? x : 0, lane by lane (greater-than, or unordered).
    const __m256 keep =
        _mm256_or_ps(_mm256_cmp_ps(v, zero, _CMP_GT_OQ), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    row_store8(y, ty, i, m, _mm256_and_ps(v, keep));
  }
}

__attribute__((target("avx2,f16c,fma"))) void relu_backward_row_avx2(const void* g, DType tg,
                                                                     const void* y, DType ty,
                                                                     void* dx, DType td,
                                                                     int64_t n) {
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t m = std::min<int64_t>(8, n - i);
    // g where not y <= 0 (y > 0, or NaN), else +0: the bits of g masked, as the FP32 loop.
    const __m256 keep = _mm256_cmp_ps(row_load8({y, ty}, i, m), zero, _CMP_NLE_UQ);
    row_store8(dx, td, i, m, _mm256_and_ps(row_load8({g, tg}, i, m), keep));
  }
}

void dot_lanes_bf16_column_avx2(int rows_a, int64_t k0, int64_t k1, const float* const* a,
                                const float* b, float* const* P) {
  dot_column_rows(rows_a, k0, k1, a, b, P);
}

void dot_lanes_tile_avx2(DotRow kind, int rows_a, int rows_b, int64_t k0, int64_t k1,
                         const float* const* a, const void* const* b, float* const* P) {
  switch (kind) {
    case DotRow::kF32:
      return dot_tile<DotRow::kF32>(rows_a, rows_b, k0, k1, a, b, P);
    case DotRow::kF16:
      return dot_tile<DotRow::kF16>(rows_a, rows_b, k0, k1, a, b, P);
    case DotRow::kBF16:
      return dot_tile<DotRow::kBF16>(rows_a, rows_b, k0, k1, a, b, P);
    case DotRow::kF32AsF16:
      return dot_tile<DotRow::kF32AsF16>(rows_a, rows_b, k0, k1, a, b, P);
    case DotRow::kF32AsBF16:
      return dot_tile<DotRow::kF32AsBF16>(rows_a, rows_b, k0, k1, a, b, P);
  }
}

// The normalization rows: separate multiplies and adds (this target has FMA, and a contracted
// multiply-add would change the bits).
__attribute__((target("avx2"))) void norm_sums8_avx2(const float* d, const float* x, int64_t n8,
                                                     float mu, float rs, float* a, float* b) {
  const __m256 m = _mm256_set1_ps(mu), r = _mm256_set1_ps(rs);
  __m256 sa = _mm256_loadu_ps(a), sb = _mm256_loadu_ps(b);
  for (int64_t i = 0; i + 8 <= n8; i += 8) {
    const __m256 dv = _mm256_loadu_ps(d + i);
    const __m256 xhat = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), m), r);
    sa = _mm256_add_ps(sa, dv);
    sb = _mm256_add_ps(sb, _mm256_mul_ps(dv, xhat));
  }
  _mm256_storeu_ps(a, sa);
  _mm256_storeu_ps(b, sb);
}

__attribute__((target("avx2"))) void norm_stat_sums8_avx2(const float* x, int64_t n8, float mu,
                                                          bool squares, float* acc) {
  __m256 s = _mm256_loadu_ps(acc);
  if (!squares) {
    for (int64_t i = 0; i + 8 <= n8; i += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(x + i));
  } else {
    const __m256 m = _mm256_set1_ps(mu);
    for (int64_t i = 0; i + 8 <= n8; i += 8) {
      const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + i), m);
      s = _mm256_add_ps(s, _mm256_mul_ps(d, d));
    }
  }
  _mm256_storeu_ps(acc, s);
}

namespace {
// Eight values of storage t at p (f32, f16 or bf16), widened exactly; a 16-bit operand's also
// stored at out + i.
template <int T>  // 0 f32, 1 f16, 2 bf16
__attribute__((target("avx2,f16c"), always_inline)) inline __m256 widened8(const void* p, int64_t i,
                                                                           float* out) {
  if constexpr (T == 0) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    const __m256 v =
        simd::load8(static_cast<const uint16_t*>(p) + i, T == 1 ? DType::f16 : DType::bf16);
    _mm256_storeu_ps(out + i, v);
    return v;
  }
}

template <int DT, int XT>
__attribute__((target("avx2,f16c"))) void sums8_widen(const void* d, const void* x, int64_t n8,
                                                      float mu, float rs, float* dout, float* xout,
                                                      float* a, float* b) {
  const __m256 m = _mm256_set1_ps(mu), r = _mm256_set1_ps(rs);
  __m256 sa = _mm256_loadu_ps(a), sb = _mm256_loadu_ps(b);
  for (int64_t i = 0; i + 8 <= n8; i += 8) {
    const __m256 dv = widened8<DT>(d, i, dout);
    const __m256 xhat = _mm256_mul_ps(_mm256_sub_ps(widened8<XT>(x, i, xout), m), r);
    sa = _mm256_add_ps(sa, dv);
    sb = _mm256_add_ps(sb, _mm256_mul_ps(dv, xhat));
  }
  _mm256_storeu_ps(a, sa);
  _mm256_storeu_ps(b, sb);
}

constexpr int kind_of(DType t) { return t == DType::f16 ? 1 : t == DType::bf16 ? 2 : 0; }
}  // namespace

__attribute__((target("avx2,f16c"))) void norm_sum_widen8_avx2(const void* x, DType t, int64_t n8,
                                                               float* out, float* acc) {
  __m256 s = _mm256_loadu_ps(acc);
  if (t == DType::f16)
    for (int64_t i = 0; i + 8 <= n8; i += 8) s = _mm256_add_ps(s, widened8<1>(x, i, out));
  else
    for (int64_t i = 0; i + 8 <= n8; i += 8) s = _mm256_add_ps(s, widened8<2>(x, i, out));
  _mm256_storeu_ps(acc, s);
}

// norm_sums8_avx2's arithmetic on operands stored in f32, f16 or bf16.
void norm_sums8_widen_avx2(const void* d, DType dt, const void* x, DType xt, int64_t n8, float mu,
                           float rs, float* dout, float* xout, float* a, float* b) {
  switch (kind_of(dt) * 3 + kind_of(xt)) {
#define MANTISSA_SUMS(dk, xk) \
  case dk * 3 + xk:           \
    return sums8_widen<dk, xk>(d, x, n8, mu, rs, dout, xout, a, b);
    MANTISSA_SUMS(0, 0)
    MANTISSA_SUMS(0, 1)
    MANTISSA_SUMS(0, 2)
    MANTISSA_SUMS(1, 0)
    MANTISSA_SUMS(1, 1)
    MANTISSA_SUMS(1, 2)
    MANTISSA_SUMS(2, 0)
    MANTISSA_SUMS(2, 1)
    MANTISSA_SUMS(2, 2)
#undef MANTISSA_SUMS
  }
}

__attribute__((target("avx2"))) int64_t norm_dx_row_avx2(const float* d, const float* x, int64_t n,
                                                         float mu, float rs, float scale,
                                                         float shift, float slope, float* out) {
  const __m256 m = _mm256_set1_ps(mu), r = _mm256_set1_ps(rs), sc = _mm256_set1_ps(scale),
               sh = _mm256_set1_ps(shift), sl = _mm256_set1_ps(slope);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(d + i), sc), sh);
    const __m256 xhat = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), m), r);
    _mm256_storeu_ps(out + i, _mm256_sub_ps(g, _mm256_mul_ps(xhat, sl)));
  }
  return i;
}

__attribute__((target("avx2"))) int64_t norm_affine_row_avx2(const float* x, int64_t n, float scale,
                                                             float shift, float* out) {
  const __m256 sc = _mm256_set1_ps(scale), sh = _mm256_set1_ps(shift);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), sc), sh));
  return i;
}

}  // namespace mantissa::kernels::detail

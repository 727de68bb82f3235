#include "mantissa/kernels/vector_kernels.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "mantissa/core/convert.h"
#include "mantissa/core/cpu_features.h"
#include "mantissa/core/error.h"
#include "mantissa/core/float_formats.h"
#include "mantissa/core/parallel.h"

namespace mantissa::kernels::detail {
namespace {

// The vector rows' path: the AVX2 kernels on either SIMD path, the AVX-512 dot tile, FMA rows and
// ReLU rows on their own.
[[maybe_unused]] SimdPath vectors_path() {
  static const SimdPath path = simd_path(SimdFamily::kVectorRows);
  return path;
}
[[maybe_unused]] bool avx2_vectors() { return vectors_path() != SimdPath::kScalar; }
[[maybe_unused]] bool avx512_vectors() { return vectors_path() == SimdPath::kAvx512; }

[[maybe_unused]] bool avx2_pooling() {
  static const bool on = simd_path(SimdFamily::kPooling) == SimdPath::kAvx2;
  return on;
}

// Whether kWinoTiles tiles sit side by side in one row: tile l at p[0] + 2 l.
template <class T>
bool side_by_side(T* const* p) {
  for (int l = 1; l < kWinoTiles; ++l)
    if (p[l] != p[0] + 2 * l) return false;
  return true;
}

}  // namespace

void winograd_input_f32(const float* const* in, int n, int64_t ld, float* v, int64_t vs) {
#if MANTISSA_HAVE_X86_SIMD
  if (avx2_vectors() && n == kWinoTiles)
    return side_by_side(in) ? winograd_input_row8_avx2(in[0], ld, v, vs)
                            : winograd_input_gather8_avx2(in, ld, v, vs);
#endif
  for (int l = 0; l < n; ++l) {
    float d[4][4], e[4][4];
    for (int a = 0; a < 4; ++a)
      for (int b = 0; b < 4; ++b) d[a][b] = in[l][a * ld + b];
    for (int b = 0; b < 4; ++b) {
      e[0][b] = d[0][b] - d[2][b];
      e[1][b] = d[1][b] + d[2][b];
      e[2][b] = d[2][b] - d[1][b];
      e[3][b] = d[1][b] - d[3][b];
    }
    for (int a = 0; a < 4; ++a) {
      v[(a * 4 + 0) * vs + l] = e[a][0] - e[a][2];
      v[(a * 4 + 1) * vs + l] = e[a][1] + e[a][2];
      v[(a * 4 + 2) * vs + l] = e[a][2] - e[a][1];
      v[(a * 4 + 3) * vs + l] = e[a][1] - e[a][3];
    }
  }
}

void winograd_dy_f32(const float* const* in, int n, int64_t ld, float* v, int64_t vs) {
#if MANTISSA_HAVE_X86_SIMD
  if (avx2_vectors() && n == kWinoTiles)
    return side_by_side(in) ? winograd_dy_row8_avx2(in[0], ld, v, vs)
                            : winograd_dy_gather8_avx2(in, ld, v, vs);
#endif
  for (int l = 0; l < n; ++l) {
    const float e[2][2] = {{in[l][0], in[l][1]}, {in[l][ld], in[l][ld + 1]}};
    float r[4][2];
    for (int b = 0; b < 2; ++b) {
      r[0][b] = e[0][b];
      r[1][b] = e[0][b] + e[1][b];
      r[2][b] = e[0][b] - e[1][b];
      r[3][b] = -e[1][b];
    }
    for (int a = 0; a < 4; ++a) {
      v[(a * 4 + 0) * vs + l] = r[a][0];
      v[(a * 4 + 1) * vs + l] = r[a][0] + r[a][1];
      v[(a * 4 + 2) * vs + l] = r[a][0] - r[a][1];
      v[(a * 4 + 3) * vs + l] = -r[a][1];
    }
  }
}

namespace {
// A run's tiles from t on, kWinoTiles at a time, by the per-group entry point `group`.
template <class Group>
void tiles_by_group(const float* plane, const int64_t* at, int64_t t, int64_t n, Group group) {
  const float* in[kWinoTiles];
  for (; t < n; t += kWinoTiles) {
    const int k = static_cast<int>(std::min<int64_t>(kWinoTiles, n - t));
    for (int l = 0; l < k; ++l) in[l] = plane + at[t + l];
    group(in, k, t);
  }
}
}  // namespace

void winograd_input_run(const float* plane, const int64_t* at, int64_t n, int64_t ld, float* v,
                        int64_t vs) {
  int64_t t = 0;
#if MANTISSA_HAVE_X86_SIMD
  if (avx512_vectors())
    t = winograd_input_run_avx512(plane, at, n, ld, v, vs);
  else if (avx2_vectors())
    t = winograd_input_run_avx2(plane, at, n, ld, v, vs);
#endif
  tiles_by_group(plane, at, t, n, [&](const float* const* in, int k, int64_t t0) {
    winograd_input_f32(in, k, ld, v + t0, vs);
  });
}

void winograd_dy_run(const float* plane, const int64_t* at, int64_t n, int64_t ld, float* v,
                     int64_t vs) {
  int64_t t = 0;
#if MANTISSA_HAVE_X86_SIMD
  if (avx512_vectors())
    t = winograd_dy_run_avx512(plane, at, n, ld, v, vs);
  else if (avx2_vectors())
    t = winograd_dy_run_avx2(plane, at, n, ld, v, vs);
#endif
  tiles_by_group(plane, at, t, n, [&](const float* const* in, int k, int64_t t0) {
    winograd_dy_f32(in, k, ld, v + t0, vs);
  });
}

void winograd_output_run(const float* m, int64_t ms, int64_t n, float bias, void* y,
                         const int64_t* at, int64_t ld, DType t) {
  MANTISSA_ASSERT(t == DType::f32 || t == DType::f16 || t == DType::bf16,
                  "winograd_output_run: f32, f16 or bf16 output");
  int64_t k = 0;
#if MANTISSA_HAVE_X86_SIMD
  if (avx512_vectors())
    k = winograd_output_run_avx512(m, ms, n, bias, y, at, ld, t);
  else if (avx2_vectors())
    k = winograd_output_run_avx2(m, ms, n, bias, y, at, ld, t);
#endif
  const int64_t es = static_cast<int64_t>(dtype_size(t));
  void* out[kWinoTiles];
  for (; k < n; k += kWinoTiles) {
    const int g = static_cast<int>(std::min<int64_t>(kWinoTiles, n - k));
    for (int l = 0; l < g; ++l) out[l] = static_cast<char*>(y) + at[k + l] * es;
    winograd_output(m + k, ms, g, bias, out, ld, t);
  }
}

void winograd_filter_grad_f32(const float* u, int64_t us, int64_t n, float* f) {
  for (int64_t c = 0; c < n; ++c) {
    float t[3][4];  // G^T u
    for (int j = 0; j < 4; ++j) {
      const float s = 0.5f * (u[(4 + j) * us + c] + u[(8 + j) * us + c]);
      t[0][j] = u[j * us + c] + s;
      t[1][j] = 0.5f * (u[(4 + j) * us + c] - u[(8 + j) * us + c]);
      t[2][j] = s + u[(12 + j) * us + c];
    }
    for (int a = 0; a < 3; ++a) {  // (G^T u) G
      const float s = 0.5f * (t[a][1] + t[a][2]);
      f[9 * c + 3 * a + 0] = t[a][0] + s;
      f[9 * c + 3 * a + 1] = 0.5f * (t[a][1] - t[a][2]);
      f[9 * c + 3 * a + 2] = s + t[a][3];
    }
  }
}

void winograd_filter_f32(const float* f, int64_t n, float* u, int64_t us) {
  int64_t c = 0;
#if MANTISSA_HAVE_X86_SIMD
  if (avx2_vectors())
    for (; c + 8 <= n; c += 8) winograd_filter8_avx2(f + 9 * c, u + c, us);
#endif
  for (; c < n; ++c) {
    const float* g = f + 9 * c;
    float t[4][3];  // G g
    for (int j = 0; j < 3; ++j) {
      t[0][j] = g[j];
      t[1][j] = 0.5f * ((g[j] + g[3 + j]) + g[6 + j]);
      t[2][j] = 0.5f * ((g[j] - g[3 + j]) + g[6 + j]);
      t[3][j] = g[6 + j];
    }
    for (int i = 0; i < 4; ++i) {  // (G g) G^T
      u[(i * 4 + 0) * us + c] = t[i][0];
      u[(i * 4 + 1) * us + c] = 0.5f * ((t[i][0] + t[i][1]) + t[i][2]);
      u[(i * 4 + 2) * us + c] = 0.5f * ((t[i][0] - t[i][1]) + t[i][2]);
      u[(i * 4 + 3) * us + c] = t[i][2];
    }
  }
}

void winograd_output(const float* m, int64_t ms, int n, float bias, void* const* out, int64_t ld,
                     DType t) {
  MANTISSA_ASSERT(t == DType::f32 || t == DType::f16 || t == DType::bf16,
                  "winograd_output: f32, f16 or bf16 output");
#if MANTISSA_HAVE_X86_SIMD
  if (avx2_vectors() && n == kWinoTiles) {
    const int64_t es = static_cast<int64_t>(dtype_size(t));
    bool row = true;  // tile l at out[0] + 2 l elements
    for (int l = 1; l < kWinoTiles; ++l)
      row =
          row && static_cast<const char*>(out[l]) == static_cast<const char*>(out[0]) + 2 * l * es;
    return row ? winograd_output_row8_avx2(m, ms, bias, out[0], ld, t)
               : winograd_output_gather8_avx2(m, ms, bias, out, ld, t);
  }
#endif
  for (int l = 0; l < n; ++l) {
    float r[2][4];
    for (int b = 0; b < 4; ++b) {
      r[0][b] = (m[b * ms + l] + m[(4 + b) * ms + l]) + m[(8 + b) * ms + l];
      r[1][b] = (m[(4 + b) * ms + l] - m[(8 + b) * ms + l]) - m[(12 + b) * ms + l];
    }
    for (int a = 0; a < 2; ++a) {
      const float y[2] = {((r[a][0] + r[a][1]) + r[a][2]) + bias,
                          ((r[a][1] - r[a][2]) - r[a][3]) + bias};
      for (int k = 0; k < 2; ++k) {
        const int64_t i = a * ld + k;
        if (t == DType::f32)
          static_cast<float*>(out[l])[i] = y[k];
        else if (t == DType::f16)
          static_cast<uint16_t*>(out[l])[i] = f16(y[k]).bits;
        else
          static_cast<uint16_t*>(out[l])[i] = bf16(y[k]).bits;
      }
    }
  }
}

void axpy_f32(float* a, const float* x, int64_t stride, float w, int64_t n) {
#if MANTISSA_HAVE_X86_SIMD
  if (stride == 1 && avx2_vectors()) return axpy_f32_avx2(a, x, w, n);
#endif
  for (int64_t j = 0; j < n; ++j) a[j] += w * x[j * stride];
}

namespace {
// Element i of a row stored in t (f32, f16 or bf16), as FP32 (exact).
float load_value(const void* row, DType t, int64_t i) {
  if (t == DType::f32) return static_cast<const float*>(row)[i];
  const uint16_t b = static_cast<const uint16_t*>(row)[i];
  return t == DType::f16 ? static_cast<float>(f16::from_bits(b))
                         : static_cast<float>(bf16::from_bits(b));
}
// v into element i of a row stored in t, rounded to nearest even.
void store_value(void* row, DType t, int64_t i, float v) {
  if (t == DType::f32)
    static_cast<float*>(row)[i] = v;
  else
    static_cast<uint16_t*>(row)[i] = t == DType::f16 ? f16(v).bits : bf16(v).bits;
}
}  // namespace

void max_pool_2x2_row(const void* r0, const void* r1, DType tx, int64_t n, void* out, DType ty,
                      uint8_t* codes) {
  const auto supported = [](DType t) {
    return t == DType::f32 || t == DType::f16 || t == DType::bf16;
  };
  MANTISSA_ASSERT(supported(tx) && supported(ty), "max_pool_2x2_row: f32, f16 or bf16 rows");
  int64_t j = 0;
#if MANTISSA_HAVE_X86_SIMD
  if (avx2_pooling() && n >= 8) {
    max_pool_2x2_row_avx2(r0, r1, tx, n / 8 * 8, out, ty, codes);
    if (n % 8 != 0) {
      // The last 1-7 outputs as one block of 8 ending at the row's end: the outputs it repeats
      // get the same bits again (each is a function of its window alone). Its codes go to a word
      // of their own; those of windows n8 on start byte n8 / 4 of the row (n8 a multiple of 8).
      const int64_t n8 = n / 8 * 8, k = n - 8, sx = static_cast<int64_t>(dtype_size(tx)),
                    sy = static_cast<int64_t>(dtype_size(ty));
      uint8_t last[2];
      max_pool_2x2_row_avx2(static_cast<const char*>(r0) + 2 * k * sx,
                            static_cast<const char*>(r1) + 2 * k * sx, tx, 8,
                            static_cast<char*>(out) + k * sy, ty, last);
      const uint32_t tail = (last[0] | static_cast<uint32_t>(last[1]) << 8) >> (2 * (n8 - k));
      codes[n8 / 4] = static_cast<uint8_t>(tail);
      if (n - n8 > 4) codes[n8 / 4 + 1] = static_cast<uint8_t>(tail >> 8);
    }
    return;
  }
#endif
  for (; j < n; ++j) {
    const int64_t c = 2 * j;
    float best = load_value(r0, tx, c);
    uint8_t won = 0;
    const float cand[3] = {load_value(r0, tx, c + 1), load_value(r1, tx, c),
                           load_value(r1, tx, c + 1)};
    for (uint8_t k = 0; k < 3; ++k) {
      const bool take = !std::isnan(best) && (cand[k] > best || std::isnan(cand[k]));
      best = take ? cand[k] : best;
      won = take ? static_cast<uint8_t>(k + 1) : won;
    }
    store_value(out, ty, j, best);
    uint8_t& byte = codes[j / 4];
    byte = static_cast<uint8_t>(j % 4 == 0 ? won : byte | won << (2 * (j % 4)));
  }
}

namespace {

// A kernel's rows through FP32 (the AVX2 and scalar rows, which store FP32): computed into an
// O x n buffer (the thread's, reused: the callers go row by row), then each row stored in yt.
template <class Rows>
void rows_through_f32(void* y, DType yt, int64_t ys, int64_t O, int64_t n, Rows&& rows) {
  if (yt == DType::f32) return rows(static_cast<float*>(y), ys);
  thread_local std::vector<float> buf;
  if (buf.size() < static_cast<size_t>(O * n)) buf.resize(static_cast<size_t>(O * n));
  rows(buf.data(), n);
  const int64_t es = static_cast<int64_t>(dtype_size(yt));
  for (int64_t o = 0; o < O; ++o)
    convert(buf.data() + o * n, DType::f32, static_cast<char*>(y) + o * ys * es, yt,
            static_cast<size_t>(n));
}

}  // namespace

bool has_max_pool_2x2_backward_row() {
#if MANTISSA_HAVE_X86_SIMD
  return avx512_vectors();
#else
  return false;
#endif
}

void max_pool_2x2_backward_row(const void* g, DType tg, const uint8_t* codes, int64_t n, void* r0,
                               void* r1, DType ty) {
  MANTISSA_ASSERT(has_max_pool_2x2_backward_row(),
                  "max_pool_2x2_backward_row: no vector path on this processor");
#if MANTISSA_HAVE_X86_SIMD
  max_pool_2x2_backward_row_avx512(g, tg, codes, n, r0, r1, ty);
#else
  (void)g, (void)tg, (void)codes, (void)n, (void)r0, (void)r1, (void)ty;
#endif
}

void conv_rows(void* y, DType yt, int64_t ys, int64_t O, const float* bias, const float* w,
               int64_t ws, const int64_t* tap, const float* const* x, int64_t taps, int64_t n) {
#if MANTISSA_HAVE_X86_SIMD
  if (avx512_vectors()) return conv_rows_avx512(y, yt, ys, O, bias, w, ws, tap, x, taps, n);
#endif
  rows_through_f32(y, yt, ys, O, n, [&](float* out, int64_t os) {
#if MANTISSA_HAVE_X86_SIMD
    if (avx2_vectors()) return conv_rows_f32_avx2(out, os, O, bias, w, ws, tap, x, taps, n);
#endif
    for (int64_t o = 0; o < O; ++o) {
      float* row = out + o * os;
      for (int64_t j = 0; j < n; ++j) {
        float acc = bias[o];
        for (int64_t i = 0; i < taps; ++i) acc += w[o * ws + tap[i]] * x[i][j];
        row[j] = acc;
      }
    }
  });
}

void fma_rows(void* y, DType yt, int64_t ys, int64_t O, const float* bias, const float* w,
              int64_t ws, const float* const* x, int64_t taps, int64_t n) {
#if MANTISSA_HAVE_X86_SIMD
  if (avx512_vectors()) return fma_rows_avx512(y, yt, ys, O, bias, w, ws, x, taps, n);
#endif
  rows_through_f32(y, yt, ys, O, n, [&](float* out, int64_t os) {
#if MANTISSA_HAVE_X86_SIMD
    if (avx2_vectors()) return fma_rows_f32_avx2(out, os, O, bias, w, ws, x, taps, n);
#endif
    for (int64_t o = 0; o < O; ++o)
      for (int64_t j = 0; j < n; ++j) {
        float acc = 0.0f;
        for (int64_t i = 0; i < taps; ++i) acc = std::fma(w[o * ws + i], x[i][j], acc);
        out[o * os + j] = acc + (bias ? bias[o] : 0.0f);
      }
  });
}

void conv_wgrad_rows_f32(float* lanes, int64_t O, const float* dy, int64_t ds,
                         const float* const* x, int64_t taps, int64_t n) {
#if MANTISSA_HAVE_X86_SIMD
  if (avx2_vectors()) return conv_wgrad_rows_f32_avx2(lanes, O, dy, ds, x, taps, n);
#endif
  for (int64_t o = 0; o < O; ++o)
    for (int64_t i = 0; i < taps; ++i) {
      float* l = lanes + (o * taps + i) * kDotLanes;
      for (int64_t j = 0; j < n; ++j) l[j % kDotLanes] += dy[o * ds + j] * x[i][j];
    }
}

// ---- Lane-split dot products ----

namespace {

constexpr int kDotRowsA = 3, kDotRowsB = 4;  // tile: 12 lane vectors (AVX-512: kDotRowsA512 x 4)
static_assert(kDotRowsA <= kDotRowsA512);
constexpr int64_t kDotDepth = 1024;  // columns per pass: a tile's rows stay in L1/L2
// The AVX-512 tile's: its 12 rows of A stay in L2, and B's rows stream in longer runs.
constexpr int64_t kDotDepth512 = 4096;
constexpr int64_t kDotColumnDepth = 512;  // the column tile's: its 12 rows of A in L1/L2

void dot_tile_portable(int rows_a, int rows_b, int64_t k0, int64_t k1, const float* const* a,
                       const float* const* b, float* const* P) {
  for (int i = 0; i < rows_a; ++i)
    for (int j = 0; j < rows_b; ++j) {
      float* lanes = P[i * kDotRowsB + j];
      for (int64_t k = k0; k < k1; ++k)
        lanes[k % kDotLanes] = std::fma(a[i][k], b[j][k], lanes[k % kDotLanes]);
    }
}

}  // namespace

bool relu_row(const void* x, DType tx, void* y, DType ty, int64_t n) {
#if MANTISSA_HAVE_X86_SIMD
  if (avx512_vectors()) {
    relu_row_avx512(x, tx, y, ty, n);
    return true;
  }
  if (avx2_vectors()) {
    relu_row_avx2(x, tx, y, ty, n);
    return true;
  }
#endif
  (void)x, (void)tx, (void)y, (void)ty, (void)n;
  return false;
}

void norm_sums8(const float* d, const float* x, int64_t n, float mu, float rs, float* a, float* b) {
#if MANTISSA_HAVE_X86_SIMD
  if (avx2_vectors()) return norm_sums8_avx2(d, x, n, mu, rs, a, b);
#endif
  for (int64_t i = 0; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) {
      const float xhat = (x[i + l] - mu) * rs;
      a[l] += d[i + l];
      b[l] += d[i + l] * xhat;
    }
}

void norm_stat_sums8(const float* x, int64_t n, float mu, bool squares, float* acc) {
#if MANTISSA_HAVE_X86_SIMD
  if (avx2_vectors()) return norm_stat_sums8_avx2(x, n, mu, squares, acc);
#endif
  for (int64_t i = 0; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) {
      const float d = x[i + l] - mu;
      acc[l] += squares ? d * d : x[i + l];
    }
}

void norm_dx_row(const float* d, const float* x, int64_t n, float mu, float rs, float scale,
                 float shift, float slope, float* out) {
  int64_t i = 0;
#if MANTISSA_HAVE_X86_SIMD
  if (avx512_vectors())
    i = norm_dx_row_avx512(d, x, n, mu, rs, scale, shift, slope, out);
  else if (avx2_vectors())
    i = norm_dx_row_avx2(d, x, n, mu, rs, scale, shift, slope, out);
#endif
  for (; i < n; ++i) out[i] = d[i] * scale - shift - ((x[i] - mu) * rs) * slope;
}

void norm_affine_row(const float* x, int64_t n, float scale, float shift, float* out) {
  int64_t i = 0;
#if MANTISSA_HAVE_X86_SIMD
  if (avx512_vectors())
    i = norm_affine_row_avx512(x, n, scale, shift, out);
  else if (avx2_vectors())
    i = norm_affine_row_avx2(x, n, scale, shift, out);
#endif
  for (; i < n; ++i) out[i] = x[i] * scale + shift;
}

void norm_sum_widen8(const void* x, DType t, int64_t n, float* out, float* acc) {
#if MANTISSA_HAVE_X86_SIMD
  if (avx2_vectors()) return norm_sum_widen8_avx2(x, t, n, out, acc);
#endif
  convert(x, t, out, DType::f32, static_cast<size_t>(n));
  norm_stat_sums8(out, n, 0.0f, false, acc);
}

namespace {
// Values [i, n) of a 16-bit row (storage t at out) that the SIMD loop left: fill(i, m, block)
// writes the m FP32 values from i into a block of 64, which is rounded into out.
template <class Fill>
void rounded_rest(int64_t i, int64_t n, void* out, DType t, Fill&& fill) {
  float block[64];
  const int64_t es = static_cast<int64_t>(dtype_size(t));
  for (; i < n; i += 64) {
    const int64_t m = std::min<int64_t>(64, n - i);
    fill(i, m, block);
    convert(block, DType::f32, static_cast<char*>(out) + i * es, t, static_cast<size_t>(m));
  }
}
}  // namespace

void norm_affine_row_to(const float* x, int64_t n, float scale, float shift, void* out, DType t) {
  int64_t i = 0;
#if MANTISSA_HAVE_X86_SIMD
  if (avx512_vectors()) i = norm_affine_row16_avx512(x, n, scale, shift, out, t);
#endif
  rounded_rest(i, n, out, t, [&](int64_t j, int64_t m, float* block) {
    norm_affine_row(x + j, m, scale, shift, block);
  });
}

void norm_sums8_widen(const void* d, DType dt, const void* x, DType xt, int64_t n, float mu,
                      float rs, float* dout, float* xout, float* a, float* b) {
#if MANTISSA_HAVE_X86_SIMD
  if (avx2_vectors()) return norm_sums8_widen_avx2(d, dt, x, xt, n, mu, rs, dout, xout, a, b);
#endif
  auto widened = [n](const void* p, DType t, float* out) -> const float* {
    if (t == DType::f32) return static_cast<const float*>(p);
    convert(p, t, out, DType::f32, static_cast<size_t>(n));
    return out;
  };
  norm_sums8(widened(d, dt, dout), widened(x, xt, xout), n, mu, rs, a, b);
}

void norm_dx_row_to(const float* d, const float* x, int64_t n, float mu, float rs, float scale,
                    float shift, float slope, void* out, DType t) {
  int64_t i = 0;
#if MANTISSA_HAVE_X86_SIMD
  if (avx512_vectors()) i = norm_dx_row16_avx512(d, x, n, mu, rs, scale, shift, slope, out, t);
#endif
  rounded_rest(i, n, out, t, [&](int64_t j, int64_t m, float* block) {
    norm_dx_row(d + j, x + j, m, mu, rs, scale, shift, slope, block);
  });
}

bool relu_backward_row(const void* g, DType tg, const void* y, DType ty, void* dx, DType td,
                       int64_t n) {
#if MANTISSA_HAVE_X86_SIMD
  if (avx512_vectors()) {
    relu_backward_row_avx512(g, tg, y, ty, dx, td, n);
    return true;
  }
  if (avx2_vectors()) {
    relu_backward_row_avx2(g, tg, y, ty, dx, td, n);
    return true;
  }
#endif
  (void)g, (void)tg, (void)y, (void)ty, (void)dx, (void)td, (void)n;
  return false;
}

float dot_lanes_finish(const float* l) {
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

void dot_lanes_accumulate_reference(int64_t M, int64_t N, int64_t K, const float* a, int64_t lda,
                                    const float* b, const int64_t* b_row, float* P) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      float* lanes = P + (i * N + j) * kDotLanes;
      for (int64_t k = 0; k < K; ++k)
        lanes[k % kDotLanes] = std::fma(a[i * lda + k], b[b_row[j] + k], lanes[k % kDotLanes]);
    }
}

namespace {
// The A operand: M rows of storage t, row i at p + i * ld elements. FP32 rows are read in place;
// 16-bit rows are widened (exactly) a depth pass at a time by each thread.
struct DotA {
  const void* p;
  DType t;
  int64_t ld;
};

// The driver of every version: rows_of(j0, rb, k0, k1, brows, stage) gives the B rows of group j0
// for depths [k0, k1) as pointers at depth k0 (the tiles index them from 0), read as `kind` says
// (kF32 for FP32 rows and staged ones; the others only on the SIMD paths). Depth passes start at
// multiples of 8, so a value's lane is its depth mod 8 within the call.
template <class RowsOf>
void dot_lanes_run(int64_t M, int64_t N, int64_t K, DotA a, float* P, int threads, DotRow kind,
                   RowsOf&& rows_of) {
  if (M <= 0 || N <= 0 || K <= 0) return;
  bool avx2 = false, avx512 = false;
#if MANTISSA_HAVE_X86_SIMD
  avx2 = avx2_vectors();
  avx512 = avx512_vectors();
#endif
  MANTISSA_ASSERT(avx2 || kind == DotRow::kF32,
                  "dot_lanes_run: only the SIMD tiles read 16-bit rows");
  // Threads take groups of B rows (each output is one thread's, so the result does not depend on
  // the thread count); within a group, depth passes over all tiles keep A's rows in cache.
  const int64_t groups = (N + kDotRowsB - 1) / kDotRowsB;
  // All of A's rows against each B row when B's values are rounded to BF16 as they are read (the
  // column tile; AVX2 only), so each is rounded once, not once for every three rows of A: BF16's
  // rounding is ten integer instructions, more than the FMAs a value feeds. (FP16's rounding and
  // the widenings are cheaper than the extra loads of A the column tile makes; the AVX-512 tile
  // reads each B value once for all its rows of A.)
  const bool column = avx2 && !avx512 && kind == DotRow::kF32AsBF16 && M <= kDotColumnRows;
  const int64_t depth = column ? kDotColumnDepth : avx512 ? kDotDepth512 : kDotDepth;
  const bool wide_a = a.t == DType::f32;
  const size_t a_size = dtype_size(a.t);
  const int t = static_cast<int>(std::clamp<int64_t>(threads, 1, groups));
  parallel_for(static_cast<size_t>(t), 1, t, [&](size_t p0, size_t p1) {
    std::vector<float> stage;  // staged B rows, when rows_of converts
    std::vector<float> a_stage(wide_a ? 0 : static_cast<size_t>(M * depth));  // (M, depth)
    std::vector<const float*> a_rows(static_cast<size_t>(M));                 // row i at depth k0
    for (size_t part = p0; part < p1; ++part) {
      const int64_t g0 = groups * static_cast<int64_t>(part) / t,
                    g1 = groups * static_cast<int64_t>(part + 1) / t;
      for (int64_t k0 = 0; k0 < K; k0 += depth) {
        const int64_t k1 = std::min(K, k0 + depth), n = k1 - k0;
        for (int64_t i = 0; i < M; ++i) {
          const char* row = static_cast<const char*>(a.p) + (i * a.ld + k0) * a_size;
          if (wide_a) {
            a_rows[static_cast<size_t>(i)] = reinterpret_cast<const float*>(row);
          } else {
            float* dst = a_stage.data() + i * depth;
            convert(row, a.t, dst, DType::f32, static_cast<size_t>(n));
            a_rows[static_cast<size_t>(i)] = dst;
          }
        }
        for (int64_t g = g0; g < g1; ++g) {
          const int64_t j0 = g * kDotRowsB;
          const int rb = static_cast<int>(std::min<int64_t>(kDotRowsB, N - j0));
          const void* brows[kDotRowsB];
          rows_of(j0, rb, k0, k1, brows, stage);
#if MANTISSA_HAVE_X86_SIMD
          if (column) {
            float* lanes[kDotColumnRows];
            for (int j = 0; j < rb; ++j) {
              for (int64_t i = 0; i < M; ++i) lanes[i] = P + (i * N + j0 + j) * kDotLanes;
              dot_lanes_bf16_column_avx2(static_cast<int>(M), 0, n, a_rows.data(),
                                         static_cast<const float*>(brows[j]), lanes);
            }
            continue;
          }
#endif
          const int64_t tile_a = avx512 ? kDotRowsA512 : kDotRowsA;
          for (int64_t i0 = 0; i0 < M; i0 += tile_a) {
            const int ra = static_cast<int>(std::min<int64_t>(tile_a, M - i0));
            const float* const* arows = a_rows.data() + i0;
            float* lanes[kDotRowsA512 * kDotRowsB];
            for (int i = 0; i < ra; ++i)
              for (int j = 0; j < rb; ++j)
                lanes[i * kDotRowsB + j] = P + ((i0 + i) * N + j0 + j) * kDotLanes;
#if MANTISSA_HAVE_X86_SIMD
            if (avx512) {
              dot_lanes_tile_avx512(kind, ra, rb, 0, n, arows, brows, lanes);
              continue;
            }
            if (avx2) {
              dot_lanes_tile_avx2(kind, ra, rb, 0, n, arows, brows, lanes);
              continue;
            }
#endif
            const float* frows[kDotRowsB];
            for (int j = 0; j < rb; ++j) frows[j] = static_cast<const float*>(brows[j]);
            dot_tile_portable(ra, rb, 0, n, arows, frows, lanes);
          }
        }
      }
    }
  });
}

// B's rows read in place (no staging), element size es: on the SIMD paths, as `kind`.
auto rows_in_place(const void* b, size_t es, const int64_t* b_row) {
  return [=](int64_t j0, int rb, int64_t k0, int64_t, const void** brows, std::vector<float>&) {
    for (int j = 0; j < rb; ++j)
      brows[j] = static_cast<const char*>(b) + (b_row[j0 + j] + k0) * static_cast<int64_t>(es);
  };
}

// B's rows staged in FP32 a depth pass at a time: stage_row(row, j, k0, k1) fills row with B row
// j's values at depths [k0, k1).
template <class StageRow>
auto rows_staged(StageRow stage_row) {
  return [=](int64_t j0, int rb, int64_t k0, int64_t k1, const void** brows,
             std::vector<float>& stage) {
    stage.resize(static_cast<size_t>(kDotRowsB * (k1 - k0)));
    for (int j = 0; j < rb; ++j) {
      float* row = stage.data() + j * (k1 - k0);
      stage_row(row, j0 + j, k0, k1);
      brows[j] = row;
    }
  };
}
}  // namespace

void dot_lanes_accumulate(int64_t M, int64_t N, int64_t K, const float* a, int64_t lda,
                          const float* b, const int64_t* b_row, float* P, int threads) {
  dot_lanes_run(M, N, K, {a, DType::f32, lda}, P, threads, DotRow::kF32,
                rows_in_place(b, sizeof(float), b_row));
}

void dot_lanes_accumulate(int64_t M, int64_t N, int64_t K, const void* a, DType at, int64_t lda,
                          const void* b, DType bt, const int64_t* b_row, float* P, int threads) {
  const DotA A{a, at, lda};
  if (bt == DType::f32)
    return dot_lanes_run(M, N, K, A, P, threads, DotRow::kF32,
                         rows_in_place(b, sizeof(float), b_row));
  const size_t es = dtype_size(bt);
#if MANTISSA_HAVE_X86_SIMD
  // The SIMD tiles widen 16-bit rows as they read them.
  if (avx2_vectors() && (bt == DType::f16 || bt == DType::bf16))
    return dot_lanes_run(M, N, K, A, P, threads, bt == DType::f16 ? DotRow::kF16 : DotRow::kBF16,
                         rows_in_place(b, es, b_row));
#endif
  dot_lanes_run(M, N, K, A, P, threads, DotRow::kF32,
                rows_staged([&](float* row, int64_t j, int64_t k0, int64_t k1) {
                  convert(static_cast<const char*>(b) + (b_row[j] + k0) * es, bt, row, DType::f32,
                          static_cast<size_t>(k1 - k0));
                }));
}

void dot_lanes_accumulate_rounded(int64_t M, int64_t N, int64_t K, const void* a, DType at,
                                  int64_t lda, const float* b, DType round_to, const int64_t* b_row,
                                  float* P, int threads) {
  MANTISSA_ASSERT(round_to == DType::f16 || round_to == DType::bf16,
                  "dot_lanes_accumulate_rounded rounds to f16 or bf16");
  const DotA A{a, at, lda};
#if MANTISSA_HAVE_X86_SIMD
  // The SIMD tiles round each FP32 value as they read it.
  if (avx2_vectors())
    return dot_lanes_run(M, N, K, A, P, threads,
                         round_to == DType::f16 ? DotRow::kF32AsF16 : DotRow::kF32AsBF16,
                         rows_in_place(b, sizeof(float), b_row));
#endif
  dot_lanes_run(M, N, K, A, P, threads, DotRow::kF32,
                rows_staged([&](float* row, int64_t j, int64_t k0, int64_t k1) {
                  std::copy(b + b_row[j] + k0, b + b_row[j] + k1, row);
                  round_through(row, k1 - k0, round_to);
                }));
}

void round_through(float* v, int64_t n, DType t) {
  MANTISSA_ASSERT(t == DType::f16 || t == DType::bf16, "round_through rounds to f16 or bf16");
  constexpr int64_t kChunk = 512;
  uint16_t bits[kChunk];
  for (int64_t i = 0; i < n; i += kChunk) {
    const size_t m = static_cast<size_t>(std::min(kChunk, n - i));
    convert(v + i, DType::f32, bits, t, m);
    convert(bits, t, v + i, DType::f32, m);
  }
}

}  // namespace mantissa::kernels::detail

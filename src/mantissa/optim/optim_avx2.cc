// The AVX2 inner loop of Adam/AdamW (see optim_kernels.h). Compiled for the baseline ISA with a
// target attribute; chosen at run time.
//
// Subnormals: weights whose gradient is exactly zero for many steps (an input feature a ReLU keeps
// at zero) see their first moment decay by beta1 each step into the subnormal range, where
// m * beta1 rounds back to the same few units in the last place and stays subnormal for good;
// tiny gradients make g * g subnormal. On Intel cores a multiply, divide or square root with a
// subnormal operand or result takes a microcode assist of about 30 ns a vector (a Xeon with
// AVX-512: 31 ns against 0.24 ns for a multiply; additions, comparisons and the FP32/FP64
// conversions take none), and a third of the tutorial CNN's fc1 vectors were such after 3,000
// steps: its AdamW update took 11 ms a step instead of 3.3. Flushing them (FTZ/DAZ) would change
// PyTorch's results, so instead each vector whose state or gradient holds a value near or below
// the subnormal range (exact_lanes) takes an exact path that never forms a subnormal in an FP32
// register: adam_formula over FP64 lanes, each operation rounded to FP32 as it is made. The
// product of two FP32 values is exact in FP64, and rounding a sum, quotient or square root first
// to FP64 and then to FP32 gives the correctly rounded FP32 result (53 >= 2 * 24 + 2), subnormal
// results included, so every step equals the FP32 operation's bits. The test is only about speed:
// a vector it lets through still computes IEEE FP32, just with assists.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "mantissa/core/cpu_features.h"
#include "mantissa/core/float_formats.h"
#include "mantissa/optim/optim_kernels.h"

namespace mantissa::optim::detail {
namespace {

__attribute__((target("avx2,f16c"))) inline __m256 load8(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::f16:
      return _mm256_cvtph_ps(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i)));
    case DType::bf16:
      return _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(
              reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i))),
          16));
    default:
      return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  }
}

// Round to nearest even, as convert() does (F16C for FP16; for BF16 add 0x7fff plus the lowest
// kept bit and truncate, NaN made quiet with its top payload bits).
__attribute__((target("avx2,f16c"))) inline void store8(void* base, DType t, int64_t i, __m256 x) {
  switch (t) {
    case DType::f16:
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i),
                       _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      return;
    case DType::bf16: {
      const __m256i b = _mm256_castps_si256(x);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
      const __m256i r = _mm256_srli_epi32(
          _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb), 16);
      const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40));
      const __m256i a = _mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff));
      const __m256i v =
          _mm256_blendv_epi8(r, nan, _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000)));
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i),
                       _mm256_castsi256_si128(packed));
      return;
    }
    default:
      _mm256_storeu_ps(static_cast<float*>(base) + i, x);
  }
}

// The dtypes as template parameters (the modes' combinations), so the loads and stores are
// straight-line code; kGeneric reads the types at run time.
constexpr int kGeneric = -1;

template <int T>
__attribute__((target("avx2,f16c"))) inline __m256 load8_t(const void* base, DType t, int64_t i) {
  if constexpr (T == kGeneric)
    return load8(base, t, i);
  else
    return load8(base, static_cast<DType>(T), i);
}
template <int T>
__attribute__((target("avx2,f16c"))) inline void store8_t(void* base, DType t, int64_t i,
                                                          __m256 x) {
  if constexpr (T == kGeneric)
    store8(base, t, i, x);
  else
    store8(base, static_cast<DType>(T), i, x);
}

// Sixteen FP32 lanes (two vectors) held as four vectors of four FP64 values, each operation
// rounded to FP32: the number type of adam_formula's exact lanes (see the top of the file).
// Sixteen, as the AVX-512 version takes them (two vectors of eight FP64 values).
#define MANTISSA_AVX2 __attribute__((target("avx2,f16c")))
struct Exact16 {
  __m256d x[4];
  MANTISSA_AVX2 static inline __m256d round(__m256d v) {
    return _mm256_cvtps_pd(_mm256_cvtpd_ps(v));
  }
  MANTISSA_AVX2 explicit Exact16(float f) {
    for (__m256d& v : x) v = _mm256_set1_pd(static_cast<double>(f));
  }
  MANTISSA_AVX2 Exact16() = default;
  // Vectors a (lanes 0-7) and b (8-15).
  MANTISSA_AVX2 Exact16(__m256 a, __m256 b) {
    x[0] = _mm256_cvtps_pd(_mm256_castps256_ps128(a));
    x[1] = _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1));
    x[2] = _mm256_cvtps_pd(_mm256_castps256_ps128(b));
    x[3] = _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1));
  }
  // The FP32 values of vector `half` (0: a, 1: b).
  MANTISSA_AVX2 __m256 fp32(int half) const {
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm256_cvtpd_ps(x[2 * half])),
                                _mm256_cvtpd_ps(x[2 * half + 1]), 1);
  }
};
MANTISSA_AVX2 inline Exact16 operator+(const Exact16& a, const Exact16& b) {
  Exact16 r;
  for (int i = 0; i < 4; ++i) r.x[i] = Exact16::round(_mm256_add_pd(a.x[i], b.x[i]));
  return r;
}
MANTISSA_AVX2 inline Exact16 operator*(const Exact16& a, const Exact16& b) {
  Exact16 r;
  for (int i = 0; i < 4; ++i) r.x[i] = Exact16::round(_mm256_mul_pd(a.x[i], b.x[i]));
  return r;
}
MANTISSA_AVX2 inline Exact16 operator/(const Exact16& a, const Exact16& b) {
  Exact16 r;
  for (int i = 0; i < 4; ++i) r.x[i] = Exact16::round(_mm256_div_pd(a.x[i], b.x[i]));
  return r;
}
MANTISSA_AVX2 inline Exact16 sqrt(const Exact16& a) {
  Exact16 r;
  for (int i = 0; i < 4; ++i) r.x[i] = Exact16::round(_mm256_sqrt_pd(a.x[i]));
  return r;
}

// ExactBits as vectors.
struct ExactThresholds {
  __m256i state, grad;
};

__attribute__((target("avx2,f16c"))) inline ExactThresholds exact_thresholds(ExactBits b) {
  return {_mm256_set1_epi32(static_cast<int>(b.state)),
          _mm256_set1_epi32(static_cast<int>(b.grad))};
}

// (|x| - 1) as unsigned: zero becomes the largest value, so a lane is small when this is below
// a threshold minus one. A value stored as FP16 is never small (its smallest magnitude is
// 2^-24): no test.
template <int T>
__attribute__((target("avx2,f16c"))) inline __m256i magnitude_minus_one(__m256 x) {
  if constexpr (T == static_cast<int>(DType::f16)) return _mm256_set1_epi32(-1);
  return _mm256_sub_epi32(_mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fffffff)),
                          _mm256_set1_epi32(1));
}

// Whether any lane is small: state (the minimum of the state's and weight's magnitude_minus_one)
// or grad (the gradient's) below its threshold.
__attribute__((target("avx2,f16c"))) inline bool any_small(__m256i state, __m256i grad,
                                                           const ExactThresholds& t) {
  // y >= t (unsigned) exactly when max(y, t) == y.
  const __m256i safe = _mm256_and_si256(_mm256_cmpeq_epi32(_mm256_max_epu32(state, t.state), state),
                                        _mm256_cmpeq_epi32(_mm256_max_epu32(grad, t.grad), grad));
  return !_mm256_testc_si256(safe, _mm256_set1_epi32(-1));
}

// Whether any lane of the vector holds a nonzero value below its threshold (or a subnormal).
template <int PT, int GT, int MT, int VT, bool kMaster>
__attribute__((target("avx2,f16c"))) inline bool exact_lanes(__m256 g, __m256 param, __m256 m,
                                                             __m256 v, const ExactThresholds& t) {
  const __m256i state = _mm256_min_epu32(
      _mm256_min_epu32(magnitude_minus_one<(kMaster ? static_cast<int>(DType::f32) : PT)>(param),
                       magnitude_minus_one<MT>(m)),
      magnitude_minus_one<VT>(v));
  return any_small(state, magnitude_minus_one<GT>(g), t);
}

// Sixteen lanes (vectors x[0], x[1] of each operand) on the exact lanes, in place: FP64 lanes
// four wide, or eight wide on an AVX-512 processor (optim_avx512.cc). (flatten: adam_formula,
// compiled for the baseline ISA, and the AVX2 operators it calls are inlined here, so the lanes
// stay in registers.)
__attribute__((target("avx2,f16c"), flatten)) void exact16(__m256* p, const __m256* g, __m256* m,
                                                           __m256* v, const AdamScalars& s) {
  static const bool avx512 = simd_path(SimdFamily::kOptimizer) == SimdPath::kAvx512;
  if (avx512) {
    alignas(32) float pb[16], gb[16], mb[16], vb[16];
    for (int h = 0; h < 2; ++h) {
      _mm256_store_ps(pb + 8 * h, p[h]);
      _mm256_store_ps(gb + 8 * h, g[h]);
      _mm256_store_ps(mb + 8 * h, m[h]);
      _mm256_store_ps(vb + 8 * h, v[h]);
    }
    adam_exact16_avx512(pb, gb, mb, vb, s);
    for (int h = 0; h < 2; ++h) {
      p[h] = _mm256_load_ps(pb + 8 * h);
      m[h] = _mm256_load_ps(mb + 8 * h);
      v[h] = _mm256_load_ps(vb + 8 * h);
    }
    return;
  }
  Exact16 pe(p[0], p[1]), me(m[0], m[1]), ve(v[0], v[1]);
  adam_formula<Exact16>(pe, Exact16(g[0], g[1]), me, ve, s);
  for (int h = 0; h < 2; ++h) p[h] = pe.fp32(h), m[h] = me.fp32(h), v[h] = ve.fp32(h);
}

// Vectors a and b (the same vector twice is allowed: it is written twice with the same values)
// on the exact lanes.
template <int PT, int GT, int MT, int VT, bool kMaster>
__attribute__((target("avx2,f16c"))) void exact_pair(const DirectChunk& c, int64_t a, int64_t b,
                                                     const AdamScalars& s) {
  const int64_t at[2] = {a, b};
  __m256 p[2], g[2], m[2], v[2];
  for (int h = 0; h < 2; ++h) {
    p[h] = kMaster ? _mm256_loadu_ps(c.master + at[h]) : load8_t<PT>(c.p, c.pt, at[h]);
    g[h] = load8_t<GT>(c.g, c.gt, at[h]);
    m[h] = load8_t<MT>(c.m, c.mt, at[h]);
    v[h] = load8_t<VT>(c.v, c.vt, at[h]);
  }
  exact16(p, g, m, v, s);
  for (int h = 0; h < 2; ++h) {
    store8_t<MT>(c.m, c.mt, at[h], m[h]);
    store8_t<VT>(c.v, c.vt, at[h], v[h]);
    if (kMaster) _mm256_storeu_ps(c.master + at[h], p[h]);
    store8_t<PT>(c.p, c.pt, at[h], p[h]);
  }
}

template <int PT, int GT, int MT, int VT, bool kMaster>
__attribute__((target("avx2,f16c"))) int64_t adam_direct_body(const DirectChunk& c, int64_t n,
                                                              const AdamScalars& s) {
  const __m256 b1 = _mm256_set1_ps(s.b1), b2 = _mm256_set1_ps(s.b2);
  const __m256 omb1 = _mm256_set1_ps(s.one_minus_b1), omb2 = _mm256_set1_ps(s.one_minus_b2);
  const __m256 neg_step = _mm256_set1_ps(-s.step_size), bc2 = _mm256_set1_ps(s.bc2_sqrt);
  const __m256 eps = _mm256_set1_ps(s.eps), wd = _mm256_set1_ps(s.wd);
  const __m256 decay = _mm256_set1_ps(s.decay);
  const __m256 unscale = _mm256_set1_ps(s.unscale), clip = _mm256_set1_ps(s.clip);
  const ExactThresholds thresholds = exact_thresholds(adam_exact_bits(s));
  int64_t pending = -1;  // a vector waiting for a partner on the exact path
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 g = load8_t<GT>(c.g, c.gt, j);
    const __m256 p = kMaster ? _mm256_loadu_ps(c.master + j) : load8_t<PT>(c.p, c.pt, j);
    const __m256 m = load8_t<MT>(c.m, c.mt, j), v = load8_t<VT>(c.v, c.vt, j);
    if (exact_lanes<PT, GT, MT, VT, kMaster>(g, p, m, v, thresholds)) {
      // Paired with the next such vector (or, the last, with itself).
      if (pending < 0) {
        pending = j;
        continue;
      }
      exact_pair<PT, GT, MT, VT, kMaster>(c, pending, j, s);
      pending = -1;
      continue;
    }
    __m256 grad = _mm256_mul_ps(_mm256_mul_ps(g, unscale), clip);
    __m256 param = p;
    if (s.decoupled)
      param = _mm256_mul_ps(param, decay);
    else if (s.wd != 0)
      grad = _mm256_add_ps(grad, _mm256_mul_ps(wd, param));
    const __m256 mj = _mm256_add_ps(_mm256_mul_ps(m, b1), _mm256_mul_ps(omb1, grad));
    const __m256 vj =
        _mm256_add_ps(_mm256_mul_ps(v, b2), _mm256_mul_ps(_mm256_mul_ps(omb2, grad), grad));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vj), bc2), eps);
    const __m256 pj = _mm256_add_ps(param, _mm256_mul_ps(neg_step, _mm256_div_ps(mj, denom)));
    store8_t<MT>(c.m, c.mt, j, mj);
    store8_t<VT>(c.v, c.vt, j, vj);
    if (kMaster) _mm256_storeu_ps(c.master + j, pj);
    store8_t<PT>(c.p, c.pt, j, pj);
  }
  if (pending >= 0) exact_pair<PT, GT, MT, VT, kMaster>(c, pending, pending, s);
  return j;
}

constexpr int kF32 = static_cast<int>(DType::f32), kF16 = static_cast<int>(DType::f16),
              kBF16 = static_cast<int>(DType::bf16);

// The SIMD part of a chunk (returns where the tail starts): specialised for the precision modes'
// storage combinations, generic otherwise.
__attribute__((target("avx2,f16c"))) int64_t adam_direct_simd(const DirectChunk& c, int64_t n,
                                                              const AdamScalars& s) {
  auto is = [](DType t, int k) { return static_cast<int>(t) == k; };
  if (!c.master) {
    if (is(c.pt, kF16) && is(c.gt, kF16) && is(c.mt, kF16) && is(c.vt, kBF16))
      return adam_direct_body<kF16, kF16, kF16, kBF16, false>(c, n, s);  // 16-true
    if (is(c.pt, kBF16) && is(c.gt, kBF16) && is(c.mt, kBF16) && is(c.vt, kBF16))
      return adam_direct_body<kBF16, kBF16, kBF16, kBF16, false>(c, n, s);  // bf16-true
    return adam_direct_body<kGeneric, kGeneric, kGeneric, kGeneric, false>(c, n, s);
  }
  if (is(c.pt, kF16) && is(c.gt, kF16) && is(c.mt, kF32) && is(c.vt, kF32))
    // f16 parameters with FP32 masters (--half-modules in O2)
    return adam_direct_body<kF16, kF16, kF32, kF32, true>(c, n, s);
  return adam_direct_body<kGeneric, kGeneric, kGeneric, kGeneric, true>(c, n, s);
}

__attribute__((target("avx2,f16c"))) void adam_direct(const DirectChunk& c, int64_t n,
                                                      const AdamScalars& s) {
  const void* pin = c.master ? static_cast<const void*>(c.master) : c.p;
  const DType pin_t = c.master ? DType::f32 : c.pt;
  const int64_t j = adam_direct_simd(c, n, s);
  if (j == n) return;
  // The tail through 8-wide buffers (padding lanes hold zeros and are not written back).
  const int64_t rest = n - j;
  alignas(32) float pb[8] = {}, gb[8] = {}, mb[8] = {}, vb[8] = {};
  auto get = [&](const void* base, DType t, float* out) {
    for (int64_t k = 0; k < rest; ++k) {
      switch (t) {
        case DType::f16:
          out[k] = static_cast<float>(f16::from_bits(static_cast<const uint16_t*>(base)[j + k]));
          break;
        case DType::bf16:
          out[k] = static_cast<float>(bf16::from_bits(static_cast<const uint16_t*>(base)[j + k]));
          break;
        default:
          out[k] = static_cast<const float*>(base)[j + k];
      }
    }
  };
  auto put = [&](void* base, DType t, const float* in) {
    for (int64_t k = 0; k < rest; ++k) {
      switch (t) {
        case DType::f16:
          static_cast<uint16_t*>(base)[j + k] = f16(in[k]).bits;
          break;
        case DType::bf16:
          static_cast<uint16_t*>(base)[j + k] = bf16(in[k]).bits;
          break;
        default:
          static_cast<float*>(base)[j + k] = in[k];
      }
    }
  };
  get(pin, pin_t, pb);
  get(c.g, c.gt, gb);
  get(c.m, c.mt, mb);
  get(c.v, c.vt, vb);
  for (int64_t k = 0; k < rest; ++k) adam_element(pb[k], gb[k], mb[k], vb[k], s);
  put(c.m, c.mt, mb);
  put(c.v, c.vt, vb);
  if (c.master) std::copy(pb, pb + rest, c.master + j);
  put(c.p, c.pt, pb);
}

// Lane k of the accumulator sums the elements j = k (mod 8), in order: the scalar loop's sums.
__attribute__((target("avx2"))) void sum_squares_8wide(const float* x, int64_t n, float scale,
                                                       float* acc) {
  __m256 a = _mm256_loadu_ps(acc);
  const __m256 s = _mm256_set1_ps(scale);
  const int64_t full = n & ~int64_t{7};
  for (int64_t j = 0; j < full; j += 8) {
    const __m256 u = _mm256_mul_ps(_mm256_loadu_ps(x + j), s);
    a = _mm256_add_ps(a, _mm256_mul_ps(u, u));
  }
  _mm256_storeu_ps(acc, a);
  for (int64_t j = full; j < n; ++j) {
    const float u = x[j] * scale;
    acc[j & 7] += u * u;
  }
}

// SGD, eight elements a vector: sgd_formula<float>'s operations in the same order (no FMA); a
// vector with a weight, buffer or gradient lane below 2^-100 in magnitude (nonzero) goes element
// by element through sgd_element, which computes such elements exactly without assists.
__attribute__((target("avx2,f16c"))) void sgd_avx2(float* p, const float* g, float* buf, int64_t n,
                                                   const SgdScalars& s) {
  const __m256 unscale = _mm256_set1_ps(s.unscale), clip = _mm256_set1_ps(s.clip);
  const __m256 wd = _mm256_set1_ps(s.wd), mom = _mm256_set1_ps(s.momentum);
  const __m256 damp = _mm256_set1_ps(s.damp), neg_lr = _mm256_set1_ps(-s.lr);
  const ExactThresholds thresholds = exact_thresholds(exact_bits(0x1p-100, s.unscale, s.clip));
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 pv = _mm256_loadu_ps(p + j), gv = _mm256_loadu_ps(g + j);
    const __m256 bv = buf ? _mm256_loadu_ps(buf + j) : _mm256_setzero_ps();
    if (any_small(_mm256_min_epu32(magnitude_minus_one<kF32>(pv), magnitude_minus_one<kF32>(bv)),
                  magnitude_minus_one<kF32>(gv), thresholds)) {
      for (int64_t k = j; k < j + 8; ++k) {
        float none = 0;
        sgd_element(p[k], g[k], buf ? buf[k] : none, s);
      }
      continue;
    }
    __m256 d = _mm256_mul_ps(_mm256_mul_ps(gv, unscale), clip);
    if (s.wd != 0) d = _mm256_add_ps(d, _mm256_mul_ps(wd, pv));
    if (s.use_momentum) {
      const __m256 m = s.first ? d : _mm256_add_ps(_mm256_mul_ps(bv, mom), _mm256_mul_ps(damp, d));
      _mm256_storeu_ps(buf + j, m);
      d = s.nesterov ? _mm256_add_ps(d, _mm256_mul_ps(mom, m)) : m;
    }
    _mm256_storeu_ps(p + j, _mm256_add_ps(pv, _mm256_mul_ps(neg_lr, d)));
  }
  for (; j < n; ++j) {
    float none = 0;
    sgd_element(p[j], g[j], buf ? buf[j] : none, s);
  }
}

}  // namespace

void sgd_update_avx2(float* p, const float* g, float* buf, int64_t n, const SgdScalars& s) {
  sgd_avx2(p, g, buf, n, s);
}

void sum_squares_avx2(const float* x, int64_t n, float scale, float* acc) {
  sum_squares_8wide(x, n, scale, acc);
}

void adam_update_direct_avx2(const DirectChunk& c, int64_t n, const AdamScalars& s) {
  adam_direct(c, n, s);
}

void adam_update_avx2(float* p, const float* g, float* m, float* v, int64_t n,
                      const AdamScalars& s) {
  // The FP32 case of the direct kernel: the same operations in the same order.
  const DirectChunk c{p, DType::f32, g, DType::f32, m, DType::f32, v, DType::f32, nullptr};
  for (int64_t j = adam_direct_body<kF32, kF32, kF32, kF32, false>(c, n, s); j < n; ++j)
    adam_element(p[j], g[j], m[j], v[j], s);
}

}  // namespace mantissa::optim::detail

// The AVX2 inner loop of Adam/AdamW (see optim_kernels.h). Compiled for the baseline ISA with a
// target attribute; chosen at run time.
#include <immintrin.h>

#include <algorithm>

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

template <int PT, int GT, int MT, int VT, bool kMaster>
__attribute__((target("avx2,f16c"))) int64_t adam_direct_body(const DirectChunk& c, int64_t n,
                                                              const AdamScalars& s) {
  const __m256 b1 = _mm256_set1_ps(s.b1), b2 = _mm256_set1_ps(s.b2);
  const __m256 omb1 = _mm256_set1_ps(s.one_minus_b1), omb2 = _mm256_set1_ps(s.one_minus_b2);
  const __m256 neg_step = _mm256_set1_ps(-s.step_size), bc2 = _mm256_set1_ps(s.bc2_sqrt);
  const __m256 eps = _mm256_set1_ps(s.eps), wd = _mm256_set1_ps(s.wd);
  const __m256 decay = _mm256_set1_ps(s.decay);
  const __m256 unscale = _mm256_set1_ps(s.unscale), clip = _mm256_set1_ps(s.clip);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 grad = _mm256_mul_ps(_mm256_mul_ps(load8_t<GT>(c.g, c.gt, j), unscale), clip);
    __m256 param = kMaster ? _mm256_loadu_ps(c.master + j) : load8_t<PT>(c.p, c.pt, j);
    if (s.decoupled)
      param = _mm256_mul_ps(param, decay);
    else if (s.wd != 0)
      grad = _mm256_add_ps(grad, _mm256_mul_ps(wd, param));
    const __m256 mj =
        _mm256_add_ps(_mm256_mul_ps(load8_t<MT>(c.m, c.mt, j), b1), _mm256_mul_ps(omb1, grad));
    const __m256 vj = _mm256_add_ps(_mm256_mul_ps(load8_t<VT>(c.v, c.vt, j), b2),
                                    _mm256_mul_ps(_mm256_mul_ps(omb2, grad), grad));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vj), bc2), eps);
    const __m256 pj = _mm256_add_ps(param, _mm256_mul_ps(neg_step, _mm256_div_ps(mj, denom)));
    store8_t<MT>(c.m, c.mt, j, mj);
    store8_t<VT>(c.v, c.vt, j, vj);
    if (kMaster) _mm256_storeu_ps(c.master + j, pj);
    store8_t<PT>(c.p, c.pt, j, pj);
  }
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
    return adam_direct_body<kF16, kF16, kF32, kF32, true>(c, n, s);  // O2
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

}  // namespace

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

// The Adam/AdamW loop on AVX-512 (optim_avx2.cc has the AVX2 one and explains the exact lanes):
// sixteen lanes a vector, loads and stores in the storage types converted in registers
// (core/convert_simd512_internal.h), the FP32 operations of adam_formula in its order. A vector
// with a lane near the subnormal range takes the exact lanes: adam_formula over sixteen FP32 lanes
// held as two vectors of eight FP64 values, each operation rounded to FP32 as it is made (half the
// conversions of the AVX2 version's exact lanes, which they, not the arithmetic, bound: 43 against
// 68 ns for sixteen lanes on a Xeon with AVX-512). This file is compiled without floating-point
// contraction (CMakeLists.txt): AVX-512 has FMA, and a fused multiply-add would change the bits.
#include <immintrin.h>

#include "mantissa/core/convert_simd512_internal.h"
#include "mantissa/optim/optim_kernels.h"

#define MANTISSA_AVX512 MANTISSA_AVX512_TARGET

namespace mantissa::optim::detail {
namespace {

// The zero-masking forms: the plain conversions pass GCC 12 an undefined source that
// -Wmaybe-uninitialized reports.
struct Exact16 {
  __m512d x[2];
  MANTISSA_AVX512 static inline __m512d round(__m512d v) {
    return _mm512_maskz_cvtps_pd(0xff, _mm512_maskz_cvtpd_ps(0xff, v));
  }
  MANTISSA_AVX512 Exact16() = default;
  MANTISSA_AVX512 explicit Exact16(float f) {
    for (__m512d& v : x) v = _mm512_set1_pd(static_cast<double>(f));
  }
  MANTISSA_AVX512 explicit Exact16(const float* f) {
    x[0] = _mm512_maskz_cvtps_pd(0xff, _mm256_loadu_ps(f));
    x[1] = _mm512_maskz_cvtps_pd(0xff, _mm256_loadu_ps(f + 8));
  }
  MANTISSA_AVX512 void store(float* f) const {
    _mm256_storeu_ps(f, _mm512_maskz_cvtpd_ps(0xff, x[0]));
    _mm256_storeu_ps(f + 8, _mm512_maskz_cvtpd_ps(0xff, x[1]));
  }
};
MANTISSA_AVX512 inline Exact16 operator+(const Exact16& a, const Exact16& b) {
  Exact16 r;
  for (int i = 0; i < 2; ++i) r.x[i] = Exact16::round(_mm512_add_pd(a.x[i], b.x[i]));
  return r;
}
MANTISSA_AVX512 inline Exact16 operator*(const Exact16& a, const Exact16& b) {
  Exact16 r;
  for (int i = 0; i < 2; ++i) r.x[i] = Exact16::round(_mm512_mul_pd(a.x[i], b.x[i]));
  return r;
}
MANTISSA_AVX512 inline Exact16 operator/(const Exact16& a, const Exact16& b) {
  Exact16 r;
  for (int i = 0; i < 2; ++i) r.x[i] = Exact16::round(_mm512_div_pd(a.x[i], b.x[i]));
  return r;
}
MANTISSA_AVX512 inline Exact16 sqrt(const Exact16& a) {
  Exact16 r;
  for (int i = 0; i < 2; ++i) r.x[i] = Exact16::round(_mm512_maskz_sqrt_pd(0xff, a.x[i]));
  return r;
}

}  // namespace

// (flatten: adam_formula, compiled for the baseline ISA, and the operators it calls are inlined
// here, so the lanes stay in registers.)
MANTISSA_AVX512 __attribute__((flatten)) void adam_exact16_avx512(float* p, const float* g,
                                                                  float* m, float* v,
                                                                  const AdamScalars& s) {
  Exact16 pe(p), me(m), ve(v);
  adam_formula<Exact16>(pe, Exact16(g), me, ve, s);
  pe.store(p);
  me.store(m);
  ve.store(v);
}

namespace {

// Sixteen values of storage T (a DType as int) at element i of base, as FP32, and back rounded to
// nearest even.
template <int T>
MANTISSA_AVX512 inline __attribute__((always_inline)) __m512 load16(const void* base, int64_t i) {
  constexpr DType t = static_cast<DType>(T);
  return simd512::load16(static_cast<const char*>(base) + i * static_cast<int64_t>(dtype_size(t)),
                         t);
}
template <int T>
MANTISSA_AVX512 inline __attribute__((always_inline)) void store16(void* base, int64_t i,
                                                                   __m512 x) {
  constexpr DType t = static_cast<DType>(T);
  simd512::store16(static_cast<char*>(base) + i * static_cast<int64_t>(dtype_size(t)), t, x);
}

// Lanes whose nonzero magnitude is below the threshold (ExactBits): (|x| - 1) as unsigned, below
// it. A value stored as FP16 is never small (its smallest magnitude is 2^-24): no test.
template <int T>
MANTISSA_AVX512 inline __attribute__((always_inline)) __mmask16 small(__m512 x, __m512i bits) {
  if constexpr (T == static_cast<int>(DType::f16)) return 0;
  const __m512i mag =
      _mm512_sub_epi32(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff)),
                       _mm512_set1_epi32(1));
  return _mm512_cmplt_epu32_mask(mag, bits);
}

// An FP32 multiply or divide of each lane made in FP64 and rounded to FP32: the FP32 operation's
// bits (the product of two FP32 values is exact in FP64; a quotient rounded to FP64 and then to
// FP32 is correctly rounded, subnormal results included), without the microcode assist an FP32
// operation with a subnormal operand or result takes. Conversions take none.
template <bool kDivide>
MANTISSA_AVX512 inline __attribute__((always_inline)) __m256 via_fp64_half(__m256 a, __m256 b) {
  const __m512d x = _mm512_maskz_cvtps_pd(0xff, a), y = _mm512_maskz_cvtps_pd(0xff, b);
  return _mm512_maskz_cvtpd_ps(0xff, kDivide ? _mm512_div_pd(x, y) : _mm512_mul_pd(x, y));
}
template <bool kDivide>
MANTISSA_AVX512 inline __attribute__((always_inline)) __m512 via_fp64(__m512 a, __m512 b) {
  const __m256 lo = via_fp64_half<kDivide>(_mm512_maskz_extractf32x8_ps(0xff, a, 0),
                                           _mm512_maskz_extractf32x8_ps(0xff, b, 0));
  const __m256 hi = via_fp64_half<kDivide>(_mm512_maskz_extractf32x8_ps(0xff, a, 1),
                                           _mm512_maskz_extractf32x8_ps(0xff, b, 1));
  return _mm512_maskz_insertf32x8(
      0xffff, _mm512_maskz_insertf32x8(0xffff, _mm512_setzero_ps(), lo, 0), hi, 1);
}

// A product or quotient of FP32 lanes: in FP32, or (kFp64) through via_fp64.
template <bool kFp64>
MANTISSA_AVX512 inline __attribute__((always_inline)) __m512 mul(__m512 a, __m512 b) {
  return kFp64 ? via_fp64<false>(a, b) : _mm512_mul_ps(a, b);
}
template <bool kFp64>
MANTISSA_AVX512 inline __attribute__((always_inline)) __m512 div(__m512 a, __m512 b) {
  return kFp64 ? via_fp64<true>(a, b) : _mm512_div_ps(a, b);
}

// adam_formula's FP32 operations over sixteen lanes, in its order, the scalars broadcast once.
struct Formula16 {
  __m512 b1, b2, omb1, omb2, neg_step, bc2, eps, wd, decay, unscale, clip;
  bool decoupled, l2;
  MANTISSA_AVX512 explicit Formula16(const AdamScalars& s)
      : b1(_mm512_set1_ps(s.b1)),
        b2(_mm512_set1_ps(s.b2)),
        omb1(_mm512_set1_ps(s.one_minus_b1)),
        omb2(_mm512_set1_ps(s.one_minus_b2)),
        neg_step(_mm512_set1_ps(-s.step_size)),
        bc2(_mm512_set1_ps(s.bc2_sqrt)),
        eps(_mm512_set1_ps(s.eps)),
        wd(_mm512_set1_ps(s.wd)),
        decay(_mm512_set1_ps(s.decay)),
        unscale(_mm512_set1_ps(s.unscale)),
        clip(_mm512_set1_ps(s.clip)),
        decoupled(s.decoupled),
        l2(s.wd != 0) {}
  // kSmallMoments: the three operations a first moment near or below the subnormal range reaches
  // (m * beta1, m / denom and the step times that quotient) made in FP64, without assists, for a
  // vector whose other operands are normal or zero; the same bits either way.
  template <bool kSmallMoments>
  MANTISSA_AVX512 inline __attribute__((always_inline)) void apply(__m512 p, __m512 g, __m512 m,
                                                                   __m512 v, __m512& pj, __m512& mj,
                                                                   __m512& vj) const {
    __m512 grad = _mm512_mul_ps(_mm512_mul_ps(g, unscale), clip);
    __m512 param = p;
    if (decoupled)
      param = _mm512_mul_ps(param, decay);
    else if (l2)
      grad = _mm512_add_ps(grad, _mm512_mul_ps(wd, param));
    mj = _mm512_add_ps(mul<kSmallMoments>(m, b1), _mm512_mul_ps(omb1, grad));
    vj = _mm512_add_ps(_mm512_mul_ps(v, b2), _mm512_mul_ps(_mm512_mul_ps(omb2, grad), grad));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_maskz_sqrt_ps(0xffff, vj), bc2), eps);
    pj = _mm512_add_ps(param, mul<kSmallMoments>(neg_step, div<kSmallMoments>(mj, denom)));
  }
};

template <int PT, int GT, int MT, int VT, bool kMaster>
MANTISSA_AVX512 int64_t adam_body(const DirectChunk& c, int64_t n, const AdamScalars& s) {
  // The weight's storage as the test reads it: the master's FP32 where there is one.
  constexpr int kPT = kMaster ? static_cast<int>(DType::f32) : PT;
  const Formula16 formula(s);
  const ExactBits eb = adam_exact_bits(s);
  const __m512i state_bits = _mm512_set1_epi32(static_cast<int>(eb.state));
  const __m512i grad_bits = _mm512_set1_epi32(static_cast<int>(eb.grad));
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 g = load16<GT>(c.g, j);
    const __m512 p = kMaster ? _mm512_loadu_ps(c.master + j) : load16<PT>(c.p, j);
    const __m512 m = load16<MT>(c.m, j), v = load16<VT>(c.v, j);
    __m512 pj, mj, vj;
    const __mmask16 small_m = small<MT>(m, state_bits);
    const __mmask16 small_rest =
        small<GT>(g, grad_bits) | small<kPT>(p, state_bits) | small<VT>(v, state_bits);
    if (!(small_m | small_rest)) {
      formula.apply<false>(p, g, m, v, pj, mj, vj);
    } else if (!small_rest) {
      // Only first moments are small: a weight whose gradient has been exactly zero for many
      // steps, its moment decayed into the subnormal range, where it stays.
      formula.apply<true>(p, g, m, v, pj, mj, vj);
    } else {
      alignas(64) float pb[16], gb[16], mb[16], vb[16];
      _mm512_store_ps(pb, p);
      _mm512_store_ps(gb, g);
      _mm512_store_ps(mb, m);
      _mm512_store_ps(vb, v);
      adam_exact16_avx512(pb, gb, mb, vb, s);
      pj = _mm512_load_ps(pb);
      mj = _mm512_load_ps(mb);
      vj = _mm512_load_ps(vb);
    }
    store16<MT>(c.m, j, mj);
    store16<VT>(c.v, j, vj);
    if (kMaster) _mm512_storeu_ps(c.master + j, pj);
    store16<PT>(c.p, j, pj);
  }
  return j;
}

// The vector part of a chunk (returns where the rest starts): specialised for the precision
// modes' storage combinations; others take the AVX2 loop.
MANTISSA_AVX512 int64_t adam_simd(const DirectChunk& c, int64_t n, const AdamScalars& s) {
  constexpr int kF32 = static_cast<int>(DType::f32), kF16 = static_cast<int>(DType::f16),
                kBF16 = static_cast<int>(DType::bf16);
  auto is = [](DType t, int k) { return static_cast<int>(t) == k; };
  auto all = [&](int p, int g, int m, int v) {
    return is(c.pt, p) && is(c.gt, g) && is(c.mt, m) && is(c.vt, v);
  };
  if (!c.master) {
    if (all(kF32, kF32, kF32, kF32))  // 32-true and the mixed modes
      return adam_body<kF32, kF32, kF32, kF32, false>(c, n, s);
    if (all(kF32, kF16, kF32, kF32))  // a 16-bit gradient (16-mixed's parts)
      return adam_body<kF32, kF16, kF32, kF32, false>(c, n, s);
    if (all(kF32, kBF16, kF32, kF32))  // bf16-mixed's parts
      return adam_body<kF32, kBF16, kF32, kF32, false>(c, n, s);
    if (all(kF16, kF16, kF16, kBF16))  // 16-true
      return adam_body<kF16, kF16, kF16, kBF16, false>(c, n, s);
    if (all(kBF16, kBF16, kBF16, kBF16))  // bf16-true
      return adam_body<kBF16, kBF16, kBF16, kBF16, false>(c, n, s);
    return 0;
  }
  if (all(kF16, kF16, kF32, kF32))  // f16 parameters with FP32 masters (--half-modules in O2)
    return adam_body<kF16, kF16, kF32, kF32, true>(c, n, s);
  return 0;
}

// The chunk from element j on.
DirectChunk from(const DirectChunk& c, int64_t j) {
  auto off = [j](DType t) { return j * static_cast<int64_t>(dtype_size(t)); };
  return {
      static_cast<char*>(c.p) + off(c.pt), c.pt, static_cast<const char*>(c.g) + off(c.gt), c.gt,
      static_cast<char*>(c.m) + off(c.mt), c.mt, static_cast<char*>(c.v) + off(c.vt),       c.vt,
      c.master ? c.master + j : nullptr};
}

}  // namespace

void adam_update_direct_avx512(const DirectChunk& c, int64_t n, const AdamScalars& s) {
  const int64_t j = adam_simd(c, n, s);
  if (j < n) adam_update_direct_avx2(from(c, j), n - j, s);
}

}  // namespace mantissa::optim::detail

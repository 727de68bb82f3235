// The exact lanes of the Adam/AdamW loop (optim_avx2.cc) on AVX-512: adam_formula over sixteen
// FP32 lanes held as two vectors of eight FP64 values, each operation rounded to FP32 as it is
// made. Half the conversions a lane of the AVX2 version needs (they, not the arithmetic, bound
// it): 43 against 68 ns for sixteen lanes on a Xeon with AVX-512.
#include <immintrin.h>

#include "mantissa/optim/optim_kernels.h"

#define MANTISSA_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))

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

}  // namespace mantissa::optim::detail

// Internal: the optimizers' inner loops over FP32 arrays, written once per element as inline
// functions (the scalar path and the tails of the SIMD path), with an AVX2 version chosen at run
// time. Both do the same IEEE operations in the same order (no fused multiply-add), so they give
// identical bits and a run does not depend on the machine's SIMD width.
#pragma once

#include <cmath>
#include <cstdint>

#include "mantissa/core/dtype.h"

namespace mantissa::optim::detail {

struct AdamScalars {
  float b1, b2, one_minus_b1, one_minus_b2;
  float step_size;  // lr / bias_correction1
  float bc2_sqrt;   // sqrt(bias_correction2)
  float eps;
  float wd;     // Adam: L2 added to the gradient
  float decay;  // AdamW: 1 - lr * weight_decay
  bool decoupled;
  // The gradient used is (g * unscale) * clip: the loss scaler's 1/S, then the clipping
  // coefficient, as PyTorch's unscale_ and clip_grad_norm_ apply them in place (x 1 is exact).
  float unscale = 1, clip = 1;
};

// PyTorch 1.13's single-tensor Adam/AdamW, written once over a number type T with FP32's
// operations (T(x) from a float scalar, +, *, /, and sqrt found by argument-dependent lookup):
// float for one element; the AVX2 path's exact lanes use FP64 vectors rounded to FP32 after each
// operation, which gives the same bits (optim_avx2.cc).
inline float sqrt(float x) { return std::sqrt(x); }

template <class T>
inline void adam_formula(T& p, T g, T& m, T& v, const AdamScalars& s) {
  T grad = (g * T(s.unscale)) * T(s.clip), param = p;
  if (s.decoupled)
    param = param * T(s.decay);
  else if (s.wd != 0)
    grad = grad + T(s.wd) * param;
  const T mj = m * T(s.b1) + T(s.one_minus_b1) * grad;
  const T vj = v * T(s.b2) + T(s.one_minus_b2) * grad * grad;
  const T denom = sqrt(vj) / T(s.bc2_sqrt) + T(s.eps);
  m = mj;
  v = vj;
  p = param + T(-s.step_size) * (mj / denom);
}

// One element.
inline void adam_element(float& p, float g, float& m, float& v, const AdamScalars& s) {
  adam_formula<float>(p, g, m, v, s);
}

// PyTorch 1.13's SGD (momentum, dampening, Nesterov, L2 weight decay), one element, over a number
// type as adam_formula: float, or ExactFloat for an element near the subnormal range.
struct SgdScalars {
  float lr, momentum, damp;  // damp: 1 - dampening
  float wd;
  bool use_momentum, first, nesterov;  // first: the momentum buffer is created this step
  float unscale = 1, clip = 1;
};

template <class T>
inline void sgd_formula(T& p, T g, T& buf, const SgdScalars& s) {
  T d = (g * T(s.unscale)) * T(s.clip);
  if (s.wd != 0) d = d + T(s.wd) * p;
  if (s.use_momentum) {
    const T m = s.first ? d : buf * T(s.momentum) + T(s.damp) * d;
    buf = m;
    d = s.nesterov ? d + T(s.momentum) * m : m;
  }
  p = p + T(-s.lr) * d;
}

// One FP32 value held as an FP64 one, each operation rounded to FP32 as it is made: the same
// bits as the FP32 operation (a product of FP32 values is exact in FP64; rounding a sum,
// quotient or square root to FP64 and then to FP32 is the correctly rounded FP32 result, as
// 53 >= 2 * 24 + 2, subnormal results included), without the microcode assists some processors
// take for FP32 arithmetic on subnormals (conversions take none).
struct ExactFloat {
  double v;
  explicit ExactFloat(float x) : v(x) {}
  static ExactFloat rounded(double x) {
    // An empty asm the value passes through: otherwise the compiler turns the FP64 operation on
    // FP32 values and its rounding back into the FP32 operation (the same value, but with the
    // assists this type is for).
#if defined(__x86_64__) || defined(__i386__)
    asm volatile("" : "+x"(x));
#else
    asm volatile("" : "+m"(x));
#endif
    return ExactFloat(static_cast<float>(x));
  }
  float value() const { return static_cast<float>(v); }
};
inline ExactFloat operator+(ExactFloat a, ExactFloat b) { return ExactFloat::rounded(a.v + b.v); }
inline ExactFloat operator*(ExactFloat a, ExactFloat b) { return ExactFloat::rounded(a.v * b.v); }

// Whether an FP32 value is nonzero and below 2^-100 in magnitude (a subnormal included): an
// operand whose products may leave the normal range.
inline bool near_subnormal(float x) {
  const float a = std::fabs(x);
  return a != 0 && a < 0x1p-100f;
}

// One SGD element: sgd_formula in FP32, or in ExactFloat when its weight, buffer or (unscaled,
// clipped) gradient is near the subnormal range; the same bits either way. b: the buffer's
// element (any value without momentum).
inline void sgd_element(float& p, float g, float& b, const SgdScalars& s) {
  // The gradient as it enters the formula, in FP64 (no assist; below FP32's range it is small
  // too).
  const double d = std::fabs(static_cast<double>(g) * s.unscale * s.clip);
  if (!near_subnormal(p) && !near_subnormal(b) && !(d != 0 && d < 0x1p-100)) {
    sgd_formula<float>(p, g, b, s);
    return;
  }
  ExactFloat pe(p), be(b);
  sgd_formula<ExactFloat>(pe, ExactFloat(g), be, s);
  p = pe.value();
  b = be.value();
}

// SGD over n elements of FP32 parameter, gradient and momentum buffer (buf may be null without
// momentum), sgd_element's bits: eight at a time on the AVX2 path (a vector with an element near
// the subnormal range element by element).
void sgd_update(float* p, const float* g, float* buf, int64_t n, const SgdScalars& s);
#if MANTISSA_HAVE_X86_SIMD
void sgd_update_avx2(float* p, const float* g, float* buf, int64_t n, const SgdScalars& s);
#endif

// The bit patterns below which a nonzero magnitude sends a vector to the exact lanes, minus one
// (compared as unsigned with a lane's FP32 bits & 0x7fffffff, minus one, so zero never counts):
// 2^-100 for the state and the weight (products of them with the betas, the momentum, the decay
// and the step stay normal), and for the gradient the smallest safe size of (g * unscale) * clip
// divided by the unscale and clip factors.
struct ExactBits {
  uint32_t state, grad;
};
// safe_grad: the smallest safe magnitude of the gradient as it enters the formula (0: none).
ExactBits exact_bits(double safe_grad, float unscale, float clip);
// Adam's: the gradient where (1 - beta2) * grad^2 or (1 - beta1) * grad would come within 2^-120
// of the subnormal range.
ExactBits adam_exact_bits(const AdamScalars& s);

// n elements of a parameter, its gradient and its Adam state in their storage types (f32, f16,
// bf16), read and written in place: no FP32 staging copies. With `master` the parameter's values
// come from and go to the FP32 master, and `p` receives them rounded. Writes round to nearest
// even, so the results equal the staged path's bit for bit.
struct DirectChunk {
  void* p;
  DType pt;
  const void* g;
  DType gt;
  void* m;
  DType mt;
  void* v;
  DType vt;
  float* master;  // nullptr: none
};
// False when this machine has no such path (the caller stages instead).
bool adam_update_direct(const DirectChunk& c, int64_t n, const AdamScalars& s);
#if MANTISSA_HAVE_X86_SIMD
void adam_update_direct_avx2(const DirectChunk& c, int64_t n, const AdamScalars& s);
// The AVX-512 loop: sixteen lanes at a time (a vector with a small lane through
// adam_exact16_avx512), the last n % 16 elements through the AVX2 loop; the same bits.
void adam_update_direct_avx512(const DirectChunk& c, int64_t n, const AdamScalars& s);
// Sixteen elements (FP32 values in arrays, updated in place) through adam_formula in FP64 lanes
// rounded to FP32 after each operation: the AVX2 loop's exact lanes on an AVX-512 processor
// (optim_avx512.cc).
void adam_exact16_avx512(float* p, const float* g, float* m, float* v, const AdamScalars& s);
#endif

// acc[j % 8] += (x[j] * scale)^2 over n elements, in order (a run's sum of squares: the same
// operations on the scalar and the AVX2 path).
inline void sum_squares8(const float* x, int64_t n, float scale, float* acc) {
  for (int64_t j = 0; j < n; ++j) {
    const float u = x[j] * scale;
    acc[j & 7] += u * u;
  }
}
void sum_squares(const float* x, int64_t n, float scale, float* acc);
#if MANTISSA_HAVE_X86_SIMD
void sum_squares_avx2(const float* x, int64_t n, float scale, float* acc);
#endif

// Adam over n contiguous elements; the AVX2 path when the CPU has it (optim.cc dispatches).
void adam_update(float* p, const float* g, float* m, float* v, int64_t n, const AdamScalars& s);
#if MANTISSA_HAVE_X86_SIMD
void adam_update_avx2(float* p, const float* g, float* m, float* v, int64_t n,
                      const AdamScalars& s);  // optim_avx2.cc
#endif

}  // namespace mantissa::optim::detail

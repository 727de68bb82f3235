// Test tolerances per storage dtype, in one place.
#pragma once

#include "mantissa/core/dtype.h"

namespace mantissa::testing {

// Relative error allowed for a value stored in `t`: one unit in the last place of the format
// (the fast kernels compute in FP32 and round once), or FP32 arithmetic for f32.
inline double storage_rtol(DType t) {
  switch (t) {
    case DType::f16:
      return 0x1p-10;  // 9.8e-4
    case DType::bf16:
      return 0x1p-7;  // 7.8e-3
    default:
      return 2e-6;
  }
}

// Relative error of a gradient computed from inputs and intermediates stored in `t` (a few
// roundings deep) against an exact FP64 reference gradient.
inline double gradient_rtol(DType t) {
  switch (t) {
    case DType::f16:
      return 6e-3;
    case DType::bf16:
      return 5e-2;
    default:
      return 2e-4;
  }
}

// Against PyTorch's golden data: |mantissa - pytorch| <= rtol * max(|pytorch|, floor * max|t|).
// In FP32 both compute the same sums in different orders. PyTorch 1.13's BF16 CPU kernels round
// intermediate results (a 27-term convolution can differ from the correctly rounded result by
// 20%), while Mantissa rounds once (tests/ops checks it is within 1 ulp of FP64): BF16 data are
// compared at the scale of the whole tensor.
struct GoldenTolerance {
  double rtol;
  double floor;  // fraction of the tensor's largest magnitude
};
inline GoldenTolerance golden_tolerance(DType t, bool gradient) {
  if (t == DType::bf16) return {0x1p-5, 1.0};
  return {gradient ? 2e-4 : 2e-5, 0.02};
}

}  // namespace mantissa::testing

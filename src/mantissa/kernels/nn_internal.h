// Internal: what the neural-network kernel files (linear, conv*, pool, norm, loss, dropout) share:
// byte pointers, argument checks, FP32 workspaces, bias and whole-tensor FP32 staging. Not a
// public API; included by those files' .cc only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "mantissa/core/convert.h"
#include "mantissa/core/error.h"
#include "mantissa/core/parallel.h"
#include "mantissa/core/tensor.h"
#include "mantissa/kernels/elementwise.h"
#include "mantissa/kernels/quantize.h"

namespace mantissa::kernels {

// A tensor's storage as bytes (offsets in elements times esize()).
inline const char* bytes(const Tensor& t) { return static_cast<const char*>(t.data_ptr()); }
inline char* bytes(Tensor& t) { return static_cast<char*>(t.data_ptr()); }
inline int64_t esize(DType t) { return static_cast<int64_t>(dtype_size(t)); }

inline std::string str(int64_t v) { return std::to_string(v); }

// Throws mantissa::Error unless t is defined and f32, f16 or bf16 (the storage the kernels read).
inline void require_float(const Tensor& t, const char* op, const char* what) {
  MANTISSA_CHECK(t.defined(), std::string(op) + ": " + what + " is undefined", "pass a tensor");
  MANTISSA_CHECK(is_floating(t.dtype()) && t.dtype() != DType::f64,
                 std::string(op) + ": " + what + " must be f32, f16 or bf16 (got " +
                     std::string(dtype_name(t.dtype())) + ")",
                 "convert it with cast() first");
}

inline void require_rank(const Tensor& t, int64_t rank, const char* op, const char* what) {
  MANTISSA_CHECK(t.dim() == rank,
                 std::string(op) + ": " + what + " must have " + str(rank) +
                     " dimensions, got shape " + shape_str(t.shape()),
                 rank == 4 ? "use the (N, C, H, W) layout" : "reshape the input");
}

// Lane-split dot products (vector_kernels.h) serve outputs with at most this many rows: a linear
// layer's small batch, a convolution's few output channels in its weight gradient.
inline constexpr int64_t kDotMaxRows = 16;

// A bias (or zeros where there is none) as n FP32 values.
inline std::vector<float> bias_f32(const Tensor& b, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n), 0.0f);
  if (b.defined()) {
    const Tensor bc = b.contiguous();
    convert(bc.data_ptr(), bc.dtype(), v.data(), DType::f32, v.size());
  }
  return v;
}

// An FP32 buffer charged to the memory tracker as workspace.
inline Tensor f32_workspace(const Shape& shape) {
  TensorOptions o;
  o.category = MemoryCategory::workspace;
  o.owner = "kernel workspace";
  return Tensor::empty(shape, DType::f32, o);
}

// A whole tensor's values in FP32 (small tensors: statistics, affine parameters, logits).
inline std::vector<float> load_all(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  const Tensor c = t.contiguous();
  if (!v.empty()) convert(c.data_ptr(), c.dtype(), v.data(), DType::f32, v.size());
  return v;
}

// FP32 values as a new tensor of dtype t (rounded to nearest even), charged to `cat`.
inline Tensor from_vector(const std::vector<float>& v, const Shape& shape, DType t,
                          MemoryCategory cat) {
  Tensor out = Tensor::empty(shape, t, charged_to(cat));
  if (!v.empty()) convert(v.data(), DType::f32, out.data_ptr(), t, v.size());
  return out;
}

// What a weight gradient's bound (linear_weight_grad_bound, conv2d_weight_grad_bound) is made of:
// a and b (contiguous) cut into `slices` equal slices (a linear layer's rows, a convolution's
// images), the largest |value| of each slice of each, read in parallel; +inf for a slice holding
// an inf or NaN.
inline std::pair<std::vector<double>, std::vector<double>> slice_amaxes(const Tensor& a,
                                                                        const Tensor& b,
                                                                        int64_t slices) {
  std::vector<double> am(static_cast<size_t>(slices)), bm(static_cast<size_t>(slices));
  const int64_t na = a.numel() / std::max<int64_t>(slices, 1),
                nb = b.numel() / std::max<int64_t>(slices, 1);
  parallel_for(
      static_cast<size_t>(slices), 1, threads_for(slices * (na + nb)), [&](size_t s0, size_t s1) {
        for (size_t s = s0; s < s1; ++s) {
          const int64_t i = static_cast<int64_t>(s);
          am[s] = amax(bytes(a) + i * na * esize(a.dtype()), a.dtype(), static_cast<size_t>(na));
          bm[s] = amax(bytes(b) + i * nb * esize(b.dtype()), b.dtype(), static_cast<size_t>(nb));
        }
      });
  return {std::move(am), std::move(bm)};
}

// A bound t of a gradient's FP32 values, carried into their rounding into `out`: +infinity when
// a value could round past out's largest finite value; otherwise t widened by half a unit (bf16:
// a factor 1 + 2^-8), at most that largest value.
inline double bound_rounded_into(double t, DType out) {
  const double largest = max_finite(out);
  if (!(t <= largest)) return std::numeric_limits<double>::infinity();
  return std::min(t * (1 + 0x1p-7), largest);
}

}  // namespace mantissa::kernels

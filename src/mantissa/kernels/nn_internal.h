// Internal: what the neural-network kernel files (linear, conv*, pool, norm, loss, dropout) share:
// byte pointers, argument checks, FP32 workspaces, bias and whole-tensor FP32 staging. Not a
// public API; included by those files' .cc only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mantissa/core/convert.h"
#include "mantissa/core/error.h"
#include "mantissa/core/tensor.h"
#include "mantissa/kernels/elementwise.h"

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

}  // namespace mantissa::kernels

// Elementwise, broadcasting, reduction and softmax kernels over tensors of any float storage
// dtype, computing in FP32. Raw kernels: they record nothing (src/mantissa/ops adds autograd).
// Every kernel writes a new tensor of the requested dtype, charged to the requested category.
#pragma once

#include <cstdint>
#include <vector>

#include "mantissa/core/parallel.h"
#include "mantissa/core/tensor.h"

namespace mantissa::kernels {

enum class UnaryOp : uint8_t { kRelu, kGelu, kSigmoid, kTanh, kNeg, kExp, kLog, kSqrt, kSquare };
enum class BinaryOp : uint8_t { kAdd, kSub, kMul, kDiv };

// The shape two shapes broadcast to (NumPy rules); throws mantissa::Error naming both if they
// do not.
Shape broadcast_shapes(const Shape& a, const Shape& b);

// y = op(x).
Tensor unary(UnaryOp op, const Tensor& x, DType out,
             MemoryCategory cat = MemoryCategory::activations);
// dx = dy * op'(x), from x (GELU) or from y = op(x) (ReLU, sigmoid, tanh use y). `into`, when
// defined, receives dx and is returned (a contiguous tensor of dy's shape in dtype `out`: dy
// itself when nothing else reads it; each element is read before it is written).
Tensor unary_backward(UnaryOp op, const Tensor& grad_out, const Tensor& x, const Tensor& y,
                      DType out, MemoryCategory cat = MemoryCategory::gradients,
                      Tensor into = Tensor());

// a op b with broadcasting.
Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b, DType out,
              MemoryCategory cat = MemoryCategory::activations);
inline Tensor add(const Tensor& a, const Tensor& b, DType out,
                  MemoryCategory cat = MemoryCategory::activations) {
  return binary(BinaryOp::kAdd, a, b, out, cat);
}
// a op s, or s op a when scalar_first.
Tensor binary_scalar(BinaryOp op, const Tensor& a, double s, bool scalar_first, DType out,
                     MemoryCategory cat = MemoryCategory::activations);

// Sums g over the dimensions that broadcasting expanded, giving `shape` (the gradient of a
// broadcast operand).
Tensor sum_to_shape(const Tensor& g, const Shape& shape, DType out,
                    MemoryCategory cat = MemoryCategory::gradients);

// Sum over `dims` (all when empty), keeping them as size 1 when keepdim. Accumulates in FP32.
Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim, DType out,
           MemoryCategory cat = MemoryCategory::activations);

// softmax or log_softmax along dim, and their backward from the output y.
Tensor softmax(const Tensor& x, int64_t dim, bool log, DType out,
               MemoryCategory cat = MemoryCategory::activations);
Tensor softmax_backward(const Tensor& grad_out, const Tensor& y, int64_t dim, bool log, DType out,
                        MemoryCategory cat = MemoryCategory::gradients);

// A copy of x in dtype `out` (stochastic rounding etc. via cast), charged to `cat`.
Tensor cast(const Tensor& x, DType out, const CastOptions& opt = {},
            MemoryCategory cat = MemoryCategory::activations);

// Concatenation along dim (all other sizes equal).
Tensor cat(const std::vector<Tensor>& xs, int64_t dim, DType out,
           MemoryCategory cat = MemoryCategory::activations);

// ---- Shared helpers for kernels ----
// n values from src (element stride `stride`, 0 = broadcast one value) into FP32.
void load_f32(const void* src, DType t, int64_t stride, int64_t n, float* dst);
// A row's FP32 values: the row itself when it is contiguous FP32, else staged into buf (n floats).
const float* row_f32(const char* src, DType t, int64_t stride, int64_t n, float* buf);
// n FP32 values into dst (element stride `stride`), rounding to nearest even.
void store_f32(const float* src, int64_t n, void* dst, DType t, int64_t stride);
// Threshold (elements) above which kernels split work across threads.
inline constexpr int64_t kParallelElements = 1 << 15;
// The threads for a kernel over `work` elements (or multiply-adds): default_num_threads() from
// kParallelElements on, one below (splitting small work costs more than it saves).
inline int threads_for(int64_t work) {
  return work >= kParallelElements ? default_num_threads() : 1;
}

}  // namespace mantissa::kernels

// Linear layers and batched matrix products over tensors of any float storage dtype, computing in
// FP32 (or the FP16 partials asked for). Weights are (out, in), as in PyTorch. Raw kernels: they
// record nothing (src/mantissa/ops adds autograd).
#pragma once

#include <cstdint>
#include <span>

#include "mantissa/core/tensor.h"
#include "mantissa/kernels/gemm.h"

namespace mantissa::kernels {

// The rows of a linear layer's input x (*, in): the product of every dimension but the last (also
// when `in` is 0, where numel() / in cannot say).
int64_t linear_rows(const Tensor& x);

// y = x w^T + b, x (*, in), w (out, in), b (out) or undefined. A batch of at most 16 rows through
// a layer at least 1024 deep (FP32 partials) takes lane-split dot products that read w in place
// (vector_kernels.h); everything else takes the GEMM, starting from the bias so that the sum is
// rounded once. round_w f16 or bf16: an FP32 w is read as if stored in that type (each value
// rounded to nearest even as it is staged or packed), so y is exactly that of w's 16-bit copy,
// which is never made.
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b, DType out,
              Partials p = Partials::kF32, DType round_w = DType::f32);
// The weight gradient of linear, dw = g^T x (g: (rows, out), x: (rows, in), float dtypes), given
// to `consume` in parts instead of stored (AutogradMeta::consume_grad_parts): blocks of a few
// outputs by a few thousand inputs, each computed into a buffer that stays in cache and handed
// over row by row (flat offsets o * in + j) in dtype `out`. Every element is matmul's with FP32
// partials and output `out`, bit for bit (an FMA chain over the rows in order, rounded once). For
// a small batch through a wide layer, where the update's pass over the parameter and its state
// costs more than the products.
void linear_weight_grad_parts(const Tensor& g, const Tensor& x, DType out,
                              const GradPartConsumer& consume);
// One term of a weight gradient summed over several batches: the factors g (rows, out) and x
// (rows, in) of g^T x (dist::FactorGradients: one rank's).
struct GradFactors {
  Tensor g, x;
};
// The sum of the terms' weight gradients, sum_k g_k^T x_k, given to `consume` in parts as
// linear_weight_grad_parts gives one gradient: each term's part is its own gradient's values
// (matmul's FMA chain over its rows, rounded into `out`), the terms are added in order in FP32
// and the sum is rounded into `out` once. One term: linear_weight_grad_parts. Every term has the
// same out and in, and rows that linear_weight_grad_parts_fit. Only the gradient's rows (outputs)
// [row_begin, row_end) are formed and given (row_end -1: to the last), each element the same bits
// as in the whole gradient: a ZeRO shard of the weight (dist::Zero1).
void linear_weight_grad_parts_sum(std::span<const GradFactors> terms, DType out,
                                  const GradPartConsumer& consume, int64_t row_begin = 0,
                                  int64_t row_end = -1);
// An upper bound of |v| over every value v that linear_weight_grad_parts(g, x, out, ...) gives:
// the sum over rows r of max_o |g[r][o]| * max_j |x[r][j]| (which bounds each exact dot
// product), widened for the FP32 chain's roundings and the one rounding into `out`; +infinity when
// g or x holds an inf or NaN, or when a value could round past out's largest finite value. It
// reads g and x once (no product): a finite bound proves every value of the gradient finite
// without computing it (the optimizer's inf/NaN check of a deferred gradient).
double linear_weight_grad_bound(const Tensor& g, const Tensor& x, DType out);
// The same for linear_weight_grad_parts_sum: the terms' bounds summed, widened for the FP32 sum
// and its rounding into `out`.
double linear_weight_grad_bound_sum(std::span<const GradFactors> terms, DType out);
// Whether linear's backward gives its weight gradient in parts at this many rows (a batch small
// enough that computing dw costs less than storing and re-reading it).
bool linear_weight_grad_parts_fit(int64_t rows);

// a (..., M, K) @ b (..., K, N) with equal batch dimensions, or b 2-D. round_b: an FP32 b read as
// if stored in f16 or bf16 (GemmOptions::round_b). round_out: an FP32 result holding the values of
// its f16 or bf16 copy (GemmOptions::round_c).
Tensor matmul(const Tensor& a, const Tensor& b, DType out, Partials p = Partials::kF32,
              MemoryCategory cat = MemoryCategory::activations, DType round_b = DType::f32,
              DType round_out = DType::f32);

}  // namespace mantissa::kernels

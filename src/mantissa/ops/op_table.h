// Every op of ops.h, declared once: its name, its automatic-casting category and its kind. Op
// names (in the autocast lists, the log, anomaly reports and autograd nodes), the default
// categories, the type an op writes when nothing else decides, and which ops take partials and
// count multiply-adds all derive from this table; tests and docs/mixed_precision.md enumerate it.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "mantissa/core/dtype.h"

namespace mantissa::ops {

// How automatic casting treats an op:
//   kLowerPrecision: runs in the 16-bit compute type (matrix ops: where 16 bits pay off)
//   kFp32:           runs in FP32 (reductions, exponentials, norms, losses: where range or
//                    precision matter)
//   kPromote:        multi-input ops run in the widest input type
//   kFollowInput:    runs in the type of its first input (cheap elementwise ops, layout ops)
//   kNever:          never cast: the caller names the output type
enum class AutocastCategory : uint8_t { kLowerPrecision, kFp32, kPromote, kFollowInput, kNever };

// What an op computes. It fixes the type the op writes when neither OpOptions::out nor automatic
// casting decides (default_output_type), and what the op context does with it:
//   kMatrix:  sums products (matrix multiplication, convolution): accumulates in
//             OpOptions::partials (default: PartialsScope's), its forward's multiply-adds are
//             counted by MacCounter; writes the widest input type
//   kBinary:  broadcasting arithmetic on two tensors; writes the widest input type
//   kCompute: arithmetic on one floating input (beside weights and statistics, which may be kept
//             in FP32); writes that input's type
//   kMove:    moves values without arithmetic (views, concatenation); writes the widest input
//             type. Exact, so stochastic outputs leave it alone (rounding it would only use up a
//             random stream)
//   kLoss:    a one-element result; writes FP32
//   kConvert: the caller names the output type
enum class OpKind : uint8_t { kMatrix, kBinary, kCompute, kMove, kLoss, kConvert };

// X(name, category, kind). The default categories start from Habana's HMP lists and PyTorch's
// autocast lists (REFERENCE.md, "Op lists for automatic casting"). Where they differ or are silent:
// - relu, dropout: lower precision (Habana); they cost nothing in 16 bits and keep the
//   activations 16-bit between convolutions.
// - batch/group/layer norm: FP32 (PyTorch; Habana lowers them): their statistics need the range,
//   and bf16 group_norm is what breaks PyTorch 1.13's CPU autocast on the tutorial CNN.
// - sum, softmax, log_softmax, the losses: FP32 (both); mean too, though Habana lowers it: it is
//   a sum, whose result needs FP32's precision. div: FP32 (Habana's FP32 list).
// - add, sub, mul, cat: promote (Habana's promote list; PyTorch's CPU list for cat).
// - gelu, sigmoid, tanh, pooling, the scalar ops: in no list of either, so they follow their input.
// - reshape, flatten, transpose: follow their input, and stay views (no copy) when they do; in
//   neither reference's lists, since moving values gains nothing from another type.
// - cast and normalize_input are never cast: their output type is their argument.
#define MANTISSA_OPS(X)                          \
  X(linear, kLowerPrecision, kMatrix)            \
  X(matmul, kLowerPrecision, kMatrix)            \
  X(conv2d, kLowerPrecision, kMatrix)            \
  X(relu, kLowerPrecision, kCompute)             \
  X(dropout, kLowerPrecision, kCompute)          \
  X(gelu, kFollowInput, kCompute)                \
  X(sigmoid, kFollowInput, kCompute)             \
  X(tanh, kFollowInput, kCompute)                \
  X(max_pool2d, kFollowInput, kCompute)          \
  X(avg_pool2d, kFollowInput, kCompute)          \
  X(adaptive_avg_pool2d, kFollowInput, kCompute) \
  X(flatten, kFollowInput, kMove)                \
  X(reshape, kFollowInput, kMove)                \
  X(transpose, kFollowInput, kMove)              \
  X(add_scalar, kFollowInput, kCompute)          \
  X(mul_scalar, kFollowInput, kCompute)          \
  X(add, kPromote, kBinary)                      \
  X(sub, kPromote, kBinary)                      \
  X(mul, kPromote, kBinary)                      \
  X(cat, kPromote, kMove)                        \
  X(div, kFp32, kBinary)                         \
  X(sum, kFp32, kCompute)                        \
  X(mean, kFp32, kCompute)                       \
  X(softmax, kFp32, kCompute)                    \
  X(log_softmax, kFp32, kCompute)                \
  X(batch_norm, kFp32, kCompute)                 \
  X(group_norm, kFp32, kCompute)                 \
  X(layer_norm, kFp32, kCompute)                 \
  X(nll_loss, kFp32, kLoss)                      \
  X(cross_entropy, kFp32, kLoss)                 \
  X(cast, kNever, kConvert)                      \
  X(normalize_input, kNever, kConvert)

enum class OpId : uint16_t {
#define MANTISSA_X(name, category, kind) name,
  MANTISSA_OPS(MANTISSA_X)
#undef MANTISSA_X
};

inline constexpr int kNumOps = 0
#define MANTISSA_X(name, category, kind) +1
    MANTISSA_OPS(MANTISSA_X)
#undef MANTISSA_X
    ;
// Written out so that adding or removing an op is a decision, not a side effect.
static_assert(kNumOps == 32,
              "an op was added or removed: give it a case in tests/ops/test_op_table.cc, put it in "
              "docs/mixed_precision.md's op tables, then update this number");

struct OpInfo {
  std::string_view name;  // a string literal: data() is null-terminated
  AutocastCategory category;
  OpKind kind;
};

inline constexpr OpInfo kOpInfo[] = {
#define MANTISSA_X(name, category, kind) {#name, AutocastCategory::category, OpKind::kind},
    MANTISSA_OPS(MANTISSA_X)
#undef MANTISSA_X
};
static_assert(sizeof(kOpInfo) / sizeof(kOpInfo[0]) == kNumOps);

constexpr const OpInfo& op_info(OpId id) { return kOpInfo[static_cast<int>(id)]; }
std::optional<OpId> op_from_name(std::string_view name);
std::string_view autocast_category_name(AutocastCategory c);
std::string_view op_kind_name(OpKind k);

// The type an op of kind `k` writes when neither OpOptions::out nor automatic casting decides,
// given the type of its first floating input and the widest of them (kConvert: none).
constexpr std::optional<DType> default_output_type(OpKind k, DType first, DType widest) {
  switch (k) {
    case OpKind::kMatrix:
    case OpKind::kBinary:
    case OpKind::kMove:
      return widest;
    case OpKind::kCompute:
      return first;
    case OpKind::kLoss:
      return DType::f32;
    case OpKind::kConvert:
      return std::nullopt;
  }
  return std::nullopt;
}

}  // namespace mantissa::ops

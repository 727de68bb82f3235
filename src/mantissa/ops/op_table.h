// Every differentiable op, declared once: its name and its automatic-casting category. The mixed-
// precision layer reads the categories; tests and docs enumerate the table.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace mantissa::ops {

// How automatic casting treats an op (the mixed-precision issue uses this table):
//   kLowerPrecision: runs in the 16-bit compute type (matrix ops: where 16 bits pay off)
//   kFp32:           runs in FP32 (reductions, exponentials, norms, losses: where range or
//                    precision matter)
//   kPromote:        multi-input ops run in the widest input type
//   kFollowInput:    runs in the type of its first input (cheap elementwise ops, layout ops)
//   kNever:          never cast (the cast op itself)
enum class AutocastCategory : uint8_t { kLowerPrecision, kFp32, kPromote, kFollowInput, kNever };

// X(name, category). Defaults start from Habana's HMP lists and PyTorch's autocast lists
// (REFERENCE.md), adapted: PyTorch keeps group_norm/layer_norm/softmax/losses in FP32 (bf16
// group_norm is what breaks PyTorch 1.13's CPU autocast on the tutorial CNN); Habana lowers
// relu and dropout, which cost nothing to run in 16 bits.
#define MANTISSA_OPS(X)                \
  X(linear, kLowerPrecision)           \
  X(matmul, kLowerPrecision)           \
  X(conv2d, kLowerPrecision)           \
  X(relu, kLowerPrecision)             \
  X(dropout, kLowerPrecision)          \
  X(gelu, kFollowInput)                \
  X(sigmoid, kFollowInput)             \
  X(tanh, kFollowInput)                \
  X(max_pool2d, kFollowInput)          \
  X(avg_pool2d, kFollowInput)          \
  X(adaptive_avg_pool2d, kFollowInput) \
  X(flatten, kFollowInput)             \
  X(reshape, kFollowInput)             \
  X(transpose, kFollowInput)           \
  X(add_scalar, kFollowInput)          \
  X(mul_scalar, kFollowInput)          \
  X(add, kPromote)                     \
  X(sub, kPromote)                     \
  X(mul, kPromote)                     \
  X(cat, kPromote)                     \
  X(div, kFp32)                        \
  X(sum, kFp32)                        \
  X(mean, kFp32)                       \
  X(softmax, kFp32)                    \
  X(log_softmax, kFp32)                \
  X(batch_norm, kFp32)                 \
  X(group_norm, kFp32)                 \
  X(layer_norm, kFp32)                 \
  X(nll_loss, kFp32)                   \
  X(cross_entropy, kFp32)              \
  X(cast, kNever)

enum class OpId : uint16_t {
#define MANTISSA_X(name, cat) name,
  MANTISSA_OPS(MANTISSA_X)
#undef MANTISSA_X
};

inline constexpr int kNumOps = 0
#define MANTISSA_X(name, cat) +1
    MANTISSA_OPS(MANTISSA_X)
#undef MANTISSA_X
    ;

struct OpInfo {
  std::string_view name;
  AutocastCategory category;
};

inline constexpr OpInfo kOpInfo[] = {
#define MANTISSA_X(name, cat) {#name, AutocastCategory::cat},
    MANTISSA_OPS(MANTISSA_X)
#undef MANTISSA_X
};
static_assert(sizeof(kOpInfo) / sizeof(kOpInfo[0]) == kNumOps);

constexpr const OpInfo& op_info(OpId id) { return kOpInfo[static_cast<int>(id)]; }
std::optional<OpId> op_from_name(std::string_view name);
std::string_view autocast_category_name(AutocastCategory c);

}  // namespace mantissa::ops

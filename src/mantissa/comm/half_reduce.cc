#include "mantissa/comm/half_reduce.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include "mantissa/core/error.h"

namespace mantissa::comm {

namespace {

// Values per pass: both FP32 staging arrays stay in L1.
constexpr size_t kChunk = 512;
// The canonical quiet NaN; it narrows to f16 0x7e00 and bf16 0x7fc0.
const float kNaN = std::bit_cast<float>(uint32_t{0x7fc00000});

// b[i] = op(a[i], b[i]) in FP32, commutative bit for bit (see the header).
void combine(ReduceOp op, const float* a, float* b, size_t n) {
  switch (op) {
    case ReduceOp::kSum:
      for (size_t i = 0; i < n; ++i) {
        const float r = a[i] + b[i];
        b[i] = r != r ? kNaN : r;  // the sum of two NaNs keeps one payload: which depends on order
      }
      return;
    case ReduceOp::kMax:
    case ReduceOp::kMin:
      for (size_t i = 0; i < n; ++i) {
        const float x = a[i], y = b[i];
        if (x != x || y != y) {
          b[i] = kNaN;
        } else if (x != y) {
          b[i] = (x > y) == (op == ReduceOp::kMax) ? x : y;
        } else {
          // Equal values differ in bits only as +0 and -0: max keeps +0, min keeps -0.
          const uint32_t bx = std::bit_cast<uint32_t>(x), by = std::bit_cast<uint32_t>(y);
          b[i] = std::bit_cast<float>(op == ReduceOp::kMax ? bx & by : bx | by);
        }
      }
      return;
  }
  MANTISSA_ASSERT(false, "unknown reduction");
}

}  // namespace

void reduce_16bit(ReduceOp op, DType dtype, const void* in, void* inout, size_t n, SimdPath path) {
  MANTISSA_ASSERT(dtype == DType::f16 || dtype == DType::bf16,
                  "reduce_16bit on a type that is not a 16-bit float");
  const auto* src = static_cast<const uint16_t*>(in);
  auto* dst = static_cast<uint16_t*>(inout);
  alignas(64) float a[kChunk], b[kChunk];
  for (size_t off = 0; off < n; off += kChunk) {
    const size_t m = std::min(kChunk, n - off);
    convert(src + off, dtype, a, DType::f32, m, {}, path);
    convert(dst + off, dtype, b, DType::f32, m, {}, path);
    combine(op, a, b, m);
    convert(b, DType::f32, dst + off, dtype, m, {}, path);
  }
}

void reduce_16bit(ReduceOp op, DType dtype, const void* in, void* inout, size_t n) {
  reduce_16bit(op, dtype, in, inout, n, active_simd_path());
}

}  // namespace mantissa::comm

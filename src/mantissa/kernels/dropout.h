// Dropout over tensors of any float storage dtype, its mask a function of (seed, stream, element
// index): the backward pass recomputes it instead of storing it. Raw kernel: it records nothing
// (src/mantissa/ops adds autograd).
#pragma once

#include <cstdint>

#include "mantissa/core/tensor.h"

namespace mantissa::kernels {

// Keeps each element with probability 1 - p (scaled by 1 / (1 - p)). Element i is dropped when
// the Philox draw of (seed, stream, i) falls below p * 2^32.
Tensor dropout(const Tensor& x, double p, uint64_t seed, uint64_t stream, DType out,
               MemoryCategory cat = MemoryCategory::activations);

}  // namespace mantissa::kernels

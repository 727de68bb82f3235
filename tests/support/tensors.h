// Tensors of drawn values for tests.
#pragma once

#include <vector>

#include "mantissa/core/tensor.h"

namespace mantissa::testing {

// An FP32 tensor of `shape` whose elements, in row-major order, are successive values of draw():
// a test's own distribution and generator, e.g. tensor_of({4, 3}, [&] { return normal(gen); }).
template <class Draw>
Tensor tensor_of(const Shape& shape, Draw&& draw) {
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  for (float& e : v) e = static_cast<float>(draw());
  return Tensor::from_floats(v, shape);
}

}  // namespace mantissa::testing

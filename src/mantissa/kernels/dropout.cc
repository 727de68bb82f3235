// Dropout (dropout.h): Philox-keyed masks, so any split of the tensor over threads draws the same
// mask, and the backward pass can draw it again. Its own file: it shares nothing with the losses.
#include "mantissa/kernels/dropout.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "mantissa/core/parallel.h"
#include "mantissa/core/philox.h"
#include "mantissa/kernels/nn_internal.h"

namespace mantissa::kernels {

Tensor dropout(const Tensor& x_in, double p, uint64_t seed, uint64_t stream, DType out,
               MemoryCategory cat) {
  require_float(x_in, "dropout", "input");
  MANTISSA_CHECK(p >= 0.0 && p < 1.0,
                 "dropout: probability " + std::to_string(p) + " is outside [0, 1)",
                 "use a probability in [0, 1)");
  const Tensor x = x_in.contiguous();
  Tensor y = Tensor::empty(x.shape(), out, charged_to(cat));
  const int64_t n = x.numel();
  // Drop when the 32 random bits fall below p * 2^32.
  const uint64_t threshold = static_cast<uint64_t>(std::ldexp(p, 32));
  const float scale = static_cast<float>(1.0 / (1.0 - p));
  parallel_for(static_cast<size_t>(n), 4096, threads_for(n), [&](size_t b, size_t e) {
    float buf[1024];
    for (size_t c = b; c < e; c += 1024) {
      const int64_t m = static_cast<int64_t>(std::min<size_t>(1024, e - c));
      load_f32(bytes(x) + static_cast<int64_t>(c) * esize(x.dtype()), x.dtype(), 1, m, buf);
      for (int64_t i = 0; i < m; ++i)
        buf[i] = philox_bits(seed, stream, c + static_cast<uint64_t>(i)) < threshold
                     ? 0.0f
                     : buf[i] * scale;
      store_f32(buf, m, bytes(y) + static_cast<int64_t>(c) * esize(out), out, 1);
    }
  });
  return y;
}

}  // namespace mantissa::kernels

// The README's C++ example, built and run as a test so that it stays true.
#include <cstdio>

#include "mantissa/mantissa.h"

int main() {
  using namespace mantissa;

  f16 h(0.1f);     // 2-byte value type, round to nearest even
  float back = h;  // exact
  std::printf("0.1 as f16: %.9g (bits 0x%04x)\n", static_cast<double>(back), h.bits);

  Tensor w = Tensor::from_floats({1.0f, 0.1f, -3.5f}, {3});
  CastOptions sr{.rounding = Rounding::kStochastic, .seed = 42};
  Tensor w16 = w.to(DType::bf16, sr);  // reproducible for the seed, whatever the thread count
  std::printf("stochastic bf16: %s\n", w16.str().c_str());

  MemoryTracker& mem = default_memory_tracker();
  mem.set_budget(512ull << 20);  // allocations past 512 MiB throw OutOfMemoryError with a report
  try {
    Tensor too_big = Tensor::empty({1024, 1024, 1024}, DType::f32);
  } catch (const OutOfMemoryError& e) {
    std::printf("%s\n", e.what());
  }
  std::printf("%s", mem.report().c_str());

  // Differentiable ops and reverse-mode gradients, stored in each tensor's dtype.
  Tensor w2 = Tensor::from_floats({0.5f, 0.25f}, {1, 2}, DType::bf16).set_requires_grad();
  Tensor x = Tensor::from_floats({1.0f, 2.0f}, {1, 2});
  Tensor loss = ops::sum(ops::relu(ops::linear(x, w2)));
  autograd::backward(loss);  // w2.grad(): bf16, like w2
  std::printf("loss %g, gradient %s\n", loss.item(), w2.grad().str().c_str());
  return 0;
}

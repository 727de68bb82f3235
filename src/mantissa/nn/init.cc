#include "mantissa/nn/init.h"

#include <cmath>
#include <numbers>
#include <vector>

#include "mantissa/core/error.h"
#include "mantissa/core/philox.h"

namespace mantissa::nn::init {
namespace {

// A uniform double in (0, 1) from two 32-bit words (53 bits, never 0 or 1).
double unit(uint32_t hi, uint32_t lo) {
  const uint64_t bits = (static_cast<uint64_t>(hi) << 21) ^ (lo >> 11);
  return (static_cast<double>(bits & ((uint64_t{1} << 53) - 1)) + 0.5) * 0x1p-53;
}

void store(Tensor& t, const std::vector<float>& v) {
  MANTISSA_CHECK(t.is_contiguous(), "initialisation needs a contiguous tensor", "");
  Tensor src = Tensor::from_floats(v, t.shape(), DType::f32);
  t.copy_from(src);
}

}  // namespace

void uniform_(Tensor& t, double low, double high, uint64_t seed, uint64_t stream) {
  const int64_t n = t.numel();
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; i += 2) {
    const PhiloxCounter r = philox_block(seed, stream, static_cast<uint64_t>(i / 2));
    v[static_cast<size_t>(i)] = static_cast<float>(low + (high - low) * unit(r[0], r[1]));
    if (i + 1 < n)
      v[static_cast<size_t>(i + 1)] = static_cast<float>(low + (high - low) * unit(r[2], r[3]));
  }
  store(t, v);
}

void normal_(Tensor& t, double mean, double std, uint64_t seed, uint64_t stream) {
  const int64_t n = t.numel();
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; i += 2) {
    const PhiloxCounter r = philox_block(seed, stream, static_cast<uint64_t>(i / 2));
    const double u1 = unit(r[0], r[1]), u2 = unit(r[2], r[3]);
    const double radius = std::sqrt(-2.0 * std::log(u1));
    const double angle = 2.0 * std::numbers::pi * u2;
    v[static_cast<size_t>(i)] = static_cast<float>(mean + std * radius * std::cos(angle));
    if (i + 1 < n)
      v[static_cast<size_t>(i + 1)] = static_cast<float>(mean + std * radius * std::sin(angle));
  }
  store(t, v);
}

int64_t fan_in(const Tensor& w) {
  MANTISSA_CHECK(w.dim() >= 2,
                 "fan_in needs a weight of 2 or more dimensions, got " + shape_str(w.shape()), "");
  return w.numel() / w.size(0);
}

int64_t fan_out(const Tensor& w) {
  MANTISSA_CHECK(w.dim() >= 2,
                 "fan_out needs a weight of 2 or more dimensions, got " + shape_str(w.shape()), "");
  return w.numel() / w.size(1);
}

void default_weight_(Tensor& weight, uint64_t seed, uint64_t stream) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in(weight)));
  uniform_(weight, -bound, bound, seed, stream);
}

void default_bias_(Tensor& bias, int64_t fan_in_count, uint64_t seed, uint64_t stream) {
  const double bound = fan_in_count > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in_count)) : 0;
  uniform_(bias, -bound, bound, seed, stream);
}

void kaiming_normal_fan_out_(Tensor& weight, uint64_t seed, uint64_t stream) {
  normal_(weight, 0.0, std::sqrt(2.0 / static_cast<double>(fan_out(weight))), seed, stream);
}

}  // namespace mantissa::nn::init

// Integer arithmetic that reports overflow instead of wrapping, and float-to-integer conversion
// that reports values out of range instead of being undefined. Every size that comes from a file
// or a user (shapes, element and byte counts, offsets) is computed with these, so a corrupt
// header becomes a clear error instead of a wrapped size and a small allocation read past.
#pragma once

#include <cmath>
#include <concepts>
#include <limits>
#include <optional>

namespace mantissa {

// a * b, or std::nullopt if the product does not fit in T.
template <std::integral T>
[[nodiscard]] constexpr std::optional<T> checked_mul(T a, T b) {
  T r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// a + b, or std::nullopt if the sum does not fit in T.
template <std::integral T>
[[nodiscard]] constexpr std::optional<T> checked_add(T a, T b) {
  T r;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// v converted to T (truncated toward zero), or std::nullopt if v is NaN or its truncation is
// outside T's range (where a plain cast is undefined behaviour).
template <std::integral T>
[[nodiscard]] std::optional<T> checked_cast_from_double(double v) {
  if (std::isnan(v)) return std::nullopt;
  const double t = std::trunc(v);
  // Both bounds are powers of two (or zero), exact in a double: min is -2^k or 0, max + 1 is 2^k.
  constexpr double lo = static_cast<double>(std::numeric_limits<T>::min());
  constexpr double hi_excl = static_cast<double>(std::numeric_limits<T>::max() / 2 + 1) * 2.0;
  if (t < lo || t >= hi_excl) return std::nullopt;
  return static_cast<T>(t);
}

}  // namespace mantissa

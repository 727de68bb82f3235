// Integers read from JSON that came from a file. nlohmann's get<integer type>() converts whatever
// number it finds with a cast: a floating-point value out of the type's range (2e27 for an
// int64_t) is undefined behaviour, and a negative or oversized integer silently wraps. Fields of
// checkpoints and their JSON metadata are read through json_integer instead, which accepts only an
// integer in [lo, hi].
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>

namespace mantissa::io {

// `v` as an integer when it is one (not a float, string or other type) within [lo, hi].
inline std::optional<int64_t> json_integer(const nlohmann::json& v, int64_t lo, int64_t hi) {
  int64_t x = 0;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX)) return std::nullopt;
    x = static_cast<int64_t>(u);
  } else if (v.is_number_integer()) {
    x = v.get<int64_t>();
  } else {
    return std::nullopt;
  }
  if (x < lo || x > hi) return std::nullopt;
  return x;
}

}  // namespace mantissa::io

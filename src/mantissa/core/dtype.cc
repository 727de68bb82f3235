#include "mantissa/core/dtype.h"

#include <algorithm>
#include <cctype>
#include <limits>

#include "mantissa/core/error.h"

namespace mantissa {

double max_finite(DType t) {
  switch (t) {
    case DType::f32:
      return std::numeric_limits<float>::max();
    case DType::f16:
      return decode<kF16Format>(kF16Format.max_finite_bits());
    case DType::bf16:
      return decode<kBF16Format>(kBF16Format.max_finite_bits());
    default:
      return 0;
  }
}

const FloatFormat* float_format(DType t) {
  switch (t) {
    case DType::f16:
      return &kF16Format;
    case DType::bf16:
      return &kBF16Format;
    case DType::e4m3:
      return &kE4M3Format;
    case DType::e5m2:
      return &kE5M2Format;
    default:
      return nullptr;
  }
}

std::optional<DType> parse_dtype(std::string_view name) {
  std::string s(name);
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (DType t : kAllDTypes)
    if (s == dtype_name(t)) return t;
  struct Alias {
    const char* name;
    DType type;
  };
  static constexpr Alias kAliases[] = {
      {"float32", DType::f32},      {"fp32", DType::f32},           {"float", DType::f32},
      {"float64", DType::f64},      {"fp64", DType::f64},           {"double", DType::f64},
      {"float16", DType::f16},      {"fp16", DType::f16},           {"half", DType::f16},
      {"bfloat16", DType::bf16},    {"float8_e4m3fn", DType::e4m3}, {"fp8_e4m3", DType::e4m3},
      {"float8_e5m2", DType::e5m2}, {"fp8_e5m2", DType::e5m2},      {"int32", DType::i32},
      {"int64", DType::i64},        {"uint8", DType::u8},           {"b8", DType::boolean},
  };
  for (const Alias& a : kAliases)
    if (s == a.name) return a.type;
  return std::nullopt;
}

std::string dtype_names() {
  std::string out;
  for (DType t : kAllDTypes) {
    if (!out.empty()) out += ", ";
    out += dtype_name(t);
  }
  return out;
}

DType dtype_from_name(std::string_view name) {
  if (auto t = parse_dtype(name)) return *t;
  throw Error(
      "unknown dtype '" + std::string(name) + "'",
      "use one of: " + dtype_names() + " (aliases such as fp16, bfloat16, float32 work too)");
}

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  // Rank by the set of values each type holds; integers and bool rank below every float.
  auto rank = [](DType t) {
    switch (t) {
      case DType::f64:
        return 7;
      case DType::f32:
        return 6;
      case DType::f16:
      case DType::bf16:
        return 5;
      case DType::e4m3:
      case DType::e5m2:
        return 4;
      case DType::i64:
        return 3;
      case DType::i32:
        return 2;
      case DType::u8:
        return 1;
      case DType::boolean:
        return 0;
    }
    return 0;
  };
  const int ra = rank(a), rb = rank(b);
  if (ra != rb) return ra > rb ? a : b;
  // Same rank, different types: f16 with bf16 (neither holds the other) meet in f32; e4m3 with
  // e5m2 in f16, which holds both exactly.
  return ra == 5 ? DType::f32 : DType::f16;
}

}  // namespace mantissa

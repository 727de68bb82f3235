// The one list of data types. Names, sizes, C++ storage types and properties all derive from
// MANTISSA_DTYPES; the numeric ids are stable (they are written into files) and never reused.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "mantissa/core/float_formats.h"

namespace mantissa {

enum class DTypeKind : uint8_t { kFloat, kInt, kBool };

// X(enumerator, stable id, bytes, C++ storage type, kind, canonical name)
#define MANTISSA_DTYPES(X)                        \
  X(f32, 0, 4, float, kFloat, "f32")              \
  X(f64, 1, 8, double, kFloat, "f64")             \
  X(f16, 2, 2, ::mantissa::f16, kFloat, "f16")    \
  X(bf16, 3, 2, ::mantissa::bf16, kFloat, "bf16") \
  X(e4m3, 4, 1, ::mantissa::e4m3, kFloat, "e4m3") \
  X(e5m2, 5, 1, ::mantissa::e5m2, kFloat, "e5m2") \
  X(i32, 6, 4, int32_t, kInt, "i32")              \
  X(i64, 7, 8, int64_t, kInt, "i64")              \
  X(u8, 8, 1, uint8_t, kInt, "u8")                \
  X(boolean, 9, 1, bool, kBool, "bool")

enum class DType : uint8_t {
#define MANTISSA_X(e, id, bytes, type, kind, name) e = id,
  MANTISSA_DTYPES(MANTISSA_X)
#undef MANTISSA_X
};

inline constexpr int kNumDTypes = 0
#define MANTISSA_X(e, id, bytes, type, kind, name) +1
    MANTISSA_DTYPES(MANTISSA_X)
#undef MANTISSA_X
    ;
static_assert(kNumDTypes == 10, "update the dtype tests and docs when the list changes");

// Every dtype, in id order (ids are dense from 0).
inline constexpr DType kAllDTypes[] = {
#define MANTISSA_X(e, id, bytes, type, kind, name) DType::e,
    MANTISSA_DTYPES(MANTISSA_X)
#undef MANTISSA_X
};

constexpr size_t dtype_size(DType t) {
  switch (t) {
#define MANTISSA_X(e, id, bytes, type, kind, name) \
  case DType::e:                                   \
    static_assert(sizeof(type) == bytes);          \
    return bytes;
    MANTISSA_DTYPES(MANTISSA_X)
#undef MANTISSA_X
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
#define MANTISSA_X(e, id, bytes, type, kind, name) \
  case DType::e:                                   \
    return name;
    MANTISSA_DTYPES(MANTISSA_X)
#undef MANTISSA_X
  }
  return "?";
}

constexpr DTypeKind dtype_kind(DType t) {
  switch (t) {
#define MANTISSA_X(e, id, bytes, type, kind, name) \
  case DType::e:                                   \
    return DTypeKind::kind;
    MANTISSA_DTYPES(MANTISSA_X)
#undef MANTISSA_X
  }
  return DTypeKind::kBool;
}

constexpr bool is_floating(DType t) { return dtype_kind(t) == DTypeKind::kFloat; }
// The types kernels compute and store activations in: f32, f16, bf16 (8-bit floats are storage).
constexpr bool is_compute_float(DType t) {
  return t == DType::f32 || t == DType::f16 || t == DType::bf16;
}
constexpr bool is_16bit_float(DType t) { return t == DType::f16 || t == DType::bf16; }
// The 16- and 8-bit floating-point storage formats (the ones with a FloatFormat).
constexpr bool is_narrow_float(DType t) {
  return t == DType::f16 || t == DType::bf16 || t == DType::e4m3 || t == DType::e5m2;
}
// Parameters of a narrow float format; nullptr for the other dtypes.
const FloatFormat* float_format(DType t);
// The largest finite value of a compute float (f32 3.4e38, f16 65504, bf16 3.39e38); 0 for the
// other dtypes.
double max_finite(DType t);

// The canonical name or a common alias ("float32", "fp16", "half", "bfloat16", "fp8_e4m3",
// "int64", ...), case-insensitive. std::nullopt when unknown.
std::optional<DType> parse_dtype(std::string_view name);
// Like parse_dtype, but an unknown name throws mantissa::Error listing the valid names.
DType dtype_from_name(std::string_view name);
// "f32, f64, f16, ..." for messages.
std::string dtype_names();

// The type an op that promotes to the widest input computes in: f64 > f32 > 16-bit floats >
// 8-bit floats > i64 > i32 > u8 > bool. f16 with bf16 (neither holds the other) gives f32; e4m3
// with e5m2 gives f16, which holds both exactly.
DType promote_types(DType a, DType b);

// Compile-time map from a C++ storage type to its dtype.
template <typename T>
struct DTypeOf;
#define MANTISSA_X(e, id, bytes, type, kind, name) \
  template <>                                      \
  struct DTypeOf<type> {                           \
    static constexpr DType value = DType::e;       \
  };
MANTISSA_DTYPES(MANTISSA_X)
#undef MANTISSA_X
template <typename T>
inline constexpr DType dtype_of = DTypeOf<T>::value;

}  // namespace mantissa

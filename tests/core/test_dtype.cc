#include <gtest/gtest.h>

#include "mantissa/mantissa.h"

namespace mantissa {
namespace {

TEST(DType, NamesSizesAndIdsComeFromOneList) {
  EXPECT_EQ(kNumDTypes, 10);
  EXPECT_EQ(dtype_size(DType::f32), 4u);
  EXPECT_EQ(dtype_size(DType::f16), 2u);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::e4m3), 1u);
  EXPECT_EQ(dtype_size(DType::i64), 8u);
  EXPECT_EQ(dtype_size(DType::boolean), 1u);
  // Stable ids: written into files, never renumbered.
  EXPECT_EQ(static_cast<int>(DType::f32), 0);
  EXPECT_EQ(static_cast<int>(DType::bf16), 3);
  EXPECT_EQ(static_cast<int>(DType::boolean), 9);
  for (int i = 0; i < kNumDTypes; ++i) {
    EXPECT_EQ(static_cast<int>(kAllDTypes[i]), i);
    EXPECT_EQ(parse_dtype(dtype_name(kAllDTypes[i])), kAllDTypes[i]);
  }
  EXPECT_EQ(dtype_of<float>, DType::f32);
  EXPECT_EQ(dtype_of<bf16>, DType::bf16);
  EXPECT_EQ(dtype_of<int64_t>, DType::i64);
}

TEST(DType, Properties) {
  EXPECT_TRUE(is_floating(DType::e5m2));
  EXPECT_FALSE(is_floating(DType::i32));
  EXPECT_TRUE(is_narrow_float(DType::bf16));
  EXPECT_FALSE(is_narrow_float(DType::f32));
  EXPECT_EQ(float_format(DType::f16)->man_bits, 10);
  EXPECT_EQ(float_format(DType::f32), nullptr);
}

TEST(DType, ParsesAliasesAndRejectsUnknownNames) {
  EXPECT_EQ(parse_dtype("FP16"), DType::f16);
  EXPECT_EQ(parse_dtype("half"), DType::f16);
  EXPECT_EQ(parse_dtype("bfloat16"), DType::bf16);
  EXPECT_EQ(parse_dtype("float32"), DType::f32);
  EXPECT_EQ(parse_dtype("float8_e4m3fn"), DType::e4m3);
  EXPECT_EQ(parse_dtype("bool"), DType::boolean);
  EXPECT_EQ(parse_dtype("f8"), std::nullopt);
  try {
    dtype_from_name("f8");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown dtype 'f8'"), std::string::npos);
    EXPECT_NE(e.hint().find("bf16"), std::string::npos);
  }
}

TEST(DType, PromotesToTheWidest) {
  EXPECT_EQ(promote_types(DType::f16, DType::f32), DType::f32);
  EXPECT_EQ(promote_types(DType::f16, DType::bf16), DType::f32);
  EXPECT_EQ(promote_types(DType::bf16, DType::bf16), DType::bf16);
  EXPECT_EQ(promote_types(DType::e4m3, DType::e5m2), DType::f16);
  EXPECT_EQ(promote_types(DType::e4m3, DType::bf16), DType::bf16);
  EXPECT_EQ(promote_types(DType::i64, DType::f16), DType::f16);
  EXPECT_EQ(promote_types(DType::f64, DType::f32), DType::f64);
  EXPECT_EQ(promote_types(DType::u8, DType::boolean), DType::u8);
  for (DType a : kAllDTypes)
    for (DType b : kAllDTypes) EXPECT_EQ(promote_types(a, b), promote_types(b, a));
}

}  // namespace
}  // namespace mantissa

// Checked arithmetic: overflow and out-of-range conversions are reported, never wrapped.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "mantissa/core/checked.h"

namespace mantissa {
namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
constexpr int64_t kMin = std::numeric_limits<int64_t>::min();

TEST(Checked, MultiplicationReportsOverflow) {
  EXPECT_EQ(checked_mul<int64_t>(3, 4), 12);
  EXPECT_EQ(checked_mul<int64_t>(kMax, 1), kMax);
  EXPECT_EQ(checked_mul<int64_t>(kMax, 0), 0);
  EXPECT_EQ(checked_mul<int64_t>(int64_t{1} << 31, int64_t{1} << 31), int64_t{1} << 62);
  EXPECT_EQ(checked_mul<int64_t>(int64_t{1} << 32, int64_t{1} << 31), std::nullopt);
  EXPECT_EQ(checked_mul<int64_t>(kMin, -1), std::nullopt);
  EXPECT_EQ(checked_mul<uint64_t>(uint64_t{1} << 63, 2), std::nullopt);
  EXPECT_EQ(checked_mul<uint64_t>(uint64_t{1} << 63, 1), uint64_t{1} << 63);
  EXPECT_EQ(checked_mul<uint32_t>(65536, 65536), std::nullopt);
}

TEST(Checked, AdditionReportsOverflow) {
  EXPECT_EQ(checked_add<int64_t>(kMax - 1, 1), kMax);
  EXPECT_EQ(checked_add<int64_t>(kMax, 1), std::nullopt);
  EXPECT_EQ(checked_add<int64_t>(kMin, -1), std::nullopt);
  EXPECT_EQ(checked_add<uint64_t>(~uint64_t{0}, 1), std::nullopt);
  EXPECT_EQ(checked_add<uint64_t>(~uint64_t{0} - 1, 1), ~uint64_t{0});
}

TEST(Checked, DoubleToIntegerReportsValuesOutOfRange) {
  EXPECT_EQ(checked_cast_from_double<int64_t>(2.9), 2);
  EXPECT_EQ(checked_cast_from_double<int64_t>(-2.9), -2);
  EXPECT_EQ(checked_cast_from_double<int64_t>(0x1p62), int64_t{1} << 62);
  EXPECT_EQ(checked_cast_from_double<int64_t>(-0x1p63), kMin);
  EXPECT_EQ(checked_cast_from_double<int64_t>(0x1p63), std::nullopt);  // kMax + 1
  EXPECT_EQ(checked_cast_from_double<int64_t>(-0x1p63 - 2048), std::nullopt);
  EXPECT_EQ(checked_cast_from_double<uint64_t>(0x1p64 - 2048), ~uint64_t{0} - 2047);
  EXPECT_EQ(checked_cast_from_double<uint64_t>(0x1p64), std::nullopt);
  EXPECT_EQ(checked_cast_from_double<uint64_t>(-0.5), 0u);  // truncates to zero
  EXPECT_EQ(checked_cast_from_double<uint64_t>(-1.0), std::nullopt);
  EXPECT_EQ(checked_cast_from_double<uint8_t>(255.9), 255);
  EXPECT_EQ(checked_cast_from_double<uint8_t>(256.0), std::nullopt);
  EXPECT_EQ(checked_cast_from_double<int32_t>(std::nan("")), std::nullopt);
  EXPECT_EQ(checked_cast_from_double<int32_t>(INFINITY), std::nullopt);
  EXPECT_EQ(checked_cast_from_double<int32_t>(-INFINITY), std::nullopt);
}

}  // namespace
}  // namespace mantissa

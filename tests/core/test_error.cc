// Errors: user-input checks throw mantissa::Error with a hint; internal invariants throw
// mantissa::InternalError, which is not an Error, naming the place and the condition.
#include <gtest/gtest.h>

#include <string>

#include "mantissa/core/error.h"

namespace mantissa {
namespace {

TEST(Error, CheckThrowsErrorWithHint) {
  try {
    MANTISSA_CHECK(1 + 1 == 3, "two is not three", "count again");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "two is not three");
    EXPECT_EQ(e.hint(), "count again");
    EXPECT_NE(std::string(e.what()).find("---> HINT: count again"), std::string::npos);
  }
  EXPECT_NO_THROW(MANTISSA_CHECK(true, "never", ""));
}

TEST(Error, AssertThrowsInternalErrorNamingThePlace) {
  const int rows = 3;
  try {
    MANTISSA_ASSERT(rows == 4, "rows must be 4 here");
    FAIL() << "no throw";
  } catch (const Error&) {
    FAIL() << "an internal invariant must not look like bad input";
  } catch (const InternalError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("test_error.cc:"), std::string::npos) << what;
    EXPECT_NE(what.find("rows must be 4 here"), std::string::npos) << what;
    EXPECT_NE(what.find("rows == 4"), std::string::npos) << what;
  }
  EXPECT_NO_THROW(MANTISSA_ASSERT(rows == 3, "never"));
}

TEST(Error, ExcerptsCutAndEscapeWhatAMessageQuotes) {
  EXPECT_EQ(excerpt("conv2d"), "conv2d");
  EXPECT_EQ(excerpt(""), "");
  EXPECT_EQ(excerpt(std::string(64, 'a')), std::string(64, 'a'));
  EXPECT_EQ(excerpt(std::string(65, 'a')), std::string(64, 'a') + "... (65 bytes)");
  EXPECT_EQ(excerpt(std::string(1000000, 'b'), 8), "bbbbbbbb... (1000000 bytes)");
  EXPECT_EQ(excerpt(std::string("a\x1b[2J\n\0\xff", 8)), "a\\x1b[2J\\x0a\\x00\\xff");
}

}  // namespace
}  // namespace mantissa

// Comparing computed values with expected ones, failing loudly.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

namespace mantissa::testing {

// Checks every element against tol = rtol * max(|want|, scale_floor * max|want|) + abs_floor and
// fails naming `what`, the worst element's index and both values. A NaN on one side only is
// infinitely wrong.
inline void expect_close(const std::string& what, const std::vector<double>& got,
                         const std::vector<double>& want, double rtol, double scale_floor,
                         double abs_floor, const char* got_name = "got",
                         const char* want_name = "expected") {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = rtol * std::max(std::fabs(want[i]), scale_floor * scale) + abs_floor;
    const double excess =
        std::isnan(got[i]) != std::isnan(want[i]) ? INFINITY : std::fabs(got[i] - want[i]) / tol;
    if (excess > worst) worst = excess, at = i;
  }
  EXPECT_LE(worst, 1.0) << what << ": worst element at index " << at << ": " << got_name << " "
                        << got[at] << ", " << want_name << " " << want[at]
                        << " (relative tolerance " << rtol << ")";
}

}  // namespace mantissa::testing

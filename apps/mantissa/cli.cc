#include "mantissa/cli.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "mantissa/core/error.h"

namespace mantissa::cli {

std::string format_float(float v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(v));
  return buf;
}

bool parse_float(const std::string& text, float& out) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text.front()))) return false;
  errno = 0;
  char* end = nullptr;
  // strtof rounds correctly from the decimal string (no double rounding through double).
  const float v = std::strtof(text.c_str(), &end);
  if (end != text.c_str() + text.size()) return false;
  // ERANGE on underflow still gives the correctly rounded (subnormal or zero) value; on overflow
  // it gives inf, which is what the decimal rounds to.
  out = v;
  return true;
}

bool parse_u64(const std::string& text, unsigned long long& out) {
  if (text.empty()) return false;
  for (char ch : text)
    if (!std::isdigit(static_cast<unsigned char>(ch))) return false;
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (errno != 0 || end != text.c_str() + text.size()) return false;
  out = v;
  return true;
}

int64_t int_value(const std::string& flag, const std::string& v, int64_t min, int64_t max) {
  const bool digits = !v.empty() && v.find_first_not_of("0123456789") == std::string::npos;
  unsigned long long x = 0;
  const bool fits = digits && parse_u64(v, x) && x <= static_cast<unsigned long long>(max);
  if (!digits || (fits && static_cast<int64_t>(x) < min))
    throw UsageError(flag + " '" + excerpt(v) + "' is not an integer >= " + std::to_string(min));
  if (!fits)
    throw UsageError(flag + " " + excerpt(v) + " is too large: give an integer from " +
                     std::to_string(min) + " to " + std::to_string(max));
  return static_cast<int64_t>(x);
}

double number_value(const std::string& flag, const std::string& v) {
  if (v.empty() || std::isspace(static_cast<unsigned char>(v.front())))
    throw UsageError(flag + " '" + excerpt(v) + "' is not a number");
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (end != v.c_str() + v.size()) throw UsageError(flag + " '" + excerpt(v) + "' is not a number");
  // The engine computes in FP32: a value must be finite there, and not vanish to zero.
  if (!(std::fabs(x) <= std::numeric_limits<float>::max()))
    throw UsageError(flag + " '" + excerpt(v) + "' is not a finite number in FP32 (at most " +
                     "3.4e38), the precision Mantissa computes in");
  if (x != 0 && static_cast<float>(x) == 0)
    throw UsageError(flag + " '" + excerpt(v) + "' rounds to 0 in FP32 (the smallest is 1.4e-45)" +
                     ", the precision Mantissa computes in; give a value of at least 1.4e-45");
  return x;
}

uint64_t seed_value(const std::string& flag, const std::string& v) {
  unsigned long long x = 0;
  if (!parse_u64(v, x))
    throw UsageError(flag + " '" + excerpt(v) + "' is not a non-negative integer (a seed from 0 " +
                     "to 18446744073709551615)");
  return x;
}

int threads_value(const std::string& v) {
  unsigned long long x = 0;
  if (!parse_u64(v, x) || x < 1 || x > static_cast<unsigned long long>(train::kMaxThreads))
    throw UsageError("--threads must be an integer from 1 to " +
                     std::to_string(train::kMaxThreads) + " (got '" + excerpt(v) +
                     "'); leave it out to use every core");
  return static_cast<int>(x);
}

}  // namespace mantissa::cli

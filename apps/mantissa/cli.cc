#include "mantissa/cli.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

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
  if (text.empty() || !std::isdigit(static_cast<unsigned char>(text.front()))) return false;
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (errno != 0 || end != text.c_str() + text.size()) return false;
  out = v;
  return true;
}

}  // namespace mantissa::cli

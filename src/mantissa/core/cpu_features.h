// What the processor can do, read once (cpuid through the compiler's builtins).
#pragma once

#include <string>

namespace mantissa {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
};

const CpuFeatures& cpu_features();
// "avx2 fma f16c" style summary for reports.
std::string cpu_features_string();

}  // namespace mantissa

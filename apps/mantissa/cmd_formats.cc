// `mantissa formats`: what each storage format can hold, and which conversion path is in use.
#include <bit>
#include <cstdio>
#include <ostream>

#include "mantissa/cli.h"
#include "mantissa/mantissa.h"

namespace mantissa::cli {
namespace {

struct Row {
  const char* name;
  int exp_bits, man_bits, bytes;
  float max_finite, min_normal, min_subnormal, epsilon;
  const char* specials;
};

template <FloatFormat F>
Row row_of(const char* name, const char* specials) {
  return {name,
          F.exp_bits,
          F.man_bits,
          F.total_bits() / 8,
          decode<F>(F.max_finite_bits()),
          decode<F>(1u << F.man_bits),
          decode<F>(1u),
          decode<F>(static_cast<uint32_t>(F.bias) << F.man_bits | 1u) - 1.0f,
          specials};
}

}  // namespace

int run_formats(const std::vector<std::string>& args, std::ostream& out) {
  for (const std::string& a : args) {
    if (a == "-h" || a == "--help") {
      out << "usage: mantissa formats\n"
             "Prints each number format's bits, range and precision, and the SIMD path in use.\n";
      return kExitOk;
    }
    throw UsageError("formats takes no arguments (got '" + excerpt(a) +
                     "'); run 'mantissa formats'");
  }
  const Row rows[] = {
      {"f32", 8, 23, 4, std::bit_cast<float>(0x7f7fffffu), std::bit_cast<float>(0x00800000u),
       std::bit_cast<float>(0x00000001u), std::bit_cast<float>(0x34000000u), "inf, nan"},
      row_of<kF16Format>("f16", "inf, nan"),
      row_of<kBF16Format>("bf16", "inf, nan"),
      row_of<kE4M3Format>("e4m3", "nan only (S.1111.111)"),
      row_of<kE5M2Format>("e5m2", "inf, nan"),
  };
  char line[256];
  std::snprintf(line, sizeof line, "%-6s %-12s %-6s %-16s %-16s %-16s %-16s %s\n", "format",
                "bits s/e/m", "bytes", "max finite", "min normal", "min subnormal", "epsilon",
                "specials");
  out << line;
  for (const Row& r : rows) {
    const std::string bits = "1/" + std::to_string(r.exp_bits) + "/" + std::to_string(r.man_bits);
    std::snprintf(line, sizeof line, "%-6s %-12s %-6d %-16s %-16s %-16s %-16s %s\n", r.name,
                  bits.c_str(), r.bytes, format_float(r.max_finite).c_str(),
                  format_float(r.min_normal).c_str(), format_float(r.min_subnormal).c_str(),
                  format_float(r.epsilon).c_str(), r.specials);
    out << line;
  }
  out << "\nconversion path: " << simd_path_name(simd_path(SimdFamily::kConvert))
      << " (cpu features: " << cpu_features_string() << "; the scalar path is always built; "
      << "MANTISSA_SIMD=scalar forces it)\n"
      << "rounding: nearest-even (default) or stochastic (Philox-4x32-10, unbiased); overflow "
         "gives inf (e4m3: nan) unless saturating\n";
  return kExitOk;
}

}  // namespace mantissa::cli

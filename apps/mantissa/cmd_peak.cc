// `mantissa peak`: the machine's FP32 multiply-add throughput, the ceiling that `mantissa train`'s
// GFLOP/s (and bench/train_vs_pytorch.sh's share of the ceiling) are compared with. A shared
// machine's figure drifts: measure it next to the run it judges.
#include <ostream>

#include "mantissa/cli.h"
#include "mantissa/mantissa.h"

namespace mantissa::cli {

namespace {

constexpr const char* kPeakUsage =
    "usage: mantissa peak [--threads N] [--seconds S]\n"
    "Measures FP32 multiply-add throughput (GFLOP/s, 2 per FMA) on N threads (default: all "
    "cores), best of 3 runs of about S seconds each (default 0.5): the ceiling that training's "
    "GFLOP/s is compared with.\n";

}  // namespace

PeakArgs parse_peak_args(const std::vector<std::string>& args) {
  PeakArgs p;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") {
      p.help = true;
      continue;
    }
    auto value = [&](const char* flag) -> const std::string& {
      if (i + 1 >= args.size())
        throw UsageError(std::string(flag) + " needs a value; e.g. 'mantissa peak " + flag +
                         (a == "--threads" ? " 2'" : " 0.5'"));
      return args[++i];
    };
    if (a == "--threads") {
      p.threads = threads_value(value("--threads"));
    } else if (a == "--seconds") {
      const std::string& v = value("--seconds");
      if (!parse_float(v, p.seconds) || !(p.seconds >= 0.01f && p.seconds <= 60.0f))
        throw UsageError("--seconds must be a number from 0.01 to 60 (got '" + excerpt(v) + "')");
    } else {
      throw UsageError("unknown option '" + excerpt(a) + "' for peak; run 'mantissa peak --help'");
    }
  }
  return p;
}

int run_peak(const std::vector<std::string>& args, std::ostream& out) {
  const PeakArgs p = parse_peak_args(args);
  if (p.help) {
    out << kPeakUsage;
    return kExitOk;
  }
  const float seconds = p.seconds;
  const int n = p.threads > 0 ? p.threads : default_num_threads();
  const double one = fma_peak_gflops(1, seconds);
  const double all = n == 1 ? one : fma_peak_gflops(n, seconds);
  const SimdPath path = simd_path(SimdFamily::kFmaProbe);
  const char* how = path == SimdPath::kAvx512 ? "avx512, 12 chains x 16 lanes"
                    : path == SimdPath::kAvx2 ? "avx2+fma, 12 chains x 8 lanes, twice"
                                              : "portable loop";
  char line[160];
  if (n == 1)
    std::snprintf(line, sizeof line, "fp32 fma peak: %.1f GFLOP/s on 1 thread (%s)\n", one, how);
  else
    std::snprintf(line, sizeof line, "fp32 fma peak: %.1f GFLOP/s on %d threads (%.1f on 1; %s)\n",
                  all, n, one, how);
  out << line;
  return kExitOk;
}

}  // namespace mantissa::cli

// `mantissa cast`: convert values to a storage format and show exactly what is stored.
#include <cstdio>
#include <istream>
#include <ostream>
#include <string>

#include "mantissa/cli.h"
#include "mantissa/mantissa.h"

namespace mantissa::cli {
namespace {

constexpr const char* kCastUsage =
    "usage: mantissa cast --to f16|bf16|e4m3|e5m2 [--stochastic [--seed N]] [--saturate] [VALUE "
    "...]\n"
    "Converts each VALUE (or each line of standard input when none is given) and prints:\n"
    "  the input as given, the stored value (9 significant digits), the stored bits in hex.\n"
    "  --to FORMAT     target format (required)\n"
    "  --stochastic    stochastic rounding; value k (from 0) uses element index k of the seed\n"
    "  --seed N        seed of the stochastic rounding generator (default 0)\n"
    "  --saturate      overflow to the largest finite value instead of inf (e4m3: nan)\n";

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

}  // namespace

int run_cast(const std::vector<std::string>& args, std::istream& in, std::ostream& out) {
  std::string to;
  bool stochastic = false, saturate = false, seed_given = false;
  unsigned long long seed = 0;
  std::vector<std::string> values;
  bool options_done = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (!options_done && a.rfind("--", 0) == 0) {
      if (a == "--") {
        options_done = true;
      } else if (a == "--help") {
        out << kCastUsage;
        return kExitOk;
      } else if (a == "--to" || a.rfind("--to=", 0) == 0) {
        if (a == "--to" && i + 1 >= args.size())
          throw UsageError("--to needs a format: f16, bf16, e4m3 or e5m2");
        to = a == "--to" ? args[++i] : a.substr(5);
      } else if (a == "--stochastic") {
        stochastic = true;
      } else if (a == "--saturate") {
        saturate = true;
      } else if (a == "--seed" || a.rfind("--seed=", 0) == 0) {
        if (a == "--seed" && i + 1 >= args.size())
          throw UsageError("--seed needs a non-negative integer");
        const std::string v = a == "--seed" ? args[++i] : a.substr(7);
        if (!parse_u64(v, seed))
          throw UsageError("--seed '" + excerpt(v) + "' is not a non-negative integer");
        seed_given = true;
      } else {
        throw UsageError("unknown option '" + excerpt(a) +
                         "' for cast; run 'mantissa cast --help'");
      }
    } else if (a == "-h") {
      out << kCastUsage;
      return kExitOk;
    } else {
      values.push_back(a);
    }
  }
  if (to.empty()) throw UsageError("cast needs --to f16|bf16|e4m3|e5m2");
  const std::optional<DType> target = parse_dtype(to);
  if (!target || !is_narrow_float(*target))
    throw UsageError("unknown format '" + excerpt(to) + "' for --to; use f16, bf16, e4m3 or e5m2");
  if (seed_given && !stochastic) throw UsageError("--seed only applies with --stochastic");

  CastOptions opt;
  opt.rounding = stochastic ? Rounding::kStochastic : Rounding::kNearestEven;
  opt.saturate = saturate;
  opt.seed = seed;
  const int hex_digits = static_cast<int>(dtype_size(*target)) * 2;

  auto emit = [&](const std::string& text, uint64_t index, const std::string& where) {
    float v;
    if (!parse_float(text, v))
      throw UsageError("'" + excerpt(text) + "'" + where +
                       " is not a number; give decimal or hex floats, inf or nan");
    opt.index = index;
    uint16_t bits = 0;  // little-endian: an 8-bit result lands in the low byte
    convert(&v, DType::f32, &bits, *target, 1, opt);
    float back;
    convert(&bits, *target, &back, DType::f32, 1);
    char hex[16];
    std::snprintf(hex, sizeof hex, "0x%0*x", hex_digits, static_cast<unsigned>(bits));
    out << text << ' ' << format_float(back) << ' ' << hex << '\n';
  };

  if (!values.empty()) {
    for (size_t k = 0; k < values.size(); ++k) emit(values[k], k, "");
    return kExitOk;
  }
  std::string line;
  uint64_t index = 0, line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    const std::string t = trim(line);
    if (t.empty()) continue;
    emit(t, index++, " (standard input, line " + std::to_string(line_no) + ")");
  }
  return kExitOk;
}

}  // namespace mantissa::cli

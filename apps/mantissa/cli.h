// The mantissa command-line program: subcommands and shared helpers.
#pragma once

#include <iosfwd>
#include <stdexcept>
#include <string>
#include <vector>

namespace mantissa::cli {

// A mistake in the command line or its input: reported in one line, exit status 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Exit statuses shared by every subcommand.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;   // an unexpected internal failure
inline constexpr int kExitBadInput = 2;  // bad flags, values or files
inline constexpr int kExitOutOfMemory = 3;
inline constexpr int kExitAnomaly = 4;        // --detect-anomaly found inf/NaN
inline constexpr int kExitInterrupted = 130;  // Ctrl-C: stopped cleanly (128 + SIGINT)

int run_formats(const std::vector<std::string>& args, std::ostream& out);
int run_cast(const std::vector<std::string>& args, std::istream& in, std::ostream& out);
int run_train(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);
int run_eval(const std::vector<std::string>& args, std::ostream& out);
int run_memory(const std::vector<std::string>& args, std::ostream& out);
int run_peak(const std::vector<std::string>& args, std::ostream& out);

// A float as a user reads it: 9 significant digits, and "inf", "-inf", "nan".
std::string format_float(float v);
// The whole string as a float (decimal, hex float, inf, nan; correctly rounded), or false.
bool parse_float(const std::string& text, float& out);
// The whole string as an unsigned 64-bit integer, or false.
bool parse_u64(const std::string& text, unsigned long long& out);

}  // namespace mantissa::cli

// The mantissa command-line program: subcommands, their parsers, and shared helpers.
#pragma once

#include <cstdint>
#include <exception>
#include <iosfwd>
#include <stdexcept>
#include <string>
#include <vector>

#include "mantissa/train/config.h"

namespace mantissa::cli {

// A mistake in the command line or its input: reported in one line, exit status 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Exit statuses shared by every subcommand (README, "Exit statuses").
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;   // an unexpected internal failure
inline constexpr int kExitBadInput = 2;  // bad flags, values or files
inline constexpr int kExitOutOfMemory = 3;
inline constexpr int kExitAnomaly = 4;  // --detect-anomaly found inf/NaN
// A run stopped cleanly by a signal exits with 128 + its number, as a shell reports a process the
// signal ended: 129 SIGHUP, 130 SIGINT (Ctrl-C), 143 SIGTERM.
inline constexpr int kExitSignalBase = 128;

// Runs a command line (without the program's name) and returns its exit status; an error that
// ends it is reported on `err` by exit_status_of, and in a job of several processes (mpirun) ends
// the whole job with that status.
int run_command(std::vector<std::string> args, std::istream& in, std::ostream& out,
                std::ostream& err);
// What ended a command, reported in one line on `err` (the problem and the fix; "mantissa (rank R
// of N)" in a job of several processes), and its exit
// status: kExitBadInput for UsageError and mantissa::Error, kExitOutOfMemory for
// OutOfMemoryError and std::bad_alloc, kExitAnomaly for autograd::AnomalyError, kExitFailure
// for anything else (a bug in Mantissa).
int exit_status_of(const std::exception_ptr& error, std::ostream& err);

int run_formats(const std::vector<std::string>& args, std::ostream& out);
int run_cast(const std::vector<std::string>& args, std::istream& in, std::ostream& out);
int run_train(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);
int run_eval(const std::vector<std::string>& args, std::ostream& out);
int run_memory(const std::vector<std::string>& args, std::ostream& out);
int run_advise(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);
int run_peak(const std::vector<std::string>& args, std::ostream& out);

// The commands' parsers: what a command line asks for, checked value by value (UsageError), before
// anything runs. The configurations are resolved (train::resolve) by the commands themselves.
struct TrainArgs {
  train::TrainConfig config;
  bool print_model = false;
  bool help = false;
};
TrainArgs parse_train_args(const std::vector<std::string>& args);

struct EvalArgs {
  std::string checkpoint, dataset, data_dir;
  int64_t test_limit = 0;  // 0: the whole test split
  int64_t batch_size = 32;
  int threads = 0;  // 0: every core
  bool help = false;
};
EvalArgs parse_eval_args(const std::vector<std::string>& args);

struct MemoryArgs {
  train::TrainConfig config;
  std::vector<std::string> precisions;  // at least one once parsed
  std::string json_path, html_path;
  int64_t ranks = 0;  // --ranks: 0 for none
  bool help = false;
};
MemoryArgs parse_memory_args(const std::vector<std::string>& args);

struct PeakArgs {
  int threads = 0;  // 0: every core
  float seconds = 0.5f;
  bool help = false;
};
PeakArgs parse_peak_args(const std::vector<std::string>& args);

// A float as a user reads it: 9 significant digits, and "inf", "-inf", "nan".
std::string format_float(float v);
// The whole string as a float (decimal, hex float, inf, nan; correctly rounded), or false.
bool parse_float(const std::string& text, float& out);
// The whole string as an unsigned 64-bit integer (decimal digits only), or false.
bool parse_u64(const std::string& text, unsigned long long& out);

// The value of a flag, checked (UsageError naming the flag and what it takes):
// an integer from `min` to `max`;
int64_t int_value(const std::string& flag, const std::string& v, int64_t min,
                  int64_t max = int64_t{1} << 62);
// a number (decimal or hex float, correctly rounded to a double) that is finite in FP32 and does
// not round to zero there unless it is zero;
double number_value(const std::string& flag, const std::string& v);
// a seed: any unsigned 64-bit integer;
uint64_t seed_value(const std::string& flag, const std::string& v);
// --threads, the same rule in every command: from 1 to train::kMaxThreads.
int threads_value(const std::string& v);

}  // namespace mantissa::cli

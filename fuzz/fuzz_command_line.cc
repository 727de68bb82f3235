// The command line end to end without training: the bytes are a command line (arguments
// separated by NUL bytes, the first the command). train, eval and memory are parsed and their
// configuration resolved as the commands do before they run anything (no output path is
// claimed); peak is parsed; formats and cast, which only compute, run whole with an empty
// standard input. Refusals must be a UsageError or a mantissa::Error, and quote at most an
// excerpt of what they were given.
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "mantissa/cli.h"
#include "mantissa/core/error.h"
#include "mantissa/train/config.h"

namespace {

using namespace mantissa;

// Every message quotes an excerpt: none may be much longer than the flags it names.
void check_length(const std::string& message) {
  if (message.size() > 4096) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args;
  std::string arg;
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == 0) {
      args.push_back(arg);
      arg.clear();
    } else {
      arg.push_back(static_cast<char>(data[i]));
    }
  }
  args.push_back(arg);
  const std::string command = args.front();
  args.erase(args.begin());
  try {
    if (command == "train") {
      const cli::TrainArgs t = cli::parse_train_args(args);
      if (!t.help) train::resolve(t.config, /*checks_outputs=*/false);
    } else if (command == "memory") {
      const cli::MemoryArgs m = cli::parse_memory_args(args);
      for (const std::string& p : m.precisions) {
        train::TrainConfig c = m.config;
        c.precision = p;
        train::resolve(c, /*checks_outputs=*/false);
      }
    } else if (command == "eval") {
      cli::parse_eval_args(args);
    } else if (command == "peak") {
      cli::parse_peak_args(args);
    } else if (command == "formats" || command == "cast") {
      args.insert(args.begin(), command);
      std::istringstream in;
      std::ostringstream out, err;
      const int status = cli::run_command(args, in, out, err);
      if (status != cli::kExitOk && status != cli::kExitBadInput) std::abort();
      check_length(err.str());
    }
  } catch (const cli::UsageError& e) {
    check_length(e.what());
  } catch (const Error& e) {
    check_length(e.what());
  }
  return 0;
}

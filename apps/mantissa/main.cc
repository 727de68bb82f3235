// mantissa: the command-line program of the Mantissa engine.
#include <iostream>
#include <string>
#include <vector>

#include "mantissa/cli.h"
#include "mantissa/mantissa.h"

namespace {

constexpr const char* kUsage =
    "usage: mantissa <command> [options]\n"
    "commands:\n"
    "  formats   the number formats: bits, range, precision, SIMD path in use\n"
    "  cast      convert values to f16, bf16, e4m3 or e5m2 (nearest-even or stochastic)\n"
    "  train     train a model (default: the tutorial CNN on Fashion-MNIST)\n"
    "  eval      evaluate a checkpoint on a test set\n"
    "  memory    memory of one training step by category, layer and over time; two precisions\n"
    "  peak      FP32 multiply-add throughput of this machine: the ceiling for training GFLOP/s\n"
    "Run 'mantissa <command> --help' for a command's options.\n";

// "mantissa", or in a job of several processes "mantissa (rank 1 of 4)": whose error it is.
std::string who() {
  if (!mantissa::comm::launched_by_mpi()) return "mantissa";
  try {
    const mantissa::comm::Communicator& w = mantissa::comm::world();
    if (w.size() > 1)
      return "mantissa (rank " + std::to_string(w.rank()) + " of " + std::to_string(w.size()) + ")";
  } catch (const std::exception&) {
  }
  return "mantissa";
}

// A failed process of a job that several run ends the whole job with its status: the others
// would wait for it in their next collective (and a rank that returns from main while they wait
// hangs in MPI's shutdown). One process returns the status.
int failed(int status) {
  if (mantissa::comm::launched_by_mpi()) {
    try {
      mantissa::comm::Communicator& w = mantissa::comm::world();
      if (w.size() > 1) w.abort(status);
    } catch (const std::exception&) {
    }
  }
  return status;
}

int run(const std::string& command, std::vector<std::string>& args);

}  // namespace

int main(int argc, char** argv) {
  using namespace mantissa::cli;
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "-h" || args[0] == "--help" || args[0] == "help") {
    std::cout << kUsage;
    return args.empty() ? kExitBadInput : kExitOk;
  }
  const std::string command = args[0];
  args.erase(args.begin());
  return run(command, args);
}

namespace {

int run(const std::string& command, std::vector<std::string>& args) {
  using namespace mantissa::cli;
  try {
    if (command == "formats") return run_formats(args, std::cout);
    if (command == "cast") return run_cast(args, std::cin, std::cout);
    if (command == "train") return run_train(args, std::cout, std::cerr);
    if (command == "eval") return run_eval(args, std::cout);
    if (command == "memory") return run_memory(args, std::cout);
    if (command == "peak") return run_peak(args, std::cout);
    if (command == "--version" || command == "version") {
      std::cout << "mantissa 0.1.0\n";
      return kExitOk;
    }
    throw UsageError("unknown command '" + command + "'; run 'mantissa --help' for the list");
  } catch (const UsageError& e) {
    std::cout.flush();
    std::cerr << who() << ": error: " << e.what() << std::endl;
    return failed(kExitBadInput);
  } catch (const mantissa::OutOfMemoryError& e) {
    std::cout.flush();
    std::cerr << who() << ": " << e.what() << std::endl;
    return failed(kExitOutOfMemory);
  } catch (const mantissa::autograd::AnomalyError& e) {
    std::cout.flush();
    std::cerr << who() << ": " << e.what() << std::endl;
    return failed(kExitAnomaly);
  } catch (const mantissa::Error& e) {
    // One line: the problem, then how to fix it.
    std::cout.flush();
    std::cerr << who() << ": error: " << e.message();
    if (!e.hint().empty()) std::cerr << " (" << e.hint() << ")";
    std::cerr << std::endl;
    return failed(kExitBadInput);
  } catch (const mantissa::InternalError& e) {
    // A bug in Mantissa: the place it was detected, and where it belongs.
    std::cout.flush();
    std::cerr << who() << ": " << e.what() << " -- please report this as a bug" << std::endl;
    return failed(kExitFailure);
  } catch (const std::exception& e) {
    std::cout.flush();
    std::cerr << who() << ": internal error: " << e.what() << std::endl;
    return failed(kExitFailure);
  }
}

}  // namespace

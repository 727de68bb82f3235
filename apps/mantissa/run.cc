// The program's dispatch: a command line to its command, and what ended it to an exit status.
#include <iostream>
#include <new>
#include <string>
#include <vector>

#include "mantissa/cli.h"
#include "mantissa/mantissa.h"

namespace mantissa::cli {
namespace {

constexpr const char* kUsage =
    "usage: mantissa <command> [options]\n"
    "commands:\n"
    "  formats   the number formats: bits, range, precision, SIMD path in use\n"
    "  cast      convert values to f16, bf16, e4m3 or e5m2 (nearest-even or stochastic)\n"
    "  train     train a model (default: the tutorial CNN on Fashion-MNIST)\n"
    "  eval      evaluate a checkpoint on a test set\n"
    "  memory    memory of one training step by category, layer and over time; two precisions\n"
    "  advise    what a precision will break, from a short FP32 run; the command to run instead\n"
    "  peak      FP32 multiply-add throughput of this machine: the ceiling for training GFLOP/s\n"
    "Run 'mantissa <command> --help' for a command's options.\n";

// "mantissa", or in a job of several processes "mantissa (rank 1 of 4)": whose error it is.
std::string who() {
  if (!comm::launched_by_mpi()) return "mantissa";
  try {
    const comm::Communicator& w = comm::world();
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
  if (comm::launched_by_mpi()) {
    try {
      comm::Communicator& w = comm::world();
      if (w.size() > 1) w.abort(status);
    } catch (const std::exception&) {
    }
  }
  return status;
}

}  // namespace

int exit_status_of(const std::exception_ptr& error, std::ostream& err) {
  // The report is made whole, then written at once: the ranks of a job share one terminal or
  // pipe, and a report written in pieces interleaves with another rank's.
  const std::string name = who();
  std::string report;
  int status = kExitFailure;
  try {
    std::rethrow_exception(error);
  } catch (const UsageError& e) {
    report = name + ": error: " + e.what();
    status = kExitBadInput;
  } catch (const OutOfMemoryError& e) {
    report = name + ": " + e.what();
    status = kExitOutOfMemory;
  } catch (const autograd::AnomalyError& e) {
    report = name + ": " + e.what();
    status = kExitAnomaly;
  } catch (const Error& e) {
    // One line: the problem, then how to fix it.
    report = name + ": error: " + e.message();
    if (!e.hint().empty()) report += " (" + e.hint() + ")";
    status = kExitBadInput;
  } catch (const std::bad_alloc&) {
    // An allocation outside the accounted tensors (a container, a string) that the system refused.
    report = name +
             ": out of memory: the system refused an allocation\n---> HINT: lower the batch size, "
             "the image size or the model, or free memory on the machine";
    status = kExitOutOfMemory;
  } catch (const InternalError& e) {
    // A bug in Mantissa: the place it was detected, and where it belongs.
    report = name + ": " + e.what() + " -- please report this as a bug";
    status = kExitFailure;
  } catch (const std::exception& e) {
    report = name + ": internal error: " + e.what() + " -- please report this as a bug";
    status = kExitFailure;
  }
  report += '\n';
  err.write(report.data(), static_cast<std::streamsize>(report.size()));
  err.flush();
  return status;
}

int run_command(std::vector<std::string> args, std::istream& in, std::ostream& out,
                std::ostream& err) {
  if (args.empty() || args[0] == "-h" || args[0] == "--help" || args[0] == "help") {
    out << kUsage;
    return args.empty() ? kExitBadInput : kExitOk;
  }
  const std::string command = args[0];
  args.erase(args.begin());
  try {
    if (command == "formats") return run_formats(args, out);
    if (command == "cast") return run_cast(args, in, out);
    if (command == "train") return run_train(args, out, err);
    if (command == "eval") return run_eval(args, out);
    if (command == "memory") return run_memory(args, out);
    if (command == "advise") return run_advise(args, out, err);
    if (command == "peak") return run_peak(args, out);
    if (command == "--version" || command == "version") {
      out << "mantissa 0.1.0\n";
      return kExitOk;
    }
    throw UsageError("unknown command '" + excerpt(command) +
                     "'; run 'mantissa --help' for the list");
  } catch (...) {
    out.flush();  // what was printed before the error comes first
    return failed(exit_status_of(std::current_exception(), err));
  }
}

}  // namespace mantissa::cli

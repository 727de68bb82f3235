// Runs a program to completion with a time limit, its output in files: how the page check starts
// the browser (CTest's own timeout would kill the check, not the browser it started).
#pragma once

#include <string>
#include <vector>

namespace mantissa::browser {

struct ProcessResult {
  int exit_code = -1;      // the program's exit status; -1 when it did not exit normally
  bool timed_out = false;  // killed (with everything it started) after the time limit
};

// Starts argv[0] (searched in PATH) in its own process group with standard input from /dev/null,
// standard output and error into the named files, and `home` as HOME and XDG directories (so the
// program writes nothing into the user's home). Throws std::runtime_error if it cannot start.
ProcessResult run_process(const std::vector<std::string>& argv, const std::string& stdout_path,
                          const std::string& stderr_path, const std::string& home,
                          double timeout_seconds);

}  // namespace mantissa::browser

#include "browser/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace mantissa::browser {

ProcessResult run_process(const std::vector<std::string>& argv, const std::string& stdout_path,
                          const std::string& stderr_path, const std::string& home,
                          double timeout_seconds) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // The environment is built before fork: the child may only make async-signal-safe calls.
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string var(*e);
    if (var.starts_with("HOME=") || var.starts_with("XDG_CONFIG_HOME=") ||
        var.starts_with("XDG_CACHE_HOME="))
      continue;
    env_strings.push_back(var);
  }
  for (const char* name : {"HOME=", "XDG_CONFIG_HOME=", "XDG_CACHE_HOME="})
    env_strings.push_back(name + home);
  std::vector<char*> env;
  for (std::string& e : env_strings) env.push_back(e.data());
  env.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error(std::string("fork failed: ") + std::strerror(errno));
  if (pid == 0) {
    setpgid(0, 0);
    const int in = open("/dev/null", O_RDONLY);
    const int out = open(stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int err = open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (in < 0 || out < 0 || err < 0) _exit(126);
    dup2(in, 0);
    dup2(out, 1);
    dup2(err, 2);
    execvpe(args[0], args.data(), env.data());
    _exit(127);
  }
  setpgid(pid, pid);  // also here, so the group exists before a timeout could kill it
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<long>(timeout_seconds * 1000));
  ProcessResult result;
  for (;;) {
    // WNOWAIT leaves the exited child unreaped, so its id (the group's) cannot be reused before
    // the group is killed below.
    siginfo_t info{};
    if (waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(std::string("waitid failed: ") + std::strerror(errno));
    }
    if (info.si_pid == pid) {
      if (info.si_code == CLD_EXITED) result.exit_code = info.si_status;
      break;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      result.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // The browser's helper processes share its group; none may outlive the check.
  kill(-pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  if (result.exit_code == 127) throw std::runtime_error("cannot run " + argv[0]);
  return result;
}

}  // namespace mantissa::browser

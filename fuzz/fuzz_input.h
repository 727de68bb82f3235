// What every harness shares: the fuzzer's bytes as a file (the readers take paths, and reading
// through io::InputFile is part of what is fuzzed), and the rule that a mantissa::Error is the
// only acceptable failure. Any other exception escapes LLVMFuzzerTestOneInput, which libFuzzer
// reports as a crash, as it does sanitizer reports and allocations past -malloc_limit_mb.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "mantissa/core/tensor.h"

namespace mantissa::fuzz {

// A directory of this process (under $TMPDIR, or /dev/shm when it exists: no disk writes per
// execution), removed at exit.
inline const std::filesystem::path& scratch_dir() {
  struct Dir {
    std::filesystem::path path;
    Dir() {
      const char* tmp = std::getenv("TMPDIR");
      std::filesystem::path base = std::filesystem::exists("/dev/shm") ? "/dev/shm"
                                   : tmp                               ? tmp
                                                                       : "/tmp";
      path = base / ("mantissa_fuzz_" + std::to_string(::getpid()));
      std::filesystem::create_directories(path);
    }
    ~Dir() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static Dir dir;
  return dir.path;
}

// Writes `size` bytes to scratch_dir()/name (replacing it) and returns its path.
inline std::string write_input(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = (scratch_dir() / name).string();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) std::abort();
  for (size_t done = 0; done < size;) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n <= 0) std::abort();
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return path;
}

// Reads every byte a reader says the tensor holds (a sanitizer reports one that is not there); the
// sum goes to a volatile so the loads are not optimised away.
inline void read_every_byte(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data_ptr());
  unsigned sum = 0;
  for (size_t i = 0; i < t.nbytes(); ++i) sum += p[i];
  volatile unsigned sink = sum;
  (void)sink;
}

}  // namespace mantissa::fuzz

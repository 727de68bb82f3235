#include "mantissa/io/output_file.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "mantissa/core/error.h"

namespace mantissa::io {

void check_output_path(const std::string& path, const char* flag) {
  if (path.empty()) return;
  namespace fs = std::filesystem;
  const fs::path p(path);
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  std::error_code ec;
  MANTISSA_CHECK(fs::is_directory(dir, ec),
                 std::string(flag) + " " + path + ": directory " + dir.string() + " does not exist",
                 "create the directory first, or choose another path");
  MANTISSA_CHECK(
      ::access(dir.c_str(), W_OK) == 0,
      std::string(flag) + " " + path + ": directory " + dir.string() + " is not writable",
      "choose a directory you can write to");
  MANTISSA_CHECK(!fs::is_directory(p, ec), std::string(flag) + " " + path + " is a directory",
                 "give a file name");
}

void write_file_atomic(const std::string& path, const std::function<void(std::ostream&)>& write) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::error_code ec;
  MANTISSA_CHECK(fs::is_directory(dir, ec),
                 "cannot write " + path + ": directory " + dir.string() + " does not exist",
                 "create the directory first, or choose another path");
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    MANTISSA_CHECK(f.good(), "cannot write " + tmp, "check that the directory is writable");
    write(f);
    f.flush();
    if (!f.good()) {
      f.close();
      fs::remove(tmp, ec);
      throw Error("writing " + tmp + " failed (disk full?)", "free some space and run again");
    }
  }
  fs::rename(tmp, target, ec);
  if (ec) {
    const std::string why = ec.message();
    fs::remove(tmp, ec);
    throw Error("cannot rename " + tmp + " to " + path + ": " + why,
                "check that the directory is writable");
  }
}

void write_file_atomic(const std::string& path, const std::string& text) {
  write_file_atomic(path, [&](std::ostream& f) { f << text; });
}

}  // namespace mantissa::io

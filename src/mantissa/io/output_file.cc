#include "mantissa/io/output_file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <ostream>
#include <streambuf>
#include <string_view>
#include <utility>
#include <vector>

#include "mantissa/core/error.h"
#include "mantissa/io/file_kind.h"

namespace mantissa::io {

namespace fs = std::filesystem;

namespace {

std::string directory_of(const std::string& path) {
  const fs::path p(path);
  return p.has_parent_path() ? p.parent_path().string() : std::string(".");
}

// Refuses a target that exists and is not a regular file (following symbolic links).
void check_target_kind(const std::string& path, const std::string& label) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    throw Error(label + " is " + detail::file_kind(st.st_mode) + ", which Mantissa never replaces",
                "give the path of a regular file to write");
}

// ---- Claims: advisory locks on PATH.lock, for one write or until the process exits ----

// Whether the open lock file `fd` is empty or holds a process id as Claims writes it: digits and
// a newline.
bool holds_a_process_id(int fd, const struct stat& st) {
  if (st.st_size == 0) return true;
  if (st.st_size > 24) return false;
  char buf[25] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  if (n <= 0) return n == 0;
  std::string_view text(buf, static_cast<size_t>(n));
  if (text.back() == '\n') text.remove_suffix(1);
  return !text.empty() && text.find_first_not_of("0123456789") == std::string_view::npos;
}

struct Claim {
  dev_t dev;
  ino_t ino;
  int fd;
  std::string lock_path;
};

class Claims {
 public:
  static Claims& instance() {
    static Claims claims;
    return claims;
  }
  // Claims `path` (see output_file.h); `label` starts the error message. Returns false if this
  // process held it already; otherwise the claim lasts until release(path) or the process's end.
  bool claim(const std::string& path, const std::string& label) {
    const std::string lock_path = path + ".lock";
    std::lock_guard<std::mutex> lock(mu_);
    // A lock file unlinked by its holder between our open and our lock is not the lock any more:
    // try again with the file now at the path (a few times; more means something keeps deleting
    // it).
    for (int attempt = 0; attempt < 8; ++attempt) {
      const int fd =
          ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
      if (fd < 0)
        throw Error(
            label + ": cannot create its lock file " + lock_path + ": " + std::strerror(errno),
            "check that the directory is writable, and that " + lock_path + " is a regular file");
      struct stat st {};
      if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        ::close(fd);
        throw Error(label + ": its lock file " + lock_path + " is not a regular file",
                    "remove " + lock_path);
      }
      // A lock file holds a process id (or nothing yet: one being made); anything else at that
      // path is a file of the user's, which a claim would truncate and remove.
      if (!holds_a_process_id(fd, st)) {
        ::close(fd);
        throw Error(label + ": " + lock_path +
                        " exists and is not a lock file Mantissa made (it holds other data)",
                    "rename or remove " + lock_path + ", or write to another path");
      }
      for (const Claim& c : held_)
        if (c.dev == st.st_dev && c.ino == st.st_ino) {  // this process holds it already
          ::close(fd);
          return false;
        }
      if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
        const int err = errno;
        char buf[32] = {};
        const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
        ::close(fd);
        std::string pid(buf, n > 0 ? static_cast<size_t>(n) : 0);
        while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
        if (err == EWOULDBLOCK)
          throw Error(label + " is being written by another process (pid " +
                          (pid.empty() ? std::string("unknown") : excerpt(pid, 20)) + ", per " +
                          lock_path + ")",
                      "wait for that run to end, or choose another path");
        throw Error(label + ": cannot lock " + lock_path + ": " + std::strerror(err),
                    "write to a file system that supports file locks");
      }
      struct stat now {};
      if (::stat(lock_path.c_str(), &now) != 0 || now.st_dev != st.st_dev ||
          now.st_ino != st.st_ino) {
        ::close(fd);
        continue;
      }
      const std::string pid = std::to_string(::getpid()) + "\n";
      if (::ftruncate(fd, 0) != 0 ||
          ::pwrite(fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
        // The lock holds without the id: other processes then report the holder as unknown.
      }
      held_.push_back({st.st_dev, st.st_ino, fd, lock_path});
      return true;
    }
    throw Error(label + ": its lock file " + lock_path + " keeps being replaced",
                "check what else writes to that directory");
  }

  // Ends the claim of `path` made by the last claim() that returned true.
  void release(const std::string& path) {
    const std::string lock_path = path + ".lock";
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = held_.size(); i-- > 0;)
      if (held_[i].lock_path == lock_path) {
        drop(held_[i]);
        held_.erase(held_.begin() + static_cast<std::ptrdiff_t>(i));
        return;
      }
  }

  ~Claims() {
    for (const Claim& c : held_) drop(c);
  }

 private:
  Claims() = default;
  // The lock file is unlinked while still locked, and only if the path is still our file: a
  // process that opened it meanwhile finds it gone once it gets the lock, and opens the path again.
  static void drop(const Claim& c) {
    struct stat st {};
    if (::stat(c.lock_path.c_str(), &st) == 0 && st.st_dev == c.dev && st.st_ino == c.ino)
      ::unlink(c.lock_path.c_str());
    ::close(c.fd);
  }

  std::mutex mu_;
  std::vector<Claim> held_;
};

// Removes PATH.tmp.PID files of a process that no longer runs (killed during a write). Called
// with the path claimed: a live process writing it would hold the claim.
void remove_stale_temporaries(const std::string& path) {
  const std::string prefix = fs::path(path).filename().string() + ".tmp.";
  std::error_code ec;
  for (fs::directory_iterator it(directory_of(path), ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() <= prefix.size() || name.size() > prefix.size() + 10 ||
        name.compare(0, prefix.size(), prefix) != 0 ||
        name.find_first_not_of("0123456789", prefix.size()) != std::string::npos)
      continue;
    const long pid = std::stol(name.substr(prefix.size()));
    if (pid <= 0 || pid > INT32_MAX || pid == ::getpid()) continue;
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      std::error_code ignored;
      fs::remove(it->path(), ignored);
    }
  }
}

// An output stream over a file descriptor that remembers the first write error.
class FdStreambuf : public std::streambuf {
 public:
  explicit FdStreambuf(int fd) : fd_(fd), buf_(size_t{1} << 16) {
    setp(buf_.data(), buf_.data() + buf_.size());
  }
  int error() const { return error_; }

 protected:
  int_type overflow(int_type c) override {
    if (!flush_buffer()) return traits_type::eof();
    if (!traits_type::eq_int_type(c, traits_type::eof())) {
      *pptr() = traits_type::to_char_type(c);
      pbump(1);
    }
    return traits_type::not_eof(c);
  }
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    if (n <= epptr() - pptr()) {
      std::memcpy(pptr(), s, static_cast<size_t>(n));
      pbump(static_cast<int>(n));
      return n;
    }
    if (!flush_buffer() || !write_all(s, static_cast<size_t>(n))) return 0;
    return n;
  }
  int sync() override { return flush_buffer() ? 0 : -1; }

 private:
  bool flush_buffer() {
    const size_t n = static_cast<size_t>(pptr() - pbase());
    setp(buf_.data(), buf_.data() + buf_.size());
    return write_all(buf_.data(), n);
  }
  bool write_all(const char* p, size_t n) {
    while (n > 0 && error_ == 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        error_ = w < 0 ? errno : EIO;
        break;
      }
      p += w;
      n -= static_cast<size_t>(w);
    }
    return error_ == 0;
  }

  int fd_;
  std::vector<char> buf_;
  int error_ = 0;
};

}  // namespace

void check_output_path(const std::string& path, const char* flag) {
  if (path.empty()) return;
  const std::string label = std::string(flag) + " " + path;
  const std::string dir = directory_of(path);
  std::error_code ec;
  MANTISSA_CHECK(fs::is_directory(dir, ec), label + ": directory " + dir + " does not exist",
                 "create the directory first, or choose another path");
  MANTISSA_CHECK(::access(dir.c_str(), W_OK) == 0,
                 label + ": directory " + dir + " is not writable",
                 "choose a directory you can write to");
  check_target_kind(path, label);
  Claims::instance().claim(path, label);  // until the process ends: the run's output
}

void check_distinct_outputs(const std::vector<OutputPath>& outputs) {
  // A file is written by renaming over its name, so its identity is its directory (links and "."
  // or ".." resolved) and its own name: a symbolic link is replaced, not written through.
  std::vector<std::pair<fs::path, const OutputPath*>> seen;
  for (const OutputPath& o : outputs) {
    if (o.path.empty()) continue;
    const fs::path abs = fs::absolute(o.path).lexically_normal();
    std::error_code ec;
    fs::path dir = fs::weakly_canonical(abs.parent_path(), ec);
    if (ec) dir = abs.parent_path();
    const fs::path p = dir / abs.filename();
    for (const auto& [q, other] : seen)
      MANTISSA_CHECK(p != q,
                     other->flag + " " + other->path + " and " + o.flag + " " + o.path +
                         " name the same file: one would replace the other",
                     "give each output its own path");
    seen.emplace_back(p, &o);
  }
}

void write_file_atomic(const std::string& path, const std::function<void(std::ostream&)>& write) {
  const std::string dir = directory_of(path);
  std::error_code ec;
  MANTISSA_CHECK(fs::is_directory(dir, ec),
                 "cannot write " + path + ": directory " + dir + " does not exist",
                 "create the directory first, or choose another path");
  check_target_kind(path, "cannot write " + path + ": it");
  // A path this process has not claimed before is claimed for this write only (a program writing
  // many files keeps no lock file or descriptor per file).
  struct WriteClaim {
    const std::string& path;
    bool held;
    ~WriteClaim() {
      if (held) Claims::instance().release(path);
    }
  } write_claim{path, Claims::instance().claim(path, "cannot write " + path + ": it")};
  remove_stale_temporaries(path);

  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  ::unlink(tmp.c_str());  // a leftover of a process with our id (the claim excludes a live one)
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0666);
  MANTISSA_CHECK(fd >= 0, "cannot write " + tmp + ": " + std::strerror(errno),
                 "check that the directory is writable");
  // From here on, any failure removes the temporary file and leaves `path` as it was.
  bool fd_open = true;
  auto fail = [&](const std::string& what, int err) {
    if (fd_open) ::close(fd);
    ::unlink(tmp.c_str());
    throw Error(
        "writing " + tmp + " failed: " + what + (err ? std::string(": ") + std::strerror(err) : ""),
        err == ENOSPC || err == EDQUOT ? "free some space and run again"
                                       : "check the disk and the directory");
  };
  {
    FdStreambuf buf(fd);
    std::ostream out(&buf);
    try {
      write(out);
    } catch (...) {
      ::close(fd);
      ::unlink(tmp.c_str());
      throw;
    }
    out.flush();
    if (!out.good() || buf.error() != 0) fail("the data could not be written", buf.error());
  }
  if (::fsync(fd) != 0) fail("fsync", errno);
  fd_open = false;
  if (::close(fd) != 0) fail("close", errno);
  // Checked again just before the rename: the target may have changed since the claim.
  try {
    check_target_kind(path, "cannot write " + path + ": it");
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw Error("cannot rename " + tmp + " to " + path + ": " + std::strerror(err),
                "check that the directory is writable");
  }
  // The rename is durable once the directory is synced (some file systems cannot: ignored).
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void write_file_atomic(const std::string& path, const std::string& text) {
  write_file_atomic(path, [&](std::ostream& f) { f << text; });
}

}  // namespace mantissa::io

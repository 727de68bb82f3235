// Output files: written whole or not at all, never over something that is not a regular file,
// stale temporaries of killed writers removed, and one writer per path across processes.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mantissa/io/output_file.h"
#include "support/errors.h"
#include "support/files.h"

namespace mantissa {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;
using testing::write_raw;

std::string contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The names in a directory, sorted.
std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

TEST(OutputFile, WritesWholeFilesAndReplacesThem) {
  TempDir d;
  const std::string path = d.file("out.txt");
  io::write_file_atomic(path, "first");
  EXPECT_EQ(contents(path), "first");
  io::write_file_atomic(path, [](std::ostream& out) {
    for (int i = 0; i < 100000; ++i) out << i << '\n';  // more than the stream's buffer
  });
  const std::string all = contents(path);
  EXPECT_EQ(all.substr(0, 6), "0\n1\n2\n");
  EXPECT_EQ(all.substr(all.size() - 6), "99999\n");
  // Only the file: a write claims the path for its own duration.
  EXPECT_EQ(entries(d.path()), (std::vector<std::string>{"out.txt"}));
  // A checked path stays claimed until the process ends.
  io::check_output_path(path, "--save");
  EXPECT_EQ(contents(path + ".lock"), std::to_string(::getpid()) + "\n");
  io::write_file_atomic(path, "again");
  EXPECT_EQ(contents(path + ".lock"), std::to_string(::getpid()) + "\n");
}

TEST(OutputFile, AFailedWriteKeepsTheOldFileAndLeavesNoTemporary) {
  TempDir d;
  const std::string path = d.file("out.txt");
  io::write_file_atomic(path, "old");
  EXPECT_THROW(io::write_file_atomic(path,
                                     [](std::ostream& out) {
                                       out << "half";
                                       throw std::runtime_error("interrupted");
                                     }),
               std::runtime_error);
  EXPECT_EQ(contents(path), "old");
  EXPECT_EQ(entries(d.path()), (std::vector<std::string>{"out.txt"}));
}

TEST(OutputFile, NeverReplacesWhatIsNotARegularFile) {
  TempDir d;
  // A FIFO: refused by the check and by the writer, and still a FIFO afterwards.
  const std::string fifo = d.file("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::string e = error_of([&] { io::check_output_path(fifo, "--save"); });
  EXPECT_NE(e.find("--save " + fifo + " is a FIFO (named pipe), which Mantissa never replaces"),
            std::string::npos)
      << e;
  e = error_of([&] { io::write_file_atomic(fifo, "data"); });
  EXPECT_NE(e.find("cannot write " + fifo + ": it is a FIFO"), std::string::npos) << e;
  EXPECT_TRUE(fs::is_fifo(fifo));
  // A device, through a link in the directory (were the check broken, the rename would replace
  // the link, not the device).
  const std::string dev = d.file("null");
  fs::create_symlink("/dev/null", dev);
  e = error_of([&] { io::write_file_atomic(dev, "data"); });
  EXPECT_NE(e.find("it is a character device"), std::string::npos) << e;
  EXPECT_TRUE(fs::is_symlink(dev));
  e = error_of([&] { io::check_output_path("/dev/null", "--metrics-json"); });
  EXPECT_NE(e.find("--metrics-json /dev/null is a character device"), std::string::npos) << e;
  // A directory and a socket.
  fs::create_directory(d.file("dir"));
  e = error_of([&] { io::write_file_atomic(d.file("dir"), "data"); });
  EXPECT_NE(e.find("it is a directory"), std::string::npos) << e;
  e = error_of([&] { io::check_output_path(d.file("dir"), "--save"); });
  EXPECT_NE(e.find("is a directory"), std::string::npos) << e;
  const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string sock = d.file("sock");
  std::memcpy(addr.sun_path, sock.c_str(), sock.size() + 1);
  ASSERT_EQ(::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  e = error_of([&] { io::write_file_atomic(sock, "data"); });
  ::close(s);
  EXPECT_NE(e.find("it is a socket"), std::string::npos) << e;
  EXPECT_TRUE(fs::is_socket(sock));
  // No temporaries were left by any of these.
  for (const std::string& name : entries(d.path()))
    EXPECT_EQ(name.find(".tmp."), std::string::npos) << name;
  // The checks still pass for a new file and a regular one, and a missing directory is named.
  EXPECT_EQ(error_of([&] { io::check_output_path(d.file("new.json"), "--save"); }), "");
  EXPECT_NE(error_of([&] {
              io::check_output_path(d.file("no/such.json"), "--save");
            }).find("does not exist"),
            std::string::npos);
}

// The id of a process that has ended.
pid_t dead_pid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  ::waitpid(pid, nullptr, 0);
  return pid;
}

TEST(OutputFile, RemovesStaleTemporariesOfThatPathOnly) {
  TempDir d;
  const std::string path = d.file("ck.safetensors");
  const std::string dead = std::to_string(dead_pid());
  const std::string alive = std::to_string(::getppid());
  write_raw(path + ".tmp." + dead, "killed during a write");
  write_raw(path + ".tmp." + alive, "a live process's");
  write_raw(path + ".tmp.x" + dead, "not this naming");
  write_raw(d.file("other.safetensors.tmp." + dead), "another path's");
  io::write_file_atomic(path, "new");
  EXPECT_EQ(contents(path), "new");
  EXPECT_FALSE(fs::exists(path + ".tmp." + dead));
  EXPECT_TRUE(fs::exists(path + ".tmp." + alive));
  EXPECT_TRUE(fs::exists(path + ".tmp.x" + dead));
  EXPECT_TRUE(fs::exists(d.file("other.safetensors.tmp." + dead)));
}

// A child process that writes `path` and stops in the middle of it until the parent says so.
class ChildWriter {
 public:
  explicit ChildWriter(const std::string& path) {
    int ready[2], go[2];
    EXPECT_EQ(::pipe(ready), 0);
    EXPECT_EQ(::pipe(go), 0);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(ready[0]);
      ::close(go[1]);
      int status = 0;
      try {
        io::write_file_atomic(path, [&](std::ostream& out) {
          out << "child";
          char c = 'r';
          if (::write(ready[1], &c, 1) != 1 || ::read(go[0], &c, 1) < 0) status = 3;
        });
      } catch (...) {
        status = 2;
      }
      ::_exit(status);
    }
    ::close(ready[1]);
    ::close(go[0]);
    go_ = go[1];
    char c;
    EXPECT_EQ(::read(ready[0], &c, 1), 1);  // the child is writing
    ::close(ready[0]);
  }
  pid_t pid() const { return pid_; }
  // Lets the child finish its write; returns its exit status.
  int finish() {
    ::close(go_);
    int status = -1;
    ::waitpid(pid_, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

 private:
  pid_t pid_;
  int go_;
};

TEST(OutputFile, TwoProcessesCannotWriteOnePath) {
  TempDir d;
  const std::string path = d.file("ck.safetensors");
  ChildWriter child(path);
  const std::string pid = std::to_string(child.pid());
  std::string e = error_of([&] { io::write_file_atomic(path, "parent"); });
  EXPECT_NE(e.find("cannot write " + path + ": it is being written by another process (pid " + pid +
                   ", per " + path + ".lock)"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("wait for that run to end, or choose another path"), std::string::npos) << e;
  e = error_of([&] { io::check_output_path(path, "--save"); });
  EXPECT_NE(e.find("--save " + path + " is being written by another process (pid " + pid),
            std::string::npos)
      << e;
  EXPECT_EQ(child.finish(), 0);
  EXPECT_EQ(contents(path), "child");
  EXPECT_FALSE(fs::exists(path + ".lock"));  // the write's claim ended with it
  io::write_file_atomic(path, "parent");
  EXPECT_EQ(contents(path), "parent");
}

TEST(OutputFile, ALockLeftByAKilledProcessDoesNotBlock) {
  TempDir d;
  const std::string path = d.file("ck.safetensors");
  const pid_t pid = ::fork();
  if (pid == 0) {
    try {
      io::check_output_path(path, "--save");  // claimed until the process ends...
    } catch (...) {
      ::_exit(2);
    }
    ::_exit(0);  // ...which it does without cleaning up, as if killed
  }
  int status = -1;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(contents(path + ".lock"), std::to_string(pid) + "\n");
  io::write_file_atomic(path, "after");
  EXPECT_EQ(contents(path), "after");
  EXPECT_FALSE(fs::exists(path + ".lock"));
}

// A file of the user's at PATH.lock is not a lock: refused, and left as it was (a claim would
// truncate it and remove it when done). An empty one is taken (a lock being made).
TEST(OutputFile, AUsersFileAtTheLockPathIsNeitherTruncatedNorRemoved) {
  TempDir d;
  const std::string path = d.file("metrics.json");
  write_raw(path + ".lock", "my notes\n");
  for (const std::function<void()>& write :
       {std::function<void()>([&] { io::write_file_atomic(path, "x"); }),
        std::function<void()>([&] { io::check_output_path(path, "--metrics-json"); })}) {
    const std::string e = error_of(write);
    EXPECT_NE(e.find(path + ".lock exists and is not a lock file Mantissa made"), std::string::npos)
        << e;
    EXPECT_NE(e.find("rename or remove " + path + ".lock"), std::string::npos) << e;
    EXPECT_EQ(contents(path + ".lock"), "my notes\n");
    EXPECT_FALSE(fs::exists(path));
  }
  write_raw(path + ".lock", "12345678901234567890123456\n");  // digits, but too long for an id
  EXPECT_NE(error_of([&] { io::write_file_atomic(path, "x"); }).find("not a lock file"),
            std::string::npos);
  write_raw(path + ".lock", "");
  io::write_file_atomic(path, "x");
  EXPECT_EQ(contents(path), "x");
}

// Outputs of one command that name one file are refused, however the paths are spelled.
TEST(OutputFile, OutputsOfOneCommandMustBeDistinctFiles) {
  TempDir d;
  fs::create_directory(d.file("sub"));
  const std::string a = d.file("a.json");
  const std::string e = error_of([&] {
    io::check_distinct_outputs({{"--save", d.file("b.st")},
                                {"--metrics-json", a},
                                {"--report", ""},
                                {"--json", d.file("sub") + "/../a.json"}});
  });
  EXPECT_NE(e.find("--metrics-json " + a + " and --json " + d.file("sub") +
                   "/../a.json name the same file: one would replace the other"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("give each output its own path"), std::string::npos) << e;
  // A directory reached through a link is the same directory; a link to a file is a file of its
  // own (a write replaces the link).
  fs::create_directory_symlink(d.file("sub"), d.file("alias"));
  EXPECT_NE(error_of([&] {
              io::check_distinct_outputs(
                  {{"--save", d.file("sub") + "/c.st"}, {"--report", d.file("alias") + "/c.st"}});
            }).find("name the same file"),
            std::string::npos);
  write_raw(a, "{}");
  fs::create_symlink(a, d.file("link.json"));
  io::check_distinct_outputs({{"--save", a}, {"--report", d.file("link.json")}});
  io::check_distinct_outputs(
      {{"--save", a}, {"--report", d.file("a.html")}, {"--json", ""}, {"--html", ""}});
}

}  // namespace
}  // namespace mantissa

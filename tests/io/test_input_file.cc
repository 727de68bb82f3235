// Input files: only regular files are read (checked on the open descriptor), sizes are bounded,
// reads are exact, and gzip content is inflated only as far as it is read.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "mantissa/io/input_file.h"
#include "support/errors.h"
#include "support/files.h"

namespace mantissa {
namespace {

using testing::error_of;
using testing::TempDir;
using testing::write_gz;
using testing::write_raw;

std::string read_gz_file(const std::string& path) {
  const io::InputFile f(path, "test file", 1 << 20, "");
  return f.read_all();
}

TEST(InputFile, ReadsARegularFileExactly) {
  TempDir d;
  write_raw(d.file("a"), "hello world");
  const io::InputFile f(d.file("a"), "test file", 100, "");
  EXPECT_EQ(f.size(), 11u);
  EXPECT_EQ(f.read_all(), "hello world");
  char buf[5];
  f.read_at(6, buf, 5);
  EXPECT_EQ(std::string(buf, 5), "world");
  EXPECT_NE(error_of([&] { f.read_at(8, buf, 5); }).find("ended at byte 11, before the 13"),
            std::string::npos);
}

TEST(InputFile, RefusesWhatIsNotARegularFile) {
  TempDir d;
  std::filesystem::create_directory(d.file("dir"));
  std::string e = error_of([&] { io::InputFile(d.file("dir"), "op list", 100, ""); });
  EXPECT_NE(e.find("op list " + d.file("dir") + " is a directory, not a regular file"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("HINT: give the path of a regular file"), std::string::npos) << e;
  // A FIFO is refused at once: opening it does not wait for a writer.
  ASSERT_EQ(::mkfifo(d.file("fifo").c_str(), 0600), 0);
  e = error_of([&] { io::InputFile(d.file("fifo"), "IDX file", 100, ""); });
  EXPECT_NE(e.find("is a FIFO (named pipe), not a regular file"), std::string::npos) << e;
  e = error_of([&] { io::InputFile("/dev/null", "checkpoint", 100, ""); });
  EXPECT_NE(e.find("checkpoint /dev/null is a character device"), std::string::npos) << e;
  // A symbolic link to a device is the device.
  std::filesystem::create_symlink("/dev/zero", d.file("zero"));
  e = error_of([&] { io::InputFile(d.file("zero"), "checkpoint", 100, ""); });
  EXPECT_NE(e.find("is a character device"), std::string::npos) << e;
  const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string sock = d.file("sock");
  ASSERT_LT(sock.size(), sizeof addr.sun_path);
  std::memcpy(addr.sun_path, sock.c_str(), sock.size() + 1);
  ASSERT_EQ(::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  e = error_of([&] { io::InputFile(sock, "IDX file", 100, ""); });
  ::close(s);
  EXPECT_NE(e.find("is a socket, not a regular file"), std::string::npos) << e;
}

TEST(InputFile, NamesAMissingFileAndTheLimit) {
  TempDir d;
  const std::string e =
      error_of([&] { io::InputFile(d.file("absent"), "IDX file", 100, "pass --data-dir"); });
  EXPECT_NE(e.find("cannot find IDX file " + d.file("absent")), std::string::npos) << e;
  EXPECT_NE(e.find("HINT: pass --data-dir"), std::string::npos) << e;
  write_raw(d.file("big"), std::string(101, 'x'));
  EXPECT_NE(error_of([&] {
              io::InputFile(d.file("big"), "op list", 100, "");
            }).find("op list " + d.file("big") + " has 101 bytes; the limit is 100"),
            std::string::npos);
  EXPECT_EQ(error_of([&] { io::InputFile(d.file("big"), "op list", 101, ""); }), "");
}

TEST(InputFile, AFileThatShrinksWhileReadIsAnError) {
  TempDir d;
  write_raw(d.file("a"), std::string(1000, 'x'));
  const io::InputFile f(d.file("a"), "test file", 1000, "");
  ASSERT_EQ(::truncate(d.file("a").c_str(), 10), 0);
  const std::string e = error_of([&] { f.read_all(); });
  EXPECT_NE(e.find("ended at byte 10, before the 1000 it had when opened"), std::string::npos) << e;
}

TEST(ContentReader, ReadsRawContent) {
  TempDir d;
  write_raw(d.file("a"), "abcdef");
  const io::InputFile f(d.file("a"), "test file", 100, "");
  io::ContentReader in(f);
  EXPECT_FALSE(in.compressed());
  EXPECT_EQ(in.declared_size(), 6u);
  EXPECT_EQ(in.max_size(), 6u);
  char buf[8];
  in.read_exact(buf, 4, "");
  EXPECT_EQ(std::string(buf, 4), "abcd");
  EXPECT_FALSE(in.at_end());
  EXPECT_EQ(in.read(buf, 8), 2u);
  EXPECT_EQ(std::string(buf, 2), "ef");
  EXPECT_TRUE(in.at_end());
  EXPECT_EQ(in.position(), 6u);
}

TEST(ContentReader, InflatesGzipAsItIsRead) {
  TempDir d;
  std::string content;
  for (int i = 0; i < 300000; ++i) content.push_back(static_cast<char>(i * 7 % 251));
  ASSERT_TRUE(write_gz(d.file("a.gz"), content));
  const io::InputFile f(d.file("a.gz"), "test file", 1 << 20, "");
  io::ContentReader in(f);
  EXPECT_TRUE(in.compressed());
  EXPECT_EQ(in.declared_size(), content.size());  // the trailer's length
  EXPECT_EQ(in.max_size(), f.size() * 1032);
  std::string got(content.size(), '\0');
  in.read_exact(got.data(), 10, "");
  EXPECT_FALSE(in.at_end());
  EXPECT_EQ(in.position(), 10u);
  in.read_exact(got.data() + 10, got.size() - 10, "");
  EXPECT_EQ(got, content);
  EXPECT_TRUE(in.at_end());
  const std::string e = error_of([&] { in.read_exact(got.data(), 1, "expected one more"); });
  EXPECT_NE(e.find("ends after 300000 bytes of decompressed content; expected one more"),
            std::string::npos)
      << e;
}

TEST(ContentReader, ReadsOnlyWhatIsAskedOfABrokenGzipFile) {
  // 10 MB of zeros with a damaged checksum: the start reads fine (nothing past it is inflated),
  // the whole fails at the end with zlib's reason.
  TempDir d;
  ASSERT_TRUE(write_gz(d.file("z.gz"), std::string(10 << 20, '\0')));
  std::string bytes = read_gz_file(d.file("z.gz"));
  bytes[bytes.size() - 8] ^= 1;  // the CRC-32
  write_raw(d.file("z.gz"), bytes);
  const io::InputFile f(d.file("z.gz"), "test file", 1 << 20, "");
  io::ContentReader in(f);
  std::vector<char> buf(1 << 16);
  in.read_exact(buf.data(), buf.size(), "");
  std::string e;
  for (int i = 0; i < 200 && e.empty(); ++i) e = error_of([&] { in.read(buf.data(), buf.size()); });
  EXPECT_NE(
      e.find("test file " + d.file("z.gz") + " is not valid gzip data (incorrect data check)"),
      std::string::npos)
      << e;
}

TEST(ContentReader, GzipFaultsAreNamed) {
  TempDir d;
  ASSERT_TRUE(write_gz(d.file("a.gz"), std::string(5000, 'a')));
  const std::string whole = read_gz_file(d.file("a.gz"));
  auto error_reading = [&](const std::string& bytes) {
    write_raw(d.file("b.gz"), bytes);
    const io::InputFile f(d.file("b.gz"), "IDX file", 1 << 20, "");
    io::ContentReader in(f);
    std::string all(10000, '\0');
    return error_of([&] { in.read(all.data(), all.size()); });
  };
  EXPECT_NE(error_reading(whole.substr(0, whole.size() - 3)).find("is truncated"),
            std::string::npos);
  EXPECT_NE(error_reading(whole + "junk").find("has data after the end of its gzip stream"),
            std::string::npos);
  EXPECT_NE(error_reading(whole + whole).find("has data after the end of its gzip stream"),
            std::string::npos);
  std::string header = whole;
  header[2] = 9;  // not deflate
  EXPECT_NE(error_reading(header).find("is not valid gzip data"), std::string::npos);
  EXPECT_EQ(error_reading(whole), "");
}

}  // namespace
}  // namespace mantissa

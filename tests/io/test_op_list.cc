// Op-list files (--autocast-lower-list, --autocast-fp32-list): read as validated input files, so a
// directory or a special file is an error instead of an empty list, and a huge token is not
// echoed whole.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <string>
#include <vector>

#include "mantissa/ops/autocast.h"
#include "support/errors.h"
#include "support/files.h"

namespace mantissa {
namespace {

using testing::error_of;
using testing::TempDir;
using testing::write_raw;

TEST(OpListFile, ReadsOneNamePerLine) {
  TempDir d;
  write_raw(d.file("ops.txt"), "# ops in 16 bits\r\nconv2d\n  linear  # matrix ops\n\nrelu");
  EXPECT_EQ(ops::read_op_list(d.file("ops.txt")),
            (std::vector<std::string>{"conv2d", "linear", "relu"}));
  write_raw(d.file("empty.txt"), "");
  EXPECT_EQ(ops::read_op_list(d.file("empty.txt")), std::vector<std::string>{});
}

TEST(OpListFile, ADirectoryOrSpecialFileIsNotAnEmptyList) {
  TempDir d;
  std::filesystem::create_directory(d.file("lists"));
  std::string e = error_of([&] { ops::read_op_list(d.file("lists")); });
  EXPECT_NE(e.find("op list " + d.file("lists") + " is a directory, not a regular file"),
            std::string::npos)
      << e;
  ASSERT_EQ(::mkfifo(d.file("fifo").c_str(), 0600), 0);
  e = error_of([&] { ops::read_op_list(d.file("fifo")); });
  EXPECT_NE(e.find("is a FIFO (named pipe), not a regular file"), std::string::npos) << e;
  e = error_of([&] { ops::read_op_list(d.file("missing.txt")); });
  EXPECT_NE(e.find("cannot find op list " + d.file("missing.txt")), std::string::npos) << e;
}

TEST(OpListFile, HugeTokensAreNotEchoedWhole) {
  TempDir d;
  // One token of 1000 bytes: not an op name, cut in the message.
  write_raw(d.file("long.txt"), "linear\n" + std::string(1000, 'z') + "\n");
  std::string e = error_of([&] { ops::read_op_list(d.file("long.txt")); });
  EXPECT_NE(e.find("line 2: '" + std::string(64, 'z') + "... (1000 bytes)' is not an op name"),
            std::string::npos)
      << e;
  EXPECT_LT(e.size(), 300u);
  write_raw(d.file("two.txt"), "conv2d linear" + std::string(1000, ' ') + "x\n");
  e = error_of([&] { ops::read_op_list(d.file("two.txt")); });
  EXPECT_NE(e.find("line 1: 'conv2d linear       "), std::string::npos) << e;
  EXPECT_LT(e.size(), 300u);
  // A file far larger than any op list is refused before it is read.
  write_raw(d.file("big.txt"), std::string((1 << 20) + 1, 'a'));
  e = error_of([&] { ops::read_op_list(d.file("big.txt")); });
  EXPECT_NE(e.find("op list " + d.file("big.txt") + " has 1048577 bytes; the limit is 1048576"),
            std::string::npos)
      << e;
  // Bytes that are not text are shown escaped.
  write_raw(d.file("bin.txt"), std::string("a\x1b[2Jb c\n"));
  e = error_of([&] { ops::read_op_list(d.file("bin.txt")); });
  EXPECT_NE(e.find("'a\\x1b[2Jb c' is not one op name"), std::string::npos) << e;
}

}  // namespace
}  // namespace mantissa

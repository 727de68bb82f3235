// Internal to io: what a file that is not a regular file is, in words, for the errors of the
// readers and writers that refuse it.
#pragma once

#include <sys/stat.h>

namespace mantissa::io::detail {

// "a directory", "a FIFO (named pipe)", ... for st_mode `mode`.
inline const char* file_kind(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "a special file";
}

}  // namespace mantissa::io::detail

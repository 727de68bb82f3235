// Writing output files (checkpoints, metrics, reports) so that a reader never sees a half-written
// file: everything goes to a temporary file in the target's directory, which is renamed over the
// target only once complete. Every file Mantissa writes goes through here.
#pragma once

#include <functional>
#include <iosfwd>
#include <string>

namespace mantissa::io {

// Checks that `path` can be written (its directory exists and is writable, it is not a
// directory), naming `flag` in the error: output files are checked before any work starts, so a
// run does not end in a write error. An empty path passes.
void check_output_path(const std::string& path, const char* flag);

// Writes a file atomically: `write` fills a temporary file in the same directory (`path.tmp.PID`),
// which is renamed over `path` once it is complete. A failed write (disk full) removes the
// temporary file and throws mantissa::Error; `path` keeps its old contents.
void write_file_atomic(const std::string& path, const std::function<void(std::ostream&)>& write);
void write_file_atomic(const std::string& path, const std::string& text);

}  // namespace mantissa::io

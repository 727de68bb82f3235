// Writing output files (checkpoints, metrics, reports) so that a reader never sees a half-written
// file and nothing but a regular file is ever replaced. Every file Mantissa writes goes through
// here:
//  - the data goes to a temporary file in the target's directory, `PATH.tmp.PID`, which is flushed
//    to disk (fsync) and renamed over the target only once complete; the directory is then
//    synced too, so after a crash the target is the old file or the new one, never a mix;
//  - a target that exists and is not a regular file (a directory, FIFO, device node, socket; a
//    symbolic link is followed) is refused, never replaced; a link to a regular file is replaced
//    by the new file (the file it pointed to is left as it was);
//  - temporaries of this naming left by a process that no longer runs (killed during a write) are
//    removed by the next write of the same path;
//  - a process that checks a path (check_output_path, at the start of a run) claims it until it
//    exits, and one that writes a path it has not checked claims it for that write: an advisory
//    lock (flock) on `PATH.lock`, a file beside the target holding the process id, removed when
//    the claim ends (at the end of the write, or when the process ends normally). A path another
//    running process has claimed is refused, naming that process, so two runs writing one
//    checkpoint fail clearly instead of both reporting success. A `PATH.lock` that holds anything
//    but a process id (a file of the user's) is refused, never truncated or removed.
// Threads of one process must not write the same path at the same time.
#pragma once

#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

namespace mantissa::io {

// Checks that `path` can be written (its directory exists and is writable; it does not exist or is
// a regular file) and claims it for this process, naming `flag` in the error: output files are
// checked before any work starts, so a run does not end in a write error. An empty path passes.
void check_output_path(const std::string& path, const char* flag);

// One output of a command: the flag that names it ("--save") and its path (empty: not written).
struct OutputPath {
  std::string flag;
  std::string path;
};
// Refuses outputs of one command that name the same file (the same directory, however it is
// reached, and the same name; a symbolic link to a file is a name of its own, which a write
// replaces): one would replace the other when the run writes them. Call it with every file the
// command writes, before any work starts.
void check_distinct_outputs(const std::vector<OutputPath>& outputs);

// Writes a file atomically: `write` fills the temporary file, which is renamed over `path` once it
// is complete. A failed write (disk full), an exception from `write`, or a path that is not
// writable (as check_output_path says) removes the temporary file and throws mantissa::Error;
// `path` keeps its old contents.
void write_file_atomic(const std::string& path, const std::function<void(std::ostream&)>& write);
void write_file_atomic(const std::string& path, const std::string& text);

}  // namespace mantissa::io

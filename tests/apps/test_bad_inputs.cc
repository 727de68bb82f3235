// The catalogue of bad inputs: the program (its command dispatch, as main runs it) given a bad
// flag, file or path of each kind a hostile user tried. Each row holds the command line, the exit
// status README promises and a phrase the one-line message must hold: the flag or file it names and
// the fix. Signals and kill -9 are tested on the program itself (cli.tests, cli.crash_safety).
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "mantissa/cli.h"
#include "mantissa/io/safetensors.h"
#include "support/files.h"

namespace mantissa {
namespace {

struct Ended {
  int status = 0;
  std::string err;
};

Ended run(const std::vector<std::string>& args) {
  std::istringstream in;
  std::ostringstream out, err;
  Ended r;
  r.status = cli::run_command(args, in, out, err);
  r.err = err.str();
  return r;
}

void write(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// A safetensors file whose header is `header` (JSON text) and holds no data.
std::string safetensors_bytes(const std::string& header) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return bytes + header;
}

struct BadInput {
  const char* what;                  // the class of bad input
  std::vector<std::string> args;     // the command line; {D} is the fixtures' directory
  int status;                        // the exit status README promises
  std::vector<std::string> phrases;  // each in the message, {D} replaced
};

TEST(BadInputs, EachIsRefusedWithItsStatusAndAMessageNamingTheFix) {
  const testing::TempDir dir;
  const std::string d = dir.path();
  const std::vector<std::string> tiny = {"train",     "--model",          "lenet5", "--dataset",
                                         "synthetic", "--synthetic-size", "32",     "--image-size",
                                         "16",        "--batch-size",     "16",     "--no-progress",
                                         "--no-eval", "--threads",        "1"};
  // Fixtures: a checkpoint of the tiny run, damaged copies of it, special files and bad files.
  std::vector<std::string> save = tiny;
  save.insert(save.end(), {"--save", d + "/good.safetensors"});
  ASSERT_EQ(run(save).status, cli::kExitOk);
  const io::SafetensorsFile good = io::load_safetensors(d + "/good.safetensors");
  // The same run under dynamic loss scaling, whose checkpoint holds the scaler's state.
  std::vector<std::string> save_scaled = tiny;
  save_scaled.insert(save_scaled.end(),
                     {"--loss-scaling", "dynamic", "--save", d + "/good_scaled.safetensors"});
  ASSERT_EQ(run(save_scaled).status, cli::kExitOk);
  const io::SafetensorsFile good_scaled = io::load_safetensors(d + "/good_scaled.safetensors");
  const auto damaged = [&](const std::string& name, std::map<std::string, std::string> edits,
                           bool drop_state = false, const io::SafetensorsFile* from = nullptr) {
    const io::SafetensorsFile& source = from ? *from : good;
    std::map<std::string, std::string> m = source.metadata;
    for (auto& [k, v] : edits) m[k] = v;
    std::vector<std::pair<std::string, Tensor>> ts;
    bool dropped = false;
    for (auto& [n, t] : source.tensors) {
      if (drop_state && !dropped && n.rfind("optimizer.", 0) == 0) {
        dropped = true;
        continue;
      }
      ts.emplace_back(n, t);
    }
    io::save_safetensors(d + "/" + name, ts, m);
  };
  damaged("step_negative.safetensors", {{"step", "-1"}});
  damaged("step_huge.safetensors", {{"step", "9223372036854775807"}});
  damaged("geometry.safetensors", {{"image_size", "16384"}});
  damaged("lost_state.safetensors", {}, /*drop_state=*/true);
  damaged("scaler_type.safetensors", {{"loss_scaler", "{\"dynamic\": \"yes\"}"}}, false,
          &good_scaled);
  write(d + "/wrong_type.safetensors", safetensors_bytes("{\"w\": {\"dtype\": 5, \"shape\": [1], "
                                                         "\"data_offsets\": [0, 4]}}"));
  write(d + "/truncated.safetensors", safetensors_bytes("{\"w\": {\"dtype\": \"F32\", \"shape\": "
                                                        "[1000], \"data_offsets\": [0, 4000]}}"));
  write(d + "/huge_token.txt", "matmul\n" + std::string(100000, 'x') + "\n");
  ASSERT_EQ(::mkfifo((d + "/fifo").c_str(), 0600), 0);
  std::filesystem::create_directories(d + "/a_directory");

  const std::vector<BadInput> catalogue = {
      // Flags and values.
      {"unknown option", {"train", "--fast"}, 2, {"unknown option '--fast'", "--help"}},
      {"not a number", {"train", "--lr", "nan"}, 2, {"--lr 'nan'"}},
      {"negative factor",
       {"train", "--lr-schedule", "step", "--lr-gamma", "-0.5"},
       2,
       {"--lr-gamma -0.5 is not a positive factor"}},
      {"--threads beyond any machine, train as peak",
       {"train", "--threads", "5000"},
       2,
       {"--threads must be an integer from 1 to 1024"}},
      {"--threads beyond any machine, peak",
       {"peak", "--threads", "5000"},
       2,
       {"--threads must be an integer from 1 to 1024"}},
      {"an epoch count whose step total wraps",
       {"{TINY}", "--epochs", "3074457345618258603"},
       2,
       {"--epochs 3074457345618258603 of 2 batches is more than", "lower --epochs"}},
      {"a count past 2^62",
       {"train", "--epochs", "99999999999999999999"},
       2,
       {"--epochs 99999999999999999999 is too large"}},
      {"examples of a call that overflow",
       {"train", "--batch-size", "4611686018427387904", "--gradient-accumulation", "4"},
       2,
       {"examples a call is more than"}},
      {"an empty value", {"train", "--save", ""}, 2, {"--save needs a value"}},
      {"a huge token",
       {"train", "--model", std::string(1 << 20, 'm')},
       2,
       {"unknown model 'mmmm", "... (1048576 bytes)"}},
      // Files.
      {"an op list that is a directory",
       {"{TINY}", "--precision", "16-mixed", "--autocast-lower-list", "{D}/a_directory"},
       2,
       {"{D}/a_directory is a directory, not a regular file"}},
      {"an op list with a huge token",
       {"{TINY}", "--precision", "16-mixed", "--autocast-lower-list", "{D}/huge_token.txt"},
       2,
       {"line 2: 'xxxx", "bytes)' is not an op name", "one op name per line"}},
      {"weights that are a FIFO",
       {"{TINY}", "--init-from", "{D}/fifo"},
       2,
       {"{D}/fifo is a FIFO (named pipe), not a regular file", "give the path of a regular file"}},
      {"a safetensors field of the wrong JSON type",
       {"{TINY}", "--init-from", "{D}/wrong_type.safetensors"},
       2,
       {"wrong_type.safetensors", "dtype"}},
      {"a truncated safetensors file",
       {"{TINY}", "--init-from", "{D}/truncated.safetensors"},
       2,
       {"truncated.safetensors"}},
      {"a missing checkpoint",
       {"eval", "--checkpoint", "{D}/none.safetensors"},
       2,
       {"cannot find safetensors file {D}/none.safetensors", "check the path"}},
      {"resume from a negative step",
       {"{TINY}", "--resume", "{D}/step_negative.safetensors"},
       2,
       {"metadata 'step' is -1, outside [0, ", "use an intact checkpoint"}},
      {"resume from a huge step",
       {"{TINY}", "--resume", "{D}/step_huge.safetensors"},
       2,
       {"metadata 'step' is 9223372036854775807, outside"}},
      {"resume without the optimizer state the run needs",
       {"{TINY}", "--resume", "{D}/lost_state.safetensors"},
       2,
       {"optimizer state tensors it was written with", "--init-from"}},
      {"checkpoint JSON of the wrong type",
       {"{TINY}", "--resume", "{D}/scaler_type.safetensors", "--loss-scaling", "dynamic"},
       2,
       {"loss-scaler state is not valid", "the file is damaged"}},
      {"checkpoint geometry larger than the file",
       {"eval", "--checkpoint", "{D}/geometry.safetensors"},
       2,
       {"describes a model larger than the tensors the file holds"}},
      // Paths written.
      {"--save a directory",
       {"{TINY}", "--save", "{D}/a_directory"},
       2,
       {"{D}/a_directory", "directory"}},
      {"--save a FIFO", {"{TINY}", "--save", "{D}/fifo"}, 2, {"{D}/fifo", "FIFO"}},
      {"--metrics-json in a missing directory",
       {"{TINY}", "--metrics-json", "{D}/no/m.json"},
       2,
       {"{D}/no", "does not exist"}},
      // Memory.
      {"past --memory-budget",
       {"{TINY}", "--memory-budget", "10KiB"},
       3,
       {"budget", "raise the memory budget"}},
      {"memory past --memory-budget",
       {"memory", "--model", "lenet5", "--batch-size", "4", "--memory-budget", "10KiB"},
       3,
       {}},
  };
  const auto expand = [&](const std::string& s) {
    std::string out = s;
    for (size_t at; (at = out.find("{D}")) != std::string::npos;) out.replace(at, 3, d);
    return out;
  };
  for (const BadInput& b : catalogue) {
    std::vector<std::string> args;
    for (const std::string& a : b.args) {
      if (a == "{TINY}")
        args.insert(args.end(), tiny.begin(), tiny.end());
      else
        args.push_back(expand(a));
    }
    const Ended r = run(args);
    EXPECT_EQ(r.status, b.status) << b.what << ": " << r.err.substr(0, 400);
    EXPECT_EQ(r.err.find("internal error"), std::string::npos) << b.what;
    EXPECT_LT(r.err.size(), 4000u) << b.what;
    for (const std::string& p : b.phrases)
      EXPECT_NE(r.err.find(expand(p)), std::string::npos)
          << b.what << ": '" << expand(p) << "' not in: " << r.err.substr(0, 400);
  }
}

}  // namespace
}  // namespace mantissa

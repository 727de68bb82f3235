// The program's command lines value by value: every numeric flag of every command refuses zero
// (where it means nothing), negative, huge, NaN, infinite, empty and malformed values, naming
// the flag, either when parsed or when the configuration is resolved; and what ends a command maps
// to the exit statuses README promises.
#include <gtest/gtest.h>

#include <new>
#include <sstream>
#include <string>
#include <vector>

#include "mantissa/autograd/autograd.h"
#include "mantissa/cli.h"
#include "mantissa/core/error.h"
#include "mantissa/train/config.h"
#include "support/errors.h"

namespace mantissa {
namespace {

using cli::UsageError;

// The message of the first error that parsing `args` (and resolving what they set) raises: a
// UsageError or a mantissa::Error. "" when the command line is accepted.
std::string refusal(const std::string& command, std::vector<std::string> args) {
  try {
    if (command == "train") {
      // The values alone: output paths are another test's (nothing is claimed here).
      train::resolve(cli::parse_train_args(args).config, /*checks_outputs=*/false);
    } else if (command == "memory") {
      const cli::MemoryArgs m = cli::parse_memory_args(args);
      for (const std::string& p : m.precisions) {
        train::TrainConfig c = m.config;
        c.precision = p;
        train::validate(c);
      }
    } else if (command == "eval") {
      args.insert(args.begin(), {"--checkpoint", "c.safetensors"});
      cli::parse_eval_args(args);
    } else if (command == "peak") {
      cli::parse_peak_args(args);
    } else {
      ADD_FAILURE() << "no command " << command;
    }
  } catch (const UsageError& e) {
    return e.what();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

struct NumericFlag {
  const char* command;
  const char* flag;
  bool integer;
  bool zero_ok;  // 0 is a meaningful value
};

// Every numeric flag of every command that takes a configuration.
const NumericFlag kNumericFlags[] = {
    {"train", "--image-size", true, false},
    {"train", "--train-limit", true, false},
    {"train", "--test-limit", true, false},
    {"train", "--synthetic-size", true, false},
    {"train", "--batch-size", true, false},
    {"train", "--eval-batch-size", true, false},
    {"train", "--epochs", true, false},
    {"train", "--max-steps", true, false},
    {"train", "--warmup-steps", true, true},
    {"train", "--lr-step-size", true, false},
    {"train", "--seed", true, true},
    {"train", "--threads", true, false},
    {"train", "--prefetch", true, true},
    {"train", "--workers", true, false},
    {"train", "--gradient-accumulation", true, false},
    {"train", "--device-iterations", true, false},
    {"train", "--output-return-period", true, false},
    {"train", "--numerics-every", true, false},
    {"train", "--loss-scale-growth-interval", true, false},
    {"train", "--loss-scale-hysteresis", true, false},
    {"train", "--lr", false, false},
    {"train", "--weight-decay", false, true},
    {"train", "--momentum", false, true},
    {"train", "--beta1", false, true},
    {"train", "--beta2", false, true},
    {"train", "--eps", false, true},
    {"train", "--max-grad-norm", false, true},
    {"train", "--lr-gamma", false, false},
    {"train", "--loss-scale-init", false, false},
    {"train", "--loss-scale-min", false, false},
    {"train", "--loss-scale-max", false, false},
    {"memory", "--batch-size", true, false},
    {"memory", "--image-size", true, false},
    {"memory", "--gradient-accumulation", true, false},
    {"memory", "--device-iterations", true, false},
    {"memory", "--threads", true, false},
    {"eval", "--test-limit", true, false},
    {"eval", "--batch-size", true, false},
    {"eval", "--threads", true, false},
    {"peak", "--threads", true, false},
    {"peak", "--seconds", false, false},
};

TEST(CliValues, EveryNumericFlagRefusesBadValuesNamingTheFlag) {
  const std::vector<std::string> bad = {"-1", "nan", "inf", "-inf", "1e999", "3x",
                                        "",   " 1",  "1 ",  "0x",   "1,5"};
  // Huge: past FP32 for numbers (the engine computes in FP32), past 2^62 for counts (past 2^64
  // for seeds); tiny: numbers that vanish in FP32.
  const std::vector<std::string> bad_numbers = {"1e39", "-3.5e38", "1e-46"};
  const std::vector<std::string> bad_integers = {"1.5", "1e3", "+-2", "99999999999999999999999",
                                                 "18446744073709551616"};
  int vanishing = 0;
  for (const NumericFlag& f : kNumericFlags) {
    std::vector<std::string> values = bad;
    if (f.integer) values.insert(values.end(), bad_integers.begin(), bad_integers.end());
    if (!f.integer) values.insert(values.end(), bad_numbers.begin(), bad_numbers.end());
    if (f.integer && std::string(f.flag) != "--seed") values.push_back("4611686018427387905");
    if (!f.zero_ok) values.push_back("0");
    for (const std::string& v : values) {
      for (const bool inline_value : {false, true}) {
        const std::vector<std::string> args =
            inline_value ? std::vector<std::string>{std::string(f.flag) + "=" + v}
                         : std::vector<std::string>{f.flag, v};
        const std::string message = refusal(f.command, args);
        EXPECT_NE(message.find(f.flag), std::string::npos)
            << "mantissa " << f.command << " " << f.flag << " '" << v << "': "
            << (message.empty() ? "accepted" : "refused without naming the flag: " + message);
        // A value that vanishes in FP32 is answered with the smallest one that does not (0 is
        // refused by some flags, so it is not offered).
        if (message.find("rounds to 0 in FP32") != std::string::npos) {
          ++vanishing;
          EXPECT_NE(message.find("(the smallest is 1.4e-45), the precision Mantissa computes in; "
                                 "give a value of at least 1.4e-45"),
                    std::string::npos)
              << f.flag << ": " << message;
        }
      }
    }
  }
  EXPECT_GT(vanishing, 0) << "1e-46 vanishes in FP32 for the number flags";
}

TEST(CliValues, AcceptsTheValuesItDocuments) {
  for (const NumericFlag& f : kNumericFlags) {
    const std::string v = f.zero_ok ? "0" : std::string(f.flag) == "--seconds" ? "0.5" : "1";
    std::vector<std::string> args = {f.flag, v};
    // A factor or a probability of 1 means something else: give each a value inside its range.
    const std::string name = f.flag;
    if (name == "--lr-gamma" || name == "--lr") args[1] = "0.5";
    // Each with the settings it acts under (others refuse it as having no effect).
    if (name == "--synthetic-size") args.insert(args.end(), {"--dataset", "synthetic"});
    if (name == "--lr-step-size" || name == "--lr-gamma")
      args.insert(args.end(), {"--lr-schedule", "step"});
    if (name == "--prefetch") args = {"--prefetch", "1", "--async-dataloader"};
    if (name == "--numerics-every") args.insert(args.end(), {"--numerics-report", "n.json"});
    if (name == "--output-return-period")
      args.insert(args.end(), {"--device-iterations", "2", "--output-mode", "every"});
    if (name.rfind("--loss-scale-", 0) == 0) args.insert(args.end(), {"--precision", "16-mixed"});
    if (name == "--loss-scale-max") args[1] = "1e6";  // above the initial scale
    EXPECT_EQ(refusal(f.command, args), "") << f.command << " " << f.flag << " " << args[1];
  }
  EXPECT_EQ(refusal("train", {"--seed", "18446744073709551615"}), "");     // any 64-bit seed
  EXPECT_EQ(refusal("train", {"--eps", "0x1p-30", "--lr", "1e-40"}), "");  // subnormal in FP32
}

// An option given twice keeps its last value, in either form.
TEST(CliValues, AnOptionGivenTwiceKeepsItsLastValue) {
  const train::TrainConfig c =
      cli::parse_train_args({"--lr", "0.1", "--lr=0.2", "--model", "lenet5", "--model=resnet18"})
          .config;
  EXPECT_EQ(c.lr, 0.2);
  EXPECT_EQ(c.model, "resnet18");
}

// Limits that depend on the flag: one rule for --threads in every command, and the ranges resolve
// knows.
TEST(CliValues, RangesOfEachFlag) {
  const std::string threads = "--threads must be an integer from 1 to 1024 (got '1025')";
  for (const char* command : {"train", "memory", "eval", "peak"})
    EXPECT_NE(refusal(command, {"--threads", "1025"}).find(threads), std::string::npos) << command;
  EXPECT_EQ(refusal("train", {"--threads", "1024"}), "");
  const std::pair<std::vector<std::string>, std::string> cases[] = {
      {{"--lr-schedule", "step", "--lr-gamma", "-0.5"}, "--lr-gamma -0.5 is not a positive factor"},
      {{"--beta1", "1"}, "--beta1 1 does not lie in [0, 1)"},
      {{"--beta2", "1.5"}, "--beta2 1.5 does not lie in [0, 1)"},
      {{"--image-size", "16385"}, "--image-size 16385 is not from 1 to 16384"},
      {{"--workers", "65"}, "--workers must lie in [1, 64]"},
      {{"--prefetch", "1000000"}, "--prefetch must lie in [0, 64]"},
      {{"--loss-scaling", "dynamic", "--loss-scale-max", "-8"}, "--loss-scale-max -8 is not a "},
      {{"--batch-size", "1048576", "--gradient-accumulation", "1048576", "--device-iterations",
        "1048576"},
       "--batch-size 1048576 x --gradient-accumulation 1048576 x --device-iterations 1048576 "
       "examples a call is more than 9007199254740992"},
      {{"--dataset", "synthetic", "--synthetic-size", "4611686018427387904", "--image-size", "32"},
       "--synthetic-size 4611686018427387904 images of 32x32 are more bytes than a dataset can "
       "hold"},
      {{"--save", ""}, "--save needs a value (got an empty one)"},
      {{"--keep-fp32", ","}, "--keep-fp32 needs a comma-separated list (got ',')"},
      {{"--epochs", "4611686018427387905"},
       "--epochs 4611686018427387905 is too large: give an integer from 1 to 4611686018427387904"},
  };
  for (const auto& [args, want] : cases)
    EXPECT_NE(refusal("train", args).find(want), std::string::npos)
        << want << "\ngot: " << refusal("train", args);
}

// An epoch count whose step total passes kMaxCount is refused when the epoch's length is known,
// instead of wrapping to a run that trains nothing.
TEST(CliValues, StepTotalsAreChecked) {
  train::TrainConfig c;
  c.epochs = int64_t{1} << 62;
  EXPECT_NE(testing::error_of([&] { train::total_steps(c, 6); })
                .find("--epochs 4611686018427387904 of 6 "
                      "batches is more than"),
            std::string::npos);
  c.epochs = 3074457345618258603;  // x 6 wraps to a small positive number in int64_t
  EXPECT_NE(testing::error_of([&] { train::total_steps(c, 6); }), "");
  c.epochs = 1000;
  c.gradient_accumulation = 3;
  EXPECT_EQ(train::total_steps(c, 10), 3000);
}

// What an error quotes of a user's text is an excerpt: a 1 MB token given to any flag that takes
// a name is refused in a message of bounded length that says how long the token was.
TEST(CliValues, ErrorsQuoteAnExcerptOfHugeTokens) {
  const std::string huge(1 << 20, 'x');
  const std::vector<std::vector<std::string>> lines = {
      {"train", "--model", huge},
      {"train", "--dataset", huge},
      {"train", "--optimizer", huge},
      {"train", "--precision", huge},
      {"train", "--half-type", huge},
      {"train", "--partials", huge},
      {"train", "--lr-schedule", huge},
      {"train", "--loss-scaling", huge},
      {"train", "--accumulation-reduction", huge},
      {"train", "--output-mode", huge},
      {"train", "--memory-budget", huge},
      {"train", "--lr", huge},
      {"train", "--epochs", huge},
      {"train", "--" + huge},
      {"memory", "--model", huge},
      {"eval", "--checkpoint", "c", "--threads", huge},
      {"peak", "--seconds", huge},
      {"cast", "--to", huge, "1"},
      {"cast", "--to", "f16", huge},
      {"formats", huge},
      {huge},
  };
  for (const std::vector<std::string>& line : lines) {
    std::istringstream in;
    std::ostringstream out, err;
    EXPECT_EQ(cli::run_command(line, in, out, err), cli::kExitBadInput)
        << line[0] << " " << line[1];
    EXPECT_LT(err.str().size(), 2000u) << line[0] << " " << line[1].substr(0, 40);
    EXPECT_NE(err.str().find("... (104857"), std::string::npos)
        << line[0] << " " << line[1].substr(0, 40) << ": " << err.str().substr(0, 300);
  }
}

int status_of(const std::exception_ptr& e, std::string* message = nullptr) {
  std::ostringstream err;
  const int status = cli::exit_status_of(e, err);
  if (message) *message = err.str();
  return status;
}

TEST(ExitStatus, EachKindOfEnd) {
  std::string m;
  EXPECT_EQ(status_of(std::make_exception_ptr(UsageError("--x is bad")), &m), cli::kExitBadInput);
  EXPECT_EQ(m, "mantissa: error: --x is bad\n");
  EXPECT_EQ(status_of(std::make_exception_ptr(Error("f.bin is damaged", "write it again")), &m),
            cli::kExitBadInput);
  EXPECT_EQ(m, "mantissa: error: f.bin is damaged (write it again)\n");
  EXPECT_EQ(status_of(std::make_exception_ptr(OutOfMemoryError("past the budget", "raise it",
                                                               /*over_budget=*/true))),
            cli::kExitOutOfMemory);
  EXPECT_EQ(status_of(std::make_exception_ptr(OutOfMemoryError("the system said no", "free"))),
            cli::kExitOutOfMemory);
  EXPECT_EQ(status_of(std::make_exception_ptr(std::bad_alloc()), &m), cli::kExitOutOfMemory);
  EXPECT_NE(m.find("out of memory: the system refused an allocation"), std::string::npos) << m;
  EXPECT_NE(m.find("HINT: lower the batch size"), std::string::npos) << m;
  EXPECT_EQ(status_of(std::make_exception_ptr(autograd::AnomalyError("nan in conv1", "fp32"))),
            cli::kExitAnomaly);
  EXPECT_EQ(status_of(std::make_exception_ptr(InternalError("x.cc:1: broken")), &m),
            cli::kExitFailure);
  EXPECT_NE(m.find("please report this as a bug"), std::string::npos) << m;
  EXPECT_EQ(status_of(std::make_exception_ptr(std::runtime_error("?"))), cli::kExitFailure);
}

TEST(ExitStatus, RunCommandReportsAndReturns) {
  std::istringstream in;
  std::ostringstream out, err;
  EXPECT_EQ(cli::run_command({"train", "--threads", "2000"}, in, out, err), cli::kExitBadInput);
  EXPECT_NE(err.str().find("--threads must be an integer from 1 to 1024"), std::string::npos);
  EXPECT_EQ(cli::run_command({"formats"}, in, out, err), cli::kExitOk);
  EXPECT_EQ(cli::run_command({}, in, out, err), cli::kExitBadInput);
}

}  // namespace
}  // namespace mantissa

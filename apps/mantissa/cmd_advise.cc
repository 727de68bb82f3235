// `mantissa advise`: what a precision will break, before training (train/advise.h).
#include <algorithm>
#include <iostream>
#include <map>
#include <ostream>
#include <string>

#include "mantissa/cli.h"
#include "mantissa/flags.h"
#include "mantissa/mantissa.h"

namespace mantissa::cli {
namespace {

constexpr const char* kAdviseUsage =
    "usage: mantissa advise --precision P [--model NAME] [options] [--json FILE] [--html FILE]\n"
    "                       [--verify K]\n"
    "Runs a short FP32 calibration on the real data and says, per layer, which weights,\n"
    "activations and gradients would overflow, flush to zero or be subnormal in P's 16-bit type,\n"
    "which weight updates would be lost to rounding, and which loss scales keep the gradients\n"
    "representable; then recommends what to keep in FP32, the loss scaling, FP16 or BF16 and\n"
    "--kahan, printed as the 'mantissa train' command to run (docs/advise.md).\n"
    "options:\n"
    "  --precision P         the precision to advise on: 16-mixed, bf16-mixed, 16-true,\n"
    "                        bf16-true, O1, O2, O3, 16.32, 16.16   --half-type fp16|bf16\n"
    "  --model NAME          tutorial-cnn (default), lenet5, resnet18, ...   --imagenet-stem\n"
    "  --init-from FILE      initial weights from a safetensors file with PyTorch names\n"
    "  --dataset NAME --data-dir DIR --image-size N --train-limit N --synthetic-size N\n"
    "  --batch-size N (default 12)   --seed N   --threads N\n"
    "  --optimizer NAME --lr X --weight-decay X   the run's optimizer (default adamw, 1e-3)\n"
    "  --steps N             FP32 calibration steps (default 20)\n"
    "  --verify K            train K steps each with 32-true, the recommendation and P from\n"
    "                        the same start, and print the loss gaps\n"
    "  --json FILE           the figures and the recommendation as JSON\n"
    "  --html FILE           a self-contained page (opens offline)\n";

}  // namespace

int run_advise(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  train::AdviseConfig a;
  train::TrainConfig& c = a.train;
  c.precision.clear();
  std::string json_path, html_path;
  bool help = false;
  const std::map<std::string, Flag> flags = {
      {"--help", switch_flag(help)},
      {"--precision", str_flag("--precision", c.precision)},
      {"--half-type", str_flag("--half-type", c.half_type)},
      {"--model", str_flag("--model", c.model)},
      {"--imagenet-stem", switch_flag(c.imagenet_stem)},
      {"--init-from", str_flag("--init-from", c.init_from)},
      {"--dataset", str_flag("--dataset", c.dataset)},
      {"--data-dir", str_flag("--data-dir", c.data_dir)},
      {"--image-size", int_flag("--image-size", c.image_size, 1)},
      {"--train-limit", int_flag("--train-limit", c.train_limit, 1)},
      {"--synthetic-size", int_flag("--synthetic-size", c.synthetic_size, 1)},
      {"--batch-size", int_flag("--batch-size", c.batch_size, 1)},
      {"--seed", Flag{true, [&c](const std::string& v) { c.seed = seed_value("--seed", v); }}},
      {"--threads", threads_flag(c.threads)},
      {"--optimizer", str_flag("--optimizer", c.optimizer)},
      {"--lr", num_flag("--lr", c.lr)},
      {"--weight-decay", opt_num_flag("--weight-decay", c.weight_decay)},
      {"--steps", int_flag("--steps", a.steps, 1)},
      {"--verify", int_flag("--verify", a.verify, 1)},
      {"--json", str_flag("--json", json_path)},
      {"--html", str_flag("--html", html_path)},
  };
  parse_flags(args, flags, "advise");
  if (help) {
    out << kAdviseUsage;
    return kExitOk;
  }
  if (c.precision.empty())
    throw UsageError(
        "'mantissa advise' needs --precision P, the precision to advise on (e.g. 16-mixed)");
  refuse_ranks("advise",
               "run it without mpirun: the calibration and verification run in one process");
  io::check_distinct_outputs({{"--json", json_path}, {"--html", html_path}});
  io::check_output_path(json_path, "--json");
  io::check_output_path(html_path, "--html");
  const train::Advice advice = train::advise(a, &err);
  std::optional<train::Verification> v;
  if (a.verify > 0) v = train::verify(a, advice);
  const train::Verification* vp = v ? &*v : nullptr;
  out << train::advice_text(advice, vp);
  if (!json_path.empty()) io::write_file_atomic(json_path, train::advice_json(advice, vp));
  if (!html_path.empty()) io::write_file_atomic(html_path, train::advice_html(a, advice, vp));
  return kExitOk;
}

}  // namespace mantissa::cli

#include "mantissa/train/config.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>

#include "mantissa/core/checked.h"
#include "mantissa/core/error.h"
#include "mantissa/core/memory.h"
#include "mantissa/data/datasets.h"
#include "mantissa/io/output_file.h"

namespace mantissa::train {
namespace {

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (auto& n : v) s += (s.empty() ? "" : ", ") + n;
  return s;
}

OptimizerKind parse_optimizer(const std::string& name) {
  if (name == "sgd") return OptimizerKind::kSgd;
  if (name == "adam") return OptimizerKind::kAdam;
  if (name == "adamw") return OptimizerKind::kAdamW;
  throw Error("unknown optimizer '" + excerpt(name) + "'", "choose --optimizer sgd, adam or adamw");
}

Reduction parse_reduction(const std::string& name) {
  if (name == "mean") return Reduction::kMean;
  if (name == "running") return Reduction::kRunning;
  if (name == "sum") return Reduction::kSum;
  throw Error("--accumulation-reduction '" + excerpt(name) + "' is not valid",
              "use mean, running or sum");
}

OutputMode parse_output_mode(const std::string& name) {
  if (name == "all") return OutputMode::kAll;
  if (name == "sum") return OutputMode::kSum;
  if (name == "final") return OutputMode::kFinal;
  if (name == "every") return OutputMode::kEvery;
  throw Error("--output-mode '" + excerpt(name) + "' is not valid",
              "use all, sum, final or every (with --output-return-period N)");
}

DType parse_allreduce_dtype(const std::string& name) {
  if (name == "fp32") return DType::f32;
  if (name == "fp16") return DType::f16;
  if (name == "bf16") return DType::bf16;
  throw Error("--allreduce-dtype '" + name + "' is not valid", "use fp32, fp16 or bf16");
}

// a * b for counts a run reaches, or nothing when the product passes kMaxCount.
std::optional<int64_t> count_product(int64_t a, int64_t b) {
  const std::optional<int64_t> p = checked_mul(a, b);
  if (!p || *p > kMaxCount) return std::nullopt;
  return p;
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// The values of the numeric settings, one by one and in the products the run computes from them:
// what the command line's parser cannot know (ranges that depend on the setting, factors that
// must be positive, counts whose product overflows).
void check_values(const TrainConfig& c) {
  MANTISSA_CHECK(
      c.threads >= 0 && c.threads <= kMaxThreads,
      "--threads " + std::to_string(c.threads) + " is not from 1 to " + std::to_string(kMaxThreads),
      "leave it out to use every core");
  MANTISSA_CHECK(c.image_size >= 0 && c.image_size <= kMaxImageSize,
                 "--image-size " + std::to_string(c.image_size) + " is not from 1 to " +
                     std::to_string(kMaxImageSize),
                 "e.g. --image-size 32 (the default of lenet5 and the ResNets)");
  const auto positive = [](double v) { return std::isfinite(v) && v > 0; };
  const auto non_negative = [](double v) { return std::isfinite(v) && v >= 0; };
  MANTISSA_CHECK(
      positive(c.lr_gamma), "--lr-gamma " + num(c.lr_gamma) + " is not a positive factor",
      "the step schedule multiplies the rate by it every --lr-step-size steps: e.g. 0.1");
  MANTISSA_CHECK(non_negative(c.eps), "--eps " + num(c.eps) + " is not a non-negative number",
                 "e.g. --eps 1e-8 (the default)");
  for (const auto& [flag, v] : {std::pair{"--beta1", c.beta1}, std::pair{"--beta2", c.beta2}})
    MANTISSA_CHECK(v >= 0 && v < 1, std::string(flag) + " " + num(v) + " does not lie in [0, 1)",
                   "e.g. --beta1 0.9 --beta2 0.999 (the defaults)");
  MANTISSA_CHECK(non_negative(c.max_grad_norm),
                 "--max-grad-norm " + num(c.max_grad_norm) + " is not a non-negative number",
                 "e.g. --max-grad-norm 1; leave it out for no clipping");
  for (const auto& [flag, v] : {std::pair{"--loss-scale-init", c.loss_scale_init},
                                std::pair{"--loss-scale-min", c.loss_scale_min},
                                std::pair{"--loss-scale-max", c.loss_scale_max}})
    MANTISSA_CHECK(!v || positive(*v),
                   std::string(flag) + " " + num(v.value_or(0)) + " is not a positive scale",
                   "a loss scale multiplies the loss: e.g. 1024");
  // The examples of one call of the training step.
  const std::optional<int64_t> per_step = count_product(c.batch_size, c.gradient_accumulation);
  MANTISSA_CHECK(per_step && count_product(*per_step, c.device_iterations),
                 "--batch-size " + std::to_string(c.batch_size) + " x --gradient-accumulation " +
                     std::to_string(c.gradient_accumulation) + " x --device-iterations " +
                     std::to_string(c.device_iterations) + " examples a call is more than " +
                     std::to_string(kMaxCount),
                 "lower them: one call takes all these examples at once");
  // The synthetic dataset's bytes: examples x channels x image size^2.
  if (c.dataset == "synthetic") {
    const int64_t side = c.effective_image_size();
    std::optional<int64_t> bytes = count_product(c.synthetic_size, side * side);
    if (bytes) bytes = count_product(*bytes, nn::default_in_channels(c.model));
    MANTISSA_CHECK(bytes,
                   "--synthetic-size " + std::to_string(c.synthetic_size) + " images of " +
                       std::to_string(side) + "x" + std::to_string(side) +
                       " are more bytes than a dataset can hold",
                   "lower --synthetic-size or --image-size");
  }
}

// A setting that only acts together with another: refused when it is set (differs from its
// default) while the other leaves it without effect, so no flag is accepted and then ignored.
void check_applies(bool set, bool applies, const std::string& conflict, const std::string& fix) {
  MANTISSA_CHECK(!set || applies, conflict, fix);
}

// The settings that act only under others (optimizer, schedule, pipeline, loader, reports,
// evaluation, dataset, model).
void check_relevance(const TrainConfig& c, const RunSettings& r) {
  const TrainConfig d;
  const bool sgd = r.optimizer == OptimizerKind::kSgd;
  const std::string opt = "--optimizer " + c.optimizer;
  for (const auto& [flag, set] :
       {std::pair{"--beta1", c.beta1 != d.beta1}, std::pair{"--beta2", c.beta2 != d.beta2},
        std::pair{"--eps", c.eps != d.eps}, std::pair{"--no-bias-correction", !c.bias_correction}})
    check_applies(set, !sgd, std::string(flag) + " applies to Adam and AdamW, not to " + opt,
                  std::string("drop ") + flag + ", or use --optimizer adam or adamw");
  check_applies(c.nesterov, sgd, "--nesterov applies to SGD, not to " + opt,
                "drop --nesterov, or use --optimizer sgd --momentum 0.9 --nesterov");
  check_applies(c.nesterov, c.momentum > 0, "--nesterov needs SGD momentum, and --momentum is 0",
                "set --momentum (e.g. 0.9), or drop --nesterov");
  check_applies(!c.first_moment_type.empty(), !sgd || c.momentum > 0,
                "--first-moment-type sets the type of SGD's momentum buffer, and --momentum 0 "
                "keeps none",
                "set --momentum, or drop --first-moment-type");
  check_applies(!c.second_moment_type.empty(), !sgd,
                "--second-moment-type sets the type of Adam's exp_avg_sq, and " + opt +
                    " keeps no second moment",
                "drop --second-moment-type, or use --optimizer adam or adamw");
  const bool step_schedule = r.schedule.kind == optim::LrSchedule::Kind::kStep;
  for (const auto& [flag, set] : {std::pair{"--lr-step-size", c.lr_step_size != d.lr_step_size},
                                  std::pair{"--lr-gamma", c.lr_gamma != d.lr_gamma}})
    check_applies(set, step_schedule,
                  std::string(flag) + " applies to --lr-schedule step, not " + c.lr_schedule,
                  std::string("add --lr-schedule step, or drop ") + flag);
  check_applies(c.accumulation_reduction != d.accumulation_reduction, c.gradient_accumulation > 1,
                "--accumulation-reduction " + c.accumulation_reduction +
                    " combines the micro-batches of a step, and --gradient-accumulation is 1",
                "add --gradient-accumulation N (N > 1), or drop --accumulation-reduction");
  check_applies(c.output_mode != d.output_mode, c.device_iterations > 1,
                "--output-mode " + c.output_mode +
                    " chooses among the steps of a call, and --device-iterations is 1",
                "add --device-iterations K (K > 1), or drop --output-mode");
  check_applies(c.output_return_period != d.output_return_period,
                r.output_mode == OutputMode::kEvery,
                "--output-return-period applies to --output-mode every, not " + c.output_mode,
                "add --output-mode every, or drop --output-return-period");
  check_applies(c.async_loader, c.prefetch > 0,
                "--async-dataloader with --prefetch 0 lets the workers make nothing ahead: the "
                "batches would be made while the step waits, as without it",
                "use --prefetch 1 or more, or drop --async-dataloader");
  check_applies(c.prefetch != d.prefetch, c.async_loader,
                "--prefetch applies to the asynchronous loader (--async-dataloader)",
                "add --async-dataloader, or drop --prefetch");
  check_applies(c.workers != d.workers, c.async_loader,
                "TrainConfig::workers applies to the asynchronous loader, and async_loader is off",
                "set async_loader (the command line's --workers sets it)");
  check_applies(c.numerics_every != d.numerics_every, !c.numerics_report.empty(),
                "--numerics-every applies to --numerics-report, which is not given",
                "add --numerics-report FILE, or drop --numerics-every");
  for (const auto& [flag, set] :
       {std::pair{"--eval-batch-size", c.eval_batch_size != d.eval_batch_size},
        std::pair{"--test-limit", c.test_limit != d.test_limit}})
    check_applies(set, c.evaluate,
                  std::string(flag) + " applies to the evaluation, which --no-eval skips",
                  std::string("drop ") + flag + " or --no-eval");
  check_applies(c.autocast_log, r.precision.mode.autocast,
                "--autocast-log logs automatic casting, which --precision " +
                    r.precision.mode.name + " does not use",
                "use a mixed mode (16-mixed, bf16-mixed, O1), or drop --autocast-log");
  check_applies(c.imagenet_stem, c.model.rfind("resnet", 0) == 0,
                "--imagenet-stem chooses a ResNet's stem, and --model is " + c.model,
                "use a ResNet (--model resnet18, ...), or drop --imagenet-stem");
  check_applies(c.synthetic_size != d.synthetic_size, c.dataset == "synthetic",
                "--synthetic-size sizes the synthetic dataset, and --dataset is " + c.dataset,
                "add --dataset synthetic, or drop --synthetic-size");
  check_applies(!c.data_dir.empty(), c.dataset != "synthetic",
                "--data-dir locates a dataset's files, and --dataset synthetic has none",
                "drop --data-dir, or name a dataset read from files");
}

}  // namespace

int64_t total_steps(const TrainConfig& c, int64_t batches_per_epoch) {
  MANTISSA_ASSERT(c.gradient_accumulation >= 1 && batches_per_epoch >= c.gradient_accumulation,
                  "an epoch shorter than one optimizer step");
  MANTISSA_CHECK(count_product(c.epochs, batches_per_epoch),
                 "--epochs " + std::to_string(c.epochs) + " of " +
                     std::to_string(batches_per_epoch) + " batches is more than " +
                     std::to_string(kMaxCount) + " batches",
                 "lower --epochs; --max-steps N stops a run after N optimizer steps");
  return c.epochs * (batches_per_epoch / c.gradient_accumulation);
}

RunSettings resolve(const TrainConfig& c, bool checks_outputs) {
  RunSettings r;
  const auto models = nn::model_names();
  MANTISSA_CHECK(std::find(models.begin(), models.end(), c.model) != models.end(),
                 "unknown model '" + excerpt(c.model) + "'",
                 "choose --model from: " + joined(models));
  const auto sets = data::dataset_names();
  MANTISSA_CHECK(std::find(sets.begin(), sets.end(), c.dataset) != sets.end(),
                 "unknown dataset '" + excerpt(c.dataset) + "'",
                 "choose --dataset from: " + joined(sets));
  r.model = c.model;
  r.dataset = c.dataset;
  check_values(c);
  r.optimizer = parse_optimizer(c.optimizer);
  MANTISSA_CHECK(c.batch_size > 0, "--batch-size must be positive", "");
  MANTISSA_CHECK(c.eval_batch_size > 0, "--eval-batch-size must be positive", "");
  MANTISSA_CHECK(c.epochs > 0, "--epochs must be positive", "");
  MANTISSA_CHECK(c.max_steps >= 0 && c.train_limit >= 0 && c.test_limit >= 0,
                 "--max-steps, --train-limit and --test-limit must not be negative", "");
  r.image_size = c.effective_image_size();
  MANTISSA_CHECK(std::isfinite(c.lr) && c.lr > 0, "--lr must be a positive number",
                 "e.g. --lr 1e-3");
  r.weight_decay = c.effective_weight_decay();
  MANTISSA_CHECK(r.weight_decay >= 0, "--weight-decay must not be negative", "");
  MANTISSA_CHECK(c.momentum >= 0 && c.momentum < 1, "--momentum must lie in [0, 1)", "");
  MANTISSA_CHECK(c.momentum == 0 || r.optimizer == OptimizerKind::kSgd,
                 "--momentum applies to SGD only", "Adam and AdamW take --beta1");
  MANTISSA_CHECK(c.max_grad_norm >= 0, "--max-grad-norm must not be negative", "");
  MANTISSA_CHECK(c.synthetic_size > 0, "--synthetic-size must be positive", "");
  MANTISSA_CHECK(c.gradient_accumulation >= 1, "--gradient-accumulation must be at least 1",
                 "1 updates after every batch");
  r.reduction = parse_reduction(c.accumulation_reduction);
  MANTISSA_CHECK(c.device_iterations >= 1, "--device-iterations must be at least 1",
                 "1 runs one optimizer step per call");
  r.output_mode = parse_output_mode(c.output_mode);
  MANTISSA_CHECK(
      c.output_return_period >= 1 && c.output_return_period <= c.device_iterations,
      "--output-return-period " + std::to_string(c.output_return_period) +
          " must lie in [1, --device-iterations = " + std::to_string(c.device_iterations) + "]",
      "e.g. --device-iterations 4 --output-mode every --output-return-period 2");
  MANTISSA_CHECK(c.workers >= 1 && c.workers <= 64, "--workers must lie in [1, 64]", "");
  MANTISSA_CHECK(c.prefetch >= 0 && c.prefetch <= 64, "--prefetch must lie in [0, 64]", "");
  if (checks_outputs) {
    const std::string page =
        c.numerics_report.empty() ? std::string() : numerics_page_path(c.numerics_report);
    io::check_distinct_outputs({{"--save", c.save},
                                {"--metrics-json", c.metrics_json},
                                {"--report", c.report},
                                {"--numerics-report", c.numerics_report},
                                {"--numerics-report's page", page}});
    io::check_output_path(c.save, "--save");
    io::check_output_path(c.metrics_json, "--metrics-json");
    io::check_output_path(c.report, "--report");
    io::check_output_path(c.numerics_report, "--numerics-report");
    io::check_output_path(page, "--numerics-report's page");
  }
  MANTISSA_CHECK(c.numerics_every >= 1, "--numerics-every must be at least 1", "");
  MANTISSA_CHECK(c.init_from.empty() || c.resume.empty(),
                 "--init-from and --resume cannot be used together",
                 "--resume restores the weights itself; use one of them");
  r.schedule.kind = optim::parse_schedule(c.lr_schedule);
  MANTISSA_CHECK(c.warmup_steps >= 0, "--warmup-steps must not be negative", "0: no warm-up");
  MANTISSA_CHECK(c.lr_step_size >= 1, "--lr-step-size must be at least 1", "e.g. 1000");
  MANTISSA_CHECK(std::isfinite(c.lr_gamma) && c.lr_gamma > 0, "--lr-gamma must be positive",
                 "e.g. 0.1");
  r.schedule.warmup_steps = c.warmup_steps;
  r.schedule.step_size = c.lr_step_size;
  r.schedule.gamma = c.lr_gamma;
  if (!c.memory_budget.empty()) {
    r.memory_budget = parse_bytes(c.memory_budget);
    MANTISSA_CHECK(r.memory_budget.value_or(0) > 0,
                   "--memory-budget '" + excerpt(c.memory_budget) + "' is not a size",
                   "give bytes or a size with a unit, e.g. 512MiB or 1.5GiB");
  }
  r.precision = amp::resolve_precision(c, c.seed);
  r.allreduce_dtype = parse_allreduce_dtype(c.allreduce_dtype);
  MANTISSA_CHECK(std::isfinite(c.bucket_size_mib) && c.bucket_size_mib > 0,
                 "--bucket-size must be a positive number of MiB", "e.g. --bucket-size 25");
  MANTISSA_CHECK(c.zero == 0 || c.zero == 1,
                 "--zero " + std::to_string(c.zero) + " is not a supported ZeRO stage",
                 "use --zero 1 (optimizer state and master weights sharded), or leave it out");
  check_relevance(c, r);
  return r;
}

void validate(const TrainConfig& c) { resolve(c); }

std::string numerics_page_path(const std::string& report) {
  const bool json = report.size() > 5 && report.compare(report.size() - 5, 5, ".json") == 0;
  return (json ? report.substr(0, report.size() - 5) : report) + ".html";
}

void check_user_model_config(const TrainConfig& c) {
  const TrainConfig d;
  struct Field {
    const char* name;
    bool set;
    const char* what;  // what the field is for
    const char* fix;
  };
  const char* kLeave = "leave it at its default";
  const Field fields[] = {
      {"model", c.model != d.model, "names a built-in model", kLeave},
      {"dataset", c.dataset != d.dataset, "names a built-in dataset", kLeave},
      {"data_dir", c.data_dir != d.data_dir, "locates a built-in dataset's files", kLeave},
      {"image_size", c.image_size != d.image_size, "resizes a built-in dataset's images",
       "transform the examples in your ExampleSource::get"},
      {"imagenet_stem", c.imagenet_stem != d.imagenet_stem, "chooses a built-in ResNet's stem",
       kLeave},
      {"train_limit", c.train_limit != d.train_limit, "shortens a built-in dataset",
       "pass the examples you want to train on"},
      {"test_limit", c.test_limit != d.test_limit, "shortens a built-in dataset",
       "pass the examples you want to test on"},
      {"augment", c.augment != d.augment, "crops and flips a built-in dataset's images",
       "transform the examples in your ExampleSource::get"},
      {"synthetic_size", c.synthetic_size != d.synthetic_size,
       "sizes the built-in synthetic dataset", kLeave},
      {"eight_bit_io", c.eight_bit_io != d.eight_bit_io,
       "hands over a built-in dataset's images in 8 bits", kLeave},
  };
  for (const Field& f : fields)
    MANTISSA_CHECK(!f.set,
                   std::string("TrainConfig::") + f.name + " " + f.what +
                       ", but this trainer was given a model and datasets of its own",
                   f.fix);
}

}  // namespace mantissa::train

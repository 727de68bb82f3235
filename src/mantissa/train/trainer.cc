#include "mantissa/train/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>

#include "mantissa/autograd/autograd.h"
#include "mantissa/core/error.h"
#include "mantissa/core/parallel.h"
#include "mantissa/io/output_file.h"
#include "mantissa/io/safetensors.h"

namespace mantissa::train {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

constexpr const char* kFormat = "mantissa-checkpoint-1";
constexpr const char* kOptimizerPrefix = "optimizer.";

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string clock_str(double s) {
  const long t = std::lround(std::max(0.0, s));
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", t / 3600, (t / 60) % 60, t % 60);
  else
    std::snprintf(buf, sizeof buf, "%02ld:%02ld", t / 60, t % 60);
  return buf;
}

// Number of rows of `out` (B, classes) whose largest score is at the label.
int64_t count_correct(const Tensor& out, const Tensor& labels) {
  const std::vector<float> v = out.to_float_vector();
  const int64_t B = out.size(0), K = out.size(1);
  const int64_t* y = labels.data<int64_t>();
  int64_t correct = 0;
  for (int64_t i = 0; i < B; ++i) {
    int64_t best = 0;
    for (int64_t k = 1; k < K; ++k)
      if (v[static_cast<size_t>(i * K + k)] > v[static_cast<size_t>(i * K + best)]) best = k;
    correct += best == y[i];
  }
  return correct;
}

amp::PrecisionMode mode_of(const TrainConfig& c) {
  return amp::precision_mode(
      c.precision, c.half_type.empty()
                       ? std::nullopt
                       : std::optional<DType>(amp::parse_float_type(c.half_type, "--half-type")));
}

// The default op lists, with the lists that --autocast-lower-list / --autocast-fp32-list replace.
ops::AutocastPolicy policy_of(const TrainConfig& c) {
  std::optional<std::vector<std::string>> lower, fp32;
  if (!c.autocast_lower_list.empty()) lower = ops::read_op_list(c.autocast_lower_list);
  if (!c.autocast_fp32_list.empty()) fp32 = ops::read_op_list(c.autocast_fp32_list);
  ops::AutocastPolicy policy;
  policy.replace_lists(lower, fp32);
  return policy;
}

data::LoaderConfig loader_config(const TrainConfig& c, bool train, int64_t channels) {
  data::LoaderConfig lc;
  lc.dtype = c.eight_bit_io ? DType::u8 : mode_of(c).input_dtype;
  lc.batch_size = train ? c.batch_size : c.eval_batch_size;
  lc.shuffle = train && c.shuffle;
  lc.drop_last = train;
  lc.seed = c.seed;
  lc.transform.image_size = c.effective_image_size();
  lc.transform.crop_padding = train && c.augment ? 4 : 0;
  lc.transform.random_flip = train && c.augment;
  lc.transform.mean = std::vector<float>(static_cast<size_t>(channels), 0.5f);
  lc.transform.std = std::vector<float>(static_cast<size_t>(channels), 0.5f);
  lc.prefetch = c.prefetch;
  lc.workers = c.async_loader ? c.workers : 0;
  return lc;
}

data::Dataset load_split(const TrainConfig& c, bool train) {
  data::SyntheticConfig sc;
  sc.size = train ? c.synthetic_size : std::max<int64_t>(1, c.synthetic_size / 4);
  sc.channels = c.model == "tutorial-cnn" || c.model == "lenet5" ? 1 : 3;
  sc.image_size = c.effective_image_size();
  sc.seed = c.seed;
  data::Dataset d = data::load_dataset(c.dataset, c.data_dir, train, sc);
  return d.head(train ? c.train_limit : c.test_limit);
}

std::map<std::string, Tensor> model_tensors(const io::SafetensorsFile& f) {
  std::map<std::string, Tensor> out;
  for (auto& [name, t] : f.tensors)
    if (name.rfind(kOptimizerPrefix, 0) != 0) out.emplace(name, t);
  return out;
}

std::string meta(const io::SafetensorsFile& f, const std::string& key, const std::string& path) {
  auto it = f.metadata.find(key);
  MANTISSA_CHECK(
      it != f.metadata.end(),
      path + " is not a Mantissa checkpoint (no '" + key + "' in its metadata)",
      "pass a file written by 'mantissa train --save'; for weights alone use --init-from");
  return it->second;
}

int64_t meta_int(const io::SafetensorsFile& f, const std::string& key, const std::string& path) {
  const std::string v = meta(f, key, path);
  try {
    size_t used = 0;
    const long long x = std::stoll(v, &used);
    if (used == v.size()) return x;
  } catch (const std::exception&) {
  }
  throw Error(path + ": metadata '" + key + "' is not an integer ('" + v + "')",
              "the file is damaged");
}

nn::ModelConfig model_config_from(const io::SafetensorsFile& f, const std::string& path) {
  nn::ModelConfig mc;
  mc.in_channels = meta_int(f, "in_channels", path);
  mc.image_size = meta_int(f, "image_size", path);
  mc.num_classes = meta_int(f, "num_classes", path);
  mc.imagenet_stem = meta(f, "imagenet_stem", path) == "true";
  return mc;
}

// Accuracy and mean loss of `m` on the test split that `c` names (first test_limit examples),
// in evaluation mode, without recording; the model's mode is restored afterwards. `source` names
// the weights in the error for a dataset of another channel count.
EvalResult evaluate_split(nn::Classifier& m, const TrainConfig& c,
                          const std::string& source = "the model",
                          const ops::AutocastPolicy* policy = nullptr) {
  data::Dataset test = load_split(c, false);
  MANTISSA_CHECK(test.channels() == m.config().in_channels,
                 "dataset " + test.name + " has " + std::to_string(test.channels()) +
                     " channels but " + source + " expects " +
                     std::to_string(m.config().in_channels),
                 "evaluate on the dataset the model was trained on");
  data::Loader loader(test, loader_config(c, false, test.channels()));
  autograd::NoGradGuard no_grad;
  const bool was_training = m.is_training();
  m.eval();
  EvalResult r;
  r.model = c.model;
  double loss_sum = 0;
  int64_t correct = 0;
  loader.start(0);
  const amp::PrecisionMode mode = mode_of(c);
  while (auto batch = loader.next()) {
    std::optional<ops::AutocastScope> autocast;
    if (mode.autocast && policy) autocast.emplace(mode.half, *policy);
    Tensor out = m(batch->images);
    if (mode.fp32_loss && out.dtype() != DType::f32) out = ops::cast(out, DType::f32);
    loss_sum += m.loss(out, batch->labels).item() * static_cast<double>(batch->labels.size(0));
    correct += count_correct(out, batch->labels);
    r.examples += batch->labels.size(0);
  }
  m.train(was_training);
  r.accuracy = r.examples > 0 ? static_cast<double>(correct) / static_cast<double>(r.examples) : 0;
  r.loss = r.examples > 0 ? loss_sum / static_cast<double>(r.examples) : 0;
  return r;
}

class ProgressBar {
 public:
  ProgressBar(std::ostream* os, bool enabled) : os_(os), enabled_(enabled && os != nullptr) {
    tty_ = enabled_ && isatty(STDERR_FILENO);
  }
  void update(int64_t epoch, int64_t epochs, int64_t done, int64_t total, double elapsed,
              double images, double loss, double acc, bool final,
              const amp::LossScaler* scaler = nullptr) {
    if (!enabled_) return;
    const auto now = Clock::now();
    const double since = std::chrono::duration<double>(now - last_).count();
    if (!final && since < (tty_ ? 0.1 : 10.0)) return;
    last_ = now;
    const double frac = total > 0 ? static_cast<double>(done) / static_cast<double>(total) : 1.0;
    const int width = 20;
    const int filled = static_cast<int>(frac * width);
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(width, ' ');
    const double rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0;
    const double eta = rate > 0 ? static_cast<double>(total - done) / rate : 0;
    char scale[64] = "";
    if (scaler)
      std::snprintf(scale, sizeof scale, ", scale=%g, skipped=%lld", scaler->scale(),
                    static_cast<long long>(scaler->skipped_steps()));
    char line[320];
    std::snprintf(line, sizeof line,
                  "epoch %lld/%lld %3d%%|%s| %lld/%lld [%s<%s, %.2f it/s, %.0f img/s, loss=%.4f, "
                  "acc=%.2f%%%s]",
                  static_cast<long long>(epoch), static_cast<long long>(epochs),
                  static_cast<int>(frac * 100), bar.c_str(), static_cast<long long>(done),
                  static_cast<long long>(total), clock_str(elapsed).c_str(), clock_str(eta).c_str(),
                  rate, elapsed > 0 ? images / elapsed : 0, loss, acc * 100, scale);
    *os_ << (tty_ ? "\r" : "") << line << (tty_ && !final ? "" : "\n") << std::flush;
  }

 private:
  std::ostream* os_;
  bool enabled_, tty_ = false;
  Clock::time_point last_{};
};

}  // namespace

namespace {

volatile std::sig_atomic_t g_stop = 0;

}  // namespace

void request_stop() { g_stop = 1; }
bool stop_requested() { return g_stop != 0; }

void validate(const TrainConfig& c) {
  auto names = [](const std::vector<std::string>& v) {
    std::string s;
    for (auto& n : v) s += (s.empty() ? "" : ", ") + n;
    return s;
  };
  const auto models = nn::model_names();
  MANTISSA_CHECK(std::find(models.begin(), models.end(), c.model) != models.end(),
                 "unknown model '" + c.model + "'", "choose --model from: " + names(models));
  const auto sets = data::dataset_names();
  MANTISSA_CHECK(std::find(sets.begin(), sets.end(), c.dataset) != sets.end(),
                 "unknown dataset '" + c.dataset + "'", "choose --dataset from: " + names(sets));
  MANTISSA_CHECK(c.optimizer == "sgd" || c.optimizer == "adam" || c.optimizer == "adamw",
                 "unknown optimizer '" + c.optimizer + "'",
                 "choose --optimizer sgd, adam or adamw");
  MANTISSA_CHECK(c.batch_size > 0, "--batch-size must be positive", "");
  MANTISSA_CHECK(c.eval_batch_size > 0, "--eval-batch-size must be positive", "");
  MANTISSA_CHECK(c.epochs > 0, "--epochs must be positive", "");
  MANTISSA_CHECK(c.max_steps >= 0 && c.train_limit >= 0 && c.test_limit >= 0,
                 "--max-steps, --train-limit and --test-limit must not be negative", "");
  MANTISSA_CHECK(c.image_size >= 0, "--image-size must be positive", "");
  MANTISSA_CHECK(std::isfinite(c.lr) && c.lr > 0, "--lr must be a positive number",
                 "e.g. --lr 1e-3");
  MANTISSA_CHECK(c.effective_weight_decay() >= 0, "--weight-decay must not be negative", "");
  MANTISSA_CHECK(c.momentum >= 0 && c.momentum < 1, "--momentum must lie in [0, 1)", "");
  MANTISSA_CHECK(c.momentum == 0 || c.optimizer == "sgd", "--momentum applies to SGD only",
                 "Adam and AdamW take --beta1");
  MANTISSA_CHECK(c.max_grad_norm >= 0, "--max-grad-norm must not be negative", "");
  MANTISSA_CHECK(c.threads >= 0, "--threads must not be negative", "");
  MANTISSA_CHECK(c.synthetic_size > 0, "--synthetic-size must be positive", "");
  MANTISSA_CHECK(c.gradient_accumulation >= 1, "--gradient-accumulation must be at least 1",
                 "1 updates after every batch");
  MANTISSA_CHECK(c.accumulation_reduction == "mean" || c.accumulation_reduction == "running" ||
                     c.accumulation_reduction == "sum",
                 "--accumulation-reduction '" + c.accumulation_reduction + "' is not valid",
                 "use mean, running or sum");
  MANTISSA_CHECK(c.device_iterations >= 1, "--device-iterations must be at least 1",
                 "1 runs one optimizer step per call");
  MANTISSA_CHECK(c.output_mode == "all" || c.output_mode == "sum" || c.output_mode == "final" ||
                     c.output_mode == "every",
                 "--output-mode '" + c.output_mode + "' is not valid",
                 "use all, sum, final or every (with --output-return-period N)");
  MANTISSA_CHECK(
      c.output_return_period >= 1 && c.output_return_period <= c.device_iterations,
      "--output-return-period " + std::to_string(c.output_return_period) +
          " must lie in [1, --device-iterations = " + std::to_string(c.device_iterations) + "]",
      "e.g. --device-iterations 4 --output-mode every --output-return-period 2");
  MANTISSA_CHECK(c.workers >= 1 && c.workers <= 64, "--workers must lie in [1, 64]", "");
  MANTISSA_CHECK(c.prefetch >= 0 && c.prefetch <= 64, "--prefetch must lie in [0, 64]", "");
  io::check_output_path(c.save, "--save");
  io::check_output_path(c.metrics_json, "--metrics-json");
  io::check_output_path(c.numerics_report, "--numerics-report");
  MANTISSA_CHECK(c.numerics_every >= 1, "--numerics-every must be at least 1", "");
  MANTISSA_CHECK(c.init_from.empty() || c.resume.empty(),
                 "--init-from and --resume cannot be used together",
                 "--resume restores the weights itself; use one of them");
  optim::parse_schedule(c.lr_schedule);
  const amp::PrecisionMode mode = mode_of(c);
  MANTISSA_CHECK(c.memory_budget.empty() || parse_bytes(c.memory_budget).value_or(0) > 0,
                 "--memory-budget '" + c.memory_budget + "' is not a size",
                 "give bytes or a size with a unit, e.g. 512MiB or 1.5GiB");
  MANTISSA_CHECK(c.partials == "fp32" || c.partials == "fp16",
                 "--partials '" + c.partials + "' is not valid", "use fp32 or fp16");
  for (const auto& [flag, v] :
       {std::pair<const char*, const std::string*>{"--accum-type", &c.accum_type},
        {"--first-moment-type", &c.first_moment_type},
        {"--second-moment-type", &c.second_moment_type}})
    if (!v->empty()) amp::parse_float_type(*v, flag);
  if (!c.loss_scaling.empty()) amp::parse_loss_scaling(c.loss_scaling);
  MANTISSA_CHECK(c.loss_scale_growth_interval > 0, "--loss-scale-growth-interval must be positive",
                 "e.g. 2000");
  MANTISSA_CHECK(c.loss_scale_hysteresis >= 1, "--loss-scale-hysteresis must be at least 1",
                 "1 backs off on every overflow");
  MANTISSA_CHECK(!c.stochastic_outputs || mode.param_dtype != DType::f32 || mode.autocast,
                 "--stochastic-outputs needs 16-bit op outputs",
                 "use it with a 16-bit --precision (16-true, bf16-true, 16-mixed, ...)");
  policy_of(c);  // the op-list files: readable, known ops, no op in both
  for (const auto& k : c.keep_fp32)
    MANTISSA_CHECK(
        std::find(c.half_modules.begin(), c.half_modules.end(), k) == c.half_modules.end(),
        "module '" + k + "' is in both --keep-fp32 and --half-modules", "name it in one of them");
}

Trainer::Trainer(const TrainConfig& config, TrainStreams streams)
    : config_(config), streams_(streams) {
  validate(config_);
  if (!config_.memory_budget.empty()) {
    budget_.previous = default_memory_tracker().budget();
    budget_.active = true;
    default_memory_tracker().set_budget(parse_bytes(config_.memory_budget));
  }
  set_num_threads(config_.threads);
  train_data_ = load_split(config_, true);
  nn::ModelConfig mc;
  mc.in_channels = train_data_.channels();
  mc.image_size = config_.effective_image_size();
  mc.num_classes = train_data_.num_classes;
  mc.seed = config_.seed;
  mc.imagenet_stem = config_.imagenet_stem;
  model_ = nn::make_model(config_.model, mc);
  if (!config_.init_from.empty()) init_from(config_.init_from);
  apply_precision();
  apply_levers();

  auto params = model_->named_parameters();
  optim::StateTypes types{mode_.first_moment, mode_.second_moment};
  if (!config_.first_moment_type.empty())
    types.first_moment = amp::parse_float_type(config_.first_moment_type, "--first-moment-type");
  if (!config_.second_moment_type.empty())
    types.second_moment = amp::parse_float_type(config_.second_moment_type, "--second-moment-type");
  const double wd = config_.effective_weight_decay();
  if (config_.optimizer == "sgd") {
    optim::SgdOptions o;
    o.lr = config_.lr;
    o.momentum = config_.momentum;
    o.nesterov = config_.nesterov;
    o.weight_decay = wd;
    optimizer_ = std::make_unique<optim::Sgd>(params, o, types);
  } else {
    optim::AdamOptions o;
    o.lr = config_.lr;
    o.beta1 = config_.beta1;
    o.beta2 = config_.beta2;
    o.eps = config_.eps;
    o.bias_correction = config_.bias_correction;
    o.weight_decay = wd;
    optimizer_ = std::make_unique<optim::Adam>(params, o, config_.optimizer == "adamw", types);
  }
  if (mode_.master_weights) optimizer_->enable_master_weights();
  // A stream of its own: the seed also keys initialisation, shuffling and dropout.
  if (config_.stochastic_rounding) optimizer_->set_stochastic_rounding(config_.seed ^ 0x5352u);
  std::optional<amp::LossScalerOptions> so = config_.loss_scaling.empty()
                                                 ? mode_.loss_scaling
                                                 : amp::parse_loss_scaling(config_.loss_scaling);
  if (so) {
    if (config_.loss_scale_init) so->init_scale = *config_.loss_scale_init;
    so->min_scale = config_.loss_scale_min;
    so->max_scale = config_.loss_scale_max;
    so->growth_interval = config_.loss_scale_growth_interval;
    so->hysteresis = config_.loss_scale_hysteresis;
    scaler_.emplace(*so);
  }
  if (streams_.out) {
    amp::PrecisionMode shown = mode_;  // with the flags that override the mode's defaults
    shown.loss_scaling = so;
    shown.first_moment = types.first_moment;
    shown.second_moment = types.second_moment;
    *streams_.out << shown.describe() << ", partials " << config_.partials
                  << (config_.stochastic_rounding ? ", stochastic rounding" : "")
                  << (config_.stochastic_outputs ? ", stochastic op outputs" : "") << std::endl;
  }
  schedule_.kind = optim::parse_schedule(config_.lr_schedule);
  schedule_.warmup_steps = config_.warmup_steps;
  schedule_.step_size = config_.lr_step_size;
  schedule_.gamma = config_.lr_gamma;
  loader_ = std::make_unique<data::Loader>(train_data_,
                                           loader_config(config_, true, train_data_.channels()));
  const int64_t bpe = loader_->batches_per_epoch();
  MANTISSA_CHECK(bpe >= config_.gradient_accumulation,
                 "an epoch has " + std::to_string(bpe) + " batches, fewer than the " +
                     std::to_string(config_.gradient_accumulation) +
                     " micro-batches of one optimizer step",
                 "lower --gradient-accumulation or --batch-size, or use more examples");
  // The schedule spans --epochs; --max-steps only stops early, so a run stopped and resumed
  // follows the same learning rates as one that was not.
  schedule_.total_steps = config_.epochs * (bpe / config_.gradient_accumulation);
  if (!config_.resume.empty()) load_checkpoint(config_.resume);
}

Trainer::~Trainer() = default;

void Trainer::apply_precision() {
  mode_ = mode_of(config_);
  nn::Module& m = *model_;
  if (mode_.param_dtype != DType::f32) {
    m.to(mode_.param_dtype);
    if (mode_.keep_norm_fp32) {
      // O2: normalization layers keep FP32 weights and statistics and take 16-bit activations
      // as they come; the log-softmax (the loss's first half) runs in FP32.
      for (auto& [path, sub] : m.named_modules()) {
        const std::string& t = sub->type();
        if (t == "BatchNorm2d" || t == "GroupNorm" || t == "LayerNorm")
          sub->cast_parameters(DType::f32);
        if (t == "LogSoftmax") sub->to(DType::f32);
      }
    }
  }
  for (const std::string& path : config_.half_modules) m.submodule(path).to(mode_.half);
  for (const std::string& path : config_.keep_fp32) m.submodule(path).to(DType::f32);
  if (!config_.accum_type.empty()) {
    const DType t = amp::parse_float_type(config_.accum_type, "--accum-type");
    for (auto& p : m.named_parameters()) p.tensor->autograd_meta()->grad_dtype = t;
  }
  policy_ = policy_of(config_);
  std::function<void(const std::string&)> sink;
  if (config_.autocast_log && streams_.out) {
    std::ostream* os = streams_.out;
    sink = [os](const std::string& line) { *os << line << std::endl; };
  }
  log_ = std::make_unique<ops::AutocastLog>(sink);
  partials_ = config_.partials == "fp16" ? kernels::Partials::kF16 : kernels::Partials::kF32;
}

void Trainer::apply_levers() {
  if (!config_.numerics_report.empty()) numerics_ = std::make_unique<nn::NumericsRecorder>();
  if (config_.recompute) {
    const std::vector<nn::Module*> blocks = model_->recompute_blocks();
    MANTISSA_CHECK(!blocks.empty(), "--recompute: " + config_.model + " has no blocks to recompute",
                   "use it with a ResNet (each block is a recomputation checkpoint)");
    for (nn::Module* b : blocks) b->set_recompute(true);
  }
  if (config_.eight_bit_io) {
    const data::Transform t = loader_config(config_, true, train_data_.channels()).transform;
    model_->set_input_normalization(t.mean, t.std, mode_.input_dtype);
  }
}

float Trainer::train_step(const data::Batch* micro, int64_t* correct) {
  const int64_t N = config_.gradient_accumulation;
  const std::string& reduction = config_.accumulation_reduction;
  // The loss scale is read once: every micro-batch of the step is scaled alike.
  const float scale = scaler_ ? scaler_->scale() : 1.0f;
  const auto t0 = Clock::now();
  std::optional<autograd::DetectAnomalyGuard> anomaly;
  if (config_.detect_anomaly) anomaly.emplace(/*inf_in_backward=*/!scaler_.has_value());
  nn::NumericsRecorder* numerics =
      numerics_ && step_ % config_.numerics_every == 0 ? numerics_.get() : nullptr;
  double loss_sum = 0;
  for (int64_t f = 0; f < N; ++f) {
    const data::Batch& batch = micro[f];
    // "running" keeps the mean so far, s = f/(f+1) s + g/(f+1): micro-batch f's loss is scaled
    // by 1/(f+1) and the accumulator by f/(f+1). "mean" and "sum" add gradients as they come.
    const double factor = reduction == "running" && f > 0 ? 1.0 / static_cast<double>(f + 1) : 1.0;
    std::optional<nn::NumericsScope> probe;
    if (numerics) probe.emplace(*numerics, 1.0 / (scale * factor));
    Tensor out, loss;
    default_memory_tracker().set_phase("forward");
    {
      ProfileTimer timed("step", "", "forward");
      ops::PartialsScope partials(partials_);
      std::optional<ops::AutocastScope> autocast;
      if (mode_.autocast) autocast.emplace(mode_.half, policy_, log_.get());
      std::optional<ops::StochasticOutputsScope> sr;
      if (config_.stochastic_outputs)
        sr.emplace(config_.seed ^ 0x4f5554u, static_cast<uint64_t>(step_ * N + f) << 24);
      {
        std::optional<MacCounter> macs;
        if (forward_macs_per_image_ == 0) macs.emplace();
        out = (*model_)(batch.images);
        if (macs && batch.images.dim() > 0 && batch.images.size(0) > 0)
          forward_macs_per_image_ =
              static_cast<double>(macs->macs()) / static_cast<double>(batch.images.size(0));
      }
      if (mode_.fp32_loss && out.dtype() != DType::f32) out = ops::cast(out, DType::f32);
      ProfileTimer timed_loss("forward", "", "loss");
      loss = model_->loss(out, batch.labels);
    }
    if (factor != 1.0) optim::scale_grads(optimizer_->params(), static_cast<float>(1.0 - factor));
    // Scaled in FP32: S * loss; the optimizer multiplies the gradients by 1/S.
    default_memory_tracker().set_phase("backward");
    const double s = scale * factor;
    // Parameters update as their gradients come (bit for bit the step below) when the step needs
    // nothing global: no clipping, no loss scale, one backward pass, no gradient reports.
    if (config_.update_in_backward && N == 1 && !scaler_ && config_.max_grad_norm <= 0 &&
        !numerics && !config_.detect_anomaly && !config_.recompute)
      optimizer_->begin_backward_step();
    {
      ProfileTimer timed("step", "", "backward");
      autograd::backward(s != 1.0 ? ops::mul_scalar(loss, s) : loss);
    }
    loss_sum += loss.item();
    if (correct) *correct += count_correct(out, batch.labels);
  }
  anomaly.reset();
  default_memory_tracker().set_phase("optimizer");
  optim::StepOptions so;
  // "mean" divides the summed gradients by N here, with the unscaling (one pass).
  so.grad_scale = static_cast<float>(
      1.0 / (static_cast<double>(scale) * (reduction == "mean" ? static_cast<double>(N) : 1.0)));
  if (numerics) {
    numerics->record_parameter_gradients(*model_, 1.0 / static_cast<double>(so.grad_scale));
    numerics->count_step();
  }
  so.max_grad_norm = config_.max_grad_norm;
  so.skip_nonfinite = scaler_.has_value();
  std::optional<ProfileTimer> timed;
  timed.emplace("step", "", "optimizer");
  const optim::StepReport report = optimizer_->step(so);
  if (scaler_) scaler_->update(!report.nonfinite.empty(), report.nonfinite);
  timed.emplace("step", "", "zero_grad");
  optimizer_->zero_grad();
  timed.reset();
  default_memory_tracker().set_phase("");
  compute_seconds_ += seconds_since(t0);
  return static_cast<float>(loss_sum / static_cast<double>(N));
}

CallOutput Trainer::call(const std::vector<data::Batch>& batches) {
  if (!model_->is_training()) model_->train();
  const int64_t N = config_.gradient_accumulation;
  const int64_t n = static_cast<int64_t>(batches.size());
  MANTISSA_CHECK(n > 0 && n % N == 0,
                 "a call of the training step got " + std::to_string(n) +
                     " batches, not a multiple of --gradient-accumulation " + std::to_string(N),
                 "hand over device_iterations x gradient_accumulation batches");
  CallOutput co;
  co.steps = n / N;
  const std::string& mode = config_.output_mode;
  for (int64_t k = 0; k < co.steps; ++k) {
    const bool returned = mode == "all" || mode == "sum" ||
                          (mode == "final" && k == co.steps - 1) ||
                          (mode == "every" && (k + 1) % config_.output_return_period == 0);
    nn::set_random_context({config_.seed, static_cast<uint64_t>(step_)});
    optimizer_->set_lr(schedule_.lr_at(config_.lr, step_));
    int64_t correct = 0;
    float l = 0;
    try {
      l = train_step(&batches[static_cast<size_t>(k * N)], returned ? &correct : nullptr);
    } catch (const autograd::AnomalyError& e) {
      throw autograd::AnomalyError("step " + std::to_string(step_ + 1) + ": " + e.message(),
                                   e.hint());
    }
    MANTISSA_CHECK(std::isfinite(l),
                   "the loss became " + std::string(std::isnan(l) ? "nan" : "inf") + " at step " +
                       std::to_string(step_ + 1),
                   "lower --lr, or set --max-grad-norm");
    step_losses_.push_back(l);
    ++step_;
    int64_t images = 0;
    for (int64_t f = 0; f < N; ++f)
      images += batches[static_cast<size_t>(k * N + f)].labels.size(0);
    co.images += images;
    if (!returned) continue;
    if (mode == "sum" && !co.outputs.empty()) {
      StepOutput& o = co.outputs.back();
      o.step = step_;
      ++o.steps;
      o.loss_sum += l;
      o.correct += correct;
      o.examples += images;
    } else {
      co.outputs.push_back({step_, 1, l, correct, images});
    }
  }
  return co;
}

void Trainer::init_from(const std::string& path) {
  const io::SafetensorsFile f = io::load_safetensors(path);
  model_->load_state_dict(model_tensors(f), path);
}

void Trainer::save_checkpoint(const std::string& path) const {
  std::vector<std::pair<std::string, Tensor>> tensors = model_->state_dict();
  for (auto& [name, t] : optimizer_->state_tensors())
    tensors.emplace_back(kOptimizerPrefix + name, t);
  const nn::ModelConfig& mc = model_->config();
  json losses = json::array();
  for (float l : step_losses_) losses.push_back(l);
  std::map<std::string, std::string> m = {
      {"format", kFormat},
      {"model", config_.model},
      {"dataset", config_.dataset},
      {"in_channels", std::to_string(mc.in_channels)},
      {"image_size", std::to_string(mc.image_size)},
      {"num_classes", std::to_string(mc.num_classes)},
      {"imagenet_stem", mc.imagenet_stem ? "true" : "false"},
      {"optimizer", optimizer_->name()},
      {"step", std::to_string(step_)},
      {"optimizer_steps", std::to_string(optimizer_->steps())},
      {"seed", std::to_string(config_.seed)},
      {"batch_size", std::to_string(config_.batch_size)},
      {"gradient_accumulation", std::to_string(config_.gradient_accumulation)},
      {"synthetic_size", std::to_string(config_.synthetic_size)},
      {"step_losses", losses.dump()},
      {"precision", mode_.name},
  };
  if (scaler_) m["loss_scaler"] = scaler_->to_json();
  if (optimizer_->stochastic_rounding())
    m["stochastic_rounding_seed"] = std::to_string(*optimizer_->stochastic_rounding());
  io::save_safetensors(path, tensors, m);
}

void Trainer::load_checkpoint(const std::string& path) {
  const io::SafetensorsFile f = io::load_safetensors(path);
  MANTISSA_CHECK(meta(f, "format", path) == kFormat,
                 path + " has checkpoint format '" + meta(f, "format", path) + "'",
                 std::string("this Mantissa reads ") + kFormat);
  const std::string model = meta(f, "model", path);
  MANTISSA_CHECK(model == config_.model,
                 path + " is a checkpoint of " + model + ", not of " + config_.model,
                 "pass --model " + model + " to resume it");
  const nn::ModelConfig saved = model_config_from(f, path);
  const nn::ModelConfig& mc = model_->config();
  MANTISSA_CHECK(saved.image_size == mc.image_size && saved.in_channels == mc.in_channels &&
                     saved.num_classes == mc.num_classes,
                 path + " was trained on " + std::to_string(saved.in_channels) + "x" +
                     std::to_string(saved.image_size) + "x" + std::to_string(saved.image_size) +
                     " images of " + std::to_string(saved.num_classes) + " classes, not " +
                     std::to_string(mc.in_channels) + "x" + std::to_string(mc.image_size) + "x" +
                     std::to_string(mc.image_size) + " of " + std::to_string(mc.num_classes),
                 "resume with the --image-size and --dataset of the original run");
  const std::string opt = meta(f, "optimizer", path);
  MANTISSA_CHECK(opt == optimizer_->name(),
                 path + " holds the state of optimizer " + opt + ", not " + optimizer_->name(),
                 "pass --optimizer " + opt + " to resume it");
  const std::string precision =
      f.metadata.count("precision") ? f.metadata.at("precision") : std::string("32-true");
  MANTISSA_CHECK(precision == mode_.name,
                 path + " was trained with --precision " + precision + ", not " + mode_.name,
                 "pass --precision " + precision + " to resume it");
  const int64_t ga =
      f.metadata.count("gradient_accumulation") ? meta_int(f, "gradient_accumulation", path) : 1;
  MANTISSA_CHECK(ga == config_.gradient_accumulation,
                 path + " was trained with --gradient-accumulation " + std::to_string(ga) +
                     ", not " + std::to_string(config_.gradient_accumulation),
                 "pass --gradient-accumulation " + std::to_string(ga) + " to resume it");
  MANTISSA_CHECK(f.metadata.count("loss_scaler") == (scaler_ ? 1u : 0u),
                 path + (scaler_ ? " holds no loss-scaler state" : " holds loss-scaler state"),
                 "resume with the --loss-scaling of the original run");
  if (scaler_) scaler_->load_json(f.metadata.at("loss_scaler"), path);
  model_->load_state_dict(model_tensors(f), path);
  std::map<std::string, Tensor> state;
  for (auto& [name, t] : f.tensors)
    if (name.rfind(kOptimizerPrefix, 0) == 0)
      state.emplace(name.substr(std::string(kOptimizerPrefix).size()), t);
  optimizer_->load_state(state, meta_int(f, "optimizer_steps", path), path);
  step_ = meta_int(f, "step", path);
  step_losses_.clear();
  try {
    for (auto& v : json::parse(meta(f, "step_losses", path)))
      step_losses_.push_back(v.get<float>());
  } catch (const json::exception& e) {
    throw Error(path + ": metadata 'step_losses' is not a JSON list of numbers",
                "the file is damaged");
  }
}

void Trainer::train_steps(TrainResult& result) {
  const int64_t N = config_.gradient_accumulation, K = config_.device_iterations;
  const int64_t spe = loader_->batches_per_epoch() / N;  // optimizer steps per epoch
  const int64_t total = config_.max_steps > 0 ? std::min(config_.max_steps, schedule_.total_steps)
                                              : schedule_.total_steps;
  const int64_t epochs = (total + spe - 1) / spe;
  ProgressBar bar(streams_.progress, config_.progress);
  model_->train();
  profiler_.clear();
  ProfilerScope profiling(config_.profile ? &profiler_ : nullptr);
  const auto t_train = Clock::now();
  const double wait0 = loader_->wait_seconds();
  compute_seconds_ = 0;
  int64_t images_total = 0, steps_run = 0;
  while (step_ < total && !stop_requested()) {
    const int64_t epoch = step_ / spe;
    const int64_t last = std::min(total, (epoch + 1) * spe);
    loader_->start(epoch, (step_ % spe) * N);
    EpochStats es;
    es.epoch = epoch + 1;
    const auto t0 = Clock::now();
    double loss_sum = 0;
    int64_t loss_steps = 0, correct = 0, counted = 0, seen = 0;
    const int64_t first = step_;
    // Calls of this epoch, for the progress bar: K steps each, the last may run fewer.
    const int64_t call0 = (step_ - epoch * spe) / K;
    const int64_t calls = (last - epoch * spe + K - 1) / K;
    int64_t call_index = call0;
    std::vector<data::Batch> batches;
    while (step_ < last && !stop_requested()) {
      const int64_t k = std::min(K, last - step_);
      batches.clear();
      const auto t_call = Clock::now();
      std::optional<ProfileTimer> timed;
      timed.emplace("step", "", "data");
      for (int64_t b = 0; b < k * N; ++b) {
        std::optional<data::Batch> batch = loader_->next();
        MANTISSA_ASSERT(batch.has_value(), "the loader ended before the epoch's steps");
        result.input_bytes += batch->images.nbytes() + batch->labels.nbytes();
        batches.push_back(std::move(*batch));
      }
      timed.reset();
      const CallOutput co = call(batches);
      const double call_seconds = seconds_since(t_call);
      for (int64_t i = 0; i < co.steps; ++i)
        result.step_seconds.push_back(call_seconds / static_cast<double>(co.steps));
      ++result.calls;
      ++call_index;
      steps_run += co.steps;
      seen += co.images;
      for (const StepOutput& o : co.outputs) {
        loss_sum += o.loss_sum;
        loss_steps += o.steps;
        correct += o.correct;
        counted += o.examples;
      }
      es.steps = step_ - first;
      bar.update(es.epoch, epochs, call_index, calls, seconds_since(t0), static_cast<double>(seen),
                 loss_steps > 0 ? loss_sum / static_cast<double>(loss_steps) : 0,
                 counted > 0 ? static_cast<double>(correct) / static_cast<double>(counted) : 0,
                 step_ == last, loss_scaler());
    }
    es.seconds = seconds_since(t0);
    es.loss = loss_steps > 0 ? loss_sum / static_cast<double>(loss_steps) : 0;
    es.train_accuracy =
        counted > 0 ? static_cast<double>(correct) / static_cast<double>(counted) : 0;
    es.images_per_second = es.seconds > 0 ? static_cast<double>(seen) / es.seconds : 0;
    images_total += seen;
    result.epochs.push_back(es);
    if (streams_.out)
      *streams_.out << "epoch " << es.epoch << ": loss " << fmt("%.4f", es.loss)
                    << ", train accuracy " << fmt("%.2f", es.train_accuracy * 100) << "%, "
                    << fmt("%.1f", es.seconds) << " s, " << fmt("%.1f", es.images_per_second)
                    << " images/s" << std::endl;
    if (!config_.save.empty() && step_ < total && !stop_requested()) save_checkpoint(config_.save);
  }
  loader_->stop();
  result.interrupted = step_ < total;
  if (result.interrupted) g_stop = 0;  // the request is honoured: a later run goes on
  result.train_seconds = seconds_since(t_train);
  result.images_per_second =
      result.train_seconds > 0 ? static_cast<double>(images_total) / result.train_seconds : 0;
  result.data_wait_seconds = loader_->wait_seconds() - wait0;
  result.flops_per_image = 6 * forward_macs_per_image_;
  result.gflops_per_second = result.flops_per_image * result.images_per_second * 1e-9;
  if (config_.profile) {
    result.profile = profiler_.rows();
    result.profiled_steps = steps_run;
  }
  result.host_seconds_per_step =
      steps_run > 0
          ? std::max(0.0, result.train_seconds - compute_seconds_ - result.data_wait_seconds) /
                static_cast<double>(steps_run)
          : 0;
}

TrainResult Trainer::run() {
  TrainResult r;
  default_memory_tracker().reset_peaks();
  train_steps(r);
  r.memory = default_memory_tracker().stats();
  r.steps = step_;
  if (scaler_) {
    r.loss_scale = scaler_->scale();
    r.skipped_steps = scaler_->skipped_steps();
    r.loss_scale_history = scaler_->history();
  }
  r.step_losses = step_losses_;
  if (!config_.save.empty()) save_checkpoint(config_.save);
  if (r.interrupted && streams_.out)
    *streams_.out << "interrupted at step " << step_
                  << (config_.save.empty() ? std::string()
                                           : ", checkpoint saved to " + config_.save +
                                                 " (continue with --resume " + config_.save + ")")
                  << std::endl;
  if (config_.evaluate && !r.interrupted) {
    r.test_accuracy = evaluate(&r.test_examples);
    if (streams_.out)
      *streams_.out << "test accuracy: " << fmt("%.2f", *r.test_accuracy * 100) << "% ("
                    << r.test_examples << " images)" << std::endl;
  }
  if (streams_.out && r.train_seconds > 0)
    *streams_.out << "training: " << fmt("%.1f", r.images_per_second) << " images/s ("
                  << fmt("%.1f", r.gflops_per_second) << " GFLOP/s at "
                  << fmt("%.4g", r.flops_per_image * 1e-6) << " MFLOP an image), waited "
                  << fmt("%.2f", r.data_wait_seconds) << " s for data ("
                  << format_bytes(static_cast<size_t>(loader_->batch_bytes())) << " a batch), host "
                  << fmt("%.0f", r.host_seconds_per_step * 1e6) << " us a step, peak memory "
                  << format_bytes(r.memory.peak_total)
                  << (scaler_ ? ", loss scale " + fmt("%g", scaler_->scale()) + ", " +
                                    std::to_string(scaler_->skipped_steps()) + " steps skipped"
                              : std::string())
                  << std::endl;
  if (streams_.out && config_.profile) *streams_.out << profile_table(r);
  if (!config_.metrics_json.empty())
    io::write_file_atomic(config_.metrics_json, metrics_json(config_, r));
  if (numerics_) {
    const std::string& path = config_.numerics_report;
    const std::string html = (path.size() > 5 && path.compare(path.size() - 5, 5, ".json") == 0
                                  ? path.substr(0, path.size() - 5)
                                  : path) +
                             ".html";
    io::write_file_atomic(path, numerics_->json());
    io::write_file_atomic(html, numerics_->html(config_.model + ", " + mode_.name + ", batch " +
                                                std::to_string(config_.batch_size)));
    if (streams_.out)
      *streams_.out << "numerics report: " << path << " and " << html << " (" << numerics_->steps()
                    << " steps); suggested loss scale "
                    << fmt("%g", numerics_->suggested_loss_scale().scale) << std::endl;
  }
  return r;
}

double Trainer::evaluate(int64_t* examples) {
  const EvalResult r = evaluate_split(*model_, config_, "the model", &policy_);
  if (examples) *examples = r.examples;
  return r.accuracy;
}

std::string profile_table(const TrainResult& r) {
  if (r.profiled_steps <= 0) return "profile: no training step ran\n";
  const double steps = static_cast<double>(r.profiled_steps);
  const double total = r.train_seconds / steps;
  std::ostringstream o;
  char line[256];
  auto row = [&](const std::string& phase, const std::string& where, const std::string& op,
                 double seconds, double calls) {
    const double ms = seconds / steps * 1e3;
    const std::string c = calls > 0 ? fmt("%.0f", calls / steps) : std::string();
    std::snprintf(line, sizeof line, "  %-11s %-24s %-18s %9.3f %6.1f%% %6s", phase.c_str(),
                  where.c_str(), op.c_str(), ms, total > 0 ? ms / (total * 1e3) * 100 : 0,
                  c.c_str());
    std::string l = line;
    l.erase(l.find_last_not_of(' ') + 1);
    o << l << '\n';
  };
  o << "profile: " << r.profiled_steps << " steps, " << fmt("%.3f", total * 1e3)
    << " ms a step (wall clock; a multithreaded op's time includes its workers')\n";
  std::snprintf(line, sizeof line, "  %-11s %-24s %-18s %9s %7s %6s\n", "phase", "module", "op",
                "ms/step", "share", "calls");
  o << line;
  auto step_seconds = [&](const char* op) {
    for (const ProfileRow& p : r.profile)
      if (p.phase == "step" && p.where.empty() && p.op == op) return p.seconds;
    return 0.0;
  };
  double accounted = 0;
  for (const char* phase :
       {"data", "forward", "backward", "recompute", "in-backward", "optimizer", "zero_grad"}) {
    const std::string ph = phase;
    const bool inclusive_only = ph == "data" || ph == "zero_grad";
    // Recomputed forwards and updates in the backward pass run inside the backward rows of
    // their modules: listed, not added again.
    const bool nested = ph == "recompute" || ph == "in-backward";
    const double inclusive = step_seconds(phase);
    if (!nested) accounted += inclusive;
    if (inclusive_only) {
      if (inclusive > 0) row(phase, "", "", inclusive, 0);
      continue;
    }
    double inside = 0;
    for (const ProfileRow& p : r.profile) {
      if (p.phase != phase) continue;
      row(phase, p.where.empty() ? "-" : p.where, p.op, p.seconds, static_cast<double>(p.calls));
      inside += p.seconds;
    }
    if (nested) continue;
    if (inclusive > 0) row(phase, "(rest)", "", std::max(0.0, inclusive - inside), 0);
  }
  row("(loop)", "(rest)", "", std::max(0.0, r.train_seconds - accounted), 0);
  return o.str();
}

std::string metrics_json(const TrainConfig& c, const TrainResult& r) {
  json j;
  j["config"] = {{"model", c.model},
                 {"dataset", c.dataset},
                 {"data_dir", c.data_dir},
                 {"image_size", c.effective_image_size()},
                 {"batch_size", c.batch_size},
                 {"epochs", c.epochs},
                 {"max_steps", c.max_steps},
                 {"train_limit", c.train_limit},
                 {"test_limit", c.test_limit},
                 {"shuffle", c.shuffle},
                 {"augment", c.augment},
                 {"optimizer", c.optimizer},
                 {"lr", c.lr},
                 {"lr_schedule", c.lr_schedule},
                 {"warmup_steps", c.warmup_steps},
                 {"weight_decay", c.effective_weight_decay()},
                 {"momentum", c.momentum},
                 {"max_grad_norm", c.max_grad_norm},
                 {"bias_correction", c.bias_correction},
                 {"seed", c.seed},
                 {"threads", c.threads > 0 ? c.threads : default_num_threads()},
                 {"init_from", c.init_from},
                 {"resume", c.resume},
                 {"precision", c.precision},
                 {"half_type", c.half_type},
                 {"keep_fp32", c.keep_fp32},
                 {"half_modules", c.half_modules},
                 {"loss_scaling", c.loss_scaling},
                 {"stochastic_rounding", c.stochastic_rounding},
                 {"stochastic_outputs", c.stochastic_outputs},
                 {"partials", c.partials},
                 {"accum_type", c.accum_type},
                 {"first_moment_type", c.first_moment_type},
                 {"second_moment_type", c.second_moment_type},
                 {"memory_budget", c.memory_budget},
                 {"gradient_accumulation", c.gradient_accumulation},
                 {"accumulation_reduction", c.accumulation_reduction},
                 {"device_iterations", c.device_iterations},
                 {"output_mode", c.output_mode},
                 {"output_return_period", c.output_return_period},
                 {"eight_bit_io", c.eight_bit_io},
                 {"detect_anomaly", c.detect_anomaly},
                 {"profile", c.profile},
                 {"update_in_backward", c.update_in_backward},
                 {"recompute", c.recompute},
                 {"numerics_report", c.numerics_report},
                 {"async_dataloader", c.async_loader},
                 {"workers", c.async_loader ? c.workers : 0}};
  j["step_losses"] = r.step_losses;
  j["epochs"] = json::array();
  for (auto& e : r.epochs)
    j["epochs"].push_back({{"epoch", e.epoch},
                           {"loss", e.loss},
                           {"train_accuracy", e.train_accuracy},
                           {"seconds", e.seconds},
                           {"images_per_second", e.images_per_second},
                           {"steps", e.steps}});
  j["test_accuracy"] = r.test_accuracy ? json(*r.test_accuracy) : json(nullptr);
  j["test_examples"] = r.test_examples;
  j["images_per_second"] = r.images_per_second;
  j["train_seconds"] = r.train_seconds;
  j["step_seconds"] = r.step_seconds;
  j["data_wait_seconds"] = r.data_wait_seconds;
  j["flops_per_image"] = r.flops_per_image;
  j["gflops_per_second"] = r.gflops_per_second;
  j["calls"] = r.calls;
  j["input_bytes"] = r.input_bytes;
  j["host_seconds_per_step"] = r.host_seconds_per_step;
  j["interrupted"] = r.interrupted;
  j["steps"] = r.steps;
  if (c.profile) {
    json rows = json::array();
    for (const ProfileRow& p : r.profile)
      rows.push_back({{"phase", p.phase},
                      {"module", p.where},
                      {"op", p.op},
                      {"calls", p.calls},
                      {"seconds", p.seconds}});
    j["profile"] = {{"steps", r.profiled_steps}, {"rows", rows}};
  }
  json peak = {{"total", r.memory.peak_total}};
  for (MemoryCategory cat : kAllMemoryCategories)
    peak[std::string(memory_category_name(cat))] = r.memory.peak_of(cat);
  j["peak_memory_bytes"] = peak;
  // What the total peak was made of (the per-category peaks above may come at other moments).
  json at_peak = json::object();
  for (MemoryCategory cat : kAllMemoryCategories)
    at_peak[std::string(memory_category_name(cat))] =
        r.memory.at_peak_total[static_cast<size_t>(cat)];
  j["memory_at_peak_bytes"] = at_peak;
  if (r.loss_scale) {
    json h = json::array();
    for (const amp::ScaleChange& ch : r.loss_scale_history)
      h.push_back({{"step", ch.step}, {"scale", ch.scale}, {"overflow", ch.overflow}});
    j["loss_scale"] = {
        {"final", *r.loss_scale}, {"skipped_steps", r.skipped_steps}, {"history", h}};
  } else {
    j["loss_scale"] = nullptr;
  }
  return j.dump(2) + "\n";
}

EvalResult evaluate_checkpoint(const std::string& path, const std::string& dataset_in,
                               const std::string& data_dir, int64_t test_limit,
                               int64_t batch_size) {
  const io::SafetensorsFile f = io::load_safetensors(path);
  const std::string model = meta(f, "model", path);
  nn::ModelConfig mc = model_config_from(f, path);
  auto m = nn::make_model(model, mc);
  m->load_state_dict(model_tensors(f), path);
  TrainConfig c;
  c.model = model;
  c.dataset = dataset_in.empty() ? meta(f, "dataset", path) : dataset_in;
  c.data_dir = data_dir;
  c.image_size = mc.image_size;
  c.test_limit = test_limit;
  c.eval_batch_size = batch_size;
  // The synthetic dataset is made from the run's seed and size.
  if (f.metadata.count("seed")) c.seed = static_cast<uint64_t>(meta_int(f, "seed", path));
  if (f.metadata.count("synthetic_size")) c.synthetic_size = meta_int(f, "synthetic_size", path);
  return evaluate_split(*m, c, path);
}

}  // namespace mantissa::train

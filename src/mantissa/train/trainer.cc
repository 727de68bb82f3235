#include "mantissa/train/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>

#include "mantissa/autograd/autograd.h"
#include "mantissa/core/error.h"
#include "mantissa/core/parallel.h"
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

data::LoaderConfig loader_config(const TrainConfig& c, bool train, int64_t channels) {
  data::LoaderConfig lc;
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
                          const std::string& source = "the model") {
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
  while (auto batch = loader.next()) {
    Tensor out = m(batch->images);
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
              double images, double loss, double acc, bool final) {
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
    char line[256];
    std::snprintf(line, sizeof line,
                  "epoch %lld/%lld %3d%%|%s| %lld/%lld [%s<%s, %.2f it/s, %.0f img/s, loss=%.4f, "
                  "acc=%.2f%%]",
                  static_cast<long long>(epoch), static_cast<long long>(epochs),
                  static_cast<int>(frac * 100), bar.c_str(), static_cast<long long>(done),
                  static_cast<long long>(total), clock_str(elapsed).c_str(), clock_str(eta).c_str(),
                  rate, elapsed > 0 ? images / elapsed : 0, loss, acc * 100);
    *os_ << (tty_ ? "\r" : "") << line << (tty_ && !final ? "" : "\n") << std::flush;
  }

 private:
  std::ostream* os_;
  bool enabled_, tty_ = false;
  Clock::time_point last_{};
};

// Output files are checked before training starts, so a run does not end in a write error.
void check_output_path(const std::string& path, const char* flag) {
  if (path.empty()) return;
  namespace fs = std::filesystem;
  const fs::path p(path);
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  std::error_code ec;
  MANTISSA_CHECK(fs::is_directory(dir, ec),
                 std::string(flag) + " " + path + ": directory " + dir.string() + " does not exist",
                 "create the directory first, or choose another path");
  MANTISSA_CHECK(
      ::access(dir.c_str(), W_OK) == 0,
      std::string(flag) + " " + path + ": directory " + dir.string() + " is not writable",
      "choose a directory you can write to");
  MANTISSA_CHECK(!fs::is_directory(p, ec), std::string(flag) + " " + path + " is a directory",
                 "give a file name");
}

}  // namespace

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
  check_output_path(c.save, "--save");
  check_output_path(c.metrics_json, "--metrics-json");
  MANTISSA_CHECK(c.init_from.empty() || c.resume.empty(),
                 "--init-from and --resume cannot be used together",
                 "--resume restores the weights itself; use one of them");
  optim::parse_schedule(c.lr_schedule);
}

Trainer::Trainer(const TrainConfig& config, TrainStreams streams)
    : config_(config), streams_(streams) {
  validate(config_);
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

  auto params = model_->named_parameters();
  const double wd = config_.effective_weight_decay();
  if (config_.optimizer == "sgd") {
    optim::SgdOptions o;
    o.lr = config_.lr;
    o.momentum = config_.momentum;
    o.nesterov = config_.nesterov;
    o.weight_decay = wd;
    optimizer_ = std::make_unique<optim::Sgd>(params, o);
  } else {
    optim::AdamOptions o;
    o.lr = config_.lr;
    o.beta1 = config_.beta1;
    o.beta2 = config_.beta2;
    o.eps = config_.eps;
    o.bias_correction = config_.bias_correction;
    o.weight_decay = wd;
    optimizer_ = std::make_unique<optim::Adam>(params, o, config_.optimizer == "adamw");
  }
  schedule_.kind = optim::parse_schedule(config_.lr_schedule);
  schedule_.warmup_steps = config_.warmup_steps;
  schedule_.step_size = config_.lr_step_size;
  schedule_.gamma = config_.lr_gamma;
  loader_ = std::make_unique<data::Loader>(train_data_,
                                           loader_config(config_, true, train_data_.channels()));
  const int64_t bpe = loader_->batches_per_epoch();
  // The schedule spans --epochs; --max-steps only stops early, so a run stopped and resumed
  // follows the same learning rates as one that was not.
  schedule_.total_steps = config_.epochs * bpe;
  if (!config_.resume.empty()) load_checkpoint(config_.resume);
}

Trainer::~Trainer() = default;

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
      {"synthetic_size", std::to_string(config_.synthetic_size)},
      {"step_losses", losses.dump()},
  };
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
  const int64_t bpe = loader_->batches_per_epoch();
  const int64_t total = config_.max_steps > 0 ? std::min(config_.max_steps, schedule_.total_steps)
                                              : schedule_.total_steps;
  const int64_t epochs = (total + bpe - 1) / bpe;
  const auto params = model_->named_parameters();
  ProgressBar bar(streams_.progress, config_.progress);
  model_->train();
  const auto t_train = Clock::now();
  int64_t images_total = 0;
  while (step_ < total) {
    const int64_t epoch = step_ / bpe;
    const int64_t last = std::min(total, (epoch + 1) * bpe);
    loader_->start(epoch, step_ % bpe);
    EpochStats es;
    es.epoch = epoch + 1;
    const auto t0 = Clock::now();
    double loss_sum = 0;
    int64_t correct = 0, seen = 0;
    const int64_t first = step_;
    while (step_ < last) {
      std::optional<data::Batch> batch = loader_->next();
      if (!batch) break;
      nn::set_random_context({config_.seed, static_cast<uint64_t>(step_)});
      optimizer_->set_lr(schedule_.lr_at(config_.lr, step_));
      Tensor out = (*model_)(batch->images);
      Tensor loss = model_->loss(out, batch->labels);
      autograd::backward(loss);
      if (config_.max_grad_norm > 0) optim::clip_grad_norm(params, config_.max_grad_norm);
      optimizer_->step();
      optimizer_->zero_grad();
      const float l = static_cast<float>(loss.item());
      MANTISSA_CHECK(std::isfinite(l),
                     "the loss became " + std::string(std::isnan(l) ? "nan" : "inf") + " at step " +
                         std::to_string(step_ + 1),
                     "lower --lr, or set --max-grad-norm");
      step_losses_.push_back(l);
      loss_sum += l;
      correct += count_correct(out.detach(), batch->labels);
      seen += batch->labels.size(0);
      ++step_;
      es.steps = step_ - first;
      bar.update(es.epoch, epochs, step_ - epoch * bpe, last - epoch * bpe, seconds_since(t0),
                 static_cast<double>(seen), loss_sum / static_cast<double>(es.steps),
                 static_cast<double>(correct) / static_cast<double>(seen), step_ == last);
    }
    es.seconds = seconds_since(t0);
    es.loss = es.steps > 0 ? loss_sum / static_cast<double>(es.steps) : 0;
    es.train_accuracy = seen > 0 ? static_cast<double>(correct) / static_cast<double>(seen) : 0;
    es.images_per_second = es.seconds > 0 ? static_cast<double>(seen) / es.seconds : 0;
    images_total += seen;
    result.epochs.push_back(es);
    if (streams_.out)
      *streams_.out << "epoch " << es.epoch << ": loss " << fmt("%.4f", es.loss)
                    << ", train accuracy " << fmt("%.2f", es.train_accuracy * 100) << "%, "
                    << fmt("%.1f", es.seconds) << " s, " << fmt("%.1f", es.images_per_second)
                    << " images/s" << std::endl;
    if (!config_.save.empty() && step_ < total) save_checkpoint(config_.save);
  }
  result.train_seconds = seconds_since(t_train);
  result.images_per_second =
      result.train_seconds > 0 ? static_cast<double>(images_total) / result.train_seconds : 0;
  result.data_wait_seconds = loader_->wait_seconds();
}

TrainResult Trainer::run() {
  TrainResult r;
  default_memory_tracker().reset_peaks();
  train_steps(r);
  r.memory = default_memory_tracker().stats();
  r.steps = step_;
  r.step_losses = step_losses_;
  if (!config_.save.empty()) save_checkpoint(config_.save);
  if (config_.evaluate) {
    r.test_accuracy = evaluate(&r.test_examples);
    if (streams_.out)
      *streams_.out << "test accuracy: " << fmt("%.2f", *r.test_accuracy * 100) << "% ("
                    << r.test_examples << " images)" << std::endl;
  }
  if (streams_.out && r.train_seconds > 0)
    *streams_.out << "training: " << fmt("%.1f", r.images_per_second) << " images/s, waited "
                  << fmt("%.2f", r.data_wait_seconds) << " s for data, peak memory "
                  << format_bytes(r.memory.peak_total) << std::endl;
  if (!config_.metrics_json.empty())
    write_file_atomic(config_.metrics_json, metrics_json(config_, r));
  return r;
}

double Trainer::evaluate(int64_t* examples) {
  const EvalResult r = evaluate_split(*model_, config_);
  if (examples) *examples = r.examples;
  return r.accuracy;
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
                 {"resume", c.resume}};
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
  j["data_wait_seconds"] = r.data_wait_seconds;
  j["steps"] = r.steps;
  json peak = {{"total", r.memory.peak_total}};
  for (MemoryCategory cat : kAllMemoryCategories)
    peak[std::string(memory_category_name(cat))] = r.memory.peak_of(cat);
  j["peak_memory_bytes"] = peak;
  return j.dump(2) + "\n";
}

void write_file_atomic(const std::string& path, const std::string& text) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::error_code ec;
  MANTISSA_CHECK(fs::is_directory(dir, ec),
                 "cannot write " + path + ": directory " + dir.string() + " does not exist",
                 "create the directory first, or choose another path");
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    MANTISSA_CHECK(f.good(), "cannot write " + tmp, "check that the directory is writable");
    f << text;
    f.flush();
    if (!f.good()) {
      f.close();
      fs::remove(tmp, ec);
      throw Error("writing " + tmp + " failed (disk full?)", "free some space and run again");
    }
  }
  fs::rename(tmp, target, ec);
  if (ec) {
    fs::remove(tmp, ec);
    throw Error("cannot rename " + tmp + " to " + path, "check that the directory is writable");
  }
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

#include "mantissa/train/checkpoint.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "mantissa/core/checked.h"
#include "mantissa/core/error.h"
#include "mantissa/core/memory.h"
#include "mantissa/data/datasets.h"
#include "mantissa/io/json_fields.h"
#include "mantissa/io/safetensors.h"
#include "mantissa/ops/autocast.h"
#include "mantissa/train/run_data.h"

namespace mantissa::train {
namespace {

using json = nlohmann::json;

constexpr const char* kFormat = "mantissa-checkpoint-1";
constexpr const char* kOptimizerPrefix = "optimizer.";
// How many optimizer state tensors the checkpoint was written with: a resume refuses a file
// that lost some, rather than re-initialise their state (which would not continue the run bit
// for bit). Files written before it was recorded are checked by the optimizer alone.
constexpr const char* kOptimizerTensors = "optimizer_state_tensors";

std::map<std::string, Tensor> model_tensors(const io::SafetensorsFile& f) {
  std::map<std::string, Tensor> out;
  for (auto& [name, t] : f.tensors)
    if (name.rfind(kOptimizerPrefix, 0) != 0) out.emplace(name, t);
  return out;
}

// O2 as earlier builds stored it: the model in 16 bits beside FP32 master copies in the optimizer
// ("optimizer.<param>.master"). Its arithmetic is this build's O2 (the FP32 parameters are the
// masters, read as 16-bit): the settings line it recorded, rewritten as this build prints it, or
// nullopt for any other line.
std::optional<std::string> stored_o2_settings(const std::string& line) {
  for (const char* h : {"f16", "bf16"}) {
    const std::string old = std::string("precision O2: parameters ") + h +
                            " (normalization layers f32), input f32, autocast off, "
                            "master weights f32, ";
    if (line.rfind(old, 0) != 0) continue;
    return std::string("precision O2: parameters f32, read as ") + h +
           " (normalization layers f32), input " + h +
           ", autocast off, master weights f32 (the parameters), " + line.substr(old.size());
  }
  return std::nullopt;
}

std::string meta(const io::SafetensorsFile& f, const std::string& key, const std::string& path) {
  auto it = f.metadata.find(key);
  MANTISSA_CHECK(
      it != f.metadata.end(),
      path + " is not a Mantissa checkpoint (no '" + key + "' in its metadata)",
      "pass a file written by 'mantissa train --save'; for weights alone use --init-from");
  return it->second;
}

// An integer of the metadata, checked to lie in [min, max] before anything is sized or counted
// from it: a damaged or hand-made file is refused here, not as gigabytes allocated later.
int64_t meta_int(const io::SafetensorsFile& f, const std::string& key, const std::string& path,
                 int64_t min, int64_t max) {
  const std::string v = meta(f, key, path);
  const size_t sign = !v.empty() && v[0] == '-' ? 1 : 0;
  std::optional<long long> x;
  if (v.size() > sign && v.find_first_not_of("0123456789", sign) == std::string::npos) {
    try {
      x = std::stoll(v);
    } catch (const std::exception&) {  // past int64_t: reported as out of range below
      x = sign ? std::numeric_limits<long long>::min() : std::numeric_limits<long long>::max();
    }
  }
  MANTISSA_CHECK(x.has_value(),
                 path + ": metadata '" + key + "' is not an integer ('" + excerpt(v) + "')",
                 "the file is damaged: use an intact checkpoint");
  MANTISSA_CHECK(*x >= min && *x <= max,
                 path + ": metadata '" + key + "' is " + excerpt(v) + ", outside [" +
                     std::to_string(min) + ", " + std::to_string(max) + "]",
                 "the file is damaged: use an intact checkpoint");
  return *x;
}

uint64_t meta_u64(const io::SafetensorsFile& f, const std::string& key, const std::string& path) {
  const std::string v = meta(f, key, path);
  const bool digits = !v.empty() && v.find_first_not_of("0123456789") == std::string::npos;
  std::optional<unsigned long long> x;
  if (digits) {
    try {
      x = std::stoull(v);
    } catch (const std::exception&) {
    }
  }
  MANTISSA_CHECK(
      x.has_value(),
      path + ": metadata '" + key + "' is not an unsigned 64-bit integer ('" + excerpt(v) + "')",
      "the file is damaged: use an intact checkpoint");
  return *x;
}

// A metadata entry that names one of `names` (what: "a model of this build"); another value is a
// damaged file, refused with `hint`.
std::string meta_one_of(const io::SafetensorsFile& f, const std::string& key,
                        const std::string& path, const std::vector<std::string>& names,
                        const std::string& what, const std::string& hint) {
  const std::string v = meta(f, key, path);
  MANTISSA_CHECK(std::find(names.begin(), names.end(), v) != names.end(),
                 path + ": metadata '" + key + "' is '" + excerpt(v) + "', not " + what, hint);
  return v;
}

// The bounds of the model's geometry in a checkpoint: far beyond the built-in models and
// datasets (1 or 3 channels, 1000 classes), and small enough that a model sized from them is not
// an allocation of the address space.
constexpr int64_t kMaxChannels = 1024;
constexpr int64_t kMaxClasses = int64_t{1} << 20;
constexpr int64_t kMaxRanks = int64_t{1} << 20;  // processes of a data-parallel job

bool is_user_model(const io::SafetensorsFile& f) {
  auto it = f.metadata.find("user_model");
  return it != f.metadata.end() && it->second == "true";
}

nn::ModelConfig model_config_from(const io::SafetensorsFile& f, const std::string& path) {
  nn::ModelConfig mc;
  mc.in_channels = meta_int(f, "in_channels", path, 1, kMaxChannels);
  mc.image_size = meta_int(f, "image_size", path, 1, kMaxImageSize);
  mc.num_classes = meta_int(f, "num_classes", path, 1, kMaxClasses);
  mc.imagenet_stem = meta(f, "imagenet_stem", path) == "true";
  return mc;
}

// The checkpoint holds `run`'s model: the same built-in model and image geometry, or a
// user-defined model of the same type (its tensors are compared as they are loaded).
void check_model(const io::SafetensorsFile& f, const std::string& path, const CheckpointRun& run,
                 const nn::Classifier& model) {
  const std::string saved_name = meta(f, "model", path);
  const std::string saved = excerpt(saved_name);  // as messages quote it
  if (is_user_model(f) != run.user_model) {
    throw Error(path + " is a checkpoint of " +
                    (run.user_model ? "the built-in model " + saved
                                    : "a user-defined model (" + saved + ")") +
                    ", not of " + run.model,
                run.user_model ? "resume it with 'mantissa train --model " + saved + "'"
                               : "resume it from C++, into the model it was saved from");
  }
  if (run.user_model) {
    MANTISSA_CHECK(saved_name == run.model,
                   path + " is a checkpoint of " + saved + ", not of " + run.model,
                   "resume into the model the checkpoint was saved from");
    return;
  }
  MANTISSA_CHECK(saved_name == run.model,
                 path + " is a checkpoint of " + saved + ", not of " + run.model,
                 "pass --model " + saved + " to resume it");
  const nn::ModelConfig s = model_config_from(f, path);
  const nn::ModelConfig& mc = model.config();
  MANTISSA_CHECK(s.image_size == mc.image_size && s.in_channels == mc.in_channels &&
                     s.num_classes == mc.num_classes,
                 path + " was trained on " + std::to_string(s.in_channels) + "x" +
                     std::to_string(s.image_size) + "x" + std::to_string(s.image_size) +
                     " images of " + std::to_string(s.num_classes) + " classes, not " +
                     std::to_string(mc.in_channels) + "x" + std::to_string(mc.image_size) + "x" +
                     std::to_string(mc.image_size) + " of " + std::to_string(mc.num_classes),
                 "resume with the --image-size and --dataset of the original run");
}

// The model a checkpoint's metadata describes, built with no more memory than the file's own
// tensors could fill (twice their bytes: 16-bit values widen to FP32), so that geometry a damaged
// file declares (a 16384-pixel image through LeNet-5's first linear layer) is refused as such
// before it costs gigabytes.
template <typename Build>
auto build_within_file(const io::SafetensorsFile& f, const std::string& path, Build build) {
  size_t file_bytes = 0;
  for (const auto& [name, t] : f.tensors) file_bytes += t.nbytes();
  MemoryTracker& tracker = default_memory_tracker();
  const std::optional<size_t> previous = tracker.budget();
  const size_t current = tracker.stats().current_total;
  const size_t allowance = 2 * file_bytes + (size_t{1} << 20);
  size_t budget = allowance > SIZE_MAX - current ? SIZE_MAX : current + allowance;
  if (previous) budget = std::min(budget, *previous);
  tracker.set_budget(budget);
  try {
    auto model = build();
    tracker.set_budget(previous);
    return model;
  } catch (const OutOfMemoryError& e) {
    tracker.set_budget(previous);
    if (previous && budget == *previous) throw;  // the process's own budget: a real shortage
    throw Error(path +
                    ": its metadata (in_channels, image_size, num_classes) describes a model "
                    "larger than the tensors the file holds",
                "the file is damaged: evaluate an intact checkpoint");
  } catch (...) {
    tracker.set_budget(previous);
    throw;
  }
}

// A number as the shortest text that reads back to it (0.001, not 0.0010000000000000000208).
std::string number_text(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::general);
  return std::string(buf, r.ptr);
}

// The op lists of automatic casting, as checkpoints record them.
constexpr const char* kOpLists = "autocast_op_lists";
constexpr std::pair<const char*, ops::AutocastCategory> kListedCategories[] = {
    {"lower-precision", ops::AutocastCategory::kLowerPrecision},
    {"fp32", ops::AutocastCategory::kFp32}};

std::string op_lists_json(const ops::AutocastPolicy& policy) {
  json lists = json::object();
  for (const auto& [key, category] : kListedCategories) {
    json names = json::array();
    for (ops::OpId id : policy.list(category)) names.push_back(std::string(ops::op_info(id).name));
    lists[key] = names;
  }
  return lists.dump();
}

// The op lists a checkpoint records: an object of both lists, each of op names that a policy
// takes; anything else is a damaged file.
json recorded_op_lists(const io::SafetensorsFile& f, const std::string& path) {
  const auto damaged = [&](const std::string& what) {
    return Error(path + ": metadata '" + kOpLists + "' " + what,
                 "the file is damaged: resume from an intact checkpoint");
  };
  json lists;
  try {
    lists = json::parse(f.metadata.at(kOpLists));
  } catch (const json::exception&) {
    throw damaged("is not JSON");
  }
  if (!lists.is_object()) throw damaged("is not a JSON object");
  std::optional<std::vector<std::string>> names[2];
  for (size_t i = 0; i < 2; ++i) {
    const char* key = kListedCategories[i].first;
    if (!lists.contains(key) || !lists.at(key).is_array())
      throw damaged("holds no list '" + std::string(key) + "'");
    names[i].emplace();
    for (const json& n : lists.at(key)) {
      if (!n.is_string()) throw damaged("holds an op name that is not text");
      names[i]->push_back(n.get<std::string>());
    }
  }
  try {
    ops::AutocastPolicy().replace_lists(names[0], names[1]);
  } catch (const Error& e) {
    throw damaged("is not a policy's lists (" + e.message() + ")");
  }
  return lists;
}

// A precision settings line without the op-list files it names (they come last in the line).
std::string without_op_list_files(const std::string& line) {
  size_t cut = line.size();
  for (const char* from : {", lower-precision ops from ", ", fp32 ops from "})
    cut = std::min(cut, line.find(from));
  return line.substr(0, cut);
}

// A recorded setting that a bit-exact continuation needs unchanged. Throws naming the recorded and
// the given value when they differ; a key the checkpoint does not record is not compared.
void check_recorded(const io::SafetensorsFile& f, const std::string& path, const std::string& key,
                    const std::string& given, const std::string& setting, const std::string& why,
                    const std::string& fix) {
  auto it = f.metadata.find(key);
  if (it == f.metadata.end() || it->second == given) return;
  auto shown = [](const std::string& v) {
    return v.find(' ') == std::string::npos ? v : "'" + v + "'";
  };
  throw Error(path + " was trained with " + setting + " " + shown(it->second) + ", not " +
                  shown(given) + ": " + why,
              fix.empty() ? "pass " + setting + " " + it->second + " to resume it" : fix);
}

// The steps the loss scaler skipped, for the metrics of a resumed run.
constexpr const char* kSkipped = "loss_scale_skipped";

constexpr const char* kDamaged = "the file is damaged: resume from an intact checkpoint";

// Whether `value` is one a changeable setting's flag takes, as the checkpoint writes it (a
// number as number_text writes it, a count, true or false, a name). A flag this build does not
// know is not compared, so any value passes.
bool valid_changeable(const std::string& flag, const std::string& value) {
  const auto number = [&](double lo, bool lo_open, double hi) {
    double v = 0;
    const char* end = value.data() + value.size();
    const auto r = std::from_chars(value.data(), end, v);
    return !value.empty() && r.ec == std::errc() && r.ptr == end && std::isfinite(v) &&
           (lo_open ? v > lo : v >= lo) && v < hi;
  };
  const auto count = [&](int64_t lo) {
    if (value.empty() || value.size() > 16 ||
        value.find_first_not_of("0123456789") != std::string::npos)
      return false;
    const int64_t v = std::stoll(value);
    return v >= lo && v <= kMaxCount;
  };
  const auto one_of = [&](std::initializer_list<const char*> names) {
    return std::any_of(names.begin(), names.end(), [&](const char* n) { return value == n; });
  };
  const double inf = std::numeric_limits<double>::infinity();
  if (flag == "--lr" || flag == "--lr-gamma") return number(0, true, inf);
  if (flag == "--weight-decay" || flag == "--eps" || flag == "--max-grad-norm")
    return number(0, false, inf);
  if (flag == "--momentum" || flag == "--beta1" || flag == "--beta2") return number(0, false, 1);
  if (flag == "--warmup-steps") return count(0);
  if (flag == "--lr-step-size" || flag == "--epochs") return count(1);
  if (flag == "--nesterov" || flag == "--no-bias-correction") return one_of({"true", "false"});
  if (flag == "--lr-schedule") return one_of({"constant", "step", "cosine"});
  if (flag == "--accumulation-reduction") return one_of({"mean", "running", "sum"});
  return true;
}

// What a resume reads from a checkpoint's metadata besides the model and optimizer tensors, each
// value checked before anything compares it with a flag or counts from it.
struct Position {
  int64_t step = 0, optimizer_steps = 0;
  std::vector<float> step_losses;
  std::vector<int64_t> skipped_steps;
};

// Checks every metadata value a resume compares with the run's flags or counts from: a value a
// flag would refuse (a precision, model, dataset or optimizer this build does not have, a seed or
// size that is not one, a changeable setting's value its flag would not take) and counts that
// contradict each other (more or fewer step losses than steps, more optimizer steps than steps,
// or other than the steps the loss scaler did not skip) are a damaged file, reported as such
// rather than as a flag to pass.
Position check_metadata(const io::SafetensorsFile& f, const std::string& path) {
  const auto damaged = [&](const std::string& key, const std::string& what) {
    return Error(path + ": metadata '" + key + "' " + what, kDamaged);
  };
  const auto has = [&](const char* key) { return f.metadata.count(key) > 0; };
  const auto one_of = [&](const char* key, const std::vector<std::string>& names,
                          const std::string& what) {
    meta_one_of(f, key, path, names, what, kDamaged);
  };
  const bool user = is_user_model(f);
  if (!user) {
    one_of("model", nn::model_names(), "a model of this build");
    model_config_from(f, path);
    if (has("dataset")) one_of("dataset", data::dataset_names(), "a dataset of this build");
    if (has("synthetic_size")) meta_int(f, "synthetic_size", path, 1, kMaxCount);
  }
  one_of("optimizer", {"sgd", "adam", "adamw"}, "an optimizer of this build");
  if (has("precision")) one_of("precision", amp::precision_names(), "a precision of this build");
  for (const char* key : {"seed", "stochastic_rounding_seed"})
    if (has(key)) meta_u64(f, key, path);
  if (has("batch_size")) meta_int(f, "batch_size", path, 1, kMaxCount);
  if (has("gradient_accumulation")) meta_int(f, "gradient_accumulation", path, 1, kMaxCount);
  if (has("world_size")) meta_int(f, "world_size", path, 1, kMaxRanks);
  if (has("train_limit")) meta_int(f, "train_limit", path, 0, kMaxCount);
  if (has(kOptimizerTensors)) meta_int(f, kOptimizerTensors, path, 0, kMaxCount);
  for (const char* key : {"shuffle", "augment", "eight_bit_io", "imagenet_stem"})
    if (has(key)) one_of(key, {"true", "false"}, "true or false");
  if (has(kOpLists)) recorded_op_lists(f, path);

  Position p;
  p.step = meta_int(f, "step", path, 0, kMaxCount);
  try {
    const json losses = json::parse(meta(f, "step_losses", path));
    if (!losses.is_array()) throw json::type_error::create(302, "not an array", nullptr);
    for (auto& v : losses) p.step_losses.push_back(v.get<float>());
  } catch (const json::exception& e) {
    throw Error(path + ": metadata 'step_losses' is not a JSON list of numbers", kDamaged);
  }
  if (static_cast<int64_t>(p.step_losses.size()) != p.step)
    throw damaged("step_losses", "holds " + std::to_string(p.step_losses.size()) +
                                     " losses for the checkpoint's " + std::to_string(p.step) +
                                     " steps");
  // Every step updates the weights but those the loss scaler skipped.
  int64_t skipped = 0;
  if (has("loss_scaler")) {
    amp::LossScaler scaler;
    scaler.load_json(f.metadata.at("loss_scaler"), path);
    skipped = scaler.skipped_steps();
    if (scaler.steps() != p.step)
      throw damaged("loss_scaler", "counts " + std::to_string(scaler.steps()) +
                                       " steps, the checkpoint " + std::to_string(p.step));
  }
  if (has(kSkipped)) {
    // The skipped steps: as many as the scaler counts, each a step of the run, in order.
    json steps;
    try {
      steps = json::parse(f.metadata.at(kSkipped));
    } catch (const json::exception&) {
      throw damaged(kSkipped, "is not JSON");
    }
    if (!steps.is_array()) throw damaged(kSkipped, "is not a JSON list");
    for (const json& v : steps) {
      const std::optional<int64_t> k = io::json_integer(v, 1, p.step);
      if (!k || (!p.skipped_steps.empty() && *k <= p.skipped_steps.back()))
        throw damaged(kSkipped,
                      "is not a rising list of steps from 1 to " + std::to_string(p.step));
      p.skipped_steps.push_back(*k);
    }
    if (!has("loss_scaler") || static_cast<int64_t>(p.skipped_steps.size()) != skipped)
      throw damaged(kSkipped, "lists " + std::to_string(p.skipped_steps.size()) +
                                  " steps, the loss scaler skipped " + std::to_string(skipped));
  }
  p.optimizer_steps = meta_int(f, "optimizer_steps", path, 0, kMaxCount);
  if (p.optimizer_steps != p.step - skipped)
    throw damaged("optimizer_steps",
                  "is " + std::to_string(p.optimizer_steps) + ", not the " +
                      std::to_string(p.step - skipped) + " steps of the checkpoint's " +
                      std::to_string(p.step) + " that updated the weights" +
                      (skipped ? " (" + std::to_string(skipped) + " skipped)" : ""));
  if (has("changeable_settings")) {
    json recorded;
    try {
      recorded = json::parse(f.metadata.at("changeable_settings"));
    } catch (const json::exception&) {
      throw damaged("changeable_settings", "is not JSON");
    }
    if (!recorded.is_object()) throw damaged("changeable_settings", "is not a JSON object");
    for (const auto& [flag, value] : recorded.items()) {
      if (!value.is_string())
        throw damaged("changeable_settings", "holds a " + excerpt(flag) + " that is not text");
      if (!valid_changeable(flag, value.get<std::string>()))
        throw damaged("changeable_settings", "holds " + excerpt(flag) + " '" +
                                                 excerpt(value.get<std::string>()) +
                                                 "', which the flag does not take");
    }
  }
  return p;
}

// The changeable settings that differ from the checkpoint's, in one line ("" when none), after
// `split`: the same global batch split otherwise ("" when it is not).
std::string changes_of(const io::SafetensorsFile& f, const std::string& path,
                       const CheckpointRun& run, int64_t step, const std::string& split) {
  std::string changes = split;
  auto it = f.metadata.find("changeable_settings");
  const json recorded =
      it == f.metadata.end() ? json::object() : json::parse(it->second);  // checked on reading
  for (const auto& [flag, value] : run.changeable) {
    if (!recorded.contains(flag)) continue;
    const std::string was = recorded[flag].get<std::string>();
    if (was != value)
      changes +=
          (changes.empty() ? "" : ", ") + flag + " " + value + " (the checkpoint's: " + was + ")";
  }
  if (changes.empty()) return {};
  return "resuming " + path + " at step " + std::to_string(step) +
         " with settings that change the run from there: " + changes;
}

}  // namespace

CheckpointRun checkpoint_run(const TrainConfig& c, const RunSettings& r, bool user_model) {
  CheckpointRun run;
  run.model = r.model;
  run.user_model = user_model;
  run.dataset = r.dataset;
  run.precision = r.precision.mode.name;
  run.seed = c.seed;
  run.batch_size = c.batch_size;
  run.gradient_accumulation = c.gradient_accumulation;
  run.synthetic_size = c.synthetic_size;
  run.train_limit = c.train_limit;
  run.shuffle = c.shuffle;
  run.augment = c.augment;
  run.eight_bit_io = c.eight_bit_io;
  run.precision_settings = r.precision.describe();
  amp::PrecisionSettings without_files = r.precision;
  without_files.autocast_lower_list.clear();
  without_files.autocast_fp32_list.clear();
  run.precision_settings_without_files = without_files.describe();
  if (r.precision.mode.autocast) run.autocast_op_lists = op_lists_json(r.precision.policy);
  auto flag = [](bool on) { return std::string(on ? "true" : "false"); };
  run.changeable = {
      {"--lr", number_text(c.lr)},
      {"--lr-schedule", c.lr_schedule},
      {"--warmup-steps", std::to_string(c.warmup_steps)},
      {"--lr-step-size", std::to_string(c.lr_step_size)},
      {"--lr-gamma", number_text(c.lr_gamma)},
      {"--weight-decay", number_text(r.weight_decay)},
      {"--momentum", number_text(c.momentum)},
      {"--nesterov", flag(c.nesterov)},
      {"--beta1", number_text(c.beta1)},
      {"--beta2", number_text(c.beta2)},
      {"--eps", number_text(c.eps)},
      {"--no-bias-correction", flag(!c.bias_correction)},
      {"--max-grad-norm", number_text(c.max_grad_norm)},
      {"--accumulation-reduction", c.accumulation_reduction},
  };
  // The cosine schedule spans --epochs: there a different number of epochs changes the learning
  // rates of the steps left (elsewhere it is just the run's length, which resuming may extend).
  if (r.schedule.kind == optim::LrSchedule::Kind::kCosine)
    run.changeable.emplace_back("--epochs", std::to_string(c.epochs));
  return run;
}

void save_checkpoint(const std::string& path, const CheckpointRun& run, nn::Classifier& model,
                     const optim::Optimizer& optimizer, const amp::LossScaler* scaler, int64_t step,
                     const std::vector<float>& step_losses,
                     const std::vector<std::pair<std::string, Tensor>>* optimizer_state,
                     const amp::Fp8State* fp8, const std::vector<int64_t>* skipped_steps) {
  std::vector<std::pair<std::string, Tensor>> tensors = model.state_dict();
  const auto& state = optimizer_state ? *optimizer_state : optimizer.state_tensors();
  for (auto& [name, t] : state) tensors.emplace_back(kOptimizerPrefix + name, t);
  const size_t optimizer_tensors = state.size();
  json losses = json::array();
  for (float l : step_losses) losses.push_back(l);
  std::map<std::string, std::string> m = {
      {"format", kFormat},
      {"model", run.model},
      {"dataset", run.dataset},
      {"optimizer", optimizer.name()},
      {"step", std::to_string(step)},
      {"optimizer_steps", std::to_string(optimizer.steps())},
      {kOptimizerTensors, std::to_string(optimizer_tensors)},
      {"seed", std::to_string(run.seed)},
      {"batch_size", std::to_string(run.batch_size)},
      {"gradient_accumulation", std::to_string(run.gradient_accumulation)},
      {"step_losses", losses.dump()},
      {"precision", run.precision},
  };
  if (run.user_model) {
    m["user_model"] = "true";
  } else {
    // What `mantissa eval` rebuilds the model and its dataset from.
    const nn::ModelConfig& mc = model.config();
    m["in_channels"] = std::to_string(mc.in_channels);
    m["image_size"] = std::to_string(mc.image_size);
    m["num_classes"] = std::to_string(mc.num_classes);
    m["imagenet_stem"] = mc.imagenet_stem ? "true" : "false";
    m["synthetic_size"] = std::to_string(run.synthetic_size);
  }
  if (run.world_size > 1) m["world_size"] = std::to_string(run.world_size);
  m["train_limit"] = std::to_string(run.train_limit);
  m["shuffle"] = run.shuffle ? "true" : "false";
  m["augment"] = run.augment ? "true" : "false";
  m["eight_bit_io"] = run.eight_bit_io ? "true" : "false";
  m["precision_settings"] = run.precision_settings;
  if (!run.autocast_op_lists.empty()) m[kOpLists] = run.autocast_op_lists;
  json changeable = json::object();
  for (const auto& [flag, value] : run.changeable) changeable[flag] = value;
  m["changeable_settings"] = changeable.dump();
  if (scaler) m["loss_scaler"] = scaler->to_json();
  if (scaler && skipped_steps) m[kSkipped] = json(*skipped_steps).dump();
  if (fp8) m["fp8"] = fp8->to_json();
  if (optimizer.stochastic_rounding())
    m["stochastic_rounding_seed"] = std::to_string(*optimizer.stochastic_rounding());
  io::save_safetensors(path, tensors, m);
}

Resumed load_checkpoint(const std::string& path, const CheckpointRun& run, nn::Classifier& model,
                        optim::Optimizer& optimizer, amp::LossScaler* scaler, amp::Fp8State* fp8) {
  return load_checkpoint(io::load_safetensors(path), path, run, model, optimizer, scaler, fp8);
}

Resumed load_checkpoint(const io::SafetensorsFile& f, const std::string& path,
                        const CheckpointRun& run, nn::Classifier& model,
                        optim::Optimizer& optimizer, amp::LossScaler* scaler, amp::Fp8State* fp8) {
  MANTISSA_CHECK(meta(f, "format", path) == kFormat,
                 path + " has checkpoint format '" + excerpt(meta(f, "format", path)) + "'",
                 std::string("this Mantissa reads ") + kFormat);
  const Position position = check_metadata(f, path);
  check_model(f, path, run, model);
  const std::string opt = meta(f, "optimizer", path);
  MANTISSA_CHECK(
      opt == optimizer.name(),
      path + " holds the state of optimizer " + excerpt(opt) + ", not " + optimizer.name(),
      "pass --optimizer " + excerpt(opt) + " to resume it");
  const std::string precision =
      f.metadata.count("precision") ? f.metadata.at("precision") : std::string("32-true");
  MANTISSA_CHECK(
      precision == run.precision,
      path + " was trained with --precision " + excerpt(precision) + ", not " + run.precision,
      "pass --precision " + excerpt(precision) + " to resume it");
  // The global batch (ranks x batch x accumulation) fixes which images each step trains on: the
  // same for any number of ranks.
  const int64_t ga = f.metadata.count("gradient_accumulation")
                         ? meta_int(f, "gradient_accumulation", path, 1, kMaxCount)
                         : 1;
  const int64_t ranks =
      f.metadata.count("world_size") ? meta_int(f, "world_size", path, 1, kMaxRanks) : 1;
  const int64_t batch = f.metadata.count("batch_size")
                            ? meta_int(f, "batch_size", path, 1, kMaxCount)
                            : run.batch_size;
  // The same global batch split otherwise (other ranks, batch size or accumulation): the same
  // images each step, summed in another order, which changes the run from there.
  std::string split;
  if (ranks == run.world_size && batch == run.batch_size) {
    MANTISSA_CHECK(ga == run.gradient_accumulation,
                   path + " was trained with --gradient-accumulation " + std::to_string(ga) +
                       ", not " + std::to_string(run.gradient_accumulation),
                   "pass --gradient-accumulation " + std::to_string(ga) + " to resume it");
  } else {
    // ranks x batch x accumulation, or nothing past int64_t (a damaged file's numbers).
    const auto product = [](int64_t r, int64_t b, int64_t a) -> std::optional<int64_t> {
      const std::optional<int64_t> rb = checked_mul(r, b);
      return rb ? checked_mul(*rb, a) : rb;
    };
    const auto global = [&](int64_t r, int64_t b, int64_t a) {
      const std::optional<int64_t> g = product(r, b, a);
      return (g ? std::to_string(*g) : std::string("more than 2^63")) + " (" + std::to_string(r) +
             " rank" + (r > 1 ? "s" : "") + " x --batch-size " + std::to_string(b) +
             " x --gradient-accumulation " + std::to_string(a) + ")";
    };
    const std::optional<int64_t> saved = product(ranks, batch, ga);
    MANTISSA_CHECK(
        saved && saved == product(run.world_size, run.batch_size, run.gradient_accumulation),
        path + " was trained with a global batch of " + global(ranks, batch, ga) + ", not " +
            global(run.world_size, run.batch_size, run.gradient_accumulation),
        "choose --batch-size and --gradient-accumulation so that ranks x batch x "
        "accumulation = " +
            (saved ? std::to_string(*saved) : std::string("the original run's")));
    const auto split_of = [](int64_t r, int64_t b, int64_t a) {
      return std::to_string(r) + " rank" + (r > 1 ? "s" : "") + " x --batch-size " +
             std::to_string(b) + " x --gradient-accumulation " + std::to_string(a);
    };
    split = "the global batch of " + std::to_string(*saved) + " as " +
            split_of(run.world_size, run.batch_size, run.gradient_accumulation) +
            " (the checkpoint's: " + split_of(ranks, batch, ga) + ")";
  }
  const std::string precision_flags =
      "resume with the precision flags of the original run (--precision, --partials, "
      "--accum-type, the state types, --loss-scaling and --loss-scale-*, --stochastic-rounding, "
      "--stochastic-outputs, --keep-fp32, --half-modules, the op lists)";
  // Kahan compensation and the FP8 recipe are compared where their state is read (the optimizer's
  // and Fp8State's loads name the flag that differs); the rest of the printed settings here.
  const auto compared_here = [](std::string settings) {
    if (const auto o2 = stored_o2_settings(settings)) settings = *o2;
    for (const auto& [from, to] :
         {std::pair<std::string, std::string>{", Kahan-compensated parameters", ""},
          {", fp8 linear and conv2d: ", ", fp32 accumulation"}}) {
      const size_t b = settings.find(from);
      if (b == std::string::npos) continue;
      const size_t e = to.empty() ? b + from.size() : settings.find(to, b);
      if (e != std::string::npos) settings.erase(b, e - b + (to.empty() ? 0 : to.size()));
    }
    // The numerics report an initial loss scale was read from: its value is compared (the
    // "initial" of the loss scaling), not the name of its file, which a resume may spell
    // otherwise or no longer have (--loss-scale-init with the value resumes it).
    const std::string report = ", initial loss scale from numerics report ";
    if (const size_t b = settings.find(report); b != std::string::npos) {
      size_t e = settings.size();
      for (const char* next : {", 16-bit modules ", ", fp32 modules ",
                               ", lower-precision ops from ", ", fp32 ops from "})
        e = std::min(e, settings.find(next, b + report.size()));
      settings.erase(b, e - b);
    }
    return settings;
  };
  // The op lists are compared as they were read, not by the names of their files (a checkpoint
  // that does not record them: by the files' names, in the settings line).
  const bool lists_recorded = f.metadata.count(kOpLists) > 0;
  io::SafetensorsFile recorded_settings;  // the metadata entry alone
  if (f.metadata.count("precision_settings")) {
    const std::string& line = f.metadata.at("precision_settings");
    recorded_settings.metadata["precision_settings"] =
        compared_here(lists_recorded ? without_op_list_files(line) : line);
  }
  check_recorded(
      recorded_settings, path, "precision_settings",
      compared_here(lists_recorded ? run.precision_settings_without_files : run.precision_settings),
      "the precision settings", "the dtypes of what is saved and how it is rounded",
      precision_flags);
  if (lists_recorded) {
    const json recorded = recorded_op_lists(f, path);
    const json given =
        run.autocast_op_lists.empty() ? json::object() : json::parse(run.autocast_op_lists);
    for (const auto& listed : kListedCategories) {
      const std::string key = listed.first;
      const auto names = [&](const json& lists) {
        std::string s;
        if (lists.contains(key))
          for (const json& n : lists.at(key)) {
            if (!s.empty()) s += ',';
            s += n.get<std::string>();
          }
        return s.empty() ? std::string("(none)") : s;
      };
      const std::string was = names(recorded), now = names(given);
      MANTISSA_CHECK(was == now,
                     path + " was trained with the " + key + " op list " + excerpt(was) + ", not " +
                         excerpt(now) + ": the dtypes ops compute in",
                     "resume with op-list files that list the ops of the original run "
                     "(--autocast-lower-list, --autocast-fp32-list; without them, the default "
                     "lists)");
    }
  }
  // The data order: the batch of a step is a function of the seed, the global batch (above) and
  // the data.
  const std::string order = "a bit-exact continuation needs the same batches";
  check_recorded(f, path, "seed", std::to_string(run.seed), "--seed", order, "");
  check_recorded(f, path, "dataset", run.dataset, run.user_model ? "the examples of" : "--dataset",
                 order,
                 run.user_model ? "resume on the examples the checkpoint was trained on" : "");
  if (!run.user_model && run.dataset == "synthetic")
    check_recorded(f, path, "synthetic_size", std::to_string(run.synthetic_size),
                   "--synthetic-size", order, "");
  const bool no_limit = f.metadata.count("train_limit") && f.metadata.at("train_limit") == "0";
  check_recorded(f, path, "train_limit", std::to_string(run.train_limit), "--train-limit", order,
                 no_limit ? "drop --train-limit to resume it" : "");
  check_recorded(f, path, "shuffle", run.shuffle ? "true" : "false", "shuffling", order,
                 run.shuffle ? "pass --no-shuffle to resume it" : "drop --no-shuffle to resume it");
  check_recorded(f, path, "augment", run.augment ? "true" : "false", "augmentation", order,
                 run.augment ? "drop --augment to resume it" : "pass --augment to resume it");
  check_recorded(
      f, path, "eight_bit_io", run.eight_bit_io ? "true" : "false", "--eight-bit-io", order,
      run.eight_bit_io ? "drop --eight-bit-io to resume it" : "pass --eight-bit-io to resume it");
  // The stochastic-rounding streams: the seed the checkpoint's writes used, read back.
  const std::optional<uint64_t> sr = optimizer.stochastic_rounding();
  auto it = f.metadata.find("stochastic_rounding_seed");
  const std::optional<std::string> recorded_sr =
      it == f.metadata.end() ? std::nullopt : std::optional<std::string>(it->second);
  MANTISSA_CHECK(
      recorded_sr.has_value() == sr.has_value(),
      path + (sr ? " was trained without stochastic rounding"
                 : " was trained with stochastic rounding"),
      sr ? "drop --stochastic-rounding to resume it" : "pass --stochastic-rounding to resume it");
  if (sr)
    MANTISSA_CHECK(*recorded_sr == std::to_string(*sr),
                   path + " was trained with stochastic-rounding seed " + *recorded_sr + ", not " +
                       std::to_string(*sr),
                   "resume with the --seed of the original run (the rounding streams derive "
                   "from it)");
  MANTISSA_CHECK(f.metadata.count("loss_scaler") == (scaler ? 1u : 0u),
                 path + (scaler ? " holds no loss-scaler state" : " holds loss-scaler state"),
                 "resume with the --loss-scaling of the original run");
  if (scaler) scaler->load_json(f.metadata.at("loss_scaler"), path);
  MANTISSA_CHECK(f.metadata.count("fp8") == (fp8 ? 1u : 0u),
                 path + (fp8 ? " holds no FP8 state" : " holds FP8 state"),
                 "resume with the --precision of the original run");
  if (fp8) fp8->load_json(f.metadata.at("fp8"), path);
  try {
    model.load_state_dict(model_tensors(f), path);
  } catch (const OutOfMemoryError&) {
    throw;
  } catch (const Error& e) {
    // The built-in models' hint names the flags that choose them; a user's model has none.
    if (!run.user_model) throw;
    throw Error(e.message(), "resume into the model the checkpoint was saved from");
  }
  std::map<std::string, Tensor> state;
  for (auto& [name, t] : f.tensors)
    if (name.rfind(kOptimizerPrefix, 0) == 0)
      state.emplace(name.substr(std::string(kOptimizerPrefix).size()), t);
  if (f.metadata.count(kOptimizerTensors)) {
    const int64_t saved = meta_int(f, kOptimizerTensors, path, 0, kMaxCount);
    MANTISSA_CHECK(static_cast<int64_t>(state.size()) == saved,
                   path + " holds " + std::to_string(state.size()) + " of the " +
                       std::to_string(saved) +
                       " optimizer state tensors it was written with: a resume would start their "
                       "state afresh and not continue the run bit for bit",
                   "the file is damaged: resume from an intact checkpoint, or start the run "
                   "from its weights with --init-from");
  }
  if (f.metadata.count("precision_settings") &&
      stored_o2_settings(f.metadata.at("precision_settings"))) {
    // The masters of O2's earlier layout are this build's FP32 parameters (the model's 16-bit
    // tensors, loaded above, are their rounding).
    for (const nn::Module::NamedTensor& p : model.named_parameters()) {
      auto it = state.find(p.name + ".master");
      if (it == state.end() || p.tensor->dtype() != DType::f32) continue;
      MANTISSA_CHECK(it->second.shape() == p.tensor->shape(),
                     path + ": the master weights of '" + p.name + "' have shape " +
                         shape_str(it->second.shape()) + ", the parameter " +
                         shape_str(p.tensor->shape()),
                     "the file is damaged: resume from an intact checkpoint");
      p.tensor->copy_from(it->second);
      state.erase(it);
    }
  }
  optimizer.load_state(state, position.optimizer_steps, path);
  Resumed r;
  r.step = position.step;
  r.step_losses = position.step_losses;
  r.skipped_steps = position.skipped_steps;
  r.note = changes_of(f, path, run, r.step, split);
  return r;
}

void load_weights(const std::string& path, nn::Module& model) {
  const io::SafetensorsFile f = io::load_safetensors(path);
  model.load_state_dict(model_tensors(f), path);
}

std::shared_ptr<nn::Classifier> model_from_checkpoint(const io::SafetensorsFile& f,
                                                      const std::string& path) {
  const std::string model =
      is_user_model(f) ? meta(f, "model", path)
                       : meta_one_of(f, "model", path, nn::model_names(), "a model of this build",
                                     "the file is damaged: evaluate an intact checkpoint");
  MANTISSA_CHECK(!is_user_model(f),
                 path + " holds a user-defined model (" + excerpt(model) +
                     "), which 'mantissa eval' cannot rebuild",
                 "evaluate it from C++: train::load_weights into your model, then "
                 "train::evaluate_model");
  const nn::ModelConfig mc = model_config_from(f, path);
  auto m = build_within_file(f, path, [&] { return nn::make_model(model, mc); });
  m->load_state_dict(model_tensors(f), path);
  return m;
}

EvalResult evaluate_checkpoint(const std::string& path, const std::string& dataset,
                               const std::string& data_dir, int64_t test_limit,
                               int64_t batch_size) {
  const io::SafetensorsFile f = io::load_safetensors(path);
  const std::string model = meta(f, "model", path);
  const std::shared_ptr<nn::Classifier> m = model_from_checkpoint(f, path);  // a built-in one
  const nn::ModelConfig mc = model_config_from(f, path);
  TrainConfig c;
  c.model = model;
  c.dataset =
      !dataset.empty()
          ? dataset
          : meta_one_of(f, "dataset", path, data::dataset_names(), "a dataset of this build",
                        "the file is damaged: evaluate an intact checkpoint, or name the "
                        "data with --dataset");
  c.data_dir = data_dir;
  c.image_size = mc.image_size;
  c.test_limit = test_limit;
  c.eval_batch_size = batch_size;
  // The synthetic dataset is made from the run's seed and size.
  if (f.metadata.count("seed")) c.seed = meta_u64(f, "seed", path);
  if (f.metadata.count("synthetic_size"))
    c.synthetic_size = meta_int(f, "synthetic_size", path, 1, kMaxCount);
  // The synthetic dataset's bytes, examples x channels x image size^2, before it is made.
  const std::optional<int64_t> pixels =
      checked_mul(c.synthetic_size, mc.image_size * mc.image_size);
  const std::optional<int64_t> bytes = pixels ? checked_mul(*pixels, mc.in_channels) : pixels;
  MANTISSA_CHECK(c.dataset != "synthetic" || (bytes && *bytes <= kMaxCount),
                 path + ": metadata 'synthetic_size' " + std::to_string(c.synthetic_size) +
                     " images of " + std::to_string(mc.image_size) + "x" +
                     std::to_string(mc.image_size) + " are more bytes than a dataset can hold",
                 "the file is damaged: evaluate an intact checkpoint");
  const data::Dataset test = load_split(c, false);
  MANTISSA_CHECK(test.channels() == mc.in_channels,
                 "dataset " + test.name + " has " + std::to_string(test.channels()) +
                     " channels but " + path + " expects " + std::to_string(mc.in_channels),
                 "evaluate on the dataset the model was trained on");
  // 8-bit input: u8 images, normalized by the model's first op, as in training.
  const bool eight_bit =
      f.metadata.count("eight_bit_io") && f.metadata.at("eight_bit_io") == "true";
  const data::LoaderConfig lc =
      loader_config(c, eight_bit ? DType::u8 : DType::f32, false, test.channels());
  if (eight_bit) m->set_input_normalization(lc.transform.mean, lc.transform.std, DType::f32);
  data::Loader loader(test, lc);
  EvalResult r = evaluate_model(*m, loader);
  r.model = model;
  return r;
}

}  // namespace mantissa::train

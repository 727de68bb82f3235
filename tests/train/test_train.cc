// The trainer end to end on the synthetic dataset: learning, bit-exact resume, checkpoints that
// PyTorch names and Mantissa validates, metrics, and errors for bad settings.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>

#include "mantissa/io/safetensors.h"
#include "mantissa/mantissa.h"
#include "mantissa/train/run_data.h"
#include "support/errors.h"
#include "support/files.h"
#include "support/tensors.h"
#include "support/train.h"

namespace mantissa {
namespace {

namespace fs = std::filesystem;
using testing::error_of;

train::TrainConfig small(const std::string& model = "lenet5") {
  return testing::small_run(model, 256);
}

std::vector<float> all_values(const std::string& checkpoint) {
  std::vector<float> v;
  for (auto& [name, t] : io::load_safetensors(checkpoint).tensors) {
    const std::vector<float> x = t.to_float_vector();
    v.insert(v.end(), x.begin(), x.end());
  }
  return v;
}

TEST(Trainer, LearnsTheSyntheticDataset) {
  train::TrainConfig c = small();
  c.epochs = 3;
  c.synthetic_size = 1024;
  c.evaluate = true;
  c.lr = 3e-3;
  train::Trainer t(c);
  const train::TrainResult r = t.run();
  ASSERT_EQ(r.step_losses.size(), 3u * 64);
  EXPECT_LT(r.epochs.back().loss, r.epochs.front().loss);
  ASSERT_TRUE(r.test_accuracy.has_value());
  EXPECT_GT(*r.test_accuracy, 0.8) << "a learnable dataset must be learned";
  EXPECT_EQ(r.test_examples, 256);
}

TEST(Trainer, ResumeContinuesBitExactly) {
  for (const std::string opt : {"adamw", "sgd"}) {
    const testing::TempDir dir;
    train::TrainConfig c = small("tutorial-cnn");
    c.optimizer = opt;
    if (opt == "sgd") c.momentum = 0.9, c.lr = 0.01;
    c.max_grad_norm = 1.0;
    c.lr_schedule = "cosine";
    c.warmup_steps = 2;
    // 16 batches per epoch: the resume point (step 11) is mid-epoch and the run crosses an epoch.
    c.epochs = 2;
    c.max_steps = 20;
    c.save = dir.file("straight.safetensors");
    const train::TrainResult straight = train::Trainer(c).run();

    c.max_steps = 11;
    c.save = dir.file("first.safetensors");
    train::Trainer(c).run();
    c.max_steps = 20;
    c.resume = dir.file("first.safetensors");
    c.save = dir.file("resumed.safetensors");
    const train::TrainResult resumed = train::Trainer(c).run();

    EXPECT_EQ(resumed.step_losses, straight.step_losses) << opt;
    EXPECT_EQ(resumed.steps, 20);
    EXPECT_EQ(all_values(dir.file("resumed.safetensors")),
              all_values(dir.file("straight.safetensors")))
        << opt;
  }
}

TEST(Trainer, ResultsDoNotDependOnTheThreadCount) {
  for (const std::string model : {"tutorial-cnn", "resnet18"}) {
    std::vector<float> first;
    for (int threads : {1, 2, 3}) {
      train::TrainConfig c = small(model);
      if (model == "resnet18") c.image_size = 8, c.synthetic_size = 48;
      c.epochs = 3;
      c.max_steps = 8;
      c.threads = threads;
      const train::TrainResult r = train::Trainer(c).run();
      ASSERT_EQ(r.step_losses.size(), 8u) << model << " with " << threads << " threads";
      if (first.empty())
        first = r.step_losses;
      else
        EXPECT_EQ(r.step_losses, first) << model << " with " << threads << " threads";
    }
  }
  set_num_threads(0);
}

TEST(Trainer, CheckpointsHoldPyTorchNamesAndOptimizerState) {
  const testing::TempDir dir;
  train::TrainConfig c = small("resnet18");
  c.image_size = 8;
  c.synthetic_size = 32;
  c.max_steps = 1;
  c.save = dir.file("r18.safetensors");
  train::Trainer(c).run();
  const io::SafetensorsFile f = io::load_safetensors(c.save);
  EXPECT_TRUE(f.contains("layer1.0.conv1.weight"));
  EXPECT_TRUE(f.contains("layer4.1.bn2.running_var"));
  EXPECT_EQ(f.at("bn1.num_batches_tracked").dtype(), DType::i64);
  EXPECT_EQ(static_cast<const int64_t*>(f.at("bn1.num_batches_tracked").data_ptr())[0], 1);
  EXPECT_TRUE(f.contains("optimizer.fc.weight.exp_avg_sq"));
  EXPECT_EQ(f.metadata.at("model"), "resnet18");
  EXPECT_EQ(f.metadata.at("step"), "1");

  // The checkpoint evaluates, and it cannot be resumed as another model or optimizer.
  const train::EvalResult e = train::evaluate_checkpoint(c.save, "", "", 0, 8);
  EXPECT_EQ(e.model, "resnet18");
  EXPECT_EQ(e.examples, 8);
  train::TrainConfig other = small("lenet5");
  other.resume = c.save;
  EXPECT_NE(
      error_of([&] { train::Trainer t(other); }).find("is a checkpoint of resnet18, not of lenet5"),
      std::string::npos);
  train::TrainConfig sgd = c;
  sgd.save.clear();
  sgd.resume = c.save;
  sgd.optimizer = "sgd";
  EXPECT_NE(error_of([&] { train::Trainer t(sgd); }).find("pass --optimizer adamw"),
            std::string::npos);
  train::TrainConfig bigger = c;
  bigger.save.clear();
  bigger.resume = c.save;
  bigger.image_size = 16;
  EXPECT_NE(error_of([&] { train::Trainer t(bigger); }).find("--image-size"), std::string::npos);
}

// A checkpoint's metadata is checked before anything is sized or counted from it, and a resume
// that would not continue the run bit for bit is refused: damaged numbers, geometry that would
// size a model of gigabytes, a negative or huge step, lost optimizer state, JSON of the wrong
// type.
TEST(Trainer, DamagedCheckpointMetadataIsRefusedBeforeUse) {
  const testing::TempDir dir;
  train::TrainConfig c = small();
  c.max_steps = 2;
  c.save = dir.file("good.safetensors");
  train::Trainer(c).run();
  const io::SafetensorsFile good = io::load_safetensors(c.save);
  // `good` with one metadata field replaced (or removed, when `value` is null), or without the
  // tensor `drop`.
  // `good` with metadata fields replaced.
  const auto damaged_all = [&](const std::map<std::string, std::string>& edits) {
    std::map<std::string, std::string> m = good.metadata;
    for (const auto& [key, value] : edits) m[key] = value;
    std::vector<std::pair<std::string, Tensor>> ts(good.tensors.begin(), good.tensors.end());
    const std::string path = dir.file("damaged.safetensors");
    io::save_safetensors(path, ts, m);
    return path;
  };
  const auto damaged = [&](const std::string& key, const char* value,
                           const std::string& drop = "") {
    std::map<std::string, std::string> m = good.metadata;
    if (value)
      m[key] = value;
    else
      m.erase(key);
    std::vector<std::pair<std::string, Tensor>> ts;
    for (auto& [name, t] : good.tensors)
      if (name != drop) ts.emplace_back(name, t);
    const std::string path = dir.file("damaged.safetensors");
    io::save_safetensors(path, ts, m);
    return path;
  };
  // A list of n losses, as step_losses holds them.
  const auto losses_json = [](int n) {
    std::string s = "[";
    for (int i = 0; i < n; ++i) s += (i ? ",2.5" : "2.5");
    return s + "]";
  };
  const auto resume_error = [&](const std::string& path) {
    train::TrainConfig r = small();
    r.resume = path;
    return error_of([&] { train::Trainer t(r); });
  };
  const auto eval_error = [&](const std::string& path) {
    return error_of([&] { train::evaluate_checkpoint(path, "", "", 8, 8); });
  };
  const std::pair<std::string, std::string> evals[] = {
      {eval_error(damaged("image_size", "99999999999")),
       "metadata 'image_size' is 99999999999, outside [1, 16384]"},
      {eval_error(damaged("in_channels", "-3")), "metadata 'in_channels' is -3, outside [1, 1024]"},
      {eval_error(damaged("num_classes", "1e9")),
       "metadata 'num_classes' is not an integer ('1e9')"},
      {eval_error(damaged("num_classes", "99999999999999999999")),
       "metadata 'num_classes' is 99999999999999999999, outside"},
      {eval_error(damaged("seed", "-1")), "metadata 'seed' is not an unsigned 64-bit integer"},
      {eval_error(damaged("synthetic_size", "4611686018427387904")),
       "metadata 'synthetic_size' is 4611686018427387904, outside [1, 9007199254740992]"},
      {eval_error(damaged("synthetic_size", "9007199254740992")),
       "are more bytes than a dataset can hold"},
      {eval_error(damaged("model", "../etc")),
       "metadata 'model' is '../etc', not a model of this build"},
      {eval_error(damaged("dataset", "nothing")),
       "metadata 'dataset' is 'nothing', not a dataset of this build"},
      // LeNet-5's fc1 at 16384 pixels a side: 16 GB of weights, from a 250 KB file.
      {eval_error(damaged("image_size", "16384")),
       "describes a model larger than the tensors the file holds"},
  };
  for (const auto& [got, want] : evals) EXPECT_NE(got.find(want), std::string::npos) << got;
  EXPECT_EQ(eval_error(damaged("seed", "18446744073709551615")), "") << "any 64-bit seed";

  std::string first_state;
  for (auto& [name, t] : good.tensors)
    if (name.rfind("optimizer.", 0) == 0 && first_state.empty()) first_state = name;
  ASSERT_FALSE(first_state.empty());
  const std::pair<std::string, std::string> resumes[] = {
      {resume_error(damaged("step", "-1")), "metadata 'step' is -1, outside [0, "},
      {resume_error(damaged("step", "9223372036854775807")),
       "metadata 'step' is 9223372036854775807"},
      {resume_error(damaged_all(
           {{"step", "17"}, {"optimizer_steps", "17"}, {"step_losses", losses_json(17)}})),
       "is at step 17, past the 16 steps of this run's --epochs 1"},
      {resume_error(damaged("optimizer_steps", "x")),
       "metadata 'optimizer_steps' is not an integer"},
      {resume_error(damaged("gradient_accumulation", "0")),
       "'gradient_accumulation' is 0, outside"},
      {resume_error(damaged("step_losses", "{\"a\": 1}")), "'step_losses' is not a JSON list"},
      {resume_error(damaged("step_losses", "[\"x\"]")), "'step_losses' is not a JSON list"},
      {resume_error(damaged("", nullptr, first_state)),
       "optimizer state tensors it was written with: a resume would start their state afresh"},
      {resume_error(damaged("optimizer_state_tensors", "-2")), "outside [0, "},
  };
  for (const auto& [got, want] : resumes) EXPECT_NE(got.find(want), std::string::npos) << got;
  // Counts that contradict each other, and values a flag would refuse, are a damaged file: they
  // are never compared with the run's flags (whose hint would name a value that is itself
  // refused) nor resumed.
  const std::pair<std::string, std::string> inconsistent[] = {
      {resume_error(damaged("step_losses", "[2.5,2.4,2.3]")),
       "metadata 'step_losses' holds 3 losses for the checkpoint's 2 steps"},
      {resume_error(damaged("optimizer_steps", "0")),
       "metadata 'optimizer_steps' is 0, not the 2 steps of the checkpoint's 2 that updated the "
       "weights"},
      {resume_error(damaged("optimizer_steps", "3")), "metadata 'optimizer_steps' is 3, not the 2"},
      {resume_error(damaged("changeable_settings", R"({"--lr":"abc"})")),
       "metadata 'changeable_settings' holds --lr 'abc', which the flag does not take"},
      {resume_error(damaged("changeable_settings", R"({"--epochs":"0"})")),
       "holds --epochs '0', which the flag does not take"},
      {resume_error(damaged("precision", "fp64")),
       "metadata 'precision' is 'fp64', not a precision of this build"},
      {resume_error(damaged("seed", "-1")), "metadata 'seed' is not an unsigned 64-bit integer"},
      {resume_error(damaged("model", "../etc")),
       "metadata 'model' is '../etc', not a model of this build"},
      {resume_error(damaged("synthetic_size", "0")),
       "metadata 'synthetic_size' is 0, outside [1, "},
      {resume_error(damaged("dataset", "nothing")),
       "metadata 'dataset' is 'nothing', not a dataset of this build"},
      {resume_error(damaged("shuffle", "maybe")),
       "metadata 'shuffle' is 'maybe', not true or false"},
  };
  for (const auto& [got, want] : inconsistent) {
    EXPECT_NE(got.find(want), std::string::npos) << got;
    EXPECT_NE(got.find("the file is damaged"), std::string::npos) << got;
    EXPECT_EQ(got.find("to resume it"), std::string::npos) << got;
  }
  EXPECT_EQ(resume_error(damaged_all(
                {{"step", "16"}, {"optimizer_steps", "16"}, {"step_losses", losses_json(16)}})),
            "")
      << "the run's last step resumes";
  // A file written before the count was recorded: the optimizer's own check still refuses one
  // that lost all its state.
  EXPECT_EQ(resume_error(damaged("optimizer_state_tensors", nullptr)), "");
  // ... and one that lost one buffer of a parameter whose other buffers are there.
  std::map<std::string, std::string> no_count = good.metadata;
  no_count.erase("optimizer_state_tensors");
  std::vector<std::pair<std::string, Tensor>> partial;
  for (auto& [name, t] : good.tensors)
    if (name != first_state) partial.emplace_back(name, t);
  const std::string partial_path = dir.file("partial.safetensors");
  io::save_safetensors(partial_path, partial, no_count);
  EXPECT_NE(resume_error(partial_path).find("'" + first_state.substr(10) + "' is missing"),
            std::string::npos)
      << resume_error(partial_path);
}

// A run trained with 8-bit input is evaluated from its checkpoint as its trainer evaluated it: on
// u8 images normalized by the model. With a resize (Fashion-MNIST's 28x28 to 16x16) the u8 pixels
// differ from the float ones.
TEST(Trainer, AnEightBitCheckpointEvaluatesOnEightBitInput) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz"))
    GTEST_SKIP() << "no Fashion-MNIST (Debian's dataset-fashion-mnist)";
  const testing::TempDir dir;
  train::TrainConfig c = small();
  c.dataset = "fashion-mnist";
  c.synthetic_size = train::TrainConfig().synthetic_size;
  c.train_limit = 64;
  c.test_limit = 96;
  c.evaluate = true;
  c.max_steps = 2;
  c.eight_bit_io = true;
  c.save = dir.file("e8.safetensors");
  train::Trainer t(c);
  t.run();
  const data::Dataset test = train::load_split(c, false);
  data::Loader loader(test, train::loader_config(c, DType::u8, false, test.channels()));
  const train::EvalResult want = train::evaluate_model(t.model(), loader);
  const train::EvalResult got =
      train::evaluate_checkpoint(c.save, "", "", c.test_limit, c.eval_batch_size);
  EXPECT_EQ(got.examples, 96);
  EXPECT_EQ(got.correct, want.correct);
  EXPECT_EQ(got.loss, want.loss);
}

TEST(Trainer, InitFromRejectsWrongShapesAndLoadsPyTorchNames) {
  const testing::TempDir dir;
  train::TrainConfig c = small();
  const std::string path = dir.file("init.safetensors");
  nn::ModelConfig mc;
  mc.image_size = 16;
  mc.seed = 42;
  auto source = nn::make_model("lenet5", mc);
  io::save_safetensors(path, source->state_dict());
  c.init_from = path;
  train::Trainer t(c);
  EXPECT_EQ(t.model().state_dict()[0].second.to_float_vector(),
            source->state_dict()[0].second.to_float_vector());
  c.image_size = 20;  // fc1 has another input size
  const std::string e = error_of([&] { train::Trainer bad(c); });
  EXPECT_NE(e.find("'fc1.weight' has shape (120, 16) but the model's is (120, 64)"),
            std::string::npos)
      << e;
}

TEST(Trainer, MetricsJsonHasEveryField) {
  const testing::TempDir dir;
  train::TrainConfig c = small();
  c.max_steps = 3;
  c.evaluate = true;
  c.test_limit = 20;
  c.metrics_json = dir.file("metrics.json");
  train::Trainer(c).run();
  std::ifstream in(c.metrics_json);
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["config"]["model"], "lenet5");
  EXPECT_EQ(j["step_losses"].size(), 3u);
  ASSERT_EQ(j["epochs"].size(), 1u);
  for (auto k : {"epoch", "loss", "train_accuracy", "seconds", "images_per_second"})
    EXPECT_TRUE(j["epochs"][0].contains(k)) << k;
  EXPECT_TRUE(j["test_accuracy"].is_number());
  EXPECT_TRUE(j["images_per_second"].is_number());
  EXPECT_TRUE(j["data_wait_seconds"].is_number());
  // One wall time per step, together no more than the whole run's.
  ASSERT_EQ(j["step_seconds"].size(), 3u);
  double steps_total = 0;
  for (const auto& t : j["step_seconds"]) {
    EXPECT_GT(t.get<double>(), 0);
    steps_total += t.get<double>();
  }
  EXPECT_LE(steps_total, j["train_seconds"].get<double>());
  // LeNet-5 at 16x16: 44,040 multiply-adds a forward (tests/nn), 6 FLOPs each a trained image.
  EXPECT_EQ(j["flops_per_image"].get<double>(), 6.0 * 44040);
  EXPECT_NEAR(j["gflops_per_second"].get<double>(),
              6.0 * 44040 * j["images_per_second"].get<double>() * 1e-9, 1e-9);
  for (auto k : {"total", "parameters", "gradients", "optimizer_state", "master_weights",
                 "activations", "workspace", "input_data"})
    EXPECT_TRUE(j["peak_memory_bytes"][k].is_number()) << k;
  EXPECT_GT(j["peak_memory_bytes"]["optimizer_state"].get<double>(), 0);
  EXPECT_FALSE(fs::exists(c.metrics_json + ".tmp." + std::to_string(::getpid())));
  c.metrics_json = "/nonexistent-dir/m.json";
  EXPECT_NE(
      error_of([&] { train::Trainer(c).run(); }).find("directory /nonexistent-dir does not exist"),
      std::string::npos);
}

TEST(Trainer, ProfileTimesEveryLayerAndParameter) {
  const testing::TempDir dir;
  train::TrainConfig c = testing::small_run("tutorial-cnn", 64);
  c.max_steps = 3;
  c.profile = true;
  c.update_in_backward = false;  // every update in the optimizer phase
  c.metrics_json = dir.file("metrics.json");
  std::ostringstream out;
  const train::TrainResult r = train::Trainer(c, {&out, nullptr}).run();
  EXPECT_EQ(r.profiled_steps, 3);
  auto find = [&](const std::string& phase, const std::string& where) -> const ProfileRow* {
    for (const ProfileRow& p : r.profile)
      if (p.phase == phase && p.where == where) return &p;
    return nullptr;
  };
  // Every leaf layer forward, every parameterised layer's backward node, every parameter's update.
  for (const char* layer : {"conv1", "pool", "conv2", "norm", "fc1", "fc2", "log_softmax"}) {
    const ProfileRow* f = find("forward", layer);
    ASSERT_NE(f, nullptr) << layer;
    EXPECT_EQ(f->calls, 3) << layer;
  }
  ASSERT_NE(find("forward", "relu"), nullptr) << "the shared ReLU module runs";
  EXPECT_EQ(find("forward", "relu")->calls, 9) << "after conv1, conv2 and fc1 in each step";
  for (const char* layer : {"conv1", "conv2", "norm", "fc1", "fc2"})
    EXPECT_NE(find("backward", layer), nullptr) << layer;
  ASSERT_NE(find("backward", "conv2"), nullptr);
  EXPECT_EQ(find("backward", "conv2")->op, "conv2d");
  for (const char* param : {"conv1.weight", "fc1.bias", "fc2.weight"}) {
    const ProfileRow* o = find("optimizer", param);
    ASSERT_NE(o, nullptr) << param;
    EXPECT_EQ(o->op, "adamw");
    EXPECT_EQ(o->calls, 3);
  }
  // The phases include their rows; the loop includes the phases.
  double phases = 0;
  int checked = 0;
  for (const ProfileRow& p : r.profile) {
    if (p.phase != "step") continue;
    phases += p.seconds;
    if (p.op == "forward" || p.op == "backward" || p.op == "optimizer") {
      ++checked;
      double inside = 0;
      for (const ProfileRow& q : r.profile)
        if (q.phase == p.op) inside += q.seconds;
      EXPECT_LE(inside, p.seconds) << p.op;
      EXPECT_GT(inside, 0.5 * p.seconds) << p.op;
    }
  }
  EXPECT_EQ(checked, 3) << "the forward, backward and optimizer phases";
  EXPECT_GT(phases, 0);
  EXPECT_LE(phases, r.train_seconds);
  const std::string table = out.str();
  EXPECT_NE(table.find("profile: 3 steps"), std::string::npos) << table;
  EXPECT_NE(table.find("forward     conv1"), std::string::npos) << table;
  EXPECT_NE(table.find("optimizer   fc1.weight"), std::string::npos) << table;
  std::ifstream in(c.metrics_json);
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["profile"]["steps"], 3);
  EXPECT_EQ(j["profile"]["rows"].size(), r.profile.size());
  EXPECT_TRUE(j["config"]["profile"].get<bool>());
  // Off by default: no rows, no table, no JSON entry.
  c.profile = false;
  std::ostringstream quiet;
  EXPECT_TRUE(train::Trainer(c, {&quiet, nullptr}).run().profile.empty());
  EXPECT_EQ(quiet.str().find("profile:"), std::string::npos);
  std::ifstream in2(c.metrics_json);
  EXPECT_FALSE(nlohmann::json::parse(in2).contains("profile"));
}

TEST(Trainer, BadSettingsAreExplained) {
  auto check = [](auto edit, const std::string& want) {
    train::TrainConfig c = small();
    edit(c);
    const std::string e = error_of([&] { train::validate(c); });
    EXPECT_NE(e.find(want), std::string::npos) << e;
  };
  check([](auto& c) { c.model = "alexnet"; }, "choose --model from");
  check([](auto& c) { c.optimizer = "lamb"; }, "choose --optimizer sgd, adam or adamw");
  check([](auto& c) { c.lr = -1; }, "--lr must be a positive number");
  check([](auto& c) { c.momentum = 0.9; }, "--momentum applies to SGD only");
  check([](auto& c) { c.lr_schedule = "linear"; }, "use constant, step or cosine");
  check(
      [](auto& c) {
        c.init_from = "a";
        c.resume = "b";
      },
      "cannot be used together");
  const testing::TempDir dir;
  train::TrainConfig c = small();
  c.resume = dir.file("absent.safetensors");
  const std::string absent = error_of([&] { train::Trainer t(c); });
  EXPECT_NE(absent.find(c.resume), std::string::npos) << absent;
}

// A loss that stops being finite is named with its likely cause: at the first step (before any
// update) the weights or the data, or a 16-bit forward's overflow; with Adam and --eps 0, the
// division by zero; otherwise the updates (the learning rate).
TEST(Trainer, ANonFiniteLossNamesItsLikelyCause) {
  auto failure = [](train::TrainConfig c, bool nan_weight) {
    c.max_steps = 4;
    return error_of([&] {
      train::Trainer t(c);
      if (nan_weight) t.model().named_parameters()[0].tensor->data<float>()[0] = NAN;
      t.run();
    });
  };
  train::TrainConfig c = small();
  std::string e = failure(c, true);
  EXPECT_NE(e.find("the loss became nan at step 1, before any update"), std::string::npos) << e;
  EXPECT_NE(e.find("the initial weights or the data hold a non-finite value"), std::string::npos)
      << e;
  EXPECT_EQ(e.find("16-bit"), std::string::npos) << e;
  c.precision = "bf16-mixed";
  e = failure(c, true);
  EXPECT_NE(e.find("or the forward pass overflows its 16-bit type"), std::string::npos) << e;
  c = small();
  c.optimizer = "adam";
  c.eps = 0;
  e = failure(c, false);
  EXPECT_NE(e.find("--eps 0 divides by zero"), std::string::npos) << e;
  c.eps = 1e-8;
  c.lr = 1e30;
  e = failure(c, false);
  EXPECT_NE(e.find("lower --lr, or set --max-grad-norm"), std::string::npos) << e;
}

TEST(Trainer, ScheduleDrivesTheLearningRate) {
  optim::LrSchedule s;
  s.warmup_steps = 4;
  EXPECT_DOUBLE_EQ(s.lr_at(1.0, 0), 0.25);
  EXPECT_DOUBLE_EQ(s.lr_at(1.0, 3), 1.0);
  EXPECT_DOUBLE_EQ(s.lr_at(1.0, 100), 1.0);
  s.kind = optim::LrSchedule::Kind::kCosine;
  s.total_steps = 14;
  EXPECT_DOUBLE_EQ(s.lr_at(1.0, 4), 1.0);
  EXPECT_NEAR(s.lr_at(1.0, 9), 0.5, 1e-12);
  EXPECT_NEAR(s.lr_at(1.0, 14), 0.0, 1e-12);
}

// Updates in the backward pass equal the ordinary step bit for bit, for each optimizer: an
// ordinary parameter is updated when its gradient arrives (and keeps none), a shared weight (two
// gradients) falls back to step(), and a parameter without a gradient gets no state.
TEST(Optimizer, UpdatesInTheBackwardPassEqualTheStep) {
  std::mt19937 gen(3);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  auto random = [&](const Shape& shape) {
    return testing::tensor_of(shape, [&] { return dist(gen); });
  };
  // w1 has 134400 elements: several chunks on two threads; in FP32 its gradient comes in parts
  // (groups of 6 outputs, parts of 2048 inputs: partial ones of each).
  const Tensor x = random({8, 2100}), w1_0 = random({64, 2100}), b1_0 = random({64}),
               w2_0 = random({64, 64}), u_0 = random({10});
  struct Run {
    std::vector<std::vector<float>> params, state;
    std::vector<std::string> state_names;
    bool w1_grad_kept = false, w2_grad_kept = false;
  };
  auto run = [&](const std::string& kind, bool in_backward) {
    // "-bf16": BF16 parameters with FP32 master copies (16-bit gradients, the layout of Apex's O2).
    const bool half = kind.find("-bf16") != std::string::npos;
    auto param = [&](const Tensor& t) { return half ? t.to(DType::bf16) : t.clone(); };
    Tensor w1 = param(w1_0), b1 = param(b1_0), w2 = param(w2_0), u = param(u_0);
    for (Tensor* t : {&w1, &b1, &w2, &u}) t->set_requires_grad(true);
    const optim::ParamList params{{"w1", &w1}, {"b1", &b1}, {"w2", &w2}, {"u", &u}};
    std::unique_ptr<optim::Optimizer> opt;
    if (kind == "sgd") {
      optim::SgdOptions o;
      o.lr = 0.01, o.momentum = 0.9, o.dampening = 0.1, o.weight_decay = 0.01;
      opt = std::make_unique<optim::Sgd>(params, o);
    } else {
      optim::AdamOptions o;
      o.weight_decay = 0.01;
      opt = std::make_unique<optim::Adam>(params, o, kind.rfind("adamw", 0) == 0);
    }
    if (half) opt->enable_master_weights();
    const Tensor xin = half ? x.to(DType::bf16) : x;
    Run r;
    for (int step = 0; step < 3; ++step) {
      const Tensor h = ops::relu(ops::linear(xin, w1, b1));
      const Tensor y = ops::linear(ops::linear(h, w2), w2);  // w2 gets two gradients
      const Tensor loss = ops::sum(ops::mul(y, y));
      if (in_backward) {
        EXPECT_EQ(opt->begin_backward_step(), 4u);
      }
      autograd::backward(loss);
      r.w1_grad_kept = w1.grad().defined();
      r.w2_grad_kept = w2.grad().defined();
      opt->step();
      opt->zero_grad();
    }
    EXPECT_EQ(opt->steps(), 3);
    for (Tensor* t : {&w1, &b1, &w2, &u}) r.params.push_back(t->to_float_vector());
    for (auto& [name, t] : opt->state_tensors()) {
      r.state_names.push_back(name);
      r.state.push_back(t.to_float_vector());
    }
    return r;
  };
  for (const std::string kind : {"sgd", "adam", "adamw", "adamw-bf16"}) {
    const Run ordinary = run(kind, false), early = run(kind, true);
    EXPECT_TRUE(ordinary.w1_grad_kept) << kind;
    EXPECT_FALSE(early.w1_grad_kept) << kind << ": a consumed gradient is not stored";
    EXPECT_TRUE(early.w2_grad_kept) << kind << ": the shared weight keeps the ordinary path";
    EXPECT_EQ(early.params, ordinary.params) << kind;
    EXPECT_EQ(early.state_names, ordinary.state_names) << kind;
    EXPECT_EQ(early.state, ordinary.state) << kind;
    for (const std::vector<float>& v : early.params)
      for (float e : v) ASSERT_TRUE(std::isfinite(e)) << kind;
    const DType pt = kind == "adamw-bf16" ? DType::bf16 : DType::f32;
    EXPECT_NE(early.params[0], w1_0.to(pt).to_float_vector()) << kind;
    EXPECT_EQ(early.params[3], u_0.to(pt).to_float_vector()) << kind << ": no gradient, no update";
    for (const std::string& n : early.state_names)
      EXPECT_TRUE(n.rfind("u.", 0) != 0 || n == "u.master") << n;
  }
}

// The trainer's default (updates in the backward pass) trains exactly as the ordinary step, with
// a lower gradient peak.
TEST(Trainer, UpdateInBackwardChangesNothingButMemory) {
  train::TrainConfig c = testing::small_run("tutorial-cnn", 96);
  c.max_steps = 5;
  c.update_in_backward = false;
  const train::TrainResult ordinary = train::Trainer(c).run();
  c.update_in_backward = true;
  const train::TrainResult early = train::Trainer(c).run();
  EXPECT_EQ(early.step_losses, ordinary.step_losses);
  EXPECT_LT(early.memory.peak_of(MemoryCategory::gradients),
            ordinary.memory.peak_of(MemoryCategory::gradients));
  // Clipping needs every gradient first: the ordinary step, the same losses as without the flag.
  c.max_grad_norm = 0.5;
  const train::TrainResult clipped = train::Trainer(c).run();
  c.update_in_backward = false;
  EXPECT_EQ(train::Trainer(c).run().step_losses, clipped.step_losses);
}

TEST(Optimizer, SixteenBitStateAndParameters) {
  // f16 state and bf16 parameters: the update runs in FP32 and rounds once per store.
  Tensor p = Tensor::full({1000}, 1.0, DType::bf16);
  p.set_requires_grad(true);
  p.set_grad(Tensor::full({1000}, 0.5, DType::bf16));
  optim::AdamOptions o;
  o.lr = 0.01;
  optim::StateTypes st{DType::f16, DType::f16};
  optim::Adam adam({{"p", &p}}, o, true, st);
  adam.step();
  EXPECT_EQ(adam.state_tensors()[0].second.dtype(), DType::f16);
  EXPECT_NEAR(p.to_float_vector()[0], 1.0 * (1 - 0.01 * 0.01) - 0.01, 4e-3);  // bf16 spacing near 1
  EXPECT_EQ(adam.state_bytes(), 2u * 1000 * 2);
}

}  // namespace
}  // namespace mantissa

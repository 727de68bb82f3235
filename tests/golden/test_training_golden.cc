// Optimizers, schedules and the first 20 training steps of the tutorial CNN against PyTorch 1.13
// (tests/golden/training.safetensors, from scripts/make_golden_training.py).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "mantissa/io/safetensors.h"
#include "mantissa/kernels/reference.h"
#include "mantissa/mantissa.h"
#include "support/compare.h"
#include "support/files.h"
#include "support/golden.h"

namespace mantissa {
namespace {

namespace fs = std::filesystem;

io::SafetensorsFile golden() { return testing::golden_file("training.safetensors"); }

std::vector<double> values(const Tensor& t) { return reference::from_tensor(t).v; }

// The Module-free parameters an optimizer case updates: copies of the golden initial values.
struct Params {
  std::vector<Tensor> tensors;
  optim::ParamList list;
  explicit Params(const std::string& c) {
    for (int j = 0; j < 2; ++j)
      tensors.push_back(golden().at("opt/" + c + "/p" + std::to_string(j) + "/init").clone());
    for (size_t j = 0; j < tensors.size(); ++j) {
      tensors[j].set_requires_grad(true);
      list.push_back({std::string("p") + std::to_string(j), &tensors[j]});
    }
  }
};

void run_case(const std::string& c, optim::Optimizer& opt, Params& ps, double clip = 0) {
  for (int k = 1; k <= 6; ++k) {
    const std::string step = "opt/" + c + "/step" + std::to_string(k);
    for (size_t j = 0; j < ps.tensors.size(); ++j)
      ps.tensors[j].set_grad(golden().at(step + "/g" + std::to_string(j)).clone());
    if (clip > 0) optim::clip_grad_norm(ps.list, clip);
    opt.step();
    for (size_t j = 0; j < ps.tensors.size(); ++j)
      testing::expect_close(step + "/p" + std::to_string(j), values(ps.tensors[j]),
                            values(golden().at(step + "/p" + std::to_string(j))), 2e-6, 0.01, 1e-7,
                            "mantissa", "pytorch");
  }
}

TEST(OptimizerGolden, Sgd) {
  Params ps("sgd");
  optim::SgdOptions o;
  o.lr = 0.1;
  optim::Sgd opt(ps.list, o);
  run_case("sgd", opt, ps);
}

TEST(OptimizerGolden, SgdMomentumDampeningWeightDecay) {
  Params ps("sgd_momentum");
  optim::SgdOptions o;
  o.lr = 0.1;
  o.momentum = 0.9;
  o.dampening = 0.1;
  o.weight_decay = 0.01;
  optim::Sgd opt(ps.list, o);
  run_case("sgd_momentum", opt, ps);
}

TEST(OptimizerGolden, SgdNesterov) {
  Params ps("sgd_nesterov");
  optim::SgdOptions o;
  o.lr = 0.05;
  o.momentum = 0.9;
  o.nesterov = true;
  o.weight_decay = 0.001;
  optim::Sgd opt(ps.list, o);
  run_case("sgd_nesterov", opt, ps);
}

TEST(OptimizerGolden, AdamWithL2) {
  Params ps("adam");
  optim::AdamOptions o;
  o.lr = 0.01;
  o.beta2 = 0.99;
  o.weight_decay = 0.01;
  optim::Adam opt(ps.list, o, false);
  run_case("adam", opt, ps);
}

TEST(OptimizerGolden, AdamW) {
  Params ps("adamw");
  optim::AdamOptions o;
  o.lr = 0.01;
  o.weight_decay = 0.1;
  optim::Adam opt(ps.list, o, true);
  run_case("adamw", opt, ps);
}

TEST(OptimizerGolden, AdamWWithoutBiasCorrection) {
  Params ps("adamw_nobc");
  optim::AdamOptions o;
  o.lr = 0.01;
  o.weight_decay = 0.1;
  o.bias_correction = false;
  optim::Adam opt(ps.list, o, true);
  run_case("adamw_nobc", opt, ps);
}

TEST(OptimizerGolden, ClipGradNormThenSgdMomentum) {
  Params ps("sgd_clip");
  optim::SgdOptions o;
  o.lr = 0.1;
  o.momentum = 0.5;
  optim::Sgd opt(ps.list, o);
  run_case("sgd_clip", opt, ps, 0.5);
}

TEST(ScheduleGolden, StepAndCosineMatchTorchSchedulers) {
  optim::LrSchedule step;
  step.kind = optim::LrSchedule::Kind::kStep;
  step.step_size = 3;
  step.gamma = 0.5;
  optim::LrSchedule cosine;
  cosine.kind = optim::LrSchedule::Kind::kCosine;
  cosine.total_steps = 10;
  cosine.min_lr = 0.001;
  std::vector<double> got_step, got_cos;
  for (int s = 0; s < 12; ++s) {
    got_step.push_back(step.lr_at(0.1, s));
    // PyTorch's CosineAnnealingLR keeps going past T_max (the cosine rises again); ours stops at
    // min_lr, so compare the first T_max + 1 values.
    if (s <= 10) got_cos.push_back(cosine.lr_at(0.1, s));
  }
  testing::expect_close("sched/step", got_step, values(golden().at("sched/step")), 1e-6, 0, 0);
  std::vector<double> want_cos = values(golden().at("sched/cosine"));
  want_cos.resize(11);
  testing::expect_close("sched/cosine", got_cos, want_cos, 1e-6, 0, 0);
}

// ---- The tutorial CNN, first 20 steps, from the same weights and data as PyTorch ----

// Tensor k of the state dict: bound * (2 * frac((i + 1) * PHI + k * PLASTIC) - 1).
Tensor formula(int k, const Shape& shape, double bound) {
  Tensor t = Tensor::empty(shape, DType::f32);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double x = (static_cast<double>(i) + 1.0) * 0.6180339887498949 +
                     static_cast<double>(k) * 0.3247179572447460;
    const double u = x - std::floor(x);
    p[i] = static_cast<float>(bound * (2.0 * u - 1.0));
  }
  return t;
}

// An IDX file (gzip) holding a u8 tensor, as the Fashion-MNIST package ships them.
void write_idx_gz(const std::string& path, const Tensor& data) {
  std::vector<uint32_t> shape;
  for (int64_t d : data.shape()) shape.push_back(static_cast<uint32_t>(d));
  ASSERT_TRUE(testing::write_gz(path, testing::idx_bytes(shape, data.data_ptr(), data.nbytes())))
      << path;
}

TEST(TrainingGolden, TutorialCnnFirst20LossesMatchPyTorch) {
  const testing::TempDir tmp;
  const fs::path dir = tmp.path();
  // The 240 images as an IDX pair, read back through the dataset reader.
  Tensor labels_u8 = Tensor::empty({240}, DType::u8);
  const Tensor labels = golden().at("cnn/labels");
  for (int64_t i = 0; i < 240; ++i)
    static_cast<uint8_t*>(labels_u8.data_ptr())[i] =
        static_cast<uint8_t>(labels.data<int64_t>()[i]);
  write_idx_gz((dir / "train-images-idx3-ubyte.gz").string(), golden().at("cnn/images"));
  write_idx_gz((dir / "train-labels-idx1-ubyte.gz").string(), labels_u8);
  // The initial weights, written as a safetensors file with PyTorch's names.
  const std::vector<float> bounds = golden().at("cnn/bounds").to_float_vector();
  nn::ModelConfig mc;
  auto model = nn::tutorial_cnn(mc);
  std::vector<std::pair<std::string, Tensor>> init;
  int k = 0;
  for (auto& [name, t] : model->state_dict()) {
    init.emplace_back(name, formula(k, t.shape(), bounds[static_cast<size_t>(k)]));
    ++k;
  }
  io::save_safetensors((dir / "init.safetensors").string(), init);

  train::TrainConfig c;  // the defaults: tutorial-cnn, 128x128, AdamW lr 1e-3, batch 12
  c.data_dir = dir.string();
  c.init_from = (dir / "init.safetensors").string();
  c.shuffle = false;
  c.max_steps = 20;
  c.evaluate = false;
  c.progress = false;
  train::Trainer trainer(c);
  const train::TrainResult r = trainer.run();

  const std::vector<double> want = values(golden().at("cnn/losses"));
  ASSERT_EQ(r.step_losses.size(), want.size());
  std::vector<double> got(r.step_losses.begin(), r.step_losses.end());
  for (size_t s = 0; s < got.size(); ++s)
    std::printf("step %2zu  mantissa %.7f  pytorch %.7f  relative %.2e\n", s + 1, got[s], want[s],
                std::fabs(got[s] - want[s]) / std::fabs(want[s]));
  testing::expect_close("first step loss", {got[0]}, {want[0]}, 1e-5, 0, 0, "mantissa", "pytorch");
  testing::expect_close("losses of steps 1-20", got, want, 1e-3, 0, 0, "mantissa", "pytorch");
}

}  // namespace
}  // namespace mantissa

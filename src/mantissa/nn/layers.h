// The layers, with PyTorch's names, parameter names, shapes and default initialisations.
// Constructors take a seed: each parameter draws from its own Philox stream of that seed.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mantissa/nn/module.h"
#include "mantissa/ops/ops.h"

namespace mantissa::nn {

// What layers that draw random numbers (Dropout) use: the run's seed and the optimizer step, set
// by the trainer before each step, so a resumed run draws the same masks.
struct RandomContext {
  uint64_t seed = 0;
  uint64_t step = 0;
};
void set_random_context(const RandomContext& c);
RandomContext random_context();

// A source of independent streams for the parameters of one model.
class InitStreams {
 public:
  explicit InitStreams(uint64_t seed) : seed_(seed) {}
  uint64_t seed() const { return seed_; }
  uint64_t next() { return next_++; }

 private:
  uint64_t seed_;
  uint64_t next_ = 1;
};

class Conv2d : public Module {
 public:
  Conv2d(int64_t in, int64_t out, int64_t kernel, InitStreams& init, int64_t stride = 1,
         int64_t padding = 0, int64_t dilation = 1, int64_t groups = 1, bool bias = true);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  const ops::Conv2dParams& params() const { return p_; }

 private:
  int64_t in_, out_, kernel_;
  ops::Conv2dParams p_;
  bool bias_;
};

class Linear : public Module {
 public:
  Linear(int64_t in, int64_t out, InitStreams& init, bool bias = true);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;

 private:
  int64_t in_, out_;
  bool bias_;
};

class BatchNorm2d : public Module {
 public:
  BatchNorm2d(int64_t channels, double eps = 1e-5, double momentum = 0.1);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  bool is_normalization() const override { return true; }
  // Sync batch norm (PyTorch's SyncBatchNorm): in training, the statistics of every process's
  // batch together, through `sums` (ops::sync_batch_norm); an empty function returns to this
  // process's batch alone.
  void set_sync(kernels::ChannelSums sums) { sync_ = std::move(sums); }
  bool synced() const { return static_cast<bool>(sync_); }

 private:
  int64_t channels_;
  double eps_, momentum_;
  kernels::ChannelSums sync_;
};

class GroupNorm : public Module {
 public:
  GroupNorm(int64_t groups, int64_t channels, double eps = 1e-5, bool affine = true);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  bool is_normalization() const override { return true; }

 private:
  int64_t groups_, channels_;
  double eps_;
  bool affine_;
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(Shape normalized_shape, double eps = 1e-5, bool affine = true);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  bool is_normalization() const override { return true; }

 private:
  Shape shape_;
  double eps_;
  bool affine_;
};

class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(int64_t kernel, int64_t stride = 0, int64_t padding = 0);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;

 private:
  ops::Pool2dParams p_;
};

class AvgPool2d : public Module {
 public:
  explicit AvgPool2d(int64_t kernel, int64_t stride = 0, int64_t padding = 0);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;

 private:
  ops::Pool2dParams p_;
};

class AdaptiveAvgPool2d : public Module {
 public:
  AdaptiveAvgPool2d(int64_t out_h, int64_t out_w);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;

 private:
  int64_t out_h_, out_w_;
};

class ReLU : public Module {
 public:
  ReLU() : Module("ReLU") {}
  Tensor forward(const Tensor& x) override { return ops::relu(x); }
};

class GELU : public Module {
 public:
  GELU() : Module("GELU") {}
  Tensor forward(const Tensor& x) override { return ops::gelu(x); }
};

class Identity : public Module {
 public:
  Identity() : Module("Identity") {}
  Tensor forward(const Tensor& x) override { return x; }
};

class Dropout : public Module {
 public:
  explicit Dropout(InitStreams& init, double p = 0.5);
  Tensor forward(const Tensor& x) override;
  std::vector<uint64_t> random_state() const override;
  void set_random_state(const std::vector<uint64_t>& s) override;
  std::string extra_repr() const override;

 private:
  double p_;
  uint64_t salt_;  // distinguishes the dropout layers of one model
  uint64_t last_step_ = ~uint64_t{0}, calls_ = 0;
};

class Flatten : public Module {
 public:
  explicit Flatten(int64_t start_dim = 1, int64_t end_dim = -1)
      : Module("Flatten"), start_(start_dim), end_(end_dim) {}
  Tensor forward(const Tensor& x) override { return ops::flatten(x, start_, end_); }
  std::string extra_repr() const override;

 private:
  int64_t start_, end_;
};

class LogSoftmax : public Module {
 public:
  explicit LogSoftmax(int64_t dim) : Module("LogSoftmax"), dim_(dim) {}
  Tensor forward(const Tensor& x) override { return ops::log_softmax(x, dim_); }
  std::string extra_repr() const override;
  bool is_log_softmax() const override { return true; }

 private:
  int64_t dim_;
};

// Runs its children in order; they are named "0", "1", ... as in PyTorch.
class Sequential : public Module {
 public:
  Sequential() : Module("Sequential") {}
  Sequential& add(std::shared_ptr<Module> m);
  Tensor forward(const Tensor& x) override;
  size_t size() const { return children().size(); }
};

}  // namespace mantissa::nn

// Optimizers with PyTorch's update formulas (torch.optim 1.13, single-tensor path), each a single
// fused pass over a parameter, its gradient and its state, computed in FP32 whatever the storage
// dtypes; gradient clipping by global norm; learning-rate schedules.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "mantissa/nn/module.h"

namespace mantissa::optim {

using ParamList = std::vector<nn::Module::NamedTensor>;

// Storage types of the optimizer state (PopTorch's first_order_momentum_accum_type and
// second_order_momentum_accum_type): FP32 by default; f16 or bf16 halve the state's memory.
struct StateTypes {
  DType first_moment = DType::f32;   // SGD momentum buffer, Adam exp_avg
  DType second_moment = DType::f32;  // Adam exp_avg_sq
};

class Optimizer {
 public:
  Optimizer(ParamList params, double lr, StateTypes types);
  virtual ~Optimizer() = default;
  virtual std::string name() const = 0;

  // One update of every parameter that has a gradient (parameters without one are skipped, as in
  // PyTorch). Runs without recording autograd.
  void step();
  void zero_grad();  // drops every gradient
  double lr() const { return lr_; }
  void set_lr(double lr) { lr_ = lr; }
  int64_t steps() const { return steps_; }
  const ParamList& params() const { return params_; }

  // The state for a checkpoint: tensors named "<parameter>.<buffer>" (e.g. "fc1.weight.exp_avg")
  // and the step count. load_state() checks names, shapes and that nothing is missing.
  std::vector<std::pair<std::string, Tensor>> state_tensors() const;
  void load_state(const std::map<std::string, Tensor>& tensors, int64_t steps,
                  const std::string& source);
  // Bytes of optimizer state.
  size_t state_bytes() const;

 protected:
  // Updates parameter i (contiguous p and g) given its state buffers; called with steps_ already
  // incremented.
  virtual void update(size_t i, Tensor& p, const Tensor& g) = 0;
  // The state buffer `k` of parameter i (created as zeros of state_dtype(k) on first use).
  Tensor& state(size_t i, size_t k);
  bool has_state(size_t i, size_t k) const;
  virtual std::vector<std::string> state_names() const = 0;
  virtual DType state_dtype(size_t k) const = 0;

  ParamList params_;
  double lr_;
  StateTypes types_;
  int64_t steps_ = 0;

 private:
  std::vector<std::vector<Tensor>> state_;  // [param][buffer]
};

struct SgdOptions {
  double lr = 0.01;
  double momentum = 0;
  double dampening = 0;
  double weight_decay = 0;
  bool nesterov = false;
};

class Sgd : public Optimizer {
 public:
  Sgd(ParamList params, const SgdOptions& o, StateTypes types = {});
  std::string name() const override { return "sgd"; }

 protected:
  void update(size_t i, Tensor& p, const Tensor& g) override;
  std::vector<std::string> state_names() const override { return {"momentum_buffer"}; }
  DType state_dtype(size_t) const override { return types_.first_moment; }

 private:
  SgdOptions o_;
};

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;  // Adam: L2 added to the gradient; AdamW: decoupled (default 0.01)
  bool bias_correction = true;
};

class Adam : public Optimizer {
 public:
  // decoupled: AdamW (p *= 1 - lr * weight_decay before the Adam step).
  Adam(ParamList params, const AdamOptions& o, bool decoupled, StateTypes types = {});
  std::string name() const override { return decoupled_ ? "adamw" : "adam"; }

 protected:
  void update(size_t i, Tensor& p, const Tensor& g) override;
  std::vector<std::string> state_names() const override { return {"exp_avg", "exp_avg_sq"}; }
  DType state_dtype(size_t k) const override {
    return k == 0 ? types_.first_moment : types_.second_moment;
  }

 private:
  AdamOptions o_;
  bool decoupled_;
};

// Scales all gradients so that their global 2-norm is at most max_norm (torch.nn.utils.
// clip_grad_norm_: coefficient max_norm / (norm + 1e-6), capped at 1). Returns the norm before
// clipping (inf or nan when a gradient is not finite; then nothing is scaled).
double clip_grad_norm(const ParamList& params, double max_norm);
// The global 2-norm of the gradients (FP64 accumulation).
double grad_norm(const ParamList& params);

// Learning rate as a function of the optimizer step (0-based): an optional linear warm-up from
// lr/warmup to lr over `warmup_steps`, then constant, step decay (x gamma every step_size steps)
// or cosine annealing to min_lr over total_steps.
struct LrSchedule {
  enum class Kind { kConstant, kStep, kCosine } kind = Kind::kConstant;
  int64_t warmup_steps = 0;
  int64_t step_size = 1;
  double gamma = 0.1;
  int64_t total_steps = 0;  // cosine: the step at which lr reaches min_lr
  double min_lr = 0;
  double lr_at(double base_lr, int64_t step) const;
};
LrSchedule::Kind parse_schedule(const std::string& name);

}  // namespace mantissa::optim

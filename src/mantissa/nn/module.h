// Modules: a tree of layers with named parameters and buffers, named as PyTorch names them
// ("conv1.weight", "layer1.0.bn1.running_mean"), so weights move between Mantissa and PyTorch
// unchanged. Train/eval mode, dtype casts of the whole tree or of any sub-module by name (the
// seed's model.half(), model.conv1.half(), model.conv1.float()), a printout, and state dicts.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mantissa/core/tensor.h"

namespace mantissa::nn {

class Module {
 public:
  explicit Module(std::string type) : type_(std::move(type)) {}
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // The layer's computation. Containers (Sequential, models) override it; a module without one
  // throws naming its type.
  virtual Tensor forward(const Tensor& x);
  // How a module is called: forward() with the module's path as the ops' context (autocast log,
  // anomaly reports, memory owners), with its precision applied when one is set (see
  // set_precision()), and recomputed in the backward pass when set_recompute() says so.
  Tensor operator()(const Tensor& x);

  // Activation recomputation (torch.utils.checkpoint; the IPU guide's recomputation
  // checkpoints): the module's forward runs without recording, so only its input and output are
  // kept, and runs again in the backward pass, under the same op context, to compute its
  // gradients. Takes effect when grad mode is on.
  void set_recompute(bool on) { recompute_ = on; }
  // operator() without recomputation (what the recomputation runs).
  Tensor call(const Tensor& x);
  bool recompute() const { return recompute_; }
  // Random state a recomputed forward must replay (Dropout's per-step call counter).
  virtual std::vector<uint64_t> random_state() const { return {}; }
  virtual void set_random_state(const std::vector<uint64_t>&) {}

  // "Conv2d", "Sequential", ...; and the arguments shown in the printout ("1, 5, kernel_size=3").
  const std::string& type() const { return type_; }
  virtual std::string extra_repr() const { return {}; }

  // What mixed-precision recipes treat apart (amp::apply_precision): a normalization layer
  // (batch, group, layer norm: O2 keeps its weights in FP32 in a 16-bit model, since its
  // statistics are FP32 anyway and its few weights cost nothing), and a log-softmax, the first
  // half of an NLL loss (O2 computes it in FP32). A layer of a user's model with either role
  // overrides these.
  virtual bool is_normalization() const { return false; }
  virtual bool is_log_softmax() const { return false; }

  // ---- The tree ----
  // Registration order is the order of named_parameters(), state_dict() and the printout, as in
  // PyTorch. A parameter requires grad and is charged to MemoryCategory::parameters.
  Tensor& register_parameter(const std::string& name, Tensor t);
  Tensor& register_buffer(const std::string& name, Tensor t);
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> m) {
    add_child(name, m);
    return m;
  }

  // A tensor of the tree with its full name. The pointer stays valid while the module lives, and
  // still points at the module's tensor after to(dtype) replaces it.
  struct NamedTensor {
    std::string name;
    Tensor* tensor;
  };
  std::vector<NamedTensor> named_parameters();
  std::vector<NamedTensor> named_buffers();
  std::vector<Tensor*> parameters();
  // Every module of the tree with its path ("" for this one), depth first.
  std::vector<std::pair<std::string, Module*>> named_modules();
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& children() const {
    return children_;
  }
  // The sub-module at a dotted path ("layer1.0.conv1"); throws an Error listing the valid names.
  Module& submodule(const std::string& path);
  int64_t num_parameters();

  // ---- Mode and dtype ----
  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }
  // Casts every parameter of this module and its sub-modules to `dtype` (gradients are dropped).
  // Normalization statistics (running_mean, running_var) stay FP32: the kernels update them in
  // FP32 whatever the activations' dtype, as cuDNN does.
  // It also sets that precision on every module of the subtree (set_precision()): a module cast
  // with half() runs in 16 bits and one cast back with float_() in FP32, whatever automatic
  // casting would choose, as the seeds' per-layer model.conv1.half() / model.norm.float() do.
  Module& to(DType dtype);
  Module& half() { return to(DType::f16); }
  Module& bfloat16() { return to(DType::bf16); }
  Module& float_() { return to(DType::f32); }
  // Casts the parameters of the subtree without setting a precision: inputs keep their type (the
  // O2 level's normalization layers: FP32 weights, 16-bit activations in and out).
  Module& cast_parameters(DType dtype);
  // A precision for this module alone: its floating input is cast to `dtype` and automatic
  // casting is off inside it. std::nullopt: follow the input (the default).
  void set_precision(std::optional<DType> dtype) { precision_ = dtype; }
  std::optional<DType> precision() const { return precision_; }
  // The module's dotted path from the root of the tree it belongs to ("" for the root).
  const std::string& path() const { return path_; }
  void zero_grad();

  // ---- Printout and state ----
  // PyTorch's repr of the tree, then a table of every parameter and buffer: name, shape, dtype,
  // element count; and the totals.
  std::string summary();
  std::string repr(int indent = 0) const;
  // Parameters then buffers of each module, in registration order (PyTorch's state_dict order).
  std::vector<std::pair<std::string, Tensor>> state_dict();
  // Copies tensors into the model, converting dtypes. Every parameter and buffer must be present
  // with the right shape unless `strict` is false (then absent ones keep their values); names the
  // file (`source`) and the offending tensor in the error.
  void load_state_dict(const std::map<std::string, Tensor>& tensors, const std::string& source,
                       bool strict = true);
  // Charges every tensor's storage to its full name (memory reports name the layer).
  void name_storage(const std::string& prefix = {});

 protected:
  Tensor& param(const std::string& name);  // this module's own parameter (not recursive)
  bool has_param(const std::string& name) const;
  Tensor& buffer(const std::string& name);

 private:
  void add_child(const std::string& name, std::shared_ptr<Module> m);
  template <class F>
  void visit(const std::string& prefix, F&& f);

  void set_path(const std::string& path);
  Tensor recomputed(const Tensor& x);  // operator() with recomputation

  std::string type_;
  std::string path_;
  std::optional<DType> precision_;
  bool recompute_ = false;
  bool training_ = true;
  // unique_ptr: stable addresses for NamedTensor and the optimizers.
  std::vector<std::pair<std::string, std::unique_ptr<Tensor>>> params_;
  std::vector<std::pair<std::string, std::unique_ptr<Tensor>>> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
};

// True while a recomputed forward runs: layers with side effects in training (BatchNorm's running
// statistics) do not apply them twice.
bool recomputing();

}  // namespace mantissa::nn

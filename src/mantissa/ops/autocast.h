// Automatic casting (autocast): while an AutocastScope is alive on a thread, every op decides the
// dtype it runs in from its category in an AutocastPolicy (op_table.h gives the defaults):
//   lower precision: floating inputs are cast to the scope's 16-bit type (FP32 weights through a
//                    cast cache: one 16-bit copy per weight per scope), the output is 16-bit;
//   FP32:            the output is FP32 (kernels read 16-bit inputs exactly, so no input copy);
//   promote:         the output has the widest input type;
//   follow input:    the output has the first input's type.
// Without autocast an op writes the type its kind gives (op_table.h's default_output_type).
// AutocastDisabled turns casting off for a region (the optimizer step, gradient clipping, a module
// kept in FP32). Every decision that changes a dtype can be logged once per (op, module path,
// from -> to). The op context also carries the module path of the running op (set by
// nn::Module), the default accumulation type of matrix ops, and optional stochastic rounding of
// 16-bit op outputs.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "mantissa/autograd/autograd.h"
#include "mantissa/core/tensor.h"
#include "mantissa/kernels/gemm.h"
#include "mantissa/kernels/quantize.h"
#include "mantissa/ops/op_table.h"

namespace mantissa::ops {

struct OpOptions;

// Which ops run in which precision. Starts from op_table.h's categories; editable.
class AutocastPolicy {
 public:
  AutocastPolicy();  // the defaults of op_table.h
  AutocastCategory category(OpId op) const { return categories_[static_cast<size_t>(op)]; }
  void set(OpId op, AutocastCategory c);
  // The ops of a category, in table order.
  std::vector<OpId> list(AutocastCategory c) const;
  // Replaces the lower-precision and/or FP32 lists (nullopt keeps a list as it is). Ops leaving
  // a replaced list follow their input; ops named move into the list. Throws naming the op for
  // an unknown name, an op in both lists, an op named twice, or the cast op.
  void replace_lists(const std::optional<std::vector<std::string>>& lower,
                     const std::optional<std::vector<std::string>>& fp32);

 private:
  std::array<AutocastCategory, kNumOps> categories_;
};

// One op name per line; blank lines and text after '#' ignored. The file must be a regular file of
// at most 1 MiB (io::InputFile); throws mantissa::Error naming the file, and the line for a line
// that is not one op name.
std::vector<std::string> read_op_list(const std::string& path);

// One logged decision.
struct AutocastDecision {
  std::string op;
  std::string module;  // "" for ops outside any module
  DType from;          // the first floating input's type
  DType to;            // the type the op runs and writes in
  AutocastCategory category;
};
std::string to_string(const AutocastDecision& d);

// Decisions seen, each (op, module, from, to) once; optionally echoed to a sink as they happen.
class AutocastLog {
 public:
  explicit AutocastLog(std::function<void(const std::string&)> sink = {})
      : sink_(std::move(sink)) {}
  void record(const AutocastDecision& d);
  const std::vector<AutocastDecision>& decisions() const { return decisions_; }

 private:
  std::function<void(const std::string&)> sink_;
  std::map<std::string, size_t> seen_;
  std::vector<AutocastDecision> decisions_;
};

// Casting on for this thread while alive (scopes nest; the outermost one owns the cast cache,
// released when it ends). `policy` and `log` (optional) must outlive the scope.
class AutocastScope {
 public:
  AutocastScope(DType lower, const AutocastPolicy& policy, AutocastLog* log = nullptr);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;
  // Number of cached weight copies made in this scope (tests: once per weight, not per use).
  size_t cache_misses() const;
  size_t cache_hits() const;

 private:
  struct Saved;
  std::unique_ptr<Saved> saved_;
};

// Casting off for this thread while alive (the optimizer step, clipping, FP32 modules), and
// parameters read as stored (ReadAsScope off).
class AutocastDisabled {
 public:
  AutocastDisabled();
  ~AutocastDisabled();
  AutocastDisabled(const AutocastDisabled&) = delete;
  AutocastDisabled& operator=(const AutocastDisabled&) = delete;

 private:
  bool previous_, previous_read_as_;
};

// While alive on this thread, ops read every FP32 parameter marked with AutogradMeta::read_as as
// its 16-bit values: linear and conv2d their weight as OpOptions::weight_as does, any other op
// through a 16-bit copy of the parameter made once per outermost scope (the cast cache: a bias, a
// few values), and the output type is what the 16-bit parameter would give. The parameter's
// gradient is computed in that 16-bit type (autograd). The O2 level's model: FP32 masters read as
// the 16-bit model, whose copy is never made. AutocastDisabled turns it off too.
class ReadAsScope {
 public:
  ReadAsScope();
  ~ReadAsScope();
  ReadAsScope(const ReadAsScope&) = delete;
  ReadAsScope& operator=(const ReadAsScope&) = delete;

 private:
  struct Saved;
  std::unique_ptr<Saved> saved_;
};

// Whether casting is on for this thread, and its 16-bit type.
bool autocast_enabled();
DType autocast_dtype();

// ---- The rest of the op context ----

// The module running on this thread ("layer1.0.conv1"; "" outside modules). nn::Module sets it;
// it lives in core/memory.h (the owner of allocations), and autograd records it in every node.
using mantissa::current_module_path;
using mantissa::ModulePathScope;

// Default accumulation type of the matrix ops (OpKind::kMatrix) when OpOptions::partials is not
// given.
kernels::Partials default_partials();
class PartialsScope {
 public:
  explicit PartialsScope(kernels::Partials p);
  ~PartialsScope();
  PartialsScope(const PartialsScope&) = delete;
  PartialsScope& operator=(const PartialsScope&) = delete;

 private:
  kernels::Partials previous_;
};

// While alive, every op output stored in 16 bits is rounded stochastically: op k of the scope
// (in call order) uses the random stream (seed, base_stream + k), so a run is reproducible and
// independent of the thread count.
class StochasticOutputsScope {
 public:
  StochasticOutputsScope(uint64_t seed, uint64_t base_stream);
  ~StochasticOutputsScope();
  StochasticOutputsScope(const StochasticOutputsScope&) = delete;
  StochasticOutputsScope& operator=(const StochasticOutputsScope&) = delete;

 private:
  bool previous_on_;
  uint64_t previous_seed_, previous_stream_;
};

// ---- FP8 matrix ops ----
// While an Fp8Scope is alive on a thread and automatic casting is on, linear and conv2d run in FP8
// in every module the scope's provider names (ops.cc, "the FP8 path"): their input and weight
// are quantized, each with its own scale, to an FP8 format, multiplied exactly and accumulated in
// FP32, and the product scaled back by the inverse scales; in the backward pass the gradient of
// their output is quantized too. amp/fp8.h provides the scales and keeps their history
// (docs/mixed_precision.md, "FP8 training").

// One quantized tensor of one module's matrix op (its input, weight or output gradient): the
// format, the scale to quantize with, and where the quantization's statistics go.
class Fp8Tensor {
 public:
  virtual ~Fp8Tensor() = default;
  virtual DType format() const = 0;  // e4m3 or e5m2
  // Whether scale() needs the tensor's own amax (current scaling: one more read of the tensor).
  virtual bool needs_amax() const = 0;
  // The scale (finite, positive) to quantize a tensor whose amax is `amax` with.
  virtual float scale(float amax) const = 0;
  // What quantizing with `scale` saw (amax, saturated and flushed values).
  virtual void record(const kernels::QuantizeStats& stats, float scale) = 0;
};

struct Fp8OpScaling {
  std::shared_ptr<Fp8Tensor> input, weight, grad_output;
};

class Fp8Provider {
 public:
  virtual ~Fp8Provider() = default;
  // The scaling of the matrix op running in the module at `module_path`, or nullopt when that
  // module keeps its matrix ops in the 16-bit type.
  virtual std::optional<Fp8OpScaling> scaling(const std::string& module_path) = 0;
};

// FP8 matrix ops from `provider` (which must outlive the scope) on this thread while alive.
class Fp8Scope {
 public:
  explicit Fp8Scope(Fp8Provider& provider);
  ~Fp8Scope();
  Fp8Scope(const Fp8Scope&) = delete;
  Fp8Scope& operator=(const Fp8Scope&) = delete;

 private:
  Fp8Provider* previous_;
};

// The op context of this thread (autocast type and policy, partials, stochastic outputs and
// their stream counter), saved when a block's forward starts and put back to run it again for
// recomputation: the same ops then make the same values. The log is not kept (each decision was
// logged the first time), and the cast cache is the restoring scope's own.
class OpContextSnapshot {
 public:
  static OpContextSnapshot save();

 private:
  friend class OpContextRestore;
  struct Data;
  std::shared_ptr<const Data> data_;
};
class OpContextRestore {
 public:
  explicit OpContextRestore(const OpContextSnapshot& s);
  ~OpContextRestore();
  OpContextRestore(const OpContextRestore&) = delete;
  OpContextRestore& operator=(const OpContextRestore&) = delete;

 private:
  struct Saved;
  std::unique_ptr<Saved> saved_;
};

namespace detail {

// The FP8 scaling of a matrix op called now: an Fp8Scope is alive, automatic casting is on (a
// module with a precision of its own runs without either), no other op's call is active, and the
// provider names the running module. nullopt: the op runs as usual.
std::optional<Fp8OpScaling> fp8_scaling();

// Anomaly detection of an op's output computed outside OpCall (the FP8 path): throws
// autograd::AnomalyError naming the op, the module and the inputs when `y` holds inf or NaN.
void check_output(OpId op, const Tensor& y, const std::vector<Tensor>& inputs);

// What an op does at its entry: the inputs it should use (cast where the policy says), the
// options (output dtype and partials resolved), and at its exit the output it should return.
// Inactive (no copies, no changes) when neither autocast, stochastic outputs nor anomaly
// detection (autograd::DetectAnomalyScope: the output is checked for inf/NaN) are on, or when the
// op is called from inside another op's call.
class OpCall {
 public:
  OpCall(OpId op, const OpOptions& opt, std::initializer_list<const Tensor*> inputs)
      : OpCall(op, opt, std::span<const Tensor* const>(inputs.begin(), inputs.size())) {}
  OpCall(OpId op, const OpOptions& opt, std::span<const Tensor* const> inputs);  // cat's list
  ~OpCall();
  OpCall(const OpCall&) = delete;
  OpCall& operator=(const OpCall&) = delete;
  bool active() const { return active_; }
  const Tensor& in(size_t i) const { return inputs_[i]; }
  const std::vector<Tensor>& inputs() const { return inputs_; }
  const OpOptions& options() const;
  // The op's result: rounded stochastically to the intended 16-bit type when that is on.
  Tensor finish(Tensor y);

 private:
  void check_output(const Tensor& y) const;  // anomaly detection

  bool active_ = false;
  bool check_ = false;
  OpId op_ = OpId::cast;
  std::vector<Tensor> inputs_;
  std::vector<Tensor> originals_;  // as the caller passed them (anomaly detection only)
  std::unique_ptr<OpOptions> opt_;
  std::optional<DType> round_to_;
};

}  // namespace detail
}  // namespace mantissa::ops

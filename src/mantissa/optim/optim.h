// Optimizers with PyTorch's update formulas (torch.optim 1.13, single-tensor path), computed in
// FP32 whatever the storage dtypes; gradient clipping by global norm; learning-rate schedules. A
// step makes at most two passes over the gradients: a read-only one over all of them when the step
// needs a global answer first (inf/NaN for loss scaling, the norm for clipping), then one update
// pass that reads each parameter's gradient, state and value a chunk at a time and writes them
// back (unscaled, clipped, updated, rounded to their storage types). The loss scaler's own update
// is its caller's (amp::ScaledStep).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mantissa/nn/module.h"
#include "mantissa/optim/optim_kernels.h"

namespace mantissa::optim {

using ParamList = std::vector<nn::Module::NamedTensor>;

// Storage types of the optimizer state (PopTorch's first_order_momentum_accum_type and
// second_order_momentum_accum_type): FP32 by default; f16 or bf16 halve the state's memory.
struct StateTypes {
  DType first_moment = DType::f32;   // SGD momentum buffer, Adam exp_avg
  DType second_moment = DType::f32;  // Adam exp_avg_sq
};

// What a step does besides the update, all in the same two passes over the parameters: a
// read-only pass over the gradients (inf/NaN check and global norm, only when asked for) and the
// update pass (unscale, clip, update, rounding to the storage types).
struct StepOptions {
  float grad_scale = 1;         // every gradient is multiplied by this first (the 1/S of scaling)
  double max_grad_norm = 0;     // > 0: clip the unscaled gradients to this global 2-norm
  bool skip_nonfinite = false;  // an inf/NaN gradient skips the whole step (nothing changes)
  // Optimizers that each update a shard of the parameters (set_shards: ZeRO stage 1) combine the
  // read-only pass's findings: called with this optimizer's sum of squares of the unscaled
  // gradients it updates and whether one of them is inf/NaN, it returns the totals over every
  // shard, from which the norm, the clipping and the skip follow alike on every shard. A
  // collective when it communicates: every shard's step() must be given it alike. Unset: this
  // optimizer's own figures are the totals.
  std::function<std::pair<double, bool>(double sum_of_squares, bool nonfinite)> combine = {};
};

// Elements [begin, end) of a parameter's flattened values.
struct ElementRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};

struct StepReport {
  bool skipped = false;
  std::optional<double> grad_norm;     // of the unscaled gradients, when computed (see
                                       // Optimizer::defer_gradients for when it is not)
  std::vector<std::string> nonfinite;  // parameters whose gradients hold inf/NaN
};

class Optimizer {
 public:
  Optimizer(ParamList params, double lr, StateTypes types);
  virtual ~Optimizer() = default;
  virtual std::string name() const = 0;

  // One update of every parameter that has a gradient (parameters without one are skipped, as in
  // PyTorch). Runs without recording autograd and with automatic casting off. A skipped step
  // does not count in steps().
  StepReport step(const StepOptions& o = {});
  void zero_grad();  // drops every gradient
  double lr() const { return lr_; }
  void set_lr(double lr) { lr_ = lr; }
  int64_t steps() const { return steps_; }
  const ParamList& params() const { return params_; }
  const StateTypes& state_types() const { return types_; }
  // Sets the state's storage types; before the first step (state buffers are made on first use).
  void set_state_types(StateTypes types);

  // Updates during the backward pass (PyTorch's optimizer-in-backward): begin_backward_step()
  // starts the step (counts it, sets its scalars) and gives each eligible parameter a gradient
  // consumer (AutogradMeta::consume_grad) that applies the update as soon as the backward pass
  // has the gradient, which is then dropped instead of stored: gradients do not pile up over
  // the backward pass, and each is read while it is still in cache. step() then updates the
  // parameters whose gradients were stored the ordinary way (a shared weight). The arithmetic is
  // the ordinary step's, bit for bit; only a step that needs nothing global qualifies (the
  // caller's to decide: no clipping, no inf/NaN skip, no loss scale, one backward pass).
  // Eligible: contiguous parameters (any dtype, master copies too). They also accept their
  // gradient in parts (AutogradMeta::consume_grad_parts), which a linear layer's backward hands
  // over as it computes them: the weight gradient is never stored whole, and the update reads
  // each part from cache. The arithmetic is the same, element by element.
  // An exception in the backward pass leaves the parameters updated so far updated. Returns how
  // many parameters got a consumer.
  size_t begin_backward_step();

  // Gradients kept as what computes them, for a step that needs every gradient before it may
  // change anything (the inf/NaN skip of loss scaling): each eligible parameter gets a deferral
  // (AutogradMeta::defer_grad_parts), through which an op that computes its gradient in parts
  // (a linear layer's weight gradient at a small batch) leaves a producer of the parts (its
  // small operands, g and x) instead of the gradient, as does a convolution whose dy and x hold
  // at most half its weight gradient's bytes (one part, computed whole at the step); other ops
  // store theirs as usual. step()
  // then computes each deferred gradient twice in parts: in the read-only pass (inf/NaN and the
  // sum of squares, in the parts' order) and, unless the step is skipped, in the update pass,
  // where each part is applied while in cache, before the stored gradients. Without clipping
  // (no norm needed), a gradient whose bound (AutogradMeta::defer_grad_parts) proves every
  // unscaled value finite skips the read-only pass (StepReport::grad_norm is then not computed):
  // the check could only have passed. The parts are the
  // bits the stored gradient would hold, so the step (and its skip) is the ordinary step's, bit
  // for bit, clipping aside (the norm sums the parts in another order: the trainer defers only
  // without clipping). An overflow anywhere, also in the last gradient the backward pass
  // produces, skips the step before any parameter or state changes. The deferrals live until
  // step() or zero_grad(). Sharded (set_shards), the check and the update read the parts within
  // this optimizer's range of each parameter and drop the others (a producer that forms only
  // the range, as dist::FactorGradients does under ZeRO, saves their work). Eligible: contiguous
  // parameters that require grad and have no gradient; not with a step begun in the backward
  // pass. `only`, when given, picks the parameters that get one (data parallelism: those whose
  // gradients are formed from factors gathered over the ranks, global as soon as formed).
  // Returns how many got one.
  size_t defer_gradients(const std::function<bool(const Tensor&)>& only = {});
  // Parameters whose gradient is now kept as its producer.
  size_t deferred_gradients() const;

  // FP32 master copies of the 16-bit parameters, made now from their current values (charged to
  // MemoryCategory::master_weights): the update runs on the masters and rounds each into its
  // 16-bit parameter in the same pass.
  void enable_master_weights();
  bool has_master_weights() const { return masters_enabled_; }
  // Stochastic rounding of every 16-bit parameter and optimizer-state write (round to nearest
  // even when nullopt). The random bits of an element are a function of (seed, step, parameter,
  // buffer, element index): reproducible, independent of the thread count, and resumed exactly
  // from the step count a checkpoint holds.
  void set_stochastic_rounding(std::optional<uint64_t> seed);
  std::optional<uint64_t> stochastic_rounding() const { return sr_seed_; }
  // Kahan-compensated 16-bit parameters (optimi's kahan_summation): each f16/bf16 parameter gets
  // a compensation buffer c of its own type (1-D over its shard when sharded; made as zeros with
  // the first update, charged to MemoryCategory::optimizer_state, named "<parameter>.kahan" in
  // state_tensors()), which holds what rounding the weight to 16 bits left out. With w the stored
  // weight and d the change the optimizer computes for it in FP32 (d = w1 - w, w1 the FP32 result
  // of the update from w: the whole change, weight decay, momentum and Adam's step included),
  // each update is
  //   u = c + d;  w' = round(w + u);  c' = round(u - (w' - w))     (FP32 arithmetic, round to
  // nearest even into the parameter's type), so changes far below half an ulp of w add up in c
  // until they move w, at 2 bytes per parameter. FP32 parameters update as before. Not with
  // master weights (they keep the exact value already) nor stochastic rounding (which rounds the
  // same errors away in expectation instead): both refused. Before the first step.
  void enable_kahan();
  bool kahan() const { return kahan_; }

  // The state for a checkpoint: tensors named "<parameter>.<buffer>" (e.g. "fc1.weight.exp_avg",
  // "fc1.weight.master") and the step count. load_state() checks names, shapes and that nothing
  // is missing.
  std::vector<std::pair<std::string, Tensor>> state_tensors() const;
  void load_state(const std::map<std::string, Tensor>& tensors, int64_t steps,
                  const std::string& source);
  // The state buffers each parameter gets (names as in state_tensors(), e.g. "exp_avg") and their
  // storage types, in order.
  std::vector<std::pair<std::string, DType>> state_layout() const;
  // Bytes of optimizer state, Kahan compensation included (master weights not included).
  size_t state_bytes() const;
  // Bytes of FP32 master weights.
  size_t master_bytes() const;

  // Sharded state (ZeRO stage 1): this optimizer owns elements ranges[i] of parameter i's
  // flattened values (an empty range: none of it). Its state buffers and master weights hold
  // those elements alone (1-D, range.size() elements; existing masters are cut to their range),
  // and step() updates only them: the rest of each parameter belongs to other shards, whose
  // owners bring it up to date (dist::Zero1 all-gathers the parameters after each step). An
  // element's update is the arithmetic of the unsharded optimizer, stochastic rounding included
  // (its bits are keyed by the element's index in the whole parameter), so shards that together
  // cover every element compute what one optimizer would. state_tensors() then returns the parts
  // (1-D) and load_state() takes whole tensors, keeping the parts. Before the first step; not
  // with begin_backward_step().
  void set_shards(std::vector<ElementRange> ranges);
  bool sharded() const { return !shards_.empty(); }
  // The elements of parameter i this optimizer updates: its range, or all of them.
  ElementRange shard(size_t i) const;

 protected:
  // What update_chunk gets besides the FP32 arrays.
  struct ChunkArgs {
    size_t param = 0;
    bool fresh_state = false;  // the state buffers were created in this step (zeros)
    float unscale = 1, clip = 1;
    // The parameter's element that the state buffers' and master's element 0 holds (a shard's
    // begin; 0 unsharded).
    int64_t state_begin = 0;
  };
  // Called once per step before any update (per-step scalars).
  virtual void begin_step() {}
  // The number of state buffers this step uses (state_names() gives their names).
  virtual size_t buffers_used() const = 0;
  // Updates n elements of a parameter in FP32: p (the master or a staged copy), g (the
  // gradient, not yet unscaled or clipped), s[k] the state buffers. Called from several threads.
  virtual void update_chunk(const ChunkArgs& a, float* p, const float* g, float* const* s,
                            int64_t n) const = 0;
  // The same on the tensors' own storage (16-bit values converted in registers), when the
  // optimizer has such a path and writes round to nearest; false: stage instead.
  virtual bool update_chunk_direct(const ChunkArgs&, const detail::DirectChunk&, int64_t) const {
    return false;
  }
  virtual std::vector<std::string> state_names() const = 0;
  virtual DType state_dtype(size_t k) const = 0;

  ParamList params_;
  double lr_;
  StateTypes types_;
  int64_t steps_ = 0;

 private:
  // The state buffer `k` of parameter i (created as zeros of state_dtype(k) on first use).
  Tensor& state(size_t i, size_t k);
  bool has_state(size_t i, size_t k) const;
  void update_param(size_t i, const Tensor& g, float unscale, float clip);
  // The state buffers of parameter i (created on first use) and whether any was created now;
  // with Kahan compensation, parameter i's compensation buffer too (when 16-bit).
  std::vector<Tensor*> state_buffers(size_t i, bool* fresh);
  // Writes a staged chunk's updated FP32 values `w1` (from the 16-bit values `w`) into parameter
  // i's elements [b, b + n) with the compensation `comp`'s elements [s, s + n).
  void kahan_store(size_t i, const Tensor& comp, int64_t b, int64_t s, int64_t n, const float* w,
                   float* w1) const;
  // Updates elements [b, b + n) (n <= the chunk size) of parameter i from its gradient's values
  // there, `g` (dtype gt, contiguous).
  void update_elements(const ChunkArgs& a, Tensor* const* bufs, int64_t b, int64_t n, const char* g,
                       DType gt) const;
  CastOptions rounding(size_t i, size_t buffer, int64_t begin) const;
  // A consumer applying the update `a` to parts of parameter i's gradient (converted to the
  // gradient's type gt first, as `grad` would hold them).
  GradPartConsumer part_updater(const ChunkArgs& a, std::vector<Tensor*> bufs, DType gt) const;
  // The type parameter i's gradient is held in.
  DType grad_type(size_t i) const;
  void clear_deferrals();

  // The shape of parameter i's state and master: the parameter's, or (sharded) its range's.
  Shape state_shape(size_t i) const;

  std::vector<std::vector<Tensor>> state_;  // [param][buffer]
  std::vector<Tensor> masters_;             // [param]: undefined where there is none
  std::vector<Tensor> comps_;               // [param]: Kahan compensation, made on first use
  std::vector<ElementRange> shards_;        // [param] when sharded, else empty
  bool masters_enabled_ = false;
  bool kahan_ = false;
  std::optional<uint64_t> sr_seed_;
  bool backward_step_ = false;              // begin_backward_step() ran; step() has not yet
  std::vector<GradPartProducer> deferred_;  // [param] when defer_gradients() ran, else empty
  std::vector<double> deferred_bounds_;     // [param]: the bound each producer came with
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
  size_t buffers_used() const override { return o_.momentum != 0 ? 1 : 0; }
  void update_chunk(const ChunkArgs& a, float* p, const float* g, float* const* s,
                    int64_t n) const override;
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
  void begin_step() override;
  size_t buffers_used() const override { return 2; }
  void update_chunk(const ChunkArgs& a, float* p, const float* g, float* const* s,
                    int64_t n) const override;
  bool update_chunk_direct(const ChunkArgs& a, const detail::DirectChunk& c,
                           int64_t n) const override;
  std::vector<std::string> state_names() const override { return {"exp_avg", "exp_avg_sq"}; }
  DType state_dtype(size_t k) const override {
    return k == 0 ? types_.first_moment : types_.second_moment;
  }

 private:
  AdamOptions o_;
  bool decoupled_;
  detail::AdamScalars scalars_{};  // this step's
};

// Scales all gradients so that their global 2-norm is at most max_norm (torch.nn.utils.
// clip_grad_norm_: coefficient max_norm / (norm + 1e-6), capped at 1). Returns the norm before
// clipping (inf or nan when a gradient is not finite; then nothing is scaled).
double clip_grad_norm(const ParamList& params, double max_norm);
// The global 2-norm of the gradients (FP64 accumulation).
double grad_norm(const ParamList& params);
// g *= factor for every gradient, in place (computed in FP32, stored in the gradient's type);
// gradient accumulation's running mean uses it between micro-batches.
void scale_grads(const ParamList& params, float factor);

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

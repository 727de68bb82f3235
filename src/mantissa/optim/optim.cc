#include "mantissa/optim/optim.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <numbers>

#include "mantissa/autograd/autograd.h"
#include "mantissa/core/cpu_features.h"
#include "mantissa/core/error.h"
#include "mantissa/core/parallel.h"
#include "mantissa/core/profiler.h"
#include "mantissa/kernels/elementwise.h"
#include "mantissa/ops/autocast.h"
#include "mantissa/optim/optim_kernels.h"

namespace mantissa::optim {
namespace {

constexpr int64_t kChunk = 1024;

#if MANTISSA_HAVE_X86_SIMD
// Whether the optimizer family runs its SIMD loops (the AVX2 ones; on the AVX-512 path Adam's
// loop sixteen lanes wide and the AVX2 exact lanes in AVX-512), asked once.
bool simd_loops() {
  static const bool simd = simd_path(SimdFamily::kOptimizer) != SimdPath::kScalar;
  return simd;
}
// Whether the Adam loop runs sixteen lanes at a time.
bool avx512_loops() {
  static const bool wide = simd_path(SimdFamily::kOptimizer) == SimdPath::kAvx512;
  return wide;
}
#endif

// Calls f(begin, count) over [0, n) in chunks of at most kChunk elements, in parallel.
template <class F>
void for_chunks(int64_t n, F&& f) {
  parallel_for(static_cast<size_t>(n), 1 << 15, default_num_threads(), [&](size_t b, size_t e) {
    for (size_t c = b; c < e; c += kChunk)
      f(static_cast<int64_t>(c), static_cast<int64_t>(std::min<size_t>(kChunk, e - c)));
  });
}

// A chunk of a tensor staged in FP32 (or read in place when the tensor is f32).
class Staged {
 public:
  // Unbound until bind(). The buffer is left uninitialized: value-initializing it (as
  // std::optional<Staged> did) zeroed 4 KB per chunk, about a tenth of an FP32 AdamW update.
  Staged() {}
  Staged(const Tensor& t, int64_t begin, int64_t n) { bind(t, begin, n); }
  void bind(const Tensor& t, int64_t begin, int64_t n) {
    t_ = const_cast<Tensor*>(&t);
    begin_ = begin;
    n_ = n;
    if (t.dtype() == DType::f32) {
      ptr_ = static_cast<float*>(t_->data_ptr()) + begin;
    } else {
      ptr_ = buf_;
      kernels::load_f32(static_cast<const char*>(t.data_ptr()) + begin * dtype_size(t.dtype()),
                        t.dtype(), 1, n, buf_);
    }
  }
  float* data() { return ptr_; }
  float& operator[](int64_t i) { return ptr_[i]; }
  // Writes the values back, rounded as `opt` says when the tensor is 16-bit.
  void store(const CastOptions& opt = {}) {
    if (ptr_ != buf_) return;
    char* dst = static_cast<char*>(t_->data_ptr()) + begin_ * dtype_size(t_->dtype());
    if (opt.rounding == Rounding::kNearestEven)
      kernels::store_f32(buf_, n_, dst, t_->dtype(), 1);
    else
      convert(buf_, DType::f32, dst, t_->dtype(), static_cast<size_t>(n_), opt);
  }

 private:
  Tensor* t_ = nullptr;
  int64_t begin_ = 0, n_ = 0;
  float* ptr_ = nullptr;
  float buf_[kChunk];
};

Tensor checked_grad(const nn::Module::NamedTensor& p) {
  Tensor g = p.tensor->grad();
  if (!g.defined()) return g;
  MANTISSA_CHECK(g.shape() == p.tensor->shape(),
                 "gradient of '" + p.name + "' has shape " + shape_str(g.shape()) +
                     " but the parameter " + shape_str(p.tensor->shape()),
                 "");
  return g.contiguous();
}

// Adds the squares of (x[j] * scale) over len <= kChunk values to *s (eight FP32 lanes, added
// in FP64) and clears *ok when one of the products is not finite.
void chunk_squares(const float* x, int64_t len, float scale, double* s, bool* ok) {
  float acc[8] = {};
  detail::sum_squares(x, len, scale, acc);
  float total = 0;
  for (float v : acc) total += v;
  // inf/NaN show in the sum; a finite value whose square overflows is checked one by one.
  if (!std::isfinite(total))
    for (int64_t j = 0; j < len; ++j) *ok = *ok && std::isfinite(x[j] * scale);
  for (float v : acc) *s += v;
}

// Sum of squares of (g * scale) over elements [first, first + n) of a gradient (FP64 across
// chunks), and whether every value is finite.
std::pair<double, bool> sum_of_squares(const Tensor& g, float scale, int64_t first, int64_t n) {
  std::vector<double> partial((static_cast<size_t>(n) + (1 << 15) - 1) >> 15, 0.0);
  std::vector<char> finite(partial.size(), 1);
  parallel_for(static_cast<size_t>(n), 1 << 15, default_num_threads(), [&](size_t b, size_t e) {
    double s = 0;
    bool ok = true;
    for (size_t c = b; c < e; c += kChunk) {
      const int64_t len = static_cast<int64_t>(std::min<size_t>(kChunk, e - c));
      Staged gs(g, first + static_cast<int64_t>(c), len);
      chunk_squares(gs.data(), len, scale, &s, &ok);
    }
    partial[b >> 15] = s;
    finite[b >> 15] = ok;
  });
  double total = 0;
  bool ok = true;
  for (size_t k = 0; k < partial.size(); ++k) {
    total += partial[k];
    ok = ok && finite[k];
  }
  return {total, ok};
}

// Whether every value of a deferred gradient bounded by `bound` in magnitude (its producer's
// dtype) is finite once converted to gt and multiplied by scale in FP32, as sum_of_squares checks
// it: the conversion rounds by at most half a unit (a factor 1 + 2^-8 for bf16) and stays finite
// below gt's largest value, and the FP32 product rounds by 1 + 2^-24; 2^-6 covers both.
bool proven_finite(double bound, DType gt, float scale) {
  const double b = bound * (1 + 0x1p-6);
  return b <= max_finite(gt) && b * std::fabs(static_cast<double>(scale)) <=
                                    static_cast<double>(std::numeric_limits<float>::max()) / 2;
}

// The same over a gradient kept as its producer (Optimizer::defer_gradients): the parts,
// converted to gt as `grad` would hold them, each summed as chunks are above; the parts' sums
// are added in the order of their offsets (the parts arrive from several threads).
std::pair<double, bool> sum_of_squares(const GradPartProducer& produce, DType gt, float scale) {
  std::mutex mutex;
  std::map<int64_t, double> sums;  // by the part's first element
  bool ok = true;
  produce([&](int64_t begin, int64_t n, const void* g, DType dt) {
    double s = 0;
    bool part_ok = true;
    float values[kChunk];
    alignas(32) char converted[kChunk * 8];
    for (int64_t b = 0; b < n; b += kChunk) {
      const int64_t len = std::min(kChunk, n - b);
      const char* part = static_cast<const char*>(g) + b * static_cast<int64_t>(dtype_size(dt));
      if (dt != gt) {
        convert(part, dt, converted, gt, static_cast<size_t>(len));
        part = converted;
      }
      kernels::load_f32(part, gt, 1, len, values);
      chunk_squares(values, len, scale, &s, &part_ok);
    }
    const std::lock_guard<std::mutex> lock(mutex);
    sums[begin] += s;
    ok = ok && part_ok;
  });
  double total = 0;
  for (const auto& [begin, s] : sums) total += s;
  return {total, ok};
}

// A deferred gradient's parts within elements [r.begin, r.end) alone (a shard's range): parts
// outside it are dropped and parts across its ends cut.
GradPartProducer within(GradPartProducer produce, ElementRange r) {
  return [produce = std::move(produce), r](const GradPartConsumer& consume) {
    produce([&](int64_t begin, int64_t n, const void* g, DType dt) {
      const int64_t lo = std::max(begin, r.begin), hi = std::min(begin + n, r.end);
      if (lo >= hi) return;
      consume(lo, hi - lo,
              static_cast<const char*>(g) + (lo - begin) * static_cast<int64_t>(dtype_size(dt)),
              dt);
    });
  };
}

}  // namespace

Optimizer::Optimizer(ParamList params, double lr, StateTypes types)
    : params_(std::move(params)),
      lr_(lr),
      state_(params_.size()),
      masters_(params_.size()),
      comps_(params_.size()) {
  MANTISSA_CHECK(std::isfinite(lr) && lr >= 0,
                 "learning rate " + std::to_string(lr) + " is not valid",
                 "use a finite, non-negative --lr");
  set_state_types(types);
}

void Optimizer::set_state_types(StateTypes types) {
  for (DType t : {types.first_moment, types.second_moment})
    MANTISSA_CHECK(is_compute_float(t),
                   "optimizer state type " + std::string(dtype_name(t)) + " is not supported",
                   "use f32, f16 or bf16");
  for (const std::vector<Tensor>& buffers : state_)
    for (const Tensor& b : buffers)
      MANTISSA_CHECK(!b.defined(), "the optimizer's state types cannot change after its first step",
                     "set them before training (amp::apply_precision does)");
  types_ = types;
}

void Optimizer::enable_master_weights() {
  MANTISSA_CHECK(!kahan_, "Kahan compensation and FP32 master weights together",
                 "master weights keep the exact values already: use one of them");
  masters_enabled_ = true;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = *params_[i].tensor;
    if (p.dtype() == DType::f32 || masters_[i].defined()) continue;
    TensorOptions o = charged_to(MemoryCategory::master_weights);
    o.owner = params_[i].name + ".master";
    masters_[i] = Tensor::empty(p.shape(), DType::f32, o);
    masters_[i].copy_from(p);
  }
}

void Optimizer::set_stochastic_rounding(std::optional<uint64_t> seed) {
  MANTISSA_CHECK(!seed || !kahan_, "stochastic rounding together with Kahan compensation",
                 "use one of them: each keeps the updates below half an ulp");
  sr_seed_ = seed;
}

void Optimizer::enable_kahan() {
  MANTISSA_CHECK(!masters_enabled_, "Kahan compensation and FP32 master weights together",
                 "master weights keep the exact values already: use one of them");
  MANTISSA_CHECK(!sr_seed_, "stochastic rounding together with Kahan compensation",
                 "use one of them: each keeps the updates below half an ulp");
  MANTISSA_CHECK(steps_ == 0, "Kahan compensation enabled after the optimizer's first step",
                 "enable it before training (amp::apply_precision does)");
  kahan_ = true;
}

void Optimizer::set_shards(std::vector<ElementRange> ranges) {
  MANTISSA_CHECK(ranges.size() == params_.size(),
                 "optimizer shards: " + std::to_string(ranges.size()) + " ranges for " +
                     std::to_string(params_.size()) + " parameters",
                 "give one element range per parameter");
  for (const std::vector<Tensor>& buffers : state_)
    for (const Tensor& b : buffers)
      MANTISSA_CHECK(!b.defined(), "the optimizer's shards cannot change after its first step",
                     "shard the optimizer before training");
  for (const Tensor& c : comps_)
    MANTISSA_CHECK(!c.defined(), "the optimizer's shards cannot change after its first step",
                   "shard the optimizer before training");
  MANTISSA_CHECK(!backward_step_, "optimizer shards set during a step begun in the backward pass",
                 "shard the optimizer before training");
  for (size_t i = 0; i < params_.size(); ++i) {
    const ElementRange r = ranges[i];
    MANTISSA_CHECK(r.begin >= 0 && r.begin <= r.end && r.end <= params_[i].tensor->numel(),
                   "optimizer shard [" + std::to_string(r.begin) + ", " + std::to_string(r.end) +
                       ") of '" + params_[i].name + "' outside its " +
                       std::to_string(params_[i].tensor->numel()) + " elements",
                   "give each parameter a range of its flattened elements");
  }
  shards_ = std::move(ranges);
  // Master weights keep only the shard's elements, from the parameter's current values.
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!masters_[i].defined()) continue;
    const ElementRange r = shards_[i];
    TensorOptions o = charged_to(MemoryCategory::master_weights);
    o.owner = params_[i].name + ".master";
    Tensor part = Tensor::empty({r.size()}, DType::f32, o);
    if (r.size() > 0)
      part.copy_from(params_[i].tensor->contiguous().view({-1}).narrow(0, r.begin, r.size()));
    masters_[i] = std::move(part);
  }
}

ElementRange Optimizer::shard(size_t i) const {
  return shards_.empty() ? ElementRange{0, params_[i].tensor->numel()} : shards_[i];
}

Shape Optimizer::state_shape(size_t i) const {
  return shards_.empty() ? params_[i].tensor->shape() : Shape{shards_[i].size()};
}

CastOptions Optimizer::rounding(size_t i, size_t buffer, int64_t begin) const {
  CastOptions o;
  if (!sr_seed_) return o;
  o.rounding = Rounding::kStochastic;
  o.seed = *sr_seed_;
  // One stream per (step, parameter, buffer); buffer 15 is the parameter itself.
  o.stream = (static_cast<uint64_t>(steps_) << 32) | (static_cast<uint64_t>(i) << 4) | buffer;
  o.index = static_cast<uint64_t>(begin);
  return o;
}

StepReport Optimizer::step(const StepOptions& so) {
  autograd::NoGradScope no_grad;
  ops::AutocastDisabled no_autocast;
  StepReport report;
  // Gradients kept as their producers (defer_gradients), taken for this step: dropped with it.
  std::vector<GradPartProducer> deferred = std::move(deferred_);
  std::vector<double> bounds = std::move(deferred_bounds_);
  clear_deferrals();
  deferred.resize(params_.size());
  bounds.resize(params_.size(), std::numeric_limits<double>::infinity());
  std::vector<Tensor> grads(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) grads[i] = checked_grad(params_[i]);
  for (size_t i = 0; i < params_.size(); ++i) {
    MANTISSA_ASSERT(!(grads[i].defined() && deferred[i]),
                    "a parameter with a stored gradient and a deferred one");
    if (deferred[i] && !shards_.empty()) deferred[i] = within(std::move(deferred[i]), shards_[i]);
  }
  float clip = 1;
  // Pass 1 (read only): inf/NaN and the global norm of the unscaled gradients.
  if (so.skip_nonfinite || so.max_grad_norm > 0) {
    double total = 0;
    bool all_summed = true;
    for (size_t i = 0; i < params_.size(); ++i) {
      const ElementRange r = shard(i);
      if ((!grads[i].defined() && !deferred[i]) || r.size() == 0) continue;
      if (deferred[i] && so.max_grad_norm <= 0 && !so.combine &&
          proven_finite(bounds[i], grad_type(i), so.grad_scale)) {
        all_summed = false;  // no norm is needed, and the check could only pass
        continue;
      }
      const auto [sq, finite] = grads[i].defined()
                                    ? sum_of_squares(grads[i], so.grad_scale, r.begin, r.size())
                                    : sum_of_squares(deferred[i], grad_type(i), so.grad_scale);
      total += sq;
      if (!finite) report.nonfinite.push_back(params_[i].name);
    }
    if (so.combine) {
      // Every shard's figures: the same norm and decision on each.
      const auto [all, nonfinite] = so.combine(total, !report.nonfinite.empty());
      total = all;
      if (nonfinite && report.nonfinite.empty())
        report.nonfinite.push_back("(a part of the parameters updated by another shard)");
    }
    const double norm =
        report.nonfinite.empty() ? std::sqrt(total) : std::numeric_limits<double>::infinity();
    if (all_summed || !report.nonfinite.empty()) report.grad_norm = norm;
    if (!report.nonfinite.empty() && so.skip_nonfinite) {
      report.skipped = true;
      return report;
    }
    if (so.max_grad_norm > 0 && std::isfinite(norm)) {
      const double coef = so.max_grad_norm / (norm + 1e-6);
      if (coef < 1) clip = static_cast<float>(coef);
    }
  }
  // Pass 2: unscale, clip, update, round.
  if (backward_step_) {
    MANTISSA_ASSERT(so.grad_scale == 1 && so.max_grad_norm <= 0 && !so.skip_nonfinite,
                    "a step begun in the backward pass cannot scale, clip or skip");
    backward_step_ = false;
    for (auto& p : params_) {
      AutogradMeta* meta = p.tensor->autograd_meta().get();
      if (meta) meta->consume_grad = nullptr, meta->consume_grad_parts = nullptr;
    }
  } else {
    ++steps_;
    begin_step();
  }
  const std::string op = name();
  // The deferred gradients first: their producers read the inputs of the ops that made them,
  // which (a parameter used as an input) the other updates could change.
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!deferred[i] || shard(i).size() == 0) continue;
    ProfileTimer timed("optimizer", params_[i].name, op);
    ChunkArgs a;
    a.param = i;
    a.state_begin = shard(i).begin;
    a.unscale = so.grad_scale;
    a.clip = clip;
    deferred[i](part_updater(a, state_buffers(i, &a.fresh_state), grad_type(i)));
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!grads[i].defined() || shard(i).size() == 0) continue;
    ProfileTimer timed("optimizer", params_[i].name, op);
    update_param(i, grads[i], so.grad_scale, clip);
  }
  return report;
}

std::vector<Tensor*> Optimizer::state_buffers(size_t i, bool* fresh) {
  const size_t nb = buffers_used();
  std::vector<Tensor*> bufs(nb);
  *fresh = false;
  for (size_t k = 0; k < nb; ++k) {
    *fresh = *fresh || !has_state(i, k);
    bufs[k] = &state(i, k);
  }
  const Tensor& p = *params_[i].tensor;
  if (kahan_ && is_16bit_float(p.dtype()) && !comps_[i].defined()) {
    TensorOptions o = charged_to(MemoryCategory::optimizer_state);
    o.owner = params_[i].name + ".kahan";
    comps_[i] = Tensor::zeros(state_shape(i), p.dtype(), o);
  }
  return bufs;
}

void Optimizer::update_elements(const ChunkArgs& a, Tensor* const* bufs, int64_t b, int64_t n,
                                const char* g, DType gt) const {
  const size_t i = a.param;
  Tensor& p = *params_[i].tensor;
  const size_t nb = buffers_used();
  const Tensor* master = masters_[i].defined() ? &masters_[i] : nullptr;
  const Tensor& target = master ? *master : p;
  const Tensor* comp = comps_[i].defined() ? &comps_[i] : nullptr;
  constexpr size_t kParamBuffer = 15;
  // Elements [b, b + n) of the parameter (and of its gradient, g) are elements [s, s + n) of its
  // state and master: the same unless the state holds a shard.
  const int64_t s = b - a.state_begin;
  auto at = [](const Tensor& t, int64_t e) {
    return static_cast<char*>(const_cast<void*>(t.data_ptr())) +
           e * static_cast<int64_t>(dtype_size(t.dtype()));
  };
  if (!sr_seed_ && nb == 2 && !comp) {
    const detail::DirectChunk dc{at(p, b),
                                 p.dtype(),
                                 const_cast<char*>(g),
                                 gt,
                                 at(*bufs[0], s),
                                 bufs[0]->dtype(),
                                 at(*bufs[1], s),
                                 bufs[1]->dtype(),
                                 master ? const_cast<float*>(master->data<float>()) + s : nullptr};
    if (update_chunk_direct(a, dc, n)) return;
  }
  Staged ps(target, master ? s : b, n);
  float w0[kChunk];  // the 16-bit values before the update, for the compensation
  if (comp) std::copy_n(ps.data(), n, w0);
  float gbuf[kChunk];
  const float* gp = reinterpret_cast<const float*>(g);
  if (gt != DType::f32) {
    kernels::load_f32(g, gt, 1, n, gbuf);
    gp = gbuf;
  }
  Staged ss[2];
  float* sp[2] = {nullptr, nullptr};
  for (size_t k = 0; k < nb; ++k) {
    ss[k].bind(*bufs[k], s, n);
    sp[k] = ss[k].data();
  }
  update_chunk(a, ps.data(), gp, sp, n);
  for (size_t k = 0; k < nb; ++k) ss[k].store(rounding(i, k, b));
  if (master) {
    // The 16-bit working copy, rounded from the master while the chunk is in cache.
    convert(ps.data(), DType::f32, static_cast<char*>(p.data_ptr()) + b * dtype_size(p.dtype()),
            p.dtype(), static_cast<size_t>(n), rounding(i, kParamBuffer, b));
  } else if (comp) {
    kahan_store(i, *comp, b, s, n, w0, ps.data());
  } else {
    ps.store(rounding(i, kParamBuffer, b));
  }
}

void Optimizer::kahan_store(size_t i, const Tensor& comp, int64_t b, int64_t s, int64_t n,
                            const float* w, float* w1) const {
  Tensor& p = *params_[i].tensor;
  Staged c(comp, s, n);  // the compensation in FP32 (exact)
  float u[kChunk];
  for (int64_t j = 0; j < n; ++j) {
    u[j] = c[j] + (w1[j] - w[j]);  // the change the optimizer computed, plus what was left out
    w1[j] = w[j] + u[j];
  }
  char* dst = static_cast<char*>(p.data_ptr()) + b * static_cast<int64_t>(dtype_size(p.dtype()));
  kernels::store_f32(w1, n, dst, p.dtype(), 1);  // w' = round(w + u)
  kernels::load_f32(dst, p.dtype(), 1, n, w1);   // and its exact value
  // What w' left out of u (w' - w is exact: two nearby 16-bit values), rounded into c's type.
  for (int64_t j = 0; j < n; ++j) c[j] = u[j] - (w1[j] - w[j]);
  c.store();
}

void Optimizer::update_param(size_t i, const Tensor& g, float unscale, float clip) {
  Tensor& p = *params_[i].tensor;
  MANTISSA_CHECK(p.is_contiguous(), "parameter '" + params_[i].name + "' is not contiguous", "");
  ChunkArgs a;
  a.param = i;
  a.unscale = unscale;
  a.clip = clip;
  const ElementRange r = shard(i);
  a.state_begin = r.begin;
  const std::vector<Tensor*> bufs = state_buffers(i, &a.fresh_state);
  const char* gb = static_cast<const char*>(g.data_ptr());
  const int64_t gs = static_cast<int64_t>(dtype_size(g.dtype()));
  for_chunks(r.size(), [&](int64_t b, int64_t n) {
    update_elements(a, bufs.data(), r.begin + b, n, gb + (r.begin + b) * gs, g.dtype());
  });
}

size_t Optimizer::begin_backward_step() {
  MANTISSA_ASSERT(!backward_step_, "begin_backward_step twice without step()");
  MANTISSA_CHECK(shards_.empty(), "updates in the backward pass with a sharded optimizer",
                 "a shard's update waits for the gradients reduced over every shard: use step()");
  ++steps_;
  begin_step();
  backward_step_ = true;
  size_t installed = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor& p = *params_[i].tensor;
    AutogradMeta* meta = p.autograd_meta().get();
    if (!meta || !p.requires_grad() || !p.is_contiguous() || meta->grad) continue;
    meta->consume_grad = [this, i, op = name()](int64_t begin, int64_t n, const void* g, DType gt) {
      // Called once, on the thread running the backward pass: the state is made here, as the
      // ordinary step makes it for a parameter that has a gradient.
      ProfileTimer timed("in-backward", params_[i].name, op);
      ChunkArgs a;
      a.param = i;
      const std::vector<Tensor*> bufs = state_buffers(i, &a.fresh_state);
      const int64_t gs = static_cast<int64_t>(dtype_size(gt));
      for_chunks(n, [&](int64_t b, int64_t len) {
        update_elements(a, bufs.data(), begin + b, len, static_cast<const char*>(g) + b * gs, gt);
      });
    };
    // The same update for a gradient given in parts, each converted to the gradient type as
    // `grad` would hold it (on the calling thread, a chunk at a time). Its profile row
    // ("in-backward", the parameter, the optimizer) lasts as long as the consumer, which the op
    // drops once it has given every part: the gradient's computation, fused with the update, is
    // inside it.
    meta->consume_grad_parts = [this, i, gt = meta->grad_dtype.value_or(p.dtype())]() {
      struct Timed {
        std::string op;
        ProfileTimer timer;
        Timed(std::string o, const std::string& where)
            : op(std::move(o)), timer("in-backward", where, op) {}
      };
      auto timed = std::make_shared<Timed>(name(), params_[i].name);
      ChunkArgs a;
      a.param = i;
      GradPartConsumer update = part_updater(a, state_buffers(i, &a.fresh_state), gt);
      return GradPartConsumer(
          [update = std::move(update), timed](int64_t begin, int64_t n, const void* g, DType dt) {
            update(begin, n, g, dt);
          });
    };
    ++installed;
  }
  return installed;
}

GradPartConsumer Optimizer::part_updater(const ChunkArgs& a, std::vector<Tensor*> bufs,
                                         DType gt) const {
  return [this, a, bufs = std::move(bufs), gt](int64_t begin, int64_t n, const void* g, DType dt) {
    const size_t in_size = dtype_size(dt);
    // A 16-bit part of an FP32 gradient (an autocast op's weight gradient) widens exactly: the
    // update reads it as it is (the loops widen in registers), the same values as its FP32 copy.
    const bool widens = gt == DType::f32 && (dt == DType::f16 || dt == DType::bf16);
    alignas(32) char converted[kChunk * 8];
    for (int64_t b = 0; b < n; b += kChunk) {
      const int64_t len = std::min(kChunk, n - b);
      const char* part = static_cast<const char*>(g) + b * static_cast<int64_t>(in_size);
      if (dt != gt && !widens) {
        convert(part, dt, converted, gt, static_cast<size_t>(len));
        part = converted;
      }
      update_elements(a, bufs.data(), begin + b, len, part, widens ? dt : gt);
    }
  };
}

DType Optimizer::grad_type(size_t i) const {
  const Tensor& p = *params_[i].tensor;
  const AutogradMeta* meta = p.autograd_meta().get();
  return meta && meta->grad_dtype ? *meta->grad_dtype : p.dtype();
}

size_t Optimizer::defer_gradients(const std::function<bool(const Tensor&)>& only) {
  MANTISSA_ASSERT(!backward_step_, "defer_gradients during a step begun in the backward pass");
  clear_deferrals();
  deferred_.resize(params_.size());
  deferred_bounds_.assign(params_.size(), std::numeric_limits<double>::infinity());
  size_t installed = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor& p = *params_[i].tensor;
    AutogradMeta* meta = p.autograd_meta().get();
    if (!meta || !p.requires_grad() || !p.is_contiguous() || meta->grad || (only && !only(p)))
      continue;
    meta->defer_grad_parts = [this, i](GradPartProducer produce, double bound) {
      deferred_[i] = std::move(produce);
      deferred_bounds_[i] = bound;
    };
    ++installed;
  }
  return installed;
}

size_t Optimizer::deferred_gradients() const {
  size_t n = 0;
  for (const GradPartProducer& p : deferred_) n += p ? 1 : 0;
  return n;
}

void Optimizer::clear_deferrals() {
  deferred_.clear();
  deferred_bounds_.clear();
  for (auto& p : params_) {
    AutogradMeta* meta = p.tensor->autograd_meta().get();
    if (meta) meta->defer_grad_parts = nullptr;
  }
}

void Optimizer::zero_grad() {
  clear_deferrals();
  for (auto& p : params_) p.tensor->zero_grad();
}

Tensor& Optimizer::state(size_t i, size_t k) {
  auto& s = state_[i];
  if (k < s.size() && s[k].defined()) return s[k];
  const std::vector<std::string> names = state_names();
  // Sized once for every buffer, so references returned earlier stay valid.
  if (s.size() < names.size()) s.resize(names.size());
  TensorOptions o = charged_to(MemoryCategory::optimizer_state);
  o.owner = params_[i].name + "." + names[k];
  s[k] = Tensor::zeros(state_shape(i), state_dtype(k), o);
  return s[k];
}

bool Optimizer::has_state(size_t i, size_t k) const {
  return state_[i].size() > k && state_[i][k].defined();
}

std::vector<std::pair<std::string, Tensor>> Optimizer::state_tensors() const {
  std::vector<std::pair<std::string, Tensor>> out;
  const auto names = state_names();
  for (size_t i = 0; i < params_.size(); ++i) {
    for (size_t k = 0; k < state_[i].size(); ++k)
      if (state_[i][k].defined()) out.emplace_back(params_[i].name + "." + names[k], state_[i][k]);
    if (masters_[i].defined()) out.emplace_back(params_[i].name + ".master", masters_[i]);
    if (comps_[i].defined()) out.emplace_back(params_[i].name + ".kahan", comps_[i]);
  }
  return out;
}

void Optimizer::load_state(const std::map<std::string, Tensor>& tensors, int64_t steps,
                           const std::string& source) {
  MANTISSA_CHECK(steps >= 0, source + ": negative optimizer step count", "");
  const auto names = state_names();
  std::vector<std::vector<Tensor>> loaded(params_.size());
  std::vector<Tensor> masters(params_.size()), comps(params_.size());
  size_t used = 0;
  size_t param = 0;  // the parameter `load` reads for
  auto load = [&](const std::string& key, const Shape& shape, DType dtype, MemoryCategory cat,
                  Tensor& into) {
    auto it = tensors.find(key);
    if (it == tensors.end()) return;
    ++used;
    MANTISSA_CHECK(it->second.shape() == shape,
                   source + ": optimizer state '" + key + "' has shape " +
                       shape_str(it->second.shape()) + " but the parameter " + shape_str(shape),
                   "the checkpoint belongs to another model");
    TensorOptions o = charged_to(cat);
    o.owner = key;
    into = Tensor::empty(state_shape(param), dtype, o);
    if (shards_.empty()) {
      into.copy_from(it->second);
    } else if (shards_[param].size() > 0) {
      const ElementRange r = shards_[param];  // a shard keeps its part of the whole tensor
      into.copy_from(it->second.contiguous().view({-1}).narrow(0, r.begin, r.size()));
    }
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    param = i;
    const Shape& shape = params_[i].tensor->shape();
    for (size_t k = 0; k < names.size(); ++k) {
      Tensor t;
      load(params_[i].name + "." + names[k], shape, state_dtype(k), MemoryCategory::optimizer_state,
           t);
      if (!t.defined()) continue;
      loaded[i].resize(names.size());
      loaded[i][k] = std::move(t);
    }
    // A parameter's buffers are created together at its first update: some without the others
    // is a damaged file, and the missing ones would restart from zero.
    for (size_t k = 0; !loaded[i].empty() && k < buffers_used(); ++k)
      MANTISSA_CHECK(loaded[i][k].defined(),
                     source + ": optimizer state '" + params_[i].name + "." + names[k] +
                         "' is missing while the parameter's other state is there",
                     "resume from an undamaged checkpoint of this run");
    load(params_[i].name + ".master", shape, DType::f32, MemoryCategory::master_weights,
         masters[i]);
    MANTISSA_CHECK(!masters_[i].defined() || masters[i].defined() || steps == 0,
                   source + ": no master weights for '" + params_[i].name + "'",
                   "resume with the --precision the checkpoint was made with");
    const std::string comp_key = params_[i].name + ".kahan";
    MANTISSA_CHECK(kahan_ || !tensors.count(comp_key),
                   source + ": Kahan compensation '" + comp_key + "' in a run without it",
                   "resume with --kahan, as the checkpoint was made");
    if (kahan_ && is_16bit_float(params_[i].tensor->dtype()))
      load(comp_key, shape, params_[i].tensor->dtype(), MemoryCategory::optimizer_state, comps[i]);
  }
  // A checkpoint made without compensation would restart it from zero: the run it continues
  // lost those updates, so a resume with --kahan would not continue it.
  bool has_16bit = false, has_comp = false;
  for (size_t i = 0; i < params_.size(); ++i) {
    has_16bit = has_16bit || is_16bit_float(params_[i].tensor->dtype());
    has_comp = has_comp || tensors.count(params_[i].name + ".kahan") > 0;
  }
  MANTISSA_CHECK(!kahan_ || !has_16bit || has_comp || steps == 0,
                 source + ": no Kahan compensation after " + std::to_string(steps) + " steps",
                 "resume without --kahan, as the checkpoint was made");
  MANTISSA_CHECK(used == tensors.size(),
                 source + ": " + std::to_string(tensors.size() - used) +
                     " optimizer state tensors match no parameter of this " + name() + " optimizer",
                 "resume with the optimizer, model and --precision the checkpoint was made with");
  MANTISSA_CHECK(
      steps == 0 || used > 0 || params_.empty() || buffers_used() == 0,
      source + ": " + name() + " state missing after " + std::to_string(steps) + " steps",
      "resume with the optimizer the checkpoint was made with");
  state_ = std::move(loaded);
  comps_ = std::move(comps);
  for (size_t i = 0; i < params_.size(); ++i)
    if (masters[i].defined()) {
      masters_[i] = std::move(masters[i]);
    } else if (masters_[i].defined() && shards_.empty()) {
      masters_[i].copy_from(*params_[i].tensor);  // a checkpoint from step 0
    } else if (masters_[i].defined() && shards_[i].size() > 0) {
      const ElementRange r = shards_[i];
      masters_[i].copy_from(
          params_[i].tensor->contiguous().view({-1}).narrow(0, r.begin, r.size()));
    }
  steps_ = steps;
}

size_t Optimizer::state_bytes() const {
  size_t b = 0;
  for (auto& s : state_)
    for (auto& t : s)
      if (t.defined()) b += t.nbytes();
  for (const Tensor& c : comps_)
    if (c.defined()) b += c.nbytes();
  return b;
}

std::vector<std::pair<std::string, DType>> Optimizer::state_layout() const {
  const std::vector<std::string> names = state_names();
  std::vector<std::pair<std::string, DType>> out;
  for (size_t k = 0; k < buffers_used() && k < names.size(); ++k)
    out.emplace_back(names[k], state_dtype(k));
  return out;
}

size_t Optimizer::master_bytes() const {
  size_t b = 0;
  for (const Tensor& t : masters_)
    if (t.defined()) b += t.nbytes();
  return b;
}

// ---- SGD ----
Sgd::Sgd(ParamList params, const SgdOptions& o, StateTypes types)
    : Optimizer(std::move(params), o.lr, types), o_(o) {
  MANTISSA_CHECK(o.momentum >= 0 && o.weight_decay >= 0 && o.dampening >= 0,
                 "SGD momentum, dampening and weight decay must be non-negative", "");
  MANTISSA_CHECK(!o.nesterov || (o.momentum > 0 && o.dampening == 0),
                 "Nesterov momentum requires a momentum and zero dampening",
                 "set --momentum (e.g. 0.9), or drop --nesterov");
}

void Sgd::update_chunk(const ChunkArgs& a, float* p, const float* g, float* const* s,
                       int64_t n) const {
  detail::SgdScalars sc;
  sc.lr = static_cast<float>(lr_);
  sc.momentum = static_cast<float>(o_.momentum);
  sc.damp = static_cast<float>(1 - o_.dampening);
  sc.wd = static_cast<float>(o_.weight_decay);
  sc.use_momentum = o_.momentum != 0;
  sc.first = sc.use_momentum && a.fresh_state;
  sc.nesterov = o_.nesterov;
  sc.unscale = a.unscale;
  sc.clip = a.clip;
  detail::sgd_update(p, g, sc.use_momentum ? s[0] : nullptr, n, sc);
}

void detail::sgd_update(float* p, const float* g, float* buf, int64_t n, const SgdScalars& s) {
  // A momentum buffer whose gradient stays zero decays by the momentum each step into the
  // subnormal range and stays there (a few units in the last place times 0.9 round back to
  // themselves): such elements, and tiny weights and gradients, take the exact path.
#if MANTISSA_HAVE_X86_SIMD
  if (simd_loops()) return sgd_update_avx2(p, g, buf, n, s);
#endif
  for (int64_t j = 0; j < n; ++j) {
    float none = 0;
    sgd_element(p[j], g[j], buf ? buf[j] : none, s);
  }
}

// ---- Adam / AdamW ----
Adam::Adam(ParamList params, const AdamOptions& o, bool decoupled, StateTypes types)
    : Optimizer(std::move(params), o.lr, types), o_(o), decoupled_(decoupled) {
  MANTISSA_CHECK(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1,
                 "Adam betas must lie in [0, 1)", "");
  MANTISSA_CHECK(o.eps >= 0 && o.weight_decay >= 0,
                 "Adam eps and weight decay must be non-negative", "");
}

void Adam::begin_step() {
  const double t = static_cast<double>(steps_);
  const double bc1 = o_.bias_correction ? 1 - std::pow(o_.beta1, t) : 1.0;
  const double bc2 = o_.bias_correction ? 1 - std::pow(o_.beta2, t) : 1.0;
  // The scalars PyTorch passes to its float kernels.
  detail::AdamScalars& sc = scalars_;
  sc.b1 = static_cast<float>(o_.beta1);
  sc.b2 = static_cast<float>(o_.beta2);
  sc.one_minus_b1 = static_cast<float>(1 - o_.beta1);
  sc.one_minus_b2 = static_cast<float>(1 - o_.beta2);
  sc.step_size = static_cast<float>(lr_ / bc1);
  sc.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  sc.eps = static_cast<float>(o_.eps);
  sc.wd = static_cast<float>(o_.weight_decay);
  sc.decay = static_cast<float>(1 - lr_ * o_.weight_decay);
  sc.decoupled = decoupled_;
}

void Adam::update_chunk(const ChunkArgs& a, float* p, const float* g, float* const* s,
                        int64_t n) const {
  detail::AdamScalars sc = scalars_;
  sc.unscale = a.unscale;
  sc.clip = a.clip;
  detail::adam_update(p, g, s[0], s[1], n, sc);
}

void detail::sum_squares(const float* x, int64_t n, float scale, float* acc) {
#if MANTISSA_HAVE_X86_SIMD
  if (simd_loops()) return sum_squares_avx2(x, n, scale, acc);
#endif
  sum_squares8(x, n, scale, acc);
}

bool Adam::update_chunk_direct(const ChunkArgs& a, const detail::DirectChunk& c, int64_t n) const {
  detail::AdamScalars sc = scalars_;
  sc.unscale = a.unscale;
  sc.clip = a.clip;
  return detail::adam_update_direct(c, n, sc);
}

bool detail::adam_update_direct(const DirectChunk& c, int64_t n, const AdamScalars& s) {
#if MANTISSA_HAVE_X86_SIMD
  // All-FP32 tensors gain nothing from it: the staged path reads them in place.
  const bool all_f32 =
      c.pt == DType::f32 && c.gt == DType::f32 && c.mt == DType::f32 && c.vt == DType::f32;
  if (simd_loops() && !all_f32 && is_compute_float(c.pt) && is_compute_float(c.gt) &&
      is_compute_float(c.mt) && is_compute_float(c.vt)) {
    if (avx512_loops())
      adam_update_direct_avx512(c, n, s);
    else
      adam_update_direct_avx2(c, n, s);
    return true;
  }
#endif
  (void)c, (void)n, (void)s;
  return false;
}

namespace {
uint32_t fp32_bits(double x) {
  const float f = static_cast<float>(x);
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}
}  // namespace

detail::ExactBits detail::exact_bits(double safe_grad, float unscale, float clip) {
  const double factor = std::fabs(static_cast<double>(unscale) * static_cast<double>(clip));
  // Zero factor: the gradient is zero whatever g is; a threshold of 1 (bits 0: none) then.
  const double g = factor > 0 ? std::min(safe_grad / factor, 1.0) : 0.0;
  const uint32_t gb = g > 0 ? fp32_bits(std::max(g, std::ldexp(1.0, -126))) : 1;
  return {fp32_bits(std::ldexp(1.0, -100)) - 1, gb - 1};
}

detail::ExactBits detail::adam_exact_bits(const AdamScalars& s) {
  const double tiny = std::ldexp(1.0, -120);
  const double o1 = std::fabs(static_cast<double>(s.one_minus_b1));
  const double o2 = std::fabs(static_cast<double>(s.one_minus_b2));
  double grad = 0;  // the smallest safe |grad|
  if (o1 > 0) grad = std::max(grad, tiny / o1);
  if (o2 > 0) grad = std::max(grad, std::sqrt(tiny / o2));
  return exact_bits(grad, s.unscale, s.clip);
}

void detail::adam_update(float* p, const float* g, float* m, float* v, int64_t n,
                         const detail::AdamScalars& s) {
#if MANTISSA_HAVE_X86_SIMD
  if (avx512_loops())
    return adam_update_direct_avx512(
        {p, DType::f32, g, DType::f32, m, DType::f32, v, DType::f32, nullptr}, n, s);
  if (simd_loops()) return adam_update_avx2(p, g, m, v, n, s);
#endif
  for (int64_t j = 0; j < n; ++j) adam_element(p[j], g[j], m[j], v[j], s);
}

// ---- Clipping ----
double grad_norm(const ParamList& params) {
  double total = 0;
  for (auto& p : params) {
    const Tensor g = p.tensor->grad();
    if (g.defined()) total += sum_of_squares(g.contiguous(), 1.0f, 0, g.numel()).first;
  }
  return std::sqrt(total);
}

double clip_grad_norm(const ParamList& params, double max_norm) {
  MANTISSA_CHECK(max_norm > 0, "max_grad_norm must be positive", "");
  autograd::NoGradScope no_grad;
  ops::AutocastDisabled no_autocast;
  const double norm = grad_norm(params);
  if (!std::isfinite(norm)) return norm;
  const double coef = max_norm / (norm + 1e-6);
  if (coef >= 1) return norm;
  scale_grads(params, static_cast<float>(coef));
  return norm;
}

void scale_grads(const ParamList& params, float factor) {
  for (auto& p : params) {
    Tensor g = p.tensor->grad();
    if (!g.defined()) continue;
    MANTISSA_CHECK(g.is_contiguous(), "gradient of '" + p.name + "' is not contiguous", "");
    for_chunks(g.numel(), [&](int64_t b, int64_t n) {
      Staged gs(g, b, n);
      for (int64_t j = 0; j < n; ++j) gs[j] = gs[j] * factor;
      gs.store();
    });
  }
}

// ---- Schedules ----
double LrSchedule::lr_at(double base, int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps)
    return base * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  const int64_t s = step - warmup_steps;
  switch (kind) {
    case Kind::kConstant:
      return base;
    case Kind::kStep:
      return base * std::pow(gamma, static_cast<double>(s / std::max<int64_t>(1, step_size)));
    case Kind::kCosine: {
      const int64_t span = std::max<int64_t>(1, total_steps - warmup_steps);
      const double progress = std::min(1.0, static_cast<double>(s) / static_cast<double>(span));
      return min_lr + (base - min_lr) * 0.5 * (1 + std::cos(std::numbers::pi * progress));
    }
  }
  return base;
}

LrSchedule::Kind parse_schedule(const std::string& name) {
  if (name == "constant") return LrSchedule::Kind::kConstant;
  if (name == "step") return LrSchedule::Kind::kStep;
  if (name == "cosine") return LrSchedule::Kind::kCosine;
  throw Error("unknown learning-rate schedule '" + excerpt(name) + "'",
              "use constant, step or cosine");
}

}  // namespace mantissa::optim

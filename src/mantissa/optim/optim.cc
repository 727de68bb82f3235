#include "mantissa/optim/optim.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "mantissa/autograd/autograd.h"
#include "mantissa/core/cpu_features.h"
#include "mantissa/core/error.h"
#include "mantissa/core/parallel.h"
#include "mantissa/kernels/elementwise.h"
#include "mantissa/optim/optim_kernels.h"

namespace mantissa::optim {
namespace {

constexpr int64_t kChunk = 1024;

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
  Staged(const Tensor& t, int64_t begin, int64_t n)
      : t_(const_cast<Tensor*>(&t)), begin_(begin), n_(n) {
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
  // Writes the values back, rounding to nearest even when the tensor is 16-bit.
  void store() {
    if (ptr_ == buf_)
      kernels::store_f32(buf_, n_,
                         static_cast<char*>(t_->data_ptr()) + begin_ * dtype_size(t_->dtype()),
                         t_->dtype(), 1);
  }

 private:
  Tensor* t_;
  int64_t begin_, n_;
  float* ptr_;
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

}  // namespace

Optimizer::Optimizer(ParamList params, double lr, StateTypes types)
    : params_(std::move(params)), lr_(lr), types_(types), state_(params_.size()) {
  MANTISSA_CHECK(std::isfinite(lr) && lr >= 0,
                 "learning rate " + std::to_string(lr) + " is not valid",
                 "use a finite, non-negative --lr");
  for (DType t : {types.first_moment, types.second_moment})
    MANTISSA_CHECK(t == DType::f32 || t == DType::f16 || t == DType::bf16,
                   "optimizer state type " + std::string(dtype_name(t)) + " is not supported",
                   "use f32, f16 or bf16");
}

void Optimizer::step() {
  autograd::NoGradGuard no_grad;
  ++steps_;
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor g = checked_grad(params_[i]);
    if (!g.defined()) continue;
    Tensor& p = *params_[i].tensor;
    MANTISSA_CHECK(p.is_contiguous(), "parameter '" + params_[i].name + "' is not contiguous", "");
    update(i, p, g);
  }
}

void Optimizer::zero_grad() {
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
  s[k] = Tensor::zeros(params_[i].tensor->shape(), state_dtype(k), o);
  return s[k];
}

bool Optimizer::has_state(size_t i, size_t k) const {
  return state_[i].size() > k && state_[i][k].defined();
}

std::vector<std::pair<std::string, Tensor>> Optimizer::state_tensors() const {
  std::vector<std::pair<std::string, Tensor>> out;
  const auto names = state_names();
  for (size_t i = 0; i < params_.size(); ++i)
    for (size_t k = 0; k < state_[i].size(); ++k)
      if (state_[i][k].defined()) out.emplace_back(params_[i].name + "." + names[k], state_[i][k]);
  return out;
}

void Optimizer::load_state(const std::map<std::string, Tensor>& tensors, int64_t steps,
                           const std::string& source) {
  MANTISSA_CHECK(steps >= 0, source + ": negative optimizer step count", "");
  const auto names = state_names();
  std::vector<std::vector<Tensor>> loaded(params_.size());
  size_t used = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    for (size_t k = 0; k < names.size(); ++k) {
      const std::string key = params_[i].name + "." + names[k];
      auto it = tensors.find(key);
      if (it == tensors.end()) continue;
      ++used;
      MANTISSA_CHECK(it->second.shape() == params_[i].tensor->shape(),
                     source + ": optimizer state '" + key + "' has shape " +
                         shape_str(it->second.shape()) + " but the parameter " +
                         shape_str(params_[i].tensor->shape()),
                     "the checkpoint belongs to another model");
      loaded[i].resize(names.size());
      TensorOptions o = charged_to(MemoryCategory::optimizer_state);
      o.owner = key;
      loaded[i][k] = Tensor::empty(params_[i].tensor->shape(), state_dtype(k), o);
      loaded[i][k].copy_from(it->second);
    }
  }
  MANTISSA_CHECK(used == tensors.size(),
                 source + ": " + std::to_string(tensors.size() - used) +
                     " optimizer state tensors match no parameter of this " + name() + " optimizer",
                 "resume with the optimizer and model the checkpoint was made with");
  MANTISSA_CHECK(
      steps == 0 || used > 0 || params_.empty(),
      source + ": " + name() + " state missing after " + std::to_string(steps) + " steps",
      "resume with the optimizer the checkpoint was made with");
  state_ = std::move(loaded);
  steps_ = steps;
}

size_t Optimizer::state_bytes() const {
  size_t b = 0;
  for (auto& s : state_)
    for (auto& t : s)
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

void Sgd::update(size_t i, Tensor& p, const Tensor& g) {
  const float wd = static_cast<float>(o_.weight_decay), lr = static_cast<float>(lr_);
  const float mom = static_cast<float>(o_.momentum), damp = static_cast<float>(1 - o_.dampening);
  const bool use_mom = o_.momentum != 0, first = use_mom && !has_state(i, 0);
  Tensor buf = use_mom ? state(i, 0) : Tensor();
  const bool nesterov = o_.nesterov;
  for_chunks(p.numel(), [&](int64_t b, int64_t n) {
    Staged ps(p, b, n), gs(g, b, n);
    if (use_mom) {
      Staged ms(buf, b, n);
      for (int64_t j = 0; j < n; ++j) {
        float d = gs[j];
        if (wd != 0) d = d + wd * ps[j];
        const float m = first ? d : ms[j] * mom + damp * d;
        ms[j] = m;
        if (nesterov)
          d = d + mom * m;
        else
          d = m;
        ps[j] = ps[j] + (-lr) * d;
      }
      ms.store();
    } else {
      for (int64_t j = 0; j < n; ++j) {
        float d = gs[j];
        if (wd != 0) d = d + wd * ps[j];
        ps[j] = ps[j] + (-lr) * d;
      }
    }
    ps.store();
  });
}

// ---- Adam / AdamW ----
Adam::Adam(ParamList params, const AdamOptions& o, bool decoupled, StateTypes types)
    : Optimizer(std::move(params), o.lr, types), o_(o), decoupled_(decoupled) {
  MANTISSA_CHECK(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1,
                 "Adam betas must lie in [0, 1)", "");
  MANTISSA_CHECK(o.eps >= 0 && o.weight_decay >= 0,
                 "Adam eps and weight decay must be non-negative", "");
}

void Adam::update(size_t i, Tensor& p, const Tensor& g) {
  Tensor& m = state(i, 0);
  Tensor& v = state(i, 1);
  const double t = static_cast<double>(steps_);
  const double bc1 = o_.bias_correction ? 1 - std::pow(o_.beta1, t) : 1.0;
  const double bc2 = o_.bias_correction ? 1 - std::pow(o_.beta2, t) : 1.0;
  // The scalars PyTorch passes to its float kernels.
  detail::AdamScalars sc;
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
  for_chunks(p.numel(), [&](int64_t b, int64_t n) {
    Staged ps(p, b, n), gs(g, b, n), ms(m, b, n), vs(v, b, n);
    detail::adam_update(ps.data(), gs.data(), ms.data(), vs.data(), n, sc);
    ms.store();
    vs.store();
    ps.store();
  });
}

void detail::adam_update(float* p, const float* g, float* m, float* v, int64_t n,
                         const detail::AdamScalars& s) {
#if MANTISSA_HAVE_X86_SIMD
  static const bool avx2 = cpu_features().avx2 && active_simd_path() == SimdPath::kAvx2;
  if (avx2) return adam_update_avx2(p, g, m, v, n, s);
#endif
  for (int64_t j = 0; j < n; ++j) adam_element(p[j], g[j], m[j], v[j], s);
}

// ---- Clipping ----
double grad_norm(const ParamList& params) {
  double total = 0;
  for (auto& p : params) {
    Tensor g = p.tensor->grad();
    if (!g.defined()) continue;
    g = g.contiguous();
    const int64_t n = g.numel();
    std::vector<double> partial((static_cast<size_t>(n) + (1 << 15) - 1) >> 15, 0.0);
    parallel_for(static_cast<size_t>(n), 1 << 15, default_num_threads(), [&](size_t b, size_t e) {
      double s = 0;
      for (size_t c = b; c < e; c += kChunk) {
        const int64_t len = static_cast<int64_t>(std::min<size_t>(kChunk, e - c));
        Staged gs(g, static_cast<int64_t>(c), len);
        float acc[8] = {};
        for (int64_t j = 0; j < len; ++j) acc[j & 7] += gs[j] * gs[j];
        for (float a : acc) s += a;
      }
      partial[b >> 15] = s;
    });
    for (double s : partial) total += s;
  }
  return std::sqrt(total);
}

double clip_grad_norm(const ParamList& params, double max_norm) {
  MANTISSA_CHECK(max_norm > 0, "max_grad_norm must be positive", "");
  const double norm = grad_norm(params);
  if (!std::isfinite(norm)) return norm;
  const double coef = max_norm / (norm + 1e-6);
  if (coef >= 1) return norm;
  const float c = static_cast<float>(coef);
  for (auto& p : params) {
    Tensor g = p.tensor->grad();
    if (!g.defined()) continue;
    MANTISSA_CHECK(g.is_contiguous(), "gradient of '" + p.name + "' is not contiguous", "");
    for_chunks(g.numel(), [&](int64_t b, int64_t n) {
      Staged gs(g, b, n);
      for (int64_t j = 0; j < n; ++j) gs[j] = gs[j] * c;
      gs.store();
    });
  }
  return norm;
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
  throw Error("unknown learning-rate schedule '" + name + "'", "use constant, step or cosine");
}

}  // namespace mantissa::optim

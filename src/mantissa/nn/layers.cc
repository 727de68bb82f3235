#include "mantissa/nn/layers.h"

#include <cmath>
#include <cstdio>

#include "mantissa/core/error.h"
#include "mantissa/nn/init.h"

namespace mantissa::nn {
namespace {

RandomContext g_random_context;

std::string num(double v) {  // as Python prints a float: 1e-05, 0.1
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

std::string pair(int64_t a, int64_t b) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "(%lld, %lld)", static_cast<long long>(a),
                static_cast<long long>(b));
  return buf;
}

// "weight" of `shape` (out, in, k...) and, when asked, "bias" (out), with nn.Linear's and
// nn.Conv2d's default initialisation, drawing from the next streams of `init` in that order.
void register_weight_and_bias(Module& m, const Shape& shape, bool bias, InitStreams& init) {
  Tensor w = Tensor::empty(shape, DType::f32, charged_to(MemoryCategory::parameters));
  init::default_weight_(w, init.seed(), init.next());
  const int64_t fan = init::fan_in(w);
  m.register_parameter("weight", w);
  if (bias) {
    Tensor b = Tensor::empty({shape[0]}, DType::f32, charged_to(MemoryCategory::parameters));
    init::default_bias_(b, fan, init.seed(), init.next());
    m.register_parameter("bias", b);
  }
}

}  // namespace

void set_random_context(const RandomContext& c) { g_random_context = c; }
RandomContext random_context() { return g_random_context; }

// ---- Conv2d ----
Conv2d::Conv2d(int64_t in, int64_t out, int64_t kernel, InitStreams& init, int64_t stride,
               int64_t padding, int64_t dilation, int64_t groups, bool bias)
    : Module("Conv2d"), in_(in), out_(out), kernel_(kernel), bias_(bias) {
  MANTISSA_CHECK(
      in > 0 && out > 0 && kernel > 0 && stride > 0 && padding >= 0 && dilation > 0 && groups > 0,
      "Conv2d(" + std::to_string(in) + ", " + std::to_string(out) + ", kernel " +
          std::to_string(kernel) + "): sizes must be positive",
      "");
  MANTISSA_CHECK(in % groups == 0 && out % groups == 0,
                 "Conv2d: channels " + std::to_string(in) + " -> " + std::to_string(out) +
                     " do not divide into " + std::to_string(groups) + " groups",
                 "");
  p_.stride_h = p_.stride_w = stride;
  p_.pad_h = p_.pad_w = padding;
  p_.dilation_h = p_.dilation_w = dilation;
  p_.groups = groups;
  register_weight_and_bias(*this, {out, in / groups, kernel, kernel}, bias, init);
}

Tensor Conv2d::forward(const Tensor& x) {
  return ops::conv2d(x, param("weight"), bias_ ? param("bias") : Tensor(), p_);
}

std::string Conv2d::extra_repr() const {
  std::string s = std::to_string(in_) + ", " + std::to_string(out_) +
                  ", kernel_size=" + pair(kernel_, kernel_) +
                  ", stride=" + pair(p_.stride_h, p_.stride_w);
  if (p_.pad_h != 0) s += ", padding=" + pair(p_.pad_h, p_.pad_w);
  if (p_.dilation_h != 1) s += ", dilation=" + pair(p_.dilation_h, p_.dilation_w);
  if (p_.groups != 1) s += ", groups=" + std::to_string(p_.groups);
  if (!bias_) s += ", bias=False";
  return s;
}

// ---- Linear ----
Linear::Linear(int64_t in, int64_t out, InitStreams& init, bool bias)
    : Module("Linear"), in_(in), out_(out), bias_(bias) {
  MANTISSA_CHECK(
      in > 0 && out > 0,
      "Linear(" + std::to_string(in) + ", " + std::to_string(out) + "): sizes must be positive",
      "");
  register_weight_and_bias(*this, {out, in}, bias, init);
}

Tensor Linear::forward(const Tensor& x) {
  return ops::linear(x, param("weight"), bias_ ? param("bias") : Tensor());
}

std::string Linear::extra_repr() const {
  return "in_features=" + std::to_string(in_) + ", out_features=" + std::to_string(out_) +
         ", bias=" + (bias_ ? "True" : "False");
}

// ---- Normalization ----
BatchNorm2d::BatchNorm2d(int64_t channels, double eps, double momentum)
    : Module("BatchNorm2d"), channels_(channels), eps_(eps), momentum_(momentum) {
  MANTISSA_CHECK(channels > 0, "BatchNorm2d needs a positive channel count", "");
  const TensorOptions o = charged_to(MemoryCategory::parameters);
  register_parameter("weight", Tensor::full({channels}, 1.0, DType::f32, o));
  register_parameter("bias", Tensor::zeros({channels}, DType::f32, o));
  register_buffer("running_mean", Tensor::zeros({channels}, DType::f32, o));
  register_buffer("running_var", Tensor::full({channels}, 1.0, DType::f32, o));
  register_buffer("num_batches_tracked", Tensor::zeros({}, DType::i64, o));
}

Tensor BatchNorm2d::forward(const Tensor& x) {
  MANTISSA_CHECK(x.dim() == 4 && x.size(1) == channels_,
                 "BatchNorm2d(" + std::to_string(channels_) + ") got input " + shape_str(x.shape()),
                 "the input must be (N, " + std::to_string(channels_) + ", H, W)");
  // A recomputed forward (Module::set_recompute) normalizes with the batch's statistics again
  // but does not update the running ones a second time.
  const bool update = is_training() && !recomputing();
  if (update) {
    Tensor& n = buffer("num_batches_tracked");
    n.data<int64_t>()[0] += 1;
  }
  const bool use_running = update || !is_training();
  const Tensor rm = use_running ? buffer("running_mean") : Tensor();
  const Tensor rv = use_running ? buffer("running_var") : Tensor();
  if (sync_ && is_training())
    return ops::sync_batch_norm(x, param("weight"), param("bias"), rm, rv, true, sync_, momentum_,
                                eps_);
  return ops::batch_norm(x, param("weight"), param("bias"), rm, rv, is_training(), momentum_, eps_);
}

std::string BatchNorm2d::extra_repr() const {
  return std::to_string(channels_) + ", eps=" + num(eps_) + ", momentum=" + num(momentum_) +
         ", affine=True, track_running_stats=True";
}

GroupNorm::GroupNorm(int64_t groups, int64_t channels, double eps, bool affine)
    : Module("GroupNorm"), groups_(groups), channels_(channels), eps_(eps), affine_(affine) {
  MANTISSA_CHECK(groups > 0 && channels > 0 && channels % groups == 0,
                 "GroupNorm(" + std::to_string(groups) + ", " + std::to_string(channels) +
                     "): the channels must divide into the groups",
                 "");
  if (affine) {
    const TensorOptions o = charged_to(MemoryCategory::parameters);
    register_parameter("weight", Tensor::full({channels}, 1.0, DType::f32, o));
    register_parameter("bias", Tensor::zeros({channels}, DType::f32, o));
  }
}

Tensor GroupNorm::forward(const Tensor& x) {
  MANTISSA_CHECK(x.dim() >= 2 && x.size(1) == channels_,
                 "GroupNorm(" + std::to_string(groups_) + ", " + std::to_string(channels_) +
                     ") got input " + shape_str(x.shape()),
                 "the input must be (N, " + std::to_string(channels_) + ", ...)");
  return ops::group_norm(x, groups_, affine_ ? param("weight") : Tensor(),
                         affine_ ? param("bias") : Tensor(), eps_);
}

std::string GroupNorm::extra_repr() const {
  return std::to_string(groups_) + ", " + std::to_string(channels_) + ", eps=" + num(eps_) +
         ", affine=" + (affine_ ? "True" : "False");
}

LayerNorm::LayerNorm(Shape normalized_shape, double eps, bool affine)
    : Module("LayerNorm"), shape_(std::move(normalized_shape)), eps_(eps), affine_(affine) {
  MANTISSA_CHECK(!shape_.empty(), "LayerNorm needs a normalized shape", "");
  if (affine) {
    const TensorOptions o = charged_to(MemoryCategory::parameters);
    register_parameter("weight", Tensor::full(shape_, 1.0, DType::f32, o));
    register_parameter("bias", Tensor::zeros(shape_, DType::f32, o));
  }
}

Tensor LayerNorm::forward(const Tensor& x) {
  const int64_t k = static_cast<int64_t>(shape_.size());
  bool ok = x.dim() >= k;
  for (int64_t i = 0; ok && i < k; ++i)
    ok = x.size(x.dim() - k + i) == shape_[static_cast<size_t>(i)];
  MANTISSA_CHECK(ok, "LayerNorm" + shape_str(shape_) + " got input " + shape_str(x.shape()),
                 "the input's last dimensions must be " + shape_str(shape_));
  return ops::layer_norm(x, k, affine_ ? param("weight") : Tensor(),
                         affine_ ? param("bias") : Tensor(), eps_);
}

std::string LayerNorm::extra_repr() const {
  std::string s = "(";
  for (size_t i = 0; i < shape_.size(); ++i) s += std::to_string(shape_[i]) + ",";
  if (shape_.size() > 1) s.pop_back();
  return s + "), eps=" + num(eps_) + ", elementwise_affine=" + (affine_ ? "True" : "False");
}

// ---- Pooling ----
namespace {
ops::Pool2dParams pool_params(const char* what, int64_t kernel, int64_t stride, int64_t padding) {
  MANTISSA_CHECK(kernel > 0 && stride >= 0 && padding >= 0 && padding * 2 <= kernel,
                 std::string(what) + "(kernel " + std::to_string(kernel) + ", stride " +
                     std::to_string(stride) + ", padding " + std::to_string(padding) +
                     "): invalid sizes",
                 "the kernel must be positive and the padding at most half the kernel");
  ops::Pool2dParams p;
  p.kernel_h = p.kernel_w = kernel;
  p.stride_h = p.stride_w = stride == 0 ? kernel : stride;
  p.pad_h = p.pad_w = padding;
  return p;
}
}  // namespace

MaxPool2d::MaxPool2d(int64_t kernel, int64_t stride, int64_t padding)
    : Module("MaxPool2d"), p_(pool_params("MaxPool2d", kernel, stride, padding)) {}
Tensor MaxPool2d::forward(const Tensor& x) { return ops::max_pool2d(x, p_); }
std::string MaxPool2d::extra_repr() const {
  return "kernel_size=" + std::to_string(p_.kernel_h) + ", stride=" + std::to_string(p_.stride_h) +
         ", padding=" + std::to_string(p_.pad_h) + ", dilation=1, ceil_mode=False";
}

AvgPool2d::AvgPool2d(int64_t kernel, int64_t stride, int64_t padding)
    : Module("AvgPool2d"), p_(pool_params("AvgPool2d", kernel, stride, padding)) {}
Tensor AvgPool2d::forward(const Tensor& x) { return ops::avg_pool2d(x, p_); }
std::string AvgPool2d::extra_repr() const {
  return "kernel_size=" + std::to_string(p_.kernel_h) + ", stride=" + std::to_string(p_.stride_h) +
         ", padding=" + std::to_string(p_.pad_h);
}

AdaptiveAvgPool2d::AdaptiveAvgPool2d(int64_t out_h, int64_t out_w)
    : Module("AdaptiveAvgPool2d"), out_h_(out_h), out_w_(out_w) {
  MANTISSA_CHECK(out_h > 0 && out_w > 0, "AdaptiveAvgPool2d needs a positive output size", "");
}
Tensor AdaptiveAvgPool2d::forward(const Tensor& x) {
  return ops::adaptive_avg_pool2d(x, out_h_, out_w_);
}
std::string AdaptiveAvgPool2d::extra_repr() const { return "output_size=" + pair(out_h_, out_w_); }

// ---- Dropout, Flatten, LogSoftmax, Sequential ----
Dropout::Dropout(InitStreams& init, double p) : Module("Dropout"), p_(p), salt_(init.next()) {
  MANTISSA_CHECK(p >= 0 && p < 1, "Dropout probability " + num(p) + " is outside [0, 1)", "");
}

Tensor Dropout::forward(const Tensor& x) {
  if (!is_training() || p_ == 0) return x;
  const RandomContext c = random_context();
  if (c.step != last_step_) {
    last_step_ = c.step;
    calls_ = 0;
  }
  // One stream per (layer, step, call within the step): masks never repeat.
  const uint64_t stream = (salt_ << 48) ^ (c.step << 8) ^ calls_++;
  return ops::dropout(x, p_, true, c.seed, stream);
}

std::vector<uint64_t> Dropout::random_state() const { return {last_step_, calls_}; }
void Dropout::set_random_state(const std::vector<uint64_t>& s) {
  if (s.size() == 2) last_step_ = s[0], calls_ = s[1];
}

std::string Dropout::extra_repr() const { return "p=" + num(p_) + ", inplace=False"; }

std::string Flatten::extra_repr() const {
  return "start_dim=" + std::to_string(start_) + ", end_dim=" + std::to_string(end_);
}

std::string LogSoftmax::extra_repr() const { return "dim=" + std::to_string(dim_); }

Sequential& Sequential::add(std::shared_ptr<Module> m) {
  register_module(std::to_string(children().size()), std::move(m));
  return *this;
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor y = x;
  for (auto& [name, m] : children()) y = (*m)(y);
  return y;
}

}  // namespace mantissa::nn

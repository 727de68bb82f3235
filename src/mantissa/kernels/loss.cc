// Classification losses (loss.h): negative log-likelihood and cross entropy with label smoothing.
#include "mantissa/kernels/loss.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "mantissa/kernels/elementwise.h"
#include "mantissa/kernels/nn_internal.h"

namespace mantissa::kernels {
namespace {

// Integer class targets as int64, validated against C.
std::vector<int64_t> read_targets(const Tensor& target, int64_t n, int64_t classes,
                                  int64_t ignore_index, const char* op) {
  MANTISSA_CHECK(target.dim() == 1 && target.size(0) == n,
                 std::string(op) + ": target shape " + shape_str(target.shape()) +
                     " does not match " + str(n) + " rows",
                 "pass one class index per row");
  MANTISSA_CHECK(!is_floating(target.dtype()),
                 std::string(op) + ": targets must be integers (got " +
                     std::string(dtype_name(target.dtype())) + ")",
                 "convert the labels to i64");
  std::vector<int64_t> t(static_cast<size_t>(n));
  Tensor c = target.contiguous();
  convert(c.data_ptr(), c.dtype(), t.data(), DType::i64, t.size());
  for (int64_t i = 0; i < n; ++i)
    MANTISSA_CHECK(t[i] == ignore_index || (t[i] >= 0 && t[i] < classes),
                   std::string(op) + ": target " + str(t[i]) + " at row " + str(i) +
                       " is outside [0, " + str(classes) + ")",
                   "class indices must be in [0, classes)");
  return t;
}

void check_logits(const Tensor& t, const char* op) {
  require_float(t, op, "input");
  MANTISSA_CHECK(t.dim() == 2,
                 std::string(op) + ": input must be (N, C), got " + shape_str(t.shape()),
                 "flatten the input to (batch, classes)");
}
// The loss's gradient per counted row: grad_loss over the rows whose target is not ignored.
float row_gradient(const Tensor& grad_loss, const std::vector<int64_t>& t, int64_t ignore_index) {
  int64_t count = 0;
  for (int64_t v : t) count += v != ignore_index;
  return static_cast<float>(grad_loss.item()) / static_cast<float>(std::max<int64_t>(count, 1));
}

Tensor scalar_f32(float v, MemoryCategory cat) {
  Tensor t = Tensor::empty({}, DType::f32, charged_to(cat));
  *t.data<float>() = v;
  return t;
}
}  // namespace

Tensor nll_loss(const Tensor& log_probs, const Tensor& target, int64_t ignore_index) {
  check_logits(log_probs, "nll_loss");
  const int64_t N = log_probs.size(0), C = log_probs.size(1);
  const std::vector<int64_t> t = read_targets(target, N, C, ignore_index, "nll_loss");
  const std::vector<float> lp = load_all(log_probs);
  double total = 0;
  int64_t count = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (t[i] == ignore_index) continue;
    total -= lp[static_cast<size_t>(i * C + t[i])];
    ++count;
  }
  return scalar_f32(count ? static_cast<float>(total / count) : NAN, MemoryCategory::activations);
}

Tensor nll_loss_backward(const Tensor& grad_loss, const Tensor& log_probs, const Tensor& target,
                         int64_t ignore_index, DType out) {
  const int64_t N = log_probs.size(0), C = log_probs.size(1);
  const std::vector<int64_t> t = read_targets(target, N, C, ignore_index, "nll_loss");
  const float g = row_gradient(grad_loss, t, ignore_index);
  std::vector<float> d(static_cast<size_t>(N * C), 0.0f);
  for (int64_t i = 0; i < N; ++i)
    if (t[i] != ignore_index) d[static_cast<size_t>(i * C + t[i])] = -g;
  return from_vector(d, log_probs.shape(), out, MemoryCategory::gradients);
}

Tensor cross_entropy(const Tensor& logits, const Tensor& target, double label_smoothing,
                     int64_t ignore_index) {
  check_logits(logits, "cross_entropy");
  MANTISSA_CHECK(
      label_smoothing >= 0.0 && label_smoothing <= 1.0,
      "cross_entropy: label smoothing " + std::to_string(label_smoothing) + " is outside [0, 1]",
      "use a value in [0, 1]");
  const int64_t N = logits.size(0), C = logits.size(1);
  const std::vector<int64_t> t = read_targets(target, N, C, ignore_index, "cross_entropy");
  const Tensor lp_t = softmax(logits, 1, true, DType::f32, MemoryCategory::workspace);
  const float* lp = lp_t.data<float>();
  double total = 0;
  int64_t count = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (t[i] == ignore_index) continue;
    double all = 0;
    for (int64_t c = 0; c < C; ++c) all += lp[i * C + c];
    total += -(1.0 - label_smoothing) * lp[i * C + t[i]] -
             label_smoothing / static_cast<double>(C) * all;
    ++count;
  }
  return scalar_f32(count ? static_cast<float>(total / count) : NAN, MemoryCategory::activations);
}

Tensor cross_entropy_backward(const Tensor& grad_loss, const Tensor& logits, const Tensor& target,
                              double label_smoothing, int64_t ignore_index, DType out) {
  const int64_t N = logits.size(0), C = logits.size(1);
  const std::vector<int64_t> t = read_targets(target, N, C, ignore_index, "cross_entropy");
  const float g = row_gradient(grad_loss, t, ignore_index);
  const Tensor p_t = softmax(logits, 1, false, DType::f32, MemoryCategory::workspace);
  const float* p = p_t.data<float>();
  std::vector<float> d(static_cast<size_t>(N * C), 0.0f);
  const float smooth = static_cast<float>(label_smoothing / static_cast<double>(C));
  for (int64_t i = 0; i < N; ++i) {
    if (t[i] == ignore_index) continue;
    for (int64_t c = 0; c < C; ++c) {
      const float q = (c == t[i] ? static_cast<float>(1.0 - label_smoothing) : 0.0f) + smooth;
      d[static_cast<size_t>(i * C + c)] = g * (p[i * C + c] - q);
    }
  }
  return from_vector(d, logits.shape(), out, MemoryCategory::gradients);
}

}  // namespace mantissa::kernels

// The numerics report: where the values of a model's activations and gradients lie against the
// 16-bit formats' ranges (the gradient histogram of Micikevicius et al., "Mixed Precision
// Training", 2018). While a NumericsScope is alive, every leaf module's output is binned by its
// binary exponent (log2 buckets), and so is the gradient that reaches it in the backward pass;
// the trainer adds the parameters' gradients. From the histograms: the fraction of values that
// would overflow, flush to zero, or become subnormal in FP16 and in BF16, and the largest loss
// scale (a power of two) that keeps every gradient finite in FP16.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "mantissa/core/tensor.h"

namespace mantissa::nn {

class Module;

// Values binned by floor(log2 |x|), with zeros and non-finite values apart.
struct Log2Histogram {
  static constexpr int kMinExp = -160, kMaxExp = 128;  // every float's exponent, subnormals too
  std::array<int64_t, kMaxExp - kMinExp + 1> bins{};   // bins[e - kMinExp]: 2^e <= |x| < 2^(e+1)
  int64_t zeros = 0, nonfinite = 0, count = 0;
  int64_t fp16_overflow = 0;  // exactly: |x| >= 65520, which rounds to inf in FP16
  double max_abs = 0;

  // Adds the values of t, multiplied by `scale` first (1/S unscales loss-scaled gradients).
  void add(const Tensor& t, double scale = 1.0);
  void merge(const Log2Histogram& o);
  // Fraction of the values (of all counted) with |x| >= 2^e ... below 2^e.
  double fraction_at_least(int e) const;
  double fraction_below(int e) const;  // non-zero finite values below 2^e
  int64_t nonzero() const { return count - zeros - nonfinite; }
};

// Where one format's range ends, as binary exponents: |x| >= 2^overflow_exp overflows, |x| <
// 2^zero_exp rounds to zero (half the smallest subnormal, within one bin), |x| < 2^normal_exp is
// subnormal. FP16's overflow is counted exactly instead (Log2Histogram::fp16_overflow).
struct FormatRange {
  const char* name;
  int overflow_exp, zero_exp, normal_exp;
};
inline constexpr FormatRange kFp16Range{"fp16", 16, -25, -14};
inline constexpr FormatRange kBf16Range{"bf16", 128, -134, -126};

struct RangeFractions {
  double overflow = 0, underflow = 0, subnormal = 0;  // of all counted values
};
RangeFractions range_fractions(const Log2Histogram& h, const FormatRange& f);

struct NumericsEntry {
  std::string layer;  // module path, or parameter name for weight gradients
  std::string kind;   // "activation", "activation_gradient", "weight_gradient"
  std::string dtype;  // of the values as stored
  Log2Histogram histogram;
};

// One FP8-scaled tensor at a recorded step (the FP8 modes, amp/fp8.h): its amax, the scale it was
// quantized with and the one the next step uses, and the fractions of its values that saturated
// or flushed to zero.
struct Fp8Sample {
  int64_t step = 0;
  float amax = 0, scale = 1, next_scale = 1;
  double saturated = 0, flushed = 0;
};
struct Fp8Series {
  std::string tensor;  // "conv2.input"
  DType format = DType::e4m3;
  std::vector<Fp8Sample> samples;
};

class NumericsRecorder {
 public:
  void record(const std::string& layer, const std::string& kind, const Tensor& t,
              double scale = 1.0);
  // Every parameter's gradient, unscaled by 1/loss_scale.
  void record_parameter_gradients(Module& model, double loss_scale);
  void count_step() { ++steps_; }
  // A recorded step of an FP8 tensor; the report charts each tensor's amax against the largest
  // value its scale lets through (format max / scale).
  void record_fp8(const std::string& tensor, DType format, const Fp8Sample& s);
  const std::map<std::string, Fp8Series>& fp8() const { return fp8_; }
  int64_t steps() const { return steps_; }
  const std::map<std::pair<std::string, std::string>, NumericsEntry>& entries() const {
    return entries_;
  }
  // All entries of one kind merged.
  Log2Histogram merged(const std::string& kind) const;
  // The largest power of two S with S * max|gradient| below FP16's largest finite value (the
  // activation and weight gradients seen), and the fraction of non-zero gradients that would
  // still flush to zero at S.
  struct ScaleAdvice {
    double scale = 1;
    double underflow_unscaled = 0, underflow_at_scale = 0;
  };
  ScaleAdvice suggested_loss_scale() const;

  std::string json() const;
  std::string html(const std::string& title) const;
  std::string fp8_html() const;  // the FP8 section of the page ("" without FP8 tensors)
  double gradient_scale() const { return gradient_scale_; }

 private:
  std::map<std::pair<std::string, std::string>, NumericsEntry> entries_;
  std::map<std::string, Fp8Series> fp8_;
  int64_t steps_ = 0;
  // Loss-scaled gradients are recorded unscaled: the scale of the step being recorded.
  friend class NumericsScope;
  double gradient_scale_ = 1.0;
};

// While alive, leaf modules record their outputs and, in the backward pass, their outputs'
// gradients (multiplied by gradient_scale: 1/S under loss scaling) into `r`.
class NumericsScope {
 public:
  NumericsScope(NumericsRecorder& r, double gradient_scale);
  ~NumericsScope();
  NumericsScope(const NumericsScope&) = delete;
  NumericsScope& operator=(const NumericsScope&) = delete;

 private:
  NumericsRecorder* previous_;
};
NumericsRecorder* numerics_recorder();

}  // namespace mantissa::nn

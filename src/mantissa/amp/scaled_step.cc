#include "mantissa/amp/scaled_step.h"

#include "mantissa/ops/ops.h"

namespace mantissa::amp {

ScaledStep::ScaledStep(LossScaler* scaler)
    : scaler_(scaler), scale_(scaler ? static_cast<float>(scaler->scale()) : 1.0f) {}

Tensor ScaledStep::scale_loss(const Tensor& loss, double weight) const {
  const double s = static_cast<double>(scale_) * weight;
  return s != 1.0 ? ops::mul_scalar(loss, s) : loss;
}

float ScaledStep::inverse_scale(double divisor) const {
  return static_cast<float>(1.0 / (static_cast<double>(scale_) * divisor));
}

optim::StepReport ScaledStep::step(optim::Optimizer& optimizer, optim::StepOptions options,
                                   double divisor) {
  options.grad_scale = inverse_scale(divisor);
  options.skip_nonfinite = scaler_ != nullptr;
  const optim::StepReport report = optimizer.step(options);
  if (scaler_) scaler_->update(!report.nonfinite.empty(), report.nonfinite);
  return report;
}

}  // namespace mantissa::amp

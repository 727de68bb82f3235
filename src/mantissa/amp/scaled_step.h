// The loss-scaling protocol of one optimizer step, written once (the trainer and the tests use
// it; LossScaler is the state machine it drives):
//
//   amp::ScaledStep scaled(scaler);                       // reads S once for the whole step
//   autograd::backward(scaled.scale_loss(loss));          // backward of S * loss, in FP32
//   optim::StepReport r = scaled.step(optimizer, {.max_grad_norm = 1.0});
//
// step() runs the optimizer's step (optim.h): a read-only pass over every gradient for inf/NaN
// (and the global norm when clipping), both of the unscaled values; then, unless a gradient is
// inf/NaN (the whole step is skipped), one update pass that multiplies each gradient by 1/S
// (once, before clipping), clips, updates and rounds. Then, apart from the optimizer, it tells
// the scaler whether the step overflowed (it backs off, or grows after enough clean steps; at its
// floor it throws naming the parameters). Without a scaler, S = 1, the loss is used as it is, no
// step is skipped, and the read-only pass runs only for clipping.
#pragma once

#include "mantissa/amp/loss_scaler.h"
#include "mantissa/core/tensor.h"
#include "mantissa/optim/optim.h"

namespace mantissa::amp {

class ScaledStep {
 public:
  // `scaler` (may be null: no loss scaling) must outlive the step.
  explicit ScaledStep(LossScaler* scaler);

  // This step's S (1 without scaling), rounded to FP32 as the arithmetic below uses it. Read once,
  // so every micro-batch of a step with gradient accumulation is scaled alike.
  float scale() const { return scale_; }
  // What the backward pass starts from: S * weight * loss, the product in FP32; the loss itself
  // when that factor is 1. `weight` is a micro-batch's share of the accumulated gradient (1 when
  // gradients are summed).
  Tensor scale_loss(const Tensor& loss, double weight = 1) const;
  // What the optimizer multiplies the gradients by: FP32(1 / (S * divisor)), `divisor` the
  // number of micro-batches when the step averages their summed gradients (else 1).
  float inverse_scale(double divisor = 1) const;
  // The optimizer's step with `options` (clipping) and the gradients multiplied by
  // inverse_scale(divisor), skipped when a gradient is not finite under scaling; then the
  // scaler's update with the step's report.
  optim::StepReport step(optim::Optimizer& optimizer, optim::StepOptions options,
                         double divisor = 1);

 private:
  LossScaler* scaler_;
  float scale_;
};

}  // namespace mantissa::amp

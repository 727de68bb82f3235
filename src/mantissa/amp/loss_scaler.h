// Loss scaling: the loss is multiplied by a scale S before backward so that small FP16 gradients
// do not flush to zero; the optimizer checks the gradients for inf/NaN in a read-only pass, skips
// the step when one is not finite, and otherwise multiplies them by 1/S in its update pass (once
// per step). This class is the scale's state machine, updated after the step (amp::ScaledStep).
//
// Static: S is fixed. Dynamic: PyTorch GradScaler's rule (S0 = 2^16, x2 after 2000 clean steps in
// a row, x0.5 on an overflow), plus optional clamps (MindSpore and DeepSpeed stop at 1, Apex
// caps at 2^24) and DeepSpeed's hysteresis (tolerate H-1 overflows before backing off, refilled
// when the scale grows). At the minimum scale, an overflow is an error that names the parameters
// whose gradients were not finite: a run does not go on skipping every step.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace mantissa::amp {

struct LossScalerOptions {
  bool dynamic = true;
  double init_scale = 65536.0;  // 2^16; the static scale when !dynamic
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  // Clamps of a dynamic scale. Without a minimum, the scale may fall to 2^-24 (below it no FP16
  // gradient survives scaling); an overflow there is the error described above.
  std::optional<double> min_scale;
  std::optional<double> max_scale;
  int64_t hysteresis = 1;  // 1: back off on every overflow (PyTorch, Apex)
};

// One scale change, for the metrics' history.
struct ScaleChange {
  int64_t step = 0;  // the optimizer step (1-based) after which the scale changed
  double scale = 0;  // the new scale
  bool overflow = false;
};

class LossScaler {
 public:
  explicit LossScaler(const LossScalerOptions& o = {});
  const LossScalerOptions& options() const { return o_; }

  double scale() const { return scale_; }
  // What the optimizer multiplies gradients by: FP32(1 / double(S)), as GradScaler does.
  float inverse_scale() const;
  // The scale's floor (the minimum, or 2^-24 without one).
  double floor() const;

  // Called once per optimizer step with whether a gradient was inf/NaN; returns true when the
  // step must be skipped. `offenders` (names of the parameters with non-finite gradients) goes
  // into the error raised when an overflow happens at the floor.
  bool update(bool found_inf, const std::vector<std::string>& offenders = {});

  int64_t steps() const { return steps_; }
  int64_t skipped_steps() const { return skipped_; }
  int64_t clean_steps_in_a_row() const { return growth_tracker_; }
  int64_t hysteresis_left() const { return hysteresis_left_; }
  const std::vector<ScaleChange>& history() const { return history_; }

  // The state as JSON text (scale, counters, options, history) for checkpoints, and back.
  // load_json checks every field and names the file (`source`) in its errors.
  std::string to_json() const;
  void load_json(const std::string& text, const std::string& source);

 private:
  LossScalerOptions o_;
  double scale_;
  int64_t growth_tracker_ = 0;
  int64_t hysteresis_left_;
  int64_t steps_ = 0;
  int64_t skipped_ = 0;
  std::vector<ScaleChange> history_;
};

// Parses --loss-scaling: "none" -> nullopt, "dynamic", or a positive number (static).
std::optional<LossScalerOptions> parse_loss_scaling(const std::string& text);

// Refuses a loss scale (static, initial, or a clamp) that is not a positive FP32 normal number,
// 2^-126 (1.2e-38) to FP32's largest (3.4e38): the scale and its inverse must both be finite and
// nonzero in FP32. `what` names it in the error ("--loss-scaling 1e-50").
void check_loss_scale(double v, const std::string& what);

}  // namespace mantissa::amp

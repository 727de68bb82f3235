// What the trainer shows and writes: the progress bar (on the progress stream), the line of each
// epoch, the test accuracy, the summary of the run, the profile table, the metrics JSON and the
// numerics report files. The texts are `mantissa train`'s output.
#pragma once

#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <string>

#include "mantissa/amp/loss_scaler.h"
#include "mantissa/nn/numerics.h"
#include "mantissa/train/config.h"
#include "mantissa/train/result.h"

namespace mantissa::train {

// A tqdm-like bar: epoch, percent, calls done, elapsed and remaining time, rate, loss, accuracy
// and, under loss scaling, the scale and skipped steps. Redrawn in place at most 10 times a
// second on a terminal; elsewhere (a log file) a line every 10 seconds and at the end.
class ProgressBar {
 public:
  ProgressBar(std::ostream* os, bool enabled);
  void update(int64_t epoch, int64_t epochs, int64_t done, int64_t total, double elapsed,
              double images, double loss, double acc, bool final,
              const amp::LossScaler* scaler = nullptr);

 private:
  std::ostream* os_;
  bool enabled_, tty_ = false;
  std::chrono::steady_clock::time_point last_{};
};

// An epoch's running figures from what its calls returned: the mean loss and accuracy over the
// returned steps, and the images trained on.
class EpochTally {
 public:
  void add(const CallOutput& co);
  double loss() const;
  double accuracy() const;
  int64_t images() const { return images_; }

 private:
  double loss_sum_ = 0;
  int64_t loss_steps_ = 0, correct_ = 0, counted_ = 0, images_ = 0;
};

// "epoch 1: loss 0.4391, train accuracy 84.12%, 35.2 s, 1702.3 images/s"
std::string epoch_line(const EpochStats& e);
// "test accuracy: 86.95% (10000 images)"
std::string test_line(double accuracy, int64_t examples);
// "interrupted at step 120, checkpoint saved to FILE (continue with --resume FILE)"; `save` may
// be empty (nothing saved).
std::string interrupted_line(int64_t step, const std::string& save);
// "training: ... images/s (... GFLOP/s ...), waited ... s for data (... a batch), host ... us a
// step, peak memory ...[, loss scale S, N steps skipped]"
// With several ranks a second line follows: communication_line().
std::string summary_line(const TrainResult& r, int64_t batch_bytes);
// "communication: 2 ranks, 1.2 MiB a step (gradients as fp32), collectives running 3.1 ms a
// step, the step waiting for them 0.4 ms"
std::string communication_line(const Communication& c);

// The profile as a table: milliseconds a step by phase, module and op, the part of each phase
// outside its rows ("(rest)"), and the share of the training loop's time.
std::string profile_table(const TrainResult& r);

// The metrics file's JSON text: the configuration as resolved, every step's loss and time, the
// epochs, the test accuracy, speed, memory peaks, the profile rows and the loss scale's history.
std::string metrics_json(const TrainConfig& c, const RunSettings& s, const TrainResult& r);

// Writes the numerics report: its JSON to `path` and the HTML page beside it (the same name with
// .html for .json, or .html appended), titled `title`. Returns the line that names both files.
std::string write_numerics_report(const std::string& path, const nn::NumericsRecorder& numerics,
                                  const std::string& title);

}  // namespace mantissa::train

// What training returns: the figures of a run (TrainResult, one EpochStats per epoch) and of one
// call of the training step (CallOutput).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mantissa/amp/fp8.h"
#include "mantissa/amp/loss_scaler.h"
#include "mantissa/core/memory.h"
#include "mantissa/core/profiler.h"

namespace mantissa::train {

// What one call of the training step returns (TrainConfig::output_mode): one entry per returned
// output. "all": every step; "final": the last; "every": every output_return_period-th step;
// "sum": one entry summing every step of the call.
struct StepOutput {
  int64_t step = 0;      // the (last) optimizer step it covers, 1-based
  int64_t steps = 1;     // optimizer steps summed into it
  double loss_sum = 0;   // sum of the covered steps' losses
  int64_t correct = 0;   // correctly classified training images of the covered steps
  int64_t examples = 0;  // images of the covered steps
};

struct EpochStats {
  int64_t epoch = 0;  // 1-based
  double loss = 0;    // mean over the epoch's steps in this run
  double train_accuracy = 0;
  double seconds = 0;
  double images_per_second = 0;
  int64_t steps = 0;
};

// Communication of a data-parallel run (docs/distributed.md), per optimizer step: the payload of
// its collectives (the gradient buckets all-reduced or reduce-scattered, and under ZeRO the
// parameters all-gathered; a ring algorithm sends and receives about 2 (N - 1) / N times an
// all-reduce's payload per rank, (N - 1) / N times a reduce-scatter's or an all-gather's), the
// time some collective was running, and the time the step waited for them (what the backward
// pass did not hide; ZeRO's all-gather, which nothing hides, counts whole).
struct Communication {
  int64_t world_size = 1;
  std::string wire;  // the gradients' type on the wire: fp32, fp16, bf16
  double bytes_per_step = 0;
  double seconds_per_step = 0;
  double exposed_seconds_per_step = 0;
  // Linear weights whose gradients travel as their factors (dist/factors.h), all-gathered.
  std::vector<std::string> factored;
};

struct TrainResult {
  std::vector<float> step_losses;  // every optimizer step since the start of the run (resumes too)
  std::vector<EpochStats> epochs;
  std::optional<double> test_accuracy;
  int64_t test_examples = 0;
  double images_per_second = 0;  // over all training steps of this process
  // Wall-clock seconds of each optimizer step of this run, its data included (with device
  // iterations, a call's time shared evenly by its steps). A steady rate leaves out the first
  // steps, which allocate the optimizer state and warm the caches (bench/train_vs_pytorch.sh
  // times PyTorch after the same warm-up).
  std::vector<double> step_seconds;
  double train_seconds = 0;
  double data_wait_seconds = 0;  // time the loop waited for the loader
  // The model's cost: 6 x the multiply-adds of one image's forward (2 FLOPs each; a backward
  // costs about twice its forward), counted over the first step's forward (MacCounter), and the
  // rate it was trained at. 0 when no step ran.
  double flops_per_image = 0;
  double gflops_per_second = 0;
  int64_t steps = 0;   // global step count at the end
  MemoryStats memory;  // peaks over training
  // Loss scaling, when on: the final scale, steps skipped for inf/NaN gradients (whole run,
  // resumes included) and every change of the scale.
  std::optional<double> loss_scale;
  int64_t skipped_steps = 0;
  std::vector<amp::ScaleChange> loss_scale_history;
  // The optimizer steps (1-based) that were skipped, over the whole run (a resumed run: with
  // those its checkpoint records).
  std::vector<int64_t> skipped;
  // The FP8 modes: every scaled tensor's final scale, last amax and last step's range fractions.
  std::vector<amp::Fp8TensorReport> fp8;
  // The pipeline: calls of the training step, bytes of input handed over, and the host's own
  // time per optimizer step (the loop less the step's compute and the wait for data).
  int64_t calls = 0;
  int64_t input_bytes = 0;
  double host_seconds_per_step = 0;
  // What this run's calls returned (TrainConfig::output_mode): the training accuracy over the run.
  std::vector<StepOutput> outputs;
  bool interrupted = false;  // stopped by request_stop() (Ctrl-C): a clean step boundary
  // Data parallelism: the ranks' peak memory (bytes, by rank; this process's alone when it runs
  // by itself) and the communication (nullopt on one process).
  std::vector<int64_t> rank_peak_memory;
  std::optional<Communication> communication;
  // With TrainConfig::profile: wall-clock rows over this run's training steps (phase "step" holds
  // the inclusive time of data, forward, backward, optimizer and zero_grad; phases "forward",
  // "backward", "recompute" and "optimizer" the layers, autograd nodes and parameters inside them;
  // "in-backward" the updates made in the backward pass, inside its rows).
  std::vector<ProfileRow> profile;
  int64_t profiled_steps = 0;
};

// What one call returns: its outputs, the steps it ran, the images it consumed.
struct CallOutput {
  std::vector<StepOutput> outputs;
  int64_t steps = 0;   // optimizer steps the call ran
  int64_t images = 0;  // training images it consumed
};

}  // namespace mantissa::train

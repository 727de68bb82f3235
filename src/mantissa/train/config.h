// A training run's configuration: TrainConfig is what the user sets (the `mantissa train` flags,
// names as strings), resolve() checks it once and turns it into typed values (RunSettings) that
// the trainer reads; nothing after resolve() parses a string again.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mantissa/amp/settings.h"
#include "mantissa/nn/models.h"
#include "mantissa/optim/optim.h"

namespace mantissa::train {

// The precision fields (precision, half_type, keep_fp32, half_modules, the autocast op-list files,
// loss_scaling and the loss_scale_* options, stochastic_rounding, stochastic_outputs, kahan,
// partials, accum_type, first_moment_type, second_moment_type) come from amp::PrecisionChoices
// (amp/settings.h; docs/mixed_precision.md).
struct TrainConfig : amp::PrecisionChoices {
  // ---- Model and data: the built-in ones by name. A user's own model and dataset are passed
  // to Trainer's other constructor instead, which refuses these fields when they are set. ----
  std::string model = "tutorial-cnn";
  std::string dataset = "fashion-mnist";
  std::string data_dir;        // empty: the dataset's default
  int64_t image_size = 0;      // 0: the model's default (tutorial-cnn 128, others 32)
  bool imagenet_stem = false;  // ResNets
  int64_t train_limit = 0;     // first N training examples (0: all)
  int64_t test_limit = 0;
  bool augment = false;           // random crop (padding 4) and horizontal flip
  int64_t synthetic_size = 2048;  // training examples of --dataset synthetic (test: a quarter)
  // 8-bit I/O: the loader hands over u8 images; the model's first op normalizes them and casts
  // to the mode's input type (4x fewer bytes than FP32 input, 2x fewer than FP16).
  bool eight_bit_io = false;

  // ---- Training ----
  int64_t batch_size = 12;
  int64_t eval_batch_size = 32;
  int64_t epochs = 1;
  // Total optimizer steps, counted from the start of the run (0: none); the run also ends with
  // its epochs, whichever comes first.
  int64_t max_steps = 0;
  bool shuffle = true;
  std::string optimizer = "adamw";  // sgd | adam | adamw
  double lr = 1e-3;
  std::optional<double> weight_decay;  // default: 0.01 for AdamW, 0 otherwise (PyTorch's)
  double momentum = 0;
  bool nesterov = false;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  bool bias_correction = true;           // Adam and AdamW
  double max_grad_norm = 0;              // 0: no clipping
  std::string lr_schedule = "constant";  // constant | step | cosine
  int64_t warmup_steps = 0;
  int64_t lr_step_size = 1000;
  double lr_gamma = 0.1;
  uint64_t seed = 0;
  // Compute threads of this process. 0: all hardware threads, shared among the ranks of a
  // data-parallel job that run on this host (the host's cores divided by its ranks).
  int threads = 0;
  std::string init_from, save, resume, metrics_json;
  // The training report: a self-contained HTML page of the run (loss, accuracy, loss scale,
  // skipped steps, step time, precision, memory) drawn from the metrics JSON (report_html.h),
  // written with the metrics, also when the run is interrupted.
  std::string report;

  bool autocast_log = false;  // print each automatic-casting decision once

  // The engine behaves as a device with this much memory ("512MiB", "1.5GiB", bytes): going past
  // it throws OutOfMemoryError with the report by category and holder. "": no limit.
  std::string memory_budget;

  // ---- The IPU guide's pipeline levers (docs/ipu_guide.md) ----
  // Micro-batches of batch_size per optimizer step; their gradients are reduced by
  // accumulation_reduction: "mean" (summed, divided by N at the step), "running" (the running
  // mean s = f/(f+1) s + g/(f+1) after each micro-batch: never larger than the largest gradient,
  // so it cannot overflow a 16-bit accumulator), or "sum".
  int64_t gradient_accumulation = 1;
  std::string accumulation_reduction = "mean";
  // Optimizer steps per call of the training step: the call takes device_iterations *
  // gradient_accumulation batches at once and returns outputs as output_mode says: "all",
  // "sum", "final" (PopTorch's default for training), or "every" (every output_return_period-th
  // step). The progress bar and the epoch figures are computed from what the calls return.
  int64_t device_iterations = 1;
  std::string output_mode = "final";
  int64_t output_return_period = 1;
  // Activation recomputation at block boundaries (each ResNet block, or the blocks a model's
  // recompute_blocks() lists): a block keeps only its input in the forward pass and runs again
  // in the backward.
  bool recompute = false;
  bool async_loader = false;  // background workers prepare batches while the step runs
  int workers = 1;            // with async_loader
  int prefetch = 2;           // with async_loader: batches made ahead at most (at least 1)

  // Check every op's output (forward) and every gradient (backward) for inf/NaN and stop at the
  // first, naming the op, module, dtype and input statistics (autograd::AnomalyError). Under loss
  // scaling, infinite gradients are the scaler's business: only NaN stops the backward pass.
  bool detect_anomaly = false;
  // Log2 histograms of every layer's activations and gradients, their FP16/BF16 overflow and
  // underflow fractions, and a suggested loss scale (nn/numerics.h): JSON to this file, HTML
  // beside it (.html). Recorded on step 1 and every numerics_every-th step after.
  std::string numerics_report;
  int64_t numerics_every = 50;

  // Apply the optimizer's update to each parameter as soon as the backward pass has its gradient
  // (optim::Optimizer::begin_backward_step), when a step needs nothing global (no clipping, no
  // loss scaling, no gradient accumulation, no anomaly detection, numerics report or
  // recomputation): the same arithmetic, bit for bit, and the gradients are not kept (lower peak
  // memory). Under loss scaling (otherwise the same conditions) the gradients that a linear
  // layer computes in parts are kept as what computes them instead (optim::Optimizer::
  // defer_gradients): the step's arithmetic and skips are the same, bit for bit, and those
  // gradients are not held whole either. false: always the ordinary step after the backward pass.
  bool update_in_backward = true;

  // Time every layer's forward, every autograd node's backward and every parameter's update, and
  // print the table (profile_table()) after training; TrainResult::profile keeps the rows.
  bool profile = false;

  bool progress = true;  // progress bar on the progress stream
  bool evaluate = true;  // test accuracy after training

  // ---- Data parallelism (docs/distributed.md) ----
  // Used when an MPI launcher (mpirun, srun) starts several processes (ranks): each trains on its
  // slice of every global batch of ranks x batch_size images and the gradients are summed over
  // the ranks before each update. On one process these change nothing.
  double bucket_size_mib = 25;           // gradients travel in buckets of at most this many MiB
  std::string allreduce_dtype = "fp32";  // the gradients' type on the wire: fp32 | fp16 | bf16
  bool sync_batchnorm = false;  // batch-norm statistics over the global batch, not each rank's
  int64_t zero = 0;             // 1: ZeRO stage 1, optimizer state and master weights sharded
  // Linear weights of at least 2^18 values whose gradient's factors (the layer's inputs and output
  // gradients over every rank's batch) are at most half the gradient gather the factors instead
  // of all-reducing the gradient (dist/factors.h); off: every gradient through the reducer.
  bool sufficient_factors = true;
  // After every step, check that every rank holds the same parameters and buffers, bit for bit
  // (a hash per tensor, gathered): a debugging aid that stops naming the first tensor that
  // differs.
  bool check_replicas = false;

  double effective_weight_decay() const {
    return weight_decay ? *weight_decay : (optimizer == "adamw" ? 0.01 : 0.0);
  }
  int64_t effective_image_size() const {
    return image_size > 0 ? image_size : nn::default_image_size(model);
  }
};

enum class OptimizerKind { kSgd, kAdam, kAdamW };
// How the gradients of a step's micro-batches combine (TrainConfig::accumulation_reduction).
enum class Reduction { kMean, kRunning, kSum };
// Which steps of a call return their outputs (TrainConfig::output_mode).
enum class OutputMode { kAll, kSum, kFinal, kEvery };

// A TrainConfig checked and resolved: what its strings name, as types.
struct RunSettings {
  // What the run trains on, for the printout, checkpoints and metrics: a built-in model's name
  // (or a user model's Module::type()) and the dataset's name.
  std::string model, dataset;
  std::optional<int64_t> image_size;  // built-in image datasets: the side images are resized to
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  double weight_decay = 0;
  // The learning rate over the steps; total_steps (cosine) is set by the trainer once the
  // loader knows an epoch's length.
  optim::LrSchedule schedule;
  Reduction reduction = Reduction::kMean;
  OutputMode output_mode = OutputMode::kFinal;
  std::optional<size_t> memory_budget;
  amp::PrecisionSettings precision;
  DType allreduce_dtype = DType::f32;  // TrainConfig::allreduce_dtype
};

// The bounds of what a user may set, the same for every command and for a checkpoint's metadata.
// Counts a run reaches (optimizer steps, batches, the examples of one call, the bytes of the
// synthetic dataset) stay at most kMaxCount: far beyond any run (2^53, which a double still counts
// exactly) and far enough from int64_t's limit that the loop's sums cannot overflow.
inline constexpr int64_t kMaxCount = int64_t{1} << 53;
inline constexpr int kMaxThreads = 1024;         // --threads
inline constexpr int64_t kMaxImageSize = 16384;  // --image-size: the side images are resized to

// Checks every setting and resolves it; throws mantissa::Error naming the first bad setting and
// how to fix it. A setting that acts only together with another is refused, naming both, when it
// differs from its default while the other leaves it without effect: an Adam option under SGD,
// --nesterov without SGD momentum, a state type the optimizer does not keep, the step schedule's
// options under another schedule, --accumulation-reduction without accumulation, --output-mode
// with one step a call, --output-return-period without --output-mode every, the loader's workers
// and prefetch depth without the asynchronous loader (or with a depth of 0), --numerics-every
// without a report, evaluation settings with evaluation off, --autocast-log without automatic
// casting, --imagenet-stem on another model, --synthetic-size and --data-dir on datasets they do
// not describe; and the precision settings amp::resolve_precision() refuses (amp/settings.h).
// `checks_outputs` false leaves the output paths (--save, --metrics-json, --report,
// --numerics-report) unchecked and unlocked: a data-parallel rank other than 0 writes none of
// them, and checking them would take rank 0's locks.
RunSettings resolve(const TrainConfig& c, bool checks_outputs = true);
// The same checks, for a configuration that is not run yet (`mantissa memory`, the CLI).
void validate(const TrainConfig& c);

// The page written beside a numerics report (TrainConfig::numerics_report): its path without a
// ".json" ending, plus ".html".
std::string numerics_page_path(const std::string& report);

// The optimizer steps of the run, --epochs times the steps of an epoch of `batches_per_epoch`
// batches (at least --gradient-accumulation of them); throws naming --epochs when the run would
// count more than kMaxCount batches. --max-steps is not applied.
int64_t total_steps(const TrainConfig& c, int64_t batches_per_epoch);

// For a user's model and dataset: throws naming the first field that only a built-in model or
// dataset uses (model, dataset, data_dir, image_size, imagenet_stem, the limits, augment,
// synthetic_size, eight_bit_io) when it is not at its default, rather than ignore it.
void check_user_model_config(const TrainConfig& c);

}  // namespace mantissa::train

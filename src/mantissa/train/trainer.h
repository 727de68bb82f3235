// Training and evaluation of a classifier end to end: the model by name, the dataset and its
// loader, the optimizer and schedule, the loop with progress and per-epoch figures, test accuracy,
// checkpoints (safetensors with PyTorch parameter names plus optimizer and RNG state, written
// atomically) that resume bit-exactly, and a metrics JSON. The `mantissa train` and `mantissa
// eval` commands are thin wrappers over this.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mantissa/amp/loss_scaler.h"
#include "mantissa/amp/precision.h"
#include "mantissa/core/profiler.h"
#include "mantissa/data/loader.h"
#include "mantissa/nn/models.h"
#include "mantissa/nn/numerics.h"
#include "mantissa/ops/autocast.h"
#include "mantissa/optim/optim.h"

namespace mantissa::train {

struct TrainConfig {
  std::string model = "tutorial-cnn";
  std::string dataset = "fashion-mnist";
  std::string data_dir;        // empty: the dataset's default
  int64_t image_size = 0;      // 0: the model's default (tutorial-cnn 128, others 32)
  bool imagenet_stem = false;  // ResNets
  int64_t batch_size = 12;
  int64_t eval_batch_size = 32;
  int64_t epochs = 1;
  int64_t max_steps = 0;    // total optimizer steps, counted from the start of the run; 0: none
  int64_t train_limit = 0;  // first N training examples (0: all)
  int64_t test_limit = 0;
  bool shuffle = true;
  bool augment = false;           // random crop (padding 4) and horizontal flip
  int64_t synthetic_size = 2048;  // training examples of --dataset synthetic (test: a quarter)
  std::string optimizer = "adamw";
  double lr = 1e-3;
  std::optional<double> weight_decay;  // default: 0.01 for AdamW, 0 otherwise (PyTorch's)
  double momentum = 0;
  bool nesterov = false;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  bool bias_correction = true;  // Adam and AdamW
  double max_grad_norm = 0;     // 0: no clipping
  std::string lr_schedule = "constant";
  int64_t warmup_steps = 0;
  int64_t lr_step_size = 1000;
  double lr_gamma = 0.1;
  uint64_t seed = 0;
  int threads = 0;  // 0: all hardware threads
  std::string init_from, save, resume, metrics_json;
  // ---- Precision (docs/mixed_precision.md) ----
  std::string precision = "32-true";      // a name of amp::precision_names()
  std::string half_type;                  // fp16 | bf16 for the modes whose name does not fix it
  std::vector<std::string> keep_fp32;     // module paths run in FP32
  std::vector<std::string> half_modules;  // module paths run in the mode's 16-bit type
  std::string autocast_lower_list, autocast_fp32_list;  // op-list files replacing the defaults
  bool autocast_log = false;                            // print each cast decision once
  std::string loss_scaling;  // "" (the mode's), none, dynamic, or a static scale
  std::optional<double> loss_scale_min, loss_scale_max, loss_scale_init;
  int64_t loss_scale_growth_interval = 2000;
  int64_t loss_scale_hysteresis = 1;
  bool stochastic_rounding = false;  // optimizer writes of 16-bit parameters and state
  bool stochastic_outputs = false;   // every 16-bit op output (forward)
  std::string partials = "fp32";     // accumulation of matmul and convolution: fp32 | fp16
  std::string accum_type, first_moment_type, second_moment_type;  // "": the mode's default

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
  // 8-bit I/O: the loader hands over u8 images; the model's first op normalizes them and casts
  // to the mode's input type (4x fewer bytes than FP32 input, 2x fewer than FP16).
  bool eight_bit_io = false;
  // Activation recomputation at block boundaries (each ResNet block): a block keeps only its
  // input in the forward pass and runs again in the backward.
  bool recompute = false;
  bool async_loader = false;  // background workers prepare batches while the step runs
  int workers = 1;            // with async_loader
  int prefetch = 2;           // with async_loader: batches made ahead at most

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
  // memory). false: always the ordinary step after the backward pass.
  bool update_in_backward = true;

  // Time every layer's forward, every autograd node's backward and every parameter's update, and
  // print the table (profile_table()) after training; TrainResult::profile keeps the rows.
  bool profile = false;

  bool progress = true;  // progress bar on the progress stream
  bool evaluate = true;  // test accuracy after training

  double effective_weight_decay() const {
    return weight_decay ? *weight_decay : (optimizer == "adamw" ? 0.01 : 0.0);
  }
  int64_t effective_image_size() const {
    return image_size > 0 ? image_size : nn::default_image_size(model);
  }
};

// Throws mantissa::Error naming the first bad setting and how to fix it.
void validate(const TrainConfig& c);

struct EpochStats {
  int64_t epoch = 0;  // 1-based
  double loss = 0;    // mean over the epoch's steps in this run
  double train_accuracy = 0;
  double seconds = 0;
  double images_per_second = 0;
  int64_t steps = 0;
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
  // The pipeline: calls of the training step, bytes of input handed over, and the host's own
  // time per optimizer step (the loop less the step's compute and the wait for data).
  int64_t calls = 0;
  int64_t input_bytes = 0;
  double host_seconds_per_step = 0;
  bool interrupted = false;  // stopped by request_stop() (Ctrl-C): a clean step boundary
  // With TrainConfig::profile: wall-clock rows over this run's training steps (phase "step" holds
  // the inclusive time of data, forward, backward, optimizer and zero_grad; phases "forward",
  // "backward", "recompute" and "optimizer" the layers, autograd nodes and parameters inside them;
  // "in-backward" the updates made in the backward pass, inside its rows).
  std::vector<ProfileRow> profile;
  int64_t profiled_steps = 0;
};

// The profile as a table: milliseconds a step by phase, module and op, the part of each phase
// outside its rows ("(rest)"), and the share of the training loop's time.
std::string profile_table(const TrainResult& r);

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
struct CallOutput {
  std::vector<StepOutput> outputs;
  int64_t steps = 0;   // optimizer steps the call ran
  int64_t images = 0;  // training images it consumed
};

// Asks the running Trainer (or the next one to run) to stop at the next step boundary (async-
// signal-safe: a SIGINT handler may call it). The trainer saves its checkpoint (--save) and
// metrics, then returns with TrainResult::interrupted set; the run that stops clears the request.
void request_stop();
bool stop_requested();

// Where the trainer writes: the result lines (stdout) and the progress bar (stderr).
struct TrainStreams {
  std::ostream* out = nullptr;
  std::ostream* progress = nullptr;
};

class Trainer {
 public:
  explicit Trainer(const TrainConfig& config, TrainStreams streams = {});
  ~Trainer();

  // Trains as configured (resuming and initialising as asked), evaluates, saves, writes metrics.
  TrainResult run();
  // Accuracy of the current model on the test split (first test_limit examples).
  double evaluate(int64_t* examples = nullptr);
  // One call of the training step: device_iterations optimizer steps (fewer at an epoch's end),
  // each on gradient_accumulation micro-batches taken in order from `batches` (whose size must
  // be a multiple of gradient_accumulation). Returns the outputs output_mode asks for.
  CallOutput call(const std::vector<data::Batch>& batches);

  nn::Classifier& model() { return *model_; }
  optim::Optimizer& optimizer() { return *optimizer_; }
  const amp::PrecisionMode& precision() const { return mode_; }
  amp::LossScaler* loss_scaler() { return scaler_ ? &*scaler_ : nullptr; }
  const ops::AutocastPolicy& autocast_policy() const { return policy_; }
  const ops::AutocastLog& autocast_log() const { return *log_; }
  const TrainConfig& config() const { return config_; }
  int64_t step() const { return step_; }

  void save_checkpoint(const std::string& path) const;
  // Restores weights, buffers, optimizer state, step and loss history; checks the model matches.
  void load_checkpoint(const std::string& path);
  // Weights only (PyTorch names; extra optimizer entries are ignored).
  void init_from(const std::string& path);

 private:
  void train_steps(TrainResult& result);
  void apply_precision();
  // Recomputation blocks, 8-bit input normalization, the numerics recorder (after the precision:
  // the normalization casts to the mode's input type).
  void apply_levers();
  // One optimizer step on gradient_accumulation micro-batches: forward and loss in the
  // configured precision, scaled backward (the scale fixed for the step), the reduction of the
  // micro-batch gradients, the fused step. Returns the mean (unscaled) loss, and when asked the
  // number of correctly classified images.
  float train_step(const data::Batch* micro, int64_t* correct);

  TrainConfig config_;
  TrainStreams streams_;
  std::shared_ptr<nn::Classifier> model_;
  std::unique_ptr<optim::Optimizer> optimizer_;
  optim::LrSchedule schedule_;
  data::Dataset train_data_;
  std::unique_ptr<data::Loader> loader_;
  int64_t step_ = 0;
  std::vector<float> step_losses_;
  double compute_seconds_ = 0;         // inside train_step, this run
  double forward_macs_per_image_ = 0;  // counted on this run's first forward
  Profiler profiler_;                  // with config_.profile
  std::unique_ptr<nn::NumericsRecorder> numerics_;
  amp::PrecisionMode mode_;
  ops::AutocastPolicy policy_;
  std::unique_ptr<ops::AutocastLog> log_;
  std::optional<amp::LossScaler> scaler_;
  kernels::Partials partials_ = kernels::Partials::kF32;
  // --memory-budget for the trainer's lifetime: the previous budget comes back when it ends, even
  // when the constructor throws.
  struct BudgetScope {
    bool active = false;
    std::optional<size_t> previous;
    ~BudgetScope() {
      if (active) default_memory_tracker().set_budget(previous);
    }
  } budget_;
};

// The metrics file's JSON text.
std::string metrics_json(const TrainConfig& c, const TrainResult& r);
// Evaluates a checkpoint (the model is rebuilt from its metadata) on a dataset's test split.
struct EvalResult {
  double accuracy = 0;
  int64_t examples = 0;
  double loss = 0;
  std::string model;
};
EvalResult evaluate_checkpoint(const std::string& path, const std::string& dataset,
                               const std::string& data_dir, int64_t test_limit, int64_t batch_size);

}  // namespace mantissa::train

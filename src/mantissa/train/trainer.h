// Training and evaluation of a classifier end to end: a built-in model and dataset by name, or a
// user's own nn::Classifier and data::ExampleSources, through the same loop with every precision
// mode, pipeline lever, report and checkpoint. The `mantissa train` command is a thin wrapper
// over it. The pieces live beside it: config.h (the settings, resolved once), run_data.h (the
// loaders), checkpoint.h, evaluation.h, report.h (progress, printed lines, metrics JSON).
//
//   train::TrainConfig config;                    // the CLI's defaults: tutorial-cnn, AdamW, ...
//   config.precision = "16-mixed";
//   train::Trainer trainer(config, {&std::cout, &std::cerr});
//   train::TrainResult result = trainer.run();    // losses, epochs, test accuracy, memory
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mantissa/amp/loss_scaler.h"
#include "mantissa/amp/settings.h"
#include "mantissa/comm/communicator.h"
#include "mantissa/core/profiler.h"
#include "mantissa/data/loader.h"
#include "mantissa/data/source.h"
#include "mantissa/nn/models.h"
#include "mantissa/nn/numerics.h"
#include "mantissa/ops/autocast.h"
#include "mantissa/optim/optim.h"
#include "mantissa/train/checkpoint.h"
#include "mantissa/train/config.h"
#include "mantissa/train/data_parallel.h"
#include "mantissa/train/evaluation.h"
#include "mantissa/train/report.h"
#include "mantissa/train/result.h"
#include "mantissa/train/run_data.h"

namespace mantissa::train {

// Asks the running Trainer (or the next one to run) to stop at the next step boundary (async-
// signal-safe: a SIGINT handler may call it). The trainer saves its checkpoint (--save) and
// metrics, then returns with TrainResult::interrupted set; the run that stops clears the request.
// In a data-parallel job the ranks agree on the boundary: each step starts a collective that tells
// every rank whether any was asked to stop, and each call of the training step waits for its
// steps' before it returns.
void request_stop();
bool stop_requested();

// Whether a step of `c` may update each parameter as soon as its gradient is complete, the rest
// of the step needing nothing global: updates in the backward pass not turned off, one
// micro-batch, no clipping, anomaly detection or recomputation. The trainer then updates in the
// backward pass, or keeps the gradients linear layers compute in parts as their producers (under
// loss scaling; with several ranks, those formed from gathered factors), except on the steps a
// numerics report records.
bool updates_as_gradients_complete(const TrainConfig& c);

// Where the trainer writes: the result lines (stdout) and the progress bar (stderr).
struct TrainStreams {
  std::ostream* out = nullptr;
  std::ostream* progress = nullptr;
};

// Data parallelism. A trainer runs on the processes of `comm` (default: comm::world(), which is
// every rank of a job started by mpirun or srun, or this process alone), each rank training on its
// slice of every global batch (docs/distributed.md); with one process it is the single-process
// trainer, bit for bit. Only rank 0 writes to the streams and writes files (checkpoints, metrics,
// reports); the figures it shows are the global batch's. The constructor, run(), call(),
// evaluate() and save_checkpoint() are collectives when there are several ranks: every rank calls
// them alike. A rank that fails must end the job (comm::Communicator::abort): the others would
// wait for it.
class Trainer {
 public:
  // The built-in model and dataset that `config` names (TrainConfig::model, dataset).
  explicit Trainer(const TrainConfig& config, TrainStreams streams = {},
                   comm::Communicator* comm = nullptr);
  // A user's model, trained on `train` and evaluated on `test` (null: no evaluation). Everything
  // else in `config` applies as to a built-in model (precision, levers, reports, checkpoints);
  // the fields that only the built-in models and datasets use are refused when set
  // (check_user_model_config). Checkpoints record the model's Module::type().
  Trainer(const TrainConfig& config, std::shared_ptr<nn::Classifier> model,
          std::shared_ptr<const data::ExampleSource> train,
          std::shared_ptr<const data::ExampleSource> test, TrainStreams streams = {},
          comm::Communicator* comm = nullptr);
  ~Trainer();

  // Trains as configured (resuming and initialising as asked), evaluates, saves, writes metrics.
  TrainResult run();
  // Accuracy of the current model on the test split (built-in datasets: the first test_limit
  // examples); 0 with no examples when there is no test set.
  double evaluate(int64_t* examples = nullptr);
  // One call of the training step: device_iterations optimizer steps (fewer at an epoch's end),
  // each on gradient_accumulation micro-batches taken in order from `batches` (whose size must
  // be a multiple of gradient_accumulation). Returns the outputs output_mode asks for: with
  // several ranks, those of the global batch (every rank's images and losses).
  CallOutput call(const std::vector<data::Batch>& batches);

  // The model and the optimizer, their parameters up to date (a ZeRO gather still running after
  // the last step is waited for: DataParallel::finish_parameters).
  nn::Classifier& model();
  optim::Optimizer& optimizer();
  // The named precision mode, and every precision setting as applied.
  const amp::PrecisionMode& precision() const { return run_.precision.mode; }
  const amp::PrecisionSettings& precision_settings() const { return run_.precision; }
  amp::LossScaler* loss_scaler() { return scaler_ ? &*scaler_ : nullptr; }
  // The FP8 modes' scaling state (null in the other modes).
  amp::Fp8State* fp8_state() { return fp8_.get(); }
  const ops::AutocastPolicy& autocast_policy() const { return run_.precision.policy; }
  const ops::AutocastLog& autocast_log() const { return *log_; }
  const TrainConfig& config() const { return config_; }
  const RunSettings& settings() const { return run_; }
  int64_t step() const { return step_; }
  // The job's processes: this rank and their number (1 alone).
  int rank() const { return comm_->rank(); }
  int world_size() const { return comm_->size(); }

  void save_checkpoint(const std::string& path) const;
  // Restores weights, buffers, optimizer state, step and loss history; checks the model matches.
  void load_checkpoint(const std::string& path);
  // Weights only (PyTorch names; extra optimizer entries are ignored).
  void init_from(const std::string& path);
  // Records every later step's activations and gradients (as numerics_report with numerics_every
  // 1) and returns the recorder; run() writes report files only when numerics_report names one.
  // The precision advisor's calibration reads it (advise.h).
  nn::NumericsRecorder& record_numerics();

 private:
  // What both constructors share once the model and data are there: the optimizer, the
  // precision, the levers, the loader and schedule, and the checkpoint to resume.
  void set_up();
  // Recomputation blocks, 8-bit input normalization, the numerics recorder (after the precision:
  // the normalization casts to the mode's input type).
  void apply_levers();
  CheckpointRun checkpoint_run() const;
  // The epochs: calls of the training step on the loader's batches, the progress bar and the
  // per-epoch figures, a checkpoint at each epoch's end.
  void train_epochs(TrainResult& result);
  // A step's figures under data parallelism: this rank's loss sum, correct images, images (the
  // caller's count) and stop request, summed over the ranks by an all-reduce that train_step
  // starts before the update (started after it, the sum would wait behind the update's gathers
  // of parameters).
  struct SummedFigures {
    std::shared_ptr<std::vector<double>> values;  // {loss sum, correct, images, stop}
    comm::Request request;
  };
  // One optimizer step on gradient_accumulation micro-batches (see trainer.cc). Returns the sum
  // of this rank's micro-batches' (unscaled) losses, and when asked the number of correctly
  // classified images; with several ranks it fills in and starts `summed` (null in one process).
  double train_step(const data::Batch* micro, int64_t* correct, SummedFigures* summed);
  // Whether the run stops at this step boundary: a stop request, agreed by every rank.
  bool stopping() const;
  // The micro-batches whose gradients one step combines: every rank's gradient_accumulation.
  int64_t micro_batches_per_step() const;
  // Forward and loss of one micro-batch in the configured precision.
  Tensor forward_loss(const data::Batch& batch, int64_t micro_batch, Tensor* output);

  TrainConfig config_;
  RunSettings run_;  // config_ resolved
  comm::Communicator* comm_;
  TrainStreams streams_;  // rank 0's; no stream on the other ranks
  // --memory-budget for the trainer's lifetime: the previous budget comes back when it ends, even
  // when the constructor throws.
  struct BudgetScope {
    bool active = false;
    std::optional<size_t> previous;
    explicit BudgetScope(std::optional<size_t> budget);
    ~BudgetScope();
  } budget_;
  std::optional<RunData> data_;
  std::shared_ptr<nn::Classifier> model_;
  bool user_model_ = false;
  std::unique_ptr<optim::Optimizer> optimizer_;
  optim::LrSchedule schedule_;
  std::unique_ptr<data::Loader> loader_;
  std::optional<amp::LossScaler> scaler_;
  std::unique_ptr<amp::Fp8State> fp8_;
  std::unique_ptr<ops::AutocastLog> log_;
  int64_t step_ = 0;
  bool ran_ = false;  // run() trains once
  std::vector<float> step_losses_;
  std::vector<int64_t> skipped_;       // the run's steps skipped by the loss scaler
  double compute_seconds_ = 0;         // inside train_step, this run
  double forward_macs_per_image_ = 0;  // counted on this run's first forward
  Profiler profiler_;                  // with config_.profile
  std::unique_ptr<nn::NumericsRecorder> numerics_;
  std::unique_ptr<DataParallel> dp_;  // with several ranks
  bool agreed_stop_ = false;          // every rank's stop requests, as of the last call
};

}  // namespace mantissa::train

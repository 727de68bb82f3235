#include "mantissa/train/trainer.h"

#include <chrono>
#include <cmath>
#include <csignal>
#include <ostream>

#include "mantissa/amp/scaled_step.h"
#include "mantissa/autograd/autograd.h"
#include "mantissa/core/error.h"
#include "mantissa/core/parallel.h"
#include "mantissa/dist/replicas.h"
#include "mantissa/io/output_file.h"
#include "mantissa/train/report_html.h"

namespace mantissa::train {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

volatile std::sig_atomic_t g_stop = 0;

std::unique_ptr<optim::Optimizer> make_optimizer(const TrainConfig& c, const RunSettings& s,
                                                 optim::ParamList params) {
  if (s.optimizer == OptimizerKind::kSgd) {
    optim::SgdOptions o;
    o.lr = c.lr;
    o.momentum = c.momentum;
    o.nesterov = c.nesterov;
    o.weight_decay = s.weight_decay;
    return std::make_unique<optim::Sgd>(std::move(params), o);
  }
  optim::AdamOptions o;
  o.lr = c.lr;
  o.beta1 = c.beta1;
  o.beta2 = c.beta2;
  o.eps = c.eps;
  o.bias_correction = c.bias_correction;
  o.weight_decay = s.weight_decay;
  return std::make_unique<optim::Adam>(std::move(params), o, s.optimizer == OptimizerKind::kAdamW);
}

// A run of a user's model: the built-in-only fields refused, then resolved; it is named after
// the model's type and the training data.
RunSettings resolve_user_run(const TrainConfig& c, const nn::Classifier* model,
                             const data::ExampleSource* train, bool checks_outputs) {
  check_user_model_config(c);
  MANTISSA_CHECK(model != nullptr, "the trainer got no model", "pass the nn::Classifier to train");
  MANTISSA_CHECK(train != nullptr, "the trainer got no training data",
                 "pass an ExampleSource (e.g. a data::TensorDataset) to train on");
  RunSettings r = resolve(c, checks_outputs);
  r.model = model->type();
  r.dataset = train->name();
  r.image_size.reset();
  return r;
}

// What the loader hands over: 8-bit images (normalized by the model), or the mode's input type.
DType input_dtype(const TrainConfig& c, const RunSettings& s) {
  return c.eight_bit_io ? DType::u8 : s.precision.mode.input_dtype;
}

// Rank 0 alone writes the run's files, so it alone checks and locks their paths.
bool writes_outputs(comm::Communicator* comm) {
  return (comm ? comm : &comm::world())->rank() == 0;
}

}  // namespace

void request_stop() { g_stop = 1; }
bool stop_requested() { return g_stop != 0; }

Trainer::BudgetScope::BudgetScope(std::optional<size_t> budget) {
  if (!budget) return;
  previous = default_memory_tracker().budget();
  active = true;
  default_memory_tracker().set_budget(budget);
}

Trainer::BudgetScope::~BudgetScope() {
  if (active) default_memory_tracker().set_budget(previous);
}

Trainer::Trainer(const TrainConfig& config, TrainStreams streams, comm::Communicator* comm)
    : config_(config),
      run_(resolve(config, writes_outputs(comm))),
      comm_(comm ? comm : &comm::world()),
      streams_(comm_->rank() == 0 ? streams : TrainStreams{}),
      budget_(run_.memory_budget) {
  set_rank_threads(config_, *comm_);
  if (comm_->size() > 1) dp_ = std::make_unique<DataParallel>(*comm_, config_, run_);
  data_.emplace(config_, input_dtype(config_, run_), comm_->size(), comm_->rank());
  nn::ModelConfig mc;
  mc.in_channels = data_->channels();
  mc.image_size = *run_.image_size;
  mc.num_classes = data_->num_classes();
  mc.seed = config_.seed;
  mc.imagenet_stem = config_.imagenet_stem;
  model_ = nn::make_model(config_.model, mc);
  set_up();
}

Trainer::Trainer(const TrainConfig& config, std::shared_ptr<nn::Classifier> model,
                 std::shared_ptr<const data::ExampleSource> train,
                 std::shared_ptr<const data::ExampleSource> test, TrainStreams streams,
                 comm::Communicator* comm)
    : config_(config),
      run_(resolve_user_run(config, model.get(), train.get(), writes_outputs(comm))),
      comm_(comm ? comm : &comm::world()),
      streams_(comm_->rank() == 0 ? streams : TrainStreams{}),
      budget_(run_.memory_budget),
      model_(std::move(model)),
      user_model_(true) {
  set_rank_threads(config_, *comm_);
  if (comm_->size() > 1) dp_ = std::make_unique<DataParallel>(*comm_, config_, run_);
  data_.emplace(config_, input_dtype(config_, run_), std::move(train), std::move(test),
                comm_->size(), comm_->rank());
  model_->name_storage();  // memory reports name the layers, as for the built-in models
  set_up();
}

Trainer::~Trainer() = default;

void Trainer::set_up() {
  if (!config_.init_from.empty()) init_from(config_.init_from);
  // Every rank starts from rank 0's weights (built from the same seed, or read from the same
  // file, they are the same already; the broadcast makes it so whatever the hosts hold).
  if (dp_) dp_->broadcast_model(*model_);
  // The precision applies to the model and its optimizer together: parameter and gradient
  // dtypes, per-module precision, then the optimizer's state types, master weights and
  // stochastic rounding (amp/settings.h).
  optimizer_ = make_optimizer(config_, run_, model_->named_parameters());
  amp::apply_precision(run_.precision, *model_, *optimizer_);
  if (run_.precision.fp8) fp8_ = std::make_unique<amp::Fp8State>(*run_.precision.fp8, *model_);
  apply_levers();
  if (config_.sync_batchnorm) {
    bool has = false;
    for (auto& [path, m] : model_->named_modules()) has = has || dynamic_cast<nn::BatchNorm2d*>(m);
    MANTISSA_CHECK(has, "--sync-batchnorm: " + run_.model + " has no batch normalization",
                   "drop --sync-batchnorm (a model without batch norm has no statistics to share)");
  }
  // The gradient reducer's hooks, ZeRO's shards and the synchronised batch norms, on the model
  // as it will train.
  if (dp_) dp_->attach(*model_, *optimizer_);
  // The data-parallel settings act between ranks; a run of one process accepts them (mpirun -n 1
  // is a job like any other) and says once that they change nothing here.
  if (!dp_ && streams_.out) {
    const TrainConfig d;
    std::string unused;
    for (const auto& [flag, set] :
         {std::pair{"--bucket-size", config_.bucket_size_mib != d.bucket_size_mib},
          std::pair{"--allreduce-dtype", config_.allreduce_dtype != d.allreduce_dtype},
          std::pair{"--sync-batchnorm", config_.sync_batchnorm},
          std::pair{"--zero", config_.zero != d.zero},
          std::pair{"--check-replicas", config_.check_replicas},
          std::pair{"--no-sufficient-factors", !config_.sufficient_factors}})
      if (set) unused += (unused.empty() ? "" : ", ") + std::string(flag);
    if (!unused.empty())
      *streams_.out << "note: " << unused
                    << " act between the ranks of a data-parallel job (mpirun -n N, N > 1); "
                       "this run has one process, so they change nothing"
                    << std::endl;
  }
  if (run_.precision.loss_scaling) scaler_.emplace(*run_.precision.loss_scaling);
  std::function<void(const std::string&)> sink;
  if (config_.autocast_log && streams_.out) {
    std::ostream* os = streams_.out;
    sink = [os](const std::string& line) { *os << line << std::endl; };
  }
  log_ = std::make_unique<ops::AutocastLog>(sink);
  if (streams_.out) *streams_.out << run_.precision.describe() << std::endl;
  if (streams_.out && dp_)
    *streams_.out << "data parallel: " << dp_->size() << " ranks x batch " << config_.batch_size
                  << " = global batch " << dp_->size() * config_.batch_size
                  << ", gradients in buckets of " << config_.bucket_size_mib << " MiB as "
                  << config_.allreduce_dtype << (config_.sync_batchnorm ? ", sync batch norm" : "")
                  << (config_.zero == 1 ? ", ZeRO-1 (optimizer state sharded)" : "") << std::endl;

  loader_ = data_->train_loader();
  const int64_t bpe = loader_->batches_per_epoch();
  MANTISSA_CHECK(bpe >= config_.gradient_accumulation,
                 "an epoch has " + std::to_string(bpe) + " batches, fewer than the " +
                     std::to_string(config_.gradient_accumulation) +
                     " micro-batches of one optimizer step",
                 "lower --gradient-accumulation or --batch-size, or use more examples");
  // The schedule spans --epochs; --max-steps only stops early, so a run stopped and resumed
  // follows the same learning rates as one that was not.
  schedule_ = run_.schedule;
  schedule_.total_steps = total_steps(config_, bpe);
  if (!config_.resume.empty()) load_checkpoint(config_.resume);
  // What each rank read from its own files, where the flags agree but the files may not (a
  // --data-dir or a checkpoint path that holds other files on another host): ranks that went on
  // would slice other batches, take other step counts and fall out of step in their collectives.
  if (dp_) {
    const uint64_t losses = dist::digest(step_losses_.data(), step_losses_.size() * sizeof(float));
    dp_->check_agreement({{"training examples", std::to_string(loader_->size())},
                          {"checkpoint step", std::to_string(step_)},
                          {"checkpoint losses (digest)", std::to_string(losses)}},
                         "data and checkpoint they read",
                         "give every rank the same training data and the same checkpoint (a "
                         "--data-dir or --resume path may differ between hosts, the files it "
                         "names may not)");
  }
}

void Trainer::apply_levers() {
  if (!config_.numerics_report.empty()) numerics_ = std::make_unique<nn::NumericsRecorder>();
  if (config_.recompute) {
    const std::vector<nn::Module*> blocks = model_->recompute_blocks();
    MANTISSA_CHECK(!blocks.empty(), "--recompute: " + run_.model + " has no blocks to recompute",
                   user_model_ ? "list the model's blocks in its recompute_blocks()"
                               : "use it with a ResNet (each block is a recomputation checkpoint)");
    for (nn::Module* b : blocks) b->set_recompute(true);
  }
  if (config_.eight_bit_io) {
    const data::Transform t = data_->transform();
    model_->set_input_normalization(t.mean, t.std, run_.precision.mode.input_dtype);
  }
}

// ---- The training loop ----
//
// run() trains for the configured epochs (train_epochs), then evaluates, saves and reports.
// train_epochs() hands the loader's batches to call() in groups of device_iterations x
// gradient_accumulation; call() runs one optimizer step per group of gradient_accumulation
// micro-batches (train_step), each a forward and backward pass per micro-batch and one update.

nn::Classifier& Trainer::model() {
  if (dp_) dp_->finish_parameters();
  return *model_;
}

optim::Optimizer& Trainer::optimizer() {
  if (dp_) dp_->finish_parameters();
  return *optimizer_;
}

TrainResult Trainer::run() {
  MANTISSA_CHECK(!ran_,
                 "this Trainer has run already (to step " + std::to_string(step_) +
                     "): a second run() would train nothing",
                 "make a new Trainer to train again; to continue the run, save a checkpoint "
                 "(TrainConfig::save) and resume from it (TrainConfig::resume)");
  ran_ = true;
  // Train; the memory peaks are the training's.
  TrainResult r;
  default_memory_tracker().reset_peaks();
  train_epochs(r);
  if (dp_) dp_->finish_parameters();  // the last step's gathers: what follows reads the weights
  r.memory = default_memory_tracker().stats();
  r.steps = step_;
  const int64_t peak = static_cast<int64_t>(r.memory.peak_total);
  r.rank_peak_memory = dp_ ? dp_->gather(peak) : std::vector<int64_t>{peak};
  if (dp_) r.communication = dp_->communication();
  if (scaler_) {
    r.loss_scale = scaler_->scale();
    r.skipped_steps = scaler_->skipped_steps();
    r.loss_scale_history = scaler_->history();
    r.skipped = skipped_;
  }
  r.step_losses = step_losses_;
  if (fp8_) r.fp8 = fp8_->report();
  // Save, also when stopped on request; evaluate unless stopped. A stop requested once the last
  // step is done (during the last save) skips the evaluation too, and is honoured by it.
  if (!config_.save.empty()) save_checkpoint(config_.save);
  if (r.interrupted && streams_.out)
    *streams_.out << interrupted_line(step_, config_.save) << std::endl;
  const bool stop_late = !r.interrupted && stop_requested();
  if (stop_late) g_stop = 0;
  if (config_.evaluate && !r.interrupted && !stop_late && data_->has_test()) {
    r.test_accuracy = evaluate(&r.test_examples);
    if (streams_.out) *streams_.out << test_line(*r.test_accuracy, r.test_examples) << std::endl;
  }
  // Report: the summary line, the profile table, the metrics, the training report (drawn from
  // the metrics' text) and the numerics files.
  if (streams_.out && r.train_seconds > 0)
    *streams_.out << summary_line(r, loader_->batch_bytes()) << std::endl;
  if (streams_.out && config_.profile) *streams_.out << profile_table(r);
  // Files are rank 0's to write.
  if (rank() != 0) return r;
  if (!config_.metrics_json.empty() || !config_.report.empty()) {
    const std::string metrics = metrics_json(config_, run_, r);
    if (!config_.metrics_json.empty()) io::write_file_atomic(config_.metrics_json, metrics);
    if (!config_.report.empty())
      io::write_file_atomic(config_.report, training_report_html(metrics));
  }
  if (numerics_ && !config_.numerics_report.empty()) {
    const std::string line =
        write_numerics_report(config_.numerics_report, *numerics_,
                              run_.model + ", " + run_.precision.mode.name + ", batch " +
                                  std::to_string(config_.batch_size));
    if (streams_.out) *streams_.out << line << std::endl;
  }
  return r;
}

void Trainer::train_epochs(TrainResult& result) {
  const int64_t N = config_.gradient_accumulation, K = config_.device_iterations;
  const int64_t spe = loader_->batches_per_epoch() / N;  // optimizer steps per epoch
  const int64_t total = config_.max_steps > 0 ? std::min(config_.max_steps, schedule_.total_steps)
                                              : schedule_.total_steps;
  const int64_t epochs = (total + spe - 1) / spe;
  ProgressBar bar(streams_.progress, config_.progress);
  model_->train();
  profiler_.clear();
  ProfilerScope profiling(config_.profile ? &profiler_ : nullptr);
  const auto t_train = Clock::now();
  const double wait0 = loader_->wait_seconds();
  compute_seconds_ = 0;
  int64_t images_total = 0, steps_run = 0;
  // A stop asked for before training (during set-up) is honoured by every rank alike.
  agreed_stop_ = dp_ && dp_->any(stop_requested());
  while (step_ < total && !stopping()) {
    // An epoch, or what is left of it after a resume: the loader starts at the step's batch
    // (the batches of an epoch are a function of the seed and the epoch).
    const int64_t epoch = step_ / spe;
    const int64_t last = std::min(total, (epoch + 1) * spe);
    loader_->start(epoch, (step_ % spe) * N);
    const auto t0 = Clock::now();
    const int64_t first = step_;
    EpochTally tally;
    // Calls of this epoch, for the progress bar: K steps each, the last may run fewer.
    int64_t call_index = (step_ - epoch * spe) / K;
    const int64_t calls = (last - epoch * spe + K - 1) / K;
    std::vector<data::Batch> batches;
    while (step_ < last && !stopping()) {
      // One call: the batches of up to K steps handed over at once, the outputs returned once.
      const int64_t k = std::min(K, last - step_);
      batches.clear();
      const auto t_call = Clock::now();
      {
        ProfileTimer timed("step", "", "data");
        for (int64_t b = 0; b < k * N; ++b) {
          std::optional<data::Batch> batch = loader_->next();
          MANTISSA_ASSERT(batch.has_value(), "the loader ended before the epoch's steps");
          result.input_bytes += batch->images.nbytes() + batch->labels.nbytes();
          batches.push_back(std::move(*batch));
        }
      }
      const CallOutput co = call(batches);
      const double call_seconds = seconds_since(t_call);
      for (int64_t i = 0; i < co.steps; ++i)
        result.step_seconds.push_back(call_seconds / static_cast<double>(co.steps));
      ++result.calls;
      ++call_index;
      steps_run += co.steps;
      tally.add(co);
      result.outputs.insert(result.outputs.end(), co.outputs.begin(), co.outputs.end());
      bar.update(epoch + 1, epochs, call_index, calls, seconds_since(t0),
                 static_cast<double>(tally.images()), tally.loss(), tally.accuracy(), step_ == last,
                 loss_scaler());
    }
    EpochStats es;
    es.epoch = epoch + 1;
    es.steps = step_ - first;
    es.seconds = seconds_since(t0);
    es.loss = tally.loss();
    es.train_accuracy = tally.accuracy();
    es.images_per_second = es.seconds > 0 ? static_cast<double>(tally.images()) / es.seconds : 0;
    images_total += tally.images();
    result.epochs.push_back(es);
    if (streams_.out) *streams_.out << epoch_line(es) << std::endl;
    // A checkpoint at each epoch's end; run() saves the last one.
    if (!config_.save.empty() && step_ < total && !stopping()) save_checkpoint(config_.save);
  }
  loader_->stop();
  result.interrupted = step_ < total;
  if (result.interrupted) g_stop = 0, agreed_stop_ = false;  // honoured: a later run goes on
  result.train_seconds = seconds_since(t_train);
  result.images_per_second =
      result.train_seconds > 0 ? static_cast<double>(images_total) / result.train_seconds : 0;
  result.data_wait_seconds = loader_->wait_seconds() - wait0;
  result.flops_per_image = 6 * forward_macs_per_image_;
  result.gflops_per_second = result.flops_per_image * result.images_per_second * 1e-9;
  if (config_.profile) {
    result.profile = profiler_.rows();
    result.profiled_steps = steps_run;
  }
  result.host_seconds_per_step =
      steps_run > 0
          ? std::max(0.0, result.train_seconds - compute_seconds_ - result.data_wait_seconds) /
                static_cast<double>(steps_run)
          : 0;
}

CallOutput Trainer::call(const std::vector<data::Batch>& batches) {
  if (!model_->is_training()) model_->train();
  const int64_t N = config_.gradient_accumulation;
  const int64_t n = static_cast<int64_t>(batches.size());
  MANTISSA_CHECK(n > 0 && n % N == 0,
                 "a call of the training step got " + std::to_string(n) +
                     " batches, not a multiple of --gradient-accumulation " + std::to_string(N),
                 "hand over device_iterations x gradient_accumulation batches");
  for (int64_t b = 0; b < n; ++b) {
    const data::Batch& batch = batches[static_cast<size_t>(b)];
    MANTISSA_CHECK(batch.images.defined() && batch.labels.defined(),
                   "a call of the training step got batch " + std::to_string(b) + " without " +
                       (batch.images.defined() ? "labels" : "images"),
                   "fill data::Batch::images (N, C, H, W) and labels (N, i64) of every batch");
  }
  CallOutput co;
  co.steps = n / N;
  const OutputMode mode = run_.output_mode;
  // Each step's figures, this rank's: its micro-batches' summed losses, correct images and images.
  struct Figures {
    double loss_sum = 0;
    int64_t correct = 0, images = 0;
    bool returned = false;
  };
  std::vector<Figures> steps(static_cast<size_t>(co.steps));
  std::vector<SummedFigures> summed(dp_ ? static_cast<size_t>(co.steps) : 0);
  // A step's figures (of the global batch once summed over the ranks) into the history and the
  // call's outputs.
  const int64_t first_step = step_;
  const double micro = static_cast<double>(micro_batches_per_step());
  auto record = [&](int64_t k, const Figures& f) {
    const float l = static_cast<float>(f.loss_sum / micro);
    if (!std::isfinite(l)) {
      // The first step's loss comes before any update: the weights or the data hold the
      // non-finite value, or a 16-bit forward pass overflows. Later, the updates made it.
      const bool first = first_step + k == 0;
      const bool sixteen = run_.precision.mode.computes_in_16_bits();
      const bool adam_eps0 = run_.optimizer != OptimizerKind::kSgd && config_.eps == 0;
      const std::string hint =
          first ? std::string(
                      "the initial weights or the data hold a non-finite value: check the "
                      "file given to --init-from, and the dataset") +
                      (sixteen ? "; or the forward pass overflows its 16-bit type: 'mantissa "
                                 "advise' names the layers, --keep-fp32 keeps them in FP32"
                               : "")
          : adam_eps0 ? "--eps 0 divides by zero wherever a gradient's running square is 0: "
                        "give a positive --eps (the default is 1e-8)"
                      : "lower --lr, or set --max-grad-norm";
      throw Error("the loss became " + std::string(std::isnan(l) ? "nan" : "inf") + " at step " +
                      std::to_string(first_step + k + 1) + (first ? ", before any update" : ""),
                  hint);
    }
    step_losses_.push_back(l);
    co.images += f.images;
    if (!f.returned) return;
    const int64_t step = first_step + k + 1;
    if (mode == OutputMode::kSum && !co.outputs.empty()) {
      StepOutput& o = co.outputs.back();
      o.step = step;
      ++o.steps;
      o.loss_sum += l;
      o.correct += f.correct;
      o.examples += f.images;
    } else {
      co.outputs.push_back({step, 1, l, f.correct, f.images});
    }
  };
  for (int64_t k = 0; k < co.steps; ++k) {
    Figures& f = steps[static_cast<size_t>(k)];
    f.returned = mode == OutputMode::kAll || mode == OutputMode::kSum ||
                 (mode == OutputMode::kFinal && k == co.steps - 1) ||
                 (mode == OutputMode::kEvery && (k + 1) % config_.output_return_period == 0);
    // Dropout's masks and the learning rate are functions of the step, so a resumed run draws
    // and uses the same; each rank draws masks of its own for its images.
    nn::set_random_context({config_.seed + static_cast<uint64_t>(rank()) * 0x9e3779b97f4a7c15ull,
                            static_cast<uint64_t>(step_)});
    optimizer_->set_lr(schedule_.lr_at(config_.lr, step_));
    for (int64_t m = 0; m < N; ++m)
      f.images += batches[static_cast<size_t>(k * N + m)].labels.size(0);
    if (dp_)
      summed[static_cast<size_t>(k)].values = std::make_shared<std::vector<double>>(
          std::vector<double>{0.0, 0.0, static_cast<double>(f.images), 0.0});
    try {
      f.loss_sum =
          train_step(&batches[static_cast<size_t>(k * N)], f.returned ? &f.correct : nullptr,
                     dp_ ? &summed[static_cast<size_t>(k)] : nullptr);
    } catch (const autograd::AnomalyError& e) {
      throw autograd::AnomalyError("step " + std::to_string(step_ + 1) + ": " + e.message(),
                                   e.hint());
    }
    if (!dp_) record(k, f);  // one process: each step's loss is checked as it comes
    ++step_;
  }
  if (dp_) {
    // Every step's losses, correct and counted images summed over the ranks, and the stop
    // requests (the ranks stop at the same boundary), from the all-reduces the steps started.
    bool stop = false;
    for (SummedFigures& s : summed) {
      s.request.wait();
      stop = stop || (*s.values)[3] > 0;
    }
    agreed_stop_ = stop;
    for (int64_t k = 0; k < co.steps; ++k) {
      const std::vector<double>& v = *summed[static_cast<size_t>(k)].values;
      Figures f = steps[static_cast<size_t>(k)];
      f.loss_sum = v[0];
      f.correct = static_cast<int64_t>(v[1]);
      f.images = static_cast<int64_t>(v[2]);
      record(k, f);
    }
  }
  return co;
}

bool Trainer::stopping() const { return dp_ ? agreed_stop_ : stop_requested(); }

int64_t Trainer::micro_batches_per_step() const {
  return config_.gradient_accumulation * world_size();
}

// One optimizer step:
//   1. each of the N micro-batches runs forward to its loss in the configured precision
//      (forward_loss), then backward from the loss times the loss scale S, which adds its
//      gradients to those of the micro-batches before it;
//   2. with several ranks, the gradients are summed over the ranks: the last micro-batch's
//      backward pass hands each bucket of gradients to the reducer as soon as it is complete
//      (the earlier micro-batches accumulate locally, no_sync), and the step waits for the sums
//      (with --zero 1, each rank receives the sum of its shard only);
//   3. the optimizer's step (amp::ScaledStep): under loss scaling or clipping, a read-only pass
//      over the gradients first (inf/NaN of the unscaled values: an overflow skips the step; the
//      global norm of the reduced gradients; the reduced gradients are the same on every rank, so
//      is the decision; ZeRO's shards combine their findings); then one update pass that unscales
//      each gradient by 1/S (and, for the "mean" reduction, divides it by the micro-batches of
//      every rank), clips and applies it, one parameter chunk at a time; then the scaler's update
//      (an overflow lowers S); ZeRO then gathers the updated shards, and rank 0's batch-norm
//      statistics go to every rank;
//   4. the gradients are dropped.
// When a step needs nothing global (one micro-batch on one process, no loss scale, clipping,
// anomaly detection, numerics report or recomputation), step 3 happens inside the backward pass
// of step 1: each parameter is updated as soon as its gradient is complete
// (Optimizer::begin_backward_step), so gradients do not pile up over the backward pass (a lower
// peak) and each is read while it is still in cache; the arithmetic is the same, bit for bit.
// Under loss scaling the same steps keep the gradients that an op computes in parts (a linear
// layer's weight gradient at a small batch) as what computes them (Optimizer::defer_gradients):
// the step computes them twice, to check and to apply, so no update is applied before every
// gradient is known to be finite, and the largest gradients are never held whole.
// With several ranks an update must wait for the gradient summed over the ranks, so every step
// updates after the backward pass; the weights whose gradients are formed from factors gathered
// over the ranks keep them as their producers in the same cases, with or without loss scaling
// (DataParallel::defer_factored_gradients): the step forms each part as it applies it.
bool updates_as_gradients_complete(const TrainConfig& c) {
  return c.update_in_backward && c.gradient_accumulation == 1 && c.max_grad_norm <= 0 &&
         !c.detect_anomaly && !c.recompute;
}

double Trainer::train_step(const data::Batch* micro, int64_t* correct, SummedFigures* summed) {
  const int64_t N = config_.gradient_accumulation;
  const auto t0 = Clock::now();
  amp::ScaledStep scaled(loss_scaler());  // S is read once: every micro-batch is scaled alike
  std::optional<autograd::DetectAnomalyScope> anomaly;
  if (config_.detect_anomaly) anomaly.emplace(/*inf_in_backward=*/!scaler_.has_value());
  nn::NumericsRecorder* numerics =
      numerics_ && step_ % config_.numerics_every == 0 ? numerics_.get() : nullptr;
  const bool fused = updates_as_gradients_complete(config_) && !numerics;
  const bool local_step = fused && !dp_;
  const bool update_in_backward = local_step && !scaler_;
  const bool defer_gradients = local_step && scaler_;
  const bool defer_factored = fused && dp_;
  double loss_sum = 0;
  for (int64_t f = 0; f < N; ++f) {
    // "running" keeps the mean so far, s = f/(f+1) s + g/(f+1): micro-batch f's loss is weighted
    // by 1/(f+1) and the gradients so far by f/(f+1). "mean" and "sum" add gradients as they come.
    const double weight =
        run_.reduction == Reduction::kRunning && f > 0 ? 1.0 / static_cast<double>(f + 1) : 1.0;
    std::optional<nn::NumericsScope> probe;
    if (numerics) probe.emplace(*numerics, 1.0 / (scaled.scale() * weight));
    Tensor out;
    const Tensor loss = forward_loss(micro[f], f, &out);
    if (weight != 1.0) optim::scale_grads(optimizer_->params(), static_cast<float>(1.0 - weight));
    default_memory_tracker().set_phase("backward");
    if (update_in_backward) optimizer_->begin_backward_step();
    if (defer_gradients) optimizer_->defer_gradients();
    if (defer_factored) dp_->defer_factored_gradients(*optimizer_);
    {
      ProfileTimer timed("step", "", "backward");
      std::optional<dist::Reducer::NoSync> local;  // communication on the last micro-batch only
      if (dp_ && f + 1 < N) local.emplace(dp_->no_sync());
      autograd::backward(scaled.scale_loss(loss, weight));
    }
    loss_sum += loss.item();
    if (correct) *correct += count_correct(out, micro[f].labels);
  }
  if (dp_) {
    ProfileTimer timed("step", "", "communication");
    dp_->finish_gradients();
  }
  MANTISSA_ASSERT(!dp_ == !summed, "train_step sums its figures exactly when data-parallel");
  if (summed) {
    std::vector<double>& v = *summed->values;  // the images counted by the caller
    v[0] = loss_sum;
    v[1] = correct ? static_cast<double>(*correct) : 0.0;
    v[3] = stop_requested() ? 1.0 : 0.0;
    summed->request = dp_->start_sum(summed->values);
  }
  anomaly.reset();
  default_memory_tracker().set_phase("optimizer");
  // "mean" divides the summed gradients by the micro-batches of every rank in the step's pass,
  // with the unscaling; "running" leaves each rank's mean, summed over the ranks: divided by
  // their number.
  const double divisor = run_.reduction == Reduction::kMean ? static_cast<double>(N) * world_size()
                         : run_.reduction == Reduction::kRunning ? static_cast<double>(world_size())
                                                                 : 1.0;
  if (numerics) {
    numerics->record_parameter_gradients(*model_,
                                         1.0 / static_cast<double>(scaled.inverse_scale(divisor)));
    numerics->count_step();
  }
  optim::StepOptions options;
  options.max_grad_norm = config_.max_grad_norm;
  if (dp_) dp_->prepare(options);
  optim::StepReport report;
  {
    ProfileTimer timed("step", "", "optimizer");
    report = scaled.step(*optimizer_, options, divisor);
    if (report.skipped) skipped_.push_back(step_ + 1);
  }
  if (dp_) {
    ProfileTimer timed("step", "", "communication");
    dp_->after_step(report);
  }
  {
    ProfileTimer timed("step", "", "zero_grad");
    optimizer_->zero_grad();
  }
  // FP8 scales for the next step from this step's amaxes; under data parallelism the amaxes are
  // MAX-reduced across the ranks first, so every rank quantizes with the same scales.
  if (fp8_) {
    if (dp_) {
      ProfileTimer timed("step", "", "communication");
      fp8_->reduce_amax(*comm_);
    }
    fp8_->end_step(step_ + 1, numerics);
  }
  default_memory_tracker().set_phase("");
  compute_seconds_ += seconds_since(t0);
  return loss_sum;
}

Tensor Trainer::forward_loss(const data::Batch& batch, int64_t micro_batch, Tensor* output) {
  default_memory_tracker().set_phase("forward");
  ProfileTimer timed("step", "", "forward");
  // Automatic casting, partials and stochastic op outputs as the precision says; the stream of
  // stochastic outputs is a function of the step and the micro-batch.
  // Each rank's micro-batches draw streams of their own (one process: the micro-batch's).
  const amp::ForwardPrecision precision(
      run_.precision, log_.get(),
      static_cast<uint64_t>((step_ * config_.gradient_accumulation + micro_batch) * world_size() +
                            rank())
          << 24,
      fp8_.get());
  {
    // The model's cost is counted on the run's first forward.
    std::optional<MacCounter> macs;
    if (forward_macs_per_image_ == 0) macs.emplace();
    *output = (*model_)(batch.images);
    if (macs && batch.images.dim() > 0 && batch.images.size(0) > 0)
      forward_macs_per_image_ =
          static_cast<double>(macs->macs()) / static_cast<double>(batch.images.size(0));
  }
  *output = run_.precision.loss_input(*output);
  ProfileTimer timed_loss("forward", "", "loss");
  Tensor loss = model_->loss(*output, batch.labels);
  // nn::Classifier::loss's contract, which a user's model may break: a one-element FP32 tensor
  // (loss scaling multiplies it in FP32; a 16-bit loss would overflow or lose the scaled value).
  MANTISSA_CHECK(
      loss.defined() && loss.numel() == 1 && loss.dtype() == DType::f32,
      "the model's loss() returned " +
          (loss.defined() ? std::string(dtype_name(loss.dtype())) + " " + shape_str(loss.shape())
                          : std::string("an undefined tensor")) +
          ", not the one-element f32 tensor the trainer takes",
      "reduce the loss to one value and compute it in FP32 (ops::cast(x, DType::f32) "
      "before the reduction)");
  return loss;
}

double Trainer::evaluate(int64_t* examples) {
  if (dp_) dp_->finish_parameters();
  std::unique_ptr<data::Loader> test = data_->test_loader();
  if (dp_)
    dp_->check_agreement({{"test examples", test ? std::to_string(test->size()) : "none"}},
                         "test data they read",
                         "give every rank the same test data (a --data-dir may differ between "
                         "hosts, the files it names may not)");
  // The FP8 modes evaluate in FP8 with the scales training left.
  std::optional<amp::Fp8Frozen> fp8;
  if (fp8_) fp8.emplace(*fp8_);
  EvalResult r =
      test ? evaluate_model(*model_, *test, &run_.precision, fp8 ? &*fp8 : nullptr) : EvalResult{};
  if (dp_) {
    // Each rank evaluated its slice of every test batch: the counts over the ranks.
    std::vector<double> v{static_cast<double>(r.correct), static_cast<double>(r.examples)};
    dp_->sum(v);
    r.correct = static_cast<int64_t>(v[0]);
    r.examples = static_cast<int64_t>(v[1]);
    r.accuracy =
        r.examples > 0 ? static_cast<double>(r.correct) / static_cast<double>(r.examples) : 0;
  }
  if (examples) *examples = r.examples;
  return r.accuracy;
}

// ---- Checkpoints (checkpoint.h) ----

CheckpointRun Trainer::checkpoint_run() const {
  CheckpointRun c = train::checkpoint_run(config_, run_, user_model_);
  c.world_size = world_size();
  return c;
}

void Trainer::save_checkpoint(const std::string& path) const {
  // ZeRO's shards are gathered first (every rank takes part); rank 0 writes.
  if (dp_) dp_->finish_parameters();
  const std::optional<std::vector<std::pair<std::string, Tensor>>> gathered =
      dp_ ? dp_->gathered_optimizer_state() : std::nullopt;
  if (rank() != 0) return;
  train::save_checkpoint(path, checkpoint_run(), *model_, *optimizer_,
                         scaler_ ? &*scaler_ : nullptr, step_, step_losses_,
                         gathered ? &*gathered : nullptr, fp8_.get(), &skipped_);
}

void Trainer::load_checkpoint(const std::string& path) {
  if (dp_) dp_->finish_parameters();  // a gather still running would write over the weights
  Resumed r = train::load_checkpoint(path, checkpoint_run(), *model_, *optimizer_, loss_scaler(),
                                     fp8_.get());
  // A step past the run's end has no learning rate in this schedule and nothing to train.
  MANTISSA_CHECK(r.step <= schedule_.total_steps,
                 path + " is at step " + std::to_string(r.step) + ", past the " +
                     std::to_string(schedule_.total_steps) + " steps of this run's --epochs " +
                     std::to_string(config_.epochs),
                 "raise --epochs to continue it, or resume from a checkpoint of this run");
  // --max-steps counts from the start of the run: at or below the checkpoint's step it would end
  // the run before its first step.
  MANTISSA_CHECK(config_.max_steps == 0 || config_.max_steps > r.step,
                 path + " is at step " + std::to_string(r.step) + ", and this run's --max-steps " +
                     std::to_string(config_.max_steps) + " ends it at step " +
                     std::to_string(config_.max_steps) + ": the resume would train nothing",
                 "pass a --max-steps above " + std::to_string(r.step) +
                     ": it counts the steps from the start of the run, the checkpoint's " +
                     std::to_string(r.step) + " included");
  if (!r.note.empty() && streams_.out) *streams_.out << r.note << std::endl;
  step_ = r.step;
  step_losses_ = std::move(r.step_losses);
  skipped_ = std::move(r.skipped_steps);
}

void Trainer::init_from(const std::string& path) {
  if (dp_) dp_->finish_parameters();
  load_weights(path, *model_);
}

nn::NumericsRecorder& Trainer::record_numerics() {
  if (!numerics_) numerics_ = std::make_unique<nn::NumericsRecorder>();
  config_.numerics_every = 1;
  return *numerics_;
}

}  // namespace mantissa::train

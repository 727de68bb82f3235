#include "mantissa/train/data_parallel.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "mantissa/core/error.h"
#include "mantissa/core/parallel.h"
#include "mantissa/dist/agreement.h"
#include "mantissa/dist/replicas.h"
#include "mantissa/nn/layers.h"

namespace mantissa::train {
namespace {

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string list(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += (s.empty() ? "" : ",") + x;
  return s;
}

std::string opt(const std::optional<double>& v) { return v ? num(*v) : std::string("-"); }

// The fields every rank must share: all that shape the training, named as the flags are. Paths of
// the data (--data-dir), the compute threads, the loader's workers and what is only printed or
// written by rank 0 (--metrics-json, the progress bar, --profile, --autocast-log) may differ.
// A TrainConfig field that changes the training belongs here.
dist::ConfigFields agreement_fields(const TrainConfig& c) {
  const auto b = [](bool v) { return std::string(v ? "on" : "off"); };
  const auto i = [](int64_t v) { return std::to_string(v); };
  return {
      {"model", c.model},
      {"dataset", c.dataset},
      {"image-size", i(c.image_size)},
      {"imagenet-stem", b(c.imagenet_stem)},
      {"train-limit", i(c.train_limit)},
      {"test-limit", i(c.test_limit)},
      {"augment", b(c.augment)},
      {"synthetic-size", i(c.synthetic_size)},
      {"eight-bit-io", b(c.eight_bit_io)},
      {"batch-size", i(c.batch_size)},
      {"eval-batch-size", i(c.eval_batch_size)},
      {"epochs", i(c.epochs)},
      {"max-steps", i(c.max_steps)},
      {"shuffle", b(c.shuffle)},
      {"optimizer", c.optimizer},
      {"lr", num(c.lr)},
      {"weight-decay", num(c.effective_weight_decay())},
      {"momentum", num(c.momentum)},
      {"nesterov", b(c.nesterov)},
      {"beta1", num(c.beta1)},
      {"beta2", num(c.beta2)},
      {"eps", num(c.eps)},
      {"bias-correction", b(c.bias_correction)},
      {"max-grad-norm", num(c.max_grad_norm)},
      {"lr-schedule", c.lr_schedule},
      {"warmup-steps", i(c.warmup_steps)},
      {"lr-step-size", i(c.lr_step_size)},
      {"lr-gamma", num(c.lr_gamma)},
      {"seed", std::to_string(c.seed)},
      {"init-from", c.init_from},
      {"save", c.save},
      {"resume", c.resume},
      {"memory-budget", c.memory_budget},
      {"gradient-accumulation", i(c.gradient_accumulation)},
      {"accumulation-reduction", c.accumulation_reduction},
      {"device-iterations", i(c.device_iterations)},
      {"output-mode", c.output_mode},
      {"output-return-period", i(c.output_return_period)},
      {"recompute", b(c.recompute)},
      {"detect-anomaly", b(c.detect_anomaly)},
      {"numerics-report", b(!c.numerics_report.empty())},
      {"numerics-every", i(c.numerics_every)},
      {"no-update-in-backward", b(!c.update_in_backward)},
      {"no-eval", b(!c.evaluate)},
      {"precision", c.precision},
      {"half-type", c.half_type},
      {"keep-fp32", list(c.keep_fp32)},
      {"half-modules", list(c.half_modules)},
      {"autocast-lower-list", c.autocast_lower_list},
      {"autocast-fp32-list", c.autocast_fp32_list},
      {"loss-scaling", c.loss_scaling},
      {"loss-scale-init", opt(c.loss_scale_init)},
      {"loss-scale-min", opt(c.loss_scale_min)},
      {"loss-scale-max", opt(c.loss_scale_max)},
      {"loss-scale-growth-interval", i(c.loss_scale_growth_interval)},
      {"loss-scale-hysteresis", i(c.loss_scale_hysteresis)},
      {"stochastic-rounding", b(c.stochastic_rounding)},
      {"stochastic-outputs", b(c.stochastic_outputs)},
      {"kahan", b(c.kahan)},
      {"partials", c.partials},
      {"accum-type", c.accum_type},
      {"first-moment-type", c.first_moment_type},
      {"second-moment-type", c.second_moment_type},
      {"bucket-size", num(c.bucket_size_mib)},
      {"allreduce-dtype", c.allreduce_dtype},
      {"sync-batchnorm", b(c.sync_batchnorm)},
      {"zero", i(c.zero)},
      {"check-replicas", b(c.check_replicas)},
      {"sufficient-factors", b(c.sufficient_factors)},
  };
}

}  // namespace

int rank_threads(int threads, int local_ranks) {
  if (threads > 0 || local_ranks <= 1 || std::getenv("MANTISSA_NUM_THREADS")) return threads;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / local_ranks);
}

void set_rank_threads(const TrainConfig& config, const comm::Communicator& comm) {
  set_num_threads(rank_threads(config.threads, comm.local_size()));
}

DataParallel::DataParallel(comm::Communicator& comm, const TrainConfig& config,
                           const RunSettings& settings)
    : comm_(comm), config_(config), settings_(settings) {
  dist::check_config_agreement(comm_, agreement_fields(config_));
  MANTISSA_CHECK(config_.numerics_report.empty() || config_.zero == 0,
                 "--numerics-report cannot run with --zero 1: each rank then holds only its part "
                 "of the reduced gradients the report records",
                 "drop --zero 1 for the run that records the numerics report");
}

DataParallel::~DataParallel() = default;

void DataParallel::check_agreement(const dist::ConfigFields& fields, const std::string& what,
                                   const std::string& hint) {
  dist::check_config_agreement(comm_, fields, what, hint);
}

void DataParallel::broadcast_model(nn::Module& model) {
  std::vector<nn::Module::NamedTensor> tensors = model.named_parameters();
  for (const nn::Module::NamedTensor& b : model.named_buffers()) tensors.push_back(b);
  dist::broadcast_tensors(comm_, tensors, 0);
}

constexpr int64_t kMinFactoredValues = int64_t{1} << 18;

std::vector<nn::Module::NamedTensor> factored_weights(nn::Module& model, const TrainConfig& c,
                                                      const RunSettings& s, int ranks) {
  std::vector<nn::Module::NamedTensor> out;
  // Every pass synchronised, gradients summed in FP32: no accumulation (its passes inside no_sync
  // would form global gradients), an FP32 wire, no FP8 (its linear layers form their gradients
  // otherwise). Under ZeRO each rank forms and updates its block of the weight's rows.
  if (!c.sufficient_factors || ranks < 2 || c.gradient_accumulation != 1 ||
      s.allreduce_dtype != DType::f32 || s.precision.fp8)
    return out;
  const int64_t rows = ranks * c.batch_size;  // every rank's factors
  for (auto& [path, m] : model.named_modules()) {
    if (!dynamic_cast<nn::Linear*>(m)) continue;
    for (const nn::Module::NamedTensor& t : m->named_parameters()) {
      if (t.name != "weight" || !t.tensor->requires_grad() || t.tensor->dim() != 2) continue;
      const int64_t outf = t.tensor->size(0), in = t.tensor->size(1);
      // The factors at most half the gradient's size (a layer fed more rows than the batch, a
      // sequence, only gathers more), and the gradient at least 2^18 values (1 MiB in FP32):
      // below that the bytes saved are few, while the gathers wait inside the backward pass
      // where a bucket's all-reduce overlaps it.
      if (2 * rows * (in + outf) <= in * outf && in * outf >= kMinFactoredValues)
        out.push_back({path.empty() ? t.name : path + "." + t.name, t.tensor});
    }
  }
  return out;
}

void DataParallel::attach(nn::Module& model, optim::Optimizer& optimizer) {
  dist::ReducerOptions o;
  o.bucket_cap_mib = config_.bucket_size_mib;
  o.wire = settings_.allreduce_dtype;
  o.scatter = config_.zero == 1;
  // Linear weights whose gradient's factors are smaller than it travel as factors; the reducer
  // takes the other parameters.
  std::vector<nn::Module::NamedTensor> params = model.named_parameters();
  const std::vector<nn::Module::NamedTensor> factored =
      factored_weights(model, config_, settings_, comm_.size());
  if (!factored.empty()) {
    factors_ = std::make_unique<dist::FactorGradients>(comm_, factored);
    std::erase_if(params, [&](const nn::Module::NamedTensor& p) {
      return std::any_of(factored.begin(), factored.end(),
                         [&](const nn::Module::NamedTensor& f) { return f.tensor == p.tensor; });
    });
  }
  reducer_ = std::make_unique<dist::Reducer>(comm_, params, o);
  if (config_.zero == 1)
    zero_ = std::make_unique<dist::Zero1>(comm_, *reducer_, optimizer, factors_.get());
  if (config_.sync_batchnorm) {
    comm::Communicator* c = &comm_;
    for (auto& [path, m] : model.named_modules())
      if (auto* bn = dynamic_cast<nn::BatchNorm2d*>(m))
        bn->set_sync([c](double* values, size_t n) {
          c->all_reduce(values, n, DType::f64, comm::ReduceOp::kSum);
        });
  }
  buffers_ = model.named_buffers();
  if (config_.check_replicas) {
    replicas_ = model.named_parameters();
    for (const nn::Module::NamedTensor& b : buffers_) replicas_.push_back(b);
  }
}

size_t DataParallel::defer_factored_gradients(optim::Optimizer& optimizer) {
  if (!factors_) return 0;
  std::vector<const AutogradMeta*> factored;
  for (const nn::Module::NamedTensor& w : factors_->weights())
    factored.push_back(w.tensor->autograd_meta().get());
  return optimizer.defer_gradients([&factored](const Tensor& p) {
    return std::find(factored.begin(), factored.end(), p.autograd_meta().get()) != factored.end();
  });
}

void DataParallel::prepare(optim::StepOptions& options) {
  if (zero_) options.combine = zero_->combine();
}

void DataParallel::after_step(const optim::StepReport& report) {
  if (zero_ && !report.skipped) zero_->gather_parameters();
  // Per-rank batch-norm statistics: rank 0's are every rank's (PyTorch DDP's broadcast_buffers).
  // Synchronised batch norms compute the same statistics everywhere already.
  if (!config_.sync_batchnorm && !buffers_.empty()) dist::broadcast_tensors(comm_, buffers_, 0);
  if (config_.check_replicas) {
    finish_parameters();
    const std::string mismatch = dist::replica_mismatch(comm_, replicas_);
    MANTISSA_CHECK(mismatch.empty(), "--check-replicas: after an optimizer step, " + mismatch,
                   "the ranks' replicas diverged: report this as a bug with the command line");
  }
}

void DataParallel::finish_parameters() {
  if (zero_) zero_->finish_gather();
}

void DataParallel::sum(std::vector<double>& values) {
  comm_.all_reduce(values.data(), values.size(), DType::f64, comm::ReduceOp::kSum);
}

comm::Request DataParallel::start_sum(std::shared_ptr<std::vector<double>> values) {
  double* data = values->data();
  const size_t n = values->size();
  return comm_.all_reduce_async(data, n, DType::f64, comm::ReduceOp::kSum, std::move(values));
}

bool DataParallel::any(bool flag) {
  std::vector<double> v{flag ? 1.0 : 0.0};
  sum(v);
  return v[0] > 0;
}

std::vector<int64_t> DataParallel::gather(int64_t value) {
  std::vector<int64_t> all(static_cast<size_t>(comm_.size()));
  comm_.all_gather(&value, all.data(), 1, DType::i64);
  return all;
}

std::optional<std::vector<std::pair<std::string, Tensor>>>
DataParallel::gathered_optimizer_state() {
  if (!zero_) return std::nullopt;
  return zero_->gathered_state();
}

Communication DataParallel::communication() const {
  Communication c;
  c.world_size = comm_.size();
  c.wire = config_.allreduce_dtype;
  if (!reducer_) return c;
  dist::CommStats t = reducer_->total();
  // The factors' gathers and ZeRO's parameter gathers join the reducer's figures (its steps count).
  auto add = [&t](const dist::CommStats& o) {
    t.bytes += o.bytes;
    t.busy_seconds += o.busy_seconds;
    t.exposed_seconds += o.exposed_seconds;
  };
  if (factors_) add(factors_->total());
  if (zero_) add(zero_->total());
  const double steps = static_cast<double>(std::max<int64_t>(t.steps, 1));
  c.bytes_per_step = static_cast<double>(t.bytes) / steps;
  c.seconds_per_step = t.busy_seconds / steps;
  c.exposed_seconds_per_step = t.exposed_seconds / steps;
  if (factors_)
    for (const nn::Module::NamedTensor& w : factors_->weights()) c.factored.push_back(w.name);
  return c;
}

}  // namespace mantissa::train

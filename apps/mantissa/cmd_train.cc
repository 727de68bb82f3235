// `mantissa train`, `eval` and `memory`: the trainer (src/mantissa/train) from the command line.
#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <iterator>
#include <map>
#include <optional>
#include <ostream>
#include <string>

#include "mantissa/cli.h"
#include "mantissa/flags.h"
#include "mantissa/mantissa.h"

namespace mantissa::cli {
namespace {

constexpr const char* kTrainUsage =
    "usage: mantissa train [options]\n"
    "Trains a model and prints one line per epoch, then the test accuracy. Defaults reproduce the\n"
    "PopTorch half-precision tutorial: tutorial-cnn on Fashion-MNIST at 128x128, AdamW lr 1e-3,\n"
    "batch 12, one epoch. An option that would have no effect with the others (an Adam option\n"
    "under SGD, --prefetch without --async-dataloader, ...) is refused, naming the conflict.\n"
    "model and data:\n"
    "  --model NAME          tutorial-cnn (default), lenet5, resnet18, resnet34, resnet50, "
    "resnet101\n"
    "  --imagenet-stem       ResNets: 7x7/2 convolution and max pool (default: CIFAR 3x3/1 stem)\n"
    "  --dataset NAME        fashion-mnist (default), mnist, cifar10, synthetic\n"
    "  --data-dir DIR        where the dataset's files are (default: fashion-mnist\n"
    "                        /usr/share/datasets/fashion-mnist, cifar10 "
    "data/cifar-10-batches-bin)\n"
    "  --image-size N        resize images to NxN (bilinear; default: 128 for tutorial-cnn, else "
    "32)\n"
    "  --train-limit N       train on the first N examples only\n"
    "  --test-limit N        test on the first N examples only\n"
    "  --synthetic-size N    training examples of --dataset synthetic (default 2048)\n"
    "  --no-shuffle          keep the dataset's order (default: shuffled, seeded)\n"
    "  --augment             random crop (padding 4) and horizontal flip\n"
    "training:\n"
    "  --batch-size N        (default 12)        --eval-batch-size N (default 32)\n"
    "  --epochs N            (default 1)         --max-steps N  stop after N optimizer steps\n"
    "                        (counted from the run's start; or at the end of --epochs, if sooner)\n"
    "  --optimizer NAME      sgd, adam, adamw (default)\n"
    "  --lr X                learning rate (default 1e-3)\n"
    "  --weight-decay X      (default: 0.01 for adamw, 0 for sgd and adam)\n"
    "  --momentum X          SGD momentum (default 0)   --nesterov   Nesterov momentum (SGD)\n"
    "  --beta1 X --beta2 X --eps X   Adam/AdamW (defaults 0.9, 0.999, 1e-8)\n"
    "  --no-bias-correction  Adam/AdamW without the 1 - beta^t bias corrections\n"
    "  --max-grad-norm X     clip gradients to this global 2-norm (default: no clipping)\n"
    "  --lr-schedule NAME    constant (default), step, cosine\n"
    "  --warmup-steps N      linear warm-up    --lr-step-size N --lr-gamma X  (step schedule)\n"
    "  --seed N              seed of initialisation, shuffling, augmentation, dropout and\n"
    "                        stochastic rounding (default 0)\n"
    "  --threads N           compute threads (default: all cores; under mpirun, per rank: the\n"
    "                        host's cores divided among its ranks)\n"
    "pipeline (docs/ipu_guide.md):\n"
    "  --gradient-accumulation N   N micro-batches of --batch-size per optimizer step\n"
    "  --accumulation-reduction R  with N > 1: mean (default: sum, then / N), running (running\n"
    "                        mean, cannot overflow 16-bit accumulators), sum\n"
    "  --device-iterations K optimizer steps per call of the training step (one hand-over of\n"
    "                        K x N batches, one return of outputs)\n"
    "  --output-mode M       with K > 1, what a call returns: final (default), all, sum, every\n"
    "  --output-return-period N   with --output-mode every: every N-th step\n"
    "  --eight-bit-io        the loader hands over uint8 images; the model's first op\n"
    "                        normalizes them and casts to the compute type\n"
    "  --recompute           recompute each ResNet block's activations in the backward pass\n"
    "                        (keeps only block inputs: less memory, one more forward)\n"
    "  --async-dataloader    background workers prepare batches while the step runs\n"
    "  --workers N           workers of the asynchronous loader (default 1; implies it)\n"
    "  --prefetch N          batches the workers make ahead at most (default 2; at least 1)\n"
    "precision (docs/mixed_precision.md):\n"
    "  --precision NAME      32-true (default), 16-mixed, bf16-mixed, 16-true, bf16-true, O0, O1,\n"
    "                        O2, O3, 32.32, 16.32, 16.16, fp8-hybrid, fp8-e4m3\n"
    "  --half-type T         fp16 (default) or bf16 for O1-O3, 16.32, 16.16\n"
    "  --keep-fp32 A,B       run these modules in FP32 (e.g. norm,fc2)\n"
    "  --half-modules A,B    run these modules in the 16-bit type\n"
    "  --autocast-lower-list FILE  --autocast-fp32-list FILE   replace the op lists of the\n"
    "                        mixed modes (one op name per line)\n"
    "  --autocast-log        print each cast decision once (op, module, from -> to)\n"
    "  --loss-scaling S      none, dynamic, or a static scale such as 1024 (default: the mode's)\n"
    "  a dynamic scale's options:\n"
    "  --loss-scale-init X   the first scale (default 65536); from:FILE starts at the scale a\n"
    "                        --numerics-report FILE suggests\n"
    "  --loss-scale-min X --loss-scale-max X   clamps\n"
    "  --loss-scale-growth-interval N (default 2000)   --loss-scale-hysteresis N (default 1)\n"
    "  --stochastic-rounding the optimizer writes 16-bit parameters and state stochastically\n"
    "                        (the mode or the flags must keep some in 16 bits)\n"
    "  --stochastic-outputs  every 16-bit op output is rounded stochastically too\n"
    "  --kahan               Kahan-compensated updates of 16-bit parameters (2 bytes each;\n"
    "                        bf16-true, 16-true, 16.16, O3)\n"
    "  --partials T          accumulation type of matmul and convolution: fp32 (default), or\n"
    "                        fp16 (rounded to FP16 every 16 products; docs/mixed_precision.md)\n"
    "  --accum-type T        gradient type (default: the parameter's)\n"
    "  --first-moment-type T --second-moment-type T   optimizer state: fp32, fp16, bf16\n"
    "FP8 (fp8-hybrid: E4M3 inputs and weights, E5M2 gradients; fp8-e4m3: E4M3 for all):\n"
    "  --fp8-scaling S       delayed (default: scale from the amax history) or current\n"
    "  --fp8-amax-history N  steps of amax kept (default 1024)\n"
    "  --fp8-amax-algo A     max (default) or most-recent\n"
    "  --fp8-margin M        scale = (format max / amax) / 2^M (default 0)\n"
    "  --fp8-keep-layers L   layers left in bf16: first, last, module paths, or none\n"
    "                        (default first,last: the first and last conv/linear layers)\n"
    "debugging:\n"
    "  --detect-anomaly      check every op's output and gradient for inf/NaN; stop at the\n"
    "                        first with the op, module, dtype and input statistics (exit 4)\n"
    "  --numerics-report FILE  log2 histograms of each layer's activations and gradients, the\n"
    "                        fractions that overflow or flush to zero in FP16 and BF16, and a\n"
    "                        suggested loss scale: JSON to FILE, HTML beside it\n"
    "  --numerics-every N    with --numerics-report: step 1 and every N-th step (default 50)\n"
    "  --no-update-in-backward  keep every gradient and update the parameters after the\n"
    "                        backward pass (by default a step that needs nothing global\n"
    "                        updates each parameter when its gradient is known: same values)\n"
    "  --profile             time every layer's forward, every op's backward and every\n"
    "                        parameter's update; print milliseconds a step by phase and op\n"
    "memory:\n"
    "  --memory-budget SIZE  behave as a device with this much memory (e.g. 512MiB, 1.5GiB):\n"
    "                        past it, an out-of-memory report and exit status 3\n"
    "files:\n"
    "  --init-from FILE      initial weights from a safetensors file with PyTorch names\n"
    "  --save FILE           write a checkpoint (weights, optimizer and loss-scaler state, the\n"
    "                        step) at each epoch's end and at the end, atomically\n"
    "  --resume FILE         continue a run from a checkpoint, bit-exactly: the seed, batch size,\n"
    "                        data and precision settings must be the checkpoint's; a changed\n"
    "                        --lr or other optimizer option is named as changing the run\n"
    "  --metrics-json FILE   write losses, per-epoch figures, accuracy, speed and peak memory\n"
    "  --report FILE.html    a self-contained page of the run (opens offline): loss, accuracy,\n"
    "                        loss scale, skipped steps and step time over the run, the\n"
    "                        precision settings and memory by category\n"
    "output:\n"
    "  --no-progress         no progress bar on standard error\n"
    "  --no-eval             skip the test set (then --eval-batch-size and --test-limit are "
    "refused)\n"
    "  --print-model         print the model (layers, parameter names, shapes, dtypes) first\n"
    "data parallelism (under mpirun -np N or srun; docs/distributed.md):\n"
    "  --batch-size is per rank: the global batch is N x batch, rank r trains on its r-th slice\n"
    "  --bucket-size MIB     gradients travel in buckets of at most MIB (default 25)\n"
    "  --allreduce-dtype T   the gradients' type on the wire: fp32 (default), fp16, bf16\n"
    "  --sync-batchnorm      batch-norm statistics over the global batch (default: each rank's,\n"
    "                        with rank 0's running statistics kept on every rank)\n"
    "  --zero 1              shard the optimizer state and master weights across the ranks\n"
    "  --no-sufficient-factors  all-reduce every gradient (default: a linear layer of at least\n"
    "                        2^18 weights whose inputs and output gradients over the global batch\n"
    "                        are at most half its weight gathers those instead, each rank forming\n"
    "                        the gradient)\n"
    "  --check-replicas      after every step, check that every rank holds the same weights\n";

constexpr const char* kEvalUsage =
    "usage: mantissa eval --checkpoint FILE [--dataset NAME] [--data-dir DIR] [--test-limit N]\n"
    "                     [--batch-size N] [--threads N]\n"
    "Evaluates a checkpoint written by 'mantissa train --save' on a dataset's test split (by\n"
    "default the dataset it was trained on) and prints the accuracy and mean loss.\n";

constexpr const char* kMemoryUsage =
    "usage: mantissa memory [--model NAME] [--batch-size N] [--precision P [--precision P2 ...]]\n"
    "                       [options] [--json FILE] [--html FILE]\n"
    "Measures what one training step holds (it runs one step on synthetic data of the model's\n"
    "shape; no dataset, nothing saved): memory at the peak by category and by layer, each\n"
    "category's own peak, and memory over the step (liveness), for each precision given (the\n"
    "PopTorch seed's FP32-against-FP16 comparison: --precision 32-true --precision 16-true).\n"
    "options:\n"
    "  --model NAME --batch-size N --image-size N --imagenet-stem --optimizer NAME\n"
    "  --precision P         repeatable (default 32-true)   --half-type fp16|bf16\n"
    "  --loss-scaling none|dynamic|S  instead of the mode's (every precision)\n"
    "  --gradient-accumulation N  --device-iterations K  --eight-bit-io  --recompute\n"
    "  --kahan               Kahan compensation (optimizer state; every --precision 16-bit)\n"
    "  --memory-budget SIZE  say whether each precision fits (exit status 3 if one does not)\n"
    "  --ranks N             also what each rank of an N-rank data-parallel job holds, with and\n"
    "                        without --zero 1 (computed from this step and the layout of the\n"
    "                        gradient buckets and shards; --bucket-size MIB, --allreduce-dtype T)\n"
    "                        measured with the threads each of N ranks on this host takes (its\n"
    "                        cores / N) unless --threads is given\n"
    "  --json FILE           the figures, with the liveness timeline\n"
    "  --html FILE           a self-contained page with SVG charts (opens offline)\n"
    "  --threads N\n";

// ---- Signals ----
//
// SIGINT (Ctrl-C), SIGTERM (what Slurm, Kubernetes and systemd send before killing) and SIGHUP
// ask the run to stop at the next step boundary (train::request_stop): the checkpoint (--save)
// and metrics are written, the loader's workers end, and the program exits with 128 + the
// signal's number. A second signal of the three ends the program at once, by the signal's own
// default action. The handler only stores a number and calls request_stop(), both
// async-signal-safe; the second one restores the default action and raises the signal again,
// which is delivered when the handler returns (it is blocked while the handler runs).
// Under an MPI launcher the same: Open MPI's mpirun, given Ctrl-C (SIGINT) or SIGTERM, sends its
// ranks SIGCONT, then SIGTERM after odls_base_sigkill_timeout seconds (default 1), then SIGKILL
// after as many again; the ranks agree on the step to stop at (the trainer's per-call collective)
// and rank 0 writes the checkpoint (docs/distributed.md).
volatile std::sig_atomic_t g_stop_signal = 0;
constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP};

extern "C" void on_stop_signal(int sig) {
  if (g_stop_signal != 0) {
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  g_stop_signal = sig;
  train::request_stop();
}

// The handlers for the lifetime of a run (the previous ones come back after it). Installed before
// the data is loaded, so an early signal stops the run before its first step.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    for (int s : kStopSignals) sigaddset(&sa.sa_mask, s);
    for (size_t i = 0; i < std::size(kStopSignals); ++i)
      sigaction(kStopSignals[i], &sa, &previous_[i]);
  }
  ~StopSignals() {
    for (size_t i = 0; i < std::size(kStopSignals); ++i)
      sigaction(kStopSignals[i], &previous_[i], nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  // The signal that stopped the run, 0 for none.
  int received() const { return g_stop_signal; }

 private:
  struct sigaction previous_[std::size(kStopSignals)]{};
};

}  // namespace

TrainArgs parse_train_args(const std::vector<std::string>& args) {
  TrainArgs parsed;
  train::TrainConfig& c = parsed.config;
  const auto str = str_flag;
  const auto i64 = int_flag;
  const auto dbl = num_flag;
  const auto opt_dbl = opt_num_flag;
  const auto list = list_flag;
  const auto on = switch_flag;
  int64_t prefetch = c.prefetch, workers = c.workers;
  bool fp8_keep_given = false;
  std::map<std::string, Flag> flags = {
      {"--help", on(parsed.help, true)},
      {"--model", str("--model", c.model)},
      {"--imagenet-stem", on(c.imagenet_stem, true)},
      {"--dataset", str("--dataset", c.dataset)},
      {"--data-dir", str("--data-dir", c.data_dir)},
      {"--image-size", i64("--image-size", c.image_size, 1)},
      {"--train-limit", i64("--train-limit", c.train_limit, 1)},
      {"--test-limit", i64("--test-limit", c.test_limit, 1)},
      {"--synthetic-size", i64("--synthetic-size", c.synthetic_size, 1)},
      {"--no-shuffle", on(c.shuffle, false)},
      {"--augment", on(c.augment, true)},
      {"--batch-size", i64("--batch-size", c.batch_size, 1)},
      {"--eval-batch-size", i64("--eval-batch-size", c.eval_batch_size, 1)},
      {"--epochs", i64("--epochs", c.epochs, 1)},
      {"--max-steps", i64("--max-steps", c.max_steps, 1)},
      {"--optimizer", str("--optimizer", c.optimizer)},
      {"--lr", dbl("--lr", c.lr)},
      {"--weight-decay", opt_dbl("--weight-decay", c.weight_decay)},
      {"--momentum", dbl("--momentum", c.momentum)},
      {"--nesterov", on(c.nesterov, true)},
      {"--beta1", dbl("--beta1", c.beta1)},
      {"--beta2", dbl("--beta2", c.beta2)},
      {"--eps", dbl("--eps", c.eps)},
      {"--no-bias-correction", on(c.bias_correction, false)},
      {"--max-grad-norm", dbl("--max-grad-norm", c.max_grad_norm)},
      {"--lr-schedule", str("--lr-schedule", c.lr_schedule)},
      {"--warmup-steps", i64("--warmup-steps", c.warmup_steps, 0)},
      {"--lr-step-size", i64("--lr-step-size", c.lr_step_size, 1)},
      {"--lr-gamma", dbl("--lr-gamma", c.lr_gamma)},
      {"--seed", Flag{true, [&c](const std::string& v) { c.seed = seed_value("--seed", v); }}},
      {"--threads", threads_flag(c.threads)},
      {"--prefetch", i64("--prefetch", prefetch, 0)},
      {"--gradient-accumulation", i64("--gradient-accumulation", c.gradient_accumulation, 1)},
      {"--accumulation-reduction", str("--accumulation-reduction", c.accumulation_reduction)},
      {"--device-iterations", i64("--device-iterations", c.device_iterations, 1)},
      {"--output-mode", str("--output-mode", c.output_mode)},
      {"--output-return-period", i64("--output-return-period", c.output_return_period, 1)},
      {"--async-dataloader", on(c.async_loader, true)},
      {"--eight-bit-io", on(c.eight_bit_io, true)},
      {"--detect-anomaly", on(c.detect_anomaly, true)},
      {"--profile", on(c.profile, true)},
      {"--no-update-in-backward", on(c.update_in_backward, false)},
      {"--recompute", on(c.recompute, true)},
      {"--numerics-report", str("--numerics-report", c.numerics_report)},
      {"--numerics-every", i64("--numerics-every", c.numerics_every, 1)},
      {"--workers", Flag{true,
                         [&](const std::string& v) {
                           workers = int_value("--workers", v, 1);
                           c.async_loader = true;
                         }}},
      {"--precision", str("--precision", c.precision)},
      {"--half-type", str("--half-type", c.half_type)},
      {"--keep-fp32", list("--keep-fp32", c.keep_fp32)},
      {"--half-modules", list("--half-modules", c.half_modules)},
      {"--autocast-lower-list", str("--autocast-lower-list", c.autocast_lower_list)},
      {"--autocast-fp32-list", str("--autocast-fp32-list", c.autocast_fp32_list)},
      {"--autocast-log", on(c.autocast_log, true)},
      {"--loss-scaling", str("--loss-scaling", c.loss_scaling)},
      {"--loss-scale-init", Flag{true,
                                 [&](const std::string& v) {
                                   // from:FILE reads a numerics report's suggested scale.
                                   if (v.rfind("from:", 0) == 0) {
                                     c.loss_scale_init_report = v.substr(5);
                                     if (c.loss_scale_init_report.empty())
                                       throw UsageError(
                                           "--loss-scale-init from: needs a file name "
                                           "(the JSON --numerics-report wrote)");
                                   } else {
                                     c.loss_scale_init = number_value("--loss-scale-init", v);
                                   }
                                 }}},
      {"--loss-scale-min", opt_dbl("--loss-scale-min", c.loss_scale_min)},
      {"--loss-scale-max", opt_dbl("--loss-scale-max", c.loss_scale_max)},
      {"--loss-scale-growth-interval",
       i64("--loss-scale-growth-interval", c.loss_scale_growth_interval, 1)},
      {"--loss-scale-hysteresis", i64("--loss-scale-hysteresis", c.loss_scale_hysteresis, 1)},
      {"--stochastic-rounding", on(c.stochastic_rounding, true)},
      {"--stochastic-outputs", on(c.stochastic_outputs, true)},
      {"--kahan", on(c.kahan, true)},
      {"--partials", str("--partials", c.partials)},
      {"--fp8-scaling", str("--fp8-scaling", c.fp8_scaling)},
      {"--fp8-amax-history", i64("--fp8-amax-history", c.fp8_amax_history, 1)},
      {"--fp8-amax-algo", str("--fp8-amax-algo", c.fp8_amax_algo)},
      {"--fp8-margin", i64("--fp8-margin", c.fp8_margin, 0)},
      {"--fp8-keep-layers", Flag{true,
                                 [&](const std::string& v) {
                                   // The first use replaces the default (first,last).
                                   if (!fp8_keep_given) c.fp8_keep_layers.clear();
                                   fp8_keep_given = true;
                                   list("--fp8-keep-layers", c.fp8_keep_layers).apply(v);
                                 }}},
      {"--accum-type", str("--accum-type", c.accum_type)},
      {"--first-moment-type", str("--first-moment-type", c.first_moment_type)},
      {"--second-moment-type", str("--second-moment-type", c.second_moment_type)},
      {"--memory-budget", str("--memory-budget", c.memory_budget)},
      {"--init-from", str("--init-from", c.init_from)},
      {"--save", str("--save", c.save)},
      {"--resume", str("--resume", c.resume)},
      {"--metrics-json", str("--metrics-json", c.metrics_json)},
      {"--report", str("--report", c.report)},
      {"--no-progress", on(c.progress, false)},
      {"--no-eval", on(c.evaluate, false)},
      {"--print-model", on(parsed.print_model, true)},
      {"--bucket-size", dbl("--bucket-size", c.bucket_size_mib)},
      {"--allreduce-dtype", str("--allreduce-dtype", c.allreduce_dtype)},
      {"--sync-batchnorm", on(c.sync_batchnorm, true)},
      {"--zero", i64("--zero", c.zero, 0)},
      {"--check-replicas", on(c.check_replicas, true)},
      {"--no-sufficient-factors", on(c.sufficient_factors, false)},
  };
  parse_flags(args, flags, "train");
  // TrainConfig holds them as int; past 64 (resolve's limit) the value only has to stay past it.
  c.prefetch = static_cast<int>(std::min<int64_t>(prefetch, 65));
  c.workers = static_cast<int>(std::min<int64_t>(workers, 65));
  return parsed;
}

int run_train(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  const TrainArgs a = parse_train_args(args);
  if (a.help) {
    out << kTrainUsage;
    return kExitOk;
  }
  const StopSignals signals;
  const train::TrainConfig& c = a.config;
  if (comm::launched_by_mpi() && !c.save.empty() && comm::world().rank() == 0 &&
      !std::getenv("OMPI_MCA_odls_base_sigkill_timeout") && std::getenv("OMPI_COMM_WORLD_SIZE"))
    err << "mantissa: note: mpirun ends its ranks 1 s after passing on Ctrl-C; to leave time for "
           "the checkpoint, start it with --mca odls_base_sigkill_timeout 30\n";
  train::Trainer trainer(c, {&out, &err});
  if (a.print_model) out << trainer.model().summary() << std::endl;
  const train::TrainResult r = trainer.run();
  // A signal that came after the last step (during the last save or the evaluation) ends the run
  // as it would have at a step boundary: the outputs are written, and the status says so.
  // A stop requested in the process without a signal (train::request_stop) reads as Ctrl-C.
  if (signals.received() != 0) return kExitSignalBase + signals.received();
  return r.interrupted ? kExitSignalBase + SIGINT : kExitOk;
}

EvalArgs parse_eval_args(const std::vector<std::string>& args) {
  EvalArgs e;
  std::map<std::string, Flag> flags = {
      {"--help", switch_flag(e.help)},
      {"--checkpoint", str_flag("--checkpoint", e.checkpoint)},
      {"--dataset", str_flag("--dataset", e.dataset)},
      {"--data-dir", str_flag("--data-dir", e.data_dir)},
      {"--test-limit", int_flag("--test-limit", e.test_limit, 1)},
      {"--batch-size", int_flag("--batch-size", e.batch_size, 1)},
      {"--threads", threads_flag(e.threads)},
  };
  parse_flags(args, flags, "eval");
  if (!e.help && e.checkpoint.empty())
    throw UsageError(
        "'mantissa eval' needs --checkpoint FILE (written by 'mantissa train --save')");
  return e;
}

int run_eval(const std::vector<std::string>& args, std::ostream& out) {
  const EvalArgs e = parse_eval_args(args);
  if (e.help) {
    out << kEvalUsage;
    return kExitOk;
  }
  refuse_ranks("eval", "run it without mpirun: one process evaluates the checkpoint");
  set_num_threads(e.threads);
  const train::EvalResult r =
      train::evaluate_checkpoint(e.checkpoint, e.dataset, e.data_dir, e.test_limit, e.batch_size);
  char line[256];
  std::snprintf(line, sizeof line, "%s: test accuracy %.2f%% (%lld images), mean loss %.4f\n",
                r.model.c_str(), r.accuracy * 100, static_cast<long long>(r.examples), r.loss);
  out << line;
  return kExitOk;
}

MemoryArgs parse_memory_args(const std::vector<std::string>& args) {
  MemoryArgs m;
  train::TrainConfig& c = m.config;
  std::map<std::string, Flag> flags = {
      {"--help", switch_flag(m.help)},
      {"--model", str_flag("--model", c.model)},
      {"--batch-size", int_flag("--batch-size", c.batch_size, 1)},
      {"--image-size", int_flag("--image-size", c.image_size, 1)},
      {"--imagenet-stem", switch_flag(c.imagenet_stem)},
      {"--optimizer", str_flag("--optimizer", c.optimizer)},
      {"--precision", Flag{true,
                           [&](const std::string& v) {
                             if (v.empty()) throw UsageError("--precision needs a value");
                             m.precisions.push_back(v);
                           }}},
      {"--half-type", str_flag("--half-type", c.half_type)},
      {"--loss-scaling", str_flag("--loss-scaling", c.loss_scaling)},
      {"--gradient-accumulation", int_flag("--gradient-accumulation", c.gradient_accumulation, 1)},
      {"--device-iterations", int_flag("--device-iterations", c.device_iterations, 1)},
      {"--eight-bit-io", switch_flag(c.eight_bit_io)},
      {"--recompute", switch_flag(c.recompute)},
      {"--kahan", switch_flag(c.kahan)},
      {"--memory-budget", str_flag("--memory-budget", c.memory_budget)},
      {"--json", str_flag("--json", m.json_path)},
      {"--html", str_flag("--html", m.html_path)},
      {"--threads", threads_flag(c.threads)},
      {"--ranks", int_flag("--ranks", m.ranks, 1)},
      {"--bucket-size", num_flag("--bucket-size", c.bucket_size_mib)},
      {"--allreduce-dtype", str_flag("--allreduce-dtype", c.allreduce_dtype)},
  };
  parse_flags(args, flags, "memory");
  if (m.precisions.empty()) m.precisions.push_back(c.precision);
  return m;
}

int run_memory(const std::vector<std::string>& args, std::ostream& out) {
  const MemoryArgs m = parse_memory_args(args);
  if (m.help) {
    out << kMemoryUsage;
    return kExitOk;
  }
  refuse_ranks("memory", "run it in one process, with --ranks N for what each of N ranks holds");
  train::TrainConfig c = m.config;
  // With --ranks N the step is measured with the threads each of N ranks on this host would take
  // (per-thread buffers grow with the threads), unless --threads says otherwise.
  if (m.ranks > 1) c.threads = train::rank_threads(c.threads, static_cast<int>(m.ranks));
  // Checked with the first precision (each is checked again when measured): the settings that
  // hold for one precision only (--kahan) then see it.
  train::TrainConfig first = c;
  first.precision = m.precisions.front();
  const train::RunSettings settings = train::resolve(first);
  io::check_distinct_outputs({{"--json", m.json_path}, {"--html", m.html_path}});
  io::check_output_path(m.json_path, "--json");
  io::check_output_path(m.html_path, "--html");
  std::vector<train::TrainConfig> configs;
  for (const std::string& p : m.precisions) {
    configs.push_back(c);
    configs.back().precision = p;
  }
  // Each as a fresh process would hold it; with several ranks measured as one rank runs it
  // (updates after the backward pass).
  const std::vector<train::StepMemory> runs =
      train::profile_steps(configs, m.ranks > 1 ? static_cast<int>(m.ranks) : 1);
  std::vector<train::RankMemory> per_rank;
  if (m.ranks > 0)
    for (const train::StepMemory& r : runs)
      per_rank.push_back(train::rank_memory(r, static_cast<int>(m.ranks), c.bucket_size_mib,
                                            settings.allreduce_dtype));
  out << "memory of one training step: " << c.model << ", batch " << c.batch_size << ", "
      << c.effective_image_size() << "x" << c.effective_image_size() << ", " << c.optimizer
      << (c.gradient_accumulation > 1
              ? ", gradient accumulation " + std::to_string(c.gradient_accumulation)
              : std::string())
      << (c.recompute ? ", recomputation" : "")
      << (m.ranks > 1 ? ", " + std::to_string(default_num_threads()) +
                            (default_num_threads() == 1 ? " thread" : " threads") + " a rank of " +
                            std::to_string(m.ranks) + " on this host"
                      : std::string())
      << "\n"
      << train::memory_text(runs, 12, per_rank);
  if (!m.json_path.empty())
    io::write_file_atomic(m.json_path, train::memory_json(c, runs, per_rank));
  if (!m.html_path.empty()) io::write_file_atomic(m.html_path, train::memory_html(c, runs));
  for (const train::StepMemory& r : runs)
    if (!r.fits) return kExitOutOfMemory;
  return kExitOk;
}

}  // namespace mantissa::cli

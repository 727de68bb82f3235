// `mantissa train` and `mantissa eval`: the trainer (src/mantissa/train) from the command line.
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <ostream>
#include <string>

#include "mantissa/cli.h"
#include "mantissa/mantissa.h"

namespace mantissa::cli {
namespace {

constexpr const char* kTrainUsage =
    "usage: mantissa train [options]\n"
    "Trains a model and prints one line per epoch, then the test accuracy. Defaults reproduce the\n"
    "PopTorch half-precision tutorial: tutorial-cnn on Fashion-MNIST at 128x128, AdamW lr 1e-3,\n"
    "batch 12, one epoch.\n"
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
    "  --synthetic-size N    training examples of the synthetic dataset (default 2048)\n"
    "  --no-shuffle          keep the dataset's order (default: shuffled, seeded)\n"
    "  --augment             random crop (padding 4) and horizontal flip\n"
    "training:\n"
    "  --batch-size N        (default 12)        --eval-batch-size N (default 32)\n"
    "  --epochs N            (default 1)         --max-steps N  stop after N optimizer steps\n"
    "  --optimizer NAME      sgd, adam, adamw (default)\n"
    "  --lr X                learning rate (default 1e-3)\n"
    "  --weight-decay X      (default: 0.01 for adamw, 0 for sgd and adam)\n"
    "  --momentum X          SGD momentum (default 0)   --nesterov   Nesterov momentum\n"
    "  --beta1 X --beta2 X --eps X   Adam/AdamW (defaults 0.9, 0.999, 1e-8)\n"
    "  --no-bias-correction  Adam/AdamW without the 1 - beta^t bias corrections\n"
    "  --max-grad-norm X     clip gradients to this global 2-norm (default: no clipping)\n"
    "  --lr-schedule NAME    constant (default), step, cosine\n"
    "  --warmup-steps N      linear warm-up    --lr-step-size N --lr-gamma X  (step schedule)\n"
    "  --seed N              seed of initialisation, shuffling and augmentation (default 0)\n"
    "  --threads N           compute threads (default: all cores; under mpirun, per rank: the\n"
    "                        host's cores divided among its ranks)\n"
    "pipeline (docs/ipu_guide.md):\n"
    "  --gradient-accumulation N   N micro-batches of --batch-size per optimizer step\n"
    "  --accumulation-reduction R  mean (default: sum, then / N), running (running mean, cannot\n"
    "                        overflow 16-bit accumulators), sum\n"
    "  --device-iterations K optimizer steps per call of the training step (one hand-over of\n"
    "                        K x N batches, one return of outputs)\n"
    "  --output-mode M       what a call returns: final (default), all, sum, every\n"
    "  --output-return-period N   with --output-mode every: every N-th step\n"
    "  --eight-bit-io        the loader hands over uint8 images; the model's first op\n"
    "                        normalizes them and casts to the compute type\n"
    "  --recompute           recompute each ResNet block's activations in the backward pass\n"
    "                        (keeps only block inputs: less memory, one more forward)\n"
    "  --async-dataloader    background workers prepare batches while the step runs\n"
    "  --workers N           workers of the asynchronous loader (default 1; implies it)\n"
    "  --prefetch N          batches the workers make ahead at most (default 2)\n"
    "precision (docs/mixed_precision.md):\n"
    "  --precision NAME      32-true (default), 16-mixed, bf16-mixed, 16-true, bf16-true, O0, O1,\n"
    "                        O2, O3, 32.32, 16.32, 16.16, fp8-hybrid, fp8-e4m3\n"
    "  --half-type T         fp16 (default) or bf16 for O1-O3, 16.32, 16.16\n"
    "  --keep-fp32 A,B       run these modules in FP32 (e.g. norm,fc2)\n"
    "  --half-modules A,B    run these modules in the 16-bit type\n"
    "  --autocast-lower-list FILE  --autocast-fp32-list FILE   replace the op lists (one op\n"
    "                        name per line)\n"
    "  --autocast-log        print each cast decision once (op, module, from -> to)\n"
    "  --loss-scaling S      none, dynamic, or a static scale such as 1024 (default: the mode's)\n"
    "  --loss-scale-init X --loss-scale-min X --loss-scale-max X\n"
    "  --loss-scale-growth-interval N (default 2000)   --loss-scale-hysteresis N (default 1)\n"
    "  --stochastic-rounding optimizer writes 16-bit parameters and state stochastically\n"
    "  --stochastic-outputs  every 16-bit op output is rounded stochastically too\n"
    "  --kahan               Kahan-compensated updates of 16-bit parameters (2 bytes each;\n"
    "                        bf16-true, 16-true, 16.16, O3)\n"
    "  --partials T          accumulation type of matmul and convolution: fp32 (default), fp16\n"
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
    "  --numerics-every N    record step 1 and every N-th step (default 50)\n"
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
    "  --save FILE           write a checkpoint (weights, optimizer and RNG state) atomically\n"
    "  --resume FILE         continue a run from a checkpoint, bit-exactly\n"
    "  --metrics-json FILE   write losses, per-epoch figures, accuracy, speed and peak memory\n"
    "  --report FILE.html    a self-contained page of the run (opens offline): loss, accuracy,\n"
    "                        loss scale, skipped steps and step time over the run, the\n"
    "                        precision settings and memory by category\n"
    "output:\n"
    "  --no-progress         no progress bar on standard error   --no-eval  skip the test set\n"
    "  --print-model         print the model (layers, parameter names, shapes, dtypes) first\n"
    "data parallelism (under mpirun -np N or srun; docs/distributed.md):\n"
    "  --batch-size is per rank: the global batch is N x batch, rank r trains on its r-th slice\n"
    "  --bucket-size MIB     gradients travel in buckets of at most MIB (default 25)\n"
    "  --allreduce-dtype T   the gradients' type on the wire: fp32 (default), fp16, bf16\n"
    "  --sync-batchnorm      batch-norm statistics over the global batch (default: each rank's,\n"
    "                        with rank 0's running statistics kept on every rank)\n"
    "  --zero 1              shard the optimizer state and master weights across the ranks\n"
    "  --check-replicas      after every step, check that every rank holds the same weights\n";

constexpr const char* kEvalUsage =
    "usage: mantissa eval --checkpoint FILE [--dataset NAME] [--data-dir DIR] [--test-limit N]\n"
    "                     [--batch-size N] [--threads N]\n"
    "Evaluates a checkpoint written by 'mantissa train --save' on a dataset's test split (by\n"
    "default the dataset it was trained on) and prints the accuracy and mean loss.\n";

// A flag table: name -> whether it takes a value, and what to do with it.
struct Flag {
  bool takes_value;
  std::function<void(const std::string&)> apply;
};

void parse_flags(const std::vector<std::string>& args, const std::map<std::string, Flag>& flags,
                 const char* command) {
  for (size_t i = 0; i < args.size(); ++i) {
    std::string a = args[i], value;
    const size_t eq = a.find('=');
    bool inline_value = false;
    if (a.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
      inline_value = true;
    }
    auto it = flags.find(a);
    if (it == flags.end())
      throw UsageError("unknown option '" + a + "' for 'mantissa " + command + "'; run 'mantissa " +
                       command + " --help' for the list");
    if (it->second.takes_value && !inline_value) {
      if (i + 1 >= args.size()) throw UsageError(a + " needs a value");
      value = args[++i];
    } else if (!it->second.takes_value && inline_value) {
      throw UsageError(a + " takes no value");
    }
    it->second.apply(value);
  }
}

int64_t to_int(const std::string& flag, const std::string& v, int64_t min) {
  unsigned long long x = 0;
  if (!parse_u64(v, x) || x > (1ull << 62) || static_cast<int64_t>(x) < min)
    throw UsageError(flag + " '" + v + "' is not an integer >= " + std::to_string(min));
  return static_cast<int64_t>(x);
}

double to_double(const std::string& flag, const std::string& v) {
  float f = 0;
  if (!parse_float(v, f) || !std::isfinite(f))
    throw UsageError(flag + " '" + v + "' is not a number");
  try {
    return std::stod(v);
  } catch (const std::exception&) {
    throw UsageError(flag + " '" + v + "' is not a number");
  }
}

// Flags that set a field: a string, an integer >= min, a number, an optional number, a
// comma-separated list, or a switch that stores `value`.
Flag str_flag(std::string& dst) {
  return Flag{true, [&dst](const std::string& v) { dst = v; }};
}
Flag int_flag(const char* name, int64_t& dst, int64_t min) {
  return Flag{true, [name, &dst, min](const std::string& v) { dst = to_int(name, v, min); }};
}
Flag num_flag(const char* name, double& dst) {
  return Flag{true, [name, &dst](const std::string& v) { dst = to_double(name, v); }};
}
Flag opt_num_flag(const char* name, std::optional<double>& dst) {
  return Flag{true, [name, &dst](const std::string& v) { dst = to_double(name, v); }};
}
Flag list_flag(std::vector<std::string>& dst) {
  return Flag{true, [&dst](const std::string& v) {
                size_t b = 0;
                while (b <= v.size()) {
                  const size_t e = std::min(v.find(',', b), v.size());
                  if (e > b) dst.push_back(v.substr(b, e - b));
                  b = e + 1;
                }
              }};
}
Flag switch_flag(bool& dst, bool value = true) {
  return Flag{false, [&dst, value](const std::string&) { dst = value; }};
}

// A command that runs in one process, refused when an MPI launcher started several.
void refuse_ranks(const char* command, const char* fix) {
  if (comm::launched_by_mpi() && comm::world().size() > 1)
    throw UsageError(std::string("'mantissa ") + command + "' does not run over " +
                     std::to_string(comm::world().size()) + " processes: " + fix);
}

}  // namespace

int run_train(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  train::TrainConfig c;
  bool print_model = false, help = false;
  const auto str = str_flag;
  const auto i64 = int_flag;
  const auto dbl = num_flag;
  const auto opt_dbl = opt_num_flag;
  const auto list = list_flag;
  const auto on = switch_flag;
  int64_t threads = 0, prefetch = 2, workers = 1;
  bool fp8_keep_given = false;
  int64_t seed = 0;
  double wd = 0;
  bool wd_given = false;
  std::map<std::string, Flag> flags = {
      {"--help", on(help, true)},
      {"--model", str(c.model)},
      {"--imagenet-stem", on(c.imagenet_stem, true)},
      {"--dataset", str(c.dataset)},
      {"--data-dir", str(c.data_dir)},
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
      {"--optimizer", str(c.optimizer)},
      {"--lr", dbl("--lr", c.lr)},
      {"--weight-decay", Flag{true,
                              [&](const std::string& v) {
                                wd = to_double("--weight-decay", v);
                                wd_given = true;
                              }}},
      {"--momentum", dbl("--momentum", c.momentum)},
      {"--nesterov", on(c.nesterov, true)},
      {"--beta1", dbl("--beta1", c.beta1)},
      {"--beta2", dbl("--beta2", c.beta2)},
      {"--eps", dbl("--eps", c.eps)},
      {"--no-bias-correction", on(c.bias_correction, false)},
      {"--max-grad-norm", dbl("--max-grad-norm", c.max_grad_norm)},
      {"--lr-schedule", str(c.lr_schedule)},
      {"--warmup-steps", i64("--warmup-steps", c.warmup_steps, 0)},
      {"--lr-step-size", i64("--lr-step-size", c.lr_step_size, 1)},
      {"--lr-gamma", dbl("--lr-gamma", c.lr_gamma)},
      {"--seed", i64("--seed", seed, 0)},
      {"--threads", i64("--threads", threads, 1)},
      {"--prefetch", i64("--prefetch", prefetch, 0)},
      {"--gradient-accumulation", i64("--gradient-accumulation", c.gradient_accumulation, 1)},
      {"--accumulation-reduction", str(c.accumulation_reduction)},
      {"--device-iterations", i64("--device-iterations", c.device_iterations, 1)},
      {"--output-mode", str(c.output_mode)},
      {"--output-return-period", i64("--output-return-period", c.output_return_period, 1)},
      {"--async-dataloader", on(c.async_loader, true)},
      {"--eight-bit-io", on(c.eight_bit_io, true)},
      {"--detect-anomaly", on(c.detect_anomaly, true)},
      {"--profile", on(c.profile, true)},
      {"--no-update-in-backward", on(c.update_in_backward, false)},
      {"--recompute", on(c.recompute, true)},
      {"--numerics-report", str(c.numerics_report)},
      {"--numerics-every", i64("--numerics-every", c.numerics_every, 1)},
      {"--workers", Flag{true,
                         [&](const std::string& v) {
                           workers = to_int("--workers", v, 1);
                           c.async_loader = true;
                         }}},
      {"--precision", str(c.precision)},
      {"--half-type", str(c.half_type)},
      {"--keep-fp32", list(c.keep_fp32)},
      {"--half-modules", list(c.half_modules)},
      {"--autocast-lower-list", str(c.autocast_lower_list)},
      {"--autocast-fp32-list", str(c.autocast_fp32_list)},
      {"--autocast-log", on(c.autocast_log, true)},
      {"--loss-scaling", str(c.loss_scaling)},
      {"--loss-scale-init", opt_dbl("--loss-scale-init", c.loss_scale_init)},
      {"--loss-scale-min", opt_dbl("--loss-scale-min", c.loss_scale_min)},
      {"--loss-scale-max", opt_dbl("--loss-scale-max", c.loss_scale_max)},
      {"--loss-scale-growth-interval",
       i64("--loss-scale-growth-interval", c.loss_scale_growth_interval, 1)},
      {"--loss-scale-hysteresis", i64("--loss-scale-hysteresis", c.loss_scale_hysteresis, 1)},
      {"--stochastic-rounding", on(c.stochastic_rounding, true)},
      {"--stochastic-outputs", on(c.stochastic_outputs, true)},
      {"--kahan", on(c.kahan, true)},
      {"--partials", str(c.partials)},
      {"--fp8-scaling", str(c.fp8_scaling)},
      {"--fp8-amax-history", i64("--fp8-amax-history", c.fp8_amax_history, 1)},
      {"--fp8-amax-algo", str(c.fp8_amax_algo)},
      {"--fp8-margin", i64("--fp8-margin", c.fp8_margin, 0)},
      {"--fp8-keep-layers", Flag{true,
                                 [&](const std::string& v) {
                                   // The first use replaces the default (first,last).
                                   if (!fp8_keep_given) c.fp8_keep_layers.clear();
                                   fp8_keep_given = true;
                                   list(c.fp8_keep_layers).apply(v);
                                 }}},
      {"--accum-type", str(c.accum_type)},
      {"--first-moment-type", str(c.first_moment_type)},
      {"--second-moment-type", str(c.second_moment_type)},
      {"--memory-budget", str(c.memory_budget)},
      {"--init-from", str(c.init_from)},
      {"--save", str(c.save)},
      {"--resume", str(c.resume)},
      {"--metrics-json", str(c.metrics_json)},
      {"--report", str(c.report)},
      {"--no-progress", on(c.progress, false)},
      {"--no-eval", on(c.evaluate, false)},
      {"--print-model", on(print_model, true)},
      {"--bucket-size", dbl("--bucket-size", c.bucket_size_mib)},
      {"--allreduce-dtype", str(c.allreduce_dtype)},
      {"--sync-batchnorm", on(c.sync_batchnorm, true)},
      {"--zero", i64("--zero", c.zero, 0)},
      {"--check-replicas", on(c.check_replicas, true)},
  };
  parse_flags(args, flags, "train");
  if (help) {
    out << kTrainUsage;
    return kExitOk;
  }
  c.seed = static_cast<uint64_t>(seed);
  c.threads = static_cast<int>(std::min<int64_t>(threads, 1024));
  c.prefetch = static_cast<int>(std::min<int64_t>(prefetch, 65));
  c.workers = static_cast<int>(std::min<int64_t>(workers, 65));
  if (wd_given) c.weight_decay = wd;
  // Ctrl-C stops at the next step boundary: the checkpoint (--save), metrics and report are
  // written and the loader's workers end. A second Ctrl-C ends the program at once
  // (SA_RESETHAND). Installed before the data is loaded, so an early Ctrl-C stops the run before
  // its first step.
  // Under an MPI launcher, SIGTERM too: Open MPI's mpirun, given Ctrl-C (SIGINT) or SIGTERM,
  // sends its ranks SIGCONT, then SIGTERM after odls_base_sigkill_timeout seconds (default 1),
  // then SIGKILL after as many again; the ranks agree on the step to stop at (the trainer's
  // per-call collective) and rank 0 writes the checkpoint (docs/distributed.md).
  const bool launched = comm::launched_by_mpi();
  struct sigaction sa {};
  sa.sa_handler = [](int) { train::request_stop(); };
  sa.sa_flags = SA_RESETHAND;
  sigemptyset(&sa.sa_mask);
  struct sigaction previous_int {
  }, previous_term{};
  sigaction(SIGINT, &sa, &previous_int);
  if (launched) sigaction(SIGTERM, &sa, &previous_term);
  struct Restore {
    struct sigaction *previous_int, *previous_term;
    bool term;
    ~Restore() {
      sigaction(SIGINT, previous_int, nullptr);
      if (term) sigaction(SIGTERM, previous_term, nullptr);
    }
  } restore{&previous_int, &previous_term, launched};
  if (launched && !c.save.empty() && comm::world().rank() == 0 &&
      !std::getenv("OMPI_MCA_odls_base_sigkill_timeout") && std::getenv("OMPI_COMM_WORLD_SIZE"))
    err << "mantissa: note: mpirun ends its ranks 1 s after passing on Ctrl-C; to leave time for "
           "the checkpoint, start it with --mca odls_base_sigkill_timeout 30\n";
  train::Trainer trainer(c, {&out, &err});
  if (print_model) out << trainer.model().summary() << std::endl;
  const train::TrainResult r = trainer.run();
  return r.interrupted ? kExitInterrupted : kExitOk;
}

int run_eval(const std::vector<std::string>& args, std::ostream& out) {
  std::string checkpoint, dataset, data_dir;
  int64_t limit = 0, batch = 32, threads = 0;
  bool help = false;
  std::map<std::string, Flag> flags = {
      {"--help", Flag{false, [&](const std::string&) { help = true; }}},
      {"--checkpoint", Flag{true, [&](const std::string& v) { checkpoint = v; }}},
      {"--dataset", Flag{true, [&](const std::string& v) { dataset = v; }}},
      {"--data-dir", Flag{true, [&](const std::string& v) { data_dir = v; }}},
      {"--test-limit",
       Flag{true, [&](const std::string& v) { limit = to_int("--test-limit", v, 1); }}},
      {"--batch-size",
       Flag{true, [&](const std::string& v) { batch = to_int("--batch-size", v, 1); }}},
      {"--threads", Flag{true, [&](const std::string& v) { threads = to_int("--threads", v, 1); }}},
  };
  parse_flags(args, flags, "eval");
  if (help) {
    out << kEvalUsage;
    return kExitOk;
  }
  refuse_ranks("eval", "run it without mpirun: one process evaluates the checkpoint");
  if (checkpoint.empty())
    throw UsageError(
        "'mantissa eval' needs --checkpoint FILE (written by 'mantissa train --save')");
  set_num_threads(static_cast<int>(std::min<int64_t>(threads, 1024)));
  const train::EvalResult r =
      train::evaluate_checkpoint(checkpoint, dataset, data_dir, limit, batch);
  char line[256];
  std::snprintf(line, sizeof line, "%s: test accuracy %.2f%% (%lld images), mean loss %.4f\n",
                r.model.c_str(), r.accuracy * 100, static_cast<long long>(r.examples), r.loss);
  out << line;
  return kExitOk;
}

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
    "  --json FILE           the figures, with the liveness timeline\n"
    "  --html FILE           a self-contained page with SVG charts (opens offline)\n"
    "  --threads N\n";

int run_memory(const std::vector<std::string>& args, std::ostream& out) {
  train::TrainConfig c;
  std::vector<std::string> precisions;
  std::string json_path, html_path;
  int64_t threads = 0, ranks = 0;
  bool help = false;
  const auto str = str_flag;
  const auto i64 = int_flag;
  std::map<std::string, Flag> flags = {
      {"--help", switch_flag(help)},
      {"--model", str(c.model)},
      {"--batch-size", i64("--batch-size", c.batch_size, 1)},
      {"--image-size", i64("--image-size", c.image_size, 1)},
      {"--imagenet-stem", switch_flag(c.imagenet_stem)},
      {"--optimizer", str(c.optimizer)},
      {"--precision", Flag{true, [&](const std::string& v) { precisions.push_back(v); }}},
      {"--half-type", str(c.half_type)},
      {"--loss-scaling", str(c.loss_scaling)},
      {"--gradient-accumulation", i64("--gradient-accumulation", c.gradient_accumulation, 1)},
      {"--device-iterations", i64("--device-iterations", c.device_iterations, 1)},
      {"--eight-bit-io", switch_flag(c.eight_bit_io)},
      {"--recompute", switch_flag(c.recompute)},
      {"--kahan", switch_flag(c.kahan)},
      {"--memory-budget", str(c.memory_budget)},
      {"--json", str(json_path)},
      {"--html", str(html_path)},
      {"--threads", i64("--threads", threads, 1)},
      {"--ranks", i64("--ranks", ranks, 1)},
      {"--bucket-size", num_flag("--bucket-size", c.bucket_size_mib)},
      {"--allreduce-dtype", str(c.allreduce_dtype)},
  };
  parse_flags(args, flags, "memory");
  if (help) {
    out << kMemoryUsage;
    return kExitOk;
  }
  refuse_ranks("memory", "run it in one process, with --ranks N for what each of N ranks holds");
  if (precisions.empty()) precisions.push_back(c.precision);
  c.threads = static_cast<int>(std::min<int64_t>(threads, 1024));
  // With several ranks every update waits for the reduced gradients: measured that way.
  if (ranks > 1) c.update_in_backward = false;
  // Checked with the first precision (each is checked again when measured): the settings that
  // hold for one precision only (--kahan) then see it.
  train::TrainConfig first = c;
  first.precision = precisions.front();
  const train::RunSettings settings = train::resolve(first);
  io::check_output_path(json_path, "--json");
  io::check_output_path(html_path, "--html");
  std::vector<train::StepMemory> runs;
  std::vector<train::RankMemory> per_rank;
  for (const std::string& p : precisions) {
    train::TrainConfig rc = c;
    rc.precision = p;
    runs.push_back(train::profile_step(rc));
    if (ranks > 0)
      per_rank.push_back(train::rank_memory(runs.back(), static_cast<int>(ranks), c.bucket_size_mib,
                                            settings.allreduce_dtype));
  }
  out << "memory of one training step: " << c.model << ", batch " << c.batch_size << ", "
      << c.effective_image_size() << "x" << c.effective_image_size() << ", " << c.optimizer
      << (c.gradient_accumulation > 1
              ? ", gradient accumulation " + std::to_string(c.gradient_accumulation)
              : std::string())
      << (c.recompute ? ", recomputation" : "") << "\n"
      << train::memory_text(runs, 12, per_rank);
  if (!json_path.empty()) io::write_file_atomic(json_path, train::memory_json(c, runs, per_rank));
  if (!html_path.empty()) io::write_file_atomic(html_path, train::memory_html(c, runs));
  for (const train::StepMemory& r : runs)
    if (!r.fits) return kExitOutOfMemory;
  return kExitOk;
}

}  // namespace mantissa::cli

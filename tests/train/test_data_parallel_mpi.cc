// Data-parallel training through the trainer, run by CTest under mpirun on 2 and 3 ranks
// (tests/comm/mpi_test_main.cc: every rank runs every test). Each rank trains its slice of every
// global batch; the references are trainers of one process (comm::make_single_process) that every
// rank runs itself on the global batch, as --gradient-accumulation N of the per-rank batch or as
// one batch N times larger. What is checked, and with which tolerance:
//   - FP32 wire, models without batch statistics (lenet5; tutorial-cnn with its group norm): on 2
//     ranks the losses and the weights are those of one process accumulating 2 micro-batches,
//     bit for bit (g0 + g1 is the same sum in either order, and the division by 2 is exact); on 3
//     ranks MPI may add the three gradients in another order than (g0 + g1) + g2, a rounding of
//     the sum per step, so the losses agree within 1e-4 relative over a few SGD steps;
//   - every rank holds the same parameters and buffers after every step (--check-replicas, which
//     throws otherwise; with per-rank batch-norm statistics the buffers come from rank 0);
//   - --sync-batchnorm on a ResNet matches one process with the global batch: the statistics are
//     the same sums in another order, so the first two SGD steps' losses agree within 1e-5
//     relative and the third within 1e-3 (the network amplifies roundings), while per-rank
//     statistics are off by more than 1e-2 from the first step;
//   - an overflow in one rank's gradients makes every rank skip the step, with the same scale
//     and step count, as one process accumulating the same micro-batches does;
//   - --zero 1 trains as plain data parallelism: on 2 ranks bit for bit without clipping, with
//     clipping within 1e-5 relative (the global norm is added in another order); each rank holds
//     its share of the optimizer state (the shares add up to the whole); a weight that travels as
//     factors is cut into blocks of rows, each rank forming and updating its own, gathered while
//     the next forward pass runs: the same training as without ZeRO (bit for bit on 2 ranks);
//   - a checkpoint written by N ranks (ZeRO's shards gathered) resumes on one process with
//     --gradient-accumulation N (bit for bit on 2 ranks) and a one-process checkpoint on N ranks;
//   - a stop requested on one rank stops every rank at the same step;
//   - ranks that disagree on a flag are refused, naming it;
//   - fp8-hybrid: every rank's FP8 state (the scales and amax histories) is rank 0's after every
//     run (the amaxes are MAX-reduced across the ranks), and on 2 ranks the losses, the weights
//     and the FP8 state are one process's accumulating 2 micro-batches, bit for bit (the amax of
//     a step is the larger of the micro-batches' either way);
//   - FP16 and BF16 on the wire reach the FP32 wire's test accuracy within 1 point (lenet5 trained
//     on the first 12,000 Fashion-MNIST images for one epoch, 187 steps of 2 x 32, tested on the
//     first 2,000 test images: about 70%; on 2 ranks only, and skipped without the dataset).
#include <gtest/gtest.h>

#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "mantissa/comm/communicator.h"
#include "mantissa/core/parallel.h"
#include "mantissa/dist/replicas.h"
#include "mantissa/kernels/gemm.h"
#include "mantissa/train/memory_report.h"
#include "mantissa/train/trainer.h"
#include "support/errors.h"
#include "support/train.h"

namespace mantissa {
namespace {

comm::Communicator& world() { return comm::world(); }

// A directory every rank of the job sees by the same name (rank 0's process id), removed at the
// end of the scope by rank 0.
class SharedDir {
 public:
  SharedDir() {
    int64_t id = ::getpid();
    world().broadcast(&id, 1, DType::i64, 0);
    path_ = std::filesystem::temp_directory_path() / ("mantissa_dp_" + std::to_string(id));
    if (world().rank() == 0) std::filesystem::create_directories(path_);
    world().barrier();
  }
  ~SharedDir() {
    world().barrier();
    std::error_code ec;
    if (world().rank() == 0) std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// A small run on the synthetic dataset, per-rank batch 8, one thread per rank, the replicas
// checked after every step.
train::TrainConfig small(const std::string& model, int64_t steps) {
  train::TrainConfig c = testing::small_run(model, 256);
  c.batch_size = 8;
  c.max_steps = steps;
  c.threads = 1;
  c.check_replicas = true;
  return c;
}

// The same run in one process with the global batch as `ranks` accumulation micro-batches.
train::TrainConfig as_accumulation(train::TrainConfig c, int ranks) {
  c.gradient_accumulation *= ranks;
  c.check_replicas = false;
  return c;
}

struct Trained {
  train::TrainResult result;
  std::vector<std::pair<std::string, Tensor>> weights;  // the model's state dict
  size_t optimizer_state_bytes = 0;
};

// Trains `c` on the job's ranks (world) or in this process alone.
Trained train_on(const train::TrainConfig& c, bool alone) {
  const std::unique_ptr<comm::Communicator> single = comm::make_single_process();
  train::Trainer t(c, {}, alone ? single.get() : &world());
  Trained r;
  r.result = t.run();
  r.weights = t.model().state_dict();
  r.optimizer_state_bytes = t.optimizer().state_bytes();
  return r;
}

// The losses of `c` trained in one process, by rank 0 alone and sent to every rank (for the
// references that cost as much as the run they check).
std::vector<float> losses_of_one_process(const train::TrainConfig& c) {
  std::vector<float> losses(static_cast<size_t>(c.max_steps), 0.0f);
  if (world().rank() == 0) {
    const std::vector<float> l = train_on(c, true).result.step_losses;
    std::copy(l.begin(), l.begin() + std::min(l.size(), losses.size()), losses.begin());
  }
  world().broadcast(losses.data(), losses.size(), DType::f32, 0);
  return losses;
}

void expect_same_weights(const Trained& a, const Trained& b) {
  ASSERT_EQ(a.weights.size(), b.weights.size());
  for (size_t i = 0; i < a.weights.size(); ++i) {
    const Tensor x = a.weights[i].second.contiguous(), y = b.weights[i].second.contiguous();
    ASSERT_EQ(x.nbytes(), y.nbytes()) << a.weights[i].first;
    EXPECT_EQ(std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()), 0)
        << a.weights[i].first << " differs";
  }
}

void expect_close(const std::vector<float>& a, const std::vector<float>& b, double rel) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(a[i], b[i], rel * std::max(1.0f, std::fabs(b[i]))) << "step " << i + 1;
}

TEST(DataParallel, EqualsGradientAccumulationOfTheRanksBatches) {
  const int n = world().size();
  for (const std::string model : {"lenet5", "tutorial-cnn"}) {
    train::TrainConfig c = small(model, 4);
    if (n > 2) c.optimizer = "sgd", c.lr = 0.05;  // no Adam normalization to amplify roundings
    const Trained ranks = train_on(c, false);
    const Trained one = train_on(as_accumulation(c, n), true);
    ASSERT_EQ(ranks.result.step_losses.size(), 4u);
    if (n == 2) {
      EXPECT_EQ(ranks.result.step_losses, one.result.step_losses) << model;
      expect_same_weights(ranks, one);
    } else {
      expect_close(ranks.result.step_losses, one.result.step_losses, 1e-4);
    }
    // The figures are the global batch's: every image of every rank.
    EXPECT_EQ(ranks.result.epochs.at(0).steps, 4);
    ASSERT_TRUE(ranks.result.communication.has_value());
    EXPECT_EQ(ranks.result.communication->world_size, n);
    EXPECT_GT(ranks.result.communication->bytes_per_step, 0);
    EXPECT_EQ(ranks.result.rank_peak_memory.size(), static_cast<size_t>(n));
  }
}

// The same training: on 2 ranks the same losses and weights, bit for bit; on more, the losses
// within 1e-4 relative (the sums over ranks may be added in another order).
void expect_same_training(const Trained& a, const Trained& b) {
  if (world().size() == 2) {
    EXPECT_EQ(a.result.step_losses, b.result.step_losses);
    expect_same_weights(a, b);
  } else {
    expect_close(a.result.step_losses, b.result.step_losses, 1e-4);
  }
}

// The tutorial CNN at 64 x 64, whose fc1 (100 x 8748) travels as factors over the ranks' batches
// of 8; SGD on more than 2 ranks (whose sums may be added in another order).
train::TrainConfig factored_cnn(const char* precision) {
  train::TrainConfig c = small("tutorial-cnn", 4);
  c.image_size = 64;
  c.precision = precision;
  if (world().size() > 2) c.optimizer = "sgd", c.lr = 0.05;
  return c;
}

TEST(DataParallel, SufficientFactorsSendLessAndTrainAsTheGradients) {
  // The tutorial CNN at 64 x 64: fc1 (8748 -> 100) has factors over the global batch (8 images a
  // rank) of at most half its weight's size; the other layers go through the reducer. In 16-mixed
  // the factors are FP16 (autocast's input and output gradient) and the gradient FP32; in 16-true
  // all three are FP16 (each rank's product rounded to FP16, the sum too). By default the step
  // forms fc1's gradient a part at a time from the gathered factors as it updates it (16-mixed:
  // also under loss scaling), never storing it; --no-update-in-backward stores it whole.
  for (const char* precision : {"32-true", "16-mixed", "16-true"}) {
    SCOPED_TRACE(precision);
    train::TrainConfig c = factored_cnn(precision);
    const Trained factors = train_on(c, false);
    train::TrainConfig stored = c;
    stored.update_in_backward = false;
    const Trained whole = train_on(stored, false);
    train::TrainConfig off = c;
    off.sufficient_factors = false;
    const Trained gradients = train_on(off, false);
    const train::Communication& f = *factors.result.communication;
    const train::Communication& g = *gradients.result.communication;
    EXPECT_EQ(f.factored, (std::vector<std::string>{"fc1.weight"}));
    EXPECT_EQ(whole.result.communication->factored, f.factored);
    EXPECT_TRUE(g.factored.empty());
    EXPECT_LT(f.bytes_per_step, g.bytes_per_step);
    // fc1's gradient (3.3 MiB in FP32) is never held when the step forms it in parts.
    const size_t fc1_grad = size_t{100} * 8748 * (std::string(precision) == "16-true" ? 2 : 4);
    EXPECT_LT(factors.result.memory.peak_of(MemoryCategory::gradients) + fc1_grad / 2,
              whole.result.memory.peak_of(MemoryCategory::gradients));
    // The same sums: on 2 ranks bit for bit (g0 + g1 either way), on 3 in another order; formed
    // in parts or whole, the same bits.
    EXPECT_EQ(factors.result.step_losses, whole.result.step_losses);
    expect_same_weights(factors, whole);
    expect_same_training(factors, gradients);
  }
  // Small weights stay in the reducer's buckets: lenet5's are all under 2^18 values.
  EXPECT_TRUE(train_on(small("lenet5", 1), false).result.communication->factored.empty());
}

// Rank 0's text on every rank.
std::string rank0s(const std::string& text) {
  int64_t size = static_cast<int64_t>(text.size());
  world().broadcast(&size, 1, DType::i64, 0);
  std::string s = text;
  s.resize(static_cast<size_t>(size));
  world().broadcast(s.data(), s.size(), DType::u8, 0);
  return s;
}

TEST(DataParallel, Fp8ScalesAreTheSameOnEveryRank) {
  const int n = world().size();
  train::TrainConfig c = small("lenet5", 5);
  c.precision = "fp8-hybrid";
  c.fp8_amax_history = 4;
  if (n > 2) c.optimizer = "sgd", c.lr = 0.05;
  const std::unique_ptr<comm::Communicator> single = comm::make_single_process();
  train::Trainer ranks(c, {}, &world());
  const train::TrainResult r = ranks.run();
  const std::string state = ranks.fp8_state()->to_json();
  EXPECT_EQ(state, rank0s(state)) << "rank " << world().rank();
  train::Trainer one(as_accumulation(c, n), {}, single.get());
  const train::TrainResult o = one.run();
  if (n == 2) {
    EXPECT_EQ(r.step_losses, o.step_losses);
    EXPECT_EQ(state, one.fp8_state()->to_json());
    Trained a, b;
    a.weights = ranks.model().state_dict();
    b.weights = one.model().state_dict();
    expect_same_weights(a, b);
  } else {
    expect_close(r.step_losses, o.step_losses, 1e-3);
  }
}

TEST(DataParallel, AccumulationOnEveryRankCommunicatesOnceAStep) {
  // 2 micro-batches on each rank: one process accumulating 2 x ranks micro-batches.
  train::TrainConfig c = small("lenet5", 3);
  c.gradient_accumulation = 2;
  c.device_iterations = 2;  // and two steps a call
  c.output_mode = "all";
  const Trained ranks = train_on(c, false);
  const Trained one = train_on(as_accumulation(c, world().size()), true);
  if (world().size() == 2) {
    EXPECT_EQ(ranks.result.step_losses, one.result.step_losses);
  } else {
    expect_close(ranks.result.step_losses, one.result.step_losses, 1e-4);
  }
  // The gradients travelled once per optimizer step (3), not once per micro-batch.
  const train::Communication& comm = *ranks.result.communication;
  const Trained single_step = train_on(small("lenet5", 1), false);
  EXPECT_DOUBLE_EQ(comm.bytes_per_step, single_step.result.communication->bytes_per_step);
}

TEST(DataParallel, ReplicasStayIdenticalWithPerRankBatchNorm) {
  // --check-replicas throws on any rank whose parameters or buffers differ from rank 0's after a
  // step; the running statistics differ per rank until rank 0's are broadcast.
  train::TrainConfig c = small("resnet18", 3);
  c.optimizer = "sgd";
  c.lr = 0.05;
  train::Trainer t(c, {}, &world());
  t.run();
  std::vector<nn::Module::NamedTensor> all = t.model().named_parameters();
  for (const auto& b : t.model().named_buffers()) all.push_back(b);
  EXPECT_EQ(dist::replica_mismatch(world(), all), "");
}

TEST(DataParallel, SyncBatchNormMatchesOneProcessWithTheGlobalBatch) {
  const int n = world().size();
  train::TrainConfig c = small("resnet18", 3);
  c.optimizer = "sgd";
  c.lr = 0.05;
  c.sync_batchnorm = true;
  const Trained synced = train_on(c, false);
  train::TrainConfig global = c;
  global.batch_size *= n;
  global.sync_batchnorm = false;
  global.check_replicas = false;
  const std::vector<float> b = losses_of_one_process(global);
  // The same statistics added in another order: the first two losses agree to a few roundings,
  // and the difference grows with the steps (seen: 0, 3e-7, 1.5e-4 relative on 3 ranks).
  const std::vector<float>& a = synced.result.step_losses;
  ASSERT_EQ(a.size(), 3u);
  for (size_t i = 0; i < 3; ++i)
    EXPECT_NEAR(a[i], b[i], (i < 2 ? 1e-5 : 1e-3) * b[i]) << "step " << i + 1;
  // Per-rank statistics are another computation: the first loss already differs by more.
  c.sync_batchnorm = false;
  const Trained local = train_on(c, false);
  EXPECT_GT(std::fabs(local.result.step_losses[0] - b[0]), 1e-2 * std::fabs(b[0]));
}

// 400 blobs (8 features, 4 classes) with a ninth feature: 0, except 6e4 for example `spike`.
class SpikedBlobs : public data::ExampleSource {
 public:
  explicit SpikedBlobs(int64_t spike) : blobs_(testing::blobs(400, 8, 4, 5)), spike_(spike) {}
  int64_t size() const override { return blobs_->size(); }
  Shape example_shape() const override { return {9}; }
  int64_t num_classes() const override { return blobs_->num_classes(); }
  std::string name() const override { return "spiked blobs"; }
  int64_t get(int64_t index, float* input) const override {
    const int64_t label = blobs_->get(index, input);
    input[8] = index == spike_ ? 6e4f : 0.0f;
    return label;
  }

 private:
  std::shared_ptr<data::TensorDataset> blobs_;
  int64_t spike_;
};

// UserMlp on the first 8 features, plus probe * feature 8 added to the logits: the probe (made
// last, so the gradient reducer's first bucket part, rank 0's under ZeRO, holds it) is 0, so the
// ninth feature changes nothing but the probe's own gradient, which the spike makes overflow FP16
// under the loss scale; no other gradient sees it.
class ProbedMlp : public testing::UserMlp {
 public:
  ProbedMlp() : UserMlp(8, 16, 4, 3) {
    std::vector<float> first(8 * 9, 0.0f), last(9, 0.0f);
    for (int k = 0; k < 8; ++k) first[static_cast<size_t>(k * 9 + k)] = 1;
    last[8] = 1;
    register_buffer("first_eight", Tensor::from_floats(first, {8, 9}));  // selectors
    register_buffer("ninth", Tensor::from_floats(last, {1, 9}));
    register_parameter("probe", Tensor::zeros({1, 4}, DType::f32));
  }

 protected:
  Tensor classify(const Tensor& x) override {  // (N, 9) -> (N, 4)
    const Tensor logits = UserMlp::classify(ops::linear(x, buffer("first_eight")));
    return ops::add(logits, ops::mul(ops::linear(x, buffer("ninth")), param("probe")));
  }
};

TEST(DataParallel, OverflowOnOneRankSkipsTheStepOnEveryRank) {
  const int n = world().size();
  train::TrainConfig c;
  c.batch_size = 4;
  c.max_steps = 5;
  c.shuffle = false;
  c.threads = 1;
  c.progress = false;
  c.evaluate = false;
  c.precision = "16-true";
  c.loss_scaling = "dynamic";
  c.loss_scale_init = 1024;  // the ordinary steps do not overflow
  c.check_replicas = true;
  // Global batch 2 (step index 1) holds positions [n * 4, 2 n * 4): the spike in rank 1's slice.
  const int64_t spike = static_cast<int64_t>(n) * 4 + 4 + 1;
  auto run = [&](const train::TrainConfig& rc, bool alone) {
    const std::unique_ptr<comm::Communicator> single = comm::make_single_process();
    auto model = std::make_shared<ProbedMlp>();
    train::Trainer t(rc, model, std::make_shared<SpikedBlobs>(spike), nullptr, {},
                     alone ? single.get() : &world());
    train::TrainResult r = t.run();
    return r;
  };
  // As one process accumulating the ranks' micro-batches decides.
  const train::TrainResult one = run(as_accumulation(c, n), true);
  // Plain data parallelism (the reduced gradients hold the inf on every rank) and ZeRO-1 (only
  // the shards holding it see it: the shards' checks are combined).
  for (int zero : {0, 1}) {
    c.zero = zero;
    const train::TrainResult ranks = run(c, false);
    EXPECT_EQ(ranks.skipped_steps, 1) << "rank " << world().rank() << ", zero " << zero;
    EXPECT_EQ(ranks.steps, 5);
    ASSERT_TRUE(ranks.loss_scale.has_value());
    // The same scale and counts on every rank.
    std::vector<double> mine{*ranks.loss_scale, static_cast<double>(ranks.skipped_steps),
                             static_cast<double>(ranks.steps)};
    std::vector<double> all(mine.size() * static_cast<size_t>(n));
    world().all_gather(mine.data(), all.data(), mine.size(), DType::f64);
    for (int r = 1; r < n; ++r)
      for (size_t k = 0; k < mine.size(); ++k) EXPECT_EQ(all[r * mine.size() + k], all[k]);
    EXPECT_EQ(one.skipped_steps, ranks.skipped_steps);
    EXPECT_EQ(*one.loss_scale, *ranks.loss_scale);
    if (n == 2) {
      EXPECT_EQ(one.step_losses, ranks.step_losses) << "zero " << zero;
    }
  }
}

TEST(DataParallel, ZeroOneTrainsAsPlainDataParallelWithTheStateSplit) {
  const int n = world().size();
  for (const std::string precision : {"32-true", "16-mixed", "16-true", "bf16-true"}) {
    train::TrainConfig c = small("lenet5", 4);
    c.precision = precision;
    if (precision == "16-true") c.stochastic_rounding = true;
    if (precision == "bf16-true") c.kahan = true;  // the compensation sharded like the state
    const Trained plain = train_on(c, false);
    c.zero = 1;
    const Trained zero = train_on(c, false);
    if (n == 2) {
      EXPECT_EQ(zero.result.step_losses, plain.result.step_losses) << precision;
      expect_same_weights(zero, plain);
    } else {
      expect_close(zero.result.step_losses, plain.result.step_losses, 1e-4);
    }
    // The shares of the state add up to the whole, each about 1/n of it.
    std::vector<int64_t> shares(static_cast<size_t>(n));
    const int64_t mine = static_cast<int64_t>(zero.optimizer_state_bytes);
    world().all_gather(&mine, shares.data(), 1, DType::i64);
    int64_t total = 0;
    for (int64_t s : shares) total += s;
    EXPECT_EQ(total, static_cast<int64_t>(plain.optimizer_state_bytes)) << precision;
    EXPECT_LE(mine, static_cast<int64_t>(plain.optimizer_state_bytes) / n + 64) << precision;
  }
  // With clipping the global norm is added in another order: within rounding.
  train::TrainConfig c = small("lenet5", 4);
  c.max_grad_norm = 0.05;
  const Trained plain = train_on(c, false);
  c.zero = 1;
  const Trained zero = train_on(c, false);
  expect_close(zero.result.step_losses, plain.result.step_losses, 1e-5);
}

TEST(DataParallel, ZeroOneCutsFactoredWeightsIntoBlocksOfRows) {
  // The tutorial CNN at 64 x 64: fc1 (100 x 8748) travels as factors under --zero 1 too; each
  // rank forms and updates its block of fc1's rows (50 on 2 ranks; 34, 34 and 32 on 3, gathered
  // through a padded buffer) and all-gathers them after the step, while the next forward pass
  // computes the layers below fc1 (without --check-replicas, which waits for the gather at once).
  // The same training as without ZeRO: on 2 ranks bit for bit; on 3 the reducer's other sums may
  // be added in another order (SGD, 1e-4). The state of fc1 is split by rows.
  const int n = world().size();
  for (const char* precision : {"32-true", "16-mixed", "16-true"}) {
    SCOPED_TRACE(precision);
    train::TrainConfig c = factored_cnn(precision);
    c.check_replicas = false;
    const Trained plain = train_on(c, false);
    c.zero = 1;
    const Trained zero = train_on(c, false);
    c.check_replicas = true;  // waits for each gather after its step
    const Trained checked = train_on(c, false);
    EXPECT_EQ(zero.result.communication->factored, (std::vector<std::string>{"fc1.weight"}));
    EXPECT_EQ(zero.result.step_losses, checked.result.step_losses);
    expect_same_weights(zero, checked);
    expect_same_training(zero, plain);
    // Every rank ends with the same weights (rank 0's, compared byte by byte).
    for (const auto& [name, t] : zero.weights) {
      Tensor mine = t.contiguous();
      Tensor first = mine.clone();
      world().broadcast(first, 0);
      EXPECT_EQ(std::memcmp(mine.data_ptr(), first.data_ptr(), mine.nbytes()), 0) << name;
    }
    // The state's shares add up to the whole; fc1's (nearly all of it) by blocks of rows.
    std::vector<int64_t> shares(static_cast<size_t>(n));
    const int64_t mine = static_cast<int64_t>(zero.optimizer_state_bytes);
    world().all_gather(&mine, shares.data(), 1, DType::i64);
    int64_t total = 0;
    for (int64_t v : shares) total += v;
    EXPECT_EQ(total, static_cast<int64_t>(plain.optimizer_state_bytes));
    EXPECT_LE(mine,
              static_cast<int64_t>(plain.optimizer_state_bytes) * ((100 + n - 1) / n) / 100 + 4096);
  }
}

TEST(DataParallel, CheckpointsResumeOnAnyNumberOfRanks) {
  const int n = world().size();
  SharedDir dir;
  // 16-mixed: loss scaler state too; bf16-true with Kahan compensation, gathered from the shards.
  for (const bool kahan : {false, true}) {
    train::TrainConfig c = small("lenet5", 6);
    c.precision = kahan ? "bf16-true" : "16-mixed";
    c.kahan = kahan;
    const std::string tag = kahan ? "kahan-" : "";
    const Trained whole = train_on(c, false);

    // n ranks (ZeRO's shards gathered) stop at step 3; one process resumes with the same global
    // batch and finishes: the uninterrupted run's losses.
    train::TrainConfig first = c;
    first.max_steps = 3;
    first.zero = 1;
    first.save = dir.file(tag + "ranks.safetensors");
    train_on(first, false);
    world().barrier();  // rank 0 has written it
    train::TrainConfig rest = as_accumulation(c, n);
    rest.resume = first.save;
    const Trained resumed = train_on(rest, true);
    if (n == 2) {
      EXPECT_EQ(resumed.result.step_losses, whole.result.step_losses);
    } else {
      expect_close(resumed.result.step_losses, whole.result.step_losses, 1e-3);
    }

    // One process's checkpoint resumed on n ranks.
    world().barrier();
    train::TrainConfig alone = as_accumulation(c, n);
    alone.max_steps = 3;
    alone.save = dir.file(tag + "one.safetensors");
    if (world().rank() == 0) train_on(alone, true);
    world().barrier();
    train::TrainConfig on_ranks = c;
    on_ranks.resume = alone.save;
    on_ranks.zero = 1;
    const Trained continued = train_on(on_ranks, false);
    if (n == 2) {
      EXPECT_EQ(continued.result.step_losses, whole.result.step_losses);
    } else {
      expect_close(continued.result.step_losses, whole.result.step_losses, 1e-3);
    }

    // Another global batch is refused, naming what to change.
    train::TrainConfig other = c;
    other.batch_size = 4;
    other.resume = first.save;
    EXPECT_NE(testing::error_of([&] {
                train_on(other, false);
              }).find("global batch of " + std::to_string(n * 8)),
              std::string::npos);
  }
}

// A user model that asks for a stop on rank 1 in its forward pass of step 3 (as a signal arriving
// at one rank only would).
class StopOnRankOne : public testing::UserMlp {
 public:
  StopOnRankOne() : UserMlp(8, 16, 4, 3) {}

 protected:
  Tensor classify(const Tensor& x) override {
    if (world().rank() == 1 && ++forwards_ == 3) train::request_stop();
    return UserMlp::classify(x);
  }

 private:
  int forwards_ = 0;
};

TEST(DataParallel, AStopOnOneRankStopsEveryRankAtTheSameStep) {
  SharedDir dir;
  train::TrainConfig c;
  c.batch_size = 4;
  c.max_steps = 20;
  c.threads = 1;
  c.progress = false;
  c.save = dir.file("stopped.safetensors");
  train::Trainer t(c, std::make_shared<StopOnRankOne>(), testing::blobs(400, 8, 4, 5), nullptr, {},
                   &world());
  const train::TrainResult r = t.run();
  EXPECT_TRUE(r.interrupted);
  EXPECT_EQ(r.steps, 3);  // the call that saw the request was the last
  EXPECT_FALSE(train::stop_requested()) << "the run that stopped clears the request";
  world().barrier();
  EXPECT_TRUE(std::filesystem::exists(c.save));
}

// What the ranks read from their own files must agree where their flags do: training data of
// another size, a checkpoint at another step behind the same path (host-local files), test data
// of another size. Each is refused on every rank, naming what differs, before the ranks slice
// other batches and fall out of step in their collectives (which crashed inside Open MPI).
TEST(DataParallel, RanksThatReadOtherDataOrCheckpointsAreRefused) {
  const int r = world().rank();
  train::TrainConfig c;
  c.batch_size = 4;
  c.max_steps = 2;
  c.threads = 1;
  c.progress = false;
  auto model = [] { return std::make_shared<testing::UserMlp>(8, 16, 4, 0); };
  std::string e = testing::error_of([&] {
    train::Trainer t(c, model(), testing::blobs(r == 0 ? 400 : 200, 8, 4, 5), nullptr, {},
                     &world());
  });
  EXPECT_NE(e.find("ranks disagree on the data and checkpoint they read: 'training examples' is "
                   "'400' on rank 0 but '200' on rank 1"),
            std::string::npos)
      << e;
  e = testing::error_of([&] {
    train::Trainer t(c, model(), testing::blobs(400, 8, 4, 5),
                     testing::blobs(r == 0 ? 100 : 50, 8, 4, 6), {}, &world());
    t.run();
  });
  EXPECT_NE(e.find("ranks disagree on the test data they read: 'test examples' is '100' on rank "
                   "0 but '50' on rank 1"),
            std::string::npos)
      << e;
  // Each rank's own directory holds a checkpoint of another step under one name.
  SharedDir dir;
  const std::string own = dir.file("rank" + std::to_string(r));
  std::filesystem::create_directories(own);
  {
    const std::unique_ptr<comm::Communicator> alone = comm::make_single_process();
    train::TrainConfig a = c;
    a.batch_size = c.batch_size * world().size();  // the job's global batch
    a.max_steps = r == 0 ? 2 : 1;
    a.save = own + "/ck.safetensors";
    train::Trainer(a, model(), testing::blobs(400, 8, 4, 5), nullptr, {}, alone.get()).run();
  }
  const std::filesystem::path cwd = std::filesystem::current_path();
  std::filesystem::current_path(own);
  c.resume = "ck.safetensors";
  c.max_steps = 4;
  e = testing::error_of(
      [&] { train::Trainer t(c, model(), testing::blobs(400, 8, 4, 5), nullptr, {}, &world()); });
  std::filesystem::current_path(cwd);
  EXPECT_NE(e.find("'checkpoint step' is '2' on rank 0 but '1' on rank 1"), std::string::npos) << e;
  EXPECT_NE(e.find("give every rank the same training data and the same checkpoint"),
            std::string::npos)
      << e;
}

TEST(DataParallel, RanksShareTheHostsCoresByDefault) {
  if (std::getenv("MANTISSA_NUM_THREADS")) GTEST_SKIP() << "MANTISSA_NUM_THREADS decides";
  train::TrainConfig c = small("lenet5", 1);
  c.threads = 0;
  train::Trainer t(c, {}, &world());
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  EXPECT_EQ(default_num_threads(), std::max(1, cores / world().local_size()));
  set_num_threads(0);
}

TEST(DataParallel, RanksThatDisagreeOnAFlagAreRefusedNamingIt) {
  train::TrainConfig c = small("lenet5", 1);
  if (world().rank() == world().size() - 1) c.lr = 0.01;
  const std::string e = testing::error_of([&] { train::Trainer t(c, {}, &world()); });
  EXPECT_NE(e.find("'lr' is '0.001"), std::string::npos) << e;
  EXPECT_NE(e.find("on rank " + std::to_string(world().size() - 1)), std::string::npos) << e;
}

TEST(DataParallel, MemoryOfARankIsComputedFromOneProcess) {
  // `mantissa memory --ranks N` against what each rank measured: the same step's peak (the
  // measured one includes the evaluation-free run's first step too). Both sides start from the
  // same state: the GEMM's per-thread buffers released (they only grow, so what earlier tests
  // left would count on both sides), and the estimate made first (the profile counts what the
  // process holds, and a finished run's weights would be held).
  const int n = world().size();
  for (int zero : {0, 1}) {
    train::TrainConfig c = small("lenet5", 2);
    c.check_replicas = false;
    c.zero = zero;
    kernels::release_gemm_buffers();
    const train::RankMemory m =
        train::rank_memory(train::profile_step(c, n), n, c.bucket_size_mib, DType::f32);
    kernels::release_gemm_buffers();
    const double computed = static_cast<double>(zero ? m.zero_total : m.data_parallel_total);
    const double measured = static_cast<double>(train_on(c, false).result.memory.peak_total);
    EXPECT_NEAR(computed, measured, 0.01 * measured) << "zero " << zero;
  }
  // A weight that travels as factors (the tutorial CNN's fc1 at 64 x 64, without ZeRO) is in no
  // bucket, its gathered factors are held, and the gradient the step forms in parts is not: the
  // estimate is lower than it would be without them by at least half fc1's gradient (its bucket
  // and its stored gradient against every rank's factors).
  train::TrainConfig c = small("tutorial-cnn", 2);
  c.image_size = 64;
  const train::StepMemory step = train::profile_step(c, n);
  train::StepMemory unfactored = step;
  size_t factored = 0;
  for (train::ParamMemory& p : unfactored.params)
    if (p.factor_bytes > 0) {
      ++factored;
      EXPECT_EQ(p.numel, 100 * 8748);
      EXPECT_TRUE(p.factor_deferred);
      p.factor_bytes = 0;
    }
  EXPECT_EQ(factored, 1u);
  const size_t with =
      train::rank_memory(step, n, c.bucket_size_mib, DType::f32).data_parallel_total;
  const size_t without =
      train::rank_memory(unfactored, n, c.bucket_size_mib, DType::f32).data_parallel_total;
  EXPECT_LT(with + size_t{100} * 8748 * 4 / 2, without);
  // Under ZeRO fc1 is factored too, cut into blocks of rows: the computed peak against the one
  // each rank measured (computed first: the profile counts what the process already holds).
  c.zero = 1;
  c.check_replicas = false;
  // The estimate adds the gathered factors and the ZeRO buffers to the step's peak, though the
  // ranks hold them at other moments: it may be above what they measure (8-9% at 3 ranks), never
  // below.
  kernels::release_gemm_buffers();
  const train::RankMemory m =
      train::rank_memory(train::profile_step(c, n), n, c.bucket_size_mib, DType::f32);
  kernels::release_gemm_buffers();
  const double measured = static_cast<double>(train_on(c, false).result.memory.peak_total);
  EXPECT_GE(static_cast<double>(m.zero_total), 0.99 * measured);
  EXPECT_LE(static_cast<double>(m.zero_total), 1.1 * measured);
  EXPECT_LE(m.optimizer_state_zero, m.optimizer_state * ((100 + n - 1) / n) / 100 + 4096);
  EXPECT_LT(m.zero_total, m.data_parallel_total);
}

TEST(DataParallel, HalfPrecisionWiresReachTheFp32WiresAccuracy) {
  if (world().size() != 2) GTEST_SKIP() << "runs on 2 ranks (a minute of training)";
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"))
    GTEST_SKIP() << "no Fashion-MNIST (Debian's dataset-fashion-mnist)";
  train::TrainConfig c;
  c.model = "lenet5";
  c.train_limit = 12000;
  c.test_limit = 2000;
  c.batch_size = 32;
  c.threads = 1;
  c.progress = false;
  std::vector<double> accuracy;
  for (const std::string wire : {"fp32", "fp16", "bf16"}) {
    c.allreduce_dtype = wire;
    train::Trainer t(c, {}, &world());
    accuracy.push_back(*t.run().test_accuracy);
  }
  EXPECT_GT(accuracy[0], 0.65);  // it learned (seen: 69.8% fp32, 69.9% fp16, 69.4% bf16)
  EXPECT_NEAR(accuracy[1], accuracy[0], 0.01) << "fp16 wire";
  EXPECT_NEAR(accuracy[2], accuracy[0], 0.01) << "bf16 wire";
}

}  // namespace
}  // namespace mantissa

// The pieces of data-parallel training that run in one process: the loader's rank slices, sync
// batch norm's kernels joined by an in-process "all-reduce" of two threads, the optimizer's
// shards (ZeRO-1) against one unsharded optimizer, the bucket layout, per-rank memory, the flags,
// and a run of one process with the data-parallel flags (which change nothing). The same
// features across processes: tests/train/test_data_parallel_mpi.cc.
#include <gtest/gtest.h>

#include <barrier>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <thread>
#include <utility>

#include "mantissa/dist/reducer.h"
#include "mantissa/kernels/norm.h"
#include "mantissa/optim/optim.h"
#include "mantissa/train/memory_report.h"
#include "mantissa/train/trainer.h"
#include "support/errors.h"
#include "support/files.h"
#include "support/train.h"

namespace mantissa {
namespace {

using testing::error_of;

data::Dataset images(int64_t n) {
  data::SyntheticConfig c;
  c.size = n;
  c.image_size = 8;
  return data::synthetic(c, true);
}

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor x = a.contiguous(), y = b.contiguous();
  return x.dtype() == y.dtype() && x.shape() == y.shape() &&
         std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

TEST(DataParallelLoader, RankSlicesAreTheGlobalBatchInOrder) {
  const data::Dataset ds = images(70);
  for (bool shuffle : {false, true})
    for (int64_t ranks : {2, 3}) {
      data::LoaderConfig c;
      c.batch_size = 4;
      c.shuffle = shuffle;
      data::LoaderConfig global = c;
      global.batch_size = 4 * ranks;
      const data::Loader whole(ds, global);
      for (int64_t r = 0; r < ranks; ++r) {
        c.ranks = ranks;
        c.rank = r;
        const data::Loader slice(ds, c);
        ASSERT_EQ(slice.batches_per_epoch(), whole.batches_per_epoch());
        for (int64_t b = 0; b < whole.batches_per_epoch(); ++b) {
          const std::vector<int64_t> all = whole.batch_indices(1, b);
          const std::vector<int64_t> mine(all.begin() + r * 4, all.begin() + (r + 1) * 4);
          EXPECT_EQ(slice.batch_indices(1, b), mine) << "rank " << r << " batch " << b;
        }
        // The images too (augmentation keyed by the example): rows of the global batch's.
        const data::Batch got = slice.make_batch(0, 2), want = whole.make_batch(0, 2);
        const size_t row = got.images.nbytes() / 4;
        EXPECT_EQ(std::memcmp(got.images.data_ptr(),
                              static_cast<const char*>(want.images.data_ptr()) + r * 4 * row,
                              got.images.nbytes()),
                  0);
      }
    }
}

TEST(DataParallelLoader, WithoutDropLastTheLastSlicesMayBeShortOrAbsent) {
  const data::Dataset ds = images(10);
  data::LoaderConfig c;
  c.batch_size = 3;
  c.shuffle = false;
  c.drop_last = false;
  c.ranks = 3;  // global batches of 9: positions 0-8, then 9 alone (rank 0's)
  std::vector<int64_t> seen;
  for (int64_t r = 0; r < 3; ++r) {
    c.rank = r;
    const data::Loader l(ds, c);
    EXPECT_EQ(l.batches_per_epoch(), r == 0 ? 2 : 1) << "rank " << r;
    for (int64_t b = 0; b < l.batches_per_epoch(); ++b)
      for (int64_t i : l.batch_indices(0, b)) seen.push_back(i);
  }
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));  // each example once
  c.drop_last = true;
  c.ranks = 4;
  EXPECT_NE(
      error_of([&] { data::Loader l(ds, c); }).find("fewer than one global batch of 4 ranks x 3"),
      std::string::npos);
  c.rank = 4;
  EXPECT_NE(error_of([&] { data::Loader l(ds, c); }).find("out of range"), std::string::npos);
}

// An all-reduce of two threads: each thread's values summed (slot 0 + slot 1, the same bits on
// both), as two processes' ChannelSums would be.
class TwoThreadSums {
 public:
  kernels::ChannelSums for_thread(int t) {
    return [this, t](double* v, size_t n) {
      slots_[t].assign(v, v + n);
      barrier_.arrive_and_wait();
      for (size_t i = 0; i < n; ++i) v[i] = slots_[0][i] + slots_[1][i];
      barrier_.arrive_and_wait();  // both read before either writes again
    };
  }

 private:
  std::vector<double> slots_[2];
  std::barrier<> barrier_{2};
};

TEST(SyncBatchNorm, TwoHalvesNormalizeAsTheWholeBatch) {
  // (N, C, H, W) = (6, 3, 5, 4), weight and bias per channel, dy of the same shape.
  const int64_t N = 6, C = 3;
  std::vector<float> xv(N * C * 20), dyv(xv.size());
  for (size_t i = 0; i < xv.size(); ++i) {
    xv[i] = static_cast<float>(std::sin(0.7 * static_cast<double>(i)) * 3 + 0.1 * (i % 7));
    dyv[i] = static_cast<float>(std::cos(0.3 * static_cast<double>(i)));
  }
  const Tensor x = Tensor::from_floats(xv, {N, C, 5, 4}),
               dy = Tensor::from_floats(dyv, {N, C, 5, 4});
  const Tensor w = Tensor::from_floats({1.5f, -0.5f, 2.0f}, {C}),
               b = Tensor::from_floats({0.1f, 0.2f, -0.3f}, {C});
  Tensor rm = Tensor::zeros({C}, DType::f32), rv = Tensor::full({C}, 1.0, DType::f32);
  auto [y, mean, rstd] = kernels::batch_norm(x, w, b, rm, rv, true, 0.1, 1e-5, DType::f32);
  auto [dx, dw, db] = kernels::batch_norm_backward(dy, x, w, mean, rstd, true, DType::f32);

  // The two halves on two threads, joined by the sums.
  TwoThreadSums sums;
  Tensor half_y[2], half_dx[2], half_dw[2], half_db[2], half_rm[2], half_rv[2];
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t)
    threads.emplace_back([&, t] {
      const kernels::ChannelSums s = sums.for_thread(t);
      const Tensor xt = x.narrow(0, t * 3, 3).contiguous(),
                   dyt = dy.narrow(0, t * 3, 3).contiguous();
      half_rm[t] = Tensor::zeros({C}, DType::f32);
      half_rv[t] = Tensor::full({C}, 1.0, DType::f32);
      auto [yt, mt, rt] =
          kernels::batch_norm(xt, w, b, half_rm[t], half_rv[t], true, 0.1, 1e-5, DType::f32, &s);
      auto [dxt, dwt, dbt] = kernels::batch_norm_backward(dyt, xt, w, mt, rt, true, DType::f32, &s);
      half_y[t] = yt, half_dx[t] = dxt, half_dw[t] = dwt, half_db[t] = dbt;
    });
  for (std::thread& t : threads) t.join();
  const std::vector<float> yw = y.to_float_vector(), dxw = dx.to_float_vector();
  for (int t = 0; t < 2; ++t) {
    const std::vector<float> yh = half_y[t].to_float_vector(), dxh = half_dx[t].to_float_vector();
    for (size_t i = 0; i < yh.size(); ++i) {
      EXPECT_NEAR(yh[i], yw[t * yh.size() + i], 2e-6f * std::max(1.0f, std::fabs(yw[i])));
      EXPECT_NEAR(dxh[i], dxw[t * dxh.size() + i], 2e-6f * std::max(1.0f, std::fabs(dxw[i])));
    }
    // The running statistics from the whole batch's (count 60 a channel: unbiased n / (n - 1)).
    for (int64_t c = 0; c < C; ++c) {
      EXPECT_NEAR(half_rm[t].at({c}), rm.at({c}), 1e-6);
      EXPECT_NEAR(half_rv[t].at({c}), rv.at({c}), 1e-6);
    }
  }
  // dweight and dbias stay each half's own: their sum is the whole batch's.
  for (int64_t c = 0; c < C; ++c) {
    EXPECT_NEAR(half_dw[0].at({c}) + half_dw[1].at({c}), dw.at({c}), 1e-5);
    EXPECT_NEAR(half_db[0].at({c}) + half_db[1].at({c}), db.at({c}), 1e-5);
  }

  // A sync that adds nothing (one process) computes the unsynchronised bits.
  const kernels::ChannelSums alone = [](double*, size_t) {};
  Tensor rm1 = Tensor::zeros({C}, DType::f32), rv1 = Tensor::full({C}, 1.0, DType::f32);
  auto [y1, m1, r1] = kernels::batch_norm(x, w, b, rm1, rv1, true, 0.1, 1e-5, DType::f32, &alone);
  auto [dx1, dw1, db1] = kernels::batch_norm_backward(dy, x, w, m1, r1, true, DType::f32, &alone);
  EXPECT_TRUE(same_bits(y1, y) && same_bits(m1, mean) && same_bits(r1, rstd));
  EXPECT_TRUE(same_bits(rm1, rm) && same_bits(rv1, rv));
  EXPECT_TRUE(same_bits(dx1, dx) && same_bits(dw1, dw) && same_bits(db1, db));
}

TEST(SyncBatchNorm, TheLayerUsesItsHookOnlyInTraining) {
  nn::BatchNorm2d bn(2);
  int calls = 0;
  bn.set_sync([&calls](double*, size_t) { ++calls; });
  const Tensor x = Tensor::from_floats(std::vector<float>(16, 1.0f), {2, 2, 2, 2});
  bn(x);
  EXPECT_EQ(calls, 2);  // the sums, then the squared deviations
  bn.eval();
  bn(x);
  EXPECT_EQ(calls, 2);  // evaluation uses the running statistics
}

// Parameters of two dtypes and their gradients, for the optimizer tests.
struct Params {
  Tensor a = Tensor::zeros({300}, DType::f16), b = Tensor::zeros({7, 5}, DType::f16);
  optim::ParamList list() { return {{"a", &a}, {"b", &b}}; }
  Params() {
    for (Tensor* t : {&a, &b}) {
      std::vector<float> v(static_cast<size_t>(t->numel()));
      for (size_t i = 0; i < v.size(); ++i)
        v[i] = static_cast<float>(std::sin(1.3 * i + t->numel()));
      t->copy_from(Tensor::from_floats(v, t->shape()));
      t->set_requires_grad(true);
    }
  }
  void set_grads(int step) {
    for (Tensor* t : {&a, &b}) {
      std::vector<float> g(static_cast<size_t>(t->numel()));
      for (size_t i = 0; i < g.size(); ++i)
        g[i] = static_cast<float>(std::cos(0.37 * i + step) * (1 + step));
      t->set_grad(Tensor::from_floats(g, t->shape()).to(DType::f16));
    }
  }
};

std::unique_ptr<optim::Optimizer> adamw(optim::ParamList p) {
  optim::AdamOptions o;
  o.weight_decay = 0.01;
  auto opt = std::make_unique<optim::Adam>(std::move(p), o, true);
  opt->enable_master_weights();
  opt->set_stochastic_rounding(7);
  return opt;
}

// One optimizer over the whole and two over copies of the parameters, each owning a part of each
// (a: [0, 130) and [130, 300); b: none and all of it).
struct TwoShards {
  Params whole, first, second;
  std::unique_ptr<optim::Optimizer> reference = adamw(whole.list()), s0 = adamw(first.list()),
                                    s1 = adamw(second.list());
  TwoShards() {
    s0->set_shards({{0, 130}, {0, 0}});
    s1->set_shards({{130, 300}, {0, 35}});
  }
  TwoShards(const TwoShards&) = delete;  // the optimizers hold the parameters' addresses
  // Each element, from whichever optimizer owns it, is the whole's.
  void expect_the_whole(int step) const {
    const std::vector<float> a = whole.a.to_float_vector(), a0 = first.a.to_float_vector(),
                             a1 = second.a.to_float_vector();
    for (size_t i = 0; i < a.size(); ++i)
      ASSERT_EQ(a[i], i < 130 ? a0[i] : a1[i]) << "step " << step << " element " << i;
    EXPECT_TRUE(same_bits(second.b, whole.b));
  }
};

TEST(OptimizerShards, ShardsTogetherComputeTheUnshardedUpdateBitForBit) {
  // Clipping's norm comes from combine().
  TwoShards shards;
  auto &reference = shards.reference, &s0 = shards.s0, &s1 = shards.s1;
  for (int step = 0; step < 3; ++step) {
    for (Params* p : {&shards.whole, &shards.first, &shards.second}) p->set_grads(step);
    optim::StepOptions o;
    o.max_grad_norm = 5;
    o.grad_scale = 0.5f;
    // The norm the unsharded step used, squared: sqrt gives it back exactly.
    const optim::StepReport r = reference->step(o);
    ASSERT_TRUE(r.grad_norm.has_value());
    const double total = *r.grad_norm * *r.grad_norm;
    double seen = 0;
    o.combine = [&](double sum_of_squares, bool nonfinite) {
      EXPECT_FALSE(nonfinite);
      seen += sum_of_squares;
      return std::pair<double, bool>(total, false);
    };
    s0->step(o);
    s1->step(o);
    // The shards' parts add up to the whole, in another order (float lanes from each part's start).
    EXPECT_NEAR(seen, total, 1e-6 * total);
    shards.expect_the_whole(step);
  }
  // The state holds the parts (1-D), a third and two thirds of a.
  EXPECT_EQ(s0->state_bytes() + s1->state_bytes(), reference->state_bytes());
  EXPECT_EQ(s0->master_bytes() + s1->master_bytes(), reference->master_bytes());
  for (const auto& [name, t] : s0->state_tensors())
    if (name.rfind("a.", 0) == 0) {
      EXPECT_EQ(t.shape(), (Shape{130})) << name;
    }
  // Whole tensors load into a shard as its part.
  std::map<std::string, Tensor> saved;
  for (const auto& [name, t] : reference->state_tensors()) saved[name] = t;
  Params copy;
  auto loaded = adamw(copy.list());
  loaded->set_shards({{130, 300}, {0, 35}});
  loaded->load_state(saved, reference->steps(), "test");
  for (const auto& [name, t] : loaded->state_tensors()) {
    const Tensor whole_t = saved.at(name).contiguous().view({-1});
    const optim::ElementRange r =
        name[0] == 'a' ? optim::ElementRange{130, 300} : optim::ElementRange{0, 35};
    EXPECT_TRUE(same_bits(t, whole_t.narrow(0, r.begin, r.size()))) << name;
  }
}

// Gradients kept as their producers (Optimizer::defer_gradients, as dist::FactorGradients leaves
// them under ZeRO): each shard checks and applies the parts within its range (parts that cross
// the range's ends cut, the others dropped), and the shards together compute the unsharded step,
// bit for bit, with the producers giving every part to every shard.
TEST(OptimizerShards, DeferredGradientsGiveEachShardItsRange) {
  TwoShards shards;
  auto &reference = shards.reference, &s0 = shards.s0, &s1 = shards.s1;
  for (int step = 0; step < 3; ++step) {
    for (const auto& [params, opt] :
         {std::pair{&shards.whole, reference.get()}, std::pair{&shards.first, s0.get()},
          std::pair{&shards.second, s1.get()}}) {
      params->set_grads(step);
      const Tensor grads[2] = {params->a.grad(), params->b.grad()};
      for (Tensor* t : {&params->a, &params->b}) t->autograd_meta()->grad.reset();
      ASSERT_EQ(opt->defer_gradients(), 2u);
      for (Tensor* t : {&params->a, &params->b}) {
        const Tensor g = grads[t == &params->a ? 0 : 1];
        // Parts of 64 elements (a's shard boundary at 130 falls inside one).
        t->autograd_meta()->defer_grad_parts(
            [g](const GradPartConsumer& consume) {
              for (int64_t b = 0; b < g.numel(); b += 64)
                consume(b, std::min<int64_t>(64, g.numel() - b),
                        static_cast<const char*>(g.data_ptr()) + b * 2, DType::f16);
            },
            std::numeric_limits<double>::infinity());
      }
    }
    optim::StepOptions o;
    o.grad_scale = 0.5f;
    o.skip_nonfinite = true;
    const optim::StepReport r = reference->step(o);
    ASSERT_FALSE(r.skipped);
    double seen = 0;
    o.combine = [&](double sum_of_squares, bool nonfinite) {
      EXPECT_FALSE(nonfinite);
      seen += sum_of_squares;
      return std::pair<double, bool>(*r.grad_norm * *r.grad_norm, false);
    };
    EXPECT_FALSE(s0->step(o).skipped);
    EXPECT_FALSE(s1->step(o).skipped);
    // Each shard read its range alone: the sums of squares add up to the whole's.
    EXPECT_NEAR(seen, *r.grad_norm * *r.grad_norm, 1e-6 * seen);
    shards.expect_the_whole(step);
  }
  EXPECT_EQ(s0->state_bytes() + s1->state_bytes(), reference->state_bytes());
}

TEST(OptimizerShards, MisuseIsRefused) {
  Params p;
  auto opt = adamw(p.list());
  EXPECT_NE(error_of([&] {
              opt->set_shards({{0, 10}});
            }).find("1 ranges for 2 parameters"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              opt->set_shards({{0, 301}, {0, 0}});
            }).find("outside its 300"),
            std::string::npos);
  opt->set_shards({{0, 10}, {0, 0}});
  EXPECT_NE(error_of([&] { opt->begin_backward_step(); }).find("sharded optimizer"),
            std::string::npos);
  p.set_grads(0);
  opt->step();
  EXPECT_NE(error_of([&] {
              opt->set_shards({{0, 10}, {0, 0}});
            }).find("after its first step"),
            std::string::npos);
}

TEST(BucketPlan, ScatteredBucketsSplitIntoEqualPartsThatCoverEveryParameter) {
  const std::vector<int64_t> numels = {1000, 7, 300000, 13};
  for (int ranks : {1, 2, 3, 4}) {
    dist::ReducerOptions o;
    o.first_bucket_mib = 0.0001;  // the last two parameters in a bucket of their own
    o.scatter = true;
    const std::vector<dist::Reducer::Bucket> buckets = dist::Reducer::plan(numels, o, ranks);
    int64_t covered = 0;
    for (const dist::Reducer::Bucket& b : buckets) {
      EXPECT_EQ(b.padded % ranks, 0);
      EXPECT_EQ(b.part * ranks, b.padded);
      EXPECT_GE(b.padded, b.numel);
      EXPECT_LT(b.padded - b.numel, ranks);
      covered += b.numel;
    }
    EXPECT_EQ(covered, 301020);
    o.scatter = false;
    for (const dist::Reducer::Bucket& b : dist::Reducer::plan(numels, o, ranks))
      EXPECT_EQ(b.padded, b.numel);
  }
}

TEST(RankMemory, ZeroOneHoldsAboutOneRanksShareOfTheState) {
  train::TrainConfig c = testing::small_run("lenet5", 64);
  c.update_in_backward = false;
  c.precision = "16-mixed";
  const train::StepMemory step = train::profile_step(c);
  ASSERT_FALSE(step.params.empty());
  const size_t state = static_cast<size_t>(MemoryCategory::optimizer_state);
  const size_t grads = static_cast<size_t>(MemoryCategory::gradients);
  const train::RankMemory one = train::rank_memory(step, 1, 25, DType::f32);
  EXPECT_EQ(one.zero[state], step.at_peak[state]);  // one rank owns it all
  for (int ranks : {2, 4}) {
    const train::RankMemory m = train::rank_memory(step, ranks, 25, DType::f32);
    const double share =
        static_cast<double>(m.zero[state]) / static_cast<double>(step.at_peak[state]);
    EXPECT_NEAR(share, 1.0 / ranks, 0.01) << ranks;
    EXPECT_GT(m.data_parallel[grads], step.at_peak[grads]);  // the buckets
    EXPECT_LT(m.zero_total, m.data_parallel_total);
  }
  // A 16-bit wire halves the buckets.
  const train::RankMemory f32 = train::rank_memory(step, 2, 25, DType::f32),
                          f16 = train::rank_memory(step, 2, 25, DType::f16);
  EXPECT_EQ(2 * (f16.data_parallel[grads] - step.at_peak[grads]),
            f32.data_parallel[grads] - step.at_peak[grads]);
  const std::string text = train::memory_text({step}, 4, {f32});
  EXPECT_NE(text.find("per rank of 2 ranks"), std::string::npos) << text;
  EXPECT_NE(text.find("--zero 1"), std::string::npos);
}

TEST(DataParallelFlags, BadValuesAreRefusedNamingTheFlag) {
  train::TrainConfig c;
  c.allreduce_dtype = "fp8";
  EXPECT_NE(error_of([&] { train::validate(c); }).find("--allreduce-dtype 'fp8'"),
            std::string::npos);
  c = {};
  c.zero = 2;
  EXPECT_NE(error_of([&] { train::validate(c); }).find("--zero 2 is not a supported"),
            std::string::npos);
  c = {};
  c.bucket_size_mib = 0;
  EXPECT_NE(error_of([&] { train::validate(c); }).find("--bucket-size"), std::string::npos);
  train::TrainConfig lenet = testing::small_run("lenet5", 64);
  lenet.sync_batchnorm = true;
  EXPECT_NE(
      error_of([&] { train::Trainer t(lenet); }).find("--sync-batchnorm: lenet5 has no batch"),
      std::string::npos);
}

TEST(DataParallelFlags, OneProcessTrainsAsWithoutThem) {
  train::TrainConfig c = testing::small_run("resnet18", 64);
  c.max_steps = 2;
  const train::TrainResult plain = train::Trainer(c).run();
  c.zero = 1;
  c.sync_batchnorm = true;
  c.allreduce_dtype = "fp16";
  c.bucket_size_mib = 1;
  c.check_replicas = true;
  const train::TrainResult flagged = train::Trainer(c).run();
  EXPECT_EQ(flagged.step_losses, plain.step_losses);
  EXPECT_FALSE(flagged.communication.has_value());
  EXPECT_EQ(flagged.rank_peak_memory.size(), 1u);
}

TEST(DataParallelCheckpoint, AnotherGlobalBatchIsRefusedNamingIt) {
  testing::TempDir dir;
  train::TrainConfig c = testing::small_run("lenet5", 128);
  c.max_steps = 1;
  c.save = dir.file("c.safetensors");
  train::Trainer(c).run();
  train::TrainConfig other = c;
  other.save.clear();
  other.resume = c.save;
  other.max_steps = 2;  // past the checkpoint's step
  other.batch_size = 8;
  other.gradient_accumulation = 2;  // the same global batch: resumes
  EXPECT_EQ(error_of([&] { train::Trainer t(other); }), "");
  other.gradient_accumulation = 1;
  EXPECT_NE(error_of([&] { train::Trainer t(other); })
                .find("global batch of 16 (1 rank x --batch-size 16 x --gradient-accumulation 1), "
                      "not 8 (1 rank x --batch-size 8"),
            std::string::npos);
}

// A rank's compute threads (what `mantissa train` under mpirun sets, and what `mantissa memory
// --ranks N` measures with): --threads when given; the default for one rank or when
// MANTISSA_NUM_THREADS decides; otherwise the host's cores shared by its ranks, at least one.
TEST(DataParallelThreads, RanksShareTheHostsCoresUnlessTold) {
  const char* env = std::getenv("MANTISSA_NUM_THREADS");
  const std::string saved = env ? env : "";
  unsetenv("MANTISSA_NUM_THREADS");
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  EXPECT_EQ(train::rank_threads(0, 2), std::max(1, cores / 2));
  EXPECT_EQ(train::rank_threads(0, 4 * cores), 1);
  EXPECT_EQ(train::rank_threads(3, 2), 3);
  EXPECT_EQ(train::rank_threads(0, 1), 0);
  setenv("MANTISSA_NUM_THREADS", "1", 1);
  EXPECT_EQ(train::rank_threads(0, 2), 0);
  if (env)
    setenv("MANTISSA_NUM_THREADS", saved.c_str(), 1);
  else
    unsetenv("MANTISSA_NUM_THREADS");
}

}  // namespace
}  // namespace mantissa

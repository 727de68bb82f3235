// The profiler's rows: aggregation by (phase, module, op), first-seen order, the thread's active
// profiler and timers that do nothing without one.
#include <gtest/gtest.h>

#include <bit>
#include <chrono>
#include <cstdint>
#include <thread>

#include "mantissa/core/cpu_features.h"
#include "mantissa/core/profiler.h"

namespace mantissa {
namespace {

TEST(Profiler, RowsAggregateInFirstSeenOrder) {
  Profiler p;
  p.add("forward", "conv1", "Conv2d", 1.0);
  p.add("backward", "conv1", "conv2d", 2.0);
  p.add("forward", "conv1", "Conv2d", 0.5);
  p.add("forward", "conv2", "Conv2d", 0.25);
  // The same op in another module, and the same module in another phase, are other rows.
  ASSERT_EQ(p.rows().size(), 3u);
  EXPECT_EQ(p.rows()[0].where, "conv1");
  EXPECT_EQ(p.rows()[0].calls, 2);
  EXPECT_DOUBLE_EQ(p.rows()[0].seconds, 1.5);
  EXPECT_EQ(p.rows()[1].phase, "backward");
  EXPECT_EQ(p.rows()[2].where, "conv2");
  p.clear();
  EXPECT_TRUE(p.rows().empty());
}

TEST(Profiler, TimersRecordOnlyUnderAScope) {
  Profiler p;
  { ProfileTimer t("forward", "", "idle"); }  // no active profiler: nothing recorded
  EXPECT_EQ(active_profiler(), nullptr);
  {
    ProfilerScope scope(&p);
    EXPECT_EQ(active_profiler(), &p);
    {
      ProfileTimer outer("step", "", "forward");
      ProfileTimer inner("forward", "fc", "Linear");
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    // Another thread has no active profiler.
    std::thread([] { EXPECT_EQ(active_profiler(), nullptr); }).join();
    {
      ProfilerScope off(nullptr);
      ProfileTimer ignored("forward", "", "ignored");
    }
    EXPECT_EQ(active_profiler(), &p);
  }
  EXPECT_EQ(active_profiler(), nullptr);
  ASSERT_EQ(p.rows().size(), 2u);
  // Destroyed in reverse order: the inner row is seen first, and the outer one includes it.
  EXPECT_EQ(p.rows()[0].op, "Linear");
  EXPECT_EQ(p.rows()[1].op, "forward");
  EXPECT_GE(p.rows()[0].seconds, 0.002);
  EXPECT_GE(p.rows()[1].seconds, p.rows()[0].seconds);
}

TEST(FmaPeak, ChainsGiveTheScalarLoopsBitsAndAPositiveRate) {
  // The probe's arithmetic is checked, so the measured loop is the one the rate claims.
  for (int64_t rounds : {0, 1, 7, 1000})
    for (float a : {0.999f, -1.0009765625f}) {
      const float got = fma_chains(rounds, 0.5f, 1.0f / 1024, a, 0.0625f);
      const float want = fma_chains_reference(rounds, 0.5f, 1.0f / 1024, a, 0.0625f);
      EXPECT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want))
          << rounds << " rounds, a = " << a;
    }
  // kFmaProbeLanes (192) lanes from 0.5 in steps of 1/1024, no rounds: their sum.
  constexpr float n = kFmaProbeLanes;
  EXPECT_FLOAT_EQ(fma_chains(0, 0.5f, 1.0f / 1024, 1, 0), n * 0.5f + (n - 1) * n / 2 / 1024.0f);
  const double rate = fma_peak_gflops(2, 0.01, 1);
  EXPECT_GT(rate, 0.01);  // any machine does 10 MFLOP/s
  EXPECT_LT(rate, 1e5);   // and no CPU 100 TFLOP/s
}

}  // namespace
}  // namespace mantissa

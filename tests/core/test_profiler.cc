// The profiler's rows: aggregation by (phase, module, op), first-seen order, the thread's active
// profiler and timers that do nothing without one.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

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

}  // namespace
}  // namespace mantissa

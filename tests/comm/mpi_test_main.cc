// main() of the test programs that run under mpirun: every rank runs every test. Rank 0 prints
// gtest's usual report; the other ranks print only their failures, prefixed with their rank. A
// fatal failure (ASSERT_*) on any rank ends the whole job at once (Communicator::abort), because
// the other ranks would otherwise wait forever in the test's next collective.
#include <gtest/gtest.h>

#include <cstdio>

#include "mantissa/comm/communicator.h"

namespace {

class RankFailures : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailures(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "rank %d: %s:%d: failure\n%s\n", rank_,
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.message());
    std::fflush(stderr);
  }

 private:
  int rank_;
};

class AbortOnFatalFailure : public ::testing::EmptyTestEventListener {
 public:
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.fatally_failed()) return;
    std::fprintf(stderr, "rank %d: fatal failure; ending the job\n",
                 mantissa::comm::world().rank());
    mantissa::comm::world().abort(1);
  }
};

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (!mantissa::comm::launched_by_mpi()) {
    std::fprintf(stderr, "%s: run under mpirun (mpirun -n 2 %s)\n", argv[0], argv[0]);
    return 1;
  }
  mantissa::comm::Communicator& world = mantissa::comm::world();
  ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (world.rank() != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailures(world.rank()));
  }
  listeners.Append(new AbortOnFatalFailure);
  return RUN_ALL_TESTS();
}

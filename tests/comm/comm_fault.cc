// A job in which rank 1 fails, run by tests/comm/expect_job_end.cmake under mpirun; the other
// ranks wait in a collective rank 1 never joins, so only ending the job can stop them.
//   comm_fault ok              every rank finishes (the control: exit status 0)
//   comm_fault throw           rank 1 throws; its handler prints the error and calls abort(3)
//   comm_fault abort_in_flight rank 1 calls abort(4) while its own collective is running
//   comm_fault kill            rank 1 is killed by SIGKILL
#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "mantissa/comm/communicator.h"
#include "mantissa/core/error.h"

int main(int argc, char** argv) {
  using namespace mantissa;
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "ok" && mode != "throw" && mode != "abort_in_flight" && mode != "kill") {
    std::fprintf(stderr, "usage: %s ok|throw|abort_in_flight|kill\n", argv[0]);
    return 2;
  }
  comm::Communicator& world = comm::world();
  int32_t x = 1;
  world.all_reduce(&x, 1, DType::i32, comm::ReduceOp::kSum);  // every rank is up
  try {
    if (world.rank() == 1) {
      if (mode == "throw")
        throw Error("cannot read '/no/such/dataset'", "pass --data-dir with the dataset's files");
      if (mode == "kill") {
        std::fprintf(stderr, "rank 1: killing itself\n");
        std::fflush(stderr);
        std::raise(SIGKILL);
      }
      if (mode == "abort_in_flight") {
        // A collective the others never start: running on the communication thread when the
        // abort arrives.
        double unmatched = 0;
        comm::Request r = world.broadcast_async(&unmatched, 1, DType::f64, 1);
        std::fprintf(stderr, "rank 1: aborting with a collective running\n");
        world.abort(4);
      }
    }
    if (mode != "ok" && world.rank() != 1) {
      // A collective rank 1 never joins.
      world.barrier();
      std::fprintf(stderr, "rank %d: the barrier returned without rank 1\n", world.rank());
      return 1;
    }
    world.barrier();
    std::printf("rank %d: done\n", world.rank());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", world.rank(), e.what());
    world.abort(3);
  }
}

// Collective communication between the processes (ranks) of a data-parallel job: all-reduce,
// reduce-scatter, all-gather, broadcast and barrier, blocking or asynchronous, over the dtypes
// training needs (comm/collective.h). Two backends sit behind this interface: one process alone
// (world size 1; collectives are copies) and Open MPI (comm/mpi_communicator.h), which world()
// picks when the process was started by an MPI launcher (mpirun, srun).
//
// Ordering rule (as for every MPI program): every rank must start the same collectives in the same
// order. A backend issues them in the order they were started on it (the MPI backend: one
// communication thread takes them from a first-in, first-out queue), so a caller that starts them
// in the same order on every rank may overlap them with computation safely.
//
// Failures: a collective that fails raises mantissa::Error from wait(). A rank that cannot go on
// must call abort(), which ends the whole job: the other ranks would otherwise wait forever in
// their next collective. A rank killed from outside (SIGKILL, out of memory) is noticed by Open
// MPI's runtime (mpirun), which ends the other ranks and exits with a non-zero status.
#pragma once

#include <cstddef>
#include <memory>
#include <string_view>

#include "mantissa/comm/collective.h"
#include "mantissa/comm/request.h"
#include "mantissa/core/error.h"
#include "mantissa/core/tensor.h"

namespace mantissa::comm {

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // This process's place in the job: rank in [0, size), and among the ranks on this host.
  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  // "single-process", "mpi".
  virtual std::string_view backend() const = 0;

  // ---- Blocking collectives on raw buffers (Collective documents the sizes) ----
  // The arguments are checked (Error naming the problem) before anything is sent.
  void all_reduce(void* data, size_t count, DType dtype, ReduceOp op);
  void reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op);
  void all_gather(const void* send, void* recv, size_t send_count, DType dtype);
  void broadcast(void* data, size_t count, DType dtype, int root);
  void barrier();

  // ---- Asynchronous forms: the operation runs while the caller goes on ----
  // The buffers must stay valid and untouched (except reading send) until the request finishes.
  // `keep_alive` is held until then: pass the buffers' owner to make dropping the request safe.
  Request all_reduce_async(void* data, size_t count, DType dtype, ReduceOp op,
                           std::shared_ptr<const void> keep_alive = {});
  Request reduce_scatter_async(const void* send, void* recv, size_t recv_count, DType dtype,
                               ReduceOp op, std::shared_ptr<const void> keep_alive = {});
  Request all_gather_async(const void* send, void* recv, size_t send_count, DType dtype,
                           std::shared_ptr<const void> keep_alive = {});
  Request broadcast_async(void* data, size_t count, DType dtype, int root,
                          std::shared_ptr<const void> keep_alive = {});
  Request barrier_async();

  // ---- Tensors: contiguous, of one dtype; the operation keeps their storage alive ----
  // all_gather: recv has size() * send.numel() elements; reduce_scatter: send has
  // size() * recv.numel() (any shapes).
  Request all_reduce_async(Tensor& t, ReduceOp op);
  Request reduce_scatter_async(const Tensor& send, Tensor& recv, ReduceOp op);
  Request all_gather_async(const Tensor& send, Tensor& recv);
  Request broadcast_async(Tensor& t, int root);
  void all_reduce(Tensor& t, ReduceOp op) { all_reduce_async(t, op).wait(); }
  void reduce_scatter(const Tensor& send, Tensor& recv, ReduceOp op) {
    reduce_scatter_async(send, recv, op).wait();
  }
  void all_gather(const Tensor& send, Tensor& recv) { all_gather_async(send, recv).wait(); }
  void broadcast(Tensor& t, int root) { broadcast_async(t, root).wait(); }

  // Ends every process of the job with `exit_code` (MPI_Abort; one process alone: this process),
  // after flushing this process's standard output and error. Callable from any thread, with
  // collectives outstanding.
  [[noreturn]] virtual void abort(int exit_code) = 0;

 protected:
  Communicator(int rank, int size, int local_rank, int local_size);
  // Starts a checked collective; the backend completes the returned request when it finishes.
  virtual Request start(Collective c) = 0;

 private:
  Request checked_start(Collective c, const char* what);

  int rank_, size_, local_rank_, local_size_;
};

// The process's communicator, made on the first call and kept until the process exits: the MPI
// backend when an MPI launcher started the process (launched_by_mpi()), otherwise one process
// alone, with nothing of MPI initialised. Throws Error when launched by mpirun in a build without
// MPI (MANTISSA_MPI=OFF).
Communicator& world();

// Whether the environment says an MPI launcher started this process: OMPI_COMM_WORLD_SIZE (Open
// MPI's mpirun), PMIX_RANK (PMIx launchers: mpirun, srun --mpi=pmix) or PMI_RANK (srun
// --mpi=pmi2, MPICH's hydra).
bool launched_by_mpi();

// A communicator of one process (world size 1), whatever launched this one: what world() returns
// outside mpirun, also made on its own for tests.
std::unique_ptr<Communicator> make_single_process();

}  // namespace mantissa::comm

// ZeRO stage 1 (Rajbhandari et al., 2020): the optimizer's state and FP32 master weights sharded
// across the ranks of a data-parallel job, so that each rank holds about 1/N of them.
//
//   dist::ReducerOptions o;  o.scatter = true;              // reduce-scatter the gradients
//   dist::Reducer reducer(comm, model->named_parameters(), o);
//   dist::Zero1 zero(comm, reducer, optimizer);              // the optimizer now owns a shard
//   autograd::backward(loss);  reducer.finish();             // this rank's part of each sum
//   optim::StepOptions so;  so.combine = zero.combine();     // norm and inf/NaN over all shards
//   if (!optimizer.step(so).skipped) zero.gather_parameters();
//
// Layout. The shards follow the reducer's buckets: bucket b (padded to a multiple of N) is cut
// into N equal parts and rank r owns part r of every bucket, the part the reduce-scatter leaves
// it. A parameter's elements in that part form one range (Reducer::owned), which becomes the
// optimizer's shard of that parameter (optim::Optimizer::set_shards): its state buffers and master
// weights hold only those elements. Every element is updated by exactly one rank, with the
// arithmetic (and the stochastic-rounding bits) of the unsharded optimizer, and the parameters
// then travel to every rank by an all-gather per bucket, so the replicas stay identical.
//
// Weights whose gradients travel as factors (dist::FactorGradients) are in no bucket: each is cut
// into N blocks of whole rows, ceil(out / N) rows a rank (the last ranks may get fewer or none),
// rank r owning block r. Its gradient is formed from every rank's gathered factors, so a rank
// forms only its rows (FactorGradients::set_rows: a deferred gradient's producer computes those
// alone), updates them, and the blocks travel by one all-gather per weight, in place in the
// parameter when N divides its rows (a buffer of the padded size otherwise). A rank then forms
// 1/N of the weight's gradient and runs 1/N of its update, where without ZeRO every rank forms
// and updates all of it.
//
// What differs from plain data parallelism. The gradient a rank updates with is the
// reduce-scatter's sum of its part where plain data parallelism uses the all-reduce's: on 2 ranks
// both are g0 + g1, bit for bit, so a step without clipping is identical; on more ranks MPI may
// add the ranks' contributions in another order (a few FP32 roundings of the sum). Clipping and
// the loss scaler's inf/NaN check use the sum over ranks of each shard's sum of squares and the
// MAX of each shard's flag (combine()), the same decision on every rank; the norm is added in
// another order than one process adds it, so the clipping coefficient can differ in its last
// bits. docs/distributed.md states the tolerances the tests use.
//
// Each function is a collective: every rank calls it, in the same order as its other collectives.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "mantissa/comm/communicator.h"
#include "mantissa/dist/factors.h"
#include "mantissa/dist/reducer.h"
#include "mantissa/optim/optim.h"

namespace mantissa::dist {

class Zero1 {
 public:
  // Shards `optimizer` (whose parameters must be the model's, in its order: the reducer's are
  // those of them that require grad) along `reducer`'s buckets, which must scatter
  // (ReducerOptions::scatter), and `factors`' weights (when given) in blocks of rows. Before the
  // optimizer's first step; after its master weights are made (amp::apply_precision), which it
  // cuts to the shard.
  Zero1(comm::Communicator& comm, Reducer& reducer, optim::Optimizer& optimizer,
        FactorGradients* factors = nullptr);
  // Waits for a gather still running (finish_gather) and removes the weights' hooks.
  ~Zero1();
  // A factored weight of `rows` rows on `ranks` ranks: the rows in a block, ceil(rows / ranks),
  // and the rows [first, end) of `rank`'s block (the last ranks' may be short or empty).
  static int64_t block_rows(int64_t rows, int ranks) { return (rows + ranks - 1) / ranks; }
  static std::pair<int64_t, int64_t> row_block(int64_t rows, int ranks, int rank) {
    const int64_t first = std::min<int64_t>(rank * block_rows(rows, ranks), rows);
    return {first, std::min<int64_t>(first + block_rows(rows, ranks), rows)};
  }
  Zero1(const Zero1&) = delete;
  Zero1& operator=(const Zero1&) = delete;

  // For optim::StepOptions::combine: the sum over ranks of the shards' sums of squares and whether
  // any shard found inf/NaN, in one FP64 all-reduce (of the sums and of the flags counted).
  std::function<std::pair<double, bool>(double, bool)> combine();

  // After a step that updated the parameters: each rank's updated part of every bucket to every
  // rank (an all-gather per bucket, in the parameters' dtype, or FP32 where a bucket mixes
  // dtypes: exact either way), written into the parameters. The gradient bucket's buffer holds
  // the gather when the gather dtype is no wider than the wire type (it is idle between steps);
  // otherwise a buffer of its own does. Then each factored weight's blocks of rows (an all-gather
  // per weight, in its dtype), which return before they finish: they run while the next forward
  // pass computes the layers below the weight, whose first read waits for them (the weight's
  // AutogradMeta::before_read, which ops::linear calls). Anything else that reads the parameters
  // (a checkpoint, the replicas' check, the end of training) calls finish_gather() first.
  void gather_parameters();
  // Waits for the factored weights' gathers of the last gather_parameters() (at once when they
  // are done, or none is running). Local: the other ranks need not call it.
  void finish_gather();

  // The optimizer's whole state, as an unsharded optimizer's state_tensors() would name and shape
  // it ("fc1.weight.exp_avg" of fc1.weight's shape, "fc1.weight.master"), assembled from every
  // rank's parts (bytes summed with zeros elsewhere: exact), one tensor at a time; for checkpoints.
  // Rank 0 gets the list; the other ranks take part and get an empty one.
  std::vector<std::pair<std::string, Tensor>> gathered_state() const;

  // The gathers so far (finished ones): bytes all-gathered (the buckets' and the factored
  // weights' padded sizes in their gather dtype), busy seconds (from a gather_parameters() call to
  // its last gather's end) and exposed seconds (the time gather_parameters() and finish_gather()
  // blocked); steps: gather_parameters() calls.
  const CommStats& total() const { return total_; }

 private:
  comm::Communicator& comm_;
  Reducer& reducer_;
  optim::Optimizer& optimizer_;
  std::vector<DType> gather_dtype_;  // [bucket]
  // [bucket]: (padded,) of gather_dtype_ where the bucket's own buffer is too small; else
  // undefined.
  std::vector<Tensor> gather_;
  // A weight whose gradient travels as factors: its rows, block_rows() of them a rank, and this
  // rank's block [first, end).
  struct RowBlocks {
    std::string name;
    Tensor* weight;
    int64_t rows, block_rows, row_size;  // row_size: elements of a row
    int64_t first, end;
  };
  std::vector<RowBlocks> row_blocks_;
  // The running gathers of the factored weights: [weight] requests and padded buffers (undefined
  // where the gather is in place), and when the gather_parameters() that started them began.
  std::vector<comm::Request> row_requests_;
  std::vector<Tensor> padded_;
  std::chrono::steady_clock::time_point started_{};
  bool rows_running_ = false;
  CommStats total_;
};

}  // namespace mantissa::dist

// The trainer's data-parallel side (docs/distributed.md): what the ranks of a job started by an
// MPI launcher do together around the steps the trainer runs on each of them.
//
//   at start    the ranks agree on the configuration (a field that differs is named), rank 0's
//               parameters and buffers are broadcast, the gradient reducer's hooks are set (and
//               with --zero 1 the optimizer is sharded), --sync-batchnorm joins the batch norms;
//   each step   the micro-batches before the last accumulate locally (no_sync), the last one's
//               backward pass reduces the gradients in buckets as they finish, finish_gradients()
//               waits; the update follows (ZeRO: each rank its shard, then an all-gather);
//               buffers (batch-norm statistics) come from rank 0 so the replicas stay identical;
//               one small all-reduce, started before the update, sums the step's figures
//               (losses, correct images) and the stop requests;
//   each call   waits for its steps' sums, so every rank prints, checks and stops alike;
//   at the end  the sharded state is gathered for the checkpoint rank 0 writes, and the ranks'
//               peak memory is gathered for the metrics.
// Every member function is a collective: every rank calls it at the same point of its loop.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mantissa/comm/communicator.h"
#include "mantissa/dist/agreement.h"
#include "mantissa/dist/factors.h"
#include "mantissa/dist/reducer.h"
#include "mantissa/dist/zero.h"
#include "mantissa/nn/models.h"
#include "mantissa/optim/optim.h"
#include "mantissa/train/config.h"
#include "mantissa/train/result.h"

namespace mantissa::train {

// The linear weights whose gradients travel as their factors on `ranks` ranks (dist/factors.h):
// where every pass is synchronised (no gradient accumulation, an FP32 wire, no FP8) and
// the factors of every rank's batch are at most half the gradient, for weights of at least 2^18
// values. DataParallel factors these; mantissa memory --ranks models them.
std::vector<nn::Module::NamedTensor> factored_weights(nn::Module& model, const TrainConfig& c,
                                                      const RunSettings& s, int ranks);

class DataParallel {
 public:
  // Checks that every rank runs the same configuration (dist::check_config_agreement over the
  // fields that shape the training; host-local ones such as --data-dir, --threads and the
  // loader's workers may differ) and refuses what cannot run distributed.
  DataParallel(comm::Communicator& comm, const TrainConfig& config, const RunSettings& settings);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }

  // Checks that every rank holds the same `fields` (a collective), as the constructor checks the
  // configuration: for what the ranks read from their own files (the data's sizes, a
  // checkpoint's position), which may differ where the flags agree.
  void check_agreement(const dist::ConfigFields& fields, const std::string& what,
                       const std::string& hint);

  // Rank 0's parameters and buffers to every rank: before the precision is applied (master
  // weights are made from the parameters).
  void broadcast_model(nn::Module& model);
  // The reducer's hooks on the model's parameters (after their dtypes are set), the ZeRO shards
  // of the optimizer, the batch norms joined; before the first step.
  void attach(nn::Module& model, optim::Optimizer& optimizer);

  // Before a backward pass: the weights whose gradients are formed from gathered factors keep
  // them as their producers (optim::Optimizer::defer_gradients), so the step forms each part
  // from every rank's factors as it updates it: no gradient of the weight's size is stored, and
  // the products are added and rounded a cached part at a time. The same bits as storing the
  // gradient; the trainer asks for it where one process would update in the backward pass.
  // Returns how many weights defer.
  size_t defer_factored_gradients(optim::Optimizer& optimizer);

  // The gradient-accumulation micro-batches before a step's last: gradients stay local.
  dist::Reducer::NoSync no_sync() { return reducer_->no_sync(); }
  // After the last micro-batch's backward pass: waits for the reduced gradients (and those formed
  // from gathered factors).
  void finish_gradients() {
    reducer_->finish();
    if (factors_) factors_->finish();
  }
  // What the step's options need (ZeRO: the norm and inf/NaN check over every shard).
  void prepare(optim::StepOptions& options);
  // After the optimizer's step: ZeRO's all-gather of the updated parameters (unless the step was
  // skipped, on every rank alike; the factored weights' gathers go on into the next forward
  // pass, see dist::Zero1::gather_parameters), rank 0's buffers (without --sync-batchnorm), and
  // with --check-replicas the check that every rank holds the same bits.
  void after_step(const optim::StepReport& report);
  // Waits for the parameters' gathers still running: before anything reads the parameters
  // other than the forward pass (a checkpoint, the end of training). Local.
  void finish_parameters();

  // Sums `values` over the ranks, in place (one FP64 all-reduce).
  void sum(std::vector<double>& values);
  // Starts that sum; the values hold it once the request's wait() returns (they are kept alive
  // until the all-reduce ends). The backend runs collectives in the order they start, so a sum
  // started before the update's gathers is not held up behind them.
  comm::Request start_sum(std::shared_ptr<std::vector<double>> values);
  // Whether any rank's flag is set.
  bool any(bool flag);
  // Every rank's value, by rank.
  std::vector<int64_t> gather(int64_t value);

  // The optimizer's state for a checkpoint as one process would hold it: under ZeRO gathered
  // from the shards (rank 0 gets it; the others an empty list), otherwise nullopt (each rank's
  // own state is the whole).
  std::optional<std::vector<std::pair<std::string, Tensor>>> gathered_optimizer_state();

  // The run's communication so far (per synchronised step).
  Communication communication() const;

 private:
  comm::Communicator& comm_;
  TrainConfig config_;
  RunSettings settings_;
  std::unique_ptr<dist::FactorGradients> factors_;
  std::unique_ptr<dist::Reducer> reducer_;
  std::unique_ptr<dist::Zero1> zero_;
  std::vector<nn::Module::NamedTensor> buffers_;   // the model's, broadcast after each step
  std::vector<nn::Module::NamedTensor> replicas_;  // parameters and buffers, --check-replicas
};

// The compute threads each of `local_ranks` ranks on one host takes: `threads` when it is set,
// and 0 (the default count) for one rank or when MANTISSA_NUM_THREADS decides; otherwise the
// host's cores divided among the ranks, at least one.
int rank_threads(int threads, int local_ranks);
// Applies the job's place to a run: the compute threads of this rank (rank_threads).
void set_rank_threads(const TrainConfig& config, const comm::Communicator& comm);

}  // namespace mantissa::train

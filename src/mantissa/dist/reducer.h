// The gradient reducer of data-parallel training (PyTorch DDP's Reducer): during each backward
// pass it sums the parameters' gradients over the ranks, in buckets launched as soon as they are
// complete, so that communication overlaps the rest of the backward pass.
//
//   dist::Reducer reducer(comm::world(), model->named_parameters());
//   autograd::backward(loss);       // buckets start their all-reduce as their gradients finish
//   reducer.finish();               // waits; every rank's gradients hold the sum over ranks
//   optimizer.step(...);            // with grad_scale 1/(loss_scale * world size) for the mean
//
// Buckets. Parameters go into buckets in the reverse of their registration order (the backward
// pass finishes the last layers first), each bucket a flat buffer of the wire type of at most
// bucket_cap_mib (a parameter larger than that gets one of its own), the first one at most
// first_bucket_mib so that the first all-reduce starts early. Parameters that do not require grad
// are left out. The layout depends only on the parameters and the options, so it is the same on
// every rank; the constructor checks that it is (a collective).
//
// Readiness. The constructor sets each parameter's AutogradMeta::on_grad_ready hook. When the
// backward pass has finished a parameter's gradient, the hook copies it into its bucket (on the
// thread running the backward pass); when a bucket holds all of its gradients it is ready, and
// ready buckets start an asynchronous all-reduce in bucket order: a bucket that is ready before
// an earlier one waits for it, so every rank issues the same all-reduces in the same order
// whatever order its backward pass finished them in.
//
// finish() copies in the gradients of parameters the pass did not reach (their current gradient,
// or zeros), starts the remaining buckets, waits for all of them in order and writes each result
// back into the gradients (created where a parameter had none: after finish() every parameter
// in a bucket has a gradient, the same on every rank). Every rank must call it after every
// synchronised backward pass. Where the bucket already holds the result in the gradient's type
// (an f32 wire, FP32 gradients, kSum, no scatter) the gradient becomes a view of its place in
// the bucket instead of a copy (PyTorch DDP's gradient_as_bucket_view): it keeps the bucket's
// storage alive, and holds the sum until the gradient is zeroed or replaced.
//
// Wire type. f32: the bucket holds the gradients converted to FP32 and the all-reduce sums them.
// f16/bf16 (DDP's fp16_compress_hook): each gradient is divided by the number of ranks N in FP32
// before it is rounded into the bucket, so the 16-bit sum cannot overflow where the FP32 sum of
// the mean would not; the all-reduce uses comm/half_reduce.h's sum (rounded after each
// combination) and the result is widened back to FP32. Half the bytes on the wire.
//
// Result. kSum (default): each gradient ends as the sum over ranks, as gradient accumulation over
// N micro-batches leaves it; the optimizer's unscaling by 1/(scale * N) then gives the mean. With
// an f32 wire on 2 ranks this is bit for bit what one process accumulating the two ranks'
// gradients (g0 + g1) holds; with 16-bit wires the mean is multiplied back by N in FP32 (exact
// for powers of two). kMean: the mean over ranks (the f32 sum divided by N in FP32; the 16-bit
// result as it comes).
//
// Gradient accumulation: passes inside no_sync() leave the gradients local (the hooks do
// nothing and finish() returns at once); the first synchronised pass after them reduces the
// accumulated gradients.
//
// Scatter (ZeRO stage 1, dist/zero.h): each bucket, padded with zeros to a multiple of the ranks N,
// is split into N equal parts, and a reduce-scatter leaves rank r only the sum of part r; finish()
// writes that part back into the gradients (owned(param) says which elements of each parameter
// it is) and leaves the rest of each gradient as the backward pass made it. Half the traffic of
// an all-reduce; the parameters are then brought up to date by an all-gather (dist::Zero1).
//
// Not thread-safe: the backward passes and finish() run on one thread. A pass that throws leaves
// all-reduces running on some ranks: end the job (comm::Communicator::abort).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "mantissa/comm/communicator.h"
#include "mantissa/nn/module.h"

namespace mantissa::dist {

struct ReducerOptions {
  double bucket_cap_mib = 25;   // DDP's bucket_cap_mb, in bytes of the wire type
  double first_bucket_mib = 1;  // DDP's first bucket
  DType wire = DType::f32;      // f32, f16 or bf16
  enum class Result : uint8_t { kSum, kMean } result = Result::kSum;
  bool scatter = false;  // reduce-scatter: each rank gets the sum of its part of each bucket
};

// Communication figures, of the last synchronised pass or summed over all of them.
struct CommStats {
  int64_t steps = 0;  // synchronised passes reduced (finish() calls outside no_sync)
  // Bytes all-reduced: the buckets' sizes. A ring all-reduce sends and receives about
  // 2 (N - 1) / N times this per rank.
  int64_t bytes = 0;
  // Time finish() waited for all-reduces: the communication the backward pass did not hide.
  double exposed_seconds = 0;
  // Time at least one bucket's all-reduce was running (from its start by the backend to its end).
  double busy_seconds = 0;
};

class Reducer {
 public:
  using NamedTensor = nn::Module::NamedTensor;

  struct Bucket {
    // Indices into the parameters that require grad (the list given, frozen ones left out).
    std::vector<size_t> params;
    std::vector<int64_t> offsets;  // element offset of each in the bucket
    int64_t numel = 0;             // elements of the wire type
    // Elements on the wire: numel, rounded up to a multiple of the ranks when scattering; rank r's
    // part is elements [r * part, (r + 1) * part).
    int64_t padded = 0, part = 0;
  };

  // The buckets of parameters of `numels` elements (those that require grad, in registration
  // order) as a reducer over `ranks` ranks lays them out: a pure function of its arguments, for
  // planning memory without a job.
  static std::vector<Bucket> plan(const std::vector<int64_t>& numels, const ReducerOptions& options,
                                  int ranks);

  // A collective (the layout check). Throws Error if a parameter already has a ready hook (two
  // reducers), appears twice, or the ranks' parameters or options differ.
  Reducer(comm::Communicator& comm, const std::vector<NamedTensor>& params,
          ReducerOptions options = {});
  // Removes the hooks. Buckets still being reduced stay allocated until their all-reduce ends.
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Waits for every bucket and writes the reduced gradients back (see the file comment). Throws
  // Error if a parameter tensor was replaced since the reducer was made (a dtype cast: make the
  // reducer after casting the model).
  void finish();

  // While the returned guard lives, backward passes accumulate gradients locally.
  class [[nodiscard]] NoSync {
   public:
    ~NoSync();
    NoSync(NoSync&& other) noexcept;
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    NoSync& operator=(NoSync&&) = delete;

   private:
    friend class Reducer;
    explicit NoSync(Reducer* r);
    Reducer* reducer_;
    bool previous_;
  };
  NoSync no_sync();
  bool synchronising() const { return sync_; }

  const std::vector<Bucket>& buckets() const { return buckets_; }
  DType wire() const { return options_.wire; }
  const ReducerOptions& options() const { return options_; }
  // The parameters in buckets (those that require grad), in the order given.
  const std::vector<NamedTensor>& params() const { return params_; }
  // Scatter: the elements [begin, end) of params()[k] that lie in this rank's part of its bucket
  // (begin == end: none); without scatter, all of them.
  std::pair<int64_t, int64_t> owned(size_t k) const;
  // Bucket b's flat buffer ((padded,) of the wire type). Its contents matter only from a
  // synchronised backward pass to its finish(): between finish() and the next one, others may use
  // the memory (dist::Zero1 all-gathers the parameters in it).
  Tensor& storage(size_t b) { return storage_.at(b); }
  const CommStats& last_step() const { return last_; }
  const CommStats& total() const { return total_; }
  // The buckets in the order they became ready, and in the order their all-reduces started, in
  // the last synchronised pass (the second is always 0, 1, 2, ...).
  const std::vector<size_t>& ready_order() const { return ready_order_; }
  const std::vector<size_t>& launch_order() const { return launch_order_; }

 private:
  void on_ready(size_t param);
  void copy_in(size_t param);
  void copy_out(size_t bucket);
  void mark_ready(size_t param);
  void launch_ready_buckets();
  void reset_pass();

  comm::Communicator& comm_;
  ReducerOptions options_;
  std::vector<NamedTensor> params_;                  // those in buckets
  std::vector<std::shared_ptr<AutogradMeta>> meta_;  // [param]: where the hook is
  std::vector<size_t> bucket_of_;                    // [param]
  std::vector<size_t> slot_of_;                      // [param]: index in its bucket
  std::vector<Bucket> buckets_;
  std::vector<Tensor> storage_;  // [bucket]: (padded,) of the wire type
  std::vector<Tensor> parts_;    // scatter, [bucket]: (part,) of the wire type, this rank's sum

  // The pass in progress.
  bool sync_ = true;
  bool in_pass_ = false;                 // a hook fired since the last finish()
  std::vector<uint8_t> ready_;           // [param]
  std::vector<int64_t> pending_;         // [bucket]: parameters not ready yet
  size_t next_launch_ = 0;               // the next bucket to start
  std::vector<comm::Request> requests_;  // [bucket]
  std::vector<size_t> ready_order_, launch_order_;

  CommStats last_, total_;
};

}  // namespace mantissa::dist

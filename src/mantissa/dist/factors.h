// Sufficient factors (Xie et al.'s sufficient factor broadcasting): in data-parallel training a
// linear layer's weight gradient is dW = dY^T X, the product of the layer's output gradients
// (rows x out) and inputs (rows x in) over the batch. At a small batch the two factors are far
// smaller than dW (out x in): the tutorial CNN's fc1 at 12 images a rank has 12 x (100 + 41772)
// values against 100 x 41772. For such weights the ranks all-gather the factors instead of
// all-reducing the gradient, and every rank forms the gradient over every rank's batch itself:
// the product of each rank's factors as that rank's backward pass forms it (the op's own GEMM,
// the same bits), summed in rank order in FP32 and rounded to the gradient's type once, as the
// FP32 all-reduce of dist::Reducer sums the ranks' gradients (on 2 ranks the same bits; on more,
// the same sum, in rank order where MPI may add in another). More arithmetic, fewer bytes: each
// rank forms N products where it formed one.
//
//   dist::FactorGradients factors(comm, weights);  // sets AutogradMeta::gather_grad_factors
//   autograd::backward(loss);                      // each such layer gathers its factors
//   factors.finish();                              // every weight's gradient is the sum over ranks
//
// Where the optimizer keeps the weight's gradient as its producer this pass (the op hands the
// deferral over with GradFactorCall::defer: train::DataParallel::defer_factored_gradients), no
// gradient is formed: the producer keeps every rank's factors and gives the same values a part at
// a time (kernels::linear_weight_grad_parts_sum), and the weight has no grad after finish().
//
// A weight whose gradient a pass computed some other way (an op without factors read it) is
// all-reduced by finish() instead. A weight read in one pass both by an op that gathers factors
// and by one that does not would get a global and a local part: the trainer factors only the
// weights of nn::Linear layers, which their own op alone reads. Every pass must be synchronised: no
// gradient accumulation inside no_sync (those passes would form global gradients), and the weights
// are not in a dist::Reducer. The gathers run inside the backward pass, in the order it reaches the
// weights, the same on every rank; each op's input factor is gathered from its forward pass on
// (AutogradMeta::gather_input_factor), so that it travels while the layers above it run, and its
// backward gathers only its output gradients then.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "mantissa/comm/communicator.h"
#include "mantissa/dist/reducer.h"
#include "mantissa/nn/module.h"

namespace mantissa::dist {

class FactorGradients {
 public:
  // A collective (the ranks must name the same weights, of the same shapes). Throws Error if a
  // weight does not require grad or already has the hook.
  FactorGradients(comm::Communicator& comm, const std::vector<nn::Module::NamedTensor>& weights);
  // Removes the hooks.
  ~FactorGradients();
  FactorGradients(const FactorGradients&) = delete;
  FactorGradients& operator=(const FactorGradients&) = delete;

  // After a synchronised backward pass: all-reduces the gradient of each weight whose factors the
  // pass did not gather (if it has one), and counts the pass.
  void finish();

  const std::vector<nn::Module::NamedTensor>& weights() const { return weights_; }
  // The rows [begin, end) of weight k's gradient that this rank's optimizer updates (its ZeRO
  // shard, dist::Zero1): a deferred gradient's producer forms those rows alone, the same bits as
  // in the whole gradient. Every row until set.
  void set_rows(size_t k, int64_t begin, int64_t end);
  // bytes: the factors gathered (every rank's, as received); exposed and busy seconds: the time
  // the gathers and finish()'s all-reduces took (the pass waits for them).
  const CommStats& total() const { return total_; }
  // How many backward passes took a weight's input factor from their forward pass's gather.
  int64_t inputs_gathered_in_forward() const { return early_used_; }

 private:
  Tensor gather(size_t k, const GradFactorCall& call);
  // The forward pass's gather of weight k's input factor.
  void gather_input(size_t k, const Tensor& b);

  // Weight k's input factor gathered from the forward pass: the tensor it was (its data and
  // shape, which the backward's factor must match to use it), every rank's rows, and the
  // gathered (ranks, max_rows, in) tensor once `done` has finished.
  struct EarlyInput {
    const void* data = nullptr;
    Shape shape;
    std::vector<int64_t> rows;
    Tensor all;
    comm::Request done;
  };

  comm::Communicator& comm_;
  std::vector<nn::Module::NamedTensor> weights_;
  std::vector<std::shared_ptr<AutogradMeta>> meta_;
  std::vector<uint8_t> gathered_;  // [weight]: this pass formed its gradient from factors
  std::vector<std::pair<int64_t, int64_t>> rows_;  // [weight]: the rows a deferred producer forms
  std::vector<EarlyInput> early_;                  // [weight]: from this pass's forward
  int64_t early_used_ = 0;
  CommStats total_;
};

}  // namespace mantissa::dist

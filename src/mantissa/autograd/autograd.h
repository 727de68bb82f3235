// Reverse-mode automatic differentiation: the engine. Ops (src/mantissa/ops) record a Node for
// each result that needs a gradient; backward() walks the recorded graph from a root in reverse
// topological order, calling each node once with the sum of the gradients of its output.
//
// Gradients are stored in the dtype of their tensor (an f16 parameter gets an f16 gradient) unless
// the leaf sets AutogradMeta::grad_dtype (the accumulation type),
// computed in FP32; a gradient reaching a leaf twice is accumulated into the existing one.
#pragma once

#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "mantissa/core/error.h"
#include "mantissa/core/tensor.h"

namespace mantissa::autograd {

// Whether ops record (true by default, per thread).
bool grad_enabled();

// Ops called while one of these is alive record nothing (the optimizer step, evaluation).
class NoGradScope {
 public:
  NoGradScope();
  ~NoGradScope();
  NoGradScope(const NoGradScope&) = delete;
  NoGradScope& operator=(const NoGradScope&) = delete;

 private:
  bool previous_;
};

// The module whose forward runs on this thread ("layer1.0.conv1"; "" outside modules), kept by
// core/memory.h as the owner of allocations: nodes recorded meanwhile remember it, and backward
// runs each node under it again, so gradients are charged to their layer.
using mantissa::current_module_path;
using mantissa::ModulePathScope;

// ---- Anomaly detection (the answer to the IPU's floating-point exception traps) ----
// While a guard is alive on this thread, every op's output (forward, checked by the ops layer)
// and every gradient a node computes (backward, checked here) is checked for inf and NaN; the
// first one throws AnomalyError naming the op, the module path, the dtype and statistics of
// the op's inputs. inf_in_backward = false lets infinite gradients through (only NaN stops):
// under loss scaling an infinite scaled gradient is the scaler's overflow signal, not a fault.
class DetectAnomalyScope {
 public:
  explicit DetectAnomalyScope(bool inf_in_backward = true);
  ~DetectAnomalyScope();
  DetectAnomalyScope(const DetectAnomalyScope&) = delete;
  DetectAnomalyScope& operator=(const DetectAnomalyScope&) = delete;

 private:
  int previous_;
};
bool detect_anomaly();

class AnomalyError : public Error {
 public:
  using Error::Error;
};

// Number of inf/NaN values of t.
int64_t count_nonfinite(const Tensor& t);
// "f16 (12, 100): min -3.25, max 4.5, largest |x| 4.5, 0 of 1200 inf/nan".
std::string describe_values(const Tensor& t);

// Ops record again while one of these is alive, inside a NoGradScope (recomputation runs a
// forward inside the backward pass).
class EnableGradScope {
 public:
  EnableGradScope();
  ~EnableGradScope();
  EnableGradScope(const EnableGradScope&) = delete;
  EnableGradScope& operator=(const EnableGradScope&) = delete;

 private:
  bool previous_;
};

// A recorded op. It keeps only what its backward needs (subclasses hold those tensors).
class Node {
 public:
  virtual ~Node() = default;
  virtual const char* name() const = 0;
  // The module whose forward recorded it ("" outside modules).
  const std::string& module_path() const { return module_path_; }
  // Gradients of the inputs, given the gradient of the output (same shape and dtype as the
  // output). One entry per input; an undefined tensor where an input needs none. A node may write
  // an input's gradient over grad_output where may_overwrite(grad_output) holds (the caller's
  // handle is the only reference): the engine passes a gradient it will not read again; any other
  // caller passes one it keeps a second handle to.
  virtual std::vector<Tensor> backward(const Tensor& grad_output) = 0;
  // Drops what backward() needed (the saved tensors): the engine calls it once the node's
  // gradients have gone out, so a pass frees each op's activations as it goes, not at its end.
  // A later backward() through the node is an error (the graph is walked once, as PyTorch's
  // without retain_graph).
  virtual void release() {}

  // Where each input's gradient goes: the node that computed it, or the leaf's state.
  struct Input {
    std::shared_ptr<Node> fn;
    std::shared_ptr<AutogradMeta> leaf;
    Shape shape;
    DType dtype = DType::f32;
    bool needs_grad() const { return fn != nullptr || leaf != nullptr; }
  };
  const std::vector<Input>& inputs() const { return inputs_; }
  bool needs_input_grad(size_t i) const { return i < inputs_.size() && inputs_[i].needs_grad(); }

 private:
  friend void record_many(Tensor&, std::shared_ptr<Node>, const std::vector<const Tensor*>&);
  std::vector<Input> inputs_;
  std::string module_path_;
};

// For an op whose backward can compute a leaf input's gradient in parts (AutogradMeta::
// consume_grad_parts): the part consumer of input i of `node`, when that input is a leaf whose
// gradient of this pass goes to an update in the backward pass (the leaf gets no other gradient)
// and anomaly detection is off; empty otherwise. Taking it clears the
// leaf's consumers: the op must then give every element of the gradient to it and return no
// gradient for that input.
GradPartConsumer take_grad_part_consumer(const Node& node, size_t i);
// The same for a gradient kept as its producer (AutogradMeta::defer_grad_parts): the deferral
// of input i of `node` when that input is a leaf whose only gradient of this pass the optimizer
// takes that way, and anomaly detection is off; empty otherwise. Taking it clears the leaf's
// hook: the op must then give the deferral a producer of every element of the gradient (with an
// upper bound of their magnitudes, or +infinity) and return no gradient for that input.
GradPartDeferral take_grad_part_deferral(const Node& node, size_t i);

// For an op whose gradient of a leaf input is a product of two factors (AutogradMeta::
// gather_grad_factors): that hook of input i of `node` when the input is a leaf that has one (the
// op then returns what the hook gives as the input's gradient); empty otherwise.
std::function<Tensor(const GradFactorCall&)> grad_factor_gatherer(const Node& node, size_t i);

// Whether a node's backward may write over the gradient it was given: the engine holds the only
// reference to its storage (no other node, leaf, hook, caller or view does) and anomaly
// detection, which reads it after the node ran, is off. An elementwise backward then writes its
// input's gradient there (same dtype) instead of allocating a second buffer of the same size.
bool may_overwrite(const Tensor& grad_output);

// Whether an op on these inputs must record: grad mode is on and an input requires grad.
bool needs_grad(std::initializer_list<const Tensor*> inputs);

// Attaches `node` to `out` as the op that computed it from `inputs` (undefined inputs allowed,
// e.g. an absent bias).
void record(Tensor& out, std::shared_ptr<Node> node, std::initializer_list<const Tensor*> inputs);
// The same for a variable number of inputs (cat).
void record_many(Tensor& out, std::shared_ptr<Node> node, const std::vector<const Tensor*>& inputs);

// Computes the gradient of `root` with respect to every leaf that requires grad and accumulates
// it into the leaf's grad(). `root` must be a one-element tensor unless `grad_root` (its
// gradient) is given. A leaf's AutogradMeta::on_grad_ready hook runs as soon as the leaf's
// gradient of this pass is complete (the contributions are counted when the graph is walked
// before any node runs), so leaves become ready in the order the pass finishes them: roughly the
// reverse of the order the forward pass used them.
// Each node drops what it saved once its gradients have gone out (Node::release), so a graph is
// walked once: a second pass through a node of it throws when it reaches that node, after the
// nodes before it have added their gradients (and an optimizer updating in the backward pass may
// have applied them). retain_graph keeps every node's saved tensors for another pass (PyTorch's
// flag of that name), at the cost of holding them until the graph is dropped.
void backward(const Tensor& root, const Tensor& grad_root = Tensor(), bool retain_graph = false);

}  // namespace mantissa::autograd

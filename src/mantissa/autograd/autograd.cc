#include "mantissa/autograd/autograd.h"

#include <cmath>
#include <cstdio>
#include <unordered_map>
#include <unordered_set>

#include "mantissa/core/error.h"
#include "mantissa/core/profiler.h"
#include "mantissa/kernels/elementwise.h"

namespace mantissa::autograd {

namespace {
thread_local bool t_grad_enabled = true;
// 0: off; 1: inf and NaN; 2: NaN only in backward (forward checks both).
thread_local int t_anomaly = 0;
// Backward passes running on this thread: more than one inside a node that runs a pass of its own
// (a recomputed module's backward).
thread_local int t_backward_depth = 0;
}  // namespace

bool grad_enabled() { return t_grad_enabled; }

DetectAnomalyScope::DetectAnomalyScope(bool inf_in_backward) : previous_(t_anomaly) {
  t_anomaly = inf_in_backward ? 1 : 2;
}
DetectAnomalyScope::~DetectAnomalyScope() { t_anomaly = previous_; }
bool detect_anomaly() { return t_anomaly != 0; }

int64_t count_nonfinite(const Tensor& t) {
  if (!t.defined() || !is_compute_float(t.dtype())) return 0;
  int64_t n = 0;
  for (float v : t.to_float_vector()) n += !std::isfinite(v);
  return n;
}

std::string describe_values(const Tensor& t) {
  if (!t.defined()) return "undefined";
  std::string s = std::string(dtype_name(t.dtype())) + " " + shape_str(t.shape());
  if (!is_compute_float(t.dtype()) || t.numel() == 0) return s;
  float lo = INFINITY, hi = -INFINITY, big = 0;
  int64_t bad = 0;
  for (float v : t.to_float_vector()) {
    if (!std::isfinite(v)) {
      ++bad;
      continue;
    }
    lo = std::min(lo, v);
    hi = std::max(hi, v);
    big = std::max(big, std::fabs(v));
  }
  char buf[200];
  if (bad == t.numel())
    std::snprintf(buf, sizeof buf, ": all %lld values inf/nan", static_cast<long long>(bad));
  else
    std::snprintf(buf, sizeof buf, ": min %.6g, max %.6g, largest |x| %.6g, %lld of %lld inf/nan",
                  static_cast<double>(lo), static_cast<double>(hi), static_cast<double>(big),
                  static_cast<long long>(bad), static_cast<long long>(t.numel()));
  return s + buf;
}

NoGradScope::NoGradScope() : previous_(t_grad_enabled) { t_grad_enabled = false; }
NoGradScope::~NoGradScope() { t_grad_enabled = previous_; }
EnableGradScope::EnableGradScope() : previous_(t_grad_enabled) { t_grad_enabled = true; }
EnableGradScope::~EnableGradScope() { t_grad_enabled = previous_; }

bool needs_grad(std::initializer_list<const Tensor*> inputs) {
  if (!t_grad_enabled) return false;
  for (const Tensor* t : inputs)
    if (t && t->defined() && t->requires_grad()) return true;
  return false;
}

void record(Tensor& out, std::shared_ptr<Node> node, std::initializer_list<const Tensor*> inputs) {
  record_many(out, std::move(node), std::vector<const Tensor*>(inputs));
}

void record_many(Tensor& out, std::shared_ptr<Node> node,
                 const std::vector<const Tensor*>& inputs) {
  node->inputs_.clear();
  node->module_path_ = current_module_path();
  for (const Tensor* t : inputs) {
    Node::Input in;
    if (t && t->defined()) {
      in.shape = t->shape();
      in.dtype = t->dtype();
      if (t->requires_grad()) {
        if (t->grad_fn()) {
          in.fn = t->grad_fn();
        } else {
          in.leaf = t->autograd_meta();
          // A stand-in's gradient is computed in its leaf's type; a leaf read as 16-bit
          // (AutogradMeta::read_as) has it computed in that type.
          in.dtype = in.leaf->read_as.value_or(in.leaf->dtype);
        }
      }
    }
    node->inputs_.push_back(std::move(in));
  }
  out.set_grad_fn(std::move(node));
}

namespace {

// a += b (same shape), computed in FP32, stored in a's dtype.
void accumulate(Tensor& into, const Tensor& g) {
  if (!into.defined()) {
    into = g;
    return;
  }
  into = kernels::add(into, g, into.dtype(), MemoryCategory::gradients);
}

// Takes g by value: callers move their handle in, so a gradient nobody else holds is adopted
// without a copy.
void accumulate_leaf(AutogradMeta& meta, Tensor g, DType tensor_dtype) {
  const DType dtype = meta.grad_dtype.value_or(tensor_dtype);
  if (meta.consume_grad && !meta.grad) {
    // The leaf's only gradient of this pass goes to its optimizer update, in the type `grad`
    // would have held.
    const Tensor c = (g.dtype() == dtype ? std::move(g) : g.to(dtype)).contiguous();
    meta.consume_grad(0, c.numel(), c.data_ptr(), dtype);
    meta.consume_grad = nullptr;
    meta.consume_grad_parts = nullptr;
    return;
  }
  Tensor converted = g.dtype() == dtype ? std::move(g) : g.to(dtype);
  if (!meta.grad) {
    // Own the gradient's memory: a gradient that is a view of something else would alias.
    Tensor own = converted.storage().use_count() > 1 || !converted.is_contiguous()
                     ? converted.clone()
                     : converted;
    if (own.storage()->category() != MemoryCategory::gradients)
      own.storage()->recharge(MemoryCategory::gradients, own.storage()->owner());
    meta.grad = std::make_unique<Tensor>(own.detach());
    return;
  }
  *meta.grad = kernels::add(*meta.grad, converted, dtype, MemoryCategory::gradients).detach();
}

// Anomaly detection in backward: the first gradient with inf/NaN (NaN only when asked) stops.
void check_gradients(const Node& node, const Tensor& grad_output,
                     const std::vector<Tensor>& grads) {
  for (size_t i = 0; i < grads.size(); ++i) {
    const Tensor& gi = grads[i];
    if (!gi.defined() || !is_compute_float(gi.dtype())) continue;
    int64_t bad = 0;
    for (float v : gi.to_float_vector()) bad += t_anomaly == 1 ? !std::isfinite(v) : std::isnan(v);
    if (bad == 0) continue;
    const std::string where = node.module_path().empty() ? "outside any module"
                                                         : "in module '" + node.module_path() + "'";
    throw AnomalyError(
        "anomaly in backward: the gradient of " + std::string(node.name()) + " " + where +
            " for its input " + std::to_string(i) + " has " + std::to_string(bad) + " " +
            (t_anomaly == 1 ? "inf/nan" : "nan") + " values (" + describe_values(gi) +
            ")\n  gradient of its output: " + describe_values(grad_output),
        is_16bit_float(gi.dtype())
            ? "a 16-bit gradient overflowed or lost its range: scale the loss down (or use "
              "dynamic loss scaling), keep this module in FP32 (--keep-fp32), or use bf16"
            : "lower the learning rate, or clip gradients (--max-grad-norm)");
  }
}

}  // namespace

GradPartConsumer take_grad_part_consumer(const Node& node, size_t i) {
  if (i >= node.inputs().size() || t_anomaly) return {};
  const Node::Input& in = node.inputs()[i];
  if (in.fn || !in.leaf) return {};
  AutogradMeta& meta = *in.leaf;
  if (!meta.consume_grad || !meta.consume_grad_parts || meta.grad) return {};
  GradPartConsumer consume = meta.consume_grad_parts();
  meta.consume_grad = nullptr;
  meta.consume_grad_parts = nullptr;
  return consume;
}

GradPartDeferral take_grad_part_deferral(const Node& node, size_t i) {
  if (i >= node.inputs().size() || t_anomaly) return {};
  const Node::Input& in = node.inputs()[i];
  if (in.fn || !in.leaf) return {};
  AutogradMeta& meta = *in.leaf;
  if (!meta.defer_grad_parts || meta.grad) return {};
  GradPartDeferral defer = std::move(meta.defer_grad_parts);
  meta.defer_grad_parts = nullptr;
  return defer;
}

std::function<Tensor(const GradFactorCall&)> grad_factor_gatherer(const Node& node, size_t i) {
  if (i >= node.inputs().size()) return {};
  const Node::Input& in = node.inputs()[i];
  if (in.fn || !in.leaf) return {};
  return in.leaf->gather_grad_factors;
}

bool may_overwrite(const Tensor& grad_output) {
  return !t_anomaly && grad_output.defined() && grad_output.storage() &&
         grad_output.storage().use_count() == 1;
}

void backward(const Tensor& root, const Tensor& grad_root, bool retain_graph) {
  MANTISSA_CHECK(root.defined(), "backward: the root tensor is undefined",
                 "call backward on a computed tensor");
  MANTISSA_CHECK(
      root.requires_grad(),
      "backward: the root does not require grad (no input of it requires grad, or it was computed "
      "under NoGradScope)",
      "mark the leaves with set_requires_grad() before computing the root");
  Tensor seed = grad_root;
  if (!seed.defined()) {
    MANTISSA_CHECK(root.numel() == 1,
                   "backward: the root has " + std::to_string(root.numel()) +
                       " elements; without an explicit "
                       "gradient it must be a scalar",
                   "reduce it (sum, mean) or pass its gradient");
    seed = Tensor::full(root.shape(), 1.0, root.dtype(), charged_to(MemoryCategory::gradients));
  }
  MANTISSA_CHECK(seed.shape() == root.shape(),
                 "backward: gradient of shape " + shape_str(seed.shape()) +
                     " for a root of shape " + shape_str(root.shape()),
                 "pass a gradient of the root's shape");
  NoGradScope no_record;
  // Ready hooks belong to the outermost pass: a pass nested in a node (a recomputed module
  // accumulating its parameters' gradients) contributes to gradients the outer pass has edges
  // for, and the outer pass calls the hooks once those edges are done.
  struct Depth {
    Depth() { ++t_backward_depth; }
    ~Depth() { --t_backward_depth; }
  } depth;
  const bool outermost = t_backward_depth == 1;
  if (!root.grad_fn()) {  // the root is itself a leaf
    AutogradMeta& meta = *root.autograd_meta();
    if (meta.on_grad_ready) meta.consume_grad = nullptr, meta.consume_grad_parts = nullptr;
    meta.defer_grad_parts = nullptr;  // a root's gradient is the seed: stored
    accumulate_leaf(meta, seed, root.dtype());
    if (meta.on_grad_ready && outermost) meta.on_grad_ready();
    return;
  }
  // Reverse topological order by depth-first search (iterative: graphs can be deep).
  std::vector<Node*> order;
  std::unordered_set<Node*> seen;
  std::vector<std::pair<Node*, size_t>> stack{{root.grad_fn().get(), 0}};
  seen.insert(root.grad_fn().get());
  while (!stack.empty()) {
    auto& [node, next] = stack.back();
    if (next < node->inputs().size()) {
      Node* child = node->inputs()[next++].fn.get();
      if (child && seen.insert(child).second) stack.emplace_back(child, 0);
      continue;
    }
    order.push_back(node);
    stack.pop_back();
  }
  // A gradient consumer (an update during the backward pass) needs the leaf's whole gradient at
  // once: a leaf that will get several (a shared weight) or already has one keeps the ordinary
  // accumulation, and so does a leaf whose ready hook needs its gradient.
  std::unordered_map<AutogradMeta*, int> uses;
  // Edges into leaves with a ready hook not yet taken in this pass: at 0 the leaf's gradient is
  // complete. Every edge of the graph counts, whether or not a gradient flows along it, so the
  // hook fires once for every hooked leaf the graph reaches.
  std::unordered_map<AutogradMeta*, int> edges_left;
  for (Node* node : order)
    for (const Node::Input& in : node->inputs()) {
      if (in.leaf && (in.leaf->consume_grad || in.leaf->defer_grad_parts)) ++uses[in.leaf.get()];
      if (in.leaf && in.leaf->on_grad_ready && outermost) ++edges_left[in.leaf.get()];
    }
  for (auto& [meta, count] : uses)
    if (count > 1 || meta->grad || meta->on_grad_ready) {
      meta->consume_grad = nullptr, meta->consume_grad_parts = nullptr;
      meta->defer_grad_parts = nullptr;
    }
  // After a node's gradients have gone out (or it got none): the hooks of leaves it completed.
  auto edges_done = [&edges_left](const Node& node) {
    if (edges_left.empty()) return;
    for (const Node::Input& in : node.inputs()) {
      if (!in.leaf) continue;
      const auto left = edges_left.find(in.leaf.get());
      if (left == edges_left.end() || --left->second > 0) continue;
      if (in.leaf->on_grad_ready) in.leaf->on_grad_ready();
    }
  };
  std::unordered_map<Node*, Tensor> pending;
  pending[root.grad_fn().get()] = seed;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    Node* node = *it;
    auto found = pending.find(node);
    if (found == pending.end()) {  // no gradient flowed here
      edges_done(*node);
      continue;
    }
    Tensor g = std::move(found->second);
    pending.erase(found);
    ModulePathScope module(&node->module_path());
    ProfileTimer timed("backward", node->module_path(), node->name());
    std::vector<Tensor> grads = node->backward(g);
    MANTISSA_CHECK(grads.size() == node->inputs().size(),
                   std::string("internal: ") + node->name() + " returned " +
                       std::to_string(grads.size()) + " gradients for " +
                       std::to_string(node->inputs().size()) + " inputs",
                   "report this as a bug");
    if (t_anomaly) check_gradients(*node, g, grads);
    g = Tensor();  // a gradient the node wrote over is held by `grads` alone: a leaf adopts it
    if (!retain_graph) node->release();
    for (size_t i = 0; i < grads.size(); ++i) {
      const Node::Input& in = node->inputs()[i];
      if (!in.needs_grad() || !grads[i].defined()) continue;
      MANTISSA_CHECK(grads[i].shape() == in.shape,
                     std::string("internal: ") + node->name() + " gave input " + std::to_string(i) +
                         " a gradient of shape " + shape_str(grads[i].shape()) + " for shape " +
                         shape_str(in.shape),
                     "report this as a bug");
      if (in.fn)
        accumulate(pending[in.fn.get()], grads[i]);
      else
        accumulate_leaf(*in.leaf, std::move(grads[i]), in.dtype);
    }
    edges_done(*node);
  }
}

}  // namespace mantissa::autograd

#include "mantissa/nn/module.h"

#include <cstdio>
#include <optional>
#include <set>
#include <sstream>

#include "mantissa/autograd/autograd.h"
#include "mantissa/core/error.h"
#include "mantissa/core/profiler.h"
#include "mantissa/nn/layers.h"
#include "mantissa/nn/numerics.h"
#include "mantissa/ops/autocast.h"
#include "mantissa/ops/ops.h"

namespace mantissa::nn {
namespace {

bool is_float(DType t) { return is_floating(t); }

bool keeps_f32(const std::string& buffer_name) {
  return buffer_name == "running_mean" || buffer_name == "running_var";
}

std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

}  // namespace

Tensor Module::forward(const Tensor&) {
  throw Error(type_ + " has no forward of its own",
              "call the layers inside it, or a container (Sequential, a model) that chains them");
}

Tensor& Module::register_parameter(const std::string& name, Tensor t) {
  MANTISSA_CHECK(t.defined(), type_ + ": parameter '" + name + "' is undefined", "");
  for (auto& p : params_)
    MANTISSA_CHECK(p.first != name, type_ + ": parameter '" + name + "' registered twice", "");
  if (t.storage()) t.storage()->recharge(MemoryCategory::parameters, name);
  t.set_requires_grad(true);
  params_.emplace_back(name, std::make_unique<Tensor>(std::move(t)));
  return *params_.back().second;
}

Tensor& Module::register_buffer(const std::string& name, Tensor t) {
  MANTISSA_CHECK(t.defined(), type_ + ": buffer '" + name + "' is undefined", "");
  if (t.storage()) t.storage()->recharge(MemoryCategory::parameters, name);
  buffers_.emplace_back(name, std::make_unique<Tensor>(std::move(t)));
  return *buffers_.back().second;
}

void Module::add_child(const std::string& name, std::shared_ptr<Module> m) {
  MANTISSA_CHECK(m != nullptr, type_ + ": sub-module '" + name + "' is null", "");
  for (auto& c : children_)
    MANTISSA_CHECK(c.first != name, type_ + ": sub-module '" + name + "' registered twice", "");
  // A module that is this one or holds it would make the tree a cycle, which every walk of it
  // (parameters, state_dict, printing) would follow forever.
  std::vector<const Module*> todo{m.get()};
  while (!todo.empty()) {
    const Module* x = todo.back();
    todo.pop_back();
    MANTISSA_CHECK(
        x != this,
        type_ + ": sub-module '" + name + "' is " +
            (m.get() == this ? std::string("this module itself") : "a module that holds this one") +
            ": the modules would form a cycle",
        "register a module only under a module it does not hold");
    for (const auto& c : x->children_) todo.push_back(c.second.get());
  }
  m->set_path(join(path_, name));
  children_.emplace_back(name, std::move(m));
}

void Module::set_path(const std::string& path) {
  path_ = path;
  register_layer_name(path_);
  for (auto& [name, child] : children_) child->set_path(join(path_, name));
}

namespace {
thread_local bool t_recomputing = false;

// The backward of a recomputed module: runs the module's forward again (recording this time) on
// the saved input, under the op context and random state of the first run, and backpropagates
// the output's gradient through it. Parameter gradients accumulate there directly; the input's
// is returned. Parameters are inputs of the node only so that it runs when they need gradients.
class RecomputeNode : public autograd::Node {
 public:
  RecomputeNode(Module* m, Tensor input, std::vector<std::pair<Module*, std::vector<uint64_t>>> rng)
      : module_(m),
        input_(std::move(input)),
        rng_(std::move(rng)),
        context_(ops::OpContextSnapshot::save()),
        random_(random_context()) {}
  const char* name() const override { return "recompute"; }
  std::vector<Tensor> backward(const Tensor& grad_output) override {
    MANTISSA_CHECK(!released_,
                   "backward() reached a recomputed module a second time: its saved input was "
                   "freed by the first pass",
                   "run the forward again before another backward()");
    std::vector<Tensor> grads(inputs().size());
    Tensor y, x;
    {
      autograd::EnableGradScope grad;
      ops::OpContextRestore context(context_);
      Replay replay(*this);
      x = input_.detach();
      if (needs_input_grad(0)) x.set_requires_grad(true);
      y = module_->call(x);
    }
    if (y.requires_grad()) autograd::backward(y, grad_output);
    if (needs_input_grad(0)) grads[0] = x.grad();
    return grads;
  }
  void release() override {
    input_ = Tensor();
    released_ = true;
  }

 private:
  // While alive: the first run's random state (the step's context, the layers' counters) and
  // the recomputing flag; what was there before comes back, also when the forward throws.
  class Replay {
   public:
    explicit Replay(const RecomputeNode& n)
        : node_(n), outer_(random_context()), was_(t_recomputing) {
      set_random_context(n.random_);
      for (auto& [m, state] : n.rng_) {
        now_.push_back(m->random_state());
        m->set_random_state(state);
      }
      t_recomputing = true;
    }
    ~Replay() {
      t_recomputing = was_;
      set_random_context(outer_);
      for (size_t i = 0; i < node_.rng_.size(); ++i) node_.rng_[i].first->set_random_state(now_[i]);
    }
    Replay(const Replay&) = delete;
    Replay& operator=(const Replay&) = delete;

   private:
    const RecomputeNode& node_;
    RandomContext outer_;
    bool was_;
    std::vector<std::vector<uint64_t>> now_;
  };

  Module* module_;
  Tensor input_;
  std::vector<std::pair<Module*, std::vector<uint64_t>>> rng_;
  ops::OpContextSnapshot context_;
  RandomContext random_;
  bool released_ = false;
};
// The numerics report's probe: an identity whose backward records the gradient reaching a
// module's output.
class ObserveNode : public autograd::Node {
 public:
  ObserveNode(NumericsRecorder* r, std::string layer, double scale)
      : recorder_(r), layer_(std::move(layer)), scale_(scale) {}
  const char* name() const override { return "observe"; }
  std::vector<Tensor> backward(const Tensor& g) override {
    recorder_->record(layer_, "activation_gradient", g, scale_);
    return {g};
  }

 private:
  NumericsRecorder* recorder_;
  std::string layer_;
  double scale_;
};

// Records a leaf module's output (and, through a probe, its gradient) when a report is on.
Tensor observe(const std::string& path, Tensor y) {
  NumericsRecorder* r = numerics_recorder();
  if (!r || !y.defined()) return y;
  // A recomputed forward was recorded the first time; it only gets its gradient probe (the first
  // run, without recording, could not have one).
  if (!t_recomputing) r->record(path, "activation", y);
  if (!y.requires_grad() || !autograd::grad_enabled()) return y;
  Tensor out = y.detach();
  autograd::record(out, std::make_shared<ObserveNode>(r, path, r->gradient_scale()), {&y});
  return out;
}

}  // namespace

bool recomputing() { return t_recomputing; }

Tensor Module::operator()(const Tensor& x) {
  if (recompute_ && autograd::grad_enabled() && !t_recomputing) return recomputed(x);
  return call(x);
}

Tensor Module::recomputed(const Tensor& x) {
  std::vector<const Tensor*> inputs{&x};
  for (Tensor* p : parameters())
    if (p->requires_grad()) inputs.push_back(p);
  bool any = false;
  for (const Tensor* t : inputs) any = any || (t->defined() && t->requires_grad());
  if (!any) return call(x);
  // The random state the forward starts from, for the replay.
  std::vector<std::pair<Module*, std::vector<uint64_t>>> rng;
  for (auto& [path, m] : named_modules())
    if (!m->random_state().empty()) rng.emplace_back(m, m->random_state());
  auto node = std::make_shared<RecomputeNode>(this, x.detach(), std::move(rng));
  Tensor y;
  {
    autograd::NoGradScope no_record;  // nothing inside is kept for backward
    y = call(x);
  }
  ops::ModulePathScope scope(&path_);
  autograd::record_many(y, node, inputs);
  return y;
}

Tensor Module::call(const Tensor& x) {
  ops::ModulePathScope scope(&path_);
  // Leaf layers only: a container's time is the sum of its layers'.
  std::optional<ProfileTimer> timed;
  if (children_.empty() && active_profiler())
    timed.emplace(t_recomputing ? "recompute" : "forward", path_, type_);
  Tensor y;
  if (!precision_) {
    y = forward(x);
  } else {
    ops::AutocastDisabled no_autocast;
    y = forward(x.defined() && is_float(x.dtype()) && x.dtype() != *precision_
                    ? ops::cast(x, *precision_)
                    : x);
  }
  return children_.empty() && numerics_recorder() ? observe(path_, std::move(y)) : y;
}

template <class F>
void Module::visit(const std::string& prefix, F&& f) {
  f(prefix, *this);
  for (auto& [name, child] : children_) child->visit(join(prefix, name), f);
}

std::vector<Module::NamedTensor> Module::named_parameters() {
  std::vector<NamedTensor> out;
  visit("", [&](const std::string& prefix, Module& m) {
    for (auto& [name, t] : m.params_) out.push_back({join(prefix, name), t.get()});
  });
  return out;
}

std::vector<Module::NamedTensor> Module::named_buffers() {
  std::vector<NamedTensor> out;
  visit("", [&](const std::string& prefix, Module& m) {
    for (auto& [name, t] : m.buffers_) out.push_back({join(prefix, name), t.get()});
  });
  return out;
}

std::vector<Tensor*> Module::parameters() {
  std::vector<Tensor*> out;
  for (auto& p : named_parameters()) out.push_back(p.tensor);
  return out;
}

std::vector<std::pair<std::string, Module*>> Module::named_modules() {
  std::vector<std::pair<std::string, Module*>> out;
  visit("", [&](const std::string& prefix, Module& m) { out.emplace_back(prefix, &m); });
  return out;
}

Module& Module::submodule(const std::string& path) {
  if (path.empty()) return *this;
  const size_t dot = path.find('.');
  const std::string head = path.substr(0, dot);
  for (auto& [name, child] : children_)
    if (name == head)
      return dot == std::string::npos ? *child : child->submodule(path.substr(dot + 1));
  std::string names;
  for (auto& [name, child] : named_modules())
    if (!name.empty()) names += (names.empty() ? "" : ", ") + name;
  throw Error(type_ + " has no sub-module '" + path + "'",
              "sub-modules are: " + (names.empty() ? std::string("(none)") : names));
}

int64_t Module::num_parameters() {
  int64_t n = 0;
  for (auto& p : named_parameters()) n += p.tensor->numel();
  return n;
}

void Module::train(bool on) {
  visit("", [&](const std::string&, Module& m) { m.training_ = on; });
}

Module& Module::to(DType dtype) {
  MANTISSA_CHECK(is_float(dtype), "cannot cast a module to " + std::string(dtype_name(dtype)),
                 "parameters are floating point: use f32, f16, bf16 (or e4m3/e5m2 storage)");
  cast_parameters(dtype);
  visit("", [&](const std::string&, Module& m) { m.precision_ = dtype; });
  return *this;
}

Module& Module::cast_parameters(DType dtype) {
  MANTISSA_CHECK(is_float(dtype), "cannot cast a module to " + std::string(dtype_name(dtype)),
                 "parameters are floating point: use f32, f16, bf16 (or e4m3/e5m2 storage)");
  // The copies are charged as the originals were (parameters, under the tensor's name).
  auto cast_into = [&](Tensor& t, bool requires_grad) {
    const std::string owner = t.storage() ? t.storage()->owner() : std::string();
    Tensor cast = t.detach().to(dtype);
    if (cast.storage()) cast.storage()->recharge(MemoryCategory::parameters, owner);
    if (requires_grad) cast.set_requires_grad(true);
    t = std::move(cast);
  };
  visit("", [&](const std::string&, Module& m) {
    m.precision_.reset();
    for (auto& [name, t] : m.params_)
      if (t->dtype() != dtype) cast_into(*t, true);
    for (auto& [name, t] : m.buffers_)
      if (is_float(t->dtype()) && t->dtype() != dtype && !keeps_f32(name)) cast_into(*t, false);
  });
  return *this;
}

void Module::zero_grad() {
  for (auto& p : named_parameters()) p.tensor->zero_grad();
}

Tensor& Module::param(const std::string& name) {
  for (auto& [n, t] : params_)
    if (n == name) return *t;
  throw Error(type_ + " has no parameter '" + name + "'", "");
}

bool Module::has_param(const std::string& name) const {
  for (auto& [n, t] : params_)
    if (n == name) return true;
  return false;
}

Tensor& Module::buffer(const std::string& name) {
  for (auto& [n, t] : buffers_)
    if (n == name) return *t;
  throw Error(type_ + " has no buffer '" + name + "'", "");
}

std::string Module::repr(int indent) const {
  std::string s = type_ + "(" + extra_repr();
  if (children_.empty()) return s + ")";
  const std::string pad(static_cast<size_t>(indent + 2), ' ');
  s += "\n";
  for (auto& [name, child] : children_)
    s += pad + "(" + name + "): " + child->repr(indent + 2) + "\n";
  return s + std::string(static_cast<size_t>(indent), ' ') + ")";
}

std::string Module::summary() {
  std::ostringstream os;
  os << repr() << "\n\n";
  char line[256];
  std::snprintf(line, sizeof line, "%-40s %-22s %-6s %12s\n", "name", "shape", "dtype", "elements");
  os << line;
  auto row = [&](const NamedTensor& t, const char* suffix) {
    std::snprintf(line, sizeof line, "%-40s %-22s %-6s %12lld%s\n", t.name.c_str(),
                  shape_str(t.tensor->shape()).c_str(),
                  std::string(dtype_name(t.tensor->dtype())).c_str(),
                  static_cast<long long>(t.tensor->numel()), suffix);
    os << line;
  };
  int64_t total = 0, trainable_bytes = 0, buffers = 0;
  for (auto& p : named_parameters()) {
    row(p, "");
    total += p.tensor->numel();
    trainable_bytes += static_cast<int64_t>(p.tensor->nbytes());
  }
  for (auto& b : named_buffers()) {
    row(b, "  (buffer)");
    buffers += b.tensor->numel();
  }
  os << "parameters: " << total << " (" << format_bytes(static_cast<size_t>(trainable_bytes))
     << "), buffer elements: " << buffers << "\n";
  return os.str();
}

std::vector<std::pair<std::string, Tensor>> Module::state_dict() {
  std::vector<std::pair<std::string, Tensor>> out;
  visit("", [&](const std::string& prefix, Module& m) {
    for (auto& [name, t] : m.params_) out.emplace_back(join(prefix, name), t->detach());
    for (auto& [name, t] : m.buffers_) out.emplace_back(join(prefix, name), t->detach());
  });
  return out;
}

void Module::load_state_dict(const std::map<std::string, Tensor>& tensors,
                             const std::string& source, bool strict) {
  std::set<std::string> used;
  auto load_into = [&](const std::string& name, Tensor& dst, bool is_param) {
    auto it = tensors.find(name);
    if (it == tensors.end()) {
      // Files from older PyTorch versions lack the batch counter; it only feeds momentum=None.
      if (name.ends_with("num_batches_tracked")) return;
      MANTISSA_CHECK(!strict, source + " has no tensor '" + name + "' that " + type_ + " needs",
                     "the file holds the weights of another model (or was saved before this "
                     "layer existed); check --model against the file");
      return;
    }
    used.insert(name);
    const Tensor& src = it->second;
    MANTISSA_CHECK(src.shape() == dst.shape(),
                   source + ": tensor '" + name + "' has shape " + shape_str(src.shape()) +
                       " but the model's is " + shape_str(dst.shape()),
                   "the file holds the weights of another model or another configuration "
                   "(image size, classes); check --model and --image-size");
    const bool src_float = is_float(src.dtype()), dst_float = is_float(dst.dtype());
    MANTISSA_CHECK(src_float == dst_float,
                   source + ": tensor '" + name + "' is " + std::string(dtype_name(src.dtype())) +
                       " where the model holds " + std::string(dtype_name(dst.dtype())),
                   "");
    Tensor d = dst.detach();
    d.copy_from(src);
    if (is_param) dst.zero_grad();
  };
  for (auto& p : named_parameters()) load_into(p.name, *p.tensor, true);
  for (auto& b : named_buffers()) load_into(b.name, *b.tensor, false);
  if (strict) {
    for (auto& [name, t] : tensors)
      MANTISSA_CHECK(used.count(name) != 0,
                     source + " holds tensor '" + name + "' that " + type_ + " does not have",
                     "the file holds the weights of another model; check --model against the file");
  }
}

void Module::name_storage(const std::string& prefix) {
  visit(prefix, [&](const std::string& p, Module& m) {
    for (auto& [name, t] : m.params_)
      if (t->storage()) t->storage()->recharge(MemoryCategory::parameters, join(p, name));
    for (auto& [name, t] : m.buffers_)
      if (t->storage()) t->storage()->recharge(MemoryCategory::parameters, join(p, name));
  });
}

}  // namespace mantissa::nn

#include "mantissa/ops/autocast.h"

#include <algorithm>
#include <set>
#include <string_view>

#include "mantissa/core/error.h"
#include "mantissa/io/input_file.h"
#include "mantissa/kernels/elementwise.h"
#include "mantissa/ops/ops.h"

namespace mantissa::ops {
namespace {

// The cast cache of the outermost scope: the 16-bit copy of each weight (a leaf that requires
// grad), keyed by its storage and the target type. The copies are stand-ins for their weights
// (Tensor::stand_in_for), so the gradient reaches the FP32 weight in FP32.
struct CastCache {
  std::map<std::pair<const void*, DType>, std::pair<Tensor, Tensor>> entries;  // (source, copy)
  size_t hits = 0, misses = 0;
};

struct Context {
  bool autocast = false;
  DType lower = DType::f16;
  const AutocastPolicy* policy = nullptr;
  AutocastLog* log = nullptr;
  CastCache* cache = nullptr;
  kernels::Partials partials = kernels::Partials::kF32;
  bool stochastic = false;
  uint64_t sr_seed = 0, sr_stream = 0;
  bool in_op = false;  // an OpCall is active: nested ops run as called
  Fp8Provider* fp8 = nullptr;
  bool read_as = false;  // a ReadAsScope is alive: parameters read as AutogradMeta::read_as says
};

thread_local Context ctx;

std::vector<OpId> parse_list(const std::vector<std::string>& names, const char* which,
                             std::set<OpId>& seen_here) {
  std::vector<OpId> out;
  for (const std::string& n : names) {
    const auto id = op_from_name(n);
    if (!id) {
      std::string all;
      for (const OpInfo& info : kOpInfo)
        if (info.category != AutocastCategory::kNever)
          all += (all.empty() ? "" : ", ") + std::string(info.name);
      throw Error("unknown op '" + excerpt(n) + "' in the " + which + " list",
                  "op names are: " + all);
    }
    MANTISSA_CHECK(op_info(*id).category != AutocastCategory::kNever,
                   "op '" + excerpt(n) + "' in the " + which + " list is never cast",
                   "remove it from the list");
    MANTISSA_CHECK(seen_here.insert(*id).second,
                   "op '" + excerpt(n) + "' is named twice in the " + which + " list",
                   "name each op once");
    out.push_back(*id);
  }
  return out;
}

}  // namespace

// ---- Policy ----

AutocastPolicy::AutocastPolicy() {
  for (int i = 0; i < kNumOps; ++i) categories_[static_cast<size_t>(i)] = kOpInfo[i].category;
}

void AutocastPolicy::set(OpId op, AutocastCategory c) {
  MANTISSA_CHECK(op_info(op).category != AutocastCategory::kNever || c == AutocastCategory::kNever,
                 std::string("op '") + std::string(op_info(op).name) + "' is never cast",
                 "leave its category as it is");
  MANTISSA_CHECK(
      c != AutocastCategory::kNever || op_info(op).category == AutocastCategory::kNever,
      std::string("op '") + std::string(op_info(op).name) + "' cannot be made a never-cast op",
      "choose lower precision, fp32, promote or follow input");
  categories_[static_cast<size_t>(op)] = c;
}

std::vector<OpId> AutocastPolicy::list(AutocastCategory c) const {
  std::vector<OpId> out;
  for (int i = 0; i < kNumOps; ++i)
    if (categories_[static_cast<size_t>(i)] == c) out.push_back(static_cast<OpId>(i));
  return out;
}

void AutocastPolicy::replace_lists(const std::optional<std::vector<std::string>>& lower,
                                   const std::optional<std::vector<std::string>>& fp32) {
  std::set<OpId> in_lower, in_fp32;
  const std::vector<OpId> lo =
      lower ? parse_list(*lower, "lower-precision", in_lower) : std::vector<OpId>{};
  const std::vector<OpId> hi = fp32 ? parse_list(*fp32, "FP32", in_fp32) : std::vector<OpId>{};
  for (OpId id : lo)
    MANTISSA_CHECK(!in_fp32.count(id),
                   std::string("op '") + std::string(op_info(id).name) +
                       "' is in both the lower-precision and the FP32 list",
                   "keep it in one of them");
  auto replace = [&](AutocastCategory c, const std::vector<OpId>& ids) {
    for (OpId id : list(c)) categories_[static_cast<size_t>(id)] = AutocastCategory::kFollowInput;
    for (OpId id : ids) categories_[static_cast<size_t>(id)] = c;
  };
  if (lower) replace(AutocastCategory::kLowerPrecision, lo);
  if (fp32) replace(AutocastCategory::kFp32, hi);
}

std::vector<std::string> read_op_list(const std::string& path) {
  const io::InputFile file(path, "op list", io::kMaxTextFileBytes, "check the file name");
  const std::string text = file.read_all();
  std::vector<std::string> out;
  int number = 0;
  for (size_t start = 0; start < text.size();) {
    const size_t newline = std::min(text.find('\n', start), text.size());
    std::string_view line(text.data() + start, newline - start);
    start = newline + 1;
    ++number;
    line = line.substr(0, line.find('#'));
    const size_t b = line.find_first_not_of(" \t\r");
    if (b == std::string_view::npos) continue;
    const size_t e = line.find_last_not_of(" \t\r");
    const std::string_view name = line.substr(b, e - b + 1);
    MANTISSA_CHECK(
        name.find_first_of(" \t,") == std::string_view::npos,
        path + " line " + std::to_string(number) + ": '" + excerpt(name) + "' is not one op name",
        "write one op name per line");
    // No op's name is this long; refused here so the unknown-op error never echoes a huge token.
    MANTISSA_CHECK(
        name.size() <= 64,
        path + " line " + std::to_string(number) + ": '" + excerpt(name) + "' is not an op name",
        "write one op name per line");
    out.emplace_back(name);
  }
  return out;
}

// ---- Log ----

std::string to_string(const AutocastDecision& d) {
  return "autocast: " + d.op + " in " + (d.module.empty() ? "<top level>" : d.module) + ": " +
         std::string(dtype_name(d.from)) + " -> " + std::string(dtype_name(d.to)) + " (" +
         std::string(autocast_category_name(d.category)) + ")";
}

void AutocastLog::record(const AutocastDecision& d) {
  const std::string key = d.op + '\n' + d.module + '\n' + std::string(dtype_name(d.from)) + '\n' +
                          std::string(dtype_name(d.to));
  if (!seen_.emplace(key, decisions_.size()).second) return;
  decisions_.push_back(d);
  if (sink_) sink_(to_string(d));
}

// ---- Scopes ----

struct AutocastScope::Saved {
  Context previous;
  std::unique_ptr<CastCache> cache;  // owned by the outermost scope
};

AutocastScope::AutocastScope(DType lower, const AutocastPolicy& policy, AutocastLog* log)
    : saved_(std::make_unique<Saved>()) {
  MANTISSA_CHECK(is_16bit_float(lower),
                 std::string("autocast to ") + std::string(dtype_name(lower)) + " is not supported",
                 "use f16 or bf16");
  saved_->previous = ctx;
  if (!ctx.cache) {
    saved_->cache = std::make_unique<CastCache>();
    ctx.cache = saved_->cache.get();
  }
  ctx.autocast = true;
  ctx.lower = lower;
  ctx.policy = &policy;
  ctx.log = log;
}

AutocastScope::~AutocastScope() {
  const Context& p = saved_->previous;
  ctx.autocast = p.autocast;
  ctx.lower = p.lower;
  ctx.policy = p.policy;
  ctx.log = p.log;
  ctx.cache = p.cache;
}

size_t AutocastScope::cache_misses() const { return ctx.cache ? ctx.cache->misses : 0; }
size_t AutocastScope::cache_hits() const { return ctx.cache ? ctx.cache->hits : 0; }

AutocastDisabled::AutocastDisabled() : previous_(ctx.autocast), previous_read_as_(ctx.read_as) {
  ctx.autocast = false;
  ctx.read_as = false;
}
AutocastDisabled::~AutocastDisabled() {
  ctx.autocast = previous_;
  ctx.read_as = previous_read_as_;
}

struct ReadAsScope::Saved {
  bool read_as = false;
  CastCache* cache = nullptr;
  std::unique_ptr<CastCache> own;  // when no scope had one
};

ReadAsScope::ReadAsScope() : saved_(std::make_unique<Saved>()) {
  saved_->read_as = ctx.read_as;
  saved_->cache = ctx.cache;
  if (!ctx.cache) {
    saved_->own = std::make_unique<CastCache>();
    ctx.cache = saved_->own.get();
  }
  ctx.read_as = true;
}

ReadAsScope::~ReadAsScope() {
  ctx.read_as = saved_->read_as;
  ctx.cache = saved_->cache;
}

bool autocast_enabled() { return ctx.autocast; }
DType autocast_dtype() { return ctx.lower; }

kernels::Partials default_partials() { return ctx.partials; }
PartialsScope::PartialsScope(kernels::Partials p) : previous_(ctx.partials) { ctx.partials = p; }
PartialsScope::~PartialsScope() { ctx.partials = previous_; }

StochasticOutputsScope::StochasticOutputsScope(uint64_t seed, uint64_t base_stream)
    : previous_on_(ctx.stochastic), previous_seed_(ctx.sr_seed), previous_stream_(ctx.sr_stream) {
  ctx.stochastic = true;
  ctx.sr_seed = seed;
  ctx.sr_stream = base_stream;
}
StochasticOutputsScope::~StochasticOutputsScope() {
  ctx.stochastic = previous_on_;
  ctx.sr_seed = previous_seed_;
  ctx.sr_stream = previous_stream_;
}

Fp8Scope::Fp8Scope(Fp8Provider& provider) : previous_(ctx.fp8) { ctx.fp8 = &provider; }
Fp8Scope::~Fp8Scope() { ctx.fp8 = previous_; }

// ---- Snapshots (recomputation) ----

struct OpContextSnapshot::Data {
  Context ctx;
};

OpContextSnapshot OpContextSnapshot::save() {
  OpContextSnapshot s;
  auto d = std::make_shared<Data>();
  d->ctx = ctx;
  d->ctx.log = nullptr;
  d->ctx.cache = nullptr;
  d->ctx.in_op = false;
  s.data_ = std::move(d);
  return s;
}

struct OpContextRestore::Saved {
  Context previous;
  std::unique_ptr<CastCache> cache;
};

OpContextRestore::OpContextRestore(const OpContextSnapshot& s) : saved_(std::make_unique<Saved>()) {
  saved_->previous = ctx;
  const Context& want = s.data_->ctx;
  ctx.autocast = want.autocast;
  ctx.lower = want.lower;
  ctx.policy = want.policy;
  ctx.log = nullptr;
  ctx.partials = want.partials;
  ctx.stochastic = want.stochastic;
  ctx.sr_seed = want.sr_seed;
  ctx.sr_stream = want.sr_stream;
  ctx.in_op = false;
  ctx.fp8 = want.fp8;
  ctx.read_as = want.read_as;
  if ((ctx.autocast || ctx.read_as) && !ctx.cache) {
    saved_->cache = std::make_unique<CastCache>();
    ctx.cache = saved_->cache.get();
  }
}

OpContextRestore::~OpContextRestore() {
  // The stream counter goes back too: the replay must not shift later ops' streams.
  ctx = saved_->previous;
}

// ---- The op entry ----

namespace detail {
namespace {

// The 16-bit copy of a weight, made once per outermost scope.
Tensor cached_cast(const Tensor& t, DType to) {
  CastCache& cache = *ctx.cache;
  const std::pair<const void*, DType> key{t.data_ptr(), to};
  auto it = cache.entries.find(key);
  if (it != cache.entries.end() && it->second.first.shape() == t.shape() &&
      it->second.first.dtype() == t.dtype()) {
    ++cache.hits;
    return it->second.second;
  }
  ++cache.misses;
  // A 16-bit stand-in for the weight: ops read it, and its gradient is computed straight in the
  // weight's type (no 16-bit weight gradient to round, flush or cast back).
  Tensor c = kernels::cast(t.detach(), to).stand_in_for(t);
  cache.entries[key] = {t, c};
  return c;
}

}  // namespace

OpCall::OpCall(OpId op, const OpOptions& opt, std::span<const Tensor* const> inputs) {
  const bool anomaly = autograd::detect_anomaly();
  if (ctx.in_op || !(ctx.autocast || ctx.stochastic || anomaly || ctx.read_as)) return;
  const OpInfo& info = op_info(op);
  const AutocastCategory cat = ctx.autocast ? ctx.policy->category(op) : info.category;
  if (cat == AutocastCategory::kNever && !anomaly) return;
  active_ = true;
  ctx.in_op = true;
  op_ = op;
  check_ = anomaly;
  opt_ = std::make_unique<OpOptions>(opt);
  if (anomaly)
    for (const Tensor* t : inputs) originals_.push_back(t ? *t : Tensor());
  inputs_.reserve(inputs.size());
  std::optional<DType> first, widest;
  for (const Tensor* t : inputs) {
    inputs_.push_back(t ? *t : Tensor());
    if (!t || !t->defined() || !is_compute_float(t->dtype())) continue;
    DType d = t->dtype();
    if (const AutogradMeta* m = t->autograd_meta().get();
        ctx.read_as && m && m->read_as && d == DType::f32 && !t->grad_fn()) {
      // A parameter read as its 16-bit values (ReadAsScope): linear's and conv2d's weight in
      // place (OpOptions::weight_as), any other through its cached 16-bit copy.
      d = *m->read_as;
      const size_t i = inputs_.size() - 1;
      if ((op == OpId::linear || op == OpId::conv2d) && i == 1)
        opt_->weight_as = d;
      else
        inputs_.back() = cached_cast(*t, d);
    }
    if (!first) first = d;
    widest = widest ? promote_types(*widest, d) : d;
  }
  if (!first || cat == AutocastCategory::kNever) return;  // nothing to decide
  // The type the op runs in under autocast (without: default_output_type).
  std::optional<DType> target;
  if (ctx.autocast && !opt.out) {
    switch (cat) {
      case AutocastCategory::kLowerPrecision:
        target = ctx.lower;
        for (size_t i = 0; i < inputs_.size(); ++i) {
          Tensor& t = inputs_[i];
          if (!t.defined() || !is_compute_float(t.dtype()) || t.dtype() == ctx.lower) continue;
          const bool weight = t.requires_grad() && !t.grad_fn() && ctx.cache;
          if (weight && (op == OpId::linear || op == OpId::conv2d) && i == 1 &&
              t.dtype() == DType::f32) {
            // linear and conv2d read the FP32 weight as its 16-bit copy (OpOptions::weight_as):
            // the same values and gradient as the cached copy's, without a copy held from the
            // forward pass to the backward pass.
            opt_->weight_as = ctx.lower;
            continue;
          }
          if (!weight && op == OpId::conv2d && i == 0 && t.dtype() == DType::f32) {
            // conv2d reads an FP32 activation as its 16-bit copy (OpOptions::input_as): the same
            // values and gradient, without the cast's pass or the copy saved for the backward.
            opt_->input_as = ctx.lower;
            continue;
          }
          if (!weight && op == OpId::linear && i == 0 && t.dtype() == DType::f32 &&
              !ctx.stochastic) {
            // linear makes the copy itself (OpOptions::input_as) and computes the input's
            // gradient in FP32, rounded as the copy's gradient widened would be: one pass less
            // and no 16-bit gradient in the backward. At a batch whose weight gradient is a whole
            // tensor when linear's backward returns, the FP32 input gradient sits beside it where
            // the cast's backward would widen a 16-bit one after it: the tutorial CNN's fc1 at
            // batch 64 (behind the FP32 group norm) holds 4 MiB more at bf16-mixed's peak (77.9%
            // -> 81.9% of 32-true's; 16-mixed's peak is elsewhere) and runs 16-mixed 4% faster,
            // bf16-mixed 1% (alternating builds). Not with stochastic outputs, under which the
            // cast rounds stochastically.
            opt_->input_as = ctx.lower;
            continue;
          }
          if (!weight && op == OpId::relu && !ctx.stochastic) {
            // relu commutes with rounding to nearest (monotonic, and 0 stays 0): relu of the FP32
            // input rounded once into the 16-bit output is relu of its 16-bit copy, and the
            // gradient, masked by that output and computed in the input's type, is the copy's
            // widened. One pass where the cast and relu took two, forward and backward. (Not
            // with stochastic outputs, which would round the FP32 result stochastically.)
            continue;
          }
          t = weight ? cached_cast(t, ctx.lower) : cast(t, ctx.lower);
        }
        break;
      case AutocastCategory::kFp32:
        target = DType::f32;
        break;
      case AutocastCategory::kPromote:
        target = widest;
        break;
      case AutocastCategory::kFollowInput:
        target = first;
        break;
      case AutocastCategory::kNever:
        break;
    }
    if (target) opt_->out = *target;
    if (target && ctx.log) {
      // Logged when an input changes type: the first that does (inputs_ may already be cast).
      for (const Tensor* t : inputs) {
        if (!t || !t->defined() || !is_compute_float(t->dtype()) || t->dtype() == *target) continue;
        ctx.log->record({std::string(info.name), current_module_path(), t->dtype(), *target, cat});
        break;
      }
    }
  }
  // Stochastic outputs: compute in FP32, round the result once, stochastically. An op that only
  // moves values has nothing to round.
  if (ctx.stochastic && info.kind != OpKind::kMove) {
    const std::optional<DType> out =
        opt_->out ? opt_->out : default_output_type(info.kind, *first, *widest);
    if (out && is_16bit_float(*out)) {
      round_to_ = *out;
      opt_->out = DType::f32;
    }
  }
}

OpCall::~OpCall() {
  if (active_) ctx.in_op = false;
}

const OpOptions& OpCall::options() const { return *opt_; }

Tensor OpCall::finish(Tensor y) {
  if (round_to_ && y.defined() && y.dtype() == DType::f32) {
    CastOptions o;
    o.rounding = Rounding::kStochastic;
    o.seed = ctx.sr_seed;
    o.stream = ctx.sr_stream++;
    ctx.in_op = false;  // the cast is an op of its own (and checks its output itself)
    active_ = false;
    return cast(y, *round_to_, o);
  }
  if (check_) check_output(y);
  return y;
}

namespace {

// Anomaly detection's forward check: `inputs` as the op ran on them, `originals` as its caller
// passed them (automatic casting may have cast them).
void check_output_of(OpId op, const Tensor& y, const std::vector<Tensor>& inputs,
                     const std::vector<Tensor>& originals) {
  const int64_t bad = autograd::count_nonfinite(y);
  if (bad == 0) return;
  const std::string& path = current_module_path();
  std::string msg = "anomaly in forward: " + std::string(op_info(op).name) +
                    (path.empty() ? " outside any module" : " in module '" + path + "'") +
                    " produced " + std::to_string(bad) + " inf/nan values (" +
                    autograd::describe_values(y) + ")";
  int64_t bad_inputs = 0, bad_originals = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) continue;
    msg += "\n  input " + std::to_string(i) + ": " + autograd::describe_values(inputs[i]);
    if (originals[i].dtype() != inputs[i].dtype())
      msg += " (cast by autocast from " + autograd::describe_values(originals[i]) + ")";
    bad_inputs += autograd::count_nonfinite(inputs[i]);
    bad_originals += autograd::count_nonfinite(originals[i]);
  }
  std::string hint;
  if (bad_inputs > 0 && bad_originals == 0)
    hint = "automatic casting overflowed an input: put " + std::string(op_info(op).name) +
           " on the FP32 list (--autocast-fp32-list), or keep this module in FP32";
  else if (bad_inputs > 0)
    hint = "its inputs were already inf/nan, from outside any op (the data, or the parameters)";
  else if (is_16bit_float(y.dtype()))
    hint = "the result passed the range of " + std::string(dtype_name(y.dtype())) +
           " (largest finite " + (y.dtype() == DType::f16 ? "65504" : "3.4e38") +
           "): run this module in FP32 (--keep-fp32" + (path.empty() ? "" : " " + path) +
           "), or use bf16, or lower the learning rate";
  else
    hint = "lower the learning rate, or clip gradients (--max-grad-norm)";
  throw autograd::AnomalyError(msg, hint);
}

}  // namespace

void OpCall::check_output(const Tensor& y) const { check_output_of(op_, y, inputs_, originals_); }

void check_output(OpId op, const Tensor& y, const std::vector<Tensor>& inputs) {
  check_output_of(op, y, inputs, inputs);
}

std::optional<Fp8OpScaling> fp8_scaling() {
  if (!ctx.fp8 || !ctx.autocast || ctx.in_op) return std::nullopt;
  return ctx.fp8->scaling(current_module_path());
}

}  // namespace detail
}  // namespace mantissa::ops

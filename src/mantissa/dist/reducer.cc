#include "mantissa/dist/reducer.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <unordered_set>

#include "mantissa/core/error.h"
#include "mantissa/core/parallel.h"
#include "mantissa/dist/agreement.h"

namespace mantissa::dist {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;
// Elements per staging pass in the conversions to and from the bucket (FP32 on the stack), and
// per thread range (a multiple of it).
constexpr size_t kStage = 1024;
constexpr size_t kGrain = 16 * kStage;

std::string result_name(ReducerOptions::Result r) {
  return r == ReducerOptions::Result::kSum ? "sum" : "mean";
}

// dst[i] = src[i] * scale (scale 1: a plain conversion), through FP32: n elements of dtype `from`
// into dtype `to`, rounded to nearest even once. Split over the engine's threads; the result does
// not depend on how.
void scaled_convert(const void* src, DType from, void* dst, DType to, size_t n, float multiply,
                    float divide) {
  const size_t fs = dtype_size(from), ts = dtype_size(to);
  const bool scale = multiply != 1 || divide != 1;
  parallel_for(n, kGrain, default_num_threads(), [&](size_t begin, size_t end) {
    const char* s = static_cast<const char*>(src) + begin * fs;
    char* d = static_cast<char*>(dst) + begin * ts;
    if (!scale) {
      convert(s, from, d, to, end - begin);
      return;
    }
    float buf[kStage];
    for (size_t off = 0; off < end - begin; off += kStage) {
      const size_t m = std::min(kStage, end - begin - off);
      convert(s + off * fs, from, buf, DType::f32, m);
      for (size_t i = 0; i < m; ++i) buf[i] = buf[i] * multiply / divide;
      convert(buf, DType::f32, d + off * ts, to, m);
    }
  });
}

}  // namespace

Reducer::Reducer(comm::Communicator& comm, const std::vector<NamedTensor>& params,
                 ReducerOptions options)
    : comm_(comm), options_(options) {
  MANTISSA_CHECK(
      options.wire == DType::f32 || options.wire == DType::f16 || options.wire == DType::bf16,
      "dist::Reducer: gradients cannot travel as " + std::string(dtype_name(options.wire)),
      "use f32, f16 or bf16 as the wire type");
  MANTISSA_CHECK(options.bucket_cap_mib > 0 && options.first_bucket_mib > 0,
                 "dist::Reducer: bucket sizes must be positive (bucket_cap_mib " +
                     std::to_string(options.bucket_cap_mib) + ", first_bucket_mib " +
                     std::to_string(options.first_bucket_mib) + ")",
                 "pass sizes in MiB, e.g. 25 and 1 (PyTorch DDP's)");
  std::unordered_set<const AutogradMeta*> seen;
  for (const NamedTensor& p : params) {
    MANTISSA_CHECK(p.tensor && p.tensor->defined(),
                   "dist::Reducer: parameter '" + p.name + "' is undefined",
                   "pass the model's parameters after it is built");
    if (!p.tensor->requires_grad()) continue;
    const std::shared_ptr<AutogradMeta>& meta = p.tensor->autograd_meta();
    MANTISSA_CHECK(seen.insert(meta.get()).second,
                   "dist::Reducer: parameter '" + p.name + "' is in the list twice",
                   "pass each parameter once");
    MANTISSA_CHECK(!meta->on_grad_ready,
                   "dist::Reducer: parameter '" + p.name + "' already has a gradient-ready hook",
                   "one reducer per parameter: destroy the other reducer first");
    params_.push_back(p);
    meta_.push_back(meta);
  }

  std::vector<int64_t> numels;
  for (const NamedTensor& p : params_) numels.push_back(p.tensor->numel());
  buckets_ = plan(numels, options, comm.size());
  bucket_of_.resize(params_.size());
  slot_of_.resize(params_.size());
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (size_t s = 0; s < buckets_[b].params.size(); ++s) {
      bucket_of_[buckets_[b].params[s]] = b;
      slot_of_[buckets_[b].params[s]] = s;
    }

  // The same layout on every rank, or an error naming what differs (before any hook is set).
  ConfigFields fields{{"wire", std::string(dtype_name(options.wire))},
                      {"bucket_cap_mib", std::to_string(options.bucket_cap_mib)},
                      {"first_bucket_mib", std::to_string(options.first_bucket_mib)},
                      {"result", result_name(options.result)},
                      {"scatter", options.scatter ? "yes" : "no"}};
  for (size_t k = 0; k < params_.size(); ++k) {
    const Tensor& t = *params_[k].tensor;
    const DType gd = meta_[k]->grad_dtype.value_or(t.dtype());
    fields.emplace_back(params_[k].name, std::string(dtype_name(t.dtype())) + " " +
                                             shape_str(t.shape()) + ", gradient " +
                                             std::string(dtype_name(gd)));
  }
  check_config_agreement(comm_, fields, "parameters of the data-parallel model");

  for (size_t b = 0; b < buckets_.size(); ++b) {
    TensorOptions o = charged_to(MemoryCategory::gradients);
    o.owner = "gradient bucket " + std::to_string(b);
    storage_.push_back(Tensor::zeros({buckets_[b].padded}, options.wire, o));
    if (options.scatter) {
      o.owner = "gradient bucket " + std::to_string(b) + " (this rank's part)";
      parts_.push_back(Tensor::zeros({buckets_[b].part}, options.wire, o));
    }
  }
  for (size_t k = 0; k < params_.size(); ++k) meta_[k]->on_grad_ready = [this, k] { on_ready(k); };
  reset_pass();
}

std::vector<Reducer::Bucket> Reducer::plan(const std::vector<int64_t>& numels,
                                           const ReducerOptions& options, int ranks) {
  // From the last parameter registered to the first.
  const size_t ws = dtype_size(options.wire);
  std::vector<Bucket> buckets;
  double cap = std::min(options.first_bucket_mib, options.bucket_cap_mib) * kMiB;
  for (size_t k = numels.size(); k-- > 0;) {
    const int64_t n = numels[k];
    if (buckets.empty() ||
        (buckets.back().numel > 0 &&
         static_cast<double>((buckets.back().numel + n) * static_cast<int64_t>(ws)) > cap)) {
      if (!buckets.empty()) cap = options.bucket_cap_mib * kMiB;
      buckets.emplace_back();
    }
    Bucket& b = buckets.back();
    b.params.push_back(k);
    b.offsets.push_back(b.numel);
    b.numel += n;
  }
  const int64_t parts = options.scatter ? std::max(ranks, 1) : 1;
  for (Bucket& b : buckets) {
    b.part = (b.numel + parts - 1) / parts;
    b.padded = b.part * parts;
    if (!options.scatter) b.part = b.padded = b.numel;
  }
  return buckets;
}

std::pair<int64_t, int64_t> Reducer::owned(size_t k) const {
  MANTISSA_CHECK(k < params_.size(), "dist::Reducer::owned: no parameter " + std::to_string(k),
                 "pass an index into params()");
  const int64_t n = params_[k].tensor->numel();
  if (!options_.scatter) return {0, n};
  const Bucket& b = buckets_[bucket_of_[k]];
  const int64_t offset = b.offsets[slot_of_[k]];
  const int64_t lo = static_cast<int64_t>(comm_.rank()) * b.part, hi = lo + b.part;
  const int64_t begin = std::clamp<int64_t>(lo - offset, 0, n);
  const int64_t end = std::clamp<int64_t>(hi - offset, begin, n);
  return {begin, end};
}

Reducer::~Reducer() {
  for (const auto& meta : meta_) meta->on_grad_ready = nullptr;
}

void Reducer::reset_pass() {
  in_pass_ = false;
  ready_.assign(params_.size(), 0);
  pending_.resize(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b)
    pending_[b] = static_cast<int64_t>(buckets_[b].params.size());
  next_launch_ = 0;
  requests_.assign(buckets_.size(), comm::Request());
}

void Reducer::on_ready(size_t param) {
  if (!sync_) return;
  MANTISSA_CHECK(!ready_[param],
                 "dist::Reducer: the gradient of '" + params_[param].name +
                     "' was finished twice without finish() in between",
                 "call finish() after each backward pass, or run the gradient accumulation "
                 "micro-batches before the last inside no_sync()");
  if (!in_pass_) {
    in_pass_ = true;
    last_ = CommStats();
    ready_order_.clear();
    launch_order_.clear();
  }
  copy_in(param);
  mark_ready(param);
  launch_ready_buckets();
}

void Reducer::mark_ready(size_t param) {
  ready_[param] = 1;
  const size_t b = bucket_of_[param];
  if (--pending_[b] == 0) ready_order_.push_back(b);
}

void Reducer::launch_ready_buckets() {
  while (next_launch_ < buckets_.size() && pending_[next_launch_] == 0) {
    const size_t b = next_launch_++;
    requests_[b] = options_.scatter
                       ? comm_.reduce_scatter_async(storage_[b], parts_[b], comm::ReduceOp::kSum)
                       : comm_.all_reduce_async(storage_[b], comm::ReduceOp::kSum);
    launch_order_.push_back(b);
    last_.bytes += static_cast<int64_t>(storage_[b].nbytes());
  }
}

void Reducer::copy_in(size_t param) {
  const AutogradMeta& meta = *meta_[param];
  const size_t b = bucket_of_[param];
  const size_t ws = dtype_size(options_.wire);
  char* dst = static_cast<char*>(storage_[b].data_ptr()) +
              static_cast<size_t>(buckets_[b].offsets[slot_of_[param]]) * ws;
  const size_t n = static_cast<size_t>(params_[param].tensor->numel());
  if (!meta.grad || !meta.grad->defined()) {
    std::memset(dst, 0, n * ws);
    return;
  }
  const Tensor g = meta.grad->contiguous();
  MANTISSA_ASSERT(static_cast<size_t>(g.numel()) == n, "a gradient of another size");
  // A gradient left as a view of this very place by the last finish() (not zeroed since, and not
  // reached by this pass): already there (an f32 wire divides by nothing).
  if (g.data_ptr() == static_cast<const void*>(dst) && g.dtype() == options_.wire) return;
  // 16-bit wires carry g / N, rounded once (see the header).
  const float ranks = options_.wire == DType::f32 ? 1.0f : static_cast<float>(comm_.size());
  scaled_convert(g.data_ptr(), g.dtype(), dst, options_.wire, n, 1.0f, ranks);
}

void Reducer::copy_out(size_t bucket) {
  const Bucket& bk = buckets_[bucket];
  const size_t ws = dtype_size(options_.wire);
  const float ranks = static_cast<float>(comm_.size());
  const bool f32 = options_.wire == DType::f32;
  const bool sum = options_.result == ReducerOptions::Result::kSum;
  // f32 wire: the sum (divided by N for the mean); 16-bit wires: the mean (times N for the sum).
  const float multiply = !f32 && sum ? ranks : 1.0f, divide = f32 && !sum ? ranks : 1.0f;
  for (size_t s = 0; s < bk.params.size(); ++s) {
    const size_t p = bk.params[s];
    AutogradMeta& meta = *meta_[p];
    const Tensor& t = *params_[p].tensor;
    const DType gd = meta.grad_dtype.value_or(t.dtype());
    // The elements written: all of them, or (scatter) those in this rank's part.
    const auto [begin, end] = owned(p);
    if (begin == end) continue;
    if (f32 && sum && !options_.scatter && gd == DType::f32) {
      // The bucket holds the sum in the gradient's type already: the gradient becomes a view of
      // it (PyTorch DDP's gradient_as_bucket_view, on the way out) instead of a copy, sparing a
      // pass over the gradients' memory every step. Autograd never writes into a gradient (a
      // pass that adds to it makes a new tensor), and only this parameter's copy_in() writes
      // its place in the bucket, so the view holds the sum until the gradient is replaced.
      meta.grad = std::make_unique<Tensor>(
          storage_[bucket].narrow(0, bk.offsets[s], t.numel()).view(t.shape()));
      continue;
    }
    if (!meta.grad || !meta.grad->defined() || !meta.grad->is_contiguous() ||
        meta.grad->dtype() != gd) {
      TensorOptions o = charged_to(MemoryCategory::gradients);
      o.owner = params_[p].name;
      Tensor g = Tensor::empty(t.shape(), gd, o);
      if (options_.scatter) {  // the elements not written keep the local gradient: here none
        Tensor local = meta.grad && meta.grad->defined() ? meta.grad->contiguous() : Tensor();
        if (local.defined() && local.shape() == t.shape())
          g.copy_from(local);
        else
          g.fill(0.0);
      }
      meta.grad = std::make_unique<Tensor>(std::move(g));
    }
    const char* src = options_.scatter
                          ? static_cast<const char*>(parts_[bucket].data_ptr()) +
                                static_cast<size_t>(bk.offsets[s] + begin -
                                                    static_cast<int64_t>(comm_.rank()) * bk.part) *
                                    ws
                          : static_cast<const char*>(storage_[bucket].data_ptr()) +
                                static_cast<size_t>(bk.offsets[s]) * ws;
    char* dst =
        static_cast<char*>(meta.grad->data_ptr()) + static_cast<size_t>(begin) * dtype_size(gd);
    scaled_convert(src, options_.wire, dst, gd, static_cast<size_t>(end - begin), multiply, divide);
  }
}

void Reducer::finish() {
  if (!sync_) return;
  for (size_t k = 0; k < params_.size(); ++k)
    MANTISSA_CHECK(params_[k].tensor->autograd_meta() == meta_[k],
                   "dist::Reducer: parameter '" + params_[k].name +
                       "' is not the tensor the reducer was made with (was the model cast?)",
                   "make the reducer after the model's dtypes are set (half(), to())");
  if (!in_pass_) {
    last_ = CommStats();
    ready_order_.clear();
    launch_order_.clear();
  }
  // Parameters the pass did not reach, in bucket order, then the buckets still waiting.
  for (const Bucket& b : buckets_)
    for (size_t p : b.params)
      if (!ready_[p]) {
        copy_in(p);
        mark_ready(p);
      }
  launch_ready_buckets();
  MANTISSA_ASSERT(next_launch_ == buckets_.size(), "a bucket was not started");

  using Clock = comm::Request::Clock;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Clock::time_point start = Clock::now();
    requests_[b].wait();
    last_.exposed_seconds += std::chrono::duration<double>(Clock::now() - start).count();
    copy_out(b);
  }
  // The time some all-reduce was running: the union of their intervals.
  std::vector<std::pair<Clock::time_point, Clock::time_point>> spans;
  for (const comm::Request& r : requests_) spans.emplace_back(r.started(), r.finished());
  std::sort(spans.begin(), spans.end());
  Clock::time_point covered{};
  for (const auto& [begin, end] : spans) {
    const Clock::time_point from = std::max(begin, covered);
    if (end > from) last_.busy_seconds += std::chrono::duration<double>(end - from).count();
    covered = std::max(covered, end);
  }
  last_.steps = 1;
  total_.steps += last_.steps;
  total_.bytes += last_.bytes;
  total_.exposed_seconds += last_.exposed_seconds;
  total_.busy_seconds += last_.busy_seconds;
  reset_pass();
}

Reducer::NoSync Reducer::no_sync() { return NoSync(this); }

Reducer::NoSync::NoSync(Reducer* r) : reducer_(r), previous_(r->sync_) {
  MANTISSA_CHECK(!r->in_pass_,
                 "dist::Reducer::no_sync() during a synchronised backward pass (gradients are "
                 "already being reduced)",
                 "enter no_sync() before the backward pass, or call finish() first");
  r->sync_ = false;
}

Reducer::NoSync::NoSync(NoSync&& other) noexcept
    : reducer_(other.reducer_), previous_(other.previous_) {
  other.reducer_ = nullptr;
}

Reducer::NoSync::~NoSync() {
  if (reducer_) reducer_->sync_ = previous_;
}

}  // namespace mantissa::dist

#include "mantissa/dist/zero.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <string>

#include "mantissa/core/convert.h"
#include "mantissa/core/error.h"

namespace mantissa::dist {

Zero1::Zero1(comm::Communicator& comm, Reducer& reducer, optim::Optimizer& optimizer,
             FactorGradients* factors)
    : comm_(comm), reducer_(reducer), optimizer_(optimizer) {
  MANTISSA_CHECK(reducer.options().scatter,
                 "dist::Zero1 needs a reducer that reduce-scatters the gradients",
                 "make the reducer with ReducerOptions::scatter = true");
  // Each optimizer parameter's shard: its elements in this rank's part of its bucket. Parameters
  // the reducer leaves out (frozen) get none: they have no gradient to update with.
  const optim::ParamList& ops = optimizer.params();
  std::map<const AutogradMeta*, size_t> index;
  for (size_t i = 0; i < ops.size(); ++i) index[ops[i].tensor->autograd_meta().get()] = i;
  std::vector<optim::ElementRange> ranges(ops.size());
  for (size_t k = 0; k < reducer.params().size(); ++k) {
    auto it = index.find(reducer.params()[k].tensor->autograd_meta().get());
    MANTISSA_CHECK(it != index.end(),
                   "dist::Zero1: parameter '" + reducer.params()[k].name +
                       "' of the reducer is not one of the optimizer's",
                   "make the reducer and the optimizer over the same model's parameters");
    const auto [begin, end] = reducer.owned(k);
    ranges[it->second] = {begin, end};
  }
  // The factored weights: block r of whole rows to rank r.
  const std::vector<nn::Module::NamedTensor> none;
  const std::vector<nn::Module::NamedTensor>& factored = factors ? factors->weights() : none;
  for (size_t k = 0; k < factored.size(); ++k) {
    Tensor& w = *factored[k].tensor;
    auto it = index.find(w.autograd_meta().get());
    MANTISSA_CHECK(it != index.end() && w.dim() == 2 && w.is_contiguous(),
                   "dist::Zero1: factored weight '" + factored[k].name +
                       "' is not a contiguous matrix of the optimizer",
                   "factor the weights of the optimizer's linear layers");
    const int64_t rows = w.size(0), row_size = w.size(1);
    const auto [first, end] = row_block(rows, comm.size(), comm.rank());
    ranges[it->second] = {first * row_size, end * row_size};
    factors->set_rows(k, first, end);
    row_blocks_.push_back(
        {factored[k].name, &w, rows, block_rows(rows, comm.size()), row_size, first, end});
    // The forward pass's first read of the weight waits for its rows (gather_parameters).
    w.autograd_meta()->before_read = [this] { finish_gather(); };
  }
  optimizer.set_shards(std::move(ranges));

  // Each bucket's gather dtype: its parameters' (FP32 where they differ: widening to it and back
  // is exact), in the bucket's own buffer when it fits.
  for (const Reducer::Bucket& b : reducer.buckets()) {
    DType dtype = reducer.params()[b.params.front()].tensor->dtype();
    for (size_t p : b.params)
      if (reducer.params()[p].tensor->dtype() != dtype) dtype = DType::f32;
    gather_dtype_.push_back(dtype);
    if (dtype_size(dtype) <= dtype_size(reducer.wire())) {
      gather_.emplace_back();
      continue;
    }
    TensorOptions o = charged_to(MemoryCategory::workspace);
    o.owner = "parameter gather bucket " + std::to_string(gather_.size());
    gather_.push_back(Tensor::zeros({b.padded}, dtype, o));
  }
}

std::function<std::pair<double, bool>(double, bool)> Zero1::combine() {
  return [this](double sum_of_squares, bool nonfinite) {
    // One all-reduce: the sums of squares, and the flags counted (any rank's makes it positive).
    double v[2] = {sum_of_squares, nonfinite ? 1.0 : 0.0};
    comm_.all_reduce(v, 2, DType::f64, comm::ReduceOp::kSum);
    return std::pair<double, bool>(v[0], v[1] > 0);
  };
}

namespace {
using Clock = std::chrono::steady_clock;
double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

Zero1::~Zero1() {
  for (const RowBlocks& rb : row_blocks_) rb.weight->autograd_meta()->before_read = nullptr;
  try {
    finish_gather();
  } catch (const std::exception&) {
    // A failed collective: the job is ending (Communicator::abort); nothing to keep.
  }
}

void Zero1::gather_parameters() {
  finish_gather();  // the last step's, if nothing has read the weights since
  const Clock::time_point t0 = Clock::now();
  const std::vector<Reducer::Bucket>& buckets = reducer_.buckets();
  const std::vector<Reducer::NamedTensor>& params = reducer_.params();
  std::vector<comm::Request> requests(buckets.size());
  // Bucket b's gather buffer: its own, or the gradient bucket's.
  auto buffer = [&](size_t b) -> Tensor& {
    return gather_[b].defined() ? gather_[b] : reducer_.storage(b);
  };
  for (size_t b = 0; b < buckets.size(); ++b) {
    // This rank's part: the elements it updated, converted to the gather dtype.
    const Reducer::Bucket& bk = buckets[b];
    const size_t gs = dtype_size(gather_dtype_[b]);
    char* base = static_cast<char*>(buffer(b).data_ptr());
    for (size_t s = 0; s < bk.params.size(); ++s) {
      const auto [begin, end] = reducer_.owned(bk.params[s]);
      if (begin == end) continue;
      const Tensor& p = *params[bk.params[s]].tensor;
      MANTISSA_CHECK(p.is_contiguous(),
                     "dist::Zero1: parameter '" + params[bk.params[s]].name + "' is not contiguous",
                     "");
      convert(static_cast<const char*>(p.data_ptr()) +
                  static_cast<size_t>(begin) * dtype_size(p.dtype()),
              p.dtype(), base + static_cast<size_t>(bk.offsets[s] + begin) * gs, gather_dtype_[b],
              static_cast<size_t>(end - begin));
    }
    requests[b] =
        comm_.all_gather_async(base + static_cast<size_t>(comm_.rank() * bk.part) * gs, base,
                               static_cast<size_t>(bk.part), gather_dtype_[b], buffer(b).storage());
    total_.bytes += bk.padded * static_cast<int64_t>(gs);
  }
  for (size_t b = 0; b < buckets.size(); ++b) {
    requests[b].wait();
    const Reducer::Bucket& bk = buckets[b];
    const size_t gs = dtype_size(gather_dtype_[b]);
    const char* base = static_cast<const char*>(buffer(b).data_ptr());
    for (size_t s = 0; s < bk.params.size(); ++s) {
      Tensor& p = *params[bk.params[s]].tensor;
      convert(base + static_cast<size_t>(bk.offsets[s]) * gs, gather_dtype_[b], p.data_ptr(),
              p.dtype(), static_cast<size_t>(p.numel()));
    }
  }
  const Clock::time_point t1 = Clock::now();
  total_.exposed_seconds += seconds(t1 - t0);
  ++total_.steps;
  if (row_blocks_.empty()) {
    total_.busy_seconds += seconds(t1 - t0);
    return;
  }
  // The factored weights' blocks of rows, started once the buckets' gathers have finished (the
  // backend copies a block of rows in one piece, which would hold up the buckets' last rounds),
  // to finish while the next forward pass runs: in place when the ranks' blocks fill the weight
  // exactly, through a padded buffer otherwise (the last ranks' blocks are short or empty).
  row_requests_.assign(row_blocks_.size(), comm::Request());
  padded_.assign(row_blocks_.size(), Tensor());
  const int64_t ranks = comm_.size(), rank = comm_.rank();
  for (size_t k = 0; k < row_blocks_.size(); ++k) {
    const RowBlocks& rb = row_blocks_[k];
    Tensor& w = *rb.weight;
    const size_t es = dtype_size(w.dtype());
    const int64_t part = rb.block_rows * rb.row_size;  // elements of a block
    char* base = static_cast<char*>(w.data_ptr());
    if (rb.block_rows * ranks != rb.rows) {
      TensorOptions o = charged_to(MemoryCategory::workspace);
      o.owner = "parameter gather " + rb.name;
      padded_[k] = Tensor::zeros({ranks * part}, w.dtype(), o);
      std::memcpy(static_cast<char*>(padded_[k].data_ptr()) + static_cast<size_t>(rank * part) * es,
                  base + static_cast<size_t>(rb.first * rb.row_size) * es,
                  static_cast<size_t>((rb.end - rb.first) * rb.row_size) * es);
      base = static_cast<char*>(padded_[k].data_ptr());
    }
    row_requests_[k] = comm_.all_gather_async(
        base + static_cast<size_t>(rank * part) * es, base, static_cast<size_t>(part), w.dtype(),
        padded_[k].defined() ? padded_[k].storage() : w.storage());
    total_.bytes += ranks * part * static_cast<int64_t>(es);
  }
  started_ = t1;
  rows_running_ = true;
}

void Zero1::finish_gather() {
  if (!rows_running_) return;
  rows_running_ = false;
  const Clock::time_point t0 = Clock::now();
  Clock::time_point last = started_;  // when the last gather finished
  for (size_t k = 0; k < row_blocks_.size(); ++k) {
    row_requests_[k].wait();
    last = std::max(last, row_requests_[k].finished());
    if (!padded_[k].defined()) continue;
    Tensor& w = *row_blocks_[k].weight;
    std::memcpy(w.data_ptr(), padded_[k].data_ptr(), w.nbytes());
    padded_[k] = Tensor();
  }
  const Clock::time_point t1 = Clock::now();
  total_.exposed_seconds += seconds(t1 - t0);
  total_.busy_seconds += seconds(last - started_);
}

std::vector<std::pair<std::string, Tensor>> Zero1::gathered_state() const {
  const optim::ParamList& ops = optimizer_.params();
  const std::vector<std::pair<std::string, DType>> layout = optimizer_.state_layout();
  std::map<std::string, Tensor> local;
  for (auto& [name, t] : optimizer_.state_tensors())
    if (t.numel() > 0) local.emplace(name, t);
  // Which tensors exist on some rank: per parameter, each state buffer, the master, then the
  // Kahan compensation (the order of an unsharded optimizer's state_tensors()).
  const size_t kMaster = layout.size(), kComp = layout.size() + 1, per = layout.size() + 2;
  std::vector<uint8_t> present(ops.size() * per, 0);
  auto key = [&](size_t i, size_t k) {
    return ops[i].name + "." +
           (k < kMaster ? layout[k].first : std::string(k == kMaster ? "master" : "kahan"));
  };
  for (size_t i = 0; i < ops.size(); ++i)
    for (size_t k = 0; k < per; ++k) present[i * per + k] = local.count(key(i, k)) ? 1 : 0;
  comm_.all_reduce(present.data(), present.size(), DType::u8, comm::ReduceOp::kMax);

  std::vector<std::pair<std::string, Tensor>> out;
  for (size_t i = 0; i < ops.size(); ++i)
    for (size_t k = 0; k < per; ++k) {
      if (!present[i * per + k]) continue;
      const std::string name = key(i, k);
      // The compensation has its parameter's 16-bit type.
      const DType dtype = k < kMaster  ? layout[k].second
                          : k == kComp ? ops[i].tensor->dtype()
                                       : DType::f32;
      TensorOptions o = charged_to(k == kMaster ? MemoryCategory::master_weights
                                                : MemoryCategory::optimizer_state);
      o.owner = name;
      Tensor whole = Tensor::zeros(ops[i].tensor->shape(), dtype, o);
      auto it = local.find(name);
      if (it != local.end()) {
        const optim::ElementRange r = optimizer_.shard(i);
        const Tensor part = it->second.contiguous();
        MANTISSA_ASSERT(part.numel() == r.size() && part.dtype() == dtype,
                        "a state shard of another size or type");
        std::memcpy(
            static_cast<char*>(whole.data_ptr()) + static_cast<size_t>(r.begin) * dtype_size(dtype),
            part.data_ptr(), part.nbytes());
      }
      // The parts are disjoint and every other byte is zero: a byte-wise sum assembles the
      // tensor exactly (no byte sum exceeds 255).
      comm_.all_reduce(whole.data_ptr(), whole.nbytes(), DType::u8, comm::ReduceOp::kSum);
      if (comm_.rank() == 0) out.emplace_back(name, std::move(whole));
    }
  return out;
}

}  // namespace mantissa::dist

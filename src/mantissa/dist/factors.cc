#include "mantissa/dist/factors.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <unordered_set>

#include "mantissa/core/convert.h"
#include "mantissa/core/error.h"
#include "mantissa/dist/agreement.h"
#include "mantissa/kernels/linear.h"

namespace mantissa::dist {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Every rank's (rows, cols) factor, as rows_of[r] x cols blocks of a (ranks, max_rows, cols)
// tensor: all-gathered, padded to the longest rank's rows, once `done` has finished.
Tensor gather_rows(comm::Communicator& comm, const Tensor& x, int64_t max_rows,
                   MemoryCategory category, comm::Request* done) {
  const int64_t rows = x.size(0), cols = x.size(1);
  Tensor send = x.contiguous();
  if (rows != max_rows) {
    Tensor padded =
        Tensor::zeros({max_rows, cols}, x.dtype(), charged_to(MemoryCategory::workspace));
    std::copy_n(static_cast<const char*>(send.data_ptr()), send.nbytes(),
                static_cast<char*>(padded.data_ptr()));
    send = padded;
  }
  TensorOptions o = charged_to(category);
  o.owner = "gathered factors";
  Tensor all = Tensor::empty({comm.size(), max_rows, cols}, x.dtype(), o);
  *done = comm.all_gather_async(send, all);
  return all;
}

// Every rank's rows of a factor (the last batch of an epoch may be split unevenly).
std::vector<int64_t> rows_of_ranks(comm::Communicator& comm, int64_t mine) {
  std::vector<int64_t> rows(static_cast<size_t>(comm.size()));
  comm.all_gather(&mine, rows.data(), 1, DType::i64);
  return rows;
}

// Whether the weight-gradient parts' kernel takes every rank's rows: a deferred gradient's producer
// then keeps the gathered factors until the step, and they are charged to the gradients.
bool parts_fit(const std::vector<int64_t>& rows) {
  return std::all_of(rows.begin(), rows.end(),
                     [](int64_t n) { return n == 0 || kernels::linear_weight_grad_parts_fit(n); });
}

}  // namespace

FactorGradients::FactorGradients(comm::Communicator& comm,
                                 const std::vector<nn::Module::NamedTensor>& weights)
    : comm_(comm) {
  std::unordered_set<const AutogradMeta*> seen;
  ConfigFields fields;
  for (const nn::Module::NamedTensor& w : weights) {
    MANTISSA_CHECK(w.tensor && w.tensor->defined() && w.tensor->requires_grad(),
                   "dist::FactorGradients: weight '" + w.name + "' is undefined or needs no grad",
                   "pass the trainable weights of linear layers");
    const std::shared_ptr<AutogradMeta>& meta = w.tensor->autograd_meta();
    MANTISSA_CHECK(seen.insert(meta.get()).second && !meta->gather_grad_factors,
                   "dist::FactorGradients: weight '" + w.name +
                       "' is given twice or already "
                       "gathers its factors",
                   "pass each weight once, to one FactorGradients");
    weights_.push_back(w);
    meta_.push_back(meta);
    fields.emplace_back(
        w.name, std::string(dtype_name(w.tensor->dtype())) + " " + shape_str(w.tensor->shape()));
  }
  check_config_agreement(comm_, fields, "weights whose gradients travel as factors");
  gathered_.assign(weights_.size(), 0);
  for (const nn::Module::NamedTensor& w : weights_) rows_.emplace_back(0, w.tensor->size(0));
  early_.resize(weights_.size());
  for (size_t k = 0; k < weights_.size(); ++k) {
    meta_[k]->gather_grad_factors = [this, k](const GradFactorCall& call) {
      return gather(k, call);
    };
    meta_[k]->gather_input_factor = [this, k](const Tensor& b) { gather_input(k, b); };
  }
}

FactorGradients::~FactorGradients() {
  for (const auto& meta : meta_) {
    meta->gather_grad_factors = nullptr;
    meta->gather_input_factor = nullptr;
  }
}

void FactorGradients::gather_input(size_t k, const Tensor& b) {
  MANTISSA_CHECK(
      b.dim() == 2,
      "dist::FactorGradients: the input factor of '" + weights_[k].name + "' is not a matrix",
      "pass the op's (rows, in) factor");
  const auto t0 = std::chrono::steady_clock::now();
  EarlyInput e;
  e.data = b.data_ptr();
  e.shape = b.shape();
  e.rows = rows_of_ranks(comm_, b.size(0));
  const int64_t max_rows = *std::max_element(e.rows.begin(), e.rows.end());
  // Kept by the deferred producer where the trainer defers (charged as the backward would).
  e.all = gather_rows(comm_, b, max_rows,
                      parts_fit(e.rows) ? MemoryCategory::gradients : MemoryCategory::workspace,
                      &e.done);
  total_.bytes += static_cast<int64_t>(e.all.nbytes());
  early_[k] = std::move(e);
  const double waited = seconds_since(t0);
  total_.exposed_seconds += waited;
  total_.busy_seconds += waited;
}

void FactorGradients::set_rows(size_t k, int64_t begin, int64_t end) {
  MANTISSA_ASSERT(
      k < weights_.size() && 0 <= begin && begin <= end && end <= weights_[k].tensor->size(0),
      "dist::FactorGradients::set_rows: rows outside the weight");
  rows_[k] = {begin, end};
}

Tensor FactorGradients::gather(size_t k, const GradFactorCall& call) {
  const Tensor &a = call.a, &b = call.b;
  const FactorProduct& product = call.product;
  MANTISSA_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(0) == b.size(0),
                 "dist::FactorGradients: the factors of '" + weights_[k].name +
                     "' are not two matrices of the same rows",
                 "pass the op's (rows, out) and (rows, in) factors");
  const auto t0 = std::chrono::steady_clock::now();
  // The input factor as the forward pass gathered it, when this is the tensor it gathered.
  EarlyInput early = std::move(early_[k]);
  early_[k] = EarlyInput();
  const bool gathered_early =
      early.all.defined() && early.data == b.data_ptr() && early.shape == b.shape();
  // The ranks' rows (the last batch of an epoch may be split unevenly).
  const std::vector<int64_t> rows =
      gathered_early ? std::move(early.rows) : rows_of_ranks(comm_, a.size(0));
  const int64_t max_rows = *std::max_element(rows.begin(), rows.end());
  // Factors a deferred gradient's producer keeps until the step are that gradient (charged so).
  const bool keep = call.defer && parts_fit(rows);
  const MemoryCategory held = keep ? MemoryCategory::gradients : MemoryCategory::workspace;
  // Both gathers started before either is waited for.
  comm::Request a_done, b_done;
  const Tensor as = gather_rows(comm_, a, max_rows, held, &a_done);
  const Tensor bs = gathered_early ? early.all : gather_rows(comm_, b, max_rows, held, &b_done);
  a_done.wait();
  (gathered_early ? early.done : b_done).wait();
  total_.bytes += static_cast<int64_t>(as.nbytes() + (gathered_early ? 0 : bs.nbytes()));
  early_used_ += gathered_early ? 1 : 0;
  const double waited = seconds_since(t0);
  total_.exposed_seconds += waited;
  total_.busy_seconds += waited;

  const int ranks = comm_.size();
  // A deferred gradient (the optimizer forms it at its step, a part at a time, fused with its
  // update): each rank's part as its pass would form it, the parts summed in rank order in FP32
  // and rounded once, from the gathered factors, which the producer keeps.
  if (keep) {
    std::vector<kernels::GradFactors> terms;
    for (int r = 0; r < ranks; ++r) {
      const int64_t n = rows[static_cast<size_t>(r)];
      if (n > 0)
        terms.push_back({as.select(0, r).narrow(0, 0, n), bs.select(0, r).narrow(0, 0, n)});
    }
    const double bound = kernels::linear_weight_grad_bound_sum(terms, call.dtype);
    call.defer(
        [terms = std::move(terms), dt = call.dtype,
         rows = rows_[k]](const GradPartConsumer& consume) {
          kernels::linear_weight_grad_parts_sum(terms, dt, consume, rows.first, rows.second);
        },
        bound);
    gathered_[k] = 1;
    return Tensor();
  }

  // Each rank's product as its pass would form it, summed in rank order in FP32 and rounded once,
  // a block of the gradient's columns at a time (its products and their sum stay in cache; a
  // column of the product is the same FMA chain over the rows whatever the block, so the bits do
  // not depend on it).
  const int64_t outf = a.size(1), in = b.size(1);
  const int64_t width = std::max<int64_t>(64, (int64_t{1} << 18) / std::max<int64_t>(outf, 1));
  Tensor grad;
  std::vector<float> sum, staged;
  for (int64_t c0 = 0; c0 < in; c0 += width) {
    const int64_t cw = std::min(width, in - c0);
    const size_t block = static_cast<size_t>(outf * cw);
    for (int r = 0; r < ranks; ++r) {
      const int64_t n = rows[static_cast<size_t>(r)];
      const Tensor p = product(as.select(0, r).narrow(0, 0, n),
                               bs.select(0, r).narrow(0, 0, n).narrow(1, c0, cw))
                           .contiguous();
      MANTISSA_ASSERT(p.dim() == 2 && p.size(0) == outf && p.size(1) == cw,
                      "dist::FactorGradients: the product of the factors has another shape");
      const DType dt = p.dtype();
      if (!grad.defined()) {
        TensorOptions o = charged_to(MemoryCategory::gradients);
        o.owner = "gradient from factors";
        grad = Tensor::empty({outf, in}, dt, o);
      }
      // The product as FP32 values (in place when it is FP32).
      const float* pf = static_cast<const float*>(p.data_ptr());
      if (dt != DType::f32) {
        staged.resize(block);
        convert(p.data_ptr(), dt, staged.data(), DType::f32, block);
        pf = staged.data();
      }
      if (r == 0) {
        sum.assign(pf, pf + block);
        continue;
      }
      for (size_t j = 0; j < block; ++j) sum[j] += pf[j];
    }
    const size_t es = dtype_size(grad.dtype());
    for (int64_t i = 0; i < outf; ++i)
      convert(sum.data() + i * cw, DType::f32,
              static_cast<char*>(grad.data_ptr()) + (i * in + c0) * static_cast<int64_t>(es),
              grad.dtype(), static_cast<size_t>(cw));
  }
  gathered_[k] = 1;
  if (call.defer) {  // rows past the parts' kernel: the formed gradient, as one part
    call.defer(
        [grad](const GradPartConsumer& consume) {
          consume(0, grad.numel(), grad.data_ptr(), grad.dtype());
        },
        std::numeric_limits<double>::infinity());
    return Tensor();
  }
  return grad;
}

void FactorGradients::finish() {
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t k = 0; k < weights_.size(); ++k) {
    early_[k] = EarlyInput();  // gathered by a forward pass whose backward did not use it
    AutogradMeta& meta = *meta_[k];
    if (gathered_[k] || !meta.grad || !meta.grad->defined()) continue;
    // Formed some other way this pass: the sum over ranks as the reducer's FP32 wire makes it.
    // Summed in an FP32 copy (the gradient may share its storage with another tensor), which
    // becomes the gradient when that is FP32.
    Tensor& g = *meta.grad;
    const size_t n = static_cast<size_t>(g.numel());
    Tensor g32 = Tensor::empty(g.shape(), DType::f32, charged_to(MemoryCategory::gradients));
    convert(g.contiguous().data_ptr(), g.dtype(), g32.data_ptr(), DType::f32, n);
    comm_.all_reduce(g32, comm::ReduceOp::kSum);
    total_.bytes += static_cast<int64_t>(g32.nbytes());
    if (g.dtype() == DType::f32) {
      g = g32;
      continue;
    }
    Tensor out = Tensor::empty(g.shape(), g.dtype(), charged_to(MemoryCategory::gradients));
    convert(g32.data_ptr(), DType::f32, out.data_ptr(), g.dtype(), n);
    g = out;
  }
  const double waited = seconds_since(t0);
  total_.exposed_seconds += waited;
  total_.busy_seconds += waited;
  ++total_.steps;
  std::fill(gathered_.begin(), gathered_.end(), 0);
}

}  // namespace mantissa::dist

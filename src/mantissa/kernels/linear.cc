// Linear layers and matmul (linear.h): lane-split dot products for a small batch through a deep
// layer, the GEMM otherwise, and the linear weight gradient in cache-sized parts.
#include "mantissa/kernels/linear.h"

#include <algorithm>
#include <limits>
#include <span>
#include <vector>

#include "mantissa/core/parallel.h"
#include "mantissa/kernels/nn_internal.h"
#include "mantissa/kernels/vector_kernels.h"

namespace mantissa::kernels {
namespace {

// Lane-split dot products for linear's forward from this depth on (with at most kDotMaxRows rows).
constexpr int64_t kDotMinDepth = 1024;
// linear_weight_grad_parts: batches of up to kPartsMaxRows rows (at 64 the row kernel, reading
// 64 input rows per part from L3, is slower than the GEMM and a separate update: docs/numerics.md);
// parts of kPartRows outputs (the row kernel's block) by kPartColumns inputs (48 KiB, in L2 with
// the inputs' columns).
constexpr int64_t kPartsMaxRows = 16, kPartRows = 6, kPartColumns = 2048;

}  // namespace

int64_t linear_rows(const Tensor& x) {
  int64_t rows = 1;
  for (int64_t k = 0; k + 1 < x.dim(); ++k) rows *= x.size(k);
  return rows;
}

Tensor linear(const Tensor& x_in, const Tensor& w_in, const Tensor& b, DType out, Partials p,
              DType round_w) {
  require_float(x_in, "linear", "input");
  require_float(w_in, "linear", "weight");
  MANTISSA_CHECK(w_in.dim() == 2,
                 "linear: weight must be (out, in), got " + shape_str(w_in.shape()),
                 "pass a 2-D weight");
  MANTISSA_CHECK(x_in.dim() >= 1 && x_in.size(-1) == w_in.size(1),
                 "linear: input " + shape_str(x_in.shape()) + " does not match weight " +
                     shape_str(w_in.shape()) + " (last dimension " +
                     str(x_in.dim() ? x_in.size(-1) : 0) + " vs " + str(w_in.size(1)) + ")",
                 "the input's last dimension must equal the weight's in_features");
  MANTISSA_ASSERT(round_w == DType::f32 || ((round_w == DType::f16 || round_w == DType::bf16) &&
                                            w_in.dtype() == DType::f32),
                  "linear rounds an f32 weight to f16 or bf16");
  const int64_t in = w_in.size(1), outf = w_in.size(0);
  if (b.defined())
    MANTISSA_CHECK(b.dim() == 1 && b.size(0) == outf,
                   "linear: bias " + shape_str(b.shape()) + " for " + str(outf) + " outputs",
                   "the bias has one value per output");
  const Tensor x = x_in.contiguous();
  const int64_t rows = linear_rows(x);
  Shape yshape = x.shape();
  yshape.back() = outf;
  Tensor y = Tensor::empty(yshape, out, charged_to(MemoryCategory::activations));
  if (in == 0) {  // a sum over no input features: the bias, or zeros
    if (b.defined())
      y.copy_from(b.view({1, outf}).expand({rows, outf}).reshape(yshape));
    else
      y.fill(0.0);
    return y;
  }
  // A small batch through a long layer (the tutorial CNN's fc1: 12 x 41772 by 100 x 41772):
  // lane-split dot products read the input and the weight rows in place, once (16-bit values
  // widened as they are read, a 16-bit input a depth pass at a time); the GEMM would pack
  // (transpose) the whole weight for a dozen uses of each value.
  if (rows <= kDotMaxRows && in >= kDotMinDepth && p == Partials::kF32 && w_in.stride(1) == 1 &&
      (w_in.dtype() == DType::f32 || w_in.dtype() == DType::f16 || w_in.dtype() == DType::bf16)) {
    Tensor lanes = f32_workspace({rows, outf, detail::kDotLanes});
    std::fill(lanes.data<float>(), lanes.data<float>() + lanes.numel(), 0.0f);
    std::vector<int64_t> w_rows(static_cast<size_t>(outf));
    for (int64_t j = 0; j < outf; ++j) w_rows[static_cast<size_t>(j)] = j * w_in.stride(0);
    if (round_w != DType::f32)
      detail::dot_lanes_accumulate_rounded(rows, outf, in, x.data_ptr(), x.dtype(), in,
                                           w_in.data<float>(), round_w, w_rows.data(),
                                           lanes.data<float>(), default_num_threads());
    else
      detail::dot_lanes_accumulate(rows, outf, in, x.data_ptr(), x.dtype(), in, w_in.data_ptr(),
                                   w_in.dtype(), w_rows.data(), lanes.data<float>(),
                                   default_num_threads());
    const std::vector<float> bias = bias_f32(b, outf);
    std::vector<float> row(static_cast<size_t>(outf));
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < outf; ++j)
        row[static_cast<size_t>(j)] =
            detail::dot_lanes_finish(lanes.data<float>() + (i * outf + j) * detail::kDotLanes) +
            bias[static_cast<size_t>(j)];
      store_f32(row.data(), outf, bytes(y) + i * outf * esize(out), out, 1);
    }
    return y;
  }
  GemmOptions go;
  go.partials = p;
  go.round_b = round_w;
  const ConstMatrix A{x.data_ptr(), x.dtype(), in, 1};
  const ConstMatrix B{w_in.data_ptr(), w_in.dtype(), w_in.stride(1), w_in.stride(0)};
  // With a bias, C starts from it and beta = 1, so the sum is rounded once, in FP32.
  Tensor acc = (b.defined() && out != DType::f32) ? f32_workspace({rows, outf}) : y;
  if (b.defined()) {
    Tensor bias_rows = b.unsqueeze(0).expand({rows, outf});
    acc.view({rows, outf}).copy_from(bias_rows);
  }
  gemm(rows, outf, in, 1.0f, A, B, b.defined() ? 1.0f : 0.0f,
       {acc.data_ptr(), acc.dtype(), outf, 1}, go);
  if (acc.storage() != y.storage()) y.view({rows, outf}).copy_from(acc);
  return y;
}

bool linear_weight_grad_parts_fit(int64_t rows) { return rows >= 1 && rows <= kPartsMaxRows; }

void linear_weight_grad_parts(const Tensor& g, const Tensor& x, DType out,
                              const GradPartConsumer& consume) {
  const GradFactors term{g, x};
  linear_weight_grad_parts_sum({&term, 1}, out, consume);
}

void linear_weight_grad_parts_sum(std::span<const GradFactors> terms, DType out,
                                  const GradPartConsumer& consume, int64_t row_begin,
                                  int64_t row_end) {
  MANTISSA_ASSERT(!terms.empty(), "linear_weight_grad_parts_sum takes at least one term");
  const int64_t outf = terms[0].g.dim() == 2 ? terms[0].g.size(1) : -1;
  const int64_t in = terms[0].x.dim() == 2 ? terms[0].x.size(1) : -1;
  if (row_end < 0) row_end = outf;
  MANTISSA_ASSERT(0 <= row_begin && row_begin <= row_end && row_end <= outf,
                  "linear_weight_grad_parts_sum: rows [" + str(row_begin) + ", " + str(row_end) +
                      ") of a gradient of " + str(outf));
  if (row_begin == row_end) return;
  // Per term: g^T (out, rows), row o holding the factors of output o in row order, in FP32
  // (16-bit values convert exactly, as the GEMM's packing converts them), and x (rows, in), a
  // 16-bit x widened a column block at a time (no FP32 copy of the whole input).
  struct Term {
    int64_t rows;
    std::vector<float> gt;
    Tensor x;
    bool wide;
  };
  std::vector<Term> ts;
  for (const GradFactors& t : terms) {
    MANTISSA_ASSERT(t.g.dim() == 2 && t.x.dim() == 2 && t.g.size(0) == t.x.size(0) &&
                        t.g.size(1) == outf && t.x.size(1) == in &&
                        linear_weight_grad_parts_fit(t.g.size(0)),
                    "linear_weight_grad_parts takes (rows, out) and (rows, in) matrices of at "
                    "most " +
                        str(kPartsMaxRows) + " rows, of the same out and in for every term");
    require_float(t.g, "linear backward", "gradient");
    require_float(t.x, "linear backward", "input");
    const int64_t rows = t.g.size(0);
    const Tensor g = t.g.to(DType::f32).contiguous();
    std::vector<float> gt(static_cast<size_t>(outf * rows));
    const float* gd = g.data<float>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < outf; ++o) gt[static_cast<size_t>(o * rows + r)] = gd[r * outf + o];
    const Tensor x = t.x.contiguous();
    ts.push_back({rows, std::move(gt), x, x.dtype() == DType::f32});
  }
  const size_t out_size = esize(out);
  const int64_t groups = (row_end - row_begin + kPartRows - 1) / kPartRows;
  const bool summed = ts.size() > 1;
  // Each thread takes whole groups of outputs and walks the inputs in column blocks, all its
  // groups per block: the consumer takes kPartColumns of each of the thread's rows of the
  // parameter and its state per block (fc1 on 2 threads: 50 rows), and an input block is widened
  // once per thread.
  int64_t work = 0;  // multiply-adds
  for (const Term& t : ts) work += (row_end - row_begin) * t.rows * in;
  parallel_for(static_cast<size_t>(groups), 1, threads_for(work), [&](size_t g0, size_t g1) {
    std::vector<float> part(static_cast<size_t>(kPartRows * kPartColumns));  // (kPartRows, cols)
    std::vector<float> sum(summed ? part.size() : 0);                        // (kPartRows, cols)
    std::vector<char> rounded(out == DType::f32 ? 0 : kPartColumns * out_size);
    std::vector<std::vector<float>> blocks(ts.size());  // per term: (rows, cols) widened
    std::vector<std::vector<const float*>> xr(ts.size());
    for (size_t k = 0; k < ts.size(); ++k) {
      if (!ts[k].wide) blocks[k].resize(static_cast<size_t>(ts[k].rows * kPartColumns));
      xr[k].resize(static_cast<size_t>(ts[k].rows));
    }
    for (int64_t j0 = 0; j0 < in; j0 += kPartColumns) {
      const int64_t n = std::min(kPartColumns, in - j0);
      for (size_t k = 0; k < ts.size(); ++k) {
        const Term& t = ts[k];
        const size_t x_size = esize(t.x.dtype());
        for (int64_t r = 0; r < t.rows; ++r) {
          const char* src = bytes(t.x) + static_cast<size_t>(r * in + j0) * x_size;
          if (t.wide) {
            xr[k][static_cast<size_t>(r)] = reinterpret_cast<const float*>(src);
          } else {
            float* dst = blocks[k].data() + r * kPartColumns;
            load_f32(src, t.x.dtype(), 1, n, dst);
            xr[k][static_cast<size_t>(r)] = dst;
          }
        }
      }
      for (size_t grp = g0; grp < g1; ++grp) {
        const int64_t o0 = row_begin + static_cast<int64_t>(grp) * kPartRows,
                      no = std::min(kPartRows, row_end - o0);
        for (size_t k = 0; k < ts.size(); ++k) {
          const Term& t = ts[k];
          detail::fma_rows(part.data(), DType::f32, kPartColumns, no, nullptr,
                           t.gt.data() + o0 * t.rows, t.rows, xr[k].data(), t.rows, n);
          if (!summed) break;
          // A term's values as its own gradient would hold them (rounded into `out`), added in
          // term order in FP32.
          for (int64_t o = 0; o < no; ++o) {
            float* v = part.data() + o * kPartColumns;
            float* acc = sum.data() + o * kPartColumns;
            if (out != DType::f32) detail::round_through(v, n, out);
            if (k == 0)
              std::copy(v, v + n, acc);
            else
              for (int64_t j = 0; j < n; ++j) acc[j] += v[j];
          }
        }
        const float* result = summed ? sum.data() : part.data();
        for (int64_t o = 0; o < no; ++o) {
          const float* values = result + o * kPartColumns;
          if (out == DType::f32) {
            consume((o0 + o) * in + j0, n, values, out);
          } else {  // rounded once, to nearest even, as the GEMM stores a 16-bit result
            store_f32(values, n, rounded.data(), out, 1);
            consume((o0 + o) * in + j0, n, rounded.data(), out);
          }
        }
      }
    }
  });
}

double linear_weight_grad_bound(const Tensor& g_in, const Tensor& x_in, DType out) {
  MANTISSA_ASSERT(g_in.dim() == 2 && x_in.dim() == 2 && g_in.size(0) == x_in.size(0) &&
                      linear_weight_grad_parts_fit(g_in.size(0)),
                  "linear_weight_grad_bound takes (rows, out) and (rows, in) matrices of at most " +
                      str(kPartsMaxRows) + " rows");
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const double largest = max_finite(out);
  if (largest == 0) return kInf;
  const Tensor g = g_in.contiguous(), x = x_in.contiguous();
  const int64_t rows = g.size(0);
  // amax is +inf for a row holding an inf or NaN, and so is the sum then. The rows' amaxes in
  // parallel (x's rows are long: 12 x 41,772 for the tutorial CNN's fc1), added in row order.
  const auto [g_max, x_max] = slice_amaxes(g, x, rows);
  double t = 0;
  for (int64_t r = 0; r < rows; ++r)
    t += g_max[static_cast<size_t>(r)] * x_max[static_cast<size_t>(r)];
  // Each of at most kPartsMaxRows FMAs grows |acc| by at most a factor (1 + 2^-24), and the
  // double sum above is off by far less: 2^-10 covers both.
  return bound_rounded_into(t * (1 + 0x1p-10), out);
}

double linear_weight_grad_bound_sum(std::span<const GradFactors> terms, DType out) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  double t = 0;
  for (const GradFactors& term : terms) {
    const double b = linear_weight_grad_bound(term.g, term.x, out);
    if (!(b < kInf)) return kInf;
    t += b;
  }
  if (terms.size() == 1) return t;
  // The terms' values (each at most its bound, rounding into `out` included) are added in FP32
  // (a relative 2^-24 per addition), and the sum is rounded into `out` once more.
  return bound_rounded_into(t * (1 + static_cast<double>(terms.size() - 1) * 0x1p-24), out);
}

Tensor matmul(const Tensor& a_in, const Tensor& b_in, DType out, Partials p, MemoryCategory cat,
              DType round_b, DType round_out) {
  require_float(a_in, "matmul", "left operand");
  require_float(b_in, "matmul", "right operand");
  MANTISSA_CHECK(a_in.dim() >= 2 && b_in.dim() >= 2,
                 "matmul: operands must have at least 2 dimensions, got " +
                     shape_str(a_in.shape()) + " and " + shape_str(b_in.shape()),
                 "unsqueeze vectors to matrices");
  const int64_t M = a_in.size(-2), K = a_in.size(-1), N = b_in.size(-1);
  MANTISSA_CHECK(b_in.size(-2) == K,
                 "matmul: " + shape_str(a_in.shape()) + " @ " + shape_str(b_in.shape()) +
                     ": inner dimensions " + str(K) + " and " + str(b_in.size(-2)) + " differ",
                 "the left operand's last dimension must equal the right's second-to-last");
  Shape batch(a_in.shape().begin(), a_in.shape().end() - 2);
  const bool b_batched = b_in.dim() > 2;
  if (b_batched)
    MANTISSA_CHECK(Shape(b_in.shape().begin(), b_in.shape().end() - 2) == batch,
                   "matmul: batch dimensions of " + shape_str(a_in.shape()) + " and " +
                       shape_str(b_in.shape()) + " differ",
                   "use equal batch dimensions, or a 2-D right operand");
  int64_t batches = 1;
  for (int64_t d : batch) batches *= d;
  Shape yshape = batch;
  yshape.push_back(M);
  yshape.push_back(N);
  Tensor y = Tensor::empty(yshape, out, charged_to(cat));
  const Tensor a = a_in.reshape({batches, M, K});
  const Tensor b = b_batched ? b_in.reshape({batches, K, N}) : b_in;
  GemmOptions go;
  go.partials = p;
  go.round_b = round_b;
  go.round_c = round_out;
  for (int64_t i = 0; i < batches; ++i) {
    const Tensor ai = a.select(0, i);
    const Tensor bi = b_batched ? b.select(0, i) : b;
    gemm(M, N, K, 1.0f, {ai.data_ptr(), ai.dtype(), ai.stride(0), ai.stride(1)},
         {bi.data_ptr(), bi.dtype(), bi.stride(0), bi.stride(1)}, 0.0f,
         {bytes(y) + i * M * N * esize(out), out, N, 1}, go);
  }
  return y;
}

}  // namespace mantissa::kernels

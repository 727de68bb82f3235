#include "mantissa/kernels/elementwise.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>

#include "mantissa/core/error.h"
#include "mantissa/core/parallel.h"
#include "mantissa/kernels/vector_kernels.h"

namespace mantissa::kernels {

// ---- Loads and stores
// ----------------------------------------------------------------------------

void load_f32(const void* src, DType t, int64_t stride, int64_t n, float* dst) {
  if (n <= 0) return;
  if (stride == 0) {
    float v;
    convert(src, t, &v, DType::f32, 1);
    std::fill(dst, dst + n, v);
  } else if (stride == 1) {
    convert(src, t, dst, DType::f32, static_cast<size_t>(n));
  } else if (t == DType::f32) {
    const float* s = static_cast<const float*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = s[i * stride];
  } else if (dtype_size(t) == 2) {
    // Gathered into runs of 16-bit values, converted a run at a time (the SIMD path).
    const uint16_t* s = static_cast<const uint16_t*>(src);
    uint16_t run[256];
    for (int64_t i0 = 0; i0 < n; i0 += 256) {
      const int64_t m = std::min<int64_t>(256, n - i0);
      for (int64_t i = 0; i < m; ++i) run[i] = s[(i0 + i) * stride];
      convert(run, t, dst + i0, DType::f32, static_cast<size_t>(m));
    }
  } else {
    const int64_t es = static_cast<int64_t>(dtype_size(t));
    for (int64_t i = 0; i < n; ++i)
      convert(static_cast<const char*>(src) + i * stride * es, t, dst + i, DType::f32, 1);
  }
}

const float* row_f32(const char* src, DType t, int64_t stride, int64_t n, float* buf) {
  if (t == DType::f32 && stride == 1) return reinterpret_cast<const float*>(src);
  load_f32(src, t, stride, n, buf);
  return buf;
}

void store_f32(const float* src, int64_t n, void* dst, DType t, int64_t stride) {
  if (n <= 0) return;
  if (stride == 1) {
    convert(src, DType::f32, dst, t, static_cast<size_t>(n));
  } else if (t == DType::f32) {
    float* d = static_cast<float*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i * stride] = src[i];
  } else if (dtype_size(t) == 2) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    uint16_t run[256];
    for (int64_t i0 = 0; i0 < n; i0 += 256) {
      const int64_t m = std::min<int64_t>(256, n - i0);
      convert(src + i0, DType::f32, run, t, static_cast<size_t>(m));
      for (int64_t i = 0; i < m; ++i) d[(i0 + i) * stride] = run[i];
    }
  } else {
    const int64_t es = static_cast<int64_t>(dtype_size(t));
    for (int64_t i = 0; i < n; ++i)
      convert(src + i, DType::f32, static_cast<char*>(dst) + i * stride * es, t, 1);
  }
}

namespace {

constexpr int64_t kChunk = 1024;  // FP32 staging per operand

const char* byte_ptr(const Tensor& t) { return static_cast<const char*>(t.data_ptr()); }
char* byte_ptr(Tensor& t) { return static_cast<char*>(t.data_ptr()); }

// Walks the elements of `shape` as rows: dimensions that are contiguous for every operand
// (given by element strides) are merged, so a broadcast bias over (N, C, H, W) walks rows of H*W.
// fn(offsets, row_length, inner_strides) per row; offsets in elements per operand. Rows run on
// several threads when the tensor is large (callers write disjoint outputs per row).
template <size_t N>
void for_each_row(const Shape& shape, std::array<Shape, N> strides,
                  const std::function<void(const std::array<int64_t, N>&, int64_t,
                                           const std::array<int64_t, N>&)>& fn) {
  // Coalesce, innermost first; size-1 dimensions vanish.
  Shape dims;
  std::array<Shape, N> st;
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    if (shape[d] == 1) continue;
    if (!dims.empty()) {
      bool mergeable = true;
      for (size_t k = 0; k < N; ++k)
        if (strides[k][d] != st[k].front() * dims.front()) mergeable = false;
      if (mergeable) {
        dims.front() *= shape[d];
        continue;
      }
    }
    dims.insert(dims.begin(), shape[d]);
    for (size_t k = 0; k < N; ++k) st[k].insert(st[k].begin(), strides[k][d]);
  }
  for (int64_t d : shape)
    if (d == 0) return;
  if (dims.empty()) {  // a single element
    std::array<int64_t, N> zero{}, one{};
    one.fill(1);
    fn(zero, 1, one);
    return;
  }
  const int64_t row = dims.back();
  std::array<int64_t, N> inner;
  for (size_t k = 0; k < N; ++k) inner[k] = st[k].back();
  const int64_t outer_dims = static_cast<int64_t>(dims.size()) - 1;
  int64_t rows = 1;
  for (int64_t d = 0; d < outer_dims; ++d) rows *= dims[d];
  // Work items are segments of rows: a long row (a whole contiguous tensor coalesces into one) is
  // cut into segments so that every thread gets a share.
  const int64_t threads = threads_for(rows * row);
  const int64_t seg = threads > 1 && rows < 4 * threads
                          ? std::max<int64_t>(4096, (row + 4 * threads - 1) / (4 * threads))
                          : row;
  const int64_t segs = (row + seg - 1) / seg;
  const int64_t items = rows * segs;
  const int64_t grain = std::max<int64_t>(1, kParallelElements / std::max<int64_t>(seg, 1));
  parallel_for(static_cast<size_t>(items), static_cast<size_t>(grain), static_cast<int>(threads),
               [&](size_t t0, size_t t1) {
                 for (size_t t = t0; t < t1; ++t) {
                   const int64_t r = static_cast<int64_t>(t) / segs,
                                 sg = static_cast<int64_t>(t) % segs;
                   std::array<int64_t, N> off{};
                   int64_t rem = r;
                   for (int64_t d = outer_dims - 1; d >= 0; --d) {
                     const int64_t i = rem % dims[d];
                     rem /= dims[d];
                     for (size_t k = 0; k < N; ++k) off[k] += i * st[k][d];
                   }
                   for (size_t k = 0; k < N; ++k) off[k] += sg * seg * inner[k];
                   fn(off, std::min(seg, row - sg * seg), inner);
                 }
               });
}

// Where a row's results go: the destination itself when it is contiguous FP32, else buf (then
// finish_row stores it).
float* out_row(char* dst, DType t, int64_t stride, float* buf) {
  return t == DType::f32 && stride == 1 ? reinterpret_cast<float*>(dst) : buf;
}
void finish_row(const float* r, int64_t n, char* dst, DType t, int64_t stride) {
  if (r != reinterpret_cast<const float*>(dst)) store_f32(r, n, dst, t, stride);
}

// The strides of t seen as a tensor of `shape` (broadcast dimensions get stride 0).
Shape broadcast_strides(const Tensor& t, const Shape& shape) { return t.expand(shape).strides(); }

float apply_unary(UnaryOp op, float x) {
  switch (op) {
    case UnaryOp::kRelu:
      return x > 0.0f || x != x ? x : 0.0f;  // NaN propagates, as in PyTorch
    case UnaryOp::kGelu:
      return 0.5f * x * (1.0f + std::erf(x * 0.70710678118654752f));
    case UnaryOp::kSigmoid:
      return 1.0f / (1.0f + std::exp(-x));
    case UnaryOp::kTanh:
      return std::tanh(x);
    case UnaryOp::kNeg:
      return -x;
    case UnaryOp::kExp:
      return std::exp(x);
    case UnaryOp::kLog:
      return std::log(x);
    case UnaryOp::kSqrt:
      return std::sqrt(x);
    case UnaryOp::kSquare:
      return x * x;
  }
  return x;
}

// d op(x) / dx, from x and y = op(x).
inline float unary_derivative(UnaryOp op, float x, float y) {
  switch (op) {
    case UnaryOp::kRelu:
      return y > 0.0f ? 1.0f : 0.0f;
    case UnaryOp::kGelu:
      return 0.5f * (1.0f + std::erf(x * 0.70710678118654752f)) +
             x * 0.39894228040143268f * std::exp(-0.5f * x * x);
    case UnaryOp::kSigmoid:
      return y * (1.0f - y);
    case UnaryOp::kTanh:
      return 1.0f - y * y;
    case UnaryOp::kNeg:
      return -1.0f;
    case UnaryOp::kExp:
      return y;
    case UnaryOp::kLog:
      return 1.0f / x;
    case UnaryOp::kSqrt:
      return 0.5f / y;
    case UnaryOp::kSquare:
      return 2.0f * x;
  }
  return 1.0f;
}

template <BinaryOp kOp>
void binary_loop(const float* a, const float* b, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (kOp == BinaryOp::kAdd) y[i] = a[i] + b[i];
    if constexpr (kOp == BinaryOp::kSub) y[i] = a[i] - b[i];
    if constexpr (kOp == BinaryOp::kMul) y[i] = a[i] * b[i];
    if constexpr (kOp == BinaryOp::kDiv) y[i] = a[i] / b[i];
  }
}

void binary_apply(BinaryOp op, const float* a, const float* b, float* y, int64_t n) {
  switch (op) {
    case BinaryOp::kAdd:
      return binary_loop<BinaryOp::kAdd>(a, b, y, n);
    case BinaryOp::kSub:
      return binary_loop<BinaryOp::kSub>(a, b, y, n);
    case BinaryOp::kMul:
      return binary_loop<BinaryOp::kMul>(a, b, y, n);
    case BinaryOp::kDiv:
      return binary_loop<BinaryOp::kDiv>(a, b, y, n);
  }
}

void check_float(const Tensor& t, const char* op) {
  MANTISSA_CHECK(t.defined(), std::string(op) + ": undefined input tensor",
                 "pass a defined tensor");
  MANTISSA_CHECK(is_floating(t.dtype()) && t.dtype() != DType::f64,
                 std::string(op) + ": inputs must be f32, f16, bf16, e4m3 or e5m2 (got " +
                     std::string(dtype_name(t.dtype())) + ")",
                 "convert the input with cast() first");
}

int64_t norm_dim(int64_t dim, int64_t rank, const char* op) {
  MANTISSA_CHECK(dim >= -rank && dim < rank,
                 std::string(op) + ": dimension " + std::to_string(dim) +
                     " is out of range for rank " + std::to_string(rank),
                 "use a dimension in [-rank, rank)");
  return dim < 0 ? dim + rank : dim;
}

}  // namespace

Shape broadcast_shapes(const Shape& a, const Shape& b) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    if (da != db && da != 1 && db != 1)
      throw Error("shapes " + shape_str(a) + " and " + shape_str(b) +
                      " do not broadcast (dimension " + std::to_string(i) + ": " +
                      std::to_string(da) + " vs " + std::to_string(db) + ")",
                  "sizes must match or be 1 in every trailing dimension");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

namespace {
template <UnaryOp kOp>
void unary_loop(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = apply_unary(kOp, x[i]);
}
// The op's loop, chosen once per row (the switch outside the loop lets the compiler vectorize).
void unary_apply(UnaryOp op, const float* x, float* y, int64_t n) {
  switch (op) {
    case UnaryOp::kRelu:
      return unary_loop<UnaryOp::kRelu>(x, y, n);
    case UnaryOp::kGelu:
      return unary_loop<UnaryOp::kGelu>(x, y, n);
    case UnaryOp::kSigmoid:
      return unary_loop<UnaryOp::kSigmoid>(x, y, n);
    case UnaryOp::kTanh:
      return unary_loop<UnaryOp::kTanh>(x, y, n);
    case UnaryOp::kNeg:
      return unary_loop<UnaryOp::kNeg>(x, y, n);
    case UnaryOp::kExp:
      return unary_loop<UnaryOp::kExp>(x, y, n);
    case UnaryOp::kLog:
      return unary_loop<UnaryOp::kLog>(x, y, n);
    case UnaryOp::kSqrt:
      return unary_loop<UnaryOp::kSqrt>(x, y, n);
    case UnaryOp::kSquare:
      return unary_loop<UnaryOp::kSquare>(x, y, n);
  }
}
}  // namespace

Tensor unary(UnaryOp op, const Tensor& x, DType out, MemoryCategory cat) {
  check_float(x, "unary op");
  Tensor y = Tensor::empty(x.shape(), out, charged_to(cat));
  const char* xb = byte_ptr(x);
  char* yb = byte_ptr(y);
  const size_t xs = dtype_size(x.dtype()), ys = dtype_size(out);
  // ReLU over contiguous rows by the vector rows (a 16-bit side widened and rounded in
  // registers, no staging).
  const bool relu_rows =
      op == UnaryOp::kRelu && is_compute_float(x.dtype()) && is_compute_float(out);
  for_each_row<2>(x.shape(), {x.strides(), y.strides()},
                  [&](const auto& off, int64_t n, const auto& in) {
                    if (relu_rows && in[0] == 1 && in[1] == 1 &&
                        detail::relu_row(xb + off[0] * static_cast<int64_t>(xs), x.dtype(),
                                         yb + off[1] * static_cast<int64_t>(ys), out, n))
                      return;
                    // FP32 rows are read and written in place; other dtypes go through an FP32
                    // staging buffer.
                    const bool direct_in = x.dtype() == DType::f32 && in[0] == 1,
                               direct_out = out == DType::f32 && in[1] == 1;
                    float buf[kChunk], res[kChunk];
                    for (int64_t c = 0; c < n; c += kChunk) {
                      const int64_t m = std::min(kChunk, n - c);
                      const char* src = xb + (off[0] + c * in[0]) * static_cast<int64_t>(xs);
                      char* dst = yb + (off[1] + c * in[1]) * static_cast<int64_t>(ys);
                      const float* a = direct_in ? reinterpret_cast<const float*>(src) : buf;
                      if (!direct_in) load_f32(src, x.dtype(), in[0], m, buf);
                      float* r = direct_out ? reinterpret_cast<float*>(dst) : res;
                      unary_apply(op, a, r, m);
                      if (!direct_out) store_f32(r, m, dst, out, in[1]);
                    }
                  });
  return y;
}

namespace {
template <UnaryOp kOp>
void backward_loop(const float* g, const float* x, const float* y, float* dx, int64_t n) {
  if constexpr (kOp == UnaryOp::kRelu) {
    // A selection, as PyTorch's threshold_backward: where the output is 0 the gradient is 0 even
    // if the incoming one is inf or nan (and where it is NaN, the gradient passes). Written as a
    // bit mask so that it compiles to a vector AND: the ternary compiled to a branch per element,
    // mispredicted half the time on real activations (ten times the forward ReLU's time on the
    // tutorial CNN's conv1 output).
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t keep = y[i] <= 0.0f ? 0u : ~0u;
      dx[i] = std::bit_cast<float>(std::bit_cast<uint32_t>(g[i]) & keep);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) dx[i] = g[i] * unary_derivative(kOp, x[i], y[i]);
  }
}
void backward_apply(UnaryOp op, const float* g, const float* x, const float* y, float* dx,
                    int64_t n) {
  switch (op) {
    case UnaryOp::kRelu:
      return backward_loop<UnaryOp::kRelu>(g, x, y, dx, n);
    case UnaryOp::kGelu:
      return backward_loop<UnaryOp::kGelu>(g, x, y, dx, n);
    case UnaryOp::kSigmoid:
      return backward_loop<UnaryOp::kSigmoid>(g, x, y, dx, n);
    case UnaryOp::kTanh:
      return backward_loop<UnaryOp::kTanh>(g, x, y, dx, n);
    case UnaryOp::kNeg:
      return backward_loop<UnaryOp::kNeg>(g, x, y, dx, n);
    case UnaryOp::kExp:
      return backward_loop<UnaryOp::kExp>(g, x, y, dx, n);
    case UnaryOp::kLog:
      return backward_loop<UnaryOp::kLog>(g, x, y, dx, n);
    case UnaryOp::kSqrt:
      return backward_loop<UnaryOp::kSqrt>(g, x, y, dx, n);
    case UnaryOp::kSquare:
      return backward_loop<UnaryOp::kSquare>(g, x, y, dx, n);
  }
}
}  // namespace

Tensor unary_backward(UnaryOp op, const Tensor& grad_out, const Tensor& x, const Tensor& y,
                      DType out, MemoryCategory cat, Tensor into) {
  MANTISSA_ASSERT(!into.defined() || (into.shape() == grad_out.shape() && into.dtype() == out &&
                                      into.is_contiguous()),
                  "unary_backward writes into a contiguous tensor of the gradient's shape");
  Tensor dx =
      into.defined() ? std::move(into) : Tensor::empty(grad_out.shape(), out, charged_to(cat));
  const Tensor& xx = x.defined() ? x : y;  // whichever the op's derivative is computed from
  const Tensor& yy = y.defined() ? y : x;
  const size_t gs = dtype_size(grad_out.dtype()), xs = dtype_size(xx.dtype()),
               ys = dtype_size(yy.dtype()), ds = dtype_size(out);
  // ReLU over contiguous rows by the vector rows (16-bit sides widened and rounded in
  // registers, no staging).
  const bool relu_rows = op == UnaryOp::kRelu && is_compute_float(grad_out.dtype()) &&
                         is_compute_float(yy.dtype()) && is_compute_float(out);
  for_each_row<4>(
      grad_out.shape(), {grad_out.strides(), xx.strides(), yy.strides(), dx.strides()},
      [&](const auto& off, int64_t n, const auto& in) {
        if (relu_rows && in[0] == 1 && in[2] == 1 && in[3] == 1 &&
            detail::relu_backward_row(byte_ptr(grad_out) + off[0] * static_cast<int64_t>(gs),
                                      grad_out.dtype(),
                                      byte_ptr(yy) + off[2] * static_cast<int64_t>(ys), yy.dtype(),
                                      byte_ptr(dx) + off[3] * static_cast<int64_t>(ds), out, n))
          return;
        float g[kChunk], a[kChunk], b[kChunk], r[kChunk];
        for (int64_t c = 0; c < n; c += kChunk) {
          const int64_t m = std::min(kChunk, n - c);
          const float* pg =
              row_f32(byte_ptr(grad_out) + (off[0] + c * in[0]) * static_cast<int64_t>(gs),
                      grad_out.dtype(), in[0], m, g);
          const float* px = row_f32(byte_ptr(xx) + (off[1] + c * in[1]) * static_cast<int64_t>(xs),
                                    xx.dtype(), in[1], m, a);
          const float* py = row_f32(byte_ptr(yy) + (off[2] + c * in[2]) * static_cast<int64_t>(ys),
                                    yy.dtype(), in[2], m, b);
          char* dst = byte_ptr(dx) + (off[3] + c * in[3]) * static_cast<int64_t>(ds);
          float* pd = out_row(dst, out, in[3], r);
          backward_apply(op, pg, px, py, pd, m);
          finish_row(pd, m, dst, out, in[3]);
        }
      });
  return dx;
}

Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b, DType out, MemoryCategory cat) {
  check_float(a, "binary op");
  check_float(b, "binary op");
  const Shape shape = broadcast_shapes(a.shape(), b.shape());
  Tensor y = Tensor::empty(shape, out, charged_to(cat));
  const size_t as = dtype_size(a.dtype()), bs = dtype_size(b.dtype()), ys = dtype_size(out);
  for_each_row<3>(
      shape, {broadcast_strides(a, shape), broadcast_strides(b, shape), y.strides()},
      [&](const auto& off, int64_t n, const auto& in) {
        float fa[kChunk], fb[kChunk], fy[kChunk];
        for (int64_t c = 0; c < n; c += kChunk) {
          const int64_t m = std::min(kChunk, n - c);
          const float* pa = row_f32(byte_ptr(a) + (off[0] + c * in[0]) * static_cast<int64_t>(as),
                                    a.dtype(), in[0], m, fa);
          const float* pb = row_f32(byte_ptr(b) + (off[1] + c * in[1]) * static_cast<int64_t>(bs),
                                    b.dtype(), in[1], m, fb);
          char* dst = byte_ptr(y) + (off[2] + c * in[2]) * static_cast<int64_t>(ys);
          float* py = out_row(dst, out, in[2], fy);
          binary_apply(op, pa, pb, py, m);
          finish_row(py, m, dst, out, in[2]);
        }
      });
  return y;
}

Tensor binary_scalar(BinaryOp op, const Tensor& a, double s, bool scalar_first, DType out,
                     MemoryCategory cat) {
  check_float(a, "scalar op");
  Tensor y = Tensor::empty(a.shape(), out, charged_to(cat));
  const float sv = static_cast<float>(s);
  const size_t as = dtype_size(a.dtype()), ys = dtype_size(out);
  for_each_row<2>(
      a.shape(), {a.strides(), y.strides()}, [&](const auto& off, int64_t n, const auto& in) {
        float fa[kChunk], fs[kChunk];
        std::fill(fs, fs + kChunk, sv);
        for (int64_t c = 0; c < n; c += kChunk) {
          const int64_t m = std::min(kChunk, n - c);
          load_f32(byte_ptr(a) + (off[0] + c * in[0]) * static_cast<int64_t>(as), a.dtype(), in[0],
                   m, fa);
          if (scalar_first)
            binary_apply(op, fs, fa, fa, m);
          else
            binary_apply(op, fa, fs, fa, m);
          store_f32(fa, m, byte_ptr(y) + (off[1] + c * in[1]) * static_cast<int64_t>(ys), out,
                    in[1]);
        }
      });
  return y;
}

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims_in, bool keepdim, DType out,
           MemoryCategory cat) {
  check_float(x, "sum");
  const int64_t rank = x.dim();
  std::vector<bool> reduce(static_cast<size_t>(rank), dims_in.empty());
  for (int64_t d : dims_in) reduce[static_cast<size_t>(norm_dim(d, rank, "sum"))] = true;
  Shape kept(x.shape());
  for (int64_t d = 0; d < rank; ++d)
    if (reduce[d]) kept[d] = 1;
  // Accumulate in an FP32 buffer of the kept shape: each row of x adds into its output row (or,
  // when the row runs along a reduced dimension, into one output element).
  const Shape kstrides = contiguous_strides(kept);
  Shape acc_strides(static_cast<size_t>(rank));
  for (int64_t d = 0; d < rank; ++d) acc_strides[d] = reduce[d] ? 0 : kstrides[d];
  int64_t n_out = 1;
  for (int64_t d : kept) n_out *= d;
  std::vector<float> acc(static_cast<size_t>(n_out), 0.0f);
  const size_t xs = dtype_size(x.dtype());
  Shape shape = x.shape();
  Shape xstr = x.strides();
  // Reduced dimensions at the end of a contiguous tensor are one run per output element (a bias
  // gradient's H x W planes): merged into one long row.
  if (x.is_contiguous()) {
    while (shape.size() >= 2 && reduce[shape.size() - 1] && reduce[shape.size() - 2]) {
      const size_t d = shape.size() - 1;
      shape[d - 1] *= shape[d];
      xstr[d - 1] = 1;
      shape.pop_back();
      xstr.pop_back();
      acc_strides.pop_back();
    }
  }
  const int64_t rk = static_cast<int64_t>(shape.size());
  const int64_t last = rk > 0 ? shape[rk - 1] : 1;
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < rk; ++d) rows *= shape[d];
  const int64_t xin = rk > 0 ? xstr[rk - 1] : 1, ain = rk > 0 ? acc_strides[rk - 1] : 0;
  auto offsets = [&](int64_t r, int64_t& xo, int64_t& ao) {
    int64_t rem = r;
    xo = 0;
    ao = 0;
    for (int64_t d = rk - 2; d >= 0; --d) {
      const int64_t i = rem % shape[d];
      rem /= shape[d];
      xo += i * xstr[d];
      ao += i * acc_strides[d];
    }
  };
  // FP32 rows read in place; others through a staging buffer.
  auto row_values = [&](int64_t xo, int64_t c, int64_t m, float* buf) -> const float* {
    const char* src = byte_ptr(x) + (xo + c * xin) * static_cast<int64_t>(xs);
    if (x.dtype() == DType::f32 && xin == 1) return reinterpret_cast<const float*>(src);
    load_f32(src, x.dtype(), xin, m, buf);
    return buf;
  };
  if (x.numel() > 0 && ain == 0) {
    // Each row reduces to one value: the rows' sums in parallel (eight lanes a chunk, chunks in
    // order), then added to their outputs in row order, so any thread count gives the same bits.
    std::vector<float> row_sum(static_cast<size_t>(rows));
    const int64_t threads = threads_for(rows * last);
    parallel_for(static_cast<size_t>(rows),
                 static_cast<size_t>(std::max<int64_t>(1, kParallelElements / last)),
                 static_cast<int>(threads), [&](size_t r0, size_t r1) {
                   float buf[kChunk];
                   for (size_t r = r0; r < r1; ++r) {
                     int64_t xo, ao;
                     offsets(static_cast<int64_t>(r), xo, ao);
                     float total = 0;
                     for (int64_t c = 0; c < last; c += kChunk) {
                       const int64_t m = std::min(kChunk, last - c);
                       const float* v = row_values(xo, c, m, buf);
                       float s8[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                       int64_t i = 0;
                       for (; i + 8 <= m; i += 8)
                         for (int j = 0; j < 8; ++j) s8[j] += v[i + j];
                       float sc = ((s8[0] + s8[1]) + (s8[2] + s8[3])) +
                                  ((s8[4] + s8[5]) + (s8[6] + s8[7]));
                       for (; i < m; ++i) sc += v[i];
                       total += sc;
                     }
                     row_sum[r] = total;
                   }
                 });
    for (int64_t r = 0; r < rows; ++r) {
      int64_t xo, ao;
      offsets(r, xo, ao);
      acc[static_cast<size_t>(ao)] += row_sum[static_cast<size_t>(r)];
    }
  } else if (x.numel() > 0) {
    // A serial walk over the rows of x (rows may add into the same outputs), vectorised within
    // a row.
    float buf[kChunk];
    for (int64_t r = 0; r < rows; ++r) {
      int64_t xo, ao;
      offsets(r, xo, ao);
      for (int64_t c = 0; c < last; c += kChunk) {
        const int64_t m = std::min(kChunk, last - c);
        const float* v = row_values(xo, c, m, buf);
        float* a = acc.data() + ao + c * ain;
        for (int64_t i = 0; i < m; ++i) a[i * ain] += v[i];
      }
    }
  }
  Shape out_shape;
  for (int64_t d = 0; d < rank; ++d)
    if (!reduce[d] || keepdim) out_shape.push_back(kept[d]);
  Tensor y = Tensor::empty(out_shape, out, charged_to(cat));
  convert(acc.data(), DType::f32, y.data_ptr(), out, acc.size());
  return y;
}

Tensor sum_to_shape(const Tensor& g, const Shape& shape, DType out, MemoryCategory cat) {
  if (g.shape() == shape) return g.dtype() == out ? g : cast(g, out, {}, cat);
  const int64_t lead = g.dim() - static_cast<int64_t>(shape.size());
  MANTISSA_CHECK(lead >= 0,
                 "sum_to_shape: " + shape_str(g.shape()) + " cannot reduce to " + shape_str(shape),
                 "the target must broadcast to the source");
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < g.dim(); ++d)
    if (d < lead || (shape[d - lead] == 1 && g.size(d) != 1)) dims.push_back(d);
  Tensor s = sum(g, dims, true, out, cat);
  return s.view(shape);
}

Tensor softmax(const Tensor& x, int64_t dim, bool log, DType out, MemoryCategory cat) {
  check_float(x, "softmax");
  dim = norm_dim(dim, x.dim(), "softmax");
  Tensor y = Tensor::empty(x.shape(), out, charged_to(cat));
  // Lines along `dim`: iterate the other dimensions, each line is one softmax.
  Shape outer = x.shape();
  outer[dim] = 1;
  const int64_t len = x.size(dim), xstep = x.stride(dim), ystep = y.stride(dim);
  const size_t xs = dtype_size(x.dtype()), ys = dtype_size(out);
  for_each_row<2>(
      outer, {x.strides(), y.strides()}, [&](const auto& off0, int64_t n, const auto& in) {
        std::vector<float> buf(static_cast<size_t>(len));
        for (int64_t j = 0; j < n; ++j) {
          load_f32(byte_ptr(x) + (off0[0] + j * in[0]) * static_cast<int64_t>(xs), x.dtype(), xstep,
                   len, buf.data());
          float mx = -INFINITY;
          for (float v : buf) mx = std::max(mx, v);
          // One exp per element, kept for the normalization.
          float total = 0.0f;
          if (log) {
            for (float v : buf) total += std::exp(v - mx);
            const float shift = mx + std::log(total);
            for (float& v : buf) v -= shift;
          } else {
            for (float& v : buf) {
              v = std::exp(v - mx);
              total += v;
            }
            const float inv = 1.0f / total;
            for (float& v : buf) v *= inv;
          }
          store_f32(buf.data(), len, byte_ptr(y) + (off0[1] + j * in[1]) * static_cast<int64_t>(ys),
                    out, ystep);
        }
      });
  return y;
}

Tensor softmax_backward(const Tensor& grad_out, const Tensor& y, int64_t dim, bool log, DType out,
                        MemoryCategory cat) {
  dim = norm_dim(dim, y.dim(), "softmax_backward");
  Tensor dx = Tensor::empty(y.shape(), out, charged_to(cat));
  Shape outer = y.shape();
  outer[dim] = 1;
  const int64_t len = y.size(dim);
  const size_t gs = dtype_size(grad_out.dtype()), ys = dtype_size(y.dtype()), ds = dtype_size(out);
  for_each_row<3>(
      outer, {grad_out.strides(), y.strides(), dx.strides()},
      [&](const auto& off0, int64_t n, const auto& in) {
        std::vector<float> g(static_cast<size_t>(len)), p(static_cast<size_t>(len));
        for (int64_t j = 0; j < n; ++j) {
          load_f32(byte_ptr(grad_out) + (off0[0] + j * in[0]) * static_cast<int64_t>(gs),
                   grad_out.dtype(), grad_out.stride(dim), len, g.data());
          load_f32(byte_ptr(y) + (off0[1] + j * in[1]) * static_cast<int64_t>(ys), y.dtype(),
                   y.stride(dim), len, p.data());
          if (log) {
            // y = log p: dx = g - p * sum(g)
            float s = 0.0f;
            for (float v : g) s += v;
            for (int64_t i = 0; i < len; ++i) g[i] -= std::exp(p[i]) * s;
          } else {
            // dx = p * (g - sum(g * p))
            float s = 0.0f;
            for (int64_t i = 0; i < len; ++i) s += g[i] * p[i];
            for (int64_t i = 0; i < len; ++i) g[i] = p[i] * (g[i] - s);
          }
          store_f32(g.data(), len, byte_ptr(dx) + (off0[2] + j * in[2]) * static_cast<int64_t>(ds),
                    out, dx.stride(dim));
        }
      });
  return dx;
}

Tensor cast(const Tensor& x, DType out, const CastOptions& opt, MemoryCategory cat) {
  Tensor y = Tensor::empty(x.shape(), out, charged_to(cat));
  y.copy_from(x, opt);
  return y;
}

Tensor cat(const std::vector<Tensor>& xs, int64_t dim, DType out, MemoryCategory cat) {
  MANTISSA_CHECK(!xs.empty(), "cat: no tensors given", "pass at least one tensor");
  const int64_t rank = xs[0].dim();
  dim = norm_dim(dim, rank, "cat");
  Shape shape = xs[0].shape();
  shape[dim] = 0;
  for (const Tensor& t : xs) {
    MANTISSA_CHECK(
        t.dim() == rank,
        "cat: tensors of rank " + std::to_string(t.dim()) + " and " + std::to_string(rank),
        "concatenate tensors of the same rank");
    for (int64_t d = 0; d < rank; ++d)
      MANTISSA_CHECK(d == dim || t.size(d) == xs[0].size(d),
                     "cat: shapes " + shape_str(xs[0].shape()) + " and " + shape_str(t.shape()) +
                         " differ outside dimension " + std::to_string(dim),
                     "all sizes but the concatenated one must match");
    shape[dim] += t.size(dim);
  }
  Tensor y = Tensor::empty(shape, out, charged_to(cat));
  int64_t at = 0;
  for (const Tensor& t : xs) {
    Tensor part = y.narrow(dim, at, t.size(dim));
    part.copy_from(t);
    at += t.size(dim);
  }
  return y;
}

}  // namespace mantissa::kernels

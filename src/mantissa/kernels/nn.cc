#include "mantissa/kernels/nn.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "mantissa/core/error.h"
#include "mantissa/core/parallel.h"
#include "mantissa/core/philox.h"
#include "mantissa/kernels/elementwise.h"
#include "mantissa/kernels/vector_kernels.h"

namespace mantissa::kernels {
namespace {

const char* bytes(const Tensor& t) { return static_cast<const char*>(t.data_ptr()); }

char* bytes(Tensor& t) { return static_cast<char*>(t.data_ptr()); }
int64_t esize(DType t) { return static_cast<int64_t>(dtype_size(t)); }

std::string str(int64_t v) { return std::to_string(v); }

void require_float(const Tensor& t, const char* op, const char* what) {
  MANTISSA_CHECK(t.defined(), std::string(op) + ": " + what + " is undefined", "pass a tensor");
  MANTISSA_CHECK(is_floating(t.dtype()) && t.dtype() != DType::f64,
                 std::string(op) + ": " + what + " must be f32, f16 or bf16 (got " +
                     std::string(dtype_name(t.dtype())) + ")",
                 "convert it with cast() first");
}

void require_rank(const Tensor& t, int64_t rank, const char* op, const char* what) {
  MANTISSA_CHECK(t.dim() == rank,
                 std::string(op) + ": " + what + " must have " + str(rank) +
                     " dimensions, got shape " + shape_str(t.shape()),
                 rank == 4 ? "use the (N, C, H, W) layout" : "reshape the input");
}

// Lane-split dot products (vector_kernels.h) for outputs with at most this many rows and a
// reduction at least this deep.
constexpr int64_t kDotMaxRows = 16;
// linear_weight_grad_parts: batches of up to kPartsMaxRows rows (at 64 the row kernel, reading
// 64 input rows per part from L3, took 5x the GEMM's time: the tutorial CNN's fc1 at batch 64,
// 19.9 ms against 3.8 ms of AdamW plus the GEMM); parts of kPartRows outputs (the row kernel's
// block) by kPartColumns inputs (48 KiB, in L2 with the inputs' columns).
constexpr int64_t kPartsMaxRows = 16, kPartRows = 6, kPartColumns = 2048;
constexpr int64_t kDotMinDepth = 1024;

// A bias (or zeros where there is none) as n FP32 values.
std::vector<float> bias_f32(const Tensor& b, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n), 0.0f);
  if (b.defined()) {
    const Tensor bc = b.contiguous();
    convert(bc.data_ptr(), bc.dtype(), v.data(), DType::f32, v.size());
  }
  return v;
}

Tensor f32_workspace(const Shape& shape) {
  TensorOptions o;
  o.category = MemoryCategory::workspace;
  o.owner = "kernel workspace";
  return Tensor::empty(shape, DType::f32, o);
}

// Integer class targets as int64, validated against C.
std::vector<int64_t> read_targets(const Tensor& target, int64_t n, int64_t classes,
                                  int64_t ignore_index, const char* op) {
  MANTISSA_CHECK(target.dim() == 1 && target.size(0) == n,
                 std::string(op) + ": target shape " + shape_str(target.shape()) +
                     " does not match " + str(n) + " rows",
                 "pass one class index per row");
  MANTISSA_CHECK(!is_floating(target.dtype()),
                 std::string(op) + ": targets must be integers (got " +
                     std::string(dtype_name(target.dtype())) + ")",
                 "convert the labels to i64");
  std::vector<int64_t> t(static_cast<size_t>(n));
  Tensor c = target.contiguous();
  convert(c.data_ptr(), c.dtype(), t.data(), DType::i64, t.size());
  for (int64_t i = 0; i < n; ++i)
    MANTISSA_CHECK(t[i] == ignore_index || (t[i] >= 0 && t[i] < classes),
                   std::string(op) + ": target " + str(t[i]) + " at row " + str(i) +
                       " is outside [0, " + str(classes) + ")",
                   "class indices must be in [0, classes)");
  return t;
}

}  // namespace

// ---- Linear algebra
// ---------------------------------------------------------------------------------

Tensor linear(const Tensor& x_in, const Tensor& w_in, const Tensor& b, DType out, Partials p) {
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
  const int64_t in = w_in.size(1), outf = w_in.size(0);
  if (b.defined())
    MANTISSA_CHECK(b.dim() == 1 && b.size(0) == outf,
                   "linear: bias " + shape_str(b.shape()) + " for " + str(outf) + " outputs",
                   "the bias has one value per output");
  const Tensor x = x_in.contiguous();
  const int64_t rows = x.numel() / std::max<int64_t>(in, 1);
  Shape yshape = x.shape();
  yshape.back() = outf;
  Tensor y = Tensor::empty(yshape, out, charged_to(MemoryCategory::activations));
  // A small batch through a long layer (the tutorial CNN's fc1: 12 x 41772 by 100 x 41772):
  // lane-split dot products read the weight rows in place, once (16-bit weights converted a
  // depth pass at a time; a 16-bit input staged in FP32, a few rows); the GEMM would pack
  // (transpose) the whole weight for a dozen uses of each value.
  if (rows <= kDotMaxRows && in >= kDotMinDepth && p == Partials::kF32 && w_in.stride(1) == 1 &&
      (w_in.dtype() == DType::f32 || w_in.dtype() == DType::f16 || w_in.dtype() == DType::bf16)) {
    Tensor x32 = x.dtype() == DType::f32 ? x : f32_workspace({rows, in});
    if (x.dtype() != DType::f32)
      convert(x.data_ptr(), x.dtype(), x32.data_ptr(), DType::f32, static_cast<size_t>(rows * in));
    Tensor lanes = f32_workspace({rows, outf, detail::kDotLanes});
    std::fill(lanes.data<float>(), lanes.data<float>() + lanes.numel(), 0.0f);
    std::vector<int64_t> w_rows(static_cast<size_t>(outf));
    for (int64_t j = 0; j < outf; ++j) w_rows[static_cast<size_t>(j)] = j * w_in.stride(0);
    detail::dot_lanes_accumulate(rows, outf, in, x32.data<float>(), in, w_in.data_ptr(),
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

void linear_weight_grad_parts(const Tensor& g_in, const Tensor& x_in, DType out,
                              const GradPartConsumer& consume) {
  MANTISSA_CHECK(g_in.dim() == 2 && x_in.dim() == 2 && g_in.size(0) == x_in.size(0) &&
                     linear_weight_grad_parts_fit(g_in.size(0)),
                 "internal: linear_weight_grad_parts takes (rows, out) and (rows, in) matrices of "
                 "at most " +
                     str(kPartsMaxRows) + " rows",
                 "report this as a bug");
  require_float(g_in, "linear backward", "gradient");
  require_float(x_in, "linear backward", "input");
  const int64_t rows = g_in.size(0), outf = g_in.size(1), in = x_in.size(1);
  // FP32 operands (16-bit values convert exactly, as the GEMM's packing converts them):
  // g^T (out, rows), row o holding the factors of output o in row order, and x (rows, in).
  const Tensor g = g_in.to(DType::f32).contiguous(), x = x_in.to(DType::f32).contiguous();
  std::vector<float> gt(static_cast<size_t>(outf * rows));
  const float* gd = g.data<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < outf; ++o) gt[static_cast<size_t>(o * rows + r)] = gd[r * outf + o];
  const float* xd = x.data<float>();
  const int64_t groups = (outf + kPartRows - 1) / kPartRows;
  const size_t out_size = esize(out);
  // Each thread takes whole groups of outputs and walks their rows from the first input to the
  // last: the consumer streams through a few rows of the parameter and its state at a time.
  parallel_for(static_cast<size_t>(groups), 1, default_num_threads(), [&](size_t g0, size_t g1) {
    std::vector<float> part(static_cast<size_t>(kPartRows * kPartColumns));  // (kPartRows, cols)
    std::vector<char> rounded(out == DType::f32 ? 0 : kPartColumns * out_size);
    std::vector<const float*> xr(static_cast<size_t>(rows));
    for (size_t grp = g0; grp < g1; ++grp) {
      const int64_t o0 = static_cast<int64_t>(grp) * kPartRows, no = std::min(kPartRows, outf - o0);
      for (int64_t j0 = 0; j0 < in; j0 += kPartColumns) {
        const int64_t n = std::min(kPartColumns, in - j0);
        for (int64_t r = 0; r < rows; ++r) xr[static_cast<size_t>(r)] = xd + r * in + j0;
        detail::fma_rows_f32(part.data(), kPartColumns, no, nullptr, gt.data() + o0 * rows, rows,
                             xr.data(), rows, n);
        for (int64_t o = 0; o < no; ++o) {
          const float* values = part.data() + o * kPartColumns;
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

Tensor matmul(const Tensor& a_in, const Tensor& b_in, DType out, Partials p, MemoryCategory cat) {
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
  for (int64_t i = 0; i < batches; ++i) {
    const Tensor ai = a.select(0, i);
    const Tensor bi = b_batched ? b.select(0, i) : b;
    gemm(M, N, K, 1.0f, {ai.data_ptr(), ai.dtype(), ai.stride(0), ai.stride(1)},
         {bi.data_ptr(), bi.dtype(), bi.stride(0), bi.stride(1)}, 0.0f,
         {bytes(y) + i * M * N * esize(out), out, N, 1}, go);
  }
  return y;
}

// ---- Convolution
// ------------------------------------------------------------------------------------

Shape conv2d_output_shape(const Shape& x, const Shape& w, const Conv2dParams& p) {
  MANTISSA_CHECK(x.size() == 4, "conv2d: input must be (N, C, H, W), got " + shape_str(x),
                 "use the NCHW layout");
  MANTISSA_CHECK(w.size() == 4, "conv2d: weight must be (O, C/groups, KH, KW), got " + shape_str(w),
                 "use the OIHW layout");
  MANTISSA_CHECK(p.groups >= 1 && x[1] % p.groups == 0 && w[0] % p.groups == 0,
                 "conv2d: " + str(x[1]) + " input and " + str(w[0]) +
                     " output channels do not divide into " + str(p.groups) + " groups",
                 "choose groups dividing both channel counts");
  MANTISSA_CHECK(w[1] * p.groups == x[1],
                 "conv2d: weight " + shape_str(w) + " expects " + str(w[1] * p.groups) +
                     " input channels, the input " + shape_str(x) + " has " + str(x[1]),
                 "the weight's second dimension is in_channels / groups");
  MANTISSA_CHECK(p.stride_h >= 1 && p.stride_w >= 1 && p.dilation_h >= 1 && p.dilation_w >= 1 &&
                     p.pad_h >= 0 && p.pad_w >= 0,
                 "conv2d: strides and dilations must be >= 1 and padding >= 0",
                 "fix the convolution parameters");
  // Spans below zero mean the kernel does not fit; C++ division would truncate them to 0.
  const int64_t span_h = x[2] + 2 * p.pad_h - p.dilation_h * (w[2] - 1) - 1;
  const int64_t span_w = x[3] + 2 * p.pad_w - p.dilation_w * (w[3] - 1) - 1;
  const int64_t ho = span_h < 0 ? 0 : span_h / p.stride_h + 1;
  const int64_t wo = span_w < 0 ? 0 : span_w / p.stride_w + 1;
  MANTISSA_CHECK(ho >= 1 && wo >= 1,
                 "conv2d: a " + str(w[2]) + "x" + str(w[3]) + " kernel does not fit the " +
                     str(x[2]) + "x" + str(x[3]) + " input (with padding " + str(p.pad_h) + "x" +
                     str(p.pad_w) + ")",
                 "use a larger input or more padding");
  return {x[0], w[0], ho, wo};
}

namespace {

// Elements of the im2col buffer per chunk of images (env MANTISSA_CONV_COLUMNS overrides, for
// tuning): small enough that the columns are still in cache when the GEMM packs them.
int64_t column_budget() {
  static const int64_t v = [] {
    if (const char* e = std::getenv("MANTISSA_CONV_COLUMNS"))
      return std::max<int64_t>(std::atoll(e), 1024);
    return int64_t{1} << 20;
  }();
  return v;
}

struct ConvGeometry {
  int64_t N, C, H, W, O, KH, KW, Ho, Wo, G, Cg, Og, CKK, HW;
  Conv2dParams p;
  ConvGeometry(const Shape& x, const Shape& w, const Conv2dParams& prm) : p(prm) {
    const Shape y = conv2d_output_shape(x, w, prm);
    N = x[0], C = x[1], H = x[2], W = x[3], O = w[0], KH = w[2], KW = w[3], Ho = y[2], Wo = y[3];
    G = prm.groups, Cg = C / G, Og = O / G, CKK = Cg * KH * KW, HW = Ho * Wo;
  }
  // Images per chunk: the column buffer (CKK x images*HW) stays within column_budget().
  int64_t chunk() const {
    return std::clamp<int64_t>(column_budget() / std::max<int64_t>(CKK * HW, 1), 1, N);
  }
};

// The output columns [lo, hi) whose input column ow * stride - pad + k lies in [0, W).
std::pair<int64_t, int64_t> valid_columns(int64_t Wo, int64_t W, int64_t stride, int64_t pad,
                                          int64_t k) {
  const int64_t lo = std::min(Wo, pad > k ? (pad - k + stride - 1) / stride : int64_t{0});
  const int64_t last = W - 1 + pad - k;  // ow * stride <= last
  const int64_t hi = last < 0 ? lo : std::clamp<int64_t>(last / stride + 1, lo, Wo);
  return {lo, hi};
}

template <typename Word>
void copy_strided(const char* in_row, int64_t off, int64_t stride, int64_t lo, int64_t hi,
                  char* out) {
  const Word* src = reinterpret_cast<const Word*>(in_row);
  Word* dst = reinterpret_cast<Word*>(out);
  for (int64_t ow = lo; ow < hi; ++ow) dst[ow] = src[ow * stride + off];
}

// cols[(c, ki, kj), (n - n0, oh, ow)] of group g, in x's dtype (zeros where the window is padding).
void im2col(const Tensor& x, const ConvGeometry& g, int64_t grp, int64_t n0, int64_t nb,
            char* cols) {
  const int64_t es = esize(x.dtype());
  const int64_t L = nb * g.HW;
  const char* xb = bytes(x);
  parallel_for(
      static_cast<size_t>(g.CKK), 4, g.CKK * L >= kParallelElements ? default_num_threads() : 1,
      [&](size_t r0, size_t r1) {
        for (size_t r = r0; r < r1; ++r) {
          const int64_t c = static_cast<int64_t>(r) / (g.KH * g.KW),
                        ki = (static_cast<int64_t>(r) / g.KW) % g.KH,
                        kj = static_cast<int64_t>(r) % g.KW;
          char* row = cols + static_cast<int64_t>(r) * L * es;
          for (int64_t nl = 0; nl < nb; ++nl) {
            const char* plane = xb + ((n0 + nl) * g.C + grp * g.Cg + c) * g.H * g.W * es;
            for (int64_t oh = 0; oh < g.Ho; ++oh) {
              char* out = row + (nl * g.HW + oh * g.Wo) * es;
              const int64_t ih = oh * g.p.stride_h - g.p.pad_h + ki * g.p.dilation_h;
              if (ih < 0 || ih >= g.H) {
                std::memset(out, 0, static_cast<size_t>(g.Wo * es));
                continue;
              }
              const char* in_row = plane + ih * g.W * es;
              // Columns ow whose input column iw = ow*s - pad + kj*d lies inside [0, W).
              const int64_t off = kj * g.p.dilation_w - g.p.pad_w;
              const int64_t lo =
                  std::clamp<int64_t>((-off + g.p.stride_w - 1) / g.p.stride_w, 0, g.Wo);
              const int64_t hi =
                  std::clamp<int64_t>((g.W - off + g.p.stride_w - 1) / g.p.stride_w, lo, g.Wo);
              std::memset(out, 0, static_cast<size_t>(lo * es));
              std::memset(out + hi * es, 0, static_cast<size_t>((g.Wo - hi) * es));
              if (g.p.stride_w == 1) {  // a contiguous run
                std::memcpy(out + lo * es, in_row + (lo + off) * es,
                            static_cast<size_t>((hi - lo) * es));
              } else if (es == 4) {
                copy_strided<uint32_t>(in_row, off, g.p.stride_w, lo, hi, out);
              } else if (es == 2) {
                copy_strided<uint16_t>(in_row, off, g.p.stride_w, lo, hi, out);
              } else {
                for (int64_t ow = lo; ow < hi; ++ow)
                  std::memcpy(out + ow * es, in_row + (ow * g.p.stride_w + off) * es,
                              static_cast<size_t>(es));
              }
            }
          }
        }
      });
}

// dx[n0 + nl, grp*Cg + c, ih, iw] += dcols[(c, ki, kj), (nl, oh, ow)] into an FP32 chunk (nb, C, H,
// W).
void col2im(const float* dcols, const ConvGeometry& g, int64_t grp, int64_t nb, float* dx) {
  const int64_t L = nb * g.HW;
  // Parallel over (image, input channel) planes: each task writes its own plane, adding the taps
  // in a fixed order, so the result does not depend on the thread count.
  parallel_for(
      static_cast<size_t>(g.Cg * nb), 1, g.CKK * L >= kParallelElements ? default_num_threads() : 1,
      [&](size_t t0, size_t t1) {
        for (size_t t = t0; t < t1; ++t) {
          const int64_t c = static_cast<int64_t>(t) / nb, nl = static_cast<int64_t>(t) % nb;
          float* plane = dx + (nl * g.C + grp * g.Cg + c) * g.H * g.W;
          for (int64_t ki = 0; ki < g.KH; ++ki)
            for (int64_t kj = 0; kj < g.KW; ++kj) {
              const float* row = dcols + ((c * g.KH + ki) * g.KW + kj) * L + nl * g.HW;
              const int64_t k = kj * g.p.dilation_w, sw = g.p.stride_w;
              const auto [lo, hi] = valid_columns(g.Wo, g.W, sw, g.p.pad_w, k);
              if (lo >= hi) continue;
              for (int64_t oh = 0; oh < g.Ho; ++oh) {
                const int64_t ih = oh * g.p.stride_h - g.p.pad_h + ki * g.p.dilation_h;
                if (ih < 0 || ih >= g.H) continue;
                const float* src = row + oh * g.Wo + lo;
                float* dst = plane + ih * g.W + lo * sw - g.p.pad_w + k;
                if (sw == 1) {
                  detail::axpy_f32(dst, src, 1, 1.0f, hi - lo);  // dst += 1 * src: exact adds
                } else {
                  for (int64_t j = 0; j < hi - lo; ++j) dst[j * sw] += src[j];
                }
              }
            }
        }
      });
}

// dy of group grp for images [n0, n0+nb) as a matrix (Og, nb*HW), in dy's dtype.
void gather_dy(const Tensor& dy, const ConvGeometry& g, int64_t grp, int64_t n0, int64_t nb,
               char* dst) {
  const int64_t es = esize(dy.dtype());
  for (int64_t o = 0; o < g.Og; ++o)
    for (int64_t nl = 0; nl < nb; ++nl)
      std::memcpy(dst + (o * nb * g.HW + nl * g.HW) * es,
                  bytes(dy) + (((n0 + nl) * g.O + grp * g.Og + o) * g.HW) * es,
                  static_cast<size_t>(g.HW * es));
}

Tensor byte_workspace(int64_t elements, DType t) {
  TensorOptions o;
  o.category = MemoryCategory::workspace;
  o.owner = "conv2d columns";
  return Tensor::empty({elements}, t, o);
}

// ---- Implicit-GEMM convolution (stride 1, one group) ----
// A chunk of nb images is copied once into a zero-padded FP32 buffer laid out channel-major
// across the images, (C, nb, Hp, Wp). Output position (img, oh, ow) is then column
// n = img * Hp*Wp + oh * Wp + ow of a "wide" output, and row k = (c, kh, kw) of the column matrix
// is the buffer itself shifted by off(k) = c * nb*Hp*Wp + kh*dil_h * Wp + kw*dil_w: the GEMM
// reads those rows in place (OffsetMatrix) instead of an im2col copy KH*KW times the image. The
// wide columns that are not output positions (ow >= Wo, or the padding rows between images) are
// computed and dropped: Hp*Wp / (Ho*Wo) times the multiply-adds, which use_implicit bounds.
// When the output rows are a multiple of 16 wide, or 8 or 4 wide, the columns are instead the
// output positions themselves ("dense": column n = (img, oh, ow) at img*Hp*Wp + oh*Wp + ow, listed
// to the GEMM as col_offset): a 16-column sliver is then one output row's 16 consecutive positions,
// read in place, or two rows of 8 or four rows of 4, packed in runs. Nothing is computed twice.
// Strided convolutions are always dense (column n at img*Hp*Wp + oh*sh*Wp + ow*sw): their slivers
// are packed column by column (ResNet-18's 3x3 stride-2 layers at batch 64 against im2col:
// forward 61-67 -> 81-91 GFLOP/s, weight gradient 71-90 -> 91-112).
struct ImplicitConv {
  int64_t N, C, H, W, O, KH, KW, pad_h, pad_w, dil_h, dil_w, sh, sw, Ho, Wo, Hp, Wp, plane;
  ImplicitConv(const Shape& x, int64_t o, int64_t kh, int64_t kw, int64_t ph, int64_t pw,
               int64_t dh, int64_t dw, int64_t stride_h = 1, int64_t stride_w = 1)
      : N(x[0]),
        C(x[1]),
        H(x[2]),
        W(x[3]),
        O(o),
        KH(kh),
        KW(kw),
        pad_h(ph),
        pad_w(pw),
        dil_h(dh),
        dil_w(dw),
        sh(stride_h),
        sw(stride_w) {
    Hp = H + 2 * ph, Wp = W + 2 * pw, plane = Hp * Wp;
    // Spans below zero: the kernel does not fit (no output; worthwhile() is false).
    const int64_t span_h = Hp - dh * (kh - 1) - 1, span_w = Wp - dw * (kw - 1) - 1;
    Ho = span_h < 0 ? 0 : span_h / sh + 1, Wo = span_w < 0 ? 0 : span_w / sw + 1;
  }
  // The forward convolution of g (one group).
  explicit ImplicitConv(const ConvGeometry& g)
      : ImplicitConv({g.N, g.C, g.H, g.W}, g.O, g.KH, g.KW, g.p.pad_h, g.p.pad_w, g.p.dilation_h,
                     g.p.dilation_w, g.p.stride_h, g.p.stride_w) {}
  // Images per chunk: the padded input and the wide output (or gradient) within column_budget().
  int64_t chunk() const {
    return std::clamp<int64_t>(column_budget() / std::max<int64_t>((C + O) * plane, 1), 1, N);
  }
  // Output rows whose positions fill the GEMM's 16-column slivers exactly.
  bool dense() const { return sh > 1 || sw > 1 || Wo % 16 == 0 || Wo == 8 || Wo == 4; }
  // Dense, or at most 1.15x the multiply-adds in wide columns (measured on ResNet-18's 3x3 layers
  // at batch 64: 32x32 planes, 1.13x, gain 5-45%; 16x16 planes, 1.27x, lose 15-20% against
  // im2col, which batches images densely).
  // Strided: only when the windows cover the input (a 1x1 stride-2 window would pad and copy
  // four times the pixels it reads; im2col copies only those).
  bool worthwhile() const {
    if (Ho < 1 || Wo < 1) return false;
    if (sh > 1 || sw > 1) return dil_h * (KH - 1) + 1 >= sh && dil_w * (KW - 1) + 1 >= sw;
    return dense() || (Ho * Wo >= 64 && 20 * plane <= 23 * Ho * Wo);
  }
};

// MANTISSA_CONV_IMPLICIT=0 turns the implicit-GEMM paths off (for comparisons and tuning).
bool implicit_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("MANTISSA_CONV_IMPLICIT");
    return !(e && std::string(e) == "0");
  }();
  return on;
}

bool use_implicit(const ConvGeometry& g) {
  return implicit_enabled() && g.G == 1 && ImplicitConv(g).worthwhile();
}

// Column n = (img, oh, ow) of a dense implicit GEMM: where output position n's window starts in
// the padded buffer of a chunk of nb images.
void output_positions(const ImplicitConv& g, int64_t nb, std::vector<int64_t>& position) {
  position.resize(static_cast<size_t>(nb * g.Ho * g.Wo));
  for (int64_t img = 0; img < nb; ++img)
    for (int64_t oh = 0; oh < g.Ho; ++oh)
      for (int64_t ow = 0; ow < g.Wo; ++ow)
        position[static_cast<size_t>((img * g.Ho + oh) * g.Wo + ow)] =
            img * g.plane + oh * g.sh * g.Wp + ow * g.sw;
}

// Images [n0, n0 + nb) of x into the zero-padded FP32 buffer (C, nb, Hp, Wp).
void pad_images(const Tensor& x, const ImplicitConv& g, int64_t n0, int64_t nb, float* xp) {
  const int64_t cstride = nb * g.plane, es = esize(x.dtype());
  parallel_for(
      static_cast<size_t>(g.C * nb), 1,
      g.C * cstride >= kParallelElements ? default_num_threads() : 1, [&](size_t t0, size_t t1) {
        for (size_t t = t0; t < t1; ++t) {
          const int64_t c = static_cast<int64_t>(t) / nb, img = static_cast<int64_t>(t) % nb;
          float* dst = xp + c * cstride + img * g.plane;
          std::fill(dst, dst + g.pad_h * g.Wp, 0.0f);
          std::fill(dst + (g.pad_h + g.H) * g.Wp, dst + g.plane, 0.0f);
          const char* src = bytes(x) + ((n0 + img) * g.C + c) * g.H * g.W * es;
          for (int64_t h = 0; h < g.H; ++h) {
            float* row = dst + (g.pad_h + h) * g.Wp;
            std::fill(row, row + g.pad_w, 0.0f);
            load_f32(src + h * g.W * es, x.dtype(), 1, g.W, row + g.pad_w);
            std::fill(row + g.pad_w + g.W, row + g.Wp, 0.0f);
          }
        }
      });
}

// off(k) for every tap k = (c, kh, kw) of a chunk of nb images.
void tap_offsets(const ImplicitConv& g, int64_t nb, std::vector<int64_t>& offset) {
  offset.resize(static_cast<size_t>(g.C * g.KH * g.KW));
  for (int64_t c = 0; c < g.C; ++c)
    for (int64_t kh = 0; kh < g.KH; ++kh)
      for (int64_t kw = 0; kw < g.KW; ++kw)
        offset[static_cast<size_t>((c * g.KH + kh) * g.KW + kw)] =
            c * nb * g.plane + kh * g.dil_h * g.Wp + kw * g.dil_w;
}

// implicit_conv computes up to this many output channels by register-tiled rows, not the GEMM.
constexpr int64_t kFmaRowsMaxChannels = 12;

// The last wide column that is an output position, plus one. Reading row k up to it stays inside
// the padded buffer (the last tap of the last channel ends at its last element).
int64_t wide_columns(const ImplicitConv& g, int64_t nb) {
  return (nb - 1) * g.plane + (g.Ho - 1) * g.Wp + g.Wo;
}

// y (N, O, Ho, Wo) = x (N, C, H, W) * w + bias, w given as an (O, C*KH*KW) matrix in any float
// dtype; y in `out`, charged to `cat`. Any float dtype for x (converted while padding).
Tensor implicit_conv(const Tensor& x, const ImplicitConv& g, ConstMatrix w,
                     const std::vector<float>& bias, DType out, Partials partials,
                     MemoryCategory cat) {
  Tensor y = Tensor::empty({g.N, g.O, g.Ho, g.Wo}, out, charged_to(cat));
  const int64_t CKK = g.C * g.KH * g.KW;
  const int64_t nb_max = g.chunk();
  Tensor xpad = f32_workspace({g.C * nb_max * g.plane});  // (C, nb, Hp, Wp)
  std::vector<int64_t> offset, position;
  const bool dense = g.dense();
  const int64_t HWo = g.Ho * g.Wo;
  // Few output channels along unit-stride rows (the tutorial CNN's conv2 and its backward-input):
  // the GEMM's 6 x 16 tiles would load each input value for at most two tiles, after packing it;
  // register-tiled rows read the padded buffer in place with the same arithmetic.
  const bool by_rows = g.sw == 1 && partials == Partials::kF32 && g.O <= kFmaRowsMaxChannels;
  // (O, nb * Ho * Wo) dense, (O, nb * Hp * Wp) wide
  Tensor wide = by_rows ? Tensor() : f32_workspace({g.O * nb_max * (dense ? HWo : g.plane)});
  std::vector<float> w32(by_rows ? static_cast<size_t>(g.O * CKK) : 0);  // (O, CKK)
  if (by_rows)
    for (int64_t o = 0; o < g.O; ++o)
      load_f32(static_cast<const char*>(w.data) + o * w.rs * esize(w.dtype), w.dtype, w.cs, CKK,
               w32.data() + o * CKK);
  GemmOptions go;
  go.partials = partials;
  for (int64_t n0 = 0; n0 < g.N; n0 += nb_max) {
    const int64_t nb = std::min(nb_max, g.N - n0), Nw = dense ? nb * HWo : wide_columns(g, nb);
    float* xp = xpad.data<float>();
    pad_images(x, g, n0, nb, xp);
    tap_offsets(g, nb, offset);
    if (by_rows) {
      const bool direct = out == DType::f32;
      parallel_for(
          static_cast<size_t>(nb * g.Ho), 1,
          nb * g.O * HWo * CKK >= kParallelElements ? default_num_threads() : 1,
          [&](size_t r0, size_t r1) {
            std::vector<const float*> xrow(static_cast<size_t>(CKK));
            std::vector<float> acc(direct ? 0 : static_cast<size_t>(g.O * g.Wo));  // (O, Wo)
            for (size_t r = r0; r < r1; ++r) {
              const int64_t img = static_cast<int64_t>(r) / g.Ho,
                            oh = static_cast<int64_t>(r) % g.Ho;
              const float* start = xp + img * g.plane + oh * g.sh * g.Wp;  // the row's windows
              for (int64_t t = 0; t < CKK; ++t)
                xrow[static_cast<size_t>(t)] = start + offset[static_cast<size_t>(t)];
              const int64_t at = (n0 + img) * g.O * HWo + oh * g.Wo;  // channel 0's row in y
              detail::fma_rows_f32(direct ? y.data<float>() + at : acc.data(), direct ? HWo : g.Wo,
                                   g.O, bias.empty() ? nullptr : bias.data(), w32.data(), CKK,
                                   xrow.data(), CKK, g.Wo);
              if (!direct)
                for (int64_t o = 0; o < g.O; ++o)
                  store_f32(acc.data() + o * g.Wo, g.Wo, bytes(y) + (at + o * HWo) * esize(out),
                            out, 1);
            }
          });
      continue;
    }
    OffsetMatrix B;
    B.data = xp;
    B.row_offset = offset.data();
    if (dense) {
      output_positions(g, nb, position);
      B.col_offset = position.data();
    }
    gemm(g.O, Nw, CKK, 1.0f, w, B, 0.0f, {wide.data_ptr(), DType::f32, Nw, 1}, go);
    // Keep the output positions, add the bias, round once into y's dtype.
    const float* a = wide.data<float>();
    // Where output (img, oh, ow) is in a row of the GEMM's result.
    const int64_t img_stride = dense ? HWo : g.plane, row_stride = dense ? g.Wo : g.Wp;
    parallel_for(
        static_cast<size_t>(nb * g.O), 1,
        nb * g.O * HWo >= kParallelElements ? default_num_threads() : 1, [&](size_t r0, size_t r1) {
          std::vector<float> plane(static_cast<size_t>(HWo));
          for (size_t r = r0; r < r1; ++r) {
            const int64_t img = static_cast<int64_t>(r) / g.O, o = static_cast<int64_t>(r) % g.O;
            const float bo = bias.empty() ? 0.0f : bias[static_cast<size_t>(o)];
            const float* src = a + o * Nw + img * img_stride;
            for (int64_t oh = 0; oh < g.Ho; ++oh)
              for (int64_t ow = 0; ow < g.Wo; ++ow)
                plane[static_cast<size_t>(oh * g.Wo + ow)] = src[oh * row_stride + ow] + bo;
            store_f32(plane.data(), HWo, bytes(y) + ((n0 + img) * g.O + o) * HWo * esize(out), out,
                      1);
          }
        });
  }
  return y;
}

// ---- Winograd F(2x2, 3x3) ----
// 3x3 stride-1 pad-1 convolutions (ResNet's), FP32 partials: each 4x4 input tile d gives a 2x2
// output tile Y = A^T [(G g G^T) . (B^T d B)] A (Lavin and Gray, 2015), so the 16 products per
// tile, per channel pair, replace 36 multiply-adds: 2.25x fewer. The elementwise products over
// channels are 16 GEMMs, M[xi] (O, tiles) = U[xi] (O, C) V[xi] (C, tiles). The transforms add a
// few roundings: the result differs from the direct sum by a few FP32 ulps of the inputs'
// magnitudes (tests/kernels bound it against the FP64 reference); it is deterministic and does
// not depend on the thread count.
//   G = [1 0 0; 1/2 1/2 1/2; 1/2 -1/2 1/2; 0 0 1]
//   B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1]
//   A^T = [1 1 1 0; 0 1 -1 -1]

// MANTISSA_CONV_WINOGRAD=0 turns the Winograd path off (for comparisons and tests).
bool winograd_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("MANTISSA_CONV_WINOGRAD");
    return !(e && std::string(e) == "0");
  }();
  return on;
}

// Whether the Winograd path computes a convolution of this geometry: 3x3, stride 1, pad 1,
// dilation 1, FP32 partials (its sums are not the FP16-partials emulation), even height and width
// (whole 2x2 tiles within the padded image) and at least 16 channels each way (below that the
// transforms cost more than the products they save). Callers also ask for one group and FP32
// operands: its FP32 workspace (the transformed filters, 16/9 of the weights) would undo a 16-bit
// model's memory savings, and 16-bit operands keep the implicit GEMM's arithmetic.
bool winograd_fits(const ImplicitConv& g, Partials partials) {
  return winograd_enabled() && partials == Partials::kF32 && g.KH == 3 && g.KW == 3 && g.sh == 1 &&
         g.sw == 1 && g.pad_h == 1 && g.pad_w == 1 && g.dil_h == 1 && g.dil_w == 1 &&
         g.H % 2 == 0 && g.W % 2 == 0 && g.C >= 16 && g.O >= 16;
}

// y (N, O, H, W) = x (N, C, H, W) * w + bias by F(2x2, 3x3); w32 (O, C, 3, 3) in FP32.
Tensor winograd_conv(const Tensor& x, const ImplicitConv& g, const float* w32,
                     const std::vector<float>& bias, DType out_dtype, MemoryCategory cat) {
  Tensor y = Tensor::empty({g.N, g.O, g.H, g.W}, out_dtype, charged_to(cat));
  const int64_t C = g.C, O = g.O, th = g.H / 2, tw = g.W / 2, P = th * tw;
  // U[xi] (16, O, C) = G g G^T, xi = 4 * row + column of the 4x4 tile.
  Tensor u_t = f32_workspace({16, O, C});
  float* U = u_t.data<float>();
  parallel_for(static_cast<size_t>(O), 1, O * C >= 4096 ? default_num_threads() : 1,
               [&](size_t o0, size_t o1) {
                 for (size_t o = o0; o < o1; ++o)
                   for (int64_t c = 0; c < C; ++c) {
                     const float* k = w32 + (static_cast<int64_t>(o) * C + c) * 9;
                     float t[4][3];  // G g
                     for (int j = 0; j < 3; ++j) {
                       t[0][j] = k[j];
                       t[1][j] = 0.5f * (k[j] + k[3 + j] + k[6 + j]);
                       t[2][j] = 0.5f * (k[j] - k[3 + j] + k[6 + j]);
                       t[3][j] = k[6 + j];
                     }
                     for (int i = 0; i < 4; ++i) {
                       const float r[4] = {t[i][0], 0.5f * (t[i][0] + t[i][1] + t[i][2]),
                                           0.5f * (t[i][0] - t[i][1] + t[i][2]), t[i][2]};
                       for (int j = 0; j < 4; ++j)
                         U[((i * 4 + j) * O + static_cast<int64_t>(o)) * C + c] = r[j];
                     }
                   }
               });
  const int64_t nb_max = g.chunk();
  Tensor xpad = f32_workspace({C * nb_max * g.plane});  // (C, nb, H+2, W+2)
  // Tiles per block: V (16, C, Tb) and M (16, O, Tb) within about 4 MiB, so the transforms and
  // the GEMMs pass them through the caches; at least 64, at most a chunk's tiles, a multiple of
  // the GEMM's 16-column slivers.
  const int64_t Tb_max =
      std::min(std::max<int64_t>((int64_t{4} << 20) / (64 * (C + O)) / 16 * 16, 64),
               (nb_max * P + 15) / 16 * 16);
  Tensor v_t = f32_workspace({16, C, Tb_max}), m_t = f32_workspace({16, O, Tb_max});
  float *V = v_t.data<float>(), *M = m_t.data<float>();
  const bool direct = out_dtype == DType::f32;
  GemmOptions go;
  go.threads = 1;  // the 16 GEMMs of a block are the parallel tasks
  for (int64_t n0 = 0; n0 < g.N; n0 += nb_max) {
    const int64_t nb = std::min(nb_max, g.N - n0), T = nb * P;
    float* xp = xpad.data<float>();
    pad_images(x, g, n0, nb, xp);
    for (int64_t t0 = 0; t0 < T; t0 += Tb_max) {
      const int64_t Tb = std::min(Tb_max, T - t0);
      // Where tile t of the chunk starts in a channel's padded planes: image, tile row, column.
      auto tile_at = [&](int64_t t) {
        const int64_t img = t / P, p = t % P;
        return img * g.plane + (p / tw) * 2 * g.Wp + (p % tw) * 2;
      };
      // V[xi][c][t] = (B^T d B)[xi] of tile t's 4x4 input, kWinoTiles tiles at a time.
      parallel_for(
          static_cast<size_t>(C), 1, C * Tb * 16 >= kParallelElements ? default_num_threads() : 1,
          [&](size_t c0, size_t c1) {
            const float* in[detail::kWinoTiles];
            for (size_t c = c0; c < c1; ++c) {
              const float* plane = xp + static_cast<int64_t>(c) * nb * g.plane;
              for (int64_t t = 0; t < Tb; t += detail::kWinoTiles) {
                const int n = static_cast<int>(std::min<int64_t>(detail::kWinoTiles, Tb - t));
                for (int l = 0; l < n; ++l) in[l] = plane + tile_at(t0 + t + l);
                detail::winograd_input_f32(in, n, g.Wp, V + static_cast<int64_t>(c) * Tb + t,
                                           C * Tb);
              }
            }
          });
      // M[xi] (O, Tb) = U[xi] (O, C) V[xi] (C, Tb)
      // V's rows are listed to the GEMM, which then reads its slivers in place when O is small
      // (no copy of V for a single pass over it).
      std::vector<int64_t> v_rows(static_cast<size_t>(C));
      for (int64_t c = 0; c < C; ++c) v_rows[static_cast<size_t>(c)] = c * Tb;
      parallel_tasks(16, default_num_threads(), [&](size_t xi) {
        const int64_t i = static_cast<int64_t>(xi);
        OffsetMatrix Vx;
        Vx.data = V + i * C * Tb;
        Vx.row_offset = v_rows.data();
        gemm(O, Tb, C, 1.0f, {U + i * O * C, DType::f32, C, 1}, Vx, 0.0f,
             {M + i * O * Tb, DType::f32, Tb, 1}, go);
      });
      // Y = A^T M A + bias for each tile, into y (16-bit: staged in FP32, rounded once).
      parallel_for(
          static_cast<size_t>(O), 1, O * Tb * 16 >= kParallelElements ? default_num_threads() : 1,
          [&](size_t o0, size_t o1) {
            float* out[detail::kWinoTiles];
            float stage[detail::kWinoTiles * 4];  // tile l's 2 x 2 at 4 l, rows 2 apart
            for (size_t o = o0; o < o1; ++o) {
              const float bo = bias.empty() ? 0.0f : bias[o];
              for (int64_t t = 0; t < Tb; t += detail::kWinoTiles) {
                const int n = static_cast<int>(std::min<int64_t>(detail::kWinoTiles, Tb - t));
                int64_t at[detail::kWinoTiles];  // where tile l's first output is in y
                for (int l = 0; l < n; ++l) {
                  const int64_t tt = t0 + t + l, img = tt / P, p = tt % P;
                  at[l] = ((n0 + img) * O + static_cast<int64_t>(o)) * g.H * g.W +
                          (p / tw) * 2 * g.W + (p % tw) * 2;
                  out[l] = direct ? y.data<float>() + at[l] : stage + 4 * l;
                }
                detail::winograd_output_f32(M + static_cast<int64_t>(o) * Tb + t, O * Tb, n, bo,
                                            out, direct ? g.W : 2);
                if (!direct)
                  for (int l = 0; l < n; ++l)
                    for (int r = 0; r < 2; ++r)
                      store_f32(stage + 4 * l + 2 * r, 2,
                                bytes(y) + (at[l] + r * g.W) * esize(out_dtype), out_dtype, 1);
              }
            }
          });
    }
  }
  return y;
}

}  // namespace

// ---- Direct convolution for small filter banks ----
// When the whole filter bank is tiny (the tutorial CNN's conv1: 5 x 1 x 3 x 3) im2col and GEMM
// spend their time copying and packing; register-tiled rows of every output channel, reading the
// taps' input rows in place, are several times faster. Used for groups 1, dilation 1 and FP32
// partials; the tests run both paths against the FP64 reference.
// Image groups of a small weight gradient (see conv2d_backward_weight).
constexpr int64_t kWeightGradParts = 4;

bool use_direct_conv(const ConvGeometry& g, Partials partials) {
  return g.G == 1 && g.p.dilation_h == 1 && g.p.dilation_w == 1 && partials == Partials::kF32 &&
         g.CKK <= 32 && g.O * g.CKK <= 512;
}

// Where tap t = (c * KH + kh) * KW + kw reads: output columns [lo, hi) read the input from
// column lo * stride - pad + kw on (stepping by the stride).
struct TapSpan {
  int64_t c, kh, kw, lo, hi;
};
std::vector<TapSpan> tap_spans(const ConvGeometry& g) {
  std::vector<TapSpan> v(static_cast<size_t>(g.CKK));
  for (int64_t t = 0; t < g.CKK; ++t) {
    const int64_t kw = t % g.KW;
    const auto [lo, hi] = valid_columns(g.Wo, g.W, g.p.stride_w, g.p.pad_w, kw);
    v[static_cast<size_t>(t)] = {t / (g.KH * g.KW), (t / g.KW) % g.KH, kw, lo, hi};
  }
  return v;
}

// Calls fn(t, lo, n_cols, x_offset) for every tap t whose input row exists for output row oh:
// output columns [lo, lo + n_cols) read the input from element x_offset of the image. The direct
// kernels walk the output row by row, all taps per row, so a row's sums stay in L1 (a whole
// 126 x 126 plane per tap streamed from L2 cost 2.5x more); each output element still gets its taps
// in increasing t.
template <class Fn>
void for_each_row_tap(const ConvGeometry& g, const std::vector<TapSpan>& taps, int64_t oh,
                      Fn&& fn) {
  for (int64_t t = 0; t < g.CKK; ++t) {
    const TapSpan& s = taps[static_cast<size_t>(t)];
    const int64_t ih = oh * g.p.stride_h - g.p.pad_h + s.kh;
    if (s.lo >= s.hi || ih < 0 || ih >= g.H) continue;
    fn(t, s.lo, s.hi - s.lo, (s.c * g.H + ih) * g.W + s.lo * g.p.stride_w - g.p.pad_w + s.kw);
  }
}

// The output columns that every tap reads (the register-tiled kernels' span on stride-1 rows;
// the columns outside it have some tap in the padding). Empty when strided.
std::pair<int64_t, int64_t> tiled_columns(const ConvGeometry& g, const std::vector<TapSpan>& taps) {
  int64_t j0 = 0, j1 = g.Wo;
  for (const TapSpan& t : taps) {
    j0 = std::max(j0, t.lo);
    j1 = std::min(j1, t.hi);
  }
  if (g.p.stride_w != 1 || j0 >= j1) return {0, 0};
  return {j0, j1};
}

// Calls fn(a, b) for the ranges of output columns [a, b) that a row's tiled span [j0, j1) leaves
// out (the whole row [0, Wo) when the row is not tiled).
template <class Fn>
void untiled_columns(bool tiled, int64_t j0, int64_t j1, int64_t Wo, Fn&& fn) {
  if (!tiled) return fn(int64_t{0}, Wo);
  if (j0 > 0) fn(int64_t{0}, j0);
  if (j1 < Wo) fn(j1, Wo);
}

Tensor conv2d_direct(const Tensor& x_in, const Tensor& w_in, const std::vector<float>& bias,
                     const ConvGeometry& g, DType out) {
  const Tensor x = x_in.to(DType::f32), w = w_in.to(DType::f32);
  const float* xd = x.data<float>();
  const float* wd = w.data<float>();  // (O, CKK)
  Tensor y = Tensor::empty({g.N, g.O, g.Ho, g.Wo}, out, charged_to(MemoryCategory::activations));
  const int64_t sw = g.p.stride_w, plane = g.C * g.H * g.W;
  const std::vector<TapSpan> taps = tap_spans(g);
  const auto [j0, j1] = tiled_columns(g, taps);
  const bool direct = out == DType::f32;  // FP32 rows are summed in place
  // One output row of every channel at a time: the columns every tap reads by the register-tiled
  // kernel, the others (padding) tap by tap. Either way each element is its bias plus its taps'
  // products in increasing t, so the two agree bit for bit.
  parallel_for(
      static_cast<size_t>(g.N * g.Ho), 1,
      g.N * g.O * g.HW * g.CKK >= kParallelElements ? default_num_threads() : 1,
      [&](size_t r0, size_t r1) {
        std::vector<float> acc(direct ? 0 : static_cast<size_t>(g.O * g.Wo));  // (O, Wo)
        std::vector<int64_t> tap(static_cast<size_t>(g.CKK));
        std::vector<const float*> xrow(static_cast<size_t>(g.CKK));
        for (size_t r = r0; r < r1; ++r) {
          const int64_t n = static_cast<int64_t>(r) / g.Ho, oh = static_cast<int64_t>(r) % g.Ho;
          const float* xn = xd + n * plane;
          float* rows = direct ? y.data<float>() + n * g.O * g.HW + oh * g.Wo : acc.data();
          const int64_t ys = direct ? g.HW : g.Wo;  // between channels' rows
          if (j0 < j1) {
            int64_t k = 0;
            for_each_row_tap(g, taps, oh, [&](int64_t t, int64_t lo, int64_t, int64_t xo) {
              tap[static_cast<size_t>(k)] = t;
              xrow[static_cast<size_t>(k++)] = xn + xo + (j0 - lo);
            });
            detail::conv_rows_f32(rows + j0, ys, g.O, bias.data(), wd, g.CKK, tap.data(),
                                  xrow.data(), k, j1 - j0);
          }
          for (int64_t o = 0; o < g.O; ++o) {
            float* row = rows + o * ys;
            const float* wo = wd + o * g.CKK;
            untiled_columns(j0 < j1, j0, j1, g.Wo, [&](int64_t a, int64_t b) {
              std::fill(row + a, row + b, bias[static_cast<size_t>(o)]);
              for_each_row_tap(g, taps, oh, [&](int64_t t, int64_t lo, int64_t cols, int64_t xo) {
                const int64_t s = std::max(a, lo), e = std::min(b, lo + cols);
                if (s < e) detail::axpy_f32(row + s, xn + xo + (s - lo) * sw, sw, wo[t], e - s);
              });
            });
            if (!direct)
              store_f32(row, g.Wo, bytes(y) + ((n * g.O + o) * g.HW + oh * g.Wo) * esize(out), out,
                        1);
          }
        }
      });
  return y;
}

// dW (O, CKK) of a stride-1, one-group convolution (FP32 partials) from the padded image chunks:
// the wide gradient dYw (O, nb*Hp*Wp), zero at the columns that are not output positions, against
// the tap-shifted rows of the padded buffer, by lane-split dot products (vector_kernels.h) that
// read both in place. (A dropped column pairs a zero gradient with a real input value: an inf
// there makes the product NaN where the exact gradient would ignore it; an inf input reaches the
// real gradient through its valid positions anyway, unless every gradient there is zero.)
Tensor implicit_backward_weight(const Tensor& dy, const Tensor& x, const Shape& w_shape,
                                const ConvGeometry& cg, DType out) {
  const ImplicitConv g(cg);
  const int64_t CKK = cg.CKK, HWo = g.Ho * g.Wo;
  const int64_t nb_max = g.chunk();
  Tensor xpad = f32_workspace({g.C * nb_max * g.plane});  // (C, nb, Hp, Wp)
  Tensor dyw = f32_workspace({g.O * nb_max * g.plane});   // (O, nb * Hp * Wp)
  Tensor lanes = f32_workspace({g.O, CKK, detail::kDotLanes});
  std::fill(lanes.data<float>(), lanes.data<float>() + lanes.numel(), 0.0f);
  std::vector<int64_t> offset;
  for (int64_t n0 = 0; n0 < g.N; n0 += nb_max) {
    const int64_t nb = std::min(nb_max, g.N - n0), Nw = wide_columns(g, nb);
    float* xp = xpad.data<float>();
    float* dw = dyw.data<float>();
    pad_images(x, g, n0, nb, xp);
    tap_offsets(g, nb, offset);
    parallel_for(
        static_cast<size_t>(g.O), 1, g.O * Nw >= kParallelElements ? default_num_threads() : 1,
        [&](size_t o0, size_t o1) {
          for (size_t o = o0; o < o1; ++o) {
            float* row = dw + static_cast<int64_t>(o) * Nw;
            std::fill(row, row + Nw, 0.0f);
            for (int64_t img = 0; img < nb; ++img) {
              const char* src = bytes(dy) + (((n0 + img) * g.O + static_cast<int64_t>(o)) * HWo) *
                                                esize(dy.dtype());
              for (int64_t oh = 0; oh < g.Ho; ++oh)
                load_f32(src + oh * g.Wo * esize(dy.dtype()), dy.dtype(), 1, g.Wo,
                         row + img * g.plane + oh * g.Wp);
            }
          }
        });
    detail::dot_lanes_accumulate(g.O, CKK, Nw, dw, Nw, xp, offset.data(), lanes.data<float>(),
                                 default_num_threads());
  }
  std::vector<float> total(static_cast<size_t>(g.O * CKK));
  for (size_t i = 0; i < total.size(); ++i)
    total[i] = detail::dot_lanes_finish(lanes.data<float>() + i * detail::kDotLanes);
  Tensor dwt = Tensor::empty(w_shape, out, charged_to(MemoryCategory::gradients));
  store_f32(total.data(), static_cast<int64_t>(total.size()), dwt.data_ptr(), out, 1);
  return dwt;
}

// dW (O, CKK) of a one-group convolution (any stride use_implicit accepts) by GEMM without
// im2col: for a chunk of nb images, dW += dY (O, L) x X^T (L, CKK), where L = nb*Ho*Wo output
// positions and X^T(l, k) = xpad[position(l) + tap(k)] is listed to the GEMM by rows (positions)
// and columns (taps) and packed from the padded buffer. Chunks add into one FP32 dW in order (beta
// = 1), as the im2col path does; the GEMM splits the taps among threads, so the result does not
// depend on the thread count.
Tensor implicit_gemm_backward_weight(const Tensor& dy, const Tensor& x, const Shape& w_shape,
                                     const ConvGeometry& cg, DType out, Partials partials) {
  const ImplicitConv g(cg);
  const int64_t CKK = cg.CKK, HWo = g.Ho * g.Wo;
  const int64_t nb_max = std::clamp<int64_t>(
      column_budget() / std::max<int64_t>(g.C * g.plane + g.O * HWo, 1), 1, g.N);
  Tensor xpad = f32_workspace({g.C * nb_max * g.plane});        // (C, nb, Hp, Wp)
  Tensor dyg = byte_workspace(g.O * nb_max * HWo, dy.dtype());  // (O, nb * Ho * Wo)
  Tensor dw32 = f32_workspace({g.O * CKK});
  std::vector<int64_t> taps, positions;
  GemmOptions go;
  go.partials = partials;
  for (int64_t n0 = 0; n0 < g.N; n0 += nb_max) {
    const int64_t nb = std::min(nb_max, g.N - n0), L = nb * HWo;
    float* xp = xpad.data<float>();
    pad_images(x, g, n0, nb, xp);
    tap_offsets(g, nb, taps);
    output_positions(g, nb, positions);
    gather_dy(dy, cg, 0, n0, nb, bytes(dyg));
    OffsetMatrix B;
    B.data = xp;
    B.row_offset = positions.data();
    B.col_offset = taps.data();
    gemm(g.O, CKK, L, 1.0f, {dyg.data_ptr(), dy.dtype(), L, 1}, B, n0 == 0 ? 0.0f : 1.0f,
         {dw32.data_ptr(), DType::f32, CKK, 1}, go);
  }
  Tensor dw = Tensor::empty(w_shape, out, charged_to(MemoryCategory::gradients));
  convert(dw32.data_ptr(), DType::f32, dw.data_ptr(), out, static_cast<size_t>(dw.numel()));
  return dw;
}

// dW[o, c, kh, kw] = sum over images and output positions of dy * x: per image, 8 lane sums per
// (o, tap) plus the products the tiled rows leave out, added once; images are summed in order, so
// the result does not depend on the thread count.
Tensor conv2d_direct_backward_weight(const Tensor& dy_in, const Tensor& x_in, const Shape& w_shape,
                                     const ConvGeometry& g, DType out) {
  // 16-bit inputs are read into FP32 one image at a time (no whole-tensor FP32 copies).
  const Tensor x = x_in.contiguous(), dy = dy_in.contiguous();
  const int64_t taps = g.O * g.CKK, sw = g.p.stride_w, plane = g.C * g.H * g.W;
  const std::vector<TapSpan> tap_list = tap_spans(g);
  const auto [j0, j1] = tiled_columns(g, tap_list);
  std::vector<float> per_image(static_cast<size_t>(g.N * taps), 0.0f);  // (N, O, CKK)
  parallel_for(
      static_cast<size_t>(g.N), 1,
      g.N * g.HW * taps >= kParallelElements ? default_num_threads() : 1,
      [&](size_t n0, size_t n1) {
        // Per image: 8 lane sums per (o, tap) for the rows where every tap reads the input, over
        // the columns where it does (conv_wgrad_rows_f32, the sums in registers); the other
        // products, one at a time in row order, into `rest`.
        std::vector<float> lanes(static_cast<size_t>(taps * detail::kDotLanes)), rest(taps);
        std::vector<const float*> xrow(static_cast<size_t>(g.CKK));
        // (C, H, W) and (O, Ho, Wo) of one image, when 16-bit
        std::vector<float> xbuf(x.dtype() == DType::f32 ? 0 : static_cast<size_t>(plane)),
            dybuf(dy.dtype() == DType::f32 ? 0 : static_cast<size_t>(g.O * g.HW));
        for (size_t n = n0; n < n1; ++n) {
          const int64_t ni = static_cast<int64_t>(n);
          const float* xn =
              row_f32(bytes(x) + ni * plane * esize(x.dtype()), x.dtype(), 1, plane, xbuf.data());
          const float* dyn = row_f32(bytes(dy) + ni * g.O * g.HW * esize(dy.dtype()), dy.dtype(), 1,
                                     g.O * g.HW, dybuf.data());
          std::fill(lanes.begin(), lanes.end(), 0.0f);
          std::fill(rest.begin(), rest.end(), 0.0f);
          for (int64_t oh = 0; oh < g.Ho; ++oh) {
            int64_t valid = 0;
            for_each_row_tap(g, tap_list, oh, [&](int64_t t, int64_t lo, int64_t, int64_t xo) {
              xrow[static_cast<size_t>(t)] = xn + xo + (j0 - lo);
              ++valid;
            });
            const bool tiled = j0 < j1 && valid == g.CKK;
            if (tiled)
              detail::conv_wgrad_rows_f32(lanes.data(), g.O, dyn + oh * g.Wo + j0, g.HW,
                                          xrow.data(), g.CKK, j1 - j0);
            for (int64_t o = 0; o < g.O; ++o) {
              const float* d = dyn + o * g.HW + oh * g.Wo;
              untiled_columns(tiled, j0, j1, g.Wo, [&](int64_t a, int64_t b) {
                for_each_row_tap(
                    g, tap_list, oh, [&](int64_t t, int64_t lo, int64_t cols, int64_t xo) {
                      float& r = rest[static_cast<size_t>(o * g.CKK + t)];
                      for (int64_t j = std::max(a, lo); j < std::min(b, lo + cols); ++j)
                        r += d[j] * xn[xo + (j - lo) * sw];
                    });
              });
            }
          }
          float* dw = per_image.data() + ni * taps;
          for (int64_t i = 0; i < taps; ++i)
            dw[i] = detail::dot_lanes_finish(lanes.data() + i * detail::kDotLanes) +
                    rest[static_cast<size_t>(i)];
        }
      });
  std::vector<float> total(static_cast<size_t>(taps), 0.0f);
  for (int64_t n = 0; n < g.N; ++n)
    for (int64_t i = 0; i < taps; ++i)
      total[static_cast<size_t>(i)] += per_image[static_cast<size_t>(n * taps + i)];
  Tensor dw = Tensor::empty(w_shape, out, charged_to(MemoryCategory::gradients));
  store_f32(total.data(), taps, dw.data_ptr(), out, 1);
  return dw;
}

Tensor conv2d(const Tensor& x_in, const Tensor& w_in, const Tensor& b, const Conv2dParams& p,
              DType out, Partials partials) {
  require_float(x_in, "conv2d", "input");
  require_float(w_in, "conv2d", "weight");
  const ConvGeometry g(x_in.shape(), w_in.shape(), p);
  if (b.defined())
    MANTISSA_CHECK(b.dim() == 1 && b.size(0) == g.O,
                   "conv2d: bias " + shape_str(b.shape()) + " for " + str(g.O) + " channels",
                   "the bias has one value per output channel");
  const Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const std::vector<float> bias = bias_f32(b, g.O);
  if (use_direct_conv(g, partials)) return conv2d_direct(x, w, bias, g, out);
  if (g.G == 1 && x.dtype() == DType::f32 && w.dtype() == DType::f32 &&
      winograd_fits(ImplicitConv(g), partials))
    return winograd_conv(x, ImplicitConv(g), w.data<float>(), bias, out,
                         MemoryCategory::activations);
  if (use_implicit(g))
    return implicit_conv(x, ImplicitConv(g), {w.data_ptr(), w.dtype(), g.CKK, 1}, bias, out,
                         partials, MemoryCategory::activations);
  Tensor y = Tensor::empty({g.N, g.O, g.Ho, g.Wo}, out, charged_to(MemoryCategory::activations));
  GemmOptions go;
  go.partials = partials;
  const int64_t chunk = g.chunk();
  Tensor cols = byte_workspace(g.CKK * chunk * g.HW, x.dtype());
  Tensor acc = f32_workspace({g.Og * chunk * g.HW});
  for (int64_t n0 = 0; n0 < g.N; n0 += chunk) {
    const int64_t nb = std::min(chunk, g.N - n0), L = nb * g.HW;
    for (int64_t grp = 0; grp < g.G; ++grp) {
      im2col(x, g, grp, n0, nb, bytes(cols));
      gemm(g.Og, L, g.CKK, 1.0f,
           {bytes(w) + grp * g.Og * g.CKK * esize(w.dtype()), w.dtype(), g.CKK, 1},
           {cols.data_ptr(), cols.dtype(), L, 1}, 0.0f, {acc.data_ptr(), DType::f32, L, 1}, go);
      // Scatter (Og, nb*HW) into NCHW, adding the bias, rounding once into the output dtype.
      const float* a = acc.data<float>();
      parallel_for(
          static_cast<size_t>(g.Og * nb), 1,
          g.Og * L >= kParallelElements ? default_num_threads() : 1, [&](size_t r0, size_t r1) {
            std::vector<float> row(static_cast<size_t>(g.HW));
            for (size_t r = r0; r < r1; ++r) {
              const int64_t o = static_cast<int64_t>(r) / nb, nl = static_cast<int64_t>(r) % nb;
              const float bo = bias[static_cast<size_t>(grp * g.Og + o)];
              const float* src = a + o * L + nl * g.HW;
              for (int64_t i = 0; i < g.HW; ++i) row[i] = src[i] + bo;
              store_f32(row.data(), g.HW,
                        bytes(y) + (((n0 + nl) * g.O + grp * g.Og + o) * g.HW) * esize(out), out,
                        1);
            }
          });
    }
  }
  return y;
}

Tensor conv2d_backward_input(const Tensor& dy_in, const Tensor& w_in, const Shape& x_shape,
                             const Conv2dParams& p, DType out, Partials partials) {
  const ConvGeometry g(x_shape, w_in.shape(), p);
  MANTISSA_CHECK(
      dy_in.shape() == Shape({g.N, g.O, g.Ho, g.Wo}),
      "conv2d backward: gradient " + shape_str(dy_in.shape()) + " does not match the output shape",
      "report this as a bug");
  const Tensor dy = dy_in.contiguous(), w = w_in.contiguous();
  // Stride 1, one group: dx is the forward convolution of dy, padded by dil*(K-1) - pad, with the
  // weights flipped and their channels swapped, wt[c, o, kh, kw] = w[o, c, KH-1-kh, KW-1-kw]:
  // implicit GEMM instead of a GEMM into columns and col2im.
  const int64_t tp_h = g.p.dilation_h * (g.KH - 1) - g.p.pad_h,
                tp_w = g.p.dilation_w * (g.KW - 1) - g.p.pad_w;
  if (implicit_enabled() && g.G == 1 && g.p.stride_h == 1 && g.p.stride_w == 1 && tp_h >= 0 &&
      tp_w >= 0) {
    const ImplicitConv t(dy.shape(), g.C, g.KH, g.KW, tp_h, tp_w, g.p.dilation_h, g.p.dilation_w);
    // Winograd (FP32 operands) or the implicit GEMM, both with the flipped weights.
    const bool winograd = t.Ho == g.H && t.Wo == g.W && dy.dtype() == DType::f32 &&
                          w.dtype() == DType::f32 && winograd_fits(t, partials);
    if (winograd || (t.worthwhile() && t.Ho == g.H && t.Wo == g.W)) {
      // The flipped weights in w's own dtype (the GEMM converts while packing): no FP32 copy of
      // 16-bit weights.
      Tensor wt = byte_workspace(g.C * g.O * g.KH * g.KW, w.dtype());
      const int64_t KK = g.KH * g.KW;
      auto flip = [&](auto word) {
        using Word = decltype(word);
        const Word* wd = reinterpret_cast<const Word*>(bytes(w));
        Word* wtd = reinterpret_cast<Word*>(bytes(wt));
        for (int64_t o = 0; o < g.O; ++o)
          for (int64_t c = 0; c < g.C; ++c)
            for (int64_t k = 0; k < KK; ++k)
              wtd[(c * g.O + o) * KK + (KK - 1 - k)] = wd[(o * g.C + c) * KK + k];
      };
      switch (esize(w.dtype())) {
        case 4:
          flip(uint32_t{});
          break;
        case 2:
          flip(uint16_t{});
          break;
        default:
          MANTISSA_CHECK(esize(w.dtype()) == 1, "conv2d backward: unexpected weight dtype",
                         "report this as a bug");
          flip(uint8_t{});
      }
      if (winograd)
        return winograd_conv(dy, t, wt.data<float>(), {}, out, MemoryCategory::gradients);
      return implicit_conv(dy, t, {wt.data_ptr(), w.dtype(), g.O * KK, 1}, {}, out, partials,
                           MemoryCategory::gradients);
    }
  }
  Tensor dx = Tensor::empty(x_shape, out, charged_to(MemoryCategory::gradients));
  GemmOptions go;
  go.partials = partials;
  const int64_t chunk = g.chunk();
  Tensor dyg = byte_workspace(g.Og * chunk * g.HW, dy.dtype());
  Tensor dcols = f32_workspace({g.CKK * chunk * g.HW});
  Tensor dx32 = f32_workspace({chunk * g.C * g.H * g.W});
  for (int64_t n0 = 0; n0 < g.N; n0 += chunk) {
    const int64_t nb = std::min(chunk, g.N - n0), L = nb * g.HW;
    std::fill(dx32.data<float>(), dx32.data<float>() + nb * g.C * g.H * g.W, 0.0f);
    for (int64_t grp = 0; grp < g.G; ++grp) {
      gather_dy(dy, g, grp, n0, nb, bytes(dyg));
      // dcols (CKK, L) = W_g^T (CKK, Og) x dy_g (Og, L)
      gemm(g.CKK, L, g.Og, 1.0f,
           {bytes(w) + grp * g.Og * g.CKK * esize(w.dtype()), w.dtype(), 1, g.CKK},
           {dyg.data_ptr(), dyg.dtype(), L, 1}, 0.0f, {dcols.data_ptr(), DType::f32, L, 1}, go);
      col2im(dcols.data<float>(), g, grp, nb, dx32.data<float>());
    }
    convert(dx32.data_ptr(), DType::f32, bytes(dx) + n0 * g.C * g.H * g.W * esize(out), out,
            static_cast<size_t>(nb * g.C * g.H * g.W));
  }
  return dx;
}

Tensor conv2d_backward_weight(const Tensor& dy_in, const Tensor& x_in, const Shape& w_shape,
                              const Conv2dParams& p, DType out, Partials partials) {
  const ConvGeometry g(x_in.shape(), w_shape, p);
  const Tensor dy = dy_in.contiguous(), x = x_in.contiguous();
  if (use_direct_conv(g, partials)) return conv2d_direct_backward_weight(dy, x, w_shape, g, out);
  // Few output channels: lane-split dot products over the padded chunks (the tutorial CNN's
  // conv2, 12 x 125: 2.7 -> 1.5 ms). With more, the GEMM's register tiles reuse each loaded
  // value more (ResNet-18's 64 x 576: 96 against 82 GFLOP/s).
  if (use_implicit(g)) {
    if (g.p.stride_h == 1 && g.p.stride_w == 1 && partials == Partials::kF32 && g.O <= kDotMaxRows)
      return implicit_backward_weight(dy, x, w_shape, g, out);
    return implicit_gemm_backward_weight(dy, x, w_shape, g, out, partials);
  }
  // dW_g (Og, CKK) = sum over images of dy_g (Og, L) x cols^T (L, CKK): a GEMM whose output is
  // small and whose depth is the whole batch. When the output is too small to split across
  // threads (the tutorial CNN's conv2: 12 x 125), the images are cut into a fixed number of
  // parts, each with its own FP32 accumulator, summed in order at the end; the parts do not depend
  // on the thread count, so neither do the results.
  const int64_t parts = g.Og * g.CKK < 64 * 64 ? std::min<int64_t>(kWeightGradParts, g.N) : 1;
  const int threads = static_cast<int>(std::min<int64_t>(default_num_threads(), parts));
  std::vector<Tensor> partial(static_cast<size_t>(parts));
  parallel_for(static_cast<size_t>(parts), 1, threads, [&](size_t p0, size_t p1) {
    for (size_t part = p0; part < p1; ++part) {
      const int64_t i0 = g.N * static_cast<int64_t>(part) / parts,
                    i1 = g.N * static_cast<int64_t>(part + 1) / parts;
      GemmOptions go;
      go.partials = partials;
      go.threads = parts > 1 ? 1 : 0;  // the parts are the parallelism
      const int64_t chunk = g.chunk();
      Tensor cols = byte_workspace(g.CKK * chunk * g.HW, x.dtype());
      Tensor dyg = byte_workspace(g.Og * chunk * g.HW, dy.dtype());
      Tensor dw32 = f32_workspace({g.O * g.CKK});
      for (int64_t n0 = i0; n0 < i1; n0 += chunk) {
        const int64_t nb = std::min(chunk, i1 - n0), L = nb * g.HW;
        for (int64_t grp = 0; grp < g.G; ++grp) {
          im2col(x, g, grp, n0, nb, bytes(cols));
          gather_dy(dy, g, grp, n0, nb, bytes(dyg));
          gemm(g.Og, g.CKK, L, 1.0f, {dyg.data_ptr(), dyg.dtype(), L, 1},
               {cols.data_ptr(), cols.dtype(), 1, L}, n0 == i0 ? 0.0f : 1.0f,
               {dw32.data<float>() + grp * g.Og * g.CKK, DType::f32, g.CKK, 1}, go);
        }
      }
      partial[part] = dw32;
    }
  });
  float* total = partial[0].data<float>();
  for (size_t part = 1; part < partial.size(); ++part) {
    const float* add = partial[part].data<float>();
    for (int64_t i = 0; i < g.O * g.CKK; ++i) total[i] += add[i];
  }
  Tensor dw = Tensor::empty(w_shape, out, charged_to(MemoryCategory::gradients));
  convert(total, DType::f32, dw.data_ptr(), out, static_cast<size_t>(dw.numel()));
  return dw;
}

// ---- Pooling
// ---------------------------------------------------------------------------------------------

Shape pool2d_output_shape(const Shape& x, const Pool2dParams& p) {
  MANTISSA_CHECK(x.size() == 4, "pool2d: input must be (N, C, H, W), got " + shape_str(x),
                 "use the NCHW layout");
  MANTISSA_CHECK(p.kernel_h >= 1 && p.kernel_w >= 1 && p.stride_h >= 1 && p.stride_w >= 1,
                 "pool2d: kernel and stride must be >= 1", "fix the pooling parameters");
  MANTISSA_CHECK(
      p.pad_h >= 0 && p.pad_w >= 0 && 2 * p.pad_h <= p.kernel_h && 2 * p.pad_w <= p.kernel_w,
      "pool2d: padding " + str(p.pad_h) + "x" + str(p.pad_w) + " must be at most half the kernel " +
          str(p.kernel_h) + "x" + str(p.kernel_w),
      "use less padding (PyTorch's rule)");
  auto out_size = [&](int64_t in, int64_t k, int64_t s, int64_t pad) {
    const int64_t span = in + 2 * pad - k;
    if (span < 0) return int64_t{0};  // the window does not fit (C++ division would truncate to 0)
    int64_t o = (p.ceil_mode ? (span + s - 1) / s : span / s) + 1;
    if (p.ceil_mode && (o - 1) * s >= in + pad) --o;  // the last window must start inside
    return o;
  };
  const int64_t ho = out_size(x[2], p.kernel_h, p.stride_h, p.pad_h),
                wo = out_size(x[3], p.kernel_w, p.stride_w, p.pad_w);
  MANTISSA_CHECK(ho >= 1 && wo >= 1,
                 "pool2d: a " + str(p.kernel_h) + "x" + str(p.kernel_w) +
                     " window does not fit the " + str(x[2]) + "x" + str(x[3]) + " input",
                 "use a smaller kernel or a larger input");
  return {x[0], x[1], ho, wo};
}

namespace {
// Calls fn(plane_index, in_plane (FP32, H*W)) for each (n, c) plane of a contiguous x, in
// parallel. FP32 planes are read in place, others converted into a buffer.
template <typename Fn>
void for_each_plane(const Tensor& x, int64_t planes, int64_t plane_size, Fn&& fn) {
  parallel_for(static_cast<size_t>(planes), 1,
               planes * plane_size >= kParallelElements ? default_num_threads() : 1,
               [&](size_t p0, size_t p1) {
                 std::vector<float> buf;
                 for (size_t pl = p0; pl < p1; ++pl) {
                   const char* src =
                       bytes(x) + static_cast<int64_t>(pl) * plane_size * esize(x.dtype());
                   if (x.dtype() == DType::f32) {
                     fn(static_cast<int64_t>(pl), reinterpret_cast<const float*>(src));
                     continue;
                   }
                   buf.resize(static_cast<size_t>(plane_size));
                   load_f32(src, x.dtype(), 1, plane_size, buf.data());
                   fn(static_cast<int64_t>(pl), buf.data());
                 }
               });
}

// An FP32 output plane: written in place when the tensor is FP32, else staged and converted by
// flush().
class OutPlane {
 public:
  OutPlane(Tensor& t, int64_t plane, int64_t size) : t_(t), plane_(plane), size_(size) {
    if (t.dtype() == DType::f32) {
      data_ = t.data<float>() + plane * size;
    } else {
      staged_.resize(static_cast<size_t>(size));
      data_ = staged_.data();
    }
  }
  float* data() { return data_; }
  void flush() {
    if (!staged_.empty())
      store_f32(staged_.data(), size_, bytes(t_) + plane_ * size_ * esize(t_.dtype()), t_.dtype(),
                1);
  }

 private:
  Tensor& t_;
  int64_t plane_, size_;
  float* data_;
  std::vector<float> staged_;
};
}  // namespace

std::pair<Tensor, Tensor> max_pool2d(const Tensor& x_in, const Pool2dParams& p, DType out) {
  require_float(x_in, "max_pool2d", "input");
  const Shape ys = pool2d_output_shape(x_in.shape(), p);
  const Tensor x = x_in.contiguous();
  const int64_t H = x.size(2), W = x.size(3), Ho = ys[2], Wo = ys[3];
  Tensor y = Tensor::empty(ys, out, charged_to(MemoryCategory::activations));
  Tensor idx = Tensor::empty(ys, DType::i32, charged_to(MemoryCategory::activations));
  int32_t* ib = idx.data<int32_t>();
  // The common 2x2 window with stride 2 and no padding, every window inside the input (ceil mode
  // on an odd size makes a last window of one row or column: the general loop): the four
  // candidates in window order, NaN propagating from the first one found (as the general loop
  // below does).
  const bool two_by_two = p.kernel_h == 2 && p.kernel_w == 2 && p.stride_h == 2 &&
                          p.stride_w == 2 && p.pad_h == 0 && p.pad_w == 0 && 2 * Ho <= H &&
                          2 * Wo <= W;
  for_each_plane(x, ys[0] * ys[1], H * W, [&](int64_t pl, const float* in) {
    OutPlane plane(y, pl, Ho * Wo);
    float* row = plane.data();
    if (two_by_two) {
      int32_t* ip = ib + pl * Ho * Wo;
      for (int64_t oh = 0; oh < Ho; ++oh)
        detail::max_pool_2x2_row_f32(in + 2 * oh * W, in + (2 * oh + 1) * W, Wo,
                                     static_cast<int32_t>(2 * oh * W), static_cast<int32_t>(W),
                                     row + oh * Wo, ip + oh * Wo);
      plane.flush();
      return;
    }
    for (int64_t oh = 0; oh < Ho; ++oh)
      for (int64_t ow = 0; ow < Wo; ++ow) {
        const int64_t h0 = oh * p.stride_h - p.pad_h, w0 = ow * p.stride_w - p.pad_w;
        float best = -INFINITY;
        int32_t at = -1;
        for (int64_t h = std::max<int64_t>(h0, 0); h < std::min(h0 + p.kernel_h, H); ++h)
          for (int64_t w = std::max<int64_t>(w0, 0); w < std::min(w0 + p.kernel_w, W); ++w) {
            const float v = in[h * W + w];
            if (at < 0 || v > best || std::isnan(v)) {
              best = v;
              at = static_cast<int32_t>(h * W + w);
              if (std::isnan(v)) goto done;  // NaN propagates, as in PyTorch
            }
          }
      done:
        row[oh * Wo + ow] = best;
        ib[pl * Ho * Wo + oh * Wo + ow] = at;
      }
    plane.flush();
  });
  return {y, idx};
}

Tensor max_pool2d_backward(const Tensor& dy_in, const Tensor& indices, const Shape& x_shape,
                           DType out) {
  const Tensor dy = dy_in.contiguous();
  const int64_t planes = x_shape[0] * x_shape[1], HW = x_shape[2] * x_shape[3],
                OHW = dy.size(2) * dy.size(3);
  Tensor dx = Tensor::empty(x_shape, out, charged_to(MemoryCategory::gradients));
  const int32_t* ib = indices.data<int32_t>();
  for_each_plane(dy, planes, OHW, [&](int64_t pl, const float* g) {
    OutPlane plane(dx, pl, HW);
    float* acc = plane.data();
    std::fill(acc, acc + HW, 0.0f);
    for (int64_t i = 0; i < OHW; ++i) acc[ib[pl * OHW + i]] += g[i];
    plane.flush();
  });
  return dx;
}

namespace {
// The window of output (oh, ow) and its divisor, as PyTorch's avg_pool2d defines them.
struct AvgWindow {
  int64_t h0, h1, w0, w1;
  float inv_count;
};
AvgWindow avg_window(const Pool2dParams& p, int64_t H, int64_t W, int64_t oh, int64_t ow) {
  int64_t h0 = oh * p.stride_h - p.pad_h, w0 = ow * p.stride_w - p.pad_w;
  int64_t h1 = std::min(h0 + p.kernel_h, H + p.pad_h), w1 = std::min(w0 + p.kernel_w, W + p.pad_w);
  const int64_t padded = (h1 - h0) * (w1 - w0);
  h0 = std::max<int64_t>(h0, 0), w0 = std::max<int64_t>(w0, 0), h1 = std::min(h1, H),
  w1 = std::min(w1, W);
  const int64_t count = p.count_include_pad ? padded : (h1 - h0) * (w1 - w0);
  return {h0, h1, w0, w1, 1.0f / static_cast<float>(std::max<int64_t>(count, 1))};
}
}  // namespace

Tensor avg_pool2d(const Tensor& x_in, const Pool2dParams& p, DType out) {
  require_float(x_in, "avg_pool2d", "input");
  const Shape ys = pool2d_output_shape(x_in.shape(), p);
  const Tensor x = x_in.contiguous();
  const int64_t H = x.size(2), W = x.size(3), Ho = ys[2], Wo = ys[3];
  Tensor y = Tensor::empty(ys, out, charged_to(MemoryCategory::activations));
  for_each_plane(x, ys[0] * ys[1], H * W, [&](int64_t pl, const float* in) {
    OutPlane plane(y, pl, Ho * Wo);
    float* row = plane.data();
    for (int64_t oh = 0; oh < Ho; ++oh)
      for (int64_t ow = 0; ow < Wo; ++ow) {
        const AvgWindow win = avg_window(p, H, W, oh, ow);
        float s = 0.0f;
        for (int64_t h = win.h0; h < win.h1; ++h)
          for (int64_t w = win.w0; w < win.w1; ++w) s += in[h * W + w];
        row[oh * Wo + ow] = s * win.inv_count;
      }
    plane.flush();
  });
  return y;
}

Tensor avg_pool2d_backward(const Tensor& dy_in, const Shape& x_shape, const Pool2dParams& p,
                           DType out) {
  const Tensor dy = dy_in.contiguous();
  const int64_t H = x_shape[2], W = x_shape[3], Ho = dy.size(2), Wo = dy.size(3);
  Tensor dx = Tensor::empty(x_shape, out, charged_to(MemoryCategory::gradients));
  for_each_plane(dy, x_shape[0] * x_shape[1], Ho * Wo, [&](int64_t pl, const float* g) {
    OutPlane plane(dx, pl, H * W);
    float* acc = plane.data();
    std::fill(acc, acc + H * W, 0.0f);
    for (int64_t oh = 0; oh < Ho; ++oh)
      for (int64_t ow = 0; ow < Wo; ++ow) {
        const AvgWindow win = avg_window(p, H, W, oh, ow);
        const float v = g[oh * Wo + ow] * win.inv_count;
        for (int64_t h = win.h0; h < win.h1; ++h)
          for (int64_t w = win.w0; w < win.w1; ++w) acc[h * W + w] += v;
      }
    plane.flush();
  });
  return dx;
}

namespace {
// Input rows [begin, end) averaged into output row o of n (PyTorch: floor(o*in/n),
// ceil((o+1)*in/n)).
std::pair<int64_t, int64_t> adaptive_range(int64_t o, int64_t in, int64_t n) {
  return {o * in / n, ((o + 1) * in + n - 1) / n};
}
}  // namespace

Tensor adaptive_avg_pool2d(const Tensor& x_in, int64_t out_h, int64_t out_w, DType out) {
  require_float(x_in, "adaptive_avg_pool2d", "input");
  require_rank(x_in, 4, "adaptive_avg_pool2d", "input");
  MANTISSA_CHECK(out_h >= 1 && out_w >= 1, "adaptive_avg_pool2d: output size must be >= 1",
                 "pass a positive size");
  const Tensor x = x_in.contiguous();
  const int64_t H = x.size(2), W = x.size(3);
  Tensor y = Tensor::empty({x.size(0), x.size(1), out_h, out_w}, out,
                           charged_to(MemoryCategory::activations));
  for_each_plane(x, x.size(0) * x.size(1), H * W, [&](int64_t pl, const float* in) {
    OutPlane plane(y, pl, out_h * out_w);
    float* row = plane.data();
    for (int64_t oh = 0; oh < out_h; ++oh)
      for (int64_t ow = 0; ow < out_w; ++ow) {
        const auto [h0, h1] = adaptive_range(oh, H, out_h);
        const auto [w0, w1] = adaptive_range(ow, W, out_w);
        float s = 0.0f;
        for (int64_t h = h0; h < h1; ++h)
          for (int64_t w = w0; w < w1; ++w) s += in[h * W + w];
        row[oh * out_w + ow] = s / static_cast<float>((h1 - h0) * (w1 - w0));
      }
    plane.flush();
  });
  return y;
}

Tensor adaptive_avg_pool2d_backward(const Tensor& dy_in, const Shape& x_shape, DType out) {
  const Tensor dy = dy_in.contiguous();
  const int64_t H = x_shape[2], W = x_shape[3], Ho = dy.size(2), Wo = dy.size(3);
  Tensor dx = Tensor::empty(x_shape, out, charged_to(MemoryCategory::gradients));
  for_each_plane(dy, x_shape[0] * x_shape[1], Ho * Wo, [&](int64_t pl, const float* g) {
    OutPlane plane(dx, pl, H * W);
    float* acc = plane.data();
    std::fill(acc, acc + H * W, 0.0f);
    for (int64_t oh = 0; oh < Ho; ++oh)
      for (int64_t ow = 0; ow < Wo; ++ow) {
        const auto [h0, h1] = adaptive_range(oh, H, Ho);
        const auto [w0, w1] = adaptive_range(ow, W, Wo);
        const float v = g[oh * Wo + ow] / static_cast<float>((h1 - h0) * (w1 - w0));
        for (int64_t h = h0; h < h1; ++h)
          for (int64_t w = w0; w < w1; ++w) acc[h * W + w] += v;
      }
    plane.flush();
  });
  return dx;
}

// ---- Normalization
// ---------------------------------------------------------------------------------

namespace {

// The shared engine of the three norms. x is viewed as (outer, groups, inner): statistics are taken
// per (outer, group) pair for group/layer norm, or per group across outer for batch norm. The
// affine parameters are per "channel" c = element index / channel_inner % channels.
struct NormLayout {
  int64_t outer, groups, inner;     // x = (outer, groups, inner) elements
  int64_t channels, channel_inner;  // affine index of element e: (e / channel_inner) % channels
  bool across_outer;                // batch norm: statistics of group g pool all outer
};

// A contiguous float tensor's values in FP32 a row at a time: the row itself when the tensor is
// FP32, else converted into the caller's buffer (no whole-tensor FP32 copy of a 16-bit tensor).
struct FloatRows {
  const char* base;
  DType dtype;
  const float* row(int64_t offset, int64_t n, float* buf) const {
    if (dtype == DType::f32) return reinterpret_cast<const float*>(base) + offset;
    load_f32(base + offset * esize(dtype), dtype, 1, n, buf);
    return buf;
  }
};

// Sum of n floats, 8 lanes at a time (vectorizable), in FP64 across chunks of 4096.
double sum_f(const float* p, int64_t n) {
  double total = 0;
  for (int64_t c = 0; c < n; c += 4096) {
    const int64_t m = std::min<int64_t>(4096, n - c);
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= m; i += 8)
      for (int j = 0; j < 8; ++j) acc[j] += p[c + i + j];
    for (; i < m; ++i) acc[0] += p[c + i];
    total += ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  }
  return total;
}
// Sum of (p[i] - mu)^2, the same way.
double sum_sq_f(const float* p, int64_t n, float mu) {
  double total = 0;
  for (int64_t c = 0; c < n; c += 4096) {
    const int64_t m = std::min<int64_t>(4096, n - c);
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= m; i += 8)
      for (int j = 0; j < 8; ++j) {
        const float d = p[c + i + j] - mu;
        acc[j] += d * d;
      }
    for (; i < m; ++i) acc[0] += (p[c + i] - mu) * (p[c + i] - mu);
    total += ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  }
  return total;
}

std::vector<float> load_all(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  const Tensor c = t.contiguous();
  if (!v.empty()) convert(c.data_ptr(), c.dtype(), v.data(), DType::f32, v.size());
  return v;
}

Tensor from_vector(const std::vector<float>& v, const Shape& shape, DType t, MemoryCategory cat) {
  Tensor out = Tensor::empty(shape, t, charged_to(cat));
  if (!v.empty()) convert(v.data(), DType::f32, out.data_ptr(), t, v.size());
  return out;
}

// Statistics per stat index s (outer*groups entries, or groups when across_outer), accumulated in
// FP64 (sums over whole batches lose too much in FP32).
void norm_stats(FloatRows x, const NormLayout& L, double eps, std::vector<float>& mean,
                std::vector<float>& rstd, std::vector<double>* var_out) {
  const int64_t stats = L.across_outer ? L.groups : L.outer * L.groups;
  mean.assign(static_cast<size_t>(stats), 0.0f);
  rstd.assign(static_cast<size_t>(stats), 0.0f);
  if (var_out) var_out->assign(static_cast<size_t>(stats), 0.0);
  parallel_for(static_cast<size_t>(stats), 1,
               L.outer * L.groups * L.inner >= kParallelElements ? default_num_threads() : 1,
               [&](size_t s0, size_t s1) {
                 std::vector<float> buf(x.dtype == DType::f32 ? 0 : static_cast<size_t>(L.inner));
                 auto row = [&](int64_t o, int64_t grp) {
                   return x.row((o * L.groups + grp) * L.inner, L.inner, buf.data());
                 };
                 for (size_t s = s0; s < s1; ++s) {
                   const int64_t o_begin = L.across_outer ? 0 : static_cast<int64_t>(s) / L.groups;
                   const int64_t o_end = L.across_outer ? L.outer : o_begin + 1;
                   const int64_t grp = L.across_outer ? static_cast<int64_t>(s)
                                                      : static_cast<int64_t>(s) % L.groups;
                   double sum = 0;
                   for (int64_t o = o_begin; o < o_end; ++o) sum += sum_f(row(o, grp), L.inner);
                   const double count = static_cast<double>((o_end - o_begin) * L.inner);
                   const double mu = sum / count;
                   double sq = 0;  // two passes: the variance of values around their mean
                   for (int64_t o = o_begin; o < o_end; ++o)
                     sq += sum_sq_f(row(o, grp), L.inner, static_cast<float>(mu));
                   const double var = sq / count;
                   mean[s] = static_cast<float>(mu);
                   rstd[s] = static_cast<float>(1.0 / std::sqrt(var + eps));
                   if (var_out) (*var_out)[s] = var;
                 }
               });
}

// Calls fn(row, stat index, [begin, end) within the row, channel) for each run of a row's elements
// that share an affine channel (an element e's channel is (e / channel_inner) % channels).
template <typename Fn>
void for_each_channel_run(const NormLayout& L, int64_t r, Fn&& fn) {
  const int64_t o = r / L.groups, grp = r % L.groups;
  const size_t s = static_cast<size_t>(L.across_outer ? grp : o * L.groups + grp);
  const int64_t base = r * L.inner;
  for (int64_t i = 0; i < L.inner;) {
    const int64_t e = base + i;
    const int64_t end = std::min(L.inner, i + (L.channel_inner - e % L.channel_inner));
    fn(s, i, end, static_cast<size_t>((e / L.channel_inner) % L.channels));
    i = end;
  }
}

int norm_threads(size_t elements) {
  return static_cast<int64_t>(elements) >= kParallelElements ? default_num_threads() : 1;
}

// y = (x - mean) * rstd * w[c] + b[c], computed in FP32 and stored in yt (a row at a time).
void norm_apply(FloatRows x, const NormLayout& L, const std::vector<float>& mean,
                const std::vector<float>& rstd, const std::vector<float>* w,
                const std::vector<float>* b, void* y, DType yt) {
  const int64_t rows = L.outer * L.groups;
  const int64_t ys = static_cast<int64_t>(esize(yt));
  parallel_for(static_cast<size_t>(rows), 1, norm_threads(static_cast<size_t>(rows * L.inner)),
               [&](size_t r0, size_t r1) {
                 std::vector<float> xbuf(x.dtype == DType::f32 ? 0 : static_cast<size_t>(L.inner)),
                     ybuf(yt == DType::f32 ? 0 : static_cast<size_t>(L.inner));
                 for (size_t rr = r0; rr < r1; ++rr) {
                   const int64_t r = static_cast<int64_t>(rr);
                   const float* xs = x.row(r * L.inner, L.inner, xbuf.data());
                   char* dst = static_cast<char*>(y) + r * L.inner * ys;
                   float* row = yt == DType::f32 ? reinterpret_cast<float*>(dst) : ybuf.data();
                   for_each_channel_run(L, r, [&](size_t s, int64_t i0, int64_t i1, size_t c) {
                     const float scale = w ? rstd[s] * (*w)[c] : rstd[s];
                     const float shift = w ? (*b)[c] - mean[s] * scale : -mean[s] * scale;
                     for (int64_t i = i0; i < i1; ++i) row[i] = xs[i] * scale + shift;
                   });
                   if (yt != DType::f32) store_f32(row, L.inner, dst, yt, 1);
                 }
               });
}

// y = norm_apply(...) as a tensor of `out` dtype: written in place when FP32.
Tensor normalized(FloatRows x, const Shape& shape, const NormLayout& L,
                  const std::vector<float>& mean, const std::vector<float>& rstd,
                  const Tensor& weight, const Tensor& bias, DType out) {
  std::vector<float> wv, bv;
  if (weight.defined()) wv = load_all(weight), bv = load_all(bias);
  Tensor y = Tensor::empty(shape, out, charged_to(MemoryCategory::activations));
  norm_apply(x, L, mean, rstd, weight.defined() ? &wv : nullptr, weight.defined() ? &bv : nullptr,
             y.data_ptr(), out);
  return y;
}

// Sums of d[i] and d[i] * xhat[i], xhat = (x[i] - mu) * rs, over n values: 8 float lanes
// (vectorizable) within chunks of 4096, the chunks added in FP64, as sum_f does.
void sums_d_dxhat(const float* d, const float* x, int64_t n, float mu, float rs, double& sd,
                  double& sdx) {
  for (int64_t c = 0; c < n; c += 4096) {
    const int64_t m = std::min<int64_t>(4096, n - c);
    float a[8] = {0, 0, 0, 0, 0, 0, 0, 0}, b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= m; i += 8)
      for (int j = 0; j < 8; ++j) {
        const float xhat = (x[c + i + j] - mu) * rs;
        a[j] += d[c + i + j];
        b[j] += d[c + i + j] * xhat;
      }
    for (; i < m; ++i) {
      a[0] += d[c + i];
      b[0] += d[c + i] * ((x[c + i] - mu) * rs);
    }
    sd += ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    sdx += ((b[0] + b[1]) + (b[2] + b[3])) + ((b[4] + b[5]) + (b[6] + b[7]));
  }
}

// dx (dtype dx_type, x's element count), dw, db of y = xhat * w + b with xhat normalized by
// statistics over each stat group (those statistics depend on x when `through_stats`; batch norm
// in eval mode uses fixed ones). Sums in float lanes and FP64 across chunks; dx elementwise in
// FP32, rounded once into dx_type. 16-bit rows are converted one at a time.
void norm_backward(FloatRows dy, FloatRows x, const NormLayout& L, const std::vector<float>& mean,
                   const std::vector<float>& rstd, const std::vector<float>* w, bool through_stats,
                   void* dx, DType dx_type, std::vector<double>& dw, std::vector<double>& db) {
  const int64_t stats = L.across_outer ? L.groups : L.outer * L.groups;
  const int64_t rows = L.outer * L.groups;
  const size_t elements = static_cast<size_t>(rows * L.inner);
  dw.assign(static_cast<size_t>(L.channels), 0.0);
  db.assign(static_cast<size_t>(L.channels), 0.0);
  // Row buffers for 16-bit tensors (empty for FP32, which is read and written in place).
  auto buffer = [&](DType t) {
    return std::vector<float>(t == DType::f32 ? 0 : static_cast<size_t>(L.inner));
  };
  // Pass 1, per stat group: sums of g = dy*w and g*xhat; per channel: sums of dy and dy*xhat.
  // Tasks own whole stat groups; channel sums are per task, added at the end.
  std::vector<double> sum_g(static_cast<size_t>(stats), 0.0),
      sum_gx(static_cast<size_t>(stats), 0.0);
  std::mutex merge;
  parallel_for(static_cast<size_t>(stats), 1, norm_threads(elements), [&](size_t s0, size_t s1) {
    std::vector<double> tdw(static_cast<size_t>(L.channels), 0.0),
        tdb(static_cast<size_t>(L.channels), 0.0);
    std::vector<float> dybuf = buffer(dy.dtype), xbuf = buffer(x.dtype);
    for (size_t st = s0; st < s1; ++st) {
      // The rows of stat group st: one row, or (batch norm) row o * groups + st for every o.
      const int64_t n_rows = L.across_outer ? L.outer : 1;
      for (int64_t k = 0; k < n_rows; ++k) {
        const int64_t r =
            L.across_outer ? k * L.groups + static_cast<int64_t>(st) : static_cast<int64_t>(st);
        const float* dr = dy.row(r * L.inner, L.inner, dybuf.data());
        const float* xr = x.row(r * L.inner, L.inner, xbuf.data());
        for_each_channel_run(L, r, [&](size_t s, int64_t i0, int64_t i1, size_t c) {
          const double wc = w ? (*w)[c] : 1.0;
          double sd = 0, sdx = 0;
          sums_d_dxhat(dr + i0, xr + i0, i1 - i0, mean[s], rstd[s], sd, sdx);
          sum_g[s] += wc * sd;
          sum_gx[s] += wc * sdx;
          tdw[c] += sdx;
          tdb[c] += sd;
        });
      }
    }
    std::lock_guard<std::mutex> lock(merge);
    for (size_t c = 0; c < tdw.size(); ++c) dw[c] += tdw[c], db[c] += tdb[c];
  });
  // Pass 2: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) per stat group, as
  // dx = dy * (rstd * w) - (rstd * mean(g)) - xhat * (rstd * mean(g * xhat)).
  const double count = static_cast<double>(L.across_outer ? L.outer * L.inner : L.inner);
  const size_t dx_size = esize(dx_type);
  parallel_for(static_cast<size_t>(rows), 1, norm_threads(elements), [&](size_t r0, size_t r1) {
    std::vector<float> dybuf = buffer(dy.dtype), xbuf = buffer(x.dtype), outbuf = buffer(dx_type);
    for (size_t rr = r0; rr < r1; ++rr) {
      const int64_t r = static_cast<int64_t>(rr);
      const float* dr = dy.row(r * L.inner, L.inner, dybuf.data());
      const float* xr = x.row(r * L.inner, L.inner, xbuf.data());
      char* dst = static_cast<char*>(dx) + r * L.inner * static_cast<int64_t>(dx_size);
      float* out = dx_type == DType::f32 ? reinterpret_cast<float*>(dst) : outbuf.data();
      for_each_channel_run(L, r, [&](size_t s, int64_t i0, int64_t i1, size_t c) {
        const double wc = w ? (*w)[c] : 1.0;
        const float mu = mean[s], rs = rstd[s];
        const float scale = static_cast<float>(rs * wc);
        const float shift = through_stats ? static_cast<float>(rs * (sum_g[s] / count)) : 0.0f;
        const float slope = through_stats ? static_cast<float>(rs * (sum_gx[s] / count)) : 0.0f;
        for (int64_t i = i0; i < i1; ++i)
          out[i] = dr[i] * scale - shift - ((xr[i] - mu) * rs) * slope;
      });
      if (dx_type != DType::f32) store_f32(out, L.inner, dst, dx_type, 1);
    }
  });
}

// The backward of a norm on tensors: differentiate (dx written in its own dtype, rows of 16-bit
// tensors converted one at a time), package dx, dw, db.
std::tuple<Tensor, Tensor, Tensor> norm_backward_tensors(const Tensor& dy_in, const Tensor& x_in,
                                                         const NormLayout& L, const Tensor& weight,
                                                         const Tensor& mean, const Tensor& rstd,
                                                         bool through_stats, DType dx_type) {
  std::vector<float> wv;
  if (weight.defined()) wv = load_all(weight);
  std::vector<double> dw, db;
  const Tensor dy = dy_in.contiguous(), x = x_in.contiguous();
  Tensor tdx = Tensor::empty(x.shape(), dx_type, charged_to(MemoryCategory::gradients));
  norm_backward({static_cast<const char*>(dy.data_ptr()), dy.dtype()},
                {static_cast<const char*>(x.data_ptr()), x.dtype()}, L, load_all(mean),
                load_all(rstd), weight.defined() ? &wv : nullptr, through_stats, tdx.data_ptr(),
                dx_type, dw, db);
  if (!weight.defined()) return {tdx, Tensor(), Tensor()};
  std::vector<float> fw(dw.begin(), dw.end()), fb(db.begin(), db.end());
  return {tdx, from_vector(fw, weight.shape(), weight.dtype(), MemoryCategory::gradients),
          from_vector(fb, weight.shape(), weight.dtype(), MemoryCategory::gradients)};
}

void check_affine(const Tensor& w, const Tensor& b, int64_t channels, const char* op) {
  MANTISSA_CHECK(w.defined() == b.defined(),
                 std::string(op) + ": give both weight and bias, or neither",
                 "pass both affine parameters");
  if (w.defined())
    MANTISSA_CHECK(w.numel() == channels && b.numel() == channels,
                   std::string(op) + ": weight " + shape_str(w.shape()) + " and bias " +
                       shape_str(b.shape()) + " for " + str(channels) + " channels",
                   "the affine parameters have one value per normalized channel");
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> batch_norm(const Tensor& x, const Tensor& weight,
                                              const Tensor& bias, Tensor running_mean,
                                              Tensor running_var, bool training, double momentum,
                                              double eps, DType out) {
  require_float(x, "batch_norm", "input");
  MANTISSA_CHECK(x.dim() >= 2, "batch_norm: input must be (N, C, ...), got " + shape_str(x.shape()),
                 "add a batch dimension");
  const int64_t C = x.size(1);
  check_affine(weight, bias, C, "batch_norm");
  const int64_t inner = x.numel() / std::max<int64_t>(x.size(0) * C, 1);
  const NormLayout L{x.size(0), C, inner, C, inner, true};
  const Tensor xc = x.contiguous();  // read a row at a time, converted when 16-bit
  const FloatRows xv{static_cast<const char*>(xc.data_ptr()), xc.dtype()};
  std::vector<float> mean, rstd;
  if (training) {
    MANTISSA_CHECK(x.size(0) * inner > 1,
                   "batch_norm: training needs more than one value per channel, got input " +
                       shape_str(x.shape()),
                   "use a batch larger than 1, or evaluation mode");
    std::vector<double> var;
    norm_stats(xv, L, eps, mean, rstd, &var);
    if (running_mean.defined()) {
      MANTISSA_CHECK(running_mean.dtype() == DType::f32 && running_var.dtype() == DType::f32 &&
                         running_mean.numel() == C && running_var.numel() == C,
                     "batch_norm: running statistics must be f32 with one value per channel",
                     "keep running statistics in f32");
      float* rm = running_mean.data<float>();
      float* rv = running_var.data<float>();
      const double n = static_cast<double>(x.size(0) * inner);
      for (int64_t c = 0; c < C; ++c) {
        rm[c] = static_cast<float>((1.0 - momentum) * rm[c] + momentum * mean[c]);
        rv[c] = static_cast<float>((1.0 - momentum) * rv[c] + momentum * var[c] * n / (n - 1.0));
      }
    }
  } else {
    MANTISSA_CHECK(running_mean.defined() && running_var.defined(),
                   "batch_norm: evaluation mode needs running statistics",
                   "pass running_mean and running_var");
    mean = load_all(running_mean);
    const std::vector<float> rv = load_all(running_var);
    rstd.resize(rv.size());
    for (size_t c = 0; c < rv.size(); ++c)
      rstd[c] = static_cast<float>(1.0 / std::sqrt(static_cast<double>(rv[c]) + eps));
  }
  return {normalized(xv, x.shape(), L, mean, rstd, weight, bias, out),
          from_vector(mean, {C}, DType::f32, MemoryCategory::activations),
          from_vector(rstd, {C}, DType::f32, MemoryCategory::activations)};
}

std::tuple<Tensor, Tensor, Tensor> batch_norm_backward(const Tensor& dy, const Tensor& x,
                                                       const Tensor& weight, const Tensor& mean,
                                                       const Tensor& rstd, bool training,
                                                       DType dx_type) {
  const int64_t C = x.size(1), inner = x.numel() / std::max<int64_t>(x.size(0) * C, 1);
  const NormLayout L{x.size(0), C, inner, C, inner, true};
  return norm_backward_tensors(dy, x, L, weight, mean, rstd, training, dx_type);
}

std::tuple<Tensor, Tensor, Tensor> group_norm(const Tensor& x, int64_t groups, const Tensor& weight,
                                              const Tensor& bias, double eps, DType out) {
  require_float(x, "group_norm", "input");
  MANTISSA_CHECK(x.dim() >= 2, "group_norm: input must be (N, C, ...), got " + shape_str(x.shape()),
                 "add a batch dimension");
  const int64_t N = x.size(0), C = x.size(1);
  MANTISSA_CHECK(
      groups >= 1 && C % groups == 0,
      "group_norm: " + str(C) + " channels do not divide into " + str(groups) + " groups",
      "choose a number of groups that divides the channels");
  check_affine(weight, bias, C, "group_norm");
  const int64_t spatial = x.numel() / std::max<int64_t>(N * C, 1);
  const NormLayout L{N, groups, (C / groups) * spatial, C, spatial, false};
  const Tensor xc = x.contiguous();  // read a row at a time, converted when 16-bit
  const FloatRows xv{static_cast<const char*>(xc.data_ptr()), xc.dtype()};
  std::vector<float> mean, rstd;
  norm_stats(xv, L, eps, mean, rstd, nullptr);
  return {normalized(xv, x.shape(), L, mean, rstd, weight, bias, out),
          from_vector(mean, {N, groups}, DType::f32, MemoryCategory::activations),
          from_vector(rstd, {N, groups}, DType::f32, MemoryCategory::activations)};
}

std::tuple<Tensor, Tensor, Tensor> group_norm_backward(const Tensor& dy, const Tensor& x,
                                                       int64_t groups, const Tensor& weight,
                                                       const Tensor& mean, const Tensor& rstd,
                                                       DType dx_type) {
  const int64_t N = x.size(0), C = x.size(1), spatial = x.numel() / std::max<int64_t>(N * C, 1);
  const NormLayout L{N, groups, (C / groups) * spatial, C, spatial, false};
  return norm_backward_tensors(dy, x, L, weight, mean, rstd, true, dx_type);
}

std::tuple<Tensor, Tensor, Tensor> layer_norm(const Tensor& x, int64_t normalized_dims,
                                              const Tensor& weight, const Tensor& bias, double eps,
                                              DType out) {
  require_float(x, "layer_norm", "input");
  MANTISSA_CHECK(normalized_dims >= 1 && normalized_dims <= x.dim(),
                 "layer_norm: cannot normalize the last " + str(normalized_dims) +
                     " dimensions of " + shape_str(x.shape()),
                 "normalize between 1 and rank dimensions");
  int64_t D = 1;
  for (int64_t d = x.dim() - normalized_dims; d < x.dim(); ++d) D *= x.size(d);
  check_affine(weight, bias, D, "layer_norm");
  const int64_t rows = x.numel() / std::max<int64_t>(D, 1);
  const NormLayout L{rows, 1, D, D, 1, false};
  const Tensor xc = x.contiguous();  // read a row at a time, converted when 16-bit
  const FloatRows xv{static_cast<const char*>(xc.data_ptr()), xc.dtype()};
  std::vector<float> mean, rstd;
  norm_stats(xv, L, eps, mean, rstd, nullptr);
  return {normalized(xv, x.shape(), L, mean, rstd, weight, bias, out),
          from_vector(mean, {rows}, DType::f32, MemoryCategory::activations),
          from_vector(rstd, {rows}, DType::f32, MemoryCategory::activations)};
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_backward(const Tensor& dy, const Tensor& x,
                                                       int64_t normalized_dims,
                                                       const Tensor& weight, const Tensor& mean,
                                                       const Tensor& rstd, DType dx_type) {
  int64_t D = 1;
  for (int64_t d = x.dim() - normalized_dims; d < x.dim(); ++d) D *= x.size(d);
  const NormLayout L{x.numel() / std::max<int64_t>(D, 1), 1, D, D, 1, false};
  return norm_backward_tensors(dy, x, L, weight, mean, rstd, true, dx_type);
}

// ---- Losses
// -------------------------------------------------------------------------------------------------

namespace {
void check_logits(const Tensor& t, const char* op) {
  require_float(t, op, "input");
  MANTISSA_CHECK(t.dim() == 2,
                 std::string(op) + ": input must be (N, C), got " + shape_str(t.shape()),
                 "flatten the input to (batch, classes)");
}
Tensor scalar_f32(float v, MemoryCategory cat) {
  Tensor t = Tensor::empty({}, DType::f32, charged_to(cat));
  *t.data<float>() = v;
  return t;
}
}  // namespace

Tensor nll_loss(const Tensor& log_probs, const Tensor& target, int64_t ignore_index) {
  check_logits(log_probs, "nll_loss");
  const int64_t N = log_probs.size(0), C = log_probs.size(1);
  const std::vector<int64_t> t = read_targets(target, N, C, ignore_index, "nll_loss");
  const std::vector<float> lp = load_all(log_probs);
  double total = 0;
  int64_t count = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (t[i] == ignore_index) continue;
    total -= lp[static_cast<size_t>(i * C + t[i])];
    ++count;
  }
  return scalar_f32(count ? static_cast<float>(total / count) : NAN, MemoryCategory::activations);
}

Tensor nll_loss_backward(const Tensor& grad_loss, const Tensor& log_probs, const Tensor& target,
                         int64_t ignore_index, DType out) {
  const int64_t N = log_probs.size(0), C = log_probs.size(1);
  const std::vector<int64_t> t = read_targets(target, N, C, ignore_index, "nll_loss");
  int64_t count = 0;
  for (int64_t v : t) count += v != ignore_index;
  const float g =
      static_cast<float>(grad_loss.item()) / static_cast<float>(std::max<int64_t>(count, 1));
  std::vector<float> d(static_cast<size_t>(N * C), 0.0f);
  for (int64_t i = 0; i < N; ++i)
    if (t[i] != ignore_index) d[static_cast<size_t>(i * C + t[i])] = -g;
  return from_vector(d, log_probs.shape(), out, MemoryCategory::gradients);
}

Tensor cross_entropy(const Tensor& logits, const Tensor& target, double label_smoothing,
                     int64_t ignore_index) {
  check_logits(logits, "cross_entropy");
  MANTISSA_CHECK(
      label_smoothing >= 0.0 && label_smoothing <= 1.0,
      "cross_entropy: label smoothing " + std::to_string(label_smoothing) + " is outside [0, 1]",
      "use a value in [0, 1]");
  const int64_t N = logits.size(0), C = logits.size(1);
  const std::vector<int64_t> t = read_targets(target, N, C, ignore_index, "cross_entropy");
  const Tensor lp_t = softmax(logits, 1, true, DType::f32, MemoryCategory::workspace);
  const float* lp = lp_t.data<float>();
  double total = 0;
  int64_t count = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (t[i] == ignore_index) continue;
    double all = 0;
    for (int64_t c = 0; c < C; ++c) all += lp[i * C + c];
    total += -(1.0 - label_smoothing) * lp[i * C + t[i]] -
             label_smoothing / static_cast<double>(C) * all;
    ++count;
  }
  return scalar_f32(count ? static_cast<float>(total / count) : NAN, MemoryCategory::activations);
}

Tensor cross_entropy_backward(const Tensor& grad_loss, const Tensor& logits, const Tensor& target,
                              double label_smoothing, int64_t ignore_index, DType out) {
  const int64_t N = logits.size(0), C = logits.size(1);
  const std::vector<int64_t> t = read_targets(target, N, C, ignore_index, "cross_entropy");
  int64_t count = 0;
  for (int64_t v : t) count += v != ignore_index;
  const float g =
      static_cast<float>(grad_loss.item()) / static_cast<float>(std::max<int64_t>(count, 1));
  const Tensor p_t = softmax(logits, 1, false, DType::f32, MemoryCategory::workspace);
  const float* p = p_t.data<float>();
  std::vector<float> d(static_cast<size_t>(N * C), 0.0f);
  const float smooth = static_cast<float>(label_smoothing / static_cast<double>(C));
  for (int64_t i = 0; i < N; ++i) {
    if (t[i] == ignore_index) continue;
    for (int64_t c = 0; c < C; ++c) {
      const float q = (c == t[i] ? static_cast<float>(1.0 - label_smoothing) : 0.0f) + smooth;
      d[static_cast<size_t>(i * C + c)] = g * (p[i * C + c] - q);
    }
  }
  return from_vector(d, logits.shape(), out, MemoryCategory::gradients);
}

// ---- Dropout
// ---------------------------------------------------------------------------------------------

Tensor dropout(const Tensor& x_in, double p, uint64_t seed, uint64_t stream, DType out,
               MemoryCategory cat) {
  require_float(x_in, "dropout", "input");
  MANTISSA_CHECK(p >= 0.0 && p < 1.0,
                 "dropout: probability " + std::to_string(p) + " is outside [0, 1)",
                 "use a probability in [0, 1)");
  const Tensor x = x_in.contiguous();
  Tensor y = Tensor::empty(x.shape(), out, charged_to(cat));
  const int64_t n = x.numel();
  // Drop when the 32 random bits fall below p * 2^32.
  const uint64_t threshold = static_cast<uint64_t>(std::ldexp(p, 32));
  const float scale = static_cast<float>(1.0 / (1.0 - p));
  parallel_for(static_cast<size_t>(n), 4096, n >= kParallelElements ? default_num_threads() : 1,
               [&](size_t b, size_t e) {
                 float buf[1024];
                 for (size_t c = b; c < e; c += 1024) {
                   const int64_t m = static_cast<int64_t>(std::min<size_t>(1024, e - c));
                   load_f32(bytes(x) + static_cast<int64_t>(c) * esize(x.dtype()), x.dtype(), 1, m,
                            buf);
                   for (int64_t i = 0; i < m; ++i)
                     buf[i] = philox_bits(seed, stream, c + static_cast<uint64_t>(i)) < threshold
                                  ? 0.0f
                                  : buf[i] * scale;
                   store_f32(buf, m, bytes(y) + static_cast<int64_t>(c) * esize(out), out, 1);
                 }
               });
  return y;
}

}  // namespace mantissa::kernels

// The convolution entry points (conv.h): shape checks, the path choosers (the table in
// conv_paths.h) and the hand-over to the path's file.
#include "mantissa/kernels/conv.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "mantissa/kernels/conv_paths.h"
#include "mantissa/kernels/elementwise.h"
#include "mantissa/kernels/nn_internal.h"

namespace mantissa::kernels {

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

namespace detail {

std::string_view conv_path_name(ConvPath p) {
  switch (p) {
#define MANTISSA_CONV_PATH_NAME(e, name, what) \
  case ConvPath::e:                            \
    return name;
    MANTISSA_CONV_PATHS(MANTISSA_CONV_PATH_NAME)
#undef MANTISSA_CONV_PATH_NAME
  }
  return "?";
}

const ConvSettings& conv_settings() {
  static const ConvSettings s = [] {
    ConvSettings v;
    auto off = [](const char* name) {
      const char* e = std::getenv(name);
      return e && std::string(e) == "0";
    };
    v.winograd = !off("MANTISSA_CONV_WINOGRAD");
    v.implicit = !off("MANTISSA_CONV_IMPLICIT");
    if (const char* e = std::getenv("MANTISSA_CONV_COLUMNS"))
      v.column_budget = std::max<int64_t>(std::atoll(e), 1024);
    return v;
  }();
  return s;
}

ConvGeometry::ConvGeometry(const Shape& x, const Shape& w, const Conv2dParams& prm) : p(prm) {
  const Shape y = conv2d_output_shape(x, w, prm);
  N = x[0], C = x[1], H = x[2], W = x[3], O = w[0], KH = w[2], KW = w[3], Ho = y[2], Wo = y[3];
  G = prm.groups, Cg = C / G, Og = O / G, CKK = Cg * KH * KW, HW = Ho * Wo;
}

ImplicitConv flipped_conv(const ConvGeometry& g) {
  return ImplicitConv({g.N, g.O, g.Ho, g.Wo}, g.C, g.KH, g.KW,
                      g.p.dilation_h * (g.KH - 1) - g.p.pad_h,
                      g.p.dilation_w * (g.KW - 1) - g.p.pad_w, g.p.dilation_h, g.p.dilation_w);
}

Tensor byte_workspace(int64_t elements, DType t) {
  TensorOptions o;
  o.category = MemoryCategory::workspace;
  o.owner = "conv2d columns";
  return Tensor::empty({elements}, t, o);
}

namespace {

// implicit_forward computes up to this many output channels by register-tiled rows, not the GEMM:
// the GEMM's 6 x 16 tiles would load each input value for at most two tiles, after packing it.
constexpr int64_t kFmaRowsMaxChannels = 12;

// The direct path: the whole filter bank is tiny (the tutorial CNN's conv1: 5 x 1 x 3 x 3), so
// im2col and the GEMM would spend their time copying and packing.
bool direct_fits(const ConvGeometry& g, Partials partials) {
  return g.G == 1 && g.p.dilation_h == 1 && g.p.dilation_w == 1 && partials == Partials::kF32 &&
         g.CKK <= 32 && g.O * g.CKK <= 512;
}

// Whether Winograd computes a convolution of this geometry: 3x3, stride 1, pad 1, dilation 1,
// FP32 partials (its sums are not the FP16-partials emulation), even height and width (whole 2x2
// tiles within the padded image) and at least 16 channels each way (below that the transforms
// cost more than the products they save). The callers also ask for one group. Operands in any
// float storage: 16-bit values widen exactly while the input is padded and the filters are
// transformed, and the transformed filters are made a block of output channels at a time, within
// the column budget, so that their FP32 workspace does not undo a 16-bit model's memory savings.
bool winograd_fits(const ImplicitConv& g, Partials partials, const ConvSettings& s) {
  return s.winograd && partials == Partials::kF32 && g.KH == 3 && g.KW == 3 && g.sh == 1 &&
         g.sw == 1 && g.pad_h == 1 && g.pad_w == 1 && g.dil_h == 1 && g.dil_w == 1 &&
         g.H % 2 == 0 && g.W % 2 == 0 && g.C >= 16 && g.O >= 16;
}

bool implicit_fits(const ConvGeometry& g, const ConvSettings& s) {
  return s.implicit && g.G == 1 && ImplicitConv(g).worthwhile();
}

}  // namespace

ConvPath conv_forward_path(const ConvGeometry& g, Partials partials, const ConvSettings& s) {
  if (direct_fits(g, partials)) return ConvPath::kDirect;
  if (g.G == 1 && winograd_fits(ImplicitConv(g), partials, s)) return ConvPath::kWinograd;
  if (implicit_fits(g, s))
    return g.p.stride_w == 1 && partials == Partials::kF32 && g.O <= kFmaRowsMaxChannels
               ? ConvPath::kImplicitRows
               : ConvPath::kImplicitGemm;
  return ConvPath::kIm2col;
}

ConvPath conv_backward_input_path(const ConvGeometry& g, Partials partials, const ConvSettings& s) {
  const ImplicitConv t = flipped_conv(g);
  if (s.implicit && g.G == 1 && g.p.stride_h == 1 && g.p.stride_w == 1 && t.pad_h >= 0 &&
      t.pad_w >= 0 && t.Ho == g.H && t.Wo == g.W) {
    if (winograd_fits(t, partials, s)) return ConvPath::kWinograd;
    if (t.worthwhile())
      return partials == Partials::kF32 && t.O <= kFmaRowsMaxChannels ? ConvPath::kImplicitRows
                                                                      : ConvPath::kImplicitGemm;
  }
  return ConvPath::kIm2col;
}

ConvPath conv_weight_grad_path(const ConvGeometry& g, Partials partials, const ConvSettings& s) {
  if (direct_fits(g, partials)) return ConvPath::kDirect;
  if (g.G == 1 && winograd_fits(ImplicitConv(g), partials, s)) return ConvPath::kWinograd;
  // Few output channels: lane-split dot products over the padded chunks. With more, the GEMM's
  // register tiles reuse each loaded value more (docs/numerics.md).
  if (implicit_fits(g, s))
    return g.p.stride_h == 1 && g.p.stride_w == 1 && partials == Partials::kF32 &&
                   g.O <= kDotMaxRows
               ? ConvPath::kImplicitDots
               : ConvPath::kImplicitGemm;
  return ConvPath::kIm2col;
}

}  // namespace detail

using detail::ConvGeometry;
using detail::ConvPath;

namespace {

// The input as `path` reads it: x itself, with g.read_as set where x is FP32 and read_x rounds it
// (every path but im2col stages its input in FP32 and rounds as it does); im2col, whose columns
// keep the input's dtype, gets a 16-bit copy for the call.
Tensor read_input(const Tensor& x, DType read_x, ConvPath path, ConvGeometry& g) {
  MANTISSA_CHECK(read_x == DType::f32 || (x.dtype() == DType::f32 && is_16bit_float(read_x)),
                 "conv2d: read_x " + std::string(dtype_name(read_x)) + " for an " +
                     std::string(dtype_name(x.dtype())) + " input",
                 "read_x reads an f32 input as f16 or bf16");
  g.read_as = DType::f32;
  if (read_x == DType::f32) return x;
  if (path != ConvPath::kIm2col) {
    g.read_as = read_x;
    return x;
  }
  return cast(x, read_x, {}, MemoryCategory::workspace);
}

// The weights as `path` reads them: w itself where it is stored as read_w, or where Winograd
// rounds an FP32 w to read_w as it transforms the filters (*round = read_w then); a 16-bit copy
// for the call on the other paths.
Tensor read_weight(const Tensor& w, DType read_w, ConvPath path, DType* round) {
  MANTISSA_CHECK(read_w == DType::f32 || (w.dtype() == DType::f32 && is_16bit_float(read_w)),
                 "conv2d: read_w " + std::string(dtype_name(read_w)) + " for an " +
                     std::string(dtype_name(w.dtype())) + " weight",
                 "read_w reads an f32 weight as f16 or bf16");
  *round = DType::f32;
  if (read_w == DType::f32) return w.contiguous();
  if (path == ConvPath::kWinograd) {
    *round = read_w;
    return w.contiguous();
  }
  return cast(w, read_w, {}, MemoryCategory::workspace);
}

}  // namespace

Tensor conv2d(const Tensor& x_in, const Tensor& w_in, const Tensor& b, const Conv2dParams& p,
              DType out, Partials partials, DType read_x, DType read_w) {
  require_float(x_in, "conv2d", "input");
  require_float(w_in, "conv2d", "weight");
  ConvGeometry g(x_in.shape(), w_in.shape(), p);
  if (b.defined())
    MANTISSA_CHECK(b.dim() == 1 && b.size(0) == g.O,
                   "conv2d: bias " + shape_str(b.shape()) + " for " + str(g.O) + " channels",
                   "the bias has one value per output channel");
  const std::vector<float> bias = bias_f32(b, g.O);
  const ConvPath path = detail::conv_forward_path(g, partials);
  DType round_w;
  const Tensor x = read_input(x_in, read_x, path, g).contiguous(),
               w = read_weight(w_in, read_w, path, &round_w);
  switch (path) {
    case ConvPath::kDirect:
      return detail::direct_forward(x, w, bias, g, out);
    case ConvPath::kWinograd:
      return detail::winograd_forward(x, detail::ImplicitConv(g),
                                      {w.data_ptr(), w.dtype(), round_w}, false, bias, out,
                                      MemoryCategory::activations);
    case ConvPath::kImplicitRows:
    case ConvPath::kImplicitGemm:
      return detail::implicit_forward(x, detail::ImplicitConv(g),
                                      {w.data_ptr(), w.dtype(), g.CKK, 1}, bias, out, partials,
                                      MemoryCategory::activations, path == ConvPath::kImplicitRows);
    default:
      break;
  }
  MANTISSA_ASSERT(path == ConvPath::kIm2col, "conv2d: not a forward path");
  return detail::im2col_forward(x, w, bias, g, out, partials);
}

Tensor conv2d_backward_input(const Tensor& dy_in, const Tensor& w_in, const Shape& x_shape,
                             const Conv2dParams& p, DType out, Partials partials, DType read_w) {
  const ConvGeometry g(x_shape, w_in.shape(), p);
  MANTISSA_CHECK(
      dy_in.shape() == Shape({g.N, g.O, g.Ho, g.Wo}),
      "conv2d backward: gradient " + shape_str(dy_in.shape()) + " does not match the output shape",
      "report this as a bug");
  const ConvPath path = detail::conv_backward_input_path(g, partials);
  DType round_w;
  const Tensor dy = dy_in.contiguous(), w = read_weight(w_in, read_w, path, &round_w);
  if (path == ConvPath::kIm2col)
    return detail::im2col_backward_input(dy, w, x_shape, g, out, partials);
  // dx is the forward convolution of dy with the weights flipped and their channels swapped,
  // wt[c, o, kh, kw] = w[o, c, KH-1-kh, KW-1-kw]. Winograd reads them so from w as it transforms
  // the filters; the implicit GEMM gets a copy in w's own dtype (the GEMM converts while packing):
  // no FP32 copy of 16-bit weights.
  const detail::ImplicitConv t = detail::flipped_conv(g);
  MANTISSA_ASSERT(path == ConvPath::kWinograd || path == ConvPath::kImplicitRows ||
                      path == ConvPath::kImplicitGemm,
                  "conv2d backward: not a backward-input path");
  if (path == ConvPath::kWinograd)
    return detail::winograd_forward(dy, t, {w.data_ptr(), w.dtype(), round_w}, true, {}, out,
                                    MemoryCategory::gradients);
  Tensor wt = detail::byte_workspace(g.C * g.O * g.KH * g.KW, w.dtype());
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
      MANTISSA_ASSERT(esize(w.dtype()) == 1, "conv2d backward: unexpected weight dtype");
      flip(uint8_t{});
  }
  return detail::implicit_forward(dy, t, {wt.data_ptr(), w.dtype(), g.O * KK, 1}, {}, out, partials,
                                  MemoryCategory::gradients, path == ConvPath::kImplicitRows);
}

Tensor conv2d_backward_weight(const Tensor& dy_in, const Tensor& x_in, const Shape& w_shape,
                              const Conv2dParams& p, DType out, Partials partials, DType read_x) {
  ConvGeometry g(x_in.shape(), w_shape, p);
  const ConvPath path = detail::conv_weight_grad_path(g, partials);
  const Tensor dy = dy_in.contiguous(), x = read_input(x_in, read_x, path, g).contiguous();
  switch (path) {
    case ConvPath::kDirect:
      return detail::direct_weight_grad(dy, x, w_shape, g, out);
    case ConvPath::kImplicitDots:
      return detail::implicit_weight_grad_dots(dy, x, w_shape, g, out);
    case ConvPath::kImplicitGemm:
      return detail::implicit_weight_grad_gemm(dy, x, w_shape, g, out, partials);
    case ConvPath::kWinograd:
      return detail::winograd_weight_grad(dy, x, detail::ImplicitConv(g), out);
    default:
      break;
  }
  MANTISSA_ASSERT(path == ConvPath::kIm2col, "conv2d backward: not a weight-gradient path");
  return detail::im2col_weight_grad(dy, x, w_shape, g, out, partials);
}

double conv2d_weight_grad_bound(const Tensor& dy_in, const Tensor& x_in, DType out, DType read_x) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const double largest = max_finite(out);
  MANTISSA_ASSERT(dy_in.dim() == 4 && x_in.dim() == 4 && dy_in.size(0) == x_in.size(0),
                  "conv2d_weight_grad_bound takes dy (N, O, Ho, Wo) and x (N, C, H, W)");
  if (largest == 0) return kInf;
  const Tensor dy = dy_in.contiguous(), x = x_in.contiguous();
  const int64_t N = x.size(0), positions = dy.size(2) * dy.size(3);
  // Products summed into each value, in FP32 chains (the paths add a few more sums of parts):
  // (1 + 2^-24)^terms <= 1 + terms * 2^-23 while terms * 2^-24 stays below one. Winograd's sums
  // run over the tiles' transforms (values up to 4 max|dy| and 4 max|x|, a quarter as many
  // terms), and G^T dU G adds up to 9 of them with weights whose magnitudes sum to 4: its error
  // stays within 16 (tiles + 6) 2^-24 of positions * sum(max|dy| max|x|) = (terms + 24) 2^-22,
  // which a widening by terms * 2^-21 covers twice over.
  const double terms = static_cast<double>(N * positions) + 64;
  if (terms > 0x1p21) return kInf;
  // Per image, in parallel; amax is +inf for values holding an inf or NaN, and so is the sum then.
  const auto [dy_max, x_max] = slice_amaxes(dy, x, N);
  double t = 0;
  for (int64_t n = 0; n < N; ++n) {
    double xm = x_max[static_cast<size_t>(n)];
    if (read_x != DType::f32) {
      // Read as a 16-bit type: a value rounds by at most half a unit (bf16: a factor 1 + 2^-8),
      // and one past the type's range may become inf.
      if (!(xm <= max_finite(read_x))) return kInf;
      xm *= 1 + 0x1p-8;
    }
    t += dy_max[static_cast<size_t>(n)] * xm;
  }
  // The double sums are off by far less than 2^-10.
  return bound_rounded_into(
      t * static_cast<double>(positions) * (1 + terms * 0x1p-21) * (1 + 0x1p-10), out);
}

}  // namespace mantissa::kernels

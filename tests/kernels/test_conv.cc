// Convolution kernels at the sizes the models use, against plain FP64 loops: forward, gradient of
// the input and of the weights. Together the geometries, over the dtypes and partials of the
// tests below, take every row of the path table (kernels/conv_paths.h): direct, Winograd, implicit
// rows, implicit GEMM, implicit dot products and im2col (SuiteTakesEveryPath checks it). CTest
// also runs this program with MANTISSA_CONV_COLUMNS=4096, where every path works on one image at
// a time, with MANTISSA_CONV_WINOGRAD=0, where the Winograd geometries take the implicit GEMM,
// with MANTISSA_CONV_IMPLICIT=0 (im2col for all but direct and the forward Winograd), and with
// MANTISSA_SIMD=scalar.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "mantissa/kernels/conv_paths.h"
#include "mantissa/kernels/nn.h"
#include "mantissa/kernels/vector_kernels.h"
#include "mantissa/mantissa.h"

namespace mantissa::kernels {
namespace {

struct Geometry {
  std::string name;
  Shape x, w;
  Conv2dParams p;
};

std::vector<double> random_values(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> d(-1.0, 1.0);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = d(gen);
  return v;
}

Tensor stored(const std::vector<double>& v, const Shape& s, DType t) {
  std::vector<float> f(v.begin(), v.end());
  return Tensor::from_floats(f, s, t);
}

// The values a dtype stores (what the kernel actually sees).
std::vector<double> as_stored(const Tensor& t) {
  const std::vector<float> f = t.to_float_vector();
  return {f.begin(), f.end()};
}

// The three FP64 results: y (N, O, Ho, Wo), dx (N, C, H, W), dw (O, C/G, KH, KW).
struct Expected {
  std::vector<double> y, dx, dw;
};

Expected reference(const Geometry& g, const Shape& ys, const std::vector<double>& x,
                   const std::vector<double>& w, const std::vector<double>& dy) {
  const int64_t N = g.x[0], C = g.x[1], H = g.x[2], W = g.x[3], O = g.w[0], KH = g.w[2],
                KW = g.w[3], Ho = ys[2], Wo = ys[3], G = g.p.groups, Cg = C / G, Og = O / G;
  Expected e{std::vector<double>(static_cast<size_t>(N * O * Ho * Wo), 0.0),
             std::vector<double>(x.size(), 0.0), std::vector<double>(w.size(), 0.0)};
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o)
      for (int64_t oh = 0; oh < Ho; ++oh)
        for (int64_t ow = 0; ow < Wo; ++ow) {
          const size_t yi = static_cast<size_t>(((n * O + o) * Ho + oh) * Wo + ow);
          for (int64_t c = 0; c < Cg; ++c)
            for (int64_t kh = 0; kh < KH; ++kh)
              for (int64_t kw = 0; kw < KW; ++kw) {
                const int64_t ih = oh * g.p.stride_h - g.p.pad_h + kh * g.p.dilation_h,
                              iw = ow * g.p.stride_w - g.p.pad_w + kw * g.p.dilation_w;
                if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                const int64_t ci = (o / Og) * Cg + c;
                const size_t xi = static_cast<size_t>(((n * C + ci) * H + ih) * W + iw),
                             wi = static_cast<size_t>(((o * Cg + c) * KH + kh) * KW + kw);
                e.y[yi] += x[xi] * w[wi];
                e.dx[xi] += dy[yi] * w[wi];
                e.dw[wi] += dy[yi] * x[xi];
              }
        }
  return e;
}

void expect_close(const std::string& what, const std::vector<double>& want, const Tensor& got,
                  double rtol) {
  const std::vector<float> g = got.to_float_vector();
  ASSERT_EQ(g.size(), want.size()) << what;
  double scale = 0;
  for (double v : want) scale = std::max(scale, std::abs(v));
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < g.size(); ++i)
    if (!(std::abs(g[i] - want[i]) <= rtol * scale)) {
      if (bad++ == 0) first = i;
    }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << g.size() << " differ; first at " << first
                     << ": " << (bad ? g[first] : 0.0f) << " against " << want[first]
                     << " (tolerance " << rtol * scale << ")";
}

// rtol is relative to the largest |value| of the result; with FP16 partials it grows with the
// square root of the number of 16-product roundings along the reduction (len products).
double tolerance(double rtol, Partials partials, int64_t len) {
  return partials == Partials::kF16 ? rtol * std::sqrt(std::max(1.0, len / 16.0)) : rtol;
}

void check(const Geometry& g, DType t, Partials partials, double rtol) {
  const Shape ys = conv2d_output_shape(g.x, g.w, g.p);
  const int64_t nx = g.x[0] * g.x[1] * g.x[2] * g.x[3], nw = g.w[0] * g.w[1] * g.w[2] * g.w[3],
                ny = ys[0] * ys[1] * ys[2] * ys[3];
  const Tensor x = stored(random_values(nx, 1), g.x, t), w = stored(random_values(nw, 2), g.w, t),
               dy = stored(random_values(ny, 3), ys, t);
  const Expected e = reference(g, ys, as_stored(x), as_stored(w), as_stored(dy));
  const std::string what = g.name + " " + std::string(dtype_name(t)) +
                           (partials == Partials::kF16 ? " f16 partials" : "");
  const int64_t taps = g.w[2] * g.w[3];
  expect_close(what + " forward", e.y, conv2d(x, w, Tensor(), g.p, t, partials),
               tolerance(rtol, partials, g.w[1] * taps));
  expect_close(what + " input gradient", e.dx, conv2d_backward_input(dy, w, g.x, g.p, t, partials),
               tolerance(rtol, partials, g.w[0] / g.p.groups * taps));
  expect_close(what + " weight gradient", e.dw,
               conv2d_backward_weight(dy, x, g.w, g.p, t, partials),
               tolerance(rtol, partials, ys[0] * ys[2] * ys[3]));
}

Conv2dParams params(int64_t stride, int64_t pad, int64_t dilation = 1, int64_t groups = 1) {
  return {stride, stride, pad, pad, dilation, dilation, groups};
}

const std::vector<Geometry>& geometries() {
  static const std::vector<Geometry> g = {
      // the tutorial CNN, batch 3: conv1 (direct), conv2 (implicit rows; weight gradient by
      // lane-split dot products)
      {"tutorial_conv1", {3, 1, 128, 128}, {5, 1, 3, 3}, params(1, 0)},
      {"tutorial_conv2", {3, 5, 63, 63}, {12, 5, 5, 5}, params(1, 0)},
      // more direct geometries: padding (edge columns by tap, top and bottom rows not tiled),
      // 7 channels (blocks of 6 + 1 forward, 5 + 2 weight gradient), 18 taps, rows of 21 (a
      // 5-column tail); LeNet-5's conv1 (25 taps, rows of 28); stride 2 (not tiled)
      {"direct_pad1_7_channels", {2, 2, 19, 21}, {7, 2, 3, 3}, params(1, 1)},
      {"lenet_conv1", {2, 1, 32, 32}, {6, 1, 5, 5}, params(1, 0)},
      {"direct_stride2", {2, 1, 20, 20}, {4, 1, 3, 3}, params(2, 1)},
      // ResNet-18 (CIFAR stem) shapes at reduced width: 3x3 pad 1 at 32x32, 16x16, 8x8 and 4x4
      // (Winograd with FP32 partials; FP16 partials, and every run with Winograd off, take the
      // implicit GEMM with dense columns: slivers of 16 read in place, rows of 8 and 4 packed in
      // runs; weight gradient through the GEMM above 16 channels, lane-split dot products at 16
      // or fewer), a stride-2 3x3 (implicit, strided dense columns packed one by one;
      // backward-input through im2col) and 1x1 stride 2 (direct: 16 taps; im2col with FP16
      // partials, the window skipping pixels)
      {"resnet_3x3_32", {2, 16, 32, 32}, {16, 16, 3, 3}, params(1, 1)},
      {"resnet_3x3_32_wide", {2, 16, 32, 32}, {24, 16, 3, 3}, params(1, 1)},
      {"resnet_3x3_16", {2, 16, 16, 16}, {24, 16, 3, 3}, params(1, 1)},
      {"resnet_3x3_8", {2, 16, 8, 8}, {24, 16, 3, 3}, params(1, 1)},
      {"resnet_3x3_4", {3, 16, 4, 4}, {24, 16, 3, 3}, params(1, 1)},
      // Winograd: 3 x 5 tiles an image (vectors of 8 tiles gathered across rows and images; a
      // last partial vector), and rows of 8 tiles (read side by side)
      {"winograd_odd_tiles", {3, 17, 6, 10}, {20, 17, 3, 3}, params(1, 1)},
      {"winograd_rows_of_8_tiles", {2, 16, 4, 16}, {16, 16, 3, 3}, params(1, 1)},
      // Winograd's filters transformed in blocks of output channels (8, 8, 8, 8 and 4 with the
      // one-image chunks' budget of CTest's conv_one_image_chunks run)
      {"winograd_output_blocks", {2, 32, 8, 8}, {36, 32, 3, 3}, params(1, 1)},
      // dense columns whose slivers join rows of different images (3 rows of 8 per image)
      {"dense_rows_of_8_across_images", {3, 8, 3, 8}, {12, 8, 3, 3}, params(1, 1)},
      {"resnet_3x3_stride2", {2, 16, 16, 16}, {32, 16, 3, 3}, params(2, 1)},
      {"resnet_1x1_stride2", {2, 16, 16, 16}, {32, 16, 1, 1}, params(2, 0)},
      // strided with few outputs, ImageNet's 7x7 stem, and a stride of 3 with odd sizes (all
      // implicit GEMM forward and weight gradient, im2col backward-input)
      {"stride2_few_outputs", {2, 8, 16, 16}, {12, 8, 3, 3}, params(2, 1)},
      {"imagenet_stem_7x7_stride2", {2, 3, 32, 32}, {16, 3, 7, 7}, params(2, 3)},
      {"stride3_odd", {2, 4, 17, 15}, {20, 4, 3, 3}, params(3, 0)},
      // dilation (implicit), padding wider than the kernel reaches (backward-input via im2col),
      // groups (im2col)
      {"dilation2", {1, 6, 60, 60}, {8, 6, 3, 3}, params(1, 2, 2)},
      {"pad_past_kernel", {2, 6, 24, 24}, {8, 6, 3, 3}, params(1, 3)},
      {"groups2", {2, 8, 20, 20}, {8, 4, 3, 3}, params(1, 1, 1, 2)},
  };
  return g;
}

// Every path of every direction reads 16-bit operands as the FP32 values they hold (widened as
// they are staged, a row or an image at a time) and rounds a 16-bit result once from its FP32
// value: with FP32 partials, f16 and bf16 x, w and dy give the bits of their FP32 copies, and a
// 16-bit output holds the FP32 output converted.
TEST(Conv2d, SixteenBitOperandsGiveTheBitsOfTheirFp32Copies) {
  uint32_t seed = 90;
  for (const Geometry& g : geometries())
    for (const DType half : {DType::f16, DType::bf16}) {
      SCOPED_TRACE(g.name + " " + std::string(dtype_name(half)));
      const Tensor x = stored(random_values(g.x[0] * g.x[1] * g.x[2] * g.x[3], seed++), g.x, half);
      const Tensor w = stored(random_values(g.w[0] * g.w[1] * g.w[2] * g.w[3], seed++), g.w, half);
      const Tensor b = stored(random_values(g.w[0], seed++), {g.w[0]}, DType::f32);
      const Tensor x32 = x.to(DType::f32), w32 = w.to(DType::f32);
      const Tensor y32 = conv2d(x32, w32, b, g.p, DType::f32);
      const Tensor dy = stored(random_values(y32.numel(), seed++), y32.shape(), half);
      const Tensor dy32 = dy.to(DType::f32);
      const Tensor dx32 = conv2d_backward_input(dy32, w32, g.x, g.p, DType::f32);
      const Tensor dw32 = conv2d_backward_weight(dy32, x32, g.w, g.p, DType::f32);
      auto same = [](const Tensor& got, const Tensor& want, const char* what) {
        ASSERT_EQ(got.dtype(), want.dtype()) << what;
        EXPECT_EQ(std::memcmp(got.data_ptr(), want.data_ptr(), want.nbytes()), 0) << what;
      };
      for (const DType out : {half, DType::f32}) {
        same(conv2d(x, w, b, g.p, out), y32.to(out), "forward");
        same(conv2d_backward_input(dy, w, g.x, g.p, out), dx32.to(out), "input gradient");
        same(conv2d_backward_weight(dy, x, g.w, g.p, out), dw32.to(out), "weight gradient");
      }
    }
}

// The geometries above, with the partials of the tests below (the storage dtypes choose no path),
// take every path of every direction (with the switches on; CTest's runs with them off move the
// same geometries to other paths).
TEST(Conv2d, SuiteTakesEveryPath) {
  using detail::ConvPath;
  std::set<ConvPath> forward, input, weight;
  for (const Geometry& g : geometries())
    for (const Partials partials : {Partials::kF32, Partials::kF16}) {
      const detail::ConvGeometry cg(g.x, g.w, g.p);
      const detail::ConvSettings on;
      forward.insert(detail::conv_forward_path(cg, partials, on));
      input.insert(detail::conv_backward_input_path(cg, partials, on));
      weight.insert(detail::conv_weight_grad_path(cg, partials, on));
    }
  EXPECT_EQ(forward,
            (std::set<ConvPath>{ConvPath::kDirect, ConvPath::kWinograd, ConvPath::kImplicitRows,
                                ConvPath::kImplicitGemm, ConvPath::kIm2col}));
  EXPECT_EQ(input, (std::set<ConvPath>{ConvPath::kWinograd, ConvPath::kImplicitRows,
                                       ConvPath::kImplicitGemm, ConvPath::kIm2col}));
  EXPECT_EQ(weight,
            (std::set<ConvPath>{ConvPath::kDirect, ConvPath::kWinograd, ConvPath::kImplicitDots,
                                ConvPath::kImplicitGemm, ConvPath::kIm2col}));
}

TEST(Conv2d, Fp32MatchesFp64Loops) {
  for (const Geometry& g : geometries()) check(g, DType::f32, Partials::kF32, 2e-6);
}

// 16-bit storage: the kernels accumulate in FP32 and round the result once (tolerance: half an
// ulp of the result's scale, plus FP32 accumulation).
TEST(Conv2d, SixteenBitStorageMatchesFp64Loops) {
  for (const Geometry& g : geometries()) {
    check(g, DType::bf16, Partials::kF32, 1.0 / 256);
    check(g, DType::f16, Partials::kF32, 1.0 / 2048);
  }
}

// FP16 partials round every 16 products: looser, but every path must still compute the same
// convolution.
TEST(Conv2d, Fp16PartialsMatchFp64Loops) {
  for (const Geometry& g : geometries()) check(g, DType::f16, Partials::kF16, 1.0 / 256);
}

// Random values spread over many binades, so that rounding them to 16 bits changes most of them.
std::vector<double> spread_values(int64_t n, uint32_t seed) {
  std::vector<double> v = random_values(n, seed);
  for (size_t i = 0; i < v.size(); ++i) v[i] *= std::ldexp(1.0, static_cast<int>(i % 7) - 3);
  return v;
}

// The 16-bit types an FP32 operand is read as, with the partials each is tested with (FP16
// partials only with FP16), and a name for the trace.
struct HalfRead {
  DType half;
  Partials partials;
  std::string name;
};
const std::vector<HalfRead>& half_reads() {
  static const std::vector<HalfRead> reads = {{DType::f16, Partials::kF32, "f16"},
                                              {DType::f16, Partials::kF16, "f16 fp16 partials"},
                                              {DType::bf16, Partials::kF32, "bf16"}};
  return reads;
}

// An FP32 input read as f16 or bf16 (read_x: rounded as the padding paths stage it, a copy cast
// for the call by the others) gives the results of its 16-bit copy, bit for bit: the forward (every
// forward path) and the weight gradient (every weight-gradient path), with FP32 and FP16 partials
// (whose chunks must then be those of a 16-bit input), 16-bit and FP32 outputs.
TEST(Conv2d, Fp32InputReadAsSixteenBitIsItsCopyBitForBit) {
  using detail::ConvPath;
  std::set<ConvPath> forward, weight;
  uint32_t seed = 50;
  for (const Geometry& g : geometries())
    for (const auto& [half, partials, name] : half_reads()) {
      SCOPED_TRACE(g.name + " " + name);
      // The paths with the switches on (CTest's runs with them off take others).
      const detail::ConvGeometry cg(g.x, g.w, g.p);
      const detail::ConvSettings on;
      forward.insert(detail::conv_forward_path(cg, partials, on));
      weight.insert(detail::conv_weight_grad_path(cg, partials, on));
      const Tensor x = stored(spread_values(g.x[0] * g.x[1] * g.x[2] * g.x[3], seed++), g.x,
                              DType::f32),
                   x16 = x.to(half);
      const Tensor w = stored(random_values(g.w[0] * g.w[1] * g.w[2] * g.w[3], seed++), g.w, half);
      const Tensor b = stored(random_values(g.w[0], seed++), {g.w[0]}, DType::f32);
      for (const DType out : {half, DType::f32}) {
        const Tensor want = conv2d(x16, w, b, g.p, out, partials);
        const Tensor got = conv2d(x, w, b, g.p, out, partials, half);
        ASSERT_EQ(got.dtype(), out);
        ASSERT_EQ(std::memcmp(got.data_ptr(), want.data_ptr(), want.nbytes()), 0);
        const Tensor dy = stored(random_values(want.numel(), seed++), want.shape(), half);
        const Tensor dw_want = conv2d_backward_weight(dy, x16, g.w, g.p, out, partials);
        const Tensor dw_got = conv2d_backward_weight(dy, x, g.w, g.p, out, partials, half);
        ASSERT_EQ(std::memcmp(dw_got.data_ptr(), dw_want.data_ptr(), dw_want.nbytes()), 0);
      }
    }
  EXPECT_EQ(forward,
            (std::set<ConvPath>{ConvPath::kDirect, ConvPath::kWinograd, ConvPath::kImplicitRows,
                                ConvPath::kImplicitGemm, ConvPath::kIm2col}));
  EXPECT_EQ(weight,
            (std::set<ConvPath>{ConvPath::kDirect, ConvPath::kWinograd, ConvPath::kImplicitDots,
                                ConvPath::kImplicitGemm, ConvPath::kIm2col}));
  // Only an FP32 input is read as another type.
  EXPECT_THROW(
      conv2d(Tensor::zeros({1, 1, 4, 4}, DType::f16), Tensor::zeros({1, 1, 3, 3}, DType::f32), {},
             Conv2dParams{}, DType::f32, Partials::kF32, DType::bf16),
      Error);
}

// An FP32 weight read as f16 or bf16 (read_w: rounded as Winograd transforms the filters, a copy
// cast for the call by the other paths) gives the results of its 16-bit copy, bit for bit: the
// forward and the input gradient, on every path of both, with 16-bit and FP32 inputs and outputs,
// FP32 and FP16 partials.
TEST(Conv2d, Fp32WeightReadAsSixteenBitIsItsCopyBitForBit) {
  using detail::ConvPath;
  std::set<ConvPath> forward, input;
  uint32_t seed = 70;
  for (const Geometry& g : geometries())
    for (const auto& [half, partials, name] : half_reads()) {
      SCOPED_TRACE(g.name + " " + name);
      const detail::ConvGeometry cg(g.x, g.w, g.p);
      const detail::ConvSettings on;
      forward.insert(detail::conv_forward_path(cg, partials, on));
      input.insert(detail::conv_backward_input_path(cg, partials, on));
      const Tensor w = stored(spread_values(g.w[0] * g.w[1] * g.w[2] * g.w[3], seed++), g.w,
                              DType::f32),
                   w16 = w.to(half);
      const Tensor b = stored(random_values(g.w[0], seed++), {g.w[0]}, DType::f32);
      for (const DType in : {half, DType::f32}) {
        const Tensor x = stored(random_values(g.x[0] * g.x[1] * g.x[2] * g.x[3], seed++), g.x, in);
        const DType out = in;
        const Tensor want = conv2d(x, w16, b, g.p, out, partials);
        const Tensor got = conv2d(x, w, b, g.p, out, partials, DType::f32, half);
        ASSERT_EQ(got.dtype(), want.dtype());
        ASSERT_EQ(std::memcmp(got.data_ptr(), want.data_ptr(), want.nbytes()), 0) << "forward";
        const Tensor dy = stored(random_values(want.numel(), seed++), want.shape(), in);
        const Tensor dx_want = conv2d_backward_input(dy, w16, g.x, g.p, out, partials);
        const Tensor dx_got = conv2d_backward_input(dy, w, g.x, g.p, out, partials, half);
        ASSERT_EQ(dx_got.dtype(), dx_want.dtype());
        ASSERT_EQ(std::memcmp(dx_got.data_ptr(), dx_want.data_ptr(), dx_want.nbytes()), 0)
            << "input gradient";
      }
    }
  EXPECT_EQ(forward,
            (std::set<ConvPath>{ConvPath::kDirect, ConvPath::kWinograd, ConvPath::kImplicitRows,
                                ConvPath::kImplicitGemm, ConvPath::kIm2col}));
  EXPECT_EQ(input, (std::set<ConvPath>{ConvPath::kWinograd, ConvPath::kImplicitRows,
                                       ConvPath::kImplicitGemm, ConvPath::kIm2col}));
  // Only an FP32 weight is read as another type, and only as a 16-bit one.
  const Tensor x = Tensor::zeros({1, 1, 4, 4}, DType::f32);
  EXPECT_THROW(conv2d(x, Tensor::zeros({1, 1, 3, 3}, DType::f16), {}, Conv2dParams{}, DType::f32,
                      Partials::kF32, DType::f32, DType::bf16),
               Error);
  EXPECT_THROW(conv2d(x, Tensor::zeros({1, 1, 3, 3}, DType::f32), {}, Conv2dParams{}, DType::f32,
                      Partials::kF32, DType::f32, DType::e4m3),
               Error);
  EXPECT_THROW(conv2d_backward_input(Tensor::zeros({1, 1, 2, 2}, DType::f32),
                                     Tensor::zeros({1, 1, 3, 3}, DType::bf16), {1, 1, 4, 4},
                                     Conv2dParams{}, DType::f32, Partials::kF32, DType::f16),
               Error);
}

// Winograd adds the bias once per output, after the output transform; a 16-bit output is rounded
// once from the FP32 result, from operands in any storage.
TEST(Conv2d, WinogradAddsTheBias) {
  const Geometry g{"winograd_bias", {2, 16, 8, 8}, {16, 16, 3, 3}, params(1, 1)};
  const Shape ys = conv2d_output_shape(g.x, g.w, g.p);
  for (const DType t : {DType::f32, DType::bf16, DType::f16}) {
    const Tensor x = stored(random_values(2 * 16 * 64, 1), g.x, t),
                 w = stored(random_values(16 * 16 * 9, 2), g.w, t),
                 b = stored(random_values(16, 4), {16}, t);
    Expected e = reference(g, ys, as_stored(x), as_stored(w),
                           std::vector<double>(static_cast<size_t>(2 * 16 * 64), 0.0));
    const std::vector<double> b_stored = as_stored(b);
    for (size_t i = 0; i < e.y.size(); ++i) e.y[i] += b_stored[(i / 64) % 16];
    const std::string at = std::string(dtype_name(t)) + " operands";
    expect_close("winograd bias f32, " + at, e.y, conv2d(x, w, b, g.p, DType::f32), 2e-6);
    expect_close("winograd bias, bf16 output, " + at, e.y, conv2d(x, w, b, g.p, DType::bf16),
                 1.0 / 256);
    expect_close("winograd bias, f16 output, " + at, e.y, conv2d(x, w, b, g.p, DType::f16),
                 1.0 / 2048);
    // The 16-bit output is the FP32 result rounded once, bit for bit.
    const Tensor y32 = conv2d(x, w, b, g.p, DType::f32);
    for (const DType out : {DType::bf16, DType::f16}) {
      const Tensor y = conv2d(x, w, b, g.p, out), want = y32.to(out);
      EXPECT_EQ(0, std::memcmp(y.data_ptr(), want.data_ptr(), static_cast<size_t>(y.numel()) * 2))
          << at << " into " << dtype_name(out);
    }
  }
}

// Winograd's filters transformed a block of output channels at a time give the bits of the whole
// layer at once (a block's GEMMs are the layer's restricted to its rows), for every storage.
TEST(Conv2d, WinogradOutputBlocksGiveTheSameBits) {
  const Shape xs{2, 20, 8, 6}, ws{23, 20, 3, 3};
  const detail::ImplicitConv g(xs, 23, 3, 3, 1, 1, 1, 1);
  for (const DType t : {DType::f32, DType::bf16, DType::f16}) {
    const Tensor x = stored(random_values(2 * 20 * 48, 5), xs, t),
                 w = stored(random_values(23 * 20 * 9, 6), ws, t);
    const std::vector<float> bias(23, 0.25f);
    const Tensor whole = detail::winograd_forward(x, g, {w.data_ptr(), t}, false, bias, t,
                                                  MemoryCategory::activations, 23);
    for (const int64_t block : {1, 5, 8, 22}) {
      const Tensor y = detail::winograd_forward(x, g, {w.data_ptr(), t}, false, bias, t,
                                                MemoryCategory::activations, block);
      EXPECT_EQ(0, std::memcmp(y.data_ptr(), whole.data_ptr(),
                               static_cast<size_t>(y.numel()) * dtype_size(t)))
          << dtype_name(t) << ", blocks of " << block;
    }
  }
}

// Winograd's two schedules give the same bits: the per-thread one (each thread runs every stage
// on groups of images in buffers of its own; chosen for small layers on several threads) and the
// per-stage one (the threads split each stage; a given output block forces it). Images split
// into groups with a short last one, an image's tiles in two batches (576 tiles against batches
// of 512), the flipped filters of a backward-input, every storage, 2 and 3 threads.
TEST(Conv2d, WinogradPerThreadScheduleGivesTheSameBitsAsPerStage) {
  struct Case {
    Shape x;
    int64_t O;
  };
  for (const Case& k : {Case{{7, 16, 8, 6}, 24}, Case{{5, 64, 48, 48}, 64}})
    for (const int threads : {2, 3})
      for (const DType t : {DType::f32, DType::bf16, DType::f16})
        for (const bool flipped : {false, true}) {
          set_num_threads(threads);
          const int64_t C = k.x[1], n = k.x[0] * C * k.x[2] * k.x[3];
          const detail::ImplicitConv g(k.x, k.O, 3, 3, 1, 1, 1, 1);
          const Tensor x = stored(random_values(n, 7), k.x, t),
                       w = stored(random_values(k.O * C * 9, 8), {k.O * C * 9}, t);
          const std::vector<float> bias(static_cast<size_t>(k.O), -0.5f);
          const Tensor per_thread = detail::winograd_forward(x, g, {w.data_ptr(), t}, flipped, bias,
                                                             t, MemoryCategory::activations);
          const Tensor per_stage = detail::winograd_forward(x, g, {w.data_ptr(), t}, flipped, bias,
                                                            t, MemoryCategory::activations, k.O);
          set_num_threads(0);
          EXPECT_EQ(0, std::memcmp(per_thread.data_ptr(), per_stage.data_ptr(),
                                   static_cast<size_t>(per_stage.numel()) * dtype_size(t)))
              << dtype_name(t) << ", " << C << " channels, " << threads << " threads"
              << (flipped ? ", flipped" : "");
        }
}

// The Winograd transforms against their definitions (vector_kernels.h), bit for bit: eight tiles
// side by side, eight anywhere, and fewer.
TEST(Conv2d, WinogradTransformsMatchTheirDefinitionBitForBit) {
  std::mt19937 gen(9);
  std::uniform_real_distribution<float> d(-2.0f, 2.0f);
  const int64_t ld = 37, vs = 11;
  std::vector<float> src(static_cast<size_t>(ld * 8));
  for (float& v : src) v = d(gen);
  const int64_t spread[8] = {0, 6, 20, 2, 34, 24, 10, 30};  // tile starts when not side by side
  for (bool side_by_side : {true, false})
    for (int n : {8, 5, 1}) {
      const float* in[8];
      for (int l = 0; l < 8; ++l) in[l] = src.data() + (side_by_side ? 2 * l : spread[l]);
      std::vector<float> v(static_cast<size_t>(16 * vs), 0.0f), want = v;
      detail::winograd_input_f32(in, n, ld, v.data(), vs);
      for (int l = 0; l < n; ++l) {
        float x[4][4], e[4][4];
        for (int a = 0; a < 4; ++a)
          for (int b = 0; b < 4; ++b) x[a][b] = in[l][a * ld + b];
        for (int b = 0; b < 4; ++b) {
          e[0][b] = x[0][b] - x[2][b];
          e[1][b] = x[1][b] + x[2][b];
          e[2][b] = x[2][b] - x[1][b];
          e[3][b] = x[1][b] - x[3][b];
        }
        for (int a = 0; a < 4; ++a) {
          want[static_cast<size_t>((a * 4 + 0) * vs + l)] = e[a][0] - e[a][2];
          want[static_cast<size_t>((a * 4 + 1) * vs + l)] = e[a][1] + e[a][2];
          want[static_cast<size_t>((a * 4 + 2) * vs + l)] = e[a][2] - e[a][1];
          want[static_cast<size_t>((a * 4 + 3) * vs + l)] = e[a][1] - e[a][3];
        }
      }
      const std::string at =
          (side_by_side ? "side by side, n " : "gathered, n ") + std::to_string(n);
      EXPECT_EQ(0, std::memcmp(v.data(), want.data(), v.size() * sizeof(float))) << at;
      // Output: the products of tile l at m[xi * vs + l], results to out[l] and out[l] + ld, in
      // FP32 or rounded once into 16 bits.
      for (const DType t : {DType::f32, DType::f16, DType::bf16}) {
        const size_t es = dtype_size(t);
        std::vector<char> y(src.size() * es, 0), want_y = y;
        void* out[8];
        for (int l = 0; l < 8; ++l)
          out[l] = y.data() + static_cast<size_t>(side_by_side ? 2 * l : spread[l]) * es;
        const float bias = 0.375f;
        detail::winograd_output(v.data(), vs, n, bias, out, ld, t);
        for (int l = 0; l < n; ++l) {
          auto m = [&](int xi) { return v[static_cast<size_t>(xi * vs + l)]; };
          float r[2][4];
          for (int b = 0; b < 4; ++b) {
            r[0][b] = (m(b) + m(4 + b)) + m(8 + b);
            r[1][b] = (m(4 + b) - m(8 + b)) - m(12 + b);
          }
          for (int a = 0; a < 2; ++a) {
            const float res[2] = {((r[a][0] + r[a][1]) + r[a][2]) + bias,
                                  ((r[a][1] - r[a][2]) - r[a][3]) + bias};
            for (int k = 0; k < 2; ++k) {
              const int64_t at_l = (side_by_side ? 2 * l : spread[l]) + a * ld + k;
              convert(&res[k], DType::f32, want_y.data() + static_cast<size_t>(at_l) * es, t, 1);
            }
          }
        }
        EXPECT_EQ(0, std::memcmp(y.data(), want_y.data(), y.size())) << at << ", " << dtype_name(t);
      }
    }
}

// The weight gradient's transforms: the output-gradient transform against its definition
// (vector_kernels.h) bit for bit, eight tiles side by side, eight anywhere, and fewer; the
// filter-gradient transform G^T u G as the adjoint of the filter transform G g G^T, in FP64:
// sum(G^T u G . g) = sum(u . G g G^T) for any u and g.
TEST(Conv2d, WinogradWeightGradientTransformsMatchTheirDefinitions) {
  std::mt19937 gen(12);
  std::uniform_real_distribution<float> d(-2.0f, 2.0f);
  const int64_t ld = 29, vs = 11;
  std::vector<float> src(static_cast<size_t>(ld * 2));
  for (float& v : src) v = d(gen);
  const int64_t spread[8] = {0, 6, 20, 2, 26, 14, 10, 22};
  for (bool side_by_side : {true, false})
    for (int n : {8, 5, 1}) {
      const float* in[8];
      for (int l = 0; l < 8; ++l) in[l] = src.data() + (side_by_side ? 2 * l : spread[l]);
      std::vector<float> v(static_cast<size_t>(16 * vs), 0.0f), want = v;
      detail::winograd_dy_f32(in, n, ld, v.data(), vs);
      for (int l = 0; l < n; ++l) {
        const float e[2][2] = {{in[l][0], in[l][1]}, {in[l][ld], in[l][ld + 1]}};
        float r[4][2];
        for (int b = 0; b < 2; ++b) {
          r[0][b] = e[0][b];
          r[1][b] = e[0][b] + e[1][b];
          r[2][b] = e[0][b] - e[1][b];
          r[3][b] = -e[1][b];
        }
        for (int a = 0; a < 4; ++a) {
          want[static_cast<size_t>((a * 4 + 0) * vs + l)] = r[a][0];
          want[static_cast<size_t>((a * 4 + 1) * vs + l)] = r[a][0] + r[a][1];
          want[static_cast<size_t>((a * 4 + 2) * vs + l)] = r[a][0] - r[a][1];
          want[static_cast<size_t>((a * 4 + 3) * vs + l)] = -r[a][1];
        }
      }
      EXPECT_EQ(0, std::memcmp(v.data(), want.data(), v.size() * sizeof(float)))
          << (side_by_side ? "side by side, n " : "gathered, n ") << n;
    }
  for (const int64_t n : {1, 7, 16}) {
    const int64_t us = n + 2;
    std::vector<float> u(static_cast<size_t>(16 * us)), g(static_cast<size_t>(9 * n)),
        f(static_cast<size_t>(9 * n)), ug(static_cast<size_t>(16 * us));
    for (float& v : u) v = d(gen);
    for (float& v : g) v = d(gen);
    detail::winograd_filter_grad_f32(u.data(), us, n, f.data());
    detail::winograd_filter_f32(g.data(), n, ug.data(), us);
    for (int64_t c = 0; c < n; ++c) {
      double lhs = 0, rhs = 0, scale = 0;
      for (int k = 0; k < 9; ++k) {
        lhs += static_cast<double>(f[static_cast<size_t>(9 * c + k)]) *
               g[static_cast<size_t>(9 * c + k)];
        scale += std::fabs(static_cast<double>(g[static_cast<size_t>(9 * c + k)]));
      }
      for (int xi = 0; xi < 16; ++xi)
        rhs += static_cast<double>(u[static_cast<size_t>(xi * us + c)]) *
               ug[static_cast<size_t>(xi * us + c)];
      EXPECT_NEAR(lhs, rhs, 1e-5 * scale * 16) << "filter " << c << " of " << n;
    }
  }
}

// The transforms over a run of tiles (one call a channel) give the bits of the per-group entry
// points: a run of 53 tiles whose groups of eight sit side by side or scattered, paired every way
// within the sixteen tiles of an AVX-512 vector, and a last group of five; every output dtype.
TEST(Conv2d, WinogradTransformRunsGiveTheBitsOfTheirGroups) {
  std::mt19937 gen(13);
  std::uniform_real_distribution<float> d(-2.0f, 2.0f);
  const int64_t ld = 70, n = 53, vs = 57;
  std::vector<float> plane(static_cast<size_t>(ld * 6));
  for (float& v : plane) v = d(gen);
  // Groups of eight: rows side by side in groups 0 and 1 (two rows of eight, as sixteen in a
  // vector), 3, 4 and 6 (a last group of five), spread in groups 2 and 5: every pairing of a row
  // and a spread group within sixteen.
  std::vector<int64_t> at(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    const int64_t k = t / 8;
    at[static_cast<size_t>(t)] =
        k == 2 || k == 5 ? (t * 37) % 60 : (k % 2) * 2 * ld + 22 * (k / 3) + 2 * (t % 8);
  }
  auto per_group = [&](auto group) {
    for (int64_t t = 0; t < n; t += 8) {
      const int k = static_cast<int>(std::min<int64_t>(8, n - t));
      group(t, k);
    }
  };
  std::vector<float> v(static_cast<size_t>(16 * vs), 0.0f), want = v;
  detail::winograd_input_run(plane.data(), at.data(), n, ld, v.data(), vs);
  per_group([&](int64_t t, int k) {
    const float* in[8];
    for (int l = 0; l < k; ++l) in[l] = plane.data() + at[static_cast<size_t>(t + l)];
    detail::winograd_input_f32(in, k, ld, want.data() + t, vs);
  });
  EXPECT_EQ(0, std::memcmp(v.data(), want.data(), v.size() * sizeof(float))) << "input";
  std::fill(v.begin(), v.end(), 0.0f);
  std::fill(want.begin(), want.end(), 0.0f);
  detail::winograd_dy_run(plane.data(), at.data(), n, ld, v.data(), vs);
  per_group([&](int64_t t, int k) {
    const float* in[8];
    for (int l = 0; l < k; ++l) in[l] = plane.data() + at[static_cast<size_t>(t + l)];
    detail::winograd_dy_f32(in, k, ld, want.data() + t, vs);
  });
  EXPECT_EQ(0, std::memcmp(v.data(), want.data(), v.size() * sizeof(float))) << "output gradient";
  std::vector<float> m(static_cast<size_t>(16 * vs));
  for (float& e : m) e = d(gen);
  for (const DType t : {DType::f32, DType::f16, DType::bf16}) {
    const size_t es = dtype_size(t);
    std::vector<char> y(plane.size() * es, 0), want_y = y;
    detail::winograd_output_run(m.data(), vs, n, 0.25f, y.data(), at.data(), ld, t);
    per_group([&](int64_t t0, int k) {
      void* out[8];
      for (int l = 0; l < k; ++l) out[l] = want_y.data() + at[static_cast<size_t>(t0 + l)] * es;
      detail::winograd_output(m.data() + t0, vs, k, 0.25f, out, ld, t);
    });
    EXPECT_EQ(0, std::memcmp(y.data(), want_y.data(), y.size())) << "output " << dtype_name(t);
  }
}

// Winograd's weight gradient gives the same bits whatever its blocks of output channels and its
// batches of tiles (each value one FMA chain over every tile in order): batches that end inside
// a row of tiles and inside an image, tiles gathered from rows that hold fewer than eight,
// 16-bit operands (dy widened a chunk at a time, x while it is padded) and a 16-bit output.
TEST(Conv2d, WinogradWeightGradientBlocksAndBatchesGiveTheSameBits) {
  struct Case {
    Shape x;
    int64_t O;
  };
  for (const Case& k : {Case{{3, 16, 12, 10}, 20}, Case{{2, 24, 8, 36}, 17}})
    for (const DType t : {DType::f32, DType::bf16, DType::f16}) {
      const int64_t C = k.x[1], n = k.x[0] * C * k.x[2] * k.x[3],
                    m = k.x[0] * k.O * k.x[2] * k.x[3];
      const detail::ImplicitConv g(k.x, k.O, 3, 3, 1, 1, 1, 1);
      const Tensor x = stored(random_values(n, 13), k.x, t),
                   dy = stored(random_values(m, 14), {k.x[0], k.O, k.x[2], k.x[3]}, t);
      for (const DType out : {DType::f32, t}) {
        const Tensor whole = detail::winograd_weight_grad(dy, x, g, out, k.O, 0);
        for (const int64_t block : {int64_t{1}, int64_t{6}, k.O - 1})
          for (const int64_t batch : {int64_t{16}, int64_t{48}, int64_t{0}}) {
            const Tensor dw = detail::winograd_weight_grad(dy, x, g, out, block, batch);
            EXPECT_EQ(0, std::memcmp(dw.data_ptr(), whole.data_ptr(), whole.nbytes()))
                << dtype_name(t) << " into " << dtype_name(out) << ", blocks of " << block
                << ", batches of " << batch << " tiles, " << C << " channels";
          }
      }
    }
}

// The Winograd filter transform against its definition (vector_kernels.h), bit for bit: whole
// vectors of eight filters, and the tail of fewer.
TEST(Conv2d, WinogradFilterTransformMatchesItsDefinitionBitForBit) {
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> d(-2.0f, 2.0f);
  for (const int64_t n : {1, 5, 8, 13, 24}) {
    std::vector<float> f(static_cast<size_t>(9 * n));
    for (float& v : f) v = d(gen);
    const int64_t us = n + 3;
    std::vector<float> u(static_cast<size_t>(16 * us), 0.0f), want = u;
    detail::winograd_filter_f32(f.data(), n, u.data(), us);
    for (int64_t c = 0; c < n; ++c) {
      auto g = [&](int a, int b) { return f[static_cast<size_t>(9 * c + 3 * a + b)]; };
      float t[4][3];
      for (int j = 0; j < 3; ++j) {
        t[0][j] = g(0, j);
        t[1][j] = 0.5f * ((g(0, j) + g(1, j)) + g(2, j));
        t[2][j] = 0.5f * ((g(0, j) - g(1, j)) + g(2, j));
        t[3][j] = g(2, j);
      }
      for (int i = 0; i < 4; ++i) {
        const float r[4] = {t[i][0], 0.5f * ((t[i][0] + t[i][1]) + t[i][2]),
                            0.5f * ((t[i][0] - t[i][1]) + t[i][2]), t[i][2]};
        for (int j = 0; j < 4; ++j) want[static_cast<size_t>((i * 4 + j) * us + c)] = r[j];
      }
    }
    EXPECT_EQ(0, std::memcmp(u.data(), want.data(), u.size() * sizeof(float))) << n << " filters";
  }
}

// The register-tiled convolution rows against their definitions (vector_kernels.h), bit for bit,
// for every block shape and tail: channels 1-13, taps 1-11, 1-64 columns. Their f16 and bf16
// outputs hold the FP32 results converted, and nothing between the rows is written.
TEST(Conv2d, DirectRowKernelsMatchTheirDefinitionBitForBit) {
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> d(-2.0f, 2.0f);
  auto values = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = d(gen);
    return v;
  };
  for (int64_t O : {1, 2, 4, 5, 6, 7, 11, 13})
    for (int64_t taps : {1, 2, 3, 9, 11})
      for (int64_t n : {1, 5, 8, 9, 15, 16, 21, 24, 40, 50, 64}) {
        const int64_t ws = taps + 2, ys = n + 3;
        const std::vector<float> bias = values(static_cast<size_t>(O)),
                                 w = values(static_cast<size_t>(O * ws)),
                                 xs = values(static_cast<size_t>(taps * (n + 1))),
                                 dy = values(static_cast<size_t>(O * ys));
        std::vector<int64_t> tap(static_cast<size_t>(taps));
        std::vector<const float*> x(static_cast<size_t>(taps));
        for (int64_t i = 0; i < taps; ++i) {
          tap[static_cast<size_t>(i)] = (i * 5) % ws;  // any order of weight columns
          x[static_cast<size_t>(i)] = xs.data() + i * (n + 1) + (i % 2);
        }
        std::vector<float> y(static_cast<size_t>(O * ys), 0.0f), want_y = y;
        detail::conv_rows(y.data(), DType::f32, ys, O, bias.data(), w.data(), ws, tap.data(),
                          x.data(), taps, n);
        for (int64_t o = 0; o < O; ++o)
          for (int64_t j = 0; j < n; ++j) {
            float acc = bias[static_cast<size_t>(o)];
            for (int64_t i = 0; i < taps; ++i) {
              const float prod = w[static_cast<size_t>(o * ws + tap[static_cast<size_t>(i)])] *
                                 x[static_cast<size_t>(i)][j];
              acc += prod;
            }
            want_y[static_cast<size_t>(o * ys + j)] = acc;
          }
        // The GEMM's arithmetic: an FMA chain from 0 in tap order, then the bias (or + 0).
        std::vector<float> yf(static_cast<size_t>(O * ys), 0.0f), want_yf = yf, yn = yf,
                                                                  want_yn = yf;
        detail::fma_rows(yf.data(), DType::f32, ys, O, bias.data(), w.data(), ws, x.data(), taps,
                         n);
        detail::fma_rows(yn.data(), DType::f32, ys, O, nullptr, w.data(), ws, x.data(), taps, n);
        for (int64_t o = 0; o < O; ++o)
          for (int64_t j = 0; j < n; ++j) {
            float acc = 0.0f;
            for (int64_t i = 0; i < taps; ++i)
              acc = std::fma(w[static_cast<size_t>(o * ws + i)], x[static_cast<size_t>(i)][j], acc);
            want_yf[static_cast<size_t>(o * ys + j)] = acc + bias[static_cast<size_t>(o)];
            want_yn[static_cast<size_t>(o * ys + j)] = acc + 0.0f;
          }
        std::vector<float> lanes = values(static_cast<size_t>(O * taps * detail::kDotLanes)),
                           want_lanes = lanes;
        detail::conv_wgrad_rows_f32(lanes.data(), O, dy.data(), ys, x.data(), taps, n);
        for (int64_t o = 0; o < O; ++o)
          for (int64_t i = 0; i < taps; ++i)
            for (int64_t j = 0; j < n; ++j) {
              const float prod = dy[static_cast<size_t>(o * ys + j)] * x[static_cast<size_t>(i)][j];
              want_lanes[static_cast<size_t>((o * taps + i) * detail::kDotLanes +
                                             j % detail::kDotLanes)] += prod;
            }
        const std::string at = "O " + std::to_string(O) + ", taps " + std::to_string(taps) +
                               ", n " + std::to_string(n);
        EXPECT_EQ(0, std::memcmp(y.data(), want_y.data(), y.size() * sizeof(float))) << at;
        EXPECT_EQ(0, std::memcmp(yf.data(), want_yf.data(), yf.size() * sizeof(float))) << at;
        EXPECT_EQ(0, std::memcmp(yn.data(), want_yn.data(), yn.size() * sizeof(float))) << at;
        EXPECT_EQ(0, std::memcmp(lanes.data(), want_lanes.data(), lanes.size() * sizeof(float)))
            << at;
        for (const DType t : {DType::f16, DType::bf16}) {
          std::vector<uint16_t> h(static_cast<size_t>(O * ys), 0xabcd), hf = h;
          detail::conv_rows(h.data(), t, ys, O, bias.data(), w.data(), ws, tap.data(), x.data(),
                            taps, n);
          detail::fma_rows(hf.data(), t, ys, O, bias.data(), w.data(), ws, x.data(), taps, n);
          for (int64_t i = 0; i < O * ys; ++i) {
            const size_t e = static_cast<size_t>(i);
            uint16_t want_h = 0xabcd, want_hf = 0xabcd;  // between the rows: untouched
            if (i % ys < n) {
              convert(&want_y[e], DType::f32, &want_h, t, 1);
              convert(&want_yf[e], DType::f32, &want_hf, t, 1);
            }
            ASSERT_EQ(h[e], want_h) << at << ", " << dtype_name(t) << " element " << i;
            ASSERT_EQ(hf[e], want_hf) << at << ", " << dtype_name(t) << " element " << i;
          }
        }
      }
}

// The rows' 16-bit outputs where the FP32 sums are subnormal (which the BF16 instruction would read
// as zero: the kernels must round them by the integer rule) or past FP16's range.
TEST(Conv2d, DirectRowKernelsRoundSubnormalAndLargeSumsAsConvert) {
  const int64_t O = 3, taps = 2, n = 37;
  const std::vector<float> bias = {1e-40f, -3e-39f, 7e4f},
                           w = {0.5f, 0.0f, 1e-39f, 2.0f, 3.0f, 1.0f};
  std::vector<float> x0(n), x1(n);
  for (int64_t j = 0; j < n; ++j) {
    x0[static_cast<size_t>(j)] = 1e-39f * static_cast<float>(j);
    x1[static_cast<size_t>(j)] = static_cast<float>(j % 5) * 1e4f;
  }
  const float* x[] = {x0.data(), x1.data()};
  const int64_t tap[] = {0, 1};
  std::vector<float> y(static_cast<size_t>(O * n)), yf = y;
  detail::conv_rows(y.data(), DType::f32, n, O, bias.data(), w.data(), taps, tap, x, taps, n);
  detail::fma_rows(yf.data(), DType::f32, n, O, bias.data(), w.data(), taps, x, taps, n);
  for (const DType t : {DType::f16, DType::bf16}) {
    std::vector<uint16_t> h(static_cast<size_t>(O * n)), hf = h, want = h, want_f = h;
    detail::conv_rows(h.data(), t, n, O, bias.data(), w.data(), taps, tap, x, taps, n);
    detail::fma_rows(hf.data(), t, n, O, bias.data(), w.data(), taps, x, taps, n);
    convert(y.data(), DType::f32, want.data(), t, y.size());
    convert(yf.data(), DType::f32, want_f.data(), t, yf.size());
    EXPECT_EQ(h, want) << dtype_name(t);
    EXPECT_EQ(hf, want_f) << dtype_name(t);
  }
}

// The 2x2 stride-2 max pooling (the tutorial CNN's pool) against its definition, window by window:
// ties (few distinct values), infinities and NaN, rows of whole 8-output blocks and tails, odd
// input sizes (the last row and column unused). Values and indices must match exactly.
TEST(Pool, MaxPool2x2MatchesItsDefinition) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = INFINITY;
  const float pick[] = {-1.0f, 0.0f, 2.0f, 2.0f, 3.0f, -inf, inf, nan};
  std::mt19937 gen(5);
  for (const int64_t wo :
       {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{9}, int64_t{16}, int64_t{23}}) {
    for (const int64_t extra : {int64_t{0}, int64_t{1}}) {
      const int64_t H = 6 + extra, W = 2 * wo + extra;
      std::vector<float> v(static_cast<size_t>(2 * 3 * H * W));
      for (float& e : v) e = pick[gen() % 8];
      const Tensor x = Tensor::from_floats(v, {2, 3, H, W});
      auto [y, idx] = max_pool2d(x, Pool2dParams{}, DType::f32);
      ASSERT_EQ(y.shape(), (Shape{2, 3, 3, wo}));
      const std::vector<float> got = y.to_float_vector();
      for (int64_t pl = 0; pl < 6; ++pl)
        for (int64_t oh = 0; oh < 3; ++oh)
          for (int64_t ow = 0; ow < wo; ++ow) {
            // Window order; a later value wins when larger or NaN, never after a NaN.
            const int64_t at0 = 2 * oh * W + 2 * ow;
            const int64_t cand[4] = {at0, at0 + 1, at0 + W, at0 + W + 1};
            int64_t at = cand[0];
            for (int k = 1; k < 4; ++k) {
              const float b = v[static_cast<size_t>(pl * H * W + at)],
                          c = v[static_cast<size_t>(pl * H * W + cand[k])];
              if (!std::isnan(b) && (c > b || std::isnan(c))) at = cand[k];
            }
            const size_t o = static_cast<size_t>((pl * 3 + oh) * wo + ow);
            const float want = v[static_cast<size_t>(pl * H * W + at)];
            ASSERT_EQ(idx.dtype(), DType::u8);
            ASSERT_EQ(max_pool2d_argmax(idx, x.shape(), Pool2dParams{}, static_cast<int64_t>(o)),
                      at)
                << "width " << W << " plane " << pl << " at " << oh << "," << ow;
            ASSERT_TRUE(std::isnan(want) ? std::isnan(got[o]) : got[o] == want);
          }
    }
  }
}

// The same pooling on 16-bit storage, read and written in place by the row kernel: for every
// input and output type among f32, f16 and bf16, the window's winner (taken on the input's values)
// rounded into the output type, bit for bit as convert() rounds it (NaN payloads included), and
// its index. Values that 16 bits round (1.1, 70000: FP16 infinity) and tails of every width.
TEST(Pool, MaxPool2x2ReadsAndWrites16BitStorage) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = INFINITY;
  const float pick[] = {-1.0f, 0.0f, 1.1f, 2.0f, 70000.0f, -inf, inf, nan};
  const DType types[] = {DType::f32, DType::f16, DType::bf16};
  std::mt19937 gen(11);
  for (const DType tx : types)
    for (const DType ty : types)
      for (const int64_t wo : {int64_t{1}, int64_t{8}, int64_t{13}, int64_t{24}})
        for (const int64_t extra : {int64_t{0}, int64_t{1}}) {
          const int64_t H = 4 + extra, W = 2 * wo + extra;
          std::vector<float> v(static_cast<size_t>(2 * H * W));
          for (float& e : v) e = pick[gen() % 8];
          const Tensor x = Tensor::from_floats(v, {1, 2, H, W}).to(tx);
          const std::vector<float> xv = x.to_float_vector();  // the values as stored in tx
          auto [y, idx] = max_pool2d(x, Pool2dParams{}, ty);
          ASSERT_EQ(y.dtype(), ty);
          std::vector<float> want(static_cast<size_t>(2 * 2 * wo));
          for (int64_t pl = 0; pl < 2; ++pl)
            for (int64_t oh = 0; oh < 2; ++oh)
              for (int64_t ow = 0; ow < wo; ++ow) {
                const int64_t at0 = 2 * oh * W + 2 * ow;
                const int64_t cand[4] = {at0, at0 + 1, at0 + W, at0 + W + 1};
                int64_t at = cand[0];
                for (int k = 1; k < 4; ++k) {
                  const float b = xv[static_cast<size_t>(pl * H * W + at)],
                              c = xv[static_cast<size_t>(pl * H * W + cand[k])];
                  if (!std::isnan(b) && (c > b || std::isnan(c))) at = cand[k];
                }
                const size_t o = static_cast<size_t>((pl * 2 + oh) * wo + ow);
                want[o] = xv[static_cast<size_t>(pl * H * W + at)];
                ASSERT_EQ(idx.dtype(), DType::u8);
                ASSERT_EQ(
                    max_pool2d_argmax(idx, x.shape(), Pool2dParams{}, static_cast<int64_t>(o)), at)
                    << dtype_name(tx) << " -> " << dtype_name(ty);
              }
          // The winners as FP32, rounded into ty by convert(): the bits of the staged loop.
          const Tensor w = Tensor::from_floats(want, y.shape()).to(ty);
          ASSERT_EQ(0, std::memcmp(y.data_ptr(), w.data_ptr(), y.nbytes()))
              << dtype_name(tx) << " -> " << dtype_name(ty) << ", width " << W;
        }
}

// The 2x2 backward in 16-bit storage: for every gradient and output type among f32, f16 and
// bf16, each gradient (-0, NaN, infinities, values 16 bits round or overflow) at its window
// position as 0 + g and +0 elsewhere, a last odd row and column zero, bit for bit as zeroing an
// FP32 plane, adding and converting it.
TEST(Pool, MaxPool2x2BackwardInSixteenBitStorage) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = INFINITY;
  const float pick[] = {-0.0f, 1.1f, -2.0f, 70000.0f, 1e-7f, -inf, inf, nan};
  const DType types[] = {DType::f32, DType::f16, DType::bf16};
  std::mt19937 gen(31);
  for (const DType tg : types)
    for (const DType td : types)
      for (const int64_t wo : {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{9}, int64_t{24}})
        for (const int64_t extra : {int64_t{0}, int64_t{1}}) {
          const int64_t H = 4 + extra, W = 2 * wo + extra;
          std::vector<float> xv(static_cast<size_t>(2 * H * W));
          for (float& e : xv) e = static_cast<float>(gen() % 1000);
          const Tensor x = Tensor::from_floats(xv, {1, 2, H, W});
          auto [y, offsets] = max_pool2d(x, Pool2dParams{}, DType::f32);
          std::vector<float> gv(static_cast<size_t>(2 * 2 * wo));
          for (float& e : gv) e = pick[gen() % 8];
          const Tensor g = Tensor::from_floats(gv, y.shape()).to(tg);
          const std::vector<float> gs = g.to_float_vector();  // as stored in tg
          std::vector<float> want(xv.size(), 0.0f);
          for (int64_t i = 0; i < static_cast<int64_t>(gs.size()); ++i)
            want[static_cast<size_t>((i / (2 * wo)) * H * W +
                                     max_pool2d_argmax(offsets, x.shape(), Pool2dParams{}, i))] +=
                gs[static_cast<size_t>(i)];
          const Tensor w = Tensor::from_floats(want, x.shape()).to(td);
          const Tensor dx = max_pool2d_backward(g, offsets, x.shape(), Pool2dParams{}, td);
          ASSERT_EQ(dx.dtype(), td);
          ASSERT_EQ(0, std::memcmp(dx.data_ptr(), w.data_ptr(), w.nbytes()))
              << dtype_name(tg) << " -> " << dtype_name(td) << ", width " << W << ", height " << H;
        }
}

// The lane-split weight gradient (kImplicitDots) gives the same bits however many images a
// chunk holds: 16-bit operands get a quarter of the column budget (the tutorial CNN's conv2 at
// batch 12: chunks of 3 images against one chunk of 12 for FP32), and the sums of their values
// equal those of the same values stored in FP32; the chunks' columns start at the lanes one call
// over every image would use (63 x 63 planes: an odd stride, every chunk at another lane).
TEST(ConvWeightGrad, LaneSplitSumsDoNotDependOnTheChunk) {
  const Shape xs{12, 5, 63, 63}, ws{12, 5, 5, 5};
  const Conv2dParams prm;
  const detail::ConvGeometry g(xs, ws, prm);
  ASSERT_EQ(detail::conv_weight_grad_path(g, Partials::kF32), detail::ConvPath::kImplicitDots);
  const detail::ImplicitConv ic(g);
  std::mt19937 gen(23);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> xv(static_cast<size_t>(12 * 5 * 63 * 63)),
      gv(static_cast<size_t>(12 * 12 * 59 * 59));
  for (float& v : xv) v = d(gen);
  for (float& v : gv) v = d(gen);
  for (DType t : {DType::bf16, DType::f16}) {
    const Tensor x16 = Tensor::from_floats(xv, xs, t),
                 dy16 = Tensor::from_floats(gv, {12, 12, 59, 59}, t);
    const Tensor x32 = x16.to(DType::f32), dy32 = dy16.to(DType::f32);
    if (!std::getenv("MANTISSA_CONV_COLUMNS")) {  // the default budget: 12 images against 3
      EXPECT_EQ(ic.chunk(DType::f32), 12);
      EXPECT_EQ(ic.chunk(t), 3);
    }
    const std::vector<float> a =
        conv2d_backward_weight(dy16, x16, ws, prm, DType::f32, Partials::kF32).to_float_vector();
    const std::vector<float> b =
        conv2d_backward_weight(dy32, x32, ws, prm, DType::f32, Partials::kF32).to_float_vector();
    EXPECT_EQ(a, b) << dtype_name(t);
  }
}

// Where each maximum is: its offset in the window, packed 2, 4 or 8 bits an output (rows of whole
// bytes) up to 256 window positions, four bytes beyond; either way the position of the window's
// largest value (distinct values, windows clipped by padding and ceil mode), and the backward adds
// each output's gradient there, in output order (overlapping windows), exactly.
TEST(Pool, MaxPoolOffsetsFindTheMaximumAndRouteTheGradient) {
  std::mt19937 gen(17);
  const int64_t H = 20, W = 21;
  std::vector<float> v(static_cast<size_t>(2 * H * W)), g;
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);
  std::shuffle(v.begin(), v.end(), gen);
  const Tensor x = Tensor::from_floats(v, {1, 2, H, W});
  struct Case {
    int64_t k, s, pad;
    bool ceil;
  };
  for (const Case c : {Case{2, 2, 0, false}, Case{2, 1, 0, false}, Case{3, 2, 1, true},
                       Case{4, 2, 1, false}, Case{16, 4, 8, false}, Case{17, 3, 8, true}}) {
    Pool2dParams p;
    p.kernel_h = p.kernel_w = c.k, p.stride_h = p.stride_w = c.s, p.pad_h = p.pad_w = c.pad;
    p.ceil_mode = c.ceil;
    auto [y, offsets] = max_pool2d(x, p, DType::f32);
    EXPECT_EQ(offsets.dtype(), c.k * c.k <= 256 ? DType::u8 : DType::i32) << c.k;
    const int64_t Ho = y.size(2), Wo = y.size(3);
    const int64_t bits = c.k * c.k <= 4 ? 2 : c.k * c.k <= 16 ? 4 : c.k * c.k <= 256 ? 8 : 32;
    EXPECT_EQ(offsets.numel() * static_cast<int64_t>(dtype_size(offsets.dtype())),
              2 * Ho * (bits == 32 ? 4 * Wo : (Wo * bits + 7) / 8))
        << c.k;
    std::normal_distribution<float> dist;
    g.resize(static_cast<size_t>(2 * Ho * Wo));
    for (float& e : g) e = dist(gen);
    std::vector<float> want_dx(v.size(), 0.0f);
    for (int64_t pl = 0; pl < 2; ++pl)
      for (int64_t oh = 0; oh < Ho; ++oh)
        for (int64_t ow = 0; ow < Wo; ++ow) {
          int64_t best = -1;
          for (int64_t h = oh * c.s - c.pad; h < oh * c.s - c.pad + c.k; ++h)
            for (int64_t w = ow * c.s - c.pad; w < ow * c.s - c.pad + c.k; ++w)
              if (h >= 0 && h < H && w >= 0 && w < W &&
                  (best < 0 || v[static_cast<size_t>(pl * H * W + h * W + w)] >
                                   v[static_cast<size_t>(pl * H * W + best)]))
                best = h * W + w;
          const int64_t i = (pl * Ho + oh) * Wo + ow;
          ASSERT_EQ(max_pool2d_argmax(offsets, x.shape(), p, i), best)
              << c.k << " at " << oh << "," << ow;
          want_dx[static_cast<size_t>(pl * H * W + best)] += g[static_cast<size_t>(i)];
        }
    const Tensor dx =
        max_pool2d_backward(Tensor::from_floats(g, y.shape()), offsets, x.shape(), p, DType::f32);
    EXPECT_EQ(dx.to_float_vector(), want_dx) << c.k;
  }
}
}  // namespace
}  // namespace mantissa::kernels

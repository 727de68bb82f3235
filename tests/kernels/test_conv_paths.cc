// The convolution path choosers against the path table (kernels/conv_paths.h): every row of each
// direction, its boundaries (channel counts, taps, padding), the switches given explicitly, and
// the environment's switches as CTest sets them (kernels.conv_no_winograd, conv_no_implicit,
// conv_one_image_chunks run this suite again).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "mantissa/kernels/conv_paths.h"
#include "mantissa/mantissa.h"

namespace mantissa::kernels::detail {
namespace {

constexpr Partials p32 = Partials::kF32, p16 = Partials::kF16;

Conv2dParams params(int64_t stride, int64_t pad, int64_t dilation = 1, int64_t groups = 1) {
  return {stride, stride, pad, pad, dilation, dilation, groups};
}

ConvSettings switches(bool winograd, bool implicit) {
  ConvSettings s;
  s.winograd = winograd;
  s.implicit = implicit;
  return s;
}
const ConvSettings kAllOn = switches(true, true);

// The paths of one convolution: forward, backward-input, weight gradient.
struct Paths {
  ConvPath forward, input, weight;
};

Paths paths(const Shape& x, const Shape& w, const Conv2dParams& p, Partials partials,
            const ConvSettings& s = kAllOn) {
  const ConvGeometry g(x, w, p);
  return {conv_forward_path(g, partials, s), conv_backward_input_path(g, partials, s),
          conv_weight_grad_path(g, partials, s)};
}

std::string name(ConvPath p) { return std::string(conv_path_name(p)); }

#define EXPECT_PATHS(got, f, i, w)                                 \
  do {                                                             \
    const Paths got_ = (got);                                      \
    EXPECT_EQ(name(got_.forward), name(ConvPath::f)) << "forward"; \
    EXPECT_EQ(name(got_.input), name(ConvPath::i)) << "input";     \
    EXPECT_EQ(name(got_.weight), name(ConvPath::w)) << "weight";   \
  } while (0)

// Forward and weight gradient kDirect: groups 1, dilation 1, FP32 partials, taps <= 32,
// O * taps <= 512. The backward-input has no direct path.
TEST(ConvPaths, DirectForTinyFilterBanks) {
  // The tutorial CNN's conv1 (5 x 1 x 3 x 3); its backward-input is implicit rows (1 channel).
  EXPECT_PATHS(paths({3, 1, 128, 128}, {5, 1, 3, 3}, params(1, 0), p32), kDirect, kImplicitRows,
               kDirect);
  // Any dtype, padding and stride.
  EXPECT_PATHS(paths({2, 1, 20, 20}, {4, 1, 3, 3}, params(2, 1), p32), kDirect, kIm2col, kDirect);
  // 32 taps (2 x 4 x 4) and O * taps = 512: still direct; 33 taps or 513 are not.
  EXPECT_EQ(paths({2, 2, 20, 20}, {16, 2, 4, 4}, params(1, 0), p32).forward, ConvPath::kDirect);
  EXPECT_NE(paths({2, 2, 20, 20}, {17, 2, 4, 4}, params(1, 0), p32).forward, ConvPath::kDirect);
  EXPECT_NE(paths({2, 3, 20, 20}, {2, 3, 3, 4}, params(1, 0), p32).forward,
            ConvPath::kDirect);  // 36 taps
  // FP16 partials, dilation or groups take it off.
  EXPECT_PATHS(paths({3, 1, 128, 128}, {5, 1, 3, 3}, params(1, 0), p16), kImplicitGemm,
               kImplicitGemm, kImplicitGemm);
  EXPECT_NE(paths({1, 2, 40, 40}, {4, 2, 3, 3}, params(1, 2, 2), p32).forward, ConvPath::kDirect);
  EXPECT_PATHS(paths({2, 2, 20, 20}, {4, 1, 3, 3}, params(1, 1, 1, 2), p32), kIm2col, kIm2col,
               kIm2col);
}

// kWinograd: FP32 partials, 3x3 stride 1 pad 1 dilation 1, even H and W, 16 or more channels each
// way; forward, backward-input and weight gradient. The operands' storage does not choose the path
// (16-bit values widen exactly while the input is padded and the filters transformed).
TEST(ConvPaths, WinogradForThreeByThreeLayers) {
  const Shape x{2, 16, 8, 8}, w{16, 16, 3, 3};
  EXPECT_PATHS(paths(x, w, params(1, 1), p32), kWinograd, kWinograd, kWinograd);
  // FP16 partials keep the implicit GEMM's arithmetic (the 16-product roundings).
  EXPECT_PATHS(paths(x, w, params(1, 1), p16), kImplicitGemm, kImplicitGemm, kImplicitGemm);
  // 15 input or output channels, an odd size, stride 2, pad 0, dilation 2, 5x5: not Winograd.
  EXPECT_EQ(paths({2, 15, 8, 8}, {16, 15, 3, 3}, params(1, 1), p32).forward,
            ConvPath::kImplicitGemm);
  EXPECT_EQ(paths(x, {15, 16, 3, 3}, params(1, 1), p32).forward, ConvPath::kImplicitGemm);
  EXPECT_EQ(paths(x, {15, 16, 3, 3}, params(1, 1), p32).input, ConvPath::kImplicitGemm);
  EXPECT_EQ(paths({2, 16, 12, 9}, w, params(1, 1), p32).forward, ConvPath::kIm2col);
  EXPECT_EQ(paths({2, 16, 8, 8}, w, params(2, 1), p32).forward, ConvPath::kImplicitGemm);
  EXPECT_EQ(paths({2, 16, 18, 18}, w, params(1, 0), p32).forward, ConvPath::kImplicitGemm);
  EXPECT_EQ(paths({2, 16, 8, 8}, w, params(1, 2, 2), p32).forward, ConvPath::kImplicitGemm);
  EXPECT_EQ(paths({2, 16, 8, 8}, {16, 16, 5, 5}, params(1, 2), p32).forward,
            ConvPath::kImplicitGemm);
  // The switches: Winograd off gives the implicit paths; implicit off also takes the
  // backward-input off Winograd (it enters through the flipped convolution), not the forward or
  // the weight gradient.
  EXPECT_PATHS(paths(x, w, params(1, 1), p32, switches(false, true)), kImplicitGemm, kImplicitGemm,
               kImplicitDots);
  EXPECT_PATHS(paths(x, w, params(1, 1), p32, switches(true, false)), kWinograd, kIm2col,
               kWinograd);
  EXPECT_PATHS(paths(x, w, params(1, 1), p32, switches(false, false)), kIm2col, kIm2col, kIm2col);
}

// kImplicitRows (forward: stride_w 1, FP32 partials, O <= 12; backward-input: C <= 12) and
// kImplicitGemm, over geometries that implicit fits.
TEST(ConvPaths, ImplicitRowsForFewChannelsElseTheGemm) {
  // The tutorial CNN's conv2: 12 outputs, 5 inputs (its backward-input has 5 outputs).
  const Shape x{3, 5, 63, 63};
  EXPECT_PATHS(paths(x, {12, 5, 5, 5}, params(1, 0), p32), kImplicitRows, kImplicitRows,
               kImplicitDots);
  EXPECT_PATHS(paths(x, {13, 5, 5, 5}, params(1, 0), p32), kImplicitGemm, kImplicitRows,
               kImplicitDots);
  EXPECT_PATHS(paths(x, {12, 5, 5, 5}, params(1, 0), p16), kImplicitGemm, kImplicitGemm,
               kImplicitGemm);
  // 12 and 13 input channels: the backward-input's outputs.
  EXPECT_EQ(paths({2, 12, 32, 32}, {24, 12, 3, 3}, params(1, 1), p32).input,
            ConvPath::kImplicitRows);
  EXPECT_EQ(paths({2, 13, 32, 32}, {24, 13, 3, 3}, params(1, 1), p32).input,
            ConvPath::kImplicitGemm);
  // Strided along the rows (stride_w 2): the rows kernel needs unit-stride rows.
  EXPECT_PATHS(paths({2, 4, 16, 16}, {8, 4, 3, 3}, params(2, 1), p32), kImplicitGemm, kIm2col,
               kImplicitGemm);
  Conv2dParams tall = params(1, 1);
  tall.stride_h = 2;
  EXPECT_PATHS(paths({2, 4, 16, 16}, {8, 4, 3, 3}, tall, p32), kImplicitRows, kIm2col,
               kImplicitGemm);
  // Implicit off: im2col everywhere.
  EXPECT_PATHS(paths(x, {12, 5, 5, 5}, params(1, 0), p32, switches(true, false)), kIm2col, kIm2col,
               kIm2col);
}

// "Implicit fits": dense rows (Wo 16k, 8 or 4), or at least 64 positions with at most 1.15x
// padding; strided when the windows cover the input.
TEST(ConvPaths, ImplicitFitsDenseRowsOrLittlePadding) {
  const Shape w{24, 8, 3, 3};
  for (int64_t size : {32, 16, 8, 4})  // dense rows
    EXPECT_EQ(paths({2, 8, size, size}, w, params(1, 1), p32).forward, ConvPath::kImplicitGemm)
        << size;
  // 14x14 planes padded to 16x16: 1.31x, too much. 30x30 to 32x32: 1.14x, fits.
  EXPECT_PATHS(paths({2, 8, 14, 14}, w, params(1, 1), p32), kIm2col, kIm2col, kIm2col);
  EXPECT_PATHS(paths({2, 8, 30, 30}, w, params(1, 1), p32), kImplicitGemm, kImplicitRows,
               kImplicitGemm);
  // Fewer than 64 positions and not dense: 7x7.
  EXPECT_EQ(paths({2, 8, 7, 7}, w, params(1, 0), p32).forward, ConvPath::kIm2col);
  // Strided: a 3x3 stride-2 window covers the input, a 1x1 stride-2 one does not, nor a 3x3
  // stride 4.
  EXPECT_PATHS(paths({2, 16, 16, 16}, {32, 16, 3, 3}, params(2, 1), p32), kImplicitGemm, kIm2col,
               kImplicitGemm);
  EXPECT_PATHS(paths({2, 32, 16, 16}, {32, 32, 1, 1}, params(2, 0), p32), kIm2col, kIm2col,
               kIm2col);
  EXPECT_EQ(paths({2, 16, 17, 17}, {32, 16, 3, 3}, params(4, 0), p32).forward, ConvPath::kIm2col);
  // A dilated 3x3 stride 2 window spans 5 columns: it covers.
  EXPECT_EQ(paths({2, 16, 17, 17}, {32, 16, 3, 3}, params(2, 2, 2), p32).forward,
            ConvPath::kImplicitGemm);
}

// The backward-input's implicit paths need stride 1 and a padding of at most dilation * (K - 1).
TEST(ConvPaths, BackwardInputNeedsStrideOneAndPaddingWithinTheKernel) {
  const Shape x{2, 6, 32, 32}, w{8, 6, 3, 3};
  EXPECT_EQ(paths(x, w, params(1, 1), p32).input, ConvPath::kImplicitRows);
  EXPECT_EQ(paths(x, w, params(1, 2), p32).input, ConvPath::kImplicitRows);
  EXPECT_EQ(paths(x, w, params(1, 3), p32).input, ConvPath::kIm2col);
  EXPECT_EQ(paths(x, w, params(1, 3, 2), p32).input, ConvPath::kImplicitRows);
  EXPECT_EQ(paths(x, w, params(2, 1), p32).input, ConvPath::kIm2col);
}

// kImplicitDots: stride 1, FP32 partials, O <= 16; otherwise the implicit GEMM (Winograd first
// where it fits: 16 input channels make these layers Winograd's).
TEST(ConvPaths, WeightGradientDotsForFewOutputChannels) {
  const Shape x{2, 15, 32, 32};
  EXPECT_EQ(paths(x, {16, 15, 3, 3}, params(1, 1), p32).weight, ConvPath::kImplicitDots);
  EXPECT_EQ(paths(x, {17, 15, 3, 3}, params(1, 1), p32).weight, ConvPath::kImplicitGemm);
  EXPECT_EQ(paths(x, {16, 15, 3, 3}, params(1, 1), p16).weight, ConvPath::kImplicitGemm);
  EXPECT_EQ(paths(x, {16, 15, 3, 3}, params(2, 1), p32).weight, ConvPath::kImplicitGemm);
  EXPECT_EQ(paths(x, {16, 15, 3, 3}, params(1, 1), p32, switches(true, false)).weight,
            ConvPath::kIm2col);
  EXPECT_EQ(paths({2, 16, 32, 32}, {16, 16, 3, 3}, params(1, 1), p32).weight, ConvPath::kWinograd);
}

bool env_is(const char* name, const char* value) {
  const char* e = std::getenv(name);
  return e && std::string(e) == value;
}

// The switches as the environment sets them (CTest runs this suite with each set).
TEST(ConvPaths, EnvironmentSwitchesReachTheChoosers) {
  const bool winograd_off = env_is("MANTISSA_CONV_WINOGRAD", "0");
  const bool implicit_off = env_is("MANTISSA_CONV_IMPLICIT", "0");
  EXPECT_EQ(conv_settings().winograd, !winograd_off);
  EXPECT_EQ(conv_settings().implicit, !implicit_off);
  // The choosers' default settings are the environment's.
  const ConvGeometry resnet({2, 16, 8, 8}, {16, 16, 3, 3}, params(1, 1));
  EXPECT_EQ(name(conv_forward_path(resnet, p32)),
            name(winograd_off ? (implicit_off ? ConvPath::kIm2col : ConvPath::kImplicitGemm)
                              : ConvPath::kWinograd));
  EXPECT_EQ(name(conv_backward_input_path(resnet, p32)),
            name(implicit_off   ? ConvPath::kIm2col
                 : winograd_off ? ConvPath::kImplicitGemm
                                : ConvPath::kWinograd));
  EXPECT_EQ(name(conv_weight_grad_path(resnet, p32)),
            name(winograd_off ? (implicit_off ? ConvPath::kIm2col : ConvPath::kImplicitDots)
                              : ConvPath::kWinograd));
  // The column budget: 2^20 elements, or MANTISSA_CONV_COLUMNS (4096 in CTest: one image a chunk).
  const char* columns = std::getenv("MANTISSA_CONV_COLUMNS");
  if (!columns || std::string(columns) == "4096") {
    EXPECT_EQ(conv_settings().column_budget, columns ? 4096 : int64_t{1} << 20);
    const ConvGeometry batch({8, 16, 8, 8}, {16, 16, 3, 3}, params(1, 1));  // 9216 per image
    EXPECT_EQ(batch.chunk(), columns ? 1 : 8);
  }
}

}  // namespace
}  // namespace mantissa::kernels::detail

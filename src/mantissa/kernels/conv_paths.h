// Internal: the convolution paths (one file each: conv_direct.cc, conv_winograd.cc,
// conv_implicit.cc, conv_im2col.cc) and the one place that chooses among them (conv.cc).
// docs/numerics.md describes each path's arithmetic and figures.
//
// ---- The path table ----
// Each direction takes the first row whose conditions all hold. taps = C/groups * KH * KW;
// "implicit fits" is ImplicitConv::worthwhile() below; "implicit on" and "Winograd on" are the
// environment switches MANTISSA_CONV_IMPLICIT and MANTISSA_CONV_WINOGRAD (anything but 0, or
// unset, is on), read once into ConvSettings.
//
// Forward (conv2d; conv_forward_path):
//   kDirect        groups 1; dilation 1; FP32 partials; taps <= 32 and O * taps <= 512
//   kWinograd      Winograd on; groups 1; FP32 partials; 3x3, stride 1, pad 1, dilation 1;
//                  H and W even; C >= 16 and O >= 16
//   kImplicitRows  implicit on; groups 1; implicit fits; stride_w 1; FP32 partials; O <= 12
//   kImplicitGemm  implicit on; groups 1; implicit fits
//   kIm2col        otherwise
//
// Backward-input (conv2d_backward_input; conv_backward_input_path). With stride 1 the input
// gradient is the forward convolution of dy, padded by dilation * (K - 1) - pad, with the flipped,
// channel-swapped weights (flipped_conv() below; O input channels, C outputs), which the first
// three rows run:
//   kWinograd      implicit on; groups 1; stride 1; padding >= 0; and the flipped convolution
//                  meets the forward kWinograd row: Winograd on, FP32 partials, 3x3, pad 1,
//                  dilation 1, H and W even, C >= 16 and O >= 16
//   kImplicitRows  implicit on; groups 1; stride 1; padding >= 0; the flipped convolution fits
//                  implicitly; FP32 partials; C <= 12
//   kImplicitGemm  implicit on; groups 1; stride 1; padding >= 0; the flipped convolution fits
//   kIm2col        otherwise: dcols = W^T dy by the GEMM, then col2im
// (So MANTISSA_CONV_IMPLICIT=0 also takes the backward-input off Winograd: the flipped
// convolution is the implicit path's entry.)
//
// Weight gradient (conv2d_backward_weight; conv_weight_grad_path):
//   kDirect        as the forward's kDirect
//   kWinograd      as the forward's kWinograd
//   kImplicitDots  implicit on; groups 1; implicit fits; stride 1; FP32 partials; O <= 16
//   kImplicitGemm  implicit on; groups 1; implicit fits
//   kIm2col        otherwise (the images in min(4, N) parts, each with its own FP32
//                  accumulator, when O/groups * taps < 64 * 64)
//
// Implicit fits: the output is not empty and either the convolution is strided (either axis)
// and its windows cover the input (dilation * (K - 1) + 1 >= stride on both axes), or it has
// stride 1 and its output rows are dense (Wo a multiple of 16, or 8 or 4) or it has at least 64
// output positions and its padded plane is at most 1.15x of them (20 Hp Wp <= 23 Ho Wo).
//
// MANTISSA_CONV_COLUMNS=n (elements, at least 1024; default 2^20) is the chunk budget: how many
// images a path takes at a time. It changes no path and no forward or input gradient. Weight
// gradients carry their sums from chunk to chunk: with FP32 partials the GEMM paths continue one
// FMA chain and kImplicitDots starts each chunk's columns at the lane one call over every image
// would (the same bits for any budget, and so for 16-bit operands, which get a quarter of it, as
// for their FP32 values; inputs holding inf aside: the columns a chunk leaves out or adds pair a
// zero gradient with other input values), but FP16 partials restart their 16-product groups at
// each chunk, so those round differently.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "mantissa/core/tensor.h"
#include "mantissa/kernels/conv.h"
#include "mantissa/kernels/gemm.h"

namespace mantissa::kernels::detail {

// ---- Choosing a path ----

// The paths: (enumerator, name, what it is).
#define MANTISSA_CONV_PATHS(X)                                                          \
  X(kDirect, "direct", "register-tiled rows over the input in place (conv_direct.cc)")  \
  X(kWinograd, "winograd", "F(2x2, 3x3) (conv_winograd.cc)")                            \
  X(kImplicitRows, "implicit rows",                                                     \
    "a padded FP32 copy read by register-tiled FMA rows (conv_implicit.cc)")            \
  X(kImplicitGemm, "implicit gemm",                                                     \
    "a padded FP32 copy read in place by the GEMM "                                     \
    "(conv_implicit.cc)")                                                               \
  X(kImplicitDots, "implicit dots",                                                     \
    "weight gradient: lane-split dot products over the padded copy (conv_implicit.cc)") \
  X(kIm2col, "im2col", "columns in the storage dtype, the GEMM, col2im (conv_im2col.cc)")

enum class ConvPath : uint8_t {
#define MANTISSA_CONV_PATH_ENUM(e, name, what) e,
  MANTISSA_CONV_PATHS(MANTISSA_CONV_PATH_ENUM)
#undef MANTISSA_CONV_PATH_ENUM
};
std::string_view conv_path_name(ConvPath p);

// The environment's switches, read once.
struct ConvSettings {
  bool winograd = true;                      // MANTISSA_CONV_WINOGRAD (0: off)
  bool implicit = true;                      // MANTISSA_CONV_IMPLICIT (0: off)
  int64_t column_budget = int64_t{1} << 20;  // MANTISSA_CONV_COLUMNS (at least 1024)
};
const ConvSettings& conv_settings();
// The FP32 elements an implicit path may stage per chunk for operands stored in `staged`: the
// column budget, a quarter of it for 16-bit operands. Their FP32 copies take twice the bytes of
// the values they copy, in a model that holds half the bytes of an FP32 one: a quarter keeps the
// staging of a 16-bit model from undoing what its storage saves (the tutorial CNN's conv2 weight
// gradient at batch 12: 3.1 MiB of copies for all 12 images, 0.8 MiB in chunks of 3), and it was
// no slower there. FP32 operands keep the whole budget (a quarter made ResNet-18 in 32-true 7%
// slower), and so do the GEMM forward (and backward-input) and Winograd for any storage: their
// chunks are the GEMM's columns, and each chunk packs the weights again (ResNet-18's stride-2
// 3x3 forwards in 16 bits took 12.9-14.4 ms with a quarter against 10.6-11.4 in FP32).
inline int64_t staged_budget(DType staged) {
  return dtype_size(staged) < 4 ? conv_settings().column_budget / 4 : conv_settings().column_budget;
}

// A convolution's sizes; the constructor checks the shapes (conv2d_output_shape).
struct ConvGeometry {
  int64_t N, C, H, W, O, KH, KW, Ho, Wo, G, Cg, Og, CKK, HW;  // CKK: taps, HW: output positions
  Conv2dParams p;
  // The type the input's values are read as: an FP32 input rounded to f16 or bf16 as it is
  // padded (the values of its 16-bit copy, which is never made; conv2d's read_x). f32: as stored.
  DType read_as = DType::f32;
  ConvGeometry(const Shape& x, const Shape& w, const Conv2dParams& prm);
  // Images per chunk: the column buffer (CKK x images*HW) stays within the column budget, small
  // enough that the columns are still in cache when the GEMM packs them.
  int64_t chunk() const {
    return std::clamp<int64_t>(conv_settings().column_budget / std::max<int64_t>(CKK * HW, 1), 1,
                               N);
  }
  // Images per chunk of the backward-input: the columns and the FP32 image gradients col2im adds
  // them into (C x H x W an image: four times the columns of a 1x1 stride-2 convolution) each
  // within the budget.
  int64_t input_chunk() const {
    return std::min(
        chunk(),
        std::max<int64_t>(conv_settings().column_budget / std::max<int64_t>(C * H * W, 1), 1));
  }
};

// One group's convolution as the implicit paths and Winograd see it: the input zero-padded to
// (Hp, Wp), any stride and dilation.
struct ImplicitConv {
  int64_t N, C, H, W, O, KH, KW, pad_h, pad_w, dil_h, dil_w, sh, sw, Ho, Wo, Hp, Wp, plane;
  DType read_as = DType::f32;  // ConvGeometry::read_as: pad_images rounds an FP32 input to it
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
                     g.p.dilation_w, g.p.stride_h, g.p.stride_w) {
    read_as = g.read_as;
  }
  // The type an input of `stored` type is staged from: read_as where it rounds an FP32 input.
  DType staged(DType stored) const { return read_as != DType::f32 ? read_as : stored; }
  // Images per chunk: the padded input and the wide output (or gradient) within the budget
  // (staged_budget: a quarter of it when the staged operands are 16-bit).
  int64_t chunk(DType staged = DType::f32) const {
    return std::clamp<int64_t>(staged_budget(staged) / std::max<int64_t>((C + O) * plane, 1), 1, N);
  }
  // Output rows whose positions fill the GEMM's 16-column slivers exactly.
  bool dense() const { return sh > 1 || sw > 1 || Wo % 16 == 0 || Wo == 8 || Wo == 4; }
  // Dense, or at most 1.15x the multiply-adds in wide columns: above that (ResNet's 16x16 planes
  // pad to 1.27x) im2col, which batches images densely, is faster (docs/numerics.md).
  // Strided: only when the windows cover the input (a 1x1 stride-2 window would pad and copy
  // four times the pixels it reads; im2col copies only those).
  bool worthwhile() const {
    if (Ho < 1 || Wo < 1) return false;
    if (sh > 1 || sw > 1) return dil_h * (KH - 1) + 1 >= sh && dil_w * (KW - 1) + 1 >= sw;
    return dense() || (Ho * Wo >= 64 && 20 * plane <= 23 * Ho * Wo);
  }
};

// The backward-input of a stride-1 convolution as a forward one: dy (N, O, Ho, Wo) padded by
// dilation * (K - 1) - pad, convolved with the flipped, channel-swapped weights into C channels.
// Its padding is negative where g pads more than its kernel reaches (no such path then).
ImplicitConv flipped_conv(const ConvGeometry& g);

// The path table above, one function per direction (the operands' storage dtypes choose none).
ConvPath conv_forward_path(const ConvGeometry& g, Partials partials,
                           const ConvSettings& s = conv_settings());
ConvPath conv_backward_input_path(const ConvGeometry& g, Partials partials,
                                  const ConvSettings& s = conv_settings());
ConvPath conv_weight_grad_path(const ConvGeometry& g, Partials partials,
                               const ConvSettings& s = conv_settings());

// ---- The paths ----
// x, w, dy: contiguous; bias: O FP32 values (zeros where there is none), or empty for none.

// Direct (conv_direct.cc): x and w staged in FP32; the output row by row, all channels and taps
// per row.
Tensor direct_forward(const Tensor& x, const Tensor& w, const std::vector<float>& bias,
                      const ConvGeometry& g, DType out);
Tensor direct_weight_grad(const Tensor& dy, const Tensor& x, const Shape& w_shape,
                          const ConvGeometry& g, DType out);

// Weights as Winograd reads them: contiguous, stored in `dtype` (any float type), and with
// read_as f16 or bf16 FP32 weights rounded to that type as the filters are transformed (the
// values of their 16-bit copy, which is never made).
struct WinogradWeights {
  const void* data;
  DType dtype;
  DType read_as = DType::f32;
};

// Winograd F(2x2, 3x3) (conv_winograd.cc): y (N, O, H, W) = x (N, C, H, W) * w + bias, w
// (O, C, 3, 3); x and w in any float dtype; y charged to `cat`.
// flipped: w holds the weights (C, O, 3, 3) of the convolution whose backward-input this is, read
// with channels swapped and taps reversed (flipped_conv's filters, no copy made).
// out_block: output channels per block of transformed filters (0: as many as twice the weights'
// stored bytes or the column budget hold; any block size gives the same bits).
Tensor winograd_forward(const Tensor& x, const ImplicitConv& g, WinogradWeights w, bool flipped,
                        const std::vector<float>& bias, DType out, MemoryCategory cat,
                        int64_t out_block = 0);

// Winograd's weight gradient (conv_winograd.cc): dw (O, C, 3, 3) in `out` from dy (N, O, H, W) and
// x (N, C, H, W), any float dtypes, of a convolution that winograd_forward computes: the gradient
// of the transformed filters, dU[xi] (O, C) = sum over tiles of (A dy A^T)[xi] (B^T d B)[xi]
// (16 GEMMs over the tiles, one FP32 FMA chain per value), then G^T dU G, rounded once into out.
// out_block: output channels per block of dU (0: as many as the column budget holds);
// tile_batch: tiles per batch (0: about 4 MiB of transforms); neither changes a bit.
Tensor winograd_weight_grad(const Tensor& dy, const Tensor& x, const ImplicitConv& g, DType out,
                            int64_t out_block = 0, int64_t tile_batch = 0);

// Implicit GEMM (conv_implicit.cc): y (N, O, Ho, Wo) = x (N, C, H, W) * w + bias, w given as an
// (O, C*KH*KW) matrix in any float dtype, x in any float dtype (converted while padding); y
// charged to `cat`. by_rows: register-tiled FMA rows (fma_rows) instead of the GEMM (unit
// column stride, FP32 partials, at most 12 outputs).
Tensor implicit_forward(const Tensor& x, const ImplicitConv& g, ConstMatrix w,
                        const std::vector<float>& bias, DType out, Partials partials,
                        MemoryCategory cat, bool by_rows);
// Weight gradients of a one-group convolution that implicit fits: lane-split dot products over
// the padded chunks (stride 1, FP32 partials), or the GEMM over positions x taps.
Tensor implicit_weight_grad_dots(const Tensor& dy, const Tensor& x, const Shape& w_shape,
                                 const ConvGeometry& g, DType out);
Tensor implicit_weight_grad_gemm(const Tensor& dy, const Tensor& x, const Shape& w_shape,
                                 const ConvGeometry& g, DType out, Partials partials);

// im2col + GEMM (conv_im2col.cc): any geometry, group by group.
Tensor im2col_forward(const Tensor& x, const Tensor& w, const std::vector<float>& bias,
                      const ConvGeometry& g, DType out, Partials partials);
Tensor im2col_backward_input(const Tensor& dy, const Tensor& w, const Shape& x_shape,
                             const ConvGeometry& g, DType out, Partials partials);
Tensor im2col_weight_grad(const Tensor& dy, const Tensor& x, const Shape& w_shape,
                          const ConvGeometry& g, DType out, Partials partials);

// ---- Shared by the paths ----

// The output columns [lo, hi) whose input column ow * stride - pad + k lies in [0, W).
inline std::pair<int64_t, int64_t> valid_columns(int64_t Wo, int64_t W, int64_t stride, int64_t pad,
                                                 int64_t k) {
  const int64_t lo = std::min(Wo, pad > k ? (pad - k + stride - 1) / stride : int64_t{0});
  const int64_t last = W - 1 + pad - k;  // ow * stride <= last
  const int64_t hi = last < 0 ? lo : std::clamp<int64_t>(last / stride + 1, lo, Wo);
  return {lo, hi};
}

// A buffer of `elements` values of dtype t, charged as workspace (columns, gathered gradients,
// flipped weights in their storage dtype).
Tensor byte_workspace(int64_t elements, DType t);

// Images [n0, n0 + nb) of x into the zero-padded FP32 buffer (C, nb, Hp, Wp), an FP32 x rounded
// to g.read_as when that is 16-bit (conv_implicit.cc).
void pad_images(const Tensor& x, const ImplicitConv& g, int64_t n0, int64_t nb, float* xp);

// dy of group grp for images [n0, n0+nb) as a matrix (Og, nb*HW), in dy's dtype
// (conv_im2col.cc).
void gather_dy(const Tensor& dy, const ConvGeometry& g, int64_t grp, int64_t n0, int64_t nb,
               char* dst);

}  // namespace mantissa::kernels::detail

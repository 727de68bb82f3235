// The implicit-GEMM paths (conv_paths.h): one group, any stride whose windows cover the input.
// A chunk of nb images is copied once into a zero-padded FP32 buffer laid out channel-major
// across the images, (C, nb, Hp, Wp). Output position (img, oh, ow) is then column
// n = img * Hp*Wp + oh * Wp + ow of a "wide" output, and row k = (c, kh, kw) of the column matrix
// is the buffer itself shifted by off(k) = c * nb*Hp*Wp + kh*dil_h * Wp + kw*dil_w: the GEMM
// reads those rows in place (OffsetMatrix) instead of an im2col copy KH*KW times the image. The
// wide columns that are not output positions (ow >= Wo, or the padding rows between images) are
// computed and dropped: Hp*Wp / (Ho*Wo) times the multiply-adds, which ImplicitConv::worthwhile
// bounds. When the output rows are a multiple of 16 wide, or 8 or 4 wide, the columns are instead
// the output positions themselves ("dense": column n = (img, oh, ow) at img*Hp*Wp + oh*Wp + ow,
// listed to the GEMM as col_offset): a 16-column sliver is then one output row's 16 consecutive
// positions, read in place, or two rows of 8 or four rows of 4, packed in runs. Nothing is
// computed twice. Strided convolutions are always dense (column n at img*Hp*Wp + oh*sh*Wp +
// ow*sw): their slivers are packed column by column.
// With few output channels the forward skips the GEMM: register-tiled FMA rows (fma_rows, the
// GEMM's arithmetic) read the padded buffer in place. The weight gradient takes lane-split dot
// products (few output channels, stride 1) or the GEMM over positions x taps.
#include <algorithm>
#include <cstring>
#include <vector>

#include "mantissa/core/parallel.h"
#include "mantissa/kernels/conv_paths.h"
#include "mantissa/kernels/nn_internal.h"
#include "mantissa/kernels/vector_kernels.h"

namespace mantissa::kernels::detail {
namespace {

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

// off(k) for every tap k = (c, kh, kw) of a chunk of nb images.
void tap_offsets(const ImplicitConv& g, int64_t nb, std::vector<int64_t>& offset) {
  offset.resize(static_cast<size_t>(g.C * g.KH * g.KW));
  for (int64_t c = 0; c < g.C; ++c)
    for (int64_t kh = 0; kh < g.KH; ++kh)
      for (int64_t kw = 0; kw < g.KW; ++kw)
        offset[static_cast<size_t>((c * g.KH + kh) * g.KW + kw)] =
            c * nb * g.plane + kh * g.dil_h * g.Wp + kw * g.dil_w;
}

// The last wide column that is an output position, plus one. Reading row k up to it stays inside
// the padded buffer (the last tap of the last channel ends at its last element).
int64_t wide_columns(const ImplicitConv& g, int64_t nb) {
  return (nb - 1) * g.plane + (g.Ho - 1) * g.Wp + g.Wo;
}

// Floats of padded planes a task of pad_images writes (64 KiB: in a core's L2 while it fills them).
constexpr int64_t kPadTaskFloats = int64_t{1} << 14;
// Values a task of pad_images widens in one call (16 KiB of FP32: in L1 beside the planes).
constexpr int64_t kPadRunFloats = 4096;
// Planes of at least this many values with no side padding are widened in place, one call each.
constexpr int64_t kPadInPlaceFloats = 256;
// Planes of at most this many floats are zeroed whole before their rows are copied in.
constexpr int64_t kPadZeroFirstFloats = 400;

// n floats from src to dst: ResNet's rows (4 to 32 values) as fixed-size copies the compiler
// inlines.
void copy_row(const float* src, int64_t n, float* dst) {
  switch (n) {
    case 4:
      std::memcpy(dst, src, 4 * sizeof(float));
      return;
    case 8:
      std::memcpy(dst, src, 8 * sizeof(float));
      return;
    case 16:
      std::memcpy(dst, src, 16 * sizeof(float));
      return;
    case 32:
      std::memcpy(dst, src, 32 * sizeof(float));
      return;
    default:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  }
}
}  // namespace

void pad_images(const Tensor& x, const ImplicitConv& g, int64_t n0, int64_t nb, float* xp) {
  const int64_t cstride = nb * g.plane, es = esize(x.dtype()), HW = g.H * g.W;
  const bool f32 = x.dtype() == DType::f32;
  const bool round = f32 && g.read_as != DType::f32;  // the 16-bit copy's values
  // A task fills the planes of a block of channels, all nb images (consecutive in xp): for each
  // image it widens (or rounds) the block's values, consecutive in x, in one call and copies their
  // rows in. Calls per plane (of the conversion table, of memset) cost more than the copies on
  // ResNet's 4x4 to 32x32 planes.
  const int64_t cb = std::clamp<int64_t>(std::min(kPadTaskFloats / std::max<int64_t>(cstride, 1),
                                                  kPadRunFloats / std::max<int64_t>(HW, 1)),
                                         1, g.C);
  const int64_t tasks = (g.C + cb - 1) / cb;
  // Small planes are zeroed whole first (one memset a task), larger ones only at their borders.
  const bool zero_first = g.plane <= kPadZeroFirstFloats;
  // Rows without side padding hold a plane's values as one run: a large 16-bit plane (or FP32
  // plane read as 16-bit) is widened (rounded) straight into its place, one call a plane.
  const bool widen_in_place = g.pad_w == 0 && (!f32 || round) && HW >= kPadInPlaceFloats;
  parallel_for(static_cast<size_t>(tasks), 1, threads_for(g.C * cstride),
               [&](size_t t0, size_t t1) {
                 std::vector<float> widened(
                     (f32 && !round) || widen_in_place ? 0 : static_cast<size_t>(cb * HW));
                 for (size_t t = t0; t < t1; ++t) {
                   const int64_t c0 = static_cast<int64_t>(t) * cb, cn = std::min(cb, g.C - c0);
                   float* block = xp + c0 * cstride;
                   if (zero_first) std::fill(block, block + cn * cstride, 0.0f);
                   for (int64_t img = 0; img < nb; ++img) {
                     const char* src = bytes(x) + ((n0 + img) * g.C + c0) * HW * es;
                     const float* vals = reinterpret_cast<const float*>(src);
                     if ((!f32 || round) && !widen_in_place) {
                       load_f32(src, x.dtype(), 1, cn * HW, widened.data());
                       if (round) round_through(widened.data(), cn * HW, g.read_as);
                       vals = widened.data();
                     }
                     for (int64_t c = 0; c < cn; ++c) {
                       float* dst = block + c * cstride + img * g.plane;
                       if (!zero_first) {
                         std::fill(dst, dst + g.pad_h * g.Wp + g.pad_w, 0.0f);
                         std::fill(dst + (g.pad_h + g.H) * g.Wp - g.pad_w, dst + g.plane, 0.0f);
                       }
                       if (g.pad_w == 0) {  // the plane's rows as one run
                         float* in = dst + g.pad_h * g.Wp;
                         if (widen_in_place) {
                           load_f32(src + c * HW * es, x.dtype(), 1, HW, in);
                           if (round) round_through(in, HW, g.read_as);
                         } else {
                           std::copy_n(vals + c * HW, HW, in);
                         }
                         continue;
                       }
                       for (int64_t h = 0; h < g.H; ++h) {
                         float* row = dst + (g.pad_h + h) * g.Wp + g.pad_w;
                         copy_row(vals + c * HW + h * g.W, g.W, row);
                         // The right padding of this row and the left of the next.
                         if (!zero_first && h + 1 < g.H) std::fill(row + g.W, row + g.Wp, 0.0f);
                       }
                     }
                   }
                 }
               });
}

Tensor implicit_forward(const Tensor& x, const ImplicitConv& g, ConstMatrix w,
                        const std::vector<float>& bias, DType out, Partials partials,
                        MemoryCategory cat, bool by_rows) {
  Tensor y = Tensor::empty({g.N, g.O, g.Ho, g.Wo}, out, charged_to(cat));
  const int64_t CKK = g.C * g.KH * g.KW;
  // The register-tiled rows stage a 16-bit input within the smaller budget; the GEMM takes the
  // whole one (staged_budget).
  const int64_t nb_max = by_rows ? g.chunk(g.staged(x.dtype())) : g.chunk();
  Tensor xpad = f32_workspace({g.C * nb_max * g.plane});  // (C, nb, Hp, Wp)
  std::vector<int64_t> offset, position;
  const bool dense = g.dense();
  const int64_t HWo = g.Ho * g.Wo;
  // by_rows: few output channels along unit-stride rows (the tutorial CNN's conv2 and its
  // backward-input). The GEMM's 6 x 16 tiles would load each input value for at most two tiles,
  // after packing it; register-tiled rows read the padded buffer in place with the same
  // arithmetic.
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
      parallel_for(
          static_cast<size_t>(nb * g.Ho), 1, threads_for(nb * g.O * HWo * CKK),
          [&](size_t r0, size_t r1) {
            std::vector<const float*> xrow(static_cast<size_t>(CKK));
            for (size_t r = r0; r < r1; ++r) {
              const int64_t img = static_cast<int64_t>(r) / g.Ho,
                            oh = static_cast<int64_t>(r) % g.Ho;
              const float* start = xp + img * g.plane + oh * g.sh * g.Wp;  // the row's windows
              for (int64_t t = 0; t < CKK; ++t)
                xrow[static_cast<size_t>(t)] = start + offset[static_cast<size_t>(t)];
              const int64_t at = (n0 + img) * g.O * HWo + oh * g.Wo;  // channel 0's row in y
              fma_rows(bytes(y) + at * esize(out), out, HWo, g.O,
                       bias.empty() ? nullptr : bias.data(), w32.data(), CKK, xrow.data(), CKK,
                       g.Wo);
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
        static_cast<size_t>(nb * g.O), 1, threads_for(nb * g.O * HWo), [&](size_t r0, size_t r1) {
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

// dW (O, CKK) of a stride-1, one-group convolution (FP32 partials) from the padded image chunks:
// the wide gradient dYw (O, nb*Hp*Wp), zero at the columns that are not output positions, against
// the tap-shifted rows of the padded buffer, by lane-split dot products (vector_kernels.h) that
// read both in place. (A dropped column pairs a zero gradient with a real input value: an inf
// there makes the product NaN where the exact gradient would ignore it; an inf input reaches the
// real gradient through its valid positions anyway, unless every gradient there is zero.)
Tensor implicit_weight_grad_dots(const Tensor& dy, const Tensor& x, const Shape& w_shape,
                                 const ConvGeometry& cg, DType out) {
  const ImplicitConv g(cg);
  const int64_t CKK = cg.CKK, HWo = g.Ho * g.Wo;
  const int64_t nb_max = g.chunk(g.staged(x.dtype()));
  // A chunk's columns start at lane (n0 * plane) mod 8, behind that many zero columns: the lanes
  // take the columns of one call over every image, in the same order, whatever the chunk (a zero
  // gradient times a finite value adds +0 to a lane, which is never -0). The padded buffer has
  // kDotLanes zeros ahead of it for the first tap's leading columns to read.
  Tensor xbuf = f32_workspace({kDotLanes + g.C * nb_max * g.plane});   // zeros, (C, nb, Hp, Wp)
  Tensor dyw = f32_workspace({g.O * (kDotLanes + nb_max * g.plane)});  // (O, lead + nb * Hp * Wp)
  Tensor lanes = f32_workspace({g.O, CKK, kDotLanes});
  std::fill(lanes.data<float>(), lanes.data<float>() + lanes.numel(), 0.0f);
  float* xp = xbuf.data<float>() + kDotLanes;
  std::fill(xbuf.data<float>(), xp, 0.0f);
  std::vector<int64_t> offset;
  for (int64_t n0 = 0; n0 < g.N; n0 += nb_max) {
    const int64_t nb = std::min(nb_max, g.N - n0), lead = n0 * g.plane % kDotLanes,
                  Nw = lead + wide_columns(g, nb);
    float* dw = dyw.data<float>();
    pad_images(x, g, n0, nb, xp);
    tap_offsets(g, nb, offset);
    parallel_for(static_cast<size_t>(g.O), 1, threads_for(g.O * Nw), [&](size_t o0, size_t o1) {
      for (size_t o = o0; o < o1; ++o) {
        float* row = dw + static_cast<int64_t>(o) * Nw;
        std::fill(row, row + Nw, 0.0f);
        row += lead;
        for (int64_t img = 0; img < nb; ++img) {
          const char* src =
              bytes(dy) + (((n0 + img) * g.O + static_cast<int64_t>(o)) * HWo) * esize(dy.dtype());
          for (int64_t oh = 0; oh < g.Ho; ++oh)
            load_f32(src + oh * g.Wo * esize(dy.dtype()), dy.dtype(), 1, g.Wo,
                     row + img * g.plane + oh * g.Wp);
        }
      }
    });
    dot_lanes_accumulate(g.O, CKK, Nw, dw, Nw, xp - lead, offset.data(), lanes.data<float>(),
                         default_num_threads());
  }
  std::vector<float> total(static_cast<size_t>(g.O * CKK));
  for (size_t i = 0; i < total.size(); ++i)
    total[i] = dot_lanes_finish(lanes.data<float>() + i * kDotLanes);
  Tensor dwt = Tensor::empty(w_shape, out, charged_to(MemoryCategory::gradients));
  store_f32(total.data(), static_cast<int64_t>(total.size()), dwt.data_ptr(), out, 1);
  return dwt;
}

// dW (O, CKK) of a one-group convolution (any stride the implicit paths take) by GEMM without
// im2col: for a chunk of nb images, dW += dY (O, L) x X^T (L, CKK), where L = nb*Ho*Wo output
// positions and X^T(l, k) = xpad[position(l) + tap(k)] is listed to the GEMM by rows (positions)
// and columns (taps) and packed from the padded buffer. Chunks add into one FP32 dW in order (beta
// = 1), as the im2col path does; the GEMM splits the taps among threads, so the result does not
// depend on the thread count.
Tensor implicit_weight_grad_gemm(const Tensor& dy, const Tensor& x, const Shape& w_shape,
                                 const ConvGeometry& cg, DType out, Partials partials) {
  const ImplicitConv g(cg);
  const int64_t CKK = cg.CKK, HWo = g.Ho * g.Wo;
  const int64_t nb_max = std::clamp<int64_t>(
      staged_budget(g.staged(x.dtype())) / std::max<int64_t>(g.C * g.plane + g.O * HWo, 1), 1, g.N);
  Tensor xpad = f32_workspace({g.C * nb_max * g.plane});        // (C, nb, Hp, Wp)
  Tensor dyg = byte_workspace(g.O * nb_max * HWo, dy.dtype());  // (O, nb * Ho * Wo)
  // An FP32 gradient accumulates in place; another type's in an FP32 buffer, rounded once at the
  // end.
  Tensor dw32 = out == DType::f32
                    ? Tensor::empty(w_shape, DType::f32, charged_to(MemoryCategory::gradients))
                    : f32_workspace({g.O * CKK});
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
  if (out == DType::f32) return dw32;
  Tensor dw = Tensor::empty(w_shape, out, charged_to(MemoryCategory::gradients));
  convert(dw32.data_ptr(), DType::f32, dw.data_ptr(), out, static_cast<size_t>(dw.numel()));
  return dw;
}

// dW[o, c, kh, kw] = sum over images and output positions of dy * x: per image, 8 lane sums per

}  // namespace mantissa::kernels::detail

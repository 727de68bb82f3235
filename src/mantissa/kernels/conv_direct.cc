// The direct path (conv_paths.h) for small filter banks (the tutorial CNN's conv1: 5 x 1 x 3 x 3),
// where im2col and the GEMM spend their time copying and packing: register-tiled rows of every
// output channel read the taps' input rows in place (conv_rows, conv_wgrad_rows_f32 in
// vector_kernels.h). Groups 1, dilation 1, FP32 partials; 16-bit inputs are staged in FP32 (an FP32
// input read as 16-bit, ConvGeometry::read_as, rounded as it is staged).
#include <algorithm>
#include <vector>

#include "mantissa/core/parallel.h"
#include "mantissa/kernels/conv_paths.h"
#include "mantissa/kernels/nn_internal.h"
#include "mantissa/kernels/vector_kernels.h"

namespace mantissa::kernels::detail {
namespace {

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
// kernels walk the output row by row, all taps per row, so a row's sums stay in L1 (a whole plane
// per tap streams from L2); each output element still gets its taps in increasing t.
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

// dst[0, n) = src's values as their 16-bit copy (t) holds them, 4096 at a time (in L1).
void copy_rounded(const float* src, float* dst, int64_t n, DType t) {
  for (int64_t i = 0; i < n; i += 4096) {
    const int64_t m = std::min<int64_t>(4096, n - i);
    std::copy(src + i, src + i + m, dst + i);
    round_through(dst + i, m, t);
  }
}

// Image n of x (plane values of storage x.dtype()) in FP32: in place when FP32 and read as it is,
// else widened, or rounded as its 16-bit copy (read_as) holds it, into buf.
const float* image_f32(const Tensor& x, int64_t n, int64_t plane, DType read_as, float* buf) {
  const float* v = row_f32(bytes(x) + n * plane * esize(x.dtype()), x.dtype(), 1, plane, buf);
  if (read_as == DType::f32) return v;
  copy_rounded(v, buf, plane, read_as);
  return buf;
}

// Calls fn(a, b) for the ranges of output columns [a, b) that a row's tiled span [j0, j1) leaves
// out (the whole row [0, Wo) when the row is not tiled).
template <class Fn>
void untiled_columns(bool tiled, int64_t j0, int64_t j1, int64_t Wo, Fn&& fn) {
  if (!tiled) return fn(int64_t{0}, Wo);
  if (j0 > 0) fn(int64_t{0}, j0);
  if (j1 < Wo) fn(j1, Wo);
}

}  // namespace

Tensor direct_forward(const Tensor& x_in, const Tensor& w_in, const std::vector<float>& bias,
                      const ConvGeometry& g, DType out) {
  // A 16-bit input (or an FP32 one read as 16-bit: g.read_as) is widened one image at a time into
  // each thread's buffer as its rows reach the image (no whole-tensor FP32 copy).
  const Tensor x = x_in.contiguous();
  const bool x32 = x.dtype() == DType::f32 && g.read_as == DType::f32;  // read in place
  const Tensor w = w_in.to(DType::f32);
  const float* wd = w.data<float>();  // (O, CKK)
  Tensor y = Tensor::empty({g.N, g.O, g.Ho, g.Wo}, out, charged_to(MemoryCategory::activations));
  const int64_t sw = g.p.stride_w, plane = g.C * g.H * g.W;
  const std::vector<TapSpan> taps = tap_spans(g);
  const auto [j0, j1] = tiled_columns(g, taps);
  const bool f32_out = out == DType::f32;
  // One output row of every channel at a time: the columns every tap reads by the register-tiled
  // kernel, which stores them in y's type from its registers; the others (padding) tap by tap, in
  // place when y is FP32 and otherwise in an FP32 row rounded into y. Either way each element is
  // its bias plus its taps' products in increasing t, so the two agree bit for bit.
  parallel_for(
      static_cast<size_t>(g.N * g.Ho), 1, threads_for(g.N * g.O * g.HW * g.CKK),
      [&](size_t r0, size_t r1) {
        std::vector<float> edge(f32_out ? 0 : static_cast<size_t>(g.Wo));  // one channel's row
        std::vector<int64_t> tap(static_cast<size_t>(g.CKK));
        std::vector<const float*> xrow(static_cast<size_t>(g.CKK));
        std::vector<float> xbuf(x32 ? 0 : static_cast<size_t>(plane));  // (C, H, W) of an image
        int64_t widened = -1;                                           // the image in xbuf
        for (size_t r = r0; r < r1; ++r) {
          const int64_t n = static_cast<int64_t>(r) / g.Ho, oh = static_cast<int64_t>(r) % g.Ho;
          const float* xn = x32 ? x.data<float>() + n * plane : xbuf.data();
          if (!x32 && widened != n) {
            image_f32(x, n, plane, g.read_as, xbuf.data());
            widened = n;
          }
          const int64_t at = n * g.O * g.HW + oh * g.Wo;  // channel 0's row in y
          if (j0 < j1) {
            int64_t k = 0;
            for_each_row_tap(g, taps, oh, [&](int64_t t, int64_t lo, int64_t, int64_t xo) {
              tap[static_cast<size_t>(k)] = t;
              xrow[static_cast<size_t>(k++)] = xn + xo + (j0 - lo);
            });
            conv_rows(bytes(y) + (at + j0) * esize(out), out, g.HW, g.O, bias.data(), wd, g.CKK,
                      tap.data(), xrow.data(), k, j1 - j0);
          }
          for (int64_t o = 0; o < g.O; ++o) {
            float* row = f32_out ? y.data<float>() + at + o * g.HW : edge.data();
            const float* wo = wd + o * g.CKK;
            untiled_columns(j0 < j1, j0, j1, g.Wo, [&](int64_t a, int64_t b) {
              std::fill(row + a, row + b, bias[static_cast<size_t>(o)]);
              for_each_row_tap(g, taps, oh, [&](int64_t t, int64_t lo, int64_t cols, int64_t xo) {
                const int64_t s = std::max(a, lo), e = std::min(b, lo + cols);
                if (s < e) axpy_f32(row + s, xn + xo + (s - lo) * sw, sw, wo[t], e - s);
              });
              if (!f32_out)
                store_f32(row + a, b - a, bytes(y) + (at + o * g.HW + a) * esize(out), out, 1);
            });
          }
        }
      });
  return y;
}

// dW[o, c, kh, kw] = sum over images and output positions of dy * x: per image, 8 lane sums per
// (o, tap) plus the products the tiled rows leave out, added once; images are summed in order, so
// the result does not depend on the thread count.
Tensor direct_weight_grad(const Tensor& dy_in, const Tensor& x_in, const Shape& w_shape,
                          const ConvGeometry& g, DType out) {
  // 16-bit inputs are read into FP32 one image at a time (no whole-tensor FP32 copies).
  const Tensor x = x_in.contiguous(), dy = dy_in.contiguous();
  const int64_t taps = g.O * g.CKK, sw = g.p.stride_w, plane = g.C * g.H * g.W;
  const std::vector<TapSpan> tap_list = tap_spans(g);
  const auto [j0, j1] = tiled_columns(g, tap_list);
  std::vector<float> per_image(static_cast<size_t>(g.N * taps), 0.0f);  // (N, O, CKK)
  parallel_for(
      static_cast<size_t>(g.N), 1, threads_for(g.N * g.HW * taps), [&](size_t n0, size_t n1) {
        // Per image: 8 lane sums per (o, tap) for the rows where every tap reads the input, over
        // the columns where it does (conv_wgrad_rows_f32, the sums in registers); the other
        // products, one at a time in row order, into `rest`.
        std::vector<float> lanes(static_cast<size_t>(taps * kDotLanes)), rest(taps);
        std::vector<const float*> xrow(static_cast<size_t>(g.CKK));
        // (C, H, W) of one image, when 16-bit (or read as 16-bit: g.read_as); (O, kDyRows, Wo):
        // kDyRows output rows of every channel of a 16-bit dy, widened a block at a time (in L1,
        // where a whole image's would stream through L2: 5 x 126 x 126 floats for the tutorial
        // CNN's conv1).
        constexpr int64_t kDyRows = 8;
        const bool round = g.read_as != DType::f32;
        const bool dy32 = dy.dtype() == DType::f32;
        std::vector<float> xbuf(x.dtype() == DType::f32 && !round ? 0 : static_cast<size_t>(plane)),
            dyrows(dy32 ? 0 : static_cast<size_t>(g.O * kDyRows * g.Wo));
        for (size_t n = n0; n < n1; ++n) {
          const int64_t ni = static_cast<int64_t>(n);
          const float* xn = image_f32(x, ni, plane, g.read_as, xbuf.data());
          const char* dyn = bytes(dy) + ni * g.O * g.HW * esize(dy.dtype());
          std::fill(lanes.begin(), lanes.end(), 0.0f);
          std::fill(rest.begin(), rest.end(), 0.0f);
          for (int64_t oh = 0; oh < g.Ho; ++oh) {
            // Output row oh of channel o at dyo + o * ds.
            const float* dyo = nullptr;
            int64_t ds = g.HW;
            if (dy32) {
              dyo = reinterpret_cast<const float*>(dyn) + oh * g.Wo;
            } else {
              const int64_t block = oh % kDyRows, rows = std::min(kDyRows, g.Ho - (oh - block));
              if (block == 0)
                for (int64_t o = 0; o < g.O; ++o)
                  load_f32(dyn + (o * g.HW + oh * g.Wo) * esize(dy.dtype()), dy.dtype(), 1,
                           rows * g.Wo, dyrows.data() + o * kDyRows * g.Wo);
              dyo = dyrows.data() + block * g.Wo;
              ds = kDyRows * g.Wo;
            }
            int64_t valid = 0;
            for_each_row_tap(g, tap_list, oh, [&](int64_t t, int64_t lo, int64_t, int64_t xo) {
              xrow[static_cast<size_t>(t)] = xn + xo + (j0 - lo);
              ++valid;
            });
            const bool tiled = j0 < j1 && valid == g.CKK;
            if (tiled)
              conv_wgrad_rows_f32(lanes.data(), g.O, dyo + j0, ds, xrow.data(), g.CKK, j1 - j0);
            for (int64_t o = 0; o < g.O; ++o) {
              const float* d = dyo + o * ds;
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
            dw[i] = dot_lanes_finish(lanes.data() + i * kDotLanes) + rest[static_cast<size_t>(i)];
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

}  // namespace mantissa::kernels::detail

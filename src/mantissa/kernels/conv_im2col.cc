// The im2col path (conv_paths.h): any geometry, group by group. The forward copies each chunk's
// windows into a column matrix (CKK, images * Ho * Wo) in the input's own storage dtype (16-bit
// stays 16-bit; the GEMM converts while packing) and multiplies the weights by it; the
// backward-input multiplies W^T by dy into FP32 columns and adds them back into the image
// (col2im); the weight gradient multiplies dy by the columns' transpose, chunk after chunk.
#include <algorithm>
#include <cstring>
#include <vector>

#include "mantissa/core/parallel.h"
#include "mantissa/kernels/conv_paths.h"
#include "mantissa/kernels/nn_internal.h"
#include "mantissa/kernels/vector_kernels.h"

namespace mantissa::kernels::detail {
namespace {

// Image parts of a small weight gradient (see im2col_weight_grad).
constexpr int64_t kWeightGradParts = 4;

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
  parallel_for(static_cast<size_t>(g.CKK), 4, threads_for(g.CKK * L), [&](size_t r0, size_t r1) {
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
          const int64_t lo = std::clamp<int64_t>((-off + g.p.stride_w - 1) / g.p.stride_w, 0, g.Wo);
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
      static_cast<size_t>(g.Cg * nb), 1, threads_for(g.CKK * L), [&](size_t t0, size_t t1) {
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

}  // namespace

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

Tensor im2col_forward(const Tensor& x, const Tensor& w, const std::vector<float>& bias,
                      const ConvGeometry& g, DType out, Partials partials) {
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
          static_cast<size_t>(g.Og * nb), 1, threads_for(g.Og * L), [&](size_t r0, size_t r1) {
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

Tensor im2col_backward_input(const Tensor& dy, const Tensor& w, const Shape& x_shape,
                             const ConvGeometry& g, DType out, Partials partials) {
  Tensor dx = Tensor::empty(x_shape, out, charged_to(MemoryCategory::gradients));
  GemmOptions go;
  go.partials = partials;
  const int64_t chunk = g.input_chunk();
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

Tensor im2col_weight_grad(const Tensor& dy, const Tensor& x, const Shape& w_shape,
                          const ConvGeometry& g, DType out, Partials partials) {
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
      // An FP32 gradient is the first part's accumulator; another type's is rounded from it.
      Tensor dw32 = part == 0 && out == DType::f32
                        ? Tensor::empty(w_shape, DType::f32, charged_to(MemoryCategory::gradients))
                        : f32_workspace({g.O * g.CKK});
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
  if (out == DType::f32) return partial[0];
  Tensor dw = Tensor::empty(w_shape, out, charged_to(MemoryCategory::gradients));
  convert(total, DType::f32, dw.data_ptr(), out, static_cast<size_t>(dw.numel()));
  return dw;
}

}  // namespace mantissa::kernels::detail

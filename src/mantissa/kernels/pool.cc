// Pooling (pool.h): max pooling (2x2/2 by a vector row kernel reading and writing f32, f16 or bf16
// in place, any other window by the portable loop), and average and adaptive-average pooling
// through one window template.
#include "mantissa/kernels/pool.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "mantissa/core/parallel.h"
#include "mantissa/kernels/nn_internal.h"
#include "mantissa/kernels/vector_kernels.h"

namespace mantissa::kernels {

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
  parallel_for(
      static_cast<size_t>(planes), 1, threads_for(planes * plane_size), [&](size_t p0, size_t p1) {
        std::vector<float> buf;
        for (size_t pl = p0; pl < p1; ++pl) {
          const char* src = bytes(x) + static_cast<int64_t>(pl) * plane_size * esize(x.dtype());
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

// Offsets are packed into bytes up to this many window positions, in the fewest of 2, 4 or 8
// bits that hold them; larger windows take an i32 an output.
constexpr int64_t kByteOffsetsMax = 256;
int offset_bits(const Pool2dParams& p) {
  const int64_t positions = p.kernel_h * p.kernel_w;
  return positions <= 4 ? 2 : positions <= 16 ? 4 : positions <= kByteOffsetsMax ? 8 : 32;
}
// Bytes of one output row's packed offsets (each row starts a byte, so the planes' threads never
// share one).
int64_t offset_row_bytes(int64_t Wo, int bits) { return (Wo * bits + 7) / 8; }
// Output ow's offset in a row of packed offsets: bits (2, 4 or 8) at bit ow * bits of the row.
inline uint8_t packed_offset(const uint8_t* row, int64_t ow, int bits) {
  const int64_t bit = ow * bits;
  return static_cast<uint8_t>((row[bit / 8] >> (bit % 8)) & ((1u << bits) - 1));
}
// Sets it (the row starts zeroed).
inline void pack_offset(uint8_t* row, int64_t ow, int bits, uint8_t v) {
  const int64_t bit = ow * bits;
  row[bit / 8] = static_cast<uint8_t>(row[bit / 8] | (v << (bit % 8)));
}

// The common 2x2 window with stride 2 and no padding, every window inside the input (ceil mode
// on an odd size makes a last window of one row or column: the general loops). Each input element
// is then in at most one window.
bool two_by_two(const Pool2dParams& p, int64_t H, int64_t W, int64_t Ho, int64_t Wo) {
  return p.kernel_h == 2 && p.kernel_w == 2 && p.stride_h == 2 && p.stride_w == 2 && p.pad_h == 0 &&
         p.pad_w == 0 && 2 * Ho <= H && 2 * Wo <= W;
}
bool row_kernel_reads(DType t) { return t == DType::f32 || t == DType::f16 || t == DType::bf16; }

}  // namespace

std::pair<Tensor, Tensor> max_pool2d(const Tensor& x_in, const Pool2dParams& p, DType out) {
  require_float(x_in, "max_pool2d", "input");
  const Shape ys = pool2d_output_shape(x_in.shape(), p);
  const Tensor x = x_in.contiguous();
  const int64_t H = x.size(2), W = x.size(3), Ho = ys[2], Wo = ys[3];
  Tensor y = Tensor::empty(ys, out, charged_to(MemoryCategory::activations));
  const int bits = offset_bits(p);
  const int64_t row_bytes = offset_row_bytes(Wo, bits);
  // The 2x2 row path writes every byte of its rows; the window loop below sets bits in zeros.
  const bool rows2x2 =
      two_by_two(p, H, W, Ho, Wo) && row_kernel_reads(x.dtype()) && row_kernel_reads(out);
  const Shape packed_shape{ys[0], ys[1], Ho, row_bytes};
  Tensor offsets =
      bits == 32 ? Tensor::empty(ys, DType::i32, charged_to(MemoryCategory::activations))
      : rows2x2  ? Tensor::empty(packed_shape, DType::u8, charged_to(MemoryCategory::activations))
                 : Tensor::zeros(packed_shape, DType::u8, charged_to(MemoryCategory::activations));
  // 2x2 windows with stride 2 (two_by_two): the four candidates in window order, NaN propagating
  // from the first one found (as the general loop below does).
  if (rows2x2) {
    // The row kernel reads x and writes y in their own storage: a 16-bit plane is widened in
    // registers and its outputs rounded from them, with no FP32 copy of either plane.
    const int64_t planes = ys[0] * ys[1], sx = esize(x.dtype()), sy = esize(out);
    const char* xb = bytes(x);
    char* yb = bytes(y);
    uint8_t* ob = offsets.data<uint8_t>();
    parallel_for(
        static_cast<size_t>(planes), 1, threads_for(planes * H * W), [&](size_t p0, size_t p1) {
          for (int64_t pl = static_cast<int64_t>(p0); pl < static_cast<int64_t>(p1); ++pl)
            for (int64_t oh = 0; oh < Ho; ++oh)
              detail::max_pool_2x2_row(
                  xb + (pl * H + 2 * oh) * W * sx, xb + (pl * H + 2 * oh + 1) * W * sx, x.dtype(),
                  Wo, yb + (pl * Ho + oh) * Wo * sy, out, ob + (pl * Ho + oh) * row_bytes);
        });
    return {y, offsets};
  }
  // Any other window (or storage): the plane in FP32, the first NaN found propagating.
  for_each_plane(x, ys[0] * ys[1], H * W, [&](int64_t pl, const float* in) {
    OutPlane plane(y, pl, Ho * Wo);
    float* row = plane.data();
    for (int64_t oh = 0; oh < Ho; ++oh)
      for (int64_t ow = 0; ow < Wo; ++ow) {
        const int64_t h0 = oh * p.stride_h - p.pad_h, w0 = ow * p.stride_w - p.pad_w;
        float best = -INFINITY;
        int64_t at = -1;
        for (int64_t h = std::max<int64_t>(h0, 0); h < std::min(h0 + p.kernel_h, H); ++h)
          for (int64_t w = std::max<int64_t>(w0, 0); w < std::min(w0 + p.kernel_w, W); ++w) {
            const float v = in[h * W + w];
            if (at < 0 || v > best || std::isnan(v)) {
              best = v;
              at = (h - h0) * p.kernel_w + (w - w0);
              if (std::isnan(v)) goto done;  // NaN propagates, as in PyTorch
            }
          }
      done:
        row[oh * Wo + ow] = best;
        if (bits == 32)
          offsets.data<int32_t>()[pl * Ho * Wo + oh * Wo + ow] = static_cast<int32_t>(at);
        else
          pack_offset(offsets.data<uint8_t>() + (pl * Ho + oh) * row_bytes, ow, bits,
                      static_cast<uint8_t>(at));
      }
    plane.flush();
  });
  return {y, offsets};
}

int64_t max_pool2d_argmax(const Tensor& offsets, const Shape& x_shape, const Pool2dParams& p,
                          int64_t i) {
  const Shape ys = pool2d_output_shape(x_shape, p);
  const int64_t Ho = ys[2], Wo = ys[3], W = x_shape[3];
  const int bits = offset_bits(p);
  const int64_t oh = i / Wo % Ho, ow = i % Wo,
                at = bits == 32 ? offsets.data<int32_t>()[i]
                                : packed_offset(offsets.data<uint8_t>() +
                                                    (i / Wo) * offset_row_bytes(Wo, bits),
                                                ow, bits);
  return (oh * p.stride_h - p.pad_h + at / p.kernel_w) * W + ow * p.stride_w - p.pad_w +
         at % p.kernel_w;
}

Tensor max_pool2d_backward(const Tensor& dy_in, const Tensor& offsets, const Shape& x_shape,
                           const Pool2dParams& p, DType out) {
  const Tensor dy = dy_in.contiguous();
  const int64_t planes = x_shape[0] * x_shape[1], W = x_shape[3], HW = x_shape[2] * W,
                Ho = dy.size(2), Wo = dy.size(3), OHW = Ho * Wo;
  const int bits = offset_bits(p);
  const int64_t row_bytes = offset_row_bytes(Wo, bits);
  MANTISSA_ASSERT(offsets.dtype() == (bits == 32 ? DType::i32 : DType::u8) &&
                      offsets.numel() == planes * Ho * (bits == 32 ? Wo : row_bytes),
                  "max_pool2d_backward: offsets are not max_pool2d's for these parameters");
  Tensor dx = Tensor::empty(x_shape, out, charged_to(MemoryCategory::gradients));
  if (two_by_two(p, x_shape[2], W, Ho, Wo) && row_kernel_reads(dy.dtype()) &&
      row_kernel_reads(out) && detail::has_max_pool_2x2_backward_row()) {
    // Each input element is in at most one window: the row kernel writes every element of a row
    // pair once, in dx's type (no plane to clear, scatter into and convert); the columns right of
    // the last window (an odd W) and the rows below the last pair (an odd H) are +0, all-zero
    // bits in f32, f16 and bf16 alike.
    const int64_t H = x_shape[2], sg = esize(dy.dtype()), sx = esize(out);
    const uint8_t* ob = offsets.data<uint8_t>();
    parallel_for(
        static_cast<size_t>(planes), 1, threads_for(planes * HW), [&](size_t p0, size_t p1) {
          for (int64_t pl = static_cast<int64_t>(p0); pl < static_cast<int64_t>(p1); ++pl) {
            char* dxp = bytes(dx) + pl * HW * sx;
            for (int64_t oh = 0; oh < Ho; ++oh) {
              char* r0 = dxp + 2 * oh * W * sx;
              detail::max_pool_2x2_backward_row(bytes(dy) + (pl * OHW + oh * Wo) * sg, dy.dtype(),
                                                ob + (pl * Ho + oh) * row_bytes, Wo, r0,
                                                r0 + W * sx, out);
              if (2 * Wo < W) {
                const size_t rest = static_cast<size_t>((W - 2 * Wo) * sx);
                std::memset(r0 + 2 * Wo * sx, 0, rest);
                std::memset(r0 + (W + 2 * Wo) * sx, 0, rest);
              }
            }
            std::memset(dxp + 2 * Ho * W * sx, 0, static_cast<size_t>((H - 2 * Ho) * W * sx));
          }
        });
    return dx;
  }
  // An offset's place relative to its window's corner in the plane, looked up (no division per
  // output).
  std::vector<int64_t> delta(static_cast<size_t>(p.kernel_h * p.kernel_w));
  for (int64_t a = 0; a < p.kernel_h * p.kernel_w; ++a)
    delta[static_cast<size_t>(a)] = a / p.kernel_w * W + a % p.kernel_w;
  for_each_plane(dy, planes, OHW, [&](int64_t pl, const float* g) {
    OutPlane plane(dx, pl, HW);
    float* acc = plane.data();
    std::fill(acc, acc + HW, 0.0f);
    for (int64_t oh = 0, i = 0; oh < Ho; ++oh) {
      const int64_t row = (oh * p.stride_h - p.pad_h) * W - p.pad_w;
      const uint8_t* packed =
          bits == 32 ? nullptr : offsets.data<uint8_t>() + (pl * Ho + oh) * row_bytes;
      const int32_t* wide = bits == 32 ? offsets.data<int32_t>() + (pl * Ho + oh) * Wo : nullptr;
      for (int64_t ow = 0; ow < Wo; ++ow, ++i) {
        const int64_t at = wide ? wide[ow] : packed_offset(packed, ow, bits);
        acc[row + ow * p.stride_w + delta[static_cast<size_t>(at)]] += g[i];
      }
    }
    plane.flush();
  });
  return dx;
}

namespace {

// One window of an average pooling: input rows [h0, h1) and columns [w0, w1), and how its sum
// becomes the average: times `factor` (avg_pool2d: 1 / count) or divided by it (adaptive
// pooling: the count).
struct AvgWindow {
  int64_t h0, h1, w0, w1;
  float factor;
  bool divide;
  float average(float sum) const { return divide ? sum / factor : sum * factor; }
};

// avg_pool2d's window of output (oh, ow) and its divisor, as PyTorch's avg_pool2d defines them.
AvgWindow avg_window(const Pool2dParams& p, int64_t H, int64_t W, int64_t oh, int64_t ow) {
  int64_t h0 = oh * p.stride_h - p.pad_h, w0 = ow * p.stride_w - p.pad_w;
  int64_t h1 = std::min(h0 + p.kernel_h, H + p.pad_h), w1 = std::min(w0 + p.kernel_w, W + p.pad_w);
  const int64_t padded = (h1 - h0) * (w1 - w0);
  h0 = std::max<int64_t>(h0, 0), w0 = std::max<int64_t>(w0, 0), h1 = std::min(h1, H),
  w1 = std::min(w1, W);
  const int64_t count = p.count_include_pad ? padded : (h1 - h0) * (w1 - w0);
  return {h0, h1, w0, w1, 1.0f / static_cast<float>(std::max<int64_t>(count, 1)), false};
}

// Input rows [begin, end) averaged into output row o of n (PyTorch: floor(o*in/n),
// ceil((o+1)*in/n)).
std::pair<int64_t, int64_t> adaptive_range(int64_t o, int64_t in, int64_t n) {
  return {o * in / n, ((o + 1) * in + n - 1) / n};
}

// adaptive_avg_pool2d's window of output (oh, ow) of (Ho, Wo) over an H x W input.
AvgWindow adaptive_window(int64_t H, int64_t W, int64_t Ho, int64_t Wo, int64_t oh, int64_t ow) {
  const auto [h0, h1] = adaptive_range(oh, H, Ho);
  const auto [w0, w1] = adaptive_range(ow, W, Wo);
  return {h0, h1, w0, w1, static_cast<float>((h1 - h0) * (w1 - w0)), true};
}

// y (N, C, Ho, Wo) = ys: each output the average of its window (window(oh, ow), an AvgWindow) of
// a contiguous x, the window summed in FP32 row by row.
template <class WindowAt>
Tensor average_pool(const Tensor& x, const Shape& ys, DType out, WindowAt&& window) {
  const int64_t H = x.size(2), W = x.size(3), Ho = ys[2], Wo = ys[3];
  Tensor y = Tensor::empty(ys, out, charged_to(MemoryCategory::activations));
  for_each_plane(x, ys[0] * ys[1], H * W, [&](int64_t pl, const float* in) {
    OutPlane plane(y, pl, Ho * Wo);
    float* row = plane.data();
    for (int64_t oh = 0; oh < Ho; ++oh)
      for (int64_t ow = 0; ow < Wo; ++ow) {
        const AvgWindow win = window(oh, ow);
        float s = 0.0f;
        for (int64_t h = win.h0; h < win.h1; ++h)
          for (int64_t w = win.w0; w < win.w1; ++w) s += in[h * W + w];
        row[oh * Wo + ow] = win.average(s);
      }
    plane.flush();
  });
  return y;
}

// dx (x_shape) of average_pool: each output's gradient, averaged as its window's sum was, added
// to every input of the window (outputs in order).
template <class WindowAt>
Tensor average_pool_backward(const Tensor& dy_in, const Shape& x_shape, DType out,
                             WindowAt&& window) {
  const Tensor dy = dy_in.contiguous();
  const int64_t H = x_shape[2], W = x_shape[3], Ho = dy.size(2), Wo = dy.size(3);
  Tensor dx = Tensor::empty(x_shape, out, charged_to(MemoryCategory::gradients));
  for_each_plane(dy, x_shape[0] * x_shape[1], Ho * Wo, [&](int64_t pl, const float* g) {
    OutPlane plane(dx, pl, H * W);
    float* acc = plane.data();
    std::fill(acc, acc + H * W, 0.0f);
    for (int64_t oh = 0; oh < Ho; ++oh)
      for (int64_t ow = 0; ow < Wo; ++ow) {
        const AvgWindow win = window(oh, ow);
        const float v = win.average(g[oh * Wo + ow]);
        for (int64_t h = win.h0; h < win.h1; ++h)
          for (int64_t w = win.w0; w < win.w1; ++w) acc[h * W + w] += v;
      }
    plane.flush();
  });
  return dx;
}

}  // namespace

Tensor avg_pool2d(const Tensor& x_in, const Pool2dParams& p, DType out) {
  require_float(x_in, "avg_pool2d", "input");
  const Shape ys = pool2d_output_shape(x_in.shape(), p);
  const Tensor x = x_in.contiguous();
  const int64_t H = x.size(2), W = x.size(3);
  return average_pool(x, ys, out,
                      [&](int64_t oh, int64_t ow) { return avg_window(p, H, W, oh, ow); });
}

Tensor avg_pool2d_backward(const Tensor& dy, const Shape& x_shape, const Pool2dParams& p,
                           DType out) {
  const int64_t H = x_shape[2], W = x_shape[3];
  return average_pool_backward(dy, x_shape, out,
                               [&](int64_t oh, int64_t ow) { return avg_window(p, H, W, oh, ow); });
}

Tensor adaptive_avg_pool2d(const Tensor& x_in, int64_t out_h, int64_t out_w, DType out) {
  require_float(x_in, "adaptive_avg_pool2d", "input");
  require_rank(x_in, 4, "adaptive_avg_pool2d", "input");
  MANTISSA_CHECK(out_h >= 1 && out_w >= 1, "adaptive_avg_pool2d: output size must be >= 1",
                 "pass a positive size");
  const Tensor x = x_in.contiguous();
  const int64_t H = x.size(2), W = x.size(3);
  return average_pool(x, {x.size(0), x.size(1), out_h, out_w}, out, [&](int64_t oh, int64_t ow) {
    return adaptive_window(H, W, out_h, out_w, oh, ow);
  });
}

Tensor adaptive_avg_pool2d_backward(const Tensor& dy, const Shape& x_shape, DType out) {
  const int64_t H = x_shape[2], W = x_shape[3], Ho = dy.size(2), Wo = dy.size(3);
  return average_pool_backward(dy, x_shape, out, [&](int64_t oh, int64_t ow) {
    return adaptive_window(H, W, Ho, Wo, oh, ow);
  });
}

}  // namespace mantissa::kernels

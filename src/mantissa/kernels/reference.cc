#include "mantissa/kernels/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "mantissa/core/convert.h"
#include "mantissa/core/philox.h"

namespace mantissa::reference {

namespace {
int64_t count(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}
// Row-major strides.
Shape strides_of(const Shape& s) {
  Shape st(s.size(), 1);
  for (int64_t i = static_cast<int64_t>(s.size()) - 2; i >= 0; --i) st[i] = st[i + 1] * s[i + 1];
  return st;
}
// Multi-index of flat index i.
std::vector<int64_t> unravel(int64_t i, const Shape& s) {
  std::vector<int64_t> idx(s.size());
  for (int64_t d = static_cast<int64_t>(s.size()) - 1; d >= 0; --d) {
    idx[d] = i % s[d];
    i /= s[d];
  }
  return idx;
}
}  // namespace

Array zeros(const Shape& shape) {
  return {shape, std::vector<double>(static_cast<size_t>(count(shape)), 0.0)};
}

Array from_tensor(const Tensor& t) {
  Array a{t.shape(), std::vector<double>(static_cast<size_t>(t.numel()))};
  const Tensor c = t.contiguous();
  if (!a.v.empty()) convert(c.data_ptr(), c.dtype(), a.v.data(), DType::f64, a.v.size());
  return a;
}

Array matmul(const Array& a, const Array& b) {
  const int64_t M = a.shape[a.shape.size() - 2], K = a.shape.back(), N = b.shape.back();
  const int64_t batches = count(a.shape) / (M * K);
  const bool bb = b.shape.size() > 2;
  Shape s(a.shape.begin(), a.shape.end() - 1);
  s.push_back(N);
  Array y = zeros(s);
  for (int64_t q = 0; q < batches; ++q)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0;
        for (int64_t k = 0; k < K; ++k)
          acc += a.v[(q * M + m) * K + k] * b.v[((bb ? q : 0) * K + k) * N + n];
        y.v[(q * M + m) * N + n] = acc;
      }
  return y;
}

Array linear(const Array& x, const Array& w, const Array* b) {
  const int64_t in = w.shape[1], out = w.shape[0], rows = x.numel() / in;
  Shape s = x.shape;
  s.back() = out;
  Array y = zeros(s);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double acc = b ? b->v[o] : 0.0;
      for (int64_t i = 0; i < in; ++i) acc += x.v[r * in + i] * w.v[o * in + i];
      y.v[r * out + o] = acc;
    }
  return y;
}

Array conv2d(const Array& x, const Array& w, const Array* b, const kernels::Conv2dParams& p) {
  const Shape ys = kernels::conv2d_output_shape(x.shape, w.shape, p);
  const int64_t N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3];
  const int64_t O = w.shape[0], Cg = w.shape[1], KH = w.shape[2], KW = w.shape[3],
                Og = O / p.groups;
  Array y = zeros(ys);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o)
      for (int64_t oh = 0; oh < ys[2]; ++oh)
        for (int64_t ow = 0; ow < ys[3]; ++ow) {
          double acc = b ? b->v[o] : 0.0;
          const int64_t g = o / Og;
          for (int64_t c = 0; c < Cg; ++c)
            for (int64_t ki = 0; ki < KH; ++ki)
              for (int64_t kj = 0; kj < KW; ++kj) {
                const int64_t ih = oh * p.stride_h - p.pad_h + ki * p.dilation_h;
                const int64_t iw = ow * p.stride_w - p.pad_w + kj * p.dilation_w;
                if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                acc += x.v[((n * C + g * Cg + c) * H + ih) * W + iw] *
                       w.v[((o * Cg + c) * KH + ki) * KW + kj];
              }
          y.v[((n * O + o) * ys[2] + oh) * ys[3] + ow] = acc;
        }
  return y;
}

Array max_pool2d(const Array& x, const kernels::Pool2dParams& p) {
  const Shape ys = kernels::pool2d_output_shape(x.shape, p);
  const int64_t H = x.shape[2], W = x.shape[3];
  Array y = zeros(ys);
  for (int64_t pl = 0; pl < ys[0] * ys[1]; ++pl)
    for (int64_t oh = 0; oh < ys[2]; ++oh)
      for (int64_t ow = 0; ow < ys[3]; ++ow) {
        double best = -std::numeric_limits<double>::infinity();
        for (int64_t i = 0; i < p.kernel_h; ++i)
          for (int64_t j = 0; j < p.kernel_w; ++j) {
            const int64_t h = oh * p.stride_h - p.pad_h + i, w = ow * p.stride_w - p.pad_w + j;
            if (h >= 0 && h < H && w >= 0 && w < W)
              best = std::max(best, x.v[(pl * H + h) * W + w]);
          }
        y.v[(pl * ys[2] + oh) * ys[3] + ow] = best;
      }
  return y;
}

Array avg_pool2d(const Array& x, const kernels::Pool2dParams& p) {
  const Shape ys = kernels::pool2d_output_shape(x.shape, p);
  const int64_t H = x.shape[2], W = x.shape[3];
  Array y = zeros(ys);
  for (int64_t pl = 0; pl < ys[0] * ys[1]; ++pl)
    for (int64_t oh = 0; oh < ys[2]; ++oh)
      for (int64_t ow = 0; ow < ys[3]; ++ow) {
        double s = 0;
        int64_t valid = 0, padded = 0;
        for (int64_t i = 0; i < p.kernel_h; ++i)
          for (int64_t j = 0; j < p.kernel_w; ++j) {
            const int64_t h = oh * p.stride_h - p.pad_h + i, w = ow * p.stride_w - p.pad_w + j;
            // Positions in the padded input count toward the divisor; beyond it they do not.
            if (h < H + p.pad_h && w < W + p.pad_w) ++padded;
            if (h >= 0 && h < H && w >= 0 && w < W) {
              s += x.v[(pl * H + h) * W + w];
              ++valid;
            }
          }
        y.v[(pl * ys[2] + oh) * ys[3] + ow] =
            s / static_cast<double>(p.count_include_pad ? padded : valid);
      }
  return y;
}

Array adaptive_avg_pool2d(const Array& x, int64_t oh_n, int64_t ow_n) {
  const int64_t H = x.shape[2], W = x.shape[3];
  Array y = zeros({x.shape[0], x.shape[1], oh_n, ow_n});
  for (int64_t pl = 0; pl < x.shape[0] * x.shape[1]; ++pl)
    for (int64_t oh = 0; oh < oh_n; ++oh)
      for (int64_t ow = 0; ow < ow_n; ++ow) {
        const int64_t h0 = static_cast<int64_t>(std::floor(static_cast<double>(oh * H) / oh_n));
        const int64_t h1 =
            static_cast<int64_t>(std::ceil(static_cast<double>((oh + 1) * H) / oh_n));
        const int64_t w0 = static_cast<int64_t>(std::floor(static_cast<double>(ow * W) / ow_n));
        const int64_t w1 =
            static_cast<int64_t>(std::ceil(static_cast<double>((ow + 1) * W) / ow_n));
        double s = 0;
        for (int64_t h = h0; h < h1; ++h)
          for (int64_t w = w0; w < w1; ++w) s += x.v[(pl * H + h) * W + w];
        y.v[(pl * oh_n + oh) * ow_n + ow] = s / static_cast<double>((h1 - h0) * (w1 - w0));
      }
  return y;
}

Array unary(Unary op, const Array& x) {
  Array y = x;
  for (double& v : y.v) {
    switch (op) {
      case Unary::kRelu:
        v = v > 0 || std::isnan(v) ? v : 0;
        break;
      case Unary::kGelu:
        v = 0.5 * v * (1 + std::erf(v / std::sqrt(2.0)));
        break;
      case Unary::kSigmoid:
        v = 1 / (1 + std::exp(-v));
        break;
      case Unary::kTanh:
        v = std::tanh(v);
        break;
    }
  }
  return y;
}

Array binary(Binary op, const Array& a, const Array& b) {
  const size_t n = std::max(a.shape.size(), b.shape.size());
  Shape s(n);
  auto dim = [&](const Shape& sh, size_t i) {
    return i < n - sh.size() ? int64_t{1} : sh[i - (n - sh.size())];
  };
  for (size_t i = 0; i < n; ++i) s[i] = std::max(dim(a.shape, i), dim(b.shape, i));
  Array y = zeros(s);
  const Shape sa = strides_of(a.shape), sb = strides_of(b.shape);
  for (int64_t i = 0; i < y.numel(); ++i) {
    const std::vector<int64_t> idx = unravel(i, s);
    int64_t ia = 0, ib = 0;
    for (size_t d = 0; d < n; ++d) {
      if (d >= n - a.shape.size() && dim(a.shape, d) != 1)
        ia += idx[d] * sa[d - (n - a.shape.size())];
      if (d >= n - b.shape.size() && dim(b.shape, d) != 1)
        ib += idx[d] * sb[d - (n - b.shape.size())];
    }
    const double va = a.v[ia], vb = b.v[ib];
    y.v[i] = op == Binary::kAdd   ? va + vb
             : op == Binary::kSub ? va - vb
             : op == Binary::kMul ? va * vb
                                  : va / vb;
  }
  return y;
}

Array scalar(Binary op, const Array& a, double s) { return binary(op, a, Array{{}, {s}}); }

namespace {
// Normalizes groups of elements: group_of(e) gives each element's statistics group; affine index
// channel_of(e).
template <typename GroupOf, typename ChannelOf>
Array normalize(const Array& x, int64_t groups, GroupOf group_of, ChannelOf channel_of,
                const Array* w, const Array* b, double eps,
                const std::vector<double>* fixed_mean = nullptr,
                const std::vector<double>* fixed_var = nullptr) {
  std::vector<double> mean(static_cast<size_t>(groups), 0), var(static_cast<size_t>(groups), 0),
      cnt(static_cast<size_t>(groups), 0);
  for (int64_t e = 0; e < x.numel(); ++e) mean[group_of(e)] += x.v[e], cnt[group_of(e)] += 1;
  for (int64_t g = 0; g < groups; ++g) mean[g] /= cnt[g];
  for (int64_t e = 0; e < x.numel(); ++e)
    var[group_of(e)] += (x.v[e] - mean[group_of(e)]) * (x.v[e] - mean[group_of(e)]);
  for (int64_t g = 0; g < groups; ++g) var[g] /= cnt[g];
  if (fixed_mean) mean = *fixed_mean, var = *fixed_var;
  Array y = x;
  for (int64_t e = 0; e < x.numel(); ++e) {
    const int64_t g = group_of(e);
    double v = (x.v[e] - mean[g]) / std::sqrt(var[g] + eps);
    if (w) v = v * w->v[channel_of(e)] + b->v[channel_of(e)];
    y.v[e] = v;
  }
  return y;
}
}  // namespace

Array batch_norm(const Array& x, const Array* w, const Array* b, const Array* rm, const Array* rv,
                 bool training, double eps) {
  const int64_t C = x.shape[1], inner = x.numel() / (x.shape[0] * C);
  auto channel = [&](int64_t e) { return (e / inner) % C; };
  if (training) return normalize(x, C, channel, channel, w, b, eps);
  return normalize(x, C, channel, channel, w, b, eps, &rm->v, &rv->v);
}

Array group_norm(const Array& x, int64_t groups, const Array* w, const Array* b, double eps) {
  const int64_t N = x.shape[0], C = x.shape[1], spatial = x.numel() / (N * C);
  return normalize(
      x, N * groups,
      [&](int64_t e) { return (e / spatial / C) * groups + ((e / spatial) % C) / (C / groups); },
      [&](int64_t e) { return (e / spatial) % C; }, w, b, eps);
}

Array layer_norm(const Array& x, int64_t normalized_dims, const Array* w, const Array* b,
                 double eps) {
  int64_t D = 1;
  for (size_t d = x.shape.size() - static_cast<size_t>(normalized_dims); d < x.shape.size(); ++d)
    D *= x.shape[d];
  return normalize(
      x, x.numel() / D, [&](int64_t e) { return e / D; }, [&](int64_t e) { return e % D; }, w, b,
      eps);
}

Array dropout(const Array& x, double p, uint64_t seed, uint64_t stream) {
  Array y = x;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double u =
        static_cast<double>(philox_bits(seed, stream, static_cast<uint64_t>(i))) / 4294967296.0;
    y.v[i] = u < p ? 0.0 : x.v[i] / (1.0 - p);
  }
  return y;
}

Array transpose(const Array& x, int64_t d0, int64_t d1) {
  const int64_t r = static_cast<int64_t>(x.shape.size());
  if (d0 < 0) d0 += r;
  if (d1 < 0) d1 += r;
  Shape s = x.shape;
  std::swap(s[d0], s[d1]);
  Array y = zeros(s);
  const Shape xs = strides_of(x.shape);
  for (int64_t i = 0; i < y.numel(); ++i) {
    std::vector<int64_t> idx = unravel(i, s);
    std::swap(idx[d0], idx[d1]);
    int64_t j = 0;
    for (int64_t d = 0; d < r; ++d) j += idx[d] * xs[d];
    y.v[i] = x.v[j];
  }
  return y;
}

Array cat(const std::vector<Array>& xs, int64_t dim) {
  const int64_t r = static_cast<int64_t>(xs[0].shape.size());
  if (dim < 0) dim += r;
  Shape s = xs[0].shape;
  s[dim] = 0;
  for (const Array& a : xs) s[dim] += a.shape[dim];
  Array y = zeros(s);
  for (int64_t i = 0; i < y.numel(); ++i) {
    std::vector<int64_t> idx = unravel(i, s);
    size_t k = 0;
    while (idx[dim] >= xs[k].shape[dim]) idx[dim] -= xs[k++].shape[dim];
    const Shape st = strides_of(xs[k].shape);
    int64_t j = 0;
    for (int64_t d = 0; d < r; ++d) j += idx[d] * st[d];
    y.v[i] = xs[k].v[j];
  }
  return y;
}

Array sum(const Array& x, const std::vector<int64_t>& dims, bool keepdim) {
  const int64_t r = static_cast<int64_t>(x.shape.size());
  std::vector<bool> red(static_cast<size_t>(r), dims.empty());
  for (int64_t d : dims) red[d < 0 ? d + r : d] = true;
  Shape kept = x.shape;
  for (int64_t d = 0; d < r; ++d)
    if (red[d]) kept[d] = 1;
  Array y = zeros(kept);
  const Shape ks = strides_of(kept);
  for (int64_t i = 0; i < x.numel(); ++i) {
    const std::vector<int64_t> idx = unravel(i, x.shape);
    int64_t j = 0;
    for (int64_t d = 0; d < r; ++d) j += (red[d] ? 0 : idx[d]) * ks[d];
    y.v[j] += x.v[i];
  }
  if (!keepdim) {
    Shape s;
    for (int64_t d = 0; d < r; ++d)
      if (!red[d]) s.push_back(kept[d]);
    y.shape = s;
  }
  return y;
}

Array softmax(const Array& x, int64_t dim, bool log) {
  const int64_t r = static_cast<int64_t>(x.shape.size());
  if (dim < 0) dim += r;
  const Shape st = strides_of(x.shape);
  Array y = x;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const std::vector<int64_t> idx = unravel(i, x.shape);
    if (idx[dim] != 0) continue;  // each line once, from its first element
    double mx = -std::numeric_limits<double>::infinity(), s = 0;
    for (int64_t k = 0; k < x.shape[dim]; ++k) mx = std::max(mx, x.v[i + k * st[dim]]);
    for (int64_t k = 0; k < x.shape[dim]; ++k) s += std::exp(x.v[i + k * st[dim]] - mx);
    for (int64_t k = 0; k < x.shape[dim]; ++k) {
      const double z = x.v[i + k * st[dim]] - mx;
      y.v[i + k * st[dim]] = log ? z - std::log(s) : std::exp(z) / s;
    }
  }
  return y;
}

Array nll_loss(const Array& lp, const Array& target, int64_t ignore_index) {
  const int64_t N = lp.shape[0], C = lp.shape[1];
  double total = 0;
  int64_t n = 0;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = static_cast<int64_t>(target.v[i]);
    if (t == ignore_index) continue;
    total -= lp.v[i * C + t];
    ++n;
  }
  return {{}, {total / static_cast<double>(n)}};
}

Array cross_entropy(const Array& logits, const Array& target, double smoothing,
                    int64_t ignore_index) {
  const Array lp = softmax(logits, 1, true);
  const int64_t N = logits.shape[0], C = logits.shape[1];
  double total = 0;
  int64_t n = 0;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = static_cast<int64_t>(target.v[i]);
    if (t == ignore_index) continue;
    for (int64_t c = 0; c < C; ++c) {
      const double q = (c == t ? 1.0 - smoothing : 0.0) + smoothing / static_cast<double>(C);
      total -= q * lp.v[i * C + c];
    }
    ++n;
  }
  return {{}, {total / static_cast<double>(n)}};
}

}  // namespace mantissa::reference

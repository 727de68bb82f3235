// Batch, group and layer normalization (norm.h): one engine over x viewed as (outer, groups,
// inner), statistics in FP64 across chunks, rows of 16-bit tensors converted one at a time.
#include "mantissa/kernels/norm.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

#include "mantissa/core/parallel.h"
#include "mantissa/kernels/nn_internal.h"
#include "mantissa/kernels/vector_kernels.h"

namespace mantissa::kernels {

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

// Sum of p[i], or with `squares` of (p[i] - mu)^2, over n floats: 8 float lanes within chunks of
// 4096 (detail::norm_stat_sums8, the rest into lane 0), each chunk's lanes added in a fixed tree,
// the chunks added in FP64.
double lane_sum(const float* p, int64_t n, float mu, bool squares) {
  double total = 0;
  for (int64_t c = 0; c < n; c += 4096) {
    const int64_t m = std::min<int64_t>(4096, n - c);
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = m / 8 * 8;
    detail::norm_stat_sums8(p + c, i, mu, squares, acc);
    for (; i < m; ++i) {
      const float d = p[c + i] - mu;
      acc[0] += squares ? d * d : p[c + i];
    }
    total += ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  }
  return total;
}
double sum_f(const float* p, int64_t n) { return lane_sum(p, n, 0.0f, false); }
// sum_f of a 16-bit row's values (t), widening them into out[0, n) in the same pass: the sum of
// lane_sum, in its order.
double sum_widened(const char* src, DType t, int64_t n, float* out) {
  const int64_t es = static_cast<int64_t>(esize(t));
  double total = 0;
  for (int64_t c = 0; c < n; c += 4096) {
    const int64_t m = std::min<int64_t>(4096, n - c);
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = m / 8 * 8;
    detail::norm_sum_widen8(src + c * es, t, i, out + c, acc);
    if (i < m) load_f32(src + (c + i) * es, t, 1, m - i, out + c + i);
    for (; i < m; ++i) acc[0] += out[c + i];
    total += ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  }
  return total;
}
// Sum of (p[i] - mu)^2.
double sum_sq_f(const float* p, int64_t n, float mu) { return lane_sum(p, n, mu, true); }

// Calls fn(stat index, [begin, end) within the row, channel) for each run of row r's elements
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

// y = (x - mean) * rstd * w[c] + b[c], computed in FP32 and stored in yt, a row at a time (w and
// b null for no affine parameters). mean and rstd are read when a row is normalized.
struct NormApply {
  FloatRows x;
  const NormLayout& L;
  const std::vector<float>& mean;
  const std::vector<float>& rstd;
  const std::vector<float>* w;
  const std::vector<float>* b;
  void* y;
  DType yt;
  // Row r; xbuf holds L.inner floats when x is not FP32.
  void row(int64_t r, float* xbuf) const { row_from(r, x.row(r * L.inner, L.inner, xbuf)); }
  // Row r from its values xs in FP32 (x.row()'s).
  // A 16-bit y is rounded as it is stored (norm_affine_row_to).
  void row_from(int64_t r, const float* xs) const {
    const int64_t es = static_cast<int64_t>(esize(yt));
    char* dst = static_cast<char*>(y) + r * L.inner * es;
    for_each_channel_run(L, r, [&](size_t s, int64_t i0, int64_t i1, size_t c) {
      const float scale = w ? rstd[s] * (*w)[c] : rstd[s];
      const float shift = w ? (*b)[c] - mean[s] * scale : -mean[s] * scale;
      if (yt == DType::f32)
        detail::norm_affine_row(xs + i0, i1 - i0, scale, shift, reinterpret_cast<float*>(dst) + i0);
      else
        detail::norm_affine_row_to(xs + i0, i1 - i0, scale, shift, dst + i0 * es, yt);
    });
  }
};

// FP64 (sums over whole batches lose too much in FP32). With `apply`, each stat group's rows are
// normalized as soon as its statistics are known, while they are still in cache (the same values
// as norm_apply after it).
void norm_stats(FloatRows x, const NormLayout& L, double eps, std::vector<float>& mean,
                std::vector<float>& rstd, std::vector<double>* var_out,
                const NormApply* apply = nullptr) {
  const int64_t stats = L.across_outer ? L.groups : L.outer * L.groups;
  mean.assign(static_cast<size_t>(stats), 0.0f);
  rstd.assign(static_cast<size_t>(stats), 0.0f);
  if (var_out) var_out->assign(static_cast<size_t>(stats), 0.0);
  parallel_for(static_cast<size_t>(stats), 1, threads_for(L.outer * L.groups * L.inner),
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
                   // A stat group of one row (group and layer norm) is read once: a 16-bit
                   // row widened once, in the pass that sums it, for the second sum and the
                   // normalization.
                   const bool one = o_end - o_begin == 1;
                   const float* one_row = nullptr;
                   double sum = 0;
                   if (one && x.dtype != DType::f32) {
                     const int64_t r = o_begin * L.groups + grp;
                     sum = sum_widened(x.base + r * L.inner * static_cast<int64_t>(esize(x.dtype)),
                                       x.dtype, L.inner, buf.data());
                     one_row = buf.data();
                   } else if (one) {
                     one_row = row(o_begin, grp);
                     sum = sum_f(one_row, L.inner);
                   }
                   auto values = [&](int64_t o) { return one_row ? one_row : row(o, grp); };
                   if (!one)
                     for (int64_t o = o_begin; o < o_end; ++o) sum += sum_f(values(o), L.inner);
                   const double count = static_cast<double>((o_end - o_begin) * L.inner);
                   const double mu = sum / count;
                   double sq = 0;  // two passes: the variance of values around their mean
                   for (int64_t o = o_begin; o < o_end; ++o)
                     sq += sum_sq_f(values(o), L.inner, static_cast<float>(mu));
                   const double var = sq / count;
                   mean[s] = static_cast<float>(mu);
                   rstd[s] = static_cast<float>(1.0 / std::sqrt(var + eps));
                   if (var_out) (*var_out)[s] = var;
                   if (apply)
                     for (int64_t o = o_begin; o < o_end; ++o)
                       apply->row_from(o * L.groups + grp, values(o));
                 }
               });
}

// Batch norm's statistics (L.across_outer) over the processes that `sync` joins: norm_stats'
// arithmetic in two phases, each channel's local sum (and then sum of squared deviations) a term
// of the total that sync adds. Returns the total count of values per channel.
double synced_batch_stats(FloatRows x, const NormLayout& L, double eps, const ChannelSums& sync,
                          std::vector<float>& mean, std::vector<float>& rstd,
                          std::vector<double>& var) {
  const size_t C = static_cast<size_t>(L.groups);
  const int threads = threads_for(L.outer * L.groups * L.inner);
  // Calls term(channel, row values) for every row of each channel, a task per channel range.
  auto over_channels = [&](const std::function<double(size_t, const float*)>& term,
                           std::vector<double>& out) {
    parallel_for(C, 1, threads, [&](size_t s0, size_t s1) {
      std::vector<float> buf(x.dtype == DType::f32 ? 0 : static_cast<size_t>(L.inner));
      for (size_t s = s0; s < s1; ++s) {
        double total = 0;
        for (int64_t o = 0; o < L.outer; ++o)
          total += term(
              s, x.row((o * L.groups + static_cast<int64_t>(s)) * L.inner, L.inner, buf.data()));
        out[s] = total;
      }
    });
  };
  std::vector<double> sums(C + 1, 0.0);
  over_channels([&](size_t, const float* row) { return sum_f(row, L.inner); }, sums);
  sums[C] = static_cast<double>(L.outer * L.inner);
  sync(sums.data(), C + 1);
  const double count = sums[C];
  std::vector<double> mu(C), sq(C, 0.0);
  for (size_t s = 0; s < C; ++s) mu[s] = sums[s] / count;
  over_channels(
      [&](size_t s, const float* row) { return sum_sq_f(row, L.inner, static_cast<float>(mu[s])); },
      sq);
  sync(sq.data(), C);
  mean.assign(C, 0.0f);
  rstd.assign(C, 0.0f);
  var.assign(C, 0.0);
  for (size_t s = 0; s < C; ++s) {
    var[s] = sq[s] / count;
    mean[s] = static_cast<float>(mu[s]);
    rstd[s] = static_cast<float>(1.0 / std::sqrt(var[s] + eps));
  }
  return count;
}

// norm_apply's rows, in parallel.
void norm_apply(const NormApply& a) {
  const int64_t rows = a.L.outer * a.L.groups;
  parallel_for(
      static_cast<size_t>(rows), 1, threads_for(rows * a.L.inner), [&](size_t r0, size_t r1) {
        std::vector<float> xbuf(a.x.dtype == DType::f32 ? 0 : static_cast<size_t>(a.L.inner));
        for (size_t r = r0; r < r1; ++r) a.row(static_cast<int64_t>(r), xbuf.data());
      });
}

// y = norm_apply(...) as a tensor of `out` dtype: written in place when FP32.
Tensor normalized(FloatRows x, const Shape& shape, const NormLayout& L,
                  const std::vector<float>& mean, const std::vector<float>& rstd,
                  const Tensor& weight, const Tensor& bias, DType out) {
  std::vector<float> wv, bv;
  if (weight.defined()) wv = load_all(weight), bv = load_all(bias);
  Tensor y = Tensor::empty(shape, out, charged_to(MemoryCategory::activations));
  norm_apply({x, L, mean, rstd, weight.defined() ? &wv : nullptr, weight.defined() ? &bv : nullptr,
              y.data_ptr(), out});
  return y;
}

// The statistics (norm_stats) and y = norm_apply(...) together, each stat group normalized as
// soon as its statistics are known: the same values, one pass less over x from memory. For group
// and layer norm, whose stat group is one row (batch norm's is a channel's rows, which stay in
// cache no better than a second pass in memory order: norm_backward says why).
Tensor stats_and_normalized(FloatRows x, const Shape& shape, const NormLayout& L, double eps,
                            const Tensor& weight, const Tensor& bias, DType out,
                            std::vector<float>& mean, std::vector<float>& rstd,
                            std::vector<double>* var) {
  std::vector<float> wv, bv;
  if (weight.defined()) wv = load_all(weight), bv = load_all(bias);
  Tensor y = Tensor::empty(shape, out, charged_to(MemoryCategory::activations));
  const NormApply apply{x,
                        L,
                        mean,
                        rstd,
                        weight.defined() ? &wv : nullptr,
                        weight.defined() ? &bv : nullptr,
                        y.data_ptr(),
                        out};
  norm_stats(x, L, eps, mean, rstd, var, &apply);
  return y;
}

// Sums of d[i] and d[i] * xhat[i], xhat = (x[i] - mu) * rs, over n values: 8 float lanes within
// chunks of 4096, the chunks added in FP64, as sum_f does. d and x are stored in dt and xt (f32,
// f16 or bf16); a 16-bit operand is widened into dout / xout (null for an FP32 one) in the pass
// that sums it, for dx after the sums.
void sums_d_dxhat_widened(const char* d, DType dt, const char* x, DType xt, int64_t n, float mu,
                          float rs, float* dout, float* xout, double& sd, double& sdx) {
  const int64_t ed = static_cast<int64_t>(esize(dt)), ex = static_cast<int64_t>(esize(xt));
  const float* dv = dt == DType::f32 ? reinterpret_cast<const float*>(d) : dout;
  const float* xv = xt == DType::f32 ? reinterpret_cast<const float*>(x) : xout;
  for (int64_t c = 0; c < n; c += 4096) {
    const int64_t m = std::min<int64_t>(4096, n - c);
    float a[8] = {0, 0, 0, 0, 0, 0, 0, 0}, b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = m / 8 * 8;
    detail::norm_sums8_widen(d + c * ed, dt, x + c * ex, xt, i, mu, rs,
                             dt == DType::f32 ? nullptr : dout + c,
                             xt == DType::f32 ? nullptr : xout + c, a, b);
    if (i < m && dt != DType::f32) load_f32(d + (c + i) * ed, dt, 1, m - i, dout + c + i);
    if (i < m && xt != DType::f32) load_f32(x + (c + i) * ex, xt, 1, m - i, xout + c + i);
    const float* dc = dv + c;
    const float* xc = xv + c;
    for (; i < m; ++i) {
      a[0] += dc[i];
      b[0] += dc[i] * ((xc[i] - mu) * rs);
    }
    sd += ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    sdx += ((b[0] + b[1]) + (b[2] + b[3])) + ((b[4] + b[5]) + (b[6] + b[7]));
  }
}

// dx (dtype dx_type, x's element count), dw, db of y = xhat * w + b with xhat normalized by
// statistics over each stat group (those statistics depend on x when `through_stats`; batch norm
// in eval mode uses fixed ones). Sums in float lanes and FP64 across chunks; dx elementwise in
// FP32, rounded once into dx_type. 16-bit rows are converted one at a time.
// With `sync` (batch norm), the stat groups' sums and the count are added over the processes
// before dx is computed.
void norm_backward(FloatRows dy, FloatRows x, const NormLayout& L, const std::vector<float>& mean,
                   const std::vector<float>& rstd, const std::vector<float>* w, bool through_stats,
                   void* dx, DType dx_type, std::vector<double>& dw, std::vector<double>& db,
                   const ChannelSums* sync) {
  const int64_t stats = L.across_outer ? L.groups : L.outer * L.groups;
  const int64_t rows = L.outer * L.groups;
  const int64_t elements = rows * L.inner;
  dw.assign(static_cast<size_t>(L.channels), 0.0);
  db.assign(static_cast<size_t>(L.channels), 0.0);
  // Row buffers for 16-bit tensors (empty for FP32, which is read and written in place).
  auto buffer = [&](DType t) {
    return std::vector<float>(t == DType::f32 ? 0 : static_cast<size_t>(L.inner));
  };
  // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) per stat group, as
  // dx = dy * (rstd * w) - (rstd * mean(g)) - xhat * (rstd * mean(g * xhat)), for row r once its
  // stat group's sums are complete.
  double count = static_cast<double>(L.across_outer ? L.outer * L.inner : L.inner);
  std::vector<double> sum_g(static_cast<size_t>(stats), 0.0),
      sum_gx(static_cast<size_t>(stats), 0.0);
  const size_t dx_size = esize(dx_type);
  // Row r's dx from its dy and x values in FP32 (FloatRows::row()'s).
  // A 16-bit dx is rounded as it is stored (norm_dx_row_to).
  auto dx_values = [&](int64_t r, const float* dr, const float* xr) {
    char* dst = static_cast<char*>(dx) + r * L.inner * static_cast<int64_t>(dx_size);
    for_each_channel_run(L, r, [&](size_t s, int64_t i0, int64_t i1, size_t c) {
      const double wc = w ? (*w)[c] : 1.0;
      const float mu = mean[s], rs = rstd[s];
      const float scale = static_cast<float>(rs * wc);
      const float shift = through_stats ? static_cast<float>(rs * (sum_g[s] / count)) : 0.0f;
      const float slope = through_stats ? static_cast<float>(rs * (sum_gx[s] / count)) : 0.0f;
      if (dx_type == DType::f32)
        detail::norm_dx_row(dr + i0, xr + i0, i1 - i0, mu, rs, scale, shift, slope,
                            reinterpret_cast<float*>(dst) + i0);
      else
        detail::norm_dx_row_to(dr + i0, xr + i0, i1 - i0, mu, rs, scale, shift, slope,
                               dst + i0 * static_cast<int64_t>(dx_size), dx_type);
    });
  };
  auto dx_row = [&](int64_t r, float* dybuf, float* xbuf) {
    dx_values(r, dy.row(r * L.inner, L.inner, dybuf), x.row(r * L.inner, L.inner, xbuf));
  };
  // A stat group of one row (group and layer norm) computes its dx right after its sums, while
  // the row is still in cache. Batch norm's stat group is a channel's rows, one per image, a
  // whole (C, H, W) apart: at ResNet's sizes those strides map the rows onto the same few cache
  // sets, which cannot hold them until a second look, so it makes dx in a second pass in memory
  // order (which sync batch norm needs anyway: the sums added over processes come first).
  const bool second_pass = L.across_outer || (sync && through_stats);
  // Pass 1, per stat group: sums of g = dy*w and g*xhat; per channel: sums of dy and dy*xhat.
  // Tasks own whole stat groups; channel sums are per task, added at the end.
  std::mutex merge;
  parallel_for(static_cast<size_t>(stats), 1, threads_for(elements), [&](size_t s0, size_t s1) {
    std::vector<double> tdw(static_cast<size_t>(L.channels), 0.0),
        tdb(static_cast<size_t>(L.channels), 0.0);
    std::vector<float> dybuf = buffer(dy.dtype), xbuf = buffer(x.dtype);
    for (size_t st = s0; st < s1; ++st) {
      // The rows of stat group st: one row, or (batch norm) row o * groups + st for every o.
      const int64_t n_rows = L.across_outer ? L.outer : 1;
      auto row_of = [&](int64_t k) {
        return L.across_outer ? k * L.groups + static_cast<int64_t>(st) : static_cast<int64_t>(st);
      };
      for (int64_t k = 0; k < n_rows; ++k) {
        const int64_t r = row_of(k);
        // 16-bit rows are widened in the pass that sums them (into dybuf and xbuf, which then
        // hold the whole row for dx); FP32 rows are read in place.
        const char* drow = dy.base + r * L.inner * static_cast<int64_t>(esize(dy.dtype));
        const char* xrow = x.base + r * L.inner * static_cast<int64_t>(esize(x.dtype));
        const float* dr =
            dy.dtype == DType::f32 ? reinterpret_cast<const float*>(drow) : dybuf.data();
        const float* xr =
            x.dtype == DType::f32 ? reinterpret_cast<const float*>(xrow) : xbuf.data();
        for_each_channel_run(L, r, [&](size_t s, int64_t i0, int64_t i1, size_t c) {
          const double wc = w ? (*w)[c] : 1.0;
          double sd = 0, sdx = 0;
          sums_d_dxhat_widened(drow + i0 * static_cast<int64_t>(esize(dy.dtype)), dy.dtype,
                               xrow + i0 * static_cast<int64_t>(esize(x.dtype)), x.dtype, i1 - i0,
                               mean[s], rstd[s],
                               dy.dtype == DType::f32 ? nullptr : dybuf.data() + i0,
                               x.dtype == DType::f32 ? nullptr : xbuf.data() + i0, sd, sdx);
          sum_g[s] += wc * sd;
          sum_gx[s] += wc * sdx;
          tdw[c] += sdx;
          tdb[c] += sd;
        });
        // Without a second pass the stat group is this one row (L.across_outer is false), its
        // sums complete: its dx from the values just read (a 16-bit row is not converted again).
        if (!second_pass) dx_values(r, dr, xr);
      }
    }
    std::lock_guard<std::mutex> lock(merge);
    for (size_t c = 0; c < tdw.size(); ++c) dw[c] += tdw[c], db[c] += tdb[c];
  });
  if (!second_pass) return;
  if (sync && through_stats) {
    std::vector<double> sums(2 * static_cast<size_t>(stats) + 1);
    std::copy(sum_g.begin(), sum_g.end(), sums.begin());
    std::copy(sum_gx.begin(), sum_gx.end(), sums.begin() + stats);
    sums.back() = count;
    (*sync)(sums.data(), sums.size());
    std::copy(sums.begin(), sums.begin() + stats, sum_g.begin());
    std::copy(sums.begin() + stats, sums.end() - 1, sum_gx.begin());
    count = sums.back();
  }
  // Pass 2, every row.
  parallel_for(static_cast<size_t>(rows), 1, threads_for(elements), [&](size_t r0, size_t r1) {
    std::vector<float> dybuf = buffer(dy.dtype), xbuf = buffer(x.dtype);
    for (size_t r = r0; r < r1; ++r) dx_row(static_cast<int64_t>(r), dybuf.data(), xbuf.data());
  });
}

// The backward of a norm on tensors: differentiate (dx written in its own dtype, rows of 16-bit
// tensors converted one at a time), package dx, dw, db.
std::tuple<Tensor, Tensor, Tensor> norm_backward_tensors(const Tensor& dy_in, const Tensor& x_in,
                                                         const NormLayout& L, const Tensor& weight,
                                                         const Tensor& mean, const Tensor& rstd,
                                                         bool through_stats, DType dx_type,
                                                         const ChannelSums* sync = nullptr) {
  std::vector<float> wv;
  if (weight.defined()) wv = load_all(weight);
  std::vector<double> dw, db;
  const Tensor dy = dy_in.contiguous(), x = x_in.contiguous();
  Tensor tdx = Tensor::empty(x.shape(), dx_type, charged_to(MemoryCategory::gradients));
  norm_backward({static_cast<const char*>(dy.data_ptr()), dy.dtype()},
                {static_cast<const char*>(x.data_ptr()), x.dtype()}, L, load_all(mean),
                load_all(rstd), weight.defined() ? &wv : nullptr, through_stats, tdx.data_ptr(),
                dx_type, dw, db, sync);
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
                                              double eps, DType out, const ChannelSums* sync) {
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
    double n = static_cast<double>(x.size(0) * inner);
    if (sync)
      n = synced_batch_stats(xv, L, eps, *sync, mean, rstd, var);
    else  // normalized in a second pass, in memory order (see norm_backward)
      norm_stats(xv, L, eps, mean, rstd, &var);
    if (running_mean.defined()) {
      MANTISSA_CHECK(running_mean.dtype() == DType::f32 && running_var.dtype() == DType::f32 &&
                         running_mean.numel() == C && running_var.numel() == C,
                     "batch_norm: running statistics must be f32 with one value per channel",
                     "keep running statistics in f32");
      float* rm = running_mean.data<float>();
      float* rv = running_var.data<float>();
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
                                                       DType dx_type, const ChannelSums* sync) {
  const int64_t C = x.size(1), inner = x.numel() / std::max<int64_t>(x.size(0) * C, 1);
  const NormLayout L{x.size(0), C, inner, C, inner, true};
  return norm_backward_tensors(dy, x, L, weight, mean, rstd, training, dx_type,
                               training ? sync : nullptr);
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
  Tensor y = stats_and_normalized(xv, x.shape(), L, eps, weight, bias, out, mean, rstd, nullptr);
  return {y, from_vector(mean, {N, groups}, DType::f32, MemoryCategory::activations),
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
  Tensor y = stats_and_normalized(xv, x.shape(), L, eps, weight, bias, out, mean, rstd, nullptr);
  return {y, from_vector(mean, {rows}, DType::f32, MemoryCategory::activations),
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

}  // namespace mantissa::kernels

#include "mantissa/core/convert.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "mantissa/core/convert_kernels.h"
#include "mantissa/core/cpu_features.h"
#include "mantissa/core/parallel.h"

namespace mantissa {

namespace detail {
int narrow_index(DType t) {
  switch (t) {
    case DType::f16:
      return kIdxF16;
    case DType::bf16:
      return kIdxBF16;
    case DType::e4m3:
      return kIdxE4M3;
    case DType::e5m2:
      return kIdxE5M2;
    default:
      return -1;
  }
}
}  // namespace detail

float f64_to_f32_round_to_odd(double x) {
  const float f = static_cast<float>(x);
  if (std::isnan(x) || static_cast<double>(f) == x) return f;
  // Not exact: take the neighbour toward zero (an infinity from overflow becomes FLT_MAX, already
  // odd) and set its lowest bit.
  float toward_zero = f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(x)) toward_zero = std::nextafter(f, 0.0f);
  return std::bit_cast<float>(std::bit_cast<uint32_t>(toward_zero) | 1u);
}

namespace {

using detail::ConvertKernels;

const ConvertKernels& kernels_for(SimdPath path) {
#if defined(MANTISSA_HAVE_X86_SIMD)
  if (path == SimdPath::kAvx512 && simd_path_supported(SimdPath::kAvx512))
    return detail::avx512_kernels();
  if (path != SimdPath::kScalar && simd_path_supported(SimdPath::kAvx2))
    return detail::avx2_kernels();
#endif
  (void)path;
  return detail::scalar_kernels();
}

constexpr size_t kChunk = 1024;  // elements per staging buffer in two-step conversions

double load_as_double(const void* src, DType t, size_t i) {
  switch (t) {
    case DType::f32:
      return static_cast<const float*>(src)[i];
    case DType::f64:
      return static_cast<const double*>(src)[i];
    case DType::f16:
      return static_cast<float>(static_cast<const f16*>(src)[i]);
    case DType::bf16:
      return static_cast<float>(static_cast<const bf16*>(src)[i]);
    case DType::e4m3:
      return static_cast<float>(static_cast<const e4m3*>(src)[i]);
    case DType::e5m2:
      return static_cast<float>(static_cast<const e5m2*>(src)[i]);
    case DType::i32:
      return static_cast<const int32_t*>(src)[i];
    case DType::i64:
      return static_cast<double>(static_cast<const int64_t*>(src)[i]);
    case DType::u8:
      return static_cast<const uint8_t*>(src)[i];
    case DType::boolean:
      return static_cast<const bool*>(src)[i] ? 1.0 : 0.0;
  }
  return 0.0;
}

// Truncation toward zero, saturating at the integer's range; NaN gives 0 (a defined answer where
// C++ leaves the conversion undefined).
template <typename Int>
Int double_to_int(double v) {
  if (std::isnan(v)) return 0;
  constexpr double lo = static_cast<double>(std::numeric_limits<Int>::min());
  constexpr double hi_excl = static_cast<double>(std::numeric_limits<Int>::max()) + 1.0;
  if (v <= lo) return std::numeric_limits<Int>::min();
  if (v >= hi_excl) return std::numeric_limits<Int>::max();
  return static_cast<Int>(v);
}

void store_from_double(void* dst, DType t, size_t i, double v) {
  switch (t) {
    case DType::f32:
      static_cast<float*>(dst)[i] = static_cast<float>(v);
      return;
    case DType::f64:
      static_cast<double*>(dst)[i] = v;
      return;
    case DType::i32:
      static_cast<int32_t*>(dst)[i] = double_to_int<int32_t>(v);
      return;
    case DType::i64:
      static_cast<int64_t*>(dst)[i] = double_to_int<int64_t>(v);
      return;
    case DType::u8:
      static_cast<uint8_t*>(dst)[i] = double_to_int<uint8_t>(v);
      return;
    case DType::boolean:
      static_cast<bool*>(dst)[i] = v != 0.0;
      return;
    default:
      return;  // narrow floats are stored through the kernels
  }
}

}  // namespace

void convert(const void* src, DType from, void* dst, DType to, size_t n, const CastOptions& opt,
             SimdPath path) {
  if (n == 0) return;
  if (from == to) {
    if (src != dst) std::memcpy(dst, src, n * dtype_size(from));
    return;
  }
  const ConvertKernels& k = kernels_for(path);
  const int si = detail::narrow_index(from);
  const int di = detail::narrow_index(to);
  if (from == DType::f32 && di >= 0)
    return k.from_f32[di](static_cast<const float*>(src), dst, n, opt);
  if (si >= 0 && to == DType::f32) return k.to_f32[si](src, static_cast<float*>(dst), n);

  // Two steps through a staging buffer: FP32 (exact for every narrow source) when both ends are
  // FP32-or-narrow, otherwise FP64.
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  const size_t ss = dtype_size(from), ds = dtype_size(to);
  float buf32[kChunk];
  double buf64[kChunk];
  for (size_t off = 0; off < n; off += kChunk) {
    const size_t m = std::min(kChunk, n - off);
    CastOptions o = opt;
    o.index = opt.index + off;
    if (si >= 0 && di >= 0) {
      k.to_f32[si](s + off * ss, buf32, m);
      k.from_f32[di](buf32, d + off * ds, m, o);
      continue;
    }
    for (size_t i = 0; i < m; ++i) buf64[i] = load_as_double(s + off * ss, from, i);
    if (di >= 0) {
      for (size_t i = 0; i < m; ++i) buf32[i] = f64_to_f32_round_to_odd(buf64[i]);
      k.from_f32[di](buf32, d + off * ds, m, o);
    } else {
      for (size_t i = 0; i < m; ++i) store_from_double(d + off * ds, to, i, buf64[i]);
    }
  }
}

void convert(const void* src, DType from, void* dst, DType to, size_t n, const CastOptions& opt) {
  static const SimdPath path = simd_path(SimdFamily::kConvert);
  // The kernels' many short calls (rows, runs) go straight to the chosen table.
  static const ConvertKernels& k = kernels_for(path);
  if (n != 0 && from == DType::f32 && detail::narrow_index(to) >= 0)
    return k.from_f32[detail::narrow_index(to)](static_cast<const float*>(src), dst, n, opt);
  if (n != 0 && to == DType::f32 && detail::narrow_index(from) >= 0)
    return k.to_f32[detail::narrow_index(from)](src, static_cast<float*>(dst), n);
  convert(src, from, dst, to, n, opt, path);
}

void convert_parallel(const void* src, DType from, void* dst, DType to, size_t n,
                      const CastOptions& opt, int threads) {
  const size_t ss = dtype_size(from), ds = dtype_size(to);
  parallel_for(n, 1 << 14, threads, [&](size_t begin, size_t end) {
    CastOptions o = opt;
    o.index = opt.index + begin;
    convert(static_cast<const char*>(src) + begin * ss, from, static_cast<char*>(dst) + begin * ds,
            to, end - begin, o);
  });
}

}  // namespace mantissa

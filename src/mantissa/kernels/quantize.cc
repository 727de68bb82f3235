#include "mantissa/kernels/quantize.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "mantissa/core/convert.h"
#include "mantissa/core/error.h"
#include "mantissa/core/float_formats.h"
#include "mantissa/core/parallel.h"
#include "mantissa/kernels/elementwise.h"

namespace mantissa::kernels {

#if MANTISSA_HAVE_X86_SIMD
namespace detail {
// quantize_avx2.cc: the AVX2 path (x86-64 builds only), bit for bit the reference's.
QuantizeStats quantize_fp8_avx2(const void* src, DType from, void* dst, DType format, size_t n,
                                float scale);
float amax_avx2(const void* src, DType from, size_t n);
}  // namespace detail
#endif

namespace {

// The smallest positive FP32 bit pattern whose encoding in F is past `limit` (encodings of
// positive values grow with the value, so a bisection over the bit patterns finds it).
template <FloatFormat F>
constexpr uint32_t first_encoding_above(uint32_t lo, uint32_t hi, uint32_t limit) {
  // encode(lo) <= limit < encode(hi)
  while (hi - lo > 1) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (encode_rne<F>(mid) > limit)
      hi = mid;
    else
      lo = mid;
  }
  return hi;
}

template <FloatFormat F>
constexpr uint32_t kOverflowBits = first_encoding_above<F>(max_finite_f32_bits<F>(), 0x7f800000u,
                                                           F.max_finite_bits());
template <FloatFormat F>
constexpr uint32_t kZeroBits = first_encoding_above<F>(0u, 0x3f800000u, 0u);

static_assert(kOverflowBits<kE4M3Format> == std::bit_cast<uint32_t>(464.0f) + 1,
              "E4M3: 464 ties to 448 (even), the next float saturates");
static_assert(kOverflowBits<kE5M2Format> == std::bit_cast<uint32_t>(61440.0f),
              "E5M2: 61440 ties to 65536 (57344 is odd), which overflows");
static_assert(kZeroBits<kE4M3Format> == std::bit_cast<uint32_t>(0x1p-10f) + 1,
              "E4M3: half the smallest subnormal 2^-9 ties to zero");
static_assert(kZeroBits<kE5M2Format> == std::bit_cast<uint32_t>(0x1p-17f) + 1,
              "E5M2: half the smallest subnormal 2^-16 ties to zero");

void check_format(DType format) {
  MANTISSA_CHECK(format == DType::e4m3 || format == DType::e5m2,
                 "FP8 quantization to " + std::string(dtype_name(format)) + " is not supported",
                 "quantize to e4m3 or e5m2");
}

void check_source(DType from) {
  MANTISSA_CHECK(is_compute_float(from),
                 "FP8 quantization of " + std::string(dtype_name(from)) + " is not supported",
                 "quantize f32, f16 or bf16 values");
}

float widen(const void* src, DType from, size_t i) {
  switch (from) {
    case DType::f16:
      return static_cast<float>(static_cast<const f16*>(src)[i]);
    case DType::bf16:
      return static_cast<float>(static_cast<const bf16*>(src)[i]);
    default:
      return static_cast<const float*>(src)[i];
  }
}

template <FloatFormat F>
QuantizeStats reference(const void* src, DType from, uint8_t* dst, size_t n, float scale) {
  QuantizeStats s;
  s.count = static_cast<int64_t>(n);
  bool nonfinite = false;
  const float overflow = std::bit_cast<float>(kOverflowBits<F>);
  const float zero = std::bit_cast<float>(kZeroBits<F>);
  for (size_t i = 0; i < n; ++i) {
    const float x = widen(src, from, i);
    const float a = std::fabs(x);
    if (a <= std::numeric_limits<float>::max())
      s.amax = std::max(s.amax, a);
    else
      nonfinite = true;
    s.nan += std::isnan(x);
    const float y = x * scale;
    const float ay = std::fabs(y);
    s.saturated += ay >= overflow;  // false for NaN
    s.flushed += std::isfinite(x) && x != 0 && ay < zero;
    dst[i] = static_cast<uint8_t>(encode_rne<F>(std::bit_cast<uint32_t>(y), /*saturate=*/true));
  }
  if (nonfinite) s.amax = std::numeric_limits<float>::infinity();
  return s;
}

// Elements per task of the tensor forms.
constexpr size_t kTaskElements = size_t{1} << 16;

}  // namespace

void QuantizeStats::merge(const QuantizeStats& o) {
  amax = std::max(amax, o.amax);  // never NaN (see amax's definition)
  count += o.count;
  saturated += o.saturated;
  flushed += o.flushed;
  nan += o.nan;
}

float fp8_overflow_threshold(DType format) {
  check_format(format);
  return std::bit_cast<float>(format == DType::e4m3 ? kOverflowBits<kE4M3Format>
                                                    : kOverflowBits<kE5M2Format>);
}

float fp8_zero_threshold(DType format) {
  check_format(format);
  return std::bit_cast<float>(format == DType::e4m3 ? kZeroBits<kE4M3Format>
                                                    : kZeroBits<kE5M2Format>);
}

float fp8_max(DType format) {
  check_format(format);
  return std::bit_cast<float>(format == DType::e4m3 ? max_finite_f32_bits<kE4M3Format>()
                                                    : max_finite_f32_bits<kE5M2Format>());
}

QuantizeStats quantize_fp8_reference(const void* src, DType from, void* dst, DType format, size_t n,
                                     float scale) {
  check_format(format);
  check_source(from);
  MANTISSA_ASSERT(std::isfinite(scale) && scale > 0, "an FP8 scale must be finite and positive");
  uint8_t* q = static_cast<uint8_t*>(dst);
  return format == DType::e4m3 ? reference<kE4M3Format>(src, from, q, n, scale)
                               : reference<kE5M2Format>(src, from, q, n, scale);
}

QuantizeStats quantize_fp8(const void* src, DType from, void* dst, DType format, size_t n,
                           float scale, SimdPath path) {
#if MANTISSA_HAVE_X86_SIMD
  if (path == SimdPath::kAvx2 && simd_path_supported(SimdPath::kAvx2)) {
    check_format(format);
    check_source(from);
    MANTISSA_ASSERT(std::isfinite(scale) && scale > 0, "an FP8 scale must be finite and positive");
    return detail::quantize_fp8_avx2(src, from, dst, format, n, scale);
  }
#endif
  (void)path;
  return quantize_fp8_reference(src, from, dst, format, n, scale);
}

QuantizeStats quantize_fp8(const void* src, DType from, void* dst, DType format, size_t n,
                           float scale) {
  static const SimdPath path = simd_path(SimdFamily::kQuantize);
  return quantize_fp8(src, from, dst, format, n, scale, path);
}

float amax(const void* src, DType from, size_t n, SimdPath path) {
  check_source(from);
#if MANTISSA_HAVE_X86_SIMD
  if (path == SimdPath::kAvx2 && simd_path_supported(SimdPath::kAvx2))
    return detail::amax_avx2(src, from, n);
#endif
  (void)path;
  float m = 0;
  bool nonfinite = false;
  for (size_t i = 0; i < n; ++i) {
    const float a = std::fabs(widen(src, from, i));
    if (a <= std::numeric_limits<float>::max())
      m = std::max(m, a);
    else
      nonfinite = true;
  }
  return nonfinite ? std::numeric_limits<float>::infinity() : m;
}

float amax(const void* src, DType from, size_t n) {
  static const SimdPath path = simd_path(SimdFamily::kQuantize);
  return amax(src, from, n, path);
}

Tensor quantize(const Tensor& x, DType format, float scale, QuantizeStats* stats,
                MemoryCategory cat) {
  check_format(format);
  check_source(x.dtype());
  const Tensor src = x.contiguous();
  Tensor q = Tensor::empty(x.shape(), format, charged_to(cat));
  const size_t n = static_cast<size_t>(src.numel()), es = dtype_size(src.dtype());
  const size_t tasks = (n + kTaskElements - 1) / kTaskElements;
  std::vector<QuantizeStats> parts(tasks);
  const char* s = static_cast<const char*>(src.data_ptr());
  uint8_t* d = static_cast<uint8_t*>(q.data_ptr());
  parallel_tasks(tasks, threads_for(static_cast<int64_t>(n)), [&](size_t t) {
    const size_t begin = t * kTaskElements, m = std::min(kTaskElements, n - begin);
    parts[t] = quantize_fp8(s + begin * es, src.dtype(), d + begin, format, m, scale);
  });
  if (stats) {
    *stats = QuantizeStats{};
    for (const QuantizeStats& p : parts) stats->merge(p);
  }
  return q;
}

float amax(const Tensor& x) {
  check_source(x.dtype());
  const Tensor src = x.contiguous();
  const size_t n = static_cast<size_t>(src.numel()), es = dtype_size(src.dtype());
  const size_t tasks = (n + kTaskElements - 1) / kTaskElements;
  std::vector<float> parts(tasks, 0.0f);
  const char* s = static_cast<const char*>(src.data_ptr());
  parallel_tasks(tasks, threads_for(static_cast<int64_t>(n)), [&](size_t t) {
    const size_t begin = t * kTaskElements, m = std::min(kTaskElements, n - begin);
    parts[t] = amax(s + begin * es, src.dtype(), m);
  });
  float m = 0;
  for (float p : parts) m = std::max(m, p);
  return m;
}

void fp8_epilogue_in_place(Tensor& acc, float scale_inv) {
  MANTISSA_ASSERT(acc.dtype() == DType::f32 && acc.is_contiguous(),
                  "the FP8 epilogue takes a contiguous FP32 accumulator");
  const int64_t n = acc.numel();
  float* a = acc.data<float>();
  parallel_for(static_cast<size_t>(n), 1024, threads_for(n), [&](size_t b0, size_t b1) {
    for (size_t i = b0; i < b1; ++i) a[i] *= scale_inv;
  });
}

Tensor fp8_epilogue(const Tensor& acc, float scale_inv, const Tensor& bias, int64_t channel_dim,
                    DType out, MemoryCategory cat) {
  MANTISSA_ASSERT(acc.dtype() == DType::f32 && acc.is_contiguous(),
                  "the FP8 epilogue takes a contiguous FP32 accumulator");
  MANTISSA_ASSERT(!bias.defined() || (channel_dim == 1 && acc.dim() >= 2),
                  "the FP8 epilogue adds a bias along dimension 1");
  Tensor y = Tensor::empty(acc.shape(), out, charged_to(cat));
  const int64_t n = acc.numel();
  if (n == 0) return y;
  const float* a = acc.data<float>();
  char* dst = static_cast<char*>(y.data_ptr());
  const int64_t ys = static_cast<int64_t>(dtype_size(out));
  constexpr int64_t kChunk = 1024;
  if (!bias.defined()) {  // y = fl(acc * scale_inv): nothing added (-0 stays -0)
    parallel_for(static_cast<size_t>(n), kChunk, threads_for(n), [&](size_t b0, size_t b1) {
      float buf[kChunk];
      for (size_t i0 = b0; i0 < b1; i0 += kChunk) {
        const int64_t m = std::min<int64_t>(kChunk, static_cast<int64_t>(b1 - i0));
        for (int64_t i = 0; i < m; ++i) buf[i] = a[static_cast<int64_t>(i0) + i] * scale_inv;
        store_f32(buf, m, dst + static_cast<int64_t>(i0) * ys, out, 1);
      }
    });
    return y;
  }
  // Rows of `inner` elements, row r of channel r % C; a linear layer's (rows, C) has inner 1 and
  // is taken a row of C at a time, each element with its channel's bias.
  const int64_t C = acc.size(1), inner = n / (acc.size(0) * C);
  MANTISSA_ASSERT(bias.numel() == C, "the FP8 epilogue's bias has one value per channel");
  std::vector<float> b(static_cast<size_t>(C));
  const Tensor bc = bias.contiguous();
  load_f32(bc.data_ptr(), bc.dtype(), 1, C, b.data());
  const bool per_element = inner == 1;
  const int64_t len = per_element ? C : inner, rows = n / len;
  parallel_for(static_cast<size_t>(rows), 1, threads_for(n), [&](size_t r0, size_t r1) {
    float buf[kChunk];
    for (size_t r = r0; r < r1; ++r) {
      const float* row = a + static_cast<int64_t>(r) * len;
      const float br = b[r % static_cast<size_t>(C)];
      for (int64_t i0 = 0; i0 < len; i0 += kChunk) {
        const int64_t m = std::min(kChunk, len - i0);
        for (int64_t i = 0; i < m; ++i) {
          const float t = row[i0 + i] * scale_inv;  // rounded, then the bias added and rounded
          buf[i] = t + (per_element ? b[static_cast<size_t>(i0 + i)] : br);
        }
        store_f32(buf, m, dst + (static_cast<int64_t>(r) * len + i0) * ys, out, 1);
      }
    }
  });
  return y;
}

}  // namespace mantissa::kernels

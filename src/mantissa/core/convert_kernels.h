// Internal: the per-path kernel tables behind convert(). Not part of the public API.
#pragma once

#include <cstddef>
#include <cstdint>

#include <bit>

#include "mantissa/core/convert.h"
#include "mantissa/core/philox.h"

namespace mantissa::detail {

// Narrow formats in kernel-table order.
enum NarrowIndex : int { kIdxF16 = 0, kIdxBF16 = 1, kIdxE4M3 = 2, kIdxE5M2 = 3, kNumNarrow = 4 };
int narrow_index(DType t);  // -1 if t is not a narrow float

using FromF32Fn = void (*)(const float* src, void* dst, size_t n, const CastOptions& opt);
using ToF32Fn = void (*)(const void* src, float* dst, size_t n);

struct ConvertKernels {
  FromF32Fn from_f32[kNumNarrow];  // both rounding modes (opt.rounding)
  ToF32Fn to_f32[kNumNarrow];
};

const ConvertKernels& scalar_kernels();

// The scalar loops (the reference path; the SIMD path uses them for heads and tails). Compiled for
// the baseline ISA in every translation unit, so their instantiations are safe to share.
template <FloatFormat F, typename Storage>
void scalar_from_f32(const float* src, Storage* dst, size_t n, const CastOptions& opt) {
  if (opt.rounding == Rounding::kNearestEven) {
    for (size_t i = 0; i < n; ++i)
      dst[i] = static_cast<Storage>(encode_rne<F>(std::bit_cast<uint32_t>(src[i]), opt.saturate));
    return;
  }
  // One Philox block serves four consecutive elements.
  PhiloxCounter block{};
  uint64_t block_index = ~uint64_t{0};
  for (size_t i = 0; i < n; ++i) {
    const uint64_t index = opt.index + i;
    if ((index >> 2) != block_index) {
      block_index = index >> 2;
      block = philox_block(opt.seed, opt.stream, block_index);
    }
    dst[i] = static_cast<Storage>(
        encode_stochastic<F>(std::bit_cast<uint32_t>(src[i]), block[index & 3], opt.saturate));
  }
}

template <FloatFormat F, typename Storage>
void scalar_to_f32(const Storage* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = decode<F>(src[i]);
}
#if defined(MANTISSA_HAVE_X86_SIMD)
const ConvertKernels& avx2_kernels();
// The AVX2 table with FP16 and BF16 in nearest-even on AVX-512 (convert_avx512.cc).
const ConvertKernels& avx512_kernels();
#endif

}  // namespace mantissa::detail

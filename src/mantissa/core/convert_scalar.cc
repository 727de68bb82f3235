// The portable conversion kernels: the table over the scalar reference loops.
#include "mantissa/core/convert_kernels.h"

namespace mantissa::detail {
namespace {

template <FloatFormat F, typename Storage>
void from_f32(const float* src, void* dst, size_t n, const CastOptions& opt) {
  scalar_from_f32<F>(src, static_cast<Storage*>(dst), n, opt);
}

template <FloatFormat F, typename Storage>
void to_f32(const void* src, float* dst, size_t n) {
  scalar_to_f32<F>(static_cast<const Storage*>(src), dst, n);
}

}  // namespace

const ConvertKernels& scalar_kernels() {
  static const ConvertKernels k{
      {from_f32<kF16Format, uint16_t>, from_f32<kBF16Format, uint16_t>,
       from_f32<kE4M3Format, uint8_t>, from_f32<kE5M2Format, uint8_t>},
      {to_f32<kF16Format, uint16_t>, to_f32<kBF16Format, uint16_t>, to_f32<kE4M3Format, uint8_t>,
       to_f32<kE5M2Format, uint8_t>},
  };
  return k;
}

}  // namespace mantissa::detail

// The scalar reference GEMM: sequential FMA per output element, as documented in gemm.h.
#include <cmath>

#include "mantissa/core/convert.h"
#include "mantissa/core/error.h"
#include "mantissa/kernels/gemm.h"

namespace mantissa::kernels {
namespace {

float load(const void* base, DType t, int64_t offset) {
  float v;
  convert(static_cast<const char*>(base) + offset * static_cast<int64_t>(dtype_size(t)), t, &v,
          DType::f32, 1, {}, SimdPath::kScalar);
  return v;
}

float round_f16(float v) { return static_cast<float>(f16(v)); }

}  // namespace

void gemm_reference(int64_t M, int64_t N, int64_t K, float alpha, ConstMatrix A, ConstMatrix B,
                    float beta, Matrix C, Partials partials) {
  const bool f16p = partials == Partials::kF16;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      const int64_t c_off = m * C.rs + n * C.cs;
      float acc = 0.0f;
      if (beta != 0.0f) {
        const float c = load(C.data, C.dtype, c_off);
        acc = beta == 1.0f ? c : beta * c;
      }
      for (int64_t k = 0; k < K; ++k) {
        float a = load(A.data, A.dtype, m * A.rs + k * A.cs);
        if (alpha != 1.0f) a *= alpha;
        acc = std::fma(a, load(B.data, B.dtype, k * B.rs + n * B.cs), acc);
        if (f16p && (k + 1) % kF16PartialsGranularity == 0) acc = round_f16(acc);
      }
      if (f16p) acc = round_f16(acc);
      convert(&acc, DType::f32,
              static_cast<char*>(C.data) + c_off * static_cast<int64_t>(dtype_size(C.dtype)),
              C.dtype, 1, {}, SimdPath::kScalar);
    }
  }
}

}  // namespace mantissa::kernels

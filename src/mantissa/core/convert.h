// Bulk conversion of arrays between dtypes, in both rounding modes, with a SIMD path chosen at run
// time (AVX2 + F16C on x86-64; simd_path(SimdFamily::kConvert), cpu_features.h) and a portable
// scalar path that is always built. Both paths give bit-identical results; tests check them
// exhaustively against independent references.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mantissa/core/cpu_features.h"
#include "mantissa/core/dtype.h"

namespace mantissa {

enum class Rounding : uint8_t {
  kNearestEven,  // IEEE round to nearest, ties to even
  kStochastic,   // unbiased stochastic rounding (Philox-4x32-10 keyed by seed, stream, index)
};

struct CastOptions {
  Rounding rounding = Rounding::kNearestEven;
  // Overflow to the largest finite value (infinities too) instead of to inf (or NaN for E4M3).
  bool saturate = false;
  // Stochastic rounding: element i of the call uses the random bits of (seed, stream, index + i),
  // so a tensor converted in pieces, or by any number of threads, rounds the same way.
  uint64_t seed = 0;
  uint64_t stream = 0;
  uint64_t index = 0;
};

// Converts n elements of src (dtype `from`) into dst (dtype `to`), on the convert family's path.
// Narrow floats are rounded as `opt` says; other targets (f32 from f64, integers, bool) round to
// nearest even, and float to integer truncates toward zero, saturating at the integer's range, with
// NaN giving 0. Conversions from f64 to narrow floats are correctly rounded (through round-to-odd
// FP32). src and dst must not overlap unless they are the same pointer with the same dtype.
void convert(const void* src, DType from, void* dst, DType to, size_t n,
             const CastOptions& opt = {});
// The same on an explicit path (tests and benchmarks compare the paths).
void convert(const void* src, DType from, void* dst, DType to, size_t n, const CastOptions& opt,
             SimdPath path);
// The same, split over `threads` threads (1: on the calling thread). Results do not depend on the
// number of threads.
void convert_parallel(const void* src, DType from, void* dst, DType to, size_t n,
                      const CastOptions& opt, int threads);

// Converts one FP64 value to FP32 rounding to odd: the result is exact, or the FP32 value next to x
// toward zero with its lowest bit set. Narrowing that once more with round to nearest even is then
// correctly rounded for any format with at most 22 significand bits.
float f64_to_f32_round_to_odd(double x);

}  // namespace mantissa

// FP8 quantization with one FP32 scale per tensor (the FP8 recipes of amp/fp8.h), and the
// epilogue of an FP8 matrix product.
//
// Quantizing x (f32, f16 or bf16) to an FP8 format F (e4m3 or e5m2) with scale s is, element by
// element:
//   y = x * s                    one FP32 multiplication, rounded to nearest even;
//   q = saturate_F(rne_F(y))     F's exact conversion of core/float_formats.h with saturation:
//                                past the largest finite value (and infinities) -> +-max finite,
//                                NaN -> NaN, subnormals exact, ties to even.
// Dequantizing is the exact widening of q (kernels::cast to f32, f16 or bf16: every E4M3 and
// E5M2 value is representable in all three); the inverse scale is applied to a matrix product's
// output by fp8_epilogue (amp/fp8.h and docs/mixed_precision.md say why there).
//
// The quantization also measures x: its amax and how many values the format could not hold
// (QuantizeStats). The kernel runs on the "quantize" SIMD family's path (core/cpu_features.h):
// AVX2 widening, scaling and counting, then the convert family's saturating encoder on the same
// path; quantize_fp8_reference is the element-by-element oracle, and every path gives its bits.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mantissa/core/cpu_features.h"
#include "mantissa/core/tensor.h"

namespace mantissa::kernels {

// What one quantization saw of its input x (before scaling).
struct QuantizeStats {
  // max |x| over the finite values; +inf when x holds an infinity or a NaN (so that MAX-reducing
  // amaxes, across ranks or steps, is well defined and a non-finite tensor never sets a scale).
  float amax = 0;
  int64_t count = 0;      // elements
  int64_t saturated = 0;  // |x * s| rounds past the format's largest finite value (inf included)
  int64_t flushed = 0;    // x is finite and non-zero, but x * s rounds to zero
  int64_t nan = 0;        // NaN inputs (stored as the format's NaN)

  void merge(const QuantizeStats& o);
};

// The smallest positive FP32 value that rounds past the format's largest finite value (E4M3:
// 464, which ties to 448, is not; the next float is), and the smallest that does not round to
// zero (half the smallest subnormal ties to zero). `format` is e4m3 or e5m2.
float fp8_overflow_threshold(DType format);
float fp8_zero_threshold(DType format);
// The format's largest finite value (E4M3 448, E5M2 57344).
float fp8_max(DType format);

// n values of `from` (f32, f16, bf16) at src quantized with `scale` (finite, positive) into n
// bytes of `format` (e4m3, e5m2) at dst, on the quantize family's path. Returns the input's stats.
QuantizeStats quantize_fp8(const void* src, DType from, void* dst, DType format, size_t n,
                           float scale);
// The same on an explicit path (tests compare the paths).
QuantizeStats quantize_fp8(const void* src, DType from, void* dst, DType format, size_t n,
                           float scale, SimdPath path);
// The oracle: element by element, encode_rne<F>(bits(x * scale), saturate) of float_formats.h.
QuantizeStats quantize_fp8_reference(const void* src, DType from, void* dst, DType format, size_t n,
                                     float scale);

// amax of n values (QuantizeStats::amax's definition): current scaling's first read.
float amax(const void* src, DType from, size_t n);
float amax(const void* src, DType from, size_t n, SimdPath path);

// Tensor forms, split across threads (the result does not depend on their number): x (any
// shape, f32/f16/bf16) quantized into a new contiguous tensor of x's shape in `format`, charged
// to `cat`; `stats` (may be null) receives the input's stats.
Tensor quantize(const Tensor& x, DType format, float scale, QuantizeStats* stats,
                MemoryCategory cat = MemoryCategory::activations);
float amax(const Tensor& x);

// The epilogue of an FP8 matrix product whose FP32 accumulator is `acc` (contiguous f32,
// (outer, C, inner)): y = fl(acc * scale_inv) + bias[c] (one FP32 rounding each; bias of C
// elements, any float dtype, or undefined), rounded once into `out`. A linear layer is (rows, C)
// with inner 1; a convolution's output (N, C, H, W) has inner H * W. `channel_dim` is 1 for both
// (C's dimension), or -1 when there is no bias.
Tensor fp8_epilogue(const Tensor& acc, float scale_inv, const Tensor& bias, int64_t channel_dim,
                    DType out, MemoryCategory cat = MemoryCategory::activations);
// The epilogue of a product that stays FP32 and has no bias (an FP32 weight's gradient), in
// place: acc = fl(acc * scale_inv), the bits fp8_epilogue(acc, scale_inv, {}, -1, f32) gives,
// without a second FP32 buffer of the result's size.
void fp8_epilogue_in_place(Tensor& acc, float scale_inv);

}  // namespace mantissa::kernels

// Internal: the GEMM micro-kernels (6 x 16 tiles of C over packed panels, and 6 x 32 pairs of them
// on AVX-512). Not a public API.
#pragma once

#include <cstdint>

#include "mantissa/core/dtype.h"

namespace mantissa::kernels::detail {

inline constexpr int kMR = 6;   // rows of C per micro-tile
inline constexpr int kNR = 16;  // columns of C per micro-tile

// C[0:6][0:16] (row stride ldc) = init + sum over kc of a[k][0:6] * b[k][0:16], in sequential FMA
// order, where init is 0 (load_c false) or beta * C. a: kc x 6 packed, b: kc x 16 packed.
// f16_partials rounds the accumulators to FP16 every 16 products and at the end.
using MicroKernel = void (*)(int64_t kc, const float* a, const float* b, float* c, int64_t ldc,
                             bool load_c, float beta, bool f16_partials);

// The same tile with B read in place: row k of the 16 columns starts at b + b_off[k] (FP32,
// contiguous, any alignment). Same arithmetic, same order.
using RowsMicroKernel = void (*)(int64_t kc, const float* a, const float* b, const int64_t* b_off,
                                 float* c, int64_t ldc, bool load_c, float beta, bool f16_partials);

// Two slivers side by side (AVX-512): C[0:6][0:32], columns 0-15 from sliver b0 and 16-31 from
// b1, each element the same FMA chain as the single tile's.
using PairMicroKernel = void (*)(int64_t kc, const float* a, const float* b0, const float* b1,
                                 float* c, int64_t ldc, bool load_c, float beta, bool f16_partials);
// The same with both slivers read in place: row k of each at b0 + b_off[k], b1 + b_off[k].
using PairRowsMicroKernel = void (*)(int64_t kc, const float* a, const float* b0, const float* b1,
                                     const int64_t* b_off, float* c, int64_t ldc, bool load_c,
                                     float beta, bool f16_partials);

// How the rows micro-kernels below read B: FP32 as stored, FP16 or BF16 values widened (exact),
// or FP32 values rounded to nearest even to FP16 or BF16 as they are read (GemmOptions::round_b).
inline constexpr int kLoadF32 = 0, kLoadF16 = 1, kLoadBF16 = 2, kLoadF32AsF16 = 3,
                     kLoadF32AsBF16 = 4;
// The rows and pair-rows kernels with B read as `load` says: row k of the 16 columns at
// b + b_off[k] elements of B's storage type. Same arithmetic and order as the FP32 kernels on the
// FP32 values so read.
using Rows16MicroKernel = void (*)(int64_t kc, const float* a, const void* b, const int64_t* b_off,
                                   float* c, int64_t ldc, bool load_c, float beta,
                                   bool f16_partials);
using PairRows16MicroKernel = void (*)(int64_t kc, const float* a, const void* b0, const void* b1,
                                       const int64_t* b_off, float* c, int64_t ldc, bool load_c,
                                       float beta, bool f16_partials);
// A 12 x 32 tile from two packed A slivers (rows 6-11 at a + kc * kMR) and two B slivers read in
// place by rows (as PairRows16MicroKernel, B's load kind fixed), FP32 partials only.
using Pair12RowsMicroKernel = void (*)(int64_t kc, const float* a, const void* b0, const void* b1,
                                       const int64_t* b_off, float* c, int64_t ldc, bool load_c,
                                       float beta);

// dst[k * dst_stride + r] = line[r][k] for r < rows (rows <= 8), k < kc: the transposition
// that packing needs when the packed direction is the strided one (lines at a fixed stride, or
// listed one by one as an implicit convolution's taps are). May write up to 8 floats past
// dst + kc * dst_stride (packing buffers have that slack).
using InterleaveFn = void (*)(const float* const* line, int rows, int64_t kc, float* dst,
                              int64_t dst_stride);

// Rows [0, rows) x columns [0, cols) of an FP32 block (row r at src + r * src_ld) into C (row r
// at dst + r * dst_rs elements of t, contiguous columns; t f32, f16 or bf16), each value rounded
// to nearest even through `round` first when it is f16 or bf16 (GemmOptions::round_c), then into
// t: convert()'s rounding, bit for bit. One call per block (a GEMM stores a 16-bit C of one depth
// panel so, a few slivers at a time).
using StoreBlockFn = void (*)(const float* src, int64_t src_ld, int64_t rows, int64_t cols,
                              void* dst, int64_t dst_rs, DType t, DType round);

MicroKernel portable_micro_kernel();
RowsMicroKernel portable_rows_micro_kernel();
InterleaveFn portable_interleave();
StoreBlockFn portable_store_block();
#if defined(MANTISSA_HAVE_X86_SIMD)
MicroKernel avx2_micro_kernel();
RowsMicroKernel avx2_rows_micro_kernel();
InterleaveFn avx2_interleave();
MicroKernel avx512_micro_kernel();
RowsMicroKernel avx512_rows_micro_kernel();
PairMicroKernel avx512_pair_micro_kernel();
PairRowsMicroKernel avx512_pair_rows_micro_kernel();
// For load kLoadF16 .. kLoadF32AsBF16 (kLoadF32 is the kernels above).
Rows16MicroKernel avx512_rows16_micro_kernel(int load);
PairRows16MicroKernel avx512_pair_rows16_micro_kernel(int load);
// For every load kind, kLoadF32 (a row-listed FP32 B) included.
Pair12RowsMicroKernel avx512_pair12_rows_micro_kernel(int load);
StoreBlockFn avx512_store_block();
#endif

}  // namespace mantissa::kernels::detail

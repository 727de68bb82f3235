// Matrix multiplication C = alpha * A B + beta * C over strided matrices stored in FP32, FP16 or
// BF16 (any float dtype for A and B), computing in FP32 registers.
//
// Arithmetic, identical on every path (the fast kernel matches the reference bit for bit):
//   acc = (beta == 0) ? 0 : beta * C[m][n]            (beta == 1: C itself)
//   for k = 0 .. K-1:  acc = fma(alpha * A[m][k], B[k][n], acc)   (alpha == 1: A itself)
//   with Partials::kF16, acc is rounded to FP16 (nearest even) after every
//   kF16PartialsGranularity products and at the end, continuing in FP32 from that value: a
//   nominal model of FP16 accumulation (one rounding per block of 16 products, the K of an
//   m16n8k16 MMA), not any processor's bits (docs/mixed_precision.md says what it reproduces).
//   C[m][n] = acc, rounded to nearest even into C's dtype.
// beta == 0 never reads C (NaN there does not propagate). K == 0 reads neither A nor B (their data
// may be null). The FP32 panels a call packs are workspace charged to the memory tracker
// (release_gemm_buffers). Calls may run concurrently on any threads.
#pragma once

#include <cstdint>

#include "mantissa/core/dtype.h"
#include "mantissa/core/parallel.h"

namespace mantissa::kernels {

// The accumulation ("partials") type of matmul and convolution.
enum class Partials : uint8_t { kF32, kF16 };
inline constexpr int kF16PartialsGranularity = 16;

// A matrix view: element (i, j) at data + (i * rs + j * cs) elements.
struct ConstMatrix {
  const void* data;
  DType dtype;
  int64_t rs, cs;
};
struct Matrix {
  void* data;
  DType dtype;
  int64_t rs, cs;
};

struct GemmOptions {
  Partials partials = Partials::kF32;
  int threads = 0;  // 0: default_num_threads()
  // f16 or bf16: an FP32 B is read as if stored in that type, each value rounded to nearest even
  // as B is packed, so the product is exactly that of B's 16-bit copy, which is never made
  // (autocast's linear reads its FP32 weight so). f32: B as it is.
  DType round_b = DType::f32;
  // f16 or bf16 with an FP32 C: each result rounded to nearest even to that type as it is stored,
  // so C holds the values of the 16-bit C the same product would give, widened (a linear layer's
  // input gradient for an FP32 input read as 16-bit, which the cast's backward would widen).
  DType round_c = DType::f32;
};

// C (M x N) = alpha * A (M x K) * B (K x N) + beta * C. A and B: any float dtype; C: f32, f16 or
// bf16. Throws mantissa::Error on other dtypes.
void gemm(int64_t M, int64_t N, int64_t K, float alpha, ConstMatrix A, ConstMatrix B, float beta,
          Matrix C, const GemmOptions& opt = {});

// An FP32 B operand located by tables of offsets: element (k, n) at data + r(k) + c(n), where
// r(k) = row_offset[k] (K entries) or k when row_offset is null, and c(n) = col_offset[n]
// (N entries) or n when col_offset is null. So
//   rows listed:    data + row_offset[k] + n   (each row's N values contiguous),
//   columns listed: data + col_offset[n] + k   (each column's K values contiguous),
//   both listed:    data + row_offset[k] + col_offset[n].
// At least one table is given. Implicit-GEMM convolution reads an image this way (row k of the
// column matrix is the image shifted by tap k; with both listed, column n is output position n)
// instead of materializing the columns. With rows listed, 16 columns that are consecutive in
// memory are read in place; other columns are packed.
struct OffsetMatrix {
  const float* data = nullptr;
  const int64_t* row_offset = nullptr;
  const int64_t* col_offset = nullptr;
};
// C = alpha * A B + beta * C with B so given; the same arithmetic as gemm above.
void gemm(int64_t M, int64_t N, int64_t K, float alpha, ConstMatrix A, const OffsetMatrix& B,
          float beta, Matrix C, const GemmOptions& opt = {});

// A packed ahead of the products that share it (Winograd's transformed filters, against every
// batch of tiles): the FP32 panels gemm packs A into at each call, made once. Rows go in with
// pack_rows, in any order, from any thread; gemm then reads the panels in place, with the values
// and the arithmetic of gemm given A itself (the same bits).
inline constexpr int64_t kPackedSliverRows = 6;  // rows pack_rows takes together
struct PackedMatrix {
  float* data = nullptr;  // packed_floats(rows, depth) floats
  int64_t rows = 0, depth = 0;
};
size_t packed_floats(int64_t rows, int64_t depth);
// Rows [r0, r0 + n) of the matrix, given as A (row r0 at A.data, any float dtype): r0 a multiple
// of kPackedSliverRows, n a multiple of it too unless the rows end the matrix.
void pack_rows(const PackedMatrix& p, int64_t r0, int64_t n, ConstMatrix A);
// C (A.rows x N) = A B + beta * C, A packed, B given by offsets.
void gemm(int64_t N, const PackedMatrix& A, const OffsetMatrix& B, float beta, Matrix C,
          const GemmOptions& opt = {});

// B packed ahead in the slivers gemm packs it into, for a producer that can write them directly
// (Winograd's input transforms): sliver s, columns [16 s, 16 s + 16), at data + 16 s depth, its
// element (k, 16 s + i) at + 16 k + i; data aligned to 64 bytes, as gemm's own packing is. A last
// partial sliver's columns past N are read and must hold finite values (their products are not
// stored). gemm reads the slivers in place, with no packing, and computes what it computes from B
// itself: the same bits.
struct PackedPanels {
  const float* data = nullptr;
  int64_t depth = 0;
};
// C (A.rows x N) = A B + beta * C, A and B both packed (B.depth == A.depth).
void gemm(int64_t N, const PackedMatrix& A, const PackedPanels& B, float beta, Matrix C,
          const GemmOptions& opt = {});

// Frees every thread's packing buffers now, unless a GEMM is running (then nothing). A large GEMM
// does this when it ends; the buffers of small ones stay with their threads for the next call
// (charged to the memory tracker as workspace while held). The memory report calls it before
// each step it measures, so that each starts with what a fresh process holds.
void release_gemm_buffers();

// The scalar reference: the same arithmetic, one element at a time. Always built; the oracle of
// the fast path's tests.
void gemm_reference(int64_t M, int64_t N, int64_t K, float alpha, ConstMatrix A, ConstMatrix B,
                    float beta, Matrix C, Partials partials = Partials::kF32);

}  // namespace mantissa::kernels

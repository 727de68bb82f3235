// Internal: short FP32 vector loops of the convolutions and the small-batch linear layer, each with
// an AVX2 version chosen at run time. Both versions do the same IEEE operations per element (each
// function's comment says which: a rounded multiply then an add, or a fused multiply-add), so they
// give identical bits.
#pragma once

#include <cstdint>

#include "mantissa/core/dtype.h"

namespace mantissa::kernels::detail {

// a[j] += w * x[j * stride], j < n.
void axpy_f32(float* a, const float* x, int64_t stride, float w, int64_t n);

// ---- 2x2 max pooling with stride 2, one output row of n: out[j] is the largest of the window's
// r0[2j], r0[2j + 1], r1[2j], r1[2j + 1], taken in that order (a later value wins when it is
// larger or NaN, unless a NaN is already held: the first NaN wins, as PyTorch propagates it), and
// its offset in the window, 0, 1, 2 or 3 in that order, is the 2-bit code at bits 2j and 2j + 1
// of `codes` (byte j / 4, low bits first; bytes [0, ceil(n / 4)) are written whole). The rows are
// stored in tx and out in ty (each f32, f16 or bf16): values are widened to FP32 exactly in
// registers and the winner rounded to nearest even into ty (convert()'s rounding; exact when ty
// holds tx's values), the bits of converting the rows to FP32, pooling and converting the result.
// Comparisons only: identical results on every path.
void max_pool_2x2_row(const void* r0, const void* r1, DType tx, int64_t n, void* out, DType ty,
                      uint8_t* codes);

// The 2x2 stride-2 max pooling's backward for one output row of n: window j's gradient g[j]
// (stored in tg) goes to its winner, the 2-bit code at bits 2j and 2j + 1 of `codes` (as
// max_pool_2x2_row writes them), in the input rows
// r0 (at 0, 1: columns 2j, 2j + 1) and r1 (at 2, 3), as 0 + g (-0 becomes +0, as adding it to a
// zeroed plane gives); the window's other three elements are +0. Columns [0, 2n) of both rows are
// written, in ty (f32, f16 or bf16), rounded to nearest even (convert()'s rounding). Only on the
// AVX-512 path: has_max_pool_2x2_backward_row() says whether it is there (the callers' plane loops
// do the same otherwise).
bool has_max_pool_2x2_backward_row();
void max_pool_2x2_backward_row(const void* g, DType tg, const uint8_t* codes, int64_t n, void* r0,
                               void* r1, DType ty);

// ---- Direct convolution rows (few input channels and taps: the tutorial CNN's conv1), a row
// segment of n output columns at a time, all output channels and taps together so that the sums
// stay in registers. x[i] is tap i's input row (stride 1), already at the segment's first column.
//
// Forward: y[o * ys + j] = ((bias[o] + w[o * ws + tap[0]] * x[0][j]) + w[o * ws + tap[1]] *
// x[1][j]) + ..., each product rounded and then added: the per-tap axpy_f32 loop's arithmetic,
// bit for bit. y is stored in yt (f32, f16 or bf16): a 16-bit output is each FP32 sum rounded once
// to nearest even as it leaves the registers (store_f32's rounding), so it holds the bits of the
// FP32 rows converted, and no FP32 row is staged.
void conv_rows(void* y, DType yt, int64_t ys, int64_t O, const float* bias, const float* w,
               int64_t ws, const int64_t* tap, const float* const* x, int64_t taps, int64_t n);
// Weight gradient: lanes[(o * taps + i) * 8 + j % 8] += dy[o * ds + j] * x[i][j], in increasing j,
// each product rounded and then added. lanes: (O, taps, 8).
void conv_wgrad_rows_f32(float* lanes, int64_t O, const float* dy, int64_t ds,
                         const float* const* x, int64_t taps, int64_t n);

// Rows of a product as the GEMM computes them, for few output rows (a convolution's few output
// channels, a small batch's rows), where the GEMM's 6-row tiles would pack each value of x for at
// most two tiles: y[o * ys + j] = acc + bias[o] (bias[o] = 0 when bias is null), acc =
// fma(w[o * ws + i], x[i][j], acc) over i < taps in increasing order from acc = 0: gemm()'s
// arithmetic (followed by the bias), bit for bit. x[i] is row i of the right operand (stride 1).
// y is stored in yt (f32, f16 or bf16), each result rounded once as conv_rows rounds it.
void fma_rows(void* y, DType yt, int64_t ys, int64_t O, const float* bias, const float* w,
              int64_t ws, const float* const* x, int64_t taps, int64_t n);

// ReLU over n contiguous values, each operand f32, f16 or bf16: y = x where x > 0 or x is NaN,
// else +0 (forward); dx = g where y > 0 or y is NaN, else +0 (backward, PyTorch's
// threshold_backward). Values are widened and rounded in registers (convert()'s rounding), so the
// bits are those of the loops that stage rows in FP32. False where this machine has no such path
// (the caller stages).
bool relu_row(const void* x, DType tx, void* y, DType ty, int64_t n);
bool relu_backward_row(const void* g, DType tg, const void* y, DType ty, void* dx, DType td,
                       int64_t n);

// Normalization rows (norm.cc), each the operations written here in their order, no contraction
// into FMAs: the same bits on every path.
// The backward's sums over n values (n a multiple of 8), lane l taking elements l, l + 8, ...:
//   a[l] += d[i];  b[l] += d[i] * ((x[i] - mu) * rs).
void norm_sums8(const float* d, const float* x, int64_t n, float mu, float rs, float* a, float* b);
// The statistics' sums over n values (n a multiple of 8), lane l taking elements l, l + 8, ...:
// acc[l] += x[i] (squares false), or with d = x[i] - mu, acc[l] += d * d (squares true).
void norm_stat_sums8(const float* x, int64_t n, float mu, bool squares, float* acc);
// The backward's dx: out[i] = ((d[i] * scale) - shift) - (((x[i] - mu) * rs) * slope).
void norm_dx_row(const float* d, const float* x, int64_t n, float mu, float rs, float scale,
                 float shift, float slope, float* out);
// The forward's affine: out[i] = x[i] * scale + shift.
void norm_affine_row(const float* x, int64_t n, float scale, float shift, float* out);
// For 16-bit rows (t: f16 or bf16), the same arithmetic with the conversion in the same pass:
// norm_stat_sums8's sums (squares false) of a row stored in t, its values (widened exactly) also
// written to out[0, n); and norm_affine_row's values stored in t, each rounded to nearest even
// as convert() rounds it.
void norm_sum_widen8(const void* x, DType t, int64_t n, float* out, float* acc);
void norm_affine_row_to(const float* x, int64_t n, float scale, float shift, void* out, DType t);
// The backward's: norm_sums8 over d and x stored in dt and xt (f32, f16 or bf16), each 16-bit
// operand's values also written to dout / xout (unused for an f32 operand); and norm_dx_row's
// values stored in t (f16 or bf16), rounded as convert() rounds them.
void norm_sums8_widen(const void* d, DType dt, const void* x, DType xt, int64_t n, float mu,
                      float rs, float* dout, float* xout, float* a, float* b);
void norm_dx_row_to(const float* d, const float* x, int64_t n, float mu, float rs, float scale,
                    float shift, float slope, void* out, DType t);

// ---- Lane-split dot products (inner-product GEMM: C = A B^T with both operands contiguous
// along K, read in place, nothing packed). For long K and few outputs (a linear layer's forward
// at a small batch, a convolution's weight gradient), where packing an operand would cost as much
// as the multiply-adds.
// Arithmetic, on every path: eight lane sums per output, P[i][j][l] accumulating with FMA, in
// increasing k, the products with k = l (mod 8); the sums carry across calls (K may be split into
// calls in order), and dot_lanes_finish adds the lanes in one fixed tree:
//   ((P0 + P4) + (P2 + P6)) + ((P1 + P5) + (P3 + P7)).
// Rows of A at a + i * lda; rows of B at b + b_row[j]; P is (M, N, 8) FP32.
inline constexpr int kDotLanes = 8;
// How the AVX2 tiles read B's rows: FP32, 16-bit values widened, or FP32 values rounded to 16 bits
// (nearest even) as they are read.
enum class DotRow { kF32, kF16, kBF16, kF32AsF16, kF32AsBF16 };
void dot_lanes_accumulate(int64_t M, int64_t N, int64_t K, const float* a, int64_t lda,
                          const float* b, const int64_t* b_row, float* P, int threads);
float dot_lanes_finish(const float* lanes);
// The same with A stored in f32, f16 or bf16 (at; a and lda in elements) and B in f32, f16 or bf16
// (bt; b_row in elements): 16-bit values are widened exactly (B's by the SIMD tiles as they read
// them, or a depth pass at a time on the scalar path; A's a depth pass at a time by each thread),
// so the sums are those of FP32 rows holding the same values (a 16-bit model's linear layer reads
// its input and weights once, in 16 bits).
void dot_lanes_accumulate(int64_t M, int64_t N, int64_t K, const void* a, DType at, int64_t lda,
                          const void* b, DType bt, const int64_t* b_row, float* P, int threads);
// The same with FP32 B rows read as if stored in `round_to` (f16 or bf16): each value is rounded
// to nearest even to that type as it is read (SIMD) or staged (scalar path), so the sums are those
// of the 16-bit copy of B, which is never made (autocast's linear reads its FP32 weight so).
void dot_lanes_accumulate_rounded(int64_t M, int64_t N, int64_t K, const void* a, DType at,
                                  int64_t lda, const float* b, DType round_to, const int64_t* b_row,
                                  float* P, int threads);
// v[0, n) rounded to nearest even to `t` (f16 or bf16) and back to FP32, in place: the values a
// 16-bit copy would hold.
void round_through(float* v, int64_t n, DType t);
// The scalar reference of the same arithmetic (the oracle of the tests).
void dot_lanes_accumulate_reference(int64_t M, int64_t N, int64_t K, const float* a, int64_t lda,
                                    const float* b, const int64_t* b_row, float* P);

// ---- Winograd F(2x2, 3x3) transforms (conv_winograd.cc), up to kWinoTiles tiles at a time.
// Input: tile l's 4x4 input d starts at in[l], rows ld apart; v[xi * vs + l] = (B^T d B)[xi],
// xi = 4 * row + column, computed as
//   e[0][b] = d[0][b] - d[2][b], e[1][b] = d[1][b] + d[2][b], e[2][b] = d[2][b] - d[1][b],
//   e[3][b] = d[1][b] - d[3][b]; then the same along each row of e.
// Output: tile l's 4x4 products at m[xi * ms + l]; its 2x2 result, A^T m A + bias, goes to out[l]
// and out[l] + ld (elements of dtype t: f32, f16 or bf16), computed as
// r[0][b] = (m[0][b] + m[1][b]) + m[2][b], r[1][b] = (m[1][b] - m[2][b]) - m[3][b], then
// y[a][0] = ((r[a][0] + r[a][1]) + r[a][2]) + bias, y[a][1] = ((r[a][1] - r[a][2]) - r[a][3]) +
// bias, rounded once to nearest even into t (a 16-bit output is written from the FP32 registers).
// Every path does these operations in this order: identical bits.
inline constexpr int kWinoTiles = 8;
void winograd_input_f32(const float* const* in, int n, int64_t ld, float* v, int64_t vs);
// Filters: n 3x3 filters (filter c's rows g[0..2] at f + 9 c, row-major) to their 4x4 transforms,
// u[xi * us + c] = (G g G^T)[xi], computed as
//   t[0][j] = g[0][j], t[1][j] = 0.5 * ((g[0][j] + g[1][j]) + g[2][j]),
//   t[2][j] = 0.5 * ((g[0][j] - g[1][j]) + g[2][j]), t[3][j] = g[2][j];
// then the same along each row of t. Eight filters a vector on the AVX2 path.
void winograd_filter_f32(const float* f, int64_t n, float* u, int64_t us);
void winograd_output(const float* m, int64_t ms, int n, float bias, void* const* out, int64_t ld,
                     DType t);
// The weight gradient's transforms (the forward's transposed). Output gradients: tile l's 2x2
// output gradient e starts at in[l], rows ld apart; v[xi * vs + l] = (A e A^T)[xi], computed as
//   r[0][b] = e[0][b], r[1][b] = e[0][b] + e[1][b], r[2][b] = e[0][b] - e[1][b],
//   r[3][b] = -e[1][b]; then the same along each row of r.
void winograd_dy_f32(const float* const* in, int n, int64_t ld, float* v, int64_t vs);
// Filter gradients: n gradients of transformed filters (gradient c's 4x4 at u[xi * us + c]) to
// the 3x3 filter gradients G^T u G, at f + 9 c (row-major), computed as
//   s[j] = 0.5 * (u[1][j] + u[2][j]), t[0][j] = u[0][j] + s[j], t[1][j] = 0.5 * (u[1][j] -
//   u[2][j]), t[2][j] = s[j] + u[3][j]; then the same along each row of t.
void winograd_filter_grad_f32(const float* u, int64_t us, int64_t n, float* f);
// The input and output-gradient transforms over a run of n tiles of one plane (one call a channel
// and batch of tiles, the dispatch per group of kWinoTiles inside): tile t's values start at
// plane + at[t], rows ld apart; its transform goes to v[xi * vs + t]. The same arithmetic as
// winograd_input_f32 and winograd_dy_f32 on each group.
void winograd_input_run(const float* plane, const int64_t* at, int64_t n, int64_t ld, float* v,
                        int64_t vs);
void winograd_dy_run(const float* plane, const int64_t* at, int64_t n, int64_t ld, float* v,
                     int64_t vs);
// The output transform over a run of n tiles: tile t's products at m[xi * ms + t], its 2x2 result
// to y + at[t] elements of dtype t (f32, f16 or bf16), rows ld apart; as winograd_output.
void winograd_output_run(const float* m, int64_t ms, int64_t n, float bias, void* y,
                         const int64_t* at, int64_t ld, DType t);

// Whether the eight tiles at at[0..8) sit side by side in a row: tile l at at[0] + 2 l.
inline bool row_of_eight(const int64_t* at) {
  for (int l = 1; l < 8; ++l)
    if (at[l] != at[0] + 2 * l) return false;
  return true;
}

#if MANTISSA_HAVE_X86_SIMD
// Eight tiles side by side in a row (tile l at in[0] + 2 l, out[0] + 2 l).
void winograd_input_row8_avx2(const float* in, int64_t ld, float* v, int64_t vs);
void winograd_output_row8_avx2(const float* m, int64_t ms, float bias, void* out, int64_t ld,
                               DType t);
void winograd_dy_row8_avx2(const float* in, int64_t ld, float* v, int64_t vs);
// Runs of tiles (winograd_input_run and its kin): groups of eight by the kernels above, a last
// group of fewer left to the caller (the count done is returned).
int64_t winograd_input_run_avx2(const float* plane, const int64_t* at, int64_t n, int64_t ld,
                                float* v, int64_t vs);
int64_t winograd_dy_run_avx2(const float* plane, const int64_t* at, int64_t n, int64_t ld, float* v,
                             int64_t vs);
int64_t winograd_output_run_avx2(const float* m, int64_t ms, int64_t n, float bias, void* y,
                                 const int64_t* at, int64_t ld, DType t);
// The same runs on AVX-512: sixteen tiles a vector where they are two rows of eight side by side
// (a row of sixteen, or two rows of eight: ResNet's 32- and 16-wide planes), other groups of eight
// by the AVX2 kernels; every lane the same operations, so the same bits.
int64_t winograd_input_run_avx512(const float* plane, const int64_t* at, int64_t n, int64_t ld,
                                  float* v, int64_t vs);
int64_t winograd_dy_run_avx512(const float* plane, const int64_t* at, int64_t n, int64_t ld,
                               float* v, int64_t vs);
int64_t winograd_output_run_avx512(const float* m, int64_t ms, int64_t n, float bias, void* y,
                                   const int64_t* at, int64_t ld, DType t);
// Eight tiles anywhere (tile l at in[l], out[l]).
void winograd_dy_gather8_avx2(const float* const* in, int64_t ld, float* v, int64_t vs);
void winograd_input_gather8_avx2(const float* const* in, int64_t ld, float* v, int64_t vs);
// Eight filters (filter l at f + 9 l) to u[xi * us + l].
void winograd_filter8_avx2(const float* f, float* u, int64_t us);
void winograd_output_gather8_avx2(const float* m, int64_t ms, float bias, void* const* out,
                                  int64_t ld, DType t);
// Tiles of up to 3 rows of A by 4 rows of B, columns [k0, k1) (k0 a multiple of 8), B's rows read
// in place as `kind` says (indexed by k in their own elements); the 16-bit kinds give the values
// convert() would stage, so the same sums.
void dot_lanes_tile_avx2(DotRow kind, int rows_a, int rows_b, int64_t k0, int64_t k1,
                         const float* const* a, const void* const* b, float* const* P);
// Up to kDotColumnRows rows of A against one FP32 row of B read as its BF16 copy (each value
// rounded once for all of them), columns [k0, k1) as above: the driver's tile for kF32AsBF16
// rows when A has that few rows.
inline constexpr int kDotColumnRows = 12;
void dot_lanes_bf16_column_avx2(int rows_a, int64_t k0, int64_t k1, const float* const* a,
                                const float* b, float* const* P);
// Tiles of up to kDotRowsA512 rows of A by 4 rows of B on AVX-512 (vector_avx512.cc), as
// dot_lanes_tile_avx2 takes them (P[i * 4 + j] the lanes of A row i against B row j); every B value
// is read once for all the tile's rows of A, so no column tile is needed.
inline constexpr int kDotRowsA512 = 12;
void dot_lanes_tile_avx512(DotRow kind, int rows_a, int rows_b, int64_t k0, int64_t k1,
                           const float* const* a, const void* const* b, float* const* P);
void relu_row_avx2(const void* x, DType tx, void* y, DType ty, int64_t n);
// The normalization rows (n8: a multiple of 8 values; the others do whole vectors and return the
// count done).
void norm_sums8_avx2(const float* d, const float* x, int64_t n8, float mu, float rs, float* a,
                     float* b);
void norm_stat_sums8_avx2(const float* x, int64_t n8, float mu, bool squares, float* acc);
int64_t norm_dx_row_avx2(const float* d, const float* x, int64_t n, float mu, float rs, float scale,
                         float shift, float slope, float* out);
int64_t norm_dx_row_avx512(const float* d, const float* x, int64_t n, float mu, float rs,
                           float scale, float shift, float slope, float* out);
int64_t norm_affine_row_avx2(const float* x, int64_t n, float scale, float shift, float* out);
int64_t norm_affine_row_avx512(const float* x, int64_t n, float scale, float shift, float* out);
void norm_sum_widen8_avx2(const void* x, DType t, int64_t n8, float* out, float* acc);
void norm_sums8_widen_avx2(const void* d, DType dt, const void* x, DType xt, int64_t n8, float mu,
                           float rs, float* dout, float* xout, float* a, float* b);
int64_t norm_dx_row16_avx512(const float* d, const float* x, int64_t n, float mu, float rs,
                             float scale, float shift, float slope, void* out, DType t);
int64_t norm_affine_row16_avx512(const float* x, int64_t n, float scale, float shift, void* out,
                                 DType t);
void relu_row_avx512(const void* x, DType tx, void* y, DType ty, int64_t n);
void relu_backward_row_avx512(const void* g, DType tg, const void* y, DType ty, void* dx, DType td,
                              int64_t n);
void relu_backward_row_avx2(const void* g, DType tg, const void* y, DType ty, void* dx, DType td,
                            int64_t n);
void conv_rows_f32_avx2(float* y, int64_t ys, int64_t O, const float* bias, const float* w,
                        int64_t ws, const int64_t* tap, const float* const* x, int64_t taps,
                        int64_t n);
void fma_rows_f32_avx2(float* y, int64_t ys, int64_t O, const float* bias, const float* w,
                       int64_t ws, const float* const* x, int64_t taps, int64_t n);
void max_pool_2x2_backward_row_avx512(const void* g, DType tg, const uint8_t* codes, int64_t n,
                                      void* r0, void* r1, DType ty);
// The AVX-512 rows store y in yt themselves; the AVX2 ones store FP32.
void fma_rows_avx512(void* y, DType yt, int64_t ys, int64_t O, const float* bias, const float* w,
                     int64_t ws, const float* const* x, int64_t taps, int64_t n);
void conv_rows_avx512(void* y, DType yt, int64_t ys, int64_t O, const float* bias, const float* w,
                      int64_t ws, const int64_t* tap, const float* const* x, int64_t taps,
                      int64_t n);
void conv_wgrad_rows_f32_avx2(float* lanes, int64_t O, const float* dy, int64_t ds,
                              const float* const* x, int64_t taps, int64_t n);
void axpy_f32_avx2(float* a, const float* x, float w, int64_t n);  // stride 1
// Whole blocks of 8 outputs (n a multiple of 8); block b's codes are the 16 bits at codes + 2b.
void max_pool_2x2_row_avx2(const void* r0, const void* r1, DType tx, int64_t n, void* out, DType ty,
                           uint8_t* codes);
#endif

}  // namespace mantissa::kernels::detail

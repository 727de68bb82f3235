// The fast GEMM against the scalar reference, bit for bit (both follow the arithmetic in gemm.h),
// for every storage combination, layout, edge size and thread count; and against exact results.
#include <gtest/gtest.h>
#include <bit>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "mantissa/kernels/gemm.h"
#include "mantissa/kernels/nn.h"
#include "mantissa/kernels/vector_kernels.h"
#include "mantissa/mantissa.h"

namespace mantissa::kernels {
namespace {

// A matrix of random values stored in `dtype`, row-major or transposed (column-major).
struct Stored {
  std::vector<unsigned char> bytes;
  DType dtype;
  int64_t rows, cols;
  bool transposed;
  ConstMatrix view() const {
    return {bytes.data(), dtype, transposed ? 1 : cols, transposed ? rows : 1};
  }
  Matrix mut() { return {bytes.data(), dtype, transposed ? 1 : cols, transposed ? rows : 1}; }
};

Stored random_matrix(int64_t rows, int64_t cols, DType dtype, bool transposed, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (float& x : v) x = dist(gen);
  Stored s{std::vector<unsigned char>(v.size() * dtype_size(dtype)), dtype, rows, cols, transposed};
  convert(v.data(), DType::f32, s.bytes.data(), dtype, v.size());
  return s;
}

struct Case {
  int64_t M, N, K;
};

void expect_same(int64_t M, int64_t N, int64_t K, DType ta, DType tb, DType tc, bool trans_a,
                 bool trans_b, bool trans_c, float alpha, float beta, Partials p, int threads) {
  const Stored A = random_matrix(M, K, ta, trans_a, 1);
  const Stored B = random_matrix(K, N, tb, trans_b, 2);
  Stored C1 = random_matrix(M, N, tc, trans_c, 3);
  Stored C2 = C1;
  gemm_reference(M, N, K, alpha, A.view(), B.view(), beta, C1.mut(), p);
  GemmOptions opt;
  opt.partials = p;
  opt.threads = threads;
  gemm(M, N, K, alpha, A.view(), B.view(), beta, C2.mut(), opt);
  if (C1.bytes != C2.bytes) {
    std::vector<float> r(static_cast<size_t>(M * N)), f(r.size());
    convert(C1.bytes.data(), tc, r.data(), DType::f32, r.size());
    convert(C2.bytes.data(), tc, f.data(), DType::f32, f.size());
    size_t i = 0;
    while (i < r.size() && std::memcmp(&r[i], &f[i], 4) == 0) ++i;
    FAIL() << "M=" << M << " N=" << N << " K=" << K << " A " << dtype_name(ta)
           << (trans_a ? "^T" : "") << " B " << dtype_name(tb) << (trans_b ? "^T" : "") << " C "
           << dtype_name(tc) << (trans_c ? "^T" : "") << " alpha " << alpha << " beta " << beta
           << " partials " << (p == Partials::kF16 ? "f16" : "f32") << " threads " << threads
           << ": first difference at storage element " << i << ": reference " << r[i] << ", fast "
           << f[i];
  }
}

TEST(Gemm, EveryStorageCombinationMatchesTheReference) {
  const DType types[] = {DType::f32, DType::f16, DType::bf16};
  for (DType ta : types)
    for (DType tb : types)
      for (DType tc : types)
        for (Partials p : {Partials::kF32, Partials::kF16})
          expect_same(13, 35, 300, ta, tb, tc, false, false, false, 1.0f, 0.0f, p, 2);
}

TEST(Gemm, LayoutsEdgesAndScalingMatchTheReference) {
  const Case cases[] = {{1, 1, 1},      {6, 16, 16},   {7, 17, 5},   {5, 3, 0},
                        {12, 100, 513}, {97, 40, 257}, {130, 33, 33}};
  for (const Case& c : cases)
    for (int layout = 0; layout < 8; ++layout)
      for (auto [alpha, beta] :
           {std::pair{1.0f, 0.0f}, std::pair{0.5f, 1.0f}, std::pair{2.0f, -0.75f}})
        expect_same(c.M, c.N, c.K, DType::f32, DType::f16, DType::f32, layout & 1, layout & 2,
                    layout & 4, alpha, beta, Partials::kF32, 2);
}

// An empty product (K = 0) is C = beta C, as the reference computes it, and reads nothing from A
// or B: an empty batch's operands have no storage (null data), which packing would offset.
TEST(Gemm, EmptyProductScalesCWithoutReadingAOrB) {
  for (DType tc : {DType::f32, DType::f16, DType::bf16})
    for (bool trans_c : {false, true})
      for (float beta : {0.0f, 1.0f, -0.75f})
        for (Partials p : {Partials::kF32, Partials::kF16}) {
          Stored want = random_matrix(7, 37, tc, trans_c, 3);
          std::vector<float> big(want.bytes.size() / dtype_size(tc), 70000.0f);  // past FP16
          if (tc == DType::f32) std::memcpy(want.bytes.data(), big.data(), 4 * 3);
          Stored got = want;
          const ConstMatrix none{nullptr, DType::f32, 0, 1};
          gemm_reference(7, 37, 0, 1.0f, none, none, beta, want.mut(), p);
          GemmOptions opt;
          opt.partials = p;
          gemm(7, 37, 0, 1.0f, none, none, beta, got.mut(), opt);
          EXPECT_EQ(got.bytes, want.bytes) << dtype_name(tc) << (trans_c ? "^T" : "") << " beta "
                                           << beta << (p == Partials::kF16 ? " f16 partials" : "");
        }
  float c[2] = {std::nanf(""), 3.0f};  // beta 0 writes zeros, whatever C held
  const ConstMatrix none{nullptr, DType::f16, 0, 1};
  gemm(1, 2, 0, 1.0f, none, none, 0.0f, {c, DType::f32, 2, 1}, {});
  EXPECT_EQ(c[0], 0.0f);
  EXPECT_EQ(c[1], 0.0f);
}

// A 16-bit C of one depth panel (K <= 384) goes tile by tile through a local FP32 tile (beta
// read from C, edges, a strided C); a deeper one is staged in FP32 in blocks of columns.
TEST(Gemm, SixteenBitOutputTileByTileOrStagedInBlocks) {
  expect_same(600, 2100, 40, DType::bf16, DType::bf16, DType::bf16, false, true, false, 1.0f, 1.0f,
              Partials::kF32, 2);
  expect_same(600, 2100, 40, DType::f16, DType::f16, DType::f16, false, false, true, 1.0f, 0.5f,
              Partials::kF16, 2);
  expect_same(13, 2100, 100, DType::f16, DType::f32, DType::f16, false, false, false, 1.0f, -0.75f,
              Partials::kF32, 2);
  expect_same(200, 1500, 500, DType::f16, DType::f16, DType::bf16, false, false, true, 1.0f, 0.5f,
              Partials::kF32, 2);
}

TEST(Gemm, ResultDoesNotDependOnThreads) {
  for (int threads : {1, 2, 3, 8})
    expect_same(150, 260, 300, DType::f32, DType::f32, DType::f32, false, true, false, 1.0f, 0.0f,
                Partials::kF32, threads);
}

// B given by listed rows, columns or both (OffsetMatrix) against the reference on the same matrix
// stored densely. The listed lines are scattered in a larger buffer in a shuffled order, so an
// offset taken from the wrong entry, or a read past a line, gives a different result (NaN fills
// the gaps). With both listed, the columns lie in runs of `run` consecutive floats placed in a
// shuffled order within each row: runs of 16 are read in place, others are packed. With
// kBothRowRuns the rows lie in runs of `run` consecutive floats and the columns are scattered (an
// implicit weight gradient's positions and taps): packed by 8 x 8 transposes where 8 rows are
// consecutive.
enum class Listed { kRows, kColumns, kBoth, kBothRowRuns };

// packed: A packed ahead (PackedMatrix), its slivers in a shuffled order, into a buffer of NaN
// (a sliver placed wrongly or left out shows).
void expect_offset_same(int64_t M, int64_t N, int64_t K, Listed listed, DType ta, DType tc,
                        float beta, Partials p, int threads, int64_t run = 16,
                        bool packed = false) {
  const Stored A = random_matrix(M, K, ta, false, 11);
  const Stored dense = random_matrix(K, N, DType::f32, false, 12);  // (K, N) row-major
  const float* d = reinterpret_cast<const float*>(dense.bytes.data());
  const int64_t gap = 5;
  auto shuffled = [](int64_t n, unsigned seed) {
    std::vector<int64_t> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = i;
    std::shuffle(v.begin(), v.end(), std::mt19937(seed));
    return v;
  };
  std::vector<int64_t> row_off, col_off;
  std::vector<float> buf;
  if (listed == Listed::kBoth) {
    const int64_t runs = (N + run - 1) / run, span = runs * (run + gap);
    const std::vector<int64_t> run_slot = shuffled(runs, 15), row_slot = shuffled(K, 13);
    for (int64_t n = 0; n < N; ++n)
      col_off.push_back(run_slot[static_cast<size_t>(n / run)] * (run + gap) + n % run);
    for (int64_t k = 0; k < K; ++k)
      row_off.push_back(gap + row_slot[static_cast<size_t>(k)] * span);
    buf.assign(static_cast<size_t>(gap + K * span + gap), NAN);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n)
        buf[static_cast<size_t>(row_off[static_cast<size_t>(k)] +
                                col_off[static_cast<size_t>(n)])] = d[k * N + n];
  } else if (listed == Listed::kBothRowRuns) {
    const int64_t runs = (K + run - 1) / run, span = gap + runs * (run + gap);
    const std::vector<int64_t> run_slot = shuffled(runs, 15), col_slot = shuffled(N, 13);
    for (int64_t k = 0; k < K; ++k)
      row_off.push_back(gap + run_slot[static_cast<size_t>(k / run)] * (run + gap) + k % run);
    for (int64_t n = 0; n < N; ++n) col_off.push_back(col_slot[static_cast<size_t>(n)] * span);
    buf.assign(static_cast<size_t>(N * span + gap), NAN);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n)
        buf[static_cast<size_t>(row_off[static_cast<size_t>(k)] +
                                col_off[static_cast<size_t>(n)])] = d[k * N + n];
  } else {
    const bool rows = listed == Listed::kRows;
    const int64_t lines = rows ? K : N, len = rows ? N : K;
    const std::vector<int64_t> order = shuffled(lines, 13);
    std::vector<int64_t>& offset = rows ? row_off : col_off;
    offset.resize(static_cast<size_t>(lines));
    buf.assign(static_cast<size_t>(lines * (len + gap) + gap), NAN);
    for (int64_t slot = 0; slot < lines; ++slot) {
      const int64_t line = order[static_cast<size_t>(slot)], at = gap + slot * (len + gap);
      offset[static_cast<size_t>(line)] = at;
      for (int64_t e = 0; e < len; ++e)
        buf[static_cast<size_t>(at + e)] = rows ? d[line * N + e] : d[e * N + line];
    }
  }
  OffsetMatrix B;
  B.data = buf.data();
  B.row_offset = row_off.empty() ? nullptr : row_off.data();
  B.col_offset = col_off.empty() ? nullptr : col_off.data();
  Stored C1 = random_matrix(M, N, tc, false, 14);
  Stored C2 = C1;
  gemm_reference(M, N, K, 1.0f, A.view(), dense.view(), beta, C1.mut(), p);
  GemmOptions opt;
  opt.partials = p;
  opt.threads = threads;
  std::vector<float> panels(packed_floats(M, K), NAN);
  if (packed) {
    const PackedMatrix pa{panels.data(), M, K};
    const int64_t slivers = (M + kPackedSliverRows - 1) / kPackedSliverRows;
    std::vector<int64_t> order(static_cast<size_t>(slivers));
    for (int64_t i = 0; i < slivers; ++i) order[static_cast<size_t>(i)] = i;
    std::shuffle(order.begin(), order.end(), std::mt19937(17));
    for (const int64_t i : order) {
      const int64_t r0 = i * kPackedSliverRows;
      pack_rows(pa, r0, std::min(kPackedSliverRows, M - r0),
                {A.bytes.data() + r0 * K * dtype_size(ta), ta, K, 1});
    }
    gemm(N, pa, B, beta, C2.mut(), opt);
  } else {
    gemm(M, N, K, 1.0f, A.view(), B, beta, C2.mut(), opt);
  }
  static const char* const kListed[] = {"rows", "columns", "both", "both (row runs)"};
  EXPECT_EQ(C1.bytes, C2.bytes) << (packed ? "packed A, " : "") << "M=" << M << " N=" << N
                                << " K=" << K << " " << kListed[static_cast<int>(listed)]
                                << " listed (runs of " << run << "), A " << dtype_name(ta) << " C "
                                << dtype_name(tc) << " beta " << beta << " threads " << threads;
}

TEST(Gemm, OffsetMatrixMatchesTheReference) {
  const Case cases[] = {{1, 1, 1},      {6, 16, 16},   {7, 17, 5},   {12, 100, 125},
                        {13, 1100, 40}, {70, 45, 400}, {5, 3000, 12}};
  for (const Case& c : cases)
    for (Listed listed : {Listed::kRows, Listed::kColumns, Listed::kBoth})
      for (int threads : {1, 2, 3}) {
        expect_offset_same(c.M, c.N, c.K, listed, DType::f32, DType::f32, 0.0f, Partials::kF32,
                           threads);
        expect_offset_same(c.M, c.N, c.K, listed, DType::bf16, DType::f16, 0.5f, Partials::kF16,
                           threads);
      }
}

// Both tables listed, as the dense implicit convolution lists output rows of 32, 16, 8 and 4
// (read in place, or packed in runs of 8 or 4) and rows of other widths (packed column by column);
// N past one column block (1024) and K past one depth panel (384); M past one block of rows (96),
// where consecutive slivers are packed too.
TEST(Gemm, OffsetMatrixWithBothTablesReadsRunsInPlaceOrPacked) {
  for (int64_t run : {32, 16, 8, 4, 5, 1})
    for (const Case& c :
         {Case{13, 1100, 40}, Case{7, 64, 400}, Case{20, 2056, 9}, Case{100, 70, 30}}) {
      expect_offset_same(c.M, c.N, c.K, Listed::kBoth, DType::f32, DType::f32, 0.0f, Partials::kF32,
                         2, run);
      expect_offset_same(c.M, c.N, c.K, Listed::kBoth, DType::f16, DType::bf16, 1.0f,
                         Partials::kF16, 1, run);
    }
}

// Rows in runs, columns scattered: 8 x 8 transposes where 8 or more rows are consecutive (runs
// of 32, 8 and 12, which leave 4), row by row otherwise (runs of 3); partial slivers (N = 45, 13).
TEST(Gemm, OffsetMatrixWithRowRunsPacksByTransposes) {
  for (int64_t run : {32, 8, 12, 3})
    for (const Case& c : {Case{13, 45, 400}, Case{70, 13, 50}, Case{6, 1040, 20}}) {
      expect_offset_same(c.M, c.N, c.K, Listed::kBothRowRuns, DType::f32, DType::f32, 0.0f,
                         Partials::kF32, 2, run);
      expect_offset_same(c.M, c.N, c.K, Listed::kBothRowRuns, DType::bf16, DType::f32, 0.5f,
                         Partials::kF16, 1, run);
    }
}

// A packed ahead gives the bits of gemm given A: M past one block of rows (96) and a partial
// last sliver, K past one and two depth panels (384), every table, thread counts, beta, FP16
// partials, a 16-bit A.
TEST(Gemm, PackedAGivesTheBitsOfItsMatrix) {
  for (const Case& c :
       {Case{1, 40, 5}, Case{6, 70, 384}, Case{7, 33, 400}, Case{100, 64, 130}, Case{200, 90, 800}})
    for (Listed listed : {Listed::kRows, Listed::kColumns, Listed::kBoth})
      for (int threads : {1, 2, 3}) {
        expect_offset_same(c.M, c.N, c.K, listed, DType::f32, DType::f32, 0.0f, Partials::kF32,
                           threads, 16, true);
        expect_offset_same(c.M, c.N, c.K, listed, DType::bf16, DType::f16, 0.5f, Partials::kF16,
                           threads, 16, true);
      }
}

// A and B both packed ahead (PackedMatrix, PackedPanels) give the reference's bits: a partial
// last sliver of B whose columns past N hold other finite values, N past one column block (1024),
// K past one and two depth panels (384), M past one block of rows (96), thread counts, beta, a
// 16-bit C, FP16 partials.
TEST(Gemm, PackedBGivesTheBitsOfItsMatrix) {
  for (const Case& c : {Case{1, 40, 5}, Case{6, 16, 384}, Case{64, 1100, 64}, Case{100, 45, 400},
                        Case{200, 90, 800}})
    for (int threads : {1, 2, 3})
      for (const bool f16 : {false, true}) {
        const DType tc = f16 ? DType::f16 : DType::f32;
        const float beta = f16 ? 0.5f : 0.0f;
        const Partials p = f16 ? Partials::kF16 : Partials::kF32;
        const Stored A = random_matrix(c.M, c.K, DType::f32, false, 21);
        const Stored B = random_matrix(c.K, c.N, DType::f32, false, 22);
        const float* b = reinterpret_cast<const float*>(B.bytes.data());
        const int64_t slivers = (c.N + 15) / 16;
        std::vector<float> buffer(static_cast<size_t>(slivers * c.K * 16 + 16), 3.0f);
        float* panels =
            buffer.data() + (16 - reinterpret_cast<uintptr_t>(buffer.data()) % 64 / 4) % 16;
        for (int64_t k = 0; k < c.K; ++k)
          for (int64_t n = 0; n < c.N; ++n)
            panels[(n / 16 * c.K + k) * 16 + n % 16] = b[k * c.N + n];
        std::vector<float> pa_data(packed_floats(c.M, c.K), NAN);
        const PackedMatrix pa{pa_data.data(), c.M, c.K};
        for (int64_t r0 = 0; r0 < c.M; r0 += kPackedSliverRows)
          pack_rows(pa, r0, std::min(kPackedSliverRows, c.M - r0),
                    {A.bytes.data() + r0 * c.K * sizeof(float), DType::f32, c.K, 1});
        Stored C1 = random_matrix(c.M, c.N, tc, false, 23);
        Stored C2 = C1;
        gemm_reference(c.M, c.N, c.K, 1.0f, A.view(), B.view(), beta, C1.mut(), p);
        GemmOptions opt;
        opt.partials = p;
        opt.threads = threads;
        gemm(c.N, pa, PackedPanels{panels, c.K}, beta, C2.mut(), opt);
        EXPECT_EQ(C1.bytes, C2.bytes) << "M=" << c.M << " N=" << c.N << " K=" << c.K << " C "
                                      << dtype_name(tc) << " threads " << threads;
      }
  alignas(64) float x[32] = {};
  const PackedMatrix a{x, 1, 2};
  EXPECT_THROW(gemm(1, a, PackedPanels{x, 1}, 0.0f, {x, DType::f32, 1, 1}), Error);      // depth
  EXPECT_THROW(gemm(1, a, PackedPanels{x + 1, 2}, 0.0f, {x, DType::f32, 1, 1}), Error);  // align
}

TEST(Gemm, OffsetMatrixNeedsATable) {
  const float x = 1.0f;
  float y = 0.0f;
  OffsetMatrix none{&x, nullptr, nullptr};
  EXPECT_THROW(gemm(1, 1, 1, 1.0f, {&x, DType::f32, 1, 1}, none, 0.0f, {&y, DType::f32, 1, 1}),
               Error);
}

// An FP32 B with contiguous rows is packed by copying straight from its rows: the edges of that
// path (a partial last sliver, several column blocks, beta, FP16 partials, strided C).
TEST(Gemm, Fp32RowsOfBPackedDirectly) {
  for (const Case& c : {Case{13, 2061, 100}, Case{64, 40, 700}, Case{14, 16, 1}, Case{5, 15, 3}})
    for (int layout : {0, 4})
      for (Partials p : {Partials::kF32, Partials::kF16})
        expect_same(c.M, c.N, c.K, DType::f16, DType::f32, DType::f32, false, false, layout & 4,
                    1.0f, 0.25f, p, 2);
}

// An FP32 B with contiguous rows against at most 12 rows of A is read in place by its rows: a
// partial last sliver (packed), several column blocks and depth panels, beta, FP16 partials,
// strided C, one and two threads.
TEST(Gemm, SmallMFp32RowsOfBReadInPlace) {
  for (const Case& c : {Case{12, 2061, 100}, Case{1, 17, 3}, Case{7, 40, 700}, Case{6, 16, 1}})
    for (int layout : {0, 4})
      for (Partials p : {Partials::kF32, Partials::kF16})
        for (int threads : {1, 2})
          expect_same(c.M, c.N, c.K, DType::f32, DType::f32, DType::f32, false, false, layout & 4,
                      1.0f, 0.25f, p, threads);
}

// FP32 values that test a rounding to FP16 and BF16: ties of both parities, values past the
// 16-bit ranges, FP16 subnormals and values that round to zero, an FP32 subnormal, infinities and
// NaNs with payloads (one signalling).
std::vector<float> rounding_specials() {
  return {1.0f + 0x1p-11f,
          1.0f + 3 * 0x1p-11f,
          1.0f + 0x1p-8f,
          1.0f + 3 * 0x1p-8f,
          65520.0f,
          -70000.0f,
          3e38f,
          0x1p-20f,
          0x1p-25f,
          -0x1p-30f,
          1e-40f,
          INFINITY,
          -INFINITY,
          std::bit_cast<float>(0x7fc12345u),
          std::bit_cast<float>(0xff812345u)};
}

// The same in-place reading of B's full slivers for a 16-bit B (widened as read), against the
// reference bit for bit: FP32 and BF16 outputs, both partials, two depth panels, a partial last
// sliver (packed), 1 and 2 threads; and for one depth panel against one block of A's rows (up to
// 96 rows, several A slivers and a partial one; 97 rows are packed).
TEST(Gemm, SixteenBitRowsOfBReadInPlace) {
  for (const Case& c : {Case{12, 2061, 100}, Case{1, 17, 3}, Case{7, 40, 700}, Case{6, 16, 1},
                        Case{12, 50, 385}, Case{64, 300, 100}, Case{95, 90, 384}, Case{97, 40, 64},
                        Case{100, 1100, 64}, Case{192, 40, 384}, Case{193, 33, 20}})
    for (DType tb : {DType::f16, DType::bf16})
      for (DType tc : {DType::f32, DType::bf16})
        for (Partials p : {Partials::kF32, Partials::kF16})
          for (int threads : {1, 2})
            expect_same(c.M, c.N, c.K, DType::f32, tb, tc, false, false, false, 1.0f, 0.25f, p,
                        threads);
}

// An FP32 B read as its 16-bit copy (round_b) at a small M, where its full slivers are rounded as
// they are read: the reference's product with the rounded copy, bit for bit, with ties of both
// parities, values past the 16-bit range, subnormals, infinities and NaNs among B's values.
TEST(Gemm, SmallMRoundedRowsOfBEqualTheSixteenBitCopy) {
  const std::vector<float> specials = rounding_specials();
  for (const Case& c : {Case{12, 2061, 100}, Case{1, 33, 7}, Case{6, 48, 385}})
    for (DType t : {DType::f16, DType::bf16})
      for (Partials p : {Partials::kF32, Partials::kF16})
        for (int threads : {1, 2}) {
          std::mt19937 gen(static_cast<uint32_t>(c.M * 31 + c.N + c.K));
          std::uniform_real_distribution<float> d(-1.0f, 1.0f);
          std::vector<float> a(static_cast<size_t>(c.M * c.K)), b(static_cast<size_t>(c.K * c.N));
          for (float& v : a) v = d(gen);
          for (float& v : b) v = d(gen);
          for (size_t q = 0; q < specials.size(); ++q) b[(q * 977 + 5) % b.size()] = specials[q];
          std::vector<float> held = b;
          detail::round_through(held.data(), static_cast<int64_t>(held.size()), t);
          std::vector<float> want(static_cast<size_t>(c.M * c.N), 0.5f), got = want;
          gemm_reference(c.M, c.N, c.K, 1.0f, {a.data(), DType::f32, c.K, 1},
                         {held.data(), DType::f32, c.N, 1}, 0.25f,
                         {want.data(), DType::f32, c.N, 1}, p);
          GemmOptions opt;
          opt.partials = p;
          opt.threads = threads;
          opt.round_b = t;
          gemm(c.M, c.N, c.K, 1.0f, {a.data(), DType::f32, c.K, 1}, {b.data(), DType::f32, c.N, 1},
               0.25f, {got.data(), DType::f32, c.N, 1}, opt);
          EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0)
              << c.M << " x " << c.N << " x " << c.K << " " << dtype_name(t) << " threads "
              << threads;
        }
}

// An FP32 C rounded to 16 bits as it is stored (round_c) holds the values of the 16-bit C the
// same GEMM gives, widened: small M with B rows read in place (FP32, and FP32 read as 16-bit),
// packed B, one depth panel (C tile by tile) and three (C staged), beta 0 and not, 1 and 2
// threads; products past FP16's range overflow alike.
TEST(Gemm, RoundedFp32OutputHoldsTheSixteenBitOutputsValues) {
  for (const Case& c : {Case{12, 2061, 100}, Case{70, 90, 33}, Case{3, 20, 5}, Case{12, 300, 700}})
    for (DType t : {DType::f16, DType::bf16})
      for (DType round_b : {DType::f32, t})
        for (float beta : {0.0f, 0.5f})
          for (int threads : {1, 2}) {
            const Stored A = random_matrix(c.M, c.K, DType::f32, false, 5);
            Stored B = random_matrix(c.K, c.N, DType::f32, false, 6);
            reinterpret_cast<float*>(B.bytes.data())[7] = 1e5f;  // a column past FP16's range
            Stored C16 = random_matrix(c.M, c.N, t, false, 7);
            Stored C32 = random_matrix(c.M, c.N, DType::f32, false, 7);
            convert(C16.bytes.data(), t, C32.bytes.data(), DType::f32,
                    static_cast<size_t>(c.M * c.N));
            GemmOptions opt;
            opt.threads = threads;
            opt.round_b = round_b;
            gemm(c.M, c.N, c.K, 1.0f, A.view(), B.view(), beta, C16.mut(), opt);
            opt.round_c = t;
            gemm(c.M, c.N, c.K, 1.0f, A.view(), B.view(), beta, C32.mut(), opt);
            std::vector<float> want(static_cast<size_t>(c.M * c.N));
            convert(C16.bytes.data(), t, want.data(), DType::f32, want.size());
            EXPECT_EQ(std::memcmp(C32.bytes.data(), want.data(), want.size() * sizeof(float)), 0)
                << c.M << " x " << c.N << " x " << c.K << " " << dtype_name(t) << " round_b "
                << dtype_name(round_b) << " beta " << beta << " threads " << threads;
          }
  GemmOptions opt;  // a 16-bit C is not rounded again: refused
  opt.round_c = DType::f16;
  const float one = 1.0f;
  uint16_t h = 0;
  EXPECT_THROW(gemm(1, 1, 1, 1.0f, {&one, DType::f32, 1, 1}, {&one, DType::f32, 1, 1}, 0.0f,
                    {&h, DType::f16, 1, 1}, opt),
               Error);
}

// The FP32 panels a GEMM packs are workspace: a small call's stay with the thread for the next
// call, and a large call (2^26 multiply-adds or more) that ends with no other GEMM running frees
// every thread's, the small call's among them, after charging its own while it ran.
TEST(Gemm, ALargeCallFreesThePanelsWhenItEnds) {
  MemoryTracker& tracker = default_memory_tracker();
  release_gemm_buffers();  // what the tests before left
  const size_t before = tracker.stats().current_of(MemoryCategory::workspace);
  GemmOptions opt;
  opt.threads = 1;  // one thread packs every column of B
  const Stored a = random_matrix(50, 700, DType::f32, false, 1);
  const Stored b = random_matrix(700, 300, DType::f32, false, 2);
  Stored c = random_matrix(50, 300, DType::f32, false, 3);
  gemm(50, 300, 700, 1.0f, a.view(), b.view(), 0.0f, c.mut(), opt);  // 10.5 M multiply-adds
  EXPECT_GE(tracker.stats().current_of(MemoryCategory::workspace), before + 300 * 384 * 4);
  for (DType tb : {DType::f32, DType::f16}) {
    const Stored A = random_matrix(64, 1000, DType::f32, false, 4);
    const Stored B = random_matrix(1000, 1100, tb, false, 5);  // deeper than a panel: packed
    Stored C = random_matrix(64, 1100, DType::f32, false, 6);
    tracker.reset_peaks();
    gemm(64, 1100, 1000, 1.0f, A.view(), B.view(), 0.0f, C.mut(), opt);  // 70.4 M
    const MemoryStats after = tracker.stats();
    EXPECT_EQ(after.current_of(MemoryCategory::workspace), before) << dtype_name(tb);
    EXPECT_GE(after.peak_of(MemoryCategory::workspace), before + 1024 * 384 * 4) << dtype_name(tb);
  }
}

// GEMMs called at once from several threads (a library user's, or a kernel's tasks) each give the
// reference's bits while the others start, end and free the buffers of every thread
// (ThreadSanitizer checks the hand-over in the threads build).
TEST(Gemm, ConcurrentCallsFromSeveralThreads) {
  // Small and large calls (the large ones free every thread's buffers when they end last).
  const Case cases[] = {{50, 300, 700}, {7, 1100, 64}, {64, 1100, 1000}, {13, 35, 300}};
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 3; ++t)
    threads.emplace_back([&, t] {
      for (int round = 0; round < 6; ++round) {
        const Case& c = cases[(t + round) % 4];
        const Stored A = random_matrix(c.M, c.K, DType::f32, false, 1);
        const Stored B = random_matrix(c.K, c.N, round % 2 ? DType::f16 : DType::f32, false, 2);
        Stored C1 = random_matrix(c.M, c.N, DType::f32, false, 3), C2 = C1;
        gemm_reference(c.M, c.N, c.K, 1.0f, A.view(), B.view(), 0.5f, C1.mut());
        GemmOptions opt;
        opt.threads = 1 + round % 2;
        gemm(c.M, c.N, c.K, 1.0f, A.view(), B.view(), 0.5f, C2.mut(), opt);
        if (C1.bytes != C2.bytes) ++wrong;
      }
    });
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
}

TEST(Gemm, ExactOnSmallIntegers) {
  // Products and sums of small integers are exact in FP32 and in FP16 partials (below 2048).
  const int64_t M = 20, N = 30, K = 40;
  std::vector<float> a(M * K), b(K * N), c(M * N, NAN);
  for (int64_t i = 0; i < M * K; ++i) a[i] = static_cast<float>((i * 7) % 5 - 2);
  for (int64_t i = 0; i < K * N; ++i) b[i] = static_cast<float>((i * 3) % 7 - 3);
  for (Partials p : {Partials::kF32, Partials::kF16}) {
    GemmOptions opt;
    opt.partials = p;
    gemm(M, N, K, 1.0f, {a.data(), DType::f32, K, 1}, {b.data(), DType::f32, N, 1}, 0.0f,
         {c.data(), DType::f32, N, 1}, opt);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double want = 0;
        for (int64_t k = 0; k < K; ++k) want += static_cast<double>(a[m * K + k]) * b[k * N + n];
        ASSERT_EQ(c[m * N + n], want) << m << "," << n;  // beta = 0: the NaN in C never leaks
      }
  }
}

TEST(Gemm, F16PartialsLoseWhatFp16Loses) {
  // C starts at 4096 (FP16 ulp 4); each chunk of 16 products of 0.1 adds 1.6, less than half an
  // ulp, so FP16 partials never move while FP32 partials reach 4096 + 409.6.
  const int64_t K = 4096;
  std::vector<float> a(K, 0.1f), b(K, 1.0f);
  float c = 4096.0f;
  gemm(1, 1, K, 1.0f, {a.data(), DType::f32, K, 1}, {b.data(), DType::f32, 1, 1}, 1.0f,
       {&c, DType::f32, 1, 1});
  EXPECT_NEAR(c, 4505.6f, 1.0f);  // FP32 rounds too (ulp 2^-11 at 4096), 4096 times
  c = 4096.0f;
  GemmOptions opt;
  opt.partials = Partials::kF16;
  gemm(1, 1, K, 1.0f, {a.data(), DType::f32, K, 1}, {b.data(), DType::f32, 1, 1}, 1.0f,
       {&c, DType::f32, 1, 1}, opt);
  EXPECT_EQ(c, 4096.0f);
  // The same chunk with 2.0 per product (32 per chunk) is representable and is kept.
  std::fill(a.begin(), a.end(), 2.0f);
  c = 0.0f;
  gemm(1, 1, K, 1.0f, {a.data(), DType::f32, K, 1}, {b.data(), DType::f32, 1, 1}, 0.0f,
       {&c, DType::f32, 1, 1}, opt);
  EXPECT_EQ(c, 8192.0f);
}

TEST(Gemm, RejectsUnsupportedDtypes) {
  int32_t x = 0;
  float y = 0;
  EXPECT_THROW(gemm(1, 1, 1, 1.0f, {&x, DType::i32, 1, 1}, {&y, DType::f32, 1, 1}, 0.0f,
                    {&y, DType::f32, 1, 1}),
               Error);
  EXPECT_THROW(gemm(1, 1, 1, 1.0f, {&y, DType::f32, 1, 1}, {&y, DType::f32, 1, 1}, 0.0f,
                    {&x, DType::i32, 1, 1}),
               Error);
}

}  // namespace
}  // namespace mantissa::kernels

namespace mantissa::kernels::detail {
namespace {

// Lane-split dot products: the fast tiles (3 x 4 in registers, partial tiles, tails of K) against
// the scalar reference, bit for bit, for any thread count, and carrying lanes across calls.
TEST(DotLanes, MatchesTheReferenceBitForBit) {
  struct Shape3 {
    int64_t M, N, K;
  };
  for (const Shape3& s : {Shape3{1, 1, 1}, Shape3{3, 4, 8}, Shape3{12, 100, 3001},
                          Shape3{5, 7, 2053}, Shape3{12, 125, 40}, Shape3{2, 9, 7}}) {
    std::mt19937 gen(static_cast<uint32_t>(s.M * 131 + s.N * 7 + s.K));
    std::uniform_real_distribution<float> d(-1.0f, 1.0f);
    const int64_t lda = s.K + 3;
    std::vector<float> a(static_cast<size_t>(s.M * lda)), b(static_cast<size_t>(s.N * (s.K + 5)));
    for (float& v : a) v = d(gen);
    for (float& v : b) v = d(gen);
    std::vector<int64_t> rows(static_cast<size_t>(s.N));  // B's rows in reverse order
    for (int64_t j = 0; j < s.N; ++j) rows[static_cast<size_t>(j)] = (s.N - 1 - j) * (s.K + 5) + 2;
    std::vector<float> want(static_cast<size_t>(s.M * s.N * kDotLanes), 0.5f);
    const int64_t split = s.K / 3;  // two calls: [0, split) then the rest
    dot_lanes_accumulate_reference(s.M, s.N, split, a.data(), lda, b.data(), rows.data(),
                                   want.data());
    std::vector<int64_t> rows2 = rows;
    for (int64_t& r : rows2) r += split;
    dot_lanes_accumulate_reference(s.M, s.N, s.K - split, a.data() + split, lda, b.data(),
                                   rows2.data(), want.data());
    for (int threads : {1, 2, 3}) {
      std::vector<float> got(want.size(), 0.5f);
      dot_lanes_accumulate(s.M, s.N, split, a.data(), lda, b.data(), rows.data(), got.data(),
                           threads);
      dot_lanes_accumulate(s.M, s.N, s.K - split, a.data() + split, lda, b.data(), rows2.data(),
                           got.data(), threads);
      EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0)
          << s.M << " x " << s.N << " x " << s.K << ", threads " << threads;
    }
    // And the dot products themselves are right (FP64 check of the finished sums).
    for (int64_t i = 0; i < s.M; ++i)
      for (int64_t j = 0; j < s.N; ++j) {
        double exact = 8 * 0.5;
        for (int64_t k = 0; k < s.K; ++k)
          exact += static_cast<double>(a[static_cast<size_t>(i * lda + k)]) *
                   b[static_cast<size_t>(rows[static_cast<size_t>(j)] + k)];
        const float got = dot_lanes_finish(want.data() + (i * s.N + j) * kDotLanes);
        EXPECT_NEAR(got, exact, 1e-5 * std::sqrt(static_cast<double>(s.K)) + 1e-6);
      }
  }
}

// Rows of B in reverse order (row j at (N - 1 - j) * ldb + 2), shifted by `shift` elements.
std::vector<int64_t> reversed_rows(int64_t N, int64_t ldb, int64_t shift) {
  std::vector<int64_t> rows(static_cast<size_t>(N));
  for (int64_t j = 0; j < N; ++j) rows[static_cast<size_t>(j)] = (N - 1 - j) * ldb + 2 + shift;
  return rows;
}

// The FP32 path's lane sums over FP32 rows b (from 0.25), in two calls split at `split`.
std::vector<float> fp32_rows_sums(int64_t M, int64_t N, int64_t K, int64_t split,
                                  const std::vector<float>& a, int64_t lda,
                                  const std::vector<float>& b, const std::vector<int64_t>& rows,
                                  const std::vector<int64_t>& rows2) {
  std::vector<float> want(static_cast<size_t>(M * N * kDotLanes), 0.25f);
  dot_lanes_accumulate(M, N, split, a.data(), lda, b.data(), rows.data(), want.data(), 1);
  dot_lanes_accumulate(M, N, K - split, a.data() + split, lda, b.data(), rows2.data(), want.data(),
                       1);
  return want;
}

// The FP32 values a 16-bit copy of v (in t) holds, and that copy's encodings.
std::vector<float> held_values(std::vector<float> v, DType t) {
  if (t != DType::f32) round_through(v.data(), static_cast<int64_t>(v.size()), t);
  return v;
}
std::vector<uint16_t> encodings(const std::vector<float>& v, DType t) {
  std::vector<uint16_t> h(v.size());
  convert(v.data(), DType::f32, h.data(), t, v.size());
  return h;
}

// 16-bit B rows (f16, bf16) read in place, and A rows in f32, f16 or bf16 (a 16-bit A widened a
// depth pass at a time): the same sums, bit for bit, as the FP32 path on FP32 rows holding the
// same values (several depth passes, partial tiles, 5 and 13 rows of A, calls split at a depth
// that is not a multiple of 8, 1-3 threads).
TEST(DotLanes, SixteenBitRowsGiveTheFp32RowsSums) {
  const int64_t max_m = 13, N = 7, K = 2500, ldb = K + 5, lda = K + 3;
  std::mt19937 gen(17);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> a32(static_cast<size_t>(max_m * lda)), b32(static_cast<size_t>(N * ldb));
  for (float& v : a32) v = d(gen);
  for (const DType bt : {DType::f16, DType::bf16}) {
    for (float& v : b32) v = d(gen);
    const std::vector<float> b_held = held_values(b32, bt);
    const std::vector<uint16_t> b16 = encodings(b_held, bt);
    for (const DType at : {DType::f32, DType::f16, DType::bf16}) {
      const std::vector<float> a_held = held_values(a32, at);
      const std::vector<uint16_t> a16 =
          at == DType::f32 ? std::vector<uint16_t>{} : encodings(a_held, at);
      const void* a = at == DType::f32 ? static_cast<const void*>(a_held.data()) : a16.data();
      const size_t a_size = dtype_size(at);
      const int64_t split = 1029;
      const std::vector<int64_t> rows = reversed_rows(N, ldb, 0),
                                 rows2 = reversed_rows(N, ldb, split);
      for (const int64_t M : {int64_t{5}, max_m}) {
        const std::vector<float> want =
            fp32_rows_sums(M, N, K, split, a_held, lda, b_held, rows, rows2);
        for (int threads : {1, 2, 3}) {
          std::vector<float> got(want.size(), 0.25f);
          dot_lanes_accumulate(M, N, split, a, at, lda, b16.data(), bt, rows.data(), got.data(),
                               threads);
          dot_lanes_accumulate(M, N, K - split, static_cast<const char*>(a) + split * a_size, at,
                               lda, b16.data(), bt, rows2.data(), got.data(), threads);
          EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0)
              << "B " << dtype_name(bt) << ", A " << dtype_name(at) << ", M " << M << ", threads "
              << threads;
        }
      }
    }
  }
}

// FP32 B rows read as their 16-bit copies (dot_lanes_accumulate_rounded, autocast's linear): the
// same sums, bit for bit, as FP32 rows holding the rounded values, where the rows hold ties of both
// parities, values past the 16-bit range, FP16 subnormals and values that round to zero, infinities
// and NaNs with payloads (several depth passes, partial tiles, tails of K, 1-3 threads; A in FP32
// or 16 bits; on AVX2, 1, 5 and 12 rows of A take BF16's column tile, 13 the 3 x 4 tiles).
TEST(DotLanes, RoundedRowsGiveTheSumsOfTheSixteenBitCopy) {
  const int64_t max_m = 13, N = 7, K = 2500, ldb = K + 5, lda = K + 3;
  std::mt19937 gen(29);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> a(static_cast<size_t>(max_m * lda)), b32(static_cast<size_t>(N * ldb));
  for (float& v : a) v = d(gen);
  const std::vector<float> specials = rounding_specials();
  for (const DType bt : {DType::f16, DType::bf16}) {
    for (float& v : b32) v = d(gen);
    // The specials at scattered places of every row (the vector part and the tail).
    for (int64_t j = 0; j < N; ++j)
      for (size_t q = 0; q < specials.size(); ++q)
        b32[static_cast<size_t>(j * ldb + 2 + static_cast<int64_t>(q) * 163 + j)] = specials[q];
    b32[static_cast<size_t>(3 * ldb + 2 + K - 1)] = 1.0f + 0x1p-11f;  // in the last tail
    std::vector<float> held = b32;
    round_through(held.data(), static_cast<int64_t>(held.size()), bt);
    const int64_t split = 1029;
    const std::vector<int64_t> rows = reversed_rows(N, ldb, 0),
                               rows2 = reversed_rows(N, ldb, split);
    // A in FP32, or in the type B is rounded to (autocast's linear: a 16-bit input).
    for (const DType at : {DType::f32, bt}) {
      const std::vector<float> a_held = held_values(a, at);
      const std::vector<uint16_t> a16 =
          at == DType::f32 ? std::vector<uint16_t>{} : encodings(a_held, at);
      const void* ap = at == DType::f32 ? static_cast<const void*>(a_held.data()) : a16.data();
      const size_t a_size = dtype_size(at);
      for (const int64_t M : {int64_t{1}, int64_t{5}, int64_t{12}, max_m}) {
        const std::vector<float> want =
            fp32_rows_sums(M, N, K, split, a_held, lda, held, rows, rows2);
        for (int threads : {1, 2, 3}) {
          std::vector<float> got(want.size(), 0.25f);
          dot_lanes_accumulate_rounded(M, N, split, ap, at, lda, b32.data(), bt, rows.data(),
                                       got.data(), threads);
          dot_lanes_accumulate_rounded(M, N, K - split,
                                       static_cast<const char*>(ap) + split * a_size, at, lda,
                                       b32.data(), bt, rows2.data(), got.data(), threads);
          EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0)
              << dtype_name(bt) << ", A " << dtype_name(at) << ", M " << M << ", threads "
              << threads;
        }
      }
    }
  }
}

TEST(DotLanes, FinishAddsTheLanesInTheDocumentedTree) {
  // 2^24 + 1 - 2^24 shows the order: only adding 1 to 2^24 last (or to another small value
  // first) keeps it.
  const float big = 16777216.0f;
  const float lanes[8] = {big, 1, 0, 1, -big, 0, 0, 0};
  // ((big + -big) + (0 + 0)) + ((1 + 0) + (1 + 0)) = 0 + 2
  EXPECT_EQ(dot_lanes_finish(lanes), 2.0f);
}

}  // namespace
}  // namespace mantissa::kernels::detail

namespace mantissa::kernels {
namespace {

// kernels::linear at a small batch through a deep layer (the lane-split dot-product path for FP32,
// the GEMM for 16-bit operands), with and without a bias, against FP64.
TEST(Linear, SmallBatchDeepLayerMatchesFp64) {
  for (DType t : {DType::f32, DType::bf16})
    for (bool with_bias : {true, false}) {
      const int64_t rows = 10, in = 2051, outf = 37;
      std::mt19937 gen(5);
      std::uniform_real_distribution<float> d(-1.0f, 1.0f);
      std::vector<float> xv(static_cast<size_t>(rows * in)), wv(static_cast<size_t>(outf * in)),
          bv(static_cast<size_t>(outf));
      for (float& v : xv) v = d(gen);
      for (float& v : wv) v = d(gen);
      for (float& v : bv) v = d(gen);
      const Tensor x = Tensor::from_floats(xv, {2, 5, in}, t),
                   w = Tensor::from_floats(wv, {outf, in}, t),
                   b = with_bias ? Tensor::from_floats(bv, {outf}, t) : Tensor();
      const Tensor y = linear(x, w, b, DType::f32);
      ASSERT_EQ(y.shape(), Shape({2, 5, outf}));
      const std::vector<float> xs = x.to_float_vector(), ws = w.to_float_vector(),
                               got = y.to_float_vector();
      const std::vector<float> bs = with_bias ? b.to_float_vector() : std::vector<float>(outf, 0);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < outf; ++j) {
          double want = bs[static_cast<size_t>(j)], magnitude = std::abs(want);
          for (int64_t k = 0; k < in; ++k) {
            const double prod = static_cast<double>(xs[static_cast<size_t>(i * in + k)]) *
                                ws[static_cast<size_t>(j * in + k)];
            want += prod;
            magnitude += std::abs(prod);
          }
          // FP32 accumulation: a few units of 2^-24 of the sum of magnitudes
          EXPECT_NEAR(got[static_cast<size_t>(i * outf + j)], want, 2e-7 * magnitude)
              << dtype_name(t) << (with_bias ? " bias" : "") << " at " << i << ", " << j;
        }
    }
}

// An FP32 weight read as if stored in f16 or bf16 (linear's round_w, matmul's round_b, the GEMM's
// round_b) gives exactly the result of its 16-bit copy, on the lane-split dot products (10 rows
// through 2051 inputs), on the GEMM (40 rows; FP16 partials) and in the product with the weight
// that linear's backward computes; the weights' values are random FP32, so most of them round.
TEST(Linear, Fp32WeightReadAsSixteenBitsEqualsItsSixteenBitCopy) {
  for (DType t : {DType::f16, DType::bf16})
    for (int64_t rows : {10, 40})
      for (Partials p : {Partials::kF32, Partials::kF16}) {
        const int64_t in = 2051, outf = 37;
        std::mt19937 gen(7);
        std::uniform_real_distribution<float> d(-1.0f, 1.0f);
        std::vector<float> xv(static_cast<size_t>(rows * in)), wv(static_cast<size_t>(outf * in)),
            bv(static_cast<size_t>(outf)), gv(static_cast<size_t>(rows * outf));
        for (float& v : xv) v = d(gen);
        for (float& v : wv) v = d(gen);
        for (float& v : bv) v = d(gen);
        for (float& v : gv) v = d(gen);
        const Tensor x = Tensor::from_floats(xv, {rows, in}, t),
                     w32 = Tensor::from_floats(wv, {outf, in}, DType::f32), w16 = w32.to(t),
                     b = Tensor::from_floats(bv, {outf}, DType::f32),
                     g = Tensor::from_floats(gv, {rows, outf}, t);
        ASSERT_NE(w16.to_float_vector(), w32.to_float_vector());
        const std::string where = std::string(dtype_name(t)) + " rows " + std::to_string(rows);
        EXPECT_EQ(linear(x, w32, b, t, p, t).to_float_vector(),
                  linear(x, w16, b, t, p).to_float_vector())
            << where;
        EXPECT_EQ(matmul(g, w32, DType::f32, p, MemoryCategory::gradients, t).to_float_vector(),
                  matmul(g, w16, DType::f32, p, MemoryCategory::gradients).to_float_vector())
            << where;
      }
  // round_b takes an FP32 B and a 16-bit type.
  const Tensor a = Tensor::zeros({2, 3}, DType::f32), b16 = Tensor::zeros({3, 2}, DType::f16);
  EXPECT_THROW(matmul(a, b16, DType::f32, Partials::kF32, MemoryCategory::activations, DType::bf16),
               Error);
  EXPECT_THROW(matmul(a, a.transpose(0, 1), DType::f32, Partials::kF32, MemoryCategory::activations,
                      DType::e4m3),
               Error);
}

// A 16-bit input through the lane-split dot products is widened a depth block at a time: the
// sums are those of its FP32 copy, bit for bit, across several blocks and a partial last one (a
// block that broke the lanes' order would move some products to another lane); the weight
// gradient's parts, widened a column block at a time, equal the FP32 copy's too.
TEST(Linear, SixteenBitInputGivesTheSumsOfItsFp32Copy) {
  for (DType t : {DType::f16, DType::bf16})
    for (DType wt : {DType::f32, t}) {
      const int64_t rows = 12, in = 3 * 8192 + 1237, outf = 13;
      std::mt19937 gen(9);
      std::uniform_real_distribution<float> d(-1.0f, 1.0f);
      std::vector<float> xv(static_cast<size_t>(rows * in)), wv(static_cast<size_t>(outf * in)),
          gv(static_cast<size_t>(rows * outf));
      for (float& v : xv) v = d(gen);
      for (float& v : wv) v = d(gen);
      for (float& v : gv) v = d(gen);
      const Tensor x = Tensor::from_floats(xv, {rows, in}, t), x32 = x.to(DType::f32),
                   w = Tensor::from_floats(wv, {outf, in}, wt),
                   g = Tensor::from_floats(gv, {rows, outf}, DType::f32);
      const std::string where =
          std::string(dtype_name(t)) + " weight " + std::string(dtype_name(wt));
      EXPECT_EQ(linear(x, w, Tensor(), DType::f32).to_float_vector(),
                linear(x32, w, Tensor(), DType::f32).to_float_vector())
          << where;
      auto parts = [&](const Tensor& input) {
        std::vector<float> dw(static_cast<size_t>(outf * in), NAN);
        linear_weight_grad_parts(
            g, input, DType::f32, [&](int64_t begin, int64_t n, const void* v, DType vt) {
              convert(v, vt, dw.data() + begin, DType::f32, static_cast<size_t>(n));
            });
        return dw;
      };
      EXPECT_EQ(parts(x), parts(x32)) << where;
    }
}

// A weight gradient summed over terms (every rank's factors) in parts: each term's values are its
// own gradient's (matmul with FP32 partials, rounded into the output type), added in term order
// in FP32 and rounded once, bit for bit; terms of 12, 7 and 16 rows, 16-bit and FP32 inputs, 13
// outputs (a partial group) by 5000 inputs (a partial column block); the bound holds every value;
// a range of rows gives those rows alone, with the same bits.
TEST(Linear, WeightGradientPartsSummedOverTermsAreTheTermsGradientsAddedInOrder) {
  std::mt19937 gen(21);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  const int64_t outf = 13, in = 5000;
  for (DType out : {DType::f32, DType::f16, DType::bf16}) {
    std::vector<GradFactors> terms;
    for (const int64_t rows : {12, 7, 16}) {
      std::vector<float> gv(static_cast<size_t>(rows * outf)), xv(static_cast<size_t>(rows * in));
      for (float& v : gv) v = d(gen);
      for (float& v : xv) v = d(gen);
      const DType xt = rows == 7 ? DType::f32 : out == DType::f32 ? DType::bf16 : out;
      terms.push_back({Tensor::from_floats(gv, {rows, outf}, DType::f32),
                       Tensor::from_floats(xv, {rows, in}, xt)});
    }
    std::vector<float> want(static_cast<size_t>(outf * in), 0.0f);
    for (size_t k = 0; k < terms.size(); ++k) {
      const std::vector<float> t =
          matmul(terms[k].g.transpose(0, 1), terms[k].x, out, Partials::kF32).to_float_vector();
      for (size_t j = 0; j < want.size(); ++j) want[j] = k == 0 ? t[j] : want[j] + t[j];
    }
    want = Tensor::from_floats(want, {outf, in}).to(out).to_float_vector();
    std::vector<float> got(want.size(), NAN);
    std::vector<int> seen(want.size(), 0);
    linear_weight_grad_parts_sum(terms, out, [&](int64_t begin, int64_t n, const void* v, DType t) {
      EXPECT_EQ(t, out);
      convert(v, t, got.data() + begin, DType::f32, static_cast<size_t>(n));
      for (int64_t j = begin; j < begin + n; ++j) ++seen[static_cast<size_t>(j)];
    });
    EXPECT_EQ(seen, std::vector<int>(want.size(), 1)) << dtype_name(out);
    EXPECT_EQ(got, want) << dtype_name(out);
    const double bound = linear_weight_grad_bound_sum(terms, out);
    for (float v : got) ASSERT_LE(std::fabs(v), bound) << dtype_name(out);
    // A range of rows (a ZeRO shard): those rows alone, each element the same bits; groups start
    // at the range's first row (rows 5 to 11: one group of 6 and a partial one), and an empty
    // range gives nothing.
    for (const auto& [r0, r1] : {std::pair<int64_t, int64_t>{5, 12}, {0, 13}, {12, 13}, {7, 7}}) {
      std::vector<int> in_range(want.size(), 0);
      linear_weight_grad_parts_sum(
          terms, out,
          [&](int64_t begin, int64_t n, const void* v, DType t) {
            std::vector<float> values(static_cast<size_t>(n));
            convert(v, t, values.data(), DType::f32, static_cast<size_t>(n));
            for (int64_t j = 0; j < n; ++j) {
              ++in_range[static_cast<size_t>(begin + j)];
              ASSERT_EQ(values[static_cast<size_t>(j)], want[static_cast<size_t>(begin + j)]);
            }
          },
          r0, r1);
      for (int64_t e = 0; e < outf * in; ++e)
        ASSERT_EQ(in_range[static_cast<size_t>(e)], e / in >= r0 && e / in < r1 ? 1 : 0)
            << dtype_name(out) << " rows " << r0 << " to " << r1 << ", element " << e;
    }
  }
}

}  // namespace
}  // namespace mantissa::kernels

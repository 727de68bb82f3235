// The communication layer in one process: the 16-bit reduction against a reference that rounds
// the exact sum (edge values by their bits, random bit patterns, SIMD against scalar), the
// single-process backend's collectives, and the checks every backend shares.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "mantissa/comm/communicator.h"
#include "mantissa/comm/half_reduce.h"
#include "mantissa/core/float_formats.h"
#include "support/errors.h"

namespace mantissa {
namespace {

using comm::ReduceOp;
using testing::error_of;

// ---- An independent reference for 16-bit rounding: the nearest of all finite values ----

double decode16(DType t, uint16_t b) {
  return t == DType::f16 ? static_cast<float>(f16::from_bits(b))
                         : static_cast<float>(bf16::from_bits(b));
}

// Every finite non-negative value of the format with its bits, ascending (+0 first).
struct Grid {
  std::vector<double> value;
  std::vector<uint16_t> bits;
  double max_finite = 0, half_ulp_at_max = 0;
};

const Grid& grid(DType t) {
  static const std::array<Grid, 2> grids = [] {
    std::array<Grid, 2> out;
    for (int k = 0; k < 2; ++k) {
      const DType dt = k == 0 ? DType::f16 : DType::bf16;
      std::vector<std::pair<double, uint16_t>> all;
      for (uint32_t b = 0; b < 0x8000; ++b) {
        const double v = decode16(dt, static_cast<uint16_t>(b));
        if (std::isfinite(v)) all.emplace_back(v, static_cast<uint16_t>(b));
      }
      std::sort(all.begin(), all.end());
      for (auto& [v, b] : all) out[k].value.push_back(v), out[k].bits.push_back(b);
      const size_t n = out[k].value.size();
      out[k].max_finite = out[k].value[n - 1];
      out[k].half_ulp_at_max = (out[k].value[n - 1] - out[k].value[n - 2]) / 2;
    }
    return out;
  }();
  return grids[t == DType::f16 ? 0 : 1];
}

// x rounded to the format, to nearest with ties to the even bit pattern; beyond the largest
// finite value by half an ulp or more: infinity. NaN: the canonical quiet NaN.
uint16_t round16(DType t, double x) {
  if (std::isnan(x)) return t == DType::f16 ? 0x7e00 : 0x7fc0;
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const uint16_t inf = t == DType::f16 ? 0x7c00 : 0x7f80;
  const double a = std::fabs(x);
  const Grid& g = grid(t);
  if (a >= g.max_finite + g.half_ulp_at_max) return sign | inf;
  const size_t hi =
      static_cast<size_t>(std::lower_bound(g.value.begin(), g.value.end(), a) - g.value.begin());
  if (hi == g.value.size()) return sign | g.bits.back();  // above the largest, below the tie
  if (g.value[hi] == a) return sign | g.bits[hi];
  const size_t lo = hi - 1;
  const double dl = a - g.value[lo], dh = g.value[hi] - a;
  const size_t pick = dl < dh ? lo : dh < dl ? hi : (g.bits[lo] % 2 == 0 ? lo : hi);
  return sign | g.bits[pick];
}

uint16_t reduce_one(ReduceOp op, DType t, uint16_t in, uint16_t inout,
                    SimdPath path = active_simd_path()) {
  comm::reduce_16bit(op, t, &in, &inout, 1, path);
  return inout;
}

// The reference of op(a, b): sums rounded once from the exact sum (double holds the sum of two
// f16 values exactly; for bf16 its rounding is innocuous, 53 >= 2 * 8 + 2 bits); max/min as the
// header states.
uint16_t reference(ReduceOp op, DType t, uint16_t a, uint16_t b) {
  const double x = decode16(t, a), y = decode16(t, b);
  const uint16_t nan = t == DType::f16 ? 0x7e00 : 0x7fc0;
  if (op == ReduceOp::kSum) {
    const double s = x + y;
    if (s == 0) return std::signbit(x) && std::signbit(y) ? 0x8000 : 0;  // -0 only from -0 + -0
    return round16(t, s);
  }
  if (std::isnan(x) || std::isnan(y)) return nan;
  if (x == y) return op == ReduceOp::kMax ? (a & b) : (a | b);
  return (x > y) == (op == ReduceOp::kMax) ? a : b;
}

struct Case {
  ReduceOp op;
  DType t;
  uint16_t a, b, want;
  const char* what;
};

TEST(HalfReduce, EdgeValuesGiveTheRoundedFp32Result) {
  const DType h = DType::f16, b = DType::bf16;
  const ReduceOp sum = ReduceOp::kSum, max = ReduceOp::kMax, min = ReduceOp::kMin;
  const Case cases[] = {
      {sum, h, 0x3c00, 0x3c00, 0x4000, "1 + 1 = 2"},
      {sum, h, 0x3c00, 0x1000, 0x3c00, "1 + 2^-11: a tie, to the even 1"},
      {sum, h, 0x3c01, 0x1000, 0x3c02, "(1 + 2^-10) + 2^-11: a tie, up to the even neighbour"},
      {sum, h, 0x3c00, 0x1001, 0x3c01, "just above the tie: up"},
      {sum, h, 0x7bff, 0x4c00, 0x7c00, "65504 + 16 = 65520: the tie at the top overflows to inf"},
      {sum, h, 0x7bff, 0x4800, 0x7bff, "65504 + 8 rounds back to 65504"},
      {sum, h, 0xfbff, 0xcc00, 0xfc00, "-65504 - 16 = -inf"},
      {sum, h, 0x7c00, 0x3c00, 0x7c00, "inf + 1 = inf"},
      {sum, h, 0x7c00, 0xfc00, 0x7e00, "inf - inf = NaN, canonical"},
      {sum, h, 0x7d01, 0x3c00, 0x7e00, "a signalling NaN's payload is not kept"},
      {sum, h, 0xfe01, 0x7e17, 0x7e00, "two NaN payloads: canonical either way"},
      {sum, h, 0x0001, 0x0001, 0x0002, "the smallest subnormals add exactly"},
      {sum, h, 0x03ff, 0x0001, 0x0400, "largest subnormal + smallest = smallest normal"},
      {sum, h, 0x8001, 0x0001, 0x0000, "x - x = +0"},
      {sum, h, 0x8000, 0x8000, 0x8000, "-0 + -0 = -0"},
      {sum, h, 0x8000, 0x0000, 0x0000, "-0 + +0 = +0"},
      {max, h, 0x8000, 0x0000, 0x0000, "max(-0, +0) = +0"},
      {min, h, 0x0000, 0x8000, 0x8000, "min(+0, -0) = -0"},
      {max, h, 0x7e00, 0x3c00, 0x7e00, "max with NaN is NaN"},
      {min, h, 0x3c00, 0xfd00, 0x7e00, "min with NaN is NaN, canonical"},
      {max, h, 0xfc00, 0x4200, 0x4200, "max(-inf, 3) = 3"},
      {min, h, 0x7c00, 0xfbff, 0xfbff, "min(inf, -65504) = -65504"},
      {max, h, 0x0001, 0x0002, 0x0002, "subnormals compare"},
      {sum, b, 0x3f80, 0x3f80, 0x4000, "bf16 1 + 1 = 2"},
      {sum, b, 0x3f80, 0x3b80, 0x3f80, "bf16 1 + 2^-8: a tie, to the even 1"},
      {sum, b, 0x3f81, 0x3b80, 0x3f82, "bf16 (1 + 2^-7) + 2^-8: a tie, up"},
      {sum, b, 0x7f7f, 0x7b00, 0x7f80, "bf16 max + half an ulp: a tie to inf"},
      {sum, b, 0x7f7f, 0x7a80, 0x7f7f, "bf16 max + a quarter ulp: max"},
      {sum, b, 0x7f80, 0xff80, 0x7fc0, "bf16 inf - inf = NaN, canonical"},
      {sum, b, 0x7f81, 0x3f80, 0x7fc0, "bf16 signalling NaN"},
      {sum, b, 0x0001, 0x0001, 0x0002, "bf16 subnormals"},
      {max, b, 0x8000, 0x0000, 0x0000, "bf16 max(-0, +0) = +0"},
      {min, b, 0xff80, 0x7fc1, 0x7fc0, "bf16 min with NaN is NaN"},
  };
  std::vector<SimdPath> paths{SimdPath::kScalar};
  if (simd_path_supported(SimdPath::kAvx2)) paths.push_back(SimdPath::kAvx2);
  for (const Case& c : cases)
    for (SimdPath p : paths) {
      const std::string at = std::string(c.what) + " (" + std::string(simd_path_name(p)) + ")";
      EXPECT_EQ(reduce_one(c.op, c.t, c.a, c.b, p), c.want) << at;
      EXPECT_EQ(reduce_one(c.op, c.t, c.b, c.a, p), c.want) << at << ", operands swapped";
      EXPECT_EQ(reference(c.op, c.t, c.a, c.b), c.want) << at << ": the reference disagrees";
    }
}

// Random bit patterns (every class: normal, subnormal, zero, inf, NaN) and random values of
// similar magnitude (where sums round most), in arrays long enough for the vector loops and
// their tails: the reference's bits exactly, commutative bit for bit, SIMD = scalar.
TEST(HalfReduce, RandomValuesMatchTheReferenceOnEveryPath) {
  std::mt19937 gen(20);
  for (const DType t : {DType::f16, DType::bf16})
    for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
      const size_t n = 40000 + 13;  // chunks of 512 and a tail
      std::vector<uint16_t> a(n), b(n);
      std::uniform_int_distribution<uint32_t> bits(0, 0xffff);
      std::normal_distribution<float> normal(0.0f, 3.0f);
      for (size_t i = 0; i < n; ++i) {
        if (i % 2 == 0) {
          a[i] = static_cast<uint16_t>(bits(gen));
          b[i] = static_cast<uint16_t>(bits(gen));
        } else {
          a[i] = round16(t, normal(gen));
          b[i] = round16(t, normal(gen));
        }
      }
      const std::string at =
          std::string(dtype_name(t)) + " " + std::string(comm::reduce_op_name(op));
      std::vector<uint16_t> scalar = b, swapped = a;
      comm::reduce_16bit(op, t, a.data(), scalar.data(), n, SimdPath::kScalar);
      comm::reduce_16bit(op, t, b.data(), swapped.data(), n, SimdPath::kScalar);
      size_t wrong = 0;
      for (size_t i = 0; i < n; ++i) {
        const uint16_t want = reference(op, t, a[i], b[i]);
        if (scalar[i] != want && wrong++ < 5)
          ADD_FAILURE() << at << ": " << std::hex << a[i] << " op " << b[i] << " gave " << scalar[i]
                        << ", reference " << want;
      }
      EXPECT_EQ(wrong, 0u) << at;
      EXPECT_EQ(scalar, swapped) << at << ": not commutative bit for bit";
      if (simd_path_supported(SimdPath::kAvx2)) {
        std::vector<uint16_t> simd = b;
        comm::reduce_16bit(op, t, a.data(), simd.data(), n, SimdPath::kAvx2);
        EXPECT_EQ(simd, scalar) << at << ": AVX2 differs from scalar";
      }
    }
}

TEST(HalfReduce, OnlyFor16BitFloats) {
  float x = 1, y = 2;
  EXPECT_THROW(comm::reduce_16bit(ReduceOp::kSum, DType::f32, &x, &y, 1), InternalError);
}

// ---- The single-process backend ----

TEST(SingleProcess, IsTheWorldOutsideAnMpiLauncher) {
  ASSERT_FALSE(comm::launched_by_mpi()) << "run this test outside mpirun";
  comm::Communicator& w = comm::world();
  EXPECT_EQ(w.backend(), "single-process");
  EXPECT_EQ(w.rank(), 0);
  EXPECT_EQ(w.size(), 1);
  EXPECT_EQ(w.local_rank(), 0);
  EXPECT_EQ(w.local_size(), 1);
  EXPECT_EQ(&comm::world(), &w);
}

TEST(SingleProcess, LauncherDetectionReadsTheEnvironment) {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK"}) {
    ASSERT_EQ(std::getenv(name), nullptr);
    setenv(name, "0", 1);
    EXPECT_TRUE(comm::launched_by_mpi()) << name;
    unsetenv(name);
  }
  EXPECT_FALSE(comm::launched_by_mpi());
}

TEST(SingleProcess, CollectivesOverOneRankAreCopies) {
  auto c = comm::make_single_process();
  std::vector<float> x{1.5f, -2, 3};
  c->all_reduce(x.data(), x.size(), DType::f32, ReduceOp::kSum);
  EXPECT_EQ(x, (std::vector<float>{1.5f, -2, 3}));
  c->broadcast(x.data(), x.size(), DType::f32, 0);
  EXPECT_EQ(x, (std::vector<float>{1.5f, -2, 3}));
  std::vector<int64_t> send{7, 8}, recv(2);
  c->reduce_scatter(send.data(), recv.data(), 2, DType::i64, ReduceOp::kMax);
  EXPECT_EQ(recv, send);
  std::vector<uint16_t> h{0x3c00, 0x4000}, gathered(2);
  c->all_gather(h.data(), gathered.data(), 2, DType::f16);
  EXPECT_EQ(gathered, h);
  c->all_gather(gathered.data(), gathered.data(), 2, DType::f16);  // in place
  EXPECT_EQ(gathered, h);
  c->barrier();
  comm::Request r = c->all_reduce_async(x.data(), x.size(), DType::f32, ReduceOp::kMin);
  EXPECT_TRUE(r.test());
  r.wait();
  EXPECT_LE(r.started(), r.finished());
  EXPECT_TRUE(comm::Request().test());

  Tensor t = Tensor::from_floats({1, 2, 3, 4}, {2, 2}, DType::bf16);
  c->all_reduce(t, ReduceOp::kSum);
  c->broadcast(t, 0);
  EXPECT_EQ(t.to_float_vector(), (std::vector<float>{1, 2, 3, 4}));
  Tensor g = Tensor::zeros({4}, DType::bf16);
  c->all_gather(t, g);
  EXPECT_EQ(g.to_float_vector(), (std::vector<float>{1, 2, 3, 4}));
  Tensor s = Tensor::zeros({2, 2}, DType::bf16);
  c->reduce_scatter(g, s, ReduceOp::kSum);
  EXPECT_EQ(s.to_float_vector(), (std::vector<float>{1, 2, 3, 4}));
}

TEST(SingleProcess, BadArgumentsAreErrorsBeforeAnythingIsSent) {
  auto c = comm::make_single_process();
  std::vector<uint8_t> buf(64);
  EXPECT_NE(error_of([&] {
              c->all_reduce(buf.data(), 4, DType::e4m3, ReduceOp::kSum);
            }).find("all_reduce of e4m3 values is not supported"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              c->broadcast(buf.data(), 4, DType::u8, 1);
            }).find("broadcast from rank 1 in a job of 1 ranks"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              c->reduce_scatter(buf.data(), buf.data() + 2, 4, DType::u8, ReduceOp::kSum);
            }).find("overlap"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              c->all_gather(buf.data() + 1, buf.data(), 4, DType::u8);
            }).find("not this rank's part"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { c->all_reduce(nullptr, 4, DType::f32, ReduceOp::kSum); }).find("null buffer"),
      std::string::npos);
  EXPECT_NE(error_of([&] {
              c->all_reduce(buf.data(), size_t{1} << 31, DType::u8, ReduceOp::kSum);
            }).find("split the buffer"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              c->all_reduce(buf.data(), 1, DType::u8, static_cast<ReduceOp>(7));
            }).find("unknown reduction"),
            std::string::npos);
  Tensor t = Tensor::zeros({4, 2}, DType::f32);
  Tensor column = t.transpose(0, 1);
  EXPECT_NE(error_of([&] { c->all_reduce(column, ReduceOp::kSum); }).find("not contiguous"),
            std::string::npos);
  Tensor small = Tensor::zeros({3}, DType::f32);
  EXPECT_NE(error_of([&] { c->all_gather(t, small); }).find("size() times"), std::string::npos);
  Tensor other = Tensor::zeros({8}, DType::f16);
  EXPECT_NE(error_of([&] { c->reduce_scatter(t, other, ReduceOp::kSum); }).find("same dtype"),
            std::string::npos);
}

}  // namespace
}  // namespace mantissa

// The MPI backend, run by CTest under mpirun on 2 and 3 ranks: every collective over every dtype,
// the 16-bit reduction across ranks (the same bits on every rank), asynchronous requests, the
// issue order of queued collectives, and the checks that keep bad input from reaching MPI.
// Each rank can compute every other rank's input, so each checks the result on its own.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "mantissa/comm/communicator.h"
#include "mantissa/comm/half_reduce.h"
#include "mantissa/core/convert.h"
#include "support/errors.h"

namespace mantissa {
namespace {

using comm::ReduceOp;

comm::Communicator& world() { return comm::world(); }

int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : -1;
}

const DType kDtypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                         DType::i32, DType::i64, DType::u8};

// Element i of rank r's data: small integers (exact in every dtype and in their sums); u8 values
// in [0, 80], whose sums over 3 ranks stay in range (collective.h: integer sums must).
double value(DType t, int r, size_t i) {
  if (t == DType::u8) return static_cast<double>((i * 7 + static_cast<size_t>(r) * 13) % 81);
  return static_cast<double>(static_cast<int>((i * 7 + static_cast<size_t>(r) * 13) % 11) - 5);
}

// n elements of dtype t holding f(i), and back.
template <class F>
std::vector<char> make(DType t, size_t n, F f) {
  std::vector<double> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = f(i);
  std::vector<char> out(n * dtype_size(t));
  convert(v.data(), DType::f64, out.data(), t, n);
  return out;
}
std::vector<double> read(DType t, const void* data, size_t n) {
  std::vector<double> v(n);
  convert(data, t, v.data(), DType::f64, n);
  return v;
}

double combine(ReduceOp op, double a, double b) {
  switch (op) {
    case ReduceOp::kSum:
      return a + b;
    case ReduceOp::kMax:
      return std::max(a, b);
    case ReduceOp::kMin:
      return std::min(a, b);
  }
  return 0;
}

TEST(Mpi, TopologyIsTheLaunchersOne) {
  comm::Communicator& w = world();
  EXPECT_EQ(w.backend(), "mpi");
  EXPECT_EQ(w.size(), env_int("OMPI_COMM_WORLD_SIZE"));
  EXPECT_EQ(w.rank(), env_int("OMPI_COMM_WORLD_RANK"));
  EXPECT_EQ(w.local_size(), env_int("OMPI_COMM_WORLD_LOCAL_SIZE"));
  EXPECT_EQ(w.local_rank(), env_int("OMPI_COMM_WORLD_LOCAL_RANK"));
  EXPECT_GE(w.size(), 2) << "run with at least 2 ranks";
}

TEST(Mpi, AllReduceEveryDtypeAndOperation) {
  comm::Communicator& w = world();
  const size_t n = 1001;
  for (const DType t : kDtypes)
    for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
      std::vector<char> data = make(t, n, [&](size_t i) { return value(t, w.rank(), i); });
      w.all_reduce(data.data(), n, t, op);
      const std::vector<double> got = read(t, data.data(), n);
      size_t wrong = 0;
      for (size_t i = 0; i < n; ++i) {
        double want = value(t, 0, i);
        for (int r = 1; r < w.size(); ++r) want = combine(op, want, value(t, r, i));
        wrong += got[i] != want;
      }
      EXPECT_EQ(wrong, 0u) << dtype_name(t) << " " << comm::reduce_op_name(op);
    }
}

// Random FP16/BF16 values: every rank gets the same bits; with 2 ranks the result is one
// rounding of the exact sum (the reduction op applied to the two inputs); with more, within the
// roundings of N - 1 combinations of the exact sum.
TEST(Mpi, HalfPrecisionSumsAreRoundedOnceEachAndAgreeOnEveryRank) {
  comm::Communicator& w = world();
  const size_t n = 100003;
  for (const DType t : {DType::f16, DType::bf16}) {
    auto input = [&](int r) {
      std::mt19937 gen(static_cast<uint32_t>(100 + r));
      std::normal_distribution<float> normal(0.0f, 1.0f);
      std::vector<float> f(n);
      for (size_t i = 0; i < n; ++i) f[i] = normal(gen) * std::ldexp(1.0f, static_cast<int>(i % 9));
      std::vector<uint16_t> h(n);
      convert(f.data(), DType::f32, h.data(), t, n);
      return h;
    };
    std::vector<uint16_t> data = input(w.rank());
    w.all_reduce(data.data(), n, t, ReduceOp::kSum);
    const std::string at(dtype_name(t));
    // The same bits everywhere.
    std::vector<uint16_t> all(n * static_cast<size_t>(w.size()));
    w.all_gather(data.data(), all.data(), n, t);
    for (int r = 0; r < w.size(); ++r)
      EXPECT_EQ(0, std::memcmp(all.data() + static_cast<size_t>(r) * n, data.data(), n * 2))
          << at << ": rank " << r << " got other bits";
    if (w.size() == 2) {
      std::vector<uint16_t> want = input(1), first = input(0);
      comm::reduce_16bit(ReduceOp::kSum, t, first.data(), want.data(), n);
      EXPECT_EQ(data, want) << at;
    }
    std::vector<std::vector<double>> inputs;
    for (int r = 0; r < w.size(); ++r) {
      const std::vector<uint16_t> h = input(r);
      inputs.push_back(read(t, h.data(), n));
    }
    const std::vector<double> got = read(t, data.data(), n);
    const double unit = t == DType::f16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
    size_t wrong = 0;
    for (size_t i = 0; i < n; ++i) {
      double exact = 0, magnitude = 0;
      for (const auto& in : inputs) exact += in[i], magnitude += std::fabs(in[i]);
      // Each rounding is at most half an ulp of an intermediate sum (<= magnitude); subnormal
      // spacing bounds it from below.
      const double bound = (w.size() - 1) * (unit * magnitude + std::ldexp(1.0, -24));
      wrong += !(std::fabs(got[i] - exact) <= bound);
    }
    EXPECT_EQ(wrong, 0u) << at;
  }
}

TEST(Mpi, HalfPrecisionSumsOverflowToInfinity) {
  comm::Communicator& w = world();
  uint16_t h[2] = {0x7bff, 0xfbff};  // +-65504
  w.all_reduce(h, 2, DType::f16, ReduceOp::kSum);
  EXPECT_EQ(h[0], 0x7c00);
  EXPECT_EQ(h[1], 0xfc00);
  uint16_t b[2] = {0x7f7f, 0x3f80};  // bf16 max, 1
  w.all_reduce(b, 2, DType::bf16, ReduceOp::kSum);
  EXPECT_EQ(b[0], 0x7f80);
  EXPECT_EQ(static_cast<float>(bf16::from_bits(b[1])), static_cast<float>(w.size()));
  uint16_t m[2] = {static_cast<uint16_t>(w.rank() == 1 ? 0x7e00 : 0x3c00), 0x3c00};
  w.all_reduce(m, 2, DType::f16, ReduceOp::kMax);
  EXPECT_EQ(m[0], 0x7e00) << "a NaN on one rank is NaN everywhere";
  EXPECT_EQ(m[1], 0x3c00);
}

TEST(Mpi, ReduceScatterGivesEachRankItsPart) {
  comm::Communicator& w = world();
  const size_t count = 257, N = static_cast<size_t>(w.size());
  for (const DType t : {DType::f32, DType::bf16, DType::i64})
    for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kMin}) {
      // Element i of part p on rank r: value(t, r, p * count + i).
      const std::vector<char> send =
          make(t, N * count, [&](size_t i) { return value(t, w.rank(), i); });
      std::vector<char> recv(count * dtype_size(t));
      w.reduce_scatter(send.data(), recv.data(), count, t, op);
      const std::vector<double> got = read(t, recv.data(), count);
      size_t wrong = 0;
      for (size_t i = 0; i < count; ++i) {
        const size_t at = static_cast<size_t>(w.rank()) * count + i;
        double want = value(t, 0, at);
        for (int r = 1; r < w.size(); ++r) want = combine(op, want, value(t, r, at));
        wrong += got[i] != want;
      }
      EXPECT_EQ(wrong, 0u) << dtype_name(t) << " " << comm::reduce_op_name(op);
    }
}

TEST(Mpi, AllGatherSeparateAndInPlace) {
  comm::Communicator& w = world();
  const size_t count = 100, N = static_cast<size_t>(w.size());
  for (const DType t : {DType::f64, DType::f16, DType::u8}) {
    const std::vector<char> send = make(t, count, [&](size_t i) { return value(t, w.rank(), i); });
    std::vector<char> recv(N * count * dtype_size(t));
    w.all_gather(send.data(), recv.data(), count, t);
    std::vector<char> in_place(recv.size());
    std::memcpy(in_place.data() + static_cast<size_t>(w.rank()) * send.size(), send.data(),
                send.size());
    w.all_gather(in_place.data() + static_cast<size_t>(w.rank()) * send.size(), in_place.data(),
                 count, t);
    const std::vector<double> got = read(t, recv.data(), N * count);
    size_t wrong = 0;
    for (size_t r = 0; r < N; ++r)
      for (size_t i = 0; i < count; ++i)
        wrong += got[r * count + i] != value(t, static_cast<int>(r), i);
    EXPECT_EQ(wrong, 0u) << dtype_name(t);
    EXPECT_EQ(in_place, recv) << dtype_name(t) << " in place";
  }
}

TEST(Mpi, BroadcastFromEveryRoot) {
  comm::Communicator& w = world();
  for (int root = 0; root < w.size(); ++root)
    for (const DType t : {DType::f32, DType::bf16, DType::i32}) {
      std::vector<char> data = make(t, 77, [&](size_t i) { return value(t, w.rank(), i); });
      w.broadcast(data.data(), 77, t, root);
      EXPECT_EQ(data, make(t, 77, [&](size_t i) { return value(t, root, i); }))
          << "root " << root << ", " << dtype_name(t);
    }
  w.barrier();
}

// Several collectives in flight at once, of different kinds and sizes, waited for in reverse
// order; test() reports completion without blocking.
TEST(Mpi, AsynchronousCollectivesRunTogether) {
  comm::Communicator& w = world();
  const int N = w.size();
  std::vector<std::vector<float>> sums;
  for (size_t k = 0; k < 6; ++k)
    sums.emplace_back((k + 1) * 10007, static_cast<float>(w.rank() + k));
  std::vector<comm::Request> requests;
  for (auto& s : sums)
    requests.push_back(w.all_reduce_async(s.data(), s.size(), DType::f32, ReduceOp::kSum));
  std::vector<int32_t> bcast(5, w.rank() == N - 1 ? 42 : -1);
  requests.push_back(w.broadcast_async(bcast.data(), bcast.size(), DType::i32, N - 1));
  requests.push_back(w.barrier_async());
  for (auto it = requests.rbegin(); it != requests.rend(); ++it) it->wait();
  for (size_t k = 0; k < sums.size(); ++k) {
    const float want = static_cast<float>(N * (N - 1) / 2 + N * static_cast<int>(k));
    size_t wrong = 0;
    for (float v : sums[k]) wrong += v != want;
    EXPECT_EQ(wrong, 0u) << "all-reduce " << k;
  }
  EXPECT_EQ(bcast, std::vector<int32_t>(5, 42));
  for (const comm::Request& r : requests) EXPECT_LE(r.started(), r.finished());

  double x = w.rank();
  comm::Request r = w.all_reduce_async(&x, 1, DType::f64, ReduceOp::kMax);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!r.test() && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  EXPECT_TRUE(r.test());
  EXPECT_EQ(x, N - 1);
}

// Collectives of the same size started back to back, with ranks starting them at different
// moments: buffer k gets the sum of every rank's buffer k, so each rank issued them in the order
// it started them.
TEST(Mpi, CollectivesAreIssuedInTheOrderTheyAreStarted) {
  comm::Communicator& w = world();
  const size_t ops = 40, n = 64;
  std::vector<std::vector<int64_t>> bufs(ops);
  std::vector<comm::Request> requests;
  for (size_t k = 0; k < ops; ++k) {
    bufs[k].assign(n, static_cast<int64_t>(k * 1000 + static_cast<size_t>(w.rank())));
    requests.push_back(w.all_reduce_async(bufs[k].data(), n, DType::i64, ReduceOp::kSum));
    if (w.rank() == 1 && k % 7 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  for (auto& r : requests) r.wait();
  const int64_t N = w.size();
  for (size_t k = 0; k < ops; ++k)
    EXPECT_EQ(bufs[k],
              std::vector<int64_t>(n, static_cast<int64_t>(k) * 1000 * N + N * (N - 1) / 2))
        << "collective " << k;
}

// Large buffers (the transport pipelines them in segments; the 16-bit op sees partial counts).
TEST(Mpi, LargeBuffers) {
  comm::Communicator& w = world();
  const size_t n = (size_t{3} << 20) + 5;
  for (const DType t : {DType::f32, DType::f16}) {
    std::vector<char> data = make(t, n, [&](size_t i) { return value(t, w.rank(), i); });
    w.all_reduce(data.data(), n, t, ReduceOp::kSum);
    const std::vector<double> got = read(t, data.data(), n);
    size_t wrong = 0;
    for (size_t i = 0; i < n; ++i) {
      double want = 0;
      for (int r = 0; r < w.size(); ++r) want += value(t, r, i);
      wrong += got[i] != want;
    }
    EXPECT_EQ(wrong, 0u) << dtype_name(t);
  }
}

// A request dropped before it finishes: the backend holds the buffers' owner until then.
TEST(Mpi, KeepAliveOwnsTheBuffersOfADroppedRequest) {
  comm::Communicator& w = world();
  auto buffer = std::make_shared<std::vector<float>>(1 << 20, 1.0f);
  std::weak_ptr<std::vector<float>> watch = buffer;
  w.all_reduce_async(buffer->data(), buffer->size(), DType::f32, ReduceOp::kSum, buffer);
  buffer.reset();
  w.barrier();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!watch.expired() && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  EXPECT_TRUE(watch.expired()) << "released once finished";
}

TEST(Mpi, TensorCollectives) {
  comm::Communicator& w = world();
  const float N = static_cast<float>(w.size()), r = static_cast<float>(w.rank());
  Tensor t = Tensor::full({2, 3}, r + 1, DType::bf16);
  w.all_reduce(t, ReduceOp::kSum);
  EXPECT_EQ(t.to_float_vector(), std::vector<float>(6, N * (N + 1) / 2));
  Tensor mine = Tensor::full({2}, r, DType::f32);
  Tensor all = Tensor::zeros({w.size(), 2}, DType::f32);
  w.all_gather(mine, all);
  for (int k = 0; k < w.size(); ++k) EXPECT_EQ(all.at({k, 1}), k);
  Tensor parts = Tensor::full({w.size(), 4}, 1.0, DType::f16);
  Tensor part = Tensor::zeros({4}, DType::f16);
  w.reduce_scatter(parts, part, ReduceOp::kSum);
  EXPECT_EQ(part.to_float_vector(), std::vector<float>(4, N));
  Tensor b = Tensor::full({3}, r, DType::i64);
  w.broadcast(b, w.size() - 1);
  EXPECT_EQ(b.to_float_vector(), std::vector<float>(3, N - 1));
}

// Bad input is refused on every rank before anything is sent: the next collective still pairs up.
TEST(Mpi, BadArgumentsAreRefusedBeforeSending) {
  comm::Communicator& w = world();
  std::vector<uint8_t> buf(16);
  EXPECT_NE(testing::error_of([&] {
              w.all_reduce(buf.data(), 4, DType::e5m2, ReduceOp::kSum);
            }).find("not supported"),
            std::string::npos);
  EXPECT_NE(
      testing::error_of([&] { w.broadcast(buf.data(), 4, DType::u8, w.size()); }).find("from rank"),
      std::string::npos);
  int32_t one = 1;
  w.all_reduce(&one, 1, DType::i32, ReduceOp::kSum);
  EXPECT_EQ(one, w.size());
}

}  // namespace
}  // namespace mantissa

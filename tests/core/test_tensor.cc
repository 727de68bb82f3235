#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "mantissa/mantissa.h"
#include "support/errors.h"

namespace mantissa {
namespace {

Tensor iota(const Shape& shape, DType dtype = DType::f32) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0.0f);
  return Tensor::from_floats(v, shape, dtype);
}

using testing::error_of;

TEST(Tensor, ShapesStridesAndContiguity) {
  Tensor t = Tensor::zeros({2, 3, 4}, DType::f16);
  EXPECT_EQ(t.dim(), 3);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 48u);
  EXPECT_EQ(t.strides(), (Shape{12, 4, 1}));
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.storage()->bytes(), 48u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % 64, 0u);
  Tensor scalar = Tensor::full({}, 2.5, DType::bf16);
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_EQ(scalar.item(), 2.5);
  EXPECT_EQ(Tensor::zeros({0, 5}, DType::f32).numel(), 0);
  EXPECT_NE(error_of([] {
              Tensor::empty({2, -1}, DType::f32);
            }).find("negative dimension"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              Tensor::empty({1ll << 40, 1ll << 40}, DType::f32);
            }).find("too many elements"),
            std::string::npos);
}

TEST(Tensor, ShapeArithmeticCannotWrap) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(shape_numel({2, 3, 4}), 24);
  EXPECT_EQ(shape_numel({}), 1);
  EXPECT_EQ(shape_numel({kMax}), kMax);
  EXPECT_NE(error_of([] {
              shape_numel({1ll << 32, 1ll << 31});
            }).find("too many elements"),
            std::string::npos);
  // A zero does not make the other sizes' product harmless: strides and flattened sizes use it.
  EXPECT_NE(error_of([] {
              shape_numel({0, 1ll << 32, 1ll << 32});
            }).find("too many elements"),
            std::string::npos);
  EXPECT_NE(error_of([] { shape_numel({3, -1}); }).find("negative dimension"), std::string::npos);
  // Bytes beyond what memory can address, whatever the element count.
  EXPECT_NE(error_of([] {
              Tensor::empty({1ll << 61}, DType::f64);
            }).find("shape (2305843009213693952,) of f64 is too large for memory"),
            std::string::npos);
  const Tensor one = iota({1});
  EXPECT_NE(error_of([&] {
              one.expand({1ll << 62, 1ll << 62});
            }).find("too many elements"),
            std::string::npos);
  EXPECT_NE(error_of([&] { one.expand({1ll << 62}).to(DType::f64); }).find("too large"),
            std::string::npos);
  EXPECT_NE(error_of([&] { one.expand({-3}); }).find("negative dimension"), std::string::npos);
  EXPECT_NE(error_of([&] {
              one.view({1ll << 32, 1ll << 32, 0});
            }).find("too many elements"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              iota({0}).view({0, 1ll << 40, 1ll << 40});
            }).find("too many"),
            std::string::npos);
  EXPECT_NE(error_of([&] { iota({4}).narrow(0, kMax, 1); }).find("outside dimension 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { iota({4}).narrow(0, 1, kMax); }).find("outside dimension 0"),
            std::string::npos);
  // The allocator refuses sizes no system can provide (its rounding would wrap).
  EXPECT_THROW(Storage::allocate(~size_t{0} - 8, MemoryCategory::workspace), OutOfMemoryError);
}

TEST(Tensor, ViewsShareStorage) {
  Tensor t = iota({2, 3});
  Tensor v = t.view({3, 2});
  EXPECT_EQ(v.storage(), t.storage());
  EXPECT_EQ(v.at({2, 1}), 5.0);
  EXPECT_EQ(t.view({-1}).shape(), (Shape{6}));
  t.data<float>()[5] = 50.0f;
  EXPECT_EQ(v.at({2, 1}), 50.0);

  Tensor tr = t.transpose(0, 1);  // (3, 2)
  EXPECT_EQ(tr.shape(), (Shape{3, 2}));
  EXPECT_EQ(tr.strides(), (Shape{1, 3}));
  EXPECT_FALSE(tr.is_contiguous());
  EXPECT_EQ(tr.at({2, 0}), 2.0);
  EXPECT_EQ(tr.at({1, 1}), 4.0);
  EXPECT_NE(error_of([&] { tr.view({6}); }).find("not contiguous"), std::string::npos);
  Tensor flat = tr.reshape({6});  // copies
  EXPECT_NE(flat.storage(), t.storage());
  EXPECT_EQ(flat.to_float_vector(), (std::vector<float>{0, 3, 1, 4, 2, 50}));

  Tensor p = iota({2, 3, 4}).permute({2, 0, 1});  // (4, 2, 3)
  EXPECT_EQ(p.shape(), (Shape{4, 2, 3}));
  EXPECT_EQ(p.at({3, 1, 2}), 1 * 12 + 2 * 4 + 3);
  EXPECT_NE(error_of([&] { iota({2, 3}).permute({0, 0}); }).find("repeated"), std::string::npos);

  Tensor n = iota({4, 5}).narrow(1, 1, 3);  // columns 1..3
  EXPECT_EQ(n.shape(), (Shape{4, 3}));
  EXPECT_EQ(n.at({2, 0}), 11.0);
  EXPECT_EQ(n.contiguous().to_float_vector()[3], 6.0f);
  EXPECT_NE(error_of([] {
              iota({4, 5}).narrow(1, 3, 3);
            }).find("outside dimension 1"),
            std::string::npos);

  Tensor s = iota({4, 5}).select(0, -1);
  EXPECT_EQ(s.shape(), (Shape{5}));
  EXPECT_EQ(s.at({0}), 15.0);

  Tensor u = iota({3}).unsqueeze(0);
  EXPECT_EQ(u.shape(), (Shape{1, 3}));
  Tensor e = u.expand({2, 4, 3});
  EXPECT_EQ(e.strides()[0], 0);
  EXPECT_EQ(e.at({1, 3, 2}), 2.0);
  EXPECT_NE(error_of([] { iota({3}).expand({4}); }).find("only size-1"), std::string::npos);

  EXPECT_EQ(iota({2, 3, 4}).flatten(1).shape(), (Shape{2, 12}));
  EXPECT_EQ(iota({2, 3, 4}).flatten().shape(), (Shape{24}));
  EXPECT_NE(error_of([] { iota({2, 3}).view({4, -1}); }).find("cannot infer"), std::string::npos);
  EXPECT_NE(error_of([] { iota({2, 3}).view({4, 2}); }).find("has 8 elements"), std::string::npos);
  EXPECT_NE(error_of([] { iota({2, 3}).size(2); }).find("out of range"), std::string::npos);
}

// A copy between overlapping views of one storage reads the source as it was before the copy
// (PyTorch's copy_ of a shifted view); a destination whose elements share memory (an expand()ed
// view) is refused rather than left holding one of the values.
TEST(Tensor, CopiesBetweenOverlappingViewsAndIntoSharedElements) {
  for (const int64_t n : {int64_t{10}, int64_t{100000}}) {  // one chunk, and a threaded copy
    std::vector<float> v(static_cast<size_t>(n));
    std::iota(v.begin(), v.end(), 0.0f);
    Tensor x = Tensor::from_floats(v, {n});
    x.narrow(0, 1, n - 1).copy_from(x.narrow(0, 0, n - 1));  // shift right by one
    const std::vector<float> right = x.to_float_vector();
    EXPECT_EQ(right[0], 0.0f);
    for (int64_t i = 1; i < n; ++i)
      ASSERT_EQ(right[static_cast<size_t>(i)], i - 1) << n << " " << i;
    x = Tensor::from_floats(v, {n});
    x.narrow(0, 0, n - 1).copy_from(x.narrow(0, 1, n - 1), {});  // shift left, into f32
    const std::vector<float> left = x.to_float_vector();
    for (int64_t i = 0; i + 1 < n; ++i)
      ASSERT_EQ(left[static_cast<size_t>(i)], i + 1) << n << " " << i;
  }
  Tensor x = Tensor::from_floats({1, 2, 3, 4}, {4});
  x.copy_from(x);  // the same view
  EXPECT_EQ(x.to_float_vector(), (std::vector<float>{1, 2, 3, 4}));
  Tensor flipped = Tensor::from_floats({1, 2, 3, 4}, {2, 2});
  flipped.copy_from(flipped.transpose(0, 1));  // overlapping, interleaved
  EXPECT_EQ(flipped.to_float_vector(), (std::vector<float>{1, 3, 2, 4}));
  const std::string e = error_of([] {
    Tensor::from_floats({1}, {1}).expand({3}).copy_from(Tensor::from_floats({1, 2, 3}, {3}));
  });
  EXPECT_NE(e.find("copy_from: the tensor written to, (3,), has elements that share memory"),
            std::string::npos)
      << e;
  Tensor one = Tensor::from_floats({1}, {1});
  one.expand({1}).copy_from(Tensor::from_floats({5}, {1}));  // stride 0 along a single element
  EXPECT_EQ(one.item(), 5.0);
}

TEST(Tensor, DtypeConversionAndCopies) {
  Tensor t = Tensor::from_floats({1.0f, 0.1f, -3.5f, 70000.0f}, {4});
  Tensor h = t.to(DType::f16);
  EXPECT_EQ(h.dtype(), DType::f16);
  EXPECT_EQ(h.data<f16>()[1].bits, 0x2e66);
  EXPECT_TRUE(std::isinf(h.at({3})));
  EXPECT_EQ(t.to(DType::f32).storage(), t.storage());  // no copy when nothing changes
  EXPECT_NE(error_of([&] { h.data<float>(); }).find("holds f16 but was read as f32"),
            std::string::npos);
  CastOptions sat;
  sat.saturate = true;
  EXPECT_EQ(t.to(DType::f16, sat).at({3}), 65504.0);
  EXPECT_EQ(t.to(DType::e4m3).to(DType::f32).to_float_vector()[2], -3.5f);
  Tensor c = t.clone();
  EXPECT_NE(c.storage(), t.storage());
  EXPECT_EQ(c.to_float_vector(), t.to_float_vector());
  Tensor z = Tensor::zeros({4}, DType::bf16);
  z.copy_from(t);
  EXPECT_EQ(z.at({2}), -3.5);
  EXPECT_NE(error_of([&] { z.copy_from(iota({5})); }).find("differs"), std::string::npos);
  Tensor f = Tensor::zeros({2, 3}, DType::f16).transpose(0, 1);
  f.fill(0.5);
  EXPECT_EQ(f.contiguous().to_float_vector(), std::vector<float>(6, 0.5f));
  EXPECT_NE(iota({2}).str().find("f32 (2,) [0, 1]"), std::string::npos);
}

// Stochastic rounding of a strided copy uses each element's logical (row-major) index, so it
// equals the rounding of the same values copied contiguously first.
TEST(Tensor, StochasticCopyDependsOnLogicalIndexOnly) {
  std::vector<float> v(64 * 48);
  for (size_t i = 0; i < v.size(); ++i) v[i] = 1.0f + static_cast<float>(i) * 1e-5f;
  Tensor t = Tensor::from_floats(v, {64, 48}).transpose(0, 1);  // (48, 64), strided
  CastOptions sr;
  sr.rounding = Rounding::kStochastic;
  sr.seed = 5;
  const Tensor a = t.to(DType::bf16, sr);
  const Tensor b = t.contiguous().to(DType::bf16, sr);
  EXPECT_EQ(a.to_float_vector(), b.to_float_vector());
}

TEST(Tensor, CategoryAndOwnerFollowCopies) {
  MemoryTracker tracker("test");
  TensorOptions opt;
  opt.category = MemoryCategory::parameters;
  opt.owner = "fc1.weight";
  opt.tracker = &tracker;
  {
    Tensor w = Tensor::zeros({100, 10}, DType::f32, opt);
    EXPECT_EQ(w.storage()->category(), MemoryCategory::parameters);
    EXPECT_EQ(tracker.stats().current_of(MemoryCategory::parameters), 4000u);
    {
      // Copies are charged like their source: same tracker, category and owner.
      const Tensor h = w.to(DType::f16);
      const Tensor c = w.transpose(0, 1).contiguous();
      EXPECT_EQ(h.storage()->owner(), "fc1.weight");
      EXPECT_EQ(tracker.stats().current_of(MemoryCategory::parameters), 4000u + 2000u + 4000u);
    }
    w.storage()->recharge(MemoryCategory::master_weights, "fc1.weight(master)");
    EXPECT_EQ(tracker.stats().current_of(MemoryCategory::parameters), 0u);
    EXPECT_EQ(tracker.stats().current_of(MemoryCategory::master_weights), 4000u);
  }
  EXPECT_EQ(tracker.stats().current_total, 0u);
}

TEST(Tensor, CudaIsRefusedClearly) {
  TensorOptions opt;
  opt.device = {DeviceType::kCuda, 0};
  EXPECT_NE(error_of([&] { Tensor::empty({2}, DType::f32, opt); }).find("no CUDA support"),
            std::string::npos);
}

}  // namespace
}  // namespace mantissa

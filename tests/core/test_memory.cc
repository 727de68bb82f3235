#include <gtest/gtest.h>

#include "mantissa/mantissa.h"

namespace mantissa {
namespace {

TensorOptions on(MemoryTracker& t, MemoryCategory c, std::string owner) {
  TensorOptions o;
  o.tracker = &t;
  o.category = c;
  o.owner = std::move(owner);
  return o;
}

TEST(Memory, AccountsCurrentAndPeakByCategory) {
  MemoryTracker tr("test");
  Tensor w = Tensor::empty({1000}, DType::f32, on(tr, MemoryCategory::parameters, "w"));
  {
    Tensor a1 = Tensor::empty({500}, DType::f32, on(tr, MemoryCategory::activations, "a1"));
    Tensor a2 = Tensor::empty({250}, DType::f16, on(tr, MemoryCategory::activations, "a2"));
    const MemoryStats s = tr.stats();
    EXPECT_EQ(s.current_of(MemoryCategory::parameters), 4000u);
    EXPECT_EQ(s.current_of(MemoryCategory::activations), 2500u);
    EXPECT_EQ(s.current_total, 6500u);
    EXPECT_EQ(s.live_allocations, 3u);
  }
  Tensor g = Tensor::empty({1000}, DType::f32, on(tr, MemoryCategory::gradients, "w.grad"));
  const MemoryStats s = tr.stats();
  EXPECT_EQ(s.current_of(MemoryCategory::activations), 0u);
  EXPECT_EQ(s.peak_of(MemoryCategory::activations), 2500u);
  EXPECT_EQ(s.current_total, 8000u);
  EXPECT_EQ(s.peak_total, 8000u);  // the sum's own high-water mark, not the sum of peaks (10500)
  EXPECT_EQ(s.at_peak_total[static_cast<size_t>(MemoryCategory::gradients)], 4000u);
  EXPECT_EQ(s.at_peak_total[static_cast<size_t>(MemoryCategory::activations)], 0u);
  EXPECT_EQ(s.allocations, 4u);
  const auto owners = tr.largest_owners(5);
  ASSERT_EQ(owners.size(), 2u);
  EXPECT_EQ(owners[0].second, 4000u);
  tr.reset_peaks();
  EXPECT_EQ(tr.stats().peak_of(MemoryCategory::activations), 0u);
  EXPECT_NE(tr.report().find("activations"), std::string::npos);
}

TEST(Memory, BudgetThrowsAReportAndRecordsNothing) {
  MemoryTracker tr("test-device");
  tr.set_budget(10000);
  Tensor w = Tensor::empty({1500}, DType::f32, on(tr, MemoryCategory::parameters, "fc1.weight"));
  Tensor a = Tensor::empty({500}, DType::f32, on(tr, MemoryCategory::activations, "conv1"));
  try {
    Tensor big = Tensor::empty({1000}, DType::f32, on(tr, MemoryCategory::activations, "conv2"));
    FAIL() << "no out-of-memory error";
  } catch (const OutOfMemoryError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("out of memory on test-device"), std::string::npos) << msg;
    EXPECT_NE(msg.find("cannot allocate 3.91 KiB for activations ('conv2')"), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("7.81 KiB of the 9.77 KiB budget"), std::string::npos) << msg;
    EXPECT_NE(msg.find("parameters: 5.86 KiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("fc1.weight: 5.86 KiB"), std::string::npos) << msg;
    EXPECT_LT(msg.find("parameters: 5.86"), msg.find("activations: 1.95"));  // largest first
    EXPECT_NE(msg.find("HINT"), std::string::npos);
  }
  EXPECT_EQ(tr.stats().current_total, 8000u);
  EXPECT_EQ(tr.stats().allocations, 2u);
  // Exactly up to the budget fits.
  Tensor fits = Tensor::empty({500}, DType::f32, on(tr, MemoryCategory::workspace, "ws"));
  EXPECT_EQ(tr.stats().current_total, 10000u);
  EXPECT_THROW(Tensor::empty({1}, DType::u8, on(tr, MemoryCategory::workspace, "x")),
               OutOfMemoryError);
  tr.set_budget(std::nullopt);
  EXPECT_NO_THROW(Tensor::empty({1}, DType::u8, on(tr, MemoryCategory::workspace, "x")));
}

// The reason for the budget: the same model's tensors fit in FP16 and not in FP32.
TEST(Memory, SameTensorsFitInF16ButNotF32) {
  for (DType t : {DType::f32, DType::f16}) {
    MemoryTracker tr("budget");
    tr.set_budget(3 * 1024 * 1024);
    auto allocate_model = [&] {
      std::vector<Tensor> held;
      for (const char* layer : {"l0", "l1", "l2", "l3"})
        held.push_back(Tensor::empty({256, 1024}, t, on(tr, MemoryCategory::parameters, layer)));
      return held;
    };
    if (t == DType::f32)
      EXPECT_THROW(allocate_model(), OutOfMemoryError);
    else
      EXPECT_NO_THROW(allocate_model());
  }
}

TEST(Memory, FormatsAndParsesSizes) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(512ull << 20), "512.00 MiB");
  EXPECT_EQ(parse_bytes("1000"), 1000u);
  EXPECT_EQ(parse_bytes("512MiB"), 512ull << 20);
  EXPECT_EQ(parse_bytes("1.5GiB"), 1536ull << 20);
  EXPECT_EQ(parse_bytes("2 GB"), 2000000000u);
  EXPECT_EQ(parse_bytes("64k"), 65536u);
  EXPECT_EQ(parse_bytes("12 parsecs"), std::nullopt);
  EXPECT_EQ(parse_bytes("MiB"), std::nullopt);
  EXPECT_EQ(parse_bytes(""), std::nullopt);
  EXPECT_EQ(parse_bytes("-5"), std::nullopt);
}

TEST(Memory, ParsesOnlySizesThatFit) {
  EXPECT_EQ(parse_bytes(" 7 kB "), 7000u);
  EXPECT_EQ(parse_bytes("0.5"), 1u);  // rounded to a whole byte
  EXPECT_EQ(parse_bytes("16383.99 PiB"), std::nullopt);
  EXPECT_EQ(parse_bytes("16777215TiB"), (16777215ull << 40));
  EXPECT_EQ(parse_bytes("16777216TiB"), std::nullopt);                      // 2^64
  EXPECT_EQ(parse_bytes("18446744073709549568"), 18446744073709549568ull);  // 2^64 - 2048
  EXPECT_EQ(parse_bytes("18446744073709551615"), std::nullopt);  // rounds to 2^64 as a double
  EXPECT_EQ(parse_bytes(std::string(400, '9')), std::nullopt);   // beyond a double's range
  EXPECT_EQ(parse_bytes(std::string(400, '9') + "." + std::string(400, '9')), std::nullopt);
  for (const char* bad : {"nan", "inf", "1e9", "0x10", "+5", "5..5", "1.5.5", ".", "5 M iB",
                          "5MiBs", "5 MiB x", "1,000"})
    EXPECT_EQ(parse_bytes(bad), std::nullopt) << bad;
  EXPECT_EQ(parse_bytes(std::string_view("5\0MiB", 5)), std::nullopt);
  EXPECT_EQ(parse_bytes(".5k"), 512u);
  EXPECT_EQ(parse_bytes("5."), 5u);
}

TEST(Memory, OwnersGroupUnderTheirLayer) {
  register_layer_name("blockA.conv");
  register_layer_name("blockA");
  EXPECT_EQ(layer_of_owner("blockA.conv.weight.exp_avg"), "blockA.conv");
  EXPECT_EQ(layer_of_owner("blockA.conv"), "blockA.conv");
  EXPECT_EQ(layer_of_owner("blockA.bn.weight"), "blockA");
  EXPECT_EQ(layer_of_owner("blockAB.weight"), "blockAB.weight");  // prefixes end at a '.'
  EXPECT_EQ(layer_of_owner("gemm packing"), "gemm packing");
  EXPECT_EQ(layer_of_owner("(unnamed)"), "(top level)");
  EXPECT_EQ(layer_of_owner(""), "(top level)");
}

}  // namespace
}  // namespace mantissa

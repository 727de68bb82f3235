// The loss scaler's state machine (every transition, clamps, hysteresis, skip counting, the
// checkpoint round trip) and the precision modes' settings.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "mantissa/mantissa.h"
#include "support/errors.h"

namespace mantissa::amp {
namespace {

using testing::error_of;

LossScalerOptions dynamic(int64_t interval = 3) {
  LossScalerOptions o;
  o.growth_interval = interval;
  return o;
}

TEST(LossScaler, DefaultsAreGradScalers) {
  LossScaler s;
  EXPECT_TRUE(s.options().dynamic);
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.options().growth_factor, 2.0);
  EXPECT_EQ(s.options().backoff_factor, 0.5);
  EXPECT_EQ(s.options().growth_interval, 2000);
  EXPECT_EQ(s.inverse_scale(), static_cast<float>(1.0 / 65536.0));
}

TEST(LossScaler, GrowsAfterIntervalCleanStepsAndBacksOffOnOverflow) {
  LossScaler s(dynamic(3));
  EXPECT_FALSE(s.update(false));
  EXPECT_FALSE(s.update(false));
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.clean_steps_in_a_row(), 2);
  EXPECT_FALSE(s.update(false));  // third clean step: grow, counter resets
  EXPECT_EQ(s.scale(), 131072.0);
  EXPECT_EQ(s.clean_steps_in_a_row(), 0);
  EXPECT_FALSE(s.update(false));
  EXPECT_TRUE(s.update(true));  // overflow: skip, halve, counter resets
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.clean_steps_in_a_row(), 0);
  EXPECT_EQ(s.skipped_steps(), 1);
  EXPECT_EQ(s.steps(), 5);
  ASSERT_EQ(s.history().size(), 2u);
  EXPECT_EQ(s.history()[0].step, 3);
  EXPECT_EQ(s.history()[0].scale, 131072.0);
  EXPECT_FALSE(s.history()[0].overflow);
  EXPECT_EQ(s.history()[1].step, 5);
  EXPECT_TRUE(s.history()[1].overflow);
  // An overflow interrupts the run of clean steps: two more clean steps do not grow it.
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 65536.0);
}

TEST(LossScaler, ClampsAtMaximumAndMinimum) {
  LossScalerOptions o = dynamic(1);
  o.init_scale = 4;
  o.max_scale = 8;
  o.min_scale = 1;
  LossScaler s(o);
  s.update(false);
  EXPECT_EQ(s.scale(), 8);
  s.update(false);
  EXPECT_EQ(s.scale(), 8);            // capped
  EXPECT_EQ(s.history().size(), 1u);  // no change recorded at the cap
  s.update(true);
  s.update(true);
  s.update(true);
  EXPECT_EQ(s.scale(), 1);  // floor
  // At the floor an overflow is an error naming the parameters.
  const std::string e = error_of([&] { s.update(true, {"fc1.weight", "fc2.bias"}); });
  EXPECT_NE(e.find("minimum 1"), std::string::npos) << e;
  EXPECT_NE(e.find("fc1.weight, fc2.bias"), std::string::npos) << e;
  EXPECT_NE(e.find("--detect-anomaly"), std::string::npos) << e;
  // An initial scale outside the clamps starts at the clamp.
  o.init_scale = 100;
  EXPECT_EQ(LossScaler(o).scale(), 8);
}

TEST(LossScaler, WithoutMinimumStopsAtTwoToTheMinus24) {
  LossScalerOptions o = dynamic();
  o.init_scale = 1.0 / (1 << 22);
  LossScaler s(o);
  s.update(true);
  s.update(true);
  EXPECT_EQ(s.scale(), std::ldexp(1.0, -24));
  EXPECT_NE(error_of([&] { s.update(true); }), "");
}

TEST(LossScaler, HysteresisToleratesOverflowsUntilTheScaleGrows) {
  LossScalerOptions o = dynamic(2);
  o.hysteresis = 3;
  LossScaler s(o);
  EXPECT_TRUE(s.update(true));  // tolerated (2 left)
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.hysteresis_left(), 2);
  EXPECT_TRUE(s.update(true));  // tolerated (1 left)
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_TRUE(s.update(true));  // backs off
  EXPECT_EQ(s.scale(), 32768.0);
  EXPECT_TRUE(s.update(true));  // still 1 left: backs off again
  EXPECT_EQ(s.scale(), 16384.0);
  EXPECT_EQ(s.skipped_steps(), 4);
  s.update(false);
  s.update(false);  // grows; hysteresis refilled
  EXPECT_EQ(s.scale(), 32768.0);
  EXPECT_EQ(s.hysteresis_left(), 3);
}

TEST(LossScaler, StaticNeverChangesAndSkipsOverflows) {
  LossScalerOptions o = *parse_loss_scaling("1024");
  EXPECT_FALSE(o.dynamic);
  LossScaler s(o);
  for (int i = 0; i < 5000; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_EQ(s.skipped_steps(), 1);
  EXPECT_TRUE(s.history().empty());
  // A static scale that overflows on most steps is reported rather than skipped forever.
  LossScaler bad(o);
  EXPECT_NE(error_of([&] {
              for (int i = 0; i < 200; ++i) bad.update(true, {"w"});
            }),
            "");
}

TEST(LossScaler, ParsesTheFlag) {
  EXPECT_FALSE(parse_loss_scaling("none"));
  EXPECT_TRUE(parse_loss_scaling("dynamic")->dynamic);
  EXPECT_EQ(parse_loss_scaling("128")->init_scale, 128);
  for (const char* bad : {"", "-1", "0", "abc", "12x", "inf"})
    EXPECT_NE(error_of([&] { parse_loss_scaling(bad); }).find("--loss-scaling"), std::string::npos)
        << bad;
  // Static scales that are not FP32 normal numbers: the scale or its inverse would be 0 or inf,
  // and every step skipped.
  for (const char* far : {"1e-50", "1e-45", "1e-39", "1e300", "3.5e38"})
    EXPECT_NE(
        error_of([&] {
          parse_loss_scaling(far);
        }).find("--loss-scaling " + std::string(far) + " is outside the range of a loss scale"),
        std::string::npos)
        << far;
  EXPECT_EQ(parse_loss_scaling("1.2e-38")->init_scale, 1.2e-38);
  EXPECT_EQ(parse_loss_scaling("3.4e38")->init_scale, 3.4e38);
  LossScalerOptions o;
  o.growth_factor = 1;
  EXPECT_NE(error_of([&] { LossScaler s(o); }), "");
  o = {};
  o.min_scale = 8;
  o.max_scale = 4;
  EXPECT_NE(error_of([&] { LossScaler s(o); }), "");
}

TEST(LossScaler, StateRoundTripsThroughJson) {
  LossScalerOptions o = dynamic(3);
  o.hysteresis = 2;
  o.min_scale = 2;
  LossScaler a(o);
  for (bool inf : {false, true, false, false, true, true, false}) a.update(inf);
  LossScaler b;
  b.load_json(a.to_json(), "ckpt");
  EXPECT_EQ(b.scale(), a.scale());
  EXPECT_EQ(b.steps(), a.steps());
  EXPECT_EQ(b.skipped_steps(), a.skipped_steps());
  EXPECT_EQ(b.clean_steps_in_a_row(), a.clean_steps_in_a_row());
  EXPECT_EQ(b.hysteresis_left(), a.hysteresis_left());
  EXPECT_EQ(b.history().size(), a.history().size());
  EXPECT_EQ(b.options().min_scale, 2);
  // The two go on identically.
  for (bool inf : {false, false, true, false, false, false, true}) {
    EXPECT_EQ(a.update(inf), b.update(inf));
    EXPECT_EQ(a.scale(), b.scale());
  }
  EXPECT_EQ(a.to_json(), b.to_json());
  EXPECT_NE(error_of([&] { b.load_json("{\"scale\": 1}", "x.safetensors"); }).find("x.safetensors"),
            std::string::npos);
  EXPECT_NE(error_of([&] { b.load_json("not json", "x.safetensors"); }), "");
}

// Counters of a damaged checkpoint are refused, never cast: a float where an integer belongs
// (2e27 converted to int64_t would be undefined behaviour), a negative count, a zero interval.
TEST(LossScaler, DamagedCountersAreRefused) {
  LossScaler a(dynamic(3));
  for (bool inf : {false, true, false}) a.update(inf);
  const nlohmann::json good = nlohmann::json::parse(a.to_json());
  const std::pair<const char*, nlohmann::json> damaged[] = {
      {"growth_interval", 2.0555555555555555e27},
      {"growth_interval", 0},
      {"growth_interval", 2.5},
      {"steps", -1},
      {"steps", 1e300},
      {"skipped_steps", uint64_t{1} << 63},
      {"growth_tracker", "3"},
      {"hysteresis", 0},
      {"hysteresis_left", 1e19}};
  for (const auto& [field, value] : damaged) {
    nlohmann::json j = good;
    j[field] = value;
    LossScaler b;
    EXPECT_NE(error_of([&] { b.load_json(j.dump(), "x.safetensors"); }).find("x.safetensors"),
              std::string::npos)
        << field << " = " << value.dump();
  }
  nlohmann::json j = good;
  j["history"][0]["step"] = 1e40;
  LossScaler b;
  EXPECT_NE(error_of([&] { b.load_json(j.dump(), "x.safetensors"); }).find("'history step'"),
            std::string::npos);
}

TEST(PrecisionModes, EachNameMapsToItsSettings) {
  const PrecisionMode fp32 = precision_mode("32-true");
  EXPECT_EQ(fp32.param_dtype, DType::f32);
  EXPECT_FALSE(fp32.autocast || fp32.loss_scaling || fp32.master_weights);
  for (const char* n : {"O0", "32.32"}) {
    const PrecisionMode m = precision_mode(n);
    EXPECT_EQ(m.describe().substr(m.describe().find(':')),
              fp32.describe().substr(fp32.describe().find(':')))
        << n;
  }

  const PrecisionMode mixed = precision_mode("16-mixed");
  EXPECT_TRUE(mixed.autocast);
  EXPECT_EQ(mixed.half, DType::f16);
  EXPECT_EQ(mixed.param_dtype, DType::f32);
  ASSERT_TRUE(mixed.loss_scaling);
  EXPECT_TRUE(mixed.loss_scaling->dynamic);
  EXPECT_TRUE(precision_mode("O1").autocast);
  const PrecisionMode bmixed = precision_mode("bf16-mixed");
  EXPECT_EQ(bmixed.half, DType::bf16);
  EXPECT_FALSE(bmixed.loss_scaling);  // BF16 has FP32's range

  const PrecisionMode o2 = precision_mode("O2");
  // The FP32 parameters are the masters, read as f16 (no 16-bit copy); the input arrives in f16.
  EXPECT_EQ(o2.param_dtype, DType::f32);
  EXPECT_EQ(o2.input_dtype, DType::f16);
  EXPECT_TRUE(o2.read_as_half && o2.keep_norm_fp32 && o2.master_weights && o2.fp32_loss);
  EXPECT_FALSE(o2.autocast);
  ASSERT_TRUE(o2.loss_scaling);

  for (const char* n : {"16-true", "O3", "16.16"}) {
    const PrecisionMode t = precision_mode(n);
    EXPECT_EQ(t.param_dtype, DType::f16) << n;
    EXPECT_EQ(t.input_dtype, DType::f16) << n;
    EXPECT_FALSE(t.master_weights || t.loss_scaling || t.autocast) << n;
    EXPECT_EQ(t.first_moment, DType::f16) << n;
    EXPECT_EQ(t.second_moment, DType::bf16) << n;
  }
  const PrecisionMode btrue = precision_mode("bf16-true");
  EXPECT_EQ(btrue.param_dtype, DType::bf16);
  EXPECT_EQ(btrue.first_moment, DType::bf16);

  const PrecisionMode ipu = precision_mode("16.32");
  EXPECT_EQ(ipu.input_dtype, DType::f16);
  EXPECT_EQ(ipu.param_dtype, DType::f32);

  EXPECT_EQ(precision_mode("O3", DType::bf16).param_dtype, DType::bf16);
  EXPECT_EQ(precision_mode("16.32", DType::bf16).input_dtype, DType::bf16);
  EXPECT_NE(error_of([] { precision_mode("16-mixed", DType::bf16); }).find("fixes"),
            std::string::npos);
  EXPECT_NE(error_of([] { precision_mode("32-true", DType::bf16); }), "");
  const std::string e = error_of([] { precision_mode("fp8"); });
  EXPECT_NE(e.find("unknown precision 'fp8'"), std::string::npos) << e;
  EXPECT_NE(e.find("bf16-true"), std::string::npos) << e;
  EXPECT_EQ(precision_names().size(), 14u);  // with the FP8 modes, fp8-hybrid and fp8-e4m3
  EXPECT_EQ(precision_mode("fp8-hybrid").fp8_gradients, DType::e5m2);
  EXPECT_EQ(precision_mode("fp8-e4m3").fp8_gradients, DType::e4m3);
  EXPECT_NE(precision_mode("16-mixed").describe().find("loss scaling dynamic (initial 65536"),
            std::string::npos);
}

TEST(PrecisionModes, ParsesTypeNames) {
  EXPECT_EQ(parse_float_type("fp32", "--x"), DType::f32);
  EXPECT_EQ(parse_float_type("fp16", "--x"), DType::f16);
  EXPECT_EQ(parse_float_type("bf16", "--x"), DType::bf16);
  EXPECT_NE(error_of([] { parse_float_type("fp8", "--accum-type"); }).find("--accum-type"),
            std::string::npos);
}

}  // namespace
}  // namespace mantissa::amp

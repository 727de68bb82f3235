// The op table (op_table.h) is the source of truth: every op goes through its entry, so its name,
// its automatic-casting category (default or set by a policy), its kind (the type it writes by
// default, partials, multiply-adds, stochastic outputs) and anomaly detection all reach it; and
// docs/mixed_precision.md's op tables say what the table says.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "mantissa/mantissa.h"
#include "mantissa/ops/ops.h"

namespace mantissa::ops {
namespace {

// An input of an op's sample call: floating (the type is the test's choice), class labels, or
// u8 images.
struct Arg {
  Shape shape;
  enum Kind { kFloat, kLabels, kBytes } kind = kFloat;
};

struct Sample {
  std::vector<Arg> args;
  std::function<Tensor(const std::vector<Tensor>&, const OpOptions&)> call;
};

using In = const std::vector<Tensor>&;
using Opt = const OpOptions&;

// One call of each op. No default case: an op added to the table fails to compile here (-Wswitch
// is an error) until it has a sample. The matrix ops sum more than 16 products per output, so that
// FP16 partials round.
Sample sample(OpId id) {
  switch (id) {
    case OpId::linear:
      return {{{{3, 64}}, {{4, 64}}, {{4}}},
              [](In x, Opt o) { return linear(x[0], x[1], x[2], o); }};
    case OpId::matmul:
      return {{{{2, 64}}, {{64, 3}}}, [](In x, Opt o) { return matmul(x[0], x[1], o); }};
    case OpId::conv2d:
      return {{{{1, 4, 5, 5}}, {{2, 4, 3, 3}}, {{2}}},
              [](In x, Opt o) { return conv2d(x[0], x[1], x[2], {}, o); }};
    case OpId::relu:
      return {{{{3, 5}}}, [](In x, Opt o) { return relu(x[0], o); }};
    case OpId::dropout:
      return {{{{4, 16}}}, [](In x, Opt o) { return dropout(x[0], 0.5, true, 7, 1, o); }};
    case OpId::gelu:
      return {{{{3, 5}}}, [](In x, Opt o) { return gelu(x[0], o); }};
    case OpId::sigmoid:
      return {{{{3, 5}}}, [](In x, Opt o) { return sigmoid(x[0], o); }};
    case OpId::tanh:
      return {{{{3, 5}}}, [](In x, Opt o) { return tanh(x[0], o); }};
    case OpId::max_pool2d:
      return {{{{1, 2, 4, 4}}}, [](In x, Opt o) { return max_pool2d(x[0], {}, o); }};
    case OpId::avg_pool2d:
      return {{{{1, 2, 4, 4}}}, [](In x, Opt o) { return avg_pool2d(x[0], {}, o); }};
    case OpId::adaptive_avg_pool2d:
      return {{{{1, 2, 4, 4}}}, [](In x, Opt o) { return adaptive_avg_pool2d(x[0], 2, 2, o); }};
    case OpId::flatten:
      return {{{{2, 3, 4}}}, [](In x, Opt o) { return flatten(x[0], 1, -1, o); }};
    case OpId::reshape:
      return {{{{2, 3, 4}}}, [](In x, Opt o) { return reshape(x[0], {6, 4}, o); }};
    case OpId::transpose:
      return {{{{2, 3, 4}}}, [](In x, Opt o) { return transpose(x[0], 0, 2, o); }};
    case OpId::add_scalar:
      return {{{{3, 5}}}, [](In x, Opt o) { return add_scalar(x[0], 0.5, o); }};
    case OpId::mul_scalar:
      return {{{{3, 5}}}, [](In x, Opt o) { return mul_scalar(x[0], 1.5, o); }};
    case OpId::add:
      return {{{{3, 5}}, {{5}}}, [](In x, Opt o) { return add(x[0], x[1], o); }};
    case OpId::sub:
      return {{{{3, 5}}, {{5}}}, [](In x, Opt o) { return sub(x[0], x[1], o); }};
    case OpId::mul:
      return {{{{3, 5}}, {{5}}}, [](In x, Opt o) { return mul(x[0], x[1], o); }};
    case OpId::cat:
      return {{{{2, 3}}, {{2, 2}}}, [](In x, Opt o) { return cat({x[0], x[1]}, 1, o); }};
    case OpId::div:
      return {{{{3, 5}}, {{5}}}, [](In x, Opt o) { return div(x[0], x[1], o); }};
    case OpId::sum:
      return {{{{3, 5}}}, [](In x, Opt o) { return sum(x[0], {}, false, o); }};
    case OpId::mean:
      return {{{{3, 5}}}, [](In x, Opt o) { return mean(x[0], {1}, false, o); }};
    case OpId::softmax:
      return {{{{3, 5}}}, [](In x, Opt o) { return softmax(x[0], 1, o); }};
    case OpId::log_softmax:
      return {{{{3, 5}}}, [](In x, Opt o) { return log_softmax(x[0], 1, o); }};
    case OpId::batch_norm:
      return {{{{4, 3, 2, 2}}, {{3}}, {{3}}}, [](In x, Opt o) {
                return batch_norm(x[0], x[1], x[2], Tensor(), Tensor(), true, 0.1, 1e-5, o);
              }};
    case OpId::group_norm:
      return {{{{2, 4, 3}}, {{4}}, {{4}}},
              [](In x, Opt o) { return group_norm(x[0], 2, x[1], x[2], 1e-5, o); }};
    case OpId::layer_norm:
      return {{{{3, 4}}, {{4}}, {{4}}},
              [](In x, Opt o) { return layer_norm(x[0], 1, x[1], x[2], 1e-5, o); }};
    case OpId::nll_loss:
      return {{{{5, 4}}, {{5}, Arg::kLabels}},
              [](In x, Opt o) { return nll_loss(x[0], x[1], -100, o); }};
    case OpId::cross_entropy:
      return {{{{5, 4}}, {{5}, Arg::kLabels}},
              [](In x, Opt o) { return cross_entropy(x[0], x[1], 0.0, -100, o); }};
    case OpId::cast:
      return {{{{3, 5}}}, [](In x, Opt) { return cast(x[0], DType::bf16); }};
    case OpId::normalize_input:
      return {{{{1, 2, 2, 2}, Arg::kBytes}}, [](In x, Opt o) {
                return normalize_input(x[0], {0.5f}, {0.25f}, o.out.value_or(DType::f32));
              }};
  }
  return {};
}

// The sample's inputs: the first floating one in `first`, the other floating ones in `rest`
// (requiring grad when `grad`), labels in [0, 4), bytes; finite values unless `bad`, which
// alternates NaN and inf.
std::vector<Tensor> inputs(const Sample& s, DType first, DType rest, bool grad = false,
                           bool bad = false) {
  std::vector<Tensor> xs;
  bool seen_float = false;
  for (const Arg& a : s.args) {
    int64_t n = 1;
    for (int64_t d : a.shape) n *= d;
    std::vector<float> v(static_cast<size_t>(n));
    for (size_t i = 0; i < v.size(); ++i) {
      if (a.kind == Arg::kLabels) {
        v[i] = static_cast<float>(i % 4);
      } else if (a.kind == Arg::kBytes) {
        v[i] = static_cast<float>(i * 37 % 256);
      } else if (bad) {
        v[i] = i % 2 ? INFINITY : NAN;
      } else {
        v[i] = 0.25f * static_cast<float>((i * 7919 + xs.size() * 31) % 13) - 1.4f;
      }
    }
    Tensor t;
    if (a.kind == Arg::kLabels) {
      t = Tensor::from_floats(v, a.shape).to(DType::i64);
    } else if (a.kind == Arg::kBytes) {
      t = Tensor::from_floats(v, a.shape).to(DType::u8);
    } else {
      t = Tensor::from_floats(v, a.shape, seen_float ? rest : first);
      seen_float = true;
      if (grad) t.set_requires_grad(true);
    }
    xs.push_back(t);
  }
  return xs;
}

bool has_float_input(const Sample& s) {
  for (const Arg& a : s.args)
    if (a.kind == Arg::kFloat) return true;
  return false;
}

int float_inputs(const Sample& s) {
  int n = 0;
  for (const Arg& a : s.args) n += a.kind == Arg::kFloat;
  return n;
}

std::string name_of(OpId id) { return std::string(op_info(id).name); }

TEST(OpTable, NamesRoundTripAndAreUnique) {
  for (int i = 0; i < kNumOps; ++i) {
    const OpId id = static_cast<OpId>(i);
    const std::string_view name = op_info(id).name;
    ASSERT_TRUE(op_from_name(name)) << name;
    EXPECT_EQ(*op_from_name(name), id) << name;  // also: no other op has this name
    EXPECT_EQ(std::string(name.data()), name);   // null-terminated, as node names need
    EXPECT_NE(autocast_category_name(op_info(id).category), "?") << name;
    EXPECT_NE(op_kind_name(op_info(id).kind), "?") << name;
    // Never-cast ops are exactly those whose caller names the output type.
    EXPECT_EQ(op_info(id).category == AutocastCategory::kNever,
              op_info(id).kind == OpKind::kConvert)
        << name;
  }
  EXPECT_FALSE(op_from_name("conv3d"));
  EXPECT_FALSE(op_from_name(""));
}

TEST(OpTable, EveryDifferentiableOpRecordsANodeNamedAfterItsEntry) {
  for (int i = 0; i < kNumOps; ++i) {
    const OpId id = static_cast<OpId>(i);
    const Sample s = sample(id);
    const Tensor y = s.call(inputs(s, DType::f32, DType::f32, /*grad=*/true), {});
    if (!has_float_input(s)) {  // input normalization: data
      EXPECT_FALSE(y.grad_fn()) << name_of(id);
      continue;
    }
    ASSERT_TRUE(y.grad_fn()) << name_of(id);
    EXPECT_EQ(std::string(y.grad_fn()->name()), name_of(id));
  }
}

TEST(OpTable, WithoutAutocastEachOpWritesTheTypeItsKindGives) {
  // First input f16, the others bf16: the widest type is f32.
  for (int i = 0; i < kNumOps; ++i) {
    const OpId id = static_cast<OpId>(i);
    const Sample s = sample(id);
    const auto want = default_output_type(op_info(id).kind, DType::f16,
                                          float_inputs(s) > 1 ? DType::f32 : DType::f16);
    if (!want) continue;  // the caller names the type
    EXPECT_EQ(s.call(inputs(s, DType::f16, DType::bf16), {}).dtype(), *want) << name_of(id);
  }
}

// Under autocast to bf16, with the first floating input in f16 and the others in f32, each op is
// put in each category in turn and must run in it: its output type, and gradients that come back
// in each input's own type.
TEST(OpTable, UnderAutocastEachOpRunsInTheCategoryItsPolicyGives) {
  const AutocastCategory categories[] = {AutocastCategory::kLowerPrecision, AutocastCategory::kFp32,
                                         AutocastCategory::kPromote,
                                         AutocastCategory::kFollowInput};
  for (int i = 0; i < kNumOps; ++i) {
    const OpId id = static_cast<OpId>(i);
    if (op_info(id).category == AutocastCategory::kNever) continue;
    const Sample s = sample(id);
    for (AutocastCategory c : categories) {
      SCOPED_TRACE(name_of(id) + " as " + std::string(autocast_category_name(c)));
      AutocastPolicy policy;
      policy.set(id, c);
      DType want = DType::f16;
      switch (c) {
        case AutocastCategory::kLowerPrecision:
          want = DType::bf16;
          break;
        case AutocastCategory::kFp32:
          want = DType::f32;
          break;
        case AutocastCategory::kPromote:
          want = float_inputs(s) > 1 ? DType::f32 : DType::f16;
          break;
        default:
          break;
      }
      const std::vector<Tensor> xs = inputs(s, DType::f16, DType::f32, /*grad=*/true);
      Tensor y;
      {
        AutocastScope scope(DType::bf16, policy);
        y = s.call(xs, {});
      }
      EXPECT_EQ(y.dtype(), want);
      if (y.dtype() != want) continue;
      autograd::backward(y, Tensor::full(y.shape(), 1.0, DType::f32));
      for (const Tensor& x : xs) {
        if (!x.requires_grad()) continue;
        ASSERT_TRUE(x.grad().defined());
        EXPECT_EQ(x.grad().dtype(), x.dtype());
      }
    }
  }
}

TEST(OpTable, AnomalyDetectionChecksEveryOp) {
  autograd::DetectAnomalyScope guard;
  auto anomaly_of = [](const std::function<void()>& fn) -> std::string {
    try {
      fn();
    } catch (const autograd::AnomalyError& e) {
      return e.what();
    }
    return "";
  };
  for (int i = 0; i < kNumOps; ++i) {
    const OpId id = static_cast<OpId>(i);
    const Sample s = sample(id);
    std::string e;
    if (has_float_input(s)) {
      e = anomaly_of([&] { s.call(inputs(s, DType::f32, DType::f32, false, /*bad=*/true), {}); });
    } else {  // input normalization: 1/255 over a tiny std passes FP16's range
      const std::vector<Tensor> xs = inputs(s, DType::f32, DType::f32);
      e = anomaly_of([&] { normalize_input(xs[0], {0.0f}, {1e-8f}, DType::f16); });
    }
    EXPECT_EQ(e.rfind("anomaly in forward: " + name_of(id) + " outside any module produced", 0), 0u)
        << name_of(id) << ": " << e;
  }
}

TEST(OpTable, OnlyMatrixOpsCountMultiplyAdds) {
  for (int i = 0; i < kNumOps; ++i) {
    const OpId id = static_cast<OpId>(i);
    const Sample s = sample(id);
    const std::vector<Tensor> xs = inputs(s, DType::f32, DType::f32);
    MacCounter macs;
    s.call(xs, {});
    EXPECT_EQ(macs.macs() > 0, op_info(id).kind == OpKind::kMatrix) << name_of(id);
  }
}

TEST(OpTable, OnlyMatrixOpsTakePartials) {
  for (int i = 0; i < kNumOps; ++i) {
    const OpId id = static_cast<OpId>(i);
    const Sample s = sample(id);
    const std::vector<Tensor> xs = inputs(s, DType::f16, DType::f16);
    OpOptions o;
    o.out = DType::f32;
    o.partials = kernels::Partials::kF32;
    const std::vector<float> f32 = s.call(xs, o).to_float_vector();
    o.partials = kernels::Partials::kF16;
    const std::vector<float> f16 = s.call(xs, o).to_float_vector();
    EXPECT_EQ(f32 != f16, op_info(id).kind == OpKind::kMatrix) << name_of(id);
  }
}

// Under stochastic outputs an op that computes a 16-bit result rounds it with the next random
// stream. Ops that move values (exact), losses (FP32) and ops whose caller names the type leave the
// streams alone: a probe op run after each shows which stream it got.
TEST(OpTable, StochasticOutputsRoundWhatOpsCompute) {
  const Tensor p = Tensor::full({256}, 0.1, DType::f16);
  auto probe = [&](uint64_t base_stream) {
    StochasticOutputsScope sr(5, base_stream);
    return mul_scalar(p, 1.3).to_float_vector();
  };
  const std::vector<float> stream0 = probe(0), stream1 = probe(1);
  ASSERT_NE(stream0, stream1);
  for (int i = 0; i < kNumOps; ++i) {
    const OpId id = static_cast<OpId>(i);
    const OpKind kind = op_info(id).kind;
    const Sample s = sample(id);
    const std::vector<Tensor> xs = inputs(s, DType::f16, DType::f16);
    StochasticOutputsScope sr(5, 0);
    s.call(xs, {});
    const std::vector<float> after = mul_scalar(p, 1.3).to_float_vector();
    const bool rounds = kind != OpKind::kMove && kind != OpKind::kLoss && kind != OpKind::kConvert;
    EXPECT_EQ(after, rounds ? stream1 : stream0) << name_of(id);
  }
}

// docs/mixed_precision.md lists the ops of each category and of each kind in table order, in rows
// "| <label> | op, op, ... |".
TEST(OpTable, TheDocsListEachCategoryAndKind) {
  std::ifstream f(MANTISSA_SOURCE_DIR "/docs/mixed_precision.md");
  ASSERT_TRUE(f.good());
  std::vector<std::string> lines;
  for (std::string l; std::getline(f, l);) lines.push_back(l);
  auto row = [&](const std::string& label) -> std::string {
    const std::string head = "| " + label + " | ";
    for (const std::string& l : lines)
      if (l.rfind(head, 0) == 0)
        return l.substr(head.size(), l.find(" |", head.size()) - head.size());
    return "(no row '" + label + "')";
  };
  auto names = [](auto keep) {
    std::string out;
    for (const OpInfo& info : kOpInfo)
      if (keep(info)) out += (out.empty() ? "" : ", ") + std::string(info.name);
    return out;
  };
  const std::pair<AutocastCategory, const char*> categories[] = {
      {AutocastCategory::kLowerPrecision, "lower precision"},
      {AutocastCategory::kFp32, "FP32"},
      {AutocastCategory::kPromote, "promote"},
      {AutocastCategory::kFollowInput, "follow input"},
      {AutocastCategory::kNever, "never cast"}};
  for (auto [c, label] : categories)
    EXPECT_EQ(row(label), names([c](const OpInfo& i) { return i.category == c; })) << label;
  for (int k = 0; k <= static_cast<int>(OpKind::kConvert); ++k) {
    const OpKind kind = static_cast<OpKind>(k);
    const std::string label(op_kind_name(kind));
    EXPECT_EQ(row(label), names([kind](const OpInfo& i) { return i.kind == kind; })) << label;
  }
}

}  // namespace
}  // namespace mantissa::ops

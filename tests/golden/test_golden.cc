// Mantissa against PyTorch 1.13 (CPU): every op, the tutorial CNN and a ResNet basic block, in
// FP32 and in BF16 where PyTorch supports it. The golden files come from scripts/make_golden.py;
// each case here has a twin of the same name there and calls Mantissa the same way.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "mantissa/autograd/autograd.h"
#include "mantissa/io/safetensors.h"
#include "mantissa/kernels/reference.h"
#include "mantissa/mantissa.h"
#include "mantissa/ops/ops.h"
#include "support/compare.h"
#include "support/golden.h"
#include "support/tolerances.h"

namespace mantissa {
namespace {

using testing::golden_file;

// Fails naming the tensor, the worst element, its index and both values.
void expect_matches(const std::string& what, const Tensor& got, const Tensor& want, double rtol,
                    double floor = 0.02) {
  ASSERT_EQ(got.shape(), want.shape()) << what << ": shape";
  testing::expect_close(what, reference::from_tensor(got).v, reference::from_tensor(want).v, rtol,
                        floor, 1e-7, "mantissa", "pytorch");
}

void expect_golden(const std::string& what, const Tensor& got, const Tensor& want, bool gradient) {
  const testing::GoldenTolerance tol = testing::golden_tolerance(want.dtype(), gradient);
  expect_matches(what, got, want, tol.rtol, tol.floor);
}

// Largest |a - b| relative to the largest |b|.
double max_rel_error(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = reference::from_tensor(a).v, y = reference::from_tensor(b).v;
  double err = 0, scale = 0;
  for (size_t i = 0; i < x.size(); ++i)
    err = std::max(err, std::fabs(x[i] - y[i])), scale = std::max(scale, std::fabs(y[i]));
  return err / std::max(scale, 1e-30);
}

using OpFn = std::function<Tensor(const std::vector<Tensor>&)>;

std::map<std::string, OpFn> op_cases() {
  using kernels::Conv2dParams;
  using kernels::Pool2dParams;
  auto pool = [](bool include_pad) {
    Pool2dParams p;
    p.kernel_h = p.kernel_w = 3;
    p.stride_h = p.stride_w = 2;
    p.pad_h = p.pad_w = 1;
    p.count_include_pad = include_pad;
    return p;
  };
  std::map<std::string, OpFn> c;
  c["linear"] = [](auto& x) { return ops::linear(x[0], x[1], x[2]); };
  c["matmul"] = [](auto& x) { return ops::matmul(x[0], x[1]); };
  c["conv2d_pad1"] = [](auto& x) {
    return ops::conv2d(x[0], x[1], x[2], Conv2dParams{1, 1, 1, 1, 1, 1, 1});
  };
  c["conv2d_stride2_groups2"] = [](auto& x) {
    return ops::conv2d(x[0], x[1], x[2], Conv2dParams{2, 2, 1, 1, 1, 1, 2});
  };
  c["conv2d_dilation2"] = [](auto& x) {
    return ops::conv2d(x[0], x[1], Tensor(), Conv2dParams{1, 1, 2, 2, 2, 2, 1});
  };
  c["max_pool2d"] = [pool](auto& x) { return ops::max_pool2d(x[0], pool(true)); };
  c["avg_pool2d"] = [pool](auto& x) { return ops::avg_pool2d(x[0], pool(true)); };
  c["avg_pool2d_exclude_pad"] = [pool](auto& x) { return ops::avg_pool2d(x[0], pool(false)); };
  c["adaptive_avg_pool2d"] = [](auto& x) { return ops::adaptive_avg_pool2d(x[0], 3, 2); };
  c["relu"] = [](auto& x) { return ops::relu(x[0]); };
  c["gelu"] = [](auto& x) { return ops::gelu(x[0]); };
  c["sigmoid"] = [](auto& x) { return ops::sigmoid(x[0]); };
  c["tanh"] = [](auto& x) { return ops::tanh(x[0]); };
  c["add"] = [](auto& x) { return ops::add(x[0], x[1]); };
  c["sub"] = [](auto& x) { return ops::sub(x[0], x[1]); };
  c["mul"] = [](auto& x) { return ops::mul(x[0], x[1]); };
  c["div"] = [](auto& x) { return ops::div(x[0], x[1]); };
  c["add_scalar"] = [](auto& x) { return ops::add_scalar(x[0], 0.75); };
  c["mul_scalar"] = [](auto& x) { return ops::mul_scalar(x[0], -1.5); };
  c["batch_norm_eval"] = [](auto& x) {
    return ops::batch_norm(x[0], x[1], x[2], Tensor::from_floats({0.1f, -0.2f, 0.3f}, {3}),
                           Tensor::from_floats({1.5f, 0.5f, 2.0f}, {3}), false, 0.1, 1e-5);
  };
  c["group_norm"] = [](auto& x) { return ops::group_norm(x[0], 3, x[1], x[2], 1e-5); };
  c["layer_norm"] = [](auto& x) { return ops::layer_norm(x[0], 1, x[1], x[2], 1e-5); };
  c["softmax"] = [](auto& x) { return ops::softmax(x[0], 1); };
  c["log_softmax"] = [](auto& x) { return ops::log_softmax(x[0], 0); };
  c["sum"] = [](auto& x) { return ops::sum(x[0], {0, 2}, true); };
  c["mean"] = [](auto& x) { return ops::mean(x[0], {1}); };
  c["cat"] = [](auto& x) { return ops::cat({x[0], x[1], x[2]}, 1); };
  c["transpose"] = [](auto& x) { return ops::transpose(x[0], 0, 2); };
  c["flatten"] = [](auto& x) { return ops::flatten(x[0], 1); };
  c["nll_loss"] = [](auto& x) { return ops::nll_loss(x[0], x[1]); };
  c["cross_entropy"] = [](auto& x) { return ops::cross_entropy(x[0], x[1]); };
  c["cross_entropy_label_smoothing"] = [](auto& x) { return ops::cross_entropy(x[0], x[1], 0.1); };
  return c;
}

class GoldenOp : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenOp, MatchesPyTorch) {
  const std::string name = GetParam();
  const io::SafetensorsFile& f = golden_file("ops.safetensors");
  const OpFn fn = op_cases().at(name);
  int dtypes_run = 0;
  for (const char* dt : {"f32", "bf16"}) {
    const std::string tag = name + "/" + dt + "/";
    if (!f.contains(tag + "out"))
      continue;  // PyTorch cannot run it in this dtype (see the file's metadata)
    ++dtypes_run;
    std::vector<Tensor> in;
    for (int i = 0; f.contains(tag + "in" + std::to_string(i)); ++i) {
      Tensor t = f.at(tag + "in" + std::to_string(i)).clone();
      if (is_floating(t.dtype())) t.set_requires_grad(true);
      in.push_back(t);
    }
    const Tensor want = f.at(tag + "out");
    const Tensor y = fn(in);
    // Same dtype as PyTorch, except losses, which Mantissa always returns in FP32.
    if (name.find("loss") == std::string::npos && name.find("cross_entropy") == std::string::npos) {
      ASSERT_EQ(y.dtype(), want.dtype()) << tag;
    }
    expect_golden(tag + "out", y, want, false);
    autograd::backward(y, f.at(tag + "R").to(y.dtype()));
    for (size_t i = 0; i < in.size(); ++i) {
      if (!f.contains(tag + "grad" + std::to_string(i))) continue;
      ASSERT_TRUE(in[i].grad().defined()) << tag << "grad" << i;
      expect_golden(tag + "grad" + std::to_string(i), in[i].grad(),
                    f.at(tag + "grad" + std::to_string(i)), true);
    }
  }
  EXPECT_GE(dtypes_run, 1) << name << ": no golden data (regenerate with scripts/make_golden.py)";
}

std::vector<std::string> op_names() {
  std::vector<std::string> names;
  for (const auto& [n, fn] : op_cases()) names.push_back(n);
  return names;
}

INSTANTIATE_TEST_SUITE_P(PyTorch, GoldenOp, ::testing::ValuesIn(op_names()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

TEST(Golden, BatchNormTrainingAndRunningStatistics) {
  const io::SafetensorsFile& f = golden_file("ops.safetensors");
  const std::string tag = "batch_norm_train/f32/";
  Tensor x = f.at(tag + "in0").clone(), w = f.at(tag + "in1").clone(),
         b = f.at(tag + "in2").clone();
  x.set_requires_grad(true), w.set_requires_grad(true), b.set_requires_grad(true);
  Tensor rm = Tensor::zeros({3}, DType::f32), rv = Tensor::full({3}, 1.0, DType::f32);
  const Tensor y = ops::batch_norm(x, w, b, rm, rv, true, 0.1, 1e-5);
  expect_golden(tag + "out", y, f.at(tag + "out"), false);
  expect_matches(tag + "running_mean", rm, f.at(tag + "running_mean"), 1e-5);
  expect_matches(tag + "running_var", rv, f.at(tag + "running_var"), 1e-5);
  autograd::backward(y, f.at(tag + "R"));
  expect_golden(tag + "grad0", x.grad(), f.at(tag + "grad0"), true);
  expect_golden(tag + "grad1", w.grad(), f.at(tag + "grad1"), true);
  expect_golden(tag + "grad2", b.grad(), f.at(tag + "grad2"), true);
}

// The model of the PopTorch half-precision tutorial, written with Mantissa's ops.
struct Params {
  std::map<std::string, Tensor> p;
  Params(const io::SafetensorsFile& f, const std::string& tag) {
    const std::string prefix = tag + "param/";
    for (const auto& [name, t] : f.tensors)
      if (name.rfind(prefix, 0) == 0) {
        Tensor c = t.clone();
        if (name.find("running") == std::string::npos) c.set_requires_grad(true);
        p[name.substr(prefix.size())] = c;
      }
  }
  Tensor& operator[](const std::string& n) { return p.at(n); }
};

void compare_grads(const io::SafetensorsFile& f, const std::string& tag, Params& params,
                   const Tensor& input) {
  expect_golden(tag + "grad/input", input.grad(), f.at(tag + "grad/input"), true);
  for (auto& [name, tensor] : params.p) {
    if (name.find("running") != std::string::npos) {
      expect_matches(tag + "after/" + name, tensor, f.at(tag + "after/" + name), 1e-5);
      continue;
    }
    ASSERT_TRUE(tensor.grad().defined()) << name;
    expect_golden(tag + "grad/" + name, tensor.grad(), f.at(tag + "grad/" + name), true);
  }
}

// The tutorial CNN: returns (log-probabilities, loss). `compute` is the dtype every op writes.
std::pair<Tensor, Tensor> tutorial_cnn(Params& P, const Tensor& x, const Tensor& target,
                                       DType compute) {
  ops::OpOptions o;
  o.out = compute;
  kernels::Pool2dParams pool;  // 2x2, stride 2
  Tensor h = ops::max_pool2d(
      ops::relu(ops::conv2d(x, P["conv1.weight"], P["conv1.bias"], {}, o), o), pool, o);
  h = ops::group_norm(ops::relu(ops::conv2d(h, P["conv2.weight"], P["conv2.bias"], {}, o), o), 3,
                      P["norm.weight"], P["norm.bias"], 1e-5, o);
  h = ops::relu(ops::linear(ops::flatten(h, 1), P["fc1.weight"], P["fc1.bias"], o), o);
  const Tensor logp = ops::log_softmax(ops::linear(h, P["fc2.weight"], P["fc2.bias"], o), 1, o);
  return {logp, ops::nll_loss(logp, target)};
}

TEST(Golden, TutorialCnnFp32MatchesPyTorch) {
  const io::SafetensorsFile& f = golden_file("networks.safetensors");
  const std::string tag = "tutorial_cnn/f32/";
  Params P(f, tag);
  Tensor x = f.at(tag + "input").clone();
  x.set_requires_grad(true);
  auto [logp, loss] = tutorial_cnn(P, x, f.at(tag + "target"), DType::f32);
  expect_golden(tag + "out", logp, f.at(tag + "out"), false);
  expect_matches(tag + "loss", loss, f.at(tag + "loss"), 1e-5);
  autograd::backward(loss);
  compare_grads(f, tag, P, x);
}

// In BF16 both PyTorch and Mantissa are approximations of the same network; the exact answer for
// the BF16 parameters and input is their FP32 computation (Mantissa's FP32 path, checked against
// PyTorch above). Mantissa's BF16 must be at least about as accurate as PyTorch's.
TEST(Golden, TutorialCnnBf16IsAsAccurateAsPyTorch) {
  const io::SafetensorsFile& f = golden_file("networks.safetensors");
  const std::string tag = "tutorial_cnn/bf16/";
  ASSERT_TRUE(f.contains(tag + "out"));
  const Tensor target = f.at(tag + "target");
  Params exact_p(f, tag), bf16_p(f, tag);
  Tensor x_exact = f.at(tag + "input").clone(), x_bf16 = f.at(tag + "input").clone();
  x_exact.set_requires_grad(true);
  x_bf16.set_requires_grad(true);
  auto [logp_exact, loss_exact] = tutorial_cnn(exact_p, x_exact, target, DType::f32);
  auto [logp_bf16, loss_bf16] = tutorial_cnn(bf16_p, x_bf16, target, DType::bf16);
  autograd::backward(loss_exact);
  autograd::backward(loss_bf16);
  auto check = [&](const std::string& what, const Tensor& ours, const Tensor& exact,
                   const Tensor& torch_bf16) {
    const double ours_err = max_rel_error(ours, exact),
                 torch_err = max_rel_error(torch_bf16, exact);
    EXPECT_LE(ours_err, 1.25 * torch_err + 0x1p-7)
        << what << ": Mantissa's BF16 error " << ours_err << " against PyTorch's " << torch_err;
    RecordProperty(what, std::to_string(ours_err) + " vs pytorch " + std::to_string(torch_err));
  };
  check("log-probabilities", logp_bf16, logp_exact, f.at(tag + "out"));
  check("loss", loss_bf16, loss_exact, f.at(tag + "loss"));
  check("input gradient", x_bf16.grad(), x_exact.grad(), f.at(tag + "grad/input"));
  for (auto& [name, t] : bf16_p.p)
    check(name + " gradient", t.grad(), exact_p[name].grad(), f.at(tag + "grad/" + name));
}

TEST(Golden, ResNetBasicBlockForwardAndBackward) {
  const io::SafetensorsFile& f = golden_file("networks.safetensors");
  int run = 0;
  for (const char* dt : {"f32", "bf16"}) {
    const std::string tag = std::string("resnet_block/") + dt + "/";
    if (!f.contains(tag + "out")) continue;
    ++run;
    Params P(f, tag);
    Tensor x = f.at(tag + "input").clone();
    x.set_requires_grad(true);
    auto bn = [&](const Tensor& in, const std::string& n) {
      return ops::batch_norm(in, P[n + ".weight"], P[n + ".bias"], P[n + ".running_mean"],
                             P[n + ".running_var"], true);
    };
    Tensor out =
        ops::relu(bn(ops::conv2d(x, P["conv1.weight"], Tensor(), {2, 2, 1, 1, 1, 1, 1}), "bn1"));
    out = bn(ops::conv2d(out, P["conv2.weight"], Tensor(), {1, 1, 1, 1, 1, 1, 1}), "bn2");
    const Tensor shortcut = bn(
        ops::conv2d(x, P["downsample.0.weight"], Tensor(), {2, 2, 0, 0, 1, 1, 1}), "downsample.1");
    const Tensor y = ops::relu(ops::add(out, shortcut));
    expect_golden(tag + "out", y, f.at(tag + "out"), false);
    autograd::backward(y, f.at(tag + "R").to(y.dtype()));
    compare_grads(f, tag, P, x);
  }
  EXPECT_EQ(run, 1) << "f32 golden data expected (PyTorch 1.13 cannot run this block in bf16 with "
                       "fp32 statistics)";
}

}  // namespace
}  // namespace mantissa

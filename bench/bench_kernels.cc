// The kernel benchmark table (docs/numerics.md): GEMM (against OpenBLAS and BLIS, loaded at run
// time if installed), conv2d per layer of the tutorial CNN and ResNet-18, whole-network
// forward+backward, and elementwise/norm bandwidth. Prints figures; asserts nothing.
//
//   build/bench/bench_kernels [--quick] [--threads N]
#include <dlfcn.h>
#include <stdlib.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "mantissa/autograd/autograd.h"
#include "mantissa/kernels/elementwise.h"
#include "mantissa/kernels/gemm.h"
#include "mantissa/kernels/nn.h"
#include "mantissa/mantissa.h"
#include "mantissa/ops/ops.h"

using namespace mantissa;
using kernels::Conv2dParams;

namespace {

int g_threads = 2;
bool g_quick = false;
bool g_networks_only = false;

// Best wall time of fn over a few runs (after one warm-up), in seconds.
double best_time(const std::function<void()>& fn, int reps = 5, double min_total = 0.3) {
  fn();
  double best = 1e30, total = 0;
  for (int r = 0; r < reps || total < min_total; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, dt);
    total += dt;
    if (r > 50) break;
  }
  return best;
}

Tensor random_tensor(const Shape& s, DType t, float scale = 1.0f, uint32_t seed = 1) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, scale);
  int64_t n = 1;
  for (int64_t x : s) n *= x;
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(gen);
  return Tensor::from_floats(v, s, t);
}

// ---- BLAS libraries, loaded at run time ----
using SgemmFn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int,
                         float, float*, int);
struct Blas {
  std::string name;
  SgemmFn sgemm = nullptr;
};
Blas load_blas(const char* name, const char* path, const char* set_threads) {
  Blas b{name};
  void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) return b;
  b.sgemm = reinterpret_cast<SgemmFn>(dlsym(h, "cblas_sgemm"));
  if (auto st = reinterpret_cast<void (*)(int)>(dlsym(h, set_threads))) st(g_threads);
  return b;
}
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

struct GemmShape {
  const char* what;
  int64_t M, N, K;
  bool ta, tb;  // operand stored transposed (as the engine issues it)
};

void gemm_table(const std::vector<Blas>& libs) {
  std::vector<GemmShape> shapes = {
      {"square 256", 256, 256, 256, false, false},
      {"square 512", 512, 512, 512, false, false},
      {"square 1024", 1024, 1024, 1024, false, false},
      {"square 2048", 2048, 2048, 2048, false, false},
      // The tutorial CNN, batch 12 on 128x128 (conv as im2col GEMMs: M=out channels, N=pixels,
      // K=C*k*k).
      {"cnn conv1 fwd", 5, 190512, 9, false, false},
      {"cnn conv2 fwd", 12, 41772, 125, false, false},
      {"cnn conv2 bwd-data", 125, 41772, 12, true, false},
      {"cnn conv2 bwd-weight", 12, 125, 41772, false, true},
      {"cnn fc1 fwd", 12, 100, 41772, false, true},
      {"cnn fc1 bwd-data", 12, 41772, 100, false, false},
      {"cnn fc1 bwd-weight", 100, 41772, 12, true, false},
      // ResNet-18, CIFAR stem, batch 64 on 32x32 (per image chunk as the engine issues them).
      {"r18 stem fwd", 64, 65536, 27, false, false},
      {"r18 layer1 fwd", 64, 14336, 576, false, false},
      {"r18 layer1 bwd-data", 576, 14336, 64, true, false},
      {"r18 layer1 bwd-weight", 64, 576, 14336, false, true},
      {"r18 layer2 fwd", 128, 7168, 1152, false, false},
      {"r18 layer3 fwd", 256, 3584, 2304, false, false},
      {"r18 layer4 fwd", 512, 1024, 4608, false, false},
      {"r18 layer4 bwd-weight", 512, 4608, 1024, false, true},
  };
  if (g_quick) shapes.resize(6);
  std::printf("\n== GEMM, %d threads (GFLOP/s; operands stored as the engine stores them) ==\n",
              g_threads);
  std::printf("%-24s %6s %6s %6s | %8s %8s %8s |", "shape", "M", "N", "K", "f32", "f16-op",
              "bf16-op");
  for (const Blas& b : libs) std::printf(" %8s", b.name.c_str());
  std::printf(" | %7s %7s\n", "f32/best", "bf16/f32");
  for (const GemmShape& s : shapes) {
    const double flops =
        2.0 * static_cast<double>(s.M) * static_cast<double>(s.N) * static_cast<double>(s.K);
    const Tensor a32 = random_tensor(s.ta ? Shape{s.K, s.M} : Shape{s.M, s.K}, DType::f32, 1, 1);
    const Tensor b32 = random_tensor(s.tb ? Shape{s.N, s.K} : Shape{s.K, s.N}, DType::f32, 1, 2);
    Tensor c = Tensor::zeros({s.M, s.N}, DType::f32);
    auto view = [](const Tensor& t, bool trans, int64_t rows, int64_t cols) {
      return trans ? kernels::ConstMatrix{t.data_ptr(), t.dtype(), 1, rows}
                   : kernels::ConstMatrix{t.data_ptr(), t.dtype(), cols, 1};
    };
    double ours[3];
    int col = 0;
    for (DType t : {DType::f32, DType::f16, DType::bf16}) {
      const Tensor a = a32.to(t), b = b32.to(t);
      kernels::GemmOptions o;
      o.threads = g_threads;
      ours[col++] =
          flops / best_time([&] {
            kernels::gemm(s.M, s.N, s.K, 1.0f, view(a, s.ta, s.M, s.K), view(b, s.tb, s.K, s.N),
                          0.0f, {c.data_ptr(), DType::f32, s.N, 1}, o);
          }) /
          1e9;
    }
    std::printf("%-24s %6lld %6lld %6lld | %8.1f %8.1f %8.1f |", s.what,
                static_cast<long long>(s.M), static_cast<long long>(s.N),
                static_cast<long long>(s.K), ours[0], ours[1], ours[2]);
    double best = 0;
    for (const Blas& lib : libs) {
      if (!lib.sgemm) {
        std::printf(" %8s", "n/a");
        continue;
      }
      const float* A = a32.data<float>();
      const float* B = b32.data<float>();
      const double g =
          flops / best_time([&] {
            lib.sgemm(kRowMajor, s.ta ? kTrans : kNoTrans, s.tb ? kTrans : kNoTrans,
                      static_cast<int>(s.M), static_cast<int>(s.N), static_cast<int>(s.K), 1.0f, A,
                      static_cast<int>(s.ta ? s.M : s.K), B, static_cast<int>(s.tb ? s.K : s.N),
                      0.0f, c.data<float>(), static_cast<int>(s.N));
          }) /
          1e9;
      best = std::max(best, g);
      std::printf(" %8.1f", g);
    }
    std::printf(" | %6.0f%% %6.0f%%\n", best > 0 ? 100 * ours[0] / best : 0.0,
                100 * ours[2] / ours[0]);
  }
}

// ---- conv2d layers ----
struct ConvLayer {
  const char* what;
  Shape x, w;
  Conv2dParams p;
};

void conv_table(const char* title, const std::vector<ConvLayer>& layers, DType t) {
  std::printf("\n== conv2d layers, %s, %s storage, %d threads (GFLOP/s) ==\n", title,
              std::string(dtype_name(t)).c_str(), g_threads);
  std::printf("%-22s %-16s %-16s | %8s %9s %10s\n", "layer", "input", "weight", "forward",
              "bwd-data", "bwd-weight");
  for (const ConvLayer& L : layers) {
    const Tensor x = random_tensor(L.x, t), w = random_tensor(L.w, t, 0.1f);
    const Shape ys = kernels::conv2d_output_shape(L.x, L.w, L.p);
    const Tensor dy = random_tensor(ys, t);
    const double flops = 2.0 * static_cast<double>(ys[0] * ys[1] * ys[2] * ys[3]) *
                         static_cast<double>(L.w[1] * L.w[2] * L.w[3]);
    const double f = flops / best_time([&] { kernels::conv2d(x, w, Tensor(), L.p, t); }, 3) / 1e9;
    const double bd =
        flops / best_time([&] { kernels::conv2d_backward_input(dy, w, L.x, L.p, t); }, 3) / 1e9;
    const double bw =
        flops / best_time([&] { kernels::conv2d_backward_weight(dy, x, L.w, L.p, t); }, 3) / 1e9;
    std::printf("%-22s %-16s %-16s | %8.1f %9.1f %10.1f\n", L.what, shape_str(L.x).c_str(),
                shape_str(L.w).c_str(), f, bd, bw);
  }
}

// ---- whole networks ----
Tensor param(const Shape& s, DType t, float scale, uint32_t seed) {
  Tensor p = random_tensor(s, t, scale, seed);
  p.set_requires_grad(true);
  return p;
}

double tutorial_cnn_step(DType t, int64_t batch) {
  const Tensor c1w = param({5, 1, 3, 3}, t, 0.3f, 1), c1b = param({5}, t, 0.1f, 2);
  const Tensor c2w = param({12, 5, 5, 5}, t, 0.1f, 3), c2b = param({12}, t, 0.1f, 4);
  const Tensor nw = param({12}, t, 1.0f, 5), nb = param({12}, t, 0.1f, 6);
  const Tensor f1w = param({100, 41772}, t, 0.005f, 7), f1b = param({100}, t, 0.01f, 8);
  const Tensor f2w = param({10, 100}, t, 0.1f, 9), f2b = param({10}, t, 0.1f, 10);
  const Tensor x = random_tensor({batch, 1, 128, 128}, t);
  std::vector<float> labels(static_cast<size_t>(batch));
  for (int64_t i = 0; i < batch; ++i) labels[static_cast<size_t>(i)] = static_cast<float>(i % 10);
  const Tensor target = Tensor::from_floats(labels, {batch}).to(DType::i64);
  kernels::Pool2dParams pool;
  return best_time(
      [&] {
        Tensor h = ops::max_pool2d(ops::relu(ops::conv2d(x, c1w, c1b)), pool);
        h = ops::group_norm(ops::relu(ops::conv2d(h, c2w, c2b)), 3, nw, nb);
        h = ops::relu(ops::linear(ops::flatten(h, 1), f1w, f1b));
        const Tensor loss = ops::nll_loss(ops::log_softmax(ops::linear(h, f2w, f2b), 1), target);
        autograd::backward(loss);
      },
      3);
}

// ResNet-18 with the CIFAR stem (3x3 conv, no max-pool), batch norm in training mode.
double resnet18_step(DType t, int64_t batch) {
  uint32_t seed = 100;
  struct Bn {
    Tensor w, b, rm, rv;
  };
  auto bn = [&](int64_t c) {
    return Bn{param({c}, t, 0.0f, seed++), param({c}, t, 0.0f, seed++),
              Tensor::zeros({c}, DType::f32), Tensor::full({c}, 1.0, DType::f32)};
  };
  struct Block {
    Tensor c1, c2, ds;
    Bn b1, b2, bds;
    int64_t stride;
  };
  const Tensor stem = param({64, 3, 3, 3}, t, 0.2f, seed++);
  Bn stem_bn = bn(64);
  std::vector<Block> blocks;
  int64_t cin = 64;
  for (int64_t cout : {64, 128, 256, 512})
    for (int i = 0; i < 2; ++i) {
      const int64_t stride = (i == 0 && cout != 64) ? 2 : 1;
      Block b{param({cout, cin, 3, 3}, t, 0.05f, seed++),
              param({cout, cout, 3, 3}, t, 0.05f, seed++),
              stride != 1 || cin != cout ? param({cout, cin, 1, 1}, t, 0.1f, seed++) : Tensor(),
              bn(cout),
              bn(cout),
              bn(cout),
              stride};
      blocks.push_back(b);
      cin = cout;
    }
  const Tensor fcw = param({10, 512}, t, 0.05f, seed++), fcb = param({10}, t, 0.0f, seed++);
  const Tensor x = random_tensor({batch, 3, 32, 32}, t);
  std::vector<float> labels(static_cast<size_t>(batch));
  for (int64_t i = 0; i < batch; ++i) labels[static_cast<size_t>(i)] = static_cast<float>(i % 10);
  const Tensor target = Tensor::from_floats(labels, {batch}).to(DType::i64);
  auto norm = [](const Tensor& in, Bn& b) {
    return ops::batch_norm(in, b.w, b.b, b.rm, b.rv, true);
  };
  return best_time(
      [&] {
        Tensor h = ops::relu(norm(ops::conv2d(x, stem, Tensor(), {1, 1, 1, 1, 1, 1, 1}), stem_bn));
        for (Block& b : blocks) {
          Tensor o = ops::relu(
              norm(ops::conv2d(h, b.c1, Tensor(), {b.stride, b.stride, 1, 1, 1, 1, 1}), b.b1));
          o = norm(ops::conv2d(o, b.c2, Tensor(), {1, 1, 1, 1, 1, 1, 1}), b.b2);
          const Tensor sc =
              b.ds.defined()
                  ? norm(ops::conv2d(h, b.ds, Tensor(), {b.stride, b.stride, 0, 0, 1, 1, 1}), b.bds)
                  : h;
          h = ops::relu(ops::add(o, sc));
        }
        h = ops::flatten(ops::adaptive_avg_pool2d(h, 1, 1), 1);
        autograd::backward(ops::cross_entropy(ops::linear(h, fcw, fcb), target));
      },
      2, 0.0);
}

// ---- bandwidth ----
void bandwidth_table() {
  const int64_t n = int64_t{1} << 24;  // 16M elements
  std::printf(
      "\n== elementwise and norms, 16M elements, %d threads (GB/s: bytes read + written) ==\n",
      g_threads);
  std::vector<char> src(static_cast<size_t>(n * 4), 1), dst(static_cast<size_t>(n * 4));
  const double memcpy_gbs = 2.0 * static_cast<double>(n * 4) / best_time([&] {
                              parallel_for(src.size(), 1 << 16, g_threads, [&](size_t b, size_t e) {
                                std::memcpy(dst.data() + b, src.data() + b, e - b);
                              });
                            }) /
                            1e9;
  std::printf("memcpy (FP32 array): %.1f GB/s\n", memcpy_gbs);
  std::printf("%-28s | %9s %8s | %9s %8s | %s\n", "op", "f32 GB/s", "%memcpy", "bf16 GB/s",
              "%memcpy", "bf16 speed-up");
  struct Op {
    const char* what;
    int reads, writes;  // tensors of n elements
    std::function<void(const Tensor&, const Tensor&, DType)> run;
  };
  const std::vector<Op> list = {
      {"relu", 1, 1,
       [](const Tensor& a, const Tensor&, DType t) {
         kernels::unary(kernels::UnaryOp::kRelu, a, t);
       }},
      {"gelu", 1, 1,
       [](const Tensor& a, const Tensor&, DType t) {
         kernels::unary(kernels::UnaryOp::kGelu, a, t);
       }},
      {"add", 2, 1, [](const Tensor& a, const Tensor& b, DType t) { kernels::add(a, b, t); }},
      {"mul by channel (N,C,H,W)", 1, 1,
       [](const Tensor& a, const Tensor&, DType t) {
         kernels::binary(kernels::BinaryOp::kMul, a.view({64, 256, 32, 32}),
                         Tensor::full({1, 256, 1, 1}, 2.0, t), t);
       }},
      {"relu backward", 2, 1,
       [](const Tensor& a, const Tensor& b, DType t) {
         kernels::unary_backward(kernels::UnaryOp::kRelu, a, Tensor(), b, t);
       }},
      {"batch_norm (train)", 1, 1,
       [](const Tensor& a, const Tensor&, DType t) {
         kernels::batch_norm(a.view({64, 256, 32, 32}), Tensor(), Tensor(), Tensor(), Tensor(),
                             true, 0.1, 1e-5, t);
       }},
      {"group_norm", 1, 1,
       [](const Tensor& a, const Tensor&, DType t) {
         kernels::group_norm(a.view({64, 256, 32, 32}), 32, Tensor(), Tensor(), 1e-5, t);
       }},
      {"softmax (rows of 1024)", 1, 1,
       [](const Tensor& a, const Tensor&, DType t) {
         kernels::softmax(a.view({-1, 1024}), 1, false, t);
       }},
  };
  for (const Op& op : list) {
    double gbs[2];
    int i = 0;
    for (DType t : {DType::f32, DType::bf16}) {
      const Tensor a = random_tensor({n}, t, 1, 3), b = random_tensor({n}, t, 1, 4);
      const double bytes =
          static_cast<double>(n) * static_cast<double>(dtype_size(t)) * (op.reads + op.writes);
      gbs[i++] = bytes / best_time([&] { op.run(a, b, t); }, 3) / 1e9;
    }
    std::printf("%-28s | %9.1f %7.0f%% | %9.1f %7.0f%% | %.2fx\n", op.what, gbs[0],
                100 * gbs[0] / memcpy_gbs, gbs[1], 100 * gbs[1] / memcpy_gbs, 2 * gbs[1] / gbs[0]);
  }
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick"))
      g_quick = true;
    else if (!std::strcmp(argv[i], "--networks"))
      g_networks_only = true;
    else if (!std::strcmp(argv[i], "--threads") && i + 1 < argc)
      g_threads = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: bench_kernels [--quick] [--networks] [--threads N]\n");
      return 2;
    }
  }
  setenv("MANTISSA_NUM_THREADS", std::to_string(g_threads).c_str(), 1);
  std::printf("Mantissa kernel benchmark: %d threads, cpu features: %s\n", g_threads,
              cpu_features_string().c_str());
  const std::vector<Blas> libs = {
      load_blas("OpenBLAS", "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
                "openblas_set_num_threads"),
      load_blas("BLIS", "/usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4",
                "bli_thread_set_num_threads")};
  {  // warm up: start the thread pool and the packing buffers before measuring anything
    const Tensor a = random_tensor({512, 512}, DType::f32);
    Tensor c = Tensor::zeros({512, 512}, DType::f32);
    for (int i = 0; i < 3; ++i)
      kernels::gemm(512, 512, 512, 1.0f, {a.data_ptr(), DType::f32, 512, 1},
                    {a.data_ptr(), DType::f32, 512, 1}, 0.0f, {c.data_ptr(), DType::f32, 512, 1});
  }
  if (!g_networks_only) gemm_table(libs);
  const std::vector<ConvLayer> cnn = {
      {"cnn conv1", {12, 1, 128, 128}, {5, 1, 3, 3}, {}},
      {"cnn conv2", {12, 5, 63, 63}, {12, 5, 5, 5}, {}},
  };
  std::vector<ConvLayer> r18 = {
      {"r18 stem 3->64", {64, 3, 32, 32}, {64, 3, 3, 3}, {1, 1, 1, 1, 1, 1, 1}},
      {"r18 layer1 64->64", {64, 64, 32, 32}, {64, 64, 3, 3}, {1, 1, 1, 1, 1, 1, 1}},
      {"r18 layer2 64->128 s2", {64, 64, 32, 32}, {128, 64, 3, 3}, {2, 2, 1, 1, 1, 1, 1}},
      {"r18 layer2 128->128", {64, 128, 16, 16}, {128, 128, 3, 3}, {1, 1, 1, 1, 1, 1, 1}},
      {"r18 layer2 ds 1x1 s2", {64, 64, 32, 32}, {128, 64, 1, 1}, {2, 2, 0, 0, 1, 1, 1}},
      {"r18 layer3 128->256 s2", {64, 128, 16, 16}, {256, 128, 3, 3}, {2, 2, 1, 1, 1, 1, 1}},
      {"r18 layer3 256->256", {64, 256, 8, 8}, {256, 256, 3, 3}, {1, 1, 1, 1, 1, 1, 1}},
      {"r18 layer4 256->512 s2", {64, 256, 8, 8}, {512, 256, 3, 3}, {2, 2, 1, 1, 1, 1, 1}},
      {"r18 layer4 512->512", {64, 512, 4, 4}, {512, 512, 3, 3}, {1, 1, 1, 1, 1, 1, 1}},
  };
  if (!g_networks_only) conv_table("tutorial CNN (batch 12, 128x128)", cnn, DType::f32);
  if (!g_quick && !g_networks_only) {
    conv_table("ResNet-18 CIFAR (batch 64, 32x32)", r18, DType::f32);
    conv_table("tutorial CNN (batch 12, 128x128)", cnn, DType::bf16);
  }
  std::printf("\n== whole network, forward + backward (no optimizer), %d threads ==\n", g_threads);
  for (DType t : {DType::f32, DType::bf16}) {
    const double s = tutorial_cnn_step(t, 12);
    std::printf(
        "tutorial CNN, batch 12, 128x128, %-4s: %7.1f ms/step, %6.2f ms/image, %6.0f images/s\n",
        std::string(dtype_name(t)).c_str(), s * 1e3, s * 1e3 / 12, 12 / s);
  }
  if (!g_quick)
    for (DType t : {DType::f32, DType::bf16}) {
      const double s = resnet18_step(t, 64);
      std::printf(
          "ResNet-18 CIFAR, batch 64, 32x32, %-4s: %7.1f ms/step, %6.2f ms/image, %6.0f images/s\n",
          std::string(dtype_name(t)).c_str(), s * 1e3, s * 1e3 / 64, 64 / s);
    }
  if (!g_networks_only) bandwidth_table();
  return 0;
}

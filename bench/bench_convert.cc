// Bulk conversion throughput, next to memcpy of the same bytes.
//
//   build/bench/bench_convert                      # everything
//   build/bench/bench_convert --benchmark_filter=bf16
//
// bytes_per_second counts bytes read plus bytes written, for the conversions and for memcpy alike,
// so the columns compare directly: memcpy of the FP32 array is the bandwidth ceiling of the
// FP32 -> 16-bit direction's read side.
#include <benchmark/benchmark.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "mantissa/mantissa.h"

namespace {

using namespace mantissa;

std::vector<float> make_input(size_t n) {
  std::mt19937 gen(1);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

void bm_memcpy(benchmark::State& state, size_t elem_bytes, int threads) {
  const size_t n = static_cast<size_t>(state.range(0));
  std::vector<char> src(n * elem_bytes, 1), dst(n * elem_bytes);
  for (auto _ : state) {
    parallel_for(src.size(), 1 << 16, threads,
                 [&](size_t b, size_t e) { std::memcpy(dst.data() + b, src.data() + b, e - b); });
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * 2 * src.size()));
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * n));
}

void bm_from_f32(benchmark::State& state, DType to, Rounding rounding, SimdPath path, int threads) {
  const size_t n = static_cast<size_t>(state.range(0));
  const std::vector<float> src = make_input(n);
  std::vector<char> dst(n * dtype_size(to));
  CastOptions opt;
  opt.rounding = rounding;
  opt.seed = 3;
  for (auto _ : state) {
    if (threads > 1)
      convert_parallel(src.data(), DType::f32, dst.data(), to, n, opt, threads);
    else
      convert(src.data(), DType::f32, dst.data(), to, n, opt, path);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * (4 + dtype_size(to))));
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * n));
}

void bm_to_f32(benchmark::State& state, DType from, SimdPath path, int threads) {
  const size_t n = static_cast<size_t>(state.range(0));
  const std::vector<float> f = make_input(n);
  std::vector<char> src(n * dtype_size(from));
  convert(f.data(), DType::f32, src.data(), from, n);
  std::vector<float> dst(n);
  for (auto _ : state) {
    if (threads > 1)
      convert_parallel(src.data(), from, dst.data(), DType::f32, n, {}, threads);
    else
      convert(src.data(), from, dst.data(), DType::f32, n, {}, path);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * (4 + dtype_size(from))));
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * n));
}

}  // namespace

int main(int argc, char** argv) {
  // 64K elements stay in cache; 16M (64 MiB of FP32) go to memory.
  const std::vector<int64_t> sizes = {1 << 16, 1 << 24};
  std::vector<SimdPath> paths = {SimdPath::kScalar};
  if (simd_path_supported(SimdPath::kAvx2)) paths.push_back(SimdPath::kAvx2);
  const int hw = default_num_threads();

  for (int64_t n : sizes) {
    benchmark::RegisterBenchmark("memcpy/4B", bm_memcpy, 4, 1)->Arg(n);
    benchmark::RegisterBenchmark("memcpy/2B", bm_memcpy, 2, 1)->Arg(n);
  }
  if (hw > 1)
    benchmark::RegisterBenchmark(("memcpy/4B/" + std::to_string(hw) + "threads").c_str(), bm_memcpy,
                                 4, hw)
        ->Arg(1 << 24);
  for (DType t : {DType::f16, DType::bf16, DType::e4m3, DType::e5m2}) {
    const std::string name(dtype_name(t));
    for (SimdPath p : paths) {
      const std::string pn(simd_path_name(p));
      for (int64_t n : sizes) {
        benchmark::RegisterBenchmark(("f32->" + name + "/nearest/" + pn).c_str(), bm_from_f32, t,
                                     Rounding::kNearestEven, p, 1)
            ->Arg(n);
        benchmark::RegisterBenchmark(("f32->" + name + "/stochastic/" + pn).c_str(), bm_from_f32, t,
                                     Rounding::kStochastic, p, 1)
            ->Arg(n);
        benchmark::RegisterBenchmark((name + "->f32/" + pn).c_str(), bm_to_f32, t, p, 1)->Arg(n);
      }
    }
    if (hw > 1) {
      const std::string tn = std::to_string(hw) + "threads";
      benchmark::RegisterBenchmark(("f32->" + name + "/nearest/" + tn).c_str(), bm_from_f32, t,
                                   Rounding::kNearestEven, active_simd_path(), hw)
          ->Arg(1 << 24);
      benchmark::RegisterBenchmark(("f32->" + name + "/stochastic/" + tn).c_str(), bm_from_f32, t,
                                   Rounding::kStochastic, active_simd_path(), hw)
          ->Arg(1 << 24);
      benchmark::RegisterBenchmark((name + "->f32/" + tn).c_str(), bm_to_f32, t, active_simd_path(),
                                   hw)
          ->Arg(1 << 24);
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

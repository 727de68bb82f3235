// The blocked GEMM driver (the BLIS design: loops over NC columns, KC depth, MC rows, then 16 x 6
// micro-tiles). A and B are converted to FP32 while they are packed into cache-sized panels, so a
// 16-bit operand is never copied whole into FP32.
#include "mantissa/kernels/gemm.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "mantissa/core/convert.h"
#include "mantissa/core/cpu_features.h"
#include "mantissa/core/error.h"
#include "mantissa/core/float_formats.h"
#include "mantissa/core/tensor.h"
#include "mantissa/kernels/elementwise.h"
#include "mantissa/kernels/gemm_kernels.h"
#include "mantissa/kernels/vector_kernels.h"

namespace mantissa::kernels {
namespace detail {
namespace {

float round_f16(float v) { return static_cast<float>(f16(v)); }

// b_off null: b is a packed sliver (kc x 16); otherwise row k of B is at b + b_off[k].
template <bool kF16Partials>
void portable_6x16(int64_t kc, const float* a, const float* b, const int64_t* b_off, float* c,
                   int64_t ldc, bool load_c, float beta) {
  float acc[kMR][kNR];
  for (int i = 0; i < kMR; ++i)
    for (int j = 0; j < kNR; ++j)
      acc[i][j] = load_c ? (beta == 1.0f ? c[i * ldc + j] : beta * c[i * ldc + j]) : 0.0f;
  for (int64_t k = 0; k < kc; ++k) {
    const float* bk = b_off ? b + b_off[k] : b + k * kNR;
    for (int i = 0; i < kMR; ++i)
      for (int j = 0; j < kNR; ++j) acc[i][j] = std::fma(a[k * kMR + i], bk[j], acc[i][j]);
    if (kF16Partials && (k + 1) % 16 == 0)
      for (auto& row : acc)
        for (float& v : row) v = round_f16(v);
  }
  for (int i = 0; i < kMR; ++i)
    for (int j = 0; j < kNR; ++j) c[i * ldc + j] = kF16Partials ? round_f16(acc[i][j]) : acc[i][j];
}

void portable_kernel(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, bool load_c,
                     float beta, bool f16_partials) {
  if (f16_partials)
    portable_6x16<true>(kc, a, b, nullptr, c, ldc, load_c, beta);
  else
    portable_6x16<false>(kc, a, b, nullptr, c, ldc, load_c, beta);
}

void portable_rows_kernel(int64_t kc, const float* a, const float* b, const int64_t* b_off,
                          float* c, int64_t ldc, bool load_c, float beta, bool f16_partials) {
  if (f16_partials)
    portable_6x16<true>(kc, a, b, b_off, c, ldc, load_c, beta);
  else
    portable_6x16<false>(kc, a, b, b_off, c, ldc, load_c, beta);
}

}  // namespace

void portable_interleave_fn(const float* const* line, int rows, int64_t kc, float* dst,
                            int64_t dst_stride) {
  for (int64_t k = 0; k < kc; ++k)
    for (int i = 0; i < rows; ++i) dst[k * dst_stride + i] = line[i][k];
}

void portable_store_block_fn(const float* src, int64_t src_ld, int64_t rows, int64_t cols,
                             void* dst, int64_t dst_rs, DType t, DType round) {
  thread_local std::vector<float> row;
  row.resize(static_cast<size_t>(cols));
  const int64_t es = static_cast<int64_t>(dtype_size(t));
  for (int64_t r = 0; r < rows; ++r) {
    const float* v = src + r * src_ld;
    if (round != DType::f32) {
      std::copy(v, v + cols, row.begin());
      round_through(row.data(), cols, round);
      v = row.data();
    }
    convert(v, DType::f32, static_cast<char*>(dst) + r * dst_rs * es, t, static_cast<size_t>(cols));
  }
}

MicroKernel portable_micro_kernel() { return portable_kernel; }
StoreBlockFn portable_store_block() { return portable_store_block_fn; }
RowsMicroKernel portable_rows_micro_kernel() { return portable_rows_kernel; }
InterleaveFn portable_interleave() { return portable_interleave_fn; }

}  // namespace detail

namespace {

using detail::kMR;
using detail::kNR;

constexpr int64_t kKC = 384;   // depth of a packed panel (a multiple of 16 for FP16 partials)
constexpr int64_t kMC = 96;    // rows of A per packed block: 96 x 384 x 4 B = 144 KiB, in L2
constexpr int64_t kNC = 1024;  // columns of B per packed block: 384 x 1024 x 4 B = 1.5 MiB, in L3
constexpr int64_t kMaxC32 = int64_t{1} << 20;  // FP32 staging of a 16-bit C: at most 4 MiB a thread
// A 16-bit C of one depth panel: through a block of at most this many floats (32 KiB, in L1).
constexpr int64_t kLocalFloats = 8192;
static_assert(kLocalFloats >= kMC * 2 * kNR, "the block holds two slivers of a full row block");
// Depth panels shallower than this walk C along its rows (see gemm_block).
constexpr int64_t kShallowK = 64;
static_assert(kPackedSliverRows == kMR, "PackedMatrix slivers are the micro-kernel's rows");

// Where depth panel kb of a PackedMatrix of `rows` rows starts: each earlier panel holds kKC
// positions of every sliver.
int64_t packed_panel(int64_t rows, int64_t kb) { return kb * kKC * ((rows + kMR - 1) / kMR * kMR); }
// Below this many multiply-adds a GEMM runs on one thread: splitting costs more than it saves.
constexpr double kMinParallelWork = 1 << 18;

struct Kernels {
  detail::MicroKernel micro;
  detail::RowsMicroKernel rows_micro;
  detail::InterleaveFn interleave;
  // 6 x 32 tiles from two slivers (AVX-512); null where the path has none.
  detail::PairMicroKernel pair_micro = nullptr;
  detail::PairRowsMicroKernel pair_rows_micro = nullptr;
  // Rows kernels reading 16-bit B, or FP32 B rounded to 16 bits, indexed by detail::kLoad*
  // (AVX-512; null where the path has none: B is then packed).
  std::array<detail::Rows16MicroKernel, 5> rows16{};
  std::array<detail::PairRows16MicroKernel, 5> pair_rows16{};
  // 12 x 32 tiles from B rows read in place, by load kind, kLoadF32 included (AVX-512).
  std::array<detail::Pair12RowsMicroKernel, 5> pair12_rows{};
  detail::StoreBlockFn store_block = detail::portable_store_block();
};

const Kernels& kernels() {
  static const Kernels k = [] {
#if defined(MANTISSA_HAVE_X86_SIMD)
    const SimdPath path = simd_path(SimdFamily::kGemm);
    if (path == SimdPath::kAvx512) {
      Kernels k{detail::avx512_micro_kernel(), detail::avx512_rows_micro_kernel(),
                detail::avx2_interleave(), detail::avx512_pair_micro_kernel(),
                detail::avx512_pair_rows_micro_kernel()};
      for (int load = detail::kLoadF16; load <= detail::kLoadF32AsBF16; ++load) {
        k.rows16[static_cast<size_t>(load)] = detail::avx512_rows16_micro_kernel(load);
        k.pair_rows16[static_cast<size_t>(load)] = detail::avx512_pair_rows16_micro_kernel(load);
      }
      for (int load = detail::kLoadF32; load <= detail::kLoadF32AsBF16; ++load)
        k.pair12_rows[static_cast<size_t>(load)] = detail::avx512_pair12_rows_micro_kernel(load);
      k.store_block = detail::avx512_store_block();
      return k;
    }
    if (path == SimdPath::kAvx2)
      return Kernels{detail::avx2_micro_kernel(), detail::avx2_rows_micro_kernel(),
                     detail::avx2_interleave()};
#endif
    return Kernels{detail::portable_micro_kernel(), detail::portable_rows_micro_kernel(),
                   detail::portable_interleave()};
  }();
  return k;
}

// Per-thread buffers, charged to the memory tracker as workspace. A large GEMM (kFreeingMacs or
// more multiply-adds) that ends with no other GEMM in flight frees every thread's buffers
// (InFlight): no large call's panels are held while the ops after it run, so the memory a step
// holds at its peak is what the op running then packs (the tutorial CNN's fc1 forward panels,
// 0.4 MB a thread, were held through its backward when buffers lived as long as the threads).
// Small GEMMs leave them for the next: a ResNet-18 step runs tens of thousands (a Winograd tile
// batch's 16, each 64 x 64 x 512 in layer1's weight gradient), mostly while the other thread is
// between its own, and freeing and allocating their buffers around each cost 3% of the step
// (about 50,000 allocations), as a lock taken by every call did. The next large GEMM frees them.
constexpr double kFreeingMacs = 1 << 26;  // about a millisecond of one thread's arithmetic
enum Slot { kStageC, kPackA, kPackB, kRun, kNumSlots };
struct Buffers {
  Tensor slot[kNumSlots];
};
// Every thread's set, listed, and the GEMMs running. Never destroyed: the pool's threads end (and
// unlist theirs) during static destruction, after a static list would be gone.
struct Registry {
  std::mutex mu;  // the list; one release at a time
  std::vector<Buffers*> sets;
  std::atomic<int> in_flight{0};
  std::atomic<bool> releasing{false};
};
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}
struct ThreadBuffers {
  Buffers b;
  ThreadBuffers() {
    std::lock_guard<std::mutex> lock(registry().mu);
    registry().sets.push_back(&b);
  }
  ~ThreadBuffers() {
    std::lock_guard<std::mutex> lock(registry().mu);
    std::erase(registry().sets, &b);
  }
};
// A GEMM (or a pack_rows) running: buffers are used (scratch) only inside one, on its threads.
// When the last one ends, if it `frees`, every thread's buffers are freed. Without a lock on every
// call: a starting GEMM announces itself (in_flight) before it looks for a release in progress,
// and a release announces itself (releasing) before it looks for GEMMs in flight, both
// sequentially consistent, so either the release sees the GEMM and frees nothing, or the GEMM
// sees the release and waits until it is done (and finds its buffers freed).
class InFlight {
 public:
  explicit InFlight(bool frees) : frees_(frees) {
    registry().in_flight.fetch_add(1);
    while (registry().releasing.load()) std::this_thread::yield();
  }
  ~InFlight() {
    if (registry().in_flight.fetch_sub(1) == 1 && frees_) release_gemm_buffers();
  }
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;

 private:
  bool frees_;
};
float* scratch(Slot slot, size_t floats) {
  thread_local ThreadBuffers buffers;
  Tensor& t = buffers.b.slot[slot];
  if (!t.defined() || static_cast<size_t>(t.numel()) < floats) {
    TensorOptions opt;
    opt.category = MemoryCategory::workspace;
    opt.owner = "gemm packing";
    t = Tensor();  // release before allocating the larger one
    t = Tensor::empty({static_cast<int64_t>(floats + 64)}, DType::f32, opt);
  }
  return t.data<float>();
}

const char* at(const void* base, DType t, int64_t offset) {
  return static_cast<const char*>(base) + offset * static_cast<int64_t>(dtype_size(t));
}

// One sliver from `rows` (<= width) lines of kc FP32 values each, line r at src + r * ld:
// interleaved 8 lines at a time, zero past the last line.
void interleave_sliver(const float* src, int64_t ld, int rows, int64_t kc, int width, float* d) {
  for (int r0 = 0; r0 < rows; r0 += 8) {
    const int n = std::min(8, rows - r0);
    const float* line[8];
    for (int i = 0; i < n; ++i) line[i] = src + (r0 + i) * ld;
    kernels().interleave(line, n, kc, d + r0, width);
  }
  if (rows < width)
    for (int64_t k = 0; k < kc; ++k) std::fill(d + k * width + rows, d + (k + 1) * width, 0.0f);
}

// Packs `count` groups of `width` (16 for B, 6 for A) lines of a matrix into slivers: sliver s
// holds, for each of the kc positions along the packed direction, `width` values (zero past
// `lines`). Line l, position p of the source is at element offset l * line_stride + p * pos_stride.
void pack(const void* base, DType t, int64_t line_stride, int64_t pos_stride, int64_t lines,
          int64_t kc, int width, float* dst) {
  const int64_t slivers = (lines + width - 1) / width;
  if (std::llabs(pos_stride) <= std::llabs(line_stride)) {
    // Positions are the contiguous (nearer) direction: convert `width` lines, then interleave.
    // FP32 lines that are contiguous are transposed straight from the source; others are first
    // converted into a run buffer (24 KiB at most: it stays in L1).
    const bool direct = t == DType::f32 && pos_stride == 1;
    float* run = direct ? nullptr : scratch(kRun, static_cast<size_t>(width * kc));
    for (int64_t s = 0; s < slivers; ++s) {
      const int rows = static_cast<int>(std::min<int64_t>(width, lines - s * width));
      const float* src = direct ? static_cast<const float*>(base) + s * width * line_stride : run;
      const int64_t ld = direct ? line_stride : kc;
      if (!direct)
        for (int r = 0; r < rows; ++r)
          load_f32(at(base, t, (s * width + r) * line_stride), t, pos_stride, kc, run + r * kc);
      interleave_sliver(src, ld, rows, kc, width, dst + s * kc * width);
    }
  } else {
    // Lines are the contiguous direction: convert a run across all lines for each position
    // (FP32 lines are copied straight from the source).
    if (t == DType::f32 && line_stride == 1) {
      // Whole 16-wide slivers (B) copy a fixed 64 bytes, which the compiler inlines (a call to
      // memcpy per 64 bytes cost about as much as the copy).
      const int64_t whole = width == kNR ? lines / kNR : 0;
      for (int64_t k = 0; k < kc; ++k) {
        const float* src = static_cast<const float*>(base) + k * pos_stride;
        for (int64_t s = 0; s < whole; ++s)
          std::memcpy(dst + s * kc * kNR + k * kNR, src + s * kNR, kNR * sizeof(float));
        for (int64_t s = whole; s < slivers; ++s) {
          const int64_t w = std::min<int64_t>(width, lines - s * width);
          float* d = dst + s * kc * width + k * width;
          std::memcpy(d, src + s * width, static_cast<size_t>(w) * sizeof(float));
          if (w < width) std::fill(d + w, d + width, 0.0f);
        }
      }
      return;
    }
    float* run = scratch(kRun, static_cast<size_t>(slivers * width));
    std::fill(run + lines, run + slivers * width, 0.0f);
    for (int64_t k = 0; k < kc; ++k) {
      load_f32(at(base, t, k * pos_stride), t, line_stride, lines, run);
      for (int64_t s = 0; s < slivers; ++s)
        std::memcpy(dst + s * kc * width + k * width, run + s * width,
                    static_cast<size_t>(width) * sizeof(float));
    }
  }
}

void check_dtypes(ConstMatrix A, ConstMatrix B, Matrix C) {
  MANTISSA_CHECK(is_floating(A.dtype) && A.dtype != DType::f64 && is_floating(B.dtype) &&
                     B.dtype != DType::f64,
                 "gemm: operands must be f32, f16, bf16, e4m3 or e5m2 (got " +
                     std::string(dtype_name(A.dtype)) + " and " + std::string(dtype_name(B.dtype)) +
                     ")",
                 "convert the operands to a supported float dtype");
  MANTISSA_CHECK(
      is_compute_float(C.dtype),
      "gemm: the output must be f32, f16 or bf16 (got " + std::string(dtype_name(C.dtype)) + ")",
      "write into an f32, f16 or bf16 tensor");
}

// B as gemm_block reads it: a strided matrix (any dtype), or FP32 with its rows or its columns
// listed by offset (offsets.data set).
struct BSource {
  ConstMatrix plain{};
  OffsetMatrix offsets{};
  DType round = DType::f32;  // GemmOptions::round_b (a plain FP32 B only)
  // A plain B with contiguous rows whose full slivers are read in place by the 16-bit rows
  // kernels (detail::kLoad*, 0: not so read), row k at element row16[k] of plain.data.
  int load16 = 0;
  const int64_t* row16 = nullptr;
  PackedPanels panels{};  // B packed ahead (panels.data set): its slivers read in place
};

// Packs columns [j0, j0 + lines) of a column-listed B, depth [pc, pc + kc), into 16-wide slivers
// (as pack does): each column's kc values are contiguous at data + col_offset[j] + pc.
void pack_listed_columns(const OffsetMatrix& B, int64_t j0, int64_t lines, int64_t pc, int64_t kc,
                         float* dst) {
  const int64_t slivers = (lines + kNR - 1) / kNR;
  float* run = scratch(kRun, static_cast<size_t>(kNR * kc));
  for (int64_t s = 0; s < slivers; ++s) {
    const int rows = static_cast<int>(std::min<int64_t>(kNR, lines - s * kNR));
    for (int r = 0; r < rows; ++r)
      std::memcpy(run + r * kc, B.data + B.col_offset[j0 + s * kNR + r] + pc,
                  static_cast<size_t>(kc) * sizeof(float));
    interleave_sliver(run, kc, rows, kc, kNR, dst + s * kc * kNR);
  }
}

// Copies `count` runs of L consecutive floats: run r from row + base[r] to dst + r * L.
template <int L>
inline void copy_runs(const float* row, const int64_t* base, int count, float* dst) {
  for (int r = 0; r < count; ++r) std::memcpy(dst + r * L, row + base[r], L * sizeof(float));
}

// Packs columns [j0, j0 + w) (w <= 16) of a row-listed B, depth [pc, pc + kc), into one sliver
// (zero past w). The columns are copied in runs that are consecutive in memory: runs of 16, 8 or
// 4 (a 16-, 8- or 4-wide output row of a convolution) or 1 (a strided convolution's positions)
// with fixed-size copies, others one by one.
void pack_row_listed_sliver(const OffsetMatrix& B, int64_t j0, int64_t w, int64_t pc, int64_t kc,
                            float* dst) {
  int start[kNR + 1];
  int64_t base[kNR];
  int runs = 0;
  for (int64_t i = 0; i < w; ++i) {
    const int64_t c = B.col_offset ? B.col_offset[j0 + i] : j0 + i;
    if (runs == 0 || c != base[runs - 1] + (i - start[runs - 1])) {
      start[runs] = static_cast<int>(i);
      base[runs] = c;
      ++runs;
    }
  }
  start[runs] = static_cast<int>(w);
  int uniform = w == kNR ? kNR / runs : 0;  // the common run length, if every run has it
  for (int r = 0; r < runs && uniform; ++r)
    if (start[r + 1] - start[r] != uniform) uniform = 0;
  if (!uniform && B.col_offset && runs > kNR / 4) {
    // Short column runs (an implicit weight gradient's taps): where 8 or more rows are
    // consecutive in memory (output positions along a row), transpose 8 x 8 blocks from the
    // columns instead of copying column by column.
    for (int64_t k = 0; k < kc;) {
      const int64_t r0 = B.row_offset[pc + k];
      int64_t run = 1;
      while (k + run < kc && B.row_offset[pc + k + run] == r0 + run) ++run;
      const int64_t span = run / 8 * 8;
      if (span == 0) {
        const float* row = B.data + r0;
        float* d = dst + k * kNR;
        for (int64_t i = 0; i < w; ++i) d[i] = row[B.col_offset[j0 + i]];
        std::fill(d + w, d + kNR, 0.0f);
        ++k;
        continue;
      }
      for (int64_t g = 0; g < w; g += 8) {
        const int n = static_cast<int>(std::min<int64_t>(8, w - g));
        const float* line[8];
        for (int i = 0; i < n; ++i) line[i] = B.data + r0 + B.col_offset[j0 + g + i];
        kernels().interleave(line, n, span, dst + k * kNR + g, kNR);
      }
      if (w < kNR)
        for (int64_t i = k; i < k + span; ++i)
          std::fill(dst + i * kNR + w, dst + (i + 1) * kNR, 0.0f);
      k += span;
    }
    return;
  }
  for (int64_t k = 0; k < kc; ++k) {
    const float* row = B.data + B.row_offset[pc + k];
    float* d = dst + k * kNR;
    switch (uniform) {
      case 16:
        copy_runs<16>(row, base, runs, d);
        break;
      case 8:
        copy_runs<8>(row, base, runs, d);
        break;
      case 4:
        copy_runs<4>(row, base, runs, d);
        break;
      case 1:
        copy_runs<1>(row, base, runs, d);
        break;
      default:
        for (int r = 0; r < runs; ++r)
          for (int i = start[r]; i < start[r + 1]; ++i) d[i] = row[base[r] + (i - start[r])];
        std::fill(d + w, d + kNR, 0.0f);
    }
  }
}

// One thread's whole GEMM on the block C[m0:m1, n0:n1]: the BLIS loop nest (NC columns, KC depth,
// MC rows, then 16 x 6 micro-tiles), with its own packing buffers and no synchronisation. A is
// packed here, a block at a time, or was packed ahead (packed_a: then A is unused, alpha is 1
// and m0 starts a sliver).
void gemm_block(int64_t m0, int64_t m1, int64_t n0, int64_t n1, int64_t K, float alpha,
                const ConstMatrix& A, const BSource& B, float beta, const Matrix& C, bool f16p,
                DType round_c, const PackedMatrix* packed_a) {
  const int64_t M = m1 - m0;
  if (M <= 0 || n1 <= n0) return;
  const detail::MicroKernel micro = kernels().micro;
  const detail::RowsMicroKernel rows_micro = kernels().rows_micro;
  const detail::PairMicroKernel pair_micro = kernels().pair_micro;
  const detail::PairRowsMicroKernel pair_rows_micro = kernels().pair_rows_micro;
  const detail::Rows16MicroKernel rows16_micro = kernels().rows16[static_cast<size_t>(B.load16)];
  const detail::PairRows16MicroKernel pair_rows16_micro =
      kernels().pair_rows16[static_cast<size_t>(B.load16)];
  const bool rows16 = B.load16 != 0;
  const detail::Pair12RowsMicroKernel pair12_rows_micro =
      kernels().pair12_rows[static_cast<size_t>(rows16 ? B.load16 : detail::kLoadF32)];
  const size_t es_b = dtype_size(B.plain.dtype);
  // C in FP32 accumulates in place. A 16-bit C (or an FP32 one rounded to 16 bits: round_c) of
  // one depth panel goes through a local FP32 block on the stack, a few slivers of columns at a
  // time: their tiles are computed there and rounded into C (per_tile). A deeper one is staged in
  // FP32 a block of columns at a time (rounding it to 16 bits between depth panels would not be
  // FP32 accumulation).
  const bool direct = C.dtype == DType::f32 && round_c == DType::f32;
  const bool per_tile = !direct && K <= kKC;
  const int64_t nc_max =
      direct || per_tile ? kNC : std::clamp<int64_t>(kMaxC32 / M / kNR * kNR, kNR, kNC);
  // Row blocks of equal size (a multiple of 6), so no block is a sliver of leftovers.
  const int64_t m_blocks = (M + kMC - 1) / kMC;
  const int64_t mc_step = ((M + m_blocks - 1) / m_blocks + kMR - 1) / kMR * kMR;
  const size_t es_c = dtype_size(C.dtype);
  // per_tile's block: mc_step rows by `group` slivers (an even number, at least two), within
  // kLocalFloats; row stride local_ld.
  const int64_t group = std::max<int64_t>(2, kLocalFloats / mc_step / kNR / 2 * 2);
  const int64_t local_ld = group * kNR;
  alignas(64) float local[kLocalFloats];
  // Rows [r, r + rows) and columns [j, j + cols) of C, to or from an FP32 block (row stride ld):
  // widened from C's type (beta), or rounded through round_c and into C's type.
  auto load_c_rows = [&](float* block, int64_t ld, int64_t r, int64_t rows, int64_t j,
                         int64_t cols) {
    for (int64_t q = 0; q < rows; ++q)
      load_f32(at(C.data, C.dtype, (r + q) * C.rs + j * C.cs), C.dtype, C.cs, cols, block + q * ld);
  };
  auto store_c_rows = [&](float* src, int64_t ld, int64_t r, int64_t rows, int64_t j,
                          int64_t cols) {
    char* dst = static_cast<char*>(C.data) + (r * C.rs + j * C.cs) * static_cast<int64_t>(es_c);
    if (C.cs == 1) return kernels().store_block(src, ld, rows, cols, dst, C.rs, C.dtype, round_c);
    for (int64_t q = 0; q < rows; ++q) {
      float* v = src + q * ld;
      if (round_c != DType::f32) detail::round_through(v, cols, round_c);
      for (int64_t n = 0; n < cols; ++n)
        convert(v + n, DType::f32, dst + (q * C.rs + n * C.cs) * static_cast<int64_t>(es_c),
                C.dtype, 1);
    }
  };

  for (int64_t jc = n0; jc < n1; jc += nc_max) {
    const int64_t nc = std::min(nc_max, n1 - jc);
    float* c_base;
    int64_t c_rs, c_cs;
    float* c32 = nullptr;
    if (direct) {
      c_base = static_cast<float*>(C.data) + m0 * C.rs + jc * C.cs;
      c_rs = C.rs;
      c_cs = C.cs;
    } else if (per_tile) {
      c_base = nullptr;  // the tiles write `local` (c_at)
      c_rs = local_ld;
      c_cs = 1;
    } else {
      c32 = scratch(kStageC, static_cast<size_t>(M * nc));
      c_base = c32;
      c_rs = nc;
      c_cs = 1;
      if (beta != 0.0f) load_c_rows(c32, nc, m0, M, jc, nc);
    }
    const int64_t n_slivers = (nc + kNR - 1) / kNR;
    const int64_t k_blocks = K == 0 ? 1 : (K + kKC - 1) / kKC;
    // Where each sliver of this column block is read: a row-listed B's full slivers whose 16
    // columns are consecutive in memory are read in place by the rows micro-kernel, at
    // data + in_place[s] (no packing), when the rows of A fit one block; the others are packed,
    // sliver s into slot[s] of bp. (A sliver read in place spans two cache lines a row, more than
    // L1 holds at kc = 384; when many A slivers reuse it, an aligned packed copy that stays in L1
    // is faster: docs/numerics.md.)
    const OffsetMatrix& Bo = B.offsets;
    const bool rows_listed = Bo.row_offset != nullptr;
    const bool panels = B.panels.data != nullptr;
    std::array<int64_t, kNC / kNR> in_place, slot;
    int64_t n_packed = 0;
    for (int64_t s = 0; s < n_slivers; ++s) {
      const int64_t j = jc + s * kNR;
      in_place[s] = -1;
      if (rows16 && nc - s * kNR >= kNR) in_place[s] = j;
      if (rows_listed && M <= kMC && nc - s * kNR >= kNR) {
        const int64_t c0 = Bo.col_offset ? Bo.col_offset[j] : j;
        bool consecutive = true;
        for (int64_t i = 1; i < kNR && consecutive && Bo.col_offset; ++i)
          consecutive = Bo.col_offset[j + i] == c0 + i;
        if (consecutive) in_place[s] = c0;
      }
      if (in_place[s] < 0 && !panels) slot[s] = n_packed++;
    }
    for (int64_t kb = 0; kb < k_blocks; ++kb) {
      const int64_t pc = kb * kKC, kc = std::min(kKC, K - pc);
      // A partial sliver packed here is zero past N (B packed ahead holds finite values there).
      float* bp = scratch(kPackB, static_cast<size_t>(n_packed * std::max<int64_t>(kc, 1) * kNR));
      // Packed sliver s of this depth panel: B's own (packed ahead) or this call's.
      auto packed = [&](int64_t s) {
        return panels ? B.panels.data + ((jc / kNR + s) * B.panels.depth + pc) * kNR
                      : bp + slot[s] * kc * kNR;
      };
      if (panels) {
        // Nothing to pack.
      } else if (rows_listed) {
        for (int64_t s = 0; s < n_slivers; ++s)
          if (in_place[s] < 0)
            pack_row_listed_sliver(Bo, jc + s * kNR, std::min<int64_t>(kNR, nc - s * kNR), pc, kc,
                                   bp + slot[s] * kc * kNR);
      } else if (rows16) {
        // The slivers not read in place (a partial last one), packed as a plain B's are.
        const ConstMatrix& Bm = B.plain;
        for (int64_t s = 0; s < n_slivers; ++s) {
          if (in_place[s] >= 0) continue;
          float* dst = bp + slot[s] * kc * kNR;
          pack(at(Bm.data, Bm.dtype, pc * Bm.rs + (jc + s * kNR) * Bm.cs), Bm.dtype, Bm.cs, Bm.rs,
               std::min<int64_t>(kNR, nc - s * kNR), kc, kNR, dst);
          if (B.round != DType::f32) detail::round_through(dst, kc * kNR, B.round);
        }
      } else if (Bo.col_offset) {
        pack_listed_columns(Bo, jc, nc, pc, kc, bp);
      } else {
        // B's lines are its columns (16 per sliver), positions run along k.
        const ConstMatrix& Bm = B.plain;
        pack(at(Bm.data, Bm.dtype, pc * Bm.rs + jc * Bm.cs), Bm.dtype, Bm.cs, Bm.rs, nc, kc, kNR,
             bp);
        // The packed panel rounded as B's 16-bit copy would hold it (zero padding stays zero).
        if (B.round != DType::f32) detail::round_through(bp, n_packed * kc * kNR, B.round);
      }
      // One 6 x 16 tile: sliver s of B against the packed A sliver as.
      auto tile = [&](int64_t s, const float* as, float* c, int64_t ldc, bool load_c,
                      float bscale) {
        if (in_place[s] >= 0 && rows16)
          rows16_micro(kc, as, static_cast<const char*>(B.plain.data) + in_place[s] * es_b,
                       B.row16 + pc, c, ldc, load_c, bscale, f16p);
        else if (in_place[s] >= 0)
          rows_micro(kc, as, Bo.data + in_place[s], Bo.row_offset + pc, c, ldc, load_c, bscale,
                     f16p);
        else
          micro(kc, as, packed(s), c, ldc, load_c, bscale, f16p);
      };
      // Slivers s and s + 1 as one 6 x 32 tile, where the path has pair kernels: both full and
      // both packed or both read in place.
      auto pairable = [&](int64_t s) {
        return pair_micro && s + 1 < n_slivers && nc - (s + 1) * kNR >= kNR &&
               (in_place[s] < 0) == (in_place[s + 1] < 0);
      };
      auto tile_pair = [&](int64_t s, const float* as, float* c, int64_t ldc, bool load_c,
                           float bscale) {
        if (in_place[s] >= 0 && rows16)
          pair_rows16_micro(kc, as, static_cast<const char*>(B.plain.data) + in_place[s] * es_b,
                            static_cast<const char*>(B.plain.data) + in_place[s + 1] * es_b,
                            B.row16 + pc, c, ldc, load_c, bscale, f16p);
        else if (in_place[s] >= 0)
          pair_rows_micro(kc, as, Bo.data + in_place[s], Bo.data + in_place[s + 1],
                          Bo.row_offset + pc, c, ldc, load_c, bscale, f16p);
        else
          pair_micro(kc, as, packed(s), packed(s + 1), c, ldc, load_c, bscale, f16p);
      };
      // Slivers s and s + 1, both read in place, against both A slivers of a 12-row block as one
      // 12 x 32 tile: each B value loaded once for the twelve rows (FP32 partials).
      auto twelve = [&](int64_t s, int64_t mc, bool pair) {
        return pair12_rows_micro && pair && in_place[s] >= 0 && mc == 2 * kMR && c_cs == 1 && !f16p;
      };
      auto tile_twelve = [&](int64_t s, const float* as, float* c, int64_t ldc, bool load_c,
                             float bscale) {
        if (rows16)
          pair12_rows_micro(kc, as, static_cast<const char*>(B.plain.data) + in_place[s] * es_b,
                            static_cast<const char*>(B.plain.data) + in_place[s + 1] * es_b,
                            B.row16 + pc, c, ldc, load_c, bscale);
        else
          pair12_rows_micro(kc, as, Bo.data + in_place[s], Bo.data + in_place[s + 1],
                            Bo.row_offset + pc, c, ldc, load_c, bscale);
      };
      // beta applies on the first depth panel only; later panels add to what is there.
      const bool load_c = kb > 0 || beta != 0.0f;
      const float bscale = kb == 0 ? beta : 1.0f;
      for (int64_t ic = 0; ic < M; ic += mc_step) {
        const int64_t mc = std::min(mc_step, M - ic);
        const float* ap;
        if (packed_a) {
          ap = packed_a->data + packed_panel(packed_a->rows, kb) + (m0 + ic) / kMR * kc * kMR;
        } else {
          float* own = scratch(
              kPackA, static_cast<size_t>(((mc + kMR - 1) / kMR) * kMR * std::max<int64_t>(kc, 1)));
          // A's lines are its rows (6 per sliver), positions run along k.
          pack(at(A.data, A.dtype, (m0 + ic) * A.rs + pc * A.cs), A.dtype, A.rs, A.cs, mc, kc, kMR,
               own);
          if (alpha != 1.0f)
            for (int64_t i = 0; i < ((mc + kMR - 1) / kMR) * kMR * kc; ++i) own[i] *= alpha;
          ap = own;
        }
        // Element (r, j) of this column block of C (row r of the thread's block, column jc + j),
        // where the tiles write it: in C or its staging, or in `local` for per_tile's group of
        // columns starting at local_j (rows from ic).
        int64_t local_j = 0;
        auto c_at = [&](int64_t r, int64_t j) {
          return per_tile ? local + (r - ic) * local_ld + (j - local_j)
                          : c_base + r * c_rs + j * c_cs;
        };
        // Deep panels: a B sliver stays in L1 while the A slivers stream from L2 (BLIS's order).
        // Shallow panels (the cost is writing C): walk along C's rows, so its stores stream.
        float edge[kMR * kNR];
        // The tile of A sliver i (rows ic + i on) by B sliver s, or by slivers s and s + 1.
        auto run = [&](int64_t s, int64_t i, bool pair) {
          const int64_t mr = std::min<int64_t>(kMR, mc - i);
          const float* as = ap + (i / kMR) * kc * kMR;
          if (pair && mr == kMR && c_cs == 1) {
            tile_pair(s, as, c_at(ic + i, s * kNR), c_rs, load_c, bscale);
            return;
          }
          for (int64_t q = s; q < s + (pair ? 2 : 1); ++q) {
            const int64_t j = q * kNR, nr = std::min<int64_t>(kNR, nc - j);
            float* c = c_at(ic + i, j);
            if (mr == kMR && nr == kNR && c_cs == 1) {
              tile(q, as, c, c_rs, load_c, bscale);
              continue;
            }
            // An edge or strided tile goes through a local 6 x 16 tile.
            for (int64_t r = 0; r < kMR; ++r)
              for (int64_t col = 0; col < kNR; ++col)
                edge[r * kNR + col] =
                    (r < mr && col < nr && load_c) ? c[r * c_rs + col * c_cs] : 0.0f;
            tile(q, as, edge, kNR, load_c, bscale);
            for (int64_t r = 0; r < mr; ++r)
              for (int64_t col = 0; col < nr; ++col) c[r * c_rs + col * c_cs] = edge[r * kNR + col];
          }
        };
        // Slivers [s0, s1) against every A sliver of the block, a B sliver (or pair) at a time.
        auto sweep = [&](int64_t s0, int64_t s1) {
          for (int64_t s = s0; s < s1;) {
            const bool pair = pairable(s) && s + 1 < s1;
            if (twelve(s, mc, pair))
              tile_twelve(s, ap, c_at(ic, s * kNR), c_rs, load_c, bscale);
            else
              for (int64_t i = 0; i < mc; i += kMR) run(s, i, pair);
            s += pair ? 2 : 1;
          }
        };
        if (per_tile) {
          // Slivers [g0, g1) into `local`, then rounded and stored into C: rows [ic, ic + mc)
          // and the group's columns. The micro-kernels compute whole tiles there (rows of A past
          // M and columns of B past N are packed as zeros), of which only those are stored.
          for (int64_t g0 = 0; g0 < n_slivers; g0 += group) {
            const int64_t g1 = std::min(n_slivers, g0 + group), j0 = g0 * kNR,
                          cols = std::min(nc, g1 * kNR) - j0;
            local_j = j0;
            if (load_c) {
              std::fill(local, local + mc_step * local_ld, 0.0f);
              load_c_rows(local, local_ld, m0 + ic, mc, jc + j0, cols);
            }
            sweep(g0, g1);
            store_c_rows(local, local_ld, m0 + ic, mc, jc + j0, cols);
          }
        } else if (kc < kShallowK) {
          for (int64_t i = 0; i < mc; i += kMR)
            for (int64_t s = 0; s < n_slivers;) {
              const bool pair = pairable(s);
              if (!twelve(s, mc, pair))
                run(s, i, pair);
              else if (i == 0)
                tile_twelve(s, ap, c_at(ic, s * kNR), c_rs, load_c, bscale);
              s += pair ? 2 : 1;
            }
        } else {
          sweep(0, n_slivers);
        }
      }
    }
    if (c32) store_c_rows(c32, nc, m0, M, jc, nc);
  }
}

}  // namespace

namespace {

// GemmOptions::round_b and round_c: none (f32), or f16 / bf16 for an f32 operand.
void check_rounding(const char* option, DType round, DType operand, const char* name) {
  MANTISSA_CHECK(round == DType::f32 ||
                     ((round == DType::f16 || round == DType::bf16) && operand == DType::f32),
                 std::string("gemm: ") + option + " " + std::string(dtype_name(round)) + " for a " +
                     std::string(dtype_name(operand)) + " " + name,
                 std::string(option) + " rounds an f32 " + name + " to f16 or bf16");
}

// C = beta C, for an empty product (K = 0): A and B hold no values and may have no storage at all
// (an empty batch's activations), so nothing is packed or read from them. Element by element as
// gemm_reference computes it: beta C (C itself at beta 1, zero at beta 0), rounded as the
// partials and round_c say.
void scale_c(int64_t M, int64_t N, float beta, const Matrix& C, const GemmOptions& opt) {
  const int64_t es = static_cast<int64_t>(dtype_size(C.dtype));
  std::vector<float> row(static_cast<size_t>(N));  // [N]
  for (int64_t m = 0; m < M; ++m) {
    char* c = static_cast<char*>(C.data) + m * C.rs * es;
    if (beta != 0.0f) {
      load_f32(c, C.dtype, C.cs, N, row.data());
      if (beta != 1.0f)
        for (float& v : row) v *= beta;
    } else {
      std::fill(row.begin(), row.end(), 0.0f);
    }
    if (opt.partials == Partials::kF16) detail::round_through(row.data(), N, DType::f16);
    if (opt.round_c != DType::f32) detail::round_through(row.data(), N, opt.round_c);
    for (int64_t n = 0; n < N; ++n)
      convert(&row[static_cast<size_t>(n)], DType::f32, c + n * C.cs * es, C.dtype, 1);
  }
}

// Splits C among the threads and runs gemm_block on each part.
void gemm_driver(int64_t M, int64_t N, int64_t K, float alpha, const ConstMatrix& A,
                 const BSource& B, float beta, const Matrix& C, const GemmOptions& opt,
                 const PackedMatrix* packed_a = nullptr) {
  check_rounding("round_c", opt.round_c, C.dtype, "C");
  if (M <= 0 || N <= 0) return;
  if (K <= 0) return scale_c(M, N, beta, C, opt);
  int threads = opt.threads > 0 ? opt.threads : default_num_threads();
  if (static_cast<double>(M) * static_cast<double>(N) *
          static_cast<double>(std::max<int64_t>(K, 1)) <
      kMinParallelWork)
    threads = 1;
  const bool f16p = opt.partials == Partials::kF16;
  // Each thread computes a block of C. Splitting the columns makes every thread pack all of A,
  // splitting the rows makes every thread pack all of B: split the dimension whose duplicate
  // packing is smaller, in whole slivers.
  const int64_t n_slivers = (N + kNR - 1) / kNR, m_slivers = (M + kMR - 1) / kMR;
  const bool split_n = N >= M ? n_slivers >= threads : m_slivers < threads;
  const int64_t units = split_n ? n_slivers : m_slivers;
  // Column blocks of a large GEMM are cut finer than the threads and taken as threads come free:
  // on a shared machine one thread is often slowed for milliseconds, and with one block each the
  // other would wait for it. Each block packs A again, so the blocks stay wide (at least 512
  // columns). Every element of C is computed the same way whatever the blocks, so the result does
  // not depend on them.
  const int64_t parts = split_n && threads > 1
                            ? std::clamp<int64_t>(units / 32, threads, int64_t{4} * threads)
                            : std::min<int64_t>(threads, units);
  const InFlight running(static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K) >=
                         kFreeingMacs);
  parallel_tasks(static_cast<size_t>(parts), static_cast<int>(std::min<int64_t>(threads, parts)),
                 [&](size_t p) {
                   const int64_t u0 = units * static_cast<int64_t>(p) / parts,
                                 u1 = units * static_cast<int64_t>(p + 1) / parts;
                   if (split_n)
                     gemm_block(0, M, std::min(N, u0 * kNR), std::min(N, u1 * kNR), K, alpha, A, B,
                                beta, C, f16p, opt.round_c, packed_a);
                   else
                     gemm_block(std::min(M, u0 * kMR), std::min(M, u1 * kMR), 0, N, K, alpha, A, B,
                                beta, C, f16p, opt.round_c, packed_a);
                 });
}

}  // namespace

void gemm(int64_t M, int64_t N, int64_t K, float alpha, ConstMatrix A, ConstMatrix B, float beta,
          Matrix C, const GemmOptions& opt) {
  check_dtypes(A, B, C);
  check_rounding("round_b", opt.round_b, B.dtype, "B");
  BSource src;
  src.plain = B;
  src.round = opt.round_b;
  // A B with contiguous rows against at most two slivers of A (a small batch's rows: the tutorial
  // CNN's fc1 input gradient, 12 x 100 by 100 x 41772) has its full slivers read in place by
  // gemm_block: packing would copy every value of B for one or two tiles' use. An FP32 B is listed
  // by its rows (the rows micro-kernel, on every path); a 16-bit B, or an FP32 B rounded to 16
  // bits, where the path has kernels that widen or round B's values as they read them (AVX-512).
  // A 16-bit B of one depth panel is read in place against up to two blocks of A's rows too (up
  // to 192 rows: the same layer's input and weight gradients at batch 64, 64 and 100 rows).
  // Packing would widen B's values into FP32 panels (0.8 MB for that input gradient and 0.5 MB
  // for the weight gradient on two threads), which would put a 16-bit model's workspace at the
  // step's peak above half of an FP32 model's. Reading in place converts B's rows once per
  // micro-tile instead of once: about 10% slower on those GEMMs (fc1's weight gradient at batch
  // 64, 100 x 41772 x 64: 2.3 against 2.1 ms), under 1% of the step. The values are those
  // packing would hold and the arithmetic is the rows micro-kernel's, so the bits are the same.
  const int load = B.dtype == DType::f32 && opt.round_b == DType::f32    ? detail::kLoadF32
                   : B.dtype == DType::f16                               ? detail::kLoadF16
                   : B.dtype == DType::bf16                              ? detail::kLoadBF16
                   : B.dtype == DType::f32 && opt.round_b == DType::f16  ? detail::kLoadF32AsF16
                   : B.dtype == DType::f32 && opt.round_b == DType::bf16 ? detail::kLoadF32AsBF16
                                                                         : -1;
  const bool readable = load == detail::kLoadF32 ||
                        (load > detail::kLoadF32 && kernels().rows16[static_cast<size_t>(load)]);
  std::vector<int64_t> rows;
  const bool sixteen = load == detail::kLoadF16 || load == detail::kLoadBF16;
  if (readable && B.cs == 1 && K > 0 && N >= kNR &&
      (M <= 2 * kMR || (sixteen && K <= kKC && M <= 2 * kMC))) {
    rows.resize(static_cast<size_t>(K));
    for (int64_t k = 0; k < K; ++k) rows[static_cast<size_t>(k)] = k * B.rs;
    if (load == detail::kLoadF32) {
      src.offsets = {static_cast<const float*>(B.data), rows.data(), nullptr};
    } else {
      src.load16 = load;
      src.row16 = rows.data();
    }
  }
  gemm_driver(M, N, K, alpha, A, src, beta, C, opt);
}

void release_gemm_buffers() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.releasing.store(true);  // before looking for GEMMs in flight (InFlight)
  if (r.in_flight.load() == 0)
    for (Buffers* b : r.sets)
      for (Tensor& t : b->slot) t = Tensor();
  r.releasing.store(false);
}

size_t packed_floats(int64_t rows, int64_t depth) {
  return static_cast<size_t>((rows + kMR - 1) / kMR * kMR * std::max<int64_t>(depth, 0));
}

void pack_rows(const PackedMatrix& p, int64_t r0, int64_t n, ConstMatrix A) {
  MANTISSA_ASSERT(
      r0 >= 0 && r0 % kMR == 0 && n > 0 && r0 + n <= p.rows && (n % kMR == 0 || r0 + n == p.rows),
      "pack_rows: rows must be whole slivers of 6, or end the matrix");
  // Packed in this thread's buffer first: pack may write a few floats past a sliver, which gemm's
  // own packing overwrites with the next one, but here would land on slivers packed before (or by
  // another thread).
  const int64_t slivers = (n + kMR - 1) / kMR;
  const InFlight running(false);
  for (int64_t pc = 0, kb = 0; pc < p.depth; pc += kKC, ++kb) {
    const int64_t kc = std::min(kKC, p.depth - pc);
    float* own = scratch(kPackA, static_cast<size_t>(slivers * kc * kMR));
    pack(at(A.data, A.dtype, pc * A.cs), A.dtype, A.rs, A.cs, n, kc, kMR, own);
    std::memcpy(p.data + packed_panel(p.rows, kb) + r0 / kMR * kc * kMR, own,
                static_cast<size_t>(slivers * kc * kMR) * sizeof(float));
  }
}

void gemm(int64_t N, const PackedMatrix& A, const OffsetMatrix& B, float beta, Matrix C,
          const GemmOptions& opt) {
  check_dtypes({A.data, DType::f32, 0, 0}, {B.data, DType::f32, 0, 0}, C);
  MANTISSA_CHECK(B.row_offset != nullptr || B.col_offset != nullptr,
                 "gemm: an OffsetMatrix lists neither its rows nor its columns",
                 "set row_offset, col_offset or both");
  BSource src;
  src.offsets = B;
  gemm_driver(A.rows, N, A.depth, 1.0f, {A.data, DType::f32, A.depth, 1}, src, beta, C, opt, &A);
}

void gemm(int64_t N, const PackedMatrix& A, const PackedPanels& B, float beta, Matrix C,
          const GemmOptions& opt) {
  check_dtypes({A.data, DType::f32, 0, 0}, {B.data, DType::f32, 0, 0}, C);
  MANTISSA_CHECK(B.data != nullptr && B.depth == A.depth,
                 "gemm: packed B of depth " + std::to_string(B.depth) +
                     " against packed A of depth " + std::to_string(A.depth),
                 "pack B with the depth of A");
  MANTISSA_CHECK(reinterpret_cast<uintptr_t>(B.data) % 64 == 0,
                 "gemm: packed B not aligned to 64 bytes", "place packed B on a 64-byte boundary");
  BSource src;
  src.panels = B;
  gemm_driver(A.rows, N, A.depth, 1.0f, {A.data, DType::f32, A.depth, 1}, src, beta, C, opt, &A);
}

void gemm(int64_t M, int64_t N, int64_t K, float alpha, ConstMatrix A, const OffsetMatrix& B,
          float beta, Matrix C, const GemmOptions& opt) {
  check_dtypes(A, {B.data, DType::f32, 0, 0}, C);
  MANTISSA_CHECK(B.row_offset != nullptr || B.col_offset != nullptr,
                 "gemm: an OffsetMatrix lists neither its rows nor its columns",
                 "set row_offset, col_offset or both");
  BSource src;
  src.offsets = B;
  gemm_driver(M, N, K, alpha, A, src, beta, C, opt);
}

}  // namespace mantissa::kernels

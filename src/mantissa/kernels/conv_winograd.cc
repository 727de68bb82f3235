// The Winograd F(2x2, 3x3) path (conv_paths.h): 3x3 stride-1 pad-1 convolutions (ResNet's),
// FP32 partials, operands in any float storage (widened exactly: the input while it is padded, the
// weights while they are transformed). Each 4x4 input tile d gives a 2x2 output tile
// Y = A^T [(G g G^T) . (B^T d B)] A (Lavin and Gray, 2015), so the 16 products per tile, per
// channel pair, replace 36 multiply-adds: 2.25x fewer. The elementwise products over channels are
// 16 GEMMs, M[xi] (O, tiles) = U[xi] (O, C) V[xi] (C, tiles). The weight gradient is the same
// factorization transposed: dU[xi] (O, C) = E[xi] (O, tiles) V[xi]^T with E = A e A^T of each
// tile's 2x2 output gradient e, then dw = G^T dU G. The transforms add a few roundings:
// the result differs from the direct sum by a few FP32 ulps of the inputs' magnitudes
// (tests/kernels bound it against the FP64 reference); it is deterministic and does not depend
// on the thread count.
//   G = [1 0 0; 1/2 1/2 1/2; 1/2 -1/2 1/2; 0 0 1]
//   B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1]
//   A^T = [1 1 1 0; 0 1 -1 -1]
// The transforms are vector kernels (vector_kernels.h), 8 tiles or filters a vector on AVX2, 16
// tiles on AVX-512 where they lie in rows of eight or more (the filter gradients, O x C of them a
// call, in scalar code).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "mantissa/core/parallel.h"
#include "mantissa/kernels/conv_paths.h"
#include "mantissa/kernels/nn_internal.h"
#include "mantissa/kernels/vector_kernels.h"

namespace mantissa::kernels::detail {

namespace {

// The per-thread schedule of winograd_forward: for layers whose whole transformed filters U
// (16, O, C) take at most this many floats (1 MiB: within a core's cache beside its own buffers).
constexpr int64_t kPerThreadFilterFloats = int64_t{1} << 18;

// Filters [o, o + n) of the flipped filters of forward weights w (C, O, 3, 3), as stored, filter
// l at dst + l * C * 9: dst[l][c, k] = w[c, o + l, 8 - k]. The n filters of one c lie side by
// side in w, so w is read in order.
template <class Word>
void gather_flipped(const void* w, int64_t O, int64_t o, int64_t n, int64_t C, char* dst) {
  const Word* src = static_cast<const Word*>(w);
  Word* d = reinterpret_cast<Word*>(dst);
  for (int64_t c = 0; c < C; ++c) {
    const Word* f = src + (c * O + o) * 9;
    for (int64_t l = 0; l < n; ++l)
      for (int64_t k = 0; k < 9; ++k) d[(l * C + c) * 9 + k] = f[l * 9 + 8 - k];
  }
}

// U[xi] (nO, C) = G g G^T for output channels [o0, o0 + nO) of the filters in w, stored in any
// float dtype (widened exactly; FP32 rounded to w.read_as first where it is 16-bit), xi = 4 * row
// + column of the 4x4 tile (winograd_filter_f32),
// packed for the GEMM as it is made (u[xi]: each a PackedMatrix of nO rows and C columns). w holds
// (O, C, 3, 3), or with `flipped` the forward weights (C, O, 3, 3) whose channels swapped and taps
// reversed are the filters (a backward-input's): gathered from w a sliver of outputs at a time,
// with no flipped copy of the weights.
void transform_filters(WinogradWeights weights, bool flipped, int64_t o0, int64_t nO, int64_t O,
                       int64_t C, const PackedMatrix* u) {
  constexpr int64_t kRows = kPackedSliverRows;  // outputs transformed and packed together
  const void* w = weights.data;
  const DType wt = weights.dtype;
  const bool round = weights.read_as != DType::f32;
  MANTISSA_ASSERT(!round || (wt == DType::f32 && is_16bit_float(weights.read_as)),
                  "winograd: weights read as 16-bit are stored in FP32");
  const int64_t es = static_cast<int64_t>(dtype_size(wt));
  const int64_t slivers = (nO + kRows - 1) / kRows;
  parallel_for(
      static_cast<size_t>(slivers), 1, nO * C >= 4096 ? default_num_threads() : 1,
      [&](size_t s0, size_t s1) {
        // (C, 3, 3) of one output: FP32 weights read in place (or copied and rounded),
        // others widened; flipped filters gathered as stored first. The sliver's U
        // (16, n, C) is made here, then packed.
        std::vector<float> row(wt == DType::f32 && !round ? 0 : static_cast<size_t>(C * 9));
        std::vector<char> gathered(flipped ? static_cast<size_t>(kRows * C * 9 * es) : 0);
        std::vector<float> sliver(static_cast<size_t>(16 * kRows * C));
        for (size_t s = s0; s < s1; ++s) {
          const int64_t r0 = static_cast<int64_t>(s) * kRows, o = o0 + r0;
          const int64_t n = std::min(kRows, nO - r0);
          if (flipped) switch (es) {
              case 4:
                gather_flipped<uint32_t>(w, O, o, n, C, gathered.data());
                break;
              case 2:
                gather_flipped<uint16_t>(w, O, o, n, C, gathered.data());
                break;
              default:
                gather_flipped<uint8_t>(w, O, o, n, C, gathered.data());
            }
          for (int64_t l = 0; l < n; ++l) {
            const char* src = flipped ? gathered.data() + l * C * 9 * es
                                      : static_cast<const char*>(w) + (o + l) * C * 9 * es;
            const float* f = reinterpret_cast<const float*>(src);
            if (wt != DType::f32 || round) {
              load_f32(src, wt, 1, C * 9, row.data());
              if (round) round_through(row.data(), C * 9, weights.read_as);
              f = row.data();
            }
            winograd_filter_f32(f, C, sliver.data() + l * C, n * C);
          }
          for (int64_t xi = 0; xi < 16; ++xi)
            pack_rows(u[xi], r0, n, {sliver.data() + xi * n * C, DType::f32, C, 1});
        }
      });
}

// Tiles rounded up to whole 16-column slivers.
int64_t whole_slivers(int64_t tiles) { return (tiles + 15) / 16 * 16; }

// Tiles a batch and images a chunk: the batch's transforms, V (16, C, Tb) and (16, rows, Tb),
// within about `bytes` (or `tiles` a batch when given), at least 64 tiles, at most the chunk's,
// a multiple of the GEMM's 16-column slivers; a chunk holds the images of one batch of tiles
// (the padded input's FP32 staging no larger than what the batch reads), at most `images`.
struct TileBatches {
  int64_t images, tiles;
};
TileBatches tile_batches(const ImplicitConv& g, int64_t rows, int64_t bytes, int64_t images,
                         int64_t tiles = 0) {
  const int64_t P = (g.H / 2) * (g.W / 2);
  auto whole = [&](int64_t nb) { return whole_slivers(nb * P); };
  int64_t Tb = tiles > 0 ? tiles
                         : std::min(std::max<int64_t>(bytes / (64 * (g.C + rows)) / 16 * 16, 64),
                                    whole(images));
  const int64_t nb = std::clamp<int64_t>(Tb / std::max<int64_t>(P, 1), 1, images);
  return {nb, std::min(Tb, whole(nb))};
}

// Tiles [t0, t0 + Tb) of a chunk (tile t: image t / P, tile row, tile column): where each starts
// in a channel's padded planes (C, nb, H+2, W+2), at in[t], and where its first output value is
// in an (.., H, W) tensor whose images lie image_stride apart, at out[t] (relative to the
// chunk's first image and channel). Found once a batch, not once a channel.
void tile_offsets(const ImplicitConv& g, int64_t t0, int64_t Tb, int64_t image_stride, int64_t* in,
                  int64_t* out) {
  const int64_t tw = g.W / 2, P = (g.H / 2) * tw;
  for (int64_t t = 0; t < Tb; ++t) {
    const int64_t img = (t0 + t) / P, p = (t0 + t) % P, row = p / tw * 2, col = p % tw * 2;
    in[t] = img * g.plane + row * g.Wp + col;
    out[t] = img * image_stride + row * g.W + col;
  }
}

// V[xi] (C, Tb) = (B^T d B)[xi] of tile t's 4x4 input, for the Tb tiles at `at` of each
// channel's padded planes (xp: (C, nb, H+2, W+2)). Plain: V (16, C, Tb). Packed: each V[xi] in
// the 16-column slivers gemm reads as B (PackedPanels of depth C), at V + xi * C * Tp (Tp: Tb in
// whole slivers), the last sliver's columns past Tb zero.
void input_transforms(const ImplicitConv& g, const float* xp, int64_t nb, const int64_t* at,
                      int64_t Tb, float* V, bool packed) {
  const int64_t C = g.C, Tp = packed ? whole_slivers(Tb) : Tb;
  if (packed) {
    // Sliver by sliver, every channel of a sliver in turn: each row xi of V written in order.
    const int64_t slivers = Tp / 16;
    parallel_for(
        static_cast<size_t>(slivers), 1, threads_for(C * Tb * 16), [&](size_t j0, size_t j1) {
          for (size_t js = j0; js < j1; ++js) {
            const int64_t j = static_cast<int64_t>(js), n = std::min<int64_t>(16, Tb - 16 * j);
            for (int64_t c = 0; c < C; ++c) {
              float* v = V + (j * C + c) * 16;
              winograd_input_run(xp + c * nb * g.plane, at + 16 * j, n, g.Wp, v, C * Tp);
              if (n < 16)
                for (int64_t xi = 0; xi < 16; ++xi) std::fill_n(v + xi * C * Tp + n, 16 - n, 0.0f);
            }
          }
        });
    return;
  }
  parallel_for(static_cast<size_t>(C), 1, threads_for(C * Tb * 16), [&](size_t c0, size_t c1) {
    for (size_t ch = c0; ch < c1; ++ch) {
      const int64_t c = static_cast<int64_t>(ch);
      winograd_input_run(xp + c * nb * g.plane, at, Tb, g.Wp, V + c * Tb, C * Tb);
    }
  });
}

}  // namespace

Tensor winograd_forward(const Tensor& x, const ImplicitConv& g, WinogradWeights w, bool flipped,
                        const std::vector<float>& bias, DType out_dtype, MemoryCategory cat,
                        int64_t out_block) {
  Tensor y = Tensor::empty({g.N, g.O, g.H, g.W}, out_dtype, charged_to(cat));
  const int64_t C = g.C, O = g.O, P = (g.H / 2) * (g.W / 2);
  // Two schedules, the same bits (each output is its tile's transforms of the same GEMM sums):
  // - Per thread, where the whole U is small (ResNet's 64- and 128-channel layers: 256 KiB and
  //   1 MiB): each thread takes groups of images and runs every stage on them alone (pad,
  //   input transform, the 16 GEMMs, output transform) in buffers of its own that stay in its
  //   cache, with no barrier between the stages. Splitting each stage across the threads costs
  //   more there than the stage: 16 GEMMs of 64 x 64 x tiles per batch of tiles.
  // - Per stage, elsewhere: the threads split each stage of one batch of tiles (the channels of
  //   the transforms, the 16 GEMMs), the batch's V and M shared.
  const int threads = default_num_threads();
  const bool per_thread = out_block <= 0 && threads > 1 && g.N >= 2 * threads &&
                          16 * static_cast<int64_t>(packed_floats(O, C)) <= kPerThreadFilterFloats;
  // Output channels in blocks whose transformed filters U (16, Ob, C) take at most twice the
  // weights' stored bytes, or the column budget for small layers: U is 16/9 of the weights in
  // FP32, so an FP32 layer's U is made whole (FP32 weights read as 16-bit too), while a 16-bit
  // layer's (3.6 times its weights) is made in blocks that keep the 16-bit model's memory savings
  // (ResNet's 512-channel layers: two blocks).
  // Blocks outermost, so each block's U is made once; the input is padded and transformed again
  // per block. A block's GEMMs are those of the whole layer restricted to its rows: the same bits.
  const int64_t u_floats =
      std::max(conv_settings().column_budget, 2 * O * C * 9 * esize(w.dtype) / int64_t{4});
  const int64_t Ob =
      per_thread ? O
                 : std::clamp<int64_t>(
                       out_block > 0 ? out_block : u_floats / std::max<int64_t>(16 * C, 1), 1, O);
  Tensor u_t = f32_workspace({16 * static_cast<int64_t>(packed_floats(Ob, C))});
  // Tiles per batch: V (16, C, Tb) and M (16, Ob, Tb) within about 4 MiB (2 MiB a thread for
  // the per-thread schedule, a core's cache), so the transforms and the GEMMs pass them through
  // the caches. A chunk's images within the column budget; per thread, a group of images, at
  // least twice as many groups as threads.
  const TileBatches batches =
      per_thread ? tile_batches(g, Ob, int64_t{2} << 20, std::max<int64_t>(g.N / (2 * threads), 1))
                 : tile_batches(g, Ob, int64_t{4} << 20, g.chunk());
  const int64_t nb_max = batches.images, Tb_max = batches.tiles;
  // Each thread's (or the one schedule's) buffers, made here so that they are charged to the
  // running module: slot s's at s times a slot's size.
  const int64_t slots = per_thread ? threads : 1;
  const int64_t xpad_floats = C * nb_max * g.plane, v_floats = 16 * C * Tb_max,
                m_floats = 16 * Ob * Tb_max;
  Tensor xpad = f32_workspace({slots * xpad_floats});  // [slot] (C, nb, H+2, W+2)
  Tensor v_t = f32_workspace({slots * v_floats});      // [slot] (16, C, Tb) in packed slivers
  Tensor m_t = f32_workspace({slots * m_floats});      // [slot] (16, Ob, Tb)
  // f32, f16 and bf16 outputs are written by the output transform; other dtypes are staged.
  const bool direct =
      out_dtype == DType::f32 || out_dtype == DType::f16 || out_dtype == DType::bf16;
  const int64_t es = esize(out_dtype);
  GemmOptions go;
  go.threads = 1;  // the 16 GEMMs of a batch are the parallel tasks (or one thread's work)
  // [slot] (Tb) where each tile starts in the padded input and its output in y.
  std::vector<int64_t> tile_in(static_cast<size_t>(slots * Tb_max)),
      tile_out(static_cast<size_t>(slots * Tb_max));

  // Images [n0, n0 + nb) through every stage for output channels [o0, o0 + nO), in slot s's
  // buffers. Each stage splits across the threads (parallel_for, parallel_tasks) when called
  // from the calling thread and runs on the one thread when called inside a task.
  const auto run_chunk = [&](int64_t s, int64_t o0, int64_t nO, const PackedMatrix* u, int64_t n0,
                             int64_t nb) {
    float* xp = xpad.data<float>() + s * xpad_floats;
    float* V = v_t.data<float>() + s * v_floats;
    float* M = m_t.data<float>() + s * m_floats;
    int64_t* t_in = tile_in.data() + s * Tb_max;
    int64_t* t_out = tile_out.data() + s * Tb_max;
    const int64_t T = nb * P;
    pad_images(x, g, n0, nb, xp);
    for (int64_t t0 = 0; t0 < T; t0 += Tb_max) {
      const int64_t Tb = std::min(Tb_max, T - t0);
      // Where each tile starts in the padded planes, and its first output in y's image n0 and
      // channel 0.
      tile_offsets(g, t0, Tb, O * g.H * g.W, t_in, t_out);
      // V made in the GEMM's packed slivers, which it reads in place (no packing of V).
      input_transforms(g, xp, nb, t_in, Tb, V, true);
      // M[xi] (nO, Tb) = U[xi] (nO, C) V[xi] (C, Tb)
      const int64_t Tp = whole_slivers(Tb);
      parallel_tasks(16, default_num_threads(), [&](size_t xi) {
        const int64_t i = static_cast<int64_t>(xi);
        gemm(Tb, u[i], PackedPanels{V + i * C * Tp, C}, 0.0f, {M + i * nO * Tb, DType::f32, Tb, 1},
             go);
      });
      // Y = A^T M A + bias for each tile, into y (rounded once into y's dtype from the
      // registers; other dtypes staged in FP32).
      parallel_for(static_cast<size_t>(nO), 1, threads_for(nO * Tb * 16),
                   [&](size_t b0, size_t b1) {
                     void* out[kWinoTiles];
                     float stage[kWinoTiles * 4];  // tile l's 2 x 2 at 4 l, rows 2 apart
                     for (size_t ob = b0; ob < b1; ++ob) {
                       const int64_t o = o0 + static_cast<int64_t>(ob);
                       const float bo = bias.empty() ? 0.0f : bias[static_cast<size_t>(o)];
                       if (direct) {  // the whole batch of tiles in one call
                         winograd_output_run(M + static_cast<int64_t>(ob) * Tb, nO * Tb, Tb, bo,
                                             bytes(y) + (n0 * O + o) * g.H * g.W * es, t_out, g.W,
                                             out_dtype);
                         continue;
                       }
                       for (int64_t t = 0; t < Tb; t += kWinoTiles) {
                         const int n = static_cast<int>(std::min<int64_t>(kWinoTiles, Tb - t));
                         int64_t at[kWinoTiles];  // where tile l's first output is in y
                         for (int l = 0; l < n; ++l) {
                           at[l] = t_out[t + l] + (n0 * O + o) * g.H * g.W;
                           out[l] = static_cast<void*>(stage + 4 * l);
                         }
                         winograd_output(M + static_cast<int64_t>(ob) * Tb + t, nO * Tb, n, bo, out,
                                         2, DType::f32);
                         for (int l = 0; l < n; ++l)
                           for (int r = 0; r < 2; ++r)
                             store_f32(stage + 4 * l + 2 * r, 2, bytes(y) + (at[l] + r * g.W) * es,
                                       out_dtype, 1);
                       }
                     }
                   });
    }
  };

  for (int64_t o0 = 0; o0 < O; o0 += Ob) {
    const int64_t nO = std::min(Ob, O - o0);
    PackedMatrix u[16];  // U[xi] (nO, C), packed for the GEMM
    for (int64_t xi = 0; xi < 16; ++xi)
      u[xi] = {u_t.data<float>() + xi * static_cast<int64_t>(packed_floats(nO, C)), nO, C};
    transform_filters(w, flipped, o0, nO, O, C, u);
    if (per_thread) {
      // Groups of nb_max images, taken in turn by the threads (a thread slowed by a busy machine
      // takes fewer); task s is slot s.
      const int64_t groups = (g.N + nb_max - 1) / nb_max;
      std::atomic<int64_t> next{0};
      parallel_tasks(static_cast<size_t>(slots), threads, [&](size_t s) {
        for (int64_t k; (k = next.fetch_add(1)) < groups;)
          run_chunk(static_cast<int64_t>(s), o0, nO, u, k * nb_max,
                    std::min(nb_max, g.N - k * nb_max));
      });
    } else {
      for (int64_t n0 = 0; n0 < g.N; n0 += nb_max)
        run_chunk(0, o0, nO, u, n0, std::min(nb_max, g.N - n0));
    }
  }
  return y;
}

Tensor winograd_weight_grad(const Tensor& dy, const Tensor& x, const ImplicitConv& g, DType out,
                            int64_t out_block, int64_t tile_batch) {
  const int64_t C = g.C, O = g.O, P = (g.H / 2) * (g.W / 2), HW = g.H * g.W;
  // Output channels in blocks whose dU (16, Ob, C) fits the column budget (ResNet's
  // 512-channel layers: four blocks); the tiles are transformed again for each block. dU[xi]
  // (Ob, C), FP32: each value one FMA chain over every tile in order (a batch's GEMM with beta 1
  // goes on from the batch before), so neither blocks nor batches change a bit.
  const int64_t Ob = std::clamp<int64_t>(
      out_block > 0 ? out_block : conv_settings().column_budget / std::max<int64_t>(16 * C, 1), 1,
      O);
  Tensor du = f32_workspace({16 * Ob * C});
  // Tiles per batch (the GEMMs' depth) as the forward's: V (16, C, Tb) and the output gradients'
  // transforms E (16, Ob, Tb) within about 4 MiB, whole images within the column budget.
  const TileBatches batches = tile_batches(g, Ob, int64_t{4} << 20, g.chunk(), tile_batch);
  const int64_t nb_max = batches.images, Tb_max = batches.tiles;
  Tensor xpad = f32_workspace({C * nb_max * g.plane});  // (C, nb, H+2, W+2)
  Tensor v_t = f32_workspace({16, C, Tb_max}), e_t = f32_workspace({16, Ob, Tb_max});
  // A 16-bit dy widened a chunk at a time into (Ob, nb, H, W); an FP32 one read in place.
  const bool dy32 = dy.dtype() == DType::f32;
  Tensor dy_t = dy32 ? Tensor() : f32_workspace({Ob * nb_max * HW});
  float *V = v_t.data<float>(), *E = e_t.data<float>(), *dU = du.data<float>();
  Tensor dw = Tensor::empty({O, C, 3, 3}, out, charged_to(MemoryCategory::gradients));
  GemmOptions go;
  go.threads = 1;  // the 16 GEMMs of a batch are the parallel tasks
  std::vector<int64_t> tile_in(static_cast<size_t>(Tb_max)), tile_dy(static_cast<size_t>(Tb_max));
  for (int64_t o0 = 0; o0 < O; o0 += Ob) {
    const int64_t nO = std::min(Ob, O - o0);
    for (int64_t n0 = 0; n0 < g.N; n0 += nb_max) {
      const int64_t nb = std::min(nb_max, g.N - n0), T = nb * P;
      float* xp = xpad.data<float>();
      pad_images(x, g, n0, nb, xp);
      // Output channel o0 + o of the chunk's image i at dyp + o * o_stride + i * i_stride.
      const float* dyp = dy32 ? dy.data<float>() + (n0 * O + o0) * HW : dy_t.data<float>();
      const int64_t o_stride = dy32 ? HW : nb * HW, i_stride = dy32 ? O * HW : HW;
      if (!dy32)
        parallel_for(
            static_cast<size_t>(nO * nb), 1, threads_for(nO * nb * HW), [&](size_t p0, size_t p1) {
              for (size_t q = p0; q < p1; ++q) {
                const int64_t o = static_cast<int64_t>(q) / nb, i = static_cast<int64_t>(q) % nb;
                load_f32(bytes(dy) + ((n0 + i) * O + o0 + o) * HW * esize(dy.dtype()), dy.dtype(),
                         1, HW, dy_t.data<float>() + o * o_stride + i * HW);
              }
            });
      for (int64_t t0 = 0; t0 < T; t0 += Tb_max) {
        const int64_t Tb = std::min(Tb_max, T - t0);
        // Where each tile starts in the padded planes and in the output gradients.
        tile_offsets(g, t0, Tb, i_stride, tile_in.data(), tile_dy.data());
        input_transforms(g, xp, nb, tile_in.data(), Tb, V, false);
        // E[xi][o][t] = (A e A^T)[xi] of tile t's 2x2 output gradient e.
        parallel_for(static_cast<size_t>(nO), 1, threads_for(nO * Tb * 16),
                     [&](size_t b0, size_t b1) {
                       for (size_t o = b0; o < b1; ++o)
                         winograd_dy_run(dyp + static_cast<int64_t>(o) * o_stride, tile_dy.data(),
                                         Tb, g.W, E + static_cast<int64_t>(o) * Tb, nO * Tb);
                     });
        // dU[xi] (nO, C) += E[xi] (nO, Tb) V[xi]^T (Tb, C), from zero at the block's first batch.
        const float beta = n0 == 0 && t0 == 0 ? 0.0f : 1.0f;
        parallel_tasks(16, default_num_threads(), [&](size_t xi) {
          const int64_t i = static_cast<int64_t>(xi);
          gemm(nO, C, Tb, 1.0f, {E + i * nO * Tb, DType::f32, Tb, 1},
               {V + i * C * Tb, DType::f32, 1, Tb}, beta, {dU + i * nO * C, DType::f32, C, 1}, go);
        });
      }
    }
    // dw[o0 + o, c] = G^T dU[o, c] G, rounded once into out.
    parallel_for(static_cast<size_t>(nO), 1, threads_for(nO * C * 16), [&](size_t b0, size_t b1) {
      std::vector<float> row(out == DType::f32 ? 0 : static_cast<size_t>(C * 9));
      for (size_t o = b0; o < b1; ++o) {
        const int64_t ob = static_cast<int64_t>(o), at = (o0 + ob) * C * 9;
        float* f = out == DType::f32 ? dw.data<float>() + at : row.data();
        winograd_filter_grad_f32(dU + ob * C, nO * C, C, f);
        if (out != DType::f32) store_f32(f, C * 9, bytes(dw) + at * esize(out), out, 1);
      }
    });
  }
  return dw;
}

}  // namespace mantissa::kernels::detail

// The Winograd F(2x2, 3x3) path (conv_paths.h): 3x3 stride-1 pad-1 convolutions (ResNet's),
// FP32 operands and partials. Each 4x4 input tile d gives a 2x2 output tile
// Y = A^T [(G g G^T) . (B^T d B)] A (Lavin and Gray, 2015), so the 16 products per tile, per
// channel pair, replace 36 multiply-adds: 2.25x fewer. The elementwise products over channels are
// 16 GEMMs, M[xi] (O, tiles) = U[xi] (O, C) V[xi] (C, tiles). The transforms add a few roundings:
// the result differs from the direct sum by a few FP32 ulps of the inputs' magnitudes
// (tests/kernels bound it against the FP64 reference); it is deterministic and does not depend
// on the thread count.
//   G = [1 0 0; 1/2 1/2 1/2; 1/2 -1/2 1/2; 0 0 1]
//   B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1]
//   A^T = [1 1 1 0; 0 1 -1 -1]
// The input and output transforms are vector kernels (vector_kernels.h), 8 tiles at a time.
#include <algorithm>
#include <vector>

#include "mantissa/core/parallel.h"
#include "mantissa/kernels/conv_paths.h"
#include "mantissa/kernels/nn_internal.h"
#include "mantissa/kernels/vector_kernels.h"

namespace mantissa::kernels::detail {

Tensor winograd_forward(const Tensor& x, const ImplicitConv& g, const float* w32,
                        const std::vector<float>& bias, DType out_dtype, MemoryCategory cat) {
  Tensor y = Tensor::empty({g.N, g.O, g.H, g.W}, out_dtype, charged_to(cat));
  const int64_t C = g.C, O = g.O, th = g.H / 2, tw = g.W / 2, P = th * tw;
  // U[xi] (16, O, C) = G g G^T, xi = 4 * row + column of the 4x4 tile.
  Tensor u_t = f32_workspace({16, O, C});
  float* U = u_t.data<float>();
  parallel_for(static_cast<size_t>(O), 1, O * C >= 4096 ? default_num_threads() : 1,
               [&](size_t o0, size_t o1) {
                 for (size_t o = o0; o < o1; ++o)
                   for (int64_t c = 0; c < C; ++c) {
                     const float* k = w32 + (static_cast<int64_t>(o) * C + c) * 9;
                     float t[4][3];  // G g
                     for (int j = 0; j < 3; ++j) {
                       t[0][j] = k[j];
                       t[1][j] = 0.5f * (k[j] + k[3 + j] + k[6 + j]);
                       t[2][j] = 0.5f * (k[j] - k[3 + j] + k[6 + j]);
                       t[3][j] = k[6 + j];
                     }
                     for (int i = 0; i < 4; ++i) {
                       const float r[4] = {t[i][0], 0.5f * (t[i][0] + t[i][1] + t[i][2]),
                                           0.5f * (t[i][0] - t[i][1] + t[i][2]), t[i][2]};
                       for (int j = 0; j < 4; ++j)
                         U[((i * 4 + j) * O + static_cast<int64_t>(o)) * C + c] = r[j];
                     }
                   }
               });
  const int64_t nb_max = g.chunk();
  Tensor xpad = f32_workspace({C * nb_max * g.plane});  // (C, nb, H+2, W+2)
  // Tiles per block: V (16, C, Tb) and M (16, O, Tb) within about 4 MiB, so the transforms and
  // the GEMMs pass them through the caches; at least 64, at most a chunk's tiles, a multiple of
  // the GEMM's 16-column slivers.
  const int64_t Tb_max =
      std::min(std::max<int64_t>((int64_t{4} << 20) / (64 * (C + O)) / 16 * 16, 64),
               (nb_max * P + 15) / 16 * 16);
  Tensor v_t = f32_workspace({16, C, Tb_max}), m_t = f32_workspace({16, O, Tb_max});
  float *V = v_t.data<float>(), *M = m_t.data<float>();
  const bool direct = out_dtype == DType::f32;
  GemmOptions go;
  go.threads = 1;  // the 16 GEMMs of a block are the parallel tasks
  for (int64_t n0 = 0; n0 < g.N; n0 += nb_max) {
    const int64_t nb = std::min(nb_max, g.N - n0), T = nb * P;
    float* xp = xpad.data<float>();
    pad_images(x, g, n0, nb, xp);
    for (int64_t t0 = 0; t0 < T; t0 += Tb_max) {
      const int64_t Tb = std::min(Tb_max, T - t0);
      // Where tile t of the chunk starts in a channel's padded planes: image, tile row, column.
      auto tile_at = [&](int64_t t) {
        const int64_t img = t / P, p = t % P;
        return img * g.plane + (p / tw) * 2 * g.Wp + (p % tw) * 2;
      };
      // V[xi][c][t] = (B^T d B)[xi] of tile t's 4x4 input, kWinoTiles tiles at a time.
      parallel_for(static_cast<size_t>(C), 1, threads_for(C * Tb * 16), [&](size_t c0, size_t c1) {
        const float* in[kWinoTiles];
        for (size_t c = c0; c < c1; ++c) {
          const float* plane = xp + static_cast<int64_t>(c) * nb * g.plane;
          for (int64_t t = 0; t < Tb; t += kWinoTiles) {
            const int n = static_cast<int>(std::min<int64_t>(kWinoTiles, Tb - t));
            for (int l = 0; l < n; ++l) in[l] = plane + tile_at(t0 + t + l);
            winograd_input_f32(in, n, g.Wp, V + static_cast<int64_t>(c) * Tb + t, C * Tb);
          }
        }
      });
      // M[xi] (O, Tb) = U[xi] (O, C) V[xi] (C, Tb)
      // V's rows are listed to the GEMM, which then reads its slivers in place when O is small
      // (no copy of V for a single pass over it).
      std::vector<int64_t> v_rows(static_cast<size_t>(C));
      for (int64_t c = 0; c < C; ++c) v_rows[static_cast<size_t>(c)] = c * Tb;
      parallel_tasks(16, default_num_threads(), [&](size_t xi) {
        const int64_t i = static_cast<int64_t>(xi);
        OffsetMatrix Vx;
        Vx.data = V + i * C * Tb;
        Vx.row_offset = v_rows.data();
        gemm(O, Tb, C, 1.0f, {U + i * O * C, DType::f32, C, 1}, Vx, 0.0f,
             {M + i * O * Tb, DType::f32, Tb, 1}, go);
      });
      // Y = A^T M A + bias for each tile, into y (16-bit: staged in FP32, rounded once).
      parallel_for(static_cast<size_t>(O), 1, threads_for(O * Tb * 16), [&](size_t o0, size_t o1) {
        float* out[kWinoTiles];
        float stage[kWinoTiles * 4];  // tile l's 2 x 2 at 4 l, rows 2 apart
        for (size_t o = o0; o < o1; ++o) {
          const float bo = bias.empty() ? 0.0f : bias[o];
          for (int64_t t = 0; t < Tb; t += kWinoTiles) {
            const int n = static_cast<int>(std::min<int64_t>(kWinoTiles, Tb - t));
            int64_t at[kWinoTiles];  // where tile l's first output is in y
            for (int l = 0; l < n; ++l) {
              const int64_t tt = t0 + t + l, img = tt / P, p = tt % P;
              at[l] = ((n0 + img) * O + static_cast<int64_t>(o)) * g.H * g.W + (p / tw) * 2 * g.W +
                      (p % tw) * 2;
              out[l] = direct ? y.data<float>() + at[l] : stage + 4 * l;
            }
            winograd_output_f32(M + static_cast<int64_t>(o) * Tb + t, O * Tb, n, bo, out,
                                direct ? g.W : 2);
            if (!direct)
              for (int l = 0; l < n; ++l)
                for (int r = 0; r < 2; ++r)
                  store_f32(stage + 4 * l + 2 * r, 2,
                            bytes(y) + (at[l] + r * g.W) * esize(out_dtype), out_dtype, 1);
          }
        }
      });
    }
  }
  return y;
}

}  // namespace mantissa::kernels::detail

// Mixture-of-experts decode GEMV on q4f16_1 experts (schedules/cuda_moe_gemv.py): out[j] = x_j . W[ids[j]]^T for
// the k selected experts, the SwiGLU of gate_up folded in. Calls mlcc_q4x8_hfma2_s1 / mlcc_h2_sum (q4_gemv.cuh).
#include <cuda_fp16.h>

#define MLCC_MOE_WARPS 4  // warps per block (128 threads)

// One thread's share of the kernel; the grid is ceil(KSEL * N / (ROWS * 32 / LANES) / MLCC_MOE_WARPS) blocks of
// MLCC_MOE_WARPS warps.
//   K: input width (K % 32 == 0); N: output width; KSEL: selected experts (ids[KSEL], out[KSEL, N]);
//   ROWS_X: 1 (one x for every expert) or KSEL (expert j reads x row j);
//   SWIGLU: W holds gate rows [0, N) and up rows [N, 2N), out = silu(gate) * up;
//   LANES: lanes per row set (a power of two <= 32; a warp holds 32 / LANES sets);
//   ROWS: consecutive output rows a set owns (N % ROWS == 0, so they share one expert and one x row);
//   CHUNK: units per row whose loads a lane issues together before their math.
// The output rows are flattened over (expert slot j, row r); set i owns rows i*ROWS .. i*ROWS + ROWS - 1. Lane l of
// a set reads the 16-byte units l, l + LANES, ... (one unit: 4 words of W = one 32-code scale group) of each of its
// weight rows, so a warp's load instruction covers LANES * 16 contiguous bytes of a row.
template <int K, int N, int KSEL, int ROWS_X, bool SWIGLU, int LANES, int ROWS, int CHUNK>
__device__ __forceinline__ void mlcc_moe_gemv(const half* __restrict__ x, const int* __restrict__ ids,
                                              const unsigned* __restrict__ w, const half* __restrict__ s,
                                              half* __restrict__ out) {
  static_assert(K % 32 == 0 && N % ROWS == 0 && LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0, "shape");
  static_assert(ROWS_X == 1 || ROWS_X == KSEL, "x has one row or one per expert slot");
  constexpr int UNITS = K / 32;                     // units (= scale groups) per weight row
  constexpr int ITERS = (UNITS + LANES - 1) / LANES;  // units a lane reads per row
  constexpr int RW = SWIGLU ? 2 * ROWS : ROWS;      // weight rows per thread
  constexpr int W_ROWS = SWIGLU ? 2 * N : N;        // rows of one expert's W
  constexpr int SLOTS = 32 / LANES;
  const int lane = threadIdx.x & 31;
  const int sub = lane & (LANES - 1);
  const int set = (blockIdx.x * MLCC_MOE_WARPS + threadIdx.x / 32) * SLOTS + lane / LANES;
  // the last block's surplus sets read nothing but still take part in the shuffles
  const bool active = set < KSEL * N / ROWS;
  const int row0 = active ? set * ROWS : 0;
  const int j = row0 / N;
  const int r0 = row0 - j * N;
  const int e = ids[j];
  const uint4* wp[RW];
  const half* sp[RW];
#pragma unroll
  for (int i = 0; i < RW; ++i) {
    const size_t wrow = (size_t)e * W_ROWS + (i < ROWS ? r0 + i : N + r0 + i - ROWS);
    wp[i] = reinterpret_cast<const uint4*>(w) + wrow * UNITS;
    sp[i] = s + wrow * UNITS;
  }
  const uint4* xp = reinterpret_cast<const uint4*>(x + (ROWS_X == 1 ? 0 : j) * K);
  float acc[RW];
#pragma unroll
  for (int i = 0; i < RW; ++i) acc[i] = 0.f;
#pragma unroll 1
  for (int c0 = 0; c0 < ITERS; c0 += CHUNK) {
    // every weight and scale load of the chunk in flight before the first product: DRAM latency, not the ALU,
    // bounds a GEMV this short
    uint4 wv[CHUNK][RW];
    half sv[CHUNK][RW];
#pragma unroll
    for (int c = 0; c < CHUNK; ++c) {
      const int u = (c0 + c) * LANES + sub;
      const bool ok = active && (ITERS % CHUNK == 0 || c0 + c < ITERS) && (UNITS % LANES == 0 || u < UNITS);
#pragma unroll
      for (int i = 0; i < RW; ++i) {
        wv[c][i] = ok ? __ldcs(wp[i] + u) : make_uint4(0u, 0u, 0u, 0u);
        sv[c][i] = ok ? sp[i][u] : __float2half(0.f);
      }
    }
#pragma unroll
    for (int c = 0; c < CHUNK; ++c) {
      const int u = (c0 + c) * LANES + sub;
      const bool ok = active && (ITERS % CHUNK == 0 || c0 + c < ITERS) && (UNITS % LANES == 0 || u < UNITS);
      if (ok) {
        uint4 xv[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) xv[q] = xp[u * 4 + q];
#pragma unroll
        for (int i = 0; i < RW; ++i) {
          // one group's 32 products summed in fp16, then scaled into the row's fp32 sum
          unsigned h = 0u;
          h = mlcc_q4x8_hfma2_s1(wv[c][i].x, xv[0].x, xv[0].y, xv[0].z, xv[0].w, h);
          h = mlcc_q4x8_hfma2_s1(wv[c][i].y, xv[1].x, xv[1].y, xv[1].z, xv[1].w, h);
          h = mlcc_q4x8_hfma2_s1(wv[c][i].z, xv[2].x, xv[2].y, xv[2].z, xv[2].w, h);
          h = mlcc_q4x8_hfma2_s1(wv[c][i].w, xv[3].x, xv[3].y, xv[3].z, xv[3].w, h);
          acc[i] += mlcc_h2_sum(h) * __half2float(sv[c][i]);
        }
      }
    }
  }
  // the set's lanes are aligned LANES-wide groups of the warp: xor offsets below LANES stay inside one
#pragma unroll
  for (int i = 0; i < RW; ++i) {
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) acc[i] += __shfl_xor_sync(0xFFFFFFFFu, acc[i], o);
  }
  if (active && sub == 0) {
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      if (SWIGLU) {
        // silu(gate) * up from the fp16-rounded projections, as the dense fused kernel
        const float g = __half2float(__float2half(acc[i]));
        const float up = __half2float(__float2half(acc[ROWS + i]));
        out[row0 + i] = __float2half(g / (1.f + __expf(-g)) * up);
      } else {
        out[row0 + i] = __float2half(acc[i]);
      }
    }
  }
}

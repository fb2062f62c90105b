// q4f16_1 GEMV over a few tokens (schedules/cuda_few_token_gemv.py): Y[t, n] = X[t, :] . W[n, :] (EPI 1: + bias[n],
// 2: + residual[t, n], 3: Y float32, the fp16 result widened, as the LM head's cast) for t < m <= TOK. Each 16-byte unit of W (one 32-code group of a row) is read and dequantized
// once, then multiplied with every token's activations: the weights stream once for all m tokens, as in a decode
// step. A warp owns ROWS rows; lane i takes units i, i + 32, ... of them; the sums meet through shuffles.
// Dequantization as mlcc_q4x8_hfma2_s1 (q4_gemv.cuh): codes j and j + 4 of a word land in one fp16 pair, exactly.
__device__ __forceinline__ void mlcc_q4_dequant_word(unsigned w, half2* d) {
  const half2 bias = mlcc_u2h(0x64076407u);       // 1024 + 7
  const half2 sixteenth = mlcc_u2h(0x2C002C00u);  // 1/16
  const half2 bias16 = mlcc_u2h(0xD470D470u);     // -71
  const unsigned w8 = w >> 8;
  d[0] = __hsub2(mlcc_u2h(mlcc_lop3_and_or(w, 0x000F000Fu, 0x64006400u)), bias);
  d[1] = __hfma2(mlcc_u2h(mlcc_lop3_and_or(w, 0x00F000F0u, 0x64006400u)), sixteenth, bias16);
  d[2] = __hsub2(mlcc_u2h(mlcc_lop3_and_or(w8, 0x000F000Fu, 0x64006400u)), bias);
  d[3] = __hfma2(mlcc_u2h(mlcc_lop3_and_or(w8, 0x00F000F0u, 0x64006400u)), sixteenth, bias16);
}

template <int K, int TOK, int ROWS, int EPI>
__device__ __forceinline__ void mlcc_q4_gemv_tokens(const half* __restrict__ X, const unsigned* __restrict__ W,
                                                    const half* __restrict__ S, const half* __restrict__ E,
                                                    void* __restrict__ Y, int m, int N) {
  constexpr int UNITS = K / 32, ITERS = (UNITS + 31) / 32;
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * ROWS;
  float acc[ROWS][TOK];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int t = 0; t < TOK; ++t) acc[r][t] = 0.f;
  uint4 w[ITERS][ROWS];
  half sc[ITERS][ROWS];
  // every weight load of the lane in flight before the math
#pragma unroll
  for (int i = 0; i < ITERS; ++i) {
    const int u = lane + 32 * i;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const bool ok = u < UNITS && row0 + r < N;
      w[i][r] = ok ? reinterpret_cast<const uint4*>(W + (size_t)(row0 + r) * (K / 8))[u]
                   : make_uint4(0x77777777u, 0x77777777u, 0x77777777u, 0x77777777u);
      sc[i][r] = ok ? S[(size_t)(row0 + r) * UNITS + u] : __float2half(0.f);
    }
  }
#pragma unroll
  for (int i = 0; i < ITERS; ++i) {
    const int u = lane + 32 * i;
    if (u >= UNITS) break;
    half2 d[ROWS][16];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      mlcc_q4_dequant_word(w[i][r].x, d[r]);
      mlcc_q4_dequant_word(w[i][r].y, d[r] + 4);
      mlcc_q4_dequant_word(w[i][r].z, d[r] + 8);
      mlcc_q4_dequant_word(w[i][r].w, d[r] + 12);
    }
#pragma unroll
    for (int t = 0; t < TOK; ++t) {
      if (t >= m) break;
      const uint4* xp = reinterpret_cast<const uint4*>(X + (size_t)t * K + u * 32);
      half2 a[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) a[r] = __float2half2_rn(0.f);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const uint4 xv = xp[c];  // activations 8c .. 8c + 7 of the group
        const half2 p0 = mlcc_u2h(__byte_perm(xv.x, xv.z, 0x5410)), p1 = mlcc_u2h(__byte_perm(xv.x, xv.z, 0x7632));
        const half2 p2 = mlcc_u2h(__byte_perm(xv.y, xv.w, 0x5410)), p3 = mlcc_u2h(__byte_perm(xv.y, xv.w, 0x7632));
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          a[r] = __hfma2(d[r][4 * c], p0, a[r]);
          a[r] = __hfma2(d[r][4 * c + 1], p1, a[r]);
          a[r] = __hfma2(d[r][4 * c + 2], p2, a[r]);
          a[r] = __hfma2(d[r][4 * c + 3], p3, a[r]);
        }
      }
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
        acc[r][t] += (__low2float(a[r]) + __high2float(a[r])) * __half2float(sc[i][r]);
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int t = 0; t < TOK; ++t)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[r][t] += __shfl_xor_sync(0xFFFFFFFFu, acc[r][t], o);
  if (lane != 0) return;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int n = row0 + r;
    if (n >= N) break;
#pragma unroll
    for (int t = 0; t < TOK; ++t) {
      if (t >= m) break;
      half y = __float2half(acc[r][t]);
      if constexpr (EPI == 1) y = __hadd(y, E[n]);
      if constexpr (EPI == 2) y = __hadd(y, E[(size_t)t * N + n]);
      if constexpr (EPI == 3) {
        static_cast<float*>(Y)[(size_t)t * N + n] = __half2float(y);
      } else {
        static_cast<half*>(Y)[(size_t)t * N + n] = y;
      }
    }
  }
}

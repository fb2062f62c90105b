// Prefill GEMM on tensor cores (schedules/cuda_gemm.py): C[M, N] = A[M, K] · W[N, K]^T, fp16 in, fp32 accumulate,
// fp16 out, for sm_80+ (mma.sync.m16n8k16 fed by ldmatrix from a cp.async multi-stage shared-memory ring).
// W is fp16 (q0f16) or MLC's q4f16_1: uint32 [N, K/8] (code j of a word in bits 4j..4j+3, value (code - 7) * scale)
// with fp16 scales [N, K/32]; the 4-bit weights are copied to shared memory as they are and dequantized there, one
// k-tile at a time, into the fp16 tile the tensor cores read, so global memory traffic stays 4-bit.
// One block computes a BM x BN tile of C with WM x WN warps, BK (32 or 64: one or two q4 scale groups) of K per
// pipeline stage; shared-memory rows of BK fp16 are 16-byte chunks XOR-swizzled so ldmatrix's eight rows fall in
// distinct banks. Shared memory is the caller's (dynamic: Hopper gives a block up to 227 KB, so deeper rings and
// wider tiles fit than in 48 KB of static memory), cuda_gemm.GemmParams.smem_bytes of it. Rows of A past M read zeros
// and are not stored; N % BN == 0 and K % 64 == 0 are the caller's to check.
// EPI: 0 plain, 1 + bias[n], 2 + residual[m, n], 3 SwiGLU: W's rows are [gate (N/2) ; up (N/2)], the block's B tile
// interleaves them by 8 rows so a thread holds gate and up of the same output column, and C is [M, N/2].
// SPLIT > 1 (few tokens: a grid of N / BN blocks would be a few waves of long serial K loops): blockIdx.z takes
// K / SPLIT of K and the block stores its fp32 partial tile to P[z][M][N]; mlcc_tc_gemm_reduce sums the SPLIT
// partials and applies the epilogue (0, 1 or 2).
#include <cuda_fp16.h>

__device__ __forceinline__ unsigned mlcc_smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mlcc_cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(mlcc_smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void mlcc_cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(mlcc_smem_u32(dst)), "l"(src));
}
__device__ __forceinline__ void mlcc_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void mlcc_cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void mlcc_ldmatrix_x4(unsigned* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(mlcc_smem_u32(p)));
}
__device__ __forceinline__ void mlcc_mma_16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Element offset of 16-byte chunk c of row r in a swizzled [rows][BK] fp16 tile: 64-byte rows pair up in the 32
// banks (so the XOR changes every second row), 128-byte rows fill them.
template <int BK>
__device__ __forceinline__ int mlcc_swz(int r, int c) {
  if constexpr (BK == 32) return r * 32 + ((c ^ ((r >> 1) & 3)) << 3);
  else return r * 64 + ((c ^ (r & 7)) << 3);
}

// The 8 codes of one q4f16_1 word as 4 fp16 pairs in k order, times the group's scale.
__device__ __forceinline__ void mlcc_q4_dequant8(unsigned w, half2 scale, uint4* out) {
  union { unsigned u; half2 h; } p[4], q[4];
  const half2 bias = __halves2half2(__ushort_as_half(0x6407), __ushort_as_half(0x6407));  // 1024 + 7
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // p[j] = (code j, code j + 4) - 7
    p[j].u = ((w >> (4 * j)) & 0x000F000Fu) | 0x64006400u;
    p[j].h = __hmul2(__hsub2(p[j].h, bias), scale);
  }
  q[0].h = __lows2half2(p[0].h, p[1].h);   // codes 0, 1
  q[1].h = __lows2half2(p[2].h, p[3].h);   // 2, 3
  q[2].h = __highs2half2(p[0].h, p[1].h);  // 4, 5
  q[3].h = __highs2half2(p[2].h, p[3].h);  // 6, 7
  *out = make_uint4(q[0].u, q[1].u, q[2].u, q[3].u);
}

__device__ __forceinline__ float mlcc_silu(float x) { return x / (1.0f + __expf(-x)); }

template <int BM, int BN, int BK, int WM, int WN, int STAGES, bool Q4, int EPI, int SPLIT = 1>
__device__ __forceinline__ void mlcc_tc_gemm(const half* __restrict__ A, const void* __restrict__ Wv,
                                             const half* __restrict__ S, const half* __restrict__ E,
                                             half* __restrict__ C, int M, int N, int K,
                                             unsigned char* __restrict__ smem, float* __restrict__ P = nullptr) {
  constexpr int THREADS = WM * WN * 32, CH = BK / 8;  // CH: 16-byte chunks (8 fp16, or one q4 word) per row
  constexpr int WTM = BM / WM, WTN = BN / WN, MI = WTM / 16, NI = WTN / 8;
  static_assert(BK == 32 || BK == 64, "BK");
  static_assert(MI >= 1 && NI % 2 == 0 && (BM * CH) % THREADS == 0 && (BN * CH) % THREADS == 0, "tile shape");
  // one shared array carved by hand, so a variant holds only the buffers it uses
  constexpr int A_BYTES = STAGES * BM * BK * 2, B_BYTES = (Q4 ? 1 : STAGES) * BN * BK * 2;
  constexpr int WQ_BYTES = Q4 ? STAGES * BN * BK / 2 : 0;
  auto As = reinterpret_cast<half(*)[BM * BK]>(smem);
  auto Bs = reinterpret_cast<half(*)[BN * BK]>(smem + A_BYTES);
  // fp16: Bs is the ring; q4: Bs is the one dequantized k-tile, the ring holds the packed words and scale pairs
  auto Wq = reinterpret_cast<unsigned(*)[BN * CH]>(smem + A_BYTES + B_BYTES);
  auto Sq = reinterpret_cast<half2(*)[BN]>(smem + A_BYTES + B_BYTES + WQ_BYTES);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / WN, wn = warp % WN;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  static_assert(SPLIT == 1 || EPI != 3, "split-K partials take no SwiGLU");
  const int KT = K / SPLIT / BK, G = K / 32;
  const int kt0 = SPLIT > 1 ? blockIdx.z * KT : 0;  // this block's first k-tile
  const int Nw = EPI == 3 ? N / 2 : N;  // output columns
  // the weight row behind B-tile row j
  auto wrow = [&](int j) -> int {
    if (EPI != 3) return n0 + j;
    const int g = j >> 3;  // gate and up alternate by 8 rows; block tile covers BN/2 output columns
    return ((g & 1) ? Nw : 0) + (n0 >> 1) + ((g >> 1) << 3) + (j & 7);
  };

  auto load_stage = [&](int slot, int kt_local) {
    const int kt = kt0 + kt_local, k0 = kt * BK;
#pragma unroll
    for (int i = 0; i < BM * CH / THREADS; ++i) {
      const int c = tid + i * THREADS, r = c / CH, ch = c % CH;
      const int gm = m0 + r;
      const half* src = A + (size_t)(gm < M ? gm : M - 1) * K + k0 + ch * 8;
      mlcc_cp_async16(&As[slot][mlcc_swz<BK>(r, ch)], src, gm < M);
    }
    if constexpr (Q4) {
      const unsigned* W = static_cast<const unsigned*>(Wv);
      constexpr int UNITS = BN * CH / 4;  // 16-byte pieces (four words) of the k-tile's packed rows
#pragma unroll
      for (int i = 0; i < (UNITS + THREADS - 1) / THREADS; ++i) {
        const int u = tid + i * THREADS, r = u / (CH / 4), part = u % (CH / 4);
        if (u < UNITS) {
          const int n = wrow(r);
          mlcc_cp_async16(&Wq[slot][r * CH + part * 4], W + (size_t)n * (K / 8) + kt * CH + part * 4, true);
          // the scale pair holding this k-tile's group (BK 32) or groups (BK 64)
          if (part == 0) mlcc_cp_async4(&Sq[slot][r], S + (size_t)n * G + (BK == 64 ? 2 * kt : (kt & ~1)));
        }
      }
    } else {
      const half* W = static_cast<const half*>(Wv);
#pragma unroll
      for (int i = 0; i < BN * CH / THREADS; ++i) {
        const int c = tid + i * THREADS, r = c / CH, ch = c % CH;
        mlcc_cp_async16(&Bs[slot][mlcc_swz<BK>(r, ch)], W + (size_t)wrow(r) * K + k0 + ch * 8, true);
      }
    }
  };

  float acc[MI][NI][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < KT) load_stage(s, s);
    mlcc_cp_async_commit();
  }

  for (int kt = 0; kt < KT; ++kt) {
    mlcc_cp_async_wait<STAGES - 2>();
    __syncthreads();  // stage kt landed for every thread; the slot refilled next was read by all last iteration
    const int slot = kt % STAGES;
    if (kt + STAGES - 1 < KT) load_stage((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
    mlcc_cp_async_commit();
    const half* Bt = Bs[Q4 ? 0 : slot];
    if constexpr (Q4) {
#pragma unroll
      for (int i = 0; i < BN * CH / THREADS; ++i) {  // a packed word (8 codes) becomes one 16-byte fp16 chunk
        const int c = tid + i * THREADS, r = c / CH, wd = c % CH;
        const half2 sp = Sq[slot][r];
        const bool hi = BK == 64 ? wd >= 4 : ((kt0 + kt) & 1);
        const half s1 = hi ? __high2half(sp) : __low2half(sp);
        uint4 v;
        mlcc_q4_dequant8(Wq[slot][r * CH + wd], __halves2half2(s1, s1), &v);
        *reinterpret_cast<uint4*>(&Bs[0][mlcc_swz<BK>(r, wd)]) = v;
      }
      __syncthreads();
    }
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      unsigned af[MI][4], bf[NI][2];
#pragma unroll
      for (int i = 0; i < MI; ++i) {
        const int r = wm * WTM + i * 16 + (lane & 15);
        mlcc_ldmatrix_x4(af[i], &As[slot][mlcc_swz<BK>(r, kk * 2 + (lane >> 4))]);
      }
#pragma unroll
      for (int j = 0; j < NI; j += 2) {
        const int r = wn * WTN + j * 8 + (lane & 7) + ((lane >> 4) << 3);
        unsigned t[4];
        mlcc_ldmatrix_x4(t, &Bt[mlcc_swz<BK>(r, kk * 2 + ((lane >> 3) & 1))]);
        bf[j][0] = t[0]; bf[j][1] = t[1]; bf[j + 1][0] = t[2]; bf[j + 1][1] = t[3];
      }
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j) mlcc_mma_16816(acc[i][j], af[i], bf[j][0], bf[j][1]);
    }
  }
  mlcc_cp_async_wait<0>();

  // Epilogue: thread holds rows lane/4 (+8) and columns 2 * (lane % 4) (+1) of each 16 x 8 accumulator.
#pragma unroll
  for (int i = 0; i < MI; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + wm * WTM + i * 16 + (lane >> 2) + h * 8;
      if (m >= M) continue;
#pragma unroll
      for (int j = 0; j < NI; ++j) {
        if (EPI == 3 && (j & 1)) continue;
        const int nl = wn * WTN + j * 8 + (lane & 3) * 2;  // column within the B tile
        float x0 = acc[i][j][2 * h], x1 = acc[i][j][2 * h + 1];
        int n;
        if constexpr (EPI == 3) {
          n = (n0 >> 1) + ((nl >> 4) << 3) + (nl & 7);
          // silu(gate) * up from the fp16-rounded projections, as the unfused kernels compute it
          const float u0 = __half2float(__float2half(acc[i][j + 1][2 * h]));
          const float u1 = __half2float(__float2half(acc[i][j + 1][2 * h + 1]));
          x0 = mlcc_silu(__half2float(__float2half(x0))) * u0;
          x1 = mlcc_silu(__half2float(__float2half(x1))) * u1;
        } else {
          n = n0 + nl;
        }
        if constexpr (SPLIT > 1) {
          *reinterpret_cast<float2*>(P + ((size_t)blockIdx.z * M + m) * N + n) = make_float2(x0, x1);
          continue;
        }
        half2 o = __floats2half2_rn(x0, x1);
        if constexpr (EPI == 1) o = __hadd2(o, *reinterpret_cast<const half2*>(E + n));
        if constexpr (EPI == 2) o = __hadd2(o, *reinterpret_cast<const half2*>(E + (size_t)m * Nw + n));
        *reinterpret_cast<half2*>(C + (size_t)m * Nw + n) = o;
      }
    }
  }
}

// The split-K partials P[SPLIT][M][N] summed into C[M, N] with the epilogue (0, 1 + bias[n], 2 + residual[m, n]),
// rounded as the unsplit kernel rounds; one thread per two outputs.
template <int SPLIT, int EPI>
__device__ __forceinline__ void mlcc_tc_gemm_reduce(const float* __restrict__ P, const half* __restrict__ E,
                                                    half* __restrict__ C, int M, int N) {
  const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 2, total = (size_t)M * N;
  if (i >= total) return;
  float2 acc = *reinterpret_cast<const float2*>(P + i);
#pragma unroll
  for (int z = 1; z < SPLIT; ++z) {
    const float2 v = *reinterpret_cast<const float2*>(P + z * total + i);
    acc.x += v.x;
    acc.y += v.y;
  }
  half2 o = __floats2half2_rn(acc.x, acc.y);
  if constexpr (EPI == 1) o = __hadd2(o, *reinterpret_cast<const half2*>(E + i % N));
  if constexpr (EPI == 2) o = __hadd2(o, *reinterpret_cast<const half2*>(E + i));
  *reinterpret_cast<half2*>(C + i) = o;
}

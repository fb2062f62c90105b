// Causal prefill attention on tensor cores (schedules/cuda_flash_prefill.py), FlashAttention-2's loop: a block
// takes 64 query rows of one query head and walks its sequence's keys in tiles of 64, S = Q K^T and O += P V on
// mma.sync.m16n8k16 (fp16 in, fp32 accumulate), the softmax online in registers, K and V tiles double-buffered in
// shared memory through cp.async. Same contract as TVM's batch_prefill_ragged_kv: q [tokens, h_q, D], k / v
// [kv tokens, h_kv, D] with per-sequence offsets q_indptr / kv_indptr, a query row r of a sequence sees keys
// c < kv_len - qo_len + r + 1 (causal) or c < kv_len; out [tokens, h_q, D] fp16 and lse [tokens, h_q] =
// m + log2(sum) over scores scaled by sm_scale * log2(e) (TVM merges partial attention states in that base).
// Each of the block's 4 warps owns 16 rows: S is 16 x 64 in 32 fp32 registers, O 16 x D in D / 2.
// Uses mlcc_cp_async16 / mlcc_ldmatrix_x4 / mlcc_mma_16816 from tc_gemm.cuh.
#include <cuda_fp16.h>

__device__ __forceinline__ void mlcc_ldmatrix_x4_trans(unsigned* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(mlcc_smem_u32(p)));
}
// Element offset of 16-byte chunk c of row r in a [rows][D] fp16 tile: the low three bits of the chunk index are
// XOR-ed with the row, so ldmatrix's eight rows of one chunk fall in distinct banks.
template <int D>
__device__ __forceinline__ int mlcc_fa_swz(int r, int c) { return r * D + ((c ^ (r & 7)) << 3); }

__device__ __forceinline__ unsigned mlcc_pack_half2(float a, float b) {
  union { half2 h; unsigned u; } v;
  v.h = __floats2half2_rn(a, b);
  return v.u;
}

template <int D>
__device__ __forceinline__ void mlcc_flash_prefill(const half* __restrict__ Q, const int* __restrict__ q_indptr,
                                                   const half* __restrict__ K, const half* __restrict__ V,
                                                   const int* __restrict__ kv_indptr, half* __restrict__ O,
                                                   float* __restrict__ LSE, int batch, int h_q, int h_kv,
                                                   int causal, float sm_scale, unsigned char* __restrict__ smem) {
  constexpr int BM = 64, BN = 64, THREADS = 128, CH = D / 8, NS = BN / 8, NO = D / 8;
  static_assert(D % 16 == 0 && D <= 256, "head dim");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int head = blockIdx.y, kvh = head / (h_q / h_kv);
  // this block's sequence and query tile; a sequence's last (causally longest) tiles get the lowest block ids
  int tile = blockIdx.x, b = 0, n_q_tiles = 0;
  for (; b < batch; ++b) {
    n_q_tiles = (q_indptr[b + 1] - q_indptr[b] + BM - 1) / BM;
    if (tile < n_q_tiles) break;
    tile -= n_q_tiles;
  }
  if (b == batch) return;
  tile = n_q_tiles - 1 - tile;
  const int q0 = q_indptr[b], qo_len = q_indptr[b + 1] - q0;
  const int kv0 = kv_indptr[b], kv_len = kv_indptr[b + 1] - kv0;
  const int m0 = tile * BM;
  const int kv_end = causal ? min(kv_len, kv_len - qo_len + m0 + BM) : kv_len;  // keys any row here sees
  const int n_tiles = kv_end > 0 ? (kv_end + BN - 1) / BN : 0;

  half* Qs = reinterpret_cast<half*>(smem);
  half* Ks = Qs + BM * D;      // two buffers of BN x D
  half* Vs = Ks + 2 * BN * D;  // two buffers of BN x D
  const size_t q_stride = (size_t)h_q * D, kv_stride = (size_t)h_kv * D;

  for (int i = tid; i < BM * CH; i += THREADS) {
    const int r = i / CH, c = i % CH, m = m0 + r;
    const half* src = Q + (size_t)(q0 + (m < qo_len ? m : qo_len - 1)) * q_stride + (size_t)head * D + c * 8;
    mlcc_cp_async16(&Qs[mlcc_fa_swz<D>(r, c)], src, m < qo_len);
  }
  auto load_kv = [&](int buf, int t) {
    for (int i = tid; i < BN * CH; i += THREADS) {
      const int r = i / CH, c = i % CH, n = t * BN + r;
      const bool ok = n < kv_len;
      const size_t off = (size_t)(kv0 + (ok ? n : 0)) * kv_stride + (size_t)kvh * D + c * 8;
      mlcc_cp_async16(&Ks[buf * BN * D + mlcc_fa_swz<D>(r, c)], K + off, ok);
      mlcc_cp_async16(&Vs[buf * BN * D + mlcc_fa_swz<D>(r, c)], V + off, ok);
    }
  };
  if (n_tiles > 0) load_kv(0, 0);
  mlcc_cp_async_commit();

  float o[NO][4];
#pragma unroll
  for (int j = 0; j < NO; ++j)
#pragma unroll
    for (int v = 0; v < 4; ++v) o[j][v] = 0.f;
  float m_i[2] = {-1e30f, -1e30f}, l_i[2] = {0.f, 0.f};
  unsigned qf[D / 16][4];
  const float scale = sm_scale * 1.4426950408889634f;
  const int row0 = m0 + warp * 16 + (lane >> 2);  // this thread's rows: row0 and row0 + 8
  const float neg_inf = -__int_as_float(0x7f800000);

  for (int t = 0; t < n_tiles; ++t) {
    if (t + 1 < n_tiles) load_kv((t + 1) & 1, t + 1);
    mlcc_cp_async_commit();
    mlcc_cp_async_wait<1>();
    __syncthreads();
    if (t == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        mlcc_ldmatrix_x4(qf[kk], &Qs[mlcc_fa_swz<D>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4))]);
    }
    const half* Kt = Ks + (t & 1) * BN * D;
    const half* Vt = Vs + (t & 1) * BN * D;
    float s[NS][4];
#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
      for (int v = 0; v < 4; ++v) s[j][v] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int j = 0; j < NS; j += 2) {
        unsigned f[4];
        mlcc_ldmatrix_x4(f, &Kt[mlcc_fa_swz<D>(j * 8 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1))]);
        mlcc_mma_16816(s[j], qf[kk], f[0], f[1]);
        mlcc_mma_16816(s[j + 1], qf[kk], f[2], f[3]);
      }
    }
    // scale and mask; the accumulator's v-th value is row row0 + 8 (v / 2), column 2 (lane % 4) + v % 2
    float mx[2] = {m_i[0], m_i[1]};
    const bool edge = (t + 1) * BN > kv_len || (causal && (t + 1) * BN > kv_len - qo_len + m0 + 1);
#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        float x = s[j][v] * scale;
        if (edge) {
          const int col = t * BN + j * 8 + (lane & 3) * 2 + (v & 1), row = row0 + (v >> 1) * 8;
          if (col >= kv_len || (causal && col >= kv_len - qo_len + row + 1)) x = neg_inf;
        }
        s[j][v] = x;
        mx[v >> 1] = fmaxf(mx[v >> 1], x);
      }
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the four threads of a quad hold one row
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      alpha[h] = exp2f(m_i[h] - mx[h]);
      m_i[h] = mx[h];
      l_i[h] *= alpha[h];
    }
#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const float p = exp2f(s[j][v] - m_i[v >> 1]);
        s[j][v] = p;
        l_i[v >> 1] += p;  // this thread's columns; the quad's partial sums are added at the end
      }
#pragma unroll
    for (int j = 0; j < NO; ++j) {
      o[j][0] *= alpha[0]; o[j][1] *= alpha[0]; o[j][2] *= alpha[1]; o[j][3] *= alpha[1];
    }
    // O += P V: two 16 x 8 accumulators of P are the A fragment of one 16-key step
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const unsigned pa[4] = {mlcc_pack_half2(s[2 * kk][0], s[2 * kk][1]), mlcc_pack_half2(s[2 * kk][2], s[2 * kk][3]),
                              mlcc_pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              mlcc_pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int j = 0; j < NO; j += 2) {
        unsigned f[4];
        mlcc_ldmatrix_x4_trans(f, &Vt[mlcc_fa_swz<D>(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), j + (lane >> 4))]);
        mlcc_mma_16816(o[j], pa, f[0], f[1]);
        mlcc_mma_16816(o[j + 1], pa, f[2], f[3]);
      }
    }
    __syncthreads();  // every warp is done with buffer t & 1 before the next iteration refills it
  }
  mlcc_cp_async_wait<0>();

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_i[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row = row0 + h * 8;
    if (row >= qo_len) continue;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    half* out = O + (size_t)(q0 + row) * q_stride + (size_t)head * D + (lane & 3) * 2;
#pragma unroll
    for (int j = 0; j < NO; ++j)
      *reinterpret_cast<half2*>(out + j * 8) = __floats2half2_rn(o[j][2 * h] * inv, o[j][2 * h + 1] * inv);
    if ((lane & 3) == 0) LSE[(size_t)(q0 + row) * h_q + head] = m_i[h] + log2f(l);
  }
}

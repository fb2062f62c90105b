"""Can a persistent decode kernel stream a layer's q4 weights near the copy bandwidth? (issue 4, session 12)

Session 11's persistent layers (`layer_probe.py`) lost 31% to the model's four kernels. This probe runs the same
chain (o -> gate_up -> down on the first 14336 outputs -> qkv; the next layer's o reads the first 4096 of qkv)
over LAYERS layers of identical weights in separate buffers (from DRAM) in one launch of one block per SM, against
the model's four kernels per layer (`make_gemv`, default rule, PDL) on the same weights in MLC's layout, both
from one CUDA graph. Weights are pre-tiled (a converter could write them so). Variants:

  stream_<feed>[_mode]  the published megakernel design: one producer warp per SM streams 9216-byte tiles (8 rows
                        x 2048 inputs, codes then scales) into a 20-stage shared-memory ring (mbarriers), never
                        waiting on a grid barrier; 16 consumer warps wait for the previous projection (grid-wide
                        barrier), stage its output in shared memory and multiply. Feeds: `cp.async.bulk` (1 or 4
                        copies a tile, or with an L2 evict-first policy) or cp.async from the producer's 32 lanes.
                        Diagnostic modes: the ring alone, no barrier, polling waits, plain loads without a ring.
  chain_direct_u*       no ring: the block's warps load its contiguous run of tiles into registers (two chunks
                        of U tiles), a block-wide reduction per group
  chain_units[_w32]     units of 8 rows x 1024 inputs laid out for one warp, a block's contiguous run of units
                        dealt to its warps, two units in flight per warp (or one, with 32 warps), shuffles and
                        shared-memory atomics per group: no block-wide barrier but the grid's
  chain_units_tc        as chain_units with units of 16 rows x 512 inputs multiplied on the tensor cores
                        (cuda_gemv_tc's mma step, ~1/3 of the CUDA-core instructions per byte); prepared in
                        session 12 after the last device call: compiled (128 registers, no spills), its layout
                        and lane arithmetic checked by a numpy emulation; run in session 13 (59.5 us a
                        layer, chain_units 59.0 in the same call)
  chain_units_no_*      diagnostics of chain_units (session 13): no grid barrier, no math (the unit's words
                        folded by XOR), neither; chain_units_tc_no_barrier likewise
  chain_units_block_fence, chain_units_tc_block_fence, chain_units_two_ahead (session 13, correct): no fence by
                        every warp before the grid barrier (only the barrier's own), and also two units a warp
                        requested across it

Every chain's projections are checked against numpy on their actual inputs before and after timing; diagnostic
modes are timed only. Results: bench/results/README.md, "Issue 4, session 12" and "session 13".

    python bench/stream_probe.py build --out .dev/stream      # here
    python3 bench/stream_probe.py run --libs .dev/stream --out $OUT   # MLCC_PROBE_ONLY=a,b: those variants only
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from cli import build_and_run
from layer_probe import CHAIN, GRID_ARRIVE_SOURCE, PROJ, compile_probe, quantized

LAYERS = 4
SMS = 132
CONSUMERS = 16
ROWS, TILE_K = 8, 2048
TILE_BYTES = ROWS * TILE_K // 2 + ROWS * TILE_K // 32 * 2
STAGES = 20
SMEM_BYTES = STAGES * TILE_BYTES + 14336 * 2 + 2 * CONSUMERS * ROWS * 4 + 2 * STAGES * 8
Y_OFF = {"o": 0, "gate_up": 4096, "down": 4096 + 28672, "qkv": 4096 + 28672 + 4096}
Y_LAYER = 4096 + 28672 + 4096 + 6144
MODES = ("", "_ring_only", "_no_barrier", "_ring_only_poll", "_direct_ldg", "_direct_ldg16",
         "_direct_ldg16_contiguous")  # the consumers' MODE 0-6
# the producer: 1 or 4 bulk copies a tile, cp.async by its warp, 1 bulk copy with an L2 evict-first policy
FEEDS = ("bulk", "bulk4", "cpasync", "bulk_evict_first")


def stream_variants() -> dict[str, tuple[int, int]]:
    """Kernel name -> (mode, feed): every feed with mode 0 and 1, the first with mode 2."""
    out = {f"stream_{f}{MODES[m]}": (m, i) for i, f in enumerate(FEEDS) for m in (0, 1)}
    out[f"stream_{FEEDS[0]}{MODES[2]}"] = (2, 0)
    out[f"stream_{FEEDS[0]}{MODES[3]}"] = (3, 0)
    out[f"stream_{FEEDS[2]}{MODES[3]}"] = (3, 2)
    out["stream_direct_ldg"] = (4, 0)
    out["stream_direct_ldg16"] = (5, 0)
    out["stream_direct_ldg16_contiguous"] = (6, 0)
    return out

STREAM_SOURCE = GRID_ARRIVE_SOURCE + r"""
namespace mlcc_stream {
constexpr int kBlocks = 132, kConsumers = 16, kThreads = kConsumers * 32;
constexpr int kRows = 8, kTileK = 2048;
constexpr int kCodeBytes = kRows * kTileK / 2, kTileBytes = kCodeBytes + kRows * kTileK / 32 * 2;
constexpr int kStages = 20, kMaxK = 14336;
constexpr int kXOff = kStages * kTileBytes, kRedOff = kXOff + kMaxK * 2;
constexpr int kBarOff = kRedOff + 2 * kConsumers * kRows * 4;
// o, gate_up, down, qkv: outputs, inputs, first tile within a layer, offset of the output within a layer's Y
__device__ constexpr int kN[4] = {4096, 28672, 4096, 6144};
__device__ constexpr int kK[4] = {4096, 4096, 14336, 4096};
__device__ constexpr int kTileBase[4] = {0, 1024, 1024 + 7168, 1024 + 7168 + 3584};
constexpr int kLayerTiles = 1024 + 7168 + 3584 + 1536;
__device__ constexpr int kYOff[4] = {0, 4096, 4096 + 28672, 4096 + 28672 + 4096};
constexpr int kYLayer = 4096 + 28672 + 4096 + 6144;

__device__ __forceinline__ unsigned saddr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(unsigned long long* b, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(saddr(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(saddr(b)) : "memory");
}
__device__ __forceinline__ bool mbar_try(unsigned long long* b, unsigned parity) {
  unsigned ok;
  asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(ok) : "r"(saddr(b)), "r"(parity) : "memory");
  return ok != 0;
}
__device__ __forceinline__ bool mbar_test(unsigned long long* b, unsigned parity) {
  unsigned ok;
  asm volatile("{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(ok) : "r"(saddr(b)), "r"(parity) : "memory");
  return ok != 0;
}
__device__ __forceinline__ void mbar_spin(unsigned long long* b, unsigned parity) {
  long long spins = 0;
  while (!mbar_test(b, parity))
    if (++spins == (1ll << 28)) __trap();
}
__device__ __forceinline__ void mbar_wait(unsigned long long* b, unsigned parity) {
  long long spins = 0;
  while (!mbar_try(b, parity))
    if (++spins == (1ll << 26)) __trap();  // a lost phase: fail instead of hanging the device
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, unsigned long long* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(saddr(dst)), "l"(src), "r"(bytes), "r"(saddr(b)) : "memory");
}
__device__ __forceinline__ void bulk_load_evict_first(void* dst, const void* src, unsigned bytes,
                                                      unsigned long long* b) {
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
               " [%0], [%1], %2, [%3], %4;"
               ::"r"(saddr(dst)), "l"(src), "r"(bytes), "r"(saddr(b)), "l"(policy) : "memory");
}
template <int THREADS = kThreads>
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory"); }

// every block's consumers past this point after every block's consumers reached it (the producer is not part of it)
template <int THREADS = kThreads>
__device__ __forceinline__ void grid_barrier(unsigned* bar) {
  consumers_sync<THREADS>();
  if (threadIdx.y == 0 && threadIdx.x == 0) mlcc_grid_arrive_wait(bar, kBlocks, 1ll << 24);
  consumers_sync<THREADS>();
}

// sum over one 32-code group of (code - 7) * x (x: its 32 staged inputs), fp16 within the group
__device__ __forceinline__ float dot32(const uint4& c, const half* x) {
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  const uint4 xa = xv[0], xb = xv[1], xc = xv[2], xd = xv[3];
  unsigned h = 0;
  h = mlcc_q4x8_hfma2_s1(c.x, xa.x, xa.y, xa.z, xa.w, h);
  h = mlcc_q4x8_hfma2_s1(c.y, xb.x, xb.y, xb.z, xb.w, h);
  h = mlcc_q4x8_hfma2_s1(c.z, xc.x, xc.y, xc.z, xc.w, h);
  h = mlcc_q4x8_hfma2_s1(c.w, xd.x, xd.y, xd.z, xd.w, h);
  return mlcc_h2_sum(h);
}

// a group's end when all 16 consumer warps hold partial sums (lane l: row l % 8): the 8 rows' totals to y_rows
__device__ __forceinline__ void group_end(float acc, half* y_rows, float* red, int& par) {
  const int w = threadIdx.y, lane = threadIdx.x;
  acc += __shfl_xor_sync(0xffffffffu, acc, 8);
  acc += __shfl_xor_sync(0xffffffffu, acc, 16);
  if (lane < kRows) red[(par * kConsumers + w) * kRows + lane] = acc;
  consumers_sync();
  if (w == 0 && lane < kRows) {
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < kConsumers; ++v) sum += red[(par * kConsumers + v) * kRows + lane];
    y_rows[lane] = __float2half(sum);
    __threadfence();
  }
  par ^= 1;
}

// this block's groups of projection p, in order; off is the running offset (carried across projections/layers)
#ifdef MLCC_STREAM_INTERLEAVED
#define MLCC_FOR_GROUPS(p, off, g) \
  for (int g = ((int)blockIdx.x - (off) % kBlocks + kBlocks) % kBlocks; g < kN[p] / kRows; g += kBlocks)
#else
// block b: groups [b G / 132, (b + 1) G / 132) of each projection, one contiguous run of tiles (session 12: a
// block's tiles 132 groups apart stream at ~2.9 TB/s, contiguous runs at ~4.0)
#define MLCC_FOR_GROUPS(p, off, g) \
  for (int g = (int)blockIdx.x * (kN[p] / kRows) / kBlocks; g < ((int)blockIdx.x + 1) * (kN[p] / kRows) / kBlocks; ++g)
#endif

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(saddr(dst)), "l"(src) : "memory");
}
// arrives on b once this thread's earlier cp.async copies have landed (.noinc: counted in b's expected arrivals)
__device__ __forceinline__ void cp_async_arrive(unsigned long long* b) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(saddr(b)) : "memory");
}

// How a tile reaches its stage. BULK: one thread, SPLIT bulk copies of kTileBytes / SPLIT (the TMA's 1-D form);
// otherwise the producer warp's 32 lanes, each kTileBytes / 512 cp.async copies of 16 bytes
template <bool BULK, int SPLIT, bool EVICT_FIRST = false>
__device__ __forceinline__ void producer(const unsigned char* W, int layers, unsigned char* ring,
                                         unsigned long long* full, unsigned long long* empty) {
  const int lane = threadIdx.x;
  unsigned it = 0;
  int off = 0;
  for (int l = 0; l < layers; ++l) {
    for (int p = 0; p < 4; ++p) {
      const int kt_n = kK[p] / kTileK;
      MLCC_FOR_GROUPS(p, off, g) {
        for (int kt = 0; kt < kt_n; ++kt, ++it) {
          const int s = it % kStages;
          mbar_wait(empty + s, ((it / kStages) & 1) ^ 1);
          const size_t tile = (size_t)l * kLayerTiles + kTileBase[p] + (size_t)g * kt_n + kt;
          const unsigned char* src = W + tile * kTileBytes;
          unsigned char* dst = ring + s * kTileBytes;
          if (BULK) {
            mbar_expect_tx(full + s, kTileBytes);
#pragma unroll
            for (int j = 0; j < SPLIT; ++j)
              if (EVICT_FIRST) bulk_load_evict_first(dst, src, kTileBytes, full + s);
              else bulk_load(dst + j * (kTileBytes / SPLIT), src + j * (kTileBytes / SPLIT), kTileBytes / SPLIT,
                             full + s);
          } else {
#pragma unroll
            for (int j = 0; j < kTileBytes / 512; ++j) cp_async16(dst + j * 512 + lane * 16, src + j * 512 + lane * 16);
            cp_async_arrive(full + s);
          }
        }
      }
      off += kN[p] / kRows;
    }
  }
}

// MODE 0: the layer chain. Diagnostics (outputs wrong, timing only): 1 the ring alone (consumers take each tile
// and release it, no barrier, no staging, no math); 2 no grid barrier and no staging (the math on stale inputs);
// 3 as 1, the consumers polling (test_wait) instead of try_wait; 4 no ring: the consumer warps load the tiles
// themselves (LDG, 8 tiles in flight), no math, no barrier; 5 as 4 with 16 tiles in flight
template <int U>
__device__ __forceinline__ void direct(const unsigned char* W, half* Y, int layers) {
  const int tid = threadIdx.y * 32 + threadIdx.x;
  int off = 0;
  unsigned sum = 0;
  for (int l = 0; l < layers; ++l) {
    for (int p = 0; p < 4; ++p) {
      const int kt_n = kK[p] / kTileK, first = ((int)blockIdx.x - off % kBlocks + kBlocks) % kBlocks;
      const int groups = first < kN[p] / kRows ? (kN[p] / kRows - first + kBlocks - 1) / kBlocks : 0;
      const int tiles = groups * kt_n;
      for (int t0 = 0; t0 < tiles; t0 += U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int t = t0 + u < tiles ? t0 + u : tiles - 1;
          const int g = first + (t / kt_n) * kBlocks, kt = t % kt_n;
          const size_t tile = (size_t)l * kLayerTiles + kTileBase[p] + (size_t)g * kt_n + kt;
          const uint4* src = reinterpret_cast<const uint4*>(W + tile * kTileBytes);
          v[u] = __ldg(src + tid);
          if (tid < 64) v[u].x ^= __ldg(src + 512 + tid).y;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) sum += v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
      }
      off += kN[p] / kRows;
    }
  }
  if (sum == 0x12345678u) Y[0] = __float2half(1.f);  // (keeps the loads)
}

// MODE 6: as 5, but block b reads one contiguous run of a layer's tiles (about 1/132 of it) instead of groups
// interleaved across the blocks: is the access pattern what caps the stream?
__device__ __forceinline__ void direct_contiguous(const unsigned char* W, half* Y, int layers) {
  constexpr int U = 16, kPer = (kLayerTiles + kBlocks - 1) / kBlocks;
  const int tid = threadIdx.y * 32 + threadIdx.x;
  const int t_begin = blockIdx.x * kPer, t_end = min(t_begin + kPer, kLayerTiles);
  unsigned sum = 0;
  for (int l = 0; l < layers; ++l) {
    for (int t0 = t_begin; t0 < t_end; t0 += U) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int t = t0 + u < t_end ? t0 + u : t_end - 1;
        const uint4* src = reinterpret_cast<const uint4*>(W + ((size_t)l * kLayerTiles + t) * kTileBytes);
        v[u] = __ldg(src + tid);
        if (tid < 64) v[u].x ^= __ldg(src + 512 + tid).y;
      }
#pragma unroll
      for (int u = 0; u < U; ++u) sum += v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
  }
  if (sum == 0x12345678u) Y[0] = __float2half(1.f);
}

template <int MODE>
__device__ __forceinline__ void consumer(const half* x0, half* Y, unsigned* bar, int layers, unsigned char* smem,
                                         unsigned long long* full, unsigned long long* empty) {
  const int w = threadIdx.y, lane = threadIdx.x, tid = w * 32 + lane;
  const unsigned char* ring = smem;
  half* xs = reinterpret_cast<half*>(smem + kXOff);
  float* red = reinterpret_cast<float*>(smem + kRedOff);
  const int kg = w * 4 + (lane >> 3), r = lane & 7;  // this lane's 32-code group and row within a tile
  unsigned it = 0;
  int off = 0, par = 0;
  mlcc_pdl_wait();
  mlcc_pdl_launch_dependents();
  for (int l = 0; l < layers; ++l) {
    for (int p = 0; p < 4; ++p) {
      const half* x = p == 0 ? (l == 0 ? x0 : Y + (size_t)(l - 1) * kYLayer + kYOff[3])
                             : Y + (size_t)l * kYLayer + kYOff[p - 1];
      if (MODE == 0) {
        if (l != 0 || p != 0) grid_barrier(bar);  // the input was written by every block
        for (int i = tid; i < kK[p] / 8; i += kThreads)
          reinterpret_cast<uint4*>(xs)[i] = __ldcg(reinterpret_cast<const uint4*>(x) + i);
        consumers_sync();
      }
      half* y = Y + (size_t)l * kYLayer + kYOff[p];
      const int kt_n = kK[p] / kTileK;
      MLCC_FOR_GROUPS(p, off, g) {
        float acc = 0.f;
        for (int kt = 0; kt < kt_n; ++kt, ++it) {
          const int s = it % kStages;
          if (MODE == 3) mbar_spin(full + s, (it / kStages) & 1);
          else mbar_wait(full + s, (it / kStages) & 1);
          if (MODE == 1 || MODE == 3) {
            __syncwarp();
            if (lane == 0) mbar_arrive(empty + s);
            continue;
          }
          const unsigned char* tile = ring + s * kTileBytes;
          const uint4 c = *reinterpret_cast<const uint4*>(tile + (kg * 8 + r) * 16);
          const float sc = __half2float(*reinterpret_cast<const half*>(tile + kCodeBytes + (kg * 8 + r) * 2));
          __syncwarp();
          if (lane == 0) mbar_arrive(empty + s);  // the stage's bytes are in registers: the producer may refill it
          acc += dot32(c, xs + kt * kTileK + kg * 32) * sc;
        }
        group_end(acc, y + g * kRows, red, par);
      }
      off += kN[p] / kRows;
    }
  }
}
}  // namespace mlcc_stream

// mode: the consumer's MODE; feed: 0 one bulk copy a tile, 1 four, 2 cp.async by the producer warp
__device__ __forceinline__ void mlcc_stream_layers(const void* x0, const void* W, void* Y, void* bar, int layers,
                                                   int mode, int feed, void* smem_v) {
  using namespace mlcc_stream;
  unsigned char* smem = (unsigned char*)smem_v;
  unsigned long long* full = reinterpret_cast<unsigned long long*>(smem + kBarOff);
  unsigned long long* empty = full + kStages;
  if (threadIdx.y == 0 && threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full + s, feed == 2 ? 32 : 1);
      mbar_init(empty + s, kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.y == kConsumers) {
    if (mode >= 4) return;
    if (feed == 0 && threadIdx.x == 0) producer<true, 1>((const unsigned char*)W, layers, smem, full, empty);
    if (feed == 1 && threadIdx.x == 0) producer<true, 4>((const unsigned char*)W, layers, smem, full, empty);
    if (feed == 3 && threadIdx.x == 0) producer<true, 1, true>((const unsigned char*)W, layers, smem, full, empty);
    if (feed == 2) producer<false, 1>((const unsigned char*)W, layers, smem, full, empty);
  } else {
    if (mode == 0) consumer<0>((const half*)x0, (half*)Y, (unsigned*)bar, layers, smem, full, empty);
    if (mode == 1) consumer<1>((const half*)x0, (half*)Y, (unsigned*)bar, layers, smem, full, empty);
    if (mode == 2) consumer<2>((const half*)x0, (half*)Y, (unsigned*)bar, layers, smem, full, empty);
    if (mode == 3) consumer<3>((const half*)x0, (half*)Y, (unsigned*)bar, layers, smem, full, empty);
    if (mode == 4) direct<8>((const unsigned char*)W, (half*)Y, layers);
    if (mode == 5) direct<16>((const unsigned char*)W, (half*)Y, layers);
    if (mode == 6) direct_contiguous((const unsigned char*)W, (half*)Y, layers);
  }
}
namespace mlcc_stream {
// The chain without a ring (session 12, after the ring variants streamed at ~2.9 TB/s and plain loads of
// contiguous runs at ~4.0): all 16 warps of a block load its contiguous run of tiles themselves, U tiles a chunk
// into registers (thread tid: the tile's 16 bytes of codes at tid * 16, its scale at 8192 + tid * 2 - the same
// lane mapping as the ring's consumers), two chunk buffers so the next chunk is in flight while one is multiplied,
// and the first chunk of the next projection requested before the grid barrier it does not depend on.
struct Cursor { int l, p, t, t_end; };  // layer, projection, this block's next tile and end (tiles of p)

__device__ __forceinline__ void block_tiles(int p, int& t_begin, int& t_end) {
  const int groups = kN[p] / kRows, kt_n = kK[p] / kTileK;
  t_begin = (int)blockIdx.x * groups / kBlocks * kt_n;
  t_end = ((int)blockIdx.x + 1) * groups / kBlocks * kt_n;
}

template <int U>
__device__ __forceinline__ void load_chunk(const unsigned char* W, const Cursor& c, int tid, uint4 (&cw)[U],
                                           unsigned short (&cs)[U]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (c.t + u < c.t_end) {
      const unsigned char* tile = W + ((size_t)c.l * kLayerTiles + kTileBase[c.p] + c.t + u) * kTileBytes;
      cw[u] = __ldg(reinterpret_cast<const uint4*>(tile) + tid);
      cs[u] = __ldg(reinterpret_cast<const unsigned short*>(tile + kCodeBytes) + tid);
    }
  }
}

// the cursor's next chunk: the rest of this projection's run, else the first chunk of the next projection
template <int U>
__device__ __forceinline__ Cursor next_chunk(Cursor c, int layers) {
  c.t += U;
  if (c.t < c.t_end) return c;
  if (++c.p == 4) { c.p = 0; ++c.l; }
  int t_begin;
  block_tiles(c.p, t_begin, c.t_end);
  c.t = c.l < layers ? t_begin : c.t_end;  // (past the last layer: an empty chunk)
  return c;
}

template <int U>
__device__ __forceinline__ void compute_chunk(const Cursor& c, const half* xs, half* y, float* red, int& par,
                                              float& acc, const uint4 (&cw)[U], const unsigned short (&cs)[U]) {
  const int w = threadIdx.y, lane = threadIdx.x, kg = w * 4 + (lane >> 3);
  const int kt_n = kK[c.p] / kTileK;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (c.t + u < c.t_end) {
      const int tile = c.t + u, kt = tile % kt_n;
      acc += dot32(cw[u], xs + kt * kTileK + kg * 32) * __half2float(__ushort_as_half(cs[u]));
      if (kt == kt_n - 1) {  // the group's last tile: its 8 rows' sums over the 16 warps
        group_end(acc, y + (tile / kt_n) * kRows, red, par);
        acc = 0.f;
      }
    }
  }
}

template <int U>
__device__ __forceinline__ void direct_chain(const unsigned char* W, const half* x0, half* Y, unsigned* bar,
                                             int layers, unsigned char* smem) {
  const int tid = threadIdx.y * 32 + threadIdx.x;
  half* xs = reinterpret_cast<half*>(smem);
  float* red = reinterpret_cast<float*>(smem + kMaxK * 2);
  uint4 aw[U], bw[U];
  unsigned short as[U], bs[U];
  Cursor c{0, 0, 0, 0};
  block_tiles(0, c.t, c.t_end);
  load_chunk<U>(W, c, tid, aw, as);  // (before the PDL wait: weights do not depend on the previous kernel)
  mlcc_pdl_wait();
  mlcc_pdl_launch_dependents();
  int par = 0;
  float acc = 0.f;
  bool a_current = true;
  while (c.l < layers) {
    int t_begin, t_end_unused;
    block_tiles(c.p, t_begin, t_end_unused);
    if (c.t == t_begin) {  // a projection's first chunk: wait for its input, stage it
      const half* x = c.p == 0 ? (c.l == 0 ? x0 : Y + (size_t)(c.l - 1) * kYLayer + kYOff[3])
                               : Y + (size_t)c.l * kYLayer + kYOff[c.p - 1];
      if (c.l != 0 || c.p != 0) grid_barrier(bar);
      for (int i = tid; i < kK[c.p] / 8; i += kThreads)
        reinterpret_cast<uint4*>(xs)[i] = __ldcg(reinterpret_cast<const uint4*>(x) + i);
      consumers_sync();
    }
    const Cursor n = next_chunk<U>(c, layers);
    half* y = Y + (size_t)c.l * kYLayer + kYOff[c.p];
    if (a_current) {
      load_chunk<U>(W, n, tid, bw, bs);
      compute_chunk<U>(c, xs, y, red, par, acc, aw, as);
    } else {
      load_chunk<U>(W, n, tid, aw, as);
      compute_chunk<U>(c, xs, y, red, par, acc, bw, bs);
    }
    a_current = !a_current;
    const bool last_of_projection = n.p != c.p || n.l != c.l;
    c = n;
    if (last_of_projection) consumers_sync();  // xs is staged again for the next projection
  }
}
}  // namespace mlcc_stream

__device__ __forceinline__ void mlcc_stream_direct_chain(const void* x0, const void* W, void* Y, void* bar,
                                                         int layers, int unroll, int, void* smem) {
  if (unroll == 4)
    mlcc_stream::direct_chain<4>((const unsigned char*)W, (const half*)x0, (half*)Y, (unsigned*)bar, layers,
                                 (unsigned char*)smem);
  if (unroll == 8)
    mlcc_stream::direct_chain<8>((const unsigned char*)W, (const half*)x0, (half*)Y, (unsigned*)bar, layers,
                                 (unsigned char*)smem);
}
namespace mlcc_stream {
// Units instead of tiles (session 12, after chain_direct lost to per-group block barriers): a unit is 8 rows x 1024
// inputs, laid out for one warp (per row, lane l's 16 bytes of codes for 32-code group l, then per row the lanes'
// scales: 4608 bytes); a block's units (its contiguous run of groups, 1024 inputs at a time) go to its warps in turn,
// each warp with two units in flight in registers. A lane multiplies 8 rows by one staged x slice (4 shared loads
// for 8 rows), the warp reduces the 8 sums by shuffles and adds them to its group's slot in shared memory; the
// last of the group's K/1024 units to arrive writes the 8 outputs. No block-wide barrier but the grid-wide one.
constexpr int kUnitK = 1024, kUnitBytes = kRows * kUnitK / 2 + kRows * kUnitK / 32 * 2;  // 4608
constexpr int kSlots = 32;  // groups of one projection a block holds at most (gate_up: 28)
__device__ constexpr int kUnitBase[4] = {0, 2048, 2048 + 14336, 2048 + 14336 + 7168};  // units before p in a layer
constexpr int kLayerUnits = 2048 + 14336 + 7168 + 3072;

struct Unit {
  static constexpr int kGroupRows = 8;  // rows that share a unit's 1024 inputs
  uint4 w[kRows];
  unsigned short s[kRows];
};
// the tensor-core unit (session 12, prepared): 16 rows x 512 inputs, four mma steps of 4 groups of 32 codes; lane
// (r, c) = (lane / 4, lane % 4) holds, per step s, group 4 s + c of rows r and r + 8 (w[2 s], w[2 s + 1]) and the
// scale pair of groups 4 s + 2 (c % 2), + 1 of those rows (s[2 s], s[2 s + 1]): cuda_gemv_tc's fragments
struct UnitTC {
  static constexpr int kGroupRows = 16;
  uint4 w[8];
  unsigned s[8];
};
struct UCursor { int l, p, u, u_end, u_begin; };  // this warp's unit u of the block's run [u_begin, u_end) of p

template <int GROUP_ROWS>
__device__ __forceinline__ void block_units(int p, int& u_begin, int& u_end) {
  // (both unit kinds hold 4608 bytes: 8 rows x 1024 inputs or 16 x 512, so a layer has the same units)
  const int groups = kN[p] / GROUP_ROWS, per_group = GROUP_ROWS == 8 ? kK[p] / kUnitK : kK[p] / 512;
  u_begin = (int)blockIdx.x * groups / kBlocks * per_group;
  u_end = ((int)blockIdx.x + 1) * groups / kBlocks * per_group;
}

__device__ __forceinline__ void load_unit(const unsigned char* W, const UCursor& c, int lane, Unit& b) {
  if (c.u >= c.u_end) return;
  const unsigned char* unit = W + ((size_t)c.l * kLayerUnits + kUnitBase[c.p] + c.u) * kUnitBytes;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    b.w[r] = __ldg(reinterpret_cast<const uint4*>(unit) + r * 32 + lane);
    b.s[r] = __ldg(reinterpret_cast<const unsigned short*>(unit + kRows * 512) + r * 32 + lane);
  }
}

// the warp's next unit: WARPS further in this projection's run, else its first in the next projection
template <int WARPS, int GROUP_ROWS>
__device__ __forceinline__ UCursor next_unit(UCursor c, int layers) {
  c.u += WARPS;
  if (c.u < c.u_end) return c;
  if (++c.p == 4) { c.p = 0; ++c.l; }
  block_units<GROUP_ROWS>(c.p, c.u_begin, c.u_end);
  c.u = c.l < layers ? c.u_begin + (int)threadIdx.y : c.u_end;
  return c;
}

// after a warp added its unit's sums to its group's slot (sums, count): the last of the group's units to arrive
// writes the ROWS outputs and clears the slot for the next projection
template <int ROWS>
__device__ __forceinline__ void unit_done(float* sums, int* count, int per_group, half* y_rows) {
  const int lane = threadIdx.x;
  __threadfence_block();
  __syncwarp();
  int last = 0;
  if (lane == 0) last = atomicAdd(count, 1) == per_group - 1;
  last = __shfl_sync(0xffffffffu, last, 0);
  if (last) {
    __threadfence_block();
    if (lane < ROWS) y_rows[lane] = __float2half(atomicExch(sums + lane, 0.f));
    if (lane == 0) *count = 0;
  }
}

__device__ __forceinline__ void compute_unit(const UCursor& c, const half* xs, half* y, float* red, int* count,
                                             const Unit& b) {
  const int lane = threadIdx.x, per_group = kK[c.p] / kUnitK;
  const int j = c.u % per_group, slot = c.u / per_group - c.u_begin / per_group;
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
    acc[r] = dot32(b.w[r], xs + j * kUnitK + lane * 32) * __half2float(__ushort_as_half(b.s[r]));
  // lane r ends with row r's sum over the unit: halve the rows held at each step (8 -> 4 -> 2 -> 1)
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const float mine = (lane & 4) ? acc[r + 4] : acc[r], theirs = (lane & 4) ? acc[r] : acc[r + 4];
    acc[r] = mine + __shfl_xor_sync(0xffffffffu, theirs, 4);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float mine = (lane & 2) ? acc[r + 2] : acc[r], theirs = (lane & 2) ? acc[r] : acc[r + 2];
    acc[r] = mine + __shfl_xor_sync(0xffffffffu, theirs, 2);
  }
  {
    const float mine = (lane & 1) ? acc[1] : acc[0], theirs = (lane & 1) ? acc[0] : acc[1];
    acc[0] = mine + __shfl_xor_sync(0xffffffffu, theirs, 1);
  }
  // lane l now holds row l & 7's sum over lanes l ^ {1, 2, 4}; the other 24 lanes of the row follow
  float v = acc[0];
  v += __shfl_xor_sync(0xffffffffu, v, 8);
  v += __shfl_xor_sync(0xffffffffu, v, 16);
  if (lane < kRows) atomicAdd(red + slot * kRows + lane, v);
  unit_done<kRows>(red + slot * kRows, count + slot, per_group, y + (c.u / per_group) * kRows);
}

// a projection's input into shared memory: as it is (Unit), or as the mma's B words (UnitTC: per 8 inputs the
// pairs (x0, x4), (x1, x5) / 16, (x2, x6), (x3, x7) / 16, then 16 zero words for the lanes off the diagonal)
template <int THREADS, class U>
__device__ __forceinline__ void stage_input(const half* x, int k, half* xs, int tid) {
  if constexpr (U::kGroupRows == 8) {
#pragma unroll 1
    for (int i = tid; i < k / 8; i += THREADS)
      reinterpret_cast<uint4*>(xs)[i] = __ldcg(reinterpret_cast<const uint4*>(x) + i);
  } else {
    unsigned* xw = reinterpret_cast<unsigned*>(xs);
#pragma unroll 1
    for (int i = tid; i < k / 8; i += THREADS) {
      const uint4 v = __ldcg(reinterpret_cast<const uint4*>(x) + i);
      xw[i * 4 + 0] = mlcc_tc_pair(v.x, v.z, 0);
      xw[i * 4 + 1] = mlcc_tc_pair(v.x, v.z, 1);
      xw[i * 4 + 2] = mlcc_tc_pair(v.y, v.w, 2);
      xw[i * 4 + 3] = mlcc_tc_pair(v.y, v.w, 3);
    }
    if (tid < 16) xw[k / 2 + tid] = 0u;
  }
}

__device__ __forceinline__ void load_unit(const unsigned char* W, const UCursor& c, int lane, UnitTC& b) {
  if (c.u >= c.u_end) return;
  const unsigned char* unit = W + ((size_t)c.l * kLayerUnits + kUnitBase[c.p] + c.u) * kUnitBytes;
  // codes [step][row r / r + 8][lane][16 B], then scale pairs [step][row r / r + 8][r][c % 2]
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    b.w[i] = __ldg(reinterpret_cast<const uint4*>(unit) + i * 32 + lane);
    b.s[i] = __ldg(reinterpret_cast<const unsigned*>(unit + 4096) + i * 16 + (lane >> 2) * 2 + (lane & 1));
  }
}

__device__ __forceinline__ void compute_unit(const UCursor& c, const half* xs, half* y, float* red, int* count,
                                             const UnitTC& b) {
  constexpr int kG = UnitTC::kGroupRows;
  const int lane = threadIdx.x, r = lane >> 2, cc = lane & 3, per_group = kK[c.p] / 512;
  const int j = c.u % per_group, slot = c.u / per_group - c.u_begin / per_group;
  const unsigned* xw = reinterpret_cast<const unsigned*>(xs);
  float a0 = 0.f, a1 = 0.f;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    // the lane on the diagonal (r == c) supplies B column c: x of group 4 s + c; the others 16 zero words
    const uint4* xv = reinterpret_cast<const uint4*>(r == cc ? xw + (j * 16 + s * 4 + cc) * 16 : xw + kK[c.p] / 2);
    const uint4 q0 = xv[0], q1 = xv[1], q2 = xv[2], q3 = xv[3];
    const unsigned xb[16] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w,
                             q2.x, q2.y, q2.z, q2.w, q3.x, q3.y, q3.z, q3.w};
    float d[4];
    mlcc_q4tc_step_sub(d, reinterpret_cast<const unsigned*>(&b.w[2 * s]),
                       reinterpret_cast<const unsigned*>(&b.w[2 * s + 1]), xb);
    a0 = mlcc_tc_scale2(b.s[2 * s], d[0], d[1], a0);
    a1 = mlcc_tc_scale2(b.s[2 * s + 1], d[2], d[3], a1);
  }
  // the subnormal codes are q * 2^-24; a row's sum is over its 4 lane columns
  a0 *= 16777216.f;
  a1 *= 16777216.f;
  a0 += __shfl_xor_sync(0xffffffffu, a0, 1);
  a0 += __shfl_xor_sync(0xffffffffu, a0, 2);
  a1 += __shfl_xor_sync(0xffffffffu, a1, 1);
  a1 += __shfl_xor_sync(0xffffffffu, a1, 2);
  if (cc == 0) {
    atomicAdd(red + slot * kG + r, a0);
    atomicAdd(red + slot * kG + r + 8, a1);
  }
  unit_done<kG>(red + slot * kG, count + slot, per_group, y + (c.u / per_group) * kG);
}

// diagnostic (session 13, after chain_units_tc ran no faster than chain_units): the unit's words folded into one
// bit-test instead of its dot products, so the loads stay live and the group bookkeeping is the same
__device__ __forceinline__ void fold_unit(const UCursor& c, half* y, float* red, int* count, const Unit& b) {
  const int lane = threadIdx.x, per_group = kK[c.p] / kUnitK;
  const int slot = c.u / per_group - c.u_begin / per_group;
  unsigned h = 0;
#pragma unroll
  for (int r = 0; r < kRows; ++r) h ^= b.w[r].x ^ b.w[r].y ^ b.w[r].z ^ b.w[r].w ^ b.s[r];
  if (lane < kRows) atomicAdd(red + slot * kRows + lane, h == 0x9E3779B9u ? 1.f : 0.f);
  unit_done<kRows>(red + slot * kRows, count + slot, per_group, y + (c.u / per_group) * kRows);
}

// WARPS warps a block; DOUBLE: two units in flight a warp (80 registers of buffers), else one (load, then multiply);
// U: Unit (CUDA-core dot products) or UnitTC (tensor cores); DIAG (diagnostics, wrong results): 1 no grid barrier
// (each projection reads whatever its input holds), 2 no math (fold_unit), 3 both; DIAG 4 (correct): no fence by every
// warp at a projection's end, only grid_barrier's by thread 0 after the block barrier (cooperative groups' grid sync
// does the same), so the next projection's weights already requested stay in flight across the barrier; DIAG 8
// (correct, with DOUBLE): at a projection's end the warp also requests its second unit of the next one into the
// buffer it just freed, so two units a warp (147 KB an SM) stream during the barrier instead of one
template <int WARPS, bool DOUBLE, class U = Unit, int DIAG = 0>
__device__ __forceinline__ void unit_chain(const unsigned char* W, const half* x0, half* Y, unsigned* bar, int layers,
                                           unsigned char* smem) {
  constexpr int kT = WARPS * 32, kG = U::kGroupRows;
  constexpr int kXBytes = kMaxK * 2 + (kG == 16 ? 64 : 0);  // (the B words' 16 zero words)
  const int tid = threadIdx.y * 32 + threadIdx.x, lane = threadIdx.x;
  half* xs = reinterpret_cast<half*>(smem);
  float* red = reinterpret_cast<float*>(smem + kXBytes);
  int* count = reinterpret_cast<int*>(smem + kXBytes + kSlots * kG * 4);
  for (int i = tid; i < kSlots * kG; i += kT) red[i] = 0.f;
  for (int i = tid; i < kSlots; i += kT) count[i] = 0;
  U a;
  U b;  // (unused unless DOUBLE)
  UCursor c{0, 0, 0, 0, 0};
  block_units<kG>(0, c.u_begin, c.u_end);
  c.u = c.u_begin + (int)threadIdx.y;
  load_unit(W, c, lane, a);  // (before the PDL wait)
  mlcc_pdl_wait();
  mlcc_pdl_launch_dependents();
  bool a_current = true, loaded_ahead = false;
  int staged_l = -1, staged_p = -1;
  while (c.l < layers) {
    if (c.l != staged_l || c.p != staged_p) {  // a projection's first unit: wait for its input, stage it
      const half* x = c.p == 0 ? (c.l == 0 ? x0 : Y + (size_t)(c.l - 1) * kYLayer + kYOff[3])
                               : Y + (size_t)c.l * kYLayer + kYOff[c.p - 1];
      if ((c.l != 0 || c.p != 0) && !(DIAG & 1)) grid_barrier<kT>(bar);  // (starts with a block barrier: xs free)
      else consumers_sync<kT>();                         // (red and count zeroed)
      stage_input<kT, U>(x, kK[c.p], xs, tid);
      consumers_sync<kT>();
      staged_l = c.l;
      staged_p = c.p;
    }
    const UCursor n = next_unit<WARPS, kG>(c, layers);
    half* y = Y + (size_t)c.l * kYLayer + kYOff[c.p];
    if (!DOUBLE) {
      if (c.u < c.u_end) compute_unit(c, xs, y, red, count, a);
      load_unit(W, n, lane, a);
    } else if (a_current) {
      if (!loaded_ahead) load_unit(W, n, lane, b);
      if constexpr (DIAG & 2) { if (c.u < c.u_end) fold_unit(c, y, red, count, a); }
      else if (c.u < c.u_end) compute_unit(c, xs, y, red, count, a);
    } else {
      if (!loaded_ahead) load_unit(W, n, lane, a);
      if constexpr (DIAG & 2) { if (c.u < c.u_end) fold_unit(c, y, red, count, b); }
      else if (c.u < c.u_end) compute_unit(c, xs, y, red, count, b);
    }
    loaded_ahead = false;
    if constexpr (DOUBLE && (DIAG & 8)) {
      if (n.p != c.p || n.l != c.l) {  // the unit after n into the buffer just computed
        if (a_current) load_unit(W, next_unit<WARPS, kG>(n, layers), lane, a);
        else load_unit(W, next_unit<WARPS, kG>(n, layers), lane, b);
        loaded_ahead = true;
      }
    }
    a_current = !a_current;
    if (!(DIAG & 4) && (n.p != c.p || n.l != c.l)) __threadfence();  // this warp's outputs of p, before the barrier
    c = n;
  }
}
}  // namespace mlcc_stream

namespace mlcc_stream {
template <int WARPS, bool DOUBLE, class U, int DIAG>
__device__ __forceinline__ void units(const void* x0, const void* W, void* Y, void* bar, int layers, void* smem) {
  unit_chain<WARPS, DOUBLE, U, DIAG>((const unsigned char*)W, (const half*)x0, (half*)Y, (unsigned*)bar, layers,
                                     (unsigned char*)smem);
}
}  // namespace mlcc_stream

__device__ __forceinline__ void mlcc_stream_unit_chain(const void* x0, const void* W, void* Y, void* bar, int layers,
                                                       int warps, int diag, void* smem) {
  using mlcc_stream::units;
  using mlcc_stream::Unit;
  if (warps == 32) return units<32, false, Unit, 0>(x0, W, Y, bar, layers, smem);
  switch (diag) {
    case 0: return units<16, true, Unit, 0>(x0, W, Y, bar, layers, smem);
    case 1: return units<16, true, Unit, 1>(x0, W, Y, bar, layers, smem);
    case 2: return units<16, true, Unit, 2>(x0, W, Y, bar, layers, smem);
    case 3: return units<16, true, Unit, 3>(x0, W, Y, bar, layers, smem);
    case 4: return units<16, true, Unit, 4>(x0, W, Y, bar, layers, smem);
    case 12: return units<16, true, Unit, 12>(x0, W, Y, bar, layers, smem);
  }
}

__device__ __forceinline__ void mlcc_stream_unit_chain_tc(const void* x0, const void* W, void* Y, void* bar,
                                                          int layers, int diag, int, void* smem) {
  using mlcc_stream::units;
  using mlcc_stream::UnitTC;
  switch (diag) {
    case 0: return units<16, true, UnitTC, 0>(x0, W, Y, bar, layers, smem);
    case 1: return units<16, true, UnitTC, 1>(x0, W, Y, bar, layers, smem);
    case 4: return units<16, true, UnitTC, 4>(x0, W, Y, bar, layers, smem);
  }
}
"""


def _chain_kernel(helper: str, warps: int, smem_bytes: int, p0: int, p1: int):
    """The TIR kernel around one of the source's chains: helper(x0, W, Y, bar, LAYERS, p0, p1, shared memory)."""
    from tvm.script import tirx as T

    from mlcc.schedules import cuda_pdl

    layer_bytes = sum(n * k // 2 + n * k // 32 * 2 for n, k in PROJ.values())

    @T.prim_func(s_tir=True)
    def chain(x0: T.Buffer((4096,), "float16"), W: T.Buffer((LAYERS * layer_bytes,), "uint8"),
              Y: T.Buffer((LAYERS * Y_LAYER,), "float16"), bar: T.Buffer((2,), "uint32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for bx in T.thread_binding(SMS, thread="blockIdx.x"):
            for ty in T.thread_binding(warps, thread="threadIdx.y"):
                for tx in T.thread_binding(32, thread="threadIdx.x"):
                    with T.sblock("chain"):
                        T.reads()
                        T.writes()
                        if bar[1] == T.uint32(0xFFFFFFFF):  # (never true: names the PDL wait, see layer_probe)
                            T.evaluate(T.call_extern("void", cuda_pdl.WAIT))
                        smem = T.sblock_alloc_buffer((smem_bytes,), "uint8", scope="shared.dyn")
                        T.evaluate(T.call_extern("void", helper, x0.data, W.data, Y.data, bar.data, LAYERS, p0, p1,
                                                 smem.data))

    return chain


DIRECT = {"chain_direct_u4": 4, "chain_direct_u8": 8}
# unit chains: name -> (unit kind, warps a block, DIAG of unit_chain). 16 warps: two units in flight a warp; 32: one.
# DIAG & 3 (session 13 diagnostics: no grid barrier, no math, both) computes wrong results and is timed only
UNIT_CHAINS = {"chain_units": ("cuda", 16, 0), "chain_units_w32": ("cuda", 32, 0), "chain_units_tc": ("tc", 16, 0),
               "chain_units_no_barrier": ("cuda", 16, 1), "chain_units_no_math": ("cuda", 16, 2),
               "chain_units_neither": ("cuda", 16, 3), "chain_units_block_fence": ("cuda", 16, 4),
               "chain_units_two_ahead": ("cuda", 16, 12), "chain_units_tc_block_fence": ("tc", 16, 4),
               "chain_units_tc_no_barrier": ("tc", 16, 1)}


def cmd_build(a) -> None:
    from mlcc.schedules.cuda_gemv import GemvShape, make_gemv

    funcs = {c: make_gemv(GemvShape(*PROJ[c], "none"), pdl=True).with_attr("global_symbol", c) for c in CHAIN}
    for name, (mode, feed) in stream_variants().items():
        funcs[name] = _chain_kernel("mlcc_stream_layers", CONSUMERS + 1, SMEM_BYTES, mode, feed)
    x_and_red = 14336 * 2 + 2 * CONSUMERS * ROWS * 4
    for name, unroll in DIRECT.items():
        funcs[name] = _chain_kernel("mlcc_stream_direct_chain", CONSUMERS, x_and_red, unroll, 0)
    for name, (kind, warps, diag) in UNIT_CHAINS.items():
        if kind == "cuda":  # (x, then 32 group slots of 8 sums and a count)
            funcs[name] = _chain_kernel("mlcc_stream_unit_chain", warps, 14336 * 2 + 32 * ROWS * 4 + 32 * 4, warps,
                                        diag)
        else:  # (x as B words and 16 zero words, then 32 group slots of 16 sums and a count)
            funcs[name] = _chain_kernel("mlcc_stream_unit_chain_tc", warps, 14336 * 2 + 64 + 32 * 16 * 4 + 32 * 4,
                                        diag, 0)
    funcs = {name: f.with_attr("global_symbol", name) for name, f in funcs.items()}
    compile_probe(funcs, STREAM_SOURCE, Path(a.out), "stream")


def tiled(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MLC's q4f16_1 (codes [n, k/8] uint32, scales [n, k/32] fp16) as the probe's tiles: per group of 8 rows and
    tile of 2048 inputs, codes as [32-code group][row][16 bytes], then scales as [32-code group][row]."""
    n, k = packed.shape[0], packed.shape[1] * 8
    g, kt = n // ROWS, k // TILE_K
    codes = packed.reshape(g, ROWS, kt, TILE_K // 32, 4).transpose(0, 2, 3, 1, 4)
    sc = scales.reshape(g, ROWS, kt, TILE_K // 32).transpose(0, 2, 3, 1)
    codes = np.ascontiguousarray(codes).view(np.uint8).reshape(g, kt, -1)
    sc = np.ascontiguousarray(sc).view(np.uint8).reshape(g, kt, -1)
    return np.concatenate([codes, sc], axis=2).reshape(-1)


def unit_tiled(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MLC's q4f16_1 as chain_units' units: per group of 8 rows and 1024 inputs, codes [row][32-code group][16 B],
    then scales [row][32-code group]."""
    n, k = packed.shape[0], packed.shape[1] * 8
    g, uj = n // ROWS, k // 1024
    codes = np.ascontiguousarray(packed.reshape(g, ROWS, uj, 32, 4).transpose(0, 2, 1, 3, 4))
    sc = np.ascontiguousarray(scales.reshape(g, ROWS, uj, 32).transpose(0, 2, 1, 3))
    return np.concatenate([codes.view(np.uint8).reshape(g, uj, -1), sc.view(np.uint8).reshape(g, uj, -1)],
                          axis=2).reshape(-1)


def unit_tiled_tc(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MLC's q4f16_1 as chain_units_tc's units: per group of 16 rows and 512 inputs, codes [step 4][row r / r + 8]
    [lane (r, c)][16 B: group 4 step + c], then scale pairs [step][row r / r + 8][r][groups 4 step + 2 p, + 1]."""
    n, k = packed.shape[0], packed.shape[1] * 8
    g, uj = n // 16, k // 512
    codes = packed.reshape(g, 2, 8, uj, 4, 4, 4).transpose(0, 3, 4, 1, 2, 5, 6)
    sc = scales.reshape(g, 2, 8, uj, 4, 2, 2).transpose(0, 3, 4, 1, 2, 5, 6)
    codes = np.ascontiguousarray(codes).view(np.uint8).reshape(g, uj, -1)
    sc = np.ascontiguousarray(sc).view(np.uint8).reshape(g, uj, -1)
    return np.concatenate([codes, sc], axis=2).reshape(-1)


def cmd_run(a) -> None:
    import tvm

    from gemv_kernels import cuda_device, time_graph

    dev = cuda_device()
    m = tvm.runtime.load_module(str(Path(a.libs) / "stream.so"))
    rng = np.random.default_rng(0)
    host = {c: quantized(rng, *PROJ[c], signed_scales=True) for c in CHAIN}
    layer_bytes = sum(p.nbytes + s.nbytes for p, s, _ in host.values())
    layer_tiles = np.concatenate([tiled(host[c][0], host[c][1]) for c in CHAIN])
    assert layer_tiles.nbytes == layer_bytes
    w_stream = tvm.runtime.tensor(np.tile(layer_tiles, LAYERS), dev)
    layer_units = np.concatenate([unit_tiled(host[c][0], host[c][1]) for c in CHAIN])
    w_units = tvm.runtime.tensor(np.tile(layer_units, LAYERS), dev)
    layer_units_tc = np.concatenate([unit_tiled_tc(host[c][0], host[c][1]) for c in CHAIN])
    w_units_tc = tvm.runtime.tensor(np.tile(layer_units_tc, LAYERS), dev)
    w_mlc = [{c: [tvm.runtime.tensor(host[c][0], dev), tvm.runtime.tensor(host[c][1], dev)] for c in CHAIN}
             for _ in range(LAYERS)]
    x0 = rng.standard_normal(4096).astype(np.float16)
    xin = tvm.runtime.tensor(x0, dev)
    Y = tvm.runtime.tensor(np.zeros(LAYERS * Y_LAYER, np.float16), dev)
    bar = tvm.runtime.tensor(np.zeros(2, np.uint32), dev)

    # (the model's kernels take no offset into their output: one tensor per layer and projection)
    ys = [{c: tvm.runtime.tensor(np.zeros(PROJ[c][0], np.float16), dev) for c in CHAIN} for _ in range(LAYERS)]

    def kernels():
        prev = xin
        for l in range(LAYERS):
            for c in CHAIN:
                n, k = PROJ[c]
                m[c](prev._create_view((1, 1, k)), *w_mlc[l][c], ys[l][c]._create_view((1, 1, n)))
                prev = ys[l][c]

    def streamer(name):
        return lambda: m[name](xin, w_stream, Y, bar)

    def outputs(name):
        if name != "kernels":
            return Y.numpy().astype(np.float32)
        return np.concatenate([ys[l][c].numpy() for l in range(LAYERS) for c in CHAIN]).astype(np.float32)

    def errors(name):
        y = outputs(name)
        errs, x = {}, x0.astype(np.float32)
        for l in range(LAYERS):
            for c in CHAIN:
                n, k = PROJ[c]
                got = y[l * Y_LAYER + Y_OFF[c]:][:n]
                want = host[c][2] @ x[:k]
                errs[f"{l}.{c}"] = float(np.abs(got - want).max() / np.abs(want).max())
                x = got  # the next projection's input is what this one wrote
        return errs

    def worst(errs):
        return float(np.max(list(errs.values())))  # (NaN if any is)

    rows = []
    # the ring alone first (which feed streams best), then the chains, the model's kernels twice
    names = sorted(stream_variants(), key=lambda v: (stream_variants()[v][0] not in (1, 3, 4, 5, 6), v))
    variants = [("kernels", kernels)] + [(v, streamer(v)) for v in names] + [("kernels", kernels)]
    variants += [(v, streamer(v)) for v in DIRECT] + [("kernels", kernels)]
    w_of_kind = {"cuda": w_units, "tc": w_units_tc}
    variants += [(v, lambda v=v, w=w_of_kind[kind]: m[v](xin, w, Y, bar)) for v, (kind, _, _) in UNIT_CHAINS.items()]
    variants += [("kernels", kernels)]
    only = os.environ.get("MLCC_PROBE_ONLY")  # comma-separated variant names (a short device call)
    if only:
        variants = [(n, f) for n, f in variants if n in only.split(",")]
    for name, f in variants:
        Y.copyfrom(np.zeros(Y.shape, np.float16))
        for t in (t for layer in ys for t in layer.values()):
            t.copyfrom(np.zeros(t.shape, np.float16))
        try:
            f()
            dev.sync()
        except Exception as e:  # noqa: BLE001 - record a refused launch, keep the other variant's row
            print(name, "failed:", repr(e), flush=True)
            rows.append({"variant": name, "error": repr(e)})
            continue
        errs = errors(name)
        # (the diagnostic modes compute on stale inputs or not at all)
        checked = (name == "kernels" or name in DIRECT or name in UNIT_CHAINS and not UNIT_CHAINS[name][2] & 3
                   or stream_variants().get(name, (None,))[0] == 0)
        ok = all(e < 2e-2 for e in errs.values()) or not checked  # (False for NaN)
        t = min(time_graph(lambda *_: f(), None, [[]], None, dev, calls=40) for _ in range(3)) if ok else float("nan")
        errs_after = errors(name)
        ok = ok and (all(e < 2e-2 for e in errs_after.values()) or not checked)
        per_layer = t / LAYERS
        rows.append({"variant": name, "layers": LAYERS, "us_per_layer": per_layer * 1e6, "checked": checked,
                     "check_ok": ok,
                     "max_rel_err": worst(errs), "max_rel_err_after": worst(errs_after),
                     "layer_bytes": layer_bytes, "GB_s": layer_bytes / per_layer / 1e9 if ok else None})
        print(f"{name:8} {per_layer * 1e6:7.2f} us per layer  {layer_bytes / per_layer / 1e9 if ok else 0:6.0f} GB/s"
              f"  max rel err {worst(errs):.1e} / after timing {worst(errs_after):.1e} "
              f"{('ok' if ok else 'WRONG') if checked else '(not checked)'}", flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "stream_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    build_and_run(cmd_build, cmd_run)

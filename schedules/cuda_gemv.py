"""Batch-1 decode GEMVs for CUDA, written by hand (issue 4: decode near the bandwidth limit): q4f16_1
dequantize-GEMV and plain float16 GEMV, with PDL-aware weight preloading and fused epilogues.

dlight's GEMV rule unpacks one nibble at a time: shift, and, or, reinterpret, subtract, scale and FMA per code, about
seven scalar ops per 4 bits, which caps the kernel at ~2 TB/s on an H200 (ALU-bound, bench/results/README.md). This
kernel does the FasterTransformer/Marlin trick on MLC's unchanged layout instead: `(w >> 4j) & 0x000F000F | 0x64006400`
(one LOP3) puts codes j and j+4 into the two fp16 halves of one register as 1024 + code, so one HSUB2 and one HFMA2
handle two codes. The activation pairs (x_j, x_j+4) come from two 32-bit loads and a byte permute, shared by every row a
thread owns. Partial sums stay in fp16 only within a 32-code group; the group's scale is applied in fp32 and the row
is accumulated in fp32 (more accurate than the fp16 reduction it replaces).

Layout: one warp slot of L lanes per row set; lane i reads groups i, i+L, ... of R rows with one 16-byte load each
(a whole 32-code group), so a warp's loads of a row are contiguous. The cross-lane sum is a shuffle butterfly.

float16 weights (q0f16) use the same layout with 8 values per 16-byte load, multiplied in fp32. dlight's fp16 GEMV
already streams at 3.8-4.4 TB/s, but it waits for its predecessor before its first load; this one issues its first
weight loads before the PDL wait (cuda_pdl), which is what the ~130 GEMV launches of an 8B step lose otherwise.

The kernel replaces the fused PrimFunc of a decode projection in place (same parameters), for the epilogues TVM
fuses into it here: none, `+ residual/bias`, `cast to float32` (lm_head). Anything else keeps dlight's schedule.
A fourth epilogue, "swiglu", is not TVM's: `swiglu_gemv_pass` replaces the gate_up projection and the
split/silu/multiply kernel after it with one kernel whose threads own gate row i and up row i + I together and write
silu(gate) * up, so the activation never makes a round trip through memory and a step has one launch less per layer.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import tvm

from . import cuda_pdl

log = logging.getLogger(__name__)

HELPER_NAME = "mlcc_q4x8_hfma2"
# The unpacking with one shift per word (10% fewer SASS instructions in the 8B down_proj kernel; H200 A/B session 9:
# 8B +0.9%, Qwen2.5-0.5B +2.5%, SmolLM2 +2.2%). MLCC_Q4_ONE_SHIFT=0 at build time gives the two-shift helper.
ONE_SHIFT_HELPER_NAME = "mlcc_q4x8_hfma2_s1"


def q4_helper_name() -> str:
    return ONE_SHIFT_HELPER_NAME if os.environ.get("MLCC_Q4_ONE_SHIFT", "1") == "1" else HELPER_NAME


# The tensor-core kernel (cuda_gemv_tc) is faster on short projections in isolation (H200 sweep, session 10, 8B
# shapes, weights from DRAM: qkv 5.6 vs 6.5 us, o 4.8 vs 6.0 us) and slower on long ones (gate_up 19.7 vs 19.3 us,
# down 13.6 vs 11.1 us). In the model it did not pay: "auto" (tensor cores up to TC_MAX_CODE_BYTES of codes) against
# the CUDA-core kernel everywhere, interleaved A/B: 8B 541 vs 545 tok/s, Qwen2.5-0.5B 1289 vs 1446, SmolLM2 1304
# vs 1443 (bench/results/ab_decode_h200_tc_auto_rejected_s10.json). So the default stays "cuda-core".
TC_MAX_CODE_BYTES = 16 << 20


def q4_kernel(shape: GemvShape) -> str:
    """Which q4f16_1 decode GEMV a projection gets: "cuda-core" (this module's HFMA2 kernel, the default) or "tc"
    (tensor cores, cuda_gemv_tc). MLCC_Q4_KERNEL at build time: "cuda-core", "tc" for every projection, or "auto"
    (tc for projections up to TC_MAX_CODE_BYTES of codes)."""
    kernel = os.environ.get("MLCC_Q4_KERNEL", "cuda-core")
    if kernel not in ("auto", "tc", "cuda-core"):
        raise ValueError(f"MLCC_Q4_KERNEL={kernel!r}: use 'cuda-core', 'tc' or 'auto'")
    if kernel == "auto":
        return "tc" if shape.weight_rows * shape.k // 2 <= TC_MAX_CODE_BYTES else "cuda-core"
    return kernel

# Device helpers, added to the CUDA source of any module that calls them (schedules/cuda_source.py).
CUDA_HELPERS = r"""
#include <cuda_fp16.h>
__device__ __forceinline__ half2 mlcc_u2h(unsigned v) { union { unsigned u; half2 h; } c; c.u = v; return c.h; }
__device__ __forceinline__ unsigned mlcc_h2u(half2 v) { union { unsigned u; half2 h; } c; c.h = v; return c.u; }
__device__ __forceinline__ unsigned mlcc_lop3_and_or(unsigned a, unsigned b, unsigned c) {
  unsigned d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));  // (a & b) | c
  return d;
}
// acc (fp16x2 bits) += sum over the 8 codes of word w of (code - 7) * x, x given as its 4 natural-order fp16 pairs
__device__ __forceinline__ unsigned mlcc_q4x8_hfma2(unsigned w, unsigned x01, unsigned x23, unsigned x45,
                                                    unsigned x67, unsigned acc) {
  const half2 bias = mlcc_u2h(0x64076407u);  // 1024 + 7 in both halves
  half2 a = mlcc_u2h(acc);
  a = __hfma2(__hsub2(mlcc_u2h(mlcc_lop3_and_or(w, 0x000F000Fu, 0x64006400u)), bias),
              mlcc_u2h(__byte_perm(x01, x45, 0x5410)), a);
  a = __hfma2(__hsub2(mlcc_u2h(mlcc_lop3_and_or(w >> 4, 0x000F000Fu, 0x64006400u)), bias),
              mlcc_u2h(__byte_perm(x01, x45, 0x7632)), a);
  a = __hfma2(__hsub2(mlcc_u2h(mlcc_lop3_and_or(w >> 8, 0x000F000Fu, 0x64006400u)), bias),
              mlcc_u2h(__byte_perm(x23, x67, 0x5410)), a);
  a = __hfma2(__hsub2(mlcc_u2h(mlcc_lop3_and_or(w >> 12, 0x000F000Fu, 0x64006400u)), bias),
              mlcc_u2h(__byte_perm(x23, x67, 0x7632)), a);
  return mlcc_h2u(a);
}
// the same sum with one shift per word instead of three: codes 1/5 and 3/7 are masked in place (bits 4-7 and
// 20-23), giving 1024 + 16 * code, and brought to code - 7 by one HFMA2 (x 1/16, - 71) in place of the HSUB2; exact
__device__ __forceinline__ unsigned mlcc_q4x8_hfma2_s1(unsigned w, unsigned x01, unsigned x23, unsigned x45,
                                                       unsigned x67, unsigned acc) {
  const half2 bias = mlcc_u2h(0x64076407u);     // 1024 + 7 in both halves
  const half2 sixteenth = mlcc_u2h(0x2C002C00u);  // 1/16
  const half2 bias16 = mlcc_u2h(0xD470D470u);     // -71 = -(1024 / 16 + 7)
  const unsigned w8 = w >> 8;
  half2 a = mlcc_u2h(acc);
  a = __hfma2(__hsub2(mlcc_u2h(mlcc_lop3_and_or(w, 0x000F000Fu, 0x64006400u)), bias),
              mlcc_u2h(__byte_perm(x01, x45, 0x5410)), a);
  a = __hfma2(__hfma2(mlcc_u2h(mlcc_lop3_and_or(w, 0x00F000F0u, 0x64006400u)), sixteenth, bias16),
              mlcc_u2h(__byte_perm(x01, x45, 0x7632)), a);
  a = __hfma2(__hsub2(mlcc_u2h(mlcc_lop3_and_or(w8, 0x000F000Fu, 0x64006400u)), bias),
              mlcc_u2h(__byte_perm(x23, x67, 0x5410)), a);
  a = __hfma2(__hfma2(mlcc_u2h(mlcc_lop3_and_or(w8, 0x00F000F0u, 0x64006400u)), sixteenth, bias16),
              mlcc_u2h(__byte_perm(x23, x67, 0x7632)), a);
  return mlcc_h2u(a);
}
__device__ __forceinline__ float mlcc_h2_sum(unsigned acc) {
  const half2 a = mlcc_u2h(acc);
  return __low2float(a) + __high2float(a);
}
"""


@dataclasses.dataclass(frozen=True)
class GemvShape:
    n: int                 # output features (rows of W; for "swiglu", half of them)
    k: int                 # input features
    epilogue: str          # "none" | "add" | "cast" | "swiglu"
    residual_shape: tuple[int, ...] = ()
    out_dtype: str = "float16"
    weights: str = "q4f16_1"  # | "float16"
    norm_eps: float | None = None  # RMSNorm prologue: x is the un-normalized input, with the norm weight after it

    @property
    def weight_rows(self) -> int:
        """Rows of W: for "swiglu" the gate rows and then the up rows."""
        return 2 * self.n if self.epilogue == "swiglu" else self.n

    @property
    def unit(self) -> int:
        """Weights per 16-byte load of one row."""
        return 32 if self.weights == "q4f16_1" else 8


F16_HELPER_NAME = "mlcc_f16x2_fma"
F16_HELPERS = r"""
#include <cuda_fp16.h>
// acc + w.lo * x.lo + w.hi * x.hi in fp32, w and x given as the bits of an fp16 pair
__device__ __forceinline__ float mlcc_f16x2_fma(unsigned w, unsigned x, float acc) {
  const float2 wf = __half22float2(*reinterpret_cast<const __half2*>(&w));
  const float2 xf = __half22float2(*reinterpret_cast<const __half2*>(&x));
  return fmaf(wf.y, xf.y, fmaf(wf.x, xf.x, acc));
}
"""


NORM_HELPER_NAME = "mlcc_h2_rms_scale"
NORM_HELPERS = r"""
#include <cuda_fp16.h>
__device__ __forceinline__ float mlcc_h2_sumsq(unsigned x) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&x));
  return f.x * f.x + f.y * f.y;
}
// fp16(rs * x * g) for an fp16 pair, in fp32 and in the order of TVM's rms_norm, so the GEMV sees its input bits
__device__ __forceinline__ unsigned mlcc_h2_rms_scale(unsigned x, unsigned g, float rs) {
  const float2 xf = __half22float2(*reinterpret_cast<const __half2*>(&x));
  const float2 gf = __half22float2(*reinterpret_cast<const __half2*>(&g));
  const __half2 r = __floats2half2_rn(rs * xf.x * gf.x, rs * xf.y * gf.y);
  return *reinterpret_cast<const unsigned*>(&r);
}
// fp16(x * g) for an fp16 pair, in fp32
__device__ __forceinline__ unsigned mlcc_h2_mul(unsigned x, unsigned g) {
  const float2 xf = __half22float2(*reinterpret_cast<const __half2*>(&x));
  const float2 gf = __half22float2(*reinterpret_cast<const __half2*>(&g));
  const __half2 r = __floats2half2_rn(xf.x * gf.x, xf.y * gf.y);
  return *reinterpret_cast<const unsigned*>(&r);
}
"""


# Enough warps in flight to cover DRAM latency on a big GPU (132 SMs x 16 warps on an H100/H200, ~32 KB of loads
# outstanding per SM); short projections (o_proj, down_proj: 4096 rows) reach it only by splitting K across warps.
# Session 5's sweep (bench/gemv_sweep.py) found configurations 14% faster per 8B layer in isolation (35.2 vs 40.9 us
# back to back), but neither they nor a rule of 1536 warps with two iterations preloaded made the 8B model faster
# (interleaved A/B: -1.4%, -1.3%; bench/results session 5), so this rule stays.
_WARPS_WANTED = 4096


def launch_config(n: int, units: int, warps_wanted: int = _WARPS_WANTED,
                  weights: str = "q4f16_1") -> tuple[int, int, int, int]:
    """(lanes per row, rows per thread, row warps per block, warps splitting K) for n rows of `units` 16-byte
    loads each."""
    lanes = 32
    while lanes > 4 and units < lanes:
        lanes //= 2
    if weights == "float16":
        # float16 rows are 4x longer per 16-byte load than q4 ones: the L2-rotated sweep (session 7,
        # bench/results/gemv_sweep_q0f16_l2rotated_h200_s7.json) found 2 rows per thread with K split over 8 warps
        # best or within 1% of best on all four 8B projections (qkv 3969, o 3743, gate_up 4396, down 4196 GB/s;
        # the q4 rule gave 3540/3100/4279/3524)
        ksplit = 1
        while units >= lanes * ksplit * 2 and ksplit < 8:
            ksplit *= 2
        return lanes, 2, 1, ksplit
    rows, ksplit = 4, 1

    def warps_total() -> int:
        return -(-n // (rows * (32 // lanes))) * ksplit

    while warps_total() < warps_wanted and units >= lanes * ksplit * 2 and ksplit < 8:
        ksplit *= 2
    while warps_total() < warps_wanted // 2 and rows > 1:  # small models: fewer rows per thread, more threads
        rows //= 2
    return lanes, rows, max(1, 4 // ksplit), ksplit


def make_gemv(shape: GemvShape, warps_wanted: int = _WARPS_WANTED, pdl: bool = False,
              config: tuple[int, int, int, int] | None = None, preload: int = 1, max_blocks: int | None = None,
              contiguous: bool = False):
    """The hand-scheduled kernel for one projection, with the parameter order of TVM's fused function (for
    "swiglu": x, weights[, scales], out). `pdl`: place the programmatic-dependent-launch wait after the first weight
    loads (sm_90+, see cuda_pdl). `config` overrides launch_config (rows counted in weight rows); `preload`: how many
    of a thread's iterations load their weights before anything else (before the wait, with PDL), each in its own
    registers. `max_blocks`: launch at most that many blocks, each looping over the row blocks bx, bx + grid, ...
    (only the first one's weights are preloaded); with `contiguous`, block bx takes one run of consecutive row blocks
    instead (its weights one contiguous stream: session 12 measured ~2.9 TB/s for a persistent kernel's tiles
    interleaved across blocks and ~4.0 for contiguous runs, stream_probe.py)."""
    from tvm.script import tirx as T

    if shape.weights == "q4f16_1" and config is None and preload == 1 and q4_kernel(shape) == "tc":
        from .cuda_gemv_tc import make_gemv_tc, supports

        if supports(shape):
            return make_gemv_tc(shape, pdl=pdl)
    n, k, epi = shape.n, shape.k, shape.epilogue
    q4 = shape.weights == "q4f16_1"
    swiglu = epi == "swiglu"
    n_w = shape.weight_rows
    units = k // shape.unit
    x_words = shape.unit // 2  # 32-bit words of x per unit
    lanes, rows_w, row_warps, ksplit = config or launch_config(n_w, units, warps_wanted, shape.weights)
    # a swiglu thread owns `rows` output rows: weight rows r (gate) and r + n (up) of each
    rows = max(1, rows_w // 2) if swiglu else rows_w
    rows_w = 2 * rows if swiglu else rows
    warps = row_warps * ksplit
    slots = 32 // lanes
    rows_per_block = row_warps * slots * rows
    iters = -(-units // (lanes * ksplit))
    pre = max(1, min(preload, iters))
    blocks = -(-n // rows_per_block)
    grid = min(blocks, max_blocks or blocks)
    rounds = -(-blocks // grid)  # row blocks per launched block
    if contiguous:
        grid = -(-blocks // rounds)  # (every launched block gets `rounds` row blocks but the last)

    def row_block_of(bx, vb):
        return bx * rounds + vb if contiguous else vb * grid + bx
    r_shape = shape.residual_shape or (1, 1, n)
    out_dtype = shape.out_dtype
    groups = k // 32
    norm = shape.norm_eps is not None
    eps = float(shape.norm_eps or 0.0)
    # float16 weights multiply in fp32, so they take x * g un-normalized and scale each row by 1/rms(x) at the end:
    # the sum of x² rides along as one more accumulator, and no pass over x or barrier precedes the weight stream
    # (a prologue pass left the 8B qkv projection at 3.1 TB/s, session 7 profile). The q4 kernel sums fp16 products
    # of 32 codes, which un-normalized activations (the residual stream reaches the thousands) could overflow: its
    # blocks normalize x once into shared memory (per warp, 4 rows each, the rescaling cost more than the ALU-bound
    # kernel had to spare: 8B q4f16_1 456 -> 288 tok/s, session 7)
    defer = norm and not q4
    q4_helper = q4_helper_name()
    n_acc = rows_w + defer  # the accumulators a thread reduces: its rows [, the sum of x²]
    staged = norm and q4
    threads = warps * 32
    stage_words = -(-(k // 2) // threads) if staged else 1  # 32-bit words of x a thread stages

    def row_of(bx, ty, tx, r):
        return bx * rows_per_block + (ty // ksplit * slots + tx // lanes) * rows + r

    def wrow_of(bx, ty, tx, r):
        # weight row of the thread's r-th loaded row (the up rows of a swiglu thread follow its gate rows)
        if swiglu:
            return row_of(bx, ty, tx, r % rows) + (r // rows) * n
        return row_of(bx, ty, tx, r)

    def unit_of(it, ty, tx):
        return (it * ksplit + ty % ksplit) * lanes + tx % lanes

    def slot(it):
        # the preloaded iterations keep their own registers; later ones reuse the first slot
        return T.if_then_else(it < pre, it, 0)

    @T.macro
    def load_weights(ww, wl, bx, ty, tx, it):
        for r in T.unroll(rows_w):
            if row_of(bx, ty, tx, r % rows) < n:
                for v in T.vectorized(4):
                    wl[slot(it), r, v] = ww[wrow_of(bx, ty, tx, r) * (units * 4) + unit_of(it, ty, tx) * 4 + v]
            else:
                for v in T.vectorized(4):
                    wl[slot(it), r, v] = T.uint32(0x77777777 if q4 else 0)

    @T.macro
    def accumulate(sf, wl, xl, accf, acc, bx, ty, tx, it):
        if q4:
            for r in T.unroll(rows_w):
                acc[r] = T.uint32(0)
            for c in T.unroll(4):
                for r in T.unroll(rows_w):
                    acc[r] = T.call_pure_extern("uint32", q4_helper, wl[slot(it), r, c], xl[c * 4],
                                                xl[c * 4 + 1], xl[c * 4 + 2], xl[c * 4 + 3], acc[r])
            for r in T.unroll(rows_w):
                if row_of(bx, ty, tx, r % rows) < n:
                    accf[r] = accf[r] + T.call_pure_extern("float32", "mlcc_h2_sum", acc[r]) * \
                        T.Cast("float32", sf[wrow_of(bx, ty, tx, r) * groups + unit_of(it, ty, tx)])
        else:
            for c in T.unroll(4):
                for r in T.unroll(rows_w):
                    accf[r] = T.call_pure_extern("float32", F16_HELPER_NAME, wl[slot(it), r, c], xl[c], accf[r])

    block_rms = block_rsqrt_macro(warps, k, eps)

    @T.macro
    def stage_normalized_x(xw, gw, xs, xr, rs, ssred, ty, tx):
        # the block's threads read x once (into registers), sum its squares across the block, then write it
        # rescaled to shared memory for every warp: one read of x per block and two barriers
        rs[0] = T.float32(0)
        for j in T.unroll(stage_words):
            xr[j] = T.uint32(0)
            if ty * 32 + tx + j * threads < k // 2:
                xr[j] = xw[ty * 32 + tx + j * threads]
            rs[0] = rs[0] + T.call_pure_extern("float32", "mlcc_h2_sumsq", xr[j])
        block_rms(rs, ssred, ty, tx)
        for j in T.unroll(stage_words):
            if ty * 32 + tx + j * threads < k // 2:
                xs[ty * 32 + tx + j * threads] = T.call_pure_extern(
                    "uint32", NORM_HELPER_NAME, xr[j], gw[ty * 32 + tx + j * threads], rs[0])
        T.evaluate(T.tvm_storage_sync("shared"))

    def later_load(it, vb):
        # iterations past the preloaded ones load their weights in the loop, as do all of a later row block's
        return it >= pre if rounds == 1 else tvm.tirx.Or(it >= pre, vb > 0)

    @T.macro
    def row_block(xw, gw, ww, sf, rf, out, xs, xl, wl, acc, accf, red, bx, vb, ty, tx):
        for r in T.unroll(n_acc):
            accf[r] = T.float32(0)
        for it in T.unroll(iters):
            if unit_of(it, ty, tx) < units:
                for q in T.unroll(x_words // 4):
                    for v in T.vectorized(4):
                        xl[q * 4 + v] = (xs if staged else xw)[unit_of(it, ty, tx) * x_words + q * 4 + v]
                if defer:
                    for c in T.unroll(x_words):
                        accf[rows_w] = accf[rows_w] + T.call_pure_extern("float32", "mlcc_h2_sumsq", xl[c])
                        xl[c] = T.call_pure_extern("uint32", "mlcc_h2_mul", xl[c],
                                                   gw[unit_of(it, ty, tx) * x_words + c])
                if later_load(it, vb):
                    load_weights(ww, wl, bx, ty, tx, it)
                accumulate(sf, wl, xl, accf, acc, bx, ty, tx, it)
        for r in T.unroll(n_acc):
            for o in T.unroll(5):
                if (1 << o) < lanes:
                    accf[r] = accf[r] + T.call_pure_extern(
                        "float32", "__shfl_xor_sync", T.uint32(0xFFFFFFFF), accf[r], 1 << o, 32)
        if ksplit > 1:
            # the warps that split K meet in shared memory; the first of them finishes the rows
            for r in T.unroll(n_acc):
                if tx % lanes == 0:
                    red[ty, tx // lanes, r] = accf[r]
            T.evaluate(T.tvm_storage_sync("shared"))
            if ty % ksplit == 0:
                for r in T.unroll(n_acc):
                    for j in T.unroll(ksplit - 1):
                        accf[r] = accf[r] + red[ty + 1 + j, tx // lanes, r]
        if defer:
            for r in T.unroll(rows_w):
                accf[r] = accf[r] * T.rsqrt(accf[rows_w] / T.float32(k) + T.float32(eps))
        for r in T.unroll(rows):
            if tx % lanes == 0 and ty % ksplit == 0 and row_of(bx, ty, tx, r) < n:
                if epi == "add":
                    out[0, 0, row_of(bx, ty, tx, r)] = T.Cast("float16", accf[r]) + rf[row_of(bx, ty, tx, r)]
                elif swiglu:
                    # silu(gate) * up from the fp16-rounded projections, as the unfused kernels
                    out[0, 0, row_of(bx, ty, tx, r)] = T.Cast("float16", _silu_times(
                        T.Cast("float32", T.Cast("float16", accf[r])),
                        T.Cast("float32", T.Cast("float16", accf[r + rows]))))
                else:
                    out[0, 0, row_of(bx, ty, tx, r)] = T.Cast(out_dtype, T.Cast("float16", accf[r]))
        if rounds > 1 and ksplit > 1:
            T.evaluate(T.tvm_storage_sync("shared"))  # `red` is written again by the next row block

    @T.macro
    def body(x, g, w, s, res, out):
        xw = T.decl_buffer((k // 2,), "uint32", data=x.data)
        gw = T.decl_buffer((k // 2,), "uint32", data=g.data)  # unread without the norm prologue
        ww = T.decl_buffer((n_w * units * 4,), "uint32", data=w.data)
        sf = T.decl_buffer((n_w * groups,), "float16", data=s.data)  # unread for float16 weights
        rf = T.decl_buffer((n,), "float16", data=res.data)  # unread unless epilogue == "add"
        for bx in T.thread_binding(grid, thread="blockIdx.x"):
            for ty in T.thread_binding(warps, thread="threadIdx.y"):
                for tx in T.thread_binding(32, thread="threadIdx.x"):
                    with T.sblock("gemv"):
                        T.reads()
                        T.writes()
                        xl = T.sblock_alloc_buffer((x_words,), "uint32", scope="local")
                        wl = T.sblock_alloc_buffer((pre, rows_w, 4), "uint32", scope="local")
                        acc = T.sblock_alloc_buffer((rows_w,), "uint32", scope="local")
                        accf = T.sblock_alloc_buffer((n_acc,), "float32", scope="local")
                        red = T.sblock_alloc_buffer((warps, slots, n_acc), "float32", scope="shared")
                        rs = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        ssred = T.sblock_alloc_buffer((warps, slots), "float32", scope="shared")
                        xs = T.sblock_alloc_buffer((k // 2 if staged else 1,), "uint32", scope="shared")
                        xr = T.sblock_alloc_buffer((stage_words,), "uint32", scope="local")
                        # the first weights do not depend on the previous kernel: with PDL they load while it
                        # finishes (cuda_pdl), the activations only after the wait
                        for p in T.unroll(pre):
                            if unit_of(p, ty, tx) < units:
                                load_weights(ww, wl, row_block_of(bx, 0), ty, tx, p)
                        if pdl:
                            T.evaluate(T.call_extern("void", cuda_pdl.WAIT))
                            T.evaluate(T.call_extern("void", cuda_pdl.LAUNCH_DEPENDENTS))
                        if staged:
                            stage_normalized_x(xw, gw, xs, xr, rs, ssred, ty, tx)
                        if rounds == 1:  # (grid = blocks)
                            row_block(xw, gw, ww, sf, rf, out, xs, xl, wl, acc, accf, red, bx, 0, ty, tx)
                        else:
                            for vb in T.serial(rounds):
                                if row_block_of(bx, vb) < blocks:
                                    row_block(xw, gw, ww, sf, rf, out, xs, xl, wl, acc, accf, red,
                                              row_block_of(bx, vb), vb, ty, tx)

    w_shape, w_dtype = ((n_w, k // 8), "uint32") if q4 else ((n_w, k), "float16")
    x_shape, g_shape, s_shape = (1, 1, k), (k,), (n_w, groups)
    add = epi == "add"
    # one kernel with every parameter, then only those this shape reads, in TVM's order: x[, norm weight], W[,
    # scales][, residual], out (the body reads an alias, x or W or out, in place of each one dropped)
    @T.prim_func(private=True, s_tir=True)
    def full(x: T.Buffer(x_shape, "float16"), g: T.Buffer(g_shape, "float16"), w: T.Buffer(w_shape, w_dtype),
             s: T.Buffer(s_shape, "float16"), res: T.Buffer(r_shape, "float16"), out: T.Buffer((1, 1, n), out_dtype)):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        body(x, g if norm else x, w, s if q4 else w, res if add else out, out)

    x_p, g_p, w_p, s_p, res_p, out_p = full.params
    params = [x_p] + [g_p] * norm + [w_p] + [s_p] * q4 + [res_p] * add + [out_p]
    func = tvm.tirx.PrimFunc(params, full.body, attrs=full.attrs)
    return func


def block_rsqrt_macro(warps: int, k: int, eps: float):
    """A TIR macro (rs, ssred, ty, tx): rs[0] holds this thread's share of the sum of x² over k values; afterwards
    every thread's rs[0] is 1 / sqrt(mean(x²) + eps) over the whole block (a warp butterfly, then one barrier
    through ssred, shared float32 of shape (warps, >= 1))."""
    from tvm.script import tirx as T

    @T.macro
    def block_rsqrt(rs, ssred, ty, tx):
        for o in T.unroll(5):
            rs[0] = rs[0] + T.call_pure_extern("float32", "__shfl_xor_sync", T.uint32(0xFFFFFFFF), rs[0], 1 << o, 32)
        if tx == 0:
            ssred[ty, 0] = rs[0]
        T.evaluate(T.tvm_storage_sync("shared"))
        rs[0] = T.float32(0)
        for j in T.unroll(warps):
            rs[0] = rs[0] + ssred[j, 0]
        rs[0] = T.rsqrt(rs[0] / T.float32(k) + T.float32(eps))

    return block_rsqrt


def _silu_times(gate, up):
    from tvm import tirx

    return gate * tirx.sigmoid(gate) * up


def _static_ints(shape) -> tuple[int, ...] | None:
    try:
        return tuple(int(d) for d in shape)
    except TypeError:  # a symbolic dimension
        return None


def _blocks(func) -> dict | None:
    from tvm import s_tir

    try:
        sch = s_tir.Schedule(func)
        return {sch.get(b).name_hint: sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))}
    except Exception:  # noqa: BLE001 - not a plain block-structured function: not ours
        return None


def match_gemv(func) -> GemvShape | None:
    """The shape of a batch-1 decode projection PrimFunc — q4f16_1 dequantize→matmul or float16 NT_matmul,
    [→add|cast] — or None if it is anything else."""
    blocks = _blocks(func)
    if blocks is None:
        return None
    if {"dequantize", "matmul"} <= set(blocks):
        core, weights = {"dequantize", "matmul"}, "q4f16_1"
        deq, mm = blocks["dequantize"], blocks["matmul"]
        if len(deq.reads) != 2 or len(mm.reads) != 2:
            return None
        w, s = (r.source for r in deq.reads)
        x = next((r.source for r in mm.reads if not r.source.same_as(deq.writes[0].source)), None)
        if x is None or w.dtype != "uint32" or s.dtype != "float16":
            return None
    elif "NT_matmul" in blocks:
        core, weights = {"NT_matmul"}, "float16"
        mm = blocks["NT_matmul"]
        if len(mm.reads) != 2:
            return None
        x, w = (r.source for r in mm.reads)
        s = None
        if w.dtype != "float16" or not _reads_row_major(mm, w):
            return None
    else:
        return None
    extra = set(blocks) - core
    if len(extra) > 1 or not extra <= {"T_add", "compute"}:
        return None
    ws, xs, ys = (_static_ints(b.shape) for b in (w, x, mm.writes[0].source))
    if None in (ws, xs, ys) or x.dtype != "float16" or len(ws) != 2:
        return None
    n, k = (ws[0], ws[1] * 8) if weights == "q4f16_1" else ws
    if xs != (1, 1, k) or ys != (1, 1, n) or k % 32:
        return None
    if s is not None and _static_ints(s.shape) != (n, k // 32):
        return None
    if not extra:
        epilogue, res, out = "none", None, mm.writes[0].source
    else:
        (name,) = extra
        blk = blocks[name]
        reads = [r.source for r in blk.reads]
        out = blk.writes[0].source
        others = [b for b in reads if not b.same_as(mm.writes[0].source)]
        if name == "T_add":
            if len(reads) != 2 or len(others) != 1 or not isinstance(blk.body.value, tvm.tirx.Add):
                return None
            res = others[0]
            if res.dtype != "float16" or _static_ints(res.shape) not in ((n,), (1, 1, n)) or out.dtype != "float16":
                return None
            epilogue = "add"
        else:
            if len(reads) != 1 or others or not isinstance(blk.body.value, tvm.tirx.Cast):
                return None
            epilogue, res = "cast", None
        if _static_ints(out.shape) != (1, 1, n):
            return None
    expected = [x, w] + ([s] if s is not None else []) + ([res] if res is not None else []) + [out]
    if len(func.params) != len(expected) or not all(p.same_as(e) for p, e in zip(func.params, expected)):
        return None
    return GemvShape(n, k, epilogue, _static_ints(res.shape) if res is not None else (), str(out.dtype), weights)


def _reads_row_major(block, w) -> bool:
    """The NT matmul reads W[i, k] (row i of the output, the reduction index second), not W[k, i]."""
    (region,) = [r for r in block.reads if r.source.same_as(w)]
    iters = block.iter_vars
    spatial = [iv.var for iv in iters if iv.iter_type == 0]
    reduce = [iv.var for iv in iters if iv.iter_type == 2]
    if len(reduce) != 1 or not spatial:
        return False
    first, second = (r.min for r in region.region)
    return first.same_as(spatial[-1]) and second.same_as(reduce[0])


def match_swiglu(func) -> int | None:
    """I for the split → silu(first half) * second half kernel of a (1, 1, 2I) float16 input, else None."""
    blocks = _blocks(func)
    if blocks is None or set(blocks) != {"T_split_sections", "T_split_sections_1", "compute", "T_multiply",
                                         "T_multiply1"}:
        return None
    if len(func.params) != 2:
        return None
    src, dst = (_static_ints(p.shape) for p in func.params)
    dtypes = {str(p.dtype) for p in func.params}
    value = blocks["compute"].body.value
    if src is None or dst is None or dtypes != {"float16"} or len(src) != 3 or src[:2] != (1, 1) \
            or dst != (1, 1, src[2] // 2) or src[2] % 2:
        return None
    if not (isinstance(value, tvm.ir.expr.Call) and value.op.same_as(tvm.ir.Op.get("tirx.sigmoid"))):
        return None
    return dst[2]


@tvm.transform.module_pass(opt_level=0, name="mlcc_cuda_decode_gemv")
def decode_gemv_pass(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
    """Swap every batch-1 decode projection for the hand-written kernel (before dlight sees it)."""
    replaced = 0
    pdl = _pdl()
    for gv, func in list(mod.functions.items()):
        if not isinstance(func, tvm.tirx.PrimFunc) or func.attrs is not None and "tirx.is_scheduled" in func.attrs:
            continue
        shape = match_gemv(func)
        if shape is None:
            continue
        new = make_gemv(shape, pdl=pdl)
        mod[gv] = new.with_attrs({k: v for k, v in func.attrs.items()} if func.attrs is not None else {}) \
            .with_attr("tirx.is_scheduled", True)
        replaced += 1
    log.debug("decode GEMV kernels: %d", replaced)
    return mod


def _pdl() -> bool:
    target = tvm.target.Target.current(allow_none=True)
    return target is not None and cuda_pdl.supported(target)


def match_rms_norm(func) -> tuple[int, float] | None:
    """(k, eps) of TVM's legalized float16 rms_norm over (1, 1, k) with a (k,) weight, else None."""
    blocks = _blocks(func)
    if blocks is None or set(blocks) != {"T_cast", "T_multiply", "T_multiply_red", "rsqrt", "T_cast_1", "T_rms_norm",
                                         "T_cast_2"} or len(func.params) != 3:
        return None
    x, g, out = (_static_ints(p.shape) for p in func.params)
    if x is None or len(x) != 3 or x[:2] != (1, 1) or g != x[2:] or out != x \
            or {str(p.dtype) for p in func.params} != {"float16"}:
        return None
    value = blocks["rsqrt"].body.value  # rsqrt(sum / k + eps)
    try:
        mean, eps = value.args[0].a, value.args[0].b
        if int(round(float(mean.b.value))) != x[2]:
            return None
        return x[2], float(eps.value)
    except AttributeError:
        return None


def fuse_decode_gemvs(mod: tvm.ir.IRModule) -> tvm.ir.IRModule:
    """In every Relax function: gate_up projection + split/silu/multiply → one "swiglu" GEMV kernel; then an
    rms_norm whose only reader is a decode GEMV → that GEMV with the norm as its prologue (x, norm weight, ...).
    The new kernels are scheduled already; the projections left over go to decode_gemv_pass."""
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, PyExprVisitor, mutator, visitor

    call_tir = tvm.ir.Op.get("relax.call_tir")
    pdl = _pdl()
    made: dict[str, GemvShape] = {}  # name of a kernel made here → its shape

    def prim_funcs(m, matcher):
        return {gv.name_hint: r for gv, f in m.functions.items() if isinstance(f, tvm.tirx.PrimFunc)
                and (r := matcher(f)) is not None}

    def gemv_shape(m, callee) -> GemvShape | None:
        if callee.name_hint in made:
            return made[callee.name_hint]
        f = m[callee]
        if not isinstance(f, tvm.tirx.PrimFunc) or f.attrs is not None and "tirx.is_scheduled" in f.attrs:
            return None
        return match_gemv(f)

    def add_kernel(builder, shape: GemvShape) -> tvm.ir.GlobalVar:
        name = f"fused_gemv_{'rms_' if shape.norm_eps is not None else ''}{shape.epilogue}_{shape.n}_{shape.k}"
        gv = builder.add_func(make_gemv(shape, pdl=pdl).with_attr("tirx.is_scheduled", True), name)
        made[gv.name_hint] = shape
        return gv

    @visitor
    class Uses(PyExprVisitor):
        def __init__(self):
            super().__init__()
            self.count: dict = {}

        def visit_var_(self, v):
            self.count[v] = self.count.get(v, 0) + 1

        def visit_dataflow_var_(self, v):
            self.count[v] = self.count.get(v, 0) + 1

    def run(m, fuse_call):
        @mutator
        class Fuse(PyExprMutator):
            def __init__(self):
                super().__init__(m)
                self.kernels: dict[GemvShape, tvm.ir.GlobalVar] = {}

            def visit_call_(self, call):
                call = self.visit_expr_post_order(call)
                if not call.op.same_as(call_tir):
                    return call
                fused = fuse_call(self, call)
                if fused is None:
                    return call
                shape, args = fused
                if shape not in self.kernels:
                    self.kernels[shape] = add_kernel(self.builder_, shape)
                return relax.call_tir(self.kernels[shape], args, call.ty_args[0])

        fuser = Fuse()
        for gv, func in m.functions.items():
            if isinstance(func, relax.Function):
                fuser.uses = Uses()
                fuser.uses.visit_expr(func)
                fuser.builder_.update_func(gv, fuser.visit_expr(func))
        return relax.transform.DeadCodeElimination()(fuser.builder_.get())

    def producer(fuser, var, callees=None) -> relax.Call | None:
        """The call_tir that binds `var` (to one of `callees`, by name, when given)."""
        value = fuser.lookup_binding(var) if isinstance(var, relax.Var) else None
        if not isinstance(value, relax.Call) or not value.op.same_as(call_tir) \
                or callees is not None and value.args[0].name_hint not in callees:
            return None
        return value

    swiglus = prim_funcs(mod, match_swiglu)

    def swiglu_call(fuser, call):
        if call.args[0].name_hint not in swiglus:
            return None
        (src,) = call.args[1].fields
        gemv = producer(fuser, src)
        shape = gemv_shape(mod, gemv.args[0]) if gemv is not None else None
        if shape is None or shape.epilogue != "none" or shape.n != 2 * swiglus[call.args[0].name_hint]:
            return None
        return GemvShape(shape.n // 2, shape.k, "swiglu", weights=shape.weights), gemv.args[1]

    mod = run(mod, swiglu_call) if swiglus else mod
    norms = prim_funcs(mod, match_rms_norm)

    def norm_call(fuser, call):
        shape = gemv_shape(mod, call.args[0])
        # (q4: x normalized once per block in shared memory; the per-warp version cost the 8B 456 -> 288 tok/s,
        # session 7 A/B, bench/results/ab_decode_h200_f16rule_rmsfold_s7.json)
        if shape is None or shape.norm_eps is not None:
            return None
        x, *rest = call.args[1].fields
        norm = producer(fuser, x, norms)
        if norm is None or fuser.uses.count.get(x, 0) != 1 or norms[norm.args[0].name_hint][0] != shape.k:
            return None
        h, g = norm.args[1].fields
        return dataclasses.replace(shape, norm_eps=norms[norm.args[0].name_hint][1]), relax.Tuple([h, g, *rest])

    if norms:
        mod = run(mod, norm_call)
    log.debug("decode GEMV kernels with fused SwiGLU / RMSNorm: %s", sorted(made))
    return mod


@tvm.transform.module_pass(opt_level=0, name="mlcc_cuda_fused_decode_gemv")
def fused_decode_gemv_pass(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
    return fuse_decode_gemvs(mod)

"""Batch-1 q4f16_1 decode GEMV on the tensor cores (issue 4): `mma.sync.m16n8k16` with fp32 accumulation instead of
HFMA2 chains, on MLC's unchanged weight layout.

Why it was built (sessions 8-9's hypothesis, which the measurements below refute): the CUDA-core kernel
(cuda_gemv) spends 82-164 SASS instructions per 16 bytes of codes a thread streams (per pair of codes: LOP3 to
unpack, HSUB2 for the zero point, HFMA2 for the product, plus the per-group fp16→fp32 reduction; bench/gemv_sass.py),
which was taken to keep the q4 projections near 3 TB/s. Here a warp owns 16 weight rows and, per step, one 32-code
group of each row for each of its four lane columns; per 32-bit word of codes a lane needs one shift and four
LOP3 (AND), and the products, the zero point and the sums over the group are the tensor core's:

* A (16 x 16, the weights): codes are used as fp16 *subnormals* — `w & 0x000F000F` is the pair (q_j, q_j+4) as
  q * 2^-24 exactly, `w & 0x00F000F0` the pair (q_j+1, q_j+5) as 16 q * 2^-24 — so no bias has to be subtracted
  and nothing cancels. (variant "bias": `| 0x64006400` as in the CUDA-core kernel, 1024 + q; kept to compare.)
  The order of k inside an mma does not matter as long as A and B agree, so a lane's slots hold whatever pair the
  unpacking gives: lane (r, c) holds rows r and r + 8, group c of the step.
* B (16 x 8, the activations): column n holds x of group n at the k of the slots lane column n owns, zero
  elsewhere, so D[m][n] is row m's sum over group n alone and the per-group scale applies in fp32 afterwards.
  x is staged once per block in shared memory already in pair order (x_j, x_j+4), the odd pairs divided by 16.
* The zero point (code - 7) is one more mma per B with a constant A of -7 * 2^-24: per step 16 mmas, 8 of them
  for the zero point, instead of a subtraction per pair of codes.

Per warp and 1 KB of weights: 2 LDG.128, 8 x (SHF + 4 LOP3), 16 HMMA, 4 LDS.128 of x (one lane per column), and
the scale epilogue (2 FFMA pairs). Accumulation is fp32 throughout (the CUDA-core kernel sums a group's 32 products
in fp16): max relative error 3e-4 against 6-8e-4 on the 8B shapes.

Measured (H200, session 10, bench/results/README.md): ~45% fewer SASS instructions per byte than the CUDA-core
kernel; in isolation faster on the short 8B projections (qkv 5.6 vs 6.5 us, o 4.8-5.4 vs 6.0) and slower on the
long ones (gate_up, down), but in the model not faster (8B) or 10% slower (small models, whose projections are a
few us and pay for the staging barrier and the mma chains). So it is opt-in: MLCC_Q4_KERNEL=tc or auto
(cuda_gemv.q4_kernel).
"""

from __future__ import annotations

import os

import tvm

from . import cuda_pdl
from .cuda_gemv import NORM_HELPER_NAME, GemvShape, _silu_times, block_rsqrt_macro

STEP_HELPERS = {"sub": "mlcc_q4tc_step_sub", "bias": "mlcc_q4tc_step_bias"}
# what the fp32 sums are multiplied by at the end: the subnormal codes are q * 2^-24
_FINAL_SCALE = {"sub": float(1 << 24), "bias": 1.0}

# (mlcc_lop3_and_or comes from cuda_gemv.CUDA_HELPERS, listed before this group in cuda_source)
CUDA_HELPERS = r"""
#include <cuda_fp16.h>
__device__ __forceinline__ void mlcc_mma_16816(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                               unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// d[0..3] = this lane's part of the group sums of one step: rows wa (r) and wb (r + 8), 4 words (32 codes) each,
// x pairs xb (16 words; zero unless the lane's column c equals its row r). Codes as fp16 subnormals (q * 2^-24).
__device__ __forceinline__ void mlcc_q4tc_step_sub(float* d, const unsigned* wa, const unsigned* wb,
                                                   const unsigned* xb) {
  const unsigned zp = 0x80078007u, zp16 = 0x80708070u;  // -7 * 2^-24 and -112 * 2^-24 (for x / 16)
  float e[4] = {0.f, 0.f, 0.f, 0.f};  // a second chain: 8 dependent mmas each instead of 16
  d[0] = d[1] = d[2] = d[3] = 0.f;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const unsigned a = wa[w], b = wb[w], a8 = a >> 8, b8 = b >> 8;
    mlcc_mma_16816(d, a & 0x000F000Fu, b & 0x000F000Fu, a & 0x00F000F0u, b & 0x00F000F0u, xb[4 * w], xb[4 * w + 1]);
    mlcc_mma_16816(e, a8 & 0x000F000Fu, b8 & 0x000F000Fu, a8 & 0x00F000F0u, b8 & 0x00F000F0u, xb[4 * w + 2],
                   xb[4 * w + 3]);
    mlcc_mma_16816(d, zp, zp, zp16, zp16, xb[4 * w], xb[4 * w + 1]);
    mlcc_mma_16816(e, zp, zp, zp16, zp16, xb[4 * w + 2], xb[4 * w + 3]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) d[i] += e[i];
}
// the same with codes as 1024 + q (normal fp16), the bias folded into the zero-point mma (-1031, -1136 for x / 16)
__device__ __forceinline__ void mlcc_q4tc_step_bias(float* d, const unsigned* wa, const unsigned* wb,
                                                    const unsigned* xb) {
  const unsigned zp = 0xE407E407u, zp16 = 0xE470E470u, e = 0x64006400u;
  float f[4] = {0.f, 0.f, 0.f, 0.f};
  d[0] = d[1] = d[2] = d[3] = 0.f;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const unsigned a = wa[w], b = wb[w], a8 = a >> 8, b8 = b >> 8;
    mlcc_mma_16816(d, mlcc_lop3_and_or(a, 0x000F000Fu, e), mlcc_lop3_and_or(b, 0x000F000Fu, e),
                   mlcc_lop3_and_or(a, 0x00F000F0u, e), mlcc_lop3_and_or(b, 0x00F000F0u, e), xb[4 * w], xb[4 * w + 1]);
    mlcc_mma_16816(f, mlcc_lop3_and_or(a8, 0x000F000Fu, e), mlcc_lop3_and_or(b8, 0x000F000Fu, e),
                   mlcc_lop3_and_or(a8, 0x00F000F0u, e), mlcc_lop3_and_or(b8, 0x00F000F0u, e), xb[4 * w + 2],
                   xb[4 * w + 3]);
    mlcc_mma_16816(d, zp, zp, zp16, zp16, xb[4 * w], xb[4 * w + 1]);
    mlcc_mma_16816(f, zp, zp, zp16, zp16, xb[4 * w + 2], xb[4 * w + 3]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) d[i] += f[i];
}
// the four B words of 8 activations (natural order, 4 words): pairs (x0,x4), (x1,x5)/16, (x2,x6), (x3,x7)/16
__device__ __forceinline__ unsigned mlcc_tc_pair(unsigned lo, unsigned hi, int which) {
  const unsigned p = __byte_perm(lo, hi, (which & 1) ? 0x7632 : 0x5410);
  if (!(which & 1)) return p;
  union { unsigned u; half2 h; } c;
  c.u = p;
  c.h = __hmul2(c.h, __half2half2(__ushort_as_half((unsigned short)0x2C00u)));  // exact: a power of two
  return c.u;
}
// acc + d0 * lo(s) + d1 * hi(s), s the bits of two fp16 scales
__device__ __forceinline__ float mlcc_tc_scale2(unsigned s, float d0, float d1, float acc) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&s));
  return fmaf(d1, f.y, fmaf(d0, f.x, acc));
}
"""


def variant_default() -> str:
    return os.environ.get("MLCC_Q4_TC_VARIANT", "sub")


_TILE = 16  # weight rows per warp (the mma's M)
_GROUPS_PER_STEP = 4  # one per lane column


def tc_launch_config(n_tiles: int, chunks: int) -> tuple[int, int]:
    """(row warps per block, warps splitting K): enough warps to cover DRAM latency (each streams 1 KB per step)."""
    ksplit = 1
    while n_tiles * ksplit < 4096 and chunks >= ksplit * 2 * 2 and ksplit < 8:
        ksplit *= 2
    return max(1, 8 // ksplit), ksplit


def supports(shape: GemvShape) -> bool:
    """Shapes this kernel takes: q4f16_1 with x staged within the 48 KB of static shared memory."""
    return shape.weights == "q4f16_1" and shape.k % 32 == 0 and shape.k * 2 <= 40 * 1024


def make_gemv_tc(shape: GemvShape, pdl: bool = False, config: tuple[int, int] | None = None, preload: int = 1,
                 variant: str | None = None):
    """The tensor-core kernel for one q4f16_1 projection, parameters as cuda_gemv.make_gemv (x[, norm weight], W,
    scales[, residual], out). `config`: (row warps per block, warps splitting K); `preload`: steps whose weights
    load before the PDL wait."""
    from tvm.script import tirx as T

    if not supports(shape):
        raise ValueError(f"the tensor-core GEMV does not take {shape}")
    variant = variant or variant_default()
    step_helper = STEP_HELPERS[variant]
    final_scale = _FINAL_SCALE[variant]
    n, k, epi = shape.n, shape.k, shape.epilogue
    swiglu = epi == "swiglu"
    n_w = shape.weight_rows
    groups = k // 32
    chunks = -(-groups // _GROUPS_PER_STEP)
    out_rows = _TILE // 2 if swiglu else _TILE  # output rows per warp tile (swiglu: 8 gate rows + their up rows)
    n_tiles = -(-n // out_rows)
    row_warps, ksplit = config or tc_launch_config(n_tiles, chunks)
    warps = row_warps * ksplit
    threads = warps * 32
    iters = -(-chunks // ksplit)
    pre = max(1, min(preload, iters))
    blocks = -(-n_tiles // row_warps)
    r_shape = shape.residual_shape or (1, 1, n)
    out_dtype = shape.out_dtype
    norm = shape.norm_eps is not None
    eps = float(shape.norm_eps or 0.0)
    units8 = k // 8  # 16-byte words of x
    staged_units = chunks * _GROUPS_PER_STEP * 4
    stage_iters = -(-(staged_units + 4) // threads)  # + the zero words
    sq_iters = -(-(k // 2) // threads)
    wwords = k // 8  # uint32 words of codes per row

    # guards only where the shape needs them: groups past k / 32 (last chunk), chunks past the last (K split
    # unevenly); rows past n are clamped into the matrix and not written. The 8B shapes need none, so their loads are
    # unconditional
    groups_exact = groups % _GROUPS_PER_STEP == 0
    chunks_exact = chunks % ksplit == 0
    scale_pairs = groups % 2 == 0  # a lane's two scales of a row are one aligned 32-bit word
    x_zero = staged_units * 4  # 16 zero words after the staged x: what lanes off the diagonal read

    def tile_of(bx, ty):
        return bx * row_warps + ty // ksplit

    def row_a(bx, ty, tx):
        return tile_of(bx, ty) * out_rows + tx // 4

    def row_b(bx, ty, tx):
        # the second row a lane owns: r + 8, or for swiglu the up row of its gate row
        return row_a(bx, ty, tx) + n if swiglu else row_a(bx, ty, tx) + 8

    def valid_a(bx, ty, tx):
        return row_a(bx, ty, tx) < n

    def valid_b(bx, ty, tx):
        return row_a(bx, ty, tx) < n if swiglu else row_a(bx, ty, tx) + 8 < n

    def scale_col(tx):
        # the scale column a lane starts at: its own (c) on the guarded path, else c % 2 (see scale_epilogue)
        return tx % 2 if scale_pairs and groups_exact else tx % 4

    def chunk_of(it, ty):
        return it * ksplit + ty % ksplit

    @T.macro
    def load_weights(ww, sw, wl, sl, ib, ty, tx, it):
        # ib[0] / ib[1]: 16-byte offsets of rows a / b at this warp's first chunk (rows clamped into the matrix);
        # offsets kept in 16-byte units so TVM sees the loads aligned and emits one 128-bit load each
        if groups_exact:
            for v in T.vectorized(4):
                wl[it % pre, 0, v] = ww[ib[0] * 4 + it * ksplit * 16 + v]
            for v in T.vectorized(4):
                wl[it % pre, 1, v] = ww[ib[1] * 4 + it * ksplit * 16 + v]
            if scale_pairs:
                # the step's scales load with its weights, `pre` steps ahead (loaded when needed they cost one
                # dependent round trip per step: 17 us instead of 11 for the 8B down_proj, session 10)
                sl[it % pre, 0] = sw[(ib[2] + it * ksplit * 4) // 2]
                sl[it % pre, 1] = sw[(ib[3] + it * ksplit * 4) // 2]
        else:
            if chunk_of(it, ty) * 4 + tx % 4 < groups:
                for v in T.vectorized(4):
                    wl[it % pre, 0, v] = ww[ib[0] * 4 + it * ksplit * 16 + v]
                for v in T.vectorized(4):
                    wl[it % pre, 1, v] = ww[ib[1] * 4 + it * ksplit * 16 + v]
            else:
                for v in T.vectorized(4):
                    wl[it % pre, 0, v] = T.uint32(0)
                for v in T.vectorized(4):
                    wl[it % pre, 1, v] = T.uint32(0)

    block_rms = block_rsqrt_macro(warps, k, eps)

    @T.macro
    def stage_x(xw, gw, xs, xr, rs, ssred, ty, tx):
        # x (rms-normalized when the norm is folded in) into shared memory as B words, once per block
        if norm:
            rs[0] = T.float32(0)
            for j in T.unroll(sq_iters):
                if ty * 32 + tx + j * threads < k // 2:
                    rs[0] = rs[0] + T.call_pure_extern("float32", "mlcc_h2_sumsq", xw[ty * 32 + tx + j * threads])
            block_rms(rs, ssred, ty, tx)
        for j in T.unroll(stage_iters):
            if ty * 32 + tx + j * threads < units8:
                for v in T.vectorized(4):
                    xr[v] = xw[(ty * 32 + tx + j * threads) * 4 + v]
                if norm:
                    for v in T.unroll(4):
                        xr[v] = T.call_pure_extern("uint32", NORM_HELPER_NAME, xr[v],
                                                   gw[(ty * 32 + tx + j * threads) * 4 + v], rs[0])
                for p in T.unroll(4):
                    xs[(ty * 32 + tx + j * threads) * 4 + p] = T.call_pure_extern(
                        "uint32", "mlcc_tc_pair", xr[p // 2], xr[p // 2 + 2], p)
            elif ty * 32 + tx + j * threads < staged_units + 4:  # the padding and the zero words
                for p in T.unroll(4):
                    xs[(ty * 32 + tx + j * threads) * 4 + p] = T.uint32(0)
        T.evaluate(T.tvm_storage_sync("shared"))

    @T.macro
    def scale_epilogue(sf, sl, accf, dacc, ib, ty, tx, it):
        # columns 2c, 2c + 1 of rows r, r + 8 are the real groups (lanes c < 2; the others hold columns 4-7, which
        # are zero: they add 0 times a scale of columns 0-3); ib[2] / ib[3]: scale index of rows a / b at this
        # warp's first chunk, column 2 (c % 2)
        if scale_pairs and groups_exact:
            accf[0] = T.call_pure_extern("float32", "mlcc_tc_scale2", sl[it % pre, 0], dacc[0], dacc[1], accf[0])
            accf[1] = T.call_pure_extern("float32", "mlcc_tc_scale2", sl[it % pre, 1], dacc[2], dacc[3], accf[1])
        else:
            if tx % 4 < 2:
                for j in T.unroll(2):
                    if chunk_of(it, ty) * 4 + (tx % 4) * 2 + j < groups:
                        accf[0] = accf[0] + dacc[j] * T.Cast("float32", sf[ib[2] + it * ksplit * 4 + j])
                        accf[1] = accf[1] + dacc[2 + j] * T.Cast("float32", sf[ib[3] + it * ksplit * 4 + j])

    @T.macro
    def step(ww, xs, sf, sw, wl, sl, xf, dacc, accf, ib, ty, tx, it):
        for q in T.unroll(4):
            for v in T.vectorized(4):
                xf[q * 4 + v] = xs[(ib[4] + it * ib[5] + q) * 4 + v]
        T.evaluate(T.call_extern("void", step_helper, T.address_of(dacc[0]), T.address_of(wl[it % pre, 0, 0]),
                                 T.address_of(wl[it % pre, 1, 0]), T.address_of(xf[0])))
        scale_epilogue(sf, sl, accf, dacc, ib, ty, tx, it)
        if it + pre < iters:  # the slots just consumed take the weights and scales `pre` steps ahead
            if chunks_exact:
                load_weights(ww, sw, wl, sl, ib, ty, tx, it + pre)
            elif chunk_of(it + pre, ty) < chunks:
                load_weights(ww, sw, wl, sl, ib, ty, tx, it + pre)

    @T.macro
    def body(x, g, w, s, res, out):
        xw = T.decl_buffer((k // 2,), "uint32", data=x.data)
        gw = T.decl_buffer((k // 2,), "uint32", data=g.data)  # unread without the norm prologue
        ww = T.decl_buffer((n_w * wwords,), "uint32", data=w.data)
        sf = T.decl_buffer((n_w * groups,), "float16", data=s.data)
        sw = T.decl_buffer((n_w * groups // 2,), "uint32", data=s.data)  # read only when groups is even
        rf = T.decl_buffer((n,), "float16", data=res.data)  # unread unless epilogue == "add"
        for bx in T.thread_binding(blocks, thread="blockIdx.x"):
            for ty in T.thread_binding(warps, thread="threadIdx.y"):
                for tx in T.thread_binding(32, thread="threadIdx.x"):
                    with T.sblock("gemv"):
                        T.reads()
                        T.writes()
                        wl = T.sblock_alloc_buffer((pre, 2, 4), "uint32", scope="local")
                        sl = T.sblock_alloc_buffer((pre, 2), "uint32", scope="local")
                        xf = T.sblock_alloc_buffer((16,), "uint32", scope="local")
                        dacc = T.sblock_alloc_buffer((4,), "float32", scope="local")
                        accf = T.sblock_alloc_buffer((2,), "float32", scope="local")
                        ib = T.sblock_alloc_buffer((6,), "int32", scope="local")
                        xr = T.sblock_alloc_buffer((4,), "uint32", scope="local")
                        rs = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        ssred = T.sblock_alloc_buffer((warps, 1), "float32", scope="shared")
                        red = T.sblock_alloc_buffer((warps, 8, 2), "float32", scope="shared")
                        xs = T.sblock_alloc_buffer((staged_units * 4 + 16,), "uint32", scope="shared")
                        accf[0] = T.float32(0)
                        accf[1] = T.float32(0)
                        ib[0] = T.min(row_a(bx, ty, tx), n_w - 1) * (wwords // 4) + (ty % ksplit) * 4 + tx % 4
                        ib[1] = T.min(row_b(bx, ty, tx), n_w - 1) * (wwords // 4) + (ty % ksplit) * 4 + tx % 4
                        ib[2] = T.min(row_a(bx, ty, tx), n_w - 1) * groups + (ty % ksplit) * 4 + scale_col(tx) * 2
                        ib[3] = T.min(row_b(bx, ty, tx), n_w - 1) * groups + (ty % ksplit) * 4 + scale_col(tx) * 2
                        # the lane on the diagonal (its row r equals its column c) reads column c's x, the others
                        # the same 16 zero words every step
                        ib[4] = T.if_then_else(tx // 4 == tx % 4, ((ty % ksplit) * 4 + tx % 4) * 4, x_zero // 4)
                        ib[5] = T.if_then_else(tx // 4 == tx % 4, ksplit * 16, 0)
                        # the first weights do not depend on the previous kernel: with PDL they load while it
                        # finishes (cuda_pdl), x only after the wait
                        for p in T.unroll(pre):
                            if chunks_exact:
                                load_weights(ww, sw, wl, sl, ib, ty, tx, p)
                            elif chunk_of(p, ty) < chunks:
                                load_weights(ww, sw, wl, sl, ib, ty, tx, p)
                        if pdl:
                            T.evaluate(T.call_extern("void", cuda_pdl.WAIT))
                            T.evaluate(T.call_extern("void", cuda_pdl.LAUNCH_DEPENDENTS))
                        stage_x(xw, gw, xs, xr, rs, ssred, ty, tx)
                        for it in T.unroll(iters):
                            if chunks_exact:
                                step(ww, xs, sf, sw, wl, sl, xf, dacc, accf, ib, ty, tx, it)
                            elif chunk_of(it, ty) < chunks:
                                step(ww, xs, sf, sw, wl, sl, xf, dacc, accf, ib, ty, tx, it)
                        for r in T.unroll(2):
                            accf[r] = accf[r] + T.call_pure_extern("float32", "__shfl_xor_sync", T.uint32(0xFFFFFFFF),
                                                                   accf[r], 1, 32)
                        if ksplit > 1:
                            if tx % 4 == 0:
                                for r in T.unroll(2):
                                    red[ty, tx // 4, r] = accf[r]
                            T.evaluate(T.tvm_storage_sync("shared"))
                            if ty % ksplit == 0:
                                for r in T.unroll(2):
                                    for j in T.unroll(ksplit - 1):
                                        accf[r] = accf[r] + red[ty + 1 + j, tx // 4, r]
                        for r in T.unroll(2):
                            accf[r] = accf[r] * T.float32(final_scale)
                        if tx % 4 == 0 and ty % ksplit == 0:
                            if swiglu:
                                if valid_a(bx, ty, tx):
                                    out[0, 0, row_a(bx, ty, tx)] = T.Cast("float16", _silu_times(
                                        T.Cast("float32", T.Cast("float16", accf[0])),
                                        T.Cast("float32", T.Cast("float16", accf[1]))))
                            else:
                                for r in T.unroll(2):
                                    if row_a(bx, ty, tx) + 8 * r < n:
                                        if epi == "add":
                                            out[0, 0, row_a(bx, ty, tx) + 8 * r] = T.Cast("float16", accf[r]) + \
                                                rf[row_a(bx, ty, tx) + 8 * r]
                                        else:
                                            out[0, 0, row_a(bx, ty, tx) + 8 * r] = T.Cast(
                                                out_dtype, T.Cast("float16", accf[r]))

    w_shape = (n_w, k // 8)
    x_shape, g_shape, s_shape = (1, 1, k), (k,), (n_w, groups)
    add = epi == "add"

    @T.prim_func(private=True, s_tir=True)
    def full(x: T.Buffer(x_shape, "float16"), g: T.Buffer(g_shape, "float16"), w: T.Buffer(w_shape, "uint32"),
             s: T.Buffer(s_shape, "float16"), res: T.Buffer(r_shape, "float16"), out: T.Buffer((1, 1, n), out_dtype)):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        body(x, g if norm else x, w, s, res if add else out, out)

    x_p, g_p, w_p, s_p, res_p, out_p = full.params
    params = [x_p] + [g_p] * norm + [w_p, s_p] + [res_p] * add + [out_p]
    return tvm.tirx.PrimFunc(params, full.body, attrs=full.attrs)

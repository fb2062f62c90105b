"""Batch-1 q4f16_1 dequant-GEMV for CUDA, written by hand (issue 4: decode near the bandwidth limit).

dlight's GEMV rule unpacks one nibble at a time: shift, and, or, reinterpret, subtract, scale and FMA per code, about
seven scalar ops per 4 bits, which caps the kernel at ~2 TB/s on an H200 (ALU-bound, bench/results/README.md). This
kernel does the FasterTransformer/Marlin trick on MLC's unchanged layout instead: `(w >> 4j) & 0x000F000F | 0x64006400`
(one LOP3) puts codes j and j+4 into the two fp16 halves of one register as 1024 + code, so one HSUB2 and one HFMA2
handle two codes. The activation pairs (x_j, x_j+4) come from two 32-bit loads and a byte permute, shared by every row a
thread owns. Partial sums stay in fp16 only within a 32-code group; the group's scale is applied in fp32 and the row
is accumulated in fp32 (more accurate than the fp16 reduction it replaces).

Layout: one warp slot of L lanes per row set; lane i reads groups i, i+L, ... of R rows with one 16-byte load each
(a whole 32-code group), so a warp's loads of a row are contiguous. The cross-lane sum is a shuffle butterfly.

The kernel replaces the fused PrimFunc of a decode projection in place (same parameters), for the epilogues TVM
fuses into it here: none, `+ residual/bias`, `cast to float32` (lm_head). Anything else keeps dlight's schedule.
"""

from __future__ import annotations

import dataclasses
import logging

import tvm

from . import cuda_pdl

log = logging.getLogger(__name__)

HELPER_NAME = "mlcc_q4x8_hfma2"

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
__device__ __forceinline__ float mlcc_h2_sum(unsigned acc) {
  const half2 a = mlcc_u2h(acc);
  return __low2float(a) + __high2float(a);
}
"""


@dataclasses.dataclass(frozen=True)
class GemvShape:
    n: int                 # output features (rows of W)
    k: int                 # input features
    epilogue: str          # "none" | "add" | "cast"
    residual_shape: tuple[int, ...] = ()
    out_dtype: str = "float16"


# Enough warps in flight to cover DRAM latency on a big GPU (132 SMs x 16 warps on an H100/H200, ~32 KB of loads
# outstanding per SM); short projections (o_proj, down_proj: 4096 rows) reach it only by splitting K across warps.
# Session 5's sweep (bench/gemv_sweep.py) found configurations 14% faster per 8B layer in isolation (35.2 vs 40.9 us
# back to back), but neither they nor a rule of 1536 warps with two iterations preloaded made the 8B model faster
# (interleaved A/B: -1.4%, -1.3%; bench/results session 5), so this rule stays.
_WARPS_WANTED = 4096


def launch_config(n: int, k: int, warps_wanted: int = _WARPS_WANTED) -> tuple[int, int, int, int]:
    """(lanes per row, rows per thread, row warps per block, warps splitting K)."""
    groups = k // 32
    lanes = 32
    while lanes > 4 and groups < lanes:
        lanes //= 2
    rows, ksplit = 4, 1

    def warps_total() -> int:
        return -(-n // (rows * (32 // lanes))) * ksplit

    while warps_total() < warps_wanted and groups >= lanes * ksplit * 2 and ksplit < 8:
        ksplit *= 2
    while warps_total() < warps_wanted // 2 and rows > 1:  # small models: fewer rows per thread, more threads
        rows //= 2
    return lanes, rows, max(1, 4 // ksplit), ksplit


def make_q4_gemv(shape: GemvShape, warps_wanted: int = _WARPS_WANTED, pdl: bool = False,
                 config: tuple[int, int, int, int] | None = None, preload: int = 1):
    """The hand-scheduled kernel for one projection, with the parameter order of TVM's fused function; `pdl`: place
    the programmatic-dependent-launch wait after the first weight loads (sm_90+, see cuda_pdl). `config` overrides
    launch_config; `preload`: how many of a thread's iterations load their weights before anything else (before the
    wait, with PDL), each in its own registers."""
    from tvm.script import tirx as T

    n, k, epi = shape.n, shape.k, shape.epilogue
    lanes, rows, row_warps, ksplit = config or launch_config(n, k, warps_wanted)
    warps = row_warps * ksplit
    groups = k // 32
    slots = 32 // lanes
    rows_per_block = row_warps * slots * rows
    iters = -(-groups // (lanes * ksplit))
    pre = max(1, min(preload, iters))
    blocks = -(-n // rows_per_block)
    r_shape = shape.residual_shape or (1, 1, n)
    out_dtype = shape.out_dtype

    def row_of(bx, ty, tx, r):
        return bx * rows_per_block + (ty // ksplit * slots + tx // lanes) * rows + r

    def group_of(it, ty, tx):
        return (it * ksplit + ty % ksplit) * lanes + tx % lanes

    def slot(it):
        # the preloaded iterations keep their own registers; later ones reuse the first slot
        return T.if_then_else(it < pre, it, 0)

    @T.macro
    def load_weights(ww, wl, bx, ty, tx, it):
        for r in T.unroll(rows):
            if row_of(bx, ty, tx, r) < n:
                for v in T.vectorized(4):
                    wl[slot(it), r, v] = ww[row_of(bx, ty, tx, r) * (k // 8) + group_of(it, ty, tx) * 4 + v]
            else:
                for v in T.vectorized(4):
                    wl[slot(it), r, v] = T.uint32(0x77777777)

    @T.macro
    def body(x, w, s, res, out):
        xw = T.decl_buffer((k // 2,), "uint32", data=x.data)
        ww = T.decl_buffer((n * k // 8,), "uint32", data=w.data)
        sf = T.decl_buffer((n * groups,), "float16", data=s.data)
        rf = T.decl_buffer((n,), "float16", data=res.data)  # unread unless epilogue == "add"
        for bx in T.thread_binding(blocks, thread="blockIdx.x"):
            for ty in T.thread_binding(warps, thread="threadIdx.y"):
                for tx in T.thread_binding(32, thread="threadIdx.x"):
                    with T.sblock("gemv"):
                        T.reads()
                        T.writes()
                        xl = T.sblock_alloc_buffer((16,), "uint32", scope="local")
                        wl = T.sblock_alloc_buffer((pre, rows, 4), "uint32", scope="local")
                        acc = T.sblock_alloc_buffer((rows,), "uint32", scope="local")
                        accf = T.sblock_alloc_buffer((rows,), "float32", scope="local")
                        red = T.sblock_alloc_buffer((warps, slots, rows), "float32", scope="shared")
                        for r in T.unroll(rows):
                            accf[r] = T.float32(0)
                        # the first weights do not depend on the previous kernel: with PDL they load while it
                        # finishes (cuda_pdl), the activations only after the wait
                        for p in T.unroll(pre):
                            if group_of(p, ty, tx) < groups:
                                load_weights(ww, wl, bx, ty, tx, p)
                        if pdl:
                            T.evaluate(T.call_extern("void", cuda_pdl.WAIT))
                            T.evaluate(T.call_extern("void", cuda_pdl.LAUNCH_DEPENDENTS))
                        for it in T.unroll(iters):
                            if group_of(it, ty, tx) < groups:
                                for q in T.unroll(4):
                                    for v in T.vectorized(4):
                                        xl[q * 4 + v] = xw[group_of(it, ty, tx) * 16 + q * 4 + v]
                                if it >= pre:
                                    load_weights(ww, wl, bx, ty, tx, it)
                                for r in T.unroll(rows):
                                    acc[r] = T.uint32(0)
                                for c in T.unroll(4):
                                    for r in T.unroll(rows):
                                        acc[r] = T.call_pure_extern("uint32", HELPER_NAME, wl[slot(it), r, c], xl[c * 4],
                                                                    xl[c * 4 + 1], xl[c * 4 + 2], xl[c * 4 + 3],
                                                                    acc[r])
                                for r in T.unroll(rows):
                                    if row_of(bx, ty, tx, r) < n:
                                        accf[r] = accf[r] + T.call_pure_extern("float32", "mlcc_h2_sum", acc[r]) * \
                                            T.Cast("float32", sf[row_of(bx, ty, tx, r) * groups + group_of(it, ty, tx)])
                        for r in T.unroll(rows):
                            for o in T.unroll(5):
                                if (1 << o) < lanes:
                                    accf[r] = accf[r] + T.call_pure_extern(
                                        "float32", "__shfl_xor_sync", T.uint32(0xFFFFFFFF), accf[r], 1 << o, 32)
                        if ksplit > 1:
                            # the warps that split K meet in shared memory; the first of them finishes the rows
                            for r in T.unroll(rows):
                                if tx % lanes == 0:
                                    red[ty, tx // lanes, r] = accf[r]
                            T.evaluate(T.tvm_storage_sync("shared"))
                            if ty % ksplit == 0:
                                for r in T.unroll(rows):
                                    for j in T.unroll(ksplit - 1):
                                        accf[r] = accf[r] + red[ty + 1 + j, tx // lanes, r]
                        for r in T.unroll(rows):
                            if tx % lanes == 0 and ty % ksplit == 0 and row_of(bx, ty, tx, r) < n:
                                if epi == "add":
                                    out[0, 0, row_of(bx, ty, tx, r)] = T.Cast("float16", accf[r]) + rf[row_of(bx, ty, tx, r)]
                                else:
                                    out[0, 0, row_of(bx, ty, tx, r)] = T.Cast(out_dtype, T.Cast("float16", accf[r]))

    if epi == "add":
        @T.prim_func(private=True, s_tir=True)
        def func(x: T.Buffer((1, 1, k), "float16"), w: T.Buffer((n, k // 8), "uint32"),
                 s: T.Buffer((n, groups), "float16"), res: T.Buffer(r_shape, "float16"),
                 out: T.Buffer((1, 1, n), "float16")):
            T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
            body(x, w, s, res, out)
    else:
        @T.prim_func(private=True, s_tir=True)
        def func(x: T.Buffer((1, 1, k), "float16"), w: T.Buffer((n, k // 8), "uint32"),
                 s: T.Buffer((n, groups), "float16"), out: T.Buffer((1, 1, n), out_dtype)):
            T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
            body(x, w, s, out, out)
    return func


def _static_ints(shape) -> tuple[int, ...] | None:
    try:
        return tuple(int(d) for d in shape)
    except TypeError:  # a symbolic dimension
        return None


def match_q4_gemv(func) -> GemvShape | None:
    """The shape of a batch-1 q4f16_1 dequantize→matmul[→add|cast] PrimFunc, or None if it is anything else."""
    from tvm import s_tir

    try:
        sch = s_tir.Schedule(func)
        blocks = {sch.get(b).name_hint: sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))}
    except Exception:  # noqa: BLE001 - not a plain block-structured function: not ours
        return None
    extra = set(blocks) - {"dequantize", "matmul"}
    if not {"dequantize", "matmul"} <= set(blocks) or len(extra) > 1 or not extra <= {"T_add", "compute"}:
        return None
    deq, mm = blocks["dequantize"], blocks["matmul"]
    if len(deq.reads) != 2 or len(mm.reads) != 2:
        return None
    w, s = (r.source for r in deq.reads)
    x = next((r.source for r in mm.reads if not r.source.same_as(deq.writes[0].source)), None)
    ws, ss, xs, ys = (_static_ints(b.shape) for b in (w, s, x, mm.writes[0].source)) if x is not None else [None] * 4
    if None in (ws, ss, xs, ys) or w.dtype != "uint32" or s.dtype != "float16" or x.dtype != "float16":
        return None
    n, k = ws[0], ws[1] * 8
    if xs != (1, 1, k) or ys != (1, 1, n) or ss != (n, k // 32) or k % 32:
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
    expected = [x, w, s] + ([res] if res is not None else []) + [out]
    if len(func.params) != len(expected) or not all(p.same_as(e) for p, e in zip(func.params, expected)):
        return None
    return GemvShape(n, k, epilogue, _static_ints(res.shape) if res is not None else (), str(out.dtype))


@tvm.transform.module_pass(opt_level=0, name="mlcc_cuda_q4_gemv")
def q4_decode_gemv_pass(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
    """Swap every batch-1 q4f16_1 projection for the hand-written kernel (before dlight sees it)."""
    replaced = 0
    target = tvm.target.Target.current(allow_none=True)
    pdl = target is not None and cuda_pdl.supported(target)
    for gv, func in list(mod.functions.items()):
        if not isinstance(func, tvm.tirx.PrimFunc) or func.attrs is not None and "tirx.is_scheduled" in func.attrs:
            continue
        shape = match_q4_gemv(func)
        if shape is None:
            continue
        new = make_q4_gemv(shape, pdl=pdl)
        mod[gv] = new.with_attrs({k: v for k, v in func.attrs.items()} if func.attrs is not None else {}) \
            .with_attr("tirx.is_scheduled", True)
        replaced += 1
    log.debug("q4 decode GEMV kernels: %d", replaced)
    return mod

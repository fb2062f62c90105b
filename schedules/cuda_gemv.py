"""Batch-1 decode GEMVs for CUDA, written by hand: q4f16_1 dequantize-GEMV and plain float16 GEMV, with the first
weight loads issued before the PDL wait and the epilogues TVM fuses into a projection.

dlight's GEMV rule unpacks one nibble at a time: shift, and, or, reinterpret, subtract, scale and FMA per code, about
seven scalar ops per 4 bits, which caps the kernel at ~2 TB/s on an H200 (ALU-bound, bench/results/README.md). This
kernel does the FasterTransformer/Marlin trick on MLC's unchanged layout instead: `(w >> 4j) & 0x000F000F | 0x64006400`
(one LOP3) puts codes j and j+4 into the two fp16 halves of one register as 1024 + code, so one HSUB2 and one HFMA2
handle two codes (cuda/q4_gemv.cuh). The activation pairs (x_j, x_j+4) come from two 32-bit loads and a byte
permute, shared by every row a thread owns. Partial sums stay in fp16 only within a 32-code group; the group's scale
is applied in fp32 and the row is accumulated in fp32 (more accurate than the fp16 reduction it replaces).

Layout: one warp slot of L lanes per row set; lane i reads groups i, i+L, ... of R rows with one 16-byte load each
(a whole 32-code group), so a warp's loads of a row are contiguous. The cross-lane sum is a shuffle butterfly.

e4m3 weights (e4m3_e4m3_f16) use the same layout with 16 codes per 16-byte load: each code's bits are moved into
an fp16 that reads as its value / 256 (cuda/e4m3_gemv.cuh, two codes per HFMA2, zero and subnormals exact), a load's
16 products summed in fp16 and the row's float32 scale (times 256) applied once to its fp32 sum.

int8 weights (q8f16_1) use the same layout with 16 codes per 16-byte load, two loads to a 32-code group: one PRMT
per code pair builds 1024 + code in fp16 and one HFMA2 makes it (code - 128) / 128 (cuda/q8_gemv.cuh), so a load's
16 products, summed in fp16, stay within 16 times the largest activation; the group's scale, times 128, is applied
to each load's sum in fp32.

float16 weights (q0f16) use the same layout with 8 values per 16-byte load, multiplied in fp32. dlight's fp16 GEMV
already streams at 3.8-4.4 TB/s, but it waits for its predecessor before its first load; this one issues its first
weight loads before the PDL wait (cuda_pdl), which is what the ~130 GEMV launches of an 8B step lose otherwise.

The kernel replaces the fused PrimFunc of a decode projection in place (same parameters; gemv_match finds them), for
the epilogues TVM fuses into it: none, `+ residual/bias`, `cast to float32` (lm_head). Two more shapes come from the
compiler's GEMV fusion (compiler/gemv_fusion.py): "swiglu" (and "geglu", the same with the tanh GELU), one kernel
for the gate_up projection and the split/silu/multiply after it (a thread owns gate row i and up row i + I and writes
silu(gate) * up, so the activation never makes a round trip through memory), and an RMSNorm prologue
(`GemvShape.norm_eps`), the norm computed from its input inside the GEMV that reads its output.
"""

from __future__ import annotations

import dataclasses
import logging

import tvm

from mlcc.quantization import weight_scheme

from . import cuda_pdl
from .cuda_source import decodes_e4m3, decodes_int8, q4_scheme
from .gemv_match import GATED, GemvShape, is_unscheduled_prim_func, match_gemv

log = logging.getLogger(__name__)

# Device helpers (cuda/*.cuh; schedules/cuda_source adds them to the generated source)
Q4_HELPER = "mlcc_q4x8_hfma2_s1"   # eight q4 codes against their activations, one shift per word
Q8_HELPER = "mlcc_q8x4_hfma2"      # four int8 codes against their activations
E4M3_HELPER = "mlcc_e4m3x4_hfma2"  # four e4m3 codes against their activations
F16_HELPER = "mlcc_f16x2_fma"      # an fp16 pair of weights against one of activations, in fp32
NORM_HELPER = "mlcc_h2_rms_scale"  # an fp16 pair of activations normalized

# Enough warps in flight to cover DRAM latency on a big GPU (132 SMs x 16 warps on an H100/H200, ~32 KB of loads
# outstanding per SM); short projections (o_proj, down_proj: 4096 rows) reach it only by splitting K across warps.
# Other splits that were faster for single projections in isolation did not make the 8B model faster, measured in
# the whole model (bench/results/README.md).
WARPS_WANTED = 4096


def launch_config(n: int, units: int, weights: str = "q4f16_1") -> tuple[int, int, int, int]:
    """(lanes per row, rows per thread, row warps per block, warps splitting K) for n rows of `units` 16-byte
    loads each."""
    lanes = 32
    while lanes > 4 and units < lanes:
        lanes //= 2
    if weights == "float16":
        # float16 rows are 4x longer per 16-byte load than q4 ones: a sweep of the four 8B projections with the
        # weights out of L2 found 2 rows per thread with K split over 8 warps best or within 1% of best on all of
        # them (qkv 3969, o 3743, gate_up 4396, down 4196 GB/s on an H200; the q4 rule gave 3540/3100/4279/3524)
        ksplit = 1
        while units >= lanes * ksplit * 2 and ksplit < 8:
            ksplit *= 2
        return lanes, 2, 1, ksplit
    rows, ksplit = 4, 1

    def warps_total() -> int:
        return -(-n // (rows * (32 // lanes))) * ksplit

    while warps_total() < WARPS_WANTED and units >= lanes * ksplit * 2 and ksplit < 8:
        ksplit *= 2
    while warps_total() < WARPS_WANTED // 2 and rows > 1:  # small models: fewer rows per thread, more threads
        rows //= 2
    return lanes, rows, max(1, 4 // ksplit), ksplit


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Which rows and 16-byte units of W thread (bx, ty, tx) reads. A block is `warps` warps: `row_warps` sets of
    rows, each split over `ksplit` warps along K; a warp holds 32 // lanes row slots of `lanes` lanes; a slot owns
    `rows` output rows (for "swiglu" a gate and an up weight row each, so `rows_w` = 2 * rows weight rows)."""

    n: int
    units: int          # 16-byte loads per weight row
    swiglu: bool
    lanes: int
    rows: int
    rows_w: int
    row_warps: int
    ksplit: int

    @classmethod
    def of(cls, shape: GemvShape) -> _Layout:
        units = shape.k // shape.unit
        lanes, rows_w, row_warps, ksplit = launch_config(shape.weight_rows, units, shape.weights)
        swiglu = shape.epilogue in GATED
        rows = max(1, rows_w // 2) if swiglu else rows_w
        return cls(shape.n, units, swiglu, lanes, rows, 2 * rows if swiglu else rows, row_warps, ksplit)

    @property
    def warps(self) -> int:
        return self.row_warps * self.ksplit

    @property
    def slots(self) -> int:
        return 32 // self.lanes

    @property
    def rows_per_block(self) -> int:
        return self.row_warps * self.slots * self.rows

    @property
    def iters(self) -> int:
        """Units of a row each lane reads."""
        return -(-self.units // (self.lanes * self.ksplit))

    @property
    def blocks(self) -> int:
        return -(-self.n // self.rows_per_block)

    def row_of(self, bx, ty, tx, r):
        """Output row of the thread's r-th row."""
        return bx * self.rows_per_block + (ty // self.ksplit * self.slots + tx // self.lanes) * self.rows + r

    def wrow_of(self, bx, ty, tx, r):
        """Weight row of the thread's r-th loaded row (the up rows of a swiglu thread follow its gate rows)."""
        if self.swiglu:
            return self.row_of(bx, ty, tx, r % self.rows) + (r // self.rows) * self.n
        return self.row_of(bx, ty, tx, r)

    def unit_of(self, it, ty, tx):
        """The 16-byte unit of its rows the thread reads in iteration `it`."""
        return (it * self.ksplit + ty % self.ksplit) * self.lanes + tx % self.lanes


def _packed_accumulate(lay: _Layout, helper: str, x_per_word: int, groups: int | None = None,
                       units_per_group: int = 1, code_scale: float = 1.0):
    """Packed codes, 4 words a unit: each word against its `x_per_word` words of activations through `helper`,
    summed in fp16 per row (acc), then into the row's fp32 sum (accf). q4f16_1 (`groups` scales a row): a unit is
    one 32-code group, its scale applied here; int8 likewise, a group being `units_per_group` units and the helper's
    codes 1 / `code_scale` of their value; e4m3 (16 codes a unit, as value / 256; groups None): the row's scale,
    times 256, is applied once to the whole sum after the reduction."""
    from tvm.script import tirx as T

    def scale(sf, bx, ty, tx, r, it):
        s = T.Cast("float32", sf[lay.wrow_of(bx, ty, tx, r) * groups + lay.unit_of(it, ty, tx) // units_per_group]
                   if units_per_group > 1 else sf[lay.wrow_of(bx, ty, tx, r) * groups + lay.unit_of(it, ty, tx)])
        return s * T.float32(code_scale) if code_scale != 1.0 else s

    @T.macro
    def accumulate(sf, wl, xl, accf, acc, bx, ty, tx, it):
        for r in T.unroll(lay.rows_w):
            acc[r] = T.uint32(0)
        for c in T.unroll(4):
            for r in T.unroll(lay.rows_w):
                if x_per_word == 4:
                    acc[r] = T.call_pure_extern("uint32", helper, wl[r, c], xl[c * 4], xl[c * 4 + 1], xl[c * 4 + 2],
                                                xl[c * 4 + 3], acc[r])
                else:
                    acc[r] = T.call_pure_extern("uint32", helper, wl[r, c], xl[c * 2], xl[c * 2 + 1], acc[r])
        for r in T.unroll(lay.rows_w):
            if groups is None:
                accf[r] = accf[r] + T.call_pure_extern("float32", "mlcc_h2_sum", acc[r])
            elif lay.row_of(bx, ty, tx, r % lay.rows) < lay.n:
                accf[r] = accf[r] + T.call_pure_extern("float32", "mlcc_h2_sum", acc[r]) * scale(sf, bx, ty, tx, r, it)

    return accumulate


def _f16_accumulate(lay: _Layout):
    """float16: 8 weights per unit, multiplied and summed in fp32."""
    from tvm.script import tirx as T

    @T.macro
    def accumulate(sf, wl, xl, accf, acc, bx, ty, tx, it):
        for c in T.unroll(4):
            for r in T.unroll(lay.rows_w):
                accf[r] = T.call_pure_extern("float32", F16_HELPER, wl[r, c], xl[c], accf[r])

    return accumulate


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


def _stage_normalized_x(k: int, eps: float, warps: int, stage_words: int):
    """The q4 kernel's RMSNorm prologue: the block's threads read x once (into registers), sum its squares across the
    block, then write it rescaled to shared memory for every warp: one read of x per block and two barriers."""
    from tvm.script import tirx as T

    threads = warps * 32
    block_rms = block_rsqrt_macro(warps, k, eps)

    @T.macro
    def stage(xw, gw, xs, xr, rs, ssred, ty, tx):
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
                    "uint32", NORM_HELPER, xr[j], gw[ty * 32 + tx + j * threads], rs[0])
        T.evaluate(T.tvm_storage_sync("shared"))

    return stage


def _silu_times(gate, up):
    from tvm import tirx

    return gate * tirx.sigmoid(gate) * up


def _gelu_tanh_times(gate, up):
    from tvm import tirx

    inner = tirx.const(0.7978845608028654, "float32") * (gate + tirx.const(0.044715, "float32") * gate * gate * gate)
    return tirx.const(0.5, "float32") * gate * (tirx.const(1.0, "float32") + tirx.tanh(inner)) * up


def make_gemv(shape: GemvShape, pdl: bool = False) -> tvm.tirx.PrimFunc:
    """The hand-scheduled kernel for one projection, with the parameter order of TVM's fused function: x[, norm
    weight], W[, scales][, residual], out (for "swiglu": x[, norm weight], W[, scales], out). `pdl`: place the
    programmatic-dependent-launch wait after the first weight loads (sm_90+, see cuda_pdl)."""
    from tvm.script import tirx as T

    lay = _Layout.of(shape)
    n, k, epi = shape.n, shape.k, shape.epilogue
    # (a scheme's sizes are those q4_gemv.cuh / q8_gemv.cuh / e4m3_gemv.cuh are compiled for: q4_scheme refuses
    # any other)
    q = weight_scheme(shape.weights)
    e4m3, int8 = decodes_e4m3(q), decodes_int8(q)
    q = q if e4m3 or int8 or q is None else q4_scheme(shape.weights)
    q4 = q is not None and not e4m3 and not int8
    grouped = q4 or int8   # one scale per 32 codes
    swiglu, add = epi in GATED, epi == "add"
    act = _silu_times if epi == "swiglu" else _gelu_tanh_times
    n_w, units, rows, rows_w, lanes, ksplit = shape.weight_rows, lay.units, lay.rows, lay.rows_w, lay.lanes, lay.ksplit
    warps, slots, iters = lay.warps, lay.slots, lay.iters
    x_words = shape.unit // 2  # 32-bit words of x per unit
    groups = k // q.group_size if grouped else 1   # scales per weight row
    norm = shape.norm_eps is not None
    eps = float(shape.norm_eps or 0.0)
    # The RMSNorm prologue differs by weight format. float16 weights multiply in fp32, so they take x * g
    # un-normalized and scale each row by 1/rms(x) at the end ("deferred"): the sum of x² rides along as one more
    # accumulator, and no pass over x or barrier precedes the weight stream (a prologue pass left the 8B qkv
    # projection at 3.1 TB/s on an H200). The q4 kernel sums fp16 products of 32 codes, which un-normalized
    # activations (the residual stream reaches the thousands) could overflow: its blocks normalize x once into
    # shared memory ("staged"; normalizing per warp, 4 rows each, cost more than the ALU-bound kernel had to spare).
    # e4m3 and int8 sum fp16 products too: staged.
    defer = norm and q is None
    staged = norm and q is not None
    n_acc = rows_w + defer  # the accumulators a thread reduces: its rows [, the sum of x²]
    stage_words = -(-(k // 2) // (warps * 32)) if staged else 1  # 32-bit words of x a thread stages
    accumulate = _packed_accumulate(lay, Q4_HELPER, 4, groups) if q4 else \
        _packed_accumulate(lay, Q8_HELPER, 2, groups, q.group_size // shape.unit, 128.0) if int8 else \
        _packed_accumulate(lay, E4M3_HELPER, 2) if e4m3 else _f16_accumulate(lay)
    stage_normalized_x = _stage_normalized_x(k, eps, warps, stage_words) if staged else None
    # the weights a thread loads past the last row: every code zero_code (zero), or 0
    out_of_range = sum(q.zero_code << (i * q.bits) for i in range(q.per_word)) if grouped else 0
    row_of, wrow_of, unit_of = lay.row_of, lay.wrow_of, lay.unit_of
    out_dtype = shape.out_dtype
    w_shape, w_dtype = ((n_w, k // q.per_word), q.storage_dtype) if q is not None else ((n_w, k), "float16")
    s_shape, s_dtype = (q.scale_shape(n_w, k), q.scale_dtype) if q is not None else ((n_w, groups), "float16")

    @T.macro
    def load_weights(ww, wl, bx, ty, tx, it):
        for r in T.unroll(rows_w):
            if row_of(bx, ty, tx, r % rows) < n:
                for v in T.vectorized(4):
                    wl[r, v] = ww[wrow_of(bx, ty, tx, r) * (units * 4) + unit_of(it, ty, tx) * 4 + v]
            else:
                for v in T.vectorized(4):
                    wl[r, v] = T.uint32(out_of_range)

    @T.macro
    def dot_rows(xw, gw, ww, sf, xs, xl, wl, acc, accf, bx, ty, tx):
        # each thread's partial sums of its rows over the units it reads (iteration 0's weights already in wl)
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
                if it > 0:
                    load_weights(ww, wl, bx, ty, tx, it)
                accumulate(sf, wl, xl, accf, acc, bx, ty, tx, it)

    @T.macro
    def reduce_and_store(sf, rf, out, accf, red, bx, ty, tx):
        # each row summed over its lanes and its K-split warps, then the epilogue applied and written
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
        if e4m3:
            for r in T.unroll(rows_w):
                if row_of(bx, ty, tx, r % rows) < n:
                    accf[r] = accf[r] * (sf[wrow_of(bx, ty, tx, r)] * T.float32(256))
        for r in T.unroll(rows):
            if tx % lanes == 0 and ty % ksplit == 0 and row_of(bx, ty, tx, r) < n:
                if add:
                    out[0, 0, row_of(bx, ty, tx, r)] = T.Cast("float16", accf[r]) + rf[row_of(bx, ty, tx, r)]
                elif swiglu:
                    # silu(gate) * up from the fp16-rounded projections, as the unfused kernels
                    out[0, 0, row_of(bx, ty, tx, r)] = T.Cast("float16", act(
                        T.Cast("float32", T.Cast("float16", accf[r])),
                        T.Cast("float32", T.Cast("float16", accf[r + rows]))))
                else:
                    out[0, 0, row_of(bx, ty, tx, r)] = T.Cast(out_dtype, T.Cast("float16", accf[r]))

    @T.macro
    def body(x, g, w, s, res, out):
        xw = T.decl_buffer((k // 2,), "uint32", data=x.data)
        gw = T.decl_buffer((k // 2,), "uint32", data=g.data)  # unread without the norm prologue
        ww = T.decl_buffer((n_w * units * 4,), "uint32", data=w.data)
        sf = T.decl_buffer((n_w * groups,), s_dtype, data=s.data)  # unread for float16 weights
        rf = T.decl_buffer((n,), "float16", data=res.data)  # unread unless epilogue == "add"
        for bx in T.thread_binding(lay.blocks, thread="blockIdx.x"):
            for ty in T.thread_binding(warps, thread="threadIdx.y"):
                for tx in T.thread_binding(32, thread="threadIdx.x"):
                    with T.sblock("gemv"):
                        T.reads()
                        T.writes()
                        # (the lowering drops the buffers a variant does not use)
                        xl = T.sblock_alloc_buffer((x_words,), "uint32", scope="local")
                        wl = T.sblock_alloc_buffer((rows_w, 4), "uint32", scope="local")
                        acc = T.sblock_alloc_buffer((rows_w,), "uint32", scope="local")
                        accf = T.sblock_alloc_buffer((n_acc,), "float32", scope="local")
                        red = T.sblock_alloc_buffer((warps, slots, n_acc), "float32", scope="shared")
                        rs = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        ssred = T.sblock_alloc_buffer((warps, slots), "float32", scope="shared")
                        xs = T.sblock_alloc_buffer((k // 2 if staged else 1,), "uint32", scope="shared")
                        xr = T.sblock_alloc_buffer((stage_words,), "uint32", scope="local")
                        # the first weights do not depend on the previous kernel: with PDL they load while it
                        # finishes (cuda_pdl), the activations only after the wait
                        if unit_of(0, ty, tx) < units:
                            load_weights(ww, wl, bx, ty, tx, 0)
                        if pdl:
                            T.evaluate(T.call_extern("void", cuda_pdl.WAIT))
                            T.evaluate(T.call_extern("void", cuda_pdl.LAUNCH_DEPENDENTS))
                        if staged:
                            stage_normalized_x(xw, gw, xs, xr, rs, ssred, ty, tx)
                        dot_rows(xw, gw, ww, sf, xs, xl, wl, acc, accf, bx, ty, tx)
                        reduce_and_store(sf, rf, out, accf, red, bx, ty, tx)

    # TVMScript has no optional parameters: write the kernel with all six, then keep only those this shape reads
    # (the body is given an alias, x or W or out, for each one it does not read)
    x_shape, g_shape, r_shape = (1, 1, k), (k,), shape.residual_shape or (1, 1, n)

    @T.prim_func(private=True, s_tir=True)
    def full(x: T.Buffer(x_shape, "float16"), g: T.Buffer(g_shape, "float16"), w: T.Buffer(w_shape, w_dtype),
             s: T.Buffer(s_shape, s_dtype), res: T.Buffer(r_shape, "float16"), out: T.Buffer((1, 1, n), out_dtype)):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        body(x, g if norm else x, w, s if q is not None else w, res if add else out, out)

    x_p, g_p, w_p, s_p, res_p, out_p = full.params
    params = [x_p] + [g_p] * norm + [w_p] + [s_p] * (q is not None) + [res_p] * add + [out_p]
    return tvm.tirx.PrimFunc(params, full.body, attrs=full.attrs)


def decode_gemv_pass(pdl: bool) -> tvm.transform.Pass:
    """Swap every batch-1 decode projection for the hand-written kernel (before dlight sees it); `pdl`: the kernels
    place their own PDL wait (cuda_pdl.enabled)."""

    @tvm.transform.module_pass(opt_level=0, name="mlcc_cuda_decode_gemv")
    def _pass(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        replaced = 0
        for gv, func in list(mod.functions.items()):
            if not is_unscheduled_prim_func(func):
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

    return _pass

"""The mixture-of-experts decode GEMV for CUDA on q4 experts (cuda/moe_gemv.cuh), in place of the portable TIR
kernel (relax_models/moe_kernels.expert_gemv_warp) that Metal, WebGPU and ROCm keep.

The TIR kernel unpacks one nibble at a time (~7 ALU ops per 4-bit code) and sums a row's lanes through shared
memory; on an H200 that held the Qwen3-30B-A3B expert GEMVs to 0.5-0.7 TB/s. This one is the dense decode GEMV's
recipe (cuda_gemv) on the stacked [E, rows, K/8] layout: two codes per HFMA2 (mlcc_q4x8_hfma2_s1), one 16-byte load
per lane per 32-code scale group, a row's lanes summed by warp shuffles. A batch-1 expert GEMV is a few MB read
once, so what bounds it is how many bytes are in flight: each lane issues all its loads of a chunk (up to
MAX_LOADS 16-byte loads) before their math, and a thread owns up to 4 rows (launch_layout) while the grid keeps
thousands of warps.

The expert id is read on the device (ids never leave it); the weight addresses depend on it, so nothing is
loaded before the PDL wait the kernel pass puts at the top.
"""

from __future__ import annotations

import dataclasses
import logging

import tvm

from mlcc.quantization import TAG, Quantization

from .cuda_source import decodes_q4, q4_scheme
from .gemv_match import tagged_scheme

log = logging.getLogger(__name__)

HELPER = "mlcc_moe_gemv"
ATTR = "mlcc.moe_expert_gemv"  # = moe_kernels.EXPERT_GEMV_ATTR (schedules import no model code); the scheme: TAG
WARPS = 4                      # warps per block (MLCC_MOE_WARPS in the header)
MAX_LOADS = 16                 # 16-byte weight loads a lane has in flight (64 registers)
MIN_WARPS = 2048               # more rows a thread only while the grid keeps this many warps


@dataclasses.dataclass(frozen=True)
class MoeGemv:
    """One expert GEMV: out[j, :n] from x [rows_x, kdim] and expert ids[j] for j < k (k: selected experts)."""

    kdim: int
    n: int
    k: int
    rows_x: int
    swiglu: bool
    experts: int

    @property
    def scheme(self) -> Quantization:
        """The layout read: every scheme the q4 code decodes has the same (cuda_source.decodes_q4)."""
        return q4_scheme()

    @property
    def units(self) -> int:
        """16-byte units (scale groups) per weight row."""
        return self.kdim // self.scheme.group_size

    @property
    def w_rows(self) -> int:
        return 2 * self.n if self.swiglu else self.n


@dataclasses.dataclass(frozen=True)
class MoeLayout:
    lanes: int   # lanes per row set
    rows: int    # output rows per set (a swiglu set loads 2x as many weight rows)
    chunk: int   # units per row a lane loads before their math

    def warps(self, shape: MoeGemv) -> int:
        return -(-(shape.k * shape.n // self.rows) // (32 // self.lanes))

    def blocks(self, shape: MoeGemv) -> int:
        return -(-self.warps(shape) // WARPS)


def _lanes(units: int) -> int:
    """The lane count (32, 16, 8 or 4) that leaves fewest lanes idle on the last unit round; the widest of those
    (K=768's 24 units: 8 lanes of 3 units each rather than 16 with half of them idle on the second)."""
    def idle(lanes: int) -> int:
        return -(-units // lanes) * lanes - units

    return min((32, 16, 8, 4), key=lambda lanes: (idle(lanes), -lanes))


def launch_layout(shape: MoeGemv) -> MoeLayout:
    """As many rows a thread (4, 2 or 1) as keep a chunk of loads within MAX_LOADS and the grid at MIN_WARPS; the
    lane's units then split evenly into chunks of at most MAX_LOADS loads. On an H200 with the weights out of L2,
    more loads in flight a thread beat more warps: Mixtral's down 38 -> 21 us from 1 to 4 rows, its gate_up 41 ->
    35 us from 1 to 2, Qwen3-30B-A3B's down 6.0 -> 4.5 us from 1 to 2."""
    lanes = _lanes(shape.units)
    iters = -(-shape.units // lanes)
    per_row = 2 if shape.swiglu else 1
    # (a chunk of 4 units, or all of a lane's when fewer, must fit MAX_LOADS)
    rows = next(r for r in (4, 2, 1) if r == 1 or (
        shape.n % r == 0 and r * per_row * min(iters, 4) <= MAX_LOADS
        and MoeLayout(lanes, r, 1).warps(shape) >= MIN_WARPS))
    rows_w = rows * per_row
    chunks = -(-iters * rows_w // MAX_LOADS)  # rounds of loads, the units split evenly over them
    return MoeLayout(lanes, rows, -(-iters // chunks))


def template_call(shape: MoeGemv, lay: MoeLayout | None = None) -> str:
    lay = lay or launch_layout(shape)
    return (f"{HELPER}<{shape.kdim}, {shape.n}, {shape.k}, {shape.rows_x}, {'true' if shape.swiglu else 'false'}, "
            f"{lay.lanes}, {lay.rows}, {lay.chunk}>")


def make_moe_gemv(shape: MoeGemv, lay: MoeLayout | None = None) -> tvm.tirx.PrimFunc:
    """The PrimFunc that replaces expert_gemv_warp's in place: parameters x, ids, W, scales, out with its buffer
    shapes; one launch of the templated kernel."""
    from tvm.script import tirx as T

    lay = lay or launch_layout(shape)
    call = template_call(shape, lay)
    q = shape.scheme
    x_shape, w_shape = (shape.rows_x, shape.kdim), (shape.experts, shape.w_rows, shape.kdim // q.per_word)
    s_shape, out_shape = (shape.experts, shape.w_rows, shape.units), (shape.k, shape.n)
    blocks, k = lay.blocks(shape), shape.k

    @T.prim_func(private=True, s_tir=True)
    def func(x_h: T.handle, ids_h: T.handle, w_h: T.handle, s_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        x = T.match_buffer(x_h, x_shape, "float16")
        ids = T.match_buffer(ids_h, (k,), "int32")
        w = T.match_buffer(w_h, w_shape, q.storage_dtype)
        s = T.match_buffer(s_h, s_shape, q.scale_dtype)
        out = T.match_buffer(out_h, out_shape, "float16")
        for bx in T.thread_binding(blocks, thread="blockIdx.x"):
            for tx in T.thread_binding(WARPS * 32, thread="threadIdx.x"):
                with T.sblock("moe_gemv"):
                    T.reads()
                    T.writes()
                    T.evaluate(T.call_extern("void", call, x.data, ids.data, w.data, s.data, out.data))

    return func


def match_expert_gemv(func) -> MoeGemv | None:
    """The shape of an expert GEMV PrimFunc that takes this kernel (experts in a scheme the q4 code decodes, float16
    activations), else None."""
    if not isinstance(func, tvm.tirx.PrimFunc) or func.attrs is None or ATTR not in func.attrs:
        return None
    info, q = func.attrs[ATTR], tagged_scheme(func)
    if not decodes_q4(q) or str(info["dtype"]) != "float16":
        return None
    if len(func.params) != 5:
        return None
    x, ids, w, _s, out = func.params
    rows_x, kdim = (int(d) for d in x.shape)
    experts, w_rows = int(w.shape[0]), int(w.shape[1])
    (k,), (_, n) = (int(d) for d in ids.shape), (int(d) for d in out.shape)
    swiglu = bool(info["swiglu"])
    if kdim % q.group_size or w_rows != (2 * n if swiglu else n) or rows_x not in (1, k):
        return None
    return MoeGemv(kdim, n, k, rows_x, swiglu, experts)


def moe_expert_gemv_pass() -> tvm.transform.Pass:
    """Swap every q4 expert GEMV (the decode MoE) for the hand-written kernel."""

    @tvm.transform.module_pass(opt_level=0, name="mlcc_cuda_moe_expert_gemv")
    def _pass(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        replaced = 0
        for gv, func in list(mod.functions.items()):
            shape = match_expert_gemv(func)
            if shape is None:
                continue
            # (the marker dropped: the replacement is not matched again)
            attrs = {k: v for k, v in func.attrs.items() if k not in (ATTR, TAG)}
            mod[gv] = make_moe_gemv(shape).with_attrs(attrs)
            replaced += 1
        log.debug("MoE expert GEMV kernels: %d", replaced)
        return mod

    return _pass


def kernel_name(shape: MoeGemv, lay: MoeLayout | None = None) -> str:
    lay = lay or launch_layout(shape)
    return (f"mlcc_moe_gemv_k{shape.kdim}_n{shape.n}_e{shape.k}_x{shape.rows_x}{'_swiglu' if shape.swiglu else ''}"
            f"_l{lay.lanes}_r{lay.rows}_c{lay.chunk}")


def kernel_source(shape: MoeGemv, lay: MoeLayout | None = None, with_header: bool = True) -> str:
    """A standalone kernel: name(x, ids, W, S, out), `lay.blocks(shape)` blocks of WARPS * 32 threads, no shared
    memory (the NVRTC tests and benchmarks compile exactly this)."""
    from .cuda_source import HELPER_DIR

    head = "".join((HELPER_DIR / f).read_text() for f in ("q4_gemv.cuh", "moe_gemv.cuh")) if with_header else ""
    return (f"{head}\nextern \"C\" __global__ void __launch_bounds__({WARPS * 32}) {kernel_name(shape, lay)}("
            "const half* x, const int* ids, const unsigned* w, const half* s, half* out) {\n"
            f"  {template_call(shape, lay)}(x, ids, w, s, out);\n}}\n")

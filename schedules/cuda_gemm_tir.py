"""The tensor-core prefill GEMM (cuda_gemm, cuda/tc_gemm.cuh) in a compiled model: which of TVM's fused PrimFuncs
are many-token projections with float16 activations, and the PrimFunc that replaces one in place (same parameters)
with a single launch of the templated kernel.

A projection matches when its activations are (1, m, K) or (m, 1, K) with m symbolic (prefill, batched calls):
batch-1 decode has a static (1, 1, K) and keeps its GEMV kernel. Weights are q4f16_1 (dequantize → matmul) or
float16 (NT_matmul); the epilogue TVM fused into it is none, + bias[n] or + a residual shaped like the output.
"""

from __future__ import annotations

import dataclasses
import logging

import tvm
from tvm import tirx

from .cuda_gemm import (
    MID_BLOCKS,
    REDUCE_THREADS,
    SMALL_M,
    GemmParams,
    default_params,
    few_token_params,
    is_q4,
    mid_params,
    reads,
    reduce_call,
    supported,
    template_call,
)
from .cuda_source import q4_scheme

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PrefillGemm:
    n: int              # output features (rows of W)
    k: int              # input features
    x_shape: tuple      # (1, m, K) or (m, 1, K), m symbolic
    weights: str        # a scheme the q4 path decodes (cuda_source.decodes_q4) | "float16"
    epilogue: str       # "none" | "bias" | "add"

    @property
    def m(self) -> tirx.Var:
        from .gemv_match import token_dim

        return token_dim(self.x_shape)


def match_prefill_gemm(func: tirx.PrimFunc) -> PrefillGemm | None:
    """The shape of a many-token float16 projection, or None for anything else."""
    from .gemv_match import match_many_token_projection

    found = match_many_token_projection(func, "float16")
    return PrefillGemm(*found) if found is not None and reads(found[3]) else None


def make_prefill_gemm(shape: PrefillGemm, params: GemmParams, few: GemmParams | None = None,
                      mid: GemmParams | None = None) -> tirx.PrimFunc:
    """One launch of the templated kernel with the parameters of TVM's fused function: x, W[, scales][, bias or
    residual], y. Grid: N / bn blocks by ceil(m / bm). With `few` (split-K parameters), up to SMALL_M tokens take
    that kernel instead, its partials in a workspace and a second kernel summing them; with `mid`, token counts
    for which `params` would launch fewer than MID_BLOCKS blocks take `mid`'s smaller tiles."""
    from tvm.script import tirx as T

    n, k, p, m = shape.n, shape.k, params, shape.m
    q4 = is_q4(shape.weights)
    q = q4_scheme(shape.weights) if q4 else None
    x_shape = tuple(shape.x_shape)
    y_shape = x_shape[:-1] + (T.int64(n),)
    w_shape, w_dtype = ((T.int64(n), T.int64(k // q.per_word)), q.storage_dtype) if q4 else \
        ((T.int64(n), T.int64(k)), "float16")
    s_shape = (T.int64(n), T.int64(k // q.group_size if q4 else 1))  # (float16: no scales)
    r_shape = (T.int64(n),) if shape.epilogue == "bias" else y_shape
    m_blocks = (m + (p.bm - 1)) // p.bm

    def tiles(t: GemmParams, name: str):
        """One launch of the kernel with tile parameters `t` (block `name`)."""
        t_call, t_smem = template_call(shape.weights, shape.epilogue, t), t.smem_bytes(q4)

        @T.macro
        def launch(x, w, s, r, y):
            for bx in T.thread_binding(n // t.bn, thread="blockIdx.x"):
                for by in T.thread_binding((m + (t.bm - 1)) // t.bm, thread="blockIdx.y"):
                    for tx in T.thread_binding(t.threads, thread="threadIdx.x"):
                        with T.sblock(name):
                            T.reads()
                            T.writes()
                            # TVM launches the kernel with this much dynamic shared memory (opting in past 48 KB)
                            smem = T.alloc_buffer((t_smem,), "uint8", scope="shared.dyn")
                            T.evaluate(T.call_extern("void", t_call, x.data, w.data, s.data, r.data, y.data,
                                                     T.Cast("int32", m), T.int32(n), T.int32(k), smem.data))

        return launch

    big_tiles = tiles(p, "tc_gemm")
    if mid is None:
        tiled = big_tiles
    else:
        mid_tiles = tiles(mid, "tc_gemm_mid")

        @T.macro
        def tiled(x, w, s, r, y):
            if (n // p.bn) * m_blocks < MID_BLOCKS:
                mid_tiles(x, w, s, r, y)
            else:
                big_tiles(x, w, s, r, y)

    if few is None:
        body = tiled
    else:
        f = few
        few_call, reduce = template_call(shape.weights, shape.epilogue, f), reduce_call(shape.epilogue, f)
        few_smem = f.smem_bytes(q4)
        reduce_blocks = (m * n // 2 + (REDUCE_THREADS - 1)) // REDUCE_THREADS

        @T.macro
        def body(x, w, s, r, y):
            if m <= SMALL_M:
                part = T.alloc_buffer((f.split * m * n,), "float32", scope="global")
                for bx in T.thread_binding(n // f.bn, thread="blockIdx.x"):
                    for by in T.thread_binding((m + (f.bm - 1)) // f.bm, thread="blockIdx.y"):
                        for bz in T.thread_binding(f.split, thread="blockIdx.z"):
                            for tx in T.thread_binding(f.threads, thread="threadIdx.x"):
                                with T.sblock("tc_gemm_split"):
                                    T.reads()
                                    T.writes()
                                    smem = T.alloc_buffer((few_smem,), "uint8", scope="shared.dyn")
                                    T.evaluate(T.call_extern(
                                        "void", few_call, x.data, w.data, s.data, r.data, y.data,
                                        T.Cast("int32", m), T.int32(n), T.int32(k), smem.data, part.data))
                for bx in T.thread_binding(reduce_blocks, thread="blockIdx.x"):
                    for tx in T.thread_binding(REDUCE_THREADS, thread="threadIdx.x"):
                        with T.sblock("tc_gemm_reduce"):
                            T.reads()
                            T.writes()
                            T.evaluate(T.call_extern("void", reduce, part.data, r.data, y.data,
                                                     T.Cast("int32", m), T.int32(n)))
            else:
                tiled(x, w, s, r, y)

    attrs = {"tirx.noalias": True, "tirx.is_scheduled": True}
    epi = shape.epilogue != "none"

    # TVMScript has no optional parameters: the kernel is written with all five (x, W, scales, bias or residual,
    # y), then keeps those this shape has; the call reads x in place of the others
    @T.prim_func(private=True, s_tir=True)
    def full(x: T.Buffer(x_shape, "float16"), w: T.Buffer(w_shape, w_dtype), s: T.Buffer(s_shape, "float16"),
             r: T.Buffer(r_shape, "float16"), y: T.Buffer(y_shape, "float16")):
        T.func_attr(attrs)
        body(x, w, s if q4 else x, r if epi else x, y)

    x_p, w_p, s_p, r_p, y_p = full.params
    return tirx.PrimFunc([x_p, w_p] + [s_p] * q4 + [r_p] * epi + [y_p], full.body, attrs=full.attrs)


# Projections with a side under this keep dlight's GEMM: on the Qwen2.5-0.5B shape (896 wide) this kernel made a
# 512-token prefill slower (38k vs 49k tok/s on an H200); from Llama-3-8B's 4096 up it is faster (bench/results).
MIN_SIDE = 2048


def params_for(shape: PrefillGemm, sm: int, params: GemmParams | None = None) -> GemmParams | None:
    """The parameters to build `shape` with on SM version `sm` (None: the kernel does not apply)."""
    q4 = is_q4(shape.weights)
    if params is None and min(shape.n, shape.k) < MIN_SIDE:
        return None
    # N not a multiple of the default tile: the 64-column tile
    for p in [params] if params is not None else [default_params(shape.weights, sm=sm), GemmParams(128, 64, 2, 2, 4)]:
        if p.valid(q4, sm) and supported(shape.n, shape.k, p, shape.epilogue):
            return p
    return None


def prefill_gemm_pass(sm: int) -> tvm.transform.Pass:
    """Swap every many-token float16 projection for the tensor-core kernel (before dlight sees it)."""

    @tvm.transform.module_pass(opt_level=0, name="mlcc_cuda_prefill_gemm")
    def _pass(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        from .gemv_match import is_unscheduled_prim_func

        replaced = 0
        for gv, func in list(mod.functions.items()):
            if not is_unscheduled_prim_func(func):
                continue
            shape = match_prefill_gemm(func)
            p = params_for(shape, sm) if shape is not None else None
            if p is None:
                continue
            few = params_for(shape, sm, few_token_params(shape.n, shape.k, shape.weights, sm))
            mid = params_for(shape, sm, mid_params(shape.weights, sm))
            new = make_prefill_gemm(shape, p, few if few is not None and few.split > 1 else None,
                                    mid if mid != p else None)
            attrs = {k: v for k, v in func.attrs.items()} if func.attrs is not None else {}
            mod[gv] = new.with_attrs(attrs).with_attr("tirx.is_scheduled", True)
            replaced += 1
        log.debug("tensor-core prefill GEMMs: %d", replaced)
        return mod

    return _pass

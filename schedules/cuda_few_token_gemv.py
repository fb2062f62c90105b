"""q4f16_1 projections over a few tokens on CUDA (a speculative verify, a batched decode of a few streams) as a GEMV
that reads each weight once for all of them (cuda/q4_gemv_tokens.cuh), instead of a GEMM tile mostly empty.

A 5-token verify of the Llama-3-8B shape spent 9 ms in its projections through the split-K tensor-core GEMM on an
H200 (0.5 TB/s of weights) where one decode step's GEMVs stream the same 4.5 GB in about 1.3 ms. The pass puts a
host function in the place of each many-token q4 projection (same parameters) that calls the GEMV for up to
FEW_TOKENS tokens and the projection as it was otherwise: the original is kept under a name of its own, so the
tensor-core GEMM pass or dlight schedules it afterwards as before. Both are functions of the same library, called
directly (call_cpacked).
"""

from __future__ import annotations

import logging

import tvm

from mlcc.quantization import weight_scheme

from .cuda_source import decodes_q4, q4_scheme
from .gemv_match import is_unscheduled_prim_func, match_many_token_projection, token_dim
from .host_dispatch import host_dispatch

log = logging.getLogger(__name__)

FEW_TOKENS = 8          # tokens the GEMV takes (its accumulators are TOK x ROWS per lane)
HELPER = "mlcc_q4_gemv_tokens"
EPILOGUES = {"none": 0, "bias": 1, "add": 2, "cast": 3}  # cast: float32 out (an LM head over several positions)
WARPS = 4               # per block
WARPS_WANTED = 4096     # as the decode GEMV: enough loads in flight for an H100/H200


def rows_per_warp(n: int, k: int) -> int:
    """Two rows a warp where that still leaves WARPS_WANTED warps and a lane's loads stay few (registers)."""
    iters = -(-(k // q4_scheme().group_size) // 32)  # a lane's 16-byte loads (one scale group each) of a row
    return 2 if n // 2 >= WARPS_WANTED and iters <= 4 else 1


def template_call(n: int, k: int, epilogue: str) -> str:
    return f"{HELPER}<{k}, {FEW_TOKENS}, {rows_per_warp(n, k)}, {EPILOGUES[epilogue]}>"


def blocks(n: int, k: int) -> int:
    return -(-n // (WARPS * rows_per_warp(n, k)))


def supported(n: int, k: int, weights: str) -> bool:
    q = weight_scheme(weights)
    return decodes_q4(q) and k % q.group_size == 0 and n > 0


def _signature(x_shape, n: int, k: int, epilogue: str, weights: str | None = None):
    """(x, W, scales[, bias or residual], y) buffer shapes of a many-token projection in q4 scheme `weights`."""
    from tvm.script import tirx as T

    q = q4_scheme(weights)
    y_shape = tuple(x_shape[:-1]) + (T.int64(n),)
    shapes = [(tuple(x_shape), "float16"), ((T.int64(n), T.int64(k // q.per_word)), q.storage_dtype),
              ((T.int64(n), T.int64(k // q.group_size)), q.scale_dtype)]
    if epilogue in ("bias", "add"):
        shapes.append(((T.int64(n),) if epilogue == "bias" else y_shape, "float16"))
    return shapes + [(y_shape, "float32" if epilogue == "cast" else "float16")]


def make_few_token_gemv(x_shape, n: int, k: int, epilogue: str, weights: str | None = None) -> tvm.tirx.PrimFunc:
    """The kernel for up to FEW_TOKENS tokens, with the projection's parameters (weights: its q4 scheme)."""
    from tvm.script import tirx as T

    m = token_dim(x_shape)
    call, grid = template_call(n, k, epilogue), blocks(n, k)
    attrs = {"tirx.noalias": True, "tirx.is_scheduled": True}

    @T.macro
    def body(x, w, s, r, y):
        for bx in T.thread_binding(grid, thread="blockIdx.x"):
            for tx in T.thread_binding(WARPS * 32, thread="threadIdx.x"):
                with T.sblock("q4_gemv_tokens"):
                    T.reads()
                    T.writes()
                    T.evaluate(T.call_extern("void", call, x.data, w.data, s.data, r.data, y.data,
                                             T.Cast("int32", m), T.int32(n)))

    (xs, _), (ws, wt), (ss, st), *rest = _signature(x_shape, n, k, epilogue, weights)
    ys, yt = rest[-1]
    has_r = len(rest) == 2
    rs = rest[0][0] if has_r else (T.int64(1),)

    # TVMScript has no optional parameters: the kernel is written with all five, then keeps those the shape has
    @T.prim_func(private=True, s_tir=True)
    def full(x: T.Buffer(xs, "float16"), w: T.Buffer(ws, wt), s: T.Buffer(ss, st),
             r: T.Buffer(rs, "float16"), y: T.Buffer(ys, yt)):
        T.func_attr(attrs)
        body(x, w, s, r if has_r else x, y)

    x_p, w_p, s_p, r_p, y_p = full.params
    return tvm.tirx.PrimFunc([x_p, w_p, s_p] + [r_p] * has_r + [y_p], full.body, attrs=full.attrs)


def few_token_gemv_pass() -> tvm.transform.Pass:
    """Every many-token q4 projection behind a dispatch to the few-token GEMV (before the GEMM pass)."""

    @tvm.transform.module_pass(opt_level=0, name="mlcc_cuda_few_token_gemv")
    def _pass(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        replaced = 0
        for gv, func in list(mod.functions.items()):
            if not is_unscheduled_prim_func(func):
                continue
            found = match_many_token_projection(func, "float16", cast=True)
            if found is None:
                continue
            n, k, x_shape, weights, epilogue = found
            if not supported(n, k, weights):
                continue
            name = gv.name_hint
            few, many = f"{name}_few_tokens", f"{name}_many_tokens"
            kernel = make_few_token_gemv(x_shape, n, k, epilogue, weights)
            mod[tvm.ir.GlobalVar(few)] = kernel.with_attr("global_symbol", few)
            mod[tvm.ir.GlobalVar(many)] = func.with_attr("global_symbol", many)
            attrs = {a: v for a, v in func.attrs.items()} if func.attrs is not None else {}
            mod[gv] = host_dispatch(func, token_dim(x_shape), FEW_TOKENS, few, many, {**attrs, "global_symbol": name})
            replaced += 1
        log.debug("few-token GEMV dispatches: %d", replaced)
        return mod

    return _pass

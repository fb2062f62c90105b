"""CPU batch-1 decode GEMV for 8-bit group schemes (q8f32_1, q8f16_1), written by hand in TIR and put in place of
TVM's fused PrimFunc.

schedules/cpu.py's generic rule vectorizes the reduction over 16 consecutive codes; for 8-bit codes each lane then
reads its own uint32 word (`w[i, j // 4] >> 8 (j % 4) & 255`), which LLVM emits as 16 chained masked scalar loads
per vector: ~40x slower than the same rule on 4-bit codes. The codes are bytes in memory order (four to a
little-endian word), so this kernel reads the words through a uint8 view of the same buffer: 16 codes are one
contiguous vector load, zero-extended and converted, with no gather. Per row: 16 lanes of partial sums per group
of 32 codes, scaled once per group, then summed across lanes; tasks of ROWS rows are the parallel loop.

It keeps the fused function's parameters and epilogue (none, `+ residual`, `+ bias`, or a cast of the output:
the float16 LM head's float32 logits), so it replaces it in place.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import tirx
from tvm.script import tirx as T

from mlcc.quantization import Quantization, weight_scheme

from .gemv_match import _blocks, _static_ints, tagged_scheme

LANES = 16
# Rows per parallel task: its scratch (16-lane sums) is allocated once per task through TVM's workspace pool,
# which per row cost more than the row's arithmetic (three pool calls for a 576-code row).
ROWS = 16


@dataclasses.dataclass(frozen=True)
class Int8GemvShape:
    n: int
    k: int
    weights: str          # an 8-bit group scheme (decodes)
    epilogue: str = "none"   # "none" | "add" (residual (1, 1, n)) | "bias" ((n,)) | "cast" (output to float32)


def decodes(q: Quantization | None) -> bool:
    """Whether this kernel reads scheme `q`: symmetric 8-bit codes, four a uint32 word, whole 16-code vectors to a
    group."""
    return q is not None and (q.kind, q.bits, q.storage_dtype, q.symmetric) == ("group", 8, "uint32", True) and \
        q.group_size % LANES == 0


def match_int8_gemv(func: tirx.PrimFunc) -> Int8GemvShape | None:
    """The shape of a batch-1 projection over (1, 1, K) activations whose weights are in a scheme this kernel
    decodes, [→ + residual or bias | → cast], or None."""
    blocks = _blocks(func)
    if blocks is None or not {"dequantize", "matmul"} <= set(blocks):
        return None
    q = tagged_scheme(func, blocks["dequantize"])
    extra = set(blocks) - {"dequantize", "matmul"}
    if not decodes(q) or not extra <= {"T_add", "compute"} or len(extra) > 1:
        return None
    shapes = [_static_ints(p.shape) for p in func.params]
    dtypes = [str(p.dtype) for p in func.params]
    if None in shapes or len(shapes) not in (4, 5) or len(shapes[1]) != 2:
        return None
    n, k = shapes[1][0], shapes[1][1] * q.per_word
    d = q.model_dtype
    if shapes[:3] != [(1, 1, k), (n, k // q.per_word), (n, k // q.group_size)] or k % q.group_size or \
            dtypes[:3] != [d, q.storage_dtype, q.scale_dtype] or shapes[-1] != (1, 1, n):
        return None
    if extra == {"compute"}:   # the LM head's cast to float32 logits
        value = blocks["compute"].body.value
        if len(shapes) != 4 or not isinstance(value, tvm.tirx.Cast) or dtypes[-1] != "float32":
            return None
        return Int8GemvShape(n, k, q.name, "cast")
    if dtypes[-1] != d:
        return None
    if not extra:
        return Int8GemvShape(n, k, q.name) if len(shapes) == 4 else None
    if len(shapes) != 5 or dtypes[3] != d or shapes[3] not in ((1, 1, n), (n,)) or \
            not isinstance(blocks["T_add"].body.value, tvm.tirx.Add):
        return None
    return Int8GemvShape(n, k, q.name, "bias" if shapes[3] == (n,) else "add")


def make_int8_gemv(shape: Int8GemvShape) -> tirx.PrimFunc:
    q = weight_scheme(shape.weights)
    n, k, g, d = shape.n, shape.k, q.group_size, q.model_dtype
    out_dtype = "float32" if shape.epilogue == "cast" else d
    add = shape.epilogue in ("add", "bias")
    r_shape = (n,) if shape.epilogue == "bias" else (1, 1, n)
    zero = float(q.zero_code)

    @T.macro
    def body(x, w, s, r, y):
        wb = T.decl_buffer((n * k,), "uint8", data=w.data)   # the words' bytes: code j of row i at i * k + j
        xf = T.decl_buffer((k,), d, data=x.data)
        rf = T.decl_buffer((n,), d, data=r.data)
        for task in T.parallel(-(-n // ROWS)):
            with T.sblock("rows"):
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((LANES,), "float32", scope="local")
                part = T.sblock_alloc_buffer((LANES,), "float32", scope="local")
                total = T.sblock_alloc_buffer((1,), "float32", scope="local")
                for row in T.serial(ROWS):
                    if task * ROWS + row < n:
                        for v in T.vectorized(LANES):
                            acc[v] = T.float32(0)
                        for grp in T.serial(k // g):
                            for v in T.vectorized(LANES):
                                part[v] = T.float32(0)
                            for h in T.unroll(g // LANES):
                                for v in T.vectorized(LANES):
                                    part[v] = part[v] + T.Cast("float32", xf[grp * g + h * LANES + v]) * (T.Cast(
                                        "float32", wb[(task * ROWS + row) * k + grp * g + h * LANES + v])
                                        - T.float32(zero))
                            for v in T.vectorized(LANES):
                                acc[v] = acc[v] + part[v] * T.Cast("float32", s[task * ROWS + row, grp])
                        total[0] = T.float32(0)
                        for v in T.serial(LANES):
                            total[0] = total[0] + acc[v]
                        if add:
                            y[0, 0, task * ROWS + row] = T.Cast(d, total[0]) + rf[task * ROWS + row]
                        else:
                            y[0, 0, task * ROWS + row] = T.Cast(out_dtype, T.Cast(d, total[0]))

    x_t, w_t, s_t = (1, 1, k), (n, k // q.per_word), (n, k // g)
    if add:
        @T.prim_func(private=True, s_tir=True)
        def gemv(x: T.Buffer(x_t, d), w: T.Buffer(w_t, "uint32"), s: T.Buffer(s_t, q.scale_dtype),
                 r: T.Buffer(r_shape, d), y: T.Buffer((1, 1, n), out_dtype)):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            body(x, w, s, r, y)
    else:
        @T.prim_func(private=True, s_tir=True)
        def gemv(x: T.Buffer(x_t, d), w: T.Buffer(w_t, "uint32"), s: T.Buffer(s_t, q.scale_dtype),
                 y: T.Buffer((1, 1, n), out_dtype)):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            body(x, w, s, y, y)
    return gemv


def int8_gemv_for(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """The int8 GEMV in place of `func` (same parameters), or None where it does not apply."""
    shape = match_int8_gemv(func)
    return make_int8_gemv(shape) if shape is not None else None


@tvm.transform.module_pass(opt_level=0, name="mlcc_cpu_int8_gemv")
def int8_gemv_pass(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
    """Every batch-1 projection of 8-bit codes swapped for the byte-reading kernel (before the CPU matmul rule,
    which leaves scheduled functions alone)."""
    for gv, func in list(mod.functions.items()):
        if isinstance(func, tirx.PrimFunc) and not (func.attrs and func.attrs.get("tirx.is_scheduled")):
            new = int8_gemv_for(func)
            if new is not None:
                attrs = {a: v for a, v in func.attrs.items()} if func.attrs is not None else {}
                mod[gv] = new.with_attrs({**attrs, "tirx.is_scheduled": True})
    return mod

"""Cross-kernel L2 prefetch of decode weights (sm_90+; issue 4).

A batch-1 decode step alternates projections that stream their weights from DRAM with short kernels that barely
touch it (RMSNorm, RoPE and the KV append, attention, SwiGLU): on the 8B shape ~16 us of every ~57 us layer pass
with DRAM idle, and each projection then starts cold. Here each q4 decode GEMV, as its last blocks finish, asks L2
for the first bytes of the *next* projection's weights and scales (`cp.async.bulk.prefetch.L2`, no completion to
wait for), so DRAM keeps streaming through the short kernels and the next GEMV finds its first rows in L2.

The rewrite is on the Relax side: every call of a q4 GEMV kernel that has a q4 GEMV after it in the same function
gets two more arguments, the next call's weight and scale tensors, and calls a variant of its kernel with the
prefetch (one variant per kernel and next shape). Nothing changes numerically: the kernels compute what they did.

MLCC_L2_PREFETCH_MB (at compile time) caps the bytes per prefetch (L2 is 50 MB on an H100/H200); 0 turns it off.
"""

from __future__ import annotations

import logging
import os

import tvm
from tvm import relax

from . import cuda_pdl
from .cuda_q4_gemv import SHAPE_ATTR, Prefetch, make_q4_gemv, shape_from_attr

log = logging.getLogger(__name__)

DEFAULT_MB = 0  # off: see the module docstring


def budget_bytes(target: tvm.target.Target) -> int:
    """Bytes prefetched ahead of each projection (0: off; bulk L2 prefetch exists from sm_90 on)."""
    if cuda_pdl.sm_version(target) < 90:
        return 0
    return int(float(os.environ.get("MLCC_L2_PREFETCH_MB", DEFAULT_MB)) * (1 << 20))


def _nbytes(shape, dtype: str) -> int:
    count = 1
    for d in shape:
        count *= int(d)
    return count * tvm.DataType(dtype).bits // 8


def _plan(w_shape, s_shape, budget: int, at: str | None = None) -> Prefetch:
    """The first `budget` bytes of the next projection, split over weights and scales in proportion (the same
    leading rows of both), each rounded to the 16 bytes a bulk request moves at least."""
    wb, sb = _nbytes(w_shape, "uint32"), _nbytes(s_shape, "float16")
    share = min(1.0, budget / (wb + sb))
    return Prefetch(tuple(int(d) for d in w_shape), tuple(int(d) for d in s_shape),
                    min(wb, -(-int(wb * share) // 16) * 16), min(sb, -(-int(sb * share) // 16) * 16),
                    tail_blocks=int(os.environ.get("MLCC_L2_PREFETCH_TAIL", 64)),
                    at=at or os.environ.get("MLCC_L2_PREFETCH_AT", "start"))


def _gemv_calls(func: relax.Function, mod: tvm.IRModule, call_tir) -> tuple[list[relax.Call], dict]:
    """The q4 GEMV calls of a function in program order, and each bound variable's position."""
    calls, position = [], {}
    for block in func.body.blocks:
        for binding in block.bindings:
            position[binding.var] = len(position)
            value = binding.value
            if isinstance(value, relax.Call) and value.op.same_as(call_tir) and \
                    isinstance(value.args[0], tvm.ir.GlobalVar):
                callee = mod[value.args[0]]
                if isinstance(callee, tvm.tirx.PrimFunc) and callee.attrs is not None and SHAPE_ATTR in callee.attrs:
                    calls.append((value, position[binding.var]))
    return calls, position


@tvm.transform.module_pass(opt_level=0, name="mlcc_cuda_l2_prefetch")
def l2_prefetch_pass(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
    """After q4_decode_gemv_pass: chain every q4 decode GEMV to the one that follows it."""
    target = tvm.target.Target.current(allow_none=True)
    budget = budget_bytes(target) if target is not None else 0
    if budget <= 0:
        return mod
    call_tir = tvm.ir.Op.get("relax.call_tir")
    pdl = cuda_pdl.supported(target)
    variants: dict[tuple, tvm.ir.GlobalVar] = {}
    bb = relax.BlockBuilder(mod)
    rewrites: dict[str, dict] = {}
    for gv, func in list(mod.functions.items()):
        if not isinstance(func, relax.Function):
            continue
        calls, position = _gemv_calls(func, mod, call_tir)
        new_calls = {}
        for (call, at), (nxt, _) in zip(calls, calls[1:]):
            w_next, s_next = nxt.args[1].fields[1], nxt.args[1].fields[2]
            if any(position.get(v, -1) > at for v in (w_next, s_next)):
                continue  # bound after this call (the models bind every weight first; anything else keeps the kernel)
            plan = _plan(w_next.ty.shape, s_next.ty.shape, budget)
            key = (call.args[0].name_hint, plan)
            if key not in variants:
                base = mod[call.args[0]]
                kernel = make_q4_gemv(shape_from_attr(base.attrs[SHAPE_ATTR]), pdl=pdl, prefetch=plan)
                kernel = kernel.with_attrs({k: v for k, v in base.attrs.items()})
                variants[key] = bb.add_func(kernel, f"{call.args[0].name_hint}_l2pf")
            args = list(call.args[1].fields)
            new_calls[call] = relax.call_tir(variants[key], relax.Tuple(args + [w_next, s_next]), call.ty_args[0])
        rewrites[gv.name_hint] = new_calls
    mod = bb.get()
    for name, new_calls in rewrites.items():
        mod[name] = _Replace(new_calls).visit_expr(mod[name])
    log.debug("L2 prefetch: %d kernel variants", len(variants))
    return mod


@relax.expr_functor.mutator
class _Replace(relax.PyExprMutator):
    def __init__(self, new_calls: dict):
        super().__init__()
        self.new_calls = new_calls

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new = self.new_calls.get(call)
        return new if new is not None else super().visit_call_(call)

"""Decode GEMV fusion (CUDA): the RMSNorm before a batch-1 projection and the SwiGLU after gate_up folded into the
projection's hand-written kernel (schedules/cuda_gemv.py), so a decode step launches two kernels fewer per layer
and neither the normalized activation nor the gate_up output makes a round trip through memory.

A graph rewrite, so it runs on the Relax module after FuseOps/FuseTIR and before the kernel passes: the GEMV pass
(schedules.cuda_gemv.decode_gemv_pass) then replaces the projections left over, one kernel each.
"""

from __future__ import annotations

import dataclasses
import logging

import tvm

from mlcc.schedules.cuda_gemv import make_gemv
from mlcc.schedules.gemv_match import GemvShape, is_unscheduled_prim_func, match_gated, match_gemv, match_rms_norm

log = logging.getLogger(__name__)


def fuse_decode_gemvs(mod: tvm.ir.IRModule, pdl: bool) -> tvm.ir.IRModule:
    """In every Relax function: gate_up projection + split/act/multiply → one "swiglu" (silu) or "geglu" (tanh
    GELU) GEMV kernel; then an
    rms_norm whose only reader is a decode GEMV → that GEMV with the norm as its prologue (x, norm weight, ...).
    The new kernels are scheduled already (with their PDL wait where `pdl`); the projections left over go to
    decode_gemv_pass."""
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    call_tir = tvm.ir.Op.get("relax.call_tir")
    made: dict[str, GemvShape] = {}  # name of a kernel made here → its shape

    def prim_funcs(m, matcher):
        return {gv.name_hint: r for gv, f in m.functions.items() if isinstance(f, tvm.tirx.PrimFunc)
                and (r := matcher(f)) is not None}

    def gemv_shape(m, callee) -> GemvShape | None:
        if callee.name_hint in made:
            return made[callee.name_hint]
        f = m[callee]
        return match_gemv(f) if is_unscheduled_prim_func(f) else None

    def add_kernel(builder, shape: GemvShape) -> tvm.ir.GlobalVar:
        name = f"fused_gemv_{'rms_' if shape.norm_eps is not None else ''}{shape.epilogue}_{shape.n}_{shape.k}"
        gv = builder.add_func(make_gemv(shape, pdl=pdl).with_attr("tirx.is_scheduled", True), name)
        made[gv.name_hint] = shape
        return gv

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
                fuser.uses = var_uses(func)
                fuser.builder_.update_func(gv, fuser.visit_expr(func))
        return relax.transform.DeadCodeElimination()(fuser.builder_.get())

    def producer(fuser, var, callees=None) -> relax.Call | None:
        """The call_tir that binds `var` (to one of `callees`, by name, when given)."""
        value = fuser.lookup_binding(var) if isinstance(var, relax.Var) else None
        if not isinstance(value, relax.Call) or not value.op.same_as(call_tir) \
                or callees is not None and value.args[0].name_hint not in callees:
            return None
        return value

    gated = prim_funcs(mod, match_gated)

    def gated_call(fuser, call):
        if call.args[0].name_hint not in gated:
            return None
        half, kind = gated[call.args[0].name_hint]
        (src,) = call.args[1].fields
        gemv = producer(fuser, src)
        shape = gemv_shape(mod, gemv.args[0]) if gemv is not None else None
        if shape is None or shape.epilogue != "none" or shape.n != 2 * half:
            return None
        return GemvShape(shape.n // 2, shape.k, kind, weights=shape.weights), gemv.args[1]

    mod = run(mod, gated_call) if gated else mod
    norms = prim_funcs(mod, match_rms_norm)

    def norm_call(fuser, call):
        shape = gemv_shape(mod, call.args[0])
        if shape is None or shape.norm_eps is not None:
            return None
        x, *rest = call.args[1].fields
        norm = producer(fuser, x, norms)
        # (only a norm whose output nothing else reads: the fused kernel never writes it)
        if norm is None or fuser.uses.get(x, 0) != 1 or norms[norm.args[0].name_hint][0] != shape.k:
            return None
        h, g = norm.args[1].fields
        return dataclasses.replace(shape, norm_eps=norms[norm.args[0].name_hint][1]), relax.Tuple([h, g, *rest])

    if norms:
        mod = run(mod, norm_call)
    log.debug("decode GEMV kernels with fused SwiGLU/GeGLU / RMSNorm: %s", sorted(made))
    return mod


def var_uses(func) -> dict:
    """How many times each variable of the Relax function `func` is read."""
    from tvm.relax.expr_functor import PyExprVisitor, visitor

    @visitor
    class Uses(PyExprVisitor):
        def __init__(self):
            super().__init__()
            self.count: dict = {}

        def visit_var_(self, v):
            self.count[v] = self.count.get(v, 0) + 1

        def visit_dataflow_var_(self, v):
            self.count[v] = self.count.get(v, 0) + 1

    uses = Uses()
    uses.visit_expr(func)
    return uses.count


def fused_decode_gemv_pass(pdl: bool) -> tvm.transform.Pass:
    """fuse_decode_gemvs as a module pass; `pdl` as for schedules.cuda_gemv.decode_gemv_pass."""

    @tvm.transform.module_pass(opt_level=0, name="mlcc_cuda_fused_decode_gemv")
    def _pass(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        return fuse_decode_gemvs(mod, pdl)

    return _pass

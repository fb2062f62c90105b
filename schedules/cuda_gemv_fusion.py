"""Fold the producer of a batch-1 q4 GEMV's activations into the GEMV (issue 4: fewer kernels per decode step).

TVM fuses elementwise work into the *output* of a matmul but not a reduction or a split into its *input*, so every
decoder layer runs RMSNorm → qkv GEMV, RMSNorm → gate_up GEMV and SwiGLU → down GEMV as six kernels, and the
norm/SwiGLU kernels (a few µs each, 3 per layer) plus the gaps around them are ~10% of an 8B decode step. Here the
hand-written GEMV (cuda_q4_gemv) takes the producer's inputs instead and computes the activations itself:
- SwiGLU: each lane reads its slice of gate and up and forms silu(gate) * up in fp32;
- RMSNorm: the block first reduces sum(h^2) over the whole input (8 KB, from L2), then each lane forms
  h * rsqrt(mean + eps) * w in fp32, as TVM's rms_norm does.
The producer's call then has no user and dead-code elimination drops it (prefill, which has no batch-1 GEMVs,
keeps its own kernels).
"""

from __future__ import annotations

import dataclasses
import logging

import tvm
from tvm import relax

from . import cuda_pdl
from .cuda_q4_gemv import _static_ints, make_q4_gemv, match_q4_gemv

log = logging.getLogger(__name__)


def _blocks(func: tvm.tirx.PrimFunc) -> dict | None:
    from tvm import s_tir

    try:
        sch = s_tir.Schedule(func)
        return {sch.get(b).name_hint: sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))}
    except Exception:  # noqa: BLE001 - not a plain block-structured function
        return None


def match_swiglu(func: tvm.tirx.PrimFunc) -> int | None:
    """k if `func` is split(x (1, 1, 2k)) → silu(first half) * second half, in fp16; else None."""
    blocks = _blocks(func)
    if blocks is None or set(blocks) != {"T_split_sections", "T_split_sections_1", "compute", "T_multiply",
                                         "T_multiply1"} or len(func.params) != 2:
        return None
    sig = blocks["compute"].body.value
    if getattr(getattr(sig, "op", None), "name", "") != "tirx.sigmoid":
        return None
    x, y = blocks["T_split_sections"].reads[0].source, blocks["T_multiply1"].writes[0].source
    xs, ys = _static_ints(x.shape), _static_ints(y.shape)
    if x.dtype != "float16" or y.dtype != "float16" or xs is None or ys is None or len(xs) != 3 \
            or xs[:2] != (1, 1) or ys != (1, 1, xs[2] // 2) or xs[2] % 2:
        return None
    # silu(gate) * up: the first multiply reads the gate half and its sigmoid, the second that and the up half
    gate, up = blocks["T_split_sections"], blocks["T_split_sections_1"]
    if not any(r.source.same_as(gate.writes[0].source) for r in blocks["T_multiply"].reads) \
            or not any(r.source.same_as(up.writes[0].source) for r in blocks["T_multiply1"].reads):
        return None
    return ys[2]


def match_rms_norm(func: tvm.tirx.PrimFunc) -> float | None:
    """eps if `func` is TVM's legalized rms_norm(h, w) over the last axis, fp16 in and out; else None."""
    blocks = _blocks(func)
    if blocks is None or set(blocks) != {"T_cast", "T_multiply", "T_multiply_red", "rsqrt", "T_cast_1",
                                         "T_rms_norm", "T_cast_2"} or len(func.params) != 3:
        return None
    h, w = blocks["T_cast"].reads[0].source, blocks["T_cast_1"].reads[0].source
    y = blocks["T_cast_2"].writes[0].source
    if h.dtype != "float16" or w.dtype != "float16" or y.dtype != "float16" or len(w.shape) != 1:
        return None
    value = blocks["rsqrt"].body.value  # rsqrt(sum / k + eps)
    try:
        eps = value.args[0].b
        return float(eps.value) if isinstance(eps, tvm.tirx.FloatImm) else None
    except (AttributeError, IndexError):
        return None


@relax.expr_functor.mutator
class _FoldProducers(relax.PyExprMutator):
    def __init__(self, mod: tvm.ir.IRModule, pdl: bool):
        super().__init__(mod)
        self.mod_, self.pdl, self.folded, self.kernels = mod, pdl, 0, {}

    def _prim(self, gv):
        f = self.mod_[gv] if isinstance(gv, tvm.ir.GlobalVar) and gv in self.mod_.get_global_vars() else None
        return f if isinstance(f, tvm.tirx.PrimFunc) else None

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.call_tir"):
            return call
        func = self._prim(call.args[0])
        shape = match_q4_gemv(func) if func is not None and not (func.attrs and "tirx.is_scheduled" in func.attrs) \
            else None
        args = list(call.args[1].fields)
        producer = self.lookup_binding(args[0]) if shape is not None and isinstance(args[0], relax.Var) else None
        if not (isinstance(producer, relax.Call) and isinstance(producer.op, tvm.ir.Op)
                and producer.op.name == "relax.call_tir"):
            return call
        pfunc, pargs = self._prim(producer.args[0]), list(producer.args[1].fields)
        if pfunc is None:
            return call
        if match_swiglu(pfunc) == shape.k:
            new_shape, new_args = dataclasses.replace(shape, prologue="swiglu"), [pargs[0]] + args[1:]
        elif (eps := match_rms_norm(pfunc)) is not None:  # (rms_norm keeps its input's shape: (1, 1, k) here)
            new_shape, new_args = dataclasses.replace(shape, prologue="rmsnorm", eps=eps), pargs[:2] + args[1:]
        else:
            return call
        if new_shape not in self.kernels:
            kernel = make_q4_gemv(new_shape, pdl=self.pdl).with_attr("tirx.is_scheduled", True)
            self.kernels[new_shape] = self.builder_.add_func(kernel, f"q4_gemv_{new_shape.prologue}")
        self.folded += 1
        return relax.call_tir(self.kernels[new_shape], relax.Tuple(new_args), call.ty_args[0])


@tvm.transform.module_pass(opt_level=0, name="mlcc_cuda_gemv_prologues")
def fold_gemv_producers_pass(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
    target = tvm.target.Target.current(allow_none=True)
    folder = _FoldProducers(mod, pdl=target is not None and cuda_pdl.supported(target))
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            folder.builder_.update_func(gv, folder.visit_expr(func))
    log.debug("q4 GEMVs with their producer folded in: %d", folder.folded)
    return relax.transform.DeadCodeElimination()(folder.builder_.get())

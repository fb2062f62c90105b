"""CUDA: float16/bfloat16 projections over many tokens (prefill, batched decode, verify) on cuBLASLt.

Each fused projection TVM made (NT_matmul [+ bias | + residual], activations (1, m, K) or (m, 1, K) with m
symbolic; batch-1 decode is static and keeps its GEMV) becomes a host function that calls the shim's global
function (mlcc.native.cublaslt_shim) for more than MIN_TOKENS tokens, and for fewer the projection as it was,
kept under a name of its own so that the few-token kernels and the tensor-core GEMM pass still schedule it. The
call site gets the cuBLASLt workspace as a second output of the call_tir, so TVM's memory planner allocates it (once,
shared by every projection) outside any graph capture.

q4f16_1 projections keep mlcc's own kernels: dequantizing into a scratch buffer before cuBLASLt has not been shown
faster than the q4 tensor-core GEMM.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax, tirx

from mlcc.native.cublaslt_shim import MATMUL
from mlcc.schedules.gemv_match import is_unscheduled_prim_func, match_many_token_projection, token_dim
from mlcc.schedules.host_dispatch import size_dispatch

log = logging.getLogger(__name__)

# Up to this many tokens the projection keeps mlcc's kernels (the split-K tensor-core GEMM, dlight's GEMV)
MIN_TOKENS = 16
WORKSPACE_BYTES = 32 << 20   # cuBLAS's own choice on Hopper
DTYPES = ("float16", "bfloat16")


def _match(func) -> tuple[int, int, tuple, str, str] | None:
    """(n, k, x shape, dtype, epilogue) of a float16/bfloat16 projection cuBLASLt can take, else None."""
    for dtype in DTYPES:
        found = match_many_token_projection(func, dtype)
        if found is None:
            continue
        n, k, x_shape, weights, epilogue = found
        # 16-byte aligned rows: what cuBLASLt's fast kernels need
        if weights == dtype and epilogue in MATMUL and n % 8 == 0 and k % 8 == 0:
            return n, k, x_shape, dtype, epilogue
    return None


def make_dispatch(func: tirx.PrimFunc, kernel: str, epilogue: str, x_shape: tuple, min_tokens: int,
                  attrs: dict) -> tirx.PrimFunc:
    """A host PrimFunc with `func`'s parameters and a workspace after them, calling `kernel` (the library function
    that was `func`) for up to `min_tokens` tokens, else the shim's global function."""
    params = list(func.params)
    workspace = tirx.decl_buffer((tvm.tirx.IntImm("int64", WORKSPACE_BYTES),), "uint8", name="workspace")
    x, w, *rest = params
    *extra, y = rest
    return size_dispatch(params + [workspace], func.ret_type, token_dim(x_shape), min_tokens,
                         tirx.call_cpacked(kernel, *params),
                         tirx.call_packed(MATMUL[epilogue], x, w, *extra, workspace, y), attrs)


def vendor_gemm_pass(min_tokens: int = MIN_TOKENS) -> tvm.transform.Pass:
    """Every matched projection behind a token-count dispatch to cuBLASLt (after FuseTIR, before mlcc's kernels)."""

    @tvm.transform.module_pass(opt_level=0, name="mlcc_cuda_vendor_gemm")
    def _pass(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        rewriter = _WithWorkspace(mod)
        for gv, func in list(mod.functions.items()):
            if not is_unscheduled_prim_func(func):
                continue
            found = _match(func)
            if found is None:
                continue
            _n, _k, x_shape, _dtype, epilogue = found
            name = gv.name_hint
            kernel = f"{name}_kernel"
            attrs = {a: v for a, v in func.attrs.items()} if func.attrs is not None else {}
            rewriter.builder_.add_func(func.with_attr("global_symbol", kernel), kernel)
            dispatch = f"{name}_cublaslt"
            rewriter.replaced[name] = rewriter.builder_.add_func(
                make_dispatch(func, kernel, epilogue, x_shape, min_tokens, {**attrs, "global_symbol": dispatch}),
                dispatch)
        if not rewriter.replaced:
            return mod
        out = rewriter.rewrite()
        for name in rewriter.replaced:   # the old signature: no caller is left
            out = _remove(out, name)
        log.debug("cuBLASLt projections: %d", len(rewriter.replaced))
        return out

    return _pass


def _remove(mod: tvm.ir.IRModule, name: str) -> tvm.ir.IRModule:
    funcs = {gv: f for gv, f in mod.functions.items() if gv.name_hint != name}
    return tvm.ir.IRModule(funcs, attrs=mod.attrs, global_infos=mod.global_infos)


@relax.expr_functor.mutator
class _WithWorkspace(relax.PyExprMutator):
    """call_tir(f, args) -> call_tir(f_cublaslt, args) with (y, workspace) out, then its first element."""

    def __init__(self, mod: tvm.ir.IRModule):
        super().__init__(mod)
        self.mod_ = mod
        self.replaced: dict[str, tvm.ir.GlobalVar] = {}
        self.call_tir = tvm.ir.Op.get("relax.call_tir")

    def rewrite(self) -> tvm.ir.IRModule:
        for gv, func in self.mod_.functions.items():
            if isinstance(func, relax.Function):
                self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.get()

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not call.op.same_as(self.call_tir) or not isinstance(call.args[0], tvm.ir.GlobalVar) \
                or call.args[0].name_hint not in self.replaced:
            return call
        out = call.ty_args[0]
        workspace = relax.TensorType((WORKSPACE_BYTES,), "uint8")
        both = relax.call_tir(self.replaced[call.args[0].name_hint], call.args[1], [out, workspace])
        if len(call.args) > 2:  # (shape variables passed on)
            both = relax.Call(both.op, [*both.args, call.args[2]], both.attrs, both.ty_args)
        return relax.TupleGetItem(self.builder_.emit(both), 0)

"""CUDA: float16/bfloat16 projections over many tokens (prefill, batched decode, verify) on cuBLASLt.

Each fused projection TVM made (NT_matmul [+ bias | + residual], activations (1, m, K) or (m, 1, K) with m
symbolic; batch-1 decode is static and keeps its GEMV) becomes a host function that calls the shim's global
function (mlcc.native.cublaslt_shim) for more than MIN_TOKENS tokens, and for fewer the projection as it was,
kept under a name of its own so that the few-token kernels and the tensor-core GEMM pass still schedule it. The
call site gets the cuBLASLt workspace as a second output of the call_tir, so TVM's memory planner allocates it (once,
shared by every projection) outside any graph capture.

Group-quantized projections with float16/bfloat16 scales (q4f16_1) take cuBLASLt from `q4_min_tokens` tokens on:
their weights are first decoded into a scratch float16 [n, k] tensor (a third output of the call_tir, so the
memory planner gives every projection's scratch one shared allocation), then multiplied. The decode costs a pass
over the packed weights and a write of the float16 ones per call, which many tokens amortize; below the threshold
the q4 tensor-core GEMM, which reads the packed weights once, stays faster. int8 projections (q8f16_1) have no
GEMM of mlcc's own (below the threshold they would get dlight's generic dequantize-matmul), so they take the same
scratch and cuBLASLt over more than MIN_TOKENS tokens, like float16 weights (not yet measured against dlight on a
GPU).

float8 projections (e4m3_e4m3_f16) take cuBLASLt's FP8 GEMM over more than MIN_TOKENS tokens on sm_90+: a kernel
quantizes the activations per token (schedules/cuda_token_quantize.py) into two more outputs of the call_tir (e4m3
codes shaped like x, float32 scales, one per token), and the shim multiplies them with the e4m3 weights, cuBLASLt
applying both scale vectors (per channel, per token) in its epilogue (OUTER_VEC_32F scale mode) with the bias or
residual epilogues of the float16 path.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax, s_tir, te, tirx

from mlcc.native.cublaslt_shim import MATMUL, MATMUL_FP8
from mlcc.quantization import Quantization, weight_scheme
from mlcc.schedules.cuda_token_quantize import quantize_tokens_func
from mlcc.schedules.gemv_match import is_unscheduled_prim_func, match_many_token_projection, token_dim
from mlcc.schedules.host_dispatch import size_dispatch

from .quantize import dequant_value

log = logging.getLogger(__name__)

# Up to this many tokens the projection keeps mlcc's kernels (the split-K tensor-core GEMM, dlight's GEMV)
MIN_TOKENS = 16
WORKSPACE_BYTES = 32 << 20   # cuBLAS's own choice on Hopper
DTYPES = ("float16", "bfloat16")
DEQUANT_THREADS = 256


def takes_fp8(q: Quantization) -> bool:
    """Whether the shim's FP8 GEMM multiplies scheme `q`: e4m3 weights with one float32 scale per row, activations
    quantized per token to e4m3."""
    return (q.kind, q.storage_dtype, q.scale_dtype, q.activations) == \
        ("float8", "float8_e4m3fn", "float32", "float8_e4m3fn")


def _match(func, q4: bool, fp8: bool = False) -> tuple[int, int, tuple, str, str, Quantization | None] | None:
    """(n, k, x shape, dtype, epilogue, weight scheme or None) of a projection cuBLASLt can take, else None."""
    for dtype in DTYPES:
        found = match_many_token_projection(func, dtype)
        if found is None:
            continue
        n, k, x_shape, weights, epilogue = found
        scheme = weight_scheme(weights)
        if scheme is not None and not ((q4 or scheme.bits == 8) and scheme.kind == "group" and scheme.symmetric) \
                and not (fp8 and takes_fp8(scheme) and k % 16 == 0):
            continue
        # 16-byte aligned rows: what cuBLASLt's fast kernels need
        if (scheme is not None or weights == dtype) and epilogue in MATMUL and n % 8 == 0 and k % 8 == 0:
            return n, k, x_shape, dtype, epilogue, scheme
    return None


def dequantize_func(n: int, k: int, q: Quantization, threads: int | None = DEQUANT_THREADS) -> tirx.PrimFunc:
    """A CUDA kernel decoding packed weights [n, k / per_word] and scales [n, k / group_size] into [n, k]: one
    element a thread, so a warp's stores are contiguous and its 8 threads of a word read it once through L1.
    threads=None: the same computation unscheduled (what a CPU build of it checks)."""
    qw = te.placeholder((n, k // q.per_word), q.storage_dtype, name="q_weight")
    qs = te.placeholder((n, k // q.group_size), q.scale_dtype, name="q_scale")
    w = te.compute((n, k), lambda i, j: dequant_value(qw, qs, i, j, q), name="dequantize")
    func = te.create_prim_func([qw, qs, w])
    if threads is None:
        return func
    sch = s_tir.Schedule(func)
    block = sch.get_sblock("dequantize")
    flat = sch.fuse(*sch.get_loops(block))
    bx, tx = sch.split(flat, [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    return sch.mod["main"].without_attr("global_symbol").with_attr("tirx.is_scheduled", True)


def make_dispatch(func: tirx.PrimFunc, kernel: str, epilogue: str, x_shape: tuple, min_tokens: int,
                  attrs: dict, dequantize: tuple[str, int, int, str] | None = None,
                  quantize: tuple[str, str] | None = None) -> tirx.PrimFunc:
    """A host PrimFunc with `func`'s parameters and a workspace after them, calling `kernel` (the library function
    that was `func`) for up to `min_tokens` tokens, else the shim's global function. With `dequantize` (the
    decoding kernel's name, n, k, dtype) `func` reads packed weights and scales, and a scratch [n, k] parameter
    after the workspace receives the decoded weights cuBLASLt multiplies. With `quantize` (the token-quantizing
    kernel's name, the activations' dtype) `func` reads float8 weights and row scales, and two scratch parameters
    shaped like x (the codes) and like x less its last axis (float32 scales) receive the quantized activations."""
    params = list(func.params)
    workspace = tirx.decl_buffer((tvm.tirx.IntImm("int64", WORKSPACE_BYTES),), "uint8", name="workspace")
    if quantize is not None:
        name, act_dtype = quantize
        x, qw, qs, *rest = params
        *extra, y = rest
        shape = list(x_shape)
        xq = tirx.decl_buffer(shape, act_dtype, name="x_codes")
        xs = tirx.decl_buffer(shape[:-1], "float32", name="x_scales")
        return size_dispatch(params + [workspace, xq, xs], func.ret_type, token_dim(x_shape), min_tokens,
                             tirx.call_cpacked(kernel, *params),
                             [tirx.call_cpacked(name, x, xq, xs),
                              tirx.call_packed(MATMUL_FP8[epilogue], xq, xs, qw, qs, *extra, workspace, y)], attrs)
    if dequantize is None:
        x, w, *rest = params
        *extra, y = rest
        return size_dispatch(params + [workspace], func.ret_type, token_dim(x_shape), min_tokens,
                             tirx.call_cpacked(kernel, *params),
                             tirx.call_packed(MATMUL[epilogue], x, w, *extra, workspace, y), attrs)
    name, n, k, dtype = dequantize
    scratch = tirx.decl_buffer((tvm.tirx.IntImm("int64", n), tvm.tirx.IntImm("int64", k)), dtype, name="scratch")
    x, qw, qs, *rest = params
    *extra, y = rest
    return size_dispatch(params + [workspace, scratch], func.ret_type, token_dim(x_shape), min_tokens,
                         tirx.call_cpacked(kernel, *params),
                         [tirx.call_cpacked(name, qw, qs, scratch),
                          tirx.call_packed(MATMUL[epilogue], x, scratch, *extra, workspace, y)], attrs)


def vendor_gemm_pass(min_tokens: int = MIN_TOKENS, q4_min_tokens: int = 0, fp8: bool = False
                     ) -> tvm.transform.Pass:
    """Every matched projection behind a token-count dispatch to cuBLASLt (after FuseTIR, before mlcc's kernels):
    float16/bfloat16 weights over more than `min_tokens` tokens, 4-bit group-quantized ones over more than
    `q4_min_tokens` (0: never), int8 ones over more than `min_tokens`, and with `fp8` (sm_90+) float8 ones over
    more than `min_tokens`."""

    @tvm.transform.module_pass(opt_level=0, name="mlcc_cuda_vendor_gemm")
    def _pass(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        rewriter = _WithWorkspace(mod)
        decoders: dict[tuple, str] = {}
        for gv, func in list(mod.functions.items()):
            if not is_unscheduled_prim_func(func):
                continue
            found = _match(func, q4=q4_min_tokens > 0, fp8=fp8)
            if found is None:
                continue
            n, k, x_shape, dtype, epilogue, scheme = found
            name = gv.name_hint
            kernel = f"{name}_kernel"
            attrs = {a: v for a, v in func.attrs.items()} if func.attrs is not None else {}
            rewriter.builder_.add_func(func.with_attr("global_symbol", kernel), kernel)
            dequantize = quantize = None
            if scheme is not None and scheme.kind == "float8":
                key = (k, scheme.name)
                if key not in decoders:
                    decoders[key] = f"quantize_tokens_{scheme.activations}_{k}"
                    rewriter.builder_.add_func(quantize_tokens_func(k, scheme).with_attr(
                        "global_symbol", decoders[key]), decoders[key])
                quantize = (decoders[key], scheme.activations)
                rewriter.quantized[name] = scheme.activations
            elif scheme is not None:
                key = (n, k, scheme.name)
                if key not in decoders:
                    decoders[key] = f"mlcc_dequantize_{scheme.name}_{n}x{k}"
                    rewriter.builder_.add_func(dequantize_func(n, k, scheme).with_attr(
                        "global_symbol", decoders[key]), decoders[key])
                dequantize = (decoders[key], n, k, dtype)
                rewriter.scratch[name] = (n, k, dtype)
            dispatch = f"{name}_cublaslt"
            rewriter.replaced[name] = rewriter.builder_.add_func(
                make_dispatch(func, kernel, epilogue, x_shape,
                              _scratch_tokens(scheme, min_tokens, q4_min_tokens),
                              {**attrs, "global_symbol": dispatch}, dequantize, quantize),
                dispatch)
        if not rewriter.replaced:
            return mod
        out = rewriter.rewrite()
        for name in rewriter.replaced:   # the old signature: no caller is left
            out = _remove(out, name)
        log.debug("cuBLASLt projections: %d (%d through a decoded scratch, %d FP8)", len(rewriter.replaced),
                  len(rewriter.scratch), len(rewriter.quantized))
        return out

    return _pass


def _scratch_tokens(scheme: Quantization | None, min_tokens: int, q4_min_tokens: int) -> int:
    """The token count over which a projection of `scheme` takes cuBLASLt: 4-bit groups keep mlcc's q4 GEMM up to
    `q4_min_tokens`; int8 groups, float16 and float8 weights go over `min_tokens`."""
    return q4_min_tokens if scheme is not None and scheme.kind == "group" and scheme.bits == 4 else min_tokens


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
        self.scratch: dict[str, tuple[int, int, str]] = {}   # projection -> its decoded weights' (n, k, dtype)
        self.quantized: dict[str, str] = {}   # FP8 projection -> the dtype its activations are quantized to
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
        name = call.args[0].name_hint
        outs = [out, relax.TensorType((WORKSPACE_BYTES,), "uint8")]
        if name in self.scratch:
            n, k, dtype = self.scratch[name]
            outs.append(relax.TensorType((n, k), dtype))
        if name in self.quantized:   # codes shaped like x, one float32 scale per token
            x_shape = list(call.args[1].fields[0].ty.shape.values)
            outs += [relax.TensorType(x_shape, self.quantized[name]), relax.TensorType(x_shape[:-1], "float32")]
        both = relax.call_tir(self.replaced[name], call.args[1], outs)
        if len(call.args) > 2:  # (shape variables passed on)
            both = relax.Call(both.op, [*both.args, call.args[2]], both.attrs, both.ty_args)
        return relax.TupleGetItem(self.builder_.emit(both), 0)

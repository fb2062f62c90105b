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
residual epilogues of the float16 path. Where the activations come from a SwiGLU/GeGLU or an RMSNorm kernel read
by nothing else, that kernel moves into the projection's host function: over MIN_TOKENS tokens one kernel computes
and quantizes them (quantize_produced_tokens_func), so the float16 activations are never written; for fewer the
kernel runs as it was, into a scratch output, before the projection's own kernel.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax, s_tir, te, tirx

from mlcc.native.cublaslt_shim import MATMUL, MATMUL_FP8
from mlcc.quantization import Quantization, weight_scheme
from mlcc.schedules.cuda_token_quantize import quantize_produced_tokens_func, quantize_tokens_func
from mlcc.schedules.gemv_match import (
    is_unscheduled_prim_func,
    match_gated,
    match_many_token_projection,
    match_rms_norm,
    token_dim,
)
from mlcc.schedules.host_dispatch import size_dispatch

from .gemv_fusion import var_uses
from .quantize import dequant_value

log = logging.getLogger(__name__)

# Up to this many tokens the projection keeps mlcc's kernels (the split-K tensor-core GEMM, dlight's GEMV)
MIN_TOKENS = 16
WORKSPACE_BYTES = 32 << 20   # cuBLAS's own choice on Hopper
# The norm/SwiGLU computed inside the FP8 token quantizer: off until an 8B build's logits with it match the unfused
# build's on a GPU (bench/prefill.py's check); the unit test of its kernels against numpy is gpu-marked
FUSE_PRODUCERS = False
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


def make_produced_dispatch(func: tirx.PrimFunc, kernel: str, epilogue: str, x_shape: tuple, min_tokens: int,
                           attrs: dict, act_dtype: str, inputs: list, producer: str, fused: str) -> tirx.PrimFunc:
    """make_dispatch's FP8 host function for activations that kernel `producer` makes from `inputs` (buffers):
    parameters inputs, then `func`'s less x, the workspace, x (a scratch: the few-token path's), codes and scales.
    Few tokens: `producer` into x, then `kernel`; more: `fused` (producer and quantizer in one) into the codes and
    scales, then the shim's FP8 GEMM."""
    _, qw, qs, *rest = func.params
    *extra, y = rest
    workspace = tirx.decl_buffer((tvm.tirx.IntImm("int64", WORKSPACE_BYTES),), "uint8", name="workspace")
    shape = list(x_shape)
    x = tirx.decl_buffer(shape, "float16", name="x")
    xq = tirx.decl_buffer(shape, act_dtype, name="x_codes")
    xs = tirx.decl_buffer(shape[:-1], "float32", name="x_scales")
    return size_dispatch([*inputs, qw, qs, *rest, workspace, x, xq, xs], func.ret_type, token_dim(x_shape),
                         min_tokens,
                         [tirx.call_cpacked(producer, *inputs, x), tirx.call_cpacked(kernel, x, qw, qs, *rest)],
                         [tirx.call_cpacked(fused, *inputs, xq, xs),
                          tirx.call_packed(MATMUL_FP8[epilogue], xq, xs, qw, qs, *extra, workspace, y)], attrs)


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
                rewriter.plain_quantizer[name] = decoders[key]
                rewriter.fp8[name] = (func, kernel, epilogue, x_shape, _scratch_tokens(scheme, min_tokens, 0), attrs,
                                      scheme)
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
        # FP8 projections whose every call site quantizes its producer's output: their plain host function, and
        # the token quantizers no host function calls any more
        for name in set(rewriter.plain_quantizer) - rewriter.plain_sites:
            out = _remove(out, f"{name}_cublaslt")
        for quantizer in set(rewriter.plain_quantizer.values()) - \
                {rewriter.plain_quantizer[n] for n in rewriter.plain_sites if n in rewriter.plain_quantizer}:
            out = _remove(out, quantizer)
        log.debug("cuBLASLt projections: %d (%d through a decoded scratch, %d FP8, %d call sites quantizing "
                  "their producer's output)", len(rewriter.replaced), len(rewriter.scratch), len(rewriter.fp8),
                  rewriter.fused_sites)
        # the producers whose only reader became a fused host function
        return relax.transform.DeadCodeElimination()(out) if rewriter.fused_sites else out

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
        self.fp8: dict[str, tuple] = {}   # FP8 projection -> what make_produced_dispatch needs of it (scheme last)
        self.produced: dict[tuple[str, str], tvm.ir.GlobalVar] = {}   # (projection, producer) -> host function
        self.producer_kernels: set[str] = set()   # producers added under their `_kernel` symbol
        self.fused_sites = 0
        self.plain_sites: set[str] = set()   # projections called somewhere with their own activations
        self.plain_quantizer: dict[str, str] = {}   # FP8 projection -> its token quantizer
        self.uses: dict = {}
        self.call_tir = tvm.ir.Op.get("relax.call_tir")
        self.producers = {gv.name_hint: found for gv, f in mod.functions.items()
                          if isinstance(f, tirx.PrimFunc) and is_unscheduled_prim_func(f)
                          and (found := _match_producer(f)) is not None} if FUSE_PRODUCERS else {}

    def rewrite(self) -> tvm.ir.IRModule:
        for gv, func in self.mod_.functions.items():
            if isinstance(func, relax.Function):
                self.uses = var_uses(func)
                self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.get()

    def _producer_call(self, x: relax.Expr, k: int) -> relax.Call | None:
        """The call_tir of a fusable producer of `k` activations that binds `x`, where nothing else reads x."""
        value = self.lookup_binding(x) if isinstance(x, relax.Var) else None
        if not isinstance(value, relax.Call) or not value.op.same_as(self.call_tir) \
                or not isinstance(value.args[0], tvm.ir.GlobalVar) or self.uses.get(x, 0) != 1:
            return None
        found = self.producers.get(value.args[0].name_hint)
        return value if found is not None and found[1] == k else None

    def _produced(self, name: str, producer: relax.Call) -> tvm.ir.GlobalVar:
        func, kernel, epilogue, x_shape, min_tokens, attrs, scheme = self.fp8[name]
        pname = producer.args[0].name_hint
        key = (name, pname)
        if key in self.produced:
            return self.produced[key]
        kind, k, eps = self.producers[pname]
        fused = f"quantize_{kind}_tokens_{scheme.activations}_{k}"
        if pname not in self.producer_kernels:
            self.producer_kernels.add(pname)
            self.builder_.add_func(self.mod_[pname].with_attr("global_symbol", f"{pname}_kernel"), f"{pname}_kernel")
            self.builder_.add_func(quantize_produced_tokens_func(k, scheme, kind, eps).with_attr(
                "global_symbol", fused), fused)
        lead = list(x_shape[:-1])
        inputs = ([tirx.decl_buffer(lead + [2 * k], "float16", name="gate_up")] if kind != "rms_norm" else
                  [tirx.decl_buffer(lead + [k], "float16", name="h"), tirx.decl_buffer((k,), "float16", name="weight")])
        dispatch = f"{name}_{pname}_cublaslt"
        self.produced[key] = self.builder_.add_func(
            make_produced_dispatch(func, kernel, epilogue, x_shape, min_tokens, {**attrs, "global_symbol": dispatch},
                                   scheme.activations, inputs, f"{pname}_kernel", fused), dispatch)
        return self.produced[key]

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
        callee, args = self.replaced[name], call.args[1]
        if name in self.fp8:   # codes shaped like x, one float32 scale per token
            x, *rest = call.args[1].fields
            x_shape = list(x.ty.shape.values)
            producer = self._producer_call(x, int(x_shape[-1]))
            if producer is not None:   # (x itself: the few-token path's scratch)
                callee, args = self._produced(name, producer), relax.Tuple([*producer.args[1].fields, *rest])
                outs.append(relax.TensorType(x_shape, "float16"))
                self.fused_sites += 1
            else:
                self.plain_sites.add(name)
            outs += [relax.TensorType(x_shape, self.fp8[name][-1].activations),
                     relax.TensorType(x_shape[:-1], "float32")]
        both = relax.call_tir(callee, args, outs)
        if len(call.args) > 2:  # (shape variables passed on)
            both = relax.Call(both.op, [*both.args, call.args[2]], both.attrs, both.ty_args)
        return relax.TupleGetItem(self.builder_.emit(both), 0)


def _match_producer(func: tirx.PrimFunc) -> tuple[str, int, float] | None:
    """(kind, k, eps) of a many-token kernel whose output a token quantizer can compute itself, else None."""
    gated = match_gated(func, many_tokens=True)
    if gated is not None:
        return gated[1], gated[0], 0.0
    norm = match_rms_norm(func, many_tokens=True)
    return ("rms_norm", norm[0], norm[1]) if norm is not None else None


"""Which of TVM's fused PrimFuncs are batch-1 decode projections, and the RMSNorm and SwiGLU kernels around them.

The matchers read the block structure TVM's legalization gives these operators (block names such as "dequantize",
"matmul", "NT_matmul", "T_add", "T_rms_norm"), the buffers' shapes and dtypes, and a quantized projection's scheme
from the tag the quantizer puts on its "dequantize" block (mlcc.quantization.TAG); anything else returns None and
keeps its default schedule. `GemvShape` is what the CUDA GEMV generator (cuda_gemv.make_gemv) builds a kernel for.
"""

from __future__ import annotations

import dataclasses

import tvm

from mlcc.quantization import TAG, Quantization, weight_scheme

from .cuda_source import decodes_e4m3, decodes_int8, decodes_q4

GATED = ("swiglu", "geglu")  # silu / tanh-approximated GELU of the gate half, times the up half


@dataclasses.dataclass(frozen=True)
class GemvShape:
    n: int                 # output features (rows of W; for the gated "swiglu"/"geglu", half of them)
    k: int                 # input features
    epilogue: str          # "none" | "add" | "cast" | "swiglu" | "geglu" (GATED: act(gate rows) * up rows)
    residual_shape: tuple[int, ...] = ()
    out_dtype: str = "float16"
    weights: str = "q4f16_1"  # a scheme CUDA's q4, int8 or e4m3 code decodes (cuda_source.decodes_*), or "float16"
    norm_eps: float | None = None  # RMSNorm prologue: x is the un-normalized input, with the norm weight after it

    @property
    def weight_rows(self) -> int:
        """Rows of W: for a gated epilogue the gate rows and then the up rows."""
        return 2 * self.n if self.epilogue in GATED else self.n

    @property
    def unit(self) -> int:
        """Weights per 16-byte load of one row."""
        q = weight_scheme(self.weights)
        return 128 // (q.bits if q is not None else tvm.DataType(self.weights).bits)


def _static_ints(shape) -> tuple[int, ...] | None:
    try:
        return tuple(int(d) for d in shape)
    except TypeError:  # a symbolic dimension
        return None


def _blocks(func) -> dict | None:
    from tvm import s_tir

    try:
        sch = s_tir.Schedule(func)
        return {sch.get(b).name_hint: sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))}
    except Exception:  # noqa: BLE001 - not a plain block-structured function: not ours
        return None


def tagged_scheme(func, block=None) -> Quantization | None:
    """The scheme a quantized projection is tagged with: on `block` (a dense projection's "dequantize", which
    fusion keeps) or on the function (the opaque expert kernels); None where untagged or unknown."""
    for attrs in ((block.annotations if block is not None else None), func.attrs):
        if attrs is not None and TAG in attrs:
            return weight_scheme(str(attrs[TAG]))
    return None


def is_unscheduled_prim_func(func) -> bool:
    return isinstance(func, tvm.tirx.PrimFunc) and not (func.attrs is not None and "tirx.is_scheduled" in func.attrs)


def match_gemv(func) -> GemvShape | None:
    """The shape of a batch-1 decode projection PrimFunc — dequantize→matmul in a scheme CUDA's q4, int8 or e4m3 code
    decodes, or float16 NT_matmul, [→add|cast] — or None if it is anything else."""
    blocks = _blocks(func)
    if blocks is None:
        return None
    q = None
    if {"dequantize", "matmul"} <= set(blocks):
        deq, mm = blocks["dequantize"], blocks["matmul"]
        q = tagged_scheme(func, deq)
        if not (decodes_q4(q) or decodes_int8(q) or decodes_e4m3(q)):
            return None
        core, weights = {"dequantize", "matmul"}, q.name
        if len(deq.reads) != 2 or len(mm.reads) != 2:
            return None
        w, s = (r.source for r in deq.reads)
        x = next((r.source for r in mm.reads if not r.source.same_as(deq.writes[0].source)), None)
        if x is None or w.dtype != q.storage_dtype or s.dtype != q.scale_dtype:
            return None
    elif "NT_matmul" in blocks:
        core, weights = {"NT_matmul"}, "float16"
        mm = blocks["NT_matmul"]
        if len(mm.reads) != 2:
            return None
        x, w = (r.source for r in mm.reads)
        s = None
        if w.dtype != "float16" or not _reads_row_major(mm, w):
            return None
    else:
        return None
    extra = set(blocks) - core
    if len(extra) > 1 or not extra <= {"T_add", "compute"}:
        return None
    ws, xs, ys = (_static_ints(b.shape) for b in (w, x, mm.writes[0].source))
    if None in (ws, xs, ys) or x.dtype != "float16" or len(ws) != 2:
        return None
    n, k = (ws[0], ws[1] * q.per_word) if q is not None else ws
    if xs != (1, 1, k) or ys != (1, 1, n) or k % 32:  # (K whole warps of 16-byte loads, for both kernels)
        return None
    if q is not None and _static_ints(s.shape) != q.scale_shape(n, k):
        return None
    if not extra:
        epilogue, res, out = "none", None, mm.writes[0].source
    else:
        (name,) = extra
        blk = blocks[name]
        reads = [r.source for r in blk.reads]
        out = blk.writes[0].source
        others = [b for b in reads if not b.same_as(mm.writes[0].source)]
        if name == "T_add":
            if len(reads) != 2 or len(others) != 1 or not isinstance(blk.body.value, tvm.tirx.Add):
                return None
            res = others[0]
            if res.dtype != "float16" or _static_ints(res.shape) not in ((n,), (1, 1, n)) or out.dtype != "float16":
                return None
            epilogue = "add"
        else:
            if len(reads) != 1 or others or not isinstance(blk.body.value, tvm.tirx.Cast):
                return None
            epilogue, res = "cast", None
        if _static_ints(out.shape) != (1, 1, n):
            return None
    expected = [x, w] + ([s] if s is not None else []) + ([res] if res is not None else []) + [out]
    if len(func.params) != len(expected) or not all(p.same_as(e) for p, e in zip(func.params, expected)):
        return None
    return GemvShape(n, k, epilogue, _static_ints(res.shape) if res is not None else (), str(out.dtype), weights)


def _reads_row_major(block, w) -> bool:
    """The NT matmul reads W[i, k] (row i of the output, the reduction index second), not W[k, i]."""
    (region,) = [r for r in block.reads if r.source.same_as(w)]
    iters = block.iter_vars
    spatial = [iv.var for iv in iters if iv.iter_type == 0]
    reduce = [iv.var for iv in iters if iv.iter_type == 2]
    if len(reduce) != 1 or not spatial or len(region.region) != 2:   # (batched matmuls: a 3-D or 4-D operand)
        return False
    first, second = (r.min for r in region.region)
    return first.same_as(spatial[-1]) and second.same_as(reduce[0])


_GATED_BLOCKS = {
    "swiglu": {"T_split_sections", "T_split_sections_1", "compute", "T_multiply", "T_multiply1"},
    # TVM's legalized gelu(approximate="tanh"): 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
    "geglu": {"T_split_sections", "T_split_sections_1", "T_multiply", "T_multiply_1", "T_multiply_2", "T_multiply_3",
              "T_add", "T_multiply_4", "compute", "T_add_1", "T_multiply_5", "T_multiply1"},
}
_GATED_OP = {"swiglu": "tirx.sigmoid", "geglu": "tirx.tanh"}



def static_dim(d) -> int | None:
    return int(d) if isinstance(d, (int, tvm.tirx.IntImm)) else None


def token_dim(x_shape) -> tvm.tirx.PrimExpr:
    """The symbolic dimension (the token count) of a many-token projection's activations, (1, m, K) or (m, 1, K)."""
    return next(d for d in x_shape if static_dim(d) is None)


def same_shape(a, b) -> bool:
    return len(a) == len(b) and all(p.same_as(q) or (static_dim(p) is not None and static_dim(p) == static_dim(q))
                                    for p, q in zip(a, b))


def match_many_token_projection(func, dtype: str, cast: bool = False) -> tuple[int, int, tuple, str, str] | None:
    """(n, k, x shape, weights, epilogue) of a projection over several tokens with `dtype` activations: dequantize→
    matmul in a tagged scheme of model dtype `dtype` (weights: the scheme's name) or `dtype` NT_matmul weights
    [→ + residual or bias], activations (1, m, K) or (m, 1, K) with m symbolic; None for anything else (batch-1
    GEMVs included). Epilogue: "none" | "add" | "bias", and with `cast` also "cast" (the output cast to float32:
    an LM head over several positions). Which schemes a kernel decodes is the caller's to check."""
    blocks = _blocks(func)
    if blocks is None:
        return None
    q = None
    if {"dequantize", "matmul"} <= set(blocks):
        deq, mm = blocks["dequantize"], blocks["matmul"]
        q = tagged_scheme(func, deq)
        if q is None or q.model_dtype != dtype:
            return None
        core, weights = {"dequantize", "matmul"}, q.name
        if len(deq.reads) != 2 or len(mm.reads) != 2:
            return None
        w, s = (r.source for r in deq.reads)
        x = next((r.source for r in mm.reads if not r.source.same_as(deq.writes[0].source)), None)
        if x is None or w.dtype != q.storage_dtype or s.dtype != q.scale_dtype:
            return None
    elif "NT_matmul" in blocks:
        core, weights, s = {"NT_matmul"}, dtype, None
        mm = blocks["NT_matmul"]
        if len(mm.reads) != 2:
            return None
        x, w = (r.source for r in mm.reads)
        if w.dtype != dtype or not _reads_row_major(mm, w):
            return None
    else:
        return None
    extra = set(blocks) - core
    if not extra <= {"T_add"} and not (cast and extra == {"compute"}):
        return None
    ws = [static_dim(d) for d in w.shape]
    if len(ws) != 2 or None in ws or len(x.shape) != 3 or x.dtype != dtype:
        return None
    n, k = (ws[0], ws[1] * q.per_word) if q is not None else tuple(ws)
    lead = [static_dim(d) for d in x.shape[:2]]
    if static_dim(x.shape[2]) != k or sorted(lead, key=lambda v: v is None) != [1, None]:
        return None
    if q is not None and tuple(static_dim(d) for d in s.shape) != q.scale_shape(n, k):
        return None
    y = mm.writes[0].source
    res, bias = None, False
    if extra == {"compute"}:
        blk = blocks["compute"]
        if len(blk.reads) != 1 or not isinstance(blk.body.value, tvm.tirx.Cast) or y.dtype != dtype:
            return None
        out = blk.writes[0].source
        if out.dtype != "float32" or not same_shape(out.shape, list(x.shape[:2]) + [n]):
            return None
        expected = [x, w] + ([s] if s is not None else []) + [out]
        if len(func.params) != len(expected) or not all(p.same_as(e) for p, e in zip(func.params, expected)):
            return None
        return n, k, tuple(x.shape), weights, "cast"
    if extra:
        blk = blocks["T_add"]
        reads = [r.source for r in blk.reads]
        others = [b for b in reads if not b.same_as(y)]
        if len(reads) != 2 or len(others) != 1 or not isinstance(blk.body.value, tvm.tirx.Add):
            return None
        res, y = others[0], blk.writes[0].source
        bias = len(res.shape) == 1 and static_dim(res.shape[0]) == n
        if res.dtype != dtype or not (bias or same_shape(res.shape, y.shape)):
            return None
    if y.dtype != dtype or not same_shape(y.shape, list(x.shape[:2]) + [n]):
        return None
    expected = [x, w] + ([s] if s is not None else []) + ([res] if res is not None else []) + [y]
    if len(func.params) != len(expected) or not all(p.same_as(e) for p, e in zip(func.params, expected)):
        return None
    return n, k, tuple(x.shape), weights, "none" if res is None else "bias" if bias else "add"


def _token_rows(shape) -> tuple | None:
    """(leading dims, last dim) of a many-token activation (1, m, K) / (m, 1, K) with m symbolic, else None."""
    if len(shape) != 3 or static_dim(shape[2]) is None or sum(static_dim(d) is None for d in shape[:2]) != 1 \
            or any(static_dim(d) not in (None, 1) for d in shape[:2]):
        return None
    return tuple(shape[:2]), static_dim(shape[2])


def match_gated(func, many_tokens: bool = False) -> tuple[int, str] | None:
    """(I, "swiglu" | "geglu") for the split → act(first half) * second half kernel of a (1, 1, 2I) float16 input
    (act: silu, or the tanh-approximated GELU), else None; with `many_tokens` of a (1, m, 2I) / (m, 1, 2I) one."""
    blocks = _blocks(func)
    kind = next((k for k, names in _GATED_BLOCKS.items() if blocks is not None and set(blocks) == names), None)
    if kind is None or len(func.params) != 2:
        return None
    dtypes = {str(p.dtype) for p in func.params}
    value = blocks["compute"].body.value
    if many_tokens:
        src, dst = (_token_rows(p.shape) for p in func.params)
        if src is None or dst is None or dtypes != {"float16"} or not same_shape(src[0], dst[0]) \
                or src[1] != 2 * dst[1]:
            return None
        src, dst = (1, 1, src[1]), (1, 1, dst[1])
    else:
        src, dst = (_static_ints(p.shape) for p in func.params)
    if src is None or dst is None or dtypes != {"float16"} or len(src) != 3 or src[:2] != (1, 1) \
            or dst != (1, 1, src[2] // 2) or src[2] % 2:
        return None
    if not (isinstance(value, tvm.ir.expr.Call) and value.op.same_as(tvm.ir.Op.get(_GATED_OP[kind]))):
        return None
    return dst[2], kind


def match_rms_norm(func, many_tokens: bool = False) -> tuple[int, float] | None:
    """(k, eps) of TVM's legalized float16 rms_norm over (1, 1, k) with a (k,) weight, else None; with
    `many_tokens` over (1, m, k) / (m, 1, k)."""
    blocks = _blocks(func)
    if blocks is None or set(blocks) != {"T_cast", "T_multiply", "T_multiply_red", "rsqrt", "T_cast_1", "T_rms_norm",
                                         "T_cast_2"} or len(func.params) != 3:
        return None
    if many_tokens:
        rows, out = (_token_rows(p.shape) for p in (func.params[0], func.params[2]))
        if rows is None or out is None or not same_shape(rows[0], out[0]) or rows[1] != out[1]:
            return None
        x, g, out = (1, 1, rows[1]), _static_ints(func.params[1].shape), (1, 1, rows[1])
    else:
        x, g, out = (_static_ints(p.shape) for p in func.params)
    if x is None or len(x) != 3 or x[:2] != (1, 1) or g != x[2:] or out != x \
            or {str(p.dtype) for p in func.params} != {"float16"}:
        return None
    value = blocks["rsqrt"].body.value  # rsqrt(sum / k + eps)
    try:
        mean, eps = value.args[0].a, value.args[0].b
        if int(round(float(mean.b.value))) != x[2]:
            return None
        return x[2], float(eps.value)
    except AttributeError:
        return None

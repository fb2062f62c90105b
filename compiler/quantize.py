"""The nn modules that replace Linear/Embedding for group and float8 quantization (schemes: mlcc.quantization;
numpy packers: quant_schemes.py).

Dequantization lives inside the same TE function as the matmul/take that consumes it, so the compiled kernels
read packed weights and never write a dequantized copy to memory. A projection's "dequantize" block carries its
scheme's name (quantization.TAG): the kernels read the layout from that scheme.
"""

from __future__ import annotations

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from mlcc.errors import UnsupportedQuantizationError
from mlcc.quantization import TAG

# re-exported: the scheme table (mlcc.quantization) and the numpy packing (quant_schemes), neither needing TVM
from .quant_schemes import (  # noqa: F401
    QUANTIZATIONS,
    Quantization,
    dequantize_weight,
    get_quantization,
    group_dequantize,
    group_quantize,
    quantize_weight,
)

# -- TE: dequantize fused into its consumer --------------------------------------------------------------------

# Integer → float via the exponent trick: OR the code into the mantissa of 2^10 (fp16) or 2^23 (fp32), reinterpret,
# subtract. Exact for 4-bit codes, and a logic op instead of the quarter-rate int→float convert in GEMV inner loops.
_MAGIC = {"float16": ("uint16", 0x6400, 1024.0), "float32": ("uint32", 0x4B000000, 8388608.0)}


# float8 → float16 by moving the bits: the sign to bit 15, exponent and mantissa to the top of fp16's, which reads
# as the value times 2^(bias - 15), subnormals and zero included. TVM's own float8 legalization (LLVM, WGSL, Metal)
# decodes zero as 2^-7 and is off for every subnormal code. (magnitude shift, 2^(15 - bias))
_FLOAT8_AS_F16 = {"float8_e4m3fn": (7, 256.0), "float8_e5m2": (8, 1.0)}


def float8_value(code, q: Quantization):
    """A float8 code of scheme `q` as float32, decoded with integer ops (exact)."""
    shift, unscale = _FLOAT8_AS_F16[q.storage_dtype]
    b = tirx.reinterpret("uint8", code).astype("uint16")
    bits = tirx.bitwise_or(tirx.shift_left(tirx.bitwise_and(b, tirx.const(0x80, "uint16")), tirx.const(8, "uint16")),
                           tirx.shift_left(tirx.bitwise_and(b, tirx.const(0x7F, "uint16")),
                                           tirx.const(shift, "uint16")))
    return tirx.reinterpret("float16", bits).astype("float32") * tirx.const(unscale, "float32")


def dequant_value(qw: te.Tensor, qs: te.Tensor, row, j, q: Quantization, qz: te.Tensor | None = None):
    """Element (row, j) of the dequantized weight, in the model dtype: (code - zero) · scale of its group, the zero
    being the scheme's zero_code or, in a zero-point scheme, the group's code in `qz`; for float8 code · scale of its
    row (the product in float32, the scale's dtype)."""
    if q.kind == "float8":
        return (float8_value(qw[row, j], q) * qs[row].astype("float32")).astype(q.model_dtype)
    code = _code(qw[row, j // q.per_word], j % q.per_word, q)
    group = j // q.group_size
    if q.symmetric:
        zero = tirx.const(q.zero_code, qs.dtype)
    else:
        zero = _code(qz[row, group // q.per_word], group % q.per_word, q).astype(qs.dtype)
    if not q.magic_int_to_float:
        return (code.astype(qs.dtype) - zero) * qs[row, group]
    bits_dtype, magic, base = _MAGIC[str(qs.dtype)]
    as_float = tirx.reinterpret(qs.dtype, tirx.bitwise_or(code.astype(bits_dtype), tirx.const(magic, bits_dtype)))
    # (base + code) - base is exact, and so is the small integer difference that follows
    return (as_float - tirx.const(base, qs.dtype) - zero) * qs[row, group] if not q.symmetric else \
        (as_float - tirx.const(base + q.zero_code, qs.dtype)) * qs[row, group]


def _code(word, index, q: Quantization):
    """Code `index` of a packed storage word, low code first."""
    return tirx.bitwise_and(tirx.shift_right(word, (index * q.bits).astype(q.storage_dtype)),
                            tirx.const(q.code_mask, q.storage_dtype))


def _dequant_matmul(x: Tensor, q_weight: nn.Parameter, q_scale: nn.Parameter, q: Quantization, k: int, n: int,
                    q_zero: nn.Parameter | None = None) -> Tensor:
    """x[..., k] @ W[n, k]^T with W unpacked inside the same PrimFunc: a block named "dequantize" (dlight
    inlines blocks by that name into the consumer), tagged with the scheme, feeding the "matmul" block."""

    def compute(x: te.Tensor, qw: te.Tensor, qs: te.Tensor, qz: te.Tensor | None = None) -> te.Tensor:
        w = te.compute((n, k), lambda i, j: dequant_value(qw, qs, i, j, q, qz), name="dequantize",
                       attrs={TAG: q.name})
        r = te.reduce_axis((0, k), name="k")
        return te.compute(list(x.shape[:-1]) + [n], lambda *idx: te.sum(x[(*idx[:-1], r)] * w[idx[-1], r], axis=r),
                          name="matmul")

    args = [x, q_weight, q_scale] + ([q_zero] if q_zero is not None else [])
    return op.tensor_expr_op(compute, "dequantize_matmul", args)


class GroupQuantLinear(nn.Module):
    """A Linear in a group or float8 scheme: codes and scales shaped as the scheme says."""

    def __init__(self, in_features: int, out_features: int, bias: bool, q: Quantization):
        self.in_features, self.out_features, self.q = in_features, out_features, q
        self.q_weight = nn.Parameter(q.weight_shape(out_features, in_features), q.storage_dtype)
        self.q_scale = nn.Parameter(q.scale_shape(out_features, in_features), q.scale_dtype)
        self.q_zero = None if q.symmetric else nn.Parameter(q.zero_shape(out_features, in_features), q.storage_dtype)
        self.bias = nn.Parameter((out_features,), q.model_dtype) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        out = _dequant_matmul(x, self.q_weight, self.q_scale, self.q, self.in_features, self.out_features,
                              self.q_zero)
        return out + self.bias if self.bias is not None else out

    # nn.Module.to() would cast the codes and float32 scales; keep storage dtypes fixed.
    def to(self, dtype: str | None = None) -> None:  # noqa: ARG002
        return None


class GroupQuantEmbedding(nn.Module):
    def __init__(self, num: int, dim: int, q: Quantization):
        self.num, self.dim, self.q = num, dim, q
        self.q_weight = nn.Parameter(q.weight_shape(num, dim), q.storage_dtype)
        self.q_scale = nn.Parameter(q.scale_shape(num, dim), q.scale_dtype)

    def forward(self, ids: Tensor) -> Tensor:
        q, dim = self.q, self.dim

        def take_dequant(qw: te.Tensor, qs: te.Tensor, ids: te.Tensor) -> te.Tensor:
            return te.compute((ids.shape[0], dim), lambda i, j: dequant_value(qw, qs, ids[i], j, q),
                              name="take_dequantize")

        return op.tensor_expr_op(take_dequant, "take_dequantize", [self.q_weight, self.q_scale, ids])

    def lm_head_forward(self, x: Tensor) -> Tensor:
        return _dequant_matmul(x, self.q_weight, self.q_scale, self.q, self.dim, self.num)

    def to(self, dtype: str | None = None) -> None:  # noqa: ARG002
        return None


# -- model surgery ---------------------------------------------------------------------------------------------

def quantize_model(model: nn.Module, q: Quantization) -> nn.Module:
    """Cast to the model dtype and, for quantized schemes, swap Linear/Embedding for their quantized forms (the
    embedding and LM head only where the scheme quantizes them)."""
    model.to(q.model_dtype)
    if q.kind == "none":
        return model

    class _Swap(nn.Mutator):
        def visit_module(self, name: str, node: nn.Module):
            if isinstance(node, nn.Linear) and (q.quantize_lm_head or name.split(".")[-1] != "lm_head"):
                return GroupQuantLinear(node.in_features, node.out_features, node.bias is not None, q)
            if isinstance(node, nn.Embedding) and q.quantize_embedding:
                if not q.symmetric:
                    raise UnsupportedQuantizationError(f"{q.name}: zero-point schemes quantize projections only")
                return GroupQuantEmbedding(node.num, node.dim, q)
            if hasattr(node, "group_quantized"):  # stacked expert weights (relax_models/moe.py)
                if q.kind != "group" or q.zero_code != q.max_int or not q.symmetric:
                    raise UnsupportedQuantizationError(
                        f"{q.name}: mixture-of-experts weights have no {q.kind if q.kind != 'group' else q.name} form "
                        "yet; use q4f16_1 or q0f16 for "
                        "this model")
                return node.group_quantized(q)
            return self.visit(name, node)

    return _Swap().visit("", model)

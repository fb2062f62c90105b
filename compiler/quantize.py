"""Quantization schemes: the registry, the numpy packers, and the nn modules that replace Linear/Embedding.

q4f16_1 / q4f32_1 are bit-compatible with MLC-LLM: groups of 32 along K, uint32[out, in/8] holding 8 nibbles low
nibble first, scale[out, in/32] in the model dtype, symmetric: q = clamp(round(w/scale) + 7, 0, 14), w ≈ (q-7)·scale.
Dequantization lives inside the same TE function as the matmul/take that consumes it, so the compiled kernels
read packed weights and never write a dequantized copy to memory.
"""

from __future__ import annotations

import dataclasses
import numpy as np
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op


@dataclasses.dataclass(frozen=True)
class Quantization:
    name: str
    model_dtype: str          # activations and unquantized parameters
    kind: str                 # "none" | "group"
    group_size: int = 32
    bits: int = 4
    # int -> float by OR-ing the code into a float's mantissa (exact, and cheaper than a convert on GPUs);
    # off for WGSL, which has no 16-bit integers to build the f16 bit pattern from
    magic_int_to_float: bool = True

    @property
    def max_int(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @property
    def per_word(self) -> int:
        return 32 // self.bits


QUANTIZATIONS: dict[str, Quantization] = {
    "q0f32": Quantization("q0f32", "float32", "none"),
    "q0f16": Quantization("q0f16", "float16", "none"),
    "q4f16_1": Quantization("q4f16_1", "float16", "group"),
    "q4f32_1": Quantization("q4f32_1", "float32", "group"),
}


class UnknownQuantizationError(ValueError):
    pass


def get_quantization(name: str) -> Quantization:
    if name not in QUANTIZATIONS:
        raise UnknownQuantizationError(
            f"unknown quantization '{name}'; choose one of: {', '.join(QUANTIZATIONS)}")
    return QUANTIZATIONS[name]


# -- numpy: pack / unpack ----------------------------------------------------------------------------------------

def group_quantize(w: np.ndarray, q: Quantization) -> tuple[np.ndarray, np.ndarray]:
    """float[N, K] → (uint32[N, K/8], scale[N, K/32]) in MLC's q4 layout."""
    n, k = w.shape
    if k % q.group_size:
        raise ValueError(f"cannot {q.name}-quantize a [{n}, {k}] weight: {k} is not a multiple of {q.group_size}")
    w32 = w.astype(np.float32).reshape(n, k // q.group_size, q.group_size)
    scale = np.abs(w32).max(axis=-1, keepdims=True) / q.max_int
    # Round the scale to its stored dtype first so dequantization reproduces exactly what we quantized against.
    scale = scale.astype(q.model_dtype).astype(np.float32)
    safe = np.where(scale == 0, 1.0, scale)
    codes = np.clip(np.round(w32 / safe) + q.max_int, 0, 2 * q.max_int).astype(np.uint32).reshape(n, k)
    codes = codes.reshape(n, k // q.per_word, q.per_word)
    shifts = (np.arange(q.per_word, dtype=np.uint32) * q.bits)
    packed = np.bitwise_or.reduce(codes << shifts, axis=-1).astype(np.uint32)
    return packed, scale.reshape(n, k // q.group_size).astype(q.model_dtype)


def group_dequantize(packed: np.ndarray, scale: np.ndarray, q: Quantization) -> np.ndarray:
    """Inverse of group_quantize, in float32: the reference the compiled kernels are tested against."""
    n = packed.shape[0]
    shifts = (np.arange(q.per_word, dtype=np.uint32) * q.bits)
    codes = (packed[:, :, None] >> shifts) & ((1 << q.bits) - 1)
    codes = codes.reshape(n, -1).astype(np.float32) - q.max_int
    return codes * np.repeat(scale.astype(np.float32), q.group_size, axis=1)


# -- TE: dequantize fused into its consumer --------------------------------------------------------------------

# Integer → float via the exponent trick: OR the code into the mantissa of 2^10 (fp16) or 2^23 (fp32), reinterpret,
# subtract. Exact for 4-bit codes, and a logic op instead of the quarter-rate int→float convert in GEMV inner loops.
_MAGIC = {"float16": ("uint16", 0x6400, 1024.0), "float32": ("uint32", 0x4B000000, 8388608.0)}


def _dequant_value(qw: te.Tensor, qs: te.Tensor, row, j, q: Quantization):
    """Element (row, j) of the dequantized weight: (code - 7) · scale of its group."""
    code = tirx.bitwise_and(tirx.shift_right(qw[row, j // q.per_word], (j % q.per_word * q.bits).astype("uint32")),
                            tirx.const((1 << q.bits) - 1, "uint32"))
    if not q.magic_int_to_float:
        return (code.astype(qs.dtype) - tirx.const(q.max_int, qs.dtype)) * qs[row, j // q.group_size]
    bits_dtype, magic, base = _MAGIC[str(qs.dtype)]
    as_float = tirx.reinterpret(qs.dtype, tirx.bitwise_or(code.astype(bits_dtype), tirx.const(magic, bits_dtype)))
    return (as_float - tirx.const(base + q.max_int, qs.dtype)) * qs[row, j // q.group_size]


def _dequant_matmul(x: Tensor, q_weight: nn.Parameter, q_scale: nn.Parameter, q: Quantization, k: int, n: int
                    ) -> Tensor:
    """x[..., k] @ W[n, k]^T with W unpacked inside the same PrimFunc: a block named "dequantize" (dlight
    inlines blocks by that name into the consumer) feeding the "matmul" block."""

    def compute(x: te.Tensor, qw: te.Tensor, qs: te.Tensor) -> te.Tensor:
        w = te.compute((n, k), lambda i, j: _dequant_value(qw, qs, i, j, q), name="dequantize")
        r = te.reduce_axis((0, k), name="k")
        return te.compute(list(x.shape[:-1]) + [n], lambda *idx: te.sum(x[(*idx[:-1], r)] * w[idx[-1], r], axis=r),
                          name="matmul")

    return op.tensor_expr_op(compute, "dequantize_matmul", [x, q_weight, q_scale])


class GroupQuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, q: Quantization):
        self.in_features, self.out_features, self.q = in_features, out_features, q
        self.q_weight = nn.Parameter((out_features, in_features // q.per_word), "uint32")
        self.q_scale = nn.Parameter((out_features, in_features // q.group_size), q.model_dtype)
        self.bias = nn.Parameter((out_features,), q.model_dtype) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        out = _dequant_matmul(x, self.q_weight, self.q_scale, self.q, self.in_features, self.out_features)
        return out + self.bias if self.bias is not None else out

    # nn.Module.to() would cast uint32 codes; keep storage dtypes fixed.
    def to(self, dtype: str | None = None) -> None:  # noqa: ARG002
        return None


class GroupQuantEmbedding(nn.Module):
    def __init__(self, num: int, dim: int, q: Quantization):
        self.num, self.dim, self.q = num, dim, q
        self.q_weight = nn.Parameter((num, dim // q.per_word), "uint32")
        self.q_scale = nn.Parameter((num, dim // q.group_size), q.model_dtype)

    def forward(self, ids: Tensor) -> Tensor:
        q, dim = self.q, self.dim

        def take_dequant(qw: te.Tensor, qs: te.Tensor, ids: te.Tensor) -> te.Tensor:
            return te.compute((ids.shape[0], dim), lambda i, j: _dequant_value(qw, qs, ids[i], j, q),
                              name="take_dequantize")

        return op.tensor_expr_op(take_dequant, "take_dequantize", [self.q_weight, self.q_scale, ids])

    def lm_head_forward(self, x: Tensor) -> Tensor:
        return _dequant_matmul(x, self.q_weight, self.q_scale, self.q, self.dim, self.num)

    def to(self, dtype: str | None = None) -> None:  # noqa: ARG002
        return None


# -- model surgery ---------------------------------------------------------------------------------------------

def quantize_model(model: nn.Module, q: Quantization) -> nn.Module:
    """Cast to the model dtype and, for group schemes, swap Linear/Embedding for their quantized forms."""
    model.to(q.model_dtype)
    if q.kind == "none":
        return model

    class _Swap(nn.Mutator):
        def visit_module(self, name: str, node: nn.Module):
            if isinstance(node, nn.Linear):
                return GroupQuantLinear(node.in_features, node.out_features, node.bias is not None, q)
            if isinstance(node, nn.Embedding):
                return GroupQuantEmbedding(node.num, node.dim, q)
            return self.visit(name, node)

    return _Swap().visit("", model)


def quantize_weights(named: dict[str, np.ndarray], param_names: set[str], q: Quantization) -> dict[str, np.ndarray]:
    """Turn float weights (keyed by our parameter names) into what the quantized model's parameters expect."""
    out: dict[str, np.ndarray] = {}
    for name, w in named.items():
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base is not None and f"{base}.q_weight" in param_names:
            out[f"{base}.q_weight"], out[f"{base}.q_scale"] = group_quantize(w, q)
        else:
            out[name] = w.astype(q.model_dtype)
    return out

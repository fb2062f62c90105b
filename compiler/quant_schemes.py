"""Quantization schemes: the registry and the numpy packers (no TVM import, so runtime-only tools can use them).

q4f16_1 / q4f32_1 are bit-compatible with MLC-LLM: groups of 32 along K, uint32[out, in/8] holding 8 nibbles low
nibble first, scale[out, in/32] in the model dtype, symmetric: q = clamp(round(w/scale) + 7, 0, 14), w ≈ (q-7)·scale.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mlcc.errors import UnknownQuantizationError


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


def get_quantization(name: str) -> Quantization:
    if name not in QUANTIZATIONS:
        raise UnknownQuantizationError(
            f"unknown quantization '{name}'; choose one of: {', '.join(QUANTIZATIONS)}")
    return QUANTIZATIONS[name]


# -- numpy: pack / unpack ----------------------------------------------------------------------------------------

def group_quantize(w: np.ndarray, q: Quantization) -> tuple[np.ndarray, np.ndarray]:
    """float[N, K] → (uint32[N, K/8], scale[N, K/32]) in MLC's q4 layout; leading dimensions (stacked experts,
    [E, N, K]) are kept: each row is quantized on its own."""
    if w.ndim > 2:
        packed, scale = group_quantize(w.reshape(-1, w.shape[-1]), q)
        return packed.reshape(*w.shape[:-1], -1), scale.reshape(*w.shape[:-1], -1)
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
    if packed.ndim > 2:
        w = group_dequantize(packed.reshape(-1, packed.shape[-1]), scale.reshape(-1, scale.shape[-1]), q)
        return w.reshape(*packed.shape[:-1], -1)
    n = packed.shape[0]
    shifts = (np.arange(q.per_word, dtype=np.uint32) * q.bits)
    codes = (packed[:, :, None] >> shifts) & ((1 << q.bits) - 1)
    codes = codes.reshape(n, -1).astype(np.float32) - q.max_int
    return codes * np.repeat(scale.astype(np.float32), q.group_size, axis=1)

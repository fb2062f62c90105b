"""The numpy packers of the group schemes (mlcc.quantization describes them; no TVM import, so runtime-only tools
can use them)."""

from __future__ import annotations

import numpy as np

# re-exported: callers of the packers name schemes through here
from mlcc.quantization import QUANTIZATIONS, Quantization, get_quantization  # noqa: F401

# -- numpy: pack / unpack ----------------------------------------------------------------------------------------

def group_quantize(w: np.ndarray, q: Quantization) -> tuple[np.ndarray, np.ndarray]:
    """float[N, K] → (codes[N, K/per_word], scale[N, K/group_size]) in `q`'s layout (symmetric); leading dimensions
    (stacked experts, [E, N, K]) are kept: each row is quantized on its own."""
    if w.ndim > 2:
        packed, scale = group_quantize(w.reshape(-1, w.shape[-1]), q)
        return packed.reshape(*w.shape[:-1], -1), scale.reshape(*w.shape[:-1], -1)
    n, k = w.shape
    if k % q.group_size:
        raise ValueError(f"cannot {q.name}-quantize a [{n}, {k}] weight: {k} is not a multiple of {q.group_size}")
    w32 = w.astype(np.float32).reshape(n, k // q.group_size, q.group_size)
    scale = np.abs(w32).max(axis=-1, keepdims=True) / q.max_int
    # Round the scale to its stored dtype first so dequantization reproduces exactly what we quantized against.
    scale = scale.astype(q.scale_dtype).astype(np.float32)
    safe = np.where(scale == 0, 1.0, scale)
    word = np.dtype(q.storage_dtype)
    codes = np.clip(np.round(w32 / safe) + q.max_int, 0, 2 * q.max_int).astype(word).reshape(n, k)
    codes = codes.reshape(n, k // q.per_word, q.per_word)
    shifts = (np.arange(q.per_word, dtype=word) * q.bits)
    packed = np.bitwise_or.reduce(codes << shifts, axis=-1).astype(word)
    return packed, scale.reshape(n, k // q.group_size).astype(q.scale_dtype)


def group_dequantize(packed: np.ndarray, scale: np.ndarray, q: Quantization) -> np.ndarray:
    """Inverse of group_quantize, in float32: the reference the compiled kernels are tested against."""
    if packed.ndim > 2:
        w = group_dequantize(packed.reshape(-1, packed.shape[-1]), scale.reshape(-1, scale.shape[-1]), q)
        return w.reshape(*packed.shape[:-1], -1)
    n = packed.shape[0]
    shifts = (np.arange(q.per_word, dtype=np.dtype(q.storage_dtype)) * q.bits)
    codes = (packed[:, :, None] >> shifts) & q.code_mask
    codes = codes.reshape(n, -1).astype(np.float32) - q.max_int
    return codes * np.repeat(scale.astype(np.float32), q.group_size, axis=1)

"""The numpy packers of the group and float8 schemes (mlcc.quantization describes them; no TVM import, so
runtime-only tools can use them)."""

from __future__ import annotations

import sys

import numpy as np

# re-exported: callers of the packers name schemes through here
from mlcc.quantization import QUANTIZATIONS, Quantization, get_quantization  # noqa: F401

# -- numpy: pack / unpack ----------------------------------------------------------------------------------------

def group_quantize(w: np.ndarray, q: Quantization) -> tuple[np.ndarray, ...]:
    """float[N, K] → (codes[N, K/per_word], scale[N, K/group_size]) in `q`'s layout, and for a zero-point scheme
    the packed zero points (q.zero_shape) after them; leading dimensions (stacked experts, [E, N, K]) are kept: each
    row is quantized on its own."""
    if w.ndim > 2:
        parts = group_quantize(w.reshape(-1, w.shape[-1]), q)
        return tuple(p.reshape(*w.shape[:-1], -1) for p in parts)
    n, k = w.shape
    if k % q.group_size:
        raise ValueError(f"cannot {q.name}-quantize a [{n}, {k}] weight: {k} is not a multiple of {q.group_size}")
    groups = np.asarray(w, dtype=np.float32).reshape(n, k // q.group_size, q.group_size)
    if not q.symmetric:
        return _asymmetric_quantize(groups, q)
    scale = np.abs(groups).max(axis=-1)
    scale /= q.max_int
    # Round the scale to its stored dtype first so dequantization reproduces exactly what we quantized against.
    scale = scale.astype(q.scale_dtype).astype(np.float32)
    safe = np.where(scale == 0, np.float32(1.0), scale)
    codes = np.divide(groups, safe[..., None], dtype=np.float32)  # the one full-size temporary, updated in place
    np.round(codes, out=codes)
    codes += q.zero_code
    np.clip(codes, 0, min(q.zero_code + q.max_int, q.code_mask), out=codes)
    return pack_codes(codes.reshape(n, k), q), scale.astype(q.scale_dtype)


def _asymmetric_quantize(groups: np.ndarray, q: Quantization) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round-to-nearest with a zero point per group: the group's range [min, max] (widened to hold 0) over all
    codes, as AWQ's and GPTQ's asymmetric quantizers start from."""
    n = groups.shape[0]
    lo = np.minimum(groups.min(axis=-1), 0)
    hi = np.maximum(groups.max(axis=-1), 0)
    scale = ((hi - lo) / q.code_mask).astype(q.scale_dtype).astype(np.float32)
    safe = np.where(scale == 0, np.float32(1.0), scale)
    zero = np.clip(np.round(-lo / safe), 0, q.code_mask)
    codes = np.divide(groups, safe[..., None], dtype=np.float32)
    np.round(codes, out=codes)
    codes += zero[..., None]
    np.clip(codes, 0, q.code_mask, out=codes)
    return pack_codes(codes.reshape(n, -1), q), scale.astype(q.scale_dtype), pack_zeros(zero, q)


def pack_codes(codes: np.ndarray, q: Quantization) -> np.ndarray:
    """Codes (whole numbers in 0..code_mask, any dtype) [N, K] → storage words [N, K/per_word], low code first."""
    n, k = codes.shape
    word = np.dtype(q.storage_dtype)
    if q.bits == 4 and sys.byteorder == "little":
        # two codes per byte, bytes in word order: the words are those bytes read as little-endian integers
        c = codes.astype(np.uint8)
        return np.ascontiguousarray(c[:, 0::2] | (c[:, 1::2] << 4)).view(word)
    if q.bits == 8 and sys.byteorder == "little":
        return np.ascontiguousarray(codes.astype(np.uint8)).view(word)   # one code per byte, likewise
    c = codes.astype(word).reshape(n, k // q.per_word, q.per_word)
    shifts = np.arange(q.per_word, dtype=word) * q.bits
    return np.bitwise_or.reduce(c << shifts, axis=-1).astype(word)


def pack_zeros(zeros: np.ndarray, q: Quantization) -> np.ndarray:
    """Zero points [N, groups] (whole numbers) → q.zero_shape words, the last word padded with zero codes."""
    n, g = zeros.shape
    padded = np.zeros((n, -(-g // q.per_word) * q.per_word), np.uint8)
    padded[:, :g] = zeros
    return pack_codes(padded, q)


def unpack_codes(words: np.ndarray, q: Quantization) -> np.ndarray:
    """Inverse of pack_codes: uint8 codes [N, words · per_word]."""
    shifts = np.arange(q.per_word, dtype=np.dtype(q.storage_dtype)) * q.bits
    return ((words[..., None] >> shifts) & q.code_mask).astype(np.uint8).reshape(*words.shape[:-1], -1)


def group_dequantize(packed: np.ndarray, scale: np.ndarray, q: Quantization, zeros: np.ndarray | None = None
                     ) -> np.ndarray:
    """Inverse of group_quantize, in float32: the reference the compiled kernels are tested against."""
    if packed.ndim > 2:
        w = group_dequantize(packed.reshape(-1, packed.shape[-1]), scale.reshape(-1, scale.shape[-1]), q,
                             None if zeros is None else zeros.reshape(-1, zeros.shape[-1]))
        return w.reshape(*packed.shape[:-1], -1)
    groups = scale.shape[-1]
    zero = (np.float32(q.zero_code) if q.symmetric else
            np.repeat(unpack_codes(zeros, q)[:, :groups].astype(np.float32), q.group_size, axis=1))
    codes = unpack_codes(packed, q).astype(np.float32) - zero
    return codes * np.repeat(scale.astype(np.float32), q.group_size, axis=1)


def float8_quantize(w: np.ndarray, q: Quantization) -> tuple[np.ndarray, np.ndarray]:
    """float[..., N, K] → (codes[..., N, K] in q.storage_dtype, float32 scale[..., N]): one scale per row, absmax
    mapped to the format's largest finite value, codes rounded to nearest even (ml_dtypes' cast)."""
    import ml_dtypes  # noqa: F401 - registers the float8 dtypes with numpy

    w = np.asarray(w, dtype=np.float32)
    scale = np.abs(w).max(axis=-1) / np.float32(q.float_max)
    safe = np.where(scale == 0, np.float32(1.0), scale)
    codes = np.divide(w, safe[..., None], dtype=np.float32)
    # (a quotient rounded up past the largest finite code would cast to NaN: e4m3fn has no infinity)
    np.clip(codes, -q.float_max, q.float_max, out=codes)
    return codes.astype(q.storage_dtype), scale.astype(q.scale_dtype)


def float8_dequantize(codes: np.ndarray, scale: np.ndarray, q: Quantization) -> np.ndarray:
    """Inverse of float8_quantize, in float32."""
    return codes.astype(np.float32) * scale.astype(np.float32)[..., None]


def quantize_weight(w: np.ndarray, q: Quantization) -> tuple[np.ndarray, ...]:
    """(codes, scales) of a float weight in scheme `q`'s stored layout, and the packed zero points of a zero-point
    scheme (in the order of stored_names)."""
    return float8_quantize(w, q) if q.kind == "float8" else group_quantize(w, q)


def dequantize_weight(codes: np.ndarray, scale: np.ndarray, q: Quantization, zeros: np.ndarray | None = None
                      ) -> np.ndarray:
    """The float32 weight scheme `q`'s stored (codes, scales[, zero points]) stand for: what compiled kernels are
    tested against."""
    return float8_dequantize(codes, scale, q) if q.kind == "float8" else group_dequantize(codes, scale, q, zeros)


def stored_names(q: Quantization) -> tuple[str, ...]:
    """The parameters a quantized projection stores, by suffix, in quantize_weight's order."""
    return ("q_weight", "q_scale") + (() if q.symmetric else ("q_zero",))

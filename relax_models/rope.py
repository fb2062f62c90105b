"""Rotary position embedding applied by the model (the KV cache then stores rotated keys and rotates nothing).

Used where TVM's cache-side RoPE does not fit: per-layer bases (Gemma 3's local layers), partial rotary and LongRoPE
(Phi-3), YaRN (gpt-oss, DeepSeek), and every model with sliding layers (TVM's cache would rotate keys inside
attention, where mlcc's CUDA kernels do not). The frequencies follow transformers' `ROPE_INIT_FUNCTIONS`, computed in
float32 like them; rotation is HF's `rotate_half` over the first `rotary_dim` channels of each q and k head.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import numpy as np
from tvm import te, tirx
from tvm.relax.frontend.nn import Tensor, op

from mlcc.errors import UnsupportedConfigError


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / np.power(np.float32(theta), exponents)).astype(np.float32)


def _llama3(inv: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - lo) / (hi - lo)
    scaled = np.where(wavelen > old / lo, inv / factor, inv)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    return np.where((wavelen >= old / hi) & (wavelen <= old / lo), mid, scaled).astype(np.float32)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(base: np.ndarray, theta: float, dim: int, s: dict[str, Any], max_positions: int
          ) -> tuple[np.ndarray, float]:
    """YaRN (gpt-oss, DeepSeek-V2/V3): the low frequencies interpolated by `factor`, the high ones kept, a linear
    ramp between, and cos/sin scaled by the attention factor; transformers' `_compute_yarn_parameters`."""
    original = int(s["original_max_position_embeddings"])
    factor = float(s.get("factor") or max_positions / original)
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else yarn_mscale(factor))
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    powers = np.power(np.float32(theta), np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim))
    interpolation = (np.float32(1.0) / (np.float32(factor) * powers)).astype(np.float32)
    inv = interpolation * (1 - extrapolation) + base * extrapolation
    return inv.astype(np.float32), float(attention)


class RopeFrequencies:
    """inv_freq per rotary pair for one layer kind, plus LongRoPE's second table and the cos/sin factor."""

    def __init__(self, theta: float, rotary_dim: int, scaling: dict[str, Any] | None, max_positions: int):
        kind = (scaling or {}).get("rope_type", "default")
        self.attention_factor = 1.0
        self.long: np.ndarray | None = None
        self.long_from = 0
        base = _base_inv_freq(theta, rotary_dim)
        if kind == "default":
            self.inv = base
        elif kind == "linear":
            self.inv = (base / np.float32(scaling["factor"])).astype(np.float32)
        elif kind == "llama3":
            self.inv = _llama3(base, scaling)
        elif kind == "yarn":
            self.inv, self.attention_factor = _yarn(base, theta, rotary_dim, scaling, max_positions)
        elif kind == "longrope":
            # Phi-3: short factors up to the original context, long ones past it (per position, as vLLM does;
            # HF switches the whole sequence once it grows past the original context)
            original = int(scaling.get("original_max_position_embeddings") or max_positions)
            exps = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rotary_dim)
            powers = np.power(np.float32(theta), exps)
            self.inv = (1.0 / (np.asarray(scaling["short_factor"], np.float32) * powers)).astype(np.float32)
            self.long = (1.0 / (np.asarray(scaling["long_factor"], np.float32) * powers)).astype(np.float32)
            self.long_from = original
            factor = scaling.get("factor") or max_positions / original
            self.attention_factor = float(scaling.get("attention_factor") or (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))))
        else:
            raise UnsupportedConfigError(
                f"rope_scaling type {kind!r} is not supported with this model's attention layout (sliding windows, "
                "partial rotary or per-layer RoPE bases); supported: default, linear, llama3, longrope, yarn")
        if self.inv.shape != (rotary_dim // 2,) or (self.long is not None and self.long.shape != self.inv.shape):
            raise UnsupportedConfigError(f"rope_scaling factors must have rotary_dim / 2 = {rotary_dim // 2} entries")


def rope_for_layer(cfg: Any, layer_id: int) -> Callable[[Tensor, Tensor, int], Tensor]:
    """rotate(qkv [b, s, heads, d], positions [b·s] int32, rotated heads) for this layer of a DecoderConfig."""
    sliding = cfg.is_sliding(layer_id)
    theta = cfg.rope_local_theta if sliding and cfg.rope_local_theta else cfg.rope_theta
    # Gemma 3 scales only its global layers' RoPE (the local ones keep the plain local base)
    scaling = None if sliding and cfg.rope_local_theta else cfg.rope_scaling
    freqs = RopeFrequencies(theta, cfg.rotary_dim, scaling, cfg.context_window_size)
    rot = cfg.rotary_dim

    def rotate(qkv: Tensor, positions: Tensor, rope_heads: int,
               before: tuple[Callable[..., te.Tensor], list[Tensor]] | None = None) -> Tensor:
        """`before`: (te function of x and its own tensors, those tensors) applied to x in the same kernel."""
        b, s, heads, d = qkv.shape
        flat = op.reshape(qkv, (b * s, heads, d))
        tables = [Tensor.from_const(freqs.inv)] + ([Tensor.from_const(freqs.long)] if freqs.long is not None else [])
        fn = functools.partial(_rotate_te, rope_heads=rope_heads, rot=rot, factor=freqs.attention_factor,
                               long_from=freqs.long_from)
        if before is None:
            out = op.tensor_expr_op(fn, "rope", [flat, positions, *tables])
        else:
            first, extra = before
            n = len(extra)
            out = op.tensor_expr_op(lambda x, *rest: fn(first(x, *rest[:n]), *rest[n:]), "rope",
                                    [flat, *extra, positions, *tables])
        return op.reshape(out, (b, s, heads, d))

    return rotate


def _rotate_te(x: te.Tensor, pos: te.Tensor, inv: te.Tensor, long: te.Tensor | None = None, *,
               rope_heads: int, rot: int, factor: float, long_from: int) -> te.Tensor:
    half = rot // 2
    dtype = x.dtype

    def value(t, h, i):
        j = tirx.indexmod(i, half)
        freq = inv[j] if long is None else tirx.if_then_else(pos[t] >= long_from, long[j], inv[j])
        angle = pos[t].astype("float32") * freq
        cos, sin = tirx.cos(angle), tirx.sin(angle)
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        partner = tirx.if_then_else(i < half, -x[t, h, tirx.min(i + half, rot - 1)].astype("float32"),
                                    x[t, h, tirx.max(i - half, 0)].astype("float32"))
        rotated = (x[t, h, i].astype("float32") * cos + partner * sin).astype(dtype)
        return tirx.if_then_else(tirx.all(h < rope_heads, i < rot), rotated, x[t, h, i])

    return te.compute(x.shape, value, name="rope")

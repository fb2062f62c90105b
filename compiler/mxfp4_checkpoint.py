"""gpt-oss checkpoints as OpenAI publishes them: the expert weights in MXFP4 (config.json's quantization_config
`{"quant_method": "mxfp4"}`), everything else in bfloat16.

Each expert projection `<experts>.<proj>` is stored as `<proj>_blocks` (uint8 [E, out, in / 32, 16]: two 4-bit
E2M1 codes a byte, the low nibble first) and `<proj>_scales` (uint8 [E, out, in / 32]: a power-of-two exponent
biased by 127 for each block of 32). They are read here under the name and layout of transformers'
dequantized model (`<experts>.<proj>`, [E, in, out]), which the family's weight plan reads either way: dequantized
to float32, and as their codes and exponents, which the model keeps as they are (the MXFP4 scheme of
mlcc.quantization, decoded by the expert kernels). llama.cpp's GGUF stores the same values as GGML blocks of 17
bytes (the exponent, then 16 bytes whose low nibbles are codes 0-15 and high nibbles codes 16-31), read by
`ggml_codes`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mlcc.errors import ModelSourceError

log = logging.getLogger(__name__)

# E2M1: sign, two exponent bits, one mantissa bit
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def is_mxfp4(qc: dict[str, Any]) -> bool:
    return str(qc.get("quant_method", "")).lower() == "mxfp4"


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[..., G, 16] uint8 codes and [..., G] uint8 exponents → float32 [..., G * 32]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match")
    codes = np.empty((*blocks.shape[:-1], 32), np.float32)
    codes[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    codes[..., 1::2] = FP4_VALUES[blocks >> 4]
    codes *= np.exp2(scales.astype(np.float32) - 127)[..., None]
    return codes.reshape(*blocks.shape[:-2], -1)


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The nearest MXFP4 of float w [..., K] (K a multiple of 32) as (blocks, scales): the inverse of `dequantize`
    for values it represents exactly (tests write checkpoints with it)."""
    groups = w.reshape(*w.shape[:-1], -1, 32).astype(np.float32)
    amax = np.abs(groups).max(axis=-1)
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), 0).clip(-127, 127)
    scaled = groups / np.exp2(exp)[..., None]
    codes = np.abs(scaled[..., None] - FP4_VALUES).argmin(axis=-1).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(blocks), np.ascontiguousarray((exp + 127).astype(np.uint8))


def unpacked_codes(blocks: np.ndarray) -> np.ndarray:
    """[..., G, 16] bytes of two codes, low nibble first → uint8 codes [..., G * 32]."""
    codes = np.empty((*blocks.shape[:-1], 32), np.uint8)
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    return codes.reshape(*blocks.shape[:-2], -1)


def ggml_codes(raw: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """A GGML MXFP4 tensor's bytes (any shape holding its blocks in order) → (uint8 codes `shape`, uint8
    exponents `shape` with the last axis / 32)."""
    blocks = np.asarray(raw, np.uint8).reshape(*shape[:-1], shape[-1] // 32, 17)
    codes = np.concatenate([blocks[..., 1:] & 0x0F, blocks[..., 1:] >> 4], axis=-1)
    return codes.reshape(shape), np.ascontiguousarray(blocks[..., 0])


def add_dequantized_experts(tensors: dict[str, Callable[[], np.ndarray]], where: Path,
                            codes: dict[str, Callable[[], tuple[np.ndarray, np.ndarray]]] | None = None) -> int:
    """Register every `<proj>_blocks`/`<proj>_scales` pair of `tensors` as the float32 tensor `<proj>` in
    transformers' [E, in, out] layout, and in `codes` as its (codes, exponents) in that layout (K on the
    second-to-last axis, the exponents' divided by 32); returns how many."""
    pairs = [n.removesuffix("_blocks") for n in tensors if n.endswith("_blocks")]
    for base in pairs:
        if f"{base}_scales" not in tensors:
            raise ModelSourceError(f"{where}: '{base}_blocks' has no '{base}_scales'; the MXFP4 checkpoint is "
                                   "incomplete: download it again")

        def load(base: str = base) -> np.ndarray:
            w = dequantize(tensors[f"{base}_blocks"](), tensors[f"{base}_scales"]())
            return w.swapaxes(-1, -2) if w.ndim == 3 else w.T

        def load_codes(base: str = base) -> tuple[np.ndarray, np.ndarray]:
            c, e = unpacked_codes(tensors[f"{base}_blocks"]()), np.asarray(tensors[f"{base}_scales"]())
            return c.swapaxes(-1, -2), e.swapaxes(-1, -2)

        tensors[base] = load
        if codes is not None:
            codes[base] = load_codes
    if pairs:
        log.info("MXFP4 checkpoint: %d expert weights, kept as published where the family stores MXFP4 experts",
                 len(pairs))
    return len(pairs)

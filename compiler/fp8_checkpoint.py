"""FP8 checkpoints as published: what their quantization_config says, and each FP8 weight as its raw e4m3 codes with
their scales or dequantized to float32.

Two formats are read:
- compressed-tensors (llm-compressor's FP8 / FP8-dynamic / FP8-block recipes): `<layer>.weight` float8_e4m3fn with
  `<layer>.weight_scale` ([out, 1] per channel, [1] per tensor, [ceil(out/r), ceil(in/c)] per block), maybe a static
  `<layer>.input_scale`;
- transformers' `fp8` (FineGrainedFP8: DeepSeek-V3, Qwen3-FP8): `<layer>.weight` float8_e4m3fn with
  `<layer>.weight_scale_inv` [ceil(out/r), ceil(in/c)] (or one value without `weight_block_size`), maybe a static
  `<layer>.activation_scale`.
Both mean weight = codes × the scale of the block the element lies in. Which layers are FP8 is read from the
tensors themselves (a float8 weight with its scale), so `ignore` lists need no matching here.

4-bit checkpoints (AWQ, GPTQ, compressed-tensors pack-quantized) are read by int4_checkpoint.py. Anything else a
config can ask for (int8 packing, NVFP4, 2:4 sparsity, rotations, asymmetric FP8, other
quantization methods) is one ModelSourceError naming it and the way out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from mlcc.errors import ModelSourceError

_FLOAT_FIX = ("use the model's unquantized (float16/bfloat16) checkpoint, which mlcc quantizes itself "
              "(--quant q4f16_1 and the others)")


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    """How a checkpoint's FP8 weights are stored and how its authors quantized activations."""

    method: str                          # "compressed-tensors" | "fp8" (transformers' FineGrainedFP8)
    strategy: str                        # weight scales: "tensor" | "channel" | "group" | "block"
    block_size: tuple[int, int] | None   # (rows, cols) one scale covers: block's shape, (1, group size); else None
    activation_scheme: str | None        # "dynamic" | "static" | None (weight-only FP8)
    activation_strategy: str | None      # "token" | "tensor" | "group" (per token, groups of activation_group_size)
    activation_group_size: int | None
    ignore: tuple[str, ...]              # modules the config keeps in float (informational)
    scale_suffix: str                    # "weight_scale" | "weight_scale_inv": the scale tensor beside `.weight`
    input_scale_suffixes: tuple[str, ...]  # names a static activation scale goes by beside `.weight`

    def describe(self) -> str:
        """e.g. "compressed-tensors, per-channel weight scales, dynamic per-token activations"."""
        weights = {"tensor": "per-tensor", "channel": "per-channel"}.get(self.strategy) or \
            f"{self.strategy} {self.block_size[0]}x{self.block_size[1]}"
        acts = ("weight-only" if self.activation_scheme is None else
                f"{self.activation_scheme} per-{self.activation_strategy} activations")
        return f"{self.method}, {weights} weight scales, {acts}"


@dataclasses.dataclass
class Fp8Weight:
    """One FP8 weight: codes [out, in] (float8_e4m3fn, a view of the file) and the float32 scale grid
    [ceil(out/block[0]), ceil(in/block[1])]: element (i, j) stands for codes[i, j] * scale[i // block[0],
    j // block[1]]. Per-tensor and per-channel scales are grids too (block (out, in) and (1, in))."""

    codes: np.ndarray
    scale: np.ndarray
    block: tuple[int, int]
    input_scale: np.ndarray | None = None   # float32 [1]: the static activation scale, where the checkpoint has one

    def row_scales(self) -> np.ndarray | None:
        """float32 [out], one scale per row, where every element of a row shares its row's scale (per-tensor,
        per-channel, or blocks as wide as the row); None where scales vary along a row."""
        if self.scale.shape[1] != 1:
            return None
        return np.repeat(self.scale[:, 0], self.block[0])[: self.codes.shape[0]].astype(np.float32)

    def dequantize(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows start..stop-1 as float32."""
        stop = self.codes.shape[0] if stop is None else stop
        w = self.codes[start:stop].astype(np.float32)
        rows, cols = w.shape
        s = self.scale[np.arange(start, stop) // self.block[0]]          # [rows, column blocks]
        full, rem = divmod(cols, self.block[1])
        if rem == 0:   # a view of w: scaled in place, no second weight-sized array
            w.reshape(rows, full, self.block[1])[...] *= s[:, :, None]
            return w
        head = w[:, : full * self.block[1]].reshape(rows, full, self.block[1]) * s[:, :full, None]
        w[:, : full * self.block[1]] = head.reshape(rows, -1)
        w[:, full * self.block[1]:] *= s[:, full:]
        return w


def checkpoint_quantization(config: dict[str, Any], where: Path) -> Fp8Format | None:
    """The FP8 format config.json's quantization_config describes; None for a checkpoint of float weights. Any other
    quantization is a ModelSourceError naming what it is and what to use instead."""
    qc = config.get("quantization_config") or config.get("compression_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "?")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    if method == "fp8":
        return _finegrained_fp8(qc, where)
    raise ModelSourceError(f"{where}: a checkpoint quantized with '{method}', which mlcc does not read (it reads FP8 "
                           "checkpoints: compressed-tensors float-quantized, transformers' fp8; and 4-bit AWQ, GPTQ "
                           f"and compressed-tensors pack-quantized ones); {_FLOAT_FIX}")


def _refuse(where: Path, what: str, fix: str = _FLOAT_FIX) -> ModelSourceError:
    return ModelSourceError(f"{where}: {what}; {fix}")


_CT_FP8_FORMATS = ("float-quantized", "naive-quantized")
_CT_FORMAT_NAMES = {
    "int-quantized": "int8 weights and activations (W8A8-INT8)",
    "nvfp4-pack-quantized": "NVFP4 weights", "mxfp4-pack-quantized": "MXFP4 weights",
    "mxfp6-pack-quantized": "MXFP6 weights", "mxfp8-quantized": "MXFP8 weights",
    "marlin-24": "2:4 sparse Marlin weights", "sparse-24-bitmask": "2:4 sparse weights",
    "sparse-bitmask": "sparse (bitmask) weights",
}


def _compressed_tensors(qc: dict[str, Any], where: Path) -> Fp8Format:
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format") not in (None, "dense"):
        raise _refuse(where, f"a compressed-tensors checkpoint with {sparsity['format']} sparsity: sparse weights "
                      "are not supported", "use the model's dense checkpoint")
    if qc.get("transform_config"):
        raise _refuse(where, "a compressed-tensors checkpoint with rotations (transform_config: SpinQuant/QuIP "
                      "style): not supported")
    groups = qc.get("config_groups") or {}
    if qc.get("format") == "dense" and all(
            not isinstance(g, dict) or g.get("format") in (None, "dense") for g in groups.values()):
        return None   # saved uncompressed: float weights (already rounded to the scheme's values) and unused scales
    if not groups:
        raise _refuse(where, "a compressed-tensors checkpoint without config_groups: nothing says how its weights "
                      "are stored")
    formats = []
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise _refuse(where, f"compressed-tensors config group '{name}' is not a quantization scheme")
        fmt = group.get("format") or qc.get("format") or "?"
        if fmt not in _CT_FP8_FORMATS:
            what = _CT_FORMAT_NAMES.get(fmt, f"the compressed-tensors format '{fmt}'")
            raise _refuse(where, f"{what} (config group '{name}'): not supported yet, mlcc reads FP8 "
                          "float-quantized compressed-tensors checkpoints")
        formats.append(_ct_group(name, group, where))
    if len(set(formats)) > 1:
        raise _refuse(where, "a compressed-tensors checkpoint mixing several FP8 schemes "
                      f"({', '.join(sorted(groups))}): not supported yet")
    strategy, block, act = formats[0]
    return Fp8Format("compressed-tensors", strategy, block, *act, ignore=tuple(qc.get("ignore") or ()),
                     scale_suffix="weight_scale", input_scale_suffixes=("input_scale",))


def _ct_strategy(args: dict[str, Any]) -> str:
    """A QuantizationArgs' strategy, inferred from group_size where left out (as compressed-tensors infers it)."""
    if args.get("strategy"):
        return str(args["strategy"]).lower()
    group = args.get("group_size")
    return "tensor" if group is None else "channel" if group == -1 else "group"


def _ct_group(name: str, group: dict[str, Any], where: Path
              ) -> tuple[str, tuple[int, int] | None, tuple[str | None, str | None, int | None]]:
    w = group.get("weights")
    if not w:
        raise _refuse(where, f"compressed-tensors config group '{name}' quantizes no weights (activations only): "
                      "not supported")
    kind = f"{w.get('type', 'int')}{w.get('num_bits', 8)}"
    if kind != "float8":
        raise _refuse(where, f"{kind} weights (compressed-tensors config group '{name}'): not supported yet, mlcc "
                      "reads FP8 (float8) weights")
    if w.get("symmetric") is False:
        raise _refuse(where, f"asymmetric FP8 weights (zero points; config group '{name}'): not supported")
    if w.get("dynamic"):
        raise _refuse(where, f"dynamically quantized weights (config group '{name}'): not a stored format mlcc reads")
    strategy = _ct_strategy(w)
    if strategy == "block":
        bs = w.get("block_structure")
        if isinstance(bs, str):   # older checkpoints write "128x128"
            bs = [int(x) for x in bs.split("x")]
        if not (isinstance(bs, (list, tuple)) and len(bs) == 2 and all(int(b) > 0 for b in bs)):
            raise _refuse(where, f"block-quantized FP8 weights without a [rows, cols] block_structure (config "
                          f"group '{name}': {bs!r})", "the checkpoint's config.json is damaged: download it again")
        block: tuple[int, int] | None = (int(bs[0]), int(bs[1]))
    elif strategy == "group":
        if not (isinstance(w.get("group_size"), int) and w["group_size"] > 0):
            raise _refuse(where, f"group-quantized FP8 weights without a group_size (config group '{name}')",
                          "the checkpoint's config.json is damaged: download it again")
        block = (1, int(w["group_size"]))
    elif strategy in ("tensor", "channel"):
        block = None
    else:
        raise _refuse(where, f"FP8 weights with the '{strategy}' scale strategy (config group '{name}'): not "
                      "supported; mlcc reads tensor, channel, group and block scales")
    return strategy, block, _ct_activations(name, group.get("input_activations"), where)


def _ct_activations(name: str, a: dict[str, Any] | None, where: Path) -> tuple[str | None, str | None, int | None]:
    if not a:
        return None, None, None
    kind = f"{a.get('type', 'int')}{a.get('num_bits', 8)}"
    if kind != "float8":
        raise _refuse(where, f"FP8 weights with {kind} activations (config group '{name}'): not supported yet")
    strategy = _ct_strategy(a)
    dynamic = a.get("dynamic")
    if dynamic is True:
        if strategy not in ("token", "tensor", "group"):
            raise _refuse(where, f"dynamic '{strategy}' activation scales (config group '{name}'): not supported")
        return "dynamic", strategy, (int(a["group_size"]) if strategy == "group" else None)
    if dynamic in (False, None):
        if strategy != "tensor":
            raise _refuse(where, f"static '{strategy}' activation scales (config group '{name}'): not supported; "
                          "mlcc reads static per-tensor or dynamic activation scales")
        return "static", "tensor", None
    raise _refuse(where, f"activation scales that are '{dynamic}' (config group '{name}'): not supported")


def _finegrained_fp8(qc: dict[str, Any], where: Path) -> Fp8Format:
    if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
        raise _refuse(where, f"an fp8 checkpoint in the {qc['fmt']} format: not supported, mlcc reads e4m3")
    if qc.get("scale_fmt", "float") != "float":
        raise _refuse(where, f"an fp8 checkpoint with {qc['scale_fmt']} (power-of-two) scales: not supported yet, mlcc "
                      "reads float32 scales (DeepSeek-V3 style)")
    if qc.get("expert_dtype", "fp8") != "fp8":
        raise _refuse(where, f"an fp8 checkpoint with {qc['expert_dtype']} experts: not supported yet")
    bs = qc.get("weight_block_size")
    if bs is not None and not (isinstance(bs, (list, tuple)) and len(bs) == 2 and all(int(b) > 0 for b in bs)):
        raise _refuse(where, f"an fp8 checkpoint whose weight_block_size is {bs!r}, not [rows, cols]",
                      "the checkpoint's config.json is damaged: download it again")
    block = (int(bs[0]), int(bs[1])) if bs is not None else None
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme == "dynamic":   # transformers quantizes activations per token, in groups of a block's width
        act: tuple[str | None, str | None, int | None] = (
            ("dynamic", "group", block[1]) if block else ("dynamic", "token", None))
    elif scheme == "static":
        act = ("static", "tensor", None)
    else:
        raise _refuse(where, f"an fp8 checkpoint with activation_scheme '{scheme}': not supported (dynamic or "
                      "static)")
    ignore = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
    return Fp8Format("fp8", "block" if block else "tensor", block, *act, ignore=tuple(ignore),
                     scale_suffix="weight_scale_inv", input_scale_suffixes=("activation_scale", "input_scale"))


# -- the tensors ---------------------------------------------------------------------------------------------------

Loader = Callable[[], np.ndarray]


class _Entry(NamedTuple):
    scale: str                  # the scale tensor's name
    input_scale: str | None     # the static activation scale's name
    block: tuple[int, int]
    shape: tuple[int, int]


class Fp8Checkpoint:
    """The FP8 weights of a checkpoint: `weight(name)` gives one as codes + scales, `dequantized(name)` as float32."""

    def __init__(self, fmt: Fp8Format, where: Path, tensors: dict[str, Loader],
                 shapes: dict[str, tuple[str, list[int]]]):
        """tensors: every tensor's loader (float8 ones give their raw codes); shapes: name → (safetensors dtype,
        shape). Checks every FP8 weight against its scales now, so a damaged checkpoint fails before converting."""
        # its own copy of the raw loaders: the caller may replace the FP8 weights' entries with dequantizing ones
        self.format, self._where, self._tensors = fmt, where, dict(tensors)
        self._names: dict[str, _Entry] = {}
        for name, (dtype, shape) in shapes.items():
            if dtype == "F8_E4M3":
                self._names[name] = self._check(name, shape, shapes)
        if not self._names:
            raise ModelSourceError(f"{where}: config.json says FP8 ({fmt.describe()}), but no tensor is float8_e4m3; "
                                   "the config and the weights come from different checkpoints: download them again")

    def _check(self, name: str, shape: list[int], shapes: dict[str, tuple[str, list[int]]]) -> _Entry:
        fmt, where = self.format, self._where
        base = name.removesuffix(".weight")
        if not name.endswith(".weight") or len(shape) != 2:
            raise ModelSourceError(f"{where}: float8 tensor '{name}' {shape} is not a 2-D layer weight; mlcc reads "
                                   "FP8 checkpoints whose float8 tensors are [out, in] weights")
        scale = f"{base}.{fmt.scale_suffix}"
        if scale not in shapes:
            raise ModelSourceError(f"{where}: float8 weight '{name}' has no '{scale}' beside it ({fmt.method} stores "
                                   "one); the checkpoint is incomplete or of another format: download it again")
        if f"{base}.weight_zero_point" in shapes:
            raise _refuse(where, f"'{name}' has zero points (asymmetric FP8): not supported")
        out, cols = shape
        block = fmt.block_size or ((out, cols) if fmt.strategy == "tensor" else (1, cols))
        expected = [math.ceil(out / block[0]), math.ceil(cols / block[1])]
        got = shapes[scale][1]
        if [d for d in got if d != 1] != [d for d in expected if d != 1]:   # [out] for [out, 1], [] for [1, 1]
            raise ModelSourceError(f"{where}: '{scale}' has shape {got}, {fmt.strategy} scales of a {shape} weight "
                                   f"have {expected}; the checkpoint and its config.json disagree: download them "
                                   "again")
        inputs = [f"{base}.{s}" for s in fmt.input_scale_suffixes if f"{base}.{s}" in shapes]
        if fmt.activation_scheme == "static" and not inputs:
            raise ModelSourceError(
                f"{where}: config.json says activations have static scales, but '{name}' has no "
                f"'{base}.{fmt.input_scale_suffixes[0]}'; the config and the weights disagree: download the "
                "checkpoint again, or set the activations to dynamic in config.json if that is how it was made")
        if fmt.activation_scheme != "static" and inputs:
            raise ModelSourceError(
                f"{where}: '{inputs[0]}' is a static activation scale, but config.json says activations are "
                f"{fmt.activation_scheme or 'not quantized'}; the config and the weights disagree: download the "
                "checkpoint again")
        if inputs and math.prod(shapes[inputs[0]][1]) != 1:
            raise _refuse(where, f"'{inputs[0]}' has {math.prod(shapes[inputs[0]][1])} static activation scales: "
                          "not supported, mlcc reads one per layer")
        return _Entry(scale, inputs[0] if inputs else None, block, (out, cols))

    def names(self) -> list[str]:
        """The checkpoint names of every FP8 weight."""
        return list(self._names)

    def weight(self, name: str) -> Fp8Weight | None:
        """`name` (a checkpoint `<layer>.weight`) as codes + scales; None where that weight is not FP8."""
        if name not in self._names:
            return None
        scale, input_scale, block, _ = self._names[name]
        codes = self._tensors[name]()
        grid = np.asarray(self._tensors[scale](), dtype=np.float32).reshape(
            math.ceil(codes.shape[0] / block[0]), math.ceil(codes.shape[1] / block[1]))
        act = np.asarray(self._tensors[input_scale](), dtype=np.float32).reshape(1) if input_scale else None
        return Fp8Weight(codes, grid, block, act)

    def dequantized(self, name: str) -> Loader:
        """A loader of FP8 weight `name` as float32."""
        return lambda: self.weight(name).dequantize()

    def dequantized_rows(self, name: str) -> tuple[int, Callable[[int, int], np.ndarray]]:
        """(rows, read(start, stop)) of FP8 weight `name`, dequantized a few rows at a time."""
        return self._names[name].shape[0], lambda start, stop: self.weight(name).dequantize(start, stop)

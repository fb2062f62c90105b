"""Published 4-bit checkpoints (AWQ, GPTQ, compressed-tensors pack-quantized): what their quantization_config says,
and each quantized weight as its 4-bit codes, scales and zero points, or dequantized to float32.

The stored layouts, all with w = (q - z) · s per group of input channels:
- AWQ (version "gemm"): `<layer>.qweight` int32 [in, out/8], eight output columns a word in AWQ's interleaved
  order (nibble p holds column [0, 2, 4, 6, 1, 3, 5, 7][p] of its eight), `<layer>.qzeros` int32 [in/g, out/8] in the
  same order, `<layer>.scales` float16 [in/g, out].
- GPTQ: `<layer>.qweight` int32 [in/8, out], eight input rows a word, low nibble first; `<layer>.qzeros` int32
  [in/g, out/8], eight output columns a word in order; `<layer>.scales` [in/g, out]; `<layer>.g_idx` [in], each input
  channel's group. Old GPTQ/AutoGPTQ checkpoints (checkpoint_format "gptq", the default) store every zero point less
  one, gptqmodel's "gptq_v2" as it is; symmetric checkpoints have every zero point 8.
- compressed-tensors pack-quantized (W4A16): `<layer>.weight_packed` int32 [out, in/8], eight input channels a word,
  low nibble first, each code the signed value plus 8; `<layer>.weight_scale` [out, in/g]; asymmetric ones
  `<layer>.weight_zero_point` int32 [out/8, in/g] (packed along the output rows, each plus 8 too); `weight_g_idx`
  with activation ordering.

Act-order (GPTQ desc_act, compressed-tensors actorder "group") puts input channel i in group g_idx[i] rather than
i // g. Such weights load (dequantized with their g_idx), but are not kept as published: their groups are scattered
over the input, so keeping them would need either a scale gather per input channel in every kernel, or a
permutation of each projection's activations at run time (and q/k/v, gate/up would share their input only where
they share their permutation). The 4-bit schemes that keep them refuse such a weight, naming the re-quantizing
scheme instead; a g_idx that is plain i // g (static groups) is kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mlcc.errors import ModelSourceError

Loader = Callable[[], np.ndarray]
_FIX = ("use the model's unquantized (float16/bfloat16) checkpoint, which mlcc quantizes itself (--quant q4f16_1 "
        "and the others), or a 4-bit AWQ/GPTQ/compressed-tensors W4A16 one")
_AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])   # the output column each nibble of an AWQ word holds
_SHIFTS = np.arange(8, dtype=np.uint32) * 4


@dataclasses.dataclass(frozen=True)
class Int4Format:
    """How a checkpoint's 4-bit weights are stored."""

    method: str             # "awq" | "gptq" | "compressed-tensors"
    group_size: int         # input channels sharing a scale; 0: the whole row (per channel)
    symmetric: bool         # every zero point 8 (none stored, or all stored as 8)
    version: str            # awq "gemm"; gptq "gptq" (zero points stored less one) | "gptq_v2"; "pack-quantized"
    desc_act: bool
    ignore: tuple[str, ...] = ()

    def describe(self) -> str:
        """e.g. "awq gemm, group 128, zero points"."""
        group = f"group {self.group_size}" if self.group_size else "per-channel"
        return f"{self.method} {self.version}, {group}, {'symmetric' if self.symmetric else 'zero points'}" + \
            (", act-order" if self.desc_act else "")

    def scheme(self, model_dtype: str) -> str:
        """The mlcc scheme that keeps these weights as published (mlcc.quantization)."""
        return f"q4{'f32' if model_dtype == 'float32' else 'f16'}_{'g128' if self.symmetric else 'awq'}"


@dataclasses.dataclass
class Int4Weight:
    """One 4-bit weight: codes uint8 [out, in] (0..15), scales float32 [out, groups] (exact: the published float16 or
    bfloat16 values), zero points uint8 [out, groups] (None: 8 throughout) and the group of each input channel where
    it is not i // group_size."""

    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None
    group_size: int
    g_idx: np.ndarray | None = None

    def dequantize(self) -> np.ndarray:
        """float32 [out, in]."""
        group = self.g_idx if self.g_idx is not None else np.arange(self.codes.shape[1]) // self.group_size
        zero = np.float32(8) if self.zero is None else self.zero[:, group].astype(np.float32)
        return (self.codes.astype(np.float32) - zero) * self.scale[:, group]

    def regrouped(self, group_size: int) -> Int4Weight:
        """The same values with scales and zero points per `group_size` channels (each published group repeated),
        for a published group that is a multiple of it; ValueError otherwise, or with act-order groups."""
        if self.g_idx is not None:
            raise ValueError("its input channels are in act-order (desc_act) groups, not contiguous ones")
        if self.group_size % group_size or self.codes.shape[1] % group_size:
            raise ValueError(f"its groups of {self.group_size} input channels do not split into groups of "
                             f"{group_size}")
        times = self.group_size // group_size
        return Int4Weight(self.codes, np.repeat(self.scale, times, axis=1),
                          None if self.zero is None else np.repeat(self.zero, times, axis=1), group_size)


def _refuse(where: Path, what: str, fix: str = _FIX) -> ModelSourceError:
    return ModelSourceError(f"{where}: {what}; {fix}")


def is_int4(qc: dict[str, Any]) -> bool:
    """Whether a quantization_config describes a checkpoint this module reads (or refuses as a 4-bit one)."""
    method = str(qc.get("quant_method", "")).lower()
    if method in ("awq", "gptq"):
        return True
    groups = qc.get("config_groups") or {}
    return method == "compressed-tensors" and any(
        isinstance(g, dict) and (g.get("format") or qc.get("format")) == "pack-quantized" for g in groups.values())


def int4_format(qc: dict[str, Any], where: Path) -> Int4Format:
    """The Int4Format of a quantization_config is_int4 accepts; a ModelSourceError naming anything unservable."""
    method = str(qc["quant_method"]).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    bits = qc.get("bits", qc.get("w_bit", 4))
    if bits != 4:
        raise _refuse(where, f"a {bits}-bit {method.upper()} checkpoint: not supported, mlcc reads 4-bit ones")
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise _refuse(where, f"an AWQ checkpoint of version '{version}' (its own packing): not supported, mlcc "
                          "reads AWQ's 'gemm' layout")
        if not qc.get("zero_point", True):
            raise _refuse(where, "an AWQ checkpoint without zero points: not supported, mlcc reads AWQ's zero-point "
                          "'gemm' layout")
        return Int4Format("awq", _group(group, where), False, "gemm", False,
                          tuple(qc.get("modules_to_not_convert") or ()))
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(where, f"a GPTQ checkpoint in the '{fmt}' format (another kernel's packing): not supported, "
                      "mlcc reads the 'gptq' and 'gptq_v2' layouts")
    return Int4Format("gptq", _group(group, where), bool(qc.get("sym", True)), fmt, bool(qc.get("desc_act", False)),
                      tuple(qc.get("modules_to_not_convert") or ()))


def _group(group: int, where: Path) -> int:
    if group == -1:
        return 0
    if group <= 0 or group % 8:
        raise _refuse(where, f"a group size of {group}: not a whole number of 8-code words",
                      "the checkpoint's config.json is damaged: download it again")
    return group


def _compressed_tensors(qc: dict[str, Any], where: Path) -> Int4Format:
    if (qc.get("sparsity_config") or {}).get("format") not in (None, "dense"):
        raise _refuse(where, "a compressed-tensors checkpoint with sparse weights: not supported",
                      "use the model's dense checkpoint")
    if qc.get("transform_config"):
        raise _refuse(where, "a compressed-tensors checkpoint with rotations (transform_config): not supported")
    found = set()
    for name, group in (qc.get("config_groups") or {}).items():
        fmt = group.get("format") or qc.get("format")
        w = group.get("weights") or {}
        if fmt != "pack-quantized":
            raise _refuse(where, f"a compressed-tensors checkpoint mixing pack-quantized and {fmt} config groups "
                          f"('{name}'): not supported")
        kind = f"{w.get('type', 'int')}{w.get('num_bits', 8)}"
        if kind != "int4":
            raise _refuse(where, f"{kind} pack-quantized weights (config group '{name}'): not supported, mlcc reads "
                          "int4 (W4A16)")
        if group.get("input_activations"):
            raise _refuse(where, f"int4 weights with quantized activations (config group '{name}'): not supported, "
                          "mlcc reads W4A16")
        if w.get("dynamic"):
            raise _refuse(where, f"dynamically quantized weights (config group '{name}'): not a stored format")
        strategy = str(w.get("strategy") or ("group" if w.get("group_size") else "channel")).lower()
        if strategy not in ("group", "channel", "tensor"):
            raise _refuse(where, f"int4 weights with the '{strategy}' scale strategy (config group '{name}'): not "
                          "supported; mlcc reads tensor, channel and group scales")
        group_size = _group(int(w["group_size"]), where) if strategy == "group" else 0
        actorder = str(w.get("actorder") or "").lower() in ("group", "dynamic", "true")
        found.add((group_size, w.get("symmetric", True) is not False, actorder))
    if len(found) != 1:
        raise _refuse(where, "a compressed-tensors checkpoint mixing several int4 schemes: not supported yet")
    group_size, symmetric, actorder = found.pop()
    return Int4Format("compressed-tensors", group_size, symmetric, "pack-quantized", actorder,
                      tuple(qc.get("ignore") or ()))


# -- the tensors ---------------------------------------------------------------------------------------------------

def _nibbles(words: np.ndarray) -> np.ndarray:
    """int32 [..., w] → uint8 [..., w, 8]: each word's eight codes, low nibble first."""
    return ((words.view(np.uint32)[..., None] >> _SHIFTS) & 15).astype(np.uint8)


class Int4Checkpoint:
    """The 4-bit weights of a checkpoint by their float name (`<layer>.weight`): `weight(name)` as codes, scales and
    zero points, `dequantized(name)` as float32."""

    def __init__(self, fmt: Int4Format, where: Path, tensors: dict[str, Loader],
                 shapes: dict[str, tuple[str, list[int]]]):
        self.format, self._where, self._tensors, self._shapes = fmt, where, tensors, shapes
        marker = ".weight_packed" if fmt.method == "compressed-tensors" else ".qweight"
        self._names = {n.removesuffix(marker) + ".weight": n.removesuffix(marker) for n in shapes if
                       n.endswith(marker)}
        if not self._names:
            raise ModelSourceError(f"{where}: config.json says {fmt.method} 4-bit weights, but no tensor ends in "
                                   f"'{marker}'; the config and the weights come from different checkpoints: "
                                   "download them again")
        for name in self._names:
            self._check(name)

    def names(self) -> list[str]:
        return list(self._names)

    def holds(self, name: str) -> bool:
        """Whether `name` (a `<layer>.weight`) is one of the 4-bit weights."""
        return name in self._names

    def _shape(self, base: str, suffix: str) -> list[int] | None:
        entry = self._shapes.get(f"{base}.{suffix}")
        return None if entry is None else entry[1]

    def _check(self, name: str) -> None:
        """Every tensor of a layer there with the shapes its format gives (the weight's shape from its scales)."""
        base, fmt = self._names[name], self.format
        if fmt.method == "compressed-tensors":
            needed = ["weight_packed", "weight_scale"] + ([] if fmt.symmetric else ["weight_zero_point"])
        else:
            needed = ["qweight", "qzeros", "scales"]
        missing = [s for s in needed if self._shape(base, s) is None]
        if missing:
            raise ModelSourceError(f"{self._where}: '{base}.{needed[0]}' has no '{base}.{missing[0]}' beside it "
                                   f"({fmt.method} stores one); the checkpoint is incomplete: download it again")
        out, k = self.shape(name)
        groups = k // fmt.group_size if fmt.group_size else 1
        if fmt.method == "compressed-tensors":
            expected = {"weight_packed": [out, k // 8], "weight_scale": [out, groups],
                        "weight_zero_point": [-(-out // 8), groups]}
        else:
            expected = {"qweight": [k, out // 8] if fmt.method == "awq" else [k // 8, out],
                        "qzeros": [groups, out // 8], "scales": [groups, out]}
        if fmt.method == "compressed-tensors" and f"{base}.weight_shape" in self._tensors:
            stated = [int(d) for d in np.asarray(self._tensors[f"{base}.weight_shape"]()).ravel()]
            if stated != [out, k]:
                raise _refuse(self._where, f"'{base}' is a {stated} weight, packed into {out} rows of {k // 8} words: "
                              "mlcc reads weights whose input width is a multiple of 8")
        for suffix, want in expected.items():
            got = self._shape(base, suffix)
            if got is not None and got != want and not (suffix == "weight_scale" and got == [1] and out > 0):
                raise ModelSourceError(f"{self._where}: '{base}.{suffix}' has shape {got}; {fmt.describe()} of a "
                                       f"[{out}, {k}] weight stores {want}: the checkpoint and its config.json "
                                       "disagree, download them again")

    def shape(self, name: str) -> tuple[int, int]:
        """[out, in] of the float weight `name` stands for."""
        base, fmt = self._names[name], self.format
        if fmt.method == "compressed-tensors":
            packed = self._shape(base, "weight_packed")
            return packed[0], packed[1] * 8
        rows, cols = self._shape(base, "qweight")
        return (cols * 8, rows) if fmt.method == "awq" else (cols, rows * 8)

    def weight(self, name: str) -> Int4Weight | None:
        """`name` (a `<layer>.weight`) as published; None where that weight is not 4-bit."""
        if name not in self._names:
            return None
        base, fmt = self._names[name], self.format

        def get(suffix: str) -> np.ndarray:
            return self._tensors[f"{base}.{suffix}"]()

        out, k = self.shape(name)
        group = fmt.group_size or k
        g_idx = None
        if fmt.method == "awq":
            codes = _nibbles(get("qweight"))[..., np.argsort(_AWQ_ORDER)].reshape(k, out).T
            zero = _nibbles(get("qzeros"))[..., np.argsort(_AWQ_ORDER)].reshape(-1, out).T
            scale = get("scales").astype(np.float32).T
        elif fmt.method == "gptq":
            codes = _nibbles(get("qweight").T).reshape(out, k)
            zero = _nibbles(get("qzeros")).reshape(-1, out).T
            if fmt.version == "gptq":   # stored less one
                if (zero == 15).any():
                    raise ModelSourceError(
                        f"{self._where}: '{base}.qzeros' holds a zero point of 16 (stored as 15 less one, the old "
                        "GPTQ layout), which 4 bits cannot hold; use a gptq_v2 checkpoint or the float one")
                zero = zero + 1
            scale = get("scales").astype(np.float32).T
            if f"{base}.g_idx" in self._tensors:
                g_idx = np.asarray(get("g_idx"), np.int64)
        else:
            codes = _nibbles(get("weight_packed")).reshape(out, k)
            stored = get("weight_scale").astype(np.float32)
            scale = np.broadcast_to(stored.reshape(out if stored.size > 1 else 1, -1), (out, k // group))
            zero = None
            if not fmt.symmetric:
                # packed along the output rows: [ceil(out/8), groups] → [groups, out]
                zero = _nibbles(get("weight_zero_point").T).reshape(k // group, -1)[:, :out].T
            if f"{base}.weight_g_idx" in self._tensors:
                g_idx = np.asarray(get("weight_g_idx"), np.int64)
        if g_idx is not None and np.array_equal(g_idx, np.arange(k) // group):
            g_idx = None
        if fmt.symmetric and zero is not None:
            if not (zero == 8).all():
                raise ModelSourceError(f"{self._where}: config.json says symmetric, but '{base}' has zero points "
                                       "other than 8; the config and the weights disagree: download them again")
            zero = None
        return Int4Weight(np.ascontiguousarray(codes), np.ascontiguousarray(scale),
                          None if zero is None else np.ascontiguousarray(zero), group, g_idx)

    def dequantized(self, name: str) -> Loader:
        """A loader of 4-bit weight `name` as float32."""
        return lambda: self.weight(name).dequantize()

"""LoRA adapters on the device: PEFT adapters read and checked against the build's adaptable projections, and the
pool of adapter slots a LoRA build's forward functions read (relax_models/lora.py says how).

A build serving adapters (`CompileOptions.max_loras`) records in mlcc-config.json's "lora" the pool's geometry and
each adaptable projection: our name, its input width, the HF modules it fuses with their widths, and the factor its
weight was scaled by. An adapter's tensors map onto those by HF module name, so every family maps the same way.

A step where some token has an adapter runs the library's `<name>_lora` functions, which take the pool and one int32
slot per token (-1: no adapter): the slot of the sequence the token belongs to, bound by the engine core when the
sequence is admitted. A step where none has one runs the plain functions, as fast as a build without LoRA. Slots are filled on demand and reused least
recently used first, never while a running request's adapter holds them (the scheduler admits no more distinct
adapters than there are slots).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mlcc.errors import ArtifactError, LoraAdapterError
from mlcc.lora_format import LoraLayout
from mlcc.runtime.device.interface import KVCacheOps, ModelFunctions

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# the forward functions that a LoRA build has twins of, `<name>_lora`, taking (..., kv, lora_ids, lora_pool, params)
_FORWARD = ("prefill", "decode", "batch_prefill", "batch_decode")
# PEFT's tensor names: [base_model.model.]<module>.lora_A|B[.<adapter name>].weight
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_]+)?\.weight$")
_KEY_PREFIX = re.compile(r"^(?:base_model\.model\.)?")
_keys = itertools.count(1)


@dataclasses.dataclass(eq=False)
class LoraAdapter:
    """A checked adapter, its products ready for the pool: per target, A [parts, max_rank, in] and B [out, max_rank]
    with the scaling folded into B (None where the adapter leaves the target alone). key: unique per load, so a
    cached prefix computed with one adapter is never reused by another of the same name."""

    name: str
    path: Path
    rank: int
    weights: list[tuple[np.ndarray, np.ndarray] | None]
    key: int = dataclasses.field(default_factory=lambda: next(_keys))


def adapter_rank(path: str | Path) -> int:
    """The largest rank an adapter's config declares (to size a pool before the model is built)."""
    cfg = _read_config(Path(path))
    return max([int(cfg.get("r", 8))] + [int(v) for v in (cfg.get("rank_pattern") or {}).values()])


def _read_config(path: Path) -> dict[str, Any]:
    f = path / ADAPTER_CONFIG
    if not f.is_file():
        raise LoraAdapterError(f"{path}: no {ADAPTER_CONFIG}; pass a PEFT LoRA adapter folder (adapter_config.json "
                               f"and {ADAPTER_WEIGHTS})")
    try:
        return json.loads(f.read_text())
    except ValueError as e:
        raise LoraAdapterError(f"{f}: not valid JSON ({e})") from None


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    """The adapter's tensors as float32 (bfloat16 too, which numpy cannot read by itself)."""
    import ml_dtypes
    import safetensors

    f = path / ADAPTER_WEIGHTS
    if not f.is_file():
        raise LoraAdapterError(f"{path}: no {ADAPTER_WEIGHTS} (PEFT's .bin adapters are not read: save the adapter "
                               "with safe_serialization=True)")
    dtypes = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
    out = {}
    for name, t in safetensors.deserialize(f.read_bytes()):
        if t["dtype"] not in dtypes:
            raise LoraAdapterError(f"{f}: tensor {name} has dtype {t['dtype']}; LoRA weights must be floating point")
        out[name] = np.frombuffer(t["data"], dtype=dtypes[t["dtype"]]).reshape(t["shape"]).astype(np.float32)
    return out


def _check_config(cfg: dict[str, Any], where: Path) -> None:
    """Refuse the PEFT features a pool of plain A and B matrices cannot serve."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"{where} is a {cfg.get('peft_type')} adapter; only LoRA adapters are served")
    features = [("use_dora", "uses DoRA (use_dora)"), ("bias", "trains biases (bias)"),
                ("lora_bias", "trains a bias on lora_B (lora_bias)"),
                ("modules_to_save", "saves whole modules (modules_to_save)"),
                ("alpha_pattern", "sets per-module alphas (alpha_pattern)"),
                ("trainable_token_indices", "trains token embeddings (trainable_token_indices)"),
                ("target_parameters", "targets parameters (target_parameters)"),
                ("fan_in_fan_out", "stores GPT-2 Conv1D weights (fan_in_fan_out)")]
    for key, what in features:
        if cfg.get(key) not in (None, False, "none", [], {}):
            raise LoraAdapterError(f"LoRA adapter {where} {what}, which is not served; merge it into the model "
                                   "instead")


def read_adapter(name: str, path: str | Path, layout: LoraLayout) -> LoraAdapter:
    """A PEFT adapter folder checked against this build: every tensor a lora_A/lora_B pair of an adaptable module,
    shaped like the base model's projection, of rank at most the pool's; refused in one line naming the problem."""
    path = Path(path)
    if not path.is_dir():
        raise LoraAdapterError(f"LoRA adapter {name!r}: {path} is not a folder (pass a PEFT adapter folder)")
    cfg = _read_config(path)
    _check_config(cfg, path)
    tensors = _read_tensors(path)
    pairs: dict[str, dict[str, np.ndarray]] = collections.defaultdict(dict)
    others = []
    for key, value in tensors.items():
        m = _LORA_KEY.match(key)
        if m is None:
            others.append(_KEY_PREFIX.sub("", key))
        else:
            pairs[m["module"]][m["ab"]] = value
    modules = layout.modules()
    unknown = sorted({k.rsplit(".", 1)[-1] for k in pairs if k not in modules}
                     | {".".join(k.removesuffix(".weight").split(".")[-2:]) for k in others})
    if unknown:
        raise LoraAdapterError(f"LoRA adapter {name!r} targets modules this model cannot adapt: {', '.join(unknown)} "
                               f"(adaptable: {', '.join(layout.module_kinds())})")
    if not pairs:
        raise LoraAdapterError(f"LoRA adapter {name!r}: {path / ADAPTER_WEIGHTS} holds no lora_A/lora_B weights")
    alpha, rslora = float(cfg.get("lora_alpha", 8)), bool(cfg.get("use_rslora"))
    weights: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(layout.targets)
    rank = 0
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraAdapterError(f"LoRA adapter {name!r}: {module} has lora_{next(iter(ab))} without its "
                                   f"lora_{'B' if 'A' in ab else 'A'}")
        ti, part = modules[module]
        t = layout.targets[ti]
        a, b = ab["A"], ab["B"]
        r, rows = a.shape[0], t.parts[part][1]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != t.in_features or b.shape != (rows, r):
            raise LoraAdapterError(
                f"LoRA adapter {name!r} has the wrong base shapes: {module} lora_A {list(a.shape)}, lora_B "
                f"{list(b.shape)}, but this model's {module} maps {t.in_features} inputs to {rows} outputs (lora_A "
                f"[r, {t.in_features}], lora_B [{rows}, r]): it was trained for another base model")
        if r > layout.max_rank:
            raise LoraAdapterError(
                f"LoRA adapter {name!r} has rank {r} ({module}), over this build's max_lora_rank {layout.max_rank}; "
                f"rebuild with --option max_lora_rank={r} (mlcc serve/chat: --max-lora-rank {r})")
        rank = max(rank, r)
        scaling = alpha / (math.sqrt(r) if rslora else r) * t.scale
        if weights[ti] is None:
            weights[ti] = (np.zeros((len(t.parts), layout.max_rank, t.in_features), np.float32),
                           np.zeros((t.out_features, layout.max_rank), np.float32))
        pool_a, pool_b = weights[ti]
        start = sum(rows for _, rows in t.parts[:part])
        pool_a[part, :r] = a
        pool_b[start:start + rows, :r] = b * np.float32(scaling)
    np_dtype = _numpy_dtype(layout.dtype)
    weights = [None if w is None else (w[0].astype(np_dtype), w[1].astype(np_dtype)) for w in weights]
    log.info("LoRA adapter %r: rank %d, %d of %d projections, from %s", name, rank,
             sum(w is not None for w in weights), len(weights), path)
    return LoraAdapter(name, path, rank, weights)


def _numpy_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


class LoraPool:
    """The adapter slots on the device, which sequence uses which, and the forward functions that read them."""

    def __init__(self, layout: LoraLayout, dev):
        import tvm
        import tvm_ffi

        self.layout, self.dev = layout, dev
        L, R = layout.max_loras, layout.max_rank
        np_dtype = _numpy_dtype(layout.dtype)
        tensors, self._views = [], []   # _views[slot][target] = (A view, B view)
        for t in layout.targets:
            a = tvm.runtime.tensor(np.zeros((L, len(t.parts), R, t.in_features), np_dtype), dev)
            b = tvm.runtime.tensor(np.zeros((L, t.out_features, R), np_dtype), dev)
            tensors += [a, b]
        item = np.dtype(np_dtype).itemsize
        for slot in range(L):
            views = []
            for i, t in enumerate(layout.targets):
                a_shape, b_shape = (len(t.parts), R, t.in_features), (t.out_features, R)
                views.append((tensors[2 * i]._create_view(a_shape, layout.dtype, slot * math.prod(a_shape) * item),
                              tensors[2 * i + 1]._create_view(b_shape, layout.dtype,
                                                              slot * math.prod(b_shape) * item)))
            self._views.append(views)
        self.tensors = tvm_ffi.convert(tensors)   # one FFI Array: a Python list would be converted every call
        self._slots: collections.OrderedDict[int, int] = collections.OrderedDict()   # adapter key → slot, LRU first
        self._free = list(range(L))
        self._seq_slot: dict[int, int] = {}
        self._step = np.zeros(0, np.int32)
        self._id_buffers: dict[int, Any] = {}
        self.loads = 0

    @property
    def capacity(self) -> int:
        return self.layout.max_loras

    # -- slots ---------------------------------------------------------------------------------------------------
    def acquire(self, adapter: LoraAdapter, in_use: set[int]) -> int:
        """The slot holding `adapter`, written into a free slot or the least recently used one whose adapter no
        running request uses (keys in `in_use`)."""
        if adapter.key in self._slots:
            self._slots.move_to_end(adapter.key)
            return self._slots[adapter.key]
        if self._free:
            slot = self._free.pop(0)
        else:
            victim = next((k for k in self._slots if k not in in_use), None)
            if victim is None:
                raise RuntimeError(f"all {self.capacity} LoRA slots hold adapters of running requests")
            slot = self._slots.pop(victim)
        for (a_view, b_view), w, t in zip(self._views[slot], adapter.weights, self.layout.targets):
            if w is None:
                dtype = _numpy_dtype(self.layout.dtype)
                w = (np.zeros((len(t.parts), self.layout.max_rank, t.in_features), dtype),
                     np.zeros((t.out_features, self.layout.max_rank), dtype))
            a_view.copyfrom(w[0])
            b_view.copyfrom(w[1])
        self._slots[adapter.key] = slot
        self.loads += 1
        log.debug("LoRA adapter %r into slot %d", adapter.name, slot)
        return slot

    def resident(self) -> list[int]:
        """Keys of the adapters in slots, least recently used first."""
        return list(self._slots)

    def bind(self, seq_id: int, slot: int | None) -> None:
        """The sequence's tokens read adapter `slot` (None: none)."""
        if slot is None:
            self._seq_slot.pop(seq_id, None)
        else:
            self._seq_slot[seq_id] = slot

    # -- the forward functions -------------------------------------------------------------------------------------
    def wrap(self, fns: ModelFunctions, kv_ops: KVCacheOps, get: Callable[[str], Callable]
             ) -> tuple[ModelFunctions, KVCacheOps]:
        """`fns` whose forward functions run the library's `<name>_lora` twin (which takes each token's slot and the
        pool after the KV cache; get(name) looks it up) for a step where some token has an adapter, the plain one
        otherwise; and `kv_ops` whose begin_forward notes each step's sequences, which the slots are read from."""
        begin = kv_ops.begin_forward

        def begin_forward(kv, seq_ids, lens):
            slots = [self._seq_slot.get(int(s), -1) for s in seq_ids]
            self._step = np.repeat(np.asarray(slots, np.int32), [int(n) for n in lens])
            return begin(kv, seq_ids, lens)

        def forward(plain: Callable, with_lora: Callable) -> Callable:
            def call(*args):   # (..., kv, params) → (..., kv, lora_ids, lora_pool, params) with adapters
                if not (self._step >= 0).any():
                    return plain(*args)
                return with_lora(*args[:-1], self._step_ids(), self.tensors, args[-1])

            return call

        try:
            twins = {name: get(f"{name}_lora") for name in _FORWARD}
        except Exception as e:  # noqa: BLE001 - TVM's error for a function the library lacks
            raise ArtifactError(f"the library lacks the LoRA forward functions ({e.__class__.__name__}): built by an "
                                "earlier mlcc; recompile it") from None
        fns = dataclasses.replace(fns, **{name: forward(getattr(fns, name), twins[name]) for name in _FORWARD})
        return fns, dataclasses.replace(kv_ops, begin_forward=begin_forward)

    def _step_ids(self):
        """This step's slots on the device, in a buffer kept per length (as LoadedModel's token ids: a fresh one
        would be an allocation every decode step; the copy is queued behind the kernels that read the last one)."""
        import tvm

        n = self._step.size
        if n > 256:
            return tvm.runtime.tensor(self._step, self.dev)
        buf = self._id_buffers.get(n)
        if buf is None:
            buf = self._id_buffers[n] = tvm.runtime.empty((n,), "int32", self.dev)
        buf.copyfrom(self._step)
        return buf

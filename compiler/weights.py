"""Reading source weights (HF folder or GGUF file) and turning them into our parameters.

Sources expose HF tensor names; each family's weight plan says how our parameters are assembled from them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import struct
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from mlcc.errors import ModelSourceError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ModelSource:
    """A model on disk: its HF-style config, a lazy tensor table keyed by HF names, and where it came from."""

    kind: str                              # "hf" | "gguf"
    path: Path
    model_type: str                        # HF model_type or GGUF general.architecture
    config: dict[str, Any]
    tensors: dict[str, Callable[[], np.ndarray]]

    def get(self, name: str) -> np.ndarray:
        for alias in (name, *(name.replace(a, b, 1) for a, b in _PREFIX_ALIASES if name.startswith(a))):
            if alias in self.tensors:
                return self.tensors[alias]()
        stacked = self._stacked_experts(name)
        if stacked is not None:
            return stacked
        raise ModelSourceError(f"{self.path}: tensor '{name}' is missing from the checkpoint")

    def _stacked_experts(self, name: str) -> np.ndarray | None:
        """`<block>.experts.<proj>.weight` (one tensor over all experts, as GGUF stores them) from an HF
        checkpoint's per-expert `<block>.experts.<e>.<proj>.weight`, stacked to [E, out, in]."""
        m = _MERGED_EXPERTS.match(name)
        if m is None or f"{m[1]}.0.{m[2]}.weight" not in self.tensors:
            return None
        count = 0
        while f"{m[1]}.{count}.{m[2]}.weight" in self.tensors:
            count += 1
        return np.stack([self.tensors[f"{m[1]}.{e}.{m[2]}.weight"]() for e in range(count)])


# multimodal checkpoints name their language model one way on the Hub and another once transformers saves them
_PREFIX_ALIASES = (("model.language_model.", "language_model.model."),)
_MERGED_EXPERTS = re.compile(r"^(.*\.experts)\.([A-Za-z_][A-Za-z0-9_]*)\.weight$")


# -- safetensors (read with numpy memmaps: bf16 has no numpy dtype, so we widen it ourselves) ------------------

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
              "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _safetensors_index(path: Path) -> dict[str, Callable[[], np.ndarray]]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _ST_DTYPES:
            raise ModelSourceError(f"{path}: tensor '{name}' has unsupported dtype {meta['dtype']}")

        def load(meta=meta) -> np.ndarray:
            start, end = meta["data_offsets"]
            arr = np.memmap(path, dtype=_ST_DTYPES[meta["dtype"]], mode="r", offset=base + start,
                            shape=tuple(meta["shape"]) or (1,))
            if meta["dtype"] == "BF16":
                return (arr.astype(np.uint32) << 16).view(np.float32).reshape(meta["shape"])
            return np.asarray(arr).reshape(meta["shape"])

        out[name] = load
    return out


def load_hf_folder(path: Path) -> ModelSource:
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise ModelSourceError(f"{path}: no config.json; pass a Hugging Face model folder or a .gguf file")
    config = json.loads(cfg_path.read_text())
    tensors: dict[str, Callable[[], np.ndarray]] = {}
    st_files = sorted(path.glob("*.safetensors"))
    if st_files:
        for f in st_files:
            tensors.update(_safetensors_index(f))
    elif (path / "pytorch_model.bin").exists() or list(path.glob("pytorch_model-*.bin")):
        tensors.update(_torch_bin_index(path))
    else:
        raise ModelSourceError(f"{path}: no *.safetensors or pytorch_model*.bin weights found")
    return ModelSource("hf", path, config.get("model_type", "?"), config, tensors)


def _torch_bin_index(path: Path) -> dict[str, Callable[[], np.ndarray]]:
    try:
        import torch
    except ImportError as e:  # torch is a conversion-only dependency
        raise ModelSourceError(f"{path}: pytorch_model.bin needs torch to read; convert to safetensors or "
                               "`pip install torch`") from e
    out = {}
    for f in sorted(path.glob("pytorch_model*.bin")):
        sd = torch.load(f, map_location="cpu", weights_only=True)
        for k, v in sd.items():
            out[k] = (lambda v=v: v.float().numpy() if v.is_floating_point() else v.numpy())
    return out


# -- GGUF ------------------------------------------------------------------------------------------------------

def _gguf_field(reader, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.contents()


def _gguf_expected_size(path: Path) -> int | None:
    """The size a GGUF file's header says it has (the end of its last tensor's data), read without touching the
    data; None where even the header is unreadable."""
    import gguf

    class HeaderOnly(gguf.GGUFReader):
        end = 0

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            for field in fields:
                _, _, _, dims, raw_dtype, offset = field.parts
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_dtype[0]))]
                n_bytes = int(np.prod(dims)) * type_size // block
                self.end = max(self.end, int(start_offs + offset[0]) + n_bytes)
            self.tensors = []

    try:
        return HeaderOnly(str(path)).end
    except Exception:  # noqa: BLE001 - a header cut short too: the caller reports the file as unreadable
        return None


def load_gguf(path: Path) -> ModelSource:
    import gguf

    from mlcc.relax_models import family_for, gguf_model_type

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - gguf raises bare ValueErrors on bad magic
        expected, found = _gguf_expected_size(path), Path(path).stat().st_size
        if expected is not None and found < expected:
            raise ModelSourceError(f"{path}: truncated or incomplete file (expected {expected} bytes, found {found}); "
                                   "download it again") from None
        raise ModelSourceError(f"{path}: not a readable GGUF file ({e})") from e
    arch = _gguf_field(reader, "general.architecture")
    fields = {k: _gguf_field(reader, k) for k in reader.fields if not k.startswith("tokenizer.ggml.")}
    model_type = gguf_model_type(arch, fields)
    family = family_for(model_type, source="gguf")
    by_name = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in by_name:
        raise ModelSourceError(f"{path}: GGUF has no token_embd.weight")
    vocab = int(by_name["token_embd.weight"].shape[-1])
    config = family.gguf_config(fields, arch, vocab, has_output="output.weight" in by_name)
    config["model_type"] = model_type
    if "rope_factors_long.weight" in by_name:  # LongRoPE (Phi-3) keeps its factors as tensors
        from mlcc.relax_models.phi3 import gguf_rope_factors

        gguf_rope_factors({n: np.asarray(by_name[n].data, np.float32).ravel() for n in
                           ("rope_factors_long.weight", "rope_factors_short.weight") if n in by_name}, config)
    cfg = family.config_from_hf(config)

    # HF name → GGUF name through gguf's own table, so we do not maintain a second copy of llama.cpp's names.
    tmap = gguf.get_tensor_name_map(_gguf_arch_enum(arch), cfg.num_hidden_layers)
    fixups = family.gguf_fixups(cfg)
    tensors: dict[str, Callable[[], np.ndarray]] = {}
    for sources, _ in family.weight_plan(cfg).values():
        for hf_name in sources:
            g = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if g is None or g not in by_name:
                continue
            tensors[hf_name] = _gguf_loader(by_name[g], fixups.get(hf_name))
    return ModelSource("gguf", path, model_type, config, tensors)


def _gguf_arch_enum(arch: str):
    import gguf

    for k, v in gguf.MODEL_ARCH_NAMES.items():
        if v == arch:
            return k
    raise ModelSourceError(f"gguf package does not know architecture '{arch}'")


def _gguf_loader(t, fix: Callable | None) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        from gguf.quants import dequantize

        arr = dequantize(t.data, t.tensor_type)
        # GGUF lists dims fastest-first; numpy wants them slowest-first.
        arr = np.asarray(arr, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        return fix(arr) if fix else arr

    return load


def load_source(path: str | Path) -> ModelSource:
    p = Path(path)
    if not p.exists():
        raise ModelSourceError(f"{p}: no such file or folder")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelSourceError(f"{p}: expected a .gguf file or a Hugging Face model folder")
        return load_gguf(p)
    ggufs = sorted(p.glob("*.gguf"))
    if not (p / "config.json").exists() and len(ggufs) == 1:
        return load_gguf(ggufs[0])
    return load_hf_folder(p)


# -- our parameters ----------------------------------------------------------------------------------------------

def iter_float_params(source: ModelSource, family, cfg) -> Iterator[tuple[str, np.ndarray]]:
    """(our name, float32 array) for every parameter of the unquantized model, assembled per the family plan."""
    fixups = family.hf_fixups(cfg) if source.kind == "hf" else {}
    for ours, (names, combine) in family.weight_plan(cfg).items():
        parts = []
        for n in names:
            a = source.get(n)
            parts.append(fixups[n](a) if n in fixups else a)
        yield ours, (combine(parts) if combine else parts[0]).astype(np.float32, copy=False)

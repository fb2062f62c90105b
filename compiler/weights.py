"""Reading source weights (HF folder or GGUF file) and turning them into our parameters.

Sources expose HF tensor names; each family's weight plan says how our parameters are assembled from them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import mmap
import re
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from mlcc.errors import ModelSourceError

from .fp8_checkpoint import Fp8Checkpoint, Fp8Weight, checkpoint_quantization
from .int4_checkpoint import Int4Checkpoint, Int4Weight, int4_format, is_int4
from .mxfp4_checkpoint import add_dequantized_experts, ggml_codes, is_mxfp4

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ModelSource:
    """A model on disk: its HF-style config, a lazy tensor table keyed by HF names, and where it came from."""

    kind: str                              # "hf" | "gguf"
    path: Path
    model_type: str                        # HF model_type or GGUF general.architecture
    config: dict[str, Any]
    tensors: dict[str, Callable[[], np.ndarray]]
    # the 2-D tensors that can be read a few rows at a time, as float32 (rows, read(start, stop)): a big weight is
    # converted in slices instead of through one float copy of the whole matrix
    rows: dict[str, tuple[int, Callable[[int, int], np.ndarray]]] = dataclasses.field(default_factory=dict)
    # an FP8 checkpoint's weights as published (codes + scales); `tensors` and `rows` give them dequantized
    fp8: Fp8Checkpoint | None = None
    # a published 4-bit checkpoint's weights as stored (codes, scales, zero points); `tensors` gives them dequantized
    int4: Int4Checkpoint | None = None
    # MXFP4 weights (gpt-oss's experts) as (uint8 codes, uint8 exponents) in the layout `tensors` gives them
    # dequantized
    mxfp4: dict[str, Callable[[], tuple[np.ndarray, np.ndarray]]] = dataclasses.field(default_factory=dict)

    def _resolve(self, name: str) -> str | None:
        for alias in (name, *(name.replace(a, b, 1) for a, b in _PREFIX_ALIASES if name.startswith(a))):
            if alias in self.tensors:
                return alias
        return None

    def get(self, name: str) -> np.ndarray:
        alias = self._resolve(name)
        if alias is not None:
            return self.tensors[alias]()
        stacked = self._stacked_experts(name)
        if stacked is not None:
            return stacked
        raise ModelSourceError(f"{self.path}: tensor '{name}' is missing from the checkpoint")

    def fp8_weight(self, name: str) -> Fp8Weight | None:
        """An FP8 checkpoint's weight `name` as its e4m3 codes and scales; None where it is not stored in FP8."""
        alias = self._resolve(name)
        return self.fp8.weight(alias) if self.fp8 is not None and alias is not None else None

    def int4_weight(self, name: str) -> Int4Weight | None:
        """A 4-bit checkpoint's weight `name` as published; None where it is not stored in 4 bits."""
        alias = self._resolve(name)
        return self.int4.weight(alias) if self.int4 is not None and alias is not None else None

    def stored_int4(self, name: str) -> bool:
        """Whether weight `name` is stored in 4 bits (without reading it)."""
        alias = self._resolve(name)
        return self.int4 is not None and alias is not None and self.int4.holds(alias)

    def mxfp4_weight(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """An MXFP4 weight `name` as (codes, exponents), in the layout `get` gives it; None where not so stored."""
        alias = self._resolve(name)
        return self.mxfp4[alias]() if alias is not None and alias in self.mxfp4 else None

    def stored_mxfp4(self, name: str) -> bool:
        alias = self._resolve(name)
        return alias is not None and alias in self.mxfp4

    def row_reader(self, name: str) -> tuple[int, Callable[[int, int], np.ndarray]] | None:
        """(row count, read(start, stop) → float32 rows) of a 2-D tensor, or None where it is only read whole."""
        alias = self._resolve(name)
        return self.rows.get(alias) if alias is not None else None

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
_PREFIX_ALIASES = (("model.language_model.", "language_model.model."),
                   ("model.vision_tower.", "vision_tower.vision_model."), ("model.vision_tower.", "vision_tower."),
                   ("model.multi_modal_projector.", "multi_modal_projector."), ("lm_head.", "language_model.lm_head."))
_MERGED_EXPERTS = re.compile(r"^(.*\.experts)\.([A-Za-z_][A-Za-z0-9_]*)\.weight$")


# -- safetensors (read with numpy memmaps: bf16 has no numpy dtype, so we widen it ourselves) ------------------

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
              "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
              # read raw: only an FP8 checkpoint's reader (fp8_checkpoint.py) may use them, with their scales
              "F8_E4M3": ml_dtypes.float8_e4m3fn}


def _safetensors_index(path: Path, rows: dict[str, tuple[int, Callable[[int, int], np.ndarray]]] | None = None,
                       shapes: dict[str, tuple[str, list[int]]] | None = None) -> dict[str, Callable[[], np.ndarray]]:
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
            start = meta["data_offsets"][0]
            arr = np.memmap(path, dtype=_ST_DTYPES[meta["dtype"]], mode="r", offset=base + start,
                            shape=tuple(meta["shape"]) or (1,))
            if meta["dtype"] == "BF16":
                return (arr.astype(np.uint32) << 16).view(np.float32).reshape(meta["shape"])
            return np.asarray(arr).reshape(meta["shape"])

        out[name] = load
        if shapes is not None:
            shapes[name] = (meta["dtype"], list(meta["shape"]))
        if rows is not None and len(meta["shape"]) == 2:
            def read(start: int, stop: int, meta=meta) -> np.ndarray:
                k = meta["shape"][1]
                item = np.dtype(_ST_DTYPES[meta["dtype"]]).itemsize
                arr = np.memmap(path, dtype=_ST_DTYPES[meta["dtype"]], mode="r",
                                offset=base + meta["data_offsets"][0] + start * k * item, shape=(stop - start, k))
                if meta["dtype"] == "BF16":
                    return (arr.astype(np.uint32) << 16).view(np.float32)
                return np.asarray(arr, dtype=np.float32)

            rows[name] = (int(meta["shape"][0]), read)
    return out


def load_hf_folder(path: Path) -> ModelSource:
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise ModelSourceError(f"{path}: no config.json; pass a Hugging Face model folder or a .gguf file")
    config = json.loads(cfg_path.read_text())
    qc = config.get("quantization_config") or config.get("compression_config") or {}
    q4_format = int4_format(qc, path) if is_int4(qc) else None
    fp8_format = checkpoint_quantization(config, path) if q4_format is None and not is_mxfp4(qc) else None
    tensors: dict[str, Callable[[], np.ndarray]] = {}
    rows: dict[str, tuple[int, Callable[[int, int], np.ndarray]]] = {}
    shapes: dict[str, tuple[str, list[int]]] = {}
    st_files = sorted(path.glob("*.safetensors"))
    if st_files:
        for f in st_files:
            tensors.update(_safetensors_index(f, rows, shapes))
    elif fp8_format is not None or q4_format is not None:
        raise ModelSourceError(f"{path}: a quantized checkpoint without *.safetensors files; mlcc reads quantized "
                               "weights from safetensors, as they are published: download those")
    elif (path / "pytorch_model.bin").exists() or list(path.glob("pytorch_model-*.bin")):
        tensors.update(_torch_bin_index(path))
    else:
        raise ModelSourceError(f"{path}: no *.safetensors or pytorch_model*.bin weights found")
    fp8 = None
    if fp8_format is not None:
        fp8 = Fp8Checkpoint(fp8_format, path, tensors, shapes)
        for name in fp8.names():   # every reader of `tensors` and `rows` gets float32, as from any checkpoint
            tensors[name] = fp8.dequantized(name)
            rows[name] = fp8.dequantized_rows(name)
    else:
        raw = [n for n, (dtype, _) in shapes.items() if dtype == "F8_E4M3"]
        if raw:
            raise ModelSourceError(f"{path}: '{raw[0]}' is float8_e4m3, but config.json has no FP8 "
                                   "quantization_config saying how it is scaled; download the checkpoint's own "
                                   "config.json")
    mxfp4: dict[str, Callable[[], tuple[np.ndarray, np.ndarray]]] = {}
    if is_mxfp4(qc):  # (gpt-oss's experts)
        add_dequantized_experts(tensors, path, mxfp4)
    int4 = None
    if q4_format is not None:
        int4 = Int4Checkpoint(q4_format, path, tensors, shapes)
        for name in int4.names():   # every float reader gets them dequantized
            tensors[name] = int4.dequantized(name)
    return ModelSource("hf", path, config.get("model_type", "?"), config, tensors, rows, fp8, int4, mxfp4)


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

_GGUF_READER = None


def open_gguf(path: str | Path):
    """A `gguf.GGUFReader` of `path` that opens in a fraction of a second.

    gguf's reader builds two numpy memmap views per string of an array field; a 150k-token vocabulary with its
    merges takes it seconds and half a gigabyte. This subclass slices plain views of the same mapping and walks a
    string array's lengths with struct: the fields (parts, data indices, types) and tensors are the ones gguf's reader
    gives, tensor data included (plain ndarray views of the mapping instead of memmaps)."""
    global _GGUF_READER
    if _GGUF_READER is None:
        _GGUF_READER = _fast_gguf_reader_class()
    return _GGUF_READER(str(path))


def _fast_gguf_reader_class() -> type:
    import gguf
    from gguf import GGUFValueType

    class FastGGUFReader(gguf.GGUFReader):
        def _get(self, offset: int, dtype, count: int = 1, override_order: str | None = None) -> np.ndarray:
            plain = self.__dict__.get("_plain")
            if plain is None:  # a memmap's every view runs Python hooks; an ndarray view of it does not
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            dt = np.dtype(dtype)
            arr = plain[offset:offset + dt.itemsize * count].view(dt)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
            if raw_type != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            itype, n, offs = GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
            parts: list[np.ndarray] = [raw_itype, alen]
            if itype == GGUFValueType.STRING:
                native = (self.byte_order == "I") == (sys.byteorder == "little")
                unpack = struct.Struct("<Q" if native else ">Q").unpack_from
                plain, buf = self._plain, memoryview(self._plain)
                length_type = np.dtype(np.uint64).newbyteorder(self.byte_order)
                for _ in range(n):
                    (size,) = unpack(buf, offs)
                    parts.append(plain[offs:offs + 8].view(length_type))
                    parts.append(plain[offs + 8:offs + 8 + size])
                    offs += 8 + size
                return offs - orig_offs, parts, list(range(3, 2 * n + 3, 2)), [GGUFValueType.ARRAY, itype]
            scalar = self.gguf_scalar_to_np.get(itype)
            if scalar is None:  # arrays of arrays: rare and small
                return super()._get_field_parts(orig_offs, raw_type)
            whole = self._get(offs, scalar, n)
            parts += [whole[i:i + 1] for i in range(n)]
            return 12 + int(whole.nbytes), parts, list(range(2, n + 2)), [GGUFValueType.ARRAY, itype]

    return FastGGUFReader


def _gguf_field(reader, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.contents()


def _gguf_expected_size(path: Path) -> int | None:
    """The size a GGUF file's header says it has (the end of its last tensor's data), read without touching the
    data; None where even the header is unreadable."""
    import gguf

    class HeaderOnly(_fast_gguf_reader_class()):
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


# llama.cpp's split GGUF (llama-gguf-split, convert_hf_to_gguf.py --split-max-*): `<name>-00001-of-00003.gguf`, ...,
# each part a GGUF of its own; the first carries the model's metadata, every part the split.* keys and its tensors
_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_MERGE_FIX = "or merge them into one file with `llama-gguf-split --merge FIRST-PART OUT.gguf`"


def _split_names(path: Path) -> list[Path]:
    """Every part of the split GGUF `path` is a part of (by llama.cpp's naming), first part first; `[path]` for a
    file not named as a part."""
    m = _SPLIT_NAME.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    return [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def gguf_parts(path: str | Path) -> list[Path]:
    """The files of the GGUF model `path` belongs to, the one with the metadata first: `path` itself, or every part
    of a split GGUF given any of its parts. A missing part is a ModelSourceError naming it."""
    parts = _split_names(Path(path))
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ModelSourceError(f"{parts[0]}: a GGUF split into {len(parts)} parts, and {', '.join(missing)} "
                               f"{'is' if len(missing) == 1 else 'are'} missing from {parts[0].parent}; download "
                               f"every part into that folder (a Hugging Face repo name downloads them all), "
                               f"{_MERGE_FIX}")
    return parts


def _read_gguf(path: Path):
    """open_gguf(path), its failures as one ModelSourceError: a file shorter than its header says is reported as
    truncated (an interrupted download), anything else as unreadable."""
    try:
        return open_gguf(path)
    except Exception as e:  # gguf raises bare ValueErrors on bad magic
        expected, found = _gguf_expected_size(path), Path(path).stat().st_size
        if expected is not None and found < expected:
            raise ModelSourceError(f"{path}: truncated or incomplete file (expected {expected} bytes, found {found}); "
                                   "download it again") from None
        raise ModelSourceError(f"{path}: not a readable GGUF file ({e})") from e


def _check_split(parts: list[Path], readers: list) -> None:
    """The parts' split.* keys agree with their names and with each other, so no part of another split (another
    quantization, an older upload) is mixed in, and no split is read as a whole model."""
    import gguf

    keys = gguf.Keys.Split
    count = _gguf_field(readers[0], keys.LLM_KV_SPLIT_COUNT) or 1
    if len(parts) == 1 and count > 1:
        raise ModelSourceError(f"{parts[0]}: part {(_gguf_field(readers[0], keys.LLM_KV_SPLIT_NO) or 0) + 1} of a "
                               f"GGUF split into {count} parts, but not named as llama.cpp names the parts "
                               f"(<name>-00001-of-{count:05d}.gguf, ...), so the others cannot be found; rename "
                               f"the parts so, {_MERGE_FIX}")
    for i, (part, reader) in enumerate(zip(parts, readers)):
        no, of = _gguf_field(reader, keys.LLM_KV_SPLIT_NO) or 0, _gguf_field(reader, keys.LLM_KV_SPLIT_COUNT) or 1
        if (no, of) != (i, len(parts)):
            raise ModelSourceError(f"{part}: its metadata says it is part {no + 1} of {of}, its name part {i + 1} of "
                                   f"{len(parts)}; the parts come from different files: download them again")
    expected = _gguf_field(readers[0], keys.LLM_KV_SPLIT_TENSORS_COUNT)
    found = sum(len(r.tensors) for r in readers)
    if expected is not None and expected != found:
        raise ModelSourceError(f"{parts[0]}: the split GGUF lists {expected} tensors (split.tensors.count) and its "
                               f"{len(parts)} parts hold {found}; the parts come from different files: download "
                               "them again")


def _gguf_tensors(parts: list[Path], readers: list) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Every part's tensors by name, and the memory map each one's data lies in (its own part's)."""
    by_name: dict[str, Any] = {}
    mapping: dict[str, np.ndarray] = {}
    for part, reader in zip(parts, readers):
        for t in reader.tensors:
            if t.name in by_name:
                raise ModelSourceError(f"{part}: tensor '{t.name}' is in two parts of the split GGUF; download the "
                                       "parts again")
            by_name[t.name], mapping[t.name] = t, reader.data
    return by_name, mapping


def load_gguf(path: Path) -> ModelSource:
    """The GGUF model `path` is (or, for a split GGUF, any part of): metadata from the first part, tensors from all,
    read lazily from their memory maps."""
    import gguf

    from mlcc.relax_models import family_for, gguf_model_type

    parts = gguf_parts(path)
    readers = [_read_gguf(p) for p in parts]
    _check_split(parts, readers)
    reader, path = readers[0], parts[0]
    by_name, mapping = _gguf_tensors(parts, readers)
    arch = _gguf_field(reader, "general.architecture")
    fields = {k: _gguf_field(reader, k) for k in reader.fields if not k.startswith("tokenizer.ggml.")}
    model_type = gguf_model_type(arch, fields)
    family = family_for(model_type, source="gguf")
    if "token_embd.weight" not in by_name:
        raise ModelSourceError(f"{path}: GGUF has no token_embd.weight")
    vocab = int(by_name["token_embd.weight"].shape[-1])
    config = family.gguf_config(fields, arch, vocab, has_output="output.weight" in by_name)
    config["model_type"] = model_type
    experts = [t for n, t in by_name.items() if n.endswith("_exps.weight")]
    if experts and all(t.tensor_type == gguf.GGMLQuantizationType.MXFP4 for t in experts):
        # what an HF checkpoint with MXFP4 experts says (a family that keeps them so reads it)
        config["quantization_config"] = {"quant_method": "mxfp4"}
    if "rope_factors_long.weight" in by_name:  # LongRoPE (Phi-3) keeps its factors as tensors
        from mlcc.relax_models.phi3 import gguf_rope_factors

        gguf_rope_factors({n: np.asarray(by_name[n].data, np.float32).ravel() for n in
                           ("rope_factors_long.weight", "rope_factors_short.weight") if n in by_name}, config)
    cfg = family.config_from_hf(config)

    # HF name → GGUF name through gguf's own table, so we do not maintain a second copy of llama.cpp's names.
    tmap = gguf.get_tensor_name_map(_gguf_arch_enum(arch), cfg.num_hidden_layers)
    fixups = family.gguf_fixups(cfg)
    tensors: dict[str, Callable[[], np.ndarray]] = {}
    rows: dict[str, tuple[int, Callable[[int, int], np.ndarray]]] = {}
    mxfp4: dict[str, Callable[[], tuple[np.ndarray, np.ndarray]]] = {}
    read: set[str] = set()
    for sources, _ in family.weight_plan(cfg, "gguf").values():
        for hf_name in sources:
            g = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if g is None or g not in by_name:
                continue
            read.add(g)
            tensors[hf_name] = _gguf_loader(by_name[g], fixups.get(hf_name))
            if by_name[g].tensor_type == gguf.GGMLQuantizationType.MXFP4 and hf_name not in fixups:
                mxfp4[hf_name] = _gguf_mxfp4_loader(by_name[g])
            if len(by_name[g].shape) == 2 and hf_name not in fixups:
                rows[hf_name] = (int(by_name[g].shape[1]), _gguf_rows(by_name[g], mapping[g]))
    _refuse_converter_fusions(path, by_name, read)
    return ModelSource("gguf", path, model_type, config, tensors, rows, mxfp4=mxfp4)


# tensors convert_hf_to_gguf.py fuses only when asked (→ the flag that asked); an architecture that stores them fused
# of its own (Phi-3's attn_qkv) reads them, so only unread ones are refused
_CONVERTER_FUSIONS = {"ffn_gate_up_exps": "--fuse-gate-up-exps", "attn_qkv": "--fuse-qkv"}


def _refuse_converter_fusions(path: Path, by_name: dict[str, Any], read: set[str]) -> None:
    for name in sorted(by_name):
        parts = name.split(".")
        flag = _CONVERTER_FUSIONS.get(parts[2]) if len(parts) > 2 and parts[0] == "blk" else None
        if flag is not None and name not in read:
            raise ModelSourceError(f"{path}: '{name}' is fused as llama.cpp's convert_hf_to_gguf.py {flag} writes it, "
                                   f"which mlcc does not read for this architecture; convert the model without {flag}")


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


def _gguf_mxfp4_loader(t) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
    return lambda: ggml_codes(t.data, tuple(int(d) for d in reversed(t.shape)))


def _gguf_rows(t, mapping: np.ndarray) -> Callable[[int, int], np.ndarray]:
    """read(start, stop): rows start..stop-1 of a 2-D GGUF tensor as float32; the pages read are handed back to the
    page cache, so converting a model does not keep the whole file resident."""
    row_bytes = t.data.nbytes // int(t.shape[1])
    file_map = getattr(mapping, "_mmap", None)  # np.memmap's mmap object, for madvise

    def read(start: int, stop: int) -> np.ndarray:
        from gguf.quants import dequantize

        rows = dequantize(t.data[start:stop], t.tensor_type)
        out = np.asarray(rows, dtype=np.float32).reshape(stop - start, int(t.shape[0]))
        if file_map is not None and hasattr(mmap, "MADV_DONTNEED"):
            first = t.data_offset + start * row_bytes
            lo = -(-first // mmap.PAGESIZE) * mmap.PAGESIZE
            hi = (first + (stop - start) * row_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
            if hi > lo:
                file_map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        return out

    return read


def load_source(path: str | Path) -> ModelSource:
    p = Path(path)
    if not p.exists():
        raise ModelSourceError(f"{p}: no such file or folder")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelSourceError(f"{p}: expected a .gguf file or a Hugging Face model folder")
        return load_gguf(p)
    models = {_split_names(g)[0] for g in p.glob("*.gguf")}   # a split GGUF's parts are one model
    if not (p / "config.json").exists() and len(models) == 1:
        return load_gguf(models.pop())
    return load_hf_folder(p)


# -- our parameters ----------------------------------------------------------------------------------------------

def iter_float_params(source: ModelSource, family, cfg) -> Iterator[tuple[str, np.ndarray]]:
    """(our name, float32 array) for every parameter of the unquantized model, assembled per the family plan."""
    fixups = source_fixups(source, family, cfg)
    for ours, (names, combine) in family.weight_plan(cfg, source.kind).items():
        yield ours, float_param(source, names, combine, fixups)


def source_fixups(source: ModelSource, family, cfg) -> dict[str, Callable[[np.ndarray], np.ndarray]]:
    """The per-tensor corrections a family applies to an HF checkpoint's tensors (GGUF's are in its loaders)."""
    return family.hf_fixups(cfg) if source.kind == "hf" else {}


def float_param(source: ModelSource, names: list[str], combine: Callable | None,
                fixups: dict[str, Callable[[np.ndarray], np.ndarray]]) -> np.ndarray:
    """One parameter of the plan as float32: its source tensors, corrected, combined."""
    parts = []
    for n in names:
        a = source.get(n)
        parts.append(fixups[n](a) if n in fixups else a)
    return (combine(parts) if combine else parts[0]).astype(np.float32, copy=False)

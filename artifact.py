"""The artifacts folder format, shared by the compiler (writes) and the runtime (reads).

Kept free of TVM and the compiler so a deployment imports only this and TVM's runtime.

    DIR/model.so               library (holds a `_metadata` function returning the ABI stamp as JSON)
    DIR/params_shard_*.bin     weights; DIR/tensor-cache.json lists them (TVM's format) plus a sha256 per shard
    DIR/mlcc-config.json       model config, quantization, context window, parameter list, tokenizer files, stamp
    DIR/tokenizer.json, ...    tokenizer files, chat template
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any

from mlcc.errors import ArtifactError
from mlcc.options import CompileOptions

CONFIG_FILE = "mlcc-config.json"
TENSOR_CACHE_FILE = "tensor-cache.json"
FORMAT_VERSION = 2

# CUDA libraries hold `decode_graph` (compiler/graph_decode.py), batch-1 decode as one CUDA graph per step. It calls
# the paged attention through GRAPH_ATTENTION, which the runtime registers, and its graphs are keyed by the layout of
# the KV cache's per-step metadata: TVM 0.27's merged aux buffer aligns each int32 array to 16 bytes, so the arrays
# after the page table move whenever the sequence's page count crosses a multiple of 4.
GRAPH_DECODE_FUNCTION = "decode_graph"
GRAPH_ATTENTION = "mlcc.graph_attention_with_fused_qkv"
_PAGES_PER_LAYOUT = 4


def graph_decode_layout(seq_len_after_step: int, page_size: int) -> int:
    """The key of the decode graph valid for a step that ends with `seq_len_after_step` tokens in the cache."""
    pages = -(-seq_len_after_step // page_size)
    return -(-pages // _PAGES_PER_LAYOUT)


def mlcc_version() -> str:
    from mlcc import __version__

    return __version__


def tvm_version() -> str:
    return importlib.metadata.version("apache-tvm")


def param_hash(params: list[dict[str, Any]]) -> str:
    """Hash of the parameter list (names, shapes, dtypes, order): what library and weights must agree on."""
    canon = json.dumps([[p["name"], list(p["shape"]), p["dtype"]] for p in params], separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def make_stamp(arch: str, quantization: str, target: str, params: list[dict[str, Any]],
               options: CompileOptions) -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "mlcc": mlcc_version(),
        "tvm": tvm_version(),
        "arch": arch,
        "quantization": quantization,
        "target": target,
        "param_hash": param_hash(params),
        "options": options.to_dict(),
    }


def read_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / CONFIG_FILE
    if not path.exists():
        raise ArtifactError(f"{model_dir}: no {CONFIG_FILE}; this is not an mlcc artifacts folder "
                            f"(create one with `mlcc compile MODEL --output {model_dir}`)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: unreadable ({e}); recompile with `mlcc compile`") from e


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def shard_dir(rank: int) -> str:
    """Sub-folder holding tensor-parallel rank `rank`'s weights."""
    return f"tp-rank-{rank}"


def add_shard_checksums(model_dir: Path) -> None:
    """Record a sha256 per shard in TVM's tensor-cache.json (unknown keys are ignored by TVM's loaders)."""
    path = Path(model_dir) / TENSOR_CACHE_FILE
    cache = json.loads(path.read_text())
    for shard in cache["records"]:
        shard["sha256"] = sha256_file(Path(model_dir) / shard["dataPath"])
    path.write_text(json.dumps(cache, indent=1))


def verify_shards(model_dir: Path) -> None:
    model_dir = Path(model_dir)
    path = model_dir / TENSOR_CACHE_FILE
    if not path.exists():
        raise ArtifactError(f"{model_dir}: {TENSOR_CACHE_FILE} is missing; recompile with `mlcc compile`")
    cache = json.loads(path.read_text())
    for shard in cache["records"]:
        f = model_dir / shard["dataPath"]
        if not f.exists():
            raise ArtifactError(f"{f}: weight shard is missing; copy the whole artifacts folder or recompile")
        if f.stat().st_size != shard["nbytes"]:
            raise ArtifactError(f"{f}: weight shard is corrupted (size {f.stat().st_size}, expected "
                                f"{shard['nbytes']}); copy it again or recompile")
        if "sha256" in shard and sha256_file(f) != shard["sha256"]:
            raise ArtifactError(f"{f}: weight shard is corrupted (sha256 mismatch); copy it again or recompile")


def check_stamp(lib_stamp: dict[str, Any], config: dict[str, Any], model_dir: Path) -> None:
    """Refuse a library that does not belong to these weights or this runtime, naming what to recompile."""
    want = config.get("stamp", {})
    hint = f"recompile with `mlcc compile SOURCE --target {want.get('target', '?')} " \
           f"--quant {want.get('quantization', '?')} --output {model_dir}`"
    for key in ("format", "arch", "quantization", "param_hash", "options"):
        if lib_stamp.get(key) != want.get(key):
            raise ArtifactError(f"{model_dir}: library was built for {key}={lib_stamp.get(key)!r} but the weights/config "
                                f"say {want.get(key)!r}; {hint}")
    if lib_stamp.get("tvm") != tvm_version():
        raise ArtifactError(f"{model_dir}: library was built with apache-tvm {lib_stamp.get('tvm')} but this runtime "
                            f"has {tvm_version()}; {hint}")
    if lib_stamp.get("mlcc") != mlcc_version():
        raise ArtifactError(f"{model_dir}: library was built by mlcc {lib_stamp.get('mlcc')} but this is mlcc "
                            f"{mlcc_version()}; {hint}")


def built_options(config: dict[str, Any]) -> CompileOptions:
    """The compile options an artifacts folder was built with."""
    return CompileOptions.from_dict(config.get("stamp", {}).get("options"))


def check_options(config: dict[str, Any], wanted: CompileOptions | None, model_dir: Path) -> None:
    """Refuse an artifacts folder built with other compile options than the caller asks for (None: any)."""
    if wanted is None:
        return
    have = built_options(config)
    diff = have.differences(wanted)
    if diff:
        said = ", ".join(f"{k}={b!r} (built with {a!r})" for k, (a, b) in diff.items())
        stamp = config.get("stamp", {})
        raise ArtifactError(f"{model_dir}: asked for compile options {said}; recompile with `mlcc compile SOURCE "
                            f"--target {stamp.get('target', '?')} --quant {stamp.get('quantization', '?')} "
                            f"{wanted.as_cli()} --output {model_dir}` or drop the options")

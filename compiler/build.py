"""`mlcc compile`: model source → Relax → quantized → library + weights + config in one folder."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from mlcc import artifact, kv_cache_format
from mlcc.errors import UnsupportedConfigError, UnsupportedKVCacheDtypeError, UnsupportedQuantizationError
from mlcc.options import CompileOptions
from mlcc.relax_models import Family, family_for
from mlcc.targets import TargetPreset, cpu_record, get_target

from .lora import add_lora, check_lora
from .quantize import Quantization, get_quantization, quantize_model
from .sampler import attach_argmax, attach_logit_functions, attach_sampler
from .weights import ModelSource, load_source

log = logging.getLogger(__name__)

# the tvm target kinds whose attention kernels read a quantized KV cache (mlcc/kv_cache_format.py)
QUANTIZED_KV_TARGETS = ("llvm", "cuda")


@dataclasses.dataclass
class CompileReport:
    output: Path
    seconds_export: float
    seconds_compile: float
    seconds_weights: float
    library_bytes: int
    weight_bytes: int


@dataclasses.dataclass
class BuiltModule:
    """The exported Relax module and everything needed to pair it with weights."""

    mod: Any
    params: list[dict[str, Any]]   # name/shape/dtype in the VM's parameter order
    stamp: dict[str, Any]
    family: Family
    cfg: Any
    quant: Quantization
    preset: TargetPreset
    target: Any
    options: CompileOptions
    lora: dict[str, Any] | None = None   # mlcc-config.json's "lora" (compiler/lora.py): None without LoRA


def export_module(source: ModelSource, preset: TargetPreset, quant: Quantization,
                  context_window: int | None = None, tensor_parallel: int = 1,
                  options: CompileOptions | None = None) -> BuiltModule:
    options = options or CompileOptions()
    family = family_for(source.model_type, source.kind)
    cfg = family.config_from_hf(source.config)
    if context_window:
        cfg.context_window_size = context_window
    check_target_reads(preset, quant)
    family.check_tensor_parallel(cfg, tensor_parallel, quant.group_size if quant.kind == "group" else None)
    cfg.tensor_parallel_shards = tensor_parallel
    if getattr(cfg, "vision", None) is not None and tensor_parallel > 1:
        raise UnsupportedConfigError(f"--tensor-parallel {tensor_parallel}: vision-language models run on one device "
                                     "(the runtime encodes images outside the tensor-parallel workers); use 1")
    check_kv_cache_dtype(preset, cfg, options.kv_cache_dtype)
    cfg.kv_cache_dtype = options.kv_cache_dtype
    target = preset.tvm_target()
    check_lora(options, target.kind.name, tensor_parallel)
    check_attention_kernels(preset, cfg)
    if target.kind.name == "webgpu":
        quant = dataclasses.replace(quant, magic_int_to_float=False)
    model = family.model_cls(cfg, target)
    model = quantize_model(model, quant)
    _check_quantizable(model, quant)
    lora = None
    if options.max_loras:
        lora = add_lora(model, family, cfg, options, quant.model_dtype).to_config()
    mod, named_params = model.export_tvm(spec=model.get_default_spec())
    if target.kind.name == "llvm":
        from mlcc.schedules.cpu_attention import replace_cpu_attention

        kv = options.kv_cache_dtype if kv_cache_format.is_quantized(options.kv_cache_dtype) else None
        mod = replace_cpu_attention(mod, cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim,
                                    quant.model_dtype, cfg.sliding_window, cfg.attn_softcap, kv,
                                    getattr(cfg, "attention_sinks", False))
    elif target.kind.name == "cuda" and kv_cache_format.is_quantized(options.kv_cache_dtype):
        from mlcc.schedules.cuda_quantized_kv_attention import replace_cuda_quantized_attention

        mod = replace_cuda_quantized_attention(mod, cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim,
                                               quant.model_dtype, cfg.attn_softcap, options.kv_cache_dtype)
    elif cfg.attn_softcap:
        from mlcc.schedules.attention_softcap import apply_attention_softcap

        mod = apply_attention_softcap(mod, cfg.attn_softcap)
    params = [{"name": n, "shape": [int(d) for d in p.shape], "dtype": p.dtype} for n, p in named_params]
    stamp = artifact.make_stamp(family.name, quant.name, preset.name, params, options,
                                cpu=cpu_record(target) if preset.device == "cpu" else None)
    mod = _attach_metadata(mod, stamp)
    # GPUs get a hand-scheduled argmax (schedules/argmax.py). WGSL needs the int32 index and keeps the simple
    # one-workgroup-per-row form; the others split each row over many blocks.
    gpu = "gpu" in target.keys
    mod = attach_argmax(mod, cfg.vocab_size, int32_index=gpu, threads=256,
                         chunk=2048 if gpu and target.kind.name != "webgpu" else None)
    if target.kind.name != "webgpu":
        # TVM's GPU sort (top-p) needs blockIdx.z, which WGSL lacks; the JS engine samples from logits instead
        mod = attach_sampler(mod, cfg.vocab_size)
    # grammar masks, logit_bias and logprobs on the device, for every target (schedules/logit_processing.py)
    mod = attach_logit_functions(mod, cfg.vocab_size, target)
    return BuiltModule(mod, params, stamp, family, cfg, quant, preset, target, options, lora)


def check_target_reads(preset: TargetPreset, quant: Quantization) -> None:
    """Refuse a scheme whose weights the target's kernels cannot load, saying why and what to use instead."""
    if quant.kind == "float8" and preset.tvm_target().kind.name == "webgpu":
        raise UnsupportedQuantizationError(
            f"{quant.name} cannot run on target '{preset.name}': WGSL has no 8-bit types to load float8 weights "
            "with; use q4f16_1 or q0f16 there")


def _log_int4(source: ModelSource, q: Quantization) -> None:
    """One line saying whether a published 4-bit checkpoint is kept as it is, and the scheme that would keep it."""
    fmt = source.int4.format
    keeps = fmt.scheme(q.model_dtype)
    if q.name in (keeps, keeps.replace("g128", "awq")):
        log.info("4-bit checkpoint (%s): codes, scales and zero points kept as published in %s", fmt.describe(), q.name)
    else:
        log.info("4-bit checkpoint (%s): weights dequantized to float and %s; --quant %s keeps them as published",
                 fmt.describe(), "re-quantized to " + q.name if q.kind != "none" else "kept as " + q.model_dtype,
                 keeps)


def check_attention_kernels(preset: TargetPreset, cfg) -> None:
    """Refuse a model whose attention the target's kernels cannot compute, in one line."""
    if getattr(cfg, "attention_sinks", False) and preset.tvm_target().kind.name != "llvm":
        raise UnsupportedConfigError(
            f"this model's attention sinks (gpt-oss) are computed only by mlcc's CPU attention kernels, not TVM's "
            f"{preset.name} ones; compile it for --target llvm")


def check_kv_cache_dtype(preset: TargetPreset, cfg, kv_cache_dtype: str) -> None:
    """Refuse a quantized KV cache where its kernels do not exist (targets, model shapes), in one line."""
    if not kv_cache_format.is_quantized(kv_cache_dtype):
        return
    if not hasattr(cfg, "kv_cache_dtype"):
        raise UnsupportedKVCacheDtypeError(f"--kv-cache-dtype {kv_cache_dtype}: this model family's attention does "
                                           "not support a quantized KV cache; use --kv-cache-dtype auto")
    kind = preset.tvm_target().kind.name
    if kind not in QUANTIZED_KV_TARGETS:
        raise UnsupportedKVCacheDtypeError(
            f"--kv-cache-dtype {kv_cache_dtype} cannot run on target '{preset.name}': its attention kernels read "
            f"quantized K/V only on {', '.join(QUANTIZED_KV_TARGETS)}; use --kv-cache-dtype auto there")
    if getattr(cfg, "attention_sinks", False):
        raise UnsupportedKVCacheDtypeError(f"--kv-cache-dtype {kv_cache_dtype}: the attention kernels with sinks "
                                           "(gpt-oss) read a float KV cache only; use --kv-cache-dtype auto")
    if kind == "cuda" and getattr(cfg, "tensor_parallel_shards", 1) > 1:
        raise UnsupportedKVCacheDtypeError(f"--kv-cache-dtype {kv_cache_dtype}: the CUDA kernels of a quantized "
                                           "cache run on one GPU; use --tensor-parallel-shards 1 or "
                                           "--kv-cache-dtype auto")
    reason = kv_cache_format.unsupported_reason(kv_cache_dtype, cfg.head_dim)
    if reason:
        raise UnsupportedKVCacheDtypeError(reason)


def _check_quantizable(model, quant: Quantization) -> None:
    if quant.kind != "group":
        return
    for name, p in model.named_parameters():
        if name.endswith("q_weight") and (p.shape[-1] * quant.per_word) % quant.group_size:
            raise UnsupportedQuantizationError(
                f"{name.removesuffix('.q_weight')}: its {p.shape[-1] * quant.per_word} inputs are not a multiple of "
                f"the {quant.name} group size {quant.group_size}; use a scheme of smaller groups (q4f16_1) or q0f16")


def _attach_metadata(mod, stamp: dict[str, Any]):
    """A `_metadata()` function in the library itself, so a library cannot be paired silently with other weights."""
    import tvm
    from tvm import relax

    func = relax.Function([], tvm.ir.StringImm(json.dumps(stamp)), is_pure=True)
    mod["_metadata"] = func.with_attr("global_symbol", "_metadata")
    return mod


def builds_graph_decode(built: BuiltModule) -> bool:
    """CUDA, one GPU: batch-1 decode gets a whole-step CUDA graph (compiler/graph_decode.py). Disco workers (tensor
    parallel) keep plain decode: the graph's attention alias is registered by runtime.device.graph_decode, not in their processes."""
    return built.options.decode_graph and built.target.kind.name == "cuda" and built.cfg.tensor_parallel_shards == 1 \
        and built.lora is None   # (the graph's decode takes no adapter inputs)


def compile_library(built: BuiltModule, out_path: Path, tuning_db: str | Path | None = None):
    import tvm

    from mlcc.schedules.cuda_pdl import tir_pipeline_for
    from mlcc.schedules.cuda_source import add_cuda_helpers
    from mlcc.targets.toolchains import toolchain_for
    from mlcc.tvm_compat import cuda_source_postproc, pass_config

    from .pipeline import build_pipeline

    config = pass_config(built.target, built.cfg.rope_scaling)

    mod = built.mod  # (for a wasm host, relax.build itself marks the module as a system library for tvmjs)
    if builds_graph_decode(built):
        from .graph_decode import add_graph_decode

        mod = add_graph_decode(mod)
    # our CUDA kernels call small device helpers, added to each generated translation unit so the library
    # carries complete source
    helpers = cuda_source_postproc(add_cuda_helpers) if built.target.kind.name == "cuda" else contextlib.nullcontext()
    relax_pipeline = build_pipeline(built.target, tuning_db, built.options)
    t0 = time.time()

    @tvm.transform.module_pass(opt_level=0, name="mlcc_timed_pipeline")
    def timed_pipeline(mod: tvm.ir.IRModule, _ctx: tvm.transform.PassContext) -> tvm.ir.IRModule:
        mod = relax_pipeline(mod)
        log.info("compile: kernels fused and scheduled in %.1fs", time.time() - t0)
        return mod

    with toolchain_for(built.target.kind.name), helpers, tvm.transform.PassContext(config=config):
        ex = tvm.compile(mod, built.target, relax_pipeline=timed_pipeline,
                         tir_pipeline=tir_pipeline_for(built.target, built.options))
        t1 = time.time()
        log.info("compile: lowered and code generated at %.1fs", t1 - t0)
        if built.target.kind.name == "webgpu":
            from .wasm_link import export_wasm

            export_wasm(ex, out_path)
        else:
            ex.export_library(str(out_path))
        log.info("compile: library written at %.1fs", time.time() - t0)
    return ex


_COMPILE_SECONDS = "compile-seconds.json"


def _compile_estimate(built: BuiltModule) -> tuple[float, str] | None:
    """Seconds a library like this one took to compile on this machine, and which one: the last build of this family,
    shape and target, else the mean of this target's builds (None: nothing built for the target yet)."""
    from mlcc.cache import cache_root

    try:
        times = {k: float(v) for k, v in json.loads((cache_root() / _COMPILE_SECONDS).read_text()).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    key = _estimate_key(built)
    if key in times:
        return times[key], f"the last {built.family.name} build of this shape here took"
    same_target = [v for k, v in times.items() if k.split("/", 1)[0] == built.preset.name]
    if not same_target:
        return None
    return sum(same_target) / len(same_target), f"the mean of {len(same_target)} {built.preset.name} builds here"


def _record_compile_seconds(built: BuiltModule, seconds: float) -> None:
    from mlcc.cache import cache_root

    path = cache_root() / _COMPILE_SECONDS
    try:
        times = json.loads(path.read_text()) if path.exists() else {}
        times[_estimate_key(built)] = round(seconds, 2)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(times, indent=1, sort_keys=True))
        tmp.replace(path)
    except (OSError, ValueError):
        pass  # an estimate for next time only


def _estimate_key(built: BuiltModule) -> str:
    cfg = built.cfg
    return (f"{built.preset.name}/{built.family.name}/{cfg.hidden_size}x{cfg.intermediate_size}x{cfg.vocab_size}/"
            f"{built.quant.name}/tp{cfg.tensor_parallel_shards}")


@contextlib.contextmanager
def _compile_progress(built: BuiltModule) -> Iterator[None]:
    """A bar for the compile (which reports no progress of its own): time against the last compile's duration here,
    so its ETA is that duration less the time spent; the real duration is kept for the next estimate."""
    from tqdm import tqdm

    found, t0, done = _compile_estimate(built), time.time(), threading.Event()
    estimate = found[0] if found else None
    if found is None:
        log.info("compiling the library (the first build for %s on this machine: no estimate yet)", built.preset.name)
    else:
        log.info("compiling the library: about %.0fs (%s)", *found)

    def tick(bar) -> None:
        while not done.wait(0.5):
            bar.n = round(min(time.time() - t0, bar.total * 0.99), 1)
            bar.refresh()

    bar = tqdm(total=round(estimate or 0, 1), desc="compiling library", unit="s", file=sys.stderr, position=1,
               leave=False, bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f}s [ETA {remaining}]",
               disable=estimate is None or not sys.stderr.isatty())
    thread = threading.Thread(target=tick, args=(bar,), daemon=True)
    if not bar.disable:
        thread.start()
    try:
        yield
    finally:
        done.set()
        if thread.is_alive():
            thread.join()
        bar.close()
    _record_compile_seconds(built, time.time() - t0)


def iter_params(source: ModelSource, built: BuiltModule, rank: int = 0) -> Iterator[tuple[str, np.ndarray]]:
    """Our parameters in their stored form, one at a time (this rank's shard; quantized where expected)."""
    from .weight_conversion import converted_params

    return converted_params(source, built, rank)


def write_weights(source: ModelSource, built: BuiltModule, out: Path, rank: int = 0,
                  cancel: threading.Event | None = None, slots: threading.Semaphore | None = None) -> None:
    from tqdm import tqdm
    from tvm.contrib import tvmjs

    from .weight_conversion import converted_params, total_elements

    shards = built.cfg.tensor_parallel_shards
    desc = "converting weights" + (f" (shard {rank + 1}/{shards})" if shards > 1 else "")
    t0 = time.time()
    with tqdm(total=total_elements(built), desc=desc, unit=" weights", unit_scale=True, file=sys.stderr,
              mininterval=0.5 if sys.stderr.isatty() else 5.0) as bar:
        params = converted_params(source, built, rank, progress=bar.update, cancel=cancel, slots=slots)
        # TVM's writer prints one line per tensor to stdout; keep stdout for the program's own output.
        with contextlib.redirect_stdout(io.StringIO()):
            tvmjs.dump_tensor_cache(params, str(out), encode_format="raw", show_progress=False)
    if cancel is not None and cancel.is_set():
        return
    artifact.add_shard_checksums(out)
    cache = json.loads((out / artifact.TENSOR_CACHE_FILE).read_text())
    have = {r["name"] for s in cache["records"] for r in s["records"]}
    missing = [p["name"] for p in built.params if p["name"] not in have]
    if missing:
        raise ValueError(f"weights for {missing[:3]}... were not produced; the checkpoint is incomplete")
    log.info("converted weights%s in %.1fs", f" (shard {rank + 1}/{shards})" if shards > 1 else "", time.time() - t0)


def _config_json(built: BuiltModule, lib_name: str, tok: dict[str, Any], source: dict[str, Any]) -> dict[str, Any]:
    return {
        "model_type": built.family.name,
        "model_config": dataclasses.asdict(built.cfg),
        "quantization": built.quant.name,
        "model_dtype": built.quant.model_dtype,
        "target": built.preset.name,
        "device": built.preset.device,
        "library": lib_name,
        "cuda_arch": str(built.target.attrs["arch"]) if built.target.kind.name == "cuda" else None,
        "context_window_size": built.cfg.context_window_size,
        "tensor_parallel": built.cfg.tensor_parallel_shards,
        "vocab_size": built.cfg.vocab_size,
        "hidden_size": built.cfg.hidden_size,
        "params": built.params,
        "tokenizer": tok,
        "source": source,
        "stamp": built.stamp,
        **({"lora": built.lora} if built.lora is not None else {}),
    }


_LIBRARIES = "libraries"
_LIBRARIES_KEPT = 8


def _library_key(built: BuiltModule, tuning_db: str | Path | None) -> str:
    """What a library is made from: the model's shape and settings (not its weights), target, quantization, options,
    the TVM version, the tuning records and mlcc's own sources (a changed kernel makes another library)."""
    import hashlib

    h = hashlib.sha256(json.dumps([built.stamp, dataclasses.asdict(built.cfg), builds_graph_decode(built),
                                   str(built.target)], sort_keys=True, default=str).encode())
    if tuning_db is not None:
        for f in sorted(Path(tuning_db).glob("*.json")):
            h.update(f.read_bytes())
    package = Path(__file__).resolve().parent.parent
    sources = [*package.glob("*.py")]
    for part in ("compiler", "relax_models", "schedules", "targets", "native"):
        sources += [f for f in (package / part).rglob("*") if f.suffix in (".py", ".cuh", ".cc", ".h")]
    for f in sorted(sources):
        h.update(str(f.relative_to(package)).encode() + f.read_bytes())
    return h.hexdigest()[:24]


def _cached_library(built: BuiltModule, key: str) -> Path | None:
    from mlcc.cache import cache_root

    lib = cache_root() / _LIBRARIES / key / ("model" + built.preset.lib_ext)
    return lib if lib.exists() else None


def _keep_library(built: BuiltModule, key: str, lib: Path) -> None:
    """Keep a copy of the library for the next model of the same shape; the oldest beyond a few are dropped."""
    from mlcc.cache import cache_root

    root = cache_root() / _LIBRARIES
    dest = root / key / lib.name
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f"{dest.name}.{threading.get_ident()}.tmp")
        shutil.copyfile(lib, tmp)
        tmp.replace(dest)
        entries = sorted(root.iterdir(), key=lambda d: d.stat().st_mtime)
        for old in entries[:-_LIBRARIES_KEPT]:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        log.debug("library not kept for reuse: %s", e)


def _tokenizer(source: ModelSource, out: Path) -> dict[str, Any]:
    """The tokenizer files written into `out`, with a chat template from the family where the model has none."""
    from .tokenizer_files import write_tokenizer

    tok = write_tokenizer(source.kind, source.path, out)
    if not tok.get("chat_template") and (out / "tokenizer.json").exists():
        from .chat_templates import fallback_chat_template

        tok["chat_template"] = fallback_chat_template(str(out / "tokenizer.json"), source.path.name)
    return tok


def compile_shape_only(model_type: str, hf_config: dict[str, Any], target: str, quant: str,
                       output: str | Path, tensor_parallel: int = 1, options: CompileOptions | None = None) -> float:
    """Library + config for a config with no checkpoint (benchmarks fill the weights with random values)."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    source = ModelSource("config", out, model_type, hf_config, {})
    t0 = time.time()
    built = export_module(source, get_target(target), get_quantization(quant), tensor_parallel=tensor_parallel,
                          options=options)
    lib_name = "model" + built.preset.lib_ext
    compile_library(built, out / lib_name)
    seconds = time.time() - t0
    cfg = _config_json(built, lib_name, {}, {"kind": "config", "path": str(out)})
    cfg["weights"] = "none"
    from .tokenizer_files import write_placeholder_tokenizer

    cfg["tokenizer"] = write_placeholder_tokenizer(out, built.cfg.vocab_size)
    (out / artifact.CONFIG_FILE).write_text(json.dumps(cfg, indent=1))
    return seconds


def compile_model(model: str | Path, target: str, quant: str, output: str | Path,
                  context_window: int | None = None, tuning_db: str | Path | None = None,
                  tensor_parallel: int = 1, options: CompileOptions | None = None) -> CompileReport:
    """Compile `model` (HF folder or .gguf) for `target` with `quant` into the artifacts folder `output`."""
    if target == "auto":
        from mlcc.targets import detect_local

        target = detect_local()
    preset, q = get_target(target), get_quantization(quant)   # fail fast on bad names, before loading anything
    check_target_reads(preset, q)
    if preset.lib_ext == ".wasm":
        from .wasm_runtime import emcc_path

        emcc_path()  # the link step needs emscripten: say so before minutes of compiling
    out = Path(output)
    t_read = time.time()
    source = load_source(model)
    t0 = time.time()
    built = export_module(source, preset, q, context_window, tensor_parallel, options)
    from .vision_files import vision_section

    vision = vision_section(source.path, built.family.module, built.cfg) if source.kind == "hf" else None
    t1 = time.time()
    log.info("read %s and exported its model in %.1fs", source.path.name, t1 - t_read)
    if source.fp8 is not None:
        stored = f"re-quantized to {q.name}" if q.kind != "none" else f"kept as {q.model_dtype} ({q.name})"
        log.info("FP8 checkpoint (%s): weights dequantized to float and %s on this target",
                 source.fp8.format.describe(), stored)
    if source.int4 is not None:
        _log_int4(source, q)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    lib_name = "model" + preset.lib_ext
    if tuning_db is not None and not (Path(tuning_db) / "database_tuning_record.json").exists():
        raise FileNotFoundError(f"{tuning_db}: no tuning database there (create one with `mlcc tune`)")
    # The weights and the tokenizer are converted on other threads while this one compiles: the compile is mostly
    # one core of C++ (TVM releases the GIL), the conversion numpy loops on the others.
    # While the library compiles it keeps one core: the conversion gets the others, then all of them.
    from .weight_conversion import default_workers

    cancel, slots = threading.Event(), threading.Semaphore(max(1, default_workers() - 1))
    side_times: dict[str, float] = {}

    def weights_and_tokenizer() -> dict[str, Any]:
        t = time.time()
        if tensor_parallel == 1:
            write_weights(source, built, tmp, cancel=cancel, slots=slots)
        else:
            for rank in range(tensor_parallel):  # one tensor cache per GPU, each loaded by its own disco worker
                write_weights(source, built, tmp / artifact.shard_dir(rank), rank, cancel=cancel, slots=slots)
        side_times["weights"] = time.time() - t
        # after the weights, not beside them: the tokenizer is mostly Python, and would hold the GIL the compile needs
        return _tokenizer(source, tmp)

    log.info("compiling %s (%s, %s) for %s; converting its weights meanwhile", source.path.name,
             built.family.name, q.name, preset.name)
    from tqdm.contrib.logging import logging_redirect_tqdm

    # log lines printed above the progress bars instead of through them
    with logging_redirect_tqdm(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlcc-convert") as pool:
        converting = pool.submit(weights_and_tokenizer)
        try:
            key = _library_key(built, tuning_db) if preset.lib_ext != ".wasm" else None
            cached = _cached_library(built, key) if key else None
            if cached is not None:
                log.info("the library of a model of the same shape is in the cache: %s", cached.parent)
                shutil.copyfile(cached, tmp / lib_name)
            else:
                with _compile_progress(built):
                    compile_library(built, tmp / lib_name, tuning_db)
                if key:
                    _keep_library(built, key, tmp / lib_name)
        except BaseException:
            cancel.set()
            raise
        finally:
            if default_workers() > 1:
                slots.release()
        t2 = time.time()
        log.info("library ready in %.1fs", t2 - t1)
        tok = converting.result()
    t3 = time.time()
    config = _config_json(built, lib_name, tok, {"kind": source.kind, "path": str(source.path)})
    if vision is not None:   # the runtime's image preprocessing and where image tokens go
        config["vision"] = vision
    (tmp / artifact.CONFIG_FILE).write_text(json.dumps(config, indent=1))
    # Replace the output only once everything is written: an interrupted compile leaves the old folder intact.
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    lib_bytes = (out / lib_name).stat().st_size
    weight_bytes = sum(f.stat().st_size for f in out.rglob("params_shard_*.bin"))
    report = CompileReport(out, t1 - t0, t2 - t1, side_times.get("weights", t3 - t2), lib_bytes, weight_bytes)
    log.info("wrote %s: library %.1f MB, weights %.1f MB", out, lib_bytes / 1e6, weight_bytes / 1e6)
    return report

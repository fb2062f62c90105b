"""The artifacts folder format, shared by the compiler (writes) and the runtime (reads).

Kept free of TVM and the compiler so a deployment imports only this and TVM's runtime.

    DIR/model.so               library (holds a `_metadata` function returning the ABI stamp as JSON)
    DIR/params_shard_*.bin     weights; DIR/tensor-cache.json lists them (TVM's format) plus a sha256 per shard
    DIR/mlcc-config.json       model config, quantization, context window, parameter list, tokenizer files, stamp
    DIR/tokenizer.json, ...    tokenizer files, chat template
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import platform
from pathlib import Path
from typing import Any

from mlcc.errors import ArtifactError
from mlcc.options import CompileOptions

log = logging.getLogger(__name__)

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
               options: CompileOptions, cpu: dict[str, Any] | None = None) -> dict[str, Any]:
    """cpu: for CPU libraries, the CPU they were compiled for (targets.cpu_record): checked by check_cpu at load."""
    stamp = {
        "format": FORMAT_VERSION,
        "mlcc": mlcc_version(),
        "tvm": tvm_version(),
        "arch": arch,
        "quantization": quantization,
        "target": target,
        "param_hash": param_hash(params),
        "options": options.to_dict(),
    }
    if cpu is not None:
        stamp["cpu"] = cpu
    return stamp


# The instruction-set extensions (LLVM's names) whose absence makes a CPU library die of SIGILL. LLVM's other
# "features" are tuning hints (fast-*, macrofusion) or system instructions TVM's kernels never emit.
CPU_ISA_FEATURES = {
    "x86_64": ("sse3", "ssse3", "sse4.1", "sse4.2", "avx", "avx2", "fma", "f16c", "bmi", "bmi2", "avx512f",
               "avx512cd", "avx512dq", "avx512bw", "avx512vl", "avx512ifma", "avx512vbmi", "avx512vbmi2",
               "avx512vnni", "avx512bitalg", "avx512vpopcntdq", "avx512bf16", "avx512fp16", "avxvnni",
               "amx-tile", "amx-int8", "amx-bf16", "amx-fp16"),
    "aarch64": ("neon", "fullfp16", "dotprod", "i8mm", "bf16", "sve", "sve2", "sme"),
}
# /proc/cpuinfo's names where they differ from LLVM's (x86 "flags", arm64 "Features")
_CPUINFO_TO_LLVM = {
    "pni": "sse3", "sse4_1": "sse4.1", "sse4_2": "sse4.2", "bmi1": "bmi", "avx512_vnni": "avx512vnni",
    "avx512_bf16": "avx512bf16", "avx512_fp16": "avx512fp16", "avx512_vbmi2": "avx512vbmi2",
    "avx512_bitalg": "avx512bitalg", "avx512_vpopcntdq": "avx512vpopcntdq", "avx_vnni": "avxvnni",
    "amx_tile": "amx-tile", "amx_int8": "amx-int8", "amx_bf16": "amx-bf16", "amx_fp16": "amx-fp16",
    "asimd": "neon", "asimdhp": "fullfp16", "asimddp": "dotprod",
}


def host_machine() -> str:
    """This CPU's architecture in LLVM's spelling of a triple's first part."""
    m = platform.machine().lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(m, m)


def _cpuinfo_features(text: str) -> set[str]:
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return {_CPUINFO_TO_LLVM.get(f, f) for f in value.split()}
    return set()


def _llvm_host(name: str):
    """One of LLVM's host-detection functions through TVM (None where this TVM has no LLVM)."""
    try:
        import tvm

        return tvm.get_global_func(name, allow_missing=True)
    except Exception:  # noqa: BLE001 - a runtime-only TVM: /proc/cpuinfo still answers
        return None


@functools.lru_cache(maxsize=1)
def host_cpu_features() -> frozenset[str]:
    """The ISA extensions (CPU_ISA_FEATURES) this CPU has. LLVM's host detection (cpuid, and the OS's saving of
    the AVX-512/AMX state) united with /proc/cpuinfo's flags: a feature either reports is there, so that neither's
    gaps (LLVM's arm64 names, a kernel without some flag) refuses a library this CPU runs."""
    have: set[str] = set()
    detect = _llvm_host("tvm.codegen.llvm.GetHostCPUFeatures")
    if detect is not None:
        have |= {str(k) for k, v in dict(detect()).items() if v}
    try:
        have |= _cpuinfo_features(Path("/proc/cpuinfo").read_text())
    except OSError:
        pass
    return frozenset(have & set(CPU_ISA_FEATURES.get(host_machine(), ())))


@functools.lru_cache(maxsize=1)
def host_cpu() -> dict[str, Any]:
    """This CPU as the JIT cache key and the errors name it: architecture, LLVM's CPU name, ISA extensions."""
    name_fn = _llvm_host("target.llvm_get_system_cpu")
    name = str(name_fn()) if name_fn is not None else platform.processor() or "unknown"
    return {"machine": host_machine(), "name": name, "features": sorted(host_cpu_features())}


def missing_cpu_features(cpu: dict[str, Any], host: dict[str, Any]) -> list[str]:
    """What a library compiled for `cpu` needs that `host` lacks: its architecture, or ISA extensions."""
    if cpu.get("machine") and cpu["machine"] != host["machine"]:
        return [cpu["machine"]]
    return sorted(set(cpu.get("features", ())) - set(host["features"]))


def check_cpu(config: dict[str, Any], model_dir: Path, host: dict[str, Any] | None = None) -> None:
    """Refuse a CPU library that needs instructions this CPU lacks (it would die of SIGILL mid-generation), before
    it is loaded. host: this CPU (host_cpu()), for tests."""
    stamp = config.get("stamp", {})
    cpu = stamp.get("cpu")
    if cpu is None:  # compiled before libraries recorded their CPU: load as before, unchecked
        log.warning("%s: the library does not record the CPU features it was compiled for; if it crashes, rebuild "
                    "it on this machine with `mlcc compile SOURCE --target llvm --output %s`", model_dir, model_dir)
        return
    host = host or host_cpu()
    missing = missing_cpu_features(cpu, host)
    if missing:
        raise ArtifactError(
            f"{model_dir}: the library was compiled for a {cpu.get('name', '?')} CPU and needs {', '.join(missing)}, "
            f"which this CPU ({host['name']}) lacks; rebuild it on this machine with `mlcc compile SOURCE --target "
            f"llvm --quant {stamp.get('quantization', '?')} --output {model_dir}`")


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
    for key in ("format", "arch", "quantization", "param_hash", "options", "cpu"):
        if lib_stamp.get(key) != want.get(key):
            raise ArtifactError(f"{model_dir}: library was built for {key}={lib_stamp.get(key)!r} but the "
                                f"weights/config say {want.get(key)!r}; {hint}")
    if lib_stamp.get("tvm") != tvm_version():
        raise ArtifactError(f"{model_dir}: library was built with apache-tvm {lib_stamp.get('tvm')} but this runtime "
                            f"has {tvm_version()}; {hint}")
    if lib_stamp.get("mlcc") != mlcc_version():
        raise ArtifactError(f"{model_dir}: library was built by mlcc {lib_stamp.get('mlcc')} but this is mlcc "
                            f"{mlcc_version()}; {hint}")


def built_options(config: dict[str, Any]) -> CompileOptions:
    """The compile options an artifacts folder was built with."""
    return CompileOptions.from_dict(config.get("stamp", {}).get("options"))


def check_kv_cache_dtype(config: dict[str, Any], wanted: str | None, model_dir: Path) -> None:
    """Refuse an artifacts folder whose KV cache stores another dtype than the caller asks for (None: any): the
    cache's layout and the attention kernels reading it are compiled into the library."""
    have = built_options(config).kv_cache_dtype
    if wanted is not None and wanted != have:
        stamp = config.get("stamp", {})
        raise ArtifactError(f"{model_dir}: asked for --kv-cache-dtype {wanted} but it was compiled with {have}; "
                            f"recompile with `mlcc compile SOURCE --target {stamp.get('target', '?')} --quant "
                            f"{stamp.get('quantization', '?')} --option kv_cache_dtype={wanted} --output {model_dir}` or "
                            "drop --kv-cache-dtype")


def check_lora(config: dict[str, Any], max_loras: int | None, max_rank: int | None, model_dir: Path) -> None:
    """Refuse an artifacts folder that serves no LoRA adapters, or other pool sizes than asked for (None: any):
    the adapter pool's shape is compiled into the library."""
    have, stamp = built_options(config), config.get("stamp", {})
    n, r = max_loras or have.max_loras or 4, max_rank or have.max_lora_rank
    rebuild = (f"recompile with `mlcc compile SOURCE --target {stamp.get('target', '?')} --quant "
               f"{stamp.get('quantization', '?')} --option max_loras={n} --option max_lora_rank={r} --output "
               f"{model_dir}`")
    if not have.max_loras:
        raise ArtifactError(f"{model_dir} was compiled without LoRA, so it serves no adapters; {rebuild}")
    for flag, wanted, built in (("max-loras", max_loras, have.max_loras), ("max-lora-rank", max_rank,
                                                                            have.max_lora_rank)):
        if wanted is not None and wanted != built:
            raise ArtifactError(f"{model_dir}: asked for --{flag} {wanted} but it was compiled with {built}; "
                                f"{rebuild} or drop --{flag}")


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

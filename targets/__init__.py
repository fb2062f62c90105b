"""Target presets: what to hand tvm.compile, how the library is exported, and where it can run.

Plain dicts on purpose (TVM 0.27 only accepts targets as dicts or tags).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from mlcc import artifact
from mlcc.errors import UnsupportedTargetError

_LLVM_HOST = {"kind": "llvm"}


@dataclasses.dataclass(frozen=True)
class TargetPreset:
    name: str
    target: dict[str, Any] | str      # TVM target dict or tag
    device: str                       # runtime device kind: "cpu", "cuda", "rocm", "metal", "opencl"
    lib_ext: str = ".so"
    description: str = ""
    host: dict[str, Any] | None = None
    runs_with_wheel: bool = True      # the PyPI apache-tvm wheel for Linux x86-64 ships a runtime for it
    notes: str = ""

    def tvm_target(self):
        import tvm  # heavy; only when compiling

        if self.device == "cpu":
            return tvm.target.Target(_host_cpu_target() if self.name == "llvm" else self.target)
        return tvm.target.Target(self.target, host=self.host or _LLVM_HOST)

    def can_run_here(self) -> bool:
        """Whether this machine can execute libraries for this preset (the device exists and TVM has a runtime)."""
        import tvm

        if self.device == "cpu":
            return True
        try:
            return bool(self.runs_with_wheel and tvm.device(self.device, 0).exist)
        except Exception:  # noqa: BLE001 - no runtime for that device kind
            return False


def _host_cpu_target() -> dict[str, Any]:
    """The build machine's CPU, as clang's -march=native: vector width matters ~2x for decode on CPU. The CPU's
    name alone would claim every extension of its model, which a hypervisor may hide (a Zen 4 guest without
    AVX-512): the ISA extensions the host lacks are turned off, and those it has beyond its model's turned on."""
    import tvm
    from tvm.target import codegen

    cpu = codegen.llvm_get_system_cpu()
    model = codegen.llvm_get_cpu_features(tvm.target.Target({"kind": "llvm", "mcpu": cpu}))
    host = artifact.host_cpu_features()
    isa = artifact.CPU_ISA_FEATURES.get(artifact.host_machine(), ())
    mattr = [f"-{f}" for f in isa if f in model and f not in host] + \
            [f"+{f}" for f in isa if f in host and f not in model]
    target: dict[str, Any] = {"kind": "llvm", "mcpu": cpu, "num-cores": os.cpu_count() or 1}
    if mattr:
        target["mattr"] = mattr
    return target


def cpu_record(target) -> dict[str, Any]:
    """What a CPU library compiled for the TVM target `target` needs of the CPU it runs on, for its ABI stamp."""
    from tvm.target import codegen

    triple = str(target.attrs.get("mtriple", "")) or codegen.llvm_get_system_triple()
    machine = triple.split("-")[0].replace("arm64", "aarch64")
    features = codegen.llvm_get_cpu_features(target)
    return {"machine": machine, "name": str(target.attrs.get("mcpu", "generic")),
            "features": sorted(f for f in artifact.CPU_ISA_FEATURES.get(machine, ()) if f in features)}


TARGETS: dict[str, TargetPreset] = {
    "llvm": TargetPreset("llvm", {"kind": "llvm"}, "cpu", description="this host's CPU (mcpu detected at compile)"),
    "llvm-generic": TargetPreset("llvm-generic", {"kind": "llvm"}, "cpu",
                                 description="portable x86-64 CPU (no ISA extensions beyond the baseline)"),
    # The nvidia/nvidia-h100 tag says sm_90a, and TVM 0.27's dlight reads "90a" as no SM version at all
    # (check_sm_version → -1), which silently turns off tensor cores for every prefill GEMM. Nothing in TVM's
    # codegen uses the sm_90a-only instructions, so plain sm_90 with the tag's limits loses nothing.
    "cuda": TargetPreset("cuda", {"kind": "cuda", "arch": "sm_90", "max_num_threads": 1024,
                                  "max_threads_per_block": 1024, "max_shared_memory_per_block": 49152,
                                  "registers_per_block": 65536, "thread_warp_size": 32,
                                  "l2_cache_size_bytes": 52428800},
                         "cuda", description="NVIDIA Hopper (sm_90: H100/H200)"),
    "cuda-sm80": TargetPreset("cuda-sm80", {"kind": "cuda", "arch": "sm_80"}, "cuda",
                              description="NVIDIA Ampere and newer (sm_80: A100, also runs on Hopper)"),
    **{f"rocm-{arch}": TargetPreset(f"rocm-{arch}", {"kind": "rocm", "mcpu": arch}, "rocm", runs_with_wheel=False,
                                    description=f"AMD {desc} ({arch}; HSACO linked at build time)",
                                    notes="compile-only here: no PyPI TVM wheel ships a ROCm runtime; needs "
                                          "ld.lld >= 19 and rocm-device-libs (apt-get install lld-19 "
                                          "rocm-device-libs)")
       for arch, desc in (("gfx942", "Instinct MI300"), ("gfx90a", "Instinct MI200"), ("gfx1100", "Radeon RX 7900"))},
    "metal": TargetPreset("metal", "apple/m2-gpu", "metal", lib_ext=".tar", runs_with_wheel=False,
                          host={"kind": "llvm", "mtriple": "arm64-apple-macos", "mcpu": "apple-m1"},
                          description="Apple silicon GPU (MSL; arm64 macOS host code)",
                          notes="a .tar of arm64 objects: tvm.runtime.load_module links it on the Mac (Xcode "
                                "command line tools) with the macOS arm64 apache-tvm wheel, which has Metal"),
    # WGSL kernels + wasm32 host code linked with TVM's wasm runtime; runs in browsers and in Node through Dawn.
    # Browsers without shader-f16 (SwiftShader, many phones) need q4f32_1.
    "webgpu": TargetPreset("webgpu", {"kind": "webgpu", "max_num_threads": 256}, "webgpu", lib_ext=".wasm",
                           host={"kind": "llvm", "mtriple": "wasm32-unknown-unknown-wasm"}, runs_with_wheel=False,
                           description="WebGPU (WGSL kernels in a .wasm for browsers and Node.js)",
                           notes="runs through mlcc's JS engine (`mlcc web`), not the Python Engine; needs "
                                 "emscripten to link (apt-get install emscripten)"),
    # TVM 0.27's wheel has no SPIR-V codegen, so Vulkan runs the WebGPU build: Dawn (npm `webgpu`) translates
    # WGSL to SPIR-V and drives the Vulkan driver (GPU vendor's, Mesa lavapipe >= 24, or SwiftShader).
    "vulkan": TargetPreset("vulkan", {"kind": "webgpu", "max_num_threads": 256}, "webgpu", lib_ext=".wasm",
                           host={"kind": "llvm", "mtriple": "wasm32-unknown-unknown-wasm"}, runs_with_wheel=False,
                           description="Vulkan GPUs through Dawn's Vulkan backend (the WebGPU build, run by "
                                       "node_chat.mjs)",
                           notes="run: mlcc web DIR -o SITE && node SITE/node_chat.mjs SITE --backend vulkan "
                                 "(needs node + npm webgpu@0.6.2 and a Vulkan driver Dawn accepts)"),
    "opencl": TargetPreset("opencl", {"kind": "opencl"}, "opencl", runs_with_wheel=False,
                           description="OpenCL GPUs (OpenCL C kernels)",
                           notes="compile-only: the Linux wheel has no OpenCL runtime"),
}

ALIASES = {"cpu": "llvm", "cuda-sm90": "cuda", "h100": "cuda", "h200": "cuda", "rocm": "rocm-gfx942"}


def get_target(name: str) -> TargetPreset:
    name = ALIASES.get(name, name)
    if name not in TARGETS:
        raise UnsupportedTargetError(f"unsupported target '{name}'; choose one of: {', '.join(TARGETS)}")
    return TARGETS[name]


def detect_local() -> str:
    """The best target this machine can run: CUDA if a GPU answers, else the CPU."""
    return "cuda" if TARGETS["cuda"].can_run_here() else "llvm"

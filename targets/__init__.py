"""Target presets: what to hand tvm.compile, how the library is exported, and where it can run.

Plain dicts on purpose (TVM 0.27 only accepts targets as dicts or tags).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

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
    """The build machine's CPU: vector width matters ~2x for decode on CPU."""
    from tvm.target import codegen

    return {"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(), "num-cores": os.cpu_count() or 1}


TARGETS: dict[str, TargetPreset] = {
    "llvm": TargetPreset("llvm", {"kind": "llvm"}, "cpu", description="this host's CPU (mcpu detected at compile)"),
    "llvm-generic": TargetPreset("llvm-generic", {"kind": "llvm"}, "cpu",
                                 description="portable x86-64 CPU (no ISA extensions beyond the baseline)"),
    "cuda": TargetPreset("cuda", "nvidia/nvidia-h100", "cuda", description="NVIDIA Hopper (sm_90a: H100/H200)"),
    "cuda-sm80": TargetPreset("cuda-sm80", {"kind": "cuda", "arch": "sm_80"}, "cuda",
                              description="NVIDIA Ampere and newer (sm_80: A100, also runs on Hopper)"),
}

ALIASES = {"cpu": "llvm", "cuda-sm90": "cuda", "h100": "cuda", "h200": "cuda"}


class UnsupportedTargetError(ValueError):
    pass


def get_target(name: str) -> TargetPreset:
    name = ALIASES.get(name, name)
    if name not in TARGETS:
        raise UnsupportedTargetError(f"unsupported target '{name}'; choose one of: {', '.join(TARGETS)}")
    return TARGETS[name]


def detect_local() -> str:
    """The best target this machine can run: CUDA if a GPU answers, else the CPU."""
    for name in ("cuda",):
        if TARGETS[name].can_run_here():
            return name
    return "llvm"

"""Target presets: what to hand tvm.compile, how the library is exported, and where it can run.

Plain dicts on purpose (TVM 0.27 only accepts targets as dicts or tags).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class TargetPreset:
    name: str
    target: dict[str, Any] | str      # TVM target dict or tag
    device: str                       # runtime device kind: "cpu", "cuda", ...
    lib_ext: str = ".so"
    description: str = ""
    runs_on_wheel: bool = True        # the PyPI apache-tvm wheel has a runtime for it (Linux)

    def tvm_target(self):
        import tvm  # heavy; only when compiling

        host = {"kind": "llvm"}
        if self.device == "cpu":
            return tvm.target.Target(_host_cpu_target() if self.name == "llvm" else self.target)
        return tvm.target.Target(self.target, host=host)

    def stamp_target(self) -> str:
        return self.name


def _host_cpu_target() -> dict[str, Any]:
    """The build machine's CPU: vector width matters ~2x for decode on CPU."""
    from tvm.target import codegen
    import os

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
    import tvm

    try:
        if tvm.cuda(0).exist:
            return "cuda"
    except Exception:  # noqa: BLE001 - no CUDA runtime is the common case
        pass
    return "llvm"

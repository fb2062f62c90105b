"""Before a CUDA library built with CompileOptions.vendor_gemm runs: the cuBLASLt shim (mlcc.native.cublaslt_shim)
loaded into the process, built under mlcc's cache if need be, and the device's cuBLASLt handle made, since the
library calls `mlcc.cublaslt.*` by name and the shim creates nothing during a CUDA-graph capture."""

from __future__ import annotations

from pathlib import Path

from mlcc.artifact import ArtifactError
from mlcc.cache import cache_root
from mlcc.native import cublaslt_shim

CALL_PREFIX = b"mlcc.cublaslt."   # the names the library's host code calls (compiler/vendor_gemm.py)


def prepare(device_id: int) -> bool:
    """False (logged once) where the shim is unavailable."""
    if not cublaslt_shim.available(cache_root()):
        return False
    cublaslt_shim.prepare_device(device_id)
    return True


def prepare_for(library: Path, device_id: int) -> None:
    """The shim ready for `library` where it calls cuBLASLt (a build whose compiling machine had the shim);
    refused in one line, before anything runs, where this machine cannot build it."""
    if CALL_PREFIX not in Path(library).read_bytes():
        return
    if not prepare(device_id):
        raise ArtifactError(
            f"{library} calls cuBLASLt through mlcc's shim, which does not build here ({cublaslt_shim.failure()}); "
            "install g++ and pip's nvidia-cublas, nvidia-cuda-runtime, nvidia-cuda-crt and nvidia-cuda-cccl, or "
            "rebuild with --option vendor_gemm=0")

"""Before a CUDA library built with CompileOptions.vendor_gemm runs: the cuBLASLt shim (mlcc.native.cublaslt_shim)
loaded into the process, built under mlcc's cache if need be, and the device's cuBLASLt handle made, since the
library calls `mlcc.cublaslt.*` by name and the shim creates nothing during a CUDA-graph capture."""

from __future__ import annotations

from mlcc.cache import cache_root
from mlcc.native import cublaslt_shim


def prepare(device_id: int) -> bool:
    """False (logged once) where the shim is unavailable: such a library then fails at its first cuBLASLt call."""
    if not cublaslt_shim.available(cache_root()):
        return False
    cublaslt_shim.prepare_device(device_id)
    return True

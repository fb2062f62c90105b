"""External tools some targets need at build time, found or explained (never a traceback from deep in TVM)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator
from mlcc.errors import ToolchainError


@contextlib.contextmanager
def rocm_toolchain() -> Iterator[None]:
    """TVM links HSACO with `ld.lld` and the ROCm device bitcode. It looks for ld.lld-<its LLVM major> or a plain
    ld.lld; Debian's default ld.lld (LLVM 14) cannot read LLVM 22 objects, but lld 19+ can, so put the newest one
    first on PATH as `ld.lld` and point ROCM_PATH at Debian's rocm-device-libs when no ROCm install is set."""
    lld = next((shutil.which(f"ld.lld-{v}") for v in range(22, 18, -1) if shutil.which(f"ld.lld-{v}")), None)
    if lld is None and not Path("/opt/rocm/llvm/bin/ld.lld").exists():
        raise ToolchainError("ROCm builds need ld.lld from LLVM 19 or newer: `apt-get install lld-19` "
                             "(or a ROCm install under /opt/rocm)")
    env = dict(os.environ)
    if "ROCM_PATH" not in os.environ:
        for root in ("/opt/rocm", "/usr/lib/x86_64-linux-gnu"):
            if any((Path(root) / sub).exists() for sub in ("amdgcn/bitcode", "lib/bitcode")):
                os.environ["ROCM_PATH"] = root
                break
        else:
            raise ToolchainError("ROCm builds need the device bitcode libraries: `apt-get install "
                                 "rocm-device-libs` (or set ROCM_PATH to a ROCm install)")
    with tempfile.TemporaryDirectory() as d:
        if lld is not None:
            os.symlink(lld, Path(d) / "ld.lld")
            os.environ["PATH"] = f"{d}{os.pathsep}{env['PATH']}"
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(env)


@contextlib.contextmanager
def no_toolchain() -> Iterator[None]:
    yield


@contextlib.contextmanager
def cuda_source_helpers() -> Iterator[None]:
    """Our hand-written CUDA kernels call small device helpers (mlcc.schedules.cuda_source); TVM hands every
    generated CUDA translation unit to `tvm_callback_cuda_postproc`, where the helpers are added, so the library
    carries complete source."""
    import tvm_ffi

    from mlcc.schedules.cuda_source import add_cuda_helpers

    name = "tvm_callback_cuda_postproc"
    previous = tvm_ffi.get_global_func(name, allow_missing=True)

    def postproc(code: str, target=None) -> str:
        code = previous(code, target) if previous is not None else code
        return add_cuda_helpers(code)

    tvm_ffi.register_global_func(name, postproc, override=True)
    try:
        yield
    finally:
        if previous is not None:
            tvm_ffi.register_global_func(name, previous, override=True)
        else:
            tvm_ffi.remove_global_func(name)


def toolchain_for(kind: str):
    return {"rocm": rocm_toolchain, "cuda": cuda_source_helpers}.get(kind, no_toolchain)()

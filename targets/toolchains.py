"""External tools some targets need at build time, found or explained (never a traceback from deep in TVM)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from mlcc.errors import ToolchainError
from mlcc.tvm_compat import environment


@contextlib.contextmanager
def rocm_toolchain() -> Iterator[None]:
    """TVM links HSACO with `ld.lld` and the ROCm device bitcode. It looks for ld.lld-<its LLVM major> or a plain
    ld.lld; Debian's default ld.lld (LLVM 14) cannot read LLVM 22 objects, but lld 19+ can, so put the newest one
    first on PATH as `ld.lld` and point ROCM_PATH at Debian's rocm-device-libs when no ROCm install is set."""
    lld = next((shutil.which(f"ld.lld-{v}") for v in range(22, 18, -1) if shutil.which(f"ld.lld-{v}")), None)
    if lld is None and not Path("/opt/rocm/llvm/bin/ld.lld").exists():
        raise ToolchainError("ROCm builds need ld.lld from LLVM 19 or newer: `apt-get install lld-19` "
                             "(or a ROCm install under /opt/rocm)")
    env: dict[str, str] = {}
    if "ROCM_PATH" not in os.environ:
        for root in ("/opt/rocm", "/usr/lib/x86_64-linux-gnu"):
            if any((Path(root) / sub).exists() for sub in ("amdgcn/bitcode", "lib/bitcode")):
                env["ROCM_PATH"] = root
                break
        else:
            raise ToolchainError("ROCm builds need the device bitcode libraries: `apt-get install "
                                 "rocm-device-libs` (or set ROCM_PATH to a ROCm install)")
    with tempfile.TemporaryDirectory() as d:
        if lld is not None:
            os.symlink(lld, Path(d) / "ld.lld")
            env["PATH"] = f"{d}{os.pathsep}{os.environ.get('PATH', '')}"
        with environment(env):
            yield


@contextlib.contextmanager
def no_toolchain() -> Iterator[None]:
    yield


def toolchain_for(kind: str):
    return {"rocm": rocm_toolchain}.get(kind, no_toolchain)()

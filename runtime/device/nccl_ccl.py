"""NCCL collectives for TVM disco. The apache-tvm wheel ships disco's NCCL source (src/runtime/extra/disco/nccl)
but was built without it, so tensor parallelism would have no all-reduce. We compile that source once against the
wheel's headers, CUDA's and pip's NCCL (nvidia-nccl-cu*), cache the .so, and load it before the disco session
starts: it registers `runtime.disco.nccl.*`, which disco's built-in allreduce dispatches to.

MLCC_NCCL_BRIDGE=/path/to/lib.so loads a bridge built elsewhere instead (an escape hatch where this machine cannot
build one: no g++ or no CUDA headers)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

from mlcc.errors import NcclUnavailableError
from mlcc.native import TVM_SUPPORT_DIR as SUPPORT_DIR

log = logging.getLogger(__name__)

_LOADED: Path | None = None


def _nccl_dir() -> Path:
    try:
        import nvidia.nccl
    except ImportError as e:
        raise NcclUnavailableError("tensor parallelism needs NCCL: pip install nvidia-nccl-cu13 (or -cu12)") from e
    return Path(list(nvidia.nccl.__path__)[0])


def _cuda_include() -> Path:
    for d in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if d and (Path(d) / "include" / "cuda_runtime.h").exists():
            return Path(d) / "include"
    try:
        import nvidia.cuda_runtime

        inc = Path(list(nvidia.cuda_runtime.__path__)[0]) / "include"
        if (inc / "cuda_runtime.h").exists():
            return inc
    except ImportError:
        pass
    raise NcclUnavailableError("building the NCCL bridge needs CUDA headers (cuda_runtime.h): install the CUDA "
                               "toolkit or pip install nvidia-cuda-runtime-cu13, or set CUDA_HOME")


_STREAM_LOOKUP = """    const auto func = tvm::ffi::Function::GetGlobal("runtime.get_" TVM_DISCO_DEVICE_NAME "_stream");
    TVM_FFI_ICHECK(func.has_value());
    deviceStream_t stream = static_cast<deviceStream_t>((*func)().cast<void*>());"""
_ENV_STREAM = """    deviceStream_t stream = static_cast<deviceStream_t>(TVMFFIEnvGetStream(kDLCUDA, device_id));"""


def _issue_on_env_stream(header: Path) -> None:
    """Collectives go on the stream TVM launches kernels on (tvm-ffi's env stream). The wheel's source asks a
    global function that this runtime does not route to the env stream, so under TVM's CUDA-graph capture NCCL
    landed on a stream synchronizing with the legacy one (cudaErrorStreamCaptureUnsupported); on the env stream
    the all-reduce is captured into the graph like any kernel."""
    text = header.read_text()
    if _STREAM_LOOKUP not in text:
        raise NcclUnavailableError(f"{header}: disco's NCCL source changed; mlcc's stream patch needs updating")
    header.write_text(text.replace(_STREAM_LOOKUP, _ENV_STREAM).replace(
        "#include <tvm/ffi/function.h>", "#include <tvm/ffi/function.h>\n#include <tvm/ffi/extra/c_env_api.h>", 1))


def library_path() -> Path:
    """The bridge .so, compiled on first use (needs g++, CUDA headers, NCCL)."""
    import tvm
    import tvm_ffi

    from mlcc.cache import cache_root

    tvm_dir, ffi_dir, nccl = Path(tvm.__file__).parent, Path(tvm_ffi.__file__).parent, _nccl_dir()
    src_dir = tvm_dir / "src" / "runtime" / "extra" / "disco"
    key = hashlib.sha256(f"{tvm.__version__}|{tvm_ffi.__version__}|{nccl}|3".encode()
                         + (src_dir / "nccl" / "nccl.cc").read_bytes()).hexdigest()[:16]
    out = cache_root() / "nccl-ccl" / key / "libmlcc_disco_nccl.so"
    if out.exists():
        return out
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        raise NcclUnavailableError("building the NCCL bridge needs a C++ compiler (apt-get install g++)")
    stage = out.parent / "stage"
    shutil.rmtree(stage, ignore_errors=True)
    shutil.copytree(src_dir, stage / "src" / "runtime" / "extra" / "disco")
    shutil.copytree(SUPPORT_DIR / "src", stage / "src", dirs_exist_ok=True)
    _issue_on_env_stream(stage / "src" / "runtime" / "extra" / "disco" / "nccl" / "nccl_context.h")
    cuda_include = _cuda_include()
    libcudart = next(iter(sorted(cuda_include.parent.glob("lib*/libcudart.so*"))), None)
    cmd = [cxx, "-O2", "-shared", "-fPIC", "-std=c++17", f"-I{SUPPORT_DIR / 'include'}", f"-I{tvm_dir / 'include'}",
           f"-I{ffi_dir / 'include'}", f"-I{ffi_dir / '3rdparty' / 'dlpack' / 'include'}", f"-I{cuda_include}",
           f"-I{nccl / 'include'}", str(stage / "src" / "runtime" / "extra" / "disco" / "nccl" / "nccl.cc"),
           "-o", str(out) + ".tmp", f"-L{tvm_dir / 'lib'}", "-ltvm_runtime", "-ltvm_runtime_extra",
           f"-L{ffi_dir / 'lib'}", "-ltvm_ffi",
           f"-L{nccl / 'lib'}", "-l:libnccl.so.2"]
    cmd += [str(libcudart)] if libcudart else ["-lcudart"]
    log.info("building the NCCL bridge for TVM disco (once): %s", out)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NcclUnavailableError(f"compiling disco's NCCL source failed:\n{proc.stderr[-3000:]}")
    os.replace(str(out) + ".tmp", out)
    shutil.rmtree(stage, ignore_errors=True)
    return out


def load(path: Path | None = None) -> None:
    """Load NCCL and the bridge into this process (disco's threaded workers share it)."""
    global _LOADED
    if _LOADED is not None:
        return
    import tvm  # noqa: F401 - libtvm_runtime / libtvm_ffi must be loaded first

    ctypes.CDLL(str(_nccl_dir() / "lib" / "libnccl.so.2"), mode=ctypes.RTLD_GLOBAL)
    # disco's worker state lives in libtvm_runtime_extra, which `import tvm` may not have loaded
    ctypes.CDLL(str(Path(tvm.__file__).parent / "lib" / "libtvm_runtime_extra.so"), mode=ctypes.RTLD_GLOBAL)
    lib = Path(path or os.environ.get("MLCC_NCCL_BRIDGE") or library_path())
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    if tvm.get_global_func("runtime.disco.nccl.init_ccl", allow_missing=True) is None:
        raise NcclUnavailableError(f"{lib} loaded but registered no runtime.disco.nccl functions")
    # In runtime-only TVM, tvm.runtime.disco's FFI table was filled before libtvm_runtime_extra was loaded
    import tvm_ffi
    from tvm.runtime.disco import _ffi_api

    tvm_ffi.init_ffi_api("runtime.disco", _ffi_api.__name__)
    _LOADED = lib

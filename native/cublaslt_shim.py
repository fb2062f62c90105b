"""The cuBLASLt shim (cublaslt/mlcc_cublaslt.cc): compiled with g++ on first use against CUDA's headers (the
system toolkit, or pip's nvidia-cublas / nvidia-cuda-runtime / nvidia-cuda-crt / nvidia-cuda-cccl) and tvm-ffi's,
cached in a folder the caller names (mlcc's cache), and loaded with RTLD_GLOBAL: it registers the `mlcc.cublaslt.*`
global functions that libraries built with CompileOptions.vendor_gemm call. The compiler asks whether it builds
here (compiler/vendor_gemm.py); the runtime loads it before such a library runs (runtime/device/cublaslt.py).

MLCC_CUBLASLT_SHIM=/path/to/lib.so loads a shim built elsewhere instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import filelock

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "cublaslt" / "mlcc_cublaslt.cc"
MATMUL = {"none": "mlcc.cublaslt.matmul", "bias": "mlcc.cublaslt.matmul_bias", "add": "mlcc.cublaslt.matmul_add"}
# e4m3 activations (per-token scales) times e4m3 weights (per-channel scales): (xq, x_scale, w, w_scale, [extra,]
# workspace, out)
MATMUL_FP8 = {epi: name.replace("matmul", "matmul_fp8") for epi, name in MATMUL.items()}
_BUILD_REV = "1"

_loaded: Path | None = None
_failed: str | None = None


class CublasLtUnavailable(RuntimeError):
    """The shim cannot be built or loaded here (no g++, no CUDA headers or libcublasLt)."""


@dataclass(frozen=True)
class CudaPaths:
    include: list[Path]       # cublasLt.h, cuda_runtime.h (+ crt/, cccl's nv/ where split across packages)
    cublaslt: Path            # libcublasLt.so.*
    cudart: Path | None       # libcudart.so.* (None: the linker's default)


def _pip_roots() -> list[Path]:
    """pip's CUDA 13 layout (nvidia/cu13/{include,lib}) and the per-package cu12 one (nvidia/<pkg>/...)."""
    try:
        import nvidia
    except ImportError:
        return []
    roots = []
    for base in (Path(p) for p in nvidia.__path__):
        roots.append(base / "cu13")
        roots += [base / name for name in ("cublas", "cuda_runtime", "cuda_nvcc", "cuda_cccl")]
    return [r for r in roots if r.is_dir()]


def _find_lib(roots: list[Path], stem: str) -> Path | None:
    for r in roots:
        for sub in ("lib", "lib64", "targets/x86_64-linux/lib"):
            hits = sorted((r / sub).glob(f"{stem}.so.*")) if (r / sub).is_dir() else []
            hits = [h for h in hits if h.name.count(".") == 2] or hits  # libX.so.13 over libX.so.13.1.0.3
            if hits:
                return hits[0]
    return None


def cuda_paths() -> CudaPaths:
    """Where cuBLASLt's and CUDA's headers and libraries are: $CUDA_HOME, /usr/local/cuda, then pip's packages."""
    system = [Path(d) for d in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if d]
    for roots in ([r for r in system if (r / "include" / "cublasLt.h").exists()], _pip_roots()):
        includes = [r / "include" for r in roots if (r / "include").is_dir()]
        if not any((i / "cublasLt.h").exists() for i in includes) \
                or not any((i / "cuda_runtime.h").exists() for i in includes):
            continue
        cccl = [i / "cccl" for i in includes if (i / "cccl").is_dir()]  # (nv/target, cuda/std, split out in pip)
        lt = _find_lib(roots, "libcublasLt")
        if lt is not None:
            return CudaPaths(includes + cccl, lt, _find_lib(roots, "libcudart"))
    raise CublasLtUnavailable("cuBLASLt headers or library not found: install the CUDA toolkit (CUDA_HOME) or "
                              "pip install nvidia-cublas nvidia-cuda-runtime nvidia-cuda-crt nvidia-cuda-cccl")


def _ffi_paths() -> tuple[list[Path], Path]:
    import tvm_ffi.libinfo as info

    includes = [Path(info.find_include_path()), Path(info.find_dlpack_include_path())]
    return includes, Path(info.find_libtvm_ffi())


def library_path(cache_dir: Path) -> Path:
    """The shim .so under `cache_dir`, compiled on first use and keyed by source, CUDA and tvm-ffi versions."""
    import tvm_ffi

    cuda = cuda_paths()
    ffi_includes, libffi = _ffi_paths()
    key = hashlib.sha256(f"{tvm_ffi.__version__}|{cuda.cublaslt.resolve()}|{_BUILD_REV}".encode()
                         + SOURCE.read_bytes()).hexdigest()[:16]
    out = Path(cache_dir) / "cublaslt" / key / "libmlcc_cublaslt.so"
    if out.exists():
        return out
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        raise CublasLtUnavailable("building the cuBLASLt shim needs a C++ compiler (apt-get install g++)")
    out.parent.mkdir(parents=True, exist_ok=True)
    # the lock file outside the cache (flock leaves it in place): this user's runtime directory, named by the key
    locks = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / f"mlcc-locks-{os.getuid()}"
    locks.mkdir(mode=0o700, parents=True, exist_ok=True)
    with filelock.FileLock(locks / f"cublaslt-{key}.lock"):
        if out.exists():
            return out
        libs = [cuda.cublaslt] + ([cuda.cudart] if cuda.cudart else [])
        cmd = [cxx, "-O2", "-shared", "-fPIC", "-std=c++17", *(f"-I{i}" for i in ffi_includes + cuda.include),
               str(SOURCE), "-o", str(out) + ".tmp", str(libffi), *map(str, libs),
               *(f"-Wl,-rpath,{d}" for d in sorted({str(p.parent) for p in libs}))]
        if not cuda.cudart:
            cmd.append("-lcudart")
        log.info("building the cuBLASLt shim (once): %s", out)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise CublasLtUnavailable(f"compiling {SOURCE.name} failed:\n{proc.stderr[-3000:]}")
        os.replace(str(out) + ".tmp", out)
    return out


def load(cache_dir: Path) -> Path:
    """Load libcublasLt and the shim (built under `cache_dir` if need be) into this process, once; raises
    CublasLtUnavailable."""
    global _loaded
    if _loaded is not None:
        return _loaded
    import tvm_ffi

    prebuilt = os.environ.get("MLCC_CUBLASLT_SHIM")
    lib = Path(prebuilt or library_path(cache_dir))
    if not prebuilt:
        cuda = cuda_paths()
        # the shim's DT_NEEDED sonames then resolve to these, whatever LD_LIBRARY_PATH says; a soname this
        # process already has (TVM's libcudart, torch's libcublasLt) is kept, not loaded twice
        for dep in ([cuda.cudart] if cuda.cudart else []) + [cuda.cublaslt]:
            try:
                ctypes.CDLL(dep.name, mode=ctypes.RTLD_GLOBAL | os.RTLD_NOLOAD)
            except OSError:
                ctypes.CDLL(str(dep), mode=ctypes.RTLD_GLOBAL)
    try:
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise CublasLtUnavailable(f"loading {lib} failed: {e}") from e
    if tvm_ffi.get_global_func(MATMUL["none"], allow_missing=True) is None:
        raise CublasLtUnavailable(f"{lib} loaded but registered no mlcc.cublaslt functions")
    _loaded = lib
    return lib


def available(cache_dir: Path) -> bool:
    """Whether the shim builds and loads here; the first failure is logged once and remembered."""
    global _failed
    if _loaded is not None:
        return True
    if _failed is not None:
        return False
    try:
        load(cache_dir)
        return True
    except CublasLtUnavailable as e:
        _failed = str(e).splitlines()[0]
        log.warning("cuBLASLt GEMMs unavailable, keeping mlcc's GEMM kernels: %s", _failed)
        return False


def failure() -> str:
    """Why the shim did not build or load here (empty where it did, or was not tried)."""
    return _failed or ""


def prepare_device(device_id: int) -> None:
    """Create the cuBLASLt handle for a device before any CUDA-graph capture (the shim refuses to create one then)."""
    import tvm_ffi

    tvm_ffi.get_global_func("mlcc.cublaslt.init")(device_id)


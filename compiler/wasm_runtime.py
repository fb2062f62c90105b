"""Build TVM's wasm runtime (VM, paged KV cache, WebGPU device API) from the apache-tvm wheel's own sources.

The wheel ships `tvm/web/emcc/*.cc`, `src/runtime` and `include`; apache-tvm-ffi ships `src/ffi`. A few support
headers are missing from the wheel; `native/tvm_support/` holds our own versions. Sources are staged into a build
folder (so their relative includes resolve), compiled once to wasm objects with emscripten, and cached per
TVM/emscripten version. Model wasm files link against these objects.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mlcc.errors import ToolchainError
from mlcc.native import TVM_SUPPORT_DIR as SUPPORT_DIR

log = logging.getLogger(__name__)

RUNTIME_SOURCES = ("wasm_runtime", "tvmjs_support", "webgpu_runtime")
# Compiled wasm objects under TVM's .bc names (emcc reads either by content): as LLVM bitcode, every model link ran
# link-time codegen over the whole runtime again (~110 s of a tiny model's 115 s webgpu build on 2 cores)
RUNTIME_FORMAT = "wasm-object"


def emcc_env() -> dict[str, str]:
    env = dict(os.environ)
    # Debian's emscripten finds its JS dependencies (acorn, ...) only through NODE_PATH
    env.setdefault("NODE_PATH", "/usr/share/nodejs")
    return env


def emcc_path() -> str:
    emcc = shutil.which("emcc")
    if emcc is None:
        raise ToolchainError("emscripten is not installed: `apt-get install emscripten` (needs emcc on PATH)")
    return emcc


def emcc_version() -> str:
    out = subprocess.run([emcc_path(), "--version"], capture_output=True, text=True, env=emcc_env())
    return out.stdout.splitlines()[0] if out.stdout else "unknown"


def _wheel_dirs() -> tuple[Path, Path]:
    import tvm
    import tvm_ffi

    return Path(tvm.__file__).parent, Path(tvm_ffi.__file__).parent


def _fingerprint() -> str:
    import tvm
    import tvm_ffi

    h = hashlib.sha256()
    h.update(f"{tvm.__version__}|{tvm_ffi.__version__}|{emcc_version()}|{RUNTIME_FORMAT}".encode())
    for p in sorted(SUPPORT_DIR.rglob("*.h")):
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def runtime_dir() -> Path:
    from mlcc.cache import cache_root

    return cache_root() / "wasm-runtime" / _fingerprint()


def _stage(root: Path) -> None:
    """A tree shaped like TVM's source checkout: the wheel's sources with our headers laid over them."""
    tvm_dir, ffi_dir = _wheel_dirs()
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(tvm_dir / "src" / "runtime", root / "src" / "runtime")
    shutil.copytree(tvm_dir / "include", root / "include")
    shutil.copytree(tvm_dir / "web" / "emcc", root / "web" / "emcc", ignore=shutil.ignore_patterns("__pycache__"))
    ffi = root / "3rdparty" / "tvm-ffi"
    shutil.copytree(ffi_dir / "include", ffi / "include")
    shutil.copytree(ffi_dir / "src", ffi / "src")
    shutil.copytree(ffi_dir / "3rdparty" / "dlpack" / "include", ffi / "3rdparty" / "dlpack" / "include")
    shutil.copytree(SUPPORT_DIR / "include", root / "include", dirs_exist_ok=True)
    shutil.copytree(SUPPORT_DIR / "src", root / "src", dirs_exist_ok=True)
    shutil.copytree(SUPPORT_DIR / "3rdparty", root / "3rdparty", dirs_exist_ok=True)


def _compile_one(root: Path, name: str, out: Path) -> None:
    flags = [f"-I{root}", f"-I{root}/include", f"-I{root}/3rdparty/tvm-ffi/include",
             f"-I{root}/3rdparty/tvm-ffi/3rdparty/dlpack/include", f"-I{root}/3rdparty/compiler-rt",
             "-O3", "-std=c++17", "-Wno-ignored-attributes"]
    cmd = [emcc_path(), *flags, "-c", "-o", str(out), str(root / "web" / "emcc" / f"{name}.cc")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=emcc_env())
    if proc.returncode != 0:
        raise ToolchainError(f"building the TVM wasm runtime failed in {name}.cc:\n{proc.stderr[-6000:]}")


def build_runtime(force: bool = False) -> Path:
    """Folder with web/dist/wasm/{wasm_runtime,tvmjs_support,webgpu_runtime}.bc (shaped for TVM_HOME)."""
    from mlcc.cache import cache_lock

    home = runtime_dir()
    dist = home / "web" / "dist" / "wasm"

    def built() -> bool:
        return not force and all((dist / f"{n}.bc").exists() for n in RUNTIME_SOURCES)

    if not built():
        with cache_lock(home):
            if not built():  # another process may have built it while this one waited
                _build_runtime(home, dist)
    return home


def _build_runtime(home: Path, dist: Path) -> None:
    log.info("building the TVM wasm runtime with emscripten into %s (once per TVM version, a few minutes)", home)
    stage = home / "stage"
    _stage(stage)
    dist.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=max(1, min(3, os.cpu_count() or 1))) as pool:
        futures = {n: pool.submit(_compile_one, stage, n, dist / f"{n}.bc.tmp") for n in RUNTIME_SOURCES}
        for name, fut in futures.items():
            fut.result()
            log.info("  %s.bc built", name)
    for n in RUNTIME_SOURCES:
        (dist / f"{n}.bc.tmp").replace(dist / f"{n}.bc")
    shutil.rmtree(stage, ignore_errors=True)

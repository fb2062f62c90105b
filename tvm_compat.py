"""Every workaround for apache-tvm 0.27 in one place, each with the TVM behaviour it works around, so that a TVM
upgrade can check and delete them here. Nothing else in mlcc patches TVM or the process environment for TVM.

TVM is imported inside the functions: the runtime imports this module too, and must not pull in the compiler.
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)


@contextlib.contextmanager
def environment(updates: dict[str, str]) -> Iterator[None]:
    """Set `updates` in os.environ for the block, then restore exactly those keys. TVM's emscripten link
    (`tvm.support.emcc.create_tvmjs_wasm`) and its ROCm linker lookup read their settings only from the process
    environment (TVM_HOME, PATH, ROCM_PATH): there is no argument to pass them."""
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def pass_config(target: Any, rope_scaling: Any) -> dict[str, Any]:
    """PassContext settings a build needs. TIR CSE breaks TVM's GPU tree-attention kernel under scaled RoPE
    ("cse_v21 has been used before definition"); nvcc/NVRTC run their own CSE, so the kernels lose little."""
    config: dict[str, Any] = {}
    if target.kind.name != "llvm" and rope_scaling:
        config["tirx.disable_cse_tir"] = True
    return config


def without_metal_simdgroup(inner: Any) -> Any:
    """dlight's Matmul sends Metal to its simdgroup rule, which segfaults (a native crash, past its own try/except)
    on dynamic-batch matmuls in TVM 0.27. Run the rule set with that branch disabled so Matmul uses its generic
    tiled schedule instead."""
    import tvm
    import tvm.s_tir.dlight.gpu.matmul as dlm

    @tvm.transform.module_pass(opt_level=0, name="mlcc_metal_schedule")
    def _pass(mod: Any, _ctx: Any) -> Any:
        original = dlm.MetalMatmul.apply
        dlm.MetalMatmul.apply = lambda self, *a, **k: None
        try:
            return inner(mod)
        finally:
            dlm.MetalMatmul.apply = original

    return _pass


def _frames_with_lines(context: int = 1) -> list[inspect.FrameInfo]:
    """`inspect.stack()` (the caller's frame first) with the current line as code context where there is a file."""
    frame, out = sys._getframe(1), []
    while frame is not None:
        code = frame.f_code
        line = linecache.getline(code.co_filename, frame.f_lineno) if context > 0 else ""
        out.append(inspect.FrameInfo(frame, code.co_filename, frame.f_lineno, code.co_name,
                                     [line] if line else None, 0 if line else None))
        frame = frame.f_back
    return out


def import_tensor_intrinsics() -> None:
    """Import tvm.s_tir.tensor_intrin (dlight's GPU Matmul rule imports it on first use) in seconds, not ~40 s.

    The package parses ~270 TVMScript functions; each parse calls `inspect.stack()`, and for every frame of the
    import machinery ("<frozen importlib...>", not a file on disk) `inspect.getmodule` scans all of `sys.modules`
    (~2000 entries once TVM is loaded): 38.9 s of a 66.6 s first CUDA compile of the Llama-3-8B shape on a 2-core
    machine, 3.3 s this way. The parser only uses the frames and the caller's source line, so during that one
    import `inspect.stack` is a frame walk that reads lines through linecache and never calls getmodule."""
    if "tvm.s_tir.tensor_intrin" in sys.modules:
        return
    t0 = time.time()
    original = inspect.stack
    inspect.stack = _frames_with_lines
    try:
        import tvm.s_tir.tensor_intrin  # noqa: F401  (registers the MMA/WMMA intrinsics)
    finally:
        inspect.stack = original
    log.debug("tensor intrinsics imported in %.1f s", time.time() - t0)


@contextlib.contextmanager
def prefill_kernel_blocks(num_blocks: int) -> Iterator[None]:
    """TVM's prefill attention builders take their grid size (NUM_BLKS) from the private
    `_get_prefill_kernel_config` with no way to pass another; replace its first result for the block."""
    from tvm.relax.frontend.nn.llm import _prefill_kernels as pk

    original = pk._get_prefill_kernel_config

    def wider(*args: Any, **kwargs: Any) -> tuple:
        _, *rest = original(*args, **kwargs)
        return (num_blocks, *rest)

    pk._get_prefill_kernel_config = wider
    try:
        yield
    finally:
        pk._get_prefill_kernel_config = original


@contextlib.contextmanager
def cuda_source_postproc(transform: Callable[[str], str]) -> Iterator[None]:
    """TVM hands every generated CUDA translation unit to the global `tvm_callback_cuda_postproc` and offers no
    per-build hook: chain `transform` after whatever is registered for the block, then restore it."""
    import tvm_ffi

    name = "tvm_callback_cuda_postproc"
    previous = tvm_ffi.get_global_func(name, allow_missing=True)

    def postproc(code: str, target: Any = None) -> str:
        code = previous(code, target) if previous is not None else code
        return transform(code)

    tvm_ffi.register_global_func(name, postproc, override=True)
    try:
        yield
    finally:
        if previous is not None:
            tvm_ffi.register_global_func(name, previous, override=True)
        else:
            tvm_ffi.remove_global_func(name)


def register_cuda_jit(arch: str) -> None:
    """Libraries cross-compiled on a GPU-less host carry CUDA source, compiled when loaded. TVM's own
    `tvm_callback_cuda_compile` asks the current Target for the arch, which runtime-only mode cannot answer; the
    arch recorded at build time is passed instead."""
    import tvm_ffi
    from tvm.support import nvcc

    def compile_for_arch(code: str) -> bytes:
        mode = os.environ.get("TVM_CUDA_COMPILE_MODE", "nvrtc").lower()
        return nvcc.compile_cuda(code, target_format="cubin" if mode == "nvrtc" else "fatbin", arch=arch,
                                 compiler=mode)

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", compile_for_arch, override=True)


def load_backend_runtimes(device: str) -> None:
    """In runtime-only mode (TVM_USE_RUNTIME_LIB=1, no libtvm_compiler) TVM skips loading its CUDA runtime
    library; load it by hand so CUDA devices and modules exist."""
    import tvm

    if device != "cuda" or hasattr(tvm, "relax"):
        return
    from tvm.base import _LOADED_LIBS
    from tvm_ffi.libinfo import load_lib_ctypes

    d = Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent
    if "tvm_runtime_cuda" not in _LOADED_LIBS:
        _LOADED_LIBS["tvm_runtime_cuda"] = load_lib_ctypes(package="tvm", target_name="tvm_runtime_cuda",
                                                           extra_lib_paths=[d], mode="RTLD_LOCAL")

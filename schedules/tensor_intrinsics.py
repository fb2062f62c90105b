"""Import TVM's tensor-core intrinsics (tvm.s_tir.tensor_intrin) in seconds instead of ~40 s (default_schedule_passes
does it for CUDA, which covers compile and tuning).

dlight's GPU Matmul rule imports that package on first use, which parses ~270 TVMScript functions. Each parse calls
`inspect.stack()`, and for every frame of the import machinery ("<frozen importlib...>", not a file on disk) the
standard library's `inspect.getmodule` scans all of `sys.modules` (~2000 entries once TVM is loaded): 38.9 s, most
of the 66.6 s first CUDA compile of the Llama-3-8B shape on the 2-core dev machine, against 3.3 s this way
(bench/tensor_intrin_import.py).
The parser only uses the stack's frames and the caller's source line, so during that one import `inspect.stack`
is replaced by a walk over the frames that reads lines through linecache and never calls getmodule.
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import logging
import sys
import time

log = logging.getLogger(__name__)


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


@contextlib.contextmanager
def _fast_inspect_stack():
    original = inspect.stack
    inspect.stack = _frames_with_lines
    try:
        yield
    finally:
        inspect.stack = original


def preload() -> None:
    """Import tvm.s_tir.tensor_intrin (once per process) with the fast stack walk."""
    if "tvm.s_tir.tensor_intrin" in sys.modules:
        return
    t0 = time.time()
    with _fast_inspect_stack():
        import tvm.s_tir.tensor_intrin  # noqa: F401  (registers the MMA/WMMA intrinsics)
    log.debug("tensor intrinsics imported in %.1f s", time.time() - t0)

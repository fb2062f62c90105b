"""Device helpers that mlcc's hand-written CUDA kernels call, added to the generated source of any module that calls
them (TVM hands every CUDA translation unit to `tvm_callback_cuda_postproc`; targets/toolchains.py hooks it), so a
library carries complete source."""

from __future__ import annotations


def _helper_groups() -> list[tuple[str, str]]:
    """(a name the kernels call, the source that defines it and its siblings)."""
    from . import cuda_gemv, cuda_pdl

    return [(cuda_gemv.HELPER_NAME, cuda_gemv.CUDA_HELPERS), (cuda_gemv.F16_HELPER_NAME, cuda_gemv.F16_HELPERS),
            (cuda_gemv.NORM_HELPER_NAME, cuda_gemv.NORM_HELPERS),
            (cuda_pdl.WAIT, cuda_pdl.CUDA_HELPERS)]


def _marker(name: str) -> str:
    return f"// mlcc device helpers: {name}"


def add_cuda_helpers(code: str) -> str:
    """Insert each helper group the code calls (once) before the first kernel of the translation unit."""
    wanted = "".join(f"{_marker(name)}\n{src}" for name, src in _helper_groups()
                     if f"{name}(" in code and _marker(name) not in code)
    if not wanted:
        return code
    at = code.find('extern "C" __global__')
    return code[:at] + wanted + "\n" + code[at:] if at >= 0 else wanted + code

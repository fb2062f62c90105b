"""Device helpers that mlcc's hand-written CUDA kernels call, added to the generated source of any module that calls
them (TVM hands every CUDA translation unit to `tvm_callback_cuda_postproc`; targets/toolchains.py hooks it), so a
library carries complete source."""

from __future__ import annotations

import re

_DEFINED = re.compile(r"__device__\s+__forceinline__\s+[\w\s*]+?\b(\w+)\s*\(")


def _helper_groups() -> list[str]:
    """The helper sources; each is added whole where the code, or another group added, calls any function it
    defines. A group may call the groups listed before it."""
    from . import cuda_gemv, cuda_gemv_tc, cuda_pdl

    return [cuda_gemv.CUDA_HELPERS, cuda_gemv.F16_HELPERS, cuda_gemv.NORM_HELPERS, cuda_gemv_tc.CUDA_HELPERS,
            cuda_pdl.CUDA_HELPERS]


def _marker(name: str) -> str:
    return f"// mlcc device helpers: {name}"


def add_cuda_helpers(code: str) -> str:
    """Insert each helper group the code calls, directly or through a group it calls, once, before the first kernel
    of the translation unit, in the order of _helper_groups."""
    groups = [(src, _DEFINED.findall(src)) for src in _helper_groups()]
    chosen, calls = set(), code
    for i in reversed(range(len(groups))):  # callers come after their callees: one pass from the end
        src, names = groups[i]
        # (a call, not the definition a previous insertion brought along: those sit behind the group's marker)
        if any(f"{n}(" in calls for n in names) and _marker(names[0]) not in code:
            chosen.add(i)
            calls += src
    if not chosen:
        return code
    wanted = "".join(f"{_marker(names[0])}\n{src}" for i, (src, names) in enumerate(groups) if i in chosen)
    at = code.find('extern "C" __global__')
    return code[:at] + wanted + "\n" + code[at:] if at >= 0 else wanted + code

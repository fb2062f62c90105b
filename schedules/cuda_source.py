"""Device helpers that mlcc's hand-written CUDA kernels call, added to the generated source of any module that calls
them, so a library carries complete source. compiler/build.py runs `add_cuda_helpers` on every CUDA translation
unit TVM generates (through mlcc.tvm_compat.cuda_source_postproc).

The helpers are plain CUDA in schedules/cuda/*.cuh (package data), one group per file.
"""

from __future__ import annotations

import re
from pathlib import Path

from mlcc.quantization import QUANTIZATIONS, Quantization, weight_scheme

_DEFINED = re.compile(r"__device__\s+__forceinline__\s+[\w\s*]+?\b(\w+)\s*\(")

# In dependency order: a group may call the groups listed before it (moe_gemv and q8_gemv call q4_gemv's).
HELPER_FILES = ("q4_gemv.cuh", "q4_gemv_tokens.cuh", "q8_gemv.cuh", "e4m3_gemv.cuh", "f16_gemv.cuh", "rms_norm.cuh",
                "pdl.cuh", "tc_gemm.cuh", "flash_prefill.cuh", "moe_gemv.cuh")
HELPER_DIR = Path(__file__).with_name("cuda")
# Each group is added whole where the code, or another group added, calls any function it defines.
HELPER_GROUPS = tuple((HELPER_DIR / name).read_text() for name in HELPER_FILES)


def decodes_q4(q: Quantization | None) -> bool:
    """Whether the q4 device code (q4_gemv*.cuh, tc_gemm.cuh, moe_gemv.cuh) decodes scheme `q`: symmetric 4-bit
    codes centred on 7, 8 a uint32 word low code first, one float16 scale per 32 codes (one 16-byte load of a
    row); those sizes are compiled into the helpers."""
    return q is not None and (q.kind, q.bits, q.storage_dtype, q.group_size, q.scale_dtype, q.symmetric,
                              q.zero_code) == ("group", 4, "uint32", 32, "float16", True, 7)


def decodes_int8(q: Quantization | None) -> bool:
    """Whether the int8 device code (q8_gemv.cuh) decodes scheme `q`: symmetric 8-bit codes stored + 128, 4 a uint32
    word low byte first, one float16 scale per 32 codes (two 16-byte loads of a row), float16 activations."""
    return q is not None and (q.kind, q.bits, q.storage_dtype, q.group_size, q.scale_dtype, q.model_dtype,
                              q.symmetric, q.zero_code) == ("group", 8, "uint32", 32, "float16", "float16", True, 128)


def decodes_e4m3(q: Quantization | None) -> bool:
    """Whether the e4m3 device code (e4m3_gemv.cuh) decodes scheme `q`: e4m3 codes, one float32 scale per row,
    float16 activations."""
    return q is not None and (q.kind, q.storage_dtype, q.scale_dtype, q.model_dtype) == \
        ("float8", "float8_e4m3fn", "float32", "float16")


def q4_scheme(weights: str | None = None) -> Quantization:
    """The scheme named `weights`, which the q4 device code must decode (by default the first scheme it does)."""
    q = weight_scheme(weights) if weights is not None else \
        next(q for q in QUANTIZATIONS.values() if decodes_q4(q))
    if not decodes_q4(q):
        raise ValueError(f"the CUDA q4 kernels do not decode '{weights}' weights")
    return q


def _marker(name: str) -> str:
    return f"// mlcc device helpers: {name}"


def add_cuda_helpers(code: str) -> str:
    """Insert each helper group the code calls, directly or through a group it calls, once, before the first kernel
    of the translation unit, in HELPER_FILES order."""
    groups = [(src, _DEFINED.findall(src)) for src in HELPER_GROUPS]
    chosen, calls = set(), code
    for i in reversed(range(len(groups))):  # callers come after their callees: one pass from the end
        src, names = groups[i]
        # (a call, not the definition a previous insertion brought along: those sit behind the group's marker)
        # (a template is called with its arguments: `name<...>(`)
        if any(f"{n}(" in calls or f"{n}<" in calls for n in names) and _marker(names[0]) not in code:
            chosen.add(i)
            calls += src
    if not chosen:
        return code
    wanted = "".join(f"{_marker(names[0])}\n{src}" for i, (src, names) in enumerate(groups) if i in chosen)
    at = code.find('extern "C" __global__')
    return code[:at] + wanted + "\n" + code[at:] if at >= 0 else wanted + code

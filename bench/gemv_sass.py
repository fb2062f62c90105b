"""SASS instruction counts of the q4f16_1 decode GEMVs of the Llama-3-8B shape (no GPU needed): the two-shift
unpacking (MLCC_Q4_ONE_SHIFT=0), the default one-shift unpacking and the tensor-core kernel (MLCC_Q4_KERNEL=tc); and a bit-exact numpy check of the one-shift
arithmetic for all 16 codes. (Session 9 also counted two int8-activation designs with this script, then removed
them: bench/results/README.md, issue 4 session 9.)

    pip download --no-deps nvidia-cuda-cuobjdump -d /tmp/w && python -m zipfile -e /tmp/w/*.whl /tmp/w/x
    python bench/gemv_sass.py --cuobjdump /tmp/w/x/nvidia/cu13/bin/cuobjdump     # needs nvcc

Sessions 8 and 9 (this 2-core dev machine, nvcc 13, sm_90a): bench/results/README.md, issue 4.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np

SHAPES = {"qkv": (6144, 4096, "none", True), "o": (4096, 4096, "add", False), "gate_up": (14336, 4096, "swiglu", True),
          "down": (4096, 14336, "add", False)}
COUNTED = ("HFMA2", "HADD2", "HMMA", "LOP3", "SHF", "PRMT", "LDS", "LDG")
VARIANTS = {"two-shift": {"MLCC_Q4_ONE_SHIFT": "0", "MLCC_Q4_KERNEL": "cuda-core"},
            "one-shift": {"MLCC_Q4_ONE_SHIFT": "1", "MLCC_Q4_KERNEL": "cuda-core"},
            "tensor-core": {"MLCC_Q4_KERNEL": "tc"}}  # session 10: schedules/cuda_gemv_tc.py


def one_shift_is_exact() -> bool:
    """code - 7 from the masked halves: 1024 + c minus 1031 (codes 0/4, 2/6) and (1024 + 16c) / 16 - 71 with one
    rounding (codes 1/5, 3/7), in fp16, as the two CUDA helpers compute it."""
    def half(bits: int) -> float:
        return float(np.array([bits], np.uint16).view(np.float16)[0])

    sixteenth, bias16 = half(0x2C00), half(0xD470)
    return all(np.float16(half(0x6400 | c) - 1031.0) == c - 7
               and np.float16(half(0x6400 | (c << 4)) * sixteenth + bias16) == c - 7 for c in range(16))


def kernel_source(variant: str) -> str:
    import tvm

    from mlcc.schedules import cuda_pdl
    from mlcc.schedules.cuda_gemv import GemvShape, make_gemv
    from mlcc.targets import get_target
    from mlcc.targets.toolchains import toolchain_for

    os.environ.update(VARIANTS[variant])
    target = get_target("cuda").tvm_target()
    shapes = {n: GemvShape(rows, k, epi, (1, 1, rows) if epi == "add" else (), norm_eps=1e-5 if norm else None)
              for n, (rows, k, epi, norm) in SHAPES.items()}
    with target, toolchain_for("cuda"):
        mod = tvm.IRModule({n: make_gemv(s, pdl=True).with_attr("global_symbol", n) for n, s in shapes.items()})
        ex = tvm.compile(mod, target, tir_pipeline=cuda_pdl.tir_pipeline_for(target))
    (cuda,) = [m for m in ex.mod.imports if m.kind == "cuda"]
    return cuda.inspect_source()


def units_per_thread(variant: str, name: str) -> float:
    """16-byte units of codes (32 codes each) one thread streams in the kernel's default launch configuration (on
    average: a CUDA-core thread's last iteration may be partial), to put the SASS totals per byte."""
    from mlcc.schedules.cuda_gemv import GemvShape, launch_config
    from mlcc.schedules.cuda_gemv_tc import tc_launch_config

    rows, k, epi, _ = SHAPES[name]
    groups = k // 32
    if variant == "tensor-core":  # per step a lane streams one group of each of its two rows
        chunks = -(-groups // 4)
        _, ksplit = tc_launch_config(-(-rows // (8 if epi == "swiglu" else 16)), chunks)
        return 2 * chunks / ksplit
    lanes, rows_w, _, ksplit = launch_config(GemvShape(rows, k, epi).weight_rows, groups)
    if epi == "swiglu":
        rows_w = 2 * max(1, rows_w // 2)
    return rows_w * groups / (lanes * ksplit)


def sass_counts(src: str, cuobjdump: str, work: Path) -> dict[str, dict[str, int]]:
    (work / "k.cu").write_text(src)
    built = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", "-o", str(work / "k.cubin"),
                            str(work / "k.cu")], check=True, capture_output=True, text=True)
    registers = dict(re.findall(r"Compiling entry function '(\w+?)_kernel'.*?Used (\d+) registers",
                                built.stdout + built.stderr, re.S))
    sass = subprocess.run([cuobjdump, "-sass", str(work / "k.cubin")], check=True, capture_output=True,
                          text=True).stdout
    out = {}
    for func in re.split(r"\n\s+Function : ", sass)[1:]:
        name = func.split("\n", 1)[0].strip().removesuffix("_kernel")
        ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", func)
        kinds = collections.Counter(op.split(".")[0] for op in ops)
        out[name] = {"registers": int(registers[name]), "total": len(ops), **{k: kinds[k] for k in COUNTED}}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cuobjdump", required=True)
    a = p.parse_args()
    print("one-shift unpacking exact for all 16 codes:", one_shift_is_exact())
    with tempfile.TemporaryDirectory() as d:
        for variant in VARIANTS:
            for name, c in sass_counts(kernel_source(variant), a.cuobjdump, Path(d)).items():
                units = units_per_thread(variant, name)
                print(f"{variant:11} {name:8} " + " ".join(f"{k} {v}" for k, v in c.items())
                      + f" | per 16 B of codes: {c['total'] / units:.1f} ({units:g} units a thread)", flush=True)


if __name__ == "__main__":
    main()

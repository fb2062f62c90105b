"""Why most meta-schedule candidates for the CUDA fp16 GEMM fail to build (issue 7), measured without a GPU:
the builder runs here, so build errors are real; the runner then fails for want of a CUDA device, which is
counted separately.

    python bench/ms_build_failures.py --trials 16 --out bench/results/ms_build_failures.json

Variants of C[M, N] = A[M, K] · B[N, K]^T (2048 x 4096 x 4096, fp16 inputs, the `cuda` preset, sm_90):
  f16-accumulate   sum in fp16 (what q0f16/q4f16 model matmuls are)
  f32-accumulate   inputs cast to fp32, fp32 output
  f32-acc+f16-out  fp32 sum then a cast to fp16 (the mixed-precision GEMM of the issue's measurement)
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import tempfile
import time
from pathlib import Path

M, N, K = 2048, 4096, 4096


def gemm(variant: str):
    import tvm
    from tvm import te

    a = te.placeholder((M, K), "float16", name="A")
    b = te.placeholder((N, K), "float16", name="B")
    k = te.reduce_axis((0, K), "k")
    if variant == "f16-accumulate":
        out = te.compute((M, N), lambda i, j: te.sum(a[i, k] * b[j, k], axis=k), name="C")
    else:
        out = te.compute((M, N), lambda i, j: te.sum(a[i, k].astype("float32") * b[j, k].astype("float32"), axis=k),
                         name="C")
        if variant == "f32-acc+f16-out":
            acc = out
            out = te.compute((M, N), lambda i, j: acc[i, j].astype("float16"), name="D")
    return tvm.IRModule({"main": te.create_prim_func([a, b, out])})


def classify(log: str) -> collections.Counter:
    """One reason per failed trial: the last error line of each build/run failure."""
    reasons: collections.Counter = collections.Counter()
    for kind, marker in (("build", "Error in building:"), ("run", "Error in running:")):
        for block in log.split(marker)[1:]:
            lines = [ln.strip() for ln in block.splitlines()[:200]]
            errs = [ln for ln in lines if ln.startswith(("tvm.error.", "RuntimeError", "ValueError", "TypeError"))]
            reasons[f"{kind}: {(errs[0] if errs else lines[-1])[:200]}"] += 1
    return reasons


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from mlcc.schedules.tensor_intrinsics import preload

    preload()  # registers the MMA intrinsics the CUDA rules use
    from tvm.s_tir import meta_schedule as ms

    from mlcc.targets import get_target

    target = get_target("cuda").tvm_target()
    rows = {}
    for variant in ("f16-accumulate", "f32-accumulate", "f32-acc+f16-out"):
        wd = Path(tempfile.mkdtemp(prefix="ms-"))
        t = time.time()
        try:
            ms.tune_tir(gemm(variant), target, str(wd), max_trials_global=a.trials, num_trials_per_iter=a.trials,
                        runner=ms.runner.LocalRunner(timeout_sec=5))
        except Exception as e:  # noqa: BLE001 - no candidate ran (no GPU here); the logs say why
            print(f"{variant}: tune_tir ended with {type(e).__name__}")
        log = "\n".join(f.read_text() for f in (wd / "logs").glob("*.log"))
        reasons = classify(log)
        rows[variant] = {"trials": a.trials, "seconds": round(time.time() - t, 1), "failures": dict(reasons)}
        shutil.rmtree(wd, ignore_errors=True)
        print(variant, json.dumps(rows[variant], indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

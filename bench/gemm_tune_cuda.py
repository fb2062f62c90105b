"""fp16 GEMM on the H200 (issue 7): cuBLAS (torch) vs TVM's dlight default vs meta-schedule tuned, one run.

    # device (nvidia-h200), carrying .gpu (../shared/gpu/pack.sh): full TVM, so tuning builds there too
    source .gpu/setup.sh && python3 bench/gemm_tune_cuda.py --trials 48 --out $OUT
    # mlcc's fused q4f16_1 dequantize-GEMM (the model's prefill kernel: packed weights, group scales), default
    # schedule only, against cuBLAS fp16 on the dequantized weights
    python3 bench/gemm_tune_cuda.py --kernel q4f16_1 --trials 0 --shape 2048x14336x4096 --out $OUT
    # with meta-schedule's xgboost cost model: xgboost-cpu travels in a second call made while the machine is warm
    # (../shared/gpu/pack.sh --extra; it does not fit next to TVM in one call), see bench/tune_xgb_h200.sh

fp16 accumulate (the model matmuls' dtype; fp32-accumulate candidates mostly fail to build in TVM 0.27, see
ms_build_failures.py). Outputs are checked against torch before anything is timed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

DEFAULT_SHAPE = "2048x4096x4096"


def gemm_mod(M: int, N: int, K: int):
    import tvm
    from tvm import te

    a = te.placeholder((M, K), "float16", name="A")
    b = te.placeholder((N, K), "float16", name="B")
    k = te.reduce_axis((0, K), "k")
    c = te.compute((M, N), lambda i, j: te.sum(a[i, k] * b[j, k], axis=k), name="C")
    return tvm.IRModule({"main": te.create_prim_func([a, b, c])})


def q4_gemm_mod(M: int, N: int, K: int):
    """x[M,K] @ dequantize(packed[N,K/8], scales[N,K/32]).T, the block structure of mlcc's prefill matmuls."""
    import tvm
    from tvm import te

    from mlcc.compiler.quantize import _dequant_value, get_quantization

    q = get_quantization("q4f16_1")
    x = te.placeholder((M, K), "float16", name="x")
    qw = te.placeholder((N, K // 8), "uint32", name="qw")
    qs = te.placeholder((N, K // 32), "float16", name="qs")
    w = te.compute((N, K), lambda i, j: _dequant_value(qw, qs, i, j, q), name="dequantize")
    k = te.reduce_axis((0, K), "k")
    c = te.compute((M, N), lambda i, j: te.sum(x[i, k] * w[j, k], axis=k), name="matmul")
    return tvm.IRModule({"main": te.create_prim_func([x, qw, qs, c])})


def time_tvm(lib, dev, args) -> float:
    f = lib.time_evaluator("main", dev, number=20, repeat=3)
    return min(f(*args).results)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=48)
    p.add_argument("--out", default="/tmp/out")
    p.add_argument("--cost-model", default="random", choices=["random", "xgb"])
    p.add_argument("--shape", default=DEFAULT_SHAPE, help="MxNxK")
    p.add_argument("--kernel", default="fp16", choices=["fp16", "q4f16_1"])
    a = p.parse_args()
    M, N, K = (int(v) for v in a.shape.split("x"))
    import torch
    import tvm
    from tvm.s_tir import dlight, meta_schedule as ms

    from mlcc.schedules.tensor_intrinsics import preload

    preload()  # the MMA intrinsics dlight's tensor-core rule uses

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_num_threads": 1024,
                                "max_threads_per_block": 1024, "max_shared_memory_per_block": 49152,
                                "thread_warp_size": 32, "registers_per_block": 65536})
    flops = 2 * M * N * K
    dev = tvm.cuda(0)
    rng = np.random.default_rng(0)
    a_np = (rng.standard_normal((M, K)) * 0.1).astype("float16")
    b_np = (rng.standard_normal((N, K)) * 0.1).astype("float16")
    if a.kernel == "q4f16_1":
        from mlcc.compiler.quantize import get_quantization, group_dequantize, group_quantize

        q = get_quantization("q4f16_1")
        packed, scales = group_quantize(b_np.astype("float32"), q)
        b_np = group_dequantize(packed, scales, q).astype("float16")  # what cuBLAS multiplies
    ta, tb = torch.tensor(a_np, device="cuda"), torch.tensor(b_np, device="cuda")
    ref = (ta @ tb.T).float().cpu().numpy()
    for _ in range(3):
        ta @ tb.T
    torch.cuda.synchronize()
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    for _ in range(50):
        ta @ tb.T
    ev1.record()
    torch.cuda.synchronize()
    cublas_s = ev0.elapsed_time(ev1) / 50 / 1e3
    inputs = [a_np, b_np] if a.kernel == "fp16" else [a_np, packed, scales]
    args = [tvm.runtime.tensor(x, dev) for x in inputs] + [tvm.runtime.empty((M, N), "float16", dev)]
    rows = {"cublas": {"seconds": cublas_s}}
    mod_of = gemm_mod if a.kernel == "fp16" else q4_gemm_mod

    def check_and_time(name: str, lib) -> None:
        lib(*args)
        err = float(np.abs(args[-1].numpy().astype("float32") - ref).max() / np.abs(ref).max())
        rows[name] = {"seconds": time_tvm(lib, dev, args), "max_rel_err_vs_torch": err}

    with target:
        dl = dlight.ApplyDefaultSchedule(dlight.gpu.Matmul(), dlight.gpu.Fallback())(mod_of(M, N, K))
    check_and_time("dlight_default", tvm.tirx.build(dl, target=target))
    if a.trials > 0:
        with tempfile.TemporaryDirectory() as wd:
            t = time.time()
            db = ms.tune_tir(mod_of(M, N, K), target, wd, max_trials_global=a.trials, num_trials_per_iter=16,
                             cost_model=a.cost_model)
            tune_s = time.time() - t
            sch = ms.tir_integration.compile_tir(db, mod_of(M, N, K), target)
            check_and_time("metaschedule_tuned", tvm.tirx.build(sch.mod, target=target))
            rows["metaschedule_tuned"].update({"trials": a.trials, "tune_seconds": tune_s,
                                               "cost_model": a.cost_model})
    for r in rows.values():
        r["tflops"] = flops / r["seconds"] / 1e12
        r["vs_cublas"] = cublas_s / r["seconds"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = a.cost_model if a.trials > 0 else "default"
    (out / f"gemm_tune_cuda_{a.kernel}_{M}x{N}x{K}_{tag}.json").write_text(
        json.dumps({"shape": [M, N, K], "kernel": a.kernel, **rows}, indent=1))
    print(f"{a.kernel} GEMM {M}x{N}x{K} on {dev.device_name}")
    print(f"{'kernel':20s} {'TFLOP/s':>8s} {'vs cuBLAS':>9s} {'rel err':>8s}")
    for name, r in rows.items():
        print(f"{name:20s} {r['tflops']:8.1f} {r['vs_cublas']:9.2f} {r.get('max_rel_err_vs_torch', 0):8.1e}")


if __name__ == "__main__":
    main()

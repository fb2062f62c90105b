"""Prefill GEMMs on CUDA: mlcc's tensor-core kernel (schedules/cuda_gemm.py) against cuBLAS fp16 through torch, on
an 8B model's projection shapes, fp16 and q4f16_1 weights (q4 rows: cuBLAS on the dequantized fp16 weights).

Two steps: `build` compiles every candidate parameter set here (nvcc, sm_90a cubin, no GPU needed); `run` on the
GPU machine (torch + cupy) checks each kernel and epilogue against torch first, then times them and prints a table:

    python bench/gemm.py build --out .dev/gemm
    run(command="python3 bench/gemm.py run --lib .dev/gemm --out $OUT", carry=[".dev/gemm"])

Rows of $OUT/gemm.json: {"bench": "gemm", "dtype", "M", "N", "K", "params", "tflops", "cublas_tflops",
"ratio_vs_cublas", "default_tflops"} (tflops: the best candidate; default_tflops: the untuned table's choice).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

# (name, N = W's rows, K) of Llama-3-8B's projections
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
TOKENS = [512, 2048, 8192]
FEW_TOKENS = [1, 5, 16, 64]   # batched decode and speculative verify: the split-K kernel (few_token_params)
# (bm, bn, wm, wn, stages, bk): GemmParams' fields; shared memory is dynamic (227 KB a block on sm_90)
CANDIDATES = [(128, 128, 2, 4, 3, 32), (128, 128, 2, 4, 5, 32), (128, 128, 2, 4, 3, 64), (128, 128, 2, 4, 4, 64),
              (128, 256, 2, 4, 4, 32), (128, 256, 2, 4, 3, 64), (128, 256, 2, 4, 4, 64), (256, 128, 4, 2, 3, 64),
              (256, 128, 4, 2, 4, 64), (128, 256, 2, 4, 5, 32), (128, 128, 2, 4, 6, 32), (64, 128, 2, 2, 4, 64),
              (128, 64, 2, 2, 4, 64), (64, 128, 2, 2, 4, 32)]
CHECKS = [("float16", "none"), ("float16", "bias"), ("float16", "add"), ("float16", "swiglu"),
          ("q4f16_1", "none"), ("q4f16_1", "bias"), ("q4f16_1", "add"), ("q4f16_1", "swiglu")]


def cmd_build(a) -> None:
    from mlcc.schedules.cuda_gemm import (
        GemmParams,
        default_params,
        few_token_params,
        kernel_name,
        kernel_source,
        reduce_source,
    )

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    kernels, src = [], None
    for w in ("float16", "q4f16_1"):
        params = {GemmParams(*c) for c in CANDIDATES} | {default_params(w), default_params(w, 64)}
        for p in sorted((p for p in params if p.valid(w == "q4f16_1")), key=lambda p: tuple(p.to_dict().values())):
            for epi in ("none", "bias", "add", "swiglu") if p in (default_params(w),) else ("none",):
                kernels.append({"name": kernel_name(w, epi, p), "weights": w, "epilogue": epi, "params": p.to_dict(),
                                "threads": p.threads, "smem": p.smem_bytes(w == "q4f16_1"),
                                "default": p == default_params(w)})
                src = (src or "") + kernel_source(w, epi, p, with_header=src is None)
    few = {few_token_params(n, k, w) for w in ("float16", "q4f16_1") for _, n, k in SHAPES}
    for w in ("float16", "q4f16_1"):
        for p in sorted({f for f in few}, key=lambda p: p.split):
            for epi in ("none", "bias", "add"):
                kernels.append({"name": kernel_name(w, epi, p), "weights": w, "epilogue": epi, "params": p.to_dict(),
                                "threads": p.threads, "smem": p.smem_bytes(w == "q4f16_1"), "default": False,
                                "few": True, "reduce": f"mlcc_reduce_k{p.split}_{epi}"})
                src += kernel_source(w, epi, p, with_header=False)
    for p in sorted(few, key=lambda p: p.split):
        for epi in ("none", "bias", "add"):
            src += reduce_source(epi, p)
    (out / "gemm.cu").write_text(src)
    t = time.time()
    subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-O3", "-o", str(out / "gemm.cubin"), str(out / "gemm.cu")],
                   check=True)
    (out / "kernels.json").write_text(json.dumps(kernels, indent=1))
    print(f"{len(kernels)} kernels, nvcc {time.time() - t:.1f} s -> {out}")


def _dequant(torch, wq, s):
    """q4f16_1 [N, K/8] uint32 (as int32) + [N, K/32] fp16 scales -> [N, K] fp16."""
    n = wq.shape[0]
    shifts = torch.arange(0, 32, 4, device=wq.device, dtype=torch.int32)
    codes = (wq.unsqueeze(-1) >> shifts) & 0xF  # [N, K/8, 8]
    vals = (codes.reshape(n, -1).to(torch.float16) - 7).reshape(n, -1, 32) * s.unsqueeze(-1)
    return vals.reshape(n, -1)


def cmd_run(a) -> None:
    import cupy
    import torch

    lib = Path(a.lib)
    kernels = json.loads((lib / "kernels.json").read_text())
    mod = cupy.RawModule(path=str(lib / "gemm.cubin"))
    fns = {k["name"]: mod.get_function(k["name"]) for k in kernels}
    for k in kernels:  # past 48 KB a kernel must opt in to its dynamic shared memory
        fns[k["name"]].max_dynamic_shared_size_bytes = k["smem"]
    torch.manual_seed(0)
    dev = "cuda"

    def weights(n, k, kind):
        if kind == "float16":
            w = (torch.randn(n, k, device=dev) * 0.02).half()
            return w, None, w
        wq = torch.randint(-2**31, 2**31 - 1, (n, k // 8), device=dev, dtype=torch.int32)
        s = (torch.rand(n, k // 32, device=dev) * 0.01 + 0.001).half()
        return wq, s, _dequant(torch, wq, s)

    for k in kernels:
        if k.get("few"):
            fns[k["reduce"]] = mod.get_function(k["reduce"])
    parts = {}

    def launch(kern, x, w, s, e, c, m, n, k):
        p = kern["params"]
        args = [cupy.asarray(t) if t is not None else cupy.asarray(x) for t in (x, w, s, e)]
        if not kern.get("few"):
            grid = (n // p["bn"], -(-m // p["bm"]))
            fns[kern["name"]](grid, (kern["threads"],), (*args, cupy.asarray(c), cupy.int32(m), cupy.int32(n),
                                                           cupy.int32(k)), shared_mem=kern["smem"])
            return
        size = p["split"] * m * n
        if parts.get(size) is None:
            parts[size] = cupy.empty(size, dtype=cupy.float32)
        part = parts[size]
        grid = (n // p["bn"], -(-m // p["bm"]), p["split"])
        fns[kern["name"]](grid, (kern["threads"],), (*args, cupy.asarray(c), cupy.int32(m), cupy.int32(n),
                                                       cupy.int32(k), part), shared_mem=kern["smem"])
        fns[kern["reduce"]]((-(-(m * n // 2) // 256),), (256,), (part, args[3], cupy.asarray(c), cupy.int32(m),
                                                                 cupy.int32(n)))

    def bench(fn, flops, iters=20):
        for _ in range(3):
            fn()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(iters):
            fn()
        t1.record()
        torch.cuda.synchronize()
        return flops / (t0.elapsed_time(t1) / iters * 1e-3) / 1e12

    # correctness first: every epilogue of the default kernels, an M that is no multiple of the tile
    checks, ok = [], True
    for kern in kernels:
        m, n, k = (37, 512, 14336) if kern.get("few") else (200, 512, 1024)
        w, s, wf = weights(n, k, kern["weights"])
        x = torch.randn(m, k, device=dev).half()
        y = x.float() @ wf.float().T
        e = None
        epi = kern["epilogue"]
        if epi == "bias":
            e = torch.randn(n, device=dev).half()
            ref = y + e.float()
        elif epi == "add":
            e = torch.randn(m, n, device=dev).half()
            ref = y + e.float()
        elif epi == "swiglu":
            g, u = y[:, : n // 2].half().float(), y[:, n // 2:].half().float()
            ref = torch.nn.functional.silu(g) * u
        else:
            ref = y
        c = torch.empty(ref.shape, device=dev, dtype=torch.float16)
        launch(kern, x, w, s, e, c, m, n, k)
        torch.cuda.synchronize()
        err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
        good = err < 2e-2 and bool(torch.isfinite(c).all())
        ok &= good
        checks.append({"kernel": kern["name"], "max_rel_err": err, "ok": good})
        print(f"check {kern['name']:55s} max|err|/max|ref| {err:.2e} {'ok' if good else 'FAIL'}", flush=True)
    rows = []
    if ok:
        for kind in ("float16", "q4f16_1"):
            for name, n, k in SHAPES:
                w, s, wf = weights(n, k, kind)
                for m in TOKENS:
                    x = torch.randn(m, k, device=dev).half()
                    c = torch.empty(m, n, device=dev, dtype=torch.float16)
                    flops = 2 * m * n * k
                    cublas = bench(lambda: torch.matmul(x, wf.T), flops)
                    res = {}
                    for kern in kernels:
                        if kern["weights"] != kind or kern["epilogue"] != "none" or n % kern["params"]["bn"] \
                                or kern.get("few"):
                            continue
                        res[kern["name"]] = (bench(lambda: launch(kern, x, w, s, None, c, m, n, k), flops), kern)
                    best, bk = max(res.values(), key=lambda r: r[0])
                    dflt = next(t for t, kk in res.values() if kk["default"])
                    rows.append({"bench": "gemm", "dtype": kind, "proj": name, "M": m, "N": n, "K": k,
                                 "params": bk["params"], "tflops": round(best, 1), "default_tflops": round(dflt, 1),
                                 "cublas_tflops": round(cublas, 1), "ratio_vs_cublas": round(best / cublas, 3),
                                 "all": {kk: round(t, 1) for kk, (t, _) in res.items()}})
                    print(f"{kind:8s} {name:8s} M={m:5d} N={n:6d} K={k:6d}  best {best:6.1f} "
                          f"({' '.join(str(v) for v in bk['params'].values())}) default {dflt:6.1f}  "
                          f"cuBLAS {cublas:6.1f}  ratio {best / cublas:.3f}", flush=True)
    few_rows = []
    if ok:  # few tokens: the split-K kernel the build picks for the shape, against cuBLAS and the weights' bytes
        from mlcc.schedules.cuda_gemm import few_token_params, kernel_name

        for kind in ("float16", "q4f16_1"):
            for name, n, k in SHAPES:
                w, s, wf = weights(n, k, kind)
                p = few_token_params(n, k, kind)
                kern = next(kk for kk in kernels if kk["name"] == kernel_name(kind, "none", p))
                wbytes = n * k * 2 if kind == "float16" else n * k // 2 + n * k // 32 * 2
                for m in FEW_TOKENS:
                    x = torch.randn(m, k, device=dev).half()
                    c = torch.empty(m, n, device=dev, dtype=torch.float16)
                    us = 1e6 * 2 * m * n * k / 1e12 / bench(lambda: launch(kern, x, w, s, None, c, m, n, k),
                                                           2 * m * n * k, iters=50)
                    cub = 1e6 * 2 * m * n * k / 1e12 / bench(lambda: torch.matmul(x, wf.T), 2 * m * n * k, iters=50)
                    few_rows.append({"bench": "gemm_few_tokens", "dtype": kind, "proj": name, "M": m, "N": n, "K": k,
                                     "split": p.split, "us": round(us, 2), "cublas_fp16_us": round(cub, 2),
                                     "weight_GBps": round(wbytes / us / 1e3, 1)})
                    print(json.dumps(few_rows[-1]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "checks": checks,
                                               "rows": rows, "few_tokens": few_rows}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", default=".dev/gemm")
    r = sub.add_parser("run")
    r.add_argument("--lib", default=".dev/gemm")
    r.add_argument("--out", default="/tmp/out")
    a = p.parse_args()
    {"build": cmd_build, "run": cmd_run}[a.cmd](a)


if __name__ == "__main__":
    main()

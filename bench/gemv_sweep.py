"""Launch-configuration sweep of the hand-written q4f16_1 decode GEMV (schedules/cuda_q4_gemv.py) on the 8B shapes:
threads per row (lanes), rows per thread, row warps per block, warps splitting K, iterations preloaded before the
PDL wait. Every kernel is checked against numpy before it is timed; the current launch_config is marked.

    python bench/gemv_sweep.py build --out .dev/sweep      # here
    python3 bench/gemv_sweep.py run --libs .dev/sweep --out $OUT
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np

from cli import build_and_run
from gemv_kernels import SHAPES, _inputs, _reference

SWEPT = ("qkv", "o", "gate_up", "down")


def configs(n: int, k: int):
    groups = k // 32
    for lanes, rows, row_warps, ksplit, pre in itertools.product((32,), (1, 2, 4, 8), (1, 2, 4), (1, 2, 4, 8),
                                                                 (1, 2, 4)):
        iters = -(-groups // (lanes * ksplit))
        warps = row_warps * ksplit
        if warps > 16 or lanes * ksplit > groups or (pre > 1 and pre > iters) or pre * rows > 16:
            continue
        yield lanes, rows, row_warps, ksplit, pre


def cmd_build(a) -> None:
    import tvm

    from mlcc.schedules.cuda_pdl import tir_pipeline_for
    from mlcc.schedules.cuda_q4_gemv import GemvShape, launch_config, make_q4_gemv
    from mlcc.targets import get_target
    from mlcc.targets.toolchains import toolchain_for

    target = get_target("cuda").tvm_target()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {}
    for name in SWEPT:
        n, k = SHAPES[name]
        funcs, entries = {}, []
        for cfg in configs(n, k):
            fname = f"{name}__" + "_".join(map(str, cfg))
            funcs[fname] = make_q4_gemv(GemvShape(n, k, "none"), pdl=True, config=cfg[:4], preload=cfg[4]) \
                .with_attr("global_symbol", fname)
            entries.append({"func": fname, "config": cfg, "current": cfg[:4] == launch_config(n, k) and cfg[4] == 1})
        with target, toolchain_for("cuda"):
            tvm.compile(tvm.IRModule(funcs), target, tir_pipeline=tir_pipeline_for(target)) \
                .export_library(str(out / f"{name}.so"))
        meta[name] = {"bytes": n * k // 2 + n * k // 32 * 2 + k * 2 + n * 2,
                      "args": [[[1, 1, k], "float16"], [[n, k // 8], "uint32"], [[n, k // 32], "float16"],
                               [[1, 1, n], "float16"]], "kernels": entries}
        print("built", name, len(entries), flush=True)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


def cmd_run(a) -> None:
    import tvm

    from mlcc.runtime.model import _load_backend_runtimes, _register_cuda_jit

    _load_backend_runtimes("cuda")
    _register_cuda_jit("sm_90a")
    dev = tvm.cuda(0)
    meta = json.loads((Path(a.libs) / "meta.json").read_text())
    rows = []
    for name, spec in meta.items():
        m = tvm.runtime.load_module(str(Path(a.libs) / f"{name}.so"))
        host = _inputs(spec["args"], "q4f16_1")
        want = _reference(host, "q4f16_1")
        args = [tvm.runtime.tensor(h, dev) for h in host]
        best = None
        for e in spec["kernels"]:
            args[-1] = tvm.runtime.tensor(np.zeros(spec["args"][-1][0], "float16"), dev)
            m[e["func"]](*args)
            got = args[-1].numpy().astype(np.float32).reshape(-1)
            rel = float(np.abs(got - want).max() / np.abs(want).max())
            t = m.time_evaluator(e["func"], dev, number=100, repeat=3, min_repeat_ms=30)(*args).mean
            r = {"kernel": name, "config": e["config"], "current": e["current"], "us": t * 1e6,
                 "GB_s": spec["bytes"] / t / 1e9, "max_rel_err": rel, "check_ok": rel < 2e-2}
            rows.append(r)
            if r["check_ok"] and (best is None or r["us"] < best["us"]):
                best = r
        cur = next(r for r in rows if r["kernel"] == name and r["current"])
        print(f"{name:8} current {cur['config']} {cur['us']:6.2f} us {cur['GB_s']:6.0f} GB/s | best {best['config']} "
              f"{best['us']:6.2f} us {best['GB_s']:6.0f} GB/s", flush=True)
        for r in sorted((r for r in rows if r["kernel"] == name), key=lambda r: r["us"])[:5]:
            print(f"    {r['config']} {r['us']:6.2f} us {r['GB_s']:6.0f} GB/s {'ok' if r['check_ok'] else 'WRONG'}")
    bad = [r for r in rows if not r["check_ok"]]
    print(f"{len(rows)} kernels timed, {len(bad)} wrong", flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gemv_sweep.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    build_and_run(cmd_build, cmd_run)

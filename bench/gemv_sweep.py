"""Launch-configuration sweep of the hand-written decode GEMVs (schedules/cuda_gemv.py) on the 8B shapes: threads per
row (lanes), rows per thread, row warps per block, warps splitting K, iterations preloaded before the PDL wait, for
q4f16_1 or float16 weights; float16 also times dlight's GEMV (what q0f16 builds used before, config "dlight").
Every kernel is checked against numpy before it is timed; the current launch_config is marked.

    python bench/gemv_sweep.py build --out .dev/sweep [--weights float16]     # here
    python3 bench/gemv_sweep.py run --libs .dev/sweep --out $OUT

Timing: the kernel is called in turn on enough copies of the weights (>= 320 MB) that none is still in the H200's
50 MB L2 when its turn comes back, as in a model step; session 5's sweep timed one copy over and over, which let the
q4 projections (8-60 MB) run partly out of L2 and is why its winners did not carry into the model. The calls are
queued from Python (~3 us each), so kernels shorter than that (q4 o_proj) are launch-bound there; `run --graph`
replays them from a CUDA graph instead (not yet run on the GPU: compare with us_queued on the long kernels).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np

from cli import build_and_run
from gemv_kernels import (L2_DEFEAT_BYTES, SHAPES, _inputs, _reference, cuda_device, kernels, time_graph,
                          time_rotating)

SWEPT = ("qkv", "o", "gate_up", "down")


def configs(n: int, units: int):
    for lanes, rows, row_warps, ksplit, pre in itertools.product((32,), (1, 2, 4, 8), (1, 2, 4), (1, 2, 4, 8),
                                                                 (1, 2, 4)):
        iters = -(-units // (lanes * ksplit))
        warps = row_warps * ksplit
        if warps > 16 or lanes * ksplit > units or (pre > 1 and pre > iters) or pre * rows > 16:
            continue
        yield lanes, rows, row_warps, ksplit, pre


def grid_configs(n: int, units: int):
    """The current launch configuration with bigger blocks (row warps x1, x2, x4) and the grid capped at a few
    multiples of the H200's 132 SMs (each block then loops over row blocks): the empty-kernel floor (session 11,
    kernel_floor.py) grows with the number of blocks, ~0.7 us at 132 blocks to 1.8 us at 1056 and 5.6 us at 4224
    with PDL, and the current rule launches 1000-1800 blocks per 8B projection."""
    from mlcc.schedules.cuda_gemv import launch_config

    lanes, rows, row_warps, ksplit = launch_config(n, units)
    for mult, cap in itertools.product((1, 2, 4), (None, 132, 264, 396, 528, 792, 1056)):
        if row_warps * mult * ksplit <= 16:
            yield lanes, rows, row_warps * mult, ksplit, 1, cap


def contiguous_configs(n: int, units: int):
    """As grid_configs (row warps x1, x2; caps 132-528), each block's row blocks interleaved (bx, bx + grid, ...)
    and contiguous (one run of consecutive row blocks): session 12's stream probe streamed ~4.0 TB/s from
    contiguous runs per block and ~2.9 from interleaved ones."""
    from mlcc.schedules.cuda_gemv import launch_config

    lanes, rows, row_warps, ksplit = launch_config(n, units)
    yield lanes, rows, row_warps, ksplit, 1, None, False
    for mult, cap, contiguous in itertools.product((1, 2), (132, 264, 396, 528), (False, True)):
        if row_warps * mult * ksplit <= 16:
            yield lanes, rows, row_warps * mult, ksplit, 1, cap, contiguous


def tc_configs(n: int, k: int):
    """(row warps, warps splitting K, steps preloaded, variant) for the tensor-core q4 kernel (cuda_gemv_tc)."""
    chunks = -(-(k // 32) // 4)
    for row_warps, ksplit, pre in itertools.product((1, 2, 4), (1, 2, 4, 8), (1, 2, 4)):
        iters = -(-chunks // ksplit)
        if row_warps * ksplit > 16 or ksplit > chunks or pre > iters or row_warps * ksplit < 2:
            continue
        yield row_warps, ksplit, pre, "sub"


def _quant(weights: str) -> str:
    return "q4f16_1" if weights == "q4f16_1" else "q0f16"


def cmd_build(a) -> None:
    import tvm
    from tvm.s_tir import dlight as dl

    from mlcc.schedules.cuda_gemv import GemvShape, launch_config, make_gemv
    from mlcc.schedules.cuda_pdl import tir_pipeline_for
    from mlcc.targets import get_target
    from mlcc.targets.toolchains import toolchain_for

    target = get_target("cuda").tvm_target()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    quant = _quant(a.weights)
    # dlight's baseline only for float16 (the q4 kernels have no other schedule worth timing)
    default_funcs = {name: f for name, f, _ in kernels(quant)} if a.weights == "float16" else {}
    meta = {"weights": a.weights}
    for name in SWEPT:
        n, k = SHAPES[name]
        shape = GemvShape(n, k, "none", weights=a.weights)
        funcs, entries = {}, []
        if a.tc:
            # the tensor-core kernel's configurations next to the CUDA-core kernel as the model builds it now
            from mlcc.schedules.cuda_gemv_tc import make_gemv_tc, tc_launch_config

            cur = launch_config(n, k // shape.unit)
            funcs[f"{name}__cur"] = make_gemv(shape, pdl=True).with_attr("global_symbol", f"{name}__cur")
            entries.append({"func": f"{name}__cur", "config": ["cuda-core", *cur, 1], "current": True})
            default = tc_launch_config(-(-n // 16), -(-(k // 32) // 4))
            cfgs = list(tc_configs(n, k)) + [(*default, 1, "bias"), (*default, 2, "bias")]
            for cfg in cfgs:
                fname = f"{name}__tc_" + "_".join(map(str, cfg))
                funcs[fname] = make_gemv_tc(shape, pdl=True, config=cfg[:2], preload=cfg[2], variant=cfg[3]) \
                    .with_attr("global_symbol", fname)
                entries.append({"func": fname, "config": ["tc", *cfg], "current": False,
                                "tc_default": cfg[:2] == default})
        swept = ([] if a.tc else contiguous_configs(n, k // shape.unit) if a.contiguous
                 else grid_configs(n, k // shape.unit) if a.grid else configs(n, k // shape.unit))
        for cfg in swept:
            fname = f"{name}__" + "_".join(map(str, cfg))
            cap = cfg[5] if len(cfg) > 5 else None
            funcs[fname] = make_gemv(shape, pdl=True, config=cfg[:4], preload=cfg[4], max_blocks=cap,
                                     contiguous=len(cfg) > 6 and cfg[6]).with_attr("global_symbol", fname)
            entries.append({"func": fname, "config": cfg, "current": cfg[:4] == launch_config(
                n, k // shape.unit, weights=a.weights) and cfg[4] == 1 and cap is None})
        if a.weights == "float16":
            # dlight's GEMV as q0f16 builds scheduled it before the hand kernel (PDL wait at its start, cuda_pdl)
            with target:
                dmod = dl.ApplyDefaultSchedule(dl.gpu.GEMV(), dl.gpu.Fallback())(
                    tvm.IRModule({"d": default_funcs[name]}))
            funcs[f"{name}__dlight"] = dmod["d"].with_attr("global_symbol", f"{name}__dlight")
            entries.append({"func": f"{name}__dlight", "config": "dlight", "current": False})
        with target, toolchain_for("cuda"):
            tvm.compile(tvm.IRModule(funcs), target, tir_pipeline=tir_pipeline_for(target)) \
                .export_library(str(out / f"{name}.so"))
        wbytes = n * k // 2 + n * k // 32 * 2 if a.weights == "q4f16_1" else n * k * 2
        args = ([[[1, 1, k], "float16"], [[n, k // 8], "uint32"], [[n, k // 32], "float16"]]
                if a.weights == "q4f16_1" else [[[1, 1, k], "float16"], [[n, k], "float16"]])
        meta[name] = {"bytes": wbytes + k * 2 + n * 2, "weight_bytes": wbytes, "args": args + [[[1, 1, n], "float16"]],
                      "kernels": entries}
        print("built", name, len(entries), flush=True)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


def cmd_run(a) -> None:
    import tvm

    dev = cuda_device()
    meta = json.loads((Path(a.libs) / "meta.json").read_text())
    quant = _quant(meta.pop("weights"))
    rows = []
    for name, spec in meta.items():
        m = tvm.runtime.load_module(str(Path(a.libs) / f"{name}.so"))
        host = _inputs(spec["args"], quant)
        want = _reference(host, quant)
        x = tvm.runtime.tensor(host[0], dev)
        copies = max(2, -(-L2_DEFEAT_BYTES // spec["weight_bytes"]))
        weight_sets = [[tvm.runtime.tensor(h, dev) for h in host[1:-1]] for _ in range(copies)]
        best = None
        for e in spec["kernels"]:
            out = tvm.runtime.tensor(np.zeros(spec["args"][-1][0], "float16"), dev)
            f = m[e["func"]]
            f(x, *weight_sets[0], out)
            got = out.numpy().astype(np.float32).reshape(-1)
            rel = float(np.abs(got - want).max() / np.abs(want).max())
            queued = min(time_rotating(f, x, weight_sets, out, dev) for _ in range(3))
            t = min(time_graph(f, x, weight_sets, out, dev) for _ in range(3)) if a.graph else queued
            r = {"kernel": name, "config": e["config"], "current": e["current"], "us": t * 1e6,
                 "us_queued": queued * 1e6, "GB_s": spec["bytes"] / t / 1e9, "max_rel_err": rel,
                 "check_ok": rel < 2e-2}
            rows.append(r)
            if r["check_ok"] and (best is None or r["us"] < best["us"]):
                best = r
        cur = next(r for r in rows if r["kernel"] == name and r["current"])
        base = next((r for r in rows if r["kernel"] == name and r["config"] == "dlight"), None)
        print(f"{name:8} current {cur['config']} {cur['us']:6.2f} us {cur['GB_s']:6.0f} GB/s | best {best['config']} "
              f"{best['us']:6.2f} us {best['GB_s']:6.0f} GB/s"
              + (f" | dlight {base['us']:6.2f} us {base['GB_s']:6.0f} GB/s" if base else "")
              + f" ({copies} weight copies)", flush=True)
        for r in sorted((r for r in rows if r["kernel"] == name), key=lambda r: r["us"])[:5]:
            print(f"    {r['config']} {r['us']:6.2f} us {r['GB_s']:6.0f} GB/s {'ok' if r['check_ok'] else 'WRONG'}")
    bad = [r for r in rows if not r["check_ok"]]
    print(f"{len(rows)} kernels timed, {len(bad)} wrong", flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    tag = "_tc" if any(r["config"][0] == "tc" for r in rows if isinstance(r["config"], list)) else \
        "_contiguous" if any(isinstance(r["config"], list) and len(r["config"]) > 6 for r in rows) else \
        "_grid" if any(isinstance(r["config"], list) and len(r["config"]) > 5 for r in rows) else ""
    (Path(a.out) / f"gemv_sweep_{quant}{tag}.json").write_text(json.dumps(rows, indent=1))


def _configure(b, r) -> None:
    b.add_argument("--weights", choices=("q4f16_1", "float16"), default="q4f16_1")
    b.add_argument("--tc", action="store_true", help="q4f16_1: the tensor-core kernel's configurations (cuda_gemv_tc)")
    b.add_argument("--grid", action="store_true", help="the current configuration with bigger blocks and capped grids")
    b.add_argument("--contiguous", action="store_true",
                   help="capped grids with each block's row blocks interleaved or contiguous")
    r.add_argument("--graph", action="store_true",
                   help="time from a CUDA graph of the calls (gemv_kernels.time_graph); us_queued keeps the other")


if __name__ == "__main__":
    build_and_run(cmd_build, cmd_run, configure=_configure)

"""The per-kernel floor of a decode step on the GPU: kernels that do nothing, back to back in one CUDA graph, with
and without programmatic dependent launch (issue 4: an 8B q4f16_1 step is ~260 kernels against a 1.0 ms roofline,
and session 10 found the q4 projections limited by time per kernel rather than by instructions; this measures the
part of that no kernel body can remove).

    python bench/kernel_floor.py build --out .dev/floor          # here
    python3 bench/kernel_floor.py run --libs .dev/floor --out $OUT   # device (carry .gpu-rt and the folder)

Each kernel: `blocks` x 128 threads; thread 0 of block 0 adds 1 to a counter (so the launches are not empty work the
driver could skip), read back to check that every launch ran. Built with the PDL pipeline (cuda_pdl: wait +
launch_dependents first, PDL launch attribute) and without.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from cli import build_and_run
from gemv_kernels import cuda_device, time_graph

BLOCKS = (1, 132, 1056, 4224)


def _kernel(blocks: int):
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def f(out: T.Buffer((1,), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for bx in T.thread_binding(blocks, thread="blockIdx.x"):
            for tx in T.thread_binding(128, thread="threadIdx.x"):
                with T.sblock("count"):
                    T.reads()
                    T.writes()
                    if bx == 0 and tx == 0:
                        out[0] = out[0] + T.float32(1)

    return f


def cmd_build(a) -> None:
    import tvm

    from mlcc.schedules.cuda_pdl import tir_pipeline_for
    from mlcc.targets import get_target
    from mlcc.targets.toolchains import toolchain_for

    target = get_target("cuda").tvm_target()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    funcs = {f"empty_{b}": _kernel(b).with_attr("global_symbol", f"empty_{b}") for b in BLOCKS}
    with target, toolchain_for("cuda"):
        for name, pipeline in (("pdl", tir_pipeline_for(target)), ("plain", "default")):
            ex = tvm.compile(tvm.IRModule(funcs), target, tir_pipeline=pipeline)
            (cuda,) = [m for m in ex.mod.imports if m.kind == "cuda"]
            waits = cuda.inspect_source().count("mlcc_pdl_wait();")
            assert waits == (len(funcs) if name == "pdl" else 0), (name, waits)
            ex.export_library(str(out / f"{name}.so"))
    print("built", sorted(funcs))


def cmd_run(a) -> None:
    import tvm

    dev = cuda_device()
    rows = []
    calls = 600
    for lib in ("plain", "pdl"):
        m = tvm.runtime.load_module(str(Path(a.libs) / f"{lib}.so"))
        for b in BLOCKS:
            f = m[f"empty_{b}"]
            out = tvm.runtime.tensor(np.zeros(1, "float32"), dev)
            t = min(time_graph(lambda _x, o: f(o), None, [[]], out, dev, calls=calls) for _ in range(3))
            # each time_graph call runs f once outside the capture, then replays the captured calls twice
            ran, want = float(out.numpy()[0]), 3 * (1 + 2 * calls)
            rows.append({"launch": lib, "blocks": b, "us_per_kernel": t * 1e6, "every_launch_ran": ran == want})
            print(f"{lib:5} {b:5} blocks  {t * 1e6:6.2f} us per kernel  ({'every launch ran' if ran == want else f'counter {ran:.0f} != {want}: WRONG'})",
                  flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "kernel_floor.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    build_and_run(cmd_build, cmd_run)

"""A/B of batch-1 decode between builds of one shape, in one process, interleaved to cancel drift (the step time
moves ±4% between device calls, more than one kernel change is worth).

    python bench/ab_decode.py build --out .dev/ab --model llama3-8b-q4f16_1   # here: one library per variant
    python3 bench/ab_decode.py run --libs .dev/ab --out $OUT                  # device

Variants: a folder of --libs per variant (any name: a library built elsewhere can be copied in to compare; runtime
variants without a folder load base's library). To compare against another commit, build from a worktree of it:
`git worktree add /tmp/wt REV && ln -sfn /tmp/wt /tmp/mlccrev/mlcc && PYTHONPATH=/tmp/mlccrev python ab_decode.py build
...` (PYTHONPATH wins over the editable install), then rename its `base` folder (session 7: bench/issue4_s7_h200.sh). "base" = the default build (batch-1 decode through decode_graph,
one CUDA graph per step), timed with the engine's pipelined loop (runtime.decode_pipeline); "sync" = the same
library timed with the synchronous loop (decode, argmax, read the id, repeat; every variant before session 8);
"no-tail" = base's library, pipelined with the next step's KV metadata queued only after the previous step's end
instead of its last attention (MLCC_STEP_TAIL=0, runtime.model); "two-shift" = a build whose q4 GEMVs unpack with
three shifts per word instead of one (MLCC_Q4_ONE_SHIFT=0, schedules/cuda_gemv.py) — session 9 measured the other
way round, as "tail" and "one-shift" against a base without them (bench/issue4_s9_h200.sh at 6859041); "no-graph" = the same library with plain decode
(MLCC_DECODE_GRAPH=0 at load: every kernel launched by the VM); "no-pdl" = a build without programmatic dependent launch (MLCC_CUDA_PDL=0);
"cuda-core" = a build whose q4 GEMVs all use the CUDA-core kernel (MLCC_Q4_KERNEL=cuda-core, the default
again after session 10, whose base built with MLCC_Q4_KERNEL=auto: the tensor-core kernel of schedules/cuda_gemv_tc.py
for the short projections); "tc-auto" = such a build; "splits16" = a build whose split-KV decode attention cuts every context into 16 chunks whatever the number of KV
heads (session 4's choice; MLCC_DECODE_SPLITS=16); session 13's "add-cap" (o/down q4 GEMVs on grids capped at 528
blocks, each a contiguous run of row blocks, MLCC_GEMV_ADD_CAP=528) was working-tree code, measured and dropped
(bench/results/gemv_add_cap_rejected_s13.diff);
"attn-s5": session 5's decode attention (4 tokens per step). Session 11's "bignorm" and "sweep11" (q4 kernels
with an RMSNorm prologue given 4x the row warps per block; that plus the swept o/down configurations) were
working-tree code, measured and dropped (bench/results README, session 11). Session 6's cross-kernel L2 prefetch variants
("no-prefetch", "pf12", "pf40", "pf-end", "pf-all") and "attn-128" (now the default) were built from commit 45fdaf2,
where schedules/cuda_l2_prefetch.py still existed; bench/results README says what each was.
`--fixed-context`: every round starts a new sequence from the same 128-token prompt, so rounds differ only in time
(clocks, temperature), not in context length.
Session 5's "gemv-s4" and "no-fold" variants (session 4's GEMV rule against the swept configurations; the
RMSNorm/SwiGLU fold for small inputs) were built from working-tree code that was measured, rejected and never
committed; the results README says what it was. Each is checked (argmax; decode_graph against decode; logits
against the CPU build where bench/decode.py has a reference for the shape) before it is timed.
(Session 4's "graphs"/"no-graph" builds compared TVM's partial graphs, between attention calls, with none.)
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
from pathlib import Path
from unittest import mock

from cli import build_and_run
from decode import (MODELS, check_against_reference, check_argmax, check_graph_decode, check_pipelined_decode,
                    decode_steps)

VARIANTS = ("base", "sync", "no-tail", "two-shift", "cuda-core", "tc-auto", "no-graph", "no-pdl", "splits16", "attn-s5")
BUILT = ("base", "two-shift", "cuda-core", "tc-auto", "no-pdl", "splits16", "attn-s5")   # the others load base's library
ENV = {"cuda-core": {"MLCC_Q4_KERNEL": "cuda-core"}, "tc-auto": {"MLCC_Q4_KERNEL": "auto"}, "no-tail": {"MLCC_STEP_TAIL": "0"}, "two-shift": {"MLCC_Q4_ONE_SHIFT": "0"}, "no-pdl": {"MLCC_CUDA_PDL": "0"},
       "no-graph": {"MLCC_DECODE_GRAPH": "0"}, "splits16": {"MLCC_DECODE_SPLITS": "16"}, "attn-s5": {"MLCC_DECODE_TOKENS": "4"}}


@contextlib.contextmanager
def _variant(name: str):
    with mock.patch.dict(os.environ, ENV.get(name, {})):
        yield


def _order(variant: str) -> int:
    return VARIANTS.index(variant) if variant in VARIANTS else len(VARIANTS)


def cmd_build(a) -> None:
    from mlcc.compiler.build import compile_shape_only

    for model in a.model.split(","):
        name, quant = model.rsplit("-", 1)
        arch, cfg = MODELS[name]
        for v in a.variants.split(","):
            if v not in BUILT:
                continue
            with _variant(v):
                s = compile_shape_only(arch, cfg, "cuda", quant, Path(a.out) / v / model)
            print(f"{v} {model}: {s:.1f}s", flush=True)


def cmd_run(a) -> None:
    import numpy as np

    from mlcc.runtime.model import LoadedModel
    from mlcc.runtime.token_fetch import TokenFetcher

    libs = Path(a.libs)
    ref_file = libs / "reference.npz"
    ref = np.load(ref_file) if ref_file.exists() else None
    rows = []
    for model in sorted(p.name for p in (libs / "base").iterdir()):
        name, quant = model.rsplit("-", 1)
        loaded = {}
        built = [p.name for p in libs.iterdir() if (p / model).is_dir()]
        for v in sorted(set(built) | set(a.variants.split(",")), key=_order):
            with _variant(v):
                m = LoadedModel(libs / (v if (libs / v / model).is_dir() else "base") / model, weights="random")
            fetcher = TokenFetcher(m.dev)
            try:
                check = {"argmax_ok": check_argmax(m), "graph": check_graph_decode(m),
                         "pipelined": check_pipelined_decode(m, fetcher)}
            except Exception as e:  # noqa: BLE001 - one broken variant must not cost the call's other rows
                print(model, v, "check raised:", repr(e), flush=True)
                rows.append({"model": model, "variant": v, "error": f"check raised {e!r}: not timed"})
                continue
            if ref is not None and f"{name}/{quant}/logits" in ref:
                check.update(check_against_reference(m, ref, f"{name}/{quant}"))
            print(model, v, "check:", check, flush=True)
            if not check["argmax_ok"] or not check["graph"].get("ok", True) or not check.get("ok", True) \
                    or not check["pipelined"]["ok"]:
                rows.append({"model": model, "variant": v, "check": check, "error": "check failed: not timed"})
                continue
            m.create_kv_cache(1, 4096, 2048)
            m.add_sequence(0)
            m.prefill([0], [[7] * 128])
            loaded[v] = [m, 7, [], fetcher]
        for _ in range(a.rounds):
            for v, state in loaded.items():
                m, tok, times, fetcher = state
                if a.fixed_context:
                    m.remove_sequence(0)
                    m.add_sequence(0)
                    m.prefill([0], [[7] * 128])
                tok = decode_steps(m, tok, 4, v != "sync", fetcher)[0][-1]
                got, seconds = decode_steps(m, tok, a.steps, v != "sync", fetcher)
                times.append(a.steps / seconds)
                state[1] = got[-1]
        for v, (m, _, times, _) in loaded.items():
            rows.append({"model": model, "variant": v, "tok_s_median": statistics.median(times),
                         "tok_s_rounds": [round(x, 1) for x in times]})
            print(f"{model:24} {v:8} median {rows[-1]['tok_s_median']:8.1f} tok/s  rounds {rows[-1]['tok_s_rounds']}",
                  flush=True)
        del loaded
        import gc

        gc.collect()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "ab_decode.json").write_text(json.dumps(rows, indent=1))


def _arguments(b, r) -> None:
    b.add_argument("--model", default="llama3-8b-q4f16_1,qwen2.5-0.5b-q4f16_1,smollm2-135m-q4f16_1")
    b.add_argument("--variants", default="base")
    r.add_argument("--variants", default="base,no-graph", help="runtime variants loaded besides the built ones")
    r.add_argument("--rounds", type=int, default=6)
    r.add_argument("--steps", type=int, default=128)
    r.add_argument("--fixed-context", action="store_true")


if __name__ == "__main__":
    build_and_run(cmd_build, cmd_run, configure=_arguments)

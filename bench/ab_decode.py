"""A/B of batch-1 decode between builds of one shape: every variant loaded in one process and timed in interleaved
rounds, which cancels the drift between device runs (the step time moves by a few percent from one run to the
next, more than one kernel change is worth).

    # here: one library folder per variant (--libs DIR/VARIANT/MODEL), plus the CPU logits of the small shapes
    python bench/ab_decode.py build --out .dev/ab --model llama3-8b-q4f16_1 --variants base,no-pdl
    python bench/decode.py reference --out .dev/ab
    # device (carry .gpu-rt and .dev/ab; `source .gpu-rt/setup.sh` first, see bench/gpu.sh)
    python3 bench/ab_decode.py run --libs .dev/ab --out $OUT

A variant is a CompileOptions value: a name from VARIANTS, or fields joined by '+' (`pdl=0+decode_graph=0`).
"sync" is base's library timed with the synchronous loop (decode, argmax, read the id, repeat) instead of the
engine's pipelined loop (runtime.device.graph_decode). Any other folder under --libs holding the model is a variant
too: to compare against another commit, build there (`git worktree add /tmp/wt REV`, then
`PYTHONPATH=/tmp/wtpkg python bench/ab_decode.py build ...` with /tmp/wtpkg/mlcc linked to /tmp/wt, since
PYTHONPATH wins over the editable install) and copy its base folder in under another name. Each variant is
checked before it is timed (argmax against numpy, decode_graph against plain decode, pipelined against
synchronous ids, logits against the CPU build where --libs holds decode.py's reference.npz for the shape);
`--fixed-context` starts every round from the same 128-token prompt, so rounds differ only in time (clocks,
temperature), not in context length.
"""

from __future__ import annotations

import gc
import statistics
from pathlib import Path

from decode import (
    MODELS,
    check_against_reference,
    check_argmax,
    check_graph_decode,
    check_pipelined_decode,
    decode_steps,
)
from harness import build_info, cli, write_json

from mlcc.artifact import built_options
from mlcc.options import CompileOptions

VARIANTS = {
    "base": CompileOptions(),
    "no-pdl": CompileOptions(pdl=False),                          # no programmatic dependent launch
    "no-graph": CompileOptions(decode_graph=False),               # the VM launches every kernel of a step
    "dlight-gemv": CompileOptions(decode_gemv=False),             # dlight's GEMV rule instead of mlcc's kernels
    "no-gemv-fusion": CompileOptions(fuse_decode_gemv=False),     # RMSNorm and SwiGLU not folded into the GEMVs
    "tvm-attention": CompileOptions(split_decode_attention=False),  # TVM's paged decode attention kernel
    "splits16": CompileOptions(decode_attention_splits=16),       # every context cut into 16 chunks
    "attn-4-tokens": CompileOptions(decode_attention_tokens=4),   # 4 tokens scored per block and step
}
RUNTIME_VARIANTS = ("sync",)   # base's library, another loop


def variant_options(name: str) -> CompileOptions:
    if name in VARIANTS:
        return VARIANTS[name]
    if "=" in name:
        return CompileOptions.parse(name.split("+"))
    raise SystemExit(f"unknown variant {name!r}: one of {', '.join(VARIANTS)}, or KEY=VALUE fields joined by '+'")


def _order(variant: str) -> tuple[int, str]:
    names = list(VARIANTS) + list(RUNTIME_VARIANTS)
    return (names.index(variant) if variant in names else len(names), variant)


def cmd_build(a) -> None:
    from mlcc.compiler.build import compile_shape_only

    out = Path(a.out)
    for v in a.variants.split(","):
        if v in RUNTIME_VARIANTS:
            continue
        options = variant_options(v)
        info = {**build_info(options), "compile_s": {}}
        for model in a.model.split(","):
            name, quant = model.rsplit("-", 1)
            arch, cfg = MODELS[name]
            s = compile_shape_only(arch, cfg, "cuda", quant, out / v / model, options=options)
            info["compile_s"][model] = s
            print(f"{v} {model}: {s:.1f}s", flush=True)
        write_json(out / v, "build.json", info)


def cmd_run(a) -> None:
    import numpy as np

    from mlcc.runtime.device.model import LoadedModel
    from mlcc.runtime.device.token_fetch import TokenFetcher

    libs = Path(a.libs)
    ref_file = libs / "reference.npz"
    ref = np.load(ref_file) if ref_file.exists() else None
    rows = []
    for model in sorted(p.name for p in (libs / "base").iterdir() if p.is_dir()):
        name, quant = model.rsplit("-", 1)
        loaded = {}
        built = [p.name for p in libs.iterdir() if (p / model).is_dir()]
        for v in sorted(set(built) | set(a.variants.split(",")), key=_order):
            folder = libs / v / model if (libs / v / model).is_dir() else libs / "base" / model
            if v not in RUNTIME_VARIANTS and folder == libs / "base" / model and v != "base":
                print(model, v, "not built: skipped", flush=True)
                continue
            m = LoadedModel(folder, weights="random")
            fetcher = TokenFetcher(m.dev)
            try:
                check = {"argmax_ok": check_argmax(m), "graph": check_graph_decode(m),
                         "pipelined": check_pipelined_decode(m, fetcher)}
            except Exception as e:  # noqa: BLE001 - one broken variant must not cost the run's other rows
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
            options = built_options(m.config).to_dict()
            loaded[v] = [m, 7, [], fetcher, options]
        for _ in range(a.rounds):
            for v, state in loaded.items():
                m, tok, times, fetcher, _ = state
                if a.fixed_context:
                    m.remove_sequence(0)
                    m.add_sequence(0)
                    m.prefill([0], [[7] * 128])
                tok = decode_steps(m, tok, 4, v != "sync", fetcher)[0][-1]
                got, seconds = decode_steps(m, tok, a.steps, v != "sync", fetcher)
                times.append(a.steps / seconds)
                state[1] = got[-1]
        for v, (m, _, times, _, options) in loaded.items():
            rows.append({"model": model, "variant": v, "options": options, "tok_s_median": statistics.median(times),
                         "tok_s_rounds": [round(x, 1) for x in times]})
            print(f"{model:24} {v:16} median {rows[-1]['tok_s_median']:8.1f} tok/s  rounds "
                  f"{rows[-1]['tok_s_rounds']}", flush=True)
        del loaded
        gc.collect()
        write_json(a.out, "ab_decode.json", rows)
    write_json(a.out, "ab_decode.json", rows)


def _build_args(p) -> None:
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="llama3-8b-q4f16_1,qwen2.5-0.5b-q4f16_1,smollm2-135m-q4f16_1",
                   help="comma-separated PRESET-QUANT")
    p.add_argument("--variants", default="base", help=f"comma-separated: {', '.join(VARIANTS)} or KEY=VALUE+...")


def _run_args(p) -> None:
    p.add_argument("--libs", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default="base,sync", help="variants to time besides every folder under --libs")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--fixed-context", action="store_true")


if __name__ == "__main__":
    cli(__doc__, {"build": (cmd_build, _build_args), "run": (cmd_run, _run_args)})

"""Where a batch-1 decode step (or a prefill) spends its GPU time, kernel by kernel: torch.profiler (CUPTI) records
every CUDA kernel in the process, TVM's included; per token, each kernel's calls and time, and the GPU's idle gaps
over 2 us by the kernels around them.

    # here: the libraries (decode.py build); with PDL the profiler counts a kernel's wait for its predecessor as
    # its own busy time, so kernel times come from a build without it and idle gaps from the default build
    python bench/decode.py build --out .dev/prof-nopdl --only llama3-8b/q4f16_1 --option pdl=0
    # device (carry .gpu-rt and the libraries; `source .gpu-rt/setup.sh` first, see bench/gpu.sh)
    python3 bench/profile_decode.py --libs .dev/prof-nopdl --model llama3-8b-q4f16_1 --out $OUT
    python3 bench/profile_decode.py --libs .dev/bench --model llama3-8b-q4f16_1 --prefill 2048 --steps 3 --out $OUT
    python3 bench/profile_decode.py --libs .dev/bench --model llama3-8b-q4f16_1 --verify 5 --out $OUT

--verify K profiles a speculative verify forward of K tokens after a 1,024-token context, as runtime.spec.speculative
calls it (the logits of every position, their argmax read, the K tokens popped again).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import time
from pathlib import Path


def _folded(kernel: str) -> str:
    """A kernel's name with its numeric suffixes folded (one row per kind of kernel, not per layer)."""
    return re.sub(r"\d+", "#", re.sub(r"(_kernel)?(_\d+)?$", "", kernel))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--libs", required=True)
    p.add_argument("--model", default="llama3-8b-q4f16_1")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prefill", type=int, default=0, help="profile prefills of this many tokens instead of decode")
    p.add_argument("--verify", type=int, default=0, help="profile verify forwards of this many tokens instead")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from mlcc.artifact import built_options
    from mlcc.runtime.device.model import LoadedModel

    torch.cuda.init()
    m = LoadedModel(Path(a.libs) / a.model, weights="random")
    m.create_kv_cache(1, 4096, 2048)
    m.add_sequence(0)
    m.prefill([0], [[7] * (1024 if a.verify else 128)])
    argmax = m.argmax
    tok = 7
    for _ in range(5):
        tok = int(argmax(m.decode([0], [tok])).numpy()[0])
    prompt = [1 + i % 1000 for i in range(a.prefill)]
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(a.steps):
            if a.verify:
                argmax(m.verify([0], [[tok] * a.verify])).numpy()
                m.popn(0, a.verify)
            elif a.prefill:
                m.add_sequence(1)
                m.prefill([1], [prompt]).numpy()
                m.remove_sequence(1)
            else:
                tok = int(argmax(m.decode([0], [tok])).numpy()[0])
        wall = (time.perf_counter() - t) / a.steps * 1e3
    kernels = collections.defaultdict(lambda: [0, 0.0])
    gaps = collections.defaultdict(lambda: [0, 0.0])  # idle GPU time, by the kernel before and after it
    spans = sorted((e.time_range.start, e.time_range.end, _folded(e.name))
                   for e in prof.events() if e.device_type.name == "CUDA" and e.device_time_total > 0)
    for (_, end, before), (start, _, after) in zip(spans, spans[1:]):
        if start - end > 2:  # us
            gaps[f"{before[:28]} -> {after[:28]}"][0] += 1
            gaps[f"{before[:28]} -> {after[:28]}"][1] += (start - end) / 1e3
    gpu_total = 0.0
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            name = _folded(e.name)
            kernels[name][0] += 1
            kernels[name][1] += e.device_time_total / 1e3  # ms
            gpu_total += e.device_time_total / 1e3
    rows = sorted(((k, c / a.steps, t / a.steps) for k, (c, t) in kernels.items()), key=lambda r: -r[2])
    unit = f"prefill of {a.prefill}" if a.prefill else f"verify of {a.verify}" if a.verify else "token"
    print(f"{a.model}: wall {wall:.3f} ms/{unit}, GPU busy {gpu_total / a.steps:.3f} ms/{unit} "
          f"({gpu_total / a.steps / wall:.0%}), kernels/token {sum(r[1] for r in rows):.0f}")
    print(f"{'kernel (digits folded)':60} {'calls/tok':>9} {'ms/tok':>8}")
    for k, c, t in rows[:25]:
        print(f"{k[:60]:60} {c:9.1f} {t:8.3f}")
    gap_rows = sorted(((k, c / a.steps, t / a.steps) for k, (c, t) in gaps.items()), key=lambda r: -r[2])
    print(f"{'GPU idle > 2 us, between':60} {'count/tok':>9} {'ms/tok':>8}")
    for k, c, t in gap_rows[:10]:
        print(f"{k[:60]:60} {c:9.1f} {t:8.3f}")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"profile_{a.model}{f'_prefill{a.prefill}' if a.prefill else ''}{f'_verify{a.verify}' if a.verify else ''}.json").write_text(json.dumps(
        {"model": a.model, "options": built_options(m.config).to_dict(), "unit": unit, "wall_ms_per_token": wall,
         "gpu_busy_ms_per_token": gpu_total / a.steps,
         "kernels": [{"name": k, "calls_per_token": c, "ms_per_token": t} for k, c, t in rows],
         "idle_gaps": [{"between": k, "per_token": c, "ms_per_token": t} for k, c, t in gap_rows]}, indent=1))


if __name__ == "__main__":
    main()

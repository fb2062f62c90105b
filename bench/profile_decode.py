"""Kernel-level profile of batch-1 decode on CUDA (issue 4: where the time goes), via torch.profiler/CUPTI,
which records every CUDA kernel in the process, TVM's included.

    python3 bench/profile_decode.py --libs .dev/bench --model llama3-8b-q4f16_1 --out $OUT
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--libs", required=True)
    p.add_argument("--model", default="llama3-8b-q4f16_1")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from mlcc.runtime.model import LoadedModel

    torch.cuda.init()
    m = LoadedModel(Path(a.libs) / a.model, weights="random")
    m.create_kv_cache(1, 4096, 2048)
    m.add_sequence(0)
    m.prefill([0], [[7] * 128])
    argmax = m.vm["argmax_logits"]
    tok = 7
    for _ in range(5):
        tok = int(argmax(m.decode([0], [tok])).numpy()[0])
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(a.steps):
            tok = int(argmax(m.decode([0], [tok])).numpy()[0])
        wall = (time.perf_counter() - t) / a.steps * 1e3
    kernels = collections.defaultdict(lambda: [0, 0.0])
    gpu_total = 0.0
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            name = re.sub(r"(_kernel)?(_\d+)?$", "", e.name)
            name = re.sub(r"\d+", "#", name)
            kernels[name][0] += 1
            kernels[name][1] += e.device_time_total / 1e3  # ms
            gpu_total += e.device_time_total / 1e3
    rows = sorted(((k, c / a.steps, t / a.steps) for k, (c, t) in kernels.items()), key=lambda r: -r[2])
    print(f"{a.model}: wall {wall:.3f} ms/token, GPU busy {gpu_total / a.steps:.3f} ms/token "
          f"({gpu_total / a.steps / wall:.0%}), kernels/token {sum(r[1] for r in rows):.0f}")
    print(f"{'kernel (digits folded)':60} {'calls/tok':>9} {'ms/tok':>8}")
    for k, c, t in rows[:25]:
        print(f"{k[:60]:60} {c:9.1f} {t:8.3f}")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"profile_{a.model}.json").write_text(json.dumps(
        {"wall_ms_per_token": wall, "gpu_busy_ms_per_token": gpu_total / a.steps,
         "kernels": [{"name": k, "calls_per_token": c, "ms_per_token": t} for k, c, t in rows]}, indent=1))


if __name__ == "__main__":
    main()

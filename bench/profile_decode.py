"""Kernel-level profile of batch-1 decode on CUDA (issue 4: where the time goes), via torch.profiler/CUPTI,
which records every CUDA kernel in the process, TVM's included.

    python3 bench/profile_decode.py --libs .dev/bench --model llama3-8b-q4f16_1 --out $OUT
    python3 bench/profile_decode.py --libs .dev/bench --model llama3-8b-q4f16_1 --prefill 2048 --steps 3 --out $OUT
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
    p.add_argument("--prefill", type=int, default=0, help="profile prefills of this many tokens instead of decode")
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
    prompt = [1 + i % 1000 for i in range(a.prefill)]
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(a.steps):
            if a.prefill:
                m.add_sequence(1)
                m.prefill([1], [prompt]).numpy()
                m.remove_sequence(1)
            else:
                tok = int(argmax(m.decode([0], [tok])).numpy()[0])
        wall = (time.perf_counter() - t) / a.steps * 1e3
    kernels = collections.defaultdict(lambda: [0, 0.0])
    gaps = collections.defaultdict(lambda: [0, 0.0])  # idle GPU time, by the kernel before and after it
    spans = sorted((e.time_range.start, e.time_range.end, re.sub(r"\d+", "#", re.sub(r"(_kernel)?(_\d+)?$", "", e.name)))
                   for e in prof.events() if e.device_type.name == "CUDA" and e.device_time_total > 0)
    for (_, end, before), (start, _, after) in zip(spans, spans[1:]):
        if start - end > 2:  # us
            gaps[f"{before[:28]} -> {after[:28]}"][0] += 1
            gaps[f"{before[:28]} -> {after[:28]}"][1] += (start - end) / 1e3
    gpu_total = 0.0
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            name = re.sub(r"(_kernel)?(_\d+)?$", "", e.name)
            name = re.sub(r"\d+", "#", name)
            kernels[name][0] += 1
            kernels[name][1] += e.device_time_total / 1e3  # ms
            gpu_total += e.device_time_total / 1e3
    rows = sorted(((k, c / a.steps, t / a.steps) for k, (c, t) in kernels.items()), key=lambda r: -r[2])
    unit = f"prefill of {a.prefill}" if a.prefill else "token"
    print(f"{a.model}: wall {wall:.3f} ms/{unit}, GPU busy {gpu_total / a.steps:.3f} ms/token "
          f"({gpu_total / a.steps / wall:.0%}), kernels/token {sum(r[1] for r in rows):.0f}")
    print(f"{'kernel (digits folded)':60} {'calls/tok':>9} {'ms/tok':>8}")
    for k, c, t in rows[:25]:
        print(f"{k[:60]:60} {c:9.1f} {t:8.3f}")
    # host time per call of each piece of a step (no syncs but the last: launches are asynchronous, so a piece
    # that outruns the GPU shows only its own CPU cost)
    host = collections.defaultdict(float)
    for _ in range(0 if a.prefill else a.steps):
        t0 = time.perf_counter()
        ids = m._ids_to_dev(m._check_ids([tok]))
        t1 = time.perf_counter()
        if m._decode_graph is None:
            emb = m._reshape(m._f["embed"](ids, m.params), m._shape([1, 1, m.hidden]))
        t2 = time.perf_counter()
        m._kv_begin(m.kv, m._shape([0]), m._shape([1]))
        t3 = time.perf_counter()
        if m._decode_graph is not None:  # as LoadedModel.decode does it (the embedding inside the call)
            out = m._graph_call(0, ids)
            m._grow([0], [1])
        else:
            out = m._f["decode"](emb, m.kv, m.params)
        t4 = time.perf_counter()
        m._kv_end(m.kv)
        ids_out = argmax(m._logits(out, 1))
        t5 = time.perf_counter()
        tok = int(ids_out.numpy()[0])
        t6 = time.perf_counter()
        for k, v in (("ids to device", t1 - t0), ("embed call", t2 - t1), ("kv begin_forward", t3 - t2),
                     ("decode call (enqueue)", t4 - t3), ("end_forward + argmax call", t5 - t4),
                     ("wait for GPU + id to host", t6 - t5)):
            host[k] += v * 1e3 / a.steps
    if host:
        print("host ms per step: " + ", ".join(f"{k} {v:.3f}" for k, v in host.items()))
    gap_rows = sorted(((k, c / a.steps, t / a.steps) for k, (c, t) in gaps.items()), key=lambda r: -r[2])
    print(f"{'GPU idle > 2 us, between':60} {'count/tok':>9} {'ms/tok':>8}")
    for k, c, t in gap_rows[:10]:
        print(f"{k[:60]:60} {c:9.1f} {t:8.3f}")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"profile_{a.model}{f'_prefill{a.prefill}' if a.prefill else ''}.json").write_text(json.dumps(
        {"unit": unit, "wall_ms_per_token": wall, "gpu_busy_ms_per_token": gpu_total / a.steps,
         "kernels": [{"name": k, "calls_per_token": c, "ms_per_token": t} for k, c, t in rows],
         "host_ms_per_step": host,
         "idle_gaps": [{"between": k, "per_token": c, "ms_per_token": t} for k, c, t in gap_rows]}, indent=1))


if __name__ == "__main__":
    main()

"""Host cost of the pieces of a batch-1 decode step, decode_graph vs plain decode (issue 4: where a step's time goes
once the GPU work is one graph). No profiler attached (CUPTI slows graph launches). "ids+embed": the id to the
device, plus the embedding call for plain decode (decode_graph looks it up inside its own call).

    python3 bench/graph_launch_probe.py --libs .dev/ab2/base --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def probe(m, graph: bool, steps: int = 64) -> dict:
    from mlcc import artifact

    m.create_kv_cache(1, 4096, 2048)
    m.add_sequence(0)
    m.prefill([0], [[7] * 128])
    n = 128
    parts = {k: [] for k in ("ids+embed", "begin_forward", "aux_sync", "decode_call", "gpu_wait", "step")}
    captures = []
    for i in range(steps + 8):
        t0 = time.perf_counter()
        if graph:  # decode_graph looks the embedding up itself
            emb = m._ids_to_dev(m._check_ids([7]))
        else:
            emb = m._embed_shaped([7], [1, 1, m.hidden])
        t1 = time.perf_counter()
        m._kv_begin(m.kv, m._shape([0]), m._shape([1]))
        t2 = time.perf_counter()
        if graph:
            m._kv_sync(m.kv)
        t3 = time.perf_counter()
        layout = artifact.graph_decode_layout(n + 1, m.page_size)
        if graph:
            out = m._decode_graph(emb, m._shape([m._kv_cache_id, layout]), m.kv, m.params)
        else:
            out = m._f["decode"](emb, m.kv, m.params)
        t4 = time.perf_counter()
        m.dev.sync()
        t5 = time.perf_counter()
        m._kv_end(m.kv)
        n += 1
        new_layout = artifact.graph_decode_layout(n, m.page_size) != artifact.graph_decode_layout(n - 1, m.page_size)
        if new_layout:
            captures.append((t4 - t3) * 1e3)
        elif i >= 8:
            for k, v in (("ids+embed", t1 - t0), ("begin_forward", t2 - t1), ("aux_sync", t3 - t2),
                         ("decode_call", t4 - t3), ("gpu_wait", t5 - t4), ("step", t5 - t0)):
                parts[k].append(v * 1e3)
        del out
    m.remove_sequence(0)
    return {"median_ms": {k: round(statistics.median(v), 4) for k, v in parts.items() if v},
            "first_step_of_a_layout_ms": [round(c, 2) for c in captures]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--libs", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    from mlcc.runtime.model import LoadedModel

    rows = []
    for d in sorted(Path(a.libs).iterdir()):
        if not (d / "mlcc-config.json").exists():
            continue
        m = LoadedModel(d, weights="random")
        for graph in (True, False):
            r = {"model": d.name, "decode": "decode_graph" if graph else "decode", **probe(m, graph)}
            print(json.dumps(r), flush=True)
            rows.append(r)
        del m
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "graph_launch_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""`mlcc bench throughput`: the engine's offline throughput in this process, in trtllm-bench's style.

N requests of fixed input/output lengths (synthetic token ids; greedy; EOS ignored, so every answer has exactly
output_len tokens) go straight to the engine core, all at once or at a Poisson rate. Reported: output tok/s (and
input + output), TTFT and inter-token latency p50/p99, and the peak KV-cache use. Answers are detokenized as a
server would, so the host's per-token work is in the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import threading
import time
from typing import Any

import numpy as np

from mlcc.options import EngineConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Trace:
    submitted: float = 0.0
    token_times: list[float] = dataclasses.field(default_factory=list)
    tokens: int = 0
    error: str = ""


def synthetic_prompts(vocab: int, num_requests: int, input_len: int, seed: int = 0) -> list[list[int]]:
    """Random token ids below the vocabulary's top 1% (where special tokens usually sit), one prompt a request; no
    two share a first token, so no prefix is cached between them."""
    rng = np.random.default_rng(seed)
    hi = max(vocab - vocab // 100, 2)
    prompts = rng.integers(1, hi, size=(num_requests, input_len)).tolist()
    for i, p in enumerate(prompts):
        p[0] = 1 + i % (hi - 1)
    return prompts


def _pct(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64) * 1e3
    if a.size == 0:
        return {"p50": 0.0, "p99": 0.0}
    return {"p50": round(float(np.percentile(a, 50)), 2), "p99": round(float(np.percentile(a, 99)), 2)}


def run_requests(engine: Any, prompts: list[list[int]], output_len: int, request_rate: float | None = None,
                 seed: int = 0, detokenize: bool = True) -> dict[str, Any]:
    """Submits `prompts` to engine.core (all at once, or with exponential gaps at `request_rate` per second) and
    waits for every answer; the row of measurements."""
    from mlcc.runtime.core.request import Request
    from mlcc.runtime.core.sampler import SamplingParams

    core = engine.core
    traces = [_Trace() for _ in prompts]
    done = threading.Semaphore(0)

    def sink(trace: _Trace, ev) -> None:
        if ev.kind == "delta":
            trace.token_times.append(time.perf_counter())
        elif ev.kind == "finish":
            trace.tokens = ev.completion_tokens
            done.release()
        elif ev.kind == "error":
            trace.error = str(ev.error)
            done.release()

    peak = [0]
    stop = threading.Event()

    def watch_kv() -> None:   # sampled: asking per token would cost a device call each
        while not stop.wait(0.02):
            peak[0] = max(peak[0], core.pages_in_use())

    watcher = threading.Thread(target=watch_kv, name="mlcc-kv-watch", daemon=True)
    params = SamplingParams(temperature=0, ignore_eos=True)
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / request_rate, len(prompts)) if request_rate else np.zeros(len(prompts))
    watcher.start()
    t0 = time.perf_counter()
    for trace, prompt, gap in zip(traces, prompts, gaps):
        if gap:
            time.sleep(gap)
        decoder = engine.tokenizer.stream(skip_special_tokens=True) if detokenize else None
        trace.submitted = time.perf_counter()
        core.submit(Request(prompt, params, output_len, lambda ev, t=trace: sink(t, ev), decoder,
                            engine.tokenizer.eos_ids))
    for _ in prompts:
        done.acquire()
    wall = time.perf_counter() - t0
    stop.set()
    watcher.join()
    errors = [t.error for t in traces if t.error]
    out_tokens = sum(t.tokens for t in traces)
    in_tokens = sum(len(p) for p in prompts)
    ttft = [t.token_times[0] - t.submitted for t in traces if t.token_times]
    itl = [b - a for t in traces for a, b in zip(t.token_times, t.token_times[1:])]
    return {"requests": len(prompts), "errors": len(errors), "error_samples": errors[:3],
            "output_tokens": out_tokens, "wall_s": round(wall, 3),
            "output_tok_s": round(out_tokens / wall, 1), "total_tok_s": round((in_tokens + out_tokens) / wall, 1),
            "request_per_s": round(len(prompts) / wall, 3), "ttft_ms": _pct(ttft), "itl_ms": _pct(itl),
            "peak_kv_tokens": peak[0] * core.page_size, "kv_capacity_tokens": core.total_pages * core.page_size}


def run_throughput(engine: Any, input_len: int, output_len: int, num_requests: int,
                   request_rate: float | None = None, seed: int = 0, warmup: int = 2) -> dict[str, Any]:
    """A warm-up of `warmup` short requests (kernel loading, graph capture), then the measured run."""
    cfg: EngineConfig = engine.config
    need = input_len + output_len
    if need > cfg.context_window:
        raise ValueError(f"input_len + output_len = {need} exceeds the context window ({cfg.context_window}); "
                         "lower them or raise --context-window")
    if warmup:
        run_requests(engine, synthetic_prompts(engine.model.vocab, warmup, min(input_len, 16), seed + 1), 4)
    row = run_requests(engine, synthetic_prompts(engine.model.vocab, num_requests, input_len, seed),
                       output_len, request_rate, seed)
    return {"bench": "throughput", "input_len": input_len, "output_len": output_len, "max_batch": cfg.max_batch,
            "request_rate": request_rate, **row}


def add_throughput_parser(sub) -> None:
    t = sub.add_parser("throughput", help="the engine's offline throughput in this process (trtllm-bench style)")
    EngineConfig.add_cli_arguments(t, max_batch=256)
    t.add_argument("--input-len", type=int, default=128, help="prompt tokens a request (default: %(default)s)")
    t.add_argument("--output-len", type=int, default=128, help="answer tokens a request (default: %(default)s)")
    t.add_argument("--num-requests", type=int, default=512, help="(default: %(default)s)")
    t.add_argument("--request-rate", type=float, default=None,
                   help="requests a second, Poisson arrivals (default: all at once)")
    t.add_argument("--weights", choices=("files", "random"), default="files",
                   help="random: a shape-only build's random weights (speed only; default: %(default)s)")
    t.add_argument("--seed", type=int, default=0, help="of the synthetic prompts and arrivals (default: 0)")
    t.add_argument("--json", default=None, help="append the result row to this JSON file (a list of rows)")
    t.set_defaults(func=run_throughput_cli)


def run_throughput_cli(args: argparse.Namespace) -> int:
    from mlcc.runtime.engine import Engine

    config = dataclasses.replace(EngineConfig.from_cli(args), weights=args.weights)
    with Engine(args.model, config=config) as engine:
        row = run_throughput(engine, args.input_len, args.output_len, args.num_requests, args.request_rate,
                             args.seed)
        row.update(model=engine.model_name, quant=engine.model.config.get("quantization"),
                   target=engine.model.config.get("target"))
    print(f"{row['requests']} requests {args.input_len}/{args.output_len}, max batch {row['max_batch']}: "
          f"{row['output_tok_s']:.0f} output tok/s ({row['total_tok_s']:.0f} in+out), "
          f"TTFT p50/p99 {row['ttft_ms']['p50']:.0f}/{row['ttft_ms']['p99']:.0f} ms, "
          f"ITL p50/p99 {row['itl_ms']['p50']:.1f}/{row['itl_ms']['p99']:.1f} ms, "
          f"peak KV {row['peak_kv_tokens']}/{row['kv_capacity_tokens']} tokens, {row['errors']} errors")
    if args.json:
        from pathlib import Path

        path = Path(args.json)
        rows = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps([*rows, row], indent=1))
    return 1 if row["errors"] else 0

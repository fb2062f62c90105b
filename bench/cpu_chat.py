"""CPU numbers for the embedded default (issue 3): time to first answer cold/warm, decode tok/s, peak RSS.

    python bench/cpu_chat.py            # writes bench/results/cpu_chat.json

Cold = empty JIT cache (GGUF → compile → weights → load → answer); warm = cached artifacts. Each is a fresh
`mlcc chat --prompt` process, timed from the outside; decode speed is measured in-process over 128 tokens.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "What is the capital of France?"


def timed_chat(cache: str) -> tuple[float, str, float]:
    env = {**os.environ, "MLCC_CACHE_DIR": cache}
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "mlcc", "chat", "--prompt", PROMPT], capture_output=True, text=True,
                       env=env, check=True)
    dt = time.perf_counter() - t
    rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return dt, r.stdout.strip(), rss_mb


def decode_speed(cache: str) -> dict:
    os.environ["MLCC_CACHE_DIR"] = cache
    from mlcc.runtime.engine import Engine

    with Engine(target="llvm", max_batch=1) as e:
        msgs = [{"role": "user", "content": "Write a long story about a dragon."}]
        e.chat.completions.create(messages=msgs, max_tokens=4, temperature=0)  # warm-up
        t = time.perf_counter()
        first = None
        n = 0
        for c in e.chat.completions.create(messages=msgs, max_tokens=128, temperature=0, ignore_eos=True,
                                           stream=True, stream_options={"include_usage": True}):
            if first is None and c.choices and c.choices[0].delta.content:
                first = time.perf_counter()
            if c.usage:
                n = c.usage.completion_tokens
        end = time.perf_counter()
    return {"ttft_s": first - t, "decode_tok_s": (n - 1) / (end - first), "tokens": n}


def main() -> None:
    cache = tempfile.mkdtemp(prefix="mlcc-cache-")
    cold_s, answer, rss_cold = timed_chat(cache)
    warm_s, answer2, _ = timed_chat(cache)
    speed = decode_speed(cache)
    out = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
           "cold_first_answer_s": round(cold_s, 1), "warm_first_answer_s": round(warm_s, 1), "answer": answer,
           "answer_warm": answer2, "peak_rss_mb_children": round(rss_cold), **{k: round(v, 2) for k, v in speed.items()}}
    print(json.dumps(out, indent=1))
    res = Path(__file__).parent / "results"
    res.mkdir(exist_ok=True)
    (res / "cpu_chat.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

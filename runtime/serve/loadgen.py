"""`mlcc bench serve`: load generator for any OpenAI-compatible endpoint (ours or another).

Fixed or uniform input/output lengths, optionally a fraction of each prompt shared by all requests (a common system
prompt: what a prefix cache reuses), open-loop Poisson request-rate sweep or fixed concurrency, streaming; reports
TTFT and inter-token latency p50/p90/p99, output tok/s and errors as a table and JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import time
from typing import Any

import numpy as np

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact").split()


@dataclasses.dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    itls: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    latency: float = 0.0
    error: str = ""


def wait_until_healthy(base: str, proc=None, timeout: float = 300.0) -> None:
    """Poll GET {base}/health until it answers 200; fail early if the server process `proc` has exited."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before becoming healthy")
        time.sleep(0.2)
    raise TimeoutError(f"{base} did not become healthy within {timeout:.0f}s")


def parse_len(spec: str) -> tuple[int, int]:
    """'128' → fixed; 'uniform:64:256' → range."""
    if spec.startswith("uniform:"):
        _, a, b = spec.split(":")
        return int(a), int(b)
    return int(spec), int(spec)


def make_prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


async def one_request(client, model: str, prompt: str, max_tokens: int, timeout: float) -> Result:
    t0 = time.perf_counter()
    r = Result(ok=False)
    last = None
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}, timeout=timeout)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                if last is None:
                    r.ttft = now - t0
                else:
                    r.itls.append(now - last)
                last = now
            if chunk.usage:
                r.output_tokens = chunk.usage.completion_tokens
                r.prompt_tokens = chunk.usage.prompt_tokens
        r.latency = time.perf_counter() - t0
        if last is None and r.output_tokens:  # tokens that decode to no text (partial UTF-8) still count
            r.ttft = r.latency
        r.ok = last is not None or r.output_tokens > 0
        if not r.ok:
            r.error = "no tokens"
    except Exception as e:  # noqa: BLE001 - every failure is a data point
        r.error = f"{type(e).__name__}: {e}"[:200]
    return r


async def run_load(base_url: str, model: str | None, api_key: str, num_prompts: int, input_len: str,
                   output_len: str, rate: float | None, concurrency: int | None, seed: int = 0,
                   timeout: float = 600.0, shared_prefix: float = 0.0) -> dict[str, Any]:
    """shared_prefix: the fraction of each prompt's words that are the same words, in the same order, for all."""
    import openai

    # closed before the caller's event loop ends: its connections cannot be closed after that
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        return await _run_load(client, model, num_prompts, input_len, output_len, rate, concurrency, seed, timeout,
                               shared_prefix)


async def _run_load(client, model: str | None, num_prompts: int, input_len: str, output_len: str, rate: float | None,
                    concurrency: int | None, seed: int, timeout: float, shared_prefix: float) -> dict[str, Any]:
    if model is None:
        model = (await client.models.list()).data[0].id
    rng = random.Random(seed)
    (ia, ib), (oa, ob) = parse_len(input_len), parse_len(output_len)
    common = make_prompt(rng, ib).split()
    jobs = []
    for _ in range(num_prompts):
        n = rng.randint(ia, ib)
        k = round(n * shared_prefix)
        jobs.append((" ".join(common[:k] + [make_prompt(rng, n - k)] if n > k else common[:k]), rng.randint(oa, ob)))
    sem = asyncio.Semaphore(concurrency) if concurrency else None

    async def guarded(p: str, m: int) -> Result:
        if sem is None:
            return await one_request(client, model, p, m, timeout)
        async with sem:
            return await one_request(client, model, p, m, timeout)

    t0 = time.perf_counter()
    tasks = []
    for p, m in jobs:
        tasks.append(asyncio.create_task(guarded(p, m)))
        if rate:  # open loop: Poisson arrivals, independent of completions
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    return summarize(results, wall, {"rate": rate, "concurrency": concurrency, "input_len": input_len,
                                     "output_len": output_len, "num_prompts": num_prompts, "model": model,
                                     "shared_prefix": shared_prefix})


def summarize(results: list[Result], wall: float, setup: dict[str, Any]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = np.array([r.ttft for r in ok]) if ok else np.zeros(1)
    itl = np.array([x for r in ok for x in r.itls]) if any(r.itls for r in ok) else np.zeros(1)
    out_tokens = sum(r.output_tokens for r in ok)

    def pct(a: np.ndarray) -> dict[str, float]:
        return {f"p{p}": round(float(np.percentile(a, p)) * 1000, 2) for p in (50, 90, 99)}

    return {**setup, "requests": len(results), "errors": len(results) - len(ok),
            "error_samples": sorted({r.error for r in results if not r.ok})[:3], "wall_s": round(wall, 2),
            "output_tok_s": round(out_tokens / wall, 1), "request_per_s": round(len(ok) / wall, 2),
            "ttft_ms": pct(ttft), "itl_ms": pct(itl), "output_tokens": out_tokens}


def print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'rate':>6} {'conc':>5} {'reqs':>5} {'err':>4} {'out tok/s':>10} {'TTFT p50/p90/p99 ms':>24} " \
           f"{'ITL p50/p90/p99 ms':>24}"
    print(head)
    for r in rows:
        t, i = r["ttft_ms"], r["itl_ms"]
        print(f"{str(r['rate'] or '-'):>6} {str(r['concurrency'] or '-'):>5} {r['requests']:>5} {r['errors']:>4} "
              f"{r['output_tok_s']:>10} {t['p50']:>8}/{t['p90']}/{t['p99']:<8} {i['p50']:>8}/{i['p90']}/{i['p99']}")
        for e in r["error_samples"]:
            print(f"    error: {e}")


def add_bench_parser(sub) -> None:
    """`mlcc bench serve` (this load generator, over HTTP) and `mlcc bench throughput` (the engine in-process)."""
    from mlcc.runtime.serve.throughput import add_throughput_parser

    modes = sub.add_parser("bench", help="benchmarks: `serve` load-tests an OpenAI-compatible endpoint, "
                                         "`throughput` runs the engine in this process").add_subparsers(
        dest="bench_mode", required=True)
    b = modes.add_parser("serve", help="load-test an OpenAI-compatible endpoint (TTFT/ITL percentiles, tok/s)")
    b.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the endpoint's OpenAI API root")
    b.add_argument("--model", default=None, help="model name (default: the endpoint's first model)")
    b.add_argument("--api-key", default="none", help="sent as 'Authorization: Bearer KEY'")
    b.add_argument("--num-prompts", type=int, default=32, help="requests sent per request rate")
    b.add_argument("--input-len", default="128", help="words per prompt: N or uniform:A:B")
    b.add_argument("--output-len", default="64", help="tokens per answer: N or uniform:A:B")
    b.add_argument("--request-rate", default=None, help="comma-separated req/s for an open-loop sweep")
    b.add_argument("--concurrency", type=int, default=None,
                   help="fixed number of requests in flight (default: 8 where no --request-rate is given)")
    b.add_argument("--shared-prefix", type=float, default=0.0, metavar="F",
                   help="fraction of each prompt that is the same for all requests (default: %(default)s)")
    b.add_argument("--json", default=None, help="write the results here")
    b.set_defaults(func=run_bench)
    add_throughput_parser(modes)


def run_bench(args: argparse.Namespace) -> int:
    rates = [float(x) for x in args.request_rate.split(",")] if args.request_rate else [None]
    if rates == [None] and not args.concurrency:
        args.concurrency = 8
    rows = [asyncio.run(run_load(args.base_url, args.model, args.api_key, args.num_prompts, args.input_len,
                                 args.output_len, rate, args.concurrency, shared_prefix=args.shared_prefix))
            for rate in rates]
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any(r["errors"] for r in rows) else 0

"""Automatic prefix caching (runtime.core.prefix_cache): time to first token with a shared prefix, cache on vs off.

    python bench/prefix_cache.py cpu --out /tmp/prefix-cache            # this CPU, the bundled SmolLM2
    python3 bench/prefix_cache.py load --model DIR --weights random --target cuda --out $OUT   # device: 8B shape

cpu: the bundled SmolLM2-135M (real weights, llvm) with a ~1,200-token system prompt.
  1. TTFT of a request whose system prompt is cached (an earlier request with another question read it) against a
     cold one (cache emptied first), --repeats pairs, medians; and the same second request with the cache off.
  2. A 10-turn chat on that system prompt (32-token answers fed back as assistant messages): TTFT per turn, with
     the cache and without.
load: the serving load in one process on any artifacts folder, a shape-only build included (`bench/decode.py
  build`; token ids, no tokenizer: --weights random): --requests prompts of --prompt-len tokens whose first
  --shared fraction is the same for all, Poisson arrivals at --rate (0: all at once), --output-len tokens each (EOS
  ignored), greedy; the same prompts and arrival times with the prefix cache on and off, one engine after the
  other: output tok/s, TTFT p50/p99, the cache's token hit rate.
Each writes prefix_cache_<cmd>.json to --out with the 1-minute load average before and after (timings on a busy
machine are noisy).
"""

from __future__ import annotations

import os
import random
import statistics
import threading
import time

import numpy as np
from harness import build_info, cli, write_json

SYSTEM_WORDS = ("You are a careful assistant for a hardware store. Answer briefly, cite the aisle, never invent "
                "stock levels, and ask one question when a request is ambiguous.").split()


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _ttft(engine, messages: list[dict], max_tokens: int = 8) -> tuple[float, str, int]:
    """Seconds to the first streamed content, the whole answer, and the prompt tokens served from the cache."""
    t0 = time.perf_counter()
    first, text, cached = None, "", 0
    for c in engine.chat.completions.create(messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True}):
        if c.choices and c.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            text += c.choices[0].delta.content
        if c.usage:
            cached = c.usage.prompt_tokens_details.cached_tokens
    return (first or time.perf_counter() - t0), text, cached


def _system_prompt(engine, tokens: int) -> str:
    words, text = [], ""
    while len(engine.tokenizer.encode(text)) < tokens:
        words += SYSTEM_WORDS
        text = " ".join(words)
    return text


def cmd_cpu(a) -> None:
    from mlcc import Engine

    res: dict = {"build": build_info(), "load_before": _load(), "system_tokens": a.system_tokens}
    with Engine(target="llvm", max_batch=2, kv_cache_tokens=8192) as warm, \
            Engine(target="llvm", max_batch=2, kv_cache_tokens=8192, prefix_cache=False) as off:
        system = {"role": "system", "content": _system_prompt(warm, a.system_tokens)}
        ask = [[system, {"role": "user", "content": f"Where do I find item number {i}?"}] for i in range(2 * a.repeats)]
        res["prompt_tokens"] = len(warm.encode_chat(ask[0]))
        _ttft(warm, ask[0][1:])   # warm-up: the first call builds what each kernel needs
        cold, second, second_off = [], [], []
        for i in range(a.repeats):
            warm.core.prefix_cache.clear()   # idle between calls: nothing else touches the cache
            t, _, cached = _ttft(warm, ask[2 * i])
            assert cached == 0
            cold.append(t)
            t, _, cached = _ttft(warm, ask[2 * i + 1])
            second.append(t)
            res["second_cached_tokens"] = cached
            second_off.append(_ttft(off, ask[2 * i + 1])[0])
        res["ttft_s"] = {"cold": statistics.median(cold), "second": statistics.median(second),
                         "second_cache_off": statistics.median(second_off), "all_cold": cold, "all_second": second}
        res["speedup"] = res["ttft_s"]["cold"] / res["ttft_s"]["second"]
        print(f"TTFT cold {res['ttft_s']['cold'] * 1e3:.0f} ms, second {res['ttft_s']['second'] * 1e3:.0f} ms "
              f"({res['speedup']:.1f}x; {res['second_cached_tokens']} of {res['prompt_tokens']} tokens cached), "
              f"second with the cache off {res['ttft_s']['second_cache_off'] * 1e3:.0f} ms", flush=True)
        warm.core.prefix_cache.clear()
        res["chat"] = {}
        for name, engine in (("cache_on", warm), ("cache_off", off)):
            messages, turns = [system], []
            for turn in range(a.turns):
                messages.append({"role": "user", "content": f"Turn {turn}: is item {turn * 7} in stock?"})
                t, answer, cached = _ttft(engine, messages, a.answer_tokens)
                turns.append({"turn": turn + 1, "ttft_s": round(t, 4),
                              "prompt_tokens": len(engine.encode_chat(messages)),
                              "cached_tokens": cached})
                messages.append({"role": "assistant", "content": answer})
            res["chat"][name] = turns
            print(name, " ".join(f"{x['ttft_s'] * 1e3:.0f}" for x in turns), "ms per turn", flush=True)
    res["load_after"] = _load()
    print(write_json(a.out, "prefix_cache_cpu.json", res))


def _run_load(core, prompts: list[list[int]], gaps: list[float], output_len: int) -> dict:
    from mlcc.runtime.core.request import Request
    from mlcc.runtime.core.sampler import SamplingParams

    done = threading.Semaphore(0)
    first: dict[int, float] = {}
    start: dict[int, float] = {}
    tokens = [0]

    def sink(i: int, ev) -> None:
        if ev.kind == "delta":
            first.setdefault(i, time.perf_counter())
        elif ev.kind == "finish":
            tokens[0] += ev.completion_tokens
            done.release()
        elif ev.kind == "error":
            raise SystemExit(f"request {i} failed: {ev.error}")

    params = SamplingParams(temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, (p, gap) in enumerate(zip(prompts, gaps)):
        time.sleep(gap)
        start[i] = time.perf_counter()
        core.submit(Request(p, params, output_len, lambda ev, i=i: sink(i, ev), None, set()))
    for _ in prompts:
        done.acquire()
    wall = time.perf_counter() - t0
    ttft = np.array([first[i] - start[i] for i in start]) * 1e3
    cache = core.prefix_cache
    return {"output_tok_s": round(tokens[0] / wall, 1), "wall_s": round(wall, 2),
            "ttft_ms": {f"p{q}": round(float(np.percentile(ttft, q)), 1) for q in (50, 90, 99)},
            "token_hit_rate": round(cache.hit_rate(), 3) if cache else 0.0,
            "prefill_tokens": core.stats["prefill_tokens"], "preempted": core.stats["preempted"]}


def cmd_load(a) -> None:
    from mlcc.runtime.core.sampler import Sampler
    from mlcc.runtime.device.model import LoadedModel
    from mlcc.options import EngineConfig
    from mlcc.runtime.engine_core import EngineCore

    rng = random.Random(0)
    model = LoadedModel(a.model, weights=a.weights)
    vocab = model.vocab
    shared = [rng.randrange(vocab) for _ in range(int(a.prompt_len * a.shared))]
    prompts = [shared + [rng.randrange(vocab) for _ in range(a.prompt_len - len(shared))] for _ in range(a.requests)]
    gaps = [rng.expovariate(a.rate) if a.rate else 0.0 for _ in prompts]
    kv_tokens = a.kv_tokens or a.max_batch * (a.prompt_len + a.output_len + 16)
    res: dict = {"build": build_info(), "model": a.model, "weights": a.weights, "requests": a.requests,
                 "prompt_len": a.prompt_len, "shared": a.shared, "output_len": a.output_len, "rate": a.rate,
                 "max_batch": a.max_batch, "kv_tokens": kv_tokens, "policy": a.policy, "load_before": _load()}
    for name, on in (("cache_on", True), ("cache_off", False)):
        config = EngineConfig(max_batch=a.max_batch, kv_cache_tokens=kv_tokens, prefill_chunk=a.prefill_chunk,
                              policy=a.policy, prefix_cache=on)
        core = EngineCore(model, Sampler.for_model(model), config)
        try:
            _run_load(core, [prompts[0]], [0.0], 4)   # warm-up (and, with the cache, the shared prefix cached)
            core.stats.clear()
            res[name] = _run_load(core, prompts, gaps, a.output_len)
        finally:
            core.shutdown()
        r = res[name]
        print(f"{name}: {r['output_tok_s']} tok/s, TTFT p50 {r['ttft_ms']['p50']} ms p99 {r['ttft_ms']['p99']} ms, "
              f"hit rate {r['token_hit_rate']}", flush=True)
    res["throughput_ratio"] = round(res["cache_on"]["output_tok_s"] / res["cache_off"]["output_tok_s"], 2)
    res["load_after"] = _load()
    print(write_json(a.out, "prefix_cache_load.json", res))


def _cpu_args(p) -> None:
    p.add_argument("--system-tokens", type=int, default=1200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--out", required=True)


def _load_args(p) -> None:
    p.add_argument("--model", required=True, help="artifacts folder (a shape-only build with --weights random)")
    p.add_argument("--weights", default="files", choices=["files", "random"])
    p.add_argument("--target", default="cuda", help="(the folder's own target is used; kept for symmetry)")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--shared", type=float, default=0.9, help="fraction of each prompt shared by all requests")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rate", type=float, default=0.0, help="requests/s, Poisson; 0: all at once")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--kv-tokens", type=int, default=None, help="default: max batch x (prompt + output)")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--policy", default="no_evict", choices=["no_evict", "max_util"])
    p.add_argument("--out", required=True)


if __name__ == "__main__":
    cli(__doc__, {"cpu": (cmd_cpu, _cpu_args), "load": (cmd_load, _load_args)})
